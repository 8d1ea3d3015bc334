// Attention backward, query side: dQ = scale * sum_j dS(t, j) K[j] over the tile's support, with
// dS = P * (dP - Delta), P = exp(scale * Q K^T - LSE), dP = dO V^T, Delta = rowsum(dO * O).
//
// The tile and its KV stream are the forward's (fwd_kernel.cuh): kBlockM = 128 rows = m tokens x
// the Gi query heads of one index head, the union of the tokens' selections visited in ascending
// order (every causal block in dense mode), K and V streamed by TMA through two mbarrier
// pipelines by warp 0. Each consumer warpgroup owns 64 rows and keeps its dQ in registers for
// the whole tile, so dQ is written once, with no atomics (dK and dV come from bwd_kv_kernel.cuh).
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
struct BwdQTraits {
  using Element = Element_;
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kBlockN = kBlockN_;
  static constexpr int kBlockM = 128;
  static constexpr int kStages = 2;
  static constexpr int kConsumerThreads = 256;
  static constexpr int kThreads = kConsumerThreads + 128;

  // S = Q K^T and dP = dO V^T (both SS, K-major); dQ += dS K (RS, K as the MN-major B operand).
  using TileS = Shape<Int<kBlockM>, Int<kBlockN>, Int<kHeadDim>>;
  using TileDQ = Shape<Int<kBlockM>, Int<kHeadDim>, Int<kBlockN>>;
  using MmaS = decltype(make_tiled_mma(GMMA::ss_op_selector<Element, Element, float, TileS>(),
                                       Layout<Shape<_2, _1, _1>>{}));
  using MmaDQ = decltype(make_tiled_mma(
      GMMA::rs_op_selector<Element, Element, float, TileDQ, GMMA::Major::K, GMMA::Major::MN>(),
      Layout<Shape<_2, _1, _1>>{}));

  using SmemAtomQ = decltype(cutlass::gemm::collective::detail::ss_smem_selector<
                             GMMA::Major::K, Element, Int<kBlockM>, Int<kHeadDim>>());
  using SmemLayoutQ = decltype(tile_to_shape(SmemAtomQ{}, Shape<Int<kBlockM>, Int<kHeadDim>>{}));
  using SmemAtomKV = decltype(cutlass::gemm::collective::detail::ss_smem_selector<
                              GMMA::Major::K, Element, Int<kBlockN>, Int<kHeadDim>>());
  using SmemLayoutKV = decltype(tile_to_shape(
      SmemAtomKV{}, Shape<Int<kBlockN>, Int<kHeadDim>, Int<kStages>>{}));
  using SmemLayoutKt = decltype(composition(
      SmemLayoutKV{}, make_ordered_layout(Shape<Int<kHeadDim>, Int<kBlockN>, Int<kStages>>{},
                                          Step<_2, _1, _3>{})));

  using GLayout = Layout<Shape<int32_t, int32_t, int32_t>, Stride<int64_t, _1, int64_t>>;
  using Tma = decltype(make_tma_copy(
      SM90_TMA_LOAD{}, make_tensor(make_gmem_ptr(static_cast<Element const*>(nullptr)), GLayout{}),
      take<0, 2>(SmemLayoutKV{}), Shape<Int<kBlockN>, Int<kHeadDim>>{}, _1{}));

  using Pipeline = cutlass::PipelineTmaAsync<kStages>;
  static constexpr uint32_t kTmaBytes = kBlockN * kHeadDim * sizeof(Element);

  struct SharedStorage {
    alignas(1024) cute::array_aligned<Element, cosize_v<SmemLayoutQ>> q;
    alignas(1024) cute::array_aligned<Element, cosize_v<SmemLayoutQ>> dout;
    alignas(1024) cute::array_aligned<Element, cosize_v<SmemLayoutKV>> k;
    alignas(1024) cute::array_aligned<Element, cosize_v<SmemLayoutKV>> v;
    typename Pipeline::SharedStorage pipe_k;
    typename Pipeline::SharedStorage pipe_v;
    int32_t num_blocks;
  };
  static constexpr size_t kUnionOffset = (sizeof(SharedStorage) + 15) / 16 * 16;
};

