#!/usr/bin/env python3
"""Where the time of one sparse forward over a given block_idx goes, kernel by kernel
(torch.profiler), on selections of each overlap level, for each forward pass.

    python bench/kernel_split.py --config paper --length 131072
    python bench/kernel_split.py --config flash-msa --length 32768 --passes kv_block,split,auto

One sequence of --length tokens; the index inputs and selections of ``selection_patterns``
(sink 1, local 4 forced). Prints, per level, how the split divides the selection
(``selection_patterns.split_work``: the tiles' unions, the blocks they keep, the pairs left to the
KV-block pass and those pairs' bytes against the HBM copy bandwidth measured in the run), and per
(level, pass) the overlap and union of the selection,
the wall time of the call (CUDA events, L2 flushed, median of --reps) and the kernels' device times.
With --out PREFIX the rows also go to PREFIX.csv, each with a digest of the output's bytes
(``out_digest``), so that runs of two builds show whether a change left the result bit for bit.
"""

import argparse
import csv
import hashlib
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import selection_patterns as sp  # noqa: E402
from bench_backward import Timer, profile_kernels  # noqa: E402
from bench_forward import HEADS  # noqa: E402


def digest(t: torch.Tensor) -> str:
    """A digest of a 16-bit tensor's bits, taken on its device in chunks (the output of a long
    sequence is GBs): per chunk the sum of its words and their sum weighted by a hash of the
    position, both in wrapping int64 arithmetic, then SHA-1 over those sums."""
    h = hashlib.sha1()
    words = t.contiguous().view(-1).view(torch.int16)
    for chunk in words.split(1 << 26):
        c = chunk.to(torch.int64)
        pos = torch.arange(c.numel(), device=c.device, dtype=torch.int64)
        w = (pos * 2654435761) % (1 << 31) + 1
        h.update(f"{c.sum().item()},{(c * w).sum().item()};".encode())
    return h.hexdigest()[:16]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", choices=sorted(HEADS), default="paper")
    ap.add_argument("--length", type=int, default=131072)
    ap.add_argument("--levels", default="shared,mixed,random")
    ap.add_argument("--passes", default="query_tile,kv_block,split,auto")
    ap.add_argument("--top-k", type=int, default=16)
    ap.add_argument("--block-size", type=int, default=128)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--kv-cost", type=float, default=2.1,
                    help="the split's cost constant kKvCost (device/pass_choice.cuh) for its counts")
    ap.add_argument("--out", default=None, help="write PREFIX.csv")
    args = ap.parse_args(argv)
    import msa
    from bench_serving import hbm_bandwidth

    dev = torch.device("cuda")
    h = HEADS[args.config]
    T, D, Bk, k = args.length, args.head_dim, args.block_size, args.top_k
    timer = Timer(dev, flush=True)
    gen = torch.Generator(device=dev)
    gen.manual_seed(args.seed)
    r = lambda *s: torch.randn(*s, device=dev, dtype=torch.bfloat16, generator=gen)  # noqa: E731
    q, kk, v = r(T, h["Hq"], D), r(T, h["Hkv"], D), r(T, h["Hkv"], D)
    cu = torch.tensor([0, T], device=dev, dtype=torch.int32)
    # The split's division of each selection (query tiles of 128 rows: 128 / Gi tokens), and the
    # bytes of the KV-block pass's pairs: per pair its Gi query rows gathered, their partial O
    # written and read back by the tiles' merge, their (max, sum) written and read.
    gi = h["Hq"] // h["Hi"]
    tile_tokens = max(1, 128 // gi)
    share_min = -(-tile_tokens * 10 // round(args.kv_cost * 10))
    pair_bytes = gi * (3 * D * 2 + 2 * 8)
    bw = hbm_bandwidth(dev)
    print(f"HBM copy bandwidth {bw / 1e12:.2f} TB/s; split: tiles of {tile_tokens} tokens keep the blocks "
          f"at least {share_min} of them selected; a KV-block pair moves {pair_bytes} bytes")
    rows = []
    for name in sp.level_names(args.levels):
        _, _, bi, st = sp.make_level(name, cu, h["Hi"], h["Hik"], D, Bk, k, device=dev, generator=gen)
        sw = sp.split_work(bi, cu, tile_tokens, share_min)
        kv_gb = sw["kv_pairs"] * pair_bytes / 1e9
        print(f"{name}: per tile and index head {sw['union_blocks'] / sw['tiles']:.1f} blocks in the union, "
              f"{sw['kept_blocks'] / sw['tiles']:.1f} kept; KV-block pairs {sw['kv_pairs']} "
              f"({sw['kv_pairs'] / max(1, sw['pairs']):.1%} of the selected), {kv_gb:.1f} GB "
              f"= {kv_gb * 1e9 / bw * 1e3:.2f} ms at the copy bandwidth")
        outs = {}
        for fp in [x.strip() for x in args.passes.split(",") if x.strip()]:
            fn = lambda: msa.sparse_attention(q, kk, v, None, None, block_idx=bi, block_size=Bk,  # noqa: E731
                                              cu_seqlens=cu, kl_value=False, fwd_pass=fp)
            ms = timer.ms(fn, reps=args.reps)
            out = fn()[0]
            outs[fp] = out.float()
            sha = digest(out)
            print(f"{args.config} T={T} {name} (overlap {st['overlap']:.2f} / union {st['union']:.2f}) "
                  f"{fp}: {ms:.2f} ms")
            kernels = profile_kernels(fn)[:8]
            for kname, kms in kernels:
                print(f"    {kms:9.3f} ms  {kname}")
            rows.append(dict(config=args.config, T=T, level=name, overlap=st["overlap"], union=st["union"],
                             fwd_pass=fp, ms=ms, out_digest=sha, pairs=sw["pairs"],
                             union_blocks=sw["union_blocks"], kept_blocks=sw["kept_blocks"],
                             kv_pairs=sw["kv_pairs"], kv_pair_bytes=pair_bytes, hbm_bytes_per_s=bw,
                             kernels="; ".join(f"{kn} {km:.3f}" for kn, km in kernels)))
        if "query_tile" in outs:
            for other in ("kv_block", "split"):
                if other in outs:
                    a, b = outs["query_tile"], outs[other]
                    print(f"    rel L2 diff query_tile / {other}: {((a - b).norm() / b.norm()).item():.2e}")
        if "auto" in outs:  # which pass kAuto ran: its out is that pass's, bit for bit
            # (A split with no partials to merge can give the query tiles' out too, so where only
            # one of the two ran, equal outputs do not tell them apart.)
            ran = [fp for fp in ("query_tile", "split") if fp in outs and torch.equal(outs[fp], outs["auto"])]
            print(f"    auto's out equals: {', '.join(ran) or 'neither'}"
                  + ("" if "query_tile" in outs and "split" in outs else " (run both passes to tell them apart)"))
        sys.stdout.flush()
    if args.out:
        with open(args.out + ".csv", "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(rows[0].keys()))
            w.writeheader()
            w.writerows(rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
