// Attention forward, KV-block-outer: for one KV block of one KV head, the partial outputs of
// every (token, head) whose selection holds it; then a combine per (token, head) over its
// selected blocks. The work a token brings is the same whatever its neighbours selected, so the
// cost does not grow with the union of a query tile's selections as the query-tile forward's
// (fwd_kernel.cuh) does; the price is the partial outputs' memory traffic.
//
// fwd_kv_kernel: one CTA walks one chunk of the entry list of one (KV block, KV head) item
// (device/entry_list.cuh: records of up to m tokens that selected the block through one index
// head; an entry's 64 columns are (token, head) pairs). Per entry, with the keys as MMA rows:
//   S^T = K Q^T                         (SS wgmma, 64 keys per consumer warpgroup),
//   column max over the block's visible keys (warp shuffles, then shared memory across warps),
//   P^T = exp2(S^T scale_log2 - max)    (bf16/fp16, to shared memory as a (column, key) tile),
//   O^T = V^T P^T                       (SS wgmma, the head dim as MMA rows),
// and writes O^T (unnormalised, element type) and (max, sum) per column to the partial slot of
// the (token, head, column of the block in the token's block_idx row). Q streams through
// kStages shared-memory stages with cp.async (EntryStream); every thread issues its share.
//
// fwd_combine_kernel: one warp per (token, head): the partials of the token's valid, distinct
// slots in slot order (deterministic), out = sum w_j O_j / sum w_j l_j with
// w_j = exp2(m_j - max_j m_j), lse = (max + log2 sum) ln 2; no valid slot: out 0, lse -inf.
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/gemm/collective/builders/sm90_common.inl>

#include "../device/entry_list.cuh"
#include "../device/kv_side_traits.cuh"
#include "../device/load.cuh"
#include "../device/softmax.cuh"
#include "../device/tile.cuh"
#include "../device/utils.cuh"
#include "../host/args.h"

namespace msa::cuda::kern {

using cuda::FwdKvArgs;

template <class Element_, int kHeadDim_, int kBlockN_>
struct FwdKvTraits : KvSideTraits<Element_, kHeadDim_, kBlockN_, 3> {
  using Base = KvSideTraits<Element_, kHeadDim_, kBlockN_, 3>;
  using Element = Element_;
  static constexpr int kHeadDim = kHeadDim_, kBlockN = kBlockN_;
  static constexpr int kBlockC = Base::kBlockC, kStages = Base::kStages;
  static constexpr int kWarpGroups = Base::kWarpGroups, kThreads = Base::kThreads;
  static constexpr int kWarps = kThreads / 32;
  static constexpr int kOWarpGroups = kWarpGroups < kHeadDim / 64 ? kWarpGroups : kHeadDim / 64;
  using typename Base::SmemLayoutK;
  using typename Base::SmemLayoutKt;
  using typename Base::SmemLayoutQ;

  // O^T = V^T P^T (SS): V^T the MN-major A operand (head dim, keys), P^T the (columns, keys) B
  // operand with the keys contiguous.
  using TileO = Shape<Int<kHeadDim>, Int<kBlockC>, Int<kBlockN>>;
  using MmaO = decltype(make_tiled_mma(
      GMMA::ss_op_selector<Element, Element, float, TileO, GMMA::Major::MN, GMMA::Major::K>(),
      Layout<Shape<Int<kOWarpGroups>, _1, _1>>{}));
  using SmemAtomP = decltype(cutlass::gemm::collective::detail::ss_smem_selector<
                             GMMA::Major::K, Element, Int<kBlockC>, Int<kBlockN>>());
  using SmemLayoutP = decltype(tile_to_shape(SmemAtomP{}, Shape<Int<kBlockC>, Int<kBlockN>>{}));
  static constexpr int kOStride = kHeadDim + 8;  // a staged O^T column, padded (16-byte rows)

