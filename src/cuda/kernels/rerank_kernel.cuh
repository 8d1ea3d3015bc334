// Re-ranking of FP8 shortlists (docs/contract.md §2, Options.fp8_rerank = m > 0). The FP8
// select kernel leaves each (token, index head) row's shortlist: its best (free slots + m)
// blocks by FP8 score. These kernels then rank them again by the inputs' own scores:
//
//   rerank_count_kernel,   (rerank_list_kernel.cuh) the shortlist entries listed per segment
//   rerank_scatter_kernel  (KV tile x, index key head): counted, scanned (seg_start), then each
//                          placed by counting its segment's count down, with one atomic per
//                          group of a warp's lanes that share a segment;
//   rerank_score_kernel    one CTA per chunk of up to kRerankChunk entries of one segment, the
//                          KV-block-outer layout of the attention passes: the block's Bk keys
//                          into shared memory once, then tiles of kRerankRows entries in turn,
//                          each tile's query rows gathered by cp.async while the tile before is
//                          multiplied (two buffers): S = Q K^T by wgmma (two consumer
//                          warpgroups of 64 rows, fp32 accumulators, as the bf16 select kernel),
//                          each row's max over the block's keys times |scale_idx| into
//                          score[entry];
//   rerank_pick_kernel     (rerank_list_kernel.cuh) one thread per row: the free slots go to
//                          the blocks the select kernel kept (fp8_rerank_slots > 0: the best
//                          free slots - a by FP8 score, never listed nor scored) and to the best
//                          other shortlisted blocks by that score (ties to the lower block
//                          index), written ascending into the places the select kernel left in
//                          block_idx.
//
// A shortlisted block always precedes the row's local blocks, so all its Bk keys are causal and
// present. The order of a segment's entries depends on the atomics; each entry's score does not
// (a row of S depends only on its own query row), so the selection is deterministic. The score
// is computed as the bf16 select kernel computes it (the same MMA, max, scale and, over an E4M3
// cache's codes, page scale), so a shortlist that holds every candidate gives kInput's
// selection bit for bit.
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/gemm/collective/builders/sm90_common.inl>

#include "../device/grid_dependency.cuh"
#include "../device/load.cuh"
#include "../device/tile.cuh"
#include "../device/utils.cuh"
#include "../host/args.h"

