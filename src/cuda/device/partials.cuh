// The KV-block pass's partial outputs (FwdKvArgs::part_o): one row of D elements a (token, head,
// slot), written by fwd_kv_kernel from its wgmma accumulator and read back into the query tiles'
// accumulator by fwd_kernel's merge, both in the accumulator's own register order.
//
// A wgmma accumulator row gives the thread at quad lane q the columns 8 a + 2 q + e (a group of
// 8 columns, e in {0, 1}); its c-th value of the row (acc_rowcol order) is column
// 8 (c / 2) + 2 q + c % 2. A partial row stores, inside each group of 32 columns, the pair
// (a, q) at the place of (q, a): column 32 k + 8 a + 2 q + e at position 32 k + 8 q + 2 a + e.
// Thread q's values c = 8 k .. 8 k + 7 are then the 16 contiguous bytes at 32 k + 8 q: a row
// moves as D / 32 16-byte loads or stores a thread, and a quad's four lanes cover 64
// contiguous bytes (two whole sectors) at each of them. The map is its own inverse.
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/array.h>

#include "load.cuh"
#include "softmax.cuh"
#include "utils.cuh"

namespace msa::cuda::kern {

// Position of column `col` in a partial row (and of position `col`'s column: an involution).
__host__ __device__ constexpr int partial_pos(int col) {
  return (col & ~31) | ((col & 6) << 2) | ((col >> 2) & 6) | (col & 1);
}

// The slot of (token, block_idx column, head) in a pass of tokens from tok_lo
// (FwdKvArgs::part_o, part_ml): a token's slots are its columns in order, each column its Hq heads
// in a row, so that column j + 1 of a (token, head) is hq slots further.
__host__ __device__ constexpr int64_t partial_slot(int64_t token, int64_t tok_lo, int top_k, int column,
                                                   int hq, int head) {
  return ((token - tok_lo) * top_k + column) * hq + head;
}

template <class Element, int kHeadDim>
struct PartialRows {
  static_assert(kHeadDim % 32 == 0);
  static constexpr int kVecs = kHeadDim / 32;  // 16-byte vectors a thread holds of a row
  using Row = uint4[kVecs];

  // Row r of `acc` (row/column view, D / 4 values a thread) times `scale` to the partial row at
  // `dst`; q = the thread's quad lane.
  template <class TAcc>
  __device__ __forceinline__ static void store(Element* dst, const TAcc& acc, int r, int q, float scale) {
    static_assert(decltype(size<1>(acc))::value == kHeadDim / 4);
#pragma unroll
    for (int k = 0; k < kVecs; ++k) {
      cutlass::Array<Element, 8> v;
#pragma unroll
      for (int x = 0; x < 8; ++x) v[x] = static_cast<Element>(acc(r, 8 * k + x) * scale);
      *reinterpret_cast<cutlass::Array<Element, 8>*>(dst + 32 * k + 8 * q) = v;
    }
  }

  // This thread's share of the partial row at `src` (q = its quad lane), or zeros where src is
  // null.
  __device__ __forceinline__ static void load(Row& v, const Element* src, int q) {
#pragma unroll
    for (int k = 0; k < kVecs; ++k) {
      v[k] = make_uint4(0u, 0u, 0u, 0u);
      if (src != nullptr) v[k] = *reinterpret_cast<const uint4*>(src + 32 * k + 8 * q);
    }
  }

