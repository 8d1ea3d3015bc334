#!/usr/bin/env python3
"""PNG plots of the benchmarks' CSV files (``--out PREFIX`` of bench_forward.py and
bench_backward.py), written next to each CSV as PREFIX.png.

One column of subplots per head configuration; lines per overlap level, labelled with the
overlap the level's selections measured (its range over the lengths); x: sequence length.

* bench_forward.py CSV: speedup of the whole MSA forward over dense attention; effective
  TFLOP/s of the sparse forward over a given block_idx and of the whole MSA forward (dense
  attention's TFLOP/s dashed, for reference).
* bench_backward.py CSV: training-step speedup over dense forward + backward; effective TFLOP/s
  of the sparse forward, the backward, the backward with the KL gradient and the whole step.
* bench_serving.py CSV (its decode rows): per (context, batch, q_len), the graph-replayed decode
  step of each cache dtype next to SDPA and dense paged attention (ms, log scale), and the step's
  speedup over SDPA. A CSV of prefill rows only (``--no-decode``): per chunk, the effective
  TFLOP/s of the attention by each walk of the forward (query tiles, split, KV block, and the
  library's choice, also over E4M3 caches), labelled with the overlap of the timed selection,
  and below it the indexer's TFLOP/s by its scores (bf16, FP8 re-ranked and alone, E4M3 keys)
  where the CSV has them.

    python bench/plot_bench.py bench-out/forward.csv bench-out/backward.csv

Needs matplotlib (requirements-dev.txt); runs headless (the Agg backend).
"""

import argparse
import csv
import math
import os
import sys
from typing import Dict, List, Optional, Sequence

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

LEVEL_ORDER = ["shared", "mixed", "random"]
COLORS = {"shared": "tab:blue", "mixed": "tab:orange", "random": "tab:green"}

# (title, y label, column of a level's value: forward CSVs name it per level, backward CSVs per
# row), the first row of each figure being the speedup
FORWARD_PANELS = [
    ("MSA forward vs dense", "speedup (x)", "speedup_{level}"),
    ("sparse forward, given block_idx", "effective TFLOP/s", "fwd_{level}_tflops"),
    ("whole MSA forward", "effective TFLOP/s", "msa_{level}_tflops"),
]
BACKWARD_PANELS = [
    ("training step vs dense fwd+bwd", "speedup (x)", "step_speedup"),
    ("sparse forward", "effective TFLOP/s", "fwd_tflops"),
    ("backward", "effective TFLOP/s", "bwd_tflops"),
    ("backward + KL gradient", "effective TFLOP/s", "bwd_kl_tflops"),
    ("training step", "effective TFLOP/s", "step_tflops"),
]


def _num(v) -> Optional[float]:
    try:
        x = float(v)
    except (TypeError, ValueError):
        return None
    return x if math.isfinite(x) else None


def _fmt_tokens(n: int) -> str:
    if n % (1024 * 1024) == 0:
        return f"{n // (1024 * 1024)}M"
    if n % 1024 == 0:
        return f"{n // 1024}K"
    return str(n)


def read_rows(path: str) -> List[Dict[str, str]]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def _levels(names: Sequence[str]) -> List[str]:
    seen = [n for n in LEVEL_ORDER if n in names]
    return seen + sorted(n for n in set(names) if n not in seen)


def series(rows: List[Dict[str, str]]) -> Dict:
    """{config: {level: [(T, row, overlap)]}} and the kind of CSV (backward: a row per level;
    forward: a row per length with the levels' columns in it)."""
    backward = bool(rows) and "index" in rows[0]
    out: Dict[str, Dict[str, list]] = {}
    for r in rows:
        cfg, T = r.get("config", "?"), int(float(r["T"]))
        if backward:
            lv = {r["index"]: (r, _num(r.get("overlap")))}
        else:
            names = [k[: -len("_overlap")] for k in r if k.endswith("_overlap")]
            lv = {n: (r, _num(r.get(f"{n}_overlap"))) for n in names}
        for name, (vals, ov) in lv.items():
            out.setdefault(cfg, {}).setdefault(name, []).append((T, vals, ov))
    for cfg in out:
        for name in out[cfg]:
            out[cfg][name].sort(key=lambda x: x[0])
    return dict(backward=backward, data=out)


def _label(name: str, points) -> str:
    ovs = [ov for _, _, ov in points if ov is not None]
    if not ovs:
        return name
    lo, hi = min(ovs), max(ovs)
    if hi - lo < 0.005:
        return f"{name} (overlap {lo:.2f})"
    return f"{name} (overlap {lo:.2f}–{hi:.2f})"


def _save(fig, path: str, out: Optional[str]) -> str:
    fig.tight_layout()
    if out is None:
        out = os.path.splitext(path)[0] + ".png"
    d = os.path.dirname(out)
    if d:
        os.makedirs(d, exist_ok=True)
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


