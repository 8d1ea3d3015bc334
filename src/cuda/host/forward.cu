// Entry points of the Hopper backend's forward side: selection (docs/contract.md §2) and attention forward
// (docs/contract.md §3, §5). Each call: the kernels' limits (plan.h), the value checks of GPU inputs
// (check_values.h), the Args once, then one dispatch per kernel (variants.h).
#include <cuda_runtime.h>

#include <algorithm>

#include "../backend.h"
#include "../kernels/pass_choice_kernel.cuh"
#include "check_values.h"
#include "common.h"
#include "launch.h"
#include "plan.h"
#include "reverse_index.h"
#include "variants.h"

namespace msa::cuda {
namespace {

Status run_select(const char* fn, const Problem& prob, const SelectArgs& a, DType dt,
                  cudaStream_t stream) {
  return dispatch(fn, "q_idx", dt, prob.Di, prob.opts.block_size, [&](auto v) {
    using V = decltype(v);
    return launch_select<typename V::Element, V::kDim, V::kBlockN>(a, stream);
  });
}

// The split's marks (p.split.taken of `a`) and kAuto's sums that choose between the plain query
// tiles and the split (device/pass_choice.cuh), zeroed then summed over the query tiles of `a`
// into the plan's workspace; returns them through *sums.
Status choose_pass(const char* fn, const Problem& prob, const FwdArgs& a, const Plan& pl, void* ws,
                   cudaStream_t stream, const unsigned long long** sums) {
  auto* s = at<unsigned long long>(ws, pl.choice);
  auto* seen = at<uint32_t>(ws, pl.items_seen);
  cudaError_t e = cudaMemsetAsync(s, 0, 2 * sizeof(unsigned long long), stream);
  if (e == cudaSuccess) e = cudaMemsetAsync(seen, 0, pl.items_seen_bytes(), stream);
  if (e != cudaSuccess) return cuda_error(fn, e);
  // A byte per block and the staged rows, per warp.
  const size_t per_warp = 32 * size_t(std::max(a.uni.bitmap_words, 1)) + 4 * size_t(kern::kChoiceStage);
  const int warps = static_cast<int>(std::clamp<size_t>((96 << 10) / per_warp, 1, 8));
  const size_t smem = warps * per_warp;
  e = cudaFuncSetAttribute(kern::pass_choice_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                           static_cast<int>(smem));
  if (e != cudaSuccess) return cuda_error(fn, e);
  const int64_t n = a.num_tiles * a.Hi;
  const unsigned blocks = static_cast<unsigned>((n + warps - 1) / warps);
  launch_grid(kern::pass_choice_kernel, blocks, 32 * warps, smem, stream, a, prob.opts.block_size, s, seen);
  e = cudaGetLastError();
  if (e != cudaSuccess) return cuda_error(fn, e);
  *sums = s;
  return Status::Ok();
}

}  // namespace

// The sparse forward in passes of pl.fwd_tokens tokens over the caller's or the just-made
// selection, by the KV-block pass (Options.fwd_pass = kKvBlock: per pass the reverse index of its
// rows, its work list, the partials and their combine), the split (kSplit: pass_choice_kernel
// marks the entries of the blocks the query tiles keep; per pass the KV-block pass over the
// other entries, then the query tiles holding the pass's tokens, which merge its partials), or
// kAuto (the sums of the same kernel pick the split or the plain query tiles on the device; the
// kernels of the other return at once).
Status run_forward_passes(const char* fn, const Problem& prob, DType dt, FwdKvArgs a, FwdArgs q,
                          const TensorRef& block_idx, const Plan& pl, bool split, bool automatic,
                          void* ws, cudaStream_t stream) {
  a.part_o = at<void>(ws, pl.part_o);
  a.part_ml = at<float>(ws, pl.part_ml);
  uint8_t* taken = nullptr;
  if (split || automatic) {
    taken = at<uint8_t>(ws, pl.taken);
    q.split.part_o = a.part_o;
    q.split.part_ml = a.part_ml;
    q.split.taken = taken;
    q.split.share_min = kern::share_min(q.tile_tokens);
    const unsigned long long* sums = nullptr;
    MSA_TRY(choose_pass(fn, prob, q, pl, ws, stream, &sums));
    if (automatic) q.choice = a.choice = sums;
  }
  const int64_t row = int64_t(prob.Hi) * prob.k;  // taken entries per token
  for (int64_t c0 = 0; c0 < prob.T; c0 += pl.fwd_tokens) {
    const int64_t c1 = std::min<int64_t>(prob.T, c0 + pl.fwd_tokens);
    if (taken != nullptr) a.taken = taken + c0 * row;
    MSA_TRY(build_entries(fn, pl, prob, block_idx, a.cu_seqlens, a.nseq, c0, c1, ws, stream, &a.list,
                          a.paged, a.choice, a.taken));
    MSA_TRY(build_work(fn, pl, pl.kv, prob, a.list, a.cu_seqlens, a.nseq, ws, stream, &a.work, &a.grid,
                       a.paged));
    a.tok_lo = c0;
    a.tok_hi = c1;
    MSA_TRY(dispatch(fn, "q", dt, prob.D, prob.opts.block_size, [&](auto v) {
      using V = decltype(v);
      return launch_fwd_kv<typename V::Element, V::kDim, V::kBlockN>(a, stream);
    }));
    if (taken != nullptr) {
      set_tile_pass(&q, c0, c1);
      MSA_TRY(run_forward(fn, "q", q, dt, prob.D, prob.opts.block_size, stream));
    }
  }
  return Status::Ok();
}

Status run_forward(const char* fn, const char* arg, const FwdArgs& a, DType dt, int32_t dim,
                   int32_t bk, cudaStream_t stream) {
  return dispatch(fn, arg, dt, dim, bk, [&](auto v) {
    using V = decltype(v);
    return launch_forward<typename V::Element, V::kDim, V::kBlockN>(a, stream);
  });
}

bool available() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess || n == 0) {
    cudaGetLastError();
    return false;
  }
  for (int d = 0; d < n; ++d) {
    cudaDeviceProp prop;
    if (cudaGetDeviceProperties(&prop, d) == cudaSuccess && prop.major == 9) return true;
  }
  return false;
}

