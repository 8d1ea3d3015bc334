#!/usr/bin/env python3
"""Bytes a context-parallel training step moves (``msa.distributed``), computed from the
selection alone, and how evenly each layout spreads the step's work: for lengths no machine at
hand runs, and for layouts not yet timed.

Per length T (one sequence) and overlap level (``selection_patterns``; "mixed" calibrated to a
neighbour overlap of 0.57 on sampled query blocks of these very inputs), the script draws the
index inputs on the CPU, selects with ``select_by_gemm`` (the selection of contract §3 by
float32 GEMMs, equal to ``msa.select_blocks`` where no scores tie) and, per layout, gives:

* the bytes all ranks receive in a step (forward + backward, what ``sparse_attention``'s stats
  count; ``msa.distributed.exchange_bytes``, which a test checks against the stats of real
  steps) with the selected exchange, and that as a share of the all-gather baseline's;
* the largest rank's share of the step's modelled work over the mean (1.00: even), a token at
  position t costing ``1 + select_weight * (t + 1)`` (its attention, bounded by k blocks, plus
  its selection over every earlier key; ``select_weight`` measured on an H200 by default,
  ``msa.distributed.SELECT_WEIGHT_H200_PAPER``).

Layouts: "contiguous" (even split), "balanced" (zigzag) and "contiguous-weighted"
(``msa.distributed.contiguous_sizes``: contiguous shards whose modelled work is equal).

    python bench/cp_bytes.py --lengths 128K,256K,512K --levels mixed,random --world 2,4 \\
        --out docs/cp-bytes-2ranks

Paper heads by default (Hq 64, Hkv 4, Hi 4, Hik 1, D = Di = 128, Bk 128, k 16, sink 1, local
4, bf16). On two CPU cores a 512K selection takes about 25 minutes (GEMMs of 1.4e14 FLOP).
"""

import argparse
import csv
import os
import sys
import time
from typing import Dict, List

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import selection_patterns as sp  # noqa: E402

PAPER = dict(Hq=64, Hkv=4, Hi=4, Hik=1, D=128, Di=128, Bk=128, k=16)
TINY = dict(Hq=4, Hkv=2, Hi=2, Hik=1, D=16, Di=16, Bk=16, k=8)
LAYOUTS = ("contiguous", "balanced", "contiguous-weighted")


def parse_tokens(text: str) -> List[int]:
    out = []
    for x in text.split(","):
        x = x.strip().upper()
        mult = 1 << 20 if x.endswith("M") else 1 << 10 if x.endswith("K") else 1
        out.append(int(x.rstrip("MK")) * mult)
    return out


def fmt_tokens(n: int) -> str:
    return f"{n >> 10}K" if n % 1024 == 0 else str(n)


def draw(alpha: float, T: int, h: Dict, seed: int, device="cpu"):
    """The index inputs of ``seed``, drawn by the CPU generator (the same numbers whatever
    ``device`` the selection runs on), on ``device``."""
    g = torch.Generator().manual_seed(seed)
    cu = torch.tensor([0, T], dtype=torch.int64)
    qi, ki = sp.index_inputs(alpha, cu, h["Hi"], h["Hik"], h["Di"], h["Bk"],
                             dtype=torch.bfloat16, generator=g)
    return qi.to(device), ki.to(device)


