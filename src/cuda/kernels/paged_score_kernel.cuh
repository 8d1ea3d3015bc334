// The decode/prefill indexer over a paged cache (docs/contract.md §2 at the new tokens'
// positions), in two kernels:
//
//   paged_score_kernel  block scores M_i(t, b) = max over the causal keys j of block b of
//                       scale_idx * q_idx[t, i] . k_idx[j]: one CTA per (tile of index rows,
//                       index key head, chunk of logical blocks), so that a batch of one at 1M
//                       tokens still spreads its index keys over every SM.
//   paged_topk_kernel   (kernels/paged_topk.cuh) the contract's selection from those scores.
//
// Score kernel. Rows: a tile packs m = kRows / Gk new tokens x the Gk = Hi / Hik index heads of
// one index key head into kRows MMA columns (row = token * Gk + head): 32, or 16 for a decode
// call whose tokens per sequence times Gk fit (half the MMA and reduction work per key). Warp roles: none;
// four warps each take 1/4 of a block's keys (S^T = K q^T: keys are the MMA's M, so a block of
// 128 keys fills the tensor cores whatever the row count). Pipeline: kStages cp.async stages
// of k_idx blocks; blocks b + 1 .. b + kStages - 1 are in flight while block b is scored.
// Work loop: the chunk's blocks up to the tile's last causal block; each block's per-row max
// goes to scores[(t - tok_lo) * Hi + i][b].
// E4M3 index keys (kE4M3): the stages hold the codes (half the bytes). Each warp converts its
// own keys in registers, straight into the A fragments: ldmatrix of 16-byte code rows gives a
// thread codes 4c .. 4c + 3 of a 16-dim group, which become the MMA's dims {2c, 2c + 1} and
// {2c + 8, 2c + 9}; the Q rows are permuted once in shared memory to the same dim order
// (permute_e4m3_dims), and a dot product does not depend on the order of its dims. A block's
// maxima are multiplied by its page's scale (positive, so the max commutes with it). With
// bfloat16 queries a CTA whose Q rows float16 holds exactly (the usual case; half_exact_tile)
// converts them once to float16 and runs float16 MMAs: E4M3 -> float16 is one instruction per
// pair of codes, -> bfloat16 four (282 -> 260 us at 1M tokens, batch 8). The products are the
// same numbers either way, and the fp32 accumulation too.
#pragma once

#include "../device/e4m3.cuh"
#include "../device/grid_dependency.cuh"
#include "../device/paged.cuh"
#include "../device/utils.cuh"

