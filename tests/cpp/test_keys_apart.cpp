// Keys apart from queries (cu_seqlens_k, docs/contract.md §1): sequence s has m_s keys and its
// n_s queries are its last positions. Such a call must equal the call over the whole sequences
// (queries = keys) on the rows it holds: the selection, out, lse and the KL terms row by row;
// and the gradients when the whole call's other rows take no part (zero dout, and in sparse mode
// an empty support, which adds nothing to the KL: contract §3). The CPU backend sums in a fixed
// order, so every comparison is exact. Also: the dense warmup over keys apart equals the sparse
// call over every causal block, and bad values of cu_seqlens_k are refused by name. (The CUDA
// backend is compared with this one in test_cuda.cpp, CudaKeysApart.)
#include <gtest/gtest.h>

#include "harness.h"

namespace msatest {
namespace {

using msa::StatusCode;

// The rows of `full` ([T, ...]) that a keys-apart call holds: the last n[s] of every sequence.
HostTensor suffix_rows(const HostTensor& full, const std::vector<int64_t>& cu, const std::vector<int64_t>& n) {
  int64_t rows = 0;
  for (int64_t x : n) rows += x;
  std::vector<int64_t> shape = full.shape();
  const int64_t row = full.numel() / std::max<int64_t>(shape[0], 1);
  shape[0] = rows;
  HostTensor out(full.dtype(), shape);
  int64_t r = 0;
  for (size_t s = 0; s + 1 < cu.size(); ++s)
    for (int64_t g = cu[s + 1] - n[s]; g < cu[s + 1]; ++g, ++r)
      for (int64_t x = 0; x < row; ++x) out.set(r * row + x, full.get(g * row + x));
  return out;
}

// Values equal (NaN never equal), element by element.
void expect_equal(const HostTensor& a, const HostTensor& b, const char* what) {
  ASSERT_EQ(a.shape(), b.shape()) << what;
  for (int64_t x = 0; x < a.numel(); ++x)
    ASSERT_TRUE(a.get(x) == b.get(x)) << what << " element " << x << ": " << a.get(x) << " vs " << b.get(x);
}

HostTensor offsets(const std::vector<int64_t>& cu) {
  HostTensor t(DType::kInt32, {static_cast<int64_t>(cu.size())});
  for (size_t s = 0; s < cu.size(); ++s) t.set(static_cast<int64_t>(s), static_cast<double>(cu[s]));
  return t;
}

// A batch over which a keys-apart call holds the last n[s] positions of every sequence: empty
// sequences, no queries, all queries, a first query mid-block, on a block boundary.
struct Split {
  Config cfg;
  std::vector<int64_t> n;  // queries per sequence
};

Split make_split(uint64_t seed, DType dtype = DType::kFloat64) {
  Split x;
  x.cfg = make_config({150, 0, 64, 97, 40, 200}, 8, 2, 16, 4, 2, 16, 4, seed);
  x.cfg.sink = 1;
  x.cfg.dtype = dtype;
  x.n = {61, 0, 64, 0, 40, 48};
  return x;
}

struct Apart {
  Problem p;  // the whole sequences
  std::vector<int64_t> n, cu_q;
  int64_t Tq = 0;
  HostTensor q, q_idx, cuq, cuk;  // the keys-apart call's queries and offsets
  explicit Apart(const Split& x) : p(x.cfg), n(x.n) {
    cu_q.assign(1, 0);
    for (int64_t c : n) cu_q.push_back(cu_q.back() + c);
    Tq = cu_q.back();
    q = suffix_rows(p.q, p.offsets, n);
    q_idx = suffix_rows(p.q_idx, p.offsets, n);
    cuq = offsets(cu_q);
    cuk = offsets(p.offsets);
  }
  // A full-call tensor's rows of this call.
  HostTensor rows(const HostTensor& full) const { return suffix_rows(full, p.offsets, n); }
};

HostTensor select_apart(Apart& a, const msa::Options& opts, HostTensor* lse_idx) {
  const Config& c = a.p.cfg;
  HostTensor bi(DType::kInt32, {a.Tq, c.Hi, c.k});
  bi.fill(-7);
  *lse_idx = HostTensor(DType::kFloat32, {a.Tq, c.Hi});
  lse_idx->fill(NAN);
  msa::SelectParams sp;
  sp.q_idx = a.q_idx.ref();
  sp.k_idx = a.p.k_idx.ref();
  sp.cu_seqlens = a.cuq.ref();
  sp.cu_seqlens_k = a.cuk.ref();
  sp.block_idx = bi.ref();
  sp.lse_idx = lse_idx->ref();
  sp.opts = opts;
  const msa::Status s = msa::select_blocks(sp);
  EXPECT_TRUE(s.ok()) << s.message;
  return bi;
}

struct Fwd {
  HostTensor out, lse, kl, kl_rows;
};

Fwd forward_apart(Apart& a, HostTensor* bi, Mode mode) {
  const Config& c = a.p.cfg;
  Fwd r{HostTensor(c.dtype, {a.Tq, c.Hq, c.D}), HostTensor(DType::kFloat32, {a.Tq, c.Hq}),
        HostTensor(DType::kFloat32, {1}), HostTensor(DType::kFloat32, {a.Tq, c.Hi})};
  for (HostTensor* t : {&r.out, &r.lse, &r.kl, &r.kl_rows}) t->fill(NAN);
  msa::ForwardParams fp;
  fp.q = a.q.ref();
  fp.k = a.p.k.ref();
  fp.v = a.p.v.ref();
  fp.cu_seqlens = a.cuq.ref();
  fp.cu_seqlens_k = a.cuk.ref();
  if (mode == Mode::kSparse) fp.block_idx = bi->ref();
  fp.q_idx = a.q_idx.ref();
  fp.k_idx = a.p.k_idx.ref();
  fp.out = r.out.ref();
  fp.lse = r.lse.ref();
  fp.kl = r.kl.ref();
  fp.opts = a.p.options(mode);
  msa::Status s = msa::forward(fp);
  EXPECT_TRUE(s.ok()) << s.message;
  msa::KlParams kp;
  kp.q = a.q.ref();
  kp.k = a.p.k.ref();
  kp.lse = r.lse.ref();
  kp.q_idx = a.q_idx.ref();
  kp.k_idx = a.p.k_idx.ref();
  kp.cu_seqlens = a.cuq.ref();
  kp.cu_seqlens_k = a.cuk.ref();
  if (mode == Mode::kSparse) kp.block_idx = bi->ref();
  HostTensor kl2(DType::kFloat32, {1});
  kp.kl = kl2.ref();
  kp.kl_rows = r.kl_rows.ref();
  kp.opts = a.p.options(mode);
  s = msa::kl_divergence(kp);
  EXPECT_TRUE(s.ok()) << s.message;
  EXPECT_TRUE(kl2.get(0) == r.kl.get(0)) << "kl_divergence " << kl2.get(0) << " vs forward " << r.kl.get(0);
  return r;
}

// The full call's per-row KL terms (kl_divergence's kl_rows).
HostTensor kl_rows_full(Problem& p, HostTensor* bi, Mode mode, FwdResult& f) {
  HostTensor rows(DType::kFloat32, {p.T, p.cfg.Hi}), kl(DType::kFloat32, {1});
  msa::KlParams kp;
  kp.q = p.q.ref();
  kp.k = p.k.ref();
  kp.lse = f.lse.ref();
  kp.q_idx = p.q_idx.ref();
  kp.k_idx = p.k_idx.ref();
  kp.cu_seqlens = p.cu.ref();
  if (mode == Mode::kSparse) kp.block_idx = bi->ref();
  kp.kl = kl.ref();
  kp.kl_rows = rows.ref();
  kp.opts = p.options(mode);
  const msa::Status s = msa::kl_divergence(kp);
  EXPECT_TRUE(s.ok()) << s.message;
  return rows;
}

// The keys-apart backward's gradient tensors (NaN-filled): dk's rows given, Tk by default.
BwdResult apart_grads(const Apart& a, int64_t dk_rows = -1) {
  const Config& c = a.p.cfg;
  const int64_t Tk = a.p.T;
  BwdResult r{HostTensor(c.dtype, {a.Tq, c.Hq, c.D}), HostTensor(c.dtype, {dk_rows < 0 ? Tk : dk_rows, c.Hkv, c.D}),
              HostTensor(c.dtype, {Tk, c.Hkv, c.D}), HostTensor(c.dtype, {a.Tq, c.Hi, c.Di}),
              HostTensor(c.dtype, {Tk, c.Hik, c.Di})};
  for (HostTensor* t : {&r.dq, &r.dk, &r.dv, &r.dq_idx, &r.dk_idx}) t->fill(NAN);
  return r;
}

msa::Status call_backward(Apart& a, HostTensor* bi, Mode mode, Fwd& f, HostTensor& dout, double kl_weight,
                          BwdResult& r) {
  msa::BackwardParams bp;
  bp.q = a.q.ref();
  bp.k = a.p.k.ref();
  bp.v = a.p.v.ref();
  bp.out = f.out.ref();
  bp.lse = f.lse.ref();
  bp.dout = dout.ref();
  bp.cu_seqlens = a.cuq.ref();
  bp.cu_seqlens_k = a.cuk.ref();
  if (mode == Mode::kSparse) bp.block_idx = bi->ref();
  bp.dq = r.dq.ref();
  bp.dk = r.dk.ref();
  bp.dv = r.dv.ref();
  bp.q_idx = a.q_idx.ref();
  bp.k_idx = a.p.k_idx.ref();
  bp.dq_idx = r.dq_idx.ref();
  bp.dk_idx = r.dk_idx.ref();
  bp.kl_weight = static_cast<float>(kl_weight);
  bp.opts = a.p.options(mode);
  return msa::backward(bp);
}

BwdResult backward_apart(Apart& a, HostTensor* bi, Mode mode, Fwd& f, HostTensor& dout, double kl_weight) {
  BwdResult r = apart_grads(a);
  const msa::Status s = call_backward(a, bi, mode, f, dout, kl_weight, r);
  EXPECT_TRUE(s.ok()) << s.message;
  return r;
}

// The full call's block_idx with the rows of this call's queries taken from `bi_rows` and every
// other row empty (all -1): those rows then attend to nothing and add nothing to the KL.
HostTensor only_held_rows(const Apart& a, const HostTensor& bi_rows) {
  const Config& c = a.p.cfg;
  HostTensor bi(DType::kInt32, {a.p.T, c.Hi, bi_rows.shape()[2]});
  bi.fill(-1);
  const int64_t row = c.Hi * bi_rows.shape()[2];
  int64_t r = 0;
  for (size_t s = 0; s + 1 < a.p.offsets.size(); ++s)
    for (int64_t g = a.p.offsets[s + 1] - a.n[s]; g < a.p.offsets[s + 1]; ++g, ++r)
      for (int64_t x = 0; x < row; ++x) bi.set(g * row + x, bi_rows.get(r * row + x));
  return bi;
}

class KeysApart : public ::testing::TestWithParam<int> {};

// Selection (input and FP8 scores) and lse_idx: the rows of the whole call's.
TEST_P(KeysApart, SelectionEqualsTheWholeCallsRows) {
  for (msa::SelectScores scores : {msa::SelectScores::kInput, msa::SelectScores::kFp8}) {
    Apart a(make_split(40 + GetParam(), GetParam() == 1 ? DType::kBFloat16 : DType::kFloat64));
    msa::Options o = a.p.options();
    o.select_scores = scores;
    HostTensor lse_full, lse_apart;
    HostTensor full = run_select(a.p, &lse_full, &o);
    HostTensor bi = select_apart(a, o, &lse_apart);
    expect_equal(bi, a.rows(full), "block_idx");
    expect_equal(lse_apart, a.rows(lse_full), "lse_idx");
  }
}

// Forward (sparse over the selection, and the dense warmup): out, lse and the KL terms of each
// row are the whole call's; the KL value is their sum over this call's N = Tq rows.
TEST_P(KeysApart, ForwardEqualsTheWholeCallsRows) {
  for (Mode mode : {Mode::kSparse, Mode::kDense}) {
    Apart a(make_split(50 + GetParam(), GetParam() == 1 ? DType::kBFloat16 : DType::kFloat64));
    HostTensor lse_idx;
    HostTensor full_bi = run_select(a.p);
    HostTensor bi = a.rows(full_bi);
    FwdResult full = run_forward(a.p, &full_bi, mode, false);
    HostTensor full_rows = kl_rows_full(a.p, &full_bi, mode, full);
    Fwd f = forward_apart(a, &bi, mode);
    expect_equal(f.out, a.rows(full.out), "out");
    expect_equal(f.lse, a.rows(full.lse), "lse");
    expect_equal(f.kl_rows, a.rows(full_rows), "kl_rows");
    double sum = 0;
    for (int64_t x = 0; x < f.kl_rows.numel(); ++x) sum += f.kl_rows.get(x);
    const double want = sum / (static_cast<double>(a.Tq) * a.p.cfg.Hi);
    EXPECT_NEAR(f.kl.get(0), want, 1e-6 * std::fabs(want) + 1e-12);
    EXPECT_GT(want, 0.0);
  }
}

// Backward, sparse: the whole call with the other rows' supports empty and their dout zero gives
// the same five gradients (dk, dv, dk_idx over all Tk keys, zero where no query reads a key).
// The KL weights are the token counts, so that gamma / (N * Hi) is 1 / Hi in both calls.
TEST_P(KeysApart, SparseBackwardEqualsTheWholeCall) {
  Apart a(make_split(60 + GetParam(), GetParam() == 1 ? DType::kBFloat16 : DType::kFloat64));
  const Config& c = a.p.cfg;
  HostTensor full_bi = run_select(a.p);
  HostTensor bi = a.rows(full_bi);
  HostTensor whole_bi = only_held_rows(a, bi);
  std::mt19937_64 rng(GetParam() + 3);
  HostTensor dout(c.dtype, {a.Tq, c.Hq, c.D});
  dout.randomize(rng);
  HostTensor whole_dout(c.dtype, {a.p.T, c.Hq, c.D});
  whole_dout.fill(0.0);
  {
    const int64_t row = c.Hq * c.D;
    int64_t r = 0;
    for (size_t s = 0; s + 1 < a.p.offsets.size(); ++s)
      for (int64_t g = a.p.offsets[s + 1] - a.n[s]; g < a.p.offsets[s + 1]; ++g, ++r)
        for (int64_t x = 0; x < row; ++x) whole_dout.set(g * row + x, dout.get(r * row + x));
  }
  FwdResult wf = run_forward(a.p, &whole_bi, Mode::kSparse, false);
  BwdResult want = run_backward(a.p, &whole_bi, Mode::kSparse, wf, whole_dout, static_cast<double>(a.p.T));
  Fwd f = forward_apart(a, &bi, Mode::kSparse);
  expect_equal(f.out, a.rows(wf.out), "out");
  BwdResult got = backward_apart(a, &bi, Mode::kSparse, f, dout, static_cast<double>(a.Tq));
  expect_equal(got.dq, a.rows(want.dq), "dq");
  expect_equal(got.dq_idx, a.rows(want.dq_idx), "dq_idx");
  expect_equal(got.dk, want.dk, "dk");
  expect_equal(got.dv, want.dv, "dv");
  expect_equal(got.dk_idx, want.dk_idx, "dk_idx");
  // Not vacuous: the held queries read keys of the prefix, so those keys have gradients.
  double prefix = 0;
  for (int64_t x = 0; x < (a.p.offsets[1] - a.n[0]) * c.Hkv * c.D; ++x) prefix += std::fabs(got.dk.get(x));
  EXPECT_GT(prefix, 0.0);
}

// Backward, dense warmup over keys apart = sparse over every causal block (contract §5), all five
// gradients; the sparse call is tied to the whole call by the test above.
TEST_P(KeysApart, DenseBackwardEqualsSparseOverEveryCausalBlock) {
  Split x = make_split(70 + GetParam(), GetParam() == 1 ? DType::kBFloat16 : DType::kFloat64);
  x.cfg.k = 13;  // the longest sequence's blocks (200 keys of Bk 16)
  Apart a(x);
  const Config& c = a.p.cfg;
  HostTensor bi(DType::kInt32, {a.Tq, c.Hi, c.k});
  for (size_t s = 0; s + 1 < a.cu_q.size(); ++s)
    for (int64_t u = 0; u < a.n[s]; ++u) {
      const int64_t t = (a.p.offsets[s + 1] - a.p.offsets[s]) - a.n[s] + u;
      for (int i = 0; i < c.Hi; ++i)
        for (int j = 0; j < c.k; ++j) bi.set(((a.cu_q[s] + u) * c.Hi + i) * c.k + j, j <= t / c.Bk ? j : -1);
    }
  std::mt19937_64 rng(GetParam() + 9);
  HostTensor dout(c.dtype, {a.Tq, c.Hq, c.D});
  dout.randomize(rng);
  Fwd fd = forward_apart(a, nullptr, Mode::kDense);
  Fwd fs = forward_apart(a, &bi, Mode::kSparse);
  expect_equal(fd.out, fs.out, "out");
  expect_equal(fd.kl_rows, fs.kl_rows, "kl_rows");
  BwdResult gd = backward_apart(a, nullptr, Mode::kDense, fd, dout, 1.5);
  BwdResult gs = backward_apart(a, &bi, Mode::kSparse, fs, dout, 1.5);
  expect_equal(gd.dq, gs.dq, "dq");
  expect_equal(gd.dk, gs.dk, "dk");
  expect_equal(gd.dv, gs.dv, "dv");
  expect_equal(gd.dq_idx, gs.dq_idx, "dq_idx");
  expect_equal(gd.dk_idx, gs.dk_idx, "dk_idx");
}

INSTANTIATE_TEST_SUITE_P(Dtypes, KeysApart, ::testing::Values(0, 1),
                         [](const ::testing::TestParamInfo<int>& i) { return i.param ? "BFloat16" : "Float64"; });

// Bad cu_seqlens_k and key tensors are refused naming the argument, before anything is written.
TEST(KeysApartValidation, NamesTheArgument) {
  Apart a(make_split(80));
  const Config& c = a.p.cfg;
  HostTensor full_bi = run_select(a.p);
  HostTensor bi = a.rows(full_bi);
  HostTensor out(c.dtype, {a.Tq, c.Hq, c.D}), lse(DType::kFloat32, {a.Tq, c.Hq});
  out.fill(NAN);
  auto base = [&]() {
    msa::ForwardParams fp;
    fp.q = a.q.ref();
    fp.k = a.p.k.ref();
    fp.v = a.p.v.ref();
    fp.cu_seqlens = a.cuq.ref();
    fp.cu_seqlens_k = a.cuk.ref();
    fp.block_idx = bi.ref();
    fp.out = out.ref();
    fp.lse = lse.ref();
    fp.opts = a.p.options();
    return fp;
  };
  auto refused = [&](const msa::ForwardParams& fp, const char* arg, const char* why) {
    const msa::Status s = msa::forward(fp);
    EXPECT_EQ(s.code, StatusCode::kInvalidArgument) << why << ": " << s.message;
    EXPECT_NE(s.message.find(std::string("argument '") + arg + "'"), std::string::npos) << why << ": " << s.message;
    for (int64_t x = 0; x < out.numel(); ++x) ASSERT_TRUE(std::isnan(out.get(x))) << why << ": out written";
  };
  {
    std::vector<int64_t> cu = a.p.offsets;
    cu.pop_back();
    HostTensor t = offsets(cu);
    msa::ForwardParams fp = base();
    fp.cu_seqlens_k = t.ref();
    refused(fp, "cu_seqlens_k", "one sequence fewer than cu_seqlens");
  }
  {
    std::vector<int64_t> cu = a.p.offsets;
    cu.back() -= 1;
    HostTensor t = offsets(cu);
    msa::ForwardParams fp = base();
    fp.cu_seqlens_k = t.ref();
    refused(fp, "cu_seqlens_k", "not ending at Tk");
  }
  {
    // Sequence 2 given 50 keys for its 64 queries (the offsets still end at Tk = 551).
    HostTensor t = offsets({0, 150, 150, 200, 311, 351, 551});
    msa::ForwardParams fp = base();
    fp.cu_seqlens_k = t.ref();
    refused(fp, "cu_seqlens_k", "fewer keys than queries");
  }
  {
    HostTensor t = offsets(a.p.offsets);
    t.set(3, t.get(2) - 1);
    msa::ForwardParams fp = base();
    fp.cu_seqlens_k = t.ref();
    refused(fp, "cu_seqlens_k", "decreasing");
  }
  {
    HostTensor v2(c.dtype, {a.p.T - 1, c.Hkv, c.D});
    msa::ForwardParams fp = base();
    fp.v = v2.ref();
    refused(fp, "v", "v's rows not k's");
  }
  {
    // Fewer key rows than queries (seen from the shapes, before any value): Tk = Tq - 1.
    HostTensor k2(c.dtype, {a.Tq - 1, c.Hkv, c.D}), v2(c.dtype, {a.Tq - 1, c.Hkv, c.D});
    HostTensor t = offsets({0, a.Tq - 1, a.Tq - 1, a.Tq - 1, a.Tq - 1, a.Tq - 1, a.Tq - 1});
    msa::ForwardParams fp = base();
    fp.k = k2.ref();
    fp.v = v2.ref();
    fp.cu_seqlens_k = t.ref();
    const msa::Status s = msa::forward(fp);
    EXPECT_NE(s.message.find("fewer than the T = " + std::to_string(a.Tq) + " queries"), std::string::npos) << s.message;
    refused(fp, "cu_seqlens_k", "Tk < T");
  }
  {
    msa::ForwardParams fp = base();
    fp.cu_seqlens = msa::TensorRef{};
    refused(fp, "cu_seqlens_k", "no cu_seqlens, several key sequences");
  }
  {
    // Query 0 of sequence 0 sits at position 150 - 61 = 89, block 5: block 6 is after it.
    HostTensor bad = bi;
    bad.set(0, 6);
    msa::ForwardParams fp = base();
    fp.block_idx = bad.ref();
    refused(fp, "block_idx", "a block after the query's position");
  }
  {
    // The same entry is fine for the whole call's last row of sequence 0 (position 149, block 9):
    // the check is by position, not by row.
    HostTensor ok = bi;
    ok.set((60 * c.Hi) * c.k, 9);
    ok.set((60 * c.Hi) * c.k + 1, -1);
    ok.set((60 * c.Hi) * c.k + 2, -1);
    ok.set((60 * c.Hi) * c.k + 3, -1);
    msa::ForwardParams fp = base();
    fp.block_idx = ok.ref();
    const msa::Status s = msa::forward(fp);
    EXPECT_TRUE(s.ok()) << s.message;
  }
  {
    // The backward's key gradients have Tk rows.
    Fwd f = forward_apart(a, &bi, Mode::kSparse);
    HostTensor dout(c.dtype, {a.Tq, c.Hq, c.D});
    BwdResult r = apart_grads(a, /*dk_rows=*/a.Tq);
    const msa::Status s = call_backward(a, &bi, Mode::kSparse, f, dout, 1.0, r);
    EXPECT_EQ(s.code, StatusCode::kInvalidArgument) << s.message;
    EXPECT_NE(s.message.find("argument 'dk'"), std::string::npos) << s.message;
    EXPECT_NE(s.message.find("[Tk, Hkv, D]"), std::string::npos) << s.message;
  }
  {
    // select_blocks: k_idx rows must end cu_seqlens_k.
    HostTensor k_idx(c.dtype, {a.p.T + 1, c.Hik, c.Di});
    HostTensor b(DType::kInt32, {a.Tq, c.Hi, c.k});
    msa::SelectParams sp;
    sp.q_idx = a.q_idx.ref();
    sp.k_idx = k_idx.ref();
    sp.cu_seqlens = a.cuq.ref();
    sp.cu_seqlens_k = a.cuk.ref();
    sp.block_idx = b.ref();
    sp.opts = a.p.options();
    const msa::Status s = msa::select_blocks(sp);
    EXPECT_EQ(s.code, StatusCode::kInvalidArgument) << s.message;
    EXPECT_NE(s.message.find("argument 'cu_seqlens_k'"), std::string::npos) << s.message;
  }
}

}  // namespace
}  // namespace msatest
