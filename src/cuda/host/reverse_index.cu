// The reverse index and the KV-side work lists (reverse_index.h).
#include "reverse_index.h"

#include <cub/block/block_radix_sort.cuh>
#include <cub/block/block_scan.cuh>
#include <cub/device/device_radix_sort.cuh>
#include <cub/device/device_scan.cuh>
#include <cub/device/device_select.cuh>

#include <algorithm>
#include <type_traits>

#include "../device/entry_list.cuh"
#include "../device/grid_dependency.cuh"
#include "../device/pass_choice.cuh"
#include "common.h"

namespace msa::cuda {
namespace {

// One reverse-index key per (token, index head, slot) of the tokens [t_lo, t_hi): the segment
// (KV tile of the selected block, KV head, index head of that KV head), the token's packed
// index and the slot (the block's column in the row). Slots outside [0, blk(t)] get `invalid`
// (sorted past every real key), as do the entries `taken` marks (the split forward's query
// tiles computed them).
__global__ void key_kernel(const int32_t* block_idx, int64_t bi_s0, int64_t bi_s1,
                           const int32_t* cu, int32_t nseq, int64_t T, int64_t t_lo, int64_t t_hi,
                           int32_t Hi, int32_t k, int32_t Bk, int32_t Hkv, int32_t ipk, int tbits,
                           int sbits, uint64_t invalid, const unsigned long long* choice,
                           const uint8_t* taken, kern::PagedKeys paged, uint64_t* keys) {
  grid_dependency_begin();
  // kAuto chose the query-tile forward: no entries (the sort still runs, on invalid keys).
  const bool none = choice != nullptr && !kern::split_chosen(choice);
  // n < 2^31 (make_plan): 32-bit index arithmetic.
  const int32_t n = static_cast<int32_t>((t_hi - t_lo) * Hi * k), hk = Hi * k;
  for (int32_t e = blockIdx.x * blockDim.x + threadIdx.x; e < n; e += gridDim.x * blockDim.x) {
    const int32_t dt = e / hk;
    const int64_t t = t_lo + dt;
    const int32_t rem = e - dt * hk;
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
    uint64_t key = invalid;
    if (!none && t >= start && t < end && (taken == nullptr || taken[e] == 0)) {
      // The token's position and its sequence's first KV tile (paged keys or keys apart: the
      // tokens are the last ones of the sequence's keys; paged, its KV tiles are its max_pages
      // blocks).
      int64_t pos = t - start, keys = end - start;
      const int64_t x0 = paged.first_kv_tile(s, start, Bk);
      if (paged.keyed()) {
        keys = paged.seq_keys(s);
        pos += keys > end - start ? keys - (end - start) : 0;
      }
      // A block of the sequence's keys up to the token's own (the second test only fails for
      // unchecked lengths shorter than the tokens: no KV tile of another sequence is named).
      const int32_t b = block_idx[t * bi_s0 + i * bi_s1 + slot];
      if (b >= 0 && b <= pos / Bk && int64_t(b) * Bk < keys) {
        const int64_t x = x0 + b;
        const uint64_t seg = static_cast<uint64_t>((x * Hkv + i / ipk) * ipk + i % ipk);
        key = (((seg << tbits) | static_cast<uint64_t>(t)) << sbits) | static_cast<uint64_t>(slot);
      }
    }
    keys[e] = key;
  }
}

// first[p] = 1 where sorted key p is a real key and the first of its (segment, token): a block
// repeated in a row (which the value checks refuse) counts once, at its first column.
__global__ void first_kernel(const uint64_t* keys, int64_t n, int sbits, uint64_t invalid,
                             uint8_t* first) {
  grid_dependency_begin();
  for (int64_t p = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; p < n;
       p += static_cast<int64_t>(gridDim.x) * blockDim.x)
    first[p] = keys[p] != invalid && (p == 0 || (keys[p] >> sbits) != (keys[p - 1] >> sbits));
}

// head[p] = p where unique key p starts a segment, else 0 (a max-scan then gives each key its
// segment's first position). `shift`: the segment's position in a key.
__global__ void head_kernel(const uint64_t* keys, const int32_t* count, int shift, int32_t* head) {
  grid_dependency_begin();
  const int32_t n = *count;
  for (int32_t p = blockIdx.x * blockDim.x + threadIdx.x; p < n; p += gridDim.x * blockDim.x)
    head[p] = p > 0 && (keys[p] >> shift) != (keys[p - 1] >> shift) ? p : 0;
}

// flag[p] = 1 where a record starts: a key at a multiple of m from its segment's start; 0 past
// the unique keys (the selection reads all n flags).
__global__ void flag_kernel(const int32_t* count, const int32_t* seg_first, int64_t n, int32_t m,
                            uint8_t* flag) {
  grid_dependency_begin();
  const int32_t nk = *count;
  for (int64_t p = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; p < n;
       p += static_cast<int64_t>(gridDim.x) * blockDim.x)
    flag[p] = p < nk && (p - seg_first[p]) % m == 0;
}

// The records: record e holds keys [starts[e], end), end = the next record's start or the end
// of the keys, at most m of them (a record ends where its segment or its m tokens do). Also
// seg_start[s] = the first record of a segment >= s, for s in [0, segments] (every s is written
// once: by the first record past it, or by the end, e = the number of records).
__global__ void record_kernel(const uint64_t* keys, const int32_t* count, const int32_t* starts,
                              const int32_t* num_records, int32_t m, int tbits, int sbits,
                              int32_t segments, kern::EntryRecord* records, int32_t* seg_start) {
  grid_dependency_begin();
  const int32_t nk = *count;
  const int32_t nr = *num_records;
  const uint64_t tmask = (uint64_t(1) << tbits) - 1, smask = (uint64_t(1) << sbits) - 1;
  // One warp per record: lane j < 16 writes token j and its slot, lane 16 the segment and count;
  // the segments from the previous record's (exclusive) to this one's, by all lanes.
  const int lane = threadIdx.x & 31;
  for (int32_t e = (blockIdx.x * blockDim.x + threadIdx.x) / 32; e <= nr;
       e += (gridDim.x * blockDim.x) / 32) {
    const int32_t seg = e < nr ? static_cast<int32_t>(keys[starts[e]] >> (tbits + sbits)) : segments;
    const int32_t prev = e > 0 ? static_cast<int32_t>(keys[starts[e - 1]] >> (tbits + sbits)) : -1;
    for (int32_t s = prev + 1 + lane; s <= seg; s += 32) seg_start[s] = e;
    if (e == nr) continue;
    const int32_t start = starts[e];
    const int32_t next = e + 1 < nr ? starts[e + 1] : nk;
    const int32_t cnt = min(m, next - start);
    kern::EntryRecord& rec = records[e];
    if (lane < kern::kEntryTokens) {
      const uint64_t key = keys[start + (lane < cnt ? lane : 0)];
      rec.tok[lane] = static_cast<int32_t>((key >> sbits) & tmask);
      rec.slot[lane] = static_cast<uint8_t>(key & smask);
    }
    if (lane == 16) {
      rec.seg = seg;
      rec.count = cnt;
    }
  }
}

// Work item `item` (KV tile x, KV head r): its chunk count (0 for an empty tile id, else at
// least 1 so that a block nobody selected still gets its zero dk, dv) and entry count.
__device__ inline int32_t item_chunks(const kern::EntryListParams& list, const int32_t* cu, int32_t nseq,
                                      int64_t T, int32_t Bk, int32_t Hkv, int32_t ipk, int32_t m,
                                      int32_t chunk, const kern::PagedKeys& paged, int32_t item,
                                      uint32_t* size) {
  const int64_t x = item / Hkv;
  const int32_t r = item % Hkv;
  const kern::QueryTile tile = paged.tile_of(cu, nseq, T, Bk, x);
  int32_t n = 0;
  int64_t entries = 0;
  if (tile.count > 0) {
    const kern::EntryList l(list, tile, paged.token_base(tile), x, r, Hkv, ipk, m);
    n = l.n > chunk ? static_cast<int32_t>((l.n + chunk - 1) / chunk) : 1;
    entries = l.n;
  }
  *size = static_cast<uint32_t>(entries < 0xffffffffll ? entries : 0xffffffffll);
  return n;
}

// The CTA of chunk w: the last position of the order whose first chunk is <= w (items without
// chunks come last: empty tile ids), the item there and the chunk within it.
__device__ inline kern::CtaWork cta_work(const int32_t* chunk_start, const int32_t* order,
                                         const int32_t* num_chunks, int32_t items, int64_t w) {
  int32_t lo = 0, hi = items - 1;
  while (lo < hi) {
    const int32_t mid = (lo + hi + 1) >> 1;
    if (chunk_start[mid] <= w) lo = mid; else hi = mid - 1;
  }
  const int64_t c = w - chunk_start[lo];
  const int32_t item = order[lo];
  if (c < 0 || c >= num_chunks[item]) return {-1, 0, 0, 0};
  return {item, static_cast<int32_t>(c), num_chunks[item], 0};
}

// The whole work list in one CTA of kThreads threads, kPer items each (items <= kThreads * kPer;
// the smallest such CTA is launched): per item its chunks and partial slots (an exclusive scan in
// item order), zeroed arrivals; the items sorted longest first (a stable radix sort of their
// entry counts, descending: ties keep the item order), their chunks laid out in that order (an
// exclusive scan), and each CTA's chunk. The multi-kernel path below computes the same list for
// more items.
template <int kThreads, int kPer>
struct WorkListCta {
  static constexpr int32_t kItems = kThreads * kPer;
  using Sort = cub::BlockRadixSort<uint32_t, kThreads, kPer, int32_t>;
  using Scan = cub::BlockScan<int32_t, kThreads>;
  struct Smem {
    union {
      typename Sort::TempStorage sort;
      typename Scan::TempStorage scan;
    } tmp;
    int32_t chunks[kItems];  // by item
    int32_t first[kItems];   // by position: the first chunk
    int32_t order[kItems];   // by position: the item
  };
};
constexpr int32_t kWorkListItems = WorkListCta<1024, 8>::kItems;  // the largest CTA's

template <int kThreads, int kPer>
__global__ void __launch_bounds__(kThreads, 1)
    work_list_kernel(kern::EntryListParams list, const int32_t* cu, int32_t nseq, int64_t T,
                     int32_t Bk, int32_t Hkv, int32_t ipk, int32_t m, int32_t items, int32_t chunk,
                     kern::PagedKeys paged, int size_bits, int64_t grid, int32_t* slot_start,
                     int32_t* arrivals, kern::CtaWork* cta) {
  grid_dependency_begin();
  using C = WorkListCta<kThreads, kPer>;
  extern __shared__ __align__(16) char smem_raw[];
  typename C::Smem& sm = *reinterpret_cast<typename C::Smem*>(smem_raw);
  uint32_t size[kPer];
  int32_t id[kPer], v[kPer];
  // Blocked: thread t holds items (then positions) [t * kPer, (t + 1) * kPer); past `items`,
  // size 0 and no chunks, after every real item in the stable order.
#pragma unroll
  for (int j = 0; j < kPer; ++j) {
    const int32_t item = threadIdx.x * kPer + j;
    int32_t n = 0;
    size[j] = 0;
    if (item < items) {
      n = item_chunks(list, cu, nseq, T, Bk, Hkv, ipk, m, chunk, paged, item, &size[j]);
      arrivals[item] = 0;
    }
    sm.chunks[item] = n;
    id[j] = item;
    v[j] = n > 1 ? n : 0;
  }
  typename C::Scan(sm.tmp.scan).ExclusiveSum(v, v);
#pragma unroll
  for (int j = 0; j < kPer; ++j) {
    const int32_t item = threadIdx.x * kPer + j;
    if (item < items) slot_start[item] = v[j];
  }
  __syncthreads();
  typename C::Sort(sm.tmp.sort).SortDescending(size, id, 0, size_bits);
  __syncthreads();
#pragma unroll
  for (int j = 0; j < kPer; ++j) v[j] = sm.chunks[id[j]];
  typename C::Scan(sm.tmp.scan).ExclusiveSum(v, v);
#pragma unroll
  for (int j = 0; j < kPer; ++j) {
    const int32_t pos = threadIdx.x * kPer + j;
    sm.first[pos] = v[j];
    sm.order[pos] = id[j];
  }
  __syncthreads();
  for (int64_t w = threadIdx.x; w < grid; w += kThreads)
    cta[w] = cta_work(sm.first, sm.order, sm.chunks, items, w);
}

// The multi-kernel path: per item its chunk count, partial slots, entry count and id.
__global__ void chunk_kernel(kern::EntryListParams list, const int32_t* cu, int32_t nseq, int64_t T,
                             int32_t Bk, int32_t Hkv, int32_t ipk, int32_t m, int32_t items,
                             int32_t chunk, kern::PagedKeys paged, int32_t* num_chunks,
                             int32_t* num_slots, uint32_t* sizes, int32_t* ids) {
  grid_dependency_begin();
  const int32_t item = blockIdx.x * blockDim.x + threadIdx.x;
  if (item >= items) return;
  const int32_t n = item_chunks(list, cu, nseq, T, Bk, Hkv, ipk, m, chunk, paged, item, &sizes[item]);
  num_chunks[item] = n;
  num_slots[item] = n > 1 ? n : 0;
  ids[item] = item;
}

// ordered[pos] = the chunk count of the item at position pos of the order.
__global__ void ordered_chunks_kernel(const int32_t* order, const int32_t* num_chunks, int32_t items,
                                      int32_t* ordered) {
  grid_dependency_begin();
  const int32_t pos = blockIdx.x * blockDim.x + threadIdx.x;
  if (pos < items) ordered[pos] = num_chunks[order[pos]];
}

// Each CTA's chunk from the layout (the multi-kernel path).
__global__ void cta_kernel(const int32_t* chunk_start, const int32_t* order, const int32_t* num_chunks,
                           int32_t items, int64_t grid, kern::CtaWork* cta) {
  grid_dependency_begin();
  for (int64_t w = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; w < grid;
       w += static_cast<int64_t>(gridDim.x) * blockDim.x)
    cta[w] = cta_work(chunk_start, order, num_chunks, items, w);
}

}  // namespace

// The reverse index of block_idx (the rows of tokens [t_lo, t_hi)) into the plan's buffers;
// returns the entry arguments.
Status build_entries(const char* fn, const Plan& pl, const Problem& prob, const TensorRef& bi,
                     const int32_t* cu, int32_t nseq, int64_t t_lo, int64_t t_hi, void* ws,
                     cudaStream_t stream, kern::EntryListParams* out, const kern::PagedKeys& paged,
                     const unsigned long long* choice, const uint8_t* taken) {
  uint64_t* ka = at<uint64_t>(ws, pl.keys_a);
  uint64_t* kb = at<uint64_t>(ws, pl.keys_b);
  uint8_t* flags = at<uint8_t>(ws, pl.flags);
  int32_t* counts = at<int32_t>(ws, pl.count);  // [0]: unique keys, [1]: records
  int32_t* starts = at<int32_t>(ws, pl.starts);
  kern::EntryRecord* records = at<kern::EntryRecord>(ws, pl.records);
  const int64_t n = (t_hi - t_lo) * prob.Hi * int64_t(prob.k);  // <= pl.n
  const int threads = 256;
  const int blocks = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>((n + threads - 1) / threads, num_sms() * 16)));
  const int32_t ipk = prob.Hi / prob.Hkv;
  if (n > 0) {
    launch_grid(key_kernel, blocks, threads, 0, stream, static_cast<const int32_t*>(bi.data), bi.stride[0],
                bi.stride[1], cu, nseq, prob.T, t_lo, t_hi, prob.Hi, prob.k, prob.opts.block_size, prob.Hkv,
                ipk, pl.tbits, pl.sbits, pl.invalid, choice, taken, paged, ka);
  }
  // The keys by segment alone: key_kernel writes them in (token, index head, slot) order and the
  // radix sort is stable, so a segment's keys keep their (token, slot) order, as a sort of the
  // whole key would give them, in fewer passes (9-12 bits instead of 27-33). Invalid keys have
  // every segment bit set, above every real segment (bits_for(segments) bits hold 0..segments).
  cub::DoubleBuffer<uint64_t> keys(ka, kb);
  size_t bytes = pl.cub_bytes;
  cudaError_t e = cub::DeviceRadixSort::SortKeys(at<void>(ws, pl.cub), bytes, keys,
                                                 static_cast<int>(n), pl.seg_bit, pl.end_bit, stream);
  if (e != cudaSuccess) return cuda_error(fn, e);
  // The real keys, each (segment, token) once.
  if (n > 0)
    launch_grid(first_kernel, blocks, threads, 0, stream, keys.Current(), n, pl.sbits, pl.invalid, flags);
  uint64_t* ukeys = keys.Alternate();
  bytes = pl.cub_bytes;
  e = cub::DeviceSelect::Flagged(at<void>(ws, pl.cub), bytes, keys.Current(), flags, ukeys, counts,
                                 static_cast<int>(n), stream);
  if (e != cudaSuccess) return cuda_error(fn, e);
  // The sorted keys' buffer is free now: the segment starts go there.
  int32_t* seg_first = reinterpret_cast<int32_t*>(keys.Current());
  if (n > 0) {
    launch_grid(head_kernel, blocks, threads, 0, stream, ukeys, counts, pl.seg_bit, seg_first);
  }
  bytes = pl.cub_bytes;
  e = cub::DeviceScan::InclusiveScan(at<void>(ws, pl.cub), bytes, seg_first, seg_first, MaxOp{},
                                     static_cast<int>(n), stream);
  if (e != cudaSuccess) return cuda_error(fn, e);
  if (n > 0) launch_grid(flag_kernel, blocks, threads, 0, stream, counts, seg_first, n, pl.m, flags);
  bytes = pl.cub_bytes;
  e = cub::DeviceSelect::Flagged(at<void>(ws, pl.cub), bytes, CountingIt(0), flags, starts,
                                 counts + 1, static_cast<int>(n), stream);
  if (e != cudaSuccess) return cuda_error(fn, e);
  int32_t* seg_start = at<int32_t>(ws, pl.seg_start);
  if (n > 0) {
    const int rblocks = static_cast<int>(std::min<int64_t>(((pl.entries + 1) * 32 + threads - 1) / threads, num_sms() * 16));
    launch_grid(record_kernel, rblocks, threads, 0, stream, ukeys, counts, starts, counts + 1, pl.m, pl.tbits,
                pl.sbits, static_cast<int32_t>(pl.segments), records, seg_start);
  } else {
    e = cudaMemsetAsync(seg_start, 0, 4 * (size_t(pl.segments) + 1), stream);  // no records
    if (e != cudaSuccess) return cuda_error(fn, e);
  }
  out->records = records;
  out->seg_start = seg_start;
  out->dense = false;
  return Status::Ok();
}

