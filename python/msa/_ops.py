"""torch.library custom ops over the msa._C binding (namespace ``msa``).

Every op allocates its outputs, hands the tensors to the C++ library through DLPack and runs
on the current CUDA stream for CUDA tensors. Fake (meta) kernels give shapes and dtypes only,
so the ops trace under torch.compile. ``msa::forward`` is differentiable (see
``_forward_backward``); the other ops are not.

CUDA path: the call runs with the tensors' device current and passes that device's current
stream (so it is ordered after the producers of the inputs, works on any torch.cuda.Stream and
under CUDA-graph capture); device workspace comes from torch's caching allocator. Nothing here
reads a device value on the host (no .item(), .cpu(), .tolist()). The library checks the values
of ``cu_seqlens`` and of a caller's ``block_idx`` (``check_values``, msa::Launch): on the CPU
that is free; on CUDA it waits for a small check kernel, so it is off while the current stream
is being captured into a CUDA graph, and in the autograd backward, whose saved tensors the
forward already checked (torch's version counters refuse saved tensors changed in place since).
A check that passed is remembered: a later call with the same ``cu_seqlens`` (and ``block_idx``)
objects, unchanged since by their version counters, for the same token count and block size,
skips it, so a model whose layers share one ``cu_seqlens`` waits once per step, not per layer.

Layout rule: the C++ API accepts any strides as long as the last dimension is contiguous, so an
input is copied only when its last-dim stride is not 1.
"""

import collections
import weakref
from typing import Optional, Tuple

import torch
from torch import Tensor

from . import _C

__all__ = ["select_blocks", "forward", "backward", "kl_divergence"]

_MODE_SPARSE = 0
_MODE_DENSE = 1


def _lc(t: Optional[Tensor]) -> Optional[Tensor]:
    """Detached view of ``t`` whose last dimension is contiguous (a copy only if needed)."""
    if t is None:
        return None
    t = t.detach()
    if t.dim() > 0 and t.shape[-1] > 1 and t.stride(-1) != 1:
        t = t.contiguous()
    return t


def _alloc(device: torch.device):
    return lambda nbytes: torch.empty(int(nbytes), dtype=torch.uint8, device=device)


# Whether CUDA calls check the values of cu_seqlens and block_idx (msa.value_checks).
_value_checks = True


# CUDA value checks that passed, most recent last: key -> weak references to its tensors.
_checked: "collections.OrderedDict[tuple, tuple]" = collections.OrderedDict()
_CHECKED_MAX = 16


def _value_key(tensors, *meta) -> Optional[tuple]:
    """What a value check of ``tensors`` (cu_seqlens, and block_idx or None) for ``meta`` (the
    op's token count, block size) depends on: each tensor's identity, version counter, data
    pointer, shape and strides; None where one has no version counter (an inference tensor,
    checked every time). Callers keep the tensors alive while the key is in use."""
    if any(t is not None and t.is_inference() for t in tensors):
        return None
    return tuple(None if t is None else
                 (id(t), t._version, t.data_ptr(), tuple(t.shape), t.stride()) for t in tensors
                 ) + meta, tuple(tensors)


def _was_checked(key) -> bool:
    k, tensors = key
    refs = _checked.get(k)
    if refs is None or any(r() is not t for r, t in zip(refs, tensors) if t is not None):
        return False
    _checked.move_to_end(k)
    return True


def _remember_checked(key) -> None:
    k, tensors = key
    _checked[k] = tuple(weakref.ref(t) for t in tensors if t is not None)
    _checked.move_to_end(k)
    while len(_checked) > _CHECKED_MAX:
        _checked.popitem(last=False)


