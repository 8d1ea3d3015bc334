// Shared pieces of the CPU backend: strided row access, dot products in double, the support of
// a (token, index head) row (contract §3: its selected blocks, or every causal block in kDense mode)
// and the reverse index (for a key block, the rows whose support holds it).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "../core/problem.h"
#include "msa/params.h"
#include "numeric.h"
#include "parallel.h"

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

// Row layout of the packed batch: sequence of each query row, first query row, key row and
// block of each sequence. Sequence s has key_len(s) keys (rows cu_k[s] ..) and its queries (rows
// cu[s] ..) are its last positions, from start(s) on (0 unless keys are apart from queries).
struct Layout {
  std::vector<int64_t> cu;          // query offsets [nseq + 1]
  std::vector<int64_t> cu_k;        // key offsets [nseq + 1] (cu unless keys are apart)
  std::vector<int32_t> seq_of;      // [T]
  std::vector<int64_t> block_base;  // [nseq + 1]: first global block id of each sequence
  std::vector<int32_t> seq_of_block;  // [num_blocks()]
  int32_t Bk = 1;

  Layout(const Problem& prob);
  int64_t num_blocks() const { return block_base.back(); }
  int64_t key_len(int64_t s) const { return cu_k[s + 1] - cu_k[s]; }
  // Position of sequence s's first query, and of query row g; query row of position t of s.
  int64_t start(int64_t s) const { return key_len(s) - (cu[s + 1] - cu[s]); }
  int64_t pos(int64_t g) const { return start(seq_of[g]) + g - cu[seq_of[g]]; }
  int64_t query_row(int64_t s, int64_t t) const { return cu[s] + t - start(s); }
};

// Which key blocks a (token, index head) row attends to.
class Support {
 public:
  // `block_idx` is ignored in kDense mode.
  Support(const Problem& prob, const Layout& layout, const TensorRef& block_idx);

  // Blocks of row (global token g, index head i) in ascending order.
  void blocks(int64_t g, int32_t i, std::vector<int32_t>* out) const;

  // Local key positions j <= t of the row (t its position), ascending.
  void keys(int64_t g, int32_t i, std::vector<int64_t>* out) const;

