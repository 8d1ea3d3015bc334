"""Serving over a paged KV cache (docs/contract.md §6): ``msa.serving``.

A cache holds pages of ``Bk`` tokens (``Bk`` = ``block_size``, the MSA block size):
``k_cache, v_cache [pages, Bk, Hkv, D]`` and the index keys ``k_idx_cache [pages, Bk, Hik, Di]``,
token-major. Sequence ``s`` keeps its tokens ``0 .. seq_lens[s]-1`` in logical blocks whose
physical pages are ``page_table[s, :]`` (int32 ``[nseq, max_pages]``). A call's new tokens are
packed by ``cu_seqlens_q`` (int32 ``[nseq+1]``); sequence ``s`` has
``n_s = cu_seqlens_q[s+1] - cu_seqlens_q[s]`` of them (0 allowed), its last ``n_s`` positions
(``seq_lens`` counts them), and new token ``j`` at position ``p = seq_lens[s] - n_s + j``
selects and attends exactly as token ``p`` of the contiguous sequence does in
:func:`msa.select_blocks` / :func:`msa.sparse_attention`. ``block_idx`` holds logical block ids.
``max_q_len``: 0 for any ``n_s`` (prefill chunks), 1..16 for decode (a bound on every ``n_s``).

Three layers:

* torch custom ops (``torch.ops.msa.paged_select_blocks``, ``paged_forward``,
  ``paged_forward_into``, ``paged_append``) with fake kernels: they trace under
  ``torch.compile(fullgraph=True)`` and run on the current CUDA stream;
* functions :func:`paged_select_blocks`, :func:`paged_forward`, :func:`paged_append`;
* :class:`PagedKVCache` (the page tensors, a page allocator and per-sequence page lists) and
  :class:`PagedMSAWrapper`, whose ``plan`` takes the batch shape once and allocates the outputs
  and the device workspace, and whose ``run`` allocates nothing, never waits for the GPU
  (value checks off) and can be captured into a CUDA graph and replayed with new ``seq_lens``,
  ``cu_seqlens_q`` values and page tables (same shapes).
"""

from typing import Dict, List, Optional, Sequence, Tuple

import torch
from torch import Tensor

from . import _C
from . import _ops

__all__ = [
    "paged_select_blocks",
    "paged_forward",
    "paged_append",
    "PagedKVCache",
    "PagedMSAWrapper",
]

_MAX_Q_LEN = 16
_INT32_MIN, _INT32_MAX = -(2**31), 2**31 - 1


_launch, _lc, _empty = _ops._launch, _ops._lc, _ops._empty


# --------------------------------------------------------------------------------------------
# custom ops
# --------------------------------------------------------------------------------------------


@torch.library.custom_op("msa::paged_select_blocks", mutates_args=())
def _paged_select_blocks_op(
    q_idx: Tensor,
    cu_seqlens_q: Tensor,
    k_idx_cache: Tensor,
    page_table: Tensor,
    seq_lens: Tensor,
    max_q_len: int,
    top_k: int,
    block_size: int,
    sink_blocks: int,
    local_blocks: int,
    scale_idx: float,
    k_idx_scale: Optional[Tensor] = None,
    select_scores: str = "input",
    fp8_rerank: int = 4,
    fp8_rerank_slots: int = 0,
) -> Tensor:
    """block_idx [Tq, Hi, top_k] int32: ascending logical block ids, then -1. ``k_idx_scale``:
    the scale of a float8_e4m3fn ``k_idx_cache`` ([1] or [pages] float32). ``select_scores``,
    ``fp8_rerank``, ``fp8_rerank_slots``: Options.select_scores ("input" or "fp8": a prefill's
    E4M3 copies), Options.fp8_rerank and Options.fp8_rerank_slots."""
    _ops._need_select_scores(select_scores)
    _ops._need_rank("q_idx", q_idx, 3, "[Tq, Hi, Di]")
    _ops._need_int("top_k", top_k, 1, _ops._MAX_TOP_K)
    block_idx = torch.empty((q_idx.shape[0], q_idx.shape[1], top_k), dtype=torch.int32,
                            device=q_idx.device)
    _launch(_C.paged_select_blocks, q_idx.device, _lc(q_idx), _lc(cu_seqlens_q),
            _lc(k_idx_cache), _lc(page_table), _lc(seq_lens), block_idx, max_q_len=max_q_len,
            block_size=block_size, top_k=top_k, sink_blocks=sink_blocks,
            local_blocks=local_blocks, scale_idx=scale_idx, k_idx_scale=_lc(k_idx_scale),
            select_scores=select_scores, fp8_rerank=fp8_rerank, fp8_rerank_slots=fp8_rerank_slots)
    return block_idx


@_paged_select_blocks_op.register_fake
def _(q_idx, cu_seqlens_q, k_idx_cache, page_table, seq_lens, max_q_len, top_k, block_size,
      sink_blocks, local_blocks, scale_idx, k_idx_scale=None, select_scores="input", fp8_rerank=4,
      fp8_rerank_slots=0):
    return q_idx.new_empty((q_idx.shape[0], q_idx.shape[1], top_k), dtype=torch.int32)


