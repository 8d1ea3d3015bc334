// Host code that turns a kernel family's Args into the Params of one instantiation (adding the
// TMA descriptors) and launches it. Included by the generated instantiation sources only.
#pragma once

#include <algorithm>
#include <string>

#include "../kernels/bwd_dq_kernel.cuh"
#include "../kernels/bwd_kv_kernel.cuh"
#include "../kernels/bwd_q_kernel.cuh"
#include "../kernels/fp8_copy_kernel.cuh"
#include "../kernels/fwd_kernel.cuh"
#include "../kernels/fwd_kv_kernel.cuh"
#include "../kernels/kl_grad_kernel.cuh"
#include "../kernels/kl_lse_kernel.cuh"
#include "../kernels/kl_kernel.cuh"
#include "../kernels/paged_attn_kernel.cuh"
#include "../kernels/paged_score_kernel.cuh"
#include "../kernels/rerank_kernel.cuh"
#include "../kernels/select_kernel.cuh"
#include "../../core/status.h"
#include "common.h"
#include "launch.h"
#include "rerank.h"

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
// `too_large` is the message (naming the argument that sized it) when smem exceeds the GPU's.
template <class Kernel, class Params>
Status launch_kernel(const char* fn, Kernel kernel, dim3 grid, int threads, size_t smem,
                     cudaStream_t stream, const Params& p, const std::string& too_large = "") {
  if (smem > size_t(smem_limit()))
    return Status::NotSupported(std::string("msa::") + fn + ": " +
                                (too_large.empty() ? "the kernel" : too_large) + " needs " +
                                std::to_string(smem) +
                                " bytes of shared memory per block, more than this GPU has");
  cudaError_t e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                       static_cast<int>(smem));
  if (e != cudaSuccess) return launch_error(fn, e);
  if (grid.x == 0 || grid.y == 0) return Status::Ok();
  launch_grid(kernel, grid, threads, smem, stream, p);
  e = cudaGetLastError();
  return e == cudaSuccess ? Status::Ok() : launch_error(fn, e);
}

// Where a query-tile kernel's union arrays end, rounded up to 16 bytes.
template <class Traits, class Args>
size_t union_end(const Args& a) {
  return (Traits::kUnionOffset + a.uni.bytes() + 15) / 16 * 16;
}

// A query-tile kernel (forward, bwd_q): the K and V TMA descriptors over (tokens, dim, KV head),
// then one CTA per (tile, head group) with the block-union arrays after SharedStorage.
// tail: bytes after the union arrays (16-byte aligned).
template <class Traits, class Params, class Args, class Kernel>
Status launch_query_tile(const char* fn, Kernel kernel, const Args& a, cudaStream_t stream, size_t tail = 0) {
  using namespace cute;
  using Element = typename Traits::Element;
  constexpr int kHeadDim = Traits::kHeadDim, kBlockN = Traits::kBlockN;
  Params p{};
  static_cast<Args&>(p) = a;
  const int32_t rows = a.paged.rows(a.T);  // the pages' rows when paged, Tk with keys apart
  const auto kv_tensor = [&](const void* ptr, int64_t s0, int64_t s1) {
    return make_tensor(make_gmem_ptr(static_cast<Element const*>(ptr)),
                       make_layout(make_shape(rows, int32_t(kHeadDim), a.Hkv), make_stride(s0, _1{}, s1)));
  };
  const auto smem_kv = take<0, 2>(typename Traits::SmemLayoutKV{});
  const auto box = Shape<Int<kBlockN>, Int<kHeadDim>>{};
  p.tma_k = make_tma_copy(SM90_TMA_LOAD{}, kv_tensor(a.k, a.k_s0, a.k_s1), smem_kv, box, _1{});
  p.tma_v = make_tma_copy(SM90_TMA_LOAD{}, kv_tensor(a.v, a.v_s0, a.v_s1), smem_kv, box, _1{});
  const size_t smem = tail == 0 ? Traits::kUnionOffset + a.uni.bytes() : union_end<Traits>(a) + tail;
  const dim3 grid(static_cast<unsigned>(a.num_tiles), static_cast<unsigned>(a.Hi));
  return launch_kernel(fn, kernel, grid, Traits::kThreads, smem, stream, p,
                       "argument 'block_idx': the union of a tile's selections (" +
                           std::to_string(a.tile_tokens) + " tokens x k = " + std::to_string(a.top_k) +
                           " blocks)");
}

// A KV-side kernel (bwd_kv, kl): one CTA per chunk of the work list.
template <class Traits, class Params, class Args, class Kernel>
Status launch_kv_side(const char* fn, Kernel kernel, const Args& a, cudaStream_t stream) {
  Params p{};
  static_cast<Args&>(p) = a;
  return launch_kernel(fn, kernel, dim3(static_cast<unsigned>(a.grid)), Traits::kThreads,
                       sizeof(typename Traits::SharedStorage), stream, p);
}

}  // namespace detail

