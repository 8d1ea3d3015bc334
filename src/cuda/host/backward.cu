// The Hopper backend's backward and KL value: host orchestration and the small kernels around
// the three main ones.
//
// backward:  Delta = rowsum(dO * O)                          (delta_kernel)
//            reverse index of block_idx (sparse mode)        (key_kernel, CUB sort + reduce-by-key)
//            dq                                              (bwd_q_kernel, query side)
//            KL branch, when dq_idx or dk_idx is wanted:
//              LSE_idx over the support                      (forward kernel, LSE-only mode)
//            dk, dv; with the KL branch also the fixed-point sums of dq_idx, dk_idx
//                                                            (bwd_kv_kernel, KV side)
//              (sparse mode: LSE_idx by the LSE pass;        (kl_lse_kernel, lse_combine_kernel)
//               bwd_kv_kernel writes the teacher,            (bwd_kv_kernel, kl_grad_kernel,
//               a pass of its own takes the sums, dq_idx      in passes over the records)
//               as a row per selected block, added in
//               column order                                 (dq_idx_combine_kernel)
//               Hq / Hi not a power of two: a separate pass  (kl_kernel))
//              scale by gamma * scale_idx / (N Hi), convert  (finalize_grad_kernel)
// sparse mode with dq from dS (Options.dq_pass; backward_from_ds), in passes of tokens:
//            Delta, then per pass: the reverse index of its rows; LSE_idx of its rows (KL);
//            dk, dv (fp32 sums across passes), the teacher and the pass's dS tiles
//                                                            (bwd_kv_kernel)
//            the KL gradient's sums and dq_idx's rows        (kl_grad_kernel)
//            dq = scale * dS K                               (bwd_dq_kernel, query side)
//            dq_idx of the pass's tokens                     (dq_idx_combine_kernel)
//            then dk, dv from the sums (several passes)      (finalize_dkv_kernel)
// kl value:  reverse index, LSE_idx, kl_kernel's per-row terms, then finalize_kl_kernel.
//
// Every step is deterministic: no floating-point atomics anywhere. Plans, Args and limits are in
// plan.cu, the reverse index and work lists in reverse_index.cu.
#include <cuda_runtime.h>

#include <cutlass/array.h>
#include <cutlass/numeric_types.h>

#include <algorithm>
#include <string>

#include "../backend.h"
#include "../device/entry_list.cuh"
#include "../device/grid_dependency.cuh"
#include "check_values.h"
#include "common.h"
#include "launch.h"
#include "plan.h"
#include "reverse_index.h"
#include "variants.h"

