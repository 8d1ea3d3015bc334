// Entry lists of the KV-side kernels (bwd_kv_kernel.cuh, kl_kernel.cuh, fwd_kv_kernel.cuh): the
// tokens that selected a KV block, the work items and chunks they are cut into, and the entry
// stream that keeps kStages entries in flight.
//
// A KV-side work item is one KV block (Bk keys of one sequence) of one KV head r. Its work is a
// list of entries; an entry is up to m = min(64 / Gi, 16) tokens of one index head i of r, and
// its 64 columns are (token, head) pairs of those tokens and of i's Gi query heads (column =
// token * Gi + head). An entry is an EntryRecord: its tokens' packed indices, the block's column
// in each token's block_idx row, and its segment ((KV tile * Hkv + r) * ipk + i - r * ipk).
//   Sparse mode: the tokens are packed. The reverse index (host/reverse_index.cu) sorts one key
//   per selection, (KV tile, r, i, token, column), keeps one per (segment, token), and cuts each
//   (KV tile, r, i) run into records of m consecutive keys, so every column of an entry holds a
//   token that selected the block, whatever the overlap of neighbouring tokens' selections.
//   Dense (warmup) mode: the records are worked out on the device: m consecutive tokens of the
//   sequence from the group holding the token at the block's first key on (tokens before it see
//   none of it).
//
// Lists are uneven (a sink block is selected by every token; in dense mode the first block by
// all), so an item's list is cut into chunks of at most `chunk` entries and each chunk is one
// CTA. The chunks are laid out by an exclusive scan of the per-item chunk counts, the items
// longest first, and each CTA reads its item and chunk from a table (WorkListParams::cta); an
// item's records start at its first segment's entry of EntryListParams::seg_start.
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>

#include <cstdint>

#include "load.cuh"
#include "tile.cuh"

namespace msa::cuda::kern {

// Fixed-point sums across CTAs: one unit is 2^-32; integer atomics make them order-independent.
constexpr double kFixedOne = 4294967296.0;

// v * 2^32 is exact in float (a power-of-two scale cannot round, and overflow saturates the
// conversion as the double product would), so this rounds exactly as the double product does,
// without the float-to-double conversions.
__device__ __forceinline__ void add_fixed(unsigned long long* dst, float v) {
  atomicAdd(dst, static_cast<unsigned long long>(__float2ll_rn(v * 4294967296.f)));
}

constexpr int kEntryTokens = 16;  // the most tokens of an entry (m <= 16)
constexpr int kKlGradTokens = 32;  // the index columns of a kl_grad_kernel step

// One entry: up to kEntryTokens tokens (packed indices, ascending; slots past `count` repeat
// the first) of one segment. 96 bytes: six 16-byte copies.
struct alignas(16) EntryRecord {
  int32_t tok[kEntryTokens];
  int32_t seg;    // (KV tile * Hkv + r) * ipk + index head of r
  int32_t count;  // tokens (0: nothing to do)
  uint8_t slot[kEntryTokens];  // sparse: the block's column in each token's block_idx row
  int32_t pad[2];
};
static_assert(sizeof(EntryRecord) == 96, "EntryRecord is six 16-byte chunks");
constexpr int kEntryChunks = sizeof(EntryRecord) / 16;

struct EntryListParams {
  const EntryRecord* records;  // sparse: every item's records, sorted by seg
  // sparse: [segments + 1], the first record of each segment (the number of records past the
  // last), so that a list is found with two loads instead of two binary searches
  const int32_t* seg_start;
  bool dense;
};

// The entries of (KV tile x of `tile`, KV head r). token_base: the packed index of the token at
// the position of the block's first key (PagedKeys::token_base).
struct EntryList {
  int64_t lo = 0, n = 0;
  int64_t seq_start = 0;  // packed index of the sequence's first token
  int32_t seg0 = 0;       // the item's first segment: (x * Hkv + r) * ipk
  int32_t g_first = 0;    // dense: first group (m tokens) at or after the block
  int32_t ng = 0;         // dense: groups per index head
  int32_t seq_len = 0, m = 0;

