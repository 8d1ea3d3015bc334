// Bad input (spec §7): every entry point rejects it before touching data, with kInvalidArgument
// and a message naming the argument. Each case starts from valid parameters and breaks one thing.
#include <gtest/gtest.h>

#include <functional>

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
