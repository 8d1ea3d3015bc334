// The KV stream of the query-tile kernels (fwd_kernel.cuh, bwd_q_kernel.cuh): the tile a CTA
// owns, the shared memory of its block list, two mbarrier pipelines (K and V), and the producer
// warp that builds the tile's block list (block_list.cuh), hands it to the consumer warpgroups
// (Barrier::kListReady) and streams the K tile, and optionally the V tile, of every listed block
// by TMA, in list order.
//
// Traits: a QueryTileTraits with its SharedStorage (StorageQ or StorageQdO) and kUnionOffset. Params: the kernel's parameters, which hold the TMA
// descriptors tma_k / tma_v and the QueryTileArgs fields (args.h).
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/gemm/collective/builders/sm90_common.inl>
#include <cutlass/pipeline/sm90_pipeline.hpp>

#include "block_list.cuh"
#include "tile.cuh"
#include "utils.cuh"

namespace msa::cuda::kern {

// The shapes both query-tile kernels share: kBlockM = 128 rows of (token, head), Q in a K-major
// swizzled tile, K/V blocks in kStages TMA stages, two consumer warpgroups and a producer one.
template <class Element_, int kHeadDim_, int kBlockN_>
struct QueryTileTraits {
  using Element = Element_;
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kBlockN = kBlockN_;  // the MSA block size Bk
  static constexpr int kBlockM = 128;
  static constexpr int kStages = 2;
  static constexpr int kConsumerThreads = 256;
  static constexpr int kThreads = kConsumerThreads + 128;

  using SmemAtomQ = decltype(cutlass::gemm::collective::detail::ss_smem_selector<
                             GMMA::Major::K, Element, Int<kBlockM>, Int<kHeadDim>>());
  using SmemLayoutQ = decltype(tile_to_shape(SmemAtomQ{}, Shape<Int<kBlockM>, Int<kHeadDim>>{}));
  using SmemAtomKV = decltype(cutlass::gemm::collective::detail::ss_smem_selector<
                              GMMA::Major::K, Element, Int<kBlockN>, Int<kHeadDim>>());
  using SmemLayoutKV = decltype(tile_to_shape(
      SmemAtomKV{}, Shape<Int<kBlockN>, Int<kHeadDim>, Int<kStages>>{}));
  // K or V viewed as the (D, Bk) B operand of P V or dS K: D-contiguous, i.e. MN-major.
  using SmemLayoutKVt = decltype(composition(
      SmemLayoutKV{}, make_ordered_layout(Shape<Int<kHeadDim>, Int<kBlockN>, Int<kStages>>{},
                                          Step<_2, _1, _3>{})));

  // K and V in global memory as (tokens, dim, kv head).
  using GLayout = Layout<Shape<int32_t, int32_t, int32_t>, Stride<int64_t, _1, int64_t>>;
  using Tma = decltype(make_tma_copy(
      SM90_TMA_LOAD{}, make_tensor(make_gmem_ptr(static_cast<Element const*>(nullptr)), GLayout{}),
      take<0, 2>(SmemLayoutKV{}), Shape<Int<kBlockN>, Int<kHeadDim>>{}, _1{}));

  using Pipeline = cutlass::PipelineTmaAsync<kStages>;
  static constexpr uint32_t kTmaBytes = kBlockN * kHeadDim * sizeof(Element);

  // The tile's two GEMMs, split over the two consumer warpgroups (64 rows each): rows x keys
  // over D, both operands K-major (S = Q K^T, dP = dO V^T), and rows x D over the keys, the
  // first operand from registers and the keys' block as the MN-major B operand (O += P V,
  // dQ += dS K).
  using TileRowsKeys = Shape<Int<kBlockM>, Int<kBlockN>, Int<kHeadDim>>;
  using TileRowsDim = Shape<Int<kBlockM>, Int<kHeadDim>, Int<kBlockN>>;
  using MmaRowsKeys = decltype(make_tiled_mma(
      GMMA::ss_op_selector<Element, Element, float, TileRowsKeys>(), Layout<Shape<_2, _1, _1>>{}));
  using MmaRowsDim = decltype(make_tiled_mma(
      GMMA::rs_op_selector<Element, Element, float, TileRowsDim, GMMA::Major::K, GMMA::Major::MN>(),
      Layout<Shape<_2, _1, _1>>{}));

