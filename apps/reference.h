// msa_main's reference check: a double-precision recomputation from the contract (docs/contract.md)
// and written independently of src/cpu, of a random sample of the outputs.
//
// Sampled tokens serve as query rows and as key columns:
//   rows     selection (§2: brute-force block maxima, forced blocks, ties to the lower index; judged
//            by the contract's tolerance rule), out and lse (§3, over the support of the returned
//            block_idx), dq and dq_idx (§4; they depend on the row alone);
//   columns  dk, dv (sum over the rows whose support holds the key) and dk_idx.
// A full pass over every row (when affordable, see kFullPassBudget) adds the exact KL value, the
// lse of every row, and the index log-normalisers that dk_idx needs.
//
// The backward is checked as a function of its inputs, which include out and lse as the forward
// returned them (themselves checked): delta = dO.O uses the returned out, P uses the returned lse.
// Outputs a run does not have (the CUDA backend: the KL value and the backward) are reported as
// skipped.
#pragma once

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <functional>
#include <limits>
#include <random>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "flops.h"
#include "host_tensor.h"
#include "workload.h"

namespace msa_app {

// Work allowed for the full pass, in FLOPs of its model (2*D*Nh + 2*Di*Ni in double).
constexpr double kFullPassBudget = 2.5e10;
// Work allowed for the sampled rows and columns of one variant; beyond it the sample is trimmed
// (GPU-sized shapes: a dense row or key column of a long sequence costs ~Hq*D*L).
constexpr double kSampleBudget = 5e10;

// ---- tolerances ---------------------------------------------------------------------------------

struct Tolerances {
  // An output element passes when |got - ref| <= rtol*|ref| + atol + vec_rel*max|ref of its vector|.
  double rtol, atol, vec_rel;
  double lse_rel, lse_abs;  // lse (fp32 output)
  double score_abs;         // selection: score slack of the contract's rule, times (1 + |k-th score|)
  double kl_rel;            // the KL value (fp32 output)
};

// The CPU backend computes in double from inputs that are exact in the dtype and rounds each output
// once: rtol is that rounding (2u, u the unit roundoff), atol the dtype's step near zero (fp16's
// subnormal gradients), vec_rel the slack for a different summation order in double. The CUDA
// values assume fp32 accumulation with 16-bit P in the PV product (vec_rel 8u of the row's largest
// value) and fp32 index scores (score_abs).
inline Tolerances tolerances_for(msa::DType dt, msa::DeviceType dev) {
  const double u = unit_roundoff(dt);
  const double step = float_format(dt).min_subnormal;
  if (dev == msa::DeviceType::kCpu) return {2 * u, step, 1e-6, std::ldexp(1.0, -22), 1e-6, 1e-9, 1e-5};
  return {2 * u, step, std::max(8 * u, 1e-4), 1e-5, 1e-4, 1e-3, 1e-3};
}

// ---- error statistics ---------------------------------------------------------------------------

struct ErrStat {
  int64_t count = 0;     // compared elements (or rows, for the selection)
  int64_t failures = 0;
  double max_err = 0;    // largest |got - ref|
  double max_ref = 0;    // largest |ref|
  double worst = 0;      // largest |got - ref| / allowed (<= 1 passes)
  std::string first_failure;
  bool skipped = false;
  std::string note;

  // `where` is called only for a failure.
  template <class Where>
  void add(double got, double ref, double allowed, Where&& where) {
    max_ref = std::max(max_ref, std::fabs(ref));
    add_error(std::fabs(got - ref), allowed, [&] {
      char buf[160];
      std::snprintf(buf, sizeof buf, ": got %.9g, expected %.9g (allowed error %.3g)", got, ref, allowed);
      return where() + buf;
    });
  }

