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
//
// Split (Options.fwd_pass = kSplit, or kAuto's sums choosing it; device/pass_choice.cuh): the
// tile keeps only the union's blocks that at least share_min of its tokens selected; the
// KV-block pass (fwd_kv_kernel.cuh), run before it, wrote the partial outputs of every other
// selected (token, block) of the pass, and the consumers merge them into their own online
// softmax (device/partials.cuh: each row's partials in block_idx column order), one stage of a
// partial a row after each block's P V while the other warpgroup's products run, and the stages
// left after the mainloop three at a time. The split is its own instance (kSplit), so that the
// plain query tiles' and the warmup's code stays free of it; kAuto launches both, and the one
// its sums did not choose returns at once.
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
#include "../device/partials.cuh"
#include "../device/pass_choice.cuh"
#include "../device/softmax.cuh"
#include "../device/tile.cuh"
#include "../device/utils.cuh"
#include "../host/args.h"

namespace msa::cuda::kern {

using cuda::FwdArgs;

// kScaledKV: K and V are an E4M3 cache's codes (as Element) with per-page scales (FwdArgs::kv_scale).
template <class Element_, int kHeadDim_, int kBlockN_, bool kScaledKV_ = false>
struct FwdTraits : QueryTileTraits<Element_, kHeadDim_, kBlockN_> {
  using Base = QueryTileTraits<Element_, kHeadDim_, kBlockN_>;
  using Element = Element_;
  static constexpr int kHeadDim = kHeadDim_, kBlockN = kBlockN_, kBlockM = Base::kBlockM;
  static constexpr bool kScaledKV = kScaledKV_;
  static_assert(kBlockM == cuda::kQueryTileRows);
  using typename Base::Pipeline;
  using typename Base::SmemLayoutKV;
  using typename Base::SmemLayoutQ;
  using SmemLayoutVt = typename Base::SmemLayoutKVt;
  using MmaQK = typename Base::MmaRowsKeys;  // S = Q K^T
  using MmaPV = typename Base::MmaRowsDim;   // O += P V
  using SharedStorage = typename Base::StorageQ;
  static constexpr size_t kUnionOffset = Base::template union_offset<SharedStorage>();
  // The split's slots of the consumer threads' next partials (two accumulator rows a thread).
  static constexpr int kPartialSlotBytes =
      PartialMerge<Element, kHeadDim, 2>::template kSlotBytes<Base::kConsumerThreads>;
};

template <class Traits>
struct FwdParams : FwdArgs {
  typename Traits::Tma tma_k, tma_v;
};

// Warp roles: the first warpgroup produces (warp 0: the block list, then TMA of K and V; the
// other three warps leave); warpgroups 1 and 2 consume 64 rows each.
// Pipelines: pipe_k, pipe_v (kStages each), producer -> consumers (QueryTileStream); in the
// split (kSplit), each consumer thread's next partials: one stage in flight into its own slot
// of shared memory (cp.async) over a block's products, then groups of three into registers
// after the mainloop.
// Work: one tile (blockIdx.x over the tile ids [tile_lo, tile_lo + num_tiles), late tiles first)
// of one head group (blockIdx.y), for its tokens in the pass [tok_lo, tok_hi).
// Scaled keys (a prefill over an E4M3 cache): each block's scores times its k scale (and each
// row's query scale, FP8 queries), its values times its v scale (OnlineSoftmax::update_scaled);
// the bf16 instance's code is unchanged.
//
// The consumers' mask, tail zeroing and epilogue are written out here rather than calling the
// helpers of device/ that bwd_q uses (BlockList, row_sees, zero_tail_rows, store_row): measured
// on the H200, taking the then load_head_rows (plain loads, one round trip a chunk) for the Q
// load made this mainloop 1.55x slower (paper heads, 128K, shared selections: 278 against 437
// effective TFLOP/s; dense mode 353 against 550), with the same 168 registers, no spill and
// nearly the same PTX. The Q load is now load_head_rows_async: every chunk requested at once,
// waited for at the list barrier (the plain loop it replaces spent 14% of the consumers'
// samples waiting on its loads: ncu, H100, 128K shared, query tiles). Keep this kernel's SASS
// under watch when touching it: changes elsewhere (the parameter struct, the producer) once
// turned the mask into branches (66 BSSY in the mainloop, 1255 instructions) and cost 1.55x
// again; at bf16/D128/Bk128 the mainloop is 890 instructions with 4 BSSY (the V tail and the
// membership lookup) and no local memory; the split's instance's is 1124, 234 of them its merge
// of a stage, branched over where a warp has none left.
// Likewise, letting each warpgroup skip the blocks none of its tokens selected (as
// bwd_q_kernel.cuh does) made ptxas serialise the mainloop's wgmma (warning C7518: a divergent
// path) and cost 1.6x on shared selections (paper heads, 128K: 267 against 445 TFLOP/s), more
// than it saved on diverse ones.
template <class Traits, bool kSplit>
__global__ void __launch_bounds__(Traits::kThreads, 1)
    fwd_kernel(const __grid_constant__ FwdParams<Traits> p) {
  grid_dependency_begin();
  using Element = typename Traits::Element;
  constexpr int kBlockM = Traits::kBlockM, kBlockN = Traits::kBlockN, kHeadDim = Traits::kHeadDim;
  using Pipeline = typename Traits::Pipeline;

  extern __shared__ __align__(1024) char smem_raw[];
  // kAuto launches both instances: the one its sums did not choose returns.
  if (p.split.part_o != nullptr && p.choice != nullptr && split_chosen(p.choice) != kSplit) return;
  const QueryTile tile = query_tile(p);
  // The tile's tokens in the pass: [j_lo, j_hi) of its rows (all of them outside passes).
  const int64_t tok0 = tile.seq_start + tile.first;
  const int32_t j_lo = static_cast<int32_t>(max<int64_t>(0, p.tok_lo - tok0));
  const int32_t j_hi = static_cast<int32_t>(min<int64_t>(tile.count, p.tok_hi - tok0));
  if (tile.count == 0 || j_lo >= j_hi) return;
  QueryTileStream<Traits> kv(smem_raw, p);
  auto& ss = kv.ss;
  const int32_t ih = kv.ih;

  Tensor sQ = make_tensor(make_smem_ptr(ss.q.data()), typename Traits::SmemLayoutQ{});
  Tensor sK = make_tensor(make_smem_ptr(ss.k.data()), typename Traits::SmemLayoutKV{});
  Tensor sV = make_tensor(make_smem_ptr(ss.v.data()), typename Traits::SmemLayoutKV{});
  Tensor sVt = make_tensor(make_smem_ptr(ss.v.data()), typename Traits::SmemLayoutVt{});

  if (kv.producer) {
    cutlass::arch::warpgroup_reg_dealloc<40>();
    if (cutlass::canonical_warp_idx_sync() == 0)
      kv.produce(p, tile, sK, sV, !p.lse_only, kSplit ? p.split.share_min : 0);
    return;
  }
  const UnionSmem us = kv.us(p);

  // ---------------------------------------------------------------- consumers
  cutlass::arch::warpgroup_reg_alloc<232>();
  const int tidx = threadIdx.x - 128;
  const int32_t Gi = p.heads_per_idx;
  const int32_t rows_used = p.tile_tokens * Gi;

  // Q: rows (token, head) of this index head, zero for padding rows; requested now, waited for
  // just before the mainloop.
  load_head_rows_async<kBlockM, kHeadDim, Traits::kConsumerThreads>(
      sQ, as<Element>(p.q) + tok0 * p.q_s0, p.q_s0, p.q_s1, ih * Gi, Gi, tile.count, tidx);

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

  // A row is real when its token is one of the tile's tokens in the pass (rows of the other
  // tokens are masked like padding rows and never written).
  int32_t row_tok[kRows];
  bool row_ok[kRows];
#pragma unroll
  for (int r = 0; r < kRows; ++r) {
    const int row = get<0>(cSrc(r, 0));
    row_tok[r] = row / Gi;
    row_ok[r] = row < rows_used && row_tok[r] >= j_lo && row_tok[r] < j_hi;
  }

  // Scaled keys: each row's query scale (FP8 queries; else 1).
  float row_qf[kRows];
#pragma unroll
  for (int r = 0; r < kRows; ++r) row_qf[r] = 1.f;
  if constexpr (Traits::kScaledKV) {
    if (p.q_factor != nullptr) {
#pragma unroll
      for (int r = 0; r < kRows; ++r) {
        const int row = get<0>(cSrc(r, 0));
        if (row_ok[r])
          row_qf[r] = p.q_factor[(tok0 + row_tok[r]) * p.Hq + int64_t(ih) * Gi + (row - row_tok[r] * Gi)];
      }
    }
  }

  OnlineSoftmax<kRows> softmax(p.scale_log2);
  // The split: the rows' marks and their partials' maxima read while Q's copies fly and the
  // softmax's max started at the largest; once Q has landed, the first stage requested into the
  // thread's slot.
  PartialMerge<Element, kHeadDim, kRows> partials;
  constexpr int kSlotThreads = Traits::kConsumerThreads;
  static_assert(decltype(partials)::template kSlotBytes<kSlotThreads> == Traits::kPartialSlotBytes);
  if constexpr (kSplit) {
    int32_t first[kRows];  // the row's partial slot of column 0 (FwdKvArgs::part_o's layout)
    const uint8_t* marks[kRows];
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      const int row = get<0>(cSrc(r, 0));
      first[r] = row_ok[r] ? static_cast<int32_t>(partial_slot(tok0 + row_tok[r], p.tok_lo, p.top_k, 0, p.Hq,
                                                               ih * Gi + (row - row_tok[r] * Gi)))
                           : -1;
      marks[r] = row_ok[r] ? p.split.taken + ((tok0 + row_tok[r]) * p.Hi + ih) * p.top_k : nullptr;
    }
    partials.init(p.split.part_ml, marks, p.top_k, p.Hq, first, tidx, softmax);
  }
  cp_async_wait_all();
  if (p.negate) negate_head_rows<kBlockM, kHeadDim, Traits::kConsumerThreads>(sQ, tidx);
  if (kSplit && p.split.slot_offset != 0 && partials.to_come())
    partials.template fetch_async<kSlotThreads>(smem_raw + p.split.slot_offset, tidx, p.split.part_ml,
                                                p.split.part_o);
  cutlass::arch::fence_view_async_shared();
  // The list is built and every consumer's Q chunks have landed.
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
      // The row's last visible column, relative to the thread's first: the scores past it are
      // masked (all of them where the row's token did not select the block). Score c of a row is
      // column first + (c / 2) * 8 + c % 2 (the wgmma accumulator's column pairs, 8 apart), so
      // each score costs one compare with an immediate and a select. (Written as
      // !member || (causal && col > qpos), ptxas made the mask branchy or kept every column in
      // a register, and the mainloop ran 1.55x slower.)
      const int32_t last = (!member ? -1 : causal ? tile.pos0 + row_tok[r] - key0 : kBlockN) -
                           get<1>(cSrc(r, 0));
#pragma unroll
      for (int c = 0; c < size<1>(S); ++c) {
        if ((c / 2) * 8 + c % 2 > last) S(r, c) = -INFINITY;
      }
    }
    if constexpr (Traits::kScaledKV) {
      const float2 f = p.kv_scale[(p.paged.first_kv_tile(tile.seq, tile.seq_start, kBlockN) + b) * p.Hkv + kv.kvh];
      float ks[kRows];
#pragma unroll
      for (int r = 0; r < kRows; ++r) ks[r] = f.x * row_qf[r];
      softmax.update_scaled(S, corr, ks, f.y);
    } else {
      softmax.update(S, corr);
    }
  };
  // Keys past the sequence end belong to the next sequence (or are a page's unwritten rows): P
  // is 0 there, but 0 * NaN is not, so those rows of the V stage are zeroed. Each warpgroup zeroes them before its own P V (the
  // two may both write the same zeros), then syncs its 128 threads.
  const int wg = tidx / 128;
  auto zero_v_tail = [&](int32_t u, int stage) {
    const int32_t key0 = (p.dense ? u : us.blocks[u]) * kBlockN;
    if (key0 + kBlockN <= tile.key_len) return;
    const int32_t valid = max(tile.key_len - key0, 0);  // 0: a block past the keys (unchecked lengths)
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
      // O is idle until the next P V: the stage in the thread's slot joins it, the next is requested.
      if (kSplit && p.split.slot_offset != 0 && partials.pending()) {
        char* slot = smem_raw + p.split.slot_offset;
        partials.template merge_async<Traits::kScaledKV, kSlotThreads>(O, softmax, slot, tidx);
        asm volatile("" ::: "memory");  // the slot's reads before its refill
        if (partials.to_come())
          partials.template fetch_async<kSlotThreads>(slot, tidx, p.split.part_ml, p.split.part_o);
      }
    }
    kv.pipe_v.consumer_wait(sv);
    zero_v_tail(n - 1, sv.index());
    wg_gemm<false, true>(mma_pv, tOrP, tOrV(_, _, _, sv.index()), tOrO);
    warpgroup_wait<0>();
    kv.pipe_v.consumer_release(sv);
  }

  // The partials left: the stage in the thread's slot, then groups of kGroup stages, each group's
  // loads into registers (free of S and P now) requested together.
  bool in_slot = kSplit && p.split.slot_offset != 0 && partials.pending();
  while (kSplit && partials.pending()) {
    constexpr int kGroup = 3;
    typename decltype(partials)::Stage group[kGroup];
#pragma unroll
    for (int i = 0; i < kGroup; ++i)
      if (partials.to_come()) partials.fetch(group[i], p.split.part_ml, p.split.part_o);
    if (in_slot) {
      partials.template merge_async<Traits::kScaledKV, kSlotThreads>(O, softmax, smem_raw + p.split.slot_offset,
                                                                    tidx);
      in_slot = false;
    }
#pragma unroll
    for (int i = 0; i < kGroup; ++i)
      if (partials.merged < partials.fetched) partials.template merge<Traits::kScaledKV>(O, softmax, group[i]);
  }

  if constexpr (Traits::kScaledKV) softmax.values_to_units(O);
  Tensor cO = thr_pv.partition_C(make_identity_tensor(Shape<Int<kBlockM>, Int<kHeadDim>>{}));
  Tensor cOrc = make_tensor(cO.data(), acc_rowcol(cO.layout()));
  // Epilogue: normalise, write out (bf16/fp16 pairs) and the natural-log LSE.
  float lse[kRows];
  softmax.finalize(O, p.scale, lse);
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