namespace msa::cuda::kern {

template <class Element_, int kDim_, int kBlockN_>
struct RerankTraits {
  using Element = Element_;
  static constexpr int kDim = kDim_;
  static constexpr int kBlockN = kBlockN_;
  static constexpr int kRows = kRerankRows;  // two consumer warpgroups of 64 rows
  static constexpr int kThreads = 256;
  using TileQK = Shape<Int<kRows>, Int<kBlockN>, Int<kDim>>;
  using MmaQK = decltype(make_tiled_mma(GMMA::ss_op_selector<Element, Element, float, TileQK>(),
                                        Layout<Shape<_2, _1, _1>>{}));
  using SmemLayoutQ = decltype(tile_to_shape(
      cutlass::gemm::collective::detail::ss_smem_selector<GMMA::Major::K, Element, Int<kRows>, Int<kDim>>(),
      Shape<Int<kRows>, Int<kDim>>{}));
  using SmemLayoutK = decltype(tile_to_shape(
      cutlass::gemm::collective::detail::ss_smem_selector<GMMA::Major::K, Element, Int<kBlockN>, Int<kDim>>(),
      Shape<Int<kBlockN>, Int<kDim>>{}));
  struct SharedStorage {
    alignas(1024) cute::array_aligned<Element, cosize_v<SmemLayoutQ>> q[2];  // a tile's rows, two buffers
    alignas(1024) cute::array_aligned<Element, cosize_v<SmemLayoutK>> k;
    int64_t q_off[2][kRows];  // each row's q_idx offset (-1: no entry), per buffer
    int32_t entry[2][kRows];  // each row's shortlist entry, per buffer
  };
};

// Warp roles: none (all 256 threads look up the chunk's segment together and load, then each
// warpgroup multiplies its 64 rows of a tile). Pipeline: two buffers of a tile's query rows by
// cp.async, the next tile's gathered while this one is multiplied; the block's keys once. Work:
// chunk blockIdx.x of the segments' lists (CTAs past the last chunk leave), its tiles in turn.
template <class Traits>
__global__ void __launch_bounds__(Traits::kThreads) rerank_score_kernel(const __grid_constant__ SelectArgs a) {
  grid_dependency_begin();
  using Element = typename Traits::Element;
  constexpr int kRows = Traits::kRows, kBlockN = Traits::kBlockN, kDim = Traits::kDim;
  const RerankArgs& r = a.rerank;
  const int32_t chunk = blockIdx.x;
  if (chunk >= r.chunk_start[r.nseg]) return;
  const int32_t nr = r.ranges;
  // The segment: the last s with chunk_start[s] <= chunk (empty segments share their start).
  const int64_t seg = cta_last_le(r.chunk_start, r.nseg, chunk);
  const int32_t e0 = r.seg_start[seg * nr] + (chunk - r.chunk_start[seg]) * kRerankChunk;
  const int32_t count = min(kRerankChunk, r.seg_start[(seg + 1) * nr] - e0);
  const int tiles = (count + kRows - 1) / kRows;
  const int32_t ik = static_cast<int32_t>(seg % a.Hik);
  const QueryTile blk = a.paged.tile_of(a.cu_seqlens, a.nseq, a.T, kBlockN, seg / a.Hik);
  const int32_t Hi = a.Hik * a.idx_per_key;

  extern __shared__ __align__(1024) char smem_raw[];
  auto& ss = *reinterpret_cast<typename Traits::SharedStorage*>(smem_raw);
  Tensor sK = make_tensor(make_smem_ptr(ss.k.data()), typename Traits::SmemLayoutK{});
  const int tidx = threadIdx.x;
  const Element* q_idx = as<Element>(r.q_idx);
  // The block's keys: packed, or a prefill's page.
  const int64_t key0 = a.paged.first_row(blk, kBlockN);
  const Element* keys = as<Element>(r.k_idx) + key0 * r.k_s0 + ik * r.k_s1;
  // One thread copies the same 16 bytes of rows row0, row0 + step, ... of both tiles.
  const BlockRowLoader<kBlockN, kDim, Traits::kThreads> k_load(sK, tidx);
  const BlockRowLoader<kRows, kDim, Traits::kThreads> q_load(
      make_tensor(make_smem_ptr(ss.q[0].data()), typename Traits::SmemLayoutQ{}), tidx);
  // Tile t's entries and q_idx offsets into buffer t % 2 (threads 0 .. kRows - 1; the caller
  // syncs before the gather reads them).
  auto set_rows = [&](int t) {
    if (tidx < kRows) {
      const int32_t row = t * kRows + tidx;
      const int32_t e = row < count ? r.entries[e0 + row] : -1;
      const int32_t q_row = e / r.width;  // token * Hi + head
      ss.entry[t & 1][tidx] = e;
      ss.q_off[t & 1][tidx] = e >= 0 ? int64_t(q_row / Hi) * r.q_s0 + int64_t(q_row % Hi) * r.q_s1 : -1;
    }
  };
  auto gather = [&](int t) {
    const int64_t* off = ss.q_off[t & 1];
    q_load.load_rows(
        ss.q[t & 1].data(), [&](int row) -> const Element* { return off[row] >= 0 ? q_idx + off[row] : nullptr; },
        q_idx);
    cp_async_commit();
  };

  typename Traits::MmaQK mma;
  auto thr = mma.get_thread_slice(tidx);
  Tensor tSrK = thr.partition_fragment_B(sK);
  Tensor cS = thr.partition_C(make_identity_tensor(Shape<Int<kRows>, Int<kBlockN>>{}));
  Tensor cSrc = make_tensor(cS.data(), acc_rowcol(cS.layout()));
  const int32_t keys_in = blk.count;  // Bk, unless the block were a sequence's last
  // The keys' factor (an E4M3 cache's page scale, the codes being the keys), else 1.
  const float factor = r.k_factor != nullptr ? r.k_factor[key0 * a.Hik + ik] : 1.f;

  k_load.load(ss.k.data(), keys, r.k_s0, blk.count);  // one commit group with tile 0's rows
  set_rows(0);
  __syncthreads();
  gather(0);
  for (int t = 0; t < tiles; ++t) {
    const int b = t & 1;
    // Tile t + 1's rows go to the other buffer, once every thread is done with its tile t - 1.
    if (t + 1 < tiles) {
      __syncthreads();
      set_rows(t + 1);
      __syncthreads();
      gather(t + 1);
      cp_async_wait<1>();  // tile t's rows are in
    } else {
      cp_async_wait_all();
    }
    if (r.negate) q_load.negate(ss.q[b].data());  // as the select kernel loads it: |scale_idx| applied
    cutlass::arch::fence_view_async_shared();
    __syncthreads();

    Tensor sQ = make_tensor(make_smem_ptr(ss.q[b].data()), typename Traits::SmemLayoutQ{});
    Tensor tSrS = partition_fragment_C(mma, Shape<Int<kRows>, Int<kBlockN>>{});
    wg_gemm<true>(mma, thr.partition_fragment_A(sQ), tSrK, tSrS);
    warpgroup_wait<0>();
    Tensor S = make_tensor(tSrS.data(), acc_rowcol(tSrS.layout()));
#pragma unroll
    for (int i = 0; i < size<0>(S); ++i) {
      float m[4] = {-INFINITY, -INFINITY, -INFINITY, -INFINITY};
#pragma unroll
      for (int c = 0; c < size<1>(S); ++c)
        m[c & 3] = fmaxf(m[c & 3], get<1>(cSrc(i, c)) < keys_in ? S(i, c) : -INFINITY);
      const float mx = quad_max(fmaxf(fmaxf(m[0], m[1]), fmaxf(m[2], m[3])));
      const int row = get<0>(cSrc(i, 0));
      if ((tidx & 3) == i && t * kRows + row < count) r.score[ss.entry[b][row]] = mx * a.scale * factor;
    }
  }
}

}  // namespace msa::cuda::kern
