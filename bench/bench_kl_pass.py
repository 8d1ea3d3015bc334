#!/usr/bin/env python3
"""The backward's KL gradient by each route (Options::kl_pass), on selections of each overlap
level: the backward without the KL branch, then with it by every route asked for, the kernels of
one call of each (torch.profiler), and how far each route's dq_idx and dk_idx are from the first
route's (relative L2).

    python bench/bench_kl_pass.py --config paper --length 131072 --passes fused,teacher
    python bench/bench_kl_pass.py --config flash-msa --length 16384 --levels mixed

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
    ap.add_argument("--passes", default="fused,teacher")
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
    passes = [x.strip() for x in args.passes.split(",") if x.strip()]
    print(f"| heads | T | level (overlap / union) | bwd ms | " +
          " | ".join(f"bwd+KL {p} ms" for p in passes) + " |")
    table = []
    with msa.value_checks(False):
        for name in sp.level_names(args.levels):
            qi, ki, bi, st = sp.make_level(name, cu, h["Hi"], h["Hik"], D, Bk, k, device=dev,
                                           generator=gen, sink_blocks=sp.SINK_BLOCKS,
                                           local_blocks=sp.LOCAL_BLOCKS)
            out, _, lse = msa.sparse_attention(q, kk, v, None, None, block_idx=bi, block_size=Bk,
                                               cu_seqlens=cu, kl_value=False, return_lse=True)

            def bwd(kl: bool, kp: str = "auto"):
                return lambda: torch.ops.msa.backward(dout, q, kk, v, out, lse, qi, ki, bi, cu,
                                                      kl_grad, False, Bk, D ** -0.5, 0.0, kl, kl, False,
                                                      kp, check_values=False)
            what = f"{args.config} T={T} {name} (overlap {st['overlap']:.2f} / union {st['union']:.2f})"
            base = timer.ms(bwd(False), reps=args.reps)
            print(f"{what} bwd without KL: {base:.2f} ms")
            times, grads = [], {}
            for kp in passes:
                ms = timer.ms(bwd(True, kp), reps=args.reps)
                times.append(ms)
                grads[kp] = bwd(True, kp)()
                print(f"{what} bwd+KL {kp}: {ms:.2f} ms (KL adds {100 * (ms / base - 1):.0f}%)")
                for kname, kms in profile_kernels(bwd(True, kp), templates=True)[:args.kernels]:
                    print(f"    {kms:9.3f} ms  {kname}")
                g0 = grads[passes[0]]
                print("    vs " + passes[0] + ": " + ", ".join(
                    f"{n} {rel(a, b):.1e}" for n, a, b in zip(("dq", "dk", "dv", "dq_idx", "dk_idx"),
                                                              grads[kp], g0)))
                sys.stdout.flush()
            table.append(f"| {args.config} | {T} | {name} ({st['overlap']:.2f} / {st['union']:.2f}) | "
                         f"{base:.2f} | " + " | ".join(f"{t:.2f}" for t in times) + " |")
    print("\n".join(table))
    return 0


if __name__ == "__main__":
    sys.exit(main())
