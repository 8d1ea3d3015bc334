// Storage types of the CPU backend and their conversions to and from double.
// float16 and bfloat16 are converted bit-exactly, rounding to nearest even on the way back.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

namespace msa::cpu {

struct Half {
  uint16_t bits;
};
struct BFloat16 {
  uint16_t bits;
};

inline float bits_to_float(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
inline uint32_t float_to_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}

inline double to_double(double x) { return x; }
inline double to_double(float x) { return x; }
inline double to_double(BFloat16 x) { return bits_to_float(static_cast<uint32_t>(x.bits) << 16); }
inline double to_double(Half x) {
  const uint32_t sign = (x.bits & 0x8000u) << 16;
  const uint32_t exp = (x.bits >> 10) & 0x1f;
  const uint32_t man = x.bits & 0x3ff;
  if (exp == 0x1f) return bits_to_float(sign | 0x7f800000u | (man << 13));  // inf / nan
  if (exp == 0) {                                                            // zero / subnormal
    const double v = std::ldexp(static_cast<double>(man), -24);
    return sign ? -v : v;
  }
  return bits_to_float(sign | ((exp + 112) << 23) | (man << 13));
}

template <class E>
E from_double(double x);

template <>
inline double from_double<double>(double x) { return x; }
template <>
inline float from_double<float>(double x) { return static_cast<float>(x); }
template <>
inline BFloat16 from_double<BFloat16>(double x) {
  if (std::isnan(x)) return {static_cast<uint16_t>(std::signbit(x) ? 0xffc0 : 0x7fc0)};
  // Round to float with round-to-odd (truncate, then set the last bit if inexact), then to
  // bfloat16 to nearest even: exact single rounding, as float keeps 16 more bits than bfloat16.
  float f = static_cast<float>(x);
  if (std::fabs(static_cast<double>(f)) > std::fabs(x)) f = std::nextafter(f, 0.0f);
  uint32_t u = float_to_bits(f);
  if (static_cast<double>(f) != x) u |= 1u;
  const uint32_t rounded = u + 0x7fffu + ((u >> 16) & 1u);
  return {static_cast<uint16_t>(rounded >> 16)};
}

// The magnitude bits (exponent field, then mantissa field) of a finite a >= 0 rounded to nearest
// even in a binary format of p significant bits and exponent bias `bias`, subnormals included
// (a carry into the next binade comes out right). Overflow past the format's range is the
// caller's to handle.
inline uint32_t round_magnitude(double a, int p, int bias) {
  const int emin = 1 - bias;
  if (a < std::ldexp(1.0, emin))  // subnormal range: step 2^(emin - p + 1), ties to even
    return static_cast<uint32_t>(std::nearbyint(std::ldexp(a, p - 1 - emin)));
  int e;
  std::frexp(a, &e);  // a = f * 2^e, f in [0.5, 1)
  const uint32_t m = static_cast<uint32_t>(std::nearbyint(std::ldexp(a, p - e)));  // [2^(p-1), 2^p]
  return (static_cast<uint32_t>(e - 1 + bias) << (p - 1)) + m - (1u << (p - 1));
}

template <>
inline Half from_double<Half>(double x) {
  // Round the double directly to the nearest float16 (no double rounding through float).
  const uint16_t sign = std::signbit(x) ? 0x8000 : 0;
  if (std::isnan(x)) return {static_cast<uint16_t>(sign | 0x7e00)};
  const double a = std::fabs(x);
  if (a >= 65520.0) return {static_cast<uint16_t>(sign | 0x7c00)};  // rounds to inf
  return {static_cast<uint16_t>(sign | round_magnitude(a, 11, 15))};
}

// float8 E4M3 (OCP "e4m3fn"): value = (-1)^s * 2^(e-7) * (1 + m/8) for e in 1..15 (e = 15 with
// m = 7 is NaN), 2^-6 * m/8 for e = 0. No infinities; the largest finite value is 448.
struct E4M3 {
  uint8_t bits;
};

inline double to_double(E4M3 x) {
  const int e = (x.bits >> 3) & 0xf, m = x.bits & 7;
  if (e == 0xf && m == 7) return std::nan("");
  const double v = e == 0 ? std::ldexp(static_cast<double>(m), -9) : std::ldexp(8.0 + m, e - 10);
  return (x.bits & 0x80) ? -v : v;
}

// The E4M3 code nearest to x (ties to even), saturating: |x| beyond 448 gives +-448 (also for
// infinities); NaN gives NaN. The cache append's conversion (docs/contract.md §6).
inline E4M3 e4m3_from_double(double x) {
  const uint8_t sign = std::signbit(x) ? 0x80 : 0;
  if (std::isnan(x)) return {static_cast<uint8_t>(sign | 0x7f)};
  const double a = std::fabs(x);
  if (a >= 448.0) return {static_cast<uint8_t>(sign | 0x7e)};  // 448 = e 15, m 6
  return {static_cast<uint8_t>(sign | round_magnitude(a, 4, 7))};
}

}  // namespace msa::cpu
