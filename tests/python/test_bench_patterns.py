"""bench/selection_patterns.py (overlap statistics, index inputs of a chosen overlap, levels) and
bench/plot_bench.py, on the CPU backend."""

import csv
import math
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import selection_patterns as sp  # noqa: E402

# A small shape on which the levels mean what they mean at the benchmark's (many more blocks
# than k, so that random selections share little beyond the forced blocks): one sequence of
# 2048 tokens in 256 blocks of 8, k = 16, sink 1 + local 4 forced; a selection takes ~0.1 s.
L, BK, K, HI, HIK, DI = 2048, 8, 16, 2, 1, 16


def reference_stats(bi, cu, k, window=8):
    """The statistics by plain Python loops over sets."""
    rows, cu = bi.tolist(), [int(x) for x in cu]
    Hi = bi.shape[1]
    inter = pairs = union = windows = 0
    for s in range(len(cu) - 1):
        a, b = cu[s], cu[s + 1]
        for t in range(a, b - 1):
            pairs += 1
            for h in range(Hi):
                a_, b_ = ({x for x in rows[u][h] if x >= 0} for u in (t, t + 1))
                inter += len(a_ & b_)
        for w in range(a, b, window):
            windows += 1
            for h in range(Hi):
                seen = set()
                for t in range(w, min(w + window, b)):
                    seen |= {x for x in rows[t][h] if x >= 0}
                union += len(seen)
    return dict(overlap_count=inter, pairs=pairs, union_count=union, windows=windows,
                overlap=inter / (pairs * Hi * k) if pairs else math.nan,
                union=union / (windows * Hi * k) if windows else math.nan)


def sorted_rows(T, Hi, k, nblk, gen):
    """Rows in the library's format: distinct ascending ids, then -1 (random counts)."""
    ids = torch.rand(T, Hi, nblk, generator=gen).argsort(-1)[..., :k]
    count = torch.randint(0, k + 1, (T, Hi, 1), generator=gen)
    ids = torch.where(torch.arange(k) < count, ids, torch.full_like(ids, 1 << 30))
    ids = ids.sort(-1).values
    return torch.where(ids < (1 << 30), ids, torch.full_like(ids, -1)).to(torch.int32)


@pytest.mark.parametrize("seed", range(6))
def test_stats_equal_python_reference(seed):
    g = torch.Generator()
    g.manual_seed(seed)
    lengths = torch.randint(2, 40, (5,), generator=g).tolist() + [1, 0, 9]
    lengths = [lengths[i] for i in torch.randperm(len(lengths), generator=g).tolist()]
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32)
    T, Hi, k = int(cu[-1]), 3, 6
    nblk = 4 + seed  # few blocks: rows overlap a lot, and partly
    cases = [sorted_rows(T, Hi, k, max(nblk, k), g),
             # any order, repeated ids and any negative padding count as the sets they hold
             torch.randint(-3, nblk, (T, Hi, k), generator=g, dtype=torch.int32)]
    for bi in cases:
        want = reference_stats(bi, cu, k)
        for chunk in (1, 50, 1 << 23):  # chunking changes nothing
            got = sp.selection_stats(bi, cu, k, chunk_elems=chunk)
            for key in ("overlap_count", "pairs", "union_count", "windows"):
                assert got[key] == want[key], (key, chunk)
            assert got["overlap"] == pytest.approx(want["overlap"], rel=1e-12)
            assert got["union"] == pytest.approx(want["union"], rel=1e-12)
    # another window, and k larger than the rows (overlap is divided by k)
    bi = cases[0]
    want = reference_stats(bi, cu, 2 * k, window=3)
    got = sp.selection_stats(bi, cu, 2 * k, window=3, chunk_elems=64)
    assert (got["overlap_count"], got["union_count"], got["windows"]) == (
        want["overlap_count"], want["union_count"], want["windows"])
    assert got["union"] == pytest.approx(want["union"], rel=1e-12)


def reference_split(bi, cu, tile_tokens, share_min):
    """split_work by plain Python loops: per sequence, tile and index head, the members of each
    block of the tiles' union."""
    rows, cu = bi.tolist(), [int(x) for x in cu]
    Hi = bi.shape[1]
    out = dict(pairs=0, union_blocks=0, kept_blocks=0, kept_pairs=0, kv_pairs=0, tiles=0)
    for s in range(len(cu) - 1):
        for t0 in range(cu[s], cu[s + 1], tile_tokens):
            for h in range(Hi):
                out["tiles"] += 1
                members = {}
                for t in range(t0, min(t0 + tile_tokens, cu[s + 1])):
                    for b in {x for x in rows[t][h] if x >= 0}:
                        members[b] = members.get(b, 0) + 1
                for c in members.values():
                    out["pairs"] += c
                    out["union_blocks"] += 1
                    kept = c >= share_min
                    out["kept_blocks"] += kept
                    out["kept_pairs" if kept else "kv_pairs"] += c
    return out


