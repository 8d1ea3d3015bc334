// The host side of the re-ranking of FP8 shortlists (rerank.h).
#include "rerank.h"

#include <cub/device/device_scan.cuh>

#include <algorithm>

#include "../kernels/rerank_list_kernel.cuh"
#include "common.h"

namespace msa::cuda {
namespace {

int grid_for(int64_t n, int threads) {
  return static_cast<int>(std::max<int64_t>(1, std::min<int64_t>((n + threads - 1) / threads, num_sms() * 16)));
}

Status last_error(const char* fn) {
  const cudaError_t e = cudaGetLastError();
  return e == cudaSuccess ? Status::Ok() : cuda_error(fn, e);
}

}  // namespace

size_t rerank_cub_bytes(int64_t n) {
  size_t bytes = 0;
  cub::DeviceScan::ExclusiveSum(nullptr, bytes, static_cast<const int32_t*>(nullptr),
                                static_cast<int32_t*>(nullptr), static_cast<int>(n));
  return bytes;
}

Status rerank_lists(const char* fn, const SelectArgs& a, cudaStream_t stream) {
  const RerankArgs& r = a.rerank;
  const int n = static_cast<int>(r.nseg * r.ranges + 1), nseg = static_cast<int>(r.nseg + 1);
  const int64_t entries = int64_t(a.T) * a.Hik * a.idx_per_key * r.width;
  cudaError_t e = cudaMemsetAsync(r.seg_count, 0, sizeof(int32_t) * size_t(n), stream);
  if (e != cudaSuccess) return cuda_error(fn, e);
  if (entries > 0) {
    launch_grid(kern::rerank_count_kernel, grid_for(entries, 256), 256, 0, stream, a);
    MSA_TRY(last_error(fn));
  }
  size_t bytes = r.cub_bytes;
  e = cub::DeviceScan::ExclusiveSum(r.cub, bytes, r.seg_count, r.seg_start, n, stream);
  if (e != cudaSuccess) return cuda_error(fn, e);
  launch_grid(kern::rerank_chunks_kernel, grid_for(nseg, 256), 256, 0, stream, a);
  MSA_TRY(last_error(fn));
  bytes = r.cub_bytes;
  e = cub::DeviceScan::ExclusiveSum(r.cub, bytes, r.chunk_start, r.chunk_start, nseg, stream);
  if (e != cudaSuccess) return cuda_error(fn, e);
  if (entries == 0) return Status::Ok();
  launch_grid(kern::rerank_scatter_kernel, grid_for(entries, 256), 256, 0, stream, a);
  return last_error(fn);
}

Status rerank_pick(const char* fn, const SelectArgs& a, cudaStream_t stream) {
  const int64_t rows = int64_t(a.T) * a.Hik * a.idx_per_key;
  if (rows == 0) return Status::Ok();
  launch_grid(kern::rerank_pick_kernel, static_cast<unsigned>((rows + 255) / 256), 256, 0, stream, a);
  return last_error(fn);
}

}  // namespace msa::cuda
