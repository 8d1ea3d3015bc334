// The Hopper backend's host side: the kernels' own constraints (on top of src/api's
// validation), then dispatch to one instantiation per (dtype, head dim, block size).
#include <cuda_runtime.h>

#include <cutlass/numeric_types.h>

#include <string>

#include "backend.h"
#include "host_util.h"
#include "launch.h"

namespace msa::cuda {
namespace {

template <int kDim, int kBlockN>
Status select_dtype(const SelectArgs& a, DType dt) {
  if (dt == DType::kBFloat16) return launch_select<cutlass::bfloat16_t, kDim, kBlockN>(a);
#if !MSA_CUDA_FAST_BUILD
  return launch_select<cutlass::half_t, kDim, kBlockN>(a);
#else
  return Status::NotSupported("msa::select_blocks: float16 is not built into this library");
#endif
}

template <int kDim, int kBlockN>
Status forward_dtype(const FwdArgs& a, DType dt) {
  if (dt == DType::kBFloat16) return launch_forward<cutlass::bfloat16_t, kDim, kBlockN>(a);
#if !MSA_CUDA_FAST_BUILD
  return launch_forward<cutlass::half_t, kDim, kBlockN>(a);
#else
  return Status::NotSupported("msa::forward: float16 is not built into this library");
#endif
}

Status dispatch_select(const SelectArgs& a, DType dt, int32_t Di, int32_t Bk) {
#if MSA_CUDA_FAST_BUILD
  if (Di == 128 && Bk == 128) return select_dtype<128, 128>(a, dt);
  return Status::NotSupported("msa::select_blocks: only Di = 128, block_size = 128 are built");
#else
  if (Di == 64) return Bk == 64 ? select_dtype<64, 64>(a, dt) : select_dtype<64, 128>(a, dt);
  return Bk == 64 ? select_dtype<128, 64>(a, dt) : select_dtype<128, 128>(a, dt);
#endif
}

}  // namespace

Status dispatch_forward(const FwdArgs& a, DType dt, int32_t D, int32_t Bk) {
#if MSA_CUDA_FAST_BUILD
  if (D == 128 && Bk == 128) return forward_dtype<128, 128>(a, dt);
  return Status::NotSupported("msa::forward: only D = 128, block_size = 128 are built");
#else
  if (D == 64) return Bk == 64 ? forward_dtype<64, 64>(a, dt) : forward_dtype<64, 128>(a, dt);
  return Bk == 64 ? forward_dtype<128, 64>(a, dt) : forward_dtype<128, 128>(a, dt);
#endif
}

namespace {

Status check_select(const char* fn, const Problem& prob, const TensorRef& q_idx,
                    const TensorRef& k_idx) {
  MSA_TRY(check_half(fn, "q_idx", q_idx));
  MSA_TRY(check_head_dim(fn, "q_idx", prob.Di));
  MSA_TRY(check_block_size(fn, prob.opts.block_size));
  MSA_TRY(check_aligned(fn, "q_idx", q_idx));
  MSA_TRY(check_aligned(fn, "k_idx", k_idx));
  if (prob.idx_per_key() > 128)
    return fail(fn, "q_idx", "the CUDA backend takes at most 128 index heads per index key head");
  return Status::Ok();
}

SelectArgs select_args(const Problem& prob, const TensorRef& q_idx, const TensorRef& k_idx,
                       const TensorRef& cu, const TensorRef& block_idx, cudaStream_t stream) {
  SelectArgs a{};
  a.q_idx = q_idx.data;
  a.q_s0 = q_idx.stride[0];
  a.q_s1 = q_idx.stride[1];
  a.k_idx = k_idx.data;
  a.k_s0 = k_idx.stride[0];
  a.k_s1 = k_idx.stride[1];
  a.block_idx = static_cast<int32_t*>(block_idx.data);
  a.bi_s0 = block_idx.stride[0];
  a.bi_s1 = block_idx.stride[1];
  a.cu_seqlens = cu.defined() ? static_cast<const int32_t*>(cu.data) : nullptr;
  a.nseq = num_seqs(cu);
  a.T = prob.T;
  a.Hi = prob.Hi;
  a.Hik = prob.Hik;
  a.top_k = prob.k;
  a.sink_blocks = prob.opts.sink_blocks;
  a.local_blocks = prob.opts.local_blocks;
  a.scale_idx = prob.opts.scale_idx;
  a.stream = stream;
  return a;
}

// The KL value of a forward call: over the forward's own LSE and support.
KlParams kl_params(const ForwardParams& p) {
  KlParams kp;
  kp.q = p.q;
  kp.k = p.k;
  kp.lse = p.lse;
  kp.q_idx = p.q_idx;
  kp.k_idx = p.k_idx;
  kp.cu_seqlens = p.cu_seqlens;
  kp.block_idx = p.block_idx;
  kp.kl = p.kl;
  kp.opts = p.opts;
  kp.launch = p.launch;
  return kp;
}

}  // namespace

bool available() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess || n == 0) {
    cudaGetLastError();
    return false;
  }
  for (int d = 0; d < n; ++d) {
    cudaDeviceProp prop;
    if (cudaGetDeviceProperties(&prop, d) == cudaSuccess && prop.major == 9) return true;
  }
  return false;
}

