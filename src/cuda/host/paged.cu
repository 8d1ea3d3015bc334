// Entry points of the Hopper backend's serving path (docs/contract.md §6): selection, attention
// and append over a paged KV cache. Each call: the kernels' limits, the value checks of its
// device inputs (check_values.h, skipped with Launch.check_values = false), then launches whose
// grids and workspace depend on shapes only, so a captured CUDA graph replays with new lengths
// and page tables.
//
//   paged_select_blocks  a prefill (max_q_len = 0): the training selection kernel
//                        (select_kernel) with the page table as its block iterator (FP8
//                        scores: over E4M3 copies of each sequence's pages; an E4M3 cache:
//                        over its pages' codes as 16-bit values, times the page scales); decode:
//                        paged_score_kernel (block scores, in passes of tokens that bound the
//                        score buffer) -> paged_topk_kernel
//   paged_forward        [selection] -> a prefill (max_q_len = 0): the training forward
//                        (fwd_kernel's query tiles, and in sparse mode its KV-block passes,
//                        kAuto's split) with the page table as its block iterator; decode:
//                        paged_attn_kernel (split over the tile's block union when the grid
//                        would not fill the GPU) -> [paged_combine_kernel]
//   paged_append         one copy kernel for k, v and k_idx (quantising into E4M3 caches)
//
// E4M3 caches (docs/contract.md §6): the score and attention kernels' E4M3 instances read the
// codes and apply the page scales (device/e4m3.cuh), as do FP8 queries (Q8KV8: codes converted
// to out's 16-bit type, q_scale in each row's score scale). A prefill over E4M3 caches runs the
// training kernels over 16-bit copies of its sequences' pages' codes (the conversion is exact):
// the selection (k_idx, the page scale times each block's maxima) and the attention (k and v,
// e4m3_kv_pages_kernel, and FP8 queries, e4m3_query_rows_kernel; the forward's scaled-keys
// instances apply each block's k scale and each row's q scale to its scores and the block's v
// scale to its values), each copy bounded in size (else the paged kernels).
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>

#include "../backend.h"
#include "../device/e4m3.cuh"
#include "../device/grid_dependency.cuh"
#include "../kernels/fp8_copy_kernel.cuh"
#include "../kernels/paged_topk_kernel.cuh"
#include "check_values.h"
#include "common.h"
#include "launch.h"
#include "plan.h"
#include "variants.h"

