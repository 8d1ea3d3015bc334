// The KL branch (docs/contract.md §4) as a pass of its own on the KV side, for the exact KL value and for the
// gradient when bwd_kv_kernel.cuh cannot carry it (Gi = Hq / Hi not a power of two). For one KV
// block and one KV head, over the same entry list as bwd_kv_kernel.cuh,
//   teacher  pi(t, j)    = mean over index head i's Gi query heads of P_h(t, j) (recomputed),
//   student  sigma(t, j) = exp(scale_idx * q_idx[t, i] . k_idx[j] - LSE_idx(t, i)),
//   dS(t, j) = sigma - pi (the factor gamma / (N Hi) is applied when the sums are finalised),
//   dk_idx[j] += dS^T q_idx (RS wgmma, the block's keys as rows, kept in registers),
//   dq_idx[t] += k_idx^T dS (SS wgmma over the block's keys, added to the token's row),
//   and, when asked, the KL terms pi * (log pi - log sigma) per (token, index head).
// Sums that cross CTAs (dq_idx, dk_idx over the KV heads sharing an index key head, the KL rows)
// are added as 64-bit fixed point (2^-32 units) with integer atomics: integer addition is
// associative, so every run gives the same bits whatever the order of the CTAs.
//
// The teacher needs the mean over heads, i.e. over columns of P^T: P^T goes to shared memory
// (fp32) and each (key, token) pair is summed in a fixed order by one thread.
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/gemm/collective/builders/sm90_common.inl>

#include "../device/entry_list.cuh"
#include "../device/grid_dependency.cuh"
#include "../device/kv_side_traits.cuh"
#include "../device/load.cuh"
#include "../device/mask.cuh"
#include "../device/softmax.cuh"
#include "../device/tile.cuh"
#include "../device/utils.cuh"
#include "../host/args.h"

namespace msa::cuda::kern {

using cuda::KlArgs;

// kDim: D == Di (the index branch and the main branch share the instantiation's head dim).
template <class Element_, int kDim_, int kBlockN_>
struct KlTraits : KvSideTraits<Element_, kDim_, kBlockN_, 4> {
  using Base = KvSideTraits<Element_, kDim_, kBlockN_, 4>;
  using Element = Element_;
  static constexpr int kDim = kDim_, kBlockN = kBlockN_;
  static constexpr int kBlockC = Base::kBlockC, kTok = Base::kTok, kStages = Base::kStages;
  static constexpr int kWarpGroups = Base::kWarpGroups;
  static constexpr int kPStride = kBlockC + 1;
  using typename Base::SmemLayoutK;
  using typename Base::SmemLayoutQ;
  using typename Base::SmemLayoutQi;
  using typename Base::SmemLayoutQit;
  // dS^T as the B operand (tokens, keys) of dq_idx^T = k_idx^T dS^T.
  using SmemLayoutDS = typename Base::SmemLayoutDS1;

