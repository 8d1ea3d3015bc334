// Attention backward, KV side: dK = scale * sum dS^T Q and dV = sum P^T dO for one KV block,
// over every (token, head) whose support holds it.
//
// One CTA walks one chunk of the entry list of one KV block of one KV head (device/entry_list.cuh). An
// item with one chunk writes dK and dV directly; the chunks of a longer list write fp32 partial
// sums, and the last of them to finish adds them in chunk order and writes the result, so the
// result does not depend on scheduling and no floating-point atomics are used.
//
// The scores are computed transposed, with the keys as MMA rows: S^T = K Q^T and dP^T = V dO^T (SS wgmma, 64 keys per consumer warpgroup, 64 columns per entry;
// at Gi = 2 an entry step is two records of 16 tokens x 2 heads, BwdKVTraits::kRecs),
// which leaves P^T and dS^T in registers as the A operands of dV += P^T dO and dK += dS^T Q
// (RS wgmma).
//
// Warp roles: kBlockN / 64 consumer warpgroups (64 keys each, dK and dV in registers) and one
// producer warpgroup (few registers) that loads the block's K and V, then each entry's record,
// Q and dO columns, LSE and Delta (and q_idx, LSE_idx) into kStages shared-memory stages with
// cp.async. Pipelines: full[stage] (the producer's cp.async arrivals and the record's writers)
// and empty[stage] (every consumer thread, once its GEMMs and reads of the stage are done). The
// consumer warpgroups share no per-entry barrier and meet only where the KL branch's shared
// tiles need it (below). (Measured against the lockstep kernel before, with every thread
// loading: the same time; docs/perf.md, 2026-12-01.)
//
// With kKl the same pass also computes the KL gradient of the index branch (docs/contract.md §4) from the P^T
// it already holds:
//   teacher  pi(t, j)    = mean of P^T over index head i's Gi heads of token t (butterfly sums over
//                          the accumulator columns, in a fixed order: Gi is a power of two),
//   student  sigma(t, j) = exp(scale_idx * k_idx[j] . q_idx[t] - LSE_idx(t, i)) (S_idx^T, one
//                          more SS wgmma of 16 token columns),
//   dS_idx(t, j) = sigma - pi (gamma / (N Hi) is applied when the sums are finalised),
//   dq_idx[t] += k_idx^T dS_idx^T over the block's keys, per entry (SS wgmma; the warpgroups take
//                          turns, one entry late, through the ds_full / ds_empty barriers of the
//                          two dS_idx buffers),
//   dk_idx[j] += dS_idx^T q_idx, over batches of up to kBatch tokens kept in shared memory (the
//                          consumer warpgroups sync on Barrier::kConsumers around each flush).
// Each warpgroup loads its own 64 rows of k_idx. The dK and dV accumulators fill the register
// file, so dk_idx has no register home: a batch's product goes straight to the sums. Sums that
// cross CTAs are 64-bit fixed point (2^-32 units) added with integer atomics, so every run gives
// the same bits.
//
// dq from dS (Options.dq_pass = kFromDs, args ds set; kNone and kTeacher): each entry's dS, the
// values dK's product reads, also goes to the (token, index head, slot) tiles of the pass's tokens
// for bwd_dq_kernel.cuh, staged in shared memory (at Gi = 2, 4 and 16 by stmatrix into a
// swizzled tile, then written by 16-byte stores under the dV and dK products; at other Gi
// written by bulk copies). Passes of tokens (args dk_acc set): dK and dV are added to fp32
// sums instead of written.
//
// With kTeacher (Options.kl_pass = kTeacher, sparse mode) the pass computes only the teacher of
// the KL branch: pi of each entry (the butterfly sums above) goes from the warp's rows of the
// teacher tile to global memory, [record][key][m] fp32 (KvSideArgs::teacher), and the index
// branch's work is kernels/kl_grad_kernel.cuh's, a KV-side pass of its own that reads it. The
// main pass then keeps the stages and registers of the kernel without the KL branch.
#pragma once

#include <cute/tensor.hpp>
#include <cute/arch/copy_sm90.hpp>
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

using cuda::BwdKvArgs;

// What the pass computes of the KL branch: nothing, all of it (kFused), or its teacher (kTeacher).
enum class KvKl { kNone, kFused, kTeacher };

// With kFused, Di == kHeadDim. Entries in flight: 4, or 2 with the fused KL branch, whose tiles
// take the shared memory of two stages. kGi_: Gi (heads per index head) as a compile-time
// constant (a power of two >= 2; the launch picks it for the common head counts), or 0: Gi at
// run time. Each is its own kernel: one kernel's code paths for several Gi made ptxas spill.
// At Gi = 2 an entry of m = 16 tokens fills 32 of the 64 columns, so the kGi = 2 kernel takes
// two records a step (kRecs): columns 0-31 are the first's, 32-63 the second's (of the same KV
// block and head, perhaps of another index head), and the MMAs run full.
template <class Element_, int kHeadDim_, int kBlockN_, KvKl kMode_ = KvKl::kNone, int kGi_ = 0>
struct BwdKVTraits : KvSideTraits<Element_, kHeadDim_, kBlockN_, kMode_ == KvKl::kFused ? 2 : 4> {
  using Base = KvSideTraits<Element_, kHeadDim_, kBlockN_, kMode_ == KvKl::kFused ? 2 : 4>;
  using Element = Element_;
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kBlockN = kBlockN_;
  static constexpr bool kKl = kMode_ == KvKl::kFused;
  static constexpr bool kTeacher = kMode_ == KvKl::kTeacher;
  static constexpr bool kHeadMean = kKl || kTeacher;  // the teacher tile and its butterfly sums
  static constexpr int kGi = kGi_;
  static_assert(kGi == 0 || (!kKl && kGi >= 2 && (kGi & (kGi - 1)) == 0 && kGi <= 64),
                "a constant Gi is a power of two >= 2, without the fused KL branch");
  static constexpr int kRecs = kGi == 2 ? 2 : 1;  // records per entry step (see above)
  static_assert(kRecs == 1 || kEntryTokens * 2 * kRecs == 64, "two records of 16 tokens x 2 heads");
  static constexpr int kBatch = 64;  // tokens of a dk_idx batch
  static constexpr int kBlockC = Base::kBlockC, kTok = Base::kTok, kStages = Base::kStages;
  static constexpr int kWarpGroups = Base::kWarpGroups;  // consumers
  static constexpr int kConsumerThreads = Base::kThreads;
  static constexpr int kThreads = kConsumerThreads + 128;  // and the producer warpgroup
  // Registers per thread after setmaxnreg with two consumer warpgroups: a 384-thread CTA holds
  // 168 x 384 of them, and 24 x 128 + 240 x 256 is exactly that (ask for more and the consumers'
  // setmaxnreg.inc waits forever). One consumer warpgroup (Bk 64) needs no setmaxnreg.
  static constexpr int kProducerRegs = 24, kConsumerRegs = 240;
  static constexpr int kLaunchRegs = 65536 / kThreads / 8 * 8;  // what the launch bounds grant
  static_assert(kWarpGroups == 1 ||
                    kProducerRegs * 128 + kConsumerRegs * kConsumerThreads <= kLaunchRegs * kThreads,
                "setmaxnreg asks for more registers than the CTA holds");
  static constexpr int kRing = 2 * kStages * kRecs;  // entry records in shared memory
  // Lanes per warp that issue an entry's bulk dS copies (a token each: four warps).
  static constexpr int kDsIssuers = kEntryTokens * kRecs / 4;
  using typename Base::SmemLayoutK;
  using typename Base::SmemLayoutQ;
  using typename Base::SmemLayoutQi;

