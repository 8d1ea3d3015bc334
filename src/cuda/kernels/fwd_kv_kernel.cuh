// Attention forward, KV-block-outer: for one KV block of one KV head, the partial outputs of
// every (token, head) whose selection holds it; then a combine per (token, head) over its
// selected blocks. The work a token brings is the same whatever its neighbours selected, so the
// cost does not grow with the union of a query tile's selections as the query-tile forward's
// (fwd_kernel.cuh) does; the price is the partial outputs' memory traffic.
//
// fwd_kv_kernel: one CTA walks one chunk of the entry list of one (KV block, KV head) item
// (device/entry_list.cuh: records of up to m tokens that selected the block through one index
// head; an entry's 64 rows are (token, head) pairs, row = token slot * Gi + head; at Gi = 2 an
// entry is two records, FwdKvTraits::kRecs). The block's K
// and V stay in shared memory for the whole chunk. Per entry, with the entry's rows as MMA rows
// (as a query tile's rows, so every reduction stays inside a quad of one warp):
//   S = Q K^T                       (SS wgmma, 64 rows x kBlockN keys),
//   the row max over the keys the row's token sees, P = exp2(S scale_log2 - max), row sums,
//   O = P V                         (RS wgmma, P from registers),
// and writes O (unnormalised, element type) and (max, sum) to the partial slot of (token, column
// of the block in the token's block_idx row, head): the slots of a token's column are its heads
// in a row (FwdKvArgs::part_o), so an entry's rows go out as whole 4 KB runs at Gi = 16.
//
// Warp roles: two warpgroups, both consumers; each owns half of the chunk's entries and its own
// entry stream (kStages shared-memory stages of Q, cp.async issued by its own threads, synced on
// its own named barrier), so one warpgroup's softmax and stores run while the other's GEMMs do.
// Inside a warpgroup the entries are software-pipelined: S of entry e + 1 and its softmax run
// while O = P V of entry e does. O leaves through a per-warpgroup staging tile in shared memory,
// in the partial rows' order (device/partials.cuh: a thread's values of a row are 16-byte
// vectors), as whole 16-byte chunks of 256-byte rows. (Stored from the accumulator straight to
// global memory, 64 contiguous bytes a quad, the kernel took 46-47% longer on an H100 at 128K,
// paper heads, mixed and random selections.) The only CTA-wide barrier follows the K and V load.
//
// A serving prefill runs the same kernel over a paged cache (FwdKvArgs::paged): its KV tiles
// are the sequences' pages (PagedKeys::kv_tile) and its tokens the last new ones of each
// sequence.
//
// Alone (Options.fwd_pass = kKvBlock), fwd_zero_kernel clears the pass's (max, sum) slots first:
// a slot no entry writes keeps sum 0. Under the split the query tiles know the written slots from
// FwdSplitArgs::taken instead, and nothing is cleared.
//
// fwd_combine_kernel: D / 8 threads per (token, head): the partials of the token's slots that
// hold one, in slot order (deterministic), out = sum w_j O_j / sum w_j l_j with
// w_j = exp2(m_j - max_j m_j), lse = (max + log2 sum) ln 2; no partial: out 0, lse -inf.
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/gemm/collective/builders/sm90_common.inl>

#include "../device/entry_list.cuh"
#include "../device/grid_dependency.cuh"
#include "../device/kv_side_traits.cuh"
#include "../device/load.cuh"
#include "../device/partials.cuh"
#include "../device/pass_choice.cuh"
#include "../device/softmax.cuh"
#include "../device/tile.cuh"
#include "../device/utils.cuh"
#include "../host/args.h"

