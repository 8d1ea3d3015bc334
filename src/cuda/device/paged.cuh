// Pieces shared by the paged (serving) kernels: where a tile's new tokens sit in their sequence,
// the page of a logical block, and the mma.sync (SM80-style) tiling these small-row kernels use.
// Decode tiles have few rows (a handful of tokens x heads), so warp-level MMAs over a few KV
// blocks in flight per CTA, many CTAs per SM, fit them better than the training kernels'
// 128-row warpgroup tiles.
#pragma once

#include <cute/tensor.hpp>
#include <cute/atom/copy_atom.hpp>
#include <cute/atom/mma_atom.hpp>
#include <cutlass/numeric_types.h>

#include "../host/args.h"
#include "load.cuh"
#include "tile.cuh"

namespace msa::cuda::kern {

using namespace cute;

// The new tokens of one tile: tile.first .. tile.first + tile.count - 1 of sequence tile.seq's
// n_s = tile.seq_len new tokens, at key positions base + tile.first + j.
struct PagedTile {
  QueryTile tile;
  int32_t len = 0;   // cached tokens of the sequence (clamped to the page table)
  int32_t base = 0;  // position of the sequence's first new token
  const int32_t* pages = nullptr;

  __device__ int32_t pos(int32_t j) const { return base + tile.first + j; }
  __device__ int32_t last_pos() const { return pos(tile.count - 1); }
};

__device__ inline PagedTile paged_tile(const PagedArgs& a, int64_t tile_id) {
  PagedTile t;
  t.tile = decode_tile(a.cu_q, a.nseq, a.Tq, a.tile_tokens, tile_id);
  if (t.tile.count == 0) return t;
  const int32_t cap = a.max_pages * a.block_size;
  const int32_t len = a.seq_lens[t.tile.seq];
  t.len = len < 0 ? 0 : (len > cap ? cap : len);
  t.base = t.len - t.tile.seq_len > 0 ? t.len - t.tile.seq_len : 0;
  t.pages = a.page_table + t.tile.seq * a.pt_s0;
  return t;
}

// Physical page of logical block b (b in [0, max_pages)), clamped to the cache.
__device__ inline int32_t page_of(const PagedArgs& a, const int32_t* pages, int32_t b) {
  const int32_t p = pages[b];
  return p < 0 ? 0 : (p >= a.num_pages ? a.num_pages - 1 : p);
}

// mma.sync m16n8k16 with fp32 accumulation for the 16-bit element type.
template <class Element>
using Sm80MmaAtom = MMA_Atom<std::conditional_t<std::is_same_v<Element, cutlass::half_t>,
                                                SM80_16x8x16_F32F16F16F32_TN,
                                                SM80_16x8x16_F32BF16BF16F32_TN>>;

// A [rows, kDim] shared tile swizzled for ldmatrix (16-byte chunks XOR-ed across 8-row groups).
template <class Element, int kRows, int kDim>
using Sm80SmemLayout = decltype(tile_to_shape(
    composition(Swizzle<3, 3, 3>{}, Layout<Shape<_8, Int<(kDim >= 64 ? 64 : kDim)>>,
                                           Stride<Int<(kDim >= 64 ? 64 : kDim)>, _1>>{}),
    Shape<Int<kRows>, Int<kDim>>{}));

// Row/column view of an SM80 accumulator: ((2, 2), MMA_M, MMA_N) -> ((2, MMA_M), (2, MMA_N)):
// rows (row half, MMA_M), columns (column pair, MMA_N).
template <class Layout>
CUTE_HOST_DEVICE constexpr auto sm80_rowcol(Layout l) {
  static_assert(decltype(rank(l))::value == 3);
  return make_layout(make_layout(get<0, 1>(l), get<1>(l)), make_layout(get<0, 0>(l), get<2>(l)));
}

// The SM80 accumulator of S = Q K^T as the A operand of O += P V: two n8 column tiles form one
// k16 slice. ((2, 2), MMA_M, MMA_N) -> (((2, 2), 2), MMA_M, MMA_N / 2).
template <class Layout>
CUTE_HOST_DEVICE constexpr auto sm80_acc_as_a(Layout l) {
  auto d = logical_divide(l, Shape<Underscore, Underscore, _2>{});  // ((2,2), MMA_M, (2, MMA_N/2))
  return make_layout(make_layout(get<0>(d), get<2, 0>(d)), get<1>(d), get<2, 1>(d));
}

}  // namespace msa::cuda::kern
