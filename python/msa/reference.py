"""Independent eager PyTorch reference of MSA, written from the contract (docs/contract.md).

Slow and memory-hungry (it materialises [H, L, L] score matrices per sequence); meant for tests
and small experiments. Differentiable with autograd (selection excluded); compute in float64
for tight comparisons. Sequences of a packed batch are processed one by one.
"""

from typing import List, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = ["select_blocks_ref", "sparse_attention_ref", "warmup_attention_ref",
           "attention_over_support_ref", "fp8_index_copies_ref"]

NEG_INF = float("-inf")


def _sequences(T: int, cu_seqlens: Optional[Tensor]) -> List[Tuple[int, int]]:
    if cu_seqlens is None:
        return [(0, T)]
    cu = [int(x) for x in cu_seqlens.tolist()]
    return [(cu[s], cu[s + 1]) for s in range(len(cu) - 1)]


def _index_scores(q_idx: Tensor, k_idx: Tensor, scale_idx: float) -> Tensor:
    """s[i, t, j] = scale_idx * <q_idx[t, i], k_idx[j, i // (Hi/Hik)]> for one sequence."""
    Hi, Hik = q_idx.shape[1], k_idx.shape[1]
    kk = k_idx.repeat_interleave(Hi // Hik, dim=1)
    return scale_idx * torch.einsum("thd,jhd->htj", q_idx, kk)


def _causal(L: int, device) -> Tensor:
    t = torch.arange(L, device=device)
    return t[None, :] <= t[:, None]  # [t, j]: j <= t


def _fp8_copy(x: Tensor, amax: Tensor) -> Tensor:
    """Contract §2, FP8 scores: e4m3(fp32(x * s)) / s with s = 16 / amax (fp32), s = 1 where
    amax is 0 or not finite; nearest even, saturated to +-448. amax broadcasts against x."""
    x = x.float()
    ok = (amax > 0) & torch.isfinite(amax)
    s = torch.where(ok, torch.full_like(amax, 16.0) / torch.where(ok, amax, torch.ones_like(amax)),
                    torch.ones_like(amax))
    y = (x * s).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)
    return y.double() / s.double()


def fp8_index_copies_ref(q_idx: Tensor, k_idx: Tensor, block_size: int,
                         cu_seqlens: Optional[Tensor] = None) -> Tuple[Tensor, Tensor]:
    """The dequantised E4M3 copies (float64) that select_scores="fp8" ranks blocks by: a scale
    per q_idx row, and per block of block_size keys of one sequence and index key head."""
    def amax_of(x):
        return torch.nan_to_num(x.float().abs(), nan=0.0).amax(dim=-1, keepdim=True)
    q8 = _fp8_copy(q_idx, amax_of(q_idx))
    k8 = torch.empty(k_idx.shape, dtype=torch.float64, device=k_idx.device)
    for a, b in _sequences(k_idx.shape[0], cu_seqlens):
        for j0 in range(a, b, block_size):
            j1 = min(j0 + block_size, b)
            blk = k_idx[j0:j1]  # [n, Hik, Di]
            amax = amax_of(blk).amax(dim=0, keepdim=True)  # [1, Hik, 1]
            k8[j0:j1] = _fp8_copy(blk, amax)
    return q8, k8


def _best(M: Tensor, cand: Tensor, n: Tensor) -> Tensor:
    """[Hi, L, nb] bool: the n[t] best blocks of `cand` by (score M desc, block asc)."""
    Hi, L, nb = M.shape
    # A stable descending sort keeps equal scores in ascending block order.
    order = torch.sort(M, dim=-1, descending=True, stable=True).indices
    cand_sorted = cand.expand(Hi, L, nb).gather(-1, order)
    rank_in_cand = torch.cumsum(cand_sorted.to(torch.int64), dim=-1)
    best_sorted = cand_sorted & (rank_in_cand <= n[None, :, None])
    return torch.zeros_like(best_sorted).scatter(-1, order, best_sorted)


def _block_scores(q_idx: Tensor, k_idx: Tensor, scale_idx: float, Bk: int) -> Tensor:
    """[Hi, L, nb] block maxima M(t, b) of one sequence's causal index scores."""
    L = q_idx.shape[0]
    s = _index_scores(q_idx, k_idx, scale_idx)  # [Hi, L, L]
    s = s.masked_fill(~_causal(L, q_idx.device), NEG_INF)
    nb = (L + Bk - 1) // Bk
    s = F.pad(s, (0, nb * Bk - L), value=NEG_INF)
    return s.reshape(s.shape[0], L, nb, Bk).amax(dim=-1)


