// The selection of the paged indexer (docs/contract.md §2) from the block scores of
// paged_score_kernel: one CTA of 256 threads per (new token, index head) row.
//
// Forced blocks (sinks, the local blocks ending at the token's own block) are taken as they are;
// the other `slots` go to the best candidates [sink end, first local block), compared as
// order-preserving 32-bit keys, ties to the lower block id.
//
// Threshold pass (rows whose candidates lie in the first kTopkSmemKeys blocks, the decode case):
// each thread holds its strided share of the keys in registers (loaded first of all, while the
// token's position is looked up) and their max. The slots-th largest of the 256
// thread maxima, tau, has at least `slots` keys at or above it (each of those threads' maxima
// is one), so every key the row takes is >= tau. Those keys (usually a few dozen) are listed in
// shared memory and each is ranked among them by (key, then block id): the rank is its place in
// the whole row, and ranks below `slots` are taken. Where more than kTopkCandidates keys reach
// tau (scores tied over a long range), the radix pass below runs instead.
//
// Radix pass: the row's keys are staged in shared memory (up to kTopkSmemKeys candidates;
// longer rows are read from global memory, where the score kernel just left them in L2). The
// slots-th best key is found by a radix select: four 8-bit digits, each a shared histogram
// (equal digits of a warp are added by one lane: neighbouring blocks' scores share their top
// bits, and per-lane atomics on one bin would serialise) and a block scan. Every candidate above
// it is taken, and of those equal to it the lowest block ids (the contract's tie rule): all of
// them when exactly as many are needed (the last digit's histogram counts them; the usual case),
// in one pass strided over the candidates, else ranked by a block scan over contiguous per-thread
// ranges (whose shared-memory reads conflict: only for equal scores). The row is written in
// ascending block order, then -1 padding.
#pragma once

#include <cub/block/block_scan.cuh>

#include "../device/grid_dependency.cuh"
#include "../device/tile.cuh"