  EntryList() = default;
  __device__ EntryList(const EntryListParams& p, const QueryTile& tile, int64_t token_base, int64_t x,
                       int32_t r, int32_t Hkv, int32_t ipk, int32_t m_)
      : seq_start(tile.seq_start), seq_len(tile.seq_len), m(m_) {
    seg0 = static_cast<int32_t>((x * Hkv + r) * ipk);
    if (p.dense) {
      // The first token that sees the block is token_base - seq_start of the sequence (keys
      // apart: the block may lie wholly before the first token, 0), which is < seq_len.
      g_first = static_cast<int32_t>(max<int64_t>(token_base - tile.seq_start, 0) / m);
      ng = tile.seq_len > 0 ? (tile.seq_len - 1) / m - g_first + 1 : 0;
      n = int64_t(ng) * ipk;
      return;
    }
    lo = p.seg_start[seg0];
    n = p.seg_start[seg0 + ipk] - lo;
  }

  // Entry e's record into dst (shared memory): sparse, 16-byte cp.async copies by threads
  // 0..kEntryChunks-1 (the caller commits them); dense, written by threads 0-15.
  __device__ void issue_record(const EntryListParams& p, int64_t e, EntryRecord* dst,
                               int tid) const {
    if (p.dense) {
      const uint32_t ee = static_cast<uint32_t>(e), nn = static_cast<uint32_t>(ng);
      const int32_t il = static_cast<int32_t>(ee / nn);
      const int32_t first = (g_first + static_cast<int32_t>(ee % nn)) * m;
      const int32_t count = first < seq_len ? min(m, seq_len - first) : 0;
      if (tid < kEntryTokens)
        dst->tok[tid] = static_cast<int32_t>(seq_start + first + (tid < count ? tid : 0));
      if (tid == 0) {
        dst->seg = seg0 + il;
        dst->count = count;
      }
    } else if (tid < kEntryChunks) {
      cp_async16(reinterpret_cast<char*>(dst) + 16 * tid,
                 reinterpret_cast<const char*>(p.records + lo + e) + 16 * tid, true);
    }
  }

