"""Bad input raises ValueError naming the argument (docs/contract.md §7); the binding's small surface."""

import collections
import contextlib

import pytest
import torch

import msa
from msa import _C
from conftest import make_inputs

T, Hq, Hkv, Hi, Hik, D, Di, Bk = 40, 4, 2, 2, 1, 8, 8, 8


@pytest.fixture
def x():
    return make_inputs(T, Hq, Hkv, Hi, Hik, D, Di, torch.float32, requires_grad=False)


def _raises(arg, fn, *args, **kwargs):
    with pytest.raises(ValueError, match=f"'{arg}'"):
        fn(*args, **kwargs)


def test_bad_tensors(x):
    q, k, v, qi, ki = x
    sa = msa.sparse_attention
    _raises("q", sa, q[0], k, v, qi, ki)                                   # rank
    _raises("q", sa, q.to(torch.int32), k, v, qi, ki)                      # dtype
    _raises("k", sa, q, k[:, :, :4], v, qi, ki)                            # head dim
    _raises("k", sa, q, torch.randn(T, 3, D), torch.randn(T, 3, D), qi, ki)  # Hkv !| Hq
    _raises("v", sa, q, k, v.double(), qi, ki)                             # dtype mismatch
    _raises("v", sa, q, k, v[:30], qi, ki)                                 # token count
    _raises("q_idx", sa, q, k, v, torch.randn(T, 3, Di), ki)               # Hi vs Hq, Hkv
    _raises("q_idx", sa, q, k, v, None, ki)                                # missing
    _raises("k_idx", sa, q, k, v, qi, torch.randn(T, 3, Di))               # Hik !| Hi
    _raises("k_idx", sa, q, k, v, qi, ki[:, :, :4])                        # Di mismatch
    _raises("q", msa.warmup_attention, "not a tensor", k, v, qi, ki)


def test_bad_options(x):
    q, k, v, qi, ki = x
    sa = msa.sparse_attention
    _raises("top_k", sa, q, k, v, qi, ki, top_k=0)
    _raises("top_k", sa, q, k, v, qi, ki, top_k=2, sink_blocks=2, local_blocks=1)
    _raises("block_size", sa, q, k, v, qi, ki, block_size=0)
    _raises("local_blocks", sa, q, k, v, qi, ki, local_blocks=0)
    _raises("sink_blocks", sa, q, k, v, qi, ki, sink_blocks=-1)
    _raises("scale", sa, q, k, v, qi, ki, scale=0.0)
    _raises("scale_idx", sa, q, k, v, qi, ki, scale_idx=float("nan"))
    _raises("top_k", msa.select_blocks, qi, ki, top_k=-3)


def test_bad_cu_seqlens(x):
    q, k, v, qi, ki = x
    sa = msa.sparse_attention
    for cu in ([0, 10, 30], [0, 30, 10, 40], [1, 40], [0]):
        _raises("cu_seqlens", sa, q, k, v, qi, ki, 2, Bk,
                cu_seqlens=torch.tensor(cu, dtype=torch.int32))
    _raises("cu_seqlens", sa, q, k, v, qi, ki, 2, Bk, cu_seqlens=torch.tensor([0.0, 40.0]))
    _raises("cu_seqlens", sa, q, k, v, qi, ki, 2, Bk,
            cu_seqlens=torch.tensor([[0, 40]], dtype=torch.int32))


def test_bad_block_idx(x):
    q, k, v, qi, ki = x
    sa = msa.sparse_attention
    good = msa.select_blocks(qi, ki, 3, Bk)
    bad = good.clone()
    bad[5, 0, 0] = 3  # token 5 is in block 0: block 3 is in its future
    _raises("block_idx", sa, q, k, v, qi, ki, block_idx=bad, block_size=Bk)
    bad = good.clone()
    bad[20, 1] = torch.tensor([1, 1, 2], dtype=torch.int32)  # duplicate
    _raises("block_idx", sa, q, k, v, qi, ki, block_idx=bad, block_size=Bk)
    bad = good.clone()
    bad[30, 0, 0] = -2
    _raises("block_idx", sa, q, k, v, qi, ki, block_idx=bad, block_size=Bk)
    _raises("block_idx", sa, q, k, v, qi, ki, block_idx=good.long(), block_size=Bk)
    with pytest.raises(ValueError, match="block_idx"):  # Hi of block_idx vs q_idx
        sa(q, k, v, qi, ki, block_idx=good[:, :1], block_size=Bk)
    _raises("block_idx", sa, q, k, v, None, None, block_idx=good[:, :, :, None], block_size=Bk)
    _raises("lse", msa.kl_divergence, q, k, torch.zeros(T, Hq + 1), qi, ki, good,
            block_size=Bk)


