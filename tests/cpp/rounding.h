// Whether a backend rounds its stored outputs correctly: every value of a float16, bfloat16 or
// float32 output lies within half a unit in the last place of the exact (double) result. A
// conversion that truncates misses this on about half of the values; one that rounds twice (via
// float) misses it on a few.
#pragma once

#include <algorithm>
#include <cmath>
#include <sstream>
#include <string>
#include <vector>

#include "harness.h"

namespace msatest {

// Significand bits (the implicit one included) and the smallest normal binade of a dtype.
inline int significand_bits(DType dt) {
  switch (dt) {
    case DType::kFloat16: return 11;
    case DType::kBFloat16: return 8;
    case DType::kFloat32: return 24;
    default: return 53;
  }
}
inline int min_binade(DType dt) {
  switch (dt) {
    case DType::kFloat16: return -14;
    case DType::kBFloat16:
    case DType::kFloat32: return -126;
    default: return -1022;
  }
}

// The spacing of dt's values in the binade of |x| (the subnormal spacing below the normal range).
inline double ulp_of(DType dt, double x) {
  int e = 0;
  if (x != 0) std::frexp(std::fabs(x), &e);  // |x| = f * 2^e, f in [0.5, 1)
  const int binade = x == 0 ? min_binade(dt) : std::max(e - 1, min_binade(dt));
  return std::ldexp(1.0, binade - (significand_bits(dt) - 1));
}

inline double max_abs(const std::vector<double>& v) {
  double m = 0;
  for (double x : v) m = std::max(m, std::fabs(x));
  return m;
}

// Every got[i] (a value stored as dt) within half an ulp of want[i] plus `slack` (the error of
// `want` itself; 0 when want is the exact pre-rounding value). The ulp is taken in the binade of
// the smaller magnitude, which is the right one on both sides of a power of two.
inline void expect_correctly_rounded(DType dt, const std::vector<double>& got, const std::vector<double>& want,
                                     double slack, const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  int64_t bad = 0;
  std::ostringstream first;
  first.precision(17);
  for (size_t i = 0; i < got.size(); ++i) {
    const double err = std::fabs(got[i] - want[i]);
    const double bound = 0.5 * ulp_of(dt, std::min(std::fabs(got[i]), std::fabs(want[i]))) + slack;
    if (err <= bound) continue;  // false for NaN
    if (bad++ < 3)
      first << "\n  [" << i << "] got " << got[i] << ", exact " << want[i] << ": off by " << err / ulp_of(dt, want[i])
            << " ulp";
  }
  EXPECT_EQ(bad, 0) << what << ": " << bad << " of " << got.size() << " values of dtype " << msa::dtype_name(dt)
                    << " not within half an ulp of the exact result" << first.str();
}

// A float64 copy of a tensor: every value is exactly representable.
inline HostTensor float64_copy(const HostTensor& t) {
  HostTensor w(DType::kFloat64, t.shape());
  for (int64_t i = 0; i < t.numel(); ++i) w.set(i, t.get(i));
  return w;
}

// The problem with its inputs copied exactly into float64.
inline Problem float64_copy(const Problem& p) {
  Config c = p.cfg;
  c.dtype = DType::kFloat64;
  Problem w(c);
  w.q = float64_copy(p.q);
  w.k = float64_copy(p.k);
  w.v = float64_copy(p.v);
  w.q_idx = float64_copy(p.q_idx);
  w.k_idx = float64_copy(p.k_idx);
  return w;
}

}  // namespace msatest