template <class Element, int kHeadDim, int kBlockN>
Status launch_forward(const FwdArgs& a, cudaStream_t stream) {
  // scaled: K and V an E4M3 cache's codes, with its page scales; split: the instance that
  // merges the KV-block pass's partials.
  auto launch = [&](auto scaled, auto split) {
    using Traits = kern::FwdTraits<Element, kHeadDim, kBlockN, decltype(scaled)::value>;
    constexpr bool kSplit = decltype(split)::value;
    // The split: the consumer threads' slots for their next partials after the union arrays,
    // where the GPU's shared memory holds them (else the tiles merge after their mainloop).
    FwdArgs b = a;
    size_t tail = 0;
    const size_t end = detail::union_end<Traits>(a);
    if (kSplit && end + Traits::kPartialSlotBytes <= size_t(detail::smem_limit())) {
      b.split.slot_offset = static_cast<uint32_t>(end);
      tail = Traits::kPartialSlotBytes;
    }
    return detail::launch_query_tile<Traits, kern::FwdParams<Traits>>(
        "forward", kern::fwd_kernel<Traits, kSplit>, b, stream, tail);
  };
  auto with = [&](auto scaled) {
    if (a.split.part_o == nullptr) return launch(scaled, cute::false_type{});
    if (a.choice != nullptr) MSA_TRY(launch(scaled, cute::false_type{}));  // kAuto: both, one returns
    return launch(scaled, cute::true_type{});
  };
  return a.kv_scale != nullptr ? with(cute::true_type{}) : with(cute::false_type{});
}

template <class Element, int kHeadDim, int kBlockN>
Status launch_bwd_q(const BwdQArgs& a, cudaStream_t stream) {
  using Traits = kern::BwdQTraits<Element, kHeadDim, kBlockN>;
  return detail::launch_query_tile<Traits, kern::BwdQParams<Traits>>("backward",
                                                                     kern::bwd_q_kernel<Traits>, a, stream);
}

template <class Element, int kHeadDim, int kBlockN>
Status launch_bwd_dq(const BwdDqArgs& a, cudaStream_t stream) {
  // Gi = 2 and 4: bwd_kv wrote K-major dS tiles (BwdKvArgs::ds)
  auto launch = [&](auto ds_gi) {
    using Traits = kern::BwdDqTraits<Element, kHeadDim, kBlockN, decltype(ds_gi)::value>;
    return detail::launch_query_tile<Traits, kern::BwdDqParams<Traits>>(
        "backward", kern::bwd_dq_kernel<Traits>, a, stream);
  };
  switch (a.heads_per_idx) {
    case 2: return launch(cute::Int<2>{});
    case 4: return launch(cute::Int<4>{});
    default: return launch(cute::Int<0>{});
  }
}

