// The CUDA (Hopper) backend against the CPU backend on the same inputs: selection (docs/contract.md §2), sparse
// forward over a given or computed block_idx (§3), the backward with the KL gradient and the exact
// KL value (§4), the dense warmup forward and backward (§5), packed varlen batches, keys apart
// from queries (cu_seqlens_k, §1: against the CPU backend's call over the same keys apart) and
// bad input (§7).
//
// Every test skips unless msa::backend_available(kCuda). Inputs are random and never zero. Outputs
// are poisoned before each call: 0xFF bytes (NaN) for floats, 0x7F bytes for block_idx (-1 is a
// legal entry there). Every device tensor and workspace lies between guard bytes (DeviceTensor):
// reads past an input see NaN, writes past an output or a workspace fail the test. The CPU
// reference runs in float64 on exactly the values the GPU saw.
// Tolerances: out rel-L2 < 1e-2 (bf16) / 3e-3 (fp16) over the tensor and 4x that per row; lse
// within 1e-3 where finite and -inf exactly where the reference is -inf; selection by the contract's
// rule with a score slack of 1e-3 * (1 + |k-th score|), lse_idx within 1e-3 * (1 + |ref|) when the
// backend produces it. Gradients: rel-L2 < 2e-2 (bf16) / 6e-3 (fp16) per tensor (KL gradients:
// 2e-2 / 1.5e-2) and 4x that per row, against the CPU backend run on the same out, lse and dout; the reproducibility test
// compares bits. Kernel variants the library was built without are skipped.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include "msa_cuda_variants.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <ostream>
#include <random>
#include <stdexcept>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include "harness.h"
#include "paged_cases.h"
#include "reference.h"

namespace msatest {
namespace {

using msa::DeviceType;
using msa::StatusCode;

constexpr DType kBf16 = DType::kBFloat16;
constexpr DType kFp16 = DType::kFloat16;

// ---- device memory and streams ------------------------------------------------------------------

void cuda_check(cudaError_t e, const char* what) {
  if (e != cudaSuccess) throw std::runtime_error(std::string(what) + ": " + cudaGetErrorString(e));
}
#define CUDA_CHECK(expr) cuda_check((expr), #expr)

// An msa call that must succeed (its message becomes the test failure otherwise).
void require_ok(const msa::Status& s) {
  if (!s.ok()) throw std::runtime_error(s.message);
}

#define SKIP_WITHOUT_CUDA()                                    \
  if (!msa::backend_available(DeviceType::kCuda))             \
  GTEST_SKIP() << "no CUDA backend built or no compute capability 9.0 GPU visible"

// The kernel variants this library was built with (src/cuda/sources.cmake's table; a
// MSA_CUDA_FAST_BUILD library has bf16 with head dim and block size 128 only): other shapes skip.
// `main`: the attention kernels run (head dim D); `index`: selection (head dim Di).
bool variant_built(DType dt, int32_t dim, int32_t bk) {
#define MSA_X(E, DT, D, BK) \
  if (dt == DType::DT && dim == D && bk == BK) return true;
  MSA_CUDA_FOR_EACH_VARIANT(MSA_X)
#undef MSA_X
  return false;
}
bool kernels_built(const Config& c, bool main, bool index) {
  return (!main || variant_built(c.dtype, c.D, c.Bk)) && (!index || variant_built(c.dtype, c.Di, c.Bk));
}

#define SKIP_UNLESS_BUILT(cfg, main, index)  \
  if (!kernels_built((cfg), (main), (index))) \
  GTEST_SKIP() << "kernel variant not built into this library"

// The stream of a test: the legacy default stream or a new non-blocking one. Copies and poison
// go on the same stream, so a backend that ignored Launch.stream would race with them.
class Stream {
 public:
  explicit Stream(bool own) {
    if (own) CUDA_CHECK(cudaStreamCreateWithFlags(&s_, cudaStreamNonBlocking));
  }
  ~Stream() {
    if (s_) cudaStreamDestroy(s_);
  }
  Stream(const Stream&) = delete;
  Stream& operator=(const Stream&) = delete;
  cudaStream_t get() const { return s_; }

 private:
  cudaStream_t s_ = nullptr;
};

// An owning contiguous device tensor in the layout of the harness's HostTensor.
//
// Guards: each tensor lies between two regions of kGuardBytes bytes in its allocation: 0xFF (NaN in
// every floating type here, E4M3 included) and, for int32 tensors, 0x7F (0x7F7F7F7F, an index or
// offset no tensor has; -1 would read as block_idx padding). A kernel that reads past an input
// then reads NaN or a wild index instead of a neighbour's values, in plain runs too; and the
// guards are compared with their byte when the tensor is downloaded and when it goes (workspaces
// are never downloaded), so a kernel that writes past an output or a workspace fails the test
// that made it. MSA_TEST_GUARDS=0 leaves them out: each tensor is then an allocation of its own, whose
// exact bounds compute-sanitizer checks (scripts/gpu_check.sh's sanitizer stages).
class DeviceTensor {
 public:
  static constexpr size_t kGuardBytes = 64 << 10;  // > one row of any tensor the tests make

  DeviceTensor() = default;
  DeviceTensor(DType dt, std::vector<int64_t> shape) : dt_(dt), shape_(std::move(shape)) {
    int64_t n = 1;
    for (int64_t x : shape_) n *= x;
    bytes_ = static_cast<size_t>(n) * msa::dtype_size(dt_);
    CUDA_CHECK(cudaGetDevice(&device_));
    if (bytes_ == 0) return;
    guard_ = guards_on() ? kGuardBytes : 0;
    CUDA_CHECK(cudaMalloc(&base_, bytes_ + 2 * guard_));
    ptr_ = static_cast<char*>(base_) + guard_;
    if (guard_ > 0) {  // before any stream's use of the tensor
      CUDA_CHECK(cudaMemset(base_, guard_byte(), guard_));
      CUDA_CHECK(cudaMemset(static_cast<char*>(ptr_) + bytes_, guard_byte(), guard_));
      CUDA_CHECK(cudaDeviceSynchronize());
    }
  }
  DeviceTensor(DeviceTensor&& o) noexcept { *this = std::move(o); }
  DeviceTensor& operator=(DeviceTensor&& o) noexcept {
    std::swap(base_, o.base_);
    std::swap(ptr_, o.ptr_);
    std::swap(bytes_, o.bytes_);
    std::swap(guard_, o.guard_);
    std::swap(dt_, o.dt_);
    std::swap(shape_, o.shape_);
    std::swap(device_, o.device_);
    return *this;
  }
  ~DeviceTensor() {
    if (!base_) return;
    // A call that failed the test already may have left the device unusable: then no check.
    if (cudaDeviceSynchronize() == cudaSuccess) check_guards();
    cudaFree(base_);
  }

  // An asynchronous copy of `h` on `s`.
  static DeviceTensor upload(HostTensor& h, cudaStream_t s) {
    DeviceTensor d(h.dtype(), h.shape());
    if (d.bytes_) CUDA_CHECK(cudaMemcpyAsync(d.ptr_, h.ref().data, d.bytes_, cudaMemcpyHostToDevice, s));
    return d;
  }
  // A new tensor filled with the poison pattern on `s`.
  static DeviceTensor poisoned(DType dt, std::vector<int64_t> shape, cudaStream_t s) {
    DeviceTensor d(dt, std::move(shape));
    if (d.bytes_) CUDA_CHECK(cudaMemsetAsync(d.ptr_, dt == DType::kInt32 ? 0x7f : 0xff, d.bytes_, s));
    return d;
  }
  // Waits for `s`, checks the guards, then copies back.
  HostTensor download(cudaStream_t s) const {
    CUDA_CHECK(cudaStreamSynchronize(s));
    check_guards();
    HostTensor h(dt_, shape_);
    if (bytes_) CUDA_CHECK(cudaMemcpy(h.ref().data, ptr_, bytes_, cudaMemcpyDeviceToHost));
    return h;
  }

  msa::TensorRef ref() const {
    msa::TensorRef t;
    t.data = ptr_;
    t.dtype = dt_;
    t.device = {DeviceType::kCuda, device_};
    t.rank = static_cast<int32_t>(shape_.size());
    int64_t stride = 1;
    for (int d = t.rank - 1; d >= 0; --d) {
      t.shape[d] = shape_[d];
      t.stride[d] = stride;
      stride *= shape_[d];
    }
    return t;
  }

 private:
  static bool guards_on() {
    static const bool on = [] {
      const char* e = std::getenv("MSA_TEST_GUARDS");
      return e == nullptr || std::string(e) != "0";
    }();
    return on;
  }
  unsigned char guard_byte() const { return dt_ == DType::kInt32 ? 0x7f : 0xff; }
  // Every guard byte still as filled (the caller has synchronised the device or the tensor's stream).
  void check_guards() const {
    if (guard_ == 0) return;
    std::vector<unsigned char> g(2 * guard_);
    if (cudaMemcpy(g.data(), base_, guard_, cudaMemcpyDeviceToHost) != cudaSuccess ||
        cudaMemcpy(g.data() + guard_, static_cast<char*>(ptr_) + bytes_, guard_, cudaMemcpyDeviceToHost) != cudaSuccess)
      return;  // a sticky error of the call fails the test elsewhere
    for (size_t i = 0; i < g.size(); ++i) {
      if (g[i] != guard_byte()) {
        std::string dims;
        for (int64_t x : shape_) dims += (dims.empty() ? "" : ", ") + std::to_string(x);
        const bool after = i >= guard_;
        ADD_FAILURE() << "a kernel wrote " << (after ? i - guard_ + 1 : guard_ - i) << " bytes "
                      << (after ? "past the end" : "before the start") << " of a device tensor [" << dims
                      << "] of " << msa::dtype_name(dt_) << " (guard byte " << i << " is 0x" << std::hex
                      << static_cast<int>(g[i]) << std::dec << ")";
        return;
      }
    }
  }

  void* base_ = nullptr;  // the allocation: guard, tensor, guard
  void* ptr_ = nullptr;
  size_t bytes_ = 0;
  size_t guard_ = 0;
  DType dt_ = DType::kFloat32;
  std::vector<int64_t> shape_;
  int device_ = 0;
};

// ---- inputs -------------------------------------------------------------------------------------

// Uniform in [-amp, amp], rounded to the dtype, never zero (a value that rounds to 0 is redrawn).
void randomize_nonzero(HostTensor& t, std::mt19937_64& rng, double amp) {
  std::uniform_real_distribution<double> u(-amp, amp);
  for (int64_t x = 0; x < t.numel(); ++x) {
    do t.set(x, u(rng));
    while (t.get(x) == 0.0);
  }
}

// Random inputs: q and k in [-2, 2] (main scores of standard deviation ~1.3, so the softmax is
// far from uniform), v, q_idx and k_idx in [-1, 1].
Problem random_problem(const Config& c) {
  Problem p(c);
  std::mt19937_64 rng(c.seed * 7919 + 1);
  randomize_nonzero(p.q, rng, 2.0);
  randomize_nonzero(p.k, rng, 2.0);
  for (HostTensor* t : {&p.v, &p.q_idx, &p.k_idx}) randomize_nonzero(*t, rng, 1.0);
  return p;
}

// The same values in float64: the CPU backend then returns its double results unrounded.
Problem widened(const Problem& p) {
  Config c = p.cfg;
  c.dtype = DType::kFloat64;
  Problem w(c);
  const std::pair<const HostTensor*, HostTensor*> pairs[] = {
      {&p.q, &w.q}, {&p.k, &w.k}, {&p.v, &w.v}, {&p.q_idx, &w.q_idx}, {&p.k_idx, &w.k_idx}};
  for (auto [src, dst] : pairs)
    for (int64_t x = 0; x < src->numel(); ++x) dst->set(x, src->get(x));
  return w;
}

struct DeviceInputs {
  DeviceTensor q, k, v, q_idx, k_idx, cu;
  DeviceInputs(Problem& p, cudaStream_t s)
      : q(DeviceTensor::upload(p.q, s)), k(DeviceTensor::upload(p.k, s)), v(DeviceTensor::upload(p.v, s)),
        q_idx(DeviceTensor::upload(p.q_idx, s)), k_idx(DeviceTensor::upload(p.k_idx, s)),
        cu(DeviceTensor::upload(p.cu, s)) {}
};

// ---- checks -------------------------------------------------------------------------------------

// Many small checks: a count and the first few descriptions.
struct Failures {
  int64_t count = 0;
  std::string first;
  void add(const std::string& what) {
    if (count++ < 5) first += "\n  " + what;
  }
  void merge(const Failures& o) {
    if (count < 5) first += o.first;
    count += o.count;
  }
};

// fn(item, failures) for item in [0, n), on all hardware threads; the failures merged.
template <class F>
Failures parallel_check(int64_t n, F&& fn) {
  const int threads = static_cast<int>(std::max(1u, std::min(32u, std::thread::hardware_concurrency())));
  std::vector<Failures> per(threads);
  std::atomic<int64_t> next{0};
  auto work = [&](int w) {
    for (int64_t x = next++; x < n; x = next++) fn(x, per[w]);
  };
  std::vector<std::thread> pool;
  for (int w = 1; w < threads; ++w) pool.emplace_back(work, w);
  work(0);
  for (std::thread& t : pool) t.join();
  Failures all;
  for (const Failures& f : per) all.merge(f);
  return all;
}

double out_tolerance(DType dt) { return dt == kBf16 ? 1e-2 : 3e-3; }

// out against the reference: relative L2 error over the compared rows below out_tolerance(dtype),
// and each (token, head) row within 4x that of max(its own norm, 1/8 of the RMS row norm); lse
// within 1e-3 where the reference is finite, -inf where it is -inf. `compare(t)` picks the tokens.
template <class Pick>
void expect_forward_close(const HostTensor& out, const HostTensor& lse, const FwdResult& ref, DType dt,
                          Pick&& compare, const std::string& what) {
  const std::vector<int64_t>& shape = out.shape();
  const int64_t T = shape[0], H = shape[1], D = shape[2];
  const double tol = out_tolerance(dt);
  double err2 = 0, ref2 = 0;
  int64_t rows = 0;
  for (int64_t r = 0; r < T * H; ++r) {
    if (!compare(r / H)) continue;
    ++rows;
    for (int64_t d = 0; d < D; ++d) {
      const double a = out.get(r * D + d), b = ref.out.get(r * D + d);
      err2 += (a - b) * (a - b);  // NaN makes err2 NaN: fails below
      ref2 += b * b;
    }
  }
  if (rows == 0) return;
  const double rel = std::sqrt(err2 / std::max(ref2, 1e-300));
  EXPECT_LT(rel, tol) << what << ": out relative L2 error (NaN: an output left unwritten or a NaN leak)";
  const double rms_row = std::sqrt(ref2 / static_cast<double>(rows));
  Failures f;
  for (int64_t r = 0; r < T * H; ++r) {
    if (!compare(r / H)) continue;
    const std::string where = what + " [token " + std::to_string(r / H) + ", head " + std::to_string(r % H) + "]";
    double e2 = 0, n2 = 0;
    for (int64_t d = 0; d < D; ++d) {
      const double a = out.get(r * D + d), b = ref.out.get(r * D + d);
      e2 += (a - b) * (a - b);
      n2 += b * b;
    }
    const double row_err = std::sqrt(e2) / std::max(std::sqrt(n2), rms_row / 8);
    if (!(row_err < 4 * tol)) f.add(where + ": out row error " + std::to_string(row_err));
    const double lg = lse.get(r), lr = ref.lse.get(r);
    if (std::isinf(lr) && lr < 0) {
      if (!(std::isinf(lg) && lg < 0)) f.add(where + ": lse " + std::to_string(lg) + ", expected -inf");
    } else if (!(std::fabs(lg - lr) < 1e-3)) {
      f.add(where + ": lse " + std::to_string(lg) + ", expected " + std::to_string(lr));
    }
  }
  EXPECT_EQ(f.count, 0) << f.first;
}

void expect_forward_close(const HostTensor& out, const HostTensor& lse, const FwdResult& ref, DType dt,
                          const std::string& what) {
  expect_forward_close(out, lse, ref, dt, [](int64_t) { return true; }, what);
}

// Index scores from float copies of q_idx and k_idx (16-bit values are exact in float), summed in
// double: block maxima and log-normalisers of contract §2 / §4 for any row.
class IndexScores {
 public:
  explicit IndexScores(const Problem& p)
      : p_(p), qi_(to_float(p.q_idx)), ki_(to_float(p.k_idx)), scale_(p.scale_idx()) {}

  int own_block(int64_t g) const { return static_cast<int>((g - seq_begin(p_, g)) / p_.cfg.Bk); }

  // M(t, b) for b in [0, own] (NaN scores count as -inf, as in the backends).
  std::vector<double> block_maxima(int64_t g, int i) const {
    const int64_t b0 = seq_begin(p_, g), t = g - b0;
    std::vector<double> m(t / p_.cfg.Bk + 1, -INFINITY);
    for (int64_t j = 0; j <= t; ++j) {
      const double s = score(g, i, b0 + j);
      if (s > m[j / p_.cfg.Bk]) m[j / p_.cfg.Bk] = s;
    }
    return m;
  }

  // log sum exp of the scores over the keys j <= t of `blocks`.
  double lse_over(int64_t g, int i, const std::vector<int>& blocks) const {
    const int64_t b0 = seq_begin(p_, g), t = g - b0;
    std::vector<double> s;
    for (int b : blocks)
      for (int64_t j = int64_t{b} * p_.cfg.Bk; j < std::min<int64_t>(int64_t{b + 1} * p_.cfg.Bk, t + 1); ++j)
        s.push_back(score(g, i, b0 + j));
    if (s.empty()) return -INFINITY;
    const double mx = *std::max_element(s.begin(), s.end());
    double z = 0;
    for (double x : s) z += std::exp(x - mx);
    return mx + std::log(z);
  }

 private:
  static std::vector<float> to_float(const HostTensor& t) {
    std::vector<float> v(t.numel());
    for (int64_t x = 0; x < t.numel(); ++x) v[x] = static_cast<float>(t.get(x));
    return v;
  }
  double score(int64_t g, int i, int64_t gj) const {
    const int Di = p_.cfg.Di, ik = i / (p_.cfg.Hi / p_.cfg.Hik);
    const float* a = &qi_[(g * p_.cfg.Hi + i) * Di];
    const float* b = &ki_[(gj * p_.cfg.Hik + ik) * Di];
    double acc = 0;
    for (int d = 0; d < Di; ++d) acc += static_cast<double>(a[d]) * b[d];
    return scale_ * acc;
  }

  const Problem& p_;
  std::vector<float> qi_, ki_;
  double scale_;
};

// One returned block_idx row.
std::vector<int> bi_row(const HostTensor& bi, int64_t g, int i) {
  std::vector<int> row(bi.shape()[2]);
  for (size_t j = 0; j < row.size(); ++j) row[j] = bi.idx(g, i, static_cast<int64_t>(j));
  return row;
}

// Selection rows `tokens` (all heads): the contract's format (ascending ids, then -1 padding), its
// acceptance rule with a slack of 1e-3 * (1 + |k-th score|), and lse_idx (when given) within
// 1e-3 * (1 + |ref|) of the log-normaliser over the returned support.
// With `shortlist` (kFp8 with fp8_rerank = m > 0: the E4M3 copies' scores) the rule is
// shortlist_rule_error's instead (`a`: fp8_rerank_slots), with `sc` the inputs' own scores.
Failures check_selection(const Problem& p, const IndexScores& sc, const HostTensor& bi, const HostTensor* lse_idx,
                         const std::vector<int64_t>& tokens, const IndexScores* shortlist = nullptr, int m = 0,
                         int a = 0) {
  return parallel_check(static_cast<int64_t>(tokens.size()), [&](int64_t x, Failures& f) {
    const int64_t g = tokens[x];
    const int own = sc.own_block(g);
    for (int i = 0; i < p.cfg.Hi; ++i) {
      const std::string where = "block_idx[" + std::to_string(g) + ", " + std::to_string(i) + "]";
      const std::vector<int> row = bi_row(bi, g, i);
      const std::string format = selection_format_error(row, own);
      if (!format.empty()) {
        f.add(where + ": " + format);
        continue;
      }
      std::vector<int> chosen;
      for (int b : row)
        if (b >= 0) chosen.push_back(b);
      const std::string rule =
          shortlist != nullptr
              ? shortlist_rule_error(p.cfg, own, shortlist->block_maxima(g, i), sc.block_maxima(g, i), m, chosen,
                                     1e-3, 1e-3, a)
              : selection_rule_error(p.cfg, own, sc.block_maxima(g, i), chosen, 1e-3, 1e-3);
      if (!rule.empty()) f.add(where + ": " + rule);
      if (lse_idx) {
        const double want = sc.lse_over(g, i, chosen), got = lse_idx->at(g, i);
        if (!(std::fabs(got - want) <= 1e-3 * (1 + std::fabs(want))))
          f.add("lse_idx[" + std::to_string(g) + ", " + std::to_string(i) + "] = " + std::to_string(got) +
                ", expected " + std::to_string(want));
      }
    }
  });
}

// select_blocks with lse_idx, or without it when the backend answers that it does not produce it
// yet (kNotSupported naming 'lse_idx'); *with_lse tells which.
msa::Status select_with_lse_idx(msa::SelectParams sp, bool* with_lse) {
  const msa::Status s = msa::select_blocks(sp);
  *with_lse = !(s.code == StatusCode::kNotSupported && s.message.find("argument 'lse_idx'") != std::string::npos);
  if (*with_lse) return s;
  std::printf("note: %s; lse_idx not checked\n", s.message.c_str());
  sp.lse_idx = {};
  return msa::select_blocks(sp);
}

std::vector<int64_t> all_tokens(const Problem& p) {
  std::vector<int64_t> t(p.T);
  for (int64_t g = 0; g < p.T; ++g) t[g] = g;
  return t;
}

// A caller's block_idx in any legal form, one column wider than k: the CPU selection with each row
// shuffled and -1 anywhere, the own block left out of some rows, another block out of others, and
// a few rows empty (their lse is -inf, their out 0).
HostTensor scrambled_block_idx(Problem& p, uint64_t seed) {
  const Config& c = p.cfg;
  const HostTensor sel = run_select(p);
  HostTensor bi(DType::kInt32, {p.T, c.Hi, c.k + 1});
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<double> u(0, 1);
  for (int64_t g = 0; g < p.T; ++g) {
    const int own = static_cast<int>((g - seq_begin(p, g)) / c.Bk);
    for (int i = 0; i < c.Hi; ++i) {
      std::vector<int> row = bi_row(sel, g, i);
      row.push_back(-1);
      const double r = u(rng);
      for (int& b : row) {
        if (r < 0.03) b = -1;                                       // empty support
        else if (r < 0.13 && b == own) b = -1;                      // without its own block
        else if (r > 0.9 && b >= 0 && b != own && u(rng) < 0.5) b = -1;  // fewer blocks
      }
      std::shuffle(row.begin(), row.end(), rng);
      for (int j = 0; j <= c.k; ++j) bi.set((g * c.Hi + i) * (c.k + 1) + j, row[j]);
    }
  }
  return bi;
}

// ---- the parameterised comparison -----------------------------------------------------------------

struct CudaCase {
  const char* name;
  Config cfg;
  bool own_stream;     // launch on a non-default stream
  bool no_cu_seqlens;  // a single sequence passed without cu_seqlens
};

void PrintTo(const CudaCase& c, std::ostream* os) {
  *os << c.name << " (" << c.cfg.str() << (c.own_stream ? ", own stream" : "")
      << (c.no_cu_seqlens ? ", no cu_seqlens" : "") << ")";
}

Config shape(std::vector<int64_t> lens, int Hq, int Hkv, int D, int Hi, int Hik, int Di, int Bk, int k, DType dt,
             uint64_t seed, int sink = 0, int local = 1) {
  Config c = make_config(std::move(lens), Hq, Hkv, D, Hi, Hik, Bk, k, seed);
  c.Di = Di;
  c.dtype = dt;
  c.sink = sink;
  c.local = local;
  return c;
}

// 4200 sequences of 0-9 tokens, then one of 3000: more KV-side work items (KV tile ids x KV
// heads: 8648) than one CTA lays out, so the work lists take the multi-kernel path; the long
// sequence's tiles come last, so a CTA's lookup of its tile (e.g. the FP8 re-ranking's, over
// thousands of segments) finds it deep in the tables.
std::vector<int64_t> many_sequences() {
  std::vector<int64_t> lens;
  const int64_t cycle[] = {1, 2, 0, 5, 9};
  for (int i = 0; i < 4200; ++i) lens.push_back(cycle[i % 5]);
  lens.push_back(3000);
  return lens;
}

// Lengths 1, 113, 799, 4224 and empty sequences; G = Hq/Hkv in {1, 2, 4, 8, 16}; Hi = Hkv and
// 2 Hkv; Hik = 1 and Hi; D, Di and Bk 64 and 128; bf16 and fp16; default and own streams.
const CudaCase kCases[] = {
    //                      seqlens            Hq Hkv  D   Hi Hik Di  Bk  k  dtype seed
    {"G1_D128_Di128_Bk128", shape({799},        2, 2, 128, 2, 1, 128, 128, 4, kBf16, 1), false, true},
    {"G2_D64_Di64_Bk64_fp16", shape({113, 799}, 4, 2, 64, 4, 4, 64, 64, 4, kFp16, 2), true, false},
    {"G4_D128_Di64_Bk128", shape({1, 4224},     4, 1, 128, 2, 2, 64, 128, 8, kBf16, 3), false, false},
    {"G8_D64_Di128_Bk64_sink", shape({4224},    8, 1, 64, 2, 1, 128, 64, 16, kBf16, 4, 1, 2), true, false},
    {"G16_D128_Bk128_varlen_fp16", shape({799, 0, 113, 1}, 16, 1, 128, 1, 1, 128, 128, 3, kFp16, 5), true, false},
    {"KCoversAllBlocks_Bk128", shape({799, 500}, 4, 2, 64, 2, 1, 64, 128, 8, kBf16, 6), false, false},
    // KL branch paths of the backward: Gi = 4 with two index heads per KV head and two index key
    // heads (fused, the block's index keys change within a CTA); Gi = 32 and 64 (fused, 2 and 1
    // tokens per entry); Gi = 3 (not a power of two: the separate KL pass).
    {"G4_Hi4_Hik2_D128_Bk128", shape({1100, 300}, 16, 2, 128, 4, 2, 128, 128, 4, kBf16, 7), false, false},
    {"G32_D64_Bk128", shape({900}, 32, 1, 64, 1, 1, 64, 128, 3, kBf16, 8), false, true},
    {"G3_Hi4_D64_Bk64_fp16", shape({650, 131}, 12, 2, 64, 4, 2, 64, 64, 6, kFp16, 9), true, false},
    {"G64_D64_Bk64", shape({300}, 64, 1, 64, 1, 1, 64, 64, 3, kBf16, 10), false, false},
    // An index key head per index head (Hik = Hi) with two index heads per KV head: a work
    // item's index keys change between its records, so the KL passes take one record a step.
    {"G4_Hi4_Hik4_D128_Bk128", shape({900, 250}, 8, 2, 128, 4, 4, 128, 128, 4, kBf16, 12), false, false},
    // The paper's heads (Gi = 16: 4 tokens per entry, 4 entries per step of the teacher route's
    // gradient pass), varlen with an empty sequence, sink and local blocks.
    {"Paper_G16_Hi4_D128_Bk128", shape({700, 0, 1300}, 64, 4, 128, 4, 1, 128, 128, 6, kBf16, 11, 1, 2), false, false},
    // Gi = 8: the KV-side backward's kernel with Gi at run time on the teacher route (Gi = 4 and
    // 16 take kernels with Gi a constant), 8 tokens per entry.
    {"G8_Hi2_D128_Bk128", shape({1500, 77}, 16, 2, 128, 2, 1, 128, 128, 5, kBf16, 13, 1, 2), false, false},
    // Gi = 2 (examples/train_retrieval.py's --idx-heads 4): the KV-side backward takes two
    // records of 16 tokens x 2 heads a step, here often of the KV head's two index heads; dq
    // from K-major dS tiles of two heads. G = 2: the same in dense mode (KV heads as the column
    // groups), one index head per KV head in sparse mode.
    {"G4_Hi4_Gi2_D128_Bk128", shape({1500, 300}, 8, 2, 128, 4, 1, 128, 128, 5, kBf16, 15, 1, 2), false, false},
    {"G2_Gi2_D128_Bk128", shape({1100, 0, 517}, 4, 2, 128, 2, 1, 128, 128, 7, kBf16, 16), true, false},
    {"ManySequences_G4_D128_Bk128", shape(many_sequences(), 8, 2, 128, 2, 1, 128, 128, 4, kBf16, 14), true, false},
};

// ---- One backward call on the GPU, shared by the CUDA-vs-CPU fixtures.

// The device inputs of a call: the queries' tensors (T rows, packed by cu; undefined: one
// sequence) and the keys' (Tk rows, packed by cu_k where they lie apart from the queries, else
// undefined and Tk = T).
struct DeviceCall {
  msa::TensorRef q, k, v, q_idx, k_idx, cu, cu_k;
  int64_t T = 0, Tk = 0;
};

struct GpuGrads {
  HostTensor dq, dk, dv, dq_idx, dk_idx;
};

// Inputs of one backward call, identical on both sides: the CPU forward's out (rounded to the
// dtype) and lse, a random dout.
struct BwdCase {
  FwdResult fwd;       // float64 out (rounded values), float32 lse
  HostTensor out_lo;   // out in the dtype
  HostTensor dout_lo;  // dout in the dtype
  HostTensor dout_w;   // the same values in float64
};

// `fwd`: the CPU forward over the float64 inputs (T query rows).
BwdCase make_bwd_case(FwdResult fwd, const Config& c, int64_t T) {
  BwdCase b{std::move(fwd), HostTensor(c.dtype, {T, c.Hq, c.D}), HostTensor(c.dtype, {T, c.Hq, c.D}),
            HostTensor(DType::kFloat64, {T, c.Hq, c.D})};
  for (int64_t x = 0; x < b.out_lo.numel(); ++x) {
    b.out_lo.set(x, b.fwd.out.get(x));
    b.fwd.out.set(x, b.out_lo.get(x));
  }
  std::mt19937_64 rng(c.seed * 31 + 7);
  randomize_nonzero(b.dout_lo, rng, 1.0);
  for (int64_t x = 0; x < b.dout_lo.numel(); ++x) b.dout_w.set(x, b.dout_lo.get(x));
  return b;
}

// The options a backward call sets beyond the problem's.
struct BwdRun {
  bool deterministic = false;
  msa::KlPass kl_pass = msa::KlPass::kAuto;
  int64_t teacher_bytes = 0;  // Options.kl_teacher_bytes
  msa::DqPass dq_pass = msa::DqPass::kAuto;
  int32_t bwd_chunk = 0;  // Options.bwd_chunk_tokens
  int64_t dq_rows_bytes = 0;  // Options.kl_dq_rows_bytes
};

// backward on the GPU into poisoned gradients (dk, dv, dk_idx: Tk rows) over a poisoned
// workspace, with `opts` (the problem's, for `mode`) and `run`; the KL branch with gamma =
// kl_weight * kl_grad[0] (kl_grad on the device) when `kl`. With `status` a failed call returns
// its status there (and empty gradients) instead of failing the test.
GpuGrads gpu_backward_call(const DeviceCall& in, const Config& c, msa::Options opts, Mode mode, HostTensor* bi,
                           const BwdCase& b, bool kl, float kl_weight, float kl_grad, const BwdRun& run,
                           cudaStream_t s, msa::Status* status) {
  HostTensor out_lo = b.out_lo, dout_lo = b.dout_lo, lse = b.fwd.lse;
  DeviceTensor out = DeviceTensor::upload(out_lo, s), dout = DeviceTensor::upload(dout_lo, s);
  DeviceTensor dlse = DeviceTensor::upload(lse, s);
  DeviceTensor dbi;
  if (mode == Mode::kSparse) dbi = DeviceTensor::upload(*bi, s);
  HostTensor g_host(DType::kFloat32, {1});
  g_host.set(0, kl_grad);
  DeviceTensor dgrad = DeviceTensor::upload(g_host, s);
  DeviceTensor dq = DeviceTensor::poisoned(c.dtype, {in.T, c.Hq, c.D}, s);
  DeviceTensor dk = DeviceTensor::poisoned(c.dtype, {in.Tk, c.Hkv, c.D}, s);
  DeviceTensor dv = DeviceTensor::poisoned(c.dtype, {in.Tk, c.Hkv, c.D}, s);
  DeviceTensor dqi = DeviceTensor::poisoned(c.dtype, {in.T, c.Hi, c.Di}, s);
  DeviceTensor dki = DeviceTensor::poisoned(c.dtype, {in.Tk, c.Hik, c.Di}, s);
  msa::BackwardParams bp;
  bp.q = in.q;
  bp.k = in.k;
  bp.v = in.v;
  bp.out = out.ref();
  bp.lse = dlse.ref();
  bp.dout = dout.ref();
  bp.cu_seqlens = in.cu;
  bp.cu_seqlens_k = in.cu_k;
  if (mode == Mode::kSparse) bp.block_idx = dbi.ref();
  bp.dq = dq.ref();
  bp.dk = dk.ref();
  bp.dv = dv.ref();
  if (kl) {
    bp.q_idx = in.q_idx;
    bp.k_idx = in.k_idx;
    bp.dq_idx = dqi.ref();
    bp.dk_idx = dki.ref();
    bp.kl_grad = dgrad.ref();
    bp.kl_weight = kl_weight;
  }
  bp.opts = opts;
  bp.opts.deterministic = run.deterministic;
  bp.opts.kl_pass = run.kl_pass;
  bp.opts.kl_teacher_bytes = run.teacher_bytes;
  bp.opts.dq_pass = run.dq_pass;
  bp.opts.bwd_chunk_tokens = run.bwd_chunk;
  bp.opts.kl_dq_rows_bytes = run.dq_rows_bytes;
  bp.launch.stream = s;
  const size_t ws_bytes = msa::workspace_size(bp);
  DeviceTensor ws = DeviceTensor::poisoned(DType::kInt32, {static_cast<int64_t>((ws_bytes + 3) / 4)}, s);
  bp.launch.workspace = ws.ref().data;
  bp.launch.workspace_bytes = ws_bytes;
  const msa::Status st = msa::backward(bp);
  if (status != nullptr) {
    *status = st;
    if (!st.ok()) {
      CUDA_CHECK(cudaStreamSynchronize(s));
      return {};
    }
  } else {
    require_ok(st);
  }
  return {dq.download(s), dk.download(s), dv.download(s), dqi.download(s), dki.download(s)};
}

class CudaVsCpu : public ::testing::TestWithParam<CudaCase> {
 protected:
  void SetUp() override {
    SKIP_WITHOUT_CUDA();
    stream_ = std::make_unique<Stream>(GetParam().own_stream);
    p_ = std::make_unique<Problem>(random_problem(GetParam().cfg));
    dev_ = std::make_unique<DeviceInputs>(*p_, s());
  }