  // Where the block-union arrays start after a kernel's shared storage (16-byte aligned).
  template <class Storage>
  static constexpr size_t union_offset() {
    return (sizeof(Storage) + 15) / 16 * 16;
  }

  // Shared memory: Q, the K and V stages, the pipelines and the list length; the block-union
  // arrays (UnionLayout) follow at kUnionOffset. The backward's tile also holds dO.
  struct StorageQ {
    alignas(1024) cute::array_aligned<Element, cosize_v<SmemLayoutQ>> q;
    alignas(1024) cute::array_aligned<Element, cosize_v<SmemLayoutKV>> k;
    alignas(1024) cute::array_aligned<Element, cosize_v<SmemLayoutKV>> v;
    typename Pipeline::SharedStorage pipe_k;
    typename Pipeline::SharedStorage pipe_v;
    int32_t num_blocks;
  };
  struct StorageQdO : StorageQ {
    alignas(1024) cute::array_aligned<Element, cosize_v<SmemLayoutQ>> dout;
  };
};

// The CTA's tile, of the ids [tile_lo, tile_lo + num_tiles): blockIdx.x counts from the last
// (heavy, late tiles first); count 0: nothing to do. With a page table or keys apart, the tile's
// tokens are the last tile.seq_len of their sequence's keys.
template <class Params>
__device__ QueryTile query_tile(const Params& p) {
  QueryTile t = decode_tile(p.cu_seqlens, p.nseq, p.T, p.tile_tokens,
                            p.tile_lo + p.num_tiles - 1 - blockIdx.x);
  p.paged.place(t);
  return t;
}

template <class Traits>
struct QueryTileStream {
  using Pipeline = typename Traits::Pipeline;
  using SharedStorage = typename Traits::SharedStorage;
  char* smem;
  SharedStorage& ss;
  int32_t ih;   // the tile's head group (index head; dense mode: KV head)
  int32_t kvh;  // its KV head
  bool producer;  // the first warpgroup: warp 0 produces, the others leave
  Pipeline pipe_k, pipe_v;

  // Every thread constructs the stream of the CTA's tile (query_tile()): the pipelines, the union
  // bitmap cleared, then a CTA barrier.
  template <class Params>
  __device__ QueryTileStream(char* smem_, const Params& p)
      : smem(smem_),
        ss(*reinterpret_cast<SharedStorage*>(smem_)),
        ih(blockIdx.y),
        kvh(blockIdx.y / p.idx_per_kv),
        producer(cutlass::canonical_warp_idx_sync() < 4),
        pipe_k(ss.pipe_k, pipeline_params(producer), Shape<_1, _1, _1>{}),
        pipe_v(ss.pipe_v, pipeline_params(producer), Shape<_1, _1, _1>{}) {
    if (cutlass::canonical_warp_idx_sync() == 0) {
      uint32_t* bitmap = us(p).bitmap;
      for (int w = threadIdx.x & 31; w < p.uni.bitmap_words; w += 32) bitmap[w] = 0u;
    }
    __syncthreads();
  }

  static __device__ typename Pipeline::Params pipeline_params(bool producer) {
    typename Pipeline::Params pp;
    pp.transaction_bytes = Traits::kTmaBytes;
    pp.role = producer ? Pipeline::ThreadCategory::Producer : Pipeline::ThreadCategory::Consumer;
    pp.is_leader = threadIdx.x == 0;
    pp.num_consumers = Traits::kConsumerThreads;
    return pp;
  }

  // The block-union arrays (block_list.cuh) after SharedStorage.
  template <class Params>
  __device__ UnionSmem us(const Params& p) const {
    return p.uni.carve(smem + Traits::kUnionOffset);
  }

  // The warp roles. The producer warpgroup gives registers back and its warp 0 produces (the
  // block list, then the TMA stream); it returns true, and the kernel returns. The consumer
  // warpgroups take the registers and get false.
  template <class Params, class TensorK, class TensorV>
  __device__ bool producer_done(const Params& p, const QueryTile& tile, TensorK& sK, TensorV& sV,
                                bool with_v) {
    if (!producer) {
      cutlass::arch::warpgroup_reg_alloc<232>();
      return false;
    }
    cutlass::arch::warpgroup_reg_dealloc<40>();
    if (cutlass::canonical_warp_idx_sync() == 0) produce(p, tile, sK, sV, with_v);
    return true;
  }

