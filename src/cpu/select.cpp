// CPU index selection (docs/contract.md §2), literally: token scores, per-block maxima over causal keys,
// forced blocks, then the best remaining blocks by score (ties to the lower block index); the
// row itself is select_row (common.h), shared with the serving selection.
#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>

#include "backend.h"
#include "common.h"
#include "parallel.h"

namespace msa::cpu {
namespace {

template <class E>
void select_impl(const Problem& prob, const TensorRef& q_idx_t, const TensorRef& k_idx_t,
                 const TensorRef& block_idx_t, const TensorRef& lse_idx_t) {
  const Layout layout(prob);
  const Rows<const E> q_idx = rows<const E>(q_idx_t);
  const Rows<const E> k_idx = rows<const E>(k_idx_t);
  int32_t* bi = static_cast<int32_t*>(block_idx_t.data);
  const Mat lse_idx = lse_idx_t.defined() ? mat(lse_idx_t) : Mat{};
  const double scale_idx = prob.opts.scale_idx;

  parallel_for(prob.T, [&](int64_t g, int) {
    const int64_t s = layout.seq_of[g], base = layout.cu[s], t = g - base;
    for (int32_t i = 0; i < prob.Hi; ++i) {
      const int32_t ik = i / prob.idx_per_key();
      select_row(prob.opts, prob.k, prob.Di, scale_idx, q_idx.row(g, i), t,
                 [&](int64_t j) { return k_idx.row(base + j, ik); },
                 bi + g * block_idx_t.stride[0] + i * block_idx_t.stride[1], block_idx_t.stride[2],
                 lse_idx.base ? &lse_idx.at(g, i) : nullptr);
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