def _launch(fn, device: torch.device, *args, check_values: bool = True,
            workspace: Optional[Tensor] = None, allocates: bool = True,
            values: Optional[tuple] = None, **kwargs):
    """Calls the binding function ``fn`` for tensors on ``device``: on the CPU directly; for
    CUDA with ``device`` current and its current stream. ``check_values`` (CUDA only; the CPU
    always checks, for free) is turned off while that stream is being captured, where
    msa.value_checks(False) is in force, and where ``values`` (the arguments of ``_value_key``:
    the tensors the call checks, its token count and block size; the key is made only when the
    call would check) name tensors a check passed for before. Device workspace comes from the
    torch allocator, or is ``workspace`` when given (the call's whole workspace: nothing is
    allocated); ``allocates=False`` for calls that take no workspace at all."""
    extra = {}
    if allocates:
        extra = ({"workspace": workspace, "workspace_alloc": None} if workspace is not None
                 else {"workspace_alloc": _alloc(device)})
    if device.type != "cuda":
        return fn(*args, stream=0, check_values=True, **extra, **kwargs)
    with torch.cuda.device(device):
        check = (bool(check_values) and _value_checks
                 and not torch.cuda.is_current_stream_capturing())
        key = _value_key(*values) if check and values is not None else None
        if key is not None and _was_checked(key):
            check = False
        result = fn(*args, stream=torch.cuda.current_stream(device).cuda_stream,
                    check_values=check, **extra, **kwargs)
        if check and key is not None:
            _remember_checked(key)
        return result


def _need_rank(name: str, t: Optional[Tensor], rank: int, shape: str) -> None:
    if t is None:
        raise ValueError(f"msa: argument '{name}': required but not given (expected {shape})")
    if not isinstance(t, Tensor):
        raise ValueError(f"msa: argument '{name}': expected a torch.Tensor, got {type(t).__name__}")
    if t.dim() != rank:
        raise ValueError(
            f"msa: argument '{name}': expected rank {rank} {shape}, got shape {tuple(t.shape)}")


_INT32_MAX = 2**31 - 1
_MAX_TOP_K = 2**20  # the library's limit on top_k and on block_idx's k


def _need_int(name: str, value: int, lo: int, hi: int = _INT32_MAX) -> None:
    """Checked here where the op allocates by the value (top_k); the binding refuses any other
    int outside int32 by name, and the library checks what the values mean."""
    if value < lo or value > hi:
        raise ValueError(f"msa: argument '{name}': must be in [{lo}, {hi}], got {value}")


_KL_PASSES = ("auto", "fused", "separate", "teacher")


_FWD_PASSES = ("auto", "query_tile", "kv_block", "split")
_DQ_PASSES = ("auto", "query_tile", "from_ds")
_SELECT_SCORES = ("input", "fp8")


def _need_fwd_pass(fwd_pass: str) -> None:
    if fwd_pass not in _FWD_PASSES:
        raise ValueError(f"msa: argument 'fwd_pass': expected 'auto', 'query_tile', "
                         f"'kv_block' or 'split', got {fwd_pass!r}")


def _need_dq_pass(dq_pass: str) -> None:
    if dq_pass not in _DQ_PASSES:
        raise ValueError(f"msa: argument 'dq_pass': expected 'auto', 'query_tile' or "
                         f"'from_ds', got {dq_pass!r}")


def _need_select_scores(select_scores: str) -> None:
    if select_scores not in _SELECT_SCORES:
        raise ValueError(f"msa: argument 'select_scores': expected 'input' or 'fp8', got "
                         f"{select_scores!r}")


def _need_kl_pass(kl_pass: str) -> None:
    if kl_pass not in _KL_PASSES:
        raise ValueError(f"msa: argument 'kl_pass': expected 'auto', 'fused', 'separate' or "
                         f"'teacher', "
                         f"got {kl_pass!r}")


def _empty(dtype: torch.dtype, device: torch.device) -> Tensor:
    return torch.empty((0,), dtype=dtype, device=device)


# --------------------------------------------------------------------------------------------
# msa::select_blocks
# --------------------------------------------------------------------------------------------