def select_blocks_ref(q_idx: Tensor, k_idx: Tensor, top_k: int, block_size: int,
                      cu_seqlens: Optional[Tensor] = None, sink_blocks: int = 0,
                      local_blocks: int = 1, scale_idx: Optional[float] = None,
                      shortlist_by: Optional[Tuple[Tensor, Tensor]] = None,
                      rerank: int = 0, rerank_slots: int = 0) -> Tensor:
    """Contract §2: block_idx [T, Hi, top_k] int32, ascending block ids then -1.

    ``shortlist_by`` = (q, k) (select_scores="fp8": the E4M3 copies of fp8_index_copies_ref):
    the free slots + ``rerank`` best candidates by the scores of q and k are kept, and the slots
    go to the best of them by the scores of q_idx and k_idx (with rerank = 0: by q and k's).
    ``rerank_slots`` = a (fp8_rerank_slots) in (0, free slots), with more candidates than free
    slots: the best (free - a) by q and k's scores are selected as they are, and only the last a
    slots go to the best of the other shortlisted blocks by q_idx and k_idx's."""
    T, Hi, Di = q_idx.shape
    if scale_idx is None:
        scale_idx = Di ** -0.5
    Bk = block_size
    out = torch.full((T, Hi, top_k), -1, dtype=torch.int32, device=q_idx.device)
    with torch.no_grad():
        for a, b in _sequences(T, cu_seqlens):
            L = b - a
            if L == 0:
                continue
            dev = q_idx.device
            M = _block_scores(q_idx[a:b], k_idx[a:b], scale_idx, Bk)  # [Hi, L, nb]
            nb = M.shape[-1]
            own = torch.arange(L, device=dev) // Bk  # [L]
            blk = torch.arange(nb, device=dev)
            local = (blk[None, :] <= own[:, None]) & (blk[None, :] > own[:, None] - local_blocks)
            sink = blk[None, :] < torch.clamp(own + 1, max=sink_blocks)[:, None]
            forced = local | sink  # [L, nb]
            cand = (blk[None, :] < own[:, None]) & ~forced  # [L, nb]
            slots = top_k - forced.sum(-1)  # [L]
            kept = torch.zeros_like(cand)
            n = slots
            if shortlist_by is not None:
                M8 = _block_scores(shortlist_by[0][a:b], shortlist_by[1][a:b], scale_idx, Bk)
                if rerank == 0:
                    M = M8
                else:
                    short = cand[None] & _best(M8, cand, slots + rerank)
                    if rerank_slots > 0:
                        n = torch.where((rerank_slots < slots) & (cand.sum(-1) > slots),
                                        torch.full_like(slots, rerank_slots), slots)
                        kept = _best(M8, cand, slots - n)
                    cand = short & ~kept
            chosen = kept | _best(M, cand, n)
            sel = forced[None] | chosen  # [Hi, L, nb]
            ids = torch.where(sel, blk, nb + blk).sort(dim=-1).values
            count = sel.sum(-1, keepdim=True)
            ids = torch.where(blk < count, ids, torch.full_like(ids, -1))
            w = min(top_k, nb)
            out[a:b, :, :w] = ids[..., :w].permute(1, 0, 2).to(torch.int32)
    return out


