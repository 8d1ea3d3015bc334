// The support of a score (docs/contract.md §3): a key is seen by a query row when the row's
// token selected the key's block and the key is not in its future. Only a block that reaches
// past a tile's first token needs the causal test. Query-tile kernels (rows = tokens) ask
// row_sees; KV-side kernels (columns = an entry's tokens) ask entry_selects / entry_sees.
#pragma once

#include <cstdint>

#include <cute/tensor.hpp>

#include "entry_list.cuh"

namespace msa::cuda::kern {

using namespace cute;

// The rows of a query tile this thread holds (kRows of them): row = token * G + head; ok: the
// row's token exists (padding rows and tokens past the tile's end are not ok).
template <int kRows>
struct TileRows {
  int32_t tok[kRows];
  bool ok[kRows];

  // coord: the row/column identity view of the thread's score accumulator.
  template <class TCoord>
  __device__ TileRows(const TCoord& coord, int32_t G, int32_t count) {
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      tok[r] = get<0>(coord(r, 0)) / G;
      ok[r] = tok[r] < count;
    }
  }
  // The head (within the group) of row r of another accumulator with the same rows.
  template <class TCoord>
  __device__ int32_t head(const TCoord& coord, int r, int32_t G) const {
    return get<0>(coord(r, 0)) - tok[r] * G;
  }
};

// A query-tile row: `member`: its token selected the block (and the row is real); `causal`: the
// block reaches past the tile's first token; key and qpos are positions in the sequence.
__device__ __forceinline__ bool row_sees(bool member, bool causal, int32_t key, int32_t qpos) {
  return member && !(causal && key > qpos);
}

// Token slot t of an entry exists (every token of an entry selected its block).
__device__ __forceinline__ bool entry_selects(const EntryRecord& en, int32_t t) {
  return t < en.count;
}

// The last key row of the block that token slot t of an entry sees (key_base: the packed index
// of the token at the block's first key, PagedKeys::token_base); -1 where the slot holds no
// token. A column's mask is row <= this: a slot without a token sees no key even where key_base
// is negative (keys apart from the tokens), where a token of -1 would have seen some.
__device__ __forceinline__ int64_t entry_last_row(const EntryRecord& en, int32_t t, int64_t key_base) {
  return entry_selects(en, t) ? en.tok[t] - key_base : -1;
}

// ... and key `key` of the block is in its support: not in the token's future (`key`: the packed
// index of the token at the key's position, PagedKeys::token_base + the key's row in the block).
__device__ __forceinline__ bool entry_sees(const EntryRecord& en, int32_t t, int64_t key) {
  return t < en.count && key <= en.tok[t];
}

}  // namespace msa::cuda::kern
