// Serving test cases (docs/contract.md §6) whose oracle is the training API on contiguous
// sequences. A PagedBatch holds, on the host, full random sequences (q, k, v, q_idx, k_idx for
// every position), their k, v, k_idx scattered into pages through a shuffled page table (the
// pages no sequence uses, and every row past a sequence's length, poisoned with NaN), and the
// queries of each sequence's last n_s positions as the call's new tokens. The paged calls take
// TensorRefs (PagedRefs), so a backend test on another device uploads the same host tensors
// and runs the same parameter builders.
#pragma once

#include <algorithm>
#include <cmath>
#include <numeric>
#include <ostream>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "harness.h"

namespace msatest {

// One serving batch: sequence s holds lens[s] tokens, its last nq[s] of which are new.
struct PagedCase {
  std::vector<int64_t> lens{200};
  std::vector<int64_t> nq{5};
  int Hq = 4, Hkv = 2, D = 16;
  int Hi = 2, Hik = 1, Di = 16;
  int Bk = 64, k = 3, sink = 0, local = 1;
  int max_q_len = 0;
  int extra_pages = 3;       // pages no sequence uses (poisoned)
  int extra_table_cols = 1;  // page table columns past the longest sequence (holding -1)
  DType dtype = DType::kFloat32;
  uint64_t seed = 1;
  msa::FwdPass fwd_pass = msa::FwdPass::kAuto;  // the sparse forward's walk (a backend's choice)
  int fwd_chunk_tokens = 0;
  msa::SelectScores select_scores = msa::SelectScores::kInput;  // kFp8: a prefill's E4M3 copies
  int fp8_rerank = 4;
  int fp8_rerank_slots = 0;

  std::string str() const {
    std::ostringstream os;
    os << "lens=[";
    for (size_t i = 0; i < lens.size(); ++i) os << (i ? "," : "") << lens[i];
    os << "] nq=[";
    for (size_t i = 0; i < nq.size(); ++i) os << (i ? "," : "") << nq[i];
    os << "] Hq=" << Hq << " Hkv=" << Hkv << " D=" << D << " Hi=" << Hi << " Hik=" << Hik << " Di=" << Di
       << " Bk=" << Bk << " k=" << k << " sink=" << sink << " local=" << local << " max_q_len=" << max_q_len
       << " dtype=" << msa::dtype_name(dtype) << " seed=" << seed;
    if (select_scores == msa::SelectScores::kFp8)
      os << " select_scores=kFp8 fp8_rerank=" << fp8_rerank << " fp8_rerank_slots=" << fp8_rerank_slots;
    return os.str();
  }
  Config config() const {
    Config c;
    c.seqlens = lens;
    c.Hq = Hq;
    c.Hkv = Hkv;
    c.D = D;
    c.Hi = Hi;
    c.Hik = Hik;
    c.Di = Di;
    c.Bk = Bk;
    c.k = k;
    c.sink = sink;
    c.local = local;
    c.dtype = dtype;
    c.seed = seed;
    return c;
  }
  msa::Options options(Mode mode = Mode::kSparse) const {
    msa::Options o;
    o.mode = mode;
    o.block_size = Bk;
    o.top_k = k;
    o.sink_blocks = sink;
    o.local_blocks = local;
    o.fwd_pass = fwd_pass;
    o.fwd_chunk_tokens = fwd_chunk_tokens;
    o.select_scores = select_scores;
    o.fp8_rerank = fp8_rerank;
    o.fp8_rerank_slots = fp8_rerank_slots;
    return o;
  }
};

// gtest prints a parameter through this.
inline void PrintTo(const PagedCase& c, std::ostream* os) { *os << c.str(); }

inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// Copies token rows `rows` (first dimension) of `src` into a new tensor of those rows.
inline HostTensor gather_rows(const HostTensor& src, const std::vector<int64_t>& rows) {
  std::vector<int64_t> shape = src.shape();
  const int64_t row = src.numel() / std::max<int64_t>(shape[0], 1);
  shape[0] = static_cast<int64_t>(rows.size());
  HostTensor dst(src.dtype(), shape);
  for (size_t r = 0; r < rows.size(); ++r)
    for (int64_t x = 0; x < row; ++x) dst.set(static_cast<int64_t>(r) * row + x, src.get(rows[r] * row + x));
  return dst;
}

struct PagedBatch {
  PagedCase cs;
  Problem full;  // the contiguous sequences (cu_seqlens = lens)
  int64_t nseq = 0, Tq = 0, pages = 0, max_pages = 0;
  std::vector<std::vector<int32_t>> table;  // [nseq][blocks of the sequence]: physical page
  std::vector<int64_t> new_rows;            // row of `full` of each new token
  HostTensor q, q_idx;                      // [Tq, Hq, D], [Tq, Hi, Di]: the new tokens' queries
  HostTensor kc, vc, kic;                   // the caches [pages, Bk, H, n]
  HostTensor page_table, seq_lens, cu_q;    // int32

