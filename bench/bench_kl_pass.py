#!/usr/bin/env python3
"""The backward's KL gradient by each route (Options::kl_pass) and its dq by each route
(Options::dq_pass, with the tokens of a pass: Options::bwd_chunk_tokens), on selections of each
overlap level: the backward without the KL branch, then with it by every pair of routes asked
for, the kernels of one call of each (torch.profiler), and how far each pair's gradients are from
the first pair's (relative L2).

    python bench/bench_kl_pass.py --config paper --length 131072 --passes fused,teacher
    python bench/bench_kl_pass.py --config flash-msa --length 16384 --levels mixed
    python bench/bench_kl_pass.py --passes teacher --dq query_tile,from_ds,from_ds:131072

One sequence of --length tokens; the index inputs and selections of ``selection_patterns``
(sink 1, local 4 forced); times are medians of CUDA-event timed calls with the L2 flushed.
"""

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import selection_patterns as sp  # noqa: E402
from bench_backward import HEADS, Timer, profile_kernels  # noqa: E402


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.float(), b.float()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", choices=sorted(HEADS), default="paper")
    ap.add_argument("--length", type=int, default=131072)
    ap.add_argument("--levels", default="mixed,random")
    ap.add_argument("--passes", default="fused,teacher", help="kl_pass values")
    ap.add_argument("--dq", default="auto",
                    help="dq_pass values, each optionally with :bwd_chunk_tokens (from_ds:65536)")
    ap.add_argument("--top-k", type=int, default=16)
    ap.add_argument("--block-size", type=int, default=128)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--kernels", type=int, default=8, help="kernels listed per call")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    import msa

    dev = torch.device("cuda")
    h = HEADS[args.config]
    T, D, Bk, k = args.length, args.head_dim, args.block_size, args.top_k
    timer = Timer(dev, flush=True)
    gen = torch.Generator(device=dev)
    gen.manual_seed(args.seed)
    r = lambda *s: torch.randn(*s, device=dev, dtype=torch.bfloat16, generator=gen)  # noqa: E731
    q, kk, v, dout = r(T, h["Hq"], D), r(T, h["Hkv"], D), r(T, h["Hkv"], D), r(T, h["Hq"], D)
    cu = torch.tensor([0, T], device=dev, dtype=torch.int32)
    kl_grad = torch.ones(1, device=dev, dtype=torch.float32)
    routes = []  # (kl_pass, dq_pass, bwd_chunk_tokens, name)
    for kp in [x.strip() for x in args.passes.split(",") if x.strip()]:
        for dq in [x.strip() for x in args.dq.split(",") if x.strip()]:
            dp, _, chunk = dq.partition(":")
            routes.append((kp, dp, int(chunk or 0), kp if args.dq == "auto" else f"{kp}/{dq}"))
    print(f"| heads | T | level (overlap / union) | bwd ms | " +
          " | ".join(f"bwd+KL {r[3]} ms" for r in routes) + " |")
    table = []
    with msa.value_checks(False):
        for name in sp.level_names(args.levels):
            qi, ki, bi, st = sp.make_level(name, cu, h["Hi"], h["Hik"], D, Bk, k, device=dev,
                                           generator=gen, sink_blocks=sp.SINK_BLOCKS,
                                           local_blocks=sp.LOCAL_BLOCKS)
            out, _, lse = msa.sparse_attention(q, kk, v, None, None, block_idx=bi, block_size=Bk,
                                               cu_seqlens=cu, kl_value=False, return_lse=True)

            def bwd(kl: bool, kp: str = "auto", dp: str = "auto", chunk: int = 0):
                return lambda: torch.ops.msa.backward(dout, q, kk, v, out, lse, qi, ki, bi, cu,
                                                      kl_grad, False, Bk, D ** -0.5, 0.0, kl, kl, False,
                                                      kp, check_values=False, dq_pass=dp,
                                                      bwd_chunk_tokens=chunk)
            what = f"{args.config} T={T} {name} (overlap {st['overlap']:.2f} / union {st['union']:.2f})"
            base = timer.ms(bwd(False), reps=args.reps)
            print(f"{what} bwd without KL: {base:.2f} ms")
            times, grads = [], {}
            for kp, dp, chunk, rname in routes:
                ms = timer.ms(bwd(True, kp, dp, chunk), reps=args.reps)
                times.append(ms)
                grads[rname] = bwd(True, kp, dp, chunk)()
                print(f"{what} bwd+KL {rname}: {ms:.2f} ms (KL adds {100 * (ms / base - 1):.0f}%)")
                for kname, kms in profile_kernels(bwd(True, kp, dp, chunk), templates=True)[:args.kernels]:
                    print(f"    {kms:9.3f} ms  {kname}")
                g0 = grads[routes[0][3]]
                print("    vs " + routes[0][3] + ": " + ", ".join(
                    f"{n} {rel(a, b):.1e}" for n, a, b in zip(("dq", "dk", "dv", "dq_idx", "dk_idx"),
                                                              grads[rname], g0)))
                sys.stdout.flush()
            table.append(f"| {args.config} | {T} | {name} ({st['overlap']:.2f} / {st['union']:.2f}) | "
                         f"{base:.2f} | " + " | ".join(f"{t:.2f}" for t in times) + " |")
    print("\n".join(table))
    return 0


if __name__ == "__main__":
    sys.exit(main())
