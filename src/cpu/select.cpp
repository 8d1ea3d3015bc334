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

// The dequantised E4M3 copies of q_idx (a group per row) and k_idx (a group per block of one
// sequence and index key head), packed [T, Hi, Di] and [Tk, Hik, Di] in double.
template <class E>
void fp8_copies(const Problem& prob, const Layout& layout, const Rows<const E>& q_idx,
                const Rows<const E>& k_idx, std::vector<double>* q8, std::vector<double>* k8) {
  const int32_t Di = prob.Di, Bk = prob.opts.block_size;
  fp8_copy_queries(prob, q_idx, q8);
  k8->resize(static_cast<size_t>(prob.Tk) * prob.Hik * Di);
  parallel_for(layout.num_blocks(), [&](int64_t gb, int) {
    const int32_t s = layout.seq_of_block[gb];
    const int64_t j0 = layout.cu_k[s] + (gb - layout.block_base[s]) * Bk;
    const int64_t j1 = std::min<int64_t>(j0 + Bk, layout.cu_k[s + 1]);
    for (int32_t ik = 0; ik < prob.Hik; ++ik)
      fp8_copy_block(Di, j0, j1 - j0, [&](int64_t j) { return k_idx.row(j, ik); },
                     k8->data() + (j0 * prob.Hik + ik) * Di, int64_t(prob.Hik) * Di);
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
    const int64_t s = layout.seq_of[g], base = layout.cu_k[s], t = layout.pos(g);
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
      select_row_fp8(prob.opts, prob.k, prob.Di, scale_idx, q8.data() + (g * prob.Hi + i) * prob.Di, q_idx.row(g, i),
                     t, key_row, [&](int64_t j) { return k8.data() + ((base + j) * prob.Hik + ik) * prob.Di; }, out,
                     block_idx_t.stride[2], lse);
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
