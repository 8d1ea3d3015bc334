// The Hopper backend's backward and KL value: host orchestration and the small kernels around
// the three main ones.
//
// backward:  Delta = rowsum(dO * O)                          (delta_kernel)
//            reverse index of block_idx (sparse mode)        (key_kernel, CUB sort + reduce-by-key)
//            dq                                              (bwd_q_kernel, query side)
//            KL branch, when dq_idx or dk_idx is wanted:
//              LSE_idx over the support                      (forward kernel, LSE-only mode)
//            dk, dv; with the KL branch also the fixed-point sums of dq_idx, dk_idx
//                                                            (bwd_kv_kernel, KV side)
//              (Hq / Hi not a power of two: a separate pass  (kl_kernel))
//              scale by gamma * scale_idx / (N Hi), convert  (finalize_grad_kernel)
// kl value:  reverse index, LSE_idx, kl_kernel's per-row terms, then finalize_kl_kernel.
//
// Every step is deterministic: no floating-point atomics anywhere.
#include <cuda_runtime.h>

#include <cub/device/device_radix_sort.cuh>
#include <cub/device/device_reduce.cuh>
#include <cub/device/device_scan.cuh>
#include <cutlass/numeric_types.h>

#include <cmath>
#include <cstdlib>
#include <string>

#include "backend.h"
#include "host_util.h"
#include "kernels/bwd_common.cuh"
#include "kernels/tile.cuh"
#include "launch.h"

namespace msa::cuda {
namespace {

constexpr int kBlockC = 64;  // columns of a KV-side entry (kernels/bwd_common.cuh)

// ------------------------------------------------------------------------------ small kernels

// delta[t, h] = sum_d dout[t, h, d] * out[t, h, d] (fp32); one warp per (t, h).
template <class Element>
__global__ void delta_kernel(const Element* dout, int64_t do_s0, int64_t do_s1, const Element* out,
                             int64_t o_s0, int64_t o_s1, int64_t rows, int32_t Hq, int32_t D,
                             float* delta) {
  const int64_t row = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) / 32;
  const int lane = threadIdx.x & 31;
  if (row >= rows) return;
  const int64_t t = row / Hq;
  const int32_t h = static_cast<int32_t>(row % Hq);
  const Element* a = dout + t * do_s0 + h * do_s1;
  const Element* b = out + t * o_s0 + h * o_s1;
  float acc = 0.f;
  for (int d = lane; d < D; d += 32) acc += static_cast<float>(a[d]) * static_cast<float>(b[d]);
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) acc += __shfl_xor_sync(0xffffffff, acc, o);
  if (lane == 0) delta[row] = acc;
}

// One reverse-index key per (token, index head, slot): the entry (KV tile of the selected block,
// KV head, index head of that KV head, query group of the token) and the token's bit in its
// group. Slots outside [0, blk(t)] get `invalid` (sorted past every real key).
__global__ void key_kernel(const int32_t* block_idx, int64_t bi_s0, int64_t bi_s1,
                           const int32_t* cu, int32_t nseq, int64_t T, int32_t Hi, int32_t k,
                           int32_t Bk, int32_t Hkv, int32_t ipk, int32_t m, int gbits,
                           uint64_t invalid, uint64_t* keys, uint64_t* vals) {
  const int64_t n = T * Hi * k;
  for (int64_t e = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; e < n;
       e += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t t = e / (static_cast<int64_t>(Hi) * k);
    const int32_t rem = static_cast<int32_t>(e - t * Hi * k);
    const int32_t i = rem / k, slot = rem - i * k;
    // The token's sequence (cu clamped as in kern::decode_tile).
    int32_t s = 0;
    int64_t start = 0, end = T;
    if (cu != nullptr) {
      int32_t lo = 0, hi = nseq - 1;
      while (lo < hi) {
        const int32_t mid = (lo + hi + 1) >> 1;
        if (kern::clamp_offset(cu[mid], 0, T) <= t) lo = mid; else hi = mid - 1;
      }
      s = lo;
      start = kern::clamp_offset(cu[s], 0, T);
      end = kern::clamp_offset(cu[s + 1], start, T);
    }
    uint64_t key = invalid, val = 0;
    if (t >= start && t < end) {
      const int64_t pos = t - start;
      const int32_t b = block_idx[t * bi_s0 + i * bi_s1 + slot];
      if (b >= 0 && b <= pos / Bk) {
        const int64_t x = s + start / Bk + b;
        const int64_t g = s + start / m + pos / m;
        key = kern::entry_key(x, i / ipk, Hkv, i % ipk, ipk, g, gbits);
        val = uint64_t(1) << (pos % m);
      }
    }
    keys[e] = key;
    vals[e] = val;
  }
}

// Per work item (KV tile x, KV head r): its chunk count (0 for an empty tile id, else at least 1
// so that a block nobody selected still gets its zero dk, dv) and its partial slots (split items).
__global__ void chunk_kernel(kern::EntryListParams list, const int32_t* cu, int32_t nseq, int64_t T,
                             int32_t Bk, int32_t Hkv, int32_t ipk, int32_t m, int32_t items,
                             int32_t chunk, int32_t* num_chunks, int32_t* num_slots) {
  const int32_t item = blockIdx.x * blockDim.x + threadIdx.x;
  if (item >= items) return;
  const int64_t x = item / Hkv;
  const int32_t r = item % Hkv;
  const kern::QueryTile tile = kern::decode_tile(cu, nseq, T, Bk, x);
  int32_t n = 0;
  if (tile.count > 0) {
    const kern::EntryList l(list, tile, x, r, Hkv, ipk, m);
    n = l.n > chunk ? static_cast<int32_t>((l.n + chunk - 1) / chunk) : 1;
  }
  num_chunks[item] = n;
  num_slots[item] = n > 1 ? n : 0;
}

