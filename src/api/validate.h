// Argument validation for every entry point (docs/contract.md §7). Each function checks the parameters
// completely, without launching anything, and fills a Problem on success. Messages have the form
//   msa::<entry>: argument '<name>': <what was expected>, got <what was passed>
#pragma once

#include "msa/params.h"
#include "../core/problem.h"

namespace msa::detail {

Status validate(const SelectParams& p, Problem* prob);
Status validate(const ForwardParams& p, Problem* prob);
Status validate(const BackwardParams& p, Problem* prob);
Status validate(const KlParams& p, Problem* prob);

// Serving over a paged cache (docs/contract.md §6). `prob` describes the new tokens: T = Tq, the
// heads and dims of q / q_idx and the cache, k, dtype, opts with the scales resolved; prob->cu
// holds cu_seqlens_q for CPU tensors only. The batch's values (cu_seqlens_q, seq_lens, the
// page ids in use, a caller's block_idx) are checked here for CPU tensors; the CUDA backend
// checks those of CUDA tensors.
Status validate(const PagedSelectParams& p, Problem* prob);
Status validate(const PagedForwardParams& p, Problem* prob);
// paged_append has no Problem of its own; the overload with one fills T = Tq, block_size and
// (on the CPU) cu.
Status validate(const PagedAppendParams& p);
Status validate(const PagedAppendParams& p, Problem* prob);

}  // namespace msa::detail
