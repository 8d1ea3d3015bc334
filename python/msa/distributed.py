"""Context parallelism: MSA over a torch.distributed process group (issue 14).

Every rank of ``group`` holds a shard of the tokens of ONE packed batch (``cu_seqlens`` gives the
sequences of the whole batch and is the same on every rank) and passes its shard of ``q, k, v,
q_idx, k_idx`` (rows in ascending global order). :func:`sparse_attention` returns this rank's
rows of ``out`` (and ``lse``, ``block_idx``) and the global KL value, exactly what the
single-process :func:`msa.sparse_attention` computes for the whole batch (contract §2-§4), with
autograd: the gradients of a rank's inputs are its rows of the single-process gradients.

Layouts (:func:`shard_positions`):

* ``"contiguous"``: rank ``r`` holds a contiguous range of the packed tokens, ranks in order
  (the sizes are those the ranks pass; their sum is the batch's token count).
* ``"balanced"`` (zigzag): every sequence of ``L`` tokens is cut into ``2W`` chunks (bounds
  ``c*L // (2W)``) and rank ``r`` holds chunks ``r`` and ``2W-1-r`` of every sequence. The
  attention work per query is bounded (``k`` blocks), so the contiguous layout already balances
  the forward and backward; what grows with the position is the selection (each query scores
  every earlier key) and, with the selection done here, the prefix each rank selects over
  (see below). The balanced layout evens out the number of query positions per prefix length.

How a step runs (``exchange="selected"``):

1. exchange the index keys ``k_idx`` (``Hik*Di`` per token: at the paper's heads 1/8 of ``K+V``):
   a rank reads only the keys of each sequence up to its last query there, so every owner sends
   it just those rows (one all-to-all; a contiguous layout's first rank receives none);
2. select with global positions: the library's selection of this rank's queries at their
   positions over each sequence's gathered index keys (see "Limits and costs");
3. fetch only the K/V rows of the blocks this rank's queries selected: the per-owner lists of
   requested rows are exchanged first (all-to-all of int64 ids), then the rows (all-to-all);
4. run ``msa::forward`` with a caller's ``block_idx`` on a *compact* packed call, its block
   ids remapped to the call's (a monotone map, so the support, the causal mask in the own
   block and the order of the blocks are those of the single-process call). ``call="keys"``
   (where the backend takes keys apart from queries, ``cu_seqlens_k``: the CPU): one call
   sequence per run of this rank's consecutive positions in a sequence, its queries the
   shard's own rows (no copy of ``q``, ``out``, ``dout``, ``dq``) and its keys the blocks
   before the run that its queries selected, one ``Bk``-row slot each, then the sequence's
   rows from the run's first block to its end, so the queries are the last positions of their
   keys. ``call="rows"`` (CUDA for now): per sequence, the union of the selected blocks in
   ascending order, one ``Bk``-row slot each, and this rank's queries at their offsets in
   their own block's slot; rows that hold only fetched keys are queries with an empty
   selection (``block_idx`` all ``-1``): ``out = 0``, no KL term, no gradient.
5. backward (``msa::backward`` on the same call): ``dq`` and ``dq_idx`` are this rank's rows;
   the ``dk, dv, dk_idx`` of fetched rows go back to their owners (all-to-all), and every owner
   sums the contributions in rank order ``0 .. W-1`` (in float32, float64 for float64 inputs),
   so the gradients are bitwise repeatable run to run.

``exchange="allgather"`` is the baseline and fallback: all of ``k_idx``, ``K`` and ``V`` are
all-gathered and every block of the prefix is in the call (the gradients still go back by
all-to-all).

KL: the op normalises by the call's row count; this module rescales every rank's term to the
global count (contract §4: ``1/(N*Hi)`` with ``N`` the batch's tokens) and sums the ranks' terms
in rank order. The KL gradient's weight is handed to ``msa::backward`` as the float32
``kl_grad`` (``gamma * T_call / N``), so the index gradients agree with the single-process call
to float32 rounding of that factor (relative 6e-8), the rest to the rounding of the partial sums.

Bytes moved: ``return_stats=True`` adds a dict of the bytes this rank received per phase
(payload, without padding); the backward adds its phases to the same dict when it runs. The
same dict gives the call's layout (``call``), its key rows (``call_tokens``), query rows
(``call_queries``) and blocks, and the key rows fetched from other ranks (``fetched_tokens``).

Limits and costs (measured against the single-process call):

* The selection of step 2 is exact and scores only this rank's queries: it is the serving
  API's selection at given positions (``paged_select_blocks``, on a GPU the training selection
  kernel reading the keys through a page table), over the gathered index keys laid out in pages
  of ``Bk`` rows (one copy of them). Beyond that call's limits (more than 32 index heads per
  index key head, ``top_k`` > 256) it falls back to ``select_blocks`` over each sequence's
  prefix up to this rank's last query, with zero rows at the other positions.
* With ``call="rows"`` the compact call holds one query row per fetched key row (zero
  queries), so ``q``, ``out``, ``dout`` and ``dq`` of the call are as large as the call, not
  as the shard; ``call="keys"`` holds only the shard's queries (a key row that two runs of a
  zigzag shard read is in the call twice, fetched once, and its gradients summed in run order
  before they go back).
* Everything is host-orchestrated (block lists and split sizes are read on the host): not
  capturable in a CUDA graph. Every rank must call the function with the same options and run
  the backward (as in any context-parallel model); a rank whose shard or options do not match
  the others makes every rank raise the same ``ValueError`` before any data moves.

NVLink multicast stays off: importing this module sets ``NCCL_NVLS_ENABLE=0`` and
``TORCH_SYMM_MEM_DISABLE_MULTICAST=1`` in the environment (overriding other values, with a
warning). NCCL reads them when a communicator is created, so import ``msa.distributed`` before
``torch.distributed.init_process_group``.
"""

import hashlib
import math
import os
from collections import OrderedDict
import struct
import time
import warnings
from typing import Dict, List, Optional, Sequence

_MULTICAST_OFF = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1"}


def multicast_off() -> None:
    """Sets NCCL_NVLS_ENABLE=0 and TORCH_SYMM_MEM_DISABLE_MULTICAST=1 (NVLink multicast off)."""
    for key, value in _MULTICAST_OFF.items():
        old = os.environ.get(key)
        if old is not None and old != value:
            warnings.warn(f"msa.distributed: {key}={old} overridden with {value} (NVLink "
                          f"multicast stays off)")
        os.environ[key] = value


multicast_off()

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch import Tensor  # noqa: E402

from . import _ops  # noqa: E402,F401  (registers torch.ops.msa.*)
from . import _cu_seqlens, _int, _kl_pass, _scale, _MAX_TOP_K  # noqa: E402

__all__ = ["sparse_attention", "warmup_attention", "shard_positions", "shard", "contiguous_sizes",
           "exchange_bytes", "moved_bytes", "multicast_off"]

_LAYOUTS = ("contiguous", "balanced")
_EXCHANGES = ("selected", "allgather")
_CALLS = ("keys", "rows")
# Devices where call="auto" takes the call over keys apart from queries (cu_seqlens_k), "rows"
# elsewhere. (The CUDA backend runs that call too, reached with call="keys"; CUDA joins this list
# once the key call is measured on two GPUs.)
_KEYS_APART_DEVICES = ("cpu",)


# --------------------------------------------------------------------------------------------
# layouts
# --------------------------------------------------------------------------------------------


def _cu_list(cu_seqlens, total: int) -> List[int]:
    if cu_seqlens is None:
        return [0, total]
    return [int(x) for x in torch.as_tensor(cu_seqlens).cpu().tolist()]


