// The shapes both KV-side kernels (bwd_kv_kernel.cuh, kl_kernel.cuh) share: a CTA of kBlockN / 64
// consumer warpgroups owns one block of kBlockN keys (64 per warpgroup); an entry brings
// kBlockC = 64 main columns (token, head) and kTok index columns (tokens; 16, or kl_grad's
// kKlGradTokens) through kStages shared-memory stages. The scores are computed transposed, keys
// as MMA rows:
//   S^T = K Q^T (MmaS), S_idx^T = k_idx q_idx^T (MmaSi), dq_idx^T = k_idx^T dS_idx^T (MmaDQ),
//   dk_idx += dS_idx^T q_idx (MmaDK).
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/gemm/collective/builders/sm90_common.inl>

namespace msa::cuda::kern {

using namespace cute;

template <class Element_, int kDim_, int kBlockN_, int kStages_, int kTok_ = 16>
struct KvSideTraits {
  using Element = Element_;
  static constexpr int kDim = kDim_;        // D (== Di where the index branch runs)
  static constexpr int kBlockN = kBlockN_;  // keys per CTA: one MSA block
  static constexpr int kBlockC = 64;        // main columns (token, head) per entry
  static constexpr int kTok = kTok_;        // index columns: whole entries' tokens (m <= 16)
  static constexpr int kStages = kStages_;  // entries in flight: cp.async prefetch depth + 1
  static constexpr int kWarpGroups = kBlockN / 64;
  static constexpr int kThreads = 128 * kWarpGroups;
  static constexpr int kDqWarpGroups = kWarpGroups < kDim / 64 ? kWarpGroups : kDim / 64;

  using TileS = Shape<Int<kBlockN>, Int<kBlockC>, Int<kDim>>;
  using TileSi = Shape<Int<kBlockN>, Int<kTok>, Int<kDim>>;
  using TileDQ = Shape<Int<kDim>, Int<kTok>, Int<kBlockN>>;
  using MmaS = decltype(make_tiled_mma(GMMA::ss_op_selector<Element, Element, float, TileS>(),
                                       Layout<Shape<Int<kWarpGroups>, _1, _1>>{}));
  using MmaSi = decltype(make_tiled_mma(GMMA::ss_op_selector<Element, Element, float, TileSi>(),
                                        Layout<Shape<Int<kWarpGroups>, _1, _1>>{}));
  using MmaDQ = decltype(make_tiled_mma(
      GMMA::ss_op_selector<Element, Element, float, TileDQ, GMMA::Major::MN, GMMA::Major::K>(),
      Layout<Shape<Int<kDqWarpGroups>, _1, _1>>{}));

  // The block's keys (K, k_idx), K-major; transposed, the A operand of dq_idx^T.
  using SmemAtomK = decltype(cutlass::gemm::collective::detail::ss_smem_selector<
                             GMMA::Major::K, Element, Int<kBlockN>, Int<kDim>>());
  using SmemLayoutK = decltype(tile_to_shape(SmemAtomK{}, Shape<Int<kBlockN>, Int<kDim>>{}));
  using SmemLayoutKt = decltype(composition(
      SmemLayoutK{}, make_ordered_layout(Shape<Int<kDim>, Int<kBlockN>>{}, Step<_2, _1>{})));
  // An entry's main columns (Q, dO) and index columns (q_idx), per stage.
  using SmemAtomQ = decltype(cutlass::gemm::collective::detail::ss_smem_selector<
                             GMMA::Major::K, Element, Int<kBlockC>, Int<kDim>>());
  using SmemLayoutQ =
      decltype(tile_to_shape(SmemAtomQ{}, Shape<Int<kBlockC>, Int<kDim>, Int<kStages>>{}));
  using SmemAtomQi = decltype(cutlass::gemm::collective::detail::ss_smem_selector<
                              GMMA::Major::K, Element, Int<kTok>, Int<kDim>>());
  using SmemLayoutQi =
      decltype(tile_to_shape(SmemAtomQi{}, Shape<Int<kTok>, Int<kDim>, Int<kStages>>{}));
  // dS_idx of an entry as the (tokens, keys) B operand of dq_idx^T, keys contiguous.
  using SmemAtomDS = decltype(cutlass::gemm::collective::detail::ss_smem_selector<
                              GMMA::Major::K, Element, Int<kTok>, Int<kBlockN>>());
  using SmemLayoutDS1 = decltype(tile_to_shape(SmemAtomDS{}, Shape<Int<kTok>, Int<kBlockN>>{}));

  // dk_idx += dS_idx^T q_idx with dS_idx^T in registers (RS, the block's keys as rows; the KL
  // kernels, whose dk_idx stays in registers): q_idx transposed, (Di, tokens), as the B operand.
  using TileDK = Shape<Int<kBlockN>, Int<kDim>, Int<kTok>>;
  using MmaDK = decltype(make_tiled_mma(
      GMMA::rs_op_selector<Element, Element, float, TileDK, GMMA::Major::K, GMMA::Major::MN>(),
      Layout<Shape<Int<kWarpGroups>, _1, _1>>{}));
  using SmemLayoutQit = decltype(composition(
      SmemLayoutQi{}, make_ordered_layout(Shape<Int<kDim>, Int<kTok>, Int<kStages>>{}, Step<_2, _1, _3>{})));
};

}  // namespace msa::cuda::kern