@torch.library.custom_op("msa::select_blocks", mutates_args=())
def select_blocks(
    q_idx: Tensor,
    k_idx: Tensor,
    cu_seqlens: Optional[Tensor],
    top_k: int,
    block_size: int,
    sink_blocks: int,
    local_blocks: int,
    scale_idx: float,
    select_scores: str = "input",
    fp8_rerank: int = 4,
    cu_seqlens_k: Optional[Tensor] = None,
    fp8_rerank_slots: int = 0,
) -> Tensor:
    """block_idx [T, Hi, top_k] int32: ascending selected block ids, then -1 (docs/contract.md §2).
    ``select_scores``: "input" or "fp8" (Options.select_scores); ``fp8_rerank``,
    ``fp8_rerank_slots``: Options.fp8_rerank, Options.fp8_rerank_slots.
    ``cu_seqlens_k``: keys apart from queries (k_idx [Tk, Hik, Di]; msa/params.h, contract §1)."""
    _need_select_scores(select_scores)
    _need_rank("q_idx", q_idx, 3, "[T, Hi, Di]")
    _need_int("top_k", top_k, 1, _MAX_TOP_K)
    block_idx = torch.empty((q_idx.shape[0], q_idx.shape[1], top_k), dtype=torch.int32,
                            device=q_idx.device)
    _launch(_C.select_blocks, q_idx.device, _lc(q_idx), _lc(k_idx), _lc(cu_seqlens), block_idx,
            None, block_size=block_size, top_k=top_k, sink_blocks=sink_blocks,
            local_blocks=local_blocks, scale_idx=scale_idx, select_scores=select_scores,
            fp8_rerank=fp8_rerank, cu_seqlens_k=_lc(cu_seqlens_k), fp8_rerank_slots=fp8_rerank_slots,
            values=((cu_seqlens, None), q_idx.shape[0], block_size))
    return block_idx


@select_blocks.register_fake
def _(q_idx, k_idx, cu_seqlens, top_k, block_size, sink_blocks, local_blocks, scale_idx,
      select_scores="input", fp8_rerank=4, cu_seqlens_k=None, fp8_rerank_slots=0):
    _need_select_scores(select_scores)
    return q_idx.new_empty((q_idx.shape[0], q_idx.shape[1], top_k), dtype=torch.int32)


# --------------------------------------------------------------------------------------------
# msa::forward
# --------------------------------------------------------------------------------------------


