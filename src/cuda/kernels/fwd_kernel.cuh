// Sparse (and dense-causal) attention forward on Hopper: query-tile-outer over the union of the
// tile's selected KV blocks.
//
// A tile packs m consecutive tokens x the Gi = Hq / Hi query heads of one index head into
// kBlockM = 128 MMA rows (row = token * Gi + head), so all rows share one KV head. The tile
// visits the union of its tokens' selected blocks in ascending order; a row whose token did not
// select a block masks it out. Warp specialisation: warp 0 builds the block list and streams K
// and V blocks with TMA through two mbarrier pipelines; two consumer warpgroups own 64 rows
// each, compute S = Q K^T and O += P V with wgmma and keep the online softmax in registers.
// Dense (warmup) mode visits every causal block with no membership mask.
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/gemm/collective/builders/sm90_common.inl>
#include <cutlass/pipeline/sm90_pipeline.hpp>

#include "../device/block_list.cuh"
#include "../device/epilogue.cuh"
#include "../device/kv_producer.cuh"
#include "../device/load.cuh"
#include "../device/mask.cuh"
#include "../device/pass_choice.cuh"
#include "../device/softmax.cuh"
#include "../device/tile.cuh"
#include "../device/utils.cuh"
#include "../host/args.h"

namespace msa::cuda::kern {

using cuda::FwdArgs;

template <class Element_, int kHeadDim_, int kBlockN_>
struct FwdTraits : QueryTileTraits<Element_, kHeadDim_, kBlockN_> {
  using Base = QueryTileTraits<Element_, kHeadDim_, kBlockN_>;
  using Element = Element_;
  static constexpr int kHeadDim = kHeadDim_, kBlockN = kBlockN_, kBlockM = Base::kBlockM;
  static_assert(kBlockM == cuda::kQueryTileRows);
  using typename Base::Pipeline;
  using typename Base::SmemLayoutKV;
  using typename Base::SmemLayoutQ;
  using SmemLayoutVt = typename Base::SmemLayoutKVt;
  using MmaQK = typename Base::MmaRowsKeys;  // S = Q K^T
  using MmaPV = typename Base::MmaRowsDim;   // O += P V
  using SharedStorage = typename Base::StorageQ;
  static constexpr size_t kUnionOffset = Base::template union_offset<SharedStorage>();
};

template <class Traits>
struct FwdParams : FwdArgs {
  typename Traits::Tma tma_k, tma_v;
};

// Warp roles: the first warpgroup produces (warp 0: the block list, then TMA of K and V; the
// other three warps leave); warpgroups 1 and 2 consume 64 rows each.
// Pipelines: pipe_k, pipe_v (kStages each), producer -> consumers (QueryTileStream).
// Work: one tile (blockIdx.x, late tiles first) of one head group (blockIdx.y).
//
// The consumers' Q load, mask, tail zeroing and epilogue are written out here rather than
// calling the helpers of device/ that bwd_q uses (load_head_rows, BlockList, row_sees,
// zero_tail_rows, store_row): measured on the H200, taking load_head_rows alone for the Q load
// made this mainloop 1.55x slower (paper heads, 128K, shared selections: 278 against 437
// effective TFLOP/s; dense mode 353 against 550), with the same 168 registers, no spill and
// nearly the same PTX. Keep this kernel's SASS under watch when touching it. Likewise, letting
// each warpgroup skip the blocks none of its tokens selected (as bwd_q_kernel.cuh does) made
// ptxas serialise the mainloop's wgmma (warning C7518: a divergent path) and cost 1.6x on shared
// selections (paper heads, 128K: 267 against 445 TFLOP/s), more than it saved on diverse ones.
template <class Traits>
__global__ void __launch_bounds__(Traits::kThreads, 1)
    fwd_kernel(const __grid_constant__ FwdParams<Traits> p) {
  using Element = typename Traits::Element;
  constexpr int kBlockM = Traits::kBlockM, kBlockN = Traits::kBlockN, kHeadDim = Traits::kHeadDim;
  using Pipeline = typename Traits::Pipeline;

  extern __shared__ __align__(1024) char smem_raw[];
  if (p.choice != nullptr && kv_pass_chosen(p.choice)) return;  // kAuto chose the KV-block pass
  const QueryTile tile = query_tile(p);
  if (tile.count == 0) return;
  QueryTileStream<Traits> kv(smem_raw, p);
  auto& ss = kv.ss;
  const int32_t ih = kv.ih;

  Tensor sQ = make_tensor(make_smem_ptr(ss.q.data()), typename Traits::SmemLayoutQ{});
  Tensor sK = make_tensor(make_smem_ptr(ss.k.data()), typename Traits::SmemLayoutKV{});
  Tensor sV = make_tensor(make_smem_ptr(ss.v.data()), typename Traits::SmemLayoutKV{});
  Tensor sVt = make_tensor(make_smem_ptr(ss.v.data()), typename Traits::SmemLayoutVt{});

  if (kv.producer) {
    cutlass::arch::warpgroup_reg_dealloc<40>();
    if (cutlass::canonical_warp_idx_sync() == 0) kv.produce(p, tile, sK, sV, !p.lse_only);
    return;
  }
  const UnionSmem us = kv.us(p);

  // ---------------------------------------------------------------- consumers
  cutlass::arch::warpgroup_reg_alloc<232>();
  const int tidx = threadIdx.x - 128;
  const int32_t Gi = p.heads_per_idx;
  const int32_t rows_used = p.tile_tokens * Gi;

  // Q: rows (token, head) of this index head, zero for padding rows.
  {
    constexpr int kChunks = kHeadDim / 8;
    for (int e = tidx; e < kBlockM * kChunks; e += Traits::kConsumerThreads) {
      const int row = e / kChunks, c = e % kChunks;
      const int tok = row / Gi, h = row - tok * Gi;
      uint4 val = make_uint4(0, 0, 0, 0);
      if (row < rows_used && tok < tile.count) {
        const Element* src = as<Element>(p.q) + (tile.seq_start + tile.first + tok) * p.q_s0 +
                             (int64_t)(ih * Gi + h) * p.q_s1 + c * 8;
        val = *reinterpret_cast<const uint4*>(src);
        if (p.negate) val = negate8(val);
      }
      *reinterpret_cast<uint4*>(&sQ(row, c * 8)) = val;
    }
    cutlass::arch::fence_view_async_shared();
  }

  typename Traits::MmaQK mma_qk;
  typename Traits::MmaPV mma_pv;
  auto thr_qk = mma_qk.get_thread_slice(tidx);
  auto thr_pv = mma_pv.get_thread_slice(tidx);
  Tensor tSrQ = thr_qk.partition_fragment_A(sQ);
  Tensor tSrK = thr_qk.partition_fragment_B(sK);
  Tensor tOrV = thr_pv.partition_fragment_B(sVt);
  Tensor tSrS = partition_fragment_C(mma_qk, Shape<Int<kBlockM>, Int<kBlockN>>{});
  Tensor tOrO = partition_fragment_C(mma_pv, Shape<Int<kBlockM>, Int<kHeadDim>>{});
  clear(tOrO);

  Tensor cS = thr_qk.partition_C(make_identity_tensor(Shape<Int<kBlockM>, Int<kBlockN>>{}));
  Tensor S = make_tensor(tSrS.data(), acc_rowcol(tSrS.layout()));
  Tensor cSrc = make_tensor(cS.data(), acc_rowcol(cS.layout()));
  Tensor O = make_tensor(tOrO.data(), acc_rowcol(tOrO.layout()));
  constexpr int kRows = decltype(size<0>(S))::value;

  int32_t row_tok[kRows];
  bool row_ok[kRows];
#pragma unroll
  for (int r = 0; r < kRows; ++r) {
    const int row = get<0>(cSrc(r, 0));
    row_tok[r] = row / Gi;
    row_ok[r] = row < rows_used && row_tok[r] < tile.count;
  }

  OnlineSoftmax<kRows> softmax(p.scale_log2);
  cutlass::arch::NamedBarrier::sync(Traits::kConsumerThreads + 32,
                                    static_cast<uint32_t>(Barrier::kListReady));
  const int32_t n = ss.num_blocks;

  // Scores of list entry u -> unnormalised probabilities (mask: membership of the row's token,
  // causality, padding rows); corr receives the rescale factors of O.
  auto softmax_step = [&](int32_t u, float (&corr)[kRows]) {
    const int32_t b = p.dense ? u : us.blocks[u];
    const int32_t key0 = b * kBlockN;
    const bool causal = key0 + kBlockN - 1 > tile.pos0;
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      bool member = row_ok[r];
      if (!p.dense && member) {
        const uint32_t word = us.members[u * p.uni.mask_words + (row_tok[r] >> 5)];
        member = (word >> (row_tok[r] & 31)) & 1u;
      }
      const int32_t qpos = tile.pos0 + row_tok[r];
#pragma unroll
      for (int c = 0; c < size<1>(S); ++c) {
        if (!member || (causal && key0 + get<1>(cSrc(r, c)) > qpos)) S(r, c) = -INFINITY;
      }
    }
    softmax.update(S, corr);
  };
  // Keys past the sequence end belong to the next sequence (or are a page's unwritten rows): P
  // is 0 there, but 0 * NaN is not, so those rows of the V stage are zeroed. Each warpgroup zeroes them before its own P V (the
  // two may both write the same zeros), then syncs its 128 threads.
  const int wg = tidx / 128;
  auto zero_v_tail = [&](int32_t u, int stage) {
    const int32_t key0 = (p.dense ? u : us.blocks[u]) * kBlockN;
    if (key0 + kBlockN <= tile.key_len) return;
    const int32_t valid = tile.key_len - key0;
    constexpr int kChunks = kHeadDim / 8;
    for (int e = tidx % 128; e < (kBlockN - valid) * kChunks; e += 128) {
      const int row = valid + e / kChunks, c = e % kChunks;
      *reinterpret_cast<uint4*>(&sV(row, c * 8, stage)) = make_uint4(0, 0, 0, 0);
    }
    cutlass::arch::fence_view_async_shared();
    cutlass::arch::NamedBarrier::sync(128, static_cast<uint32_t>(Barrier::kVTail) + wg);
  };

