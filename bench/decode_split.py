#!/usr/bin/env python3
"""Where the time of one graph-replayed decode step goes, kernel by kernel (torch.profiler).

    python bench/decode_split.py --ctx 1048576 --batch 8 --q-len 1
    python bench/decode_split.py --ctx 131072 --batch 64 --fp8

The step of ``bench_serving.py`` (paper heads, D = Di = Bk = 128, k 16, sink 1 + local 4,
random inputs, a shuffled page table; ``--fp8``: E4M3 copies of k, v and k_idx with a scale per
page) captured into a CUDA graph; prints the median, 10th and 90th percentile of ``--reps``
single replays (CUDA events, after ``--warmup`` replays), then each kernel's device time per
replay over 20 profiled replays. Compare builds in one run: kernel times move less between
runs than whole-step times do.
"""

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_serving as bs  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ctx", type=int, default=1 << 20)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--q-len", type=int, default=1)
    p.add_argument("--fp8", action="store_true", help="E4M3 caches on the MSA side")
    p.add_argument("--reps", type=int, default=200)
    p.add_argument("--warmup", type=int, default=20)
    args = p.parse_args(argv)
    dev = torch.device("cuda")
    ctx, batch, q_len = args.ctx, args.batch, args.q_len
    per = -(-ctx // bs.BK)
    cache = bs.Cache(batch * per + 64, dev)
    if args.fp8:
        cache.quantise()
    x = bs.decode_inputs(cache, ctx, batch, q_len, dev, args.fp8)
    w = bs.msa_wrapper(x, batch, q_len, dev)
    q, q_idx, page_table, seq_lens, cu = x["q"], x["q_idx"], x["page_table"], x["seq_lens"], x["cu"]
    graph = bs.graph_of(lambda: w.run(q, page_table, seq_lens, cu, q_idx))
    for _ in range(args.warmup):
        graph.replay()
    torch.cuda.synchronize()
    ts = []
    for _ in range(args.reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b) * 1e3)
    ts.sort()
    from torch.profiler import ProfilerActivity, profile
    n = 20
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(n):
            graph.replay()
        torch.cuda.synchronize()
    kernels = {}
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            us = e.device_time_total if hasattr(e, "device_time_total") else e.cuda_time_total
            kernels[e.name] = kernels.get(e.name, 0.0) + us
    pct = lambda f: ts[min(len(ts) - 1, int(f * len(ts)))]  # noqa: E731
    print(f"ctx {ctx}, batch {batch}, q_len {q_len}, {'e4m3' if args.fp8 else 'bf16'} caches: "
          f"replay median {pct(0.5):.1f} us (p10 {pct(0.1):.1f}, p90 {pct(0.9):.1f})")
    for name, us in sorted(kernels.items(), key=lambda kv: -kv[1]):
        print(f"  {us / n:9.1f} us  {name[:100]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