template <class Traits>
struct BwdQParams {
  using Element = typename Traits::Element;
  typename Traits::Tma tma_k, tma_v;
  const Element* q;
  int64_t q_s0, q_s1;
  const Element* dout;
  int64_t do_s0, do_s1;
  const float* lse;
  int64_t lse_s0, lse_s1;
  const float* delta;  // [T, Hq] contiguous
  Element* dq;
  int64_t dq_s0, dq_s1;
  const int32_t* block_idx;
  int64_t bi_s0, bi_s1;
  const int32_t* cu_seqlens;
  int32_t nseq;
  int32_t T;
  int32_t Hq, Hkv, Hi;
  int32_t heads_per_idx;
  int32_t idx_per_kv;
  int32_t tile_tokens;
  int32_t k;
  float scale;       // signed softmax scale
  float scale_log2;  // scale * log2(e), signed
  bool dense;
  int32_t bitmap_words, capacity, mask_words;
  int64_t num_tiles;
};

// Rows (token, head) of a [T, H, D] tensor into a swizzled shared tile, zero for padding rows.
template <int kRowsTile, int kHeadDim, int kThreadsUsed, class SmemTensor, class Element>
__device__ inline void load_head_rows(SmemTensor& s, const Element* base, int64_t s0, int64_t s1,
                                      int32_t first_head, int32_t heads, int32_t tokens,
                                      int tidx) {
  constexpr int kChunks = kHeadDim / 8;
  const int32_t rows_used = tokens * heads;
  for (int e = tidx; e < kRowsTile * kChunks; e += kThreadsUsed) {
    const int row = e / kChunks, c = e % kChunks;
    uint4 val = make_uint4(0, 0, 0, 0);
    if (row < rows_used) {
      const int tok = row / heads, h = row - tok * heads;
      val = *reinterpret_cast<const uint4*>(base + tok * s0 + (int64_t)(first_head + h) * s1 + c * 8);
    }
    *reinterpret_cast<uint4*>(&s(row, c * 8)) = val;
  }
}

template <class Traits>
__global__ void __launch_bounds__(Traits::kThreads, 1)
    bwd_q_kernel(const __grid_constant__ BwdQParams<Traits> p) {
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

  const int64_t tile_id = p.num_tiles - 1 - blockIdx.x;
  const int32_t ih = blockIdx.y;
  const int32_t kvh = ih / p.idx_per_kv;
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
  Tensor sdO = make_tensor(make_smem_ptr(ss.dout.data()), typename Traits::SmemLayoutQ{});
  Tensor sK = make_tensor(make_smem_ptr(ss.k.data()), typename Traits::SmemLayoutKV{});
  Tensor sV = make_tensor(make_smem_ptr(ss.v.data()), typename Traits::SmemLayoutKV{});
  Tensor sKt = make_tensor(make_smem_ptr(ss.k.data()), typename Traits::SmemLayoutKt{});

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
      pipe_v.producer_acquire(state);
      copy(p.tma_v.with(*pipe_v.producer_get_barrier(state), 0), tVg(_, b), tVs(_, state.index()));
      ++state;
    }
    return;
  }

  // ---------------------------------------------------------------- consumers
  cutlass::arch::warpgroup_reg_alloc<232>();
  const int tidx = threadIdx.x - 128;
  const int32_t Gi = p.heads_per_idx;
  const int64_t tok0 = tile.seq_start + tile.first;
  load_head_rows<kBlockM, kHeadDim, Traits::kConsumerThreads>(
      sQ, p.q + tok0 * p.q_s0, p.q_s0, p.q_s1, ih * Gi, Gi, tile.count, tidx);
  load_head_rows<kBlockM, kHeadDim, Traits::kConsumerThreads>(
      sdO, p.dout + tok0 * p.do_s0, p.do_s0, p.do_s1, ih * Gi, Gi, tile.count, tidx);
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

  const int32_t rows_used = p.tile_tokens * Gi;
  int32_t row_tok[kRows];
  bool row_ok[kRows];
  float row_lse2[kRows], row_delta[kRows];
