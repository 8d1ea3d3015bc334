// A minimal MSA training step through the C++ API (CPU tensors): selection, forward with the
// exact KL value, backward with the KL gradient. Built as `msa_example`; the README quotes it.
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

  // Bad input is rejected with a message naming the argument.
  f.k.shape[2] = 32;
  std::printf("%s\n", msa::forward(f).message.c_str());
  return 0;
}
