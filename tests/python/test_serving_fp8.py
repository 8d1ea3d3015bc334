"""float8 E4M3 caches (docs/contract.md §6) through msa.serving, on the CPU backend (and the
CUDA backend against it where a GPU is present).

The codes' values and the append's quantisation are compared with torch's own float8_e4m3fn
conversions (an implementation independent of the library's); the calls over an E4M3 cache
with the calls over the dequantised float32 cache float32(value * scale[page]), which on the
CPU must agree bit for bit.
"""

import pytest
import torch

import msa
from msa import serving

FP8 = torch.float8_e4m3fn
CUDA = torch.cuda.is_available() and msa.backend_available("cuda")


def _table(nseq, per, pages, gen):
    perm = torch.randperm(pages, generator=gen)[: nseq * per].to(torch.int32)
    return perm.view(nseq, per).contiguous()


def _dequantised(codes, scale):
    """float32(value * scale[page]) of a cache [pages, Bk, H, D] of E4M3 codes."""
    s = scale.view(-1, 1, 1, 1) if scale.numel() > 1 else scale.view(1, 1, 1, 1)
    return codes.to(torch.float32) * s


def test_every_code_dequantises_as_torch_does():
    # One cached token per sequence: each output row is that token's dequantised v row.
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(FP8).view(4, 1, 1, 64)
    k = torch.zeros((4, 1, 1, 64), dtype=FP8)
    cu = torch.arange(5, dtype=torch.int32)
    table = torch.arange(4, dtype=torch.int32).view(4, 1)
    lens = torch.ones(4, dtype=torch.int32)
    one = torch.ones(1, dtype=torch.float32)
    q = torch.zeros((4, 1, 64), dtype=torch.float32)
    out = serving.paged_forward(q, k, codes, table, lens, cu, dense=True, k_scale=one,
                                v_scale=one)
    want = codes.view(4, 64).to(torch.float32)
    assert torch.equal(out.view(4, 64).isnan(), want.isnan())
    assert torch.equal(out.view(4, 64).nan_to_num(7.0), want.nan_to_num(7.0))


