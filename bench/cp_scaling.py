#!/usr/bin/env python3
"""Context-parallel scaling of the MSA training step (msa.distributed) over 1, 2, 4, 8 ... GPUs,
all from one launch: strong scaling (one sequence of ``--strong`` tokens on every GPU count) and
weak scaling (``--weak`` tokens per GPU).

One launch of N processes (torchrun on N GPUs, or ``--spawn N`` local processes on the CPU
backend over gloo) forms a group of the first W ranks for every W of ``--worlds`` up to N; the
ranks outside it wait. Per (mode, overlap level, W), on inputs of paper heads by default (bf16,
k 16, sink 1, local 4; ``selection_patterns`` levels, "mixed" calibrated once at the first
length and then fixed, as ``bench_cp.py --fit`` does):

* step     one training step (forward, and the gradient of <out, g> + KL with the KL value
           skipped, as ``bench_backward``'s "step"): ``msa.distributed.sparse_attention`` over the
           group (balanced = zigzag shards, selected K/V exchange), only each rank's shard of q,
           k, v drawn; W = 1 runs ``msa.sparse_attention`` on the whole sequence (the one-GPU
           step, no context parallelism). Median of ``--reps`` steps of the slowest rank;
* peak     the largest peak of device memory over the group's ranks (CUDA);
* bytes    received by all ranks per step with the selected exchange (measured) and what the
           all-gather baseline would receive (``msa.distributed.exchange_bytes``, computed);
* comm     with ``--phases``: one more step with the device synchronised between phases, the
           share of its time spent in the communication phases (index-key all-gather, K/V
           exchange, gradient exchange), the slowest rank's of each;
* efficiency  strong: t(W0) W0 / (t(W) W), weak: t(W0) / t(W), W0 the smallest W that ran.

A case whose peak memory, predicted from the same W's last case (per token of a shard), would
pass 92% of the device is skipped (a rank out of memory inside a collective would stop the
others). ``--check`` compares, at the strong length, each W's output and five gradients with the
one-rank step's (a check for small shapes: every rank draws the whole tensors and runs the
one-rank step too).

    torchrun --standalone --nproc-per-node 8 bench/cp_scaling.py --out cp-scaling-h200
    python bench/cp_scaling.py --device cpu --tiny --spawn 4 --check    # gloo, CPU backend

``--out PREFIX`` writes PREFIX.csv and, where matplotlib is installed, PREFIX.png (step time and
efficiency against the GPU count, a line per mode and level).
"""

import argparse
import csv
import os
import sys
from typing import Dict, List, Optional

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_cp as bc  # noqa: E402  (sets NVLink multicast off before torch.distributed)
import selection_patterns as sp  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

COMM_PHASES = ("k_idx_gather", "kv_exchange", "grad_exchange")


def _peak(device) -> int:
    return torch.cuda.max_memory_allocated(device) if device.type == "cuda" else 0


def _gib(x) -> str:
    return "-" if x is None else f"{x}"


def run_case(msa, msad, mode: str, T: int, level: str, alpha, W: int, group, h: Dict, args,
             device) -> Dict:
    """The step at T tokens on the first W ranks (this rank among them)."""
    single = W == 1
    step, st = bc.shard_step(msa, msad, T, level, alpha, h, args, device, group=group,
                             single=single)
    timer = bc.Timer(device, group)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    ms = timer.ms(step, args.reps)
    peak = bc._all_reduce(_peak(device), dist.ReduceOp.MAX, group)
    row = dict(mode=mode, T=T, level=level, overlap=round(st["overlap"], 3),
               union=round(st["union"], 3), world=W, ms=round(ms, 2),
               tokens_per_s=round(T / ms * 1e3),
               peak_gib=round(peak / 2**30, 2) if device.type == "cuda" else None)
    if not single:
        stats = step()
        got = bc._all_reduce(msad.moved_bytes(stats), dist.ReduceOp.SUM, group)
        cu = torch.tensor([0, T], dtype=torch.int32)
        base = sum(msad.moved_bytes(r) for r in msad.exchange_bytes(
            None, W, cu_seqlens=cu, layout="balanced", block_size=h["Bk"], Hkv=h["Hkv"],
            D=h["D"], Hik=h["Hik"], Di=h["Di"], element_size=2 if device.type == "cuda" else 4,
            exchange="allgather", call=stats["call"]))
        row.update(mib_selected=round(got / 2**20, 2), mib_allgather=round(base / 2**20, 2),
                   of_allgather=round(got / base, 3) if base else float("nan"))
        if args.phases:
            ph = {k[3:]: v for k, v in step(phase_times=True).items() if k.startswith("ms_")}
            total = bc._all_reduce(sum(ph.values()), dist.ReduceOp.MAX, group)
            comm = bc._all_reduce(sum(ph.get(k, 0.0) for k in COMM_PHASES), dist.ReduceOp.MAX,
                                  group)
            row.update(phases_ms=round(total, 2), comm_ms=round(comm, 2),
                       comm_share=round(comm / total, 3) if total else float("nan"))
    del step
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return row


