#!/usr/bin/env python3
"""Recall of FP8 shortlist rules against the inputs' own selection, computed on the CPU: what a
rule for ``select_scores="fp8"`` would keep, before any kernel for it is written.

Contract §2's FP8 scores: each ``q_idx`` row and each block of ``k_idx`` rows (one sequence, one
index key head) is stored as E4M3 under the scale ``16 / amax``; ``M̂(t, b)`` is the block
maximum of the dequantised copies' products, ``M(t, b)`` that of the inputs'. The rules, for a
row with ``free`` slots left after the forced blocks (candidates ordered by ``M̂``, ties to the
lower block index):

* ``m`` (``Options::fp8_rerank = m``, the shipped rule): the best ``free + m`` candidates by
  ``M̂`` are shortlisted and the free slots go to the best of them by ``M`` (m = 0: ``M̂``
  alone);
* ``a/m`` (a candidate rule): the best ``free - a`` by ``M̂`` are kept as they are, the next
  ``a + m`` shortlisted, and the last ``a`` slots go to the best of those by ``M`` (rows with
  ``free <= a``: the rule ``m``).

Per rule it reports the recall (the share of the inputs' selection's non-forced entries the
rule's selection holds; forced blocks are in both) and the entries re-scored per row, which the
re-ranking kernels' time scales with. Rows: every token of ``--pairs`` pairs of neighbouring
query blocks spread over the sequence (the inputs of ``selection_patterns`` at the level; mixed
calibrated on those blocks as ``cp_bytes.py`` does). Scores in float32 by default (the GPU
accumulates the FP8 products in fp16, a relative error near 1e-3, which this leaves out);
``--double`` computes as the CPU backend does (the test compares the two).

    python bench/fp8_shortlist_recall.py --lengths 128K --levels mixed,random \\
        --rules 0,2,4,8,2/4,4/4,6/4 --out docs/fp8-shortlist-recall-cpu
"""

import argparse
import csv
import os
import sys
import time
from typing import Dict, List, Tuple

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import cp_bytes as cb  # noqa: E402
import selection_patterns as sp  # noqa: E402


def e4m3_copy(x: torch.Tensor, dims: Tuple[int, ...], dtype) -> torch.Tensor:
    """x's dequantised E4M3 copy, a group per slice over ``dims``: scale 16 / amax (1 when amax
    is 0 or not finite), the fp32 product rounded to E4M3 (nearest even), divided back."""
    xf = x.float()
    amax = xf.abs().nan_to_num(nan=0.0).amax(dim=dims, keepdim=True)
    ok = (amax > 0) & torch.isfinite(amax)
    s = torch.where(ok, 16.0 / torch.where(ok, amax, torch.ones_like(amax)), torch.ones_like(amax))
    return (xf * s).to(torch.float8_e4m3fn).to(dtype) / s.to(dtype)


def parse_rules(text: str) -> List[Tuple[int, int]]:
    """'0,4,4/4' -> [(a, m)]: a = -1 for the shipped rule m."""
    out = []
    for x in text.split(","):
        x = x.strip()
        if not x:
            continue
        a, m = x.split("/") if "/" in x else ("-1", x)
        if int(m) < 0 or (int(a) < 0 and "/" in x):
            raise ValueError(f"bad rule {x!r}")
        out.append((int(a), int(m)))
    return out


def rule_name(a: int, m: int) -> str:
    return str(m) if a < 0 else f"{a}/{m}"


def _best(score: torch.Tensor, cand: torch.Tensor, n: int) -> torch.Tensor:
    """Per row, the n best of the candidate columns ``cand`` ([R, C], each row's ascending)
    by ``score`` ([R, nblocks]), ties to the lower block: [R, n] block ids."""
    sc = score.gather(1, cand)
    order = torch.sort(sc, dim=1, descending=True, stable=True).indices
    return cand.gather(1, order[:, :n])


def select_rows(BM: torch.Tensor, BM8: torch.Tensor, cand: torch.Tensor, free: int, a: int,
                m: int) -> torch.Tensor:
    """Rows' chosen candidate blocks under rule (a, m) (a < 0: the shipped rule; BM8 None: the
    inputs' own rule), as a [R, nblocks] mask."""
    R = BM.shape[0]
    chosen = torch.zeros_like(BM, dtype=torch.bool)
    C = cand.shape[1]
    if C <= free:  # short rows: every candidate
        chosen[:, cand[0]] = True
        return chosen
    if BM8 is None:
        chosen.scatter_(1, _best(BM, cand, free), True)
        return chosen
    if m == 0:
        chosen.scatter_(1, _best(BM8, cand, free), True)
        return chosen
    keep = max(0, free - a) if a >= 0 else 0
    ranked = _best(BM8, cand, min(C, free + m))  # the FP8 order of the shortlist
    if keep:
        chosen.scatter_(1, ranked[:, :keep], True)
    short = ranked[:, keep:].sort(dim=1).values  # ascending: ties to the lower block
    chosen.scatter_(1, _best(BM, short, free - keep), True)
    return chosen