def test_binding_errors_and_info(x):
    q, k, v, qi, ki = x
    assert msa.version() == "0.1.0" == msa.__version__
    assert msa.backend_available("cpu") is True
    assert isinstance(msa.backend_available("cuda"), bool)
    with pytest.raises(ValueError, match="device_type"):
        msa.backend_available("tpu")
    bi = torch.empty(T, Hi, 2, dtype=torch.int32)
    # unsupported DLPack dtype, 0-dim tensor, bad mode: all name the argument
    with pytest.raises(ValueError, match="'q_idx'"):
        _C.select_blocks(qi.to(torch.uint8), ki, None, bi, top_k=2, block_size=Bk)
    with pytest.raises(ValueError, match="'k_idx'"):
        _C.select_blocks(qi, torch.tensor(1.0), None, bi, top_k=2, block_size=Bk)
    out, lse = torch.empty_like(q), torch.empty(T, Hq)
    with pytest.raises(ValueError, match="'mode'"):
        _C.forward(q, k, v, None, None, False, None, None, out, lse, mode=5)
    # outputs of the wrong shape are rejected by the core, naming them
    with pytest.raises(ValueError, match="'lse'"):
        _C.forward(q, k, v, None, None, False, None, None, out, lse[:, :1], mode=1)
    # a plain call works and fills the outputs
    _C.forward(q, k, v, None, None, False, None, None, out, lse, mode=1)
    assert torch.isfinite(out).all() and torch.isfinite(lse).all()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_tensors():
    """CUDA tensors reach the CUDA backend, or a NotImplementedError says why not; inputs its
    kernels do not take are refused naming the argument (tests/python/test_cuda.py checks the
    results). The shapes are the fast build's one variant (bfloat16, head dim 128, Bk 128)."""
    T, D, Di, Bk = 300, 128, 128, 128
    q, k, v, qi, ki = make_inputs(T, Hq, Hkv, Hi, Hik, D, Di, torch.bfloat16,
                                  requires_grad=False, device="cuda")
    if not msa.backend_available("cuda"):
        with pytest.raises(NotImplementedError, match="CUDA"):
            msa.sparse_attention(q, k, v, qi, ki, 2, Bk, kl_value=False)
        return
    bi = msa.select_blocks(qi, ki, 2, Bk)
    out, kl = msa.sparse_attention(q, k, v, None, None, block_idx=bi, block_size=Bk,
                                   kl_value=False)
    assert out.is_cuda and out.dtype == torch.bfloat16 and kl.is_cuda and float(kl) == 0.0
    cpu = [t.cpu().float() for t in (q, k, v)]
    out_c, _ = msa.sparse_attention(*cpu, None, None, block_idx=bi.cpu(), block_size=Bk)
    torch.testing.assert_close(out.cpu().float(), out_c, rtol=2e-2, atol=2e-2)
    with pytest.raises(NotImplementedError, match="'block_size'"):
        msa.sparse_attention(q, k, v, qi, ki, 2, 8, kl_value=False)
    with pytest.raises(NotImplementedError, match="'q'"):
        msa.sparse_attention(q.float(), k.float(), v.float(), None, None, block_idx=bi,
                             block_size=Bk, kl_value=False)


def test_cu_seqlens_beyond_int32(x):
    """int64 offsets that do not fit in int32 are refused, not wrapped by a cast (which turned
    [0, 2**32 + 20, 40] into the valid [0, 20, 40])."""
    q, k, v, qi, ki = x
    sa = msa.sparse_attention
    for cu in ([0, 2**32 + 20, 40], [0, 2**31, 40], [0, -(2**31) - 1, 40], [-(2**32), 40]):
        _raises("cu_seqlens", sa, q, k, v, qi, ki, 2, Bk, cu_seqlens=torch.tensor(cu))
        _raises("cu_seqlens", msa.select_blocks, qi, ki, 2, Bk, cu_seqlens=torch.tensor(cu))
        _raises("cu_seqlens", msa.warmup_attention, q, k, v, qi, ki, cu_seqlens=torch.tensor(cu))
    # int64 and int16 offsets that fit are converted and give the int32 result.
    want, _ = sa(q, k, v, qi, ki, 2, Bk, cu_seqlens=torch.tensor([0, 20, 40], dtype=torch.int32))
    for dt in (torch.int64, torch.int16):
        got, _ = sa(q, k, v, qi, ki, 2, Bk, cu_seqlens=torch.tensor([0, 20, 40], dtype=dt))
        assert torch.equal(got, want)


