// Value checks of GPU inputs (docs/contract.md §7): cu_seqlens starts at 0, never decreases and
// ends at T; so does cu_seqlens_k (keys apart), ending at Tk, with every sequence's keys at least
// its queries; every entry of a caller's block_idx is -1 or a block in [0, blk(t)] of the token's
// own sequence (t's key position), and no row holds a block twice. A small kernel finds the first offence and the host
// waits for its verdict (one stream synchronisation), so errors name the argument and the entry
// exactly as on the CPU. Launch.check_values = false skips the check; with it set, a stream
// being captured into a CUDA graph is refused (naming 'launch.check_values'), since the wait
// cannot be captured.
#pragma once

#include "plan.h"

namespace msa::cuda {

// block_idx undefined: the offsets only; cu_seqlens_k undefined: the tokens are the keys.
Status check_values(const char* fn, const Problem& prob, const TensorRef& cu_seqlens,
                    const TensorRef& cu_seqlens_k, const TensorRef& block_idx, const Launch& launch);

// A paged call (docs/contract.md §6): cu_seqlens_q starts at 0, never decreases and ends at Tq;
// every sequence's new tokens fit in its seq_lens, which fit in its page table row; n_s <=
// max_q_len (when > 0); the pages of every cached block are pages of the cache; a caller's
// block_idx (undefined: none) holds -1 or blocks up to each token's own, none twice; the
// scales of E4M3 caches and q_scale (FP8 queries; undefined: none) are finite and positive.
Status check_paged_values(const char* fn, const Problem& prob, const TensorRef& cu_seqlens_q,
                          const PagedCache& cache, const TensorRef& block_idx, int32_t max_q_len,
                          const Launch& launch, const TensorRef& q_scale = TensorRef{});

}  // namespace msa::cuda
