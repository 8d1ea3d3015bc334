// The host plan of a call: the kernels' limits, the Args of each kernel (the parameter chain)
// and the workspace of the backward and the KL value. See plan.h.
#include "plan.h"
#include "rerank.h"

#include <cub/device/device_radix_sort.cuh>
#include <cub/device/device_scan.cuh>
#include <cub/device/device_select.cuh>

#include <algorithm>
#include <cmath>
#include <limits>
#include <string>

#include "common.h"
#include "reverse_index.h"

namespace msa::cuda {
namespace {

constexpr int kBlockC = 64;  // columns of a KV-side entry (kernels/bwd_kv_kernel.cuh)

// Tokens and keys: int32 positions and rows in the kernels.
Status check_tokens(const char* fn, const Problem& prob) {
  if (prob.T >= (int64_t(1) << 31)) return fail(fn, "q", "more than 2^31 - 1 tokens");
  if (prob.Tk >= (int64_t(1) << 31)) return fail(fn, "cu_seqlens_k", "more than 2^31 - 1 keys");
  return Status::Ok();
}

// The main branch: q, k (and v) 16-bit, head dim and block size of a kernel variant, 16-byte rows.
Status can_main(const char* fn, const Problem& prob, const TensorRef& q, const TensorRef& k,
                const TensorRef& v) {
  MSA_TRY(check_half(fn, "q", q));
  MSA_TRY(check_head_dim(fn, "q", prob.D));
  MSA_TRY(check_block_size(fn, prob.opts.block_size));
  MSA_TRY(check_aligned(fn, "q", q));
  MSA_TRY(check_aligned(fn, "k", k));
  if (v.defined()) MSA_TRY(check_aligned(fn, "v", v));
  return check_tokens(fn, prob);
}

// Query heads per tile head group (index head; KV head in dense mode): the tile's 128 rows.
Status can_query_tile(const char* fn, const Problem& prob, bool dense) {
  const int32_t groups = dense ? prob.Hkv : prob.Hi;
  if (prob.Hq / groups > kQueryTileRows)
    return fail(fn, "q", "the CUDA backend takes at most " + std::to_string(kQueryTileRows) +
                             " query heads per " + (dense ? "KV head" : "index head") + ", got " +
                             std::to_string(prob.Hq / groups));
  return Status::Ok();
}

int32_t seqs(const TensorRef& cu) { return num_seqs(cu); }
const int32_t* cu_ptr(const TensorRef& cu) {
  return cu.defined() ? static_cast<const int32_t*>(cu.data) : nullptr;
}

void set_seqs(SeqArgs* a, const Problem& prob, const TensorRef& cu) {
  a->cu_seqlens = cu_ptr(cu);
  a->nseq = seqs(cu);
  a->T = static_cast<int32_t>(prob.T);
}

// The keys' layout of a training call: packed apart from the tokens (cu_seqlens_k, Tk rows of
// their own), or the tokens themselves.
kern::PagedKeys keys_of(const Problem& prob, const TensorRef& cu_k) {
  kern::PagedKeys keys;
  if (prob.keys_apart) {
    keys.cu_k = cu_ptr(cu_k);
    keys.kv_rows = static_cast<int32_t>(prob.Tk);
  }
  return keys;
}

// The query-tile geometry of `groups` head groups over Hq heads (dense: every causal block), over
// the keys of cu_k (keys_of).
void set_query_tile(QueryTileArgs* a, const Problem& prob, const TensorRef& cu, const TensorRef& cu_k,
                    int32_t Hq, int32_t Hkv, int32_t groups, const TensorRef& block_idx, bool dense) {
  set_seqs(a, prob, cu);
  a->paged = keys_of(prob, cu_k);
  a->Hq = Hq;
  a->Hkv = Hkv;
  a->Hi = groups;
  a->heads_per_idx = Hq / groups;
  a->idx_per_kv = groups / Hkv;
  a->tile_tokens = kQueryTileRows / a->heads_per_idx;
  a->top_k = prob.k;
  a->dense = dense;
  if (!dense) {
    a->block_idx = static_cast<const int32_t*>(block_idx.data);
    a->bi_s0 = block_idx.stride[0];
    a->bi_s1 = block_idx.stride[1];
  }
  // The blocks of the longest key space: Tk keys (positions stay below max(T, Tk) even where
  // unchecked cu_seqlens_k values give a sequence fewer keys than tokens).
  a->uni = kern::UnionLayout::make(dense, std::max(prob.T, prob.Tk), prob.opts.block_size, a->tile_tokens, prob.k);
  a->num_tiles = kern::num_tile_ids(a->nseq, prob.T, a->tile_tokens);
  a->tok_hi = prob.T;
}

int bits_for(uint64_t v) {  // bits needed to hold values 0..v
  int b = 0;
  while (b < 64 && (v >> b) != 0) ++b;
  return b;
}

}  // namespace

// ------------------------------------------------------------------------------ limits

Status can_select(const char* fn, const Problem& prob, const TensorRef& q_idx,
                  const TensorRef& k_idx, bool with_lse_idx) {
  MSA_TRY(check_half(fn, "q_idx", q_idx));
  MSA_TRY(check_head_dim(fn, "q_idx", prob.Di));
  MSA_TRY(check_block_size(fn, prob.opts.block_size));
  MSA_TRY(check_aligned(fn, "q_idx", q_idx));
  MSA_TRY(check_aligned(fn, "k_idx", k_idx));
  if (prob.idx_per_key() > 128)
    return fail(fn, "q_idx", "the CUDA backend takes at most 128 index heads per index key head");
  if (with_lse_idx && prob.Hi > kQueryTileRows)
    return fail(fn, "lse_idx", "the CUDA backend computes it for at most 128 index heads");
  if (rerank_width(prob) > 0) {
    if (rerank_width(prob) > 128)
      return fail(fn, "fp8_rerank", "the CUDA re-ranking takes top_k + fp8_rerank <= 128, got " +
                                        std::to_string(rerank_width(prob)));
    if (int64_t(prob.T) * prob.Hi * rerank_width(prob) >= (int64_t(1) << 31))
      return fail(fn, "fp8_rerank", "the CUDA re-ranking indexes T * Hi * (top_k + fp8_rerank) shortlist "
                                    "entries in 31 bits; split the call or set fp8_rerank = 0");
  }
  return check_tokens(fn, prob);
}

Status can_forward(const char* fn, const Problem& prob, const ForwardParams& p) {
  const bool dense = prob.opts.mode == Mode::kDense;
  MSA_TRY(can_main(fn, prob, p.q, p.k, p.v));
  MSA_TRY(check_even(fn, "out", p.out));
  MSA_TRY(can_query_tile(fn, prob, dense));
  if (!dense && p.select) MSA_TRY(can_select(fn, prob, p.q_idx, p.k_idx, false));
  return Status::Ok();
}

bool kv_block_forward(const Problem& prob) {
  return prob.opts.mode == Mode::kSparse && prob.opts.fwd_pass == FwdPass::kKvBlock;
}

bool split_forward(const Problem& prob) {
  return prob.opts.mode == Mode::kSparse && prob.opts.fwd_pass == FwdPass::kSplit;
}

bool auto_forward(const Problem& prob) {
  return prob.opts.mode == Mode::kSparse && prob.opts.fwd_pass == FwdPass::kAuto && prob.T > 0 &&
         can_fwd_kv("forward", prob).ok();
}

Status can_fwd_kv(const char* fn, const Problem& prob) {
  const int32_t gi = prob.Hq / prob.Hi;
  if (gi > kBlockC)
    return fail(fn, "fwd_pass", "the KV-block forward takes at most 64 query heads per index head, got " +
                                    std::to_string(gi));
  if (prob.k > 32)
    return fail(fn, "fwd_pass", "the KV-block forward takes at most 32 blocks per row (block_idx), got " +
                                    std::to_string(prob.k));
  return Status::Ok();
}

Status can_split(const char* fn, const Problem& prob, int64_t keys) {
  MSA_TRY(can_fwd_kv(fn, prob));
  // pass_choice_kernel counts a tile's tokens per block in a byte per block of the sequence in
  // shared memory: 192K blocks (25M keys at Bk = 128) per warp at most.
  const int64_t blocks = ((keys > 0 ? keys : std::max(prob.T, prob.Tk)) + prob.opts.block_size - 1) / prob.opts.block_size;
  if (blocks > (int64_t(192) << 10))
    return fail(fn, "fwd_pass", "the split forward takes at most 196608 key blocks, got " +
                                    std::to_string(blocks));
  return Status::Ok();
}

Status can_kl(const char* fn, const Problem& prob, const KlInputs& in) {
  MSA_TRY(can_main(fn, prob, in.q, in.k, TensorRef{}));
  MSA_TRY(check_half(fn, "q_idx", in.q_idx));
  MSA_TRY(check_head_dim(fn, "q_idx", prob.Di));
  MSA_TRY(check_aligned(fn, "q_idx", in.q_idx));
  MSA_TRY(check_aligned(fn, "k_idx", in.k_idx));
  if (prob.Di != prob.D)
    return fail(fn, "q_idx", "the CUDA KL kernels need Di == D (got Di = " + std::to_string(prob.Di) +
                                 ", D = " + std::to_string(prob.D) + ")");
  if (in.q_idx.dtype != in.q.dtype)
    return fail(fn, "q_idx", "the CUDA KL kernels need q_idx in the dtype of q");
  return can_query_tile(fn, prob, /*dense=*/false);  // the index LSE: Hi tile head groups
}

KlRoute kl_route(const Problem& prob) {
  const int32_t gi = prob.Hq / prob.Hi;
  const bool butterfly = gi >= 1 && gi <= 64 && (gi & (gi - 1)) == 0;
  const bool sparse = prob.opts.mode == Mode::kSparse;
  switch (prob.opts.kl_pass) {
    case KlPass::kSeparate: return KlRoute::kSeparate;
    case KlPass::kFused: return butterfly ? KlRoute::kFused : KlRoute::kSeparate;
    case KlPass::kTeacher: return butterfly && sparse ? KlRoute::kTeacher : KlRoute::kSeparate;
    default: return !butterfly ? KlRoute::kSeparate : sparse ? KlRoute::kTeacher : KlRoute::kFused;
  }
}

namespace {
// Why dq cannot come from dS for this call (empty: it can).
std::string dq_from_ds_limit(const Problem& prob, bool kl) {
  const int32_t gi = prob.Hq / prob.Hi;
  if (prob.opts.mode != Mode::kSparse) return "kFromDs needs mode kSparse";
  if (gi < 2 || gi > 64 || (gi & (gi - 1)) != 0)
    return "kFromDs needs Hq / Hi a power of two from 2 to 64 (dS tiles of whole 16-byte "
           "pieces), got " + std::to_string(gi);
  if (prob.k > 32) return "kFromDs needs top_k <= 32, got " + std::to_string(prob.k);
  if (kl && kl_route(prob) != KlRoute::kTeacher)
    return "kFromDs needs the KL gradient by kl_pass kTeacher (or kAuto where it takes it)";
  return "";
}
}  // namespace

bool dq_from_ds(const Problem& prob, bool kl) {
  return prob.opts.dq_pass != DqPass::kQueryTile && dq_from_ds_limit(prob, kl).empty();
}

Status can_backward(const Problem& prob, const BackwardParams& p) {
  const char* fn = "backward";
  const bool sparse = prob.opts.mode == Mode::kSparse;
  MSA_TRY(can_main(fn, prob, p.q, p.k, p.v));
  MSA_TRY(check_aligned(fn, "dout", p.dout));
  MSA_TRY(check_aligned(fn, "out", p.out));
  MSA_TRY(check_even(fn, "dq", p.dq));
  MSA_TRY(check_even(fn, "dk", p.dk));
  MSA_TRY(check_even(fn, "dv", p.dv));
  MSA_TRY(can_query_tile(fn, prob, !sparse));
  if (p.dq_idx.defined() || p.dk_idx.defined()) {
    MSA_TRY(can_kl(fn, prob, KlInputs(p)));
    if (prob.opts.kl_pass == KlPass::kFused && kl_route(prob) != KlRoute::kFused)
      return fail(fn, "kl_pass",
                  "kFused needs Hq / Hi a power of two up to 64 (the teacher's head mean is a "
                  "butterfly over accumulator columns), got " + std::to_string(prob.Hq / prob.Hi));
    if (prob.opts.kl_pass == KlPass::kTeacher && kl_route(prob) != KlRoute::kTeacher)
      return fail(fn, "kl_pass",
                  sparse ? "kTeacher needs Hq / Hi a power of two up to 64 (the teacher's head mean "
                           "is a butterfly over accumulator columns), got " +
                               std::to_string(prob.Hq / prob.Hi)
                         : std::string("kTeacher needs mode kSparse (the warmup's dense support has "
                                       "no bounded teacher)"));
  }
  if (prob.opts.dq_pass == DqPass::kFromDs) {
    const std::string why = dq_from_ds_limit(prob, p.dq_idx.defined() || p.dk_idx.defined());
    if (!why.empty()) return fail(fn, "dq_pass", why);
  }
  return Status::Ok();
}

// ------------------------------------------------------------------------------ parameter chain

SelectArgs select_args(const Problem& prob, const TensorRef& q_idx, const TensorRef& k_idx,
                       const TensorRef& cu, const TensorRef& cu_k, const TensorRef& block_idx) {
  SelectArgs a;
  set_seqs(&a, prob, cu);
  a.paged = keys_of(prob, cu_k);
  a.q_idx = q_idx.data;
  a.q_s0 = q_idx.stride[0];
  a.q_s1 = q_idx.stride[1];
  a.k_idx = k_idx.data;
  a.k_s0 = k_idx.stride[0];
  a.k_s1 = k_idx.stride[1];
  a.block_idx = static_cast<int32_t*>(block_idx.data);
  a.bi_s0 = block_idx.stride[0];
  a.bi_s1 = block_idx.stride[1];
  a.Hik = prob.Hik;
  a.idx_per_key = prob.Hi / prob.Hik;
  a.tile_tokens = kSelectTileRows / a.idx_per_key;
  a.k = prob.k;
  a.sink_blocks = prob.opts.sink_blocks;
  a.local_blocks = prob.opts.local_blocks;
  a.scale = std::fabs(prob.opts.scale_idx);
  a.negate = prob.opts.scale_idx < 0.f;
  a.num_tiles = kern::num_tile_ids(a.nseq, prob.T, a.tile_tokens);
  return a;
}

int32_t rerank_width(const Problem& prob) {
  const bool on = prob.opts.select_scores == SelectScores::kFp8 && prob.opts.mode == Mode::kSparse &&
                  prob.opts.fp8_rerank > 0;
  return on ? prob.k + prob.opts.fp8_rerank : 0;
}

namespace {
// The key side of an FP8 selection: the rows of the k_idx copy and the KV tile ids its blocks
// have (packed keys: T rows, or Tk apart, decode_tile's ids over them; a prefill's pages: a
// slot of Bk rows per block of each sequence, PagedKeys::kv_tile's ids).
struct Fp8Keys {
  int64_t rows = 0, tiles = 0;
  Fp8Keys(const Problem& prob, int32_t nseq, const kern::PagedKeys& paged) {
    const int32_t bk = prob.opts.block_size;
    rows = paged.page_table != nullptr ? int64_t(nseq) * paged.key_cap : prob.Tk;
    tiles = paged.page_table != nullptr ? paged.kv_tiles(nseq, bk) : kern::num_tile_ids(nseq, prob.Tk, bk);
  }
};

// The re-ranking's buffers (RerankArgs), in this order: cand, rows, seg_count, seg_start,
// chunk_start, entries, score, CUB's temporary bytes.
struct RerankLayout {
  size_t cand = 0, rows = 0, seg = 0, chunk = 0, entries = 0, cub = 0;
  int64_t nseg = 0;
  int32_t ranges = 1, range_shift = 12;  // at least 4096 tokens a range, at most 64 ranges
  RerankLayout(const Problem& prob, const Fp8Keys& keys) {
    const int32_t w = rerank_width(prob);
    if (w == 0) return;
    const size_t n = size_t(prob.T) * prob.Hi * w;
    nseg = keys.tiles * prob.Hik;
    while ((prob.T >> range_shift) >= 64) ++range_shift;
    ranges = static_cast<int32_t>((prob.T >> range_shift) + 1);
    cand = align_up(4 * n);
    rows = align_up(8 * size_t(prob.T) * prob.Hi);
    seg = align_up(4 * size_t(nseg * ranges + 1));
    chunk = align_up(4 * size_t(nseg + 1));
    entries = align_up(4 * n);
    cub = align_up(rerank_cub_bytes(nseg * ranges + 1));
  }
  size_t bytes() const { return cand + rows + 2 * seg + chunk + 2 * entries + cub; }
};
}  // namespace

// Codes of q_idx [T, Hi, Di], of k_idx [key rows, Hik, Di], then k_factor [key rows, Hik] fp32;
// then the re-ranking's buffers.
size_t select_fp8_bytes(const Problem& prob, int32_t nseq, const kern::PagedKeys& paged) {
  if (prob.opts.select_scores != SelectScores::kFp8 || prob.opts.mode != Mode::kSparse) return 0;
  const Fp8Keys keys(prob, nseq, paged);
  return align_up(size_t(prob.T) * prob.Hi * prob.Di) + align_up(size_t(keys.rows) * prob.Hik * prob.Di) +
         align_up(sizeof(float) * size_t(keys.rows) * prob.Hik) + RerankLayout(prob, keys).bytes();
}

size_t select_fp8_bytes(const Problem& prob, const TensorRef& cu) { return select_fp8_bytes(prob, seqs(cu), {}); }

namespace {
// The index inputs' pointers and strides from the selection's Args (before the copies replace them).
template <class Dst>
void set_index_inputs(Dst* d, const SelectArgs& a) {
  d->q_idx = a.q_idx;
  d->q_s0 = a.q_s0;
  d->q_s1 = a.q_s1;
  d->k_idx = a.k_idx;
  d->k_s0 = a.k_s0;
  d->k_s1 = a.k_s1;
}
}  // namespace

void set_select_fp8(const Problem& prob, void* ws, SelectArgs* a) {
  Fp8CopyArgs& c = a->copy;
  static_cast<SeqArgs&>(c) = static_cast<const SeqArgs&>(*a);
  set_index_inputs(&c, *a);
  c.Hi = prob.Hi;
  c.Hik = prob.Hik;
  c.block_size = prob.opts.block_size;
  c.negate = a->negate;
  c.paged = a->paged;
  const Fp8Keys keys(prob, a->nseq, a->paged);
  char* base = static_cast<char*>(ws);
  c.q8 = reinterpret_cast<uint8_t*>(base);
  base += align_up(size_t(prob.T) * prob.Hi * prob.Di);
  c.k8 = reinterpret_cast<uint8_t*>(base);
  base += align_up(size_t(keys.rows) * prob.Hik * prob.Di);
  c.k_factor = reinterpret_cast<float*>(base);
  base += align_up(sizeof(float) * size_t(keys.rows) * prob.Hik);
  c.num_blocks = keys.tiles;
  const RerankLayout l(prob, keys);
  if (l.nseg > 0) {
    RerankArgs& r = a->rerank;
    r.m = prob.opts.fp8_rerank;
    r.slots = prob.opts.fp8_rerank_slots;
    r.width = rerank_width(prob);
    set_index_inputs(&r, *a);
    r.negate = a->negate;
    const auto take = [&](size_t bytes) {
      char* p = base;
      base += bytes;
      return p;
    };
    r.cand = reinterpret_cast<int32_t*>(take(l.cand));
    r.rows = reinterpret_cast<int2*>(take(l.rows));
    r.seg_count = reinterpret_cast<int32_t*>(take(l.seg));
    r.seg_start = reinterpret_cast<int32_t*>(take(l.seg));
    r.chunk_start = reinterpret_cast<int32_t*>(take(l.chunk));
    r.entries = reinterpret_cast<int32_t*>(take(l.entries));
    r.score = reinterpret_cast<float*>(take(l.entries));
    r.cub = take(l.cub);
    r.cub_bytes = l.cub;
    r.nseg = l.nseg;
    r.ranges = l.ranges;
    r.range_shift = l.range_shift;
    // Chunks: at most one partial chunk per segment beyond the full ones.
    r.grid = (int64_t(prob.T) * prob.Hi * r.width + kRerankChunk - 1) / kRerankChunk + l.nseg;
  }
  a->fp8 = true;
  a->q_idx = c.q8;
  a->q_s0 = int64_t(prob.Hi) * prob.Di;
  a->q_s1 = prob.Di;
  a->k_idx = c.k8;
  a->k_s0 = int64_t(prob.Hik) * prob.Di;
  a->k_s1 = prob.Di;
  a->negate = false;  // folded into the codes
}

namespace {
void set_scale(FwdArgs* a, float scale) {
  a->scale = std::fabs(scale);
  a->scale_log2 = a->scale * static_cast<float>(M_LOG2E);
  a->negate = scale < 0.f;
}
}  // namespace

namespace {
// The forward's tensors, named alike in FwdArgs and FwdKvArgs: q, k, v in; out, lse out.
template <class Args>
void set_forward_tensors(Args* a, const ForwardParams& p) {
  a->q = p.q.data;
  a->q_s0 = p.q.stride[0];
  a->q_s1 = p.q.stride[1];
  a->k = p.k.data;
  a->k_s0 = p.k.stride[0];
  a->k_s1 = p.k.stride[1];
  a->v = p.v.data;
  a->v_s0 = p.v.stride[0];
  a->v_s1 = p.v.stride[1];
  a->out = p.out.data;
  a->o_s0 = p.out.stride[0];
  a->o_s1 = p.out.stride[1];
  a->lse = static_cast<float*>(p.lse.data);
  a->lse_s0 = p.lse.stride[0];
  a->lse_s1 = p.lse.stride[1];
}
}  // namespace

FwdArgs forward_args(const Problem& prob, const ForwardParams& p) {
  const bool dense = prob.opts.mode == Mode::kDense;
  FwdArgs a;
  // Dense mode has no index heads to follow: one tile head group per KV head.
  set_query_tile(&a, prob, p.cu_seqlens, p.cu_seqlens_k, prob.Hq, prob.Hkv, dense ? prob.Hkv : prob.Hi,
                 p.block_idx, dense);
  set_forward_tensors(&a, p);
  set_scale(&a, prob.opts.scale);
  return a;
}

FwdArgs index_lse_args(const Problem& prob, const KlInputs& in, float* lse_idx, int64_t s0,
                       int64_t s1) {
  const bool dense = prob.opts.mode == Mode::kDense;
  FwdArgs a;
  // Queries q_idx (Hi heads), keys k_idx (Hik heads), one selection row per index head.
  set_query_tile(&a, prob, in.cu_seqlens, in.cu_seqlens_k, prob.Hi, prob.Hik, dense ? prob.Hik : prob.Hi,
                 in.block_idx, dense);
  a.q = in.q_idx.data;
  a.q_s0 = in.q_idx.stride[0];
  a.q_s1 = in.q_idx.stride[1];
  a.k = a.v = in.k_idx.data;
  a.k_s0 = a.v_s0 = in.k_idx.stride[0];
  a.k_s1 = a.v_s1 = in.k_idx.stride[1];
  a.lse = lse_idx;
  a.lse_s0 = s0;
  a.lse_s1 = s1;
  a.lse_only = true;
  set_scale(&a, prob.opts.scale_idx);
  return a;
}

namespace {
// The KV side's column groups: index heads (sparse mode, or with the KL branch), else KV heads.
void set_kv_heads(KvSideArgs* a, const Problem& prob, bool sparse, bool kl) {
  a->Hq = prob.Hq;
  a->Hkv = prob.Hkv;
  a->Hi = (sparse || kl) ? prob.Hi : prob.Hkv;
  a->heads_per_idx = prob.Hq / a->Hi;
  a->idx_per_kv = a->Hi / prob.Hkv;
  a->group_tokens = kern::group_tokens(a->heads_per_idx);
  a->top_k = prob.k;
}
void set_kv_side(KvSideArgs* a, const Problem& prob, const TensorRef& cu, const TensorRef& cu_k, bool sparse,
                 bool kl) {
  set_seqs(a, prob, cu);
  a->paged = keys_of(prob, cu_k);
  set_kv_heads(a, prob, sparse, kl);
}
void set_index(KvSideArgs* a, const Problem& prob, const TensorRef& q_idx, const TensorRef& k_idx) {
  a->q_idx = q_idx.data;
  a->k_idx = k_idx.data;
  a->qi_s0 = q_idx.stride[0];
  a->qi_s1 = q_idx.stride[1];
  a->ki_s0 = k_idx.stride[0];
  a->ki_s1 = k_idx.stride[1];
  a->Hik = prob.Hik;
  a->idx_per_key = prob.Hi / prob.Hik;
  a->scale_idx = prob.opts.scale_idx;
}
}  // namespace

namespace {
// The backward's inputs, named alike in BwdQArgs and BwdKvArgs.
template <class Args>
void set_backward_inputs(Args* a, const BackwardParams& p, const float* delta) {
  a->q = p.q.data;
  a->k = p.k.data;
  a->v = p.v.data;
  a->dout = p.dout.data;
  a->q_s0 = p.q.stride[0];
  a->q_s1 = p.q.stride[1];
  a->k_s0 = p.k.stride[0];
  a->k_s1 = p.k.stride[1];
  a->v_s0 = p.v.stride[0];
  a->v_s1 = p.v.stride[1];
  a->do_s0 = p.dout.stride[0];
  a->do_s1 = p.dout.stride[1];
  a->lse = static_cast<const float*>(p.lse.data);
  a->lse_s0 = p.lse.stride[0];
  a->lse_s1 = p.lse.stride[1];
  a->delta = delta;
}
}  // namespace

BwdQArgs bwd_q_args(const Problem& prob, const BackwardParams& p, const float* delta) {
  const bool dense = prob.opts.mode == Mode::kDense;
  BwdQArgs a;
  set_query_tile(&a, prob, p.cu_seqlens, p.cu_seqlens_k, prob.Hq, prob.Hkv, dense ? prob.Hkv : prob.Hi,
                 p.block_idx, dense);
  set_backward_inputs(&a, p, delta);
  a.dq = p.dq.data;
  a.dq_s0 = p.dq.stride[0];
  a.dq_s1 = p.dq.stride[1];
  a.scale = prob.opts.scale;
  a.scale_log2 = prob.opts.scale * static_cast<float>(M_LOG2E);
  return a;
}

BwdDqArgs bwd_dq_args(const Problem& prob, const BackwardParams& p) {
  BwdDqArgs a;
  set_query_tile(&a, prob, p.cu_seqlens, p.cu_seqlens_k, prob.Hq, prob.Hkv, prob.Hi, p.block_idx, /*dense=*/false);
  a.k = a.v = p.k.data;
  a.k_s0 = a.v_s0 = p.k.stride[0];
  a.k_s1 = a.v_s1 = p.k.stride[1];
  a.dq = p.dq.data;
  a.dq_s0 = p.dq.stride[0];
  a.dq_s1 = p.dq.stride[1];
  a.scale = prob.opts.scale;
  return a;
}

void set_tile_pass(QueryTileArgs* a, int64_t tok_lo, int64_t tok_hi) {
  // Token x of sequence s is in tile s + cu[s] / m + (x - cu[s]) / m, which lies in
  // [x / m - 1, x / m + nseq - 1] (floor(u) + floor(v) is floor(u + v) or one less).
  const int64_t m = a->tile_tokens;
  const int64_t all = kern::num_tile_ids(a->nseq, a->T, a->tile_tokens);
  a->tok_lo = tok_lo;
  a->tok_hi = tok_hi;
  a->tile_lo = std::max<int64_t>(0, tok_lo / m - 1);
  const int64_t hi = tok_hi > tok_lo ? std::min<int64_t>(all, (tok_hi - 1) / m + a->nseq) : a->tile_lo;
  a->num_tiles = std::max<int64_t>(0, hi - a->tile_lo);
}

FwdKvArgs fwd_kv_args(const Problem& prob, const FwdArgs& q) {
  FwdKvArgs a;
  static_cast<SeqArgs&>(a) = q;
  set_kv_heads(&a, prob, /*sparse=*/true, /*kl=*/false);
  a.q = q.q;
  a.k = q.k;
  a.v = q.v;
  a.q_s0 = q.q_s0;
  a.q_s1 = q.q_s1;
  a.k_s0 = q.k_s0;
  a.k_s1 = q.k_s1;
  a.v_s0 = q.v_s0;
  a.v_s1 = q.v_s1;
  a.out = q.out;
  a.o_s0 = q.o_s0;
  a.o_s1 = q.o_s1;
  a.lse = q.lse;
  a.lse_s0 = q.lse_s0;
  a.lse_s1 = q.lse_s1;
  a.block_idx = q.block_idx;
  a.bi_s0 = q.bi_s0;
  a.bi_s1 = q.bi_s1;
  a.block_size = prob.opts.block_size;
  a.scale_log2 = prob.opts.scale * static_cast<float>(M_LOG2E);
  a.paged = q.paged;
  a.kv_scale = q.kv_scale;
  a.q_factor = q.q_factor;
  return a;
}

BwdKvArgs bwd_kv_args(const Problem& prob, const BackwardParams& p, const float* delta) {
  const bool sparse = prob.opts.mode == Mode::kSparse;
  const bool kl = p.dq_idx.defined() || p.dk_idx.defined();
  BwdKvArgs a;
  set_kv_side(&a, prob, p.cu_seqlens, p.cu_seqlens_k, sparse, kl);
  set_backward_inputs(&a, p, delta);
  a.dk = p.dk.data;
  a.dv = p.dv.data;
  a.dk_s0 = p.dk.stride[0];
  a.dk_s1 = p.dk.stride[1];
  a.dv_s0 = p.dv.stride[0];
  a.dv_s1 = p.dv.stride[1];
  a.scale = prob.opts.scale;
  a.scale_log2 = prob.opts.scale * static_cast<float>(M_LOG2E);
  if (kl && kl_route(prob) == KlRoute::kFused) set_index(&a, prob, p.q_idx, p.k_idx);
  return a;
}

KlArgs kl_args(const Problem& prob, const KlInputs& in) {
  KlArgs a;
  set_kv_side(&a, prob, in.cu_seqlens, in.cu_seqlens_k, prob.opts.mode == Mode::kSparse, true);
  set_index(&a, prob, in.q_idx, in.k_idx);
  a.q = in.q.data;
  a.k = in.k.data;
  a.q_s0 = in.q.stride[0];
  a.q_s1 = in.q.stride[1];
  a.k_s0 = in.k.stride[0];
  a.k_s1 = in.k.stride[1];
  a.lse = static_cast<const float*>(in.lse.data);
  a.lse_s0 = in.lse.stride[0];
  a.lse_s1 = in.lse.stride[1];
  a.scale_log2 = prob.opts.scale * static_cast<float>(M_LOG2E);
  return a;
}

// ------------------------------------------------------------------------------ workspace

Status make_plan(const char* fn, const Problem& prob, int32_t nseq, bool sparse, bool main,
                 bool kl, bool grad, Plan* out, int64_t fwd_tokens, int64_t bwd_tokens,
                 int64_t paged_kv_tiles) {
  Plan p;
  p.sparse = sparse;
  p.kl = kl;
  p.grad = grad;
  const int32_t Bk = prob.opts.block_size;
  // Column groups of the KV side: the index heads (always in sparse mode or with the KL),
  // else the KV heads.
  p.Hi_group = (sparse || kl) ? prob.Hi : prob.Hkv;
  const int32_t Gi = prob.Hq / p.Hi_group;
  if (Gi > kBlockC)
    return fail(fn, "q", "the CUDA backward takes at most 64 query heads per " +
                             std::string((sparse || kl) ? "index head" : "KV head") + ", got " +
                             std::to_string(Gi));
  p.m = kern::group_tokens(Gi);
  size_t off = 0;
  auto take = [&](size_t bytes) {
    const size_t at = off;
    off += align_up(bytes);
    return at;
  };
  if (main) p.delta = take(sizeof(float) * size_t(prob.T) * prob.Hq);
  // KV tiles: decode_tile's over the keys (the tokens, or Tk apart), or a prefill's pages.
  const int64_t kv_tiles = paged_kv_tiles > 0 ? paged_kv_tiles : kern::num_tile_ids(nseq, prob.Tk, Bk);
  if (sparse) {
    p.n = (fwd_tokens > 0 ? fwd_tokens : bwd_tokens > 0 ? bwd_tokens : prob.T) * prob.Hi * int64_t(prob.k);
    if (p.n >= (int64_t(1) << 31))
      return fail(fn, "block_idx",
                  "the reverse index's T * Hi * k entries (T: the tokens of one pass) must stay "
                  "below 2^31");
    // Reverse-index keys: (segment = (KV tile, KV head, index head of it), token, slot).
    const uint64_t segments = static_cast<uint64_t>(kv_tiles) * prob.Hkv * (prob.Hi / prob.Hkv);
    p.tbits = bits_for(static_cast<uint64_t>(prob.T));
    p.sbits = bits_for(static_cast<uint64_t>(prob.k > 0 ? prob.k - 1 : 0));
    p.seg_bit = p.tbits + p.sbits;
    p.end_bit = bits_for(segments) + p.seg_bit;
    if (p.end_bit > 63 || segments >= (uint64_t(1) << 31))
      return fail(fn, "q", "too many tokens for the reverse index");
    p.invalid = (uint64_t(1) << p.end_bit) - 1;
    // A run of L tokens makes ceil(L / m) <= L / m + 1 entries.
    p.entries = std::min<int64_t>(p.n, (p.n + p.m - 1) / p.m + static_cast<int64_t>(segments));
    p.keys_a = take(8 * size_t(p.n));
    p.keys_b = take(8 * size_t(p.n));
    p.flags = take(size_t(p.n));
    p.starts = take(4 * size_t(p.entries));
    p.records = take(sizeof(kern::EntryRecord) * size_t(p.entries));
    p.count = take(2 * sizeof(int32_t));
    p.segments = static_cast<int64_t>(segments);
    p.seg_start = take(4 * (size_t(segments) + 1));
    size_t sort_bytes = 0, unique_bytes = 0, scan_bytes = 0, select_bytes = 0;
    cub::DoubleBuffer<uint64_t> kb(nullptr, nullptr);
    cub::DeviceRadixSort::SortKeys(nullptr, sort_bytes, kb, static_cast<int>(p.n), p.seg_bit,
                                   p.end_bit);
    cub::DeviceSelect::Flagged(nullptr, unique_bytes, static_cast<const uint64_t*>(nullptr),
                               static_cast<const uint8_t*>(nullptr), static_cast<uint64_t*>(nullptr),
                               static_cast<int32_t*>(nullptr), static_cast<int>(p.n));
    cub::DeviceScan::InclusiveScan(nullptr, scan_bytes, static_cast<int32_t*>(nullptr),
                                   static_cast<int32_t*>(nullptr), MaxOp{}, static_cast<int>(p.n));
    cub::DeviceSelect::Flagged(nullptr, select_bytes, CountingIt(0),
                               static_cast<const uint8_t*>(nullptr), static_cast<int32_t*>(nullptr),
                               static_cast<int32_t*>(nullptr), static_cast<int>(p.n));
    p.cub_bytes = std::max({sort_bytes, unique_bytes, scan_bytes, select_bytes});
  }
  // The KV-side work lists. e_bound bounds the entries of all lists: the records in sparse
  // mode, every (index head, KV tile, group) pair in dense mode.
  const double e_bound =
      sparse ? double(p.entries)
             : double(p.Hi_group) * double(kv_tiles) * double(kern::num_tile_ids(nseq, prob.T, p.m));
  if (kv_tiles * prob.Hkv >= (int64_t(1) << 31)) return fail(fn, "q", "too many tokens for the CUDA KV-side passes");
  p.items = static_cast<int32_t>(kv_tiles * prob.Hkv);
  p.size_bits = e_bound >= 4294967295.0 ? 32 : std::max(1, bits_for(static_cast<uint64_t>(e_bound)));
  size_t scan_bytes = 0, order_bytes = 0;
  cub::DeviceScan::ExclusiveSum(nullptr, scan_bytes, static_cast<int32_t*>(nullptr),
                                static_cast<int32_t*>(nullptr), p.items);
  cub::DeviceRadixSort::SortPairsDescending(nullptr, order_bytes, static_cast<const uint32_t*>(nullptr),
                                            static_cast<uint32_t*>(nullptr), static_cast<const int32_t*>(nullptr),
                                            static_cast<int32_t*>(nullptr), p.items);
  // CUB's own estimates can vary with its tuning for the current device: keep a margin so that
  // the size a caller was given always suffices.
  p.cub_bytes = 2 * std::max({p.cub_bytes, scan_bytes, order_bytes}) + 65536;
  p.cub = take(p.cub_bytes);
  // chunk: entries per CTA; with_slots: split lists keep fp32 partial sums (bwd_kv).
  auto work = [&](Plan::Work* w, double chunk, bool with_slots) -> Status {
    chunk = std::max(1.0, chunk);
    const int64_t extra = static_cast<int64_t>(std::ceil(e_bound / chunk));
    if (chunk >= double(int64_t(1) << 31) || p.items + extra >= (int64_t(1) << 31))
      return fail(fn, "q", "too many tokens for the CUDA KV-side passes");
    w->chunk = static_cast<int32_t>(chunk);
    w->grid = p.items + extra;
    w->slots = with_slots ? 2 * extra + 2 : 0;
    w->num_chunks = take(4 * size_t(p.items));
    w->chunk_start = take(4 * size_t(p.items));
    w->num_slots = take(4 * size_t(p.items));
    w->slot_start = take(4 * size_t(p.items));
    w->arrivals = take(4 * size_t(p.items));
    w->sizes = take(4 * size_t(p.items));
    w->sizes_sorted = take(4 * size_t(p.items));
    w->ids = take(4 * size_t(p.items));
    w->order = take(4 * size_t(p.items));
    w->cta = take(sizeof(kern::CtaWork) * size_t(w->grid));
    w->partials = take(sizeof(float) * 2 * size_t(Bk) * prob.D * size_t(w->slots));
    return Status::Ok();
  };
  // bwd_kv: about 16 chunks per SM of the entry bound (which also bounds the partial slots:
  // at most 2 * 16 * SMs of them, 540 MB at Bk = D = 128 on 132 SMs); KL: chunks of 512 entries.
  if (main) MSA_TRY(work(&p.kv, std::max(256.0, std::ceil(e_bound / (16.0 * num_sms()))), true));
  // kl_work: the separate KL pass's list (the KL value, or the gradient by KlRoute::kSeparate;
  // kTeacher's gradient pass has its own, below).
  const KlRoute route = main && kl ? kl_route(prob) : KlRoute::kSeparate;
  if (kl && route == KlRoute::kSeparate) MSA_TRY(work(&p.kl_work, 512.0, false));
  if (main && kl && grad && sparse && route == KlRoute::kTeacher) {
    // The teacher of one pass's records: passes of equal record counts within the budget, at
    // least one chunk each (a pass's buffer also holds the chunk that starts at its end).
    p.teacher = true;
    const double rec_bytes = 4.0 * Bk * p.m;
    const double budget = prob.opts.kl_teacher_bytes > 0 ? double(prob.opts.kl_teacher_bytes)
                                                         : double(int64_t(6) << 30);
    const int64_t entries = std::max<int64_t>(p.entries, 1);
    const int64_t passes = std::max<int64_t>(1, static_cast<int64_t>(std::ceil(entries * rec_bytes / budget)));
    p.pass_records = std::max<int64_t>(p.kv.chunk, (entries + passes - 1) / passes);
    p.passes = static_cast<int32_t>((entries + p.pass_records - 1) / p.pass_records);
    p.teacher_buf = take(static_cast<size_t>(rec_bytes) * size_t(p.pass_records + p.kv.chunk));
    p.lse_part = take(8 * size_t(prob.T) * prob.Hi * size_t(prob.k));
    // dq_idx's products: a row per selected (token, index head, block) of one pass of tokens,
    // written once and added in column order after the pass, where they fit kl_dq_rows_bytes;
    // else fixed-point sums per token, a read-modify-write of the token's 8 Di bytes per block.
    // kl_dq_rows_bytes = 0: rows within 8 GiB (the dS tiles' budget: a pass of dS tiles at
    // Gi >= 2 and Di <= Bk has rows of at most that) where the sums of all T tokens would be over
    // kRowsOverL2 times the L2 cache: where the sums stay in L2 longer, their additions cost less
    // than writing and reading back the rows (measured on an H100, 50 MB of L2, docs/perf.md
    // 2026-12-07: sums of 64 MB, flash-msa's heads at 16K, a 5.18 ms step with the sums against
    // 5.23 with the rows; 537 MB, the paper's heads at 128K, 135.0 against 133.7 ms; 2.1 GB,
    // the retrieval model's heads at 16 x 32K, 139.8 against 132.3 ms).
    constexpr double kRowsOverL2 = 4.0;
    const int64_t row_tokens = bwd_tokens > 0 ? bwd_tokens : prob.T;
    const double row_bytes = 4.0 * double(row_tokens) * prob.Hi * double(prob.k) * prob.Di;
    const double sum_bytes = 8.0 * double(prob.T) * prob.Hi * prob.Di;
    p.dq_rows = prob.opts.kl_dq_rows_bytes > 0
                    ? row_bytes <= double(prob.opts.kl_dq_rows_bytes)
                    : row_bytes <= double(int64_t(8) << 30) && sum_bytes > kRowsOverL2 * double(l2_bytes());
    if (p.dq_rows) p.dq_part = take(static_cast<size_t>(row_bytes));
    // The gradient pass's own chunks (kl_work): bwd_kv's halved while they would be fewer than
    // one per SM, down to 32 entries, so that a short sequence's few long lists do not leave
    // most SMs idle, while each chunk's prologue (its block's index keys, the first stages) is
    // paid for few enough times. With the items in item order, 2 per SM ran best at 16K tokens,
    // flash-msa's heads (mixed / random selections: 8 chunks per SM 1.18 / 1.19 ms, 4 1.08, 2
    // 1.02 / 1.00, 1 1.09 / 0.95); taken longest first (build_work), whole 256-entry chunks run
    // 0.97 / 0.96 against 1.05 / 1.00 for 2 per SM. At 128K, paper heads, the chunks stay 256
    // (128 made it 7% slower). Each is a piece of one bwd_kv chunk, whose pass it takes
    // (KvSideArgs::pass_chunk).
    int32_t kl_chunk = p.kv.chunk;
    while (kl_chunk % 2 == 0 && kl_chunk / 2 >= 32 && e_bound / kl_chunk < num_sms()) kl_chunk /= 2;
    MSA_TRY(work(&p.kl_work, kl_chunk, false));
    // A step of the gradient pass takes kKlGradTokens / m records when a work item's index heads
    // share one index key head (Gk a multiple of Hi / Hkv), else one.
    const int32_t Gk = prob.Hi / prob.Hik, ipk = prob.Hi / prob.Hkv;
    p.step_records = Gk % ipk == 0 ? std::max(1, kern::kKlGradTokens / p.m) : 1;
    // The LSE pass's steps: up to 128 query rows (kl_lse_kernel), on the same condition.
    p.lse_step_records = Gk % ipk == 0 ? std::min(kLseStepRecords, 128 / p.m) : 1;
  }
  if (fwd_tokens > 0) {
    // The KV-block forward: its work list (no partial sums across CTAs) and the partial outputs
    // of one pass of fwd_tokens tokens.
    MSA_TRY(work(&p.kv, std::max(256.0, std::ceil(e_bound / (16.0 * num_sms()))), false));
    p.fwd_tokens = fwd_tokens;
    const size_t slots = size_t(fwd_tokens) * prob.Hq * size_t(prob.k);
    p.part_o = take(2 * slots * prob.D);
    p.part_ml = take(8 * slots);
    p.choice = take(2 * sizeof(unsigned long long));
    p.items_seen = take(p.items_seen_bytes());
    p.taken = take(size_t(prob.T) * prob.Hi * size_t(prob.k));
  }
  if (bwd_tokens > 0) {
    p.bwd_tokens = bwd_tokens;
    p.bwd_passes = static_cast<int32_t>((prob.T + bwd_tokens - 1) / bwd_tokens);
    p.ds = take(2 * size_t(bwd_tokens) * prob.Hq * size_t(prob.k) * Bk);
    if (p.bwd_passes > 1) {
      p.dk_sum = take(sizeof(float) * size_t(prob.Tk) * prob.Hkv * prob.D);
      p.dv_sum = take(sizeof(float) * size_t(prob.Tk) * prob.Hkv * prob.D);
    }
  }
  if (kl) {
    p.lse_idx = take(sizeof(float) * size_t(prob.T) * prob.Hi);
    if (grad) {
      if (!p.dq_rows) p.dq_acc = take(8 * size_t(prob.T) * prob.Hi * prob.Di);
      p.dk_acc = take(8 * size_t(prob.Tk) * prob.Hik * prob.Di);
    } else {
      p.kl_acc = take(8 * size_t(prob.T) * prob.Hi);
    }
  }
  p.total = off;
  *out = p;
  return Status::Ok();
}

Status fwd_kv_plan(const char* fn, const Problem& prob, int32_t nseq, Plan* pl, int64_t paged_kv_tiles) {
  MSA_TRY(can_fwd_kv(fn, prob));
  int64_t tokens = prob.opts.fwd_chunk_tokens;
  if (tokens <= 0) {
    const int64_t per_token = int64_t(prob.Hq) * prob.k * (2 * int64_t(prob.D) + 8);
    tokens = std::max<int64_t>(1, (int64_t(8) << 30) / std::max<int64_t>(per_token, 1));
  }
  // A pass's partial slots are numbered in 32 bits (fwd_kernel's merge: the row's slot of
  // column 0); a workspace that large (over 2^31 slots of 2 D + 8 bytes) would not fit a GPU anyway.
  const int64_t slots_per_token = std::max<int64_t>(1, int64_t(prob.Hq) * prob.k);
  tokens = std::min<int64_t>(tokens, std::numeric_limits<int32_t>::max() / slots_per_token);
  tokens = std::max<int64_t>(1, std::min<int64_t>(tokens, prob.T));
  return make_plan(fn, prob, nseq, /*sparse=*/true, /*main=*/false, /*kl=*/false, /*grad=*/false, pl,
                   tokens, 0, paged_kv_tiles);
}

Status backward_plan(const Problem& prob, const BackwardParams& p, Plan* pl) {
  MSA_TRY(can_backward(prob, p));
  const bool kl = p.dq_idx.defined() || p.dk_idx.defined();
  int64_t tokens = 0;
  if (prob.T > 0 && dq_from_ds(prob, kl)) {
    tokens = prob.opts.bwd_chunk_tokens;
    if (tokens <= 0) {
      const int64_t per_token = 2 * int64_t(prob.Hq) * prob.k * prob.opts.block_size;
      tokens = std::max<int64_t>(1, (int64_t(8) << 30) / std::max<int64_t>(per_token, 1));
    }
    tokens = std::max<int64_t>(1, std::min<int64_t>(tokens, prob.T));
  }
  return make_plan("backward", prob, num_seqs(p.cu_seqlens), prob.opts.mode == Mode::kSparse,
                   true, kl, true, pl, 0, tokens);
}

Status kl_plan(const char* fn, const Problem& prob, const KlInputs& in, Plan* pl) {
  MSA_TRY(can_kl(fn, prob, in));
  return make_plan(fn, prob, num_seqs(in.cu_seqlens),
                   prob.opts.mode == Mode::kSparse, false, true, false, pl);
}

Status need_bytes(const char* fn, size_t bytes, const Launch& launch) {
  Plan pl;
  pl.total = bytes;
  return need_workspace(fn, pl, launch);
}

Status need_workspace(const char* fn, const Plan& pl, const Launch& launch) {
  if (pl.total > 0 && (launch.workspace == nullptr || launch.workspace_bytes < pl.total))
    return Status::Invalid(std::string("msa::") + fn +
                           ": argument 'launch.workspace': the CUDA backend needs " +
                           std::to_string(pl.total) + " bytes of device workspace (workspace_size), got " +
                           std::to_string(launch.workspace == nullptr ? 0 : launch.workspace_bytes));
  return Status::Ok();
}

}  // namespace msa::cuda
