// The Hopper (sm_90a) backend. Arguments arrive validated by src/api (shapes, dtypes, devices,
// options); these functions add the constraints of the kernels themselves and launch on
// `launch.stream` without synchronising the host. Built only when MSA_WITH_CUDA is defined.
#pragma once

#include "../api/problem.h"
#include "msa/params.h"

namespace msa::cuda {

using detail::Problem;

// A device of compute capability 9.0 is visible to the CUDA runtime.
bool available();

// Spec §2: block_idx (and, when given, lse_idx) from q_idx / k_idx.
Status select_blocks(const Problem& prob, const SelectParams& p);

// Spec §3 / §5: out and lse; runs the selection first when p.select is set. The exact KL value
// (p.kl) is not computed by this backend yet: kNotSupported names the argument.
Status attention_forward(const Problem& prob, const ForwardParams& p);

}  // namespace msa::cuda