def _forward_impl(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    q_idx: Optional[Tensor],
    k_idx: Optional[Tensor],
    block_idx: Optional[Tensor],
    cu_seqlens: Optional[Tensor],
    dense: bool,
    select: bool,
    block_size: int,
    top_k: int,
    sink_blocks: int,
    local_blocks: int,
    scale: float,
    scale_idx: float,
    want_kl: bool,
    deterministic: bool,
    kl_pass: str = "auto",
    fwd_pass: str = "auto",
    select_scores: str = "input",
    fp8_rerank: int = 4,
    dq_pass: str = "auto",
    bwd_chunk_tokens: int = 0,
    fwd_chunk_tokens: int = 0,
    cu_seqlens_k: Optional[Tensor] = None,
    fp8_rerank_slots: int = 0,
) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    """(out [T, Hq, D] dtype of q, lse [T, Hq] fp32, block_idx, kl 0-dim fp32).

    ``block_idx`` (output) is the selection written by this call, [T, Hi, top_k] int32, when
    ``select`` is set in sparse mode, else an empty [0] int32 tensor. ``kl`` is the exact KL
    value when ``want_kl`` is set, else 0. ``kl_pass`` is for the autograd backward (see
    ``msa::backward``); it is checked here. ``fwd_pass``: how the sparse forward walks its work
    (Options.fwd_pass: "auto", "query_tile", "kv_block" or "split"). ``select_scores``: the scores a
    selection made here ranks blocks by (Options.select_scores: "input" or "fp8"), and
    ``fp8_rerank`` how many FP8-scored candidates beyond the free slots the inputs' scores rank
    again (Options.fp8_rerank; ``fp8_rerank_slots``: Options.fp8_rerank_slots). ``dq_pass`` and ``bwd_chunk_tokens`` are for the autograd
    backward (see ``msa::backward``); they are checked here. ``fwd_chunk_tokens``: the tokens
    of one pass of the KV-block forward (Options.fwd_chunk_tokens). ``cu_seqlens_k``: keys apart
    from queries (k, v, k_idx with Tk rows; msa/params.h, contract §1).
    """
    _need_kl_pass(kl_pass)
    _need_fwd_pass(fwd_pass)
    _need_select_scores(select_scores)
    _need_dq_pass(dq_pass)
    _need_int("bwd_chunk_tokens", bwd_chunk_tokens, 0)
    _need_int("fwd_chunk_tokens", fwd_chunk_tokens, 0)
    _need_rank("q", q, 3, "[T, Hq, D]")
    T, Hq, _ = q.shape
    dev = q.device
    sel = (not dense) and select
    if sel:
        _need_rank("q_idx", q_idx, 3, "[T, Hi, Di]")
        _need_int("top_k", top_k, 1, _MAX_TOP_K)
        bi_out = torch.empty((T, q_idx.shape[1], top_k), dtype=torch.int32, device=dev)
        bi = bi_out
    else:
        bi_out = _empty(torch.int32, dev)
        bi = None if dense else _lc(block_idx)
        if not dense and bi is None:
            raise ValueError("msa: argument 'block_idx': required in sparse mode when select "
                             "is not set")
    if want_kl and (q_idx is None or k_idx is None):
        raise ValueError("msa: argument 'q_idx': the KL value needs q_idx and k_idx")
    out = torch.empty(q.shape, dtype=q.dtype, device=dev)
    lse = torch.empty((T, Hq), dtype=torch.float32, device=dev)
    kl = torch.zeros((), dtype=torch.float32, device=dev)
    _launch(_C.forward, dev, _lc(q), _lc(k), _lc(v), _lc(cu_seqlens), bi, sel, _lc(q_idx),
            _lc(k_idx), out, lse, kl.view(1) if want_kl else None,
            mode=_MODE_DENSE if dense else _MODE_SPARSE, block_size=block_size,
            top_k=top_k, sink_blocks=sink_blocks, local_blocks=local_blocks, scale=scale,
            scale_idx=scale_idx, deterministic=deterministic, fwd_pass=fwd_pass,
            fwd_chunk_tokens=fwd_chunk_tokens, select_scores=select_scores, fp8_rerank=fp8_rerank,
            cu_seqlens_k=_lc(cu_seqlens_k), fp8_rerank_slots=fp8_rerank_slots,
            values=((cu_seqlens, None if sel or dense else block_idx), T, block_size))
    return out, lse, bi_out, kl


forward = torch.library.custom_op("msa::forward", mutates_args=())(_forward_impl)


@forward.register_fake
def _(q, k, v, q_idx, k_idx, block_idx, cu_seqlens, dense, select, block_size, top_k,
      sink_blocks, local_blocks, scale, scale_idx, want_kl, deterministic, kl_pass="auto",
      fwd_pass="auto", select_scores="input", fp8_rerank=4, dq_pass="auto", bwd_chunk_tokens=0,
      fwd_chunk_tokens=0, cu_seqlens_k=None, fp8_rerank_slots=0):
    _need_kl_pass(kl_pass)
    _need_fwd_pass(fwd_pass)
    _need_select_scores(select_scores)
    _need_dq_pass(dq_pass)
    _need_int("bwd_chunk_tokens", bwd_chunk_tokens, 0)
    _need_int("fwd_chunk_tokens", fwd_chunk_tokens, 0)
    T, Hq, D = q.shape
    out = q.new_empty((T, Hq, D))
    lse = q.new_empty((T, Hq), dtype=torch.float32)
    if (not dense) and select:
        bi = q.new_empty((T, q_idx.shape[1], top_k), dtype=torch.int32)
    else:
        bi = q.new_empty((0,), dtype=torch.int32)
    kl = q.new_empty((), dtype=torch.float32)
    return out, lse, bi, kl


# --------------------------------------------------------------------------------------------
# msa::backward
# --------------------------------------------------------------------------------------------


