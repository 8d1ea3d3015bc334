// Sparse (or dense) attention of new tokens over a paged KV cache (docs/contract.md §3 and §6):
// decode with 1..16 tokens per sequence, and chunked prefill with the same kernel.
//
// Rows: a tile packs m = rows / G new tokens of one sequence x the G query heads of one KV head
// (grid.y) into MMA rows (row = token * G + head), so decode's few tokens still fill a tile with
// heads. Block list: the union of the tile's selections (each of its tokens x the Hi / Hkv index
// heads of the KV head), built in shared memory by a bitonic sort of (block, pair) keys; each
// union block carries a 64-bit mask of the (token, index head) pairs that selected it, so a row
// attends a block only where its own pair did. Dense mode walks every causal block. The union is
// split over grid.z CTAs (split-KV): with splits > 1 each writes its rows' normalised partial
// output and LSE, and paged_combine_kernel merges them.
//
// Two layouts of the four warps (mma.sync m16n8k16, fp32 accumulation):
// - rows (kColumns false, 64 rows): each warp owns 16 rows and every key of a block. Pipeline:
//   cp.async groups K(u), V(u) for the CTA; K(u + 1) is loaded while P V runs, V(u + 1) while the
//   next S = Q K^T runs; barriers between the warps around each tile.
// - columns (kColumns true, 16 rows: a decode call whose max_q_len x G rows fit in one MMA row
//   tile, e.g. one token x 16 heads): each warp owns every row and a quarter of each block's keys,
//   loads and converts that slice itself and keeps its own online softmax, so the warps meet no
//   barrier in the block loop. At the end the four warps' (max, sum, output) are merged in
//   shared memory in warp order. A row tile of 64 would spend 3/4 of its MMAs, shared reads and
//   softmax on empty rows here.
// Online softmax in registers (exp2, signed scale folded into the scores).
// E4M3 caches (kE4M3): K(u) and V(u) are copied as codes and converted, when they land, into one
// 16-bit tile that holds K(u) for S and then V(u) for P V (device/e4m3.cuh: every warp reads the
// whole tile in the row layout, so converting it once in shared memory beats converting in each
// warp's registers); the page's K scale goes into the block's score scale and its V scale into P
// (after the row sums). Shared memory stays that of the 16-bit kernel.
// FP8 queries (Q8KV8, E4M3 instances only: a.q_scale set): the tile's query codes are read and
// converted exactly into the 16-bit Q tile, and each row's q_scale goes into its score scale
// (PagedRowState::qs) next to the page's K scale.
#pragma once

#include <cub/block/block_scan.cuh>

#include "../device/e4m3.cuh"
#include "../device/grid_dependency.cuh"
#include "../device/paged.cuh"
#include "../device/utils.cuh"

