#include "validate.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <numeric>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

namespace msa::detail {
namespace {

constexpr int32_t kMaxTopK = 1 << 20;  // also the largest k (dim 2) of a caller's block_idx

bool rank_in_range(const TensorRef& t) { return t.rank >= 0 && t.rank <= kMaxRank; }

std::string shape_str(const TensorRef& t) {
  if (!rank_in_range(t)) return "(rank " + std::to_string(t.rank) + ")";
  std::ostringstream os;
  os << '[';
  for (int d = 0; d < t.rank; ++d) os << (d ? ", " : "") << t.shape[d];
  os << ']';
  return os.str();
}

// A tensor's bytes as rows: `T` tokens `s0` bytes apart, each holding `H` rows `s1` bytes apart
// of `len` contiguous bytes (rank 3 [T, H, n]; rank 2 [T, n] is H = 1; rank 1 [n] is T = H = 1).
// A stride of a dimension of size 1 is irrelevant and set to 0. Bytes [begin, end) hold it all.
struct RowLayout {
  bool empty = true;   // no elements: shares nothing
  bool rows = false;   // rank <= 3: the row form applies
  __int128 begin = 0, end = 0;
  int64_t T = 1, H = 1, len = 0, s0 = 0, s1 = 0;
  int64_t footprint() const { return (H - 1) * s1 + len; }  // bytes of one token's rows
};

// `t` has passed Check::tensor: rank in [1, kMaxRank], non-negative sizes and strides, the last
// dimension contiguous, and a byte extent below 2^62.
RowLayout row_layout(const TensorRef& t) {
  RowLayout r;
  if (t.numel() == 0) return r;
  r.empty = false;
  const int64_t e = static_cast<int64_t>(dtype_size(t.dtype));
  __int128 last = 0;  // byte offset of the last element
  for (int d = 0; d < t.rank; ++d) last += static_cast<__int128>(t.shape[d] - 1) * t.stride[d] * e;
  r.begin = static_cast<__int128>(reinterpret_cast<uintptr_t>(t.data));
  r.end = r.begin + last + e;
  if (t.rank > 3) return r;
  r.rows = true;
  const int n = t.rank - 1;  // the contiguous dimension
  r.len = t.shape[n] * e;
  if (t.rank >= 2) {
    r.T = t.shape[0];
    r.s0 = t.stride[0] * e;
  }
  if (t.rank == 3) {
    r.H = t.shape[1];
    r.s1 = t.stride[1] * e;
  }
  if (r.T == 1) r.s0 = 0;
  if (r.H == 1) r.s1 = 0;
  return r;
}

// Whether one of the H rows of `y`'s token, at [h * s1, h * s1 + len), meets the bytes [a, b)
// of that token (0 <= a < b).
bool rows_meet(const RowLayout& y, int64_t a, int64_t b) {
  if (y.s1 == 0) return a < y.len;
  const int64_t lo = a < y.len ? 0 : (a - y.len) / y.s1 + 1;  // first row ending after a
  const int64_t hi = std::min(y.H - 1, (b - 1) / y.s1);        // last row starting before b
  return lo <= hi;
}

enum class Overlap { kNone, kShared, kUnknown };

// Whether two tensors share a byte. Decided exactly when both are in row form with one token
// stride that holds each token's rows (any head and element slices of one buffer, e.g. dq, dk,
// dv as head ranges of one [T, Hq + 2 Hkv, D] tensor); otherwise kUnknown when their address
// ranges overlap.
Overlap overlap(const TensorRef& ta, const TensorRef& tb) {
  RowLayout x = row_layout(ta), y = row_layout(tb);
  if (x.empty || y.empty || x.end <= y.begin || y.end <= x.begin) return Overlap::kNone;
  if (!x.rows || !y.rows) return Overlap::kUnknown;
  int64_t s0;
  if (x.T > 1 && y.T > 1) {
    if (x.s0 != y.s0) return Overlap::kUnknown;
    s0 = x.s0;
  } else {
    s0 = x.T > 1 ? x.s0 : y.T > 1 ? y.s0 : std::max(x.footprint(), y.footprint());
  }
  if (s0 <= 0 || x.footprint() > s0 || y.footprint() > s0) return Overlap::kUnknown;
  if (x.H > y.H) std::swap(x, y);  // walk the rows of the one with fewer heads
  // Token u of x starts at y.begin + (u + q) * s0 + r, 0 <= r < s0: a row of x at r + g * s1
  // lies in y's token u + q, or reaches into token u + q + 1 (footprints are at most s0).
  const int64_t delta = static_cast<int64_t>(x.begin - y.begin);  // |delta| < 2^62 here
  int64_t q = delta / s0, r = delta % s0;
  if (r < 0) {
    r += s0;
    --q;
  }
  // Some u in [0, x.T) puts token u + q + j in [0, y.T).
  const bool tok[2] = {q <= y.T - 1 && q + x.T - 1 >= 0, q + 1 <= y.T - 1 && q + x.T >= 0};
  for (int64_t g = 0; g < x.H; ++g) {
    const int64_t o = r + g * x.s1, e = o + x.len;
    if (tok[0] && o < s0 && rows_meet(y, o, std::min(e, s0))) return Overlap::kShared;
    if (tok[1] && e > s0 && rows_meet(y, std::max(o, s0) - s0, e - s0)) return Overlap::kShared;
  }
  return Overlap::kNone;
}

// One entry point's checks: every message names the entry and the argument.
class Check {
 public:
  explicit Check(const char* fn) : fn_(fn) {}

  Status fail(const char* arg, const std::string& what) const { return invalid_arg(fn_, arg, what); }

  Status option(const char* name, bool good, const std::string& what) const {
    return good ? Status::Ok() : fail(name, what);
  }

  // The rank of every TensorRef of the parameters, given or not, before anything reads a shape:
  // a rank outside [0, kMaxRank] is a malformed view (rank 0 means "not given").
  Status ranks(std::initializer_list<std::pair<const char*, const TensorRef*>> all) const {
    for (const auto& [arg, t] : all)
      if (!rank_in_range(*t))
        return fail(arg, "rank " + std::to_string(t->rank) + " is outside [0, " +
                             std::to_string(kMaxRank) + "] (0 means not given)");
    return Status::Ok();
  }

  // Presence, rank, device and layout. Outputs must not overlap themselves; aliasing between
  // tensors is checked by no_aliasing() once every tensor of the call has passed here.
  Status tensor(const char* arg, const TensorRef& t, int rank, bool output) {
    if (!rank_in_range(t))
      return fail(arg, "rank " + std::to_string(t.rank) + " is outside [0, " + std::to_string(kMaxRank) + "]");
    if (!t.defined()) return fail(arg, "required but not given");
    if (t.rank != rank)
      return fail(arg, "expected rank " + std::to_string(rank) + ", got rank " +
                           std::to_string(t.rank) + " with shape " + shape_str(t));
    for (int d = 0; d < t.rank; ++d) {
      if (t.shape[d] < 0) return fail(arg, "negative size in shape " + shape_str(t));
      if (t.stride[d] < 0) return fail(arg, "negative strides are not supported");
    }
    if (!addressable(t))
      return fail(arg, "shape " + shape_str(t) + " and strides address more than 2^62 bytes");
    if (t.numel() > 0 && t.data == nullptr) return fail(arg, "null data pointer");
    if (t.shape[rank - 1] > 1 && t.stride[rank - 1] != 1)
      return fail(arg, "the last dimension must be contiguous (stride 1), got stride " +
                           std::to_string(t.stride[rank - 1]));
    if (output && !non_overlapping(t))
      return fail(arg, "output strides make elements overlap (broadcast or aliased layout)");
    if (!device_set_) {
      device_ = t.device;
      device_set_ = true;
      device_arg_ = arg;
    } else if (t.device != device_) {
      return fail(arg, std::string("on another device than '") + device_arg_ + "'");
    }
    seen_.push_back({arg, t, output});
    return Status::Ok();
  }

