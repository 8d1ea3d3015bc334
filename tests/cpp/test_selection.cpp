// Index selection (docs/contract.md §2) against a brute-force reference.
#include <gtest/gtest.h>

#include "harness.h"
#include "reference.h"

namespace msatest {
namespace {

// Grid-valued inputs make every score exact in double, so ties are real ties and the selection
// must equal the brute force exactly (ascending ids, then -1 padding).
void expect_exact_selection(const Config& c) {
  Problem p(c);
  std::mt19937_64 rng(c.seed + 100);
  p.q_idx.randomize_grid(rng, 2, 0.25);
  p.k_idx.randomize_grid(rng, 2, 0.25);
  HostTensor bi = run_select(p);
  const Sets want = ref_select(p);
  for (int64_t g = 0; g < p.T; ++g)
    for (int i = 0; i < c.Hi; ++i) {
      const std::vector<int>& w = want[g][i];
      for (int j = 0; j < c.k; ++j) {
        const int expect = j < static_cast<int>(w.size()) ? w[j] : -1;
        ASSERT_EQ(bi.idx(g, i, j), expect) << c.str() << " row " << g << " head " << i << " slot " << j;
      }
    }
}

class SelectionExact : public ::testing::TestWithParam<Config> {};

TEST_P(SelectionExact, MatchesBruteForce) { expect_exact_selection(GetParam()); }

Config sel(std::vector<int64_t> lens, int Bk, int k, int sink = 0, int local = 1, int Hi = 2, int Hik = 1) {
  Config c;
  c.seqlens = std::move(lens);
  c.Bk = Bk;
  c.k = k;
  c.sink = sink;
  c.local = local;
  c.Hq = 4;
  c.Hkv = 2;
  c.Hi = Hi;
  c.Hik = Hik;
  c.D = 8;
  c.Di = 8;
  c.seed = 11 + lens.size() * 7 + Bk + k * 3 + sink * 5 + local;
  return c;
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, SelectionExact,
    ::testing::Values(sel({1}, 16, 4), sel({2}, 16, 4), sel({113}, 16, 4), sel({127, 128, 129}, 16, 3),
                      sel({799}, 64, 4), sel({799}, 128, 3), sel({300}, 16, 6, 1, 1), sel({300}, 16, 6, 2, 3),
                      sel({300}, 16, 2, 0, 2), sel({300}, 16, 4, 3, 1, 4, 4), sel({200, 0, 77}, 16, 5, 0, 1, 4, 2),
                      sel({4224}, 128, 16)));

// Every key identical: all block maxima tie, so the lowest-index candidates win.
TEST(Selection, TiesGoToLowerBlockIndex) {
  Config c = sel({160}, 16, 4);
  Problem p(c);
  for (int64_t g = 0; g < p.T; ++g)
    for (int d = 0; d < c.Di; ++d) p.k_idx.set(g * c.Di + d, 0.5);
  HostTensor bi = run_select(p);
  const int64_t t = 159;  // own block 9: forced 9, then 0, 1, 2
  const int want[4] = {0, 1, 2, 9};
  for (int i = 0; i < c.Hi; ++i)
    for (int j = 0; j < 4; ++j) EXPECT_EQ(bi.idx(t, i, j), want[j]);
}

// Early tokens see fewer blocks than slots: all of them, then -1.
TEST(Selection, PadsWithMinusOne) {
  Config c = sel({70}, 16, 8);
  Problem p(c);
  HostTensor bi = run_select(p);
  for (int64_t t = 0; t < 70; ++t)
    for (int i = 0; i < c.Hi; ++i) {
      const int own = static_cast<int>(t / 16);
      for (int j = 0; j < 8; ++j) EXPECT_EQ(bi.idx(t, i, j), j <= own ? j : -1) << t;
    }
}

// A hand-made score pattern: the best block by index score must be chosen over the others.
TEST(Selection, PicksHighestBlockMax) {
  Config c = sel({128}, 16, 2);
  c.Hi = 2;
  Problem p(c);
  for (int64_t g = 0; g < p.T; ++g)
    for (int d = 0; d < c.Di; ++d) {
      p.k_idx.set(g * c.Di + d, d == 0 ? 0.01 : 0.0);
      for (int i = 0; i < c.Hi; ++i) p.q_idx.set((g * c.Hi + i) * c.Di + d, d == 0 ? 1.0 : 0.0);
    }
  // One key in block 3 scores high; it must win for every later token.
  p.k_idx.set(3 * 16 * c.Di + 5 * c.Di, 4.0);
  HostTensor bi = run_select(p);
  for (int64_t t = 64; t < 128; ++t) {
    const int own = static_cast<int>(t / 16);
    EXPECT_EQ(bi.idx(t, 0, 0), 3) << t;
    EXPECT_EQ(bi.idx(t, 0, 1), own) << t;
  }
}

// Float inputs (no exact ties): the contract's tolerance rule against the reference ranking.
class SelectionTolerance : public ::testing::TestWithParam<DType> {};

TEST_P(SelectionTolerance, WithinSpecRule) {
  Config c = sel({500}, 32, 5, 1, 1);
  c.dtype = GetParam();
  Problem p(c);
  HostTensor bi = run_select(p);
  for (int64_t g = 0; g < p.T; ++g) {
    const int own = static_cast<int>(g / c.Bk);
    for (int i = 0; i < c.Hi; ++i) {
      std::vector<int> row, chosen;
      for (int j = 0; j < c.k; ++j) row.push_back(bi.idx(g, i, j));
      for (int b : row)
        if (b >= 0) chosen.push_back(b);
      ASSERT_EQ(selection_format_error(row, own), "") << "row " << g << " head " << i;
      EXPECT_EQ(selection_rule_error(c, own, block_scores(p, g, i), chosen, 1e-6, 0.0), "")
          << "row " << g << " head " << i;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Dtypes, SelectionTolerance,
                         ::testing::Values(DType::kFloat32, DType::kBFloat16, DType::kFloat16, DType::kFloat64));

// lse_idx: log-sum-exp of the index scores over the selected support.
TEST(Selection, IndexLseOverSupport) {
  Config c = sel({333}, 32, 4, 1, 1, 4, 2);
  Problem p(c);
  HostTensor lse;
  HostTensor bi = run_select(p, &lse);
  const Sets sets = sets_from(p, bi);
  for (int64_t g = 0; g < p.T; ++g)
    for (int i = 0; i < c.Hi; ++i) {
      double mx = -INFINITY, z = 0;
      std::vector<double> s;
      for (int b : sets[g][i])
        for (int64_t j = b * c.Bk; j < std::min<int64_t>((b + 1) * c.Bk, g + 1); ++j) s.push_back(index_score(p, g, i, j));
      for (double x : s) mx = std::max(mx, x);
      for (double x : s) z += std::exp(x - mx);
      EXPECT_NEAR(lse.at(g, i), mx + std::log(z), 1e-5 * (1 + std::fabs(mx)));
    }
}

// NaN in one sequence never reaches another sequence's selection.
TEST(Selection, NanStaysInItsSequence) {
  Config c = sel({150, 150}, 16, 4);
  Problem p(c);
  HostTensor clean = run_select(p);
  p.k_idx.set(160 * c.Di + 3, NAN);  // sequence 1
  HostTensor dirty = run_select(p);
  for (int64_t g = 0; g < 150; ++g)
    for (int i = 0; i < c.Hi; ++i)
      for (int j = 0; j < c.k; ++j) EXPECT_EQ(clean.idx(g, i, j), dirty.idx(g, i, j));
  // The NaN sequence still yields well-formed rows that hold their own block.
  for (int64_t g = 150; g < 300; ++g) {
    bool own = false;
    for (int j = 0; j < c.k; ++j) own |= dirty.idx(g, 0, j) == (g - 150) / 16;
    EXPECT_TRUE(own) << g;
  }
}

// A NaN score counts as -inf inside its block too (contract §2): a block whose last key scores
// NaN keeps the maximum of its other keys, and the selection equals the brute force's.
TEST(Selection, NanKeyLeavesItsBlockTheOtherKeysMaximum) {
  Config c = sel({200}, 16, 4);
  Problem p(c);
  std::mt19937_64 rng(29);
  p.q_idx.randomize_grid(rng, 2, 0.25);
  p.k_idx.randomize_grid(rng, 2, 0.25);
  for (int b : {1, 3, 4, 6, 8}) p.k_idx.set((16 * b + 15) * c.Di + 2, NAN);  // Hik = 1
  p.k_idx.set((16 * 5 + 7) * c.Di, NAN);  // and one in the middle of block 5
  HostTensor bi = run_select(p);
  const Sets want = ref_select(p);
  for (int64_t g = 0; g < p.T; ++g)
    for (int i = 0; i < c.Hi; ++i)
      for (int j = 0; j < c.k; ++j) {
        const int expect = j < static_cast<int>(want[g][i].size()) ? want[g][i][j] : -1;
        ASSERT_EQ(bi.idx(g, i, j), expect) << "row " << g << " head " << i << " slot " << j;
      }
}

// select_blocks with FP8 scores and fp8_rerank = m on the CPU: block_idx (poisoned first), and
// lse_idx into *lse when given.
HostTensor select_fp8(Problem& p, int m, HostTensor* lse = nullptr, int slots = 0) {
  HostTensor bi(DType::kInt32, {p.T, p.cfg.Hi, p.cfg.k});
  bi.fill(-7);
  msa::SelectParams sp;
  sp.q_idx = p.q_idx.ref();
  sp.k_idx = p.k_idx.ref();
  sp.cu_seqlens = p.cu.ref();
  sp.block_idx = bi.ref();
  if (lse != nullptr) sp.lse_idx = lse->ref();
  sp.opts = p.options();
  sp.opts.select_scores = msa::SelectScores::kFp8;
  sp.opts.fp8_rerank = m;
  sp.opts.fp8_rerank_slots = slots;
  expect_ok(msa::select_blocks(sp));
  return bi;
}

// Options.select_scores = kFp8 with fp8_rerank = 0 (contract §2): the selection follows the rule
// over the scores of the dequantised E4M3 copies (fp8_scored, the tests' own quantiser) with no
// slack, on several sequences whose last blocks are partial; lse_idx keeps the inputs' own scores.
TEST(Selection, Fp8ScoresFollowTheRule) {
  for (DType dt : {DType::kBFloat16, DType::kFloat32}) {
    Config c = sel({300, 1, 77, 129}, 16, 5, 1, 1, 4, 2);
    c.dtype = dt;
    Problem p(c);
    p.k_idx.set(40 * c.Hik * c.Di + 3, 9.5);  // one block with a large amax
    const Problem q8 = fp8_scored(p);
    HostTensor lse(DType::kFloat32, {p.T, c.Hi});
    lse.fill(NAN);
    const HostTensor bi = select_fp8(p, 0, &lse);
    const Sets sets = sets_from(p, bi);
    int64_t differs = 0;
    const Sets exact = ref_select(p);
    for (int64_t g = 0; g < p.T; ++g) {
      const int64_t t = g - seq_begin(p, g);
      const int own = static_cast<int>(t / c.Bk);
      for (int i = 0; i < c.Hi; ++i) {
        std::vector<int> row;
        for (int j = 0; j < c.k; ++j) row.push_back(bi.idx(g, i, j));
        ASSERT_EQ(selection_format_error(row, own), "") << "row " << g << " head " << i;
        EXPECT_EQ(selection_rule_error(c, own, block_scores(q8, g, i), sets[g][i], 1e-9, 0.0), "")
            << msa::dtype_name(dt) << " row " << g << " head " << i;
        differs += sets[g][i] != exact[g][i];
        std::vector<double> sc;
        for (int b : sets[g][i])
          for (int64_t j = b * c.Bk; j <= std::min<int64_t>((b + 1) * c.Bk - 1, t); ++j)
            sc.push_back(index_score(p, g, i, seq_begin(p, g) + j));
        double mx = -INFINITY, z = 0;
        for (double x : sc) mx = std::max(mx, x);
        for (double x : sc) z += std::exp(x - mx);
        EXPECT_NEAR(lse.at(g, i), mx + std::log(z), 1e-5 * (1 + std::fabs(mx))) << "row " << g << " head " << i;
      }
    }
    // The copies are coarse: some rows must pick otherwise than the inputs' own scores.
    EXPECT_GT(differs, 0) << msa::dtype_name(dt);
  }
}

// 16 (tied + 1) tokens, Bk 16, k 2, one index head: blocks 0 .. tied - 1 whose best keys round
// to the same E4M3 value under the scale a large value elsewhere in each block sets, the last
// one's 2^-7 above the others' (apart in bfloat16). tied = 2: blocks 0 and 1, 48 tokens.
Problem e4m3_tie_problem(int tied = 2) {
  Config c = sel({16 * (tied + 1)}, 16, 2);
  c.dtype = DType::kBFloat16;
  c.Hi = 1;
  Problem p(c);
  for (int64_t x = 0; x < p.q_idx.numel(); ++x) p.q_idx.set(x, x % c.Di == 0 ? 1.0 : 0.0);
  for (int64_t x = 0; x < p.k_idx.numel(); ++x) p.k_idx.set(x, 0.0);
  for (int b = 0; b < tied; ++b) {
    p.k_idx.set(16 * b * c.Di + 1, 100.0);  // row 0: dim 1 (which the query ignores) sets the scale
    p.k_idx.set((16 * b + 1) * c.Di, b == tied - 1 ? 1.0078125 : 1.0);
  }
  return p;
}

// e4m3_tie_problem: kFp8 with fp8_rerank = 0 ties the two blocks and picks the lower one, where
// the inputs' own scores pick the higher one.
TEST(Selection, Fp8ScoresTieWhatE4M3CannotTellApart) {
  Problem p = e4m3_tie_problem();
  const Config& c = p.cfg;
  for (msa::SelectScores scores : {msa::SelectScores::kInput, msa::SelectScores::kFp8}) {
    // (kFp8 with re-ranking: Selection.Fp8RerankFollowsTheRule)
    HostTensor bi(DType::kInt32, {p.T, c.Hi, c.k});
    msa::SelectParams sp;
    sp.q_idx = p.q_idx.ref();
    sp.k_idx = p.k_idx.ref();
    sp.block_idx = bi.ref();
    sp.opts = p.options();
    sp.opts.select_scores = scores;
    sp.opts.fp8_rerank = 0;
    expect_ok(msa::select_blocks(sp));
    const int want = scores == msa::SelectScores::kFp8 ? 0 : 1;
    for (int64_t t = 32; t < 48; ++t) {
      EXPECT_EQ(bi.idx(t, 0, 0), want) << "token " << t;
      EXPECT_EQ(bi.idx(t, 0, 1), 2) << "token " << t;
    }
  }
}

// The re-ranking tests' case: four sequences with partial last blocks (Bk 16, k 5, sink 1,
// local 1: three free slots), Hi 4 over Hik 2, one key with a large value (its block's scale).
Problem rerank_problem() {
  Config c = sel({300, 1, 77, 129}, 16, 5, 1, 1, 4, 2);
  c.dtype = DType::kBFloat16;
  Problem p(c);
  p.k_idx.set(40 * c.Hik * c.Di + 3, 9.5);
  return p;
}
}  // namespace

// Options.fp8_rerank = m > 0 (contract §2): the selection is the brute force of the rule (the
// free slots + m best candidates by the E4M3 copies' scores, then the slots by the inputs'),
// exactly, for m = 1, 4 and 7 on several sequences with partial last blocks; it changes rows
// against m = 0, holds more of kInput's selection, and with m covering every candidate equals it.
TEST(Selection, Fp8RerankFollowsTheRule) {
  Problem p = rerank_problem();
  const Config& c = p.cfg;
  const Problem q8 = fp8_scored(p);
  const Sets exact = ref_select(p);
  const auto run = [&](int m) { return sets_from(p, select_fp8(p, m)); };
  const auto missed = [&](const Sets& s) {
    int64_t n = 0;
    for (int64_t g = 0; g < p.T; ++g)
      for (int i = 0; i < c.Hi; ++i)
        for (int b : exact[g][i]) n += std::find(s[g][i].begin(), s[g][i].end(), b) == s[g][i].end();
    return n;
  };
  const Sets raw = run(0);
  for (int m : {1, 4, 7}) {
    const Sets got = run(m), want = ref_select_shortlist(p, q8, m);
    for (int64_t g = 0; g < p.T; ++g)
      for (int i = 0; i < c.Hi; ++i) ASSERT_EQ(got[g][i], want[g][i]) << "m " << m << " row " << g << " head " << i;
    EXPECT_NE(got, raw) << "m " << m;
    EXPECT_LT(missed(got), missed(raw)) << "m " << m;
  }
  EXPECT_GT(missed(raw), 0);
  EXPECT_EQ(run(20), exact);  // the longest sequence has 19 blocks
}

// e4m3_tie_problem re-ranked: both blocks are in the shortlist, and the inputs' own scores pick
// the higher one, as kInput does.
TEST(Selection, Fp8RerankBreaksWhatE4M3Ties) {
  Problem p = e4m3_tie_problem();
  const HostTensor bi = select_fp8(p, 1);
  for (int64_t t = 32; t < 48; ++t) {
    EXPECT_EQ(bi.idx(t, 0, 0), 1) << "token " << t;
    EXPECT_EQ(bi.idx(t, 0, 1), 2) << "token " << t;
  }
}

// The shortlist with exactly one candidate to spare (free slots + m + 1 candidates): m 1,
// e4m3_tie_problem(3), whose blocks 0, 1 and 2 tie in E4M3 while block 2 is the best by its
// inputs' own scores. The two shortlisted are blocks 0 and 1 (ties to the lower index), so
// tokens of block 3 take block 0, not block 2 as a selection without the shortlist would.
TEST(Selection, Fp8RerankShortlistWithOneCandidateToSpare) {
  Problem p = e4m3_tie_problem(3);
  const HostTensor bi = select_fp8(p, 1);
  for (int64_t t = 48; t < 64; ++t) {
    EXPECT_EQ(bi.idx(t, 0, 0), 0) << "token " << t;
    EXPECT_EQ(bi.idx(t, 0, 1), 3) << "token " << t;
  }
  EXPECT_EQ(sets_from(p, bi), ref_select_shortlist(p, fp8_scored(p), 1));
  EXPECT_EQ(ref_select(p)[48][0], (std::vector<int>{2, 3}));  // the inputs' own choice
}

// Options.fp8_rerank_slots = a (contract §2): the best (free - a) candidates by the E4M3 copies'
// scores are kept and the last a slots go to the best of the next a + m by the inputs' own
// scores: the brute force of that rule, exactly, for (a, m) in {1, 2, 4} x {1, 4}, on the
// sequences of Fp8RerankFollowsTheRule (free slots 3: a = 4 is the rule of fp8_rerank alone). It
// differs from the rule of fp8_rerank alone on some rows (a = 1), and every row holds its
// (free - a) best blocks by the copies' scores.
TEST(Selection, Fp8RerankSlotsFollowTheRule) {
  Problem p = rerank_problem();
  const Config& c = p.cfg;
  const Problem q8 = fp8_scored(p);
  for (int m : {1, 4}) {
    const Sets all = ref_select_shortlist(p, q8, m);
    for (int a : {1, 2, 4}) {
      const Sets got = sets_from(p, select_fp8(p, m, nullptr, a)), want = ref_select_shortlist(p, q8, m, a);
      for (int64_t g = 0; g < p.T; ++g)
        for (int i = 0; i < c.Hi; ++i)
          ASSERT_EQ(got[g][i], want[g][i]) << "m " << m << " a " << a << " row " << g << " head " << i;
      if (a == 1) EXPECT_NE(got, all) << "m " << m;  // two kept by FP8: some row differs
      if (a >= 3) EXPECT_EQ(got, all) << "m " << m << " a " << a;
      if (a >= 3) continue;
      Problem fewer = q8;  // the copies' own selection with a slots fewer: the FP8 order's best
      fewer.cfg.k -= a;
      const Sets kept = ref_select(fewer);
      for (int64_t g = 0; g < p.T; ++g)
        for (int i = 0; i < c.Hi; ++i)
          for (int b : kept[g][i])
            ASSERT_NE(std::find(got[g][i].begin(), got[g][i].end(), b), got[g][i].end())
                << "m " << m << " a " << a << " row " << g << " head " << i << " block " << b;
    }
  }
}

}  // namespace msatest
