#!/usr/bin/env python3
"""Serving benchmarks on one GPU (paged KV cache, docs/contract.md §6): decode steps and prefill
chunks of MSA against dense attention over the same cache, with the HBM bandwidth measured in
the same run.

Decode (paper heads Hq 64 / Hkv 4 / Hi 4 / Hik 1, D = Di = 128, Bk = 128, k = 16, bf16): for each
context length, batch and q_len (new tokens per sequence), a shuffled page table over one cache;
timed with CUDA events, value checks off (as PagedMSAWrapper.run):

  indexer   paged_select_blocks: reads every index key of the context (its bytes / time against
            the measured HBM bandwidth), eager and as a CUDA graph replay (its GPU time);
  attend    paged_forward over that block_idx;
  step      PagedMSAWrapper.run (selection + attention), eager and as a CUDA graph replay;
  dense     the same call with dense=True (every cached key), and torch SDPA (cuDNN or flash) on
            contiguous K/V of the same heads where it applies (q_len 1: no mask needed); SDPA
            and the graph-replayed step are timed alternately (the clocks are not locked).

--fp8: the MSA side of every decode row (and the prefill rows' indexer, timed once more over
them with the inputs' scores and with FP8 scores, and their attention with bf16 and FP8 queries)
reads float8 E4M3 copies of the caches (k, v and k_idx,
a scale per page: the page's largest magnitude / 448), while dense and SDPA keep the bf16
cache; bytes count one byte per E4M3 element. Those rows also time FP8 queries (Q8KV8: q as
E4M3 codes with a scale per (token, head), its largest magnitude / 448): the attention call
(q8 attend) and the graph-replayed step (q8 graph).

Prefill: chunks of new tokens against a cached prefix, index inputs of mixed overlap
(bench/selection_patterns.index_inputs; --prefill-alpha 1 or 0: shared-like or random);
effective TFLOP/s count the selected work only (4 * D * Hq * the support size of every row). The indexer is timed with the inputs' bf16 scores
and with FP8 scores (select_scores="fp8": E4M3 copies of q_idx and of the pages, re-ranked with
fp8_rerank 4 and alone with 0), each FP8 selection's recall of the bf16 one reported.

    python bench/bench_serving.py --out docs/bench-serving-h200     # everything (a few minutes)
    python bench/bench_serving.py --quick                           # fewer shapes
"""

import argparse
import csv
import json
import math
import os
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import msa  # noqa: E402
from msa import serving  # noqa: E402
import selection_patterns as sp  # noqa: E402
from bench_forward import event_ms as _event_ms  # noqa: E402
from bench_select_fp8 import recall  # noqa: E402

HQ, HKV, HI, HIK, D, DI, BK, K = 64, 4, 4, 1, 128, 128, 128, 16
SINK, LOCAL = 1, 4


def _warm(fns, warmup_ms: float) -> None:
    """Runs every fn in turn for at least `warmup_ms` (the clocks are not locked: a
    sub-millisecond step timed right after an idle spell need not run at the clocks of a busy
    GPU)."""
    t0 = time.perf_counter()
    while (time.perf_counter() - t0) * 1e3 < warmup_ms:
        for fn in fns:
            fn()
        torch.cuda.synchronize()


def timed(fn, iters: int = 20, warmup: int = 3, warmup_ms: float = 50.0) -> float:
    """Median milliseconds of fn() over `iters` runs (CUDA events), after `warmup` calls and at
    least `warmup_ms` of them."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    _warm([fn], warmup_ms)
    ts = sorted(_event_ms(fn) for _ in range(iters))
    return ts[len(ts) // 2]


def timed_pair(fa, fb, iters: int = 40, warmup_ms: float = 50.0) -> tuple:
    """Median milliseconds of fa() and of fb(), timed alternately (CUDA events, after
    `warmup_ms` of both), so that the two see the same clock states: their ratio is what the
    speedup columns report (one reading of the same graph step read 0.583 ms where 100 replays
    in the same run gave 0.520)."""
    _warm([fa, fb], warmup_ms)
    ta, tb = [], []
    for _ in range(iters):
        ta.append(_event_ms(fa))
        tb.append(_event_ms(fb))
    ta.sort()
    tb.sort()
    return ta[len(ta) // 2], tb[len(tb) // 2]


def graph_of(fn) -> "torch.cuda.CUDAGraph":
    """fn() captured into a CUDA graph (after one call on a side stream, as torch asks)."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph


def hbm_bandwidth(dev) -> float:
    """Bytes per second of a 4 GiB device copy (read + write)."""
    x = torch.empty(1 << 31, dtype=torch.int16, device=dev)
    y = torch.empty_like(x)
    ms = timed(lambda: y.copy_(x), iters=10)
    del x, y
    return 2 * (1 << 32) / (ms * 1e-3)


class Cache:
    """One physical cache of `pages` pages, filled with random values."""

    def __init__(self, pages: int, dev):
        g = torch.Generator(device=dev).manual_seed(0)
        shape = (pages, BK, HKV, D)
        self.k = torch.randn(shape, generator=g, device=dev, dtype=torch.bfloat16)
        self.v = torch.randn(shape, generator=g, device=dev, dtype=torch.bfloat16)
        self.k_idx = torch.randn((pages, BK, HIK, DI), generator=g, device=dev, dtype=torch.bfloat16)
        self.pages = pages
        self.fp8 = None

    def quantise(self):
        """E4M3 copies of k, v and k_idx with a scale per page (its largest magnitude / 448);
        torch's conversion rounds to the nearest code as paged_append does."""
        def q(x):
            s = x.abs().amax(dim=(1, 2, 3)).float().clamp(min=1e-12) / 448.0
            return (x.float() / s.view(-1, 1, 1, 1)).to(torch.float8_e4m3fn), s
        (k8, ks), (v8, vs), (ki8, kis) = q(self.k), q(self.v), q(self.k_idx)
        self.fp8 = dict(k=k8, v=v8, k_idx=ki8, k_scale=ks, v_scale=vs, k_idx_scale=kis)