def _out_dtype(q: Tensor, out_dtype: Optional[torch.dtype]) -> torch.dtype:
    """The output dtype of a paged_forward: q's, or for float8 queries out_dtype (bfloat16 by
    default)."""
    if q.dtype == torch.float8_e4m3fn:
        return torch.bfloat16 if out_dtype is None else out_dtype
    if out_dtype is not None and out_dtype != q.dtype:
        raise ValueError(f"msa: argument 'out_dtype': {out_dtype} differs from q's dtype {q.dtype} "
                         "(out_dtype applies to float8_e4m3fn queries)")
    return q.dtype


def _run_paged_forward(q, cu_seqlens_q, k_cache, v_cache, k_idx_cache, page_table, seq_lens,
                       q_idx, block_idx, out, lse, max_q_len, dense, sel, block_size, top_k,
                       sink_blocks, local_blocks, scale, scale_idx, k_scale=None, v_scale=None,
                       k_idx_scale=None, q_scale=None, fwd_pass="auto", fwd_chunk_tokens=0,
                       select_scores="input", fp8_rerank=4, fp8_rerank_slots=0, **launch):
    """The binding's paged_forward into out / lse (and block_idx when ``sel``); ``launch``:
    msa._ops._launch's check_values and workspace."""
    _launch(_C.paged_forward, q.device, _lc(q), _lc(cu_seqlens_q), _lc(k_cache), _lc(v_cache),
            _lc(k_idx_cache) if sel else None, _lc(page_table), _lc(seq_lens), block_idx, sel,
            _lc(q_idx) if sel else None, out, lse, max_q_len=max_q_len,
            mode=_ops._MODE_DENSE if dense else _ops._MODE_SPARSE, block_size=block_size,
            top_k=top_k, sink_blocks=sink_blocks, local_blocks=local_blocks, scale=scale,
            scale_idx=scale_idx, k_scale=_lc(k_scale), v_scale=_lc(v_scale),
            k_idx_scale=_lc(k_idx_scale) if sel else None, q_scale=_lc(q_scale), fwd_pass=fwd_pass,
            fwd_chunk_tokens=fwd_chunk_tokens, select_scores=select_scores, fp8_rerank=fp8_rerank,
            fp8_rerank_slots=fp8_rerank_slots, **launch)


@torch.library.custom_op("msa::paged_forward", mutates_args=())
def _paged_forward_op(
    q: Tensor,
    cu_seqlens_q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    k_idx_cache: Optional[Tensor],
    page_table: Tensor,
    seq_lens: Tensor,
    q_idx: Optional[Tensor],
    block_idx: Optional[Tensor],
    max_q_len: int,
    dense: bool,
    select: bool,
    block_size: int,
    top_k: int,
    sink_blocks: int,
    local_blocks: int,
    scale: float,
    scale_idx: float,
    k_scale: Optional[Tensor] = None,
    v_scale: Optional[Tensor] = None,
    k_idx_scale: Optional[Tensor] = None,
    q_scale: Optional[Tensor] = None,
    out_dtype: Optional[torch.dtype] = None,
    fwd_pass: str = "auto",
    fwd_chunk_tokens: int = 0,
    select_scores: str = "input",
    fp8_rerank: int = 4,
    fp8_rerank_slots: int = 0,
) -> Tuple[Tensor, Tensor, Tensor]:
    """(out [Tq, Hq, D] dtype of q (``out_dtype`` for float8 queries), lse [Tq, Hq] fp32,
    block_idx).

    ``block_idx`` (output) is the selection written by this call, [Tq, Hi, top_k] int32, when
    ``select`` is set in sparse mode, else an empty [0] int32 tensor. ``fwd_pass``,
    ``fwd_chunk_tokens``: a sparse prefill's walk and its pass size (Options.fwd_pass,
    Options.fwd_chunk_tokens). ``select_scores``, ``fp8_rerank``, ``fp8_rerank_slots``: the
    scores a selection made here ranks blocks by (Options.select_scores, Options.fp8_rerank,
    Options.fp8_rerank_slots).
    """
    _ops._need_fwd_pass(fwd_pass)
    _ops._need_select_scores(select_scores)
    _ops._need_int("fwd_chunk_tokens", fwd_chunk_tokens, 0)
    _ops._need_rank("q", q, 3, "[Tq, Hq, D]")
    Tq, Hq, _ = q.shape
    dev = q.device
    sel = (not dense) and select
    if sel:
        _ops._need_rank("q_idx", q_idx, 3, "[Tq, Hi, Di]")
        _ops._need_int("top_k", top_k, 1, _ops._MAX_TOP_K)
        bi_out = torch.empty((Tq, q_idx.shape[1], top_k), dtype=torch.int32, device=dev)
        bi = bi_out
    else:
        bi_out = _empty(torch.int32, dev)
        bi = None if dense else _lc(block_idx)
        if not dense and bi is None:
            raise ValueError("msa: argument 'block_idx': required in sparse mode when select "
                             "is not set")
    out = torch.empty(q.shape, dtype=_out_dtype(q, out_dtype), device=dev)
    lse = torch.empty((Tq, Hq), dtype=torch.float32, device=dev)
    _run_paged_forward(q, cu_seqlens_q, k_cache, v_cache, k_idx_cache, page_table, seq_lens,
                       q_idx, bi, out, lse, max_q_len, dense, sel, block_size, top_k,
                       sink_blocks, local_blocks, scale, scale_idx, k_scale, v_scale, k_idx_scale,
                       q_scale, fwd_pass, fwd_chunk_tokens, select_scores, fp8_rerank,
                       fp8_rerank_slots)
    return out, lse, bi_out


