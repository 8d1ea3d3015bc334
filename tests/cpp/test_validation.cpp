// Bad input (docs/contract.md §7): every entry point rejects it before touching data, with kInvalidArgument
// and a message naming the argument. Each case starts from valid parameters and breaks one thing.
#include <gtest/gtest.h>

#include <functional>
#include <limits>
#include <string>
#include <vector>

#include "harness.h"

namespace msatest {
namespace {

// Valid buffers for T = 40 tokens in two sequences (24 + 16), Bk = 8.
struct Valid {
  Config c;
  Problem p;
  HostTensor bi, out, lse, kl, dout, dq, dk, dv, dq_idx, dk_idx, kl_grad, lse_idx, kl_rows;

  Valid() : c(valid_config()), p(c) {
    bi = run_select(p);
    out = HostTensor(c.dtype, {p.T, c.Hq, c.D});
    lse = HostTensor(DType::kFloat32, {p.T, c.Hq});
    kl = HostTensor(DType::kFloat32, {1});
    dout = HostTensor(c.dtype, {p.T, c.Hq, c.D});
    dq = HostTensor(c.dtype, {p.T, c.Hq, c.D});
    dk = HostTensor(c.dtype, {p.T, c.Hkv, c.D});
    dv = HostTensor(c.dtype, {p.T, c.Hkv, c.D});
    dq_idx = HostTensor(c.dtype, {p.T, c.Hi, c.Di});
    dk_idx = HostTensor(c.dtype, {p.T, c.Hik, c.Di});
    kl_grad = HostTensor(DType::kFloat32, {1});
    lse_idx = HostTensor(DType::kFloat32, {p.T, c.Hi});
    kl_rows = HostTensor(DType::kFloat32, {p.T, c.Hi});
    std::mt19937_64 rng(3);
    dout.randomize(rng);
  }
  static Config valid_config() {
    Config c = msatest::make_config({24, 16}, 4, 2, 8, 2, 1, 8, 2, 1);
    c.dtype = DType::kFloat32;
    return c;
  }
  msa::SelectParams select() {
    msa::SelectParams s;
    s.q_idx = p.q_idx.ref();
    s.k_idx = p.k_idx.ref();
    s.cu_seqlens = p.cu.ref();
    s.block_idx = bi.ref();
    s.lse_idx = lse_idx.ref();
    s.opts = p.options();
    return s;
  }
  msa::ForwardParams forward() {
    msa::ForwardParams f;
    f.q = p.q.ref();
    f.k = p.k.ref();
    f.v = p.v.ref();
    f.cu_seqlens = p.cu.ref();
    f.block_idx = bi.ref();
    f.q_idx = p.q_idx.ref();
    f.k_idx = p.k_idx.ref();
    f.out = out.ref();
    f.lse = lse.ref();
    f.kl = kl.ref();
    f.opts = p.options();
    return f;
  }
  msa::BackwardParams backward() {
    msa::BackwardParams b;
    b.q = p.q.ref();
    b.k = p.k.ref();
    b.v = p.v.ref();
    b.out = out.ref();
    b.lse = lse.ref();
    b.dout = dout.ref();
    b.cu_seqlens = p.cu.ref();
    b.block_idx = bi.ref();
    b.dq = dq.ref();
    b.dk = dk.ref();
    b.dv = dv.ref();
    b.q_idx = p.q_idx.ref();
    b.k_idx = p.k_idx.ref();
    b.dq_idx = dq_idx.ref();
    b.dk_idx = dk_idx.ref();
    b.kl_grad = kl_grad.ref();
    b.opts = p.options();
    return b;
  }
  msa::KlParams klp() {
    msa::KlParams k;
    k.q = p.q.ref();
    k.k = p.k.ref();
    k.lse = lse.ref();
    k.q_idx = p.q_idx.ref();
    k.k_idx = p.k_idx.ref();
    k.cu_seqlens = p.cu.ref();
    k.block_idx = bi.ref();
    k.kl = kl.ref();
    k.kl_rows = kl_rows.ref();
    k.opts = p.options();
    return k;
  }
};

void expect_invalid(const msa::Status& s, const std::string& arg, const std::string& what) {
  EXPECT_EQ(s.code, msa::StatusCode::kInvalidArgument) << what << ": " << s.message;
  EXPECT_NE(s.message.find("argument '" + arg + "'"), std::string::npos)
      << what << ": message does not name '" << arg << "': " << s.message;
}

msa::TensorRef reshaped(msa::TensorRef t, int dim, int64_t size) {
  t.shape[dim] = size;
  return t;
}
msa::TensorRef retyped(msa::TensorRef t, DType dt) {
  t.dtype = dt;
  return t;
}

// Every case: a name, the argument the message must name, and a mutation of valid params.
template <class P>
struct Case {
  const char* what;
  const char* arg;
  std::function<void(P&, Valid&)> mutate;
};

TEST(Validation, ValidParamsPass) {
  Valid v;
  expect_ok(msa::select_blocks(v.select()));
  expect_ok(msa::forward(v.forward()));
  expect_ok(msa::backward(v.backward()));
  expect_ok(msa::kl_divergence(v.klp()));
}

TEST(Validation, Forward) {
  using P = msa::ForwardParams;
  const std::vector<Case<P>> cases = {
      {"q missing", "q", [](P& p, Valid&) { p.q = {}; }},
      {"q rank", "q", [](P& p, Valid&) { p.q.rank = 2; }},
      {"q dtype int", "q", [](P& p, Valid&) { p.q = retyped(p.q, DType::kInt32); }},
      {"q last dim strided", "q", [](P& p, Valid&) { p.q.stride[2] = 2; }},
      {"q negative stride", "q", [](P& p, Valid&) { p.q.stride[0] = -1; }},
      {"q null data", "q", [](P& p, Valid&) { p.q.data = nullptr; }},
      {"k dtype", "k", [](P& p, Valid&) { p.k = retyped(p.k, DType::kFloat16); }},
      {"k tokens", "k", [](P& p, Valid&) { p.k = reshaped(p.k, 0, 39); }},
      {"k head dim", "k", [](P& p, Valid&) { p.k = reshaped(p.k, 2, 4); }},
      {"Hkv does not divide Hq", "k", [](P& p, Valid&) { p.k = reshaped(p.k, 1, 3); }},
      {"v shape", "v", [](P& p, Valid&) { p.v = reshaped(p.v, 1, 1); }},
      {"v missing", "v", [](P& p, Valid&) { p.v = {}; }},
      {"block_idx missing", "block_idx", [](P& p, Valid&) { p.block_idx = {}; }},
      {"block_idx dtype", "block_idx", [](P& p, Valid&) { p.block_idx = retyped(p.block_idx, DType::kFloat32); }},
      {"block_idx tokens", "block_idx", [](P& p, Valid&) { p.block_idx = reshaped(p.block_idx, 0, 20); }},
      {"block_idx k past 2^20", "block_idx", [](P& p, Valid&) { p.block_idx = reshaped(p.block_idx, 2, (1 << 20) + 1); }},
      {"block_idx Hi vs q_idx", "q_idx", [](P& p, Valid&) { p.block_idx = reshaped(p.block_idx, 1, 1); }},
      {"block_idx future block", "block_idx", [](P& p, Valid& v) { v.bi.set(0, 2); }},
      {"block_idx below -1", "block_idx", [](P& p, Valid& v) { v.bi.set(5, -2); }},
      {"block_idx duplicate", "block_idx", [](P& p, Valid& v) { v.bi.set(30 * 4, 0); v.bi.set(30 * 4 + 1, 0); }},
      {"q_idx dtype", "q_idx", [](P& p, Valid&) { p.q_idx = retyped(p.q_idx, DType::kBFloat16); }},
      {"q_idx missing with kl", "q_idx", [](P& p, Valid&) { p.q_idx = {}; }},
      {"k_idx head dim", "k_idx", [](P& p, Valid&) { p.k_idx = reshaped(p.k_idx, 2, 4); }},
      {"Hik does not divide Hi", "k_idx", [](P& p, Valid&) { p.k_idx = reshaped(p.k_idx, 1, 3); }},
      {"Hi not a multiple of Hkv", "q_idx",
       [](P& p, Valid&) { p.q_idx = reshaped(p.q_idx, 1, 1); p.block_idx = reshaped(p.block_idx, 1, 1); p.k_idx = reshaped(p.k_idx, 1, 1); }},
      {"out dtype", "out", [](P& p, Valid&) { p.out = retyped(p.out, DType::kFloat64); }},
      {"out shape", "out", [](P& p, Valid&) { p.out = reshaped(p.out, 1, 2); }},
      {"out overlapping", "out", [](P& p, Valid&) { p.out.stride[0] = 0; }},
      {"lse dtype", "lse", [](P& p, Valid&) { p.lse = retyped(p.lse, DType::kFloat16); }},
      {"lse shape", "lse", [](P& p, Valid&) { p.lse = reshaped(p.lse, 1, 2); }},
      {"kl shape", "kl", [](P& p, Valid&) { p.kl = reshaped(p.kl, 0, 2); }},
      {"cu_seqlens dtype", "cu_seqlens", [](P& p, Valid&) { p.cu_seqlens = retyped(p.cu_seqlens, DType::kFloat32); }},
      {"cu_seqlens rank", "cu_seqlens", [](P& p, Valid&) { p.cu_seqlens.rank = 2; }},
      {"cu_seqlens too short", "cu_seqlens", [](P& p, Valid&) { p.cu_seqlens = reshaped(p.cu_seqlens, 0, 1); }},
      {"cu_seqlens first", "cu_seqlens", [](P& p, Valid& v) { v.p.cu.set(0, 1); }},
      {"cu_seqlens decreasing", "cu_seqlens", [](P& p, Valid& v) { v.p.cu.set(1, 41); }},
      {"cu_seqlens last", "cu_seqlens", [](P& p, Valid& v) { v.p.cu.set(2, 39); }},
      {"device mismatch", "k", [](P& p, Valid&) { p.k.device.type = msa::DeviceType::kCuda; }},
      {"block_size", "block_size", [](P& p, Valid&) { p.opts.block_size = 0; }},
      {"scale", "scale", [](P& p, Valid&) { p.opts.scale = INFINITY; }},
      {"scale_idx", "scale_idx", [](P& p, Valid&) { p.opts.scale_idx = NAN; }},
      {"mode", "mode", [](P& p, Valid&) { p.opts.mode = static_cast<msa::Mode>(7); }},
      {"select: top_k vs block_idx", "block_idx", [](P& p, Valid&) { p.select = true; p.opts.top_k = 3; }},
      {"select: top_k 0", "top_k", [](P& p, Valid&) { p.select = true; p.opts.top_k = 0; }},
      {"select: local 0", "local_blocks", [](P& p, Valid&) { p.select = true; p.opts.local_blocks = 0; }},
      {"select: sink negative", "sink_blocks", [](P& p, Valid&) { p.select = true; p.opts.sink_blocks = -1; }},
      {"select: forced > k", "top_k", [](P& p, Valid&) { p.select = true; p.opts.sink_blocks = 2; }},
      {"select: block_idx overlapping", "block_idx", [](P& p, Valid&) { p.select = true; p.block_idx.stride[0] = 1; }},
  };
  for (const auto& cs : cases) {
    Valid v;
    P params = v.forward();
    cs.mutate(params, v);
    expect_invalid(msa::forward(params), cs.arg, cs.what);
  }
}

TEST(Validation, Backward) {
  using P = msa::BackwardParams;
  const std::vector<Case<P>> cases = {
      {"dout shape", "dout", [](P& p, Valid&) { p.dout = reshaped(p.dout, 2, 4); }},
      {"dout dtype", "dout", [](P& p, Valid&) { p.dout = retyped(p.dout, DType::kFloat16); }},
      {"out missing", "out", [](P& p, Valid&) { p.out = {}; }},
      {"lse dtype", "lse", [](P& p, Valid&) { p.lse = retyped(p.lse, DType::kFloat64); }},
      {"dq missing", "dq", [](P& p, Valid&) { p.dq = {}; }},
      {"dk shape", "dk", [](P& p, Valid&) { p.dk = reshaped(p.dk, 1, 4); }},
      {"dv overlapping", "dv", [](P& p, Valid&) { p.dv.stride[1] = 1; }},
      {"dq_idx shape", "dq_idx", [](P& p, Valid&) { p.dq_idx = reshaped(p.dq_idx, 1, 1); }},
      {"dk_idx dtype", "dk_idx", [](P& p, Valid&) { p.dk_idx = retyped(p.dk_idx, DType::kBFloat16); }},
      {"q_idx missing with dq_idx", "q_idx", [](P& p, Valid&) { p.q_idx = {}; }},
      {"k_idx missing with dk_idx", "k_idx", [](P& p, Valid&) { p.k_idx = {}; }},
      {"kl_grad shape", "kl_grad", [](P& p, Valid&) { p.kl_grad = reshaped(p.kl_grad, 0, 2); }},
      {"kl_grad dtype", "kl_grad", [](P& p, Valid&) { p.kl_grad = retyped(p.kl_grad, DType::kFloat64); }},
      {"kl_weight", "kl_weight", [](P& p, Valid&) { p.kl_weight = NAN; }},
      {"block_idx out of range", "block_idx", [](P& p, Valid& v) { v.bi.set(7, 100); }},
      {"q float64 on cuda", "q", [](P& p, Valid&) { p.q = retyped(p.q, DType::kFloat64); p.q.device.type = msa::DeviceType::kCuda; }},
  };
  for (const auto& cs : cases) {
    Valid v;
    P params = v.backward();
    cs.mutate(params, v);
    expect_invalid(msa::backward(params), cs.arg, cs.what);
  }
}

TEST(Validation, Select) {
  using P = msa::SelectParams;
  const std::vector<Case<P>> cases = {
      {"q_idx missing", "q_idx", [](P& p, Valid&) { p.q_idx = {}; }},
      {"k_idx tokens", "k_idx", [](P& p, Valid&) { p.k_idx = reshaped(p.k_idx, 0, 41); }},
      {"block_idx k vs top_k", "block_idx", [](P& p, Valid&) { p.opts.top_k = 5; }},
      {"block_idx dtype", "block_idx", [](P& p, Valid&) { p.block_idx = retyped(p.block_idx, DType::kFloat32); }},
      {"lse_idx shape", "lse_idx", [](P& p, Valid&) { p.lse_idx = reshaped(p.lse_idx, 1, 5); }},
      {"dense mode", "mode", [](P& p, Valid&) { p.opts.mode = Mode::kDense; }},
      {"top_k", "top_k", [](P& p, Valid&) { p.opts.top_k = -3; }},
      {"cu_seqlens", "cu_seqlens", [](P& p, Valid& v) { v.p.cu.set(2, 400); }},
  };
  for (const auto& cs : cases) {
    Valid v;
    P params = v.select();
    cs.mutate(params, v);
    expect_invalid(msa::select_blocks(params), cs.arg, cs.what);
  }
}

TEST(Validation, Kl) {
  using P = msa::KlParams;
  const std::vector<Case<P>> cases = {
      {"kl missing", "kl", [](P& p, Valid&) { p.kl = {}; }},
      {"kl_rows shape", "kl_rows", [](P& p, Valid&) { p.kl_rows = reshaped(p.kl_rows, 1, 3); }},
      {"lse missing", "lse", [](P& p, Valid&) { p.lse = {}; }},
      {"q_idx missing", "q_idx", [](P& p, Valid&) { p.q_idx = {}; }},
      {"k shape", "k", [](P& p, Valid&) { p.k = reshaped(p.k, 2, 3); }},
  };
  for (const auto& cs : cases) {
    Valid v;
    P params = v.klp();
    cs.mutate(params, v);
    expect_invalid(msa::kl_divergence(params), cs.arg, cs.what);
  }
}

// Malformed ranks are refused by name before anything reads the shape array (rank 2^28 used to
// crash in the message), for required and optional arguments alike.
TEST(Validation, RankOutOfRange) {
  for (int32_t rank : {-1, msa::kMaxRank + 1, 1 << 28, std::numeric_limits<int32_t>::min()}) {
    const std::string what = "rank " + std::to_string(rank);
    {
      Valid v;
      msa::ForwardParams f = v.forward();
      f.q.rank = rank;
      expect_invalid(msa::forward(f), "q", what);
    }
    {
      Valid v;
      msa::ForwardParams f = v.forward();
      f.kl.rank = rank;  // optional
      expect_invalid(msa::forward(f), "kl", what);
    }
    {
      Valid v;
      msa::ForwardParams f = v.forward();
      f.opts.mode = Mode::kDense;  // block_idx unused, but malformed all the same
      f.block_idx.rank = rank;
      expect_invalid(msa::forward(f), "block_idx", what);
    }
    {
      Valid v;
      msa::BackwardParams b = v.backward();
      b.dk_idx.rank = rank;
      expect_invalid(msa::backward(b), "dk_idx", what);
    }
    {
      Valid v;
      msa::SelectParams s = v.select();
      s.lse_idx.rank = rank;
      expect_invalid(msa::select_blocks(s), "lse_idx", what);
    }
    {
      Valid v;
      msa::KlParams k = v.klp();
      k.cu_seqlens.rank = rank;
      expect_invalid(msa::kl_divergence(k), "cu_seqlens", what);
    }
    msa::TensorRef t;
    t.rank = rank;
    EXPECT_EQ(t.numel(), 0);
    EXPECT_FALSE(t.is_contiguous());
  }
}

// make_tensor with more sizes than kMaxRank writes nothing past its arrays and gives a rank that
// validation refuses by name.
TEST(Validation, MakeTensorTooManySizes) {
  struct Guarded {
    msa::TensorRef t;
    int64_t guard[8];
  } g;
  for (int64_t& x : g.guard) x = 0x5a5a5a5a;
  float data[64];
  g.t = msa::make_tensor(data, DType::kFloat32, {2, 2, 2, 2, 2, 2});
  for (int64_t x : g.guard) EXPECT_EQ(x, 0x5a5a5a5a);
  EXPECT_EQ(g.t.rank, msa::kMaxRank + 1);
  Valid v;
  msa::ForwardParams f = v.forward();
  f.q = g.t;
  expect_invalid(msa::forward(f), "q", "six sizes");
  const msa::TensorRef empty = msa::make_tensor(data, DType::kFloat32, {});
  EXPECT_FALSE(empty.defined());
}

// Sizes and strides whose byte extent does not fit in 62 bits are refused by name.
TEST(Validation, HugeExtent) {
  Valid v;
  msa::ForwardParams f = v.forward();
  f.v.stride[0] = int64_t{1} << 61;
  expect_invalid(msa::forward(f), "v", "huge token stride");
  f = v.forward();
  f.out.shape[0] = int64_t{1} << 62;
  f.out.stride[0] = 1;
  expect_invalid(msa::forward(f), "out", "huge token count");
}

// Options are checked for their ranges even where this call does not use them.
TEST(Validation, OptionRangesAlwaysChecked) {
  Valid v;
  msa::ForwardParams f = v.forward();  // a caller's block_idx: the selection options are unused
  f.opts.top_k = -3;
  expect_invalid(msa::forward(f), "top_k", "top_k -3 with a caller's block_idx");
  f = v.forward();
  f.opts.local_blocks = 0;
  expect_invalid(msa::forward(f), "local_blocks", "local_blocks 0 with a caller's block_idx");
  f = v.forward();
  f.opts.sink_blocks = -1;
  expect_invalid(msa::forward(f), "sink_blocks", "sink_blocks -1 with a caller's block_idx");
  f = v.forward();
  f.opts.mode = Mode::kDense;
  f.opts.top_k = 0;
  expect_invalid(msa::forward(f), "top_k", "top_k 0 in dense mode");
  msa::BackwardParams b = v.backward();
  b.opts.top_k = (1 << 20) + 1;
  expect_invalid(msa::backward(b), "top_k", "top_k 2^20 + 1 in backward");
  b = v.backward();
  b.opts.kl_pass = static_cast<msa::KlPass>(4);
  expect_invalid(msa::backward(b), "kl_pass", "kl_pass 4");
  b = v.backward();
  b.opts.kl_teacher_bytes = -1;
  expect_invalid(msa::backward(b), "kl_teacher_bytes", "kl_teacher_bytes -1");
  b = v.backward();
  b.opts.kl_dq_rows_bytes = -1;
  expect_invalid(msa::backward(b), "kl_dq_rows_bytes", "kl_dq_rows_bytes -1");
  b = v.backward();
  b.opts.dq_pass = static_cast<msa::DqPass>(3);
  expect_invalid(msa::backward(b), "dq_pass", "dq_pass 3");
  b = v.backward();
  b.opts.bwd_chunk_tokens = -1;
  expect_invalid(msa::backward(b), "bwd_chunk_tokens", "bwd_chunk_tokens -1");
  f = v.forward();
  f.opts.fwd_pass = static_cast<msa::FwdPass>(4);
  expect_invalid(msa::forward(f), "fwd_pass", "fwd_pass 4");
  f = v.forward();
  f.opts.fwd_chunk_tokens = -1;
  expect_invalid(msa::forward(f), "fwd_chunk_tokens", "fwd_chunk_tokens -1");
  f = v.forward();
  f.opts.select_scores = static_cast<msa::SelectScores>(2);
  expect_invalid(msa::forward(f), "select_scores", "select_scores 2");
  for (int32_t m : {-1, 65}) {
    f = v.forward();
    f.opts.fp8_rerank = m;
    expect_invalid(msa::forward(f), "fp8_rerank", "fp8_rerank " + std::to_string(m));
  }
  for (int32_t a : {-1, (1 << 20) + 1}) {
    f = v.forward();
    f.opts.fp8_rerank_slots = a;
    expect_invalid(msa::forward(f), "fp8_rerank_slots", "fp8_rerank_slots " + std::to_string(a));
  }
  msa::KlParams k = v.klp();
  k.opts.top_k = 0;
  expect_invalid(msa::kl_divergence(k), "top_k", "top_k 0 in kl_divergence");
  // Selecting with a top_k above the limit names top_k, not block_idx.
  f = v.forward();
  f.select = true;
  f.opts.top_k = 1 << 21;
  expect_invalid(msa::forward(f), "top_k", "top_k 2^21 with select");
  msa::SelectParams s = v.select();
  s.opts.top_k = 1 << 21;
  expect_invalid(msa::select_blocks(s), "top_k", "top_k 2^21 in select_blocks");
  // The largest top_k passes the option check (then block_idx's k must match it).
  f.opts.top_k = 1 << 20;
  expect_invalid(msa::forward(f), "block_idx", "top_k 2^20 with select");
}

// block_size: a power of two, one rule for every backend, checked before the backend is chosen.
TEST(Validation, BlockSizePowerOfTwo) {
  for (int32_t bs : {3, 24, 48, 96, 100, -8, 0, std::numeric_limits<int32_t>::max()}) {
    Valid v;
    msa::ForwardParams f = v.forward();
    f.opts.block_size = bs;
    expect_invalid(msa::forward(f), "block_size", "block_size " + std::to_string(bs));
    msa::BackwardParams b = v.backward();
    b.opts.block_size = bs;
    expect_invalid(msa::backward(b), "block_size", "backward block_size " + std::to_string(bs));
    msa::SelectParams s = v.select();
    s.opts.block_size = bs;
    expect_invalid(msa::select_blocks(s), "block_size", "select block_size " + std::to_string(bs));
    // CUDA tensors: the same rule at validation, whether or not a CUDA backend is built.
    for (msa::TensorRef* t : {&f.q, &f.k, &f.v, &f.cu_seqlens, &f.block_idx, &f.q_idx, &f.k_idx, &f.out, &f.lse, &f.kl})
      t->device.type = msa::DeviceType::kCuda;
    expect_invalid(msa::forward(f), "block_size", "CUDA block_size " + std::to_string(bs));
  }
  Valid v;
  msa::ForwardParams f = v.forward();
  for (int32_t bs : {1, 2, 4, 16, 1 << 30}) {
    f.opts.block_size = bs;
    f.select = true;  // a selection for this block size, then its forward
    expect_ok(msa::forward(f));
  }
}

// ---- Aliasing: an output must not share memory with an input or another output -------------

// A [n0, n1, n2] view of `buf` from element `offset` with strides `st` (in elements), shifted
// by `byte_shift` bytes.
msa::TensorRef view(HostTensor& buf, int64_t offset, std::vector<int64_t> shape, std::vector<int64_t> st,
                    int64_t byte_shift = 0) {
  msa::TensorRef t = buf.ref();
  t.data = static_cast<char*>(t.data) + offset * static_cast<int64_t>(msa::dtype_size(buf.dtype())) + byte_shift;
  t.rank = static_cast<int32_t>(shape.size());
  for (size_t d = 0; d < shape.size(); ++d) {
    t.shape[d] = shape[d];
    t.stride[d] = st[d];
  }
  return t;
}

// Copies the values of a contiguous [T, H, n] tensor into a strided view.
void copy_into(const msa::TensorRef& dst, const HostTensor& src) {
  const auto& sh = src.shape();
  const size_t es = msa::dtype_size(dst.dtype);
  for (int64_t a = 0; a < sh[0]; ++a)
    for (int64_t b = 0; b < sh[1]; ++b)
      for (int64_t c = 0; c < sh[2]; ++c)
        double_to_bits(dst.dtype, src.at(a, b, c),
                       static_cast<char*>(dst.data) + (a * dst.stride[0] + b * dst.stride[1] + c * dst.stride[2]) * es);
}

std::vector<double> values_of(const msa::TensorRef& t) {
  std::vector<double> v;
  const size_t es = msa::dtype_size(t.dtype);
  for (int64_t a = 0; a < t.shape[0]; ++a)
    for (int64_t b = 0; b < t.shape[1]; ++b)
      for (int64_t c = 0; c < t.shape[2]; ++c)
        v.push_back(bits_to_double(t.dtype, static_cast<const char*>(t.data) +
                                                (a * t.stride[0] + b * t.stride[1] + c * t.stride[2]) * es));
  return v;
}

TEST(Aliasing, ForwardOutputsOverInputsAreRefused) {
  using P = msa::ForwardParams;
  // One buffer [T, Hq + Hkv, D] = [40, 6, 8] for the cases that slice it by heads.
  const std::vector<Case<P>> cases = {
      {"out over v (other layout)", "out", [](P& p, Valid&) { p.out.data = p.v.data; }},
      {"out over q (same layout)", "out", [](P& p, Valid&) { p.out.data = p.q.data; }},
      {"lse inside out", "lse", [](P& p, Valid&) { p.lse.data = p.out.data; }},
      {"kl over lse", "kl", [](P& p, Valid&) { p.kl.data = static_cast<float*>(p.lse.data) + 5; }},
      {"kl inside k", "kl", [](P& p, Valid&) { p.kl.data = static_cast<float*>(p.k.data) + 17; }},
      {"kl over cu_seqlens", "kl", [](P& p, Valid&) { p.kl.data = p.cu_seqlens.data; }},
      {"out over q_idx used by the KL", "out", [](P& p, Valid&) { p.out.data = p.q_idx.data; }},
      {"select: block_idx over q_idx", "block_idx", [](P& p, Valid&) { p.select = true; p.block_idx.data = p.q_idx.data; }},
      {"select: block_idx over cu_seqlens", "block_idx",
       [](P& p, Valid&) { p.select = true; p.block_idx.data = static_cast<int32_t*>(p.cu_seqlens.data) + 1; }},
      {"select: out over block_idx", "out", [](P& p, Valid&) { p.select = true; p.out.data = p.block_idx.data; }},
  };
  for (const auto& cs : cases) {
    Valid v;
    P params = v.forward();
    cs.mutate(params, v);
    expect_invalid(msa::forward(params), cs.arg, cs.what);
  }
  // Slices of one buffer: out = heads [0, 4); v = heads [3, 5) shares head 3.
  Valid v;
  const int64_t T = v.p.T, Hq = v.c.Hq, Hkv = v.c.Hkv, D = v.c.D, W = Hq + Hkv;
  HostTensor buf(v.c.dtype, {T, W, D});
  P f = v.forward();
  f.out = view(buf, 0, {T, Hq, D}, {W * D, D, 1});
  f.v = view(buf, (Hq - 1) * D, {T, Hkv, D}, {W * D, D, 1});
  expect_invalid(msa::forward(f), "out", "out and v share a head of one buffer");
  // v = heads [4, 6) and out = heads [0, 4) moved by 2 bytes: out's last element reaches into v.
  f.v = view(buf, Hq * D, {T, Hkv, D}, {W * D, D, 1});
  f.out = view(buf, 0, {T, Hq, D}, {W * D, D, 1}, 2);
  expect_invalid(msa::forward(f), "out", "out two bytes into v");
  // For T - 1 tokens: out from head 4 of each token, so that its rows wrap into heads 0 and 1
  // of the next token (the rows of one token still fit in the token stride). v = heads [2, 4)
  // is beside them; v = heads [0, 2) is what the next token's rows cover.
  f = v.forward();
  const int64_t T1 = T - 1;
  f.q.shape[0] = f.k.shape[0] = f.lse.shape[0] = f.q_idx.shape[0] = f.k_idx.shape[0] = T1;
  f.block_idx.shape[0] = T1;
  f.cu_seqlens = {};  // one sequence: the selection of the two stays causal
  f.out = view(buf, 4 * D, {T1, Hq, D}, {W * D, D, 1});
  f.v = view(buf, 2 * D, {T1, Hkv, D}, {W * D, D, 1});
  expect_ok(msa::forward(f));
  f.v = view(buf, 0, {T1, Hkv, D}, {W * D, D, 1});
  expect_invalid(msa::forward(f), "out", "out's rows wrapping onto v's heads of the next token");
}

TEST(Aliasing, ForwardSharedBuffersThatDoNotAlias) {
  Valid v;
  const int64_t T = v.p.T, Hq = v.c.Hq, Hkv = v.c.Hkv, D = v.c.D;
  msa::ForwardParams f = v.forward();
  expect_ok(msa::forward(f));
  const std::vector<double> want = v.out.values(), want_lse = v.lse.values();
  const double want_kl = v.kl.get(0);

  // q, k, v as head slices of one fused qkv [T, Hq + 2 Hkv, D]; inputs may overlap each other
  // (k and v the very same view in the second run).
  const int64_t W = Hq + 2 * Hkv;
  HostTensor qkv(v.c.dtype, {T, W, D});
  f.q = view(qkv, 0, {T, Hq, D}, {W * D, D, 1});
  f.k = view(qkv, Hq * D, {T, Hkv, D}, {W * D, D, 1});
  f.v = view(qkv, (Hq + Hkv) * D, {T, Hkv, D}, {W * D, D, 1});
  copy_into(f.q, v.p.q);
  copy_into(f.k, v.p.k);
  copy_into(f.v, v.p.v);
  v.out.fill(NAN);
  expect_ok(msa::forward(f));
  EXPECT_EQ(v.out.values(), want);
  EXPECT_EQ(v.lse.values(), want_lse);
  EXPECT_EQ(v.kl.get(0), want_kl);
  msa::ForwardParams same_kv = f;
  same_kv.v = same_kv.k;
  expect_ok(msa::forward(same_kv));

  // The outputs in the same buffer as the inputs, beside them: [T, Hq + Hkv + Hq, D] holding
  // v's heads, then k's, then out's; lse and kl in one fp32 buffer [T, Hq + 1].
  const int64_t W2 = Hkv + Hkv + Hq;
  HostTensor all(v.c.dtype, {T, W2, D});
  f = v.forward();
  f.v = view(all, 0, {T, Hkv, D}, {W2 * D, D, 1});
  f.k = view(all, Hkv * D, {T, Hkv, D}, {W2 * D, D, 1});
  f.out = view(all, 2 * Hkv * D, {T, Hq, D}, {W2 * D, D, 1});
  copy_into(f.v, v.p.v);
  copy_into(f.k, v.p.k);
  HostTensor stats(DType::kFloat32, {T, Hq + 1});
  f.lse = view(stats, 0, {T, Hq}, {Hq + 1, 1});
  f.kl = view(stats, Hq, {1}, {1});  // row 0's spare slot
  expect_ok(msa::forward(f));
  EXPECT_EQ(values_of(f.out), want);
  f.kl = view(stats, 2 * (Hq + 1) - 1, {1}, {1});  // row 1's spare slot
  expect_ok(msa::forward(f));
  f.kl = view(stats, 2 * (Hq + 1) - 2, {1}, {1});  // row 1's last lse: refused
  expect_invalid(msa::forward(f), "kl", "kl over lse[1, Hq - 1]");

  // Head-major storage: out = [Hq, T, D] and v = [Hkv, T, D] back to back, seen as [T, H, D].
  HostTensor hm(v.c.dtype, {Hq + Hkv, T, D});
  f = v.forward();
  f.out = view(hm, 0, {T, Hq, D}, {D, T * D, 1});
  f.v = view(hm, Hq * T * D, {T, Hkv, D}, {D, T * D, 1});
  copy_into(f.v, v.p.v);
  expect_ok(msa::forward(f));
  EXPECT_EQ(values_of(f.out), want);
}

TEST(Aliasing, BackwardFusedGradients) {
  Valid v;
  const int64_t T = v.p.T, Hq = v.c.Hq, Hkv = v.c.Hkv, D = v.c.D;
  expect_ok(msa::forward(v.forward()));
  msa::BackwardParams b = v.backward();
  expect_ok(msa::backward(b));
  const std::vector<double> dq = v.dq.values(), dk = v.dk.values(), dv = v.dv.values();

  // dq, dk, dv as head slices of one dqkv [T, Hq + 2 Hkv, D], as frameworks allocate them.
  const int64_t W = Hq + 2 * Hkv;
  HostTensor dqkv(v.c.dtype, {T, W, D});
  dqkv.fill(NAN);
  b.dq = view(dqkv, 0, {T, Hq, D}, {W * D, D, 1});
  b.dk = view(dqkv, Hq * D, {T, Hkv, D}, {W * D, D, 1});
  b.dv = view(dqkv, (Hq + Hkv) * D, {T, Hkv, D}, {W * D, D, 1});
  expect_ok(msa::backward(b));
  EXPECT_EQ(values_of(b.dq), dq);
  EXPECT_EQ(values_of(b.dk), dk);
  EXPECT_EQ(values_of(b.dv), dv);

  // dk and dv interleaved along the head dim of one [T, Hkv, 2 D] buffer.
  HostTensor kv(v.c.dtype, {T, Hkv, 2 * D});
  msa::BackwardParams b2 = v.backward();
  b2.dk = view(kv, 0, {T, Hkv, D}, {Hkv * 2 * D, 2 * D, 1});
  b2.dv = view(kv, D, {T, Hkv, D}, {Hkv * 2 * D, 2 * D, 1});
  expect_ok(msa::backward(b2));
  EXPECT_EQ(values_of(b2.dk), dk);
  EXPECT_EQ(values_of(b2.dv), dv);

  // Head-major dqkv [Hq + 2 Hkv, T, D]: disjoint address ranges.
  HostTensor hm(v.c.dtype, {W, T, D});
  msa::BackwardParams b3 = v.backward();
  b3.dq = view(hm, 0, {T, Hq, D}, {D, T * D, 1});
  b3.dk = view(hm, Hq * T * D, {T, Hkv, D}, {D, T * D, 1});
  b3.dv = view(hm, (Hq + Hkv) * T * D, {T, Hkv, D}, {D, T * D, 1});
  expect_ok(msa::backward(b3));
  EXPECT_EQ(values_of(b3.dq), dq);

  // Refused: dk over dq's last head, dv equal to dk, dk and dv overlapping in the interleaved
  // layout, and the head-major dk starting one token early.
  msa::BackwardParams bad = b;
  bad.dk = view(dqkv, (Hq - 1) * D, {T, Hkv, D}, {W * D, D, 1});
  expect_invalid(msa::backward(bad), "dk", "dk over dq's last head");
  bad = b;
  bad.dv = bad.dk;
  expect_invalid(msa::backward(bad), "dv", "dv == dk");
  bad = b2;
  bad.dv = view(kv, D - 1, {T, Hkv, D}, {Hkv * 2 * D, 2 * D, 1});
  expect_invalid(msa::backward(bad), "dv", "dv one element into dk");
  bad = b3;
  bad.dk = view(hm, Hq * T * D - D, {T, Hkv, D}, {D, T * D, 1});
  expect_invalid(msa::backward(bad), "dk", "head-major dk over dq's last token");
}

TEST(Aliasing, BackwardOutputsOverInputsAreRefused) {
  using P = msa::BackwardParams;
  const std::vector<Case<P>> cases = {
      {"dq over dout", "dq", [](P& p, Valid&) { p.dq.data = p.dout.data; }},
      {"dq over q", "dq", [](P& p, Valid&) { p.dq.data = p.q.data; }},
      {"dq over out", "dq", [](P& p, Valid&) { p.dq.data = p.out.data; }},
      {"dk over k", "dk", [](P& p, Valid&) { p.dk.data = p.k.data; }},
      {"dv over v", "dv", [](P& p, Valid&) { p.dv.data = p.v.data; }},
      {"dk over lse", "dk", [](P& p, Valid&) { p.dk.data = p.lse.data; }},
      {"dv over block_idx", "dv", [](P& p, Valid&) { p.dv.data = p.block_idx.data; }},
      {"dq_idx over q_idx", "dq_idx", [](P& p, Valid&) { p.dq_idx.data = p.q_idx.data; }},
      {"dk_idx over k_idx", "dk_idx", [](P& p, Valid&) { p.dk_idx.data = p.k_idx.data; }},
      {"dk_idx over dq_idx", "dk_idx", [](P& p, Valid&) { p.dk_idx.data = p.dq_idx.data; }},
      {"dk_idx over kl_grad", "dk_idx", [](P& p, Valid&) { p.kl_grad.data = p.dk_idx.data; }},
      {"dq over cu_seqlens", "dq", [](P& p, Valid&) { p.dq.data = static_cast<int32_t*>(p.cu_seqlens.data) + 1; }},
  };
  for (const auto& cs : cases) {
    Valid v;
    P params = v.backward();
    cs.mutate(params, v);
    expect_invalid(msa::backward(params), cs.arg, cs.what);
  }
}

TEST(Aliasing, SelectAndKlOutputs) {
  {
    Valid v;
    msa::SelectParams s = v.select();
    s.lse_idx.data = s.block_idx.data;
    expect_invalid(msa::select_blocks(s), "lse_idx", "lse_idx over block_idx");
    s = v.select();
    s.block_idx.data = s.k_idx.data;
    expect_invalid(msa::select_blocks(s), "block_idx", "block_idx over k_idx");
    // block_idx and lse_idx side by side in one int32-sized buffer [T, Hi * k + Hi].
    const int64_t T = v.p.T, Hi = v.c.Hi, k = v.c.k, W = Hi * k + Hi;
    HostTensor both(DType::kInt32, {T, W});
    s = v.select();
    s.block_idx = view(both, 0, {T, Hi, k}, {W, k, 1});
    s.lse_idx = view(both, Hi * k, {T, Hi}, {W, 1});
    s.lse_idx.dtype = DType::kFloat32;
    expect_ok(msa::select_blocks(s));
    EXPECT_EQ(values_of(s.block_idx), v.bi.values());
  }
  {
    Valid v;
    expect_ok(msa::forward(v.forward()));
    msa::KlParams k = v.klp();
    k.kl_rows.data = k.lse.data;
    expect_invalid(msa::kl_divergence(k), "kl_rows", "kl_rows over lse");
    k = v.klp();
    k.kl.data = static_cast<float*>(k.kl_rows.data) + 7;
    expect_invalid(msa::kl_divergence(k), "kl_rows", "kl inside kl_rows");
    k = v.klp();
    k.kl.data = k.q.data;
    expect_invalid(msa::kl_divergence(k), "kl", "kl over q");
  }
}

// A rejected call writes nothing.
TEST(Validation, RejectedCallWritesNothing) {
  Valid v;
  v.out.fill(123.0);
  msa::ForwardParams f = v.forward();
  f.v = reshaped(f.v, 2, 3);
  expect_invalid(msa::forward(f), "v", "v shape");
  for (int64_t x = 0; x < v.out.numel(); ++x) ASSERT_EQ(v.out.get(x), 123.0);
}

// Valid inputs for a backend this build lacks: kNotSupported, not a crash.
TEST(Validation, CudaTensorsWithoutCudaBackend) {
  if (msa::backend_available(msa::DeviceType::kCuda)) GTEST_SKIP() << "CUDA backend built";
  Valid v;
  msa::ForwardParams f = v.forward();
  for (msa::TensorRef* t : {&f.q, &f.k, &f.v, &f.cu_seqlens, &f.block_idx, &f.q_idx, &f.k_idx, &f.out, &f.lse, &f.kl})
    t->device.type = msa::DeviceType::kCuda;
  const msa::Status s = msa::forward(f);
  EXPECT_EQ(s.code, msa::StatusCode::kNotSupported) << s.message;
}

// Non-contiguous (but last-dim contiguous) inputs give the same result as contiguous ones.
TEST(Validation, StridedInputs) {
  Valid v;
  msa::ForwardParams f = v.forward();
  expect_ok(msa::forward(f));
  const std::vector<double> want = v.out.values();
  // q stored head-major [Hq, T, D] and viewed as [T, Hq, D].
  HostTensor qh(v.c.dtype, {v.c.Hq, v.p.T, v.c.D});
  for (int64_t t = 0; t < v.p.T; ++t)
    for (int h = 0; h < v.c.Hq; ++h)
      for (int d = 0; d < v.c.D; ++d) qh.set((h * v.p.T + t) * v.c.D + d, v.p.q.at(t, h, d));
  f.q = qh.ref();
  f.q.shape[0] = v.p.T;
  f.q.shape[1] = v.c.Hq;
  f.q.stride[0] = v.c.D;
  f.q.stride[1] = v.p.T * v.c.D;
  v.out.fill(NAN);
  expect_ok(msa::forward(f));
  EXPECT_EQ(v.out.values(), want);
}

}  // namespace
}  // namespace msatest
