// Loads of row tiles into shared memory by cp.async with zero fill: the KV-side kernels' entry
// stream and a query tile's (token, head) rows.
#pragma once

#include <cute/tensor.hpp>

#include <cstdint>

#include "utils.cuh"

namespace msa::cuda::kern {

// 16-byte cp.async with zero fill: copies 16 bytes when `pred`, else writes 16 zero bytes.
__device__ __forceinline__ void cp_async16(void* smem, const void* gmem, bool pred) {
  const uint32_t s = cute::cast_smem_ptr_to_uint(smem);
  const int n = pred ? 16 : 0;
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(s), "l"(gmem), "r"(n));
}
// 8-byte cp.async with zero fill.
__device__ __forceinline__ void cp_async8(void* smem, const void* gmem, bool pred) {
  const uint32_t s = cute::cast_smem_ptr_to_uint(smem);
  const int n = pred ? 8 : 0;
  asm volatile("cp.async.ca.shared.global [%0], [%1], 8, %2;\n" ::"r"(s), "l"(gmem), "r"(n));
}
// 4-byte cp.async with zero fill.
__device__ __forceinline__ void cp_async4(void* smem, const void* gmem, bool pred) {
  const uint32_t s = cute::cast_smem_ptr_to_uint(smem);
  const int n = pred ? 4 : 0;
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(s), "l"(gmem), "r"(n));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
__device__ __forceinline__ void cp_async_wait_all() {
  asm volatile("cp.async.wait_group 0;\n" ::: "memory");
}
// Waits until at most N of this thread's cp.async groups are pending.
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

// Rows [0, kRowsTile) of a swizzled shared tile from global rows: row_ptr(row) gives the row's
// first element, or nullptr for a zero row. kDim elements per row, 16 bytes per copy.
template <int kRowsTile, int kDim, class SmemTensor, class RowPtr>
__device__ inline void load_rows_async(SmemTensor&& s, RowPtr row_ptr, int tid, int nthreads) {
  constexpr int kChunks = kDim / 8;
  for (int e = tid; e < kRowsTile * kChunks; e += nthreads) {
    const int row = e / kChunks, c = e % kChunks;
    const auto* src = row_ptr(row);
    cp_async16(&s(row, c * 8), src != nullptr ? src + c * 8 : nullptr, src != nullptr);
  }
}

// The 64 (token, head) columns of an entry as a [64, kDim] row tile (column c = token * Gi +
// head), loaded by kThreads threads with cp.async; the entry's tokens are packed indices (any
// tokens, not only consecutive ones). A thread copies one 16-byte chunk of rows row0,
// row0 + kRowStep, ...: kRowStep is a multiple of the swizzle atom's 8 rows, so those rows'
// shared offsets differ by a constant, and their (token slot, head) advance by a constant
// (dtok, dhead) with one carry. The constructor does the divisions and the swizzled
// addressing once; an entry then costs each thread a shared-memory read and a few integer
// operations per 16-byte copy.
template <int kDim, int kThreads>
struct ColumnLoader {
  static constexpr int kRows = 64;
  static constexpr int kChunks = kDim / 8;
  static constexpr int kIters = kRows * kChunks / kThreads;
  static constexpr int kRowStep = kThreads / kChunks;  // rows between one thread's copies
  static_assert(kRows * kChunks % kThreads == 0 && kThreads % kChunks == 0 && kRowStep % 8 == 0,
                "a thread's rows must sit at the same place in their swizzle atoms");
  int32_t Gi, tok0, head0, dtok, dhead, soff0, dsoff, chunk;

  // smem: the tile of stage 0 (a CuTe tensor); offsets are in elements from its start.
  template <class SmemTensor>
  __device__ ColumnLoader(const SmemTensor& smem, int32_t gi, int tid) : Gi(gi) {
    chunk = tid % kChunks;
    const int row0 = tid / kChunks;
    tok0 = row0 / Gi;
    head0 = row0 - tok0 * Gi;
    dtok = kRowStep / Gi;
    dhead = kRowStep - dtok * Gi;
    const auto* base = &smem(0, 0);
    soff0 = static_cast<int32_t>(&smem(row0, chunk * 8) - base);
    dsoff = kIters > 1 ? static_cast<int32_t>(&smem(row0 + kRowStep, chunk * 8) - base) - soff0 : 0;
  }

