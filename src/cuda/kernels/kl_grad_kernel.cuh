// The KL gradient of the index branch (docs/contract.md §4) from the teacher that
// bwd_kv_kernel.cuh wrote (Options.kl_pass = kTeacher, sparse mode): a KV-side pass of the index
// branch alone, over bwd_kv's work list and pass, so that it reads exactly the records whose
// teacher that pass wrote. For one KV block and one KV head, per entry (token t, index head i):
//   student  sigma(t, j) = exp(scale_idx * k_idx[j] . q_idx[t, i] - LSE_idx(t, i)),
//   dS(t, j) = sigma - pi (pi: the entry's teacher; gamma / (N Hi) is applied when the sums are
//              finalised),
//   dk_idx[j] += dS^T q_idx (RS wgmma, the block's keys as rows, in registers for the chunk),
//   dq_idx[t] += k_idx^T dS (SS wgmma over the block's keys), the token's product for this block.
// The products of dq_idx go to a row per (token, index head, block_idx column) of the workspace
// (KvSideArgs::dq_part), which the backward's combine adds in column order once the pass is done
// (backward.cu), where the plan takes the rows (the sums would outgrow L2; plan.cu), else to the
// token's fixed-point sums. Sums that cross CTAs (dk_idx over the KV heads sharing an index key
// head and over a block's chunks; dq_idx without its rows) are 64-bit fixed point (2^-32 units)
// added with integer atomics, so every run gives the same bits.
// LSE_idx comes from the pass before (kl_lse_kernel.cuh).
//
// Work: a step is up to R = 32 / m consecutive records of the chunk (p.step_records; 1 where the
// index key head may change inside a work item), whose tokens fill the 32 index columns of the
// MMAs: column c = j * m + t is token t of the step's record j.
// Warp roles: kBlockN / 64 consumer warpgroups (64 keys each: the products, dS, dk_idx in
// registers) and a producer warpgroup (few registers) that loads every step's records and rows
// and stores each step's dq_idx products, so that neither the loads' addressing nor the stores
// sit on the consumers' path (1-3% faster than every thread loading, computing and adding, on an
// H100). The pass is bound by its bytes: per selected (token, index head, block) the teacher row
// (4 Bk bytes), the q_idx row and the dq_idx product: 4 Di bytes written once as a row, or with
// the sums a read-modify-write of the token's 8 Di bytes of sums, seldom in L2 when its atomics
// arrive once the sums are well past its size (72% of the pass's bytes, ncu at the retrieval
// model's heads, 16 x 32K: the rows make the pass 30% faster there; docs/perf.md, 2026-12-07).
// Pipelines: full[stage] / empty[stage], kStages stages of a step's q_idx rows, LSE_idx and
// teacher rows (the producer's cp.async, kStages - 1 steps ahead; the steps' records kStages - 1
// steps further ahead through a ring); the dS^T tile of a step, two buffers, one consumer barrier a
// step; dq_full[b] / dq_empty[b], two buffers of a step's dq_idx products in shared memory, handed
// to the producer, which stores (or adds) step s's while the consumers compute the steps after it.
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/gemm/collective/builders/sm90_common.inl>

#include "../device/entry_list.cuh"
#include "../device/grid_dependency.cuh"
#include "../device/kv_side_traits.cuh"
#include "../device/load.cuh"
#include "../device/mask.cuh"
#include "../device/softmax.cuh"
#include "../device/utils.cuh"
#include "../host/args.h"

