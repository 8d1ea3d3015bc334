"""msa.sparse_attention / warmup_attention / kl_divergence against the eager reference."""

import contextlib

import pytest
import torch
import torch.nn.functional as F

import msa
from msa import reference as R
from conftest import assert_close, check_selection, detached64, grads, make_inputs

# (T, Hq, Hkv, Hi, Hik, D, Di, block_size, top_k, sink_blocks, local_blocks)
CONFIGS = [
    (150, 4, 2, 2, 1, 16, 8, 16, 3, 0, 1),    # GQA, one shared index key head
    (130, 8, 2, 4, 2, 8, 16, 32, 2, 1, 1),    # Hi = 2*Hkv, Hik = 2, a sink block
    (100, 4, 4, 4, 1, 16, 16, 16, 4, 1, 2),   # MHA, sink + two local blocks
    (77, 2, 1, 1, 1, 8, 4, 8, 16, 0, 3),      # top_k above the block count: -1 padding
]
IDS = ["gqa", "hi2hkv_sink", "mha_sink_local2", "pad"]

# rtol of (out, lse/kl, grads) per dtype: fp32 outputs/LSE bound the float64 comparisons.
TOL = {torch.float64: (1e-6, 1e-5), torch.float32: (2e-5, 2e-4)}


def _loss(out, kl, w, gamma):
    return (out * w).sum() + gamma * kl


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
@pytest.mark.parametrize("cfg", CONFIGS, ids=IDS)
def test_sparse_forward_backward_vs_reference(cfg, dtype):
    T, Hq, Hkv, Hi, Hik, D, Di, Bk, top_k, sink, local = cfg
    q, k, v, qi, ki = make_inputs(T, Hq, Hkv, Hi, Hik, D, Di, dtype)
    out, kl, lse, bi = msa.sparse_attention(q, k, v, qi, ki, top_k, Bk, sink_blocks=sink,
                                            local_blocks=local, return_lse=True,
                                            return_block_idx=True)
    assert out.dtype == dtype and out.shape == (T, Hq, D)
    assert lse.dtype == torch.float32 and lse.shape == (T, Hq)
    assert kl.dtype == torch.float32 and kl.dim() == 0
    check_selection(bi, qi, ki, top_k, Bk, sink_blocks=sink, local_blocks=local)
    if dtype == torch.float64:  # independent selection, exact up to summation order
        ref_bi = R.select_blocks_ref(qi, ki, top_k, Bk, sink_blocks=sink, local_blocks=local)
        assert torch.equal(bi, ref_bi)

    r = detached64(q, k, v, qi, ki)
    r_out, r_kl, r_lse, _ = R.sparse_attention_ref(*r, top_k, Bk, block_idx=bi)
    tol_o, tol_g = TOL[dtype]
    assert_close(out, r_out, tol_o, "out")
    assert_close(lse, r_lse, tol_o, "lse")
    assert_close(kl, r_kl, tol_g, "kl")

    w = torch.randn(T, Hq, D, dtype=torch.float64)
    gamma = 0.75
    g = grads(_loss(out, kl, w.to(dtype), gamma), (q, k, v, qi, ki))
    rg = grads(_loss(r_out, r_kl, w, gamma), r)
    for name, a, b in zip(["dq", "dk", "dv", "dq_idx", "dk_idx"], g, rg):
        assert b.abs().max() > 0, name
        assert_close(a, b, tol_g, name)