  cudaStream_t s() const { return stream_->get(); }
  Problem& p() { return *p_; }
  const Config& cfg() const { return GetParam().cfg; }
  Problem& wide() {  // built on first use
    if (!wide_) wide_ = std::make_unique<Problem>(widened(*p_));
    return *wide_;
  }
  std::string what(const std::string& test) const { return test + " " + cfg().str(); }

  struct GpuForward {
    HostTensor out, lse, block_idx;
  };

  // forward on the GPU: over `given` (kSparse, select off), over its own selection (`select`), or
  // dense (kDense); `pass` and `chunk`: Options.fwd_pass and fwd_chunk_tokens.
  GpuForward gpu_forward(Mode mode, HostTensor* given, bool select,
                         msa::FwdPass pass = msa::FwdPass::kAuto, int32_t chunk = 0,
                         msa::SelectScores scores = msa::SelectScores::kInput) {
    const Config& c = cfg();
    const int64_t T = p().T;
    DeviceTensor out = DeviceTensor::poisoned(c.dtype, {T, c.Hq, c.D}, s());
    DeviceTensor lse = DeviceTensor::poisoned(DType::kFloat32, {T, c.Hq}, s());
    DeviceTensor bi;
    msa::ForwardParams f;
    f.q = dev_->q.ref();
    f.k = dev_->k.ref();
    f.v = dev_->v.ref();
    if (!GetParam().no_cu_seqlens) f.cu_seqlens = dev_->cu.ref();
    if (mode == Mode::kSparse) {
      bi = select ? DeviceTensor::poisoned(DType::kInt32, {T, c.Hi, c.k}, s()) : DeviceTensor::upload(*given, s());
      f.block_idx = bi.ref();
      f.select = select;
    }
    if (select) {
      f.q_idx = dev_->q_idx.ref();
      f.k_idx = dev_->k_idx.ref();
    }
    f.out = out.ref();
    f.lse = lse.ref();
    f.opts = p().options(mode);
    f.opts.fwd_pass = pass;
    f.opts.fwd_chunk_tokens = chunk;
    f.opts.select_scores = scores;
    f.launch.stream = s();
    const size_t ws_bytes = msa::workspace_size(f);
    DeviceTensor ws(DType::kInt32, {static_cast<int64_t>((ws_bytes + 3) / 4)});
    if (ws_bytes > 0) {
      f.launch.workspace = ws.ref().data;
      f.launch.workspace_bytes = ws_bytes;
    }
    require_ok(msa::forward(f));
    GpuForward r{out.download(s()), lse.download(s()), {}};
    if (select) r.block_idx = bi.download(s());
    return r;
  }

  // The CPU forward's out and lse and a random dout: the inputs of one backward call.
  BwdCase bwd_case(Mode mode, HostTensor* bi) { return make_bwd_case(run_forward(wide(), bi, mode, false), cfg(), p().T); }

  // backward on the GPU (gpu_backward_call) over the device inputs.
  GpuGrads gpu_backward(Mode mode, HostTensor* bi, const BwdCase& b, bool kl, float kl_weight, float kl_grad,
                        bool deterministic = false, msa::Status* status = nullptr,
                        msa::KlPass pass = msa::KlPass::kAuto, int64_t teacher_bytes = 0,
                        msa::DqPass dq_pass = msa::DqPass::kAuto, int32_t bwd_chunk = 0,
                        int64_t dq_rows_bytes = 0) {
    DeviceCall in{dev_->q.ref(), dev_->k.ref(), dev_->v.ref(), dev_->q_idx.ref(), dev_->k_idx.ref(), {}, {}, p().T, p().T};
    if (!GetParam().no_cu_seqlens) in.cu = dev_->cu.ref();
    const BwdRun run{deterministic, pass, teacher_bytes, dq_pass, bwd_chunk, dq_rows_bytes};
    return gpu_backward_call(in, cfg(), p().options(mode), mode, bi, b, kl, kl_weight, kl_grad, run, s(), status);
  }

 private:
  std::unique_ptr<Stream> stream_;
  std::unique_ptr<Problem> p_, wide_;
  std::unique_ptr<DeviceInputs> dev_;

 protected:
  DeviceInputs& dev() { return *dev_; }
  msa::TensorRef dev_q() { return dev_->q.ref(); }

  // select_blocks over the device inputs into bi and lse_idx, on the test's stream.
  msa::SelectParams select_params(DeviceTensor& bi, DeviceTensor& lse_idx) {
    msa::SelectParams sp;
    sp.q_idx = dev().q_idx.ref();
    sp.k_idx = dev().k_idx.ref();
    if (!GetParam().no_cu_seqlens) sp.cu_seqlens = dev().cu.ref();
    sp.block_idx = bi.ref();
    sp.lse_idx = lse_idx.ref();
    sp.opts = p().options();
    sp.launch.stream = s();
    return sp;
  }
};

// select_blocks with lse_idx: the contract's format and tolerance rule on every row.
TEST_P(CudaVsCpu, SelectBlocks) {
  SKIP_UNLESS_BUILT(cfg(), false, true);
  const Config& c = cfg();
  DeviceTensor bi = DeviceTensor::poisoned(DType::kInt32, {p().T, c.Hi, c.k}, s());
  DeviceTensor lse_idx = DeviceTensor::poisoned(DType::kFloat32, {p().T, c.Hi}, s());
  msa::SelectParams sp = select_params(bi, lse_idx);
  bool with_lse = false;
  require_ok(select_with_lse_idx(sp, &with_lse));
  const HostTensor got = bi.download(s()), got_lse = lse_idx.download(s());
  const Failures f = check_selection(p(), IndexScores(p()), got, with_lse ? &got_lse : nullptr, all_tokens(p()));
  EXPECT_EQ(f.count, 0) << what("select_blocks") << f.first;
}

// select_blocks with FP8 scores (Options.select_scores = kFp8), fp8_rerank 0 and 4 (and 4 with
// fp8_rerank_slots 1 and 2): the contract's format and tolerance rule over the scores of the
// dequantised E4M3 copies (the tests' own quantiser), or the shortlist's rule over those and the
// inputs' scores; lse_idx over the returned support with the inputs' own scores; the re-ranked
// selection the same in a second call (its lists are built with atomics).
TEST_P(CudaVsCpu, SelectBlocksFp8) {
  SKIP_UNLESS_BUILT(cfg(), false, true);
  const Config& c = cfg();
  const Problem q8 = fp8_scored(p());
  const IndexScores own(p()), own8(q8);
  for (const auto [m, a] : {std::pair{0, 0}, std::pair{4, 0}, std::pair{4, 1}, std::pair{4, 2}}) {
    DeviceTensor bi = DeviceTensor::poisoned(DType::kInt32, {p().T, c.Hi, c.k}, s());
    DeviceTensor lse_idx = DeviceTensor::poisoned(DType::kFloat32, {p().T, c.Hi}, s());
    msa::SelectParams sp = select_params(bi, lse_idx);
    sp.opts.select_scores = msa::SelectScores::kFp8;
    sp.opts.fp8_rerank = m;
    sp.opts.fp8_rerank_slots = a;
    const size_t ws_bytes = msa::workspace_size(sp);
    ASSERT_GT(ws_bytes, 0u);
    DeviceTensor ws = DeviceTensor::poisoned(DType::kInt32, {static_cast<int64_t>((ws_bytes + 3) / 4)}, s());
    sp.launch.workspace = ws.ref().data;
    sp.launch.workspace_bytes = ws_bytes;
    require_ok(msa::select_blocks(sp));
    const HostTensor got = bi.download(s()), got_lse = lse_idx.download(s());
    const std::string name =
        "select_blocks, kFp8, fp8_rerank " + std::to_string(m) + ", fp8_rerank_slots " + std::to_string(a);
    const Failures f = m == 0 ? check_selection(q8, own8, got, nullptr, all_tokens(p()))
                              : check_selection(p(), own, got, nullptr, all_tokens(p()), &own8, m, a);
    EXPECT_EQ(f.count, 0) << what(name) << f.first;
    Failures fl;
    for (int64_t g = 0; g < p().T; ++g)
      for (int i = 0; i < c.Hi; ++i) {
        std::vector<int> chosen;
        for (int b : bi_row(got, g, i))
          if (b >= 0) chosen.push_back(b);
        const double want = own.lse_over(g, i, chosen), lse = got_lse.at(g, i);
        if (!(std::fabs(lse - want) <= 1e-3 * (1 + std::fabs(want))))
          fl.add("lse_idx[" + std::to_string(g) + ", " + std::to_string(i) + "] = " + std::to_string(lse) +
                 ", expected " + std::to_string(want));
      }
    EXPECT_EQ(fl.count, 0) << what(name + ", lse_idx") << fl.first;
    if (m > 0) {
      DeviceTensor bi2 = DeviceTensor::poisoned(DType::kInt32, {p().T, c.Hi, c.k}, s());
      sp.block_idx = bi2.ref();
      sp.lse_idx = {};
      require_ok(msa::select_blocks(sp));
      const HostTensor again = bi2.download(s());
      int64_t differ = 0;
      for (int64_t x = 0; x < got.numel(); ++x) differ += got.get(x) != again.get(x);
      EXPECT_EQ(differ, 0) << what(name + ": a second call differs");
    }
  }
}

// forward with select = true and FP8 scores (fp8_rerank = 4, the default): the selection by the
// shortlist's rule, then out and lse against the CPU over the block_idx the GPU chose.
TEST_P(CudaVsCpu, ForwardWithSelectFp8) {
  SKIP_UNLESS_BUILT(cfg(), true, true);
  GpuForward g = gpu_forward(Mode::kSparse, nullptr, true, msa::FwdPass::kAuto, 0, msa::SelectScores::kFp8);
  const Problem q8 = fp8_scored(p());
  const IndexScores own8(q8);
  const Failures f = check_selection(p(), IndexScores(p()), g.block_idx, nullptr, all_tokens(p()), &own8, 4);
  ASSERT_EQ(f.count, 0) << what("forward, select = true, kFp8") << f.first;
  const FwdResult ref = run_forward(wide(), &g.block_idx, Mode::kSparse, false);
  expect_forward_close(g.out, g.lse, ref, cfg().dtype, what("forward, select = true, kFp8"));
}

// forward over a caller's block_idx (the same one on both sides) in any legal form.
TEST_P(CudaVsCpu, ForwardGivenBlockIdx) {
  SKIP_UNLESS_BUILT(cfg(), true, false);
  HostTensor bi = scrambled_block_idx(p(), cfg().seed + 11);
  const GpuForward g = gpu_forward(Mode::kSparse, &bi, false);
  const FwdResult ref = run_forward(wide(), &bi, Mode::kSparse, false);
  expect_forward_close(g.out, g.lse, ref, cfg().dtype, what("forward, given block_idx"));
}

// The KV-block forward (Options.fwd_pass = kKvBlock) and the split (kSplit: the query tiles take
// the blocks most of their tokens selected, the KV-block pass the rest) over a caller's block_idx
// in any legal form (-1 anywhere, rows without their own block, empty rows), in one pass and in
// passes of 97 tokens (a pass boundary inside a query tile), against the CPU.
TEST_P(CudaVsCpu, ForwardKvBlock) {
  SKIP_UNLESS_BUILT(cfg(), true, false);
  HostTensor bi = scrambled_block_idx(p(), cfg().seed + 13);
  const FwdResult ref = run_forward(wide(), &bi, Mode::kSparse, false);
  for (msa::FwdPass pass : {msa::FwdPass::kKvBlock, msa::FwdPass::kSplit}) {
    const std::string name = pass == msa::FwdPass::kSplit ? "kSplit" : "kKvBlock";
    for (int32_t chunk : {0, 97}) {
      const GpuForward g = gpu_forward(Mode::kSparse, &bi, false, pass, chunk);
      expect_forward_close(g.out, g.lse, ref, cfg().dtype,
                           what("forward, " + name + ", pass tokens " + std::to_string(chunk)));
    }
  }
}

// forward with select = true: the selection by the contract's rule, then out and lse against the
// CPU over the block_idx the GPU chose.
TEST_P(CudaVsCpu, ForwardWithSelect) {
  SKIP_UNLESS_BUILT(cfg(), true, true);
  GpuForward g = gpu_forward(Mode::kSparse, nullptr, true);
  const Failures f = check_selection(p(), IndexScores(p()), g.block_idx, nullptr, all_tokens(p()));
  ASSERT_EQ(f.count, 0) << what("forward, select = true") << f.first;
  const FwdResult ref = run_forward(wide(), &g.block_idx, Mode::kSparse, false);
  expect_forward_close(g.out, g.lse, ref, cfg().dtype, what("forward, select = true"));
}

// The warmup forward (Mode::kDense): dense causal attention.
TEST_P(CudaVsCpu, DenseWarmupForward) {
  SKIP_UNLESS_BUILT(cfg(), true, false);
  const GpuForward g = gpu_forward(Mode::kDense, nullptr, false);
  const FwdResult ref = run_forward(wide(), nullptr, Mode::kDense, false);
  expect_forward_close(g.out, g.lse, ref, cfg().dtype, what("forward, kDense"));
}


// Gradient tolerance: relative L2 over the tensor, and per row (last dim) within 4x that of
// max(its own norm, 1/8 of the RMS row norm).
double grad_tolerance(DType dt) { return dt == kBf16 ? 2e-2 : 6e-3; }

// The KL gradient is built from sigma - pi, a difference of two close distributions, so its
// relative error is larger than the main gradients' (fp16 runs measured 6.1e-3 to 6.3e-3).
double kl_grad_tolerance(DType dt) { return dt == kBf16 ? 2e-2 : 1.5e-2; }

void expect_grad_close(const HostTensor& got, const HostTensor& ref, DType dt, const std::string& what,
                       double tol = 0) {
  const int64_t D = got.shape().back(), rows = got.numel() / D;
  ASSERT_EQ(got.numel(), ref.numel()) << what;
  if (tol == 0) tol = grad_tolerance(dt);
  double err2 = 0, ref2 = 0;
  for (int64_t x = 0; x < got.numel(); ++x) {
    const double a = got.get(x), b = ref.get(x);
    err2 += (a - b) * (a - b);
    ref2 += b * b;
  }
  if (rows == 0) return;
  const double rel = std::sqrt(err2 / std::max(ref2, 1e-300));
  EXPECT_LT(rel, tol) << what << ": relative L2 error (NaN: an output left unwritten or a NaN leak)";
  const double rms_row = std::sqrt(ref2 / static_cast<double>(rows));
  Failures f;
  for (int64_t r = 0; r < rows; ++r) {
    double e2 = 0, n2 = 0;
    for (int64_t d = 0; d < D; ++d) {
      const double a = got.get(r * D + d), b = ref.get(r * D + d);
      e2 += (a - b) * (a - b);
      n2 += b * b;
    }
    const double row_err = std::sqrt(e2) / std::max(std::sqrt(n2), std::max(rms_row / 8, 1e-300));
    if (!(row_err < 4 * tol)) f.add(what + " row " + std::to_string(r) + ": error " + std::to_string(row_err));
  }
  EXPECT_EQ(f.count, 0) << f.first;
}

// The KL branch needs Di == D on the GPU (one instantiation per head dim).
bool kl_on_gpu(const Config& c) { return c.D == c.Di; }

// Elements whose values differ between two tensors of the same shape (NaN equals NaN).
int64_t differing(const HostTensor& a, const HostTensor& b) {
  int64_t diff = 0;
  for (int64_t e = 0; e < a.numel(); ++e) {
    const double u = a.get(e), v = b.get(e);
    diff += !(u == v || (std::isnan(u) && std::isnan(v)));
  }
  return diff;
}

// The gradients of two calls equal bit for bit (the index gradients where `kl`); a failure names
// the gradient, `where` (the test's case) and `why`.
void expect_same_grads(const GpuGrads& a, const GpuGrads& b, bool kl, const std::string& where, const std::string& why) {
  const std::tuple<const HostTensor*, const HostTensor*, const char*> same[] = {
      {&a.dq, &b.dq, "dq"}, {&a.dk, &b.dk, "dk"}, {&a.dv, &b.dv, "dv"},
      {&a.dq_idx, &b.dq_idx, "dq_idx"}, {&a.dk_idx, &b.dk_idx, "dk_idx"}};
  for (auto [x, y, name] : same) {
    if (!kl && std::string(name).find("idx") != std::string::npos) continue;
    EXPECT_EQ(differing(*x, *y), 0) << name << " " << where << ": " << why;
  }
}

// backward over a caller's block_idx: dq, dk, dv and (Di == D) dq_idx, dk_idx with
// gamma = 0.5 * 1.5 against the CPU backend on the same out, lse and dout.
TEST_P(CudaVsCpu, BackwardGivenBlockIdx) {
  SKIP_UNLESS_BUILT(cfg(), true, false);
  HostTensor bi = scrambled_block_idx(p(), cfg().seed + 11);
  BwdCase b = bwd_case(Mode::kSparse, &bi);
  const bool kl = kl_on_gpu(cfg());
  const GpuGrads g = gpu_backward(Mode::kSparse, &bi, b, kl, 0.5f, 1.5f);
  const BwdResult ref = run_backward(wide(), &bi, Mode::kSparse, b.fwd, b.dout_w, 0.75);
  const DType dt = cfg().dtype;
  expect_grad_close(g.dq, ref.dq, dt, what("backward dq"));
  expect_grad_close(g.dk, ref.dk, dt, what("backward dk"));
  expect_grad_close(g.dv, ref.dv, dt, what("backward dv"));
  if (kl) {
    expect_grad_close(g.dq_idx, ref.dq_idx, dt, what("backward dq_idx"), kl_grad_tolerance(dt));
    expect_grad_close(g.dk_idx, ref.dk_idx, dt, what("backward dk_idx"), kl_grad_tolerance(dt));
    const int gi = cfg().Hq / cfg().Hi;
    if ((gi & (gi - 1)) == 0) {
      // The fused KL branch (kAuto takes kTeacher in sparse mode) against the reference too.
      const GpuGrads f = gpu_backward(Mode::kSparse, &bi, b, true, 0.5f, 1.5f, false, nullptr, msa::KlPass::kFused);
      expect_grad_close(f.dq, ref.dq, dt, what("fused backward dq"));
      expect_grad_close(f.dk, ref.dk, dt, what("fused backward dk"));
      expect_grad_close(f.dv, ref.dv, dt, what("fused backward dv"));
      expect_grad_close(f.dq_idx, ref.dq_idx, dt, what("fused backward dq_idx"), kl_grad_tolerance(dt));
      expect_grad_close(f.dk_idx, ref.dk_idx, dt, what("fused backward dk_idx"), kl_grad_tolerance(dt));
      // kTeacher in passes of a few records (the least workspace: one chunk per pass) gives the
      // bits of one pass: each CTA's work is the same, and the sums are integers.
      const GpuGrads t = gpu_backward(Mode::kSparse, &bi, b, true, 0.5f, 1.5f, false, nullptr, msa::KlPass::kTeacher, 1);
      expect_same_grads(g, t, true, what(""), "kTeacher in many passes differs from one pass");
      // dq_idx by per-block rows (Options.kl_dq_rows_bytes; at these sizes the sums are the
      // default): the main branch's bits, dk_idx's bits (the same integer sums), dq_idx against
      // the reference, and the same bits in one pass and in many (rows added in column order).
      GpuGrads rows[2];
      for (const int64_t teacher_bytes : {int64_t(0), int64_t(1)}) {
        GpuGrads& u = rows[teacher_bytes];
        u = gpu_backward(Mode::kSparse, &bi, b, true, 0.5f, 1.5f, false, nullptr, msa::KlPass::kTeacher,
                         teacher_bytes, msa::DqPass::kAuto, 0, int64_t(1) << 40);
        const std::string why = "dq_idx by per-block rows, teacher bytes " + std::to_string(teacher_bytes);
        expect_same_grads(g, u, false, what(""), why);
        EXPECT_EQ(differing(g.dk_idx, u.dk_idx), 0) << "dk_idx " << what("") << ": " << why;
        expect_grad_close(u.dq_idx, ref.dq_idx, dt, what("backward dq_idx, " + why), kl_grad_tolerance(dt));
      }
      expect_same_grads(rows[0], rows[1], true, what(""), "dq_idx by rows in many passes differs from one pass");
    }
  } else {
    msa::Status st;
    gpu_backward(Mode::kSparse, &bi, b, true, 0.5f, 1.5f, false, &st);
    EXPECT_EQ(st.code, StatusCode::kNotSupported) << st.message;
    EXPECT_NE(st.message.find("argument 'q_idx'"), std::string::npos) << st.message;
  }
}

// dq from dS (Options.dq_pass): where it can run (Hq / Hi a power of two from 2 to 64, k <= 32)
// kAuto takes it; the query tiles (kQueryTile) and kFromDs in passes of 97 tokens (dK and dV
// then fp32 sums across passes; the KL gradient per pass) agree with the CPU backend, and two
// calls in passes give the same bits. Elsewhere kFromDs is refused naming 'dq_pass'.
TEST_P(CudaVsCpu, BackwardDqPasses) {
  SKIP_UNLESS_BUILT(cfg(), true, false);
  const Config& c = cfg();
  const int gi = c.Hq / c.Hi;
  const bool from_ds = gi >= 2 && gi <= 64 && (gi & (gi - 1)) == 0 && c.k <= 32;
  HostTensor bi = scrambled_block_idx(p(), c.seed + 14);
  BwdCase b = bwd_case(Mode::kSparse, &bi);
  const bool kl = kl_on_gpu(c);
  if (!from_ds) {
    msa::Status st;
    gpu_backward(Mode::kSparse, &bi, b, kl, 0.5f, 1.5f, false, &st, msa::KlPass::kAuto, 0, msa::DqPass::kFromDs);
    EXPECT_EQ(st.code, StatusCode::kNotSupported) << st.message;
    EXPECT_NE(st.message.find("argument 'dq_pass'"), std::string::npos) << st.message;
    return;
  }
  const BwdResult ref = run_backward(wide(), &bi, Mode::kSparse, b.fwd, b.dout_w, 0.75);
  const DType dt = c.dtype;
  auto check = [&](const GpuGrads& g, const std::string& name) {
    expect_grad_close(g.dq, ref.dq, dt, what(name + " dq"));
    expect_grad_close(g.dk, ref.dk, dt, what(name + " dk"));
    expect_grad_close(g.dv, ref.dv, dt, what(name + " dv"));
    if (kl) {
      expect_grad_close(g.dq_idx, ref.dq_idx, dt, what(name + " dq_idx"), kl_grad_tolerance(dt));
      expect_grad_close(g.dk_idx, ref.dk_idx, dt, what(name + " dk_idx"), kl_grad_tolerance(dt));
    }
  };
  const GpuGrads g0 = gpu_backward(Mode::kSparse, &bi, b, kl, 0.5f, 1.5f, false, nullptr, msa::KlPass::kAuto, 0,
                                   msa::DqPass::kQueryTile);
  check(g0, "query-tile dq:");
  const GpuGrads g1 = gpu_backward(Mode::kSparse, &bi, b, kl, 0.5f, 1.5f, true, nullptr, msa::KlPass::kAuto, 0,
                                   msa::DqPass::kFromDs, 97);
  check(g1, "dq from dS in passes of 97 tokens:");
  // dq_idx is a fixed-point sum of one product per (token, index head, block), whatever the
  // passes: the same bits in passes of 97 tokens as in one. (dk_idx's chunks follow the passes,
  // so its fp32 partial sums, and bits, may differ.)
  if (kl) EXPECT_EQ(differing(g0.dq_idx, g1.dq_idx), 0) << what("dq_idx") << ": passes of 97 tokens differ from one pass";
  const GpuGrads g2 = gpu_backward(Mode::kSparse, &bi, b, kl, 0.5f, 1.5f, true, nullptr, msa::KlPass::kAuto, 0,
                                   msa::DqPass::kFromDs, 97);
  expect_same_grads(g1, g2, kl, what(""), "two calls in passes of 97 tokens differ");
}

// The warmup backward (kDense): dense causal attention backward and the KL over the full causal
// support.
TEST_P(CudaVsCpu, DenseWarmupBackward) {
  SKIP_UNLESS_BUILT(cfg(), true, false);
  BwdCase b = bwd_case(Mode::kDense, nullptr);
  const bool kl = kl_on_gpu(cfg());
  const GpuGrads g = gpu_backward(Mode::kDense, nullptr, b, kl, 2.0f, 1.0f);
  const BwdResult ref = run_backward(wide(), nullptr, Mode::kDense, b.fwd, b.dout_w, 2.0);
  const DType dt = cfg().dtype;
  expect_grad_close(g.dq, ref.dq, dt, what("dense backward dq"));
  expect_grad_close(g.dk, ref.dk, dt, what("dense backward dk"));
  expect_grad_close(g.dv, ref.dv, dt, what("dense backward dv"));
  if (kl) {
    expect_grad_close(g.dq_idx, ref.dq_idx, dt, what("dense backward dq_idx"), kl_grad_tolerance(dt));
    expect_grad_close(g.dk_idx, ref.dk_idx, dt, what("dense backward dk_idx"), kl_grad_tolerance(dt));
    msa::Status st;  // the teacher route is for sparse mode only
    gpu_backward(Mode::kDense, nullptr, b, true, 2.0f, 1.0f, false, &st, msa::KlPass::kTeacher);
    EXPECT_EQ(st.code, StatusCode::kNotSupported) << st.message;
    EXPECT_NE(st.message.find("argument 'kl_pass'"), std::string::npos) << st.message;
  }
}

// Deterministic mode: two backward calls give the same bits in every gradient.
TEST_P(CudaVsCpu, BackwardIsBitwiseReproducible) {
  SKIP_UNLESS_BUILT(cfg(), true, false);
  HostTensor bi = scrambled_block_idx(p(), cfg().seed + 12);
  BwdCase b = bwd_case(Mode::kSparse, &bi);
  const bool kl = kl_on_gpu(cfg());
  const GpuGrads g1 = gpu_backward(Mode::kSparse, &bi, b, kl, 1.0f, 1.0f, true);
  const GpuGrads g2 = gpu_backward(Mode::kSparse, &bi, b, kl, 1.0f, 1.0f, true);
  expect_same_grads(g1, g2, kl, what(""), "elements that differ between two runs");
}

// The exact KL value: forward with kl on the GPU, and kl_divergence's per-row terms, against the CPU.
TEST_P(CudaVsCpu, KlValue) {
  SKIP_UNLESS_BUILT(cfg(), true, false);
  if (!kl_on_gpu(cfg())) GTEST_SKIP() << "the CUDA KL kernels need Di == D";
  const Config& c = cfg();
  HostTensor bi = scrambled_block_idx(p(), c.seed + 13);
  const FwdResult ref = run_forward(wide(), &bi, Mode::kSparse, true);
  const int64_t T = p().T;
  DeviceTensor dbi = DeviceTensor::upload(bi, s());
  DeviceTensor out = DeviceTensor::poisoned(c.dtype, {T, c.Hq, c.D}, s());
  DeviceTensor lse = DeviceTensor::poisoned(DType::kFloat32, {T, c.Hq}, s());
  DeviceTensor kl = DeviceTensor::poisoned(DType::kFloat32, {1}, s());
  DeviceTensor rows = DeviceTensor::poisoned(DType::kFloat32, {T, c.Hi}, s());
  msa::ForwardParams f;
  f.q = dev_q();
  f.k = dev().k.ref();
  f.v = dev().v.ref();
  if (!GetParam().no_cu_seqlens) f.cu_seqlens = dev().cu.ref();
  f.block_idx = dbi.ref();
  f.q_idx = dev().q_idx.ref();
  f.k_idx = dev().k_idx.ref();
  f.out = out.ref();
  f.lse = lse.ref();
  f.kl = kl.ref();
  f.opts = p().options();
  f.launch.stream = s();
  const size_t ws_bytes = msa::workspace_size(f);
  EXPECT_GT(ws_bytes, 0u);
  DeviceTensor ws(DType::kInt32, {static_cast<int64_t>((ws_bytes + 3) / 4)});
  f.launch.workspace = ws.ref().data;
  f.launch.workspace_bytes = ws_bytes;
  require_ok(msa::forward(f));
  const double got = kl.download(s()).get(0), want = ref.kl.get(0);
  EXPECT_NEAR(got, want, 2e-3 * std::fabs(want) + 1e-6) << what("forward kl");

  msa::KlParams kp;
  kp.q = dev_q();
  kp.k = dev().k.ref();
  kp.lse = lse.ref();
  kp.q_idx = dev().q_idx.ref();
  kp.k_idx = dev().k_idx.ref();
  if (!GetParam().no_cu_seqlens) kp.cu_seqlens = dev().cu.ref();
  kp.block_idx = dbi.ref();
  kp.kl = kl.ref();
  kp.kl_rows = rows.ref();
  kp.opts = p().options();
  kp.launch.stream = s();
  kp.launch.workspace = ws.ref().data;
  kp.launch.workspace_bytes = ws_bytes;
  ASSERT_LE(msa::workspace_size(kp), ws_bytes);
  require_ok(msa::kl_divergence(kp));
  const HostTensor got_rows = rows.download(s());
  // CPU per-row terms on the GPU's lse.
  HostTensor lse_host = lse.download(s());
  HostTensor ref_rows(DType::kFloat32, {T, c.Hi}), ref_kl(DType::kFloat32, {1});
  msa::KlParams cp;
  cp.q = wide().q.ref();
  cp.k = wide().k.ref();
  cp.lse = lse_host.ref();
  cp.q_idx = wide().q_idx.ref();
  cp.k_idx = wide().k_idx.ref();
  cp.cu_seqlens = wide().cu.ref();
  cp.block_idx = bi.ref();
  cp.kl = ref_kl.ref();
  cp.kl_rows = ref_rows.ref();
  cp.opts = p().options();
  require_ok(msa::kl_divergence(cp));
  Failures fr;
  for (int64_t x = 0; x < T * c.Hi; ++x)
    if (!(std::fabs(got_rows.get(x) - ref_rows.get(x)) <= 2e-3 * std::fabs(ref_rows.get(x)) + 1e-5))
      fr.add("row " + std::to_string(x) + ": " + std::to_string(got_rows.get(x)) + " vs " +
             std::to_string(ref_rows.get(x)));
  EXPECT_EQ(fr.count, 0) << what("kl_rows") << fr.first;
}

INSTANTIATE_TEST_SUITE_P(Shapes, CudaVsCpu, ::testing::ValuesIn(kCases),
                         [](const ::testing::TestParamInfo<CudaCase>& info) { return std::string(info.param.name); });

// ---- varlen ---------------------------------------------------------------------------------------

// NaN in one sequence's inputs reaches no other sequence: the other rows keep a valid selection
// and match the CPU; the NaN sequence's rows are still well-formed. Empty and 1-token sequences
// around it.
TEST(Cuda, VarlenNanStaysInItsSequence) {
  SKIP_WITHOUT_CUDA();
  const Config c = shape({700, 0, 557, 1, 390}, 4, 2, 128, 2, 1, 128, 128, 3, kBf16, 21, 1, 1);
  Problem p = random_problem(c);
  const int64_t s0 = p.offsets[2], s1 = p.offsets[3];  // the 557-token sequence
  const auto set_nan = [&](HostTensor& t, int64_t token) { t.set(token * (t.numel() / p.T) + 5, NAN); };
  set_nan(p.q, s0 + 10);
  set_nan(p.k, s0 + 100);
  set_nan(p.v, s0 + 5);
  set_nan(p.q_idx, s0 + 70);
  set_nan(p.k_idx, s0 + 130);
  Stream stream(true);
  DeviceInputs d(p, stream.get());
  DeviceTensor out = DeviceTensor::poisoned(c.dtype, {p.T, c.Hq, c.D}, stream.get());
  DeviceTensor lse = DeviceTensor::poisoned(DType::kFloat32, {p.T, c.Hq}, stream.get());
  DeviceTensor bi = DeviceTensor::poisoned(DType::kInt32, {p.T, c.Hi, c.k}, stream.get());
  msa::ForwardParams f;
  f.q = d.q.ref();
  f.k = d.k.ref();
  f.v = d.v.ref();
  f.cu_seqlens = d.cu.ref();
  f.q_idx = d.q_idx.ref();
  f.k_idx = d.k_idx.ref();
  f.block_idx = bi.ref();
  f.select = true;
  f.out = out.ref();
  f.lse = lse.ref();
  f.opts = p.options();
  f.launch.stream = stream.get();
  require_ok(msa::forward(f));
  HostTensor got_bi = bi.download(stream.get());
  const HostTensor got_out = out.download(stream.get()), got_lse = lse.download(stream.get());

  std::vector<int64_t> clean, dirty;
  for (int64_t g = 0; g < p.T; ++g) (g >= s0 && g < s1 ? dirty : clean).push_back(g);
  const IndexScores sc(p);
  const Failures fc = check_selection(p, sc, got_bi, nullptr, clean);
  EXPECT_EQ(fc.count, 0) << "selection outside the NaN sequence" << fc.first;
  Failures fd;
  for (int64_t g : dirty)
    for (int i = 0; i < c.Hi; ++i) {
      const std::vector<int> row = bi_row(got_bi, g, i);
      const int own = sc.own_block(g);
      if (std::find(row.begin(), row.end(), own) == row.end())
        fd.add("row " + std::to_string(g) + ": own block missing");
      for (int b : row)
        if (b < -1 || b > own) fd.add("row " + std::to_string(g) + ": entry " + std::to_string(b) + " out of range");
    }
  EXPECT_EQ(fd.count, 0) << "selection inside the NaN sequence" << fd.first;

  Problem w = widened(p);
  const FwdResult ref = run_forward(w, &got_bi, Mode::kSparse, false);
  expect_forward_close(got_out, got_lse, ref, c.dtype, [&](int64_t g) { return g < s0 || g >= s1; },
                       "forward outside the NaN sequence " + c.str());
}

// No tokens at all: every call succeeds.
TEST(Cuda, AllSequencesEmpty) {
  SKIP_WITHOUT_CUDA();
  const Config c = shape({0, 0}, 4, 2, 128, 2, 1, 128, 128, 4, kBf16, 22);
  Problem p = random_problem(c);
  DeviceInputs d(p, nullptr);
  DeviceTensor out(c.dtype, {0, c.Hq, c.D}), lse(DType::kFloat32, {0, c.Hq}), bi(DType::kInt32, {0, c.Hi, c.k});
  msa::SelectParams sp;
  sp.q_idx = d.q_idx.ref();
  sp.k_idx = d.k_idx.ref();
  sp.cu_seqlens = d.cu.ref();
  sp.block_idx = bi.ref();
  sp.opts = p.options();
  require_ok(msa::select_blocks(sp));
  for (Mode mode : {Mode::kSparse, Mode::kDense}) {
    msa::ForwardParams f;
    f.q = d.q.ref();
    f.k = d.k.ref();
    f.v = d.v.ref();
    f.cu_seqlens = d.cu.ref();
    f.q_idx = d.q_idx.ref();
    f.k_idx = d.k_idx.ref();
    if (mode == Mode::kSparse) f.block_idx = bi.ref();
    f.select = mode == Mode::kSparse;
    f.out = out.ref();
    f.lse = lse.ref();
    f.opts = p.options(mode);
    require_ok(msa::forward(f));
  }
  CUDA_CHECK(cudaDeviceSynchronize());
}

// ---- keys apart from queries (cu_seqlens_k) ---------------------------------------------------------

// A keys-apart batch: the key side (k, v, k_idx: Tk rows) packs whole sequences of m_s =
// cfg.seqlens[s] keys; the query side (q, q_idx: T rows) holds the last n[s] positions of each,
// query u of sequence s at position m_s - n[s] + u (contract §1).
struct ApartCase {
  const char* name;
  Config cfg;              // seqlens: keys per sequence (m_s)
  std::vector<int64_t> n;  // queries per sequence (n_s <= m_s)
  bool own_stream;         // launch on a non-default stream
  bool no_cu_seqlens;      // one sequence, cu_seqlens absent (cu_seqlens_k then has 2 entries)
};

std::string apart_str(const ApartCase& c) {
  std::ostringstream os;
  os << c.name << " (keys " << c.cfg.str() << "; queries [";
  for (size_t s = 0; s < c.n.size(); ++s) os << (s ? "," : "") << c.n[s];
  os << "]" << (c.own_stream ? ", own stream" : "") << (c.no_cu_seqlens ? ", no cu_seqlens" : "") << ")";
  return os.str();
}

void PrintTo(const ApartCase& c, std::ostream* os) { *os << apart_str(c); }

HostTensor int_offsets(const std::vector<int64_t>& cu) {
  HostTensor t(DType::kInt32, {static_cast<int64_t>(cu.size())});
  for (size_t s = 0; s < cu.size(); ++s) t.set(static_cast<int64_t>(s), static_cast<double>(cu[s]));
  return t;
}

// The query side of a keys-apart call over the whole sequences `p`, whose k, v, k_idx are the
// call's key tensors: q and q_idx are p's rows at the last n[s] positions of every sequence.
struct ApartInputs {
  std::vector<int64_t> n, cu_q;
  std::vector<int64_t> rows;  // p's row of each query
  std::vector<int64_t> pos;   // each query's position in its sequence
  int64_t Tq = 0;
  HostTensor q, q_idx, cuq, cuk;
};

ApartInputs apart_inputs(const Problem& p, const std::vector<int64_t>& n) {
  if (n.size() + 1 != p.offsets.size())
    throw std::runtime_error("a keys-apart case without a query count per sequence");
  ApartInputs a;
  a.n = n;
  a.cu_q.assign(1, 0);
  for (size_t s = 0; s + 1 < p.offsets.size(); ++s) {
    const int64_t m = p.offsets[s + 1] - p.offsets[s];
    if (n[s] > m) throw std::runtime_error("a keys-apart case with more queries than keys");
    for (int64_t u = 0; u < n[s]; ++u) {
      a.rows.push_back(p.offsets[s + 1] - n[s] + u);
      a.pos.push_back(m - n[s] + u);
    }
    a.cu_q.push_back(a.cu_q.back() + n[s]);
  }
  a.Tq = a.cu_q.back();
  a.q = gather_rows(p.q, a.rows);
  a.q_idx = gather_rows(p.q_idx, a.rows);
  a.cuq = int_offsets(a.cu_q);
  a.cuk = int_offsets(p.offsets);
  return a;
}

// A [T, ...] query-side result scattered to the rows of the whole sequences ([Tk, ...]); the
// other rows hold `fill`.
HostTensor to_whole_rows(const HostTensor& got, const ApartInputs& a, int64_t Tk, double fill) {
  std::vector<int64_t> shape = got.shape();
  const int64_t row = got.numel() / std::max<int64_t>(shape[0], 1);
  shape[0] = Tk;
  HostTensor whole(got.dtype(), shape);
  whole.fill(fill);
  for (size_t r = 0; r < a.rows.size(); ++r)
    for (int64_t x = 0; x < row; ++x) whole.set(a.rows[r] * row + x, got.get(static_cast<int64_t>(r) * row + x));
  return whole;
}

// A caller's block_idx [T, Hi, k] for the queries at their positions: every row its own block
// blk(pos) and up to k - 1 distinct random earlier blocks, ascending, then -1 padding. With
// `scramble` the rows are also shuffled (-1 anywhere), a few empty (lse -inf, out 0) and a few
// without their own block, every form a caller may pass (contract §3). `full`: every row holds
// min(k, blk(pos) + 1) blocks (no shorter rows).
HostTensor apart_block_idx(const ApartInputs& a, const Config& c, uint64_t seed, bool scramble, bool full = false) {
  HostTensor bi(DType::kInt32, {a.Tq, c.Hi, c.k});
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<double> u(0, 1);
  for (int64_t r = 0; r < a.Tq; ++r) {
    const int own = static_cast<int>(a.pos[r] / c.Bk);
    for (int i = 0; i < c.Hi; ++i) {
      std::vector<int> earlier(own);
      for (int b = 0; b < own; ++b) earlier[b] = b;
      std::shuffle(earlier.begin(), earlier.end(), rng);
      int take = std::min<int>(c.k - 1, own);
      if (!full && take > 0 && u(rng) < 0.2) take = static_cast<int>(u(rng) * take);  // fewer blocks
      std::vector<int> row(earlier.begin(), earlier.begin() + take);
      row.push_back(own);
      std::sort(row.begin(), row.end());
      row.resize(c.k, -1);
      if (scramble) {
        const double x = u(rng);
        for (int& b : row) {
          if (x < 0.03) b = -1;                     // empty support
          else if (x < 0.10 && b == own) b = -1;    // without its own block
        }
        std::shuffle(row.begin(), row.end(), rng);
      }
      for (int j = 0; j < c.k; ++j) bi.set((r * c.Hi + i) * c.k + j, row[j]);
    }
  }
  return bi;
}

// The CPU backend's keys-apart calls on p's keys and a's queries (the reference; p and a in
// float64 give its double results unrounded).
class ApartCpu {
 public:
  ApartCpu(Problem& p, ApartInputs& a, bool no_cu) : p_(p), a_(a), no_cu_(no_cu) {}

