// Pieces shared by the KV-side backward kernels (bwd_kv_kernel.cuh, kl_kernel.cuh): the list of
// query groups that selected a KV block, and cp.async loads of row tiles.
//
// A KV-side work item is one KV block (Bk keys of one sequence) of one KV head r. Its work is a
// list of entries (index head i of r, query group g): a group is m = min(64 / Gi, 16) consecutive
// tokens of the sequence, and the entry's 64 columns are (token, head) pairs of those tokens and of i's Gi query
// heads (column = token * Gi + head). `mask` bit t says that token t of the group selected the
// block. Sparse mode reads the entries from the reverse index (bwd_aux.cuh): keys sorted by
// (KV tile, r, i, g), one per distinct entry, with the OR of the selecting tokens' bits. Dense
// (warmup) mode enumerates every group at or after the block, all bits set.
//
// Lists are uneven (a sink block is selected by every token; in dense mode the first block by
// all), so an item's list is cut into chunks of at most `chunk` entries and each chunk is one
// CTA. The chunks are laid out by an exclusive scan of the per-item chunk counts (WorkList).
#pragma once

#include <cute/tensor.hpp>

#include <cstdint>

#include "tile.cuh"

namespace msa::cuda::kern {

// Fixed-point sums across CTAs: one unit is 2^-32; integer atomics make them order-independent.
constexpr double kFixedOne = 4294967296.0;

__device__ __forceinline__ void add_fixed(unsigned long long* dst, float v) {
  atomicAdd(dst, static_cast<unsigned long long>(__double2ll_rn(static_cast<double>(v) * kFixedOne)));
}

// 16-byte cp.async with zero fill: copies 16 bytes when `pred`, else writes 16 zero bytes.
__device__ __forceinline__ void cp_async16(void* smem, const void* gmem, bool pred) {
  const uint32_t s = cute::cast_smem_ptr_to_uint(smem);
  const int n = pred ? 16 : 0;
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(s), "l"(gmem), "r"(n));
}
// 4-byte cp.async with zero fill.
__device__ __forceinline__ void cp_async4(void* smem, const void* gmem, bool pred) {
  const uint32_t s = cute::cast_smem_ptr_to_uint(smem);
  const int n = pred ? 4 : 0;
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(s), "l"(gmem), "r"(n));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
__device__ __forceinline__ void cp_async_wait_all() {
  asm volatile("cp.async.wait_group 0;\n" ::: "memory");
}
// Waits until at most N of this thread's cp.async groups are pending.
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

// Rows [0, kRowsTile) of a swizzled shared tile from global rows: row_ptr(row) gives the row's
// first element, or nullptr for a zero row. kDim elements per row, 16 bytes per copy.
template <int kRowsTile, int kDim, class SmemTensor, class RowPtr>
__device__ inline void load_rows_async(SmemTensor&& s, RowPtr row_ptr, int tid, int nthreads) {
  constexpr int kChunks = kDim / 8;
  for (int e = tid; e < kRowsTile * kChunks; e += nthreads) {
    const int row = e / kChunks, c = e % kChunks;
    const auto* src = row_ptr(row);
    cp_async16(&s(row, c * 8), src != nullptr ? src + c * 8 : nullptr, src != nullptr);
  }
}

// The 64 (token, head) columns of an entry as a [64, kDim] row tile (column c = token * Gi +
// head), loaded by kThreads threads with cp.async. What does not change from entry to entry (each
// thread's rows, their token and head, their shared-memory offsets) is worked out once, so that
// an entry costs each thread a few multiply-adds per 16-byte copy.
template <int kDim, int kThreads>
struct ColumnLoader {
  static constexpr int kRows = 64;
  static constexpr int kChunks = kDim / 8;
  static constexpr int kIters = kRows * kChunks / kThreads;
  static_assert(kRows * kChunks % kThreads == 0, "");
  int32_t tok[kIters], head[kIters], soff[kIters];
  int32_t chunk;

  // smem: the tile of stage 0 (a CuTe tensor); offsets are in elements from its start.
  template <class SmemTensor>
  __device__ ColumnLoader(const SmemTensor& smem, int32_t Gi, int tid) {
    chunk = tid % kChunks;
    const auto* base = &smem(0, 0);
#pragma unroll
    for (int j = 0; j < kIters; ++j) {
      const int row = (tid + j * kThreads) / kChunks;
      tok[j] = row / Gi;
      head[j] = row - tok[j] * Gi;
      soff[j] = static_cast<int32_t>(&smem(row, chunk * 8) - base);
    }
  }

  // Rows of `count` tokens from src (the entry's first token and head), into the tile at dst.
  template <class Element>
  __device__ void load(Element* dst, const Element* src, int64_t s0, int64_t s1,
                       int32_t count) const {
#pragma unroll
    for (int j = 0; j < kIters; ++j) {
      const bool ok = tok[j] < count;
      cp_async16(dst + soff[j], ok ? src + tok[j] * s0 + head[j] * s1 + chunk * 8 : src, ok);
    }
  }
};

// Reverse-index key of entry (KV tile x, KV head r, index head i_local of r, group g).
__host__ __device__ inline uint64_t entry_key(int64_t x, int32_t r, int32_t Hkv, int32_t il,
                                              int32_t ipk, int64_t g, int gbits) {
  return ((static_cast<uint64_t>((x * Hkv + r)) * ipk + il) << gbits) | static_cast<uint64_t>(g);
}