  // dV += P^T dO and dK += dS^T Q (RS): Q and dO as the (D, columns) B operand, MN-major.
  using TileKV = Shape<Int<kBlockN>, Int<kHeadDim>, Int<kBlockC>>;
  using MmaKV = decltype(make_tiled_mma(
      GMMA::rs_op_selector<Element, Element, float, TileKV, GMMA::Major::K, GMMA::Major::MN>(),
      Layout<Shape<Int<kWarpGroups>, _1, _1>>{}));
  using SmemLayoutQt = decltype(composition(
      SmemLayoutQ{},
      make_ordered_layout(Shape<Int<kHeadDim>, Int<kBlockC>, Int<kStages>>{}, Step<_2, _1, _3>{})));

  // The KL branch: dk_idx = dS_idx^T q_idx over batches of kBatch tokens.
  static constexpr int kDkCols = 64;  // dk_idx columns per flush GEMM (its accumulator is transient)
  using TileDKi = Shape<Int<kBlockN>, Int<kDkCols>, Int<kBatch>>;
  using MmaDKi = decltype(make_tiled_mma(
      GMMA::ss_op_selector<Element, Element, float, TileDKi, GMMA::Major::K, GMMA::Major::MN>(),
      Layout<Shape<Int<kWarpGroups>, _1, _1>>{}));
  using SmemAtomQb = decltype(cutlass::gemm::collective::detail::ss_smem_selector<
                              GMMA::Major::K, Element, Int<kBatch>, Int<kHeadDim>>());
  using SmemLayoutQb = decltype(tile_to_shape(SmemAtomQb{}, Shape<Int<kBatch>, Int<kHeadDim>>{}));
  using SmemLayoutQbt = decltype(composition(
      SmemLayoutQb{}, make_ordered_layout(Shape<Int<kHeadDim>, Int<kBatch>>{}, Step<_2, _1>{})));
  // dS_idx^T of a batch: (keys, tokens), tokens contiguous.
  using SmemAtomDSb = decltype(cutlass::gemm::collective::detail::ss_smem_selector<
                               GMMA::Major::K, Element, Int<kBlockN>, Int<kBatch>>());
  using SmemLayoutDSb = decltype(tile_to_shape(SmemAtomDSb{}, Shape<Int<kBlockN>, Int<kBatch>>{}));
  // dS_idx of the last two entries (dq_idx runs one entry late).
  using SmemLayoutDS = decltype(tile_to_shape(typename Base::SmemAtomDS{}, Shape<Int<kTok>, Int<kBlockN>, _2>{}));
  static constexpr int kTeacherStride = kTok + 4;
  // dq_idx^T = k_idx^T dS_idx^T over the block's keys, by one warpgroup, 64 rows of D at a time.
  using TileDQ = Shape<_64, Int<kTok>, Int<kBlockN>>;
  using MmaDQ = decltype(make_tiled_mma(
      GMMA::ss_op_selector<Element, Element, float, TileDQ, GMMA::Major::MN, GMMA::Major::K>(),
      Layout<Shape<_1, _1, _1>>{}));

  // The KL branch's tiles; one element each without kKl (never touched then), but the teacher
  // tile with kTeacher too.
  // (kRecs = 2 writes the teacher from registers: no tile.)
  static constexpr int kl_size(int n) { return kKl ? n : 1; }
  static constexpr int teacher_size(int n) { return kHeadMean && kRecs == 1 ? n : 1; }
  static constexpr int kKlAlign = kKl ? 1024 : 16;  // the swizzled tiles' alignment, where used
  struct KlStorage {
    alignas(kKlAlign) cute::array_aligned<Element, kl_size(cosize_v<SmemLayoutK>)> k_idx;
    alignas(kKlAlign) cute::array_aligned<Element, kl_size(cosize_v<SmemLayoutQi>)> q_idx;
    alignas(kKlAlign) cute::array_aligned<Element, kl_size(cosize_v<SmemLayoutQb>)> q_batch;
    alignas(kKlAlign) cute::array_aligned<Element, kl_size(cosize_v<SmemLayoutDSb>)> ds_batch;
    alignas(kKlAlign) cute::array_aligned<Element, kl_size(cosize_v<SmemLayoutDS>)> ds;
    float teacher[teacher_size(kBlockN * kTeacherStride)];
    float lidx[kStages][kl_size(kTok)];  // LSE_idx per token
  };

  struct SharedStorage {
    KlStorage kl;
    alignas(1024) cute::array_aligned<Element, cosize_v<SmemLayoutK>> k;
    alignas(1024) cute::array_aligned<Element, cosize_v<SmemLayoutK>> v;
    alignas(1024) cute::array_aligned<Element, cosize_v<SmemLayoutQ>> q;
    alignas(1024) cute::array_aligned<Element, cosize_v<SmemLayoutQ>> dout;
    // dq from dS: each consumer warpgroup's dS of one entry (its 64 keys), staged for the copies
    // to the tokens' tiles: DsStage's swizzled rows at Gi = 2, 4 and 16, else [token][key][head]
    // for bulk copies (none with the fused KL branch: no room).
    alignas(128) Element ds_stage[kKl ? 8 : kWarpGroups * 64 * kBlockC];
    float lse[kStages][kBlockC];   // LSE (natural log) per column
    float delta[kStages][kBlockC];  // rowsum(dO * O) per column
    EntryRecord ring[kRing];
    uint64_t full[kStages], empty[kStages];  // the entry stages
    uint64_t kv_full;                        // K and V of the block
    uint64_t ds_full[2], ds_empty[2];        // kKl: the two dS_idx tiles of dq_idx
  };
};

template <class Traits>
struct BwdKVParams : BwdKvArgs {};

// A consumer warpgroup's staging tile of an entry's dS (dq from dS), where Gi is a constant the
// tile's rows suit: 64 columns (token, head) x the warpgroup's 64 keys, 8 KB, in the order of
// the tokens' tiles (BwdKvArgs::ds: [token][head][key] at Gi = 2 and 4, [token][key][head] at
// Gi = 16), as 64 rows of 128 bytes, each in 16-byte chunks. Chunk c of row `line` lies at
// chunk c ^ (line & kSwizzle), so that both sides are free of bank conflicts:
//   write  the thread's dS^T registers (u[2 j + a]: columns 8 j + 2 q, + 1 of key row
//          16 warp + lane / 4 + 8 a, q = lane % 4) by stmatrix, an 8 x 8 piece (8 keys x 8
//          columns) a matrix: transposed at Gi = 2 and 4 (a row is a column's 8 keys), plain at
//          Gi = 16 (a row is a key's 8 heads); a piece's 8 rows fall in 8 distinct chunks;
//   read   16-byte chunk U = ltid + 128 i (i < 4) of the tile in order: token U / (8 Gi), at
//          element (U % (8 Gi)) * 8 of the token's tile (its warpgroup's half); a warp reads
//          four whole rows, 512 contiguous bytes of one or two tokens' tiles.
// (The 2-byte and 4-byte stores of the tile in plain order conflicted 2-way, and the
// conflict-free order tried on 2026-12-04 made bwd_dq's reads slower: docs/perf.md.)
template <int kGi>
struct DsStage {
  static constexpr bool kSupported = kGi == 2 || kGi == 4 || kGi == 16;
  static constexpr bool kTrans = kGi <= 4;
  static constexpr int kGiShift = log2_pow2(kGi);
  static constexpr int kSwizzle = kTrans ? 7 : 1;  // 8 rows of a piece: 8 lines, or 2 of 4 keys each

  __device__ __forceinline__ static int chunk_offset(int line, int c) { return line * 128 + ((c ^ (line & kSwizzle)) << 4); }