template <class Element, int kDim, int kBlockN>
Status launch_select(const SelectArgs& a, cudaStream_t stream) {
  using namespace cute;
  auto launch = [&](auto element) {
    using E = decltype(element);
    using Traits = kern::SelectTraits<E, kDim, kBlockN>;
    kern::SelectKernelParams<Traits> p{};
    static_cast<SelectArgs&>(p) = a;
    auto g = make_tensor(make_gmem_ptr(static_cast<E const*>(a.k_idx)),
                         make_layout(make_shape(a.key_rows(), int32_t(kDim), a.Hik),
                                     make_stride(a.k_s0, _1{}, a.k_s1)));
    p.tma_k = make_tma_copy(SM90_TMA_LOAD{}, g, take<0, 2>(typename Traits::SmemLayoutK{}),
                            Shape<Int<kBlockN>, Int<kDim>>{}, _1{});
    const size_t smem = Traits::kListOffset + size_t(Traits::kBlockM) * ((a.k + a.rerank.m) | 1) * 8;
    const dim3 grid(static_cast<unsigned>(a.num_tiles), static_cast<unsigned>(a.Hik));
    return detail::launch_kernel("select_blocks", kern::select_kernel<Traits>, grid, Traits::kThreads,
                                 smem, stream, p,
                                 a.rerank.m > 0 ? "arguments 'top_k' + 'fp8_rerank': " +
                                                      std::to_string(a.k + a.rerank.m) + " candidates per row"
                                                : "argument 'top_k': " + std::to_string(a.k) +
                                                      " candidates per row");
  };
  if (a.e4m3_keys)  // a prefill over an E4M3 k_idx cache: its pages' codes as Element first
    MSA_TRY(detail::launch_kernel("select_blocks", kern::e4m3_pages_kernel<Element, kDim>,
                                  dim3(static_cast<unsigned>(a.e4m3.num_blocks), static_cast<unsigned>(a.e4m3.Hik)),
                                  128, 0, stream, a.e4m3));
  if (!a.fp8) return launch(Element{});
  // FP8 scores: the E4M3 copies of q_idx (a warp per row) and k_idx (a CTA per key block), then
  // the selection over them.
  const Fp8CopyArgs& c = a.copy;
  const int64_t rows = int64_t(c.T) * c.Hi;
  MSA_TRY(detail::launch_kernel("select_blocks", kern::fp8_rows_kernel<Element, kDim>,
                                dim3(static_cast<unsigned>((rows + 7) / 8)), 256, 0, stream, c));
  MSA_TRY(detail::launch_kernel("select_blocks", kern::fp8_blocks_kernel<Element, kDim>,
                                dim3(static_cast<unsigned>(c.num_blocks), static_cast<unsigned>(c.Hik)), 128, 0,
                                stream, c));
  if (a.rerank.m == 0) return launch(cutlass::float_e4m3_t{});
  // The shortlists, then their entries scored by the inputs (rerank_kernel.cuh) and the pick.
  MSA_TRY(launch(cutlass::float_e4m3_t{}));
  MSA_TRY(rerank_lists("select_blocks", a, stream));
  using RT = kern::RerankTraits<Element, kDim, kBlockN>;
  MSA_TRY(detail::launch_kernel("select_blocks", kern::rerank_score_kernel<RT>,
                                dim3(static_cast<unsigned>(a.rerank.grid)), RT::kThreads,
                                sizeof(typename RT::SharedStorage), stream, a));
  return rerank_pick("select_blocks", a, stream);
}

// The KL branch fused (q_idx set), its teacher only (teacher set), or none.
template <class Element, int kHeadDim, int kBlockN>
Status launch_bwd_kv(const BwdKvArgs& a, cudaStream_t stream) {
  auto launch = [&](auto mode, auto gi) {
    using Traits = kern::BwdKVTraits<Element, kHeadDim, kBlockN, decltype(mode)::value, decltype(gi)::value>;
    return detail::launch_kv_side<Traits, kern::BwdKVParams<Traits>>("backward", kern::bwd_kv_kernel<Traits>,
                                                                     a, stream);
  };
  // Gi as a compile-time constant for the head counts of the common models (flash-msa's 4, the
  // paper's 16): their per-entry index arithmetic folds into constant offsets. Gi = 2 (an index
  // head per two query heads) takes two records a step (BwdKVTraits::kRecs).
  auto by_gi = [&](auto mode) {
    if (a.heads_per_idx == 2) return launch(mode, cute::Int<2>{});
    if (a.heads_per_idx == 4) return launch(mode, cute::Int<4>{});
    if (a.heads_per_idx == 16) return launch(mode, cute::Int<16>{});
    return launch(mode, cute::Int<0>{});
  };
  using kern::KvKl;
  if (a.q_idx != nullptr) return launch(std::integral_constant<KvKl, KvKl::kFused>{}, cute::Int<0>{});
  if (a.teacher != nullptr) return by_gi(std::integral_constant<KvKl, KvKl::kTeacher>{});
  return by_gi(std::integral_constant<KvKl, KvKl::kNone>{});
}

template <class Element, int kHeadDim, int kBlockN>
Status launch_fwd_kv(const FwdKvArgs& a, cudaStream_t stream) {
  const int64_t pairs = (a.tok_hi - a.tok_lo) * a.Hq;
  if (pairs == 0) return Status::Ok();
  // The zeroing and the combine of the pass alone (the split's query tiles find the written
  // slots from `taken` and merge them): grid-stride loops over a bounded grid.
  const auto grid = [](int64_t threads) {
    return static_cast<unsigned>(std::min<int64_t>((threads + 255) / 256, int64_t(num_sms()) * 128));
  };
  if (a.taken == nullptr)
    launch_grid(kern::fwd_zero_kernel<Element>, grid(pairs * a.top_k / 2 + 1), 256, 0, stream, a);
  // scaled: K and V an E4M3 cache's codes, with its page scales; recs: records an entry (two at
  // Gi = 2, FwdKvTraits::kRecs)
  auto launch = [&](auto scaled, auto recs) {
    using Traits = kern::FwdKvTraits<Element, kHeadDim, kBlockN, decltype(scaled)::value, decltype(recs)::value>;
    return detail::launch_kv_side<Traits, kern::FwdKvParams<Traits>>("forward", kern::fwd_kv_kernel<Traits>, a,
                                                                     stream);
  };
  auto by_recs = [&](auto scaled) {
    return a.heads_per_idx == 2 ? launch(scaled, cute::Int<2>{}) : launch(scaled, cute::Int<1>{});
  };
  const Status st = a.kv_scale != nullptr ? by_recs(cute::true_type{}) : by_recs(cute::false_type{});
  if (!st.ok()) return st;
  // The split: the query tiles that run next merge the partials.
  if (a.taken == nullptr)
    launch_grid(kern::fwd_combine_kernel<Element, kHeadDim>, grid(pairs * (kHeadDim / 8)), 256, 0, stream, a);
  const cudaError_t e = cudaGetLastError();
  return e == cudaSuccess ? Status::Ok() : detail::launch_error("forward", e);
}

