#!/usr/bin/env python3
"""MSA forward benchmark on one GPU, against dense causal attention measured in the same run.

Per head configuration and sequence length T (a fixed-length batch packed as varlen with equal
lengths, batch B so that B*T >= --total-tokens where memory allows) it times:

* index selection alone (``msa.select_blocks`` on random index vectors); TFLOP/s counted on its
  GEMM only: 2 * Di * Hi * sum over tokens of (t+1) causal keys;
* for each overlap level (``selection_patterns.LEVELS``: "shared", "mixed", "random"; index
  inputs whose selections overlap from token to token as much as the level says, the block_idx
  computed from them by ``msa.select_blocks`` with sink 1 and local 4 forced blocks):
  - the sparse attention forward over that given ``block_idx``; effective TFLOP/s counted on
    the selected work only: 4 * D * (Hq/Hi) * sum over (token, index head) of the causally
    visible keys in its selected blocks;
  - the whole MSA forward (selection + attention) on the level's index inputs;
  and the overlap (mean |I(t) & I(t+1)| / k over neighbouring tokens) and union (mean distinct
  blocks of 8 neighbouring tokens / k) of that selection, with the level's alpha;
* dense causal GQA attention: torch SDPA with ``enable_gqa``, the cuDNN backend forced (FLASH
  when cuDNN refuses); TFLOP/s on 4 * D * Hq * sum of (t+1). Beyond --dense-max-tokens (per
  sequence) its time is extrapolated from the largest measured length by the FLOP ratio
  (quadratic in T) and labelled "extrapolated".

Speedup (per level) = dense time / MSA forward time; ideal = dense FLOPs / (selection FLOPs +
selected attention FLOPs), the selected attention the largest of the levels' (they differ by
well under 1%).

Timing: CUDA events around each call, a warm-up, the median of several calls, the L2 cache
flushed before each call and, when one input set fits in L2 a few times over, several input
sets used in turn. Output: progress on stderr, a markdown table last on stdout, and
``--out PREFIX`` writes PREFIX.csv and PREFIX.json (``plot_bench.py PREFIX.csv`` plots them).

    python bench/bench_forward.py                     # paper + flash-msa heads, 8K..128K
    python bench/bench_forward.py --with-1m           # also the whole forward at 1M tokens
    python bench/bench_forward.py --quick             # a smoke run with small shapes
    python bench/bench_forward.py --device cpu --quick --lengths 256 --total-tokens 512 \\
        --top-k 8                                     # the script itself, on the CPU backend
"""

import argparse
import csv
import json
import math
import os
import statistics
import subprocess
import sys
import time
from typing import Callable, Dict, List, Optional

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import selection_patterns as sp  # noqa: E402

HEADS = {
    "paper": dict(Hq=64, Hkv=4, Hi=4, Hik=1),
    "flash-msa": dict(Hq=16, Hkv=2, Hi=4, Hik=1),
}
SINK_BLOCKS, LOCAL_BLOCKS = sp.SINK_BLOCKS, sp.LOCAL_BLOCKS  # forced blocks of every selection


def make_target(name, key, thr, covers, overlap=None, at_most=False):
    """A milestone target: rows ``covers`` selects, their value ``key`` against ``thr`` (at
    least, or at most), the worst row's ``overlap`` column shown beside it."""
    return dict(name=name, key=key, thr=thr, covers=covers, overlap=overlap, at_most=at_most)


def _paper_at(T):
    return lambda r: r["config"] == "paper" and r["T"] == T


