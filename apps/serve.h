// msa_main --mode serve: a batch of requests served from a paged KV cache (docs/contract.md §6)
// through the public API. This file holds the plan of the run (the requests, their pages behind a
// shuffled page table, the calls: prefill chunks then decode steps), the inputs (drawn per token
// position, so a token's values do not depend on how the calls split its sequence), the device
// cache and the per-call buffers, the parameters of each API call, the FLOP model of the serving
// table, and the reference check of sampled new-token rows.
//
// The check applies the contract to the contiguous sequences: new token x of request s at
// position p selects as query p of the sequence over its keys 0..p (§2; judged with the
// tolerance rule the training check uses, judge_selection in reference.h), and attends over the
// support of the block_idx row the call returned (§3), or over every key 0..p (kDense), all in
// double from the same inputs.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <numeric>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "cli.h"
#include "device.h"
#include "host_tensor.h"
#include "msa/msa.h"
#include "reference.h"
#include "workload.h"

namespace msa_app {

// ---- the plan -------------------------------------------------------------------------------------

// One call of the serving loop: request s gets n[s] new tokens after start[s] cached ones
// (seq_lens[s] = start[s] + n[s]; cu_seqlens_q packs the n[s]).
struct ServeCall {
  bool decode = false;
  int index = 0;  // chunk or step number, from 0
  std::vector<int64_t> start, n;
  std::vector<int32_t> cu;     // [nseq + 1]
  std::vector<int32_t> seq;    // [Tq]: request of each new token
  std::vector<int64_t> pos;    // [Tq]: its position in the request's sequence
  int32_t max_q_len = 0;       // 0: a prefill chunk; q_len: a decode step

  int64_t Tq() const { return static_cast<int64_t>(seq.size()); }
  std::string name(int of) const {
    return std::string(decode ? "decode step " : "prefill chunk ") + std::to_string(index + 1) + "/" +
           std::to_string(of);
  }
};

struct ServePlan {
  Shape full;                  // the contiguous sequences at the end (prompt + decoded tokens), heads, options
  std::vector<int64_t> prompt;
  int64_t chunk = 0;
  int32_t steps = 0, q_len = 0;
  std::vector<ServeCall> calls;  // prefill chunks, then decode steps
  int prefill_calls = 0;
  int64_t max_tq = 1;
  // Paged layout: request s keeps logical block b in page table[s][b]; pages no request uses (and
  // every row past a request's length) hold NaN, which a read of a wrong row would spread.
  static constexpr int64_t kSparePages = 2;
  int64_t pages = 0, max_pages = 0;
  std::vector<std::vector<int32_t>> table;

