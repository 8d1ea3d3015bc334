// Value checks of GPU inputs (docs/contract.md §7): cu_seqlens starts at 0, never decreases and
// ends at T; every entry of a caller's block_idx is -1 or a block in [0, blk(t)] of the token's own
// sequence, and no row holds a block twice. A small kernel finds the first offence and the host
// waits for its verdict (one stream synchronisation), so errors name the argument and the entry
// exactly as on the CPU. Launch.check_values = false skips the check; with it set, a stream
// being captured into a CUDA graph is refused (naming 'launch.check_values'), since the wait
// cannot be captured.
#pragma once

#include "plan.h"

namespace msa::cuda {

// block_idx undefined: cu_seqlens only.
Status check_values(const char* fn, const Problem& prob, const TensorRef& cu_seqlens,
                    const TensorRef& block_idx, const Launch& launch);

}  // namespace msa::cuda