namespace msa::cuda::kern {

using cuda::KlArgs;

// kDim: Di (== D: the instantiation's head dim).
template <class Element_, int kDim_, int kBlockN_>
struct KlGradTraits : KvSideTraits<Element_, kDim_, kBlockN_, 4, kKlGradTokens> {
  using Base = KvSideTraits<Element_, kDim_, kBlockN_, 4, kKlGradTokens>;
  using Element = Element_;
  static constexpr int kDim = kDim_, kBlockN = kBlockN_;
  static constexpr int kTok = Base::kTok, kStages = Base::kStages, kWarpGroups = Base::kWarpGroups;
  static constexpr int kConsumerThreads = Base::kThreads;
  static constexpr int kThreads = kConsumerThreads + 128;  // and the producer warpgroup
  // Registers after setmaxnreg with two consumer warpgroups (as bwd_kv_kernel.cuh): a 384-thread
  // CTA holds 168 x 384, and 56 x 128 + 224 x 256 is exactly that (with 40 the producer's loop
  // spilled 8 bytes; the consumers need no more than 224).
  static constexpr int kProducerRegs = 56, kConsumerRegs = 224;
  static constexpr int kLaunchRegs = 65536 / kThreads / 8 * 8;
  static_assert(kWarpGroups == 1 ||
                    kProducerRegs * 128 + kConsumerRegs * kConsumerThreads <= kLaunchRegs * kThreads,
                "setmaxnreg asks for more registers than the CTA holds");
  static constexpr int kLead = kStages - 1;   // steps in flight ahead of the one computed
  static constexpr int kRing = 2 * kStages;   // steps whose records are in shared memory
  static constexpr int kMaxRecords = kTok;    // records of a step (m = 1)
  static constexpr int kDqStride = kDim + 4;  // floats a column of a staged dq_idx tile (no bank conflicts)
  // One CTA per SM. (With every thread loading and adding, 16 columns a step at two CTAs per SM
  // ran 1.13x faster than at one, and 32 columns a step at one CTA per SM 8-9% faster still.)
  static constexpr int kMinBlocks = 1;
  using typename Base::SmemLayoutK;
  using typename Base::SmemLayoutQi;
  using typename Base::SmemLayoutQit;
  // dS^T of two steps: step s's dq_idx product reads buffer s % 2 while step s + 1's is written.
  using SmemLayoutDS = decltype(tile_to_shape(typename Base::SmemAtomDS{}, Shape<Int<kTok>, Int<kBlockN>, _2>{}));