namespace msa::cuda::kern {

template <class Element_, int kHeadDim_, int kBlockN_, bool kE4M3_ = false, bool kColumns_ = false>
struct PagedAttnTraits {
  using Element = Element_;
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kBlockN = kBlockN_;
  static constexpr bool kE4M3 = kE4M3_;
  static constexpr bool kColumns = kColumns_;
  static constexpr int kWarps = 4;
  static constexpr int kThreads = 32 * kWarps;
  static constexpr int kRows = kColumns ? cuda::kPagedAttnColumnRows : cuda::kPagedAttnRows;
  static constexpr int kCtasPerSm = cuda::kPagedAttnCtasPerSm;
  static constexpr int kWarpN = kColumns ? kBlockN / kWarps : kBlockN;  // keys of a block per warp
  static_assert(!kColumns || kRows == 16, "the column layout: one m16 row tile");
  // Rows: the warps stacked over M. Columns: one warp's MMA (each warp runs its own).
  using TiledMma = TiledMMA<Sm80MmaAtom<Element>, Layout<Shape<Int<kWarps>, _1, _1>>, Tile<Int<16 * kWarps>, _16, _16>>;
  using ColumnMma = TiledMMA<Sm80MmaAtom<Element>, Layout<Shape<_1, _1, _1>>, Tile<_16, _16, _16>>;
  using SmemLayoutQ = Sm80SmemLayout<Element, kRows, kHeadDim>;
  using SmemLayoutKV = Sm80SmemLayout<Element, kBlockN, kHeadDim>;
  using SmemLayoutVt = decltype(composition(
      SmemLayoutKV{}, make_layout(Shape<Int<kHeadDim>, Int<kBlockN>>{}, GenRowMajor{})));
  using SmemLayoutRaw = E4M3SmemLayout<kBlockN, kHeadDim>;
  static constexpr int kRawWords = kE4M3 ? cosize_v<SmemLayoutRaw> : 8;
  static constexpr int kVWords = kE4M3 ? 8 : cosize_v<SmemLayoutKV>;  // E4M3: V(u) goes into k
  static constexpr int kMergeStride = kHeadDim + 4;  // floats per merged row (fewer bank conflicts)
  struct Tiles {
    alignas(128) cute::array_aligned<Element, cosize_v<SmemLayoutQ>> q;
    alignas(128) cute::array_aligned<Element, cosize_v<SmemLayoutKV>> k;
    alignas(128) cute::array_aligned<Element, kVWords> v;
    alignas(128) cute::array_aligned<uint16_t, kRawWords> k_raw;  // E4M3 codes of K(u) and V(u)
    alignas(128) cute::array_aligned<uint16_t, kRawWords> v_raw;
  };
  struct Merge {  // the column layout's per-warp results, after the block loop
    float o[kColumns ? kWarps * kRows * kMergeStride : 1];
    float max[kWarps * kRows], sum[kWarps * kRows];
  };
  struct SharedStorage {
    union {
      Tiles t;
      Merge merge;
    };
  };
  // Followed by the union arrays: uint64 mask[cap], uint32 key[cap], int32 block[cap].
  static constexpr size_t kUnionOffset = (sizeof(SharedStorage) + 15) / 16 * 16;
  static size_t smem_bytes(int32_t cap) { return kUnionOffset + size_t(cap) * 16; }
};

// Sorts keys[0, cap) ascending (cap a power of two) with all kThreads threads.
template <int kThreads>
__device__ inline void bitonic_sort(uint32_t* keys, int32_t cap, int tid) {
  for (int32_t size = 2; size <= cap; size <<= 1) {
    for (int32_t stride = size >> 1; stride > 0; stride >>= 1) {
      for (int32_t e = tid; e < cap / 2; e += kThreads) {
        const int32_t lo = 2 * stride * (e / stride) + (e % stride), hi = lo + stride;
        const bool ascending = (lo & size) == 0;
        const uint32_t x = keys[lo], y = keys[hi];
        if ((x > y) == ascending) {
          keys[lo] = y;
          keys[hi] = x;
        }
      }
      __syncthreads();
    }
  }
}

// What both layouts know of a CTA's work: its tile, KV head, split and block range, and the
// union arrays (sparse) in shared memory.
struct PagedAttnWork {
  PagedTile pt;
  int32_t kv = 0, split = 0, count = 0;
  int64_t t0 = 0;
  int32_t u_begin = 0, u_end = 0;
  const int32_t* u_block = nullptr;
  const uint64_t* u_mask = nullptr;
  bool dense = false;
  __device__ int32_t block(int32_t u) const { return dense ? u : u_block[u]; }
  __device__ uint64_t mask(int32_t u) const { return dense ? ~0ull : u_mask[u]; }
};

// The union of the tile's selections (sorted ascending, each block's pair mask) into the arrays
// after SharedStorage, or every causal block (dense); returns the number of union blocks.
// Ends with a barrier.
template <int kThreads, int kBlockN>
__device__ inline int32_t build_block_union(const PagedAttnArgs& a, const PagedTile& pt, int32_t i0,
                                            uint64_t* u_mask, uint32_t* u_key, int32_t* u_block, int tid) {
  constexpr uint32_t kNoKey = 0xffffffffu;
  const int32_t last_block = min(pt.last_pos() / kBlockN, a.max_pages - 1);
  if (a.dense) return last_block + 1;
  const int32_t ipk = a.idx_per_kv, count = pt.tile.count;
  const int64_t t0 = pt.tile.seq_start + pt.tile.first;
  const int32_t per_tok = ipk * a.top_k;
  const int32_t n = count * per_tok;
  for (int32_t e = tid; e < a.union_cap; e += kThreads) {
    uint32_t key = kNoKey;
    if (e < n) {
      const int32_t j = e / per_tok, rem = e % per_tok, ii = rem / a.top_k, c = rem % a.top_k;
      const int32_t b = a.block_idx[(t0 + j) * a.bi_s0 + int64_t(i0 + ii) * a.bi_s1 + c];
      if (b >= 0 && b <= pt.pos(j) / kBlockN && b < a.max_pages)
        key = (uint32_t(b) << 6) | uint32_t(j * ipk + ii);
    }
    u_key[e] = key;
    u_mask[e] = 0;
  }
  __syncthreads();
  bitonic_sort<kThreads>(u_key, a.union_cap, tid);
  // Union index of each key: the number of distinct blocks up to it, by a scan of per-thread
  // counts over contiguous ranges.
  using Scan = cub::BlockScan<int32_t, kThreads>;
  __shared__ typename Scan::TempStorage scan_tmp;
  const int32_t per = a.union_cap / kThreads > 0 ? a.union_cap / kThreads : 1;
  const int32_t lo = min(a.union_cap, tid * per), hi = min(a.union_cap, lo + per);
  auto is_head = [&](int32_t e) {
    return u_key[e] != kNoKey && (e == 0 || (u_key[e] >> 6) != (u_key[e - 1] >> 6));
  };
  int32_t heads = 0;
  for (int32_t e = lo; e < hi; ++e) heads += is_head(e);
  int32_t before = 0, total = 0;
  Scan(scan_tmp).ExclusiveSum(heads, before, total);
  int32_t u = before - 1;
  for (int32_t e = lo; e < hi; ++e) {
    if (u_key[e] == kNoKey) break;
    if (is_head(e)) u_block[++u] = static_cast<int32_t>(u_key[e] >> 6);
    atomicOr(reinterpret_cast<unsigned long long*>(&u_mask[u]), 1ull << (u_key[e] & 63));
  }
  __syncthreads();
  return total;
}

// One row's result: out and lse (one split), or the split's normalised partial and its LSE.
// o: kN consecutive dims from d0, unnormalised (times inv); lse in natural-log units.
template <class Element, int kHeadDim, int kN>
__device__ __forceinline__ void store_paged_row(const PagedAttnArgs& a, int64_t t, int32_t head,
                                                int32_t split, int d0, const float* o, float inv,
                                                bool write_lse, float lse) {
  if (a.splits == 1) {
    Element* dst = as<Element>(a.out) + t * a.o_s0 + int64_t(head) * a.o_s1 + d0;
#pragma unroll
    for (int c = 0; c < kN; c += 2) {
      dst[c] = static_cast<Element>(o[c] * inv);
      dst[c + 1] = static_cast<Element>(o[c + 1] * inv);
    }
    if (a.lse != nullptr && write_lse) a.lse[t * a.lse_s0 + int64_t(head) * a.lse_s1] = lse;
  } else {
    const int64_t prow = (int64_t(split) * a.Tq + t) * a.Hq + head;
    float* dst = a.part_o + prow * kHeadDim + d0;
#pragma unroll
    for (int c = 0; c < kN; c += 2)
      *reinterpret_cast<float2*>(dst + c) = make_float2(o[c] * inv, o[c + 1] * inv);
    if (write_lse) a.part_lse[prow] = lse;
  }
}

// Rows of the MMA tile -> (token j, query head, index pair) of the CTA's tile.
struct PagedRow {
  int32_t pos, pair, head, j;
};
__device__ __forceinline__ PagedRow paged_row(const PagedAttnArgs& a, const PagedAttnWork& w, int32_t row) {
  const int32_t G = a.group, j = row / G;
  const int32_t head = w.kv * G + row % G;
  return {j < w.count ? w.pt.pos(j) : -1, j * a.idx_per_kv + head / a.heads_per_idx - w.kv * a.idx_per_kv,
          head, j};
}

// Per MMA row of this thread: its key position (-1: no token), its (token, index head) pair, its
// query scale (FP8 queries; else 1), the running max (log2 units) and sum of the online softmax.
template <int kRowsPerThread>
struct PagedRowState {
  int32_t pos[kRowsPerThread], pair[kRowsPerThread];
  float qs[kRowsPerThread], max[kRowsPerThread], sum[kRowsPerThread];

