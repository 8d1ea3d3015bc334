"""Keys apart from queries (``cu_seqlens_k``, contract §1) through the Python API: each
sequence's queries are the last positions of its keys. A call over keys apart equals, on the rows
it holds, the call over the whole sequences in which the other rows take no part (an empty
selection and no output gradient); autograd gives the key side's gradients over all ``Tk`` rows;
the ops pass torch.library's opcheck; bad offsets raise naming the argument."""

import pytest
import torch

import msa
from conftest import grads, make_inputs

Hq, Hkv, Hi, Hik, D, Di, Bk, TOP_K = 4, 2, 2, 1, 16, 8, 16, 3
LENS = [70, 0, 45, 33]  # keys per sequence
HELD = [30, 0, 45, 0]   # queries per sequence: its last positions


def _offsets(xs):
    out = [0]
    for x in xs:
        out.append(out[-1] + x)
    return torch.tensor(out, dtype=torch.int32)


def _held_rows():
    """Rows of the whole batch that the keys-apart call holds (ascending)."""
    cu = _offsets(LENS).tolist()
    return torch.tensor([g for s, n in enumerate(HELD) for g in range(cu[s + 1] - n, cu[s + 1])],
                        dtype=torch.int64)


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_sparse_attention_equals_the_whole_call(dtype):
    T = sum(LENS)
    rows = _held_rows()
    Tq = rows.numel()
    q, k, v, qi, ki = make_inputs(T, Hq, Hkv, Hi, Hik, D, Di, dtype=dtype)
    cu, cu_q = _offsets(LENS), _offsets(HELD)
    # The whole call's selection; the keys-apart call takes its held rows, the whole call keeps
    # only those (every other row attends to nothing and adds nothing to the KL).
    bi_whole = msa.select_blocks(qi.detach(), ki.detach(), TOP_K, Bk, cu_seqlens=cu, sink_blocks=1)
    bi = bi_whole[rows]
    bi_held = torch.full_like(bi_whole, -1)
    bi_held[rows] = bi
    sel = msa.select_blocks(qi.detach()[rows], ki.detach(), TOP_K, Bk, cu_seqlens=cu_q,
                            cu_seqlens_k=cu, sink_blocks=1)
    assert torch.equal(sel, bi)

    w = torch.randn(Tq, Hq, D, dtype=torch.float64).to(dtype)
    w_whole = torch.zeros(T, Hq, D, dtype=dtype)
    w_whole[rows] = w

    q_a, qi_a = q.detach()[rows].requires_grad_(True), qi.detach()[rows].requires_grad_(True)
    out_a, kl_a = msa.sparse_attention(q_a, k, v, qi_a, ki, TOP_K, Bk, cu_seqlens=cu_q,
                                       cu_seqlens_k=cu, block_idx=bi)
    out_w, kl_w = msa.sparse_attention(q, k, v, qi, ki, TOP_K, Bk, cu_seqlens=cu,
                                       block_idx=bi_held)
    assert out_a.shape == (Tq, Hq, D)
    assert torch.equal(out_a, out_w[rows])
    # The same per-row KL terms, normalised by each call's N (Tq and T queries).
    torch.testing.assert_close(kl_a.double() * Tq, kl_w.double() * T, rtol=1e-6, atol=0)
    assert kl_a.item() > 0
    ga = grads((out_a * w).float().sum() + 0.5 * kl_a, (q_a, k, v, qi_a, ki))
    gw = grads((out_w * w_whole).float().sum() + 0.5 * (T / Tq) * kl_w, (q, k, v, qi, ki))
    # float64: the KL weight reaches the backward as a float32 kl_grad (relative 6e-8).
    tol = dict(rtol=2e-7, atol=1e-12) if dtype == torch.float64 else dict(rtol=2e-2, atol=1e-2)
    torch.testing.assert_close(ga[0], gw[0][rows], **tol)
    torch.testing.assert_close(ga[3], gw[3][rows], **tol)
    for name, a, b in (("dk", ga[1], gw[1]), ("dv", ga[2], gw[2]), ("dk_idx", ga[4], gw[4])):
        assert a.shape == (T,) + tuple(b.shape[1:]), name
        torch.testing.assert_close(a, b, **tol, msg=name)
    assert ga[1][:cu[1] - HELD[0]].abs().sum() > 0  # the held queries read the prefix's keys


def test_warmup_and_kl_divergence_over_keys_apart():
    T = sum(LENS)
    rows = _held_rows()
    q, k, v, qi, ki = make_inputs(T, Hq, Hkv, Hi, Hik, D, Di, requires_grad=False)
    cu, cu_q = _offsets(LENS), _offsets(HELD)
    out_a, kl_a, lse_a = msa.warmup_attention(q[rows], k, v, qi[rows], ki, cu_seqlens=cu_q,
                                              cu_seqlens_k=cu, return_lse=True)
    out_w, kl_w, lse_w = msa.warmup_attention(q, k, v, qi, ki, cu_seqlens=cu, return_lse=True)
    assert torch.equal(out_a, out_w[rows]) and torch.equal(lse_a, lse_w[rows])
    kl2, kl_rows = msa.kl_divergence(q[rows], k, lse_a, qi[rows], ki, cu_seqlens=cu_q,
                                     cu_seqlens_k=cu, return_rows=True)
    _, kl_rows_w = msa.kl_divergence(q, k, lse_w, qi, ki, cu_seqlens=cu, return_rows=True)
    assert torch.equal(kl2, kl_a)
    assert torch.equal(kl_rows, kl_rows_w[rows])


