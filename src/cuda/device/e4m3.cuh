// float8 E4M3 cache tiles in the paged (serving) kernels (docs/contract.md §6).
//
// A tile of E4M3 codes is copied into shared memory as it is (half the bytes of a 16-bit
// cache), then converted to the queries' 16-bit type: in shared memory into a 16-bit tile that
// the kernel's MMAs read as they read a bfloat16 or float16 cache (convert_e4m3_tile: for tiles
// every warp reads), or in registers straight into a warp's MMA fragments (load_e4m3_a: for
// rows one warp reads alone). The conversion is exact: every E4M3 value (3 mantissa bits,
// exponents -9 .. 8, NaN) is a bfloat16 and a float16 value. The scale of the tile's page is
// applied to fp32 results: a block's scores (K, k_idx) or its probabilities (V), so a call
// computes over the dequantised cache float32(value * scale[page]) up to the order of the fp32
// roundings.
#pragma once

#include <cuda_fp16.h>
#include <cuda_bf16.h>
#include <cuda_fp8.h>

#include "paged.cuh"

namespace msa::cuda::kern {

// A [kRows, kDim] tile of E4M3 codes viewed as [kRows, kDim / 2] 16-bit words, with the
// 16-bit tiles' swizzle (16-byte chunks XOR-ed across 8-row groups), so that the 16-bit row
// loaders (load.cuh) copy its rows 16 bytes at a time.
template <int kRows, int kDim>
using E4M3SmemLayout = Sm80SmemLayout<uint16_t, kRows, kDim / 2>;

// The scale of a page: scale[page * step] (step 0: one scale for the tensor).
__device__ __forceinline__ float page_scale(const float* scale, int64_t step, int32_t page) {
  return scale[page * step];
}

// Four E4M3 codes (byte i of w is code i) as two pairs of Element (codes 0, 1 and 2, 3).
template <class Element>
__device__ __forceinline__ uint2 e4m3x4_to(uint32_t w) {
  const __half2_raw lo = __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(w & 0xffffu), __NV_E4M3);
  const __half2_raw hi = __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(w >> 16), __NV_E4M3);
  if constexpr (std::is_same_v<Element, cutlass::half_t>) {
    return make_uint2(uint32_t(lo.x) | (uint32_t(lo.y) << 16), uint32_t(hi.x) | (uint32_t(hi.y) << 16));
  } else {
    // float16 -> float32 -> bfloat16: both steps exact for E4M3 values.
    const __nv_bfloat162 a = __float22bfloat162_rn(__half22float2(__half2(lo)));
    const __nv_bfloat162 b = __float22bfloat162_rn(__half22float2(__half2(hi)));
    return make_uint2(*reinterpret_cast<const uint32_t*>(&a), *reinterpret_cast<const uint32_t*>(&b));
  }
}

// Sixteen E4M3 codes (w) as Element values: codes 0-7 into the 16-byte chunk lo, 8-15 into hi.
template <class Element>
__device__ __forceinline__ void e4m3x16_store(const uint4& w, void* lo, void* hi) {
  const uint2 a = e4m3x4_to<Element>(w.x), b = e4m3x4_to<Element>(w.y);
  const uint2 x = e4m3x4_to<Element>(w.z), y = e4m3x4_to<Element>(w.w);
  *reinterpret_cast<uint4*>(lo) = make_uint4(a.x, a.y, b.x, b.y);
  *reinterpret_cast<uint4*>(hi) = make_uint4(x.x, x.y, y.x, y.y);
}

// Converts the codes of `raw` (E4M3SmemLayout<kRows, kDim>) into `dst` (the 16-bit tile,
// Sm80SmemLayout<Element, kRows, kDim>), 16 codes per step of each of nthreads threads.
template <class Element, int kRows, int kDim, class Raw, class Dst>
__device__ inline void convert_e4m3_tile(const Raw& raw, Dst& dst, int tid, int nthreads) {
  constexpr int kChunks = kDim / 16;
  for (int e = tid; e < kRows * kChunks; e += nthreads) {
    const int row = e / kChunks, c = e % kChunks;
    e4m3x16_store<Element>(*reinterpret_cast<const uint4*>(&raw(row, c * 8)), &dst(row, c * 16), &dst(row, c * 16 + 8));
  }
}

// FP8 queries: rows of E4M3 codes read from global memory (row_ptr(r): row r's kDim codes,
// 16-byte aligned; null: a zero row) into the 16-bit tile dst (Sm80SmemLayout<Element, kRows,
// kDim>), converted exactly. Plain loads and stores: a barrier before the tile's readers
// publishes it.
template <class Element, int kRows, int kDim, class Dst, class RowPtr>
__device__ inline void load_e4m3_rows(Dst& dst, RowPtr row_ptr, int tid, int nthreads) {
  constexpr int kChunks = kDim / 16;
  for (int e = tid; e < kRows * kChunks; e += nthreads) {
    const int row = e / kChunks, c = e % kChunks;
    const uint8_t* src = row_ptr(row);
    const uint4 w = src != nullptr ? *reinterpret_cast<const uint4*>(src + c * 16) : make_uint4(0, 0, 0, 0);
    e4m3x16_store<Element>(w, &dst(row, c * 16), &dst(row, c * 16 + 8));
  }
}

