"""examples/train_retrieval.py in its small CPU configuration: it trains the three models (dense,
MSA with a warmup phase, MSA sparse from the start), writes its report and the trained model's
selections."""

import csv
import importlib.util
import json
import math
import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
SCRIPT = os.path.join(HERE, "..", "..", "examples", "train_retrieval.py")


def _script():
    """examples/train_retrieval.py as a module."""
    spec = importlib.util.spec_from_file_location("train_retrieval", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _eval_rows(mod, argv):
    """The evaluation rows of mod.main(argv), which must succeed."""
    out = []
    real_run = mod.run

    def keep(a):
        result = real_run(a)
        out.extend(result["rows"])
        return result
    mod.run = keep
    try:
        assert mod.main(argv) == 0
    finally:
        mod.run = real_run
    return out


def test_train_retrieval_tiny(tmp_path):
    mod = _script()
    prefix = str(tmp_path / "tiny")
    assert mod.main(["--tiny", "--out", prefix]) == 0
    rows = list(csv.DictReader(open(prefix + ".csv")))
    assert {r["model"] for r in rows} == {"dense", "warmup", "sparse"}
    for r in rows:
        for key in ("loss", "acc", "step_ms"):
            assert math.isfinite(float(r[key])), (r["model"], key)
        if r["model"] != "dense":
            assert 0.0 < float(r["recall_mass"]) <= float(r["recall_oracle"]) + 1e-6 <= 1.0 + 2e-6
            assert 0.0 <= float(r["recall_score"]) <= 1.0 + 1e-6
            assert 0.0 <= float(r["recall_block"]) <= 1.0 + 1e-6
            assert 0.0 <= float(r["recall_answer"]) <= 1.0
            assert 0.0 < float(r["recall_ans_mass"]) <= float(r["recall_ans_oracle"]) + 1e-6 \
                <= 1.0 + 2e-6
            assert float(r["kl"]) > 0.0
    # the warmup model trains dense first, then sparse
    modes = [r["mode"] for r in rows if r["model"] == "warmup"]
    assert modes[0] == "warmup" and modes[-1] == "sparse"
    # training works: every model's held-out loss falls, the KL falls during the warmup phase,
    # and the selections hold more of the teacher's attention than chance (the selected share
    # of each row's causal keys)
    for name in ("dense", "warmup", "sparse"):
        mine = [r for r in rows if r["model"] == name]
        assert float(mine[-1]["loss"]) < float(mine[0]["loss"]), name
    warm = [float(r["kl"]) for r in rows if r["model"] == "warmup" and r["mode"] == "warmup"]
    assert len(warm) >= 2 and warm[-1] < warm[0]
    for name in ("warmup", "sparse"):
        last = [r for r in rows if r["model"] == name][-1]
        assert float(last["recall_mass"]) > float(last["recall_chance"]), name
    sel = torch.load(prefix + "_block_idx.pt")
    assert sel["block_size"] == 8 and set(sel["block_idx"]) == {"layer0", "layer1"}
    bi = sel["block_idx"]["layer0"]
    assert bi.shape == (96, 2, 4) and bi.dtype == torch.int32
    assert os.path.getsize(prefix + ".png") > 0


def test_train_retrieval_learning_rate_schedule():
    """lr_at: the linear warmup, a constant rate without a decay start, and with one a cosine
    that starts at --lr, falls monotonically and ends at --lr-min x --lr; --scale-lr scales by
    the batch of the length (capped by --max-tokens)."""
    mod = _script()
    args = type("A", (), dict(lr=1e-3, lr_warmup=10, lr_decay_start=0, lr_min=0.1, steps=110,
                              scale_lr=False, batch=16, max_tokens=0))()
    assert math.isclose(mod.lr_at(args, 5, 256), 5e-4)
    assert all(math.isclose(mod.lr_at(args, s, 256), 1e-3) for s in (10, 50, 110))
    args.lr_decay_start = 10
    lrs = [mod.lr_at(args, s, 256) for s in range(10, 111)]
    assert math.isclose(lrs[0], 1e-3) and math.isclose(lrs[-1], 1e-4)
    assert math.isclose(lrs[50], 1e-3 * (0.1 + 0.9 * 0.5))  # half way: the cosine's mean
    assert all(b < a for a, b in zip(lrs, lrs[1:]))
    args.scale_lr, args.max_tokens = True, 4096
    assert math.isclose(mod.lr_at(args, 10, 1024), 1e-3 * 4 / 16)


def test_bench_forward_times_trained_selections(tmp_path, capsys):
    """bench_forward --trained: the sparse forward over a trained model's saved selections, with
    their overlap and union, where the file's length and block size match the case."""
    sys.path.insert(0, os.path.join(HERE, "..", "..", "bench"))
    import bench_forward as bf
    T, Hi_file, k = 128, 2, 4
    bi = torch.full((T, Hi_file, k), -1, dtype=torch.int32)
    own = torch.arange(T) // 16
    bi[:, :, 0] = own[:, None]
    bi[:, 0, 1] = (own - 2).clamp(min=-1)  # head 0 also looks two blocks back
    path = tmp_path / "sel_block_idx.pt"
    torch.save(dict(block_idx={"layer0": bi}, block_size=16), path)
    out = tmp_path / "bench"
    rc = bf.main(["--device", "cpu", "--configs", "flash-msa", "--lengths", "128",
                  "--total-tokens", "128", "--block-size", "16", "--head-dim", "64",
                  "--index-dim", "64", "--top-k", "8", "--levels", "shared", "--skip-dense",
                  "--reps", "1", "--rep-ms", "0", "--warmup-ms", "0", "--trained", str(path),
                  "--out", str(out)])
    assert rc == 0
    row = json.loads((tmp_path / "bench.json").read_text())["rows"][0]
    assert row["fwd_trained_layer0_ms"] > 0 and row["fwd_trained_layer0_tflops"] > 0
    # heads 0 and 2 (file head 0) select two blocks, heads 1 and 3 one; neighbours inside a block
    # agree, so the overlap is (2 + 1 + 2 + 1) / (4 heads x k = 4) = 0.375 away from block edges
    # and from the first blocks (where head 0 has one block), less there
    assert 0.3 < row["trained_layer0_overlap"] <= 0.375
    assert row["trained_layer0_union"] >= row["trained_layer0_overlap"]


def test_selection_recall_by_hand():
    """selection_recall on two rows worked by hand: block size 4, k 2. Row at position 9 (three
    causal blocks) with teacher mass (0.5, 0.2, 0.3): its top-2 I* = {0, 2}; it selected {0, 1}:
    mass 0.7, oracle 0.8, score recall 0.5 / 0.8, block recall 1 / 2. Row at position 2 (one
    causal block, so |I*| = 1) with mass (1, 0, 0) selected {0, -1}: all five are 1."""
    mod = _script()
    pi = torch.tensor([[0.5, 0.2, 0.3], [1.0, 0.0, 0.0]])
    sel = torch.tensor([[0, 1], [0, -1]])
    got = mod.selection_recall(pi, sel, torch.tensor([9, 2]), 4)
    assert got["rows"] == 2
    assert math.isclose(got["mass"], 0.7 + 1.0, rel_tol=1e-6)
    assert math.isclose(got["oracle"], 0.8 + 1.0, rel_tol=1e-6)
    assert math.isclose(got["score"], 0.5 / 0.8 + 1.0, rel_tol=1e-6)
    assert math.isclose(got["block"], 0.5 + 1.0, rel_tol=1e-6)
    # a uniform teacher: 8 of row 9's 10 causal keys are in blocks 0 and 1, row 2's 3 in block 0
    assert math.isclose(got["chance"], 0.8 + 1.0, rel_tol=1e-6)
    # selecting the teacher's own top-k gives full recall; order within a row does not matter
    full = mod.selection_recall(pi, torch.tensor([[2, 0], [0, -1]]), torch.tensor([9, 2]), 4)
    assert math.isclose(full["score"], 2.0, rel_tol=1e-6) and math.isclose(full["block"], 2.0)


def test_train_retrieval_compiled_matches_eager():
    """--compile: the MSA model with its warmup phase, through torch.compile (a recompile at the
    second length and at the switch to sparse mode), trains as the eager model does: the same
    training losses and held-out metrics at every evaluation, within float32 reassociation."""
    mod = _script()
    eager = _eval_rows(mod, ["--tiny", "--models", "warmup"])
    compiled = _eval_rows(mod, ["--tiny", "--models", "warmup", "--compile"])
    assert [r["step"] for r in eager] == [r["step"] for r in compiled]
    assert [r["mode"] for r in compiled] == ["warmup", "warmup", "sparse"]
    for e, c in zip(eager, compiled):
        for key in ("train_loss", "loss", "kl", "recall_mass"):
            assert math.isclose(e[key], c[key], rel_tol=1e-4, abs_tol=1e-6), (e["step"], key, e[key], c[key])


def test_train_retrieval_select_scores(monkeypatch):
    """--select-scores fp8 reaches every sparse call of the MSA models (dense warmup calls have
    no selection), and the model still trains: its held-out loss falls."""
    import msa

    seen = []
    real = msa.sparse_attention

    def spy(*args, **kwargs):
        seen.append(kwargs.get("select_scores"))
        return real(*args, **kwargs)

    monkeypatch.setattr(msa, "sparse_attention", spy)
    out = _eval_rows(_script(), ["--tiny", "--models", "sparse", "--select-scores", "fp8"])
    assert seen and set(seen) == {"fp8"}
    assert out[-1]["loss"] < out[0]["loss"]


def test_train_retrieval_words_filler():
    """--filler words: filler ids in the bottom half, made of runs of a short word of distinct
    tokens repeated, so that most tokens equal the one a word length (2-8) back and almost none
    the one just before; random filler has neither property."""
    mod = _script()
    gen = torch.Generator().manual_seed(0)
    half = mod.FILLER0 + (64 - mod.FILLER0) // 2

    def shares(x):
        back = torch.stack([x[:, 8:] == x[:, 8 - d: x.shape[1] - d] for d in range(2, 9)]).any(0)
        return back.float().mean().item(), (x[:, 1:] == x[:, :-1]).float().mean().item()

    words = mod.filler(4, 4000, 64, "words", gen)
    assert words.shape == (4, 4000) and int(words.min()) >= mod.FILLER0 and int(words.max()) < half
    periodic, repeat = shares(words)
    assert periodic > 0.8 and repeat < 0.05, (periodic, repeat)
    periodic, repeat = shares(mod.filler(4, 4000, 64, "random", gen))
    assert periodic < 0.35 and repeat > 0.01, (periodic, repeat)

def test_train_retrieval_words_filler_needs_a_vocabulary(capsys):
    """--filler words with too small a vocabulary for a word of two distinct tokens: a usage
    error naming --vocab, before anything is built."""
    import pytest
    with pytest.raises(SystemExit):
        _script().main(["--device", "cpu", "--filler", "words", "--vocab", "7"])
    assert "--vocab 7" in capsys.readouterr().err


def test_train_retrieval_lm_loss_and_bos():
    """lm_loss counts only filler-after-filler targets: perfect logits there give 0 whatever the
    other positions' logits are, uniform logits give ln(vocab); --bos puts BOS at position 0 and
    shifts the answer and value positions with the sequence."""
    mod = _script()
    args = type("A", (), dict(task="needle", vocab=64, queries=3, filler="words", bos=True))()
    x, target, ans_pos, value_pos = mod.make_batch(args, 2, 300, torch.Generator().manual_seed(1),
                                                   torch.device("cpu"))
    assert x.shape == (2, 300) and bool((x[:, 0] == mod.BOS).all())
    assert bool((x[:, ans_pos] == 3).all()) and int(ans_pos[-1]) == 299
    assert bool((x.gather(1, value_pos) == target).all())
    logits = torch.full((2, 299, 64), -30.0)
    logits.scatter_(2, x[:, 1:, None], 30.0)  # right everywhere ...
    half = mod.FILLER0 + 30
    counted = ((x[:, 1:] >= mod.FILLER0) & (x[:, 1:] < half) & (x[:, :-1] >= mod.FILLER0)
               & (x[:, :-1] < half))
    logits[~counted] = torch.randn(int((~counted).sum()), 64) * 30  # ... but where not counted
    assert mod.lm_loss(logits, x).item() < 1e-6
    assert math.isclose(mod.lm_loss(torch.zeros(2, 299, 64), x).item(), math.log(64), rel_tol=1e-6)
    logits[0, 5] = 0.0  # a counted position (filler follows filler there) now uniform
    assert bool(counted[0, 5])
    assert math.isclose(mod.lm_loss(logits, x).item(), math.log(64) / int(counted.sum()), rel_tol=1e-5)


def test_train_retrieval_words_lm_tiny():
    """The tiny run with the next-token loss over word filler and a BOS token: both losses are
    reported and finite, each layer's recall is reported and its means are the layers' means."""
    rows = _eval_rows(_script(), ["--tiny", "--models", "warmup", "--filler", "words",
                                  "--lm-weight", "1", "--bos"])
    for r in rows:
        assert math.isfinite(r["lm_loss"]) and math.isfinite(r["train_lm"]) and r["train_lm"] > 0
        for key in ("mass", "oracle", "score", "chance"):
            per = [r[f"recall_{key}_l0"], r[f"recall_{key}_l1"]]
            assert math.isclose(r[f"recall_{key}"], sum(per) / 2, rel_tol=1e-6), key
    assert rows[-1]["lm_loss"] < rows[0]["lm_loss"]


def test_train_retrieval_dense_layers(tmp_path, capsys):
    """--dense-layers 1: layer 0 runs SDPA in the MSA models too (no KL term from it, the same
    output as the dense model's layer 0), recall and saved selections cover layer 1 alone, the
    dense model trains exactly as without the option; all layers dense is a usage error."""
    import pytest
    mod = _script()
    torch.manual_seed(0)
    model = mod.Model(64, 32, 2, 4, 2, 8, 4, 0.1, dense_layers=1)
    assert model.msa_layers() == [1]
    h = torch.randn(2 * 40, 32)
    model.set_mode("msa", "warmup")
    for b in model.blocks:
        b.attn.kl_value = True  # the KL's value, not only its gradient
    y0, kl0 = model.attend(model.blocks[0].attn, h, 2, 40, 0)
    _, kl1 = model.attend(model.blocks[1].attn, h, 2, 40, 1)
    model.set_mode("dense")
    d0, _ = model.attend(model.blocks[0].attn, h, 2, 40, 0)
    assert torch.equal(y0, d0) and float(kl0.detach()) == 0.0 and float(kl1.detach()) > 0.0

    prefix = str(tmp_path / "dl")
    rows = _eval_rows(mod, ["--tiny", "--models", "dense,warmup", "--dense-layers", "1",
                            "--out", prefix])
    plain = _eval_rows(_script(), ["--tiny", "--models", "dense"])
    dense = [r for r in rows if r["model"] == "dense"]
    assert [(r["loss"], r["acc"]) for r in dense] == [(r["loss"], r["acc"]) for r in plain]
    for r in rows:
        if r["model"] == "warmup":
            assert "recall_mass_l1" in r and "recall_mass_l0" not in r
            assert r["recall_mass"] == r["recall_mass_l1"] and r["kl"] > 0.0
    sel = torch.load(prefix + "_block_idx.pt")
    assert set(sel["block_idx"]) == {"layer1"}
    with pytest.raises(SystemExit):
        mod.main(["--tiny", "--dense-layers", "2"])
    assert "--dense-layers 2" in capsys.readouterr().err
