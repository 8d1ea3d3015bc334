"""An MSA attention layer for models: projections, rotary embeddings on both branches, the
warmup and sparse modes, and the KL loss that trains the index branch.

    attn = msa.nn.MSAAttention(d_model=1024, n_heads=16, n_kv_heads=4, top_k=16)
    y, aux = attn(x, cu_seqlens=cu)          # x [T, d_model] packed, or [B, L, d_model]
    loss = task_loss(y) + aux                # aux = kl_weight * KL (its gradient trains the index)

``mode`` is "warmup" (dense causal attention, the KL over the full causal support: the first
phase of MSA training) or "sparse" (attention over the blocks the index branch selects); switch
with :meth:`MSAAttention.set_mode`. With :meth:`MSAAttention.set_context_parallel` the layer
takes one rank's shard of the tokens and runs its attention over a process group
(:mod:`msa.distributed`). The layer calls :func:`msa.sparse_attention` /
:func:`msa.warmup_attention`, so it runs on the CPU and CUDA backends, under ``torch.compile``
and activation checkpointing, with the library's deterministic gradients.
"""

import math
from typing import Optional, Tuple

import torch
from torch import Tensor, nn

import msa

__all__ = ["MSAAttention", "rotary", "rotary_table", "positions_of"]


def positions_of(cu_seqlens: Optional[Tensor], T: int, device) -> Tensor:
    """Each packed token's position inside its own sequence (int64 [T])."""
    t = torch.arange(T, device=device)
    if cu_seqlens is None:
        return t
    cu = cu_seqlens.to(device=device, dtype=torch.int64)
    seq = torch.searchsorted(cu[1:], t, right=True)
    return t - cu[seq]


def rotary_table(pos: Tensor, d: int, theta: float, dtype: torch.dtype = torch.float32) -> Tuple[Tensor, Tensor]:
    """cos and sin [T, 1, d / 2] of the rotary angles at positions pos [T] for head width d,
    in dtype: what :func:`rotary` computes when it is given no table (one table can serve every
    tensor of the same width and compute dtype)."""
    half = d // 2
    inv = theta ** (-torch.arange(half, device=pos.device, dtype=dtype) * 2.0 / d)
    ang = pos.to(dtype)[:, None] * inv[None, :]  # [T, half]
    return ang.cos()[:, None, :], ang.sin()[:, None, :]