  // A producer warpgroup's copy of entry e's record into shared memory, with plain stores by
  // threads 0..kRecordWriters-1 (which then arrive on the stage's mbarrier): record_chunk reads
  // 16-byte chunk c of a sparse record from global memory (thread c < kEntryChunks), and
  // write_record stores it into dst, or works the record out (dense).
  static constexpr int kRecordWriters = kEntryTokens;
  __device__ uint4 record_chunk(const EntryListParams& p, int64_t e, int c) const {
    if (p.dense || c >= kEntryChunks) return make_uint4(0, 0, 0, 0);
    return __ldg(reinterpret_cast<const uint4*>(p.records + lo + e) + c);
  }
  __device__ void write_record(const EntryListParams& p, int64_t e, EntryRecord* dst, int tid,
                               uint4 chunk) const {
    if (p.dense) {
      issue_record(p, e, dst, tid);  // plain stores in dense mode
    } else if (tid < kEntryChunks) {
      reinterpret_cast<uint4*>(dst)[tid] = chunk;
    }
  }
};

// Group size of the KV side: tokens per entry.
__host__ __device__ inline int32_t group_tokens(int32_t heads_per_idx) {
  const int32_t m = 64 / heads_per_idx;
  return m < 16 ? m : 16;
}

// A KV-side CTA's work (WorkListParams::cta): chunk c of `chunks` of work item `item` (-1: none).
struct alignas(16) CtaWork {
  int32_t item, c, chunks, pad;
};

struct WorkListParams {
  // [grid] each CTA's item and chunk: the items longest entry list first (ties by item), their
  // chunks one after another (host/reverse_index.cu, build_work)
  const CtaWork* cta;
  const int32_t* slot_start;   // [items] first partial slot of a split item
  int32_t* arrivals;           // [items] chunks of a split item that have finished (zeroed)
  float* partials;             // split items' fp32 partial sums, per slot
  int32_t items;               // num_tiles * Hkv (item = x * Hkv + r)
  int32_t chunk;               // entries per chunk
};

struct WorkItem {
  int64_t x = 0;
  int32_t r = 0, c = 0, chunks = 0;
  int32_t item = -1;  // -1: no work for this CTA
};

// The work item and chunk of CTA w (an upper-bound grid: CTAs past the last chunk get none).
// The CTAs take the items longest first, so that the short ones fill the last wave (at 16K
// tokens, flash-msa's heads, in item order the SMs of bwd_kv were busy 82% of its time).
__device__ inline WorkItem decode_work(const WorkListParams& p, int32_t Hkv, int64_t w) {
  WorkItem it;
  const CtaWork cw = p.cta[w];
  if (cw.item < 0) return it;
  it.item = cw.item;
  it.x = cw.item / Hkv;
  it.r = cw.item % Hkv;
  it.c = cw.c;
  it.chunks = cw.chunks;
  return it;
}

// The work of one KV-side CTA: chunk it.c of the entry list of (KV block it.x, KV head it.r), as
// `tile` (the block's keys, a KV tile of p.paged's layout: PagedKeys::tile_of), `list` and entries
// [begin, end).
// False: nothing to do, or (kPasses, pass_end > 0) a chunk of a pass chunk (pass_chunk entries,
// by default the chunk itself) whose first record belongs to another pass (kernels that never run
// in passes leave the test out of their code). Params: the KV-side kernel's parameters (work,
// list, cu_seqlens, nseq, T, Hkv, idx_per_kv, group_tokens, pass_first, pass_end, pass_chunk, and
// `paged`, the keys' layout: kern::PagedKeys).

template <int kBlockN, bool kPasses = false, class Params>
__device__ inline bool kv_chunk(const Params& p, WorkItem* it, QueryTile* tile, EntryList* list,
                                int64_t* begin, int64_t* end) {
  *it = decode_work(p.work, p.Hkv, blockIdx.x);
  if (it->item < 0) return false;
  *tile = p.paged.tile_of(p.cu_seqlens, p.nseq, p.T, kBlockN, it->x);
  if (tile->count == 0) return false;
  *list = EntryList(p.list, *tile, p.paged.token_base(*tile), it->x, it->r, p.Hkv, p.idx_per_kv, p.group_tokens);
  *begin = min<int64_t>(int64_t(it->c) * p.work.chunk, list->n);
  *end = min<int64_t>(*begin + p.work.chunk, list->n);
  if constexpr (kPasses) {
    // The pass of the chunk of p.pass_chunk entries that holds this one (its own by default). An
    // empty list (a block no token selected, whose dk and dv are zeros) goes with the first pass:
    // its first record is the next list's, which may lie past the last pass's end.
    const int64_t pc = p.pass_chunk > 0 ? p.pass_chunk : p.work.chunk;
    const int64_t first = list->lo + *begin / pc * pc;
    if (p.pass_end > 0 && (list->n == 0 ? p.pass_first != 0 : (first < p.pass_first || first >= p.pass_end)))
      return false;
  }
  return true;
}

// A KV-side CTA's chunk (kv_chunk's item, tile, list and entries [begin, end)) and where its
// block's keys are: key_row, the row of the block's first key in the key tensors (K, V, k_idx),
// and key_base, the packed index of the token at that key's position (a token u sees key j of
// the block where u - key_base >= j): both the block's first token when the keys are the
// tokens; for a prefill's pages or keys apart, the block's page row or key row and seq_start +
// first - pos0 (pos0: the position of the sequence's first token; PagedKeys).
struct KvChunk {
  WorkItem it;
  QueryTile tile;
  EntryList list;
  int64_t begin, end;  // set by find
  int64_t key_row, key_base;