def plot_serving(rows: List[Dict[str, str]], path: str, out: Optional[str] = None) -> str:
    """The decode rows of a bench_serving.py CSV: bars of the graph-replayed step per shape and
    cache dtype, with SDPA and dense paged attention (the bf16 row's, measured in the same run);
    below, the step's speedup over SDPA."""
    dec = [r for r in rows if r.get("kind") == "decode"]
    if not dec:
        raise ValueError(f"{path}: no decode rows")
    shapes = sorted({(int(r["ctx"]), int(r["batch"]), int(r["q_len"])) for r in dec})
    caches = sorted({r.get("cache") or "bf16" for r in dec})
    by = {((int(r["ctx"]), int(r["batch"]), int(r["q_len"])), r.get("cache") or "bf16"): r for r in dec}
    base = {sh: by.get((sh, "bf16")) or next(by[k] for k in by if k[0] == sh) for sh in shapes}
    bars = [(c, lambda sh, c=c: _num(by.get((sh, c), {}).get("graph_ms"))) for c in caches]
    bars += [("SDPA (bf16)", lambda sh: _num(base[sh].get("sdpa_ms"))),
             ("dense paged (bf16)", lambda sh: _num(base[sh].get("dense_ms")))]
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(max(6.0, 1.1 * len(shapes) + 2), 6.4))
    width = 0.8 / len(bars)
    xs = list(range(len(shapes)))
    for i, (name, value) in enumerate(bars):
        pts = [(x, value(sh)) for x, sh in zip(xs, shapes)]
        pts = [(x, y) for x, y in pts if y is not None]
        if pts:
            top.bar([x - 0.4 + (i + 0.5) * width for x, _ in pts], [y for _, y in pts], width, label=name)
    w2 = 0.8 / len(caches)
    for i, c in enumerate(caches):
        pts = [(x, _num(base[sh].get("sdpa_ms")), _num(by.get((sh, c), {}).get("graph_ms")))
               for x, sh in zip(xs, shapes)]
        pts = [(x, a / b) for x, a, b in pts if a is not None and b]
        if pts:
            bottom.bar([x - 0.4 + (i + 0.5) * w2 for x, _ in pts], [y for _, y in pts], w2, label=c)
    labels = [f"{_fmt_tokens(c)}\nB{b} q{q}" for c, b, q in shapes]
    for ax in (top, bottom):
        ax.set_xticks(xs)
        ax.set_xticklabels(labels, fontsize=8)
        ax.grid(True, alpha=0.3)
    top.set_yscale("log")
    top.set_ylabel("ms")
    top.set_title("decode step (MSA: one CUDA-graph replay)", fontsize=10)
    top.legend(fontsize=8)
    bottom.set_ylabel("speedup over SDPA (x)")
    bottom.set_title("MSA decode step vs SDPA, by cache dtype", fontsize=10)
    if bottom.patches:
        bottom.legend(fontsize=8)
    return _save(fig, path, out)


PREFILL_WALKS = [("query tiles", "attend_query_tile_ms"), ("split", "attend_split_ms"),
                 ("KV block", "attend_kv_block_ms"), ("auto (the library's choice)", "attend_ms"),
                 ("auto, E4M3 k and v", "attend_e4m3_cache_ms"),
                 ("auto, E4M3 q, k and v", "attend_q8_e4m3_cache_ms")]
# The indexer's TFLOP/s columns, by the scores it ranks blocks by.
PREFILL_INDEXERS = [("bf16 scores", "indexer_tflops"), ("FP8, re-ranked (default)", "indexer_fp8_tflops"),
                    ("FP8 alone", "indexer_fp8_alone_tflops"), ("E4M3 k_idx cache", "indexer_e4m3_cache_tflops"),
                    ("E4M3 k_idx cache, FP8 scores", "indexer_fp8_e4m3_cache_tflops")]


def _bars(ax, xs, series) -> None:
    """Grouped bars: series is [(label, [(x, y) ...])], empty ones left out of the groups."""
    series = [(name, pts) for name, pts in series if pts]
    width = 0.8 / max(1, len(series))
    for i, (name, pts) in enumerate(series):
        ax.bar([x - 0.4 + (i + 0.5) * width for x, _ in pts], [y for _, y in pts], width, label=name)