  Tensor rP = make_tensor<Element>(tSrS.layout());
  Tensor tOrP = make_tensor(rP.data(), acc_as_a_operand(rP.layout()));
  typename Pipeline::PipelineState sk, sv;  // consumer start states: index 0, phase 0
  float corr[kRows];
  if (p.lse_only) {
    for (int32_t u = 0; u < n; ++u) {
      kv.pipe_k.consumer_wait(sk);
      wg_gemm<true>(mma_qk, tSrQ, tSrK(_, _, _, sk.index()), tSrS);
      warpgroup_wait<0>();
      kv.pipe_k.consumer_release(sk);
      ++sk;
      softmax_step(u, corr);
    }
  } else if (n > 0) {
    // Software pipeline: S of block u+1 is computed while O += P V of block u runs.
    kv.pipe_k.consumer_wait(sk);
    wg_gemm<true>(mma_qk, tSrQ, tSrK(_, _, _, sk.index()), tSrS);
    warpgroup_wait<0>();
    kv.pipe_k.consumer_release(sk);
    ++sk;
    softmax_step(0, corr);
    convert_into(tSrS, rP);
    for (int32_t u = 1; u < n; ++u) {
      kv.pipe_k.consumer_wait(sk);
      wg_gemm<true>(mma_qk, tSrQ, tSrK(_, _, _, sk.index()), tSrS);
      kv.pipe_v.consumer_wait(sv);
      zero_v_tail(u - 1, sv.index());
      wg_gemm<false, true>(mma_pv, tOrP, tOrV(_, _, _, sv.index()), tOrO);
      warpgroup_wait<1>();
      kv.pipe_k.consumer_release(sk);
      ++sk;
      softmax_step(u, corr);
      warpgroup_wait<0>();
      kv.pipe_v.consumer_release(sv);
      ++sv;
      OnlineSoftmax<kRows>::rescale(O, corr);
      convert_into(tSrS, rP);
    }
    kv.pipe_v.consumer_wait(sv);
    zero_v_tail(n - 1, sv.index());
    wg_gemm<false, true>(mma_pv, tOrP, tOrV(_, _, _, sv.index()), tOrO);
    warpgroup_wait<0>();
    kv.pipe_v.consumer_release(sv);
  }

