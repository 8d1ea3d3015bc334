// FLOP model of msa_main's table: only the work on the selected support is counted, in the spirit
// of the paper's Eq. 12 (research/paper.md §4.1), but with the causal keys each row actually
// attends to instead of a flat k*Bk per token. One multiply-add is 2 FLOPs; exp/log/max are not
// counted.
//
//   selection            2*Hi*Di*P                  the index score GEMM over the causal pairs,
//                                                   P = sum over sequences of L(L+1)/2
//   forward (main)       4*D*Nh                     QK^T and PV, Nh = sum over (t, h) of |T_h(t)|
//   backward (main)      2.5 * forward (main)       = 10*D*Nh: recompute QK^T, dV, dP, dQ, dK
//   forward KL value     2*D*Nh + 2*Di*Ni           teacher logits of every query head and the index
//                                                   logits on the support, Ni = sum over (t, i) of
//                                                   |T_i(t)|
//   backward KL part     2*D*Nh + 6*Di*Ni           teacher logits again, index logits, dq_idx and
//                                                   dk_idx: the flash-msa repo's KL kernel count
//                                                   2*(D*Hq + 3*Di*Hi) per support element
//
// Sparse rows count |T| from the block_idx the selection returned (causal keys of the selected
// blocks). The warmup and dense rows use the full causal support (|T(t)| = t + 1); dense has no
// KL terms, so the "ideal speedup" of the sparse step includes the cost of training the indexer.
#pragma once

#include <algorithm>
#include <cstdint>

#include "host_tensor.h"
#include "workload.h"

namespace msa_app {

struct SupportSize {
  double nh = 0;  // sum over (t, query head h) of |T_h(t)|
  double ni = 0;  // sum over (t, index head i) of |T_i(t)|
};

inline double causal_pairs(const Shape& s) {
  double p = 0;
  for (int64_t len : s.seqlens) p += 0.5 * static_cast<double>(len) * static_cast<double>(len + 1);
  return p;
}

inline SupportSize dense_support(const Shape& s) {
  const double p = causal_pairs(s);
  return {s.Hq * p, s.Hi * p};
}

// Causal keys of the blocks in each returned block_idx row (entries out of range are ignored
// here; the reference check reports them).
inline SupportSize sparse_support(const Shape& s, const HostTensor& block_idx) {
  double ni = 0;
  const int32_t* bi = block_idx.i32();
  for (int64_t g = 0; g < s.T; ++g) {
    const int64_t t = g - s.base_of(g), own = t / s.Bk;
    for (int32_t i = 0; i < s.Hi; ++i)
      for (int32_t x = 0; x < s.k; ++x) {
        const int64_t b = bi[(g * s.Hi + i) * s.k + x];
        if (b >= 0 && b <= own) ni += static_cast<double>(std::min<int64_t>((b + 1) * s.Bk, t + 1) - b * s.Bk);
      }
  }
  return {ni * s.heads_per_idx(), ni};
}

inline double select_flops(const Shape& s) { return 2.0 * s.Hi * s.Di * causal_pairs(s); }

inline double forward_flops(const Shape& s, const SupportSize& n, bool with_kl) {
  const double main = 4.0 * s.D * n.nh;
  return main + (with_kl ? 2.0 * s.D * n.nh + 2.0 * s.Di * n.ni : 0.0);
}

inline double backward_flops(const Shape& s, const SupportSize& n, bool with_kl) {
  const double main = 2.5 * 4.0 * s.D * n.nh;
  return main + (with_kl ? 2.0 * s.D * n.nh + 6.0 * s.Di * n.ni : 0.0);
}

}  // namespace msa_app
