"""msa.flash_msa: the flash-msa drop-in twins, at a flash-msa-like shape (D scaled down)."""

import pytest
import torch

from msa import flash_msa as fm
from msa import reference as R
from conftest import assert_close, grads

B, S, Hq, Hkv, Hp, Hpk, D = 2, 384, 4, 2, 2, 1, 32


def _inputs(dtype):
    def r(h):
        return torch.randn(B, h, S, D, dtype=torch.float64).to(dtype).requires_grad_(True)
    return r(Hp), r(Hpk), r(Hq), r(Hkv), r(Hkv)


def _direct_reference(Qp, Kp, Q, K, V, top_k, scale, warmup):
    """Per batch row, in [S, H, D] token-major views, with the packed reference."""
    outs, kl_terms = [], []
    for b in range(B):
        tm = [x[b].transpose(0, 1) for x in (Q, K, V, Qp, Kp)]
        if warmup:
            o, kl, _ = R.warmup_attention_ref(*tm, scale=scale, scale_idx=scale)
        else:
            o, kl, _, _ = R.sparse_attention_ref(*tm, top_k // 128, 128, scale=scale,
                                                 scale_idx=scale)
        outs.append(o.reshape(S, Hq * D))
        kl_terms.append(kl)  # normalised by S*Hp
    return torch.stack(outs), sum(kl_terms) / B  # flash-msa: 1/(B*Hp*S)


# scale None: D**-0.5 and Dp**-0.5 (equal here); 0.3: both logits, main and proxy, at 0.3.
@pytest.mark.parametrize("top_k,scale", [(128, None), (256, 0.3)])
def test_flash_msa_func_vs_reference(top_k, scale):
    inputs = _inputs(torch.float32)
    out, kl = fm.flash_msa_func(*inputs, top_k, scale)
    assert out.shape == (B, S, Hq * D) and out.dtype == torch.float32
    assert kl.shape == () and kl.dtype == torch.float32
    r = [x.detach().double().requires_grad_(True) for x in inputs]
    r_out, r_kl = _direct_reference(*r, top_k, scale, warmup=False)
    assert_close(out, r_out, 2e-5, "attn_out")
    assert_close(kl, r_kl, 2e-4, "kl_loss")
    w = torch.randn(B, S, Hq * D, dtype=torch.float64)
    g = grads((out * w.float()).sum() + 0.1 * kl, inputs)
    rg = grads((r_out * w).sum() + 0.1 * r_kl, r)
    for name, a, b in zip(["dQ_proxy", "dK_proxy", "dQ", "dK", "dV"], g, rg):
        assert b.abs().max() > 0, name
        assert_close(a, b, 2e-4, name)


def test_flash_msa_warmup_vs_reference():
    inputs = _inputs(torch.bfloat16)
    out, kl = fm.flash_msa_warmup_func(*inputs, 256, 0.2)
    assert out.shape == (B, S, Hq * D) and out.dtype == torch.bfloat16
    r = [x.detach().double().requires_grad_(True) for x in inputs]
    r_out, r_kl = _direct_reference(*r, None, 0.2, warmup=True)
    assert_close(out, r_out, 2e-2, "attn_out")
    assert_close(kl, r_kl, 1e-4, "kl_loss")
    w = torch.randn(B, S, Hq * D, dtype=torch.float64)
    g = grads((out * w.bfloat16()).sum() + 0.5 * kl, inputs)
    rg = grads((r_out * w).sum() + 0.5 * r_kl, r)
    for name, a, b in zip(["dQ_proxy", "dK_proxy", "dQ", "dK", "dV"], g, rg):
        assert_close(a, b, 4e-2, name)


def test_aliases_and_kl_placeholder():
    assert fm.flash_msa_func_warmup is fm.flash_msa_warmup_func
    assert fm.sparse_attention_warmup is fm.flash_msa_warmup_func
    inputs = _inputs(torch.float32)
    out1, kl1 = fm.flash_msa_func(*inputs, 128, 0.15)
    out2, kl2 = fm.flash_msa_func(*inputs, 128, 0.15, kl_value=False)
    assert torch.equal(out1, out2) and kl1.item() > 0 and kl2.item() == 0.0


@pytest.mark.parametrize("top_k", [0, -128, 100, 130, 128.0, None])
def test_flash_msa_bad_top_k(top_k):
    inputs = _inputs(torch.float32)
    with pytest.raises(ValueError, match="top_k"):
        fm.flash_msa_func(*inputs, top_k, 0.1)


def test_flash_msa_bad_shapes():
    Qp, Kp, Q, K, V = _inputs(torch.float32)
    with pytest.raises(ValueError, match="'K'"):
        fm.flash_msa_func(Qp, Kp, Q, K[:, :, :128], V, 128, 0.1)
    with pytest.raises(ValueError, match="'Q_proxy'"):
        fm.flash_msa_func(Qp[0], Kp, Q, K, V, 128, 0.1)
