"""Shared helpers of the Python tests: random inputs, closeness checks, the selection rule."""

import os

import pytest
import torch

# The reference lives in the installed package (msa.reference); nothing else is needed here.
import msa  # noqa: F401

torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))


@pytest.fixture(autouse=True)
def _seed(request):
    """Seed every test from its name, so each test has its own fixed random inputs."""
    seed = sum(ord(c) * (i + 1) for i, c in enumerate(request.node.nodeid)) % (2**31)
    torch.manual_seed(seed)
    yield


def make_inputs(T, Hq, Hkv, Hi, Hik, D, Di, dtype=torch.float64, requires_grad=True,
                device="cpu"):
    """Fresh random q, k, v, q_idx, k_idx (never zeros)."""
    def r(*shape):
        x = torch.randn(*shape, dtype=torch.float64).to(dtype=dtype, device=device)
        return x.requires_grad_(requires_grad)
    return r(T, Hq, D), r(T, Hkv, D), r(T, Hkv, D), r(T, Hi, Di), r(T, Hik, Di)


def detached64(*tensors):
    """float64 leaf copies (requiring grad) of the given tensors, for the reference."""
    return tuple(t.detach().to(torch.float64).requires_grad_(True) for t in tensors)


def assert_close(got, want, rtol, name="", atol=0.0):
    """max|got - want| <= rtol * max|want| + atol (a max-norm relative test)."""
    got = got.detach().to(torch.float64)
    want = want.detach().to(torch.float64)
    assert got.shape == want.shape, f"{name}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    assert torch.isfinite(got).all(), f"{name}: non-finite values"
    err = (got - want).abs().max().item() if got.numel() else 0.0
    scale = want.abs().max().item() if want.numel() else 0.0
    assert err <= rtol * scale + atol, f"{name}: max error {err:.3e} vs scale {scale:.3e} (rtol {rtol})"


def grads(loss, tensors):
    """Gradients of loss with respect to tensors (zeros where a tensor gets none)."""
    gs = torch.autograd.grad(loss, tensors, allow_unused=True)
    return [torch.zeros_like(t) if g is None else g for g, t in zip(gs, tensors)]


def sequences(T, cu_seqlens):
    if cu_seqlens is None:
        return [(0, T)]
    cu = cu_seqlens.tolist()
    return [(cu[i], cu[i + 1]) for i in range(len(cu) - 1)]


