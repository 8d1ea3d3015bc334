// Test harness: host tensors of every dtype, random problems, and calls into the public API.
// Storage conversions here are written independently of the backend's (fp16 through the
// compiler's _Float16), so a conversion bug cannot hide on both sides.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "msa/msa.h"

namespace msatest {

using msa::DType;
using msa::Mode;

// float8 E4M3 ("e4m3fn") from the format's definition, independently of the library: code
// s eeee mmm is (-1)^s * 2^(e - 7) * (1 + m / 8) for e > 0, (-1)^s * 2^-6 * m / 8 for e = 0, and
// NaN for eeee mmm = 1111 111.
inline double e4m3_value(uint8_t code) {
  const int e = (code >> 3) & 15, m = code & 7;
  if (e == 15 && m == 7) return NAN;
  const double mag = e > 0 ? std::pow(2.0, e - 7) * (1.0 + m / 8.0) : std::pow(2.0, -6) * (m / 8.0);
  return (code & 0x80) ? -mag : mag;
}

// The E4M3 code nearest to x by exhaustive search (ties: the even code), saturated to +-448;
// NaN gives 0x7f. The contract's conversion, written as a search rather than bit arithmetic.
inline uint8_t e4m3_code(double x) {
  if (std::isnan(x)) return 0x7f;
  const uint8_t sign = std::signbit(x) ? 0x80 : 0;
  const double a = std::min(std::fabs(x), 448.0);
  uint8_t best = 0;
  for (int c = 1; c < 0x7f; ++c) {
    const double d = std::fabs(e4m3_value(static_cast<uint8_t>(c)) - a);
    const double db = std::fabs(e4m3_value(best) - a);
    if (d < db || (d == db && (c & 1) == 0)) best = static_cast<uint8_t>(c);
  }
  return static_cast<uint8_t>(sign | best);
}

inline double bits_to_double(DType dt, const void* p) {
  switch (dt) {
    case DType::kFloat8E4M3: return e4m3_value(*static_cast<const uint8_t*>(p));
    case DType::kFloat16: {
      _Float16 h;
      std::memcpy(&h, p, 2);
      return static_cast<double>(h);
    }
    case DType::kBFloat16: {
      uint16_t b;
      std::memcpy(&b, p, 2);
      uint32_t u = static_cast<uint32_t>(b) << 16;
      float f;
      std::memcpy(&f, &u, 4);
      return f;
    }
    case DType::kFloat32: return *static_cast<const float*>(p);
    case DType::kFloat64: return *static_cast<const double*>(p);
    case DType::kInt32: return *static_cast<const int32_t*>(p);
  }
  return NAN;
}

inline void double_to_bits(DType dt, double x, void* p) {
  switch (dt) {
    case DType::kFloat8E4M3: *static_cast<uint8_t*>(p) = e4m3_code(x); return;
    case DType::kFloat16: {
      _Float16 h = static_cast<_Float16>(static_cast<float>(x));
      std::memcpy(p, &h, 2);
      return;
    }
    case DType::kBFloat16: {
      float f = static_cast<float>(x);
      uint32_t u;
      std::memcpy(&u, &f, 4);
      u += 0x7fffu + ((u >> 16) & 1u);
      uint16_t b = static_cast<uint16_t>(u >> 16);
      std::memcpy(p, &b, 2);
      return;
    }
    case DType::kFloat32: *static_cast<float*>(p) = static_cast<float>(x); return;
    case DType::kFloat64: *static_cast<double*>(p) = x; return;
    case DType::kInt32: *static_cast<int32_t*>(p) = static_cast<int32_t>(x); return;
  }
}

// An owning host tensor, contiguous unless built with explicit strides.
class HostTensor {
 public:
  HostTensor() = default;
  HostTensor(DType dt, std::vector<int64_t> shape) : dt_(dt), shape_(std::move(shape)) {
    int64_t n = 1;
    for (int64_t s : shape_) n *= s;
    numel_ = n;
    bytes_.assign(static_cast<size_t>(std::max<int64_t>(n, 1)) * msa::dtype_size(dt), 0);
    strides_.assign(shape_.size(), 1);
    for (int d = static_cast<int>(shape_.size()) - 2; d >= 0; --d) strides_[d] = strides_[d + 1] * shape_[d + 1];
  }

  msa::TensorRef ref() {
    msa::TensorRef t;
    t.data = bytes_.data();
    t.dtype = dt_;
    t.rank = static_cast<int32_t>(shape_.size());
    for (size_t d = 0; d < shape_.size(); ++d) {
      t.shape[d] = shape_[d];
      t.stride[d] = strides_[d];
    }
    return t;
  }

  int64_t numel() const { return numel_; }
  DType dtype() const { return dt_; }
  const std::vector<int64_t>& shape() const { return shape_; }
  double get(int64_t i) const { return bits_to_double(dt_, &bytes_[i * msa::dtype_size(dt_)]); }
  void set(int64_t i, double x) { double_to_bits(dt_, x, &bytes_[i * msa::dtype_size(dt_)]); }
  double at(int64_t a, int64_t b, int64_t c) const { return get((a * shape_[1] + b) * shape_[2] + c); }
  double at(int64_t a, int64_t b) const { return get(a * shape_[1] + b); }
  int32_t idx(int64_t a, int64_t b, int64_t c) const { return static_cast<int32_t>(at(a, b, c)); }

