// Attention backward, query side from dS: dQ = scale * sum_j dS(t, j) K[j] over the selected
// blocks, where dS comes from memory: bwd_kv_kernel.cuh writes it (BwdKvArgs::ds) while it
// computes dK, so S and dP are computed once, on the KV side, whatever the overlap of
// neighbouring selections. bwd_q_kernel.cuh, which recomputes S and dP over the union of a
// tile's selections, is the other route (Options.dq_pass).
//
// dS of (token t, index head i, block_idx column j) is a [Bk keys][Gi heads] tile (dS^T, as the
// KV side holds it), so a consumer warpgroup's 64 rows (64 / Gi tokens x Gi heads) over one
// block are the MN-major A operand of dQ += dS K: each key's 64 row values are 16-byte pieces
// of its tokens' tiles. At Gi = 2 and 4 a key's heads are only 4 or 8 bytes, so the tile is
// [Bk / 64][Gi heads][64 keys] (BwdKvArgs::ds) and the A operand K-major: 16-byte pieces of 8
// keys of one head (BwdDqTraits::kDsGi).
//
// The tile, its block list and the K stream are the query-tile kernels' (device/kv_producer.cuh:
// kBlockM = 128 rows = m tokens x the Gi query heads of one index head; warp 0 builds the union
// of the tokens' selections and streams K by TMA; V is not read). Warp roles: the producer warp
// and two consumer warpgroups of 64 rows each. Pipelines: kStages K stages (mbarriers), and per
// consumer warpgroup kDsStages dS stages filled by its own cp.async, kDsStages - 1 blocks ahead,
// each refill issued while the block before it is multiplied.
// Work: one query tile of one index head, over the tokens of the pass [tok_lo, tok_hi): a
// warpgroup computes only the blocks one of its pass tokens selected (rows of its other tokens
// are zeros, filled only where the stage's rows are not zero already) and writes dQ of its pass
// tokens once, with no atomics.
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/gemm/collective/builders/sm90_common.inl>
#include <cutlass/pipeline/sm90_pipeline.hpp>

#include "../device/block_list.cuh"
#include "../device/epilogue.cuh"
#include "../device/grid_dependency.cuh"
#include "../device/kv_producer.cuh"
#include "../device/load.cuh"
#include "../device/tile.cuh"
#include "../device/utils.cuh"
#include "../host/args.h"

