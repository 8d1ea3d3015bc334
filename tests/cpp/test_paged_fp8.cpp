// float8 E4M3 caches (docs/contract.md §6) on the CPU backend. A call over an E4M3 cache must
// compute exactly what the same call computes over the dequantised float32 cache
// float32(value * scale[page]); paged_append must store the E4M3 code nearest to
// float32(x) / scale[page] (ties to even, saturated to +-448). The codes' values and the
// nearest-code search come from the harness (the format's definition, independent of the
// library's conversions).
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "harness.h"
#include "paged_cases.h"

namespace msatest {
namespace {

PagedCase fp8_case() {
  PagedCase c;
  c.lens = {300, 129, 1, 64};
  c.nq = {5, 16, 1, 64};
  c.Bk = 64;
  c.k = 3;
  c.sink = 1;
  c.local = 2;
  c.seed = 31;
  return c;
}

// An E4M3 copy of a float32 cache (codes of random values of magnitude up to `amp`, every
// element, the unused rows included) and its dequantised float32 twin under `scale` ([1] or
// [pages]): deq = float32(value(code) * scale[page]).
struct Quantised {
  HostTensor codes, deq, scale;
  Quantised(const HostTensor& like, bool per_page, double amp, uint64_t seed) {
    const std::vector<int64_t> shape = like.shape();
    const int64_t pages = shape[0], per = like.numel() / pages;
    codes = HostTensor(DType::kFloat8E4M3, shape);
    deq = HostTensor(DType::kFloat32, shape);
    scale = HostTensor(DType::kFloat32, {per_page ? pages : 1});
    std::mt19937_64 rng(seed);
    std::uniform_real_distribution<double> u(-amp, amp), s(0.01, 0.2);
    for (int64_t p = 0; p < scale.numel(); ++p) scale.set(p, s(rng));
    for (int64_t x = 0; x < codes.numel(); ++x) {
      codes.set(x, u(rng));
      const float sc = static_cast<float>(scale.get(per_page ? x / per : 0));
      deq.set(x, static_cast<double>(static_cast<float>(codes.get(x)) * sc));
    }
  }
};

// k_idx with one scale for the tensor, and with a scale per page (FP8 scores must quantise each
// page's dequantised keys: a copy of its codes alone would rank the pages by the wrong factor).
TEST(PagedE4M3, CallsEqualTheDequantisedCache) {
  for (const bool idx_per_page : {false, true}) {
    SCOPED_TRACE(idx_per_page ? "k_idx scale per page" : "k_idx scale per tensor");
    const PagedCase cs = fp8_case();
    PagedBatch b(cs);
    Quantised k(b.kc, true, 300.0, 1), v(b.vc, true, 300.0, 2), ki(b.kic, idx_per_page, 400.0, 3);
    // The oracle's batch holds the dequantised caches: the contiguous sequences' rows of them.
    PagedBatch deq(cs);
    deq.kc = k.deq;
    deq.vc = v.deq;
    deq.kic = ki.deq;
    const int64_t row = static_cast<int64_t>(cs.Hkv) * cs.D, irow = static_cast<int64_t>(cs.Hik) * cs.Di;
    for (int64_t s = 0; s < deq.nseq; ++s)
      for (int64_t x = 0; x < cs.lens[s]; ++x) {
        const int64_t g = deq.full.offsets[s] + x, cr = deq.cache_row(s, x);
        for (int64_t e = 0; e < row; ++e) {
          deq.full.k.set(g * row + e, k.deq.get(cr * row + e));
          deq.full.v.set(g * row + e, v.deq.get(cr * row + e));
        }
        for (int64_t e = 0; e < irow; ++e) deq.full.k_idx.set(g * irow + e, ki.deq.get(cr * irow + e));
      }
    PagedRefs r = host_refs(b);
    r.k = k.codes.ref();
    r.v = v.codes.ref();
    r.k_idx = ki.codes.ref();
    auto with_scales = [&](msa::PagedCache c) {
      c.k_scale = k.scale.ref();
      c.v_scale = v.scale.ref();
      c.k_idx_scale = ki.scale.ref();
      return c;
    };
    // Sparse with the inputs' scores and with FP8 scores (the dequantised keys' E4M3 copies, as
    // select_blocks makes them of the contiguous sequences; fp8_rerank 0 and 4), and dense.
    struct Variant {
      Mode mode;
      msa::SelectScores scores;
      int m;
    };
    for (const Variant var : {Variant{Mode::kSparse, msa::SelectScores::kInput, 4},
                              Variant{Mode::kSparse, msa::SelectScores::kFp8, 0},
                              Variant{Mode::kSparse, msa::SelectScores::kFp8, 4},
                              Variant{Mode::kDense, msa::SelectScores::kInput, 4}}) {
      const Mode mode = var.mode;
      PagedCase c = cs;
      c.select_scores = var.scores;
      c.fp8_rerank = var.m;
      SCOPED_TRACE(c.str() + (mode == Mode::kSparse ? " sparse" : " dense"));
      deq.cs = c;
      const PagedOracle o = paged_oracle(deq, mode);
      if (mode == Mode::kSparse) {
        PagedOutputs x(b);
        msa::PagedSelectParams p = paged_select_params(c, r, x.block_idx.ref());
        p.cache = with_scales(p.cache);
        expect_ok(msa::paged_select_blocks(p));
        EXPECT_EQ(first_difference(x.block_idx, o.block_idx), "") << "paged_select_blocks";
      }
      PagedOutputs x(b);
      msa::PagedForwardParams p =
          paged_forward_params(c, r, mode, mode == Mode::kSparse, x.block_idx.ref(), x.out.ref(), x.lse.ref());
      p.cache = with_scales(p.cache);
      expect_ok(msa::paged_forward(p));
      if (mode == Mode::kSparse) EXPECT_EQ(first_difference(x.block_idx, o.block_idx), "") << "block_idx";
      EXPECT_EQ(first_difference(x.out, o.out), "") << "out";
      EXPECT_EQ(first_difference(x.lse, o.lse), "") << "lse";
    }
  }
}

// Every code's value: one cached token per sequence, so each output row is that token's
// dequantised v row (a softmax over one key is exactly 1).
TEST(PagedE4M3, EveryCodeDequantises) {
  PagedCase cs;
  cs.lens = {1, 1, 1, 1};
  cs.nq = {1, 1, 1, 1};
  cs.Hq = 1;
  cs.Hkv = 1;
  cs.Hi = 1;
  cs.Hik = 1;
  cs.D = 64;
  cs.Bk = 64;
  cs.k = 1;
  PagedBatch b(cs);
  HostTensor codes(DType::kFloat8E4M3, b.vc.shape()), scale(DType::kFloat32, {1});
  scale.set(0, 1.0);
  std::vector<uint8_t> raw(static_cast<size_t>(codes.numel()), 0);
  for (int64_t s = 0; s < 4; ++s)
    for (int64_t d = 0; d < 64; ++d) raw[static_cast<size_t>(b.cache_row(s, 0) * 64 + d)] = static_cast<uint8_t>(s * 64 + d);
  std::memcpy(codes.ref().data, raw.data(), raw.size());
  HostTensor kcodes(DType::kFloat8E4M3, b.kc.shape());  // all zero: every score is 0
  PagedRefs r = host_refs(b);
  r.k = kcodes.ref();
  r.v = codes.ref();
  PagedOutputs x(b);
  msa::PagedForwardParams p = paged_forward_params(cs, r, Mode::kDense, false, {}, x.out.ref(), x.lse.ref());
  p.cache.k_scale = scale.ref();
  p.cache.v_scale = scale.ref();
  expect_ok(msa::paged_forward(p));
  for (int c = 0; c < 256; ++c) {
    const double want = e4m3_value(static_cast<uint8_t>(c)), got = x.out.get(c);
    if (std::isnan(want))
      EXPECT_TRUE(std::isnan(got)) << "code " << c;
    else
      EXPECT_EQ(got, want) << "code " << c;
  }
}

// paged_append into E4M3 caches from float32 and bfloat16 rows: the nearest code of
// float32(x) / scale[page], saturated; per-page and per-tensor scales.
TEST(PagedE4M3, AppendQuantises) {
  for (DType in_dtype : {DType::kFloat32, DType::kBFloat16}) {
    SCOPED_TRACE(msa::dtype_name(in_dtype));
    PagedCase cs = fp8_case();
    PagedBatch b(cs);
    std::mt19937_64 rng(9);
    std::uniform_real_distribution<double> u(-60.0, 60.0);
    HostTensor k(in_dtype, {b.Tq, cs.Hkv, cs.D}), v(in_dtype, {b.Tq, cs.Hkv, cs.D}), ki(in_dtype, {b.Tq, cs.Hik, cs.Di});
    for (HostTensor* t : {&k, &v, &ki})
      for (int64_t x = 0; x < t->numel(); ++x) t->set(x, u(rng));
    k.set(0, 1e6);    // saturates to +448
    k.set(1, -1e6);   // and to -448
    v.set(2, NAN);    // NaN stays NaN
    // Ties under k_idx's scale 1/8: halfway between codes goes to the even one.
    ki.set(0, 0.125 * 1.0625);         // 1 and 1.125: 1
    ki.set(1, 0.125 * 1.1875);         // 1.125 and 1.25: 1.25
    ki.set(2, 0.125 * std::ldexp(1.0, -10));  // 0 and 2^-9 (subnormal): 0
    ki.set(3, -0.125 * 3.0 * std::ldexp(1.0, -10));  // -2^-9 and -2^-8: -2^-8
    HostTensor kc(DType::kFloat8E4M3, b.kc.shape()), vc(DType::kFloat8E4M3, b.vc.shape()),
        kic(DType::kFloat8E4M3, b.kic.shape());
    HostTensor ks(DType::kFloat32, {b.pages}), vs(DType::kFloat32, {b.pages}), kis(DType::kFloat32, {1});
    for (int64_t p = 0; p < b.pages; ++p) {
      ks.set(p, 0.05 + 0.01 * p);
      vs.set(p, 0.3 / (1 + p));
    }
    kis.set(0, 0.125);
    PagedRefs r = host_refs(b);
    r.k = kc.ref();
    r.v = vc.ref();
    r.k_idx = kic.ref();
    msa::PagedAppendParams a = paged_append_params(k.ref(), v.ref(), ki.ref(), r, cs.Bk);
    a.cache.k_scale = ks.ref();
    a.cache.v_scale = vs.ref();
    a.cache.k_idx_scale = kis.ref();
    expect_ok(msa::paged_append(a));
    auto check = [&](const HostTensor& in, const HostTensor& cache, const HostTensor& scale, const char* what) {
      const int64_t row = in.numel() / b.Tq;
      int64_t bad = 0;
      for (int64_t g = 0; g < b.Tq; ++g) {
        const int64_t t = g, s = [&] {
          int64_t q = 0;
          while (b.cu_q.get(q + 1) <= t) ++q;
          return q;
        }();
        const int64_t pos = cs.lens[s] - cs.nq[s] + (g - static_cast<int64_t>(b.cu_q.get(s)));
        const int64_t cr = b.cache_row(s, pos), page = cr / cs.Bk;
        const float sc = static_cast<float>(scale.get(scale.numel() == 1 ? 0 : page));
        for (int64_t e = 0; e < row; ++e) {
          const double want = e4m3_value(e4m3_code(static_cast<float>(in.get(g * row + e)) / sc));
          const double got = cache.get(cr * row + e);
          if (!(got == want || (std::isnan(got) && std::isnan(want))) && bad++ < 5)
            ADD_FAILURE() << what << " row " << g << " element " << e << ": got " << got << ", want " << want;
        }
      }
      EXPECT_EQ(bad, 0) << what;
    };
    check(k, kc, ks, "k");
    check(v, vc, vs, "v");
    check(ki, kic, kis, "k_idx");
    const int64_t first = b.cache_row(0, cs.lens[0] - cs.nq[0]);
    EXPECT_EQ(kc.get(first * cs.Hkv * cs.D), 448.0);
    EXPECT_EQ(kc.get(first * cs.Hkv * cs.D + 1), -448.0);
    const int64_t irow = static_cast<int64_t>(cs.Hik) * cs.Di;
    EXPECT_EQ(kic.get(first * irow + 0), 1.0);
    EXPECT_EQ(kic.get(first * irow + 1), 1.25);
    EXPECT_EQ(kic.get(first * irow + 2), 0.0);
    EXPECT_EQ(kic.get(first * irow + 3), -std::ldexp(1.0, -8));
  }
}

void expect_invalid(const msa::Status& s, const std::string& arg, const std::string& what) {
  EXPECT_EQ(s.code, msa::StatusCode::kInvalidArgument) << what << ": " << s.message;
  EXPECT_NE(s.message.find("argument '" + arg + "'"), std::string::npos)
      << what << ": message does not name '" << arg << "': " << s.message;
}

// Scales: required for E4M3 tensors only, float32 [1] or [pages], finite and positive; k and v
// E4M3 together.
TEST(PagedE4M3, BadScalesAndDtypes) {
  const PagedCase cs = fp8_case();
  PagedBatch b(cs);
  Quantised k(b.kc, true, 10.0, 1), v(b.vc, false, 10.0, 2);
  HostTensor wrong(DType::kFloat32, {b.pages + 1}), half_scale(DType::kBFloat16, {1}), bad(DType::kFloat32, {b.pages});
  wrong.fill(1.0);
  half_scale.fill(1.0);
  PagedRefs r = host_refs(b);
  r.k = k.codes.ref();
  r.v = v.codes.ref();
  PagedOutputs x(b);
  auto forward = [&]() {
    msa::PagedForwardParams p = paged_forward_params(cs, r, Mode::kDense, false, {}, x.out.ref(), {});
    p.cache.k_scale = k.scale.ref();
    p.cache.v_scale = v.scale.ref();
    return p;
  };
  expect_ok(msa::paged_forward(forward()));
  {
    auto p = forward();
    p.cache.k_scale = {};
    expect_invalid(msa::paged_forward(p), "cache.k_scale", "missing scale");
  }
  {
    auto p = forward();
    p.cache.v_scale = wrong.ref();
    expect_invalid(msa::paged_forward(p), "cache.v_scale", "scale of pages + 1 entries");
  }
  {
    auto p = forward();
    p.cache.k_scale = half_scale.ref();
    expect_invalid(msa::paged_forward(p), "cache.k_scale", "bfloat16 scale");
  }
  for (double value : {0.0, -1.0, static_cast<double>(NAN), static_cast<double>(INFINITY)}) {
    bad.fill(1.0);
    bad.set(3, value);
    auto p = forward();
    p.cache.k_scale = bad.ref();
    expect_invalid(msa::paged_forward(p), "cache.k_scale", "scale value " + std::to_string(value));
  }
  {
    auto p = forward();
    p.cache.v = b.vc.ref();  // float32 v next to an E4M3 k
    p.cache.v_scale = {};
    expect_invalid(msa::paged_forward(p), "cache.v", "v not E4M3 with k");
  }
  {
    PagedRefs plain = host_refs(b);
    msa::PagedForwardParams p = paged_forward_params(cs, plain, Mode::kDense, false, {}, x.out.ref(), {});
    p.cache.k_scale = k.scale.ref();  // a scale for a float32 cache
    expect_invalid(msa::paged_forward(p), "cache.k_scale", "scale of a float cache");
  }
}

// FP8 queries (Q8KV8): q as E4M3 codes with a float32 scale per (token, head), or one for the
// tensor, over E4M3 caches. The call must compute exactly what it computes for the dequantised
// queries float32(value * q_scale) as float32 rows over the same caches: outputs, LSE and the
// selection (from q_idx) bit for bit, sparse (with the selection inside the call) and dense.
TEST(PagedE4M3, QueriesInE4M3EqualTheDequantisedQueries) {
  const PagedCase cs = fp8_case();
  PagedBatch b(cs);
  Quantised k(b.kc, true, 300.0, 1), v(b.vc, true, 300.0, 2);
  PagedRefs r = host_refs(b);
  r.k = k.codes.ref();
  r.v = v.codes.ref();
  for (bool per_row : {true, false}) {
    SCOPED_TRACE(per_row ? "q_scale [Tq, Hq]" : "q_scale [1]");
    std::mt19937_64 rng(per_row ? 41 : 43);
    std::uniform_real_distribution<double> u(-400.0, 400.0), s(0.001, 0.05);
    HostTensor q8(DType::kFloat8E4M3, b.q.shape()), deq(DType::kFloat32, b.q.shape());
    HostTensor qs = per_row ? HostTensor(DType::kFloat32, {b.Tq, cs.Hq}) : HostTensor(DType::kFloat32, {1});
    for (int64_t i = 0; i < qs.numel(); ++i) qs.set(i, s(rng));
    for (int64_t x = 0; x < q8.numel(); ++x) {
      q8.set(x, u(rng));
      const float sc = static_cast<float>(qs.get(per_row ? x / cs.D : 0));
      deq.set(x, static_cast<double>(static_cast<float>(q8.get(x)) * sc));
    }
    for (Mode mode : {Mode::kSparse, Mode::kDense}) {
      SCOPED_TRACE(mode == Mode::kSparse ? "sparse" : "dense");
      auto call = [&](bool fp8_q, PagedOutputs& x) {
        msa::PagedForwardParams p =
            paged_forward_params(cs, r, mode, mode == Mode::kSparse, x.block_idx.ref(), x.out.ref(), x.lse.ref());
        p.cache.k_scale = k.scale.ref();
        p.cache.v_scale = v.scale.ref();
        p.q = fp8_q ? q8.ref() : deq.ref();
        if (fp8_q) p.q_scale = qs.ref();
        expect_ok(msa::paged_forward(p));
      };
      PagedOutputs want(b), got(b);
      call(false, want);
      call(true, got);
      if (mode == Mode::kSparse) EXPECT_EQ(first_difference(got.block_idx, want.block_idx), "") << "block_idx";
      EXPECT_EQ(first_difference(got.out, want.out), "") << "out";
      EXPECT_EQ(first_difference(got.lse, want.lse), "") << "lse";
    }
  }
}

// FP8 queries: over E4M3 caches only, with q_scale (float32 [1] or [Tq, Hq], finite and
// positive); no q_scale for other queries; out a float dtype.
TEST(PagedE4M3, BadQueryScalesAndDtypes) {
  const PagedCase cs = fp8_case();
  PagedBatch b(cs);
  Quantised k(b.kc, true, 10.0, 1), v(b.vc, false, 10.0, 2);
  HostTensor q8(DType::kFloat8E4M3, b.q.shape()), qs(DType::kFloat32, {b.Tq, cs.Hq});
  q8.fill(1.0);
  qs.fill(0.5);
  PagedRefs r = host_refs(b);
  r.k = k.codes.ref();
  r.v = v.codes.ref();
  PagedOutputs x(b);
  auto forward = [&]() {
    msa::PagedForwardParams p = paged_forward_params(cs, r, Mode::kDense, false, {}, x.out.ref(), {});
    p.cache.k_scale = k.scale.ref();
    p.cache.v_scale = v.scale.ref();
    p.q = q8.ref();
    p.q_scale = qs.ref();
    return p;
  };
  expect_ok(msa::paged_forward(forward()));
  {
    auto p = forward();
    p.q_scale = {};
    expect_invalid(msa::paged_forward(p), "q_scale", "missing q_scale");
  }
  {
    HostTensor wrong(DType::kFloat32, {b.Tq, cs.Hq + 1});
    wrong.fill(1.0);
    auto p = forward();
    p.q_scale = wrong.ref();
    expect_invalid(msa::paged_forward(p), "q_scale", "q_scale of Hq + 1 columns");
  }
  {
    HostTensor half_scale(DType::kBFloat16, {1});
    half_scale.fill(1.0);
    auto p = forward();
    p.q_scale = half_scale.ref();
    expect_invalid(msa::paged_forward(p), "q_scale", "bfloat16 q_scale");
  }
  for (double value : {0.0, -1.0, static_cast<double>(NAN), static_cast<double>(INFINITY)}) {
    HostTensor bad(DType::kFloat32, {b.Tq, cs.Hq});
    bad.fill(1.0);
    bad.set(b.Tq * cs.Hq - 1, value);
    auto p = forward();
    p.q_scale = bad.ref();
    expect_invalid(msa::paged_forward(p), "q_scale", "q_scale value " + std::to_string(value));
  }
  {
    auto p = forward();
    p.q = b.q.ref();  // float32 queries with a q_scale
    expect_invalid(msa::paged_forward(p), "q_scale", "q_scale for float queries");
  }
  {
    PagedRefs plain = host_refs(b);
    msa::PagedForwardParams p = paged_forward_params(cs, plain, Mode::kDense, false, {}, x.out.ref(), {});
    p.q = q8.ref();
    p.q_scale = qs.ref();
    expect_invalid(msa::paged_forward(p), "q", "E4M3 queries over a float32 cache");
  }
  {
    HostTensor out8(DType::kFloat8E4M3, x.out.shape());
    auto p = forward();
    p.out = out8.ref();
    expect_invalid(msa::paged_forward(p), "out", "E4M3 out");
  }
  {
    PagedOutputs y(b);
    msa::PagedSelectParams sp = paged_select_params(cs, r, y.block_idx.ref());
    sp.q_idx = q8.ref();  // E4M3 index queries stay refused
    expect_invalid(msa::paged_select_blocks(sp), "q_idx", "E4M3 index queries");
  }
}

}  // namespace
}  // namespace msatest