struct BitOr {
  __device__ uint64_t operator()(uint64_t a, uint64_t b) const { return a | b; }
};

// out[t, h, :] = acc[t, h, :] * 2^-32 * coef, coef = base * kl_weight * (kl_grad ? kl_grad[0] : 1).
template <class Element>
__global__ void finalize_grad_kernel(const unsigned long long* acc, int64_t rows, int32_t H,
                                     int32_t D, Element* out, int64_t s0, int64_t s1,
                                     const float* kl_grad, double base) {
  const double coef = base * (kl_grad != nullptr ? static_cast<double>(kl_grad[0]) : 1.0) /
                      kern::kFixedOne;
  const int64_t n = rows * H * D;
  for (int64_t e = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; e < n;
       e += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t row = e / D;
    const int32_t d = static_cast<int32_t>(e - row * D);
    const int64_t t = row / H;
    const int32_t h = static_cast<int32_t>(row - t * H);
    const double v = static_cast<double>(static_cast<long long>(acc[e])) * coef;
    out[t * s0 + h * s1 + d] = static_cast<Element>(static_cast<float>(v));
  }
}

// kl[0] = sum of the rows / (N Hi); kl_rows (optional) the rows themselves. One block; the sum
// is over integers, so its order does not matter.
__global__ void finalize_kl_kernel(const unsigned long long* rows_acc, int64_t T, int32_t Hi,
                                   float* kl, float* kl_rows, int64_t kr_s0, int64_t kr_s1) {
  __shared__ unsigned long long part[32];
  unsigned long long sum = 0;
  const int64_t n = T * Hi;
  for (int64_t e = threadIdx.x; e < n; e += blockDim.x) {
    sum += rows_acc[e];
    if (kl_rows != nullptr) {
      const int64_t t = e / Hi;
      kl_rows[t * kr_s0 + (e - t * Hi) * kr_s1] =
          static_cast<float>(static_cast<double>(static_cast<long long>(rows_acc[e])) / kern::kFixedOne);
    }
  }
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) sum += __shfl_xor_sync(0xffffffff, sum, o);
  if ((threadIdx.x & 31) == 0) part[threadIdx.x / 32] = sum;
  __syncthreads();
  if (threadIdx.x == 0) {
    unsigned long long total = 0;
    for (int w = 0; w < static_cast<int>(blockDim.x / 32); ++w) total += part[w];
    kl[0] = n > 0 ? static_cast<float>(static_cast<double>(static_cast<long long>(total)) /
                                       kern::kFixedOne / static_cast<double>(n))
                  : 0.f;
  }
}

// ------------------------------------------------------------------------------ workspace

int bits_for(uint64_t v) {  // bits needed to hold values 0..v
  int b = 0;
  while (b < 64 && (v >> b) != 0) ++b;
  return b;
}

size_t align_up(size_t x) { return (x + 255) / 256 * 256; }

// Everything the backward and the KL value keep in device workspace.
struct Plan {
  bool sparse = false, kl = false, grad = false;
  int64_t n = 0;         // reverse-index slots T * Hi * k
  int32_t Hi_group = 0;  // column groups of the KV side
  int32_t m = 0;         // tokens per KV-side group
  int gbits = 0, end_bit = 0;
  uint64_t invalid = 0;
  size_t cub_bytes = 0;
  // byte offsets
  size_t delta = 0, keys_a = 0, keys_b = 0, vals_a = 0, vals_b = 0, count = 0, cub = 0;
  size_t lse_idx = 0, dq_acc = 0, dk_acc = 0, kl_acc = 0, total = 0;
  // KV-side work lists: bwd_kv's (chunks bounded by the partial-sum slots they may need) and
  // the KL kernel's (whose sums are fixed-point atomics, so any chunk size is free).
  struct Work {
    int32_t chunk = 0;
    int64_t grid = 0, slots = 0;
    size_t num_chunks = 0, chunk_start = 0, num_slots = 0, slot_start = 0, arrivals = 0,
           partials = 0;
  };
  int32_t items = 0;
  Work kv, kl_work;
};

int num_sms() {
  int dev = 0, n = 0;
  cudaGetDevice(&dev);
  if (cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, dev) != cudaSuccess || n <= 0) {
    cudaGetLastError();
    n = 132;
  }
  return n;
}

