// Host-side tensors of msa_main and the app's own element conversions.
//
// float16 and bfloat16 are stored as uint16 bit patterns. The conversions are written here,
// independently of the library's (src/cpu/numeric.h), so that a conversion bug cannot hide on
// both sides of the reference check: float -> 16 bit rounds to nearest, ties to even.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

#include "msa/types.h"

namespace msa_app {

inline uint32_t f32_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}

inline float f32_from_bits(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// bfloat16: the high half of a float32.
inline uint16_t float_to_bf16(float f) {
  const uint32_t u = f32_bits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x0040u);  // quiet NaN
  const uint32_t rounded = u + 0x7fffu + ((u >> 16) & 1u);  // ties to even; overflow gives inf
  return static_cast<uint16_t>(rounded >> 16);
}

inline float bf16_to_float(uint16_t b) { return f32_from_bits(static_cast<uint32_t>(b) << 16); }

// IEEE binary16: 1 sign, 5 exponent (bias 15), 10 mantissa bits.
inline uint16_t float_to_fp16(float f) {
  const uint32_t x = f32_bits(f);
  const uint16_t sign = static_cast<uint16_t>((x >> 16) & 0x8000u);
  uint32_t ax = x & 0x7fffffffu;
  if (ax > 0x7f800000u) return sign | 0x7e00u;    // NaN
  if (ax >= 0x477ff000u) return sign | 0x7c00u;   // >= 65520 rounds to inf (and inf itself)
  if (ax < 0x38800000u) {                         // below 2^-14: subnormal or zero, step 2^-24
    const double m = std::nearbyint(std::ldexp(static_cast<double>(f32_from_bits(ax)), 24));  // exact, ties to even
    return sign | static_cast<uint16_t>(m);      // m == 1024 encodes the smallest normal
  }
  ax += 0x0fffu + ((ax >> 13) & 1u);  // round the 13 dropped bits, ties to even
  ax -= 0x38000000u;                  // rebias the exponent: (127 - 15) << 23
  return sign | static_cast<uint16_t>(ax >> 13);
}

inline float fp16_to_float(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1fu, man = h & 0x3ffu;
  if (exp == 0) {  // zero or subnormal: man * 2^-24, exact in float
    const float v = static_cast<float>(man) * 5.9604644775390625e-8f;
    return sign ? -v : v;
  }
  if (exp == 31) return f32_from_bits(sign | 0x7f800000u | (man << 13));  // inf, NaN
  return f32_from_bits(sign | ((exp + 112) << 23) | (man << 13));
}

// Rounding facts of a floating storage type, for the check's tolerances.
struct FloatFormat {
  int significand_bits;  // including the implicit bit
  double min_subnormal;  // the absolute rounding step near zero
};

inline FloatFormat float_format(msa::DType dt) {
  switch (dt) {
    case msa::DType::kFloat16: return {11, std::ldexp(1.0, -24)};
    case msa::DType::kBFloat16: return {8, std::ldexp(1.0, -133)};
    case msa::DType::kFloat32: return {24, std::ldexp(1.0, -149)};
    case msa::DType::kFloat64: return {53, std::ldexp(1.0, -1074)};
    default: return {0, 0.0};
  }
}

// Unit roundoff u: round to nearest is within u * |x| (normal range).
inline double unit_roundoff(msa::DType dt) { return std::ldexp(1.0, -float_format(dt).significand_bits); }

inline const char* short_dtype_name(msa::DType dt) {
  switch (dt) {
    case msa::DType::kFloat16: return "fp16";
    case msa::DType::kBFloat16: return "bf16";
    case msa::DType::kFloat32: return "fp32";
    case msa::DType::kFloat64: return "fp64";
    case msa::DType::kInt32: return "int32";
  }
  return "?";
}

// An owning, contiguous host tensor of any dtype of the API.
class HostTensor {
 public:
  HostTensor() = default;
  HostTensor(msa::DType dtype, std::vector<int64_t> shape) : dtype_(dtype), shape_(std::move(shape)) {
    numel_ = 1;
    for (int64_t s : shape_) numel_ *= s;
    bytes_.assign(static_cast<size_t>(numel_) * msa::dtype_size(dtype_), 0);
  }

  msa::DType dtype() const { return dtype_; }
  const std::vector<int64_t>& shape() const { return shape_; }
  int64_t numel() const { return numel_; }
  size_t bytes() const { return bytes_.size(); }
  void* data() { return bytes_.data(); }
  const void* data() const { return bytes_.data(); }
  bool empty() const { return shape_.empty(); }

  double get(int64_t i) const {
    const unsigned char* p = bytes_.data() + static_cast<size_t>(i) * msa::dtype_size(dtype_);
    switch (dtype_) {
      case msa::DType::kFloat16: return fp16_to_float(load<uint16_t>(p));
      case msa::DType::kBFloat16: return bf16_to_float(load<uint16_t>(p));
      case msa::DType::kFloat32: return load<float>(p);
      case msa::DType::kFloat64: return load<double>(p);
      case msa::DType::kInt32: return load<int32_t>(p);
    }
    return 0.0;
  }

  // Stores `v` rounded to the dtype (nearest, ties to even).
  void set(int64_t i, float v) {
    unsigned char* p = bytes_.data() + static_cast<size_t>(i) * msa::dtype_size(dtype_);
    switch (dtype_) {
      case msa::DType::kFloat16: store<uint16_t>(p, float_to_fp16(v)); break;
      case msa::DType::kBFloat16: store<uint16_t>(p, float_to_bf16(v)); break;
      case msa::DType::kFloat32: store<float>(p, v); break;
      case msa::DType::kFloat64: store<double>(p, v); break;
      case msa::DType::kInt32: store<int32_t>(p, static_cast<int32_t>(v)); break;
    }
  }

  // Rank 3 [T, H, n]: the n elements of (t, h), as doubles.
  void load_row(int64_t t, int64_t h, double* dst) const {
    const int64_t n = shape_[2], first = (t * shape_[1] + h) * n;
    const unsigned char* p = bytes_.data() + static_cast<size_t>(first) * msa::dtype_size(dtype_);
    switch (dtype_) {  // one dispatch per row: the reference check decodes many rows
      case msa::DType::kFloat16:
        for (int64_t x = 0; x < n; ++x) dst[x] = fp16_to_float(load<uint16_t>(p + 2 * x));
        break;
      case msa::DType::kBFloat16:
        for (int64_t x = 0; x < n; ++x) dst[x] = bf16_to_float(load<uint16_t>(p + 2 * x));
        break;
      case msa::DType::kFloat32:
        for (int64_t x = 0; x < n; ++x) dst[x] = load<float>(p + 4 * x);
        break;
      default:
        for (int64_t x = 0; x < n; ++x) dst[x] = get(first + x);
    }
  }
  // Rank 2 [T, H].
  double at(int64_t t, int64_t h) const { return get(t * shape_[1] + h); }

  int32_t* i32() { return reinterpret_cast<int32_t*>(bytes_.data()); }
  const int32_t* i32() const { return reinterpret_cast<const int32_t*>(bytes_.data()); }

 private:
  template <class X>
  static X load(const unsigned char* p) {
    X x;
    std::memcpy(&x, p, sizeof(X));
    return x;
  }
  template <class X>
  static void store(unsigned char* p, X x) {
    std::memcpy(p, &x, sizeof(X));
  }

  msa::DType dtype_ = msa::DType::kFloat32;
  std::vector<int64_t> shape_;
  int64_t numel_ = 0;
  std::vector<unsigned char> bytes_;
};

}  // namespace msa_app