  struct SharedStorage {
    alignas(1024) cute::array_aligned<Element, cosize_v<SmemLayoutK>> k_idx;
    alignas(1024) cute::array_aligned<Element, cosize_v<SmemLayoutQi>> q_idx;
    alignas(1024) cute::array_aligned<Element, cosize_v<SmemLayoutDS>> ds;
    alignas(16) float pi[kStages][kTok * kBlockN];  // a step's teacher: [record][key][m]
    float lidx[kStages][kTok];                      // LSE_idx per column
    alignas(16) float dq[2][kTok * kDqStride];      // a step's dq_idx^T products: [column][dim]
    EntryRecord ring[kRing][kMaxRecords];
    uint64_t full[kStages], empty[kStages], dq_full[2], dq_empty[2];
  };
};

template <class Traits>
struct KlGradParams : KlArgs {};

template <class Traits>
__global__ void __launch_bounds__(Traits::kThreads, Traits::kMinBlocks)
    kl_grad_kernel(const __grid_constant__ KlGradParams<Traits> p) {
  grid_dependency_begin();
  using Element = typename Traits::Element;
  using Bar = cutlass::arch::ClusterBarrier;
  constexpr int kBlockN = Traits::kBlockN, kDim = Traits::kDim, kTok = Traits::kTok;
  constexpr int kConsumerThreads = Traits::kConsumerThreads, kStages = Traits::kStages;
  constexpr int kLead = Traits::kLead, kRing = Traits::kRing, kDqStride = Traits::kDqStride;
  using SharedStorage = typename Traits::SharedStorage;

  extern __shared__ __align__(1024) char smem_raw[];
  SharedStorage& ss = *reinterpret_cast<SharedStorage*>(smem_raw);

  KvChunk work;
  if (!work.find<kBlockN, true>(p)) return;
  const QueryTile& tile = work.tile;
  const EntryList& list = work.list;
  const int64_t e_begin = work.begin, e_end = work.end, key_row = work.key_row, key_base = work.key_base;
  const int32_t r = work.it.r;
  const int tid = threadIdx.x;
  const int32_t m = p.group_tokens, R = p.step_records, ipk = p.idx_per_kv;
  const int m_shift = __ffs(m) - 1;  // m is a power of two (kTeacher: Gi is)
  const int64_t steps = (e_end - e_begin + R - 1) / R;
  if (steps <= 0) return;
  // The teacher index of the item's first record in this pass's buffer.
  const float* pi_item = p.teacher + (list.lo - p.pass_first) * kBlockN * m;

  auto first_record = [&](int64_t s) { return e_begin + s * R; };
  auto records_of = [&](int64_t s) { return static_cast<int>(min<int64_t>(R, e_end - first_record(s))); };

  if (tid == 0) {
    for (int st = 0; st < kStages; ++st) {
      Bar::init(&ss.full[st], 128);
      Bar::init(&ss.empty[st], kConsumerThreads);
    }
    for (int b = 0; b < 2; ++b) {
      Bar::init(&ss.dq_full[b], kConsumerThreads);
      Bar::init(&ss.dq_empty[b], 128);
    }
  }
  cutlass::arch::fence_barrier_init();
  __syncthreads();

  Tensor sQi = make_tensor(make_smem_ptr(ss.q_idx.data()), typename Traits::SmemLayoutQi{});

  // ---- Producer warpgroup: every step's records and rows; then each step's dq_idx products. ---
  if (tid >= kConsumerThreads) {
    if constexpr (Traits::kWarpGroups > 1) cutlass::arch::warpgroup_reg_dealloc<Traits::kProducerRegs>();
    const int pt = tid - kConsumerThreads;
    // The records of step s into its ring slot (16-byte cp.async copies; the caller commits).
    auto issue_records = [&](int64_t s) {
      if (s >= steps) return;
      const char* src = reinterpret_cast<const char*>(p.list.records + list.lo + first_record(s));
      char* dst = reinterpret_cast<char*>(ss.ring[s % kRing]);
      for (int c = pt; c < records_of(s) * kEntryChunks; c += 128) cp_async16(dst + 16 * c, src + 16 * c, true);
    };
    // The rows of step s into its stage (its records have landed): q_idx and LSE_idx per column,
    // and the records' teacher rows, which lie one after another.
    auto issue_rows = [&](int64_t s) {
      const int st = static_cast<int>(s % kStages);
      const int n = records_of(s);
      const EntryRecord* recs = ss.ring[s % kRing];
      auto column = [&](int c, int64_t* tok, int32_t* head) {
        const int j = c >> m_shift, t = c & (m - 1);
        if (j >= n || t >= recs[j].count) return false;
        *tok = recs[j].tok[t];
        *head = r * ipk + recs[j].seg - list.seg0;
        return true;
      };
      load_rows_async<kTok, kDim>(
          sQi(_, _, st),
          [&](int c) -> const Element* {
            int64_t tok;
            int32_t i;
            return column(c, &tok, &i) ? as<Element>(p.q_idx) + tok * p.qi_s0 + i * p.qi_s1 : nullptr;
          },
          pt, 128);
      if (pt < kTok) {
        int64_t tok = 0;
        int32_t i = 0;
        const bool ok = column(pt, &tok, &i);
        cp_async4(&ss.lidx[st][pt], p.lse_idx + tok * p.Hi + i, ok);
      }
      const float* src = pi_item + first_record(s) * kBlockN * m;
      for (int c = pt; c < n * kBlockN * m / 4; c += 128) cp_async16(&ss.pi[st][4 * c], src + 4 * c, true);
    };
    // Step a's dq_idx products (staged by the consumers), a warp a column: with p.dq_part to the
    // column's own row (its lanes 16 bytes each of the row's contiguous Di floats), else added to
    // the token row's fixed-point sums (its lanes the column's dims, 256 contiguous bytes a
    // warp-wide atomic).
    const int warp = pt / 32, lane = pt % 32;
    auto add_dq = [&](int64_t a) {
      const int b = static_cast<int>(a & 1);
      Bar::wait(&ss.dq_full[b], static_cast<uint32_t>((a >> 1) & 1));
      const EntryRecord* recs = ss.ring[a % kRing];
      const int n = records_of(a);
      const float* src = ss.dq[b];
#pragma unroll 1
      for (int c = warp; c < kTok; c += 4) {
        const int j = c >> m_shift, t = c & (m - 1);
        if (j < n && t < recs[j].count) {
          const int32_t i = r * ipk + recs[j].seg - list.seg0;
          const int64_t tok = recs[j].tok[t];
          if (p.dq_part != nullptr) {
            float* dst = p.dq_part + (((tok - p.part_tok_lo) * p.Hi + i) * p.top_k + recs[j].slot[t]) * kDim;
#pragma unroll
            for (int d = 4 * lane; d < kDim; d += 128)
              *reinterpret_cast<float4*>(dst + d) = *reinterpret_cast<const float4*>(src + c * kDqStride + d);
          } else {
            unsigned long long* dst = p.dq_idx + (tok * p.Hi + i) * kDim;
#pragma unroll
            for (int d = lane; d < kDim; d += 32) add_fixed(dst + d, src[c * kDqStride + d]);
          }
        }
      }
      Bar::arrive(&ss.dq_empty[b]);
    };

    // The records of the first kLead steps, landed for every producer thread.
    for (int64_t s = 0; s < kLead; ++s) issue_records(s);
    cp_async_commit();
    cp_async_wait_all();
    cutlass::arch::NamedBarrier::sync(128, static_cast<uint32_t>(Barrier::kProducer));
#pragma unroll 1
    for (int64_t s = 0; s < steps; ++s) {
      const int st = static_cast<int>(s % kStages);
      if (s >= kStages) Bar::wait(&ss.empty[st], static_cast<uint32_t>((s / kStages - 1) & 1));
      if (s >= kLead) {
        // Step s's records (the group of step s - kLead) have landed, for every producer thread.
        cp_async_wait<kLead - 1>();
        cutlass::arch::NamedBarrier::sync(128, static_cast<uint32_t>(Barrier::kProducer));
      }
      issue_rows(s);
      issue_records(s + kLead);
      cp_async_commit();
      cutlass::arch::cpasync_barrier_arrive_noinc(&ss.full[st]);
      // The consumers finish step s - kLead while the loads of the steps after it fly.
      if (s >= kLead) add_dq(s - kLead);
    }
    for (int64_t a = max<int64_t>(0, steps - kLead); a < steps; ++a) add_dq(a);
    cp_async_wait_all();
    return;
  }

  // ---- Consumer warpgroups. -------------------------------------------------------------------
  if constexpr (Traits::kWarpGroups > 1) cutlass::arch::warpgroup_reg_alloc<Traits::kConsumerRegs>();
  auto sync_consumers = [] {
    cutlass::arch::NamedBarrier::sync(kConsumerThreads, static_cast<uint32_t>(Barrier::kConsumers));
  };
  Tensor sKi = make_tensor(make_smem_ptr(ss.k_idx.data()), typename Traits::SmemLayoutK{});
  Tensor sKit = make_tensor(make_smem_ptr(ss.k_idx.data()), typename Traits::SmemLayoutKt{});
  Tensor sDS = make_tensor(make_smem_ptr(ss.ds.data()), typename Traits::SmemLayoutDS{});

  typename Traits::MmaSi mma_si;
  typename Traits::MmaDK mma_dk;
  typename Traits::MmaDQ mma_dq;
  auto thr_si = mma_si.get_thread_slice(tid);
  auto thr_dk = mma_dk.get_thread_slice(tid);
  const bool dq_thread = tid < 128 * Traits::kDqWarpGroups;
  auto thr_dq = mma_dq.get_thread_slice(dq_thread ? tid : 0);
  Tensor tSrKi = thr_si.partition_fragment_A(sKi);
  // A stage's q_idx operands, made where they are used from the stage's address.
  auto stage_q_idx = [&](int st, auto layout) {
    return make_tensor(make_smem_ptr(ss.q_idx.data() + st * kTok * kDim), take<0, 2>(layout));
  };
  Tensor tDQrKit = thr_dq.partition_fragment_A(sKit);
  Tensor tDQrDS = thr_dq.partition_fragment_B(sDS);  // (..., buffer)
  Tensor tSrSi = partition_fragment_C(mma_si, Shape<Int<kBlockN>, Int<kTok>>{});
  Tensor tDKrDK = partition_fragment_C(mma_dk, Shape<Int<kBlockN>, Int<kDim>>{});
  Tensor tDQrDQ = partition_fragment_C(mma_dq, Shape<Int<kDim>, Int<kTok>>{});
  clear(tDKrDK);
  Tensor Si = make_tensor(tSrSi.data(), acc_rowcol(tSrSi.layout()));
  Tensor cSi = thr_si.partition_C(make_identity_tensor(Shape<Int<kBlockN>, Int<kTok>>{}));
  Tensor cSirc = make_tensor(cSi.data(), acc_rowcol(cSi.layout()));
  constexpr int kRows = decltype(size<0>(Si))::value;
  constexpr int kCols = decltype(size<1>(Si))::value;
  Tensor rDS = make_tensor<Element>(tSrSi.layout());
  Tensor tDKrDS = make_tensor(rDS.data(), acc_as_a_operand(rDS.layout()));
  Tensor cDQ = thr_dq.partition_C(make_identity_tensor(Shape<Int<kDim>, Int<kTok>>{}));
  Tensor cDQrc = make_tensor(cDQ.data(), acc_rowcol(cDQ.layout()));

  // dk_idx of the keys so far (index key head loaded_ik) -> the fixed-point sums; then zero.
  int32_t loaded_ik = -1;
  auto flush_dk = [&]() {
    if (loaded_ik < 0) return;
    Tensor cDK = thr_dk.partition_C(make_identity_tensor(Shape<Int<kBlockN>, Int<kDim>>{}));
#pragma unroll
    for (int v = 0; v < size(tDKrDK); ++v) {
      const int row = get<0>(cDK(v)), col = get<1>(cDK(v));
      if (row < tile.count) add_fixed(p.dk_idx + ((key_row + row) * p.Hik + loaded_ik) * kDim + col, tDKrDK(v));
    }
    clear(tDKrDK);
  };

  int32_t ik_seg = -1, ik = -1;  // the segment of the last step and its index key head
#pragma unroll 1
  for (int64_t s = 0; s < steps; ++s) {
    const int st = static_cast<int>(s % kStages);
    const int buf = static_cast<int>(s & 1);
    Bar::wait(&ss.full[st], static_cast<uint32_t>((s / kStages) & 1));
    const EntryRecord* recs = ss.ring[s % kRing];
    const int n = records_of(s);
    // Every record of a step has the same index key head (step_records is 1 otherwise); it is
    // worked out where the segment changes.
    if (recs[0].seg != ik_seg) {
      ik_seg = recs[0].seg;
      ik = (r * ipk + ik_seg - list.seg0) / p.idx_per_key;
    }
    if (ik != loaded_ik) {  // the same for every consumer: (re)load the block's index keys
      sync_consumers();     // every product that reads the keys is done
      flush_dk();
      loaded_ik = ik;
      load_block_rows_async<kBlockN, kDim>(sKi, as<Element>(p.k_idx) + key_row * p.ki_s0 + ik * p.ki_s1, p.ki_s0,
                                           tile.count, tid, kConsumerThreads);
      cp_async_commit();
      cp_async_wait_all();
      cutlass::arch::fence_view_async_shared();
      sync_consumers();
    }

    clear(tSrSi);
    wg_gemm<true>(mma_si, tSrKi, thr_si.partition_fragment_B(stage_q_idx(st, typename Traits::SmemLayoutQi{})), tSrSi);
    warpgroup_wait<0>();
    // Student and dS = sigma - pi, in the index-score accumulator (columns: the step's tokens).
    // A step whose every column holds a token past the block's last key needs no mask.
    bool whole = n * m == kTok;
    for (int j = 0; j < n; ++j) whole = whole && recs[j].count == m && recs[j].tok[0] - key_base >= kBlockN - 1;
    const float scale_idx = p.scale_idx;
    if (whole) {
#pragma unroll
      for (int c = 0; c < kCols; ++c) {
        const int col = get<1>(cSirc(0, c));
        const float lidx = ss.lidx[st][col];
        const float* pi_col = ss.pi[st] + (col >> m_shift) * kBlockN * m + (col & (m - 1));
#pragma unroll
        for (int a = 0; a < kRows; ++a) {
          const int row = get<0>(cSirc(a, 0));
          const float lsig2 = (Si(a, c) * scale_idx - lidx) * static_cast<float>(M_LOG2E);
          Si(a, c) = fast_exp2(lsig2) - pi_col[row * m];
        }
      }
    } else {
#pragma unroll
      for (int c = 0; c < kCols; ++c) {
        const int col = get<1>(cSirc(0, c));
        const int j = col >> m_shift, t = col & (m - 1);
        // The column's last visible key row, -1 without a token (past the step's records too:
        // a stale teacher slot must not reach dS).
        const int64_t lim = j < n ? entry_last_row(recs[j], t, key_base) : -1;
        const float lidx = ss.lidx[st][col];
        const float* pi_col = ss.pi[st] + j * kBlockN * m + t;
#pragma unroll
        for (int a = 0; a < kRows; ++a) {
          const int row = get<0>(cSirc(a, 0));
          const bool ok = row <= lim;
          const float lsig2 = (Si(a, c) * scale_idx - lidx) * static_cast<float>(M_LOG2E);
          Si(a, c) = ok ? fast_exp2(lsig2) - pi_col[row * m] : 0.f;
        }
      }
    }
    convert_into(tSrSi, rDS);
    wg_gemm<false, true>(mma_dk, tDKrDS, thr_dk.partition_fragment_B(stage_q_idx(st, typename Traits::SmemLayoutQit{})), tDKrDK);
    // dS^T (tokens, keys) to shared memory for dq_idx^T = k_idx^T dS^T over all the block's keys.
    // (Two buffers: every consumer is past step s - 1's barrier, so done with step s - 2's.)
#pragma unroll
    for (int a = 0; a < kRows; ++a) {
      const int row = get<0>(cSirc(a, 0));
#pragma unroll
      for (int c = 0; c < kCols; ++c) sDS(get<1>(cSirc(a, c)), row, buf) = static_cast<Element>(Si(a, c));
    }
    cutlass::arch::fence_view_async_shared();
    sync_consumers();
    if (dq_thread) wg_gemm<true>(mma_dq, tDQrKit, tDQrDS(_, _, _, buf), tDQrDQ);
    warpgroup_wait<0>();  // dk_idx(s), dq_idx(s)
    Bar::arrive(&ss.empty[st]);  // the stage's rows are read
    // dq_idx^T to the producer's sums, through buffer s % 2 (free once step s - 2's are added).
    if (s >= 2) Bar::wait(&ss.dq_empty[buf], static_cast<uint32_t>(((s >> 1) - 1) & 1));
    if (dq_thread) {
      Tensor DQ = make_tensor(tDQrDQ.data(), acc_rowcol(tDQrDQ.layout()));
      float* dst = ss.dq[buf];
#pragma unroll
      for (int a = 0; a < size<0>(DQ); ++a)
#pragma unroll
        for (int c = 0; c < size<1>(DQ); ++c) dst[get<1>(cDQrc(a, c)) * kDqStride + get<0>(cDQrc(a, c))] = DQ(a, c);
    }
    Bar::arrive(&ss.dq_full[buf]);
  }
  flush_dk();
}

}  // namespace msa::cuda::kern