# Targets of the forward milestone on the H200.
TARGETS = [
    make_target("sparse forward, given block_idx, shared, T >= 32K (TFLOP/s)",
                "fwd_shared_tflops", 550.0, lambda r: r["T"] >= 32 * 1024, "shared_overlap"),
    make_target("sparse forward, given block_idx, mixed, T >= 32K (TFLOP/s)",
                "fwd_mixed_tflops", 450.0, lambda r: r["T"] >= 32 * 1024, "mixed_overlap"),
    make_target("sparse forward, given block_idx, random, T >= 32K (TFLOP/s)",
                "fwd_random_tflops", 450.0, lambda r: r["T"] >= 32 * 1024, "random_overlap"),
    make_target("index selection, T >= 64K (TFLOP/s)", "select_tflops", 550.0,
                lambda r: r["T"] >= 64 * 1024),
    make_target("MSA forward vs dense, paper heads, T = 128K, mixed (x)", "speedup_mixed", 13.0,
                _paper_at(128 * 1024), "mixed_overlap"),
    make_target("MSA forward vs dense, paper heads, T = 128K, random (x)", "speedup_random", 13.0,
                _paper_at(128 * 1024), "random_overlap"),
    make_target("MSA forward vs dense, paper heads, T = 1M, mixed (x)", "speedup_mixed", 22.0,
                _paper_at(1024 * 1024), "mixed_overlap"),
    make_target("MSA forward vs dense, paper heads, T = 1M, random (x)", "speedup_random", 22.0,
                _paper_at(1024 * 1024), "random_overlap"),
]


# --------------------------------------------------------------------------------------------
# arguments
# --------------------------------------------------------------------------------------------


def parse_tokens(text: str) -> int:
    """'8192', '8K', '1M' -> tokens (K = 1024, M = 1024*1024)."""
    t = text.strip().upper()
    mult = 1
    if t.endswith("K"):
        mult, t = 1024, t[:-1]
    elif t.endswith("M"):
        mult, t = 1024 * 1024, t[:-1]
    value = int(float(t) * mult)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive token count, got {text!r}")
    return value


def token_list(text: str) -> List[int]:
    return [parse_tokens(x) for x in text.split(",") if x.strip()]


def fmt_tokens(n: int) -> str:
    if n % (1024 * 1024) == 0:
        return f"{n // (1024 * 1024)}M"
    if n % 1024 == 0:
        return f"{n // 1024}K"
    return str(n)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description="MSA forward benchmark: selection, sparse attention over a given block_idx "
                    "and the whole MSA forward on selections of several overlap levels, and "
                    "dense causal attention (cuDNN SDPA).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--configs", default="paper,flash-msa",
                   help="head configurations: " + ", ".join(
                       f"{k} (Hq={v['Hq']} Hkv={v['Hkv']} Hi={v['Hi']} Hik={v['Hik']})"
                       for k, v in HEADS.items()))
    p.add_argument("--lengths", type=token_list, default=None,
                   help="sequence lengths, e.g. 8K,16K,32K,64K,128K (default; --quick: 2K,4K)")
    p.add_argument("--total-tokens", type=parse_tokens, default=None,
                   help="batch B = max(1, total // T) sequences per length (default 128K; "
                        "--quick: 8K)")
    p.add_argument("--with-1m", action="store_true",
                   help="also time selection and the whole MSA forward at T = 1M (B = 1); "
                        "dense is extrapolated there")
    p.add_argument("--dense-max-tokens", type=parse_tokens, default=262144,
                   help="measure dense attention up to this sequence length; extrapolate beyond")
    p.add_argument("--top-k", type=int, default=16, help="blocks per (token, index head), k")
    p.add_argument("--block-size", type=int, default=128, help="tokens per block, Bk")
    p.add_argument("--head-dim", type=int, default=128, help="main head dim D")
    p.add_argument("--index-dim", type=int, default=128, help="index head dim Di")
    p.add_argument("--dtype", choices=["bf16", "fp16"], default="bf16")
    p.add_argument("--levels", default="shared,mixed,random",
                   help="overlap levels of the timed selections: " + "; ".join(
                       f"{k}: {v['text']}" for k, v in sp.LEVELS.items()))
    p.add_argument("--reps", type=int, default=5, help="at least this many timed calls")
    p.add_argument("--max-reps", type=int, default=50, help="at most this many timed calls")
    p.add_argument("--rep-ms", type=float, default=300.0,
                   help="aim for this much timed time per measurement")
    p.add_argument("--warmup-ms", type=float, default=50.0, help="warm-up time per measurement")
    p.add_argument("--no-l2-flush", action="store_true", help="do not flush L2 between calls")
    p.add_argument("--quick", action="store_true", help="small shapes, few calls: a smoke run")
    p.add_argument("--device", default="cuda",
                   help="cuda, or cpu to exercise the script on the CPU backend (tiny shapes)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--trained", default=None,
                   help="also time the forward over a trained model's saved selections (the "
                        "PREFIX_block_idx.pt of examples/train_retrieval.py) where T, Bk match")
    p.add_argument("--fwd-pass", choices=["auto", "query_tile", "kv_block", "split"], default="auto",
                   help="how the sparse forward walks its work (Options.fwd_pass)")
    p.add_argument("--out", default=None, help="write PREFIX.csv and PREFIX.json")
    p.add_argument("--skip-dense", action="store_true", help="no dense attention at all")
    return p