def check_selection(block_idx, q_idx, k_idx, top_k, block_size, cu_seqlens=None, sink_blocks=0,
                    local_blocks=1, scale_idx=None, tol=1e-5, shortlist=None):
    """The acceptance rule of contract §2 for a selection computed by any implementation.

    Format: per row, ascending block ids in [0, blk(t)], then -1 padding. Content: every forced
    block, |selection| = min(top_k, forced + candidates), and every selected non-forced block
    scores at least the k-th best non-forced score minus `tol` (scores in float64).

    ``shortlist`` = (q8, k8, m) (select_scores="fp8" with fp8_rerank = m > 0): every selected
    non-forced block is instead among the free slots + m best candidates by the scores of q8
    and k8 (up to `tol`), and no candidate surely among them (by more than `tol`) but not
    selected outscores a selected one by more than `tol` under q_idx and k_idx's scores.
    """
    T, Hi, Di = q_idx.shape
    assert block_idx.shape == (T, Hi, top_k) and block_idx.dtype == torch.int32
    dev = q_idx.device
    block_idx = block_idx.to(dev)
    if scale_idx is None:
        scale_idx = Di ** -0.5
    qi = q_idx.detach().to(torch.float64)
    ki = k_idx.detach().to(torch.float64).repeat_interleave(Hi // k_idx.shape[1], dim=1)
    Bk = block_size
    for a, b in sequences(T, cu_seqlens):
        L = b - a
        if L == 0:
            continue
        bi = block_idx[a:b].permute(1, 0, 2).to(torch.int64)  # [Hi, L, k]
        valid = bi >= 0
        # format: valid entries form a prefix and are strictly ascending
        assert (valid[..., 1:] <= valid[..., :-1]).all(), "-1 padding must come last"
        inc = bi[..., 1:] > bi[..., :-1]
        assert (inc | ~valid[..., 1:]).all(), "block ids must be strictly ascending"
        own = torch.arange(L, device=dev) // Bk
        assert (bi <= own[None, :, None]).all(), "a selected block lies after the token's block"
        nb = (L + Bk - 1) // Bk
        s = scale_idx * torch.einsum("thd,jhd->htj", qi[a:b], ki[a:b])
        t = torch.arange(L, device=dev)
        s = s.masked_fill(~(t[None, :] <= t[:, None]), float("-inf"))
        s = torch.nn.functional.pad(s, (0, nb * Bk - L), value=float("-inf"))
        M = s.reshape(Hi, L, nb, Bk).amax(-1)
        blk = torch.arange(nb, device=dev)
        forced = ((blk[None] <= own[:, None]) & (blk[None] > own[:, None] - local_blocks)) | (
            blk[None] < torch.clamp(own + 1, max=sink_blocks)[:, None])
        cand = (blk[None] < own[:, None]) & ~forced
        sel = torch.zeros(Hi, L, nb + 1, dtype=torch.bool, device=dev)
        sel.scatter_(-1, torch.where(valid, bi, torch.full_like(bi, nb)), True)
        sel = sel[..., :nb]
        assert not (forced[None] & ~sel).any(), "a forced block is missing"
        assert not (sel & ~(forced | cand)[None]).any(), "a non-candidate block was selected"
        want_count = torch.clamp(forced.sum(-1) + cand.sum(-1), max=top_k)
        assert (sel.sum(-1) == want_count[None]).all(), "wrong number of selected blocks"
        slots = top_k - forced.sum(-1)  # [L]
        chosen = sel & cand[None]

        def kth_best(M, n):
            Mc = M.masked_fill(~cand[None], float("-inf")).sort(-1, descending=True).values
            idx = torch.clamp(n - 1, min=0, max=nb - 1)[None, :, None].expand(Hi, L, 1)
            return Mc.gather(-1, idx)[..., 0]  # [Hi, L]

        if shortlist is None:
            kth = kth_best(M, slots)
            limited = (cand.sum(-1) > slots)[None] & (slots > 0)[None]
            low = chosen & (M < (kth - tol)[..., None]) & limited[..., None]
            assert not low.any(), "a selected block scores below the k-th best candidate"
            continue
        q8, k8, m = shortlist
        k8 = k8.detach().to(torch.float64).repeat_interleave(Hi // k8.shape[1], dim=1)
        s8 = scale_idx * torch.einsum("thd,jhd->htj", q8.detach().to(torch.float64)[a:b], k8[a:b])
        s8 = s8.masked_fill(~(t[None, :] <= t[:, None]), float("-inf"))
        s8 = torch.nn.functional.pad(s8, (0, nb * Bk - L), value=float("-inf"))
        M8 = s8.reshape(Hi, L, nb, Bk).amax(-1)
        kth8 = kth_best(M8, slots + m)
        limited = (cand.sum(-1) > slots + m)[None] & (slots > 0)[None]
        out = chosen & (M8 < (kth8 - tol)[..., None]) & limited[..., None]
        assert not out.any(), "a selected block lies outside the FP8 shortlist"
        surely = cand[None] & ((M8 > (kth8 + tol)[..., None]) | ~limited[..., None])
        worst = M.masked_fill(~chosen, float("inf")).amin(-1)  # [Hi, L]
        full = chosen.sum(-1) == slots[None]
        passed = surely & ~chosen & (M > (worst + tol)[..., None]) & full[..., None]
        assert not passed.any(), "a shortlisted block outscoring a selected one was not selected"
