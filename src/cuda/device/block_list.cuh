// Block iteration of the query-tile kernels: the KV blocks a tile visits, in ascending order.
// Dense (warmup) mode visits every causal block; sparse mode the union of its tokens' selections,
// with a token-membership bitmask per block, built by one warp in shared memory.
//
// Entries of block_idx outside [0, blk(t)] (the -1 padding, or a caller's out-of-range id) are
// skipped, so no selection can make a kernel read outside its sequence's causal prefix.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>

namespace msa::cuda::kern {

struct UnionSmem {
  uint32_t* bitmap;   // [bitmap_words], zero between uses
  int32_t* prefix;    // [bitmap_words] set bits before each word
  int32_t* blocks;    // [capacity] ascending block ids
  uint32_t* members;  // [capacity][mask_words] token bits of each block
  int32_t mask_words;
};

// Sizes of the union arrays, which follow a kernel's SharedStorage in dynamic shared memory
// (all zero in dense mode).
struct UnionLayout {
  int32_t bitmap_words = 0, capacity = 0, mask_words = 0;

  // Host: the arrays of tiles of `tile_tokens` tokens selecting k blocks each.
  static UnionLayout make(bool dense, int64_t T, int32_t Bk, int32_t tile_tokens, int32_t k) {
    UnionLayout l;
    if (dense) return l;
    const int64_t num_blocks = (T + Bk - 1) / Bk;
    l.bitmap_words = static_cast<int32_t>((num_blocks + 31) / 32);
    l.capacity = static_cast<int32_t>(std::min<int64_t>(int64_t(tile_tokens) * k, num_blocks));
    l.mask_words = (tile_tokens + 31) / 32;
    return l;
  }
  __host__ __device__ size_t bytes() const {
    return 4 * (2 * size_t(bitmap_words) + size_t(capacity) * (1 + mask_words));
  }
  __device__ UnionSmem carve(char* base) const {
    int32_t* a = reinterpret_cast<int32_t*>(base);
    UnionSmem u;
    u.bitmap = reinterpret_cast<uint32_t*>(a);
    u.prefix = a + bitmap_words;
    u.blocks = a + 2 * bitmap_words;
    u.members = reinterpret_cast<uint32_t*>(a + 2 * bitmap_words + capacity);
    u.mask_words = mask_words;
    return u;
  }
};

// Whether any of a tile's tokens lo..hi selected union entry u: the bits lo..hi of its row of
// `members` (mask_words words per entry).
__device__ __forceinline__ bool tokens_select(const uint32_t* members, int32_t mask_words,
                                              int32_t u, int32_t lo, int32_t hi) {
  const uint32_t* w = members + u * mask_words;
  for (int32_t x = lo >> 5; x <= (hi >> 5); ++x) {
    uint32_t bits = w[x];
    const int32_t b0 = x * 32;
    if (lo > b0) bits &= ~0u << (lo - b0);
    if (hi - b0 < 31) bits &= (2u << (hi - b0)) - 1u;
    if (bits != 0u) return true;
  }
  return false;
}

// The list a tile walks: entry u is block block(u); member(u, tok, ok) says whether the tile's
// token tok, on a real row (`ok`), selected it (always, in dense mode). Params: the kernel's
// parameters (dense, uni); they are read where used, not held in registers across loops.
template <class Params>
struct BlockList {
  const Params& p;
  UnionSmem us;