def block_scores(q: torch.Tensor, k: torch.Tensor, nblk: int, Bk: int) -> torch.Tensor:
    """[R, nblk] block maxima of q [R, Di] against k [nblk * Bk, Di]."""
    return (q @ k.T).view(q.shape[0], nblk, Bk).amax(-1)


def key_copies(ki: torch.Tensor, Bk: int, dt) -> torch.Tensor:
    """k_idx's dequantised E4M3 copy: a group per block of one index key head (one sequence
    from token 0)."""
    T, Hik, Di = ki.shape
    nb = (T + Bk - 1) // Bk
    kp = torch.cat([ki, ki.new_zeros(nb * Bk - T, Hik, Di)]) if nb * Bk > T else ki
    return e4m3_copy(kp.view(nb, Bk, Hik, Di), (1, 3), dt).view(nb * Bk, Hik, Di)[:T]


def block_rows(qi, ki, k8, b: int, ik: int, h: Dict, dt):
    """Query block b's rows of index key head ik (token-major, then the group's heads): (BM,
    BM8, cand, free) with BM / BM8 the inputs' / the copies' block maxima over blocks
    [0, first local block), cand the candidate blocks and free the slots they compete for;
    None when the rows have no candidate or no free slot."""
    Bk, k = h["Bk"], h["k"]
    G = h["Hi"] // h["Hik"]
    T = qi.shape[0]
    t_lo, t_hi = b * Bk, min((b + 1) * Bk, T)
    first_local = max(0, b - sp.LOCAL_BLOCKS + 1)
    lo = min(sp.SINK_BLOCKS, first_local)
    free = k - (lo + (b - first_local + 1))
    if free <= 0 or first_local <= lo:
        return None
    qb = qi[t_lo:t_hi, ik * G:(ik + 1) * G]
    q = qb.to(dt).reshape(-1, qi.shape[2])
    q8 = e4m3_copy(qb, (2,), dt).reshape(-1, qi.shape[2])
    n = first_local * Bk
    BM = block_scores(q, ki[:n, ik].to(dt), first_local, Bk)
    BM8 = block_scores(q8, k8[:n, ik], first_local, Bk)
    return BM, BM8, torch.arange(lo, first_local).expand(q.shape[0], -1), free


