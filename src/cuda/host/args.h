// The parameter chain of the Hopper kernels: TensorRef (the public API) -> one Args struct per
// kernel family, built once per call on the host (builders in plan.h) -> the kernel's Params,
// which derive from the Args and add only what depends on the instantiation (TMA descriptors;
// host/launch.cuh). Kernels read these fields directly; pointers are untyped here and typed by the
// kernel (kern::as<Element>).
#pragma once

#include <cstdint>

#include "../device/block_list.cuh"
#include "../device/entry_list.cuh"

namespace msa::cuda {

// Rows of a query tile: the Q-tile kernels pack m tokens x the G query heads of one head group
// into this many MMA rows (selection: 256, see select_kernel.cuh).
constexpr int kQueryTileRows = 128;
constexpr int kSelectTileRows = 256;
// Rows of the paged kernels' tiles: index rows (token x index head) of a score tile, and query rows
// (token x query head of one KV head) of an attention tile.
constexpr int kPagedScoreRows = 32;
constexpr int kPagedScoreRowsDecode = 16;  // a decode call whose max_q_len x Gk rows fit in 16
constexpr int kPagedAttnRows = 64;
// The attention kernel's column layout (one 16-row tile, the warps over each block's keys), for a
// decode call whose max_q_len x G rows fit in it; the CTAs per SM both layouts are built for
// (their shared memory and registers), which the split count fills one wave of.
constexpr int kPagedAttnColumnRows = 16;
constexpr int kPagedAttnCtasPerSm = 2;
constexpr int kPagedScoreStages = 3;
// Shared memory of a score CTA (Q rows, the k_idx stages, the per-warp maxima), for sizing a grid
// to whole waves on the host. E4M3 keys: stages of codes (one byte per element).
constexpr size_t paged_score_smem(int Di, int Bk, int rows = kPagedScoreRows, bool e4m3 = false) {
  const size_t keys = size_t(kPagedScoreStages) * Bk * Di * (e4m3 ? 1 : 2);
  return size_t(rows) * Di * 2 + keys + 4 * rows * 4;
}

// Packed sequences: cu_seqlens (null: one sequence of T tokens).
struct SeqArgs {
  const int32_t* cu_seqlens = nullptr;
  int32_t nseq = 1;
  int32_t T = 0;
};

// What the query-tile kernels (forward, bwd_q) share: the tile geometry and the block list.
// Hi here is the number of tile head groups: index heads, or KV heads in dense mode.
struct QueryTileArgs : SeqArgs {
  const int32_t* block_idx = nullptr;  // [T, Hi, k] (sparse mode)
  int64_t bi_s0 = 0, bi_s1 = 0;
  int32_t Hq = 0, Hkv = 0, Hi = 0;
  int32_t heads_per_idx = 0;  // G of a tile: Hq / Hi
  int32_t idx_per_kv = 0;     // Hi / Hkv
  int32_t tile_tokens = 0;    // m = kQueryTileRows / heads_per_idx
  int32_t top_k = 0;          // block_idx width (k)
  bool dense = false;
  kern::UnionLayout uni;  // the block-union arrays (zero in dense mode)
  // The grid covers the tile ids [tile_lo, tile_lo + num_tiles) (grid.x = num_tiles); a pass of
  // tokens [tok_lo, tok_hi) (set_tile_pass) writes only its tokens' rows, and tiles with none
  // do nothing.
  int64_t num_tiles = 0;
  int64_t tile_lo = 0;
  int64_t tok_lo = 0, tok_hi = 0;
  // The keys' layout: K and V in a paged cache (a serving prefill), or packed apart from the
  // tokens (cu_seqlens_k); default: the tokens' own.
  kern::PagedKeys paged;
};

// The split forward (Options.fwd_pass = kSplit, device/pass_choice.cuh): a query tile keeps the
// blocks at least share_min of its tokens selected; pass_choice_kernel marks in `taken` (all T
// tokens) every entry the KV-block pass does not compute (those blocks, invalid entries, a
// block's later columns in a row), and the tile merges the partials of the rows' unmarked
// entries, which the KV-block pass wrote (none of the (max, sum) slots is cleared before it).
// part_o null: not split.
struct FwdSplitArgs {
  const void* part_o = nullptr;    // FwdKvArgs::part_o of the pass
  const float* part_ml = nullptr;  // FwdKvArgs::part_ml of the pass
  uint8_t* taken = nullptr;        // [T, Hi, k]: written by pass_choice_kernel (0: a partial)
  int32_t share_min = 0;
  // Set at launch: where the consumer threads' slots for their next partials start in the
  // kernel's shared memory (after the union arrays); 0 where they do not fit, and the tile then
  // merges its partials after its mainloop only.
  uint32_t slot_offset = 0;
};

// Attention forward (kernels/fwd_kernel.cuh); also the index branch's LSE over a selection
// (lse_only: q = q_idx, k = k_idx, heads = index heads).
struct FwdArgs : QueryTileArgs {
  const void *q = nullptr, *k = nullptr, *v = nullptr;
  int64_t q_s0 = 0, q_s1 = 0, k_s0 = 0, k_s1 = 0, v_s0 = 0, v_s1 = 0;
  void* out = nullptr;
  int64_t o_s0 = 0, o_s1 = 0;
  float* lse = nullptr;
  int64_t lse_s0 = 0, lse_s1 = 0;
  float scale = 0.f;       // |softmax scale|
  float scale_log2 = 0.f;  // |scale| * log2(e)
  bool negate = false;     // the scale is negative: Q is negated on load and |scale| used
  bool lse_only = false;   // LSE only: no V, no out
  FwdSplitArgs split;
  // Options.fwd_pass = kAuto with the split planned: the sums of pass_choice_kernel; the kernel
  // runs the split where they choose it, else the plain pass.
  const unsigned long long* choice = nullptr;
  // A prefill over an E4M3 K/V cache: k and v hold its codes as 16-bit values (a copy,
  // kern::e4m3_kv_pages_kernel) and kv_scale[x * Hkv + r] the (k, v) scales of KV tile x
  // (PagedKeys' numbering) of KV head r: the kernels' instance with scaled keys applies them.
  // With FP8 queries q holds their codes as 16-bit values too and q_factor[t * Hq + h] each
  // row's q_scale (else null: 1), which that instance multiplies into the row's scores.
  const float2* kv_scale = nullptr;
  const float* q_factor = nullptr;
};

// E4M3 copies of the index inputs for FP8 selection scores (kernels/fp8_copy_kernel.cuh).
struct Fp8CopyArgs : SeqArgs {
  const void *q_idx = nullptr, *k_idx = nullptr;  // the inputs, their dtype
  int64_t q_s0 = 0, q_s1 = 0, k_s0 = 0, k_s1 = 0;
  int32_t Hi = 0, Hik = 0, block_size = 0;
  bool negate = false;  // scale_idx < 0: the q_idx codes' signs flipped
  uint8_t *q8 = nullptr, *k8 = nullptr;  // [T, Hi, Di], [key rows, Hik, Di] codes
  float* k_factor = nullptr;             // [key rows, Hik]: written at each block's first row
  int64_t num_blocks = 0;                // grid.x of fp8_blocks_kernel: KV tile ids
  // k_idx in a paged cache (a prefill): KV tile x = block b of sequence s (PagedKeys::kv_tile)
  // is copied from its page to key rows x * Bk ... (the select kernel's slot of that block).
  kern::PagedKeys paged;
  // A prefill over an E4M3 k_idx cache (the inputs' scores, e4m3_pages_kernel): k_idx holds its
  // codes, each page's codes go exactly into the queries' 16-bit type at keys16 (the slots as
  // above) and its scale, scale[page * scale_step], to k_factor.
  const float* k_scale = nullptr;
  int64_t k_scale_step = 0;
  void* keys16 = nullptr;
  int32_t* table = nullptr;  // e4m3_pages_kernel, when set: x at table[x] (the slots' page table)
  // fp8_blocks_kernel: the keys it reads carry a factor per block (the slots of an E4M3 cache's
  // codes as 16-bit values: the page scale at the block's first row, as k_factor): the values
  // it quantises are float32(key * factor), the cache's dequantised keys.
  const float* in_factor = nullptr;
};

// A prefill over an E4M3 K/V cache (kernels/fp8_copy_kernel.cuh, e4m3_kv_pages_kernel): for KV
// tile x (block b of sequence s, PagedKeys' numbering) and KV head r, its page's k and v codes
// exactly into the 16-bit copies k16 and v16 at rows x * Bk ... ([rows, Hkv, D], the rows past
// the sequence's last key zeroed), its page's (k, v) scales to kv_scale[x * Hkv + r], and x to
// table[x]: the copies' page table (nseq x max_pages, slot x is page x), which the training
// forward reads as a 16-bit cache (FwdArgs::kv_scale).
struct E4M3KvCopyArgs : SeqArgs {
  kern::PagedKeys paged;  // the cache's page table and lengths
  const void *k = nullptr, *v = nullptr;  // the cache's codes
  int64_t k_s0 = 0, k_s1 = 0, v_s0 = 0, v_s1 = 0;  // row and head strides
  const float *k_scale = nullptr, *v_scale = nullptr;  // scale[page * step]
  int64_t k_scale_step = 0, v_scale_step = 0;
  int32_t Hkv = 0, D = 0, block_size = 0;
  int64_t num_tiles = 0;  // nseq x max_pages: grid.x
  void *k16 = nullptr, *v16 = nullptr;
  float2* kv_scale = nullptr;
  int32_t* table = nullptr;
  // FP8 queries (e4m3_query_rows_kernel): the codes q [Tq, Hq, D] (strides q_s0, q_s1) exactly
  // into q16 [Tq, Hq, D], and each row's q_scale ([1], or [Tq, Hq] with strides qs_s0, qs_s1)
  // into q_factor [Tq, Hq].
  const void* q = nullptr;
  int64_t q_s0 = 0, q_s1 = 0;
  const float* q_scale = nullptr;
  int64_t qs_s0 = 0, qs_s1 = 0;
  int32_t Hq = 0;
  void* q16 = nullptr;
  float* q_factor = nullptr;
};

// The re-ranking of FP8 shortlists (Options.fp8_rerank = m > 0; kernels/rerank_kernel.cuh).
// The select kernel leaves each row's shortlist (its best free slots + m blocks by FP8 score,
// ascending ids, -1 after) in `cand` and the row's place in block_idx in `rows`; the re-ranking
// lists the entries of each (KV tile, index key head) segment, in buckets of one range of
// 2^range_shift tokens each (bucket = seg * ranges + range: `seg_count`, `seg_start`,
// `entries`), scores them by the inputs (`score`, one CTA per chunk of kRerankChunk entries of
// a segment, kRerankRows at a time over the block's keys loaded once: `chunk_start`), and picks
// the slots.
// With Options.fp8_rerank_slots = a in (0, free slots) the select kernel marks the best (free
// slots - a) of a row's shortlist by FP8 score as kept (kRerankKept set in `cand`): the list
// kernels leave them out and the pick takes them first.
constexpr int kRerankRows = 128;
constexpr int kRerankTiles = 4;
constexpr int kRerankChunk = kRerankRows * kRerankTiles;
constexpr int32_t kRerankKept = 1 << 30;
struct RerankArgs {
  int32_t m = 0;      // 0: no re-ranking
  int32_t slots = 0;  // Options.fp8_rerank_slots: the free slots re-ranked (0: all)
  int32_t width = 0;  // of a shortlist row: k + m
  const void *q_idx = nullptr, *k_idx = nullptr;  // the inputs (not the E4M3 copies)
  int64_t q_s0 = 0, q_s1 = 0, k_s0 = 0, k_s1 = 0;
  bool negate = false;  // scale_idx < 0: q_idx is negated where it is loaded
  int32_t* cand = nullptr;       // [T * Hi, width]
  int2* rows = nullptr;          // [T * Hi]: (the sequence's first KV tile id, n_sink | n_chosen << 16)
  int32_t ranges = 1, range_shift = 0;  // token ranges of a segment's buckets
  int32_t* seg_count = nullptr;  // [nseg * ranges + 1]: per bucket
  int32_t* seg_start = nullptr;  // [nseg * ranges + 1]: exclusive scan of seg_count
  int32_t* chunk_start = nullptr;  // [nseg + 1]: exclusive scan of the segments' chunk counts
  int32_t* entries = nullptr;    // [T * Hi * width]: shortlist positions (row * width + c) by segment
  float* score = nullptr;        // [T * Hi * width]: the inputs' block score of each entry
  const float* k_factor = nullptr;  // k_idx's factor per block (Fp8CopyArgs::in_factor), or none
  int64_t nseg = 0;              // KV tile ids x Hik
  int64_t grid = 0;              // CTAs of the score kernel: an upper bound of the chunk count
  void* cub = nullptr;
  size_t cub_bytes = 0;
};

// Index selection (kernels/select_kernel.cuh).
struct SelectArgs : SeqArgs {
  const void *q_idx = nullptr, *k_idx = nullptr;
  int64_t q_s0 = 0, q_s1 = 0, k_s0 = 0, k_s1 = 0;
  int32_t* block_idx = nullptr;
  int64_t bi_s0 = 0, bi_s1 = 0;
  int32_t Hik = 0;
  int32_t idx_per_key = 0;  // Gk = Hi / Hik
  int32_t tile_tokens = 0;  // kSelectTileRows / Gk
  int32_t k = 0, sink_blocks = 0, local_blocks = 0;
  float scale = 0.f;  // |scale_idx|
  bool negate = false;
  int64_t num_tiles = 0;
  kern::PagedKeys paged;  // k_idx in a paged cache (a serving prefill); default: packed
  // Options.select_scores = kFp8: the E4M3 copies `copy` makes first (into the workspace)
  // replace q_idx and k_idx (then codes: packed like the keys, or a prefill's pages as KV tile
  // slots), and each block's maxima are scaled by its copy.k_factor.
  bool fp8 = false;
  Fp8CopyArgs copy;
  RerankArgs rerank;  // FP8 scores with fp8_rerank > 0
  // A prefill over an E4M3 k_idx cache: its codes as 16-bit values (the e4m3 copy below).
  bool e4m3_keys = false;
  // A prefill's keys read from a copy in KV tile slots (FP8 scores, or e4m3_keys): block b of
  // sequence s at slot s * max_pages + b, each block's maxima scaled by its copy's k_factor.
  __host__ __device__ bool slots() const { return paged.page_table != nullptr && (fp8 || e4m3_keys); }
  // e4m3_keys: the conversion of an E4M3 cache's pages (e4m3_pages_kernel), run first; its
  // slots are the keys (k_factor: the page scales), or with FP8 scores the keys `copy`
  // quantises (in_factor) and the re-ranking scores, through the slots' page table.
  Fp8CopyArgs e4m3;