  struct SharedStorage {
    alignas(1024) cute::array_aligned<Element, cosize_v<SmemLayoutK>> k;
    alignas(1024) cute::array_aligned<Element, cosize_v<SmemLayoutK>> k_idx;
    alignas(1024) cute::array_aligned<Element, cosize_v<SmemLayoutQ>> q;
    alignas(1024) cute::array_aligned<Element, cosize_v<SmemLayoutQi>> q_idx;
    alignas(1024) cute::array_aligned<Element, cosize_v<SmemLayoutDS>> ds;
    float p[kBlockN * kPStride];  // P^T, then the teacher at column token * Gi
    float lse[kStages][kBlockC];  // main LSE per column
    float lidx[kStages][kTok];    // LSE_idx per token
    EntryRecord ring[EntryStream<kStages>::kRing];
  };
};

template <class Traits>
struct KlParams : KlArgs {};

// Warp roles, pipeline and work: those of bwd_kv_kernel.cuh (kBlockN / 64 consumer warpgroups,
// the entry stream, one chunk of one entry list per CTA).
template <class Traits>
__global__ void __launch_bounds__(Traits::kThreads, 1)
    kl_kernel(const __grid_constant__ KlParams<Traits> p) {
  grid_dependency_begin();
  using Element = typename Traits::Element;
  constexpr int kBlockN = Traits::kBlockN, kBlockC = Traits::kBlockC, kDim = Traits::kDim;
  constexpr int kThreads = Traits::kThreads, kPStride = Traits::kPStride;
  using SharedStorage = typename Traits::SharedStorage;

  extern __shared__ __align__(1024) char smem_raw[];
  SharedStorage& ss = *reinterpret_cast<SharedStorage*>(smem_raw);

  KvChunk work;
  if (!work.find<kBlockN>(p)) return;
  const QueryTile& tile = work.tile;
  const EntryList& list = work.list;
  const int64_t e_begin = work.begin, e_end = work.end, key_row = work.key_row, key_base = work.key_base;
  const int32_t r = work.it.r;
  const int tid = threadIdx.x;
  const int wg = tid / 128;
  const int32_t Gi = p.heads_per_idx, m = p.group_tokens, ipk = p.idx_per_kv;
  // The records of the first entries; their rows are issued after the block's keys.
  EntryStream<Traits::kStages> stream(list, p.list, e_begin, e_end, ss.ring);

  Tensor sK = make_tensor(make_smem_ptr(ss.k.data()), typename Traits::SmemLayoutK{});
  Tensor sKi = make_tensor(make_smem_ptr(ss.k_idx.data()), typename Traits::SmemLayoutK{});
  Tensor sKit = make_tensor(make_smem_ptr(ss.k_idx.data()), typename Traits::SmemLayoutKt{});
  Tensor sQ = make_tensor(make_smem_ptr(ss.q.data()), typename Traits::SmemLayoutQ{});
  Tensor sQi = make_tensor(make_smem_ptr(ss.q_idx.data()), typename Traits::SmemLayoutQi{});
  Tensor sQit = make_tensor(make_smem_ptr(ss.q_idx.data()), typename Traits::SmemLayoutQit{});
  Tensor sDS = make_tensor(make_smem_ptr(ss.ds.data()), typename Traits::SmemLayoutDS{});

  // The block's main keys; its index keys are loaded when the first entry (and each entry whose
  // index head uses another index key head) arrives.
  int32_t loaded_ik = -1;
  load_block_rows_async<kBlockN, kDim>(
      sK, as<Element>(p.k) + key_row * p.k_s0 + r * p.k_s1, p.k_s0, tile.count,
      tid, kThreads);

  const ColumnLoader<kDim, kThreads> cols_in(sQ(_, _, 0), Gi, tid);
  constexpr int kStageElems = kBlockC * kDim;
  auto issue = [&](const EntryRecord* recs, int st) {
    const EntryRecord& en = recs[0];
    const int32_t count = en.count;
    const int32_t i = r * ipk + en.seg - list.seg0;
    const int32_t head0 = i * Gi;
    int32_t t[ColumnLoader<kDim, kThreads>::kIters];
    cols_in.tokens(en.tok, count, t);
    cols_in.load(ss.q.data() + st * kStageElems, as<Element>(p.q) + head0 * p.q_s1, p.q_s0, p.q_s1, t);
    const Element* qi = as<Element>(p.q_idx) + i * p.qi_s1;
    load_rows_async<Traits::kTok, kDim>(
        sQi(_, _, st),
        [&](int row) { return row < count ? qi + int64_t(en.tok[row]) * p.qi_s0 : nullptr; }, tid,
        kThreads);
    if (tid < kBlockC) {
      const int c = tid;
      const int32_t tok = c / Gi;
      const bool ok = tok < count && c < m * Gi;
      cp_async4(&ss.lse[st][c],
                p.lse + int64_t(ok ? en.tok[tok] : 0) * p.lse_s0 + (head0 + (ok ? c - tok * Gi : 0)) * p.lse_s1, ok);
    } else if (tid < kBlockC + Traits::kTok) {
      const int c = tid - kBlockC;
      const bool ok = c < count;
      cp_async4(&ss.lidx[st][c], p.lse_idx + int64_t(ok ? en.tok[c] : 0) * p.Hi + i, ok);
    }
  };

  typename Traits::MmaS mma_s;
  typename Traits::MmaSi mma_si;
  typename Traits::MmaDK mma_dk;
  typename Traits::MmaDQ mma_dq;
  auto thr_s = mma_s.get_thread_slice(tid);
  auto thr_si = mma_si.get_thread_slice(tid);
  auto thr_dk = mma_dk.get_thread_slice(tid);
  const bool dq_thread = tid < 128 * Traits::kDqWarpGroups;
  auto thr_dq = mma_dq.get_thread_slice(dq_thread ? tid : 0);
  Tensor tSrK = thr_s.partition_fragment_A(sK);
  Tensor tSrKi = thr_si.partition_fragment_A(sKi);
  Tensor tSrQ = thr_s.partition_fragment_B(sQ);
  Tensor tSrQi = thr_si.partition_fragment_B(sQi);
  Tensor tDKrQit = thr_dk.partition_fragment_B(sQit);
  Tensor tDQrKit = thr_dq.partition_fragment_A(sKit);
  Tensor tDQrDS = thr_dq.partition_fragment_B(sDS);
  Tensor tSrS = partition_fragment_C(mma_s, Shape<Int<kBlockN>, Int<kBlockC>>{});
  Tensor tSrSi = partition_fragment_C(mma_si, Shape<Int<kBlockN>, Int<Traits::kTok>>{});
  Tensor tDKrDK = partition_fragment_C(mma_dk, Shape<Int<kBlockN>, Int<kDim>>{});
  Tensor tDQrDQ = partition_fragment_C(mma_dq, Shape<Int<kDim>, Int<Traits::kTok>>{});
  clear(tDKrDK);

  Tensor cS = thr_s.partition_C(make_identity_tensor(Shape<Int<kBlockN>, Int<kBlockC>>{}));
  Tensor S = make_tensor(tSrS.data(), acc_rowcol(tSrS.layout()));
  Tensor Si = make_tensor(tSrSi.data(), acc_rowcol(tSrSi.layout()));
  Tensor cSrc = make_tensor(cS.data(), acc_rowcol(cS.layout()));
  Tensor cSi = thr_si.partition_C(make_identity_tensor(Shape<Int<kBlockN>, Int<Traits::kTok>>{}));
  Tensor cSirc = make_tensor(cSi.data(), acc_rowcol(cSi.layout()));
  constexpr int kRows = decltype(size<0>(S))::value;
  constexpr int kCols = decltype(size<1>(S))::value;
  constexpr int kColsI = decltype(size<1>(Si))::value;
  Tensor rDS = make_tensor<Element>(tSrSi.layout());
  Tensor tDKrDS = make_tensor(rDS.data(), acc_as_a_operand(rDS.layout()));
  Tensor cDQ = thr_dq.partition_C(make_identity_tensor(Shape<Int<kDim>, Int<Traits::kTok>>{}));
  Tensor KLt = make_tensor<float>(tSrSi.layout());  // KL terms, in the index-score layout
  Tensor KL = make_tensor(KLt.data(), acc_rowcol(KLt.layout()));

  const float inv_gi = 1.f / static_cast<float>(Gi);
  const bool want_grad = p.dq_idx != nullptr || p.dk_idx != nullptr;
  int32_t cur_il = -1;

  // dk_idx of the keys so far (index head cur_il) -> the fixed-point sums; then zero.
  auto flush_dk = [&]() {
    if (cur_il < 0 || p.dk_idx == nullptr) return;
    const int32_t ik = (r * ipk + cur_il) / p.idx_per_key;
    Tensor cDK = thr_dk.partition_C(make_identity_tensor(Shape<Int<kBlockN>, Int<kDim>>{}));
#pragma unroll
    for (int v = 0; v < size(tDKrDK); ++v) {
      const int row = get<0>(cDK(v)), col = get<1>(cDK(v));
      if (row < tile.count) add_fixed(p.dk_idx + ((key_row + row) * p.Hik + ik) * kDim + col, tDKrDK(v));
    }
    clear(tDKrDK);
  };

  // The first kStages - 1 entries in flight (the block's own rows ride with the first).
  stream.start(list, p.list, issue);
  for (int64_t e = e_begin; e < e_end; ++e) {
    const int st = stream.stage(e);
    stream.wait();
    const EntryRecord& en = stream.record(e);
    const int32_t il = en.seg - list.seg0;
    const int32_t i = r * ipk + il;
    if (il != cur_il) {
      flush_dk();
      cur_il = il;
      const int32_t ik = i / p.idx_per_key;
      if (ik != loaded_ik) {  // another index key head: (re)load the block's index keys
        loaded_ik = ik;
        load_block_rows_now<kBlockN, kDim>(
            sKi, as<Element>(p.k_idx) + key_row * p.ki_s0 + ik * p.ki_s1, p.ki_s0, tile.count,
            tid, kThreads);
      }
    }
    stream.issue_next(list, p.list, issue);
    if (en.count == 0) continue;

    wg_gemm<true>(mma_s, tSrK, tSrQ(_, _, _, st), tSrS);
    wg_gemm<true>(mma_si, tSrKi, tSrQi(_, _, _, st), tSrSi);
    warpgroup_wait<0>();
    // P^T (masked) to shared memory.
#pragma unroll
    for (int a = 0; a < kRows; ++a) {
      const int row = get<0>(cSrc(a, 0));
      const int64_t key = key_base + row;
#pragma unroll
      for (int c = 0; c < kCols; ++c) {
        const int col = get<1>(cSrc(a, c));
        const int32_t t = col / Gi;
        const bool ok = entry_sees(en, t, key);
        ss.p[row * kPStride + col] =
            ok ? fast_exp2(S(a, c) * p.scale_log2 - ss.lse[st][col] * static_cast<float>(M_LOG2E)) : 0.f;
      }
    }
    cutlass::arch::NamedBarrier::sync(128, static_cast<uint32_t>(Barrier::kWarpGroup) + wg);
    // Teacher: one thread per (key, token) of this warpgroup's rows sums the Gi heads in order.
    for (int w = tid % 128; w < 64 * m; w += 128) {
      const int row = wg * 64 + w / m, t = w % m;
      float* pr = ss.p + row * kPStride + t * Gi;
      float acc = 0.f;
      for (int h = 0; h < Gi; ++h) acc += pr[h];
      pr[0] = acc * inv_gi;
    }
    cutlass::arch::NamedBarrier::sync(128, static_cast<uint32_t>(Barrier::kWarpGroup) + wg);

    // Student and dS = sigma - pi, in the index-score accumulator (columns are tokens).
#pragma unroll
    for (int a = 0; a < kRows; ++a) {
      const int row = get<0>(cSirc(a, 0));
      const int64_t key = key_base + row;
#pragma unroll
      for (int c = 0; c < kColsI; ++c) {
        const int t = get<1>(cSirc(a, c));
        const bool ok = entry_sees(en, t, key);
        const float pi = ok ? ss.p[row * kPStride + t * Gi] : 0.f;
        const float lsig2 = (Si(a, c) * p.scale_idx - ss.lidx[st][t]) * static_cast<float>(M_LOG2E);
        Si(a, c) = ok ? fast_exp2(lsig2) - pi : 0.f;
        // KL term pi * (ln pi - ln sigma).
        KL(a, c) = ok && pi > 0.f ? pi * (__logf(pi) - lsig2 * 0.69314718056f) : 0.f;
      }
    }
    if (p.kl_rows != nullptr) {
      // Per token: the thread's rows, then the 8 row groups of the warp; lanes 0-3 add.
#pragma unroll
      for (int c = 0; c < kColsI; ++c) {
        float v = 0.f;
#pragma unroll
        for (int a = 0; a < kRows; ++a) v += KL(a, c);
        v += __shfl_xor_sync(0xffffffff, v, 4);
        v += __shfl_xor_sync(0xffffffff, v, 8);
        v += __shfl_xor_sync(0xffffffff, v, 16);
        const int t = get<1>(cSirc(0, c));
        if ((tid & 31) < 4 && t < en.count && v != 0.f)
          add_fixed(p.kl_rows + int64_t(en.tok[t]) * p.Hi + i, v);
      }
    }
    if (!want_grad) continue;

    convert_into(tSrSi, rDS);
    if (p.dk_idx != nullptr) wg_gemm<false, true>(mma_dk, tDKrDS, tDKrQit(_, _, _, st), tDKrDK);
    if (p.dq_idx != nullptr) {
      // dS^T (tokens, keys) to shared memory for dq_idx^T = k_idx^T dS^T over all the block's keys.
#pragma unroll
      for (int a = 0; a < kRows; ++a) {
        const int row = get<0>(cSirc(a, 0));
#pragma unroll
        for (int c = 0; c < kColsI; ++c) sDS(get<1>(cSirc(a, c)), row) = static_cast<Element>(Si(a, c));
      }
      cutlass::arch::fence_view_async_shared();
      __syncthreads();
      if (dq_thread) {
        wg_gemm<true>(mma_dq, tDQrKit, tDQrDS, tDQrDQ);
        warpgroup_wait<0>();
#pragma unroll
        for (int v = 0; v < size(tDQrDQ); ++v) {
          const int d = get<0>(cDQ(v)), t = get<1>(cDQ(v));
          if (entry_selects(en, t))
            add_fixed(p.dq_idx + (int64_t(en.tok[t]) * p.Hi + i) * kDim + d, tDQrDQ(v));
        }
      }
    }
    warpgroup_wait<0>();
  }
  cp_async_wait_all();
  flush_dk();
}

}  // namespace msa::cuda::kern