  std::vector<double> values() const {
    std::vector<double> v(numel_);
    for (int64_t i = 0; i < numel_; ++i) v[i] = get(i);
    return v;
  }
  void fill(double x) {
    for (int64_t i = 0; i < numel_; ++i) set(i, x);
  }
  // Uniform in [-amp, amp], rounded to the dtype.
  void randomize(std::mt19937_64& rng, double amp = 1.0) {
    std::uniform_real_distribution<double> u(-amp, amp);
    for (int64_t i = 0; i < numel_; ++i) set(i, u(rng));
  }
  // Small integers times `step`: every dot product of such values is exact in double.
  void randomize_grid(std::mt19937_64& rng, int range, double step) {
    std::uniform_int_distribution<int> u(-range, range);
    for (int64_t i = 0; i < numel_; ++i) set(i, u(rng) * step);
  }
  bool bitwise_equal(const HostTensor& o) const { return bytes_ == o.bytes_; }

 private:
  DType dt_ = DType::kFloat32;
  std::vector<int64_t> shape_, strides_;
  int64_t numel_ = 0;
  std::vector<uint8_t> bytes_;
};

// One configuration of the problem.
struct Config {
  std::vector<int64_t> seqlens{200};
  int Hq = 4, Hkv = 2, D = 16;
  int Hi = 2, Hik = 1, Di = 16;
  int Bk = 16, k = 4, sink = 0, local = 1;
  DType dtype = DType::kFloat64;
  uint64_t seed = 1;

  int64_t T() const {
    int64_t t = 0;
    for (int64_t l : seqlens) t += l;
    return t;
  }
  std::string str() const {
    std::ostringstream os;
    os << "seqlens=[";
    for (size_t i = 0; i < seqlens.size(); ++i) os << (i ? "," : "") << seqlens[i];
    os << "] Hq=" << Hq << " Hkv=" << Hkv << " D=" << D << " Hi=" << Hi << " Hik=" << Hik
       << " Di=" << Di << " Bk=" << Bk << " k=" << k << " sink=" << sink << " local=" << local
       << " dtype=" << msa::dtype_name(dtype) << " seed=" << seed;
    return os.str();
  }
};

// A configuration with Di = D.
inline Config make_config(std::vector<int64_t> lens, int Hq, int Hkv, int D, int Hi, int Hik, int Bk, int k,
                          uint64_t seed) {
  Config c;
  c.seqlens = std::move(lens);
  c.Hq = Hq;
  c.Hkv = Hkv;
  c.D = D;
  c.Di = D;
  c.Hi = Hi;
  c.Hik = Hik;
  c.Bk = Bk;
  c.k = k;
  c.seed = seed;
  return c;
}

// Random inputs of one configuration.
struct Problem {
  Config cfg;
  int64_t T = 0;
  HostTensor q, k, v, q_idx, k_idx, cu;
  std::vector<int64_t> offsets;  // cu_seqlens as int64