def test_dense_limit_equals_causal_sdpa():
    """With top_k >= number of blocks, sparse attention is dense causal GQA attention."""
    T, Hq, Hkv, Hi, Hik, D, Di, Bk = 96, 4, 2, 2, 1, 16, 8, 16
    q, k, v, qi, ki = make_inputs(T, Hq, Hkv, Hi, Hik, D, Di)
    out, _ = msa.sparse_attention(q, k, v, qi, ki, top_k=T // Bk, block_size=Bk)
    G = Hq // Hkv
    want = F.scaled_dot_product_attention(
        q.transpose(0, 1), k.repeat_interleave(G, 1).transpose(0, 1),
        v.repeat_interleave(G, 1).transpose(0, 1), is_causal=True).transpose(0, 1)
    assert_close(out, want, 1e-10, "out")
    wout, _ = msa.warmup_attention(q, k, v, qi, ki)
    assert_close(wout, want, 1e-10, "warmup out")


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
def test_warmup_vs_reference(dtype):
    T, Hq, Hkv, Hi, Hik, D, Di = 90, 4, 2, 2, 1, 16, 8
    q, k, v, qi, ki = make_inputs(T, Hq, Hkv, Hi, Hik, D, Di, dtype)
    cu = torch.tensor([0, 33, 90], dtype=torch.int32)
    out, kl, lse = msa.warmup_attention(q, k, v, qi, ki, cu_seqlens=cu, scale=0.3,
                                        scale_idx=0.5, return_lse=True)
    r = detached64(q, k, v, qi, ki)
    r_out, r_kl, r_lse = R.warmup_attention_ref(*r, cu_seqlens=cu, scale=0.3, scale_idx=0.5)
    tol_o, tol_g = TOL[dtype]
    assert_close(out, r_out, tol_o, "out")
    assert_close(lse, r_lse, tol_o, "lse")
    assert_close(kl, r_kl, tol_g, "kl")
    w = torch.randn(T, Hq, D, dtype=torch.float64)
    g = grads(_loss(out, kl, w.to(dtype), 2.0), (q, k, v, qi, ki))
    rg = grads(_loss(r_out, r_kl, w, 2.0), r)
    for name, a, b in zip(["dq", "dk", "dv", "dq_idx", "dk_idx"], g, rg):
        assert b.abs().max() > 0, name
        assert_close(a, b, tol_g, name)


def test_warmup_without_index_is_dense_attention():
    T, Hq, Hkv, D = 40, 2, 1, 8
    q, k, v, _, _ = make_inputs(T, Hq, Hkv, 1, 1, D, 4)
    # the C++ options hold scales as float32: use an fp32-exact scale for a tight comparison
    scale = float(torch.tensor(0.3, dtype=torch.float32))
    out, kl = msa.warmup_attention(q, k, v, None, None, scale=scale)
    r_out, r_kl, _ = R.warmup_attention_ref(*detached64(q, k, v), None, None, scale=scale)
    assert_close(out, r_out, 1e-12, "out")
    assert kl.item() == 0.0


def test_kl_value_and_helper():
    T, Hq, Hkv, Hi, Hik, D, Di, Bk, top_k = 120, 4, 2, 2, 1, 8, 8, 16, 3
    q, k, v, qi, ki = make_inputs(T, Hq, Hkv, Hi, Hik, D, Di, requires_grad=False)
    out, kl, lse, bi = msa.sparse_attention(q, k, v, qi, ki, top_k, Bk, return_lse=True,
                                            return_block_idx=True)
    _, r_kl, _, _ = R.sparse_attention_ref(q, k, v, qi, ki, top_k, Bk, block_idx=bi)
    assert kl.item() > 0
    assert_close(kl, r_kl, 1e-5, "kl")
    kl2, rows = msa.kl_divergence(q, k, lse, qi, ki, bi, block_size=Bk, return_rows=True)
    assert rows.shape == (T, Hi) and rows.dtype == torch.float32
    assert_close(kl2, kl, 1e-6, "kl helper")
    assert_close(rows.double().sum() / (T * Hi), r_kl, 1e-5, "kl rows")
    assert (rows >= -1e-6).all()
    # dense (warmup) support
    wout, wkl, wlse = msa.warmup_attention(q, k, v, qi, ki, return_lse=True)
    _, r_wkl, _ = R.warmup_attention_ref(q, k, v, qi, ki)
    assert_close(msa.kl_divergence(q, k, wlse, qi, ki), r_wkl, 1e-5, "dense kl helper")
    assert_close(wkl, r_wkl, 1e-5, "dense kl")


@pytest.mark.parametrize("warmup", [False, True])
def test_kl_value_off_keeps_gradients(warmup):
    T, Hq, Hkv, Hi, Hik, D, Di, Bk, top_k = 100, 4, 2, 2, 1, 8, 8, 16, 3
    q, k, v, qi, ki = make_inputs(T, Hq, Hkv, Hi, Hik, D, Di)
    if warmup:
        out1, kl1 = msa.warmup_attention(q, k, v, qi, ki, kl_value=True)
        out2, kl2 = msa.warmup_attention(q, k, v, qi, ki, kl_value=False)
    else:
        out1, kl1 = msa.sparse_attention(q, k, v, qi, ki, top_k, Bk, kl_value=True)
        out2, kl2 = msa.sparse_attention(q, k, v, qi, ki, top_k, Bk, kl_value=False)
    assert kl1.item() > 0 and kl2.item() == 0.0
    assert torch.equal(out1, out2)
    g1 = grads(out1.sum() + 3.0 * kl1, (q, k, v, qi, ki))
    g2 = grads(out2.sum() + 3.0 * kl2, (q, k, v, qi, ki))
    for a, b in zip(g1, g2):
        assert torch.equal(a, b)


def test_unused_outputs():
    """Only `out` in the loss: no index gradient. Only `kl`: index gradients, zero main ones."""
    T, Hq, Hkv, Hi, Hik, D, Di, Bk, top_k = 64, 2, 1, 1, 1, 8, 8, 16, 2
    q, k, v, qi, ki = make_inputs(T, Hq, Hkv, Hi, Hik, D, Di)
    out, kl = msa.sparse_attention(q, k, v, qi, ki, top_k, Bk)
    gq, gqi = torch.autograd.grad(out.square().sum(), (q, qi), allow_unused=True)
    assert gq.abs().max() > 0
    assert gqi is None or gqi.abs().max() == 0
    out, kl = msa.sparse_attention(q, k, v, qi, ki, top_k, Bk)
    gq, gqi, gki = torch.autograd.grad(kl, (q, qi, ki), allow_unused=True)
    assert gq is None or gq.abs().max() == 0
    assert gqi.abs().max() > 0 and gki.abs().max() > 0
    # the KL value is not differentiable w.r.t. q, k, v (detached teacher): no grad path error
    r = detached64(q, k, v, qi, ki)
    _, r_kl, _, bi = R.sparse_attention_ref(*r, top_k, Bk)
    rg = torch.autograd.grad(r_kl, (r[3], r[4]))
    assert_close(gqi, rg[0], 1e-5, "dq_idx")
    assert_close(gki, rg[1], 1e-5, "dk_idx")


@pytest.mark.parametrize("which", [3, 4])
def test_one_index_input_requires_grad(which):
    """Only q_idx (3) or only k_idx (4) of the index inputs requires grad: it gets the same
    gradient as when both do, the other none."""
    T, Hq, Hkv, Hi, Hik, D, Di, Bk, top_k = 96, 4, 2, 2, 1, 8, 8, 16, 3
    q, k, v, qi, ki = make_inputs(T, Hq, Hkv, Hi, Hik, D, Di)
    out, kl = msa.sparse_attention(q, k, v, qi, ki, top_k, Bk)
    want = grads(out.sum() + 2.0 * kl, (q, k, v, qi, ki))
    xs = [t.detach().requires_grad_(i in (0, which)) for i, t in enumerate((q, k, v, qi, ki))]
    out, kl = msa.sparse_attention(*xs, top_k, Bk)
    (out.sum() + 2.0 * kl).backward()
    assert want[which].abs().max() > 0
    assert torch.equal(xs[0].grad, want[0]) and torch.equal(xs[which].grad, want[which])
    assert xs[7 - which].grad is None


def test_caller_block_idx():
    """A caller's selection (any order, -1 anywhere) drives attention and the KL."""
    T, Hq, Hkv, Hi, Hik, D, Di, Bk, kk = 80, 4, 2, 2, 1, 8, 8, 16, 3
    q, k, v, qi, ki = make_inputs(T, Hq, Hkv, Hi, Hik, D, Di)
    own = torch.arange(T) // Bk
    bi = torch.full((T, Hi, kk), -1, dtype=torch.int32)
    bi[:, :, 2] = own[:, None].to(torch.int32)  # own block last
    bi[:, 1, 0] = torch.where(own > 0, own - 1, -1).to(torch.int32)  # previous block, head 1
    bi[:, 0, 1] = torch.where(own > 1, 0, -1).to(torch.int32)  # block 0, head 0
    out, kl, bi_back = msa.sparse_attention(q, k, v, qi, ki, block_idx=bi, block_size=Bk,
                                            return_block_idx=True)
    assert bi_back is bi
    r = detached64(q, k, v, qi, ki)
    r_out, r_kl, _, _ = R.sparse_attention_ref(*r, block_size=Bk, block_idx=bi)
    assert_close(out, r_out, 1e-6, "out")
    assert_close(kl, r_kl, 1e-5, "kl")
    w = torch.randn(T, Hq, D, dtype=torch.float64)
    g = grads(_loss(out, kl, w, 1.5), (q, k, v, qi, ki))
    rg = grads(_loss(r_out, r_kl, w, 1.5), r)
    for name, a, b in zip(["dq", "dk", "dv", "dq_idx", "dk_idx"], g, rg):
        assert_close(a, b, 1e-5, name)
    # no index tensors: attention only, kl is a zero
    out2, kl2 = msa.sparse_attention(q, k, v, None, None, block_idx=bi, block_size=Bk)
    assert torch.equal(out2, out) and kl2.item() == 0.0


@pytest.mark.parametrize("warmup", [False, True], ids=["sparse", "warmup"])
def test_varlen_matches_per_sequence(warmup):
    """Packed sequences (an empty one included) give what separate runs give."""
    Hq, Hkv, Hi, Hik, D, Di, Bk, top_k = 4, 2, 2, 1, 8, 8, 16, 3
    lens = [0, 37, 0, 70, 45, 0]
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32)
    T = int(cu[-1])
    q, k, v, qi, ki = make_inputs(T, Hq, Hkv, Hi, Hik, D, Di)
    gamma = 0.9
    w = torch.randn(T, Hq, D, dtype=torch.float64)

    def run(q, k, v, qi, ki, cu_seqlens):
        if warmup:
            return msa.warmup_attention(q, k, v, qi, ki, cu_seqlens=cu_seqlens)
        return msa.sparse_attention(q, k, v, qi, ki, top_k, Bk, cu_seqlens=cu_seqlens)

    out, kl = run(q, k, v, qi, ki, cu)
    g = grads(_loss(out, kl, w, gamma), (q, k, v, qi, ki))
    kl_sum = 0.0
    for a, b in zip(cu[:-1].tolist(), cu[1:].tolist()):
        if a == b:
            continue
        parts = [x.detach()[a:b].clone().requires_grad_(True) for x in (q, k, v, qi, ki)]
        o_s, kl_s = run(*parts, None)
        assert torch.equal(out[a:b], o_s)
        kl_sum += kl_s.item() * (b - a)
        # per-sequence KL is normalised by its own token count: rescale gamma
        g_s = grads(_loss(o_s, kl_s, w[a:b], gamma * (b - a) / T), parts)
        # (the rescaled gamma travels as an fp32 kl_grad: 1e-7 relative for the index grads)
        for name, x, y, tol in zip(["dq", "dk", "dv", "dq_idx", "dk_idx"], g, g_s,
                                   [1e-12, 1e-12, 1e-12, 1e-6, 1e-6]):
            assert_close(x[a:b], y, tol, name)
    assert_close(kl, torch.tensor(kl_sum / T), 1e-5, "kl")
    # and against the reference, which loops over sequences by itself
    r = detached64(q, k, v, qi, ki)
    if warmup:
        r_out, r_kl, _ = R.warmup_attention_ref(*r, cu_seqlens=cu)
    else:
        r_out, r_kl, _, r_bi = R.sparse_attention_ref(*r, top_k, Bk, cu_seqlens=cu)
        _, _, bi = msa.sparse_attention(q, k, v, qi, ki, top_k, Bk, cu_seqlens=cu,
                                        return_block_idx=True)
        assert torch.equal(bi, r_bi)
    assert_close(out, r_out, 1e-6, "out")
    assert_close(kl, r_kl, 1e-5, "kl")