def _backward_impl(
    dout: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    q_idx: Optional[Tensor],
    k_idx: Optional[Tensor],
    block_idx: Optional[Tensor],
    cu_seqlens: Optional[Tensor],
    kl_grad: Optional[Tensor],
    dense: bool,
    block_size: int,
    scale: float,
    scale_idx: float,
    want_dq_idx: bool,
    want_dk_idx: bool,
    deterministic: bool,
    kl_pass: str = "auto",
    check_values: bool = True,
    dq_pass: str = "auto",
    bwd_chunk_tokens: int = 0,
    cu_seqlens_k: Optional[Tensor] = None,
) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """(dq, dk, dv, dq_idx, dk_idx).

    dq, dk, dv come from ``dout``; dq_idx, dk_idx ([T, Hi, Di], [T, Hik, Di], or empty [0]
    tensors when not wanted) come from the KL with gamma = kl_grad[0] (``kl_grad``: fp32 [1] on
    the tensors' device, so no host sync; None means gamma = 1). ``kl_pass``: how the KL
    gradient is computed, "auto" | "fused" | "separate" | "teacher" (msa::KlPass; the CPU
    backend takes them all alike). ``check_values``: whether the CUDA backend checks the values of
    ``cu_seqlens`` and ``block_idx`` first (a host wait; the CPU always checks). ``dq_pass``: how
    the sparse backward computes dq, "auto" | "query_tile" | "from_ds" (msa::DqPass), and
    ``bwd_chunk_tokens`` the tokens of one of its passes with "from_ds" (0: the backend's
    choice). ``cu_seqlens_k``: keys apart from queries (dk, dv, dk_idx then have the Tk rows of
    k, v, k_idx).
    """
    _need_kl_pass(kl_pass)
    _need_dq_pass(dq_pass)
    _need_int("bwd_chunk_tokens", bwd_chunk_tokens, 0)
    _need_rank("q", q, 3, "[T, Hq, D]")
    _need_rank("k", k, 3, "[T, Hkv, D]")
    dev = q.device
    dq = torch.empty(q.shape, dtype=q.dtype, device=dev)
    dk = torch.empty(k.shape, dtype=q.dtype, device=dev)
    dv = torch.empty(k.shape, dtype=q.dtype, device=dev)
    want_idx = want_dq_idx or want_dk_idx
    if want_idx:
        _need_rank("q_idx", q_idx, 3, "[T, Hi, Di]")
        _need_rank("k_idx", k_idx, 3, "[T, Hik, Di]")
    dq_idx = (torch.empty(q_idx.shape, dtype=q_idx.dtype, device=dev) if want_dq_idx
              else _empty(q.dtype, dev))
    dk_idx = (torch.empty(k_idx.shape, dtype=k_idx.dtype, device=dev) if want_dk_idx
              else _empty(q.dtype, dev))
    if kl_grad is not None and want_idx:
        kl_grad = kl_grad.detach().reshape(1).to(dtype=torch.float32, device=dev)
    _launch(_C.backward, dev, _lc(q), _lc(k), _lc(v), _lc(out), _lc(lse), _lc(dout),
            _lc(cu_seqlens), None if dense else _lc(block_idx), dq, dk, dv,
            _lc(q_idx) if want_idx else None, _lc(k_idx) if want_idx else None,
            dq_idx if want_dq_idx else None, dk_idx if want_dk_idx else None,
            kl_grad if want_idx else None, kl_weight=1.0,
            mode=_MODE_DENSE if dense else _MODE_SPARSE, block_size=block_size,
            scale=scale, scale_idx=scale_idx, deterministic=deterministic, kl_pass=kl_pass,
            dq_pass=dq_pass, bwd_chunk_tokens=bwd_chunk_tokens, check_values=check_values,
            cu_seqlens_k=_lc(cu_seqlens_k), values=((cu_seqlens, None if dense else block_idx), q.shape[0], block_size))
    return dq, dk, dv, dq_idx, dk_idx


backward = torch.library.custom_op("msa::backward", mutates_args=())(_backward_impl)


