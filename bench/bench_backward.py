#!/usr/bin/env python3
"""MSA training benchmark on one GPU (forward + backward with the KL gradient), against dense
causal attention (cuDNN through torch SDPA) measured in the same run.

Per head configuration and length T (B sequences of T tokens packed as varlen) and per overlap
level of the index inputs (``selection_patterns.LEVELS``: "shared", every token ranks blocks by
one shared salience, so neighbours select the same blocks; "mixed", calibrated so that
neighbouring tokens share about 57% of their blocks; "random", random index vectors, every token
selects its own random blocks) it times, with the selection computed once by the library
(sink 1, local 4, top-k k), and reports that selection's overlap (mean |I(t) & I(t+1)| / k over
neighbouring tokens) and union (mean distinct blocks of 8 neighbouring tokens / k):

* fwd        the sparse forward over that block_idx (no KL value);
* bwd        the backward without the KL branch (dq, dk, dv);
* bwd+kl     the backward with the KL gradient (dq, dk, dv, dq_idx, dk_idx);
* step       a whole training step through autograd: selection, forward, backward with KL
             (``loss = task(out) + kl``), the KL value skipped (its gradient is not);
* step+klv   the same with the exact KL value computed in the forward;
* dense      cuDNN causal GQA attention forward, and forward + backward.

Effective TFLOP/s count the selected work only: forward 4 * D * Gi * (visible keys summed over
(token, index head)), backward 2.5x that (the KL branch's extra work is not counted). Times are
medians of CUDA-event timed calls after a warm-up, with the L2 cache flushed before each call.
``--profile`` adds a per-kernel breakdown of one bwd+kl call and of one whole training step
(torch.profiler; for the step also its kernel count and the kernels' summed time, which against
the step's own time is how long the GPU waited for the host). ``--out PREFIX``
writes PREFIX.csv and PREFIX.json (``plot_bench.py PREFIX.csv`` plots them).

    python bench/bench_backward.py                 # paper + flash-msa heads, 16K..128K
    python bench/bench_backward.py --quick         # a smoke run
    python bench/bench_backward.py --device cpu --configs flash-msa --lengths 256 \\
        --head-dim 64 --reps 1                     # the script itself, on the CPU backend
"""

import argparse
import os
import statistics
import sys
import time
from typing import Dict, List, Optional

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_forward as bf  # noqa: E402  (FLOP counts, dense runner, outputs)
import selection_patterns as sp  # noqa: E402

HEADS = {
    "paper": dict(Hq=64, Hkv=4, Hi=4, Hik=1),
    "flash-msa": dict(Hq=16, Hkv=2, Hi=4, Hik=1),
    # examples/train_retrieval.py's heads: one index head per KV head (Gi = 4), or two (Gi = 2)
    "retrieval": dict(Hq=8, Hkv=2, Hi=2, Hik=1),
    "retrieval-hi4": dict(Hq=8, Hkv=2, Hi=4, Hik=1),
}
# flash-msa's published GH200 numbers at its benchmark shape (16K tokens, top-k 2048 tokens,
# Hq=16, Hkv=2, Hp=4): forward 6.4-11.4 ms, backward 23.4-24.4 ms.
FLASH_MSA_BEST_MS = 6.434 + 23.348
SINK_BLOCKS, LOCAL_BLOCKS = sp.SINK_BLOCKS, sp.LOCAL_BLOCKS


def _paper_128k(level):
    return lambda r: r["config"] == "paper" and r["T"] == 128 * 1024 and r["index"] == level


def _flash_msa_16k(level):
    return lambda r: r["config"] == "flash-msa" and r["T"] == 16384 and r["B"] == 1 and r["index"] == level


# Targets of the training milestone on the H200.
TARGETS = [
    bf.make_target("training step vs dense, paper heads, T = 128K, mixed (x)", "step_speedup",
                   12.0, _paper_128k("mixed"), "overlap"),
    bf.make_target("training step vs dense, paper heads, T = 128K, random (x)", "step_speedup",
                   10.0, _paper_128k("random"), "overlap"),
    bf.make_target("training step, flash-msa shape (16K, Hq16/Hkv2/Hi4), mixed (ms)", "step_ms",
                   5.0, _flash_msa_16k("mixed"), "overlap", at_most=True),
    # the same step replayed from a CUDA graph (--graph): the kernels without the host's lead-in
    bf.make_target("training step in a CUDA graph, flash-msa shape (16K), mixed (ms)",
                   "step_graph_ms", 5.0, _flash_msa_16k("mixed"), "overlap", at_most=True),
]


