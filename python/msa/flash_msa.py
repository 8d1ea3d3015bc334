"""Drop-in twins of the flash-msa API (``from msa.flash_msa import flash_msa_func``).

Tensors are head-major ``[B, H, S, D]`` as in flash-msa; ``top_k`` counts TOKENS (a positive
multiple of 128; block size 128); ``scale`` is used for the main and the index (proxy) logits.
Returns ``(attn_out [B, S, Hq*D], kl_loss 0-dim float32)``: add ``weight * kl_loss`` to the loss
and its gradient trains ``Q_proxy``/``K_proxy`` exactly as in flash-msa (normalised by
``1/(B*Hp*S)``). Unlike flash-msa, whose ``kl_loss`` is a zero placeholder, ``kl_loss`` holds the
exact KL value by default (``kl_value=False`` returns a zero and skips that pass).

Differences from flash-msa: any S, D and ``top_k/128 > S/128`` are accepted (padding slots are
simply empty); internally the batch is packed to ``[B*S, H, D]`` with
``cu_seqlens = arange(B+1)*S`` (a transposing copy of each input).
"""

from typing import Optional

import torch
from torch import Tensor

from . import sparse_attention, warmup_attention

__all__ = [
    "flash_msa_func",
    "flash_msa_warmup_func",
    "flash_msa_func_warmup",
    "sparse_attention_warmup",
]

BLOCK_SIZE = 128


def _pack(Q_proxy, K_proxy, Q, K, V):
    names = ("Q_proxy", "K_proxy", "Q", "K", "V")
    tensors = (Q_proxy, K_proxy, Q, K, V)
    for name, t in zip(names, tensors):
        if not isinstance(t, Tensor):
            raise ValueError(f"msa.flash_msa: argument '{name}': expected a torch.Tensor "
                             f"[B, H, S, D], got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(f"msa.flash_msa: argument '{name}': expected rank 4 [B, H, S, D], "
                             f"got shape {tuple(t.shape)}")
    B, _, S, _ = Q.shape
    for name, t in zip(names, tensors):
        if t.shape[0] != B or t.shape[2] != S:
            raise ValueError(f"msa.flash_msa: argument '{name}': expected batch {B} and sequence "
                             f"length {S} (those of Q), got shape {tuple(t.shape)}")
    packed = [t.transpose(1, 2).reshape(B * S, t.shape[1], t.shape[3]) for t in tensors]
    cu = None
    if B > 1:
        cu = torch.arange(B + 1, dtype=torch.int32, device=Q.device) * S
    return packed, cu, B, S


def _check_top_k(top_k) -> int:
    if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k <= 0 or top_k % BLOCK_SIZE:
        raise ValueError(f"msa.flash_msa: argument 'top_k': must be a positive multiple of "
                         f"{BLOCK_SIZE} (tokens), got {top_k!r}")
    return top_k // BLOCK_SIZE


def flash_msa_func(Q_proxy: Tensor, K_proxy: Tensor, Q: Tensor, K: Tensor, V: Tensor,
                   top_k: int, scale: Optional[float] = None, *, kl_value: bool = True):
    """MSA sparse attention with the flash-msa signature.

    Args:
        Q_proxy: [B, Hp, S, Dp] index (proxy) queries.
        K_proxy: [B, Hpk, S, Dp] index keys (Hpk divides Hp).
        Q: [B, Hq, S, D]; K, V: [B, Hkv, S, D] (Hp a multiple of Hkv that divides Hq).
        top_k: selected tokens per (token, proxy head), a positive multiple of 128.
        scale: softmax scale of the main and the proxy logits (None: D**-0.5 and Dp**-0.5).
        kl_value: compute the exact KL value (else ``kl_loss`` is a zero placeholder).
    Returns:
        ``(attn_out [B, S, Hq*D], kl_loss)``, attn_out in Q's dtype, kl_loss 0-dim float32.
    """
    kb = _check_top_k(top_k)
    (qp, kp, q, k, v), cu, B, S = _pack(Q_proxy, K_proxy, Q, K, V)
    out, kl = sparse_attention(q, k, v, qp, kp, top_k=kb, block_size=BLOCK_SIZE, cu_seqlens=cu,
                               scale=scale, scale_idx=scale, kl_value=kl_value)
    return out.view(B, S, Q.shape[1] * Q.shape[3]), kl


def flash_msa_warmup_func(Q_proxy: Tensor, K_proxy: Tensor, Q: Tensor, K: Tensor, V: Tensor,
                          top_k: Optional[int] = None, scale: Optional[float] = None, *,
                          kl_value: bool = True):
    """Indexer warmup with the flash-msa signature: dense causal attention, KL over the full
    causal rows. ``top_k`` is accepted and ignored, as in flash-msa. Shapes and returns as in
    :func:`flash_msa_func`."""
    (qp, kp, q, k, v), cu, B, S = _pack(Q_proxy, K_proxy, Q, K, V)
    out, kl = warmup_attention(q, k, v, qp, kp, cu_seqlens=cu, scale=scale, scale_idx=scale,
                               kl_value=kl_value)
    return out.view(B, S, Q.shape[1] * Q.shape[3]), kl


flash_msa_func_warmup = flash_msa_warmup_func
sparse_attention_warmup = flash_msa_warmup_func