  // No output shares memory with an input or with another output of the call (inputs may share
  // memory with each other). Outputs that are disjoint slices of one buffer are fine.
  Status no_aliasing() const {
    for (size_t j = 0; j < seen_.size(); ++j)
      for (size_t i = 0; i < j; ++i) {
        const Seen& a = seen_[i];
        const Seen& b = seen_[j];
        if (!a.output && !b.output) continue;
        const Seen& out = b.output ? b : a;  // the one named: the later output
        const Seen& other = b.output ? a : b;
        switch (overlap(out.t, other.t)) {
          case Overlap::kNone:
            break;
          case Overlap::kShared:
            return fail(out.arg, std::string("shares memory with argument '") + other.arg +
                                     "': an output must not alias an input or another output");
          case Overlap::kUnknown:
            return fail(out.arg,
                        std::string("overlaps the address range of argument '") + other.arg +
                            "' in a layout whose elements cannot be told apart; an output may "
                            "share a buffer only as a slice disjoint from the other tensors, with "
                            "the same token stride (dim 0) and rows that fit in it");
        }
      }
    return Status::Ok();
  }

  Status dtype(const char* arg, const TensorRef& t, DType want) const {
    if (t.dtype == want) return Status::Ok();
    return fail(arg, std::string("expected dtype ") + dtype_name(want) + ", got " +
                         dtype_name(t.dtype));
  }

  Status float_dtype(const char* arg, const TensorRef& t) const {
    switch (t.dtype) {
      case DType::kFloat16:
      case DType::kBFloat16:
      case DType::kFloat32:
        return Status::Ok();
      case DType::kFloat64:
        if (t.device.type == DeviceType::kCpu) return Status::Ok();
        return fail(arg, "float64 is supported on the CPU backend only");
      default:
        return fail(arg, std::string("expected a floating dtype (float16, bfloat16, float32), got ") +
                             dtype_name(t.dtype));
    }
  }

  // `want[d] < 0` accepts any size in dimension d; `names` describes the expectation.
  Status shape(const char* arg, const TensorRef& t, std::initializer_list<int64_t> want,
               const char* names) const {
    int d = 0;
    bool good = static_cast<int>(want.size()) == t.rank;
    for (int64_t w : want) {
      if (good && w >= 0 && t.shape[d] != w) good = false;
      ++d;
    }
    if (good) return Status::Ok();
    std::ostringstream os;
    os << "expected shape " << names << " = [";
    d = 0;
    for (int64_t w : want) {
      os << (d++ ? ", " : "");
      if (w >= 0) os << w; else os << '*';
    }
    os << "], got " << shape_str(t);
    return fail(arg, os.str());
  }

  Device device() const { return device_; }
  const char* fn() const { return fn_; }

 private:
  // Every element's byte offset, and the element count, fit in 62 bits.
  static bool addressable(const TensorRef& t) {
    const __int128 limit = static_cast<__int128>(1) << 62;
    __int128 n = 1, last = 0;
    for (int d = 0; d < t.rank; ++d) {
      n *= t.shape[d];
      if (n > limit) return false;
      last += static_cast<__int128>(t.shape[d] > 0 ? t.shape[d] - 1 : 0) * t.stride[d];
      if (last > limit) return false;
    }
    return (last + 1) * static_cast<__int128>(dtype_size(t.dtype)) <= limit;
  }

  static bool non_overlapping(const TensorRef& t) {
    std::vector<int> order;
    for (int d = 0; d < t.rank; ++d)
      if (t.shape[d] > 1) order.push_back(d);
    std::sort(order.begin(), order.end(),
              [&](int a, int b) { return t.stride[a] < t.stride[b]; });
    int64_t need = 1;
    for (int d : order) {
      if (t.stride[d] < need) return false;
      need = t.stride[d] * t.shape[d];
    }
    return true;
  }

  struct Seen {
    const char* arg;
    TensorRef t;
    bool output;
  };

