#!/usr/bin/env python3
"""MSA forward benchmark on one GPU, against dense causal attention measured in the same run.

Per head configuration and sequence length T (a fixed-length batch packed as varlen with equal
lengths, batch B so that B*T >= --total-tokens where memory allows) it times:

* index selection alone (``msa.select_blocks``); TFLOP/s counted on its GEMM only:
  2 * Di * Hi * sum over tokens of (t+1) causal keys;
* the sparse attention forward over a given ``block_idx``, for two patterns built on the GPU:
  "realistic" (block 0 as sink, the own block and the 3 before it, long-range blocks shared by
  the tokens of a 128-token query block with 2 slots chosen per token) and "random" (each token
  and index head picks its own k-1 earlier blocks plus its own block); effective TFLOP/s
  counted on the selected work only: 4 * D * (Hq/Hi) * sum over (token, index head) of the
  causally visible keys in its selected blocks;
* the whole MSA forward (selection + attention, ``select=True``);
* dense causal GQA attention: torch SDPA with ``enable_gqa``, the cuDNN backend forced (FLASH
  when cuDNN refuses); TFLOP/s on 4 * D * Hq * sum of (t+1). Beyond --dense-max-tokens (per
  sequence) its time is extrapolated from the largest measured length by the FLOP ratio
  (quadratic in T) and labelled "extrapolated".

Speedup = dense time / MSA forward time; ideal = dense FLOPs / (selection FLOPs + selected
attention FLOPs of the forward's own selection).

Timing: CUDA events around each call, a warm-up, the median of several calls, the L2 cache
flushed before each call and, when one input set fits in L2 a few times over, several input
sets used in turn. Output: progress on stderr, a markdown table last on stdout, and
``--out PREFIX`` writes PREFIX.csv and PREFIX.json.

    python bench/bench_forward.py                     # paper + flash-msa heads, 8K..128K
    python bench/bench_forward.py --with-1m           # also the whole forward at 1M tokens
    python bench/bench_forward.py --quick             # a smoke run with small shapes
    python bench/bench_forward.py --device cpu --quick --lengths 256 --total-tokens 512 \\
        --top-k 2                                     # the script itself, on the CPU backend
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

HEADS = {
    "paper": dict(Hq=64, Hkv=4, Hi=4, Hik=1),
    "flash-msa": dict(Hq=16, Hkv=2, Hi=4, Hik=1),
}
QUERY_BLOCK = 128  # tokens whose "realistic" long-range blocks are shared
PER_TOKEN_SLOTS = 2  # slots of the realistic pattern that differ from token to token
LOCAL_BEFORE = 3  # realistic pattern: the own block and this many before it
BIG = 1 << 62

# Targets of the forward milestone on the H200: (what, row value, threshold, rows it covers).
TARGETS = [
    ("sparse forward, shared realistic, T >= 32K (TFLOP/s)", "fwd_shared_tflops", 600.0,
     lambda r: r["T"] >= 32 * 1024),
    ("sparse forward, realistic with per-token slots, T >= 32K (TFLOP/s)",
     "fwd_realistic_tflops", 600.0, lambda r: r["T"] >= 32 * 1024),
    ("index selection, T >= 64K (TFLOP/s)", "select_tflops", 550.0,
     lambda r: r["T"] >= 64 * 1024),
    ("MSA forward vs dense, paper heads, T = 128K, random idx (x)", "speedup", 13.0,
     lambda r: r["config"] == "paper" and r["T"] == 128 * 1024),
    ("MSA forward vs dense, paper heads, T = 128K, structured idx (x)", "speedup_structured",
     13.0, lambda r: r["config"] == "paper" and r["T"] == 128 * 1024),
    ("MSA forward vs dense, paper heads, T = 1M, random idx (x)", "speedup", 22.0,
     lambda r: r["config"] == "paper" and r["T"] == 1024 * 1024),
    ("MSA forward vs dense, paper heads, T = 1M, structured idx (x)", "speedup_structured",
     22.0, lambda r: r["config"] == "paper" and r["T"] == 1024 * 1024),
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
        description="MSA forward benchmark: selection, sparse attention (realistic and random "
                    "block_idx), whole MSA forward, and dense causal attention (cuDNN SDPA).",
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
    p.add_argument("--patterns", default="shared,realistic,random",
                   help="block_idx patterns for the given-selection forward")
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
    p.add_argument("--out", default=None, help="write PREFIX.csv and PREFIX.json")
    p.add_argument("--skip-dense", action="store_true", help="no dense attention at all")
    return p


# --------------------------------------------------------------------------------------------
# block_idx patterns (built with torch on the device)
# --------------------------------------------------------------------------------------------


def sample_distinct(n: torch.Tensor, m: int, taken: Optional[torch.Tensor] = None,
                    gen: Optional[torch.Generator] = None) -> torch.Tensor:
    """Per row of ``n`` (int64, any shape S): ``m`` distinct uniform samples from
    ``[0, n) minus taken`` (``taken`` [S, e] sorted ascending, BIG for an empty entry), in
    sampling order (so any prefix is a uniform subset); -1 once the row runs out."""
    shape = tuple(n.shape)
    dev = n.device
    if taken is None:
        taken = torch.full(shape + (0,), BIG, dtype=torch.int64, device=dev)
    avail0 = n - (taken < BIG).sum(-1)
    out = []
    for i in range(m):
        avail = avail0 - i
        r = (torch.rand(shape, generator=gen, device=dev, dtype=torch.float64)
             * avail.clamp(min=1)).long()
        r = torch.minimum(r, (avail - 1).clamp(min=0))
        x = r
        for j in range(taken.shape[-1]):  # the r-th value not taken: step over taken ones
            x = x + (taken[..., j] <= x).long()
        ok = avail > 0
        out.append(torch.where(ok, x, torch.full_like(x, -1)))
        taken = torch.cat([taken, torch.where(ok, x, torch.full_like(x, BIG))[..., None]], -1)
        taken = taken.sort(-1).values
    if not out:
        return torch.full(shape + (0,), -1, dtype=torch.int64, device=dev)
    return torch.stack(out, -1)


def _pack_rows(cols: torch.Tensor, k: int) -> torch.Tensor:
    """[..., c] block ids with -1 holes -> [..., k] int32: ascending ids then -1."""
    v = torch.where(cols >= 0, cols, torch.full_like(cols, BIG)).sort(-1).values
    count = (v < BIG).sum(-1)
    if int(count.max()) > k:
        raise AssertionError("pattern: more than k blocks in a row")
    if v.shape[-1] < k:
        v = torch.cat([v, v.new_full(v.shape[:-1] + (k - v.shape[-1],), BIG)], -1)
    v = v[..., :k]
    return torch.where(v < BIG, v, torch.full_like(v, -1)).to(torch.int32)


def random_pattern(B: int, L: int, Hi: int, k: int, Bk: int, device,
                   gen: Optional[torch.Generator] = None) -> torch.Tensor:
    """[B*L, Hi, k]: per (token, index head) the own block + k-1 random earlier blocks."""
    pos = torch.arange(L, device=device)
    own = (pos // Bk)[None, :, None].expand(B, L, Hi)
    picks = sample_distinct(own.contiguous(), k - 1, gen=gen)  # from [0, own)
    cols = torch.cat([own[..., None], picks], -1)
    return _pack_rows(cols, k).reshape(B * L, Hi, k)


def realistic_pattern(B: int, L: int, Hi: int, k: int, Bk: int, device,
                      gen: Optional[torch.Generator] = None,
                      per_token: int = PER_TOKEN_SLOTS) -> torch.Tensor:
    """[B*L, Hi, k]: block 0 (sink), the own block and LOCAL_BEFORE before it, then
    long-range blocks shared by the tokens of each QUERY_BLOCK-token query block, with
    ``per_token`` of them chosen per token (all earlier blocks when fewer are left); with
    ``per_token=0`` ("shared") every token of a query block selects the same blocks."""
    nforced = LOCAL_BEFORE + 2
    if k < nforced + per_token:
        raise ValueError(f"the realistic pattern needs k >= {nforced + per_token}")
    pos = torch.arange(L, device=device)
    blk = pos // Bk  # [L]
    # forced: sink 0 and blocks blk-LOCAL_BEFORE .. blk (each once)
    local = blk[:, None] - torch.arange(LOCAL_BEFORE, -1, -1, device=device)[None, :]
    local = torch.where(local >= 0, local, torch.full_like(local, -1))
    sink = torch.where(blk > LOCAL_BEFORE, torch.zeros_like(blk), torch.full_like(blk, -1))
    forced = torch.cat([sink[:, None], local], -1)  # [L, nforced]
    nf = (forced >= 0).sum(-1)
    slots = k - nf  # [L]
    # long-range candidates: blocks 1 .. blk-LOCAL_BEFORE-1, i.e. [0, n) shifted by 1
    n_tok = (blk - LOCAL_BEFORE - 1).clamp(min=0)  # [L]
    nq = (L + QUERY_BLOCK - 1) // QUERY_BLOCK
    qfirst = torch.arange(nq, device=device) * QUERY_BLOCK
    n_q = (qfirst // Bk - LOCAL_BEFORE - 1).clamp(min=0)  # candidates every token of it has
    m_max = k - nforced - per_token
    shared = sample_distinct(n_q[None, :, None].expand(B, nq, Hi).contiguous(), m_max, gen=gen)
    qb = pos // QUERY_BLOCK
    shared_tok = shared[:, qb]  # [B, L, Hi, m_max]
    # per token: all candidates when they fit, else m shared + the rest per token
    fits = n_tok <= slots
    m = torch.where(fits, torch.zeros_like(slots), torch.minimum(slots - per_token, n_q[qb]))
    col = torch.arange(m_max, device=device)
    use = col[None, :] < m[:, None]  # [L, m_max]
    chosen = torch.where(use[None, :, None, :], shared_tok, torch.full_like(shared_tok, -1))
    taken = torch.where(chosen >= 0, chosen, torch.full_like(chosen, BIG)).sort(-1).values
    r = torch.minimum(slots - m, n_tok - m)  # per-token picks
    r_max = int(r.max()) if r.numel() else 0
    own_n = n_tok[None, :, None].expand(B, L, Hi).contiguous()
    picks = sample_distinct(own_n, r_max, taken=taken, gen=gen)  # [B, L, Hi, r_max]
    pick_col = torch.arange(r_max, device=device)
    keep = (pick_col[None, :] < r[:, None])[None, :, None, :]  # [1, L, 1, r_max]
    picks = torch.where(keep, picks, torch.full_like(picks, -1))
    long_range = torch.cat([chosen, picks], -1)
    long_range = torch.where(long_range >= 0, long_range + 1, long_range)  # shift: block >= 1
    cols = torch.cat([forced[None, :, None, :].expand(B, L, Hi, nforced), long_range], -1)
    return _pack_rows(cols, k).reshape(B * L, Hi, k)


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
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            fn()
            e.record()
            e.synchronize()
            return s.elapsed_time(e)
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
        return lambda: msa.select_blocks(s["qi"], s["ki"], k, Bk, cu_seqlens=cu)

    def full(s):
        return lambda: msa.sparse_attention(s["q"], s["k"], s["v"], s["qi"], s["ki"], k, Bk,
                                            cu_seqlens=cu, kl_value=False)

    def given(s, bi):
        return lambda: msa.sparse_attention(s["q"], s["k"], s["v"], None, None, block_idx=bi,
                                            block_size=Bk, cu_seqlens=cu, kl_value=False)

    sel_fl = selection_flops(B, L, Hi, Di)
    row["select_gflop"] = sel_fl / 1e9
    try:
        ms = timer.median_ms([select(s) for s in sets])
        row.update(select_ms=ms, select_tflops=tflops(sel_fl, ms))
    except Exception as e:  # noqa: BLE001 - reported in the table, the run goes on
        row["select_error"] = error_text(e)
    log(f"  select      {row.get('select_ms', float('nan')):10.3f} ms")

    if not full_only:
        for pat in [p for p in args.patterns.split(",") if p]:
            try:
                if pat == "random":
                    bi = random_pattern(B, L, Hi, k, Bk, device, gen=gen)
                else:
                    bi = realistic_pattern(B, L, Hi, k, Bk, device, gen=gen,
                                           per_token=0 if pat == "shared" else PER_TOKEN_SLOTS)
                keys = visible_keys(bi, B, L, Bk)
                fl = attention_flops(keys, Hq, Hi, D)
                row[f"fwd_{pat}_gflop"] = fl / 1e9
                ms = timer.median_ms([given(s, bi) for s in sets])
                row.update({f"fwd_{pat}_ms": ms, f"fwd_{pat}_tflops": tflops(fl, ms)})
                if pat == "shared":  # the same call with the library's default value checks
                    with msa.value_checks(True):
                        row["fwd_shared_checked_ms"] = timer.median_ms([given(s, bi) for s in sets])
                del bi
            except Exception as e:  # noqa: BLE001
                row[f"fwd_{pat}_error"] = error_text(e)
            log(f"  fwd {pat:9s} {row.get(f'fwd_{pat}_ms', float('nan')):10.3f} ms")

    try:
        s0 = sets[0]
        _, _, bi = msa.sparse_attention(s0["q"], s0["k"], s0["v"], s0["qi"], s0["ki"], k, Bk,
                                        cu_seqlens=cu, kl_value=False, return_block_idx=True)
        keys = visible_keys(bi, B, L, Bk)
        del bi
        att_fl = attention_flops(keys, Hq, Hi, D)
        row["msa_attn_gflop"] = att_fl / 1e9
        row["selected_fraction"] = keys / (Hi * causal_pairs(B, L))
        ms = timer.median_ms([full(s) for s in sets])
        row.update(msa_ms=ms, msa_tflops=tflops(sel_fl + att_fl, ms))
        dfl = dense_flops(B, L, Hq, D)
        row["dense_gflop"] = dfl / 1e9
        row["ideal_speedup"] = dfl / (sel_fl + att_fl)
    except Exception as e:  # noqa: BLE001
        row["msa_error"] = error_text(e)
    log(f"  msa forward {row.get('msa_ms', float('nan')):10.3f} ms")

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
    # The whole forward on structured index inputs: k_idx carries a per-block salience along
    # one direction (the same for every query), so the selection is the sink, the 4 local
    # blocks and the most salient earlier blocks, shared by neighbouring tokens, as trained
    # index branches behave; random index inputs give a random selection instead.
    try:
        s0 = sets[0]
        e0 = torch.zeros(Di, device=device, dtype=torch.float32)
        e0[0] = 1.0
        nblk = (L + Bk - 1) // Bk
        sal = torch.randn(B, nblk, device=device, generator=gen) * 30.0
        blk_of = (torch.arange(L, device=device) // Bk)
        ki = (sal[:, blk_of].reshape(T, 1, 1) * e0
              + 0.5 * torch.randn(T, Hik, Di, device=device, generator=gen)).to(dtype)
        qi = (4.0 * e0 + torch.randn(T, Hi, Di, device=device, generator=gen)).to(dtype)

        def structured():
            return msa.sparse_attention(s0["q"], s0["k"], s0["v"], qi, ki, k, Bk, cu_seqlens=cu,
                                        sink_blocks=1, local_blocks=4, kl_value=False)

        _, _, bi = msa.sparse_attention(s0["q"], s0["k"], s0["v"], qi, ki, k, Bk, cu_seqlens=cu,
                                        sink_blocks=1, local_blocks=4, kl_value=False,
                                        return_block_idx=True)
        keys = visible_keys(bi, B, L, Bk)
        del bi
        fl = sel_fl + attention_flops(keys, Hq, Hi, D)
        ms = timer.median_ms([structured])
        row.update(msa_structured_ms=ms, msa_structured_tflops=tflops(fl, ms))
        del qi, ki
    except Exception as e:  # noqa: BLE001
        row["msa_structured_error"] = error_text(e)
    log(f"  msa fwd str {row.get('msa_structured_ms', float('nan')):10.3f} ms")
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
        if row.get("dense_ms") and row.get("msa_ms"):
            row["speedup"] = row["dense_ms"] / row["msa_ms"]
        if row.get("dense_ms") and row.get("msa_structured_ms"):
            row["speedup_structured"] = row["dense_ms"] / row["msa_structured_ms"]


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


def markdown_table(rows: List[Dict], patterns: List[str]) -> str:
    head = ["config", "T", "B", "select ms (TF/s)"]
    head += [f"fwd {p} ms (TF/s)" for p in patterns]
    head += ["fwd shared, value checks on ms", "MSA fwd ms (TF/s)",
             "MSA fwd, structured idx ms (TF/s)", "sel. frac",
             "warmup fwd ms (TF/s)", "dense ms (TF/s)", "dense", "speedup",
             "speedup, structured", "ideal"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        dense = _ms_tf(r, "dense")
        src = r.get("dense_source", "")
        if src.startswith("extrapolated"):
            dense = f"{r['dense_ms']:.1f} (extrapolated)"
        cells = [r["config"], fmt_tokens(r["T"]), str(r["B"]), _ms_tf(r, "select")]
        cells += [_ms_tf(r, f"fwd_{p}") for p in patterns]
        cells += [_f(r.get("fwd_shared_checked_ms"), ".3f"), _ms_tf(r, "msa"), _ms_tf(r, "msa_structured"),
                  _f(r.get("selected_fraction"), ".3f"), _ms_tf(r, "warmup"), dense,
                  f"{r.get('dense_backend', '—')}{'' if src in ('', 'measured') else ' ' + src}",
                  _f(r.get("speedup"), ".1f") + ("x" if r.get("speedup") else ""),
                  _f(r.get("speedup_structured"), ".1f")
                  + ("x" if r.get("speedup_structured") else ""),
                  _f(r.get("ideal_speedup"), ".1f") + ("x" if r.get("ideal_speedup") else "")]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def target_lines(rows: List[Dict]) -> List[str]:
    """The milestone's targets against the worst measured value of the rows they cover."""
    out = ["| target | threshold | measured (worst) | |", "|---|---|---|---|"]
    for name, key, thr, covers in TARGETS:
        vals = [r[key] for r in rows if covers(r) and r.get(key) is not None]
        if not vals:
            out.append(f"| {name} | {thr:g} | not run | |")
            continue
        worst = min(vals)
        out.append(f"| {name} | {thr:g} | {worst:.1f} | {'met' if worst >= thr else 'MISSED'} |")
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
                 + 2 * h["Hi"] * k * 4 + h["Hi"] * k * 8 * 12)  # + patterns and their build
    free, _ = torch.cuda.mem_get_info(device)
    while B > 1 and B * L * per_token * 1.5 > free:
        B //= 2
    return B


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
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
    patterns = [p for p in args.patterns.split(",") if p]
    if args.out:
        write_outputs(args.out, rows, meta)
    print(f"\nMSA forward on {meta.get('gpu', device)} ({args.dtype}, D={args.head_dim}, "
          f"Di={args.index_dim}, Bk={args.block_size}, k={args.top_k}); times in ms, TF/s = "
          "TFLOP/s counted on the selected work (selection: its GEMM; dense: causal half)\n")
    print("\n".join(target_lines(rows)))
    print()
    print("## MSA forward benchmark")
    print()
    print(markdown_table(rows, patterns))
    errors = [f"{r['config']} T={fmt_tokens(r['T'])} {k}: {v}" for r in rows for k, v in r.items()
              if k.endswith("_error")]
    if errors:
        print("\nerrors:\n" + "\n".join(errors), file=sys.stderr)
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