# --------------------------------------------------------------------------------------------
# FLOP counts
# --------------------------------------------------------------------------------------------


def causal_pairs(B: int, L: int) -> int:
    """sum over tokens of (t+1): the causal (query, key) pairs of B sequences of length L."""
    return B * L * (L + 1) // 2


def selection_flops(B, L, Hi, Di) -> float:
    return 2.0 * Di * Hi * causal_pairs(B, L)


def dense_flops(B, L, Hq, D) -> float:
    return 4.0 * D * Hq * causal_pairs(B, L)


def visible_keys(block_idx: torch.Tensor, B: int, L: int, Bk: int) -> int:
    """Sum over (token, index head) of the causally visible keys in the selected blocks."""
    pos = torch.arange(L, device=block_idx.device).repeat(B)[:, None, None]  # [T, 1, 1]
    b = block_idx.long()
    n = (pos - b * Bk + 1).clamp(min=0, max=Bk)
    return int(torch.where(b >= 0, n, torch.zeros_like(n)).sum())


def attention_flops(keys: int, Hq: int, Hi: int, D: int) -> float:
    return 4.0 * D * (Hq // Hi) * keys


# --------------------------------------------------------------------------------------------
# timing
# --------------------------------------------------------------------------------------------


def event_ms(fn) -> float:
    """Milliseconds of one fn() on the current CUDA stream, between two CUDA events."""
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    fn()
    e.record()
    e.synchronize()
    return s.elapsed_time(e)


class Timer:
    """Median time of a call (ms): CUDA events on the GPU, perf_counter on the CPU."""

    def __init__(self, device: torch.device, args):
        self.device = device
        self.args = args
        self.cuda = device.type == "cuda"
        self.flush_buf = None
        if self.cuda and not args.no_l2_flush:
            l2 = getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 0) or (64 << 20)
            self.flush_buf = torch.empty(max(2 * l2, 256 << 20), dtype=torch.uint8, device=device)

    def _sync(self):
        if self.cuda:
            torch.cuda.synchronize(self.device)

    def _once(self, fn) -> float:
        if self.cuda:
            return event_ms(fn)
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3

    def median_ms(self, fns: List[Callable[[], object]]) -> float:
        a = self.args
        fns[0]()  # first call: one-time set-up (kernel attributes, allocator)
        self._sync()
        est = max(self._once(fns[0]), 1e-3)
        n_warm = int(min(max(a.warmup_ms / est, 1), 20))
        n_rep = int(min(max(a.rep_ms / est, a.reps), a.max_reps))
        for i in range(n_warm):
            fns[i % len(fns)]()
        self._sync()
        times = []
        if self.cuda:
            ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                  for _ in range(n_rep)]
            for i in range(n_rep):
                if self.flush_buf is not None:
                    self.flush_buf.zero_()
                ev[i][0].record()
                fns[i % len(fns)]()
                ev[i][1].record()
            self._sync()
            times = [s.elapsed_time(e) for s, e in ev]
        else:
            for i in range(n_rep):
                t0 = time.perf_counter()
                fns[i % len(fns)]()
                times.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(times)


# --------------------------------------------------------------------------------------------
# dense attention
# --------------------------------------------------------------------------------------------