Status make_plan(const char* fn, const Problem& prob, int32_t nseq, bool sparse, bool main,
                 bool kl, bool grad, Plan* out) {
  Plan p;
  p.sparse = sparse;
  p.kl = kl;
  p.grad = grad;
  const int32_t Bk = prob.opts.block_size;
  // Column groups of the KV side: the index heads (always in sparse mode or with the KL),
  // else the KV heads.
  p.Hi_group = (sparse || kl) ? prob.Hi : prob.Hkv;
  const int32_t Gi = prob.Hq / p.Hi_group;
  if (Gi > kBlockC)
    return fail(fn, "q", "the CUDA backward takes at most 64 query heads per " +
                             std::string((sparse || kl) ? "index head" : "KV head") + ", got " +
                             std::to_string(Gi));
  p.m = kern::group_tokens(Gi);
  size_t off = 0;
  auto take = [&](size_t bytes) {
    const size_t at = off;
    off += align_up(bytes);
    return at;
  };
  if (main) p.delta = take(sizeof(float) * size_t(prob.T) * prob.Hq);
  const int64_t kv_tiles = kern::num_tile_ids(nseq, prob.T, Bk);
  if (sparse) {
    p.n = prob.T * prob.Hi * int64_t(prob.k);
    if (p.n >= (int64_t(1) << 31))
      return fail(fn, "block_idx", "T * Hi * k must be below 2^31 for the CUDA backward");
    const int64_t groups = kern::num_tile_ids(nseq, prob.T, p.m);
    p.gbits = bits_for(static_cast<uint64_t>(groups));
    const uint64_t prefix = static_cast<uint64_t>(kv_tiles) * prob.Hkv * (prob.Hi / prob.Hkv);
    p.end_bit = bits_for(prefix) + p.gbits;
    if (p.end_bit > 63) return fail(fn, "q", "too many tokens for the reverse index");
    p.invalid = (uint64_t(1) << p.end_bit) - 1;
    p.keys_a = take(8 * size_t(p.n));
    p.keys_b = take(8 * size_t(p.n));
    p.vals_a = take(8 * size_t(p.n));
    p.vals_b = take(8 * size_t(p.n));
    p.count = take(sizeof(int32_t));
    size_t sort_bytes = 0, reduce_bytes = 0;
    cub::DoubleBuffer<uint64_t> kb(nullptr, nullptr), vb(nullptr, nullptr);
    cub::DeviceRadixSort::SortPairs(nullptr, sort_bytes, kb, vb, static_cast<int>(p.n), 0,
                                    p.end_bit);
    cub::DeviceReduce::ReduceByKey(nullptr, reduce_bytes, static_cast<uint64_t*>(nullptr),
                                   static_cast<uint64_t*>(nullptr), static_cast<uint64_t*>(nullptr),
                                   static_cast<uint64_t*>(nullptr), static_cast<int32_t*>(nullptr),
                                   BitOr{}, static_cast<int>(p.n));
    p.cub_bytes = std::max(sort_bytes, reduce_bytes);
  }
  // The KV-side work lists. e_bound bounds the entries of all lists: one per block_idx slot in
  // sparse mode, every (index head, KV tile, group) pair in dense mode.
  const double e_bound =
      sparse ? double(p.n)
             : double(p.Hi_group) * double(kv_tiles) * double(kern::num_tile_ids(nseq, prob.T, p.m));
  if (kv_tiles * prob.Hkv >= (int64_t(1) << 31)) return fail(fn, "q", "too many tokens for the CUDA backward");
  p.items = static_cast<int32_t>(kv_tiles * prob.Hkv);
  size_t scan_bytes = 0;
  cub::DeviceScan::ExclusiveSum(nullptr, scan_bytes, static_cast<int32_t*>(nullptr),
                                static_cast<int32_t*>(nullptr), p.items);
  // CUB's own estimates can vary with its tuning for the current device: keep a margin so that
  // the size a caller was given always suffices.
  p.cub_bytes = 2 * std::max(p.cub_bytes, scan_bytes) + 65536;
  p.cub = take(p.cub_bytes);
  // chunk: entries per CTA; with_slots: split lists keep fp32 partial sums (bwd_kv).
  auto work = [&](Plan::Work* w, double chunk, bool with_slots) -> Status {
    chunk = std::max(1.0, chunk);
    const int64_t extra = static_cast<int64_t>(std::ceil(e_bound / chunk));
    if (chunk >= double(int64_t(1) << 31) || p.items + extra >= (int64_t(1) << 31))
      return fail(fn, "q", "too many tokens for the CUDA backward");
    w->chunk = static_cast<int32_t>(chunk);
    w->grid = p.items + extra;
    w->slots = with_slots ? 2 * extra + 2 : 0;
    w->num_chunks = take(4 * size_t(p.items));
    w->chunk_start = take(4 * size_t(p.items));
    w->num_slots = take(4 * size_t(p.items));
    w->slot_start = take(4 * size_t(p.items));
    w->arrivals = take(4 * size_t(p.items));
    w->partials = take(sizeof(float) * 2 * size_t(Bk) * prob.D * size_t(w->slots));
    return Status::Ok();
  };
  // bwd_kv: about 16 chunks per SM of the entry bound (which also bounds the partial slots:
  // at most 2 * 16 * SMs of them, 540 MB at Bk = D = 128 on 132 SMs); KL: chunks of 512 entries.
  if (main) MSA_TRY(work(&p.kv, std::max(256.0, std::ceil(e_bound / (16.0 * num_sms()))), true));
  if (kl) MSA_TRY(work(&p.kl_work, 512.0, false));
  if (kl) {
    p.lse_idx = take(sizeof(float) * size_t(prob.T) * prob.Hi);
    if (grad) {
      p.dq_acc = take(8 * size_t(prob.T) * prob.Hi * prob.Di);
      p.dk_acc = take(8 * size_t(prob.T) * prob.Hik * prob.Di);
    } else {
      p.kl_acc = take(8 * size_t(prob.T) * prob.Hi);
    }
  }
  p.total = off;
  *out = p;
  return Status::Ok();
}