  __device__ __forceinline__ static void write(char* stage, const uint32_t* u, int ltid) {
    const int lane = ltid & 31, warp = ltid >> 5, x = lane >> 3, r8 = lane & 7;
    // Lane l gives the address of row l % 8 of piece x = l / 8 of step s's four: columns
    // 8 (2 s + x / 2) + [0, 8) at keys 16 warp + 8 (x % 2) + [0, 8), register u[4 s + x].
#pragma unroll
    for (int s = 0; s < 4; ++s) {
      if constexpr (kTrans) {
        // The row of column col: its keys 8 (2 warp + x % 2) + [0, 8), chunk 2 warp + x % 2.
        const int col = 8 * (2 * s + (x >> 1)) + r8;
        auto& dst = *reinterpret_cast<cute::uint128_t*>(stage + chunk_offset(col, 2 * warp + (x & 1)));
        cute::SM90_U16x8_STSM_T::copy(u[4 * s], u[4 * s + 1], u[4 * s + 2], u[4 * s + 3], dst);
      } else {
        // Gi = 16: the row of key k, token s, heads 8 (x / 2) + [0, 8): line 16 s + k / 4,
        // chunk 2 (k % 4) + x / 2.
        const int key = 16 * warp + 8 * (x & 1) + r8;
        auto& dst = *reinterpret_cast<cute::uint128_t*>(stage + chunk_offset(16 * s + (key >> 2), 2 * (key & 3) + (x >> 1)));
        cute::SM90_U32x4_STSM_N::copy(u[4 * s], u[4 * s + 1], u[4 * s + 2], u[4 * s + 3], dst);
      }
    }
  }

  // Chunk i of the thread's four: its token in the entry step, its element in the token's tile
  // half, and its 16 bytes.
  __device__ __forceinline__ static int token(int ltid, int i) { return (ltid + 128 * i) >> (3 + kGiShift); }
  __device__ __forceinline__ static int element(int ltid, int i) { return ((ltid + 128 * i) & (8 * kGi - 1)) * 8; }
  __device__ __forceinline__ static uint4 read(const char* stage, int ltid, int i) {
    const int U = ltid + 128 * i;
    return *reinterpret_cast<const uint4*>(stage + chunk_offset(U >> 3, U & 7));
  }
};