// The MMA dim order of E4M3 operands converted in registers (load_e4m3_a): within each group of
// 16 dims, MMA dims {2c, 2c + 1} are dims {4c, 4c + 1} and MMA dims {2c + 8, 2c + 9} are dims
// {4c + 2, 4c + 3} (c = 0 .. 3). Rewrites the 16-bit tile `s` ([kRows, kDim]) into that order,
// so that its ldmatrix fragments meet the converted codes dim for dim. In 32-bit pairs of a
// group, p0 .. p7 -> p0 p2 p4 p6 | p1 p3 p5 p7.
template <int kRows, int kDim, class Tile>
__device__ inline void permute_e4m3_dims(Tile& s, int tid, int nthreads) {
  constexpr int kGroups = kDim / 16;
  for (int e = tid; e < kRows * kGroups; e += nthreads) {
    const int row = e / kGroups, g = e % kGroups;
    uint4* lo = reinterpret_cast<uint4*>(&s(row, 16 * g));
    uint4* hi = reinterpret_cast<uint4*>(&s(row, 16 * g + 8));
    const uint4 x = *lo, y = *hi;
    *lo = make_uint4(x.x, x.z, y.x, y.z);
    *hi = make_uint4(x.y, x.w, y.y, y.w);
  }
}

// The A fragments (SM80 m16n8k16, 16-bit) of this warp's key rows from a tile of E4M3 codes
// `raw` (E4M3SmemLayout), in the dim order of permute_e4m3_dims: per 32-dim slice and 16-row
// tile, one ldmatrix.x4 of code rows (matrices: rows 0-7 and 8-15 of the tile x the slice's two
// 16-byte halves) gives each thread codes 4c .. 4c + 3 of rows g and g + 8 of both 16-dim groups;
// converted, their low pairs are the fragment's dims {2c, 2c + 1}, their high pairs {2c + 8,
// 2c + 9}. key_base[m]: the first row of the warp's m-th tile; tSrA: (MMA, MMA_M, MMA_K) as
// from partition_fragment_A. mma(kk) runs as soon as k-step kk's fragments are complete.
template <class Element, class Raw, class Frag, class Mma>
__device__ __forceinline__ void load_e4m3_a(const Raw& raw, const int32_t* key_base, Frag& tSrA, Mma&& mma) {
  constexpr int kTilesM = decltype(size<1>(tSrA))::value;
  constexpr int kSteps = decltype(size<2>(tSrA))::value;  // k16 steps
  Tensor a32 = recast<uint32_t>(tSrA);
  static_assert(decltype(size<0>(a32))::value == 4, "an m16n8k16 A fragment is four 32-bit registers");
  const int lane = threadIdx.x % 32;
  const int row_in = (lane / 8 % 2) * 8 + lane % 8, half = lane / 16;  // this lane's ldmatrix row
#pragma unroll
  for (int j = 0; j < kSteps / 2; ++j) {
#pragma unroll
    for (int m = 0; m < kTilesM; ++m) {
      uint32_t r[4];
      SM75_U32x4_LDSM_N::copy(*reinterpret_cast<const uint128_t*>(&raw(key_base[m] + row_in, 16 * j + 8 * half)),
                              r[0], r[1], r[2], r[3]);
#pragma unroll
      for (int h = 0; h < 2; ++h) {  // k-step 2j + h: matrices 2h (rows g) and 2h + 1 (rows g + 8)
        const uint2 top = e4m3x4_to<Element>(r[2 * h]), bottom = e4m3x4_to<Element>(r[2 * h + 1]);
        a32(0, m, 2 * j + h) = top.x;
        a32(1, m, 2 * j + h) = bottom.x;
        a32(2, m, 2 * j + h) = top.y;
        a32(3, m, 2 * j + h) = bottom.y;
      }
    }
    mma(2 * j);
    mma(2 * j + 1);
  }
}

// Whether every element of this thread's share of a bfloat16 tile s ([kRows, kDim], rows of
// 16-byte chunks) is a float16 value too (no overflow, no bits lost below float16's
// subnormals; NaN counts as not), so that the tile converts to float16 exactly.
template <int kRows, int kDim, class Tile>
__device__ inline bool half_exact_tile(const Tile& s, int tid, int nthreads) {
  constexpr int kChunks = kDim / 8;
  bool exact = true;
  for (int e = tid; e < kRows * kChunks; e += nthreads) {
    const int row = e / kChunks, c = e % kChunks;
    const uint4 w = *reinterpret_cast<const uint4*>(&s(row, c * 8));
    const __nv_bfloat162* v = reinterpret_cast<const __nv_bfloat162*>(&w);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const float2 f = __bfloat1622float2(v[i]);
      const float2 g = __half22float2(__float22half2_rn(f));
      exact &= g.x == f.x && g.y == f.y;
    }
  }
  return exact;
}

// The bfloat16 tile s converted in place to float16 (exact where half_exact_tile holds).
template <int kRows, int kDim, class Tile>
__device__ inline void to_half_tile(Tile& s, int tid, int nthreads) {
  constexpr int kChunks = kDim / 8;
  for (int e = tid; e < kRows * kChunks; e += nthreads) {
    const int row = e / kChunks, c = e % kChunks;
    uint4* p = reinterpret_cast<uint4*>(&s(row, c * 8));
    uint4 w = *p;
    uint32_t* x = reinterpret_cast<uint32_t*>(&w);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const __half2 h = __float22half2_rn(__bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&x[i])));
      x[i] = *reinterpret_cast<const uint32_t*>(&h);
    }
    *p = w;
  }
}

// The E4M3 code nearest to x (ties to even), saturated to +-448; NaN stays NaN.
__device__ __forceinline__ uint8_t e4m3_from_float(float x) {
  return static_cast<uint8_t>(__nv_cvt_float_to_fp8(x, __NV_SATFINITE, __NV_E4M3));
}

}  // namespace msa::cuda::kern
