// E4M3 copies of the index inputs for FP8 selection scores (docs/contract.md §2, select_scores =
// kFp8): a scale s = 16 / amax per q_idx row and per block of k_idx keys of one sequence, each
// value stored as e4m3(fp32(x * s)) (nearest even, saturated), as the CPU backend does. With
// |codes| <= 16 a sum of Di <= 128 products stays below 2^15, inside the fp16 accumulators of
// select_kernel's FP8 MMA; E4M3's normal range then still covers [amax / 1024, amax].
//
// fp8_rows_kernel: one warp per (token, index head) row, kDim / 32 elements per lane (one load),
// the row's amax by shuffles. The row's scale is not kept: it does not change the order of the
// row's scores. A negative scale_idx is folded in as a sign flip of the codes (exact).
// fp8_blocks_kernel: one CTA of 128 threads per (key block of a sequence, index key head): the
// block's amax (16-byte loads, a CTA reduction), then the codes; 1 / s goes to k_factor at the
// block's first row, where select_kernel reads it to scale the block's maxima. A prefill's keys
// in pages: block b of sequence s (KV tile x = s * max_pages + b, PagedKeys::kv_tile) is read
// from its page and written to rows x * Bk ... of the copy, the rows past the sequence's last
// key zeroed; blocks past it, and sequences without new tokens, are skipped.
#pragma once

#include <cutlass/array.h>
#include <cutlass/numeric_types.h>

#include "../device/e4m3.cuh"
#include "../device/grid_dependency.cuh"
#include "../device/tile.cuh"
#include "../host/args.h"