def test_opcheck_with_keys_apart():
    T = sum(LENS)
    rows = _held_rows()
    q, k, v, qi, ki = make_inputs(T, Hq, Hkv, Hi, Hik, D, Di, requires_grad=False)
    cu, cu_q = _offsets(LENS), _offsets(HELD)
    qa, qia = q[rows].contiguous(), qi[rows].contiguous()
    ops = torch.ops.msa

    def check(op, args, kwargs):
        result = torch.library.opcheck(op, args, kwargs)
        assert all(x == "SUCCESS" for x in result.values()), result

    check(ops.select_blocks.default, (qia, ki, cu_q, TOP_K, Bk, 1, 1, 0.0), {"cu_seqlens_k": cu})
    bi = ops.select_blocks(qia, ki, cu_q, TOP_K, Bk, 1, 1, 0.0, cu_seqlens_k=cu)
    fwd = (qa, k, v, qia, ki, None, cu_q, False, True, Bk, TOP_K, 1, 1, 0.0, 0.0, True, False)
    check(ops.forward.default, fwd, {"cu_seqlens_k": cu})
    out, lse, _, _ = ops.forward(qa, k, v, qia, ki, bi, cu_q, False, False, Bk, TOP_K, 1, 1,
                                 0.0, 0.0, False, False, cu_seqlens_k=cu)
    kl_grad = torch.tensor([0.5], dtype=torch.float32)
    check(ops.backward.default, (torch.randn_like(out), qa, k, v, out, lse, qia, ki, bi, cu_q,
                                 kl_grad, False, Bk, 0.0, 0.0, True, True, False),
          {"cu_seqlens_k": cu})
    check(ops.kl_divergence.default, (qa, k, lse, qia, ki, bi, cu_q, False, Bk, 0.0, 0.0),
          {"cu_seqlens_k": cu})
    dq, dk, dv, dq_idx, dk_idx = ops.backward(torch.randn_like(out), qa, k, v, out, lse, qia, ki,
                                              bi, cu_q, kl_grad, False, Bk, 0.0, 0.0, True, True,
                                              False, cu_seqlens_k=cu)
    assert dq.shape == qa.shape and dk.shape == k.shape and dk_idx.shape == ki.shape


def test_compile_with_keys_apart():
    torch._dynamo.reset()
    T = sum(LENS)
    rows = _held_rows()
    q, k, v, qi, ki = make_inputs(T, Hq, Hkv, Hi, Hik, D, Di, dtype=torch.float32)
    cu, cu_q = _offsets(LENS), _offsets(HELD)
    qa = q.detach()[rows].requires_grad_(True)
    qia = qi.detach()[rows].requires_grad_(True)

    def loss(q, k, v, qi, ki):
        out, kl = msa.sparse_attention(q, k, v, qi, ki, TOP_K, Bk, cu_seqlens=cu_q,
                                       cu_seqlens_k=cu)
        return out.square().sum() + kl

    compiled = torch.compile(loss, fullgraph=True, backend="aot_eager")
    g_c = grads(compiled(qa, k, v, qia, ki), (qa, k, v, qia, ki))
    g_e = grads(loss(qa, k, v, qia, ki), (qa, k, v, qia, ki))
    for a, b in zip(g_c, g_e):
        torch.testing.assert_close(a, b)


def test_bad_key_offsets_name_the_argument():
    T = sum(LENS)
    rows = _held_rows()
    q, k, v, qi, ki = make_inputs(T, Hq, Hkv, Hi, Hik, D, Di, requires_grad=False)
    cu, cu_q = _offsets(LENS), _offsets(HELD)
    sa = msa.sparse_attention
    with pytest.raises(ValueError, match="'cu_seqlens_k'"):
        sa(q[rows], k, v, qi[rows], ki, TOP_K, Bk, cu_seqlens=cu_q, cu_seqlens_k=cu.float())
    with pytest.raises(ValueError, match="'cu_seqlens_k'"):  # sequence 2: 40 keys, 45 queries
        sa(q[rows], k, v, qi[rows], ki, TOP_K, Bk, cu_seqlens=cu_q,
           cu_seqlens_k=_offsets([75, 0, 40, 33]))
    with pytest.raises(ValueError, match="'cu_seqlens_k'"):  # nseq differs
        sa(q[rows], k, v, qi[rows], ki, TOP_K, Bk, cu_seqlens=cu_q, cu_seqlens_k=_offsets([148]))
    with pytest.raises(ValueError, match="'v'"):  # v's rows are k's Tk
        sa(q[rows], k, v[:-1], qi[rows], ki, TOP_K, Bk, cu_seqlens=cu_q, cu_seqlens_k=cu)
