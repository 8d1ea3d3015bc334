#!/usr/bin/env python3
"""Context-parallel MSA training step (msa.distributed) on W GPUs against one GPU, and the bytes
it moves against the all-gather baseline.

Per length T (one sequence of T tokens) and overlap level of the index inputs
(``selection_patterns``: "mixed", calibrated so that neighbouring tokens share about 57% of
their blocks, and "random", every token selects its own random blocks), every rank draws the
same inputs (bf16, paper heads by default: Hq 64, Hkv 4, Hi 4, Hik 1, D = Di = 128, Bk 128,
k 16, sink 1, local 4) and times:

* 1 GPU    ``msa.sparse_attention`` on the whole sequence + backward (``loss = <out, g> + kl``),
           on every rank's own GPU at once (rank 0's time is reported);
* CP       ``msa.distributed.sparse_attention`` on this rank's shard + backward, for each
           layout (contiguous, balanced = zigzag, contiguous-weighted = contiguous shards of
           equal modelled work from ``msad.contiguous_sizes``, whose selection weight is
           measured on one GPU in the same run) and exchange ("selected": only the K/V rows of
           the selected blocks move; "allgather": the baseline); the step time is the slowest
           rank's, the bytes are those all ranks received (payload), forward + backward.

The KL value is skipped in the timed steps (its gradient is not), as in bench_backward's "step".
A check run (the first length and level, ``--check``) compares the CP outputs and all five
gradients with the one-GPU call on the same inputs and prints the largest errors.

Two GPUs (NCCL; NVLink multicast stays off: the script sets NCCL_NVLS_ENABLE=0 and
TORCH_SYMM_MEM_DISABLE_MULTICAST=1 before torch.distributed starts):

    PYTHONPATH=build-gpu-py torchrun --standalone --nproc-per-node 2 bench/bench_cp.py \\
        --out cp-h200                      # 128K, 256K, 512K, mixed and random
    PYTHONPATH=build-gpu-py torchrun --standalone --nproc-per-node 2 bench/bench_cp.py --quick

On the CPU (gloo, the CPU backend, tiny shapes; ``--spawn N`` starts N local processes
instead of torchrun):

    PYTHONPATH=build-cpu-py python bench/bench_cp.py --device cpu --tiny --spawn 2
"""

import argparse
import csv
import datetime
import os
import statistics
import sys
import tempfile
import time
from typing import Dict, List

# NVLink multicast stays off, before anything can create a NCCL communicator.
os.environ["NCCL_NVLS_ENABLE"] = "0"
os.environ["TORCH_SYMM_MEM_DISABLE_MULTICAST"] = "1"

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import selection_patterns as sp  # noqa: E402

PAPER = dict(Hq=64, Hkv=4, Hi=4, Hik=1, D=128, Di=128, Bk=128, k=16)
TINY = dict(Hq=4, Hkv=2, Hi=2, Hik=1, D=16, Di=16, Bk=16, k=8)
LAYOUTS = ("contiguous", "balanced", "contiguous-weighted")
EXCHANGES = ("selected", "allgather")


def log(msg: str) -> None:
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(msg, flush=True)


def parse_tokens(text: str) -> List[int]:
    out = []
    for x in text.split(","):
        x = x.strip().upper()
        if not x:
            continue
        mult = 1 << 20 if x.endswith("M") else 1 << 10 if x.endswith("K") else 1
        out.append(int(x.rstrip("MK")) * mult)
    return out


def fmt_tokens(n: int) -> str:
    if n % (1 << 20) == 0:
        return f"{n >> 20}M"
    return f"{n >> 10}K" if n % 1024 == 0 else str(n)