  // False: nothing to do (kv_chunk); with kEntries also where the chunk has no entry (a kernel
  // that writes nothing for a block no token selected).
  template <int kBlockN, bool kPasses = false, bool kEntries = false, class Params>
  __device__ bool find(const Params& p) {
    if (!kv_chunk<kBlockN, kPasses>(p, &it, &tile, &list, &begin, &end)) return false;
    if (kEntries && begin >= end) return false;
    key_row = p.paged.first_row(tile, kBlockN);
    key_base = p.paged.token_base(tile);
    return true;
  }
};

// A chunk's records [begin, end) taken R a step (kl_lse_kernel.cuh; kl_grad_kernel.cuh walks its
// steps the same way with lambdas of its own: written with this struct it spilled 156 instead of
// 116 bytes and ran 1.43 against 1.28 ms at 16K tokens, flash-msa's heads): step s holds
// records [begin + s R, min(begin + (s + 1) R, end)), copied by cp.async into slot s % kRing of
// a ring in shared memory some steps before its rows are loaded; the step's row (or column) c
// is token c % m of its record c / m (m a power of two).
template <int kRing, int kMaxRecords>
struct RecordSteps {
  const EntryRecord* records;  // the item's list
  int64_t begin, end;
  int32_t R, m, m_shift;
  int32_t head0;  // a record's index head: head0 + its seg
  int steps;      // a chunk's records are fewer than 2^31

  __device__ RecordSteps(const EntryListParams& lp, const EntryList& list, int64_t begin_, int64_t end_,
                         int32_t R_, int32_t m_, int32_t r, int32_t ipk)
      : records(lp.records + list.lo), begin(begin_), end(end_), R(R_), m(m_), m_shift(0),
        head0(r * ipk - list.seg0), steps(static_cast<int>((end_ - begin_ + R_ - 1) / R_)) {
    while ((1 << m_shift) < m) ++m_shift;
  }

  __device__ int64_t first(int s) const { return begin + int64_t(s) * R; }  // its first record
  __device__ int count(int s) const { return static_cast<int>(min<int64_t>(R, end - first(s))); }

  // Step s's records into their ring slot by threads tid, tid + nthreads, ... (16-byte copies;
  // the caller commits); nothing past the last step.
  __device__ void issue(EntryRecord (*ring)[kMaxRecords], int s, int tid, int nthreads) const {
    if (s >= steps) return;
    const char* src = reinterpret_cast<const char*>(records + first(s));
    char* dst = reinterpret_cast<char*>(ring[s % kRing]);
    for (int c = tid; c < count(s) * kEntryChunks; c += nthreads) cp_async16(dst + 16 * c, src + 16 * c, true);
  }

  // Row c of a step whose records are recs (n of them): its packed token and index head, or -1.
  __device__ int64_t token(const EntryRecord* recs, int n, int c, int32_t* head) const {
    const int j = c >> m_shift, t = c & (m - 1);
    if (j >= n || t >= recs[j].count) return -1;
    *head = head0 + recs[j].seg;
    return recs[j].tok[t];
  }
  // Its block_idx column (a row with a token).
  __device__ int slot(const EntryRecord* recs, int c) const { return recs[c >> m_shift].slot[c & (m - 1)]; }
};

// A chunk's entries [begin, end) through kStages shared-memory stages, kStages - 1 of them in
// flight ahead of the one being computed. issue(records, stage) starts the cp.async loads of one
// entry's rows; each entry is one commit group (empty past the end, so that the wait counts stay
// right). An entry is kRecs consecutive records (kRecs = 2: two records of 16 tokens x 2 heads
// fill an entry's 64 rows at Gi = 2; a missing second record reads as count 0) and is named by
// its first record e (begin, begin + kRecs, ...).
//
// The rows' addresses come from the entry's records, so records run kLead = kStages - 1 entries
// ahead of the rows, through a ring of kRing = 2 * kStages * kRecs shared-memory slots: entry n's
// records are copied in the group of entry n - kLead, which has landed when entry n's rows are
// issued. The ring holds the records of every entry from the one before the entry being
// computed (the KL branch finishes an entry one entry late) to the last one in flight.
//
// kSyncThreads = 0: the whole CTA shares the stream (its syncs are __syncthreads). Otherwise the
// kSyncThreads threads of one group (a warpgroup) own it: tid is the thread's index in the group
// and `bar` the named barrier the group syncs on, so that groups run their streams independently.
template <int kStages, int kSyncThreads = 0, int kRecs = 1>
struct EntryStream {
  static constexpr int kLead = kStages - 1;
  static constexpr int kRing = 2 * kStages * kRecs;
  int64_t begin, end, next;
  EntryRecord* ring;
  int tid;
  uint32_t bar;