def shard_positions(layout: str, rank: int, world: int, total: int, cu_seqlens=None,
                    sizes: Optional[Sequence[int]] = None) -> Tensor:
    """Global packed indices (int64, ascending) of the tokens rank ``rank`` of ``world`` holds.

    ``layout="contiguous"``: rank ``r`` holds ``[sum(sizes[:r]), sum(sizes[:r+1]))``; without
    ``sizes``, ``[r*total // world, (r+1)*total // world)``. ``layout="balanced"``: every
    sequence of ``cu_seqlens`` (None: one of ``total`` tokens) is cut into ``2*world`` chunks with
    bounds ``c*L // (2*world)``, and rank ``r`` holds chunks ``r`` and ``2*world-1-r`` of each."""
    if layout not in _LAYOUTS:
        raise ValueError(f"msa.distributed: argument 'layout': expected 'contiguous' or "
                         f"'balanced', got {layout!r}")
    if layout == "contiguous":
        if sizes is None:
            lo, hi = rank * total // world, (rank + 1) * total // world
        else:
            lo = int(sum(sizes[:rank]))
            hi = lo + int(sizes[rank])
        return torch.arange(lo, hi, dtype=torch.int64)
    cu = _cu_list(cu_seqlens, total)
    parts = []
    n = 2 * world
    for s in range(len(cu) - 1):
        a, L = cu[s], cu[s + 1] - cu[s]
        for c in (rank, n - 1 - rank):
            parts.append(torch.arange(a + c * L // n, a + (c + 1) * L // n, dtype=torch.int64))
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.int64)


def shard(x: Tensor, layout: str, rank: int, world: int, cu_seqlens=None,
          sizes: Optional[Sequence[int]] = None) -> Tensor:
    """The rows of the packed tensor ``x`` ([T, ...]) that rank ``rank`` holds in ``layout``
    (contiguous: ``sizes``, by default the even split)."""
    pos = shard_positions(layout, rank, world, x.shape[0], cu_seqlens, sizes=sizes)
    return x[pos.to(x.device)]


# One query's selection cost per earlier key, relative to the rest of its training step (forward
# and backward with the KL gradient over its k blocks). Measured on an H200 at the paper's heads
# (Hq 64 / Hkv 4 / Hi 4, D = Di = 128, Bk 128, k 16; bench_cp.py --phases): 54.4 ms of the
# one-GPU step's 461.6 selecting at 256K tokens, so 54.4 / (256K^2 / 2) per pair against
# 407.2 / 256K per query.
SELECT_WEIGHT_H200_PAPER = 1.02e-6


def contiguous_sizes(world: int, total: Optional[int] = None, cu_seqlens=None,
                     select_weight: float = SELECT_WEIGHT_H200_PAPER,
                     block_size: int = 128) -> List[int]:
    """Contiguous shard sizes that balance a training step's work over ``world`` ranks.

    A query's attention work is bounded (``k`` blocks), but its selection scores every earlier
    key of its sequence, so the rank holding a sequence's end has more to do. The model: a
    token at position ``t`` of its sequence costs ``1 + select_weight * (t + 1)`` (the second
    term its selection, relative to the rest of its step; see ``SELECT_WEIGHT_H200_PAPER``, or
    measure it: the one-GPU selection's time per (query, earlier key) pair over the rest of the
    step's time per query). Rank ``r`` gets the packed tokens up to the ``(r+1)/world`` share
    of the batch's cost, each cut moved to the nearest ``block_size`` boundary of the sequence
    it falls in (a block is then never split between two ranks). ``cu_seqlens`` gives the
    sequences (None: one sequence of ``total`` tokens). ``select_weight = 0`` gives the even
    split, rounded to blocks. With the sizes returned, pass ``layout="contiguous"``.

    Against the zigzag layout ("balanced"), which balances the selection by giving every rank
    early and late chunks, these shards keep each rank's keys in one piece: the first rank
    fetches nothing and the others fetch only earlier ranks' blocks (fewer bytes; see
    :func:`exchange_bytes`)."""
    _int("world", world, 1)
    if not (select_weight >= 0.0 and math.isfinite(select_weight)):
        raise ValueError(f"msa.distributed: argument 'select_weight': expected a finite value "
                         f">= 0, got {select_weight}")
    _int("block_size", block_size, 1)
    if cu_seqlens is None:
        if total is None:
            raise ValueError("msa.distributed: argument 'total': give total or cu_seqlens")
        _int("total", total, 0)
        cu = [0, int(total)]
    else:
        cu = _cu_list(cu_seqlens, 0)
        if total is not None and int(total) != cu[-1]:
            raise ValueError(f"msa.distributed: argument 'total': {total} differs from "
                             f"cu_seqlens' last offset {cu[-1]}")
        if cu[0] != 0 or any(b < a for a, b in zip(cu[:-1], cu[1:])):
            raise ValueError("msa.distributed: argument 'cu_seqlens': expected non-decreasing "
                             "offsets from 0")
    N = cu[-1]
    cut = [0]
    if N:
        ends = torch.tensor(cu[1:], dtype=torch.int64)
        lens = torch.tensor(cu, dtype=torch.int64).diff()
        seq_start = torch.repeat_interleave(torch.tensor(cu[:-1], dtype=torch.int64), lens)
        t = torch.arange(N, dtype=torch.int64) - seq_start
        cost = torch.cumsum(1.0 + select_weight * (t + 1).double(), 0)
        for r in range(1, world):
            x = int(torch.searchsorted(cost, cost[-1] * r / world))  # first token past the share
            s = int(torch.searchsorted(ends, x, right=True))  # its sequence
            s = min(s, len(cu) - 2)
            a, b = cu[s], cu[s + 1]
            x = min(a + int(round((x - a) / block_size)) * block_size, b)
            cut.append(max(x, cut[-1]))
    cut += [N] * (world + 1 - len(cut))
    return [cut[r + 1] - cut[r] for r in range(world)]


# --------------------------------------------------------------------------------------------
# communication helpers (every helper is called by all ranks in the same order)
# --------------------------------------------------------------------------------------------


class _Comm:
    def __init__(self, group, device: torch.device):
        self.group = group
        self.W = dist.get_world_size(group)
        self.r = dist.get_rank(group)
        backend = str(dist.get_backend(group)).lower()
        # NCCL moves device tensors; other backends (gloo) host tensors.
        self.dev = device if "nccl" in backend else torch.device("cpu")

    def all_gather_int(self, vals: List[int]) -> List[List[int]]:
        t = torch.tensor(vals, dtype=torch.int64, device=self.dev)
        out = [torch.empty_like(t) for _ in range(self.W)]
        dist.all_gather(out, t, group=self.group)
        return [o.cpu().tolist() for o in out]

    def all_gather_rows(self, x: Tensor, sizes: List[int]) -> List[Tensor]:
        """Every rank's ``x`` ([sizes[rank], F]); padded to the largest size on the wire."""
        m = max(sizes) if sizes else 0
        buf = torch.zeros((m,) + tuple(x.shape[1:]), dtype=x.dtype, device=self.dev)
        buf[: x.shape[0]] = x.to(self.dev)
        out = [torch.empty_like(buf) for _ in range(self.W)]
        dist.all_gather(out, buf, group=self.group)
        return [o[: sizes[i]].to(x.device) for i, o in enumerate(out)]

    def all_to_all(self, send: Tensor, send_counts: List[int], recv_counts: List[int]) -> Tensor:
        """Rows ``send`` split by destination (``send_counts``); returns the rows received,
        ordered by source rank (``recv_counts``)."""
        recv = torch.empty((sum(recv_counts),) + tuple(send.shape[1:]), dtype=send.dtype,
                           device=self.dev)
        dist.all_to_all_single(recv, send.to(self.dev).contiguous(), recv_counts, send_counts,
                               group=self.group)
        return recv.to(send.device)


class _Phases:
    """Wall time per phase of a call, for profiling (``phase_times=True``): ``mark(name)``
    synchronises the device and adds the milliseconds since the previous mark to
    ``stats["ms_" + name]``. Off, it does nothing (no synchronisation)."""

    def __init__(self, on: bool, stats: Dict, device: torch.device):
        self.on, self.stats, self.device = on, stats, device
        if on:
            self._sync()
            self.t = time.perf_counter()

    def _sync(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def mark(self, name: str) -> None:
        if not self.on:
            return
        self._sync()
        now = time.perf_counter()
        key = "ms_" + name
        self.stats[key] = self.stats.get(key, 0.0) + 1e3 * (now - self.t)
        self.t = now


def _nbytes(t: Tensor) -> int:
    return t.numel() * t.element_size()


def _hash(values: List[int]) -> int:
    h = hashlib.sha256(struct.pack(f"<{len(values)}q", *values)).digest()
    return int.from_bytes(h[:7], "little")


def _float_bits(x: float) -> int:
    return struct.unpack("<q", struct.pack("<d", float(x)))[0]


_DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.float64]


# --------------------------------------------------------------------------------------------
# the plan: who holds what, the call's layout, the routing of rows
# --------------------------------------------------------------------------------------------


class _Plan:
    """Host-side description of one distributed call (built in the forward)."""


def _check_local(q, k, v, q_idx, k_idx, block_idx, has_idx) -> Optional[str]:
    """The shape/dtype problems of this rank's tensors (None when they are fine)."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, Tensor) or t.dim() != 3:
            return f"argument '{name}': expected a rank-3 tensor"
    n = q.shape[0]
    if k.shape != v.shape or k.shape[0] != n or k.shape[2] != q.shape[2]:
        return (f"argument 'k'/'v': expected [{n}, Hkv, {q.shape[2]}], got {tuple(k.shape)} "
                f"and {tuple(v.shape)}")
    if k.dtype != q.dtype or v.dtype != q.dtype:
        return "argument 'k'/'v': expected the dtype of q"
    if q.dtype not in _DTYPES:
        return f"argument 'q': unsupported dtype {q.dtype}"
    if has_idx:
        for name, t in (("q_idx", q_idx), ("k_idx", k_idx)):
            if not isinstance(t, Tensor) or t.dim() != 3 or t.shape[0] != n:
                return f"argument '{name}': expected a rank-3 tensor of {n} rows (those of q)"
            if t.dtype != q.dtype:
                return f"argument '{name}': expected the dtype of q"
        if q_idx.shape[2] != k_idx.shape[2]:
            return "argument 'k_idx': expected the head dim of q_idx"
    if block_idx is not None:
        if not isinstance(block_idx, Tensor) or block_idx.dim() != 3 or block_idx.shape[0] != n:
            return f"argument 'block_idx': expected [{n}, Hi, k] int32"
    return None


def _plan(comm: _Comm, q, k, v, q_idx, k_idx, block_idx, cu_seqlens, opts) -> _Plan:
    W, r = comm.W, comm.r
    has_idx = q_idx is not None
    err = _check_local(q, k, v, q_idx, k_idx, block_idx, has_idx)
    n = q.shape[0] if err is None else 0
    cu_vals = [] if cu_seqlens is None else [int(x) for x in cu_seqlens.cpu().tolist()]
    shp = lambda t, i: int(t.shape[i]) if (err is None and t is not None) else -1  # noqa: E731
    hi = shp(q_idx, 1) if has_idx else (shp(block_idx, 1) if block_idx is not None else -1)
    meta = dict(
        n=n, error=0 if err is None else 1,
        Hq=shp(q, 1), Hkv=shp(k, 1), D=shp(q, 2), Hi=hi,
        Hik=shp(k_idx, 1) if has_idx else -1, Di=shp(q_idx, 2) if has_idx else -1,
        dtype=_DTYPES.index(q.dtype) if err is None else -1,
        top_k=opts["top_k"] if block_idx is None else shp(block_idx, 2),
        block_size=opts["block_size"], sink_blocks=opts["sink_blocks"],
        local_blocks=opts["local_blocks"], layout=_LAYOUTS.index(opts["layout"]),
        exchange=_EXCHANGES.index(opts["exchange"]), call=_CALLS.index(opts["call"]),
        has_idx=int(has_idx),
        caller_block_idx=int(block_idx is not None), kl_value=int(opts["kl_value"]),
        dense=int(opts["dense"]),
        cu_seqlens=_hash(cu_vals), scale=_float_bits(opts["scale"]),
        scale_idx=_float_bits(opts["scale_idx"]), kl_pass=opts["kl_pass_code"],
        fwd_pass=opts["fwd_pass_code"],
        device_type=1 if isinstance(q, Tensor) and q.device.type == "cuda" else 0)
    names = list(meta)
    gathered = comm.all_gather_int([meta[x] for x in names])
    # From here on every rank sees the same data, so every rank raises the same error.
    for o in range(W):
        if gathered[o][1]:
            if o == r:
                raise ValueError(f"msa.distributed: rank {r}: {err}")
            raise ValueError(f"msa.distributed: rank {o} passed bad input (its error names the "
                             f"argument)")
    for i, name in enumerate(names[2:], start=2):
        vals = [g[i] for g in gathered]
        if any(x != vals[0] for x in vals):
            raise ValueError(f"msa.distributed: argument '{name}' differs across ranks "
                             f"(rank 0: {vals[0]}, others: {vals}); every rank must pass the same "
                             f"shapes, options and cu_seqlens")
    sizes = [g[0] for g in gathered]
    total = sum(sizes)
    if cu_seqlens is not None and cu_vals[-1] != total:
        raise ValueError(f"msa.distributed: argument 'cu_seqlens': ends at {cu_vals[-1]}, but the "
                         f"ranks hold {total} tokens in all (shards {sizes})")
    layout = opts["layout"]
    cu = cu_vals if cu_seqlens is not None else [0, total]
    positions = [shard_positions(layout, o, W, total, cu, sizes if layout == "contiguous"
                                 else None) for o in range(W)]
    for o in range(W):
        if positions[o].numel() != sizes[o]:
            raise ValueError(
                f"msa.distributed: rank {o} holds {sizes[o]} tokens, but the '{layout}' layout of "
                f"{total} tokens over {W} ranks gives it {positions[o].numel()} (shard sizes "
                f"{sizes}; cu_seqlens {cu})")

    p = _Plan()
    p.W, p.r, p.N, p.sizes, p.positions, p.has_idx = W, r, total, sizes, positions, has_idx
    p.Hq, p.Hkv, p.D = q.shape[1], k.shape[1], q.shape[2]
    p.Hi = meta["Hi"]
    p.Hik, p.Di = (k_idx.shape[1], k_idx.shape[2]) if has_idx else (0, 0)
    p.Bk = opts["block_size"]
    p.cu = torch.tensor(cu, dtype=torch.int64)
    p.layout = layout
    p.geo = _geometry(p, q.device)
    return p


class _Geometry:
    """What a call's token placement alone determines (shards, sequences, block size, device),
    computed once and reused by the calls with the same placement (every layer of a model):
    the owner of every row, this rank's rows' sequences and blocks, and the page layout and
    runs of its selection. Arrays as large as the batch or the shard live on the device."""


_GEOMETRY_CACHE: "OrderedDict[tuple, _Geometry]" = OrderedDict()
_GEOMETRY_CACHE_SIZE = 8


def _geometry(p: _Plan, dev: torch.device) -> _Geometry:
    key = (p.layout, p.W, p.r, tuple(p.sizes), tuple(p.cu.tolist()), p.Bk, str(dev))
    g = _GEOMETRY_CACHE.get(key)
    if g is not None:
        _GEOMETRY_CACHE.move_to_end(key)
        return g
    g = _Geometry()
    W, r, Bk, cu, total = p.W, p.r, p.Bk, p.cu, p.N
    owner = torch.empty(total, dtype=torch.int64)
    lidx = torch.empty(total, dtype=torch.int64)
    for o in range(W):
        owner[p.positions[o]] = o
        lidx[p.positions[o]] = torch.arange(p.sizes[o], dtype=torch.int64)
    g.owner, g.lidx = owner.to(dev), lidx.to(dev)
    g.positions = [x.to(dev) for x in p.positions]
    # every rank's rows: sequence, position in it, last position per sequence
    nseq = cu.numel() - 1
    seq, tin, tmaxs = [], [], []
    for o in range(W):
        s_o = torch.searchsorted(cu, p.positions[o], right=True) - 1
        t_o = p.positions[o] - cu[s_o]
        tm = torch.full((max(nseq, 1),), -1, dtype=torch.int64)
        if t_o.numel():
            tm = tm.scatter_reduce(0, s_o, t_o, reduce="amax")
        seq.append(s_o)
        tin.append(t_o)
        tmaxs.append(tm)
    # the prefix exchange of the index keys (exchange="selected"): a rank reads index keys only
    # at t <= its tmax of their sequence, so owner o sends rank d its rows there, nothing more
    # (send lists: this rank's shard rows per peer; receive: global rows, by source rank)
    send = [torch.nonzero(tin[r] <= tmaxs[d][seq[r]]).flatten() if d != r
            else torch.zeros(0, dtype=torch.int64) for d in range(W)]
    recv = [p.positions[o][tin[o] <= tmaxs[r][seq[o]]] if o != r
            else torch.zeros(0, dtype=torch.int64) for o in range(W)]
    g.kidx_send_counts = [int(x.numel()) for x in send]
    g.kidx_recv_counts = [int(x.numel()) for x in recv]
    g.kidx_send = torch.cat(send).to(dev)
    g.kidx_recv_rows = torch.cat(recv).to(dev)
    # this rank's rows: sequence, position in it, last position per sequence, blocks
    pos = p.positions[r]
    lens = cu[1:] - cu[:-1]
    nblk = (lens + Bk - 1) // Bk
    g.blkbase = torch.cumsum(nblk, 0) - nblk  # global block id of each sequence's block 0
    g.nblocks = int(nblk.sum())
    g.s_loc, g.t_loc, g.tmax = seq[r], tin[r], tmaxs[r]
    g.base = g.blkbase[g.s_loc].to(dev)  # global block id of each row's sequence's block 0
    g.own_gb = g.base + (g.t_loc // Bk).to(dev)
    g.t_in_blk = (g.t_loc % Bk).to(dev)
    # the selection's page layout: every sequence's index keys from a page boundary, and the
    # runs of consecutive positions of one sequence in this rank's row order
    npages = (lens + Bk - 1) // Bk
    pstart = torch.cumsum(npages, 0) - npages
    g.npages = max(int(npages.sum()), 1)
    off = (pstart * Bk - cu[:-1]).to(dev)
    s_tok = torch.repeat_interleave(torch.arange(nseq, device=dev), lens.to(dev),
                                    output_size=total)
    g.page_row = off[s_tok] + torch.arange(total, device=dev)  # row of every token in the pages
    if pos.numel():
        first = torch.ones(pos.numel(), dtype=torch.bool)
        first[1:] = (g.s_loc[1:] != g.s_loc[:-1]) | (g.t_loc[1:] != g.t_loc[:-1] + 1)
        run_seq = g.s_loc[first]
        run_len = torch.bincount(torch.cumsum(first.long(), 0) - 1)
        run_end = g.t_loc[first] + run_len  # keys of the run's call sequence
        max_pages = max(int(npages.max()), 1)
        col = torch.arange(max_pages)[None, :]
        page_table = torch.where(col < npages[run_seq][:, None],
                                 pstart[run_seq][:, None] + col, torch.zeros_like(col))
        cu_q = torch.cat([torch.zeros(1, dtype=torch.int64), torch.cumsum(run_len, 0)])
        i32 = lambda t: t.to(torch.int32).to(dev)  # noqa: E731
        g.sel_cu_q, g.sel_page_table, g.sel_seq_lens = i32(cu_q), i32(page_table), i32(run_end)
        # the runs (host) and each row's run (device), for the call over keys apart
        g.run_seq, g.run_t0, g.run_len, g.run_end = run_seq, g.t_loc[first], run_len, run_end
        g.run_of_row = (torch.cumsum(first.long(), 0) - 1).to(dev)
    else:
        g.run_seq = g.run_t0 = g.run_len = g.run_end = torch.zeros(0, dtype=torch.int64)
        g.run_of_row = torch.zeros(0, dtype=torch.int64, device=dev)
        g.sel_cu_q = torch.zeros(1, dtype=torch.int32, device=dev)
    _GEOMETRY_CACHE[key] = g
    while len(_GEOMETRY_CACHE) > _GEOMETRY_CACHE_SIZE:
        _GEOMETRY_CACHE.popitem(last=False)
    return g


def _layout_call(p: _Plan, bi_local: Optional[Tensor], allgather: bool, dev: torch.device):
    """The compact call: which global rows it holds (ascending, on ``dev``), where this rank's
    queries sit (``qrow``), and this rank's block ids remapped to the call's blocks. Arrays of
    the call's or the selection's size stay on ``dev``; the host sees per-block arrays only
    (the used blocks come from a bitmap over the batch's blocks: one small copy to the host)."""
    Bk, cu, g = p.Bk, p.cu, p.geo
    blkbase, nblocks, tmax, own_gb = g.blkbase, g.nblocks, g.tmax, g.own_gb
    if allgather:
        present = torch.nonzero(tmax >= 0).flatten()
        nb_need = torch.where(tmax >= 0, tmax // Bk + 1, torch.zeros_like(tmax))[present]
        seq_of = torch.repeat_interleave(present, nb_need)
        first = torch.cumsum(nb_need, 0) - nb_need
        b_in = torch.arange(int(nb_need.sum())) - torch.repeat_interleave(first, nb_need)
        ublocks = blkbase[seq_of] + b_in
    else:
        # the union of the selected blocks (own blocks included): a bitmap over the blocks
        b = bi_local.long()
        gb = torch.where(b >= 0, g.base[:, None, None] + b, own_gb[:, None, None])
        used = torch.zeros(max(nblocks, 1), dtype=torch.bool, device=dev)
        used[gb.flatten()] = True
        used[own_gb] = True
        ublocks = torch.nonzero(used).flatten().cpu()  # sorted
        del gb
    useq = torch.searchsorted(blkbase, ublocks, right=True) - 1
    # sequences with no block (empty) share blkbase with the next one: searchsorted(right)
    # picks the last of them, which is the one whose blocks start there.
    ub = ublocks - blkbase[useq]
    nrows = torch.clamp(tmax[useq] + 1 - ub * Bk, max=Bk)
    call_start = torch.cumsum(nrows, 0) - nrows  # call row of each used block's first key
    T_call = int(nrows.sum())
    # call-block index inside its call sequence, and the call sequences' offsets
    new_seq = torch.ones_like(useq, dtype=torch.bool)
    if useq.numel() > 1:
        new_seq[1:] = useq[1:] != useq[:-1]
    seq_first = torch.nonzero(new_seq).flatten()
    grp = torch.cumsum(new_seq.long(), 0) - 1
    cblk = torch.arange(ublocks.numel()) - seq_first[grp]
    cu_call = torch.cat([call_start[seq_first], torch.tensor([T_call])]).to(torch.int32)
    # global rows of the call (on the device: as many as the call's rows)
    nub = int(ublocks.numel())
    rep = torch.repeat_interleave(torch.arange(nub, device=dev), nrows.to(dev),
                                  output_size=T_call)
    row0 = (cu[useq] + ub * Bk - call_start).to(dev)  # global row of call row 0's offset
    rows = row0[rep] + torch.arange(T_call, device=dev)
    # maps global block -> call block / call row of its first key
    cblk_of = torch.full((max(nblocks, 1),), -1, dtype=torch.int64)
    cblk_of[ublocks] = cblk
    crow_of = torch.full((max(nblocks, 1),), -1, dtype=torch.int64)
    crow_of[ublocks] = call_start
    qrow = crow_of.to(dev)[own_gb] + g.t_in_blk
    bi_call = None
    if bi_local is not None:
        b = bi_local.long()
        gbl = g.base[:, None, None] + b.clamp(min=0)
        bi_call = torch.where(b >= 0, cblk_of.to(dev)[gbl], torch.full_like(b, -1))
        bi_call = bi_call.to(torch.int32)
    return dict(rows=rows, qrow=qrow, cu_call=cu_call, bi_call=bi_call, T_call=T_call,
                blocks=nub)


def _layout_keys_call(p: _Plan, bi_local: Optional[Tensor], allgather: bool, dev: torch.device):
    """The call over keys apart (``call="keys"``): one call sequence per run of this rank's
    consecutive positions in a sequence (its queries, in the shard's row order, so ``q`` and
    the query-side tensors are the shard's own), whose keys are the blocks before the run's first
    block that its queries selected (every such block with ``allgather``), one ``Bk``-row slot
    each in ascending order, then the sequence's rows from that block's start to the run's end:
    the run's queries are the last positions of its keys (cu_seqlens_k). Returns the global rows
    of the call's keys (on ``dev``; a row that two runs read appears in both), the key offsets,
    and this rank's block ids remapped to the call's."""
    Bk, cu, g = p.Bk, p.cu, p.geo
    R = int(g.run_len.numel())
    fb = g.run_t0 // Bk  # first own block of each run: the blocks below it are gathered
    pbase = torch.cumsum(fb, 0) - fb  # each run's offset in the (run, block < fb) bitmap
    nbits = int(fb.sum())
    if bi_local is not None:  # each row's blocks, its run's first block and bitmap offset
        b = bi_local.long()
        fb_row = fb.to(dev)[g.run_of_row][:, None, None]
        bit = pbase.to(dev)[g.run_of_row][:, None, None] + b  # valid where 0 <= b < fb_row
    if allgather:
        used = torch.ones(nbits, dtype=torch.bool)
    else:
        used_d = torch.zeros(max(nbits, 1), dtype=torch.bool, device=dev)
        used_d[bit[(b >= 0) & (b < fb_row)]] = True
        used = used_d[:nbits].cpu()
    idx = torch.nonzero(used).flatten()  # by run, then block
    run_of = torch.searchsorted(pbase, idx, right=True) - 1
    # runs with fb = 0 share pbase with the next run; searchsorted(right) picks the last of them,
    # the one whose bits start there
    blk = idx - pbase[run_of]
    nsel = torch.bincount(run_of, minlength=R) if R else torch.zeros(0, dtype=torch.int64)
    sel_first = torch.cumsum(nsel, 0) - nsel
    cmap = torch.full((max(nbits, 1),), -1, dtype=torch.int64)
    cmap[idx] = torch.arange(idx.numel()) - sel_first[run_of]
    own_len = g.run_end - fb * Bk
    m = nsel * Bk + own_len  # keys per call sequence
    cu_k = torch.cat([torch.zeros(1, dtype=torch.int64), torch.cumsum(m, 0)])
    Tk = int(cu_k[-1])
    # segments of the call's keys in call order: a run's selected blocks, then its own rows
    seq0 = cu[g.run_seq]  # global row of each run's sequence's position 0
    starts = torch.cat([seq0[run_of] + blk * Bk, seq0 + fb * Bk])
    lens = torch.cat([torch.full_like(blk, Bk), own_len])
    order = torch.argsort(torch.cat([run_of * 2, torch.arange(R) * 2 + 1]), stable=True)
    starts, lens = starts[order].to(dev), lens[order].to(dev)
    seg = torch.repeat_interleave(torch.arange(lens.numel(), device=dev), lens, output_size=Tk)
    first = torch.cumsum(lens, 0) - lens
    rows = starts[seg] + torch.arange(Tk, device=dev) - first[seg]
    bi_call = None
    if bi_local is not None:
        below = cmap.to(dev)[bit.clamp(min=0, max=max(nbits, 1) - 1)]
        own = nsel.to(dev)[g.run_of_row][:, None, None] + b - fb_row
        bi_call = torch.where(b < 0, torch.full_like(b, -1), torch.where(b < fb_row, below, own))
        bi_call = bi_call.to(torch.int32)
    return dict(rows=rows, cu_k=cu_k.to(torch.int32).to(dev), bi_call=bi_call, Tk=Tk,
                blocks=int(idx.numel()) + int(((g.run_end + Bk - 1) // Bk - fb).sum()))


# The paged selection's limits (serving kernels): index heads per index key head, and top_k.
_PAGED_MAX_GK, _PAGED_MAX_K = 32, 256


def _select(p: _Plan, q_idx: Tensor, k_idx_full: Tensor, opts) -> Tensor:
    """This rank's selection (global block ids of each sequence), scoring only this rank's
    queries: the library's selection at given positions (``paged_select_blocks``, what a
    serving prefill runs). The gathered index keys are laid out in pages of ``Bk`` rows, each
    sequence's keys from a page boundary; every run of consecutive positions of one sequence
    is one sequence of that call, its new tokens the run and its keys the sequence's prefix up
    to the run's end (the page table names the sequence's pages). Outside the paged kernels'
    limits, the prefix call of ``_select_prefix``."""
    Hi, k = q_idx.shape[1], opts["top_k"]
    if p.positions[p.r].numel() == 0:
        return torch.empty((0, Hi, k), dtype=torch.int32, device=q_idx.device)
    if Hi // max(p.Hik, 1) > _PAGED_MAX_GK or k > _PAGED_MAX_K:
        return _select_prefix(p, q_idx, k_idx_full, opts)
    dev, Bk, g = q_idx.device, p.Bk, p.geo
    # every sequence's index keys in pages of Bk rows (the page layout of the geometry)
    pages = torch.zeros((g.npages, Bk) + tuple(k_idx_full.shape[1:]), dtype=k_idx_full.dtype,
                        device=dev)
    pages.view(-1, *k_idx_full.shape[1:])[g.page_row] = k_idx_full
    return torch.ops.msa.paged_select_blocks(
        q_idx, g.sel_cu_q, pages, g.sel_page_table, g.sel_seq_lens, 0, k, Bk,
        opts["sink_blocks"], opts["local_blocks"], opts["scale_idx"])


def _select_prefix(p: _Plan, q_idx: Tensor, k_idx_full: Tensor, opts) -> Tensor:
    """This rank's selection (global block ids of each sequence), from the library's
    select_blocks over the prefix of every sequence up to this rank's last query; the other
    rows of the prefix are zero queries whose selections are dropped."""
    dev, cu, g = q_idx.device, p.cu, p.geo
    s_loc, t_loc = g.s_loc, g.t_loc
    ln = g.tmax + 1
    start = torch.cumsum(ln, 0) - ln
    T_sel = int(ln.sum())
    rep = torch.repeat_interleave(torch.arange(ln.numel()), ln)
    rows = cu[rep] + torch.arange(T_sel) - start[rep]
    selrow = (start[s_loc] + t_loc).to(dev)
    qi = torch.zeros((T_sel,) + tuple(q_idx.shape[1:]), dtype=q_idx.dtype, device=dev)
    qi[selrow] = q_idx
    present = ln > 0
    cu_sel = torch.cat([torch.zeros(1, dtype=torch.int64), torch.cumsum(ln[present], 0)])
    bi = torch.ops.msa.select_blocks(
        qi, k_idx_full[rows.to(dev)], cu_sel.to(torch.int32).to(dev), opts["top_k"],
        p.Bk, opts["sink_blocks"], opts["local_blocks"], opts["scale_idx"])
    return bi[selrow]


# --------------------------------------------------------------------------------------------
# the autograd function
# --------------------------------------------------------------------------------------------


class _CPAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, comm, p, opts, stats, block_idx, q, k, v, q_idx, k_idx):
        dev, dtype = q.device, q.dtype
        W, r = p.W, p.r
        allgather = opts["exchange"] == "allgather"
        has_idx = p.has_idx
        ph = _Phases(opts["phase_times"], stats, dev)

        # 1. index keys: those of the prefix this rank reads (selected), or all (allgather).
        # stats["k_idx_allgather"] counts the index key bytes received in either mode.
        k_idx_full = None
        if has_idx and allgather:
            parts = comm.all_gather_rows(k_idx.detach(), p.sizes)
            k_idx_full = torch.empty((p.N, p.Hik, p.Di), dtype=dtype, device=dev)
            for o in range(W):
                k_idx_full[p.geo.positions[o]] = parts[o]
                if o != r:
                    stats["k_idx_allgather"] += _nbytes(parts[o])
            del parts
        elif has_idx:
            g = p.geo
            Fi = p.Hik * p.Di
            send = k_idx.detach().reshape(-1, Fi).index_select(0, g.kidx_send)
            recv = comm.all_to_all(send, g.kidx_send_counts, g.kidx_recv_counts)
            stats["k_idx_allgather"] += _nbytes(recv)
            # rows nobody sent are never read (beyond every run's end); zero keeps them defined
            k_idx_full = torch.zeros((p.N, p.Hik, p.Di), dtype=dtype, device=dev)
            k_idx_full[g.positions[r]] = k_idx.detach()
            k_idx_full[g.kidx_recv_rows] = recv.reshape(-1, p.Hik, p.Di)
            del send, recv
        ph.mark("k_idx_gather")

        # 2. selection with global positions (none in the dense warmup)
        if opts["dense"]:
            bi_local = None
        elif block_idx is None:
            bi_local = _select(p, q_idx.detach(), k_idx_full, opts)
        else:
            bi_local = block_idx.to(device=dev, dtype=torch.int32)
        ph.mark("select")

        if opts["call"] == "keys":
            return _keys_forward(ctx, comm, p, opts, stats, ph, q, k, v, q_idx, k_idx,
                                 k_idx_full, bi_local, allgather)

        # 3. the compact call and the rows it needs from every owner
        kk = bi_local.shape[2]
        lay = _layout_call(p, bi_local, allgather, dev)
        rows, T_call = lay["rows"], lay["T_call"]
        ph.mark("layout")
        F = p.Hkv * p.D
        kv_call, (req_rows, req_ids, served, send_counts) = _fetch_kv(comm, p, k, v, rows,
                                                                      allgather, stats)
        ph.mark("kv_exchange")
        k_call = kv_call[:, :F].reshape(T_call, p.Hkv, p.D)
        v_call = kv_call[:, F:].reshape(T_call, p.Hkv, p.D)

        qrow = lay["qrow"].to(dev)
        q_call = torch.zeros((T_call, p.Hq, p.D), dtype=dtype, device=dev)
        q_call.index_copy_(0, qrow, q.detach())
        bi_call = torch.full((T_call, p.Hi, kk), -1, dtype=torch.int32, device=dev)
        bi_call[qrow] = lay["bi_call"].to(dev)
        cu_call = lay["cu_call"].to(dev)
        q_idx_call = k_idx_call = None
        if has_idx:
            q_idx_call = torch.zeros((T_call, p.Hi, p.Di), dtype=dtype, device=dev)
            q_idx_call.index_copy_(0, qrow, q_idx.detach())
            k_idx_call = k_idx_full[rows.to(dev)]
        del k_idx_full
        stats["call_tokens"] += T_call
        stats["call_queries"] += T_call
        stats["fetched_tokens"] += T_call - int(req_rows[r].numel())
        stats["call_blocks"] += lay["blocks"]
        ph.mark("call_build")

        # 4. the forward over the call
        want_kl = bool(opts["kl_value"]) and has_idx
        if T_call:
            out_c, lse_c, _, kl_c = torch.ops.msa.forward(
                q_call, k_call, v_call, q_idx_call, k_idx_call, bi_call, cu_call, False, False,
                p.Bk, kk, opts["sink_blocks"], opts["local_blocks"], opts["scale"],
                opts["scale_idx"], want_kl, opts["deterministic"], opts["kl_pass"],
                opts["fwd_pass"])
        else:
            out_c = q_call.new_zeros(q_call.shape)
            lse_c = torch.zeros((0, p.Hq), dtype=torch.float32, device=dev)
            kl_c = torch.zeros((), dtype=torch.float32, device=dev)
        ph.mark("forward")
        kl = _global_kl(comm, p, kl_c, T_call, stats) if want_kl else \
            torch.zeros((), dtype=torch.float32, device=dev)

        ctx.comm, ctx.p, ctx.opts, ctx.stats = comm, p, opts, stats
        ctx.call = "rows"
        ctx.req_rows, ctx.req_ids, ctx.served, ctx.send_counts = (req_rows, req_ids, served,
                                                                  send_counts)
        ctx.T_call = T_call
        ctx.save_for_backward(q_call, k_call, v_call, q_idx_call, k_idx_call, bi_call, cu_call,
                              out_c, lse_c, qrow)
        out = out_c.index_select(0, qrow)
        lse = lse_c.index_select(0, qrow)
        ph.mark("kl_and_outputs")
        ctx.mark_non_differentiable(lse, bi_local)
        ctx.set_materialize_grads(False)
        return out, kl, lse, bi_local

    @staticmethod
    def backward(ctx, grad_out, grad_kl, grad_lse, grad_bi):
        if ctx.call == "keys":
            return _keys_backward(ctx, grad_out, grad_kl)
        comm, p, opts, stats = ctx.comm, ctx.p, ctx.opts, ctx.stats
        (q_call, k_call, v_call, q_idx_call, k_idx_call, bi_call, cu_call, out_c, lse_c,
         qrow) = ctx.saved_tensors
        dev, dtype = q_call.device, q_call.dtype
        T_call, has_idx = ctx.T_call, p.has_idx
        want_idx = has_idx and grad_kl is not None
        ph = _Phases(opts["phase_times"], stats, dev)
        if T_call:
            dout = torch.zeros_like(out_c)
            if grad_out is not None:
                dout.index_copy_(0, qrow, grad_out.to(dtype).contiguous())
            kl_grad = None
            if want_idx:
                kl_grad = (grad_kl.detach().double().reshape(1) * (T_call / p.N)).float()
            dq_c, dk_c, dv_c, dqi_c, dki_c = torch.ops.msa.backward(
                dout, q_call, k_call, v_call, out_c, lse_c, q_idx_call, k_idx_call, bi_call,
                cu_call, kl_grad, False, p.Bk, opts["scale"], opts["scale_idx"], want_idx,
                want_idx, opts["deterministic"], kl_pass=opts["kl_pass"],
                check_values=dev.type != "cuda")
            if not want_idx and has_idx:
                dqi_c = torch.zeros_like(q_idx_call)
                dki_c = torch.zeros_like(k_idx_call)
        else:
            dq_c = q_call.new_zeros(q_call.shape)
            dk_c = dv_c = k_call.new_zeros(k_call.shape)
            dqi_c = q_call.new_zeros((0, p.Hi, p.Di)) if has_idx else None
            dki_c = q_call.new_zeros((0, p.Hik, p.Di)) if has_idx else None
        grads = [dk_c, dv_c, dki_c]
        del dk_c, dv_c, dki_c  # _key_grads lets each go once it is sent
        dk, dv, dk_idx = _key_grads(ctx, grads, want_idx, ph)
        dq = dq_c.index_select(0, qrow)
        dq_idx = dqi_c.index_select(0, qrow) if want_idx else None
        return None, None, None, None, None, dq, dk, dv, dq_idx, dk_idx


def _global_kl(comm: _Comm, p: _Plan, kl_c: Tensor, n_call: int, stats) -> Tensor:
    """The global KL value from this rank's call's (normalised by its ``n_call`` queries): every
    rank's term renormalised to 1/(N*Hi), the terms summed in rank order."""
    dev = kl_c.device
    term = kl_c.double().reshape(1) * (n_call / p.N if p.N else 0.0)
    terms = comm.all_gather_rows(term.reshape(1, 1), [1] * p.W)
    stats["kl_allgather"] += 8 * (p.W - 1)
    tot = torch.zeros((1, 1), dtype=torch.float64, device=dev)
    for o in range(p.W):
        tot = tot + terms[o]
    return tot.reshape(()).float()


def _keys_forward(ctx, comm: _Comm, p: _Plan, opts, stats, ph, q, k, v, q_idx, k_idx, k_idx_full,
                  bi_local, allgather):
    """Steps 3-4 with ``call="keys"``: the call holds this rank's queries as they are (one call
    sequence per run, see ``_layout_keys_call``) over the keys it gathered, passed apart from the
    queries (cu_seqlens_k); a key row that two runs read is fetched once. The dense warmup
    (``bi_local`` None) reads every key of each run's prefix."""
    dev, dtype = q.device, q.dtype
    n, has_idx, F = p.sizes[p.r], p.has_idx, p.Hkv * p.D
    dense = bool(opts["dense"])
    lay = _layout_keys_call(p, bi_local, allgather or dense, dev)
    rows, Tk = lay["rows"], lay["Tk"]
    urows, inv = torch.unique(rows, sorted=True, return_inverse=True)
    if urows.numel() == Tk and torch.equal(urows, rows):
        inv = None  # the keys ascending, none twice (one run: contiguous shards): no copy
    ph.mark("layout")
    kv_u, routing = _fetch_kv(comm, p, k, v, urows, allgather, stats)
    ph.mark("kv_exchange")
    kv_call = kv_u.index_select(0, inv) if inv is not None else kv_u
    del kv_u
    k_call = kv_call[:, :F].reshape(Tk, p.Hkv, p.D)
    v_call = kv_call[:, F:].reshape(Tk, p.Hkv, p.D)
    k_idx_call = k_idx_full[rows] if has_idx else None
    del k_idx_full
    cu_q, cu_k, bi_call = p.geo.sel_cu_q, lay["cu_k"], lay["bi_call"]
    kk = bi_call.shape[2] if bi_call is not None else opts["top_k"]
    stats["call_tokens"] += Tk
    stats["call_queries"] += n
    stats["fetched_tokens"] += int(urows.numel()) - int(routing[0][p.r].numel())
    stats["call_blocks"] += lay["blocks"]
    ph.mark("call_build")
    want_kl = bool(opts["kl_value"]) and has_idx
    qd = q.detach()
    qid = q_idx.detach() if has_idx else None
    if n:
        out, lse, _, kl_c = torch.ops.msa.forward(
            qd, k_call, v_call, qid, k_idx_call, bi_call, cu_q, dense, False, p.Bk, kk,
            opts["sink_blocks"], opts["local_blocks"], opts["scale"], opts["scale_idx"], want_kl,
            opts["deterministic"], opts["kl_pass"], opts["fwd_pass"], "input", 4, "auto", 0, 0,
            cu_k)
    else:
        out = qd.new_zeros(qd.shape)
        lse = torch.zeros((0, p.Hq), dtype=torch.float32, device=dev)
        kl_c = torch.zeros((), dtype=torch.float32, device=dev)
    ph.mark("forward")
    kl = _global_kl(comm, p, kl_c, n, stats) if want_kl else \
        torch.zeros((), dtype=torch.float32, device=dev)
    ctx.comm, ctx.p, ctx.opts, ctx.stats = comm, p, opts, stats
    ctx.call = "keys"
    ctx.req_rows, ctx.req_ids, ctx.served, ctx.send_counts = routing
    ctx.n_u = int(urows.numel())
    ctx.save_for_backward(qd, k_call, v_call, qid, k_idx_call, bi_call, cu_q, cu_k, out, lse,
                          inv)
    ph.mark("kl_and_outputs")
    if bi_local is None:
        bi_local = torch.empty((0,), dtype=torch.int32, device=dev)
    ctx.mark_non_differentiable(lse, bi_local)
    ctx.set_materialize_grads(False)
    return out, kl, lse, bi_local


def _repeat_levels(inv: Tensor, n_u: int) -> Optional[List[Tensor]]:
    """How ``_sum_repeats`` adds the rows mapped by ``inv`` (row i to row inv[i], ``n_u``
    targets): None when no target repeats, else the rows of each occurrence level in row order
    (level 0 every target's first row, level 1 its second, ...), whose targets are distinct."""
    if inv.numel() == n_u:  # no key row read by two runs
        return None
    order = torch.argsort(inv, stable=True)
    sv = inv[order]
    starts = torch.ones_like(sv, dtype=torch.bool)
    starts[1:] = sv[1:] != sv[:-1]
    first = torch.cummax(torch.where(starts, torch.arange(sv.numel(), device=inv.device),
                                     torch.zeros_like(sv)), 0).values
    level = torch.arange(sv.numel(), device=inv.device) - first
    return [order[level == lv] for lv in range(int(level.max()) + 1 if level.numel() else 0)]


def _sum_repeats(g: Tensor, inv: Tensor, n_u: int, levels: Optional[List[Tensor]]) -> Tensor:
    """[n_u, F]: the rows of ``g`` summed by ``inv`` (row i of ``g`` goes to row inv[i]), in
    float32 (float64 for float64) and in the order of the rows of ``g`` (bitwise repeatable: one
    index_add per occurrence level of ``_repeat_levels``), rounded to ``g``'s dtype."""
    if levels is None:
        out = torch.empty_like(g[:n_u])
        return out.index_copy_(0, inv, g)
    acc_dtype = torch.float64 if g.dtype == torch.float64 else torch.float32
    acc = torch.zeros((n_u, g.shape[1]), dtype=acc_dtype, device=g.device)
    for sel in levels:
        acc.index_add_(0, inv[sel], g[sel].to(acc_dtype))
    return acc.to(g.dtype)


def _keys_backward(ctx, grad_out, grad_kl):
    comm, p, opts, stats = ctx.comm, ctx.p, ctx.opts, ctx.stats
    (q, k_call, v_call, q_idx, k_idx_call, bi_call, cu_q, cu_k, out, lse,
     inv) = ctx.saved_tensors
    dev, dtype = q.device, q.dtype
    n, has_idx = p.sizes[p.r], p.has_idx
    want_idx = has_idx and grad_kl is not None
    ph = _Phases(opts["phase_times"], stats, dev)
    if n:
        dout = grad_out.to(dtype) if grad_out is not None else torch.zeros_like(out)
        kl_grad = None
        if want_idx:
            kl_grad = (grad_kl.detach().double().reshape(1) * (n / p.N)).float()
        dq, dk_c, dv_c, dq_idx, dki_c = torch.ops.msa.backward(
            dout, q, k_call, v_call, out, lse, q_idx, k_idx_call, bi_call, cu_q, kl_grad,
            bool(opts["dense"]),
            p.Bk, opts["scale"], opts["scale_idx"], want_idx, want_idx, opts["deterministic"],
            kl_pass=opts["kl_pass"], check_values=dev.type != "cuda", cu_seqlens_k=cu_k)
        if has_idx and not want_idx:
            dki_c = torch.zeros_like(k_idx_call)
    else:
        dq = q.new_zeros(q.shape)
        dq_idx = q_idx.new_zeros(q_idx.shape) if has_idx else None
        dk_c = dv_c = k_call.new_zeros(k_call.shape)
        dki_c = k_call.new_zeros((0, p.Hik, p.Di)) if has_idx else None
    grads = [dk_c, dv_c, dki_c]
    del dk_c, dv_c, dki_c  # _key_grads lets each go once it is sent
    dk, dv, dk_idx = _key_grads(ctx, grads, want_idx, ph, inv)
    return None, None, None, None, None, dq, dk, dv, dq_idx if want_idx else None, dk_idx


def _key_grads(ctx, grads: List[Optional[Tensor]], want_idx: bool, ph,
               inv: Optional[Tensor] = None):
    """The key side's gradients of this rank's shard (dk, dv, and dk_idx when ``want_idx``)
    from the call's ``grads`` = [dk, dv, dk_idx] (rows of ``_fetch_kv``'s rows, or of the
    call's keys mapped to them by ``inv``, whose repeats are summed first), sent back to and
    summed at their owners. One tensor at a time (an all-to-all each), so that no more than one
    of them is ever held in float32 or in a send buffer; the list's entries are dropped as they
    are sent. The sums are those of one exchange of all three: the same bits."""
    p = ctx.p
    n = p.sizes[p.r]
    shapes = [(p.Hkv, p.D), (p.Hkv, p.D), (p.Hik, p.Di)]
    ph.mark("backward")
    if ctx.served is None:  # the all-gather mode: the owners learn which rows come back now
        ctx.served = _exchange_ids(ctx.comm, ctx.req_ids, ctx.send_counts, ctx.stats,
                                   "grad_request_ids")
    levels = _repeat_levels(inv, ctx.n_u) if inv is not None else None
    out: List[Optional[Tensor]] = [None, None, None]
    for i in range(3 if p.has_idx and want_idx else 2):
        g = grads[i]
        grads[i] = None
        g = g.reshape(g.shape[0], shapes[i][0] * shapes[i][1])
        if inv is not None:
            g = _sum_repeats(g, inv, ctx.n_u, levels)
        out[i] = _return_grads(ctx, g, ph).reshape((n,) + shapes[i])
        del g
    ph.mark("grad_sum")
    return out[0], out[1], out[2]


def _fetch_kv(comm: _Comm, p: _Plan, k: Tensor, v: Tensor, rows: Tensor, allgather: bool,
              stats):
    """K and V ([rows, 2 Hkv D]) of the global rows ``rows`` (distinct, on the device): this
    rank's own copied, the others' fetched from their owners (one all-to-all of the requested
    row ids, one of the rows) or, with ``allgather``, taken from an all-gather of every shard.
    Also returns the routing the backward sends the gradients back by: the positions in
    ``rows`` of each owner's rows, their indices in the owner's shard, the rows each peer
    requested from this rank (None with ``allgather``: exchanged in the backward) and the counts
    this rank requested."""
    W, r, dev, dtype = p.W, p.r, k.device, k.dtype
    owner = p.geo.owner[rows]
    lid = p.geo.lidx[rows]
    req_rows = [torch.nonzero(owner == o).flatten() for o in range(W)]  # rows by owner
    req_ids = [lid[x] for x in req_rows]  # their indices in the owner's shard
    F = p.Hkv * p.D
    kv_local = torch.cat([k.detach().reshape(-1, F), v.detach().reshape(-1, F)], 1)
    kv = torch.empty((rows.numel(), 2 * F), dtype=dtype, device=dev)
    kv.index_copy_(0, req_rows[r].to(dev), kv_local.index_select(0, req_ids[r].to(dev)))
    send_counts = [int(x.numel()) if o != r else 0 for o, x in enumerate(req_ids)]
    if allgather:
        parts = comm.all_gather_rows(kv_local, p.sizes)
        for o in range(W):
            if o != r:
                stats["kv_allgather"] += _nbytes(parts[o])
                kv[req_rows[o].to(dev)] = parts[o][req_ids[o].to(dev)]
        del parts
        served = None
    else:
        served = _exchange_ids(comm, req_ids, send_counts, stats, "kv_request_ids")
        send = torch.cat([kv_local[served[o].to(dev)] for o in range(W)])
        recv = comm.all_to_all(send, [int(x.numel()) for x in served], send_counts)
        stats["kv_fetch"] += _nbytes(recv)
        off = 0
        for o in range(W):
            c = send_counts[o]
            if c:
                kv.index_copy_(0, req_rows[o].to(dev), recv[off: off + c])
            off += c
        del send, recv
    return kv, (req_rows, req_ids, served, send_counts)


def _return_grads(ctx, g: Tensor, ph) -> Tensor:
    """Sends every owner the gradient rows ``g`` ([rows, F], the rows of ``_fetch_kv``) of its
    keys and sums, for this rank's shard, the contributions of every rank in rank order 0 ..
    W-1 (bitwise repeatable): [n, F] in the inputs' dtype."""
    comm, p, stats = ctx.comm, ctx.p, ctx.stats
    W, r, dev, dtype = p.W, p.r, g.device, g.dtype
    served = ctx.served
    send = torch.cat([g[ctx.req_rows[o].to(dev)] if o != r else g[:0] for o in range(W)])
    recv_counts = [int(x.numel()) for x in served]
    recv = comm.all_to_all(send, ctx.send_counts, recv_counts)
    stats["grad_return"] += _nbytes(recv)
    ph.mark("grad_exchange")
    acc_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    acc = torch.zeros((p.sizes[r], g.shape[1]), dtype=acc_dtype, device=dev)
    off = 0
    for o in range(W):  # the rows of one source are distinct: one add per element
        if o == r:
            acc.index_add_(0, ctx.req_ids[r].to(dev), g[ctx.req_rows[r].to(dev)].to(acc_dtype))
        else:
            c = recv_counts[o]
            if c:
                acc.index_add_(0, served[o].to(dev), recv[off: off + c].to(acc_dtype))
            off += c
    return acc.to(dtype)


def _exchange_ids(comm: _Comm, req_ids: List[Tensor], send_counts: List[int], stats,
                  key: str) -> List[Tensor]:
    """Sends every owner the list of its rows this rank needs; returns, per peer, the rows of
    this rank's shard that the peer needs (empty for this rank itself)."""
    W, r = comm.W, comm.r
    counts = torch.tensor(send_counts, dtype=torch.int64).reshape(W, 1)
    got = comm.all_to_all(counts, [1] * W, [1] * W).reshape(W).tolist()
    stats[key] += 8 * (W - 1)
    send = torch.cat([req_ids[o] if o != r else req_ids[o][:0] for o in range(W)]).reshape(-1, 1)
    recv = comm.all_to_all(send, send_counts, got).reshape(-1)
    stats[key] += _nbytes(recv)
    out, off = [], 0
    for o in range(W):
        out.append(recv[off: off + got[o]])
        off += got[o]
    return out


# --------------------------------------------------------------------------------------------
# public entry point
# --------------------------------------------------------------------------------------------


_STAT_KEYS = ("k_idx_allgather", "kv_request_ids", "kv_fetch", "kv_allgather", "kl_allgather",
              "grad_request_ids", "grad_return", "call_tokens", "call_queries", "fetched_tokens",
              "call_blocks")


def sparse_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    q_idx: Optional[Tensor],
    k_idx: Optional[Tensor],
    top_k: int = 16,
    block_size: int = 128,
    *,
    cu_seqlens: Optional[Tensor] = None,
    group=None,
    layout: str = "contiguous",
    exchange: str = "selected",
    block_idx: Optional[Tensor] = None,
    sink_blocks: int = 0,
    local_blocks: int = 1,
    scale: Optional[float] = None,
    scale_idx: Optional[float] = None,
    kl_value: bool = True,
    return_lse: bool = False,
    return_block_idx: bool = False,
    return_stats: bool = False,
    deterministic: bool = False,
    kl_pass: str = "auto",
    fwd_pass: str = "auto",
    phase_times: bool = False,
    call: str = "auto",
):
    """Context-parallel :func:`msa.sparse_attention` over the process group ``group``.

    Every rank passes its shard (rows in ascending global order) of the packed tensors ``q``
    [n, Hq, D], ``k``, ``v`` [n, Hkv, D], ``q_idx`` [n, Hi, Di], ``k_idx`` [n, Hik, Di], and the
    batch's ``cu_seqlens`` (global offsets, the same on every rank; None: one sequence). Which
    tokens a rank holds is given by ``layout`` (see :func:`shard_positions`; "contiguous": the
    ranks' shards in rank order, any sizes; "balanced": the zigzag cut of every sequence).

    ``exchange``: "selected" fetches only the K/V rows of the blocks this rank's queries selected
    (all-to-all of per-owner row lists); "allgather" all-gathers K and V (the baseline).
    ``call``: how the library call over the gathered keys is laid out: "keys" (this rank's
    queries as they are, over the keys passed apart with ``cu_seqlens_k``: one call sequence
    per run of consecutive positions; no query rows for fetched keys, no copies of ``q``,
    ``out``, ``dout``, ``dq``), "rows" (every gathered key row also a query row, zero and with
    an empty selection) or "auto" ("keys" on the CPU; "rows" on CUDA, until the key call is
    measured on two GPUs).
    ``block_idx`` [n, Hi, k] int32: a caller's selection for this rank's queries (block ids of
    their own sequences, -1 = empty); then no selection runs and ``q_idx``/``k_idx`` may be None
    (no KL). The other options are those of :func:`msa.sparse_attention`.

    Returns ``(out, kl)`` — ``out`` [n, Hq, D] this rank's rows, ``kl`` the global KL value (the
    same on every rank) — then ``lse`` [n, Hq], ``block_idx`` [n, Hi, k] and a stats dict of the
    bytes this rank received per phase, when asked for. ``phase_times=True`` (profiling only:
    it synchronises the device between phases) adds this rank's wall time per phase to that
    dict as ``ms_<phase>`` (``plan``, ``k_idx_gather``, ``select``, ``layout``, ``kv_exchange``,
    ``call_build``, ``forward``, ``kl_and_outputs``; the backward adds ``backward``,
    ``grad_exchange``, ``grad_sum``). Each rank's loss must include ``kl``
    with the same weight and every rank must run the backward (its collectives pair up across
    ranks); the global KL's gradient is then the single-process one, like every other gradient.
    """
    if block_idx is None and (q_idx is None or k_idx is None):
        raise ValueError("msa.distributed: argument 'q_idx': q_idx and k_idx are required "
                         "unless block_idx is given")
    return _run(q, k, v, q_idx, k_idx, block_idx, cu_seqlens, group, False, top_k, block_size,
                layout, exchange, sink_blocks, local_blocks, scale, scale_idx, kl_value,
                return_lse, return_block_idx, return_stats, deterministic, kl_pass, fwd_pass,
                phase_times, call)


def warmup_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    q_idx: Optional[Tensor],
    k_idx: Optional[Tensor],
    *,
    cu_seqlens: Optional[Tensor] = None,
    group=None,
    layout: str = "contiguous",
    exchange: str = "selected",
    scale: Optional[float] = None,
    scale_idx: Optional[float] = None,
    kl_value: bool = True,
    return_lse: bool = False,
    return_stats: bool = False,
    deterministic: bool = False,
    kl_pass: str = "auto",
    phase_times: bool = False,
    call: str = "auto",
):
    """Context-parallel :func:`msa.warmup_attention` (dense causal attention, the KL over the
    full causal support: contract §5) over the process group ``group``.

    Shards, ``cu_seqlens``, ``layout`` and the returns as in :func:`sparse_attention` (no
    selection: ``(out, kl)``, then ``lse`` and the stats when asked for). Every key of a
    rank's prefix takes part, so each rank gathers the K, V (and index key) rows of every
    sequence up to its last query there: from their owners with ``exchange="selected"``, by
    all-gather with ``"allgather"``. It runs on the call over keys apart (``call="keys"`` of
    :func:`sparse_attention`): ``call="auto"`` takes it on CPU tensors and raises
    NotImplementedError naming 'q' on CUDA tensors before anything moves (the key call is not
    yet measured on two GPUs); ``call="keys"`` takes it on any device.
    """
    if call not in ("auto", "keys"):
        raise ValueError(f"msa.distributed.warmup_attention: argument 'call': expected 'auto' "
                         f"or 'keys', got {call!r}")
    if call == "auto" and isinstance(q, Tensor) and q.device.type not in _KEYS_APART_DEVICES:
        raise NotImplementedError(
            f"msa.distributed.warmup_attention: argument 'q': the dense warmup runs on the call "
            f"over keys apart from queries, which call='auto' does not take for {q.device.type} "
            f"tensors yet (devices: {', '.join(_KEYS_APART_DEVICES)}); call='keys' does")
    return _run(q, k, v, q_idx, k_idx, None, cu_seqlens, group, True, 1, 128, layout, exchange,
                0, 1, scale, scale_idx, kl_value, return_lse, False, return_stats, deterministic,
                kl_pass, "auto", phase_times, "keys")


def _check_modes(layout: str, exchange: str, call: str, calls: Sequence[str]) -> None:
    if layout not in _LAYOUTS:
        raise ValueError(f"msa.distributed: argument 'layout': expected 'contiguous' or "
                         f"'balanced', got {layout!r}")
    if exchange not in _EXCHANGES:
        raise ValueError(f"msa.distributed: argument 'exchange': expected 'selected' or "
                         f"'allgather', got {exchange!r}")
    if call not in calls:
        raise ValueError(f"msa.distributed: argument 'call': expected one of "
                         f"{', '.join(repr(c) for c in calls)}, got {call!r}")


def _run(q, k, v, q_idx, k_idx, block_idx, cu_seqlens, group, dense, top_k, block_size, layout,
         exchange, sink_blocks, local_blocks, scale, scale_idx, kl_value, return_lse,
         return_block_idx, return_stats, deterministic, kl_pass, fwd_pass, phase_times, call):
    """The checks and the call shared by :func:`sparse_attention` and :func:`warmup_attention`
    (``dense``)."""
    _check_modes(layout, exchange, call, _CALLS + ("auto",))
    if call == "auto":
        dev_type = q.device.type if isinstance(q, Tensor) else "cpu"
        call = "keys" if dev_type in _KEYS_APART_DEVICES else "rows"
    _int("block_size", block_size, 1)
    _int("sink_blocks", sink_blocks, 0)
    _int("local_blocks", local_blocks, 1)
    _int("top_k", top_k, 1, _MAX_TOP_K)
    _kl_pass(kl_pass)
    _ops._need_fwd_pass(fwd_pass)
    if block_size & (block_size - 1):
        raise ValueError(f"msa.distributed: argument 'block_size': must be a power of two, "
                         f"got {block_size}")
    if (q_idx is None) != (k_idx is None):
        raise ValueError("msa.distributed: argument 'k_idx': q_idx and k_idx must be given "
                         "together")
    if group is None:
        group = dist.group.WORLD
    cu = _cu_seqlens(cu_seqlens, cu_seqlens.device) if cu_seqlens is not None else None
    comm = _Comm(group, q.device if isinstance(q, Tensor) else torch.device("cpu"))
    opts = dict(top_k=top_k, block_size=block_size, sink_blocks=sink_blocks,
                local_blocks=local_blocks, scale=_scale("scale", scale),
                scale_idx=_scale("scale_idx", scale_idx), kl_value=bool(kl_value),
                layout=layout, exchange=exchange, call=call, deterministic=bool(deterministic),
                kl_pass=kl_pass, fwd_pass=fwd_pass,
                kl_pass_code=_ops._KL_PASSES.index(kl_pass),
                fwd_pass_code=_ops._FWD_PASSES.index(fwd_pass),
                phase_times=bool(phase_times), dense=bool(dense))
    stats: Dict[str, int] = {key: 0 for key in _STAT_KEYS}
    stats["call"] = call
    ph = _Phases(opts["phase_times"], stats,
                 q.device if isinstance(q, Tensor) else torch.device("cpu"))
    p = _plan(comm, q, k, v, q_idx, k_idx, block_idx, cu, opts)
    ph.mark("plan")
    out, kl, lse, bi = _CPAttention.apply(comm, p, opts, stats, block_idx, q, k, v, q_idx,
                                          k_idx)
    result = (out, kl)
    if return_lse:
        result += (lse,)
    if return_block_idx:
        result += (bi,)
    if return_stats:
        result += (stats,)
    return result


def moved_bytes(stats: Dict[str, int], phase: str = "all") -> int:
    """Bytes a rank received: ``phase`` "forward", "backward" or "all" (from a stats dict)."""
    fwd = ("k_idx_allgather", "kv_request_ids", "kv_fetch", "kv_allgather", "kl_allgather")
    bwd = ("grad_request_ids", "grad_return")
    keys = fwd if phase == "forward" else bwd if phase == "backward" else fwd + bwd
    return sum(int(stats[x]) for x in keys)


def exchange_bytes(block_idx: Optional[Tensor], world: int, *, cu_seqlens=None,
                   layout: str = "contiguous", sizes: Optional[Sequence[int]] = None,
                   block_size: int = 128, Hkv: int, D: int, Hik: int = 0, Di: int = 0,
                   element_size: int = 2, exchange: str = "selected", call: str = "keys",
                   kl_value: bool = False) -> List[Dict[str, int]]:
    """The bytes every rank would receive in one :func:`sparse_attention` step, without running
    it: per rank a dict with the keys of the stats dict (``k_idx_allgather``,
    ``kv_request_ids``, ``kv_fetch``, ``kv_allgather``, ``kl_allgather``, ``grad_request_ids``,
    ``grad_return``; sum them with :func:`moved_bytes`) and ``fetched_tokens``, the key rows
    this rank takes from others.

    ``block_idx`` [N, Hi, k] is the whole batch's selection (block ids of each token's own
    sequence, -1 padding: what :func:`msa.select_blocks` returns, which is what the ranks
    select), on any device; ``exchange="allgather"`` needs none (None). ``Hkv, D`` give the K
    and V rows, ``Hik, Di`` the index keys (0: no index branch), ``element_size`` the inputs'
    bytes per value. ``layout``, ``sizes``, ``exchange``, ``call`` and ``kl_value`` as in
    :func:`sparse_attention` (the backward included, as a training step runs it: with the KL's
    gradient, so the index keys' gradients go back too). For planning:
    how much a layout moves on a model's own selections, at lengths no machine at hand runs."""
    _check_modes(layout, exchange, call, _CALLS)
    _int("world", world, 1)
    _int("block_size", block_size, 1)
    for name, value, lo in (("Hkv", Hkv, 1), ("D", D, 1), ("Hik", Hik, 0), ("Di", Di, 0),
                            ("element_size", element_size, 1)):
        _int(name, value, lo)
    allgather = exchange == "allgather"
    if block_idx is None:
        if not allgather:
            raise ValueError("msa.distributed: argument 'block_idx': required with "
                             "exchange='selected'")
        if cu_seqlens is None and sizes is None:
            raise ValueError("msa.distributed: argument 'cu_seqlens': give cu_seqlens or sizes "
                             "when block_idx is None")
    elif not isinstance(block_idx, Tensor) or block_idx.dim() != 3:
        raise ValueError("msa.distributed: argument 'block_idx': expected [N, Hi, k]")
    if cu_seqlens is not None:
        N = _cu_list(cu_seqlens, 0)[-1]
    elif block_idx is not None:
        N = int(block_idx.shape[0])
    else:
        N = int(sum(sizes))
    if block_idx is not None and int(block_idx.shape[0]) != N:
        raise ValueError(f"msa.distributed: argument 'block_idx': {block_idx.shape[0]} rows, "
                         f"the batch has {N} tokens")
    if sizes is not None and (layout != "contiguous" or len(sizes) != world
                              or sum(int(x) for x in sizes) != N or min(sizes) < 0):
        raise ValueError(f"msa.distributed: argument 'sizes': expected {world} contiguous shard "
                         f"sizes summing to {N}, got {list(sizes)}")
    cu = torch.tensor(_cu_list(cu_seqlens, N), dtype=torch.int64)
    lens = cu.diff()
    nseq = int(lens.numel())
    positions = [shard_positions(layout, r, world, N, cu, sizes) for r in range(world)]
    owner = torch.empty(N, dtype=torch.int64)
    for r in range(world):
        owner[positions[r]] = r
    seq = torch.repeat_interleave(torch.arange(nseq), lens, output_size=N)
    t_in = torch.arange(N) - cu[:-1][seq]
    bi = None if block_idx is None else block_idx.detach().to("cpu", torch.int64)
    if bi is not None and bi.numel():
        nblk = ((lens + block_size - 1) // block_size)[seq]
        if bool(((bi < -1) | (bi >= nblk[:, None, None])).any()):
            raise ValueError("msa.distributed: argument 'block_idx': ids must be -1 or blocks of "
                             "the row's own sequence")
    return _exchange_bytes(bi, world, cu, block_size, positions, owner, seq, t_in, Hkv * D,
                           Hik * Di, element_size, allgather, call, kl_value and Hik * Di > 0)


def _exchange_bytes(bi, W, cu, Bk, positions, owner, seq, t_in, F, Fi, es, allgather, call, kl):
    N, nseq = int(owner.numel()), int(cu.numel()) - 1
    need = []  # per rank: the rows its call reads (its own included)
    for r in range(W):
        pos = positions[r]
        s_r, t_r = seq[pos], t_in[pos]
        tmax = torch.full((max(nseq, 1),), -1, dtype=torch.int64)
        if pos.numel():
            tmax = tmax.scatter_reduce(0, s_r, t_r, reduce="amax")
        readable = t_in <= tmax[seq]  # rows up to this rank's last position of their sequence
        if not pos.numel():
            rows = torch.zeros(N, dtype=torch.bool)
        elif call == "keys":
            # per run of consecutive positions: its rows from its first block's start (fb), and
            # the blocks below fb that its queries selected (every one with allgather)
            first = torch.ones(pos.numel(), dtype=torch.bool)
            first[1:] = (s_r[1:] != s_r[:-1]) | (t_r[1:] != t_r[:-1] + 1)
            last = torch.ones_like(first)
            last[:-1] = first[1:]
            seq0, fb = cu[s_r[first]], t_r[first] // Bk
            lo, hi = seq0 + fb * Bk, pos[last] + 1
            if allgather:
                lo, hi = torch.cat([lo, seq0]), torch.cat([hi, seq0 + fb * Bk])
            rows = _range_mask(lo, hi, N)
            if not allgather:
                b = bi[pos]
                ok = (b >= 0) & (b < fb[torch.cumsum(first.long(), 0) - 1][:, None, None])
                rows |= _block_rows(cu, s_r[:, None, None].expand_as(b)[ok], b[ok], Bk, N)
        elif allgather:  # the row call: every block up to this rank's last position
            rows = readable.clone()
        else:  # the row call: its own blocks and the selected ones, up to its last position
            b = bi[pos]
            ok = b >= 0
            rows = _block_rows(cu, torch.cat([s_r, s_r[:, None, None].expand_as(b)[ok]]),
                               torch.cat([t_r // Bk, b[ok]]), Bk, N) & readable
        need.append((rows, readable))
    out = []
    for r in range(W):
        rows_r, readable_r = need[r]
        others = owner != r
        fetched = int((rows_r & others).sum())
        # rows of this rank that every other rank reads
        served = sum(int((need[o][0] & (owner == r)).sum()) for o in range(W) if o != r)
        st = {k: 0 for k in _STAT_KEYS if k not in ("call_tokens", "call_queries",
                                                     "call_blocks")}
        n_other = N - int(positions[r].numel())
        if allgather:
            st["k_idx_allgather"] = n_other * Fi * es
            st["kv_allgather"] = n_other * 2 * F * es
            st["grad_request_ids"] = 8 * (W - 1) + 8 * served
        else:
            st["k_idx_allgather"] = int((readable_r & others).sum()) * Fi * es
            st["kv_request_ids"] = 8 * (W - 1) + 8 * served
            st["kv_fetch"] = fetched * 2 * F * es
        st["grad_return"] = served * (2 * F + Fi) * es
        st["kl_allgather"] = 8 * (W - 1) if kl else 0
        st["fetched_tokens"] = fetched
        out.append(st)
    return out


def _range_mask(lo: Tensor, hi: Tensor, N: int) -> Tensor:
    """A mask of the N rows in any of the ranges [lo[i], hi[i]) (by a difference array)."""
    row = torch.zeros(N + 1, dtype=torch.int64)
    row.index_add_(0, lo, torch.ones_like(lo))
    row.index_add_(0, hi, -torch.ones_like(hi))
    return torch.cumsum(row[:N], 0) > 0


def _block_rows(cu, s, b, Bk, N):
    """A mask of the rows of blocks ``b`` of sequences ``s`` (1-D, the same length)."""
    gb = torch.unique(s * (1 << 40) + b)  # each block once
    lo = cu[gb >> 40] + (gb & ((1 << 40) - 1)) * Bk
    return _range_mask(lo, torch.minimum(lo + Bk, cu[(gb >> 40) + 1]), N)