namespace msa::cuda {
namespace {

// ------------------------------------------------------------------------------ small kernels

// delta[t, h] = sum_d dout[t, h, d] * out[t, h, d] (fp32), by kLanes = D / 8 lanes per (t, h),
// each 8 elements of both rows in 16-byte loads (plan.cu checks that dout and out are 16-byte
// aligned; D is 64 or 128, the compiled head dims), then a butterfly sum over the lanes.
template <class Element, int kLanes>
__global__ void delta_kernel(const Element* dout, int64_t do_s0, int64_t do_s1, const Element* out,
                             int64_t o_s0, int64_t o_s1, int64_t rows, int32_t Hq, float* delta) {
  grid_dependency_begin();
  const int64_t g = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t row = g / kLanes;
  const int c = static_cast<int>(g % kLanes);
  float acc = 0.f;
  if (row < rows) {  // every lane stays for the shuffles
    const int64_t t = row / Hq;
    const int32_t h = static_cast<int32_t>(row - t * Hq);
    const uint4 a = *reinterpret_cast<const uint4*>(dout + t * do_s0 + h * do_s1 + 8 * c);
    const uint4 b = *reinterpret_cast<const uint4*>(out + t * o_s0 + h * o_s1 + 8 * c);
    const Element* ea = reinterpret_cast<const Element*>(&a);
    const Element* eb = reinterpret_cast<const Element*>(&b);
#pragma unroll
    for (int i = 0; i < 8; ++i) acc += static_cast<float>(ea[i]) * static_cast<float>(eb[i]);
  }
#pragma unroll
  for (int o = kLanes / 2; o > 0; o >>= 1) acc += __shfl_xor_sync(0xffffffff, acc, o);
  if (row < rows && c == 0) delta[row] = acc;
}

template <class Element>
void launch_delta(const TensorRef& dout, const TensorRef& out, int64_t rows, int32_t Hq, int32_t D,
                  float* delta, cudaStream_t stream) {
  const auto* a = static_cast<const Element*>(dout.data);
  const auto* b = static_cast<const Element*>(out.data);
  const int blocks = static_cast<int>((rows * (D / 8) + 255) / 256);
  if (D == 128)
    launch_grid(delta_kernel<Element, 16>, blocks, 256, 0, stream, a, dout.stride[0], dout.stride[1], b,
                out.stride[0], out.stride[1], rows, Hq, delta);
  else
    launch_grid(delta_kernel<Element, 8>, blocks, 256, 0, stream, a, dout.stride[0], dout.stride[1], b,
                out.stride[0], out.stride[1], rows, Hq, delta);
}

// out[t, h, :] = acc[t, h, :] * 2^-32 * coef, coef = base * kl_weight * (kl_grad ? kl_grad[0] : 1):
// four values a thread (two 16-byte loads of the sums; one 8-byte store where the output's rows
// allow it: `vec`), a row's D / 4 threads one after another (d4_shift = log2(D / 4): D is 64 or
// 128, the compiled head dims).
template <class Element>
__global__ void finalize_grad_kernel(const unsigned long long* acc, int64_t rows, int32_t H,
                                     int d4_shift, Element* out, int64_t s0, int64_t s1, bool vec,
                                     const float* kl_grad, double base) {
  grid_dependency_begin();
  const double coef = base * (kl_grad != nullptr ? static_cast<double>(kl_grad[0]) : 1.0) /
                      kern::kFixedOne;
  const int64_t n4 = (rows * H) << d4_shift;
  const int32_t d4_mask = (1 << d4_shift) - 1;
  for (int64_t e = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; e < n4;
       e += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t row = e >> d4_shift;
    const int32_t d = 4 * static_cast<int32_t>(e & d4_mask);
    const int64_t t = row / H;
    const int32_t h = static_cast<int32_t>(row - t * H);
    const longlong2 a = reinterpret_cast<const longlong2*>(acc)[2 * e];
    const longlong2 b = reinterpret_cast<const longlong2*>(acc)[2 * e + 1];
    cutlass::Array<Element, 4> o;
    o[0] = static_cast<Element>(static_cast<float>(static_cast<double>(a.x) * coef));
    o[1] = static_cast<Element>(static_cast<float>(static_cast<double>(a.y) * coef));
    o[2] = static_cast<Element>(static_cast<float>(static_cast<double>(b.x) * coef));
    o[3] = static_cast<Element>(static_cast<float>(static_cast<double>(b.y) * coef));
    Element* dst = out + t * s0 + h * s1 + d;
    if (vec) {
      *reinterpret_cast<cutlass::Array<Element, 4>*>(dst) = o;
    } else {
#pragma unroll
      for (int i = 0; i < 4; ++i) dst[i] = o[i];
    }
  }
}

// dk = scale * dk_sum, dv = dv_sum: the fp32 sums of the backward's passes of tokens
// ([T, Hkv, D], contiguous) into the outputs' element type.
template <class Element>
__global__ void finalize_dkv_kernel(const float* dk_sum, const float* dv_sum, int64_t T, int32_t Hkv,
                                    int32_t D, Element* dk, int64_t dk_s0, int64_t dk_s1, Element* dv,
                                    int64_t dv_s0, int64_t dv_s1, float scale) {
  grid_dependency_begin();
  const int64_t n = T * Hkv * D / 2;  // D is even
  for (int64_t e = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; e < n;
       e += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t row = 2 * e / D;
    const int32_t d = static_cast<int32_t>(2 * e - row * D);
    const int64_t t = row / Hkv;
    const int32_t h = static_cast<int32_t>(row - t * Hkv);
    const float2 k2 = reinterpret_cast<const float2*>(dk_sum)[e];
    const float2 v2 = reinterpret_cast<const float2*>(dv_sum)[e];
    cutlass::Array<Element, 2> a, b;
    a[0] = static_cast<Element>(k2.x * scale);
    a[1] = static_cast<Element>(k2.y * scale);
    b[0] = static_cast<Element>(v2.x);
    b[1] = static_cast<Element>(v2.y);
    *reinterpret_cast<cutlass::Array<Element, 2>*>(dk + t * dk_s0 + h * dk_s1 + d) = a;
    *reinterpret_cast<cutlass::Array<Element, 2>*>(dv + t * dv_s0 + h * dv_s1 + d) = b;
  }
}

// dq_idx of the tokens [t0, t0 + rows / H) from their rows of products (kl_grad_kernel's
// KvSideArgs::dq_part, [rows, k, D] fp32): out[t, h, :] = coef * the sum, in column order, of the
// row's products, coef = base * (kl_grad ? kl_grad[0] : 1) as finalize_grad_kernel's, without
// its fixed-point unit. A column counts where the LSE pass wrote its partial
// (lse_part [T, H, k]: sum not 0, NaN included): the two passes take the same records, and a
// column no record holds (no block, a block repeated in the row, past the causal limit) was
// never written. A warp a row; lane j takes dims 4j .. 4j + 3 (D = 64 or 128).
template <class Element>
__global__ void dq_idx_combine_kernel(const float* part, const float2* lse_part, int64_t t0, int64_t rows,
                                      int32_t H, int32_t k, int32_t D, Element* out, int64_t s0, int64_t s1,
                                      bool vec, const float* kl_grad, double base) {
  grid_dependency_begin();
  const double coef = base * (kl_grad != nullptr ? static_cast<double>(kl_grad[0]) : 1.0);
  const int lane = threadIdx.x & 31, d = 4 * lane;
  const int64_t warp = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) / 32;
  const int64_t warps = static_cast<int64_t>(gridDim.x) * blockDim.x / 32;
  for (int64_t row = warp; row < rows; row += warps) {  // warp-uniform
    const float2* marks = lse_part + (t0 * H + row) * k;
    const float* src = part + row * k * D + d;
    float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
    for (int32_t c0 = 0; c0 < k; c0 += 32) {
      uint32_t cols = __ballot_sync(0xffffffffu, c0 + lane < k && marks[c0 + lane].y != 0.f);
      while (cols != 0u) {
        const int32_t c = c0 + __ffs(cols) - 1;
        cols &= cols - 1;
        if (d < D) {
          const float4 v = *reinterpret_cast<const float4*>(src + int64_t(c) * D);
          acc.x += v.x;
          acc.y += v.y;
          acc.z += v.z;
          acc.w += v.w;
        }
      }
    }
    if (d >= D) continue;
    const int64_t t = t0 + row / H;
    const int32_t h = static_cast<int32_t>(row % H);
    cutlass::Array<Element, 4> o;
    o[0] = static_cast<Element>(static_cast<float>(static_cast<double>(acc.x) * coef));
    o[1] = static_cast<Element>(static_cast<float>(static_cast<double>(acc.y) * coef));
    o[2] = static_cast<Element>(static_cast<float>(static_cast<double>(acc.z) * coef));
    o[3] = static_cast<Element>(static_cast<float>(static_cast<double>(acc.w) * coef));
    Element* dst = out + t * s0 + h * s1 + d;
    if (vec) {
      *reinterpret_cast<cutlass::Array<Element, 4>*>(dst) = o;
    } else {
#pragma unroll
      for (int i = 0; i < 4; ++i) dst[i] = o[i];
    }
  }
}

// LSE_idx[row] (natural log) from kl_lse_kernel's per-slot (max in log2 units, sum) partials
// (sum 0: no partial there). `lanes` (16 or 32, >= min(k, 32)) lanes per row, 32 / lanes rows a
// warp: lane j of a row takes slots j, j + lanes, ...; the max and the sum are then butterfly
// reductions over the row's lanes (a fixed order: the same bits every run).
__global__ void lse_combine_kernel(const float2* part, int64_t rows, int32_t k, int lanes, float* lse_idx) {
  grid_dependency_begin();
  const int lane = threadIdx.x & 31, sub = lane & (lanes - 1);
  const int64_t rows_per_warp = 32 / lanes;
  const int64_t warp = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) / 32;
  const int64_t warps = static_cast<int64_t>(gridDim.x) * blockDim.x / 32;
  for (int64_t r0 = warp * rows_per_warp; r0 < rows; r0 += warps * rows_per_warp) {  // warp-uniform
    const int64_t row = r0 + lane / lanes;
    const float2* pr = part + row * k;
    float mx = -INFINITY;
    if (row < rows)
      for (int32_t s = sub; s < k; s += lanes) {
        const float2 v = pr[s];
        if (v.y > 0.f) mx = fmaxf(mx, v.x);
      }
    for (int o = lanes / 2; o > 0; o >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
    float sum = 0.f;
    if (row < rows)
      for (int32_t s = sub; s < k; s += lanes) {
        const float2 v = pr[s];
        if (v.y > 0.f) sum += v.y * exp2f(v.x - mx);
      }
    for (int o = lanes / 2; o > 0; o >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
    if (row < rows && sub == 0)
      lse_idx[row] = sum > 0.f ? (mx + log2f(sum)) * 0.69314718055994531f : -INFINITY;
  }
}

// kl[0] = sum of the rows / (N Hi); kl_rows (optional) the rows themselves. One block; the sum
// is over integers, so its order does not matter.
__global__ void finalize_kl_kernel(const unsigned long long* rows_acc, int64_t T, int32_t Hi,
                                   float* kl, float* kl_rows, int64_t kr_s0, int64_t kr_s1) {
  grid_dependency_begin();
  __shared__ unsigned long long part[32];
  unsigned long long sum = 0;
  const int64_t n = T * Hi;
  for (int64_t e = threadIdx.x; e < n; e += blockDim.x) {
    sum += rows_acc[e];
    if (kl_rows != nullptr) {
      const int64_t t = e / Hi;
      kl_rows[t * kr_s0 + (e - t * Hi) * kr_s1] =
          static_cast<float>(static_cast<double>(static_cast<long long>(rows_acc[e])) / kern::kFixedOne);
    }
  }
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) sum += __shfl_xor_sync(0xffffffff, sum, o);
  if ((threadIdx.x & 31) == 0) part[threadIdx.x / 32] = sum;
  __syncthreads();
  if (threadIdx.x == 0) {
    unsigned long long total = 0;
    for (int w = 0; w < static_cast<int>(blockDim.x / 32); ++w) total += part[w];
    kl[0] = n > 0 ? static_cast<float>(static_cast<double>(static_cast<long long>(total)) /
                                       kern::kFixedOne / static_cast<double>(n))
                  : 0.f;
  }
}

// Zeroes a [rows, H, D] tensor of 16-bit elements (strides s0, s1 in elements).
__global__ void zero_rows_kernel(uint16_t* out, int64_t rows, int32_t H, int32_t D, int64_t s0, int64_t s1) {
  grid_dependency_begin();
  const int64_t n = rows * H * D;
  for (int64_t e = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; e < n;
       e += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t row = e / D;
    const int64_t t = row / H;
    out[t * s0 + (row - t * H) * s1 + (e - row * D)] = 0;
  }
}

// ------------------------------------------------------------------------------ steps

// A call whose keys no query sees (keys apart, T = 0): dk, dv and dk_idx (if wanted) are zeros.
Status zero_key_grads(const char* fn, const Problem& prob, const BackwardParams& p, cudaStream_t stream) {
  const TensorRef* outs[3] = {&p.dk, &p.dv, &p.dk_idx};
  for (const TensorRef* t : outs) {
    if (!t->defined() || t->shape[0] == 0) continue;
    const int64_t n = t->shape[0] * t->shape[1] * t->shape[2];
    const int blocks = static_cast<int>(std::min<int64_t>((n + 255) / 256, num_sms() * 32));
    launch_grid(zero_rows_kernel, blocks, 256, 0, stream, static_cast<uint16_t*>(t->data), t->shape[0],
                static_cast<int32_t>(t->shape[1]), static_cast<int32_t>(t->shape[2]), t->stride[0],
                t->stride[1]);
  }
  const cudaError_t e = cudaGetLastError();
  return e == cudaSuccess ? Status::Ok() : cuda_error(fn, e);
}

// Zeroes the fixed-point sums of the KL gradient (grad) or of the KL terms.
Status zero_kl_sums(const char* fn, const Plan& pl, const Problem& prob, void* ws,
                    cudaStream_t stream) {
  // (dq_idx by rows of products, pl.dq_rows: no sums to zero.)
  const size_t acc_bytes = !pl.grad ? 8 * size_t(prob.T) * prob.Hi
                           : pl.dq_rows ? 0 : 8 * size_t(prob.T) * prob.Hi * prob.Di;
  cudaError_t e = acc_bytes == 0 ? cudaSuccess
                                 : cudaMemsetAsync(pl.grad ? at<void>(ws, pl.dq_acc) : at<void>(ws, pl.kl_acc), 0,
                                                   acc_bytes, stream);
  if (e == cudaSuccess && pl.grad)
    e = cudaMemsetAsync(at<void>(ws, pl.dk_acc), 0, 8 * size_t(prob.Tk) * prob.Hik * prob.Di, stream);
  return e == cudaSuccess ? Status::Ok() : cuda_error(fn, e);
}

// The KV-side entry and work lists of the plan into `a` (sparse mode: the reverse index first).
Status kv_lists(const char* fn, const Plan& pl, const Plan::Work& w, const Problem& prob,
                const TensorRef& block_idx, void* ws, cudaStream_t stream, KvSideArgs* a,
                bool entries_built) {
  if (pl.sparse && !entries_built)
    MSA_TRY(build_entries(fn, pl, prob, block_idx, a->cu_seqlens, a->nseq, 0, prob.T, ws, stream,
                          &a->list, a->paged));
  if (!pl.sparse) a->list.dense = true;
  return build_work(fn, pl, w, prob, a->list, a->cu_seqlens, a->nseq, ws, stream, &a->work, &a->grid,
                    a->paged);
}

// LSE_idx over the support into the plan's buffer (the forward kernel in LSE-only mode).
Status index_lse(const char* fn, const Plan& pl, const Problem& prob, const KlInputs& in, void* ws,
                 cudaStream_t stream) {
  const FwdArgs f = index_lse_args(prob, in, at<float>(ws, pl.lse_idx), prob.Hi, 1);
  return run_forward(fn, "q_idx", f, in.q_idx.dtype, prob.Di, prob.opts.block_size, stream);
}

// The KL branch as a pass of its own: LSE_idx, zeroed sums, kl_kernel into them.
Status run_kl(const char* fn, const Plan& pl, const Problem& prob, const KlInputs& in, KlArgs a,
              void* ws, cudaStream_t stream) {
  MSA_TRY(index_lse(fn, pl, prob, in, ws, stream));
  a.lse_idx = at<float>(ws, pl.lse_idx);
  a.dq_idx = pl.grad ? at<unsigned long long>(ws, pl.dq_acc) : nullptr;
  a.dk_idx = pl.grad ? at<unsigned long long>(ws, pl.dk_acc) : nullptr;
  a.kl_rows = pl.grad ? nullptr : at<unsigned long long>(ws, pl.kl_acc);
  MSA_TRY(zero_kl_sums(fn, pl, prob, ws, stream));
  return dispatch(fn, "q", in.q.dtype, prob.D, prob.opts.block_size, [&](auto v) {
    using V = decltype(v);
    return launch_kl<typename V::Element, V::kDim, V::kBlockN>(a, stream);
  });
}

template <class Element>
Status finalize_grad(const unsigned long long* acc, int64_t T, int32_t H, int32_t D,
                     const TensorRef& out, const float* kl_grad, double base, cudaStream_t stream) {
  const int64_t n4 = T * H * D / 4;
  const int blocks = static_cast<int>(std::min<int64_t>((n4 + 255) / 256, num_sms() * 32));
  if (n4 == 0) return Status::Ok();
  launch_grid(
      finalize_grad_kernel<Element>, blocks, 256, 0, stream, acc, T, H, D == 128 ? 5 : 4,
      static_cast<Element*>(out.data), out.stride[0], out.stride[1],
      reinterpret_cast<uintptr_t>(out.data) % 8 == 0 && out.stride[0] % 4 == 0 && out.stride[1] % 4 == 0,
      kl_grad, base);
  return Status::Ok();
}

// The KL gradient's scale: base = kl_weight * scale_idx / (N Hi) on the host, times kl_grad[0]
// on the device where kl_grad is given (null: 1).
const float* kl_grad_scale(const BackwardParams& p) {
  return p.kl_grad.defined() ? static_cast<const float*>(p.kl_grad.data) : nullptr;
}
double kl_base(const Problem& prob, const BackwardParams& p) {
  return static_cast<double>(p.kl_weight) * prob.opts.scale_idx / (static_cast<double>(prob.T) * prob.Hi);
}

// The KL gradient's sums scaled into dq_idx and dk_idx (finalize_grad_kernel).
Status finalize_kl_grad(const Problem& prob, const BackwardParams& p, const Plan& pl, void* ws,
                        cudaStream_t stream) {
  const float* kl_grad = kl_grad_scale(p);
  const double base = kl_base(prob, p);
  const bool bf16 = p.q_idx.dtype == DType::kBFloat16;
  for (int which = 0; which < 2; ++which) {
    const TensorRef& out = which == 0 ? p.dq_idx : p.dk_idx;
    if (!out.defined() || (which == 0 && pl.dq_rows)) continue;  // rows: combine_dq_idx, per pass
    const auto* acc = at<unsigned long long>(ws, which == 0 ? pl.dq_acc : pl.dk_acc);
    const int32_t H = which == 0 ? prob.Hi : prob.Hik;
    const int64_t rows = which == 0 ? prob.T : prob.Tk;  // dk_idx: the key rows
    MSA_TRY(bf16 ? finalize_grad<cutlass::bfloat16_t>(acc, rows, H, prob.Di, out, kl_grad, base, stream)
                 : finalize_grad<cutlass::half_t>(acc, rows, H, prob.Di, out, kl_grad, base, stream));
  }
  return Status::Ok();
}

// dq_idx of the tokens [t0, t1) from the rows of products of their pass (pl.dq_rows; the pass's
// kl_grad launches done): dq_idx_combine_kernel.
Status combine_dq_idx(const Problem& prob, const BackwardParams& p, const Plan& pl, void* ws, int64_t t0,
                      int64_t t1, cudaStream_t stream) {
  const TensorRef& out = p.dq_idx;
  const int64_t rows = (t1 - t0) * prob.Hi;
  if (!pl.dq_rows || !out.defined() || rows == 0) return Status::Ok();
  const float* kl_grad = kl_grad_scale(p);
  const double base = kl_base(prob, p);
  const int blocks = static_cast<int>(std::min<int64_t>((rows * 32 + 255) / 256, num_sms() * 32));
  const bool vec =
      reinterpret_cast<uintptr_t>(out.data) % 8 == 0 && out.stride[0] % 4 == 0 && out.stride[1] % 4 == 0;
  const float* part = at<float>(ws, pl.dq_part);
  const float2* marks = at<float2>(ws, pl.lse_part);
  if (p.q_idx.dtype == DType::kBFloat16)
    launch_grid(dq_idx_combine_kernel<cutlass::bfloat16_t>, blocks, 256, 0, stream, part, marks, t0, rows,
                prob.Hi, prob.k, prob.Di, static_cast<cutlass::bfloat16_t*>(out.data), out.stride[0],
                out.stride[1], vec, kl_grad, base);
  else
    launch_grid(dq_idx_combine_kernel<cutlass::half_t>, blocks, 256, 0, stream, part, marks, t0, rows, prob.Hi,
                prob.k, prob.Di, static_cast<cutlass::half_t*>(out.data), out.stride[0], out.stride[1], vec,
                kl_grad, base);
  return Status::Ok();
}

// The teacher route's gradient pass (kl_grad_kernel) over bwd_kv's lists, whose pointers the
// caller sets per reverse index; bwd_kv writes the teacher it reads.
KlArgs teacher_args(const Problem& prob, const KlInputs& in, const Plan& pl, void* ws, BwdKvArgs* kv) {
  KlArgs g = kl_args(prob, in);
  g.lse_idx = at<float>(ws, pl.lse_idx);
  if (pl.dq_rows) g.dq_part = at<float>(ws, pl.dq_part);
  else g.dq_idx = at<unsigned long long>(ws, pl.dq_acc);
  g.dk_idx = at<unsigned long long>(ws, pl.dk_acc);
  kv->teacher = g.teacher = at<float>(ws, pl.teacher_buf);
  g.step_records = pl.step_records;
  return g;
}

// The teacher route's KL kernels over bwd_kv's entries (kv's lists, built), in chunks of their
// own: pieces of bwd_kv's (Plan::kl_work's chunk divides Plan::kv's), so that each takes the
// pass of the bwd_kv chunk it is a piece of; the order of the fixed-point sums does not matter.
Status teacher_lists(const char* fn, const Plan& pl, const Problem& prob, const BwdKvArgs& kv,
                     void* ws, cudaStream_t stream, KlArgs* g) {
  g->list = kv.list;
  g->pass_chunk = kv.work.chunk;
  return build_work(fn, pl, pl.kl_work, prob, kv.list, kv.cu_seqlens, kv.nseq, ws, stream, &g->work, &g->grid,
                    kv.paged);
}

// The teacher route's LSE_idx partials zeroed ([T, Hi, k]: a slot no record writes reads as
// holding no partial).
Status zero_lse_part(const char* fn, const Plan& pl, const Problem& prob, void* ws, cudaStream_t stream) {
  const cudaError_t e =
      cudaMemsetAsync(at<void>(ws, pl.lse_part), 0, 8 * size_t(prob.T) * prob.Hi * size_t(prob.k), stream);
  return e == cudaSuccess ? Status::Ok() : cuda_error(fn, e);
}

// LSE_idx of the rows of tokens [t0, t1) over their selected blocks: the LSE pass
// (kl_lse_kernel) over every record of bwd_kv's lists (the tokens' own) and work list, then the
// partials added in column order.
template <class V>
Status teacher_lse(const Plan& pl, const Problem& prob, KlArgs g, const BwdKvArgs& kv, void* ws, int64_t t0,
                   int64_t t1, cudaStream_t stream) {
  g.work = kv.work;
  g.grid = kv.grid;
  g.pass_first = g.pass_end = 0;
  g.step_records = pl.lse_step_records;
  g.lse_part = at<float>(ws, pl.lse_part);
  MSA_TRY((launch_kl_grad<typename V::Element, V::kDim, V::kBlockN>(g, stream)));
  const int64_t rows = (t1 - t0) * prob.Hi;
  const int lanes = prob.k <= 16 ? 16 : 32;
  const int64_t threads = rows * lanes;
  const int blocks = static_cast<int>(std::min<int64_t>((threads + 255) / 256, num_sms() * 32));
  launch_grid(lse_combine_kernel, blocks, 256, 0, stream,
              reinterpret_cast<const float2*>(g.lse_part) + t0 * prob.Hi * prob.k, rows, prob.k, lanes,
              at<float>(ws, pl.lse_idx) + t0 * prob.Hi);
  return Status::Ok();
}

// bwd_kv over its work list, and with the teacher route kl_grad after it, in the plan's passes
// over the records: each pass's teacher is written by bwd_kv and read by kl_grad before the next.
template <class V>
Status kv_side(const Plan& pl, BwdKvArgs& kv, KlArgs& g, cudaStream_t stream) {
  for (int32_t pass = 0; pass < pl.passes; ++pass) {
    if (pl.teacher) {
      kv.pass_first = g.pass_first = pass * pl.pass_records;
      kv.pass_end = g.pass_end = (pass + 1) * pl.pass_records;
    }
    MSA_TRY((launch_bwd_kv<typename V::Element, V::kDim, V::kBlockN>(kv, stream)));
    if (pl.teacher) MSA_TRY((launch_kl_grad<typename V::Element, V::kDim, V::kBlockN>(g, stream)));
  }
  return Status::Ok();
}

// dk = scale * dk_sum, dv = dv_sum (finalize_dkv_kernel), over the key rows.
template <class Element>
void finalize_dkv(const Problem& prob, const BackwardParams& p, const BwdKvArgs& kv, cudaStream_t stream) {
  const int64_t n = prob.Tk * prob.Hkv * prob.D / 2;
  if (n == 0) return;
  const int blocks = static_cast<int>(std::min<int64_t>((n + 255) / 256, num_sms() * 32));
  launch_grid(finalize_dkv_kernel<Element>, blocks, 256, 0, stream, kv.dk_acc, kv.dv_acc, prob.Tk, prob.Hkv,
              prob.D, static_cast<Element*>(p.dk.data), p.dk.stride[0], p.dk.stride[1],
              static_cast<Element*>(p.dv.data), p.dv.stride[0], p.dv.stride[1], prob.opts.scale);
}

// The sparse backward with dq from dS (pl.bwd_tokens > 0; KL gradient, if any, by kTeacher), in
// passes of pl.bwd_tokens tokens. Each pass: the reverse index of its rows and the work list;
// with the KL gradient, LSE_idx of its rows (the LSE pass over its records and the combine);
// bwd_kv (dK and dV, the teacher, the pass's dS tiles) and kl_grad over its records
// (in passes of records when the teacher's budget needs them); then dq of its tokens
// (bwd_dq_kernel). With one pass bwd_kv writes dK and dV; with several it adds them to fp32 sums
// in pass order (deterministic), converted at the end. `kv`: bwd_kv's Args (delta set).
Status backward_from_ds(const Problem& prob, const BackwardParams& p, const Plan& pl, BwdKvArgs kv,
                        cudaStream_t stream) {
  const char* fn = "backward";
  void* ws = p.launch.workspace;
  const KlInputs kl_in(p);
  KlArgs g;  // the KL gradient, if any, takes the teacher route (dq_from_ds)
  if (pl.teacher) {
    MSA_TRY(zero_kl_sums(fn, pl, prob, ws, stream));
    MSA_TRY(zero_lse_part(fn, pl, prob, ws, stream));
    g = teacher_args(prob, kl_in, pl, ws, &kv);
  }
  kv.ds = at<void>(ws, pl.ds);
  if (pl.bwd_passes > 1) {
    kv.dk_acc = at<float>(ws, pl.dk_sum);
    kv.dv_acc = at<float>(ws, pl.dv_sum);
    const size_t bytes = sizeof(float) * size_t(prob.Tk) * prob.Hkv * prob.D;
    cudaError_t e = cudaMemsetAsync(kv.dk_acc, 0, bytes, stream);
    if (e == cudaSuccess) e = cudaMemsetAsync(kv.dv_acc, 0, bytes, stream);
    if (e != cudaSuccess) return cuda_error(fn, e);
  }
  BwdDqArgs dq = bwd_dq_args(prob, p);
  dq.ds = kv.ds;
  for (int64_t c0 = 0; c0 < prob.T; c0 += pl.bwd_tokens) {
    const int64_t c1 = std::min<int64_t>(prob.T, c0 + pl.bwd_tokens);
    MSA_TRY(build_entries(fn, pl, prob, p.block_idx, kv.cu_seqlens, kv.nseq, c0, c1, ws, stream, &kv.list,
                          kv.paged));
    MSA_TRY(build_work(fn, pl, pl.kv, prob, kv.list, kv.cu_seqlens, kv.nseq, ws, stream, &kv.work, &kv.grid,
                       kv.paged));
    if (pl.teacher) MSA_TRY(teacher_lists(fn, pl, prob, kv, ws, stream, &g));
    kv.ds_tok_lo = g.part_tok_lo = c0;
    set_tile_pass(&dq, c0, c1);
    MSA_TRY(dispatch(fn, "q", p.q.dtype, prob.D, prob.opts.block_size, [&](auto v) {
      using V = decltype(v);
      if (pl.teacher) MSA_TRY(teacher_lse<V>(pl, prob, g, kv, ws, c0, c1, stream));
      MSA_TRY(kv_side<V>(pl, kv, g, stream));
      return launch_bwd_dq<typename V::Element, V::kDim, V::kBlockN>(dq, stream);
    }));
    if (pl.teacher) MSA_TRY(combine_dq_idx(prob, p, pl, ws, c0, c1, stream));
  }
  if (pl.bwd_passes > 1) {
    if (p.q.dtype == DType::kBFloat16) finalize_dkv<cutlass::bfloat16_t>(prob, p, kv, stream);
    else finalize_dkv<cutlass::half_t>(prob, p, kv, stream);
  }
  if (pl.kl) MSA_TRY(finalize_kl_grad(prob, p, pl, ws, stream));
  const cudaError_t e = cudaGetLastError();
  return e == cudaSuccess ? Status::Ok() : cuda_error(fn, e);
}

}  // namespace

