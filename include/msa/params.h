// Parameter structs of the public MSA API: the only contract between a caller and a backend.
//
// Shapes use the names of the contract (docs/contract.md): T packed query/key tokens, Hq/Hkv main heads, D main head
// dim, Hi/Hik index query/key heads, Di index head dim, k blocks per (token, index head).
// Tokens are packed FlashAttention-style; `cu_seqlens` [nseq+1] (int32) marks the sequences
// (absent: one sequence of T tokens). Every tensor's last dimension must be contiguous; the
// other strides are free. All tensors of one call live on one device, which picks the backend.
//
// Keys apart from queries (`cu_seqlens_k`, optional, in SelectParams, ForwardParams,
// BackwardParams and KlParams): [nseq+1] int32 offsets that pack the key-side tensors (k, v,
// k_idx and their gradients dk, dv, dk_idx: Tk rows) by sequence, while `cu_seqlens` packs the
// query-side ones (q, q_idx, block_idx, out, lse, dout, dq, dq_idx, lse_idx, kl_rows: T rows).
// Sequence s has m_s keys and n_s <= m_s queries, its queries being its last n_s positions:
// query u of it sits at position m_s - n_s + u and sees keys 0 .. that position (causal
// attention aligned to the bottom right, as FlashAttention aligns it). A chunk of queries after
// a prefix, or a context-parallel rank's queries over the keys it gathered, needs no rows for
// the keys' own queries. Absent: the keys are the queries' tokens (Tk = T, m_s = n_s). Without
// `cu_seqlens`, `cu_seqlens_k` must hold one sequence ([2]). docs/contract.md §1.
#pragma once

#include <cstddef>
#include <cstdint>

#include "msa/types.h"