def dense_runner(q4, k4, v4, device):
    """A callable running causal GQA SDPA and the backend's name: cuDNN forced (on the [B, H, L,
    D] views, then on contiguous copies), else FLASH; K/V expanded to Hq heads when GQA is
    refused."""
    F = torch.nn.functional
    if device.type != "cuda":
        def run_cpu():
            return F.scaled_dot_product_attention(q4, k4, v4, is_causal=True, enable_gqa=True)
        return run_cpu, "cpu-default"
    from torch.nn.attention import SDPBackend, sdpa_kernel

    G = q4.shape[1] // k4.shape[1]
    cudnn, flash = SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION
    #        backend  name     gqa    contiguous copies
    tries = [(cudnn, "cudnn", True, False), (cudnn, "cudnn", True, True),
             (flash, "flash", True, False), (cudnn, "cudnn", False, True),
             (flash, "flash", False, False)]
    errors = []
    for backend, name, gqa, copy in tries:
        label = name + ("" if gqa else "+expand") + ("+contiguous" if copy else "")
        try:
            qq, kk, vv = q4, k4, v4
            if not gqa:
                kk, vv = kk.repeat_interleave(G, 1), vv.repeat_interleave(G, 1)
            if copy:
                qq, kk, vv = qq.contiguous(), kk.contiguous(), vv.contiguous()

            def run(backend=backend, qq=qq, kk=kk, vv=vv, gqa=gqa):
                with sdpa_kernel([backend]):
                    return F.scaled_dot_product_attention(qq, kk, vv, is_causal=True,
                                                          enable_gqa=gqa)
            run()
            torch.cuda.synchronize(device)
            return run, label
        except RuntimeError as e:  # the backend refused these inputs (or memory ran out)
            errors.append(f"{label}: {str(e).splitlines()[0][:120] if str(e) else type(e).__name__}")
    raise RuntimeError("no dense SDPA backend ran: " + " | ".join(errors))


# --------------------------------------------------------------------------------------------
# one configuration and length
# --------------------------------------------------------------------------------------------


def log(msg: str):
    print(msg, file=sys.stderr, flush=True)


def tflops(flops: float, ms: Optional[float]) -> Optional[float]:
    return None if not ms else flops / (ms * 1e-3) / 1e12


def error_text(e: BaseException) -> str:
    return f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"