  // The records of the first kLead entries, landed and visible to the group. Every thread of the
  // group constructs the stream.
  __device__ EntryStream(const EntryList& list, const EntryListParams& lp, int64_t begin_,
                         int64_t end_, EntryRecord* ring_, int tid_ = threadIdx.x, uint32_t bar_ = 0)
      : begin(begin_), end(end_), next(begin_), ring(ring_), tid(tid_), bar(bar_) {
    for (int64_t e = begin; e < begin + kLead * kRecs && e < end; e += kRecs) issue_records(list, lp, e);
    cp_async_commit();
    cp_async_wait_all();
    cutlass::arch::fence_view_async_shared();
    sync();
  }

  // The thread's index in the group (the CTA's streams read threadIdx.x afresh).
  __device__ int thread() const {
    if constexpr (kSyncThreads == 0)
      return threadIdx.x;
    else
      return tid;
  }

  __device__ void sync() const {
    if constexpr (kSyncThreads == 0)
      __syncthreads();
    else
      cutlass::arch::NamedBarrier::sync(kSyncThreads, bar);
  }

  __device__ int64_t index(int64_t e) const { return kRecs == 1 ? e - begin : (e - begin) / kRecs; }
  __device__ int stage(int64_t e) const { return static_cast<int>(index(e) % kStages); }
  __device__ int slot(int64_t e) const { return static_cast<int>(index(e) % (2 * kStages)) * kRecs; }
  __device__ const EntryRecord& record(int64_t e) const { return ring[slot(e)]; }
  __device__ const EntryRecord* records(int64_t e) const { return ring + slot(e); }

  // Entry e's records into its ring slots (cp.async; a missing one: count 0, by a plain store
  // that the group's next sync publishes).
  __device__ void issue_records(const EntryList& list, const EntryListParams& lp, int64_t e) {
#pragma unroll
    for (int h = 0; h < kRecs; ++h) {
      const int t = thread() - h * kEntryTokens;  // record h by the threads from h * 16 on
      if (e + h < end) {
        if (t >= 0) list.issue_record(lp, e + h, &ring[slot(e) + h], t);
      } else if (t == 0) {
        ring[slot(e) + h].count = 0;
      }
    }
  }

  // The rows of the first kStages - 1 entries (after the loads that ride with the first).
  template <class Issue>
  __device__ void start(const EntryList& list, const EntryListParams& lp, Issue&& issue) {
    for (int st = 0; st < kStages - 1; ++st) issue_next(list, lp, issue);
  }

  // Entry e has landed in its stage, and every thread is done with the stage issue_next refills.
  __device__ void wait() const {
    cp_async_wait<kStages - 2>();
    cutlass::arch::fence_view_async_shared();
    sync();
  }

  template <class Issue>
  __device__ void issue_next(const EntryList& list, const EntryListParams& lp, Issue&& issue) {
    if (next < end) issue(records(next), stage(next));
    if (next + kLead * kRecs < end) issue_records(list, lp, next + kLead * kRecs);
    cp_async_commit();
    next += kRecs;
  }
};

}  // namespace msa::cuda::kern