  // Reverse index: positions t of the query rows (of index head i, in the sequence of global
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

// Local key positions j <= t of `blocks` (ascending block ids of Bk keys), ascending.
void keys_of_blocks(const std::vector<int32_t>& blocks, int64_t t, int32_t Bk, std::vector<int64_t>* out);

// Contract §2's token and block scores of one (query, index head) row: the query at position t
// of its sequence scores the keys 0 .. t, `key_row(j)` being key j's index key row (Di elements),
// with `scale_idx`: score[j] for j <= t, and block_max[b], M(t, b), for b <= blk(t) (NaN ranks
// as -inf).
template <class E, class KeyRow>
void block_maxima(int32_t Di, int32_t Bk, double scale_idx, const E* q_row, int64_t t, const KeyRow& key_row,
                  std::vector<double>* score, std::vector<double>* block_max) {
  thread_local std::vector<double> q;
  const int32_t own = static_cast<int32_t>(t / Bk);
  q.resize(Di);
  score->resize(t + 1);
  block_max->resize(own + 1);
  load(q_row, Di, q.data());
  for (int64_t j = 0; j <= t; ++j) (*score)[j] = scale_idx * dot(q.data(), key_row(j), Di);
  for (int32_t b = 0; b <= own; ++b) {
    double m = -std::numeric_limits<double>::infinity();
    const int64_t end = std::min<int64_t>(static_cast<int64_t>(b + 1) * Bk, t + 1);
    for (int64_t j = static_cast<int64_t>(b) * Bk; j < end; ++j)
      if (!std::isnan((*score)[j])) m = std::max(m, (*score)[j]);
    (*block_max)[b] = m;
  }
}

// Contract §2's choice for the query at position t from its block scores `rank` (M(t, b), b <=
// blk(t)): the forced blocks, then the other slots by score (ties to the lower block index), as
// ascending ids in *chosen. With `rerank` (kFp8 with fp8_rerank = m > 0: the inputs' own block
// scores), the best (slots + m) candidates by `rank` are ranked again by `rerank`; with
// o.fp8_rerank_slots = a in (0, slots) only the last a slots are: the best (slots - a) by `rank`
// are kept and the next (a + m) ranked again.
void choose_blocks(const Options& o, int32_t k, int64_t t, const std::vector<double>& rank,
                   const std::vector<double>* rerank, int32_t m, std::vector<int32_t>* chosen);

// The k entries of a block_idx row from ascending ids: out[0], out[stride], ..., then -1.
void write_row(const std::vector<int32_t>& chosen, int32_t k, int32_t* out, int64_t stride);

// log sum exp of score[j] over the keys j <= t of the blocks `chosen`.
double support_logsumexp(const std::vector<double>& score, const std::vector<int32_t>& chosen, int64_t t,
                         int32_t Bk);

// Contract §2 for one (query, index head) row (block_maxima, then choose_blocks): writes the k
// selected block ids (ascending, then -1) to out[0], out[stride], ... and, when `lse_idx` is
// given, the log-normaliser of the index softmax over the selected support. Shared by the
// training selection (contiguous keys) and the serving one (keys in pages).
template <class E, class KeyRow>
void select_row(const Options& o, int32_t k, int32_t Di, double scale_idx, const E* q_row, int64_t t,
                const KeyRow& key_row, int32_t* out, int64_t stride, float* lse_idx) {
  thread_local std::vector<double> score, block_max;
  thread_local std::vector<int32_t> chosen;
  block_maxima(Di, o.block_size, scale_idx, q_row, t, key_row, &score, &block_max);
  choose_blocks(o, k, t, block_max, nullptr, 0, &chosen);
  write_row(chosen, k, out, stride);
  if (lse_idx) *lse_idx = static_cast<float>(support_logsumexp(score, chosen, t, o.block_size));
}

// Contract §2, FP8 scores: the scale of a group whose largest |x| (NaN ignored) is amax, and a
// value's dequantised E4M3 copy under it (one fp32 product, then nearest-even E4M3, saturated).
float fp8_scale(float amax);
double fp8_value(float x, float s);

// The largest |x| of a row of Di values and `a` (NaN never compares greater).
template <class E>
float abs_max(float a, const E* row, int32_t Di) {
  for (int32_t d = 0; d < Di; ++d) {
    const float x = std::fabs(static_cast<float>(to_double(row[d])));
    if (x > a) a = x;
  }
  return a;
}

// A row of Di values as its dequantised E4M3 copy under scale s.
template <class E>
void fp8_copy_row(const E* row, int32_t Di, float s, double* out) {
  for (int32_t d = 0; d < Di; ++d) out[d] = fp8_value(static_cast<float>(to_double(row[d])), s);
}

// The dequantised E4M3 copies of q_idx's T x Hi rows (a group per row) into *out, [T, Hi, Di].
template <class E>
void fp8_copy_queries(const Problem& prob, const Rows<const E>& q_idx, std::vector<double>* out) {
  const int32_t Di = prob.Di;
  out->resize(static_cast<size_t>(prob.T) * prob.Hi * Di);
  parallel_for(prob.T, [&](int64_t g, int) {
    for (int32_t i = 0; i < prob.Hi; ++i) {
      const E* row = q_idx.row(g, i);
      fp8_copy_row(row, Di, fp8_scale(abs_max(0.f, row, Di)), out->data() + (g * prob.Hi + i) * Di);
    }
  });
}

// The dequantised E4M3 copy of the `n` key rows key_row(j0) .. key_row(j0 + n - 1) (one group:
// a block of one sequence and index key head) into out[(j - j0) * stride ...].
template <class KeyRow>
void fp8_copy_block(int32_t Di, int64_t j0, int64_t n, const KeyRow& key_row, double* out, int64_t stride) {
  float amax = 0.f;
  for (int64_t j = j0; j < j0 + n; ++j) amax = abs_max(amax, key_row(j), Di);
  const float sc = fp8_scale(amax);
  for (int64_t j = j0; j < j0 + n; ++j) fp8_copy_row(key_row(j), Di, sc, out + (j - j0) * stride);
}

// Contract §2 for one row with FP8 scores: the copies' block maxima (q8_row, key_row8(j): the
// dequantised E4M3 copies) rank, and with fp8_rerank > 0 shortlist for the inputs' own scores
// (q_row, key_row(j)), which also give lse_idx when it is asked for.
template <class E, class KeyRow, class KeyRow8>
void select_row_fp8(const Options& o, int32_t k, int32_t Di, double scale_idx, const double* q8_row, const E* q_row,
                    int64_t t, const KeyRow& key_row, const KeyRow8& key_row8, int32_t* out, int64_t stride,
                    float* lse_idx) {
  thread_local std::vector<double> score, block_max, score8, block_max8;
  thread_local std::vector<int32_t> chosen;
  const int32_t m = o.fp8_rerank;
  block_maxima(Di, o.block_size, scale_idx, q8_row, t, key_row8, &score8, &block_max8);
  if (m > 0 || lse_idx) block_maxima(Di, o.block_size, scale_idx, q_row, t, key_row, &score, &block_max);
  choose_blocks(o, k, t, block_max8, m > 0 ? &block_max : nullptr, m, &chosen);
  write_row(chosen, k, out, stride);
  if (lse_idx) *lse_idx = static_cast<float>(support_logsumexp(score, chosen, t, o.block_size));
}

// Contract §3 for one (query, query head) row over the key positions `keys`: `key_row(j)` and
// `val_row(j)` are key j's rows of the query head's KV head (D elements). Writes out_row and,
// when given, *lse (-inf and a zero row for an empty support).
// (q_row may have another element type than out_row: dequantised FP8 queries are float32.)
template <class QE, class E, class KeyRow, class ValRow>
void attend_row(int32_t D, double scale, const QE* q_row, const std::vector<int64_t>& keys, const KeyRow& key_row,
                const ValRow& val_row, E* out_row, float* lse) {
  thread_local std::vector<double> q, a, acc;
  q.resize(D);
  acc.assign(D, 0.0);
  a.resize(keys.size());
  load(q_row, D, q.data());
  for (size_t j = 0; j < keys.size(); ++j) a[j] = scale * dot(q.data(), key_row(keys[j]), D);
  const double l = logsumexp(a.data(), a.size());
  for (size_t j = 0; j < keys.size(); ++j) axpy(std::exp(a[j] - l), val_row(keys[j]), D, acc.data());
  store(acc.data(), D, out_row);
  if (lse) *lse = static_cast<float>(l);
}

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