Status select_blocks(const Problem& prob, const SelectParams& p) {
  const char* fn = "select_blocks";
  MSA_TRY(can_select(fn, prob, p.q_idx, p.k_idx, p.lse_idx.defined()));
  MSA_TRY(need_bytes(fn, select_fp8_bytes(prob, p.cu_seqlens), p.launch));
  // No query: nothing to select (keys apart: their offsets are still checked, as on the CPU).
  if (prob.T == 0 && !prob.keys_apart) return Status::Ok();
  DeviceGuard guard(p.q_idx.device.index);
  MSA_TRY(check_values(fn, prob, p.cu_seqlens, p.cu_seqlens_k, TensorRef{}, p.launch));
  if (prob.T == 0) return Status::Ok();
  const cudaStream_t stream = static_cast<cudaStream_t>(p.launch.stream);
  SelectArgs a = select_args(prob, p.q_idx, p.k_idx, p.cu_seqlens, p.cu_seqlens_k, p.block_idx);
  if (prob.opts.select_scores == SelectScores::kFp8) set_select_fp8(prob, p.launch.workspace, &a);
  MSA_TRY(run_select(fn, prob, a, p.q_idx.dtype, stream));
  if (!p.lse_idx.defined()) return Status::Ok();
  // lse_idx: the index softmax's normaliser over the selection just made.
  const KlInputs in(p);
  const FwdArgs f = index_lse_args(prob, in, static_cast<float*>(p.lse_idx.data),
                                   p.lse_idx.stride[0], p.lse_idx.stride[1]);
  return run_forward(fn, "q_idx", f, p.q_idx.dtype, prob.Di, prob.opts.block_size, stream);
}