  // An error already measured; `what` (called only for a failure) describes it.
  template <class What>
  void add_error(double err, double allowed, What&& what) {
    ++count;
    if (!(err <= allowed) && failures++ == 0) first_failure = what();  // NaN fails too
    if (!std::isfinite(err)) {
      max_err = worst = std::numeric_limits<double>::infinity();
      return;
    }
    max_err = std::max(max_err, err);
    worst = std::max(worst, allowed > 0 ? err / allowed : (err > 0 ? INFINITY : 0.0));
  }

  void fail(const std::string& what) {
    ++count;
    if (failures++ == 0) first_failure = what;
    worst = std::numeric_limits<double>::infinity();
  }

  void merge(const ErrStat& o) {
    if (o.failures && !failures) first_failure = o.first_failure;
    count += o.count;
    failures += o.failures;
    max_err = std::max(max_err, o.max_err);
    max_ref = std::max(max_ref, o.max_ref);
    worst = std::max(worst, o.worst);
  }

  bool pass() const { return skipped || failures == 0; }
};

struct CheckStats {
  ErrStat selection, out, lse, dq, dq_idx, dk, dv, dk_idx, kl;
  int64_t selection_identical = 0;  // rows whose selection equals the reference's exactly
  int64_t tokens = 0;               // sampled tokens checked (fewer than asked: kSampleBudget)

