// Host code that builds the TMA descriptors and launches one kernel instantiation. Included by
// the generated instantiation sources only.
#pragma once

#include <cmath>
#include <string>

#include "kernels/bwd_kv_kernel.cuh"
#include "kernels/bwd_q_kernel.cuh"
#include "kernels/fwd_kernel.cuh"
#include "kernels/kl_kernel.cuh"
#include "kernels/select_kernel.cuh"
#include "launch.h"

namespace msa::cuda {

namespace detail {

inline Status launch_error(const char* fn, cudaError_t e) {
  return Status::Internal(std::string("msa::") + fn + ": kernel launch failed: " +
                          cudaGetErrorString(e));
}

inline int smem_limit() {
  int dev = 0, bytes = 0;
  cudaGetDevice(&dev);
  cudaDeviceGetAttribute(&bytes, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev);
  return bytes;
}

// Sets the kernel's dynamic shared memory, launches it on `stream` and reports launch errors.
template <class Kernel, class Params>
Status launch_kernel(const char* fn, Kernel kernel, dim3 grid, int threads, size_t smem,
                     cudaStream_t stream, const Params& p) {
  if (smem > size_t(smem_limit()))
    return Status::NotSupported(std::string("msa::") + fn + ": needs " + std::to_string(smem) +
                                " bytes of shared memory per block, more than this GPU has");
  cudaError_t e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                       static_cast<int>(smem));
  if (e != cudaSuccess) return launch_error(fn, e);
  if (grid.x == 0 || grid.y == 0) return Status::Ok();
  kernel<<<grid, threads, smem, stream>>>(p);
  e = cudaGetLastError();
  return e == cudaSuccess ? Status::Ok() : launch_error(fn, e);
}

}  // namespace detail

template <class Element, int kHeadDim, int kBlockN>
Status launch_forward(const FwdArgs& a) {
  using namespace cute;
  using Traits = kern::FwdTraits<Element, kHeadDim, kBlockN>;
  using Params = kern::FwdParams<Traits>;
  Params p{};
  const auto kv_tensor = [&](const void* ptr, int64_t s0, int64_t s1) {
    return make_tensor(make_gmem_ptr(static_cast<Element const*>(ptr)),
                       make_layout(make_shape(static_cast<int32_t>(a.T), int32_t(kHeadDim), a.Hkv),
                                   make_stride(s0, _1{}, s1)));
  };
  const auto smem_kv = take<0, 2>(typename Traits::SmemLayoutKV{});
  const auto box = Shape<Int<kBlockN>, Int<kHeadDim>>{};
  p.tma_k = make_tma_copy(SM90_TMA_LOAD{}, kv_tensor(a.k, a.k_s0, a.k_s1), smem_kv, box, _1{});
  p.tma_v = make_tma_copy(SM90_TMA_LOAD{}, kv_tensor(a.v, a.v_s0, a.v_s1), smem_kv, box, _1{});
  p.q = static_cast<const Element*>(a.q);
  p.q_s0 = a.q_s0;
  p.q_s1 = a.q_s1;
  p.out = static_cast<Element*>(a.out);
  p.o_s0 = a.o_s0;
  p.o_s1 = a.o_s1;
  p.lse = a.lse;
  p.lse_s0 = a.lse_s0;
  p.lse_s1 = a.lse_s1;
  p.block_idx = a.block_idx;
  p.bi_s0 = a.bi_s0;
  p.bi_s1 = a.bi_s1;
  p.cu_seqlens = a.cu_seqlens;
  p.nseq = a.nseq;
  p.T = static_cast<int32_t>(a.T);
  p.Hkv = a.Hkv;
  p.Hi = a.Hi;
  p.heads_per_idx = a.Hq / a.Hi;
  p.idx_per_kv = a.Hi / a.Hkv;
  p.tile_tokens = Traits::kBlockM / p.heads_per_idx;
  p.k = a.top_k;
  p.scale = std::fabs(a.scale);
  p.scale_log2 = p.scale * static_cast<float>(M_LOG2E);
  p.negate = a.scale < 0.f;
  p.dense = a.dense;
  p.lse_only = a.lse_only;
  const int64_t num_blocks = (a.T + kBlockN - 1) / kBlockN;
  if (a.dense) {
    p.bitmap_words = p.capacity = p.mask_words = 0;
  } else {
    p.bitmap_words = static_cast<int32_t>((num_blocks + 31) / 32);
    p.capacity = static_cast<int32_t>(std::min<int64_t>(int64_t(p.tile_tokens) * a.top_k, num_blocks));
    p.mask_words = (p.tile_tokens + 31) / 32;
  }
  p.num_tiles = kern::num_tile_ids(a.nseq, a.T, p.tile_tokens);
  const size_t smem = Traits::kUnionOffset +
                      4 * (2 * size_t(p.bitmap_words) + size_t(p.capacity) * (1 + p.mask_words));
  if (smem > size_t(detail::smem_limit()))
    return Status::NotSupported(
        "msa::forward: the selection is too wide for one tile on this GPU (tokens per tile " +
        std::to_string(p.tile_tokens) + " x k " + std::to_string(a.top_k) + " needs " +
        std::to_string(smem) + " bytes of shared memory)");
  dim3 grid(static_cast<unsigned>(p.num_tiles), static_cast<unsigned>(a.Hi));
  return detail::launch_kernel("forward", kern::fwd_kernel<Traits>, grid, Traits::kThreads, smem,
                               a.stream, p);
}