namespace msa::cuda::kern {

template <class Element_, int kDim_, int kBlockN_, int kRows_ = cuda::kPagedScoreRows, bool kE4M3_ = false>
struct PagedScoreTraits {
  using Element = Element_;
  static constexpr int kDim = kDim_;
  static constexpr int kBlockN = kBlockN_;
  static constexpr int kRows = kRows_;
  static constexpr bool kE4M3 = kE4M3_;
  static constexpr int kWarps = 4;
  static constexpr int kThreads = 32 * kWarps;
  static constexpr int kStages = cuda::kPagedScoreStages;
  // The MMAs of 16-bit queries of type QElement (the queries' own, or float16: see the kernel).
  template <class QElement>
  using TiledMmaOf = TiledMMA<Sm80MmaAtom<QElement>, Layout<Shape<Int<kWarps>, _1, _1>>,
                              Tile<Int<16 * kWarps>, _16, _16>>;
  using SmemLayoutQ = Sm80SmemLayout<Element, kRows, kDim>;
  using SmemLayoutK = Sm80SmemLayout<Element, kBlockN, kDim>;
  // A stage holds one block's k_idx rows as they are in the cache: 16-bit values, or E4M3
  // codes (KeyElement) viewed as 16-bit words (StageWord).
  using KeyElement = std::conditional_t<kE4M3, uint8_t, Element>;
  using StageWord = std::conditional_t<kE4M3, uint16_t, Element>;
  using SmemLayoutStage = std::conditional_t<kE4M3, E4M3SmemLayout<kBlockN, kDim>, SmemLayoutK>;
  static constexpr int kStageWords = cosize_v<SmemLayoutStage>;
  struct SharedStorage {
    alignas(128) cute::array_aligned<Element, cosize_v<SmemLayoutQ>> q;
    alignas(128) cute::array_aligned<StageWord, kStages * kStageWords> stages;
    float warp_max[kWarps][kRows];
  };
};

template <class T>
struct QueryType {  // the element type the scoring loop's MMAs take the queries in
  using type = T;
};

template <class Traits>
__global__ void __launch_bounds__(Traits::kThreads)
    paged_score_kernel(const __grid_constant__ PagedScoreArgs a) {
  grid_dependency_begin();
  using Element = typename Traits::Element;
  constexpr int kDim = Traits::kDim, kBlockN = Traits::kBlockN, kRows = Traits::kRows;
  constexpr int kThreads = Traits::kThreads;
  extern __shared__ __align__(128) char smem_raw[];
  auto& ss = *reinterpret_cast<typename Traits::SharedStorage*>(smem_raw);

  const PagedTile pt = paged_tile(a, blockIdx.x);
  if (pt.tile.count == 0) return;
  const int32_t ik = blockIdx.y, Gk = a.idx_per_key;
  const int64_t t0 = pt.tile.seq_start + pt.tile.first;  // packed index of the tile's token 0
  const int32_t j_lo = static_cast<int32_t>(max<int64_t>(0, a.tok_lo - t0));
  const int32_t j_hi = static_cast<int32_t>(min<int64_t>(pt.tile.count, a.tok_hi - t0));
  if (j_lo >= j_hi) return;
  const int32_t last_block = min(pt.pos(j_hi - 1) / kBlockN, a.max_pages - 1);
  const int32_t b0 = blockIdx.z * a.chunk_blocks;
  if (b0 > last_block) return;
  const int32_t b1 = min(last_block + 1, b0 + a.chunk_blocks);
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;

  const Element* q_base = as<Element>(a.q_idx) + t0 * a.q_s0 + int64_t(ik) * Gk * a.q_s1;
  Tensor sQ = make_tensor(make_smem_ptr(ss.q.data()), typename Traits::SmemLayoutQ{});
  using KeyElement = typename Traits::KeyElement;
  using StageWord = typename Traits::StageWord;
  auto stage_tile = [&](int stage) {
    return make_tensor(make_smem_ptr(ss.stages.data() + stage * Traits::kStageWords),
                       typename Traits::SmemLayoutStage{});
  };
  // Block b's k_idx rows into a stage, StageWord by StageWord (rows of the cache are 16-byte
  // aligned, so an E4M3 row is whole 16-bit words).
  const int64_t row_words = a.k_s1 * int64_t(sizeof(KeyElement)) / int64_t(sizeof(StageWord));
  const BlockRowLoader<kBlockN, decltype(size<1>(stage_tile(0)))::value, kThreads> key_loader(stage_tile(0), tid);
  const KeyElement* k_head = as<KeyElement>(a.k_idx) + int64_t(ik) * a.k_s2;
  auto load_k = [&](int32_t b, int stage) {
    const int32_t valid = min(kBlockN, pt.len - b * kBlockN);  // rows past the sequence: zeros
    const KeyElement* src = k_head + int64_t(page_of(a, pt.pages, b)) * a.k_s0;
    key_loader.load(&stage_tile(stage)(0, 0), reinterpret_cast<const StageWord*>(src), row_words, valid);
  };
  // Q rows (token r / Gk, head r % Gk) of the pass; the others are zeros.
  load_rows_async<kRows, kDim>(
      sQ,
      [&](int r) -> const Element* {
        const int32_t j = r / Gk;
        return j >= j_lo && j < j_hi ? q_base + j * a.q_s0 + (r % Gk) * a.q_s1 : nullptr;
      },
      tid, kThreads);
  constexpr int kStages = Traits::kStages;
  for (int st = 0; st < kStages - 1; ++st) {  // group st: block b0 + st (with Q in group 0)
    if (b0 + st < b1) load_k(b0 + st, st);
    cp_async_commit();
  }

  // The scoring loop with the MMAs of QElement: the queries' type, or (E4M3 keys, bf16 queries
  // that float16 holds exactly) float16, whose E4M3 conversion is one instruction per pair of
  // codes where bfloat16's takes four. Products and fp32 sums are the same either way.
  auto score_blocks = [&](auto type_tag) {
    using QElement = typename decltype(type_tag)::type;
    Tensor sQe = make_tensor(make_smem_ptr(reinterpret_cast<QElement*>(ss.q.data())), typename Traits::SmemLayoutQ{});
    typename Traits::template TiledMmaOf<QElement> mma;
    auto thr = mma.get_thread_slice(tid);
    // (E4M3: the layout only; the fragments are filled from the codes by load_e4m3_a.)
    Tensor sK0 = make_tensor(make_smem_ptr(reinterpret_cast<QElement*>(ss.stages.data())), typename Traits::SmemLayoutK{});
    Tensor tSrK = thr.partition_fragment_A(sK0);  // (MMA, MMA_M, MMA_K): keys x dim
    Tensor tSrQ = thr.partition_fragment_B(sQe);   // (MMA, MMA_N, MMA_K): rows x dim
    auto s2r_k = make_tiled_copy_A(Copy_Atom<SM75_U32x4_LDSM_N, QElement>{}, mma);
    auto s2r_q = make_tiled_copy_B(Copy_Atom<SM75_U32x4_LDSM_N, QElement>{}, mma);
    auto thr_k = s2r_k.get_thread_slice(tid);
    auto thr_q = s2r_q.get_thread_slice(tid);
    Tensor tKrK = thr_k.retile_D(tSrK);
    Tensor tQrQ = thr_q.retile_D(tSrQ);
    Tensor acc = partition_fragment_C(mma, Shape<Int<kBlockN>, Int<kRows>>{});
    Tensor S = make_tensor(acc.data(), sm80_rowcol(acc.layout()));  // (key, row)
    Tensor cS = thr.partition_C(make_identity_tensor(Shape<Int<kBlockN>, Int<kRows>>{}));
    Tensor cSrc = make_tensor(cS.data(), sm80_rowcol(cS.layout()));
    constexpr int kCols = decltype(size<1>(S))::value;
    // E4M3: the first key row of each of this warp's 16-row MMA tiles.
    constexpr int kTilesM = decltype(size<1>(tSrK))::value;
    int32_t key_base[kTilesM];
#pragma unroll
    for (int m = 0; m < kTilesM; ++m) key_base[m] = get<0>(cS(0, m, 0)) - (tid % 32) / 4;

    // Each column's last causal key position (-1: inactive row).
    int32_t col_last[kCols];
#pragma unroll
    for (int c = 0; c < kCols; ++c) {
      const int32_t row = get<1>(cSrc(0, c)), j = row / Gk;
      col_last[c] = (j >= j_lo && j < j_hi) ? pt.pos(j) : -1;
    }

    for (int32_t b = b0; b < b1; ++b) {
      const int stage = (b - b0) % kStages;
      // Block b + kStages - 1 goes into the stage block b - 1 used (free since the last barrier);
      // a group is committed every iteration, empty or not, so block b's is the oldest pending.
      if (b + kStages - 1 < b1) load_k(b + kStages - 1, (b - b0 + kStages - 1) % kStages);
      cp_async_commit();
      cp_async_wait<kStages - 1>();
      __syncthreads();
      if (b == b0) {
        if constexpr (Traits::kE4M3) {
          permute_e4m3_dims<kRows, kDim>(sQe, tid, kThreads);
          __syncthreads();
        }
        copy(s2r_q, thr_q.partition_S(sQe), tQrQ);
      }
      clear(acc);
      if constexpr (Traits::kE4M3) {
        load_e4m3_a<QElement>(stage_tile(stage), key_base, tSrK, [&](int kk) {
          cute::gemm(mma, tSrK(_, _, kk), tSrQ(_, _, kk), acc);
        });
      } else {
        Tensor tKsK = thr_k.partition_S(stage_tile(stage));
#pragma unroll
        for (int kk = 0; kk < size<2>(tSrK); ++kk) {
          copy(s2r_k, tKsK(_, _, kk), tKrK(_, _, kk));
          cute::gemm(mma, tSrK(_, _, kk), tSrQ(_, _, kk), acc);
        }
      }
      // Column max over this thread's causal keys, then over the lanes and warps holding the
      // column's other keys. fmaxf drops NaN scores (the contract counts them as -inf).
      const int32_t key0 = b * kBlockN;
      // Blocks below the first active row's position are whole for every active row: no mask
      // (inactive rows' maxima are not written).
      const bool whole = key0 + kBlockN - 1 <= pt.pos(j_lo);
      float m[kCols];
#pragma unroll
      for (int c = 0; c < kCols; ++c) {
        m[c] = -INFINITY;
        if (whole) {
#pragma unroll
          for (int r = 0; r < size<0>(S); ++r) m[c] = fmaxf(m[c], S(r, c) * a.scale);
        } else {
#pragma unroll
          for (int r = 0; r < size<0>(S); ++r) {
            const bool causal = key0 + get<0>(cSrc(r, c)) <= col_last[c];
            m[c] = fmaxf(m[c], causal ? S(r, c) * a.scale : -INFINITY);
          }
        }
        m[c] = fmaxf(m[c], __shfl_xor_sync(0xffffffff, m[c], 4));
        m[c] = fmaxf(m[c], __shfl_xor_sync(0xffffffff, m[c], 8));
        m[c] = fmaxf(m[c], __shfl_xor_sync(0xffffffff, m[c], 16));
      }
      if (lane < 4) {
#pragma unroll
        for (int c = 0; c < kCols; ++c) ss.warp_max[warp][get<1>(cSrc(0, c))] = m[c];
      }
      __syncthreads();  // warp_max complete; this stage's keys are no longer read
      if (tid < kRows) {
        const int32_t j = tid / Gk;
        if (j >= j_lo && j < j_hi && b <= pt.pos(j) / kBlockN) {
          float v = ss.warp_max[0][tid];
#pragma unroll
          for (int w = 1; w < Traits::kWarps; ++w) v = fmaxf(v, ss.warp_max[w][tid]);
          if constexpr (Traits::kE4M3) v *= page_scale(a.k_scale, a.k_scale_step, page_of(a, pt.pages, b));
          const int64_t row = (t0 + j - a.tok_lo) * a.Hi + ik * Gk + tid % Gk;
          a.scores[row * a.max_pages + b] = v;
        }
      }
    }
  };
  if constexpr (Traits::kE4M3 && std::is_same_v<Element, cutlass::bfloat16_t>) {
    // Q (group 0, with block b0) has landed: float16 where every element converts exactly.
    cp_async_wait<kStages - 2>();
    __syncthreads();
    if (__syncthreads_and(half_exact_tile<kRows, kDim>(sQ, tid, kThreads))) {
      to_half_tile<kRows, kDim>(sQ, tid, kThreads);
      __syncthreads();
      score_blocks(QueryType<cutlass::half_t>{});
    } else {
      score_blocks(QueryType<Element>{});
    }
  } else {
    score_blocks(QueryType<Element>{});
  }
}

}  // namespace msa::cuda::kern
