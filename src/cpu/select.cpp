// CPU index selection (docs/contract.md §2), literally: token scores, per-block maxima over causal keys,
// forced blocks, then the best remaining blocks by score (ties to the lower block index); the
// row itself is select_row (common.h), shared with the serving selection. FP8 scores: the
// dequantised E4M3 copies rank, and with fp8_rerank > 0 the inputs' own scores rank the
// shortlist again.
#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>

#include "backend.h"
#include "common.h"
#include "parallel.h"

namespace msa::cpu {
namespace {

// Contract §2, FP8 scores: the scale of a group whose largest |x| (NaN ignored) is amax, and a
// value's dequantised E4M3 copy under it (one fp32 product, then nearest-even E4M3, saturated).
float fp8_scale(float amax) { return amax > 0.f && std::isfinite(amax) ? 16.f / amax : 1.f; }
double fp8_value(float x, float s) {
  const float y = x * s;
  return to_double(e4m3_from_double(static_cast<double>(y))) / static_cast<double>(s);
}

// The dequantised E4M3 copies of q_idx (a group per row) and k_idx (a group per block of one
// sequence and index key head), packed [T, H, Di] in double.
template <class E>
void fp8_copies(const Problem& prob, const Layout& layout, const Rows<const E>& q_idx,
                const Rows<const E>& k_idx, std::vector<double>* q8, std::vector<double>* k8) {
  const int32_t Di = prob.Di, Bk = prob.opts.block_size;
  q8->resize(static_cast<size_t>(prob.T) * prob.Hi * Di);
  k8->resize(static_cast<size_t>(prob.T) * prob.Hik * Di);
  const auto amax_of = [&](float a, const E* row) {
    for (int32_t d = 0; d < Di; ++d) {
      const float x = std::fabs(static_cast<float>(to_double(row[d])));
      if (x > a) a = x;  // NaN never compares greater
    }
    return a;
  };
  const auto quantise = [&](const E* row, float s, double* out) {
    for (int32_t d = 0; d < Di; ++d) out[d] = fp8_value(static_cast<float>(to_double(row[d])), s);
  };
  parallel_for(prob.T, [&](int64_t g, int) {
    for (int32_t i = 0; i < prob.Hi; ++i) {
      const E* row = q_idx.row(g, i);
      quantise(row, fp8_scale(amax_of(0.f, row)), q8->data() + (g * prob.Hi + i) * Di);
    }
  });
  parallel_for(layout.num_blocks(), [&](int64_t gb, int) {
    const int32_t s = layout.seq_of_block[gb];
    const int64_t j0 = layout.cu[s] + (gb - layout.block_base[s]) * Bk;
    const int64_t j1 = std::min<int64_t>(j0 + Bk, layout.cu[s + 1]);
    for (int32_t ik = 0; ik < prob.Hik; ++ik) {
      float amax = 0.f;
      for (int64_t j = j0; j < j1; ++j) amax = amax_of(amax, k_idx.row(j, ik));
      const float sc = fp8_scale(amax);
      for (int64_t j = j0; j < j1; ++j) quantise(k_idx.row(j, ik), sc, k8->data() + (j * prob.Hik + ik) * Di);
    }
  });
}

template <class E>
void select_impl(const Problem& prob, const TensorRef& q_idx_t, const TensorRef& k_idx_t,
                 const TensorRef& block_idx_t, const TensorRef& lse_idx_t) {
  const Layout layout(prob);
  const Rows<const E> q_idx = rows<const E>(q_idx_t);
  const Rows<const E> k_idx = rows<const E>(k_idx_t);
  int32_t* bi = static_cast<int32_t*>(block_idx_t.data);
  const Mat lse_idx = lse_idx_t.defined() ? mat(lse_idx_t) : Mat{};
  const double scale_idx = prob.opts.scale_idx;
  const bool fp8 = prob.opts.select_scores == SelectScores::kFp8;
  std::vector<double> q8, k8;
  if (fp8) fp8_copies(prob, layout, q_idx, k_idx, &q8, &k8);

  parallel_for(prob.T, [&](int64_t g, int) {
    thread_local std::vector<double> score, block_max, score8, block_max8;
    thread_local std::vector<int32_t> chosen;
    const int64_t s = layout.seq_of[g], base = layout.cu[s], t = g - base;
    for (int32_t i = 0; i < prob.Hi; ++i) {
      const int32_t ik = i / prob.idx_per_key();
      const auto key_row = [&](int64_t j) { return k_idx.row(base + j, ik); };
      int32_t* out = bi + g * block_idx_t.stride[0] + i * block_idx_t.stride[1];
      float* lse = lse_idx.base ? &lse_idx.at(g, i) : nullptr;
      if (!fp8) {
        select_row(prob.opts, prob.k, prob.Di, scale_idx, q_idx.row(g, i), t, key_row, out,
                   block_idx_t.stride[2], lse);
        continue;
      }
      // FP8 scores rank (shortlist, with fp8_rerank > 0); the inputs' own scores re-rank the
      // shortlist and give lse_idx.
      const int32_t Bk = prob.opts.block_size, m = prob.opts.fp8_rerank;
      block_maxima(prob.Di, Bk, scale_idx, q8.data() + (g * prob.Hi + i) * prob.Di, t,
                   [&](int64_t j) { return k8.data() + ((base + j) * prob.Hik + ik) * prob.Di; }, &score8,
                   &block_max8);
      if (m > 0 || lse) block_maxima(prob.Di, Bk, scale_idx, q_idx.row(g, i), t, key_row, &score, &block_max);
      choose_blocks(prob.opts, prob.k, t, block_max8, m > 0 ? &block_max : nullptr, m, &chosen);
      write_row(chosen, prob.k, out, block_idx_t.stride[2]);
      if (lse) *lse = static_cast<float>(support_logsumexp(score, chosen, t, Bk));
    }
  });
}

template <class E>
struct SelectFn {
  static void run(const Problem& prob, const TensorRef& q_idx, const TensorRef& k_idx,
                  const TensorRef& block_idx, const TensorRef& lse_idx) {
    select_impl<E>(prob, q_idx, k_idx, block_idx, lse_idx);
  }
};

}  // namespace

Status select_blocks(const Problem& prob, const TensorRef& q_idx, const TensorRef& k_idx,
                     const TensorRef& block_idx, const TensorRef& lse_idx) {
  return dispatch<SelectFn>(prob.dtype, prob, q_idx, k_idx, block_idx, lse_idx);
}

}  // namespace msa::cpu
