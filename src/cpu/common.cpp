#include "common.h"

#include <cmath>
#include <limits>

namespace msa::cpu {

Layout::Layout(const Problem& prob) : cu(prob.cu), cu_k(prob.cu_k), Bk(prob.opts.block_size) {
  const int64_t nseq = prob.num_seqs();
  seq_of.resize(prob.T);
  block_base.assign(nseq + 1, 0);
  for (int64_t s = 0; s < nseq; ++s) {
    for (int64_t g = cu[s]; g < cu[s + 1]; ++g) seq_of[g] = static_cast<int32_t>(s);
    block_base[s + 1] = block_base[s] + (key_len(s) + Bk - 1) / Bk;
  }
  seq_of_block.resize(num_blocks());
  for (int64_t s = 0; s < nseq; ++s)
    for (int64_t gb = block_base[s]; gb < block_base[s + 1]; ++gb) seq_of_block[gb] = static_cast<int32_t>(s);
}

Support::Support(const Problem& prob, const Layout& layout, const TensorRef& block_idx)
    : layout_(layout), dense_(prob.opts.mode == Mode::kDense) {
  if (dense_) return;
  k_ = prob.k;
  bi_ = static_cast<const int32_t*>(block_idx.data);
  s0_ = block_idx.stride[0];
  s1_ = block_idx.stride[1];
  s2_ = block_idx.stride[2];
  // Counting sort of (row, block) pairs into (i, gb) buckets; rows come out ascending.
  const int64_t nb = layout.num_blocks();
  rev_ptr_.assign(static_cast<size_t>(prob.Hi) * nb + 1, 0);
  auto for_each = [&](auto&& fn) {
    for (int64_t g = 0; g < prob.T; ++g) {
      const int32_t s = layout.seq_of[g];
      for (int32_t i = 0; i < prob.Hi; ++i)
        for (int32_t j = 0; j < k_; ++j) {
          const int32_t b = bi_[g * s0_ + i * s1_ + j * s2_];
          if (b >= 0) fn(static_cast<size_t>(i) * nb + layout.block_base[s] + b, layout.pos(g));
        }
    }
  };
  for_each([&](size_t bucket, int64_t) { ++rev_ptr_[bucket + 1]; });
  for (size_t x = 1; x < rev_ptr_.size(); ++x) rev_ptr_[x] += rev_ptr_[x - 1];
  rev_rows_.resize(rev_ptr_.back());
  std::vector<int64_t> fill(rev_ptr_.begin(), rev_ptr_.end() - 1);
  for_each([&](size_t bucket, int64_t t) { rev_rows_[fill[bucket]++] = static_cast<int32_t>(t); });
}

void Support::blocks(int64_t g, int32_t i, std::vector<int32_t>* out) const {
  out->clear();
  const int64_t t = layout_.pos(g);
  const int32_t own = static_cast<int32_t>(t / layout_.Bk);
  if (dense_) {
    for (int32_t b = 0; b <= own; ++b) out->push_back(b);
    return;
  }
  for (int32_t j = 0; j < k_; ++j) {
    const int32_t b = bi_[g * s0_ + i * s1_ + j * s2_];
    if (b >= 0) out->push_back(b);
  }
  std::sort(out->begin(), out->end());
}

void Support::keys(int64_t g, int32_t i, std::vector<int64_t>* out) const {
  thread_local std::vector<int32_t> blk;
  blocks(g, i, &blk);
  keys_of_blocks(blk, layout_.pos(g), layout_.Bk, out);
}

void keys_of_blocks(const std::vector<int32_t>& blocks, int64_t t, int32_t Bk, std::vector<int64_t>* out) {
  out->clear();
  for (int32_t b : blocks) {
    const int64_t end = std::min<int64_t>(static_cast<int64_t>(b + 1) * Bk, t + 1);
    for (int64_t j = static_cast<int64_t>(b) * Bk; j < end; ++j) out->push_back(j);
  }
}

void Support::rows_of_block(int32_t i, int64_t gb, std::vector<int64_t>* out) const {
  out->clear();
  if (dense_) {
    const int64_t s = layout_.seq_of_block[gb];
    const int64_t b = gb - layout_.block_base[s];
    for (int64_t t = std::max(b * layout_.Bk, layout_.start(s)); t < layout_.key_len(s); ++t) out->push_back(t);
    return;
  }
  const int64_t nb = layout_.num_blocks();
  const size_t bucket = static_cast<size_t>(i) * nb + gb;
  for (int64_t x = rev_ptr_[bucket]; x < rev_ptr_[bucket + 1]; ++x) out->push_back(rev_rows_[x]);
}

float fp8_scale(float amax) { return amax > 0.f && std::isfinite(amax) ? 16.f / amax : 1.f; }

double fp8_value(float x, float s) {
  const float y = x * s;
  return to_double(e4m3_from_double(static_cast<double>(y))) / static_cast<double>(s);
}

void choose_blocks(const Options& o, int32_t k, int64_t t, const std::vector<double>& rank,
                   const std::vector<double>* rerank, int32_t m, std::vector<int32_t>* chosen) {
  thread_local std::vector<int32_t> cand;
  const int32_t own = static_cast<int32_t>(t / o.block_size);
  // Forced: the last `local_blocks` blocks up to the own block, and the first `sink_blocks`.
  chosen->clear();
  const int32_t first_local = std::max(0, own - o.local_blocks + 1);
  for (int32_t b = 0; b < std::min(o.sink_blocks, first_local); ++b) chosen->push_back(b);
  for (int32_t b = first_local; b <= own; ++b) chosen->push_back(b);
  // Candidates: every other block before the own block.
  cand.clear();
  for (int32_t b = std::min(o.sink_blocks, first_local); b < first_local; ++b) cand.push_back(b);
  const size_t slots = static_cast<size_t>(std::max<int64_t>(0, int64_t(k) - int64_t(chosen->size())));
  const auto by = [](const std::vector<double>& sc) {
    return [&sc](int32_t a, int32_t b) { return sc[a] > sc[b] || (sc[a] == sc[b] && a < b); };
  };
  // With rerank and fp8_rerank_slots = a in (0, slots): the best (slots - a) by `rank` are kept,
  // the next (a + m) are the shortlist for the last a slots.
  const size_t a = static_cast<size_t>(o.fp8_rerank_slots);
  const size_t keep = rerank != nullptr && cand.size() > slots && a > 0 && a < slots ? slots - a : 0;
  if (rerank != nullptr && cand.size() > slots + m) {  // the shortlist (the kept ones first)
    std::partial_sort(cand.begin(), cand.begin() + slots + m, cand.end(), by(rank));
    cand.resize(slots + m);
  } else if (keep > 0) {
    std::sort(cand.begin(), cand.end(), by(rank));
  }
  chosen->insert(chosen->end(), cand.begin(), cand.begin() + keep);
  cand.erase(cand.begin(), cand.begin() + keep);
  const size_t left = slots - keep;
  const std::vector<double>& final_rank = rerank != nullptr ? *rerank : rank;
  if (cand.size() > left) {
    std::partial_sort(cand.begin(), cand.begin() + left, cand.end(), by(final_rank));
    cand.resize(left);
  }
  chosen->insert(chosen->end(), cand.begin(), cand.end());
  std::sort(chosen->begin(), chosen->end());
}

void write_row(const std::vector<int32_t>& chosen, int32_t k, int32_t* out, int64_t stride) {
  for (int32_t j = 0; j < k; ++j) out[j * stride] = j < static_cast<int32_t>(chosen.size()) ? chosen[j] : -1;
}

double support_logsumexp(const std::vector<double>& score, const std::vector<int32_t>& chosen, int64_t t,
                         int32_t Bk) {
  thread_local std::vector<double> support;
  support.clear();
  for (int32_t b : chosen) {
    const int64_t end = std::min<int64_t>(static_cast<int64_t>(b + 1) * Bk, t + 1);
    for (int64_t j = static_cast<int64_t>(b) * Bk; j < end; ++j) support.push_back(score[j]);
  }
  return logsumexp(support.data(), support.size());
}

double logsumexp(const double* x, size_t n) {
  if (n == 0) return -std::numeric_limits<double>::infinity();
  double m = x[0];
  for (size_t j = 1; j < n; ++j) {
    if (std::isnan(x[j])) return x[j];
    m = std::max(m, x[j]);
  }
  if (std::isnan(m)) return m;
  if (std::isinf(m)) return m;  // all -inf (or some +inf): the sum is exp(m) in the limit
  double sum = 0.0;
  for (size_t j = 0; j < n; ++j) sum += std::exp(x[j] - m);
  return m + std::log(sum);
}

}  // namespace msa::cpu
