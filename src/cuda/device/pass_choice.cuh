// Options.fwd_pass = kAuto: the sparse forward's pass chosen on the device from the selection
// itself, with no host sync. pass_choice_kernel (kernels/fwd_kv_kernel.cuh) sums
//   sums[0]: the (token, block) pairs the query-tile pass computes: per query tile and index
//            head, the union of its tokens' selected blocks times the tile's tokens;
//   sums[1]: the (token, block) pairs selected (per token and index head, its valid entries);
// both passes are launched, and each kernel returns at once where the rule picks the other.
// The query-tile pass's cost follows sums[0]; the KV-block pass's follows sums[1] times about
// kKvCost (its partial outputs are written and read back): measured on the H200 at 128K tokens,
// paper and flash-msa heads, the KV-block pass takes 2.0-2.1x the query-tile pass's time on
// selections whose neighbours agree (docs/perf.md, 2026-11-30, KV-block forward v2).
#pragma once

namespace msa::cuda::kern {

constexpr unsigned long long kKvCostNum = 21, kKvCostDen = 10;  // kKvCost = 2.1

__device__ __forceinline__ bool kv_pass_chosen(const unsigned long long* sums) {
  return sums[0] * kKvCostDen > sums[1] * kKvCostNum;
}

}  // namespace msa::cuda::kern