def bench_case(msa, cfg_name: str, L: int, B: int, full_only: bool, args, timer: Timer,
               device: torch.device, dtype: torch.dtype, gen: torch.Generator) -> Dict:
    h = HEADS[cfg_name]
    Hq, Hkv, Hi, Hik = h["Hq"], h["Hkv"], h["Hi"], h["Hik"]
    D, Di, Bk, k = args.head_dim, args.index_dim, args.block_size, args.top_k
    T = B * L
    row = dict(config=cfg_name, T=L, B=B, tokens=T, Hq=Hq, Hkv=Hkv, Hi=Hi, Hik=Hik, D=D, Di=Di,
               Bk=Bk, k=k, dtype=args.dtype)
    set_bytes = T * (2 * Hq * D + 2 * Hkv * D + Hi * Di + Hik * Di) * 2
    n_sets = 1
    if device.type == "cuda":
        l2 = getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 0) or (64 << 20)
        if set_bytes < 3 * l2:
            n_sets = min(8, math.ceil(3 * l2 / max(set_bytes, 1)))
    row["input_sets"] = n_sets

    def r(*shape):
        return torch.randn(*shape, device=device, dtype=dtype, generator=gen)

    sets = [dict(q=r(T, Hq, D), k=r(T, Hkv, D), v=r(T, Hkv, D), qi=r(T, Hi, Di), ki=r(T, Hik, Di))
            for _ in range(n_sets)]
    cu = torch.arange(B + 1, device=device, dtype=torch.int32) * L

    def select(s):
        return lambda: msa.select_blocks(s["qi"], s["ki"], k, Bk, cu_seqlens=cu,
                                         sink_blocks=SINK_BLOCKS, local_blocks=LOCAL_BLOCKS)

    def full(s, qi, ki):
        return lambda: msa.sparse_attention(s["q"], s["k"], s["v"], qi, ki, k, Bk, cu_seqlens=cu,
                                            sink_blocks=SINK_BLOCKS, local_blocks=LOCAL_BLOCKS,
                                            kl_value=False, fwd_pass=args.fwd_pass)

    def given(s, bi):
        return lambda: msa.sparse_attention(s["q"], s["k"], s["v"], None, None, block_idx=bi,
                                            block_size=Bk, cu_seqlens=cu, kl_value=False,
                                            fwd_pass=args.fwd_pass)

    sel_fl = selection_flops(B, L, Hi, Di)
    row["select_gflop"] = sel_fl / 1e9
    try:
        ms = timer.median_ms([select(s) for s in sets])
        row.update(select_ms=ms, select_tflops=tflops(sel_fl, ms))
    except Exception as e:  # noqa: BLE001 - reported in the table, the run goes on
        row["select_error"] = error_text(e)
    log(f"  select      {row.get('select_ms', float('nan')):10.3f} ms")

    # Per overlap level: its index inputs (for the first input set calibrated on those very
    # inputs, the other sets drawn with the same alpha), the selection of the first set (its
    # overlap and union go into the row), the sparse forward over that block_idx, and the
    # whole forward on each set's index inputs.
    att_max, keys_max = 0.0, 0
    for name in sp.level_names(args.levels):
        try:
            qi, ki, bi, st = sp.make_level(name, cu, Hi, Hik, Di, Bk, k, dtype=dtype,
                                           device=device, generator=gen,
                                           sink_blocks=SINK_BLOCKS, local_blocks=LOCAL_BLOCKS)
            alpha = st["alpha"]
            idx_sets = [(qi, ki)] + [sp.index_inputs(alpha, cu, Hi, Hik, Di, Bk, dtype=dtype,
                                                     generator=gen, device=device)
                                     for _ in sets[1:]]
            del qi, ki
            row.update({f"{name}_alpha": alpha, f"{name}_overlap": st["overlap"],
                        f"{name}_union": st["union"]})
            keys = visible_keys(bi, B, L, Bk)
            fl = attention_flops(keys, Hq, Hi, D)
            if fl > att_max:
                att_max, keys_max = fl, keys
        except Exception as e:  # noqa: BLE001 - reported in the table, the run goes on
            row[f"{name}_error"] = error_text(e)
            log(f"  {name}: {row[f'{name}_error']}")
            continue
        log(f"  {name}: alpha {alpha:.3f}, overlap {st['overlap']:.3f}, union {st['union']:.2f}")
        if not full_only:
            try:
                row[f"fwd_{name}_gflop"] = fl / 1e9
                ms = timer.median_ms([given(s, bi) for s in sets])
                row.update({f"fwd_{name}_ms": ms, f"fwd_{name}_tflops": tflops(fl, ms)})
                if name == "shared":  # the same call with the library's default value checks
                    with msa.value_checks(True):
                        row["fwd_shared_checked_ms"] = timer.median_ms([given(s, bi) for s in sets])
            except Exception as e:  # noqa: BLE001
                row[f"fwd_{name}_error"] = error_text(e)
            log(f"  fwd {name:9s} {row.get(f'fwd_{name}_ms', float('nan')):10.3f} ms")
        del bi
        try:
            row[f"msa_{name}_gflop"] = (sel_fl + fl) / 1e9
            ms = timer.median_ms([full(s, qi, ki) for s, (qi, ki) in zip(sets, idx_sets)])
            row.update({f"msa_{name}_ms": ms, f"msa_{name}_tflops": tflops(sel_fl + fl, ms)})
        except Exception as e:  # noqa: BLE001
            row[f"msa_{name}_error"] = error_text(e)
        log(f"  msa {name:9s} {row.get(f'msa_{name}_ms', float('nan')):10.3f} ms")
        del idx_sets
    # A trained index branch's selections (--trained, saved by examples/train_retrieval.py):
    # the sparse forward over each saved layer's block_idx, where the file's length and block
    # size are this case's and B = 1. Their overlap and union go into the row.
    if args.trained and not full_only:
        trained, trained_bk = sp.load_trained(args.trained, Hi, device)
        for layer, bi in trained.items():
            if B != 1 or bi.shape[0] != L or trained_bk != Bk:
                continue
            name = f"trained_{layer}"
            try:
                st = sp.selection_stats(bi, cu, bi.shape[2])
                fl = attention_flops(visible_keys(bi, B, L, Bk), Hq, Hi, D)
                ms = timer.median_ms([given(s, bi) for s in sets])
                row.update({f"{name}_overlap": st["overlap"], f"{name}_union": st["union"],
                            f"fwd_{name}_gflop": fl / 1e9, f"fwd_{name}_ms": ms,
                            f"fwd_{name}_tflops": tflops(fl, ms)})
            except Exception as e:  # noqa: BLE001
                row[f"fwd_{name}_error"] = error_text(e)
            log(f"  fwd {name} {row.get(f'fwd_{name}_ms', float('nan')):10.3f} ms")
    dfl = dense_flops(B, L, Hq, D)
    if att_max:
        row["selected_fraction"] = keys_max / (Hi * causal_pairs(B, L))
        row["ideal_speedup"] = dfl / (sel_fl + att_max)

    dfl = dense_flops(B, L, Hq, D)
    row["dense_gflop"] = dfl / 1e9
    if not args.skip_dense and L <= args.dense_max_tokens:
        # The warmup forward (dense causal main branch through the same kernel, every block).
        try:
            s0 = sets[0]
            ms = timer.median_ms([lambda: msa.warmup_attention(s0["q"], s0["k"], s0["v"], None, None,
                                                                cu_seqlens=cu, kl_value=False)])
            row.update(warmup_ms=ms, warmup_tflops=tflops(dfl, ms))
        except Exception as e:  # noqa: BLE001
            row["warmup_error"] = error_text(e)
        log(f"  warmup fwd  {row.get('warmup_ms', float('nan')):10.3f} ms")
        try:
            s0 = sets[0]
            # [B, H, L, D] views of the packed tensors (SDPA's preferred BSHD memory layout)
            q4, k4, v4 = (s0[n].view(B, L, -1, s0[n].shape[-1]).transpose(1, 2)
                          for n in ("q", "k", "v"))
            run, backend = dense_runner(q4, k4, v4, device)
            ms = timer.median_ms([run])
            row.update(dense_ms=ms, dense_tflops=tflops(dfl, ms), dense_backend=backend,
                       dense_source="measured")
        except Exception as e:  # noqa: BLE001
            row["dense_error"] = error_text(e)
        log(f"  dense       {row.get('dense_ms', float('nan')):10.3f} ms "
            f"({row.get('dense_backend', row.get('dense_error', ''))})")
    del sets
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return row