def test_cu_seqlens_int64_accepted():
    T = 50
    q, k, v, qi, ki = make_inputs(T, 2, 1, 1, 1, 8, 8, requires_grad=False)
    cu32 = torch.tensor([0, 20, 50], dtype=torch.int32)
    a = msa.sparse_attention(q, k, v, qi, ki, 2, 8, cu_seqlens=cu32)
    b = msa.sparse_attention(q, k, v, qi, ki, 2, 8, cu_seqlens=cu32.long())
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_low_precision_vs_reference(dtype):
    T, Hq, Hkv, Hi, Hik, D, Di, Bk, top_k = 160, 4, 2, 2, 1, 32, 16, 16, 4
    q, k, v, qi, ki = make_inputs(T, Hq, Hkv, Hi, Hik, D, Di, dtype)
    cu = torch.tensor([0, 100, 160], dtype=torch.int32)
    out, kl, lse, bi = msa.sparse_attention(q, k, v, qi, ki, top_k, Bk, cu_seqlens=cu,
                                            return_lse=True, return_block_idx=True)
    assert out.dtype == dtype
    check_selection(bi, qi, ki, top_k, Bk, cu_seqlens=cu, tol=1e-4)
    r = detached64(q, k, v, qi, ki)
    r_out, r_kl, r_lse, _ = R.sparse_attention_ref(*r, top_k, Bk, cu_seqlens=cu, block_idx=bi)
    eps = 2e-2 if dtype == torch.bfloat16 else 4e-3
    assert_close(out, r_out, eps, "out")
    assert_close(lse, r_lse, 1e-5, "lse")
    assert_close(kl, r_kl, 1e-4, "kl")
    w = torch.randn(T, Hq, D, dtype=torch.float64)
    g = grads(_loss(out, kl, w.to(dtype), 1.0), (q, k, v, qi, ki))
    rg = grads(_loss(r_out, r_kl, w, 1.0), r)
    for name, a, b in zip(["dq", "dk", "dv", "dq_idx", "dk_idx"], g, rg):
        assert a.dtype == dtype, name
        assert_close(a, b, 2 * eps, name)
    # warmup in low precision too
    wout, wkl = msa.warmup_attention(q, k, v, qi, ki, cu_seqlens=cu)
    r_wout, r_wkl, _ = R.warmup_attention_ref(*r, cu_seqlens=cu)
    assert_close(wout, r_wout, eps, "warmup out")
    assert_close(wkl, r_wkl, 1e-4, "warmup kl")


