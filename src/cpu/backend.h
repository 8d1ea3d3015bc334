// The CPU backend: the contract (docs/contract.md) followed literally, accumulating in double, multi-threaded over
// independent rows or key blocks. It is the reference for every other backend. Arguments are
// validated by the caller (src/api); these functions assume a valid Problem.
#pragma once

#include "../core/problem.h"
#include "msa/params.h"

namespace msa::cpu {

using detail::Problem;

Status select_blocks(const Problem& prob, const TensorRef& q_idx, const TensorRef& k_idx,
                     const TensorRef& block_idx, const TensorRef& lse_idx);

// out and lse over the support (block_idx, or the causal prefix in kDense mode).
Status attention_forward(const Problem& prob, const ForwardParams& p);

Status attention_backward(const Problem& prob, const BackwardParams& p);

Status kl_divergence(const Problem& prob, const KlParams& p);

// Serving over a paged cache (docs/contract.md §6, src/cpu/paged.cpp): the selection and attention
// of the new tokens at their positions, keys read through the page table; the append copies rows.
Status paged_select_blocks(const Problem& prob, const PagedSelectParams& p);
Status paged_forward(const Problem& prob, const PagedForwardParams& p);
Status paged_append(const Problem& prob, const PagedAppendParams& p);

}  // namespace msa::cpu