  void merge(const CheckStats& o) {
    for (int x = 0; x < kCount; ++x) (this->*members()[x]).merge(o.*members()[x]);
    selection_identical += o.selection_identical;
  }
  static constexpr int kCount = 9;
  static ErrStat CheckStats::* const* members() {
    static ErrStat CheckStats::* const m[kCount] = {
        &CheckStats::selection, &CheckStats::out, &CheckStats::lse, &CheckStats::dq, &CheckStats::dq_idx,
        &CheckStats::dk, &CheckStats::dv, &CheckStats::dk_idx, &CheckStats::kl};
    return m;
  }
  static const char* name(int x) {
    static const char* const n[kCount] = {"selection", "out", "lse", "dq", "dq_idx", "dk", "dv", "dk_idx", "kl"};
    return n[x];
  }
};

// ---- small numeric helpers ----------------------------------------------------------------------

inline double dot(const double* a, const double* b, int n) {
  double s = 0;
  for (int x = 0; x < n; ++x) s += a[x] * b[x];
  return s;
}

inline double log_sum_exp(const std::vector<double>& x) {
  if (x.empty()) return -INFINITY;
  const double m = *std::max_element(x.begin(), x.end());
  if (!std::isfinite(m)) return m;
  double s = 0;
  for (double v : x) s += std::exp(v - m);
  return m + std::log(s);
}

// Runs fn(item, worker) for item in [0, n) on `threads` threads; returns per-worker results merged.
inline void parallel_items(int64_t n, int threads, const std::function<void(int64_t, int)>& fn) {
  std::atomic<int64_t> next{0};
  auto work = [&](int w) {
    for (int64_t x = next++; x < n; x = next++) fn(x, w);
  };
  std::vector<std::thread> pool;
  for (int w = 1; w < threads; ++w) pool.emplace_back(work, w);
  work(0);
  for (auto& th : pool) th.join();
}

// The tokens the check samples: the first and last token of each sequence (up to half the budget),
// then uniformly random others; ascending, distinct.
inline std::vector<int64_t> sample_tokens(const Shape& s, int64_t n, uint64_t seed) {
  std::set<int64_t> pick;
  if (n >= s.T) {
    for (int64_t g = 0; g < s.T; ++g) pick.insert(g);
  } else {
    for (int64_t q = 0; q < s.nseq() && static_cast<int64_t>(pick.size()) + 2 <= n / 2; ++q)
      if (s.seqlens[q] > 0) pick.insert({s.cu[q], s.cu[q + 1] - 1});
    std::mt19937_64 rng(seed ^ 0x9e3779b97f4a7c15ull);
    std::uniform_int_distribution<int64_t> any(0, s.T - 1);
    while (static_cast<int64_t>(pick.size()) < n) pick.insert(any(rng));
  }
  return {pick.begin(), pick.end()};
}

// ---- selection (docs/contract.md §2) ----------------------------------------------------------

// Judges one returned selection row `row` (k entries) of a query whose own block is M.size() - 1,
// given the reference block maxima M (over its causal keys), by the contract's rule: entries -1 or
// in [0, own], distinct, as many as the reference selects, every forced block present, and every
// selected non-forced block scoring at least the reference's (k - |F|)-th best minus the slack.
// Rows equal to the reference's selection count in *identical.
inline void judge_selection(const Shape& s, const std::vector<double>& M, const int32_t* row, const Tolerances& tol,
                            const std::string& where, ErrStat& st, int64_t* identical) {
  const int64_t own = static_cast<int64_t>(M.size()) - 1;
  // Forced blocks; the others ranked by score, ties to the lower index.
  std::vector<bool> forced(own + 1, false);
  for (int64_t b = std::max<int64_t>(0, own - s.local + 1); b <= own; ++b) forced[b] = true;
  for (int64_t b = 0; b < std::min<int64_t>(s.sink, own + 1); ++b) forced[b] = true;
  const int64_t nforced = std::count(forced.begin(), forced.end(), true);
  std::vector<int64_t> cand;
  for (int64_t b = 0; b < own; ++b)
    if (!forced[b]) cand.push_back(b);
  std::stable_sort(cand.begin(), cand.end(), [&](int64_t a, int64_t b) { return M[a] > M[b]; });
  const int64_t slots = std::max<int64_t>(0, s.k - nforced);
  const int64_t expect = nforced + std::min<int64_t>(slots, static_cast<int64_t>(cand.size()));
  const double kth = static_cast<int64_t>(cand.size()) > slots && slots > 0 ? M[cand[slots - 1]] : -INFINITY;
  // The returned row: entries -1 or in [0, own], distinct, `expect` of them, forced ones included.
  std::vector<int64_t> got;
  for (int32_t x = 0; x < s.k; ++x) {
    const int64_t b = row[x];
    if (b == -1) continue;
    if (b < 0 || b > own) return st.fail(where + ": entry " + std::to_string(b) + " out of [-1, " + std::to_string(own) + "]");
    got.push_back(b);
  }
  std::sort(got.begin(), got.end());
  if (std::adjacent_find(got.begin(), got.end()) != got.end()) return st.fail(where + ": a block is selected twice");
  if (static_cast<int64_t>(got.size()) != expect)
    return st.fail(where + ": " + std::to_string(got.size()) + " blocks selected, expected " + std::to_string(expect));
  for (int64_t b = 0; b <= own; ++b)
    if (forced[b] && !std::binary_search(got.begin(), got.end(), b))
      return st.fail(where + ": forced block " + std::to_string(b) + " missing");
  // Every selected non-forced block scores at least the reference's k-th best minus the slack.
  // (kth is -inf when every candidate fits: then any selected candidate is fine.)
  double deficit = 0;
  int64_t worst_block = -1;
  if (std::isfinite(kth))
    for (int64_t b : got)
      if (!forced[b] && kth - M[b] > deficit) deficit = kth - M[b], worst_block = b;
  const double allowed = tol.score_abs * (1 + (std::isfinite(kth) ? std::fabs(kth) : 0.0));
  st.add_error(deficit, allowed, [&] {
    char buf[200];
    std::snprintf(buf, sizeof buf, ": selected block %lld scores %.9g, below the reference's k-th best %.9g (slack %.3g)",
                  static_cast<long long>(worst_block), M[worst_block], kth, allowed);
    return where + buf;
  });
  std::vector<int64_t> ref(cand.begin(), cand.begin() + std::min<int64_t>(slots, cand.size()));
  for (int64_t b = 0; b <= own; ++b)
    if (forced[b]) ref.push_back(b);
  std::sort(ref.begin(), ref.end());
  if (ref == got) ++*identical;
}

// ---- the checker ----------------------------------------------------------------------------------

class Reference {
 public:
  Reference(const Shape& s, const HostInputs& in, Variant v, const HostOutputs& o, const Tolerances& tol,
            int threads)
      : s_(s), in_(in), v_(v), o_(o), tol_(tol), threads_(std::max(1, threads)),
        index_(has_index(v)), Hl_(index_ ? s.Hi : 1), hpi_(s.Hq / Hl_),
        coef_(s.T > 0 && index_ ? 1.0 / (static_cast<double>(s.T) * s.Hi) : 0.0),
        backward_(!o.dq.empty()), kl_(index_ && !o.kl.empty()) {}