  HostTensor select(const msa::Options& o, HostTensor* lse_idx) {
    const Config& c = p_.cfg;
    HostTensor bi(DType::kInt32, {a_.Tq, c.Hi, o.top_k});
    bi.fill(-7);
    *lse_idx = HostTensor(DType::kFloat32, {a_.Tq, c.Hi});
    lse_idx->fill(NAN);
    msa::SelectParams sp;
    sp.q_idx = a_.q_idx.ref();
    sp.k_idx = p_.k_idx.ref();
    offsets(&sp.cu_seqlens, &sp.cu_seqlens_k);
    sp.block_idx = bi.ref();
    sp.lse_idx = lse_idx->ref();
    sp.opts = o;
    require_ok(msa::select_blocks(sp));
    return bi;
  }

  FwdResult forward(HostTensor* bi, Mode mode, bool with_kl) {
    const Config& c = p_.cfg;
    FwdResult r{HostTensor(c.dtype, {a_.Tq, c.Hq, c.D}), HostTensor(DType::kFloat32, {a_.Tq, c.Hq}),
                HostTensor(DType::kFloat32, {1})};
    for (HostTensor* t : {&r.out, &r.lse, &r.kl}) t->fill(NAN);
    msa::ForwardParams fp;
    fp.q = a_.q.ref();
    fp.k = p_.k.ref();
    fp.v = p_.v.ref();
    offsets(&fp.cu_seqlens, &fp.cu_seqlens_k);
    if (mode == Mode::kSparse) fp.block_idx = bi->ref();
    fp.q_idx = a_.q_idx.ref();
    fp.k_idx = p_.k_idx.ref();
    fp.out = r.out.ref();
    fp.lse = r.lse.ref();
    if (with_kl) fp.kl = r.kl.ref();
    fp.opts = p_.options(mode);
    require_ok(msa::forward(fp));
    return r;
  }

  // dq, dk, dv and the KL gradient (gamma) on out, lse and dout: dk, dv, dk_idx over all Tk rows.
  BwdResult backward(HostTensor* bi, Mode mode, FwdResult& f, HostTensor& dout, double gamma) {
    const Config& c = p_.cfg;
    const int64_t Tk = p_.T;
    BwdResult r{HostTensor(c.dtype, {a_.Tq, c.Hq, c.D}), HostTensor(c.dtype, {Tk, c.Hkv, c.D}),
                HostTensor(c.dtype, {Tk, c.Hkv, c.D}), HostTensor(c.dtype, {a_.Tq, c.Hi, c.Di}),
                HostTensor(c.dtype, {Tk, c.Hik, c.Di})};
    for (HostTensor* t : {&r.dq, &r.dk, &r.dv, &r.dq_idx, &r.dk_idx}) t->fill(NAN);
    msa::BackwardParams bp;
    bp.q = a_.q.ref();
    bp.k = p_.k.ref();
    bp.v = p_.v.ref();
    bp.out = f.out.ref();
    bp.lse = f.lse.ref();
    bp.dout = dout.ref();
    offsets(&bp.cu_seqlens, &bp.cu_seqlens_k);
    if (mode == Mode::kSparse) bp.block_idx = bi->ref();
    bp.dq = r.dq.ref();
    bp.dk = r.dk.ref();
    bp.dv = r.dv.ref();
    bp.q_idx = a_.q_idx.ref();
    bp.k_idx = p_.k_idx.ref();
    bp.dq_idx = r.dq_idx.ref();
    bp.dk_idx = r.dk_idx.ref();
    bp.kl_weight = static_cast<float>(gamma);
    bp.opts = p_.options(mode);
    require_ok(msa::backward(bp));
    return r;
  }

  // kl_divergence's per-row terms (and value into *kl) on `lse`.
  HostTensor kl_rows(HostTensor* bi, Mode mode, HostTensor& lse, HostTensor* kl) {
    const Config& c = p_.cfg;
    HostTensor rows(DType::kFloat32, {a_.Tq, c.Hi});
    rows.fill(NAN);
    *kl = HostTensor(DType::kFloat32, {1});
    kl->fill(NAN);
    msa::KlParams kp;
    kp.q = a_.q.ref();
    kp.k = p_.k.ref();
    kp.lse = lse.ref();
    kp.q_idx = a_.q_idx.ref();
    kp.k_idx = p_.k_idx.ref();
    offsets(&kp.cu_seqlens, &kp.cu_seqlens_k);
    if (mode == Mode::kSparse) kp.block_idx = bi->ref();
    kp.kl = kl->ref();
    kp.kl_rows = rows.ref();
    kp.opts = p_.options(mode);
    require_ok(msa::kl_divergence(kp));
    return rows;
  }

 private:
  void offsets(msa::TensorRef* cu, msa::TensorRef* cu_k) {
    if (!no_cu_) *cu = a_.cuq.ref();
    *cu_k = a_.cuk.ref();
  }
  Problem& p_;
  ApartInputs& a_;
  bool no_cu_;
};

// Key lengths m_s (the case's seqlens) and query counts n_s. Keys of a sequence start in the
// packed key tensor at offsets that are not multiples of Bk (after 77, 129, 1500, ... keys);
// sequences with m_s = n_s, with m_s > n_s and m_s not a multiple of Bk, with one query, with no
// query but keys (their dk, dv, dk_idx must be zero), empty ones; first queries mid-block and
// on a block edge; Tk up to 16x T. Heads as in CudaVsCpu: Gi = Hq / Hi of 2, 3 (the separate KL
// pass, no dq from dS), 4, 8 and 16; Hik = 1 and 2; D = Di = 64 and 128; Bk 64 and 128.
const ApartCase kApartCases[] = {
    // name, shape(key seqlens, Hq, Hkv, D, Hi, Hik, Di, Bk, k, dtype, seed[, sink, local]), queries per
    // sequence, own stream, no cu_seqlens
    {"OneSeq_n200_m900_Bk128", shape({900}, 8, 2, 128, 2, 1, 128, 128, 4, kBf16, 51), {200}, false, false},
    {"OneSeq_NoCuSeqlens_n300_m3000_Bk64_fp16", shape({3000}, 8, 2, 64, 4, 2, 64, 64, 6, kFp16, 52, 1, 2), {300},
     true, true},
    {"Mixed_G2_Bk64_fp16", shape({77, 300, 129, 200, 0, 640, 1000}, 8, 2, 64, 4, 2, 64, 64, 6, kFp16, 53, 1, 2),
     {77, 45, 1, 0, 0, 128, 333}, true, false},
    {"Mixed_LongKeys_G8_Bk128", shape({129, 1500, 0, 260, 300, 4224}, 16, 2, 128, 2, 1, 128, 128, 5, kBf16, 54, 1, 2),
     {129, 1, 0, 0, 200, 64}, false, false},
    {"Mixed_G3_Hi4_Bk64_fp16", shape({650, 131, 90}, 12, 2, 64, 4, 2, 64, 64, 6, kFp16, 55), {100, 131, 0}, true,
     false},
    {"Paper_G16_Hi4_Bk128", shape({2000, 0, 700}, 64, 4, 128, 4, 1, 128, 128, 6, kBf16, 56, 1, 2), {513, 0, 1}, false,
     false},
    // Every sequence's keys are its queries (cu_seqlens_k holds cu_seqlens's values).
    {"KeysAreQueries_G4_Bk128", shape({799, 0, 113, 1}, 8, 2, 128, 2, 1, 128, 128, 4, kBf16, 57), {799, 0, 113, 1},
     true, false},
    // One query alone in each of four sequences, all 16 blocks of its keys selected (full rows):
    // every selection is a record of its own, so the records (4 x Hi 4 x k 16 = 256) fill the
    // teacher route's one pass to its end, and the keys of the last sequence, without queries,
    // lie past it; their dk, dv must still be written (zeros).
    {"LoneQueries_TrailingKeys_G2_Bk128", shape({2048, 2048, 2048, 2048, 64}, 8, 2, 128, 4, 1, 128, 128, 16, kBf16, 58),
     {1, 1, 1, 1, 0}, false, false},
};

class CudaKeysApart : public ::testing::TestWithParam<ApartCase> {
 protected:
  void SetUp() override {
    SKIP_WITHOUT_CUDA();
    const ApartCase& c = GetParam();
    stream_ = std::make_unique<Stream>(c.own_stream);
    p_ = std::make_unique<Problem>(random_problem(c.cfg));
    a_ = std::make_unique<ApartInputs>(apart_inputs(*p_, c.n));
    q_ = DeviceTensor::upload(a_->q, s());
    k_ = DeviceTensor::upload(p_->k, s());
    v_ = DeviceTensor::upload(p_->v, s());
    q_idx_ = DeviceTensor::upload(a_->q_idx, s());
    k_idx_ = DeviceTensor::upload(p_->k_idx, s());
    cuq_ = DeviceTensor::upload(a_->cuq, s());
    cuk_ = DeviceTensor::upload(a_->cuk, s());
  }

  cudaStream_t s() const { return stream_->get(); }
  const Config& cfg() const { return GetParam().cfg; }
  Problem& p() { return *p_; }  // the whole sequences (16-bit)
  ApartInputs& a() { return *a_; }
  int64_t T() const { return a_->Tq; }
  int64_t Tk() const { return p_->T; }
  std::string what(const std::string& test) const { return test + " " + apart_str(GetParam()); }

  // The CPU reference over float64 copies of the same values (built on first use).
  ApartCpu& cpu() {
    if (!cpu_) {
      wide_ = std::make_unique<Problem>(widened(*p_));
      wide_a_ = std::make_unique<ApartInputs>(apart_inputs(*wide_, GetParam().n));
      cpu_ = std::make_unique<ApartCpu>(*wide_, *wide_a_, GetParam().no_cu_seqlens);
    }
    return *cpu_;
  }

  void offsets(msa::TensorRef* cu, msa::TensorRef* cu_k) const {
    if (!GetParam().no_cu_seqlens) *cu = cuq_.ref();
    *cu_k = cuk_.ref();
  }

  msa::SelectParams select_params(DeviceTensor& bi, DeviceTensor& lse_idx, const msa::Options& o) const {
    msa::SelectParams sp;
    sp.q_idx = q_idx_.ref();
    sp.k_idx = k_idx_.ref();
    offsets(&sp.cu_seqlens, &sp.cu_seqlens_k);
    sp.block_idx = bi.ref();
    sp.lse_idx = lse_idx.ref();
    sp.opts = o;
    sp.launch.stream = s();
    return sp;
  }

  struct GpuForward {
    HostTensor out, lse, block_idx, kl;
  };

  // forward on the GPU into poisoned outputs: over `given` (kSparse, select off), over its own
  // selection (`select`), or dense (kDense); the KL value too with `kl`.
  GpuForward gpu_forward(Mode mode, HostTensor* given, bool select, msa::FwdPass pass = msa::FwdPass::kAuto,
                         int32_t chunk = 0, bool kl = false) {
    const Config& c = cfg();
    DeviceTensor out = DeviceTensor::poisoned(c.dtype, {T(), c.Hq, c.D}, s());
    DeviceTensor lse = DeviceTensor::poisoned(DType::kFloat32, {T(), c.Hq}, s());
    DeviceTensor dkl = DeviceTensor::poisoned(DType::kFloat32, {1}, s());
    DeviceTensor bi;
    msa::ForwardParams f;
    f.q = q_.ref();
    f.k = k_.ref();
    f.v = v_.ref();
    offsets(&f.cu_seqlens, &f.cu_seqlens_k);
    if (mode == Mode::kSparse) {
      bi = select ? DeviceTensor::poisoned(DType::kInt32, {T(), c.Hi, c.k}, s()) : DeviceTensor::upload(*given, s());
      f.block_idx = bi.ref();
      f.select = select;
    }
    if (select || kl) {
      f.q_idx = q_idx_.ref();
      f.k_idx = k_idx_.ref();
    }
    f.out = out.ref();
    f.lse = lse.ref();
    if (kl) f.kl = dkl.ref();
    f.opts = p().options(mode);
    f.opts.fwd_pass = pass;
    f.opts.fwd_chunk_tokens = chunk;
    f.launch.stream = s();
    const size_t ws_bytes = msa::workspace_size(f);
    DeviceTensor ws = DeviceTensor::poisoned(DType::kInt32, {static_cast<int64_t>((ws_bytes + 3) / 4)}, s());
    if (ws_bytes > 0) {
      f.launch.workspace = ws.ref().data;
      f.launch.workspace_bytes = ws_bytes;
    }
    require_ok(msa::forward(f));
    GpuForward r{out.download(s()), lse.download(s()), {}, {}};
    if (select) r.block_idx = bi.download(s());
    if (kl) r.kl = dkl.download(s());
    return r;
  }

  // The CPU forward's out and lse and a random dout: the inputs of one backward call.
  BwdCase bwd_case(Mode mode, HostTensor* bi) { return make_bwd_case(cpu().forward(bi, mode, false), cfg(), T()); }