template <class T>
T* at(void* ws, size_t off) {
  return reinterpret_cast<T*>(static_cast<char*>(ws) + off);
}

Status cuda_error(const char* fn, cudaError_t e) {
  return Status::Internal(std::string("msa::") + fn + ": " + cudaGetErrorString(e));
}

// The reverse index of block_idx into the plan's buffers; returns the entry arguments.
Status build_entries(const char* fn, const Plan& pl, const Problem& prob, const TensorRef& bi,
                     const int32_t* cu, int32_t nseq, void* ws, cudaStream_t stream,
                     EntryArgs* out) {
  uint64_t* ka = at<uint64_t>(ws, pl.keys_a);
  uint64_t* kb = at<uint64_t>(ws, pl.keys_b);
  uint64_t* va = at<uint64_t>(ws, pl.vals_a);
  uint64_t* vb = at<uint64_t>(ws, pl.vals_b);
  int32_t* count = at<int32_t>(ws, pl.count);
  const int threads = 256;
  const int blocks = static_cast<int>(std::min<int64_t>((pl.n + threads - 1) / threads, 132 * 16));
  if (pl.n > 0) {
    key_kernel<<<blocks, threads, 0, stream>>>(
        static_cast<const int32_t*>(bi.data), bi.stride[0], bi.stride[1], cu, nseq, prob.T,
        prob.Hi, prob.k, prob.opts.block_size, prob.Hkv, prob.Hi / prob.Hkv, pl.m, pl.gbits,
        pl.invalid, ka, va);
  }
  cub::DoubleBuffer<uint64_t> keys(ka, kb), vals(va, vb);
  size_t bytes = pl.cub_bytes;
  cudaError_t e = cub::DeviceRadixSort::SortPairs(at<void>(ws, pl.cub), bytes, keys, vals,
                                                  static_cast<int>(pl.n), 0, pl.end_bit, stream);
  if (e != cudaSuccess) return cuda_error(fn, e);
  bytes = pl.cub_bytes;
  uint64_t* ukeys = keys.Alternate();
  uint64_t* umasks = vals.Alternate();
  e = cub::DeviceReduce::ReduceByKey(at<void>(ws, pl.cub), bytes, keys.Current(), ukeys,
                                     vals.Current(), umasks, count, BitOr{}, static_cast<int>(pl.n),
                                     stream);
  if (e != cudaSuccess) return cuda_error(fn, e);
  out->keys = ukeys;
  out->masks = umasks;
  out->count = count;
  out->gbits = pl.gbits;
  return Status::Ok();
}

// The KV-side work list of the plan.
Status build_work(const char* fn, const Plan& pl, const Plan::Work& w, const Problem& prob,
                  const EntryArgs& entries, const int32_t* cu, int32_t nseq, void* ws,
                  cudaStream_t stream, WorkArgs* out) {
  kern::EntryListParams list{};
  list.keys = entries.keys;
  list.masks = entries.masks;
  list.count = entries.count;
  list.gbits = entries.gbits;
  list.dense = !pl.sparse;
  int32_t* num_chunks = at<int32_t>(ws, w.num_chunks);
  int32_t* num_slots = at<int32_t>(ws, w.num_slots);
  chunk_kernel<<<(pl.items + 255) / 256, 256, 0, stream>>>(
      list, cu, nseq, prob.T, prob.opts.block_size, prob.Hkv, pl.Hi_group / prob.Hkv, pl.m,
      pl.items, w.chunk, num_chunks, num_slots);
  size_t bytes = pl.cub_bytes;
  cudaError_t e = cub::DeviceScan::ExclusiveSum(at<void>(ws, pl.cub), bytes, num_chunks,
                                                at<int32_t>(ws, w.chunk_start), pl.items, stream);
  bytes = pl.cub_bytes;
  if (e == cudaSuccess)
    e = cub::DeviceScan::ExclusiveSum(at<void>(ws, pl.cub), bytes, num_slots,
                                      at<int32_t>(ws, w.slot_start), pl.items, stream);
  if (e == cudaSuccess) e = cudaMemsetAsync(at<void>(ws, w.arrivals), 0, 4 * size_t(pl.items), stream);
  if (e != cudaSuccess) return cuda_error(fn, e);
  out->chunk_start = at<int32_t>(ws, w.chunk_start);
  out->num_chunks = num_chunks;
  out->slot_start = at<int32_t>(ws, w.slot_start);
  out->arrivals = at<int32_t>(ws, w.arrivals);
  out->partials = at<float>(ws, w.partials);
  out->items = pl.items;
  out->chunk = w.chunk;
  out->grid = w.grid;
  return Status::Ok();
}

// ------------------------------------------------------------------------------ dispatch

