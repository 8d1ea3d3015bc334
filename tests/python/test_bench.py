"""bench/bench_forward.py: its block_idx patterns, FLOP counts, and a tiny run on the CPU backend."""

import json
import sys
from pathlib import Path

import pytest
import torch

import msa

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import bench_forward as bf  # noqa: E402


def _check_pattern(bi, B, L, Hi, k, Bk):
    assert bi.shape == (B * L, Hi, k) and bi.dtype == torch.int32
    own = (torch.arange(L).repeat(B) // Bk)[:, None, None]
    v = bi >= 0
    assert (v[..., 1:] <= v[..., :-1]).all(), "-1 padding last"
    assert ((bi[..., 1:] > bi[..., :-1]) | ~v[..., 1:]).all(), "ascending, distinct"
    assert (bi <= own).all(), "causal"
    assert (bi == own).any(-1).all(), "own block present"
    assert (v.sum(-1) == torch.clamp(own[..., 0] + 1, max=k)).all(), "k blocks when possible"


@pytest.mark.parametrize("L,Bk", [(1, 128), (700, 128), (3000, 64), (5000, 128)])
def test_patterns(L, Bk):
    g = torch.Generator()
    g.manual_seed(0)
    B, Hi, k = 2, 4, 16
    real = bf.realistic_pattern(B, L, Hi, k, Bk, "cpu", gen=g)
    rand = bf.random_pattern(B, L, Hi, k, Bk, "cpu", gen=g)
    _check_pattern(real, B, L, Hi, k, Bk)
    _check_pattern(rand, B, L, Hi, k, Bk)
    own = torch.arange(L).repeat(B) // Bk
    late = own >= bf.LOCAL_BEFORE + 1 + k  # enough earlier blocks to choose from
    if late.any():
        # realistic: sink and the local blocks forced; within a query block all but
        # PER_TOKEN_SLOTS long-range blocks are shared
        r = real[late].long()
        o = own[late][:, None]
        assert (r == 0).any(-1).all()
        for d in range(bf.LOCAL_BEFORE + 1):
            assert (r == (o - d)[..., None]).any(-1).all()
        t = int(late.nonzero()[0]) // bf.QUERY_BLOCK * bf.QUERY_BLOCK
        for h in range(Hi):
            a, b = set(real[t, h].tolist()), set(real[t + bf.QUERY_BLOCK - 1, h].tolist())
            if (t + bf.QUERY_BLOCK - 1) // Bk == t // Bk:
                assert len(a & b) >= k - bf.PER_TOKEN_SLOTS
        # random: neighbouring tokens rarely agree
        same = (rand[1:] == rand[:-1]).all(-1)[late[1:]].double().mean().item()
        assert same < 0.5


def test_flop_counts():
    assert bf.causal_pairs(2, 4) == 2 * (1 + 2 + 3 + 4)
    # paper heads at 128K: the ideal speedup of the issue is about 16x, at 1M about 28.4x
    for L, ideal in ((128 * 1024, 16.0), (1024 * 1024, 28.4)):
        dense = bf.dense_flops(1, L, 64, 128)
        sel = bf.selection_flops(1, L, 4, 128)
        att = bf.attention_flops(4 * L * 16 * 128, 64, 4, 128)  # every row: k full blocks
        assert abs(dense / (sel + att) - ideal) < 0.1
    # visible keys: row t of block b sees min(Bk, t - b*Bk + 1) keys
    bi = torch.tensor([[[0, 1]], [[1, -1]], [[0, -1]]], dtype=torch.int32)  # T=3, L=3, Bk=2
    assert bf.visible_keys(bi, 1, 3, 2) == (1 + 0) + (0) + (2)


def test_token_parsing():
    assert bf.token_list("8K,1M,300") == [8192, 1 << 20, 300]
    assert bf.fmt_tokens(131072) == "128K" and bf.fmt_tokens(1 << 20) == "1M"
    with pytest.raises(Exception):
        bf.parse_tokens("0")


def test_cpu_smoke_run(tmp_path, capsys):
    out = tmp_path / "bench"
    rc = bf.main(["--device", "cpu", "--configs", "flash-msa", "--lengths", "128,256",
                  "--total-tokens", "256", "--head-dim", "64", "--index-dim", "64",
                  "--top-k", "8", "--dense-max-tokens", "128", "--reps", "1", "--rep-ms", "0",
                  "--warmup-ms", "0", "--out", str(out)])
    assert rc == 0
    text = capsys.readouterr().out
    table = text[text.index("## MSA forward benchmark"):]
    assert table.count("\n| flash-msa |") == 2 and "extrapolated" in table
    rows = json.loads((tmp_path / "bench.json").read_text())["rows"]
    assert [r["T"] for r in rows] == [128, 256] and [r["B"] for r in rows] == [2, 1]
    for r in rows:
        for key in ("select_ms", "fwd_realistic_ms", "fwd_random_ms", "msa_ms", "dense_ms",
                    "speedup", "ideal_speedup"):
            assert r[key] > 0, key
    assert rows[0]["dense_source"] == "measured"
    assert rows[1]["dense_source"].startswith("extrapolated")
    assert (tmp_path / "bench.csv").read_text().startswith("config,")
    assert msa.version() in json.loads((tmp_path / "bench.json").read_text())["meta"]["msa"]


def test_help_without_library():
    with pytest.raises(SystemExit) as e:
        bf.main(["--help"])
    assert e.value.code == 0