  // backward on the GPU (gpu_backward_call) over the queries and the keys apart (dk, dv, dk_idx:
  // Tk rows).
  GpuGrads gpu_backward(Mode mode, HostTensor* bi, const BwdCase& b, bool kl, float kl_weight, float kl_grad,
                        msa::DqPass dq_pass = msa::DqPass::kAuto, msa::KlPass kl_pass = msa::KlPass::kAuto,
                        int32_t bwd_chunk = 0, int64_t teacher_bytes = 0, bool deterministic = false,
                        msa::Status* status = nullptr, int64_t dq_rows_bytes = 0) {
    DeviceCall in{q_.ref(), k_.ref(), v_.ref(), q_idx_.ref(), k_idx_.ref(), {}, {}, T(), Tk()};
    offsets(&in.cu, &in.cu_k);
    const BwdRun run{deterministic, kl_pass, teacher_bytes, dq_pass, bwd_chunk, dq_rows_bytes};
    return gpu_backward_call(in, cfg(), p().options(mode), mode, bi, b, kl, kl_weight, kl_grad, run, s(), status);
  }

  // A KL weight of `per_row` per query row (gamma / (N * Hi) does not shrink with N): the KL
  // gradient then stays in float16's normal range over thousands of keys.
  float kl_weight(double per_row) const {
    return static_cast<float>(per_row * static_cast<double>(std::max<int64_t>(T(), 1)));
  }

  // The GPU's gradients against the reference (the KL gradient's when `kl`), and every key
  // gradient row of a sequence without queries exactly zero.
  void expect_grads(const GpuGrads& g, const BwdResult& ref, bool kl, const std::string& name) {
    const DType dt = cfg().dtype;
    expect_grad_close(g.dq, ref.dq, dt, what(name + " dq"));
    expect_grad_close(g.dk, ref.dk, dt, what(name + " dk"));
    expect_grad_close(g.dv, ref.dv, dt, what(name + " dv"));
    if (kl) {
      expect_grad_close(g.dq_idx, ref.dq_idx, dt, what(name + " dq_idx"), kl_grad_tolerance(dt));
      expect_grad_close(g.dk_idx, ref.dk_idx, dt, what(name + " dk_idx"), kl_grad_tolerance(dt));
    }
    Failures f;
    const std::vector<int64_t>& cuk = p().offsets;
    for (size_t sq = 0; sq + 1 < cuk.size(); ++sq) {
      if (a().n[sq] != 0) continue;
      const std::pair<const HostTensor*, const char*> keyside[] = {{&g.dk, "dk"}, {&g.dv, "dv"}, {&g.dk_idx, "dk_idx"}};
      for (auto [t, tname] : keyside) {
        if (!kl && t == &g.dk_idx) continue;
        const int64_t row = t->numel() / Tk();
        for (int64_t x = cuk[sq] * row; x < cuk[sq + 1] * row; ++x)
          if (!(t->get(x) == 0.0))
            f.add(std::string(tname) + "[key row " + std::to_string(x / row) + "] of sequence " + std::to_string(sq) +
                  " (no queries) = " + std::to_string(t->get(x)) + ", expected 0");
      }
    }
    EXPECT_EQ(f.count, 0) << what(name + ": key gradients of sequences without queries") << f.first;
  }

 private:
  std::unique_ptr<Stream> stream_;
  std::unique_ptr<Problem> p_, wide_;
  std::unique_ptr<ApartInputs> a_, wide_a_;
  std::unique_ptr<ApartCpu> cpu_;
  DeviceTensor q_, k_, v_, q_idx_, k_idx_, cuq_, cuk_;

 protected:
  DeviceTensor& dev_q() { return q_; }
  DeviceTensor& dev_k() { return k_; }
  DeviceTensor& dev_q_idx() { return q_idx_; }
  DeviceTensor& dev_k_idx() { return k_idx_; }
};

// The selection rule of contract §2 at each query's position (scores over the whole sequences'
// keys), lse_idx over the returned support, and nearly every row the CPU backend's keys-apart
// selection (rows may differ only where two blocks score within fp32 rounding of each other).
Failures check_apart_selection(const Problem& p, const ApartInputs& a, const HostTensor& bi, const HostTensor* lse_idx,
                               const HostTensor& cpu_bi, double* same_rows) {
  const HostTensor whole_bi = to_whole_rows(bi, a, p.T, -1);
  HostTensor whole_lse;
  if (lse_idx != nullptr) whole_lse = to_whole_rows(*lse_idx, a, p.T, NAN);
  const Failures f = check_selection(p, IndexScores(p), whole_bi, lse_idx != nullptr ? &whole_lse : nullptr, a.rows);
  const int64_t k = bi.shape()[2], rows = bi.numel() / std::max<int64_t>(k, 1);
  int64_t same = 0;
  for (int64_t r = 0; r < rows; ++r) {
    bool eq = true;
    for (int64_t j = 0; j < k; ++j) eq = eq && bi.get(r * k + j) == cpu_bi.get(r * k + j);
    same += eq;
  }
  *same_rows = rows > 0 ? static_cast<double>(same) / static_cast<double>(rows) : 1.0;
  return f;
}

// Rows of (token, index head) whose selection must equal the CPU backend's.
constexpr double kSameSelectionRows = 0.99;

// select_blocks with cu_seqlens_k, with sink and local blocks and without: the contract's format
// and rule at every query's position, lse_idx, and the CPU backend's selection on nearly every
// row; a second call gives the same bits.
TEST_P(CudaKeysApart, SelectBlocks) {
  SKIP_UNLESS_BUILT(cfg(), false, true);
  const Config& c = cfg();
  for (auto [sink, local] : {std::pair<int, int>{0, 1}, std::pair<int, int>{1, 2}}) {
    Problem rule = p();  // the rule of these options
    rule.cfg.sink = sink;
    rule.cfg.local = local;
    const msa::Options o = rule.options();
    const std::string name = "select_blocks, sink " + std::to_string(sink) + ", local " + std::to_string(local);
    DeviceTensor bi = DeviceTensor::poisoned(DType::kInt32, {T(), c.Hi, c.k}, s());
    DeviceTensor lse_idx = DeviceTensor::poisoned(DType::kFloat32, {T(), c.Hi}, s());
    msa::SelectParams sp = select_params(bi, lse_idx, o);
    bool with_lse = false;
    require_ok(select_with_lse_idx(sp, &with_lse));
    const HostTensor got = bi.download(s()), got_lse = lse_idx.download(s());
    HostTensor cpu_lse;
    const HostTensor cpu_bi = cpu().select(o, &cpu_lse);
    double same = 0;
    const Failures f = check_apart_selection(rule, a(), got, with_lse ? &got_lse : nullptr, cpu_bi, &same);
    EXPECT_EQ(f.count, 0) << what(name) << f.first;
    EXPECT_GE(same, kSameSelectionRows) << what(name) << ": rows equal to the CPU backend's selection";
    DeviceTensor bi2 = DeviceTensor::poisoned(DType::kInt32, {T(), c.Hi, c.k}, s());
    sp.block_idx = bi2.ref();
    sp.lse_idx = {};
    require_ok(msa::select_blocks(sp));
    EXPECT_EQ(differing(got, bi2.download(s())), 0) << what(name) << ": a second call differs";
  }
}

// forward with select = true and cu_seqlens_k: the selection select_blocks returns, by the
// contract's rule at the queries' positions, then out and lse against the CPU backend over it.
TEST_P(CudaKeysApart, ForwardWithSelect) {
  SKIP_UNLESS_BUILT(cfg(), true, true);
  const Config& c = cfg();
  GpuForward g = gpu_forward(Mode::kSparse, nullptr, true);
  DeviceTensor bi = DeviceTensor::poisoned(DType::kInt32, {T(), c.Hi, c.k}, s());
  DeviceTensor lse_idx = DeviceTensor::poisoned(DType::kFloat32, {T(), c.Hi}, s());
  msa::SelectParams sp = select_params(bi, lse_idx, p().options());
  sp.lse_idx = {};
  require_ok(msa::select_blocks(sp));
  EXPECT_EQ(differing(g.block_idx, bi.download(s())), 0) << what("forward (select = true) and select_blocks differ");
  HostTensor cpu_lse;
  const HostTensor cpu_bi = cpu().select(p().options(), &cpu_lse);
  double same = 0;
  const Failures f = check_apart_selection(p(), a(), g.block_idx, nullptr, cpu_bi, &same);
  ASSERT_EQ(f.count, 0) << what("forward, select = true") << f.first;
  EXPECT_GE(same, kSameSelectionRows) << what("forward, select = true") << ": rows equal to the CPU's selection";
  const FwdResult ref = cpu().forward(&g.block_idx, Mode::kSparse, false);
  expect_forward_close(g.out, g.lse, ref, c.dtype, what("forward, select = true"));
}

// The sparse forward over a caller's block_idx at the queries' positions, by every
// Options.fwd_pass (kKvBlock and kSplit also in passes of 97 tokens), against the CPU backend:
// rows in every legal form (ascending or not, -1 anywhere, empty, without the own block), and
// plain ones (the own block and earlier blocks, ascending, -1 padding).
TEST_P(CudaKeysApart, SparseForwardEachPass) {
  SKIP_UNLESS_BUILT(cfg(), true, false);
  const std::pair<msa::FwdPass, const char*> passes[] = {{msa::FwdPass::kAuto, "kAuto"},
                                                         {msa::FwdPass::kQueryTile, "kQueryTile"},
                                                         {msa::FwdPass::kKvBlock, "kKvBlock"},
                                                         {msa::FwdPass::kSplit, "kSplit"}};
  for (const bool scramble : {true, false}) {
    HostTensor bi = apart_block_idx(a(), cfg(), cfg().seed + (scramble ? 13 : 17), scramble);
    const FwdResult ref = cpu().forward(&bi, Mode::kSparse, false);
    for (auto [pass, pname] : passes) {
      const bool kv = pass == msa::FwdPass::kKvBlock || pass == msa::FwdPass::kSplit;
      for (const int32_t chunk : {0, 97}) {
        if (chunk != 0 && !kv) continue;
        const GpuForward g = gpu_forward(Mode::kSparse, &bi, false, pass, chunk);
        expect_forward_close(g.out, g.lse, ref, cfg().dtype,
                             what(std::string("forward, ") + pname + ", pass tokens " + std::to_string(chunk) +
                                  (scramble ? ", scrambled block_idx" : ", plain block_idx")));
      }
    }
  }
}

// The warmup forward (kDense) over keys apart: dense causal attention aligned to the bottom right.
TEST_P(CudaKeysApart, DenseForward) {
  SKIP_UNLESS_BUILT(cfg(), true, false);
  const GpuForward g = gpu_forward(Mode::kDense, nullptr, false);
  const FwdResult ref = cpu().forward(nullptr, Mode::kDense, false);
  expect_forward_close(g.out, g.lse, ref, cfg().dtype, what("forward, kDense"));
}

// The sparse backward over keys apart (gamma = 0.5 T * 1.5) against the CPU backend on the same out,
// lse and dout, by each dq_pass and kl_pass the CUDA backend runs: the defaults; query-tile dq
// with the KL gradient by kAuto, kSeparate, kFused and kTeacher (also in passes of one chunk, and
// with dq_idx by per-block rows instead of fixed-point sums); dq from dS (kFromDs, with kAuto and
// kTeacher, in one pass and in passes of 97 tokens, with dq_idx's sums or its rows). Where
// Hq / Hi is not a power of two, kFused and kTeacher are refused naming 'kl_pass' and kFromDs
// naming 'dq_pass'. Deterministic calls give the same bits twice.
TEST_P(CudaKeysApart, SparseBackwardEachPass) {
  SKIP_UNLESS_BUILT(cfg(), true, false);
  const Config& c = cfg();
  const int gi = c.Hq / c.Hi;
  const bool pow2 = (gi & (gi - 1)) == 0;
  const bool from_ds = gi >= 2 && gi <= 64 && pow2 && c.k <= 32;
  const bool kl = kl_on_gpu(c);
  HostTensor bi = apart_block_idx(a(), c, c.seed + 14, true);
  BwdCase b = bwd_case(Mode::kSparse, &bi);
  const float klw = kl_weight(0.5);
  const BwdResult ref = cpu().backward(&bi, Mode::kSparse, b.fwd, b.dout_w, 1.5 * klw);
  using msa::DqPass;
  using msa::KlPass;
  struct Run {
    DqPass dq;
    KlPass klp;
    int32_t chunk;
    int64_t teacher_bytes;
    const char* name;
    bool runs;
    int64_t dq_rows_bytes = 0;
  };
  const Run runs[] = {
      {DqPass::kAuto, KlPass::kAuto, 0, 0, "dq kAuto, kl kAuto:", true},
      {DqPass::kQueryTile, KlPass::kAuto, 0, 0, "dq kQueryTile, kl kAuto:", true},
      {DqPass::kQueryTile, KlPass::kSeparate, 0, 0, "dq kQueryTile, kl kSeparate:", kl},
      {DqPass::kQueryTile, KlPass::kFused, 0, 0, "dq kQueryTile, kl kFused:", kl && pow2},
      {DqPass::kQueryTile, KlPass::kTeacher, 0, 0, "dq kQueryTile, kl kTeacher:", kl && pow2},
      {DqPass::kQueryTile, KlPass::kTeacher, 0, 1, "dq kQueryTile, kl kTeacher in passes of one chunk:", kl && pow2},
      {DqPass::kQueryTile, KlPass::kTeacher, 0, 1, "dq kQueryTile, kl kTeacher in passes of one chunk, dq_idx rows:",
       kl && pow2, int64_t(1) << 40},
      {DqPass::kFromDs, KlPass::kAuto, 0, 0, "dq kFromDs, kl kAuto:", from_ds},
      {DqPass::kFromDs, KlPass::kTeacher, 0, 0, "dq kFromDs, kl kTeacher:", from_ds && kl},
      {DqPass::kFromDs, KlPass::kAuto, 97, 0, "dq kFromDs in passes of 97 tokens:", from_ds},
      {DqPass::kFromDs, KlPass::kAuto, 97, 0, "dq kFromDs in passes of 97 tokens, dq_idx rows:", from_ds && kl,
       int64_t(1) << 40},
  };
  for (const Run& r : runs) {
    if (!r.runs) continue;
    const GpuGrads g = gpu_backward(Mode::kSparse, &bi, b, kl, klw, 1.5f, r.dq, r.klp, r.chunk, r.teacher_bytes,
                                    false, nullptr, r.dq_rows_bytes);
    expect_grads(g, ref, kl, r.name);
  }
  if (!pow2 && kl) {
    for (const KlPass klp : {KlPass::kFused, KlPass::kTeacher}) {
      msa::Status st;
      gpu_backward(Mode::kSparse, &bi, b, true, klw, 1.5f, DqPass::kQueryTile, klp, 0, 0, false, &st);
      EXPECT_EQ(st.code, StatusCode::kNotSupported) << what("kl_pass with Hq / Hi not a power of two") << st.message;
      EXPECT_NE(st.message.find("argument 'kl_pass'"), std::string::npos) << st.message;
    }
  }
  if (!from_ds) {
    msa::Status st;
    gpu_backward(Mode::kSparse, &bi, b, kl, klw, 1.5f, DqPass::kFromDs, KlPass::kAuto, 0, 0, false, &st);
    EXPECT_EQ(st.code, StatusCode::kNotSupported) << what("kFromDs where it cannot run") << st.message;
    EXPECT_NE(st.message.find("argument 'dq_pass'"), std::string::npos) << st.message;
  }
  {
    // Full rows (no shorter ones): where the queries' sequences hold one query each, the
    // records fill the teacher route's passes to their end (LoneQueries_TrailingKeys).
    HostTensor full = apart_block_idx(a(), c, c.seed + 16, false, true);
    BwdCase bf = bwd_case(Mode::kSparse, &full);
    const BwdResult ref_full = cpu().backward(&full, Mode::kSparse, bf.fwd, bf.dout_w, 1.5 * klw);
    for (const DqPass dq : {DqPass::kQueryTile, DqPass::kAuto}) {
      const GpuGrads g = gpu_backward(Mode::kSparse, &full, bf, kl, klw, 1.5f, dq, KlPass::kAuto, 0, 0);
      expect_grads(g, ref_full, kl, dq == DqPass::kAuto ? "full rows, dq kAuto:" : "full rows, dq kQueryTile:");
    }
  }
  const GpuGrads d1 = gpu_backward(Mode::kSparse, &bi, b, kl, klw, 1.5f, DqPass::kAuto, KlPass::kAuto, 0, 0, true);
  const GpuGrads d2 = gpu_backward(Mode::kSparse, &bi, b, kl, klw, 1.5f, DqPass::kAuto, KlPass::kAuto, 0, 0, true);
  expect_grads(d1, ref, kl, "deterministic:");
  expect_same_grads(d1, d2, kl, what(""), "two deterministic calls differ");
}

// The warmup backward (kDense) over keys apart, the KL over the full causal support (gamma =
// 2 T * 1), by kl_pass kAuto and kSeparate; kTeacher (sparse mode only) refused naming 'kl_pass'.
TEST_P(CudaKeysApart, DenseBackward) {
  SKIP_UNLESS_BUILT(cfg(), true, false);
  BwdCase b = bwd_case(Mode::kDense, nullptr);
  const bool kl = kl_on_gpu(cfg());
  const float klw = kl_weight(2.0);
  const BwdResult ref = cpu().backward(nullptr, Mode::kDense, b.fwd, b.dout_w, klw);
  const GpuGrads g = gpu_backward(Mode::kDense, nullptr, b, kl, klw, 1.0f);
  expect_grads(g, ref, kl, "dense backward, kl kAuto:");
  if (kl) {
    const GpuGrads sep = gpu_backward(Mode::kDense, nullptr, b, true, klw, 1.0f, msa::DqPass::kAuto,
                                      msa::KlPass::kSeparate);
    expect_grads(sep, ref, true, "dense backward, kl kSeparate:");
    msa::Status st;
    gpu_backward(Mode::kDense, nullptr, b, true, klw, 1.0f, msa::DqPass::kAuto, msa::KlPass::kTeacher, 0, 0, false,
                 &st);
    EXPECT_EQ(st.code, StatusCode::kNotSupported) << st.message;
    EXPECT_NE(st.message.find("argument 'kl_pass'"), std::string::npos) << st.message;
  }
}

// The exact KL value over keys apart, sparse and dense: the forward's kl against the CPU
// backend's forward; kl_divergence's per-row terms against the CPU backend's on the GPU's lse,
// and its value the forward's.
TEST_P(CudaKeysApart, KlValue) {
  SKIP_UNLESS_BUILT(cfg(), true, false);
  if (!kl_on_gpu(cfg())) GTEST_SKIP() << "the CUDA KL kernels need Di == D";
  const Config& c = cfg();
  HostTensor bi = apart_block_idx(a(), c, c.seed + 15, true);
  for (const Mode mode : {Mode::kSparse, Mode::kDense}) {
    const std::string name = mode == Mode::kSparse ? "sparse" : "dense";
    HostTensor* mbi = mode == Mode::kSparse ? &bi : nullptr;
    const FwdResult ref = cpu().forward(mbi, mode, true);
    GpuForward g = gpu_forward(mode, mbi, false, msa::FwdPass::kAuto, 0, true);
    expect_forward_close(g.out, g.lse, ref, c.dtype, what(name + " forward with kl"));
    const double got = g.kl.get(0), want = ref.kl.get(0);
    EXPECT_NEAR(got, want, 2e-3 * std::fabs(want) + 1e-6) << what(name + " forward kl");
    if (T() > 0) {
      EXPECT_GT(want, 0.0) << what(name + " reference kl");
    }

    DeviceTensor dlse = DeviceTensor::upload(g.lse, s());
    DeviceTensor dbi;
    if (mbi != nullptr) dbi = DeviceTensor::upload(bi, s());
    DeviceTensor kl = DeviceTensor::poisoned(DType::kFloat32, {1}, s());
    DeviceTensor rows = DeviceTensor::poisoned(DType::kFloat32, {T(), c.Hi}, s());
    msa::KlParams kp;
    kp.q = dev_q().ref();
    kp.k = dev_k().ref();
    kp.lse = dlse.ref();
    kp.q_idx = dev_q_idx().ref();
    kp.k_idx = dev_k_idx().ref();
    offsets(&kp.cu_seqlens, &kp.cu_seqlens_k);
    if (mbi != nullptr) kp.block_idx = dbi.ref();
    kp.kl = kl.ref();
    kp.kl_rows = rows.ref();
    kp.opts = p().options(mode);
    kp.launch.stream = s();
    const size_t ws_bytes = msa::workspace_size(kp);
    DeviceTensor ws = DeviceTensor::poisoned(DType::kInt32, {static_cast<int64_t>((ws_bytes + 3) / 4)}, s());
    kp.launch.workspace = ws.ref().data;
    kp.launch.workspace_bytes = ws_bytes;
    require_ok(msa::kl_divergence(kp));
    const HostTensor got_rows = rows.download(s());
    const double got_kl = kl.download(s()).get(0);
    EXPECT_NEAR(got_kl, got, 2e-3 * std::fabs(got) + 1e-6) << what(name + " kl_divergence vs the forward's kl");
    HostTensor lse_host = g.lse, ref_kl;
    const HostTensor ref_rows = cpu().kl_rows(mbi, mode, lse_host, &ref_kl);
    Failures fr;
    for (int64_t x = 0; x < T() * c.Hi; ++x)
      if (!(std::fabs(got_rows.get(x) - ref_rows.get(x)) <= 2e-3 * std::fabs(ref_rows.get(x)) + 1e-5))
        fr.add("row " + std::to_string(x / c.Hi) + ", index head " + std::to_string(x % c.Hi) + ": " +
               std::to_string(got_rows.get(x)) + " vs " + std::to_string(ref_rows.get(x)));
    EXPECT_EQ(fr.count, 0) << what(name + " kl_rows") << fr.first;
  }
}

INSTANTIATE_TEST_SUITE_P(Layouts, CudaKeysApart, ::testing::ValuesIn(kApartCases),
                         [](const ::testing::TestParamInfo<ApartCase>& c) { return std::string(c.param.name); });

// Bad cu_seqlens_k on CUDA tensors: a shape other than cu_seqlens's is refused on the host; bad
// values (not starting at 0, decreasing, not ending at Tk, a sequence with fewer keys than
// queries) by the value check (Launch::check_values), with the CPU backend's message for the
// same values, naming 'cu_seqlens_k'; the refused calls write nothing. A caller's block_idx is
// checked at the queries' positions, not their rows. Key tensors (and key gradients) of another
// row count than Tk are refused naming them. With the checks off, bad offsets give no error and
// no fault.
TEST(CudaKeysApartValidation, BadKeyOffsetsNameTheArgument) {
  SKIP_WITHOUT_CUDA();
  // Keys 300, 160, 200; queries 100 (positions 200..299), 160 (all), 0: Tk = 660, T = 260.
  const Config c = shape({300, 160, 200}, 4, 2, 128, 2, 1, 128, 128, 2, kBf16, 61);
  if (!kernels_built(c, true, true)) GTEST_SKIP() << "kernel variant not built into this library";
  Problem p = random_problem(c);
  ApartInputs a = apart_inputs(p, {100, 160, 0});
  const int64_t T = a.Tq, Tk = p.T;
  HostTensor bi = apart_block_idx(a, c, 7, false);
  // Row 0 (position 200, own block 1) lists blocks 0 and 1, a row check (own block 0) would refuse;
  // row 100 (sequence 1's first query, position 0) lists block 0 only.
  for (int j = 0; j < c.k; ++j) {
    bi.set((0 * c.Hi + 0) * c.k + j, j < 2 ? j : -1);
    bi.set((100 * c.Hi + 0) * c.k + j, j == 0 ? 0 : -1);
  }
  DeviceTensor q = DeviceTensor::upload(a.q, nullptr), k = DeviceTensor::upload(p.k, nullptr),
               v = DeviceTensor::upload(p.v, nullptr), q_idx = DeviceTensor::upload(a.q_idx, nullptr),
               k_idx = DeviceTensor::upload(p.k_idx, nullptr), cuq = DeviceTensor::upload(a.cuq, nullptr),
               cuk = DeviceTensor::upload(a.cuk, nullptr), dbi = DeviceTensor::upload(bi, nullptr);
  DeviceTensor lse = DeviceTensor::poisoned(DType::kFloat32, {T, c.Hq}, nullptr);
  DeviceTensor dout = DeviceTensor::poisoned(c.dtype, {T, c.Hq, c.D}, nullptr);
  DeviceTensor dq = DeviceTensor::poisoned(c.dtype, {T, c.Hq, c.D}, nullptr);
  DeviceTensor dk = DeviceTensor::poisoned(c.dtype, {Tk, c.Hkv, c.D}, nullptr);
  DeviceTensor dv = DeviceTensor::poisoned(c.dtype, {Tk, c.Hkv, c.D}, nullptr);
  DeviceTensor sel = DeviceTensor::poisoned(DType::kInt32, {T, c.Hi, c.k}, nullptr);
  CUDA_CHECK(cudaDeviceSynchronize());
  const auto forward_params = [&](DeviceTensor& out) {
    msa::ForwardParams f;
    f.q = q.ref();
    f.k = k.ref();
    f.v = v.ref();
    f.cu_seqlens = cuq.ref();
    f.cu_seqlens_k = cuk.ref();
    f.block_idx = dbi.ref();
    f.out = out.ref();
    f.lse = lse.ref();
    f.opts = p.options();
    return f;
  };
  const auto backward_params = [&](DeviceTensor& out) {
    msa::BackwardParams b;
    b.q = q.ref();
    b.k = k.ref();
    b.v = v.ref();
    b.out = out.ref();
    b.lse = lse.ref();
    b.dout = dout.ref();
    b.cu_seqlens = cuq.ref();
    b.cu_seqlens_k = cuk.ref();
    b.block_idx = dbi.ref();
    b.dq = dq.ref();
    b.dk = dk.ref();
    b.dv = dv.ref();
    b.opts = p.options();
    return b;
  };
  const auto select_params = [&]() {
    msa::SelectParams sp;
    sp.q_idx = q_idx.ref();
    sp.k_idx = k_idx.ref();
    sp.cu_seqlens = cuq.ref();
    sp.cu_seqlens_k = cuk.ref();
    sp.block_idx = sel.ref();
    sp.opts = p.options();
    return sp;
  };
  // The CPU backend's message for a forward with these key offsets (or block_idx) on host copies,
  // from "argument '" on: the device's must hold the same text.
  const auto cpu_message = [&](const HostTensor* cu_k, const HostTensor* host_bi) {
    HostTensor out_h(c.dtype, {T, c.Hq, c.D}), lse_h(DType::kFloat32, {T, c.Hq});
    HostTensor cuk_h = cu_k != nullptr ? *cu_k : a.cuk, bi_h = host_bi != nullptr ? *host_bi : bi;
    msa::ForwardParams f;
    f.q = a.q.ref();
    f.k = p.k.ref();
    f.v = p.v.ref();
    f.cu_seqlens = a.cuq.ref();
    f.cu_seqlens_k = cuk_h.ref();
    f.block_idx = bi_h.ref();
    f.out = out_h.ref();
    f.lse = lse_h.ref();
    f.opts = p.options();
    const msa::Status st = msa::forward(f);
    EXPECT_EQ(st.code, StatusCode::kInvalidArgument) << "CPU: " << st.message;
    const size_t at = st.message.find("argument '");
    return at == std::string::npos ? std::string("argument '") : st.message.substr(at);
  };
  const auto refused = [](const msa::Status& st, const std::string& needle, const std::string& what) {
    EXPECT_EQ(st.code, StatusCode::kInvalidArgument) << what << ": " << st.message;
    EXPECT_NE(st.message.find(needle), std::string::npos)
        << what << ": message lacks \"" << needle << "\": " << st.message;
  };
  // Still the poison pattern: NaN for floats, 0x7f7f7f7f for int32.
  const auto untouched = [](const DeviceTensor& t, const std::string& what) {
    const HostTensor h = t.download(nullptr);
    for (int64_t x = 0; x < h.numel(); ++x)
      if (!(h.dtype() == DType::kInt32 ? h.get(x) == 2139062143.0 : std::isnan(h.get(x)))) {
        ADD_FAILURE() << what << ": a refused call wrote its output (element " << x << ")";
        return;
      }
  };

  // The shape: one entry fewer than cu_seqlens (checked on the host).
  {
    HostTensor h = int_offsets({0, 300, 460});
    DeviceTensor bad = DeviceTensor::upload(h, nullptr);
    DeviceTensor out = DeviceTensor::poisoned(c.dtype, {T, c.Hq, c.D}, nullptr);
    CUDA_CHECK(cudaDeviceSynchronize());
    msa::ForwardParams f = forward_params(out);
    f.cu_seqlens_k = bad.ref();
    refused(msa::forward(f), "argument 'cu_seqlens_k'", "forward, cu_seqlens_k of 3 entries");
    EXPECT_EQ(msa::workspace_size(f), 0u);
    msa::SelectParams sp = select_params();
    sp.cu_seqlens_k = bad.ref();
    refused(msa::select_blocks(sp), "argument 'cu_seqlens_k'", "select_blocks, cu_seqlens_k of 3 entries");
    untouched(out, "forward, cu_seqlens_k of 3 entries");
  }
  // The values, on the device.
  const std::pair<std::vector<int64_t>, const char*> values[] = {
      {{5, 300, 460, 660}, "not starting at 0"},
      {{0, 300, 200, 660}, "decreasing"},
      {{0, 300, 460, 659}, "ending before Tk"},
      {{0, 300, 460, 661}, "ending after Tk"},
      {{0, 400, 459, 660}, "sequence 1 with 59 keys for its 160 queries"},
  };
  for (const auto& [cu, why] : values) {
    HostTensor h = int_offsets(cu);
    const std::string needle = cpu_message(&h, nullptr);
    EXPECT_NE(needle.find("argument 'cu_seqlens_k'"), std::string::npos) << why << ": CPU message " << needle;
    DeviceTensor bad = DeviceTensor::upload(h, nullptr);
    DeviceTensor out = DeviceTensor::poisoned(c.dtype, {T, c.Hq, c.D}, nullptr);
    CUDA_CHECK(cudaDeviceSynchronize());
    msa::ForwardParams f = forward_params(out);
    f.cu_seqlens_k = bad.ref();
    refused(msa::forward(f), needle, std::string("forward, ") + why);
    untouched(out, std::string("forward, ") + why);
    msa::SelectParams sp = select_params();
    sp.cu_seqlens_k = bad.ref();
    refused(msa::select_blocks(sp), needle, std::string("select_blocks, ") + why);
    untouched(sel, std::string("select_blocks, ") + why);
    msa::BackwardParams b = backward_params(out);
    b.cu_seqlens_k = bad.ref();
    const size_t need = msa::workspace_size(b);
    DeviceTensor ws(DType::kInt32, {static_cast<int64_t>((need + 3) / 4)});
    b.launch.workspace = ws.ref().data;
    b.launch.workspace_bytes = need;
    refused(msa::backward(b), needle, std::string("backward, ") + why);
    untouched(dq, std::string("backward, ") + why);
    untouched(dk, std::string("backward, ") + why);
  }
  // block_idx by position: row 0 may list block 1 (the valid call below), block 2 is after its
  // position; row 100 may list block 0 only.
  {
    DeviceTensor out = DeviceTensor::poisoned(c.dtype, {T, c.Hq, c.D}, nullptr);
    CUDA_CHECK(cudaDeviceSynchronize());
    for (const auto& [row, value] : {std::pair<int64_t, int32_t>{0, 2}, std::pair<int64_t, int32_t>{100, 1}}) {
      HostTensor h = bi;
      h.set((row * c.Hi + 0) * c.k + 1, value);
      const std::string needle = cpu_message(nullptr, &h);
      EXPECT_NE(needle.find("argument 'block_idx'"), std::string::npos) << "CPU message " << needle;
      DeviceTensor bad = DeviceTensor::upload(h, nullptr);
      CUDA_CHECK(cudaDeviceSynchronize());
      msa::ForwardParams f = forward_params(out);
      f.block_idx = bad.ref();
      refused(msa::forward(f), needle, "forward, block_idx entry after the query's position");
      untouched(out, "forward, block_idx entry after the query's position");
    }
    require_ok(msa::forward(forward_params(out)));  // the valid selection runs
    CUDA_CHECK(cudaDeviceSynchronize());
  }
  // Key tensors and key gradients with T rows instead of Tk (checked on the host).
  {
    DeviceTensor out = DeviceTensor::poisoned(c.dtype, {T, c.Hq, c.D}, nullptr);
    DeviceTensor short_v = DeviceTensor::poisoned(c.dtype, {Tk - 1, c.Hkv, c.D}, nullptr);
    DeviceTensor short_dk = DeviceTensor::poisoned(c.dtype, {T, c.Hkv, c.D}, nullptr);
    CUDA_CHECK(cudaDeviceSynchronize());
    msa::ForwardParams f = forward_params(out);
    f.v = short_v.ref();
    refused(msa::forward(f), "argument 'v'", "forward, v of Tk - 1 rows");
    msa::BackwardParams b = backward_params(out);
    b.dk = short_dk.ref();
    refused(msa::backward(b), "argument 'dk'", "backward, dk of T rows");
  }
  // Checks off: offsets past Tk are the caller's to avoid; the calls neither fail nor fault.
  {
    HostTensor h = int_offsets({0, 300, 460, 2000});
    DeviceTensor bad = DeviceTensor::upload(h, nullptr);
    DeviceTensor out = DeviceTensor::poisoned(c.dtype, {T, c.Hq, c.D}, nullptr);
    CUDA_CHECK(cudaDeviceSynchronize());
    msa::ForwardParams f = forward_params(out);
    f.cu_seqlens_k = bad.ref();
    f.launch.check_values = false;
    require_ok(msa::forward(f));
    msa::SelectParams sp = select_params();
    sp.cu_seqlens_k = bad.ref();
    sp.launch.check_values = false;
    require_ok(msa::select_blocks(sp));
    msa::BackwardParams b = backward_params(out);
    b.cu_seqlens_k = bad.ref();
    b.launch.check_values = false;
    const size_t need = msa::workspace_size(b);
    DeviceTensor ws(DType::kInt32, {static_cast<int64_t>((need + 3) / 4)});
    b.launch.workspace = ws.ref().data;
    b.launch.workspace_bytes = need;
    require_ok(msa::backward(b));
    CUDA_CHECK(cudaDeviceSynchronize());
  }
}

// q, k, v as views of one fused [T, Hq + 2 Hkv, D] projection (token stride larger than a row):
// the same result as contiguous tensors, or kNotSupported naming the argument.
TEST(Cuda, FusedQkvStrides) {
  SKIP_WITHOUT_CUDA();
  const Config c = shape({333, 200}, 8, 2, 128, 2, 1, 128, 128, 3, kBf16, 23);
  Problem p = random_problem(c);
  const int64_t W = c.Hq + 2 * c.Hkv;
  HostTensor qkv(c.dtype, {p.T, W, c.D});
  for (int64_t t = 0; t < p.T; ++t)
    for (int64_t h = 0; h < W; ++h)
      for (int64_t d = 0; d < c.D; ++d) {
        const double x = h < c.Hq              ? p.q.at(t, h, d)
                         : h < c.Hq + c.Hkv ? p.k.at(t, h - c.Hq, d)
                                            : p.v.at(t, h - c.Hq - c.Hkv, d);
        qkv.set((t * W + h) * c.D + d, x);
      }
  HostTensor bi = run_select(p);
  DeviceInputs d(p, nullptr);
  DeviceTensor dqkv = DeviceTensor::upload(qkv, nullptr), dbi = DeviceTensor::upload(bi, nullptr);
  DeviceTensor out = DeviceTensor::poisoned(c.dtype, {p.T, c.Hq, c.D}, nullptr);
  DeviceTensor lse = DeviceTensor::poisoned(DType::kFloat32, {p.T, c.Hq}, nullptr);
  const auto view = [&](int64_t h0, int64_t heads) {
    msa::TensorRef t = dqkv.ref();
    t.data = static_cast<char*>(t.data) + h0 * c.D * msa::dtype_size(c.dtype);
    t.shape[1] = heads;
    return t;  // strides stay those of [T, W, D]
  };
  msa::ForwardParams f;
  f.q = view(0, c.Hq);
  f.k = view(c.Hq, c.Hkv);
  f.v = view(c.Hq + c.Hkv, c.Hkv);
  f.cu_seqlens = d.cu.ref();
  f.block_idx = dbi.ref();
  f.out = out.ref();
  f.lse = lse.ref();
  f.opts = p.options();
  const msa::Status st = msa::forward(f);
  if (!st.ok()) {
    EXPECT_EQ(st.code, StatusCode::kNotSupported) << st.message;
    EXPECT_NE(st.message.find("argument '"), std::string::npos) << st.message;
    return;
  }
  Problem w = widened(p);
  const FwdResult ref = run_forward(w, &bi, Mode::kSparse, false);
  expect_forward_close(out.download(nullptr), lse.download(nullptr), ref, c.dtype, "fused qkv " + c.str());
}

// ---- long sequence selection ------------------------------------------------------------------------

// One sequence of 131072 tokens (1024 blocks of 128), Hi = Hik = 1, Di = 128, k = 16: every row's
// format, and 64 sampled rows (block edges, the last token, random others) against a brute force of
// those rows only, lse_idx included.
TEST(Cuda, Selection131072Tokens) {
  SKIP_WITHOUT_CUDA();
  Config c = shape({131072}, 1, 1, 8, 1, 1, 128, 128, 16, kBf16, 24);
  Problem p = random_problem(c);
  DeviceTensor q_idx = DeviceTensor::upload(p.q_idx, nullptr), k_idx = DeviceTensor::upload(p.k_idx, nullptr);
  DeviceTensor bi = DeviceTensor::poisoned(DType::kInt32, {p.T, 1, c.k}, nullptr);
  DeviceTensor lse_idx = DeviceTensor::poisoned(DType::kFloat32, {p.T, 1}, nullptr);
  msa::SelectParams sp;
  sp.q_idx = q_idx.ref();
  sp.k_idx = k_idx.ref();
  sp.block_idx = bi.ref();
  sp.lse_idx = lse_idx.ref();
  sp.opts = p.options();
  bool with_lse = false;
  require_ok(select_with_lse_idx(sp, &with_lse));
  const HostTensor got = bi.download(nullptr), got_lse = lse_idx.download(nullptr);

  Failures format;
  for (int64_t g = 0; g < p.T; ++g) {
    const std::string e = selection_format_error(bi_row(got, g, 0), static_cast<int>(g / c.Bk));
    if (!e.empty()) format.add("row " + std::to_string(g) + ": " + e);
  }
  EXPECT_EQ(format.count, 0) << format.first;

  std::vector<int64_t> rows = {0, 1, 127, 128, 129, 255, 256, 2047, 2048, 16383, 16384, 65535, 65536, 131070, 131071};
  std::mt19937_64 rng(c.seed);
  std::uniform_int_distribution<int64_t> any(0, p.T - 1);
  while (rows.size() < 64) rows.push_back(any(rng));
  const Failures f = check_selection(p, IndexScores(p), got, with_lse ? &got_lse : nullptr, rows);
  EXPECT_EQ(f.count, 0) << f.first;
}

// ---- errors ---------------------------------------------------------------------------------------

void expect_error(const msa::Status& s, StatusCode code, const std::string& needle, const std::string& what) {
  EXPECT_EQ(s.code, code) << what << ": " << s.message;
  EXPECT_NE(s.message.find(needle), std::string::npos) << what << ": message lacks \"" << needle << "\": " << s.message;
}

// Two blocks whose best keys differ by 2^-7 (apart in bfloat16) round to the same E4M3 value
// under the scale a large value elsewhere in each block sets: kFp8 with fp8_rerank = 0 ties them
// and picks the lower block, kInput the higher one, and kFp8 re-ranking its shortlist by the
// inputs' scores the higher one too (as on the CPU, test_selection.cpp). Without the workspace
// the FP8 calls fail naming it.
TEST(Cuda, Fp8ScoresTieWhatE4M3CannotTellApart) {
  SKIP_WITHOUT_CUDA();
  Config c = shape({384}, 1, 1, 128, 1, 1, 128, 128, 2, kBf16, 5);
  if (!kernels_built(c, false, true)) GTEST_SKIP() << "kernel variant not built into this library";
  Problem p = random_problem(c);
  for (int64_t x = 0; x < p.q_idx.numel(); ++x) p.q_idx.set(x, x % c.Di == 0 ? 1.0 : 0.0);
  for (int64_t x = 0; x < p.k_idx.numel(); ++x) p.k_idx.set(x, 0.0);
  p.k_idx.set(0 * c.Di + 1, 100.0);
  p.k_idx.set(1 * c.Di + 0, 1.0);
  p.k_idx.set(128 * c.Di + 1, 100.0);
  p.k_idx.set(129 * c.Di + 0, 1.0078125);
  DeviceTensor q_idx = DeviceTensor::upload(p.q_idx, nullptr), k_idx = DeviceTensor::upload(p.k_idx, nullptr);
  for (int rerank : {-1, 0, 4}) {  // -1: kInput
    const msa::SelectScores scores = rerank < 0 ? msa::SelectScores::kInput : msa::SelectScores::kFp8;
    DeviceTensor bi = DeviceTensor::poisoned(DType::kInt32, {p.T, 1, c.k}, nullptr);
    msa::SelectParams sp;
    sp.q_idx = q_idx.ref();
    sp.k_idx = k_idx.ref();
    sp.block_idx = bi.ref();
    sp.opts = p.options();
    sp.opts.select_scores = scores;
    sp.opts.fp8_rerank = rerank < 0 ? 4 : rerank;
    const size_t ws_bytes = msa::workspace_size(sp);
    DeviceTensor ws(DType::kInt32, {static_cast<int64_t>((ws_bytes + 3) / 4 + 1)});
    if (ws_bytes > 0) {
      expect_error(msa::select_blocks(sp), StatusCode::kInvalidArgument, "argument 'launch.workspace'",
                   "kFp8 without workspace");
      sp.launch.workspace = ws.ref().data;
      sp.launch.workspace_bytes = ws_bytes;
    }
    require_ok(msa::select_blocks(sp));
    const HostTensor got = bi.download(nullptr);
    const int want = rerank == 0 ? 0 : 1;
    for (int64_t t = 256; t < 384; ++t) {
      ASSERT_EQ(got.idx(t, 0, 0), want) << "token " << t << ", fp8_rerank " << rerank;
      ASSERT_EQ(got.idx(t, 0, 1), 2) << "token " << t << ", fp8_rerank " << rerank;
    }
  }
}

// Valid device buffers of one small problem, and the parameters of each entry point over them.
struct SmallCall {
  Config c;
  Problem p;
  DeviceInputs d;
  DeviceTensor out, lse, bi, kl, dout, dq, dk, dv;