// Warp roles, pipelines and work: see the top of the file. Consumer warpgroups are 0 ..
// kWarpGroups - 1 (thread index = MMA thread index), the producer is the last warpgroup.
template <class Traits>
__global__ void __launch_bounds__(Traits::kThreads, 1)
    bwd_kv_kernel(const __grid_constant__ BwdKVParams<Traits> p) {
  grid_dependency_begin();
  using Element = typename Traits::Element;
  using Bar = cutlass::arch::ClusterBarrier;
  constexpr int kBlockN = Traits::kBlockN, kBlockC = Traits::kBlockC, kHeadDim = Traits::kHeadDim;
  constexpr int kConsumerThreads = Traits::kConsumerThreads, kStages = Traits::kStages;
  constexpr int kRing = Traits::kRing;
  constexpr int kTok = Traits::kTok, kRecs = Traits::kRecs;
  using SharedStorage = typename Traits::SharedStorage;

  extern __shared__ __align__(1024) char smem_raw[];
  SharedStorage& ss = *reinterpret_cast<SharedStorage*>(smem_raw);

  __shared__ int32_t last_chunk;
  KvChunk work;
  if (!work.find<kBlockN, Traits::kTeacher>(p)) return;
  const QueryTile& tile = work.tile;
  const EntryList& list = work.list;
  const int64_t e_begin = work.begin, e_end = work.end, key_row = work.key_row, key_base = work.key_base;
  const int32_t r = work.it.r;
  const int tid = threadIdx.x;
  const int32_t Gi = p.heads_per_idx, m = p.group_tokens, ipk = p.idx_per_kv;

  constexpr int kWriters = EntryList::kRecordWriters;  // per record
  constexpr uint32_t kFullArrivals = 128 + kRecs * kWriters;
  if (tid == 0) {
    for (int st = 0; st < kStages; ++st) {
      Bar::init(&ss.full[st], kFullArrivals);
      Bar::init(&ss.empty[st], kConsumerThreads);
    }
    Bar::init(&ss.kv_full, 128);
    for (int b = 0; b < 2; ++b) {
      Bar::init(&ss.ds_full[b], kConsumerThreads);
      Bar::init(&ss.ds_empty[b], 128);
    }
  }
  cutlass::arch::fence_barrier_init();
  __syncthreads();

  Tensor sK = make_tensor(make_smem_ptr(ss.k.data()), typename Traits::SmemLayoutK{});
  Tensor sV = make_tensor(make_smem_ptr(ss.v.data()), typename Traits::SmemLayoutK{});
  Tensor sQ = make_tensor(make_smem_ptr(ss.q.data()), typename Traits::SmemLayoutQ{});
  Tensor sQi = make_tensor(make_smem_ptr(ss.kl.q_idx.data()), typename Traits::SmemLayoutQi{});

  // ---- Producer warpgroup: the block's K and V, then every entry's record and rows. ----------
  if (tid >= kConsumerThreads) {
    if constexpr (Traits::kWarpGroups > 1) cutlass::arch::warpgroup_reg_dealloc<Traits::kProducerRegs>();
    const int pt = tid - kConsumerThreads;
    // K and V of the block; keys past the sequence end are zero rows.
    load_block_rows_async<kBlockN, kHeadDim>(
        sK, as<Element>(p.k) + key_row * p.k_s0 + r * p.k_s1, p.k_s0, tile.count, pt, 128);
    load_block_rows_async<kBlockN, kHeadDim>(
        sV, as<Element>(p.v) + key_row * p.v_s0 + r * p.v_s1, p.v_s0, tile.count, pt, 128);
    cutlass::arch::cpasync_barrier_arrive_noinc(&ss.kv_full);

    constexpr int kStageElems = kBlockC * kHeadDim;
#pragma unroll 1
    for (int64_t e = e_begin; e < e_end; e += kRecs) {
      const int32_t i = static_cast<int32_t>((e - e_begin) / kRecs);
      const int st = i % kStages;
      if (i >= kStages) Bar::wait(&ss.empty[st], static_cast<uint32_t>((i / kStages - 1) & 1));
      EntryRecord* recs = ss.ring + (i * kRecs) % kRing;
      {  // record e + h by producer threads [h kWriters, (h + 1) kWriters); none past the chunk
        const int h = pt / kWriters, rt = pt % kWriters;
        if (h < kRecs) {
          if (e + h < e_end) {
            list.write_record(p.list, e + h, &recs[h], rt, list.record_chunk(p.list, e + h, rt));
          } else if (rt == 0) {
            recs[h].count = 0;
            recs[h].seg = list.seg0;
          }
        }
      }
      cutlass::arch::NamedBarrier::sync(128, static_cast<uint32_t>(Barrier::kProducer));
      const EntryRecord& en = recs[0];
      const int32_t count = en.count;
      const int32_t head0 = (r * ipk + en.seg - list.seg0) * Gi;
      const ColumnLoader<kHeadDim, 128> cols(sQ(_, _, 0), Gi, pt);
      if constexpr (kRecs == 1) {
        cols.load_two(ss.q.data() + st * kStageElems, as<Element>(p.q) + head0 * p.q_s1, p.q_s0, p.q_s1,
                      ss.dout.data() + st * kStageElems, as<Element>(p.dout) + head0 * p.do_s1,
                      p.do_s0, p.do_s1, en.tok, count);
      } else {
        const int32_t head1 = (r * ipk + recs[1].seg - list.seg0) * Gi;
        cols.load_two_halves(ss.q.data() + st * kStageElems, as<Element>(p.q), p.q_s0, p.q_s1,
                             ss.dout.data() + st * kStageElems, as<Element>(p.dout), p.do_s0, p.do_s1,
                             kEntryTokens, en.tok, count, head0, recs[1].tok, recs[1].count, head1);
      }
      if (pt < kBlockC) {
        // Column c: record c / (m Gi) of the step, its token and head.
        const int c = pt;
        const EntryRecord& er = recs[kRecs == 1 ? 0 : c / (kEntryTokens * 2)];
        const int cc = kRecs == 1 ? c : c % (kEntryTokens * 2);
        const int32_t tok = cc / Gi;
        const bool ok = tok < er.count && cc < m * Gi;
        const int64_t tk = ok ? er.tok[tok] : 0;
        const int32_t h = (kRecs == 1 ? head0 : (r * ipk + er.seg - list.seg0) * Gi) + (ok ? cc - tok * Gi : 0);
        cp_async4(&ss.lse[st][c], p.lse + tk * p.lse_s0 + h * p.lse_s1, ok);
        cp_async4(&ss.delta[st][c], p.delta + tk * p.Hq + h, ok);
      }
      if constexpr (Traits::kKl) {
        const int32_t ih = head0 / Gi;
        const Element* qi = as<Element>(p.q_idx) + ih * p.qi_s1;
        load_rows_async<kTok, kHeadDim>(
            sQi(_, _, st),
            [&](int row) { return row < count ? qi + int64_t(en.tok[row]) * p.qi_s0 : nullptr; },
            pt, 128);
        if (pt >= kBlockC && pt < kBlockC + kTok) {
          const int c = pt - kBlockC;
          const bool ok = c < count;
          cp_async4(&ss.kl.lidx[st][c], p.lse_idx + int64_t(ok ? en.tok[c] : 0) * p.Hi + ih, ok);
        }
      }
      cutlass::arch::cpasync_barrier_arrive_noinc(&ss.full[st]);
      if (pt < kRecs * kWriters) Bar::arrive(&ss.full[st]);
    }
    cp_async_wait_all();
    return;
  }

  // ---- Consumer warpgroups. -------------------------------------------------------------------
  if constexpr (Traits::kWarpGroups > 1) cutlass::arch::warpgroup_reg_alloc<Traits::kConsumerRegs>();
  const int wg = tid / 128;
  auto sync_consumers = [] {
    cutlass::arch::NamedBarrier::sync(kConsumerThreads, static_cast<uint32_t>(Barrier::kConsumers));
  };
  Tensor sdO = make_tensor(make_smem_ptr(ss.dout.data()), typename Traits::SmemLayoutQ{});
  Tensor sQt = make_tensor(make_smem_ptr(ss.q.data()), typename Traits::SmemLayoutQt{});
  Tensor sdOt = make_tensor(make_smem_ptr(ss.dout.data()), typename Traits::SmemLayoutQt{});
  // The KL branch's tiles (unused without kKl).
  Tensor sKi = make_tensor(make_smem_ptr(ss.kl.k_idx.data()), typename Traits::SmemLayoutK{});
  Tensor sKit = make_tensor(make_smem_ptr(ss.kl.k_idx.data()), typename Traits::SmemLayoutKt{});
  Tensor sQb = make_tensor(make_smem_ptr(ss.kl.q_batch.data()), typename Traits::SmemLayoutQb{});
  Tensor sQbt = make_tensor(make_smem_ptr(ss.kl.q_batch.data()), typename Traits::SmemLayoutQbt{});
  Tensor sDSb = make_tensor(make_smem_ptr(ss.kl.ds_batch.data()), typename Traits::SmemLayoutDSb{});
  Tensor sDS = make_tensor(make_smem_ptr(ss.kl.ds.data()), typename Traits::SmemLayoutDS{});
  // The same tiles for scalar and 16-byte accesses: the swizzle acts on element offsets, so
  // each access is a 32-bit shared-memory one (GEMM operands keep the tensors above).
  Tensor sQiE = as_position_independent_swizzle_tensor(sQi);
  Tensor sQbE = as_position_independent_swizzle_tensor(sQb);
  Tensor sDSbE = as_position_independent_swizzle_tensor(sDSb);
  Tensor sDSE = as_position_independent_swizzle_tensor(sDS);

  if constexpr (Traits::kKl) {
    // The batch tiles start (and after each flush, dS_idx restarts) at zero: columns past the
    // batch's tokens then add nothing.
    const uint4 zero = make_uint4(0, 0, 0, 0);
    for (int e = tid; e < cosize_v<typename Traits::SmemLayoutQb> / 8; e += kConsumerThreads)
      reinterpret_cast<uint4*>(ss.kl.q_batch.data())[e] = zero;
    for (int e = tid; e < cosize_v<typename Traits::SmemLayoutDSb> / 8; e += kConsumerThreads)
      reinterpret_cast<uint4*>(ss.kl.ds_batch.data())[e] = zero;
    sync_consumers();
  }

  typename Traits::MmaS mma_s;
  typename Traits::MmaKV mma_kv;
  auto thr_s = mma_s.get_thread_slice(tid);
  auto thr_kv = mma_kv.get_thread_slice(tid);
  Tensor tSrK = thr_s.partition_fragment_A(sK);
  Tensor tSrV = thr_s.partition_fragment_A(sV);
  Tensor tSrQ = thr_s.partition_fragment_B(sQ);
  Tensor tSrdO = thr_s.partition_fragment_B(sdO);
  Tensor tKVrQt = thr_kv.partition_fragment_B(sQt);
  Tensor tKVrdOt = thr_kv.partition_fragment_B(sdOt);
  Tensor tSrS = partition_fragment_C(mma_s, Shape<Int<kBlockN>, Int<kBlockC>>{});
  Tensor tSrdP = partition_fragment_C(mma_s, Shape<Int<kBlockN>, Int<kBlockC>>{});
  Tensor tdKrdK = partition_fragment_C(mma_kv, Shape<Int<kBlockN>, Int<kHeadDim>>{});
  Tensor tdVrdV = partition_fragment_C(mma_kv, Shape<Int<kBlockN>, Int<kHeadDim>>{});
  clear(tdKrdK);
  clear(tdVrdV);

  Tensor cS = thr_s.partition_C(make_identity_tensor(Shape<Int<kBlockN>, Int<kBlockC>>{}));
  Tensor S = make_tensor(tSrS.data(), acc_rowcol(tSrS.layout()));
  Tensor dP = make_tensor(tSrdP.data(), acc_rowcol(tSrdP.layout()));
  Tensor cSrc = make_tensor(cS.data(), acc_rowcol(cS.layout()));
  constexpr int kRows = decltype(size<0>(S))::value;
  constexpr int kCols = decltype(size<1>(S))::value;
  // A column's token, col / Gi: a shift where Gi is a power of two (kHeadMean), else
  // (col * ceil(2^16 / Gi)) >> 16, exact for col < 64 and Gi < 1024 (the error col * (ceil - 2^16
  // / Gi) / 2^16 stays under 1 / Gi); one register either way.
  const int gi_shift = __ffs(Gi) - 1;
  const int32_t gi_inv = (65536 + Gi - 1) / Gi;

  Tensor rP = make_tensor<Element>(tSrS.layout());
  Tensor rdS = make_tensor<Element>(tSrS.layout());
  Tensor tKVrP = make_tensor(rP.data(), acc_as_a_operand(rP.layout()));
  Tensor tKVrdS = make_tensor(rdS.data(), acc_as_a_operand(rdS.layout()));

  // The KL branch's GEMMs (unused without kKl).
  typename Traits::MmaSi mma_si;
  typename Traits::MmaDQ mma_dq;
  typename Traits::MmaDKi mma_dki;
  auto thr_si = mma_si.get_thread_slice(tid);
  Tensor tSrKi = thr_si.partition_fragment_A(sKi);
  Tensor tSrQi = thr_si.partition_fragment_B(sQi);
  Tensor tSrSi = partition_fragment_C(mma_si, Shape<Int<kBlockN>, Int<kTok>>{});
  Tensor Si = make_tensor(tSrSi.data(), acc_rowcol(tSrSi.layout()));
  constexpr int kColsI = decltype(size<1>(Si))::value;
  const float inv_gi = 1.f / static_cast<float>(Gi);
  int32_t loaded_ik = -1;  // index key head in sKi
  int32_t nb = 0;          // tokens in the dk_idx batch
  int32_t uses = 0;        // entries whose dS_idx went to a dS_idx tile (tile uses & 1)

  // dk_idx += dS_idx^T q_idx over the batch (this warpgroup's keys), to the fixed-point sums;
  // then the batch restarts. Every consumer thread calls it at the same entry; it starts and
  // ends with a sync of the consumers (the batch tiles are complete; then free to write again).
  auto flush_batch = [&]() {
    if constexpr (Traits::kKl) {
      if (nb == 0) return;
      cutlass::arch::fence_view_async_shared();
      sync_consumers();
      const int ltid = fresh_thread_index();
      auto thr_dki = mma_dki.get_thread_slice(ltid);
      constexpr int kDkCols = Traits::kDkCols;
      Tensor tDKrDSb = thr_dki.partition_fragment_A(sDSb);
      unsigned long long* dst = p.dk_idx + ((key_row * p.Hik) + loaded_ik) * kHeadDim;
#pragma unroll 1
      for (int h = 0; h < kHeadDim / kDkCols; ++h) {
        Tensor tDKrQbt = thr_dki.partition_fragment_B(
            local_tile(sQbt, Shape<Int<kDkCols>, Int<Traits::kBatch>>{}, make_coord(h, 0)));
        Tensor acc = partition_fragment_C(mma_dki, Shape<Int<kBlockN>, Int<kDkCols>>{});
        wg_gemm<true>(mma_dki, tDKrDSb, tDKrQbt, acc);
        warpgroup_wait<0>();
        Tensor cDK = thr_dki.partition_C(make_identity_tensor(Shape<Int<kBlockN>, Int<kDkCols>>{}));
#pragma unroll
        for (int v = 0; v < size(acc); ++v) {
          const int row = get<0>(cDK(v)), col = h * kDkCols + get<1>(cDK(v));
          if (row < tile.count) add_fixed(dst + int64_t(row) * p.Hik * kHeadDim + col, acc(v));
        }
      }
      // This warpgroup's rows of dS_idx^T back to zero.
      const int wg_row0 = (ltid / 128) * 64;
      constexpr int kRowChunks = Traits::kBatch / 8;
      for (int e = ltid % 128; e < 64 * kRowChunks; e += 128) {
        const int row = wg_row0 + e / kRowChunks, c = e % kRowChunks;
        *reinterpret_cast<uint4*>(&sDSbE(row, c * 8)) = make_uint4(0, 0, 0, 0);
      }
      nb = 0;
      sync_consumers();
    }
  };

  // dq_idx^T = k_idx^T dS_idx^T of a finished entry (its dS_idx tile complete: ds_full), to
  // the fixed-point sums, by one warpgroup: the warpgroups take the entries in turn, each one
  // entry late (after its next entry's GEMMs), and free the tile (ds_empty).
  int32_t dq_use = -1;  // the pending entry's use of a dS_idx tile (-1: none)
  int32_t dq_entry = 0;  // its position in the chunk
  auto run_dq = [&]() {
    if constexpr (Traits::kKl) {
      if (dq_use < 0) return;
      const int buf = dq_use & 1;
      if (Traits::kWarpGroups == 1 || buf == wg) {
        const EntryRecord& pe = ss.ring[dq_entry % kRing];
        Bar::wait(&ss.ds_full[buf], static_cast<uint32_t>((dq_use >> 1) & 1));
        auto thr_dq = mma_dq.get_thread_slice(fresh_thread_index() % 128);
        Tensor tDQrDS = thr_dq.partition_fragment_B(sDS(_, _, buf));
        const int32_t ih = r * ipk + pe.seg - list.seg0;  // index head
        // 64 of the D rows at a time (a transient accumulator of 8 registers).
#pragma unroll 1
        for (int h = 0; h < kHeadDim / 64; ++h) {
          Tensor tDQrKit = thr_dq.partition_fragment_A(
              local_tile(sKit, Shape<_64, Int<kBlockN>>{}, make_coord(h, 0)));
          Tensor acc = partition_fragment_C(mma_dq, Shape<_64, Int<kTok>>{});
          wg_gemm<true>(mma_dq, tDQrKit, tDQrDS, acc);
          warpgroup_wait<0>();
          if (h == kHeadDim / 64 - 1) Bar::arrive(&ss.ds_empty[buf]);
          Tensor cDQ = thr_dq.partition_C(make_identity_tensor(Shape<_64, Int<kTok>>{}));
#pragma unroll
          for (int v = 0; v < size(acc); ++v) {
            const int d = h * 64 + get<0>(cDQ(v)), t = get<1>(cDQ(v));
            if (entry_selects(pe, t))
              add_fixed(p.dq_idx + (int64_t(pe.tok[t]) * p.Hi + ih) * kHeadDim + d, acc(v));
          }
        }
      }
      dq_use = -1;
    }
  };

  // The columns of this thread's accumulator elements: element (a, c) is at row a of the
  // thread's two and column col0 + 8 (c / 2) + c % 2, col0 = 2 (lane % 4); a column is token
  // col / Gi, head col % Gi of the entry. The per-entry work below takes Gi as kG = Traits::kGi
  // where the launch made it a constant (the common head counts), so that a column's token and
  // head are constant offsets from per-thread bases; kG = 0: Gi at run time.

  // The dS tiles of an entry (dq from dS; see the loop).
  // Where Gi is 2, 4 or 16 (the launch's constant instances) the staging tile is DsStage's:
  // written from the registers by stmatrix (stage_ds_rows, before the GEMMs take them) and
  // copied to the tokens' tiles by 16-byte stores (store_ds, after the dV and dK products are
  // issued, under them). The tile is free again once every thread of the warpgroup has passed
  // the next entry's first barrier.
  using Stage = DsStage<Traits::kGi>;
  constexpr bool kDsRows = Stage::kSupported;
  auto stage_ds_rows = [&]() {
    const int ltid = fresh_thread_index() % 128;
    cutlass::arch::NamedBarrier::sync(128, static_cast<uint32_t>(Barrier::kWarpGroup) + wg);
    Stage::write(reinterpret_cast<char*>(ss.ds_stage + wg * 64 * kBlockC), reinterpret_cast<const uint32_t*>(rdS.data()),
                 ltid);
    cutlass::arch::NamedBarrier::sync(128, static_cast<uint32_t>(Barrier::kWarpGroup) + wg);
  };
  auto store_ds = [&](const EntryRecord* recs) {
    const int ltid = fresh_thread_index() % 128;
    const char* stage = reinterpret_cast<const char*>(ss.ds_stage + wg * 64 * kBlockC);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int t = Stage::token(ltid, i);  // kRecs = 2: token t % 16 of record t / 16
      const EntryRecord& en = recs[kRecs == 1 ? 0 : t / kEntryTokens];
      const int tt = kRecs == 1 ? t : t % kEntryTokens;
      if (tt < en.count) {
        const uint4 v = Stage::read(stage, ltid, i);
        const int32_t ih = r * ipk + en.seg - list.seg0;
        *reinterpret_cast<uint4*>(
            as<Element>(p.ds) +
            ((((en.tok[tt] - p.ds_tok_lo) * p.Hi + ih) * p.top_k + en.slot[tt]) * kBlockN + 64 * wg) * Traits::kGi +
            Stage::element(ltid, i)) = v;
      }
    }
  };
  // At other Gi (Gi at run time) the dS tiles of entry en go this way: rdS (u[2j + a]: columns 8j + 2q,
  // 8j + 2q + 1 of row half a, q = lane % 4) into this warpgroup's staging tile as [token][key]
  // [head] (Gi = 2 and 4: [token][head][key], args.h's BwdKvArgs::ds), then one bulk copy per
  // token to its tile (the warpgroup's 64 keys of it): token t by lane t / 4 of warp t % 4, so
  // that no thread issues more than one copy per entry (an entry step holds up to 16 tokens, 32
  // with kRecs = 2: token t is then token t % 16 of record t / 16). The tile is free again once
  // the copies issued for the entry before have read it (each issuing thread waits for its
  // own). Gi is a power of two >= 2.
  auto stage_ds = [&](const EntryRecord* recs) {
    constexpr int kG = Traits::kGi;
    const int gs = kG > 0 ? log2_pow2(kG) : gi_shift;
    const int g = 1 << gs;
    const int ltid = fresh_thread_index() % 128, lane = ltid & 31, col0 = 2 * (lane & 3);
    Element* stage = ss.ds_stage + wg * 64 * kBlockC;
    const uint32_t* u = reinterpret_cast<const uint32_t*>(rdS.data());
    static_assert(Traits::kDsIssuers <= 8, "a token per issuing lane of four warps");
    const bool issuer = lane < Traits::kDsIssuers;
    if (issuer) tma_store_wait<0>();
    cutlass::arch::NamedBarrier::sync(128, static_cast<uint32_t>(Barrier::kWarpGroup) + wg);
    static_assert(kCols == 16, "an entry's 64 columns: 8 chunks of 8 per thread row");
    // Column 8j + col0 (col0 < 8): for g <= 8 token col0 / g + j (8 / g), head col0 % g; for
    // g >= 8 token 8j / g, head col0 + 8j % g.
    const int key0 = 16 * (ltid >> 5) + (lane >> 2);
    if (g <= 4) {
      // [token][head][key]: column 8j + col0 is token 8j / g + col0 / g, head col0 % g (Gi = 2:
      // token 4j + col0 / 2, head 0); the pair's two heads are 64 keys apart.
      uint16_t* base4 = reinterpret_cast<uint16_t*>(stage) + ((col0 >> gs) * g + (col0 & (g - 1))) * 64 + key0;
#pragma unroll
      for (int j = 0; j < 8; ++j) {
#pragma unroll
        for (int a = 0; a < 2; ++a) {
          const uint32_t w = u[2 * j + a];
          uint16_t* d = base4 + j * 8 * 64 + 8 * a;
          d[0] = static_cast<uint16_t>(w & 0xffffu);
          d[64] = static_cast<uint16_t>(w >> 16);
        }
      }
    } else {
      Element* base = stage + (((g <= 8 ? (col0 >> gs) * 64 : 0) + key0) << gs) + (col0 & (g - 1));
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        const int t = g <= 8 ? j * (8 >> gs) : (8 * j) >> gs;
        const int head = g <= 8 ? 0 : (8 * j) & (g - 1);
#pragma unroll
        for (int a = 0; a < 2; ++a)
          *reinterpret_cast<uint32_t*>(base + ((t * 64 + 8 * a) << gs) + head) = u[2 * j + a];
      }
    }
    cutlass::arch::fence_view_async_shared();
    cutlass::arch::NamedBarrier::sync(128, static_cast<uint32_t>(Barrier::kWarpGroup) + wg);
    const int t = lane * 4 + (ltid >> 5);
    const EntryRecord& en = recs[kRecs == 1 ? 0 : t / kEntryTokens];
    const int tt = kRecs == 1 ? t : t % kEntryTokens;
    if (issuer && tt < en.count) {
      const int32_t ih = r * ipk + en.seg - list.seg0;
      const int32_t bytes = 64 * g * static_cast<int32_t>(sizeof(Element));
      SM90_BULK_COPY_S2G::copy(stage + t * 64 * g,
                               as<Element>(p.ds) +
                                   ((((en.tok[tt] - p.ds_tok_lo) * p.Hi + ih) * p.top_k + en.slot[tt]) * kBlockN +
                                    64 * wg) * g,
                               bytes);
      tma_store_arrive();
    }
  };

  // The teacher of entry i (kHeadMean): the mean of P (in S) over each token's Gi columns, by
  // butterfly sums, into this warp's rows of the teacher tile; with kTeacher then from there to
  // the entry's record.
  auto write_teacher = [&](int32_t i) {
    constexpr int kG = Traits::kGi;
    if constexpr (kRecs == 2) {
      // Gi = 2: a token's two columns are the thread's pair (col0 + 8j, + 1: token col0 / 2 + 4j
      // of the step, so token col0 / 2 + 4 (j % 4) of record j / 4), so its mean needs no
      // exchange and goes from registers to the record's teacher rows ([key][m = 16]).
      const int col0 = get<1>(cSrc(0, 0));
      const int64_t rec0 = list.lo + e_begin + int64_t(i) * kRecs - p.pass_first;
      const int nrec = static_cast<int>(min<int64_t>(kRecs, e_end - (e_begin + int64_t(i) * kRecs)));
#pragma unroll
      for (int a = 0; a < kRows; ++a) {
        const int key = get<0>(cSrc(a, 0));
#pragma unroll
        for (int j = 0; j < kCols / 2; ++j) {
          const int h = j / 4, t = col0 / 2 + 4 * (j % 4);
          if (h < nrec) p.teacher[((rec0 + h) * kBlockN + key) * kEntryTokens + t] = (S(a, 2 * j) + S(a, 2 * j + 1)) * 0.5f;
        }
      }
      return;
    }
    const int gs = kG > 0 ? log2_pow2(kG) : gi_shift;
    const int g = 1 << gs;
    const int ltid = fresh_thread_index(), lane = ltid & 31, col0 = 2 * (lane & 3);
    const int row0 = 16 * (ltid >> 5) + (lane >> 2);  // both warpgroups' rows
    const float ig = kG > 0 ? 1.f / kG : inv_gi;
#pragma unroll
    for (int a = 0; a < kRows; ++a) {
      float* trow = ss.kl.teacher + (row0 + 8 * a) * Traits::kTeacherStride;
      if (g == 1) {
#pragma unroll
        for (int c = 0; c < kCols; ++c) {
          const int col = col0 + 8 * (c >> 1) + (c & 1);
          if (col < kTok) trow[col] = S(a, c);
        }
      } else {
        float w[kCols / 2];
#pragma unroll
        for (int j = 0; j < kCols / 2; ++j) w[j] = S(a, 2 * j) + S(a, 2 * j + 1);
        if (g >= 4) {
#pragma unroll
          for (int j = 0; j < kCols / 2; ++j) w[j] += __shfl_xor_sync(0xffffffff, w[j], 1);
        }
        if (g >= 8) {
#pragma unroll
          for (int j = 0; j < kCols / 2; ++j) w[j] += __shfl_xor_sync(0xffffffff, w[j], 2);
        }
#pragma unroll
        for (int s = 1; s < kCols / 2; s *= 2) {
          if (g >= 16 * s) {
            float u[kCols / 2];
#pragma unroll
            for (int j = 0; j < kCols / 2; ++j) u[j] = w[j] + w[j ^ s];
#pragma unroll
            for (int j = 0; j < kCols / 2; ++j) w[j] = u[j];
          }
        }
        // Column col0 + 8j starts its token's columns when both parts are multiples of g
        // (col0 < 8); the token is then col0 / g + 8j / g.
        if ((col0 & (g - 1)) == 0) {
#pragma unroll
          for (int j = 0; j < kCols / 2; ++j) {
            const int t = (col0 >> gs) + ((8 * j) >> gs);
            if (((8 * j) & (g - 1)) == 0 && t < kTok) trow[t] = w[j] * ig;
          }
        }
      }
    }
    __syncwarp();
    if constexpr (Traits::kTeacher) {
      // The warp's 16 rows (keys 16 w .. 16 w + 15 of consumer warp w) of the entry's teacher
      // to its record, m tokens per key, as whole 128-byte lines of the warp.
      const int m_ = kG >= 4 ? 64 / kG : m;  // m = 64 / Gi: a power of two
      const int m_shift = kG >= 4 ? log2_pow2(64 / kG) : __ffs(m) - 1;
      const int w0 = 16 * (ltid >> 5);
      float* dst = p.teacher + ((list.lo + e_begin + i - p.pass_first) * kBlockN + w0) * m_;
      if (m_ >= 2) {
        // Lane l's elements l + 32 k: row (l >> m_shift) + (32 k >> m_shift), token l % m.
        const float* src = ss.kl.teacher + (w0 + (lane >> m_shift)) * Traits::kTeacherStride + (lane & (m_ - 1));
        for (int k = 0; k < m_ / 2; ++k) dst[lane + 32 * k] = src[((32 * k) >> m_shift) * Traits::kTeacherStride];
      } else if (lane < 16) {
        dst[lane] = ss.kl.teacher[(w0 + lane) * Traits::kTeacherStride];
      }
      __syncwarp();
    }
  };

  // P and dS of entry i (in S and dP), its teacher, and both as the 16-bit operands of the dV
  // and dK products; without the fused KL branch also the entry's dS tiles for bwd_dq.
  // Column c (its token's position in the block: lim; -1: no token) sees the block's rows up to
  // lim; an entry whose every column holds a token past the block's last key sees all of them.
  auto entry_math = [&](const EntryRecord* recs, int st, int32_t i) {
    const EntryRecord& en = recs[0];
    constexpr int kG = Traits::kGi;
    const int g = kG > 0 ? kG : Gi;
    auto col_token = [&](int col) {
      if constexpr (kG > 0) return col >> log2_pow2(kG);
      else if constexpr (Traits::kHeadMean) return col >> gi_shift;
      else return (col * gi_inv) >> 16;
    };
    const int col0 = get<1>(cSrc(0, 0));
    const float scale_log2 = p.scale_log2;
    bool whole = en.count * g * kRecs == kBlockC && en.tok[0] - key_base >= kBlockN - 1;
    if constexpr (kRecs == 2) whole = whole && recs[1].count == en.count && recs[1].tok[0] - key_base >= kBlockN - 1;
    if (whole) {
#pragma unroll
      for (int c = 0; c < kCols; ++c) {
        const int col = col0 + 8 * (c >> 1) + (c & 1);
        const float lse2 = ss.lse[st][col] * static_cast<float>(M_LOG2E);
        const float delta = ss.delta[st][col];
#pragma unroll
        for (int a = 0; a < kRows; ++a) {
          const float prob = fast_exp2(S(a, c) * scale_log2 - lse2);
          S(a, c) = prob;
          dP(a, c) = prob * (dP(a, c) - delta);
        }
      }
    } else {
      // Columns outer: a column's limit, LSE and Delta are read once for its rows.
#pragma unroll
      for (int c = 0; c < kCols; ++c) {
        const int col = col0 + 8 * (c >> 1) + (c & 1);
        // kRecs = 2: column col is column col % 32 of record col / 32
        const EntryRecord& er = recs[kRecs == 1 ? 0 : col / (kBlockC / 2)];
        const int32_t t = col_token(kRecs == 1 ? col : col % (kBlockC / 2));
        const int32_t lim = static_cast<int32_t>(entry_last_row(er, t, key_base));
        const float lse2 = ss.lse[st][col] * static_cast<float>(M_LOG2E);
        const float delta = ss.delta[st][col];
#pragma unroll
        for (int a = 0; a < kRows; ++a) {
          const bool ok = get<0>(cSrc(a, 0)) <= lim;
          const float prob = ok ? fast_exp2(S(a, c) * scale_log2 - lse2) : 0.f;
          S(a, c) = prob;
          dP(a, c) = ok ? prob * (dP(a, c) - delta) : 0.f;
        }
      }
    }
    if constexpr (Traits::kHeadMean) write_teacher(i);
    convert_into(tSrS, rP);
    convert_into(tSrdP, rdS);
    // dq from dS (p.ds): the entry's dS, the values dK's product reads, staged before the
    // GEMMs take the registers (an operand of a GEMM in flight is not to be read); the copies
    // to the tokens' tiles then run under the GEMMs (store_ds's 16-byte stores after the dV
    // and dK products are issued, or stage_ds's bulk copies). Gi is a power of two >= 2 here.
    if constexpr (!Traits::kKl) {
      if (p.ds != nullptr) {
        if constexpr (kDsRows) stage_ds_rows(); else stage_ds(recs);
      }
    }
  };

  Bar::wait(&ss.kv_full, 0);
  const int32_t entries = static_cast<int32_t>((e_end - e_begin + kRecs - 1) / kRecs);  // steps
  for (int32_t i = 0; i < entries; ++i) {
    const int st = i % kStages;
    Bar::wait(&ss.full[st], static_cast<uint32_t>((i / kStages) & 1));
    const EntryRecord* recs = ss.ring + (i * kRecs) % kRing;
    const EntryRecord& en = recs[0];
    if constexpr (Traits::kKl) {
      const int32_t ik = (r * ipk + en.seg - list.seg0) / p.idx_per_key;
      if (ik != loaded_ik) {  // another index key head: (re)load this warpgroup's index keys
        run_dq();  // the pending entry and the batch use the old ones
        flush_batch();
        // Every GEMM that read them has been waited for (dq_idx's reads both warpgroups' rows;
        // the other warpgroup sees the new rows through ds_full).
        sync_consumers();
        loaded_ik = ik;
        load_block_rows_async<64, kHeadDim>(
            local_tile(sKi, Shape<_64, Int<kHeadDim>>{}, make_coord(wg, 0)),
            as<Element>(p.k_idx) + (key_row + 64 * wg) * p.ki_s0 + ik * p.ki_s1, p.ki_s0,
            tile.count - 64 * wg, tid % 128, 128);
        cp_async_commit();
        cp_async_wait_all();
        cutlass::arch::fence_view_async_shared();
        cutlass::arch::NamedBarrier::sync(128, static_cast<uint32_t>(Barrier::kWarpGroup) + wg);
      } else if (nb + en.count > Traits::kBatch) {
        flush_batch();
      }
    }
    if (en.count == 0 && (kRecs == 1 || recs[1].count == 0)) {
      if constexpr (Traits::kKl) run_dq();
      Bar::arrive(&ss.empty[st]);
      continue;
    }

    // The score accumulators start from plain zeros (their last values would otherwise be
    // copied into the GEMMs' operand registers while an earlier GEMM is in flight, and ptxas
    // would make the dP product wait for the S product to allow it).
    clear(tSrS);
    clear(tSrdP);
    wg_gemm<true>(mma_s, tSrK, tSrQ(_, _, _, st), tSrS);
    wg_gemm<true>(mma_s, tSrV, tSrdO(_, _, _, st), tSrdP);
    warpgroup_wait<0>();
    entry_math(recs, st, i);
    // Every read of the score accumulators happens before the GEMMs are issued (ptxas
    // serialises the wgmma pipeline if one is scheduled inside it). With kKl the index scores
    // S_idx^T go first, so that the student below runs under dV and dK.
    warpgroup_fence_operand(tSrS);
    warpgroup_fence_operand(tSrdP);
    if constexpr (Traits::kKl) {
      clear(tSrSi);
      wg_gemm<true>(mma_si, tSrKi, tSrQi(_, _, _, st), tSrSi);
    }
    wg_gemm<false, true>(mma_kv, tKVrP, tKVrdOt(_, _, _, st), tdVrdV);
    wg_gemm<false, true>(mma_kv, tKVrdS, tKVrQt(_, _, _, st), tdKrdK);
    if constexpr (!Traits::kKl && kDsRows) {
      if (p.ds != nullptr) store_ds(recs);
    }
    if constexpr (Traits::kKl) {
      // The index scores' GEMM has completed (dV and dK may still run).
      warpgroup_wait<2>();
      warpgroup_fence_operand(tSrSi);
      // The thread's coordinates are re-derived here from a fresh read of the thread index, so
      // that their address arithmetic stays in this block instead of holding registers across
      // the loop.
      const int ltid = fresh_thread_index();
      auto thr_l = mma_si.get_thread_slice(ltid);
      Tensor cI = thr_l.partition_C(make_identity_tensor(Shape<Int<kBlockN>, Int<kTok>>{}));
      Tensor cIrc = make_tensor(cI.data(), acc_rowcol(cI.layout()));
      // Student and dS_idx = sigma - pi in the index-score accumulator (columns are tokens).
#pragma unroll
      for (int a = 0; a < kRows; ++a) {
        const int row = get<0>(cIrc(a, 0));
        const int64_t key = key_base + row;
#pragma unroll
        for (int c = 0; c < kColsI; ++c) {
          const int t = get<1>(cIrc(a, c));
          const bool ok = entry_sees(en, t, key);
          const float pi = ss.kl.teacher[row * Traits::kTeacherStride + t];
          const float lsig2 = (Si(a, c) * p.scale_idx - ss.kl.lidx[st][t]) * static_cast<float>(M_LOG2E);
          Si(a, c) = ok ? fast_exp2(lsig2) - pi : 0.f;
        }
      }
      // dS_idx to the entry tile (dq_idx; once the warpgroup that read its last use is done)
      // and to the batch (dk_idx); the entry's q_idx rows to the batch.
      const int buf = uses & 1;
      if (uses >= 2) Bar::wait(&ss.ds_empty[buf], static_cast<uint32_t>(((uses >> 1) - 1) & 1));
#pragma unroll
      for (int a = 0; a < kRows; ++a) {
        const int row = get<0>(cIrc(a, 0));
#pragma unroll
        for (int c = 0; c < kColsI; ++c) {
          const int t = get<1>(cIrc(a, c));
          const Element v = static_cast<Element>(Si(a, c));
          sDSE(t, row, buf) = v;
          if (t < en.count) sDSbE(row, nb + t) = v;
        }
      }
      cutlass::arch::fence_view_async_shared();
      Bar::arrive(&ss.ds_full[buf]);
      constexpr int kChunks = kHeadDim / 8;
      for (int e = ltid; e < en.count * kChunks; e += kConsumerThreads) {
        const int t = e / kChunks, c = e % kChunks;
        *reinterpret_cast<uint4*>(&sQbE(nb + t, c * 8)) =
            *reinterpret_cast<const uint4*>(&sQiE(t, c * 8, st));
      }
    }
    warpgroup_wait<0>();
    if constexpr (Traits::kKl) {
      run_dq();  // the entry before (its record stays in the ring until the stage is released)
      dq_use = uses++;
      dq_entry = i;
      nb += en.count;
    }
    Bar::arrive(&ss.empty[st]);
  }
  if constexpr (Traits::kKl) {
    run_dq();
    flush_batch();
  } else {
    // The last bulk copies of dS done (their shared source lives as long as the CTA), by each
    // thread that issued some.
    if constexpr (!kDsRows) {
      if (p.ds != nullptr && (fresh_thread_index() & 31) < Traits::kDsIssuers) asm volatile("cp.async.bulk.wait_group 0;\n" ::: "memory");
    }
  }

  Tensor cKV = thr_kv.partition_C(make_identity_tensor(Shape<Int<kBlockN>, Int<kHeadDim>>{}));
  Tensor cKVrc = make_tensor(cKV.data(), acc_rowcol(cKV.layout()));
  Tensor dK = make_tensor(tdKrdK.data(), acc_rowcol(tdKrdK.layout()));
  Tensor dV = make_tensor(tdVrdV.data(), acc_rowcol(tdVrdV.layout()));
  // Two adjacent columns of the block's row `row` (its dK unscaled): to dk and dv, or (passes of
  // tokens) added to their fp32 sums, which one CTA of each pass touches at a time.
  auto emit = [&](int row, int col, float2 k2, float2 v2) {
    if (p.dk_acc != nullptr) {
      const int64_t off = ((key_row + row) * p.Hkv + r) * kHeadDim + col;
      float2* ak = reinterpret_cast<float2*>(p.dk_acc + off);
      float2* av = reinterpret_cast<float2*>(p.dv_acc + off);
      const float2 ok = *ak, ov = *av;
      *ak = make_float2(ok.x + k2.x, ok.y + k2.y);
      *av = make_float2(ov.x + v2.x, ov.y + v2.y);
      return;
    }
    cutlass::Array<Element, 2> a, b;
    a[0] = static_cast<Element>(k2.x * p.scale);
    a[1] = static_cast<Element>(k2.y * p.scale);
    b[0] = static_cast<Element>(v2.x);
    b[1] = static_cast<Element>(v2.y);
    *reinterpret_cast<cutlass::Array<Element, 2>*>(as<Element>(p.dk) + (key_row + row) * p.dk_s0 + r * p.dk_s1 + col) = a;
    *reinterpret_cast<cutlass::Array<Element, 2>*>(as<Element>(p.dv) + (key_row + row) * p.dv_s0 + r * p.dv_s1 + col) = b;
  };
  if (work.it.chunks == 1) {
#pragma unroll
    for (int i = 0; i < size<0>(dK); ++i) {
      const int row = get<0>(cKVrc(i, 0));
      if (row >= tile.count) continue;
#pragma unroll
      for (int c = 0; c < size<1>(dK); c += 2)
        emit(row, get<1>(cKVrc(i, c)), make_float2(dK(i, c), dK(i, c + 1)),
             make_float2(dV(i, c), dV(i, c + 1)));
    }
    return;
  }
  // A split item: this chunk's partial sums to its slot; the last chunk to arrive adds the slots
  // in chunk order.
  constexpr int kSlot = 2 * kBlockN * kHeadDim;
  float* slots = p.work.partials + int64_t(p.work.slot_start[work.it.item]) * kSlot;
  float* mine = slots + int64_t(work.it.c) * kSlot;