  // Steps (tok, head) on by kRowStep rows.
  __device__ __forceinline__ void advance(int32_t& tok, int32_t& head) const {
    tok += dtok;
    head += dhead;
    if (head >= Gi) {
      head -= Gi;
      ++tok;
    }
  }

  // The tokens of this thread's rows: the packed indices toks[slot] (-1: no such token).
  template <int N>
  __device__ void tokens(const int32_t (&toks)[N], int32_t count, int32_t (&out)[kIters]) const {
    int32_t tok = tok0, head = head0;
#pragma unroll
    for (int j = 0; j < kIters; ++j) {
      out[j] = tok < count ? toks[tok] : -1;
      advance(tok, head);
    }
  }

  // The rows of tokens t[] (packed indices, from tokens()) into the tile at dst; src points at
  // the entry's first head of packed token 0, so a row is src + t * s0 + head * s1.
  template <class Element>
  __device__ void load(Element* dst, const Element* src, int64_t s0, int64_t s1,
                       const int32_t (&t)[kIters]) const {
    int32_t tok = tok0, head = head0;
#pragma unroll
    for (int j = 0; j < kIters; ++j) {
      const bool ok = t[j] >= 0;
      cp_async16(dst + soff0 + j * dsoff, ok ? src + t[j] * s0 + head * s1 + chunk * 8 : src, ok);
      advance(tok, head);
    }
  }

  // The rows of an entry into two tiles at once (Q and dO), for a producer with few registers:
  // each row's token is read from `toks` (shared memory) when its copies are issued, and the
  // rows are walked one at a time. srcA/srcB point at the entry's first head of packed token 0.
  template <class Element>
  __device__ void load_two(Element* dstA, const Element* srcA, int64_t a0, int64_t a1,
                           Element* dstB, const Element* srcB, int64_t b0, int64_t b1,
                           const int32_t* toks, int32_t count) const {
    int32_t tok = tok0, head = head0;
#pragma unroll 1
    for (int j = 0; j < kIters; ++j) {
      const bool ok = tok < count;
      const int64_t t = ok ? toks[tok] : 0;
      const int32_t off = soff0 + j * dsoff;
      cp_async16(dstA + off, srcA + t * a0 + head * a1 + chunk * 8, ok);
      cp_async16(dstB + off, srcB + t * b0 + head * b1 + chunk * 8, ok);
      advance(tok, head);
    }
  }

  // load over an entry of two records: the tile's tokens [0, split) are the first record's
  // (toks0, count0, heads from head0), tokens [split, 2 split) the second's; src points at head 0
  // of packed token 0.
  template <class Element>
  __device__ void load_halves(Element* dst, const Element* src, int64_t s0, int64_t s1, int32_t split,
                              const int32_t* toks0, int32_t count0, int32_t head0_,
                              const int32_t* toks1, int32_t count1, int32_t head1_) const {
    int32_t tok = tok0, head = head0;
#pragma unroll
    for (int j = 0; j < kIters; ++j) {
      const bool second = tok >= split;
      const int32_t tt = second ? tok - split : tok;
      const bool ok = tt < (second ? count1 : count0);
      const int64_t t = ok ? (second ? toks1 : toks0)[tt] : 0;
      const int32_t hd = (second ? head1_ : head0_) + head;
      cp_async16(dst + soff0 + j * dsoff, src + t * s0 + hd * s1 + chunk * 8, ok);
      advance(tok, head);
    }
  }