namespace msa::cuda::kern {

using cuda::BwdDqArgs;

template <class Element_, int kHeadDim_, int kBlockN_, int kDsGi_ = 0>
struct BwdDqTraits : QueryTileTraits<Element_, kHeadDim_, kBlockN_> {
  using Base = QueryTileTraits<Element_, kHeadDim_, kBlockN_>;
  using Element = Element_;
  static constexpr int kHeadDim = kHeadDim_, kBlockN = kBlockN_, kBlockM = Base::kBlockM;
  // kDsGi = Gi = 2 or 4: dS tiles [Bk / 64][Gi heads][64 keys], the A operand K-major (see the
  // top); 0: Gi >= 8 at run time, [Bk keys][Gi heads] tiles, MN-major.
  static constexpr int kDsGi = kDsGi_;
  static_assert(kDsGi == 0 || kDsGi == 2 || kDsGi == 4, "K-major dS tiles at Gi = 2 or 4");
  static constexpr bool kKMajorDs = kDsGi != 0;
  // A warp's 16 rows hold at most 16 / Gi tokens (at Gi >= 8 at most 2, from 0 or 8 rows in).
  static constexpr int kWarpTokens = kDsGi == 2 ? 8 : 4;
  static constexpr GMMA::Major kMajorDs = kKMajorDs ? GMMA::Major::K : GMMA::Major::MN;
  static_assert(kBlockM == cuda::kQueryTileRows);
  static constexpr int kRows = 64;  // a consumer warpgroup's rows
  // K stages, and dS stages per consumer warpgroup. A warpgroup also waits for the K stages of
  // the blocks it skips, so K's depth bounds how far the two may drift apart: 3 and 3 measured
  // faster than 2 and 4 (24.5 against 26.1 ms at 128K, paper heads, mixed selections).
  static constexpr int kStages = 3;
  static constexpr int kDsStages = 3;
  using Pipeline = cutlass::PipelineTmaAsync<kStages>;
  using SmemLayoutKV = decltype(tile_to_shape(typename Base::SmemAtomKV{},
                                              Shape<Int<kBlockN>, Int<kHeadDim>, Int<kStages>>{}));
  using SmemLayoutKt = decltype(composition(
      SmemLayoutKV{}, make_ordered_layout(Shape<Int<kHeadDim>, Int<kBlockN>, Int<kStages>>{},
                                          Step<_2, _1, _3>{})));
  // dS of a warpgroup's rows over one block: (rows, keys), rows contiguous (kKMajorDs: keys);
  // kDsStages stages per warpgroup, warpgroup-major.
  using SmemAtomDs = decltype(cutlass::gemm::collective::detail::ss_smem_selector<
                              kMajorDs, Element, Int<kRows>, Int<kBlockN>>());
  using SmemLayoutDs =
      decltype(tile_to_shape(SmemAtomDs{}, Shape<Int<kRows>, Int<kBlockN>, Int<2 * kDsStages>>{}));
  // dQ += dS K: rows x D over the keys, dS MN-major (kKMajorDs: K-major), the keys' block as
  // the MN-major B operand.
  using MmaDQ = decltype(make_tiled_mma(
      GMMA::ss_op_selector<Element, Element, float, Shape<Int<kRows>, Int<kHeadDim>, Int<kBlockN>>,
                           kMajorDs, GMMA::Major::MN>()));

  struct SharedStorage {
    alignas(1024) cute::array_aligned<Element, cosize_v<SmemLayoutKV>> k;
    alignas(1024) cute::array_aligned<Element, cosize_v<SmemLayoutDs>> ds;
    typename Pipeline::SharedStorage pipe_k;
    typename Pipeline::SharedStorage pipe_v;  // the stream's; never used (no V)
    int32_t num_blocks;
  };
  static constexpr size_t kUnionOffset = Base::template union_offset<SharedStorage>();
};

template <class Traits>
struct BwdDqParams : BwdDqArgs {
  typename Traits::Tma tma_k, tma_v;
};

// One warp's share of its warpgroup's dS stage: rows [16 w, 16 w + 16) of the 64, i.e. 32 bytes
// of every key, in pieces of 16 bytes (8 when Gi = 4 with MN-major tiles; the kernel takes
// DsLoaderK there). A lane's pieces all belong to one token of the tile (`tok`) at a fixed head
// offset; its keys step by `key_step`, a multiple of the swizzle atom's 8 rows, so its shared
// offsets step by a constant.
template <class Traits>
struct DsLoaderMN {
  using Element = typename Traits::Element;
  static constexpr int kBlockN = Traits::kBlockN;
  int32_t gi, piece_elems;
  int32_t tok;      // the lane's token in the tile
  int32_t head0;    // its first head
  int32_t key0;     // its first key
  int32_t key_step;
  int32_t soff0, dsoff;  // shared offsets (elements) of its first piece and between pieces
  int32_t iters;

  template <class SmemTensor>
  __device__ DsLoaderMN(const SmemTensor& stage0, int32_t Gi, int wg, int warp, int lane) : gi(Gi) {
    const int piece_bytes = Gi >= 8 ? 16 : 8;
    piece_elems = piece_bytes / 2;
    const int ppk = 32 / piece_bytes;  // pieces per key in a warp's 32 bytes
    const int part = lane % ppk;
    const int m0 = 16 * warp + part * piece_elems;  // row within the warpgroup
    const int row = 64 * wg + m0;                   // row within the tile
    tok = row / Gi;
    head0 = row - tok * Gi;
    key0 = lane / ppk;
    key_step = 32 / ppk;
    iters = kBlockN / key_step;
    const auto* base = &stage0(0, 0);
    soff0 = static_cast<int32_t>(&stage0(m0, key0) - base);
    dsoff = static_cast<int32_t>(&stage0(m0, key0 + key_step) - base) - soff0;
  }