def test_ints_beyond_int32_name_the_argument(x):
    """Integers outside int32 give a ValueError naming the argument (not a TypeError of the
    binding's conversion), from the public API, the ops and the binding alike."""
    q, k, v, qi, ki = x
    sa = msa.sparse_attention
    for big in (2**31, 2**40, 2**70, -(2**31) - 1):
        _raises("top_k", sa, q, k, v, qi, ki, top_k=big)
        _raises("top_k", msa.select_blocks, qi, ki, top_k=big)
        _raises("block_size", sa, q, k, v, qi, ki, block_size=big)
        _raises("sink_blocks", sa, q, k, v, qi, ki, sink_blocks=big)
        _raises("local_blocks", sa, q, k, v, qi, ki, local_blocks=big)
        _raises("block_size", msa.kl_divergence, q, k, torch.zeros(T, Hq), qi, ki, None,
                block_size=big)
        if abs(big) < 2**63:  # torch's dispatcher itself takes no int beyond int64
            _raises("top_k", torch.ops.msa.select_blocks, qi, ki, None, big, Bk, 0, 1, 0.0)
            _raises("top_k", torch.ops.msa.forward, q, k, v, qi, ki, None, None, False, True,
                    Bk, big, 0, 1, 0.0, 0.0, False, False)
            _raises("block_size", torch.ops.msa.forward, q, k, v, None, None, None, None, True,
                    False, big, 16, 0, 1, 0.0, 0.0, False, False)
        bi = torch.empty(T, Hi, 2, dtype=torch.int32)
        _raises("top_k", _C.select_blocks, qi, ki, None, bi, top_k=big, block_size=Bk)
        _raises("sink_blocks", _C.select_blocks, qi, ki, None, bi, top_k=2, block_size=Bk,
                sink_blocks=big)
        out, lse = torch.empty_like(q), torch.empty(T, Hq)
        _raises("mode", _C.forward, q, k, v, None, None, False, None, None, out, lse, mode=big)
        _raises("block_size", _C.kl_divergence, q, k, lse, qi, ki, None, None,
                torch.zeros(1), mode=1, block_size=big)
    # top_k above the library's limit names top_k (it used to name block_idx).
    _raises("top_k", sa, q, k, v, qi, ki, top_k=2**21)
    bi = torch.empty(T, Hi, 2, dtype=torch.int32)
    _raises("top_k", _C.select_blocks, qi, ki, None, bi, top_k=2**21, block_size=Bk)


def test_options_checked_when_unused(x):
    """Option ranges hold whether or not the call uses them (a caller's block_idx makes the
    selection options unused); block_size is a power of two for every backend."""
    q, k, v, qi, ki = x
    sa = msa.sparse_attention
    bi = msa.select_blocks(qi, ki, 3, Bk)
    _raises("top_k", sa, q, k, v, qi, ki, top_k=-3, block_idx=bi, block_size=Bk)
    _raises("top_k", sa, q, k, v, None, None, top_k=0, block_idx=bi, block_size=Bk)
    _raises("local_blocks", sa, q, k, v, qi, ki, local_blocks=0, block_idx=bi, block_size=Bk)
    out, lse = torch.empty_like(q), torch.empty(T, Hq)
    _raises("top_k", _C.forward, q, k, v, None, bi, False, None, None, out, lse, top_k=-3,
            block_size=Bk)
    _raises("top_k", _C.forward, q, k, v, None, None, False, None, None, out, lse, mode=1,
            top_k=0)
    for bs in (3, 24, 48, 96, 100):
        _raises("block_size", sa, q, k, v, qi, ki, 2, bs)
        _raises("block_size", msa.select_blocks, qi, ki, 2, bs)
        _raises("block_size", sa, q, k, v, None, None, block_idx=bi, block_size=bs)


