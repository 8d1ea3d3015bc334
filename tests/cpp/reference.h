// Independent references for the tests, written from the contract (docs/contract.md) with another structure than the
// backend: selection by a full sort of all candidates, attention and gradients over an explicit
// per-row key mask (every key of the sequence is visited), and a naive dense causal GQA
// attention that knows nothing of blocks.
#pragma once

#include <algorithm>
#include <cmath>
#include <limits>
#include <sstream>
#include <string>
#include <vector>

#include "harness.h"

namespace msatest {

// Selected blocks per (global row, index head).
using Sets = std::vector<std::vector<std::vector<int>>>;

inline int64_t seq_begin(const Problem& p, int64_t g) {
  size_t s = std::upper_bound(p.offsets.begin(), p.offsets.end(), g) - p.offsets.begin() - 1;
  return p.offsets[s];
}
inline int64_t seq_end(const Problem& p, int64_t g) {
  size_t s = std::upper_bound(p.offsets.begin(), p.offsets.end(), g) - p.offsets.begin() - 1;
  return p.offsets[s + 1];
}

inline Sets sets_from(const Problem& p, const HostTensor& bi) {
  Sets s(p.T, std::vector<std::vector<int>>(p.cfg.Hi));
  for (int64_t g = 0; g < p.T; ++g)
    for (int i = 0; i < p.cfg.Hi; ++i)
      for (int j = 0; j < bi.shape()[2]; ++j)
        if (bi.idx(g, i, j) >= 0) s[g][i].push_back(bi.idx(g, i, j));
  return s;
}

inline Sets all_causal_blocks(const Problem& p) {
  Sets s(p.T, std::vector<std::vector<int>>(p.cfg.Hi));
  for (int64_t g = 0; g < p.T; ++g)
    for (int i = 0; i < p.cfg.Hi; ++i)
      for (int b = 0; b <= (g - seq_begin(p, g)) / p.cfg.Bk; ++b) s[g][i].push_back(b);
  return s;
}

inline double index_score(const Problem& p, int64_t g, int i, int64_t gj) {
  const int ik = i / (p.cfg.Hi / p.cfg.Hik);
  double acc = 0;
  for (int d = 0; d < p.cfg.Di; ++d) acc += p.q_idx.at(g, i, d) * p.k_idx.at(gj, ik, d);
  return p.scale_idx() * acc;
}

// Contract §2, FP8 scores: `p` with q_idx and k_idx replaced by their dequantised E4M3 copies
// (float64), from the format's definition in harness.h (nearest code by search), independently
// of the backends: scale 16 / amax (fp32) per q_idx row and per block of a sequence's keys of
// one index key head, values e4m3(fp32(x * scale)) / scale.
inline Problem fp8_scored(const Problem& p) {
  Problem out = p;
  const Config& c = p.cfg;
  const auto scale_of = [](float amax) { return amax > 0.f && std::isfinite(amax) ? 16.f / amax : 1.f; };
  const auto value = [](double x, float s) {
    const float y = static_cast<float>(x) * s;
    return e4m3_value(e4m3_code(y)) / static_cast<double>(s);
  };
  out.q_idx = HostTensor(DType::kFloat64, {p.T, c.Hi, c.Di});
  out.k_idx = HostTensor(DType::kFloat64, {p.T, c.Hik, c.Di});
  for (int64_t g = 0; g < p.T; ++g)
    for (int i = 0; i < c.Hi; ++i) {
      float amax = 0.f;
      for (int d = 0; d < c.Di; ++d) amax = std::max(amax, std::fabs(static_cast<float>(p.q_idx.at(g, i, d))));
      const float s = scale_of(amax);
      for (int d = 0; d < c.Di; ++d) out.q_idx.set((g * c.Hi + i) * c.Di + d, value(p.q_idx.at(g, i, d), s));
    }
  for (size_t q = 0; q + 1 < p.offsets.size(); ++q)
    for (int64_t j0 = p.offsets[q]; j0 < p.offsets[q + 1]; j0 += c.Bk) {
      const int64_t j1 = std::min<int64_t>(j0 + c.Bk, p.offsets[q + 1]);
      for (int ik = 0; ik < c.Hik; ++ik) {
        float amax = 0.f;
        for (int64_t j = j0; j < j1; ++j)
          for (int d = 0; d < c.Di; ++d) amax = std::max(amax, std::fabs(static_cast<float>(p.k_idx.at(j, ik, d))));
        const float s = scale_of(amax);
        for (int64_t j = j0; j < j1; ++j)
          for (int d = 0; d < c.Di; ++d) out.k_idx.set((j * c.Hik + ik) * c.Di + d, value(p.k_idx.at(j, ik, d), s));
      }
    }
  return out;
}

// M(t, b) for b <= blk(t).
inline std::vector<double> block_scores(const Problem& p, int64_t g, int i) {
  const int64_t b0 = seq_begin(p, g), t = g - b0;
  std::vector<double> m(t / p.cfg.Bk + 1, -INFINITY);
  for (int64_t j = 0; j <= t; ++j) m[j / p.cfg.Bk] = std::max(m[j / p.cfg.Bk], index_score(p, g, i, b0 + j));
  return m;
}

inline bool is_forced(const Config& c, int own, int b) {
  return (b <= own && b > own - c.local) || (b < c.sink && b <= own);
}

// Contract §2's output format of one block_idx row (all k entries): the selected ids strictly
// ascending, each a causal block in [0, own], then -1 padding; min(k, own + 1) ids in all (every
// causal block is forced or a candidate). Returns "" when the row has that form, else what is wrong.
inline std::string selection_format_error(const std::vector<int>& row, int own) {
  const int k = static_cast<int>(row.size());
  int n = 0;
  while (n < k && row[n] >= 0) ++n;
  for (int j = n; j < k; ++j)
    if (row[j] != -1)
      return "entry " + std::to_string(j) + " = " + std::to_string(row[j]) + " where -1 padding was expected";
  for (int j = 0; j < n; ++j) {
    if (row[j] > own)
      return "entry " + std::to_string(j) + " = " + std::to_string(row[j]) + " is after the own block " +
             std::to_string(own);
    if (j > 0 && row[j] <= row[j - 1]) return "ids not strictly ascending at entry " + std::to_string(j);
  }
  if (n != std::min(k, own + 1))
    return std::to_string(n) + " ids selected, expected min(k, own + 1) = " + std::to_string(std::min(k, own + 1));
  return "";
}

// Contract §2's acceptance rule for one selected row (two correct implementations may order
// near-equal scores differently): every forced block is selected, and every selected non-forced
// block scores at least the reference's k-th best non-forced score minus
// abs_tol + rel_tol * |that score|. `m`: the block scores M(t, b) for b in [0, own]; `chosen`: the
// row's selected ids (its non-negative entries). Returns "" when the row is acceptable.
inline std::string selection_rule_error(const Config& c, int own, const std::vector<double>& m,
                                        const std::vector<int>& chosen, double abs_tol, double rel_tol) {
  std::vector<double> others;
  int nforced = 0;
  for (int b = 0; b <= own; ++b) {
    if (!is_forced(c, own, b)) {
      others.push_back(m[b]);
      continue;
    }
    ++nforced;
    if (std::find(chosen.begin(), chosen.end(), b) == chosen.end())
      return "forced block " + std::to_string(b) + " is missing";
  }
  for (int b : chosen)
    if (b < 0 || b > own) return "block " + std::to_string(b) + " is not in [0, " + std::to_string(own) + "]";
  const int slots = c.k - nforced;
  if (slots <= 0 || static_cast<int>(others.size()) <= slots) return "";  // every candidate fits
  std::sort(others.rbegin(), others.rend());
  const double kth = others[slots - 1], allowed = abs_tol + rel_tol * std::fabs(kth);
  for (int b : chosen) {
    if (is_forced(c, own, b) || m[b] >= kth - allowed) continue;
    std::ostringstream os;
    os.precision(9);
    os << "block " << b << " scores " << m[b] << ", below the reference's k-th best non-forced score " << kth
       << " minus " << allowed;
    return os.str();
  }
  return "";
}

// Contract §2's rule for a selection re-ranked from an FP8 shortlist (kFp8, fp8_rerank = m > 0),
// with slack: every selected non-forced block is among the free slots + m best candidates by
// `m8` (the copies' block scores) up to abs_tol + rel_tol * |that (slots + m)-th score|, and no
// candidate surely in the shortlist (above that score by more than the slack) is left out while
// it outscores a selected one under `m_in` (the inputs' block scores) by more than the slack.
// With `a` in (0, free slots) (Options.fp8_rerank_slots) and more candidates than slots, every
// candidate surely among the best (slots - a) by `m8` is selected, and only the selected blocks
// surely below them by `m8` are the re-ranked ones a left-out candidate is compared with.
inline std::string shortlist_rule_error(const Config& c, int own, const std::vector<double>& m8,
                                        const std::vector<double>& m_in, int m, const std::vector<int>& chosen,
                                        double abs_tol, double rel_tol, int a = 0) {
  std::vector<int> cand;
  for (int b = 0; b <= own; ++b) {
    if (!is_forced(c, own, b)) {
      cand.push_back(b);
      continue;
    }
    if (std::find(chosen.begin(), chosen.end(), b) == chosen.end())
      return "forced block " + std::to_string(b) + " is missing";
  }
  const int slots = c.k - (own + 1 - static_cast<int>(cand.size()));
  if (slots <= 0) return "";
  std::vector<double> by8;
  for (int b : cand) by8.push_back(m8[b]);
  std::sort(by8.rbegin(), by8.rend());
  const bool limited = static_cast<int>(cand.size()) > slots + m;
  const double kth8 = limited ? by8[slots + m - 1] : -INFINITY;
  const double allowed8 = limited ? abs_tol + rel_tol * std::fabs(kth8) : 0.0;
  const bool keeps = a > 0 && a < slots && static_cast<int>(cand.size()) > slots;
  const double keep8 = keeps ? by8[slots - a - 1] : INFINITY;
  const double allowed_keep = keeps ? abs_tol + rel_tol * std::fabs(keep8) : 0.0;
  for (int b : cand)
    if (keeps && m8[b] > keep8 + allowed_keep && std::find(chosen.begin(), chosen.end(), b) == chosen.end())
      return "block " + std::to_string(b) + " is among the best free slots - " + std::to_string(a) +
             " by FP8 score (" + std::to_string(m8[b]) + " above " + std::to_string(keep8) + ") and not selected";
  double worst = INFINITY;
  int picked = 0;
  for (int b : chosen) {
    if (is_forced(c, own, b)) continue;
    ++picked;
    if (!keeps || m8[b] < keep8 - allowed_keep) worst = std::min(worst, m_in[b]);
    if (limited && m8[b] < kth8 - allowed8)
      return "block " + std::to_string(b) + " is outside the FP8 shortlist (score " + std::to_string(m8[b]) +
             " below " + std::to_string(kth8) + ")";
  }
  if (picked < slots) return "";  // fewer candidates than slots: the format check counts them
  const double allowed = abs_tol + rel_tol * std::fabs(worst);
  for (int b : cand) {
    const bool surely = !limited || m8[b] > kth8 + allowed8;
    if (!surely || std::find(chosen.begin(), chosen.end(), b) != chosen.end()) continue;
    if (m_in[b] > worst + allowed)
      return "shortlisted block " + std::to_string(b) + " scores " + std::to_string(m_in[b]) +
             ", above the selected blocks' lowest " + std::to_string(worst);
  }
  return "";
}

// Brute force of the re-ranked FP8 selection: the free slots + m best candidates by `q8`'s block
// scores (fp8_scored of `p`), then the slots by p's own, ties to the lower index both times.
// With `a` in (0, free slots) (Options.fp8_rerank_slots) and more candidates than slots, the
// best (free - a) by q8's scores are kept and only the last a slots ranked by p's own scores.
inline Sets ref_select_shortlist(const Problem& p, const Problem& q8, int m, int a = 0) {
  const Config& c = p.cfg;
  Sets s(p.T, std::vector<std::vector<int>>(c.Hi));
  for (int64_t g = 0; g < p.T; ++g) {
    const int own = static_cast<int>((g - seq_begin(p, g)) / c.Bk);
    for (int i = 0; i < c.Hi; ++i) {
      const std::vector<double> m_in = block_scores(p, g, i), m8 = block_scores(q8, g, i);
      std::vector<int> chosen, cand;
      for (int b = 0; b <= own; ++b) (is_forced(c, own, b) ? chosen : cand).push_back(b);
      const int slots = c.k - static_cast<int>(chosen.size());
      std::stable_sort(cand.begin(), cand.end(), [&](int x, int y) { return m8[x] > m8[y]; });
      const int keep = a > 0 && a < slots && static_cast<int>(cand.size()) > slots ? slots - a : 0;
      if (static_cast<int>(cand.size()) > slots + m) cand.resize(slots + m);
      chosen.insert(chosen.end(), cand.begin(), cand.begin() + keep);
      cand.erase(cand.begin(), cand.begin() + keep);
      std::sort(cand.begin(), cand.end());
      std::stable_sort(cand.begin(), cand.end(), [&](int x, int y) { return m_in[x] > m_in[y]; });
      for (int x = 0; x < static_cast<int>(cand.size()) && x < slots - keep; ++x) chosen.push_back(cand[x]);
      std::sort(chosen.begin(), chosen.end());
      s[g][i] = chosen;
    }
  }
  return s;
}

// Brute force: rank every non-forced earlier block by (score desc, index asc), take the top.
inline Sets ref_select(const Problem& p) {
  const Config& c = p.cfg;
  Sets s(p.T, std::vector<std::vector<int>>(c.Hi));
  for (int64_t g = 0; g < p.T; ++g) {
    const int own = static_cast<int>((g - seq_begin(p, g)) / c.Bk);
    for (int i = 0; i < c.Hi; ++i) {
      const std::vector<double> m = block_scores(p, g, i);
      std::vector<int> chosen, cand;
      for (int b = 0; b <= own; ++b) (is_forced(c, own, b) ? chosen : cand).push_back(b);
      std::stable_sort(cand.begin(), cand.end(), [&](int a, int b) { return m[a] > m[b]; });
      for (int x = 0; x < static_cast<int>(cand.size()) && static_cast<int>(chosen.size()) < c.k; ++x)
        chosen.push_back(cand[x]);
      std::sort(chosen.begin(), chosen.end());
      s[g][i] = chosen;
    }
  }
  return s;
}

// Main-branch scores a_h(t, j) for every key of the sequence, with the row's mask.
struct RowView {
  std::vector<double> a;     // scores (masked entries unused)
  std::vector<char> mask;    // j in T_h(t)
  std::vector<double> prob;  // P_h(t, j), 0 outside the mask
  double lse = -INFINITY;
};

inline RowView main_row(const Problem& p, const Sets& sets, int64_t g, int h, bool use_lse = false,
                        double given_lse = 0) {
  const Config& c = p.cfg;
  const int64_t b0 = seq_begin(p, g), L = seq_end(p, g) - b0, t = g - b0;
  const int i = h / (c.Hq / c.Hi), r = h / (c.Hq / c.Hkv);
  RowView rv;
  rv.a.assign(L, 0);
  rv.mask.assign(L, 0);
  rv.prob.assign(L, 0);
  const std::vector<int>& blocks = sets[g][i];
  double mx = -INFINITY;
  for (int64_t j = 0; j < L; ++j) {
    rv.mask[j] = j <= t && std::find(blocks.begin(), blocks.end(), static_cast<int>(j / c.Bk)) != blocks.end();
    if (!rv.mask[j]) continue;
    double acc = 0;
    for (int d = 0; d < c.D; ++d) acc += p.q.at(g, h, d) * p.k.at(b0 + j, r, d);
    rv.a[j] = p.scale() * acc;
    mx = std::max(mx, rv.a[j]);
  }
  double sum = 0;
  for (int64_t j = 0; j < L; ++j)
    if (rv.mask[j]) sum += std::exp(rv.a[j] - mx);
  rv.lse = sum > 0 ? mx + std::log(sum) : -INFINITY;
  const double l = use_lse ? given_lse : rv.lse;
  for (int64_t j = 0; j < L; ++j)
    if (rv.mask[j]) rv.prob[j] = std::exp(rv.a[j] - l);
  return rv;
}

struct RefForward {
  std::vector<double> out, lse;  // [T, Hq, D], [T, Hq]
};

inline RefForward ref_forward(const Problem& p, const Sets& sets) {
  const Config& c = p.cfg;
  RefForward f{std::vector<double>(p.T * c.Hq * c.D, 0), std::vector<double>(p.T * c.Hq, 0)};
  for (int64_t g = 0; g < p.T; ++g) {
    const int64_t b0 = seq_begin(p, g);
    for (int h = 0; h < c.Hq; ++h) {
      const RowView rv = main_row(p, sets, g, h);
      f.lse[g * c.Hq + h] = rv.lse;
      for (size_t j = 0; j < rv.prob.size(); ++j)
        for (int d = 0; d < c.D; ++d)
          f.out[(g * c.Hq + h) * c.D + d] += rv.prob[j] * p.v.at(b0 + j, h / (c.Hq / c.Hkv), d);
    }
  }
  return f;
}

// Dense causal GQA attention, no blocks anywhere: softmax over j <= t of the sequence.
inline RefForward naive_dense(const Problem& p) {
  const Config& c = p.cfg;
  RefForward f{std::vector<double>(p.T * c.Hq * c.D, 0), std::vector<double>(p.T * c.Hq, 0)};
  for (size_t s = 0; s + 1 < p.offsets.size(); ++s)
    for (int64_t t = 0; t < p.offsets[s + 1] - p.offsets[s]; ++t)
      for (int h = 0; h < c.Hq; ++h) {
        const int64_t g = p.offsets[s] + t;
        const int r = h * c.Hkv / c.Hq;
        std::vector<double> w(t + 1);
        for (int64_t j = 0; j <= t; ++j) {
          w[j] = 0;
          for (int d = 0; d < c.D; ++d) w[j] += p.q.at(g, h, d) * p.k.at(p.offsets[s] + j, r, d);
          w[j] *= p.scale();
        }
        const double mx = *std::max_element(w.begin(), w.end());
        double z = 0;
        for (double& x : w) z += (x = std::exp(x - mx));
        f.lse[g * c.Hq + h] = mx + std::log(z);
        for (int64_t j = 0; j <= t; ++j)
          for (int d = 0; d < c.D; ++d) f.out[(g * c.Hq + h) * c.D + d] += w[j] / z * p.v.at(p.offsets[s] + j, r, d);
      }
  return f;
}

// Teacher pi and student sigma of row (g, i) over the sequence's keys (0 outside the support).
// `lse` [T, Hq]: the LSE the teacher's probabilities use (null: computed here).
inline void kl_row(const Problem& p, const Sets& sets, int64_t g, int i, std::vector<double>* pi,
                   std::vector<double>* sigma, std::vector<double>* s_idx,
                   const std::vector<double>* lse = nullptr) {
  const Config& c = p.cfg;
  const int hpi = c.Hq / c.Hi;
  const int64_t b0 = seq_begin(p, g), L = seq_end(p, g) - b0;
  pi->assign(L, 0);
  sigma->assign(L, 0);
  s_idx->assign(L, 0);
  std::vector<char> mask;
  for (int h = i * hpi; h < (i + 1) * hpi; ++h) {
    const RowView rv = main_row(p, sets, g, h, lse != nullptr, lse ? (*lse)[g * c.Hq + h] : 0.0);
    for (int64_t j = 0; j < L; ++j) (*pi)[j] += rv.prob[j] / hpi;
    mask = rv.mask;
  }
  double mx = -INFINITY, z = 0;
  for (int64_t j = 0; j < L; ++j)
    if (mask[j]) mx = std::max(mx, (*s_idx)[j] = index_score(p, g, i, b0 + j));
  for (int64_t j = 0; j < L; ++j)
    if (mask[j]) z += std::exp((*s_idx)[j] - mx);
  for (int64_t j = 0; j < L; ++j)
    if (mask[j]) (*sigma)[j] = std::exp((*s_idx)[j] - mx) / z;
}

inline double ref_kl(const Problem& p, const Sets& sets) {
  double total = 0;
  std::vector<double> pi, sigma, s;
  for (int64_t g = 0; g < p.T; ++g)
    for (int i = 0; i < p.cfg.Hi; ++i) {
      kl_row(p, sets, g, i, &pi, &sigma, &s);
      for (size_t j = 0; j < pi.size(); ++j)
        if (pi[j] > 0) total += pi[j] * std::log(pi[j] / sigma[j]);
    }
  return p.T ? total / (static_cast<double>(p.T) * p.cfg.Hi) : 0.0;
}

// Analytic gradients over explicit masks: dS on every (row, key) pair, then the outer sums.
struct RefGrads {
  std::vector<double> dq, dk, dv, dq_idx, dk_idx;
};

// `given`: the forward's stored out and lse, which the backward takes as its inputs (a backend's
// are rounded to their dtypes); null: the exact forward, computed here.
inline RefGrads ref_backward(const Problem& p, const Sets& sets, const HostTensor& dout, double gamma,
                             const RefForward* given = nullptr) {
  const Config& c = p.cfg;
  RefGrads r{std::vector<double>(p.T * c.Hq * c.D, 0), std::vector<double>(p.T * c.Hkv * c.D, 0),
             std::vector<double>(p.T * c.Hkv * c.D, 0), std::vector<double>(p.T * c.Hi * c.Di, 0),
             std::vector<double>(p.T * c.Hik * c.Di, 0)};
  const RefForward f = given ? *given : ref_forward(p, sets);
  const std::vector<double>* lse = given ? &given->lse : nullptr;
  for (int64_t g = 0; g < p.T; ++g) {
    const int64_t b0 = seq_begin(p, g);
    for (int h = 0; h < c.Hq; ++h) {
      const int rr = h / (c.Hq / c.Hkv);
      const RowView rv = main_row(p, sets, g, h, lse != nullptr, lse ? (*lse)[g * c.Hq + h] : 0.0);
      double delta = 0;
      for (int d = 0; d < c.D; ++d) delta += dout.at(g, h, d) * f.out[(g * c.Hq + h) * c.D + d];
      for (size_t j = 0; j < rv.prob.size(); ++j) {
        if (!rv.mask[j]) continue;
        double dp = 0;
        for (int d = 0; d < c.D; ++d) dp += dout.at(g, h, d) * p.v.at(b0 + j, rr, d);
        const double ds = rv.prob[j] * (dp - delta);
        for (int d = 0; d < c.D; ++d) {
          r.dq[(g * c.Hq + h) * c.D + d] += p.scale() * ds * p.k.at(b0 + j, rr, d);
          r.dk[((b0 + j) * c.Hkv + rr) * c.D + d] += p.scale() * ds * p.q.at(g, h, d);
          r.dv[((b0 + j) * c.Hkv + rr) * c.D + d] += rv.prob[j] * dout.at(g, h, d);
        }
      }
    }
    std::vector<double> pi, sigma, s;
    for (int i = 0; i < c.Hi; ++i) {
      const int ik = i / (c.Hi / c.Hik);
      kl_row(p, sets, g, i, &pi, &sigma, &s, lse);
      for (size_t j = 0; j < pi.size(); ++j) {
        const double ds = gamma / (static_cast<double>(p.T) * c.Hi) * (sigma[j] - pi[j]);
        if (ds == 0) continue;
        for (int d = 0; d < c.Di; ++d) {
          r.dq_idx[(g * c.Hi + i) * c.Di + d] += p.scale_idx() * ds * p.k_idx.at(b0 + j, ik, d);
          r.dk_idx[((b0 + j) * c.Hik + ik) * c.Di + d] += p.scale_idx() * ds * p.q_idx.at(g, i, d);
        }
      }
    }
  }
  return r;
}

}  // namespace msatest