def log(msg: str):
    print(msg, file=sys.stderr, flush=True)


class Timer:
    """Median time of a call (ms): CUDA events with the L2 cache flushed before each call on the
    GPU, perf_counter on the CPU."""

    def __init__(self, device, flush: bool):
        self.cuda = device.type == "cuda"
        self.flush = None
        if self.cuda and flush:
            l2 = getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 0) or (64 << 20)
            self.flush = torch.empty(2 * l2, dtype=torch.uint8, device=device)

    def ms(self, fn, reps: int = 10, warm: int = 2) -> float:
        for _ in range(warm):
            fn()
        if not self.cuda:
            times = []
            for _ in range(reps):
                t0 = time.perf_counter()
                fn()
                times.append((time.perf_counter() - t0) * 1e3)
            return statistics.median(times)
        torch.cuda.synchronize()
        times = []
        for _ in range(reps):
            if self.flush is not None:
                self.flush.zero_()
            times.append(bf.event_ms(fn))
        return statistics.median(times)


def cuda_events(fn) -> list:
    """The CUDA kernel events of one call of fn (after a warm-up call), by torch.profiler."""
    from torch.profiler import ProfilerActivity, profile
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return [ev for ev in prof.events() if ev.device_type == torch.autograd.DeviceType.CUDA]


def _kernel_name(name: str, templates: bool = False) -> str:
    """A kernel's name without its arguments (and template arguments unless ``templates``),
    its last 60 characters."""
    name = name.replace("(anonymous namespace)::", "")
    name = name.split("(")[0] if templates else name.split("<")[0].split("(")[0]
    return name[-60:]


def profile_kernels(fn, templates: bool = False, events: Optional[list] = None) -> List[tuple]:
    """(kernel, ms) of one call of fn (or of the given events), longest first; templates: keep
    the end of each kernel's template arguments in its name (to tell a kernel's instantiations
    apart)."""
    out = {}
    for ev in cuda_events(fn) if events is None else events:
        name = _kernel_name(ev.name, templates)
        out[name] = out.get(name, 0.0) + ev.device_time_total / 1e3
    return sorted(out.items(), key=lambda x: -x[1])


def trace_step(fn) -> Dict:
    """One call of fn (a training step) under torch.profiler: its kernels' times by name
    (longest first), how many ran, and their sum (the profiled call's span is not reported: the
    profiler slows the host, and with it the gaps between kernels)."""
    evs = cuda_events(fn)
    counts: Dict[str, int] = {}
    for ev in evs:
        name = _kernel_name(ev.name)
        counts[name] = counts.get(name, 0) + 1
    return {"kernels": profile_kernels(fn, events=evs), "count": len(evs), "counts": counts,
            "busy_ms": sum(ev.device_time_total for ev in evs) / 1e3}