size_t backward_workspace(const Problem& prob, const BackwardParams& p) {
  Plan pl;
  return backward_plan(prob, p, &pl).ok() ? pl.total : 0;
}

size_t kl_workspace(const Problem& prob, const KlParams& p) {
  Plan pl;
  return kl_plan("kl_divergence", prob, KlInputs(p), &pl).ok()
             ? pl.total
             : 0;
}

Status attention_backward(const Problem& prob, const BackwardParams& p) {
  const char* fn = "backward";
  Plan pl;
  MSA_TRY(backward_plan(prob, p, &pl));
  MSA_TRY(need_workspace(fn, pl, p.launch));
  if (prob.T == 0 && prob.Tk == 0) return Status::Ok();
  DeviceGuard guard(p.q.device.index);
  MSA_TRY(check_values(fn, prob, p.cu_seqlens, p.cu_seqlens_k, pl.sparse ? p.block_idx : TensorRef{}, p.launch));
  const cudaStream_t stream = static_cast<cudaStream_t>(p.launch.stream);
  if (prob.T == 0) return zero_key_grads(fn, prob, p, stream);  // keys apart, no query sees them
  void* ws = p.launch.workspace;

  float* delta = at<float>(ws, pl.delta);
  if (p.q.dtype == DType::kBFloat16)
    launch_delta<cutlass::bfloat16_t>(p.dout, p.out, prob.T * prob.Hq, prob.Hq, prob.D, delta, stream);
  else
    launch_delta<cutlass::half_t>(p.dout, p.out, prob.T * prob.Hq, prob.Hq, prob.D, delta, stream);
  BwdKvArgs kv = bwd_kv_args(prob, p, delta);
  if (pl.bwd_tokens > 0) return backward_from_ds(prob, p, pl, kv, stream);
  MSA_TRY(kv_lists(fn, pl, pl.kv, prob, p.block_idx, ws, stream, &kv, false));
  const KlInputs kl_in(p);
  const bool fused = kv.q_idx != nullptr;  // bwd_kv_args set the index branch: KlRoute::kFused
  KlArgs g;  // pl.teacher: the gradient pass over bwd_kv's work list
  if (fused) MSA_TRY(index_lse(fn, pl, prob, kl_in, ws, stream));
  if (fused || pl.teacher) MSA_TRY(zero_kl_sums(fn, pl, prob, ws, stream));
  if (fused) {
    kv.lse_idx = at<float>(ws, pl.lse_idx);
    kv.dq_idx = at<unsigned long long>(ws, pl.dq_acc);
    kv.dk_idx = at<unsigned long long>(ws, pl.dk_acc);
  }
  if (pl.teacher) {
    MSA_TRY(zero_lse_part(fn, pl, prob, ws, stream));
    g = teacher_args(prob, kl_in, pl, ws, &kv);
    MSA_TRY(teacher_lists(fn, pl, prob, kv, ws, stream, &g));
  }
  const BwdQArgs q = bwd_q_args(prob, p, delta);
  MSA_TRY(dispatch(fn, "q", p.q.dtype, prob.D, prob.opts.block_size, [&](auto v) {
    using V = decltype(v);
    if (pl.teacher) MSA_TRY(teacher_lse<V>(pl, prob, g, kv, ws, 0, prob.T, stream));
    MSA_TRY((launch_bwd_q<typename V::Element, V::kDim, V::kBlockN>(q, stream)));
    return kv_side<V>(pl, kv, g, stream);
  }));
  if (pl.teacher) MSA_TRY(combine_dq_idx(prob, p, pl, ws, 0, prob.T, stream));

  if (pl.kl && !fused && !pl.teacher) {
    KlArgs a = kl_args(prob, kl_in);
    a.list = kv.list;  // the same reverse index
    MSA_TRY(kv_lists(fn, pl, pl.kl_work, prob, p.block_idx, ws, stream, &a, true));
    MSA_TRY(run_kl(fn, pl, prob, kl_in, a, ws, stream));
  }
  if (pl.kl) MSA_TRY(finalize_kl_grad(prob, p, pl, ws, stream));
  const cudaError_t e = cudaGetLastError();
  return e == cudaSuccess ? Status::Ok() : cuda_error(fn, e);
}

