// Attention backward, KV side: dK = scale * sum dS^T Q and dV = sum P^T dO for one KV block,
// over every (token, head) whose support holds it.
//
// One CTA walks one chunk of the entry list of one KV block of one KV head (bwd_common.cuh). An
// item with one chunk writes dK and dV directly; the chunks of a longer list write fp32 partial
// sums, and the last of them to finish adds them in chunk order and writes the result, so the
// result does not depend on scheduling and no floating-point atomics are used.
//
// The scores are computed transposed, with the keys as MMA rows: S^T = K Q^T and dP^T = V dO^T (SS wgmma, 64 keys per consumer warpgroup, 64 columns per entry),
// which leaves P^T and dS^T in registers as the A operands of dV += P^T dO and dK += dS^T Q
// (RS wgmma). Entries' Q, dO, LSE and Delta stream through kStages shared-memory stages with
// cp.async, kStages - 1 entries ahead of the one computing.
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/gemm/collective/builders/sm90_common.inl>

#include "bwd_common.cuh"
#include "softmax.cuh"
#include "tile.cuh"
#include "utils.cuh"

namespace msa::cuda::kern {

template <class Element_, int kHeadDim_, int kBlockN_>
struct BwdKVTraits {
  using Element = Element_;
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kBlockN = kBlockN_;  // keys per CTA: one MSA block
  static constexpr int kBlockC = 64;        // columns (token, head) per entry
  static constexpr int kWarpGroups = kBlockN / 64;
  static constexpr int kThreads = 128 * kWarpGroups;
  static constexpr int kStages = 4;  // entries in flight: cp.async prefetch depth + 1

  using TileS = Shape<Int<kBlockN>, Int<kBlockC>, Int<kHeadDim>>;
  using TileKV = Shape<Int<kBlockN>, Int<kHeadDim>, Int<kBlockC>>;
  using MmaS = decltype(make_tiled_mma(GMMA::ss_op_selector<Element, Element, float, TileS>(),
                                       Layout<Shape<Int<kWarpGroups>, _1, _1>>{}));
  using MmaKV = decltype(make_tiled_mma(
      GMMA::rs_op_selector<Element, Element, float, TileKV, GMMA::Major::K, GMMA::Major::MN>(),
      Layout<Shape<Int<kWarpGroups>, _1, _1>>{}));

  using SmemAtomK = decltype(cutlass::gemm::collective::detail::ss_smem_selector<
                             GMMA::Major::K, Element, Int<kBlockN>, Int<kHeadDim>>());
  using SmemLayoutK = decltype(tile_to_shape(SmemAtomK{}, Shape<Int<kBlockN>, Int<kHeadDim>>{}));
  using SmemAtomQ = decltype(cutlass::gemm::collective::detail::ss_smem_selector<
                             GMMA::Major::K, Element, Int<kBlockC>, Int<kHeadDim>>());
  using SmemLayoutQ =
      decltype(tile_to_shape(SmemAtomQ{}, Shape<Int<kBlockC>, Int<kHeadDim>, Int<kStages>>{}));
  // Q and dO viewed as the (D, columns) B operand of dK / dV: D-contiguous, i.e. MN-major.
  using SmemLayoutQt = decltype(composition(
      SmemLayoutQ{},
      make_ordered_layout(Shape<Int<kHeadDim>, Int<kBlockC>, Int<kStages>>{}, Step<_2, _1, _3>{})));