#pragma unroll
  for (int r = 0; r < kRows; ++r) {
    const int row = get<0>(cSrc(r, 0));
    row_tok[r] = row / Gi;
    row_ok[r] = row < rows_used && row_tok[r] < tile.count;
    row_lse2[r] = 0.f;
    row_delta[r] = 0.f;
    if (row_ok[r]) {
      const int64_t t = tok0 + row_tok[r];
      const int32_t head = ih * Gi + (row - row_tok[r] * Gi);
      row_lse2[r] = p.lse[t * p.lse_s0 + head * p.lse_s1] * static_cast<float>(M_LOG2E);
      row_delta[r] = p.delta[t * p.Hq + head];
    }
  }

  cutlass::arch::NamedBarrier::sync(Traits::kConsumerThreads + 32,
                                    static_cast<uint32_t>(Barrier::kListReady));
  const int32_t n = ss.num_blocks;
  const int wg = tidx / 128;

  // Keys past the sequence end belong to the next sequence; their dS is 0, but 0 * NaN is not,
  // so those K rows are zeroed before dQ += dS K (each warpgroup before its own GEMM).
  auto zero_k_tail = [&](int32_t key0, int stage) {
    if (key0 + kBlockN <= tile.seq_len) return;
    const int32_t valid = tile.seq_len - key0;
    constexpr int kChunks = kHeadDim / 8;
    for (int e = tidx % 128; e < (kBlockN - valid) * kChunks; e += 128) {
      const int row = valid + e / kChunks, c = e % kChunks;
      *reinterpret_cast<uint4*>(&sK(row, c * 8, stage)) = make_uint4(0, 0, 0, 0);
    }
    cutlass::arch::fence_view_async_shared();
    cutlass::arch::NamedBarrier::sync(128, static_cast<uint32_t>(Barrier::kVTail) + wg);
  };

  Tensor rdS = make_tensor<Element>(tSrS.layout());
  Tensor tdQrdS = make_tensor(rdS.data(), acc_as_a_operand(rdS.layout()));
  typename Pipeline::PipelineState sk, sv;
  for (int32_t u = 0; u < n; ++u) {
    const int32_t b = p.dense ? u : us.blocks[u];
    const int32_t key0 = b * kBlockN;
    pipe_k.consumer_wait(sk);
    wg_gemm<true>(mma_s, tSrQ, tSrK(_, _, _, sk.index()), tSrS);
    pipe_v.consumer_wait(sv);
    wg_gemm<true>(mma_s, tSrdO, tSrV(_, _, _, sv.index()), tSrdP);
    warpgroup_wait<0>();
    pipe_v.consumer_release(sv);
    ++sv;
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
        const bool ok = member && !(causal && key0 + get<1>(cSrc(r, c)) > qpos);
        const float prob = fast_exp2(S(r, c) * p.scale_log2 - row_lse2[r]);
        S(r, c) = ok ? prob * (dP(r, c) - row_delta[r]) : 0.f;
      }
    }
    convert_into(tSrS, rdS);
    zero_k_tail(key0, sk.index());
    wg_gemm<false, true>(mma_dq, tdQrdS, tdQrK(_, _, _, sk.index()), tdQrdQ);
    warpgroup_wait<0>();
    pipe_k.consumer_release(sk);
    ++sk;
  }

  Tensor cQ = thr_dq.partition_C(make_identity_tensor(Shape<Int<kBlockM>, Int<kHeadDim>>{}));
  Tensor cQrc = make_tensor(cQ.data(), acc_rowcol(cQ.layout()));
  Tensor dQ = make_tensor(tdQrdQ.data(), acc_rowcol(tdQrdQ.layout()));
#pragma unroll
  for (int r = 0; r < kRows; ++r) {
    if (!row_ok[r]) continue;
    const int row = get<0>(cQrc(r, 0));
    const int64_t t = tok0 + row_tok[r];
    const int64_t head = (int64_t)ih * Gi + (row - row_tok[r] * Gi);
    Element* dst = p.dq + t * p.dq_s0 + head * p.dq_s1;
#pragma unroll
    for (int c = 0; c < size<1>(dQ); c += 2) {
      cutlass::Array<Element, 2> pair;
      pair[0] = static_cast<Element>(dQ(r, c) * p.scale);
      pair[1] = static_cast<Element>(dQ(r, c + 1) * p.scale);
      *reinterpret_cast<cutlass::Array<Element, 2>*>(dst + get<1>(cQrc(r, c))) = pair;
    }
  }
}

}  // namespace msa::cuda::kern