def test_kl_pass(x):
    q, k, v, qi, ki = x
    for t in (q, k, v, qi, ki):
        t.requires_grad_(True)
    _raises("kl_pass", msa.sparse_attention, q, k, v, qi, ki, 2, Bk, kl_pass="fast")
    _raises("kl_pass", msa.warmup_attention, q, k, v, qi, ki, kl_pass="")
    grads = {}
    for kp in ("auto", "fused", "separate", "teacher"):
        out, kl = msa.sparse_attention(q, k, v, qi, ki, 2, Bk, kl_pass=kp)
        grads[kp] = torch.autograd.grad(out.square().sum() + 3 * kl, (q, k, v, qi, ki))
    for kp in ("fused", "separate", "teacher"):  # the CPU backend has one implementation
        for a, b in zip(grads[kp], grads["auto"]):
            assert torch.equal(a, b)
    # the op and the binding
    qd, kd, vd, qid, kid = (t.detach() for t in (q, k, v, qi, ki))
    bi = msa.select_blocks(qid, kid, 2, Bk)
    out, lse, _, _ = torch.ops.msa.forward(qd, kd, vd, qid, kid, bi, None, False, False, Bk, 2,
                                           0, 1, 0.0, 0.0, False, False)
    dout = torch.randn_like(out)
    ref = torch.ops.msa.backward(dout, qd, kd, vd, out, lse, qid, kid, bi, None, None, False, Bk,
                                 0.0, 0.0, True, True, False)
    got = torch.ops.msa.backward(dout, qd, kd, vd, out, lse, qid, kid, bi, None, None, False, Bk,
                                 0.0, 0.0, True, True, False, kl_pass="separate",
                                 check_values=False)
    for a, b in zip(got, ref):
        assert torch.equal(a, b)
    _raises("kl_pass", torch.ops.msa.backward, dout, qd, kd, vd, out, lse, qid, kid, bi, None,
            None, False, Bk, 0.0, 0.0, True, True, False, kl_pass="both")
    dq, dk, dv = torch.empty_like(qd), torch.empty_like(kd), torch.empty_like(vd)
    _raises("kl_pass", _C.backward, qd, kd, vd, out, lse, dout, None, bi, dq, dk, dv,
            block_size=Bk, kl_pass="Auto")


def test_dq_pass(x):
    q, k, v, qi, ki = x
    for t in (q, k, v, qi, ki):
        t.requires_grad_(True)
    _raises("dq_pass", msa.sparse_attention, q, k, v, qi, ki, 2, Bk, dq_pass="kv")
    _raises("bwd_chunk_tokens", msa.sparse_attention, q, k, v, qi, ki, 2, Bk, bwd_chunk_tokens=-1)
    grads = {}
    for dp, chunk in (("auto", 0), ("query_tile", 0), ("from_ds", 0), ("from_ds", 5)):
        out, kl = msa.sparse_attention(q, k, v, qi, ki, 2, Bk, dq_pass=dp, bwd_chunk_tokens=chunk)
        grads[dp, chunk] = torch.autograd.grad(out.square().sum() + 3 * kl, (q, k, v, qi, ki))
    for key, g in grads.items():  # the CPU backend has one implementation
        for a, b in zip(g, grads["auto", 0]):
            assert torch.equal(a, b), key
    qd, kd, vd, qid, kid = (t.detach() for t in (q, k, v, qi, ki))
    bi = msa.select_blocks(qid, kid, 2, Bk)
    out, lse, _, _ = torch.ops.msa.forward(qd, kd, vd, qid, kid, bi, None, False, False, Bk, 2,
                                           0, 1, 0.0, 0.0, False, False)
    dout = torch.randn_like(out)
    _raises("dq_pass", torch.ops.msa.backward, dout, qd, kd, vd, out, lse, qid, kid, bi, None,
            None, False, Bk, 0.0, 0.0, True, True, False, dq_pass="ds")
    dq, dk, dv = torch.empty_like(qd), torch.empty_like(kd), torch.empty_like(vd)
    _raises("dq_pass", _C.backward, qd, kd, vd, out, lse, dout, None, bi, dq, dk, dv,
            block_size=Bk, dq_pass="FromDs")
    _raises("bwd_chunk_tokens", _C.backward, qd, kd, vd, out, lse, dout, None, bi, dq, dk, dv,
            block_size=Bk, bwd_chunk_tokens=-2)