@pytest.mark.parametrize("in_dtype", [torch.float32, torch.bfloat16])
def test_append_quantises_as_torch_rounds(in_dtype):
    gen = torch.Generator().manual_seed(3)
    pages, Bk, H, D = 6, 16, 2, 32
    nq = [16, 9]
    table = _table(2, 2, pages, gen)
    lens = torch.tensor([20, 9], dtype=torch.int32)
    cu = torch.tensor([0, 16, 25], dtype=torch.int32)
    k = (torch.randn(25, H, D, generator=gen) * 40).to(in_dtype)
    k[0, 0, :4] = torch.tensor([1e6, -1e6, float("nan"), 0.0]).to(in_dtype)
    cache = torch.zeros((pages, Bk, H, D), dtype=FP8)
    scale = torch.rand(pages, generator=gen) * 0.2 + 0.01
    serving.paged_append(cache, None, None, table, lens, cu, k=k, k_scale=scale)
    for s in range(2):
        for j in range(nq[s]):
            g = int(cu[s]) + j
            pos = int(lens[s]) - nq[s] + j
            page = int(table[s, pos // Bk])
            x = k[g].to(torch.float32) / scale[page]  # float32(x) / scale, one rounding
            want = x.clamp(-448.0, 448.0).to(FP8)     # torch rounds to nearest even
            got = cache[page, pos % Bk]
            assert torch.equal(got.view(torch.uint8), want.view(torch.uint8)), (s, j)


@pytest.mark.parametrize("per_page", [True, False])
def test_calls_equal_the_dequantised_cache(per_page):
    gen = torch.Generator().manual_seed(11)
    pages, Bk, Hkv, Hq, D, Hi, Di, top_k = 12, 32, 2, 4, 32, 2, 16, 3
    lens = torch.tensor([150, 33, 64], dtype=torch.int32)
    nq = [5, 4, 1]
    table = _table(3, 5, pages + 3, gen)
    cu = torch.tensor([0, 5, 9, 10], dtype=torch.int32)

    def codes(H, n):
        return (torch.randn(pages + 3, Bk, H, n, generator=gen) * 100).clamp(-448, 448).to(FP8)

    kc, vc, kic = codes(Hkv, D), codes(Hkv, D), codes(1, Di)
    n = pages + 3 if per_page else 1
    ks, vs, kis = (torch.rand(n, generator=gen) * 0.05 + 0.001 for _ in range(3))
    q = torch.randn(10, Hq, D, generator=gen)
    qi = torch.randn(10, Hi, Di, generator=gen)
    kw = dict(top_k=top_k, sink_blocks=1, local_blocks=2)
    deq = [_dequantised(c, s) for c, s in ((kc, ks), (vc, vs), (kic, kis))]
    want_bi = serving.paged_select_blocks(qi, deq[2], table, lens, cu, **kw)
    got_bi = serving.paged_select_blocks(qi, kic, table, lens, cu, k_idx_scale=kis, **kw)
    assert torch.equal(got_bi, want_bi)
    want, want_lse = serving.paged_forward(q, deq[0], deq[1], table, lens, cu, q_idx=qi,
                                           k_idx_cache=deq[2], return_lse=True, **kw)
    got, got_lse = serving.paged_forward(q, kc, vc, table, lens, cu, q_idx=qi, k_idx_cache=kic,
                                         k_scale=ks, v_scale=vs, k_idx_scale=kis,
                                         return_lse=True, **kw)
    assert torch.equal(got, want) and torch.equal(got_lse, want_lse)
    # bfloat16 queries: the same rows, rounded once to bfloat16 (equal up to ties of that
    # rounding: within one bfloat16 ulp).
    got16 = serving.paged_forward(q.bfloat16(), kc, vc, table, lens, cu, q_idx=qi.bfloat16(),
                                  k_idx_cache=kic, k_scale=ks, v_scale=vs, k_idx_scale=kis, **kw)
    ref16 = serving.paged_forward(q.bfloat16().float(), deq[0], deq[1], table, lens, cu,
                                  q_idx=qi.bfloat16().float(), k_idx_cache=deq[2], **kw)
    ulp = torch.finfo(torch.bfloat16).eps * ref16.abs().clamp(min=1e-30)
    assert got16.dtype == torch.bfloat16
    assert ((got16.float() - ref16).abs() <= ulp).all()


@pytest.mark.parametrize("per_row", [True, False])
def test_fp8_queries_equal_the_dequantised_queries(per_row):
    """Q8KV8 on the CPU backend: float8 queries with q_scale ([Tq, Hq] or [1]) over E4M3 caches
    compute exactly the call with float32(value * q_scale) as float32 queries (out_dtype
    float32), and bfloat16 outputs are those results rounded once."""
    gen = torch.Generator().manual_seed(17)
    pages, Bk, Hkv, Hq, D, Hi, Di, top_k = 12, 32, 2, 4, 32, 2, 16, 3
    lens = torch.tensor([150, 33, 64], dtype=torch.int32)
    table = _table(3, 5, pages + 3, gen)
    cu = torch.tensor([0, 5, 9, 10], dtype=torch.int32)

    def codes(*shape):
        return (torch.randn(*shape, generator=gen) * 100).clamp(-448, 448).to(FP8)

    kc, vc, kic = codes(pages + 3, Bk, Hkv, D), codes(pages + 3, Bk, Hkv, D), codes(pages + 3, Bk, 1, Di)
    ks, vs, kis = (torch.rand(pages + 3, generator=gen) * 0.05 + 0.001 for _ in range(3))
    q8 = codes(10, Hq, D)
    qs = torch.rand((10, Hq) if per_row else (1,), generator=gen) * 0.02 + 0.001
    q32 = q8.to(torch.float32) * (qs.view(10, Hq, 1) if per_row else qs)
    qi = torch.randn(10, Hi, Di, generator=gen)
    kw = dict(top_k=top_k, sink_blocks=1, local_blocks=2, q_idx=qi, k_idx_cache=kic,
              k_scale=ks, v_scale=vs, k_idx_scale=kis, return_lse=True, return_block_idx=True)
    want, want_lse, want_bi = serving.paged_forward(q32, kc, vc, table, lens, cu, **kw)
    got, got_lse, got_bi = serving.paged_forward(q8, kc, vc, table, lens, cu, q_scale=qs,
                                                 out_dtype=torch.float32, **kw)
    assert got.dtype == torch.float32
    assert torch.equal(got_bi, want_bi)
    assert torch.equal(got, want) and torch.equal(got_lse, want_lse)
    got16 = serving.paged_forward(q8, kc, vc, table, lens, cu, q_scale=qs,
                                  q_idx=qi.bfloat16(), k_idx_cache=kic, k_scale=ks, v_scale=vs,
                                  k_idx_scale=kis, top_k=top_k, sink_blocks=1, local_blocks=2)
    ref16 = serving.paged_forward(q32.double(), kc, vc, table, lens, cu, q_idx=qi.bfloat16().double(),
                                  k_idx_cache=kic, k_scale=ks, v_scale=vs, k_idx_scale=kis,
                                  top_k=top_k, sink_blocks=1, local_blocks=2)
    assert got16.dtype == torch.bfloat16  # the default out_dtype
    assert torch.equal(got16, ref16.to(torch.bfloat16))
    with pytest.raises(ValueError, match="q_scale"):
        serving.paged_forward(q8, kc, vc, table, lens, cu, dense=True, k_scale=ks, v_scale=vs)
    with pytest.raises(ValueError, match="'q'"):  # float8 queries over a float32 cache
        serving.paged_forward(q8, kc.float(), vc.float(), table, lens, cu, dense=True, q_scale=qs)
    with pytest.raises(ValueError, match="out_dtype"):
        serving.paged_forward(q32, kc, vc, table, lens, cu, dense=True, k_scale=ks, v_scale=vs,
                              out_dtype=torch.bfloat16)


def test_cache_and_wrapper_with_e4m3():
    """PagedKVCache(dtype=float8_e4m3fn) appends quantised rows; the planned wrapper reads them
    with bfloat16 queries, equal to paged_forward over the dequantised cache."""
    gen = torch.Generator().manual_seed(5)
    cache = serving.PagedKVCache(8, 32, 2, 32, num_idx_heads=1, idx_head_dim=16, dtype=FP8)
    assert cache.query_dtype == torch.bfloat16 and cache.k_scale.shape == (8,)
    cache.k_scale.fill_(0.05)
    cache.v_scale.fill_(0.02)
    cache.k_idx_scale.fill_(0.03)
    s0, s1 = cache.add_sequence(), cache.add_sequence()
    k, v = torch.randn(70, 2, 32, generator=gen).bfloat16(), torch.randn(70, 2, 32, generator=gen).bfloat16()
    ki = torch.randn(70, 1, 16, generator=gen).bfloat16()
    table, lens, cu = cache.append([s0, s1], [50, 20], k, v, ki)
    q = torch.randn(70, 4, 32, generator=gen).bfloat16()
    qi = torch.randn(70, 2, 16, generator=gen).bfloat16()
    kw = dict(top_k=2, sink_blocks=0, local_blocks=1)
    want = serving.paged_forward(q.float(), _dequantised(cache.k, cache.k_scale),
                                 _dequantised(cache.v, cache.v_scale), table, lens, cu,
                                 q_idx=qi.float(),
                                 k_idx_cache=_dequantised(cache.k_idx, cache.k_idx_scale), **kw)
    w = serving.PagedMSAWrapper(cache)
    w.plan(nseq=2, num_tokens=70, num_qo_heads=4, max_pages=table.shape[1], num_idx_heads=2,
           **kw)
    out, _, _ = w.run(q, table, lens, cu, qi)
    assert out.dtype == torch.bfloat16
    ulp = torch.finfo(torch.bfloat16).eps * want.float().abs().clamp(min=1e-30)
    assert ((out.float() - want.float()).abs() <= ulp).all()
    # FP8 queries through the same plan: the planned bfloat16 outputs, equal to paged_forward's.
    qs = q.float().abs().amax(dim=2).clamp(min=1e-12) / 448
    q8 = (q.float() / qs.unsqueeze(2)).to(FP8)
    want8 = serving.paged_forward(q8, cache.k, cache.v, table, lens, cu, q_idx=qi, k_idx_cache=cache.k_idx,
                                  k_scale=cache.k_scale, v_scale=cache.v_scale,
                                  k_idx_scale=cache.k_idx_scale, q_scale=qs, **kw)
    out8, _, _ = w.run(q8, table, lens, cu, qi, q_scale=qs)
    assert out8.dtype == torch.bfloat16 and torch.equal(out8, want8)


def _error(fn, arg):
    with pytest.raises(ValueError) as e:
        fn()
    assert f"argument '{arg}'" in str(e.value), str(e.value)


def test_bad_scales_name_the_argument():
    pages, Bk = 4, 16
    kc = torch.zeros((pages, Bk, 1, 16), dtype=FP8)
    table = torch.tensor([[0, 1]], dtype=torch.int32)
    lens = torch.tensor([20], dtype=torch.int32)
    cu = torch.tensor([0, 2], dtype=torch.int32)
    q = torch.zeros((2, 1, 16))
    good = torch.ones(pages)
    call = lambda ks, vs=good, kc=kc, vc=kc: serving.paged_forward(  # noqa: E731
        q, kc, vc, table, lens, cu, dense=True, k_scale=ks, v_scale=vs)
    call(good)
    _error(lambda: call(None), "cache.k_scale")
    _error(lambda: call(torch.ones(pages + 1)), "cache.k_scale")
    for bad in (0.0, -1.0, float("nan"), float("inf")):
        s = good.clone()
        s[2] = bad
        _error(lambda: call(s), "cache.k_scale")
    _error(lambda: call(good, vc=torch.zeros((pages, Bk, 1, 16))), "cache.v")
    _error(lambda: call(torch.ones(1, dtype=torch.float64)), "cache.k_scale")
    plain = torch.zeros((pages, Bk, 1, 16))
    _error(lambda: serving.paged_forward(q, plain, plain, table, lens, cu, dense=True,
                                         k_scale=good), "cache.k_scale")
    # float8 queries without their q_scale, and over a float32 cache
    _error(lambda: serving.paged_forward(q.to(FP8), kc, kc, table, lens, cu, dense=True,
                                         k_scale=good, v_scale=good), "q_scale")
    _error(lambda: serving.paged_forward(q.to(FP8), plain, plain, table, lens, cu, dense=True,
                                         q_scale=torch.ones(1)), "q")


@pytest.mark.skipif(not CUDA, reason="the library has no usable CUDA backend")
@pytest.mark.parametrize("max_q_len", [4, 0])
def test_cuda_equals_the_cpu_on_e4m3_caches(max_q_len):
    """The CUDA kernels over E4M3 caches (decode tiles; a prefill chunk, whose selection runs the
    training selection kernel and whose attention the training forward, both over the codes as
    16-bit values) against the CPU backend over the same codes and scales: the same selection
    (random scores have no near ties), out and lse within bfloat16 rounding; and the CUDA append
    writes the CPU's codes."""
    gen = torch.Generator().manual_seed(13)
    pages, Bk, Hkv, Hq, D, Hi, Di = 40, 128, 2, 16, 128, 2, 128
    lens = torch.tensor([1500, 129, 700], dtype=torch.int32)
    nq = [4, 1, 3] if max_q_len else [300, 129, 64]
    table = _table(3, 12, pages, gen)
    cu = torch.tensor([0, nq[0], nq[0] + nq[1], sum(nq)], dtype=torch.int32)

    def codes(H, n):
        return (torch.randn(pages, Bk, H, n, generator=gen) * 100).clamp(-448, 448).to(FP8)

    kc, vc, kic = codes(Hkv, D), codes(Hkv, D), codes(1, Di)
    ks, vs = (torch.rand(pages, generator=gen) * 0.05 + 0.001 for _ in range(2))
    kis = torch.rand(1, generator=gen) * 0.05 + 0.001
    q = torch.randn(sum(nq), Hq, D, generator=gen).bfloat16()
    qi = torch.randn(sum(nq), Hi, Di, generator=gen).bfloat16()
    kw = dict(top_k=4, sink_blocks=1, local_blocks=2, max_q_len=max_q_len)
    cpu = dict(k_scale=ks, v_scale=vs, k_idx_scale=kis)
    dev = {n: t.cuda() for n, t in cpu.items()}
    args = (table, lens, cu)
    want, want_lse = serving.paged_forward(q, kc, vc, *args, q_idx=qi, k_idx_cache=kic,
                                           return_lse=True, **cpu, **kw)
    want_bi = serving.paged_select_blocks(qi, kic, *args, k_idx_scale=kis, **kw)
    got, got_lse = serving.paged_forward(q.cuda(), kc.cuda(), vc.cuda(), *(t.cuda() for t in args),
                                         q_idx=qi.cuda(), k_idx_cache=kic.cuda(), return_lse=True,
                                         **dev, **kw)
    got_bi = serving.paged_select_blocks(qi.cuda(), kic.cuda(), *(t.cuda() for t in args),
                                         k_idx_scale=dev["k_idx_scale"], **kw)
    assert torch.equal(got_bi.cpu(), want_bi)
    err = (got.float().cpu() - want.float()).norm() / want.float().norm()
    assert err < 1e-2, err
    assert (got_lse.cpu() - want_lse).abs().max() < 1e-3

    # The append: bfloat16 rows quantised into copies of the caches, on both devices.
    k_new = (torch.randn(sum(nq), Hkv, D, generator=gen) * 3).bfloat16()
    k_new[0, 0, :3] = torch.tensor([1e6, -1e6, float("nan")]).bfloat16()
    ki_new = (torch.randn(sum(nq), 1, Di, generator=gen) * 0.1).float()
    c_cpu, ci_cpu = kc.clone(), kic.clone()
    c_gpu, ci_gpu = kc.cuda(), kic.cuda()
    serving.paged_append(c_cpu, None, ci_cpu, *args, k=k_new, k_idx=ki_new, k_scale=ks,
                         k_idx_scale=kis)
    serving.paged_append(c_gpu, None, ci_gpu, *(t.cuda() for t in args), k=k_new.cuda(),
                         k_idx=ki_new.cuda(), k_scale=dev["k_scale"], k_idx_scale=dev["k_idx_scale"])
    for a, b in ((c_gpu, c_cpu), (ci_gpu, ci_cpu)):
        a8, b8 = a.cpu().view(torch.uint8), b.view(torch.uint8)
        nan = (b8 & 0x7F) == 0x7F
        assert torch.equal(a8[~nan], b8[~nan]) and bool(((a8[nan] & 0x7F) == 0x7F).all())


@pytest.mark.skipif(not CUDA, reason="the library has no usable CUDA backend")
@pytest.mark.parametrize("max_q_len,per_row", [(1, True), (4, False), (0, True)])
def test_cuda_fp8_queries_equal_the_cpu(max_q_len, per_row):
    """Q8KV8 on the CUDA backend (the query codes converted exactly to bfloat16, q_scale in each
    row's score scale) against the CPU backend over the same codes and scales, in decode's column
    layout (one token x 8 heads), its row layout and a prefill chunk (the training forward over
    16-bit copies of the codes; also through a PagedMSAWrapper plan, whose workspace holds the
    queries' copy): the same selection, out and lse within bfloat16 rounding; a q_scale that is
    not positive is named from the device's value check, and a float32 out is refused naming
    'out'."""
    gen = torch.Generator().manual_seed(29 + max_q_len)
    pages, Bk, Hkv, Hq, D, Hi, Di = 40, 128, 2, 16, 128, 2, 128
    lens = torch.tensor([1500, 129, 700], dtype=torch.int32)
    nq = {1: [1, 1, 1], 4: [4, 1, 3], 0: [300, 129, 64]}[max_q_len]
    T = sum(nq)
    table = _table(3, 12, pages, gen)
    cu = torch.tensor([0, nq[0], nq[0] + nq[1], T], dtype=torch.int32)

    def codes(*shape):
        return (torch.randn(*shape, generator=gen) * 100).clamp(-448, 448).to(FP8)

    kc, vc, kic = codes(pages, Bk, Hkv, D), codes(pages, Bk, Hkv, D), codes(pages, Bk, 1, Di)
    ks, vs = (torch.rand(pages, generator=gen) * 0.05 + 0.001 for _ in range(2))
    kis = torch.rand(1, generator=gen) * 0.05 + 0.001
    q8 = codes(T, Hq, D)
    qs = torch.rand((T, Hq) if per_row else (1,), generator=gen) * 0.02 + 0.001
    qi = torch.randn(T, Hi, Di, generator=gen).bfloat16()
    kw = dict(top_k=4, sink_blocks=1, local_blocks=2, max_q_len=max_q_len, return_lse=True,
              return_block_idx=True)
    cpu = dict(q_scale=qs, q_idx=qi, k_idx_cache=kic, k_scale=ks, v_scale=vs, k_idx_scale=kis)
    dev = {n: t.cuda() for n, t in cpu.items()}
    args = (table, lens, cu)
    dargs = tuple(t.cuda() for t in args)
    want, want_lse, want_bi = serving.paged_forward(q8, kc, vc, *args, **cpu, **kw)
    got, got_lse, got_bi = serving.paged_forward(q8.cuda(), kc.cuda(), vc.cuda(), *dargs, **dev, **kw)
    assert got.dtype == torch.bfloat16
    assert torch.equal(got_bi.cpu(), want_bi)
    err = (got.float().cpu() - want.float()).norm() / want.float().norm()
    assert err < 1e-2, err
    assert (got_lse.cpu() - want_lse).abs().max() < 1e-3
    if max_q_len == 0:  # a planned prefill (PagedMSAWrapper) over such a cache, run with FP8 queries
        cache = serving.PagedKVCache(pages, Bk, Hkv, D, num_idx_heads=1, idx_head_dim=Di, dtype=FP8,
                                     device="cuda")
        for name, t in dict(k=kc, v=vc, k_idx=kic, k_scale=ks, v_scale=vs).items():
            getattr(cache, name).copy_(t)
        cache.k_idx_scale.fill_(float(kis))
        w = serving.PagedMSAWrapper(cache)
        w.plan(nseq=3, num_tokens=T, num_qo_heads=Hq, max_pages=table.shape[1], num_idx_heads=Hi, top_k=4,
               sink_blocks=1, local_blocks=2)
        out, lse, bi = w.run(q8.cuda(), *dargs, dev["q_idx"], q_scale=dev["q_scale"])
        assert torch.equal(bi.cpu(), want_bi)
        err = (out.float().cpu() - want.float()).norm() / want.float().norm()
        assert err < 1e-2, err
        assert (lse.cpu() - want_lse).abs().max() < 1e-3
    bad = dev["q_scale"].clone()
    bad.view(-1)[-1] = 0.0
    _error(lambda: serving.paged_forward(q8.cuda(), kc.cuda(), vc.cuda(), *dargs, **{**dev, "q_scale": bad},
                                         **kw), "q_scale")
    with pytest.raises(NotImplementedError, match="'out'"):  # dense: no q_idx, which has out's dtype
        serving.paged_forward(q8.cuda(), kc.cuda(), vc.cuda(), *dargs, dense=True, q_scale=dev["q_scale"],
                              k_scale=dev["k_scale"], v_scale=dev["v_scale"], max_q_len=max_q_len,
                              out_dtype=torch.float32)
