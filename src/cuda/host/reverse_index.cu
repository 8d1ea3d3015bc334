// The reverse index and the KV-side work lists (reverse_index.h).
#include "reverse_index.h"

#include <cub/device/device_radix_sort.cuh>
#include <cub/device/device_reduce.cuh>
#include <cub/device/device_scan.cuh>

#include <algorithm>

#include "../device/entry_list.cuh"
#include "common.h"

namespace msa::cuda {
namespace {

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

}  // namespace

// The reverse index of block_idx into the plan's buffers; returns the entry arguments.
Status build_entries(const char* fn, const Plan& pl, const Problem& prob, const TensorRef& bi,
                     const int32_t* cu, int32_t nseq, void* ws, cudaStream_t stream,
                     kern::EntryListParams* out) {
  uint64_t* ka = at<uint64_t>(ws, pl.keys_a);
  uint64_t* kb = at<uint64_t>(ws, pl.keys_b);
  uint64_t* va = at<uint64_t>(ws, pl.vals_a);
  uint64_t* vb = at<uint64_t>(ws, pl.vals_b);
  int32_t* count = at<int32_t>(ws, pl.count);
  const int threads = 256;
  const int blocks = static_cast<int>(std::min<int64_t>((pl.n + threads - 1) / threads, num_sms() * 16));
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
  out->dense = false;
  return Status::Ok();
}

// The KV-side work list of the plan.
Status build_work(const char* fn, const Plan& pl, const Plan::Work& w, const Problem& prob,
                  const kern::EntryListParams& list, const int32_t* cu, int32_t nseq, void* ws,
                  cudaStream_t stream, kern::WorkListParams* out, int64_t* grid) {
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
  *grid = w.grid;
  return Status::Ok();
}

}  // namespace msa::cuda