#define MSA_DEFINE_DISPATCH(NAME, ARGS)                                                        \
  template <int kDim, int kBlockN>                                                             \
  Status NAME##_dtype(const ARGS& a, DType dt) {                                               \
    if (dt == DType::kBFloat16) return launch_##NAME<cutlass::bfloat16_t, kDim, kBlockN>(a);   \
    if (!kFastBuild) return launch_##NAME<cutlass::half_t, kDim, kBlockN>(a);                  \
    return Status::NotSupported("msa: float16 is not built into this library");                \
  }                                                                                            \
  Status NAME##_dispatch(const ARGS& a, DType dt, int32_t d, int32_t bk) {                     \
    if (kFastBuild) {                                                                          \
      if (d == 128 && bk == 128) return NAME##_dtype<128, 128>(a, dt);                         \
      return Status::NotSupported("msa: only head dim 128 and block_size 128 are built");      \
    }                                                                                          \
    if (d == 64) return bk == 64 ? NAME##_dtype<64, 64>(a, dt) : NAME##_dtype<64, 128>(a, dt); \
    return bk == 64 ? NAME##_dtype<128, 64>(a, dt) : NAME##_dtype<128, 128>(a, dt);            \
  }

#if MSA_CUDA_FAST_BUILD
constexpr bool kFastBuild = true;
#else
constexpr bool kFastBuild = false;
#endif
MSA_DEFINE_DISPATCH(bwd_q, BwdArgs)
MSA_DEFINE_DISPATCH(bwd_kv, BwdArgs)
MSA_DEFINE_DISPATCH(kl, KlArgs)
#undef MSA_DEFINE_DISPATCH

// ------------------------------------------------------------------------------ KL branch

struct KlInputs {
  TensorRef q, k, lse, q_idx, k_idx, cu_seqlens, block_idx;
};

Status check_kl_inputs(const char* fn, const Problem& prob, const KlInputs& in) {
  MSA_TRY(check_half(fn, "q_idx", in.q_idx));
  MSA_TRY(check_head_dim(fn, "q_idx", prob.Di));
  MSA_TRY(check_aligned(fn, "q_idx", in.q_idx));
  MSA_TRY(check_aligned(fn, "k_idx", in.k_idx));
  if (prob.Di != prob.D)
    return fail(fn, "q_idx", "the CUDA KL kernels need Di == D (got Di = " + std::to_string(prob.Di) +
                                 ", D = " + std::to_string(prob.D) + ")");
  if (in.q_idx.dtype != in.q.dtype)
    return fail(fn, "q_idx", "the CUDA KL kernels need q_idx in the dtype of q");
  return Status::Ok();
}

// LSE_idx over the support into the plan's buffer (the forward kernel in LSE-only mode).
Status index_lse(const Plan& pl, const Problem& prob, const KlInputs& in, void* ws,
                 cudaStream_t stream) {
  const bool dense = !pl.sparse;
  FwdArgs f{};
  f.q = in.q_idx.data;
  f.q_s0 = in.q_idx.stride[0];
  f.q_s1 = in.q_idx.stride[1];
  f.k = f.v = in.k_idx.data;
  f.k_s0 = f.v_s0 = in.k_idx.stride[0];
  f.k_s1 = f.v_s1 = in.k_idx.stride[1];
  f.lse = at<float>(ws, pl.lse_idx);
  f.lse_s0 = prob.Hi;
  f.lse_s1 = 1;
  f.block_idx = dense ? nullptr : static_cast<const int32_t*>(in.block_idx.data);
  f.bi_s0 = dense ? 0 : in.block_idx.stride[0];
  f.bi_s1 = dense ? 0 : in.block_idx.stride[1];
  f.cu_seqlens = in.cu_seqlens.defined() ? static_cast<const int32_t*>(in.cu_seqlens.data) : nullptr;
  f.nseq = num_seqs(in.cu_seqlens);
  f.T = prob.T;
  f.Hq = prob.Hi;
  f.Hkv = prob.Hik;
  f.Hi = dense ? prob.Hik : prob.Hi;
  f.top_k = prob.k;
  f.scale = prob.opts.scale_idx;
  f.dense = dense;
  f.lse_only = true;
  f.stream = stream;
  return dispatch_forward(f, in.q_idx.dtype, prob.Di, prob.opts.block_size);
}

// Zeroes the fixed-point sums of the KL gradient (grad) or of the KL terms.
Status zero_kl_sums(const char* fn, const Plan& pl, const Problem& prob, void* ws,
                    cudaStream_t stream) {
  const size_t acc_bytes =
      pl.grad ? 8 * size_t(prob.T) * prob.Hi * prob.Di : 8 * size_t(prob.T) * prob.Hi;
  cudaError_t e = cudaMemsetAsync(pl.grad ? at<void>(ws, pl.dq_acc) : at<void>(ws, pl.kl_acc), 0,
                                  acc_bytes, stream);
  if (e == cudaSuccess && pl.grad)
    e = cudaMemsetAsync(at<void>(ws, pl.dk_acc), 0, 8 * size_t(prob.T) * prob.Hik * prob.Di, stream);
  return e == cudaSuccess ? Status::Ok() : cuda_error(fn, e);
}

// The KL gradient rides in bwd_kv when the teacher's head mean is a butterfly over accumulator
// columns (Gi a power of two); MSA_BACKWARD_KL=separate forces the separate kl_kernel pass
// (a switch for measurement).
bool fused_kl(const Problem& prob) {
  static const bool separate = [] {
    const char* v = std::getenv("MSA_BACKWARD_KL");
    return v != nullptr && std::string(v) == "separate";
  }();
  const int32_t gi = prob.Hq / prob.Hi;
  return !separate && gi >= 1 && gi <= 64 && (gi & (gi - 1)) == 0;
}

