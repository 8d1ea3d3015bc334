"""examples/train_retrieval.py in its small CPU configuration: it trains the three models (dense,
MSA with a warmup phase, MSA sparse from the start), writes its report and the trained model's
selections."""

import csv
import importlib.util
import math
import os

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
SCRIPT = os.path.join(HERE, "..", "..", "examples", "train_retrieval.py")


def test_train_retrieval_tiny(tmp_path):
    spec = importlib.util.spec_from_file_location("train_retrieval", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    prefix = str(tmp_path / "tiny")
    assert mod.main(["--tiny", "--out", prefix]) == 0
    rows = list(csv.DictReader(open(prefix + ".csv")))
    assert {r["model"] for r in rows} == {"dense", "warmup", "sparse"}
    for r in rows:
        for key in ("loss", "acc", "step_ms"):
            assert math.isfinite(float(r[key])), (r["model"], key)
        if r["model"] != "dense":
            assert 0.0 < float(r["recall_mass"]) <= 1.0 + 1e-6
            assert 0.0 <= float(r["recall_answer"]) <= 1.0
            assert float(r["kl"]) > 0.0
    # the warmup model trains dense first, then sparse
    modes = [r["mode"] for r in rows if r["model"] == "warmup"]
    assert modes[0] == "warmup" and modes[-1] == "sparse"
    sel = torch.load(prefix + "_block_idx.pt")
    assert sel["block_size"] == 8 and set(sel["block_idx"]) == {"layer0", "layer1"}
    bi = sel["block_idx"]["layer0"]
    assert bi.shape == (96, 2, 4) and bi.dtype == torch.int32
    assert os.path.getsize(prefix + ".png") > 0
