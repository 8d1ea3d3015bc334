#!/usr/bin/env python3
"""Splits the tests of a GoogleTest binary into N shards of about equal time.

    BINARY --gtest_filter=F --gtest_list_tests | scripts/gtest_plan.py N [TIMES]

prints N lines, line i the test names of shard i joined by ':' (a --gtest_filter value; an empty
line where there are more shards than tests). TIMES is a file of earlier durations, one
"<ms> <full test name>" a line (scripts/gtest-times.txt, written from a run's log with
--times-from LOG); a test it does not list counts as the median of those it does. Shards are
filled longest test first, each test going to the shard with the least time so far (LPT).

GoogleTest's own sharding (GTEST_TOTAL_SHARDS) deals the tests out by their index, whatever they
cost: the CUDA suite's tests take 0.1 to 46 s (their CPU references), and its 8 shards held
53 to 231 s of tests on an H100 (this plan: 120 s each).

    scripts/gtest_plan.py --times-from gtest.log > scripts/gtest-times.txt
"""

import re
import statistics
import sys
from typing import Dict, List


def parse_list(text: str) -> List[str]:
    """Full test names from --gtest_list_tests output."""
    names, suite = [], None
    for line in text.splitlines():
        if not line.strip():
            continue
        if not line.startswith(" "):
            head = line.split("#")[0].strip()  # "Suite." (typed suites add a comment)
            suite = head if head.endswith(".") else None  # not e.g. gtest_main's banner
        elif suite is not None:
            names.append(suite + line.split("#")[0].strip())
    return names


def read_times(path: str) -> Dict[str, float]:
    times = {}
    with open(path) as f:
        for line in f:
            parts = line.split()
            if len(parts) == 2:
                times[parts[1]] = float(parts[0])
    return times


def times_from_log(path: str) -> Dict[str, float]:
    """Durations of the tests a GoogleTest log shows as OK, FAILED or SKIPPED."""
    pat = re.compile(r"^\[\s+(?:OK|FAILED|SKIPPED)\s+\] (\S+) \((\d+) ms\)$")
    times = {}
    with open(path, errors="replace") as f:
        for line in f:
            m = pat.match(line.rstrip())
            if m:
                times[m.group(1)] = float(m.group(2))
    return times


def plan(names: List[str], n: int, times: Dict[str, float]) -> List[List[str]]:
    known = [times[t] for t in names if t in times]
    default = statistics.median(known) if known else 1.0
    cost = {t: times.get(t, default) for t in names}
    order = sorted(names, key=lambda t: -cost[t])  # stable: ties keep the listing's order
    shards: List[List[str]] = [[] for _ in range(n)]
    load = [0.0] * n
    for t in order:
        i = min(range(n), key=lambda j: (load[j], j))
        shards[i].append(t)
        load[i] += cost[t]
    return shards


def main(argv: List[str]) -> int:
    if len(argv) == 2 and argv[0] == "--times-from":
        for name, ms in sorted(times_from_log(argv[1]).items(), key=lambda x: (-x[1], x[0])):
            print(f"{ms:.0f} {name}")
        return 0
    if not argv or not argv[0].isdigit() or int(argv[0]) < 1 or len(argv) > 2:
        print(__doc__, file=sys.stderr)
        return 2
    times = read_times(argv[1]) if len(argv) == 2 else {}
    for shard in plan(parse_list(sys.stdin.read()), int(argv[0]), times):
        print(":".join(shard))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