struct EntryListParams {
  const uint64_t* keys;   // sparse: sorted distinct entry keys
  const uint64_t* masks;  // sparse: token bits per key
  const int32_t* count;   // sparse: number of keys (device)
  int32_t gbits;
  bool dense;
};

struct Entry {
  int32_t il;     // index head of r
  int32_t first;  // position of the group's first token in the sequence
  int32_t count;  // tokens in the group (0: skip the entry)
  uint64_t mask;  // tokens that selected the block
};

// The entries of (KV tile x of `tile`, KV head r).
struct EntryList {
  int64_t lo = 0, n = 0;
  int64_t g_base = 0;   // id of the sequence's first group
  int64_t g_first = 0;  // dense: first group at or after the block
  int64_t ng = 0;       // dense: groups per index head

  __device__ EntryList(const EntryListParams& p, const QueryTile& tile, int64_t x, int32_t r,
                       int32_t Hkv, int32_t ipk, int32_t m) {
    g_base = tile.seq + tile.seq_start / m;
    if (p.dense) {
      g_first = tile.first / m;
      ng = (tile.seq_len - 1) / m - g_first + 1;
      n = ng * ipk;
      return;
    }
    const int64_t total = *p.count;
    const uint64_t k0 = entry_key(x, r, Hkv, 0, ipk, 0, p.gbits);
    const uint64_t k1 = entry_key(x, r + 1, Hkv, 0, ipk, 0, p.gbits);
    lo = lower_bound(p.keys, total, k0);
    n = lower_bound(p.keys, total, k1) - lo;
  }

  __device__ static int64_t lower_bound(const uint64_t* a, int64_t n, uint64_t key) {
    int64_t lo = 0, hi = n;
    while (lo < hi) {
      const int64_t mid = (lo + hi) >> 1;
      if (a[mid] < key) lo = mid + 1; else hi = mid;
    }
    return lo;
  }

  // The raw (key, mask) of entry e: loaded ahead of its use, decoded by get().
  struct Raw {
    uint64_t key = 0, mask = 0;
  };
  __device__ Raw load(const EntryListParams& p, int64_t e) const {
    Raw raw;
    if (p.dense) {
      raw.key = static_cast<uint64_t>(e);
    } else {
      raw.key = p.keys[lo + e];
      raw.mask = p.masks[lo + e];
    }
    return raw;
  }

  __device__ Entry get(const EntryListParams& p, const QueryTile& tile, const Raw& raw,
                       int32_t ipk, int32_t m) const {
    Entry en;
    int64_t g;
    if (p.dense) {
      const uint32_t e = static_cast<uint32_t>(raw.key), n = static_cast<uint32_t>(ng);
      en.il = static_cast<int32_t>(e / n);
      g = g_first + e % n;
      en.mask = ~uint64_t(0);
    } else {
      en.il = ipk == 1 ? 0 : static_cast<int32_t>(static_cast<uint32_t>(raw.key >> p.gbits) % static_cast<uint32_t>(ipk));
      g = static_cast<int64_t>(raw.key & ((uint64_t(1) << p.gbits) - 1)) - g_base;
      en.mask = raw.mask;
    }
    const int64_t first = g * m;
    en.first = static_cast<int32_t>(first);
    en.count = (first < 0 || first >= tile.seq_len) ? 0 : min(m, tile.seq_len - en.first);
    return en;
  }
};

// Group size of the KV side: tokens per entry.
__host__ __device__ inline int32_t group_tokens(int32_t heads_per_idx) {
  const int32_t m = 64 / heads_per_idx;
  return m < 16 ? m : 16;
}

struct WorkListParams {
  const int32_t* chunk_start;  // [items] exclusive scan of the chunk counts
  const int32_t* num_chunks;   // [items]
  const int32_t* slot_start;   // [items] first partial slot of a split item
  int32_t* arrivals;           // [items] chunks of a split item that have finished (zeroed)
  float* partials;             // split items' fp32 partial sums, per slot
  int32_t items;               // num_tiles * Hkv (item = x * Hkv + r)
  int32_t chunk;               // entries per chunk
};

struct WorkItem {
  int64_t x = 0;
  int32_t r = 0, c = 0, chunks = 0;
  int32_t item = -1;  // -1: no work for this CTA
};

// The work item and chunk of CTA w (an upper-bound grid: CTAs past the last chunk get none).
__device__ inline WorkItem decode_work(const WorkListParams& p, int32_t Hkv, int64_t w) {
  WorkItem it;
  int32_t lo = 0, hi = p.items - 1;
  while (lo < hi) {  // the last item whose first chunk is <= w
    const int32_t mid = (lo + hi + 1) >> 1;
    if (p.chunk_start[mid] <= w) lo = mid; else hi = mid - 1;
  }
  const int64_t c = w - p.chunk_start[lo];
  if (c < 0 || c >= p.num_chunks[lo]) return it;
  it.item = lo;
  it.x = lo / Hkv;
  it.r = lo % Hkv;
  it.c = static_cast<int32_t>(c);
  it.chunks = p.num_chunks[lo];
  return it;
}

}  // namespace msa::cuda::kern