  // The lane's pieces of one block into the stage at dst: from src (the tile of its token, the
  // block's column; then its first key and head), or zeros where `sel` is false.
  __device__ void load(Element* dst, const Element* src, bool sel) const {
    const Element* s = src + key0 * gi + head0;
    const int64_t step = int64_t(key_step) * gi;
    if (piece_elems == 8) {
#pragma unroll 4
      for (int n = 0; n < iters; ++n) cp_async16(dst + soff0 + n * dsoff, s + n * step, sel);
    } else {
#pragma unroll 4
      for (int n = 0; n < iters; ++n) cp_async8(dst + soff0 + n * dsoff, s + n * step, sel);
    }
  }
};

// The same share at Gi = 2 or 4 with K-major tiles ([Bk / 64][Gi heads][64 keys]): the warp's
// 16 rows are 16 / Gi tokens x Gi heads, each row Bk / 8 pieces of 8 keys. 2 Gi lanes share a
// token: lane l takes token l / (2 Gi) of the warp and, for each of its Gi heads and each 64-key
// half, the pieces l % (2 Gi) + 2 Gi q (q < 4 / Gi) of the 8: 4 Bk / 64 pieces, whose shared
// offsets it keeps.
template <class Traits>
struct DsLoaderK {
  using Element = typename Traits::Element;
  static constexpr int kBlockN = Traits::kBlockN;
  static constexpr int kG = Traits::kDsGi;
  static constexpr int kLanes = 2 * kG;       // lanes per token
  static constexpr int kPer = 8 / kLanes;     // pieces per (half, head) and lane
  static constexpr int kHalves = kBlockN / 64;
  static constexpr int kPieces = kHalves * kG * kPer;  // = 4 Bk / 64
  int32_t tok;  // the lane's token in the tile
  int32_t src0;  // its first piece in the token's tile (elements)
  int32_t soff[kPieces];  // shared offsets (elements) of piece ((half, head) he, q)

  template <class SmemTensor>
  __device__ DsLoaderK(const SmemTensor& stage0, int32_t /*Gi*/, int wg, int warp, int lane) {
    const int tw = lane / kLanes, c0 = lane % kLanes;
    const int row0 = 16 * warp + kG * tw;  // within the warpgroup
    tok = (64 * wg + row0) / kG;
    src0 = c0 * 8;
    const auto* base = &stage0(0, 0);
#pragma unroll
    for (int he = 0; he < kHalves * kG; ++he)
#pragma unroll
      for (int q = 0; q < kPer; ++q)
        soff[he * kPer + q] = static_cast<int32_t>(
            &stage0(row0 + he % kG, 64 * (he / kG) + 8 * (c0 + kLanes * q)) - base);
  }