  struct SharedStorage {
    alignas(1024) cute::array_aligned<Element, cosize_v<SmemLayoutK>> k;
    alignas(1024) cute::array_aligned<Element, cosize_v<SmemLayoutK>> v;
    alignas(1024) cute::array_aligned<Element, cosize_v<SmemLayoutQ>> q;
    alignas(1024) cute::array_aligned<Element, cosize_v<SmemLayoutP>> p;
    alignas(16) Element o[kBlockC * kOStride];  // O^T staged as [column][head dim]
    float red_max[kWarps][kBlockC];             // per warp: its keys' column max
    float red_sum[kWarps][kBlockC];             // per warp: its keys' column sum
    float col_max[kBlockC];
    EntryRecord ring[EntryStream<kStages>::kRing];
  };
};

template <class Traits>
struct FwdKvParams : FwdKvArgs {};

// Warp roles: kBlockN / 64 consumer warpgroups (64 keys each; the first kOWarpGroups also own 64
// rows of the head dim in O^T = V^T P^T); every thread also issues its share of the entries'
// cp.async loads and of the partials' stores. Pipeline: the entry stream (kStages stages), CTA
// barriers between the steps of an entry. Work: one chunk of one (KV block, KV head) entry list.
template <class Traits>
__global__ void __launch_bounds__(Traits::kThreads, 1)
    fwd_kv_kernel(const __grid_constant__ FwdKvParams<Traits> p) {
  using Element = typename Traits::Element;
  constexpr int kBlockN = Traits::kBlockN, kBlockC = Traits::kBlockC, kHeadDim = Traits::kHeadDim;
  constexpr int kThreads = Traits::kThreads, kWarps = Traits::kWarps, kOStride = Traits::kOStride;
  using SharedStorage = typename Traits::SharedStorage;

  extern __shared__ __align__(1024) char smem_raw[];
  SharedStorage& ss = *reinterpret_cast<SharedStorage*>(smem_raw);

  WorkItem it;
  QueryTile tile;
  EntryList list;
  int64_t e_begin, e_end;
  if (!kv_chunk<kBlockN>(p, &it, &tile, &list, &e_begin, &e_end)) return;
  if (e_begin >= e_end) return;  // no token of this pass selected the block
  const int32_t r = it.r;
  const int64_t key_base = tile.seq_start + tile.first;  // packed index of the block's first key
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int32_t Gi = p.heads_per_idx, m = p.group_tokens, ipk = p.idx_per_kv;
  // The records of the first entries; their rows are issued after the block's keys.
  EntryStream<Traits::kStages> stream(list, p.list, e_begin, e_end, ss.ring);

  Tensor sK = make_tensor(make_smem_ptr(ss.k.data()), typename Traits::SmemLayoutK{});
  Tensor sVt = make_tensor(make_smem_ptr(ss.v.data()), typename Traits::SmemLayoutKt{});
  Tensor sV = make_tensor(make_smem_ptr(ss.v.data()), typename Traits::SmemLayoutK{});
  Tensor sQ = make_tensor(make_smem_ptr(ss.q.data()), typename Traits::SmemLayoutQ{});
  Tensor sP = make_tensor(make_smem_ptr(ss.p.data()), typename Traits::SmemLayoutP{});

  // K and V of the block; keys past the sequence end are zero rows (their P is 0, and 0 * a
  // zero row adds nothing).
  load_block_rows_async<kBlockN, kHeadDim>(
      sK, as<Element>(p.k) + key_base * p.k_s0 + r * p.k_s1, p.k_s0, tile.count, tid, kThreads);
  load_block_rows_async<kBlockN, kHeadDim>(
      sV, as<Element>(p.v) + key_base * p.v_s0 + r * p.v_s1, p.v_s0, tile.count, tid, kThreads);

  // An entry's Q columns into stage st (cp.async).
  const ColumnLoader<kHeadDim, kThreads> cols_in(sQ(_, _, 0), Gi, tid);
  constexpr int kStageElems = kBlockC * kHeadDim;
  auto issue = [&](const EntryRecord& en, int st) {
    const int32_t head0 = (r * ipk + en.seg - list.seg0) * Gi;
    int32_t t[ColumnLoader<kHeadDim, kThreads>::kIters];
    cols_in.tokens(en.tok, en.count, t);
    cols_in.load(ss.q.data() + st * kStageElems, as<Element>(p.q) + head0 * p.q_s1, p.q_s0, p.q_s1, t);
  };
  stream.start(list, p.list, issue);

  typename Traits::MmaS mma_s;
  typename Traits::MmaO mma_o;
  auto thr_s = mma_s.get_thread_slice(tid);
  const bool o_thread = tid < 128 * Traits::kOWarpGroups;
  auto thr_o = mma_o.get_thread_slice(o_thread ? tid : 0);
  Tensor tSrK = thr_s.partition_fragment_A(sK);
  Tensor tSrQ = thr_s.partition_fragment_B(sQ);
  Tensor tSrS = partition_fragment_C(mma_s, Shape<Int<kBlockN>, Int<kBlockC>>{});
  Tensor tOrVt = thr_o.partition_fragment_A(sVt);
  Tensor tOrP = thr_o.partition_fragment_B(sP);
  Tensor tOrO = partition_fragment_C(mma_o, Shape<Int<kHeadDim>, Int<kBlockC>>{});
  Tensor cO = thr_o.partition_C(make_identity_tensor(Shape<Int<kHeadDim>, Int<kBlockC>>{}));

  Tensor cS = thr_s.partition_C(make_identity_tensor(Shape<Int<kBlockN>, Int<kBlockC>>{}));
  Tensor S = make_tensor(tSrS.data(), acc_rowcol(tSrS.layout()));
  Tensor cSrc = make_tensor(cS.data(), acc_rowcol(cS.layout()));
  constexpr int kRows = decltype(size<0>(S))::value;
  constexpr int kCols = decltype(size<1>(S))::value;

  for (int64_t e = e_begin; e < e_end; ++e) {
    const int st = stream.stage(e);
    stream.wait();  // also: every thread is done with the previous entry's shared tiles
    const EntryRecord& en = stream.record(e);
    const int32_t count = en.count;
    const int32_t head0 = (r * ipk + en.seg - list.seg0) * Gi;
    stream.issue_next(list, p.list, issue);
    if (count == 0) continue;

    wg_gemm<true>(mma_s, tSrK, tSrQ(_, _, _, st), tSrS);
    warpgroup_wait<0>();
    // Scores in log2 units; a column sees the block's keys up to its token (col_lim: the
    // token's position in the block; -1: no token).
    float cmax[kCols];
#pragma unroll
    for (int c = 0; c < kCols; ++c) {
      const int32_t t = get<1>(cSrc(0, c)) / Gi;
      const int32_t lim = t < count ? static_cast<int32_t>(en.tok[t] - key_base) : -1;
      cmax[c] = -INFINITY;
#pragma unroll
      for (int a = 0; a < kRows; ++a) {
        const float v = get<0>(cSrc(a, c)) <= lim ? S(a, c) * p.scale_log2 : -INFINITY;
        S(a, c) = v;
        cmax[c] = fmaxf(cmax[c], v);
      }
    }
    // Column max: the 8 lanes of a warp sharing a column, then the warps.
#pragma unroll
    for (int c = 0; c < kCols; ++c) {
      cmax[c] = fmaxf(cmax[c], __shfl_xor_sync(0xffffffff, cmax[c], 4));
      cmax[c] = fmaxf(cmax[c], __shfl_xor_sync(0xffffffff, cmax[c], 8));
      cmax[c] = fmaxf(cmax[c], __shfl_xor_sync(0xffffffff, cmax[c], 16));
    }
    if (lane < 4) {
#pragma unroll
      for (int c = 0; c < kCols; ++c) ss.red_max[warp][get<1>(cSrc(0, c))] = cmax[c];
    }
    __syncthreads();
    if (tid < kBlockC) {
      float mx = -INFINITY;
#pragma unroll
      for (int w = 0; w < kWarps; ++w) mx = fmaxf(mx, ss.red_max[w][tid]);
      ss.col_max[tid] = mx;
    }
    __syncthreads();
    // P^T = exp2(S - max) to shared memory as (column, key); per-warp column sums.
#pragma unroll
    for (int c = 0; c < kCols; ++c) {
      const int col = get<1>(cSrc(0, c));
      const float mx = ss.col_max[col];
      const float ms = mx == -INFINITY ? 0.f : mx;
      float sum = 0.f;
#pragma unroll
      for (int a = 0; a < kRows; ++a) {
        const float pr = fast_exp2(S(a, c) - ms);
        sum += pr;
        sP(col, get<0>(cSrc(a, c))) = static_cast<Element>(pr);
      }
      sum += __shfl_xor_sync(0xffffffff, sum, 4);
      sum += __shfl_xor_sync(0xffffffff, sum, 8);
      sum += __shfl_xor_sync(0xffffffff, sum, 16);
      if (lane < 4) ss.red_sum[warp][col] = sum;
    }
    cutlass::arch::fence_view_async_shared();
    __syncthreads();
    if (o_thread) {
      wg_gemm<true>(mma_o, tOrVt, tOrP, tOrO);
      warpgroup_wait<0>();
      // O^T (head dim, column) to the staging tile [column][head dim].
#pragma unroll
      for (int v = 0; v < size(tOrO); ++v)
        ss.o[get<1>(cO(v)) * kOStride + get<0>(cO(v))] = static_cast<Element>(tOrO(v));
    }
    __syncthreads();
    // The partials of the entry's real columns: O^T rows (16-byte copies) and (max, sum).
    constexpr int kChunks = kHeadDim / 8;
    for (int x = tid; x < kBlockC * kChunks; x += kThreads) {
      const int col = x / kChunks, ch = x % kChunks;
      const int32_t t = col / Gi;
      if (t >= count || col >= m * Gi) continue;
      const int64_t slot =
          (int64_t(en.tok[t] - p.tok_lo) * p.Hq + head0 + (col - t * Gi)) * p.top_k + en.slot[t];
      *reinterpret_cast<uint4*>(as<Element>(p.part_o) + slot * kHeadDim + ch * 8) =
          *reinterpret_cast<const uint4*>(&ss.o[col * kOStride + ch * 8]);
    }
    if (tid < kBlockC) {
      const int col = tid;
      const int32_t t = col / Gi;
      if (t < count && col < m * Gi) {
        float sum = 0.f;
#pragma unroll
        for (int w = 0; w < kWarps; ++w) sum += ss.red_sum[w][col];
        const int64_t slot =
            (int64_t(en.tok[t] - p.tok_lo) * p.Hq + head0 + (col - t * Gi)) * p.top_k + en.slot[t];
        *reinterpret_cast<float2*>(p.part_ml + 2 * slot) = make_float2(ss.col_max[col], sum);
      }
    }
  }
  cp_async_wait_all();
}

// One warp per (token, head) of the pass [tok_lo, tok_hi): the combine of its partials.
template <class Element, int kHeadDim>
__global__ void fwd_combine_kernel(const __grid_constant__ FwdKvArgs p) {
  constexpr int kPer = kHeadDim / 32;  // head-dim elements per lane
  const int64_t w = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) / 32;
  const int lane = threadIdx.x & 31;
  if (w >= (p.tok_hi - p.tok_lo) * p.Hq) return;
  const int64_t t = p.tok_lo + w / p.Hq;
  const int32_t h = static_cast<int32_t>(w % p.Hq);
  const int32_t i = h / p.heads_per_idx;
  // The token's position in its sequence (cu clamped as in decode_tile).
  int64_t start = 0;
  if (p.cu_seqlens != nullptr) {
    int32_t lo = 0, hi = p.nseq - 1;
    while (lo < hi) {
      const int32_t mid = (lo + hi + 1) >> 1;
      if (clamp_offset(p.cu_seqlens[mid], 0, p.T) <= t) lo = mid; else hi = mid - 1;
    }
    start = clamp_offset(p.cu_seqlens[lo], 0, p.T);
  }
  const int32_t own = static_cast<int32_t>((t - start) / p.block_size);
  // Lane j < k: slot j, valid when its block is in [0, own] and no earlier slot holds it.
  int32_t b = -1;
  float mj = -INFINITY, lj = 0.f;
  const int64_t row = (t - p.tok_lo) * p.Hq + h;
  if (lane < p.top_k) {
    b = p.block_idx[t * p.bi_s0 + i * p.bi_s1 + lane];
    if (b < 0 || b > own) b = -1;
  }
  const unsigned same = __match_any_sync(0xffffffff, b);
  bool valid = b >= 0 && (__ffs(same) - 1) == lane;
  if (valid) {
    const float2 ml = *reinterpret_cast<const float2*>(p.part_ml + 2 * (row * p.top_k + lane));
    mj = ml.x;
    lj = ml.y;
    valid = lj > 0.f;
  }
  const unsigned vmask = __ballot_sync(0xffffffff, valid);
  float mx = valid ? mj : -INFINITY;
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffff, mx, o));
  float acc[kPer];
