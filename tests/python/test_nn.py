"""msa.nn.MSAAttention on the CPU backend: the same numbers as the functional API, rotary
embeddings, gradients, the warmup mode, bad configurations, and a few dozen training steps."""

import math

import pytest
import torch

import msa
from msa.nn import MSAAttention, positions_of, rotary, rotary_table

SMALL = dict(d_model=32, n_heads=4, n_kv_heads=2, head_dim=8, n_idx_heads=2, n_idx_key_heads=1,
             idx_head_dim=8, block_size=4, top_k=3, sink_blocks=1, local_blocks=1)


def small(**kw):
    cfg = dict(SMALL, dtype=torch.float64)
    cfg.update(kw)
    return MSAAttention(**cfg)


def test_positions_and_rotary():
    cu = torch.tensor([0, 5, 5, 9], dtype=torch.int32)
    assert positions_of(cu, 9, "cpu").tolist() == [0, 1, 2, 3, 4, 0, 1, 2, 3]
    assert positions_of(None, 3, "cpu").tolist() == [0, 1, 2]
    # each pair (x[j], x[j + d/2]) turns by pos * theta^(-2j/d), as a complex product
    x = torch.randn(6, 2, 8, dtype=torch.float64)
    pos = torch.tensor([0, 1, 2, 7, 100, 3])
    got = rotary(x, pos, 500.0)
    z = torch.complex(x[..., :4], x[..., 4:])
    ang = pos[:, None].double() * 500.0 ** (-torch.arange(4).double() * 2 / 8)
    w = z * torch.polar(torch.ones_like(ang), ang)[:, None, :]
    torch.testing.assert_close(got, torch.cat([w.real, w.imag], -1), rtol=1e-6, atol=1e-6)
    assert torch.equal(rotary(x, torch.zeros(6, dtype=torch.long), 500.0), x)
    # a table shared between tensors gives the same bits as each tensor's own
    table = rotary_table(pos, 8, 500.0, torch.float64)
    assert torch.equal(rotary(x, pos, 500.0, table), got)


def test_rotary_gradient_and_rounding():
    # the gradient is the rotation's adjoint (the gradient turned back)
    x = torch.randn(5, 3, 8, dtype=torch.float64, requires_grad=True)
    pos = torch.tensor([0, 1, 2, 9, 40])
    assert torch.autograd.gradcheck(lambda t: rotary(t, pos, 500.0), (x,))
    g = torch.randn(5, 3, 8, dtype=torch.float64)
    (gx,) = torch.autograd.grad(rotary(x, pos, 500.0), x, g)
    torch.testing.assert_close(gx, rotary(g, -pos, 500.0), rtol=1e-12, atol=1e-12)
    # 16-bit inputs: computed in float32 and rounded once, so within half an ulp of the exact
    # rotation (by the same float32 angles) of the rounded inputs, up to float32's error on the
    # two products (which a difference may leave larger than the result)
    for dt, mant, emin in ((torch.bfloat16, 7, -126), (torch.float16, 10, -14)):
        xl = (torch.randn(64, 4, 16, dtype=torch.float64) * 3).to(dt)
        pos = torch.arange(64) * 37
        got = rotary(xl, pos, 10000.0)
        assert got.dtype == dt
        cos, sin = rotary_table(pos, 16, 10000.0, torch.float32)
        exact = rotary(xl.double(), pos, 10000.0, (cos.double(), sin.double()))
        e = torch.floor(torch.log2(exact.abs().clamp_min(2.0 ** emin))).clamp_min(emin)
        ulp = torch.exp2(e - mant)
        a, b = xl.double()[..., :8].abs(), xl.double()[..., 8:].abs()
        slack = 2.0 ** -22 * (a + b).repeat(1, 1, 2)
        assert ((got.double() - exact).abs() <= 0.5 * ulp + slack).all(), dt


