// Attention backward, query side: dQ = scale * sum_j dS(t, j) K[j] over the tile's support, with
// dS = P * (dP - Delta), P = exp(scale * Q K^T - LSE), dP = dO V^T, Delta = rowsum(dO * O).
//
// The tile and its KV stream are the forward's (fwd_kernel.cuh, device/kv_producer.cuh): kBlockM = 128 rows = m tokens x
// the Gi query heads of one index head, the union of the tokens' selections visited in ascending
// order (every causal block in dense mode), K and V streamed by TMA through two mbarrier
// pipelines by warp 0. Each consumer warpgroup owns 64 rows and keeps its dQ in registers for
// the whole tile, so dQ is written once, with no atomics (dK and dV come from bwd_kv_kernel.cuh).
// A warpgroup computes only the blocks its own tokens selected (on diverse selections the union
// of half a tile's tokens is much smaller than the tile's) and just releases the others' stages.
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/gemm/collective/builders/sm90_common.inl>
#include <cutlass/pipeline/sm90_pipeline.hpp>

#include "../device/block_list.cuh"
#include "../device/epilogue.cuh"
#include "../device/grid_dependency.cuh"
#include "../device/kv_producer.cuh"
#include "../device/load.cuh"
#include "../device/mask.cuh"
#include "../device/softmax.cuh"
#include "../device/tile.cuh"
#include "../device/utils.cuh"
#include "../host/args.h"