namespace msa::cuda::kern {

using cuda::FwdKvArgs;

// kScaledKV: K and V are an E4M3 cache's codes (as Element) with per-page scales: the item's
// scores times its block's k scale (and each row's query scale, FP8 queries), its partial O
// times its v scale. kRecs = 2 (Gi = 2, where a record's 16 tokens x 2 heads fill half of an
// entry's 64 rows): an entry is two records, rows 0-31 the first's, 32-63 the second's.
template <class Element_, int kHeadDim_, int kBlockN_, bool kScaledKV_ = false, int kRecs_ = 1>
struct FwdKvTraits {
  using Element = Element_;
  static constexpr int kHeadDim = kHeadDim_, kBlockN = kBlockN_;
  static constexpr bool kScaledKV = kScaledKV_;
  static constexpr int kRecs = kRecs_;
  static_assert(kRecs == 1 || (kRecs == 2 && kEntryTokens * 2 * kRecs == 64), "two records of 16 x 2 rows");
  static constexpr int kRows = 64;  // an entry's (token, head) rows: one wgmma M
  static constexpr int kWarpGroups = 2;
  static constexpr int kThreads = 128 * kWarpGroups;
  static constexpr int kStages = 3;  // per warpgroup
  // The shared layouts of the KV side: the block (K-major, and V viewed transposed) and the
  // entries' rows, kStages stages per warpgroup.
  using Side = KvSideTraits<Element, kHeadDim, kBlockN, kWarpGroups * kStages>;
  using SmemLayoutK = typename Side::SmemLayoutK;
  using SmemLayoutVt = typename Side::SmemLayoutKt;
  using SmemLayoutQ = typename Side::SmemLayoutQ;
  static_assert(Side::kBlockC == kRows);
  static constexpr int kOStride = kHeadDim + 8;

  using TileS = Shape<Int<kRows>, Int<kBlockN>, Int<kHeadDim>>;
  using TileO = Shape<Int<kRows>, Int<kHeadDim>, Int<kBlockN>>;
  using MmaS = decltype(make_tiled_mma(GMMA::ss_op_selector<Element, Element, float, TileS>()));
  using MmaO = decltype(make_tiled_mma(
      GMMA::rs_op_selector<Element, Element, float, TileO, GMMA::Major::K, GMMA::Major::MN>()));

