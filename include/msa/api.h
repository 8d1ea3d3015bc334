// Entry points of the public MSA API. Each call validates every argument before it touches any
// data (docs/contract.md §7), then dispatches on the tensors' device to a backend. Nothing here throws: the
// result is a Status whose message names the offending argument.
#pragma once

#include <cstddef>

#include "msa/params.h"
#include "msa/types.h"

namespace msa {

Status select_blocks(const SelectParams& p);
Status forward(const ForwardParams& p);
Status backward(const BackwardParams& p);
Status kl_divergence(const KlParams& p);

// Serving over a paged KV cache (docs/contract.md §6). A call allocates nothing and, with
// launch.check_values = false, never waits for the GPU: it can be captured into a CUDA graph and
// replayed with new seq_lens, cu_seqlens_q values and page tables (same shapes).
Status paged_select_blocks(const PagedSelectParams& p);
Status paged_forward(const PagedForwardParams& p);
Status paged_append(const PagedAppendParams& p);

// Device workspace each call needs, in bytes: 0 on the CPU backend (which allocates host memory
// itself) and for parameters that fail validation (the call then reports the error).
size_t workspace_size(const SelectParams& p);
size_t workspace_size(const ForwardParams& p);
size_t workspace_size(const BackwardParams& p);
size_t workspace_size(const KlParams& p);
// The serving calls' workspace depends on shapes and options only (never on lengths): size it
// once per batch shape ("plan"), then run every step in it.
size_t workspace_size(const PagedSelectParams& p);
size_t workspace_size(const PagedForwardParams& p);

// Whether a backend for this device type is compiled in and can run here (kCuda: the library was
// built with its CUDA backend and a GPU of compute capability 9.0 is visible).
bool backend_available(DeviceType device);

const char* version();

}  // namespace msa