template <class Element, int kDim, int kBlockN>
Status launch_select(const SelectArgs& a) {
  using namespace cute;
  using Traits = kern::SelectTraits<Element, kDim, kBlockN>;
  using Params = kern::SelectKernelParams<Traits>;
  Params p{};
  auto g = make_tensor(make_gmem_ptr(static_cast<Element const*>(a.k_idx)),
                       make_layout(make_shape(static_cast<int32_t>(a.T), int32_t(kDim), a.Hik),
                                   make_stride(a.k_s0, _1{}, a.k_s1)));
  p.tma_k = make_tma_copy(SM90_TMA_LOAD{}, g, take<0, 2>(typename Traits::SmemLayoutK{}),
                          Shape<Int<kBlockN>, Int<kDim>>{}, _1{});
  p.q_idx = static_cast<const Element*>(a.q_idx);
  p.q_s0 = a.q_s0;
  p.q_s1 = a.q_s1;
  p.block_idx = a.block_idx;
  p.bi_s0 = a.bi_s0;
  p.bi_s1 = a.bi_s1;
  p.cu_seqlens = a.cu_seqlens;
  p.nseq = a.nseq;
  p.T = static_cast<int32_t>(a.T);
  p.Hik = a.Hik;
  p.idx_per_key = a.Hi / a.Hik;
  p.tile_tokens = Traits::kBlockM / p.idx_per_key;
  p.k = a.top_k;
  p.sink_blocks = a.sink_blocks;
  p.local_blocks = a.local_blocks;
  p.scale = std::fabs(a.scale_idx);
  p.negate = a.scale_idx < 0.f;
  p.num_tiles = kern::num_tile_ids(a.nseq, a.T, p.tile_tokens);
  const size_t smem = Traits::kListOffset + size_t(Traits::kBlockM) * (a.top_k | 1) * 8;
  if (smem > size_t(detail::smem_limit()))
    return Status::NotSupported("msa::select_blocks: argument 'top_k': " + std::to_string(a.top_k) +
                                " is more than this GPU's shared memory holds per tile");
  dim3 grid(static_cast<unsigned>(p.num_tiles), static_cast<unsigned>(a.Hik));
  return detail::launch_kernel("select_blocks", kern::select_kernel<Traits>, grid, Traits::kThreads,
                               smem, a.stream, p);
}