def host_split(fn, reps: int = 5) -> Dict:
    """The host time of one call of fn (GPU kept busy, no profiler) inside the binding's calls
    (the library's host code and the DLPack import of their tensors), by function, and inside
    the workspace allocations they call back; medians over reps calls, in ms. Also the time of
    one tensor's DLPack export (``t.__dlpack__()``), in us; the call's GPU time with all of its
    work queued ahead (``queued_ms``) and with the host 0-1 ms ahead of the GPU (``lead_ms``)."""
    import msa._ops as ops
    real_c, real_alloc = ops._C, ops._alloc
    spent: Dict[str, List[float]] = {}

    def add(name, dt):
        spent.setdefault(name, [0.0, 0])
        spent[name][0] += dt
        spent[name][1] += 1

    class Timed:
        def __getattr__(self, name):
            f = getattr(real_c, name)

            def g(*a, **kw):
                t0 = time.perf_counter()
                try:
                    return f(*a, **kw)
                finally:
                    add("_C." + name, time.perf_counter() - t0)
            return g

    def alloc(device):
        a = real_alloc(device)

        def g(nbytes):
            t0 = time.perf_counter()
            try:
                return a(nbytes)
            finally:
                add("workspace alloc", time.perf_counter() - t0)
        return g

    runs = []
    ops._C, ops._alloc = Timed(), alloc
    try:
        for _ in range(reps):
            spent.clear()
            torch.cuda._sleep(200_000_000)  # ~0.1 s of GPU time ahead of the call
            t0 = time.perf_counter()
            fn()
            total = time.perf_counter() - t0
            torch.cuda.synchronize()
            runs.append((total, {k: tuple(v) for k, v in spent.items()}))
    finally:
        ops._C, ops._alloc = real_c, real_alloc
    runs.sort(key=lambda r: r[0])
    total, parts = runs[len(runs) // 2]
    # the call's GPU time with all of its work queued before the GPU reaches it (the events
    # after a sleep kernel): the kernels and the GPU's own time between them, no host wait
    def after_sleep(cycles):
        torch.cuda._sleep(cycles)
        return bf.event_ms(fn)
    queued = statistics.median(after_sleep(20_000_000) for _ in range(reps))  # ~10 ms ahead
    # the GPU's cycles per ms, then the call's time when the GPU starts it `lead` ms after the
    # host does (a sleep kernel of that length before it): how much of the step's time over
    # `queued` is the host's lead-in before its first kernels
    per_ms = 20_000_000 / bf.event_ms(lambda: torch.cuda._sleep(20_000_000))
    leads = {lead: statistics.median(after_sleep(max(1, int(lead * per_ms))) for _ in range(reps))
             for lead in (0.0, 0.1, 0.25, 0.5, 1.0)}
    t = torch.empty(4, device="cuda")
    for _ in range(10):
        t.__dlpack__()
    t0 = time.perf_counter()
    for _ in range(1000):
        t.__dlpack__()
    dl_us = (time.perf_counter() - t0) * 1e3
    return {"host_ms": total * 1e3, "dlpack_us": dl_us, "queued_ms": queued, "lead_ms": leads,
            "parts": {k: (v[0] * 1e3, v[1]) for k, v in parts.items()}}


def host_profile(fn, top: int = 14) -> Dict:
    """Where one call of fn (a training step) spends host time: torch.profiler's CPU events of
    that call (after a warm-up call), self time summed by name (ops, the library's Python
    wrapper inside them, and the CUDA runtime calls), longest first, with their counts; and the
    call's wall time on the host, profiled and not (``split``: host_split's)."""
    from torch.profiler import ProfilerActivity, profile
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        fn()
        profiled_ms = (time.perf_counter() - t0) * 1e3
        torch.cuda.synchronize()
    split = host_split(fn)
    # Python's own view of the unprofiled call: the functions with the most self time
    import cProfile
    import pstats
    pr = cProfile.Profile()
    torch.cuda._sleep(200_000_000)
    pr.enable()
    fn()
    pr.disable()
    torch.cuda.synchronize()
    py = []
    for (file, line, func), (_, ncalls, tt, ct, _) in pstats.Stats(pr).stats.items():
        py.append((f"{os.path.basename(file)}:{line}({func})", ncalls, tt * 1e3, ct * 1e3))
    py.sort(key=lambda x: -x[2])
    rows = {}
    for ev in prof.key_averages():
        if ev.device_type != torch.autograd.DeviceType.CPU:
            continue
        rows[ev.key] = (ev.self_cpu_time_total / 1e3, ev.count, ev.cpu_time_total / 1e3)
    top_rows = sorted(rows.items(), key=lambda x: -x[1][0])[:top]
    return {"profiled_ms": profiled_ms, "split": split, "python": py[:2 * top],
            "self": [(k, *v) for k, v in top_rows],
            "ops": {k: v for k, v in rows.items() if k.startswith("msa::")}}


def bench_case(msa, cfg: str, L: int, B: int, args, timer: Timer, device, dtype, gen) -> List[Dict]:
    h = HEADS[cfg]
    Hq, Hkv, Hi, Hik = h["Hq"], h["Hkv"], h["Hi"], h["Hik"]
    D = Di = args.head_dim
    Bk, k = args.block_size, args.top_k
    T = B * L
    cu = torch.arange(B + 1, device=device, dtype=torch.int32) * L
    reps = args.reps if T * Hq <= 32768 * 64 else max(3, args.reps // 3)

    def r(*shape):
        return torch.randn(*shape, device=device, dtype=dtype, generator=gen)

    q, kk, v = r(T, Hq, D), r(T, Hkv, D), r(T, Hkv, D)
    dout = r(T, Hq, D)
    rows = []
    dfl = bf.dense_flops(B, L, Hq, D)
    dense_fwd = dense_step = None
    if L <= args.dense_max_tokens:
        q4, k4, v4 = (t.view(B, L, -1, D).transpose(1, 2) for t in (q, kk, v))
        run, backend = bf.dense_runner(q4, k4, v4, device)
        dense_fwd = timer.ms(run, reps)
        qg, kg, vg = (t.detach().clone().requires_grad_(True) for t in (q4, k4, v4))
        run_g, _ = bf.dense_runner(qg, kg, vg, device)
        do4 = dout.view(B, L, Hq, D).transpose(1, 2)

        def dense_train():
            for t in (qg, kg, vg):  # as a training step's zero_grad(set_to_none=True)
                t.grad = None
            out = run_g()
            torch.autograd.backward(out, do4)
        dense_step = timer.ms(dense_train, reps)
        log(f"  dense fwd {dense_fwd:9.3f} ms, fwd+bwd {dense_step:9.3f} ms ({backend})")
    cases = [(kind, None) for kind in sp.level_names(args.index)]
    if args.trained:
        # a trained index branch's selections (examples/train_retrieval.py), where the file's
        # length and block size are this case's and B = 1
        trained, trained_bk = sp.load_trained(args.trained, Hi, device)
        cases += [(f"trained_{layer}", bi) for layer, bi in trained.items()
                  if B == 1 and bi.shape[0] == L and trained_bk == Bk and bi.shape[2] == k]
    for kind, given_bi in cases:
        if given_bi is None:
            # the level's index inputs and their selection ("mixed": calibrated on these inputs)
            qi, ki, bi, st = sp.make_level(kind, cu, Hi, Hik, Di, Bk, k, dtype=dtype,
                                           device=device, generator=gen,
                                           sink_blocks=SINK_BLOCKS, local_blocks=LOCAL_BLOCKS)
        else:
            # the saved selection; index inputs of the right shape for the KL gradient (its
            # cost does not depend on their values). Selection and the step select from index
            # inputs, so they are timed on the levels only.
            bi = given_bi
            qi, ki = r(T, Hi, Di), r(T, Hik, Di)
            st = dict(sp.selection_stats(bi, cu, k), alpha=float("nan"))
        alpha = st["alpha"]
        opts = dict(cu_seqlens=cu, sink_blocks=SINK_BLOCKS, local_blocks=LOCAL_BLOCKS)
        keys = bf.visible_keys(bi, B, L, Bk)
        fl = bf.attention_flops(keys, Hq, Hi, D)
        sel_fl = bf.selection_flops(B, L, Hi, Di)
        row = dict(config=cfg, T=L, B=B, tokens=T, Hq=Hq, Hkv=Hkv, Hi=Hi, Hik=Hik, D=D, Di=Di,
                   Bk=Bk, k=k, index=kind, alpha=alpha, overlap=st["overlap"],
                   union=st["union"], dense_fwd_ms=dense_fwd, dense_step_ms=dense_step,
                   fwd_gflop=fl / 1e9)
        log(f"  {kind}: alpha {alpha:.3f}, overlap {st['overlap']:.3f}, union {st['union']:.2f}")
        out, _, lse = msa.sparse_attention(q, kk, v, None, None, block_idx=bi, block_size=Bk,
                                           cu_seqlens=cu, kl_value=False, return_lse=True)
        kl_grad = torch.ones(1, device=device, dtype=torch.float32)
        scale = D ** -0.5

        def fwd():
            return msa.sparse_attention(q, kk, v, None, None, block_idx=bi, block_size=Bk,
                                        cu_seqlens=cu, kl_value=False, fwd_pass=args.fwd_pass,
                                        fwd_chunk_tokens=args.fwd_chunk_tokens)

        def bwd(kl: bool, det: bool = False):
            return lambda: torch.ops.msa.backward(
                dout, q, kk, v, out, lse, qi, ki, bi, cu, kl_grad, False, Bk, scale, 0.0, kl, kl,
                det, args.kl_pass, dq_pass=args.dq_pass, bwd_chunk_tokens=args.bwd_chunk_tokens)

        xs = [t.detach().clone().requires_grad_(True) for t in (q, kk, v, qi, ki)]

        def step(klv: bool):
            def run():
                for t in xs:  # as a training step's zero_grad(set_to_none=True)
                    t.grad = None
                o, kl = msa.sparse_attention(*xs, k, Bk, kl_value=klv, kl_pass=args.kl_pass,
                                             fwd_pass=args.fwd_pass, dq_pass=args.dq_pass,
                                             bwd_chunk_tokens=args.bwd_chunk_tokens,
                                             fwd_chunk_tokens=args.fwd_chunk_tokens,
                                             select_scores=args.select_scores, **opts)
                torch.autograd.backward([o, kl], [dout, torch.ones((), device=device)])
            return run

        row["fwd_ms"] = timer.ms(fwd, reps)
        row["bwd_ms"] = timer.ms(bwd(False), reps)
        row["bwd_kl_ms"] = timer.ms(bwd(True), reps)
        row["fwd_tflops"] = bf.tflops(fl, row["fwd_ms"])
        row["bwd_tflops"] = bf.tflops(2.5 * fl, row["bwd_ms"])
        row["bwd_kl_tflops"] = bf.tflops(2.5 * fl, row["bwd_kl_ms"])
        if given_bi is not None:
            log(f"  {kind}: fwd {row['fwd_ms']:.3f} ms, bwd {row['bwd_ms']:.3f} ms, "
                f"bwd_kl {row['bwd_kl_ms']:.3f} ms")
            rows.append(row)
            continue
        row["step_ms"] = timer.ms(step(False), reps)
        row["step_klv_ms"] = timer.ms(step(True), reps)
        if args.graph and device.type == "cuda":
            row["step_graph_ms"] = timer.ms(graphed(step(False)), reps)
        row["select_ms"] = timer.ms(lambda: msa.select_blocks(
            qi, ki, k, Bk, select_scores=args.select_scores, **opts), reps)
        row["select_scores"] = args.select_scores
        row["dq_pass"] = args.dq_pass
        row["bwd_chunk_tokens"] = args.bwd_chunk_tokens
        row["fwd_chunk_tokens"] = args.fwd_chunk_tokens
        row["step_tflops"] = bf.tflops(3.5 * fl + sel_fl, row["step_ms"])
        if dense_step:
            row["step_speedup"] = dense_step / row["step_ms"]
            row["ideal_speedup"] = 3.5 * dfl / (3.5 * fl + sel_fl)
        if cfg == "flash-msa" and L == 16384 and B == 1 and Bk * k == 2048:
            row["vs_flash_msa"] = FLASH_MSA_BEST_MS / row["step_ms"]
        log("  " + kind + ": " + ", ".join(f"{n} {row[n + '_ms']:.3f} ms" for n in
                                           ("select", "fwd", "bwd", "bwd_kl", "step", "step_klv")))
        if args.profile and device.type == "cuda":
            row["profile"] = profile_kernels(bwd(True))
            for name, ms in row["profile"][:10]:
                log(f"      {ms:9.3f} ms  {name}")
            tr = trace_step(step(False))
            row["step_profile"], row["step_kernels"] = tr["kernels"], tr["count"]
            row["step_busy_ms"] = tr["busy_ms"]
            log(f"    step: {tr['count']} kernels, {tr['busy_ms']:.3f} ms of kernels in a "
                f"{row['step_ms']:.3f} ms step")
            for name, ms in tr["kernels"]:
                log(f"      {ms:9.3f} ms  {tr['counts'][name]:3d}x {name}")
        if args.host_profile and device.type == "cuda":
            hp = host_profile(step(False))
            row["host_profile"] = hp
            sp_ = hp["split"]
            log(f"    step's host time {sp_['host_ms']:.3f} ms ({hp['profiled_ms']:.3f} ms "
                "profiled); one tensor's __dlpack__ "
                f"{sp_['dlpack_us']:.1f} us; the step queued ahead of the GPU "
                f"{sp_['queued_ms']:.3f} ms (L2 not flushed); with the host a lead of "
                + ", ".join(f"{a} ms: {b:.3f}" for a, b in sp_["lead_ms"].items()))
            for name, (ms, n) in sp_["parts"].items():
                log(f"      {ms:8.3f} ms in {n} calls of {name}")
            log("    profiled self ms / calls / total ms:")
            for name, self_ms, n, tot in hp["self"]:
                log(f"      {self_ms:8.3f} {n:5d} {tot:8.3f}  {name[-60:]}")
            log("    cProfile (GPU busy) self ms / calls / total ms:")
            for name, n, self_ms, tot in hp["python"]:
                log(f"      {self_ms:8.3f} {n:5d} {tot:8.3f}  {name[-70:]}")
            for name, (self_ms, n, tot) in hp["ops"].items():
                log(f"      op {name}: {n} calls, {tot:.3f} ms with what it calls")
        rows.append(row)
        del qi, ki, bi, xs
    return rows


def graphed(fn):
    """fn (one training step) captured in a CUDA graph after warm-up calls on a side stream;
    returns the graph's replay: the step without the host's per-call work."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return g.replay


def fmt(v, spec=".2f"):
    return "—" if v is None else format(v, spec)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--configs", default="flash-msa,paper",
                    help="head configurations: " + ", ".join(
                        f"{k} (Hq={v['Hq']} Hkv={v['Hkv']} Hi={v['Hi']} Hik={v['Hik']})"
                        for k, v in HEADS.items()))
    ap.add_argument("--lengths", default="16384,32768,131072")
    ap.add_argument("--batch-tokens", type=int, default=0,
                    help="pack B = max(1, this // T) sequences (default: one sequence)")
    ap.add_argument("--index", default="shared,mixed,random",
                    help="overlap levels of the index inputs: " + "; ".join(
                        f"{k}: {v['text']}" for k, v in sp.LEVELS.items()))
    ap.add_argument("--top-k", type=int, default=16)
    ap.add_argument("--block-size", type=int, default=128)
    ap.add_argument("--head-dim", type=int, default=128, help="D = Di")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--dense-max-tokens", type=int, default=131072)
    ap.add_argument("--no-l2-flush", action="store_true")
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--host-profile", action="store_true",
                    help="also break the step's host time down by op and CUDA runtime call")
    ap.add_argument("--graph", action="store_true",
                    help="also time the training step captured in a CUDA graph (step_graph_ms)")
    ap.add_argument("--kl-pass", choices=["auto", "fused", "separate", "teacher"], default="auto",
                    help="how the backward computes the KL gradient (Options::kl_pass)")
    ap.add_argument("--device", default="cuda",
                    help="cuda, or cpu to exercise the script on the CPU backend (tiny shapes)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--fwd-pass", choices=["auto", "query_tile", "kv_block", "split"], default="auto",
                    help="how the sparse forward walks its work (Options.fwd_pass)")
    ap.add_argument("--dq-pass", choices=["auto", "query_tile", "from_ds"], default="auto",
                    help="how the backward computes dq (Options::dq_pass)")
    ap.add_argument("--bwd-chunk-tokens", type=int, default=0,
                    help="tokens of one backward pass with dq from dS (Options::bwd_chunk_tokens; "
                         "0: the library's choice)")
    ap.add_argument("--fwd-chunk-tokens", type=int, default=0,
                    help="tokens of one pass of the split or KV-block forward (Options::fwd_chunk_tokens; "
                         "0: the library's choice)")
    ap.add_argument("--select-scores", choices=["input", "fp8"], default="input",
                    help="what the step's and the select column's selection ranks blocks by "
                         "(Options::select_scores; fwd and bwd run over the bf16 selection)")
    ap.add_argument("--trained", default=None,
                    help="also time the forward and backward over a trained model's saved "
                         "selections (examples/train_retrieval.py's PREFIX_block_idx.pt) at "
                         "lengths equal to the file's, B = 1")
    ap.add_argument("--out", default=None, help="write PREFIX.csv and PREFIX.json")
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args(argv)
    try:
        sp.level_names(args.index)
    except ValueError as e:
        raise SystemExit(str(e))
    for cfg in args.configs.split(","):
        if cfg not in HEADS:
            raise SystemExit(f"unknown config {cfg!r}; known: {', '.join(HEADS)}")
    if args.quick:
        args.lengths, args.reps = "4096", 3
    import msa
    device = torch.device(args.device)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise SystemExit("no CUDA device visible (use --device cpu to exercise the script)")
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
    gen = torch.Generator(device=device)
    gen.manual_seed(args.seed)
    timer = Timer(device, not args.no_l2_flush)
    rows = []
    for cfg in args.configs.split(","):
        for L in [bf.parse_tokens(x) for x in args.lengths.split(",")]:
            B = max(1, args.batch_tokens // L)
            log(f"{cfg}: T={bf.fmt_tokens(L)} B={B}")
            with msa.value_checks(False):  # kernel times (see bench_forward.py)
                rows += bench_case(msa, cfg, L, B, args, timer, device, torch.bfloat16, gen)
            if device.type == "cuda":
                torch.cuda.empty_cache()
    if args.out:
        meta = bf.metadata(device, msa, args)
        bf.write_outputs(args.out, rows, meta)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else str(device)
    print(f"\n## MSA training benchmark ({name}, bf16, D=Di={args.head_dim}, "
          f"Bk={args.block_size}, k={args.top_k}, sink {SINK_BLOCKS}, local {LOCAL_BLOCKS})\n")
    print("\n".join(bf.target_lines(rows, TARGETS)))
    print("\noverlap = mean |I(t) & I(t+1)| / k of neighbouring tokens, union = mean distinct "
          f"blocks of {sp.WINDOW} neighbouring tokens / k\n")
    print("| heads | T (B) | index | overlap / union (alpha) | select | fwd ms (TF/s) "
          "| bwd ms (TF/s) | bwd+KL ms (TF/s) | step ms | step+KL value ms | dense fwd+bwd ms "
          "| step speedup (ideal) |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['config']} | {bf.fmt_tokens(r['T'])} ({r['B']}) | {r['index']} | "
              f"{r['overlap']:.2f} / {r['union']:.2f} ({r['alpha']:.2f}) | "
              f"{fmt(r.get('select_ms'))} | {fmt(r['fwd_ms'])} ({fmt(r['fwd_tflops'], '.0f')}) | "
              f"{fmt(r['bwd_ms'])} ({fmt(r['bwd_tflops'], '.0f')}) | "
              f"{fmt(r['bwd_kl_ms'])} ({fmt(r['bwd_kl_tflops'], '.0f')}) | {fmt(r.get('step_ms'))} | "
              f"{fmt(r.get('step_klv_ms'))} | {fmt(r['dense_step_ms'])} | "
              f"{fmt(r.get('step_speedup'), '.1f')}x ({fmt(r.get('ideal_speedup'), '.1f')}x) |")
    for r in rows:
        if r.get("step_graph_ms"):
            print(f"\n{r['config']} {bf.fmt_tokens(r['T'])} {r['index']}: step in a CUDA graph "
                  f"{r['step_graph_ms']:.2f} ms (eager {r['step_ms']:.2f} ms)")
    for r in rows:
        if "vs_flash_msa" in r:
            print(f"\nflash-msa shape (16K, top-k 2048, Hq=16, Hkv=2, Hi=4), {r['index']} index "
                  f"(overlap {r['overlap']:.2f}): step {r['step_ms']:.2f} ms = "
                  f"{r['vs_flash_msa']:.1f}x faster than flash-msa's best published GH200 "
                  f"forward + backward ({FLASH_MSA_BEST_MS:.1f} ms)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
