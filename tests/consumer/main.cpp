// Uses the installed library through its public headers only (see CMakeLists.txt). On the CPU
// backend, for two packed sequences: with top_k covering every block, the selection is every
// causal block in ascending order and sparse attention equals dense (warmup) attention; a bad
// argument gets a Status that names it. Exits non-zero on any failure.
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <random>
#include <string>
#include <vector>

#include "msa/msa.h"

namespace {

int failures = 0;

void expect(bool good, const std::string& what) {
  if (!good) {
    std::fprintf(stderr, "msa_consumer: FAILED: %s\n", what.c_str());
    ++failures;
  }
}

}  // namespace

int main() {
  const int64_t L0 = 200, L1 = 184, T = L0 + L1;  // blocks per sequence: 4 and 3
  const int Hq = 4, Hkv = 2, D = 64, Hi = 2, Hik = 1, Di = 64, Bk = 64, k = 4;
  using msa::DType;
  using msa::make_tensor;

  std::mt19937 rng(7);
  std::normal_distribution<float> normal(0.f, 1.f);
  auto randn = [&](int64_t n) {
    std::vector<float> x(n);
    for (float& e : x) e = normal(rng);
    return x;
  };
  std::vector<float> q = randn(T * Hq * D), kk = randn(T * Hkv * D), v = randn(T * Hkv * D);
  std::vector<float> q_idx = randn(T * Hi * Di), k_idx = randn(T * Hik * Di);
  std::vector<int32_t> cu = {0, static_cast<int32_t>(L0), static_cast<int32_t>(T)};
  std::vector<int32_t> block_idx(T * Hi * k, -7);
  std::vector<float> out_sparse(T * Hq * D), lse_sparse(T * Hq), out_dense(T * Hq * D), lse_dense(T * Hq);

  expect(msa::backend_available(msa::DeviceType::kCpu), "the CPU backend is available");

  // Selection and sparse attention in one call.
  msa::ForwardParams f;
  f.q = make_tensor(q.data(), DType::kFloat32, {T, Hq, D});
  f.k = make_tensor(kk.data(), DType::kFloat32, {T, Hkv, D});
  f.v = make_tensor(v.data(), DType::kFloat32, {T, Hkv, D});
  f.q_idx = make_tensor(q_idx.data(), DType::kFloat32, {T, Hi, Di});
  f.k_idx = make_tensor(k_idx.data(), DType::kFloat32, {T, Hik, Di});
  f.cu_seqlens = make_tensor(cu.data(), DType::kInt32, {3});
  f.block_idx = make_tensor(block_idx.data(), DType::kInt32, {T, Hi, k});
  f.select = true;
  f.out = make_tensor(out_sparse.data(), DType::kFloat32, {T, Hq, D});
  f.lse = make_tensor(lse_sparse.data(), DType::kFloat32, {T, Hq});
  f.opts.block_size = Bk;
  f.opts.top_k = k;
  msa::Status s = msa::forward(f);
  expect(s.ok(), "sparse forward: " + s.message);

  // Every row selects exactly its causal blocks 0..blk(t), ascending, then -1 padding.
  auto check_selection = [&]() -> std::string {
    for (int64_t g = 0; g < T; ++g) {
      const int64_t t = g < L0 ? g : g - L0;
      const int own = static_cast<int>(t / Bk);
      for (int i = 0; i < Hi; ++i)
        for (int j = 0; j < k; ++j) {
          const int32_t got = block_idx[(g * Hi + i) * k + j];
          const int32_t want = j <= own ? j : -1;
          if (got != want)
            return "block_idx[" + std::to_string(g) + ", " + std::to_string(i) + ", " +
                   std::to_string(j) + "] = " + std::to_string(got) + ", expected " +
                   std::to_string(want);
        }
    }
    return "";
  };
  if (s.ok()) {
    const std::string bad_row = check_selection();
    expect(bad_row.empty(), bad_row);
  }

  // The warmup variant: dense causal attention over the same tensors.
  msa::ForwardParams d = f;
  d.opts.mode = msa::Mode::kDense;
  d.select = false;
  d.block_idx = msa::TensorRef{};
  d.q_idx = d.k_idx = msa::TensorRef{};
  d.out = make_tensor(out_dense.data(), DType::kFloat32, {T, Hq, D});
  d.lse = make_tensor(lse_dense.data(), DType::kFloat32, {T, Hq});
  s = msa::forward(d);
  expect(s.ok(), "dense forward: " + s.message);

  double max_out = 0, max_lse = 0;
  for (size_t e = 0; e < out_sparse.size(); ++e)
    max_out = std::fmax(max_out, std::fabs(double(out_sparse[e]) - out_dense[e]));
  for (size_t e = 0; e < lse_sparse.size(); ++e)
    max_lse = std::fmax(max_lse, std::fabs(double(lse_sparse[e]) - lse_dense[e]));
  expect(max_out <= 1e-5 && max_lse <= 1e-5,
         "sparse attention over every block differs from dense attention: max |d out| = " +
             std::to_string(max_out) + ", max |d lse| = " + std::to_string(max_lse));

  // A bad argument: k with the wrong head dim.
  msa::ForwardParams bad = f;
  bad.k.shape[2] = D / 2;
  s = msa::forward(bad);
  expect(s.code == msa::StatusCode::kInvalidArgument &&
             s.message.find("argument 'k'") != std::string::npos,
         "a bad 'k' is rejected with a message naming it, got: '" + s.message + "'");

  if (failures) {
    std::fprintf(stderr, "msa_consumer: %d check(s) failed\n", failures);
    return 1;
  }
  std::printf("msa_consumer: ok (msa %s: selection, sparse == dense with every block selected, "
              "max |d out| = %.1e; bad 'k' rejected)\n",
              msa::version(), max_out);
  return 0;
}
