// CPU serving over a paged cache (docs/contract.md §6): new token j of sequence s sits at position
// p = seq_lens[s] - n_s + j and selects and attends exactly as token p of the contiguous sequence
// would (§2, §3). The rows themselves are the training code's (select_row, attend_row in
// common.h); only the key access differs: logical position x of sequence s is row x % Bk of
// page page_table[s, x / Bk].
#include <cstring>
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

template <class E>
void select_impl(const Problem& prob, const NewTokens& tok, const TensorRef& q_idx_t, const PagedCache& cache,
                 const TensorRef& bi_t) {
  const PageTable pt(cache.page_table, prob.opts.block_size);
  const Rows<const E> q_idx = rows<const E>(q_idx_t);
  const PagedRows<const E> k_idx(cache.k_idx, pt);
  int32_t* bi = static_cast<int32_t*>(bi_t.data);
  parallel_for(prob.T, [&](int64_t g, int) {
    const int64_t s = tok.seq[g];
    for (int32_t i = 0; i < prob.Hi; ++i) {
      const int32_t ik = i / prob.idx_per_key();
      select_row(prob.opts, prob.k, prob.Di, prob.opts.scale_idx, q_idx.row(g, i), tok.pos[g],
                 [&](int64_t j) { return k_idx.row(s, j, ik); }, bi + g * bi_t.stride[0] + i * bi_t.stride[1],
                 bi_t.stride[2], nullptr);
    }
  });
}

template <class E>
void forward_impl(const Problem& prob, const NewTokens& tok, const PagedForwardParams& p) {
  const PageTable pt(p.cache.page_table, prob.opts.block_size);
  const Rows<const E> q = rows<const E>(p.q);
  const PagedRows<const E> k(p.cache.k, pt), v(p.cache.v, pt);
  const Rows<E> out = rows<E>(p.out);
  const Mat lse = p.lse.defined() ? mat(p.lse) : Mat{};
  const bool dense = prob.opts.mode == Mode::kDense;
  const int32_t Bk = prob.opts.block_size, G = prob.group();
  const int32_t Hl = loop_index_heads(prob), hpi = prob.Hq / Hl;
  const int32_t* bi = dense ? nullptr : static_cast<const int32_t*>(p.block_idx.data);
  parallel_for(prob.T, [&](int64_t g, int) {
    thread_local std::vector<int32_t> blocks;
    thread_local std::vector<int64_t> keys;
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
        attend_row(prob.D, prob.opts.scale, q.row(g, h), keys, [&](int64_t j) { return k.row(s, j, r); },
                   [&](int64_t j) { return v.row(s, j, r); }, out.row(g, h), lse.base ? &lse.at(g, h) : nullptr);
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

// Copies the rows [Tq, H, n] of `in` to their cache rows (any dtype: bytes).
void append_rows(const Problem& prob, const NewTokens& tok, const PageTable& pt, const TensorRef& in,
                 const TensorRef& cache) {
  if (!in.defined()) return;
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
  append_rows(prob, tok, pt, p.k, p.cache.k);
  append_rows(prob, tok, pt, p.v, p.cache.v);
  append_rows(prob, tok, pt, p.k_idx, p.cache.k_idx);
  return Status::Ok();
}

}  // namespace msa::cpu