@pytest.mark.parametrize("seed", range(4))
def test_split_work_equals_python_reference(seed):
    g = torch.Generator()
    g.manual_seed(100 + seed)
    lengths = torch.randint(1, 30, (4,), generator=g).tolist() + [0, 8]
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32)
    T, Hi, k = int(cu[-1]), 2, 5
    cases = [sorted_rows(T, Hi, k, 7, g),
             torch.randint(-2, 6, (T, Hi, k), generator=g, dtype=torch.int32)]  # repeats, padding
    for bi in cases:
        for tile_tokens, share_min in ((8, 4), (4, 2), (3, 1), (1, 1), (8, 9)):
            got = sp.split_work(bi, cu, tile_tokens, share_min)
            assert got == reference_split(bi, cu, tile_tokens, share_min), (tile_tokens, share_min)
    # one token per tile keeping every block: the KV-block pass gets nothing
    got = sp.split_work(cases[0], cu, 1, 1)
    assert got["kv_pairs"] == 0 and got["kept_pairs"] == got["pairs"] == got["union_blocks"]
    with pytest.raises(ValueError):
        sp.split_work(cases[0], cu, 0, 1)


def test_stats_constructed_cases():
    k, Hi = 8, 2
    # identical rows of c valid ids: overlap c/k, union c/k (one window of 8 tokens, one of 4)
    for c in (0, 3, 8):
        row = torch.tensor(list(range(10, 10 + c)) + [-1] * (k - c), dtype=torch.int32)
        bi = row.expand(12, Hi, k).contiguous()
        st = sp.selection_stats(bi, None, k)
        assert st["pairs"] == 11 and st["windows"] == 2
        assert st["overlap"] == c / k and st["union"] == c / k
    # disjoint neighbours: overlap 0; every window holds len(window) * c distinct blocks
    c = 5
    ids = torch.arange(20 * c, dtype=torch.int32).reshape(20, 1, c).expand(20, Hi, c)
    bi = torch.cat([ids, torch.full((20, Hi, k - c), -1, dtype=torch.int32)], -1)
    st = sp.selection_stats(bi, torch.tensor([0, 20]), k)
    assert st["overlap"] == 0.0
    assert st["union_count"] == Hi * c * 20 and st["windows"] == 3  # windows of 8, 8 and 4
    assert st["union"] == pytest.approx(Hi * c * 20 / (3 * Hi * k))
    # half of the blocks kept from token to token: overlap 1/2 of a full row
    a = torch.tensor([[0, 1, 2, 3, 4, 5, 6, 7]], dtype=torch.int32)
    b = torch.tensor([[4, 5, 6, 7, 8, 9, 10, 11]], dtype=torch.int32)
    st = sp.selection_stats(torch.stack([a, b]), None, k)
    assert st["overlap"] == 0.5 and st["union"] == 12 / 8
    # sequences of one token and empty ones have no pairs; nothing at all: NaN
    bi = torch.zeros(3, Hi, k, dtype=torch.int32)
    st = sp.selection_stats(bi, torch.tensor([0, 1, 1, 2, 3, 3]), k)
    assert st["pairs"] == 0 and math.isnan(st["overlap"]) and st["windows"] == 3
    assert st["union"] == 1 / k
    st = sp.selection_stats(torch.zeros(0, Hi, k, dtype=torch.int32), torch.tensor([0, 0]), k)
    assert math.isnan(st["overlap"]) and math.isnan(st["union"])
    with pytest.raises(ValueError):
        sp.selection_stats(bi, torch.tensor([0, 2]), k)  # does not reach T