namespace msa::cuda::kern {

using cuda::BwdQArgs;

template <class Element_, int kHeadDim_, int kBlockN_>
struct BwdQTraits : QueryTileTraits<Element_, kHeadDim_, kBlockN_> {
  using Base = QueryTileTraits<Element_, kHeadDim_, kBlockN_>;
  using Element = Element_;
  static constexpr int kHeadDim = kHeadDim_, kBlockN = kBlockN_, kBlockM = Base::kBlockM;
  static_assert(kBlockM == cuda::kQueryTileRows);
  using typename Base::Pipeline;
  using typename Base::SmemLayoutKV;
  using typename Base::SmemLayoutQ;
  using SmemLayoutKt = typename Base::SmemLayoutKVt;
  using MmaS = typename Base::MmaRowsKeys;  // S = Q K^T and dP = dO V^T
  using MmaDQ = typename Base::MmaRowsDim;  // dQ += dS K
  using SharedStorage = typename Base::StorageQdO;
  static constexpr size_t kUnionOffset = Base::template union_offset<SharedStorage>();
};

template <class Traits>
struct BwdQParams : BwdQArgs {
  typename Traits::Tma tma_k, tma_v;
};

// Warp roles, pipelines and work: those of fwd_kernel.cuh (QueryTileStream), with V always
// streamed; each consumer warpgroup keeps its 64 rows of dQ in registers for the whole tile and
// skips the blocks none of its tokens selected.
template <class Traits>
__global__ void __launch_bounds__(Traits::kThreads, 1)
    bwd_q_kernel(const __grid_constant__ BwdQParams<Traits> p) {
  grid_dependency_begin();
  using Element = typename Traits::Element;
  constexpr int kBlockM = Traits::kBlockM, kBlockN = Traits::kBlockN, kHeadDim = Traits::kHeadDim;
  using Pipeline = typename Traits::Pipeline;

  extern __shared__ __align__(1024) char smem_raw[];
  const QueryTile tile = query_tile(p);
  if (tile.count == 0) return;
  QueryTileStream<Traits> kv(smem_raw, p);
  auto& ss = kv.ss;
  const int32_t ih = kv.ih;

  Tensor sQ = make_tensor(make_smem_ptr(ss.q.data()), typename Traits::SmemLayoutQ{});
  Tensor sdO = make_tensor(make_smem_ptr(ss.dout.data()), typename Traits::SmemLayoutQ{});
  Tensor sK = make_tensor(make_smem_ptr(ss.k.data()), typename Traits::SmemLayoutKV{});
  Tensor sV = make_tensor(make_smem_ptr(ss.v.data()), typename Traits::SmemLayoutKV{});
  Tensor sKt = make_tensor(make_smem_ptr(ss.k.data()), typename Traits::SmemLayoutKt{});

  if (kv.producer_done(p, tile, sK, sV, true)) return;

  // ---------------------------------------------------------------- consumers
  const int tidx = threadIdx.x - 128;
  const int32_t Gi = p.heads_per_idx;
  const int64_t tok0 = tile.seq_start + tile.first;
  load_head_rows<kBlockM, kHeadDim, Traits::kConsumerThreads>(
      sQ, as<Element>(p.q) + tok0 * p.q_s0, p.q_s0, p.q_s1, ih * Gi, Gi, tile.count, tidx);
  load_head_rows<kBlockM, kHeadDim, Traits::kConsumerThreads>(
      sdO, as<Element>(p.dout) + tok0 * p.do_s0, p.do_s0, p.do_s1, ih * Gi, Gi, tile.count, tidx);
  cutlass::arch::fence_view_async_shared();

  typename Traits::MmaS mma_s;
  typename Traits::MmaDQ mma_dq;
  auto thr_s = mma_s.get_thread_slice(tidx);
  auto thr_dq = mma_dq.get_thread_slice(tidx);
  Tensor tSrQ = thr_s.partition_fragment_A(sQ);
  Tensor tSrdO = thr_s.partition_fragment_A(sdO);
  Tensor tSrK = thr_s.partition_fragment_B(sK);
  Tensor tSrV = thr_s.partition_fragment_B(sV);
  Tensor tdQrK = thr_dq.partition_fragment_B(sKt);
  Tensor tSrS = partition_fragment_C(mma_s, Shape<Int<kBlockM>, Int<kBlockN>>{});
  Tensor tSrdP = partition_fragment_C(mma_s, Shape<Int<kBlockM>, Int<kBlockN>>{});
  Tensor tdQrdQ = partition_fragment_C(mma_dq, Shape<Int<kBlockM>, Int<kHeadDim>>{});
  clear(tdQrdQ);

  Tensor cS = thr_s.partition_C(make_identity_tensor(Shape<Int<kBlockM>, Int<kBlockN>>{}));
  Tensor S = make_tensor(tSrS.data(), acc_rowcol(tSrS.layout()));
  Tensor dP = make_tensor(tSrdP.data(), acc_rowcol(tSrdP.layout()));
  Tensor cSrc = make_tensor(cS.data(), acc_rowcol(cS.layout()));
  constexpr int kRows = decltype(size<0>(S))::value;

  const TileRows<kRows> rows(cSrc, Gi, tile.count);
  float row_lse2[kRows], row_delta[kRows];
#pragma unroll
  for (int r = 0; r < kRows; ++r) {
    row_lse2[r] = 0.f;
    row_delta[r] = 0.f;
    if (rows.ok[r]) {
      const int64_t t = tok0 + rows.tok[r];
      const int32_t head = ih * Gi + rows.head(cSrc, r, Gi);
      row_lse2[r] = p.lse[t * p.lse_s0 + head * p.lse_s1] * static_cast<float>(M_LOG2E);
      row_delta[r] = p.delta[t * p.Hq + head];
    }
  }

  const int32_t n = kv.wait_list();
  const int wg = tidx / 128;

  Tensor rdS = make_tensor<Element>(tSrS.layout());
  Tensor tdQrdS = make_tensor(rdS.data(), acc_as_a_operand(rdS.layout()));
  typename Pipeline::PipelineState sk, sv;
  // This warpgroup's tokens. A block none of them selected is only waited for and released:
  // all its scores would be masked (the other warpgroup may need it). In dense mode every block
  // counts.
  const int32_t wg_tok_lo = 64 * wg / Gi, wg_tok_hi = (64 * wg + 63) / Gi;
  for (int32_t u = 0; u < n; ++u) {
    if (!kv.list(p).any_member(u, wg_tok_lo, wg_tok_hi)) {
      kv.pipe_k.consumer_wait(sk);
      kv.pipe_v.consumer_wait(sv);
      kv.pipe_v.consumer_release(sv);
      ++sv;
      kv.pipe_k.consumer_release(sk);
      ++sk;
      continue;
    }
    const int32_t key0 = kv.list(p).block(u) * kBlockN;
    kv.pipe_k.consumer_wait(sk);
    wg_gemm<true>(mma_s, tSrQ, tSrK(_, _, _, sk.index()), tSrS);
    kv.pipe_v.consumer_wait(sv);
    wg_gemm<true>(mma_s, tSrdO, tSrV(_, _, _, sv.index()), tSrdP);
    warpgroup_wait<0>();
    kv.pipe_v.consumer_release(sv);
    ++sv;
    const bool causal = key0 + kBlockN - 1 > tile.pos0;
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      const bool member = kv.list(p).member(u, rows.tok[r], rows.ok[r]);
      const int32_t qpos = tile.pos0 + rows.tok[r];  // the row's key position
#pragma unroll
      for (int c = 0; c < size<1>(S); ++c) {
        const bool ok = row_sees(member, causal, key0 + get<1>(cSrc(r, c)), qpos);
        const float prob = fast_exp2(S(r, c) * p.scale_log2 - row_lse2[r]);
        S(r, c) = ok ? prob * (dP(r, c) - row_delta[r]) : 0.f;
      }
    }
    convert_into(tSrS, rdS);
    // Keys past the sequence end: their dS is 0, but 0 * NaN is not (zero_tail_rows).
    zero_tail_rows<kBlockN, kHeadDim>(sK(_, _, sk.index()), key0, tile.key_len, tidx % 128, wg);
    wg_gemm<false, true>(mma_dq, tdQrdS, tdQrK(_, _, _, sk.index()), tdQrdQ);
    warpgroup_wait<0>();
    kv.pipe_k.consumer_release(sk);
    ++sk;
  }

  Tensor cQ = thr_dq.partition_C(make_identity_tensor(Shape<Int<kBlockM>, Int<kHeadDim>>{}));
  Tensor cQrc = make_tensor(cQ.data(), acc_rowcol(cQ.layout()));
  Tensor dQ = make_tensor(tdQrdQ.data(), acc_rowcol(tdQrdQ.layout()));
#pragma unroll
  for (int r = 0; r < kRows; ++r) {
    if (!rows.ok[r]) continue;
    const int64_t t = tok0 + rows.tok[r];
    const int64_t head = (int64_t)ih * Gi + rows.head(cQrc, r, Gi);
    store_row(as<Element>(p.dq) + t * p.dq_s0 + head * p.dq_s1, dQ, cQrc, r, p.scale);
  }
}

}  // namespace msa::cuda::kern