@pytest.mark.parametrize("mode,sink,local", [("sparse", 1, 1), ("sparse", 0, 2), ("warmup", 1, 1)])
def test_matches_functional_api(mode, sink, local):
    m = small(kl_weight=0.25, kl_value=True, mode=mode, sink_blocks=sink, local_blocks=local,
              rope_theta=500.0)
    cu = torch.tensor([0, 21, 21, 37], dtype=torch.int32)
    x = torch.randn(37, 32, dtype=torch.float64)
    y, aux = m(x, cu)
    q, k, v, qi, ki = m.project(x, cu)
    if mode == "sparse":
        out, kl = msa.sparse_attention(q, k, v, qi, ki, 3, 4, cu_seqlens=cu, sink_blocks=sink,
                                       local_blocks=local)
    else:
        out, kl = msa.warmup_attention(q, k, v, qi, ki, cu_seqlens=cu)
    assert torch.equal(y, m.o_proj(out.reshape(37, 32)))
    assert torch.equal(aux, 0.25 * kl) and float(kl.detach()) > 0
    # rotary at positions restarting in each sequence (the second sequence's first token
    # projects like a first token), at the module's base, on q, k, q_idx and k_idx, not on v
    pos = positions_of(cu, 37, "cpu")
    assert torch.equal(q, rotary(m.q_proj(x).view(37, 4, 8), pos, 500.0))
    assert torch.equal(k, rotary(m.k_proj(x).view(37, 2, 8), pos, 500.0))
    assert torch.equal(v, m.v_proj(x).view(37, 2, 8))
    assert torch.equal(qi, rotary(m.q_idx_proj(x).view(37, 2, 8), pos, 500.0))
    assert torch.equal(ki, rotary(m.k_idx_proj(x).view(37, 1, 8), pos, 500.0))
    # the main branch alone (a dense baseline of the same weights): the same q, k, v, no index
    q2, k2, v2, qi2, ki2 = m.project(x, cu, index=False)
    assert torch.equal(q2, q) and torch.equal(k2, k) and torch.equal(v2, v)
    assert qi2 is None and ki2 is None


def test_fp8_selection_scores(monkeypatch):
    """select_scores="fp8": the module's output is the functional API's over the selection of
    the E4M3 copies (fp8_rerank and fp8_rerank_slots passed on)."""
    cu = torch.tensor([0, 21, 21, 37], dtype=torch.int32)
    x = torch.randn(37, 32, dtype=torch.float64)
    for rerank, slots, top_k in ((0, 0, 3), (1, 0, 3), (1, 1, 5)):
        m = small(select_scores="fp8", fp8_rerank=rerank, fp8_rerank_slots=slots, top_k=top_k)
        y, _ = m(x, cu)
        q, k, v, qi, ki = m.project(x, cu)
        out, _ = msa.sparse_attention(q, k, v, qi, ki, top_k, 4, cu_seqlens=cu, sink_blocks=1,
                                      local_blocks=1, select_scores="fp8", fp8_rerank=rerank,
                                      fp8_rerank_slots=slots)
        assert torch.equal(y, m.o_proj(out.reshape(37, 32)))
    with pytest.raises(ValueError, match="fp8_rerank"):
        small(select_scores="fp8", fp8_rerank=-1)
    with pytest.raises(ValueError, match="fp8_rerank_slots"):
        small(select_scores="fp8", fp8_rerank_slots=-1)
    # the options reach the call (on this small input the slots may not change the selection)
    seen = {}
    real = msa.sparse_attention

    def spy(*args, **kwargs):
        seen.update(kwargs)
        return real(*args, **kwargs)

    monkeypatch.setattr(msa, "sparse_attention", spy)
    small(select_scores="fp8", fp8_rerank=3, fp8_rerank_slots=2, top_k=5)(x, cu)
    assert (seen["select_scores"], seen["fp8_rerank"], seen["fp8_rerank_slots"]) == ("fp8", 3, 2)


