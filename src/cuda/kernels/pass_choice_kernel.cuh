// kAuto's choice of the sparse forward's pass (device/pass_choice.cuh): the sums over a call's
// query tiles that the query-tile and KV-block kernels read. Launched by host/forward.cu only.
#pragma once

#include <cstdint>

#include "../device/pass_choice.cuh"
#include "../device/tile.cuh"
#include "../host/args.h"

namespace msa::cuda::kern {

using cuda::FwdArgs;

// kAuto's sums (device/pass_choice.cuh) over the query tiles of `p` (the query-tile forward's
// arguments): one warp per (tile, index head), its union counted on a bitmap of the sequence's
// blocks in shared memory (bitmap_words words per warp), the block's warps summed before two
// atomic adds. `sums` is zero before the launch.
__global__ void pass_choice_kernel(const __grid_constant__ FwdArgs p, int32_t bk,
                                   unsigned long long* sums) {
  extern __shared__ uint32_t bitmaps[];
  __shared__ unsigned long long block_sums[2];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (threadIdx.x < 2) block_sums[threadIdx.x] = 0ull;
  __syncthreads();
  const int64_t w = int64_t(blockIdx.x) * (blockDim.x / 32) + warp;
  unsigned long long visit = 0, selected = 0;
  if (w < p.num_tiles * p.Hi) {
    const int64_t tile_id = w / p.Hi;
    const int32_t ih = static_cast<int32_t>(w % p.Hi);
    const QueryTile tile = decode_tile(p.cu_seqlens, p.nseq, p.T, p.tile_tokens, tile_id);
    if (tile.count > 0) {
      uint32_t* bm = bitmaps + warp * p.uni.bitmap_words;
      const int32_t nwords = (tile.first + tile.count - 1) / bk / 32 + 1;
      for (int32_t x = lane; x < nwords; x += 32) bm[x] = 0u;
      __syncwarp();
      const int32_t* rows = p.block_idx + (tile.seq_start + tile.first) * p.bi_s0 + ih * p.bi_s1;
      const int32_t total = tile.count * p.top_k;
      for (int32_t e = lane; e < total; e += 32) {
        const int32_t tok = e / p.top_k;
        const int32_t b = rows[tok * p.bi_s0 + (e - tok * p.top_k)];
        if (b >= 0 && b <= (tile.first + tok) / bk) {
          atomicOr(&bm[b >> 5], 1u << (b & 31));
          ++selected;
        }
      }
      __syncwarp();
      for (int32_t x = lane; x < nwords; x += 32) visit += __popc(bm[x]);
      visit *= static_cast<unsigned long long>(p.tile_tokens);
    }
  }
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    visit += __shfl_xor_sync(0xffffffffu, visit, o);
    selected += __shfl_xor_sync(0xffffffffu, selected, o);
  }
  if (lane == 0 && (visit | selected) != 0ull) {
    atomicAdd(&block_sums[0], visit);
    atomicAdd(&block_sums[1], selected);
  }
  __syncthreads();
  if (threadIdx.x == 0 && (block_sums[0] | block_sums[1]) != 0ull) {
    atomicAdd(&sums[0], block_sums[0]);
    atomicAdd(&sums[1], block_sums[1]);
  }
}

}  // namespace msa::cuda::kern