def test_stats_large_chunked():
    """64K tokens, Hi = 4, k = 16 in bounded chunks: the same counts as one pass."""
    g = torch.Generator()
    g.manual_seed(0)
    T, Hi, k = 1 << 16, 4, 16
    base = torch.rand(T // 64, 1, 256, generator=g).argsort(-1)[..., :k].sort(-1).values.int()
    bi = base.repeat_interleave(64, 0).expand(T, Hi, k).contiguous()
    bi[::7, :, -1] = -1
    cu = torch.tensor([0, 30001, 30002, T], dtype=torch.int32)
    st = sp.selection_stats(bi, cu, k, chunk_elems=1 << 18)
    full = sp.selection_stats(bi, cu, k, chunk_elems=1 << 30)
    assert st == full
    assert st["pairs"] == T - 3 and st["windows"] == sum(-(-n // 8) for n in (30001, 1, T - 30002))
    # rows of k distinct ids repeat for 64 tokens, but for the last one dropped on every 7th
    assert 0.95 < st["overlap"] < 0.99 and 1.0 < st["union"] < 1.2


@pytest.mark.parametrize("cu, Hi, Hik, Bk, k, sink, local", [
    ([0, 2048], 2, 1, 8, 16, 1, 4),              # the levels' shape
    ([0, 300, 300, 1000, 1001], 4, 2, 16, 5, 0, 1),  # packed, an empty and a one-token sequence
    ([0, 700], 2, 2, 32, 3, 2, 1),                # sink and local fill all but one slot
])
def test_select_by_gemm_equals_select_blocks(cu, Hi, Hik, Bk, k, sink, local):
    # the GEMM selection (for statistics at lengths the CPU backend's loop is slow at) selects
    # the library's sets, on inputs whose block scores do not tie
    import msa
    cu_t = torch.tensor(cu, dtype=torch.int32)
    g = torch.Generator().manual_seed(len(cu) + Bk)
    qi, ki = sp.index_inputs(0.3, cu_t, Hi, Hik, DI, Bk, dtype=torch.bfloat16, generator=g)
    want = msa.select_blocks(qi, ki, k, Bk, cu_seqlens=cu_t, sink_blocks=sink, local_blocks=local)
    got = sp.select_by_gemm(qi, ki, cu_t, k, Bk, sink, local)

    def sets(x):
        return torch.where(x < 0, torch.full_like(x, 1 << 30), x).sort(-1).values

    assert torch.equal(sets(got), sets(want))
    assert torch.equal(got, sets(got).masked_fill(sets(got) == 1 << 30, -1))  # ascending, -1 last
    # sampled query blocks: their rows the same, every other row empty
    nblk = sum((b - a + Bk - 1) // Bk for a, b in zip(cu[:-1], cu[1:]))
    pick = [0, nblk // 2, nblk - 1]
    part = sp.select_by_gemm(qi, ki, cu_t, k, Bk, sink, local, blocks=pick)
    rows = torch.zeros(cu[-1], dtype=torch.bool)
    i = 0
    for a, b in zip(cu[:-1], cu[1:]):
        for blk in range((b - a + Bk - 1) // Bk):
            if i in pick:
                rows[a + blk * Bk: min(a + (blk + 1) * Bk, b)] = True
            i += 1
    assert torch.equal(part[rows], got[rows]) and bool((part[~rows] == -1).all())


def test_index_inputs_shapes_and_determinism():
    cu = torch.tensor([0, 100, 100, 350], dtype=torch.int32)
    g1, g2 = torch.Generator(), torch.Generator()
    g1.manual_seed(3)
    g2.manual_seed(3)
    q1, k1 = sp.index_inputs(0.3, cu, 4, 2, 32, 16, generator=g1, chunk_tokens=64)
    q2, k2 = sp.index_inputs(0.3, cu, 4, 2, 32, 16, generator=g2, chunk_tokens=64)
    assert q1.shape == (350, 4, 32) and k1.shape == (350, 2, 32)
    assert q1.dtype == torch.bfloat16 and k1.dtype == torch.bfloat16
    assert torch.equal(q1, q2) and torch.equal(k1, k2)
    # the keys carry one salience per (sequence, block) along e0; queries mix e0 and a random
    # direction orthogonal to it
    sal = k1[:, 0, 0].float()
    assert torch.equal(sal[100:116], sal[100].expand(16)) and sal[100] != sal[116]
    assert torch.equal(k1[:, 0, 0], k1[:, 1, 0])
    qs = sp.Q_SCALE * math.sqrt(32)
    assert torch.allclose(q1[..., 0].float(), torch.full((350, 4), 0.3 * qs), rtol=1e-2)
    assert torch.allclose(q1[..., 1:].float().norm(dim=-1), torch.full((350, 4), 0.7 * qs),
                          rtol=2e-2)
    q0, _ = sp.index_inputs(0.0, cu, 4, 2, 32, 16, generator=g1)
    assert (q0[..., 0] == 0).all()
    with pytest.raises(ValueError):
        sp.index_inputs(1.5, cu, 4, 2, 32, 16)


def test_overlap_rises_with_alpha():
    cu = sp.cu_seqlens_for(1, L)
    stats = [sp.measure(a, cu, HI, HIK, DI, BK, K, seed=1) for a in (0.0, 0.25, 0.5, 0.75, 1.0)]
    ov = [s["overlap"] for s in stats]
    un = [s["union"] for s in stats]
    assert all(b > a + 0.02 for a, b in zip(ov, ov[1:])), ov
    assert all(b < a - 0.05 for a, b in zip(un, un[1:])), un
    # alpha = 0 is what independent uniform choices of the non-forced blocks give (random index
    # vectors scored against the same keys agree a little more often than chance)
    expect = sp.random_overlap_expectation([L], BK, K)
    assert 0.40 < expect < 0.42
    assert expect - 0.005 < ov[0] < expect + 0.02
    assert ov[-1] > 0.95


def test_levels_land_in_their_ranges():
    cu = torch.tensor([0, L, 2 * L], dtype=torch.int32)  # two sequences
    got = {}
    for name in ("shared", "mixed", "random"):
        qi, ki, bi, st = sp.make_level(name, cu, HI, HIK, DI, BK, K, seed=2)
        assert qi.shape == (2 * L, HI, DI) and ki.shape == (2 * L, HIK, DI)
        assert bi.shape == (2 * L, HI, K) and bi.dtype == torch.int32
        # the stats are those of the returned selection, which is that of the returned inputs
        assert torch.equal(bi, sp._select(__import__("msa"), qi, ki, cu, K, BK, 1, 4))
        assert st == {**sp.selection_stats(bi, cu, K), "level": name, "alpha": st["alpha"]}
        lo, hi = sp.LEVELS[name]["overlap"]
        assert lo <= st["overlap"] <= hi, (name, st)
        got[name] = st
    assert got["shared"]["alpha"] == 1.0 and got["random"]["alpha"] == 0.0
    assert 0.2 < got["mixed"]["alpha"] < 0.7
    assert abs(got["mixed"]["overlap"] - 0.57) <= 0.005  # calibrated on the returned inputs
    assert got["shared"]["union"] < got["mixed"]["union"] < got["random"]["union"]
    # calibrate draws the same inputs for the same seed and shape: the same alpha
    alpha, st = sp.calibrate(0.57, cu, HI, HIK, DI, BK, K, seed=2)
    assert alpha == got["mixed"]["alpha"] and st["overlap"] == got["mixed"]["overlap"]
    # a target below the random level gives alpha 0, one above the shared level alpha 1
    assert sp.calibrate(0.2, sp.cu_seqlens_for(1, L), HI, HIK, DI, BK, K, seed=2)[0] == 0.0
    assert sp.calibrate(0.999, sp.cu_seqlens_for(1, L), HI, HIK, DI, BK, K, seed=2)[0] == 1.0
    # a caller's generator: calibrated on what it draws, then advanced past one draw
    g = torch.Generator()
    g.manual_seed(7)
    qi, ki, bi, st = sp.make_level("mixed", sp.cu_seqlens_for(1, L), HI, HIK, DI, BK, K,
                                   generator=g)
    assert abs(st["overlap"] - 0.57) <= 0.005
    g2 = torch.Generator()
    g2.manual_seed(7)
    q2, k2 = sp.index_inputs(st["alpha"], sp.cu_seqlens_for(1, L), HI, HIK, DI, BK, generator=g2)
    assert torch.equal(q2, qi) and torch.equal(k2, ki)
    assert torch.equal(g.get_state(), g2.get_state())
    with pytest.raises(ValueError):
        sp.level_names("shared,structured")


def _write_csv(path, rows):
    keys = []
    for r in rows:
        keys += [k for k in r if k not in keys]
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=keys)
        w.writeheader()
        w.writerows(rows)


def test_plot_bench_writes_png(tmp_path):
    pytest.importorskip("matplotlib")
    import plot_bench

    fwd = []
    for cfg in ("paper", "flash-msa"):
        for i, T in enumerate((8192, 16384, 32768)):
            r = dict(config=cfg, T=T, B=16 // (i + 1), dense_tflops=500 + i,
                     dense_source="measured" if i < 2 else "extrapolated from 16K")
            for j, lv in enumerate(("shared", "mixed", "random")):
                r.update({f"{lv}_alpha": 1 - j / 2, f"{lv}_overlap": 0.95 - 0.3 * j + 0.01 * i,
                          f"{lv}_union": 1 + j, f"fwd_{lv}_tflops": 550 - 50 * j,
                          f"msa_{lv}_tflops": 400 - 40 * j, f"speedup_{lv}": 4 * (i + 1) - j})
            r["fwd_random_tflops"] = "" if i == 0 else r["fwd_random_tflops"]  # a missing cell
            fwd.append(r)
    _write_csv(tmp_path / "fwd.csv", fwd)
    bwd = [dict(config="flash-msa", T=T, B=1, index=lv, alpha=a, overlap=ov, union=1.5,
                step_speedup=s, fwd_tflops=400, bwd_tflops=200, bwd_kl_tflops=180, step_tflops=190)
           for T in (16384, 32768) for lv, a, ov, s in
           (("shared", 1.0, 0.97, 8.0), ("mixed", 0.4, 0.57, 7.0), ("random", 0.0, 0.35, 5.0))]
    _write_csv(tmp_path / "bwd.csv", bwd)
    assert plot_bench.main([str(tmp_path / "fwd.csv"), str(tmp_path / "bwd.csv")]) == 0
    for name in ("fwd.png", "bwd.png"):
        data = (tmp_path / name).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000
    # bench_serving.py: decode rows of two cache dtypes (SDPA only at q_len 1), and a prefill row.
    srv = [dict(kind="decode", cache=c, ctx=ctx, batch=b, q_len=q, graph_ms=g, dense_ms=5.0,
                sdpa_ms=2.0 if q == 1 else float("nan"))
           for ctx in (131072, 1 << 20) for b, q in ((8, 1), (8, 8))
           for c, g in (("bf16", 0.5), ("e4m3", 0.4))]
    srv.append(dict(kind="prefill", cache="", ctx=139264, batch=1, q_len=8192, graph_ms="",
                    dense_ms="", sdpa_ms=""))
    _write_csv(tmp_path / "srv.csv", srv)
    assert plot_bench.main([str(tmp_path / "srv.csv")]) == 0
    assert (tmp_path / "srv.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with pytest.raises(ValueError, match="no decode rows"):
        plot_bench.plot_serving([srv[-1]], str(tmp_path / "srv.csv"))
    # prefill rows only (--no-decode): a bar per walk and chunk, one walk's cell missing
    pre = [dict(kind="prefill", ctx=ctx + q, batch=1, q_len=q, overlap=0.5, attend_ms=2.0,
                attend_tflops=200.0, attend_query_tile_ms=2.5, attend_split_ms=2.0,
                attend_kv_block_ms="" if q == 8192 else 2.2)
           for ctx in (131072, 1 << 20) for q in (8192, 32768)]
    _write_csv(tmp_path / "pre.csv", pre)
    assert plot_bench.main([str(tmp_path / "pre.csv")]) == 0
    assert (tmp_path / "pre.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # with the indexer's columns (one of them missing in a row): a second panel, a taller figure
    for i, r in enumerate(pre):
        r.update(indexer_tflops=600.0, indexer_fp8_tflops="" if i == 0 else 1000.0,
                 indexer_fp8_alone_tflops=1200.0, attend_e4m3_cache_ms=6.0)
    _write_csv(tmp_path / "pre2.csv", pre)
    assert plot_bench.main([str(tmp_path / "pre2.csv")]) == 0
    from PIL import Image
    h1 = Image.open(tmp_path / "pre.png").size[1]
    h2 = Image.open(tmp_path / "pre2.png").size[1]
    assert h2 > 1.5 * h1
    with pytest.raises(ValueError, match="no prefill rows"):
        plot_bench.plot_prefill(srv[:2], str(tmp_path / "srv.csv"))
    s = plot_bench.series(plot_bench.read_rows(str(tmp_path / "fwd.csv")))
    assert not s["backward"] and set(s["data"]) == {"paper", "flash-msa"}
    pts = s["data"]["paper"]["mixed"]
    assert [T for T, _, _ in pts] == [8192, 16384, 32768]
    assert plot_bench._label("mixed", pts) == "mixed (overlap 0.65–0.67)"
    out = plot_bench.plot_csv(str(tmp_path / "bwd.csv"), str(tmp_path / "sub" / "b.png"))
    assert Path(out).is_file()


@pytest.mark.parametrize("alpha,ties", [(0.0, False), (0.6, False), (0.3, True)])
def test_fp8_shortlist_rules_equal_the_backend(alpha, ties):
    """bench/fp8_shortlist_recall.py's quantiser and shipped rule (float64 scores) choose what
    the CPU backend's select_blocks(select_scores="fp8", fp8_rerank=m) chooses, row by row
    (with ties: integer inputs whose block scores tie exactly, the copies equal to the inputs),
    and its rule a/m what fp8_rerank_slots=a chooses; the rule a/m keeps the best free - a
    blocks by FP8 and equals the rule m once a >= free."""
    import msa
    import cp_bytes as cb
    import fp8_shortlist_recall as fr
    h, T = cb.TINY, 768
    qi, ki = cb.draw(alpha, T, h, 3)
    if ties:  # small integers, every group's amax 4: the copies are exact, every sum too
        g = torch.Generator().manual_seed(5)
        qi = torch.randint(-4, 5, qi.shape, generator=g).to(qi.dtype)
        ki = torch.randint(-4, 5, ki.shape, generator=g).to(ki.dtype)
        qi[..., 0] = 4
        ki[::h["Bk"], :, 0] = 4
    k8 = fr.key_copies(ki, h["Bk"], torch.float64)
    cu = torch.tensor([0, T], dtype=torch.int32)
    G = h["Hi"] // h["Hik"]
    checked = 0
    for m, a in ((0, 0), (2, 0), (4, 0), (2, 1), (4, 2)):
        bi = msa.select_blocks(qi, ki, h["k"], h["Bk"], cu_seqlens=cu, sink_blocks=sp.SINK_BLOCKS,
                               local_blocks=sp.LOCAL_BLOCKS, select_scores="fp8", fp8_rerank=m,
                               fp8_rerank_slots=a)
        for b in range(T // h["Bk"]):
            got = fr.block_rows(qi, ki, k8, b, 0, h, torch.float64)
            if got is None:
                continue
            BM, BM8, cand, free = got
            rows = bi[b * h["Bk"]:(b + 1) * h["Bk"], :G].reshape(-1, h["k"]).long()
            want = torch.zeros_like(BM, dtype=torch.bool)
            ok = (rows >= int(cand[0, 0])) & (rows <= int(cand[0, -1]))
            want[torch.arange(rows.shape[0])[:, None].expand_as(rows)[ok], rows[ok]] = True
            assert torch.equal(fr.select_rows(BM, BM8, cand, free, a if a else -1, m), want), (m, a, b)
            if m > 0 and a == 0:
                assert torch.equal(fr.select_rows(BM, BM8, cand, free, free, m), want)
                kept = fr.select_rows(BM, BM8, cand, free, 1, m)
                best8 = fr._best(BM8, cand, free - 1)
                assert bool(kept.gather(1, best8).all())
                assert int(kept.sum()) == BM.shape[0] * min(free, cand.shape[1])
            checked += 1
    assert checked > 100
    with pytest.raises(ValueError, match="fp8_rerank_slots"):
        msa.select_blocks(qi, ki, h["k"], h["Bk"], select_scores="fp8", fp8_rerank_slots=-1)


def test_fp8_shortlist_recall_tiny_run(tmp_path):
    """fp8_shortlist_recall.py end to end at tiny heads: a CSV row per rule and level, the rule
    of every slot re-ranked at least as good as FP8 alone, the rows' re-scored blocks as the
    rules say, and the plot from the CSV."""
    import fp8_shortlist_recall as fr
    out = tmp_path / "r"
    assert fr.main(["--tiny", "--lengths", "2048", "--levels", "random", "--rules", "0,4,2/4",
                    "--out", str(out)]) == 0
    rows = {r["rule"]: r for r in csv.DictReader(open(f"{out}.csv"))}
    assert set(rows) == {"0", "4", "2/4"}
    assert float(rows["4"]["recall"]) >= float(rows["0"]["recall"])
    assert float(rows["0"]["rescored_per_row"]) == 0
    # tiny heads: k 8, sink 1, local 4 -> 3 free slots; 2/4 re-scores 2 + 4, m = 4 all 3 + 4
    assert float(rows["4"]["rescored_per_row"]) == 7 and float(rows["2/4"]["rescored_per_row"]) == 6
    png = tmp_path / "r.png"
    assert fr.main(["--plot", str(png), "--csv", f"{out}.csv"]) == 0
    assert png.stat().st_size > 10000
