// LSE_idx of the KL branch over the support, by parts (the teacher route, Options.kl_pass =
// kTeacher): for every record of the backward's entry lists (token t, index head i, the KV block
// it selected), the block's (max, sum of exp2) of the index logits
//   x(t, j) = scale_idx * q_idx[t, i] . k_idx[j] * log2(e)   over the block's keys j <= t,
// to the slot of p.lse_part at the block's column of t's block_idx row; the backward's combine
// adds a row's slots in a fixed order (lse_combine_kernel), so that LSE_idx costs one pass over
// the selected blocks only.
//
// KV-side, as kl_grad_kernel.cuh (one CTA per chunk of the work list of one KV block and one KV
// head), with the query rows as MMA rows: a step is R = p.step_records records, whose m tokens
// each are the step's rows (row = record * m + token; R * m <= 128), S_idx = q_idx k_idx^T by
// wgmma with the block's keys as the columns, and each row's max and sum are its thread quad's,
// with no exchange across warps. R is one where the index key head may change inside a work
// item (the block's index keys are then reloaded where it does).
//
// Warp roles: none; all threads load, and each of the two warpgroups multiplies and reduces its
// 64 rows. Pipeline: kStages stages of a step's q_idx rows by cp.async, kLead = kStages - 1 steps
// in flight, the records kLead steps further ahead through a ring (RecordSteps, as
// kl_grad_kernel's); one CTA barrier per step.
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/gemm/collective/builders/sm90_common.inl>

#include "../device/entry_list.cuh"
#include "../device/grid_dependency.cuh"
#include "../device/load.cuh"
#include "../device/softmax.cuh"
#include "../device/utils.cuh"
#include "../host/args.h"

