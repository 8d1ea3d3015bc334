// The KV blocks a query tile visits: the union of its tokens' selections, in ascending order,
// with a token-membership bitmask per block. Built by one warp in shared memory.
//
// Entries of block_idx outside [0, blk(t)] (the -1 padding, or a caller's out-of-range id) are
// skipped, so no selection can make a kernel read outside its sequence's causal prefix.
#pragma once

#include <cstdint>

namespace msa::cuda::kern {

struct UnionSmem {
  uint32_t* bitmap;   // [bitmap_words], zero between uses
  int32_t* prefix;    // [bitmap_words] set bits before each word
  int32_t* blocks;    // [capacity] ascending block ids
  uint32_t* members;  // [capacity][mask_words] token bits of each block
  int32_t mask_words;
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

}  // namespace msa::cuda::kern
