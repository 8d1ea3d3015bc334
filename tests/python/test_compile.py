"""torch.compile and torch.library.opcheck of the msa ops."""

import pytest
import torch

import msa
from conftest import grads, make_inputs

T, Hq, Hkv, Hi, Hik, D, Di, Bk, TOP_K = 72, 4, 2, 2, 1, 16, 8, 16, 3


def _loss(q, k, v, qi, ki, w, cu):
    out, kl = msa.sparse_attention(q, k, v, qi, ki, TOP_K, Bk, cu_seqlens=cu)
    return (out * w).sum() + 0.5 * kl


@pytest.mark.parametrize("backend", ["inductor", "aot_eager"])
def test_compile_fullgraph_forward_backward(backend):
    torch._dynamo.reset()
    q, k, v, qi, ki = make_inputs(T, Hq, Hkv, Hi, Hik, D, Di, torch.float32)
    w = torch.randn(T, Hq, D)
    cu = torch.tensor([0, 30, 72], dtype=torch.int32)
    compiled = torch.compile(_loss, fullgraph=True, backend=backend)
    loss_c = compiled(q, k, v, qi, ki, w, cu)
    g_c = grads(loss_c, (q, k, v, qi, ki))
    loss_e = _loss(q, k, v, qi, ki, w, cu)
    g_e = grads(loss_e, (q, k, v, qi, ki))
    torch.testing.assert_close(loss_c, loss_e, rtol=1e-5, atol=1e-5)
    for a, b in zip(g_c, g_e):
        assert b.abs().max() > 0
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)


def test_compile_warmup_and_flash_msa():
    torch._dynamo.reset()
    from msa.flash_msa import flash_msa_func

    q, k, v, qi, ki = make_inputs(T, Hq, Hkv, Hi, Hik, D, Di, torch.float32)

    def f(q, k, v, qi, ki):
        out, kl = msa.warmup_attention(q, k, v, qi, ki)
        B = 2
        to4 = lambda x: x.reshape(B, T // B, x.shape[1], x.shape[2]).transpose(1, 2)  # noqa
        out2, kl2 = flash_msa_func(to4(qi), to4(ki), to4(q), to4(k), to4(v), 128, 0.25)
        return out.square().sum() + kl + out2.sum() + kl2

    loss_c = torch.compile(f, fullgraph=True, backend="aot_eager")(q, k, v, qi, ki)
    g_c = grads(loss_c, (q, k, v, qi, ki))
    loss_e = f(q, k, v, qi, ki)
    g_e = grads(loss_e, (q, k, v, qi, ki))
    torch.testing.assert_close(loss_c, loss_e)
    for a, b in zip(g_c, g_e):
        torch.testing.assert_close(a, b)


def _opcheck(op, args):
    result = torch.library.opcheck(op, args)
    assert all(v == "SUCCESS" for v in result.values()), result


@pytest.mark.parametrize("mode", ["select", "given", "dense"])
def test_opcheck_forward(mode):
    q, k, v, qi, ki = make_inputs(T, Hq, Hkv, Hi, Hik, D, Di)
    cu = torch.tensor([0, 0, 50, 72], dtype=torch.int32)
    bi = None
    if mode == "given":
        bi = msa.select_blocks(qi.detach(), ki.detach(), TOP_K, Bk, cu_seqlens=cu)
    dense = mode == "dense"
    args = (q, k, v, qi, ki, bi, cu, dense, mode == "select", Bk, TOP_K, 0, 1, 0.0, 0.3, True,
            False)
    _opcheck(torch.ops.msa.forward.default, args)


def test_opcheck_backward_select_kl():
    q, k, v, qi, ki = make_inputs(T, Hq, Hkv, Hi, Hik, D, Di, requires_grad=False)
    cu = torch.tensor([0, 40, 72], dtype=torch.int32)
    _opcheck(torch.ops.msa.select_blocks.default, (qi, ki, cu, TOP_K, Bk, 1, 1, 0.0))
    bi = torch.ops.msa.select_blocks(qi, ki, cu, TOP_K, Bk, 1, 1, 0.0)
    out, lse, _, _ = torch.ops.msa.forward(q, k, v, qi, ki, bi, cu, False, False, Bk, TOP_K, 1,
                                           1, 0.0, 0.0, False, False)
    dout = torch.randn_like(out)
    kl_grad = torch.tensor([0.5], dtype=torch.float32)
    for want_q, want_k in [(True, True), (False, False), (True, False)]:
        _opcheck(torch.ops.msa.backward.default,
                 (dout, q, k, v, out, lse, qi, ki, bi, cu, kl_grad, False, Bk, 0.0, 0.0,
                  want_q, want_k, False))
    _opcheck(torch.ops.msa.kl_divergence.default,
             (q, k, lse, qi, ki, bi, cu, False, Bk, 0.0, 0.0))
    out, lse, _, _ = torch.ops.msa.forward(q, k, v, qi, ki, None, cu, True, False, Bk, TOP_K, 0,
                                           1, 0.0, 0.0, False, False)
    _opcheck(torch.ops.msa.kl_divergence.default,
             (q, k, lse, qi, ki, None, cu, True, Bk, 0.0, 0.0))
    _opcheck(torch.ops.msa.backward.default,
             (torch.randn_like(out), q, k, v, out, lse, qi, ki, None, cu, None, True, Bk, 0.0,
              0.0, True, True, False))
