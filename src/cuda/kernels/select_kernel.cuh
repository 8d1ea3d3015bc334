// Index selection on Hopper (docs/contract.md §2): the causal index-score GEMM q_idx k_idx^T streamed over
// key blocks, the per-block max taken in registers, and a running top-k per row, so no score
// ever reaches device memory.
//
// A tile packs m tokens x the Gk = Hi / Hik index heads that share one index key head into
// kBlockM = 256 MMA rows (row = token * Gk + head): every k_idx block loaded serves 256 rows,
// which halves the key traffic against 128-row tiles. Warp 0 streams k_idx blocks with TMA; two
// consumer warpgroups (128 rows each, two m64 wgmma tiles) compute S, reduce each row's block
// max over the quad that holds the row, and one lane per row keeps that row's best candidates in
// shared memory. Blocks arrive in ascending order, so a candidate that only ties the current
// k-th best never displaces it: ties go to the lower block index.
//
// Element = float_e4m3_t (Options.select_scores = kFp8): q_idx and k_idx are the E4M3 copies of
// fp8_copy_kernel.cuh, the MMA is wgmma's E4M3 x E4M3 (k32 steps, fp16 accumulators, two of
// them, see the block loop), and each block's maxima are scaled by the block's k_factor; the
// candidate lists are the same. With fp8_rerank = m > 0 a row's list holds m candidates more than
// its free slots, and the kernel leaves that shortlist to rerank_kernel.cuh instead of choosing.
// A prefill over paged k_idx reads block b of sequence s from page page_table[s, b], or with
// FP8 scores from the copies' slot of that block (SelectArgs::key_row0: KV tile s * max_pages + b);
// over an E4M3 cache from such a slot of its codes as 16-bit values (exact), each block's maxima
// then times its page's scale.
#pragma once

#include <cuda_fp16.h>

#include <cute/tensor.hpp>
#include <cutlass/gemm/collective/builders/sm90_common.inl>
#include <cutlass/pipeline/sm90_pipeline.hpp>

#include "../device/grid_dependency.cuh"
#include "../device/load.cuh"
#include "../device/tile.cuh"
#include "../device/utils.cuh"
#include "../host/args.h"

namespace msa::cuda::kern {

using cuda::SelectArgs;

template <class Element_, int kDim_, int kBlockN_>
struct SelectTraits {
  using Element = Element_;
  static constexpr int kDim = kDim_;
  static constexpr int kBlockN = kBlockN_;
  static constexpr int kBlockM = cuda::kSelectTileRows;  // each consumer warpgroup owns 128 rows
  static constexpr bool kFp8 = sizeof(Element) == 1;
  static constexpr int kStages = kFp8 ? 4 : 3;  // a stage of E4M3 keys is half the bytes
  static constexpr int kConsumerThreads = 256;
  static constexpr int kThreads = kConsumerThreads + 128;

  using TileQK = Shape<Int<kBlockM>, Int<kBlockN>, Int<kDim>>;
  // FP8 scores accumulate in fp16: column pairs of a row share a register, so the block max
  // takes one packed max per pair (half the instructions) and the accumulators half the
  // registers. The copies' scale (fp8_copy_kernel.cuh: 16 / amax) keeps every sum of
  // Di <= 128 products inside fp16's range.
  using Acc = std::conditional_t<kFp8, cutlass::half_t, float>;
  // FP8: the queries are the MMA's register operand (RS), copied from shared memory once per
  // tile, so that each wgmma reads only the key block from shared memory (4 of its 6 KB); the
  // candidate lists share that bandwidth. bf16 keeps them in shared memory (SS): its fp32
  // accumulator leaves no room for 64 more registers a thread.
  static constexpr bool kQInRegisters = kFp8;
  using MmaAtomQK = std::conditional_t<kQInRegisters, decltype(GMMA::rs_op_selector<Element, Element, Acc, TileQK>()),
                                       decltype(GMMA::ss_op_selector<Element, Element, Acc, TileQK>())>;
  using MmaQK = decltype(make_tiled_mma(MmaAtomQK{}, Layout<Shape<_2, _1, _1>>{}));
  using SmemAtomQ = decltype(cutlass::gemm::collective::detail::ss_smem_selector<
                             GMMA::Major::K, Element, Int<kBlockM>, Int<kDim>>());
  using SmemLayoutQ = decltype(tile_to_shape(SmemAtomQ{}, Shape<Int<kBlockM>, Int<kDim>>{}));
  using SmemAtomK = decltype(cutlass::gemm::collective::detail::ss_smem_selector<
                             GMMA::Major::K, Element, Int<kBlockN>, Int<kDim>>());
  using SmemLayoutK = decltype(tile_to_shape(SmemAtomK{},
                                             Shape<Int<kBlockN>, Int<kDim>, Int<kStages>>{}));
  using GLayout = Layout<Shape<int32_t, int32_t, int32_t>, Stride<int64_t, _1, int64_t>>;
  using Tma = decltype(make_tma_copy(
      SM90_TMA_LOAD{}, make_tensor(make_gmem_ptr(static_cast<Element const*>(nullptr)), GLayout{}),
      take<0, 2>(SmemLayoutK{}), Shape<Int<kBlockN>, Int<kDim>>{}, _1{}));
  using Pipeline = cutlass::PipelineTmaAsync<kStages>;
  static constexpr uint32_t kTmaBytes = kBlockN * kDim * sizeof(Element);