  // Estimated cost of the full pass (FLOPs), against kFullPassBudget.
  double full_pass_flops() const {
    const SupportSize n = v_ == Variant::kSparse ? sparse_support(s_, o_.block_idx) : dense_support(s_);
    return 2.0 * s_.D * n.nh + (index_ ? 2.0 * s_.Di * n.ni : 0.0);
  }

  CheckStats run(const std::vector<int64_t>& sample, uint64_t seed) {
    std::vector<CheckStats> per(threads_);
    // Without the KL value the full pass would only re-check lse (and feed dk_idx): the row sample
    // checks lse.
    const bool full = kl_ && full_pass_flops() <= kFullPassBudget;
    if (full) full_pass(per);
    const std::vector<int64_t> tokens = affordable(sample, seed);
    parallel_items(static_cast<int64_t>(tokens.size()), threads_, [&](int64_t x, int w) {
      check_row(tokens[x], per[w]);
      check_column(tokens[x], full, per[w]);
    });
    CheckStats st;
    for (const CheckStats& p : per) st.merge(p);
    st.tokens = static_cast<int64_t>(tokens.size());
    if (!full && kl_) {
      char why[120];
      std::snprintf(why, sizeof why, "needs the full pass: %.3g GFLOP > budget %.3g", full_pass_flops() / 1e9,
                    kFullPassBudget / 1e9);
      st.kl.skipped = st.dk_idx.skipped = true, st.kl.note = st.dk_idx.note = why;
    }
    if (index_ && !kl_) st.kl.skipped = true, st.kl.note = "not computed on this device";
    if (!backward_) {
      for (ErrStat* e : {&st.dq, &st.dk, &st.dv, &st.dq_idx, &st.dk_idx})
        e->skipped = true, e->note = "backward not run on this device";
    }
    if (v_ != Variant::kSparse) st.selection.skipped = true, st.selection.note = "no selection";
    if (!index_) {
      for (ErrStat* e : {&st.dq_idx, &st.dk_idx, &st.kl}) e->skipped = true, e->note = "no index branch";
    }
    return st;
  }

 private:
  // Estimated reference FLOPs of checking token g as a row and as a key column.
  double token_cost(int64_t g) const {
    const double t = static_cast<double>(g - s_.base_of(g)), after = static_cast<double>(s_.len_of(g)) - t;
    double keys = t + 1;  // |T| of the row: all causal keys, or at most k blocks
    if (v_ == Variant::kSparse) keys = std::min(keys, static_cast<double>(s_.k) * s_.Bk);
    double row = (backward_ ? 6.0 : 4.0) * s_.D * s_.Hq * keys, col = backward_ ? 8.0 * s_.D * s_.Hq * after : 0.0;
    if (v_ == Variant::kSparse) row += 2.0 * s_.Di * s_.Hi * (t + 1);  // the selection's brute force
    if (index_ && backward_) {
      row += 4.0 * s_.Di * s_.Hi * keys;
      col += (2.0 * s_.D * s_.Hq + 4.0 * s_.Di * s_.Hi) * after;
    }
    return row + col;
  }