  explicit SmallCall(DType dt, int D = 128, int Di = 128, int Bk = 128)
      : SmallCall(shape({300, 160}, 4, 2, D, 2, 1, Di, Bk, 2, dt, 31)) {}
  explicit SmallCall(const Config& cfg)
      : c(cfg), p(random_problem(c)), d(p, nullptr), out(c.dtype, {p.T, c.Hq, c.D}),
        lse(DType::kFloat32, {p.T, c.Hq}), bi(DType::kInt32, {p.T, c.Hi, c.k}), kl(DType::kFloat32, {1}),
        dout(c.dtype, {p.T, c.Hq, c.D}), dq(c.dtype, {p.T, c.Hq, c.D}), dk(c.dtype, {p.T, c.Hkv, c.D}),
        dv(c.dtype, {p.T, c.Hkv, c.D}) {
    HostTensor host_bi = run_select(p);
    bi = DeviceTensor::upload(host_bi, nullptr);
    CUDA_CHECK(cudaDeviceSynchronize());
  }
  msa::SelectParams select() {
    msa::SelectParams s;
    s.q_idx = d.q_idx.ref();
    s.k_idx = d.k_idx.ref();
    s.cu_seqlens = d.cu.ref();
    s.block_idx = bi.ref();
    s.opts = p.options();
    return s;
  }
  msa::ForwardParams forward() {
    msa::ForwardParams f;
    f.q = d.q.ref();
    f.k = d.k.ref();
    f.v = d.v.ref();
    f.cu_seqlens = d.cu.ref();
    f.block_idx = bi.ref();
    f.out = out.ref();
    f.lse = lse.ref();
    f.opts = p.options();
    return f;
  }
  // dq, dk, dv from dout (out and lse as the forward wrote them); no workspace yet.
  msa::BackwardParams backward() {
    msa::BackwardParams b;
    b.q = d.q.ref();
    b.k = d.k.ref();
    b.v = d.v.ref();
    b.out = out.ref();
    b.lse = lse.ref();
    b.dout = dout.ref();
    b.cu_seqlens = d.cu.ref();
    b.block_idx = bi.ref();
    b.dq = dq.ref();
    b.dk = dk.ref();
    b.dv = dv.ref();
    b.opts = p.options();
    return b;
  }
  // ... with the KL gradient into dq_idx and dk_idx (kl_weight 1000).
  msa::BackwardParams kl_backward(DeviceTensor& dq_idx, DeviceTensor& dk_idx) {
    msa::BackwardParams b = backward();
    b.q_idx = d.q_idx.ref();
    b.k_idx = d.k_idx.ref();
    b.dq_idx = dq_idx.ref();
    b.dk_idx = dk_idx.ref();
    b.kl_weight = 1000.f;
    return b;
  }
};

// Device workspace of workspace_size(b) bytes, set in b.launch.
DeviceTensor give_workspace(msa::BackwardParams& b) {
  const size_t need = msa::workspace_size(b);
  DeviceTensor ws(DType::kInt32, {static_cast<int64_t>((need + 3) / 4)});
  b.launch.workspace = ws.ref().data;
  b.launch.workspace_bytes = need;
  return ws;
}

TEST(Cuda, Float32AndFloat64AreCpuOnly) {
  SKIP_WITHOUT_CUDA();
  SmallCall f32(DType::kFloat32);
  expect_error(msa::forward(f32.forward()), StatusCode::kNotSupported, "argument 'q'", "forward float32");
  expect_error(msa::select_blocks(f32.select()), StatusCode::kNotSupported, "argument 'q_idx'", "select float32");
  SmallCall f64(DType::kFloat64);
  expect_error(msa::forward(f64.forward()), StatusCode::kInvalidArgument, "argument 'q'", "forward float64");
}

// With value checks off a row listing a block twice is the caller's to avoid (contract §3), but
// the reverse index counts a (token, block) once, so the KV side (dk, dv, and the KL gradient's
// dq_idx, dk_idx) gives the bits of the row without the repeat: the last column of every row
// set to its first block, against it set to -1. (dq reads the dS tile of each column, and the
// repeat's is never written: not compared.)
TEST(Cuda, RepeatedBlockCountsOnceOnTheKvSide) {
  SKIP_WITHOUT_CUDA();
  const Config c = shape({900, 300}, 8, 2, 128, 2, 1, 128, 128, 4, kBf16, 33);
  if (!kernels_built(c, true, false)) GTEST_SKIP() << "kernel variant not built into this library";
  SmallCall s(c);
  const int64_t T = s.p.T;
  HostTensor dout(kBf16, {T, c.Hq, c.D});
  std::mt19937_64 rng(9);
  randomize_nonzero(dout, rng, 1.0);
  s.dout = DeviceTensor::upload(dout, nullptr);
  HostTensor bi = s.bi.download(nullptr), rep = bi;
  int64_t repeats = 0;
  for (int64_t row = 0; row < T * c.Hi; ++row) {
    const int64_t first = row * c.k, last = first + c.k - 1;
    bi.set(last, -1);
    rep.set(last, rep.get(first) >= 0 ? rep.get(first) : -1);
    repeats += rep.get(first) >= 0;
  }
  ASSERT_GT(repeats, 0);
  s.bi = DeviceTensor::upload(bi, nullptr);
  require_ok(msa::forward(s.forward()));
  struct Grads {
    HostTensor dk, dv, dq_idx, dk_idx;
  };
  auto run = [&](HostTensor& block_idx) {
    DeviceTensor dbi = DeviceTensor::upload(block_idx, nullptr);
    DeviceTensor dq_idx = DeviceTensor::poisoned(kBf16, {T, c.Hi, c.Di}, nullptr);
    DeviceTensor dk_idx = DeviceTensor::poisoned(kBf16, {T, c.Hik, c.Di}, nullptr);
    s.dk = DeviceTensor::poisoned(kBf16, {T, c.Hkv, c.D}, nullptr);  // each call writes its own
    s.dv = DeviceTensor::poisoned(kBf16, {T, c.Hkv, c.D}, nullptr);
    msa::BackwardParams b = s.kl_backward(dq_idx, dk_idx);
    b.block_idx = dbi.ref();
    b.launch.check_values = false;
    const DeviceTensor ws = give_workspace(b);
    require_ok(msa::backward(b));
    return Grads{s.dk.download(nullptr), s.dv.download(nullptr), dq_idx.download(nullptr), dk_idx.download(nullptr)};
  };
  const Grads want = run(bi), got = run(rep);
  EXPECT_EQ(differing(got.dk, want.dk), 0) << "dk";
  EXPECT_EQ(differing(got.dv, want.dv), 0) << "dv";
  EXPECT_EQ(differing(got.dq_idx, want.dq_idx), 0) << "dq_idx";
  EXPECT_EQ(differing(got.dk_idx, want.dk_idx), 0) << "dk_idx";
}

// The backward and the KL value need device workspace: without it (or with too little) the call
// fails naming launch.workspace and writes nothing; with workspace_size bytes it runs.
TEST(Cuda, BackwardAndKlNeedTheirWorkspace) {
  SKIP_WITHOUT_CUDA();
  SmallCall s(kBf16);
  msa::ForwardParams f = s.forward();
  f.q_idx = s.d.q_idx.ref();
  f.k_idx = s.d.k_idx.ref();
  f.kl = s.kl.ref();
  expect_error(msa::forward(f), StatusCode::kInvalidArgument, "argument 'launch.workspace'", "forward with kl");

  msa::BackwardParams b = s.backward();
  const size_t need = msa::workspace_size(b);
  EXPECT_GT(need, 0u);
  expect_error(msa::backward(b), StatusCode::kInvalidArgument, "argument 'launch.workspace'", "backward");
  DeviceTensor ws(DType::kInt32, {static_cast<int64_t>((need + 3) / 4)});
  b.launch.workspace = ws.ref().data;
  b.launch.workspace_bytes = need - 1;
  expect_error(msa::backward(b), StatusCode::kInvalidArgument, "argument 'launch.workspace'", "backward, short");

  msa::KlParams k;
  k.q = s.d.q.ref();
  k.k = s.d.k.ref();
  k.lse = s.lse.ref();
  k.q_idx = s.d.q_idx.ref();
  k.k_idx = s.d.k_idx.ref();
  k.cu_seqlens = s.d.cu.ref();
  k.block_idx = s.bi.ref();
  k.kl = s.kl.ref();
  k.opts = s.p.options();
  expect_error(msa::kl_divergence(k), StatusCode::kInvalidArgument, "argument 'launch.workspace'", "kl_divergence");

  require_ok(msa::forward(s.forward()));
  b.launch.workspace_bytes = need;
  require_ok(msa::backward(b));
  CUDA_CHECK(cudaDeviceSynchronize());
}

// Head dims and block sizes the kernels may not implement: either they run (checked against the
// CPU) or they answer kNotSupported naming the argument.
TEST(Cuda, KernelLimitsNameTheArgument) {
  SKIP_WITHOUT_CUDA();
  struct Limit {
    const char* what;
    int D, Di, Bk;
    const char* arg_forward;
    const char* arg_select;
  };
  const Limit limits[] = {{"D = 72", 72, 128, 128, "'q'", nullptr},
                          {"Di = 72", 128, 72, 128, nullptr, "'q_idx'"},
                          {"block_size = 32", 128, 128, 32, "'block_size'", "'block_size'"}};
  for (const Limit& l : limits) {
    SmallCall s(kBf16, l.D, l.Di, l.Bk);
    if (l.arg_forward) {
      const msa::Status st = msa::forward(s.forward());
      if (!st.ok()) {
        expect_error(st, StatusCode::kNotSupported, std::string("argument ") + l.arg_forward, l.what);
      } else {
        Problem w = widened(s.p);
        HostTensor bi = s.bi.download(nullptr);
        const FwdResult ref = run_forward(w, &bi, Mode::kSparse, false);
        expect_forward_close(s.out.download(nullptr), s.lse.download(nullptr), ref, kBf16, l.what);
      }
    }
    if (l.arg_select) {
      const msa::Status st = msa::select_blocks(s.select());
      if (!st.ok()) {
        expect_error(st, StatusCode::kNotSupported, std::string("argument ") + l.arg_select, l.what);
      } else {
        const Failures f = check_selection(s.p, IndexScores(s.p), s.bi.download(nullptr), nullptr, all_tokens(s.p));
        EXPECT_EQ(f.count, 0) << l.what << f.first;
      }
    }
  }
}


// ---- value checks of device inputs (Launch::check_values) --------------------------------------

// A device int32 tensor holding `v`.
DeviceTensor int_tensor(const std::vector<int32_t>& v, std::vector<int64_t> shape) {
  HostTensor h(DType::kInt32, std::move(shape));
  for (size_t i = 0; i < v.size(); ++i) h.set(static_cast<int64_t>(i), v[i]);
  DeviceTensor d = DeviceTensor::upload(h, nullptr);
  CUDA_CHECK(cudaDeviceSynchronize());
  return d;
}

// SmallCall's selection with entry (t, i, j) replaced.
DeviceTensor edited_block_idx(SmallCall& s, int64_t t, int i, int j, int32_t value) {
  HostTensor h = s.bi.download(nullptr);
  h.set((t * s.c.Hi + i) * s.c.k + j, value);
  DeviceTensor d = DeviceTensor::upload(h, nullptr);
  CUDA_CHECK(cudaDeviceSynchronize());
  return d;
}

// Malformed cu_seqlens or block_idx values on CUDA tensors: every entry point that reads them
// fails before it launches anything, with the CPU backend's message naming the argument and the
// offending entry, and writes nothing.
TEST(Cuda, ValueChecksNameTheArgument) {
  SKIP_WITHOUT_CUDA();
  SmallCall s(kBf16);  // sequences of 300 and 160 tokens, Bk = 128, k = 2
  const int64_t T = s.p.T;
  struct Cu {
    std::vector<int32_t> v;
    const char* needle;
  };
  const Cu cus[] = {{{0, 500, 460}, "must be non-decreasing, but cu_seqlens[2] = 460 < cu_seqlens[1] = 500"},
                    {{0, 300, 400}, "must end at T = 460, got 400"},
                    {{7, 300, 460}, "must start at 0, got 7"}};
  for (const Cu& c : cus) {
    DeviceTensor cu = int_tensor(c.v, {3});
    msa::ForwardParams f = s.forward();
    f.cu_seqlens = cu.ref();
    DeviceTensor out = DeviceTensor::poisoned(kBf16, {T, s.c.Hq, s.c.D}, nullptr);
    f.out = out.ref();
    expect_error(msa::forward(f), StatusCode::kInvalidArgument, std::string("argument 'cu_seqlens': ") + c.needle,
                 "forward");
    HostTensor o = out.download(nullptr);
    bool untouched = true;
    for (int64_t x = 0; x < o.numel() && untouched; ++x) untouched = std::isnan(o.get(x));
    EXPECT_TRUE(untouched) << "a refused forward wrote out";
    msa::SelectParams sp = s.select();
    sp.cu_seqlens = cu.ref();
    expect_error(msa::select_blocks(sp), StatusCode::kInvalidArgument, std::string("argument 'cu_seqlens': ") + c.needle,
                 "select_blocks");
  }
  struct Entry {
    int64_t t;
    int j;
    int32_t value;
    const char* needle;
  };
  // Token 5 of the first sequence owns block 0; token 200 owns block 1 (selection [0, 1]).
  const Entry entries[] = {
      {5, 0, 3, "entry [5, 0, 0] = 3 is out of range: expected -1 or a block in [0, 0]"},
      {5, 1, -2, "entry [5, 0, 1] = -2 is out of range"},
      {200, 0, 1, "row [200, 0] selects block 1 twice"},
      {310, 1, 1, "entry [310, 0, 1] = 1 is out of range: expected -1 or a block in [0, 0]"}};  // 2nd sequence
  for (const Entry& e : entries) {
    DeviceTensor bi = edited_block_idx(s, e.t, 0, e.j, e.value);
    msa::ForwardParams f = s.forward();
    f.block_idx = bi.ref();
    expect_error(msa::forward(f), StatusCode::kInvalidArgument, std::string("argument 'block_idx': ") + e.needle,
                 "forward");
    msa::BackwardParams b = s.backward();
    b.block_idx = bi.ref();
    DeviceTensor ws(DType::kInt32, {static_cast<int64_t>((msa::workspace_size(b) + 3) / 4)});
    b.launch.workspace = ws.ref().data;
    b.launch.workspace_bytes = msa::workspace_size(b);
    expect_error(msa::backward(b), StatusCode::kInvalidArgument, std::string("argument 'block_idx': ") + e.needle,
                 "backward");
  }
  // The same calls with valid values run.
  require_ok(msa::forward(s.forward()));
  CUDA_CHECK(cudaDeviceSynchronize());
}

// check_values = false: malformed values are not reported, yet nothing is accessed outside the
// tensors (the sanitizer stage runs this test). A stream being captured into a CUDA graph is
// refused while the checks are on (they wait for the device) and captures with them off; the
// graph's results equal the eager call's.
TEST(Cuda, ValueChecksOffAndGraphCapture) {
  SKIP_WITHOUT_CUDA();
  SmallCall s(kBf16);
  DeviceTensor bad = edited_block_idx(s, 200, 0, 0, 1000);
  msa::ForwardParams f = s.forward();
  f.block_idx = bad.ref();
  f.launch.check_values = false;
  require_ok(msa::forward(f));
  CUDA_CHECK(cudaDeviceSynchronize());

  Stream st(true);
  const int64_t T = s.p.T;
  require_ok(msa::forward(s.forward()));
  const HostTensor eager = s.out.download(nullptr);
  DeviceTensor out = DeviceTensor::poisoned(kBf16, {T, s.c.Hq, s.c.D}, st.get());
  CUDA_CHECK(cudaStreamSynchronize(st.get()));
  msa::ForwardParams g = s.forward();
  g.out = out.ref();
  g.launch.stream = st.get();
  cudaGraph_t graph = nullptr;
  CUDA_CHECK(cudaStreamBeginCapture(st.get(), cudaStreamCaptureModeThreadLocal));
  const msa::Status refused = msa::forward(g);
  CUDA_CHECK(cudaStreamEndCapture(st.get(), &graph));
  if (graph) CUDA_CHECK(cudaGraphDestroy(graph));
  expect_error(refused, StatusCode::kInvalidArgument, "argument 'launch.check_values'", "capture with checks");

  g.launch.check_values = false;
  graph = nullptr;
  CUDA_CHECK(cudaStreamBeginCapture(st.get(), cudaStreamCaptureModeThreadLocal));
  const msa::Status captured = msa::forward(g);
  CUDA_CHECK(cudaStreamEndCapture(st.get(), &graph));
  require_ok(captured);
  cudaGraphExec_t exec = nullptr;
  CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
  CUDA_CHECK(cudaGraphLaunch(exec, st.get()));
  const HostTensor replay = out.download(st.get());
  CUDA_CHECK(cudaGraphExecDestroy(exec));
  CUDA_CHECK(cudaGraphDestroy(graph));
  int64_t differ = 0;
  for (int64_t x = 0; x < eager.numel(); ++x) differ += eager.get(x) != replay.get(x);
  EXPECT_EQ(differ, 0) << "graph replay differs from the eager forward";
}

// Options::kl_pass: the KL gradient of the fused KV-side pass and of the separate pass agree;
// kFused where the fused pass cannot run (Hq / Hi = 3) is refused naming 'kl_pass'.
TEST(Cuda, KlPassOption) {
  SKIP_WITHOUT_CUDA();
  for (const int Hq : {4, 6}) {
    const Config c = shape({300, 160}, Hq, 2, 128, 2, 1, 128, 128, 2, kBf16, 41);
    if (!kernels_built(c, true, true)) GTEST_SKIP() << "kernel variant not built into this library";
    SmallCall s(c);
    const int64_t T = s.p.T;
    HostTensor host_dout(kBf16, {T, c.Hq, c.D});
    std::mt19937_64 rng(5);
    randomize_nonzero(host_dout, rng, 1.0);
    s.dout = DeviceTensor::upload(host_dout, nullptr);
    require_ok(msa::forward(s.forward()));
    auto run = [&](msa::KlPass pass, HostTensor* dqi, HostTensor* dki) -> msa::Status {
      DeviceTensor dq_idx = DeviceTensor::poisoned(kBf16, {T, c.Hi, c.Di}, nullptr);
      DeviceTensor dk_idx = DeviceTensor::poisoned(kBf16, {T, c.Hik, c.Di}, nullptr);
      msa::BackwardParams b = s.kl_backward(dq_idx, dk_idx);
      b.opts.kl_pass = pass;
      const DeviceTensor ws = give_workspace(b);
      const msa::Status st = msa::backward(b);
      if (st.ok()) {
        *dqi = dq_idx.download(nullptr);
        *dki = dk_idx.download(nullptr);
      }
      return st;
    };
    HostTensor dq_sep, dk_sep, dq_auto, dk_auto;
    require_ok(run(msa::KlPass::kSeparate, &dq_sep, &dk_sep));
    if (Hq / c.Hi == 3) {
      expect_error(run(msa::KlPass::kFused, &dq_auto, &dk_auto), StatusCode::kNotSupported, "argument 'kl_pass'",
                   "kFused with Hq / Hi = 3");
      expect_error(run(msa::KlPass::kTeacher, &dq_auto, &dk_auto), StatusCode::kNotSupported, "argument 'kl_pass'",
                   "kTeacher with Hq / Hi = 3");
      continue;
    }
    HostTensor dq_t, dk_t;
    require_ok(run(msa::KlPass::kTeacher, &dq_t, &dk_t));
    require_ok(run(msa::KlPass::kFused, &dq_auto, &dk_auto));
    // Each route against the separate pass: finite everywhere, relative L2 under 1e-2.
    const std::tuple<const HostTensor*, const HostTensor*, const char*> routes[] = {
        {&dq_t, &dq_sep, "teacher dq_idx"}, {&dk_t, &dk_sep, "teacher dk_idx"},
        {&dq_auto, &dq_sep, "fused dq_idx"}, {&dk_auto, &dk_sep, "fused dk_idx"}};
    for (auto [b, a, name] : routes) {
      double num = 0, den = 0;
      for (int64_t x = 0; x < a->numel(); ++x) {
        ASSERT_TRUE(std::isfinite(a->get(x)) && std::isfinite(b->get(x))) << name << " entry " << x;
        num += (a->get(x) - b->get(x)) * (a->get(x) - b->get(x));
        den += a->get(x) * a->get(x);
      }
      EXPECT_GT(den, 0.0) << name;
      EXPECT_LT(std::sqrt(num / den), 1e-2) << name << ": disagrees with the separate pass";
    }
  }
}


// s's forward over its block_idx by `pass` into poisoned out and lse, with a workspace of
// workspace_size bytes full of 0xFF (NaN floats) where `room` (else none), the value checks on
// or off; returns (out, lse).
std::pair<HostTensor, HostTensor> forward_pass(SmallCall& s, msa::FwdPass pass, bool room, bool check_values = true) {
  const Config& c = s.c;
  DeviceTensor out = DeviceTensor::poisoned(c.dtype, {s.p.T, c.Hq, c.D}, nullptr);
  DeviceTensor lse = DeviceTensor::poisoned(DType::kFloat32, {s.p.T, c.Hq}, nullptr);
  msa::ForwardParams f = s.forward();
  f.out = out.ref();
  f.lse = lse.ref();
  f.opts.fwd_pass = pass;
  f.launch.check_values = check_values;
  const size_t need = msa::workspace_size(f);
  DeviceTensor ws = DeviceTensor::poisoned(DType::kFloat32, {static_cast<int64_t>((need + 3) / 4) + 1}, nullptr);
  f.launch.workspace = room ? ws.ref().data : nullptr;
  f.launch.workspace_bytes = room ? need : 0;
  require_ok(msa::forward(f));
  return {out.download(nullptr), lse.download(nullptr)};
}

// Options.fwd_pass = kAuto launches the plain query tiles and the split and the device runs one
// (the sums of device/pass_choice.cuh): on a selection where the tokens of a query tile agree it
// must give the query-tile pass's bits (there the split keeps every block with the tiles and
// gives the same bits), on one where they share little the split's (which rounds differently
// there, as the test checks first, so that it can tell them apart); and without room for the
// split's plan in the workspace, kAuto runs the query tiles.
TEST(Cuda, AutoPassRunsTheChosenPass) {
  SKIP_WITHOUT_CUDA();
  const Config c = shape({4096, 2000}, 16, 2, 128, 2, 1, 128, 128, 4, kBf16, 43);
  if (!kernels_built(c, true, false)) GTEST_SKIP() << "kernel variant not built into this library";
  SmallCall s(c);
  const int64_t T = s.p.T;
  // agree: own block, the one before, the sink, the block halfway (the same for a tile's tokens);
  // scattered: own block and three others drawn per token.
  HostTensor agree(DType::kInt32, {T, c.Hi, c.k}), scattered(DType::kInt32, {T, c.Hi, c.k});
  std::mt19937_64 rng(9);
  for (size_t sq = 0; sq + 1 < s.p.offsets.size(); ++sq) {
    for (int64_t t = s.p.offsets[sq]; t < s.p.offsets[sq + 1]; ++t) {
      const int32_t own = static_cast<int32_t>((t - s.p.offsets[sq]) / c.Bk);
      for (int i = 0; i < c.Hi; ++i) {
        std::vector<int32_t> a{own, own - 1, 0, own / 2}, b{own};
        std::uniform_int_distribution<int32_t> u(0, std::max(own - 1, 0));
        while (static_cast<int>(b.size()) < c.k && static_cast<int>(b.size()) <= own)
          if (const int32_t x = u(rng); std::find(b.begin(), b.end(), x) == b.end()) b.push_back(x);
        for (int j = 0; j < c.k; ++j) {
          const int32_t va = a[j] >= 0 && std::find(a.begin(), a.begin() + j, a[j]) == a.begin() + j ? a[j] : -1;
          agree.set((t * c.Hi + i) * c.k + j, va);
          scattered.set((t * c.Hi + i) * c.k + j, j < static_cast<int>(b.size()) ? b[j] : -1);
        }
      }
    }
  }
  auto run = [&](HostTensor& sel, msa::FwdPass pass, bool room) {
    s.bi = DeviceTensor::upload(sel, nullptr);
    return forward_pass(s, pass, room);
  };
  for (auto [sel, kv, name] : {std::tuple{&agree, false, "agreeing tiles"},
                                      std::tuple{&scattered, true, "scattered selections"}}) {
    const auto tile = run(*sel, msa::FwdPass::kQueryTile, true);
    const auto split = run(*sel, msa::FwdPass::kSplit, true);
    ASSERT_EQ(tile.first.bitwise_equal(split.first), !kv)
        << name << (kv ? ": the passes cannot be told apart" : ": the split kept every block, yet differs");
    const auto chosen = run(*sel, msa::FwdPass::kAuto, true);
    const auto& want = kv ? split : tile;
    EXPECT_TRUE(chosen.first.bitwise_equal(want.first)) << name << ": kAuto's out is not the "
                                                        << (kv ? "split" : "query-tile") << " pass's";
    EXPECT_TRUE(chosen.second.bitwise_equal(want.second)) << name << ": kAuto's lse";
    const auto no_room = run(*sel, msa::FwdPass::kAuto, false);
    EXPECT_TRUE(no_room.first.bitwise_equal(tile.first)) << name << ": kAuto without workspace";
  }
}

// The split's query tiles fetch each row's next partial into a slot of shared memory after the
// union arrays, where those leave room (at D = Bk = 128 about 30 KB: fwd_kernel's SharedStorage
// and the 36 KB of slots take the rest); else they merge every partial after their mainloop.
// The arrays are sized for min(tile tokens x k, T / Bk) blocks: with Hq = Hi (128-token tiles)
// and k = 16, 2048 blocks (41 KB) once T passes 262144 tokens. Here 2048 sequences of one
// block and one of 8192 tokens, whose selections (random index inputs: 15 of up to 63 earlier
// blocks drawn per token) put most of its (token, block) pairs in the KV-block pass; out and
// lse against the CPU backend, and the split told apart from the query tiles.
TEST(Cuda, SplitMergesWithoutSlots) {
  SKIP_WITHOUT_CUDA();
  std::vector<int64_t> lens(2048, 128);
  lens.insert(lens.begin() + 1000, 8192);
  const Config c = shape(lens, 1, 1, 128, 1, 1, 128, 128, 16, kBf16, 47);
  if (!kernels_built(c, true, false)) GTEST_SKIP() << "kernel variant not built into this library";
  SmallCall s(c);
  const int64_t T = s.p.T;
  ASSERT_GT(T, 262144);
  HostTensor bi = s.bi.download(nullptr);
  const auto tile = forward_pass(s, msa::FwdPass::kQueryTile, true);
  const auto split = forward_pass(s, msa::FwdPass::kSplit, true);
  ASSERT_FALSE(tile.first.bitwise_equal(split.first)) << "the split kept every block with the tiles";
  Problem wide = widened(s.p);
  const FwdResult ref = run_forward(wide, &bi, Mode::kSparse, false);
  expect_forward_close(split.first, split.second, ref, c.dtype, "kSplit, partials merged after the mainloop");
  expect_forward_close(tile.first, tile.second, ref, c.dtype, "kQueryTile");
}

// With value checks off a row listing a block twice is the caller's to avoid (contract §3), but
// every forward pass gives the bits of the row without the repeat: the query tiles' union counts
// the block once, the reverse index keeps one record per (token, block), and the split's tiles
// merge only the partials pass_choice_kernel leaves unmarked (one per block of a row; the
// workspace is poisoned, so a repeat's slot merged as a partial would show). The last column of
// every row set to -1, against it set to a copy of another of the row's blocks drawn at random
// (the random index inputs' picks: mostly blocks few of a tile's 32 tokens share, so the split's
// KV-block pass computes them).
TEST(Cuda, RepeatedBlockCountsOnceInTheForward) {
  SKIP_WITHOUT_CUDA();
  const Config c = shape({2000, 700, 1}, 8, 2, 128, 2, 1, 128, 128, 8, kBf16, 51);
  if (!kernels_built(c, true, false)) GTEST_SKIP() << "kernel variant not built into this library";
  SmallCall s(c);
  const int64_t T = s.p.T;
  HostTensor bi = s.bi.download(nullptr), rep = bi;
  std::mt19937_64 rng(13);
  int64_t repeats = 0;
  for (int64_t row = 0; row < T * c.Hi; ++row) {
    const int64_t first = row * c.k, last = first + c.k - 1;
    bi.set(last, -1);
    std::vector<int64_t> others;  // the row's other columns that name a block
    for (int64_t j = first; j < last; ++j)
      if (bi.get(j) >= 0) others.push_back(j);
    rep.set(last, others.empty() ? -1 : bi.get(others[rng() % others.size()]));
    repeats += !others.empty();
  }
  ASSERT_GT(repeats, T);
  auto run = [&](HostTensor& sel, msa::FwdPass pass) {
    s.bi = DeviceTensor::upload(sel, nullptr);
    return forward_pass(s, pass, true, false);
  };
  const auto tile = run(bi, msa::FwdPass::kQueryTile);
  for (auto [pass, name] : {std::pair{msa::FwdPass::kQueryTile, "kQueryTile"},
                            std::pair{msa::FwdPass::kKvBlock, "kKvBlock"}, std::pair{msa::FwdPass::kSplit, "kSplit"}}) {
    const auto want = run(bi, pass), got = run(rep, pass);
    if (pass == msa::FwdPass::kSplit) {
      ASSERT_FALSE(want.first.bitwise_equal(tile.first)) << "the split kept every block with the tiles";
      Problem wide = widened(s.p);
      const FwdResult ref = run_forward(wide, &bi, Mode::kSparse, false);
      expect_forward_close(want.first, want.second, ref, c.dtype, "kSplit without repeats");
    }
    EXPECT_TRUE(got.first.bitwise_equal(want.first)) << name << ": out with a block repeated";
    EXPECT_TRUE(got.second.bitwise_equal(want.second)) << name << ": lse with a block repeated";
  }
}

// ---- serving over a paged cache (docs/contract.md §6) -------------------------------------------
//
// The same batches as the CPU tests (paged_cases.h: shuffled page tables, NaN in every page row
// no sequence owns), uploaded: the CUDA selection must satisfy the contract's rule at the new
// tokens' positions (scores from the contiguous sequences), and its attention must match the CPU
// backend's paged call over the same block_idx within the forward tolerances.

struct DevicePaged {
  DeviceTensor q, q_idx, k, v, k_idx, page_table, seq_lens, cu_q;
  DevicePaged(PagedBatch& b, cudaStream_t s)
      : q(DeviceTensor::upload(b.q, s)), q_idx(DeviceTensor::upload(b.q_idx, s)), k(DeviceTensor::upload(b.kc, s)),
        v(DeviceTensor::upload(b.vc, s)), k_idx(DeviceTensor::upload(b.kic, s)),
        page_table(DeviceTensor::upload(b.page_table, s)), seq_lens(DeviceTensor::upload(b.seq_lens, s)),
        cu_q(DeviceTensor::upload(b.cu_q, s)) {}
  PagedRefs refs() const {
    return {q.ref(), q_idx.ref(), k.ref(), v.ref(), k_idx.ref(), page_table.ref(), seq_lens.ref(), cu_q.ref()};
  }
};

// Device workspace of `bytes` (none for 0).
struct Workspace {
  DeviceTensor buf;
  explicit Workspace(size_t bytes) : buf(DType::kInt32, {static_cast<int64_t>((bytes + 3) / 4)}) {}
  template <class P>
  void attach(P& p) const {
    p.launch.workspace = buf.ref().data;
    p.launch.workspace_bytes = static_cast<size_t>(buf.ref().shape[0]) * 4;
  }
};

// A workspace of workspace_size(p) bytes (there must be some), poisoned, attached to p with
// stream s; the result keeps it alive.
template <class P>
DeviceTensor poisoned_workspace(P& p, cudaStream_t s) {
  const size_t bytes = msa::workspace_size(p);
  EXPECT_GT(bytes, 0u);
  DeviceTensor ws = DeviceTensor::poisoned(DType::kInt32, {static_cast<int64_t>(bytes / 4 + 1)}, s);
  p.launch.workspace = ws.ref().data;
  p.launch.workspace_bytes = bytes;
  p.launch.stream = s;
  return ws;
}

// paged_forward into poisoned out and lse tensors, with a workspace of its own; the call must succeed.
struct PagedForwardRun {
  DeviceTensor out, lse;
  PagedForwardRun(const PagedCase& cs, const PagedRefs& r, Mode mode, bool select, const msa::TensorRef& bi,
                  int64_t Tq, cudaStream_t s)
      : out(DeviceTensor::poisoned(cs.dtype, {Tq, cs.Hq, cs.D}, s)),
        lse(DeviceTensor::poisoned(DType::kFloat32, {Tq, cs.Hq}, s)) {
    msa::PagedForwardParams fp = paged_forward_params(cs, r, mode, select, bi, out.ref(), lse.ref());
    Workspace ws(msa::workspace_size(fp));
    ws.attach(fp);
    fp.launch.stream = s;
    require_ok(msa::paged_forward(fp));
  }
};

// paged_select_blocks on the device with `sp` (its block_idx: bi) and a workspace of its own;
// returns bi's values.
HostTensor paged_select_on_gpu(msa::PagedSelectParams sp, DeviceTensor& bi, cudaStream_t s) {
  Workspace ws(msa::workspace_size(sp));
  ws.attach(sp);
  sp.launch.stream = s;
  require_ok(msa::paged_select_blocks(sp));
  return bi.download(s);
}

// A [Tq, ...] result scattered to the rows of the contiguous problem (new_rows), for the checks
// written against whole problems; other rows hold `fill`.
HostTensor to_full_rows(const HostTensor& t, const PagedBatch& b, double fill) {
  std::vector<int64_t> shape = t.shape();
  const int64_t row = t.numel() / std::max<int64_t>(shape[0], 1);
  shape[0] = b.full.T;
  HostTensor f(t.dtype(), shape);
  f.fill(fill);
  for (size_t r = 0; r < b.new_rows.size(); ++r)
    for (int64_t x = 0; x < row; ++x) f.set(b.new_rows[r] * row + x, t.get(static_cast<int64_t>(r) * row + x));
  return f;
}

// The CPU backend's paged forward over `bi` (kSparse) or dense, in float64 (the reference).
FwdResult cpu_paged_forward(const PagedCase& cs, PagedBatch& b, HostTensor* bi, Mode mode) {
  PagedCase wide = cs;
  wide.dtype = DType::kFloat64;
  PagedBatch w(wide);  // same seed: the same values before rounding; copy the rounded ones
  const std::pair<const HostTensor*, HostTensor*> pairs[] = {
      {&b.q, &w.q}, {&b.q_idx, &w.q_idx}, {&b.kc, &w.kc}, {&b.vc, &w.vc}, {&b.kic, &w.kic}};
  for (auto [src, dst] : pairs)
    for (int64_t x = 0; x < src->numel(); ++x) dst->set(x, src->get(x));
  FwdResult r{HostTensor(DType::kFloat64, {w.Tq, cs.Hq, cs.D}), HostTensor(DType::kFloat32, {w.Tq, cs.Hq}), {}};
  const PagedRefs refs = host_refs(w);
  expect_ok(msa::paged_forward(paged_forward_params(wide, refs, mode, false, bi ? bi->ref() : msa::TensorRef{},
                                                    r.out.ref(), r.lse.ref())));
  return r;
}

PagedCase paged_gpu_case(std::vector<int64_t> lens, std::vector<int64_t> nq, int Hq, int Hkv, int Hi, int Hik,
                         int D, int Bk, int k, DType dt, int max_q_len, uint64_t seed) {
  PagedCase c;
  c.lens = std::move(lens);
  c.nq = std::move(nq);
  c.Hq = Hq;
  c.Hkv = Hkv;
  c.Hi = Hi;
  c.Hik = Hik;
  c.D = c.Di = D;
  c.Bk = Bk;
  c.k = k;
  c.dtype = dt;
  c.max_q_len = max_q_len;
  c.seed = seed;
  return c;
}

PagedCase with_forced(PagedCase c, int sink, int local) {
  c.sink = sink;
  c.local = local;
  return c;
}

const PagedCase kPagedCases[] = {
    // decode, paper-like heads (G = 16, one index key head), block edges, an empty request
    paged_gpu_case({1, 127, 128, 129, 4000, 0}, {1, 1, 8, 16, 3, 0}, 32, 2, 2, 1, 128, 128, 4, kBf16, 16, 1),
    // decode of one long sequence: split over the union, many score chunks
    paged_gpu_case({40000}, {1}, 64, 4, 4, 1, 128, 128, 16, kBf16, 1, 2),
    paged_gpu_case({20000, 300}, {8, 2}, 16, 2, 4, 2, 128, 128, 8, kBf16, 8, 3),
    // prefill chunks (many tiles, no split), sinks and local blocks
    with_forced(paged_gpu_case({3000, 700, 1}, {600, 200, 1}, 16, 2, 2, 1, 128, 128, 6, kBf16, 0, 4), 1, 2),
    // other variants (skipped when not built)
    paged_gpu_case({2100, 90}, {16, 16}, 8, 2, 2, 1, 64, 64, 5, kFp16, 16, 5),
    // decode with few rows per sequence (max_q_len x Gk <= 16: the 16-row score tiles)
    paged_gpu_case({2100, 90, 1}, {2, 1, 1}, 8, 2, 2, 1, 64, 64, 5, kFp16, 2, 8),
    paged_gpu_case({1500}, {300}, 8, 8, 8, 1, 64, 128, 4, kFp16, 0, 6),
    paged_gpu_case({900, 65}, {5, 65}, 4, 1, 4, 4, 128, 64, 3, kBf16, 0, 7),
    // decode whose max_q_len x G rows fit one 16-row tile (the attention's column layout): one
    // token x 16 heads at block edges and an empty request; 8 tokens x 2 heads of one tile
    paged_gpu_case({1, 127, 128, 129, 4000, 0}, {1, 1, 1, 1, 1, 0}, 32, 2, 2, 1, 128, 128, 4, kBf16, 1, 9),
    paged_gpu_case({3000, 200, 5}, {8, 3, 5}, 4, 2, 2, 1, 128, 128, 6, kBf16, 8, 10),
};

class PagedCudaVsCpu : public ::testing::TestWithParam<PagedCase> {};

TEST_P(PagedCudaVsCpu, SelectAndForward) {
  SKIP_WITHOUT_CUDA();
  const PagedCase cs = GetParam();
  SCOPED_TRACE(cs.str());
  SKIP_UNLESS_BUILT(cs.config(), true, true);
  Stream st(true);
  PagedBatch b(cs);
  DevicePaged d(b, st.get());
  const PagedRefs r = d.refs();
  Problem& full = b.full;
  const IndexScores sc(full);

  // The selection alone: the contract's rule at every new token.
  DeviceTensor bi = DeviceTensor::poisoned(DType::kInt32, {b.Tq, cs.Hi, cs.k}, st.get());
  HostTensor sel = paged_select_on_gpu(paged_select_params(cs, r, bi.ref()), bi, st.get());
  const Failures fs = check_selection(full, sc, to_full_rows(sel, b, -1), nullptr, b.new_rows);
  EXPECT_EQ(fs.count, 0) << "paged_select_blocks:" << fs.first;

  // Attention over that selection, against the CPU backend's paged call over the same one.
  const FwdResult want = cpu_paged_forward(cs, b, &sel, Mode::kSparse);
  PagedForwardRun fwd(cs, r, Mode::kSparse, false, bi.ref(), b.Tq, st.get());
  expect_forward_close(fwd.out.download(st.get()), fwd.lse.download(st.get()), want, cs.dtype,
                       "paged_forward(block_idx)");

  // With the selection inside the call: its block_idx, then the attention over it.
  DeviceTensor bi2 = DeviceTensor::poisoned(DType::kInt32, {b.Tq, cs.Hi, cs.k}, st.get());
  DeviceTensor out2 = DeviceTensor::poisoned(cs.dtype, {b.Tq, cs.Hq, cs.D}, st.get());
  msa::PagedForwardParams fs2 = paged_forward_params(cs, r, Mode::kSparse, true, bi2.ref(), out2.ref(), {});
  Workspace ws2(msa::workspace_size(fs2));
  ws2.attach(fs2);
  fs2.launch.stream = st.get();
  require_ok(msa::paged_forward(fs2));
  HostTensor sel2 = bi2.download(st.get());
  EXPECT_EQ(first_difference(sel2, sel), "") << "paged_forward(select) chose differently from paged_select_blocks";
  HostTensor no_lse(DType::kFloat32, {b.Tq, cs.Hq});
  no_lse.fill(0);
  FwdResult want2 = want;
  want2.lse = no_lse;
  expect_forward_close(out2.download(st.get()), no_lse, want2, cs.dtype, "paged_forward(select)");

  // Dense causal attention over the cache.
  const FwdResult dense = cpu_paged_forward(cs, b, nullptr, Mode::kDense);
  DeviceTensor out3 = DeviceTensor::poisoned(cs.dtype, {b.Tq, cs.Hq, cs.D}, st.get());
  DeviceTensor lse3 = DeviceTensor::poisoned(DType::kFloat32, {b.Tq, cs.Hq}, st.get());
  msa::PagedForwardParams fd = paged_forward_params(cs, r, Mode::kDense, false, {}, out3.ref(), lse3.ref());
  Workspace ws3(msa::workspace_size(fd));
  ws3.attach(fd);
  fd.launch.stream = st.get();
  require_ok(msa::paged_forward(fd));
  expect_forward_close(out3.download(st.get()), lse3.download(st.get()), dense, cs.dtype, "paged_forward(kDense)");
}

INSTANTIATE_TEST_SUITE_P(Shapes, PagedCudaVsCpu, ::testing::ValuesIn(kPagedCases),
                         [](const ::testing::TestParamInfo<PagedCase>& i) { return "case" + std::to_string(i.index); });

// Prefill batches (seeds seed0 ...): prefixes ending inside, at and after block edges, a
// sequence without new tokens, one of a single token, sinks and local blocks; paper-like heads
// (G = 16: 8 tokens per query tile) with two index key heads and a sequence wholly new; another
// variant (skipped when not built).
std::vector<PagedCase> prefill_cases(uint64_t seed0) {
  return {with_forced(paged_gpu_case({3000, 700, 1, 500, 1280}, {600, 200, 1, 0, 129}, 16, 2, 2, 1, 128, 128, 6,
                                     kBf16, 0, seed0),
                      1, 2),
          paged_gpu_case({5000, 257}, {700, 257}, 32, 2, 2, 2, 128, 128, 8, kBf16, 0, seed0 + 1),
          paged_gpu_case({1500, 64}, {300, 64}, 8, 2, 4, 1, 64, 64, 4, kFp16, 0, seed0 + 2)};
}

// A sparse prefill by each walk of the training forward over the paged cache (the query tiles,
// the KV-block pass over the pages, the split of the two, kAuto with the workspace it asks for),
// in one pass and in passes of 97 tokens (pass boundaries inside query tiles and sequences),
// against the CPU backend over the same selection: prefixes ending inside, at and after block
// edges, a sequence without new tokens, one of a single token.
TEST(CudaPaged, PrefillByEachForwardPass) {
  SKIP_WITHOUT_CUDA();
  const msa::FwdPass passes[] = {msa::FwdPass::kQueryTile, msa::FwdPass::kKvBlock, msa::FwdPass::kSplit,
                                 msa::FwdPass::kAuto};
  for (const PagedCase& base : prefill_cases(51)) {
    SCOPED_TRACE(base.str());
    if (!kernels_built(base.config(), true, true)) continue;
    Stream st(true);
    PagedBatch b(base);
    DevicePaged d(b, st.get());
    const PagedRefs r = d.refs();
    DeviceTensor bi = DeviceTensor::poisoned(DType::kInt32, {b.Tq, base.Hi, base.k}, st.get());
    HostTensor sel = paged_select_on_gpu(paged_select_params(base, r, bi.ref()), bi, st.get());
    const FwdResult want = cpu_paged_forward(base, b, &sel, Mode::kSparse);
    for (const msa::FwdPass pass : passes) {
      for (const int chunk : {0, 97}) {
        PagedCase cs = base;
        cs.fwd_pass = pass;
        cs.fwd_chunk_tokens = chunk;
        SCOPED_TRACE("fwd_pass " + std::to_string(static_cast<int>(pass)) + ", fwd_chunk_tokens " +
                     std::to_string(chunk));
        PagedForwardRun fwd(cs, r, Mode::kSparse, false, bi.ref(), b.Tq, st.get());
        expect_forward_close(fwd.out.download(st.get()), fwd.lse.download(st.get()), want, cs.dtype,
                             "paged_forward(block_idx)");
      }
    }
  }
}

// FP8 scores in a prefill (select_scores = kFp8, fp8_rerank 0 and 4, and 4 with fp8_rerank_slots
// 2): the E4M3 copies of each
// page are select_blocks's copies of that sequence's block, so paged_select_blocks (and
// paged_forward's selection) over a shuffled page table, with a poisoned workspace, must equal
// select_blocks with kFp8 on the contiguous sequences bit for bit; and follow the contract's
// rule over the CPU reference's FP8 scores (fp8_scored: the tests' own quantiser).
TEST(CudaPaged, PrefillFp8ScoresEqualSelectBlocks) {
  SKIP_WITHOUT_CUDA();
  for (const PagedCase& base : prefill_cases(61)) {
    if (!kernels_built(base.config(), false, true)) continue;
    Stream st(true);
    PagedBatch b(base);
    DevicePaged d(b, st.get());
    const PagedRefs r = d.refs();
    Problem& full = b.full;
    const Problem q8 = fp8_scored(full);
    const IndexScores own(full), own8(q8);
    DeviceTensor fq = DeviceTensor::upload(full.q_idx, st.get()), fk = DeviceTensor::upload(full.k_idx, st.get());
    DeviceTensor fcu = DeviceTensor::upload(full.cu, st.get());
    for (const auto [m, a] : {std::pair{0, 0}, std::pair{4, 0}, std::pair{4, 2}}) {
      PagedCase cs = base;
      cs.select_scores = msa::SelectScores::kFp8;
      cs.fp8_rerank = m;
      cs.fp8_rerank_slots = a;
      SCOPED_TRACE(cs.str());
      // select_blocks on the contiguous sequences, the new tokens' rows.
      DeviceTensor fbi = DeviceTensor::poisoned(DType::kInt32, {full.T, cs.Hi, cs.k}, st.get());
      msa::SelectParams sp;
      sp.q_idx = fq.ref();
      sp.k_idx = fk.ref();
      sp.cu_seqlens = fcu.ref();
      sp.block_idx = fbi.ref();
      sp.opts = cs.options();
      const DeviceTensor fws = poisoned_workspace(sp, st.get());
      require_ok(msa::select_blocks(sp));
      const HostTensor want = gather_rows(fbi.download(st.get()), b.new_rows);
      // The paged selection, its workspace poisoned.
      DeviceTensor bi = DeviceTensor::poisoned(DType::kInt32, {b.Tq, cs.Hi, cs.k}, st.get());
      msa::PagedSelectParams ps = paged_select_params(cs, r, bi.ref());
      const DeviceTensor ws = poisoned_workspace(ps, st.get());
      require_ok(msa::paged_select_blocks(ps));
      const HostTensor got = bi.download(st.get());
      EXPECT_EQ(first_difference(got, want), "") << "paged_select_blocks against select_blocks";
      const Failures f = m == 0 ? check_selection(q8, own8, to_full_rows(got, b, -1), nullptr, b.new_rows)
                                : check_selection(full, own, to_full_rows(got, b, -1), nullptr, b.new_rows, &own8, m, a);
      EXPECT_EQ(f.count, 0) << "paged_select_blocks, the contract's rule:" << f.first;
      // paged_forward's selection.
      DeviceTensor bi2 = DeviceTensor::poisoned(DType::kInt32, {b.Tq, cs.Hi, cs.k}, st.get());
      DeviceTensor out2 = DeviceTensor::poisoned(cs.dtype, {b.Tq, cs.Hq, cs.D}, st.get());
      msa::PagedForwardParams fp = paged_forward_params(cs, r, Mode::kSparse, true, bi2.ref(), out2.ref(), {});
      Workspace ws2(msa::workspace_size(fp));
      ws2.attach(fp);
      fp.launch.stream = st.get();
      require_ok(msa::paged_forward(fp));
      EXPECT_EQ(first_difference(bi2.download(st.get()), want), "") << "paged_forward's selection";
    }
    // The CUDA limits of the FP8 prefill, named: top_k past the selection kernel's lists, and
    // a shortlist wider than the re-ranking takes.
    PagedCase wide = base;
    wide.select_scores = msa::SelectScores::kFp8;
    wide.k = 33;
    DeviceTensor bi3 = DeviceTensor::poisoned(DType::kInt32, {b.Tq, wide.Hi, wide.k}, st.get());
    expect_error(msa::paged_select_blocks(paged_select_params(wide, r, bi3.ref())), StatusCode::kNotSupported,
                 "argument 'top_k'", "kFp8 prefill, top_k 33");
    wide.k = 32;
    wide.fp8_rerank = 64;
    DeviceTensor bi4 = DeviceTensor::poisoned(DType::kInt32, {b.Tq, wide.Hi, wide.k}, st.get());
    msa::PagedSelectParams ps4 = paged_select_params(wide, r, bi4.ref());
    Workspace ws4(msa::workspace_size(ps4));  // the limit shows at the launch, after the copies
    ws4.attach(ps4);
    ps4.launch.stream = st.get();
    expect_error(msa::paged_select_blocks(ps4), StatusCode::kNotSupported, "'fp8_rerank'",
                 "kFp8 prefill, top_k 32 + fp8_rerank 64");
  }
}

// paged_append writes exactly the new tokens' rows, as the CPU backend does.
TEST(CudaPaged, AppendMatchesCpu) {
  SKIP_WITHOUT_CUDA();
  PagedCase cs = paged_gpu_case({300, 5, 129}, {17, 5, 1}, 16, 2, 2, 1, 128, 128, 4, kBf16, 0, 21);
  Stream st(true);
  PagedBatch b(cs);
  HostTensor kn = gather_rows(b.full.k, b.new_rows), vn = gather_rows(b.full.v, b.new_rows),
             kin = gather_rows(b.full.k_idx, b.new_rows);
  for (HostTensor* c : {&b.kc, &b.vc, &b.kic})  // the new rows not yet written
    for (int64_t x = 0; x < c->numel(); ++x) c->set(x, 0.5);
  DevicePaged d(b, st.get());
  DeviceTensor dk = DeviceTensor::upload(kn, st.get()), dv = DeviceTensor::upload(vn, st.get()),
               dki = DeviceTensor::upload(kin, st.get());
  msa::PagedAppendParams ap;
  ap.k = dk.ref();
  ap.v = dv.ref();
  ap.k_idx = dki.ref();
  ap.cu_seqlens_q = d.cu_q.ref();
  ap.cache = cache_of(d.refs());
  ap.block_size = cs.Bk;
  ap.launch.stream = st.get();
  require_ok(msa::paged_append(ap));
  msa::PagedAppendParams hp = ap;
  const PagedRefs h = host_refs(b);
  hp.k = kn.ref();
  hp.v = vn.ref();
  hp.k_idx = kin.ref();
  hp.cu_seqlens_q = h.cu_q;
  hp.cache = cache_of(h);
  hp.launch = {};
  expect_ok(msa::paged_append(hp));
  EXPECT_EQ(first_difference(d.k.download(st.get()), b.kc), "") << "k cache";
  EXPECT_EQ(first_difference(d.v.download(st.get()), b.vc), "") << "v cache";
  EXPECT_EQ(first_difference(d.k_idx.download(st.get()), b.kic), "") << "k_idx cache";
}

// Bad values on the device are reported naming the argument, as on the CPU.
TEST(CudaPaged, ValueChecksNameTheArgument) {
  SKIP_WITHOUT_CUDA();
  PagedCase cs = paged_gpu_case({300, 130}, {3, 2}, 16, 2, 2, 1, 128, 128, 4, kBf16, 4, 22);
  Stream st(false);
  struct Edit {
    std::function<void(PagedBatch&)> edit;
    const char* arg;
  };
  const Edit edits[] = {
      {[](PagedBatch& b) { b.page_table.set(1, b.pages); }, "argument 'cache.page_table'"},
      {[](PagedBatch& b) { b.seq_lens.set(0, 1e6); }, "argument 'cache.seq_lens'"},
      {[](PagedBatch& b) { b.seq_lens.set(1, 1); }, "argument 'cache.seq_lens'"},
  };
  for (const Edit& e : edits) {
    PagedBatch b(cs);
    e.edit(b);
    DevicePaged d(b, st.get());
    DeviceTensor out = DeviceTensor::poisoned(cs.dtype, {b.Tq, cs.Hq, cs.D}, st.get());
    DeviceTensor bi = DeviceTensor::poisoned(DType::kInt32, {b.Tq, cs.Hi, cs.k}, st.get());
    msa::PagedForwardParams fp = paged_forward_params(cs, d.refs(), Mode::kSparse, true, bi.ref(), out.ref(), {});
    Workspace ws(msa::workspace_size(fp));
    ws.attach(fp);
    expect_error(msa::paged_forward(fp), StatusCode::kInvalidArgument, e.arg, e.arg);
  }
  // max_q_len below a sequence's new tokens
  PagedCase small = cs;
  small.max_q_len = 2;
  PagedBatch b(small);
  DevicePaged d(b, st.get());
  DeviceTensor bi = DeviceTensor::poisoned(DType::kInt32, {b.Tq, cs.Hi, cs.k}, st.get());
  msa::PagedSelectParams sp = paged_select_params(small, d.refs(), bi.ref());
  Workspace ws(msa::workspace_size(sp));
  ws.attach(sp);
  expect_error(msa::paged_select_blocks(sp), StatusCode::kInvalidArgument, "argument 'max_q_len'", "max_q_len");
}

// A decode step captured into a CUDA graph (checks off) and replayed with new lengths, page
// tables and queries of the same shapes gives the eager result of the new batch.
// A cache with head-major pages ([page, H, Bk, D] viewed as [page, Bk, H, D]): its pages are not
// whole row ranges, so a prefill takes the paged kernels (score, top-k, paged attention) instead
// of the training kernels; the selection and the outputs are the contract's all the same.
TEST(CudaPaged, PrefillOverHeadMajorPages) {
  SKIP_WITHOUT_CUDA();
  const PagedCase cs =
      with_forced(paged_gpu_case({3000, 700, 1}, {600, 200, 1}, 16, 2, 2, 1, 128, 128, 6, kBf16, 0, 41), 1, 2);
  SKIP_UNLESS_BUILT(cs.config(), true, true);
  Stream st(true);
  PagedBatch b(cs);
  DevicePaged d(b, st.get());
  // [P, Bk, H, D] -> a [P, H, Bk, D] copy, and the [P, Bk, H, D] view of it.
  auto head_major = [&](const HostTensor& t) {
    const std::vector<int64_t>& sh = t.shape();
    HostTensor hm(t.dtype(), {sh[0], sh[2], sh[1], sh[3]});
    for (int64_t pg = 0; pg < sh[0]; ++pg)
      for (int64_t r = 0; r < sh[1]; ++r)
        for (int64_t h = 0; h < sh[2]; ++h)
          for (int64_t x = 0; x < sh[3]; ++x)
            hm.set(((pg * sh[2] + h) * sh[1] + r) * sh[3] + x, t.get(((pg * sh[1] + r) * sh[2] + h) * sh[3] + x));
    return hm;
  };
  auto view = [](const DeviceTensor& dt, const std::vector<int64_t>& sh) {
    msa::TensorRef v = dt.ref();
    v.shape[0] = sh[0];
    v.shape[1] = sh[1];
    v.shape[2] = sh[2];
    v.shape[3] = sh[3];
    v.stride[0] = sh[1] * sh[2] * sh[3];
    v.stride[1] = sh[3];
    v.stride[2] = sh[1] * sh[3];
    v.stride[3] = 1;
    return v;
  };
  HostTensor khm = head_major(b.kc), vhm = head_major(b.vc), kihm = head_major(b.kic);
  DeviceTensor dk = DeviceTensor::upload(khm, st.get()), dv = DeviceTensor::upload(vhm, st.get()),
               dki = DeviceTensor::upload(kihm, st.get());
  PagedRefs r = d.refs();
  r.k = view(dk, b.kc.shape());
  r.v = view(dv, b.vc.shape());
  r.k_idx = view(dki, b.kic.shape());
  ASSERT_NE(r.k.stride[0], cs.Bk * r.k.stride[1]) << "the pages must not be row ranges here";

  DeviceTensor bi = DeviceTensor::poisoned(DType::kInt32, {b.Tq, cs.Hi, cs.k}, st.get());
  PagedForwardRun fwd(cs, r, Mode::kSparse, true, bi.ref(), b.Tq, st.get());
  HostTensor sel = bi.download(st.get());
  const IndexScores sc(b.full);
  const Failures fs = check_selection(b.full, sc, to_full_rows(sel, b, -1), nullptr, b.new_rows);
  EXPECT_EQ(fs.count, 0) << "selection over head-major pages:" << fs.first;
  const FwdResult want = cpu_paged_forward(cs, b, &sel, Mode::kSparse);
  expect_forward_close(fwd.out.download(st.get()), fwd.lse.download(st.get()), want, cs.dtype,
                       "paged_forward over head-major pages");
}

// One captured paged_forward (selection inside) replayed over two batches of the same shapes
// with other lengths, page tables and contents.
void graph_replay_with_new_lengths_and_pages(const PagedCase& c1, const PagedCase& c2) {
  PagedBatch b1(c1), b2(c2);
  ASSERT_EQ(b1.Tq, b2.Tq);
  // Same shapes: the second batch's pages and page table fit in the first's buffers.
  ASSERT_LE(b2.pages, b1.pages);
  ASSERT_LE(b2.max_pages, b1.max_pages);
  Stream st(true);
  DevicePaged d(b1, st.get());
  DeviceTensor bi = DeviceTensor::poisoned(DType::kInt32, {b1.Tq, c1.Hi, c1.k}, st.get());
  DeviceTensor out = DeviceTensor::poisoned(c1.dtype, {b1.Tq, c1.Hq, c1.D}, st.get());
  msa::PagedForwardParams fp = paged_forward_params(c1, d.refs(), Mode::kSparse, true, bi.ref(), out.ref(), {});
  Workspace ws(msa::workspace_size(fp));
  ws.attach(fp);
  fp.launch.stream = st.get();
  fp.launch.check_values = false;
  cudaGraph_t graph = nullptr;
  CUDA_CHECK(cudaStreamBeginCapture(st.get(), cudaStreamCaptureModeThreadLocal));
  const msa::Status captured = msa::paged_forward(fp);
  CUDA_CHECK(cudaStreamEndCapture(st.get(), &graph));
  require_ok(captured);
  cudaGraphExec_t exec = nullptr;
  CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));