def check_case(msa, msad, T: int, level: str, alpha, W: int, group, h: Dict, args,
               device) -> Dict[str, float]:
    """The largest error of the W-rank step's output and gradients against the one-rank step
    on the same inputs (relative to the largest reference element)."""
    cu, gen, dtype, q_idx, k_idx, _ = bc.level_inputs(T, level, alpha, h, args, device)
    full = [torch.randn(T, h["Hq"], h["D"], device=device, generator=gen, dtype=dtype)]
    full += [torch.randn(T, h["Hkv"], h["D"], device=device, generator=gen, dtype=dtype)
             for _ in range(2)]
    full += [q_idx, k_idx]
    gout = torch.randn(T, h["Hq"], h["D"], device=device, generator=gen, dtype=dtype)
    opts = dict(top_k=h["k"], block_size=h["Bk"], sink_blocks=sp.SINK_BLOCKS,
                local_blocks=sp.LOCAL_BLOCKS)

    def grads(fn, xs, g):
        xs = [x.detach().clone().requires_grad_(True) for x in xs]
        out, kl = fn(xs)
        return [out.detach()] + list(torch.autograd.grad((out, kl), xs, (g, torch.ones_like(kl))))

    ref = grads(lambda xs: msa.sparse_attention(*xs, cu_seqlens=cu, **opts), full, gout)
    pos = msad.shard_positions("balanced", dist.get_rank(group), W, T, cu).to(device)
    got = grads(lambda xs: msad.sparse_attention(*xs, cu_seqlens=cu, group=group,
                                                 layout="balanced", call=args.call, **opts),
                [x[pos] for x in full], gout[pos])
    errs = {}
    for name, a, b in zip(("out", "dq", "dk", "dv", "dq_idx", "dk_idx"), got, ref):
        e = bc._all_reduce((a.float() - b[pos].float()).abs().max().item(), dist.ReduceOp.MAX,
                           group)
        errs[name] = e / max(b.float().abs().max().item(), 1e-30)
    return errs


def efficiency(rows: List[Dict]) -> None:
    """Each row's efficiency against the smallest W of its (mode, level) that ran."""
    for r in rows:
        if r.get("ms") is None:
            continue
        ran = [x for x in rows if x["mode"] == r["mode"] and x["level"] == r["level"]
               and x.get("ms") is not None]
        b = min(ran, key=lambda x: x["world"])
        if r["mode"] == "strong":
            r["efficiency"] = round(b["ms"] * b["world"] / (r["ms"] * r["world"]), 3)
        else:
            r["efficiency"] = round(b["ms"] / r["ms"], 3)