  explicit Problem(const Config& c, double amp = 1.0) : cfg(c), T(c.T()) {
    std::mt19937_64 rng(c.seed);
    q = HostTensor(c.dtype, {T, c.Hq, c.D});
    k = HostTensor(c.dtype, {T, c.Hkv, c.D});
    v = HostTensor(c.dtype, {T, c.Hkv, c.D});
    q_idx = HostTensor(c.dtype, {T, c.Hi, c.Di});
    k_idx = HostTensor(c.dtype, {T, c.Hik, c.Di});
    for (HostTensor* t : {&q, &k, &v, &q_idx, &k_idx}) t->randomize(rng, amp);
    cu = HostTensor(DType::kInt32, {static_cast<int64_t>(c.seqlens.size()) + 1});
    offsets.assign(1, 0);
    for (int64_t l : c.seqlens) offsets.push_back(offsets.back() + l);
    for (size_t s = 0; s < offsets.size(); ++s) cu.set(static_cast<int64_t>(s), static_cast<double>(offsets[s]));
  }
  msa::Options options(Mode mode = Mode::kSparse) const {
    msa::Options o;
    o.mode = mode;
    o.block_size = cfg.Bk;
    o.top_k = cfg.k;
    o.sink_blocks = cfg.sink;
    o.local_blocks = cfg.local;
    return o;
  }
  // The API takes scales as float: the reference uses the same rounded values.
  double scale() const { return static_cast<float>(1.0 / std::sqrt(static_cast<double>(cfg.D))); }
  double scale_idx() const { return static_cast<float>(1.0 / std::sqrt(static_cast<double>(cfg.Di))); }
};

inline void expect_ok(const msa::Status& s) { ASSERT_TRUE(s.ok()) << s.message; }

// select_blocks over `p` with its options (or `opts`).
inline HostTensor run_select(Problem& p, HostTensor* lse_idx = nullptr, const msa::Options* opts = nullptr) {
  HostTensor bi(DType::kInt32, {p.T, p.cfg.Hi, p.cfg.k});
  bi.fill(-7);  // poison
  msa::SelectParams sp;
  sp.q_idx = p.q_idx.ref();
  sp.k_idx = p.k_idx.ref();
  sp.cu_seqlens = p.cu.ref();
  sp.block_idx = bi.ref();
  if (lse_idx) {
    *lse_idx = HostTensor(DType::kFloat32, {p.T, p.cfg.Hi});
    lse_idx->fill(NAN);
    sp.lse_idx = lse_idx->ref();
  }
  sp.opts = opts != nullptr ? *opts : p.options();
  msa::Status s = msa::select_blocks(sp);
  EXPECT_TRUE(s.ok()) << s.message;
  return bi;
}

struct FwdResult {
  HostTensor out, lse, kl;
};

// Forward over `bi` (kSparse) or dense (kDense); the exact KL when `with_kl`.
inline FwdResult run_forward(Problem& p, HostTensor* bi, Mode mode, bool with_kl) {
  FwdResult r{HostTensor(p.cfg.dtype, {p.T, p.cfg.Hq, p.cfg.D}), HostTensor(DType::kFloat32, {p.T, p.cfg.Hq}),
              HostTensor(DType::kFloat32, {1})};
  r.out.fill(NAN);
  r.lse.fill(NAN);
  r.kl.fill(NAN);
  msa::ForwardParams fp;
  fp.q = p.q.ref();
  fp.k = p.k.ref();
  fp.v = p.v.ref();
  fp.cu_seqlens = p.cu.ref();
  if (mode == Mode::kSparse) fp.block_idx = bi->ref();
  fp.q_idx = p.q_idx.ref();
  fp.k_idx = p.k_idx.ref();
  fp.out = r.out.ref();
  fp.lse = r.lse.ref();
  if (with_kl) fp.kl = r.kl.ref();
  fp.opts = p.options(mode);
  msa::Status s = msa::forward(fp);
  EXPECT_TRUE(s.ok()) << s.message;
  return r;
}

struct BwdResult {
  HostTensor dq, dk, dv, dq_idx, dk_idx;
};

// `index_grads`: which of dq_idx (bit 0) and dk_idx (bit 1) the call asks for; the other stays
// NaN-filled and unbound.
inline BwdResult run_backward(Problem& p, HostTensor* bi, Mode mode, FwdResult& f, HostTensor& dout, double gamma,
                              bool deterministic = false, int index_grads = 3) {
  const Config& c = p.cfg;
  BwdResult r{HostTensor(c.dtype, {p.T, c.Hq, c.D}), HostTensor(c.dtype, {p.T, c.Hkv, c.D}),
              HostTensor(c.dtype, {p.T, c.Hkv, c.D}), HostTensor(c.dtype, {p.T, c.Hi, c.Di}),
              HostTensor(c.dtype, {p.T, c.Hik, c.Di})};
  for (HostTensor* t : {&r.dq, &r.dk, &r.dv, &r.dq_idx, &r.dk_idx}) t->fill(NAN);
  msa::BackwardParams bp;
  bp.q = p.q.ref();
  bp.k = p.k.ref();
  bp.v = p.v.ref();
  bp.out = f.out.ref();
  bp.lse = f.lse.ref();
  bp.dout = dout.ref();
  bp.cu_seqlens = p.cu.ref();
  if (mode == Mode::kSparse) bp.block_idx = bi->ref();
  bp.dq = r.dq.ref();
  bp.dk = r.dk.ref();
  bp.dv = r.dv.ref();
  bp.q_idx = p.q_idx.ref();
  bp.k_idx = p.k_idx.ref();
  if (index_grads & 1) bp.dq_idx = r.dq_idx.ref();
  if (index_grads & 2) bp.dk_idx = r.dk_idx.ref();
  bp.kl_weight = static_cast<float>(gamma);
  bp.opts = p.options(mode);
  bp.opts.deterministic = deterministic;
  msa::Status s = msa::backward(bp);
  EXPECT_TRUE(s.ok()) << s.message;
  return r;
}

// max |a - b| / max(max |b|, floor), NaN-aware (NaN anywhere fails).
inline double rel_err(const std::vector<double>& a, const std::vector<double>& b, double floor = 1e-30) {
  EXPECT_EQ(a.size(), b.size());
  double num = 0, den = floor;
  for (size_t i = 0; i < a.size() && i < b.size(); ++i) {
    if (std::isnan(a[i]) || std::isnan(b[i])) return INFINITY;
    num = std::max(num, std::fabs(a[i] - b[i]));
    den = std::max(den, std::fabs(b[i]));
  }
  return num / den;
}

inline bool all_finite(const HostTensor& t) {
  for (int64_t i = 0; i < t.numel(); ++i)
    if (!std::isfinite(t.get(i))) return false;
  return true;
}

}  // namespace msatest