def _support(block_idx: Optional[Tensor], L: int, Bk: int, H: int, device) -> Tensor:
    """[H, L, L] bool: j <= t and blk(j) in the row's selected blocks (all blocks if None)."""
    causal = _causal(L, device)
    if block_idx is None:
        return causal.expand(H, L, L)
    nb = (L + Bk - 1) // Bk
    b = block_idx.permute(1, 0, 2).to(torch.int64)  # [H, L, k]
    b = torch.where(b < 0, torch.full_like(b, nb), b)
    bm = torch.zeros((H, L, nb + 1), dtype=torch.bool, device=device)
    bm.scatter_(-1, b, True)
    tok = bm[..., torch.arange(L, device=device) // Bk]  # [H, L, L]
    return tok & causal


def attention_over_support_ref(q: Tensor, k: Tensor, v: Tensor, q_idx: Optional[Tensor],
                               k_idx: Optional[Tensor], block_idx: Optional[Tensor], *,
                               block_size: int = 128, cu_seqlens: Optional[Tensor] = None,
                               scale: Optional[float] = None,
                               scale_idx: Optional[float] = None):
    """Contract §3-§5 over a given support: ``block_idx`` [T, Hi, k] (sparse) or None (dense causal).

    Returns (out [T, Hq, D], lse [T, Hq], kl 0-dim): kl is 0 when q_idx is None.
    """
    T, Hq, D = q.shape
    Hkv = k.shape[1]
    G = Hq // Hkv
    if scale is None:
        scale = D ** -0.5
    has_idx = q_idx is not None
    if has_idx:
        Hi, Di = q_idx.shape[1], q_idx.shape[2]
        if scale_idx is None:
            scale_idx = Di ** -0.5
    else:
        Hi = block_idx.shape[1] if block_idx is not None else 1
    hpi = Hq // Hi
    out = torch.zeros_like(q)
    lse = torch.full((T, Hq), NEG_INF, dtype=q.dtype, device=q.device)
    outs, lses = [], []
    kl_sum = q.new_zeros(()) if not has_idx else q_idx.new_zeros(())
    for a, b in _sequences(T, cu_seqlens):
        L = b - a
        if L == 0:
            continue
        dev = q.device
        bi = None if block_idx is None else block_idx[a:b]
        mask_i = _support(bi, L, block_size, Hi, dev)  # [Hi, L, L]
        mask = mask_i.repeat_interleave(hpi, dim=0)  # [Hq, L, L]: head h -> index head h // hpi
        kk = k[a:b].repeat_interleave(G, dim=1)  # head h -> kv head h // G
        vv = v[a:b].repeat_interleave(G, dim=1)
        logits = scale * torch.einsum("thd,jhd->htj", q[a:b], kk)
        logits = logits.masked_fill(~mask, NEG_INF)
        l = torch.logsumexp(logits, dim=-1)  # [Hq, L]
        l_safe = torch.where(torch.isfinite(l), l, torch.zeros_like(l))
        P = torch.exp(logits - l_safe[..., None])  # 0 off the support
        o = torch.einsum("htj,jhd->thd", P, vv)
        outs.append(o)
        lses.append(l.transpose(0, 1))
        if has_idx:
            pi = P.detach().reshape(Hi, hpi, L, L).mean(dim=1)  # teacher, detached
            s = _index_scores(q_idx[a:b], k_idx[a:b], scale_idx).masked_fill(~mask_i, NEG_INF)
            ls = torch.logsumexp(s, dim=-1)
            ls_safe = torch.where(torch.isfinite(ls), ls, torch.zeros_like(ls))
            log_sigma = torch.where(mask_i, s - ls_safe[..., None], torch.zeros_like(s))
            pos = mask_i & (pi > 0)
            pi_safe = torch.where(pos, pi, torch.ones_like(pi))
            term = torch.where(pos, pi * (torch.log(pi_safe) - log_sigma), torch.zeros_like(pi))
            kl_sum = kl_sum + term.sum()
    if outs:  # the sequences tile [0, T) in order; empty ones add no rows
        out = torch.cat([o for o in outs], dim=0)
        lse = torch.cat([l for l in lses], dim=0)
    kl = kl_sum / (T * Hi) if (has_idx and T > 0) else kl_sum * 0
    return out, lse, kl


def sparse_attention_ref(q: Tensor, k: Tensor, v: Tensor, q_idx: Optional[Tensor],
                         k_idx: Optional[Tensor], top_k: int = 16, block_size: int = 128, *,
                         cu_seqlens: Optional[Tensor] = None, block_idx: Optional[Tensor] = None,
                         sink_blocks: int = 0, local_blocks: int = 1,
                         scale: Optional[float] = None, scale_idx: Optional[float] = None):
    """Reference of msa.sparse_attention: returns (out, kl, lse, block_idx)."""
    if block_idx is None:
        block_idx = select_blocks_ref(q_idx, k_idx, top_k, block_size, cu_seqlens, sink_blocks,
                                      local_blocks, scale_idx)
    out, lse, kl = attention_over_support_ref(q, k, v, q_idx, k_idx, block_idx,
                                              block_size=block_size, cu_seqlens=cu_seqlens,
                                              scale=scale, scale_idx=scale_idx)
    return out, kl, lse, block_idx


def warmup_attention_ref(q: Tensor, k: Tensor, v: Tensor, q_idx: Optional[Tensor],
                         k_idx: Optional[Tensor], *, cu_seqlens: Optional[Tensor] = None,
                         scale: Optional[float] = None, scale_idx: Optional[float] = None):
    """Reference of msa.warmup_attention (docs/contract.md §5): returns (out, kl, lse)."""
    out, lse, kl = attention_over_support_ref(q, k, v, q_idx, k_idx, None,
                                              cu_seqlens=cu_seqlens, scale=scale,
                                              scale_idx=scale_idx)
    return out, kl, lse
