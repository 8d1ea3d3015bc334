// CPU main attention (docs/contract.md §3), its backward and the KL loss (docs/contract.md §4), in double.
//
// The backward never materialises a T x T (or T x selected) matrix and needs no atomics:
//   pass A, one task per query token: delta = dO.O, dq; the index softmax log-normaliser and dq_idx;
//   pass B, one task per (KV head, key block): dk, dv, from the reverse index of the block;
//   pass C, one task per (index key head, key block): dk_idx, likewise.
// Every sum runs in a fixed order, so the results are bitwise reproducible.
#include <cmath>
#include <limits>
#include <vector>

#include "backend.h"
#include "common.h"
#include "parallel.h"

namespace msa::cpu {
namespace {

template <class E>
struct Main {  // the main-branch tensors of a call
  Rows<const E> q, k, v;
  explicit Main(const TensorRef& q_, const TensorRef& k_, const TensorRef& v_)
      : q(rows<const E>(q_)), k(rows<const E>(k_)) {
    if (v_.defined()) v = rows<const E>(v_);
  }
};

template <class E>
void forward_impl(const Problem& prob, const ForwardParams& p) {
  const Layout layout(prob);
  const Support support(prob, layout, p.block_idx);
  const Main<E> m(p.q, p.k, p.v);
  const Rows<E> out = rows<E>(p.out);
  const Mat lse = mat(p.lse);
  const int32_t D = prob.D, G = prob.group(), Hl = loop_index_heads(prob), hpi = prob.Hq / Hl;
  const double scale = prob.opts.scale;

  parallel_for(prob.T, [&](int64_t g, int) {
    thread_local std::vector<int64_t> keys;
    const int64_t base = layout.cu_k[layout.seq_of[g]];  // key row of position 0
    for (int32_t i = 0; i < Hl; ++i) {
      support.keys(g, i, &keys);
      for (int32_t h = i * hpi; h < (i + 1) * hpi; ++h) {
        const int32_t r = h / G;
        attend_row(D, scale, m.q.row(g, h), keys, [&](int64_t j) { return m.k.row(base + j, r); },
                   [&](int64_t j) { return m.v.row(base + j, r); }, out.row(g, h), &lse.at(g, h));
      }
    }
  });
}

// Per-row KL(pi || sigma) and the total 1/(N*Hi) * sum.
template <class E>
void kl_impl(const Problem& prob, const TensorRef& q_t, const TensorRef& k_t, const TensorRef& lse_t,
             const TensorRef& q_idx_t, const TensorRef& k_idx_t, const TensorRef& block_idx_t,
             const TensorRef& kl_t, const TensorRef& kl_rows_t) {
  const Layout layout(prob);
  const Support support(prob, layout, block_idx_t);
  const Main<E> m(q_t, k_t, TensorRef{});
  const Rows<const E> q_idx = rows<const E>(q_idx_t), k_idx = rows<const E>(k_idx_t);
  const Mat lse = mat(lse_t);
  const int32_t D = prob.D, Di = prob.Di, G = prob.group(), hpi = prob.heads_per_idx();
  const double scale = prob.opts.scale, scale_idx = prob.opts.scale_idx;
  std::vector<double> row_kl(static_cast<size_t>(prob.T) * prob.Hi, 0.0);

  parallel_for(prob.T, [&](int64_t g, int) {
    thread_local std::vector<int64_t> keys;
    thread_local std::vector<double> q, pi, sc;
    const int64_t base = layout.cu_k[layout.seq_of[g]];
    q.resize(std::max(D, Di));
    for (int32_t i = 0; i < prob.Hi; ++i) {
      support.keys(g, i, &keys);
      pi.assign(keys.size(), 0.0);
      sc.resize(keys.size());
      for (int32_t h = i * hpi; h < (i + 1) * hpi; ++h) {
        const double l = lse.at(g, h);
        load(m.q.row(g, h), D, q.data());
        for (size_t j = 0; j < keys.size(); ++j)
          pi[j] += std::exp(scale * dot(q.data(), m.k.row(base + keys[j], h / G), D) - l) / hpi;
      }
      const int32_t ik = i / prob.idx_per_key();
      load(q_idx.row(g, i), Di, q.data());
      for (size_t j = 0; j < keys.size(); ++j) sc[j] = scale_idx * dot(q.data(), k_idx.row(base + keys[j], ik), Di);
      const double lidx = logsumexp(sc.data(), sc.size());
      double acc = 0.0;
      for (size_t j = 0; j < keys.size(); ++j)
        if (pi[j] != 0.0) acc += pi[j] * (std::log(pi[j]) - (sc[j] - lidx));
      row_kl[static_cast<size_t>(g) * prob.Hi + i] = acc;
    }
  });
  double total = 0.0;
  for (double x : row_kl) total += x;
  static_cast<float*>(kl_t.data)[0] =
      prob.T > 0 ? static_cast<float>(total / (static_cast<double>(prob.T) * prob.Hi)) : 0.f;
  if (kl_rows_t.defined()) {
    const Mat kr = mat(kl_rows_t);
    for (int64_t g = 0; g < prob.T; ++g)
      for (int32_t i = 0; i < prob.Hi; ++i) kr.at(g, i) = static_cast<float>(row_kl[static_cast<size_t>(g) * prob.Hi + i]);
  }
}

template <class E>
void backward_impl(const Problem& prob, const BackwardParams& p) {
  const Layout layout(prob);
  const Support support(prob, layout, p.block_idx);
  const Main<E> m(p.q, p.k, p.v);
  const Rows<const E> out = rows<const E>(p.out), dout = rows<const E>(p.dout);
  const Mat lse = mat(p.lse);
  const Rows<E> dq = rows<E>(p.dq), dk = rows<E>(p.dk), dv = rows<E>(p.dv);
  const int32_t D = prob.D, G = prob.group(), Hq = prob.Hq, Bk = prob.opts.block_size;
  const int32_t Hl = loop_index_heads(prob), hpi = Hq / Hl;
  const double scale = prob.opts.scale, scale_idx = prob.opts.scale_idx;
  const int64_t nb = layout.num_blocks();

  const bool kl = p.dq_idx.defined() || p.dk_idx.defined();
  const int32_t Di = prob.Di;
  Rows<const E> q_idx, k_idx;
  if (kl) {
    q_idx = rows<const E>(p.q_idx);
    k_idx = rows<const E>(p.k_idx);
  }
  const double gamma =
      static_cast<double>(p.kl_weight) * (p.kl_grad.defined() ? static_cast<const float*>(p.kl_grad.data)[0] : 1.0);
  const double coef = prob.T > 0 && kl ? gamma / (static_cast<double>(prob.T) * prob.Hi) : 0.0;

  std::vector<double> delta(static_cast<size_t>(prob.T) * Hq);
  std::vector<double> lse_idx(kl ? static_cast<size_t>(prob.T) * prob.Hi : 0);

  // Pass A: per query token.
  parallel_for(prob.T, [&](int64_t g, int) {
    thread_local std::vector<int64_t> keys;
    thread_local std::vector<double> q, o, acc, pi, sc;
    const int64_t base = layout.cu_k[layout.seq_of[g]];
    q.resize(std::max(D, Di));
    o.resize(D);
    acc.resize(std::max(D, Di));
    for (int32_t i = 0; i < Hl; ++i) {
      support.keys(g, i, &keys);
      if (kl) pi.assign(keys.size(), 0.0);
      for (int32_t h = i * hpi; h < (i + 1) * hpi; ++h) {
        const int32_t r = h / G;
        load(m.q.row(g, h), D, q.data());
        load(dout.row(g, h), D, o.data());  // o holds dO
        const double dl = dot(o.data(), out.row(g, h), D);
        delta[static_cast<size_t>(g) * Hq + h] = dl;
        const double l = lse.at(g, h);
        std::fill(acc.begin(), acc.begin() + D, 0.0);
        for (size_t j = 0; j < keys.size(); ++j) {
          const E* kj = m.k.row(base + keys[j], r);
          const double P = std::exp(scale * dot(q.data(), kj, D) - l);
          const double dS = P * (dot(o.data(), m.v.row(base + keys[j], r), D) - dl);
          axpy(scale * dS, kj, D, acc.data());
          if (kl) pi[j] += P / hpi;
        }
        store(acc.data(), D, dq.row(g, h));
      }
      if (!kl) continue;
      const int32_t ik = i / prob.idx_per_key();
      load(q_idx.row(g, i), Di, q.data());
      sc.resize(keys.size());
      for (size_t j = 0; j < keys.size(); ++j) sc[j] = scale_idx * dot(q.data(), k_idx.row(base + keys[j], ik), Di);
      const double lidx = logsumexp(sc.data(), sc.size());
      lse_idx[static_cast<size_t>(g) * prob.Hi + i] = lidx;
      if (!p.dq_idx.defined()) continue;
      std::fill(acc.begin(), acc.begin() + Di, 0.0);
      for (size_t j = 0; j < keys.size(); ++j)
        axpy(scale_idx * coef * (std::exp(sc[j] - lidx) - pi[j]), k_idx.row(base + keys[j], ik), Di, acc.data());
      store(acc.data(), Di, rows<E>(p.dq_idx).row(g, i));
    }
  });

  // Pass B: per (KV head, key block): dk, dv over the rows whose support holds the block.
  parallel_for(prob.Hkv * nb, [&](int64_t task, int) {
    thread_local std::vector<int64_t> trows;
    thread_local std::vector<double> q, o, dk_acc, dv_acc;
    const int32_t r = static_cast<int32_t>(task / nb);
    const int64_t gb = task % nb, s = layout.seq_of_block[gb], base = layout.cu_k[s];
    const int64_t j0 = (gb - layout.block_base[s]) * Bk, j1 = std::min<int64_t>(j0 + Bk, layout.key_len(s));
    q.resize(D);
    o.resize(D);
    dk_acc.assign((j1 - j0) * D, 0.0);
    dv_acc.assign((j1 - j0) * D, 0.0);
    for (int32_t h = r * G; h < (r + 1) * G; ++h) {
      support.rows_of_block(h / hpi, gb, &trows);
      for (int64_t t : trows) {
        const int64_t g = layout.query_row(s, t);
        load(m.q.row(g, h), D, q.data());
        load(dout.row(g, h), D, o.data());
        const double l = lse.at(g, h), dl = delta[static_cast<size_t>(g) * Hq + h];
        for (int64_t j = j0; j < std::min(j1, t + 1); ++j) {
          const double P = std::exp(scale * dot(q.data(), m.k.row(base + j, r), D) - l);
          const double dS = P * (dot(o.data(), m.v.row(base + j, r), D) - dl);
          for (int32_t d = 0; d < D; ++d) {
            dk_acc[(j - j0) * D + d] += scale * dS * q[d];
            dv_acc[(j - j0) * D + d] += P * o[d];
          }
        }
      }
    }
    for (int64_t j = j0; j < j1; ++j) {
      store(&dk_acc[(j - j0) * D], D, dk.row(base + j, r));
      store(&dv_acc[(j - j0) * D], D, dv.row(base + j, r));
    }
  });

  if (!p.dk_idx.defined()) return;
  // Pass C: per (index key head, key block): dk_idx.
  const Rows<E> dk_idx = rows<E>(p.dk_idx);
  const int32_t ipk = prob.idx_per_key();
  parallel_for(prob.Hik * nb, [&](int64_t task, int) {
    thread_local std::vector<int64_t> trows;
    thread_local std::vector<double> qi, qh, acc;
    const int32_t ik = static_cast<int32_t>(task / nb);
    const int64_t gb = task % nb, s = layout.seq_of_block[gb], base = layout.cu_k[s];
    const int64_t j0 = (gb - layout.block_base[s]) * Bk, j1 = std::min<int64_t>(j0 + Bk, layout.key_len(s));
    qi.resize(Di);
    qh.resize(static_cast<size_t>(hpi) * D);
    acc.assign((j1 - j0) * Di, 0.0);
    for (int32_t i = ik * ipk; i < (ik + 1) * ipk; ++i) {
      support.rows_of_block(i, gb, &trows);
      for (int64_t t : trows) {
        const int64_t g = layout.query_row(s, t);
        load(q_idx.row(g, i), Di, qi.data());
        for (int32_t x = 0; x < hpi; ++x) load(m.q.row(g, i * hpi + x), D, &qh[static_cast<size_t>(x) * D]);
        const double lidx = lse_idx[static_cast<size_t>(g) * prob.Hi + i];
        for (int64_t j = j0; j < std::min(j1, t + 1); ++j) {
          double pi = 0.0;
          for (int32_t x = 0; x < hpi; ++x) {
            const int32_t h = i * hpi + x;
            pi += std::exp(scale * dot(&qh[static_cast<size_t>(x) * D], m.k.row(base + j, h / G), D) - lse.at(g, h)) / hpi;
          }
          const double sigma = std::exp(scale_idx * dot(qi.data(), k_idx.row(base + j, ik), Di) - lidx);
          const double dS = coef * (sigma - pi);
          for (int32_t d = 0; d < Di; ++d) acc[(j - j0) * Di + d] += scale_idx * dS * qi[d];
        }
      }
    }
    for (int64_t j = j0; j < j1; ++j) store(&acc[(j - j0) * Di], Di, dk_idx.row(base + j, ik));
  });
}

template <class E> struct ForwardFn { static void run(const Problem& pr, const ForwardParams& p) { forward_impl<E>(pr, p); } };
template <class E> struct BackwardFn { static void run(const Problem& pr, const BackwardParams& p) { backward_impl<E>(pr, p); } };
template <class E> struct KlFn {
  static void run(const Problem& pr, const KlParams& p) {
    kl_impl<E>(pr, p.q, p.k, p.lse, p.q_idx, p.k_idx, p.block_idx, p.kl, p.kl_rows);
  }
};

}  // namespace

Status attention_forward(const Problem& prob, const ForwardParams& p) {
  return dispatch<ForwardFn>(prob.dtype, prob, p);
}

Status attention_backward(const Problem& prob, const BackwardParams& p) {
  return dispatch<BackwardFn>(prob.dtype, prob, p);
}

Status kl_divergence(const Problem& prob, const KlParams& p) {
  return dispatch<KlFn>(prob.dtype, prob, p);
}

}  // namespace msa::cpu