namespace msa::cuda {
namespace {

constexpr size_t kScoreBudget = size_t(256) << 20;  // bytes of block scores per pass
// A prefill over an E4M3 k_idx cache copies its codes as 16-bit values into nseq x max_pages
// slots of Bk rows (sized from shapes); past this many bytes it scores the pages as decode
// does instead (the score buffer of kScoreBudget), so a batch of many long page tables does not
// ask for a copy of every slot.
constexpr size_t kE4M3SlotBudget = size_t(1) << 30;
constexpr int32_t kMaxSplits = 32;
// A prefill's attention over an E4M3 K/V cache copies the codes of its sequences' pages as
// 16-bit values (nseq x max_pages slots of Bk rows, sized from shapes) for the training forward;
// past this many bytes of copy it takes the paged attention kernels instead.
constexpr size_t kE4M3KvCopyBudget = size_t(4) << 30;

int32_t max_pages_of(const PagedCache& c) { return static_cast<int32_t>(c.page_table.shape[1]); }
int32_t num_pages_of(const TensorRef& cache) { return static_cast<int32_t>(cache.shape[0]); }

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// Whether a cache tensor's pages are whole row ranges (page stride = Bk rows): the pages of one
// head are then one TMA tensor of pages * Bk rows, which the training kernels read by page id.
bool pages_are_rows(const TensorRef& c, int32_t bk) { return c.stride[0] == int64_t(bk) * c.stride[1]; }

kern::PagedKeys paged_keys(const PagedCache& c, const TensorRef& keys, int32_t bk) {
  kern::PagedKeys k;
  k.page_table = static_cast<const int32_t*>(c.page_table.data);
  k.pt_s0 = c.page_table.stride[0];
  k.seq_lens = static_cast<const int32_t*>(c.seq_lens.data);
  k.key_cap = max_pages_of(c) * bk;
  k.kv_rows = num_pages_of(keys) * bk;
  return k;
}

bool is_e4m3(const TensorRef& t) { return t.defined() && t.dtype == DType::kFloat8E4M3; }

// A cache tensor [pages, Bk, H, D] of 16-bit values or E4M3 codes: 16-byte rows for cp.async.
Status check_cache(const char* fn, const char* arg, const TensorRef& t) {
  if (!is_e4m3(t)) MSA_TRY(check_half(fn, arg, t));
  return check_aligned(fn, arg, t);
}

// The scale of an E4M3 cache tensor as the kernels read it: scale[page * step].
int64_t scale_step(const TensorRef& scale) { return scale.shape[0] == 1 ? 0 : scale.stride[0]; }

PagedArgs paged_args(const Problem& prob, const TensorRef& cu_q, const PagedCache& c,
                     int32_t tile_tokens) {
  PagedArgs a;
  a.cu_q = static_cast<const int32_t*>(cu_q.data);
  a.nseq = static_cast<int32_t>(cu_q.shape[0] - 1);
  a.Tq = static_cast<int32_t>(prob.T);
  a.seq_lens = static_cast<const int32_t*>(c.seq_lens.data);
  a.page_table = static_cast<const int32_t*>(c.page_table.data);
  a.pt_s0 = c.page_table.stride[0];
  a.max_pages = max_pages_of(c);
  a.block_size = prob.opts.block_size;
  a.tile_tokens = tile_tokens;
  a.num_tiles = kern::num_tile_ids(a.nseq, a.Tq, tile_tokens);
  return a;
}

// Tiles that can hold tokens: decode's bound (max_q_len per sequence) or a prefill's.
int64_t busy_tiles(const PagedArgs& a, int32_t max_q_len) {
  if (max_q_len > 0) return int64_t(a.nseq) * ceil_div(max_q_len, a.tile_tokens);
  return ceil_div(a.Tq, a.tile_tokens) + 1;
}

// ---- selection
struct SelectPlan {
  PagedScoreArgs score;
  kern::PagedTopkArgs topk;
  int64_t pass_tokens = 0;
  size_t bytes = 0;  // the score buffer
  // A prefill: the training selection kernel over the page table instead (no score buffer).
  bool query_tile = false;
  SelectArgs tile;
};

// A prefill over an E4M3 k_idx cache: its pages' codes as 16-bit values (nseq * max_pages slots
// of Bk rows), then a factor per slot row (written at each block's first row), then the slots'
// page table (slot x at page x; FP8 scores read the slots through it).
struct E4M3KeysLayout {
  size_t factor = 0, table = 0, bytes = 0;
  E4M3KeysLayout(const Problem& prob, const SelectArgs& s) {
    const size_t rows = size_t(s.nseq) * s.paged.key_cap * prob.Hik;
    factor = align_up(rows * prob.Di * 2);
    table = factor + align_up(rows * sizeof(float));
    bytes = table + align_up(size_t(s.nseq) * (s.paged.key_cap / prob.opts.block_size) * sizeof(int32_t));
  }
};

// The workspace of E4M3KeysLayout into the Args: the select kernel reads the slots (with FP8
// scores, the copies and the re-ranking read them through the slots' page table, and take the
// page scales as the keys' factor).
void set_e4m3_keys(const Problem& prob, void* ws, SelectArgs* s) {
  const E4M3KeysLayout l(prob, *s);
  char* base = static_cast<char*>(ws);
  Fp8CopyArgs& c = s->e4m3;
  c.keys16 = base;
  c.k_factor = reinterpret_cast<float*>(base + l.factor);
  c.table = reinterpret_cast<int32_t*>(base + l.table);
  s->k_idx = base;
  if (prob.opts.select_scores == SelectScores::kFp8) {
    s->paged.page_table = c.table;
    s->paged.pt_s0 = s->paged.key_cap / prob.opts.block_size;
    s->paged.kv_rows = static_cast<int32_t>(s->nseq * s->paged.key_cap);
  }
}

// The training selection kernel's limit on k (its per-row candidate lists fill shared memory).
constexpr int32_t kTileSelectMaxK = 32;

Status can_paged_select(const char* fn, const Problem& prob, const PagedSelectParams& p) {
  MSA_TRY(check_half(fn, "q_idx", p.q_idx));
  MSA_TRY(check_aligned(fn, "q_idx", p.q_idx));
  MSA_TRY(check_cache(fn, "cache.k_idx", p.cache.k_idx));
  MSA_TRY(check_head_dim(fn, "q_idx", prob.Di));
  MSA_TRY(check_block_size(fn, prob.opts.block_size));
  if (prob.idx_per_key() > kPagedScoreRows)
    return fail(fn, "q_idx", "the CUDA serving kernels take at most " + std::to_string(kPagedScoreRows) +
                                 " index heads per index key head, got " + std::to_string(prob.idx_per_key()));
  if (prob.k > 256)
    return fail(fn, "top_k", "the CUDA serving kernels take at most 256, got " + std::to_string(prob.k));
  if (prob.opts.select_scores == SelectScores::kFp8) {  // a prefill over a 16-bit cache (validated)
    MSA_TRY(can_select(fn, prob, p.q_idx, p.cache.k_idx, false));
    const int64_t slot_rows = (p.cu_seqlens_q.shape[0] - 1) * p.cache.page_table.shape[1] * prob.opts.block_size;
    if (slot_rows >= (int64_t(1) << 31))
      return fail(fn, "cache.page_table", "FP8 scores in a CUDA prefill copy nseq x max_pages x block_size = " +
                                              std::to_string(slot_rows) + " key rows, at most 2^31 - 1");
    if (prob.k > kTileSelectMaxK)
      return fail(fn, "top_k", "FP8 scores in a CUDA prefill take at most " + std::to_string(kTileSelectMaxK) +
                                   " (the selection kernel's candidate lists), got " + std::to_string(prob.k));
    if (!pages_are_rows(p.cache.k_idx, prob.opts.block_size))
      return fail(fn, "cache.k_idx", "FP8 scores in a CUDA prefill read pages that are whole row ranges "
                                     "(page stride = block_size rows)");
    const size_t slot_bytes = size_t(slot_rows) * prob.Hik * (prob.Di * 2 + 4);
    if (is_e4m3(p.cache.k_idx) && slot_bytes > kE4M3SlotBudget)
      return fail(fn, "cache.page_table", "FP8 scores over an E4M3 k_idx cache in a CUDA prefill convert "
                                          "nseq x max_pages pages first, " + std::to_string(slot_bytes) +
                                              " bytes, at most " + std::to_string(kE4M3SlotBudget));
  }
  return Status::Ok();
}

SelectPlan select_plan(const Problem& prob, const PagedSelectParams& p) {
  SelectPlan sp;
  PagedScoreArgs& a = sp.score;
  // Decode tiles of 16 index rows when a sequence's tokens x Gk fit, else 32.
  a.rows = p.max_q_len > 0 && p.max_q_len * prob.idx_per_key() <= kPagedScoreRowsDecode ? kPagedScoreRowsDecode
                                                                                          : kPagedScoreRows;
  static_cast<PagedArgs&>(a) = paged_args(prob, p.cu_seqlens_q, p.cache, a.rows / prob.idx_per_key());
  a.q_idx = p.q_idx.data;
  a.q_s0 = p.q_idx.stride[0];
  a.q_s1 = p.q_idx.stride[1];
  a.k_idx = p.cache.k_idx.data;
  a.k_s0 = p.cache.k_idx.stride[0];
  a.k_s1 = p.cache.k_idx.stride[1];
  a.k_s2 = p.cache.k_idx.stride[2];
  const bool e4m3 = is_e4m3(p.cache.k_idx);
  if (e4m3) {
    a.k_scale = static_cast<const float*>(p.cache.k_idx_scale.data);
    a.k_scale_step = scale_step(p.cache.k_idx_scale);
  }
  a.num_pages = num_pages_of(p.cache.k_idx);
  a.Hi = prob.Hi;
  a.Hik = prob.Hik;
  a.idx_per_key = prob.idx_per_key();
  a.scale = prob.opts.scale_idx;
  // Chunks of blocks: at most one whole wave of CTAs (as many as fit on every SM at once: a
  // second, partial wave would double a short call's time), from shapes only. The chunk count
  // rounds down: rounding up (5 chunks of 64 tiles for 264 slots) made a second wave.
  const int64_t per_sm = std::clamp<int64_t>(
      int64_t(227 * 1024) / int64_t(paged_score_smem(prob.Di, prob.opts.block_size, a.rows, e4m3) + 1024), 1, 8);
  const int64_t want = per_sm * int64_t(num_sms());
  const int64_t ctas = std::max<int64_t>(1, busy_tiles(a, p.max_q_len) * a.Hik);
  const int64_t chunks = std::max<int64_t>(1, std::min<int64_t>(a.max_pages, want / ctas));
  a.chunk_blocks = static_cast<int32_t>(std::max<int64_t>(1, ceil_div(a.max_pages, chunks)));
  a.num_chunks = static_cast<int32_t>(std::max<int64_t>(1, ceil_div(a.max_pages, a.chunk_blocks)));
  const size_t row_bytes = size_t(prob.Hi) * std::max(1, a.max_pages) * sizeof(float);
  sp.pass_tokens = std::max<int64_t>(1, std::min<int64_t>(prob.T, int64_t(kScoreBudget / row_bytes)));
  sp.bytes = align_up(size_t(sp.pass_tokens) * row_bytes);

  kern::PagedTopkArgs& t = sp.topk;
  t.cu_q = a.cu_q;
  t.nseq = a.nseq;
  t.Tq = a.Tq;
  t.seq_lens = a.seq_lens;
  t.cap = a.max_pages * a.block_size;
  t.block_size = a.block_size;
  t.Hi = prob.Hi;
  t.k = prob.k;
  t.sink_blocks = prob.opts.sink_blocks;
  t.local_blocks = prob.opts.local_blocks;
  t.max_pages = a.max_pages;
  t.block_idx = static_cast<int32_t*>(p.block_idx.data);
  t.bi_s0 = p.block_idx.stride[0];
  t.bi_s1 = p.block_idx.stride[1];

  // A prefill chunk (max_q_len = 0) scores every block of its sequences once per 256 index rows
  // with wgmma: the training selection kernel, its block b read from page page_table[s, b] (an
  // E4M3 cache: from a copy of its codes as the queries' 16-bit type, in the workspace).
  const int32_t bk = prob.opts.block_size;
  const size_t slot_rows = size_t(a.nseq) * a.max_pages * bk * prob.Hik;
  if (p.max_q_len == 0 && prob.k <= kTileSelectMaxK && prob.idx_per_key() <= 128 &&
      pages_are_rows(p.cache.k_idx, bk) && (!e4m3 || slot_rows * (prob.Di * 2 + 4) <= kE4M3SlotBudget)) {
    sp.query_tile = true;
    sp.bytes = 0;  // no score buffer
    SelectArgs& s = sp.tile;
    s = select_args(prob, p.q_idx, p.cache.k_idx, p.cu_seqlens_q, TensorRef{}, p.block_idx);
    s.k_s0 = p.cache.k_idx.stride[1];
    s.k_s1 = p.cache.k_idx.stride[2];
    s.paged = paged_keys(p.cache, p.cache.k_idx, bk);
    if (e4m3) {
      Fp8CopyArgs& c = s.e4m3;
      static_cast<SeqArgs&>(c) = static_cast<const SeqArgs&>(s);
      c.paged = s.paged;
      c.k_idx = s.k_idx;
      c.k_s0 = s.k_s0;
      c.k_s1 = s.k_s1;
      c.Hik = prob.Hik;
      c.block_size = bk;
      c.k_scale = a.k_scale;
      c.k_scale_step = a.k_scale_step;
      c.num_blocks = s.paged.kv_tiles(s.nseq, bk);
      s.e4m3_keys = true;
      s.k_s0 = int64_t(prob.Hik) * prob.Di;  // the copy's rows
      s.k_s1 = prob.Di;
      sp.bytes = E4M3KeysLayout(prob, s).bytes;
    }
    // FP8 scores: E4M3 copies of q_idx and of the sequences' pages (over an E4M3 cache: of its
    // dequantised keys, from the slots above), in the workspace after them.
    sp.bytes += select_fp8_bytes(prob, s.nseq, s.paged);
  }
  return sp;
}

Status run_select(const char* fn, const Problem& prob, SelectPlan sp, void* ws, DType dt,
                  cudaStream_t stream) {
  if (sp.query_tile && sp.tile.e4m3_keys) set_e4m3_keys(prob, ws, &sp.tile);
  if (sp.query_tile && prob.opts.select_scores == SelectScores::kFp8) {
    const size_t slots = sp.tile.e4m3_keys ? E4M3KeysLayout(prob, sp.tile).bytes : 0;
    set_select_fp8(prob, static_cast<char*>(ws) + slots, &sp.tile);
    if (sp.tile.e4m3_keys) sp.tile.copy.in_factor = sp.tile.rerank.k_factor = sp.tile.e4m3.k_factor;
  }
  if (sp.query_tile)
    return dispatch(fn, "q_idx", dt, prob.Di, prob.opts.block_size, [&](auto v) {
      using V = decltype(v);
      return launch_select<typename V::Element, V::kDim, V::kBlockN>(sp.tile, stream);
    });
  sp.score.scores = static_cast<float*>(ws);
  sp.topk.scores = sp.score.scores;
  for (int64_t lo = 0; lo < prob.T; lo += sp.pass_tokens) {
    const int64_t hi = std::min<int64_t>(prob.T, lo + sp.pass_tokens);
    sp.score.tok_lo = lo;
    sp.score.tok_hi = hi;
    MSA_TRY(dispatch(fn, "q_idx", dt, prob.Di, prob.opts.block_size, [&](auto v) {
      using V = decltype(v);
      return launch_paged_score<typename V::Element, V::kDim, V::kBlockN>(sp.score, stream);
    }));
    sp.topk.tok_lo = lo;
    const int64_t rows = (hi - lo) * prob.Hi;
    launch_grid(kern::paged_topk_kernel, static_cast<unsigned>(rows), kern::kTopkThreads, 0, stream, sp.topk);
    const cudaError_t e = cudaGetLastError();
    if (e != cudaSuccess) return cuda_error(fn, e);
  }
  return Status::Ok();
}

// ---- attention
struct AttnPlan {
  PagedAttnArgs attn;
  size_t part_o = 0, part_lse = 0, bytes = 0;
};

bool fp8_queries(const PagedForwardParams& p) { return p.q.dtype == DType::kFloat8E4M3; }

// The attention kernels' element type: q's, or for FP8 queries out's (the codes are converted to
// it exactly); named by its argument.
DType attn_dtype(const PagedForwardParams& p) { return fp8_queries(p) ? p.out.dtype : p.q.dtype; }
const char* attn_dtype_arg(const PagedForwardParams& p) { return fp8_queries(p) ? "out" : "q"; }

Status can_paged_attn(const char* fn, const Problem& prob, const PagedForwardParams& p) {
  // FP8 queries come over E4M3 caches (validated), so the E4M3 kernels take them.
  MSA_TRY(check_half(fn, attn_dtype_arg(p), fp8_queries(p) ? p.out : p.q));
  MSA_TRY(check_aligned(fn, "q", p.q));
  MSA_TRY(check_cache(fn, "cache.k", p.cache.k));
  MSA_TRY(check_cache(fn, "cache.v", p.cache.v));
  MSA_TRY(check_head_dim(fn, "q", prob.D));
  MSA_TRY(check_block_size(fn, prob.opts.block_size));
  if (prob.group() > kPagedAttnRows)
    return fail(fn, "q", "the CUDA serving kernels take at most " + std::to_string(kPagedAttnRows) +
                             " query heads per KV head, got " + std::to_string(prob.group()));
  if (prob.opts.mode == Mode::kSparse && prob.k > 256)
    return fail(fn, "top_k", "the CUDA serving kernels take at most 256, got " + std::to_string(prob.k));
  return Status::Ok();
}

// The call's outputs, named alike in PagedAttnArgs and FwdArgs (lse only when the call has one).
template <class Args>
void set_outputs(Args* a, const PagedForwardParams& p) {
  a->out = p.out.data;
  a->o_s0 = p.out.stride[0];
  a->o_s1 = p.out.stride[1];
  if (p.lse.defined()) {
    a->lse = static_cast<float*>(p.lse.data);
    a->lse_s0 = p.lse.stride[0];
    a->lse_s1 = p.lse.stride[1];
  }
}

AttnPlan attn_plan(const Problem& prob, const PagedForwardParams& p) {
  AttnPlan ap;
  PagedAttnArgs& a = ap.attn;
  const int32_t G = prob.group();
  // Decode whose rows (max_q_len tokens x G heads) fit one 16-row tile: the column layout.
  a.columns = p.max_q_len > 0 && int64_t(p.max_q_len) * G <= kPagedAttnColumnRows;
  static_cast<PagedArgs&>(a) =
      paged_args(prob, p.cu_seqlens_q, p.cache, (a.columns ? kPagedAttnColumnRows : kPagedAttnRows) / G);
  a.num_pages = num_pages_of(p.cache.k);
  a.q = p.q.data;
  a.q_s0 = p.q.stride[0];
  a.q_s1 = p.q.stride[1];
  a.k = p.cache.k.data;
  a.k_s0 = p.cache.k.stride[0];
  a.k_s1 = p.cache.k.stride[1];
  a.k_s2 = p.cache.k.stride[2];
  a.v = p.cache.v.data;
  a.v_s0 = p.cache.v.stride[0];
  a.v_s1 = p.cache.v.stride[1];
  a.v_s2 = p.cache.v.stride[2];
  if (is_e4m3(p.cache.k)) {  // k and v are E4M3 together (validated)
    a.k_scale = static_cast<const float*>(p.cache.k_scale.data);
    a.k_scale_step = scale_step(p.cache.k_scale);
    a.v_scale = static_cast<const float*>(p.cache.v_scale.data);
    a.v_scale_step = scale_step(p.cache.v_scale);
  }
  if (fp8_queries(p)) {  // q_scale [1] or [Tq, Hq]
    a.q_scale = static_cast<const float*>(p.q_scale.data);
    if (p.q_scale.rank == 2) {
      a.qs_s0 = p.q_scale.stride[0];
      a.qs_s1 = p.q_scale.stride[1];
    }
  }
  a.Hq = prob.Hq;
  a.Hkv = prob.Hkv;
  a.group = G;
  a.dense = prob.opts.mode == Mode::kDense;
  if (!a.dense) {
    a.Hi = prob.Hi;
    a.heads_per_idx = prob.heads_per_idx();
    a.idx_per_kv = prob.Hi / prob.Hkv;
    a.block_idx = static_cast<const int32_t*>(p.block_idx.data);
    a.bi_s0 = p.block_idx.stride[0];
    a.bi_s1 = p.block_idx.stride[1];
    a.top_k = prob.k;
    int32_t cap = 32;
    while (cap < a.tile_tokens * a.idx_per_kv * a.top_k) cap *= 2;
    a.union_cap = cap;
  } else {
    a.Hi = prob.Hkv;
    a.heads_per_idx = G;
    a.idx_per_kv = 1;
  }
  a.scale_log2 = prob.opts.scale * 1.4426950408889634f;
  set_outputs(&a, p);
  // Split the block union when the tiles alone would leave SMs idle (decode's small batches):
  // into as many splits as one wave of kPagedAttnCtasPerSm CTAs per SM (either layout) holds,
  // rounded down, since a few CTAs past the wave would take a second round of its latency.
  const int64_t ctas = std::max<int64_t>(1, busy_tiles(a, p.max_q_len) * prob.Hkv);
  a.splits = static_cast<int32_t>(
      std::clamp<int64_t>(int64_t(kPagedAttnCtasPerSm) * num_sms() / ctas, 1, kMaxSplits));
  if (a.splits > 1) {
    const size_t rows = size_t(prob.T) * prob.Hq * a.splits;
    ap.part_o = 0;
    ap.part_lse = align_up(rows * prob.D * sizeof(float));
    ap.bytes = ap.part_lse + align_up(rows * sizeof(float));
  }
  return ap;
}

// ---- prefill attention: the training forward (kernels/fwd_kernel.cuh: 128-row query tiles,
// wgmma, K and V by TMA) reading block b of sequence s from page page_table[s, b], with the
// tokens' key positions offset to the end of their cached sequence. Taken for prefill calls
// (max_q_len = 0) whose cache pages are whole row ranges (page stride = Bk rows, so the pages
// are one TMA tensor of pages * Bk rows) and whose heads one query tile packs; decode keeps
// paged_attn_kernel, which packs a few tokens' rows and splits the union over CTAs.
//
// A sparse prefill takes the training forward's passes (run_forward_passes) over the same paged
// keys: with fwd_pass kKvBlock or kSplit, or kAuto where the call's workspace holds their plan
// (paged_forward_workspace asks for it), the KV-block pass walks the sequences' pages
// (kern::PagedKeys::kv_tile) and kAuto picks the split or the plain query tiles on the device.
struct PrefillPlan {
  bool use = false;
  FwdArgs fwd;
  size_t bytes = 0;  // a scratch LSE [Tq, Hq] when the call asks for none (the kernel writes it)
  // An E4M3 K/V cache: its pages' codes as 16-bit values, their scales and the copies' page
  // table (E4M3KvCopyArgs), copy_bytes of the workspace after the scratch LSE.
  bool e4m3 = false;
  E4M3KvCopyArgs copy;
  size_t copy_bytes = 0;
  // The KV-block passes: planned (their limits hold; else `why` says which fails), and asked
  // for by fwd_pass (else kAuto's); their plan lies in the workspace after the scratch LSE.
  bool passes = false, asked = false;
  Status why;
  Plan plan;
  size_t total() const { return bytes + copy_bytes + (passes ? plan.total : 0); }
};

// The E4M3 copy's parts: k16 and v16 (slot rows x Hkv x D each), kv_scale, table; with FP8
// queries q16 [Tq, Hq, D] and q_factor [Tq, Hq].
struct KvCopyLayout {
  size_t k16 = 0, v16 = 0, scale = 0, table = 0, q16 = 0, q_factor = 0, bytes = 0;
  KvCopyLayout(int64_t slots, const Problem& prob, bool fp8_q) {
    const size_t half = align_up(size_t(slots) * prob.opts.block_size * prob.Hkv * prob.D * 2);
    v16 = half;
    scale = 2 * half;
    table = scale + align_up(size_t(slots) * prob.Hkv * sizeof(float2));
    q16 = table + align_up(size_t(slots) * sizeof(int32_t));
    const size_t rows = fp8_q ? size_t(prob.T) * prob.Hq : 0;
    q_factor = q16 + align_up(rows * prob.D * 2);
    bytes = q_factor + align_up(rows * sizeof(float));
  }
};

// Points the copy and the forward's K, V, page table and scales at the workspace `ws`.
void set_kv_copy(const Problem& prob, void* ws, PrefillPlan* pp) {
  const KvCopyLayout l(pp->copy.num_tiles, prob, pp->copy.q != nullptr);
  char* base = static_cast<char*>(ws);
  E4M3KvCopyArgs& c = pp->copy;
  c.k16 = base + l.k16;
  c.v16 = base + l.v16;
  c.kv_scale = reinterpret_cast<float2*>(base + l.scale);
  c.table = reinterpret_cast<int32_t*>(base + l.table);
  FwdArgs& a = pp->fwd;
  a.k = c.k16;
  a.v = c.v16;
  a.kv_scale = c.kv_scale;
  a.paged.page_table = c.table;
  if (c.q != nullptr) {  // FP8 queries
    c.q16 = base + l.q16;
    c.q_factor = reinterpret_cast<float*>(base + l.q_factor);
    a.q = c.q16;
    a.q_factor = c.q_factor;
  }
}

PrefillPlan prefill_plan(const Problem& prob, const PagedForwardParams& p) {
  PrefillPlan pp;
  const bool dense = prob.opts.mode == Mode::kDense;
  const int32_t bk = prob.opts.block_size;
  const int32_t groups = dense ? prob.Hkv : prob.Hi;
  if (p.max_q_len != 0 || groups <= 0 || groups % prob.Hkv != 0 || prob.Hq % groups != 0 ||
      prob.Hq / groups > kQueryTileRows || !pages_are_rows(p.cache.k, bk) || !pages_are_rows(p.cache.v, bk))
    return pp;
  // An E4M3 cache (k and v together, validated) through a 16-bit copy of its pages' codes
  // (and of FP8 queries' codes), within kE4M3KvCopyBudget and TMA's 32-bit row coordinates.
  const int64_t slots = int64_t(p.cu_seqlens_q.shape[0] - 1) * max_pages_of(p.cache);
  if (is_e4m3(p.cache.k)) {
    const KvCopyLayout l(slots, prob, fp8_queries(p));
    if (slots * bk >= (int64_t(1) << 31) || l.bytes > kE4M3KvCopyBudget) return pp;
    pp.e4m3 = true;
    pp.copy_bytes = l.bytes;
  }
  pp.use = true;
  FwdArgs& a = pp.fwd;
  a.cu_seqlens = static_cast<const int32_t*>(p.cu_seqlens_q.data);
  a.nseq = static_cast<int32_t>(p.cu_seqlens_q.shape[0] - 1);
  a.T = static_cast<int32_t>(prob.T);
  a.Hq = prob.Hq;
  a.Hkv = prob.Hkv;
  a.Hi = groups;
  a.heads_per_idx = prob.Hq / groups;
  a.idx_per_kv = groups / prob.Hkv;
  a.tile_tokens = kQueryTileRows / a.heads_per_idx;
  a.top_k = prob.k;
  a.dense = dense;
  if (!dense) {
    a.block_idx = static_cast<const int32_t*>(p.block_idx.data);
    a.bi_s0 = p.block_idx.stride[0];
    a.bi_s1 = p.block_idx.stride[1];
  }
  a.paged = paged_keys(p.cache, p.cache.k, bk);
  a.uni = kern::UnionLayout::make(dense, a.paged.key_cap, bk, a.tile_tokens, prob.k);
  a.num_tiles = kern::num_tile_ids(a.nseq, a.T, a.tile_tokens);
  a.tok_hi = a.T;
  a.q = p.q.data;
  a.q_s0 = p.q.stride[0];
  a.q_s1 = p.q.stride[1];
  a.k = p.cache.k.data;
  a.k_s0 = p.cache.k.stride[1];
  a.k_s1 = p.cache.k.stride[2];
  a.v = p.cache.v.data;
  a.v_s0 = p.cache.v.stride[1];
  a.v_s1 = p.cache.v.stride[2];
  if (pp.e4m3) {
    E4M3KvCopyArgs& c = pp.copy;
    static_cast<SeqArgs&>(c) = static_cast<const SeqArgs&>(a);
    c.paged = a.paged;
    c.k = a.k;
    c.v = a.v;
    c.k_s0 = a.k_s0;
    c.k_s1 = a.k_s1;
    c.v_s0 = a.v_s0;
    c.v_s1 = a.v_s1;
    c.k_scale = static_cast<const float*>(p.cache.k_scale.data);
    c.k_scale_step = scale_step(p.cache.k_scale);
    c.v_scale = static_cast<const float*>(p.cache.v_scale.data);
    c.v_scale_step = scale_step(p.cache.v_scale);
    c.Hkv = prob.Hkv;
    c.D = prob.D;
    c.block_size = bk;
    c.num_tiles = slots;
    if (fp8_queries(p)) {  // q_scale [1] or [Tq, Hq]
      c.q = p.q.data;
      c.q_s0 = p.q.stride[0];
      c.q_s1 = p.q.stride[1];
      c.q_scale = static_cast<const float*>(p.q_scale.data);
      if (p.q_scale.rank == 2) {
        c.qs_s0 = p.q_scale.stride[0];
        c.qs_s1 = p.q_scale.stride[1];
      }
      c.Hq = prob.Hq;
      a.q_s0 = int64_t(prob.Hq) * prob.D;  // the copy's rows
      a.q_s1 = prob.D;
    }
    // The forward reads the copies: rows of Hkv x D, slot x at page x of an nseq x max_pages table.
    a.k_s0 = a.v_s0 = int64_t(prob.Hkv) * prob.D;
    a.k_s1 = a.v_s1 = prob.D;
    a.paged.pt_s0 = max_pages_of(p.cache);
    a.paged.kv_rows = static_cast<int32_t>(slots * bk);
  }
  set_outputs(&a, p);
  if (!p.lse.defined()) {
    pp.bytes = align_up(size_t(prob.T) * prob.Hq * sizeof(float));
    a.lse_s0 = prob.Hq;
    a.lse_s1 = 1;
  }
  a.scale = std::fabs(prob.opts.scale);
  a.scale_log2 = a.scale * 1.4426950408889634f;
  a.negate = prob.opts.scale < 0.f;
  pp.asked = kv_block_forward(prob) || split_forward(prob);
  if (pp.asked || auto_forward(prob)) {
    const char* fn = "paged_forward";
    pp.why = fwd_kv_plan(fn, prob, a.nseq, &pp.plan, a.paged.kv_tiles(a.nseq, bk));
    if (pp.why.ok() && !kv_block_forward(prob)) pp.why = can_split(fn, prob, a.paged.key_cap);
    pp.passes = pp.why.ok();
  }
  return pp;
}

Status need(const char* fn, size_t bytes, const Launch& launch) {
  if (bytes == 0) return Status::Ok();
  if (launch.workspace == nullptr || launch.workspace_bytes < bytes)
    return detail::invalid_arg(fn, "launch.workspace",
                               "expected at least " + std::to_string(bytes) + " bytes (workspace_size), got " +
                                   std::to_string(launch.workspace == nullptr ? 0 : launch.workspace_bytes));
  return Status::Ok();
}

PagedSelectParams select_part(const PagedForwardParams& p) {
  PagedSelectParams s;
  s.q_idx = p.q_idx;
  s.cu_seqlens_q = p.cu_seqlens_q;
  s.cache = p.cache;
  s.block_idx = p.block_idx;
  s.max_q_len = p.max_q_len;
  s.opts = p.opts;
  s.launch = p.launch;
  return s;
}

// ---- append: one thread per element of the new rows, k, v, k_idx in turn: a 16-bit copy, or
// into an E4M3 cache the code nearest to float32(x) / scale[page] (the division rounded once).
enum AppendSource : int32_t { kCopy16 = 0, kFromBf16 = 1, kFromFp16 = 2, kFromFp32 = 3 };

struct AppendArgs {
  const int32_t* cu_q = nullptr;
  int32_t nseq = 0, Tq = 0, block_size = 0, max_pages = 0, cap = 0;
  const int32_t* seq_lens = nullptr;
  const int32_t* page_table = nullptr;
  int64_t pt_s0 = 0;
  struct Part {
    const void* src = nullptr;
    int64_t s0 = 0, s1 = 0;
    void* dst = nullptr;
    int64_t d0 = 0, d1 = 0, d2 = 0;
    int32_t H = 0, D = 0, pages = 0;
    int32_t source = kCopy16;      // how the rows are read (E4M3 caches: any of the float types)
    const float* scale = nullptr;  // E4M3 cache: scale[page * scale_step]
    int64_t scale_step = 0;
  } part[3];
};

__device__ float append_source(const AppendArgs::Part& p, int64_t off) {
  if (p.source == kFromBf16) return __bfloat162float(static_cast<const __nv_bfloat16*>(p.src)[off]);
  if (p.source == kFromFp16) return __half2float(static_cast<const __half*>(p.src)[off]);
  return static_cast<const float*>(p.src)[off];
}

__global__ void paged_append_kernel(const __grid_constant__ AppendArgs a) {
  grid_dependency_begin();
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  for (int w = 0; w < 3; ++w) {
    const AppendArgs::Part& p = a.part[w];
    if (p.src == nullptr) continue;
    const int64_t n = int64_t(a.Tq) * p.H * p.D;
    for (int64_t e = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; e < n; e += stride) {
      const int64_t t = e / (int64_t(p.H) * p.D);
      const int32_t h = static_cast<int32_t>(e / p.D % p.H), d = static_cast<int32_t>(e % p.D);
      int32_t s = 0;
      const int32_t pos = kern::paged_position(a.cu_q, a.nseq, a.Tq, a.seq_lens, a.cap, t, &s);
      const int32_t b = min(pos / a.block_size, a.max_pages - 1);
      int32_t page = a.page_table[s * a.pt_s0 + b];
      page = page < 0 ? 0 : (page >= p.pages ? p.pages - 1 : page);
      const int64_t src = t * p.s0 + h * p.s1 + d, dst = page * p.d0 + (pos % a.block_size) * p.d1 + h * p.d2 + d;
      if (p.source == kCopy16) {
        static_cast<uint16_t*>(p.dst)[dst] = static_cast<const uint16_t*>(p.src)[src];
      } else {
        const float x = __fdiv_rn(append_source(p, src), kern::page_scale(p.scale, p.scale_step, page));
        static_cast<uint8_t*>(p.dst)[dst] = kern::e4m3_from_float(x);
      }
    }
  }
}

}  // namespace

Status paged_select_blocks(const Problem& prob, const PagedSelectParams& p) {
  const char* fn = "paged_select_blocks";
  MSA_TRY(can_paged_select(fn, prob, p));
  const SelectPlan sp = select_plan(prob, p);
  MSA_TRY(need(fn, sp.bytes, p.launch));
  if (prob.T == 0) return Status::Ok();
  DeviceGuard guard(p.q_idx.device.index);
  MSA_TRY(check_paged_values(fn, prob, p.cu_seqlens_q, p.cache, TensorRef{}, p.max_q_len, p.launch));
  return run_select(fn, prob, sp, p.launch.workspace, p.q_idx.dtype, static_cast<cudaStream_t>(p.launch.stream));
}

Status paged_forward(const Problem& prob, const PagedForwardParams& p) {
  const char* fn = "paged_forward";
  const bool dense = prob.opts.mode == Mode::kDense;
  MSA_TRY(can_paged_attn(fn, prob, p));
  const bool select = !dense && p.select;
  SelectPlan sp;
  if (select) {
    MSA_TRY(can_paged_select(fn, prob, select_part(p)));
    sp = select_plan(prob, select_part(p));
  }
  PrefillPlan pf = prefill_plan(prob, p);
  AttnPlan ap;
  if (pf.use && pf.asked) MSA_TRY(pf.why);  // the passes fwd_pass asks for cannot run
  if (!pf.use) ap = attn_plan(prob, p);
  // kAuto's passes where the workspace holds them (else the plain query tiles).
  const bool passes = pf.use && pf.passes &&
                      (pf.asked || (p.launch.workspace != nullptr && p.launch.workspace_bytes >= pf.total()));
  // Selection and attention run one after the other: the larger of the two workspaces.
  MSA_TRY(need(fn, std::max(sp.bytes, pf.use ? (passes ? pf.total() : pf.bytes + pf.copy_bytes) : ap.bytes), p.launch));
  if (prob.T == 0) return Status::Ok();
  DeviceGuard guard(p.q.device.index);
  MSA_TRY(check_paged_values(fn, prob, p.cu_seqlens_q, p.cache,
                             dense || select ? TensorRef{} : p.block_idx, p.max_q_len, p.launch,
                             fp8_queries(p) ? p.q_scale : TensorRef{}));
  const cudaStream_t stream = static_cast<cudaStream_t>(p.launch.stream);
  void* ws = p.launch.workspace;
  if (select) MSA_TRY(run_select(fn, prob, sp, ws, p.q_idx.dtype, stream));
  if (pf.use) {
    if (pf.fwd.lse == nullptr) pf.fwd.lse = static_cast<float*>(ws);
    const DType dt = attn_dtype(p);
    if (pf.e4m3) {  // the codes as the 16-bit type (after the selection: the workspace is reused)
      set_kv_copy(prob, static_cast<char*>(ws) + pf.bytes, &pf);
      MSA_TRY(dispatch(fn, attn_dtype_arg(p), dt, prob.D, prob.opts.block_size, [&](auto v) {
        using E = typename decltype(v)::Element;
        launch_grid(kern::e4m3_kv_pages_kernel<E>,
                    dim3(static_cast<unsigned>(pf.copy.num_tiles), static_cast<unsigned>(prob.Hkv)), 128, 0,
                    stream, pf.copy);
        if (pf.copy.q != nullptr) {
          const int64_t threads = prob.T * prob.Hq * (prob.D / 16);
          const unsigned blocks = static_cast<unsigned>(std::min<int64_t>(ceil_div(threads, 256), int64_t(num_sms()) * 16));
          launch_grid(kern::e4m3_query_rows_kernel<E>, blocks, 256, 0, stream, pf.copy);
        }
        const cudaError_t e = cudaGetLastError();
        return e == cudaSuccess ? Status::Ok() : cuda_error(fn, e);
      }));
    }
    if (passes)
      return run_forward_passes(fn, prob, dt, fwd_kv_args(prob, pf.fwd), pf.fwd, p.block_idx, pf.plan,
                                split_forward(prob), !pf.asked, static_cast<char*>(ws) + pf.bytes + pf.copy_bytes,
                                stream);
    return dispatch(fn, attn_dtype_arg(p), dt, prob.D, prob.opts.block_size, [&](auto v) {
      using V = decltype(v);
      return launch_forward<typename V::Element, V::kDim, V::kBlockN>(pf.fwd, stream);
    });
  }
  if (ap.attn.splits > 1) {
    ap.attn.part_o = at<float>(ws, ap.part_o);
    ap.attn.part_lse = at<float>(ws, ap.part_lse);
  }
  return dispatch(fn, attn_dtype_arg(p), attn_dtype(p), prob.D, prob.opts.block_size, [&](auto v) {
    using V = decltype(v);
    return launch_paged_attn<typename V::Element, V::kDim, V::kBlockN>(ap.attn, stream);
  });
}

Status paged_append(const PagedAppendParams& p) {
  const char* fn = "paged_append";
  const TensorRef* srcs[3] = {&p.k, &p.v, &p.k_idx};
  const TensorRef* dsts[3] = {&p.cache.k, &p.cache.v, &p.cache.k_idx};
  const TensorRef* scales[3] = {&p.cache.k_scale, &p.cache.v_scale, &p.cache.k_idx_scale};
  const char* names[3] = {"k", "v", "k_idx"};
  AppendArgs a;
  a.cu_q = static_cast<const int32_t*>(p.cu_seqlens_q.data);
  a.nseq = static_cast<int32_t>(p.cu_seqlens_q.shape[0] - 1);
  a.seq_lens = static_cast<const int32_t*>(p.cache.seq_lens.data);
  a.page_table = static_cast<const int32_t*>(p.cache.page_table.data);
  a.pt_s0 = p.cache.page_table.stride[0];
  a.max_pages = max_pages_of(p.cache);
  a.block_size = p.block_size;
  a.cap = a.max_pages * a.block_size;
  int device = -1;
  for (int w = 0; w < 3; ++w) {
    const TensorRef& s = *srcs[w];
    if (!s.defined()) continue;
    const TensorRef& d = *dsts[w];
    int32_t source = kCopy16;
    if (is_e4m3(d)) {
      if (s.dtype == DType::kBFloat16) source = kFromBf16;
      else if (s.dtype == DType::kFloat16) source = kFromFp16;
      else if (s.dtype == DType::kFloat32) source = kFromFp32;
      else
        return fail(fn, names[w], std::string("the CUDA backend quantises float32, bfloat16 or float16 rows, got ") +
                                      dtype_name(s.dtype));
    } else {
      MSA_TRY(check_half(fn, names[w], s));
    }
    a.Tq = static_cast<int32_t>(s.shape[0]);
    device = s.device.index;
    a.part[w] = {s.data, s.stride[0], s.stride[1], d.data, d.stride[0], d.stride[1], d.stride[2],
                 static_cast<int32_t>(s.shape[1]), static_cast<int32_t>(s.shape[2]), static_cast<int32_t>(d.shape[0]),
                 source};
    if (source != kCopy16) {
      a.part[w].scale = static_cast<const float*>(scales[w]->data);
      a.part[w].scale_step = scale_step(*scales[w]);
    }
  }
  if (device < 0 || a.Tq == 0) return Status::Ok();
  DeviceGuard guard(device);
  Problem prob;
  prob.T = a.Tq;
  prob.opts.block_size = p.block_size;
  MSA_TRY(check_paged_values(fn, prob, p.cu_seqlens_q, p.cache, TensorRef{}, 0, p.launch));
  int64_t n = 0;
  for (const auto& part : a.part) n = std::max<int64_t>(n, int64_t(a.Tq) * part.H * part.D);
  const int blocks = static_cast<int>(std::min<int64_t>(ceil_div(n, 256), int64_t(num_sms()) * 8));
  launch_grid(paged_append_kernel, blocks, 256, 0, static_cast<cudaStream_t>(p.launch.stream), a);
  const cudaError_t e = cudaGetLastError();
  return e == cudaSuccess ? Status::Ok() : cuda_error(fn, e);
}

size_t paged_select_workspace(const Problem& prob, const PagedSelectParams& p) {
  if (!can_paged_select("paged_select_blocks", prob, p).ok()) return 0;
  return select_plan(prob, p).bytes;
}

size_t paged_forward_workspace(const Problem& prob, const PagedForwardParams& p) {
  if (!can_paged_attn("paged_forward", prob, p).ok()) return 0;
  const PrefillPlan pf = prefill_plan(prob, p);
  size_t bytes = pf.use ? pf.total() : attn_plan(prob, p).bytes;
  if (prob.opts.mode == Mode::kSparse && p.select && can_paged_select("paged_forward", prob, select_part(p)).ok())
    bytes = std::max(bytes, select_plan(prob, select_part(p)).bytes);
  return bytes;
}

}  // namespace msa::cuda