  template <class TC>  // cSrc: the scores' (row, column) coordinates of this thread
  __device__ PagedRowState(const PagedAttnArgs& a, const PagedAttnWork& w, const TC& cSrc) {
#pragma unroll
    for (int r = 0; r < kRowsPerThread; ++r) {
      const PagedRow pr = paged_row(a, w, get<0>(cSrc(r, 0)));
      pos[r] = pr.pos;
      pair[r] = pr.pair;
      qs[r] = a.q_scale != nullptr && pr.pos >= 0
                  ? a.q_scale[(w.t0 + pr.j) * a.qs_s0 + int64_t(pr.head) * a.qs_s1]
                  : 1.f;
      max[r] = -INFINITY;
      sum[r] = 0.f;
    }
  }
};

// Scores of one block (S: rows x columns of this thread, cSrc their coordinates, key0 the key
// of column 0) masked to the row's selection and causality, scaled, and folded into the online
// softmax; S becomes P (unnormalised) and O is rescaled.
template <int kRowsPerThread, class TS, class TC, class TO>
__device__ __forceinline__ void paged_softmax_step(TS& S, const TC& cSrc, TO& O, int32_t key0,
                                                   uint64_t mask, float scale_log2,
                                                   PagedRowState<kRowsPerThread>& st) {
#pragma unroll
  for (int r = 0; r < kRowsPerThread; ++r) {
    const bool sel = st.pos[r] >= 0 && ((mask >> st.pair[r]) & 1);
    const float row_scale = scale_log2 * st.qs[r];
    float mx = -INFINITY;
#pragma unroll
    for (int c = 0; c < size<1>(S); ++c) {
      const bool ok = sel && key0 + get<1>(cSrc(r, c)) <= st.pos[r];
      S(r, c) = ok ? S(r, c) * row_scale : -INFINITY;
      mx = fmaxf(mx, S(r, c));
    }
    mx = quad_max(mx);
    const float m_new = fmaxf(st.max[r], mx);
    const float m_use = m_new == -INFINITY ? 0.f : m_new;
    const float alpha = exp2f(st.max[r] - m_use);
    st.max[r] = m_new;
    float sum = 0.f;
#pragma unroll
    for (int c = 0; c < size<1>(S); ++c) {
      S(r, c) = exp2f(S(r, c) - m_use);
      sum += S(r, c);
    }
    st.sum[r] = st.sum[r] * alpha + sum;
#pragma unroll
    for (int c = 0; c < size<1>(O); ++c) O(r, c) *= alpha;
  }
}

// The MMAs of one attention tile, in either layout: thread t of `mma` over the shared tiles
// sQ [kRows, D], sK [kCols keys, D] and sVt [D, kCols keys], every operand by ldmatrix one k16
// slice at a time (registers go to S and O). Calls body(mma_state) with
//   accS, S, cSrc   the scores' accumulator, its (row, column) view and their coordinates;
//   accO, O         the output's accumulator (cleared) and view;
//   qk()            S = Q K^T into accS;
//   p_of()          P = accS in Element (the A operand of P V);
//   pv(rP)          O += P V.
template <class Element, int kRows, int kCols, int kHeadDim, class Mma, class TQ, class TK, class TVt,
          class Body>
__device__ __forceinline__ void with_tile_mma(const Mma& mma, int t, const TQ& sQ, const TK& sK, const TVt& sVt,
                                              Body&& body) {
  auto thr = mma.get_thread_slice(t);
  Tensor tSrQ = thr.partition_fragment_A(sQ);
  Tensor tSrK = thr.partition_fragment_B(sK);
  Tensor tOrVt = thr.partition_fragment_B(sVt);
  auto s2r_q = make_tiled_copy_A(Copy_Atom<SM75_U32x4_LDSM_N, Element>{}, mma);
  auto s2r_k = make_tiled_copy_B(Copy_Atom<SM75_U32x4_LDSM_N, Element>{}, mma);
  auto s2r_v = make_tiled_copy_B(Copy_Atom<SM75_U16x8_LDSM_T, Element>{}, mma);
  auto thr_q = s2r_q.get_thread_slice(t);
  auto thr_k = s2r_k.get_thread_slice(t);
  auto thr_v = s2r_v.get_thread_slice(t);
  Tensor tQsQ = thr_q.partition_S(sQ);
  Tensor tQrQ = thr_q.retile_D(tSrQ);
  Tensor tKsK = thr_k.partition_S(sK);
  Tensor tKrK = thr_k.retile_D(tSrK);
  Tensor tVsV = thr_v.partition_S(sVt);
  Tensor tVrV = thr_v.retile_D(tOrVt);

  Tensor accS = partition_fragment_C(mma, Shape<Int<kRows>, Int<kCols>>{});
  Tensor accO = partition_fragment_C(mma, Shape<Int<kRows>, Int<kHeadDim>>{});
  clear(accO);
  Tensor cS = thr.partition_C(make_identity_tensor(Shape<Int<kRows>, Int<kCols>>{}));
  Tensor cO = thr.partition_C(make_identity_tensor(Shape<Int<kRows>, Int<kHeadDim>>{}));
  auto qk = [&] {
    clear(accS);
#pragma unroll
    for (int kk = 0; kk < size<2>(tSrK); ++kk) {
      copy(s2r_q, tQsQ(_, _, kk), tQrQ(_, _, kk));
      copy(s2r_k, tKsK(_, _, kk), tKrK(_, _, kk));
      cute::gemm(mma, tSrQ(_, _, kk), tSrK(_, _, kk), accS);
    }
  };
  auto p_of = [&] {
    Tensor rP = make_tensor_like<Element>(accS);
    convert_into(accS, rP);
    return rP;
  };
  auto pv = [&](auto& rP) {
    Tensor tOrP = make_tensor(rP.data(), sm80_acc_as_a(rP.layout()));
#pragma unroll
    for (int kk = 0; kk < size<2>(tOrVt); ++kk) {
      copy(s2r_v, tVsV(_, _, kk), tVrV(_, _, kk));
      cute::gemm(mma, tOrP(_, _, kk), tOrVt(_, _, kk), accO);
    }
  };
  struct {
    decltype(accS)& accS;
    decltype(make_tensor(accS.data(), sm80_rowcol(accS.layout()))) S;
    decltype(make_tensor(cS.data(), sm80_rowcol(cS.layout()))) cSrc;
    decltype(accO)& accO;
    decltype(make_tensor(accO.data(), sm80_rowcol(accO.layout()))) O;
    decltype(make_tensor(cO.data(), sm80_rowcol(cO.layout()))) cOrc;
    decltype(qk)& qk;
    decltype(p_of)& p_of;
    decltype(pv)& pv;
  } m{accS, make_tensor(accS.data(), sm80_rowcol(accS.layout())), make_tensor(cS.data(), sm80_rowcol(cS.layout())),
      accO, make_tensor(accO.data(), sm80_rowcol(accO.layout())), make_tensor(cO.data(), sm80_rowcol(cO.layout())),
      qk, p_of, pv};
  body(m);
}

// Block b's scores (in m, after qk) to P, in either layout: the page's K scale (E4M3) into the
// score scale, the online softmax step (key0: the key of the thread's column 0), then the page's
// V scale (E4M3) into P after the row sums. Returns P in the MMAs' element type.
template <bool kE4M3, class M, class St>
__device__ __forceinline__ auto paged_block_p(const PagedAttnArgs& a, const PagedTile& pt, M& m, St& st, int32_t b,
                                              int32_t key0, uint64_t mask) {
  float scale_log2 = a.scale_log2;
  if constexpr (kE4M3) scale_log2 *= page_scale(a.k_scale, a.k_scale_step, page_of(a, pt.pages, b));
  paged_softmax_step(m.S, m.cSrc, m.O, key0, mask, scale_log2, st);
  if constexpr (kE4M3) {
    const float vs = page_scale(a.v_scale, a.v_scale_step, page_of(a, pt.pages, b));
#pragma unroll
    for (int i = 0; i < size(m.accS); ++i) m.accS(i) *= vs;
  }
  return m.p_of();
}

// ---- Row layout: 64 rows, warps over M, every key of a block per warp.
template <class Traits>
__device__ inline void paged_attn_rows(const PagedAttnArgs& a, typename Traits::SharedStorage& ss,
                                       const PagedAttnWork& w) {
  using Element = typename Traits::Element;
  constexpr int kHeadDim = Traits::kHeadDim, kBlockN = Traits::kBlockN, kRows = Traits::kRows;
  constexpr int kThreads = Traits::kThreads;
  const int tid = threadIdx.x;
  const int32_t u_begin = w.u_begin, u_end = w.u_end;
  const PagedTile& pt = w.pt;

  Tensor sQ = make_tensor(make_smem_ptr(ss.t.q.data()), typename Traits::SmemLayoutQ{});
  Tensor sK = make_tensor(make_smem_ptr(ss.t.k.data()), typename Traits::SmemLayoutKV{});
  Element* v_tile = Traits::kE4M3 ? ss.t.k.data() : ss.t.v.data();
  Tensor sV = make_tensor(make_smem_ptr(v_tile), typename Traits::SmemLayoutKV{});
  Tensor sVt = make_tensor(make_smem_ptr(v_tile), typename Traits::SmemLayoutVt{});
  using KvElement = std::conditional_t<Traits::kE4M3, uint8_t, Element>;
  const KvElement* k_head = as<KvElement>(a.k) + int64_t(w.kv) * a.k_s2;
  const KvElement* v_head = as<KvElement>(a.v) + int64_t(w.kv) * a.v_s2;
  Tensor sKraw = make_tensor(make_smem_ptr(ss.t.k_raw.data()), typename Traits::SmemLayoutRaw{});
  Tensor sVraw = make_tensor(make_smem_ptr(ss.t.v_raw.data()), typename Traits::SmemLayoutRaw{});
  // Block b's K or V rows into s (the 16-bit tile, or the codes' tile s_raw), by a loader whose
  // per-thread offsets are computed once (the same for K and V: one layout).
  const auto kv_loader = [&] {
    if constexpr (Traits::kE4M3) return BlockRowLoader<kBlockN, kHeadDim / 2, kThreads>(sKraw, tid);
    else return BlockRowLoader<kBlockN, kHeadDim, kThreads>(sK, tid);
  }();
  auto load_kv = [&](auto& s, auto& s_raw, const KvElement* head, int64_t s0, int64_t s1, int32_t b) {
    const KvElement* src = head + int64_t(page_of(a, pt.pages, b)) * s0;
    const int32_t valid = min(kBlockN, pt.len - b * kBlockN);  // rows past the sequence: zeros
    if constexpr (Traits::kE4M3)  // codes as 16-bit words: two per word
      kv_loader.load(&s_raw(0, 0), reinterpret_cast<const uint16_t*>(src), s1 / 2, valid);
    else
      kv_loader.load(&s(0, 0), src, s1, valid);
  };
  // After the wait and barrier that land a K or V tile: E4M3 codes become the 16-bit tile
  // (free: the barrier after S = Q K^T and the one after P V end its reads).
  auto convert = [&](auto& s, auto& s_raw) {
    if constexpr (Traits::kE4M3) {
      convert_e4m3_tile<Element, kBlockN, kHeadDim>(s_raw, s, tid, kThreads);
      __syncthreads();
    }
  };
  if (u_begin < u_end) {
    load_kv(sK, sKraw, k_head, a.k_s0, a.k_s1, w.block(u_begin));
    cp_async_commit();
    load_kv(sV, sVraw, v_head, a.v_s0, a.v_s1, w.block(u_begin));
    cp_async_commit();
  }

  typename Traits::TiledMma mma;
  with_tile_mma<Element, kRows, kBlockN, kHeadDim>(mma, tid, sQ, sK, sVt, [&](auto& m) {
    constexpr int kRowsPerThread = std::decay_t<decltype(size<0>(m.S))>::value;
    PagedRowState<kRowsPerThread> st(a, w, m.cSrc);
    for (int32_t u = u_begin; u < u_end; ++u) {
      const int32_t b = w.block(u);
      const uint64_t mask = w.mask(u);
      cp_async_wait<1>();  // Q and K(u)
      __syncthreads();
      convert(sK, sKraw);
      m.qk();
      __syncthreads();  // every warp is done with K(u)
      const bool more = u + 1 < u_end;
      if (more) {
        load_kv(sK, sKraw, k_head, a.k_s0, a.k_s1, w.block(u + 1));
        cp_async_commit();
      }

      auto rP = paged_block_p<Traits::kE4M3>(a, pt, m, st, b, b * kBlockN, mask);

      if (more) cp_async_wait<1>(); else cp_async_wait<0>();  // V(u)
      __syncthreads();
      convert(sV, sVraw);
      m.pv(rP);
      __syncthreads();  // every warp is done with V(u)
      if (more) {
        load_kv(sV, sVraw, v_head, a.v_s0, a.v_s1, w.block(u + 1));
        cp_async_commit();
      }
    }

    cp_async_wait<0>();  // Q of a CTA with no blocks
    // ---- Epilogue
    constexpr float kLn2 = 0.6931471805599453f;
#pragma unroll
    for (int r = 0; r < kRowsPerThread; ++r) {
      const float sum = quad_sum(st.sum[r]);
      const PagedRow pr = paged_row(a, w, get<0>(m.cOrc(r, 0)));
      if (pr.j >= w.count) continue;
      const float inv = sum > 0.f ? 1.f / sum : 0.f;
      const float lse = sum > 0.f ? (st.max[r] + log2f(sum)) * kLn2 : -INFINITY;
#pragma unroll
      for (int c = 0; c < size<1>(m.O); c += 2) {
        const float pair[2] = {m.O(r, c), m.O(r, c + 1)};
        store_paged_row<Element, kHeadDim, 2>(a, w.t0 + pr.j, pr.head, w.split, get<1>(m.cOrc(r, c)), pair,
                                              inv, c == 0 && (tid & 3) == 0, lse);
      }
    }
  });
}

// ---- Column layout: 16 rows, each warp every row and keys [kWarpN * warp, kWarpN * (warp + 1))
// of each block; no barrier between the warps until the merge.
template <class Traits>
__device__ inline void paged_attn_columns(const PagedAttnArgs& a, typename Traits::SharedStorage& ss,
                                          const PagedAttnWork& w) {
  using Element = typename Traits::Element;
  constexpr int kHeadDim = Traits::kHeadDim, kBlockN = Traits::kBlockN, kRows = Traits::kRows;
  constexpr int kWarpN = Traits::kWarpN, kWarps = Traits::kWarps;
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int32_t u_begin = w.u_begin, u_end = w.u_end;
  const PagedTile& pt = w.pt;

  Tensor sKraw = make_tensor(make_smem_ptr(ss.t.k_raw.data()), typename Traits::SmemLayoutRaw{});
  Tensor sVraw = make_tensor(make_smem_ptr(ss.t.v_raw.data()), typename Traits::SmemLayoutRaw{});
  Tensor sKrw = local_tile(sKraw, Shape<Int<kWarpN>, Int<kHeadDim / 2>>{}, make_coord(warp, 0));
  Tensor sVrw = local_tile(sVraw, Shape<Int<kWarpN>, Int<kHeadDim / 2>>{}, make_coord(warp, 0));
  // This warp's key rows of a K or V tile.
  auto rows_of = [&](Element* tile) {
    return local_tile(make_tensor(make_smem_ptr(tile), typename Traits::SmemLayoutKV{}),
                      Shape<Int<kWarpN>, Int<kHeadDim>>{}, make_coord(warp, 0));
  };
  Element* k_tile = ss.t.k.data();
  Element* v_tile = Traits::kE4M3 ? ss.t.k.data() : ss.t.v.data();
  using KvElement = std::conditional_t<Traits::kE4M3, uint8_t, Element>;
  const KvElement* k_head = as<KvElement>(a.k) + int64_t(w.kv) * a.k_s2;
  const KvElement* v_head = as<KvElement>(a.v) + int64_t(w.kv) * a.v_s2;
  const auto kv_loader = [&] {
    if constexpr (Traits::kE4M3) return SliceRowLoader<kWarpN, kHeadDim / 2, 32>(sKrw, lane);
    else return SliceRowLoader<kWarpN, kHeadDim, 32>(rows_of(k_tile), lane);
  }();
  // The warp's rows of block b's K or V: codes into s_raw (E4M3), or values into the tile at
  // `tile` (the same offsets for both: one layout).
  auto load_kv = [&](Element* tile, auto& s_raw, const KvElement* head, int64_t s0, int64_t s1, int32_t b) {
    const KvElement* page = head + int64_t(page_of(a, pt.pages, b)) * s0;
    const int32_t valid = pt.len - b * kBlockN - warp * kWarpN;  // rows past the sequence: zeros
    const KvElement* src = valid > 0 ? page + int64_t(warp * kWarpN) * s1 : page;
    if constexpr (Traits::kE4M3)
      kv_loader.load(&s_raw(0, 0), reinterpret_cast<const uint16_t*>(src), s1 / 2, valid);
    else
      kv_loader.load(&rows_of(tile)(0, 0), src, s1, valid);
  };
  if (u_begin < u_end) {
    load_kv(k_tile, sKrw, k_head, a.k_s0, a.k_s1, w.block(u_begin));
    cp_async_commit();
    load_kv(v_tile, sVrw, v_head, a.v_s0, a.v_s1, w.block(u_begin));
    cp_async_commit();
    cp_async_wait<2>();  // Q (every thread copied some of its rows)
  } else {
    cp_async_wait<0>();
  }
  __syncthreads();

  Tensor sQ = make_tensor(make_smem_ptr(ss.t.q.data()), typename Traits::SmemLayoutQ{});
  Tensor sKw = rows_of(k_tile);
  Tensor sVw = rows_of(v_tile);
  Tensor sVt = make_tensor(make_smem_ptr(v_tile), typename Traits::SmemLayoutVt{});
  Tensor sVtw = local_tile(sVt, Shape<Int<kHeadDim>, Int<kWarpN>>{}, make_coord(0, warp));
  auto convert = [&](auto& s, const auto& s_raw) {  // the warp's slice, after its copies landed
    convert_e4m3_tile<Element, kWarpN, kHeadDim>(s_raw, s, lane, 32);
    __syncwarp();
  };

  // ---- MMA state: each warp its own single-warp MMA
  typename Traits::ColumnMma mma;
  with_tile_mma<Element, kRows, kWarpN, kHeadDim>(mma, lane, sQ, sKw, sVtw, [&](auto& m) {
    constexpr int kRowsPerThread = std::decay_t<decltype(size<0>(m.S))>::value;
    PagedRowState<kRowsPerThread> st(a, w, m.cSrc);
    // Groups in flight: K(u), V(u) at the top of step u. E4M3 codes land in their own buffers,
    // so the next block's codes are requested as soon as this block's are converted; 16-bit
    // slices are the MMAs' operands and are refilled after the MMAs that read them.
    for (int32_t u = u_begin; u < u_end; ++u) {
      const int32_t b = w.block(u);
      const uint64_t mask = w.mask(u);
      const bool more = u + 1 < u_end;
      cp_async_wait<1>();  // K(u)
      __syncwarp();
      if constexpr (Traits::kE4M3) {
        convert(sKw, sKrw);  // into the 16-bit tile, whose V(u - 1) slice P V has read
        if (more) load_kv(k_tile, sKrw, k_head, a.k_s0, a.k_s1, w.block(u + 1));
        cp_async_commit();
      }
      m.qk();
      if constexpr (!Traits::kE4M3) {
        __syncwarp();  // the warp is done with its K(u) slice
        if (more) load_kv(k_tile, sKrw, k_head, a.k_s0, a.k_s1, w.block(u + 1));
        cp_async_commit();
      }

      auto rP = paged_block_p<Traits::kE4M3>(a, pt, m, st, b, b * kBlockN + warp * kWarpN, mask);

      cp_async_wait<1>();  // V(u) (the group after it: K(u + 1), possibly empty)
      __syncwarp();
      if constexpr (Traits::kE4M3) {
        convert(sVw, sVrw);  // over the K(u) slice S has read (the warp's own)
        if (more) load_kv(v_tile, sVrw, v_head, a.v_s0, a.v_s1, w.block(u + 1));
        cp_async_commit();
      }
      m.pv(rP);
      if constexpr (!Traits::kE4M3) {
        __syncwarp();  // the warp is done with its V(u) slice
        if (more) load_kv(v_tile, sVrw, v_head, a.v_s0, a.v_s1, w.block(u + 1));
        cp_async_commit();
      }
    }
    cp_async_wait<0>();

    // ---- The warp's (max, sum, output) into the merge area, which overlays the tiles.
    __syncthreads();  // every warp is done with them
#pragma unroll
    for (int r = 0; r < kRowsPerThread; ++r) {
      const int32_t row = get<0>(m.cOrc(r, 0));
      const float sum = quad_sum(st.sum[r]);
      if ((lane & 3) == 0) {
        ss.merge.max[warp * kRows + row] = st.max[r];
        ss.merge.sum[warp * kRows + row] = sum;
      }
#pragma unroll
      for (int c = 0; c < size<1>(m.O); c += 2) {
        const int d = get<1>(m.cOrc(r, c));
        *reinterpret_cast<float2*>(&ss.merge.o[(warp * kRows + row) * Traits::kMergeStride + d]) =
            make_float2(m.O(r, c), m.O(r, c + 1));
      }
    }
  });

  // ---- Merge the warps (in warp order) and store.
  __syncthreads();
  auto& mg = ss.merge;
  constexpr int kStride = Traits::kMergeStride;
  constexpr int kPerThread = kRows * kHeadDim / Traits::kThreads;  // dims of one row per thread
  static_assert(kPerThread % 4 == 0 && kHeadDim % kPerThread == 0, "whole float4s of one row");
  const int32_t row = tid / (kHeadDim / kPerThread), d0 = tid % (kHeadDim / kPerThread) * kPerThread;
  const PagedRow pr = paged_row(a, w, row);
  if (pr.j >= w.count) return;
  float m = -INFINITY;
#pragma unroll
  for (int q = 0; q < kWarps; ++q) m = fmaxf(m, mg.max[q * kRows + row]);
  float acc[kPerThread] = {};
  float sum = 0.f;
  if (m != -INFINITY) {
#pragma unroll
    for (int q = 0; q < kWarps; ++q) {
      const float wq = exp2f(mg.max[q * kRows + row] - m);  // 0 for a warp that saw no key
      sum += wq * mg.sum[q * kRows + row];
      const float* o = &mg.o[(q * kRows + row) * kStride + d0];
#pragma unroll
      for (int e = 0; e < kPerThread; e += 4) {
        const float4 x = *reinterpret_cast<const float4*>(o + e);
        acc[e] += wq * x.x;
        acc[e + 1] += wq * x.y;
        acc[e + 2] += wq * x.z;
        acc[e + 3] += wq * x.w;
      }
    }
  }
  constexpr float kLn2 = 0.6931471805599453f;
  const float inv = sum > 0.f ? 1.f / sum : 0.f;
  const float lse = sum > 0.f ? (m + log2f(sum)) * kLn2 : -INFINITY;
  store_paged_row<Element, kHeadDim, kPerThread>(a, w.t0 + pr.j, pr.head, w.split, d0, acc, inv, d0 == 0, lse);
}

template <class Traits>
__global__ void __launch_bounds__(Traits::kThreads, Traits::kCtasPerSm)
    paged_attn_kernel(const __grid_constant__ PagedAttnArgs a) {
  grid_dependency_begin();
  using Element = typename Traits::Element;
  constexpr int kHeadDim = Traits::kHeadDim, kBlockN = Traits::kBlockN, kRows = Traits::kRows;
  constexpr int kThreads = Traits::kThreads;
  extern __shared__ __align__(128) char smem_raw[];
  auto& ss = *reinterpret_cast<typename Traits::SharedStorage*>(smem_raw);
  uint64_t* u_mask = reinterpret_cast<uint64_t*>(smem_raw + Traits::kUnionOffset);
  uint32_t* u_key = reinterpret_cast<uint32_t*>(u_mask + a.union_cap);
  int32_t* u_block = reinterpret_cast<int32_t*>(u_key + a.union_cap);

  PagedAttnWork w;
  w.pt = paged_tile(a, blockIdx.x);
  if (w.pt.tile.count == 0) return;
  w.kv = blockIdx.y;
  w.split = blockIdx.z;
  w.count = w.pt.tile.count;
  w.t0 = w.pt.tile.seq_start + w.pt.tile.first;
  w.dense = a.dense;
  w.u_block = u_block;
  w.u_mask = u_mask;
  const int tid = threadIdx.x;

  // ---- Q (its own cp.async group, the first; FP8 queries: converted by plain loads, the group
  // empty) and the block list
  Tensor sQ = make_tensor(make_smem_ptr(ss.t.q.data()), typename Traits::SmemLayoutQ{});
  const int32_t G = a.group;
  const int64_t q_off = w.t0 * a.q_s0 + int64_t(w.kv) * G * a.q_s1;  // in elements of q's dtype
  auto q_row = [&](const auto* base, int r) -> decltype(base) {
    return r < w.count * G ? base + q_off + (r / G) * a.q_s0 + (r % G) * a.q_s1 : nullptr;
  };
  bool q_codes = false;
  if constexpr (Traits::kE4M3) q_codes = a.q_scale != nullptr;
  if (q_codes) {
    load_e4m3_rows<Element, kRows, kHeadDim>(
        sQ, [&](int r) { return q_row(static_cast<const uint8_t*>(a.q), r); }, tid, kThreads);
  } else {
    load_rows_async<kRows, kHeadDim>(sQ, [&](int r) { return q_row(as<Element>(a.q), r); }, tid, kThreads);
  }
  cp_async_commit();
  const int32_t num_union =
      build_block_union<kThreads, kBlockN>(a, w.pt, w.kv * a.idx_per_kv, u_mask, u_key, u_block, tid);
  w.u_begin = static_cast<int32_t>(int64_t(num_union) * w.split / a.splits);
  w.u_end = static_cast<int32_t>(int64_t(num_union) * (w.split + 1) / a.splits);

  if constexpr (Traits::kColumns) paged_attn_columns<Traits>(a, ss, w);
  else paged_attn_rows<Traits>(a, ss, w);
}

// Merges the splits' partial outputs: one warp per (token, head) row, in split order.
template <class Element, int kHeadDim>
__global__ void __launch_bounds__(256) paged_combine_kernel(const __grid_constant__ PagedAttnArgs a) {
  grid_dependency_begin();
  const int64_t row = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) / 32;
  const int lane = threadIdx.x % 32;
  if (row >= int64_t(a.Tq) * a.Hq) return;
  const int64_t t = row / a.Hq;
  const int32_t h = static_cast<int32_t>(row % a.Hq);
  const int64_t plane = int64_t(a.Tq) * a.Hq;
  float mx = -INFINITY;
  for (int s = 0; s < a.splits; ++s) mx = fmaxf(mx, a.part_lse[s * plane + row]);
  constexpr int kPer = kHeadDim / 32;
  float acc[kPer] = {};
  float sum = 0.f;
  if (mx != -INFINITY) {
    for (int s = 0; s < a.splits; ++s) {
      const float w = expf(a.part_lse[s * plane + row] - mx);
      sum += w;
      const float* o = a.part_o + (s * plane + row) * kHeadDim;
#pragma unroll
      for (int e = 0; e < kPer; ++e) acc[e] += w * o[lane + 32 * e];
    }
  }
  const float inv = sum > 0.f ? 1.f / sum : 0.f;
  Element* o = as<Element>(a.out) + t * a.o_s0 + int64_t(h) * a.o_s1;
#pragma unroll
  for (int e = 0; e < kPer; ++e) o[lane + 32 * e] = static_cast<Element>(acc[e] * inv);
  if (a.lse != nullptr && lane == 0)
    a.lse[t * a.lse_s0 + int64_t(h) * a.lse_s1] = sum > 0.f ? mx + logf(sum) : -INFINITY;
}

}  // namespace msa::cuda::kern