  // load_two over an entry step of two records: the tile's tokens [0, split) are the first
  // record's (toks0, count0, heads from head0), tokens [split, 2 split) the second's (toks1,
  // count1, heads from head1); srcA/srcB point at head 0 of packed token 0.
  template <class Element>
  __device__ void load_two_halves(Element* dstA, const Element* srcA, int64_t a0, int64_t a1,
                                  Element* dstB, const Element* srcB, int64_t b0, int64_t b1,
                                  int32_t split, const int32_t* toks0, int32_t count0, int32_t head0_,
                                  const int32_t* toks1, int32_t count1, int32_t head1_) const {
    int32_t tok = tok0, head = head0;
#pragma unroll 1
    for (int j = 0; j < kIters; ++j) {
      const bool second = tok >= split;
      const int32_t tt = second ? tok - split : tok;
      const bool ok = tt < (second ? count1 : count0);
      const int64_t t = ok ? (second ? toks1 : toks0)[tt] : 0;
      const int32_t hd = (second ? head1_ : head0_) + head;
      const int32_t off = soff0 + j * dsoff;
      cp_async16(dstA + off, srcA + t * a0 + hd * a1 + chunk * 8, ok);
      cp_async16(dstB + off, srcB + t * b0 + hd * b1 + chunk * 8, ok);
      advance(tok, head);
    }
  }
};

// The rows of a block of keys: rows [0, count) of a swizzled [kRowsTile, kDim] tile by cp.async
// from base + row * s0 (base: the block's first row of one head), zero rows past count.
template <int kRowsTile, int kDim, class SmemTensor, class Element>
__device__ inline void load_block_rows_async(SmemTensor&& s, const Element* base, int64_t s0,
                                             int32_t count, int tid, int nthreads) {
  load_rows_async<kRowsTile, kDim>(
      s, [&](int row) { return row < count ? base + row * s0 : nullptr; }, tid, nthreads);
}

// The rows of a block of keys into a swizzled [kRowsTile, kDim] tile of 16-bit words, as
// load_block_rows_async, for a kernel that loads one such block after another: every thread
// copies the same 16-byte chunk of rows row0, row0 + kRowStep, ... (kRowStep a multiple of the
// swizzle atom's 8 rows, so those rows' shared offsets differ by a constant). The constructor
// does the divisions and the swizzled addressing once; a block then costs each thread one
// multiply-add and a compare per copy.
template <int kRowsTile, int kDim, int kThreads>
struct BlockRowLoader {
  static constexpr int kChunks = kDim / 8;
  static constexpr int kRowStep = kThreads / kChunks;
  static constexpr int kIters = kRowsTile / kRowStep;
  static_assert(kThreads % kChunks == 0 && kRowsTile % kRowStep == 0 && kRowStep % 8 == 0,
                "a thread's rows must sit at the same place in their swizzle atoms");
  int32_t row0, chunk, soff0, dsoff;

  // smem: any tile of the layout (a CuTe tensor); offsets are in elements from its start.
  template <class SmemTensor>
  __device__ BlockRowLoader(const SmemTensor& smem, int tid) : row0(tid / kChunks), chunk(tid % kChunks) {
    const auto* base = &smem(0, 0);
    soff0 = static_cast<int32_t>(&smem(row0, chunk * 8) - base);
    dsoff = kIters > 1 ? static_cast<int32_t>(&smem(row0 + kRowStep, chunk * 8) - base) - soff0 : 0;
  }

  // Rows [0, count) from src + row * stride (src: the block's first row) into the tile at dst;
  // zeros in the rows past count.
  template <class Element>
  __device__ __forceinline__ void load(Element* dst, const Element* src, int64_t stride, int32_t count) const {
    const Element* p = src + row0 * stride + chunk * 8;
    const int64_t step = kRowStep * stride;
#pragma unroll
    for (int j = 0; j < kIters; ++j) {
      const bool ok = row0 + j * kRowStep < count;
      cp_async16(dst + soff0 + j * dsoff, ok ? p : src, ok);
      p += step;
    }
  }

