// Basic types of the public MSA API: element types, devices, tensor views, status.
// Framework-free (no torch, no CUDA headers): a C++ engine includes this as is.
#pragma once

#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <string>

namespace msa {

enum class DType : int32_t {
  kFloat16 = 0,
  kBFloat16 = 1,
  kFloat32 = 2,
  kFloat64 = 3,  // CPU backend only (finite-difference tests, references)
  kInt32 = 4,
  // OCP float8 E4M3 ("e4m3fn": 1 sign, 4 exponent bits of bias 7, 3 mantissa bits; no
  // infinities, NaN = all ones; largest finite 448). A storage type: paged KV caches and index
  // key caches with their scales (params.h, PagedCache), never queries or outputs.
  kFloat8E4M3 = 5,
};

const char* dtype_name(DType dtype);
size_t dtype_size(DType dtype);

enum class DeviceType : int32_t { kCpu = 0, kCuda = 1 };

struct Device {
  DeviceType type = DeviceType::kCpu;
  int32_t index = 0;  // CUDA ordinal; ignored for the CPU
};

inline bool operator==(Device a, Device b) {
  return a.type == b.type && (a.type == DeviceType::kCpu || a.index == b.index);
}
inline bool operator!=(Device a, Device b) { return !(a == b); }

constexpr int kMaxRank = 4;

// A non-owning view of a strided tensor. Strides are in elements, not bytes.
// A TensorRef with rank 0 means "not given" (for optional arguments); scalars
// are passed as rank-1 tensors of shape [1].
struct TensorRef {
  void* data = nullptr;
  DType dtype = DType::kFloat32;
  Device device{};
  int32_t rank = 0;
  int64_t shape[kMaxRank] = {0, 0, 0, 0};
  int64_t stride[kMaxRank] = {0, 0, 0, 0};

  bool defined() const { return rank > 0; }
  int64_t numel() const;
  bool is_contiguous() const;
};

// A contiguous (row-major) view of `data` with the given shape.
TensorRef make_tensor(void* data, DType dtype, std::initializer_list<int64_t> shape,
                      Device device = {});

enum class StatusCode : int32_t {
  kOk = 0,
  kInvalidArgument = 1,  // bad input: the message names the argument
  kNotSupported = 2,     // valid input that no built backend implements
  kInternal = 3,         // a backend failed (e.g. a CUDA error)
};

struct Status {
  StatusCode code = StatusCode::kOk;
  std::string message;

  bool ok() const { return code == StatusCode::kOk; }
  static Status Ok() { return {}; }
  static Status Invalid(std::string m) { return {StatusCode::kInvalidArgument, std::move(m)}; }
  static Status NotSupported(std::string m) { return {StatusCode::kNotSupported, std::move(m)}; }
  static Status Internal(std::string m) { return {StatusCode::kInternal, std::move(m)}; }
};

}  // namespace msa
