// Host-side launch arguments of the Hopper kernels: raw pointers and element strides taken from
// validated TensorRefs, so the kernel instantiations need nothing of the public API.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "msa/types.h"

namespace msa::cuda {

struct FwdArgs {
  const void* q;
  int64_t q_s0, q_s1;
  const void* k;
  int64_t k_s0, k_s1;
  const void* v;
  int64_t v_s0, v_s1;
  void* out;
  int64_t o_s0, o_s1;
  float* lse;
  int64_t lse_s0, lse_s1;
  const int32_t* block_idx;  // sparse mode
  int64_t bi_s0, bi_s1;
  const int32_t* cu_seqlens;  // null: one sequence
  int32_t nseq;
  int64_t T;
  int32_t Hq, Hkv, Hi, top_k;
  float scale;
  bool dense;
  bool lse_only;  // LSE only (out unused): the index branch's normaliser over a selection
  cudaStream_t stream;
};

struct SelectArgs {
  const void* q_idx;
  int64_t q_s0, q_s1;
  const void* k_idx;
  int64_t k_s0, k_s1;
  int32_t* block_idx;
  int64_t bi_s0, bi_s1;
  const int32_t* cu_seqlens;
  int32_t nseq;
  int64_t T;
  int32_t Hi, Hik, top_k, sink_blocks, local_blocks;
  float scale_idx;
  cudaStream_t stream;
};

// The KV-side entry lists (kernels/bwd_common.cuh): sorted distinct keys of the reverse index
// and the token bits of each, in sparse mode; dense mode enumerates and needs neither.
struct EntryArgs {
  const uint64_t* keys = nullptr;
  const uint64_t* masks = nullptr;
  const int32_t* count = nullptr;
  int32_t gbits = 0;
};

// The KV-side work list (kernels/bwd_common.cuh): chunks of the per-(KV block, KV head) entry
// lists, one CTA each, on a grid of `grid` CTAs (an upper bound of the chunk count).
struct WorkArgs {
  const int32_t* chunk_start = nullptr;
  const int32_t* num_chunks = nullptr;
  const int32_t* slot_start = nullptr;
  int32_t* arrivals = nullptr;
  float* partials = nullptr;
  int32_t items = 0;
  int32_t chunk = 0;
  int64_t grid = 0;
};

// Attention backward (dq from bwd_q, dk and dv from bwd_kv).
struct BwdArgs {
  const void *q, *k, *v, *dout;
  int64_t q_s0, q_s1, k_s0, k_s1, v_s0, v_s1, do_s0, do_s1;
  const float* lse;
  int64_t lse_s0, lse_s1;
  const float* delta;  // [T, Hq]: rowsum(dO * O)
  void *dq, *dk, *dv;
  int64_t dq_s0, dq_s1, dk_s0, dk_s1, dv_s0, dv_s1;
  const int32_t* block_idx;  // sparse mode
  int64_t bi_s0, bi_s1;
  EntryArgs entries;
  WorkArgs work;
  const int32_t* cu_seqlens;
  int32_t nseq;
  int64_t T;
  int32_t Hq, Hkv;
  int32_t Hi;       // index heads: the column groups of the KV side (and the query tiles in sparse mode)
  int32_t Hi_tile;  // query-side tile head groups (dense mode: Hkv)
  int32_t top_k;
  float scale;
  bool dense;
  cudaStream_t stream;
  // The KL gradient fused into the KV side (kernels/bwd_kv_kernel.cuh, needs Di == D and
  // Hq / Hi a power of two); null q_idx: none. Fixed-point sums, as in KlArgs.
  const void *q_idx = nullptr, *k_idx = nullptr;
  int64_t qi_s0 = 0, qi_s1 = 0, ki_s0 = 0, ki_s1 = 0;
  const float* lse_idx = nullptr;  // [T, Hi]
  unsigned long long *dq_idx = nullptr, *dk_idx = nullptr;
  int32_t Hik = 1;
  float scale_idx = 0.f;
};

// The KL branch as a KV-side pass of its own: the gradient sums and/or the KL terms (fixed
// point, see kernels/kl_kernel.cuh); null outputs are skipped.
struct KlArgs {
  const void *q, *k, *q_idx, *k_idx;
  int64_t q_s0, q_s1, k_s0, k_s1, qi_s0, qi_s1, ki_s0, ki_s1;
  const float* lse;
  int64_t lse_s0, lse_s1;
  const float* lse_idx;  // [T, Hi]
  unsigned long long *dq_idx, *dk_idx, *kl_rows;
  EntryArgs entries;
  WorkArgs work;
  const int32_t* cu_seqlens;
  int32_t nseq;
  int64_t T;
  int32_t Hq, Hkv, Hi, Hik;
  float scale, scale_idx;
  bool dense;
  cudaStream_t stream;
};

using forward_args_t = FwdArgs;
using select_args_t = SelectArgs;
using bwd_q_args_t = BwdArgs;
using bwd_kv_args_t = BwdArgs;
using kl_args_t = KlArgs;

// One instantiation per (element type, head dim, block size); defined in generated sources.
template <class Element, int kHeadDim, int kBlockN>
Status launch_forward(const FwdArgs& a);
template <class Element, int kDim, int kBlockN>
Status launch_select(const SelectArgs& a);
template <class Element, int kHeadDim, int kBlockN>
Status launch_bwd_q(const BwdArgs& a);
template <class Element, int kHeadDim, int kBlockN>
Status launch_bwd_kv(const BwdArgs& a);
// kDim: D == Di.
template <class Element, int kDim, int kBlockN>
Status launch_kl(const KlArgs& a);

}  // namespace msa::cuda