// The KV-side work list of the plan.
Status build_work(const char* fn, const Plan& pl, const Plan::Work& w, const Problem& prob,
                  const kern::EntryListParams& list, const int32_t* cu, int32_t nseq, void* ws,
                  cudaStream_t stream, kern::WorkListParams* out, int64_t* grid,
                  const kern::PagedKeys& paged) {
  int32_t* num_chunks = at<int32_t>(ws, w.num_chunks);
  int32_t* num_slots = at<int32_t>(ws, w.num_slots);
  uint32_t* sizes = at<uint32_t>(ws, w.sizes);
  int32_t* order = at<int32_t>(ws, w.order);
  kern::CtaWork* cta = at<kern::CtaWork>(ws, w.cta);
  const int32_t ipk = pl.Hi_group / prob.Hkv;
  cudaError_t e = cudaSuccess;
  // The smallest CTA that holds the items (a block sort's passes cost its whole width).
  auto one_cta = [&](auto threads, auto per) {
    constexpr int kThreads = decltype(threads)::value, kPer = decltype(per)::value;
    auto* kernel = work_list_kernel<kThreads, kPer>;
    const int smem = static_cast<int>(sizeof(typename WorkListCta<kThreads, kPer>::Smem));
    cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
    if (err != cudaSuccess) return err;
    launch_grid(kernel, 1, kThreads, smem, stream, list, cu, nseq, prob.T, prob.opts.block_size, prob.Hkv,
                ipk, pl.m, pl.items, w.chunk, paged, pl.size_bits, w.grid, at<int32_t>(ws, w.slot_start),
                at<int32_t>(ws, w.arrivals), cta);
    return cudaGetLastError();
  };
  if (pl.items <= kWorkListItems) {
    if (pl.items <= 128 * 4) e = one_cta(std::integral_constant<int, 128>{}, std::integral_constant<int, 4>{});
    else if (pl.items <= 256 * 8) e = one_cta(std::integral_constant<int, 256>{}, std::integral_constant<int, 8>{});
    else e = one_cta(std::integral_constant<int, 1024>{}, std::integral_constant<int, 8>{});
    if (e != cudaSuccess) return cuda_error(fn, e);
  } else {
    const int blocks = (pl.items + 255) / 256;
    launch_grid(chunk_kernel, blocks, 256, 0, stream, list, cu, nseq, prob.T, prob.opts.block_size, prob.Hkv,
                ipk, pl.m, pl.items, w.chunk, paged, num_chunks, num_slots, sizes, at<int32_t>(ws, w.ids));
    // The items longest first (a stable sort: ties keep the item order), and the chunk starts in
    // that order (the sizes' buffer is free after the sort).
    size_t bytes = pl.cub_bytes;
    e = cub::DeviceRadixSort::SortPairsDescending(at<void>(ws, pl.cub), bytes, sizes,
                                                  at<uint32_t>(ws, w.sizes_sorted), at<int32_t>(ws, w.ids),
                                                  order, pl.items, 0, pl.size_bits, stream);
    if (e != cudaSuccess) return cuda_error(fn, e);
    int32_t* ordered = reinterpret_cast<int32_t*>(sizes);
    launch_grid(ordered_chunks_kernel, blocks, 256, 0, stream, order, num_chunks, pl.items, ordered);
    bytes = pl.cub_bytes;
    e = cub::DeviceScan::ExclusiveSum(at<void>(ws, pl.cub), bytes, ordered,
                                      at<int32_t>(ws, w.chunk_start), pl.items, stream);
    bytes = pl.cub_bytes;
    if (e == cudaSuccess)
      e = cub::DeviceScan::ExclusiveSum(at<void>(ws, pl.cub), bytes, num_slots,
                                        at<int32_t>(ws, w.slot_start), pl.items, stream);
    if (e == cudaSuccess) e = cudaMemsetAsync(at<void>(ws, w.arrivals), 0, 4 * size_t(pl.items), stream);
    if (e != cudaSuccess) return cuda_error(fn, e);
    const int cblocks = static_cast<int>(std::min<int64_t>((w.grid + 255) / 256, num_sms() * 16));
    launch_grid(cta_kernel, cblocks, 256, 0, stream, at<int32_t>(ws, w.chunk_start), order, num_chunks,
                pl.items, w.grid, cta);
  }
  out->cta = cta;
  out->slot_start = at<int32_t>(ws, w.slot_start);
  out->arrivals = at<int32_t>(ws, w.arrivals);
  out->partials = at<float>(ws, w.partials);
  out->items = pl.items;
  out->chunk = w.chunk;
  *grid = w.grid;
  return Status::Ok();
}

}  // namespace msa::cuda