@_paged_forward_op.register_fake
def _(q, cu_seqlens_q, k_cache, v_cache, k_idx_cache, page_table, seq_lens, q_idx, block_idx,
      max_q_len, dense, select, block_size, top_k, sink_blocks, local_blocks, scale, scale_idx,
      k_scale=None, v_scale=None, k_idx_scale=None, q_scale=None, out_dtype=None, fwd_pass="auto",
      fwd_chunk_tokens=0, select_scores="input", fp8_rerank=4, fp8_rerank_slots=0):
    Tq, Hq, D = q.shape
    out = q.new_empty((Tq, Hq, D), dtype=_out_dtype(q, out_dtype))
    lse = q.new_empty((Tq, Hq), dtype=torch.float32)
    if (not dense) and select:
        bi = q.new_empty((Tq, q_idx.shape[1], top_k), dtype=torch.int32)
    else:
        bi = q.new_empty((0,), dtype=torch.int32)
    return out, lse, bi


@torch.library.custom_op("msa::paged_forward_into",
                         mutates_args=("out", "lse", "block_idx", "workspace"))
def _paged_forward_into_op(
    q: Tensor,
    cu_seqlens_q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    k_idx_cache: Optional[Tensor],
    page_table: Tensor,
    seq_lens: Tensor,
    q_idx: Optional[Tensor],
    block_idx: Optional[Tensor],
    out: Tensor,
    lse: Tensor,
    workspace: Tensor,
    max_q_len: int,
    dense: bool,
    select: bool,
    block_size: int,
    top_k: int,
    sink_blocks: int,
    local_blocks: int,
    scale: float,
    scale_idx: float,
    check_values: bool,
    k_scale: Optional[Tensor] = None,
    v_scale: Optional[Tensor] = None,
    k_idx_scale: Optional[Tensor] = None,
    q_scale: Optional[Tensor] = None,
    fwd_pass: str = "auto",
    fwd_chunk_tokens: int = 0,
    select_scores: str = "input",
    fp8_rerank: int = 4,
    fp8_rerank_slots: int = 0,
) -> None:
    """paged_forward into caller buffers (PagedMSAWrapper.run): ``out``, ``lse`` and, with
    ``select``, ``block_idx`` are written; ``workspace`` (uint8, at least the planned size) is
    the call's whole device workspace, so nothing is allocated. ``q_scale``: float8 queries'
    scales (Q8KV8). ``fwd_pass``, ``fwd_chunk_tokens``, ``select_scores``, ``fp8_rerank``,
    ``fp8_rerank_slots``: as planned."""
    sel = (not dense) and select
    _run_paged_forward(q, cu_seqlens_q, k_cache, v_cache, k_idx_cache, page_table, seq_lens,
                       q_idx, None if dense else block_idx, out, lse, max_q_len, dense, sel,
                       block_size, top_k, sink_blocks, local_blocks, scale, scale_idx,
                       k_scale, v_scale, k_idx_scale, q_scale, fwd_pass, fwd_chunk_tokens,
                       select_scores, fp8_rerank, fp8_rerank_slots, check_values=check_values,
                       workspace=workspace)


@_paged_forward_into_op.register_fake
def _(q, cu_seqlens_q, k_cache, v_cache, k_idx_cache, page_table, seq_lens, q_idx, block_idx,
      out, lse, workspace, max_q_len, dense, select, block_size, top_k, sink_blocks,
      local_blocks, scale, scale_idx, check_values, k_scale=None, v_scale=None,
      k_idx_scale=None, q_scale=None, fwd_pass="auto", fwd_chunk_tokens=0, select_scores="input",
      fp8_rerank=4, fp8_rerank_slots=0):
    return None


@torch.library.custom_op("msa::paged_append", mutates_args=("k_cache", "v_cache", "k_idx_cache"))
def _paged_append_op(
    k: Optional[Tensor],
    v: Optional[Tensor],
    k_idx: Optional[Tensor],
    cu_seqlens_q: Tensor,
    k_cache: Optional[Tensor],
    v_cache: Optional[Tensor],
    k_idx_cache: Optional[Tensor],
    page_table: Tensor,
    seq_lens: Tensor,
    block_size: int,
    k_scale: Optional[Tensor] = None,
    v_scale: Optional[Tensor] = None,
    k_idx_scale: Optional[Tensor] = None,
) -> None:
    """Writes the new tokens' k, v, k_idx rows into their pages (each optional); into a
    float8_e4m3fn cache tensor quantised with its scale (contract §6)."""
    _launch(_C.paged_append, cu_seqlens_q.device, _lc(k), _lc(v), _lc(k_idx), _lc(cu_seqlens_q),
            k_cache, v_cache, k_idx_cache, _lc(page_table), _lc(seq_lens), allocates=False,
            block_size=block_size, k_scale=_lc(k_scale), v_scale=_lc(v_scale),
            k_idx_scale=_lc(k_idx_scale))


@_paged_append_op.register_fake
def _(k, v, k_idx, cu_seqlens_q, k_cache, v_cache, k_idx_cache, page_table, seq_lens,
      block_size, k_scale=None, v_scale=None, k_idx_scale=None):
    return None


# --------------------------------------------------------------------------------------------
# functions
# --------------------------------------------------------------------------------------------