  for (PagedBatch* b : {&b1, &b2}) {
    // New contents in the same device buffers (b2's cache fits in b1's pages: same or fewer rows used).
    auto put = [&](DeviceTensor& dst, HostTensor& src) {
      ASSERT_LE(src.numel() * msa::dtype_size(src.dtype()), static_cast<int64_t>(
          dst.ref().numel() * msa::dtype_size(dst.ref().dtype)));
      CUDA_CHECK(cudaMemcpyAsync(dst.ref().data, src.ref().data, src.numel() * msa::dtype_size(src.dtype()),
                                 cudaMemcpyHostToDevice, st.get()));
    };
    HostTensor pt(DType::kInt32, {b1.nseq, b1.max_pages});
    pt.fill(-1);
    for (int64_t s = 0; s < b->nseq; ++s)
      for (size_t x = 0; x < b->table[s].size(); ++x) pt.set(s * b1.max_pages + x, b->table[s][x]);
    put(d.q, b->q);
    put(d.q_idx, b->q_idx);
    put(d.seq_lens, b->seq_lens);
    put(d.cu_q, b->cu_q);
    put(d.page_table, pt);
    put(d.k, b->kc);
    put(d.v, b->vc);
    put(d.k_idx, b->kic);
    CUDA_CHECK(cudaGraphLaunch(exec, st.get()));
    HostTensor sel = bi.download(st.get());
    const IndexScores sc(b->full);
    const Failures fs = check_selection(b->full, sc, to_full_rows(sel, *b, -1), nullptr, b->new_rows);
    EXPECT_EQ(fs.count, 0) << "replayed selection:" << fs.first;
    const FwdResult want = cpu_paged_forward(b->cs, *b, &sel, Mode::kSparse);
    HostTensor no_lse(DType::kFloat32, {b->Tq, c1.Hq});
    no_lse.fill(0);
    FwdResult w = want;
    w.lse = no_lse;
    expect_forward_close(out.download(st.get()), no_lse, w, c1.dtype, "replayed paged_forward");
  }
  CUDA_CHECK(cudaGraphExecDestroy(exec));
  CUDA_CHECK(cudaGraphDestroy(graph));
}