// LSE_idx, then kl_kernel into the plan's fixed-point buffers.
Status run_kl(const char* fn, const Plan& pl, const Problem& prob, const KlInputs& in,
              const EntryArgs& entries, const WorkArgs& work, void* ws, cudaStream_t stream) {
  const bool dense = !pl.sparse;
  const int32_t* cu =
      in.cu_seqlens.defined() ? static_cast<const int32_t*>(in.cu_seqlens.data) : nullptr;
  const int32_t nseq = num_seqs(in.cu_seqlens);
  float* lse_idx = at<float>(ws, pl.lse_idx);
  MSA_TRY(index_lse(pl, prob, in, ws, stream));

  KlArgs a{};
  a.q = in.q.data;
  a.k = in.k.data;
  a.q_idx = in.q_idx.data;
  a.k_idx = in.k_idx.data;
  a.q_s0 = in.q.stride[0];
  a.q_s1 = in.q.stride[1];
  a.k_s0 = in.k.stride[0];
  a.k_s1 = in.k.stride[1];
  a.qi_s0 = in.q_idx.stride[0];
  a.qi_s1 = in.q_idx.stride[1];
  a.ki_s0 = in.k_idx.stride[0];
  a.ki_s1 = in.k_idx.stride[1];
  a.lse = static_cast<const float*>(in.lse.data);
  a.lse_s0 = in.lse.stride[0];
  a.lse_s1 = in.lse.stride[1];
  a.lse_idx = lse_idx;
  a.dq_idx = pl.grad ? at<unsigned long long>(ws, pl.dq_acc) : nullptr;
  a.dk_idx = pl.grad ? at<unsigned long long>(ws, pl.dk_acc) : nullptr;
  a.kl_rows = pl.grad ? nullptr : at<unsigned long long>(ws, pl.kl_acc);
  a.entries = entries;
  a.work = work;
  a.cu_seqlens = cu;
  a.nseq = nseq;
  a.T = prob.T;
  a.Hq = prob.Hq;
  a.Hkv = prob.Hkv;
  a.Hi = prob.Hi;
  a.Hik = prob.Hik;
  a.scale = prob.opts.scale;
  a.scale_idx = prob.opts.scale_idx;
  a.dense = dense;
  a.stream = stream;
  MSA_TRY(zero_kl_sums(fn, pl, prob, ws, stream));
  return kl_dispatch(a, in.q.dtype, prob.D, prob.opts.block_size);
}

Status check_main(const char* fn, const Problem& prob, const TensorRef& q, const TensorRef& k,
                  const TensorRef& v) {
  MSA_TRY(check_half(fn, "q", q));
  MSA_TRY(check_head_dim(fn, "q", prob.D));
  MSA_TRY(check_block_size(fn, prob.opts.block_size));
  MSA_TRY(check_aligned(fn, "q", q));
  MSA_TRY(check_aligned(fn, "k", k));
  if (v.defined()) MSA_TRY(check_aligned(fn, "v", v));
  if (prob.T >= (int64_t(1) << 31)) return fail(fn, "q", "more than 2^31 - 1 tokens");
  return Status::Ok();
}

Status check_even(const char* fn, const char* arg, const TensorRef& t) {
  if (!t.defined()) return Status::Ok();
  if (t.stride[0] % 2 != 0 || t.stride[1] % 2 != 0 || reinterpret_cast<uintptr_t>(t.data) % 4 != 0)
    return fail(fn, arg, "the CUDA backend needs 4-byte aligned rows (even strides)");
  return Status::Ok();
}

Status backward_plan(const Problem& prob, const BackwardParams& p, Plan* pl) {
  const char* fn = "backward";
  const bool sparse = prob.opts.mode == Mode::kSparse;
  const bool kl = p.dq_idx.defined() || p.dk_idx.defined();
  MSA_TRY(check_main(fn, prob, p.q, p.k, p.v));
  MSA_TRY(check_aligned(fn, "dout", p.dout));
  MSA_TRY(check_aligned(fn, "out", p.out));
  MSA_TRY(check_even(fn, "dq", p.dq));
  MSA_TRY(check_even(fn, "dk", p.dk));
  MSA_TRY(check_even(fn, "dv", p.dv));
  if (kl) MSA_TRY(check_kl_inputs(fn, prob, {p.q, p.k, p.lse, p.q_idx, p.k_idx, p.cu_seqlens, p.block_idx}));
  const int32_t tile_heads = sparse ? prob.Hi : prob.Hkv;
  if (prob.Hq / tile_heads > 128)
    return fail(fn, "q", "the CUDA backend takes at most 128 query heads per index head");
  return make_plan(fn, prob, num_seqs(p.cu_seqlens), sparse, true, kl, true, pl);
}

Status kl_plan(const Problem& prob, const KlInputs& in, Plan* pl) {
  const char* fn = "kl_divergence";
  MSA_TRY(check_main(fn, prob, in.q, in.k, TensorRef{}));
  MSA_TRY(check_kl_inputs(fn, prob, in));
  return make_plan(fn, prob, num_seqs(in.cu_seqlens), prob.opts.mode == Mode::kSparse, false, true,
                   false, pl);
}