  // Row r of `acc` += w * the loaded share.
  template <class TAcc>
  __device__ __forceinline__ static void axpy(TAcc& acc, int r, float w, const Row& v) {
#pragma unroll
    for (int k = 0; k < kVecs; ++k) {
      const auto& e = *reinterpret_cast<const cutlass::Array<Element, 8>*>(&v[k]);
#pragma unroll
      for (int x = 0; x < 8; ++x) acc(r, 8 * k + x) = fmaf(w, static_cast<float>(e[x]), acc(r, 8 * k + x));
    }
  }
};

// A query tile's merge of the partials its rows' other blocks left (the split): each thread
// merges those of its kRows accumulator rows into the tile's own online softmax, a stage at a
// time: stage s holds each row's s-th partial (its unmarked slots, in column order), and a
// warp runs as many stages as its row with the most partials has. The softmax's max starts at
// the rows' largest partial max, so that a partial merged at the running max (w = 2^(m_j - max),
// at most 1) is rescaled with the rest of the row by every later change of the max.
// A stage comes into registers (fetch) or into the thread's own slot of shared memory by
// cp.async (fetch_async: 16 kVecs + 8 bytes a row, kSlotBytes for all the threads; no barrier:
// the thread reads back only its own copies); the pass's arrays (FwdSplitArgs) are passed to
// each call rather than kept.
template <class Element, int kHeadDim, int kRows>
struct PartialMerge {
  using Rows = PartialRows<Element, kHeadDim>;
  static constexpr int kVecs = Rows::kVecs;
  struct Stage {
    typename Rows::Row o[kRows];
    float2 ml[kRows];  // the partial's (max, sum); sum 0 where the row has none
  };
  // A slot of kThreads threads: vector k of row r of thread t at 16 ((r kVecs + k) kThreads + t),
  // then the rows' (max, sum) (conflict-free 16- and 8-byte accesses).
  template <int kThreads>
  static constexpr int kSlotBytes = kThreads * kRows * (16 * kVecs + 8);

  // The row's slot of column 0, ((token - tok_lo) k) Hq + head in the pass (-1: outside it); its
  // column j's is `step` (Hq) slots further.
  int32_t first[kRows];
  int32_t step = 0;
  uint32_t to_fetch[kRows];
  int q = 0;       // the thread's quad lane
  int stages = 0;  // warp-uniform
  int fetched = 0, merged = 0;