template <class Element, int kDim, int kBlockN>
Status launch_kl(const KlArgs& a, cudaStream_t stream) {
  using Traits = kern::KlTraits<Element, kDim, kBlockN>;
  return detail::launch_kv_side<Traits, kern::KlParams<Traits>>("kl", kern::kl_kernel<Traits>, a, stream);
}

// The gradient pass, or (a.lse_part set) the LSE pass before it.
template <class Element, int kDim, int kBlockN>
Status launch_kl_grad(const KlArgs& a, cudaStream_t stream) {
  if (a.lse_part != nullptr) {
    using Traits = kern::KlLseTraits<Element, kDim, kBlockN>;
    return detail::launch_kv_side<Traits, kern::KlLseParams<Traits>>("backward", kern::kl_lse_kernel<Traits>, a,
                                                                     stream);
  }
  using Traits = kern::KlGradTraits<Element, kDim, kBlockN>;
  return detail::launch_kv_side<Traits, kern::KlGradParams<Traits>>("backward", kern::kl_grad_kernel<Traits>, a,
                                                                    stream);
}

template <class Element, int kDim, int kBlockN>
Status launch_paged_score(const PagedScoreArgs& a, cudaStream_t stream) {
  const dim3 grid(static_cast<unsigned>(a.num_tiles), static_cast<unsigned>(a.Hik),
                  static_cast<unsigned>(a.num_chunks));
  auto launch = [&](auto rows, auto e4m3) {
    using Traits = kern::PagedScoreTraits<Element, kDim, kBlockN, decltype(rows)::value, decltype(e4m3)::value>;
    return detail::launch_kernel("paged_select_blocks", kern::paged_score_kernel<Traits>, grid,
                                 Traits::kThreads, sizeof(typename Traits::SharedStorage), stream, a);
  };
  // E4M3 index keys: the kernel that converts their codes.
  auto with_keys = [&](auto rows) {
    return a.k_scale != nullptr ? launch(rows, cute::true_type{}) : launch(rows, cute::false_type{});
  };
  if (a.rows == kPagedScoreRowsDecode) return with_keys(cute::Int<kPagedScoreRowsDecode>{});
  return with_keys(cute::Int<kPagedScoreRows>{});
}

template <class Element, int kHeadDim, int kBlockN>
Status launch_paged_attn(const PagedAttnArgs& a, cudaStream_t stream) {
  const dim3 grid(static_cast<unsigned>(a.num_tiles), static_cast<unsigned>(a.Hkv),
                  static_cast<unsigned>(a.splits));
  auto launch = [&](auto e4m3, auto columns) {  // E4M3 k and v: the kernel that converts their codes
    using Traits = kern::PagedAttnTraits<Element, kHeadDim, kBlockN, decltype(e4m3)::value,
                                         decltype(columns)::value>;
    return detail::launch_kernel("paged_forward", kern::paged_attn_kernel<Traits>, grid, Traits::kThreads,
                                 Traits::smem_bytes(a.dense ? 0 : a.union_cap), stream, a,
                                 "argument 'block_idx': the union of a tile's selections (" +
                                     std::to_string(a.tile_tokens) + " tokens x k = " + std::to_string(a.top_k) +
                                     " blocks)");
  };
  auto with_layout = [&](auto e4m3) {
    return a.columns ? launch(e4m3, cute::true_type{}) : launch(e4m3, cute::false_type{});
  };
  MSA_TRY(a.k_scale != nullptr ? with_layout(cute::true_type{}) : with_layout(cute::false_type{}));
  if (a.splits == 1) return Status::Ok();
  const int64_t blocks = (int64_t(a.Tq) * a.Hq * 32 + 255) / 256;
  launch_grid(kern::paged_combine_kernel<Element, kHeadDim>, static_cast<unsigned>(blocks), 256, 0, stream,
              a);
  const cudaError_t e = cudaGetLastError();
  return e == cudaSuccess ? Status::Ok() : detail::launch_error("paged_forward", e);
}

}  // namespace msa::cuda