def _rotate(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Each pair (a, b) = (x[..., j], x[..., j + d/2]) turned to (a cos - b sin, a sin + b cos),
    in cos's dtype, rounded once into a new tensor of x's dtype: four half-width products and a
    difference and a sum written straight into the result's halves (out=). The same roundings,
    so the same bits, as the plain expression (:func:`rotary` under torch.compile), which also
    makes a full-width float32 copy of the result, a concatenation and a conversion (three passes
    more over memory, and as many in autograd's backward)."""
    half = x.shape[-1] // 2
    a, b = x[..., :half], x[..., half:]
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    p, q = torch.mul(a, cos), torch.mul(b, sin)
    torch.sub(p, q, out=out[..., :half])
    torch.mul(a, sin, out=p)
    torch.mul(b, cos, out=q)
    torch.add(p, q, out=out[..., half:])
    return out


class _Rotary(torch.autograd.Function):
    """x turned by the angles of (cos, sin); its gradient is the gradient turned back."""

    @staticmethod
    def forward(ctx, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        ctx.save_for_backward(cos, sin)
        return _rotate(x, cos, sin)

    @staticmethod
    def backward(ctx, g: Tensor):
        cos, sin = ctx.saved_tensors
        return _rotate(g, cos, -sin), None, None


def rotary(x: Tensor, pos: Tensor, theta: float,
           table: Optional[Tuple[Tensor, Tensor]] = None) -> Tensor:
    """Rotary embedding of x [T, H, d] (d even; the two halves of the last dim rotate as pairs)
    at positions pos [T], computed in float32 (float64 for float64 x) and returned in x's dtype.
    ``table``: :func:`rotary_table`'s (cos, sin) for these positions, width and compute dtype,
    when the caller shares one between tensors. Differentiable in x (not in the table)."""
    d = x.shape[-1]
    ct = torch.float64 if x.dtype == torch.float64 else torch.float32
    cos, sin = table if table is not None else rotary_table(pos, d, theta, ct)
    if torch.compiler.is_compiling():  # one expression, which the compiler fuses and
        half = d // 2                  # differentiates (it takes no out= views)
        a, b = x[..., :half], x[..., half:]
        return torch.cat([a * cos - b * sin, a * sin + b * cos], dim=-1).to(x.dtype)
    return _Rotary.apply(x, cos.detach(), sin.detach())


def _need(ok: bool, name: str, what: str) -> None:
    if not ok:
        raise ValueError(f"msa.nn.MSAAttention: argument '{name}': {what}")


class MSAAttention(nn.Module):
    """MiniMax Sparse Attention (block-sparse GQA attention on the blocks a light index branch
    selects) with its index branch.

    Args:
        d_model: model width (input and output features).
        n_heads, n_kv_heads: main query heads ``Hq`` and KV heads ``Hkv`` (``Hkv`` divides ``Hq``).
        head_dim: main head dim ``D`` (even; default ``d_model // n_heads``).
        n_idx_heads: index query heads ``Hi``: a multiple of ``Hkv`` that divides ``Hq``
            (default ``Hkv``: one per GQA group). The CUDA backward has Gi-constant kernels for
            ``Hq / Hi`` = 2, 4 and 16 (others take Gi at run time); the selection and the KL
            gradient scale with ``Hi``, and an index head over fewer query heads learns a
            sharper teacher (docs/perf.md, the retrieval runs at 32K).
        n_idx_key_heads: index key heads ``Hik`` (divides ``Hi``; default 1, shared).
        idx_head_dim: index head dim ``Di`` (even; default ``head_dim``; the CUDA backend's KL
            gradient needs ``Di == D``).
        block_size, top_k, sink_blocks, local_blocks: the selection (``Bk``, ``k``, forced sink and
            local blocks; contract §2).
        kl_weight: weight of the KL in the returned auxiliary loss.
        kl_value: compute the KL's value (one more pass over the support). Without it the
            auxiliary loss is a zero that still carries the KL's gradient (cheaper; enough to
            train).
        rope_theta: base of the rotary embeddings of both branches.
        mode: "sparse" or "warmup".
        select_scores: what the sparse mode's selection ranks blocks by: "input" (the index
            branch's own scores) or "fp8" (E4M3 copies of them: faster at long contexts; the KL
            keeps the branch's own scores; see :func:`msa.select_blocks`).
        fp8_rerank: with "fp8", the candidates beyond a row's free slots that the FP8 scores
            shortlist for the branch's own scores to rank again (0 ... 64; 0: FP8 decides).
        fp8_rerank_slots: with "fp8", how many of a row's free slots that re-ranking decides
            (0: all; a > 0: the best free - a kept by FP8 score).
        bias: biases in the projections.

    ``forward(x, cu_seqlens=None)`` takes ``x`` [T, d_model] (packed sequences marked by
    ``cu_seqlens`` int32 [nseq+1]; None: one sequence) or [B, L, d_model] (B sequences of L
    tokens) and returns ``(y, aux)``: ``y`` shaped like ``x``, ``aux`` = kl_weight * KL, 0-dim
    float32.

    Context parallelism (:meth:`set_context_parallel`): ``x`` [n, d_model] is this rank's shard
    of the packed batch (its rows in the layout's order, :func:`msa.distributed.shard_positions`)
    and ``cu_seqlens`` the whole batch's; the projections and rotary embeddings (at the tokens'
    global positions) run on the shard, the attention over the group. ``y`` is this rank's rows
    of the single-process output and ``aux`` the global KL term (the same on every rank: add it
    on every rank, as with any loss of a context-parallel model). Each rank's parameter
    gradients are its shard's part: summed over the ranks (all-reduce, as data parallelism
    does) they are the single-process gradients.
    """

    def __init__(self, d_model: int, n_heads: int, n_kv_heads: int, *,
                 head_dim: Optional[int] = None, n_idx_heads: Optional[int] = None,
                 n_idx_key_heads: int = 1, idx_head_dim: Optional[int] = None,
                 block_size: int = 128, top_k: int = 16, sink_blocks: int = 1,
                 local_blocks: int = 4, kl_weight: float = 1.0, kl_value: bool = False,
                 rope_theta: float = 10000.0, mode: str = "sparse", select_scores: str = "input",
                 fp8_rerank: int = 4, bias: bool = False, device=None, dtype=None,
                 fp8_rerank_slots: int = 0):
        super().__init__()
        _need(isinstance(d_model, int) and d_model >= 1, "d_model", f"must be a positive int, got {d_model!r}")
        _need(isinstance(n_heads, int) and n_heads >= 1, "n_heads", f"must be a positive int, got {n_heads!r}")
        _need(isinstance(n_kv_heads, int) and n_kv_heads >= 1 and n_heads % n_kv_heads == 0,
              "n_kv_heads", f"must divide n_heads = {n_heads}, got {n_kv_heads!r}")
        if head_dim is None:
            _need(d_model % n_heads == 0, "head_dim",
                  f"d_model = {d_model} is not a multiple of n_heads = {n_heads}: give head_dim")
            head_dim = d_model // n_heads
        _need(isinstance(head_dim, int) and head_dim >= 2 and head_dim % 2 == 0, "head_dim",
              f"must be a positive even int (rotary pairs), got {head_dim!r}")
        n_idx_heads = n_kv_heads if n_idx_heads is None else n_idx_heads
        _need(isinstance(n_idx_heads, int) and n_idx_heads >= 1 and n_idx_heads % n_kv_heads == 0
              and n_heads % n_idx_heads == 0, "n_idx_heads",
              f"must be a multiple of n_kv_heads = {n_kv_heads} that divides n_heads = {n_heads}, "
              f"got {n_idx_heads!r}")
        _need(isinstance(n_idx_key_heads, int) and n_idx_key_heads >= 1
              and n_idx_heads % n_idx_key_heads == 0, "n_idx_key_heads",
              f"must divide n_idx_heads = {n_idx_heads}, got {n_idx_key_heads!r}")
        idx_head_dim = head_dim if idx_head_dim is None else idx_head_dim
        _need(isinstance(idx_head_dim, int) and idx_head_dim >= 2 and idx_head_dim % 2 == 0,
              "idx_head_dim", f"must be a positive even int (rotary pairs), got {idx_head_dim!r}")
        _need(isinstance(block_size, int) and block_size >= 1 and block_size & (block_size - 1) == 0,
              "block_size", f"must be a power of two, got {block_size!r}")
        _need(isinstance(top_k, int) and top_k >= 1, "top_k", f"must be a positive int, got {top_k!r}")
        _need(isinstance(sink_blocks, int) and sink_blocks >= 0, "sink_blocks",
              f"must be a non-negative int, got {sink_blocks!r}")
        _need(isinstance(local_blocks, int) and local_blocks >= 1, "local_blocks",
              f"must be at least 1, got {local_blocks!r}")
        _need(math.isfinite(kl_weight) and kl_weight >= 0, "kl_weight",
              f"must be finite and non-negative, got {kl_weight!r}")
        _need(rope_theta > 0, "rope_theta", f"must be positive, got {rope_theta!r}")
        _need(select_scores in ("input", "fp8"), "select_scores",
              f"expected 'input' or 'fp8', got {select_scores!r}")
        self.select_scores = select_scores
        _need(isinstance(fp8_rerank, int) and not isinstance(fp8_rerank, bool) and 0 <= fp8_rerank <= 64,
              "fp8_rerank", f"must be an int in [0, 64], got {fp8_rerank!r}")
        self.fp8_rerank = fp8_rerank
        _need(isinstance(fp8_rerank_slots, int) and not isinstance(fp8_rerank_slots, bool)
              and 0 <= fp8_rerank_slots <= 1 << 20, "fp8_rerank_slots",
              f"must be an int in [0, 2^20], got {fp8_rerank_slots!r}")
        self.fp8_rerank_slots = fp8_rerank_slots
        self.d_model, self.n_heads, self.n_kv_heads = d_model, n_heads, n_kv_heads
        self.head_dim, self.n_idx_heads, self.n_idx_key_heads = head_dim, n_idx_heads, n_idx_key_heads
        self.idx_head_dim = idx_head_dim
        self.block_size, self.top_k = block_size, top_k
        self.sink_blocks, self.local_blocks = sink_blocks, local_blocks
        self.kl_weight, self.kl_value, self.rope_theta = float(kl_weight), bool(kl_value), rope_theta
        self.set_mode(mode)
        kw = dict(bias=bias, device=device, dtype=dtype)
        self.q_proj = nn.Linear(d_model, n_heads * head_dim, **kw)
        self.k_proj = nn.Linear(d_model, n_kv_heads * head_dim, **kw)
        self.v_proj = nn.Linear(d_model, n_kv_heads * head_dim, **kw)
        self.o_proj = nn.Linear(n_heads * head_dim, d_model, **kw)
        self.q_idx_proj = nn.Linear(d_model, n_idx_heads * idx_head_dim, **kw)
        self.k_idx_proj = nn.Linear(d_model, n_idx_key_heads * idx_head_dim, **kw)
        self.cp = None  # (group, layout, exchange) under context parallelism

    def set_context_parallel(self, group=None, layout: Optional[str] = "balanced",
                             exchange: str = "selected") -> None:
        """Runs the layer's attention over the torch.distributed process group ``group``
        (None: the default group) with this rank's shard of the tokens in ``layout``
        ("contiguous" or "balanced", see :func:`msa.distributed.shard_positions`) and the
        K/V ``exchange`` ("selected" or "allgather"). ``layout=None`` turns it off."""
        if layout is None:
            self.cp = None
            return
        _need(layout in ("contiguous", "balanced"), "layout",
              f"expected 'contiguous', 'balanced' or None, got {layout!r}")
        _need(exchange in ("selected", "allgather"), "exchange",
              f"expected 'selected' or 'allgather', got {exchange!r}")
        _need(self.select_scores == "input", "select_scores",
              "context parallelism selects by the index branch's own scores ('input'), got "
              f"{self.select_scores!r}")
        self.cp = (group, layout, exchange)

    def set_mode(self, mode: str) -> None:
        """"warmup" (dense causal attention, KL over the full causal support) or "sparse"."""
        _need(mode in ("sparse", "warmup"), "mode", f"must be 'sparse' or 'warmup', got {mode!r}")
        self.mode = mode

    def extra_repr(self) -> str:
        return (f"d_model={self.d_model}, heads={self.n_heads}/{self.n_kv_heads}, "
                f"head_dim={self.head_dim}, idx_heads={self.n_idx_heads}/{self.n_idx_key_heads}, "
                f"idx_head_dim={self.idx_head_dim}, block_size={self.block_size}, "
                f"top_k={self.top_k}, mode={self.mode}")

    def project(self, x: Tensor, cu_seqlens: Optional[Tensor], index: bool = True,
                pos: Optional[Tensor] = None) -> Tuple[Tensor, ...]:
        """The branches' inputs for packed x [T, d_model]: q, k, v, q_idx, k_idx (rotary applied
        to q, k, q_idx, k_idx at each token's position in its sequence, or at ``pos`` [T] when
        given). ``index=False`` leaves the index branch out (q_idx, k_idx None): the main branch
        alone, e.g. for a dense baseline built from the same weights."""
        T = x.shape[0]
        if pos is None:
            pos = positions_of(cu_seqlens, T, x.device)
        tables = {}  # (width, compute dtype) -> (cos, sin), shared by the tensors that match

        def rot(y: Tensor) -> Tensor:
            ct = torch.float64 if y.dtype == torch.float64 else torch.float32
            key = (y.shape[-1], ct)
            if key not in tables:
                tables[key] = rotary_table(pos, y.shape[-1], self.rope_theta, ct)
            return rotary(y, pos, self.rope_theta, tables[key])

        q = rot(self.q_proj(x).view(T, self.n_heads, self.head_dim))
        k = rot(self.k_proj(x).view(T, self.n_kv_heads, self.head_dim))
        v = self.v_proj(x).view(T, self.n_kv_heads, self.head_dim)
        if not index:
            return q, k, v, None, None
        qi = rot(self.q_idx_proj(x).view(T, self.n_idx_heads, self.idx_head_dim))
        ki = rot(self.k_idx_proj(x).view(T, self.n_idx_key_heads, self.idx_head_dim))
        return q, k, v, qi, ki

    def forward(self, x: Tensor, cu_seqlens: Optional[Tensor] = None) -> Tuple[Tensor, Tensor]:
        _need(x.dim() in (2, 3) and x.shape[-1] == self.d_model, "x",
              f"expected [T, {self.d_model}] or [B, L, {self.d_model}], got {tuple(x.shape)}")
        batched = x.dim() == 3
        if batched:
            _need(cu_seqlens is None, "cu_seqlens", "give it only with packed [T, d_model] input")
            B, L, _ = x.shape
            cu_seqlens = torch.arange(B + 1, device=x.device, dtype=torch.int32) * L
            x = x.reshape(B * L, self.d_model)
        if self.cp is not None:
            _need(not batched, "x", "context parallelism takes a packed shard [n, d_model]")
            return self._forward_cp(x, cu_seqlens)
        q, k, v, qi, ki = self.project(x, cu_seqlens)
        if self.mode == "warmup":
            out, kl = msa.warmup_attention(q, k, v, qi, ki, cu_seqlens=cu_seqlens,
                                           kl_value=self.kl_value)
        else:
            out, kl = msa.sparse_attention(q, k, v, qi, ki, self.top_k, self.block_size,
                                           cu_seqlens=cu_seqlens, sink_blocks=self.sink_blocks,
                                           local_blocks=self.local_blocks, kl_value=self.kl_value,
                                           select_scores=self.select_scores,
                                           fp8_rerank=self.fp8_rerank,
                                           fp8_rerank_slots=self.fp8_rerank_slots)
        y = self.o_proj(out.reshape(x.shape[0], self.n_heads * self.head_dim))
        if batched:
            y = y.view(B, L, self.d_model)
        return y, kl * self.kl_weight

    def _forward_cp(self, x: Tensor, cu_seqlens: Optional[Tensor]) -> Tuple[Tensor, Tensor]:
        import torch.distributed as dist
        from . import distributed as msad
        group, layout, exchange = self.cp
        g = group if group is not None else dist.group.WORLD
        rank, world = dist.get_rank(g), dist.get_world_size(g)
        n = x.shape[0]
        # every shard's size (contiguous shards may differ) and the batch's token count
        wire = x.device if "nccl" in str(dist.get_backend(g)).lower() else torch.device("cpu")
        every = [torch.zeros(1, dtype=torch.int64, device=wire) for _ in range(world)]
        dist.all_gather(every, torch.tensor([n], dtype=torch.int64, device=wire), group=g)
        sizes = [int(t.item()) for t in every]
        N = sum(sizes)
        cu = cu_seqlens if cu_seqlens is not None else torch.tensor([0, N], dtype=torch.int32)
        idx = msad.shard_positions(layout, rank, world, N, cu,
                                   sizes=sizes if layout == "contiguous" else None)
        pos = positions_of(cu.cpu(), N, "cpu")[idx].to(x.device)
        q, k, v, qi, ki = self.project(x, cu, pos=pos)
        cu_dev = cu.to(device=x.device, dtype=torch.int32)
        if self.mode == "warmup":
            out, kl = msad.warmup_attention(q, k, v, qi, ki, cu_seqlens=cu_dev, group=group,
                                            layout=layout, exchange=exchange,
                                            kl_value=self.kl_value)
        else:
            out, kl = msad.sparse_attention(q, k, v, qi, ki, self.top_k, self.block_size,
                                            cu_seqlens=cu_dev, group=group, layout=layout,
                                            exchange=exchange, sink_blocks=self.sink_blocks,
                                            local_blocks=self.local_blocks,
                                            kl_value=self.kl_value)
        y = self.o_proj(out.reshape(n, self.n_heads * self.head_dim))
        return y, kl * self.kl_weight