def test_batched_input_equals_packed():
    m = small()
    x = torch.randn(3, 10, 32, dtype=torch.float64)
    y, aux = m(x)
    cu = torch.arange(4, dtype=torch.int32) * 10
    y2, aux2 = m(x.reshape(30, 32), cu)
    assert torch.equal(y.reshape(30, 32), y2) and torch.equal(aux, aux2)
    with pytest.raises(ValueError, match="'cu_seqlens'"):
        m(x, cu)
    with pytest.raises(ValueError, match="'x'"):
        m(torch.randn(5, 31, dtype=torch.float64))


def test_sparse_equals_warmup_when_k_covers_all_blocks():
    m = small(top_k=8, sink_blocks=0, kl_value=True)  # 30 tokens, 8 blocks of 4
    x = torch.randn(30, 32, dtype=torch.float64)
    y_sparse, kl_sparse = m(x)
    m.set_mode("warmup")
    y_warm, kl_warm = m(x)
    torch.testing.assert_close(y_sparse, y_warm, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(kl_sparse, kl_warm, rtol=1e-10, atol=1e-12)


def test_gradients():
    m = small(kl_weight=0.5)
    x = torch.randn(26, 32, dtype=torch.float64, requires_grad=True)
    y, aux = m(x)
    (y.square().sum() + aux).backward()
    for name, p in m.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, name
    assert x.grad.abs().sum() > 0
    # the task loss alone does not reach the index branch; the KL alone does not reach q, k, v
    m.zero_grad()
    y, aux = m(x)
    y.square().sum().backward()
    assert m.q_idx_proj.weight.grad is None or m.q_idx_proj.weight.grad.abs().sum() == 0
    m.zero_grad()
    y, aux = m(x)
    aux.backward()
    assert m.q_idx_proj.weight.grad.abs().sum() > 0
    assert m.q_proj.weight.grad is None or m.q_proj.weight.grad.abs().sum() == 0


@pytest.mark.parametrize("mode", ["sparse", "warmup"])
def test_kl_value_off(mode):
    """kl_value=False: the auxiliary loss is a zero, and every gradient is the one with the
    exact value."""
    x = torch.randn(26, 32, dtype=torch.float64)
    got = []
    for kl_value in (True, False):
        torch.manual_seed(1)
        m = small(kl_weight=0.5, mode=mode, kl_value=kl_value)
        y, aux = m(x)
        assert (float(aux.detach()) > 0) == kl_value
        (y.square().sum() + aux).backward()
        got.append([p.grad for p in m.parameters()])
    for a, b in zip(*got):
        assert torch.equal(a, b)


def test_activation_checkpointing_gives_the_same_gradients():
    m = small(kl_weight=0.5)
    x = torch.randn(26, 32, dtype=torch.float64, requires_grad=True)
    y, aux = m(x)
    (y.square().sum() + aux).backward()
    ref = [p.grad.clone() for p in m.parameters()]
    m.zero_grad()
    y, aux = torch.utils.checkpoint.checkpoint(m, x, use_reentrant=False)
    (y.square().sum() + aux).backward()
    for a, b in zip(ref, [p.grad for p in m.parameters()]):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("kw, arg", [
    (dict(n_heads=6, n_kv_heads=4), "n_kv_heads"),
    (dict(n_idx_heads=3), "n_idx_heads"),
    (dict(n_heads=4, n_kv_heads=2, n_idx_heads=8), "n_idx_heads"),
    (dict(n_idx_key_heads=3), "n_idx_key_heads"),
    (dict(idx_head_dim=7), "idx_head_dim"),
    (dict(head_dim=5), "head_dim"),
    (dict(block_size=6), "block_size"),
    (dict(top_k=0), "top_k"),
    (dict(local_blocks=0), "local_blocks"),
    (dict(kl_weight=-1.0), "kl_weight"),
    (dict(mode="dense"), "mode"),
    (dict(select_scores="e4m3"), "select_scores"),
    (dict(sink_blocks=-1), "sink_blocks"),
    (dict(kl_weight=float("nan")), "kl_weight"),
    (dict(rope_theta=0.0), "rope_theta"),
    (dict(fp8_rerank=65), "fp8_rerank"),
    (dict(d_model=30, head_dim=None), "head_dim"),
])
def test_bad_configurations_name_the_argument(kw, arg):
    with pytest.raises(ValueError, match=f"'{arg}'"):
        small(**kw)


def _teacher_mass_in_selection(m, x, chance=False):
    """Share of the dense teacher's attention mass (mean over each index head's query heads)
    that the index branch's selection keeps, averaged over tokens and index heads; with
    `chance`, that of a random selection (the local block and random earlier blocks)."""
    with torch.no_grad():
        q, k, _, qi, ki = m.project(x, None)
        T, Hq, D = q.shape
        G, Gi, Bk = Hq // m.n_kv_heads, Hq // m.n_idx_heads, m.block_size
        s = torch.einsum("thd,jhd->htj", q, k.repeat_interleave(G, 1)) / math.sqrt(D)
        s = s.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), -math.inf)
        pi = s.softmax(-1).view(m.n_idx_heads, Gi, T, T).mean(1)  # [Hi, T, T]
        if chance:  # random index vectors select random blocks
            qi, ki = torch.randn_like(qi), torch.randn_like(ki)
        bi = msa.select_blocks(qi, ki, m.top_k, Bk, sink_blocks=m.sink_blocks,
                               local_blocks=m.local_blocks)  # [T, Hi, k]
        blk = torch.arange(T) // Bk
        sel = (bi.long().permute(1, 0, 2)[..., None] == blk[None, None, None, :]).any(2)
        return float((pi * sel).sum(-1).mean())


