// Serving over a paged cache (docs/contract.md §6) on the CPU backend, against the training API
// on the contiguous sequences: new token j of sequence s is position seq_lens[s] - n_s + j and
// must select and attend exactly as that position does in msa::select_blocks / msa::forward.
// Both sides run the same double-precision rows on the CPU, so the results must agree bit for bit.
#include <gtest/gtest.h>

#include <functional>
#include <string>
#include <vector>

#include "harness.h"
#include "paged_cases.h"

namespace msatest {
namespace {

PagedCase make_case(std::vector<int64_t> lens, std::vector<int64_t> nq, int Bk, int k, uint64_t seed) {
  PagedCase c;
  c.lens = std::move(lens);
  c.nq = std::move(nq);
  c.Bk = Bk;
  c.k = k;
  c.seed = seed;
  return c;
}

std::vector<PagedCase> oracle_cases() {
  std::vector<PagedCase> v;
  v.push_back(make_case({1}, {1}, 64, 2, 1));                                        // one token
  PagedCase decode = make_case({127, 128, 129, 1}, {1, 5, 16, 1}, 64, 2, 2);         // block edges
  decode.max_q_len = 16;
  v.push_back(decode);
  PagedCase mixed = make_case({127, 128, 129, 3000, 0}, {16, 0, 1, 5, 0}, 128, 4, 3);  // empty requests
  mixed.max_q_len = 16;
  v.push_back(mixed);
  PagedCase prefill = make_case({3000, 700, 1}, {300, 200, 1}, 128, 5, 4);           // prefill chunks
  prefill.sink = 1;
  prefill.local = 2;
  v.push_back(prefill);
  PagedCase sink = make_case({0, 250, 0, 1000}, {0, 5, 0, 16}, 64, 6, 5);
  sink.sink = 2;
  sink.local = 3;
  v.push_back(sink);
  PagedCase bf16 = make_case({513, 64, 200}, {100, 64, 3}, 64, 4, 6);                // whole sequence as new
  bf16.dtype = DType::kBFloat16;
  bf16.Hq = 8;
  bf16.Hkv = 2;
  bf16.Hi = 4;
  bf16.Hik = 2;
  v.push_back(bf16);
  PagedCase fp16 = make_case({2100, 90}, {16, 16}, 128, 3, 7);
  fp16.dtype = DType::kFloat16;
  fp16.D = 32;
  fp16.Di = 8;
  fp16.max_q_len = 16;
  v.push_back(fp16);
  return v;
}

// paged_select_blocks alone, and paged_forward with the selection inside the call, equal the
// oracle bit for bit (block_idx, out, lse).
void expect_selections_equal(const PagedCase& cs, PagedBatch& b, const PagedRefs& r, const PagedOracle& o) {
  PagedOutputs x(b);
  expect_ok(msa::paged_select_blocks(paged_select_params(cs, r, x.block_idx.ref())));
  EXPECT_EQ(first_difference(x.block_idx, o.block_idx), "") << "paged_select_blocks";
  PagedOutputs y(b);
  expect_ok(msa::paged_forward(
      paged_forward_params(cs, r, Mode::kSparse, true, y.block_idx.ref(), y.out.ref(), y.lse.ref())));
  EXPECT_EQ(first_difference(y.block_idx, o.block_idx), "") << "paged_forward(select) block_idx";
  EXPECT_EQ(first_difference(y.out, o.out), "") << "paged_forward(select) out";
  EXPECT_EQ(first_difference(y.lse, o.lse), "") << "paged_forward(select) lse";
}

class PagedVsContiguous : public ::testing::TestWithParam<PagedCase> {};

TEST_P(PagedVsContiguous, SelectAndForward) {
  const PagedCase cs = GetParam();
  SCOPED_TRACE(cs.str());
  PagedBatch b(cs);
  const PagedRefs r = host_refs(b);
  const HostTensor kc0 = b.kc, vc0 = b.vc, kic0 = b.kic;

  const PagedOracle o = paged_oracle(b, Mode::kSparse);
  expect_selections_equal(cs, b, r, o);
  {  // forward over the caller's block_idx, without lse
    PagedOutputs x(b);
    HostTensor bi = o.block_idx;
    expect_ok(msa::paged_forward(paged_forward_params(cs, r, Mode::kSparse, false, bi.ref(), x.out.ref(), {})));
    EXPECT_EQ(first_difference(x.out, o.out), "") << "paged_forward(block_idx) out";
    EXPECT_EQ(first_difference(bi, o.block_idx), "") << "an input block_idx was written";
  }
  {  // dense causal attention over the cache
    const PagedOracle d = paged_oracle(b, Mode::kDense);
    PagedOutputs x(b);
    expect_ok(msa::paged_forward(paged_forward_params(cs, r, Mode::kDense, false, {}, x.out.ref(), x.lse.ref())));
    EXPECT_EQ(first_difference(x.out, d.out), "") << "paged_forward(kDense) out";
    EXPECT_EQ(first_difference(x.lse, d.lse), "") << "paged_forward(kDense) lse";
  }
  EXPECT_TRUE(b.kc.bitwise_equal(kc0) && b.vc.bitwise_equal(vc0) && b.kic.bitwise_equal(kic0))
      << "a read-only cache was written";
  EXPECT_EQ(msa::workspace_size(paged_select_params(cs, r, PagedOutputs(b).block_idx.ref())), 0u);
}

INSTANTIATE_TEST_SUITE_P(Cases, PagedVsContiguous, ::testing::ValuesIn(oracle_cases()));

// FP8 scores in a prefill (select_scores = kFp8, fp8_rerank 0 and 4): the E4M3 copies of each
// page of a sequence's index keys are select_blocks's copies of that sequence's blocks, so the
// new tokens select exactly as their positions do in select_blocks with kFp8 over the contiguous
// sequences (paged_select_blocks, and paged_forward with select, whose out follows). The FP8
// selection must also differ from kInput's somewhere in these cases, or the comparison would not
// show that the copies were used.
TEST(Paged, Fp8ScoresInAPrefill) {
  PagedCase chunks = make_case({3000, 700, 1}, {300, 200, 1}, 128, 5, 4);
  chunks.sink = 1;
  chunks.local = 2;
  PagedCase bf16 = make_case({513, 64, 200, 0}, {100, 64, 3, 0}, 64, 4, 6);  // whole sequences as new
  bf16.dtype = DType::kBFloat16;
  bf16.Hi = 4;
  bf16.Hik = 2;
  int64_t differ = 0;
  for (PagedCase cs : {chunks, bf16}) {
    PagedBatch plain(cs);
    const HostTensor input_bi = paged_oracle(plain, Mode::kSparse).block_idx;
    for (int m : {0, 4}) {
      cs.select_scores = msa::SelectScores::kFp8;
      cs.fp8_rerank = m;
      SCOPED_TRACE(cs.str());
      PagedBatch b(cs);
      const PagedRefs r = host_refs(b);
      const PagedOracle o = paged_oracle(b, Mode::kSparse);
      if (m == 0)
        for (int64_t x = 0; x < o.block_idx.numel(); ++x) differ += o.block_idx.get(x) != input_bi.get(x);
      expect_selections_equal(cs, b, r, o);
    }
  }
  EXPECT_GT(differ, 0) << "kFp8 chose as kInput everywhere: the cases do not tell the scores apart";
}

// A row of a page the sequence does not own, or a row past its length, is never read: poisoning
// them with NaN (as the builder does) would show in every output; here a sequence's own pages
// hold another sequence's data after its end, and its outputs must not change.
TEST(Paged, RowsPastTheLengthAreNotRead) {
  PagedCase cs = make_case({100, 300}, {7, 9}, 64, 3, 11);
  PagedBatch b(cs);
  const PagedRefs r = host_refs(b);
  PagedOutputs a(b);
  expect_ok(msa::paged_forward(paged_forward_params(cs, r, Mode::kSparse, true, a.block_idx.ref(), a.out.ref(), a.lse.ref())));
  // Rows 100..127 of sequence 0's last page: fill with large values.
  const int64_t row = static_cast<int64_t>(cs.Hkv) * cs.D, irow = static_cast<int64_t>(cs.Hik) * cs.Di;
  for (int64_t x = 100; x < 128; ++x) {
    const int64_t cr = b.cache_row(0, x);
    for (int64_t e = 0; e < row; ++e) {
      b.kc.set(cr * row + e, 50.0);
      b.vc.set(cr * row + e, -50.0);
    }
    for (int64_t e = 0; e < irow; ++e) b.kic.set(cr * irow + e, 100.0);
  }
  for (Mode mode : {Mode::kSparse, Mode::kDense}) {
    PagedOutputs x(b);
    expect_ok(msa::paged_forward(paged_forward_params(cs, r, mode, mode == Mode::kSparse, x.block_idx.ref(), x.out.ref(), x.lse.ref())));
    const PagedOracle o = paged_oracle(b, mode);
    EXPECT_EQ(first_difference(x.out, o.out), "");
    EXPECT_EQ(first_difference(x.lse, o.lse), "");
    if (mode == Mode::kSparse) EXPECT_EQ(first_difference(x.out, a.out), "");
  }
}

// Chunked prefill: two chunks, each appended to the cache and then attended, equal the one-shot
// prefill of the whole sequences (and leave the cache as the one-shot batch holds it).
TEST(Paged, ChunkedPrefillEqualsOneShot) {
  PagedCase cs = make_case({700, 300, 64}, {700, 300, 64}, 64, 4, 12);
  cs.sink = 1;
  PagedBatch one(cs);
  const PagedRefs r1 = host_refs(one);
  PagedOutputs whole(one);
  expect_ok(msa::paged_forward(
      paged_forward_params(cs, r1, Mode::kSparse, true, whole.block_idx.ref(), whole.out.ref(), whole.lse.ref())));
  const PagedOracle o = paged_oracle(one, Mode::kSparse);
  EXPECT_EQ(first_difference(whole.out, o.out), "");

  // Chunk boundaries per sequence: positions [0, cut) then [cut, len).
  const std::vector<int64_t> cut = {400, 150, 0};
  HostTensor kc = one.kc, vc = one.vc, kic = one.kic;
  kc.fill(NAN);
  vc.fill(NAN);
  kic.fill(NAN);
  for (int chunk = 0; chunk < 2; ++chunk) {
    std::vector<int64_t> rows, one_rows;  // rows of `full`, rows of the one-shot call
    HostTensor seq_lens(DType::kInt32, {one.nseq}), cu(DType::kInt32, {one.nseq + 1});
    cu.set(0, 0);
    for (int64_t s = 0; s < one.nseq; ++s) {
      const int64_t lo = chunk == 0 ? 0 : cut[s], hi = chunk == 0 ? cut[s] : cs.lens[s];
      for (int64_t x = lo; x < hi; ++x) {
        rows.push_back(one.full.offsets[s] + x);
        one_rows.push_back(one.full.offsets[s] + x);  // the one-shot call's new tokens are all rows
      }
      seq_lens.set(s, static_cast<double>(hi));
      cu.set(s + 1, static_cast<double>(rows.size()));
    }
    HostTensor k = gather_rows(one.full.k, rows), v = gather_rows(one.full.v, rows);
    HostTensor ki = gather_rows(one.full.k_idx, rows), q = gather_rows(one.full.q, rows);
    HostTensor qi = gather_rows(one.full.q_idx, rows);
    PagedRefs r{q.ref(), qi.ref(), kc.ref(), vc.ref(), kic.ref(), one.page_table.ref(), seq_lens.ref(), cu.ref()};
    msa::PagedAppendParams ap;
    ap.k = k.ref();
    ap.v = v.ref();
    ap.k_idx = ki.ref();
    ap.cu_seqlens_q = cu.ref();
    ap.cache = cache_of(r);
    ap.block_size = cs.Bk;
    expect_ok(msa::paged_append(ap));
    const int64_t Tq = static_cast<int64_t>(rows.size());
    HostTensor bi(DType::kInt32, {Tq, cs.Hi, cs.k}), out(cs.dtype, {Tq, cs.Hq, cs.D}), lse(DType::kFloat32, {Tq, cs.Hq});
    out.fill(NAN);
    expect_ok(msa::paged_forward(paged_forward_params(cs, r, Mode::kSparse, true, bi.ref(), out.ref(), lse.ref())));
    EXPECT_EQ(first_difference(out, gather_rows(whole.out, one_rows)), "") << "chunk " << chunk;
    EXPECT_EQ(first_difference(lse, gather_rows(whole.lse, one_rows)), "") << "chunk " << chunk;
    EXPECT_EQ(first_difference(bi, gather_rows(whole.block_idx, one_rows)), "") << "chunk " << chunk;
  }
  EXPECT_EQ(first_difference(kc, one.kc), "") << "cache.k after both chunks";
  EXPECT_EQ(first_difference(vc, one.vc), "") << "cache.v after both chunks";
  EXPECT_EQ(first_difference(kic, one.kic), "") << "cache.k_idx after both chunks";
}

// paged_append writes the new tokens' rows, and only them; an absent input leaves its cache alone.
TEST(Paged, AppendWritesTheNewRowsOnly) {
  for (DType dt : {DType::kBFloat16, DType::kFloat32}) {
    PagedCase cs = make_case({130, 0, 64, 5}, {16, 0, 64, 1}, 64, 3, 13);
    cs.dtype = dt;
    PagedBatch b(cs);
    // The caches before the append: the new rows hold a sentinel.
    HostTensor kc = b.kc, vc = b.vc, kic = b.kic;
    const int64_t row = static_cast<int64_t>(cs.Hkv) * cs.D, irow = static_cast<int64_t>(cs.Hik) * cs.Di;
    for (int64_t s = 0; s < b.nseq; ++s)
      for (int64_t x = cs.lens[s] - cs.nq[s]; x < cs.lens[s]; ++x) {
        const int64_t cr = b.cache_row(s, x);
        for (int64_t e = 0; e < row; ++e) {
          kc.set(cr * row + e, 3.0);
          vc.set(cr * row + e, 3.0);
        }
        for (int64_t e = 0; e < irow; ++e) kic.set(cr * irow + e, 3.0);
      }
    HostTensor k = gather_rows(b.full.k, b.new_rows), v = gather_rows(b.full.v, b.new_rows);
    HostTensor ki = gather_rows(b.full.k_idx, b.new_rows);
    const HostTensor vc_before = vc;
    msa::PagedAppendParams ap;
    ap.k = k.ref();
    ap.k_idx = ki.ref();  // v absent: cache.v untouched
    ap.cu_seqlens_q = b.cu_q.ref();
    ap.cache.k = kc.ref();
    ap.cache.v = vc.ref();
    ap.cache.k_idx = kic.ref();
    ap.cache.page_table = b.page_table.ref();
    ap.cache.seq_lens = b.seq_lens.ref();
    ap.block_size = cs.Bk;
    expect_ok(msa::paged_append(ap));
    EXPECT_EQ(first_difference(kc, b.kc), "") << msa::dtype_name(dt);
    EXPECT_EQ(first_difference(kic, b.kic), "") << msa::dtype_name(dt);
    EXPECT_TRUE(vc.bitwise_equal(vc_before)) << "cache.v was written without v";
    ap.k = {};
    ap.k_idx = {};
    ap.v = v.ref();
    expect_ok(msa::paged_append(ap));
    EXPECT_EQ(first_difference(vc, b.vc), "") << msa::dtype_name(dt);
  }
}

// Decode steps with multi-token prediction: 4 new tokens per step appended and attended, each
// step equal to the contiguous reference at its positions.
TEST(Paged, DecodeStepsWithFourTokens) {
  PagedCase cs = make_case({260, 75}, {260, 75}, 64, 3, 14);
  cs.max_q_len = 4;
  PagedBatch b(cs);  // the full sequences; prefill then decode from the last 12 positions
  HostTensor kc = b.kc, vc = b.vc, kic = b.kic;
  const PagedOracle o = paged_oracle(b, Mode::kSparse);
  const int64_t prompt[2] = {248, 63};
  for (int64_t s = 0; s < b.nseq; ++s)  // the decoded positions are not in the cache yet
    for (int64_t x = prompt[s]; x < cs.lens[s]; ++x) {
      const int64_t cr = b.cache_row(s, x), row = static_cast<int64_t>(cs.Hkv) * cs.D;
      for (int64_t e = 0; e < row; ++e) kc.set(cr * row + e, NAN);
    }
  for (int step = 0; step < 3; ++step) {
    std::vector<int64_t> rows, orows;
    HostTensor seq_lens(DType::kInt32, {b.nseq}), cu(DType::kInt32, {b.nseq + 1});
    cu.set(0, 0);
    for (int64_t s = 0; s < b.nseq; ++s) {
      const int64_t lo = prompt[s] + 4 * step;
      for (int64_t x = lo; x < lo + 4; ++x) {
        rows.push_back(b.full.offsets[s] + x);
        orows.push_back(b.full.offsets[s] + x);  // the oracle's rows: every position is new there
      }
      seq_lens.set(s, static_cast<double>(lo + 4));
      cu.set(s + 1, static_cast<double>(rows.size()));
    }
    HostTensor k = gather_rows(b.full.k, rows), q = gather_rows(b.full.q, rows), qi = gather_rows(b.full.q_idx, rows);
    PagedRefs r{q.ref(), qi.ref(), kc.ref(), vc.ref(), kic.ref(), b.page_table.ref(), seq_lens.ref(), cu.ref()};
    msa::PagedAppendParams ap;
    ap.k = k.ref();
    ap.cu_seqlens_q = cu.ref();
    ap.cache = cache_of(r);
    ap.block_size = cs.Bk;
    expect_ok(msa::paged_append(ap));
    const int64_t Tq = static_cast<int64_t>(rows.size());
    HostTensor bi(DType::kInt32, {Tq, cs.Hi, cs.k}), out(cs.dtype, {Tq, cs.Hq, cs.D}), lse(DType::kFloat32, {Tq, cs.Hq});
    expect_ok(msa::paged_forward(paged_forward_params(cs, r, Mode::kSparse, true, bi.ref(), out.ref(), lse.ref())));
    EXPECT_EQ(first_difference(out, gather_rows(o.out, orows)), "") << "step " << step;
    EXPECT_EQ(first_difference(lse, gather_rows(o.lse, orows)), "") << "step " << step;
    EXPECT_EQ(first_difference(bi, gather_rows(o.block_idx, orows)), "") << "step " << step;
  }
}

// ---- bad input: kInvalidArgument naming the argument --------------------------------------------

void expect_invalid(const msa::Status& s, const std::string& arg, const std::string& what) {
  EXPECT_EQ(s.code, msa::StatusCode::kInvalidArgument) << what << ": " << s.message;
  EXPECT_NE(s.message.find("argument '" + arg + "'"), std::string::npos)
      << what << ": message does not name '" << arg << "': " << s.message;
}

// Valid buffers: two sequences of 70 and 10 tokens with 5 and 10 new ones, Bk = 64.
struct ValidPaged {
  PagedCase cs;
  PagedBatch b;
  PagedRefs r;
  PagedOutputs o;
  HostTensor bi, k, v, ki;
  ValidPaged() : cs(make_case({70, 10}, {5, 10}, 64, 2, 21)), b(cs), r(host_refs(b)), o(b) {
    bi = paged_oracle(b, Mode::kSparse).block_idx;
    k = gather_rows(b.full.k, b.new_rows);
    v = gather_rows(b.full.v, b.new_rows);
    ki = gather_rows(b.full.k_idx, b.new_rows);
  }
  msa::PagedSelectParams select() { return paged_select_params(cs, r, o.block_idx.ref()); }
  msa::PagedForwardParams forward(bool sel = true) {
    return paged_forward_params(cs, r, Mode::kSparse, sel, sel ? o.block_idx.ref() : bi.ref(), o.out.ref(), o.lse.ref());
  }
  msa::PagedAppendParams append() { return paged_append_params(k.ref(), v.ref(), ki.ref(), r, cs.Bk); }
};

template <class P>
struct Case {
  const char* what;
  const char* arg;
  std::function<void(P&, ValidPaged&)> mutate;
};

template <class P>
using Batch = std::vector<Case<P>>;

// Cases every call shares: the batch description and the cache layout.
template <class P>
Batch<P> batch_cases() {
  return {
      {"page id out of range", "cache.page_table", [](P&, ValidPaged& v) { v.b.page_table.set(1, static_cast<double>(v.b.pages)); }},
      {"negative page id", "cache.page_table", [](P&, ValidPaged& v) { v.b.page_table.set(v.b.max_pages, -1); }},
      {"page_table rank", "cache.page_table", [](P& p, ValidPaged&) { p.cache.page_table.rank = 1; }},
      {"page_table dtype", "cache.page_table", [](P& p, ValidPaged&) { p.cache.page_table.dtype = DType::kFloat32; }},
      {"page_table rows", "cache.page_table", [](P& p, ValidPaged&) { p.cache.page_table.shape[0] = 1; }},
      {"page_table missing", "cache.page_table", [](P& p, ValidPaged&) { p.cache.page_table = {}; }},
      {"seq_len beyond the pages", "cache.seq_lens",
       [](P&, ValidPaged& v) { v.b.seq_lens.set(1, static_cast<double>(v.b.max_pages * v.cs.Bk + 1)); }},
      {"n_s > seq_len", "cache.seq_lens", [](P&, ValidPaged& v) { v.b.seq_lens.set(1, 9); }},
      {"negative seq_len", "cache.seq_lens", [](P&, ValidPaged& v) { v.b.seq_lens.set(0, -1); }},
      {"seq_lens shape", "cache.seq_lens", [](P& p, ValidPaged&) { p.cache.seq_lens.shape[0] = 3; }},
      {"seq_lens dtype", "cache.seq_lens", [](P& p, ValidPaged&) { p.cache.seq_lens.dtype = DType::kFloat32; }},
      {"cu_seqlens_q missing", "cu_seqlens_q", [](P& p, ValidPaged&) { p.cu_seqlens_q = {}; }},
      {"cu_seqlens_q end", "cu_seqlens_q", [](P&, ValidPaged& v) { v.b.cu_q.set(2, 14); }},
      {"cu_seqlens_q start", "cu_seqlens_q", [](P&, ValidPaged& v) { v.b.cu_q.set(0, 1); }},
      {"cu_seqlens_q decreasing", "cu_seqlens_q", [](P&, ValidPaged& v) { v.b.cu_q.set(1, 16); }},
      {"cu_seqlens_q size", "cu_seqlens_q", [](P& p, ValidPaged&) { p.cu_seqlens_q.shape[0] = 1; }},
  };
}

template <class P, class M, class F>
void run_cases(const Batch<P>& cases, M&& make, F&& call) {
  for (const Case<P>& c : cases) {
    ValidPaged v;
    P p = make(v);
    c.mutate(p, v);
    expect_invalid(call(p), c.arg, c.what);
  }
}

TEST(PagedValidation, ValidParamsPass) {
  ValidPaged v;
  expect_ok(msa::paged_select_blocks(v.select()));
  expect_ok(msa::paged_forward(v.forward(true)));
  expect_ok(msa::paged_forward(v.forward(false)));
  expect_ok(msa::paged_append(v.append()));
}

TEST(PagedValidation, Select) {
  using P = msa::PagedSelectParams;
  Batch<P> cases = batch_cases<P>();
  const Batch<P> own = {
      {"max_q_len 17", "max_q_len", [](P& p, ValidPaged&) { p.max_q_len = 17; }},
      {"max_q_len negative", "max_q_len", [](P& p, ValidPaged&) { p.max_q_len = -1; }},
      {"n_s > max_q_len", "max_q_len", [](P& p, ValidPaged&) { p.max_q_len = 8; }},
      {"kDense", "mode", [](P& p, ValidPaged&) { p.opts.mode = Mode::kDense; }},
      {"block_size", "block_size", [](P& p, ValidPaged&) { p.opts.block_size = 48; }},
      {"top_k below the forced blocks", "top_k", [](P& p, ValidPaged&) { p.opts.local_blocks = 3; }},
      {"q_idx missing", "q_idx", [](P& p, ValidPaged&) { p.q_idx = {}; }},
      {"q_idx dtype", "q_idx", [](P& p, ValidPaged&) { p.q_idx.dtype = DType::kInt32; }},
      {"page shape", "cache.k_idx", [](P& p, ValidPaged&) { p.cache.k_idx.shape[1] = 32; }},
      {"k_idx cache rank", "cache.k_idx", [](P& p, ValidPaged&) { p.cache.k_idx.rank = 3; }},
      {"k_idx cache Di", "cache.k_idx", [](P& p, ValidPaged&) { p.cache.k_idx.shape[3] = 8; }},
      {"k_idx cache dtype", "cache.k_idx", [](P& p, ValidPaged&) { p.cache.k_idx.dtype = DType::kFloat64; }},
      {"k_idx cache Hik", "cache.k_idx", [](P& p, ValidPaged&) { p.cache.k_idx.shape[2] = 3; }},
      {"block_idx width", "block_idx", [](P& p, ValidPaged&) { p.block_idx.shape[2] = 1; }},
      {"block_idx missing", "block_idx", [](P& p, ValidPaged&) { p.block_idx = {}; }},
      {"block_idx aliasing q_idx", "block_idx", [](P& p, ValidPaged&) { p.block_idx.data = p.q_idx.data; }},
      {"FP8 scores in decode", "select_scores",
       [](P& p, ValidPaged&) { p.opts.select_scores = msa::SelectScores::kFp8; p.max_q_len = 16; }},
  };
  cases.insert(cases.end(), own.begin(), own.end());
  run_cases<P>(cases, [](ValidPaged& v) { return v.select(); }, [](const P& p) { return msa::paged_select_blocks(p); });
}

TEST(PagedValidation, Forward) {
  using P = msa::PagedForwardParams;
  Batch<P> cases = batch_cases<P>();
  const Batch<P> own = {
      {"max_q_len 17", "max_q_len", [](P& p, ValidPaged&) { p.max_q_len = 17; }},
      {"n_s > max_q_len", "max_q_len", [](P& p, ValidPaged&) { p.max_q_len = 9; }},
      {"q missing", "q", [](P& p, ValidPaged&) { p.q = {}; }},
      {"q rank", "q", [](P& p, ValidPaged&) { p.q.rank = 2; }},
      {"page shape of k", "cache.k", [](P& p, ValidPaged&) { p.cache.k.shape[1] = 32; }},
      {"k cache rank", "cache.k", [](P& p, ValidPaged&) { p.cache.k.rank = 3; }},
      {"k cache dtype", "cache.k", [](P& p, ValidPaged&) { p.cache.k.dtype = DType::kFloat64; }},
      {"k cache D", "cache.k", [](P& p, ValidPaged&) { p.cache.k.shape[3] = 8; }},
      {"k cache Hkv", "cache.k", [](P& p, ValidPaged&) { p.cache.k.shape[2] = 3; }},
      {"v cache pages", "cache.v", [](P& p, ValidPaged&) { p.cache.v.shape[0] -= 1; }},
      {"v cache missing", "cache.v", [](P& p, ValidPaged&) { p.cache.v = {}; }},
      {"k_idx cache pages", "cache.k_idx", [](P& p, ValidPaged&) { p.cache.k_idx.shape[0] -= 1; }},
      {"k_idx cache missing with select", "cache.k_idx", [](P& p, ValidPaged&) { p.cache.k_idx = {}; }},
      {"q_idx missing with select", "q_idx", [](P& p, ValidPaged&) { p.q_idx = {}; }},
      {"q_idx tokens", "q_idx", [](P& p, ValidPaged&) { p.q_idx.shape[0] = 3; }},
      {"out shape", "out", [](P& p, ValidPaged&) { p.out.shape[1] = 2; }},
      {"out dtype", "out", [](P& p, ValidPaged&) { p.out.dtype = DType::kFloat64; }},
      {"out missing", "out", [](P& p, ValidPaged&) { p.out = {}; }},
      {"lse shape", "lse", [](P& p, ValidPaged&) { p.lse.shape[1] = 2; }},
      {"out aliasing the cache", "out", [](P& p, ValidPaged&) { p.out.data = p.cache.v.data; }},
      {"block_idx width vs top_k", "block_idx", [](P& p, ValidPaged&) { p.opts.top_k = 1; p.opts.local_blocks = 1; }},
      {"scale", "scale", [](P& p, ValidPaged&) { p.opts.scale = NAN; }},
      {"FP8 scores in decode", "select_scores",
       [](P& p, ValidPaged&) { p.opts.select_scores = msa::SelectScores::kFp8; p.max_q_len = 16; }},
  };
  cases.insert(cases.end(), own.begin(), own.end());
  run_cases<P>(cases, [](ValidPaged& v) { return v.forward(true); }, [](const P& p) { return msa::paged_forward(p); });

  // A caller's block_idx: each entry -1 or a block in [0, blk(p)] at the token's position p.
  auto caller = [](const std::function<void(ValidPaged&)>& f, const char* what) {
    ValidPaged v;
    f(v);
    expect_invalid(msa::paged_forward(v.forward(false)), "block_idx", what);
  };
  // New token 0 of sequence 0 is position 65 (block 1); token 5 of sequence 1 is position 0.
  caller([](ValidPaged& v) { v.bi.set(0, 2); }, "entry after the own block");
  caller([](ValidPaged& v) { v.bi.set(5 * v.cs.Hi * v.cs.k, 1); }, "entry after the own block at position 0");
  caller([](ValidPaged& v) { v.bi.set(0, -2); }, "entry below -1");
  caller([](ValidPaged& v) { v.bi.set(0, 1); v.bi.set(1, 1); }, "duplicate entry");
  {  // the same entries are fine where the position allows them
    ValidPaged v;
    v.bi.set(0, 1);
    v.bi.set(1, -1);
    expect_ok(msa::paged_forward(v.forward(false)));
  }
  {  // kDense needs no block_idx and no index tensors
    ValidPaged v;
    msa::PagedForwardParams p = v.forward(false);
    p.opts.mode = Mode::kDense;
    p.block_idx = {};
    p.cache.k_idx = {};
    expect_ok(msa::paged_forward(p));
  }
}

TEST(PagedValidation, Append) {
  using P = msa::PagedAppendParams;
  Batch<P> cases = batch_cases<P>();
  const Batch<P> own = {
      {"nothing to append", "k", [](P& p, ValidPaged&) { p.k = {}; p.v = {}; p.k_idx = {}; }},
      {"block_size vs the pages", "cache.k", [](P& p, ValidPaged&) { p.block_size = 32; }},
      {"block_size", "block_size", [](P& p, ValidPaged&) { p.block_size = 0; }},
      {"v tokens", "v", [](P& p, ValidPaged&) { p.v.shape[0] = 3; }},
      {"v shape", "v", [](P& p, ValidPaged&) { p.v.shape[1] = 1; }},
      {"v dtype", "v", [](P& p, ValidPaged&) { p.v.dtype = DType::kFloat64; }},
      {"k_idx tokens", "k_idx", [](P& p, ValidPaged&) { p.k_idx.shape[0] = 3; }},
      {"k cache missing", "cache.k", [](P& p, ValidPaged&) { p.cache.k = {}; }},
      {"k cache dtype", "cache.k", [](P& p, ValidPaged&) { p.cache.k.dtype = DType::kInt32; }},
      {"k dtype vs the cache", "k", [](P& p, ValidPaged&) { p.k.dtype = DType::kFloat64; }},
      {"v cache dtype vs the k cache", "cache.v", [](P& p, ValidPaged&) { p.cache.v.dtype = DType::kFloat64; }},
      {"v cache pages", "cache.v", [](P& p, ValidPaged&) { p.cache.v.shape[0] -= 1; }},
      {"k_idx head dim vs the cache", "k_idx", [](P& p, ValidPaged&) { p.cache.k_idx.shape[3] = 8; }},
      {"k heads vs the cache", "k", [](P& p, ValidPaged&) { p.k.shape[1] = 1; }},
      {"cache aliasing the input", "cache.v", [](P& p, ValidPaged&) { p.cache.v.data = p.cache.k.data; }},
  };
  cases.insert(cases.end(), own.begin(), own.end());
  run_cases<P>(cases, [](ValidPaged& v) { return v.append(); }, [](const P& p) { return msa::paged_append(p); });
}

// A failed call writes nothing.
TEST(PagedValidation, NothingWrittenOnError) {
  ValidPaged v;
  const HostTensor kc = v.b.kc;
  msa::PagedAppendParams a = v.append();
  v.b.page_table.set(1, static_cast<double>(v.b.pages));
  expect_invalid(msa::paged_append(a), "cache.page_table", "page id out of range");
  EXPECT_TRUE(v.b.kc.bitwise_equal(kc));
  msa::PagedForwardParams f = v.forward(true);
  expect_invalid(msa::paged_forward(f), "cache.page_table", "page id out of range");
  for (int64_t x = 0; x < v.o.block_idx.numel(); ++x) ASSERT_EQ(v.o.block_idx.get(x), -7);
  for (int64_t x = 0; x < v.o.out.numel(); ++x) ASSERT_TRUE(std::isnan(v.o.out.get(x)));
}

}  // namespace
}  // namespace msatest