def _ints(name: str, t, rank: int, shape: str) -> Tensor:
    """An int32 index tensor (other integer dtypes are converted; values outside int32 are
    refused on the CPU and clamped on CUDA, as msa._cu_seqlens does, so the library's value
    checks name them)."""
    from . import _tensor
    _tensor(name, t, rank, shape)
    if t.dtype != torch.int32:
        if t.dtype.is_floating_point or t.dtype.is_complex or t.dtype == torch.bool:
            raise ValueError(f"msa: argument '{name}': expected dtype int32, got {t.dtype}")
        info = torch.iinfo(t.dtype)
        if info.min < _INT32_MIN or info.max > _INT32_MAX:
            if t.device.type == "cpu":
                if t.numel() and (int(t.min()) < _INT32_MIN or int(t.max()) > _INT32_MAX):
                    raise ValueError(f"msa: argument '{name}': values must fit in int32")
            else:
                t = t.clamp(_INT32_MIN, _INT32_MAX)
        t = t.to(torch.int32)
    return t


def _batch(page_table, seq_lens, cu_seqlens_q):
    return (_ints("cache.page_table", page_table, 2, "[nseq, max_pages] int32"),
            _ints("cache.seq_lens", seq_lens, 1, "[nseq] int32"),
            _ints("cu_seqlens_q", cu_seqlens_q, 1, "[nseq+1] int32"))


def _opts(top_k, max_q_len, sink_blocks, local_blocks):
    from . import _int
    _int("top_k", top_k, 1, _ops._MAX_TOP_K)
    _int("max_q_len", max_q_len, 0, _MAX_Q_LEN)
    _int("sink_blocks", sink_blocks, 0)
    _int("local_blocks", local_blocks, 1)


def paged_select_blocks(
    q_idx: Tensor,
    k_idx_cache: Tensor,
    page_table: Tensor,
    seq_lens: Tensor,
    cu_seqlens_q: Tensor,
    top_k: int = 16,
    *,
    max_q_len: int = 0,
    sink_blocks: int = 0,
    local_blocks: int = 1,
    scale_idx: Optional[float] = None,
    k_idx_scale: Optional[Tensor] = None,
    select_scores: str = "input",
    fp8_rerank: int = 4,
    fp8_rerank_slots: int = 0,
) -> Tensor:
    """Selection for the new tokens (contract §2 at their positions) over the paged index keys
    ``k_idx_cache [pages, Bk, Hik, Di]`` (``Bk`` = its dim 1). Returns ``block_idx``
    [Tq, Hi, top_k] int32: ascending logical block ids, then -1. A ``torch.float8_e4m3fn``
    cache needs ``k_idx_scale`` (float32 [1] or [pages]; see :class:`PagedKVCache`).

    ``select_scores="fp8"`` (a prefill, ``max_q_len`` 0) ranks blocks by the scores of E4M3
    copies of ``q_idx`` (a scale per row) and of each page of the sequences' index keys (a scale
    per page and index key head; a float8 cache's dequantised keys), as :func:`msa.select_blocks`
    does over each block of a contiguous sequence; ``fp8_rerank`` as there: the FP8 scores
    shortlist the best (free slots + ``fp8_rerank``) blocks, which the inputs' own scores rank
    again (0: the FP8 scores decide alone), and ``fp8_rerank_slots`` (0: all) how many of the
    free slots they rank."""
    from . import _int, _scale, _tensor
    _tensor("q_idx", q_idx, 3, "[Tq, Hi, Di]")
    _tensor("cache.k_idx", k_idx_cache, 4, "[pages, Bk, Hik, Di]")
    _opts(top_k, max_q_len, sink_blocks, local_blocks)
    pt, sl, cu = _batch(page_table, seq_lens, cu_seqlens_q)
    return torch.ops.msa.paged_select_blocks(q_idx, cu, k_idx_cache, pt, sl, max_q_len, top_k,
                                             k_idx_cache.shape[1], sink_blocks, local_blocks,
                                             _scale("scale_idx", scale_idx), k_idx_scale,
                                             select_scores, _int("fp8_rerank", fp8_rerank, 0, 64),
                                             _int("fp8_rerank_slots", fp8_rerank_slots, 0, 1 << 20))


