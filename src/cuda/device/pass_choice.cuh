// The split of the sparse forward (Options.fwd_pass = kSplit) and kAuto's choice of it.
//
// Split: a query tile (fwd_kernel.cuh) computes the blocks that at least share_min of its tokens
// selected, over its rows as in the plain query-tile pass, and writes the result as one partial
// output per (token, head); the KV-block pass (fwd_kv_kernel.cuh) computes every other selected
// (token, block) and the combine adds them all. A block a tile visits costs the tile's rows
// whatever number of its tokens selected it; a (token, block) the KV-block pass computes costs
// about kKvCost times that token's rows (its partial output is written and read back), measured on
// the H200 at 128K tokens, paper and flash-msa heads: the KV-block pass takes 2.0-2.1x the
// query-tile pass's time on selections whose neighbours agree (docs/perf.md, 2026-11-30,
// KV-block forward v2). So a block stays with the tile where members * kKvCost >= tile tokens.
//
// kAuto: pass_choice_kernel (kernels/pass_choice_kernel.cuh) sums over the query tiles
//   sums[0]: the plain query-tile pass's cost: per tile and index head, the union of its
//            tokens' selected blocks times the tile's tokens (x kKvCostDen);
//   sums[1]: the split's cost: the blocks kept by the tile times its tokens (x kKvCostDen), plus
//            the other selected (token, block) pairs x kKvCostNum, plus kKvItemCost per (KV
//            block, KV head) work item the KV-block pass gets (its block's K and V loaded, its
//            entries' last one part full: what the pairs' term misses where few tokens share
//            a block, as in a prefill of a few thousand tokens after a 1M-token prefix);
// every kernel of both is launched, and each returns at once where the rule picks the other
// (no host sync).
#pragma once

#include <cstdint>

namespace msa::cuda::kern {

constexpr unsigned long long kKvCostNum = 21, kKvCostDen = 10;  // kKvCost = 2.1
// A work item's cost in the same units (a tile's token visiting a block: kKvCostDen), set on the
// H200 from the times of both walks over prefills of 1K to 32K new tokens after 128K and 1M
// cached ones (docs/perf.md, 2026-12-04): the split's time fits 0.25 ns a unit of its sum plus
// 0.12 us an item, the query tiles' 0.2 ns a unit, and every value from 650 to 780 makes kAuto
// take the faster walk on all ten (0.35 us an item, 1770, on 2026-12-02, before a KV-side CTA
// found its work in two loads). Where a short chunk's tokens share few blocks the items outweigh
// the pairs and kAuto takes the query tiles; training shapes give an item hundreds of pairs, so
// the term moves their sums by a few percent.
constexpr unsigned long long kKvItemCost = 700;

// The fewest of a tile's `tile_tokens` tokens that keep a block with the tile.
__host__ __device__ constexpr int32_t share_min(int32_t tile_tokens) {
  return static_cast<int32_t>((uint64_t(tile_tokens) * kKvCostDen + kKvCostNum - 1) / kKvCostNum);
}

// Whether kAuto runs the split (its sums at least 10% below the plain query tile's: the split
// also sorts its pairs and combines its partials).
__device__ __forceinline__ bool split_chosen(const unsigned long long* sums) {
  return sums[1] * 10 < sums[0] * 9;
}

}  // namespace msa::cuda::kern