def test_non_contiguous_inputs():
    """Strided views (last dim contiguous) are used in place; a non-contiguous last dim is
    copied; both give what contiguous inputs give, gradients included."""
    T, Hq, Hkv, Hi, Hik, D, Di, Bk, top_k = 70, 4, 2, 2, 1, 8, 8, 16, 3
    base_q = torch.randn(T, 2 * Hq, D, dtype=torch.float64)
    q = base_q[:, ::2].requires_grad_(True)                   # head stride 2*D
    k = torch.randn(Hkv, T, D, dtype=torch.float64).transpose(0, 1).requires_grad_(True)
    v = torch.randn(T, D, Hkv, dtype=torch.float64).transpose(1, 2).requires_grad_(True)
    qi = torch.randn(Hi, T, Di, dtype=torch.float64).transpose(0, 1).requires_grad_(True)
    ki = torch.randn(T, Hik, 2 * Di, dtype=torch.float64)[..., ::2].requires_grad_(True)
    for t in (q, k, v, qi):
        assert not t.is_contiguous()
    assert v.stride(-1) != 1 and ki.stride(-1) != 1
    cont = [t.detach().contiguous().requires_grad_(True) for t in (q, k, v, qi, ki)]
    out, kl, bi = msa.sparse_attention(q, k, v, qi, ki, top_k, Bk, return_block_idx=True)
    out_c, kl_c, bi_c = msa.sparse_attention(*cont, top_k, Bk, return_block_idx=True)
    assert torch.equal(bi, bi_c) and torch.equal(out, out_c) and torch.equal(kl, kl_c)
    # out.sum() hands the backward a broadcast (stride-0) gradient
    g = grads(out.sum() + kl, (q, k, v, qi, ki))
    g_c = grads((out_c * torch.ones_like(out_c)).sum() + kl_c, cont)
    for a, b in zip(g, g_c):
        assert torch.equal(a, b)
    # a non-contiguous caller block_idx
    bi_t = bi.transpose(1, 2).contiguous().transpose(1, 2)
    assert not bi_t.is_contiguous()
    out_t, _ = msa.sparse_attention(q, k, v, qi, ki, block_idx=bi_t, block_size=Bk)
    assert torch.equal(out_t, out)