// Decode (max_q_len 4): paged_attn_kernel.
TEST(CudaPaged, GraphReplayWithNewLengthsAndPages) {
  SKIP_WITHOUT_CUDA();
  const PagedCase c1 = paged_gpu_case({5000, 300, 129}, {4, 4, 1}, 32, 2, 2, 1, 128, 128, 8, kBf16, 4, 31);
  PagedCase c2 = c1;
  c2.lens = {4000, 700, 257};
  c2.nq = {2, 4, 3};
  c2.seed = 32;
  graph_replay_with_new_lengths_and_pages(c1, c2);
}

// Prefill chunks (max_q_len 0): the query-tile forward over the page table.
TEST(CudaPaged, PrefillGraphReplayWithNewLengthsAndPages) {
  SKIP_WITHOUT_CUDA();
  const PagedCase c1 = paged_gpu_case({5000, 300, 129}, {300, 24, 1}, 32, 2, 2, 1, 128, 128, 8, kBf16, 0, 33);
  PagedCase c2 = c1;
  c2.lens = {4000, 700, 257};
  c2.nq = {70, 200, 55};
  c2.seed = 34;
  graph_replay_with_new_lengths_and_pages(c1, c2);
}

// ---- float8 E4M3 caches on the GPU (docs/contract.md §6) ----------------------------------------
//
// A call over E4M3 caches must compute what it computes over the dequantised caches
// float32(value * scale[page]), up to the order of fp32 roundings: the oracle is the CPU backend
// over a float64 twin of the batch whose caches (and contiguous problem) hold the dequantised
// values, with the 16-bit queries' values. The unused page rows stay NaN codes.

constexpr DType kE4M3 = DType::kFloat8E4M3;

void copy_values(const HostTensor& src, HostTensor& dst) {
  for (int64_t x = 0; x < src.numel(); ++x) dst.set(x, src.get(x));
}

struct E4M3Caches {
  HostTensor k, v, k_idx;  // codes [pages, Bk, H, n]
  HostTensor ks, vs, kis;  // float32 scales [pages] or [1]
};

// b's caches as the E4M3 codes nearest to value / scale (scales drawn in [0.004, 0.02], so the
// codes span the format, saturation included), per page or one per tensor; w (b's float64
// twin) gets the dequantised caches and contiguous K, V, k_idx, and b's 16-bit queries.
// The values of the 256 codes (harness.h: the format's definition), and the nearest code of x
// (ties to the even code, saturated to +-448, NaN to 0x7f) by a binary search over the positive
// codes' increasing values: harness.h's exhaustive e4m3_code, fast enough for whole caches.
const std::vector<double>& e4m3_values() {
  static const std::vector<double> v = [] {
    std::vector<double> t(256);
    for (int c = 0; c < 256; ++c) t[c] = e4m3_value(static_cast<uint8_t>(c));
    return t;
  }();
  return v;
}
uint8_t nearest_e4m3(double x) {
  if (std::isnan(x)) return 0x7f;
  const std::vector<double>& v = e4m3_values();
  const double a = std::min(std::fabs(x), 448.0);
  int c = static_cast<int>(std::lower_bound(v.begin(), v.begin() + 127, a) - v.begin());  // v[c] >= a
  if (c > 0) {
    const double below = a - v[c - 1], above = v[c] - a;
    if (below < above || (below == above && (c - 1) % 2 == 0)) --c;
  }
  return static_cast<uint8_t>((std::signbit(x) ? 0x80 : 0) | c);
}

// v_spread > 0: page p's V scale is also multiplied by 2^(v_spread * (p % 5 - 2)), so that
// the V scales of a selection lie far apart.
E4M3Caches quantise(const PagedBatch& b, PagedBatch& w, bool per_page, uint64_t seed, int v_spread = 0) {
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<double> u(0.004, 0.02);
  auto one = [&](const HostTensor& src, HostTensor& deq, HostTensor& codes, HostTensor& scale, int spread = 0) {
    const int64_t pages = src.shape()[0], per = src.numel() / pages;
    codes = HostTensor(kE4M3, src.shape());
    scale = HostTensor(DType::kFloat32, {per_page ? pages : 1});
    for (int64_t p = 0; p < scale.numel(); ++p)
      scale.set(p, std::ldexp(u(rng), spread * static_cast<int>(p % 5 - 2)));
    uint8_t* out = static_cast<uint8_t*>(codes.ref().data);
    for (int64_t x = 0; x < src.numel(); ++x) {
      const float sc = static_cast<float>(scale.get(per_page ? x / per : 0));
      out[x] = nearest_e4m3(src.get(x) / sc);
      deq.set(x, static_cast<double>(static_cast<float>(e4m3_values()[out[x]]) * sc));
    }
  };
  E4M3Caches c;
  one(b.kc, w.kc, c.k, c.ks);
  one(b.vc, w.vc, c.v, c.vs, v_spread);
  one(b.kic, w.kic, c.k_idx, c.kis);
  const PagedCase& cs = b.cs;
  const int64_t row = int64_t{cs.Hkv} * cs.D, irow = int64_t{cs.Hik} * cs.Di;
  for (int64_t s = 0; s < w.nseq; ++s)
    for (int64_t x = 0; x < cs.lens[s]; ++x) {
      const int64_t g = w.full.offsets[s] + x, cr = w.cache_row(s, x);
      for (int64_t e = 0; e < row; ++e) {
        w.full.k.set(g * row + e, w.kc.get(cr * row + e));
        w.full.v.set(g * row + e, w.vc.get(cr * row + e));
      }
      for (int64_t e = 0; e < irow; ++e) w.full.k_idx.set(g * irow + e, w.kic.get(cr * irow + e));
    }
  copy_values(b.q, w.q);
  copy_values(b.q_idx, w.q_idx);
  copy_values(b.full.q, w.full.q);
  copy_values(b.full.q_idx, w.full.q_idx);
  return c;
}

PagedCase wide_case(PagedCase c) {
  c.dtype = DType::kFloat64;
  return c;
}

// The device copies of a batch with E4M3 caches.
struct DeviceE4M3 {
  DeviceTensor q, q_idx, k, v, k_idx, page_table, seq_lens, cu_q, ks, vs, kis;
  DeviceE4M3(PagedBatch& b, E4M3Caches& c, cudaStream_t s)
      : q(DeviceTensor::upload(b.q, s)), q_idx(DeviceTensor::upload(b.q_idx, s)), k(DeviceTensor::upload(c.k, s)),
        v(DeviceTensor::upload(c.v, s)), k_idx(DeviceTensor::upload(c.k_idx, s)),
        page_table(DeviceTensor::upload(b.page_table, s)), seq_lens(DeviceTensor::upload(b.seq_lens, s)),
        cu_q(DeviceTensor::upload(b.cu_q, s)), ks(DeviceTensor::upload(c.ks, s)), vs(DeviceTensor::upload(c.vs, s)),
        kis(DeviceTensor::upload(c.kis, s)) {}
  PagedRefs refs() const {
    return {q.ref(), q_idx.ref(), k.ref(), v.ref(), k_idx.ref(), page_table.ref(), seq_lens.ref(), cu_q.ref()};
  }
  msa::PagedCache with_scales(msa::PagedCache cache) const {
    cache.k_scale = ks.ref();
    cache.v_scale = vs.ref();
    cache.k_idx_scale = kis.ref();
    return cache;
  }
};

// paged_select_blocks on the GPU over the E4M3 index keys of d into bi; returns bi's values.
HostTensor select_on_gpu(const PagedCase& cs, const DeviceE4M3& d, DeviceTensor& bi, cudaStream_t s) {
  msa::PagedSelectParams sp = paged_select_params(cs, d.refs(), bi.ref());
  sp.cache = d.with_scales(sp.cache);
  return paged_select_on_gpu(sp, bi, s);
}

// The CPU backend's paged forward over the dequantised twin w (float64).
FwdResult cpu_forward_over(const PagedCase& cs, PagedBatch& w, HostTensor* bi, Mode mode) {
  FwdResult r{HostTensor(DType::kFloat64, {w.Tq, cs.Hq, cs.D}), HostTensor(DType::kFloat32, {w.Tq, cs.Hq}), {}};
  const PagedRefs refs = host_refs(w);
  expect_ok(msa::paged_forward(paged_forward_params(wide_case(cs), refs, mode, false, bi ? bi->ref() : msa::TensorRef{},
                                                    r.out.ref(), r.lse.ref())));
  return r;
}

const PagedCase kE4M3Cases[] = {
    // decode, paper-like heads, block edges, an empty request (odd seeds: a scale per page)
    paged_gpu_case({1, 127, 128, 129, 4000, 0}, {1, 1, 8, 16, 3, 0}, 32, 2, 2, 1, 128, 128, 4, kBf16, 16, 51),
    // one long sequence: many score chunks, the union split over CTAs; one scale per tensor
    paged_gpu_case({40000}, {1}, 64, 4, 4, 1, 128, 128, 16, kBf16, 1, 52),
    // prefill chunks (the selection and the attention by the training kernels over the codes as
    // 16-bit values), sinks and local blocks
    with_forced(paged_gpu_case({3000, 700, 1}, {600, 200, 1}, 16, 2, 2, 1, 128, 128, 6, kBf16, 0, 53), 1, 2),
    // 16-row score tiles
    paged_gpu_case({2100, 90, 1}, {2, 1, 1}, 8, 2, 2, 1, 128, 128, 5, kBf16, 2, 55),
    paged_gpu_case({900, 65}, {5, 65}, 4, 1, 4, 4, 128, 128, 3, kBf16, 0, 58),
    // the attention's column layout: one token x 16 heads at block edges, 8 tokens x 2 heads
    paged_gpu_case({1, 127, 128, 129, 4000, 0}, {1, 1, 1, 1, 1, 0}, 32, 2, 2, 1, 128, 128, 4, kBf16, 1, 61),
    paged_gpu_case({3000, 200, 5}, {8, 3, 5}, 4, 2, 2, 1, 128, 128, 6, kBf16, 8, 63),
    // other variants (skipped when not built)
    paged_gpu_case({2100, 90}, {16, 16}, 8, 2, 2, 1, 64, 64, 5, kFp16, 16, 57),
    paged_gpu_case({900, 65}, {5, 65}, 4, 1, 4, 4, 128, 64, 3, kBf16, 0, 59),
};

class PagedE4M3CudaVsCpu : public ::testing::TestWithParam<PagedCase> {};

TEST_P(PagedE4M3CudaVsCpu, SelectAndForward) {
  SKIP_WITHOUT_CUDA();
  const PagedCase cs = GetParam();
  SCOPED_TRACE(cs.str());
  SKIP_UNLESS_BUILT(cs.config(), true, true);
  Stream st(true);
  PagedBatch b(cs), w(wide_case(cs));
  E4M3Caches c = quantise(b, w, cs.seed % 2 == 1, cs.seed + 5);
  DeviceE4M3 d(b, c, st.get());
  const PagedRefs r = d.refs();

  // The selection: the contract's rule over the dequantised index keys.
  DeviceTensor bi = DeviceTensor::poisoned(DType::kInt32, {b.Tq, cs.Hi, cs.k}, st.get());
  HostTensor sel = select_on_gpu(cs, d, bi, st.get());
  const Failures fs = check_selection(w.full, IndexScores(w.full), to_full_rows(sel, b, -1), nullptr, b.new_rows);
  EXPECT_EQ(fs.count, 0) << "paged_select_blocks over E4M3 index keys:" << fs.first;

  // Attention over that selection, and dense, against the CPU over the dequantised caches.
  auto forward = [&](Mode mode, bool select, const msa::TensorRef& block_idx, DeviceTensor& out, DeviceTensor& lse) {
    msa::PagedForwardParams fp = paged_forward_params(cs, r, mode, select, block_idx, out.ref(), lse.ref());
    fp.cache = d.with_scales(fp.cache);
    Workspace ws(msa::workspace_size(fp));
    ws.attach(fp);
    fp.launch.stream = st.get();
    require_ok(msa::paged_forward(fp));
    (void)out.download(st.get());
  };
  const FwdResult want = cpu_forward_over(cs, w, &sel, Mode::kSparse);
  DeviceTensor out = DeviceTensor::poisoned(cs.dtype, {b.Tq, cs.Hq, cs.D}, st.get());
  DeviceTensor lse = DeviceTensor::poisoned(DType::kFloat32, {b.Tq, cs.Hq}, st.get());
  forward(Mode::kSparse, false, bi.ref(), out, lse);
  expect_forward_close(out.download(st.get()), lse.download(st.get()), want, cs.dtype, "paged_forward(block_idx), E4M3");

  // The selection inside the call chooses as paged_select_blocks did.
  DeviceTensor bi2 = DeviceTensor::poisoned(DType::kInt32, {b.Tq, cs.Hi, cs.k}, st.get());
  DeviceTensor out2 = DeviceTensor::poisoned(cs.dtype, {b.Tq, cs.Hq, cs.D}, st.get());
  DeviceTensor lse2 = DeviceTensor::poisoned(DType::kFloat32, {b.Tq, cs.Hq}, st.get());
  forward(Mode::kSparse, true, bi2.ref(), out2, lse2);
  EXPECT_EQ(first_difference(bi2.download(st.get()), sel), "") << "paged_forward(select) chose differently";
  expect_forward_close(out2.download(st.get()), lse2.download(st.get()), want, cs.dtype, "paged_forward(select), E4M3");

  const FwdResult dense = cpu_forward_over(cs, w, nullptr, Mode::kDense);
  DeviceTensor out3 = DeviceTensor::poisoned(cs.dtype, {b.Tq, cs.Hq, cs.D}, st.get());
  DeviceTensor lse3 = DeviceTensor::poisoned(DType::kFloat32, {b.Tq, cs.Hq}, st.get());
  forward(Mode::kDense, false, {}, out3, lse3);
  expect_forward_close(out3.download(st.get()), lse3.download(st.get()), dense, cs.dtype, "paged_forward(kDense), E4M3");
}

INSTANTIATE_TEST_SUITE_P(Shapes, PagedE4M3CudaVsCpu, ::testing::ValuesIn(kE4M3Cases),
                         [](const ::testing::TestParamInfo<PagedCase>& i) { return "case" + std::to_string(i.index); });

// FP8 queries of batch b: the E4M3 codes nearest to q / q_scale, with q_scale per (token, head)
// (per_row) or one for the tensor, drawn in [0.004, 0.02] (so the codes span the format); the
// twin w's queries, and its contiguous problem's new rows, get float32(value * q_scale).
struct E4M3Queries {
  HostTensor q8, qs;
};
E4M3Queries quantise_queries(const PagedBatch& b, PagedBatch& w, bool per_row, uint64_t seed) {
  const PagedCase& cs = b.cs;
  E4M3Queries r{HostTensor(kE4M3, b.q.shape()),
                HostTensor(DType::kFloat32, per_row ? std::vector<int64_t>{b.Tq, cs.Hq} : std::vector<int64_t>{1})};
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<double> u(0.004, 0.02);
  for (int64_t x = 0; x < r.qs.numel(); ++x) r.qs.set(x, u(rng));
  uint8_t* codes = static_cast<uint8_t*>(r.q8.ref().data);
  const int64_t qrow = int64_t{cs.Hq} * cs.D;
  for (int64_t x = 0; x < b.q.numel(); ++x) {
    const float sc = static_cast<float>(r.qs.get(per_row ? x / cs.D : 0));
    codes[x] = nearest_e4m3(b.q.get(x) / sc);
    const double deq = static_cast<double>(static_cast<float>(e4m3_values()[codes[x]]) * sc);
    w.q.set(x, deq);
    w.full.q.set(b.new_rows[static_cast<size_t>(x / qrow)] * qrow + x % qrow, deq);
  }
  return r;
}