def extrapolate_dense(rows: List[Dict]):
    """Rows without a measured dense time get one scaled from the largest measured length of
    the same configuration by the dense FLOP ratio."""
    for row in rows:
        if row.get("dense_ms") is not None:
            continue
        ref = [r for r in rows if r["config"] == row["config"] and r.get("dense_source") == "measured"]
        if not ref:
            continue
        base = max(ref, key=lambda r: r["T"])
        ms = base["dense_ms"] * row["dense_gflop"] / base["dense_gflop"]
        row.update(dense_ms=ms, dense_tflops=base["dense_tflops"],
                   dense_backend=base["dense_backend"],
                   dense_source=f"extrapolated from {fmt_tokens(base['T'])}")
    for row in rows:
        for name in sp.LEVELS:
            if row.get("dense_ms") and row.get(f"msa_{name}_ms"):
                row[f"speedup_{name}"] = row["dense_ms"] / row[f"msa_{name}_ms"]


# --------------------------------------------------------------------------------------------
# report
# --------------------------------------------------------------------------------------------


def _f(v, spec=".2f"):
    return "—" if v is None else format(v, spec)


def _ms_tf(row, key):
    if row.get(f"{key}_error"):
        return "error"
    ms, tf = row.get(f"{key}_ms"), row.get(f"{key}_tflops")
    if ms is None:
        return "—"
    if tf is None:
        return f"{ms:.3f}"
    return f"{ms:.3f} ({tf:.0f})" if tf >= 10 else f"{ms:.3f} ({tf:.2g})"


def _ov_un(row, name):
    if row.get(f"{name}_error"):
        return "error"
    ov, un, al = (row.get(f"{name}_{x}") for x in ("overlap", "union", "alpha"))
    if ov is None:
        return "—"
    return f"{ov:.2f} / {un:.2f} ({al:.2f})"