  struct SharedStorage {
    alignas(1024) cute::array_aligned<Element, cosize_v<SmemLayoutK>> k;
    alignas(1024) cute::array_aligned<Element, cosize_v<SmemLayoutK>> v;
    alignas(1024) cute::array_aligned<Element, cosize_v<SmemLayoutQ>> q;
    // Per warpgroup: an entry's O staged as [row][head dim] in the partial rows' order (rows
    // padded by 16 bytes), copied out in whole 16-byte row chunks.
    alignas(16) Element o[kWarpGroups][kRows * kOStride];
    int64_t row_slot[kWarpGroups][kRows];  // the partial slot of each staged row (-1: none)
    EntryRecord ring[kWarpGroups][EntryStream<kStages, 128, kRecs>::kRing];
  };
};

template <class Traits>
struct FwdKvParams : FwdKvArgs {};

// Warp roles: two consumer warpgroups, each with its own half of the chunk and its own entry
// stream. Pipelines: per warpgroup, kStages stages of entries (cp.async), and S / softmax of the
// next entry under P V of the current one. Work: one chunk of one (KV block, KV head) entry list;
// nothing where kAuto's sums chose the plain query tiles.
template <class Traits>
__global__ void __launch_bounds__(Traits::kThreads, 1)
    fwd_kv_kernel(const __grid_constant__ FwdKvParams<Traits> p) {
  grid_dependency_begin();
  using Element = typename Traits::Element;
  constexpr int kBlockN = Traits::kBlockN, kHeadDim = Traits::kHeadDim, kStages = Traits::kStages;
  constexpr int kRecs = Traits::kRecs;
  using SharedStorage = typename Traits::SharedStorage;

  extern __shared__ __align__(1024) char smem_raw[];
  SharedStorage& ss = *reinterpret_cast<SharedStorage*>(smem_raw);

  if (p.choice != nullptr && !split_chosen(p.choice)) return;  // kAuto chose the plain query tiles
  KvChunk work;
  if (!work.find<kBlockN, false, true>(p)) return;  // also where no token of this pass selected the block
  const QueryTile& tile = work.tile;
  const EntryList& list = work.list;
  const int64_t e_begin = work.begin, e_end = work.end, key_row = work.key_row, key_base = work.key_base;
  const int32_t r = work.it.r;
  const int tid = threadIdx.x, wg = tid / 128, lt = tid % 128;
  const int32_t Gi = p.heads_per_idx, ipk = p.idx_per_kv;
  // The scores' factor (log2 units), and the values' scale of an E4M3 cache's block.
  float s_factor = p.scale_log2, v_factor = 1.f;
  if constexpr (Traits::kScaledKV) {
    const float2 f = p.kv_scale[work.it.x * p.Hkv + r];
    s_factor *= f.x;
    v_factor = f.y;
  }

  Tensor sK = make_tensor(make_smem_ptr(ss.k.data()), typename Traits::SmemLayoutK{});
  Tensor sVt = make_tensor(make_smem_ptr(ss.v.data()), typename Traits::SmemLayoutVt{});
  Tensor sV = make_tensor(make_smem_ptr(ss.v.data()), typename Traits::SmemLayoutK{});
  Tensor sQ = make_tensor(make_smem_ptr(ss.q.data()), typename Traits::SmemLayoutQ{});

  // K and V of the block, by every thread; keys past the sequence end are zero rows (no token
  // sees them, and 0 * a zero row adds nothing).
  load_block_rows_async<kBlockN, kHeadDim>(
      sK, as<Element>(p.k) + key_row * p.k_s0 + r * p.k_s1, p.k_s0, tile.count, tid, Traits::kThreads);
  load_block_rows_async<kBlockN, kHeadDim>(
      sV, as<Element>(p.v) + key_row * p.v_s0 + r * p.v_s1, p.v_s0, tile.count, tid, Traits::kThreads);
  cp_async_commit();

  // This warpgroup's half of the chunk's entries (of kRecs records). The stream's constructor
  // waits for all of the thread's copies (K and V included); the CTA barrier then makes every
  // thread's visible to all.
  const int64_t half = ((e_end - e_begin + kRecs - 1) / kRecs + 1) / 2 * kRecs;
  const int64_t my_begin = wg == 0 ? e_begin : min(e_begin + half, e_end);
  const int64_t my_end = wg == 0 ? min(e_begin + half, e_end) : e_end;
  EntryStream<kStages, 128, kRecs> stream(list, p.list, my_begin, my_end, ss.ring[wg], lt,
                                          static_cast<uint32_t>(Barrier::kWarpGroup) + wg);
  __syncthreads();

  // An entry's Q rows into stage st of this warpgroup (cp.async by its 128 threads).
  constexpr int kStageElems = Traits::kRows * kHeadDim;
  const ColumnLoader<kHeadDim, 128> rows_in(sQ(_, _, wg * kStages), Gi, lt);
  auto issue = [&](const EntryRecord* recs, int st) {
    const EntryRecord& en = recs[0];
    const int32_t head0 = (r * ipk + en.seg - list.seg0) * Gi;
    if constexpr (kRecs == 1) {
      int32_t t[ColumnLoader<kHeadDim, 128>::kIters];
      rows_in.tokens(en.tok, en.count, t);
      rows_in.load(ss.q.data() + (wg * kStages + st) * kStageElems, as<Element>(p.q) + head0 * p.q_s1,
                   p.q_s0, p.q_s1, t);
    } else {
      const int32_t head1 = (r * ipk + recs[1].seg - list.seg0) * Gi;
      rows_in.load_halves(ss.q.data() + (wg * kStages + st) * kStageElems, as<Element>(p.q), p.q_s0,
                          p.q_s1, kEntryTokens, en.tok, en.count, head0, recs[1].tok, recs[1].count, head1);
    }
  };
  stream.start(list, p.list, issue);

  typename Traits::MmaS mma_s;
  typename Traits::MmaO mma_o;
  auto thr_s = mma_s.get_thread_slice(lt);
  auto thr_o = mma_o.get_thread_slice(lt);
  Tensor tSrQ = thr_s.partition_fragment_A(sQ);
  Tensor tSrK = thr_s.partition_fragment_B(sK);
  Tensor tOrV = thr_o.partition_fragment_B(sVt);
  Tensor tSrS = partition_fragment_C(mma_s, Shape<Int<Traits::kRows>, Int<kBlockN>>{});
  Tensor tOrO = partition_fragment_C(mma_o, Shape<Int<Traits::kRows>, Int<kHeadDim>>{});
  Tensor rP = make_tensor<Element>(tSrS.layout());
  Tensor tOrP = make_tensor(rP.data(), acc_as_a_operand(rP.layout()));

  Tensor cS = thr_s.partition_C(make_identity_tensor(Shape<Int<Traits::kRows>, Int<kBlockN>>{}));
  Tensor S = make_tensor(tSrS.data(), acc_rowcol(tSrS.layout()));
  Tensor cSrc = make_tensor(cS.data(), acc_rowcol(cS.layout()));
  Tensor cO = thr_o.partition_C(make_identity_tensor(Shape<Int<Traits::kRows>, Int<kHeadDim>>{}));
  Tensor O = make_tensor(tOrO.data(), acc_rowcol(tOrO.layout()));
  Tensor cOrc = make_tensor(cO.data(), acc_rowcol(cO.layout()));
  constexpr int kRowsThr = decltype(size<0>(S))::value;  // rows this thread holds (2)
  // This thread's rows: token slot and head (in record my_rec of an entry: kRecs = 2 puts rows
  // 0-31, warps 0 and 1, in the first record and rows 32-63 in the second).
  int32_t row_t[kRowsThr], row_h[kRowsThr];
  const int my_rec = kRecs == 1 ? 0 : lt / 64;
#pragma unroll
  for (int a = 0; a < kRowsThr; ++a) {
    const int row = get<0>(cSrc(a, 0)) - 32 * my_rec;
    row_t[a] = row / Gi;
    row_h[a] = row - row_t[a] * Gi;
  }

  // Entry e's scores (S holds them, in log2 units) -> unnormalised probabilities, with each
  // row's max and this thread's share of its sum. Only an entry whose first token (the tokens
  // are ascending) lies inside the block, before its last key, needs the causal mask; rows past
  // the entry's tokens are left unmasked (never stored).
  float mx[kRowsThr], sum[kRowsThr];
  auto softmax = [&](const EntryRecord* recs) {
    const EntryRecord& en = recs[my_rec];
    const bool causal = en.tok[0] - key_base < kBlockN - 1;
    constexpr int kCols = decltype(size<1>(S))::value;
    constexpr int kWays = 4;  // independent chains of the row max and sum
    static_assert(kCols % kWays == 0);
#pragma unroll
    for (int a = 0; a < kRowsThr; ++a) {
      const int32_t lim =
          row_t[a] < en.count ? static_cast<int32_t>(en.tok[row_t[a]] - key_base) : kBlockN;
      float sf = s_factor;  // FP8 queries: times the row's query scale
      if constexpr (Traits::kScaledKV) {
        if (p.q_factor != nullptr && row_t[a] < en.count)
          sf *= p.q_factor[int64_t(en.tok[row_t[a]]) * p.Hq + (r * ipk + en.seg - list.seg0) * Gi + row_h[a]];
      }
#pragma unroll
      for (int c = 0; c < kCols; ++c) S(a, c) *= sf;
      if (causal) {
#pragma unroll
        for (int c = 0; c < kCols; ++c)
          if (get<1>(cSrc(a, c)) > lim) S(a, c) = -INFINITY;
      }
      float part[kWays];
#pragma unroll
      for (int w = 0; w < kWays; ++w) part[w] = -INFINITY;
#pragma unroll
      for (int c = 0; c < kCols; ++c) part[c % kWays] = fmaxf(part[c % kWays], S(a, c));
      mx[a] = quad_max(fmaxf(fmaxf(part[0], part[1]), fmaxf(part[2], part[3])));
      // finite: every row sees its block's first key
#pragma unroll
      for (int w = 0; w < kWays; ++w) part[w] = 0.f;
#pragma unroll
      for (int c = 0; c < kCols; ++c) {
        const float pr = fast_exp2(S(a, c) - mx[a]);
        S(a, c) = pr;
        part[c % kWays] += pr;
      }
      sum[a] = (part[0] + part[1]) + (part[2] + part[3]);
    }
  };
  // Entry en's partials: (max, sum) of its real rows, and O (unnormalised, element type)
  // through this warpgroup's staging tile, so that the global stores are whole 16-byte chunks
  // of 256-byte rows. The warpgroup's previous copy-out finished before the stream's last sync.
  Element* so = ss.o[wg];
  int64_t* row_slot = ss.row_slot[wg];
  auto store = [&](const EntryRecord* recs, const float (&m)[kRowsThr], const float (&l)[kRowsThr]) {
    const EntryRecord& en = recs[my_rec];
    const int32_t head0 = (r * ipk + en.seg - list.seg0) * Gi;
#pragma unroll
    for (int a = 0; a < kRowsThr; ++a) {
      const float lsum = quad_sum(l[a]);
      const int row = get<0>(cOrc(a, 0));
      PartialRows<Element, kHeadDim>::store(so + row * Traits::kOStride, O, a, lt & 3, v_factor);
      if ((lt & 3) == 0) {
        const int32_t t = row_t[a];
        int64_t slot = -1;
        if (t < en.count) {
          slot = partial_slot(en.tok[t], p.tok_lo, p.top_k, en.slot[t], p.Hq, head0 + row_h[a]);
          *reinterpret_cast<float2*>(p.part_ml + 2 * slot) = make_float2(m[a], lsum);
        }
        row_slot[row] = slot;
      }
    }
    cutlass::arch::NamedBarrier::sync(128, static_cast<uint32_t>(Barrier::kWarpGroup) + wg);
    constexpr int kChunks = kHeadDim / 8;
    static_assert(128 % kChunks == 0);
    const int ch = lt % kChunks;
#pragma unroll
    for (int row = lt / kChunks; row < Traits::kRows; row += 128 / kChunks) {
      const int64_t slot = row_slot[row];
      if (slot < 0) continue;
      *reinterpret_cast<uint4*>(as<Element>(p.part_o) + slot * kHeadDim + ch * 8) =
          *reinterpret_cast<const uint4*>(so + row * Traits::kOStride + ch * 8);
    }
  };

  // Software pipeline over the warpgroup's entries: S of entry e + 1 is computed and turned into
  // probabilities while O = P V of entry e runs. Entries with no token (count 0) still go
  // through the GEMMs (on zero rows) and store nothing.
  if (my_begin < my_end) {
    stream.wait();
    stream.issue_next(list, p.list, issue);
    wg_gemm<true>(mma_s, tSrQ(_, _, _, wg * kStages + stream.stage(my_begin)), tSrK, tSrS);
    warpgroup_wait<0>();
    softmax(stream.records(my_begin));
    convert_into(tSrS, rP);
  }
  float m[kRowsThr], l[kRowsThr];  // the max and sum of the entry whose O = P V is in flight
  for (int64_t e = my_begin; e + kRecs < my_end; e += kRecs) {
    // Entry e + 1 has landed; entry e's stage (its S is done) is refilled.
    stream.wait();
    stream.issue_next(list, p.list, issue);
    wg_gemm<true>(mma_s, tSrQ(_, _, _, wg * kStages + stream.stage(e + kRecs)), tSrK, tSrS);
    wg_gemm<true, true>(mma_o, tOrP, tOrV, tOrO);
#pragma unroll
    for (int a = 0; a < kRowsThr; ++a) {
      m[a] = mx[a];
      l[a] = sum[a];
    }
    warpgroup_wait<1>();
    softmax(stream.records(e + kRecs));
    warpgroup_wait<0>();
    store(stream.records(e), m, l);
    convert_into(tSrS, rP);
  }
  if (my_begin < my_end) {
    wg_gemm<true, true>(mma_o, tOrP, tOrV, tOrO);
    warpgroup_wait<0>();
    // The staging tile is free once every thread has copied out the previous entry (inside the
    // loop, the next entry's stream wait is that barrier).
    cutlass::arch::NamedBarrier::sync(128, static_cast<uint32_t>(Barrier::kWarpGroup) + wg);
    store(stream.records(my_begin + (my_end - 1 - my_begin) / kRecs * kRecs), mx, sum);
  }
  cp_async_wait_all();
}

// One (token, head) pair g of the pass: lane owns positions [8 lane, 8 lane + 8) of the partial
// rows, the columns partial_pos(8 lane + x).
template <class Element, int kHeadDim>
__device__ void combine_pair(const FwdKvArgs& p, int64_t g, int lane) {
  constexpr int kMaxSlots = 32;  // can_fwd_kv: top_k <= 32
  const int64_t t = p.tok_lo + g / p.Hq;
  const int32_t h = static_cast<int32_t>(g % p.Hq);
  // The pair's column j: `first` + j Hq.
  const int64_t first = partial_slot(t, p.tok_lo, p.top_k, 0, p.Hq, h);
  const auto ml = [&](int j) { return reinterpret_cast<const float2*>(p.part_ml)[first + int64_t(j) * p.Hq]; };
  uint32_t valid = 0;
  float mx = -INFINITY;
  for (int j = 0; j < p.top_k; ++j) {
    const float2 v = ml(j);
    if (v.y > 0.f) {
      valid |= 1u << j;
      mx = fmaxf(mx, v.x);
    }
  }
  float acc[8];
#pragma unroll
  for (int x = 0; x < 8; ++x) acc[x] = 0.f;
  float sum = 0.f;
  const Element* po = as<Element>(p.part_o) + first * kHeadDim + lane * 8;
#pragma unroll 1
  for (int j0 = 0; j0 < kMaxSlots && (valid >> j0) != 0u; j0 += 8) {
    uint4 val[8];
#pragma unroll
    for (int u = 0; u < 8; ++u)
      if ((valid >> (j0 + u)) & 1u)
        val[u] = *reinterpret_cast<const uint4*>(po + int64_t(j0 + u) * p.Hq * kHeadDim);
#pragma unroll
    for (int u = 0; u < 8; ++u) {
      if (!((valid >> (j0 + u)) & 1u)) continue;
      const float2 v = ml(j0 + u);
      const float wj = fast_exp2(v.x - mx);
      sum += wj * v.y;
      const Element* e = reinterpret_cast<const Element*>(&val[u]);
#pragma unroll
      for (int x = 0; x < 8; ++x) acc[x] += wj * static_cast<float>(e[x]);
    }
  }
  const float inv = sum > 0.f ? 1.f / sum : 0.f;
  Element* dst = as<Element>(p.out) + t * p.o_s0 + int64_t(h) * p.o_s1;
#pragma unroll
  for (int x = 0; x < 8; x += 2) {
    cutlass::Array<Element, 2> pair;
    pair[0] = static_cast<Element>(acc[x] * inv);
    pair[1] = static_cast<Element>(acc[x + 1] * inv);
    *reinterpret_cast<cutlass::Array<Element, 2>*>(dst + partial_pos(lane * 8 + x)) = pair;
  }
  if (lane == 0)
    p.lse[t * p.lse_s0 + int64_t(h) * p.lse_s1] =
        sum > 0.f ? (mx + log2f(sum)) * 0.69314718055994531f : -INFINITY;
}

// The combine of the partials of (token, head) pairs of the pass [tok_lo, tok_hi): kLanes
// threads per pair, each owning 8 elements of the head dim (16-byte loads), 8 slots' loads issued
// before any is used; a grid-stride loop over the pairs (the pass alone: kAuto takes the split,
// whose query tiles merge). A slot holds a partial when its sum is positive: fwd_zero_kernel
// zeroes the sums before the pass, and the KV pass writes one partial per distinct selected block
// of a token (the reverse index keeps one record per block and token), whose sum is at least 1.
template <class Element, int kHeadDim>
__global__ void fwd_combine_kernel(const __grid_constant__ FwdKvArgs p) {
  grid_dependency_begin();
  constexpr int kLanes = kHeadDim / 8;
  const int lane = threadIdx.x % kLanes;
  const int64_t pairs = (p.tok_hi - p.tok_lo) * p.Hq;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x / kLanes;
  for (int64_t g = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) / kLanes; g < pairs;
       g += stride)
    combine_pair<Element, kHeadDim>(p, g, lane);
}

// The KV-block pass's (max, sum) slots zeroed before it runs alone (a slot it does not write then
// reads as holding no partial to fwd_combine_kernel).
template <class Element>
__global__ void fwd_zero_kernel(const __grid_constant__ FwdKvArgs p) {
  grid_dependency_begin();
  const int64_t n = (p.tok_hi - p.tok_lo) * p.Hq * p.top_k / 2;  // float4: two slots
  float4* dst = reinterpret_cast<float4*>(p.part_ml);
  for (int64_t x = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; x < n;
       x += static_cast<int64_t>(gridDim.x) * blockDim.x)
    dst[x] = make_float4(0.f, 0.f, 0.f, 0.f);
  if ((p.tok_hi - p.tok_lo) * p.Hq * p.top_k % 2 != 0 && blockIdx.x == 0 && threadIdx.x == 0)
    reinterpret_cast<float2*>(p.part_ml)[2 * n] = make_float2(0.f, 0.f);
}

}  // namespace msa::cuda::kern
