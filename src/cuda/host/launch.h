// The launch of one kernel instantiation (defined in launch.cuh, instantiated per variant in
// generated sources): Args (args.h) -> the kernel's Params (TMA descriptors added) -> launch on
// `stream`. Called through dispatch() (variants.h).
#pragma once

#include <cuda_runtime.h>

#include "args.h"
#include "plan.h"
#include "msa/types.h"

namespace msa::cuda {

template <class Element, int kHeadDim, int kBlockN>
Status launch_forward(const FwdArgs& a, cudaStream_t stream);
template <class Element, int kDim, int kBlockN>
Status launch_select(const SelectArgs& a, cudaStream_t stream);
template <class Element, int kHeadDim, int kBlockN>
Status launch_bwd_q(const BwdQArgs& a, cudaStream_t stream);
// dq = scale * dS K from the dS tiles bwd_kv wrote, for one pass of tokens.
template <class Element, int kHeadDim, int kBlockN>
Status launch_bwd_dq(const BwdDqArgs& a, cudaStream_t stream);
// With the KL gradient when a.q_idx is set (kDim: D == Di), with the KL branch's teacher when
// a.teacher is.
template <class Element, int kHeadDim, int kBlockN>
Status launch_bwd_kv(const BwdKvArgs& a, cudaStream_t stream);
template <class Element, int kDim, int kBlockN>
Status launch_kl(const KlArgs& a, cudaStream_t stream);
// The KL gradient from the teacher bwd_kv wrote (one pass of records); with a.lse_part, the
// index branch's LSE partials over every record instead.
template <class Element, int kDim, int kBlockN>
Status launch_kl_grad(const KlArgs& a, cudaStream_t stream);
// The KV-block-outer forward over one pass of tokens: partials, then their combine.
template <class Element, int kHeadDim, int kBlockN>
Status launch_fwd_kv(const FwdKvArgs& a, cudaStream_t stream);

// The paged (serving) kernels: block scores of one pass of tokens; attention and, with splits,
// its combine.
template <class Element, int kDim, int kBlockN>
Status launch_paged_score(const PagedScoreArgs& a, cudaStream_t stream);
template <class Element, int kHeadDim, int kBlockN>
Status launch_paged_attn(const PagedAttnArgs& a, cudaStream_t stream);

// The forward kernel of the variant (dt, dim, bk) (forward.cu); `arg` names the tensor whose
// dtype and head dim pick it.
Status run_forward(const char* fn, const char* arg, const FwdArgs& a, DType dt, int32_t dim,
                   int32_t bk, cudaStream_t stream);

// The sparse forward over a selection in passes of pl.fwd_tokens tokens (forward.cu): the
// KV-block pass, the split, or kAuto's choice between the split and the plain query tiles of
// `q` (automatic), the plan `pl` (fwd_kv_plan) in `ws`; `a` and `q` the two passes' arguments
// over the same tokens and keys (packed, or a prefill's paged cache); dt: q's dtype.
Status run_forward_passes(const char* fn, const Problem& prob, DType dt, FwdKvArgs a, FwdArgs q,
                          const TensorRef& block_idx, const Plan& pl, bool split, bool automatic,
                          void* ws, cudaStream_t stream);

}  // namespace msa::cuda