@backward.register_fake
def _(dout, q, k, v, out, lse, q_idx, k_idx, block_idx, cu_seqlens, kl_grad, dense,
      block_size, scale, scale_idx, want_dq_idx, want_dk_idx, deterministic, kl_pass="auto",
      check_values=True, dq_pass="auto", bwd_chunk_tokens=0, cu_seqlens_k=None):
    _need_kl_pass(kl_pass)
    _need_dq_pass(dq_pass)
    _need_int("bwd_chunk_tokens", bwd_chunk_tokens, 0)
    dq = q.new_empty(q.shape)
    dk = q.new_empty(k.shape)
    dv = q.new_empty(k.shape)
    dq_idx = q_idx.new_empty(q_idx.shape) if want_dq_idx else q.new_empty((0,))
    dk_idx = k_idx.new_empty(k_idx.shape) if want_dk_idx else q.new_empty((0,))
    return dq, dk, dv, dq_idx, dk_idx


# --------------------------------------------------------------------------------------------
# msa::kl_divergence
# --------------------------------------------------------------------------------------------


@torch.library.custom_op("msa::kl_divergence", mutates_args=())
def kl_divergence(
    q: Tensor,
    k: Tensor,
    lse: Tensor,
    q_idx: Tensor,
    k_idx: Tensor,
    block_idx: Optional[Tensor],
    cu_seqlens: Optional[Tensor],
    dense: bool,
    block_size: int,
    scale: float,
    scale_idx: float,
    cu_seqlens_k: Optional[Tensor] = None,
) -> Tuple[Tensor, Tensor]:
    """(kl 0-dim fp32, kl_rows [T, Hi] fp32): the exact KL loss (docs/contract.md §4) and its
    unnormalised per-(token, index head) terms, from the forward's LSE. ``cu_seqlens_k``: keys
    apart from queries (k, k_idx with Tk rows)."""
    _need_rank("q_idx", q_idx, 3, "[T, Hi, Di]")
    dev = q.device
    kl = torch.zeros((), dtype=torch.float32, device=dev)
    kl_rows = torch.empty((q_idx.shape[0], q_idx.shape[1]), dtype=torch.float32, device=dev)
    if not dense and block_idx is None:
        raise ValueError("msa: argument 'block_idx': required in sparse mode")
    _launch(_C.kl_divergence, dev, _lc(q), _lc(k), _lc(lse), _lc(q_idx), _lc(k_idx),
            _lc(cu_seqlens), None if dense else _lc(block_idx), kl.view(1), kl_rows,
            mode=_MODE_DENSE if dense else _MODE_SPARSE, block_size=block_size,
            scale=scale, scale_idx=scale_idx, cu_seqlens_k=_lc(cu_seqlens_k),
            values=((cu_seqlens, None if dense else block_idx), q.shape[0], block_size))
    return kl, kl_rows


@kl_divergence.register_fake
def _(q, k, lse, q_idx, k_idx, block_idx, cu_seqlens, dense, block_size, scale, scale_idx,
      cu_seqlens_k=None):
    return (q.new_empty((), dtype=torch.float32),
            q.new_empty((q_idx.shape[0], q_idx.shape[1]), dtype=torch.float32))


# --------------------------------------------------------------------------------------------
# Autograd of msa::forward
# --------------------------------------------------------------------------------------------
#
# out -> q, k, v (attention backward restricted to the support); kl -> q_idx, k_idx with
# gamma = the incoming gradient of kl (the teacher is detached, so kl gives nothing to q, k, v;
# the selection is not differentiable, nor is lse).


def _forward_setup_context(ctx, inputs, output):
    (q, k, v, q_idx, k_idx, block_idx, cu_seqlens, dense, select, block_size, top_k,
     sink_blocks, local_blocks, scale, scale_idx, want_kl, deterministic) = inputs[:17]
    kl_pass = inputs[17] if len(inputs) > 17 else "auto"
    dq_pass = inputs[21] if len(inputs) > 21 else "auto"
    bwd_chunk_tokens = inputs[22] if len(inputs) > 22 else 0
    cu_seqlens_k = inputs[24] if len(inputs) > 24 else None
    out, lse, bi_out, kl = output
    support = None if dense else (bi_out if select else block_idx)
    ctx.save_for_backward(q, k, v, q_idx, k_idx, support, cu_seqlens, out, lse, cu_seqlens_k)
    ctx.dense = dense
    ctx.block_size = block_size
    ctx.scale = scale
    ctx.scale_idx = scale_idx
    ctx.deterministic = deterministic
    ctx.kl_pass = kl_pass
    ctx.dq_pass = dq_pass
    ctx.bwd_chunk_tokens = bwd_chunk_tokens
    ctx.num_inputs = len(inputs)
    ctx.has_idx = q_idx is not None and k_idx is not None
    ctx.mark_non_differentiable(lse, bi_out)
    ctx.set_materialize_grads(False)
    ctx.eager = False