  // share > 0: the split forward keeps the union's blocks at least that many of the tile's tokens
  // selected (keep_shared_blocks; sparse mode only).
  template <class Params, class TensorK, class TensorV>
  __device__ void produce(const Params& p, const QueryTile& tile, TensorK& sK, TensorV& sV,
                          bool with_v, int32_t share = 0) {
    constexpr int kBlockN = Traits::kBlockN, kHeadDim = Traits::kHeadDim;
    const int lane = threadIdx.x & 31;
    int32_t n;
    if (p.dense) {
      n = (tile.pos0 + tile.count - 1) / kBlockN + 1;
    } else {
      const int32_t* rows = p.block_idx + (tile.seq_start + tile.first) * p.bi_s0 + ih * p.bi_s1;
      n = build_block_union(us(p), rows, p.bi_s0, p.top_k, tile.pos0, tile.count, kBlockN, lane);
      if (share > 0) n = keep_shared_blocks(us(p), n, share, lane);
    }
    if (lane == 0) ss.num_blocks = n;
    __syncwarp();
    cutlass::arch::NamedBarrier::arrive(Traits::kConsumerThreads + 32,
                                        static_cast<uint32_t>(Barrier::kListReady));
    if (lane != 0) return;

    const int32_t rows = p.paged.rows(p.T);
    Tensor mK = p.tma_k.get_tma_tensor(make_shape(rows, kHeadDim, p.Hkv));
    Tensor mV = p.tma_v.get_tma_tensor(make_shape(rows, kHeadDim, p.Hkv));
    // Block b is tile b of the sequence's key rows, or page pages[b] (an id out of range reads
    // zeros: TMA fills boxes outside the tensor).
    const int32_t* pages = p.paged.pages(tile);
    const int32_t seq0 = pages != nullptr ? 0 : static_cast<int32_t>(p.paged.key_start(tile));
    Tensor gK = local_tile(domain_offset(make_coord(seq0, _0{}), mK(_, _, kvh)),
                           Shape<Int<kBlockN>, Int<kHeadDim>>{}, make_coord(_, _0{}));
    Tensor gV = local_tile(domain_offset(make_coord(seq0, _0{}), mV(_, _, kvh)),
                           Shape<Int<kBlockN>, Int<kHeadDim>>{}, make_coord(_, _0{}));
    auto [tKg, tKs] = tma_partition(p.tma_k, _0{}, Layout<_1>{}, group_modes<0, 2>(sK),
                                    group_modes<0, 2>(gK));
    auto [tVg, tVs] = tma_partition(p.tma_v, _0{}, Layout<_1>{}, group_modes<0, 2>(sV),
                                    group_modes<0, 2>(gV));
    const BlockList<Params> list{p, us(p)};
    auto state = cutlass::make_producer_start_state<Pipeline>();
    for (int32_t u = 0; u < n; ++u) {
      const int32_t b = pages != nullptr ? pages[list.block(u)] : list.block(u);
      pipe_k.producer_acquire(state);
      copy(p.tma_k.with(*pipe_k.producer_get_barrier(state), 0), tKg(_, b), tKs(_, state.index()));
      if (with_v) {
        pipe_v.producer_acquire(state);
        copy(p.tma_v.with(*pipe_v.producer_get_barrier(state), 0), tVg(_, b), tVs(_, state.index()));
      }
      ++state;
    }
  }

  // Consumers: waits for the block list; returns its length.
  __device__ int32_t wait_list() const {
    cutlass::arch::NamedBarrier::sync(Traits::kConsumerThreads + 32,
                                      static_cast<uint32_t>(Barrier::kListReady));
    return ss.num_blocks;
  }
  // The list to walk (a view; see BlockList).
  template <class Params>
  __device__ BlockList<Params> list(const Params& p) const {
    return BlockList<Params>{p, us(p)};
  }
};

}  // namespace msa::cuda::kern