  struct SharedStorage {
    alignas(1024) cute::array_aligned<Element, cosize_v<SmemLayoutQ>> q;
    alignas(1024) cute::array_aligned<Element, cosize_v<SmemLayoutK>> k;
    typename Pipeline::SharedStorage pipe;
  };
  // Followed by the per-row candidate lists: float score[kBlockM][k], int32 block[kBlockM][k].
  static constexpr size_t kListOffset = (sizeof(SharedStorage) + 15) / 16 * 16;
};

template <class Traits>
struct SelectKernelParams : SelectArgs {
  typename Traits::Tma tma_k;
};

// Warp roles: warp 0 of the first warpgroup streams k_idx blocks by TMA (the other three warps
// leave); warpgroups 1 and 2 own 128 rows each. Pipeline: pipe (kStages), producer -> consumers.
// Work: one tile (blockIdx.x, late tiles first) of one index key head (blockIdx.y).
template <class Traits>
__global__ void __launch_bounds__(Traits::kThreads, 1)
    select_kernel(const __grid_constant__ SelectKernelParams<Traits> p) {
  grid_dependency_begin();
  using Element = typename Traits::Element;
  constexpr int kBlockM = Traits::kBlockM, kBlockN = Traits::kBlockN, kDim = Traits::kDim;
  using SharedStorage = typename Traits::SharedStorage;
  using Pipeline = typename Traits::Pipeline;

  extern __shared__ __align__(1024) char smem_raw[];
  SharedStorage& ss = *reinterpret_cast<SharedStorage*>(smem_raw);
  // Row stride (k + m) | 1 (odd): the owner lanes of a warp hit distinct banks.
  const int32_t list_stride = (p.k + p.rerank.m) | 1;
  float* list_score = reinterpret_cast<float*>(smem_raw + Traits::kListOffset);
  int32_t* list_block = reinterpret_cast<int32_t*>(list_score + kBlockM * list_stride);

  const int64_t tile_id = p.num_tiles - 1 - blockIdx.x;
  const int32_t ik = blockIdx.y;
  QueryTile tile = decode_tile(p.cu_seqlens, p.nseq, p.T, p.tile_tokens, tile_id);
  if (tile.count == 0) return;
  p.paged.place(tile);  // a prefill over paged index keys, or keys apart: the tokens' key positions
  // The blocks up to the last token's, inside the sequence's keys: key lengths shorter than the
  // tokens (unchecked values) skip the blocks past the keys (block 0 stays: the pipeline takes
  // at least one), whose factors and KV tiles do not exist.
  const int32_t key_blocks = (tile.key_len + kBlockN - 1) / kBlockN;
  const int32_t last_block = max(0, min((tile.pos0 + tile.count - 1) / kBlockN, key_blocks - 1));

  const int warp = cutlass::canonical_warp_idx_sync();
  const bool producer = warp < 4;
  typename Pipeline::Params pp;
  pp.transaction_bytes = Traits::kTmaBytes;
  pp.role = producer ? Pipeline::ThreadCategory::Producer : Pipeline::ThreadCategory::Consumer;
  pp.is_leader = threadIdx.x == 0;
  pp.num_consumers = Traits::kConsumerThreads;
  Pipeline pipe(ss.pipe, pp, Shape<_1, _1, _1>{});
  __syncthreads();

  Tensor sQ = make_tensor(make_smem_ptr(ss.q.data()), typename Traits::SmemLayoutQ{});
  Tensor sK = make_tensor(make_smem_ptr(ss.k.data()), typename Traits::SmemLayoutK{});

  if (producer) {
    cutlass::arch::warpgroup_reg_dealloc<40>();
    if (threadIdx.x != 0) return;
    Tensor mK = p.tma_k.get_tma_tensor(make_shape(p.key_rows(), kDim, p.Hik));
    // Block b: tile b of the sequence's rows (or of its pages' copies), or page pages[b] (ids
    // out of range read zeros).
    const int32_t* pages = p.pages(tile);
    const int32_t seq0 = static_cast<int32_t>(p.key_row0(tile));
    Tensor gK = local_tile(domain_offset(make_coord(seq0, _0{}), mK(_, _, ik)),
                           Shape<Int<kBlockN>, Int<kDim>>{}, make_coord(_, _0{}));
    auto [tKg, tKs] = tma_partition(p.tma_k, _0{}, Layout<_1>{}, group_modes<0, 2>(sK),
                                    group_modes<0, 2>(gK));
    auto state = cutlass::make_producer_start_state<Pipeline>();
    for (int32_t b = 0; b <= last_block; ++b) {
      pipe.producer_acquire(state);
      copy(p.tma_k.with(*pipe.producer_get_barrier(state), 0), tKg(_, pages != nullptr ? pages[b] : b),
           tKs(_, state.index()));
      ++state;
    }
    return;
  }

  cutlass::arch::warpgroup_reg_alloc<232>();
  const int tidx = threadIdx.x - 128;
  const int32_t Gk = p.idx_per_key;
  const int32_t rows_used = p.tile_tokens * Gk;
  load_head_rows<kBlockM, kDim, Traits::kConsumerThreads>(
      sQ, as<Element>(p.q_idx) + (tile.seq_start + tile.first) * p.q_s0, p.q_s0, p.q_s1, ik * Gk, Gk,
      tile.count, tidx, p.negate);
  cutlass::arch::fence_view_async_shared();
  cutlass::arch::NamedBarrier::sync(Traits::kConsumerThreads, static_cast<uint32_t>(Barrier::kQReady));

  typename Traits::MmaQK mma;
  auto thr = mma.get_thread_slice(tidx);
  Tensor tSrQ = thr.partition_fragment_A(sQ);  // descriptors (SS) or the queries' registers (RS)
  if constexpr (Traits::kQInRegisters) copy(thr.partition_A(sQ), tSrQ);
  Tensor tSrK = thr.partition_fragment_B(sK);
  Tensor tSrS = partition_fragment_C(mma, Shape<Int<kBlockM>, Int<kBlockN>>{});
  Tensor S = make_tensor(tSrS.data(), acc_rowcol(tSrS.layout()));
  Tensor cS = thr.partition_C(make_identity_tensor(Shape<Int<kBlockM>, Int<kBlockN>>{}));
  Tensor cSrc = make_tensor(cS.data(), acc_rowcol(cS.layout()));
  constexpr int kRows = decltype(size<0>(cSrc))::value;
  static_assert(kRows == 4, "a quad holds four rows: two per 64-row wgmma tile, two tiles");

  // Lane j of a quad keeps the candidate list of the quad's j-th row.
  const int quad_lane = tidx & 3;
  int32_t row_tok[kRows];
  int32_t my_row = 0;
#pragma unroll
  for (int r = 0; r < kRows; ++r) {
    const int row = get<0>(cSrc(r, 0));
    row_tok[r] = row / Gk;
    if (r == quad_lane) my_row = row;
  }
  const int32_t my_tok = my_row / Gk;
  const bool active = my_row < rows_used && my_tok < tile.count;
  const int32_t my_pos = tile.pos0 + my_tok;  // key position (tile.first + my_tok when packed)
  const int32_t own = my_pos / kBlockN;
  const int32_t first_local = max(0, own - p.local_blocks + 1);
  const int32_t first_cand = p.sink_blocks, end_cand = min(first_local, key_blocks);  // [sink, first_local)
  // The row's list holds `slots` candidates: its free slots, and m more to re-rank.
  int32_t free_slots = 0, slots = 0;
  float* my_score = list_score + my_row * list_stride;
  int32_t* my_block = list_block + my_row * list_stride;
  if (active) {
    free_slots = p.k - (min(p.sink_blocks, first_local) + (own - first_local + 1));
    slots = free_slots > 0 ? free_slots + p.rerank.m : 0;
    for (int j = 0; j < slots; ++j) my_block[j] = -1;
  }
  // The list is unsorted. Once full, a candidate must beat the worst entry, at worst_pos: the
  // lowest score, and among equal lowest scores the highest block id (lower ids win ties).
  int32_t filled = 0, worst_pos = 0;
  float worst = -INFINITY;
  auto find_worst = [&]() {
    worst = my_score[0];
    worst_pos = 0;
    int32_t worst_block = my_block[0];
    for (int j = 1; j < slots; ++j) {
      const float sc = my_score[j];
      const int32_t bl = my_block[j];
      if (sc < worst || (sc == worst && bl > worst_block)) {
        worst = sc;
        worst_pos = j;
        worst_block = bl;
      }
    }
  };

  // Block b's maxima from its scores S (row/column view) into the row's list; FP8: scaled by
  // the block's 1 / scale, `factor`.
  auto take_block = [&](auto& S, int32_t b, float factor) {
    // Each row's max over the block's causal keys: four independent chains, then the quad.
    const int32_t key0 = b * kBlockN;
    const bool causal = key0 + kBlockN - 1 > tile.pos0;
    float block_max[kRows];
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      if constexpr (Traits::kFp8) {
        if (!causal) {  // packed pairs (columns 2j, 2j + 1 of the row), four chains
          __half2 m2[4];
#pragma unroll
          for (int j = 0; j < 4; ++j) m2[j] = __half2half2(__ushort_as_half(0xfc00));  // -inf
#pragma unroll
          for (int c = 0; c < size<1>(S); c += 2)
            m2[(c / 2) & 3] = __hmax2(m2[(c / 2) & 3], reinterpret_cast<const __half2&>(S(r, c)));
          const __half2 a = __hmax2(__hmax2(m2[0], m2[1]), __hmax2(m2[2], m2[3]));
          block_max[r] = quad_max(fmaxf(__low2float(a), __high2float(a)));
          continue;
        }
      }
      float m[4] = {-INFINITY, -INFINITY, -INFINITY, -INFINITY};
      if (causal) {
        const int32_t last_key = tile.pos0 + row_tok[r] - key0;
#pragma unroll
        for (int c = 0; c < size<1>(S); ++c)
          m[c & 3] = fmaxf(m[c & 3], get<1>(cSrc(r, c)) <= last_key ? static_cast<float>(S(r, c)) : -INFINITY);
      } else {
#pragma unroll
        for (int c = 0; c < size<1>(S); ++c) m[c & 3] = fmaxf(m[c & 3], static_cast<float>(S(r, c)));
      }
      block_max[r] = quad_max(fmaxf(fmaxf(m[0], m[1]), fmaxf(m[2], m[3])));
    }
    if (!active || b < first_cand || b >= end_cand || slots == 0) return;
    // This lane's row (quad_lane) by selects: an indexed read would put block_max in memory.
    const float lo = (quad_lane & 1) ? block_max[1] : block_max[0];
    const float hi = (quad_lane & 1) ? block_max[3] : block_max[2];
    const float mine = (quad_lane & 2) ? hi : lo;
    const float score = mine * p.scale * factor;
    if (filled < slots) {
      my_score[filled] = score;
      my_block[filled] = b;
      if (++filled == slots) find_worst();
    } else if (score > worst) {  // a later block that only ties the worst never enters
      my_score[worst_pos] = score;
      my_block[worst_pos] = b;
      find_worst();
    }
  };