def test_warmup_training():
    """A few dozen steps of the warmup phase on the CPU: the task loss falls; trained by the KL
    alone (main branch frozen, so the teacher stays put), the index branch's KL falls and its
    selection keeps more of the teacher's attention than at the start."""
    torch.manual_seed(0)
    d, T = 32, 48
    m = MSAAttention(d, 4, 2, head_dim=8, n_idx_heads=2, idx_head_dim=8, block_size=4, top_k=3,
                     sink_blocks=0, local_blocks=1, kl_value=True, mode="warmup",
                     dtype=torch.float64)
    x = torch.randn(T, d, dtype=torch.float64)
    target = torch.randn(T, d, dtype=torch.float64)
    opt = torch.optim.Adam(m.parameters(), lr=3e-2)
    losses = []
    for _ in range(30):
        y, aux = m(x)
        loss = (y - target).square().mean()
        opt.zero_grad()
        (loss + aux).backward()
        opt.step()
        losses.append(float(loss))
    assert losses[-1] < 0.8 * losses[0], losses

    index = list(m.q_idx_proj.parameters()) + list(m.k_idx_proj.parameters())
    opt = torch.optim.Adam(index, lr=3e-2)
    recall0 = _teacher_mass_in_selection(m, x)
    kls = []
    for _ in range(40):
        _, aux = m(x)
        opt.zero_grad()
        aux.backward()
        opt.step()
        kls.append(float(aux))
    recall1 = _teacher_mass_in_selection(m, x)
    chance = sum(_teacher_mass_in_selection(m, x, chance=True) for _ in range(8)) / 8
    assert kls[-1] < 0.5 * kls[0], kls
    assert recall1 > recall0 and recall1 > chance + 0.05, (recall0, recall1, chance)


def test_compiles_as_one_graph():
    m = small(kl_weight=0.5, kl_value=True)
    x = torch.randn(26, 32, dtype=torch.float64, requires_grad=True)
    cu = torch.tensor([0, 11, 26], dtype=torch.int32)
    y, aux = m(x, cu)
    (y.square().sum() + aux).backward()
    ref = [p.grad.clone() for p in m.parameters()]
    m.zero_grad()
    yc, auxc = torch.compile(m, backend="aot_eager", fullgraph=True)(x, cu)
    (yc.square().sum() + auxc).backward()
    assert torch.equal(y, yc) and torch.equal(aux, auxc)
    for a, b in zip(ref, [p.grad for p in m.parameters()]):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