  // The sample, trimmed to kSampleBudget: tokens taken in a seeded random order while they fit.
  std::vector<int64_t> affordable(std::vector<int64_t> sample, uint64_t seed) const {
    std::shuffle(sample.begin(), sample.end(), std::mt19937_64(seed + 17));
    std::vector<int64_t> keep;
    double cost = 0;
    for (int64_t g : sample) {
      cost += token_cost(g);
      if (cost > kSampleBudget && !keep.empty()) break;
      keep.push_back(g);
    }
    std::sort(keep.begin(), keep.end());
    return keep;
  }

  // ---- support of a row ----

  const int32_t* bi_row(int64_t g, int32_t i) const { return o_.block_idx.i32() + (g * s_.Hi + i) * s_.k; }

  // Blocks of the row's support, ascending: the returned selection (entries in range only) or, for
  // the dense variants, every causal block.
  void support_blocks(int64_t g, int32_t i, std::vector<int64_t>* out) const {
    out->clear();
    const int64_t own = (g - s_.base_of(g)) / s_.Bk;
    if (v_ != Variant::kSparse) {
      for (int64_t b = 0; b <= own; ++b) out->push_back(b);
      return;
    }
    for (int32_t x = 0; x < s_.k; ++x) {
      const int64_t b = bi_row(g, i)[x];
      if (b >= 0 && b <= own) out->push_back(b);
    }
    std::sort(out->begin(), out->end());
    out->erase(std::unique(out->begin(), out->end()), out->end());
  }

  // Local key positions of the support (keys j <= t of its blocks).
  void support_keys(int64_t g, int32_t i, std::vector<int64_t>* keys) const {
    thread_local std::vector<int64_t> blocks;
    support_blocks(g, i, &blocks);
    const int64_t t = g - s_.base_of(g);
    keys->clear();
    for (int64_t b : blocks)
      for (int64_t j = b * s_.Bk; j < std::min((b + 1) * s_.Bk, t + 1); ++j) keys->push_back(j);
  }

  bool in_support(int64_t g, int32_t i, int64_t block) const {
    if (v_ != Variant::kSparse) return true;  // callers pass causal blocks only
    for (int32_t x = 0; x < s_.k; ++x)
      if (bi_row(g, i)[x] == block) return true;
    return false;
  }

  // ---- comparisons ----

  // mag (optional): per element, the sum of the absolute values of the terms that make up ref; a
  // sum that cancels (a gradient near zero) is then judged by the size of its terms.
  void compare_vec(ErrStat& st, const HostTensor& got, int64_t t, int64_t h, const std::vector<double>& ref,
                   const char* name, const std::vector<double>* mag = nullptr) const {
    double scale = 0;
    for (double r : ref) scale = std::max(scale, std::fabs(r));
    if (mag != nullptr)
      for (double m : *mag) scale = std::max(scale, m);
    const int64_t n = static_cast<int64_t>(ref.size());
    for (int64_t x = 0; x < n; ++x) {
      const double allowed = tol_.rtol * std::fabs(ref[x]) + tol_.atol + tol_.vec_rel * scale;
      st.add(got.get((t * got.shape()[1] + h) * n + x), ref[x], allowed, [&] {
        return std::string(variant_name(v_)) + " " + name + "[" + std::to_string(t) + ", " + std::to_string(h) +
               ", " + std::to_string(x) + "]";
      });
    }
  }

  void compare_lse(ErrStat& st, int64_t g, int32_t h, double ref) const {
    st.add(o_.lse.at(g, h), ref, tol_.lse_rel * std::fabs(ref) + tol_.lse_abs, [&] {
      return std::string(variant_name(v_)) + " lse[" + std::to_string(g) + ", " + std::to_string(h) + "]";
    });
  }

  // ---- selection (docs/contract.md §2) ----

