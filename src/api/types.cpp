#include "msa/types.h"

#include <algorithm>

namespace msa {

const char* dtype_name(DType dtype) {
  switch (dtype) {
    case DType::kFloat16: return "float16";
    case DType::kBFloat16: return "bfloat16";
    case DType::kFloat32: return "float32";
    case DType::kFloat64: return "float64";
    case DType::kInt32: return "int32";
    case DType::kFloat8E4M3: return "float8_e4m3";
  }
  return "unknown";
}

size_t dtype_size(DType dtype) {
  switch (dtype) {
    case DType::kFloat8E4M3: return 1;
    case DType::kFloat16:
    case DType::kBFloat16: return 2;
    case DType::kFloat32:
    case DType::kInt32: return 4;
    case DType::kFloat64: return 8;
  }
  return 0;
}

int64_t TensorRef::numel() const {
  if (rank <= 0 || rank > kMaxRank) return 0;  // not given, or malformed (validation names it)
  int64_t n = 1;
  for (int d = 0; d < rank; ++d) n *= shape[d];
  return rank > 0 ? n : 0;
}

bool TensorRef::is_contiguous() const {
  if (rank < 0 || rank > kMaxRank) return false;
  int64_t expect = 1;
  for (int d = rank - 1; d >= 0; --d) {
    if (shape[d] != 1 && stride[d] != expect) return false;
    expect *= shape[d];
  }
  return true;
}

TensorRef make_tensor(void* data, DType dtype, std::initializer_list<int64_t> shape, Device device) {
  TensorRef t;
  t.data = data;
  t.dtype = dtype;
  t.device = device;
  // More than kMaxRank sizes: rank kMaxRank + 1, which validation refuses by name; only the first
  // kMaxRank sizes are stored (the arrays hold no more).
  t.rank = static_cast<int32_t>(shape.size() > static_cast<size_t>(kMaxRank) ? kMaxRank + 1 : shape.size());
  int d = 0;
  for (int64_t s : shape) {
    if (d < kMaxRank) t.shape[d] = s;
    ++d;
  }
  int64_t stride = 1;
  for (d = std::min(t.rank, kMaxRank) - 1; d >= 0; --d) {
    t.stride[d] = stride;
    stride *= t.shape[d];
  }
  return t;
}

}  // namespace msa
