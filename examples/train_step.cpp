// A minimal MSA training step through the C++ API (CPU tensors): selection, forward with the
// exact KL value, backward with the KL gradient; then a check of the results against a small
// double-precision computation written here from the contract (docs/contract.md). Built as `msa_example` and run by
// the tests (it exits with status 1 on a mismatch); the README quotes it.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <random>
#include <vector>

#include "msa/msa.h"

int main() {
  const int64_t T = 1024;  // two sequences of 512 tokens
  const int Hq = 8, Hkv = 2, D = 64, Hi = 2, Hik = 1, Di = 64, k = 4;
  std::mt19937 rng(0);
  std::uniform_real_distribution<float> u(-1.f, 1.f);
  auto make = [&](int64_t n) { std::vector<float> x(n); for (float& e : x) e = u(rng); return x; };
  std::vector<float> q = make(T * Hq * D), kk = make(T * Hkv * D), v = make(T * Hkv * D);
  std::vector<float> q_idx = make(T * Hi * Di), k_idx = make(T * Hik * Di), dout = make(T * Hq * D);
  std::vector<int32_t> cu = {0, 512, 1024}, block_idx(T * Hi * k);
  std::vector<float> out(T * Hq * D), lse(T * Hq), kl(1);
  std::vector<float> dq(q.size()), dk(kk.size()), dv(v.size()), dq_idx(q_idx.size()), dk_idx(k_idx.size());
  using msa::DType;
  using msa::make_tensor;

  msa::Options opts;
  opts.block_size = 64;
  opts.top_k = k;

  msa::ForwardParams f;  // selection + sparse attention + exact KL in one call
  f.q = make_tensor(q.data(), DType::kFloat32, {T, Hq, D});
  f.k = make_tensor(kk.data(), DType::kFloat32, {T, Hkv, D});
  f.v = make_tensor(v.data(), DType::kFloat32, {T, Hkv, D});
  f.q_idx = make_tensor(q_idx.data(), DType::kFloat32, {T, Hi, Di});
  f.k_idx = make_tensor(k_idx.data(), DType::kFloat32, {T, Hik, Di});
  f.cu_seqlens = make_tensor(cu.data(), DType::kInt32, {3});
  f.block_idx = make_tensor(block_idx.data(), DType::kInt32, {T, Hi, k});
  f.select = true;
  f.out = make_tensor(out.data(), DType::kFloat32, {T, Hq, D});
  f.lse = make_tensor(lse.data(), DType::kFloat32, {T, Hq});
  f.kl = make_tensor(kl.data(), DType::kFloat32, {1});
  f.opts = opts;
  if (msa::Status s = msa::forward(f); !s.ok()) {
    std::fprintf(stderr, "%s\n", s.message.c_str());
    return 1;
  }

  msa::BackwardParams b;
  b.q = f.q; b.k = f.k; b.v = f.v; b.out = f.out; b.lse = f.lse;
  b.cu_seqlens = f.cu_seqlens; b.block_idx = f.block_idx;
  b.dout = make_tensor(dout.data(), DType::kFloat32, {T, Hq, D});
  b.dq = make_tensor(dq.data(), DType::kFloat32, {T, Hq, D});
  b.dk = make_tensor(dk.data(), DType::kFloat32, {T, Hkv, D});
  b.dv = make_tensor(dv.data(), DType::kFloat32, {T, Hkv, D});
  b.q_idx = f.q_idx; b.k_idx = f.k_idx;
  b.dq_idx = make_tensor(dq_idx.data(), DType::kFloat32, {T, Hi, Di});
  b.dk_idx = make_tensor(dk_idx.data(), DType::kFloat32, {T, Hik, Di});
  b.kl_weight = 1.0f;  // gamma: the KL's weight in the total loss
  b.opts = opts;
  if (msa::Status s = msa::backward(b); !s.ok()) {
    std::fprintf(stderr, "%s\n", s.message.c_str());
    return 1;
  }

  double norm = 0;
  for (float g : dq_idx) norm += double(g) * g;
  std::printf("kl = %.6f, |dq_idx| = %.3e, token 700 head 0 selects blocks", kl[0], std::sqrt(norm));
  for (int j = 0; j < k; ++j) std::printf(" %d", block_idx[(700 * Hi + 0) * k + j]);
  std::printf("\n");

  // Check the values. out and lse: softmax attention in double over the causal keys of the
  // selected blocks (docs/contract.md §3), for every token and head. dv: every softmax row sums to 1, so
  // the dv rows of a KV head sum to the dout rows of the query heads it serves.
  const int Bk = opts.block_size;
  const double scale = 1.0 / std::sqrt(double(D));
  double err_out = 0, err_lse = 0;
  std::vector<double> s, o(D);
  for (int64_t t = 0; t < T; ++t) {
    const int64_t base = t < cu[1] ? cu[0] : cu[1], pos = t - base;  // sequence start, position
    for (int h = 0; h < Hq; ++h) {
      const int i = h / (Hq / Hi), r = h / (Hq / Hkv);  // index head, KV head
      std::vector<int64_t> keys;  // positions in the sequence
      for (int j = 0; j < k; ++j) {
        const int64_t b = block_idx[(t * Hi + i) * k + j];  // -1: an empty slot
        for (int64_t x = b * Bk; b >= 0 && x < (b + 1) * Bk && x <= pos; ++x) keys.push_back(x);
      }
      s.assign(keys.size(), 0.0);
      for (size_t j = 0; j < keys.size(); ++j) {
        for (int d = 0; d < D; ++d) s[j] += double(q[(t * Hq + h) * D + d]) * kk[((base + keys[j]) * Hkv + r) * D + d];
        s[j] *= scale;
      }
      const double mx = *std::max_element(s.begin(), s.end());
      double z = 0;
      for (double x : s) z += std::exp(x - mx);
      const double l = mx + std::log(z);
      std::fill(o.begin(), o.end(), 0.0);
      for (size_t j = 0; j < keys.size(); ++j)
        for (int d = 0; d < D; ++d) o[d] += std::exp(s[j] - l) * v[((base + keys[j]) * Hkv + r) * D + d];
      for (int d = 0; d < D; ++d) err_out = std::max(err_out, std::fabs(o[d] - out[(t * Hq + h) * D + d]));
      err_lse = std::max(err_lse, std::fabs(l - lse[t * Hq + h]));
    }
  }
  double err_dv = 0;
  for (int r = 0; r < Hkv; ++r)
    for (int d = 0; d < D; ++d) {
      double sum_dv = 0, sum_dout = 0;
      for (int64_t t = 0; t < T; ++t) sum_dv += dv[(t * Hkv + r) * D + d];
      for (int64_t t = 0; t < T; ++t)
        for (int h = r * (Hq / Hkv); h < (r + 1) * (Hq / Hkv); ++h) sum_dout += dout[(t * Hq + h) * D + d];
      err_dv = std::max(err_dv, std::fabs(sum_dv - sum_dout) / T);
    }
  // Outputs are float32: their rounding and that of lse allow errors near 1e-7 and 1e-6.
  if (!(err_out < 1e-5 && err_lse < 1e-5 && err_dv < 1e-5)) {
    std::printf("MISMATCH with the double-precision reference: max |out error| = %.2e, max |lse error| = "
                "%.2e, dv sums vs dout sums = %.2e per token\n", err_out, err_lse, err_dv);
    return 1;
  }
  std::printf("values match the double-precision reference: max |out error| = %.1e, max |lse error| = "
              "%.1e, dv sums vs dout sums = %.1e per token\n", err_out, err_lse, err_dv);

  // Bad input is rejected with a message naming the argument.
  f.k.shape[2] = 32;
  std::printf("%s\n", msa::forward(f).message.c_str());
  return 0;
}