def test_select_blocks_public_vs_reference():
    Hi, Hik, Di, Bk, top_k = 4, 2, 8, 8, 5
    cu = torch.tensor([0, 0, 61, 100, 100], dtype=torch.int32)
    T = 100
    qi = torch.randn(T, Hi, Di, dtype=torch.float64)
    ki = torch.randn(T, Hik, Di, dtype=torch.float64)
    for sink, local in [(0, 1), (2, 1), (1, 3)]:
        bi = msa.select_blocks(qi, ki, top_k, Bk, cu_seqlens=cu, sink_blocks=sink,
                               local_blocks=local, scale_idx=0.7)
        ref = R.select_blocks_ref(qi, ki, top_k, Bk, cu, sink, local, 0.7)
        assert torch.equal(bi, ref), (sink, local)
        check_selection(bi, qi, ki, top_k, Bk, cu, sink, local, 0.7)


def test_select_blocks_fp8_scores():
    """select_scores="fp8" on the CPU backend: exactly the reference selection over the E4M3
    copies of reference.py (float64 scores on both sides), with fp8_rerank = 0 (the copies
    decide), 4 (the default: they shortlist, the inputs re-rank) and one covering every
    candidate (kInput's selection); in sparse_attention the same selection, and the KL and
    outputs over it."""
    Hi, Hik, Di, Bk, top_k = 4, 2, 16, 8, 5
    cu = torch.tensor([0, 0, 61, 100, 163], dtype=torch.int32)
    T = 163
    qi = torch.randn(T, Hi, Di).to(torch.bfloat16)
    ki = torch.randn(T, Hik, Di).to(torch.bfloat16)
    ki[70, 1, 3] = 12.0  # one block with a large amax
    q8, k8 = R.fp8_index_copies_ref(qi, ki, Bk, cu)
    for sink, local in [(0, 1), (1, 2)]:
        exact = msa.select_blocks(qi, ki, top_k, Bk, cu_seqlens=cu, sink_blocks=sink,
                                  local_blocks=local)
        raw = msa.select_blocks(qi, ki, top_k, Bk, cu_seqlens=cu, sink_blocks=sink,
                                local_blocks=local, select_scores="fp8", fp8_rerank=0)
        assert torch.equal(raw, R.select_blocks_ref(q8, k8, top_k, Bk, cu, sink, local)), (sink, local)
        assert not torch.equal(raw, exact), "the E4M3 copies changed no row's selection"
        bi = msa.select_blocks(qi, ki, top_k, Bk, cu_seqlens=cu, sink_blocks=sink,
                               local_blocks=local, select_scores="fp8")
        assert torch.equal(bi, R.select_blocks_ref(qi, ki, top_k, Bk, cu, sink, local,
                                                   shortlist_by=(q8, k8), rerank=4)), (sink, local)
        assert not torch.equal(bi, raw), "re-ranking changed no row's selection"
        assert (bi != exact).sum() < (raw != exact).sum()
        one = msa.select_blocks(qi, ki, top_k, Bk, cu_seqlens=cu, sink_blocks=sink,
                                local_blocks=local, select_scores="fp8", fp8_rerank=1)
        assert torch.equal(one, R.select_blocks_ref(qi, ki, top_k, Bk, cu, sink, local,
                                                    shortlist_by=(q8, k8), rerank=1)), (sink, local)
        every = msa.select_blocks(qi, ki, top_k, Bk, cu_seqlens=cu, sink_blocks=sink,
                                  local_blocks=local, select_scores="fp8", fp8_rerank=64)
        assert torch.equal(every, exact), (sink, local)
    # a negative scale reverses the ranking, over the same copies
    bi = msa.select_blocks(qi, ki, top_k, Bk, cu_seqlens=cu, scale_idx=-0.5, select_scores="fp8",
                           fp8_rerank=0)
    assert torch.equal(bi, R.select_blocks_ref(q8, k8, top_k, Bk, cu, 0, 1, -0.5))
    bi = msa.select_blocks(qi, ki, top_k, Bk, cu_seqlens=cu, scale_idx=-0.5, select_scores="fp8")
    assert torch.equal(bi, R.select_blocks_ref(qi, ki, top_k, Bk, cu, 0, 1, -0.5,
                                               shortlist_by=(q8, k8), rerank=4))
    with pytest.raises(ValueError, match="fp8_rerank"):
        msa.select_blocks(qi, ki, top_k, Bk, cu_seqlens=cu, select_scores="fp8", fp8_rerank=65)
    q = torch.randn(T, 8, Di).to(torch.bfloat16)
    k = torch.randn(T, 2, Di).to(torch.bfloat16)
    v = torch.randn(T, 2, Di).to(torch.bfloat16)
    for m in (0, 4):
        out, kl, bi = msa.sparse_attention(q, k, v, qi, ki, top_k, Bk, cu_seqlens=cu,
                                           return_block_idx=True, select_scores="fp8",
                                           fp8_rerank=m)
        assert torch.equal(bi, R.select_blocks_ref(qi, ki, top_k, Bk, cu, shortlist_by=(q8, k8),
                                                   rerank=m))
        out2, kl2 = msa.sparse_attention(q, k, v, qi, ki, block_idx=bi, block_size=Bk,
                                         cu_seqlens=cu)
        assert torch.equal(out, out2) and torch.equal(kl, kl2)
    # fp8_rerank_slots: the reference's rule, through the forward and select_blocks alike
    for m, a in ((2, 1), (4, 2), (4, 64)):
        _, _, bi = msa.sparse_attention(q, k, v, qi, ki, top_k, Bk, cu_seqlens=cu,
                                        return_block_idx=True, select_scores="fp8", fp8_rerank=m,
                                        fp8_rerank_slots=a)
        want = R.select_blocks_ref(qi, ki, top_k, Bk, cu, shortlist_by=(q8, k8), rerank=m,
                                   rerank_slots=a)
        assert torch.equal(bi, want), (m, a)
        assert torch.equal(bi, msa.select_blocks(qi, ki, top_k, Bk, cu_seqlens=cu,
                                                 select_scores="fp8", fp8_rerank=m,
                                                 fp8_rerank_slots=a))
        if a == 64:  # every free slot re-ranked: the rule of fp8_rerank alone
            assert torch.equal(want, R.select_blocks_ref(qi, ki, top_k, Bk, cu,
                                                         shortlist_by=(q8, k8), rerank=m))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_selection_exact_ties(dtype):
    """Integer-valued index tensors make every score exact: many ties, which must go to the
    lower block index, so the selection must equal the reference's exactly."""
    T, Hi, Hik, Di, Bk, top_k = 120, 2, 1, 4, 8, 4
    qi = torch.randint(-1, 2, (T, Hi, Di)).to(dtype)
    ki = torch.randint(-1, 2, (T, Hik, Di)).to(dtype)
    for sink, local in [(0, 1), (1, 1), (1, 2)]:
        bi = msa.select_blocks(qi, ki, top_k, Bk, sink_blocks=sink, local_blocks=local,
                               scale_idx=1.0)
        ref = R.select_blocks_ref(qi.double(), ki.double(), top_k, Bk, None, sink, local, 1.0)
        assert torch.equal(bi, ref), (sink, local)