def paged_forward(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    page_table: Tensor,
    seq_lens: Tensor,
    cu_seqlens_q: Tensor,
    *,
    q_idx: Optional[Tensor] = None,
    k_idx_cache: Optional[Tensor] = None,
    block_idx: Optional[Tensor] = None,
    top_k: int = 16,
    dense: bool = False,
    max_q_len: int = 0,
    sink_blocks: int = 0,
    local_blocks: int = 1,
    scale: Optional[float] = None,
    scale_idx: Optional[float] = None,
    return_lse: bool = False,
    return_block_idx: bool = False,
    k_scale: Optional[Tensor] = None,
    v_scale: Optional[Tensor] = None,
    k_idx_scale: Optional[Tensor] = None,
    q_scale: Optional[Tensor] = None,
    out_dtype: Optional[torch.dtype] = None,
    fwd_pass: str = "auto",
    fwd_chunk_tokens: int = 0,
    select_scores: str = "input",
    fp8_rerank: int = 4,
    fp8_rerank_slots: int = 0,
):
    """Attention of the new tokens ``q [Tq, Hq, D]`` over the cache (contract §3 at their
    positions). ``torch.float8_e4m3fn`` cache tensors need their scales (float32 [1] or
    [pages]): the call computes as over the dequantised cache ``float32(value * scale[page])``,
    with ``q`` and ``out`` in q's float dtype. Over E4M3 k and v caches ``q`` may be
    ``torch.float8_e4m3fn`` too (Q8KV8) with ``q_scale`` (float32 [1] or [Tq, Hq]): the call
    computes over ``float32(value * q_scale[t, h])``, and ``out`` has ``out_dtype`` (default
    bfloat16). Sparse (default): over ``block_idx`` [Tq, Hi, k] when given, else over the
    selection computed first from ``q_idx`` and ``k_idx_cache``. ``dense=True``: dense causal
    attention over every cached key up to each token's position (the baseline). ``Bk`` is the
    cache's dim 1. ``fwd_pass``: how a sparse prefill (``max_q_len`` 0) walks its work, as
    ``msa.msa_attention``'s ("auto", "query_tile", "kv_block", "split"; the CUDA backend's
    "auto" picks the split or the query tiles on the device), and ``fwd_chunk_tokens`` the new
    tokens of one of its passes (0: as many as keep the split's partial outputs near 8 GiB; the
    call's workspace holds one pass's). ``select_scores``, ``fp8_rerank``,
    ``fp8_rerank_slots``: the scores the selection made here ranks blocks by, as in
    :func:`paged_select_blocks`. Not differentiable.

    Returns ``out`` [Tq, Hq, D] (dtype of q, or ``out_dtype``), then ``lse`` [Tq, Hq] float32
    and ``block_idx`` when asked for.
    """
    from . import _int, _scale, _tensor
    _tensor("q", q, 3, "[Tq, Hq, D]")
    _tensor("cache.k", k_cache, 4, "[pages, Bk, Hkv, D]")
    _tensor("cache.v", v_cache, 4, "[pages, Bk, Hkv, D]")
    _opts(top_k, max_q_len, sink_blocks, local_blocks)
    select = (not dense) and block_idx is None
    if select:
        _tensor("q_idx", q_idx, 3, "[Tq, Hi, Di]")
        _tensor("cache.k_idx", k_idx_cache, 4, "[pages, Bk, Hik, Di]")
    elif not dense:
        _tensor("block_idx", block_idx, 3, "[Tq, Hi, k] int32")
        top_k = block_idx.shape[2]
    pt, sl, cu = _batch(page_table, seq_lens, cu_seqlens_q)
    out, lse, bi = torch.ops.msa.paged_forward(
        q, cu, k_cache, v_cache, k_idx_cache if select else None, pt, sl,
        q_idx if select else None, None if (select or dense) else block_idx, max_q_len,
        bool(dense), select, k_cache.shape[1], top_k, sink_blocks, local_blocks,
        _scale("scale", scale), _scale("scale_idx", scale_idx), k_scale, v_scale,
        k_idx_scale if select else None, q_scale, out_dtype, fwd_pass, fwd_chunk_tokens,
        select_scores, _int("fp8_rerank", fp8_rerank, 0, 64),
        _int("fp8_rerank_slots", fp8_rerank_slots, 0, 1 << 20))
    result = (out,)
    if return_lse:
        result += (lse,)
    if return_block_idx:
        result += (bi if select else block_idx,)
    return result[0] if len(result) == 1 else result


def paged_append(
    k_cache: Optional[Tensor],
    v_cache: Optional[Tensor],
    k_idx_cache: Optional[Tensor],
    page_table: Tensor,
    seq_lens: Tensor,
    cu_seqlens_q: Tensor,
    k: Optional[Tensor] = None,
    v: Optional[Tensor] = None,
    k_idx: Optional[Tensor] = None,
    *,
    k_scale: Optional[Tensor] = None,
    v_scale: Optional[Tensor] = None,
    k_idx_scale: Optional[Tensor] = None,
) -> None:
    """Writes the new tokens' rows ``k, v [Tq, Hkv, D]`` and ``k_idx [Tq, Hik, Di]`` (each
    optional; a cache whose input is None is not touched) into their pages: new token j of
    sequence s goes to position ``seq_lens[s] - n_s + j``. Into a ``torch.float8_e4m3fn`` cache
    tensor (inputs of any float dtype) the stored code is ``e4m3(float32(x) / scale[page])``,
    rounded to nearest even and saturated to +-448; its scale is required."""
    from . import _tensor
    for name, t in (("k", k), ("v", v), ("k_idx", k_idx)):
        _tensor(name, t, 3, "[Tq, H, D]", optional=True)
    caches = [c for c in (k_cache, v_cache, k_idx_cache) if c is not None]
    if not caches:
        raise ValueError("msa: argument 'cache.k': no cache tensor given")
    for name, c in (("cache.k", k_cache), ("cache.v", v_cache), ("cache.k_idx", k_idx_cache)):
        _tensor(name, c, 4, "[pages, Bk, H, D]", optional=True)
    pt, sl, cu = _batch(page_table, seq_lens, cu_seqlens_q)
    torch.ops.msa.paged_append(k, v, k_idx, cu, k_cache if k is not None else None,
                               v_cache if v is not None else None,
                               k_idx_cache if k_idx is not None else None, pt, sl,
                               caches[0].shape[1], k_scale if k is not None else None,
                               v_scale if v is not None else None,
                               k_idx_scale if k_idx is not None else None)