// A prefill over E4M3 caches by each walk of the training forward (over 16-bit copies of the
// pages' codes, the scaled-keys instances: the query tiles, the KV-block pass, the split, kAuto),
// in one pass and in passes of 97 tokens, sparse over the GPU's selection and dense, each call
// with a poisoned workspace, against the CPU backend over the dequantised caches; with 16-bit
// queries and with FP8 queries (Q8KV8: their codes copied too, each row's q_scale applied to
// its scores; a q_scale per (token, head) in the first case, one for the tensor in the others).
// The bf16 cases' V scales of neighbouring pages lie up to 2^32 apart (quantise's v_spread), so
// each block's values must carry their own page's scale through the online softmax and the merge.
TEST(CudaPagedE4M3, PrefillByEachForwardPass) {
  SKIP_WITHOUT_CUDA();
  const msa::FwdPass passes[] = {msa::FwdPass::kQueryTile, msa::FwdPass::kKvBlock, msa::FwdPass::kSplit,
                                 msa::FwdPass::kAuto};
  bool first = true;
  for (const PagedCase& base : prefill_cases(71)) {
    SCOPED_TRACE(base.str());
    const bool per_row = first;
    first = false;
    if (!kernels_built(base.config(), true, true)) continue;
    Stream st(true);
    const int v_spread = base.dtype == kBf16 ? 8 : 0;
    PagedBatch b(base), w(wide_case(base)), w8(wide_case(base));
    E4M3Caches c = quantise(b, w, true, base.seed + 5, v_spread);
    (void)quantise(b, w8, true, base.seed + 5, v_spread);  // the same codes; w8: FP8 queries
    E4M3Queries q8 = quantise_queries(b, w8, per_row, base.seed + 7);
    DeviceE4M3 d(b, c, st.get());
    DeviceTensor dq8 = DeviceTensor::upload(q8.q8, st.get()), dqs = DeviceTensor::upload(q8.qs, st.get());
    DeviceTensor bi = DeviceTensor::poisoned(DType::kInt32, {b.Tq, base.Hi, base.k}, st.get());
    HostTensor sel = select_on_gpu(base, d, bi, st.get());
    for (const bool fp8_q : {false, true}) {
      SCOPED_TRACE(fp8_q ? (per_row ? "FP8 queries, q_scale [Tq, Hq]" : "FP8 queries, q_scale [1]") : "16-bit queries");
      PagedBatch& twin = fp8_q ? w8 : w;
      const FwdResult sparse = cpu_forward_over(base, twin, &sel, Mode::kSparse);
      const FwdResult dense = cpu_forward_over(base, twin, nullptr, Mode::kDense);
      for (const msa::FwdPass pass : passes) {
        for (const int chunk : {0, 97}) {
          for (const Mode mode : {Mode::kSparse, Mode::kDense}) {
            if (mode == Mode::kDense && pass != msa::FwdPass::kAuto) continue;  // one walk
            PagedCase cs = base;
            cs.fwd_pass = pass;
            cs.fwd_chunk_tokens = chunk;
            SCOPED_TRACE("fwd_pass " + std::to_string(static_cast<int>(pass)) + ", fwd_chunk_tokens " +
                         std::to_string(chunk) + (mode == Mode::kDense ? ", kDense" : ", kSparse"));
            DeviceTensor out = DeviceTensor::poisoned(cs.dtype, {b.Tq, cs.Hq, cs.D}, st.get());
            DeviceTensor lse = DeviceTensor::poisoned(DType::kFloat32, {b.Tq, cs.Hq}, st.get());
            msa::PagedForwardParams fp = paged_forward_params(
                cs, d.refs(), mode, false, mode == Mode::kSparse ? bi.ref() : msa::TensorRef{}, out.ref(), lse.ref());
            fp.cache = d.with_scales(fp.cache);
            if (fp8_q) {
              fp.q = dq8.ref();
              fp.q_scale = dqs.ref();
            }
            const DeviceTensor ws = poisoned_workspace(fp, st.get());
            require_ok(msa::paged_forward(fp));
            expect_forward_close(out.download(st.get()), lse.download(st.get()),
                                 mode == Mode::kSparse ? sparse : dense, cs.dtype, "paged_forward over E4M3 caches");
          }
        }
      }
    }
  }
}

// FP8 scores (select_scores = kFp8, fp8_rerank 0 and 4) in a prefill over an E4M3 k_idx cache
// with a scale per page: the E4M3 copies are those of the dequantised keys float32(code * scale)
// (the cache's codes as 16-bit slots, quantised with their page scale; the re-ranking scores the
// slots times it). The selection, over a poisoned workspace, must follow the contract's rule over
// the tests' own quantiser applied to the dequantised keys, and paged_forward's selection must
// equal paged_select_blocks's.
TEST(CudaPagedE4M3, PrefillFp8Scores) {
  SKIP_WITHOUT_CUDA();
  for (const PagedCase& base : prefill_cases(81)) {
    if (!kernels_built(base.config(), false, true)) continue;
    Stream st(true);
    PagedBatch b(base), w(wide_case(base));
    E4M3Caches c = quantise(b, w, true, base.seed + 5);
    DeviceE4M3 d(b, c, st.get());
    const Problem q8 = fp8_scored(w.full);
    const IndexScores own(w.full), own8(q8);
    for (const int m : {0, 4}) {
      PagedCase cs = base;
      cs.select_scores = msa::SelectScores::kFp8;
      cs.fp8_rerank = m;
      SCOPED_TRACE(cs.str());
      DeviceTensor bi = DeviceTensor::poisoned(DType::kInt32, {b.Tq, cs.Hi, cs.k}, st.get());
      msa::PagedSelectParams ps = paged_select_params(cs, d.refs(), bi.ref());
      ps.cache = d.with_scales(ps.cache);
      const DeviceTensor ws = poisoned_workspace(ps, st.get());
      require_ok(msa::paged_select_blocks(ps));
      const HostTensor got = bi.download(st.get());
      const Failures f = m == 0 ? check_selection(q8, own8, to_full_rows(got, b, -1), nullptr, b.new_rows)
                                : check_selection(w.full, own, to_full_rows(got, b, -1), nullptr, b.new_rows, &own8, m);
      EXPECT_EQ(f.count, 0) << "paged_select_blocks, FP8 scores over an E4M3 k_idx cache:" << f.first;
      DeviceTensor bi2 = DeviceTensor::poisoned(DType::kInt32, {b.Tq, cs.Hi, cs.k}, st.get());
      DeviceTensor out2 = DeviceTensor::poisoned(cs.dtype, {b.Tq, cs.Hq, cs.D}, st.get());
      msa::PagedForwardParams fp = paged_forward_params(cs, d.refs(), Mode::kSparse, true, bi2.ref(), out2.ref(), {});
      fp.cache = d.with_scales(fp.cache);
      Workspace ws2(msa::workspace_size(fp));
      ws2.attach(fp);
      fp.launch.stream = st.get();
      require_ok(msa::paged_forward(fp));
      EXPECT_EQ(first_difference(bi2.download(st.get()), got), "") << "paged_forward's selection";
    }
  }
}

// bf16 queries over E4M3 index keys are scored in float16 where float16 holds a score CTA's
// queries exactly (paged_score_kernel.cuh), in bfloat16 otherwise. Sequence 0's token holds a
// value float16 rounds (2.5 * 2^-24), a token of sequence 1 one it overflows (2^17), sequence 2
// is as drawn: all select by the contract's rule over the dequantised keys (an overflow taken to
// float16 would make that tile's scores inf).
TEST(CudaPagedE4M3, QueriesFloat16CannotHold) {
  SKIP_WITHOUT_CUDA();
  const PagedCase cs = paged_gpu_case({3000, 2000, 900}, {1, 4, 2}, 16, 2, 2, 1, 128, 128, 6, kBf16, 4, 73);
  SKIP_UNLESS_BUILT(cs.config(), true, true);
  Stream st(true);
  PagedBatch b(cs), w(wide_case(cs));
  const int64_t irow = int64_t{cs.Hi} * cs.Di;
  for (auto [t, e, v] : {std::tuple{int64_t{0}, int64_t{5}, std::ldexp(2.5, -24)},
                         std::tuple{int64_t{2}, irow - 1, std::ldexp(1.0, 17)}}) {
    b.q_idx.set(t * irow + e, v);
    b.full.q_idx.set(b.new_rows[static_cast<size_t>(t)] * irow + e, v);
  }
  E4M3Caches c = quantise(b, w, true, 77);
  DeviceE4M3 d(b, c, st.get());
  DeviceTensor bi = DeviceTensor::poisoned(DType::kInt32, {b.Tq, cs.Hi, cs.k}, st.get());
  const HostTensor sel = select_on_gpu(cs, d, bi, st.get());
  const Failures f = check_selection(w.full, IndexScores(w.full), to_full_rows(sel, b, -1), nullptr, b.new_rows);
  EXPECT_EQ(f.count, 0) << "paged_select_blocks, queries float16 cannot hold:" << f.first;
}

// Attention over E4M3 caches with bf16 queries that float16 cannot hold (the score kernel turns
// queries float16 holds into float16; an attention path doing the same without its check would
// fail here): sequence 0's token holds a value float16 rounds (2.5 * 2^-24, KV head 0),
// sequence 1's one it overflows (2^17, KV head 1), sequence 2 is as drawn. The V scales of
// neighbouring pages lie up to 2^64 apart (P times a V scale must keep bfloat16's range). Both
// layouts (max_q_len 1: columns; 4: rows), sparse and dense, against the CPU over the
// dequantised caches.
TEST(CudaPagedE4M3, AttentionQueriesAndScalesFloat16CannotHold) {
  SKIP_WITHOUT_CUDA();
  for (int max_q_len : {1, 4}) {
    const PagedCase cs = paged_gpu_case({3000, 2000, 900}, {1, 1, max_q_len == 1 ? 1 : 4}, 32, 2, 2, 1, 128, 128,
                                        6, kBf16, max_q_len, 83);
    SCOPED_TRACE(cs.str());
    SKIP_UNLESS_BUILT(cs.config(), true, true);
    Stream st(true);
    PagedBatch b(cs), w(wide_case(cs));
    const int64_t qrow = int64_t{cs.Hq} * cs.D;
    for (auto [t, e, v] : {std::tuple{int64_t{0}, int64_t{5}, std::ldexp(2.5, -24)},
                           std::tuple{int64_t{1}, qrow - 1, std::ldexp(1.0, 17)}}) {
      b.q.set(t * qrow + e, v);
      b.full.q.set(b.new_rows[static_cast<size_t>(t)] * qrow + e, v);
    }
    E4M3Caches c = quantise(b, w, true, 85, 16);
    DeviceE4M3 d(b, c, st.get());
    DeviceTensor bi = DeviceTensor::poisoned(DType::kInt32, {b.Tq, cs.Hi, cs.k}, st.get());
    HostTensor sel = select_on_gpu(cs, d, bi, st.get());
    for (Mode mode : {Mode::kSparse, Mode::kDense}) {
      const bool sparse = mode == Mode::kSparse;
      DeviceTensor out = DeviceTensor::poisoned(cs.dtype, {b.Tq, cs.Hq, cs.D}, st.get());
      DeviceTensor lse = DeviceTensor::poisoned(DType::kFloat32, {b.Tq, cs.Hq}, st.get());
      msa::PagedForwardParams fp =
          paged_forward_params(cs, d.refs(), mode, false, sparse ? bi.ref() : msa::TensorRef{}, out.ref(), lse.ref());
      fp.cache = d.with_scales(fp.cache);
      Workspace ws(msa::workspace_size(fp));
      ws.attach(fp);
      fp.launch.stream = st.get();
      require_ok(msa::paged_forward(fp));
      expect_forward_close(out.download(st.get()), lse.download(st.get()),
                           cpu_forward_over(cs, w, sparse ? &sel : nullptr, mode), cs.dtype,
                           sparse ? "paged_forward(block_idx), E4M3" : "paged_forward(kDense), E4M3");
    }
  }
}

// FP8 queries (Q8KV8) over E4M3 caches: q holds the E4M3 codes nearest to q / q_scale, with
// q_scale per (token, head) (drawn in [0.004, 0.02], so the codes span the format) or one for
// the tensor. The oracle is the CPU backend over the dequantised twin whose queries are
// float32(value * q_scale), as the contract defines the call. The column layout (max_q_len 1),
// the row layout (4) and a prefill chunk (0, the training forward over 16-bit copies),
// sparse over the GPU's selection and dense. On the device a q_scale that is not positive is
// named, and a float32 out (the kernels write 16-bit outputs) is refused naming 'out'.
TEST(CudaPagedE4M3, FloatQueriesQ8KV8) {
  SKIP_WITHOUT_CUDA();
  const PagedCase cases[] = {
      paged_gpu_case({3000, 2000, 129, 0}, {1, 1, 1, 0}, 32, 2, 2, 1, 128, 128, 6, kBf16, 1, 91),
      paged_gpu_case({3000, 2000, 900}, {4, 1, 3}, 32, 2, 2, 1, 128, 128, 6, kBf16, 4, 92),
      with_forced(paged_gpu_case({3000, 700, 1}, {600, 200, 1}, 16, 2, 2, 1, 128, 128, 6, kBf16, 0, 93), 1, 2),
      paged_gpu_case({2100, 90}, {2, 16}, 8, 2, 2, 1, 64, 64, 5, kFp16, 16, 94),
  };
  for (const PagedCase& cs : cases) {
    SCOPED_TRACE(cs.str());
    if (!kernels_built(cs.config(), true, true)) continue;  // a variant not in this build
    const bool per_row = cs.seed % 2 == 1;
    SCOPED_TRACE(per_row ? "q_scale [Tq, Hq]" : "q_scale [1]");
    Stream st(true);
    PagedBatch b(cs), w(wide_case(cs));
    E4M3Caches c = quantise(b, w, true, cs.seed + 3);
    E4M3Queries q = quantise_queries(b, w, per_row, cs.seed);
    DeviceE4M3 d(b, c, st.get());
    DeviceTensor dq8 = DeviceTensor::upload(q.q8, st.get()), dqs = DeviceTensor::upload(q.qs, st.get());
    DeviceTensor bi = DeviceTensor::poisoned(DType::kInt32, {b.Tq, cs.Hi, cs.k}, st.get());
    HostTensor sel = select_on_gpu(cs, d, bi, st.get());
    auto params = [&](Mode mode, const msa::TensorRef& out, const msa::TensorRef& lse, const msa::TensorRef& scale) {
      msa::PagedForwardParams fp = paged_forward_params(cs, d.refs(), mode, false,
                                                        mode == Mode::kSparse ? bi.ref() : msa::TensorRef{}, out, lse);
      fp.cache = d.with_scales(fp.cache);
      fp.q = dq8.ref();
      fp.q_scale = scale;
      fp.launch.stream = st.get();
      return fp;
    };
    for (Mode mode : {Mode::kSparse, Mode::kDense}) {
      const bool sparse = mode == Mode::kSparse;
      DeviceTensor out = DeviceTensor::poisoned(cs.dtype, {b.Tq, cs.Hq, cs.D}, st.get());
      DeviceTensor lse = DeviceTensor::poisoned(DType::kFloat32, {b.Tq, cs.Hq}, st.get());
      msa::PagedForwardParams fp = params(mode, out.ref(), lse.ref(), dqs.ref());
      Workspace ws(msa::workspace_size(fp));
      ws.attach(fp);
      require_ok(msa::paged_forward(fp));
      expect_forward_close(out.download(st.get()), lse.download(st.get()),
                           cpu_forward_over(cs, w, sparse ? &sel : nullptr, mode), cs.dtype,
                           sparse ? "paged_forward(block_idx), Q8KV8" : "paged_forward(kDense), Q8KV8");
    }
    // A q_scale of 0 (the last one), and a float32 out.
    HostTensor zero = q.qs;
    zero.set(zero.numel() - 1, 0.0);
    DeviceTensor dzero = DeviceTensor::upload(zero, st.get());
    DeviceTensor out = DeviceTensor::poisoned(cs.dtype, {b.Tq, cs.Hq, cs.D}, st.get());
    msa::PagedForwardParams fp = params(Mode::kDense, out.ref(), {}, dzero.ref());
    Workspace ws(msa::workspace_size(fp));
    ws.attach(fp);
    expect_error(msa::paged_forward(fp), StatusCode::kInvalidArgument, "argument 'q_scale'", "q_scale 0");
    DeviceTensor out32 = DeviceTensor::poisoned(DType::kFloat32, {b.Tq, cs.Hq, cs.D}, st.get());
    fp = params(Mode::kDense, out32.ref(), {}, dqs.ref());
    ws.attach(fp);
    expect_error(msa::paged_forward(fp), StatusCode::kNotSupported, "argument 'out'", "float32 out");
  }
}

// Every code's value through the attention kernel: one cached token per sequence (a softmax over
// one key is exactly 1), so each output row is that token's v row; bfloat16 holds every E4M3
// value, so the outputs equal the codes' values exactly (NaN for the two NaN codes).
TEST(CudaPagedE4M3, EveryCodeDequantises) {
  SKIP_WITHOUT_CUDA();
  PagedCase cs = paged_gpu_case({1, 1}, {1, 1}, 1, 1, 1, 1, 128, 128, 1, kBf16, 1, 61);
  SKIP_UNLESS_BUILT(cs.config(), true, false);
  Stream st(true);
  PagedBatch b(cs), w(wide_case(cs));
  E4M3Caches c = quantise(b, w, false, 1);
  c.ks.set(0, 1.0);
  c.vs.set(0, 1.0);
  std::memset(c.k.ref().data, 0, static_cast<size_t>(c.k.numel()));  // every score 0
  std::vector<uint8_t> raw(static_cast<size_t>(c.v.numel()), 0);
  for (int64_t s = 0; s < 2; ++s)
    for (int64_t e = 0; e < 128; ++e) raw[static_cast<size_t>(b.cache_row(s, 0) * 128 + e)] = static_cast<uint8_t>(s * 128 + e);
  std::memcpy(c.v.ref().data, raw.data(), raw.size());
  DeviceE4M3 d(b, c, st.get());
  DeviceTensor out = DeviceTensor::poisoned(kBf16, {2, 1, 128}, st.get());
  msa::PagedForwardParams fp = paged_forward_params(cs, d.refs(), Mode::kDense, false, {}, out.ref(), {});
  fp.cache = d.with_scales(fp.cache);
  fp.cache.k_idx = {};
  fp.cache.k_idx_scale = {};
  fp.launch.stream = st.get();
  Workspace ws(msa::workspace_size(fp));
  ws.attach(fp);
  require_ok(msa::paged_forward(fp));
  const HostTensor got = out.download(st.get());
  int bad = 0;
  for (int code = 0; code < 256; ++code) {
    const double want = e4m3_value(static_cast<uint8_t>(code)), g = got.get(code);
    const bool ok = std::isnan(want) ? std::isnan(g) : g == want;
    if (!ok && bad++ < 5) ADD_FAILURE() << "code " << code << ": got " << g << ", want " << want;
  }
  EXPECT_EQ(bad, 0);
}

// paged_append into E4M3 caches from bfloat16, float16 and float32 rows: the codes the CPU
// backend writes (the nearest code of float32(x) / scale[page], ties to even, saturated, NaN kept),
// scales per page (k, v) and per tensor (k_idx).
TEST(CudaPagedE4M3, AppendMatchesCpu) {
  SKIP_WITHOUT_CUDA();
  const PagedCase cs = paged_gpu_case({300, 5, 129}, {17, 5, 1}, 16, 2, 2, 1, 128, 128, 4, kBf16, 0, 21);
  for (DType in : {kBf16, kFp16, DType::kFloat32}) {
    SCOPED_TRACE(msa::dtype_name(in));
    Stream st(true);
    PagedBatch b(cs);
    std::mt19937_64 rng(7);
    std::uniform_real_distribution<double> u(-60.0, 60.0);
    HostTensor kn(in, {b.Tq, cs.Hkv, cs.D}), vn(in, {b.Tq, cs.Hkv, cs.D}), kin(in, {b.Tq, cs.Hik, cs.Di});
    for (HostTensor* t : {&kn, &vn, &kin})
      for (int64_t x = 0; x < t->numel(); ++x) t->set(x, u(rng));
    kn.set(0, 3e4);    // saturates
    kn.set(1, -3e4);
    vn.set(2, NAN);    // stays NaN
    kin.set(0, 0.125 * 1.0625);                     // a tie under scale 1/8: to the even code 1
    kin.set(1, 0.125 * 1.1875);                     // a tie: 1.25
    kin.set(2, 0.125 * std::ldexp(1.0, -10));       // a tie between 0 and the least subnormal: 0
    kin.set(3, -0.125 * 3.0 * std::ldexp(1.0, -10));  // -2^-8
    HostTensor kc(kE4M3, b.kc.shape()), vc(kE4M3, b.vc.shape()), kic(kE4M3, b.kic.shape());
    HostTensor ks(DType::kFloat32, {b.pages}), vs(DType::kFloat32, {b.pages}), kis(DType::kFloat32, {1});
    for (int64_t p = 0; p < b.pages; ++p) {
      ks.set(p, 0.05 + 0.01 * p);
      vs.set(p, 0.3 / (1 + p));
    }
    kis.set(0, 0.125);
    DevicePaged d(b, st.get());
    DeviceTensor dkc = DeviceTensor::upload(kc, st.get()), dvc = DeviceTensor::upload(vc, st.get()),
                 dkic = DeviceTensor::upload(kic, st.get()), dks = DeviceTensor::upload(ks, st.get()),
                 dvs = DeviceTensor::upload(vs, st.get()), dkis = DeviceTensor::upload(kis, st.get()),
                 dk = DeviceTensor::upload(kn, st.get()), dv = DeviceTensor::upload(vn, st.get()),
                 dki = DeviceTensor::upload(kin, st.get());
    msa::PagedAppendParams ap;
    ap.k = dk.ref();
    ap.v = dv.ref();
    ap.k_idx = dki.ref();
    ap.cu_seqlens_q = d.cu_q.ref();
    ap.cache = cache_of(d.refs());
    ap.cache.k = dkc.ref();
    ap.cache.v = dvc.ref();
    ap.cache.k_idx = dkic.ref();
    ap.cache.k_scale = dks.ref();
    ap.cache.v_scale = dvs.ref();
    ap.cache.k_idx_scale = dkis.ref();
    ap.block_size = cs.Bk;
    ap.launch.stream = st.get();
    require_ok(msa::paged_append(ap));
    msa::PagedAppendParams hp = ap;
    const PagedRefs h = host_refs(b);
    hp.k = kn.ref();
    hp.v = vn.ref();
    hp.k_idx = kin.ref();
    hp.cu_seqlens_q = h.cu_q;
    hp.cache = cache_of(h);
    hp.cache.k = kc.ref();
    hp.cache.v = vc.ref();
    hp.cache.k_idx = kic.ref();
    hp.cache.k_scale = ks.ref();
    hp.cache.v_scale = vs.ref();
    hp.cache.k_idx_scale = kis.ref();
    hp.launch = {};
    expect_ok(msa::paged_append(hp));
    auto same = [&](const HostTensor& got, const HostTensor& want, const char* what) {
      int64_t bad = 0;
      for (int64_t x = 0; x < want.numel(); ++x) {
        const double g = got.get(x), e = want.get(x);
        if (!(g == e || (std::isnan(g) && std::isnan(e))) && bad++ < 5)
          ADD_FAILURE() << what << " element " << x << ": got " << g << ", want " << e;
      }
      EXPECT_EQ(bad, 0) << what;
    };
    same(dkc.download(st.get()), kc, "k cache");
    same(dvc.download(st.get()), vc, "v cache");
    same(dkic.download(st.get()), kic, "k_idx cache");
    const int64_t first = b.cache_row(0, cs.lens[0] - cs.nq[0]);
    EXPECT_EQ(kc.get(first * cs.Hkv * cs.D), 448.0);  // the CPU side of the comparison saturates
    EXPECT_EQ(kic.get(first * cs.Di + 1), 1.25);
  }
}

// Equal block scores: the index keys of every cached row depend only on its logical block (three
// levels), so whole groups of blocks score exactly alike and the k-th best is shared by several:
// the GPU must take the lowest block ids among them as the CPU does (contract §2), over bf16 and
// E4M3 index keys. In the second case every block of a 140K-token request scores the same, more
// ties than the top-k's threshold pass ranks (paged_topk_kernel.cuh), so its radix pass decides.
TEST(CudaPaged, EqualScoresTakeTheLowestBlocks) {
  SKIP_WITHOUT_CUDA();
  const PagedCase three =
      with_forced(paged_gpu_case({3000, 1500, 700}, {1, 4, 2}, 16, 2, 2, 1, 128, 128, 8, kBf16, 4, 71), 1, 2);
  const PagedCase one = with_forced(paged_gpu_case({140000, 300}, {2, 1}, 16, 2, 2, 1, 128, 128, 8, kBf16, 4, 72), 1, 2);
  SKIP_UNLESS_BUILT(three.config(), true, true);
  Stream st(true);
  for (auto [cs, levels, e4m3] : {std::tuple{three, 3, false}, std::tuple{three, 3, true},
                                  std::tuple{one, 1, false}, std::tuple{one, 1, true}}) {
    SCOPED_TRACE(std::string(e4m3 ? "E4M3 index keys, " : "bf16 index keys, ") + std::to_string(levels) + " levels");
    PagedBatch b(cs);
    const int64_t irow = int64_t{cs.Hik} * cs.Di;
    for (int64_t s = 0; s < b.nseq; ++s)
      for (int64_t x = 0; x < cs.lens[s]; ++x)
        for (int64_t e = 0; e < irow; ++e) b.kic.set(b.cache_row(s, x) * irow + e, 0.25 * ((x / cs.Bk) % levels));
    HostTensor codes(kE4M3, b.kic.shape()), scale(DType::kFloat32, {1});
    scale.set(0, 1.0 / 32);
    uint8_t* raw = static_cast<uint8_t*>(codes.ref().data);
    for (int64_t x = 0; x < codes.numel(); ++x) raw[x] = nearest_e4m3(b.kic.get(x) * 32);  // exact: 0, 8, 16
    // The CPU's choice over the same cache.
    HostTensor want(DType::kInt32, {b.Tq, cs.Hi, cs.k});
    PagedRefs h = host_refs(b);
    if (e4m3) h.k_idx = codes.ref();
    msa::PagedSelectParams hp = paged_select_params(cs, h, want.ref());
    if (e4m3) hp.cache.k_idx_scale = scale.ref();
    expect_ok(msa::paged_select_blocks(hp));
    DevicePaged d(b, st.get());
    DeviceTensor dcodes = DeviceTensor::upload(codes, st.get()), dscale = DeviceTensor::upload(scale, st.get());
    PagedRefs r = d.refs();
    if (e4m3) r.k_idx = dcodes.ref();
    DeviceTensor bi = DeviceTensor::poisoned(DType::kInt32, {b.Tq, cs.Hi, cs.k}, st.get());
    msa::PagedSelectParams sp = paged_select_params(cs, r, bi.ref());
    if (e4m3) sp.cache.k_idx_scale = dscale.ref();
    Workspace ws(msa::workspace_size(sp));
    ws.attach(sp);
    sp.launch.stream = st.get();
    require_ok(msa::paged_select_blocks(sp));
    EXPECT_EQ(first_difference(bi.download(st.get()), want), "");
  }
}

// Scales that are zero, negative, infinite or NaN on the device are reported naming the scale.
TEST(CudaPagedE4M3, BadScalesNameTheArgument) {
  SKIP_WITHOUT_CUDA();
  const PagedCase cs = paged_gpu_case({300, 130}, {3, 2}, 16, 2, 2, 1, 128, 128, 4, kBf16, 4, 22);
  SKIP_UNLESS_BUILT(cs.config(), true, true);
  Stream st(false);
  PagedBatch b(cs), w(wide_case(cs));
  E4M3Caches c = quantise(b, w, true, 3);
  for (double bad : {0.0, -1.0, static_cast<double>(NAN), static_cast<double>(INFINITY)}) {
    for (int which = 0; which < 3; ++which) {
      E4M3Caches e = c;
      HostTensor& scale = which == 0 ? e.ks : (which == 1 ? e.vs : e.kis);
      scale.set(scale.numel() - 1, bad);
      DeviceE4M3 d(b, e, st.get());
      DeviceTensor out = DeviceTensor::poisoned(cs.dtype, {b.Tq, cs.Hq, cs.D}, st.get());
      DeviceTensor bi = DeviceTensor::poisoned(DType::kInt32, {b.Tq, cs.Hi, cs.k}, st.get());
      msa::PagedForwardParams fp = paged_forward_params(cs, d.refs(), Mode::kSparse, true, bi.ref(), out.ref(), {});
      fp.cache = d.with_scales(fp.cache);
      Workspace ws(msa::workspace_size(fp));
      ws.attach(fp);
      const char* arg = which == 0 ? "argument 'cache.k_scale'" : (which == 1 ? "argument 'cache.v_scale'"
                                                                              : "argument 'cache.k_idx_scale'");
      expect_error(msa::paged_forward(fp), StatusCode::kInvalidArgument, arg, std::string(arg) + " " + std::to_string(bad));
    }
  }
}

}  // namespace
}  // namespace msatest
