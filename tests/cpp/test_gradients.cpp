// Backward (docs/contract.md §4): central finite differences in float64 of every gradient, the analytic
// reference on explicit masks, KL isolation and bitwise reproducibility.
#include <gtest/gtest.h>

#include "harness.h"
#include "reference.h"
#include "rounding.h"

namespace msatest {
namespace {

// Main loss L = sum(out * W); KL loss gamma * KL(q_idx, k_idx) with q, k, lse and the selection
// held fixed (the teacher is detached and the selection is not differentiable).
double main_loss(Problem& p, HostTensor* bi, Mode mode, const HostTensor& w) {
  FwdResult f = run_forward(p, bi, mode, false);
  double acc = 0;
  for (int64_t x = 0; x < w.numel(); ++x) acc += f.out.get(x) * w.get(x);
  return acc;
}

// The KL in double: the reference's direct formula (the API's KL output is fp32).
double kl_loss_double(Problem& p, const Sets& sets) { return ref_kl(p, sets); }

// Directional derivative along a random direction u: (L(x + eps u) - L(x - eps u)) / 2 eps.
template <class Loss>
double directional(HostTensor& x, const HostTensor& u, double eps, Loss&& loss) {
  const std::vector<double> x0 = x.values();
  for (int64_t i = 0; i < x.numel(); ++i) x.set(i, x0[i] + eps * u.get(i));
  const double plus = loss();
  for (int64_t i = 0; i < x.numel(); ++i) x.set(i, x0[i] - eps * u.get(i));
  const double minus = loss();
  for (int64_t i = 0; i < x.numel(); ++i) x.set(i, x0[i]);
  return (plus - minus) / (2 * eps);
}

// A random output gradient dout [T, Hq, D] of p's dtype.
HostTensor random_dout(const Problem& p, uint64_t seed) {
  std::mt19937_64 rng(seed);
  HostTensor dout(p.cfg.dtype, {p.T, p.cfg.Hq, p.cfg.D});
  dout.randomize(rng);
  return dout;
}

double inner(const HostTensor& a, const HostTensor& b) {
  double acc = 0;
  for (int64_t i = 0; i < a.numel(); ++i) acc += a.get(i) * b.get(i);
  return acc;
}

// Scale of an inner product, for a tolerance that ignores cancellation.
double inner_abs(const HostTensor& a, const HostTensor& b) {
  double acc = 0;
  for (int64_t i = 0; i < a.numel(); ++i) acc += std::fabs(a.get(i) * b.get(i));
  return acc;
}

struct GradCase {
  Config cfg;
  Mode mode;
};

std::ostream& operator<<(std::ostream& os, const GradCase& g) {
  return os << g.cfg.str() << (g.mode == Mode::kDense ? " warmup" : " sparse");
}

class Gradients : public ::testing::TestWithParam<GradCase> {};

TEST_P(Gradients, FiniteDifferences) {
  const GradCase gc = GetParam();
  Config c = gc.cfg;
  Problem p(c);
  HostTensor bi = run_select(p);
  HostTensor* bip = gc.mode == Mode::kSparse ? &bi : nullptr;
  const Sets sets = gc.mode == Mode::kSparse ? sets_from(p, bi) : all_causal_blocks(p);
  std::mt19937_64 rng(c.seed + 7);
  HostTensor w(c.dtype, {p.T, c.Hq, c.D});
  w.randomize(rng);
  const double gamma = 1.7;
  FwdResult f = run_forward(p, bip, gc.mode, false);
  BwdResult g = run_backward(p, bip, gc.mode, f, w, gamma);

  const double eps = 1e-5;
  struct Check {
    const char* name;
    HostTensor* x;
    HostTensor* grad;
    bool kl;
  };
  Check checks[] = {{"q", &p.q, &g.dq, false},       {"k", &p.k, &g.dk, false},
                    {"v", &p.v, &g.dv, false},       {"q_idx", &p.q_idx, &g.dq_idx, true},
                    {"k_idx", &p.k_idx, &g.dk_idx, true}};
  for (Check& ch : checks) {
    HostTensor u(c.dtype, ch.x->shape());
    u.randomize(rng);
    double fd;
    if (ch.kl)
      fd = gamma * directional(*ch.x, u, eps, [&] { return kl_loss_double(p, sets); });
    else
      fd = directional(*ch.x, u, eps, [&] { return main_loss(p, bip, gc.mode, w); });
    const double an = inner(*ch.grad, u);
    EXPECT_NEAR(an, fd, 1e-6 * inner_abs(*ch.grad, u) + 1e-12) << ch.name << " " << gc;
    EXPECT_GT(inner_abs(*ch.grad, u), 0.0) << ch.name << ": zero gradient";
    EXPECT_TRUE(all_finite(*ch.grad)) << ch.name;
  }
}

// The analytic reference over explicit masks, element by element.
TEST_P(Gradients, MatchAnalyticReference) {
  const GradCase gc = GetParam();
  Problem p(gc.cfg);
  HostTensor bi = run_select(p);
  HostTensor* bip = gc.mode == Mode::kSparse ? &bi : nullptr;
  const Sets sets = gc.mode == Mode::kSparse ? sets_from(p, bi) : all_causal_blocks(p);
  HostTensor dout = random_dout(p, gc.cfg.seed + 9);
  FwdResult f = run_forward(p, bip, gc.mode, false);
  BwdResult g = run_backward(p, bip, gc.mode, f, dout, 2.5);
  const RefGrads r = ref_backward(p, sets, dout, 2.5);
  // lse is fp32, so P carries a relative error near 1e-7.
  EXPECT_LT(rel_err(g.dq.values(), r.dq), 1e-6) << gc;
  EXPECT_LT(rel_err(g.dk.values(), r.dk), 1e-6) << gc;
  EXPECT_LT(rel_err(g.dv.values(), r.dv), 1e-6) << gc;
  EXPECT_LT(rel_err(g.dq_idx.values(), r.dq_idx), 1e-6) << gc;
  EXPECT_LT(rel_err(g.dk_idx.values(), r.dk_idx), 1e-6) << gc;
}

const GradCase kGradCases[] = {
    {make_config({150}, 2, 2, 8, 2, 1, 16, 3, 1), Mode::kSparse},          // G = 1
    {make_config({130, 70}, 4, 2, 8, 2, 2, 16, 3, 2), Mode::kSparse},      // G = 2, Hik = Hi, varlen
    {make_config({120}, 8, 1, 8, 2, 1, 16, 3, 3), Mode::kSparse},          // G = 8, Hi = 2 Hkv
    {make_config({100}, 16, 1, 4, 1, 1, 16, 2, 4), Mode::kSparse},         // G = 16
    {make_config({140}, 8, 2, 8, 4, 4, 32, 2, 5), Mode::kSparse},          // Hi = 2 Hkv, Hik = Hi
    {make_config({1, 2, 113}, 4, 2, 8, 2, 1, 16, 3, 6), Mode::kSparse},    // tiny sequences
    {make_config({90, 0, 60}, 4, 2, 8, 2, 1, 16, 2, 7), Mode::kDense},     // warmup, empty sequence
    {make_config({129}, 8, 2, 8, 4, 2, 64, 1, 8), Mode::kDense},           // warmup, Bk = 64
    {make_config({129}, 8, 2, 8, 4, 2, 64, 2, 9), Mode::kSparse},          // Bk = 64
};

INSTANTIATE_TEST_SUITE_P(Cases, Gradients, ::testing::ValuesIn(kGradCases));

// 16-bit (and float32) gradients: the double sums are rounded once, correctly. Every stored dq,
// dk, dv, dq_idx, dk_idx is within half an ulp of the exact gradient given the forward's stored
// out and lse: of the independent reference (its own error is near 1e-15 of the largest value)
// and of this backend run in float64 on exact copies of the inputs, out, lse and dout.
class GradientsDtype : public ::testing::TestWithParam<std::tuple<DType, Mode>> {};

TEST_P(GradientsDtype, RoundOnlyTheOutputs) {
  const auto [dtype, mode] = GetParam();
  Config c = make_config({150, 97}, 8, 2, 16, 4, 2, 16, 3, 31);
  c.dtype = dtype;
  Problem p(c);
  HostTensor bi = run_select(p);
  HostTensor* bip = mode == Mode::kSparse ? &bi : nullptr;
  const Sets sets = mode == Mode::kSparse ? sets_from(p, bi) : all_causal_blocks(p);
  std::mt19937_64 rng(12);
  HostTensor dout(dtype, {p.T, c.Hq, c.D});
  dout.randomize(rng);
  const double gamma = 37.0;  // KL gradients of a size comparable to the main ones
  FwdResult f = run_forward(p, bip, mode, false);
  BwdResult g = run_backward(p, bip, mode, f, dout, gamma);

  Problem w = float64_copy(p);
  FwdResult fw{float64_copy(f.out), f.lse, f.kl};
  HostTensor dout64 = float64_copy(dout);
  BwdResult gw = run_backward(w, bip, mode, fw, dout64, gamma);
  const RefForward stored{f.out.values(), f.lse.values()};
  const RefGrads r = ref_backward(p, sets, dout, gamma, &stored);

  const struct {
    const char* name;
    const HostTensor& got;
    const HostTensor& f64;
    const std::vector<double>& ref;
  } grads[] = {{"dq", g.dq, gw.dq, r.dq},
               {"dk", g.dk, gw.dk, r.dk},
               {"dv", g.dv, gw.dv, r.dv},
               {"dq_idx", g.dq_idx, gw.dq_idx, r.dq_idx},
               {"dk_idx", g.dk_idx, gw.dk_idx, r.dk_idx}};
  const std::string m = mode == Mode::kSparse ? " sparse" : " warmup";
  for (const auto& x : grads) {
    EXPECT_GT(max_abs(x.ref), 0.0) << x.name;
    expect_correctly_rounded(dtype, x.got.values(), x.ref, 1e-13 * max_abs(x.ref), x.name + m + " vs reference");
    expect_correctly_rounded(dtype, x.got.values(), x.f64.values(), 0.0, x.name + m + " vs float64 run");
  }
}

INSTANTIATE_TEST_SUITE_P(Dtypes, GradientsDtype,
                         ::testing::Combine(::testing::Values(DType::kBFloat16, DType::kFloat16, DType::kFloat32),
                                            ::testing::Values(Mode::kSparse, Mode::kDense)));

// Larger shapes against the analytic reference only: D 64/128, Bk 64/128, odd lengths.
void expect_reference_gradients(const Config& c) {
  Problem p(c);
  HostTensor bi = run_select(p);
  std::mt19937_64 rng(c.seed + 1);
  HostTensor dout(DType::kFloat64, {p.T, c.Hq, c.D});
  dout.randomize(rng);
  FwdResult f = run_forward(p, &bi, Mode::kSparse, false);
  BwdResult g = run_backward(p, &bi, Mode::kSparse, f, dout, 1.0);
  const RefGrads r = ref_backward(p, sets_from(p, bi), dout, 1.0);
  EXPECT_LT(rel_err(g.dk.values(), r.dk), 1e-6) << c.str();
  EXPECT_LT(rel_err(g.dv.values(), r.dv), 1e-6) << c.str();
  EXPECT_LT(rel_err(g.dq.values(), r.dq), 1e-6) << c.str();
  EXPECT_LT(rel_err(g.dk_idx.values(), r.dk_idx), 1e-6) << c.str();
  EXPECT_LT(rel_err(g.dq_idx.values(), r.dq_idx), 1e-6) << c.str();
}

TEST(GradientsLarge, D64Bk64Len799) { expect_reference_gradients(make_config({799}, 4, 2, 64, 2, 1, 64, 4, 12)); }
TEST(GradientsLarge, D128Bk128Len1000) { expect_reference_gradients(make_config({1000}, 2, 1, 128, 1, 1, 128, 3, 14)); }
TEST(GradientsLarge, Bk128Len4224) { expect_reference_gradients(make_config({4224}, 2, 1, 16, 1, 1, 128, 3, 13)); }

// The KL never reaches q, k, v; dq_idx and dk_idx are linear in gamma and zero at gamma = 0.
TEST(Gradients, KlIsolation) {
  Config c = make_config({200}, 4, 2, 8, 2, 1, 16, 3, 21);
  Problem p(c);
  HostTensor bi = run_select(p);
  HostTensor dout = random_dout(p, 8);
  FwdResult f = run_forward(p, &bi, Mode::kSparse, false);
  BwdResult g0 = run_backward(p, &bi, Mode::kSparse, f, dout, 0.0);
  BwdResult g1 = run_backward(p, &bi, Mode::kSparse, f, dout, 1.0);
  BwdResult g3 = run_backward(p, &bi, Mode::kSparse, f, dout, 3.0);
  EXPECT_TRUE(g0.dq.bitwise_equal(g3.dq));
  EXPECT_TRUE(g0.dk.bitwise_equal(g3.dk));
  EXPECT_TRUE(g0.dv.bitwise_equal(g3.dv));
  for (int64_t x = 0; x < g0.dq_idx.numel(); ++x) EXPECT_EQ(g0.dq_idx.get(x), 0.0);
  EXPECT_LT(rel_err(g3.dq_idx.values(), [&] { auto v = g1.dq_idx.values(); for (double& y : v) y *= 3; return v; }()), 1e-12);
  EXPECT_LT(rel_err(g3.dk_idx.values(), [&] { auto v = g1.dk_idx.values(); for (double& y : v) y *= 3; return v; }()), 1e-12);
  // dout = 0 leaves only the KL gradients.
  dout.fill(0.0);
  BwdResult gz = run_backward(p, &bi, Mode::kSparse, f, dout, 1.0);
  for (int64_t x = 0; x < gz.dq.numel(); ++x) ASSERT_EQ(gz.dq.get(x), 0.0);
  EXPECT_TRUE(gz.dq_idx.bitwise_equal(g1.dq_idx));
}

// kl_grad (a tensor, as frameworks pass it) multiplies kl_weight.
TEST(Gradients, KlGradTensorScalesGamma) {
  Config c = make_config({100}, 4, 2, 8, 2, 1, 16, 3, 22);
  Problem p(c);
  HostTensor bi = run_select(p);
  HostTensor dout = random_dout(p, 9);
  FwdResult f = run_forward(p, &bi, Mode::kSparse, false);
  BwdResult ref = run_backward(p, &bi, Mode::kSparse, f, dout, 0.5);
  HostTensor kg(DType::kFloat32, {1});
  kg.set(0, 0.25);
  BwdResult got{HostTensor(c.dtype, {p.T, c.Hq, c.D}), HostTensor(c.dtype, {p.T, c.Hkv, c.D}),
                HostTensor(c.dtype, {p.T, c.Hkv, c.D}), HostTensor(c.dtype, {p.T, c.Hi, c.Di}),
                HostTensor(c.dtype, {p.T, c.Hik, c.Di})};
  msa::BackwardParams bp;
  bp.q = p.q.ref(); bp.k = p.k.ref(); bp.v = p.v.ref();
  bp.out = f.out.ref(); bp.lse = f.lse.ref(); bp.dout = dout.ref();
  bp.cu_seqlens = p.cu.ref(); bp.block_idx = bi.ref();
  bp.dq = got.dq.ref(); bp.dk = got.dk.ref(); bp.dv = got.dv.ref();
  bp.q_idx = p.q_idx.ref(); bp.k_idx = p.k_idx.ref();
  bp.dq_idx = got.dq_idx.ref(); bp.dk_idx = got.dk_idx.ref();
  bp.kl_grad = kg.ref();
  bp.kl_weight = 2.0f;
  bp.opts = p.options();
  expect_ok(msa::backward(bp));
  EXPECT_TRUE(got.dq_idx.bitwise_equal(ref.dq_idx));
  EXPECT_TRUE(got.dk_idx.bitwise_equal(ref.dk_idx));
}

// dq_idx or dk_idx alone (contract §4: the KL branch runs when either is given): each equals the
// call that asks for both, bit for bit, and so do dq, dk and dv.
TEST(Gradients, EitherIndexGradientAlone) {
  Config c = make_config({210, 95}, 8, 2, 16, 4, 2, 16, 3, 91);
  Problem p(c);
  HostTensor bi = run_select(p);
  HostTensor w = random_dout(p, 17);
  FwdResult f = run_forward(p, &bi, Mode::kSparse, false);
  BwdResult both = run_backward(p, &bi, Mode::kSparse, f, w, 1.3);
  BwdResult dq_only = run_backward(p, &bi, Mode::kSparse, f, w, 1.3, false, 1);
  BwdResult dk_only = run_backward(p, &bi, Mode::kSparse, f, w, 1.3, false, 2);
  EXPECT_GT(inner_abs(both.dq_idx, both.dq_idx), 0.0);
  EXPECT_GT(inner_abs(both.dk_idx, both.dk_idx), 0.0);
  EXPECT_TRUE(dq_only.dq_idx.bitwise_equal(both.dq_idx));
  EXPECT_TRUE(dk_only.dk_idx.bitwise_equal(both.dk_idx));
  for (BwdResult* r : {&dq_only, &dk_only}) {
    EXPECT_TRUE(r->dq.bitwise_equal(both.dq));
    EXPECT_TRUE(r->dk.bitwise_equal(both.dk));
    EXPECT_TRUE(r->dv.bitwise_equal(both.dv));
  }
}

// Deterministic mode (and the CPU backend always): bitwise-identical gradients run after run.
TEST(Gradients, BitwiseReproducible) {
  Config c = make_config({300, 211}, 8, 2, 16, 4, 1, 32, 4, 23);
  c.dtype = DType::kBFloat16;
  Problem p(c);
  HostTensor bi = run_select(p);
  HostTensor dout = random_dout(p, 10);
  FwdResult f = run_forward(p, &bi, Mode::kSparse, false);
  BwdResult a = run_backward(p, &bi, Mode::kSparse, f, dout, 1.0, true);
  for (int rep = 0; rep < 3; ++rep) {
    BwdResult b = run_backward(p, &bi, Mode::kSparse, f, dout, 1.0, true);
    EXPECT_TRUE(a.dq.bitwise_equal(b.dq));
    EXPECT_TRUE(a.dk.bitwise_equal(b.dk));
    EXPECT_TRUE(a.dv.bitwise_equal(b.dv));
    EXPECT_TRUE(a.dq_idx.bitwise_equal(b.dq_idx));
    EXPECT_TRUE(a.dk_idx.bitwise_equal(b.dk_idx));
  }
}

// Warmup backward equals the sparse backward when k covers every block.
TEST(Gradients, WarmupEqualsSparseWhenKCoversAll) {
  Config c = make_config({150, 97}, 4, 2, 8, 2, 1, 16, 10, 24);
  Problem p(c);
  HostTensor bi = run_select(p);
  HostTensor dout = random_dout(p, 11);
  FwdResult fs = run_forward(p, &bi, Mode::kSparse, true);
  FwdResult fd = run_forward(p, nullptr, Mode::kDense, true);
  EXPECT_TRUE(fs.out.bitwise_equal(fd.out));
  EXPECT_EQ(fs.kl.get(0), fd.kl.get(0));
  BwdResult gs = run_backward(p, &bi, Mode::kSparse, fs, dout, 1.0);
  BwdResult gd = run_backward(p, nullptr, Mode::kDense, fd, dout, 1.0);
  EXPECT_TRUE(gs.dq.bitwise_equal(gd.dq));
  EXPECT_TRUE(gs.dk.bitwise_equal(gd.dk));
  EXPECT_TRUE(gs.dv.bitwise_equal(gd.dv));
  EXPECT_TRUE(gs.dq_idx.bitwise_equal(gd.dq_idx));
  EXPECT_TRUE(gs.dk_idx.bitwise_equal(gd.dk_idx));
}

}  // namespace
}  // namespace msatest