  typename Pipeline::PipelineState state;
  if constexpr (!Traits::kFp8) {
    // An E4M3 cache's codes (a prefill): each block's maxima times its page's scale.
    const float* k_factor = p.e4m3_keys ? p.e4m3.k_factor + p.key_row0(tile) * p.Hik + ik : nullptr;
    for (int32_t b = 0; b <= last_block; ++b) {
      const float factor = k_factor != nullptr && b < key_blocks ? k_factor[int64_t(b) * kBlockN * p.Hik] : 1.f;
      __syncwarp();  // the list update diverges; wgmma needs the warp converged
      pipe.consumer_wait(state);
      wg_gemm<true, Traits::kQInRegisters>(mma, tSrQ, tSrK(_, _, _, state.index()), tSrS);
      warpgroup_wait<0>();
      pipe.consumer_release(state);
      ++state;
      take_block(S, b, factor);
    }
  } else {
    // Two accumulators (fp16: 64 registers each): block b + 1's GEMM is issued before block b's
    // maxima are taken, so they run under it. Each block's 1 / scale is loaded a block ahead.
    Tensor tSrS2 = partition_fragment_C(mma, Shape<Int<kBlockM>, Int<kBlockN>>{});
    Tensor S2 = make_tensor(tSrS2.data(), acc_rowcol(tSrS2.layout()));
    clear(tSrS2);  // defined before any GEMM is in flight
    const float* k_factor = p.copy.k_factor + p.key_row0(tile) * p.Hik + ik;
    float factor = key_blocks > 0 ? k_factor[0] : 1.f;
    typename Pipeline::PipelineState done = state;  // the stage of the block taken next
    pipe.consumer_wait(state);
    wg_gemm<true, Traits::kQInRegisters>(mma, tSrQ, tSrK(_, _, _, state.index()), tSrS);
    ++state;
    // Block b + 1's GEMM into acc_next, then block b's maxima from S_cur (the other one).
    auto step = [&](auto& acc_next, auto& S_cur, int32_t b) {
      const float factor_next = k_factor[int64_t(b + 1) * kBlockN * p.Hik];
      __syncwarp();
      pipe.consumer_wait(state);
      wg_gemm<true, Traits::kQInRegisters>(mma, tSrQ, tSrK(_, _, _, state.index()), acc_next);
      ++state;
      warpgroup_wait<1>();
      pipe.consumer_release(done);
      ++done;
      take_block(S_cur, b, factor);
      factor = factor_next;
    };
    auto last = [&](auto& S_cur, int32_t b) {
      warpgroup_wait<0>();
      pipe.consumer_release(done);
      ++done;
      take_block(S_cur, b, factor);
    };
    // Every pass of the loop leaves the GEMM of block b (into tSrS) in flight, so the loop
    // carries one state of the accumulators; the last one or two blocks follow it.
    int32_t b = 0;
    for (; b + 2 <= last_block; b += 2) {
      step(tSrS2, S, b);
      step(tSrS, S2, b + 1);
    }
    if (b + 1 == last_block) {
      step(tSrS2, S, b);
      last(S2, b + 1);
    } else {
      last(S, b);
    }
  }