Status kl_divergence(const Problem& prob, const KlParams& p) {
  const char* fn = "kl_divergence";
  Plan pl;
  const KlInputs in(p);
  MSA_TRY(kl_plan(fn, prob, in, &pl));
  MSA_TRY(need_workspace(fn, pl, p.launch));
  DeviceGuard guard(p.q.device.index);
  const cudaStream_t stream = static_cast<cudaStream_t>(p.launch.stream);
  void* ws = p.launch.workspace;
  if (prob.T == 0) {  // keys apart: their offsets are still checked, as on the CPU
    if (prob.keys_apart) MSA_TRY(check_values(fn, prob, p.cu_seqlens, p.cu_seqlens_k, TensorRef{}, p.launch));
    const cudaError_t e = cudaMemsetAsync(p.kl.data, 0, sizeof(float), stream);
    return e == cudaSuccess ? Status::Ok() : cuda_error(fn, e);
  }
  MSA_TRY(check_values(fn, prob, p.cu_seqlens, p.cu_seqlens_k, pl.sparse ? p.block_idx : TensorRef{}, p.launch));
  KlArgs a = kl_args(prob, in);
  MSA_TRY(kv_lists(fn, pl, pl.kl_work, prob, p.block_idx, ws, stream, &a, false));
  MSA_TRY(run_kl(fn, pl, prob, in, a, ws, stream));
  launch_grid(finalize_kl_kernel, 1, 1024, 0, stream, at<unsigned long long>(ws, pl.kl_acc), prob.T, prob.Hi,
              static_cast<float*>(p.kl.data),
              p.kl_rows.defined() ? static_cast<float*>(p.kl_rows.data) : nullptr,
              p.kl_rows.defined() ? p.kl_rows.stride[0] : 0, p.kl_rows.defined() ? p.kl_rows.stride[1] : 0);
  const cudaError_t e = cudaGetLastError();
  return e == cudaSuccess ? Status::Ok() : cuda_error(fn, e);
}

}  // namespace msa::cuda