def plot(rows: List[Dict], path: str) -> Optional[str]:
    try:
        import matplotlib
    except ImportError:
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(6.4, 7.2), sharex=True)
    for (mode, level) in sorted({(r["mode"], r["level"]) for r in rows}):
        xs = [r for r in rows if r["mode"] == mode and r["level"] == level and r.get("ms")]
        if not xs:
            continue
        if mode == "strong":
            label = f"strong ({'/'.join(sorted({bc.fmt_tokens(r['T']) for r in xs}))}), {level}"
        else:
            label = f"weak ({bc.fmt_tokens(xs[0]['T'] // xs[0]['world'])} a GPU), {level}"
        style = "-" if mode == "strong" else "--"
        top.plot([r["world"] for r in xs], [r["ms"] for r in xs], style, marker="o", label=label)
        bottom.plot([r["world"] for r in xs], [r["efficiency"] for r in xs], style, marker="o",
                    label=label)
    top.set_ylabel("training step, ms")
    top.set_yscale("log")
    bottom.set_ylabel("efficiency")
    bottom.set_ylim(0, 1.1)
    bottom.set_xlabel("GPUs")
    worlds = sorted({r["world"] for r in rows})
    bottom.set_xscale("log", base=2)
    bottom.set_xticks(worlds, [str(w) for w in worlds])
    top.legend(fontsize=8)
    top.grid(True, alpha=0.3)
    bottom.grid(True, alpha=0.3)
    fig.suptitle("MSA context parallelism: scaling of the training step", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def report(rows: List[Dict], checks: List[Dict], out: Optional[str]) -> None:
    efficiency(rows)
    print("\n## MSA context parallelism: scaling of the training step (balanced shards, "
          "selected exchange)\n")
    print("| mode | T | level (overlap / union) | GPUs | step ms | tokens/s | efficiency | "
          "peak GiB | vs all-gather bytes | comm share |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        if r.get("ms") is None:
            print(f"| {r['mode']} | {bc.fmt_tokens(r['T'])} | {r['level']} | {r['world']} | "
                  f"{r['note']} | | | | | |")
            continue
        print(f"| {r['mode']} | {bc.fmt_tokens(r['T'])} | {r['level']} ({r['overlap']:.2f} / "
              f"{r['union']:.2f}) | {r['world']} | {r['ms']:.1f} | {r['tokens_per_s']} | "
              f"{r['efficiency']:.2f} | {_gib(r['peak_gib'])} | "
              + (f"{r['of_allgather']:.0%}" if "of_allgather" in r else "-") + " | "
              + (f"{r['comm_share']:.0%}" if "comm_share" in r else "-") + " |")
    for c in checks:
        print(f"\ncheck {bc.fmt_tokens(c['T'])} {c['level']} on {c['world']} ranks against one "
              "(max error / max |reference|): "
              + ", ".join(f"{k[4:]} {v}" for k, v in c.items() if k.startswith("err_")))
    if out:
        keys = list(dict.fromkeys(k for r in rows + checks for k in r))
        with open(out + ".csv", "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=keys)
            w.writeheader()
            w.writerows(rows + checks)
        print(f"\nwrote {out}.csv")
        png = plot([r for r in rows if r.get("ms") is not None], out + ".png")
        if png:
            print(f"wrote {png}")


def run(args) -> int:
    import msa
    import msa.distributed as msad
    N, rank = dist.get_world_size(), dist.get_rank()
    if args.device == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank)))
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
        torch.set_num_threads(max(1, (os.cpu_count() or 2) // N))
    bc._DEVICE[0] = device
    h = dict(bc.TINY if args.tiny else bc.PAPER)
    worlds = sorted({int(w) for w in args.worlds.split(",") if w.strip() and int(w) <= N})
    if not worlds:
        raise SystemExit(f"argument --worlds: {args.worlds!r} has no GPU count up to the "
                         f"launch's {N}")
    groups = {W: dist.new_group(list(range(W))) for W in worlds}  # every rank, in one order
    levels = sp.level_names(args.index)
    strong = bc.parse_tokens(args.strong) if args.strong else []
    weak = bc.parse_tokens(args.weak)[0] if args.weak else 0
    cap = torch.cuda.get_device_properties(device).total_memory if device.type == "cuda" else 0
    bc.log(f"msa.distributed scaling: worlds {worlds} of {N} ranks ({dist.get_backend()}, "
           f"{device.type}), heads {h}, strong {[bc.fmt_tokens(x) for x in strong]}, weak "
           f"{bc.fmt_tokens(weak) + ' per GPU' if weak else '-'}, levels {levels}")
    # The calibrated levels' alpha, from the first length (the same inputs on every rank).
    first = (strong or [weak])[0]
    alphas = {}
    for level in levels:
        _, _, _, st = sp.make_level(level, torch.tensor([0, first], dtype=torch.int32,
                                                        device=device),
                                    h["Hi"], h["Hik"], h["Di"], h["Bk"], h["k"], device=device,
                                    seed=args.seed)
        alphas[level] = st.get("alpha")
    cases = [("strong", T, level) for T in strong for level in levels]
    if weak:
        cases += [("weak", weak, level) for level in levels]
    rows, checks, per_token = [], [], {}
    for mode, T0, level in cases:
        for W in worlds:
            T = T0 * W if mode == "weak" else T0
            row = None
            if rank < W:
                if cap and W in per_token and per_token[W] * T / W > 0.92 * cap:
                    peak = per_token[W] * T / W / 2**30
                    row = dict(mode=mode, T=T, level=level, world=W, ms=None,
                               peak_gib=round(peak, 1), note=f"skipped (predicted peak "
                               f"{peak:.0f} GiB of {cap / 2**30:.0f} GiB)")
                else:
                    try:
                        row = run_case(msa, msad, mode, T, level, alphas[level], W, groups[W],
                                       h, args, device)
                    except torch.cuda.OutOfMemoryError:
                        if W > 1:  # the others may be inside a collective: stop them all
                            raise
                        # the one-GPU step (no collective inside): recorded as not fitting
                        row = dict(mode=mode, T=T, level=level, world=W, ms=None,
                                   peak_gib=None, note="out of memory")
                if row.get("ms") is None:
                    if device.type == "cuda":
                        torch.cuda.empty_cache()
                    bc.log(f"  {mode} {bc.fmt_tokens(T)} {level} on {W}: {row['note']}")
                else:
                    if row["peak_gib"]:
                        per_token[W] = max(per_token.get(W, 0.0), row["peak_gib"] * 2**30 * W / T)
                    bc.log(f"  {mode} {bc.fmt_tokens(T)} {level} on {W}: {row['ms']:.1f} ms, "
                           f"peak {_gib(row['peak_gib'])} GiB"
                           + (f", {row['of_allgather']:.0%} of the all-gather's bytes"
                              if "of_allgather" in row else "")
                           + (f", comm {row['comm_share']:.0%}" if "comm_share" in row else ""))
                    if args.check and mode == "strong" and W > 1 and T == strong[0]:
                        errs = check_case(msa, msad, T, level, alphas[level], W, groups[W], h,
                                          args, device)
                        checks.append(dict(mode="check", T=T, level=level, world=W,
                                           **{f"err_{k}": f"{v:.2e}" for k, v in errs.items()}))
            dist.barrier()
            if rank == 0:
                rows.append(row)
    if rank == 0:
        report(rows, checks, args.out)
    return 0


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--worlds", default="1,2,4,8", help="GPU counts (those up to the launch's)")
    ap.add_argument("--strong", default="1M", help="tokens of the strong-scaling sequence(s)")
    ap.add_argument("--weak", default="256K", help="tokens per GPU of the weak-scaling runs")
    ap.add_argument("--index", default="mixed,random", help="overlap levels of the index inputs")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--phases", action="store_true",
                    help="the share of a step's synchronised phases spent in communication")
    ap.add_argument("--check", action="store_true",
                    help="outputs and gradients against the one-rank step (small shapes)")
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    ap.add_argument("--tiny", action="store_true", help="tiny heads (the CPU backend)")
    ap.add_argument("--call", choices=["auto", "keys", "rows"], default="auto",
                    help="msa.distributed's call (sparse_attention's `call`)")
    ap.add_argument("--spawn", type=int, default=0, help="start N local processes (gloo on the "
                    "CPU) instead of running under torchrun")
    ap.add_argument("--timeout", type=int, default=900, help="collective timeout, seconds")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None, help="write PREFIX.csv and PREFIX.png (rank 0)")
    args = ap.parse_args(argv)
    if args.tiny:  # the defaults at tiny heads
        if args.strong == ap.get_default("strong"):
            args.strong = "1024"
        if args.weak == ap.get_default("weak"):
            args.weak = "256"
    try:
        worlds = [int(w) for w in args.worlds.split(",") if w.strip()]
    except ValueError:
        worlds = []
    if not worlds or min(worlds) < 1:
        ap.error(f"argument --worlds: expected GPU counts >= 1 separated by commas, got "
                 f"{args.worlds!r}")
    for name in ("strong", "weak"):
        text = getattr(args, name)
        try:
            ok = all(t > 0 for t in bc.parse_tokens(text))
        except ValueError:
            ok = False
        if not ok:
            ap.error(f"argument --{name}: expected token counts such as 4096, 256K or 1M, "
                     f"got {text!r}")
    if not args.strong and not args.weak:
        ap.error("argument --strong: give --strong or --weak lengths")
    if args.reps < 1:
        ap.error(f"argument --reps: expected >= 1, got {args.reps}")
    return args


def main(argv=None) -> int:
    return bc.launch(list(sys.argv[1:] if argv is None else argv), parse_args, run)


if __name__ == "__main__":
    sys.exit(main())
