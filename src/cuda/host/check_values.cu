// Value checks of GPU inputs (check_values.h).
#include "check_values.h"

#include <algorithm>
#include <atomic>
#include <string>
#include <vector>

#include "../device/grid_dependency.cuh"
#include "../device/tile.cuh"
#include "common.h"

namespace msa::cuda {
namespace {

// The first offence found, as (kind << 56) | index; all ones: none. Slots are taken in turn by
// concurrent calls (each call waits for its verdict before it returns the slot).
constexpr int kSlots = 64;
__device__ unsigned long long g_verdict[kSlots];
constexpr unsigned long long kNone = ~0ull;
// The kinds are in the order of the CPU backend's checks: the smallest verdict is the offence it
// reports.
enum Kind : unsigned long long {
  kCuStart = 0,     // index: 0
  kCuDecrease = 1,  // index: s, cu[s] < cu[s - 1]
  kCuEnd = 2,       // index: nseq
  // keys apart (cu_k = cu_seqlens_k)
  kKeyStart = 3,     // index: 0
  kKeyDecrease = 4,  // index: s, cu_k[s] < cu_k[s - 1]
  kKeyEnd = 5,       // index: nseq
  kKeyShort = 6,     // index: s, m_s < n_s
  kBlockRange = 7,  // index: flat entry (t * Hi + i) * k + j
  kBlockTwice = 8,  // index: flat entry of the second occurrence
  // paged calls (cu = cu_seqlens_q)
  kLenShort = 9,    // index: s, seq_lens[s] < n_s
  kLenLong = 10,    // index: s, seq_lens[s] > max_pages * Bk
  kQLen = 11,       // index: s, n_s > max_q_len
  kPage = 12,       // index: s * max_pages + b, a used page id outside [0, pages)
  kScale = 13,      // kScale + w (k, v, k_idx, q), index: i, scale[i] not finite and positive
};

__device__ void report(unsigned long long* verdict, Kind kind, long long index) {
  atomicMin(verdict, (static_cast<unsigned long long>(kind) << 56) | static_cast<unsigned long long>(index));
}

// Keys apart (cu_k, Tk keys; null: the tokens are the keys): sequence s's tokens start at key
// position m_s - n_s (clamped values: a bad cu or cu_k is reported by its own kind).
__device__ int64_t first_position(const int32_t* cu, const int32_t* cu_k, int32_t s, int64_t T, int64_t Tk) {
  if (cu_k == nullptr) return 0;
  const int64_t q0 = cu != nullptr ? kern::clamp_offset(cu[s], 0, T) : 0;
  const int64_t n = (cu != nullptr ? kern::clamp_offset(cu[s + 1], q0, T) : T) - q0;
  const int64_t k0 = kern::clamp_offset(cu_k[s], 0, Tk);
  const int64_t m = kern::clamp_offset(cu_k[s + 1], k0, Tk) - k0;
  return m > n ? m - n : 0;
}

__global__ void check_kernel(const int32_t* cu, int32_t nseq, int64_t T, const int32_t* cu_k, int64_t Tk,
                             const int32_t* bi, int64_t bi_s0, int64_t bi_s1, int32_t Hi, int32_t k,
                             int32_t Bk, unsigned long long* verdict) {
  grid_dependency_begin();
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int64_t first = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (cu != nullptr) {
    for (int64_t s = first; s <= nseq; s += stride) {
      if (s == 0 && cu[0] != 0) report(verdict, kCuStart, 0);
      if (s > 0 && cu[s] < cu[s - 1]) report(verdict, kCuDecrease, s);
      if (s == nseq && cu[s] != T) report(verdict, kCuEnd, s);
    }
  }
  if (cu_k != nullptr) {
    for (int64_t s = first; s <= nseq; s += stride) {
      if (s == 0 && cu_k[0] != 0) report(verdict, kKeyStart, 0);
      if (s > 0 && cu_k[s] < cu_k[s - 1]) report(verdict, kKeyDecrease, s);
      if (s == nseq && cu_k[s] != Tk) report(verdict, kKeyEnd, s);
      if (s < nseq) {
        const int64_t n = cu != nullptr ? int64_t(cu[s + 1]) - cu[s] : T;
        if (int64_t(cu_k[s + 1]) - cu_k[s] < n) report(verdict, kKeyShort, s);
      }
    }
  }
  if (bi == nullptr) return;
  const int64_t n = T * Hi * k;
  for (int64_t e = first; e < n; e += stride) {
    const int64_t t = e / (static_cast<int64_t>(Hi) * k);
    const int32_t rem = static_cast<int32_t>(e - t * Hi * k);
    const int32_t i = rem / k, j = rem - i * k;
    int64_t start = 0;
    int32_t s = 0;
    if (cu != nullptr) {  // the token's sequence (cu clamped: a bad one is reported above)
      int32_t lo = 0, hi = nseq - 1;
      while (lo < hi) {
        const int32_t mid = (lo + hi + 1) >> 1;
        if (kern::clamp_offset(cu[mid], 0, T) <= t) lo = mid; else hi = mid - 1;
      }
      s = lo;
      start = kern::clamp_offset(cu[lo], 0, T);
    }
    const int64_t pos = t - start + first_position(cu, cu_k, s, T, Tk);  // the token's key position
    const int32_t* row = bi + t * bi_s0 + i * bi_s1;
    const int32_t b = row[j];
    if (b < -1 || b > pos / Bk) {
      report(verdict, kBlockRange, e);
    } else if (b >= 0) {
      for (int32_t j2 = 0; j2 < j; ++j2)
        if (row[j2] == b) {
          report(verdict, kBlockTwice, e);
          break;
        }
    }
  }
}


struct PagedCheck {
  const int32_t* cu = nullptr;
  int32_t nseq = 0, Tq = 0;
  const int32_t* lens = nullptr;
  const int32_t* pt = nullptr;
  int64_t pt_s0 = 0;
  int32_t max_pages = 0, pages = 0, Bk = 0, max_q_len = 0;
  const int32_t* bi = nullptr;
  int64_t bi_s0 = 0, bi_s1 = 0;
  int32_t Hi = 0, k = 0;
  // The scales of E4M3 cache tensors (k, v, k_idx) and queries (q_scale; null: none). Scale i
  // of w is scale[w][(i / scale_cols[w]) * scale_s[w] + (i % scale_cols[w]) * scale_s1[w]].
  static constexpr int kScales = 4;
  const float* scale[kScales] = {};
  int64_t scale_n[kScales] = {}, scale_s[kScales] = {}, scale_s1[kScales] = {}, scale_cols[kScales] = {1, 1, 1, 1};
  __host__ __device__ int64_t scale_at(int w, int64_t i) const {
    return i / scale_cols[w] * scale_s[w] + i % scale_cols[w] * scale_s1[w];
  }
};

__global__ void paged_check_kernel(const PagedCheck c, unsigned long long* verdict) {
  grid_dependency_begin();
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int64_t first = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t cap = int64_t(c.max_pages) * c.Bk;
  for (int64_t s = first; s <= c.nseq; s += stride) {
    if (s == 0 && c.cu[0] != 0) report(verdict, kCuStart, 0);
    if (s > 0 && c.cu[s] < c.cu[s - 1]) report(verdict, kCuDecrease, s);
    if (s == c.nseq && c.cu[s] != c.Tq) report(verdict, kCuEnd, s);
    if (s == c.nseq) continue;
    const int64_t n = int64_t(c.cu[s + 1]) - c.cu[s];
    if (c.lens[s] > cap) report(verdict, kLenLong, s);
    else if (c.lens[s] < n || c.lens[s] < 0) report(verdict, kLenShort, s);
    if (c.max_q_len > 0 && n > c.max_q_len) report(verdict, kQLen, s);
  }
  for (int w = 0; w < PagedCheck::kScales; ++w) {
    if (c.scale[w] == nullptr) continue;
    for (int64_t i = first; i < c.scale_n[w]; i += stride) {
      const float x = c.scale[w][c.scale_at(w, i)];
      if (!(isfinite(x) && x > 0.f)) report(verdict, static_cast<Kind>(kScale + w), i);
    }
  }
  const int64_t np = int64_t(c.nseq) * c.max_pages;
  for (int64_t e = first; e < np; e += stride) {
    const int64_t s = e / c.max_pages;
    const int32_t b = static_cast<int32_t>(e % c.max_pages);
    const int64_t len = kern::clamp_offset(c.lens[s], 0, cap);
    if (int64_t(b) * c.Bk >= len) continue;
    const int32_t page = c.pt[s * c.pt_s0 + b];
    if (page < 0 || page >= c.pages) report(verdict, kPage, e);
  }
  if (c.bi == nullptr) return;
  const int64_t n = int64_t(c.Tq) * c.Hi * c.k;
  for (int64_t e = first; e < n; e += stride) {
    const int64_t t = e / (static_cast<int64_t>(c.Hi) * c.k);
    const int32_t rem = static_cast<int32_t>(e - t * c.Hi * c.k);
    const int32_t i = rem / c.k, j = rem - i * c.k;
    const int32_t pos = kern::paged_position(c.cu, c.nseq, c.Tq, c.lens, static_cast<int32_t>(cap), t);
    const int32_t* row = c.bi + t * c.bi_s0 + i * c.bi_s1;
    const int32_t b = row[j];
    if (b < -1 || b > pos / c.Bk) {
      report(verdict, kBlockRange, e);
    } else if (b >= 0) {
      for (int32_t j2 = 0; j2 < j; ++j2)
        if (row[j2] == b) {
          report(verdict, kBlockTwice, e);
          break;
        }
    }
  }
}

std::atomic<unsigned> next_slot{0};

template <class T>
Status read(const char* fn, T* host, const T* dev, size_t n, cudaStream_t stream) {
  cudaError_t e = cudaMemcpyAsync(host, dev, n * sizeof(T), cudaMemcpyDeviceToHost, stream);
  if (e == cudaSuccess) e = cudaStreamSynchronize(stream);
  return e == cudaSuccess ? Status::Ok() : cuda_error(fn, e);
}


// The verdict of one check: refuses a stream being captured (naming 'launch.check_values'; `what`
// says which values), takes a verdict slot, runs launch_check(blocks, verdict) over `work` items
// and waits for the first offence (kNone: none) in *v.
template <class LaunchCheck>
Status run_check(const char* fn, cudaStream_t stream, const char* what, int64_t work,
                 LaunchCheck&& launch_check, unsigned long long* v) {
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  cudaError_t e = cudaStreamIsCapturing(stream, &capture);
  if (e != cudaSuccess) return cuda_error(fn, e);
  if (capture != cudaStreamCaptureStatusNone)
    return detail::invalid_arg(fn, "launch.check_values",
                               std::string("the values of ") + what +
                                   " cannot be checked on a stream that is being captured into a CUDA "
                                   "graph (the check waits for the device): set it to false to capture");
  unsigned long long* slots = nullptr;
  e = cudaGetSymbolAddress(reinterpret_cast<void**>(&slots), g_verdict);
  if (e != cudaSuccess) return cuda_error(fn, e);
  unsigned long long* verdict = slots + next_slot.fetch_add(1) % kSlots;
  e = cudaMemsetAsync(verdict, 0xff, sizeof(unsigned long long), stream);
  if (e != cudaSuccess) return cuda_error(fn, e);
  const int blocks = static_cast<int>(std::min<int64_t>((work + 255) / 256, int64_t(num_sms()) * 16));
  launch_check(blocks, verdict);
  e = cudaGetLastError();
  if (e != cudaSuccess) return cuda_error(fn, e);
  return read(fn, v, verdict, 1, stream);
}

// The message of a kCuStart / kCuDecrease / kCuEnd offence of `arg` (offsets c, ending at T).
Status offsets_error(const char* fn, const char* arg, const char* total, Kind kind, int64_t index,
                     const std::vector<int32_t>& c, int64_t T) {
  const std::string a = arg;
  const int64_t nseq = static_cast<int64_t>(c.size()) - 1;
  if (kind == kCuStart) return detail::invalid_arg(fn, arg, "must start at 0, got " + std::to_string(c[0]));
  if (kind == kCuEnd)
    return detail::invalid_arg(fn, arg, std::string("must end at ") + total + " = " + std::to_string(T) + ", got " +
                                            std::to_string(c[nseq]));
  return detail::invalid_arg(fn, arg, "must be non-decreasing, but " + a + "[" + std::to_string(index) + "] = " +
                                          std::to_string(c[index]) + " < " + a + "[" + std::to_string(index - 1) +
                                          "] = " + std::to_string(c[index - 1]));
}

}  // namespace

Status check_values(const char* fn, const Problem& prob, const TensorRef& cu_seqlens,
                    const TensorRef& cu_seqlens_k, const TensorRef& block_idx, const Launch& launch) {
  if (!launch.check_values || (!cu_seqlens.defined() && !cu_seqlens_k.defined() && !block_idx.defined()))
    return Status::Ok();
  const cudaStream_t stream = static_cast<cudaStream_t>(launch.stream);
  const int32_t* cu = cu_seqlens.defined() ? static_cast<const int32_t*>(cu_seqlens.data) : nullptr;
  const int32_t* cu_k = cu_seqlens_k.defined() ? static_cast<const int32_t*>(cu_seqlens_k.data) : nullptr;
  const int32_t nseq = cu != nullptr ? num_seqs(cu_seqlens) : 1;
  const int32_t* bi = block_idx.defined() ? static_cast<const int32_t*>(block_idx.data) : nullptr;
  const int64_t n = bi != nullptr ? prob.T * prob.Hi * prob.k : 0;
  unsigned long long v = 0;
  MSA_TRY(run_check(
      fn, stream, "cu_seqlens, cu_seqlens_k and block_idx", std::max<int64_t>(n, nseq + 1),
      [&](int blocks, unsigned long long* verdict) {
        launch_grid(check_kernel, blocks, 256, 0, stream, cu, nseq, prob.T, cu_k, prob.Tk, bi,
                    bi ? block_idx.stride[0] : 0, bi ? block_idx.stride[1] : 0, prob.Hi, prob.k,
                    prob.opts.block_size, verdict);
      },
      &v));
  if (v == kNone) return Status::Ok();

  // An offence: read what the message quotes.
  const auto kind = static_cast<Kind>(v >> 56);
  const int64_t index = static_cast<int64_t>(v & ((1ull << 56) - 1));
  const auto bad = [&](const char* arg, const std::string& what) { return detail::invalid_arg(fn, arg, what); };
  if (kind <= kCuEnd) {
    std::vector<int32_t> c(nseq + 1);
    MSA_TRY(read(fn, c.data(), cu, c.size(), stream));
    return offsets_error(fn, "cu_seqlens", "T", kind, index, c, prob.T);
  }
  // The offsets of the queries (T in one sequence without cu_seqlens) and of the keys.
  std::vector<int32_t> cq(nseq + 1, 0), ck;
  if (cu != nullptr) MSA_TRY(read(fn, cq.data(), cu, cq.size(), stream));
  else cq[1] = static_cast<int32_t>(prob.T);
  if (cu_k != nullptr) {
    ck.resize(nseq + 1);
    MSA_TRY(read(fn, ck.data(), cu_k, ck.size(), stream));
  }
  if (kind >= kKeyStart && kind <= kKeyEnd) {
    const Kind as_cu = static_cast<Kind>(kCuStart + (kind - kKeyStart));
    return offsets_error(fn, "cu_seqlens_k", "Tk (the key tensors' rows)", as_cu, index, ck, prob.Tk);
  }
  if (kind == kKeyShort)
    return bad("cu_seqlens_k", "sequence " + std::to_string(index) + " has " +
                                   std::to_string(int64_t(ck[index + 1]) - ck[index]) + " keys, fewer than its " +
                                   std::to_string(int64_t(cq[index + 1]) - cq[index]) +
                                   " queries (cu_seqlens): the queries are the last positions of their sequence's keys");
  const int64_t t = index / (int64_t(prob.Hi) * prob.k);
  const int32_t i = static_cast<int32_t>(index / prob.k % prob.Hi), j = static_cast<int32_t>(index % prob.k);
  int32_t value = 0;
  MSA_TRY(read(fn, &value, bi + t * block_idx.stride[0] + i * block_idx.stride[1] + j, 1, stream));
  if (kind == kBlockTwice)
    return bad("block_idx", "row [" + std::to_string(t) + ", " + std::to_string(i) + "] selects block " +
                                std::to_string(value) + " twice");
  // The token's key position: its place in its sequence, after m_s - n_s keys where they are apart.
  int64_t pos = t;
  for (int32_t s = 0; s < nseq; ++s)
    if (cq[s] <= t) pos = t - cq[s] + (ck.empty() ? 0 : (int64_t(ck[s + 1]) - ck[s]) - (int64_t(cq[s + 1]) - cq[s]));
  return bad("block_idx", "entry [" + std::to_string(t) + ", " + std::to_string(i) + ", " + std::to_string(j) +
                              "] = " + std::to_string(value) + " is out of range: expected -1 or a block in [0, " +
                              std::to_string(pos / prob.opts.block_size) + "] (the token's own block)");
}

Status check_paged_values(const char* fn, const Problem& prob, const TensorRef& cu_seqlens_q,
                          const PagedCache& cache, const TensorRef& block_idx, int32_t max_q_len,
                          const Launch& launch, const TensorRef& q_scale) {
  if (!launch.check_values) return Status::Ok();
  const cudaStream_t stream = static_cast<cudaStream_t>(launch.stream);
  PagedCheck c;
  c.cu = static_cast<const int32_t*>(cu_seqlens_q.data);
  c.nseq = static_cast<int32_t>(cu_seqlens_q.shape[0] - 1);
  c.Tq = static_cast<int32_t>(prob.T);
  c.lens = static_cast<const int32_t*>(cache.seq_lens.data);
  c.pt = static_cast<const int32_t*>(cache.page_table.data);
  c.pt_s0 = cache.page_table.stride[0];
  c.max_pages = static_cast<int32_t>(cache.page_table.shape[1]);
  const TensorRef& any_cache = cache.k.defined() ? cache.k : (cache.v.defined() ? cache.v : cache.k_idx);
  c.pages = static_cast<int32_t>(any_cache.shape[0]);
  c.Bk = prob.opts.block_size;
  c.max_q_len = max_q_len;
  if (block_idx.defined()) {
    c.bi = static_cast<const int32_t*>(block_idx.data);
    c.bi_s0 = block_idx.stride[0];
    c.bi_s1 = block_idx.stride[1];
    c.Hi = prob.Hi;
    c.k = prob.k;
  }
  const TensorRef* scales[3] = {&cache.k_scale, &cache.v_scale, &cache.k_idx_scale};
  for (int w = 0; w < 3; ++w) {
    if (!scales[w]->defined()) continue;
    c.scale[w] = static_cast<const float*>(scales[w]->data);
    c.scale_n[w] = scales[w]->shape[0];
    c.scale_s[w] = scales[w]->stride[0];
  }
  if (q_scale.defined()) {  // [1] or [Tq, Hq]
    c.scale[3] = static_cast<const float*>(q_scale.data);
    c.scale_n[3] = q_scale.rank == 2 ? q_scale.shape[0] * q_scale.shape[1] : q_scale.shape[0];
    c.scale_s[3] = q_scale.stride[0];
    if (q_scale.rank == 2) {
      c.scale_s1[3] = q_scale.stride[1];
      c.scale_cols[3] = std::max<int64_t>(q_scale.shape[1], 1);
    }
  }
  unsigned long long v = 0;
  MSA_TRY(run_check(
      fn, stream, "cu_seqlens_q, the cache's seq_lens, page_table and scales and block_idx",
      std::max<int64_t>({int64_t(c.Tq) * c.Hi * c.k, int64_t(c.nseq) * c.max_pages, c.nseq + 1, c.scale_n[0],
                         c.scale_n[1], c.scale_n[2], c.scale_n[3]}),
      [&](int blocks, unsigned long long* verdict) {
        launch_grid(paged_check_kernel, blocks, 256, 0, stream, c, verdict);
      },
      &v));
  if (v == kNone) return Status::Ok();

  const auto kind = static_cast<Kind>(v >> 56);
  const int64_t index = static_cast<int64_t>(v & ((1ull << 56) - 1));
  const auto bad = [&](const char* arg, const std::string& what) { return detail::invalid_arg(fn, arg, what); };
  std::vector<int32_t> cu(c.nseq + 1);
  MSA_TRY(read(fn, cu.data(), c.cu, cu.size(), stream));
  if (kind <= kCuEnd) return offsets_error(fn, "cu_seqlens_q", "Tq", kind, index, cu, c.Tq);
  if (kind == kLenShort || kind == kLenLong || kind == kQLen) {
    int32_t len = 0;
    MSA_TRY(read(fn, &len, c.lens + index, 1, stream));
    const int64_t n = int64_t(cu[index + 1]) - cu[index];
    const std::string s = std::to_string(index);
    if (kind == kQLen)
      return bad("max_q_len", "sequence " + s + " has " + std::to_string(n) + " new tokens, more than max_q_len = " +
                                  std::to_string(max_q_len));
    if (kind == kLenLong)
      return bad("cache.seq_lens", "seq_lens[" + s + "] = " + std::to_string(len) + " exceeds the page table's " +
                                       std::to_string(c.max_pages) + " pages x block_size " + std::to_string(c.Bk));
    return bad("cache.seq_lens", "seq_lens[" + s + "] = " + std::to_string(len) + " is less than the sequence's " +
                                     std::to_string(n) + " new tokens (cu_seqlens_q)");
  }
  if (kind >= kScale && kind < kScale + PagedCheck::kScales) {
    const int w = static_cast<int>(kind - kScale);
    const char* names[PagedCheck::kScales] = {"cache.k_scale", "cache.v_scale", "cache.k_idx_scale", "q_scale"};
    float x = 0.f;
    MSA_TRY(read(fn, &x, c.scale[w] + c.scale_at(w, index), 1, stream));
    const std::string at = w == 3 && q_scale.rank == 2
                               ? std::to_string(index / c.scale_cols[w]) + ", " + std::to_string(index % c.scale_cols[w])
                               : std::to_string(index);
    return bad(names[w], (w == 3 ? "q_scale[" : "scale[") + at + "] = " + std::to_string(x) +
                             " is not a finite positive number");
  }
  if (kind == kPage) {
    const int64_t s = index / c.max_pages, b = index % c.max_pages;
    int32_t page = 0;
    MSA_TRY(read(fn, &page, c.pt + s * c.pt_s0 + b, 1, stream));
    return bad("cache.page_table", "entry [" + std::to_string(s) + ", " + std::to_string(b) + "] = " +
                                       std::to_string(page) + " is not a page of the cache (expected [0, " +
                                       std::to_string(c.pages) + "))");
  }
  const int64_t t = index / (int64_t(c.Hi) * c.k);
  const int32_t i = static_cast<int32_t>(index / c.k % c.Hi), j = static_cast<int32_t>(index % c.k);
  int32_t value = 0;
  MSA_TRY(read(fn, &value, c.bi + t * c.bi_s0 + i * c.bi_s1 + j, 1, stream));
  if (kind == kBlockTwice)
    return bad("block_idx", "row [" + std::to_string(t) + ", " + std::to_string(i) + "] selects block " +
                                std::to_string(value) + " twice");
  return bad("block_idx", "entry [" + std::to_string(t) + ", " + std::to_string(i) + ", " + std::to_string(j) +
                              "] = " + std::to_string(value) +
                              " is out of range: expected -1 or a block up to the token's own block");
}

}  // namespace msa::cuda