template <class Element, int kHeadDim, int kBlockN>
Status launch_bwd_q(const BwdArgs& a) {
  using namespace cute;
  using Traits = kern::BwdQTraits<Element, kHeadDim, kBlockN>;
  kern::BwdQParams<Traits> p{};
  const auto kv_tensor = [&](const void* ptr, int64_t s0, int64_t s1) {
    return make_tensor(make_gmem_ptr(static_cast<Element const*>(ptr)),
                       make_layout(make_shape(static_cast<int32_t>(a.T), int32_t(kHeadDim), a.Hkv),
                                   make_stride(s0, _1{}, s1)));
  };
  const auto smem_kv = take<0, 2>(typename Traits::SmemLayoutKV{});
  const auto box = Shape<Int<kBlockN>, Int<kHeadDim>>{};
  p.tma_k = make_tma_copy(SM90_TMA_LOAD{}, kv_tensor(a.k, a.k_s0, a.k_s1), smem_kv, box, _1{});
  p.tma_v = make_tma_copy(SM90_TMA_LOAD{}, kv_tensor(a.v, a.v_s0, a.v_s1), smem_kv, box, _1{});
  p.q = static_cast<const Element*>(a.q);
  p.q_s0 = a.q_s0;
  p.q_s1 = a.q_s1;
  p.dout = static_cast<const Element*>(a.dout);
  p.do_s0 = a.do_s0;
  p.do_s1 = a.do_s1;
  p.lse = a.lse;
  p.lse_s0 = a.lse_s0;
  p.lse_s1 = a.lse_s1;
  p.delta = a.delta;
  p.dq = static_cast<Element*>(a.dq);
  p.dq_s0 = a.dq_s0;
  p.dq_s1 = a.dq_s1;
  p.block_idx = a.block_idx;
  p.bi_s0 = a.bi_s0;
  p.bi_s1 = a.bi_s1;
  p.cu_seqlens = a.cu_seqlens;
  p.nseq = a.nseq;
  p.T = static_cast<int32_t>(a.T);
  p.Hq = a.Hq;
  p.Hkv = a.Hkv;
  p.Hi = a.Hi_tile;
  p.heads_per_idx = a.Hq / a.Hi_tile;
  p.idx_per_kv = a.Hi_tile / a.Hkv;
  p.tile_tokens = Traits::kBlockM / p.heads_per_idx;
  p.k = a.top_k;
  p.scale = a.scale;
  p.scale_log2 = a.scale * static_cast<float>(M_LOG2E);
  p.dense = a.dense;
  const int64_t num_blocks = (a.T + kBlockN - 1) / kBlockN;
  if (a.dense) {
    p.bitmap_words = p.capacity = p.mask_words = 0;
  } else {
    p.bitmap_words = static_cast<int32_t>((num_blocks + 31) / 32);
    p.capacity = static_cast<int32_t>(std::min<int64_t>(int64_t(p.tile_tokens) * a.top_k, num_blocks));
    p.mask_words = (p.tile_tokens + 31) / 32;
  }
  p.num_tiles = kern::num_tile_ids(a.nseq, a.T, p.tile_tokens);
  const size_t smem = Traits::kUnionOffset +
                      4 * (2 * size_t(p.bitmap_words) + size_t(p.capacity) * (1 + p.mask_words));
  dim3 grid(static_cast<unsigned>(p.num_tiles), static_cast<unsigned>(a.Hi_tile));
  return detail::launch_kernel("backward", kern::bwd_q_kernel<Traits>, grid, Traits::kThreads, smem,
                               a.stream, p);
}

inline kern::WorkListParams work_params(const WorkArgs& w) {
  kern::WorkListParams l{};
  l.chunk_start = w.chunk_start;
  l.num_chunks = w.num_chunks;
  l.slot_start = w.slot_start;
  l.arrivals = w.arrivals;
  l.partials = w.partials;
  l.items = w.items;
  l.chunk = w.chunk;
  return l;
}

inline kern::EntryListParams entry_params(const EntryArgs& e, bool dense) {
  kern::EntryListParams l{};
  l.keys = e.keys;
  l.masks = e.masks;
  l.count = e.count;
  l.gbits = e.gbits;
  l.dense = dense;
  return l;
}

