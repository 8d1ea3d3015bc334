// The validated shape of one call: sizes read off the tensors, options with defaults resolved,
// and the sequence offsets. Built by src/api/validate.cpp, consumed by the backends. Part of the
// core that src/api, src/cpu and src/cuda all stand on; it includes none of them.
#pragma once

#include <cstdint>
#include <vector>

#include "msa/params.h"
#include "status.h"

namespace msa::detail {

struct Problem {
  int64_t T = 0;  // packed tokens
  int32_t Hq = 0, Hkv = 0, D = 0;
  int32_t Hi = 0, Hik = 0, Di = 0;  // 0 when no index tensors take part
  int32_t k = 0;                    // block_idx width (kSparse), or top_k when selecting
  DType dtype = DType::kFloat32;    // dtype of q (or of q_idx for select_blocks)
  Options opts;                     // scale and scale_idx resolved (never 0)
  // Sequence offsets, cu[s]..cu[s+1]; a single sequence [0, T] when cu_seqlens is absent.
  // Read on the host: available for CPU tensors only (empty for CUDA).
  std::vector<int64_t> cu;
  // Keys apart from queries (cu_seqlens_k given): Tk key rows, and on the CPU their offsets
  // cu_k (else Tk = T and cu_k = cu).
  bool keys_apart = false;
  int64_t Tk = 0;
  std::vector<int64_t> cu_k;

  int32_t group() const { return Hq / Hkv; }               // G: query heads per KV head
  int32_t heads_per_idx() const { return Hq / Hi; }        // query heads per index head
  int32_t idx_per_key() const { return Hi / Hik; }         // index heads per index key head
  int64_t num_seqs() const { return static_cast<int64_t>(cu.size()) - 1; }
};

// The KL value a forward call asks for (ForwardParams.kl): a kl_divergence call over the
// forward's own tensors, support and launch.
inline KlParams kl_params_of(const ForwardParams& p) {
  KlParams kp;
  kp.q = p.q;
  kp.k = p.k;
  kp.lse = p.lse;
  kp.q_idx = p.q_idx;
  kp.k_idx = p.k_idx;
  kp.cu_seqlens = p.cu_seqlens;
  kp.cu_seqlens_k = p.cu_seqlens_k;
  kp.block_idx = p.block_idx;
  kp.kl = p.kl;
  kp.opts = p.opts;
  kp.launch = p.launch;
  return kp;
}

}  // namespace msa::detail