  // The thread's rows' slots that hold a partial, from their marks (FwdSplitArgs::taken, k bytes
  // a row: 0 where the KV-block pass wrote the slot; null: a row outside the pass), then those
  // slots' maxima: the softmax's max starts at their largest. The marks and the partials' (max,
  // sum) of a slot no entry wrote are never cleared, so only the unmarked slots are read.
  __device__ void init(const float* part_ml, const uint8_t* const (&marks)[kRows], int top_k, int hq,
                       const int32_t (&first_)[kRows], int lane, OnlineSoftmax<kRows>& sm) {
    q = lane & 3;
    step = hq;
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      first[r] = first_[r];
      to_fetch[r] = marks[r] != nullptr ? unmarked(marks[r], top_k) : 0u;
    }
    constexpr int kChunk = 8;  // slots requested at once
    float m0[kRows];
#pragma unroll
    for (int r = 0; r < kRows; ++r) m0[r] = -INFINITY;
    for (int j0 = 0; j0 < top_k; j0 += kChunk) {
      float v[kRows][kChunk];
#pragma unroll
      for (int r = 0; r < kRows; ++r)
#pragma unroll
        for (int i = 0; i < kChunk; ++i)
          v[r][i] = j0 + i < top_k && ((to_fetch[r] >> (j0 + i)) & 1u) ? ml(part_ml, r, j0 + i)->x : -INFINITY;
#pragma unroll
      for (int r = 0; r < kRows; ++r)
#pragma unroll
        for (int i = 0; i < kChunk; ++i) m0[r] = fmaxf(m0[r], v[r][i]);
    }
    int most = 0;
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      if (m0[r] != -INFINITY) sm.row_max[r] = __fdividef(m0[r], sm.scale_log2);
      most = max(most, __popc(to_fetch[r]));
    }
    stages = __reduce_max_sync(0xffffffffu, most);
  }

  __device__ bool pending() const { return merged < stages; }
  __device__ bool to_come() const { return fetched < stages; }

  // The next stage's loads, into registers.
  __device__ void fetch(Stage& s, const float* part_ml, const void* part_o) {
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      const int j = next(r);
      s.ml[r] = j >= 0 ? *ml(part_ml, r, j) : make_float2(0.f, 0.f);
      Rows::load(s.o[r], j >= 0 ? po(part_o, r, j) : nullptr, q);
    }
    ++fetched;
  }
  // The next stage's copies into the thread's slot (zeros where a row has none), committed.
  template <int kThreads>
  __device__ void fetch_async(char* slot, int lane, const float* part_ml, const void* part_o) {
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      const int j = next(r);
      const Element* src = po(part_o, r, max(j, 0));
#pragma unroll
      for (int k = 0; k < kVecs; ++k)
        cp_async16(slot + 16 * ((r * kVecs + k) * kThreads + lane), src + 32 * k + 8 * q, j >= 0);
      cp_async8(slot + 16 * kRows * kVecs * kThreads + 8 * (r * kThreads + lane), ml(part_ml, r, max(j, 0)),
                j >= 0);
    }
    cp_async_commit();
    ++fetched;
  }

  // Stage s merged at the softmax's running max into O (row/column view; kScaled: O in units of
  // the softmax's v_unit) and the rows' sums (a quad's lane 0 adds the partial's sum).
  template <bool kScaled, class TO>
  __device__ void merge(TO& O, OnlineSoftmax<kRows>& sm, const Stage& s) {
#pragma unroll
    for (int r = 0; r < kRows; ++r) merge_row<kScaled>(O, sm, r, s.ml[r], s.o[r]);
    ++merged;
  }
  // The stage in the thread's slot (the only copies it has in flight) merged.
  template <bool kScaled, int kThreads, class TO>
  __device__ void merge_async(TO& O, OnlineSoftmax<kRows>& sm, const char* slot, int lane) {
    cp_async_wait_all();
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      typename Rows::Row v;
#pragma unroll
      for (int k = 0; k < kVecs; ++k)
        v[k] = *reinterpret_cast<const uint4*>(slot + 16 * ((r * kVecs + k) * kThreads + lane));
      const float2 m = *reinterpret_cast<const float2*>(slot + 16 * kRows * kVecs * kThreads + 8 * (r * kThreads + lane));
      merge_row<kScaled>(O, sm, r, m, v);
    }
    ++merged;
  }

 private:
  // Row r's column j: its (max, sum) and its partial row.
  __device__ int64_t slot_of(int r, int j) const { return int64_t(max(first[r], 0)) + int64_t(j) * step; }
  __device__ const float2* ml(const float* part_ml, int r, int j) const {
    return reinterpret_cast<const float2*>(part_ml) + slot_of(r, j);
  }
  __device__ const Element* po(const void* part_o, int r, int j) const {
    return static_cast<const Element*>(part_o) + slot_of(r, j) * kHeadDim;
  }
  // The slots of a row of k <= 32 marks whose mark is 0, as bits (all loads issued at once;
  // whole words where k is a multiple of 4, as the row's start then is).
  __device__ static uint32_t unmarked(const uint8_t* row, int top_k) {
    uint32_t bits = 0u;
    if (top_k % 4 == 0) {
      uint32_t w[8];
#pragma unroll
      for (int i = 0; i < 8; ++i) w[i] = 4 * i < top_k ? reinterpret_cast<const uint32_t*>(row)[i] : ~0u;
#pragma unroll
      for (int i = 0; i < 8; ++i)
#pragma unroll
        for (int x = 0; x < 4; ++x)
          if (((w[i] >> (8 * x)) & 0xffu) == 0u) bits |= 1u << (4 * i + x);
    } else {
      uint8_t b[32];
#pragma unroll
      for (int j = 0; j < 32; ++j) b[j] = j < top_k ? row[j] : uint8_t{1};
#pragma unroll
      for (int j = 0; j < 32; ++j)
        if (b[j] == 0) bits |= 1u << j;
    }
    return bits;
  }
  // Row r's next slot to fetch (-1: none left).
  __device__ int next(int r) {
    const uint32_t b = to_fetch[r];
    to_fetch[r] = b & (b - 1u);
    return __ffs(b) - 1;
  }
  template <bool kScaled, class TO>
  __device__ void merge_row(TO& O, OnlineSoftmax<kRows>& sm, int r, float2 m_l, const typename Rows::Row& v) {
    const float m = sm.row_max[r] == -INFINITY ? 0.f : sm.row_max[r] * sm.scale_log2;
    const float w = m_l.y > 0.f ? fast_exp2(m_l.x - m) : 0.f;
    sm.row_sum[r] = fmaf(w, q == 0 ? m_l.y : 0.f, sm.row_sum[r]);
    Rows::axpy(O, r, kScaled ? __fdividef(w, sm.v_unit) : w, v);
  }
};

}  // namespace msa::cuda::kern