namespace msa {

// kSparse: attention over the selected blocks (docs/contract.md §3). kDense: the warmup variant (docs/contract.md §5),
// dense causal attention with the KL taken over the full causal support; block_idx is unused.
enum class Mode : int32_t { kSparse = 0, kDense = 1 };

// How a backend computes the KL gradient of the index branch (backward with dq_idx or dk_idx).
// kAuto: the backend's choice (CUDA, when Hq / Hi is a power of two: kTeacher in sparse mode,
// kFused in dense mode; else kSeparate). kFused: inside the KV-side pass, or kNotSupported
// naming 'kl_pass' where that pass cannot carry it. kTeacher (sparse mode): the KV-side pass
// computes only the teacher (the head mean of the attention probabilities), writes it to the
// workspace (`kl_teacher_bytes` per pass), and a KV-side pass of the index branch alone turns it
// into the gradient; kNotSupported naming 'kl_pass' where it cannot run. kSeparate: a pass of
// its own that recomputes the attention scores (for comparison). The CPU backend has one
// implementation and accepts every value. Results agree to rounding.
enum class KlPass : int32_t { kAuto = 0, kFused = 1, kSeparate = 2, kTeacher = 3 };

// How a backend walks the sparse forward's work (kSparse). kQueryTile: a tile of query rows
// visits the union of its tokens' selections (fastest when neighbouring tokens select alike).
// kKvBlock: each KV block visits the tokens that selected it, writing partial outputs that a
// second kernel combines (its cost does not grow with the union; it needs workspace for the
// partials of `fwd_chunk_tokens` tokens at a time). kSplit: both, each on the work it does best:
// a query tile computes the blocks that most of its tokens selected (at least tile tokens /
// 2.1 of them, the measured cost ratio of the two) and the KV-block pass every other selected
// (token, block); the same workspace as kKvBlock. kAuto: the backend's choice (CUDA: kQueryTile
// and kSplit are both launched and the device runs the one its cost model picks from the
// selection, with no host sync, when the call's workspace holds the kSplit plan; kQueryTile
// otherwise). The CPU backend has one implementation and accepts every value.
enum class FwdPass : int32_t { kAuto = 0, kQueryTile = 1, kKvBlock = 2, kSplit = 3 };

// How a backend computes dq in the sparse backward. kQueryTile: a tile of query rows visits the
// union of its tokens' selections and recomputes the scores S and dP there, so its cost grows
// with how differently neighbouring tokens select. kFromDs: the KV-side pass, which computes S
// and dP once per selected (token, block), also writes dS to the workspace, and a query-tile
// pass multiplies it by K (only that product runs over the union); the backward then runs in
// passes of `bwd_chunk_tokens` tokens (the dS of one pass is the workspace). kAuto: the
// backend's choice (CUDA: kFromDs in sparse mode where it can run, kQueryTile otherwise).
// kNotSupported naming 'dq_pass' where kFromDs cannot run (CUDA: it needs Hq / Hi a power of two
// from 2 to 64, top_k <= 32, and the KL gradient, if any, by kTeacher). The CPU backend has one
// implementation and accepts every value. Results agree to rounding.
enum class DqPass : int32_t { kAuto = 0, kQueryTile = 1, kFromDs = 2 };

// The scores the selection ranks blocks by (docs/contract.md §2). kInput: the index inputs' own
// values. kFp8: E4M3 copies of them (a scale per q_idx row and per block of k_idx keys), which
// halves the bytes and doubles the tensor-core rate of long-context selection; the selection
// then differs where blocks score within E4M3's resolution of each other. lse_idx and the KL
// keep the inputs' own scores. With `fp8_rerank` = m > 0 the FP8 scores only shortlist: the best
// (free slots + m) blocks by them are ranked again by the inputs' own scores, which restores
// nearly all of kInput's selection for a small extra cost. It applies to select_blocks, a
// forward with `select`, and a paged prefill (max_q_len = 0), whose pages are the blocks it
// copies (an E4M3 k_idx cache: copies of its dequantised keys); decode refuses it.
enum class SelectScores : int32_t { kInput = 0, kFp8 = 1 };

struct Options {
  Mode mode = Mode::kSparse;
  int32_t block_size = 128;  // Bk, tokens per KV block
  int32_t top_k = 16;        // k, blocks per (token, index head), forced blocks included
  int32_t sink_blocks = 0;   // force the first n blocks of each sequence
  int32_t local_blocks = 1;  // force the last n blocks up to and including the token's own (>= 1)
  float scale = 0.f;         // main softmax scale; 0 means D^-0.5
  float scale_idx = 0.f;     // index score scale; 0 means Di^-0.5
  bool deterministic = false;  // backward: bitwise-reproducible gradients
  KlPass kl_pass = KlPass::kAuto;
  FwdPass fwd_pass = FwdPass::kAuto;
  // kKvBlock, kSplit: query tokens per pass (0: as many as keep the partial outputs near 8 GiB,
  // the backward's default dS budget, so that a training step's peak workspace stays the backward's).
  int32_t fwd_chunk_tokens = 0;
  // kl_pass = kTeacher: workspace bytes for the teacher of one pass (0: 6 GiB); the KV side of
  // the backward runs in as many passes over its work as the selection's entries need.
  int64_t kl_teacher_bytes = 0;
  // kl_pass = kTeacher: workspace bytes for dq_idx's products of one pass of tokens, a row of Di
  // floats per selected (token, index head, block), added in column order after the pass.
  // Where a pass's rows need more, the CUDA backend adds dq_idx to 64-bit fixed-point sums per
  // token instead (the same values to rounding): a read-modify-write of the token's sums per
  // selected block, which costs more than the rows once the sums (8 T Hi Di bytes) are well
  // past the L2 cache. 0: the backend's choice (CUDA: rows up to 8 GiB where the sums would be
  // over 4 times the L2 cache, else the sums).
  int64_t kl_dq_rows_bytes = 0;
  SelectScores select_scores = SelectScores::kInput;
  // kFp8: FP8-scored candidates beyond a row's free slots that the inputs' own scores rank again
  // (0: the FP8 scores decide alone); 0 ... 64, ignored with kInput.
  int32_t fp8_rerank = 4;
  // kFp8 with fp8_rerank = m > 0: how many of a row's free slots the re-ranking decides (0: all).
  // With a > 0 the best (free slots - a) blocks by FP8 score are kept as they are and only the
  // last a slots go to the best of the next a + m by the inputs' own scores: fewer blocks to
  // score again for nearly the same recall (bench/fp8_shortlist_recall.py). 0 ... 2^20.
  int32_t fp8_rerank_slots = 0;
  DqPass dq_pass = DqPass::kAuto;
  // dq_pass = kFromDs: query tokens per pass of the backward (0: as many as keep one pass's dS
  // near 8 GiB: 32K tokens with 64 query heads, k = 16, Bk = 128).
  int32_t bwd_chunk_tokens = 0;
};

// Per-call execution context. `stream` is a cudaStream_t for CUDA tensors (nullptr: the legacy
// default stream) and is ignored on the CPU. `workspace` is device memory of at least
// `workspace_size(params)` bytes; it may be null when that size is 0.
//
// `check_values`: the values of `cu_seqlens` and of a caller's `block_idx` are checked before
// anything runs (docs/contract.md §7). On the CPU this is free. On a GPU the check is a small
// kernel whose verdict the host waits for (one stream synchronisation), so a call with checks
// cannot be captured into a CUDA graph: such a call fails with an error naming
// 'launch.check_values'. Set it to false to capture (or to skip the wait); the values are then
// the caller's responsibility: the kernels still never access memory outside the tensors, but
// malformed values give unspecified results.
struct Launch {
  void* stream = nullptr;
  void* workspace = nullptr;
  size_t workspace_bytes = 0;
  bool check_values = true;
};

// Index selection (docs/contract.md §2).
struct SelectParams {
  TensorRef q_idx;       // in  [T, Hi, Di]
  TensorRef k_idx;       // in  [T, Hik, Di], same dtype as q_idx
  TensorRef cu_seqlens;  // in  [nseq+1] int32, optional
  TensorRef cu_seqlens_k;  // in [nseq+1] int32, optional: k_idx is [Tk, Hik, Di] (see above)
  TensorRef block_idx;   // out [T, Hi, k] int32: ascending block ids, then -1 padding
  TensorRef lse_idx;     // out [T, Hi] fp32, optional: log-normaliser of the index softmax
                         //     over the selected support (what the KL needs)
  Options opts;
  Launch launch;
};

// Main attention forward (docs/contract.md §3, §5), optionally preceded by selection and followed by the
// exact KL value.
struct ForwardParams {
  TensorRef q;           // in  [T, Hq, D]
  TensorRef k;           // in  [T, Hkv, D]
  TensorRef v;           // in  [T, Hkv, D]
  TensorRef cu_seqlens;  // in  [nseq+1] int32, optional
  TensorRef cu_seqlens_k;  // in [nseq+1] int32, optional: k, v, k_idx have Tk rows (see above)
  // kSparse: [T, Hi, k] int32. An input, unless `select` is set, in which case it is written
  // first from q_idx/k_idx (docs/contract.md §2). Unused in kDense mode.
  TensorRef block_idx;
  bool select = false;
  TensorRef q_idx;  // in [T, Hi, Di]; needed when `select` is set or `kl` is requested
  TensorRef k_idx;  // in [T, Hik, Di]
  TensorRef out;    // out [T, Hq, D], dtype of q
  TensorRef lse;    // out [T, Hq] fp32, natural log; -inf for a row with empty support
  TensorRef kl;     // out [1] fp32, optional: the exact KL loss value (docs/contract.md §4)
  Options opts;
  Launch launch;
};

// Backward (docs/contract.md §4): dq, dk, dv from dout; dq_idx, dk_idx from the KL weight gamma.
struct BackwardParams {
  TensorRef q, k, v;     // in, as in ForwardParams
  TensorRef out;         // in  [T, Hq, D]: the forward output
  TensorRef lse;         // in  [T, Hq] fp32: the forward LSE
  TensorRef dout;        // in  [T, Hq, D], dtype of q
  TensorRef cu_seqlens;  // in  [nseq+1] int32, optional
  TensorRef cu_seqlens_k;  // in [nseq+1] int32, optional: k, v, k_idx, dk, dv, dk_idx have Tk rows
  TensorRef block_idx;   // in  [T, Hi, k] int32 (kSparse)
  TensorRef dq;          // out [T, Hq, D], dtype of q
  TensorRef dk, dv;      // out [T, Hkv, D], dtype of q
  // KL branch: computed when dq_idx or dk_idx is given; then q_idx and k_idx are required.
  // gamma = kl_weight * kl_grad[0] (kl_grad optional, fp32 [1] on the tensors' device, so a
  // framework can pass the incoming gradient of the KL output without a host round trip).
  TensorRef q_idx, k_idx;  // in  [T, Hi, Di], [T, Hik, Di]
  TensorRef dq_idx;        // out [T, Hi, Di], dtype of q_idx, optional
  TensorRef dk_idx;        // out [T, Hik, Di], dtype of q_idx, optional
  TensorRef kl_grad;       // in  [1] fp32, optional
  float kl_weight = 1.f;
  Options opts;
  Launch launch;
};

// The exact KL value (docs/contract.md §4) from the forward's LSE.
struct KlParams {
  TensorRef q, k;        // in  [T, Hq, D], [T, Hkv, D]
  TensorRef lse;         // in  [T, Hq] fp32
  TensorRef q_idx;       // in  [T, Hi, Di]
  TensorRef k_idx;       // in  [T, Hik, Di]
  TensorRef cu_seqlens;  // in  [nseq+1] int32, optional
  TensorRef cu_seqlens_k;  // in [nseq+1] int32, optional: k, k_idx have Tk rows (see above)
  TensorRef block_idx;   // in  [T, Hi, k] int32 (kSparse)
  TensorRef kl;          // out [1] fp32: 1/(N*Hi) * sum over (t, i) of KL(pi || sigma)
  TensorRef kl_rows;     // out [T, Hi] fp32, optional: the unnormalised per-row KL(pi || sigma)
  Options opts;
  Launch launch;
};

// ---------------------------------------------------------------------------------------------
// Serving over a paged KV cache (docs/contract.md §6).
//
// A cache holds pages of Bk = Options.block_size tokens; page p row r of `k` is k[p, r, :, :].
// Sequence s keeps its tokens 0 .. seq_lens[s]-1 in logical blocks 0, 1, ..., block b of it in
// physical page page_table[s, b]; block_idx always holds logical block ids. Pages are
// token-major ([pages, Bk, H, D]): a page of one head is Bk rows of D contiguous elements, the
// same layout a contiguous [T, H, D] sequence has, so the training kernels' tile loads apply.
//
// FP8 caches: k and v (together) and k_idx may each be DType::kFloat8E4M3 with a float32 scale
// tensor of shape [1] (per tensor) or [pages] (per page), every value finite and positive. The
// calls then compute exactly as if the cache held the dequantised values
// float32(e4m3 value * scale[page]) (one fp32 rounding), with queries and outputs in their own
// dtype; paged_append stores e4m3(float32(x / scale[page])) rounded to nearest even and
// saturated to +-448 (contract §6). Scales are given only for E4M3 tensors. The CUDA backend
// reads the codes (converted exactly to the queries' 16-bit type) and applies the page scales to
// the fp32 scores and probabilities, so its results equal the dequantised cache's up to the
// order of fp32 roundings; it appends float32, bfloat16 or float16 rows into E4M3 caches.
struct PagedCache {
  TensorRef k;           // [pages, Bk, Hkv, D]
  TensorRef v;           // [pages, Bk, Hkv, D], dtype of k
  TensorRef k_idx;       // [pages, Bk, Hik, Di]
  TensorRef page_table;  // [nseq, max_pages] int32: physical page of each logical block
  TensorRef seq_lens;    // [nseq] int32: tokens cached per sequence, this call's new ones included
  TensorRef k_scale;     // [1] or [pages] fp32, iff k is E4M3
  TensorRef v_scale;     // [1] or [pages] fp32, iff v is E4M3
  TensorRef k_idx_scale; // [1] or [pages] fp32, iff k_idx is E4M3
};

// The new tokens of a call: `cu_seqlens_q` [nseq+1] int32 packs them per sequence; sequence s has
// n_s = cu_seqlens_q[s+1] - cu_seqlens_q[s] of them (0 allowed), the last n_s of its seq_lens[s]
// positions: new token j sits at position seq_lens[s] - n_s + j and sees keys 0 .. that position.
// `max_q_len`: 0 for any n_s (a prefill chunk); 1..16 for decode (multi-token prediction), a
// bound on every n_s that sizes the launch once, so a captured CUDA graph replays with new lengths
// and page tables.

// Selection for the new tokens (docs/contract.md §2 at their positions): reads cache.k_idx.
struct PagedSelectParams {
  TensorRef q_idx;         // in  [Tq, Hi, Di], dtype of cache.k_idx (any float dtype for E4M3)
  TensorRef cu_seqlens_q;  // in  [nseq+1] int32
  PagedCache cache;        // k_idx, page_table, seq_lens (k and v unused)
  TensorRef block_idx;     // out [Tq, Hi, k] int32: ascending logical block ids, then -1
  int32_t max_q_len = 0;
  Options opts;
  Launch launch;
};

// Attention of the new tokens over the cache (docs/contract.md §3 at their positions; kDense: over
// every causal key, the dense baseline). With `select`, block_idx is written first from q_idx.
// FP8 queries (Q8KV8): over E4M3 caches k and v, q may be DType::kFloat8E4M3 with q_scale
// (float32 [1] per tensor or [Tq, Hq] per token and head, finite and positive): the call computes
// over the dequantised queries float32(e4m3 value * q_scale[t, h]), and `out` gives its dtype
// (any float dtype; q_idx, when given, has that dtype too). Both backends implement it (the
// CUDA one with a bfloat16 or float16 out).
struct PagedForwardParams {
  TensorRef q;             // in  [Tq, Hq, D], dtype of cache.k (any float dtype for E4M3; E4M3: Q8KV8)
  TensorRef q_scale;       // in  [1] or [Tq, Hq] fp32, iff q is E4M3
  TensorRef cu_seqlens_q;  // in  [nseq+1] int32
  PagedCache cache;
  TensorRef block_idx;     // [Tq, Hi, k] int32 (kSparse): in, or out when `select`
  bool select = false;
  TensorRef q_idx;         // in  [Tq, Hi, Di] when `select`
  TensorRef out;           // out [Tq, Hq, D], dtype of q (E4M3 q: any float dtype)
  TensorRef lse;           // out [Tq, Hq] fp32, optional
  int32_t max_q_len = 0;
  Options opts;
  Launch launch;
};

// Writes the new tokens' k, v and k_idx into their pages (positions as above). Any of the three
// may be absent (its cache tensor is then not touched either).
struct PagedAppendParams {
  TensorRef k;             // in  [Tq, Hkv, D], dtype of cache.k (a float dtype for E4M3: quantised)
  TensorRef v;             // in  [Tq, Hkv, D]
  TensorRef k_idx;         // in  [Tq, Hik, Di], dtype of cache.k_idx (as k)
  TensorRef cu_seqlens_q;  // in  [nseq+1] int32
  PagedCache cache;        // written: k, v, k_idx at the new tokens' rows
  int32_t block_size = 128;
  Launch launch;
};

}  // namespace msa