Status need_workspace(const char* fn, const Plan& pl, const Launch& launch) {
  if (pl.total > 0 && (launch.workspace == nullptr || launch.workspace_bytes < pl.total))
    return Status::Invalid(std::string("msa::") + fn +
                           ": argument 'launch.workspace': the CUDA backend needs " +
                           std::to_string(pl.total) + " bytes of device workspace (workspace_size), got " +
                           std::to_string(launch.workspace == nullptr ? 0 : launch.workspace_bytes));
  return Status::Ok();
}

template <class Element>
Status finalize_grad(const unsigned long long* acc, int64_t T, int32_t H, int32_t D,
                     const TensorRef& out, const float* kl_grad, double base, cudaStream_t stream) {
  const int64_t n = T * H * D;
  const int blocks = static_cast<int>(std::min<int64_t>((n + 255) / 256, 132 * 32));
  if (n == 0) return Status::Ok();
  finalize_grad_kernel<Element><<<blocks, 256, 0, stream>>>(
      acc, T, H, D, static_cast<Element*>(out.data), out.stride[0], out.stride[1], kl_grad, base);
  return Status::Ok();
}

}  // namespace

size_t backward_workspace(const Problem& prob, const BackwardParams& p) {
  Plan pl;
  return backward_plan(prob, p, &pl).ok() ? pl.total : 0;
}

size_t kl_workspace(const Problem& prob, const KlParams& p) {
  Plan pl;
  return kl_plan(prob, {p.q, p.k, p.lse, p.q_idx, p.k_idx, p.cu_seqlens, p.block_idx}, &pl).ok()
             ? pl.total
             : 0;
}

Status attention_backward(const Problem& prob, const BackwardParams& p) {
  const char* fn = "backward";
  Plan pl;
  MSA_TRY(backward_plan(prob, p, &pl));
  MSA_TRY(need_workspace(fn, pl, p.launch));
  if (prob.T == 0) return Status::Ok();
  DeviceGuard guard(p.q.device.index);
  const cudaStream_t stream = static_cast<cudaStream_t>(p.launch.stream);
  void* ws = p.launch.workspace;
  const bool dense = !pl.sparse;
  const int32_t* cu =
      p.cu_seqlens.defined() ? static_cast<const int32_t*>(p.cu_seqlens.data) : nullptr;
  const int32_t nseq = num_seqs(p.cu_seqlens);

  float* delta = at<float>(ws, pl.delta);
  {
    const int64_t rows = prob.T * prob.Hq;
    const int blocks = static_cast<int>((rows * 32 + 255) / 256);
    if (p.q.dtype == DType::kBFloat16)
      delta_kernel<cutlass::bfloat16_t><<<blocks, 256, 0, stream>>>(
          static_cast<const cutlass::bfloat16_t*>(p.dout.data), p.dout.stride[0], p.dout.stride[1],
          static_cast<const cutlass::bfloat16_t*>(p.out.data), p.out.stride[0], p.out.stride[1],
          rows, prob.Hq, prob.D, delta);
    else
      delta_kernel<cutlass::half_t><<<blocks, 256, 0, stream>>>(
          static_cast<const cutlass::half_t*>(p.dout.data), p.dout.stride[0], p.dout.stride[1],
          static_cast<const cutlass::half_t*>(p.out.data), p.out.stride[0], p.out.stride[1], rows,
          prob.Hq, prob.D, delta);
  }
  EntryArgs entries{};
  if (!dense) MSA_TRY(build_entries(fn, pl, prob, p.block_idx, cu, nseq, ws, stream, &entries));
  WorkArgs work{};
  MSA_TRY(build_work(fn, pl, pl.kv, prob, entries, cu, nseq, ws, stream, &work));

  BwdArgs a{};
  a.q = p.q.data;
  a.k = p.k.data;
  a.v = p.v.data;
  a.dout = p.dout.data;
  a.q_s0 = p.q.stride[0];
  a.q_s1 = p.q.stride[1];
  a.k_s0 = p.k.stride[0];
  a.k_s1 = p.k.stride[1];
  a.v_s0 = p.v.stride[0];
  a.v_s1 = p.v.stride[1];
  a.do_s0 = p.dout.stride[0];
  a.do_s1 = p.dout.stride[1];
  a.lse = static_cast<const float*>(p.lse.data);
  a.lse_s0 = p.lse.stride[0];
  a.lse_s1 = p.lse.stride[1];
  a.delta = delta;
  a.dq = p.dq.data;
  a.dk = p.dk.data;
  a.dv = p.dv.data;
  a.dq_s0 = p.dq.stride[0];
  a.dq_s1 = p.dq.stride[1];
  a.dk_s0 = p.dk.stride[0];
  a.dk_s1 = p.dk.stride[1];
  a.dv_s0 = p.dv.stride[0];
  a.dv_s1 = p.dv.stride[1];
  a.block_idx = dense ? nullptr : static_cast<const int32_t*>(p.block_idx.data);
  a.bi_s0 = dense ? 0 : p.block_idx.stride[0];
  a.bi_s1 = dense ? 0 : p.block_idx.stride[1];
  a.entries = entries;
  a.work = work;
  a.cu_seqlens = cu;
  a.nseq = nseq;
  a.T = prob.T;
  a.Hq = prob.Hq;
  a.Hkv = prob.Hkv;
  a.Hi = pl.Hi_group;
  a.Hi_tile = dense ? prob.Hkv : prob.Hi;
  a.top_k = prob.k;
  a.scale = prob.opts.scale;
  a.dense = dense;
  a.stream = stream;
  const KlInputs kl_in{p.q, p.k, p.lse, p.q_idx, p.k_idx, p.cu_seqlens, p.block_idx};
  const bool fused = pl.kl && fused_kl(prob);
  if (fused) {
    MSA_TRY(index_lse(pl, prob, kl_in, ws, stream));
    MSA_TRY(zero_kl_sums(fn, pl, prob, ws, stream));
    a.q_idx = p.q_idx.data;
    a.k_idx = p.k_idx.data;
    a.qi_s0 = p.q_idx.stride[0];
    a.qi_s1 = p.q_idx.stride[1];
    a.ki_s0 = p.k_idx.stride[0];
    a.ki_s1 = p.k_idx.stride[1];
    a.lse_idx = at<float>(ws, pl.lse_idx);
    a.dq_idx = at<unsigned long long>(ws, pl.dq_acc);
    a.dk_idx = at<unsigned long long>(ws, pl.dk_acc);
    a.Hik = prob.Hik;
    a.scale_idx = prob.opts.scale_idx;
  }
  MSA_TRY(bwd_q_dispatch(a, p.q.dtype, prob.D, prob.opts.block_size));
  MSA_TRY(bwd_kv_dispatch(a, p.q.dtype, prob.D, prob.opts.block_size));

  if (pl.kl && !fused) {
    WorkArgs kl_work{};
    MSA_TRY(build_work(fn, pl, pl.kl_work, prob, entries, cu, nseq, ws, stream, &kl_work));
    MSA_TRY(run_kl(fn, pl, prob, kl_in, entries, kl_work, ws, stream));
  }
  if (pl.kl) {
    const float* kl_grad = p.kl_grad.defined() ? static_cast<const float*>(p.kl_grad.data) : nullptr;
    const double base = static_cast<double>(p.kl_weight) * prob.opts.scale_idx /
                        (static_cast<double>(prob.T) * prob.Hi);
    const bool bf16 = p.q_idx.dtype == DType::kBFloat16;
    for (int which = 0; which < 2; ++which) {
      const TensorRef& out = which == 0 ? p.dq_idx : p.dk_idx;
      if (!out.defined()) continue;
      const auto* acc = at<unsigned long long>(ws, which == 0 ? pl.dq_acc : pl.dk_acc);
      const int32_t H = which == 0 ? prob.Hi : prob.Hik;
      MSA_TRY(bf16 ? finalize_grad<cutlass::bfloat16_t>(acc, prob.T, H, prob.Di, out, kl_grad, base, stream)
                   : finalize_grad<cutlass::half_t>(acc, prob.T, H, prob.Di, out, kl_grad, base, stream));
    }
  }
  const cudaError_t e = cudaGetLastError();
  return e == cudaSuccess ? Status::Ok() : cuda_error(fn, e);
}