def decode_inputs(cache: Cache, ctx: int, batch: int, q_len: int, dev, fp8: bool = False) -> dict:
    """A decode step's inputs: a shuffled page table over `cache`, `batch` sequences of `ctx`
    cached tokens, the last `q_len` of each new (random q and q_idx), and the MSA side's cache
    tensors `m` (bf16, or with fp8 the E4M3 copies and their scales)."""
    g = torch.Generator(device=dev).manual_seed(ctx + batch + q_len)
    per = -(-ctx // BK)
    perm = torch.randperm(cache.pages, generator=g, device=dev)[: batch * per].to(torch.int32)
    Tq = batch * q_len
    return dict(
        per=per, Tq=Tq, page_table=perm.view(batch, per).contiguous(),
        seq_lens=torch.full((batch,), ctx, dtype=torch.int32, device=dev),
        cu=torch.arange(batch + 1, device=dev, dtype=torch.int32) * q_len,
        q=torch.randn((Tq, HQ, D), generator=g, device=dev, dtype=torch.bfloat16),
        q_idx=torch.randn((Tq, HI, DI), generator=g, device=dev, dtype=torch.bfloat16),
        m=cache.fp8 if fp8 else dict(k=cache.k, v=cache.v, k_idx=cache.k_idx, k_scale=None,
                                     v_scale=None, k_idx_scale=None))


def msa_wrapper(x: dict, batch: int, q_len: int, dev) -> "serving.PagedMSAWrapper":
    """The planned sparse PagedMSAWrapper over the cache tensors of decode_inputs' `x`."""
    m = x["m"]
    pm = serving.PagedKVCache.__new__(serving.PagedKVCache)  # views of the benchmark's tensors
    pm.k, pm.v, pm.k_idx, pm.page_size, pm.device = m["k"], m["v"], m["k_idx"], BK, dev
    pm.k_scale, pm.v_scale, pm.k_idx_scale = m["k_scale"], m["v_scale"], m["k_idx_scale"]
    pm.query_dtype = torch.bfloat16
    w = serving.PagedMSAWrapper(pm)
    w.plan(batch, x["Tq"], HQ, max_pages=x["per"], max_q_len=q_len, num_idx_heads=HI, top_k=K,
           sink_blocks=SINK, local_blocks=LOCAL)
    return w


def decode_case(cache: Cache, ctx: int, batch: int, q_len: int, bw: float, graphs: bool, dev,
                fp8: bool = False):
    x = decode_inputs(cache, ctx, batch, q_len, dev, fp8)
    per, Tq, page_table, seq_lens, cu = x["per"], x["Tq"], x["page_table"], x["seq_lens"], x["cu"]
    q, q_idx, m = x["q"], x["q_idx"], x["m"]
    kw = dict(max_q_len=q_len, sink_blocks=SINK, local_blocks=LOCAL)
    with msa.value_checks(False):
        bi = serving.paged_select_blocks(q_idx, m["k_idx"], page_table, seq_lens, cu, K,
                                         k_idx_scale=m["k_idx_scale"], **kw)
        t_index = timed(lambda: serving.paged_select_blocks(q_idx, m["k_idx"], page_table, seq_lens,
                                                            cu, K, k_idx_scale=m["k_idx_scale"], **kw))
        t_attend = timed(lambda: serving.paged_forward(q, m["k"], m["v"], page_table, seq_lens, cu,
                                                       block_idx=bi, k_scale=m["k_scale"],
                                                       v_scale=m["v_scale"], **kw))
    pc = serving.PagedKVCache.__new__(serving.PagedKVCache)
    pc.k, pc.v, pc.k_idx, pc.page_size, pc.device = cache.k, cache.v, cache.k_idx, BK, dev
    w = msa_wrapper(x, batch, q_len, dev)
    t_step = timed(lambda: w.run(q, page_table, seq_lens, cu, q_idx))
    wd = serving.PagedMSAWrapper(pc)
    wd.plan(batch, Tq, HQ, max_pages=per, max_q_len=q_len, dense=True)
    t_dense = timed(lambda: wd.run(q, page_table, seq_lens, cu))
    t_graph = t_index_graph = float("nan")
    step_graph = None
    if graphs:
        step_graph = graph_of(lambda: w.run(q, page_table, seq_lens, cu, q_idx))
        t_graph = timed(step_graph.replay)
        with msa.value_checks(False):
            t_index_graph = timed(graph_of(lambda: serving.paged_select_blocks(
                q_idx, m["k_idx"], page_table, seq_lens, cu, K, k_idx_scale=m["k_idx_scale"], **kw)).replay)
    t_attend_q8 = t_graph_q8 = float("nan")
    if fp8:  # FP8 queries over the same E4M3 caches
        q_scale = q.float().abs().amax(dim=2).clamp(min=1e-12) / 448.0
        q8 = (q.float() / q_scale.unsqueeze(2)).to(torch.float8_e4m3fn)
        with msa.value_checks(False):
            t_attend_q8 = timed(lambda: serving.paged_forward(q8, m["k"], m["v"], page_table, seq_lens, cu,
                                                              block_idx=bi, k_scale=m["k_scale"],
                                                              v_scale=m["v_scale"], q_scale=q_scale, **kw))
        if graphs:
            t_graph_q8 = timed(graph_of(lambda: w.run(q8, page_table, seq_lens, cu, q_idx, q_scale=q_scale)).replay)
    t_sdpa = float("nan")
    if q_len == 1 and batch * ctx <= (8 << 20):
        kc = cache.k[page_table.long()].view(batch, per * BK, HKV, D)[:, :ctx].transpose(1, 2).contiguous()
        vc = cache.v[page_table.long()].view(batch, per * BK, HKV, D)[:, :ctx].transpose(1, 2).contiguous()
        qs = q.view(batch, 1, HQ, D).transpose(1, 2)
        sdpa = lambda: F.scaled_dot_product_attention(qs, kc, vc, enable_gqa=True)  # noqa: E731
        if step_graph is not None:  # the speedup's two sides timed alternately
            t_graph, t_sdpa = timed_pair(step_graph.replay, sdpa)
        else:
            t_sdpa = timed(sdpa)
        del kc, vc
    # Bytes: the index keys of every context; the K and V of the distinct blocks each (sequence,
    # KV head) attends (its tokens' union); dense reads every K and V.
    elem = 1 if fp8 else 2  # bytes per element of the MSA side's cache
    idx_bytes = batch * ctx * HIK * DI * elem
    sel = bi.view(batch, q_len, HKV, HI // HKV, K).permute(0, 2, 1, 3, 4).reshape(batch * HKV, -1)
    union = sum(int(torch.unique(r[r >= 0]).numel()) for r in sel[: min(len(sel), 64)]) / min(len(sel), 64)
    kv_bytes = batch * HKV * union * BK * D * 2 * elem
    dense_bytes = batch * ctx * HKV * D * 2 * 2
    return dict(kind="decode", cache="e4m3" if fp8 else "bf16", ctx=ctx, batch=batch, q_len=q_len,
                union_blocks=round(union, 1),
                indexer_ms=t_index, indexer_graph_ms=t_index_graph, attend_ms=t_attend, step_ms=t_step,
                graph_ms=t_graph, attend_q8_ms=t_attend_q8, graph_q8_ms=t_graph_q8,
                dense_ms=t_dense, sdpa_ms=t_sdpa,
                indexer_bw=idx_bytes / (t_index * 1e-3) / bw,
                indexer_graph_bw=idx_bytes / (t_index_graph * 1e-3) / bw,
                step_bw=(idx_bytes + kv_bytes) / (t_step * 1e-3) / bw,
                dense_bw=dense_bytes / (t_dense * 1e-3) / bw,
                speedup_dense=t_dense / t_step,
                speedup_sdpa=t_sdpa / t_step if t_sdpa == t_sdpa else float("nan"),
                speedup_sdpa_graph=t_sdpa / t_graph if t_sdpa == t_sdpa else float("nan"))


def split_model(bi: torch.Tensor, pos0: int):
    """kAuto's cost model (src/cuda/device/pass_choice.cuh) over one sequence's selection bi
    [Tq, HI, K] whose first token sits at position pos0: (plain, split without the work items'
    term, work items), in its units (a tile's token visiting a block: 10)."""
    m = 128 // (HQ // HI)  # tokens of a query tile
    keep = -(-m * 10 // 21)
    Tq = bi.shape[0]
    pos = torch.arange(pos0, pos0 + Tq, device=bi.device)
    b = bi.long()
    ok = (b >= 0) & (b <= (pos // BK)[:, None, None])
    # a block repeated in a row counts once
    dup = torch.zeros_like(ok)
    for j in range(1, K):
        dup[:, :, j] = (b[:, :, j:j + 1] == b[:, :, :j]).any(-1)
    ok &= ~dup
    nb = int(b.max()) + 1
    tile = (torch.arange(Tq, device=bi.device) // m)[:, None, None].expand_as(b)
    head = torch.arange(HI, device=bi.device)[None, :, None].expand_as(b)
    key = ((tile * HI + head) * nb + b)[ok]
    uk, cnt = torch.unique(key, return_counts=True)
    plain = 10 * m * uk.numel()
    kept = cnt >= keep
    split = 10 * m * int(kept.sum()) + 21 * int(cnt[~kept].sum())
    blk = uk[~kept] % nb
    kvh = (uk[~kept] // nb) % HI // (HI // HKV)
    items = torch.unique(blk * HKV + kvh).numel()
    return plain, split, items


def index_flops_of(pos: torch.Tensor) -> float:
    """The index GEMM of the causal support of new tokens at positions pos: 2 Di Hi sum(p + 1)."""
    return 2 * DI * HI * float((pos + 1).sum())


def prefill_case(cache: Cache, prefix: int, chunk: int, dev, alpha: float = 0.44, e4m3: bool = False,
                 profile: bool = False):
    total = prefix + chunk
    per = -(-total // BK)
    cu_full = torch.tensor([0, total], dtype=torch.int32, device=dev)
    g = torch.Generator(device=dev).manual_seed(total)
    q_idx_full, k_idx_full = sp.index_inputs(alpha, cu_full, HI, HIK, DI, BK, dtype=torch.bfloat16,
                                             device=dev, generator=g)
    perm = torch.randperm(cache.pages, generator=g, device=dev)[:per].to(torch.int32)
    page_table = perm.view(1, per).contiguous()
    rows = torch.arange(total, device=dev)
    cache.k_idx.view(-1, HIK, DI)[(perm.long()[rows // BK] * BK + rows % BK)] = k_idx_full
    seq_lens = torch.tensor([total], dtype=torch.int32, device=dev)
    cu = torch.tensor([0, chunk], dtype=torch.int32, device=dev)
    q = torch.randn((chunk, HQ, D), generator=g, device=dev, dtype=torch.bfloat16)
    q_idx = q_idx_full[prefix:].contiguous()
    kw = dict(sink_blocks=SINK, local_blocks=LOCAL)
    with msa.value_checks(False):
        bi = serving.paged_select_blocks(q_idx, cache.k_idx, page_table, seq_lens, cu, K, **kw)
        t_index = timed(lambda: serving.paged_select_blocks(q_idx, cache.k_idx, page_table, seq_lens,
                                                            cu, K, **kw), iters=5, warmup=1)
        # The library's choice (auto), and each walk of the training forward it chooses among.
        t_pass = {fp: timed(lambda: serving.paged_forward(q, cache.k, cache.v, page_table, seq_lens, cu,
                                                          block_idx=bi, fwd_pass=fp, **kw), iters=5, warmup=1)
                  for fp in ("auto", "query_tile", "split", "kv_block")}
        t_attend = t_pass["auto"]
        if profile:  # each walk's kernels (torch.profiler), longest first
            from bench_backward import profile_kernels
            for fp in t_pass:
                ks = profile_kernels(lambda: serving.paged_forward(q, cache.k, cache.v, page_table, seq_lens, cu,
                                                                   block_idx=bi, fwd_pass=fp, **kw))
                print(f"prefill {chunk} after {prefix} {fp}: {t_pass[fp]:.3f} ms; kernels "
                      + ", ".join(f"{n} {ms:.3f}" for n, ms in ks[:8]), flush=True)
        # FP8 index scores (E4M3 copies of q_idx and of the pages), re-ranked (4) and alone (0).
        t_fp8, bi_fp8 = {}, {}
        for m in (4, 0):
            bi_fp8[m] = serving.paged_select_blocks(q_idx, cache.k_idx, page_table, seq_lens, cu, K,
                                                    select_scores="fp8", fp8_rerank=m, **kw)
            t_fp8[m] = timed(lambda: serving.paged_select_blocks(
                q_idx, cache.k_idx, page_table, seq_lens, cu, K, select_scores="fp8", fp8_rerank=m, **kw),
                iters=5, warmup=1)
        extra = {}
        if e4m3:  # the indexer over an E4M3 k_idx cache (a scale per page), scored as stored
            cache.quantise()
            ki8, kis = cache.fp8["k_idx"], cache.fp8["k_idx_scale"]
            bi8 = serving.paged_select_blocks(q_idx, ki8, page_table, seq_lens, cu, K, k_idx_scale=kis, **kw)
            t8 = timed(lambda: serving.paged_select_blocks(q_idx, ki8, page_table, seq_lens, cu, K,
                                                           k_idx_scale=kis, **kw), iters=5, warmup=1)
            # FP8 scores over it (E4M3 copies of its dequantised keys, re-ranked with the default 4)
            bi8f = serving.paged_select_blocks(q_idx, ki8, page_table, seq_lens, cu, K, k_idx_scale=kis,
                                               select_scores="fp8", **kw)
            t8f = timed(lambda: serving.paged_select_blocks(q_idx, ki8, page_table, seq_lens, cu, K,
                                                            k_idx_scale=kis, select_scores="fp8", **kw),
                        iters=5, warmup=1)
            # and the attention over E4M3 k and v caches, over the bf16 selection
            k8, v8, ks, vs = cache.fp8["k"], cache.fp8["v"], cache.fp8["k_scale"], cache.fp8["v_scale"]
            ta8 = timed(lambda: serving.paged_forward(q, k8, v8, page_table, seq_lens, cu, block_idx=bi,
                                                      k_scale=ks, v_scale=vs, **kw), iters=5, warmup=1)
            # and with FP8 queries (Q8KV8: a scale per (token, head), its largest magnitude / 448)
            q_scale = q.float().abs().amax(dim=2).clamp(min=1e-12) / 448.0
            q8 = (q.float() / q_scale.unsqueeze(2)).to(torch.float8_e4m3fn)
            ta8q = timed(lambda: serving.paged_forward(q8, k8, v8, page_table, seq_lens, cu, block_idx=bi,
                                                       k_scale=ks, v_scale=vs, q_scale=q_scale, **kw),
                         iters=5, warmup=1)
            extra = dict(indexer_e4m3_cache_ms=t8, e4m3_cache_bi=bi8, attend_e4m3_cache_ms=ta8,
                         attend_q8_e4m3_cache_ms=ta8q, indexer_fp8_e4m3_cache_ms=t8f, fp8_e4m3_cache_bi=bi8f)
    stats = sp.selection_stats(bi, torch.tensor([0, chunk], dtype=torch.int32, device=dev), k=K)
    plain, split, items = split_model(bi, prefix)
    # Support size of every (token, index head) row: its valid blocks, the own block partial.
    pos = torch.arange(prefix, total, device=dev)
    own = (pos // BK)[:, None, None]
    valid = bi >= 0
    full_blocks = (valid & (bi != own)).sum(-1)
    has_own = (bi == own).any(-1)
    support = full_blocks * BK + has_own * (pos % BK + 1)[:, None]
    flops = 4 * D * (HQ // HI) * float(support.sum())
    forced = ((bi <= own) & (bi > own - LOCAL)) | ((bi >= 0) & (bi < SINK))
    rec = {m: recall(bi_fp8[m], bi, forced) for m in bi_fp8}
    if extra:
        r8 = recall(extra.pop("e4m3_cache_bi"), bi, forced)
        r8f = recall(extra.pop("fp8_e4m3_cache_bi"), bi, forced)
        extra.update(indexer_e4m3_cache_tflops=index_flops_of(pos) / (extra["indexer_e4m3_cache_ms"] * 1e-3) / 1e12,
                     attend_e4m3_cache_tflops=flops / (extra["attend_e4m3_cache_ms"] * 1e-3) / 1e12,
                     attend_q8_e4m3_cache_tflops=flops / (extra["attend_q8_e4m3_cache_ms"] * 1e-3) / 1e12,
                     recall_e4m3_cache=r8[0], recall_free_e4m3_cache=r8[1],
                     indexer_fp8_e4m3_cache_tflops=index_flops_of(pos) / (extra["indexer_fp8_e4m3_cache_ms"] * 1e-3)
                     / 1e12, recall_fp8_e4m3_cache=r8f[0], recall_free_fp8_e4m3_cache=r8f[1])
    index_flops = index_flops_of(pos)
    return dict(kind="prefill", ctx=total, batch=1, q_len=chunk, overlap=round(stats["overlap"], 3),
                union=round(stats["union"], 2), indexer_ms=t_index, attend_ms=t_attend,
                attend_query_tile_ms=t_pass["query_tile"], attend_split_ms=t_pass["split"],
                attend_kv_block_ms=t_pass["kv_block"],
                model_plain=plain, model_split_pairs=split, model_items=items,
                step_ms=t_index + t_attend, attend_tflops=flops / (t_attend * 1e-3) / 1e12,
                attend_query_tile_tflops=flops / (t_pass["query_tile"] * 1e-3) / 1e12,
                indexer_tflops=index_flops / (t_index * 1e-3) / 1e12,
                indexer_fp8_ms=t_fp8[4], indexer_fp8_tflops=index_flops / (t_fp8[4] * 1e-3) / 1e12,
                recall_fp8=rec[4][0], recall_free_fp8=rec[4][1],
                indexer_fp8_alone_ms=t_fp8[0], indexer_fp8_alone_tflops=index_flops / (t_fp8[0] * 1e-3) / 1e12,
                recall_fp8_alone=rec[0][0], recall_free_fp8_alone=rec[0][1], step_fp8_ms=t_fp8[4] + t_attend,
                **extra)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--out", default=None, help="write PREFIX.csv and PREFIX.json")
    p.add_argument("--no-prefill", action="store_true")
    p.add_argument("--no-decode", action="store_true")
    p.add_argument("--profile", action="store_true", help="print each prefill walk's kernels (torch.profiler)")
    p.add_argument("--prefill-shapes", default=None,
                   help="the prefills as PREFIX:CHUNK,... (default 131072:8192,131072:32768,1048576:8192,1048576:32768)")
    p.add_argument("--ctx", type=int, nargs="*", help="decode context lengths (default: a grid)")
    p.add_argument("--batch", type=int, nargs="*", help="decode batches")
    p.add_argument("--q-len", type=int, nargs="*", help="decode new tokens per sequence")
    p.add_argument("--prefill-alpha", type=float, default=0.44,
                   help="the prefill index inputs' alpha (bench/selection_patterns.py): 0.44 mixed (default), "
                        "1 shared, 0 random")
    p.add_argument("--fp8", choices=["off", "on", "both"], default="off",
                   help="decode with E4M3 caches on the MSA side (both: a bf16 and an E4M3 row per shape)")
    args = p.parse_args(argv)
    dev = torch.device("cuda")
    torch.backends.cuda.matmul.allow_tf32 = False
    bw = hbm_bandwidth(dev)
    print(f"HBM copy bandwidth: {bw / 1e12:.2f} TB/s", flush=True)
    ctxs = [32768, 131072, 1 << 20]
    batches = [1, 8, 64]
    qlens = [1, 8]
    if args.quick:
        ctxs, batches = [131072, 1 << 20], [1, 8]
    ctxs, batches, qlens = args.ctx or ctxs, args.batch or batches, args.q_len or qlens
    max_tokens = 8 << 20
    cache = Cache(max_tokens // BK + 64, dev)
    fp8s = {"off": [False], "on": [True], "both": [False, True]}[args.fp8]
    if True in fp8s:
        cache.quantise()
    rows = []
    for ctx in ([] if args.no_decode else ctxs):
        for batch in batches:
            if batch * ctx > max_tokens:
                continue
            for q_len in qlens:
                for fp8 in fp8s:
                    r = decode_case(cache, ctx, batch, q_len, bw, graphs=True, dev=dev, fp8=fp8)
                    rows.append(r)
                    print(json.dumps({k: (round(v, 4) if isinstance(v, float) else v) for k, v in r.items()}),
                          flush=True)
    if not args.no_prefill:
        shapes = ([(131072, 8192), (1 << 20, 8192)] if args.quick else
                  [(131072, 8192), (131072, 32768), (1 << 20, 8192), (1 << 20, 32768)])
        if args.prefill_shapes:
            try:
                shapes = [tuple(int(x) for x in s.split(":")) for s in args.prefill_shapes.split(",")]
            except ValueError:
                shapes = []
            if not shapes or any(len(x) != 2 or min(x) < 1 for x in shapes):
                p.error(f"argument --prefill-shapes: expected PREFIX:CHUNK,... of positive integers, "
                        f"got {args.prefill_shapes!r}")
        for prefix, chunk in shapes:
            r = prefill_case(cache, prefix, chunk, dev, alpha=args.prefill_alpha, e4m3=True in fp8s,
                             profile=args.profile)
            rows.append(r)
            print(json.dumps({k: (round(v, 4) if isinstance(v, float) else v) for k, v in r.items()}),
                  flush=True)
    if args.out:
        keys = []
        for r in rows:
            keys += [k for k in r if k not in keys]
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out + ".csv", "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=keys)
            w.writeheader()
            w.writerows(rows)
        with open(args.out + ".json", "w") as f:
            json.dump(dict(hbm_bandwidth=bw, rows=rows), f, indent=1)
    print(f"\n## MSA serving on {torch.cuda.get_device_name()}, heads {HQ}/{HKV}/{HI}/{HIK}, D {D}, k {K}, bf16;"
          f" HBM copy {bw / 1e12:.2f} TB/s; decode times in ms (eager calls, and graph: one CUDA-graph"
          f" replay; x sdpa: the graph-replayed step against SDPA)")
    print(f"{'cache':>5} {'ctx':>8} {'B':>3} {'q':>3} {'index ms':>9} {'%HBM':>5} {'graph':>7} {'%HBM':>5}"
          f" {'attend':>7} {'step':>7} {'graph':>7} {'dense':>7} {'sdpa':>7} {'x dense':>7} {'x sdpa':>6}"
          f" {'q8 att':>7} {'q8 grph':>7}")
    for r in rows:
        if r["kind"] != "decode":
            continue
        print(f"{r['cache']:>5} {r['ctx']:>8} {r['batch']:>3} {r['q_len']:>3} {r['indexer_ms']:>9.3f} {100 * r['indexer_bw']:>5.0f}"
              f" {r['indexer_graph_ms']:>7.3f} {100 * r['indexer_graph_bw']:>5.0f}"
              f" {r['attend_ms']:>7.3f} {r['step_ms']:>7.3f} {r['graph_ms']:>7.3f} {r['dense_ms']:>7.3f}"
              f" {r['sdpa_ms']:>7.3f} {r['speedup_dense']:>7.2f} {r['speedup_sdpa_graph']:>6.2f}"
              f" {r['attend_q8_ms']:>7.3f} {r['graph_q8_ms']:>7.3f}")
    for r in rows:
        if r["kind"] == "prefill":
            print(f"prefill {r['q_len']} tokens at {r['ctx']}: overlap {r['overlap']} union {r['union']};"
                  f" indexer {r['indexer_ms']:.1f} ms ({r['indexer_tflops']:.0f} TF/s), attention"
                  f" {r['attend_ms']:.2f} ms ({r['attend_tflops']:.0f} TF/s effective; query tiles"
                  f" {r['attend_query_tile_ms']:.2f}, split {r['attend_split_ms']:.2f}, KV block"
                  f" {r['attend_kv_block_ms']:.2f}; kAuto's model: query tiles {r['model_plain']:.3g},"
                  f" split {r['model_split_pairs']:.3g} + {r['model_items']} items); FP8 indexer"
                  f" {r['indexer_fp8_ms']:.1f} ms ({r['indexer_fp8_tflops']:.0f} TF/s, recall {r['recall_fp8']:.4f},"
                  f" non-forced {r['recall_free_fp8']:.4f}), without re-ranking {r['indexer_fp8_alone_ms']:.1f} ms"
                  f" ({r['indexer_fp8_alone_tflops']:.0f} TF/s, recall {r['recall_fp8_alone']:.4f}); step"
                  f" {r['step_ms']:.2f} -> {r['step_fp8_ms']:.2f} ms"
                  + (f"; over an E4M3 k_idx cache {r['indexer_e4m3_cache_ms']:.1f} ms"
                     f" ({r['indexer_e4m3_cache_tflops']:.0f} TF/s, recall {r['recall_e4m3_cache']:.4f}),"
                     f" with FP8 scores {r['indexer_fp8_e4m3_cache_ms']:.1f} ms"
                     f" ({r['indexer_fp8_e4m3_cache_tflops']:.0f} TF/s, recall {r['recall_fp8_e4m3_cache']:.4f}),"
                     f" attention over E4M3 k, v {r['attend_e4m3_cache_ms']:.2f} ms"
                     f" ({r['attend_e4m3_cache_tflops']:.0f} TF/s), with FP8 queries"
                     f" {r['attend_q8_e4m3_cache_ms']:.2f} ms ({r['attend_q8_e4m3_cache_tflops']:.0f} TF/s)"
                     if "indexer_e4m3_cache_ms" in r else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