class Timer:
    """Wall times of a call that the ranks of ``group`` (default: all) make together."""

    def __init__(self, device: torch.device, group=None):
        self.device = device
        self.group = group

    def sync(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def ms(self, fn, reps: int, warm: int = 1) -> float:
        """Median over ``reps`` calls of the slowest rank's wall time (ms)."""
        for _ in range(warm):
            fn()
        times = []
        for _ in range(reps):
            self.sync()
            dist.barrier(group=self.group)
            t0 = time.perf_counter()
            fn()
            self.sync()
            times.append(_all_reduce((time.perf_counter() - t0) * 1e3, dist.ReduceOp.MAX,
                                     self.group))
        return statistics.median(times)


def _comm_dev(device: torch.device) -> torch.device:
    return device if dist.get_backend() == "nccl" else torch.device("cpu")


def _all_reduce(x: float, op, group=None) -> float:
    t = torch.tensor([x], dtype=torch.float64, device=_comm_dev(_DEVICE[0]))
    dist.all_reduce(t, op=op, group=group)
    return float(t)


_DEVICE = [torch.device("cpu")]


def bench_case(msa, msad, T: int, level: str, h: Dict, args, timer: Timer, device,
               check: bool) -> List[Dict]:
    W, rank = dist.get_world_size(), dist.get_rank()
    cu, gen, dtype, q_idx, k_idx, st = level_inputs(T, level, None, h, args, device)

    def r(*shape):
        return torch.randn(*shape, device=device, generator=gen, dtype=dtype)  # no fp32 copy

    q, k, v = r(T, h["Hq"], h["D"]), r(T, h["Hkv"], h["D"]), r(T, h["Hkv"], h["D"])
    gout = r(T, h["Hq"], h["D"])
    opts = dict(top_k=h["k"], block_size=h["Bk"], sink_blocks=sp.SINK_BLOCKS,
                local_blocks=sp.LOCAL_BLOCKS)
    full = [t.detach().requires_grad_(True) for t in (q, k, v, q_idx, k_idx)]

    def single(kl_value=False):
        out, kl = msa.sparse_attention(*full, cu_seqlens=cu, kl_value=kl_value, **opts)
        loss = (out * gout).float().sum() + kl
        return out, kl, torch.autograd.grad(loss, full)

    t1 = timer.ms(lambda: single(), args.reps)
    layouts = [x for x in args.layouts.split(",") if x]
    t_sel = None
    if args.phases or "contiguous-weighted" in layouts:
        t_sel = timer.ms(lambda: msa.select_blocks(full[3], full[4], cu_seqlens=cu, **opts),
                         args.reps)
    # the one-GPU selection's time per (query, earlier key) pair over the rest of the step's
    # per query: the cost model of msad.contiguous_sizes, measured in this run
    select_weight = None
    if t_sel is not None and t1 > t_sel:
        select_weight = (t_sel / (T * (T + 1) / 2)) / ((t1 - t_sel) / T)
    if args.phases:  # the one-GPU step's parts: selection, forward (with it), the rest
        def fwd_only():
            with torch.no_grad():
                msa.sparse_attention(*full, cu_seqlens=cu, kl_value=False, **opts)
        t_fwd = timer.ms(fwd_only, args.reps)
        log(f"    1 GPU parts (ms): select {t_sel:.1f}, forward with select {t_fwd:.1f}, "
            f"backward (step - forward) {t1 - t_fwd:.1f}; step {t1:.1f}")
    rows = []
    ref = None
    if check:
        out, kl, g = single(kl_value=True)
        ref = (out.detach(), kl.detach(), [x.detach() for x in g])
        del out, g
    for layout_name in layouts:
        layout, sizes = layout_name, None
        if layout_name == "contiguous-weighted":  # contiguous shards of equal modelled work
            layout = "contiguous"
            # (the timer's times are the slowest rank's: every rank has the same weight)
            sizes = msad.contiguous_sizes(W, T, select_weight=select_weight or 0.0,
                                          block_size=h["Bk"])
            log(f"    contiguous-weighted shards (select_weight {select_weight or 0.0:.3g}): "
                f"{sizes}")
        pos = msad.shard_positions(layout, rank, W, T, cu, sizes=sizes).to(device)
        shard = [t[pos].detach().clone().requires_grad_(True) for t in (q, k, v, q_idx, k_idx)]
        g_shard = gout[pos]
        for exchange in EXCHANGES:
            stats_box = []

            def cp(kl_value=False, phase_times=False):
                out, kl, stats = msad.sparse_attention(
                    *shard, cu_seqlens=cu, layout=layout, exchange=exchange, kl_value=kl_value,
                    call=args.call,
                    return_stats=True, phase_times=phase_times, **opts)
                loss = (out * g_shard).float().sum() + kl
                grads = torch.autograd.grad(loss, shard)
                stats_box[:] = [stats]
                return out, kl, grads

            tcp = timer.ms(lambda: cp(), args.reps)
            stats = stats_box[0]
            fwd_b = _all_reduce(msad.moved_bytes(stats, "forward"), dist.ReduceOp.SUM)
            bwd_b = _all_reduce(msad.moved_bytes(stats, "backward"), dist.ReduceOp.SUM)
            fetched = _all_reduce(stats["fetched_tokens"], dist.ReduceOp.SUM)
            # the largest call over the ranks: its key rows and its query rows (all the key rows
            # with call="rows", the shard's with call="keys")
            call_keys = _all_reduce(stats["call_tokens"], dist.ReduceOp.MAX)
            call_rows = _all_reduce(stats["call_queries"], dist.ReduceOp.MAX)
            phases = {}
            if args.phases:  # one more step, the device synchronised between phases
                cp(phase_times=True)
                mine = {k[3:]: v for k, v in stats_box[0].items() if k.startswith("ms_")}
                every = [None] * W
                dist.all_gather_object(every, mine)
                for o, ph in enumerate(every):
                    log(f"    rank {o} phases (ms, synchronised): " + ", ".join(
                        f"{k} {v:.1f}" for k, v in ph.items()) + f"; sum {sum(ph.values()):.1f}")
                phases = {f"ph_{k}": round(max(ph.get(k, 0.0) for ph in every), 2)
                          for k in every[0]}
            errs = {}
            if ref is not None:
                out, kl, g = cp(kl_value=True)
                pairs = [("out", out, ref[0][pos])] + [
                    (n, a, b[pos]) for n, a, b in zip(("dq", "dk", "dv", "dq_idx", "dk_idx"),
                                                      g, ref[2])]
                for n, a, b in pairs:
                    e = (a.float() - b.float()).abs().max().item() if a.numel() else 0.0
                    s = b.float().abs().max().item() if b.numel() else 0.0
                    errs[n] = _all_reduce(e, dist.ReduceOp.MAX) / max(
                        _all_reduce(s, dist.ReduceOp.MAX), 1e-30)
                errs["kl"] = abs(kl.item() - ref[1].item()) / max(abs(ref[1].item()), 1e-30)
                del out, g
            rows.append(dict(
                T=T, level=level, overlap=round(st["overlap"], 3), union=round(st["union"], 3),
                world=W, layout=layout_name, exchange=exchange, ms_1gpu=round(t1, 3),
                shard_sizes="/".join(map(str, sizes)) if sizes else "",
                select_weight=f"{select_weight:.3g}" if select_weight else "",
                ms_cp=round(tcp, 3), speedup=round(t1 / tcp, 3) if tcp else float("nan"),
                mb_forward=round(fwd_b / 2**20, 3), mb_backward=round(bwd_b / 2**20, 3),
                mb_total=round((fwd_b + bwd_b) / 2**20, 3), fetched_tokens=int(fetched),
                call=stats["call"], call_key_rows=int(call_keys), call_query_rows=int(call_rows),
                **phases,
                **{f"err_{n}": f"{e:.2e}" for n, e in errs.items()}))
            log(f"  {fmt_tokens(T)} {level} {layout_name} {exchange}: 1 GPU {t1:.1f} ms, "
                f"{W} ranks {tcp:.1f} ms, {(fwd_b + bwd_b) / 2**20:.1f} MiB moved"
                + (f", errors {errs}" if errs else ""))
        del shard
    del full, q, k, v, gout, q_idx, k_idx, ref
    return rows


def warmup_case(msa, msad, T: int, h: Dict, args, timer: Timer, device) -> List[Dict]:
    """The dense warmup (``msad.warmup_attention``, the call over keys apart, selected
    exchange) against ``msa.warmup_attention`` on one GPU: the largest error of the output, the
    KL value and the five gradients (relative to the largest reference element) and both step
    times, per layout."""
    W, rank = dist.get_world_size(), dist.get_rank()
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    cu = torch.tensor([0, T], dtype=torch.int32, device=device)
    gen = torch.Generator(device=device)
    gen.manual_seed(args.seed + 1)

    def r(*shape):
        return torch.randn(*shape, device=device, generator=gen, dtype=dtype)

    full = [r(T, h["Hq"], h["D"]), r(T, h["Hkv"], h["D"]), r(T, h["Hkv"], h["D"]),
            r(T, h["Hi"], h["Di"]), r(T, h["Hik"], h["Di"])]
    full = [t.requires_grad_(True) for t in full]
    gout = r(T, h["Hq"], h["D"])

    def single():
        out, kl = msa.warmup_attention(*full, cu_seqlens=cu)
        g = torch.autograd.grad((out.float() * gout.float()).sum() + kl, full)
        return out.detach(), kl.detach(), g

    t1 = timer.ms(single, args.reps)
    ref_out, ref_kl, ref_g = single()
    rows = []
    for layout in ("contiguous", "balanced"):
        pos = msad.shard_positions(layout, rank, W, T, cu).to(device)
        shard = [t[pos].detach().clone().requires_grad_(True) for t in full]

        def cp():
            out, kl = msad.warmup_attention(*shard, cu_seqlens=cu, layout=layout, call="keys")
            g = torch.autograd.grad((out.float() * gout[pos].float()).sum() + kl, shard)
            return out.detach(), kl.detach(), g

        tcp = timer.ms(cp, args.reps)
        out, kl, g = cp()
        errs = {}
        for n, a, b in [("out", out, ref_out[pos])] + [
                (n, x, y[pos]) for n, x, y in zip(("dq", "dk", "dv", "dq_idx", "dk_idx"), g,
                                                  ref_g)]:
            e = _all_reduce((a.float() - b.float()).abs().max().item(), dist.ReduceOp.MAX)
            m = _all_reduce(b.float().abs().max().item(), dist.ReduceOp.MAX)
            errs[n] = e / max(m, 1e-30)
        errs["kl"] = abs(kl.item() - ref_kl.item()) / max(abs(ref_kl.item()), 1e-30)
        rows.append(dict(T=T, world=W, layout=layout, ms_1gpu=round(t1, 3), ms_cp=round(tcp, 3),
                         speedup=round(t1 / tcp, 3) if tcp else float("nan"),
                         **{f"err_{n}": f"{e:.2e}" for n, e in errs.items()}))
        log(f"  warmup {fmt_tokens(T)} {layout}: 1 GPU {t1:.1f} ms, {W} ranks {tcp:.1f} ms, "
            f"errors " + ", ".join(f"{n} {e:.1e}" for n, e in errs.items()))
        del shard
    return rows


def level_inputs(T: int, level: str, alpha, h: Dict, args, device):
    """(cu_seqlens, generator, dtype, q_idx, k_idx, selection stats) of one sequence of T tokens
    at ``level`` (``alpha`` fixed, or None to calibrate), the generator seeded with ``args.seed``
    and past the index inputs' draw: the same on every rank."""
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    cu = torch.tensor([0, T], dtype=torch.int32, device=device)
    gen = torch.Generator(device=device)
    gen.manual_seed(args.seed)
    q_idx, k_idx, _, st = sp.make_level(level, cu, h["Hi"], h["Hik"], h["Di"], h["Bk"], h["k"],
                                        dtype=dtype, device=device, generator=gen, alpha=alpha)
    return cu, gen, dtype, q_idx, k_idx, st


def shard_step(msa, msad, T: int, level: str, alpha, h: Dict, args, device, group=None,
               single: bool = False):
    """One training step at T tokens (one sequence) with only this rank's shard of q, k, v
    drawn: ``msad.sparse_attention`` over ``group`` (balanced layout, selected exchange), or with
    ``single`` ``msa.sparse_attention`` on the whole sequence (this rank alone). The index inputs
    of ``level`` (``alpha`` fixed, or None to calibrate) are drawn whole, since every rank
    selects over all of them. Returns (step, stats of the level's selection); step(phase_times)
    runs the forward and the gradient of <out, g> + kl (the KL value skipped) and returns the
    call's stats (None with ``single``)."""
    W = 1 if single else dist.get_world_size(group)
    rank = 0 if single else dist.get_rank(group)
    cu, gen, dtype, q_idx, k_idx, st = level_inputs(T, level, alpha, h, args, device)
    pos = msad.shard_positions("balanced", rank, W, T, cu).to(device)
    n = pos.numel()
    shard = [torch.randn(n, h["Hq"], h["D"], device=device, generator=gen, dtype=dtype)]
    shard += [torch.randn(n, h["Hkv"], h["D"], device=device, generator=gen, dtype=dtype)
              for _ in range(2)]
    shard += [q_idx[pos].clone(), k_idx[pos].clone()]
    del q_idx, k_idx
    shard = [t.requires_grad_(True) for t in shard]
    g_shard = torch.randn(n, h["Hq"], h["D"], device=device, generator=gen, dtype=dtype)
    opts = dict(top_k=h["k"], block_size=h["Bk"], sink_blocks=sp.SINK_BLOCKS,
                local_blocks=sp.LOCAL_BLOCKS, kl_value=False)

    def step(phase_times: bool = False):
        stats = None
        if single:
            out, kl = msa.sparse_attention(*shard, cu_seqlens=cu, **opts)
        else:
            out, kl, stats = msad.sparse_attention(
                *shard, cu_seqlens=cu, group=group, layout="balanced", call=args.call,
                exchange="selected", return_stats=True, phase_times=phase_times, **opts)
        # the gradient of <out, g> + kl without materialising the product (its fp32 copy alone
        # would be 32 bytes per token and query head)
        torch.autograd.grad((out, kl), shard, (g_shard, torch.ones_like(kl)))
        return stats

    return step, st


def fit_case(msa, msad, T: int, level: str, alpha, h: Dict, args, timer: Timer, device):
    """One CP training step at T tokens (balanced layout, selected exchange) with only this
    rank's shard of q, k, v drawn: its time and the largest peak of device memory over the
    ranks. No one-GPU reference (it would not fit)."""
    step, st = shard_step(msa, msad, T, level, alpha, h, args, device)
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    ms = timer.ms(step, 1)
    peak = _all_reduce(torch.cuda.max_memory_allocated(device), dist.ReduceOp.MAX)
    del step
    torch.cuda.empty_cache()
    return dict(T=T, level=level, overlap=round(st["overlap"], 3), union=round(st["union"], 3),
                world=dist.get_world_size(), layout="balanced", exchange="selected",
                ms_cp=round(ms, 1), peak_gib=round(peak / 2**30, 2))


def run_fit(msa, msad, h, args, timer: Timer, device) -> List[Dict]:
    """The longest sequence whose CP training step fits: the --fit lengths in order, each
    tried only if the peak memory per token of the last one predicts that it fits (92% of
    the device), so that no rank runs out of memory inside a collective."""
    cap = torch.cuda.get_device_properties(device).total_memory
    _, _, _, st = sp.make_level(args.fit_level, torch.tensor([0, 1 << 17], dtype=torch.int32,
                                                            device=device),
                                h["Hi"], h["Hik"], h["Di"], h["Bk"], h["k"], device=device)
    alpha = st.get("alpha")
    rows, per_token = [], None
    for T in sorted(parse_tokens(args.fit)):
        if per_token is not None and per_token * T > 0.92 * cap:
            log(f"  fit {fmt_tokens(T)}: skipped (predicted peak {per_token * T / 2**30:.0f} GiB "
                f"of {cap / 2**30:.0f} GiB)")
            rows.append(dict(T=T, level=args.fit_level, world=dist.get_world_size(),
                             layout="balanced", exchange="selected",
                             peak_gib=round(per_token * T / 2**30, 1), fits="predicted no"))
            continue
        r = fit_case(msa, msad, T, args.fit_level, alpha, h, args, timer, device)
        r["fits"] = "yes"
        per_token = r["peak_gib"] * 2**30 / T
        log(f"  fit {fmt_tokens(T)} {args.fit_level} (overlap {r['overlap']:.2f}): "
            f"{r['ms_cp']:.0f} ms per step, peak {r['peak_gib']:.1f} GiB per GPU")
        rows.append(r)
    return rows


def report(rows: List[Dict], out: str) -> None:
    base = {(r["T"], r["level"], r["layout"]): r["mb_total"] for r in rows
            if r["exchange"] == "allgather"}
    for r in rows:
        b = base.get((r["T"], r["level"], r["layout"]))
        r["bytes_vs_allgather"] = round(r["mb_total"] / b, 3) if b else float("nan")
    W = rows[0]["world"] if rows else 0
    print(f"\n## MSA context parallelism: training step on {W} ranks vs 1 (fwd + bwd with KL "
          f"gradient), bytes received by all ranks per step\n")
    print("| T | index (overlap / union) | layout | exchange | 1 GPU ms | CP ms | speedup | "
          "MiB moved | vs all-gather |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {fmt_tokens(r['T'])} | {r['level']} ({r['overlap']:.2f} / {r['union']:.2f}) | "
              f"{r['layout']} | {r['exchange']} | {r['ms_1gpu']:.1f} | {r['ms_cp']:.1f} | "
              f"{r['speedup']:.2f}x | {r['mb_total']:.1f} | {r['bytes_vs_allgather']:.0%} |")
    checked = [r for r in rows if "err_out" in r]
    if checked:
        print("\nCP against one GPU (max error / max |reference|):")
        for r in checked:
            errs = ", ".join(f"{k[4:]} {v}" for k, v in r.items() if k.startswith("err_"))
            print(f"  {fmt_tokens(r['T'])} {r['level']} {r['layout']} {r['exchange']}: {errs}")
    if out:
        keys = []
        for r in rows:
            keys += [k for k in r if k not in keys]
        with open(out + ".csv", "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=keys)
            w.writeheader()
            w.writerows(rows)
        print(f"\nwrote {out}.csv")


def run(args) -> int:
    import msa
    import msa.distributed as msad
    if args.device == "cuda":
        local = int(os.environ.get("LOCAL_RANK", dist.get_rank()))
        device = torch.device("cuda", local)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
        torch.set_num_threads(max(1, (os.cpu_count() or 2) // dist.get_world_size()))
    _DEVICE[0] = device
    h = dict(TINY if args.tiny else PAPER)
    if args.top_k:
        h["k"] = args.top_k
    timer = Timer(device)
    lengths = parse_tokens(args.lengths)
    levels = sp.level_names(args.index)
    log(f"msa.distributed benchmark: {dist.get_world_size()} ranks ({dist.get_backend()}, "
        f"{device.type}), heads {h}, lengths {[fmt_tokens(x) for x in lengths]}, "
        f"levels {levels}, reps {args.reps}")
    rows = []
    first = True
    if args.fit:
        fit_rows = run_fit(msa, msad, h, args, timer, device)
        if dist.get_rank() == 0:
            print(f"\n## Longest CP training step on {dist.get_world_size()} GPUs\n")
            print("| T | level (overlap / union) | step ms | peak GiB per GPU | fits |")
            print("|---|---|---|---|---|")
            for r in fit_rows:
                print(f"| {fmt_tokens(r['T'])} | {r['level']} ({r.get('overlap', '-')} / "
                      f"{r.get('union', '-')}) | {r.get('ms_cp', '-')} | {r['peak_gib']} | "
                      f"{r['fits']} |")
            if args.out:
                with open(args.out + "-fit.csv", "w", newline="") as f:
                    w = csv.DictWriter(f, fieldnames=list(dict.fromkeys(
                        k for r in fit_rows for k in r)))
                    w.writeheader()
                    w.writerows(fit_rows)
        return 0
    warm_rows = []
    if args.warmup_check:
        for T in parse_tokens(args.warmup_check):
            warm_rows += warmup_case(msa, msad, T, h, args, timer, device)
            if device.type == "cuda":
                torch.cuda.empty_cache()
    for T in lengths if args.lengths else []:
        for level in levels:
            rows += bench_case(msa, msad, T, level, h, args, timer, device,
                               check=args.check and first)
            first = False
            if device.type == "cuda":
                torch.cuda.empty_cache()
    if dist.get_rank() == 0:
        if rows:
            report(rows, args.out)
        if warm_rows and args.out:
            with open(args.out + "-warmup.csv", "w", newline="") as f:
                w = csv.DictWriter(f, fieldnames=list(warm_rows[0]))
                w.writeheader()
                w.writerows(warm_rows)
    return 0


def _worker(rank, world, store_path, argv, parse, run_fn):
    args = parse(argv)
    store = dist.FileStore(store_path, world)
    dist.init_process_group("gloo" if args.device == "cpu" else "nccl", store=store, rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=args.timeout))
    try:
        run_fn(args)
        dist.barrier()  # every rank is past its last collective before any tears gloo down
    finally:
        dist.destroy_process_group()
    # A spawned gloo worker sometimes aborts in the interpreter's teardown ("terminate called
    # without an active exception", after every rank has finished and the group is destroyed):
    # once its work is done and flushed, the worker leaves without that teardown.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def launch(argv, parse, run_fn) -> int:
    """run_fn(parse(argv)) on every rank: this process's under torchrun, or ``--spawn N``
    local processes (a FileStore in a temporary folder, the collectives' timeout
    ``--timeout``). ``parse`` and ``run_fn`` are module-level functions (spawn pickles them)."""
    args = parse(argv)
    if args.spawn:
        import torch.multiprocessing as mp
        with tempfile.TemporaryDirectory(prefix="msa_bench_cp_") as tmp:
            mp.start_processes(_worker, args=(args.spawn, os.path.join(tmp, "store"), argv,
                                              parse, run_fn),
                               nprocs=args.spawn, join=True, start_method="spawn")
        return 0
    dist.init_process_group("nccl" if args.device == "cuda" else "gloo",
                            timeout=datetime.timedelta(seconds=args.timeout))
    try:
        return run_fn(args)
    finally:
        dist.destroy_process_group()


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--lengths", default="128K,256K,512K", help="tokens of the one sequence")
    ap.add_argument("--index", default="mixed,random", help="overlap levels of the index inputs")
    ap.add_argument("--top-k", type=int, default=0, help="k (0: 16, tiny: 8)")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    ap.add_argument("--tiny", action="store_true",
                    help="tiny heads (Hq 4, Hkv 2, Hi 2, D 16, Bk 16, k 8) and lengths 512,1K")
    ap.add_argument("--quick", action="store_true", help="128K and 256K (tiny: its lengths), 2 reps (~3 minutes)")
    ap.add_argument("--no-check", dest="check", action="store_false",
                    help="skip comparing the first case with the one-GPU call")
    ap.add_argument("--spawn", type=int, default=0,
                    help="start this many local processes (instead of torchrun)")
    ap.add_argument("--timeout", type=int, default=600, help="collective timeout, seconds")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--call", choices=["auto", "keys", "rows"], default="auto",
                    help="msa.distributed's call layout (auto: keys on the CPU, rows on CUDA)")
    ap.add_argument("--layouts", default=",".join(LAYOUTS),
                    help="contiguous (even), balanced (zigzag), contiguous-weighted (contiguous "
                         "shards of equal modelled work, msa.distributed.contiguous_sizes, its "
                         "select_weight measured on one GPU in the same run)")
    ap.add_argument("--phases", action="store_true",
                    help="after timing, one step with the device synchronised between phases: "
                         "every rank's time per phase (select, exchanges, forward, backward...)")
    ap.add_argument("--fit", default="",
                    help="instead of the comparison: one CP step at each of these lengths "
                         "(e.g. 1M,1536K,2M; balanced, selected, shards drawn on their ranks), "
                         "its time and peak memory: the longest sequence that fits")
    ap.add_argument("--fit-level", default="mixed", help="overlap level of the --fit inputs")
    ap.add_argument("--warmup-check", default="",
                    help="first, at these lengths: the dense warmup on the ranks (call over keys "
                         "apart) against one GPU, errors and times per layout")
    ap.add_argument("--out", default=None, help="write PREFIX.csv (rank 0)")
    args = ap.parse_args(argv)
    if args.tiny:
        args.lengths = "512,1024" if args.lengths == ap.get_default("lengths") else args.lengths
        args.reps = min(args.reps, 2)
    if args.quick:
        if not args.tiny:
            args.lengths = "128K,256K"
        args.reps = 2
    return args


def main(argv=None) -> int:
    return launch(list(sys.argv[1:] if argv is None else argv), parse_args, run)


if __name__ == "__main__":
    sys.exit(main())