Status attention_forward(const Problem& prob, const ForwardParams& p) {
  const char* fn = "forward";
  const bool dense = prob.opts.mode == Mode::kDense;
  MSA_TRY(can_forward(fn, prob, p));
  const bool kv_block = kv_block_forward(prob), split = split_forward(prob);
  Plan kvp;
  bool automatic = false;  // kAuto: the plain query tiles and the split launched, the device picks
  if (kv_block || split) {
    if (split) MSA_TRY(can_split(fn, prob));
    MSA_TRY(fwd_kv_plan(fn, prob, num_seqs(p.cu_seqlens), &kvp));
    MSA_TRY(need_workspace(fn, kvp, p.launch));
  } else if (auto_forward(prob) && fwd_kv_plan(fn, prob, num_seqs(p.cu_seqlens), &kvp).ok()) {
    // Without room for the split's plan, or past the split's limits, kAuto runs the plain query
    // tiles.
    automatic = p.launch.workspace != nullptr && p.launch.workspace_bytes >= kvp.total &&
                can_split(fn, prob).ok();
  }
  if (p.kl.defined()) {
    Plan pl;
    MSA_TRY(kl_plan(fn, prob, KlInputs(p), &pl));
    MSA_TRY(need_workspace(fn, pl, p.launch));
  }
  // The selection's E4M3 copies are dead before the passes after it use the workspace.
  if (p.select) MSA_TRY(need_bytes(fn, select_fp8_bytes(prob, p.cu_seqlens), p.launch));
  if (prob.T == 0 && !p.kl.defined() && !prob.keys_apart) return Status::Ok();
  DeviceGuard guard(p.q.device.index);
  const bool caller_selection = !dense && !p.select;
  MSA_TRY(check_values(fn, prob, p.cu_seqlens, p.cu_seqlens_k, caller_selection ? p.block_idx : TensorRef{},
                       p.launch));
  const cudaStream_t stream = static_cast<cudaStream_t>(p.launch.stream);
  if (prob.T > 0) {
    if (!dense && p.select) {
      SelectArgs sa = select_args(prob, p.q_idx, p.k_idx, p.cu_seqlens, p.cu_seqlens_k, p.block_idx);
      if (prob.opts.select_scores == SelectScores::kFp8) set_select_fp8(prob, p.launch.workspace, &sa);
      MSA_TRY(run_select(fn, prob, sa, p.q_idx.dtype, stream));
    }
    if (kv_block || split || automatic) {
      const FwdArgs q = forward_args(prob, p);
      MSA_TRY(run_forward_passes(fn, prob, p.q.dtype, fwd_kv_args(prob, q), q, p.block_idx, kvp, split,
                                 automatic, p.launch.workspace, stream));
    } else {
      MSA_TRY(run_forward(fn, "q", forward_args(prob, p), p.q.dtype, prob.D, prob.opts.block_size, stream));
    }
  }
  if (!p.kl.defined()) return Status::Ok();
  KlParams kp = detail::kl_params_of(p);
  kp.launch.check_values = false;  // checked above
  return kl_divergence(prob, kp);
}

size_t forward_workspace(const Problem& prob, const ForwardParams& p) {
  // The KV-block forward and the KL value run one after the other: the larger plan.
  size_t bytes = 0;
  Plan pl;
  if ((kv_block_forward(prob) || split_forward(prob) || auto_forward(prob)) &&
      fwd_kv_plan("forward", prob, num_seqs(p.cu_seqlens), &pl).ok())
    bytes = pl.total;
  if (p.kl.defined() &&
      kl_plan("forward", prob, KlInputs(p), &pl).ok())
    bytes = std::max(bytes, pl.total);
  if (p.select) bytes = std::max(bytes, select_fp8_bytes(prob, p.cu_seqlens));
  return bytes;
}

size_t select_workspace(const Problem& prob, const SelectParams& p) { return select_fp8_bytes(prob, p.cu_seqlens); }

}  // namespace msa::cuda