  // Rows of the key tensor the select kernel reads: T packed keys or Tk keys apart (or their
  // copies), the pages' rows, or the copies of a prefill's pages: nseq * max_pages slots of Bk
  // rows.
  __host__ __device__ int32_t key_rows() const {
    return paged.page_table == nullptr ? paged.rows(T) : (slots() ? nseq * paged.key_cap : paged.kv_rows);
  }
  // The key row of block 0 of the tile's sequence in that tensor (0 where a page table places
  // each block); k_factor is indexed from it as well.
  __device__ int64_t key_row0(const kern::QueryTile& t) const {
    return paged.page_table == nullptr ? paged.key_start(t) : (slots() ? int64_t(t.seq) * paged.key_cap : 0);
  }
  // Block b's page (null: block b is tile b from key_row0).
  __device__ const int32_t* pages(const kern::QueryTile& t) const { return slots() ? nullptr : paged.pages(t); }
};

// Attention backward, query side (kernels/bwd_q_kernel.cuh).
struct BwdQArgs : QueryTileArgs {
  const void *q = nullptr, *k = nullptr, *v = nullptr, *dout = nullptr;
  int64_t q_s0 = 0, q_s1 = 0, k_s0 = 0, k_s1 = 0, v_s0 = 0, v_s1 = 0, do_s0 = 0, do_s1 = 0;
  const float* lse = nullptr;
  int64_t lse_s0 = 0, lse_s1 = 0;
  const float* delta = nullptr;  // [T, Hq] contiguous: rowsum(dO * O)
  void* dq = nullptr;
  int64_t dq_s0 = 0, dq_s1 = 0;
  float scale = 0.f, scale_log2 = 0.f;  // signed
};

// The most records of a step of the KL branch's LSE pass (kernels/kl_lse_kernel.cuh): m = 4
// tokens each fill its 128 query rows; fewer rows where m < 4.
constexpr int kLseStepRecords = 32;

// What the KV-side kernels (bwd_kv, kl) share: the entry lists and the work list.
// Hi: the column groups (index heads; KV heads in dense mode without the KL branch).
struct KvSideArgs : SeqArgs {
  kern::EntryListParams list{};
  kern::WorkListParams work{};
  int64_t grid = 0;  // CTAs: an upper bound of the chunk count
  int32_t Hq = 0, Hkv = 0, Hi = 0;
  int32_t heads_per_idx = 0;  // Gi = Hq / Hi <= 64
  int32_t idx_per_kv = 0;     // Hi / Hkv
  int32_t group_tokens = 0;   // m, kern::group_tokens(Gi)
  // The index branch (KL gradient, KL value); q_idx null: none.
  const void *q_idx = nullptr, *k_idx = nullptr;
  int64_t qi_s0 = 0, qi_s1 = 0, ki_s0 = 0, ki_s1 = 0;
  const float* lse_idx = nullptr;  // [T, Hi] contiguous
  unsigned long long* dq_idx = nullptr;  // [T, Hi, Di] fixed point (2^-32 units)
  // kl_grad_kernel with dq_part set: each selected (token t, index head i, block_idx column c)'s
  // dq_idx product, unscaled, to its own row dq_part[((t - part_tok_lo) * Hi + i) * top_k + c]
  // of Di floats (the tokens of one pass), instead of adding it to dq_idx.
  float* dq_part = nullptr;
  int64_t part_tok_lo = 0;
  unsigned long long* dk_idx = nullptr;  // [key rows, Hik, Di] fixed point
  int32_t Hik = 1, idx_per_key = 1;
  float scale_idx = 0.f;  // signed
  // Options.kl_pass = kTeacher: bwd_kv_kernel writes each entry's teacher (the mean of P^T over
  // the index head's Gi query heads, [record][key][m] fp32) and kl_grad_kernel reads it. The
  // records are taken in passes: with pass_end > 0 a launch does the CTAs whose first record is
  // in [pass_first, pass_end), and `teacher` holds the records from pass_first on.
  float* teacher = nullptr;
  int64_t pass_first = 0, pass_end = 0;
  // The entries per chunk of the list whose chunks the passes take (bwd_kv's, of which this
  // list's chunks are pieces: kl_grad_kernel's list cuts them finer); 0: this list's own.
  int32_t pass_chunk = 0;
  // Records per step: kl_grad_kernel's (their tokens: the kKlGradTokens = 32 index columns),
  // kl_lse_kernel's.
  int32_t step_records = 1;
  // The LSE pass (kl_lse_kernel; set: that pass): [T, Hi, top_k] (max in log2 units, sum) of
  // each selected block's index logits, at the block's column of block_idx (zeroed first).
  float* lse_part = nullptr;
  int32_t top_k = 0;  // block_idx width (k)
  // The keys' layout (KV tiles by PagedKeys::tile_of): packed apart from the tokens
  // (cu_seqlens_k), or a prefill's paged cache (the KV-block forward); default: the tokens' own.
  kern::PagedKeys paged;
};

// Attention backward, KV side (kernels/bwd_kv_kernel.cuh), with the KL gradient when q_idx is set.
struct BwdKvArgs : KvSideArgs {
  const void *q = nullptr, *k = nullptr, *v = nullptr, *dout = nullptr;
  int64_t q_s0 = 0, q_s1 = 0, k_s0 = 0, k_s1 = 0, v_s0 = 0, v_s1 = 0, do_s0 = 0, do_s1 = 0;
  const float* lse = nullptr;
  int64_t lse_s0 = 0, lse_s1 = 0;
  const float* delta = nullptr;
  void *dk = nullptr, *dv = nullptr;
  int64_t dk_s0 = 0, dk_s1 = 0, dv_s0 = 0, dv_s1 = 0;
  float scale = 0.f, scale_log2 = 0.f;  // signed
  // dq from dS (Options.dq_pass = kFromDs): every entry's dS, in the element type (the values
  // the dK product uses), to ds[((t - ds_tok_lo) * Hi + i) * top_k + slot] as a [Bk keys][Gi
  // heads] tile (dS^T of token t, index head i, block_idx column slot); at Gi = 2 and 4 as
  // [Bk / 64][Gi heads][64 keys] (each head's keys contiguous, so that bwd_dq loads 16 bytes at
  // a time, not a key's 4 or 8); null: not written.
  void* ds = nullptr;
  int64_t ds_tok_lo = 0;
  // Passes of tokens: dK (unscaled) and dV are added to these fp32 [key rows, Hkv, D] sums (zeroed
  // before the first pass) instead of written; null: written to dk and dv.
  float *dk_acc = nullptr, *dv_acc = nullptr;
};

// dq from dS (kernels/bwd_dq_kernel.cuh): dq = scale * sum over the selected blocks of dS K for
// the tokens [tok_lo, tok_hi) of a pass, from the dS tiles bwd_kv_kernel wrote (BwdKvArgs::ds).
struct BwdDqArgs : QueryTileArgs {
  const void *k = nullptr, *v = nullptr;  // v: only for the K stream's descriptors (never read)
  int64_t k_s0 = 0, k_s1 = 0, v_s0 = 0, v_s1 = 0;
  const void* ds = nullptr;  // of the tokens [tok_lo, tok_hi)
  void* dq = nullptr;
  int64_t dq_s0 = 0, dq_s1 = 0;
  float scale = 0.f;  // signed
};

// Attention forward, KV-block-outer (kernels/fwd_kv_kernel.cuh) over the tokens [tok_lo, tok_hi)
// of a pass: the partials, then their combine into out and lse.
struct FwdKvArgs : KvSideArgs {
  const void *q = nullptr, *k = nullptr, *v = nullptr;
  int64_t q_s0 = 0, q_s1 = 0, k_s0 = 0, k_s1 = 0, v_s0 = 0, v_s1 = 0;
  const int32_t* block_idx = nullptr;  // [T, Hi, k]
  int64_t bi_s0 = 0, bi_s1 = 0;
  // The partial slots, (token, block_idx column, head) in that order, so that the heads of a
  // token's column (an entry's rows, a warp's rows in the tiles' merge) lie together:
  // part_o [tok_hi - tok_lo, k, Hq, D] element type, unnormalised O, its columns in the order of
  // device/partials.cuh; part_ml [tok_hi - tok_lo, k, Hq, 2], max (log2 units) and sum. Without
  // `taken` the sum is 0 where there is no partial (fwd_zero_kernel clears them), with it only
  // the unmarked slots are written.
  void* part_o = nullptr;
  float* part_ml = nullptr;
  void* out = nullptr;
  int64_t o_s0 = 0, o_s1 = 0;
  float* lse = nullptr;
  int64_t lse_s0 = 0, lse_s1 = 0;
  int64_t tok_lo = 0, tok_hi = 0;
  int32_t block_size = 0;  // (top_k: KvSideArgs's)
  float scale_log2 = 0.f;  // signed
  // kAuto: pass_choice_kernel's sums; the KV-block kernels do nothing unless they choose the split.
  const unsigned long long* choice = nullptr;
  // The split: the entries marked here ([tok_hi - tok_lo, Hi, k]: the query tiles' and those
  // with no partial) are skipped by the reverse index, and the query tiles merge the partials of
  // the others themselves (no combine kernel).
  const uint8_t* taken = nullptr;
  const float2* kv_scale = nullptr;  // FwdArgs::kv_scale
  const float* q_factor = nullptr;   // FwdArgs::q_factor
};

// The KL branch as a pass of its own (kernels/kl_kernel.cuh): the gradient sums and/or the
// per-row KL terms; null outputs are skipped.
struct KlArgs : KvSideArgs {
  const void *q = nullptr, *k = nullptr;
  int64_t q_s0 = 0, q_s1 = 0, k_s0 = 0, k_s1 = 0;
  const float* lse = nullptr;
  int64_t lse_s0 = 0, lse_s1 = 0;
  unsigned long long* kl_rows = nullptr;  // [T, Hi] fixed point
  float scale_log2 = 0.f;                 // signed
};

// ---- Serving over a paged KV cache (docs/contract.md §6; host/paged.cu) -------------------------

// The new tokens of a paged call and the cache's page table. Sequence s has n_s new tokens
// (cu_q) at positions seq_lens[s] - n_s ...; its key position x lives in page
// page_table[s * pt_s0 + x / Bk], row x % Bk. Kernels clamp every value they read from these
// (lengths to [0, max_pages * Bk], page ids to [0, num_pages)), so malformed values never send an
// access outside the tensors.
struct PagedArgs {
  const int32_t* cu_q = nullptr;  // [nseq + 1]
  int32_t nseq = 0;
  int32_t Tq = 0;
  const int32_t* seq_lens = nullptr;    // [nseq]
  const int32_t* page_table = nullptr;  // [nseq, max_pages]
  int64_t pt_s0 = 0;
  int32_t max_pages = 0, num_pages = 0;
  int32_t block_size = 0;
  int32_t tile_tokens = 0;  // new tokens per tile (kern::decode_tile over cu_q)
  int64_t num_tiles = 0;    // grid.x
};

// Index scores of the new tokens (kernels/paged_score_kernel.cuh): the block max of
// scale_idx * q_idx . k_idx over the causal keys of each block, for the packed tokens
// [tok_lo, tok_hi) of a pass, into scores[(t - tok_lo) * Hi + i][b] (row stride max_pages).
struct PagedScoreArgs : PagedArgs {
  const void* q_idx = nullptr;
  int64_t q_s0 = 0, q_s1 = 0;
  const void* k_idx = nullptr;  // cache [pages, Bk, Hik, Di]
  int64_t k_s0 = 0, k_s1 = 0, k_s2 = 0;
  const float* k_scale = nullptr;  // E4M3 k_idx: its scale (null: a 16-bit cache)
  int64_t k_scale_step = 0;        // the scale of page p is k_scale[p * step]
  int32_t Hi = 0, Hik = 0, idx_per_key = 0;  // Gk = Hi / Hik <= kPagedScoreRows
  int32_t rows = kPagedScoreRows;            // index rows of a tile (the kernel's instance)
  float scale = 0.f;                         // signed scale_idx
  float* scores = nullptr;
  int32_t chunk_blocks = 0, num_chunks = 0;  // grid.z: chunks of chunk_blocks logical blocks
  int64_t tok_lo = 0, tok_hi = 0;
};

// Sparse (or, dense: every causal key) attention of the new tokens over the cache
// (kernels/paged_attn_kernel.cuh). A tile is tile_tokens tokens x the G query heads of one KV
// head (grid.y); it visits the union of its rows' selections, split over grid.z = splits CTAs;
// with splits > 1 each writes a normalised partial output and its LSE for the combine.
struct PagedAttnArgs : PagedArgs {
  const void* q = nullptr;
  int64_t q_s0 = 0, q_s1 = 0;
  const void *k = nullptr, *v = nullptr;  // cache [pages, Bk, Hkv, D]
  int64_t k_s0 = 0, k_s1 = 0, k_s2 = 0, v_s0 = 0, v_s1 = 0, v_s2 = 0;
  const float *k_scale = nullptr, *v_scale = nullptr;  // E4M3 k and v: their scales (null: 16-bit)
  int64_t k_scale_step = 0, v_scale_step = 0;          // the scale of page p: scale[p * step]
  // FP8 queries (Q8KV8, over E4M3 k and v): q holds E4M3 codes, and row (t, h) is scaled by
  // q_scale[t * qs_s0 + h * qs_s1] (strides 0: one scale); null: 16-bit queries.
  const float* q_scale = nullptr;
  int64_t qs_s0 = 0, qs_s1 = 0;
  int32_t Hq = 0, Hkv = 0, Hi = 0;
  int32_t group = 0;          // G = Hq / Hkv
  int32_t heads_per_idx = 0;  // Hq / Hi
  int32_t idx_per_kv = 0;     // Hi / Hkv
  const int32_t* block_idx = nullptr;  // [Tq, Hi, k] (sparse)
  int64_t bi_s0 = 0, bi_s1 = 0;
  int32_t top_k = 0;
  int32_t union_cap = 0;  // sort slots of a tile's selections: a power of two >= m * idx_per_kv * k
  bool dense = false;
  bool columns = false;    // the column layout (kPagedAttnColumnRows rows per tile)
  float scale_log2 = 0.f;  // signed scale * log2(e)
  void* out = nullptr;
  int64_t o_s0 = 0, o_s1 = 0;
  float* lse = nullptr;  // optional
  int64_t lse_s0 = 0, lse_s1 = 0;
  int32_t splits = 1;
  float* part_o = nullptr;    // [splits, Tq, Hq, D]: normalised partial outputs
  float* part_lse = nullptr;  // [splits, Tq, Hq]: their LSE (natural log)
};

}  // namespace msa::cuda