def test_fwd_pass(x):
    q, k, v, qi, ki = x
    _raises("fwd_pass", msa.sparse_attention, q, k, v, qi, ki, 2, Bk, fwd_pass="kv")
    bi = msa.select_blocks(qi, ki, 2, Bk)
    ref, _ = msa.sparse_attention(q, k, v, None, None, block_idx=bi, block_size=Bk)
    for fp in ("query_tile", "kv_block", "split"):  # the CPU backend has one implementation
        out, _ = msa.sparse_attention(q, k, v, None, None, block_idx=bi, block_size=Bk, fwd_pass=fp,
                                      fwd_chunk_tokens=7)
        assert torch.equal(out, ref)
    _raises("fwd_chunk_tokens", msa.sparse_attention, q, k, v, qi, ki, 2, Bk, fwd_chunk_tokens=-1)
    _raises("fwd_chunk_tokens", torch.ops.msa.forward, q, k, v, None, None, bi, None, False, False,
            Bk, 2, 0, 1, 0.0, 0.0, False, False, fwd_chunk_tokens=-3)
    _raises("fwd_pass", _C.forward, q, k, v, None, bi, False, None, None, torch.empty_like(q),
            torch.empty(q.shape[:2]), block_size=Bk, fwd_pass="KV")


def test_select_scores(x):
    q, k, v, qi, ki = x
    _raises("select_scores", msa.select_blocks, qi, ki, 2, Bk, select_scores="e4m3")
    _raises("select_scores", msa.sparse_attention, q, k, v, qi, ki, 2, Bk, select_scores="FP8")
    _raises("select_scores", _C.select_blocks, qi, ki, None, torch.empty(T, Hi, 2, dtype=torch.int32),
            block_size=Bk, top_k=2, select_scores="bf16")


def test_check_values_keyword(x, monkeypatch):
    """check_values reaches the library; on the CPU the values are checked regardless (free).
    The ops turn it off on CUDA while the current stream is being captured."""
    q, k, v, qi, ki = x
    bi = torch.empty(T, Hi, 2, dtype=torch.int32)
    bad_cu = torch.tensor([0, 30, 20, 40], dtype=torch.int32)
    for check in (True, False):
        _raises("cu_seqlens", _C.select_blocks, qi, ki, bad_cu, bi, top_k=2, block_size=Bk,
                check_values=check)
    _C.select_blocks(qi, ki, None, bi, top_k=2, block_size=Bk, check_values=False)
    assert torch.equal(bi, msa.select_blocks(qi, ki, 2, Bk))

    from msa import _ops
    seen = []

    def fake(*args, stream, check_values, workspace_alloc, **kwargs):
        seen.append(check_values)

    class _Stream:
        cuda_stream = 0

    monkeypatch.setattr(torch.cuda, "device", lambda d: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "current_stream", lambda d=None: _Stream())
    for capturing in (False, True):
        monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda c=capturing: c)
        _ops._launch(fake, torch.device("cuda", 0))
        _ops._launch(fake, torch.device("cuda", 0), check_values=False)
    _ops._launch(fake, torch.device("cpu"), check_values=False)
    assert seen == [True, False, False, False, True]
    seen.clear()
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    with msa.value_checks(False):
        _ops._launch(fake, torch.device("cuda", 0))
        _ops._launch(fake, torch.device("cpu"))
    _ops._launch(fake, torch.device("cuda", 0))
    assert seen == [False, True, True]


def test_value_checks_remembered(monkeypatch):
    """A CUDA value check that passed is not repeated for the same tensor objects while their
    version counters are unchanged, for the same token count and block size; another object
    with the same values, an in-place change, another token count or block size is checked
    again, and a check that failed is not remembered."""
    from msa import _ops
    seen, fail = [], []

    def fake(*args, stream, check_values, workspace_alloc, **kwargs):
        seen.append(check_values)
        if fail:
            raise ValueError("msa: argument 'cu_seqlens': malformed")

    class _Stream:
        cuda_stream = 0

    monkeypatch.setattr(torch.cuda, "device", lambda d: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "current_stream", lambda d=None: _Stream())
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setattr(_ops, "_checked", collections.OrderedDict())
    dev = torch.device("cuda", 0)

    def call(cu, bi=None, tokens=9, block=4):
        _ops._launch(fake, dev, values=((cu, bi), tokens, block))

    cu = torch.tensor([0, 5, 9], dtype=torch.int32)
    bi = torch.zeros(9, 1, 2, dtype=torch.int32)
    call(cu), call(cu)            # checked, then remembered
    call(cu, bi), call(cu, bi)    # with a block_idx: checked once
    call(cu, tokens=8), call(cu, block=8)
    call(cu.clone())              # the same values in another object
    cu[0] = 0
    call(cu)                      # changed in place (its version counter moved)
    assert seen == [True, False, True, False, True, True, True, True]
    seen.clear()
    other = torch.tensor([0, 9], dtype=torch.int32)
    fail.append(True)
    with pytest.raises(ValueError, match="cu_seqlens"):
        call(other)
    fail.clear()
    call(other), call(other)
    assert seen == [True, True, False]
    with msa.value_checks(False):
        call(torch.tensor([0, 9], dtype=torch.int32))
    assert seen == [True, True, False, False]
    with torch.inference_mode():  # no version counter: checked every time
        frozen = torch.tensor([0, 9], dtype=torch.int32)
    call(frozen), call(frozen)
    assert seen == [True, True, False, False, True, True]