  // Epilogue: normalise, write out (bf16/fp16 pairs) and the natural-log LSE.
  float lse[kRows];
  softmax.finalize(O, p.scale, lse);
  Tensor cO = thr_pv.partition_C(make_identity_tensor(Shape<Int<kBlockM>, Int<kHeadDim>>{}));
  Tensor cOrc = make_tensor(cO.data(), acc_rowcol(cO.layout()));
#pragma unroll
  for (int r = 0; r < kRows; ++r) {
    if (!row_ok[r]) continue;
    const int row = get<0>(cOrc(r, 0));
    const int64_t t = tile.seq_start + tile.first + row_tok[r];
    const int64_t head = (int64_t)ih * Gi + (row - row_tok[r] * Gi);
    if ((tidx & 3) == 0) p.lse[t * p.lse_s0 + head * p.lse_s1] = lse[r];
    if (p.lse_only) continue;
    Element* dst = as<Element>(p.out) + t * p.o_s0 + head * p.o_s1;
#pragma unroll
    for (int c = 0; c < size<1>(O); c += 2) {
      cutlass::Array<Element, 2> pair;
      pair[0] = static_cast<Element>(O(r, c));
      pair[1] = static_cast<Element>(O(r, c + 1));
      *reinterpret_cast<cutlass::Array<Element, 2>*>(dst + get<1>(cOrc(r, c))) = pair;
    }
  }
}

}  // namespace msa::cuda::kern