  explicit PagedBatch(const PagedCase& c) : cs(c), full(c.config()) {
    nseq = static_cast<int64_t>(c.lens.size());
    std::mt19937_64 rng(c.seed * 7919 + 17);
    int64_t used = 0, longest = 0;
    for (int64_t L : c.lens) {
      used += ceil_div(L, c.Bk);
      longest = std::max(longest, ceil_div(L, c.Bk));
    }
    pages = used + c.extra_pages;
    max_pages = longest + c.extra_table_cols;
    std::vector<int32_t> perm(pages);
    std::iota(perm.begin(), perm.end(), 0);
    std::shuffle(perm.begin(), perm.end(), rng);
    table.resize(nseq);
    int64_t next = 0;
    for (int64_t s = 0; s < nseq; ++s)
      for (int64_t b = 0; b < ceil_div(c.lens[s], c.Bk); ++b) table[s].push_back(perm[next++]);
    page_table = HostTensor(DType::kInt32, {nseq, max_pages});
    page_table.fill(-1);  // columns past a sequence's blocks are never read
    for (int64_t s = 0; s < nseq; ++s)
      for (size_t b = 0; b < table[s].size(); ++b) page_table.set(s * max_pages + b, table[s][b]);
    seq_lens = HostTensor(DType::kInt32, {nseq});
    cu_q = HostTensor(DType::kInt32, {nseq + 1});
    cu_q.set(0, 0);
    for (int64_t s = 0; s < nseq; ++s) {
      seq_lens.set(s, static_cast<double>(c.lens[s]));
      for (int64_t j = 0; j < c.nq[s]; ++j) new_rows.push_back(full.offsets[s] + c.lens[s] - c.nq[s] + j);
      cu_q.set(s + 1, static_cast<double>(new_rows.size()));
    }
    Tq = static_cast<int64_t>(new_rows.size());
    q = gather_rows(full.q, new_rows);
    q_idx = gather_rows(full.q_idx, new_rows);
    kc = scatter(full.k, c.Hkv, c.D);
    vc = scatter(full.v, c.Hkv, c.D);
    kic = scatter(full.k_idx, c.Hik, c.Di);
  }

  // Physical row (page * Bk + row) of position x of sequence s.
  int64_t cache_row(int64_t s, int64_t x) const { return int64_t{table[s][x / cs.Bk]} * cs.Bk + x % cs.Bk; }

