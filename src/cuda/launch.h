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

using forward_args_t = FwdArgs;
using select_args_t = SelectArgs;

// One instantiation per (element type, head dim, block size); defined in generated sources.
template <class Element, int kHeadDim, int kBlockN>
Status launch_forward(const FwdArgs& a);
template <class Element, int kDim, int kBlockN>
Status launch_select(const SelectArgs& a);

}  // namespace msa::cuda
