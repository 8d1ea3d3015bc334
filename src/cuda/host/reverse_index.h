// The reverse index of a selection and the KV-side work lists, shared by every KV-block-outer
// pass (the backward's KV side, the KL branch):
//   build_entries  block_idx -> one key per (token, index head, slot): (segment = (KV tile, KV
//                  head, index head of it), token, slot), sorted (CUB radix sort), repeats dropped,
//                  and each segment's run of tokens cut into records of m consecutive tokens (the
//                  entries read by kern::EntryList, device/entry_list.cuh), with each segment's
//                  first record (a list is two loads, not two binary searches);
//   build_work     each (KV block, KV head) item's entry list cut into chunks of at most
//                  `chunk` entries, one CTA each, the items longest first, laid out by an
//                  exclusive scan, and each CTA's chunk in a table (kern::CtaWork): up to 8192
//                  items by one CTA (CUB's block sort and scans), more by CUB's device-wide ones.
// Dense mode enumerates its entries on the device and needs no reverse index.
#pragma once

#include <cuda_runtime.h>

#include <cuda/functional>
#include <thrust/iterator/counting_iterator.h>

#include <cstdint>

#include "plan.h"

namespace msa::cuda {

using MaxOp = ::cuda::maximum<int32_t>;
using CountingIt = thrust::counting_iterator<int32_t>;

// The rows of tokens [t_lo, t_hi) (at most the plan's tokens). choice: kAuto's sums (none: no
// entries where they choose the plain query-tile forward). taken: [t_hi - t_lo, Hi, k], the
// entries the split forward's KV-block pass does not compute (skipped); null: none. paged: the
// keys' layout (KV tiles by PagedKeys::tile_of; the plan made for them): the tokens' own, keys
// apart, or a prefill's paged cache.
Status build_entries(const char* fn, const Plan& pl, const Problem& prob, const TensorRef& block_idx,
                     const int32_t* cu, int32_t nseq, int64_t t_lo, int64_t t_hi, void* ws,
                     cudaStream_t stream, kern::EntryListParams* out,
                     const kern::PagedKeys& paged, const unsigned long long* choice = nullptr,
                     const uint8_t* taken = nullptr);

Status build_work(const char* fn, const Plan& pl, const Plan::Work& w, const Problem& prob,
                  const kern::EntryListParams& entries, const int32_t* cu, int32_t nseq, void* ws,
                  cudaStream_t stream, kern::WorkListParams* out, int64_t* grid,
                  const kern::PagedKeys& paged);

}  // namespace msa::cuda
