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

#include "block_union.cuh"
#include "softmax.cuh"
#include "tile.cuh"
#include "utils.cuh"

namespace msa::cuda::kern {

template <class Element_, int kHeadDim_, int kBlockN_>
struct FwdTraits {
  using Element = Element_;
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kBlockN = kBlockN_;  // the MSA block size Bk
  static constexpr int kBlockM = 128;
  static constexpr int kStages = 2;
  static constexpr int kConsumerThreads = 256;
  static constexpr int kThreads = kConsumerThreads + 128;

  using TileQK = Shape<Int<kBlockM>, Int<kBlockN>, Int<kHeadDim>>;
  using TilePV = Shape<Int<kBlockM>, Int<kHeadDim>, Int<kBlockN>>;
  using MmaQK = decltype(make_tiled_mma(GMMA::ss_op_selector<Element, Element, float, TileQK>(),
                                        Layout<Shape<_2, _1, _1>>{}));
  using MmaPV = decltype(make_tiled_mma(
      GMMA::rs_op_selector<Element, Element, float, TilePV, GMMA::Major::K, GMMA::Major::MN>(),
      Layout<Shape<_2, _1, _1>>{}));

  using SmemAtomQ = decltype(cutlass::gemm::collective::detail::ss_smem_selector<
                             GMMA::Major::K, Element, Int<kBlockM>, Int<kHeadDim>>());
  using SmemLayoutQ = decltype(tile_to_shape(SmemAtomQ{}, Shape<Int<kBlockM>, Int<kHeadDim>>{}));
  using SmemAtomKV = decltype(cutlass::gemm::collective::detail::ss_smem_selector<
                              GMMA::Major::K, Element, Int<kBlockN>, Int<kHeadDim>>());
  using SmemLayoutKV = decltype(tile_to_shape(
      SmemAtomKV{}, Shape<Int<kBlockN>, Int<kHeadDim>, Int<kStages>>{}));
  // V viewed as the (D, Bk) B operand of P V: D-contiguous, i.e. MN-major.
  using SmemLayoutVt = decltype(composition(
      SmemLayoutKV{}, make_ordered_layout(Shape<Int<kHeadDim>, Int<kBlockN>, Int<kStages>>{},
                                          Step<_2, _1, _3>{})));

  // K and V in global memory as (tokens, dim, kv head).
  using GLayout = Layout<Shape<int32_t, int32_t, int32_t>, Stride<int64_t, _1, int64_t>>;
  using Tma = decltype(make_tma_copy(
      SM90_TMA_LOAD{}, make_tensor(make_gmem_ptr(static_cast<Element const*>(nullptr)), GLayout{}),
      take<0, 2>(SmemLayoutKV{}), Shape<Int<kBlockN>, Int<kHeadDim>>{}, _1{}));

  using Pipeline = cutlass::PipelineTmaAsync<kStages>;
  static constexpr uint32_t kTmaBytes = kBlockN * kHeadDim * sizeof(Element);

