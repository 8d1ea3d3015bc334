"""MSA: MiniMax Sparse Attention (block-sparse attention whose blocks an index branch selects,
with a KL loss that trains the index branch).

Layout (FlashAttention-style packed tokens, contract §1):

* ``q`` [T, Hq, D], ``k``, ``v`` [T, Hkv, D] (GQA: Hkv divides Hq);
* ``q_idx`` [T, Hi, Di] (index queries; Hi a multiple of Hkv that divides Hq; index head ``i``
  serves query heads ``[i*Hq/Hi, (i+1)*Hq/Hi)``), ``k_idx`` [T, Hik, Di] (Hik divides Hi);
* ``cu_seqlens`` int32 [nseq+1], cumulative sequence offsets (None: one sequence of T tokens).
  Nothing crosses a sequence boundary; positions and blocks are counted inside each sequence.
* ``cu_seqlens_k`` int32 [nseq+1] (optional): keys apart from queries. ``k``, ``v``, ``k_idx``
  then hold ``Tk`` rows packed by these offsets, and each sequence's ``n_s`` queries are the
  last ``n_s`` positions of its ``m_s >= n_s`` keys (causal attention aligned to the bottom
  right, as FlashAttention aligns it): a chunk of queries after a prefix of keys, or a
  context-parallel rank's queries over the keys it gathered (contract §1). Both backends run
  it.

Dtypes: float16 / bfloat16 (float32, and float64 on the CPU, for tests); every tensor of a call
shares q's dtype and device. Any strides are accepted; a tensor whose last dimension is not
contiguous is copied first. LSE and the KL value are float32.

Devices: CPU tensors run on the C++ CPU backend; CUDA tensors on the Hopper backend when
``backend_available("cuda")``, on the current stream of their device, without host
synchronisation (CUDA graphs can capture the calls). Both backends run everything here: the
selection, the forward, the exact KL value and the backward (with the KL gradient); the CUDA
KL kernels need ``Di == D``.

Entry points: :func:`sparse_attention` (training forward with autograd), :func:`warmup_attention`
(dense causal + KL, the indexer warmup phase), :func:`select_blocks`, :func:`kl_divergence`.
``msa.flash_msa`` holds drop-in twins of the flash-msa API. The underlying torch.library ops
are ``torch.ops.msa.{select_blocks, forward, backward, kl_divergence}``.
"""

import contextlib
from typing import Optional

import torch
from torch import Tensor

from . import _C
from . import _ops  # noqa: F401  (registers torch.ops.msa.*)

__version__ = "0.1.0"

__all__ = [
    "sparse_attention",
    "value_checks",
    "warmup_attention",
    "select_blocks",
    "kl_divergence",
    "version",
    "backend_available",
]


@contextlib.contextmanager
def value_checks(enabled: bool):
    """Turns the CUDA value checks of ``cu_seqlens`` and of a caller's ``block_idx`` on or off
    inside a ``with`` block (on by default). A checked CUDA call waits for a small check
    kernel (one stream synchronisation); the same tensor objects, unchanged since by torch's
    version counters, are not checked again for the same token count and block size, so the
    layers of a model that share one ``cu_seqlens`` wait once. With the checks off, malformed
    values give unspecified results, though never an access outside the tensors. Calls captured
    into a CUDA graph are never checked. The CPU backend always checks."""
    previous = _ops._value_checks
    _ops._value_checks = bool(enabled)
    try:
        yield
    finally:
        _ops._value_checks = previous


def version() -> str:
    """Version string of the C++ library (libmsa)."""
    return _C.version()


def backend_available(device_type: str) -> bool:
    """Whether libmsa was built with a backend for ``device_type`` ('cpu' or 'cuda')."""
    return _C.backend_available(device_type)


# --------------------------------------------------------------------------------------------
# argument helpers
# --------------------------------------------------------------------------------------------


_INT32_MIN, _INT32_MAX = -(2**31), 2**31 - 1
_MAX_TOP_K = 2**20  # the library's limit on top_k (and on block_idx's k)