#pragma unroll
  for (int x = 0; x < kPer; ++x) acc[x] = 0.f;
  float sum = 0.f;
  const Element* po = as<Element>(p.part_o) + row * p.top_k * kHeadDim + lane * kPer;
  for (unsigned bits = vmask; bits != 0u; bits &= bits - 1) {
    const int j = __ffs(bits) - 1;
    const float wj = fast_exp2(__shfl_sync(0xffffffff, mj, j) - mx);
    sum += wj * __shfl_sync(0xffffffff, lj, j);
    const Element* src = po + int64_t(j) * kHeadDim;
#pragma unroll
    for (int x = 0; x < kPer; ++x) acc[x] += wj * static_cast<float>(src[x]);
  }
  const float inv = sum > 0.f ? 1.f / sum : 0.f;
  Element* dst = as<Element>(p.out) + t * p.o_s0 + int64_t(h) * p.o_s1 + lane * kPer;
#pragma unroll
  for (int x = 0; x < kPer; x += 2) {
    cutlass::Array<Element, 2> pair;
    pair[0] = static_cast<Element>(acc[x] * inv);
    pair[1] = static_cast<Element>(acc[x + 1] * inv);
    *reinterpret_cast<cutlass::Array<Element, 2>*>(dst + x) = pair;
  }
  if (lane == 0)
    p.lse[t * p.lse_s0 + int64_t(h) * p.lse_s1] =
        sum > 0.f ? (mx + log2f(sum)) * 0.69314718055994531f : -INFINITY;
}

}  // namespace msa::cuda::kern