  void check_selection(int64_t g, int32_t i, CheckStats& st) const {
    const int64_t base = s_.base_of(g), t = g - base, own = t / s_.Bk;
    // Token scores and block maxima over causal keys.
    std::vector<double> qi(s_.Di), kj(s_.Di), M(own + 1, -INFINITY);
    in_.q_idx.load_row(g, i, qi.data());
    for (int64_t j = 0; j <= t; ++j) {
      in_.k_idx.load_row(base + j, i / s_.idx_per_key(), kj.data());
      M[j / s_.Bk] = std::max(M[j / s_.Bk], s_.scale_idx * dot(qi.data(), kj.data(), s_.Di));
    }
    judge_selection(s_, M, bi_row(g, i), tol_, "sparse block_idx[" + std::to_string(g) + ", " + std::to_string(i) + "]",
                    st.selection, &st.selection_identical);
  }

  // ---- rows: out, lse, dq, dq_idx ----

  void check_row(int64_t g, CheckStats& st) const {
    const int64_t base = s_.base_of(g);
    const int32_t D = s_.D, Di = s_.Di;
    std::vector<int64_t> keys;
    std::vector<double> q(D), kv(D), vv(D), dO(D), O(D), a, pi, sc, o_ref(D), dq_ref(D), qi(Di), ki(Di), dqi_ref(Di);
    std::vector<double> dq_mag(D), dqi_mag(Di);
    for (int32_t i = 0; i < Hl_; ++i) {
      if (v_ == Variant::kSparse) check_selection(g, i, st);
      support_keys(g, i, &keys);
      const size_t n = keys.size();
      a.resize(n);
      pi.assign(n, 0.0);
      for (int32_t h = i * hpi_; h < (i + 1) * hpi_; ++h) {
        const int32_t r = h / s_.group();
        in_.q.load_row(g, h, q.data());
        for (size_t j = 0; j < n; ++j) {
          in_.k.load_row(base + keys[j], r, kv.data());
          a[j] = s_.scale * dot(q.data(), kv.data(), D);
        }
        // Forward: out and lse over the support.
        const double lse = log_sum_exp(a);
        std::fill(o_ref.begin(), o_ref.end(), 0.0);
        for (size_t j = 0; j < n; ++j) {
          in_.v.load_row(base + keys[j], r, vv.data());
          const double p = std::exp(a[j] - lse);
          for (int32_t d = 0; d < D; ++d) o_ref[d] += p * vv[d];
        }
        compare_vec(st.out, o_.out, g, h, o_ref, "out");
        compare_lse(st.lse, g, h, lse);
        if (!backward_) continue;
        // Backward of the row: dq = scale * sum_j P_j (dO.v_j - dO.O) k_j.
        o_.out.load_row(g, h, O.data());
        in_.dout.load_row(g, h, dO.data());
        const double delta = dot(dO.data(), O.data(), D), L = o_.lse.at(g, h);
        std::fill(dq_ref.begin(), dq_ref.end(), 0.0);
        std::fill(dq_mag.begin(), dq_mag.end(), 0.0);
        for (size_t j = 0; j < n; ++j) {
          in_.k.load_row(base + keys[j], r, kv.data());
          in_.v.load_row(base + keys[j], r, vv.data());
          const double p = std::exp(a[j] - L), dp = dot(dO.data(), vv.data(), D);
          const double ds = p * (dp - delta), ds_mag = p * (std::fabs(dp) + std::fabs(delta));
          for (int32_t d = 0; d < D; ++d) {
            dq_ref[d] += s_.scale * ds * kv[d];
            dq_mag[d] += std::fabs(s_.scale * ds_mag * kv[d]);
          }
          pi[j] += p / hpi_;
        }
        compare_vec(st.dq, o_.dq, g, h, dq_ref, "dq", &dq_mag);
      }
      if (!index_ || !backward_) continue;
      // dq_idx = scale_idx * sum_j gamma/(N*Hi) (sigma_j - pi_j) k_idx_j, gamma = 1.
      const int32_t ik = i / s_.idx_per_key();
      in_.q_idx.load_row(g, i, qi.data());
      sc.resize(n);
      for (size_t j = 0; j < n; ++j) {
        in_.k_idx.load_row(base + keys[j], ik, ki.data());
        sc[j] = s_.scale_idx * dot(qi.data(), ki.data(), Di);
      }
      const double lidx = log_sum_exp(sc);
      std::fill(dqi_ref.begin(), dqi_ref.end(), 0.0);
      std::fill(dqi_mag.begin(), dqi_mag.end(), 0.0);
      for (size_t j = 0; j < n; ++j) {
        in_.k_idx.load_row(base + keys[j], ik, ki.data());
        const double sigma = std::exp(sc[j] - lidx);
        const double ds = coef_ * (sigma - pi[j]), ds_mag = std::fabs(coef_) * (sigma + pi[j]);
        for (int32_t d = 0; d < Di; ++d) {
          dqi_ref[d] += s_.scale_idx * ds * ki[d];
          dqi_mag[d] += std::fabs(s_.scale_idx * ds_mag * ki[d]);
        }
      }
      compare_vec(st.dq_idx, o_.dq_idx, g, i, dqi_ref, "dq_idx", &dqi_mag);
    }
  }