def _int(name: str, value, lo: int, hi: int = _INT32_MAX) -> int:
    """An int argument in [lo, hi] (the library's options are 32-bit)."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"msa: argument '{name}': expected an int, got {type(value).__name__}")
    if value < lo or value > hi:
        raise ValueError(f"msa: argument '{name}': must be in [{lo}, {hi}], got {value}")
    return value


def _kl_pass(value) -> str:
    if value not in ("auto", "fused", "separate", "teacher"):
        raise ValueError(f"msa: argument 'kl_pass': expected 'auto', 'fused', 'separate' or "
                         f"'teacher', "
                         f"got {value!r}")
    return value


def _scale(name: str, value) -> float:
    """None -> 0.0, which the C++ API resolves to head_dim**-0.5."""
    if value is None:
        return 0.0
    value = float(value)
    if value == 0.0 or value != value or value in (float("inf"), float("-inf")):
        raise ValueError(f"msa: argument '{name}': must be a finite non-zero float or None "
                         f"(None means head_dim**-0.5), got {value}")
    return value


def _tensor(name: str, t, rank: int, shape: str, optional: bool = False) -> Optional[Tensor]:
    if t is None:
        if optional:
            return None
        raise ValueError(f"msa: argument '{name}': required, expected a tensor {shape}")
    if not isinstance(t, Tensor):
        raise ValueError(f"msa: argument '{name}': expected a torch.Tensor {shape}, got "
                         f"{type(t).__name__}")
    if t.dim() != rank:
        raise ValueError(f"msa: argument '{name}': expected rank {rank} {shape}, got shape "
                         f"{tuple(t.shape)}")
    return t


def _cu_seqlens(cu, device: torch.device, name: str = "cu_seqlens") -> Optional[Tensor]:
    """cu_seqlens as int32. Other integer dtypes are converted; values outside int32 must not
    wrap around (a plain cast turns [0, 2**32 + 20, 40] into [0, 20, 40]):

    * on the CPU they are refused here, naming 'cu_seqlens';
    * on CUDA, reading them would synchronise the host, so they are clamped to the int32 range
      on the device instead. A clamped value (2**31 - 1 or -2**31) can never be a valid offset
      (T < 2**31 - 1 for any real tensor), so the library's value check of cu_seqlens
      (msa::Launch::check_values) reports the array as not starting at 0, decreasing, or not
      ending at T, naming 'cu_seqlens'; with checks off, the kernels clamp offsets to [0, T].
    """
    if cu is None:
        return None
    _tensor(name, cu, 1, "[nseq+1] int32")
    if cu.dtype != torch.int32:
        if cu.dtype.is_floating_point or cu.dtype.is_complex or cu.dtype == torch.bool:
            raise ValueError(f"msa: argument '{name}': expected dtype int32, got {cu.dtype}")
        info = torch.iinfo(cu.dtype)
        if info.min < _INT32_MIN or info.max > _INT32_MAX:
            if cu.device.type == "cpu":
                if cu.numel() and (int(cu.min()) < _INT32_MIN or int(cu.max()) > _INT32_MAX):
                    raise ValueError(
                        f"msa: argument '{name}': values must fit in int32, got "
                        f"{cu.tolist()}")
            else:
                cu = cu.clamp(_INT32_MIN, _INT32_MAX)
        cu = cu.to(torch.int32)
    if cu.device != device:
        raise ValueError(f"msa: argument '{name}': expected device {device} (that of q), "
                         f"got {cu.device}")
    return cu


# --------------------------------------------------------------------------------------------
# public API
# --------------------------------------------------------------------------------------------


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
    block_idx: Optional[Tensor] = None,
    sink_blocks: int = 0,
    local_blocks: int = 1,
    scale: Optional[float] = None,
    scale_idx: Optional[float] = None,
    kl_value: bool = True,
    return_lse: bool = False,
    return_block_idx: bool = False,
    deterministic: bool = False,
    kl_pass: str = "auto",
    fwd_pass: str = "auto",
    select_scores: str = "input",
    fp8_rerank: int = 4,
    dq_pass: str = "auto",
    bwd_chunk_tokens: int = 0,
    fwd_chunk_tokens: int = 0,
    cu_seqlens_k: Optional[Tensor] = None,
    fp8_rerank_slots: int = 0,
):
    """MSA training attention: index selection, sparse attention, KL loss (contract §2-§4).

    Args:
        q: [T, Hq, D] main queries (float16/bfloat16; float32/float64 accepted).
        k, v: [T, Hkv, D] main keys and values, q's dtype.
        q_idx: [T, Hi, Di] index queries, q's dtype. May be None only when ``block_idx`` is
            given (then no KL: ``kl`` is 0 and has no gradient path).
        k_idx: [T, Hik, Di] index keys.
        top_k: blocks selected per (token, index head), forced blocks included (``k``), in
            [1, 2**20]; unused when ``block_idx`` is given (its last dim is ``k``), but checked.
        block_size: tokens per block (``Bk``).
        cu_seqlens: int32 [nseq+1] sequence offsets (None: one sequence).
        cu_seqlens_k: int32 [nseq+1] key offsets (None: the keys are the queries' tokens):
            ``k``, ``v``, ``k_idx`` then have ``Tk`` rows and each sequence's queries are the
            last positions of its keys (see the module's docstring); their gradients have
            ``Tk`` rows too.
        block_idx: int32 [T, Hi, k], a caller's selection (ascending or not, ``-1`` = empty
            slot; entries must be causal: ``-1`` or ``0..t//block_size``). When given, the
            selection is skipped and attention and KL run over it.
        sink_blocks: force the first n blocks of each sequence.
        local_blocks: force the last n blocks up to and including the token's own (>= 1).
        scale: main softmax scale (None: ``D**-0.5``).
        scale_idx: index score scale (None: ``Di**-0.5``).
        kl_value: compute the exact KL value in the forward (one more pass over the support,
            comparable to the forward itself); if False, ``kl`` is a zero. Either way its
            gradient trains ``q_idx``/``k_idx``.
        return_lse: also return the LSE [T, Hq] float32 (natural log; not differentiable).
        return_block_idx: also return the selection [T, Hi, top_k] int32 (ascending block ids
            then -1 padding), or the caller's ``block_idx``.
        deterministic: ask the backward for bitwise-reproducible gradients (both backends
            always give them: no floating-point atomics).
        kl_pass: how the backward computes the KL gradient: "auto" (the backend's choice),
            "fused" (inside the KV-side pass of the CUDA backward, or NotImplementedError where
            it cannot be), "teacher" (that pass writes only the teacher, a pass of the index
            branch alone turns it into the gradient; the CUDA default in sparse mode) or
            "separate" (a pass of its own). Results agree to rounding; the CPU backend has one
            implementation.
        fwd_pass: how the sparse forward walks its work: "auto" (the backend's choice; CUDA:
            the device picks "query_tile" or "split" from the selection, no host sync),
            "query_tile" (a tile of query rows visits the union of its tokens' selections:
            fastest when neighbouring tokens select alike), "kv_block" (each KV block visits
            the tokens that selected it and a second kernel combines the partial outputs: its
            cost does not grow with how much neighbouring selections differ) or "split" (the
            query tiles take the blocks most of their tokens selected, the KV blocks the rest,
            and the tiles merge the partials). The CPU backend has one implementation.
        fwd_chunk_tokens: with "kv_block", "split" or "auto", the tokens of one pass of the
            forward (0: as many as keep one pass's partial outputs near 8 GiB).
        select_scores: what the selection ranks blocks by: "input" (the index inputs' own
            scores) or "fp8" (E4M3 copies of them, a scale per q_idx row and per block of
            k_idx keys: half the bytes and twice the tensor-core rate at long contexts; the
            selection differs where blocks score within E4M3's resolution; the KL keeps the
            inputs' scores). See :func:`select_blocks`.
        fp8_rerank: with "fp8", how many candidates beyond a row's free slots the FP8 scores
            shortlist for the inputs' own scores to rank again (0: the FP8 scores decide).
        fp8_rerank_slots: with "fp8" and fp8_rerank = m > 0, how many of a row's free slots
            the re-ranking decides (0: all): with a > 0 the best (free - a) by FP8 score are
            kept and the last a slots go to the best of the next a + m by the inputs' scores.
        dq_pass: how the backward computes dq: "auto" (the backend's choice; CUDA: "from_ds"
            where it can run), "query_tile" (a tile of query rows visits the union of its
            tokens' selections and recomputes the scores there) or "from_ds" (the KV-side pass
            writes dS and a query-tile pass multiplies it by K: the scores are computed once
            whatever the overlap of neighbouring selections; NotImplementedError where it
            cannot run). Results agree to rounding; the CPU backend has one implementation.
        bwd_chunk_tokens: with "from_ds", the tokens of one pass of the backward (0: as many
            as keep one pass's dS near 8 GiB).

    Returns:
        ``(out, kl)``, then ``lse`` and ``block_idx`` when asked for, in that order.
        ``out`` [T, Hq, D], q's dtype: ``sum_{j in T_h(t)} softmax(scale*q.k) v`` where the
        support ``T_h(t)`` is the causal keys in the blocks selected for (t, index head of h).
        ``kl`` 0-dim float32: ``1/(T*Hi) * sum_{t,i} KL(pi_i(t) || sigma_i(t))`` with the
        detached teacher ``pi`` = mean over index head i's query heads of the attention
        probabilities, and the student ``sigma`` = softmax of ``scale_idx*q_idx.k_idx`` over
        the same support. Add ``weight * kl`` to the loss: gradients reach q, k, v from
        ``out`` and q_idx, k_idx from ``kl``; the selection itself is not differentiable.
    """
    _tensor("q", q, 3, "[T, Hq, D]")
    _tensor("k", k, 3, "[T, Hkv, D]")
    _tensor("v", v, 3, "[T, Hkv, D]")
    _int("block_size", block_size, 1)
    _int("sink_blocks", sink_blocks, 0)
    _int("local_blocks", local_blocks, 1)
    _int("top_k", top_k, 1, _MAX_TOP_K)
    _kl_pass(kl_pass)
    select = block_idx is None
    if select:
        _tensor("q_idx", q_idx, 3, "[T, Hi, Di]")
        _tensor("k_idx", k_idx, 3, "[T, Hik, Di]")
    else:
        _tensor("block_idx", block_idx, 3, "[T, Hi, k] int32")
        _tensor("q_idx", q_idx, 3, "[T, Hi, Di]", optional=True)
        _tensor("k_idx", k_idx, 3, "[T, Hik, Di]", optional=True)
        if (q_idx is None) != (k_idx is None):
            raise ValueError("msa: argument 'k_idx': q_idx and k_idx must be given together")
        top_k = block_idx.shape[2]
    has_idx = q_idx is not None
    cu = _cu_seqlens(cu_seqlens, q.device)
    out, lse, bi, kl = _ops.forward_call(
        q, k, v, q_idx, k_idx, None if select else block_idx, cu, False, select, block_size,
        top_k, sink_blocks, local_blocks, _scale("scale", scale), _scale("scale_idx", scale_idx),
        bool(kl_value) and has_idx, bool(deterministic), kl_pass, fwd_pass, select_scores,
        _int("fp8_rerank", fp8_rerank, 0, 64), dq_pass, _int("bwd_chunk_tokens", bwd_chunk_tokens, 0),
        _int("fwd_chunk_tokens", fwd_chunk_tokens, 0), _cu_seqlens(cu_seqlens_k, q.device, "cu_seqlens_k"),
        _int("fp8_rerank_slots", fp8_rerank_slots, 0, 1 << 20))
    result = (out, kl)
    if return_lse:
        result += (lse,)
    if return_block_idx:
        result += (bi if select else block_idx,)
    return result


def warmup_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    q_idx: Optional[Tensor],
    k_idx: Optional[Tensor],
    *,
    cu_seqlens: Optional[Tensor] = None,
    scale: Optional[float] = None,
    scale_idx: Optional[float] = None,
    kl_value: bool = True,
    return_lse: bool = False,
    deterministic: bool = False,
    kl_pass: str = "auto",
    cu_seqlens_k: Optional[Tensor] = None,
):
    """Indexer warmup (docs/contract.md §5): dense causal attention, KL over the full causal support.

    Shapes and dtypes as in :func:`sparse_attention` (no selection, no ``top_k``).
    ``out`` [T, Hq, D] is dense causal GQA attention; ``kl`` (0-dim float32) is
    ``1/(T*Hi) * sum_{t,i} KL(pi || sigma)`` with ``pi`` the detached group-mean of the dense
    attention probabilities and ``sigma`` the index softmax, both over all ``j <= t`` of the
    token's sequence. Its gradient trains q_idx, k_idx. ``q_idx``/``k_idx`` may be None (plain
    dense causal attention, ``kl`` = 0). ``kl_value=False`` skips the exact value (``kl`` = 0,
    gradient unchanged). ``kl_pass`` and ``cu_seqlens_k`` as in :func:`sparse_attention`.
    Returns ``(out, kl)`` (+ ``lse`` [T, Hq] float32 if ``return_lse``).
    """
    _tensor("q", q, 3, "[T, Hq, D]")
    _tensor("k", k, 3, "[T, Hkv, D]")
    _tensor("v", v, 3, "[T, Hkv, D]")
    _tensor("q_idx", q_idx, 3, "[T, Hi, Di]", optional=True)
    _tensor("k_idx", k_idx, 3, "[T, Hik, Di]", optional=True)
    if (q_idx is None) != (k_idx is None):
        raise ValueError("msa: argument 'k_idx': q_idx and k_idx must be given together")
    _kl_pass(kl_pass)
    cu = _cu_seqlens(cu_seqlens, q.device)
    out, lse, _, kl = _ops.forward_call(
        q, k, v, q_idx, k_idx, None, cu, True, False, 128, 16, 0, 1,
        _scale("scale", scale), _scale("scale_idx", scale_idx),
        bool(kl_value) and q_idx is not None, bool(deterministic), kl_pass, "auto", "input", 4,
        "auto", 0, 0, _cu_seqlens(cu_seqlens_k, q.device, "cu_seqlens_k"))
    return (out, kl, lse) if return_lse else (out, kl)


def select_blocks(
    q_idx: Tensor,
    k_idx: Tensor,
    top_k: int = 16,
    block_size: int = 128,
    *,
    cu_seqlens: Optional[Tensor] = None,
    sink_blocks: int = 0,
    local_blocks: int = 1,
    scale_idx: Optional[float] = None,
    select_scores: str = "input",
    fp8_rerank: int = 4,
    cu_seqlens_k: Optional[Tensor] = None,
    fp8_rerank_slots: int = 0,
) -> Tensor:
    """Index selection alone (docs/contract.md §2). Not differentiable.

    For token t and index head i: block scores ``M(t, b) = max_{j in b, j <= t}
    scale_idx * <q_idx[t, i], k_idx[j, i // (Hi/Hik)]>``; the forced blocks (own block, the
    ``local_blocks`` last blocks, the ``sink_blocks`` first) plus the best other earlier blocks
    by score (ties to the lower index), ``top_k`` in all.

    ``select_scores="fp8"`` ranks blocks by the scores of E4M3 copies of the inputs instead
    (contract §2): each q_idx row and each block of k_idx keys gets the scale 16 / amax, its
    values ``e4m3(x * scale)``; on the GPU the scores come from FP8 tensor-core products.
    With ``fp8_rerank = m > 0`` (default 4) those scores only shortlist: the best (free slots +
    m) blocks by them are ranked again by the inputs' own scores, which keeps nearly all of the
    "input" selection (``fp8_rerank=0``: the FP8 scores decide alone). ``fp8_rerank_slots =
    a > 0``: only the last a free slots are re-ranked, from the next a + m blocks by FP8 score,
    the best (free slots - a) kept as the FP8 scores rank them: fewer blocks to score again
    for nearly the same recall (``bench/fp8_shortlist_recall.py``). ``cu_seqlens_k``: keys
    apart from queries (``k_idx`` [Tk, Hik, Di]), as in :func:`sparse_attention`.

    Returns ``block_idx`` [T, Hi, top_k] int32: ascending block ids, then -1 padding.
    """
    _tensor("q_idx", q_idx, 3, "[T, Hi, Di]")
    _tensor("k_idx", k_idx, 3, "[T, Hik, Di]")
    _int("top_k", top_k, 1, _MAX_TOP_K)
    _int("block_size", block_size, 1)
    _int("sink_blocks", sink_blocks, 0)
    _int("local_blocks", local_blocks, 1)
    cu = _cu_seqlens(cu_seqlens, q_idx.device)
    return torch.ops.msa.select_blocks(q_idx, k_idx, cu, top_k, block_size, sink_blocks,
                                       local_blocks, _scale("scale_idx", scale_idx), select_scores,
                                       _int("fp8_rerank", fp8_rerank, 0, 64),
                                       _cu_seqlens(cu_seqlens_k, q_idx.device, "cu_seqlens_k"),
                                       _int("fp8_rerank_slots", fp8_rerank_slots, 0, 1 << 20))


def kl_divergence(
    q: Tensor,
    k: Tensor,
    lse: Tensor,
    q_idx: Tensor,
    k_idx: Tensor,
    block_idx: Optional[Tensor] = None,
    *,
    cu_seqlens: Optional[Tensor] = None,
    block_size: int = 128,
    scale: Optional[float] = None,
    scale_idx: Optional[float] = None,
    return_rows: bool = False,
    cu_seqlens_k: Optional[Tensor] = None,
):
    """Exact KL value (docs/contract.md §4) from a forward's LSE. Not differentiable.

    Args:
        q [T, Hq, D], k [T, Hkv, D]: the main queries and keys of the forward.
        lse: [T, Hq] float32, the forward's LSE (``return_lse=True``).
        q_idx [T, Hi, Di], k_idx [T, Hik, Di]: index queries and keys.
        block_idx: [T, Hi, k] int32, the forward's selection; None: the dense causal support
            of the warmup (docs/contract.md §5).
        cu_seqlens_k: keys apart from queries (k, k_idx with Tk rows), as in
            :func:`sparse_attention`.
    Returns:
        ``kl`` 0-dim float32 = ``1/(T*Hi) * sum_{t,i} KL(pi_i(t) || sigma_i(t))``; with
        ``return_rows`` also the unnormalised per-row terms [T, Hi] float32.
    Cost: one pass over the support (about the cost of the attention forward).
    """
    _tensor("q", q, 3, "[T, Hq, D]")
    _tensor("k", k, 3, "[T, Hkv, D]")
    _tensor("lse", lse, 2, "[T, Hq] float32")
    _tensor("q_idx", q_idx, 3, "[T, Hi, Di]")
    _tensor("k_idx", k_idx, 3, "[T, Hik, Di]")
    _tensor("block_idx", block_idx, 3, "[T, Hi, k] int32", optional=True)
    _int("block_size", block_size, 1)
    cu = _cu_seqlens(cu_seqlens, q.device)
    kl, rows = torch.ops.msa.kl_divergence(q, k, lse, q_idx, k_idx, block_idx, cu,
                                           block_idx is None, block_size,
                                           _scale("scale", scale), _scale("scale_idx", scale_idx),
                                           _cu_seqlens(cu_seqlens_k, q.device, "cu_seqlens_k"))
    return (kl, rows) if return_rows else kl


from . import nn  # noqa: E402,F401  (msa.nn.MSAAttention; imports this module)
from . import serving  # noqa: E402,F401  (msa.serving: paged KV cache, plan/run; torch.ops.msa.paged_*)
