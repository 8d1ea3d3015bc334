// The split forward's marks and kAuto's choice (device/pass_choice.cuh): per query tile, the
// tokens selecting each block; the entries of the blocks the tile keeps marked for the KV-block
// pass to skip; the sums that the query-tile and KV-block kernels read. Launched by
// host/forward.cu only.
#pragma once

#include <cstdint>

#include "../device/grid_dependency.cuh"
#include "../device/pass_choice.cuh"
#include "../device/tile.cuh"
#include "../host/args.h"

namespace msa::cuda::kern {

using cuda::FwdArgs;

// A warp's block_idx entries staged in shared memory: kChoiceStage of them (whole rows).
constexpr int kChoiceStage = 512;
constexpr int kChoiceLoads = kChoiceStage / 32;

// One warp per (tile, index head) of `p` (the query-tile forward's arguments, split set): it
// counts the tokens selecting each block (a block repeated in a row counts once) in one byte per
// block of the sequence (8 * bitmap_words words of shared memory per warp, then kChoiceStage
// words for its rows), writes p.split.taken[t, ih, slot] for the tile's tokens (0 where the
// KV-block pass computes the slot: its block is valid, not in an earlier column of the row, and
// has fewer than share_min tokens; 1 where the tile keeps it or no block is computed), and adds
// kAuto's sums (device/pass_choice.cuh); the block's warps are summed before two atomic adds.
// `sums` is zero before the launch, as is `seen`, a bit per KV-side work item (KV tile x, KV
// head r: bit x * Hkv + r) set by the first tile that sends it a pair. The rows are read in
// chunks of whole rows staged in shared memory, each chunk's loads issued together (one memory
// latency a chunk, not one per entry).
__global__ void pass_choice_kernel(const __grid_constant__ FwdArgs p, int32_t bk,
                                   unsigned long long* sums, uint32_t* seen) {
  grid_dependency_begin();
  extern __shared__ uint32_t counts[];
  __shared__ unsigned long long block_sums[2];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int warps = blockDim.x / 32;
  if (threadIdx.x < 2) block_sums[threadIdx.x] = 0ull;
  __syncthreads();
  const int64_t w = int64_t(blockIdx.x) * warps + warp;
  unsigned long long plain = 0, split = 0;
  if (w < p.num_tiles * p.Hi) {
    const int64_t tile_id = w / p.Hi;
    const int32_t ih = static_cast<int32_t>(w % p.Hi);
    QueryTile tile = decode_tile(p.cu_seqlens, p.nseq, p.T, p.tile_tokens, tile_id);
    p.paged.place(tile);  // a prefill's tokens: positions after their cached keys
    if (tile.count > 0) {
      uint32_t* cw = counts + warp * 8 * p.uni.bitmap_words;  // block b: byte b % 4 of word b / 4
      int32_t* staged = reinterpret_cast<int32_t*>(counts + warps * 8 * p.uni.bitmap_words) + warp * kChoiceStage;
      const int32_t nwords = (tile.pos0 + tile.count - 1) / bk / 4 + 1;
      for (int32_t x = lane; x < nwords; x += 32) cw[x] = 0u;
      const int64_t tok0 = tile.seq_start + tile.first;
      const int32_t* rows = p.block_idx + tok0 * p.bi_s0 + ih * p.bi_s1;
      const int32_t k = p.top_k, total = tile.count * k;
      const int32_t chunk = kChoiceStage / k * k;  // k <= 32: at least 16 rows
      // A lane's entries step by 32: q32 rows and r32 slots (no division per entry).
      const int32_t q32 = 32 / k, r32 = 32 - q32 * k;
      const int bk_shift = __ffs(bk) - 1;  // Bk is a power of two (64 or 128)
      struct Pos {
        int32_t tok, s;
      };
      auto first_pos = [&](int32_t e) { return Pos{e / k, e - e / k * k}; };
      auto step = [&](Pos& at) {
        at.tok += q32;
        at.s += r32;
        if (at.s >= k) {
          at.s -= k;
          ++at.tok;
        }
      };
      // Entries [e0, e0 + chunk) of the tile into `staged`.
      auto stage = [&](int32_t e0) {
        int32_t v[kChoiceLoads];
        Pos at = first_pos(e0 + lane);
#pragma unroll
        for (int i = 0; i < kChoiceLoads; ++i) {
          const int32_t e = e0 + 32 * i + lane;
          v[i] = 32 * i + lane < chunk && e < total ? rows[at.tok * p.bi_s0 + at.s] : -1;
          step(at);
        }
        __syncwarp();  // the warp is done with the chunk before
#pragma unroll
        for (int i = 0; i < kChoiceLoads; ++i) staged[32 * i + lane] = v[i];
        __syncwarp();
      };
      // Entry e (at row at.tok, slot at.s) of the staged chunk starting at e0: its block, or -1
      // where it is invalid or repeats an earlier slot of the row.
      auto block_of = [&](int32_t e0, int32_t e, const Pos& at, bool first_only) {
        const int32_t* row = staged + (e - e0 - at.s);
        const int32_t b = row[at.s];
        // (past the sequence's keys: only unchecked lengths shorter than the tokens)
        if (b < 0 || b > ((tile.pos0 + at.tok) >> bk_shift) || (b << bk_shift) >= tile.key_len) return -1;
        if (first_only)
          for (int32_t s2 = 0; s2 < at.s; ++s2)
            if (row[s2] == b) return -1;
        return b;
      };
      // a tile's tokens count at most 128 < 256 per block: no carry into the next byte
      for (int32_t e0 = 0; e0 < total; e0 += chunk) {
        stage(e0);
        Pos at = first_pos(e0 + lane);
        for (int32_t e = e0 + lane; e < min(total, e0 + chunk); e += 32, step(at))
          if (const int32_t b = block_of(e0, e, at, true); b >= 0) atomicAdd(&cw[b >> 2], 1u << (8 * (b & 3)));
      }
      __syncwarp();
      const uint32_t keep = static_cast<uint32_t>(p.split.share_min);
      if (p.split.taken != nullptr) {
        for (int32_t e0 = 0; e0 < total; e0 += chunk) {
          if (total > chunk) stage(e0);  // one chunk: still staged
          Pos at = first_pos(e0 + lane);
          for (int32_t e = e0 + lane; e < min(total, e0 + chunk); e += 32, step(at)) {
            // 0 exactly where the KV-block pass writes a partial: a valid block's first
            // column, the block not kept
            const int32_t b = block_of(e0, e, at, true);
            const bool no_partial = b < 0 || ((cw[b >> 2] >> (8 * (b & 3))) & 0xffu) >= keep;
            p.split.taken[((tok0 + at.tok) * p.Hi + ih) * k + at.s] = no_partial;
          }
        }
      }
      const unsigned long long tile_cost = static_cast<unsigned long long>(p.tile_tokens) * kKvCostDen;
      // The work item of block b: KV tile x0 + b (the reverse index's numbering: packed keys,
      // or a prefill's pages) of KV head r.
      const int64_t x0 = p.paged.first_kv_tile(tile.seq, tile.seq_start, bk);
      const int32_t r = ih / p.idx_per_kv;
      for (int32_t x = lane; x < nwords; x += 32) {
        const uint32_t word = cw[x];
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          const uint32_t c = (word >> (8 * j)) & 0xffu;
          if (c == 0u) continue;
          plain += tile_cost;
          if (c >= keep) {
            split += tile_cost;
          } else {
            split += c * kKvCostNum;
            const int64_t item = (x0 + 4 * x + j) * p.Hkv + r;
            const uint32_t bit = 1u << (item & 31);
            // An earlier tile has mostly sent the item a pair already: a read from L2 first,
            // the atomic (whose answer counts the item once) only where the bit reads clear.
            if ((__ldcg(seen + (item >> 5)) & bit) == 0u && (atomicOr(seen + (item >> 5), bit) & bit) == 0u)
              split += kKvItemCost;
          }
        }
      }
    }
  }
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    plain += __shfl_xor_sync(0xffffffffu, plain, o);
    split += __shfl_xor_sync(0xffffffffu, split, o);
  }
  if (lane == 0 && (plain | split) != 0ull) {
    atomicAdd(&block_sums[0], plain);
    atomicAdd(&block_sums[1], split);
  }
  __syncthreads();
  if (threadIdx.x == 0 && (block_sums[0] | block_sums[1]) != 0ull) {
    atomicAdd(&sums[0], block_sums[0]);
    atomicAdd(&sums[1], block_sums[1]);
  }
}

}  // namespace msa::cuda::kern