  // ---- columns: dk, dv, dk_idx of key token gj ----

  void check_column(int64_t gj, bool with_dk_idx, CheckStats& st) const {
    if (!backward_) return;
    const int64_t base = s_.base_of(gj), j = gj - base, len = s_.len_of(gj), bj = j / s_.Bk;
    const int32_t D = s_.D, Di = s_.Di, G = s_.group();
    std::vector<double> kj(D), vj(D), q(D), dO(D), O(D), dk_ref(D), dv_ref(D), kij(Di), qi(Di), dki_ref(Di);
    for (int32_t r = 0; r < s_.Hkv; ++r) {
      in_.k.load_row(gj, r, kj.data());
      in_.v.load_row(gj, r, vj.data());
      std::fill(dk_ref.begin(), dk_ref.end(), 0.0);
      std::fill(dv_ref.begin(), dv_ref.end(), 0.0);
      for (int64_t t = j; t < len; ++t) {
        const int64_t g = base + t;
        for (int32_t h = r * G; h < (r + 1) * G; ++h) {
          if (!in_support(g, h / hpi_, bj)) continue;
          in_.q.load_row(g, h, q.data());
          in_.dout.load_row(g, h, dO.data());
          o_.out.load_row(g, h, O.data());
          const double p = std::exp(s_.scale * dot(q.data(), kj.data(), D) - o_.lse.at(g, h));
          const double ds = p * (dot(dO.data(), vj.data(), D) - dot(dO.data(), O.data(), D));
          for (int32_t d = 0; d < D; ++d) {
            dk_ref[d] += s_.scale * ds * q[d];
            dv_ref[d] += p * dO[d];
          }
        }
      }
      compare_vec(st.dk, o_.dk, gj, r, dk_ref, "dk");
      compare_vec(st.dv, o_.dv, gj, r, dv_ref, "dv");
    }
    if (!index_ || !with_dk_idx) return;
    const int32_t ipk = s_.idx_per_key();
    for (int32_t ik = 0; ik < s_.Hik; ++ik) {
      in_.k_idx.load_row(gj, ik, kij.data());
      std::fill(dki_ref.begin(), dki_ref.end(), 0.0);
      for (int64_t t = j; t < len; ++t) {
        const int64_t g = base + t;
        for (int32_t i = ik * ipk; i < (ik + 1) * ipk; ++i) {
          if (!in_support(g, i, bj)) continue;
          double pi = 0;
          for (int32_t h = i * hpi_; h < (i + 1) * hpi_; ++h) {
            in_.q.load_row(g, h, q.data());
            in_.k.load_row(gj, h / G, kj.data());
            pi += std::exp(s_.scale * dot(q.data(), kj.data(), D) - o_.lse.at(g, h)) / hpi_;
          }
          in_.q_idx.load_row(g, i, qi.data());
          const double sigma = std::exp(s_.scale_idx * dot(qi.data(), kij.data(), Di) - lse_idx_[g * s_.Hi + i]);
          const double ds = coef_ * (sigma - pi);
          for (int32_t d = 0; d < Di; ++d) dki_ref[d] += s_.scale_idx * ds * qi[d];
        }
      }
      compare_vec(st.dk_idx, o_.dk_idx, gj, ik, dki_ref, "dk_idx");
    }
  }

