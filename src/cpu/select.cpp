// CPU index selection (docs/contract.md §2), literally: token scores, per-block maxima over causal keys,
// forced blocks, then the best remaining blocks by score (ties to the lower block index).
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
  const Options& o = prob.opts;
  const int32_t Bk = o.block_size, Di = prob.Di, k = prob.k;
  const double scale_idx = o.scale_idx;
  const double neg_inf = -std::numeric_limits<double>::infinity();

  parallel_for(prob.T, [&](int64_t g, int) {
    thread_local std::vector<double> q, score, block_max, support;
    thread_local std::vector<int32_t> forced, cand, chosen;
    const int64_t s = layout.seq_of[g], base = layout.cu[s], t = g - base;
    const int32_t own = static_cast<int32_t>(t / Bk);
    q.resize(Di);
    score.resize(t + 1);
    block_max.resize(own + 1);
    for (int32_t i = 0; i < prob.Hi; ++i) {
      const int32_t ik = i / prob.idx_per_key();
      load(q_idx.row(g, i), Di, q.data());
      for (int64_t j = 0; j <= t; ++j) score[j] = scale_idx * dot(q.data(), k_idx.row(base + j, ik), Di);
      // M(t, b): max over the block's causal keys; NaN ranks as -inf.
      for (int32_t b = 0; b <= own; ++b) {
        double m = neg_inf;
        const int64_t end = std::min<int64_t>(static_cast<int64_t>(b + 1) * Bk, t + 1);
        for (int64_t j = static_cast<int64_t>(b) * Bk; j < end; ++j)
          if (!std::isnan(score[j])) m = std::max(m, score[j]);
        block_max[b] = m;
      }
      // Forced: the last `local_blocks` blocks up to the own block, and the first `sink_blocks`.
      forced.clear();
      const int32_t first_local = std::max(0, own - o.local_blocks + 1);
      for (int32_t b = 0; b < std::min(o.sink_blocks, first_local); ++b) forced.push_back(b);
      for (int32_t b = first_local; b <= own; ++b) forced.push_back(b);
      // Candidates: every other block before the own block.
      cand.clear();
      for (int32_t b = 0; b < own; ++b)
        if (std::find(forced.begin(), forced.end(), b) == forced.end()) cand.push_back(b);
      const size_t slots = static_cast<size_t>(k) - forced.size();
      const auto better = [&](int32_t a, int32_t b) {
        return block_max[a] > block_max[b] || (block_max[a] == block_max[b] && a < b);
      };
      if (cand.size() > slots) {
        std::partial_sort(cand.begin(), cand.begin() + slots, cand.end(), better);
        cand.resize(slots);
      }
      chosen = forced;
      chosen.insert(chosen.end(), cand.begin(), cand.end());
      std::sort(chosen.begin(), chosen.end());
      int32_t* out = bi + g * block_idx_t.stride[0] + i * block_idx_t.stride[1];
      for (int32_t j = 0; j < k; ++j)
        out[j * block_idx_t.stride[2]] = j < static_cast<int32_t>(chosen.size()) ? chosen[j] : -1;
      if (lse_idx.base) {
        support.clear();
        for (int32_t b : chosen) {
          const int64_t end = std::min<int64_t>(static_cast<int64_t>(b + 1) * Bk, t + 1);
          for (int64_t j = static_cast<int64_t>(b) * Bk; j < end; ++j) support.push_back(score[j]);
        }
        lse_idx.at(g, i) = static_cast<float>(logsumexp(support.data(), support.size()));
      }
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
