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

}  // namespace msa::detail