  // Rows [0, kRowsTile) from anywhere: row_ptr(row) gives the row's first element, or nullptr
  // for a zero row (`any`: a valid address for the copies that write zeros).
  template <class Element, class RowPtr>
  __device__ __forceinline__ void load_rows(Element* dst, RowPtr row_ptr, const Element* any) const {
#pragma unroll
    for (int j = 0; j < kIters; ++j) {
      const Element* p = row_ptr(row0 + j * kRowStep);
      cp_async16(dst + soff0 + j * dsoff, p != nullptr ? p + chunk * 8 : any, p != nullptr);
    }
  }

  // The sign of every element this thread copied flipped (16-bit elements; after its copies
  // are waited for).
  template <class Element>
  __device__ __forceinline__ void negate(Element* dst) const {
#pragma unroll
    for (int j = 0; j < kIters; ++j) {
      uint4* v = reinterpret_cast<uint4*>(dst + soff0 + j * dsoff);
      *v = negate8(*v);
    }
  }
};

// BlockRowLoader for few threads (one warp's slice of a block), where kThreads / (kDim / 8)
// rows per step would not be a multiple of the swizzle atom's 8 rows: thread t copies rows
// t % 8 + 8 i and the 16-byte chunks t / 8 + (kThreads / 8) j. Its rows sit at the same place
// in their atoms, so the shared offsets of its chunks are computed once and an atom of 8 rows
// further is a constant step.
template <int kRowsTile, int kDim, int kThreads>
struct SliceRowLoader {
  static constexpr int kChunks = kDim / 8;
  static constexpr int kGroups = kThreads / 8;
  static constexpr int kPerRow = kChunks / kGroups;
  static constexpr int kRowIters = kRowsTile / 8;
  static_assert(kThreads % 8 == 0 && kChunks % kGroups == 0 && kRowsTile % 8 == 0,
                "8-row atoms, and a whole number of chunks per thread and row");
  int32_t r8, group, soff[kPerRow], dsoff8;

  template <class SmemTensor>
  __device__ SliceRowLoader(const SmemTensor& smem, int tid) : r8(tid % 8), group(tid / 8) {
    const auto* base = &smem(0, 0);
#pragma unroll
    for (int j = 0; j < kPerRow; ++j)
      soff[j] = static_cast<int32_t>(&smem(r8, (group + kGroups * j) * 8) - base);
    dsoff8 = kRowIters > 1 ? static_cast<int32_t>(&smem(r8 + 8, group * 8) - &smem(r8, group * 8)) : 0;
  }

  // Rows [0, count) from src + row * stride into the tile at dst; zeros in the rows past count
  // (count may be 0 or negative: all zeros).
  template <class Element>
  __device__ __forceinline__ void load(Element* dst, const Element* src, int64_t stride, int32_t count) const {
#pragma unroll
    for (int i = 0; i < kRowIters; ++i) {
      const int32_t row = r8 + 8 * i;
      const bool ok = row < count;
      const Element* p = src + row * stride + group * 8;
#pragma unroll
      for (int j = 0; j < kPerRow; ++j)
        cp_async16(dst + soff[j] + i * dsoff8, ok ? p + kGroups * 8 * j : src, ok);
    }
  }
};

// load_block_rows_async, waited for: the rows are in shared memory and visible to every thread
// of the CTA when this returns (all of the thread's earlier cp.async groups are waited for too).
template <int kRowsTile, int kDim, class SmemTensor, class Element>
__device__ inline void load_block_rows_now(SmemTensor&& s, const Element* base, int64_t s0,
                                           int32_t count, int tid, int nthreads) {
  load_block_rows_async<kRowsTile, kDim>(s, base, s0, count, tid, nthreads);
  cp_async_commit();
  cp_async_wait_all();
  cutlass::arch::fence_view_async_shared();
  __syncthreads();
}

