// The re-ranking's list and pick kernels (rerank_kernel.cuh says what they do), launched by
// host/rerank.cu, the one source that includes this header.
#pragma once

#include <cstdint>

#include "../device/grid_dependency.cuh"
#include "../host/args.h"

namespace msa::cuda::kern {

// The shortlist entries (row * width + c, c a column of the row's shortlist) by bucket, for the
// count and the scatter below. A bucket is a segment's entries from one range of tokens
// (seg * ranges + range): a block most tokens pick would otherwise take every token's atomic on
// one counter. A warp takes one column c of one index head for 32 consecutive tokens:
// neighbouring tokens shortlist alike, so the lanes that share a bucket (`same`, by
// __match_any_sync) act with one atomic instead of one each. f(bucket, same, entry) runs for the
// lanes with an entry (kept blocks have none).
template <class F>
__device__ __forceinline__ void for_each_entry(const SelectArgs& a, F&& f) {
  const RerankArgs& r = a.rerank;
  const int32_t Hi = a.Hik * a.idx_per_key, W = r.width;
  const int lane = threadIdx.x & 31;
  const int64_t tasks = (int64_t(a.T) + 31) / 32 * Hi * W;
  for (int64_t task = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) / 32; task < tasks;
       task += (int64_t(gridDim.x) * blockDim.x) / 32) {
    const int32_t c = static_cast<int32_t>(task % W);
    const int32_t h = static_cast<int32_t>(task / W % Hi);
    const int64_t t = task / (int64_t(W) * Hi) * 32 + lane;
    const int64_t row = t * Hi + h;
    const int32_t listed = t < a.T ? r.cand[row * W + c] : -1;
    const int32_t b = listed & kRerankKept ? -1 : listed;  // a kept block is not scored again
    // Lanes past the last token read nothing (rows[] ends with the tokens).
    const int64_t bucket =
        b >= 0 ? (int64_t(r.rows[row].x + b) * a.Hik + h / a.idx_per_key) * r.ranges + (t >> r.range_shift) : -1;
    const unsigned same = __match_any_sync(0xffffffffu, bucket);
    if (b >= 0) f(bucket, same, static_cast<int32_t>(row * W + c));
  }
}

// seg_count[bucket] = the bucket's entries (zeroed before).
__global__ void __launch_bounds__(256) rerank_count_kernel(const __grid_constant__ SelectArgs a) {
  grid_dependency_begin();
  for_each_entry(a, [&](int64_t bucket, unsigned same, int32_t) {
    if ((threadIdx.x & 31) == __ffs(same) - 1) atomicAdd(&a.rerank.seg_count[bucket], __popc(same));
  });
}

// Each entry into its segment's list (its bucket's part of it): the bucket's count counted down.
__global__ void __launch_bounds__(256) rerank_scatter_kernel(const __grid_constant__ SelectArgs a) {
  grid_dependency_begin();
  const int lane = threadIdx.x & 31;
  for_each_entry(a, [&](int64_t bucket, unsigned same, int32_t entry) {
    const int leader = __ffs(same) - 1, n = __popc(same);
    int32_t top = 0;
    if (lane == leader) top = atomicSub(&a.rerank.seg_count[bucket], n);  // places [top - n, top) are ours
    top = __shfl_sync(same, top, leader);
    const int32_t rank = __popc(same & ((1u << lane) - 1));
    a.rerank.entries[a.rerank.seg_start[bucket] + top - n + rank] = entry;
  });
}

// chunk_start[s] = the chunks of segment s (kRerankChunk entries each; seg_start scanned), before
// their scan; 0 at nseg.
__global__ void __launch_bounds__(256) rerank_chunks_kernel(const __grid_constant__ SelectArgs a) {
  grid_dependency_begin();
  const RerankArgs& r = a.rerank;
  for (int64_t s = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; s <= r.nseg; s += int64_t(gridDim.x) * blockDim.x)
    r.chunk_start[s] = s < r.nseg ? (r.seg_start[(s + 1) * r.ranges] - r.seg_start[s * r.ranges] + kRerankChunk - 1) / kRerankChunk : 0;
}

// One thread per (token, index head) row: the free slots from the shortlist, its kept blocks
// first, the others by the inputs' scores.
__global__ void __launch_bounds__(256) rerank_pick_kernel(const __grid_constant__ SelectArgs a) {
  grid_dependency_begin();
  const RerankArgs& r = a.rerank;
  const int32_t Hi = a.Hik * a.idx_per_key;
  const int64_t row = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (row >= int64_t(a.T) * Hi) return;
  const int32_t place = r.rows[row].y, n_sink = place & 0xffff, chosen = place >> 16;
  if (chosen == 0) return;
  const int32_t* cand = r.cand + row * r.width;
  const float* score = r.score + row * r.width;
  // Taken columns as bits of two words (width <= 128; no indexed array, which would live in
  // local memory); the shortlist is ascending, so a lower column is a lower block and wins a tie.
  uint64_t taken_lo = 0, taken_hi = 0;
  const auto is_taken = [&](int c) { return ((c < 64 ? taken_lo : taken_hi) >> (c & 63)) & 1u; };
  const auto take = [&](int c) {
    if (c < 64) taken_lo |= uint64_t(1) << c; else taken_hi |= uint64_t(1) << (c - 64);
  };
  int32_t n = 0, kept = 0;
  for (; n < r.width && cand[n] >= 0; ++n)
    if (cand[n] & kRerankKept) {
      take(n);
      ++kept;
    }
  for (int j = kept; j < chosen; ++j) {
    int best = -1;
    float best_score = 0.f;
    for (int c = 0; c < n; ++c) {
      if (is_taken(c)) continue;
      const float sc = score[c];
      if (best < 0 || sc > best_score) {
        best = c;
        best_score = sc;
      }
    }
    take(best);
  }
  int32_t* out = a.block_idx + (row / Hi) * a.bi_s0 + (row % Hi) * a.bi_s1 + n_sink;
  int32_t w = 0;
  for (int c = 0; c < n; ++c)
    if (is_taken(c)) out[w++] = cand[c] & ~kRerankKept;
}

}  // namespace msa::cuda::kern
