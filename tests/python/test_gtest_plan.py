"""scripts/gtest_plan.py and scripts/gtest_shards.sh: the GPU machine's test shards are planned
from earlier durations, every selected test runs exactly once, and the summary counts them."""

import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))
import gtest_plan as gp  # noqa: E402

LISTING = """Running main() from ./googletest/src/gtest_main.cc
Cuda.
  Small
  Big
Shapes/CudaVsCpu.
  Select/G4_D128  # GetParam() = 48-byte object <...>
  Select/Paper  # GetParam() = 48-byte object <...>
"""


def test_parse_list_full_names():
    assert gp.parse_list(LISTING) == ["Cuda.Small", "Cuda.Big", "Shapes/CudaVsCpu.Select/G4_D128",
                                      "Shapes/CudaVsCpu.Select/Paper"]


def test_plan_longest_first_onto_the_least_loaded_shard():
    names = ["a.1", "a.2", "a.3", "a.4", "a.5"]
    times = {"a.1": 10, "a.2": 7, "a.3": 6, "a.4": 4, "a.5": 3}
    shards = gp.plan(names, 2, times)
    assert sorted(sum(shards, [])) == names  # each test exactly once
    loads = sorted(sum(times[t] for t in s) for s in shards)
    assert loads == [14, 16]  # LPT: 10+4 | 7+6+3
    # GoogleTest's index sharding would give 10+6+3 | 7+4 = 19 | 11


def test_plan_unknown_tests_cost_the_median_and_extra_shards_stay_empty():
    shards = gp.plan(["x.new", "x.a", "x.b"], 5, {"x.a": 1, "x.b": 9})
    assert sorted(sum(shards, [])) == ["x.a", "x.b", "x.new"]
    assert sum(1 for s in shards if not s) == 2
    assert shards[0] == ["x.b"] and shards[1] == ["x.new"]  # x.new counts as 5: after 9, before 1


def test_times_from_log(tmp_path):
    log = tmp_path / "g.log"
    log.write_text("[       OK ] Cuda.Big (1200 ms)\n[  SKIPPED ] Cuda.Small (3 ms)\n"
                   "[  FAILED  ] Shapes/CudaVsCpu.Select/Paper (45 ms)\n[ RUN      ] Cuda.Other\n"
                   "[  FAILED  ] 1 test, listed below:\n")
    assert gp.times_from_log(str(log)) == {"Cuda.Big": 1200.0, "Cuda.Small": 3.0,
                                           "Shapes/CudaVsCpu.Select/Paper": 45.0}


FAKE_GTEST = r"""#!/usr/bin/env python3
# A GoogleTest-like binary: lists its tests, runs those its --gtest_filter names (exact names,
# ':'-separated, '*' alone for all), and records each run in $RUNS_FILE.
import os, sys
tests = ["Cuda.Small", "Cuda.Big", "Cuda.Fails", "Other.One"]
filt = "*"
for a in sys.argv[1:]:
    if a.startswith("--gtest_filter="):
        filt = a.split("=", 1)[1]
chosen = tests if filt == "*" else [t for t in tests if t in filt.split(":") or
                                    (filt.endswith("*") and t.startswith(filt[:-1]))]
if "--gtest_list_tests" in sys.argv:
    print("Running main() from fake")
    suites = {}
    for t in chosen:
        suites.setdefault(t.split(".")[0], []).append(t.split(".")[1])
    for s, names in suites.items():
        print(s + ".")
        for n in names:
            print("  " + n)
    sys.exit(0)
failed = []
with open(os.environ["RUNS_FILE"], "a") as f:
    for t in chosen:
        f.write(t + "\n")
        if t == "Cuda.Fails":
            print(f"[  FAILED  ] {t} (1 ms)")
            failed.append(t)
        else:
            print(f"[       OK ] {t} (1 ms)")
print(f"[  PASSED  ] {len(chosen) - len(failed)} tests.")
if failed:
    print(f"[  FAILED  ] {len(failed)} test, listed below:")
    for t in failed:
        print(f"[  FAILED  ] {t}")
sys.exit(1 if failed else 0)
"""


@pytest.mark.skipif(os.name != "posix", reason="bash script")
@pytest.mark.parametrize("shards", [1, 3, 6])
def test_shards_run_each_selected_test_once(tmp_path, shards):
    fake = tmp_path / "fake_gtest"
    fake.write_text(FAKE_GTEST)
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    runs = tmp_path / "runs.txt"
    times = tmp_path / "times.txt"
    times.write_text("500 Cuda.Big\n1 Cuda.Small\n2 Cuda.Fails\n")
    env = dict(os.environ, RUNS_FILE=str(runs), GTEST_TIMES=str(times))
    r = subprocess.run(["bash", str(ROOT / "scripts" / "gtest_shards.sh"), str(shards), str(fake),
                        "--gtest_color=no", "--gtest_filter=Cuda*"],
                       env=env, capture_output=True, text=True, timeout=60)
    assert sorted(runs.read_text().split()) == ["Cuda.Big", "Cuda.Fails", "Cuda.Small"]
    assert r.returncode == 1  # a shard's failure is the script's
    assert "[  PASSED  ] 2 tests." in r.stdout
    assert "[  FAILED  ] 1 tests, listed below:" in r.stdout
    assert "[  FAILED  ] Cuda.Fails" in r.stdout