// Rows (token, head) of a [T, H, D] tensor into a swizzled [kRowsTile, kHeadDim] shared tile:
// row = token * heads + head, `tokens` tokens from `base` (the first token's row of head 0),
// heads first_head .. first_head + heads - 1; zero rows past them. 16-byte chunks: 8 elements of
// 16 bits or 16 of E4M3. Every chunk of the thread is requested before any has landed (one
// cp.async group, committed here), so a tile costs one round trip to memory rather than one per
// chunk the thread copies; the caller waits (cp_async_wait_all), then negate_head_rows if
// needed, then fences and syncs as for any shared write the MMAs read.
template <int kRowsTile, int kHeadDim, int kThreadsUsed, class SmemTensor, class Element>
__device__ __forceinline__ void load_head_rows_async(SmemTensor& s, const Element* base, int64_t s0,
                                                     int64_t s1, int32_t first_head, int32_t heads,
                                                     int32_t tokens, int tidx) {
  constexpr int kPer = 16 / sizeof(Element);
  constexpr int kChunks = kHeadDim / kPer;
  constexpr int kIters = (kRowsTile * kChunks + kThreadsUsed - 1) / kThreadsUsed;
  const int32_t rows_used = tokens * heads;
#pragma unroll
  for (int i = 0; i < kIters; ++i) {
    const int e = tidx + i * kThreadsUsed;
    if (kRowsTile * kChunks % kThreadsUsed != 0 && e >= kRowsTile * kChunks) break;
    const int row = e / kChunks, c = e % kChunks;
    const int tok = row / heads, h = row - tok * heads;
    const bool ok = row < rows_used;
    const Element* src = ok ? base + tok * s0 + (int64_t)(first_head + h) * s1 + c * kPer : base;
    cp_async16(&s(row, c * kPer), src, ok);
  }
  cp_async_commit();
}

// Flips the sign of every element of the chunks this thread copied with load_head_rows_async
// (16-bit elements), once its copies have landed; padding rows stay zero.
template <int kRowsTile, int kHeadDim, int kThreadsUsed, class SmemTensor>
__device__ __forceinline__ void negate_head_rows(SmemTensor& s, int tidx) {
  constexpr int kChunks = kHeadDim / 8;
  for (int e = tidx; e < kRowsTile * kChunks; e += kThreadsUsed) {
    uint4* v = reinterpret_cast<uint4*>(&s(e / kChunks, (e % kChunks) * 8));
    *v = negate8(*v);
  }
}

// load_head_rows_async, waited for (and negated: `negate` flips every sign, 16-bit elements):
// the thread's chunks are in shared memory when this returns; the caller fences and syncs.
template <int kRowsTile, int kHeadDim, int kThreadsUsed, class SmemTensor, class Element>
__device__ inline void load_head_rows(SmemTensor& s, const Element* base, int64_t s0, int64_t s1,
                                      int32_t first_head, int32_t heads, int32_t tokens, int tidx,
                                      bool negate = false) {
  load_head_rows_async<kRowsTile, kHeadDim, kThreadsUsed>(s, base, s0, s1, first_head, heads,
                                                         tokens, tidx);
  cp_async_wait_all();
  if constexpr (sizeof(Element) == 2) {
    if (negate) negate_head_rows<kRowsTile, kHeadDim, kThreadsUsed>(s, tidx);
  }
}

// Rows of a [kBlockN, kDim] stage holding the block of keys key0.. that lie past the sequence end
// (they belong to the next sequence) set to zero: a probability of 0 times a NaN there is not 0.
// Run by the 128 threads of one consumer warpgroup `wg` (lt: thread index in it), which then sync.
template <int kBlockN, int kDim, class StageTensor>
__device__ inline void zero_tail_rows(StageTensor&& s, int32_t key0, int32_t key_len, int lt, int wg) {
  if (key0 + kBlockN <= key_len) return;
  const int32_t valid = max(key_len - key0, 0);  // 0: a block past the keys (unchecked lengths)
  constexpr int kChunks = kDim / 8;
  for (int e = lt; e < (kBlockN - valid) * kChunks; e += 128) {
    const int row = valid + e / kChunks, c = e % kChunks;
    *reinterpret_cast<uint4*>(&s(row, c * 8)) = make_uint4(0, 0, 0, 0);
  }
  cutlass::arch::fence_view_async_shared();
  cutlass::arch::NamedBarrier::sync(128, static_cast<uint32_t>(Barrier::kVTail) + wg);
}

}  // namespace msa::cuda::kern
