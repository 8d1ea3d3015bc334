// Main-branch forward (docs/contract.md §3), warmup (docs/contract.md §5) and the KL value (docs/contract.md §4) against the
// independent references.
#include <gtest/gtest.h>

#include "harness.h"
#include "reference.h"
#include "rounding.h"

namespace msatest {
namespace {

// G in {1, 2, 8, 16}; Hi in {Hkv, 2 Hkv}; Hik in {1, Hi}; D and Bk 64/128 with odd lengths.
const Config kShapes[] = {
    make_config({200}, 2, 2, 16, 2, 1, 16, 4, 1),             // G = 1
    make_config({150, 90}, 4, 2, 16, 2, 2, 16, 3, 2),         // G = 2, Hik = Hi
    make_config({170}, 8, 1, 8, 2, 1, 16, 4, 3),              // G = 8, Hi = 2 Hkv
    make_config({140}, 16, 1, 8, 1, 1, 16, 3, 4),             // G = 16
    make_config({190}, 8, 2, 8, 4, 4, 32, 3, 5),              // Hi = 2 Hkv, Hik = Hi
    make_config({1, 2, 113}, 4, 2, 16, 2, 1, 16, 4, 6),       // tiny sequences
    make_config({127, 128, 129}, 4, 1, 8, 1, 1, 64, 2, 7),    // Bk = 64 around a block edge
    make_config({799}, 2, 1, 64, 1, 1, 64, 4, 8),             // D = 64, Bk = 64
    make_config({799}, 2, 2, 128, 2, 1, 128, 3, 9),           // D = 128, Bk = 128
};

class Forward : public ::testing::TestWithParam<Config> {};

TEST_P(Forward, MatchesMaskedReference) {
  Config c = GetParam();
  Problem p(c);
  HostTensor bi = run_select(p);
  FwdResult f = run_forward(p, &bi, Mode::kSparse, true);
  const Sets sets = sets_from(p, bi);
  const RefForward r = ref_forward(p, sets);
  EXPECT_LT(rel_err(f.out.values(), r.out), 1e-12) << c.str();
  EXPECT_LT(rel_err(f.lse.values(), r.lse), 1e-6) << c.str();  // lse is stored in fp32
  EXPECT_NEAR(f.kl.get(0), ref_kl(p, sets), 1e-6 * std::fabs(ref_kl(p, sets)) + 1e-9) << c.str();
  EXPECT_GT(f.kl.get(0), 0.0);
}

// The warmup forward is dense causal attention, written without blocks in the reference.
TEST_P(Forward, WarmupIsDenseCausal) {
  Config c = GetParam();
  Problem p(c);
  FwdResult f = run_forward(p, nullptr, Mode::kDense, true);
  const RefForward r = naive_dense(p);
  EXPECT_LT(rel_err(f.out.values(), r.out), 1e-12) << c.str();
  EXPECT_LT(rel_err(f.lse.values(), r.lse), 1e-6) << c.str();
  const double kl = ref_kl(p, all_causal_blocks(p));
  EXPECT_NEAR(f.kl.get(0), kl, 1e-6 * std::fabs(kl) + 1e-9) << c.str();
}

// k covering every block: sparse MSA equals dense causal GQA attention (a standing test).
TEST_P(Forward, DenseWhenKCoversAllBlocks) {
  Config c = GetParam();
  int64_t longest = 0;
  for (int64_t l : c.seqlens) longest = std::max(longest, l);
  c.k = static_cast<int>((longest + c.Bk - 1) / c.Bk);
  Problem p(c);
  HostTensor bi = run_select(p);
  FwdResult sparse = run_forward(p, &bi, Mode::kSparse, true);
  FwdResult warm = run_forward(p, nullptr, Mode::kDense, true);
  const RefForward r = naive_dense(p);
  EXPECT_LT(rel_err(sparse.out.values(), r.out), 1e-12) << c.str();
  EXPECT_LT(rel_err(sparse.lse.values(), r.lse), 1e-6) << c.str();
  EXPECT_NEAR(sparse.kl.get(0), warm.kl.get(0), 1e-6 * std::fabs(warm.kl.get(0)));
}

INSTANTIATE_TEST_SUITE_P(Shapes, Forward, ::testing::ValuesIn(kShapes));

// Low-precision storage: the reference runs on the same (rounded) inputs, and the only extra
// error is the final rounding of out to the dtype, which must be correct: every value within half
// an ulp of the double result, both of the independent reference (whose own error is near 1e-15
// of the largest value) and of this backend run in float64 on exact copies of the inputs.
class ForwardDtype : public ::testing::TestWithParam<DType> {};

TEST_P(ForwardDtype, RoundsOnlyTheOutput) {
  Config c = make_config({333, 190}, 8, 2, 32, 2, 1, 32, 4, 21);
  c.dtype = GetParam();
  Problem p(c);
  Problem w = float64_copy(p);
  HostTensor bi = run_select(p);
  for (Mode mode : {Mode::kSparse, Mode::kDense}) {
    const std::string m = mode == Mode::kSparse ? "sparse" : "warmup";
    FwdResult f = run_forward(p, &bi, mode, false);
    FwdResult f64 = run_forward(w, &bi, mode, false);
    const RefForward r = mode == Mode::kSparse ? ref_forward(p, sets_from(p, bi)) : naive_dense(p);
    expect_correctly_rounded(c.dtype, f.out.values(), r.out, 1e-13 * max_abs(r.out), m + " out vs reference");
    expect_correctly_rounded(c.dtype, f.out.values(), f64.out.values(), 0.0, m + " out vs float64 run");
    EXPECT_LT(rel_err(f.lse.values(), r.lse), 1e-6) << m;
    EXPECT_EQ(f.lse.values(), f64.lse.values()) << m;  // fp32 from the same double
  }
}

// The largest finite float16, 65504, in every value: each output is a convex combination of
// them, so it rounds to +-65504, not to infinity (a float16 rounds to infinity from 65520 up).
TEST(ForwardDtype, LargestFloat16StaysFinite) {
  Config c = make_config({150}, 4, 2, 16, 2, 1, 16, 3, 23);
  c.dtype = DType::kFloat16;
  Problem p(c);
  for (int64_t x = 0; x < p.v.numel(); ++x) p.v.set(x, (x / c.D) % 2 ? -65504.0 : 65504.0);
  HostTensor bi = run_select(p);
  for (Mode mode : {Mode::kSparse, Mode::kDense}) {
    FwdResult f = run_forward(p, mode == Mode::kSparse ? &bi : nullptr, mode, false);
    for (int64_t g = 0; g < p.T; ++g)
      for (int h = 0; h < c.Hq; ++h)
        for (int d = 0; d < c.D; ++d)
          ASSERT_EQ(f.out.at(g, h, d), (h / (c.Hq / c.Hkv)) % 2 ? -65504.0 : 65504.0)
              << "row " << g << " head " << h << (mode == Mode::kSparse ? " sparse" : " warmup");
  }
}

INSTANTIATE_TEST_SUITE_P(Dtypes, ForwardDtype, ::testing::Values(DType::kFloat32, DType::kBFloat16, DType::kFloat16));

// The caller's block_idx is a set: any order and any -1 position give the same result.
TEST(Forward, BlockIdxIsASet) {
  Config c = make_config({300}, 4, 2, 16, 2, 1, 16, 5, 31);
  Problem p(c);
  HostTensor bi = run_select(p);
  FwdResult base = run_forward(p, &bi, Mode::kSparse, true);
  HostTensor shuffled(DType::kInt32, {p.T, c.Hi, c.k + 2});
  std::mt19937_64 rng(5);
  for (int64_t g = 0; g < p.T; ++g)
    for (int i = 0; i < c.Hi; ++i) {
      std::vector<int> row{-1, -1};
      for (int j = 0; j < c.k; ++j) row.push_back(bi.idx(g, i, j));
      std::shuffle(row.begin(), row.end(), rng);
      for (int j = 0; j < c.k + 2; ++j) shuffled.set((g * c.Hi + i) * (c.k + 2) + j, row[j]);
    }
  FwdResult other = run_forward(p, &shuffled, Mode::kSparse, true);
  EXPECT_TRUE(base.out.bitwise_equal(other.out));
  EXPECT_TRUE(base.lse.bitwise_equal(other.lse));
  EXPECT_EQ(base.kl.get(0), other.kl.get(0));
}

// A row whose caller-given selection is empty attends to nothing: out = 0, lse = -inf.
TEST(Forward, EmptySupportRow) {
  Config c = make_config({64}, 2, 1, 8, 1, 1, 16, 2, 41);
  Problem p(c);
  HostTensor bi = run_select(p);
  for (int j = 0; j < c.k; ++j) bi.set(50 * c.k + j, -1);
  FwdResult f = run_forward(p, &bi, Mode::kSparse, false);
  for (int h = 0; h < c.Hq; ++h) {
    EXPECT_EQ(f.lse.at(50, h), -INFINITY);
    for (int d = 0; d < c.D; ++d) EXPECT_EQ(f.out.at(50, h, d), 0.0);
  }
  EXPECT_TRUE(std::isfinite(f.lse.at(49, 0)));
}

// A row whose every score is -inf (a -inf query component against positive key components):
// lse = log sum exp(-inf) = -inf (contract §3), whatever NaN the output then carries.
TEST(Forward, AllScoresMinusInfinity) {
  Config c = make_config({64}, 2, 1, 8, 1, 1, 16, 2, 43);
  Problem p(c);
  for (int64_t j = 0; j < p.T; ++j) p.k.set(j * c.D, 1.0 + std::fabs(p.k.get(j * c.D)));
  for (int d = 0; d < c.D; ++d) p.q.set((50 * c.Hq + 1) * c.D + d, d == 0 ? -INFINITY : 0.0);
  HostTensor bi = run_select(p);
  for (Mode mode : {Mode::kSparse, Mode::kDense}) {
    FwdResult f = run_forward(p, mode == Mode::kSparse ? &bi : nullptr, mode, false);
    EXPECT_EQ(f.lse.at(50, 1), -INFINITY) << (mode == Mode::kSparse ? "sparse" : "warmup");
    EXPECT_TRUE(std::isfinite(f.lse.at(50, 0)));
  }
}

// The selection excluding the own block is legal input: keys of earlier blocks only.
TEST(Forward, CallerSelectionWithoutOwnBlock) {
  Config c = make_config({96}, 2, 1, 8, 1, 1, 16, 2, 43);
  Problem p(c);
  HostTensor bi(DType::kInt32, {p.T, 1, 2});
  for (int64_t g = 0; g < p.T; ++g) {
    bi.set(g * 2, 0);
    bi.set(g * 2 + 1, -1);
  }
  FwdResult f = run_forward(p, &bi, Mode::kSparse, false);
  const RefForward r = ref_forward(p, sets_from(p, bi));
  EXPECT_LT(rel_err(f.out.values(), r.out), 1e-12);
}

// Long sequence (4224 tokens) on a sample of heads: out and lse against the reference.
TEST(Forward, Length4224) {
  Config c = make_config({4224}, 2, 1, 16, 1, 1, 128, 4, 51);
  Problem p(c);
  HostTensor bi = run_select(p);
  FwdResult f = run_forward(p, &bi, Mode::kSparse, false);
  const RefForward r = ref_forward(p, sets_from(p, bi));
  EXPECT_LT(rel_err(f.out.values(), r.out), 1e-12);
  EXPECT_LT(rel_err(f.lse.values(), r.lse), 1e-6);
}

// kl_divergence entry point with per-row output.
TEST(Kl, RowsSumToTheValue) {
  Config c = make_config({250, 130}, 8, 2, 16, 4, 2, 32, 3, 61);
  Problem p(c);
  HostTensor bi = run_select(p);
  FwdResult f = run_forward(p, &bi, Mode::kSparse, true);
  HostTensor kl(DType::kFloat32, {1}), rows(DType::kFloat32, {p.T, c.Hi});
  rows.fill(NAN);
  msa::KlParams kp;
  kp.q = p.q.ref();
  kp.k = p.k.ref();
  kp.lse = f.lse.ref();
  kp.q_idx = p.q_idx.ref();
  kp.k_idx = p.k_idx.ref();
  kp.cu_seqlens = p.cu.ref();
  kp.block_idx = bi.ref();
  kp.kl = kl.ref();
  kp.kl_rows = rows.ref();
  kp.opts = p.options();
  expect_ok(msa::kl_divergence(kp));
  double sum = 0;
  for (int64_t x = 0; x < rows.numel(); ++x) {
    EXPECT_GE(rows.get(x), -1e-6);  // KL is non-negative
    sum += rows.get(x);
  }
  EXPECT_NEAR(kl.get(0), sum / (p.T * c.Hi), 1e-6 * kl.get(0));
  EXPECT_EQ(kl.get(0), f.kl.get(0));
  // Hi = 4 over Hik = 2 index key heads: index head i reads key head i / 2.
  const double want = ref_kl(p, sets_from(p, bi));
  EXPECT_NEAR(kl.get(0), want, 1e-6 * want);
}

// Scores thousands apart: most of the teacher's probabilities underflow to exactly 0, and their
// terms of the KL (pi log(pi / sigma), 0 where pi = 0) add nothing; the value stays finite.
TEST(Kl, TeacherZerosAddNothing) {
  Config c = make_config({200}, 4, 2, 16, 2, 1, 16, 4, 81);
  Problem p(c);
  for (int64_t x = 0; x < p.q.numel(); ++x) p.q.set(x, 60 * p.q.get(x));
  for (int64_t x = 0; x < p.k.numel(); ++x) p.k.set(x, 60 * p.k.get(x));
  HostTensor bi = run_select(p);
  FwdResult f = run_forward(p, &bi, Mode::kSparse, true);
  const double want = ref_kl(p, sets_from(p, bi));
  ASSERT_TRUE(std::isfinite(want));
  EXPECT_NEAR(f.kl.get(0), want, 1e-6 * std::fabs(want));
}

// When the student equals the teacher, the KL is zero: one query head per index head, index
// queries/keys equal to the main ones and the same scale.
TEST(Kl, ZeroWhenStudentEqualsTeacher) {
  Config c = make_config({200}, 2, 2, 16, 2, 2, 16, 4, 71);
  Problem p(c);
  for (int64_t x = 0; x < p.q.numel(); ++x) p.q_idx.set(x, p.q.get(x));
  for (int64_t x = 0; x < p.k.numel(); ++x) p.k_idx.set(x, p.k.get(x));
  HostTensor bi = run_select(p);
  FwdResult f = run_forward(p, &bi, Mode::kSparse, true);
  EXPECT_NEAR(f.kl.get(0), 0.0, 1e-7);
}

}  // namespace
}  // namespace msatest