#pragma unroll
  for (int i = 0; i < size<0>(dK); ++i) {
    const int row = get<0>(cKVrc(i, 0));
#pragma unroll
    for (int c = 0; c < size<1>(dK); c += 2) {
      const int col = get<1>(cKVrc(i, c));
      *reinterpret_cast<float2*>(mine + row * kHeadDim + col) = make_float2(dK(i, c), dK(i, c + 1));
      *reinterpret_cast<float2*>(mine + kBlockN * kHeadDim + row * kHeadDim + col) =
          make_float2(dV(i, c), dV(i, c + 1));
    }
  }
  __threadfence();
  sync_consumers();
  if (tid == 0) last_chunk = atomicAdd(p.work.arrivals + work.it.item, 1) == work.it.chunks - 1;
  sync_consumers();
  if (!last_chunk) return;
  __threadfence();
  for (int e = tid * 2; e < tile.count * kHeadDim; e += kConsumerThreads * 2) {
    float2 sk = make_float2(0.f, 0.f), sv = make_float2(0.f, 0.f);
    for (int c = 0; c < work.it.chunks; ++c) {
      const float2 a = __ldcg(reinterpret_cast<const float2*>(slots + int64_t(c) * kSlot + e));
      const float2 b = __ldcg(reinterpret_cast<const float2*>(slots + int64_t(c) * kSlot + kBlockN * kHeadDim + e));
      sk.x += a.x;
      sk.y += a.y;
      sv.x += b.x;
      sv.y += b.y;
    }
    emit(e / kHeadDim, e % kHeadDim, sk, sv);
  }
}

}  // namespace msa::cuda::kern
