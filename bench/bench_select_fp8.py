#!/usr/bin/env python3
"""FP8 selection scores (``select_scores="fp8"``) against the inputs' own (bf16) scores, on one GPU.

Per head configuration, length T (one sequence) and overlap level (``selection_patterns``) it
times, on the level's index inputs:

* ``msa.select_blocks`` with bf16 scores and with FP8 scores for each ``fp8_rerank`` of
  ``--reranks`` (the E4M3 copies, the FP8 selection kernel and, for fp8_rerank > 0, the
  re-ranking of its shortlists by the bf16 scores); TFLOP/s on the selection's GEMM,
  2 * Di * Hi * sum over tokens of (t+1) causal keys, for all (the copies and the re-ranking
  are part of the FP8 time);
* the recall of each FP8 selection: the share of the bf16 selection's blocks it also holds,
  over all entries and over the non-forced ones (sink and local blocks are in both by rule);
* with ``--forward``, the whole MSA forward (selection + sparse attention, fwd_pass auto) with
  each score type, and dense causal attention (cuDNN through SDPA) up to ``--dense-max-tokens``,
  beyond which its time is scaled from the largest measured length by the FLOP ratio and
  labelled "scaled";
* with ``--profile``, each selection's kernels (torch.profiler, one call after a warm-up),
  longest first, to the log and the CSV (``profile_<name>``: "kernel ms; ...", and their sum
  ``profile_sum_<name>_ms`` beside the timed median: launch gaps and the flushed L2's misses
  add to the median, and one profiled call can also run longer than the median);
* once per run, the FP8 and bf16 GEMM rates of torch (``torch._scaled_mm`` and ``torch.mm`` on
  8192^3), the tensor-core anchors of this GPU in the same run.

Timing as in bench_forward.py (CUDA events, warm-up, median, L2 flushed before each call).
A markdown table goes to stdout last; ``--out PREFIX`` writes PREFIX.csv.

    python bench/bench_select_fp8.py --lengths 128K,512K,1M --forward
    python bench/bench_select_fp8.py --quick
"""

import argparse
import csv
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_forward as bf  # noqa: E402
import selection_patterns as sp  # noqa: E402


def recall(fp8: torch.Tensor, ref: torch.Tensor, forced: torch.Tensor) -> tuple:
    """(share of ref's valid entries that fp8 holds, the same over ref's non-forced entries)."""
    hit = (fp8.unsqueeze(-1) == ref.unsqueeze(-2)).any(-2) & (ref >= 0)  # [T, Hi, k] over ref
    valid = ref >= 0
    free = valid & ~forced
    return (hit.sum().item() / max(1, valid.sum().item()),
            (hit & free).sum().item() / max(1, free.sum().item()))