# --------------------------------------------------------------------------------------------
# the cache and the plan/run wrapper
# --------------------------------------------------------------------------------------------


def _scale_of(cache, name: str) -> Optional[Tensor]:
    """A cache's scale tensor (None for float caches, and for views built without scales)."""
    return getattr(cache, name, None)


class PagedKVCache:
    """A paged KV cache for one attention layer: ``k``, ``v`` [num_pages, page_size, Hkv, D] and
    the index keys ``k_idx`` [num_pages, page_size, Hik, Di] (``page_size`` = the MSA block size
    Bk), with a free-page allocator and, per sequence, its page list and length.

    ``append(seq_ids, k, v, k_idx, new_lens)`` reserves pages, writes the rows and returns the
    batch description ``(page_table, seq_lens, cu_seqlens_q)`` of those new tokens, which the
    attention call of the same tokens takes. Pages are allocated on the host (the allocator is
    host bookkeeping); the tensors live on ``device``.

    FP8: ``dtype=torch.float8_e4m3fn`` stores K and V as E4M3 codes (``idx_dtype``, default
    ``dtype``, does the same for the index keys) with float32 scales ``k_scale``, ``v_scale``,
    ``k_idx_scale`` of shape [num_pages] (``scales="page"``) or [1] (``"tensor"``), all 1.0 at
    first: set them before the rows they scale are appended (a per-tensor scale is typically a
    calibrated amax / 448). Queries and outputs then use ``query_dtype`` (default bfloat16).
    Both backends read E4M3 caches; on the GPU, queries are bfloat16 or float16 and appended
    rows float32, bfloat16 or float16.
    """

    def __init__(self, num_pages: int, page_size: int, num_kv_heads: int, head_dim: int,
                 num_idx_heads: int = 1, idx_head_dim: Optional[int] = None,
                 dtype: torch.dtype = torch.bfloat16, device="cpu", *,
                 idx_dtype: Optional[torch.dtype] = None, scales: str = "page",
                 query_dtype: Optional[torch.dtype] = None):
        from . import _int
        _int("num_pages", num_pages, 1)
        _int("page_size", page_size, 1)
        if page_size & (page_size - 1):
            raise ValueError(f"msa: argument 'page_size': must be a power of two, got {page_size}")
        self.page_size = page_size
        self.device = torch.device(device)
        Di = head_dim if idx_head_dim is None else idx_head_dim
        if scales not in ("page", "tensor"):
            raise ValueError(f"msa: argument 'scales': expected 'page' or 'tensor', got {scales!r}")
        idx_dtype = dtype if idx_dtype is None else idx_dtype
        fp8 = torch.float8_e4m3fn
        self.query_dtype = (query_dtype if query_dtype is not None else
                            torch.bfloat16 if dtype == fp8 else dtype)
        self.k = torch.zeros((num_pages, page_size, num_kv_heads, head_dim), dtype=dtype,
                             device=self.device)
        self.v = torch.zeros_like(self.k)
        self.k_idx = torch.zeros((num_pages, page_size, num_idx_heads, Di), dtype=idx_dtype,
                                 device=self.device)
        n = num_pages if scales == "page" else 1
        one = lambda: torch.ones((n,), dtype=torch.float32, device=self.device)  # noqa: E731
        self.k_scale = one() if dtype == fp8 else None
        self.v_scale = one() if dtype == fp8 else None
        self.k_idx_scale = one() if idx_dtype == fp8 else None
        self._free: List[int] = list(range(num_pages - 1, -1, -1))  # pop() gives page 0 first
        self._pages: Dict[int, List[int]] = {}
        self._lens: Dict[int, int] = {}
        self._next_id = 0

    @property
    def num_pages(self) -> int:
        return self.k.shape[0]

    @property
    def num_free_pages(self) -> int:
        return len(self._free)

    def add_sequence(self) -> int:
        """A new empty sequence; returns its id."""
        sid = self._next_id
        self._next_id += 1
        self._pages[sid] = []
        self._lens[sid] = 0
        return sid

    def remove_sequence(self, seq_id: int) -> None:
        """Frees the sequence's pages."""
        self._free.extend(reversed(self._pages.pop(seq_id)))
        del self._lens[seq_id]

    def seq_len(self, seq_id: int) -> int:
        return self._lens[seq_id]

    def pages(self, seq_id: int) -> List[int]:
        return list(self._pages[seq_id])

    def reserve(self, seq_id: int, new_tokens: int) -> None:
        """Grows the sequence by ``new_tokens`` positions, allocating the pages they need."""
        n = self._lens[seq_id] + int(new_tokens)
        need = -(-n // self.page_size) - len(self._pages[seq_id])
        if need > len(self._free):
            raise RuntimeError(f"msa: PagedKVCache: sequence {seq_id} needs {need} more pages, "
                               f"{len(self._free)} are free")
        for _ in range(max(need, 0)):
            self._pages[seq_id].append(self._free.pop())
        self._lens[seq_id] = n

    def batch(self, seq_ids: Sequence[int], new_lens: Optional[Sequence[int]] = None,
              max_pages: Optional[int] = None) -> Tuple[Tensor, Tensor, Tensor]:
        """``(page_table [nseq, max_pages], seq_lens [nseq], cu_seqlens_q [nseq+1])``, int32 on
        the cache's device, for the sequences' current lengths with ``new_lens[s]`` new tokens
        (default 0). ``max_pages`` (default: the longest page list) pads the table with 0."""
        new_lens = [0] * len(seq_ids) if new_lens is None else [int(n) for n in new_lens]
        longest = max([len(self._pages[s]) for s in seq_ids] + [1])
        width = longest if max_pages is None else int(max_pages)
        if width < longest:
            raise ValueError(f"msa: argument 'max_pages': a sequence holds {longest} pages, "
                             f"more than max_pages = {width}")
        table = torch.zeros((len(seq_ids), width), dtype=torch.int32)
        for row, s in enumerate(seq_ids):
            pages = self._pages[s]
            if pages:
                table[row, :len(pages)] = torch.tensor(pages, dtype=torch.int32)
        lens = torch.tensor([self._lens[s] for s in seq_ids], dtype=torch.int32)
        cu = torch.zeros(len(seq_ids) + 1, dtype=torch.int32)
        if new_lens:
            cu[1:] = torch.cumsum(torch.tensor(new_lens, dtype=torch.int64), 0).to(torch.int32)
        return table.to(self.device), lens.to(self.device), cu.to(self.device)

    def append(self, seq_ids: Sequence[int], new_lens: Sequence[int], k: Optional[Tensor] = None,
               v: Optional[Tensor] = None, k_idx: Optional[Tensor] = None,
               max_pages: Optional[int] = None) -> Tuple[Tensor, Tensor, Tensor]:
        """Appends ``new_lens[s]`` tokens to each sequence (rows packed in ``seq_ids`` order in
        ``k, v [Tq, Hkv, D]``, ``k_idx [Tq, Hik, Di]``) and returns the batch description of those
        new tokens (see :meth:`batch`)."""
        if len(new_lens) != len(seq_ids):
            raise ValueError(f"msa: argument 'new_lens': expected {len(seq_ids)} counts, got "
                             f"{len(new_lens)}")
        for s, n in zip(seq_ids, new_lens):
            if int(n) < 0:
                raise ValueError(f"msa: argument 'new_lens': must be non-negative, got {n}")
        for s, n in zip(seq_ids, new_lens):
            self.reserve(s, int(n))
        table, lens, cu = self.batch(seq_ids, new_lens, max_pages)
        if k is not None or v is not None or k_idx is not None:
            paged_append(self.k, self.v, self.k_idx, table, lens, cu, k=k, v=v, k_idx=k_idx,
                         k_scale=self.k_scale, v_scale=self.v_scale,
                         k_idx_scale=self.k_idx_scale)
        return table, lens, cu


class PagedMSAWrapper:
    """MSA attention over a :class:`PagedKVCache` in FlashInfer's plan/run style.

    ``plan`` takes the batch shape once (``nseq`` sequences, ``num_tokens`` new tokens in all,
    the heads, ``max_pages`` page table columns, ``max_q_len`` and the options) and allocates the
    outputs and the device workspace. ``run`` then computes selection and attention (or dense
    attention with ``dense=True``) for new tokens whose queries, page table, lengths and
    ``cu_seqlens_q`` have those shapes; it allocates nothing, skips the value checks (no host
    wait) and returns the planned buffers, so a CUDA graph that captures it can be replayed with
    new values in the same input tensors.
    """

    def __init__(self, cache: PagedKVCache):
        self.cache = cache
        self._plan = None

    def plan(self, nseq: int, num_tokens: int, num_qo_heads: int, *, max_pages: int,
             max_q_len: int = 0, num_idx_heads: Optional[int] = None, top_k: int = 16,
             sink_blocks: int = 0, local_blocks: int = 1, scale: Optional[float] = None,
             scale_idx: Optional[float] = None, dense: bool = False, fwd_pass: str = "auto",
             fwd_chunk_tokens: int = 0, select_scores: str = "input", fp8_rerank: int = 4,
             fp8_rerank_slots: int = 0) -> None:
        """The batch shape and options (see the class); a prefill plan (``max_q_len`` 0)
        in sparse mode also sizes the workspace of the split's passes (``fwd_pass``,
        ``fwd_chunk_tokens`` as in :func:`paged_forward`): one pass's partial outputs,
        ``fwd_chunk_tokens`` bounding them, and with ``select_scores="fp8"`` that of the E4M3
        copies of its selection (:func:`paged_select_blocks`)."""
        from . import _int, _scale
        c = self.cache
        _ops._need_fwd_pass(fwd_pass)
        _ops._need_select_scores(select_scores)
        _int("fp8_rerank", fp8_rerank, 0, 64)
        _int("fp8_rerank_slots", fp8_rerank_slots, 0, 1 << 20)
        _int("fwd_chunk_tokens", fwd_chunk_tokens, 0)
        _int("nseq", nseq, 1)
        _int("num_tokens", num_tokens, 0)
        _int("num_qo_heads", num_qo_heads, 1)
        _int("max_pages", max_pages, 0)
        _opts(top_k, max_q_len, sink_blocks, local_blocks)
        Hkv, D = c.k.shape[2], c.k.shape[3]
        Hi = Hkv if num_idx_heads is None else _int("num_idx_heads", num_idx_heads, 1)
        Di = c.k_idx.shape[3]
        dev, dt = c.device, getattr(c, "query_dtype", c.k.dtype)
        self.out = torch.empty((num_tokens, num_qo_heads, D), dtype=dt, device=dev)
        self.lse = torch.empty((num_tokens, num_qo_heads), dtype=torch.float32, device=dev)
        self.block_idx = (None if dense else
                          torch.empty((num_tokens, Hi, top_k), dtype=torch.int32, device=dev))
        # The workspace depends on shapes and options only: sized from placeholders.
        q = torch.zeros((D,), dtype=dt, device=dev).expand(num_tokens, num_qo_heads, D)
        qi = torch.zeros((Di,), dtype=dt, device=dev).expand(num_tokens, Hi, Di)
        pt = torch.zeros((nseq, max_pages), dtype=torch.int32, device=dev)
        sl = torch.zeros((nseq,), dtype=torch.int32, device=dev)
        cu = torch.zeros((nseq + 1,), dtype=torch.int32, device=dev)
        scale_v, scale_idx_v = _scale("scale", scale), _scale("scale_idx", scale_idx)

        def need_for(q, q_scale=None):
            return int(_C.paged_forward_workspace_size(
                q, cu, c.k, c.v, None if dense else c.k_idx, pt, sl, self.block_idx, not dense,
                None if dense else qi, self.out, self.lse, max_q_len=max_q_len,
                mode=_ops._MODE_DENSE if dense else _ops._MODE_SPARSE, block_size=c.page_size,
                top_k=top_k, sink_blocks=sink_blocks, local_blocks=local_blocks, scale=scale_v,
                scale_idx=scale_idx_v, k_scale=_scale_of(c, "k_scale"), v_scale=_scale_of(c, "v_scale"),
                k_idx_scale=None if dense else _scale_of(c, "k_idx_scale"), q_scale=q_scale,
                fwd_pass=fwd_pass, fwd_chunk_tokens=fwd_chunk_tokens, select_scores=select_scores,
                fp8_rerank=fp8_rerank, fp8_rerank_slots=fp8_rerank_slots))

        need = need_for(q)
        if c.k.dtype == torch.float8_e4m3fn:  # run() may take FP8 queries (Q8KV8): their copy too
            q8 = torch.zeros((D,), dtype=c.k.dtype, device=dev).expand(num_tokens, num_qo_heads, D)
            qs = torch.ones((num_tokens, num_qo_heads), dtype=torch.float32, device=dev)
            need = max(need, need_for(q8, qs))
        self.workspace = torch.empty((int(need),), dtype=torch.uint8, device=dev)
        self._plan = dict(nseq=nseq, num_tokens=num_tokens, num_qo_heads=num_qo_heads,
                          max_pages=max_pages, max_q_len=max_q_len, Hi=Hi, top_k=top_k,
                          sink_blocks=sink_blocks, local_blocks=local_blocks, scale=scale_v,
                          scale_idx=scale_idx_v, dense=bool(dense), fwd_pass=fwd_pass,
                          fwd_chunk_tokens=fwd_chunk_tokens, select_scores=select_scores,
                          fp8_rerank=fp8_rerank, fp8_rerank_slots=fp8_rerank_slots)

    def run(self, q: Tensor, page_table: Tensor, seq_lens: Tensor, cu_seqlens_q: Tensor,
            q_idx: Optional[Tensor] = None,
            q_scale: Optional[Tensor] = None) -> Tuple[Tensor, Tensor, Optional[Tensor]]:
        """``(out, lse, block_idx)``: the planned buffers, written (``block_idx`` is None with
        ``dense``). Inputs must have the planned shapes; ``page_table``, ``seq_lens``,
        ``cu_seqlens_q`` int32. Their values are the caller's responsibility (no check).
        Over a float8 cache ``q`` may be ``torch.float8_e4m3fn`` with ``q_scale`` (float32 [1]
        or [Tq, Hq]; Q8KV8), the outputs keeping the planned dtype."""
        p = self._plan
        if p is None:
            raise RuntimeError("msa: PagedMSAWrapper.run before plan")
        want = {"q": (q, (p["num_tokens"], p["num_qo_heads"], self.out.shape[2])),
                "cache.page_table": (page_table, (p["nseq"], p["max_pages"])),
                "cache.seq_lens": (seq_lens, (p["nseq"],)),
                "cu_seqlens_q": (cu_seqlens_q, (p["nseq"] + 1,))}
        if not p["dense"]:
            want["q_idx"] = (q_idx, (p["num_tokens"], p["Hi"], self.cache.k_idx.shape[3]))
        for name, (t, shape) in want.items():
            if t is None or tuple(t.shape) != shape:
                got = None if t is None else tuple(t.shape)
                raise ValueError(f"msa: argument '{name}': expected the planned shape {shape}, "
                                 f"got {got}")
        c = self.cache
        torch.ops.msa.paged_forward_into(
            q, cu_seqlens_q, c.k, c.v, None if p["dense"] else c.k_idx, page_table, seq_lens,
            None if p["dense"] else q_idx, self.block_idx, self.out, self.lse, self.workspace,
            p["max_q_len"], p["dense"], not p["dense"], c.page_size, p["top_k"],
            p["sink_blocks"], p["local_blocks"], p["scale"], p["scale_idx"], False,
            _scale_of(c, "k_scale"), _scale_of(c, "v_scale"),
            None if p["dense"] else _scale_of(c, "k_idx_scale"), q_scale, p["fwd_pass"],
            p["fwd_chunk_tokens"], p["select_scores"], p["fp8_rerank"], p["fp8_rerank_slots"])
        return self.out, self.lse, self.block_idx
