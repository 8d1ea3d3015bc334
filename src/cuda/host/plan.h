// The host plan of a call, built once before anything is launched:
//   can_*      the kernels' own limits on a validated Problem (each failure names the argument
//              and the limit: kNotSupported);
//   *_args     the kernels' Args (args.h) from the API's tensors: the one parameter chain;
//   Plan       the device workspace of the backward and of the KL value (reverse index, work
//              lists, fixed-point sums), and its byte offsets.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "../../core/problem.h"
#include "args.h"
#include "msa/params.h"

namespace msa::cuda {

using detail::Problem;

// Workspace parts start 256 bytes apart: a part's bytes rounded up.
inline size_t align_up(size_t x) { return (x + 255) / 256 * 256; }

// The tensors of the KL branch (backward's KL gradient, the KL value), from a call's params; a
// selection's (the index LSE of select_blocks) has no main branch.
struct KlInputs {
  TensorRef q, k, lse, q_idx, k_idx, cu_seqlens, cu_seqlens_k, block_idx;
  template <class P>
  explicit KlInputs(const P& p)
      : q(p.q), k(p.k), lse(p.lse), q_idx(p.q_idx), k_idx(p.k_idx), cu_seqlens(p.cu_seqlens),
        cu_seqlens_k(p.cu_seqlens_k), block_idx(p.block_idx) {}
  explicit KlInputs(const SelectParams& p)
      : q_idx(p.q_idx), k_idx(p.k_idx), cu_seqlens(p.cu_seqlens), cu_seqlens_k(p.cu_seqlens_k),
        block_idx(p.block_idx) {}
};

// ---- limits
Status can_select(const char* fn, const Problem& prob, const TensorRef& q_idx,
                  const TensorRef& k_idx, bool with_lse_idx);
Status can_forward(const char* fn, const Problem& prob, const ForwardParams& p);
Status can_backward(const Problem& prob, const BackwardParams& p);
Status can_kl(const char* fn, const Problem& prob, const KlInputs& in);
// Whether the sparse forward walks KV blocks (Options.fwd_pass; kAuto: the query-tile forward),
// and that kernel's own limits (k <= 32, Hq / Hi <= 64; failures name 'fwd_pass').
bool kv_block_forward(const Problem& prob);
// Options.fwd_pass = kSplit (sparse mode).
bool split_forward(const Problem& prob);
// Options.fwd_pass = kAuto in sparse mode where the KV-block pass can run: the pass is chosen on
// the device (pass_choice_kernel) when the call's workspace holds the KV-block plan.
bool auto_forward(const Problem& prob);
Status can_fwd_kv(const char* fn, const Problem& prob);
// The split's limits: the KV-block pass's, and the key blocks its counting kernel holds (failures
// name 'fwd_pass'). keys: of the longest sequence's key space (0: the T packed tokens').
Status can_split(const char* fn, const Problem& prob, int64_t keys = 0);
// How the backward computes the KL gradient (Options.kl_pass): inside the KV-side pass (kFused),
// from the teacher that pass writes (kTeacher: sparse mode), or by a pass of its own. The first
// two need the teacher's head mean as a butterfly over accumulator columns (Hq / Hi a power of
// two); kAuto takes kTeacher in sparse mode, kFused in dense mode.
enum class KlRoute { kSeparate, kFused, kTeacher };
KlRoute kl_route(const Problem& prob);
// Whether the backward computes dq from dS (Options.dq_pass; kAuto: where it can run). `kl`:
// the call wants the KL gradient.
bool dq_from_ds(const Problem& prob, bool kl);

// ---- the parameter chain
// cu_k: the keys' offsets where they lie apart from the tokens (cu_seqlens_k; undefined: none).
SelectArgs select_args(const Problem& prob, const TensorRef& q_idx, const TensorRef& k_idx,
                       const TensorRef& cu, const TensorRef& cu_k, const TensorRef& block_idx);
// Options.select_scores = kFp8: the workspace of the E4M3 copies (0 otherwise), and the Args
// that make them there and select over them (`ws`: at least select_fp8_bytes; packed keys, or
// a prefill's pages `paged`, as the Args hold them).
size_t select_fp8_bytes(const Problem& prob, int32_t nseq, const kern::PagedKeys& paged);
size_t select_fp8_bytes(const Problem& prob, const TensorRef& cu_seqlens);  // packed keys, or apart
// kFp8 with fp8_rerank > 0 (sparse mode): the width of a shortlist row, top_k + fp8_rerank; else 0.
int32_t rerank_width(const Problem& prob);
void set_select_fp8(const Problem& prob, void* ws, SelectArgs* a);
FwdArgs forward_args(const Problem& prob, const ForwardParams& p);
// The index branch's LSE over the support (the forward kernel in LSE-only mode over q_idx, k_idx;
// one row per index head) into lse_idx [T, Hi] with strides (s0, s1).
FwdArgs index_lse_args(const Problem& prob, const KlInputs& in, float* lse_idx, int64_t s0,
                       int64_t s1);
BwdQArgs bwd_q_args(const Problem& prob, const BackwardParams& p, const float* delta);
BwdKvArgs bwd_kv_args(const Problem& prob, const BackwardParams& p, const float* delta);
// dq from dS over all query tiles (a pass sets its tokens and tile ids: set_tile_pass).
BwdDqArgs bwd_dq_args(const Problem& prob, const BackwardParams& p);
// A query-tile kernel's pass over the tokens [tok_lo, tok_hi): the tile ids that may hold them.
void set_tile_pass(QueryTileArgs* a, int64_t tok_lo, int64_t tok_hi);
// The KV-block forward over the tensors, selection and keys of the query-tile forward's `q`
// (sparse mode).
FwdKvArgs fwd_kv_args(const Problem& prob, const FwdArgs& q);
KlArgs kl_args(const Problem& prob, const KlInputs& in);

// ---- workspace
struct Plan {
  bool sparse = false, kl = false, grad = false;
  int64_t n = 0;         // reverse-index slots T * Hi * k
  int64_t entries = 0;   // a bound of the KV-side entries (sparse: records)
  int32_t Hi_group = 0;  // column groups of the KV side
  int32_t m = 0;         // tokens per KV-side entry
  int tbits = 0, sbits = 0, end_bit = 0;  // key bits: token, slot; all
  int seg_bit = 0;  // the segment's first bit (tbits + sbits): the keys are sorted from there
  uint64_t invalid = 0;
  size_t cub_bytes = 0;
  // byte offsets (sparse: keys_a, keys_b: the sort's buffers, then the segment starts; flags;
  // starts, records: the entries; count: unique keys, entries)
  size_t delta = 0, keys_a = 0, keys_b = 0, flags = 0, starts = 0, records = 0, count = 0, cub = 0;
  int64_t segments = 0;  // sparse: (KV tile, KV head, index head of it) segments
  size_t seg_start = 0;  // ... and each one's first record, [segments + 1]
  size_t lse_idx = 0, dq_acc = 0, dk_acc = 0, kl_acc = 0, total = 0;
  // A KV-side work list: bwd_kv's (chunks bounded by the partial-sum slots they may need) or
  // the KL kernel's (fixed-point atomics: any chunk size is free).
  struct Work {
    int32_t chunk = 0;
    int64_t grid = 0, slots = 0;
    size_t num_chunks = 0, chunk_start = 0, num_slots = 0, slot_start = 0, arrivals = 0,
           partials = 0;
    // The items longest first (build_work): their entry counts, sorted; their ids, sorted.
    size_t sizes = 0, sizes_sorted = 0, ids = 0, order = 0;
    size_t cta = 0;  // [grid] kern::CtaWork
  };
  int32_t items = 0;
  int size_bits = 32;  // bits of an item's entry count (the bound of every list's entries)
  Work kv, kl_work;  // kv: bwd_kv's list, or the KV-block forward's; kl_work: the KL passes'
  // KlRoute::kTeacher: bwd_kv and kl_grad run `passes` times over bwd_kv's work list, each over
  // the CTAs whose first record is in [pass * pass_records, (pass + 1) * pass_records); the
  // teacher buffer holds one pass's records (4 Bk m bytes each).
  bool teacher = false;
  int32_t passes = 1, step_records = 1;
  int32_t lse_step_records = 1;  // ... and the LSE pass's (kl_lse_kernel)
  int64_t pass_records = 0;
  size_t teacher_buf = 0;
  size_t lse_part = 0;  // ... and LSE_idx's partials, [T, Hi, k] float2
  // ... and dq_idx's rows of one pass of tokens (KvSideArgs::dq_part: [tokens, Hi, k, Di] fp32),
  // where they fit their budget (dq_rows); else dq_idx takes the fixed-point sums (dq_acc).
  bool dq_rows = false;
  size_t dq_part = 0;
  int64_t fwd_tokens = 0;            // the KV-block forward: tokens per pass
  size_t part_o = 0, part_ml = 0;    // ... and its partial outputs of one pass
  size_t choice = 0;                 // ... and kAuto's two sums (pass_choice_kernel)
  size_t items_seen = 0;             // ... and its bit per work item
  size_t items_seen_bytes() const { return 4 * ((size_t(items) + 31) / 32); }
  size_t taken = 0;                  // ... and the split's taken entries [T, Hi, k]
  // dq from dS: the backward runs in passes of bwd_tokens tokens (0: dq by the query tiles),
  // each with its own reverse index, dS tiles (`ds`) and dq pass; with several passes dK and dV
  // are fp32 sums (`dk_sum`, `dv_sum`, [T, Hkv, D]) until the last.
  int64_t bwd_tokens = 0;
  int32_t bwd_passes = 0;
  size_t ds = 0, dk_sum = 0, dv_sum = 0;
};

// main: the attention backward (delta, bwd_kv's work list); kl: the KL branch; grad: its
// gradient (else the KL terms).
// fwd_tokens > 0: the KV-block forward's plan for passes of that many tokens; bwd_tokens > 0:
// the backward's passes of that many tokens (dq from dS). paged_kv_tiles > 0: the KV tiles of
// a prefill's paged keys (kern::PagedKeys::kv_tiles) instead of the packed tokens'.
Status make_plan(const char* fn, const Problem& prob, int32_t nseq, bool sparse, bool main,
                 bool kl, bool grad, Plan* out, int64_t fwd_tokens = 0, int64_t bwd_tokens = 0,
                 int64_t paged_kv_tiles = 0);
Status fwd_kv_plan(const char* fn, const Problem& prob, int32_t nseq, Plan* pl, int64_t paged_kv_tiles = 0);
Status backward_plan(const Problem& prob, const BackwardParams& p, Plan* pl);
Status kl_plan(const char* fn, const Problem& prob, const KlInputs& in, Plan* pl);
// A caller's workspace holds the plan.
Status need_workspace(const char* fn, const Plan& pl, const Launch& launch);
Status need_bytes(const char* fn, size_t bytes, const Launch& launch);

}  // namespace msa::cuda
