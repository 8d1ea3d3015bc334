// The host side of the re-ranking of FP8 shortlists (Options.fp8_rerank > 0;
// kernels/rerank_kernel.cuh): the steps around the select kernel and the score kernel, which
// launch_select (launch.cuh) runs in this order after the select kernel:
//   rerank_lists  the segments' counts, starts and chunks (CUB scans) and their entry lists;
//   (the score kernel)
//   rerank_pick   the free slots chosen into block_idx.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "../../core/status.h"
#include "args.h"

namespace msa::cuda {

// CUB's temporary bytes for the scans over n segments.
size_t rerank_cub_bytes(int64_t n);

Status rerank_lists(const char* fn, const SelectArgs& a, cudaStream_t stream);
Status rerank_pick(const char* fn, const SelectArgs& a, cudaStream_t stream);

}  // namespace msa::cuda