Status kl_divergence(const Problem& prob, const KlParams& p) {
  const char* fn = "kl_divergence";
  Plan pl;
  const KlInputs in{p.q, p.k, p.lse, p.q_idx, p.k_idx, p.cu_seqlens, p.block_idx};
  MSA_TRY(kl_plan(prob, in, &pl));
  MSA_TRY(need_workspace(fn, pl, p.launch));
  DeviceGuard guard(p.q.device.index);
  const cudaStream_t stream = static_cast<cudaStream_t>(p.launch.stream);
  void* ws = p.launch.workspace;
  if (prob.T == 0) {
    const cudaError_t e = cudaMemsetAsync(p.kl.data, 0, sizeof(float), stream);
    return e == cudaSuccess ? Status::Ok() : cuda_error(fn, e);
  }
  const int32_t* cu =
      p.cu_seqlens.defined() ? static_cast<const int32_t*>(p.cu_seqlens.data) : nullptr;
  const int32_t nseq = num_seqs(p.cu_seqlens);
  EntryArgs entries{};
  if (pl.sparse) MSA_TRY(build_entries(fn, pl, prob, p.block_idx, cu, nseq, ws, stream, &entries));
  WorkArgs work{};
  MSA_TRY(build_work(fn, pl, pl.kl_work, prob, entries, cu, nseq, ws, stream, &work));
  MSA_TRY(run_kl(fn, pl, prob, in, entries, work, ws, stream));
  finalize_kl_kernel<<<1, 1024, 0, stream>>>(
      at<unsigned long long>(ws, pl.kl_acc), prob.T, prob.Hi, static_cast<float*>(p.kl.data),
      p.kl_rows.defined() ? static_cast<float*>(p.kl_rows.data) : nullptr,
      p.kl_rows.defined() ? p.kl_rows.stride[0] : 0, p.kl_rows.defined() ? p.kl_rows.stride[1] : 0);
  const cudaError_t e = cudaGetLastError();
  return e == cudaSuccess ? Status::Ok() : cuda_error(fn, e);
}

}  // namespace msa::cuda