namespace detail {
template <class Traits>
Status launch_bwd_kv_kernel(const BwdArgs& a) {
  using Element = typename Traits::Element;
  kern::BwdKVParams<Traits> p{};
  p.q = static_cast<const Element*>(a.q);
  p.k = static_cast<const Element*>(a.k);
  p.v = static_cast<const Element*>(a.v);
  p.dout = static_cast<const Element*>(a.dout);
  p.q_s0 = a.q_s0;
  p.q_s1 = a.q_s1;
  p.k_s0 = a.k_s0;
  p.k_s1 = a.k_s1;
  p.v_s0 = a.v_s0;
  p.v_s1 = a.v_s1;
  p.do_s0 = a.do_s0;
  p.do_s1 = a.do_s1;
  p.lse = a.lse;
  p.lse_s0 = a.lse_s0;
  p.lse_s1 = a.lse_s1;
  p.delta = a.delta;
  p.dk = static_cast<Element*>(a.dk);
  p.dv = static_cast<Element*>(a.dv);
  p.dk_s0 = a.dk_s0;
  p.dk_s1 = a.dk_s1;
  p.dv_s0 = a.dv_s0;
  p.dv_s1 = a.dv_s1;
  p.list = entry_params(a.entries, a.dense);
  p.cu_seqlens = a.cu_seqlens;
  p.nseq = a.nseq;
  p.T = static_cast<int32_t>(a.T);
  p.Hq = a.Hq;
  p.Hkv = a.Hkv;
  p.Hi = a.Hi;
  p.heads_per_idx = a.Hq / a.Hi;
  p.idx_per_kv = a.Hi / a.Hkv;
  p.group_tokens = kern::group_tokens(p.heads_per_idx);
  p.scale = a.scale;
  p.scale_log2 = a.scale * static_cast<float>(M_LOG2E);
  p.work = work_params(a.work);
  p.q_idx = static_cast<const Element*>(a.q_idx);
  p.k_idx = static_cast<const Element*>(a.k_idx);
  p.qi_s0 = a.qi_s0;
  p.qi_s1 = a.qi_s1;
  p.ki_s0 = a.ki_s0;
  p.ki_s1 = a.ki_s1;
  p.lse_idx = a.lse_idx;
  p.dq_idx = a.dq_idx;
  p.dk_idx = a.dk_idx;
  p.Hik = a.Hik;
  p.idx_per_key = a.Hi / a.Hik;
  p.scale_idx = a.scale_idx;
  dim3 grid(static_cast<unsigned>(a.work.grid));
  return launch_kernel("backward", kern::bwd_kv_kernel<Traits>, grid, Traits::kThreads,
                       sizeof(typename Traits::SharedStorage), a.stream, p);
}
}  // namespace detail

template <class Element, int kHeadDim, int kBlockN>
Status launch_bwd_kv(const BwdArgs& a) {
  if (a.q_idx != nullptr)
    return detail::launch_bwd_kv_kernel<kern::BwdKVTraits<Element, kHeadDim, kBlockN, true>>(a);
  return detail::launch_bwd_kv_kernel<kern::BwdKVTraits<Element, kHeadDim, kBlockN, false>>(a);
}

template <class Element, int kDim, int kBlockN>
Status launch_kl(const KlArgs& a) {
  using Traits = kern::KlTraits<Element, kDim, kBlockN>;
  kern::KlParams<Traits> p{};
  p.q = static_cast<const Element*>(a.q);
  p.k = static_cast<const Element*>(a.k);
  p.q_idx = static_cast<const Element*>(a.q_idx);
  p.k_idx = static_cast<const Element*>(a.k_idx);
  p.q_s0 = a.q_s0;
  p.q_s1 = a.q_s1;
  p.k_s0 = a.k_s0;
  p.k_s1 = a.k_s1;
  p.qi_s0 = a.qi_s0;
  p.qi_s1 = a.qi_s1;
  p.ki_s0 = a.ki_s0;
  p.ki_s1 = a.ki_s1;
  p.lse = a.lse;
  p.lse_s0 = a.lse_s0;
  p.lse_s1 = a.lse_s1;
  p.lse_idx = a.lse_idx;
  p.dq_idx = a.dq_idx;
  p.dk_idx = a.dk_idx;
  p.kl_rows = a.kl_rows;
  p.list = entry_params(a.entries, a.dense);
  p.cu_seqlens = a.cu_seqlens;
  p.nseq = a.nseq;
  p.T = static_cast<int32_t>(a.T);
  p.Hq = a.Hq;
  p.Hkv = a.Hkv;
  p.Hi = a.Hi;
  p.Hik = a.Hik;
  p.heads_per_idx = a.Hq / a.Hi;
  p.idx_per_kv = a.Hi / a.Hkv;
  p.idx_per_key = a.Hi / a.Hik;
  p.group_tokens = kern::group_tokens(p.heads_per_idx);
  p.scale_log2 = a.scale * static_cast<float>(M_LOG2E);
  p.scale_idx = a.scale_idx;
  p.work = work_params(a.work);
  dim3 grid(static_cast<unsigned>(a.work.grid));
  return detail::launch_kernel("kl", kern::kl_kernel<Traits>, grid, Traits::kThreads,
                               sizeof(typename Traits::SharedStorage), a.stream, p);
}

}  // namespace msa::cuda