  // The lane's pieces of one block into the stage at dst: from src (the tile of its token, the
  // block's column), or zeros where `sel` is false.
  __device__ void load(Element* dst, const Element* src, bool sel) const {
#pragma unroll
    for (int he = 0; he < kHalves * kG; ++he)
#pragma unroll
      for (int q = 0; q < kPer; ++q)
        cp_async16(dst + soff[he * kPer + q], src + he * 64 + src0 + 8 * kLanes * q, sel);
  }
};

template <class Traits>
using DsLoader = std::conditional_t<Traits::kKMajorDs, DsLoaderK<Traits>, DsLoaderMN<Traits>>;

// Warp roles, pipelines and work: see the top of the file.
template <class Traits>
__global__ void __launch_bounds__(Traits::kThreads, 1)
    bwd_dq_kernel(const __grid_constant__ BwdDqParams<Traits> p) {
  grid_dependency_begin();
  using Element = typename Traits::Element;
  constexpr int kBlockN = Traits::kBlockN, kHeadDim = Traits::kHeadDim, kRows = Traits::kRows;
  constexpr int kDsStages = Traits::kDsStages;
  using Pipeline = typename Traits::Pipeline;

  extern __shared__ __align__(1024) char smem_raw[];
  const QueryTile tile = query_tile(p);
  // The tile's tokens [a, b) of the pass (packed indices); none: nothing to do.
  const int64_t tok0 = tile.seq_start + tile.first;
  const int64_t a = tok0 > p.tok_lo ? tok0 : p.tok_lo;
  const int64_t b = tok0 + tile.count < p.tok_hi ? tok0 + tile.count : p.tok_hi;
  if (tile.count == 0 || a >= b) return;
  QueryTileStream<Traits> kv(smem_raw, p);
  auto& ss = kv.ss;
  const int32_t ih = kv.ih;

  Tensor sK = make_tensor(make_smem_ptr(ss.k.data()), typename Traits::SmemLayoutKV{});
  Tensor sKt = make_tensor(make_smem_ptr(ss.k.data()), typename Traits::SmemLayoutKt{});
  Tensor sDs = make_tensor(make_smem_ptr(ss.ds.data()), typename Traits::SmemLayoutDs{});

  if (kv.producer_done(p, tile, sK, sK, false)) return;

  // ---------------------------------------------------------------- consumers
  const int tidx = threadIdx.x - 128;
  const int wg = tidx / 128, lt = tidx % 128, warp = lt / 32, lane = lt % 32;
  const int32_t Gi = p.heads_per_idx, k = p.top_k;
  // This warpgroup's pass tokens, as tile positions [lo_w, hi_w] (empty: lo_w > hi_w).
  const int32_t lo_w = max<int32_t>(64 * wg / Gi, static_cast<int32_t>(a - tok0));
  const int32_t hi_w = min<int32_t>((64 * wg + 63) / Gi, static_cast<int32_t>(b - tok0) - 1);

  const DsLoader<Traits> ld(sDs(_, _, 0), Gi, wg, warp, lane);
  // The lane's token: in the pass, its block_idx row (lanes 0 .. k-1 hold one entry each; the
  // warp's tokens are at most 4 apart, and a lane ballots for its own) and its dS tiles.
  const bool tok_ok = ld.tok >= lo_w && ld.tok <= hi_w;
  const int32_t qpos = tile.pos0 + ld.tok;  // the lane's token's position in its sequence
  constexpr int kWarpTokens = Traits::kWarpTokens;
  const int32_t wtok0 = (64 * wg + 16 * warp) / Gi;  // the warp's first token
  const int my_wt = ld.tok - wtok0;
  int32_t row[kWarpTokens];
#pragma unroll
  for (int w = 0; w < kWarpTokens; ++w) {
    const int32_t t = wtok0 + w;
    const bool ok = lane < k && t < tile.count && w * Gi < 16;
    row[w] = ok ? p.block_idx[(tok0 + t) * p.bi_s0 + ih * p.bi_s1 + lane] : -1;
  }
  const Element* ds_tok =
      as<Element>(p.ds) +
      (tok_ok ? ((tok0 + ld.tok - p.tok_lo) * p.Hi + ih) * int64_t(k) * kBlockN * Gi : 0);

  const int32_t n = kv.wait_list();
  const auto list = kv.list(p);
  auto needed = [&](int32_t u) { return lo_w <= hi_w && list.any_member(u, lo_w, hi_w); };
  // The lane's pieces of list entry u into dS stage st of this warpgroup.
  constexpr int kStageElems = kRows * kBlockN;
  Element* ds_stages = ss.ds.data() + wg * kDsStages * kStageElems;
  uint32_t zeroed = 0;  // bit st: the lane's rows of dS stage st hold zeros
  auto issue = [&](int32_t u, int st) {
    const int32_t blk = list.block(u);
    uint32_t mine = 0;
#pragma unroll
    for (int w = 0; w < kWarpTokens; ++w) {
      const uint32_t hit = __ballot_sync(0xffffffffu, row[w] == blk);
      if (w == my_wt) mine = hit;
    }
    const bool sel = tok_ok && mine != 0u && blk <= qpos / kBlockN;
    const int32_t slot = sel ? __ffs(mine) - 1 : 0;
    // A lane always fills the same rows of a stage (its token's), so rows it zeroed for an
    // earlier block are still zero: only a token that selected the block moves data.
    if (sel || !(zeroed >> st & 1u))
      ld.load(ds_stages + st * kStageElems, ds_tok + int64_t(slot) * kBlockN * Gi, sel);
    zeroed = sel ? zeroed & ~(1u << st) : zeroed | (1u << st);
  };
  int32_t u_ahead = 0;  // the next list entry the prefetch looks at
  auto prefetch = [&](int st) {
    while (u_ahead < n && !needed(u_ahead)) ++u_ahead;
    if (u_ahead < n) issue(u_ahead++, st);
    cp_async_commit();
  };
  for (int st = 0; st < kDsStages - 1; ++st) prefetch(st);

  typename Traits::MmaDQ mma_dq;
  auto thr_dq = mma_dq.get_thread_slice(lt);
  Tensor tdQrK = thr_dq.partition_fragment_B(sKt);
  Tensor tdQrdQ = partition_fragment_C(mma_dq, Shape<Int<kRows>, Int<kHeadDim>>{});
  clear(tdQrdQ);

  typename Pipeline::PipelineState sk;
  int32_t c = 0;  // blocks computed
  for (int32_t u = 0; u < n; ++u) {
    if (!needed(u)) {  // the other warpgroup may need it
      kv.pipe_k.consumer_wait(sk);
      kv.pipe_k.consumer_release(sk);
      ++sk;
      continue;
    }
    const int st = c % kDsStages;
    // Block c's dS has landed for every thread of the warpgroup, and every thread is done with
    // the stage the prefetch refills (block c - 1's).
    cp_async_wait<kDsStages - 2>();
    cutlass::arch::fence_view_async_shared();
    cutlass::arch::NamedBarrier::sync(128, static_cast<uint32_t>(Barrier::kWarpGroup) + wg);
    const int32_t key0 = list.block(u) * kBlockN;
    kv.pipe_k.consumer_wait(sk);
    // Keys past the sequence end: their dS is 0, but 0 * NaN is not (zero_tail_rows).
    zero_tail_rows<kBlockN, kHeadDim>(sK(_, _, sk.index()), key0, tile.key_len, lt, wg);
    Tensor tdQrDs = thr_dq.partition_fragment_A(sDs(_, _, wg * kDsStages + st));
    wg_gemm<false>(mma_dq, tdQrDs, tdQrK(_, _, _, sk.index()), tdQrdQ);
    // The refill of block c - 1's stage (every warp waited for its product before the barrier)
    // is issued while this block's product runs.
    prefetch((c + kDsStages - 1) % kDsStages);
    warpgroup_wait<0>();
    kv.pipe_k.consumer_release(sk);
    ++sk;
    ++c;
  }
  cp_async_wait_all();

  Tensor cQ = thr_dq.partition_C(make_identity_tensor(Shape<Int<kRows>, Int<kHeadDim>>{}));
  Tensor cQrc = make_tensor(cQ.data(), acc_rowcol(cQ.layout()));
  Tensor dQ = make_tensor(tdQrdQ.data(), acc_rowcol(tdQrdQ.layout()));
#pragma unroll
  for (int r = 0; r < size<0>(dQ); ++r) {
    const int32_t row_w = 64 * wg + get<0>(cQrc(r, 0));
    const int32_t t = row_w / Gi;
    if (t < lo_w || t > hi_w) continue;
    const int32_t head = ih * Gi + row_w - t * Gi;
    store_row(as<Element>(p.dq) + (tok0 + t) * p.dq_s0 + head * p.dq_s1, dQ, cQrc, r, p.scale);
  }
}

}  // namespace msa::cuda::kern