def test_selection_tolerance_f32():
    T, Hi, Hik, Di, Bk, top_k = 200, 2, 1, 16, 8, 6
    qi = torch.randn(T, Hi, Di)
    ki = torch.randn(T, Hik, Di)
    bi = msa.select_blocks(qi, ki, top_k, Bk)
    check_selection(bi, qi, ki, top_k, Bk, tol=1e-5)
    # the checker itself rejects a wrong selection
    bad = bi.clone()
    row = bad[150, 0]
    assert row[0] >= 0 and (row >= 0).sum() == top_k
    unselected = sorted(set(range(150 // Bk)) - set(row.tolist()))
    bad[150, 0, 0] = unselected[0]  # swap a chosen non-forced block for a worse one
    bad[150, 0] = bad[150, 0].sort().values
    with pytest.raises(AssertionError):
        check_selection(bad, qi, ki, top_k, Bk, tol=0.0)


class _OpNames(torch.utils._python_dispatch.TorchDispatchMode):
    """Records the names of the ops dispatched under it."""

    def __init__(self):
        super().__init__()
        self.names = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(str(func))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("warmup", [False, True], ids=["sparse", "warmup"])
def test_eager_route_matches_the_op(warmup):
    """Plain eager calls skip torch.library's dispatch (an autograd.Function over the same
    implementation); under a dispatch mode they go through msa::forward / msa::backward. Both
    routes give the same bits, forward and backward."""
    T, Hq, Hkv, Hi, Hik, D, Di, Bk = 150, 4, 2, 2, 1, 16, 8, 16
    cu = torch.tensor([0, 61, 150], dtype=torch.int32)
    inputs = make_inputs(T, Hq, Hkv, Hi, Hik, D, Di, torch.float32, requires_grad=False)
    w = torch.randn(T, Hq, D)

    def run(mode):
        xs = [t.clone().requires_grad_(True) for t in inputs]
        with mode:
            if warmup:
                out, kl = msa.warmup_attention(*xs, cu_seqlens=cu)
            else:
                out, kl = msa.sparse_attention(*xs, 3, Bk, cu_seqlens=cu, sink_blocks=1)
            grad_fn = type(out.grad_fn).__name__
            g = torch.autograd.grad((out * w).sum() + 0.5 * kl, xs)
        return out.detach(), kl.detach(), g, grad_fn

    plain = run(contextlib.nullcontext())
    names = _OpNames()
    dispatched = run(names)
    assert "_ForwardFunction" in plain[3]
    assert "msa.forward" in " ".join(names.names) and "msa.backward" in " ".join(names.names)
    assert "_ForwardFunction" not in dispatched[3]
    assert torch.equal(plain[0], dispatched[0]) and torch.equal(plain[1], dispatched[1])
    for a, b, name in zip(plain[2], dispatched[2], ["dq", "dk", "dv", "dq_idx", "dk_idx"]):
        assert a.abs().max() > 0, name
        assert torch.equal(a, b), name
