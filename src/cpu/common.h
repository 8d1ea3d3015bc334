// Shared pieces of the CPU backend: strided row access, dot products in double, the support of
// a (token, index head) row (contract §3: its selected blocks, or every causal block in kDense mode)
// and the reverse index (for a key block, the rows whose support holds it).
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

#include "../core/problem.h"
#include "msa/params.h"
#include "numeric.h"

namespace msa::cpu {

using detail::Problem;

// A rank-3 tensor [T, H, n] seen as rows of n contiguous elements.
template <class E>
struct Rows {
  E* base = nullptr;
  int64_t s0 = 0, s1 = 0;
  E* row(int64_t t, int64_t h) const { return base + t * s0 + h * s1; }
};

template <class E>
Rows<E> rows(const TensorRef& t) {
  return {static_cast<E*>(t.data), t.stride[0], t.stride[1]};
}

// A rank-2 fp32 tensor [T, H].
struct Mat {
  float* base = nullptr;
  int64_t s0 = 0, s1 = 0;
  float& at(int64_t t, int64_t h) const { return base[t * s0 + h * s1]; }
};
inline Mat mat(const TensorRef& t) { return {static_cast<float*>(t.data), t.stride[0], t.stride[1]}; }

template <class E>
void load(const E* src, int n, double* dst) {
  for (int d = 0; d < n; ++d) dst[d] = to_double(src[d]);
}

template <class E>
void store(const double* src, int n, E* dst) {
  for (int d = 0; d < n; ++d) dst[d] = from_double<E>(src[d]);
}

template <class E>
double dot(const double* a, const E* b, int n) {
  double acc = 0.0;
  for (int d = 0; d < n; ++d) acc += a[d] * to_double(b[d]);
  return acc;
}

template <class E>
void axpy(double alpha, const E* x, int n, double* y) {
  for (int d = 0; d < n; ++d) y[d] += alpha * to_double(x[d]);
}

// Row layout of the packed batch: sequence of each token, first token and block of each sequence.
struct Layout {
  std::vector<int64_t> cu;          // sequence offsets [nseq + 1]
  std::vector<int32_t> seq_of;      // [T]
  std::vector<int64_t> block_base;  // [nseq + 1]: first global block id of each sequence
  std::vector<int32_t> seq_of_block;  // [num_blocks()]
  int32_t Bk = 1;

  Layout(const Problem& prob);
  int64_t num_blocks() const { return block_base.back(); }
  int64_t seq_len(int64_t s) const { return cu[s + 1] - cu[s]; }
};

// Which key blocks a (token, index head) row attends to.
class Support {
 public:
  // `block_idx` is ignored in kDense mode.
  Support(const Problem& prob, const Layout& layout, const TensorRef& block_idx);

  // Blocks of row (global token g, index head i) in ascending order.
  void blocks(int64_t g, int32_t i, std::vector<int32_t>* out) const;

  // Local key positions j <= t of the row, ascending.
  void keys(int64_t g, int32_t i, std::vector<int64_t>* out) const;

  // Reverse index: local positions t of the rows (of index head i, in the sequence of global
  // block gb) whose support holds block gb, ascending.
  void rows_of_block(int32_t i, int64_t gb, std::vector<int64_t>* out) const;

  bool dense() const { return dense_; }

 private:
  const Layout& layout_;
  bool dense_;
  int32_t k_ = 0;
  const int32_t* bi_ = nullptr;
  int64_t s0_ = 0, s1_ = 0, s2_ = 0;
  // CSR over (i, gb) of local rows t (kSparse only).
  std::vector<int64_t> rev_ptr_;
  std::vector<int32_t> rev_rows_;
};

// Index head count as the loops see it: kDense mode without index tensors has no index heads,
// and then one pseudo head serves every query head.
inline int32_t loop_index_heads(const Problem& p) { return p.Hi > 0 ? p.Hi : 1; }

// sum_j exp(x_j - m) with m = max_j x_j, as log: the natural log-sum-exp, NaN-propagating.
// Returns -inf for an empty set.
double logsumexp(const double* x, size_t n);

// Runs Fn<E>::run(args...) with E the storage type of `dtype`.
template <template <class> class Fn, class... Args>
Status dispatch(DType dtype, Args&&... args) {
  switch (dtype) {
    case DType::kFloat16: Fn<Half>::run(args...); return Status::Ok();
    case DType::kBFloat16: Fn<BFloat16>::run(args...); return Status::Ok();
    case DType::kFloat32: Fn<float>::run(args...); return Status::Ok();
    case DType::kFloat64: Fn<double>::run(args...); return Status::Ok();
    default: return Status::Internal("CPU backend: unexpected dtype");
  }
}

}  // namespace msa::cpu