  int decode_calls() const { return static_cast<int>(calls.size()) - prefill_calls; }
};

inline ServeCall make_call(const ServePlan& p, bool decode, int index, const std::vector<int64_t>& start,
                           const std::vector<int64_t>& n) {
  ServeCall c;
  c.decode = decode;
  c.index = index;
  c.start = start;
  c.n = n;
  c.max_q_len = decode ? p.q_len : 0;
  c.cu.assign(1, 0);
  for (size_t s = 0; s < n.size(); ++s) {
    for (int64_t j = 0; j < n[s]; ++j) {
      c.seq.push_back(static_cast<int32_t>(s));
      c.pos.push_back(start[s] + j);
    }
    c.cu.push_back(static_cast<int32_t>(c.seq.size()));
  }
  return c;
}

inline ServePlan make_serve_plan(const Config& cfg) {
  ServePlan p;
  p.prompt = cfg.seqlens;
  p.chunk = cfg.chunk;
  p.steps = cfg.decode_steps;
  p.q_len = cfg.q_len;
  Config total = cfg;
  for (int64_t& len : total.seqlens) len += static_cast<int64_t>(p.steps) * p.q_len;
  p.full = make_shape(total);
  const int64_t nseq = p.full.nseq(), Bk = p.full.Bk;

  std::vector<int64_t> done(nseq, 0), n(nseq);
  for (int index = 0;; ++index) {  // prefill: every request's next chunk in one call
    bool any = false;
    for (int64_t s = 0; s < nseq; ++s) {
      n[s] = std::min(p.chunk, p.prompt[s] - done[s]);
      any = any || n[s] > 0;
    }
    if (!any) break;
    p.calls.push_back(make_call(p, false, index, done, n));
    for (int64_t s = 0; s < nseq; ++s) done[s] += n[s];
  }
  p.prefill_calls = static_cast<int>(p.calls.size());
  for (int step = 0; step < p.steps; ++step) {
    p.calls.push_back(make_call(p, true, step, done, std::vector<int64_t>(nseq, p.q_len)));
    for (int64_t s = 0; s < nseq; ++s) done[s] += p.q_len;
  }
  for (const ServeCall& c : p.calls) p.max_tq = std::max(p.max_tq, c.Tq());

  // Pages: every block a request will hold, in a shuffled order; one spare table column (-1).
  std::vector<int64_t> blocks(nseq);
  int64_t used = 0;
  for (int64_t s = 0; s < nseq; ++s) {
    blocks[s] = (p.full.seqlens[s] + Bk - 1) / Bk;
    used += blocks[s];
    p.max_pages = std::max(p.max_pages, blocks[s]);
  }
  p.pages = used + ServePlan::kSparePages;
  p.max_pages += 1;
  std::vector<int32_t> perm(p.pages);
  std::iota(perm.begin(), perm.end(), 0);
  std::shuffle(perm.begin(), perm.end(), std::mt19937_64(cfg.seed * 7919 + 17));
  p.table.resize(nseq);
  int64_t next = 0;
  for (int64_t s = 0; s < nseq; ++s)
    for (int64_t b = 0; b < blocks[s]; ++b) p.table[s].push_back(perm[next++]);
  return p;
}

inline std::string serve_string(const ServePlan& p) {
  std::string lens;
  for (size_t s = 0; s < p.prompt.size(); ++s) lens += (s ? "," : "") + std::to_string(p.prompt[s]);
  const Shape& f = p.full;
  return std::to_string(f.nseq()) + " request(s), prompts " + lens + "; prefill chunks of " +
         std::to_string(p.chunk) + " (" + std::to_string(p.prefill_calls) + " call(s)); decode " +
         std::to_string(p.steps) + " step(s) of q_len " + std::to_string(p.q_len) + "\nheads:   Hq=" +
         std::to_string(f.Hq) + " Hkv=" + std::to_string(f.Hkv) + " D=" + std::to_string(f.D) +
         " Hi=" + std::to_string(f.Hi) + " Hik=" + std::to_string(f.Hik) + " Di=" + std::to_string(f.Di) +
         " Bk=" + std::to_string(f.Bk) + " k=" + std::to_string(f.k) + " sink=" + std::to_string(f.sink) +
         " local=" + std::to_string(f.local) + " dtype=" + short_dtype_name(f.dtype);
}

// ---- inputs ---------------------------------------------------------------------------------------

// Values are a counter-based hash of (seed, tensor, request, position, element): a sum of four
// 16-bit uniforms, centred and scaled to unit variance (close to normal, |x| < 3.47), rounded to
// the dtype. Cheap enough to draw the queries of every prefill token of a GPU-sized batch.
enum class ServeTensor : uint64_t { kQ = 1, kK = 2, kV = 3, kQIdx = 4, kKIdx = 5 };

inline uint64_t mix64(uint64_t x) {  // splitmix64's finaliser
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

inline float serve_value(uint64_t row_key, int64_t e) {
  const uint64_t h = mix64(row_key ^ (static_cast<uint64_t>(e) * 0xd6e8feb86659fd93ull));
  double sum = 0;
  for (int x = 0; x < 4; ++x) sum += static_cast<double>((h >> (16 * x)) & 0xffffu) + 0.5;
  return static_cast<float>((sum / 65536.0 - 2.0) * 1.7320508075688772);
}

// Fills rows x of t ([rows, H, n]) with the values of token (seq[x], pos[x]).
inline void fill_serve_rows(HostTensor& t, ServeTensor which, uint64_t seed, const std::vector<int32_t>& seq,
                            const std::vector<int64_t>& pos, int threads) {
  const int64_t row = t.numel() / std::max<int64_t>(1, t.shape()[0]);
  const uint64_t tkey = mix64(seed ^ (static_cast<uint64_t>(which) << 56));
  parallel_items(static_cast<int64_t>(seq.size()), threads, [&](int64_t x, int) {
    const uint64_t key = mix64(tkey ^ (static_cast<uint64_t>(seq[x]) << 40) ^ static_cast<uint64_t>(pos[x]));
    for (int64_t e = 0; e < row; ++e) t.set(x * row + e, serve_value(key, e));
  });
}

// k, v, k_idx of every position of the contiguous sequences (what the cache holds in the end).
struct ServeHost {
  HostTensor k, v, k_idx;  // [T, Hkv, D], [T, Hkv, D], [T, Hik, Di]
};

inline ServeHost make_serve_host(const ServePlan& p, uint64_t seed, int threads) {
  const Shape& f = p.full;
  std::vector<int64_t> pos(f.T);
  for (int64_t g = 0; g < f.T; ++g) pos[g] = g - f.base_of(g);
  ServeHost h{HostTensor(f.dtype, {f.T, f.Hkv, f.D}), HostTensor(f.dtype, {f.T, f.Hkv, f.D}),
              HostTensor(f.dtype, {f.T, f.Hik, f.Di})};
  fill_serve_rows(h.k, ServeTensor::kK, seed, f.seq_of, pos, threads);
  fill_serve_rows(h.v, ServeTensor::kV, seed, f.seq_of, pos, threads);
  fill_serve_rows(h.k_idx, ServeTensor::kKIdx, seed, f.seq_of, pos, threads);
  return h;
}

// ---- device state -----------------------------------------------------------------------------------

// The cache and the per-call buffers (max_tq rows; a call uses its first Tq).
struct ServeDevice {
  DeviceTensor kc, vc, kic, page_table, seq_lens, cu_q;
  DeviceTensor q, q_idx, k, v, k_idx;
  DeviceTensor block_idx, sel_idx, out, lse, out_dense, lse_dense;
};

inline ServeDevice make_serve_device(Allocator& a, const ServePlan& p) {
  const Shape& f = p.full;
  const msa::DType i32 = msa::DType::kInt32, f32 = msa::DType::kFloat32;
  const int64_t nseq = f.nseq(), T = p.max_tq;
  ServeDevice d;
  d.kc = DeviceTensor(a, f.dtype, {p.pages, f.Bk, f.Hkv, f.D});
  d.vc = DeviceTensor(a, f.dtype, {p.pages, f.Bk, f.Hkv, f.D});
  d.kic = DeviceTensor(a, f.dtype, {p.pages, f.Bk, f.Hik, f.Di});
  for (DeviceTensor* t : {&d.kc, &d.vc, &d.kic}) t->poison();  // NaN: nothing appended yet
  HostTensor table(i32, {nseq, p.max_pages});
  for (int64_t x = 0; x < table.numel(); ++x) table.i32()[x] = -1;  // never read
  for (int64_t s = 0; s < nseq; ++s)
    for (size_t b = 0; b < p.table[s].size(); ++b) table.i32()[s * p.max_pages + b] = p.table[s][b];
  d.page_table = DeviceTensor::upload(a, table);
  d.seq_lens = DeviceTensor(a, i32, {nseq});
  d.cu_q = DeviceTensor(a, i32, {nseq + 1});
  d.q = DeviceTensor(a, f.dtype, {T, f.Hq, f.D});
  d.q_idx = DeviceTensor(a, f.dtype, {T, f.Hi, f.Di});
  d.k = DeviceTensor(a, f.dtype, {T, f.Hkv, f.D});
  d.v = DeviceTensor(a, f.dtype, {T, f.Hkv, f.D});
  d.k_idx = DeviceTensor(a, f.dtype, {T, f.Hik, f.Di});
  d.block_idx = DeviceTensor(a, i32, {T, f.Hi, f.k});
  d.sel_idx = DeviceTensor(a, i32, {T, f.Hi, f.k});
  d.out = DeviceTensor(a, f.dtype, {T, f.Hq, f.D});
  d.lse = DeviceTensor(a, f32, {T, f.Hq});
  d.out_dense = DeviceTensor(a, f.dtype, {T, f.Hq, f.D});
  d.lse_dense = DeviceTensor(a, f32, {T, f.Hq});
  return d;
}

// The first `rows` rows of a per-call buffer.
inline msa::TensorRef rows_of(const DeviceTensor& t, int64_t rows) {
  msa::TensorRef r = t.ref();
  r.shape[0] = rows;
  return r;
}

// The call's new tokens on the host: queries drawn, keys copied from the sequences.
struct ServeCallHost {
  HostTensor q, q_idx, k, v, k_idx;
};

inline HostTensor gather_tokens(const Shape& f, const HostTensor& src, const ServeCall& c) {
  std::vector<int64_t> shape = src.shape();
  shape[0] = c.Tq();
  HostTensor dst(src.dtype(), shape);
  const size_t row = src.bytes() / static_cast<size_t>(std::max<int64_t>(1, src.shape()[0]));
  for (int64_t x = 0; x < c.Tq(); ++x)
    std::memcpy(static_cast<unsigned char*>(dst.data()) + x * row,
                static_cast<const unsigned char*>(src.data()) + (f.cu[c.seq[x]] + c.pos[x]) * row, row);
  return dst;
}

// Draws / gathers the call's inputs and copies them, its seq_lens and cu_seqlens_q to the device.
inline ServeCallHost load_call(Allocator& a, const ServePlan& p, const ServeHost& h, const ServeCall& c,
                               ServeDevice& d, uint64_t seed, int threads) {
  const Shape& f = p.full;
  ServeCallHost x{HostTensor(f.dtype, {c.Tq(), f.Hq, f.D}), HostTensor(f.dtype, {c.Tq(), f.Hi, f.Di}),
                  gather_tokens(f, h.k, c), gather_tokens(f, h.v, c), gather_tokens(f, h.k_idx, c)};
  fill_serve_rows(x.q, ServeTensor::kQ, seed, c.seq, c.pos, threads);
  fill_serve_rows(x.q_idx, ServeTensor::kQIdx, seed, c.seq, c.pos, threads);
  const std::pair<const HostTensor*, DeviceTensor*> copies[] = {
      {&x.q, &d.q}, {&x.q_idx, &d.q_idx}, {&x.k, &d.k}, {&x.v, &d.v}, {&x.k_idx, &d.k_idx}};
  for (const auto& cp : copies) a.copy_to_device(cp.second->ref().data, cp.first->data(), cp.first->bytes());
  std::vector<int32_t> lens(f.nseq());
  for (int64_t s = 0; s < f.nseq(); ++s) lens[s] = static_cast<int32_t>(c.start[s] + c.n[s]);
  a.copy_to_device(d.seq_lens.ref().data, lens.data(), lens.size() * 4);
  a.copy_to_device(d.cu_q.ref().data, c.cu.data(), c.cu.size() * 4);
  for (DeviceTensor* t : {&d.block_idx, &d.sel_idx, &d.out, &d.lse, &d.out_dense, &d.lse_dense}) t->poison();
  return x;
}

// ---- the calls ----------------------------------------------------------------------------------------

inline msa::PagedCache cache_of(const ServeDevice& d) {
  msa::PagedCache c;
  c.k = d.kc.ref();
  c.v = d.vc.ref();
  c.k_idx = d.kic.ref();
  c.page_table = d.page_table.ref();
  c.seq_lens = d.seq_lens.ref();
  return c;
}

inline msa::PagedAppendParams append_params(const ServePlan& p, const ServeDevice& d, const ServeCall& c) {
  msa::PagedAppendParams a;
  a.k = rows_of(d.k, c.Tq());
  a.v = rows_of(d.v, c.Tq());
  a.k_idx = rows_of(d.k_idx, c.Tq());
  a.cu_seqlens_q = d.cu_q.ref();
  a.cache = cache_of(d);
  a.block_size = p.full.Bk;
  return a;
}

inline msa::PagedSelectParams select_params(const ServePlan& p, const ServeDevice& d, const ServeCall& c) {
  msa::PagedSelectParams s;
  s.q_idx = rows_of(d.q_idx, c.Tq());
  s.cu_seqlens_q = d.cu_q.ref();
  s.cache = cache_of(d);
  s.block_idx = rows_of(d.sel_idx, c.Tq());
  s.max_q_len = c.max_q_len;
  s.opts = options_for(p.full, Variant::kSparse);
  return s;
}

// kSparse: selection over the new tokens then attention over it (block_idx written); kDense: every
// causal key, into the dense outputs.
inline msa::PagedForwardParams forward_params(const ServePlan& p, const ServeDevice& d, const ServeCall& c,
                                              bool dense) {
  msa::PagedForwardParams f;
  f.q = rows_of(d.q, c.Tq());
  f.cu_seqlens_q = d.cu_q.ref();
  f.cache = cache_of(d);
  if (!dense) {
    f.select = true;
    f.q_idx = rows_of(d.q_idx, c.Tq());
    f.block_idx = rows_of(d.block_idx, c.Tq());
  }
  f.out = rows_of(dense ? d.out_dense : d.out, c.Tq());
  f.lse = rows_of(dense ? d.lse_dense : d.lse, c.Tq());
  f.max_q_len = c.max_q_len;
  f.opts = options_for(p.full, dense ? Variant::kDense : Variant::kSparse);
  return f;
}

// ---- FLOPs of a call (the model of flops.h at the new tokens' positions) ------------------------------
//   selection   2*Hi*Di * sum over new tokens of (p + 1)
//   sparse      4*D * sum over (new token, query head h) of |T_h(p)| (from the returned block_idx)
//   dense       4*D*Hq * sum over new tokens of (p + 1)
struct CallFlops {
  double select = 0, sparse = 0, dense = 0;
};

inline CallFlops call_flops(const ServePlan& p, const ServeCall& c, const HostTensor& block_idx) {
  const Shape& f = p.full;
  CallFlops r;
  double keys = 0, ni = 0;
  for (int64_t x = 0; x < c.Tq(); ++x) {
    const int64_t pos = c.pos[x], own = pos / f.Bk;
    keys += static_cast<double>(pos + 1);
    for (int32_t i = 0; i < f.Hi; ++i)
      for (int32_t e = 0; e < f.k; ++e) {
        const int64_t b = block_idx.i32()[(x * f.Hi + i) * f.k + e];
        if (b >= 0 && b <= own) ni += static_cast<double>(std::min<int64_t>((b + 1) * f.Bk, pos + 1) - b * f.Bk);
      }
  }
  r.select = 2.0 * f.Hi * f.Di * keys;
  r.sparse = 4.0 * f.D * ni * f.heads_per_idx();
  r.dense = 4.0 * f.D * f.Hq * keys;
  return r;
}

// ---- the check ---------------------------------------------------------------------------------------

// One sampled new-token row of a call, with what the sparse and dense calls returned for it.
struct ServeRow {
  int call = 0;
  bool decode = false;
  int32_t seq = 0;
  int64_t pos = 0;
  std::vector<double> q, q_idx;    // [Hq * D], [Hi * Di]
  std::vector<int32_t> block_idx;  // [Hi * k]
  std::vector<double> out, lse, out_dense, lse_dense;  // [Hq * D], [Hq]
};

// Row x of a device tensor, as doubles.
inline std::vector<double> download_row(Allocator& a, const DeviceTensor& t, int64_t x) {
  std::vector<int64_t> shape = t.shape();
  shape[0] = 1;
  HostTensor h(t.dtype(), shape);
  a.copy_to_host(h.data(), static_cast<const unsigned char*>(t.ref().data) + x * h.bytes(), h.bytes());
  std::vector<double> r(h.numel());
  for (int64_t e = 0; e < h.numel(); ++e) r[e] = h.get(e);
  return r;
}

// The rows of a call to check: the last new token of each request (up to half the quota), then
// uniformly random others; ascending.
inline std::vector<int64_t> sample_call_rows(const ServeCall& c, int64_t quota, std::mt19937_64& rng) {
  std::set<int64_t> pick;
  quota = std::min(quota, c.Tq());
  for (size_t s = 0; s + 1 < c.cu.size() && static_cast<int64_t>(pick.size()) < std::max<int64_t>(1, quota / 2); ++s)
    if (c.cu[s + 1] > c.cu[s]) pick.insert(c.cu[s + 1] - 1);
  std::uniform_int_distribution<int64_t> any(0, std::max<int64_t>(0, c.Tq() - 1));
  while (static_cast<int64_t>(pick.size()) < quota) pick.insert(any(rng));
  return {pick.begin(), pick.end()};
}

inline ServeRow capture_row(Allocator& a, const ServePlan& p, const ServeCall& c, int call, const ServeCallHost& h,
                            const ServeDevice& d, int64_t x) {
  const Shape& f = p.full;
  ServeRow r;
  r.call = call;
  r.decode = c.decode;
  r.seq = c.seq[x];
  r.pos = c.pos[x];
  r.q.resize(static_cast<size_t>(f.Hq) * f.D);
  r.q_idx.resize(static_cast<size_t>(f.Hi) * f.Di);
  for (int32_t h2 = 0; h2 < f.Hq; ++h2) h.q.load_row(x, h2, r.q.data() + static_cast<size_t>(h2) * f.D);
  for (int32_t i = 0; i < f.Hi; ++i) h.q_idx.load_row(x, i, r.q_idx.data() + static_cast<size_t>(i) * f.Di);
  for (double b : download_row(a, d.block_idx, x)) r.block_idx.push_back(static_cast<int32_t>(b));
  r.out = download_row(a, d.out, x);
  r.lse = download_row(a, d.lse, x);
  r.out_dense = download_row(a, d.out_dense, x);
  r.lse_dense = download_row(a, d.lse_dense, x);
  return r;
}

struct ServeStats {
  ErrStat selection, out, lse;
  int64_t identical = 0;  // selection rows (token, index head) equal to the reference's
  int64_t rows = 0;       // new-token rows checked

  void merge(const ServeStats& o) {
    selection.merge(o.selection);
    out.merge(o.out);
    lse.merge(o.lse);
    identical += o.identical;
    rows += o.rows;
  }
};

class ServeReference {
 public:
  ServeReference(const ServePlan& p, const ServeHost& h, const Tolerances& tol) : p_(p), f_(p.full), h_(h), tol_(tol) {}

  // Estimated FLOPs of checking a row, sparse (selection brute force + attention) or dense.
  double cost(const ServeRow& r, bool dense) const {
    const double keys = static_cast<double>(r.pos + 1);
    if (dense) return 4.0 * f_.Hq * f_.D * keys;
    return 2.0 * f_.Hi * f_.Di * keys + 4.0 * f_.Hq * f_.D * std::min(keys, static_cast<double>(f_.k) * f_.Bk);
  }

  void check(const ServeRow& r, bool dense, ServeStats& st) const {
    const int64_t base = f_.cu[r.seq], own = r.pos / f_.Bk;
    const std::string where = std::string(r.decode ? "decode step " : "prefill chunk ") +
                              std::to_string(r.decode ? r.call - p_.prefill_calls + 1 : r.call + 1) + ", request " +
                              std::to_string(r.seq) + ", position " + std::to_string(r.pos) + (dense ? ", dense" : "");
    ++st.rows;
    std::vector<int64_t> keys;
    if (dense) {
      for (int64_t j = 0; j <= r.pos; ++j) keys.push_back(j);
      for (int32_t kv = 0; kv < f_.Hkv; ++kv)
        attend(r, base, keys, kv, kv * f_.group(), (kv + 1) * f_.group(), true, where, st);
      return;
    }
    const int32_t hpi = f_.heads_per_idx();
    std::vector<double> kj(f_.Di);
    for (int32_t i = 0; i < f_.Hi; ++i) {
      // Selection: block maxima of the index scores over the keys 0..p (§2).
      std::vector<double> M(own + 1, -INFINITY);
      const double* qi = r.q_idx.data() + static_cast<size_t>(i) * f_.Di;
      for (int64_t j = 0; j <= r.pos; ++j) {
        h_.k_idx.load_row(base + j, i / f_.idx_per_key(), kj.data());
        M[j / f_.Bk] = std::max(M[j / f_.Bk], f_.scale_idx * dot(qi, kj.data(), f_.Di));
      }
      const int32_t* row = r.block_idx.data() + static_cast<size_t>(i) * f_.k;
      judge_selection(f_, M, row, tol_, where + ": block_idx[index head " + std::to_string(i) + "]", st.selection,
                      &st.identical);
      // Attention over the returned row's support (§3): entries in [0, own], once each.
      std::vector<int64_t> blocks;
      for (int32_t e = 0; e < f_.k; ++e)
        if (row[e] >= 0 && row[e] <= own) blocks.push_back(row[e]);
      std::sort(blocks.begin(), blocks.end());
      blocks.erase(std::unique(blocks.begin(), blocks.end()), blocks.end());
      keys.clear();
      for (int64_t b : blocks)
        for (int64_t j = b * f_.Bk; j < std::min((b + 1) * f_.Bk, r.pos + 1); ++j) keys.push_back(j);
      // The query heads of index head i share one KV head (Hi is a multiple of Hkv).
      attend(r, base, keys, i * hpi / f_.group(), i * hpi, (i + 1) * hpi, false, where, st);
    }
  }

 private:
  // out and lse of query heads [h0, h1) (KV head kv) over the keys, against the returned values.
  void attend(const ServeRow& r, int64_t base, const std::vector<int64_t>& keys, int32_t kv, int32_t h0, int32_t h1,
              bool dense, const std::string& where, ServeStats& st) const {
    const int32_t D = f_.D, nh = h1 - h0;
    const size_t n = keys.size();
    std::vector<double> a(static_cast<size_t>(nh) * n), row(D), o(static_cast<size_t>(nh) * D, 0.0), lse(nh);
    for (size_t j = 0; j < n; ++j) {
      h_.k.load_row(base + keys[j], kv, row.data());
      for (int32_t h = 0; h < nh; ++h)
        a[h * n + j] = f_.scale * dot(r.q.data() + static_cast<size_t>(h0 + h) * D, row.data(), D);
    }
    for (int32_t h = 0; h < nh; ++h) lse[h] = log_sum_exp(std::vector<double>(a.begin() + h * n, a.begin() + (h + 1) * n));
    for (size_t j = 0; j < n; ++j) {
      h_.v.load_row(base + keys[j], kv, row.data());
      for (int32_t h = 0; h < nh; ++h) {
        const double pj = std::exp(a[h * n + j] - lse[h]);
        for (int32_t d = 0; d < D; ++d) o[h * D + d] += pj * row[d];
      }
    }
    const std::vector<double>& got_out = dense ? r.out_dense : r.out;
    const std::vector<double>& got_lse = dense ? r.lse_dense : r.lse;
    for (int32_t h = 0; h < nh; ++h) {
      const int32_t hq = h0 + h;
      double scale = 0;
      for (int32_t d = 0; d < D; ++d) scale = std::max(scale, std::fabs(o[h * D + d]));
      for (int32_t d = 0; d < D; ++d) {
        const double ref = o[h * D + d];
        st.out.add(got_out[static_cast<size_t>(hq) * D + d], ref, tol_.rtol * std::fabs(ref) + tol_.atol + tol_.vec_rel * scale,
                   [&] { return where + ": out[head " + std::to_string(hq) + ", " + std::to_string(d) + "]"; });
      }
      st.lse.add(got_lse[hq], lse[h], tol_.lse_rel * std::fabs(lse[h]) + tol_.lse_abs,
                 [&] { return where + ": lse[head " + std::to_string(hq) + "]"; });
    }
  }

  const ServePlan& p_;
  const Shape& f_;
  const ServeHost& h_;
  const Tolerances tol_;
};

}  // namespace msa_app
