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
template <>
inline Half from_double<Half>(double x) {
  // Round the double directly to the nearest float16 (no double rounding through float).
  const uint16_t sign = std::signbit(x) ? 0x8000 : 0;
  const double a = std::fabs(x);
  if (std::isnan(x)) return {static_cast<uint16_t>(sign | 0x7e00)};
  if (a >= 65520.0) return {static_cast<uint16_t>(sign | 0x7c00)};  // rounds to inf
  if (a < std::ldexp(1.0, -14)) {                                   // subnormal range: step 2^-24
    const double m = std::nearbyint(std::ldexp(a, 24));             // ties to even (default mode)
    return {static_cast<uint16_t>(sign | static_cast<uint16_t>(m))};
  }
  int e;
  std::frexp(a, &e);  // a = f * 2^e, f in [0.5, 1)
  const double m = std::nearbyint(std::ldexp(a, 11 - e));  // 11 significant bits, in [1024, 2048]
  uint32_t man = static_cast<uint32_t>(m);
  int exp = e - 1 + 15;
  if (man == 2048) {
    man = 1024;
    ++exp;
  }
  if (exp >= 31) return {static_cast<uint16_t>(sign | 0x7c00)};
  return {static_cast<uint16_t>(sign | (exp << 10) | (man - 1024))};
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
  if (a < std::ldexp(1.0, -6)) {                               // subnormal range: step 2^-9
    const double m = std::nearbyint(std::ldexp(a, 9));        // ties to even (default mode)
    return {static_cast<uint8_t>(sign | static_cast<uint8_t>(m))};  // m = 8 is 2^-6 itself
  }
  int e;
  std::frexp(a, &e);  // a = f * 2^e, f in [0.5, 1)
  const double m = std::nearbyint(std::ldexp(a, 4 - e));  // 4 significant bits, in [8, 16]
  uint32_t man = static_cast<uint32_t>(m);
  int exp = e - 1 + 7;
  if (man == 16) {
    man = 8;
    ++exp;
  }
  if (exp > 15 || (exp == 15 && man - 8 == 7)) return {static_cast<uint8_t>(sign | 0x7e)};
  return {static_cast<uint8_t>(sign | (exp << 3) | (man - 8))};
}

}  // namespace msa::cpu
