// Packed varlen batches: sequences never see each other, and a packed run equals running each
// sequence alone (with the KL weight rescaled for the token count N).
#include <gtest/gtest.h>

#include "harness.h"
#include "reference.h"

namespace msatest {
namespace {

Config batch(std::vector<int64_t> lens, uint64_t seed) {
  Config c = make_config(std::move(lens), 8, 2, 16, 4, 2, 16, 3, seed);
  c.sink = 1;
  return c;
}

struct Step {
  HostTensor bi;
  FwdResult f;
  BwdResult g;
};

Step train_step(Problem& p, Mode mode, HostTensor& dout, double gamma) {
  Step s;
  s.bi = run_select(p);
  s.f = run_forward(p, &s.bi, mode, true);
  s.g = run_backward(p, &s.bi, mode, s.f, dout, gamma);
  return s;
}

// Rows [r0, r1) of a tensor whose first dimension is tokens, bitwise.
bool rows_equal(const HostTensor& a, const HostTensor& b, int64_t r0, int64_t r1, int64_t b0 = -1) {
  if (b0 < 0) b0 = r0;
  int64_t row = 1;
  for (size_t d = 1; d < a.shape().size(); ++d) row *= a.shape()[d];
  for (int64_t x = r0 * row; x < r1 * row; ++x) {
    const double u = a.get(x), v = b.get(x - r0 * row + b0 * row);
    if (!(u == v || (std::isnan(u) && std::isnan(v)))) return false;
  }
  return true;
}

std::vector<double> token_rows(const HostTensor& t, int64_t r0, int64_t r1) {
  const int64_t row = t.numel() / std::max<int64_t>(t.shape()[0], 1);
  std::vector<double> v;
  for (int64_t x = r0 * row; x < r1 * row; ++x) v.push_back(t.get(x));
  return v;
}

class Varlen : public ::testing::TestWithParam<Mode> {};

// Changing every input of sequence 1 changes nothing of sequences 0 and 2.
TEST_P(Varlen, Isolation) {
  const Mode mode = GetParam();
  Config c = batch({130, 77, 0, 160}, 5);
  Problem p(c);
  std::mt19937_64 rng(1);
  HostTensor dout(c.dtype, {p.T, c.Hq, c.D});
  dout.randomize(rng);
  Step a = train_step(p, mode, dout, 1.0);
  const int64_t s1 = 130, e1 = 207;
  for (HostTensor* t : {&p.q, &p.k, &p.v, &p.q_idx, &p.k_idx, &dout}) {
    int64_t row = t->numel() / p.T;
    for (int64_t x = s1 * row; x < e1 * row; ++x) t->set(x, t->get(x) * -1.5 + 0.25);
  }
  p.k.set(s1 * c.Hkv * c.D + 3, NAN);  // even NaN stays inside its sequence
  Step b = train_step(p, mode, dout, 1.0);
  for (auto [r0, r1] : {std::pair<int64_t, int64_t>{0, s1}, {e1, p.T}}) {
    EXPECT_TRUE(rows_equal(a.bi, b.bi, r0, r1));
    EXPECT_TRUE(rows_equal(a.f.out, b.f.out, r0, r1));
    EXPECT_TRUE(rows_equal(a.f.lse, b.f.lse, r0, r1));
    EXPECT_TRUE(rows_equal(a.g.dk, b.g.dk, r0, r1));
    EXPECT_TRUE(rows_equal(a.g.dv, b.g.dv, r0, r1));
    EXPECT_TRUE(rows_equal(a.g.dq, b.g.dq, r0, r1));
    // The KL weight gamma / (N Hi) is global, and N does not change here.
    EXPECT_TRUE(rows_equal(a.g.dq_idx, b.g.dq_idx, r0, r1));
    EXPECT_TRUE(rows_equal(a.g.dk_idx, b.g.dk_idx, r0, r1));
  }
}

// A packed batch equals each sequence run alone; gamma scales by the token share so that
// gamma / (N Hi) is the same.
TEST_P(Varlen, EqualsSeparateRuns) {
  const Mode mode = GetParam();
  Config c = batch({1, 113, 0, 129, 64}, 6);
  Problem packed(c);
  std::mt19937_64 rng(2);
  HostTensor dout(c.dtype, {packed.T, c.Hq, c.D});
  dout.randomize(rng);
  Step all = train_step(packed, mode, dout, 1.0);
  for (size_t s = 0; s < c.seqlens.size(); ++s) {
    if (c.seqlens[s] == 0) continue;
    Config cs = c;
    cs.seqlens = {c.seqlens[s]};
    Problem one(cs);
    const int64_t r0 = packed.offsets[s], r1 = packed.offsets[s + 1];
    HostTensor dout1(c.dtype, {cs.T(), c.Hq, c.D});
    for (auto [src, dst] : {std::pair<HostTensor*, HostTensor*>{&packed.q, &one.q}, {&packed.k, &one.k},
                            {&packed.v, &one.v}, {&packed.q_idx, &one.q_idx}, {&packed.k_idx, &one.k_idx},
                            {&dout, &dout1}}) {
      const int64_t row = src->numel() / packed.T;
      for (int64_t x = 0; x < (r1 - r0) * row; ++x) dst->set(x, src->get(r0 * row + x));
    }
    // gamma goes through the API as a float: a relative rounding of at most 6e-8.
    Step alone = train_step(one, mode, dout1, static_cast<double>(cs.T()) / packed.T);
    EXPECT_TRUE(rows_equal(all.bi, alone.bi, r0, r1, 0)) << s;
    EXPECT_TRUE(rows_equal(all.f.out, alone.f.out, r0, r1, 0)) << s;
    EXPECT_TRUE(rows_equal(all.f.lse, alone.f.lse, r0, r1, 0)) << s;
    EXPECT_TRUE(rows_equal(all.g.dq, alone.g.dq, r0, r1, 0)) << s;
    EXPECT_TRUE(rows_equal(all.g.dk, alone.g.dk, r0, r1, 0)) << s;
    EXPECT_TRUE(rows_equal(all.g.dv, alone.g.dv, r0, r1, 0)) << s;
    EXPECT_LT(rel_err(alone.g.dq_idx.values(), token_rows(all.g.dq_idx, r0, r1)), 2e-7) << s;
    EXPECT_LT(rel_err(alone.g.dk_idx.values(), token_rows(all.g.dk_idx, r0, r1)), 2e-7) << s;
  }
}

INSTANTIATE_TEST_SUITE_P(Modes, Varlen, ::testing::Values(Mode::kSparse, Mode::kDense));

// Every output row is written, including rows of tiny sequences and around empty ones
// (the harness poisons outputs with NaN before each call).
TEST(Varlen, EveryOutputWritten) {
  Config c = batch({0, 1, 2, 0, 17, 0}, 7);
  Problem p(c);
  std::mt19937_64 rng(3);
  HostTensor dout(c.dtype, {p.T, c.Hq, c.D});
  dout.randomize(rng);
  for (Mode mode : {Mode::kSparse, Mode::kDense}) {
    Step s = train_step(p, mode, dout, 1.0);
    EXPECT_TRUE(all_finite(s.f.out));
    EXPECT_TRUE(all_finite(s.f.lse));
    EXPECT_TRUE(all_finite(s.f.kl));
    for (HostTensor* t : {&s.g.dq, &s.g.dk, &s.g.dv, &s.g.dq_idx, &s.g.dk_idx}) EXPECT_TRUE(all_finite(*t));
  }
}

// No tokens at all: every call succeeds and the KL is 0.
TEST(Varlen, AllEmpty) {
  Config c = batch({0, 0}, 8);
  Problem p(c);
  HostTensor dout(c.dtype, {0, c.Hq, c.D});
  Step s = train_step(p, Mode::kSparse, dout, 1.0);
  EXPECT_EQ(s.f.kl.get(0), 0.0);
}

}  // namespace
}  // namespace msatest
