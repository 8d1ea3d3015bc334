// Host helpers shared by the CUDA backend's sources: error messages that name the argument,
// the kernels' alignment and dtype requirements, the device guard, the SM count.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <string>
#include <utility>

#include "../../core/problem.h"
#include "msa/types.h"

namespace msa::cuda {

inline Status fail(const char* fn, const char* arg, const std::string& what) {
  return detail::unsupported_arg(fn, arg, what);
}

// 16-byte rows: TMA and the vector loads need 16-byte aligned bases and token/head strides.
inline Status check_aligned(const char* fn, const char* arg, const TensorRef& t) {
  const size_t elem = dtype_size(t.dtype);
  if (reinterpret_cast<uintptr_t>(t.data) % 16 != 0)
    return fail(fn, arg, "the CUDA backend needs a 16-byte aligned data pointer");
  for (int d = 0; d + 1 < t.rank; ++d)
    if ((t.stride[d] * elem) % 16 != 0 && t.shape[d] > 1)
      return fail(fn, arg, "the CUDA backend needs strides that are multiples of 16 bytes (dim " +
                               std::to_string(d) + " has stride " + std::to_string(t.stride[d]) +
                               ")");
  return Status::Ok();
}

inline Status check_half(const char* fn, const char* arg, const TensorRef& t) {
  if (t.dtype == DType::kBFloat16 || t.dtype == DType::kFloat16) return Status::Ok();
  return fail(fn, arg, std::string("the CUDA backend takes bfloat16 or float16, got ") +
                           dtype_name(t.dtype));
}

inline int32_t num_seqs(const TensorRef& cu) {
  return cu.defined() ? static_cast<int32_t>(cu.shape[0] - 1) : 1;
}

// Runs on the tensors' device, restoring the caller's current device afterwards.
class DeviceGuard {
 public:
  explicit DeviceGuard(int device) {
    cudaGetDevice(&prev_);
    if (device != prev_) cudaSetDevice(device);
  }
  ~DeviceGuard() {
    int now = 0;
    cudaGetDevice(&now);
    if (now != prev_) cudaSetDevice(prev_);
  }

 private:
  int prev_ = 0;
};

inline Status check_block_size(const char* fn, int32_t Bk) {
  if (Bk == 64 || Bk == 128) return Status::Ok();
  return fail(fn, "block_size", "the CUDA backend supports 64 and 128, got " + std::to_string(Bk));
}

inline Status check_head_dim(const char* fn, const char* arg, int32_t d) {
  if (d == 64 || d == 128) return Status::Ok();
  return fail(fn, arg, "the CUDA backend supports head dims 64 and 128, got " + std::to_string(d));
}

// 4-byte aligned rows (even strides): the epilogues store element pairs.
inline Status check_even(const char* fn, const char* arg, const TensorRef& t) {
  if (!t.defined()) return Status::Ok();
  if (t.stride[0] % 2 != 0 || t.stride[1] % 2 != 0 || reinterpret_cast<uintptr_t>(t.data) % 4 != 0)
    return fail(fn, arg, "the CUDA backend needs 4-byte aligned rows (even strides)");
  return Status::Ok();
}

inline Status cuda_error(const char* fn, cudaError_t e) {
  return Status::Internal(std::string("msa::") + fn + ": " + cudaGetErrorString(e));
}

// Multiprocessors of the current device.
// The current device's L2 cache in bytes (0 where it cannot be read).
inline int64_t l2_bytes() {
  int dev = 0, n = 0;
  cudaGetDevice(&dev);
  if (cudaDeviceGetAttribute(&n, cudaDevAttrL2CacheSize, dev) != cudaSuccess || n < 0) {
    cudaGetLastError();
    n = 0;
  }
  return n;
}

inline int num_sms() {
  int dev = 0, n = 0;
  cudaGetDevice(&dev);
  if (cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, dev) != cudaSuccess || n <= 0) {
    cudaGetLastError();
    n = 1;
  }
  return n;
}

// Programmatic dependent launch (device/grid_dependency.cuh) where the library is built with
// MSA_CUDA_PDL (CMake option, on by default). Every kernel of the library waits for the
// previous grid before it touches memory, so either way the results are the stream order's;
// only the gaps between kernels change.
#ifdef MSA_CUDA_PDL
inline constexpr bool kProgrammaticLaunch = true;
#else
inline constexpr bool kProgrammaticLaunch = false;
#endif

// kernel<<<grid, block, smem, stream>>>(args...); with kProgrammaticLaunch, by
// cudaLaunchKernelEx with programmatic stream serialisation. Only this library's kernels (each
// begins with grid_dependency_begin()) go through it. Returns the launch's error and leaves it for
// cudaGetLastError(), which the callers check.
template <class... Params, class... Args>
cudaError_t launch_grid(void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem, cudaStream_t stream,
                        Args&&... args) {
  if constexpr (kProgrammaticLaunch) {
    cudaLaunchAttribute attr[1];
    attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr[0].val.programmaticStreamSerializationAllowed = 1;
    cudaLaunchConfig_t cfg = {};
    cfg.gridDim = grid;
    cfg.blockDim = block;
    cfg.dynamicSmemBytes = smem;
    cfg.stream = stream;
    cfg.attrs = attr;
    cfg.numAttrs = 1;
    return cudaLaunchKernelEx(&cfg, kernel, std::forward<Args>(args)...);
  } else {
    kernel<<<grid, block, smem, stream>>>(std::forward<Args>(args)...);
    return cudaPeekAtLastError();
  }
}

template <class T>
T* at(void* ws, size_t off) {
  return reinterpret_cast<T*>(static_cast<char*>(ws) + off);
}

}  // namespace msa::cuda