def forced_mask(ref: torch.Tensor, Bk: int) -> torch.Tensor:
    T = ref.shape[0]
    own = (torch.arange(T, device=ref.device) // Bk)[:, None, None]
    local = (ref <= own) & (ref > own - sp.LOCAL_BLOCKS)
    sink = (ref < sp.SINK_BLOCKS) & (ref >= 0)
    return local | sink


def gemm_anchors(device) -> dict:
    n = 8192
    a = torch.randn(n, n, device=device).to(torch.bfloat16)
    b = torch.randn(n, n, device=device).to(torch.bfloat16)
    out = {}
    def timed(fn):
        for _ in range(3):
            fn()
        torch.cuda.synchronize(device)
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        for _ in range(10):
            fn()
        e.record()
        e.synchronize()
        return s.elapsed_time(e) / 10
    out["bf16_gemm_tflops"] = 2 * n ** 3 / (timed(lambda: a @ b) * 1e-3) / 1e12
    try:
        a8 = a.to(torch.float8_e4m3fn)
        b8 = b.t().contiguous().to(torch.float8_e4m3fn).t()  # column-major, as _scaled_mm wants
        one = torch.ones((), device=device)
        out["fp8_gemm_tflops"] = 2 * n ** 3 / (timed(
            lambda: torch._scaled_mm(a8, b8, one, one, out_dtype=torch.bfloat16)) * 1e-3) / 1e12
    except (RuntimeError, AttributeError) as e:
        out["fp8_gemm_error"] = bf.error_text(e)
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--configs", default="paper")
    p.add_argument("--lengths", type=bf.token_list, default=None, help="default 128K,512K,1M")
    p.add_argument("--levels", default="mixed,random")
    p.add_argument("--reranks", default="0,4",
                   help="the FP8 selections: fp8_rerank values m, or a/m for fp8_rerank_slots a "
                        "with fp8_rerank m (4/8: only the last 4 free slots re-ranked, from 12)")
    p.add_argument("--forward", action="store_true", help="also the whole MSA forward and dense")
    p.add_argument("--profile", action="store_true", help="each selection's kernels (torch.profiler)")
    p.add_argument("--dense-max-tokens", type=bf.parse_tokens, default=131072)
    p.add_argument("--top-k", type=int, default=16)
    p.add_argument("--block-size", type=int, default=128)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--index-dim", type=int, default=128)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--max-reps", type=int, default=20)
    p.add_argument("--rep-ms", type=float, default=300.0)
    p.add_argument("--warmup-ms", type=float, default=50.0)
    p.add_argument("--no-l2-flush", action="store_true")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    if args.lengths is None:
        args.lengths = [16384] if args.quick else [131072, 524288, 1048576]
    import msa

    device = torch.device("cuda")
    timer = bf.Timer(device, args)
    gen = torch.Generator(device=device).manual_seed(args.seed)
    dtype = torch.bfloat16
    anchors = gemm_anchors(device)
    bf.log(f"torch GEMM 8192^3: {anchors}")
    rows, dense_ref = [], {}
    # (name, select_scores, (fp8_rerank, fp8_rerank_slots)): bf16 scores, then FP8 with each.
    variants = [("input", "input", (0, 0))]
    for x in args.reranks.split(","):
        a, m = (int(y) for y in x.split("/")) if "/" in x else (0, int(x))
        variants.append((f"fp8_m{m}" + (f"_a{a}" if a else ""), "fp8", (m, a)))
    Bk, k, D, Di = args.block_size, args.top_k, args.head_dim, args.index_dim
    for cfg in args.configs.split(","):
        h = bf.HEADS[cfg]
        Hq, Hkv, Hi, Hik = h["Hq"], h["Hkv"], h["Hi"], h["Hik"]
        for L in args.lengths:
            cu = torch.tensor([0, L], dtype=torch.int32, device=device)
            sel_fl = bf.selection_flops(1, L, Hi, Di)
            for level in sp.level_names(args.levels):
                qi, ki, bi, st = sp.make_level(level, cu, Hi, Hik, Di, Bk, k, dtype=dtype, device=device,
                                               generator=gen, sink_blocks=sp.SINK_BLOCKS,
                                               local_blocks=sp.LOCAL_BLOCKS)
                row = dict(config=cfg, T=L, level=level, overlap=st["overlap"], union=st["union"],
                           **anchors)

                def select(scores, ma):
                    return lambda: msa.select_blocks(qi, ki, k, Bk, cu_seqlens=cu,
                                                     sink_blocks=sp.SINK_BLOCKS,
                                                     local_blocks=sp.LOCAL_BLOCKS, select_scores=scores,
                                                     fp8_rerank=ma[0], fp8_rerank_slots=ma[1])
                for name, scores, m in variants:
                    ms = timer.median_ms([select(scores, m)])
                    row[f"select_{name}_ms"] = ms
                    row[f"select_{name}_tflops"] = bf.tflops(sel_fl, ms)
                    if scores == "fp8":
                        bi8 = select(scores, m)()
                        row[f"recall_{name}"], row[f"recall_free_{name}"] = recall(bi8, bi, forced_mask(bi, Bk))
                        st8 = sp.selection_stats(bi8, cu, k)
                        row[f"overlap_{name}"], row[f"union_{name}"] = st8["overlap"], st8["union"]
                        del bi8
                    if args.profile:
                        import bench_backward as bb
                        kern = bb.profile_kernels(select(scores, m))
                        row[f"profile_{name}"] = "; ".join(f"{kn} {kms:.3f}" for kn, kms in kern)
                        # What the kernels of one profiled call (L2 not flushed) add up to, beside
                        # the timed median.
                        row[f"profile_sum_{name}_ms"] = sum(kms for _, kms in kern)
                        for kn, kms in kern[:8]:
                            bf.log(f"    {kms:8.3f} ms  {kn}")
                        bf.log(f"    {row[f'profile_sum_{name}_ms']:8.3f} ms  all {len(kern)} kernels "
                               f"(timed: {ms:.3f} ms)")
                    bf.log(f"{cfg} T={L} {level} {name}: select {ms:.2f} ms ({row[f'select_{name}_tflops']:.0f} "
                           f"TF/s), recall {row.get(f'recall_{name}', 1.0):.4f} "
                           f"(non-forced {row.get(f'recall_free_{name}', 1.0):.4f})")
                if args.forward:
                    q = torch.randn(L, Hq, D, device=device, dtype=dtype, generator=gen)
                    kk = torch.randn(L, Hkv, D, device=device, dtype=dtype, generator=gen)
                    v = torch.randn(L, Hkv, D, device=device, dtype=dtype, generator=gen)
                    for name, scores, m in variants:
                        def full(scores=scores, m=m):
                            return msa.sparse_attention(q, kk, v, qi, ki, k, Bk, cu_seqlens=cu,
                                                        sink_blocks=sp.SINK_BLOCKS,
                                                        local_blocks=sp.LOCAL_BLOCKS, kl_value=False,
                                                        select_scores=scores, fp8_rerank=m[0],
                                                        fp8_rerank_slots=m[1])
                        row[f"msa_{name}_ms"] = timer.median_ms([full])
                    if L <= args.dense_max_tokens and (cfg, L) not in dense_ref:
                        run, _ = bf.dense_runner(q.unsqueeze(0).transpose(1, 2), kk.unsqueeze(0).transpose(1, 2),
                                                 v.unsqueeze(0).transpose(1, 2), device)
                        dense_ref[(cfg, L)] = timer.median_ms([run])
                    if (cfg, L) in dense_ref:
                        row["dense_ms"], row["dense_source"] = dense_ref[(cfg, L)], "measured"
                    else:
                        base = max((x for c, x in dense_ref if c == cfg), default=None)
                        if base is not None:
                            row["dense_ms"] = dense_ref[(cfg, base)] * (L * (L + 1)) / (base * (base + 1))
                            row["dense_source"] = f"scaled from {bf.fmt_tokens(base)}"
                    if "dense_ms" in row:
                        for name, _, _ in variants:
                            row[f"speedup_{name}"] = row["dense_ms"] / row[f"msa_{name}_ms"]
                    bf.log("  forward " + " / ".join(f"{name} {row[f'msa_{name}_ms']:.1f}" for name, _, _ in variants)
                           + f" ms, dense {row.get('dense_ms', float('nan')):.1f} ms ({row.get('dense_source', '')})")
                    del q, kk, v
                rows.append(row)
                del qi, ki, bi
                torch.cuda.empty_cache()
    if args.out:
        keys = sorted({x for r in rows for x in r})
        with open(args.out + ".csv", "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=keys)
            w.writeheader()
            w.writerows(rows)
    print("| config | T | level (overlap / union) | scores | select | recall (non-forced) |"
          " MSA forward | dense | speedup |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        def ms(key):
            return f"{r[key]:.2f} ms" if key in r else "-"
        dense = ms("dense_ms") + (f" ({r['dense_source']})" if "dense_source" in r else "")
        for name, _, _ in variants:
            rec = (f"{r[f'recall_{name}']:.4f} ({r[f'recall_free_{name}']:.4f})" if f"recall_{name}" in r
                   else "1 (reference)")
            speed = f"{r[f'speedup_{name}']:.1f}x" if f"speedup_{name}" in r else "-"
            print(f"| {r['config']} | {bf.fmt_tokens(r['T'])} | {r['level']} ({r['overlap']:.2f} / "
                  f"{r['union']:.2f}) | {name} | {r[f'select_{name}_ms']:.2f} ms "
                  f"({r[f'select_{name}_tflops']:.0f} TF/s) | {rec} | {ms(f'msa_{name}_ms')} | {dense} | {speed} |")
    print(f"\ntorch GEMM 8192^3 in this run: bf16 {anchors.get('bf16_gemm_tflops', 0):.0f} TF/s, "
          f"FP8 {anchors.get('fp8_gemm_tflops', float('nan')):.0f} TF/s")


if __name__ == "__main__":
    main()