  // ---- full pass: lse of every row; with the index branch the exact KL and every LSE_idx ----

  void full_pass(std::vector<CheckStats>& per) {
    const int32_t D = s_.D, Di = s_.Di;
    lse_idx_.assign(static_cast<size_t>(s_.T) * (index_ ? s_.Hi : 0), 0.0);
    std::vector<double> kl_rows(static_cast<size_t>(s_.T) * (index_ ? s_.Hi : 0), 0.0);
    parallel_items(s_.T, threads_, [&](int64_t g, int w) {
      const int64_t base = s_.base_of(g);
      std::vector<int64_t> keys;
      std::vector<double> q(D), kv(D), a, pi, sc, qi(Di), ki(Di);
      for (int32_t i = 0; i < Hl_; ++i) {
        support_keys(g, i, &keys);
        const size_t n = keys.size();
        a.resize(n);
        pi.assign(n, 0.0);
        for (int32_t h = i * hpi_; h < (i + 1) * hpi_; ++h) {
          in_.q.load_row(g, h, q.data());
          for (size_t j = 0; j < n; ++j) {
            in_.k.load_row(base + keys[j], h / s_.group(), kv.data());
            a[j] = s_.scale * dot(q.data(), kv.data(), D);
          }
          const double lse = log_sum_exp(a);
          compare_lse(per[w].lse, g, h, lse);
          for (size_t j = 0; j < n; ++j) pi[j] += std::exp(a[j] - lse) / hpi_;
        }
        if (!index_) continue;
        in_.q_idx.load_row(g, i, qi.data());
        sc.resize(n);
        for (size_t j = 0; j < n; ++j) {
          in_.k_idx.load_row(base + keys[j], i / s_.idx_per_key(), ki.data());
          sc[j] = s_.scale_idx * dot(qi.data(), ki.data(), Di);
        }
        const double lidx = log_sum_exp(sc);
        double kl = 0;
        for (size_t j = 0; j < n; ++j)
          if (pi[j] > 0) kl += pi[j] * (std::log(pi[j]) - (sc[j] - lidx));
        lse_idx_[g * s_.Hi + i] = lidx;
        kl_rows[g * s_.Hi + i] = kl;
      }
    });
    if (!index_) return;
    double total = 0;
    for (double x : kl_rows) total += x;
    const double ref = s_.T > 0 ? total * coef_ : 0.0;
    per[0].kl.add(o_.kl.get(0), ref, tol_.kl_rel * std::fabs(ref) + 1e-7,
                  [&] { return std::string(variant_name(v_)) + " kl"; });
  }

  const Shape& s_;
  const HostInputs& in_;
  const Variant v_;
  const HostOutputs& o_;
  const Tolerances tol_;
  const int threads_;
  const bool index_;
  const int32_t Hl_, hpi_;  // index heads as the loops see them (1 without an index branch)
  const double coef_;       // gamma / (N * Hi), gamma = kl_weight = 1
  const bool backward_;     // the run has backward outputs (dq, dk, dv, ...)
  const bool kl_;           // the run has the exact KL value
  std::vector<double> lse_idx_;
};

}  // namespace msa_app
