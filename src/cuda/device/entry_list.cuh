// Entry lists of the KV-side kernels (bwd_kv_kernel.cuh, kl_kernel.cuh): the query groups that
// selected a KV block, the work items and chunks they are cut into, and the entry stream that
// keeps kStages entries in flight.
//
// A KV-side work item is one KV block (Bk keys of one sequence) of one KV head r. Its work is a
// list of entries (index head i of r, query group g): a group is m = min(64 / Gi, 16) consecutive
// tokens of the sequence, and the entry's 64 columns are (token, head) pairs of those tokens and of i's Gi query
// heads (column = token * Gi + head). `mask` bit t says that token t of the group selected the
// block. Sparse mode reads the entries from the reverse index (host/reverse_index.cu): keys sorted by
// (KV tile, r, i, g), one per distinct entry, with the OR of the selecting tokens' bits. Dense
// (warmup) mode enumerates every group at or after the block, all bits set.
//
// Lists are uneven (a sink block is selected by every token; in dense mode the first block by
// all), so an item's list is cut into chunks of at most `chunk` entries and each chunk is one
// CTA. The chunks are laid out by an exclusive scan of the per-item chunk counts (WorkList).
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>

#include <cstdint>

#include "load.cuh"
#include "tile.cuh"

namespace msa::cuda::kern {

// Fixed-point sums across CTAs: one unit is 2^-32; integer atomics make them order-independent.
constexpr double kFixedOne = 4294967296.0;

__device__ __forceinline__ void add_fixed(unsigned long long* dst, float v) {
  atomicAdd(dst, static_cast<unsigned long long>(__double2ll_rn(static_cast<double>(v) * kFixedOne)));
}

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

  EntryList() = default;
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

// The work of one KV-side CTA: chunk it.c of the entry list of (KV block it.x, KV head it.r), as
// `tile` (the block's keys, a tile of kBlockN of its sequence), `list` and entries [begin, end).
// False: nothing to do. Params: the KV-side kernel's parameters (work, list, cu_seqlens, nseq, T,
// Hkv, idx_per_kv, group_tokens).
template <int kBlockN, class Params>
__device__ inline bool kv_chunk(const Params& p, WorkItem* it, QueryTile* tile, EntryList* list,
                                int64_t* begin, int64_t* end) {
  *it = decode_work(p.work, p.Hkv, blockIdx.x);
  if (it->item < 0) return false;
  *tile = decode_tile(p.cu_seqlens, p.nseq, p.T, kBlockN, it->x);
  if (tile->count == 0) return false;
  *list = EntryList(p.list, *tile, it->x, it->r, p.Hkv, p.idx_per_kv, p.group_tokens);
  *begin = min<int64_t>(int64_t(it->c) * p.work.chunk, list->n);
  *end = min<int64_t>(*begin + p.work.chunk, list->n);
  return true;
}

// A chunk's entries [begin, end) through kStages shared-memory stages, kStages - 1 of them in
// flight ahead of the one being computed. issue(raw, stage) starts the cp.async loads of one
// entry; each entry is one commit group (empty past the end, so that the wait counts stay right).
template <int kStages>
struct EntryStream {
  int64_t begin, end, next;
  EntryList::Raw ahead;  // the next entry to issue: its load overlaps the current entry's compute

  template <class Issue>
  __device__ EntryStream(const EntryList& list, const EntryListParams& lp, int64_t begin_,
                         int64_t end_, Issue&& issue)
      : begin(begin_), end(end_), next(begin_) {
    for (int st = 0; st < kStages - 1; ++st, ++next) {
      if (next < end) issue(list.load(lp, next), st);
      cp_async_commit();
    }
    if (next < end) ahead = list.load(lp, next);
  }

  __device__ int stage(int64_t e) const { return static_cast<int>((e - begin) % kStages); }

  // Entry e has landed in its stage, and every thread is done with the stage issue_next refills.
  __device__ void wait() const {
    cp_async_wait<kStages - 2>();
    cutlass::arch::fence_view_async_shared();
    __syncthreads();
  }

  template <class Issue>
  __device__ void issue_next(const EntryList& list, const EntryListParams& lp, Issue&& issue) {
    if (next < end) issue(ahead, stage(next));
    cp_async_commit();
    if (++next < end) ahead = list.load(lp, next);
  }
};

}  // namespace msa::cuda::kern
