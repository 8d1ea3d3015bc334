// Online softmax over a tile of scores held in wgmma accumulators (FlashAttention's running
// max / running sum), in the base-2 domain: p = exp2(s * scale_log2 - m * scale_log2).
// Masked scores are -inf. A row that has seen only -inf keeps max -inf and sum 0.
#pragma once

#include <cmath>

#include "utils.cuh"

namespace msa::cuda::kern {

// 2^x with the MUFU unit (ex2.approx: 2^-inf = 0, NaN stays NaN).
__device__ __forceinline__ float fast_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

template <int kRows>
struct OnlineSoftmax {
  float row_max[kRows];
  float row_sum[kRows];  // this thread's partial sum; reduced over the quad at the end
  float scale_log2;      // > 0
  float v_unit = 1.f;    // update_scaled: the value scale the output accumulator is in

  __device__ explicit OnlineSoftmax(float scale_log2_) : scale_log2(scale_log2_) {
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      row_max[r] = -INFINITY;
      row_sum[r] = 0.f;
    }
  }

  // scores: row/column view (kRows, *). Turns the scores into unnormalised probabilities and
  // returns in corr the factor by which each row's output accumulator must be rescaled (the
  // change of its running max); see rescale.
  template <class TS>
  __device__ void update(TS& scores, float (&corr)[kRows]) {
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      float m = row_max[r];
#pragma unroll
      for (int c = 0; c < size<1>(scores); ++c) m = fmaxf(m, scores(r, c));
      m = quad_max(m);
      const float m_scaled = m == -INFINITY ? 0.f : m * scale_log2;
      corr[r] = row_max[r] == -INFINITY ? 0.f : fast_exp2(row_max[r] * scale_log2 - m_scaled);
      row_max[r] = m;
      float sum = 0.f;
#pragma unroll
      for (int c = 0; c < size<1>(scores); ++c) {
        const float p = fast_exp2(fmaf(scores(r, c), scale_log2, -m_scaled));
        scores(r, c) = p;
        sum += p;
      }
      row_sum[r] = row_sum[r] * corr[r] + sum;
    }
  }

  // update() for a block whose keys and values carry factors ks[r] (per row: the page's k scale
  // times the row's query scale), vs > 0 (an E4M3 cache page's scales; the scores are those of
  // the codes): the row max is taken over ks[r] * scores. The
  // output accumulator is kept in units of the last block's vs (v_unit): corr carries the
  // change of unit with the change of max, so P stays in [0, 1] (no underflow in fp16) and
  // values_to_units() applies the last unit before the output is normalised.
  template <class TS>
  __device__ void update_scaled(TS& scores, float (&corr)[kRows], const float (&ks)[kRows], float vs) {
    const float unit = v_unit / vs;
    v_unit = vs;
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      const float c = scale_log2 * ks[r];
      float m = -INFINITY;
#pragma unroll
      for (int col = 0; col < size<1>(scores); ++col) m = fmaxf(m, scores(r, col));
      m = fmaxf(row_max[r], quad_max(m) * ks[r]);
      const float m_scaled = m == -INFINITY ? 0.f : m * scale_log2;
      const float change = row_max[r] == -INFINITY ? 0.f : fast_exp2(row_max[r] * scale_log2 - m_scaled);
      row_max[r] = m;
      float sum = 0.f;
#pragma unroll
      for (int col = 0; col < size<1>(scores); ++col) {
        const float p = fast_exp2(fmaf(scores(r, col), c, -m_scaled));
        scores(r, col) = p;
        sum += p;
      }
      row_sum[r] = row_sum[r] * change + sum;
      corr[r] = change * unit;
    }
  }
  // The accumulator of update_scaled's blocks in true units.
  template <class TO>
  __device__ void values_to_units(TO& acc) const {
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
#pragma unroll
      for (int col = 0; col < size<1>(acc); ++col) acc(r, col) *= v_unit;
    }
  }

  template <class TO>
  __device__ static void rescale(TO& acc, const float (&corr)[kRows]) {
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
#pragma unroll
      for (int c = 0; c < size<1>(acc); ++c) acc(r, c) *= corr[r];
    }
  }

  // Normalises acc; returns each row's natural-log LSE (scale = scale_log2 / log2(e)) via lse.
  template <class TO>
  __device__ void finalize(TO& acc, float scale, float (&lse)[kRows]) {
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      const float sum = quad_sum(row_sum[r]);
      const float inv = sum == 0.f ? 0.f : 1.f / sum;
      lse[r] = sum == 0.f ? -INFINITY : row_max[r] * scale + logf(sum);
#pragma unroll
      for (int c = 0; c < size<1>(acc); ++c) acc(r, c) *= inv;
    }
  }
};

}  // namespace msa::cuda::kern
