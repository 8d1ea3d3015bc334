"""msa.serving (docs/contract.md §6) against the training ops on contiguous sequences.

New token j of sequence s sits at position seq_lens[s] - n_s + j and must select and attend as
that position does in msa.select_blocks / msa.sparse_attention / msa.warmup_attention over the
whole contiguous sequence. The caches are filled through a shuffled page table, with every page
no sequence uses and every row past a sequence's end poisoned with NaN. On the CPU both sides run
the same double-precision rows, so the results must be equal. The CUDA tests skip without a
usable CUDA backend.
"""

import pytest
import torch

import msa
from msa import serving

CUDA = torch.cuda.is_available() and msa.backend_available("cuda")
cuda_only = pytest.mark.skipif(not CUDA, reason="the library has no usable CUDA backend")


class Batch:
    """Full random sequences of `lens` tokens, their last `nq` tokens new, the caches paged."""

    def __init__(self, lens, nq, Bk=64, Hq=4, Hkv=2, Hi=2, Hik=1, D=16, Di=16,
                 dtype=torch.float32, extra_pages=3, device="cpu"):
        self.lens, self.nq, self.Bk = list(lens), list(nq), Bk
        T = sum(lens)
        r = lambda *s: torch.randn(*s, dtype=torch.float64).to(dtype)  # noqa: E731
        self.q, self.k, self.v = r(T, Hq, D), r(T, Hkv, D), r(T, Hkv, D)
        self.q_idx, self.k_idx = r(T, Hi, Di), r(T, Hik, Di)
        offs = [0]
        for L in lens:
            offs.append(offs[-1] + L)
        self.offs = offs
        self.cu = torch.tensor(offs, dtype=torch.int32)
        nblk = [-(-L // Bk) for L in lens]
        pages = sum(nblk) + extra_pages
        perm = torch.randperm(pages).tolist()
        self.max_pages = max(nblk + [1]) + 1
        self.table = torch.full((len(lens), self.max_pages), -1, dtype=torch.int32)
        at = 0
        for s, n in enumerate(nblk):
            self.table[s, :n] = torch.tensor(perm[at:at + n], dtype=torch.int32)
            at += n
        self.seq_lens = torch.tensor(lens, dtype=torch.int32)
        self.cu_q = torch.tensor([0] + torch.tensor(nq).cumsum(0).tolist(), dtype=torch.int32)
        self.rows = torch.tensor([offs[s] + L - n + j for s, (L, n) in enumerate(zip(lens, nq))
                                  for j in range(n)], dtype=torch.int64)
        self.k_cache = self.scatter(self.k, pages)
        self.v_cache = self.scatter(self.v, pages)
        self.k_idx_cache = self.scatter(self.k_idx, pages)
        self.device = torch.device(device)
        for name in ("q", "k", "v", "q_idx", "k_idx", "cu", "table", "seq_lens", "cu_q",
                     "k_cache", "v_cache", "k_idx_cache"):
            setattr(self, name, getattr(self, name).to(self.device))

    def cache_rows(self, s, positions):
        return torch.stack([self.table[s, x // self.Bk].long() * self.Bk + x % self.Bk
                            for x in positions]) if positions else torch.empty(0, dtype=torch.long)

    def scatter(self, src, pages):
        dst = torch.full((pages * self.Bk,) + tuple(src.shape[1:]), float("nan"), dtype=src.dtype)
        for s, L in enumerate(self.lens):
            if L:
                dst[self.cache_rows(s, list(range(L)))] = src[self.offs[s]:self.offs[s] + L]
        return dst.view(pages, self.Bk, *src.shape[1:])

    def new(self, t):
        return t[self.rows.to(t.device)]

    def oracle(self, top_k, sink_blocks=0, local_blocks=1, dense=False):
        """(block_idx, out, lse) of the new tokens from the training ops on the full sequences."""
        if dense:
            out, _, lse = msa.warmup_attention(self.q, self.k, self.v, None, None,
                                               cu_seqlens=self.cu, return_lse=True)
            return None, self.new(out), self.new(lse)
        bi = msa.select_blocks(self.q_idx, self.k_idx, top_k, self.Bk, cu_seqlens=self.cu,
                               sink_blocks=sink_blocks, local_blocks=local_blocks)
        out, _, lse = msa.sparse_attention(self.q, self.k, self.v, self.q_idx, self.k_idx,
                                           top_k, self.Bk, cu_seqlens=self.cu, block_idx=bi,
                                           kl_value=False, return_lse=True)
        return self.new(bi), self.new(out), self.new(lse)


CASES = [
    dict(lens=[1], nq=[1], Bk=64, top_k=2),
    dict(lens=[127, 128, 129, 1], nq=[1, 5, 16, 1], Bk=64, top_k=2, max_q_len=16),
    dict(lens=[127, 0, 129, 2000, 128], nq=[16, 0, 1, 5, 0], Bk=128, top_k=4, max_q_len=16),
    dict(lens=[1500, 300], nq=[300, 300], Bk=64, top_k=5, sink_blocks=1, local_blocks=2),
    dict(lens=[513, 64], nq=[100, 64], Bk=64, top_k=4, dtype=torch.bfloat16, Hq=8, Hi=4, Hik=2),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"lens{c['lens']}-nq{c['nq']}-Bk{c['Bk']}")
def test_paged_matches_contiguous(case):
    case = dict(case)
    top_k = case.pop("top_k")
    max_q_len = case.pop("max_q_len", 0)
    sink, local = case.pop("sink_blocks", 0), case.pop("local_blocks", 1)
    b = Batch(**case)
    kc, vc, kic = b.k_cache.clone(), b.v_cache.clone(), b.k_idx_cache.clone()
    bi, out, lse = b.oracle(top_k, sink, local)
    opts = dict(max_q_len=max_q_len, sink_blocks=sink, local_blocks=local)

    got_bi = serving.paged_select_blocks(b.new(b.q_idx), b.k_idx_cache, b.table, b.seq_lens,
                                         b.cu_q, top_k, **opts)
    assert torch.equal(got_bi, bi)
    o, l, sbi = serving.paged_forward(b.new(b.q), b.k_cache, b.v_cache, b.table, b.seq_lens,
                                      b.cu_q, q_idx=b.new(b.q_idx), k_idx_cache=b.k_idx_cache,
                                      top_k=top_k, return_lse=True, return_block_idx=True, **opts)
    assert torch.equal(sbi, bi)
    assert torch.equal(o, out)
    assert torch.equal(l, lse)
    o2 = serving.paged_forward(b.new(b.q), b.k_cache, b.v_cache, b.table, b.seq_lens, b.cu_q,
                               block_idx=bi, **opts)
    assert torch.equal(o2, out)
    _, dout, dlse = b.oracle(top_k, dense=True)
    o3, l3 = serving.paged_forward(b.new(b.q), b.k_cache, b.v_cache, b.table, b.seq_lens, b.cu_q,
                                   dense=True, return_lse=True, max_q_len=max_q_len)
    assert torch.equal(o3, dout)
    assert torch.equal(l3, dlse)
    for a, c in ((kc, b.k_cache), (vc, b.v_cache), (kic, b.k_idx_cache)):
        assert torch.equal(a.nan_to_num(7.0), c.nan_to_num(7.0)), "a read-only cache was written"


def _fill(cache, b, positions_of, max_pages=None):
    """Appends positions_of(s) (a range per sequence) of b's sequences to `cache` through
    PagedKVCache.append; returns the batch description and the rows of b's full tensors."""
    rows, counts = [], []
    for s in range(len(b.lens)):
        pos = list(positions_of(s))
        rows += [b.offs[s] + x for x in pos]
        counts.append(len(pos))
    rows = torch.tensor(rows, dtype=torch.int64)
    desc = cache.append(b.sids, counts, k=b.k[rows], v=b.v[rows], k_idx=b.k_idx[rows],
                        max_pages=max_pages)
    return desc, rows


def _cache_for(b, num_pages=64):
    cache = serving.PagedKVCache(num_pages, b.Bk, b.k.shape[1], b.k.shape[2],
                                 num_idx_heads=b.k_idx.shape[1], idx_head_dim=b.k_idx.shape[2],
                                 dtype=b.k.dtype, device=b.device)
    b.sids = [cache.add_sequence() for _ in b.lens]
    return cache


def test_chunked_prefill_equals_one_shot():
    b = Batch([700, 300, 0, 64], [700, 300, 0, 64], Bk=64)
    top_k = 4
    bi, out, lse = b.oracle(top_k, sink_blocks=1)
    cache = _cache_for(b)
    cut = [400, 150, 0, 0]
    got = torch.empty_like(out)
    for chunk in range(2):
        bounds = (lambda s: range(0, cut[s])) if chunk == 0 else (lambda s: range(cut[s], b.lens[s]))
        (table, lens, cu), rows = _fill(cache, b, bounds)
        o, l, sbi = serving.paged_forward(b.q[rows], cache.k, cache.v, table, lens, cu,
                                          q_idx=b.q_idx[rows], k_idx_cache=cache.k_idx,
                                          top_k=top_k, sink_blocks=1, return_lse=True,
                                          return_block_idx=True)
        assert torch.equal(o, out[rows]), f"chunk {chunk}"  # new rows = all rows here
        assert torch.equal(l, lse[rows]), f"chunk {chunk}"
        assert torch.equal(sbi, bi[rows]), f"chunk {chunk}"
        got[rows] = o
    assert torch.equal(got, out)
    assert [cache.seq_len(s) for s in b.sids] == b.lens


def test_append_writes_the_new_rows_only():
    b = Batch([130, 5, 64], [16, 1, 64], Bk=64, dtype=torch.bfloat16)
    k_cache = b.k_cache.clone()
    v_cache = b.v_cache.clone()
    for s, (L, n) in enumerate(zip(b.lens, b.nq)):
        rows = b.cache_rows(s, list(range(L - n, L)))
        k_cache.view(-1, *k_cache.shape[2:])[rows] = 3.0
        v_cache.view(-1, *v_cache.shape[2:])[rows] = 3.0
    before_v = v_cache.clone()
    serving.paged_append(k_cache, v_cache, None, b.table, b.seq_lens, b.cu_q, k=b.new(b.k))
    assert torch.equal(k_cache.nan_to_num(7.0), b.k_cache.nan_to_num(7.0))
    assert torch.equal(v_cache.nan_to_num(7.0), before_v.nan_to_num(7.0)), "v absent: untouched"
    torch.ops.msa.paged_append(None, b.new(b.v), None, b.cu_q, None, v_cache, None, b.table,
                               b.seq_lens, b.Bk)
    assert torch.equal(v_cache.nan_to_num(7.0), b.v_cache.nan_to_num(7.0))


def test_cache_allocator_and_pages():
    cache = serving.PagedKVCache(4, 16, 1, 8, dtype=torch.float32)
    a, c = cache.add_sequence(), cache.add_sequence()
    cache.reserve(a, 17)  # two pages
    cache.reserve(c, 1)
    assert cache.num_free_pages == 1 and len(cache.pages(a)) == 2
    with pytest.raises(RuntimeError, match="more pages"):
        cache.reserve(c, 40)
    cache.remove_sequence(a)
    assert cache.num_free_pages == 3
    table, lens, cu = cache.batch([c], [1])
    assert table.shape == (1, 1) and lens.tolist() == [1] and cu.tolist() == [0, 1]


def test_cache_errors_name_the_argument():
    """The cache's own checks: its page size and scales, a page table narrower than a sequence,
    the new lengths of an append; a refused reserve or append changes nothing."""
    _error(lambda: serving.PagedKVCache(4, 24, 1, 8), "page_size")
    _error(lambda: serving.PagedKVCache(4, 16, 1, 8, scales="row"), "scales")
    cache = serving.PagedKVCache(4, 16, 1, 8, dtype=torch.float32)
    a, c = cache.add_sequence(), cache.add_sequence()
    cache.reserve(a, 33)  # three pages
    _error(lambda: cache.batch([a, c], max_pages=2), "max_pages")
    assert cache.batch([a, c], max_pages=3)[0].shape == (2, 3)
    _error(lambda: cache.append([a, c], [1]), "new_lens")
    _error(lambda: cache.append([a, c], [1, -1]), "new_lens")
    with pytest.raises(RuntimeError, match="more pages"):
        cache.reserve(c, 17)
    assert cache.seq_len(a) == 33 and cache.seq_len(c) == 0 and cache.num_free_pages == 1


def test_wrapper_prefill_then_decode_with_four_tokens():
    """plan once; run per step (multi-token prediction, 4 new tokens per sequence), each step
    equal to the contiguous reference at its positions."""
    b = Batch([260, 75], [260, 75], Bk=64)
    top_k = 3
    bi, out, lse = b.oracle(top_k)
    cache = _cache_for(b)
    prompt = [248, 63]
    (table, lens, cu), rows = _fill(cache, b, lambda s: range(prompt[s]))
    o = serving.paged_forward(b.q[rows], cache.k, cache.v, table, lens, cu, q_idx=b.q_idx[rows],
                              k_idx_cache=cache.k_idx, top_k=top_k)
    assert torch.equal(o, out[rows])
    w = serving.PagedMSAWrapper(cache)
    max_pages = 8
    w.plan(nseq=2, num_tokens=8, num_qo_heads=b.q.shape[1], max_pages=max_pages, max_q_len=4,
           num_idx_heads=b.q_idx.shape[1], top_k=top_k)
    for step in range(3):
        (table, lens, cu), rows = _fill(cache, b, lambda s: range(prompt[s] + 4 * step,
                                                                  prompt[s] + 4 * step + 4),
                                        max_pages=max_pages)
        o, l, sbi = w.run(b.q[rows], table, lens, cu, q_idx=b.q_idx[rows])
        assert o.data_ptr() == w.out.data_ptr()
        assert torch.equal(o, out[rows]), f"step {step}"
        assert torch.equal(l, lse[rows]), f"step {step}"
        assert torch.equal(sbi, bi[rows]), f"step {step}"
    with pytest.raises(ValueError, match="'q'"):
        w.run(b.q[:3], table, lens, cu, q_idx=b.q_idx[rows])


def _error(fn, arg):
    with pytest.raises(ValueError) as e:
        fn()
    assert f"argument '{arg}'" in str(e.value), str(e.value)


def test_errors_name_the_argument():
    b = Batch([70, 10], [5, 10], Bk=64)
    q, qi = b.new(b.q), b.new(b.q_idx)

    def fwd(table=b.table, seq_lens=b.seq_lens, cu=b.cu_q, **kw):
        return serving.paged_forward(q, b.k_cache, b.v_cache, table, seq_lens, cu, q_idx=qi,
                                     k_idx_cache=b.k_idx_cache, top_k=2, **kw)

    bad = b.table.clone()
    bad[0, 1] = b.k_cache.shape[0]
    _error(lambda: fwd(table=bad), "cache.page_table")
    _error(lambda: fwd(seq_lens=torch.tensor([70, b.max_pages * 64 + 1], dtype=torch.int32)),
           "cache.seq_lens")
    _error(lambda: fwd(seq_lens=torch.tensor([70, 9], dtype=torch.int32)), "cache.seq_lens")
    _error(lambda: fwd(max_q_len=17), "max_q_len")
    _error(lambda: torch.ops.msa.paged_forward(q, b.cu_q, b.k_cache, b.v_cache, b.k_idx_cache,
                                               b.table, b.seq_lens, qi, None, 17, False, True,
                                               64, 2, 0, 1, 0.0, 0.0), "max_q_len")
    _error(lambda: fwd(max_q_len=8), "max_q_len")
    _error(lambda: fwd(fwd_pass="tiles"), "fwd_pass")
    _error(lambda: fwd(fwd_chunk_tokens=-1), "fwd_chunk_tokens")
    w = serving.PagedMSAWrapper(serving.PagedKVCache(8, 64, 2, 16, num_idx_heads=1, idx_head_dim=16))
    _error(lambda: w.plan(2, 15, 4, max_pages=4, num_idx_heads=2, top_k=2, fwd_chunk_tokens=-5),
           "fwd_chunk_tokens")
    _error(lambda: w.plan(2, 15, 4, max_pages=4, num_idx_heads=2, top_k=2, fwd_pass="kv"),
           "fwd_pass")
    # Bk is the k cache's dim 1: another page size in the v cache is a wrong page shape.
    _error(lambda: serving.paged_forward(q, b.k_cache, b.v_cache[:, :32], b.table, b.seq_lens,
                                         b.cu_q, dense=True), "cache.v")
    _error(lambda: torch.ops.msa.paged_forward(q, b.cu_q, b.k_cache[:, :32], b.v_cache,
                                               b.k_idx_cache, b.table, b.seq_lens, qi, None, 0,
                                               False, True, 64, 2, 0, 1, 0.0, 0.0), "cache.k")
    _error(lambda: fwd(cu=torch.tensor([0, 5, 14], dtype=torch.int32)), "cu_seqlens_q")
    _error(lambda: serving.paged_select_blocks(qi, b.k_idx_cache[:, :, :, :8], b.table,
                                               b.seq_lens, b.cu_q, 2), "cache.k_idx")
    _error(lambda: serving.paged_forward(q, b.k_cache, b.v_cache, b.table, b.seq_lens, b.cu_q,
                                         block_idx=torch.full((15, 2, 2), 3, dtype=torch.int32)),
           "block_idx")
    _error(lambda: serving.paged_append(b.k_cache.clone(), None, None, bad, b.seq_lens, b.cu_q,
                                        k=b.new(b.k)), "cache.page_table")
    _error(lambda: serving.paged_append(b.k_cache.clone(), None, None, b.table, b.seq_lens,
                                        b.cu_q, k=b.new(b.k)[:, :1]), "k")


def test_compile_fullgraph_paged_forward():
    torch._dynamo.reset()
    b = Batch([200, 90], [16, 3], Bk=64)
    q, qi = b.new(b.q), b.new(b.q_idx)

    def f(q, qi, k_cache, v_cache, k_idx_cache, table, seq_lens, cu):
        out, lse = serving.paged_forward(q, k_cache, v_cache, table, seq_lens, cu, q_idx=qi,
                                         k_idx_cache=k_idx_cache, top_k=3, max_q_len=16,
                                         return_lse=True)
        return out * 2, lse

    args = (q, qi, b.k_cache, b.v_cache, b.k_idx_cache, b.table, b.seq_lens, b.cu_q)
    got = torch.compile(f, fullgraph=True, backend="aot_eager")(*args)
    want = f(*args)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_opcheck_paged_ops():
    b = Batch([100, 40], [4, 40], Bk=64)
    q, qi = b.new(b.q), b.new(b.q_idx)
    kc, vc, kic = (x.nan_to_num(0.0) for x in (b.k_cache, b.v_cache, b.k_idx_cache))
    for op, args in (
        (torch.ops.msa.paged_forward.default,
         (q, b.cu_q, kc, vc, kic, b.table, b.seq_lens, qi, None, 0, False, True, 64, 2, 0, 1,
          0.0, 0.0)),
        (torch.ops.msa.paged_select_blocks.default,
         (qi, b.cu_q, kic, b.table, b.seq_lens, 0, 2, 64, 0, 1, 0.0)),
        (torch.ops.msa.paged_append.default,
         (b.new(b.k), None, None, b.cu_q, kc.clone(), None, None, b.table, b.seq_lens, 64)),
    ):
        result = torch.library.opcheck(op, args)
        assert all(v == "SUCCESS" for v in result.values()), result


def graph_of(fn):
    """fn() captured into a CUDA graph (after one call on a side stream, as torch asks)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return g


@cuda_only
def test_cuda_matches_cpu_and_graph_replay():
    """The CUDA backend: an eager call against the CPU backend on the same block_idx; then a CUDA
    graph of PagedMSAWrapper.run captured once and replayed with new lengths and page tables,
    each replay equal to the eager call on those inputs."""
    torch.manual_seed(0)
    Bk, top_k = 128, 4
    b = Batch([1000, 300, 130], [4, 4, 4], Bk=Bk, Hq=8, Hkv=2, Hi=2, Hik=1, D=128, Di=128,
              dtype=torch.bfloat16)
    cache = serving.PagedKVCache(40, Bk, 2, 128, num_idx_heads=1, idx_head_dim=128,
                                 dtype=torch.bfloat16, device="cuda")
    w = serving.PagedMSAWrapper(cache)
    max_pages = 12
    w.plan(nseq=3, num_tokens=12, num_qo_heads=8, max_pages=max_pages, max_q_len=4,
           num_idx_heads=2, top_k=top_k)
    static = dict(q=torch.zeros(12, 8, 128, dtype=torch.bfloat16, device="cuda"),
                  qi=torch.zeros(12, 2, 128, dtype=torch.bfloat16, device="cuda"),
                  table=torch.zeros(3, max_pages, dtype=torch.int32, device="cuda"),
                  lens=torch.zeros(3, dtype=torch.int32, device="cuda"),
                  cu=torch.tensor([0, 4, 8, 12], dtype=torch.int32, device="cuda"))
    sids = [cache.add_sequence() for _ in range(3)]
    b.sids = sids

    def load(prefix):
        """The sequences grown to `prefix` + 4 tokens; the static inputs hold the last 4."""
        rows = []
        for s, sid in enumerate(sids):
            have = cache.seq_len(sid)
            pos = list(range(have, prefix[s] + 4))
            r = torch.tensor([b.offs[s] + x for x in pos], dtype=torch.int64)
            cache.append([sid], [len(pos)], k=b.k[r].cuda(), v=b.v[r].cuda(),
                         k_idx=b.k_idx[r].cuda())
            rows += [b.offs[s] + x for x in range(prefix[s], prefix[s] + 4)]
        table, lens, _ = cache.batch(sids, [4, 4, 4], max_pages=max_pages)
        rows = torch.tensor(rows, dtype=torch.int64)
        static["q"].copy_(b.q[rows])
        static["qi"].copy_(b.q_idx[rows])
        static["table"].copy_(table)
        static["lens"].copy_(lens)

    def call():
        return w.run(static["q"], static["table"], static["lens"], static["cu"],
                     q_idx=static["qi"])

    load([500, 100, 60])
    g = graph_of(call)
    for prefix in ([700, 200, 100], [996, 296, 126]):
        load(prefix)
        g.replay()
        got = [x.clone() for x in (w.out, w.lse, w.block_idx)]
        want = serving.paged_forward(static["q"], cache.k, cache.v, static["table"],
                                     static["lens"], static["cu"], q_idx=static["qi"],
                                     k_idx_cache=cache.k_idx, top_k=top_k, max_q_len=4,
                                     return_lse=True, return_block_idx=True)
        torch.cuda.synchronize()
        for a, c in zip(got, want):
            assert torch.equal(a, c), "graph replay differs from the eager call"
        # The CPU backend over the same selection.
        cpu = serving.paged_forward(static["q"].cpu(), cache.k.cpu(), cache.v.cpu(),
                                    static["table"].cpu(), static["lens"].cpu(),
                                    static["cu"].cpu(), block_idx=got[2].cpu(), max_q_len=4)
        err = (got[0].cpu().float() - cpu.float()).norm() / cpu.float().norm()
        assert err < 2e-2, f"relative L2 error {err:.3e} against the CPU backend"


def _cuda_cache_of(b):
    """A bfloat16 PagedKVCache on the GPU holding the pages of b (2 KV heads of 128, one index
    key head of 128)."""
    cache = serving.PagedKVCache(b.k_cache.shape[0], b.Bk, 2, 128, num_idx_heads=1,
                                 idx_head_dim=128, dtype=torch.bfloat16, device="cuda")
    cache.k.copy_(b.k_cache)
    cache.v.copy_(b.v_cache)
    cache.k_idx.copy_(b.k_idx_cache)
    return cache


@cuda_only
def test_cuda_prefill_by_each_forward_pass():
    """A sparse prefill by each walk of the training forward over the pages (fwd_pass) against
    the CPU backend over the same selection; "auto" gives the bits of one of the two walks it
    chooses between. Then a PagedMSAWrapper prefill captured in a CUDA graph (the split's sorts
    and work lists inside) and replayed with new lengths equals the eager call."""
    torch.manual_seed(1)
    Bk, top_k = 128, 6
    b = Batch([3000, 700, 1, 500], [600, 200, 1, 0], Bk=Bk, Hq=16, Hkv=2, Hi=2, Hik=1, D=128,
              Di=128, dtype=torch.bfloat16, device="cuda")
    q, qi = b.new(b.q), b.new(b.q_idx)
    kw = dict(sink_blocks=1, local_blocks=2)
    bi = serving.paged_select_blocks(qi, b.k_idx_cache, b.table, b.seq_lens, b.cu_q, top_k, **kw)
    cpu = serving.paged_forward(q.cpu(), b.k_cache.cpu(), b.v_cache.cpu(), b.table.cpu(),
                                b.seq_lens.cpu(), b.cu_q.cpu(), block_idx=bi.cpu(), **kw).float()
    got = {}
    for fp in ("query_tile", "kv_block", "split", "auto"):
        got[fp] = serving.paged_forward(q, b.k_cache, b.v_cache, b.table, b.seq_lens, b.cu_q,
                                        block_idx=bi, fwd_pass=fp, **kw)
        err = (got[fp].cpu().float() - cpu).norm() / cpu.norm()
        assert err < 1e-2, f"fwd_pass {fp}: relative L2 error {err:.3e} against the CPU backend"
    assert torch.equal(got["auto"], got["split"]) or torch.equal(got["auto"], got["query_tile"])
    with pytest.raises(ValueError, match="fwd_pass"):
        serving.paged_forward(q, b.k_cache, b.v_cache, b.table, b.seq_lens, b.cu_q, block_idx=bi,
                              fwd_pass="rows")

    # The planned prefill under a CUDA graph: the same shapes, other lengths between replays.
    cache = _cuda_cache_of(b)
    w = serving.PagedMSAWrapper(cache)
    nseq, Tq, max_pages = len(b.lens), q.shape[0], b.max_pages
    w.plan(nseq=nseq, num_tokens=Tq, num_qo_heads=16, max_pages=max_pages, num_idx_heads=2,
           top_k=top_k, **kw)
    lens = b.seq_lens.clone()

    def call():
        return w.run(q, b.table, lens, b.cu_q, q_idx=qi)

    g = graph_of(call)
    for shift in (0, -300):  # the same new tokens at earlier positions: a shorter prefix
        lens.copy_(b.seq_lens + torch.tensor([shift, 0, 0, shift], device="cuda", dtype=torch.int32))
        g.replay()
        want = serving.paged_forward(q, cache.k, cache.v, b.table, lens, b.cu_q, q_idx=qi,
                                     k_idx_cache=cache.k_idx, top_k=top_k, return_lse=True,
                                     return_block_idx=True, **kw)
        torch.cuda.synchronize()
        for a, c in zip((w.out, w.lse, w.block_idx), want):
            assert torch.equal(a, c), f"graph replay (prefix shift {shift}) differs from the eager call"

    # A plan bounded to passes of 128 new tokens: a smaller workspace, the eager call's bits.
    small = serving.PagedMSAWrapper(cache)
    small.plan(nseq=nseq, num_tokens=Tq, num_qo_heads=16, max_pages=max_pages, num_idx_heads=2,
               top_k=top_k, fwd_pass="split", fwd_chunk_tokens=128, **kw)
    assert small.workspace.numel() < w.workspace.numel()
    got = small.run(q, b.table, b.seq_lens, b.cu_q, q_idx=qi)
    want = serving.paged_forward(q, cache.k, cache.v, b.table, b.seq_lens, b.cu_q, q_idx=qi,
                                 k_idx_cache=cache.k_idx, top_k=top_k, return_lse=True,
                                 return_block_idx=True, fwd_pass="split", fwd_chunk_tokens=128, **kw)
    for a, c in zip(got, want):
        assert torch.equal(a, c), "a plan of 128-token passes differs from the eager call"
    err = (got[0].cpu().float() - cpu).norm() / cpu.norm()
    assert err < 1e-2, f"128-token passes: relative L2 error {err:.3e} against the CPU backend"


@pytest.mark.parametrize("device", ["cpu"] + (["cuda"] if CUDA else []))
def test_prefill_fp8_scores_equal_select_blocks(device):
    """select_scores="fp8" in a prefill: the E4M3 copies of each page of a sequence's index keys
    are msa.select_blocks's copies of that sequence's blocks, so the new tokens select as their
    positions do in msa.select_blocks(select_scores="fp8") over the contiguous sequences, bit for
    bit on the same backend (fp8_rerank 0 and 4, and 4 with fp8_rerank_slots 2), and
    paged_forward's selection too. The FP8
    selection must differ from the input scores' somewhere, or the case would not tell them
    apart. On the GPU: a PagedMSAWrapper planned with FP8 scores, captured in a CUDA graph and
    replayed with a shorter prefix, equals the eager call."""
    torch.manual_seed(3)
    Bk, top_k = 128, 6
    b = Batch([3000, 700, 1, 500], [600, 200, 1, 0], Bk=Bk, Hq=16, Hkv=2, Hi=2, Hik=1, D=128,
              Di=128, dtype=torch.bfloat16, device=device)
    q, qi = b.new(b.q), b.new(b.q_idx)
    kw = dict(sink_blocks=1, local_blocks=2)
    plain = serving.paged_select_blocks(qi, b.k_idx_cache, b.table, b.seq_lens, b.cu_q, top_k, **kw)
    for m, a in ((0, 0), (4, 0), (4, 2)):
        want = b.new(msa.select_blocks(b.q_idx, b.k_idx, top_k, Bk, cu_seqlens=b.cu,
                                       select_scores="fp8", fp8_rerank=m, fp8_rerank_slots=a,
                                       **kw))
        got = serving.paged_select_blocks(qi, b.k_idx_cache, b.table, b.seq_lens, b.cu_q, top_k,
                                          select_scores="fp8", fp8_rerank=m, fp8_rerank_slots=a,
                                          **kw)
        assert torch.equal(got, want), f"fp8_rerank {m}, slots {a}: differs from select_blocks"
        if m == 0:
            assert not torch.equal(got, plain), "the FP8 selection equals the input scores' here"
        _, sbi = serving.paged_forward(q, b.k_cache, b.v_cache, b.table, b.seq_lens, b.cu_q,
                                       q_idx=qi, k_idx_cache=b.k_idx_cache, top_k=top_k,
                                       select_scores="fp8", fp8_rerank=m, fp8_rerank_slots=a,
                                       return_block_idx=True, **kw)
        assert torch.equal(sbi, want), f"fp8_rerank {m}, slots {a}: paged_forward's selection differs"
    if device != "cuda":
        return
    cache = _cuda_cache_of(b)
    w = serving.PagedMSAWrapper(cache)
    w.plan(nseq=len(b.lens), num_tokens=q.shape[0], num_qo_heads=16, max_pages=b.max_pages,
           num_idx_heads=2, top_k=top_k, select_scores="fp8", **kw)
    lens = b.seq_lens.clone()
    g = graph_of(lambda: w.run(q, b.table, lens, b.cu_q, q_idx=qi))
    for shift in (0, -300):
        lens.copy_(b.seq_lens + torch.tensor([shift, 0, 0, shift], device="cuda", dtype=torch.int32))
        g.replay()
        want = serving.paged_forward(q, cache.k, cache.v, b.table, lens, b.cu_q, q_idx=qi,
                                     k_idx_cache=cache.k_idx, top_k=top_k, return_lse=True,
                                     return_block_idx=True, select_scores="fp8", **kw)
        torch.cuda.synchronize()
        for a, c in zip((w.out, w.lse, w.block_idx), want):
            assert torch.equal(a, c), f"graph replay (prefix shift {shift}) differs from the eager call"


def test_fp8_scores_errors_name_the_argument():
    """FP8 scores apply to a prefill: decode calls and bad values are refused naming the argument.
    Over an E4M3 k_idx cache they take the copies of its dequantised keys: the selection equals
    the one over a float32 cache holding float32(code * scale)."""
    b = Batch([70, 10], [5, 10], Bk=64)
    qi = b.new(b.q_idx)
    sel = lambda **kw: serving.paged_select_blocks(qi, b.k_idx_cache, b.table, b.seq_lens,  # noqa: E731
                                                   b.cu_q, 2, **kw)
    _error(lambda: sel(select_scores="fp8", max_q_len=16), "select_scores")
    _error(lambda: sel(select_scores="e4m3"), "select_scores")
    _error(lambda: sel(select_scores="fp8", fp8_rerank=65), "fp8_rerank")
    _error(lambda: sel(select_scores="fp8", fp8_rerank_slots=-1), "fp8_rerank_slots")
    k8 = b.k_idx_cache.nan_to_num(0.0).clamp(-448, 448).to(torch.float8_e4m3fn)
    ks = torch.rand(k8.shape[0], generator=torch.Generator().manual_seed(3)) + 0.25
    deq = k8.float() * ks.view(-1, 1, 1, 1)
    for m in (0, 4):
        got = serving.paged_select_blocks(qi.float(), k8, b.table, b.seq_lens, b.cu_q, 2, k_idx_scale=ks,
                                          select_scores="fp8", fp8_rerank=m)
        want = serving.paged_select_blocks(qi.float(), deq, b.table, b.seq_lens, b.cu_q, 2,
                                           select_scores="fp8", fp8_rerank=m)
        assert torch.equal(got, want), m
    _error(lambda: serving.paged_forward(b.new(b.q), b.k_cache, b.v_cache, b.table, b.seq_lens,
                                         b.cu_q, q_idx=qi, k_idx_cache=b.k_idx_cache, top_k=2,
                                         max_q_len=16, select_scores="fp8"), "select_scores")
    w = serving.PagedMSAWrapper(serving.PagedKVCache(8, 64, 2, 16, num_idx_heads=1, idx_head_dim=16))
    _error(lambda: w.plan(2, 15, 4, max_pages=4, num_idx_heads=2, top_k=2, select_scores="int8"),
           "select_scores")