Status select_blocks(const Problem& prob, const SelectParams& p) {
  const char* fn = "select_blocks";
  MSA_TRY(check_select(fn, prob, p.q_idx, p.k_idx));
  if (p.lse_idx.defined() && prob.Hi > 128)
    return fail(fn, "lse_idx", "the CUDA backend computes it for at most 128 index heads");
  if (prob.T == 0) return Status::Ok();
  DeviceGuard guard(p.q_idx.device.index);
  const cudaStream_t stream = static_cast<cudaStream_t>(p.launch.stream);
  const SelectArgs a = select_args(prob, p.q_idx, p.k_idx, p.cu_seqlens, p.block_idx, stream);
  MSA_TRY(dispatch_select(a, p.q_idx.dtype, prob.Di, prob.opts.block_size));
  if (!p.lse_idx.defined()) return Status::Ok();
  // lse_idx: the forward kernel in LSE-only mode over the index branch (queries q_idx, keys
  // k_idx, one selection row per index head, scale_idx).
  FwdArgs f{};
  f.q = p.q_idx.data;
  f.q_s0 = p.q_idx.stride[0];
  f.q_s1 = p.q_idx.stride[1];
  f.k = f.v = p.k_idx.data;
  f.k_s0 = f.v_s0 = p.k_idx.stride[0];
  f.k_s1 = f.v_s1 = p.k_idx.stride[1];
  f.lse = static_cast<float*>(p.lse_idx.data);
  f.lse_s0 = p.lse_idx.stride[0];
  f.lse_s1 = p.lse_idx.stride[1];
  f.block_idx = a.block_idx;
  f.bi_s0 = a.bi_s0;
  f.bi_s1 = a.bi_s1;
  f.cu_seqlens = a.cu_seqlens;
  f.nseq = a.nseq;
  f.T = prob.T;
  f.Hq = prob.Hi;
  f.Hkv = prob.Hik;
  f.Hi = prob.Hi;
  f.top_k = prob.k;
  f.scale = prob.opts.scale_idx;
  f.lse_only = true;
  f.stream = stream;
  return dispatch_forward(f, p.q_idx.dtype, prob.Di, prob.opts.block_size);
}

Status attention_forward(const Problem& prob, const ForwardParams& p) {
  const char* fn = "forward";
  const bool dense = prob.opts.mode == Mode::kDense;
  MSA_TRY(check_half(fn, "q", p.q));
  MSA_TRY(check_head_dim(fn, "q", prob.D));
  MSA_TRY(check_block_size(fn, prob.opts.block_size));
  MSA_TRY(check_aligned(fn, "q", p.q));
  MSA_TRY(check_aligned(fn, "k", p.k));
  MSA_TRY(check_aligned(fn, "v", p.v));
  if (p.out.stride[0] % 2 != 0 || p.out.stride[1] % 2 != 0 ||
      reinterpret_cast<uintptr_t>(p.out.data) % 4 != 0)
    return fail(fn, "out", "the CUDA backend needs 4-byte aligned rows (even strides)");
  // Rows of a tile: the query heads of one index head (dense mode: of one KV head).
  const int32_t tile_heads = dense ? prob.Hkv : prob.Hi;
  if (prob.Hq / tile_heads > 128)
    return fail(fn, "q", "the CUDA backend takes at most 128 query heads per index head");
  if (!dense && p.select) MSA_TRY(check_select(fn, prob, p.q_idx, p.k_idx));
  if (prob.T == 0) return Status::Ok();
  if (prob.T >= (int64_t(1) << 31)) return fail(fn, "q", "more than 2^31 - 1 tokens");

  DeviceGuard guard(p.q.device.index);
  const cudaStream_t stream = static_cast<cudaStream_t>(p.launch.stream);
  if (!dense && p.select) {
    const SelectArgs sa = select_args(prob, p.q_idx, p.k_idx, p.cu_seqlens, p.block_idx, stream);
    MSA_TRY(dispatch_select(sa, p.q_idx.dtype, prob.Di, prob.opts.block_size));
  }
  FwdArgs a{};
  a.q = p.q.data;
  a.q_s0 = p.q.stride[0];
  a.q_s1 = p.q.stride[1];
  a.k = p.k.data;
  a.k_s0 = p.k.stride[0];
  a.k_s1 = p.k.stride[1];
  a.v = p.v.data;
  a.v_s0 = p.v.stride[0];
  a.v_s1 = p.v.stride[1];
  a.out = p.out.data;
  a.o_s0 = p.out.stride[0];
  a.o_s1 = p.out.stride[1];
  a.lse = static_cast<float*>(p.lse.data);
  a.lse_s0 = p.lse.stride[0];
  a.lse_s1 = p.lse.stride[1];
  a.block_idx = dense ? nullptr : static_cast<const int32_t*>(p.block_idx.data);
  a.bi_s0 = dense ? 0 : p.block_idx.stride[0];
  a.bi_s1 = dense ? 0 : p.block_idx.stride[1];
  a.cu_seqlens = p.cu_seqlens.defined() ? static_cast<const int32_t*>(p.cu_seqlens.data) : nullptr;
  a.nseq = num_seqs(p.cu_seqlens);
  a.T = prob.T;
  a.Hq = prob.Hq;
  a.Hkv = prob.Hkv;
  // Dense mode has no index heads to follow: one tile row group per KV head.
  a.Hi = dense ? prob.Hkv : prob.Hi;
  a.top_k = prob.k;
  a.scale = prob.opts.scale;
  a.dense = dense;
  a.stream = stream;
  MSA_TRY(dispatch_forward(a, p.q.dtype, prob.D, prob.opts.block_size));
  if (!p.kl.defined()) return Status::Ok();
  return kl_divergence(prob, kl_params(p));
}

size_t forward_workspace(const Problem& prob, const ForwardParams& p) {
  return p.kl.defined() ? kl_workspace(prob, kl_params(p)) : 0;
}

}  // namespace msa::cuda