  // A cache [pages, Bk, H, n] holding every position of every sequence; NaN elsewhere.
  HostTensor scatter(const HostTensor& src, int H, int n) const {
    HostTensor dst(src.dtype(), {pages, cs.Bk, H, n});
    dst.fill(NAN);
    const int64_t row = static_cast<int64_t>(H) * n;
    for (int64_t s = 0; s < nseq; ++s)
      for (int64_t x = 0; x < cs.lens[s]; ++x) {
        const int64_t g = full.offsets[s] + x, r = cache_row(s, x);
        for (int64_t e = 0; e < row; ++e) dst.set(r * row + e, src.get(g * row + e));
      }
    return dst;
  }
};

// The inputs of the paged calls as views (host here; a device test passes its copies).
struct PagedRefs {
  msa::TensorRef q, q_idx, k, v, k_idx, page_table, seq_lens, cu_q;
};

inline PagedRefs host_refs(PagedBatch& b) {
  return {b.q.ref(), b.q_idx.ref(), b.kc.ref(), b.vc.ref(), b.kic.ref(), b.page_table.ref(), b.seq_lens.ref(),
          b.cu_q.ref()};
}

inline msa::PagedCache cache_of(const PagedRefs& r) {
  msa::PagedCache c;
  c.k = r.k;
  c.v = r.v;
  c.k_idx = r.k_idx;
  c.page_table = r.page_table;
  c.seq_lens = r.seq_lens;
  return c;
}

inline msa::PagedSelectParams paged_select_params(const PagedCase& cs, const PagedRefs& r,
                                                  const msa::TensorRef& block_idx) {
  msa::PagedSelectParams p;
  p.q_idx = r.q_idx;
  p.cu_seqlens_q = r.cu_q;
  p.cache = cache_of(r);
  p.block_idx = block_idx;
  p.max_q_len = cs.max_q_len;
  p.opts = cs.options();
  return p;
}

// kSparse with `select`: block_idx is written from q_idx; kSparse without: block_idx is read;
// kDense: block_idx unused. `lse` may be undefined.
inline msa::PagedForwardParams paged_forward_params(const PagedCase& cs, const PagedRefs& r, Mode mode, bool select,
                                                    const msa::TensorRef& block_idx, const msa::TensorRef& out,
                                                    const msa::TensorRef& lse) {
  msa::PagedForwardParams p;
  p.q = r.q;
  p.cu_seqlens_q = r.cu_q;
  p.cache = cache_of(r);
  if (mode == Mode::kSparse) p.block_idx = block_idx;
  p.select = select;
  if (select) p.q_idx = r.q_idx;
  p.out = out;
  p.lse = lse;
  p.max_q_len = cs.max_q_len;
  p.opts = cs.options(mode);
  return p;
}

// paged_append of the new rows k, v, k_idx (any may be undefined) into the caches of `r`.
inline msa::PagedAppendParams paged_append_params(const msa::TensorRef& k, const msa::TensorRef& v,
                                                  const msa::TensorRef& k_idx, const PagedRefs& r, int Bk) {
  msa::PagedAppendParams a;
  a.k = k;
  a.v = v;
  a.k_idx = k_idx;
  a.cu_seqlens_q = r.cu_q;
  a.cache = cache_of(r);
  a.block_size = Bk;
  return a;
}

// The contiguous oracle: the training API over the full sequences (the case's selection
// options), rows of the new tokens.
struct PagedOracle {
  HostTensor block_idx;  // [Tq, Hi, k]: msa::select_blocks
  HostTensor out, lse;   // msa::forward over that selection (kSparse) or dense causal (kDense)
};

inline PagedOracle paged_oracle(PagedBatch& b, Mode mode) {
  PagedOracle o;
  msa::Options so = b.full.options();
  so.select_scores = b.cs.select_scores;
  so.fp8_rerank = b.cs.fp8_rerank;
  so.fp8_rerank_slots = b.cs.fp8_rerank_slots;
  HostTensor bi = run_select(b.full, nullptr, &so);
  FwdResult f = run_forward(b.full, &bi, mode, false);
  o.block_idx = gather_rows(bi, b.new_rows);
  o.out = gather_rows(f.out, b.new_rows);
  o.lse = gather_rows(f.lse, b.new_rows);
  return o;
}

// Output buffers of a paged call, poisoned.
struct PagedOutputs {
  HostTensor block_idx, out, lse;
  PagedOutputs(const PagedBatch& b)
      : block_idx(DType::kInt32, {b.Tq, b.cs.Hi, b.cs.k}),
        out(b.cs.dtype, {b.Tq, b.cs.Hq, b.cs.D}),
        lse(DType::kFloat32, {b.Tq, b.cs.Hq}) {
    block_idx.fill(-7);
    out.fill(NAN);
    lse.fill(NAN);
  }
};

// Where two tensors differ first ("" when equal, bit for bit; NaN equals NaN).
inline std::string first_difference(const HostTensor& got, const HostTensor& want) {
  if (got.shape() != want.shape()) return "shapes differ";
  for (int64_t x = 0; x < got.numel(); ++x) {
    const double a = got.get(x), w = want.get(x);
    if (a == w || (std::isnan(a) && std::isnan(w))) continue;
    std::ostringstream os;
    os.precision(17);
    os << "element " << x << ": got " << a << ", want " << w;
    return os.str();
  }
  return "";
}

}  // namespace msatest