namespace msa::cuda::kern {

struct PagedTopkArgs {
  const int32_t* cu_q = nullptr;
  int32_t nseq = 0;
  int32_t Tq = 0;
  const int32_t* seq_lens = nullptr;
  int32_t cap = 0;  // max_pages * Bk
  int32_t block_size = 0, Hi = 0, k = 0, sink_blocks = 0, local_blocks = 1;
  const float* scores = nullptr;  // [(t - tok_lo) * Hi + i][max_pages]
  int32_t max_pages = 0;
  int64_t tok_lo = 0;
  int32_t* block_idx = nullptr;  // [Tq, Hi, k]
  int64_t bi_s0 = 0, bi_s1 = 0;
};

constexpr int kTopkThreads = 256;
constexpr int kTopkSmemKeys = 8192;
constexpr int kTopkPerThread = kTopkSmemKeys / kTopkThreads;  // keys a thread holds in the threshold pass
constexpr int kTopkCandidates = 1024;  // keys at or above the threshold the pass ranks

// Larger float, larger key; NaN ranks as -inf (contract §2).
__device__ inline uint32_t order_key(float x) {
  if (x != x) x = -INFINITY;
  const uint32_t u = __float_as_uint(x);
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

__global__ void __launch_bounds__(kTopkThreads) paged_topk_kernel(const __grid_constant__ PagedTopkArgs a) {
  grid_dependency_begin();
  using Scan = cub::BlockScan<int32_t, kTopkThreads>;
  __shared__ typename Scan::TempStorage scan_tmp;
  __shared__ int32_t hist[256];
  __shared__ int32_t chosen[256];  // the candidates taken (k <= 256), in no order
  __shared__ int32_t n_chosen;
  __shared__ uint32_t s_prefix;
  __shared__ int32_t s_need;
  __shared__ int32_t s_equal;  // candidates matching s_prefix (after the last digit: equal to it)
  __shared__ uint32_t keys[kTopkSmemKeys];  // the threshold pass: its listed (key, candidate) pairs
  __shared__ __align__(16) uint32_t thread_max[kTopkThreads];
  __shared__ uint32_t s_tau;
  __shared__ int32_t n_listed;

  const int64_t row = blockIdx.x;
  const int64_t t = a.tok_lo + row / a.Hi;
  const int32_t i = static_cast<int32_t>(row % a.Hi);
  const int tid = threadIdx.x;
  // The row's first kTopkSmemKeys scores, requested before the token's position is known (its
  // lookup is a chain of dependent loads); the threshold pass masks them to the candidates.
  const float* row_scores = a.scores + row * a.max_pages;
  float raw[kTopkPerThread];
#pragma unroll
  for (int j = 0; j < kTopkPerThread; ++j) {
    const int32_t b = tid + j * kTopkThreads;
    raw[j] = b < a.max_pages ? row_scores[b] : -INFINITY;
  }
  const int32_t pos = paged_position(a.cu_q, a.nseq, a.Tq, a.seq_lens, a.cap, t);
  const int32_t own = min(pos / a.block_size, a.max_pages - 1);
  const int32_t first_local = max(0, own - a.local_blocks + 1);
  const int32_t sink_end = min(a.sink_blocks, first_local);
  const int32_t slots = max(0, a.k - sink_end - (own - first_local + 1));
  const int32_t n = first_local - sink_end;  // candidates sink_end .. first_local - 1
  const float* sc = a.scores + row * a.max_pages + sink_end;
  const bool staged = n <= kTopkSmemKeys;
  auto key_at = [&](int32_t c) { return staged ? keys[c] : order_key(sc[c]); };
  // Contiguous ranges per thread (the tie ranks follow block order).
  const int32_t per = (n + kTopkThreads - 1) / kTopkThreads;
  const int32_t lo = min(n, tid * per), hi = min(n, lo + per);

  if (tid == 0) n_chosen = 0;
  bool radix = false;
  if (n <= slots) {  // every candidate is taken
    __syncthreads();
    for (int32_t c = tid; c < n; c += kTopkThreads) chosen[c] = sink_end + c;
    if (tid == 0) n_chosen = n;
  } else if (slots > 0 && first_local > kTopkSmemKeys) {  // candidates past the held scores
    radix = true;
  } else if (slots > 0) {
    // Threshold pass over the held scores of blocks b = tid + 256 j. Key 0 is below every
    // candidate's (order_key(-inf) > 0): "no key".
    uint32_t held[kTopkPerThread];
    uint32_t mx = 0;
#pragma unroll
    for (int j = 0; j < kTopkPerThread; ++j) {
      const int32_t b = tid + j * kTopkThreads;
      held[j] = b >= sink_end && b < first_local ? order_key(raw[j]) : 0u;
      mx = max(mx, held[j]);
    }
    thread_max[tid] = mx;
    if (tid == 0) n_listed = 0;
    __syncthreads();
    // This thread's max ranked among the maxima (ties by thread): rank slots - 1 is tau. At
    // least min(n, 256) > slots - 1 threads hold a key, so tau is a candidate's key.
    // Four maxima per shared read, eight reads in flight: the loop is the pass's longest chain.
    int32_t rank = 0;
#pragma unroll 8
    for (int u = 0; u < kTopkThreads; u += 4) {
      const uint4 v = *reinterpret_cast<const uint4*>(&thread_max[u]);
      rank += (v.x > mx || (v.x == mx && u < tid)) + (v.y > mx || (v.y == mx && u + 1 < tid)) +
              (v.z > mx || (v.z == mx && u + 2 < tid)) + (v.w > mx || (v.w == mx && u + 3 < tid));
    }
    if (rank == slots - 1) s_tau = mx;
    __syncthreads();
    const uint32_t tau = s_tau;
    uint32_t* list_key = keys;
    int32_t* list_c = reinterpret_cast<int32_t*>(keys + kTopkCandidates);
#pragma unroll
    for (int j = 0; j < kTopkPerThread; ++j) {
      if (held[j] >= tau) {  // tau > 0: never a missing key
        const int32_t x = atomicAdd(&n_listed, 1);
        if (x < kTopkCandidates) {
          list_key[x] = held[j];
          list_c[x] = tid + j * kTopkThreads - sink_end;
        }
      }
    }
    __syncthreads();
    const int32_t listed = n_listed;
    if (listed > kTopkCandidates) {
      radix = true;
      __syncthreads();  // the list is read no more: the radix pass stages keys over it
    } else {
      for (int32_t x = tid; x < listed; x += kTopkThreads) {
        const uint32_t key = list_key[x];
        const int32_t c = list_c[x];
        int32_t r = 0;
#pragma unroll 4
        for (int32_t y = 0; y < listed; ++y) {
          const uint32_t o = list_key[y];
          r += o > key || (o == key && list_c[y] < c);
        }
        if (r < slots) chosen[r] = sink_end + c;
      }
      if (tid == 0) n_chosen = slots;
    }
  }
  if (radix) {
    if (staged)
      for (int32_t c = tid; c < n; c += kTopkThreads) keys[c] = order_key(sc[c]);
    uint32_t prefix = 0, mask = 0;
    int32_t need = slots;  // how many of the keys matching `prefix` are still to take
    const int lane = tid % 32;
    for (int shift = 24; shift >= 0; shift -= 8) {
      hist[tid] = 0;
      __syncthreads();
      // Strided over the candidates, every lane of a warp in every round (256: no digit).
      for (int32_t c0 = 0; c0 < n; c0 += kTopkThreads) {
        const int32_t c = c0 + tid;
        uint32_t digit = 256;
        if (c < n) {
          const uint32_t key = key_at(c);
          if ((key & mask) == prefix) digit = (key >> shift) & 255;
        }
        const uint32_t same = __match_any_sync(0xffffffffu, digit);
        if (digit < 256 && lane == __ffs(same) - 1) atomicAdd(&hist[digit], __popc(same));
      }
      __syncthreads();
      // Thread d holds digit 255 - d: an inclusive scan counts the keys at that digit or above.
      const int32_t count = hist[255 - tid];
      int32_t above_incl = 0;
      Scan(scan_tmp).InclusiveSum(count, above_incl);
      const int32_t above = above_incl - count;
      if (above < need && need <= above_incl) {
        s_prefix = prefix | (uint32_t(255 - tid) << shift);
        s_need = need - above;
        s_equal = count;
      }
      __syncthreads();
      prefix = s_prefix;
      need = s_need;
      mask |= 255u << shift;
    }
    // Above the threshold key: taken. Equal to it: all when `need` are equal, else the `need`
    // lowest block ids.
    const bool all_equal = s_equal == need;
    for (int32_t c = tid; c < n; c += kTopkThreads) {
      const uint32_t key = key_at(c);
      if (key > prefix || (all_equal && key == prefix)) chosen[atomicAdd(&n_chosen, 1)] = sink_end + c;
    }
    if (!all_equal) {
      int32_t ties = 0;
      for (int32_t c = lo; c < hi; ++c) ties += key_at(c) == prefix;
      int32_t rank = 0;
      Scan(scan_tmp).ExclusiveSum(ties, rank);
      for (int32_t c = lo; c < hi && rank < need; ++c)
        if (key_at(c) == prefix) {
          chosen[atomicAdd(&n_chosen, 1)] = sink_end + c;
          ++rank;
        }
    }
  }
  __syncthreads();

  // Ascending: sinks, the chosen candidates (all in [sink_end, first_local)), the local blocks.
  int32_t* out = a.block_idx + t * a.bi_s0 + int64_t(i) * a.bi_s1;
  const int32_t m = n_chosen;
  if (tid < m) {
    const int32_t v = chosen[tid];
    int32_t r = 0;
#pragma unroll 4
    for (int32_t c = 0; c < m; ++c) r += chosen[c] < v;
    out[sink_end + r] = v;
  }
  const int32_t nlocal = own - first_local + 1;
  for (int32_t c = tid; c < a.k; c += kTopkThreads) {
    if (c < sink_end) out[c] = c;
    else if (c >= sink_end + m && c < sink_end + m + nlocal) out[c] = first_local + (c - sink_end - m);
    else if (c >= sink_end + m + nlocal) out[c] = -1;
  }
}

}  // namespace msa::cuda::kern