namespace msa::cuda::kern {

using cuda::KlArgs;

template <class Element_, int kDim_, int kBlockN_>
struct KlLseTraits {
  using Element = Element_;
  static constexpr int kDim = kDim_, kBlockN = kBlockN_;
  static constexpr int kRows = 128;  // two warpgroups of 64 rows
  static constexpr int kThreads = 256;
  // Two CTAs per SM (the registers and shared memory of two, with two stages each): one CTA's
  // barrier and reductions are the other's time for its MMAs.
  static constexpr int kMinBlocks = 2;
  static constexpr int kStages = 2;
  static constexpr int kLead = kStages - 1;
  static constexpr int kRing = 2 * kStages;
  static constexpr int kMaxRecords = cuda::kLseStepRecords;
  using TileS = Shape<Int<kRows>, Int<kBlockN>, Int<kDim>>;
  using MmaS = decltype(make_tiled_mma(GMMA::ss_op_selector<Element, Element, float, TileS>(),
                                       Layout<Shape<_2, _1, _1>>{}));
  using SmemLayoutQ = decltype(tile_to_shape(
      cutlass::gemm::collective::detail::ss_smem_selector<GMMA::Major::K, Element, Int<kRows>, Int<kDim>>(),
      Shape<Int<kRows>, Int<kDim>, Int<kStages>>{}));
  using SmemLayoutK = decltype(tile_to_shape(
      cutlass::gemm::collective::detail::ss_smem_selector<GMMA::Major::K, Element, Int<kBlockN>, Int<kDim>>(),
      Shape<Int<kBlockN>, Int<kDim>>{}));
  struct SharedStorage {
    alignas(1024) cute::array_aligned<Element, cosize_v<SmemLayoutQ>> q;
    alignas(1024) cute::array_aligned<Element, cosize_v<SmemLayoutK>> k;
    EntryRecord ring[kRing][kMaxRecords];
  };
};

template <class Traits>
struct KlLseParams : KlArgs {};

template <class Traits>
__global__ void __launch_bounds__(Traits::kThreads, Traits::kMinBlocks) kl_lse_kernel(const __grid_constant__ KlLseParams<Traits> p) {
  grid_dependency_begin();
  using Element = typename Traits::Element;
  constexpr int kRows = Traits::kRows, kBlockN = Traits::kBlockN, kDim = Traits::kDim;
  constexpr int kThreads = Traits::kThreads, kStages = Traits::kStages, kLead = Traits::kLead;
  constexpr int kRing = Traits::kRing;
  using SharedStorage = typename Traits::SharedStorage;

  extern __shared__ __align__(1024) char smem_raw[];
  SharedStorage& ss = *reinterpret_cast<SharedStorage*>(smem_raw);

  KvChunk work;
  if (!work.find<kBlockN>(p)) return;
  const QueryTile& tile = work.tile;
  const int64_t key_row = work.key_row, key_base = work.key_base;
  const int tid = threadIdx.x;
  const RecordSteps<kRing, Traits::kMaxRecords> steps(p.list, work.list, work.begin, work.end, p.step_records, p.group_tokens,
                                                      work.it.r, p.idx_per_kv);
  const Element* q_idx = as<Element>(p.q_idx);

  Tensor sQ = make_tensor(make_smem_ptr(ss.q.data()), typename Traits::SmemLayoutQ{});
  Tensor sK = make_tensor(make_smem_ptr(ss.k.data()), typename Traits::SmemLayoutK{});
  const BlockRowLoader<kRows, kDim, kThreads> q_load(sQ(_, _, 0), tid);
  auto issue_records = [&](int s) { steps.issue(ss.ring, s, tid, kThreads); };
  // The q_idx rows of step s into its stage (its records have landed; zeros past them).
  auto issue_rows = [&](int s) {
    if (s >= steps.steps) return;
    const EntryRecord* recs = ss.ring[s % kRing];
    const int n = steps.count(s);
    q_load.load_rows(
        ss.q.data() + (s % kStages) * kRows * kDim,
        [&](int row) -> const Element* {
          int32_t i = 0;
          const int64_t tok = steps.token(recs, n, row, &i);
          return tok >= 0 ? q_idx + tok * p.qi_s0 + i * p.qi_s1 : nullptr;
        },
        q_idx);
  };

  typename Traits::MmaS mma;
  auto thr = mma.get_thread_slice(tid);
  Tensor tSrK = thr.partition_fragment_B(sK);
  Tensor tSrS = partition_fragment_C(mma, Shape<Int<kRows>, Int<kBlockN>>{});
  Tensor S = make_tensor(tSrS.data(), acc_rowcol(tSrS.layout()));
  Tensor cS = thr.partition_C(make_identity_tensor(Shape<Int<kRows>, Int<kBlockN>>{}));
  Tensor cSrc = make_tensor(cS.data(), acc_rowcol(cS.layout()));
  const float c2 = p.scale_idx * static_cast<float>(M_LOG2E);
  float2* lse_part = reinterpret_cast<float2*>(p.lse_part);

  // The records of the first kLead steps, then their rows (each step one commit group, with the
  // records of the step kLead after it).
  for (int s = 0; s < kLead; ++s) issue_records(s);
  cp_async_commit();
  cp_async_wait_all();
  cutlass::arch::fence_view_async_shared();
  __syncthreads();
  for (int s = 0; s < kLead; ++s) {
    issue_rows(s);
    issue_records(s + kLead);
    cp_async_commit();
  }

  int32_t loaded_ik = -1;
  for (int s = 0; s < steps.steps; ++s) {
    // Step s's rows and the records of step s + kLead have landed; every thread is done with
    // step s - 1, whose stage the next issue refills.
    cp_async_wait<kStages - 2>();
    cutlass::arch::fence_view_async_shared();
    __syncthreads();
    const EntryRecord* recs = ss.ring[s % kRing];
    const int n = steps.count(s);
    // Every record of a step has the same index key head (step_records is 1 otherwise).
    const int32_t ik = (steps.head0 + recs[0].seg) / p.idx_per_key;
    if (ik != loaded_ik) {  // the same for every thread: (re)load the block's index keys
      loaded_ik = ik;
      load_block_rows_now<kBlockN, kDim>(
          sK, as<Element>(p.k_idx) + key_row * p.ki_s0 + ik * p.ki_s1, p.ki_s0, tile.count, tid, kThreads);
    }
    issue_rows(s + kLead);
    issue_records(s + 2 * kLead);
    cp_async_commit();

    const int st = s % kStages;
    Tensor sQs = make_tensor(make_smem_ptr(ss.q.data() + st * kRows * kDim), take<0, 2>(typename Traits::SmemLayoutQ{}));
    clear(tSrS);
    wg_gemm<true>(mma, thr.partition_fragment_A(sQs), tSrK, tSrS);
    warpgroup_wait<0>();
    // Each row's (max, sum of exp2) over its visible keys, over the thread quad that holds it.
#pragma unroll
    for (int a = 0; a < size<0>(S); ++a) {
      const int row = get<0>(cSrc(a, 0));
      int32_t i = 0;
      const int64_t tok = steps.token(recs, n, row, &i);  // -1: no token
      // The row's visible keys: the block's first last + 1 (none where last < 0).
      const int32_t last = static_cast<int32_t>(max<int64_t>(min<int64_t>(tok - key_base, kBlockN), -1));
      float mx = -INFINITY;
#pragma unroll
      for (int c = 0; c < size<1>(S); ++c) {
        S(a, c) = get<1>(cSrc(a, c)) <= last ? S(a, c) * c2 : -INFINITY;
        mx = fmaxf(mx, S(a, c));
      }
      mx = quad_max(mx);
      float sum = 0.f;
      if (mx != -INFINITY) {
#pragma unroll
        for (int c = 0; c < size<1>(S); ++c) sum += fast_exp2(S(a, c) - mx);
      }
      sum = quad_sum(sum);
      if (tok >= 0 && (tid & 3) == 0) lse_part[(tok * p.Hi + i) * p.top_k + steps.slot(recs, row)] = make_float2(mx, sum);
    }
  }
  cp_async_wait_all();
}

}  // namespace msa::cuda::kern
