// The Hopper (sm_90a) backend. Arguments arrive validated by src/api (shapes, dtypes, devices,
// options); these functions add the constraints of the kernels themselves and launch on
// `launch.stream`. The host waits only for the value checks of cu_seqlens and a caller's
// block_idx (Launch::check_values). Built only when MSA_WITH_CUDA is defined.
#pragma once

#include "../core/problem.h"
#include "msa/params.h"

namespace msa::cuda {

using detail::Problem;

// A device of compute capability 9.0 is visible to the CUDA runtime.
bool available();

// docs/contract.md §2: block_idx (and, when given, lse_idx) from q_idx / k_idx.
Status select_blocks(const Problem& prob, const SelectParams& p);

// docs/contract.md §3 / §5: out and lse; runs the selection first when p.select is set, and the exact KL
// value after when p.kl is given (which needs workspace).
Status attention_forward(const Problem& prob, const ForwardParams& p);

// docs/contract.md §4 / §5: dq, dk, dv and, when given, dq_idx, dk_idx (host/backward.cu).
Status attention_backward(const Problem& prob, const BackwardParams& p);

// docs/contract.md §4: the exact KL value and its per-row terms (host/backward.cu).
Status kl_divergence(const Problem& prob, const KlParams& p);

// Device workspace of each call, in bytes (0 when the arguments are not supported).
size_t forward_workspace(const Problem& prob, const ForwardParams& p);
size_t select_workspace(const Problem& prob, const SelectParams& p);
size_t backward_workspace(const Problem& prob, const BackwardParams& p);
size_t kl_workspace(const Problem& prob, const KlParams& p);

// docs/contract.md §6, serving over a paged cache (host/paged.cu). `prob` describes the new
// tokens: T = Tq, heads and dims from q / q_idx and the cache, k; prob.cu stays empty.
Status paged_select_blocks(const Problem& prob, const PagedSelectParams& p);
Status paged_forward(const Problem& prob, const PagedForwardParams& p);
Status paged_append(const PagedAppendParams& p);
size_t paged_select_workspace(const Problem& prob, const PagedSelectParams& p);
size_t paged_forward_workspace(const Problem& prob, const PagedForwardParams& p);

}  // namespace msa::cuda