  __device__ int32_t block(int32_t u) const { return p.dense ? u : us.blocks[u]; }
  __device__ bool member(int32_t u, int32_t tok, bool ok) const {
    if (!p.dense && ok) ok = (us.members[u * p.uni.mask_words + (tok >> 5)] >> (tok & 31)) & 1u;
    return ok;
  }
  // Whether any of the tile's tokens lo..hi selected entry u (always, in dense mode).
  __device__ bool any_member(int32_t u, int32_t lo, int32_t hi) const {
    return p.dense || tokens_select(us.members, p.uni.mask_words, u, lo, hi);
  }
};

// Returns the number of blocks in the union (the same value in every lane).
// rows: block_idx rows of the tile's tokens, `row_stride` elements apart, k entries each;
// first: position of the tile's first token in its sequence; count: tokens; bk: block size.
__device__ inline int32_t build_block_union(const UnionSmem& u, const int32_t* rows,
                                            int64_t row_stride, int32_t k, int32_t first,
                                            int32_t count, int32_t bk, int lane) {
  const uint32_t kAll = 0xffffffffu;
  const int32_t total = count * k;
  for (int32_t e = lane; e < total; e += 32) {
    const int32_t tok = e / k;
    const int32_t b = rows[tok * row_stride + (e - tok * k)];
    if (b >= 0 && b <= (first + tok) / bk) atomicOr(&u.bitmap[b >> 5], 1u << (b & 31));
  }
  __syncwarp();
  const int32_t nwords = (first + count - 1) / bk / 32 + 1;
  int32_t base = 0;
  for (int32_t w0 = 0; w0 < nwords; w0 += 32) {
    const int32_t w = w0 + lane;
    uint32_t bits = w < nwords ? u.bitmap[w] : 0u;
    const int32_t c = __popc(bits);
    int32_t incl = c;
#pragma unroll
    for (int d = 1; d < 32; d <<= 1) {
      const int32_t y = __shfl_up_sync(kAll, incl, d);
      if (lane >= d) incl += y;
    }
    int32_t pos = base + incl - c;
    if (w < nwords) u.prefix[w] = pos;
    while (bits) {
      u.blocks[pos++] = w * 32 + __ffs(bits) - 1;
      bits &= bits - 1;
    }
    base += __shfl_sync(kAll, incl, 31);
  }
  const int32_t n = base;
  for (int32_t e = lane; e < n * u.mask_words; e += 32) u.members[e] = 0u;
  __syncwarp();
  for (int32_t e = lane; e < total; e += 32) {
    const int32_t tok = e / k;
    const int32_t b = rows[tok * row_stride + (e - tok * k)];
    if (b >= 0 && b <= (first + tok) / bk) {
      const int32_t w = b >> 5;
      const int32_t p = u.prefix[w] + __popc(u.bitmap[w] & ((1u << (b & 31)) - 1u));
      atomicOr(&u.members[p * u.mask_words + (tok >> 5)], 1u << (tok & 31));
    }
  }
  __syncwarp();
  for (int32_t w = lane; w < nwords; w += 32) u.bitmap[w] = 0u;
  __syncwarp();
  return n;
}

// The tokens of entry e: the set bits of its members row.
__device__ __forceinline__ int32_t union_members(const UnionSmem& u, int32_t e) {
  int32_t c = 0;
  for (int32_t x = 0; x < u.mask_words; ++x) c += __popc(u.members[e * u.mask_words + x]);
  return c;
}

// The split forward's query-tile part (device/pass_choice.cuh): keeps the n union entries that
// at least `share` of the tile's tokens selected, compacted in place in ascending order; returns
// their number. (pass_choice_kernel marks the same blocks from the same rows for the KV-block
// pass to skip.)
__device__ inline int32_t keep_shared_blocks(const UnionSmem& u, int32_t n, int32_t share, int lane) {
  int32_t base = 0;
  // Each round's lanes read their entries before any lane writes (to places at most theirs).
  for (int32_t e0 = 0; e0 < n; e0 += 32) {
    const int32_t e = e0 + lane;
    const bool keep = e < n && union_members(u, e) >= share;
    int32_t blk = 0;
    uint32_t mem[4] = {0u, 0u, 0u, 0u};  // mask_words <= 4 (tiles of at most 128 tokens)
    if (keep) {
      blk = u.blocks[e];
#pragma unroll
      for (int32_t x = 0; x < 4; ++x)
        if (x < u.mask_words) mem[x] = u.members[e * u.mask_words + x];
    }
    const uint32_t ballot = __ballot_sync(0xffffffffu, keep);
    __syncwarp();
    if (keep) {
      const int32_t to = base + __popc(ballot & ((1u << lane) - 1u));
      u.blocks[to] = blk;
#pragma unroll
      for (int32_t x = 0; x < 4; ++x)
        if (x < u.mask_words) u.members[to * u.mask_words + x] = mem[x];
    }
    base += __popc(ballot);
    __syncwarp();
  }
  return base;
}

}  // namespace msa::cuda::kern