  const char* fn_;
  std::vector<Seen> seen_;
  bool device_set_ = false;
  Device device_{};
  const char* device_arg_ = "";
};

Status check_head_dim(const Check& c, const char* arg, int64_t v, const char* what) {
  if (v < 1 || v > (1 << 20)) return c.fail(arg, std::string(what) + " must be in [1, 2^20], got " + std::to_string(v));
  return Status::Ok();
}

// Main tensors q and k: fills T, Hq, Hkv, D, dtype.
Status main_qk(Check& c, const TensorRef& q, const TensorRef& k, Problem* prob) {
  MSA_TRY(c.tensor("q", q, 3, false));
  MSA_TRY(c.float_dtype("q", q));
  prob->T = q.shape[0];
  MSA_TRY(check_head_dim(c, "q", q.shape[1], "the head count Hq (dim 1)"));
  MSA_TRY(check_head_dim(c, "q", q.shape[2], "the head dim D (dim 2)"));
  prob->Hq = static_cast<int32_t>(q.shape[1]);
  prob->D = static_cast<int32_t>(q.shape[2]);
  prob->dtype = q.dtype;
  MSA_TRY(c.tensor("k", k, 3, false));
  MSA_TRY(c.dtype("k", k, q.dtype));
  MSA_TRY(c.shape("k", k, {prob->keys_apart ? -1 : prob->T, -1, prob->D},
                  prob->keys_apart ? "[Tk, Hkv, D]" : "[T, Hkv, D]"));
  MSA_TRY(check_head_dim(c, "k", k.shape[1], "the head count Hkv (dim 1)"));
  prob->Hkv = static_cast<int32_t>(k.shape[1]);
  prob->Tk = k.shape[0];
  if (prob->Hq % prob->Hkv != 0)
    return c.fail("k", "Hkv = " + std::to_string(prob->Hkv) + " must divide Hq = " + std::to_string(prob->Hq));
  return Status::Ok();
}

Status main_qkv(Check& c, const TensorRef& q, const TensorRef& k, const TensorRef& v,
                Problem* prob) {
  MSA_TRY(main_qk(c, q, k, prob));
  MSA_TRY(c.tensor("v", v, 3, false));
  MSA_TRY(c.dtype("v", v, q.dtype));
  return c.shape("v", v, {prob->Tk, prob->Hkv, prob->D}, prob->keys_apart ? "[Tk, Hkv, D]" : "[T, Hkv, D]");
}

// q_idx [T, Hi, Di] (`shape` names it): fills Hi, Di (and T, dtype when `standalone`: a call
// without q); Hi must match a block_idx already read.
Status index_queries(Check& c, const TensorRef& qi, bool standalone, const char* shape, Problem* prob) {
  MSA_TRY(c.tensor("q_idx", qi, 3, false));
  if (standalone) {
    MSA_TRY(c.float_dtype("q_idx", qi));
    prob->T = qi.shape[0];
    prob->dtype = qi.dtype;
  } else {
    MSA_TRY(c.dtype("q_idx", qi, prob->dtype));
    MSA_TRY(c.shape("q_idx", qi, {prob->T, -1, -1}, shape));
  }
  MSA_TRY(check_head_dim(c, "q_idx", qi.shape[1], "the index head count Hi (dim 1)"));
  MSA_TRY(check_head_dim(c, "q_idx", qi.shape[2], "the index head dim Di (dim 2)"));
  const int32_t Hi = static_cast<int32_t>(qi.shape[1]);
  if (prob->Hi != 0 && prob->Hi != Hi)
    return c.fail("q_idx", "Hi = " + std::to_string(Hi) + " does not match block_idx's Hi = " +
                               std::to_string(prob->Hi));
  prob->Hi = Hi;
  prob->Di = static_cast<int32_t>(qi.shape[2]);
  return Status::Ok();
}

// Index tensors q_idx, k_idx: fills Hi, Hik, Di (and T, dtype when `standalone`).
Status index_qk(Check& c, const TensorRef& qi, const TensorRef& ki, bool standalone,
                Problem* prob) {
  MSA_TRY(index_queries(c, qi, standalone, "[T, Hi, Di]", prob));
  MSA_TRY(c.tensor("k_idx", ki, 3, false));
  MSA_TRY(c.dtype("k_idx", ki, qi.dtype));
  // Key rows: Tk (read off k_idx when it is the call's first key tensor), else T.
  if (standalone) prob->Tk = prob->keys_apart ? ki.shape[0] : prob->T;
  MSA_TRY(c.shape("k_idx", ki, {prob->Tk, -1, prob->Di}, prob->keys_apart ? "[Tk, Hik, Di]" : "[T, Hik, Di]"));
  MSA_TRY(check_head_dim(c, "k_idx", ki.shape[1], "the index key head count Hik (dim 1)"));
  prob->Hik = static_cast<int32_t>(ki.shape[1]);
  if (prob->Hi % prob->Hik != 0)
    return c.fail("k_idx", "Hik = " + std::to_string(prob->Hik) + " must divide Hi = " + std::to_string(prob->Hi));
  return Status::Ok();
}

// Index heads against main heads: Hi a multiple of Hkv that divides Hq.
Status index_vs_main(const Check& c, const char* arg, const Problem& prob) {
  if (prob.Hi % prob.Hkv != 0 || prob.Hq % prob.Hi != 0)
    return c.fail(arg, "Hi = " + std::to_string(prob.Hi) + " must be a multiple of Hkv = " +
                           std::to_string(prob.Hkv) + " that divides Hq = " + std::to_string(prob.Hq));
  return Status::Ok();
}

// The range of every option, whether or not this call uses it (a caller's block_idx makes the
// selection options unused; kDense mode makes block_idx and top_k unused).
Status option_ranges(const Check& c, const Options& o) {
  MSA_TRY(c.option("mode", o.mode == Mode::kSparse || o.mode == Mode::kDense,
                   "must be kSparse or kDense, got " + std::to_string(static_cast<int32_t>(o.mode))));
  // One rule for every backend (the CUDA kernels take 64 and 128 and say so by kNotSupported).
  MSA_TRY(c.option("block_size", o.block_size >= 1 && (o.block_size & (o.block_size - 1)) == 0,
                   "must be a power of two (1, 2, 4, ..., 2^30), got " + std::to_string(o.block_size)));
  MSA_TRY(c.option("top_k", o.top_k >= 1 && o.top_k <= kMaxTopK,
                   "must be in [1, 2^20], got " + std::to_string(o.top_k)));
  MSA_TRY(c.option("local_blocks", o.local_blocks >= 1,
                   "must be at least 1 (the token's own block is always selected), got " +
                       std::to_string(o.local_blocks)));
  MSA_TRY(c.option("sink_blocks", o.sink_blocks >= 0,
                   "must be non-negative, got " + std::to_string(o.sink_blocks)));
  MSA_TRY(c.option("scale", std::isfinite(o.scale), "must be finite"));
  MSA_TRY(c.option("scale_idx", std::isfinite(o.scale_idx), "must be finite"));
  MSA_TRY(c.option("kl_pass",
                   o.kl_pass == KlPass::kAuto || o.kl_pass == KlPass::kFused ||
                       o.kl_pass == KlPass::kSeparate || o.kl_pass == KlPass::kTeacher,
                   "must be kAuto, kFused, kSeparate or kTeacher, got " +
                       std::to_string(static_cast<int32_t>(o.kl_pass))));
  MSA_TRY(c.option("fwd_pass",
                   o.fwd_pass == FwdPass::kAuto || o.fwd_pass == FwdPass::kQueryTile ||
                       o.fwd_pass == FwdPass::kKvBlock || o.fwd_pass == FwdPass::kSplit,
                   "must be kAuto, kQueryTile, kKvBlock or kSplit, got " +
                       std::to_string(static_cast<int32_t>(o.fwd_pass))));
  MSA_TRY(c.option("dq_pass",
                   o.dq_pass == DqPass::kAuto || o.dq_pass == DqPass::kQueryTile ||
                       o.dq_pass == DqPass::kFromDs,
                   "must be kAuto, kQueryTile or kFromDs, got " +
                       std::to_string(static_cast<int32_t>(o.dq_pass))));
  MSA_TRY(c.option("bwd_chunk_tokens", o.bwd_chunk_tokens >= 0,
                   "must be non-negative, got " + std::to_string(o.bwd_chunk_tokens)));
  MSA_TRY(c.option("fwd_chunk_tokens", o.fwd_chunk_tokens >= 0,
                   "must be non-negative, got " + std::to_string(o.fwd_chunk_tokens)));
  MSA_TRY(c.option("kl_teacher_bytes", o.kl_teacher_bytes >= 0,
                   "must be non-negative, got " + std::to_string(o.kl_teacher_bytes)));
  MSA_TRY(c.option("kl_dq_rows_bytes", o.kl_dq_rows_bytes >= 0,
                   "must be non-negative, got " + std::to_string(o.kl_dq_rows_bytes)));
  MSA_TRY(c.option("select_scores",
                   o.select_scores == SelectScores::kInput || o.select_scores == SelectScores::kFp8,
                   "must be kInput or kFp8, got " + std::to_string(static_cast<int32_t>(o.select_scores))));
  MSA_TRY(c.option("fp8_rerank", o.fp8_rerank >= 0 && o.fp8_rerank <= 64,
                   "must be in [0, 64], got " + std::to_string(o.fp8_rerank)));
  MSA_TRY(c.option("fp8_rerank_slots", o.fp8_rerank_slots >= 0 && o.fp8_rerank_slots <= (1 << 20),
                   "must be in [0, 2^20], got " + std::to_string(o.fp8_rerank_slots)));
  return Status::Ok();
}

// FP8 scores in a paged call (contract §6): a prefill (max_q_len = 0) takes E4M3 copies of q_idx
// and of each page of the sequences' index keys (an E4M3 cache's: of its dequantised keys), as
// select_blocks takes them of each block; decode refuses it.
Status paged_scores(const Check& c, const Options& o, int32_t max_q_len) {
  if (o.select_scores != SelectScores::kFp8) return Status::Ok();
  return c.option("select_scores", max_q_len == 0,
                  "kFp8 applies to a prefill (max_q_len = 0); decode scores the cache's k_idx as stored "
                  "(an E4M3 cache gives FP8 keys), got max_q_len " + std::to_string(max_q_len));
}

// Options with the scales' defaults resolved (after option_ranges and the tensors: D, Di known).
void resolve_options(const Options& o, Problem* prob) {
  prob->opts = o;
  if (o.scale == 0.f && prob->D > 0) prob->opts.scale = 1.f / std::sqrt(static_cast<float>(prob->D));
  if (o.scale_idx == 0.f && prob->Di > 0)
    prob->opts.scale_idx = 1.f / std::sqrt(static_cast<float>(prob->Di));
}

// What selecting needs beyond the ranges: room for the forced blocks.
Status selection_options(const Check& c, const Options& o) {
  MSA_TRY(c.option("top_k", static_cast<int64_t>(o.sink_blocks) + o.local_blocks <= o.top_k,
                   "must hold the forced blocks: top_k = " + std::to_string(o.top_k) +
                       " < sink_blocks + local_blocks = " +
                       std::to_string(static_cast<int64_t>(o.sink_blocks) + o.local_blocks)));
  return Status::Ok();
}

// cu_seqlens (or the serving calls' cu_seqlens_q, named `arg`): int32 [nseq+1] (optional).
Status seqlens_shape(Check& c, const TensorRef& cu, const char* arg = "cu_seqlens") {
  if (!cu.defined()) return Status::Ok();
  MSA_TRY(c.tensor(arg, cu, 1, false));
  MSA_TRY(c.dtype(arg, cu, DType::kInt32));
  if (cu.shape[0] < 2) return c.fail(arg, "expected shape [nseq+1] with nseq >= 1, got " + shape_str(cu));
  return Status::Ok();
}

// The offsets of a CPU tensor `cu` (named `arg`) into *out: 0 = cu[0] <= ... <= cu[nseq] = end,
// `end_name` naming the row count they must end at.
Status offsets_values(const Check& c, const TensorRef& cu, const char* arg, int64_t end, const char* end_name,
                      std::vector<int64_t>* out) {
  const int32_t* v = static_cast<const int32_t*>(cu.data);
  const int64_t n = cu.shape[0];
  const std::string a(arg);
  std::vector<int64_t>& o = *out;
  o.resize(n);
  for (int64_t s = 0; s < n; ++s) o[s] = v[s * cu.stride[0]];
  if (o[0] != 0) return c.fail(arg, "must start at 0, got " + std::to_string(o[0]));
  for (int64_t s = 1; s < n; ++s)
    if (o[s] < o[s - 1])
      return c.fail(arg, "must be non-decreasing, but " + a + "[" + std::to_string(s) + "] = " +
                             std::to_string(o[s]) + " < " + a + "[" + std::to_string(s - 1) + "] = " +
                             std::to_string(o[s - 1]));
  if (o[n - 1] != end)
    return c.fail(arg, std::string("must end at ") + end_name + " = " + std::to_string(end) + ", got " +
                           std::to_string(o[n - 1]));
  return Status::Ok();
}

// Its values, 0 = cu[0] <= ... <= cu[nseq] = T, read into prob->cu on the CPU only (after
// seqlens_shape and the layout checks).
Status seqlens_values(const Check& c, const TensorRef& cu, Problem* prob, const char* arg = "cu_seqlens") {
  prob->cu.clear();
  if (!cu.defined()) {
    if (c.device().type == DeviceType::kCpu) prob->cu = {0, prob->T};
    return Status::Ok();
  }
  if (cu.device.type != DeviceType::kCpu) return Status::Ok();
  return offsets_values(c, cu, arg, prob->T, std::string(arg) == "cu_seqlens_q" ? "Tq" : "T", &prob->cu);
}

// cu_seqlens_k (keys apart from queries, params.h): int32 [nseq+1] with the nseq of cu_seqlens
// (absent: [2]). Called after the key tensors' shapes (prob->Tk known). Every sequence has at
// least as many keys as queries, so Tk >= T, which the shapes show before any value is read.
Status key_seqlens_shape(Check& c, const TensorRef& cu_k, const TensorRef& cu, const Problem& prob) {
  if (!cu_k.defined()) return Status::Ok();
  MSA_TRY(c.tensor("cu_seqlens_k", cu_k, 1, false));
  MSA_TRY(c.dtype("cu_seqlens_k", cu_k, DType::kInt32));
  const int64_t want = cu.defined() ? cu.shape[0] : 2;
  if (cu_k.shape[0] != want)
    return c.fail("cu_seqlens_k", "expected shape [nseq+1] = [" + std::to_string(want) + "] (" +
                                      (cu.defined() ? "that of cu_seqlens" : "one sequence: cu_seqlens is not given") +
                                      "), got " + shape_str(cu_k));
  if (prob.Tk < prob.T)
    return c.fail("cu_seqlens_k", "the key tensors hold Tk = " + std::to_string(prob.Tk) + " rows, fewer than the T = " +
                                      std::to_string(prob.T) +
                                      " queries: every sequence's queries are the last positions of its keys");
  return Status::Ok();
}

// Its values on the CPU (after seqlens_values: prob->cu known): 0 = cu_k[0] <= ... <= cu_k[nseq]
// = Tk and every sequence's keys at least its queries (they are its last positions); `start`
// (optional) receives m_s - n_s, the position of each sequence's first query. Absent: cu_k =
// cu (and start 0). For CUDA tensors prob->cu_k stays empty.
Status key_seqlens_values(const Check& c, const TensorRef& cu_k, Problem* prob,
                          std::vector<int64_t>* start = nullptr) {
  prob->cu_k.clear();
  if (!cu_k.defined()) {
    prob->cu_k = prob->cu;
    if (start) start->assign(prob->cu.empty() ? 0 : prob->cu.size() - 1, 0);
    return Status::Ok();
  }
  if (cu_k.device.type != DeviceType::kCpu) return Status::Ok();
  MSA_TRY(offsets_values(c, cu_k, "cu_seqlens_k", prob->Tk, "Tk (the key tensors' rows)", &prob->cu_k));
  const std::vector<int64_t>& ck = prob->cu_k;
  const int64_t n = cu_k.shape[0];
  if (start) start->assign(n - 1, 0);
  for (int64_t s = 0; s + 1 < n; ++s) {
    const int64_t m = ck[s + 1] - ck[s], q = prob->cu[s + 1] - prob->cu[s];
    if (m < q)
      return c.fail("cu_seqlens_k", "sequence " + std::to_string(s) + " has " + std::to_string(m) +
                                        " keys, fewer than its " + std::to_string(q) +
                                        " queries (cu_seqlens): the queries are the last positions of their "
                                        "sequence's keys");
    if (start) (*start)[s] = m - q;
  }
  return Status::Ok();
}

// A caller's block_idx on the CPU: every entry -1 or a block in [0, blk(t)], no duplicates.
// `start[s]` (optional) is the position of sequence s's first row: 0 in training (m_s - n_s with
// cu_seqlens_k), seq_lens[s] - n_s for the new tokens of a serving call.
Status block_idx_values(const Check& c, const TensorRef& bi, const Problem& prob,
                        const std::vector<int64_t>* start = nullptr) {
  if (bi.device.type != DeviceType::kCpu || prob.k == 0) return Status::Ok();
  const int32_t* base = static_cast<const int32_t*>(bi.data);
  std::vector<int32_t> row(prob.k);
  for (int64_t s = 0; s + 1 < static_cast<int64_t>(prob.cu.size()); ++s) {
    for (int64_t g = prob.cu[s]; g < prob.cu[s + 1]; ++g) {
      const int64_t own = (g - prob.cu[s] + (start ? (*start)[s] : 0)) / prob.opts.block_size;
      for (int32_t i = 0; i < prob.Hi; ++i) {
        const int32_t* r = base + g * bi.stride[0] + i * bi.stride[1];
        for (int32_t j = 0; j < prob.k; ++j) {
          row[j] = r[j * bi.stride[2]];
          if (row[j] < -1 || row[j] > own)
            return c.fail("block_idx", "entry [" + std::to_string(g) + ", " + std::to_string(i) + ", " +
                                           std::to_string(j) + "] = " + std::to_string(row[j]) +
                                           " is out of range: expected -1 or a block in [0, " +
                                           std::to_string(own) + "] (the token's own block)");
        }
        std::sort(row.begin(), row.end());
        for (int32_t j = 1; j < prob.k; ++j)
          if (row[j] >= 0 && row[j] == row[j - 1])
            return c.fail("block_idx", "row [" + std::to_string(g) + ", " + std::to_string(i) +
                                           "] selects block " + std::to_string(row[j]) + " twice");
      }
    }
  }
  return Status::Ok();
}

// block_idx [T, Hi, k] int32 in kSparse mode: fills Hi and k.
Status block_idx_shape(Check& c, const TensorRef& bi, bool output, Problem* prob) {
  MSA_TRY(c.tensor("block_idx", bi, 3, output));
  MSA_TRY(c.dtype("block_idx", bi, DType::kInt32));
  MSA_TRY(c.shape("block_idx", bi, {prob->T, -1, -1}, "[T, Hi, k]"));
  MSA_TRY(check_head_dim(c, "block_idx", bi.shape[1], "the index head count Hi (dim 1)"));
  if (bi.shape[2] < 1 || bi.shape[2] > kMaxTopK)
    return c.fail("block_idx", "k (dim 2) must be in [1, 2^20], got " + std::to_string(bi.shape[2]));
  prob->Hi = static_cast<int32_t>(bi.shape[1]);
  prob->k = static_cast<int32_t>(bi.shape[2]);
  return Status::Ok();
}

Status out_tensor(Check& c, const char* arg, const TensorRef& t, DType dt,
                  std::initializer_list<int64_t> shape, const char* names) {
  MSA_TRY(c.tensor(arg, t, static_cast<int>(shape.size()), true));
  MSA_TRY(c.dtype(arg, t, dt));
  return c.shape(arg, t, shape, names);
}

Status in_tensor(Check& c, const char* arg, const TensorRef& t, DType dt,
                 std::initializer_list<int64_t> shape, const char* names) {
  MSA_TRY(c.tensor(arg, t, static_cast<int>(shape.size()), false));
  MSA_TRY(c.dtype(arg, t, dt));
  return c.shape(arg, t, shape, names);
}

Status scalar_out(Check& c, const char* arg, const TensorRef& t) {
  return out_tensor(c, arg, t, DType::kFloat32, {1}, "[1]");
}

// ---- serving over a paged cache (docs/contract.md §6) ------------------------------------------

constexpr int32_t kMaxQLen = 16;  // the decode bound of max_q_len (multi-token prediction)

Status max_q_len_range(const Check& c, int32_t m) {
  return c.option("max_q_len", m >= 0 && m <= kMaxQLen,
                  "must be in [0, 16] (0: any number of new tokens per sequence; 1..16: a decode "
                  "bound on every sequence's count), got " + std::to_string(m));
}

// A cache tensor [pages, Bk, H, n]: `pages` < 0 accepts any page count (the first cache tensor
// of a call sets it), `H` < 0 any head count.
Status page_tensor(Check& c, const char* arg, const TensorRef& t, DType dt, int64_t pages, int32_t Bk,
                   int64_t H, int64_t n, const char* names, bool output) {
  MSA_TRY(c.tensor(arg, t, 4, output));
  MSA_TRY(c.dtype(arg, t, dt));
  MSA_TRY(c.shape(arg, t, {pages, Bk, H, n}, names));
  return check_head_dim(c, arg, t.shape[2], "the head count (dim 2)");
}

// The scale of a cache tensor (PagedCache): float32 [1] or [pages], given iff the tensor `t` is
// float8_e4m3. Its values are checked by scale_values.
Status cache_scale(Check& c, const char* arg, const TensorRef& scale, const char* tensor_arg,
                   const TensorRef& t, int64_t pages) {
  if (t.dtype != DType::kFloat8E4M3) {
    if (scale.defined())
      return c.fail(arg, std::string("given for '") + tensor_arg + "' of dtype " + dtype_name(t.dtype) +
                             ": scales apply to float8_e4m3 cache tensors only");
    return Status::Ok();
  }
  if (!scale.defined())
    return c.fail(arg, std::string("required: '") + tensor_arg +
                           "' is float8_e4m3 (expected float32 [1] per tensor or [pages] per page)");
  MSA_TRY(c.tensor(arg, scale, 1, false));
  MSA_TRY(c.dtype(arg, scale, DType::kFloat32));
  if (scale.shape[0] != 1 && scale.shape[0] != pages)
    return c.fail(arg, "expected shape [1] (per tensor) or [pages] = [" + std::to_string(pages) +
                           "] (per page), got " + shape_str(scale));
  return Status::Ok();
}

// A given scale's values on the CPU: finite and positive (for CUDA tensors the CUDA backend
// checks the same values).
Status scale_values(const Check& c, const char* arg, const TensorRef& scale) {
  if (!scale.defined() || scale.device.type != DeviceType::kCpu) return Status::Ok();
  const float* v = static_cast<const float*>(scale.data);
  for (int64_t i = 0; i < scale.shape[0]; ++i) {
    const float x = v[i * scale.stride[0]];
    if (!(std::isfinite(x) && x > 0.f))
      return c.fail(arg, "scale[" + std::to_string(i) + "] = " + std::to_string(x) +
                             " is not a finite positive number");
  }
  return Status::Ok();
}

// q_scale's values on the CPU ([1] or [Tq, Hq]): finite and positive.
Status query_scale_values(const Check& c, const TensorRef& scale) {
  if (scale.device.type != DeviceType::kCpu) return Status::Ok();
  const float* v = static_cast<const float*>(scale.data);
  const int64_t rows = scale.shape[0], cols = scale.rank == 2 ? scale.shape[1] : 1;
  for (int64_t i = 0; i < rows; ++i)
    for (int64_t j = 0; j < cols; ++j) {
      const float x = v[i * scale.stride[0] + (scale.rank == 2 ? j * scale.stride[1] : 0)];
      if (!(std::isfinite(x) && x > 0.f))
        return c.fail("q_scale", "q_scale[" + std::to_string(i) + (scale.rank == 2 ? ", " + std::to_string(j) : "") +
                                     "] = " + std::to_string(x) + " is not a finite positive number");
    }
  return Status::Ok();
}

// The dtype a cache tensor must have next to inputs of dtype `like`: its own when it is
// float8_e4m3 (dequantised through its scale), else `like`.
DType cache_dtype(const TensorRef& t, DType like) {
  return t.defined() && t.dtype == DType::kFloat8E4M3 ? DType::kFloat8E4M3 : like;
}

// The index side of a serving call: q_idx [Tq, Hi, Di] and cache.k_idx [pages, Bk, Hik, Di]
// (with cache.k_idx_scale when it is float8_e4m3). Fills Hi, Hik, Di (and T, dtype when
// `standalone`: paged_select_blocks has no q).
Status paged_index(Check& c, const TensorRef& qi, const PagedCache& cache, bool standalone, int64_t* pages,
                   Problem* prob) {
  const TensorRef& kc = cache.k_idx;
  MSA_TRY(index_queries(c, qi, standalone, "[Tq, Hi, Di]", prob));
  MSA_TRY(page_tensor(c, "cache.k_idx", kc, cache_dtype(kc, qi.dtype), *pages, prob->opts.block_size, -1,
                      prob->Di, "[pages, Bk, Hik, Di]", false));
  *pages = kc.shape[0];
  MSA_TRY(cache_scale(c, "cache.k_idx_scale", cache.k_idx_scale, "cache.k_idx", kc, *pages));
  prob->Hik = static_cast<int32_t>(kc.shape[2]);
  if (prob->Hi % prob->Hik != 0)
    return c.fail("cache.k_idx", "Hik = " + std::to_string(prob->Hik) + " must divide Hi = " +
                                     std::to_string(prob->Hi));
  return Status::Ok();
}

// The batch description: cu_seqlens_q [nseq+1], cache.seq_lens [nseq], cache.page_table
// [nseq, max_pages], all int32 and required.
Status paged_batch_shape(Check& c, const PagedCache& cache, const TensorRef& cu_q) {
  MSA_TRY(c.tensor("cu_seqlens_q", cu_q, 1, false));
  MSA_TRY(c.dtype("cu_seqlens_q", cu_q, DType::kInt32));
  if (cu_q.shape[0] < 2)
    return c.fail("cu_seqlens_q", "expected shape [nseq+1] with nseq >= 1, got " + shape_str(cu_q));
  const int64_t nseq = cu_q.shape[0] - 1;
  MSA_TRY(in_tensor(c, "cache.seq_lens", cache.seq_lens, DType::kInt32, {nseq}, "[nseq]"));
  MSA_TRY(in_tensor(c, "cache.page_table", cache.page_table, DType::kInt32, {nseq, -1}, "[nseq, max_pages]"));
  return Status::Ok();
}

// The batch's values on the CPU (after the layout checks): cu_seqlens_q into prob->cu (0, never
// decreasing, ending at Tq), then for each sequence s with n_s new tokens and L = seq_lens[s]:
// 0 <= n_s <= L <= max_pages * Bk, n_s <= max_q_len when that is set, and the pages of its blocks
// 0 .. ceil(L / Bk) - 1 in [0, pages). `start` (optional) receives L - n_s, the position of the
// sequence's first new token. For CUDA tensors the CUDA backend checks the same values.
Status paged_values(const Check& c, const PagedCache& cache, const TensorRef& cu_q, int64_t pages,
                    int32_t Bk, int32_t max_q_len, Problem* prob, std::vector<int64_t>* start) {
  MSA_TRY(seqlens_values(c, cu_q, prob, "cu_seqlens_q"));
  if (cu_q.device.type != DeviceType::kCpu) return Status::Ok();
  const int64_t nseq = cu_q.shape[0] - 1, max_pages = cache.page_table.shape[1];
  const int32_t* lens = static_cast<const int32_t*>(cache.seq_lens.data);
  const int32_t* table = static_cast<const int32_t*>(cache.page_table.data);
  if (start) start->assign(nseq, 0);
  for (int64_t s = 0; s < nseq; ++s) {
    const int64_t n = prob->cu[s + 1] - prob->cu[s];
    const int64_t L = lens[s * cache.seq_lens.stride[0]];
    const std::string ss = std::to_string(s);
    if (L < 0) return c.fail("cache.seq_lens", "seq_lens[" + ss + "] = " + std::to_string(L) + " is negative");
    if (n > L)
      return c.fail("cache.seq_lens", "seq_lens[" + ss + "] = " + std::to_string(L) +
                                          " is less than the " + std::to_string(n) + " new tokens cu_seqlens_q gives sequence " +
                                          ss + " (they are its last positions, counted in seq_lens)");
    if (L > max_pages * Bk)
      return c.fail("cache.seq_lens", "seq_lens[" + ss + "] = " + std::to_string(L) + " needs " +
                                          std::to_string((L + Bk - 1) / Bk) + " pages of Bk = " + std::to_string(Bk) +
                                          " tokens, more than the page table's max_pages = " + std::to_string(max_pages));
    if (max_q_len > 0 && n > max_q_len)
      return c.fail("max_q_len", "sequence " + ss + " has " + std::to_string(n) +
                                        " new tokens, more than max_q_len = " + std::to_string(max_q_len));
    for (int64_t b = 0; b < (L + Bk - 1) / Bk; ++b) {
      const int64_t page = table[s * cache.page_table.stride[0] + b * cache.page_table.stride[1]];
      if (page < 0 || page >= pages)
        return c.fail("cache.page_table", "entry [" + ss + ", " + std::to_string(b) + "] = " + std::to_string(page) +
                                              " is out of range: expected a page in [0, " + std::to_string(pages) +
                                              ") for block " + std::to_string(b) + " of sequence " + ss +
                                              " (seq_lens[" + ss + "] = " + std::to_string(L) + ")");
    }
    if (start) (*start)[s] = L - n;
  }
  return Status::Ok();
}

// The sequences of a training-side call, last: the shapes of cu_seqlens and cu_seqlens_k; then no
// two of the call's tensors overlap wrongly (the layout is all checked: the values of inputs come
// last); then the offsets' values and, where given, those of a caller's block_idx.
Status sequences(Check& c, const TensorRef& cu, const TensorRef& cu_k, const TensorRef* block_idx,
                 Problem* prob) {
  MSA_TRY(seqlens_shape(c, cu));
  MSA_TRY(key_seqlens_shape(c, cu_k, cu, *prob));
  MSA_TRY(c.no_aliasing());
  MSA_TRY(seqlens_values(c, cu, prob));
  std::vector<int64_t> start;
  MSA_TRY(key_seqlens_values(c, cu_k, prob, &start));
  if (block_idx != nullptr) MSA_TRY(block_idx_values(c, *block_idx, *prob, &start));
  return Status::Ok();
}

}  // namespace

Status validate(const SelectParams& p, Problem* prob) {
  Check c("select_blocks");
  *prob = Problem{};
  MSA_TRY(c.ranks({{"q_idx", &p.q_idx}, {"k_idx", &p.k_idx}, {"cu_seqlens", &p.cu_seqlens},
                   {"cu_seqlens_k", &p.cu_seqlens_k}, {"block_idx", &p.block_idx}, {"lse_idx", &p.lse_idx}}));
  MSA_TRY(option_ranges(c, p.opts));
  MSA_TRY(c.option("mode", p.opts.mode == Mode::kSparse, "select_blocks needs kSparse mode"));
  MSA_TRY(selection_options(c, p.opts));
  prob->keys_apart = p.cu_seqlens_k.defined();
  MSA_TRY(index_qk(c, p.q_idx, p.k_idx, /*standalone=*/true, prob));
  resolve_options(p.opts, prob);
  prob->k = p.opts.top_k;
  MSA_TRY(out_tensor(c, "block_idx", p.block_idx, DType::kInt32, {prob->T, prob->Hi, prob->k}, "[T, Hi, top_k]"));
  if (p.lse_idx.defined())
    MSA_TRY(out_tensor(c, "lse_idx", p.lse_idx, DType::kFloat32, {prob->T, prob->Hi}, "[T, Hi]"));
  return sequences(c, p.cu_seqlens, p.cu_seqlens_k, nullptr, prob);
}

Status validate(const ForwardParams& p, Problem* prob) {
  Check c("forward");
  *prob = Problem{};
  MSA_TRY(c.ranks({{"q", &p.q}, {"k", &p.k}, {"v", &p.v}, {"cu_seqlens", &p.cu_seqlens},
                   {"cu_seqlens_k", &p.cu_seqlens_k}, {"block_idx", &p.block_idx}, {"q_idx", &p.q_idx},
                   {"k_idx", &p.k_idx}, {"out", &p.out}, {"lse", &p.lse}, {"kl", &p.kl}}));
  MSA_TRY(option_ranges(c, p.opts));
  const bool sparse = p.opts.mode == Mode::kSparse;
  if (sparse && p.select) MSA_TRY(selection_options(c, p.opts));
  prob->keys_apart = p.cu_seqlens_k.defined();
  MSA_TRY(main_qkv(c, p.q, p.k, p.v, prob));
  const bool need_index = (sparse && p.select) || p.kl.defined();
  if (sparse) MSA_TRY(block_idx_shape(c, p.block_idx, /*output=*/p.select, prob));
  if (need_index) {
    MSA_TRY(index_qk(c, p.q_idx, p.k_idx, false, prob));
    MSA_TRY(index_vs_main(c, "q_idx", *prob));
  } else if (sparse) {
    MSA_TRY(index_vs_main(c, "block_idx", *prob));
  }
  resolve_options(p.opts, prob);
  if (sparse && p.select && prob->k != p.opts.top_k)
    return c.fail("block_idx", "expected k (dim 2) = top_k = " + std::to_string(p.opts.top_k) +
                                   ", got " + std::to_string(prob->k));
  MSA_TRY(out_tensor(c, "out", p.out, prob->dtype, {prob->T, prob->Hq, prob->D}, "[T, Hq, D]"));
  MSA_TRY(out_tensor(c, "lse", p.lse, DType::kFloat32, {prob->T, prob->Hq}, "[T, Hq]"));
  if (p.kl.defined()) MSA_TRY(scalar_out(c, "kl", p.kl));
  return sequences(c, p.cu_seqlens, p.cu_seqlens_k, sparse && !p.select ? &p.block_idx : nullptr, prob);
}

Status validate(const BackwardParams& p, Problem* prob) {
  Check c("backward");
  *prob = Problem{};
  MSA_TRY(c.ranks({{"q", &p.q}, {"k", &p.k}, {"v", &p.v}, {"out", &p.out}, {"lse", &p.lse},
                   {"dout", &p.dout}, {"cu_seqlens", &p.cu_seqlens}, {"cu_seqlens_k", &p.cu_seqlens_k},
                   {"block_idx", &p.block_idx},
                   {"dq", &p.dq}, {"dk", &p.dk}, {"dv", &p.dv}, {"q_idx", &p.q_idx},
                   {"k_idx", &p.k_idx}, {"dq_idx", &p.dq_idx}, {"dk_idx", &p.dk_idx},
                   {"kl_grad", &p.kl_grad}}));
  MSA_TRY(option_ranges(c, p.opts));
  MSA_TRY(c.option("kl_weight", std::isfinite(p.kl_weight), "must be finite"));
  prob->keys_apart = p.cu_seqlens_k.defined();
  MSA_TRY(main_qkv(c, p.q, p.k, p.v, prob));
  const bool sparse = p.opts.mode == Mode::kSparse;
  const bool kl = p.dq_idx.defined() || p.dk_idx.defined();
  if (sparse) MSA_TRY(block_idx_shape(c, p.block_idx, false, prob));
  if (kl) {
    MSA_TRY(index_qk(c, p.q_idx, p.k_idx, false, prob));
    MSA_TRY(index_vs_main(c, "q_idx", *prob));
  } else if (sparse) {
    MSA_TRY(index_vs_main(c, "block_idx", *prob));
  }
  resolve_options(p.opts, prob);
  const int64_t T = prob->T;
  MSA_TRY(in_tensor(c, "out", p.out, prob->dtype, {T, prob->Hq, prob->D}, "[T, Hq, D]"));
  MSA_TRY(in_tensor(c, "lse", p.lse, DType::kFloat32, {T, prob->Hq}, "[T, Hq]"));
  MSA_TRY(in_tensor(c, "dout", p.dout, prob->dtype, {T, prob->Hq, prob->D}, "[T, Hq, D]"));
  MSA_TRY(out_tensor(c, "dq", p.dq, prob->dtype, {T, prob->Hq, prob->D}, "[T, Hq, D]"));
  const int64_t Tk = prob->Tk;
  const bool apart = prob->keys_apart;
  MSA_TRY(out_tensor(c, "dk", p.dk, prob->dtype, {Tk, prob->Hkv, prob->D}, apart ? "[Tk, Hkv, D]" : "[T, Hkv, D]"));
  MSA_TRY(out_tensor(c, "dv", p.dv, prob->dtype, {Tk, prob->Hkv, prob->D}, apart ? "[Tk, Hkv, D]" : "[T, Hkv, D]"));
  if (p.dq_idx.defined())
    MSA_TRY(out_tensor(c, "dq_idx", p.dq_idx, prob->dtype, {T, prob->Hi, prob->Di}, "[T, Hi, Di]"));
  if (p.dk_idx.defined())
    MSA_TRY(out_tensor(c, "dk_idx", p.dk_idx, prob->dtype, {Tk, prob->Hik, prob->Di},
                       apart ? "[Tk, Hik, Di]" : "[T, Hik, Di]"));
  if (p.kl_grad.defined()) MSA_TRY(in_tensor(c, "kl_grad", p.kl_grad, DType::kFloat32, {1}, "[1]"));
  return sequences(c, p.cu_seqlens, p.cu_seqlens_k, sparse ? &p.block_idx : nullptr, prob);
}

Status validate(const KlParams& p, Problem* prob) {
  Check c("kl_divergence");
  *prob = Problem{};
  MSA_TRY(c.ranks({{"q", &p.q}, {"k", &p.k}, {"lse", &p.lse}, {"q_idx", &p.q_idx},
                   {"k_idx", &p.k_idx}, {"cu_seqlens", &p.cu_seqlens}, {"cu_seqlens_k", &p.cu_seqlens_k},
                   {"block_idx", &p.block_idx}, {"kl", &p.kl}, {"kl_rows", &p.kl_rows}}));
  MSA_TRY(option_ranges(c, p.opts));
  prob->keys_apart = p.cu_seqlens_k.defined();
  MSA_TRY(main_qk(c, p.q, p.k, prob));
  const bool sparse = p.opts.mode == Mode::kSparse;
  if (sparse) MSA_TRY(block_idx_shape(c, p.block_idx, false, prob));
  MSA_TRY(index_qk(c, p.q_idx, p.k_idx, false, prob));
  MSA_TRY(index_vs_main(c, "q_idx", *prob));
  resolve_options(p.opts, prob);
  MSA_TRY(in_tensor(c, "lse", p.lse, DType::kFloat32, {prob->T, prob->Hq}, "[T, Hq]"));
  MSA_TRY(scalar_out(c, "kl", p.kl));
  if (p.kl_rows.defined())
    MSA_TRY(out_tensor(c, "kl_rows", p.kl_rows, DType::kFloat32, {prob->T, prob->Hi}, "[T, Hi]"));
  return sequences(c, p.cu_seqlens, p.cu_seqlens_k, sparse ? &p.block_idx : nullptr, prob);
}

Status validate(const PagedSelectParams& p, Problem* prob) {
  Check c("paged_select_blocks");
  *prob = Problem{};
  const PagedCache& cache = p.cache;
  MSA_TRY(c.ranks({{"q_idx", &p.q_idx}, {"cu_seqlens_q", &p.cu_seqlens_q}, {"cache.k", &cache.k},
                   {"cache.v", &cache.v}, {"cache.k_idx", &cache.k_idx}, {"cache.page_table", &cache.page_table},
                   {"cache.seq_lens", &cache.seq_lens}, {"block_idx", &p.block_idx},
                   {"cache.k_idx_scale", &cache.k_idx_scale}}));
  MSA_TRY(option_ranges(c, p.opts));
  MSA_TRY(c.option("mode", p.opts.mode == Mode::kSparse, "paged_select_blocks needs kSparse mode"));
  MSA_TRY(selection_options(c, p.opts));
  MSA_TRY(max_q_len_range(c, p.max_q_len));
  MSA_TRY(paged_scores(c, p.opts, p.max_q_len));
  prob->opts.block_size = p.opts.block_size;
  int64_t pages = -1;
  MSA_TRY(paged_index(c, p.q_idx, cache, /*standalone=*/true, &pages, prob));
  resolve_options(p.opts, prob);
  prob->k = p.opts.top_k;
  MSA_TRY(out_tensor(c, "block_idx", p.block_idx, DType::kInt32, {prob->T, prob->Hi, prob->k}, "[Tq, Hi, top_k]"));
  MSA_TRY(paged_batch_shape(c, cache, p.cu_seqlens_q));
  MSA_TRY(c.no_aliasing());  // the layout is all checked: the values of inputs come last
  MSA_TRY(scale_values(c, "cache.k_idx_scale", cache.k_idx_scale));
  return paged_values(c, cache, p.cu_seqlens_q, pages, p.opts.block_size, p.max_q_len, prob, nullptr);
}

Status validate(const PagedForwardParams& p, Problem* prob) {
  Check c("paged_forward");
  *prob = Problem{};
  const PagedCache& cache = p.cache;
  MSA_TRY(c.ranks({{"q", &p.q}, {"q_scale", &p.q_scale}, {"cu_seqlens_q", &p.cu_seqlens_q}, {"cache.k", &cache.k},
                   {"cache.v", &cache.v}, {"cache.k_idx", &cache.k_idx}, {"cache.page_table", &cache.page_table},
                   {"cache.seq_lens", &cache.seq_lens}, {"block_idx", &p.block_idx}, {"q_idx", &p.q_idx},
                   {"out", &p.out}, {"lse", &p.lse}, {"cache.k_scale", &cache.k_scale},
                   {"cache.v_scale", &cache.v_scale}, {"cache.k_idx_scale", &cache.k_idx_scale}}));
  MSA_TRY(option_ranges(c, p.opts));
  const bool sparse = p.opts.mode == Mode::kSparse;
  const bool select = sparse && p.select;
  if (select) {
    MSA_TRY(selection_options(c, p.opts));
  }
  MSA_TRY(max_q_len_range(c, p.max_q_len));
  if (select) MSA_TRY(paged_scores(c, p.opts, p.max_q_len));
  const int32_t Bk = p.opts.block_size;
  prob->opts.block_size = Bk;
  MSA_TRY(c.tensor("q", p.q, 3, false));
  // FP8 queries (Q8KV8): over E4M3 caches, dequantised through q_scale; out gives the dtype.
  const bool q8 = p.q.dtype == DType::kFloat8E4M3;
  if (q8) {
    if (!(cache.k.defined() && cache.k.dtype == DType::kFloat8E4M3))
      return c.fail("q", std::string("float8_e4m3 queries need float8_e4m3 cache.k and cache.v (Q8KV8); cache.k is ") +
                             (cache.k.defined() ? dtype_name(cache.k.dtype) : "not given"));
    if (!p.q_scale.defined())
      return c.fail("q_scale", "required: 'q' is float8_e4m3 (expected float32 [1] per tensor or [Tq, Hq] per "
                               "token and head)");
    if (!p.out.defined()) return c.fail("out", "required but not given");
    MSA_TRY(c.float_dtype("out", p.out));  // its shape is checked below
  } else {
    MSA_TRY(c.float_dtype("q", p.q));
    if (p.q_scale.defined())
      return c.fail("q_scale", std::string("given for 'q' of dtype ") + dtype_name(p.q.dtype) +
                                   ": scales apply to float8_e4m3 queries only");
  }
  prob->T = p.q.shape[0];
  MSA_TRY(check_head_dim(c, "q", p.q.shape[1], "the head count Hq (dim 1)"));
  MSA_TRY(check_head_dim(c, "q", p.q.shape[2], "the head dim D (dim 2)"));
  prob->Hq = static_cast<int32_t>(p.q.shape[1]);
  prob->D = static_cast<int32_t>(p.q.shape[2]);
  prob->dtype = q8 ? p.out.dtype : p.q.dtype;
  if (q8) {
    if (p.q_scale.rank == 1) MSA_TRY(in_tensor(c, "q_scale", p.q_scale, DType::kFloat32, {1}, "[1] or [Tq, Hq]"));
    else MSA_TRY(in_tensor(c, "q_scale", p.q_scale, DType::kFloat32, {prob->T, prob->Hq}, "[1] or [Tq, Hq]"));
  }
  MSA_TRY(page_tensor(c, "cache.k", cache.k, cache_dtype(cache.k, prob->dtype), -1, Bk, -1, prob->D,
                      "[pages, Bk, Hkv, D]", false));
  int64_t pages = cache.k.shape[0];
  prob->Hkv = static_cast<int32_t>(cache.k.shape[2]);
  if (prob->Hq % prob->Hkv != 0)
    return c.fail("cache.k", "Hkv = " + std::to_string(prob->Hkv) + " must divide Hq = " + std::to_string(prob->Hq));
  MSA_TRY(page_tensor(c, "cache.v", cache.v, cache.k.dtype, pages, Bk, prob->Hkv, prob->D, "[pages, Bk, Hkv, D]",
                      false));
  MSA_TRY(cache_scale(c, "cache.k_scale", cache.k_scale, "cache.k", cache.k, pages));
  MSA_TRY(cache_scale(c, "cache.v_scale", cache.v_scale, "cache.v", cache.v, pages));
  if (sparse) MSA_TRY(block_idx_shape(c, p.block_idx, /*output=*/select, prob));
  if (select) {
    MSA_TRY(paged_index(c, p.q_idx, cache, /*standalone=*/false, &pages, prob));
    MSA_TRY(index_vs_main(c, "q_idx", *prob));
  } else if (sparse) {
    MSA_TRY(index_vs_main(c, "block_idx", *prob));
  }
  resolve_options(p.opts, prob);
  if (select && prob->k != p.opts.top_k)
    return c.fail("block_idx", "expected k (dim 2) = top_k = " + std::to_string(p.opts.top_k) + ", got " +
                                   std::to_string(prob->k));
  MSA_TRY(out_tensor(c, "out", p.out, prob->dtype, {prob->T, prob->Hq, prob->D}, "[Tq, Hq, D]"));
  if (p.lse.defined()) MSA_TRY(out_tensor(c, "lse", p.lse, DType::kFloat32, {prob->T, prob->Hq}, "[Tq, Hq]"));
  MSA_TRY(paged_batch_shape(c, cache, p.cu_seqlens_q));
  MSA_TRY(c.no_aliasing());  // the layout is all checked: the values of inputs come last
  MSA_TRY(scale_values(c, "cache.k_scale", cache.k_scale));
  MSA_TRY(scale_values(c, "cache.v_scale", cache.v_scale));
  if (select) MSA_TRY(scale_values(c, "cache.k_idx_scale", cache.k_idx_scale));
  if (q8) MSA_TRY(query_scale_values(c, p.q_scale));
  std::vector<int64_t> start;
  MSA_TRY(paged_values(c, cache, p.cu_seqlens_q, pages, Bk, p.max_q_len, prob, &start));
  if (sparse && !select) MSA_TRY(block_idx_values(c, p.block_idx, *prob, &start));
  return Status::Ok();
}

Status validate(const PagedAppendParams& p, Problem* prob) {
  Check c("paged_append");
  *prob = Problem{};
  const PagedCache& cache = p.cache;
  MSA_TRY(c.ranks({{"k", &p.k}, {"v", &p.v}, {"k_idx", &p.k_idx}, {"cu_seqlens_q", &p.cu_seqlens_q},
                   {"cache.k", &cache.k}, {"cache.v", &cache.v}, {"cache.k_idx", &cache.k_idx},
                   {"cache.page_table", &cache.page_table}, {"cache.seq_lens", &cache.seq_lens},
                   {"cache.k_scale", &cache.k_scale}, {"cache.v_scale", &cache.v_scale},
                   {"cache.k_idx_scale", &cache.k_idx_scale}}));
  const int32_t Bk = p.block_size;
  MSA_TRY(c.option("block_size", Bk >= 1 && (Bk & (Bk - 1)) == 0,
                   "must be a power of two (1, 2, 4, ..., 2^30), got " + std::to_string(Bk)));
  prob->opts.block_size = Bk;
  if (!p.k.defined() && !p.v.defined() && !p.k_idx.defined())
    return c.fail("k", "at least one of k, v and k_idx is required (each is written into its cache tensor)");
  // Each given input [Tq, H, n] goes to its cache tensor [pages, Bk, H, n] (an output), whose
  // heads, dim and dtype it must have; the v cache matches the k cache when both are written.
  int64_t pages = -1;
  prob->T = -1;
  // A float8_e4m3 cache tensor takes inputs of any float dtype (quantised with its scale).
  auto one = [&](const char* arg, const TensorRef& in, const char* cache_arg, const TensorRef& out,
                 const char* names, const char* cache_names, const TensorRef* like) -> Status {
    if (!in.defined()) return Status::Ok();
    MSA_TRY(c.tensor(cache_arg, out, 4, /*output=*/true));
    if (like) {
      MSA_TRY(c.dtype(cache_arg, out, like->dtype));
      MSA_TRY(c.shape(cache_arg, out, {pages, Bk, like->shape[2], like->shape[3]}, cache_names));
    } else {
      if (out.dtype != DType::kFloat8E4M3) MSA_TRY(c.float_dtype(cache_arg, out));
      MSA_TRY(c.shape(cache_arg, out, {pages, Bk, -1, -1}, cache_names));
      MSA_TRY(check_head_dim(c, cache_arg, out.shape[2], "the head count (dim 2)"));
      MSA_TRY(check_head_dim(c, cache_arg, out.shape[3], "the head dim (dim 3)"));
    }
    pages = out.shape[0];
    MSA_TRY(c.tensor(arg, in, 3, false));
    if (out.dtype == DType::kFloat8E4M3)
      MSA_TRY(c.float_dtype(arg, in));
    else
      MSA_TRY(c.dtype(arg, in, out.dtype));
    MSA_TRY(c.shape(arg, in, {prob->T, out.shape[2], out.shape[3]}, names));
    prob->T = in.shape[0];
    return Status::Ok();
  };
  MSA_TRY(one("k", p.k, "cache.k", cache.k, "[Tq, Hkv, D]", "[pages, Bk, Hkv, D]", nullptr));
  MSA_TRY(one("v", p.v, "cache.v", cache.v, "[Tq, Hkv, D]", "[pages, Bk, Hkv, D]", p.k.defined() ? &cache.k : nullptr));
  MSA_TRY(one("k_idx", p.k_idx, "cache.k_idx", cache.k_idx, "[Tq, Hik, Di]", "[pages, Bk, Hik, Di]", nullptr));
  // The scales of the tensors written (pages: those of the cache tensors, all equal).
  const struct {
    const char* arg;
    const TensorRef* scale;
    const char* tensor_arg;
    const TensorRef* in;
    const TensorRef* t;
  } scales[] = {{"cache.k_scale", &cache.k_scale, "cache.k", &p.k, &cache.k},
                {"cache.v_scale", &cache.v_scale, "cache.v", &p.v, &cache.v},
                {"cache.k_idx_scale", &cache.k_idx_scale, "cache.k_idx", &p.k_idx, &cache.k_idx}};
  for (const auto& x : scales)
    if (x.in->defined()) MSA_TRY(cache_scale(c, x.arg, *x.scale, x.tensor_arg, *x.t, pages));
  MSA_TRY(paged_batch_shape(c, cache, p.cu_seqlens_q));
  MSA_TRY(c.no_aliasing());  // the layout is all checked: the values of inputs come last
  for (const auto& x : scales)
    if (x.in->defined()) MSA_TRY(scale_values(c, x.arg, *x.scale));
  return paged_values(c, cache, p.cu_seqlens_q, pages, Bk, /*max_q_len=*/0, prob, nullptr);
}

Status validate(const PagedAppendParams& p) {
  Problem prob;
  return validate(p, &prob);
}

}  // namespace msa::detail