def _forward_backward(ctx, grad_out, grad_lse, grad_bi, grad_kl):
    q, k, v, q_idx, k_idx, support, cu_seqlens, out, lse, cu_seqlens_k = ctx.saved_tensors
    needs = ctx.needs_input_grad
    want_dq_idx = ctx.has_idx and grad_kl is not None and needs[3]
    want_dk_idx = ctx.has_idx and grad_kl is not None and needs[4]
    want_main = needs[0] or needs[1] or needs[2]
    if not (want_main or want_dq_idx or want_dk_idx):
        return (None,) * ctx.num_inputs
    if grad_out is None:
        grad_out = torch.zeros_like(out)
    kl_grad = grad_kl.reshape(1).float() if (want_dq_idx or want_dk_idx) else None
    # CUDA: the forward checked the values of these saved tensors, so the backward skips the
    # check and its host wait (the CPU checks anyway, for free).
    dq, dk, dv, dq_idx, dk_idx = (_backward_impl if ctx.eager else backward)(
        grad_out, q, k, v, out, lse, q_idx, k_idx, support, cu_seqlens, kl_grad, ctx.dense,
        ctx.block_size, ctx.scale, ctx.scale_idx, want_dq_idx, want_dk_idx, ctx.deterministic,
        kl_pass=ctx.kl_pass, check_values=q.device.type != "cuda", dq_pass=ctx.dq_pass,
        bwd_chunk_tokens=ctx.bwd_chunk_tokens, cu_seqlens_k=cu_seqlens_k)
    return (dq if needs[0] else None, dk if needs[1] else None, dv if needs[2] else None,
            dq_idx if want_dq_idx else None, dk_idx if want_dk_idx else None) + (None,) * (ctx.num_inputs - 5)


torch.library.register_autograd("msa::forward", _forward_backward,
                                setup_context=_forward_setup_context)


# --------------------------------------------------------------------------------------------
# The eager route of msa::forward
# --------------------------------------------------------------------------------------------
#
# Through torch.library a call pays the dispatcher and the op's Python autograd wrapper
# (defaults filled in, the schema's aliasing checked), and in the backward the same again for
# msa::backward: host time a model with many layers or short sequences waits for (docs/perf.md,
# 2026-12-04: a 16K training step's host time 2.77 -> 2.53 ms). Outside torch.compile,
# with plain tensors and no torch function/dispatch mode or functorch transform active, the
# forward and its backward run as a torch.autograd.Function over the same implementations
# (same checks, same kernels, same saved tensors); anything else goes through the op.


class _ForwardFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, *inputs):
        output = _forward_impl(*inputs)
        _forward_setup_context(ctx, inputs, output)
        ctx.eager = True
        return output

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, *grads):
        return _forward_backward(ctx, *grads)


_PLAIN = (Tensor, torch.nn.Parameter)
_EAGER_DEVICES = ("cpu", "cuda")


def _plain_eager(tensors) -> bool:
    """Whether a call on ``tensors`` may skip the torch.library dispatch (see above)."""
    if (torch.compiler.is_compiling() or torch._C._is_torch_function_mode_enabled()
            or torch._C._len_torch_dispatch_stack() > 0
            or torch._C._functorch.peek_interpreter_stack() is not None):
        return False
    return all(t is None or (type(t) in _PLAIN and t.device.type in _EAGER_DEVICES)
               for t in tensors)


def forward_call(*inputs) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    """msa::forward's outputs for ``inputs`` (its arguments in order), with its autograd: the
    eager route where it may run, the op otherwise."""
    if _plain_eager(inputs[:7]):
        return _ForwardFunction.apply(*inputs)
    return forward(*inputs)