def case(T: int, level: str, seed: int, h: Dict, rules, args) -> List[Dict]:
    t0 = time.time()
    lv = sp.LEVELS[level]
    alpha = (cb.calibrate(lv["target"], T, h, seed, args.pairs, args.tol)["alpha"]
             if "target" in lv else lv["alpha"])
    qi, ki = cb.draw(alpha, T, h, seed)
    dt = torch.float64 if args.double else torch.float32
    k8 = key_copies(ki, h["Bk"], dt)
    hits = {r: 0 for r in rules}
    rescored = {r: 0 for r in rules}
    total = n_rows = 0
    for b in cb.sampled_blocks(T, h["Bk"], args.pairs):
        for ik in range(h["Hik"]):
            got = block_rows(qi, ki, k8, b, ik, h, dt)
            if got is None:
                continue
            BM, BM8, cand, free = got
            ref = select_rows(BM, None, cand, free, -1, 0)
            total += int(ref.sum())
            n_rows += BM.shape[0]
            C = cand.shape[1]
            for (a, m) in rules:
                hits[(a, m)] += int((select_rows(BM, BM8, cand, free, a, m) & ref).sum())
                if m > 0 and C > free:
                    keep = max(0, free - a) if a >= 0 else 0
                    rescored[(a, m)] += (min(C, free + m) - keep) * BM.shape[0]
    out = []
    for (a, m) in rules:
        out.append(dict(T=T, level=level, seed=seed, alpha=round(alpha, 4), rule=rule_name(a, m),
                        rescored_per_row=round(rescored[(a, m)] / max(1, n_rows), 2),
                        recall=round(hits[(a, m)] / max(1, total), 5),
                        misses=total - hits[(a, m)], entries=total, rows=n_rows,
                        scores="float64" if args.double else "float32"))
    print(f"  {cb.fmt_tokens(T)} {level} seed {seed}: alpha {alpha:.3f}, {n_rows} rows "
          f"({time.time() - t0:.0f} s)", flush=True)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lengths", default="128K")
    ap.add_argument("--levels", default="mixed,random")
    ap.add_argument("--rules", default="0,2,4,8,2/4,4/4,6/4,4/2",
                    help="m (the shipped rule, fp8_rerank = m) or a/m (keep free - a by FP8)")
    ap.add_argument("--seed", default="1", help="the inputs' seed, or a list")
    ap.add_argument("--pairs", type=int, default=12,
                    help="pairs of neighbouring query blocks (their rows are scored)")
    ap.add_argument("--tol", type=float, default=0.005)
    ap.add_argument("--double", action="store_true", help="float64 scores (the CPU backend's)")
    ap.add_argument("--tiny", action="store_true", help="tiny heads (tests)")
    ap.add_argument("--out", default="", help="write PREFIX.csv")
    ap.add_argument("--csv", default="", help="with --plot: CSVs of earlier runs to plot")
    ap.add_argument("--plot", default="", help="write a PNG: recall against the blocks a row "
                    "re-scores, one panel per length, from this run's or these CSVs' rows "
                    "(comma-separated; no computing then)")
    args = ap.parse_args(argv)
    h = cb.TINY if args.tiny else cb.PAPER
    rules = parse_rules(args.rules)
    rows = []
    if args.plot and args.csv:
        for f in args.csv.split(","):
            with open(f) as fh:
                rows += list(csv.DictReader(fh))
        plot(rows, args.plot)
        return 0
    for T in cb.parse_tokens(args.lengths):
        for level in sp.level_names(args.levels):
            for seed in [int(x) for x in str(args.seed).split(",") if x.strip()]:
                rows += case(T, level, seed, h, rules, args)
                if args.out:
                    cb.write_csv(args.out + ".csv", rows)
    print("\n## Recall of FP8 shortlist rules (non-forced entries of the inputs' selection)\n")
    print("| T | level | seed | rule | entries re-scored per row | recall | misses |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {cb.fmt_tokens(r['T'])} | {r['level']} | {r['seed']} | {r['rule']} | "
              f"{r['rescored_per_row']:.2f} | {r['recall']:.4f} | {r['misses']} |")
    if args.plot:
        plot(rows, args.plot)
    return 0


def plot(rows: List[Dict], path: str) -> None:
    """Recall against the blocks each row re-scores: a panel per length, a series per level
    (summed over seeds), each rule a labelled point (the rule m joined by a line)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    lengths = sorted({int(r["T"]) for r in rows})
    fig, axes = plt.subplots(1, len(lengths), figsize=(5.5 * len(lengths), 4.2), squeeze=False)
    for ax, T in zip(axes[0], lengths):
        for level, colour in (("mixed", "tab:blue"), ("random", "tab:orange"), ("shared", "tab:green")):
            agg: Dict[str, List[float]] = {}
            for r in rows:
                if int(r["T"]) == T and r["level"] == level:
                    a = agg.setdefault(r["rule"], [0.0, 0.0, float(r["rescored_per_row"])])
                    a[0] += int(r["entries"]) - int(r["misses"])
                    a[1] += int(r["entries"])
            if not agg:
                continue
            pts = {k: (v[2], v[0] / v[1]) for k, v in agg.items()}
            plain = sorted((p for k, p in pts.items() if "/" not in k))
            ax.plot([p[0] for p in plain], [p[1] for p in plain], "-o", color=colour,
                    label=f"{level}: fp8_rerank m")
            slots = [(k, p) for k, p in pts.items() if "/" in k]
            ax.plot([p[0] for _, p in slots], [p[1] for _, p in slots], "s", color=colour,
                    mfc="none", label=f"{level}: slots a / m")
            for k, p in pts.items():
                ax.annotate(k, p, textcoords="offset points", xytext=(4, -10), fontsize=7)
        ax.axhline(0.98, color="grey", lw=0.8, ls="--")
        ax.set_title(f"T = {cb.fmt_tokens(T)}: FP8 selection's recall of the inputs' (non-forced)",
                     fontsize=9)
        ax.set_xlabel("blocks re-scored by the inputs' scores, per row")
        ax.set_ylabel("recall")
        ax.legend(fontsize=7, loc="lower right")
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


if __name__ == "__main__":
    sys.exit(main())