  struct SharedStorage {
    alignas(1024) cute::array_aligned<Element, cosize_v<SmemLayoutK>> k;
    alignas(1024) cute::array_aligned<Element, cosize_v<SmemLayoutK>> v;
    alignas(1024) cute::array_aligned<Element, cosize_v<SmemLayoutQ>> q;
    alignas(1024) cute::array_aligned<Element, cosize_v<SmemLayoutQ>> dout;
    float lse[kStages][kBlockC];   // LSE (natural log) per column
    float delta[kStages][kBlockC];  // rowsum(dO * O) per column
    Entry entry[kStages];
  };
};

template <class Traits>
struct BwdKVParams {
  using Element = typename Traits::Element;
  const Element *q, *dout, *k, *v;
  int64_t q_s0, q_s1, do_s0, do_s1, k_s0, k_s1, v_s0, v_s1;
  const float* lse;
  int64_t lse_s0, lse_s1;
  const float* delta;  // [T, Hq]
  Element *dk, *dv;
  int64_t dk_s0, dk_s1, dv_s0, dv_s1;
  EntryListParams list;
  WorkListParams work;
  const int32_t* cu_seqlens;
  int32_t nseq;
  int32_t T;
  int32_t Hq, Hkv, Hi;
  int32_t heads_per_idx;  // Gi <= 64
  int32_t idx_per_kv;
  int32_t group_tokens;  // m, see group_tokens()
  float scale, scale_log2;
};

template <class Traits>
__global__ void __launch_bounds__(Traits::kThreads, 1)
    bwd_kv_kernel(const __grid_constant__ BwdKVParams<Traits> p) {
  using Element = typename Traits::Element;
  constexpr int kBlockN = Traits::kBlockN, kBlockC = Traits::kBlockC, kHeadDim = Traits::kHeadDim;
  constexpr int kThreads = Traits::kThreads;
  using SharedStorage = typename Traits::SharedStorage;

  extern __shared__ __align__(1024) char smem_raw[];
  SharedStorage& ss = *reinterpret_cast<SharedStorage*>(smem_raw);

  __shared__ int32_t last_chunk;
  const WorkItem it = decode_work(p.work, p.Hkv, blockIdx.x);
  if (it.item < 0) return;
  const int64_t x = it.x;
  const int32_t r = it.r;
  const QueryTile tile = decode_tile(p.cu_seqlens, p.nseq, p.T, kBlockN, x);
  if (tile.count == 0) return;
  const int tid = threadIdx.x;
  const int32_t Gi = p.heads_per_idx, m = p.group_tokens, ipk = p.idx_per_kv;
  const int64_t key_base = tile.seq_start + tile.first;  // packed index of the block's first key
  const EntryList list(p.list, tile, x, r, p.Hkv, ipk, m);
  const int64_t e_begin = min<int64_t>(int64_t(it.c) * p.work.chunk, list.n);
  const int64_t e_end = min<int64_t>(e_begin + p.work.chunk, list.n);

  Tensor sK = make_tensor(make_smem_ptr(ss.k.data()), typename Traits::SmemLayoutK{});
  Tensor sV = make_tensor(make_smem_ptr(ss.v.data()), typename Traits::SmemLayoutK{});
  Tensor sQ = make_tensor(make_smem_ptr(ss.q.data()), typename Traits::SmemLayoutQ{});
  Tensor sdO = make_tensor(make_smem_ptr(ss.dout.data()), typename Traits::SmemLayoutQ{});
  Tensor sQt = make_tensor(make_smem_ptr(ss.q.data()), typename Traits::SmemLayoutQt{});
  Tensor sdOt = make_tensor(make_smem_ptr(ss.dout.data()), typename Traits::SmemLayoutQt{});

  // K and V of the block; keys past the sequence end are zero rows.
  load_rows_async<kBlockN, kHeadDim>(
      sK, [&](int row) { return row < tile.count ? p.k + (key_base + row) * p.k_s0 + r * p.k_s1 : nullptr; },
      tid, kThreads);
  load_rows_async<kBlockN, kHeadDim>(
      sV, [&](int row) { return row < tile.count ? p.v + (key_base + row) * p.v_s0 + r * p.v_s1 : nullptr; },
      tid, kThreads);

  // An entry's columns into stage st (everything by cp.async: nothing here waits for memory).
  const ColumnLoader<kHeadDim, kThreads> cols_in(sQ(_, _, 0), Gi, tid);
  constexpr int kStageElems = kBlockC * kHeadDim;
  auto issue = [&](const EntryList::Raw& raw, int st) {
    const Entry en = list.get(p.list, tile, raw, ipk, m);
    const int32_t head0 = (r * ipk + en.il) * Gi;
    const int64_t t0 = tile.seq_start + en.first;
    cols_in.load(ss.q.data() + st * kStageElems, p.q + t0 * p.q_s0 + head0 * p.q_s1, p.q_s0, p.q_s1,
                 en.count);
    cols_in.load(ss.dout.data() + st * kStageElems, p.dout + t0 * p.do_s0 + head0 * p.do_s1,
                 p.do_s0, p.do_s1, en.count);
    if (tid < kBlockC) {
      const int c = tid;
      const int32_t tok = c / Gi;
      const bool ok = tok < en.count && c < m * Gi;
      const int64_t t = t0 + (ok ? tok : 0);
      const int32_t h = head0 + (ok ? c - tok * Gi : 0);
      cp_async4(&ss.lse[st][c], p.lse + t * p.lse_s0 + h * p.lse_s1, ok);
      cp_async4(&ss.delta[st][c], p.delta + t * p.Hq + h, ok);
    }
    if (tid == 0) ss.entry[st] = en;
  };

  typename Traits::MmaS mma_s;
  typename Traits::MmaKV mma_kv;
  auto thr_s = mma_s.get_thread_slice(tid);
  auto thr_kv = mma_kv.get_thread_slice(tid);
  Tensor tSrK = thr_s.partition_fragment_A(sK);
  Tensor tSrV = thr_s.partition_fragment_A(sV);
  Tensor tSrQ = thr_s.partition_fragment_B(sQ);
  Tensor tSrdO = thr_s.partition_fragment_B(sdO);
  Tensor tKVrQt = thr_kv.partition_fragment_B(sQt);
  Tensor tKVrdOt = thr_kv.partition_fragment_B(sdOt);
  Tensor tSrS = partition_fragment_C(mma_s, Shape<Int<kBlockN>, Int<kBlockC>>{});
  Tensor tSrdP = partition_fragment_C(mma_s, Shape<Int<kBlockN>, Int<kBlockC>>{});
  Tensor tdKrdK = partition_fragment_C(mma_kv, Shape<Int<kBlockN>, Int<kHeadDim>>{});
  Tensor tdVrdV = partition_fragment_C(mma_kv, Shape<Int<kBlockN>, Int<kHeadDim>>{});
  clear(tdKrdK);
  clear(tdVrdV);

  Tensor cS = thr_s.partition_C(make_identity_tensor(Shape<Int<kBlockN>, Int<kBlockC>>{}));
  Tensor S = make_tensor(tSrS.data(), acc_rowcol(tSrS.layout()));
  Tensor dP = make_tensor(tSrdP.data(), acc_rowcol(tSrdP.layout()));
  Tensor cSrc = make_tensor(cS.data(), acc_rowcol(cS.layout()));
  constexpr int kRows = decltype(size<0>(S))::value;
  constexpr int kCols = decltype(size<1>(S))::value;
  int32_t col_tok[kCols];
#pragma unroll
  for (int c = 0; c < kCols; ++c) col_tok[c] = get<1>(cSrc(0, c)) / Gi;

  Tensor rP = make_tensor<Element>(tSrS.layout());
  Tensor rdS = make_tensor<Element>(tSrS.layout());
  Tensor tKVrP = make_tensor(rP.data(), acc_as_a_operand(rP.layout()));
  Tensor tKVrdS = make_tensor(rdS.data(), acc_as_a_operand(rdS.layout()));

  constexpr int kStages = Traits::kStages;
  // Prologue: the first kStages - 1 entries in flight (one cp.async group each; the block's own
  // rows ride with the first).
  int64_t next = e_begin;
  for (int st = 0; st < kStages - 1; ++st, ++next) {
    if (next < e_end) issue(list.load(p.list, next), st);
    cp_async_commit();
  }
  EntryList::Raw ahead;  // the next entry to issue: its load overlaps this entry's compute
  if (next < e_end) ahead = list.load(p.list, next);
  for (int64_t e = e_begin; e < e_end; ++e) {
    const int st = static_cast<int>((e - e_begin) % kStages);
    cp_async_wait<kStages - 2>();
    cutlass::arch::fence_view_async_shared();
    __syncthreads();
    if (next < e_end) issue(ahead, static_cast<int>((next - e_begin) % kStages));
    cp_async_commit();
    if (++next < e_end) ahead = list.load(p.list, next);
    const Entry en = ss.entry[st];
    if (en.count == 0) continue;

    wg_gemm<true>(mma_s, tSrK, tSrQ(_, _, _, st), tSrS);
    wg_gemm<true>(mma_s, tSrV, tSrdO(_, _, _, st), tSrdP);
    warpgroup_wait<0>();
    bool col_ok[kCols];
    int32_t col_pos[kCols];
#pragma unroll
    for (int c = 0; c < kCols; ++c) {
      const int32_t t = col_tok[c];
      col_ok[c] = t < en.count && ((en.mask >> t) & 1u);
      col_pos[c] = en.first + t;
    }
#pragma unroll
    for (int i = 0; i < kRows; ++i) {
      const int32_t key = tile.first + get<0>(cSrc(i, 0));
#pragma unroll
      for (int c = 0; c < kCols; ++c) {
        const int col = get<1>(cSrc(i, c));
        const bool ok = col_ok[c] && key <= col_pos[c];
        const float prob =
            ok ? fast_exp2(S(i, c) * p.scale_log2 - ss.lse[st][col] * static_cast<float>(M_LOG2E))
               : 0.f;
        S(i, c) = prob;
        dP(i, c) = ok ? prob * (dP(i, c) - ss.delta[st][col]) : 0.f;
      }
    }
    convert_into(tSrS, rP);
    convert_into(tSrdP, rdS);
    wg_gemm<false, true>(mma_kv, tKVrP, tKVrdOt(_, _, _, st), tdVrdV);
    wg_gemm<false, true>(mma_kv, tKVrdS, tKVrQt(_, _, _, st), tdKrdK);
    warpgroup_wait<0>();
  }
  cp_async_wait_all();

  Tensor cKV = thr_kv.partition_C(make_identity_tensor(Shape<Int<kBlockN>, Int<kHeadDim>>{}));
  Tensor cKVrc = make_tensor(cKV.data(), acc_rowcol(cKV.layout()));
  Tensor dK = make_tensor(tdKrdK.data(), acc_rowcol(tdKrdK.layout()));
  Tensor dV = make_tensor(tdVrdV.data(), acc_rowcol(tdVrdV.layout()));
  if (it.chunks == 1) {
#pragma unroll
    for (int i = 0; i < size<0>(dK); ++i) {
      const int row = get<0>(cKVrc(i, 0));
      if (row >= tile.count) continue;
      Element* dk = p.dk + (key_base + row) * p.dk_s0 + r * p.dk_s1;
      Element* dv = p.dv + (key_base + row) * p.dv_s0 + r * p.dv_s1;
#pragma unroll
      for (int c = 0; c < size<1>(dK); c += 2) {
        const int col = get<1>(cKVrc(i, c));
        cutlass::Array<Element, 2> a, b;
        a[0] = static_cast<Element>(dK(i, c) * p.scale);
        a[1] = static_cast<Element>(dK(i, c + 1) * p.scale);
        b[0] = static_cast<Element>(dV(i, c));
        b[1] = static_cast<Element>(dV(i, c + 1));
        *reinterpret_cast<cutlass::Array<Element, 2>*>(dk + col) = a;
        *reinterpret_cast<cutlass::Array<Element, 2>*>(dv + col) = b;
      }
    }
    return;
  }
  // A split item: this chunk's partial sums to its slot; the last chunk to arrive adds the slots
  // in chunk order.
  constexpr int kSlot = 2 * kBlockN * kHeadDim;
  float* slots = p.work.partials + int64_t(p.work.slot_start[it.item]) * kSlot;
  float* mine = slots + int64_t(it.c) * kSlot;
#pragma unroll
  for (int i = 0; i < size<0>(dK); ++i) {
    const int row = get<0>(cKVrc(i, 0));
#pragma unroll
    for (int c = 0; c < size<1>(dK); c += 2) {
      const int col = get<1>(cKVrc(i, c));
      *reinterpret_cast<float2*>(mine + row * kHeadDim + col) = make_float2(dK(i, c), dK(i, c + 1));
      *reinterpret_cast<float2*>(mine + kBlockN * kHeadDim + row * kHeadDim + col) =
          make_float2(dV(i, c), dV(i, c + 1));
    }
  }
  __threadfence();
  __syncthreads();
  if (tid == 0) last_chunk = atomicAdd(p.work.arrivals + it.item, 1) == it.chunks - 1;
  __syncthreads();
  if (!last_chunk) return;
  __threadfence();
  for (int e = tid * 2; e < tile.count * kHeadDim; e += kThreads * 2) {
    float2 sk = make_float2(0.f, 0.f), sv = make_float2(0.f, 0.f);
    for (int c = 0; c < it.chunks; ++c) {
      const float2 a = __ldcg(reinterpret_cast<const float2*>(slots + int64_t(c) * kSlot + e));
      const float2 b = __ldcg(reinterpret_cast<const float2*>(slots + int64_t(c) * kSlot + kBlockN * kHeadDim + e));
      sk.x += a.x;
      sk.y += a.y;
      sv.x += b.x;
      sv.y += b.y;
    }
    const int row = e / kHeadDim, col = e % kHeadDim;
    cutlass::Array<Element, 2> a, b;
    a[0] = static_cast<Element>(sk.x * p.scale);
    a[1] = static_cast<Element>(sk.y * p.scale);
    b[0] = static_cast<Element>(sv.x);
    b[1] = static_cast<Element>(sv.y);
    *reinterpret_cast<cutlass::Array<Element, 2>*>(p.dk + (key_base + row) * p.dk_s0 + r * p.dk_s1 + col) = a;
    *reinterpret_cast<cutlass::Array<Element, 2>*>(p.dv + (key_base + row) * p.dv_s0 + r * p.dv_s1 + col) = b;
  }
}

}  // namespace msa::cuda::kern