  struct SharedStorage {
    alignas(1024) cute::array_aligned<Element, cosize_v<SmemLayoutQ>> q;
    alignas(1024) cute::array_aligned<Element, cosize_v<SmemLayoutKV>> k;
    alignas(1024) cute::array_aligned<Element, cosize_v<SmemLayoutKV>> v;
    typename Pipeline::SharedStorage pipe_k;
    typename Pipeline::SharedStorage pipe_v;
    int32_t num_blocks;
  };
  // Followed in dynamic shared memory by the block-union arrays (see union_bytes).
  static constexpr size_t kUnionOffset = (sizeof(SharedStorage) + 15) / 16 * 16;
};

template <class Traits>
struct FwdParams {
  using Element = typename Traits::Element;
  typename Traits::Tma tma_k, tma_v;
  const Element* q;
  int64_t q_s0, q_s1;
  Element* out;
  int64_t o_s0, o_s1;
  float* lse;
  int64_t lse_s0, lse_s1;
  const int32_t* block_idx;  // [T, Hi, k] (sparse mode)
  int64_t bi_s0, bi_s1;
  const int32_t* cu_seqlens;  // null: one sequence
  int32_t nseq;
  int32_t T;
  int32_t Hkv, Hi;
  int32_t heads_per_idx;  // Gi
  int32_t idx_per_kv;     // Hi / Hkv
  int32_t tile_tokens;    // m = kBlockM / Gi
  int32_t k;
  float scale;       // |softmax scale|
  float scale_log2;  // |scale| * log2(e)
  bool negate;       // the softmax scale is negative: Q is negated on load, |scale| used
  bool dense;
  bool lse_only;  // LSE over the support only: no V, no out (the index softmax's normaliser)
  int32_t bitmap_words, capacity, mask_words;
  int64_t num_tiles;
};

template <class Traits>
__global__ void __launch_bounds__(Traits::kThreads, 1)
    fwd_kernel(const __grid_constant__ FwdParams<Traits> p) {
  using Element = typename Traits::Element;
  constexpr int kBlockM = Traits::kBlockM, kBlockN = Traits::kBlockN, kHeadDim = Traits::kHeadDim;
  using SharedStorage = typename Traits::SharedStorage;
  using Pipeline = typename Traits::Pipeline;

  extern __shared__ __align__(1024) char smem_raw[];
  SharedStorage& ss = *reinterpret_cast<SharedStorage*>(smem_raw);
  int32_t* uni = reinterpret_cast<int32_t*>(smem_raw + Traits::kUnionOffset);
  UnionSmem us;
  us.bitmap = reinterpret_cast<uint32_t*>(uni);
  us.prefix = uni + p.bitmap_words;
  us.blocks = uni + 2 * p.bitmap_words;
  us.members = reinterpret_cast<uint32_t*>(uni + 2 * p.bitmap_words + p.capacity);
  us.mask_words = p.mask_words;

  // Heavy (late) tiles first.
  const int64_t tile_id = p.num_tiles - 1 - blockIdx.x;
  const int32_t ih = blockIdx.y;               // index head
  const int32_t kvh = ih / p.idx_per_kv;       // its KV head
  const QueryTile tile = decode_tile(p.cu_seqlens, p.nseq, p.T, p.tile_tokens, tile_id);
  if (tile.count == 0) return;
  const int32_t last_block = (tile.first + tile.count - 1) / kBlockN;

  const int warp = cutlass::canonical_warp_idx_sync();
  const int lane = threadIdx.x & 31;
  const bool producer = warp < 4;

  typename Pipeline::Params pp;
  pp.transaction_bytes = Traits::kTmaBytes;
  pp.role = producer ? Pipeline::ThreadCategory::Producer : Pipeline::ThreadCategory::Consumer;
  pp.is_leader = threadIdx.x == 0;
  pp.num_consumers = Traits::kConsumerThreads;
  Pipeline pipe_k(ss.pipe_k, pp, Shape<_1, _1, _1>{});
  Pipeline pipe_v(ss.pipe_v, pp, Shape<_1, _1, _1>{});
  if (warp == 0) {
    for (int w = lane; w < p.bitmap_words; w += 32) us.bitmap[w] = 0u;
  }
  __syncthreads();

  Tensor sQ = make_tensor(make_smem_ptr(ss.q.data()), typename Traits::SmemLayoutQ{});
  Tensor sK = make_tensor(make_smem_ptr(ss.k.data()), typename Traits::SmemLayoutKV{});
  Tensor sV = make_tensor(make_smem_ptr(ss.v.data()), typename Traits::SmemLayoutKV{});
  Tensor sVt = make_tensor(make_smem_ptr(ss.v.data()), typename Traits::SmemLayoutVt{});

  if (producer) {
    cutlass::arch::warpgroup_reg_dealloc<40>();
    if (warp != 0) return;
    int32_t n;
    if (p.dense) {
      n = last_block + 1;
    } else {
      const int32_t* rows = p.block_idx + (tile.seq_start + tile.first) * p.bi_s0 + ih * p.bi_s1;
      n = build_block_union(us, rows, p.bi_s0, p.k, tile.first, tile.count, kBlockN, lane);
    }
    if (lane == 0) ss.num_blocks = n;
    __syncwarp();
    cutlass::arch::NamedBarrier::arrive(Traits::kConsumerThreads + 32,
                                        static_cast<uint32_t>(Barrier::kListReady));
    if (lane != 0) return;

    Tensor mK = p.tma_k.get_tma_tensor(make_shape(p.T, kHeadDim, p.Hkv));
    Tensor mV = p.tma_v.get_tma_tensor(make_shape(p.T, kHeadDim, p.Hkv));
    const int32_t seq0 = static_cast<int32_t>(tile.seq_start);
    Tensor gK = local_tile(domain_offset(make_coord(seq0, _0{}), mK(_, _, kvh)),
                           Shape<Int<kBlockN>, Int<kHeadDim>>{}, make_coord(_, _0{}));
    Tensor gV = local_tile(domain_offset(make_coord(seq0, _0{}), mV(_, _, kvh)),
                           Shape<Int<kBlockN>, Int<kHeadDim>>{}, make_coord(_, _0{}));
    auto [tKg, tKs] = tma_partition(p.tma_k, _0{}, Layout<_1>{}, group_modes<0, 2>(sK),
                                    group_modes<0, 2>(gK));
    auto [tVg, tVs] = tma_partition(p.tma_v, _0{}, Layout<_1>{}, group_modes<0, 2>(sV),
                                    group_modes<0, 2>(gV));
    auto state = cutlass::make_producer_start_state<Pipeline>();
    for (int32_t u = 0; u < n; ++u) {
      const int32_t b = p.dense ? u : us.blocks[u];
      pipe_k.producer_acquire(state);
      copy(p.tma_k.with(*pipe_k.producer_get_barrier(state), 0), tKg(_, b), tKs(_, state.index()));
      if (!p.lse_only) {
        pipe_v.producer_acquire(state);
        copy(p.tma_v.with(*pipe_v.producer_get_barrier(state), 0), tVg(_, b), tVs(_, state.index()));
      }
      ++state;
    }
    return;
  }

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
        const Element* src = p.q + (tile.seq_start + tile.first + tok) * p.q_s0 +
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
    const bool causal = key0 + kBlockN - 1 > tile.first;
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      bool member = row_ok[r];
      if (!p.dense && member) {
        const uint32_t word = us.members[u * p.mask_words + (row_tok[r] >> 5)];
        member = (word >> (row_tok[r] & 31)) & 1u;
      }
      const int32_t qpos = tile.first + row_tok[r];
#pragma unroll
      for (int c = 0; c < size<1>(S); ++c) {
        if (!member || (causal && key0 + get<1>(cSrc(r, c)) > qpos)) S(r, c) = -INFINITY;
      }
    }
    softmax.update(S, corr);
  };
  // Keys past the sequence end belong to the next sequence: P is 0 there, but 0 * NaN is not,
  // so those rows of the V stage are zeroed. Each warpgroup zeroes them before its own P V (the
  // two may both write the same zeros), then syncs its 128 threads.
  const int wg = tidx / 128;
  auto zero_v_tail = [&](int32_t u, int stage) {
    const int32_t key0 = (p.dense ? u : us.blocks[u]) * kBlockN;
    if (key0 + kBlockN <= tile.seq_len) return;
    const int32_t valid = tile.seq_len - key0;
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
      pipe_k.consumer_wait(sk);
      wg_gemm<true>(mma_qk, tSrQ, tSrK(_, _, _, sk.index()), tSrS);
      warpgroup_wait<0>();
      pipe_k.consumer_release(sk);
      ++sk;
      softmax_step(u, corr);
    }
  } else if (n > 0) {
    // Software pipeline: S of block u+1 is computed while O += P V of block u runs.
    pipe_k.consumer_wait(sk);
    wg_gemm<true>(mma_qk, tSrQ, tSrK(_, _, _, sk.index()), tSrS);
    warpgroup_wait<0>();
    pipe_k.consumer_release(sk);
    ++sk;
    softmax_step(0, corr);
    convert_into(tSrS, rP);
    for (int32_t u = 1; u < n; ++u) {
      pipe_k.consumer_wait(sk);
      wg_gemm<true>(mma_qk, tSrQ, tSrK(_, _, _, sk.index()), tSrS);
      pipe_v.consumer_wait(sv);
      zero_v_tail(u - 1, sv.index());
      wg_gemm<false, true>(mma_pv, tOrP, tOrV(_, _, _, sv.index()), tOrO);
      warpgroup_wait<1>();
      pipe_k.consumer_release(sk);
      ++sk;
      softmax_step(u, corr);
      warpgroup_wait<0>();
      pipe_v.consumer_release(sv);
      ++sv;
      OnlineSoftmax<kRows>::rescale(O, corr);
      convert_into(tSrS, rP);
    }
    pipe_v.consumer_wait(sv);
    zero_v_tail(n - 1, sv.index());
    wg_gemm<false, true>(mma_pv, tOrP, tOrV(_, _, _, sv.index()), tOrO);
    warpgroup_wait<0>();
    pipe_v.consumer_release(sv);
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
    Element* dst = p.out + t * p.o_s0 + head * p.o_s1;
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