namespace msa::cuda::kern {

__device__ __forceinline__ float fp8_scale(float amax) {
  return amax > 0.f && amax <= 3.4028235e38f ? __fdiv_rn(16.f, amax) : 1.f;
}

template <class Element, int kDim>
__global__ void __launch_bounds__(256) fp8_rows_kernel(const __grid_constant__ Fp8CopyArgs a) {
  grid_dependency_begin();
  constexpr int kPer = kDim / 32;
  using Vec = cutlass::AlignedArray<Element, kPer>;
  const int64_t row = int64_t(blockIdx.x) * 8 + threadIdx.x / 32;
  if (row >= int64_t(a.T) * a.Hi) return;
  const int lane = threadIdx.x % 32;
  const int64_t t = row / a.Hi, h = row % a.Hi;
  const Vec v = *reinterpret_cast<const Vec*>(static_cast<const Element*>(a.q_idx) + t * a.q_s0 + h * a.q_s1 +
                                             lane * kPer);
  float x[kPer], amax = 0.f;
#pragma unroll
  for (int e = 0; e < kPer; ++e) {
    x[e] = static_cast<float>(v[e]);
    amax = fmaxf(amax, fabsf(x[e]));  // fmaxf drops a NaN operand
  }
#pragma unroll
  for (int o = 16; o > 0; o /= 2) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
  const float s = fp8_scale(amax);
  const uint8_t flip = a.negate ? 0x80 : 0;
  cutlass::AlignedArray<uint8_t, kPer> out;
#pragma unroll
  for (int e = 0; e < kPer; ++e) out[e] = e4m3_from_float(__fmul_rn(x[e], s)) ^ flip;
  *reinterpret_cast<cutlass::AlignedArray<uint8_t, kPer>*>(a.q8 + row * kDim + lane * kPer) = out;
}

template <class Element, int kDim>
__global__ void __launch_bounds__(128) fp8_blocks_kernel(const __grid_constant__ Fp8CopyArgs a) {
  grid_dependency_begin();
  constexpr int kChunks = kDim / 8;  // 8 elements (16 bytes) per load
  using Vec = cutlass::AlignedArray<Element, 8>;
  const QueryTile blk = a.paged.tile_of(a.cu_seqlens, a.nseq, a.T, a.block_size, blockIdx.x);
  if (blk.count == 0) return;
  const int32_t ik = blockIdx.y;
  const bool paged = a.paged.page_table != nullptr;
  // The block's first row in the keys, and in the copy.
  const int64_t src0 = a.paged.first_row(blk, a.block_size);
  const int64_t r0 = paged ? int64_t(blockIdx.x) * a.block_size : src0;
  const Element* src = static_cast<const Element*>(a.k_idx) + src0 * a.k_s0 + ik * a.k_s1;
  const int n = blk.count * kChunks;
  // The keys' values: float32(key * in_factor) where the keys carry a factor (an E4M3 cache).
  const float f = a.in_factor != nullptr ? a.in_factor[src0 * a.Hik + ik] : 1.f;
  const auto value = [&](Element x) {
    return a.in_factor != nullptr ? __fmul_rn(static_cast<float>(x), f) : static_cast<float>(x);
  };
  float amax = 0.f;
  for (int e = threadIdx.x; e < n; e += 128) {
    const Vec v = *reinterpret_cast<const Vec*>(src + (e / kChunks) * a.k_s0 + (e % kChunks) * 8);
#pragma unroll
    for (int j = 0; j < 8; ++j) amax = fmaxf(amax, fabsf(value(v[j])));
  }
#pragma unroll
  for (int o = 16; o > 0; o /= 2) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
  __shared__ float warp_max[4];
  if (threadIdx.x % 32 == 0) warp_max[threadIdx.x / 32] = amax;
  __syncthreads();
  amax = fmaxf(fmaxf(warp_max[0], warp_max[1]), fmaxf(warp_max[2], warp_max[3]));
  const float s = fp8_scale(amax);
  if (threadIdx.x == 0) a.k_factor[r0 * a.Hik + ik] = __frcp_rn(s);
  uint8_t* dst = a.k8 + (r0 * a.Hik + ik) * kDim;
  for (int e = threadIdx.x; e < n; e += 128) {
    const int r = e / kChunks, c = e % kChunks;
    const Vec v = *reinterpret_cast<const Vec*>(src + r * a.k_s0 + c * 8);
    cutlass::AlignedArray<uint8_t, 8> out;
#pragma unroll
    for (int j = 0; j < 8; ++j) out[j] = e4m3_from_float(__fmul_rn(value(v[j]), s));
    *reinterpret_cast<cutlass::AlignedArray<uint8_t, 8>*>(dst + int64_t(r) * a.Hik * kDim + c * 8) = out;
  }
  if (!paged) return;  // packed: the rows after the block are the next block's
  for (int e = n + threadIdx.x; e < a.block_size * kChunks; e += 128)
    *reinterpret_cast<uint64_t*>(dst + int64_t(e / kChunks) * a.Hik * kDim + (e % kChunks) * 8) = 0;
}

// A page's E4M3 codes exactly into Element, by the CTA's threads, 16 codes per step: rows
// [0, count) of `chunks` 16-byte chunks from src (row stride src_s0 bytes) to dst (row stride
// dst_s0 elements), and zero rows from count to `rows`.
template <class Element>
__device__ __forceinline__ void e4m3_page_rows(const uint8_t* src, int64_t src_s0, Element* dst, int64_t dst_s0,
                                               int32_t rows, int32_t count, int chunks) {
  for (int e = threadIdx.x; e < rows * chunks; e += blockDim.x) {
    const int row = e / chunks, c = e % chunks;
    Element* out = dst + row * dst_s0 + c * 16;
    if (row < count) {
      e4m3x16_store<Element>(*reinterpret_cast<const uint4*>(src + row * src_s0 + c * 16), out, out + 8);
    } else {
      *reinterpret_cast<uint4*>(out) = make_uint4(0, 0, 0, 0);
      *reinterpret_cast<uint4*>(out + 8) = make_uint4(0, 0, 0, 0);
    }
  }
}

// e4m3_pages_kernel: a prefill over an E4M3 k_idx cache (the inputs' scores). One CTA of 128
// threads per (KV tile x = block b of sequence s, index key head), as fp8_blocks_kernel's paged
// blocks: the page's codes, 16 per step, exactly into Element at rows x * Bk ... of keys16 (the
// rows past the sequence's last key zeroed), and the page's scale to k_factor at the block's
// first row.
template <class Element, int kDim>
__global__ void __launch_bounds__(128) e4m3_pages_kernel(const __grid_constant__ Fp8CopyArgs a) {
  grid_dependency_begin();
  constexpr int kChunks = kDim / 16;  // 16 codes (16 bytes) per load
  if (a.table != nullptr && blockIdx.y == 0 && threadIdx.x == 0) a.table[blockIdx.x] = static_cast<int32_t>(blockIdx.x);
  const QueryTile blk = a.paged.tile_of(a.cu_seqlens, a.nseq, a.T, a.block_size, blockIdx.x);
  if (blk.count == 0) return;
  const int32_t ik = blockIdx.y;
  const int64_t src0 = a.paged.kv_row(blk, a.block_size);
  const int64_t r0 = int64_t(blockIdx.x) * a.block_size;
  const uint8_t* src = static_cast<const uint8_t*>(a.k_idx) + src0 * a.k_s0 + ik * a.k_s1;
  Element* dst = static_cast<Element*>(a.keys16) + (r0 * a.Hik + ik) * kDim;
  if (threadIdx.x == 0)
    a.k_factor[r0 * a.Hik + ik] = page_scale(a.k_scale, a.k_scale_step, static_cast<int32_t>(src0 / a.block_size));
  e4m3_page_rows(src, a.k_s0, dst, int64_t(a.Hik) * kDim, a.block_size, blk.count, kChunks);
}

// e4m3_kv_pages_kernel: a prefill over an E4M3 K/V cache (E4M3KvCopyArgs). One CTA of 128
// threads per (KV tile x, KV head r), every x (the table entry is written for all of them; the
// tiles past a sequence's cached keys, or of a sequence without new tokens, copy nothing): the
// page's k and v codes, 16 per step, exactly into Element, and the page's scales.
template <class Element>
__global__ void __launch_bounds__(128) e4m3_kv_pages_kernel(const __grid_constant__ E4M3KvCopyArgs a) {
  grid_dependency_begin();
  const int64_t x = blockIdx.x;
  const int32_t r = blockIdx.y;
  if (r == 0 && threadIdx.x == 0) a.table[x] = static_cast<int32_t>(x);
  const QueryTile blk = a.paged.tile_of(a.cu_seqlens, a.nseq, a.T, a.block_size, x);
  if (blk.count == 0) return;
  const int64_t src0 = a.paged.kv_row(blk, a.block_size);
  const int32_t page = static_cast<int32_t>(src0 / a.block_size);
  if (threadIdx.x == 0)
    a.kv_scale[x * a.Hkv + r] =
        make_float2(page_scale(a.k_scale, a.k_scale_step, page), page_scale(a.v_scale, a.v_scale_step, page));
  const int64_t dst0 = (x * a.block_size * a.Hkv + r) * a.D;
#pragma unroll 1
  for (int w = 0; w < 2; ++w) {
    const uint8_t* src = static_cast<const uint8_t*>(w == 0 ? a.k : a.v) + src0 * (w == 0 ? a.k_s0 : a.v_s0) +
                         r * (w == 0 ? a.k_s1 : a.v_s1);
    Element* dst = static_cast<Element*>(w == 0 ? a.k16 : a.v16) + dst0;
    e4m3_page_rows(src, w == 0 ? a.k_s0 : a.v_s0, dst, int64_t(a.Hkv) * a.D, a.block_size, blk.count, a.D / 16);
  }
}

// e4m3_query_rows_kernel: the FP8 queries of such a prefill: a thread per 16 codes of a
// (token, head) row (a grid-stride loop), exactly into Element at q16, and each row's q_scale
// into q_factor (by the row's first thread).
template <class Element>
__global__ void __launch_bounds__(256) e4m3_query_rows_kernel(const __grid_constant__ E4M3KvCopyArgs a) {
  grid_dependency_begin();
  const int chunks = a.D / 16;
  const int64_t n = int64_t(a.T) * a.Hq * chunks;
  for (int64_t e = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; e < n; e += int64_t(gridDim.x) * blockDim.x) {
    const int64_t row = e / chunks, t = row / a.Hq;
    const int32_t h = static_cast<int32_t>(row % a.Hq), c = static_cast<int32_t>(e % chunks);
    const uint8_t* src = static_cast<const uint8_t*>(a.q) + t * a.q_s0 + h * a.q_s1 + c * 16;
    Element* out = static_cast<Element*>(a.q16) + row * a.D + c * 16;
    e4m3x16_store<Element>(*reinterpret_cast<const uint4*>(src), out, out + 8);
    if (c == 0) a.q_factor[row] = a.q_scale[t * a.qs_s0 + h * a.qs_s1];
  }
}

}  // namespace msa::cuda::kern