def sampled_blocks(T: int, Bk: int, pairs: int) -> List[int]:
    """``pairs`` pairs of neighbouring query blocks spread over the sequence (the first blocks,
    which select every block they see, left out unless the sequence is short)."""
    nb = (T + Bk - 1) // Bk
    if nb <= 2 * pairs:
        return list(range(nb))
    lo = min(nb // 8, 32)
    starts = [lo + (nb - 2 - lo) * i // max(pairs - 1, 1) for i in range(pairs)]
    return sorted({b for s in starts for b in (s, s + 1)})


def calibrate(target: float, T: int, h: Dict, seed: int, pairs: int, tol: float, device="cpu"):
    """alpha whose sampled query blocks' selections overlap ``target`` (bisection on the same
    random numbers, as ``selection_patterns.make_level`` does on the full selection)."""
    blocks = sampled_blocks(T, h["Bk"], pairs)
    Bk = h["Bk"]

    def f(a):
        qi, ki = draw(a, T, h, seed, device)
        bi = sp.select_by_gemm(qi, ki, [0, T], h["k"], Bk, sp.SINK_BLOCKS, sp.LOCAL_BLOCKS,
                               blocks=blocks).cpu()
        rows = torch.cat([torch.arange(b * Bk, min((b + 1) * Bk, T)) for b in blocks])
        # each run of neighbouring sampled blocks is a sequence of its own (no pair across runs)
        cuts, n = [0], 0
        for i, b in enumerate(blocks):
            n += min((b + 1) * Bk, T) - b * Bk
            if i + 1 == len(blocks) or blocks[i + 1] != b + 1:
                cuts.append(n)
        st = sp.selection_stats(bi[rows], torch.tensor(cuts), h["k"])
        st["alpha"] = float(a)
        return (st,)

    return sp._bisect(f, target, tol, 10)[-1]


def modelled_work(positions: List[torch.Tensor], w: float) -> List[float]:
    """Each rank's work in contiguous_sizes' model (one sequence: a row's position is t)."""
    return [float((1.0 + w * (p.double() + 1)).sum()) for p in positions]


def case(msad, T: int, level: str, seed: int, h: Dict, args) -> List[Dict]:
    t0 = time.time()
    lv = sp.LEVELS[level]
    if "target" in lv:
        alpha = calibrate(lv["target"], T, h, seed, args.calib_pairs, args.tol,
                          args.device)["alpha"]
    else:
        alpha = lv["alpha"]
    qi, ki = draw(alpha, T, h, seed, args.device)
    bi = sp.select_by_gemm(qi, ki, [0, T], h["k"], h["Bk"], sp.SINK_BLOCKS,
                           sp.LOCAL_BLOCKS).cpu()
    del qi, ki
    st = sp.selection_stats(bi, torch.tensor([0, T]), h["k"])
    t_sel = time.time() - t0
    rows = []
    cu = torch.tensor([0, T], dtype=torch.int64)
    for W, layout in [(w, x) for w in args.worlds for x in LAYOUTS]:
        sizes = None
        lay = layout
        if layout == "contiguous-weighted":
            sizes = msad.contiguous_sizes(W, T, select_weight=args.select_weight,
                                          block_size=h["Bk"])
            lay = "contiguous"
        pos = [msad.shard_positions(lay, r, W, T, cu, sizes=sizes) for r in range(W)]
        work = modelled_work(pos, args.select_weight)
        common = dict(block_size=h["Bk"], Hkv=h["Hkv"], D=h["D"], Hik=h["Hik"], Di=h["Di"],
                      element_size=2, cu_seqlens=cu, layout=lay, sizes=sizes, call=args.call)
        sel = msad.exchange_bytes(bi, W, exchange="selected", **common)
        ag = msad.exchange_bytes(None, W, exchange="allgather", **common)
        b_sel = sum(msad.moved_bytes(x) for x in sel)
        b_ag = sum(msad.moved_bytes(x) for x in ag)
        rows.append(dict(
            T=T, level=level, seed=seed, alpha=round(alpha, 4), overlap=round(st["overlap"], 3),
            union=round(st["union"], 3), world=W, layout=layout,
            sizes="/".join(str(int(p.numel())) for p in pos),
            mib_selected=round(b_sel / 2**20, 1), mib_allgather=round(b_ag / 2**20, 1),
            of_allgather=round(b_sel / b_ag, 4),
            mib_fwd=round(sum(msad.moved_bytes(x, "forward") for x in sel) / 2**20, 1),
            mib_bwd=round(sum(msad.moved_bytes(x, "backward") for x in sel) / 2**20, 1),
            fetched_tokens=sum(x["fetched_tokens"] for x in sel),
            work_max_over_mean=round(max(work) / (sum(work) / W), 4),
            select_weight=args.select_weight, call=args.call))
    print(f"  {fmt_tokens(T)} {level} seed {seed}: alpha {alpha:.3f}, overlap {st['overlap']:.3f}, union "
          f"{st['union']:.2f} ({t_sel:.0f} s)", flush=True)
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lengths", default="128K")
    ap.add_argument("--levels", default="mixed,random")
    ap.add_argument("--world", default="2", help="ranks, or a list (2,4,8): one selection each")
    ap.add_argument("--tiny", action="store_true", help="tiny heads (tests)")
    ap.add_argument("--seed", default="0",
                    help="the inputs' seed, or a list (0,1,2,3): one selection each; the mixed "
                         "level's union, and so its bytes, varies with the draw")
    ap.add_argument("--device", default="cpu",
                    help="where the selection's GEMMs run (cuda: minutes at 512K instead of "
                         "about 40 on two CPU cores); the inputs are the CPU generator's")
    ap.add_argument("--call", default="keys", choices=("keys", "rows"))
    ap.add_argument("--select-weight", type=float, default=None,
                    help="selection cost per earlier key, relative to the rest of a token's "
                         "step (default: msa.distributed.SELECT_WEIGHT_H200_PAPER)")
    ap.add_argument("--calib-pairs", type=int, default=16,
                    help="pairs of neighbouring query blocks the mixed level is calibrated on")
    ap.add_argument("--tol", type=float, default=0.005)
    ap.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: default)")
    ap.add_argument("--out", default="", help="write PREFIX.csv")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    args.worlds = [int(x) for x in str(args.world).split(",") if x.strip()]
    seeds = [int(x) for x in str(args.seed).split(",") if x.strip()]
    if args.device != "cpu":  # float32 scores as on the CPU: no TF32 in the selection's GEMMs
        torch.backends.cuda.matmul.allow_tf32 = False
    import msa.distributed as msad
    if args.select_weight is None:
        args.select_weight = msad.SELECT_WEIGHT_H200_PAPER
    h = TINY if args.tiny else PAPER
    rows = []
    cases = [(T, level, seed) for T in parse_tokens(args.lengths)
             for level in sp.level_names(args.levels) for seed in seeds]
    for T, level, seed in cases:
        rows += case(msad, T, level, seed, h, args)
        if args.out:  # after every case: a long run's finished cases are kept
            write_csv(args.out + ".csv", rows)
    print(f"\n## Bytes of a context-parallel step (computed from the selection; call="
          f"{args.call}), and the modelled work's balance\n")
    print("| T | index (overlap / union) | seed | ranks | layout | shard sizes | MiB selected | "
          "MiB all-gather | of all-gather | largest rank's work / mean |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {fmt_tokens(r['T'])} | {r['level']} ({r['overlap']:.2f} / {r['union']:.2f}) | "
              f"{r['seed']} | "
              f"{r['world']} | "
              f"{r['layout']} | {r['sizes']} | {r['mib_selected']:.1f} | "
              f"{r['mib_allgather']:.1f} | {r['of_allgather']:.1%} | "
              f"{r['work_max_over_mean']:.3f} |")
    if args.out:
        print(f"\nwrote {args.out}.csv")
    return 0


def write_csv(path: str, rows: List[Dict]) -> None:
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)


if __name__ == "__main__":
    sys.exit(main())