def plot_prefill(rows: List[Dict[str, str]], path: str, out: Optional[str] = None) -> str:
    """The prefill rows of a bench_serving.py CSV: per chunk (new tokens after a prefix), bars of
    the attention's effective TFLOP/s by each walk (the selected work over each walk's time),
    and, where the CSV has them, of the indexer's TFLOP/s by the scores it ranks by."""
    pre = [r for r in rows if r.get("kind") == "prefill"]
    if not pre:
        raise ValueError(f"{path}: no prefill rows")
    xs = list(range(len(pre)))
    indexers = [(name, [(x, _num(r.get(col))) for x, r in zip(xs, pre) if _num(r.get(col))])
                for name, col in PREFILL_INDEXERS]
    with_index = any(pts for _, pts in indexers)
    fig, axes = plt.subplots(2 if with_index else 1, 1, squeeze=False,
                             figsize=(max(6.0, 1.6 * len(pre) + 2), 7.6 if with_index else 4.0))
    ax = axes[0][0]
    walks = []
    for name, col in PREFILL_WALKS:
        pts = []
        for x, r in zip(xs, pre):
            ms, rate, auto_ms = _num(r.get(col)), _num(r.get("attend_tflops")), _num(r.get("attend_ms"))
            if ms and rate is not None and auto_ms:
                pts.append((x, rate * auto_ms / ms))  # the same work over this walk's time
        walks.append((name, pts))
    _bars(ax, xs, walks)
    labels = []
    for r in pre:
        q, ctx = int(float(r["q_len"])), int(float(r["ctx"]))
        labels.append(f"{_fmt_tokens(q)} after {_fmt_tokens(ctx - q)}\noverlap {r.get('overlap', '?')}")
    ax.set_title("sparse prefill attention over the pages, by walk", fontsize=10)
    panels = [ax]
    if with_index:
        ix = axes[1][0]
        _bars(ix, xs, indexers)
        ix.set_title("the prefill's indexer, by the scores it ranks blocks by", fontsize=10)
        panels.append(ix)
    for a in panels:
        a.set_xticks(xs)
        a.set_xticklabels(labels, fontsize=8)
        a.set_ylabel("effective TFLOP/s")
        a.grid(True, alpha=0.3)
        if a.patches:
            a.legend(fontsize=8)
    return _save(fig, path, out)


def plot_csv(path: str, out: Optional[str] = None) -> str:
    """Plots one benchmark CSV; returns the PNG's path (``out``, else the CSV's with .png)."""
    rows = read_rows(path)
    if not rows:
        raise ValueError(f"{path}: no rows")
    if "kind" in rows[0] and "ctx" in rows[0]:
        if any(r.get("kind") == "decode" for r in rows):
            return plot_serving(rows, path, out)
        return plot_prefill(rows, path, out)
    s = series(rows)
    panels = BACKWARD_PANELS if s["backward"] else FORWARD_PANELS
    configs = list(s["data"])
    fig, axes = plt.subplots(len(panels), len(configs), squeeze=False,
                             figsize=(5.5 * len(configs), 3.2 * len(panels)))
    dense_by_cfg = {}
    if not s["backward"]:
        for r in rows:
            if r.get("dense_source") == "measured" and _num(r.get("dense_tflops")) is not None:
                dense_by_cfg.setdefault(r["config"], []).append(
                    (int(float(r["T"])), _num(r["dense_tflops"])))
    for j, cfg in enumerate(configs):
        levels = _levels(list(s["data"][cfg]))
        lengths = sorted({T for pts in s["data"][cfg].values() for T, _, _ in pts})
        for i, (title, ylabel, col) in enumerate(panels):
            ax = axes[i][j]
            for name in levels:
                pts = s["data"][cfg][name]
                xy = [(T, _num(vals.get(col.format(level=name)))) for T, vals, _ in pts]
                xy = [(x, y) for x, y in xy if y is not None]
                if not xy:
                    continue
                ax.plot([x for x, _ in xy], [y for _, y in xy], marker="o",
                        color=COLORS.get(name), label=_label(name, pts))
            if i > 0 and cfg in dense_by_cfg:
                d = sorted(dense_by_cfg[cfg])
                ax.plot([x for x, _ in d], [y for _, y in d], "k--", marker=".", linewidth=1,
                        label="dense attention")
            ax.set_xscale("log", base=2)
            ax.set_xticks(lengths)
            ax.set_xticklabels([_fmt_tokens(T) for T in lengths])
            ax.minorticks_off()
            ax.set_title(f"{cfg}: {title}", fontsize=10)
            ax.set_ylabel(ylabel)
            ax.grid(True, alpha=0.3)
            if i == len(panels) - 1:
                ax.set_xlabel("sequence length")
            if ax.lines:
                ax.legend(fontsize=8)
    return _save(fig, path, out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("csv", nargs="+",
                    help="CSV files of bench_forward.py / bench_backward.py / bench_serving.py")
    ap.add_argument("--out", default=None, help="the PNG's path (one CSV only)")
    args = ap.parse_args(argv)
    if args.out and len(args.csv) != 1:
        raise SystemExit("--out takes one CSV")
    for path in args.csv:
        print(plot_csv(path, args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