  if (!active) return;
  // fp8_rerank_slots = a in (0, free slots), more candidates than free slots: the best (free
  // slots - a) by FP8 score (ties to the lower block) are kept, marked in their block id.
  if (p.rerank.m > 0 && p.rerank.slots > 0 && p.rerank.slots < free_slots) {
    int32_t listed = 0;
    for (int i = 0; i < slots; ++i) listed += my_block[i] >= 0;
    if (listed > free_slots) {
      const int32_t keep = free_slots - p.rerank.slots;
      for (int i = 0; i < slots; ++i) {
        const int32_t bi = my_block[i];
        if (bi < 0) continue;
        const float si = my_score[i];
        int32_t above = 0;
        for (int j = 0; j < slots; ++j) {
          const int32_t bj = my_block[j] & ~kRerankKept;
          above += my_block[j] >= 0 && (my_score[j] > si || (my_score[j] == si && bj < bi));
        }
        if (above < keep) my_block[i] = bi | kRerankKept;
      }
    }
  }
  // Ascending output: sink blocks, the chosen candidates (all in [sink, first_local)), local.
  // (A kept mark is above every block id: the order is the ids'.)
  for (int i = 1; i < slots; ++i) {  // insertion sort by block id, -1 last
    const int32_t v = my_block[i];
    int j = i;
    while (j > 0 && v >= 0 && (my_block[j - 1] < 0 || (my_block[j - 1] & ~kRerankKept) > (v & ~kRerankKept))) {
      my_block[j] = my_block[j - 1];
      --j;
    }
    my_block[j] = v;
  }
  const int32_t head = ik * Gk + (my_row - my_tok * Gk);
  const int64_t token = tile.seq_start + tile.first + my_tok;
  int32_t* out = p.block_idx + token * p.bi_s0 + (int64_t)head * p.bi_s1;
  int32_t n = 0;
  for (int32_t b = 0; b < min(p.sink_blocks, first_local); ++b) out[n++] = b;
  if (p.rerank.m == 0) {
    for (int i = 0; i < slots; ++i)
      if (my_block[i] >= 0) out[n++] = my_block[i];
  } else {
    // The shortlist, for rerank_kernel.cuh: its blocks (ascending) and the row's place for the
    // chosen ones (-1 until the pick fills them).
    const RerankArgs& r = p.rerank;
    const int64_t row = token * (int64_t(p.Hik) * Gk) + head;
    const int32_t base = static_cast<int32_t>(p.paged.first_kv_tile(tile.seq, tile.seq_start, kBlockN));
    int32_t* cand = r.cand + row * r.width;
    int32_t c = 0;
    for (int i = 0; i < slots; ++i)
      if (my_block[i] >= 0) cand[c++] = my_block[i];
    const int32_t chosen = min(free_slots, c);
    for (; c < r.width; ++c) cand[c] = -1;
    r.rows[row] = make_int2(base, n | (chosen << 16));
    for (int i = 0; i < chosen; ++i) out[n++] = -1;
  }
  for (int32_t b = first_local; b <= own; ++b) out[n++] = b;
  while (n < p.k) out[n++] = -1;
}

}  // namespace msa::cuda::kern
