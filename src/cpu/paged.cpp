// CPU serving over a paged cache (docs/contract.md §6): new token j of sequence s sits at position
// p = seq_lens[s] - n_s + j and selects and attends exactly as token p of the contiguous sequence
// would (§2, §3). The rows themselves are the training code's (select_row, attend_row in
// common.h); only the key access differs: logical position x of sequence s is row x % Bk of
// page page_table[s, x / Bk].
#include <cmath>
#include <cstring>
#include <optional>
#include <vector>

#include "backend.h"
#include "common.h"
#include "parallel.h"

namespace msa::cpu {
namespace {

// The new tokens of a call: sequence and position of each (prob.cu holds cu_seqlens_q).
struct NewTokens {
  std::vector<int32_t> seq;  // [Tq]
  std::vector<int64_t> pos;  // [Tq]: position in its sequence

  NewTokens(const Problem& prob, const PagedCache& cache) : seq(prob.T), pos(prob.T) {
    const int32_t* lens = static_cast<const int32_t*>(cache.seq_lens.data);
    for (int64_t s = 0; s < prob.num_seqs(); ++s) {
      const int64_t start = lens[s * cache.seq_lens.stride[0]] - (prob.cu[s + 1] - prob.cu[s]);
      for (int64_t g = prob.cu[s]; g < prob.cu[s + 1]; ++g) {
        seq[g] = static_cast<int32_t>(s);
        pos[g] = start + (g - prob.cu[s]);
      }
    }
  }
};

// Physical page of logical block b of sequence s.
struct PageTable {
  const int32_t* base = nullptr;
  int64_t s0 = 0, s1 = 0;
  int32_t Bk = 1;
  explicit PageTable(const TensorRef& t, int32_t bk)
      : base(static_cast<const int32_t*>(t.data)), s0(t.stride[0]), s1(t.stride[1]), Bk(bk) {}
  int64_t page(int64_t s, int64_t x) const { return base[s * s0 + (x / Bk) * s1]; }
};

// A cache tensor [pages, Bk, H, n] read (or written) by logical position.
template <class E>
struct PagedRows {
  E* base = nullptr;
  int64_t sp = 0, sr = 0, sh = 0;
  const PageTable* table = nullptr;
  PagedRows(const TensorRef& t, const PageTable& pt)
      : base(static_cast<E*>(t.data)), sp(t.stride[0]), sr(t.stride[1]), sh(t.stride[2]), table(&pt) {}
  E* row(int64_t s, int64_t x, int64_t h) const {
    return base + table->page(s, x) * sp + (x % table->Bk) * sr + h * sh;
  }
};

// A float8_e4m3 cache tensor [pages, Bk, H, n] with its scale ([1] or [pages]), read by logical
// position as dequantised rows: float32(value * scale[page]), one fp32 rounding (contract §6).
struct E4M3Rows {
  PagedRows<const E4M3> codes;
  const float* scale = nullptr;
  int64_t scale_stride = 0;  // 0: one scale for the tensor
  int64_t n = 0;
  E4M3Rows(const TensorRef& t, const TensorRef& sc, const PageTable& pt)
      : codes(t, pt), scale(static_cast<const float*>(sc.data)),
        scale_stride(sc.shape[0] == 1 ? 0 : sc.stride[0]), n(t.shape[3]) {}
  // Row h of position x of sequence s, dequantised into buf (n floats).
  const float* row(int64_t s, int64_t x, int64_t h, std::vector<float>* buf) const {
    const float sc = scale[codes.table->page(s, x) * scale_stride];
    const E4M3* src = codes.row(s, x, h);
    buf->resize(n);
    for (int64_t d = 0; d < n; ++d) (*buf)[d] = static_cast<float>(to_double(src[d])) * sc;
    return buf->data();
  }
};

bool is_e4m3(const TensorRef& t) { return t.defined() && t.dtype == DType::kFloat8E4M3; }

// kFp8 scores (contract §2, §6): the dequantised E4M3 copies of the new tokens' q_idx rows and,
// per sequence with new tokens, of its index keys 0 .. seq_lens[s] - 1 (key_row(s, j, ik): the
// row's values, an E4M3 cache's dequantised), a group per page (a block of the sequence, as
// select_blocks groups them) and index key head: [len, Hik, Di] in double.
template <class E>
struct Fp8Copies {
  std::vector<double> q8;
  std::vector<std::vector<double>> k8;  // per sequence
  template <class KeyRow>
  Fp8Copies(const Problem& prob, const NewTokens& tok, const Rows<const E>& q_idx, const KeyRow& key_row,
            const PagedCache& cache) {
    const int32_t Di = prob.Di, Bk = prob.opts.block_size;
    fp8_copy_queries(prob, q_idx, &q8);
    const int32_t* lens = static_cast<const int32_t*>(cache.seq_lens.data);
    k8.resize(prob.num_seqs());
    for (int64_t s = 0; s < prob.num_seqs(); ++s) {
      if (prob.cu[s + 1] == prob.cu[s]) continue;
      const int64_t len = lens[s * cache.seq_lens.stride[0]];
      std::vector<double>& k = k8[s];
      k.resize(static_cast<size_t>(len) * prob.Hik * Di);
      parallel_for((len + Bk - 1) / Bk, [&](int64_t b, int) {
        const int64_t j0 = b * Bk, n = std::min<int64_t>(Bk, len - j0);
        for (int32_t ik = 0; ik < prob.Hik; ++ik)
          fp8_copy_block(Di, j0, n, [&](int64_t j) { return key_row(s, j, ik); },
                         k.data() + (j0 * prob.Hik + ik) * Di, int64_t(prob.Hik) * Di);
      });
    }
  }
};

template <class E>
void select_impl(const Problem& prob, const NewTokens& tok, const TensorRef& q_idx_t, const PagedCache& cache,
                 const TensorRef& bi_t) {
  const PageTable pt(cache.page_table, prob.opts.block_size);
  const Rows<const E> q_idx = rows<const E>(q_idx_t);
  const bool e4m3 = is_e4m3(cache.k_idx);
  const PagedRows<const E> k_idx(cache.k_idx, pt);
  std::optional<E4M3Rows> k_idx8;
  if (e4m3) k_idx8.emplace(cache.k_idx, cache.k_idx_scale, pt);
  std::optional<Fp8Copies<E>> copies;
  if (prob.opts.select_scores == SelectScores::kFp8) {
    if (e4m3)  // the dequantised keys' copies
      copies.emplace(prob, tok, q_idx, [&](int64_t s, int64_t j, int32_t ik) {
        thread_local std::vector<float> buf;
        return k_idx8->row(s, j, ik, &buf);
      }, cache);
    else
      copies.emplace(prob, tok, q_idx, [&](int64_t s, int64_t j, int32_t ik) { return k_idx.row(s, j, ik); }, cache);
  }
  int32_t* bi = static_cast<int32_t*>(bi_t.data);
  parallel_for(prob.T, [&](int64_t g, int) {
    thread_local std::vector<float> buf;
    const int64_t s = tok.seq[g];
    for (int32_t i = 0; i < prob.Hi; ++i) {
      const int32_t ik = i / prob.idx_per_key();
      int32_t* out = bi + g * bi_t.stride[0] + i * bi_t.stride[1];
      // The row's keys (an E4M3 cache's dequantised), scored as the contract's kInput or kFp8.
      const auto select = [&](const auto& key_row) {
        if (copies)
          select_row_fp8(prob.opts, prob.k, prob.Di, prob.opts.scale_idx,
                         copies->q8.data() + (g * prob.Hi + i) * prob.Di, q_idx.row(g, i), tok.pos[g], key_row,
                         [&](int64_t j) { return copies->k8[s].data() + (j * prob.Hik + ik) * prob.Di; }, out,
                         bi_t.stride[2], nullptr);
        else
          select_row(prob.opts, prob.k, prob.Di, prob.opts.scale_idx, q_idx.row(g, i), tok.pos[g], key_row, out,
                     bi_t.stride[2], nullptr);
      };
      if (e4m3)
        select([&](int64_t j) { return k_idx8->row(s, j, ik, &buf); });
      else
        select([&](int64_t j) { return k_idx.row(s, j, ik); });
    }
  });
}

template <class E>
void forward_impl(const Problem& prob, const NewTokens& tok, const PagedForwardParams& p) {
  const PageTable pt(p.cache.page_table, prob.opts.block_size);
  // FP8 queries (Q8KV8): q's rows dequantised, float32(value * q_scale[t, h]), as the caches'.
  const bool q8 = p.q.dtype == DType::kFloat8E4M3;
  const Rows<const E> q = q8 ? Rows<const E>{} : rows<const E>(p.q);
  const Rows<const E4M3> q_codes = q8 ? rows<const E4M3>(p.q) : Rows<const E4M3>{};
  auto q_scale = [&](int64_t g, int64_t h) {
    const float* sc = static_cast<const float*>(p.q_scale.data);
    return p.q_scale.rank == 2 ? sc[g * p.q_scale.stride[0] + h * p.q_scale.stride[1]] : sc[0];
  };
  const PagedRows<const E> k(p.cache.k, pt), v(p.cache.v, pt);
  const bool fp8 = is_e4m3(p.cache.k);
  std::optional<E4M3Rows> k8, v8;
  if (fp8) {
    k8.emplace(p.cache.k, p.cache.k_scale, pt);
    v8.emplace(p.cache.v, p.cache.v_scale, pt);
  }
  const Rows<E> out = rows<E>(p.out);
  const Mat lse = p.lse.defined() ? mat(p.lse) : Mat{};
  const bool dense = prob.opts.mode == Mode::kDense;
  const int32_t Bk = prob.opts.block_size, G = prob.group();
  const int32_t Hl = loop_index_heads(prob), hpi = prob.Hq / Hl;
  const int32_t* bi = dense ? nullptr : static_cast<const int32_t*>(p.block_idx.data);
  parallel_for(prob.T, [&](int64_t g, int) {
    thread_local std::vector<int32_t> blocks;
    thread_local std::vector<int64_t> keys;
    thread_local std::vector<float> kbuf, vbuf, qbuf;
    const int64_t s = tok.seq[g], t = tok.pos[g];
    for (int32_t i = 0; i < Hl; ++i) {
      blocks.clear();
      if (dense) {
        for (int32_t b = 0; b <= t / Bk; ++b) blocks.push_back(b);
      } else {
        for (int32_t j = 0; j < prob.k; ++j) {
          const int32_t b = bi[g * p.block_idx.stride[0] + i * p.block_idx.stride[1] + j * p.block_idx.stride[2]];
          if (b >= 0) blocks.push_back(b);
        }
        std::sort(blocks.begin(), blocks.end());
      }
      keys_of_blocks(blocks, t, Bk, &keys);
      for (int32_t h = i * hpi; h < (i + 1) * hpi; ++h) {
        const int32_t r = h / G;
        float* row_lse = lse.base ? &lse.at(g, h) : nullptr;
        if (q8) {
          const E4M3* src = q_codes.row(g, h);
          const float sc = q_scale(g, h);
          qbuf.resize(prob.D);
          for (int32_t d = 0; d < prob.D; ++d) qbuf[d] = static_cast<float>(to_double(src[d])) * sc;
          attend_row(prob.D, prob.opts.scale, qbuf.data(), keys, [&](int64_t j) { return k8->row(s, j, r, &kbuf); },
                     [&](int64_t j) { return v8->row(s, j, r, &vbuf); }, out.row(g, h), row_lse);
        } else if (fp8)
          attend_row(prob.D, prob.opts.scale, q.row(g, h), keys, [&](int64_t j) { return k8->row(s, j, r, &kbuf); },
                     [&](int64_t j) { return v8->row(s, j, r, &vbuf); }, out.row(g, h), row_lse);
        else
          attend_row(prob.D, prob.opts.scale, q.row(g, h), keys, [&](int64_t j) { return k.row(s, j, r); },
                     [&](int64_t j) { return v.row(s, j, r); }, out.row(g, h), row_lse);
      }
    }
  });
}

template <class E>
struct SelectFn {
  static void run(const Problem& prob, const NewTokens& tok, const TensorRef& q_idx, const PagedCache& cache,
                  const TensorRef& bi) {
    select_impl<E>(prob, tok, q_idx, cache, bi);
  }
};
template <class E>
struct ForwardFn {
  static void run(const Problem& prob, const NewTokens& tok, const PagedForwardParams& p) {
    forward_impl<E>(prob, tok, p);
  }
};

// Element i of a float tensor's storage, as a double (exact).
double element(const void* base, DType dt, int64_t i) {
  switch (dt) {
    case DType::kFloat16: return to_double(static_cast<const Half*>(base)[i]);
    case DType::kBFloat16: return to_double(static_cast<const BFloat16*>(base)[i]);
    case DType::kFloat32: return static_cast<const float*>(base)[i];
    case DType::kFloat64: return static_cast<const double*>(base)[i];
    default: return std::nan("");
  }
}

// Copies the rows [Tq, H, n] of `in` to their cache rows (any dtype: bytes); into a float8_e4m3
// cache tensor, quantised: e4m3(float32(x) / scale[page]) to nearest even, saturated to +-448.
void append_rows(const Problem& prob, const NewTokens& tok, const PageTable& pt, const TensorRef& in,
                 const TensorRef& cache, const TensorRef& scale) {
  if (!in.defined()) return;
  if (is_e4m3(cache)) {
    const float* sc = static_cast<const float*>(scale.data);
    const int64_t ss = scale.shape[0] == 1 ? 0 : scale.stride[0];
    E4M3* dst = static_cast<E4M3*>(cache.data);
    parallel_for(prob.T, [&](int64_t g, int) {
      const int64_t page = pt.page(tok.seq[g], tok.pos[g]), row = tok.pos[g] % pt.Bk;
      const float s = sc[page * ss];
      for (int64_t h = 0; h < in.shape[1]; ++h)
        for (int64_t d = 0; d < in.shape[2]; ++d) {
          const float x = static_cast<float>(element(in.data, in.dtype, g * in.stride[0] + h * in.stride[1] + d));
          dst[page * cache.stride[0] + row * cache.stride[1] + h * cache.stride[2] + d] = e4m3_from_double(x / s);
        }
    });
    return;
  }
  const size_t e = dtype_size(in.dtype), bytes = static_cast<size_t>(in.shape[2]) * e;
  const uint8_t* src = static_cast<const uint8_t*>(in.data);
  uint8_t* dst = static_cast<uint8_t*>(cache.data);
  parallel_for(prob.T, [&](int64_t g, int) {
    const int64_t page = pt.page(tok.seq[g], tok.pos[g]), row = tok.pos[g] % pt.Bk;
    for (int64_t h = 0; h < in.shape[1]; ++h)
      std::memcpy(dst + (page * cache.stride[0] + row * cache.stride[1] + h * cache.stride[2]) * e,
                  src + (g * in.stride[0] + h * in.stride[1]) * e, bytes);
  });
}

}  // namespace

Status paged_select_blocks(const Problem& prob, const PagedSelectParams& p) {
  const NewTokens tok(prob, p.cache);
  return dispatch<SelectFn>(prob.dtype, prob, tok, p.q_idx, p.cache, p.block_idx);
}

Status paged_forward(const Problem& prob, const PagedForwardParams& p) {
  const NewTokens tok(prob, p.cache);
  if (prob.opts.mode == Mode::kSparse && p.select)
    MSA_TRY(dispatch<SelectFn>(prob.dtype, prob, tok, p.q_idx, p.cache, p.block_idx));
  return dispatch<ForwardFn>(prob.dtype, prob, tok, p);
}

Status paged_append(const Problem& prob, const PagedAppendParams& p) {
  const NewTokens tok(prob, p.cache);
  const PageTable pt(p.cache.page_table, p.block_size);
  append_rows(prob, tok, pt, p.k, p.cache.k, p.cache.k_scale);
  append_rows(prob, tok, pt, p.v, p.cache.v, p.cache.v_scale);
  append_rows(prob, tok, pt, p.k_idx, p.cache.k_idx, p.cache.k_idx_scale);
  return Status::Ok();
}

}  // namespace msa::cpu