def _x(v):
    return "—" if v is None else f"{v:.1f}x"


def markdown_table(rows: List[Dict], levels: List[str]) -> str:
    head = ["config", "T", "B", "select ms (TF/s)"]
    head += [f"{p}: overlap / union (alpha)" for p in levels]
    head += [f"fwd {p} ms (TF/s)" for p in levels]
    if "shared" in levels:
        head += ["fwd shared, value checks on ms"]
    head += [f"MSA fwd {p} ms (TF/s)" for p in levels]
    head += ["sel. frac", "warmup fwd ms (TF/s)", "dense ms (TF/s)", "dense"]
    head += [f"speedup {p}" for p in levels] + ["ideal"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        dense = _ms_tf(r, "dense")
        src = r.get("dense_source", "")
        if src.startswith("extrapolated"):
            dense = f"{r['dense_ms']:.1f} (extrapolated)"
        cells = [r["config"], fmt_tokens(r["T"]), str(r["B"]), _ms_tf(r, "select")]
        cells += [_ov_un(r, p) for p in levels]
        cells += [_ms_tf(r, f"fwd_{p}") for p in levels]
        if "shared" in levels:
            cells += [_f(r.get("fwd_shared_checked_ms"), ".3f")]
        cells += [_ms_tf(r, f"msa_{p}") for p in levels]
        cells += [_f(r.get("selected_fraction"), ".3f"), _ms_tf(r, "warmup"), dense,
                  f"{r.get('dense_backend', '—')}{'' if src in ('', 'measured') else ' ' + src}"]
        cells += [_x(r.get(f"speedup_{p}")) for p in levels] + [_x(r.get("ideal_speedup"))]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def target_lines(rows: List[Dict], targets: Optional[List[Dict]] = None) -> List[str]:
    """The milestone's targets against the worst measured value of the rows they cover, with
    the overlap of the selection that row timed."""
    out = ["| target | threshold | measured (worst) | overlap there | |", "|---|---|---|---|---|"]
    for t in TARGETS if targets is None else targets:
        vals = [r for r in rows if t["covers"](r) and r.get(t["key"]) is not None]
        thr = t["thr"]
        rel = f"{'<=' if t['at_most'] else '>='} {thr:g}"
        if not vals:
            out.append(f"| {t['name']} | {rel} | not run | | |")
            continue
        pick = max if t["at_most"] else min
        worst = pick(vals, key=lambda r: r[t["key"]])
        v = worst[t["key"]]
        ok = v <= thr if t["at_most"] else v >= thr
        ov = worst.get(t["overlap"]) if t["overlap"] else None
        shown = f"{v:.2f}" if t["at_most"] else f"{v:.1f}"  # times near a bound: two decimals
        out.append(f"| {t['name']} | {rel} | {shown} | {_f(ov)} | {'met' if ok else 'MISSED'} |")
    return out


def write_outputs(prefix: str, rows: List[Dict], meta: Dict):
    for ext in (".csv", ".json"):
        if prefix.endswith(ext):
            prefix = prefix[: -len(ext)]
    d = os.path.dirname(prefix)
    if d:
        os.makedirs(d, exist_ok=True)
    keys: List[str] = []
    for r in rows:
        keys += [k for k in r if k not in keys]
    with open(prefix + ".csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=keys)
        w.writeheader()
        for r in rows:
            w.writerow(r)
    with open(prefix + ".json", "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)
    log(f"wrote {prefix}.csv and {prefix}.json")


def metadata(device: torch.device, msa, args) -> Dict:
    meta = dict(torch=torch.__version__, msa=msa.version(), device=str(device), args=vars(args),
                time=time.strftime("%Y-%m-%d %H:%M:%S"))
    if device.type == "cuda":
        p = torch.cuda.get_device_properties(device)
        meta.update(gpu=p.name, sms=p.multi_processor_count, cuda=torch.version.cuda)
    try:
        here = os.path.dirname(os.path.abspath(__file__))
        meta["commit"] = subprocess.run(["git", "-C", here, "rev-parse", "--short", "HEAD"],
                                        capture_output=True, text=True, timeout=5).stdout.strip()
    except Exception:  # noqa: BLE001 - no git: no commit in the metadata
        pass
    return meta


# --------------------------------------------------------------------------------------------
# main
# --------------------------------------------------------------------------------------------


def plan(args) -> List[tuple]:
    """(config, T, B, full_only) per case, in order."""
    lengths = args.lengths or ([2048, 4096] if args.quick else
                               [8192, 16384, 32768, 65536, 131072])
    total = args.total_tokens or (8192 if args.quick else 131072)
    cases = []
    for cfg in [c for c in args.configs.split(",") if c]:
        if cfg not in HEADS:
            raise SystemExit(f"unknown config {cfg!r}; known: {', '.join(HEADS)}")
        for L in lengths:
            cases.append((cfg, L, max(1, total // L), False))
        if args.with_1m and 1024 * 1024 not in lengths:
            cases.append((cfg, 1024 * 1024, 1, True))
    return cases


def fit_batch(cfg: str, L: int, B: int, args, device) -> int:
    """Halve B until the case's tensors fit comfortably in free device memory."""
    if device.type != "cuda":
        return B
    h = HEADS[cfg]
    D, Di, k = args.head_dim, args.index_dim, args.top_k
    per_token = (2 * (2 * h["Hq"] * D + 2 * h["Hkv"] * D + h["Hi"] * Di + h["Hik"] * Di)
                 + 2 * h["Hi"] * k * 4 + h["Hi"] * k * 8 * 12)  # + selections and their stats
    free, _ = torch.cuda.mem_get_info(device)
    while B > 1 and B * L * per_token * 1.5 > free:
        B //= 2
    return B


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        levels = sp.level_names(args.levels)
    except ValueError as e:
        raise SystemExit(str(e))
    if args.quick:
        args.reps = min(args.reps, 3)
        args.rep_ms = min(args.rep_ms, 50.0)
        args.warmup_ms = min(args.warmup_ms, 10.0)
    import msa  # noqa: E402 - after argument parsing, so --help needs no library

    device = torch.device(args.device)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise SystemExit("no CUDA device visible (use --device cpu to exercise the script)")
        if not msa.backend_available("cuda"):
            raise SystemExit("this libmsa has no usable CUDA backend")
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        torch.cuda.set_device(device)
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float16
    gen = torch.Generator(device=device)
    gen.manual_seed(args.seed)
    torch.manual_seed(args.seed)
    timer = Timer(device, args)
    meta = metadata(device, msa, args)
    log(f"msa {meta['msa']}, torch {meta['torch']}, {meta.get('gpu', device)}")

    rows = []
    with torch.inference_mode():
        for cfg, L, B, full_only in plan(args):
            B = fit_batch(cfg, L, B, args, device)
            log(f"{cfg}: T={fmt_tokens(L)} B={B}{' (selection + whole forward only)' if full_only else ''}")
            # Kernel times: the value checks of cu_seqlens and block_idx (one stream
            # synchronisation per call) are off, and timed once per length on their own.
            with msa.value_checks(False):
                rows.append(bench_case(msa, cfg, L, B, full_only, args, timer, device, dtype, gen))
    extrapolate_dense(rows)
    if args.out:
        write_outputs(args.out, rows, meta)
    print(f"\nMSA forward on {meta.get('gpu', device)} ({args.dtype}, D={args.head_dim}, "
          f"Di={args.index_dim}, Bk={args.block_size}, k={args.top_k}, sink {SINK_BLOCKS}, local "
          f"{LOCAL_BLOCKS}); times in ms, TF/s = TFLOP/s counted on the selected work (selection: "
          "its GEMM; dense: causal half); overlap = mean |I(t) & I(t+1)| / k of neighbouring "
          f"tokens, union = mean distinct blocks of {sp.WINDOW} neighbouring tokens / k\n")
    print("\n".join(target_lines(rows)))
    print()
    print("## MSA forward benchmark")
    print()
    print(markdown_table(rows, levels))
    errors = [f"{r['config']} T={fmt_tokens(r['T'])} {k}: {v}" for r in rows for k, v in r.items()
              if k.endswith("_error")]
    if errors:
        print("\nerrors:\n" + "\n".join(errors), file=sys.stderr)
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