def test_aliasing_outputs_refused(x):
    """An output sharing memory with an input or another output is refused naming the output;
    disjoint slices of one buffer (fused qkv inputs, dq/dk/dv of one dqkv) are fine."""
    q, k, v, qi, ki = x
    out, lse = torch.empty_like(q), torch.empty(T, Hq)
    bi = msa.select_blocks(qi, ki, 2, Bk)
    _raises("out", _C.forward, q, k, v, None, bi, False, None, None, q, lse, block_size=Bk)
    buf = torch.empty(T, Hq + Hkv, D)
    _raises("out", _C.forward, q, k, buf[:, Hq - 1:Hq - 1 + Hkv], None, bi, False, None, None,
            buf[:, :Hq], lse, block_size=Bk)
    _raises("lse", _C.forward, q, k, v, None, bi, False, None, None, out, out[:, :, 0],
            block_size=Bk)
    _raises("block_idx", _C.select_blocks, qi, ki, None, qi[:, :, :2].view(torch.int32),
            top_k=2, block_size=Bk)
    _raises("kl", _C.forward, q, k, v, None, bi, False, qi, ki, out, lse, lse[3, 1:2],
            block_size=Bk)

    # Backward: dq, dk, dv as head slices of one dqkv buffer.
    o, l, _, _ = torch.ops.msa.forward(q, k, v, qi, ki, bi, None, False, False, Bk, 2, 0, 1,
                                       0.0, 0.0, False, False)
    dout = torch.randn_like(o)
    want = torch.ops.msa.backward(dout, q, k, v, o, l, qi, ki, bi, None, None, False, Bk, 0.0,
                                  0.0, False, False, False)[:3]
    dqkv = torch.full((T, Hq + 2 * Hkv, D), float("nan"))
    dq, dk, dv = dqkv[:, :Hq], dqkv[:, Hq:Hq + Hkv], dqkv[:, Hq + Hkv:]
    _C.backward(q, k, v, o, l, dout, None, bi, dq, dk, dv, block_size=Bk)
    for a, b in zip((dq, dk, dv), want):
        assert torch.equal(a, b)
    _raises("dk", _C.backward, q, k, v, o, l, dout, None, bi, dq, dqkv[:, Hq - 1:Hq - 1 + Hkv],
            dv, block_size=Bk)
    _raises("dv", _C.backward, q, k, v, o, l, dout, None, bi, dq, dk, dk, block_size=Bk)
    _raises("dq", _C.backward, q, k, v, o, l, dout, None, bi, dout, dk, dv, block_size=Bk)
    _raises("dq_idx", _C.backward, q, k, v, o, l, dout, None, bi, dq, dk, dv, qi, ki, qi, None,
            block_size=Bk)


def test_fused_qkv_inputs():
    """q, k, v as views of one fused qkv tensor (inputs may share memory): the same values and
    gradients as separate tensors."""
    qkv = torch.randn(T, Hq + 2 * Hkv, D, dtype=torch.float64, requires_grad=True)
    qi, ki = (torch.randn(T, h, Di, dtype=torch.float64, requires_grad=True) for h in (Hi, Hik))
    q, k, v = qkv[:, :Hq], qkv[:, Hq:Hq + Hkv], qkv[:, Hq + Hkv:]
    out, kl = msa.sparse_attention(q, k, v, qi, ki, 2, Bk)
    w = torch.randn_like(out)
    g = torch.autograd.grad((out * w).sum() + kl, (qkv, qi, ki))
    sep = [t.detach().clone().requires_grad_(True) for t in (q, k, v)]
    out2, kl2 = msa.sparse_attention(*sep, qi, ki, 2, Bk)
    g2 = torch.autograd.grad((out2 * w).sum() + kl2, (*sep, qi, ki))
    assert torch.equal(out, out2) and torch.equal(kl, kl2)
    assert torch.equal(g[0], torch.cat(g2[:3], dim=1))
    assert torch.equal(g[1], g2[3]) and torch.equal(g[2], g2[4])
