// Small device helpers shared by the Hopper kernels: accumulator layout views, the warpgroup
// GEMM wrapper, quad reductions.
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>
#include <cutlass/arch/reg_reconfig.h>
#include <cutlass/numeric_conversion.h>
#include <cutlass/numeric_types.h>

namespace msa::cuda::kern {

using namespace cute;

// An untyped pointer of the kernels' Args (host/args.h) as the instantiation's element type.
template <class E>
CUTE_HOST_DEVICE const E* as(const void* p) {
  return static_cast<const E*>(p);
}
template <class E>
CUTE_HOST_DEVICE E* as(void* p) {
  return static_cast<E*>(p);
}

// Named barriers (user ids; CUTLASS offsets them past its reserved ones).
enum class Barrier : uint32_t {
  kListReady = 0,  // producer warp + consumers: the tile's block list is in shared memory
  kQReady = 1,     // consumers: Q is in shared memory
  kVTail = 2,      // one consumer warpgroup (2 + its index): a stage's tail rows were zeroed
  kWarpGroup = 2,  // the same ids in kernels with no V tail: a sync of one consumer warpgroup
  kConsumers = 4,  // every consumer warpgroup of a kernel with a producer warpgroup
  kProducer = 5,   // the producer warpgroup's own threads
};

// Row/column view of a wgmma accumulator: ((2, 2, N/8), M, N) -> ((2, M), (2, N/8, N)).
// Rows are (row half, MMA_M), columns (column pair, n8 chunk, MMA_N).
template <class Layout>
CUTE_HOST_DEVICE constexpr auto acc_rowcol(Layout l) {
  static_assert(decltype(rank(l))::value == 3);
  static_assert(decltype(rank(get<0>(l)))::value == 3);
  return make_layout(make_layout(get<0, 1>(l), get<1>(l)),
                     make_layout(get<0, 0>(l), get<0, 2>(l), get<2>(l)));
}

// The accumulator of S = Q K^T as the register A operand of O += P V (16-bit P):
// ((2, 2, N/8), M, N) -> ((2, 2, 2), M, (N/16, N)): two n8 chunks form one k16 slice.
template <class Layout>
CUTE_HOST_DEVICE constexpr auto acc_as_a_operand(Layout l) {
  auto chunks = logical_divide(get<0, 2>(l), Tile<_2>{});  // ((2, N/16))
  return make_layout(make_layout(get<0, 0>(l), get<0, 1>(l), get<0, 0>(chunks)), get<1>(l),
                     coalesce(make_layout(get<0, 1>(chunks), get<2>(l))));
}

// C (+)= A B on one warpgroup's tiles, issued asynchronously; the caller waits with
// warpgroup_wait<N>(). A lives in registers (kRegA, RS) or shared memory (SS descriptors).
template <bool kZeroInit, bool kRegA = false, class Mma, class TA, class TB, class TC>
CUTE_DEVICE void wg_gemm(Mma& mma, TA const& a, TB const& b, TC& c) {
  if constexpr (kRegA) warpgroup_fence_operand(const_cast<TA&>(a));
  warpgroup_fence_operand(c);
  warpgroup_arrive();
  if constexpr (kZeroInit) mma.accumulate_ = GMMA::ScaleOut::Zero;
  CUTE_UNROLL
  for (int kb = 0; kb < size<2>(a); ++kb) {
    cute::gemm(mma, a(_, _, kb), b(_, _, kb), c);
    mma.accumulate_ = GMMA::ScaleOut::One;
  }
  warpgroup_commit_batch();
  warpgroup_fence_operand(c);
  if constexpr (kRegA) warpgroup_fence_operand(const_cast<TA&>(a));
}

// Flips the sign bit of eight 16-bit floats (exact: how a negative softmax scale is folded into
// the query so that scores keep a positive scale).
CUTE_DEVICE uint4 negate8(uint4 v) {
  v.x ^= 0x80008000u;
  v.y ^= 0x80008000u;
  v.z ^= 0x80008000u;
  v.w ^= 0x80008000u;
  return v;
}

// Reductions over the 4 lanes of a quad (the threads sharing an accumulator row).
CUTE_DEVICE float quad_max(float x) {
  x = fmaxf(x, __shfl_xor_sync(0xffffffff, x, 1));
  return fmaxf(x, __shfl_xor_sync(0xffffffff, x, 2));
}
CUTE_DEVICE float quad_sum(float x) {
  x += __shfl_xor_sync(0xffffffff, x, 1);
  return x + __shfl_xor_sync(0xffffffff, x, 2);
}

// threadIdx.x, read afresh: values derived from it are then computed where they are used
// rather than hoisted out of a loop into registers that stay live across it.
CUTE_DEVICE int fresh_thread_index() {
  int t;
  asm volatile("mov.u32 %0, %%tid.x;\n" : "=r"(t));
  return t;
}

// log2 of a power of two, at compile time where x is a constant.
CUTE_HOST_DEVICE constexpr int log2_pow2(int x) { return x <= 1 ? 0 : 1 + log2_pow2(x >> 1); }

// The last s in [0, n) with v[s] <= x, where v is nondecreasing and v[0] <= x, found by the
// whole CTA (every thread calls it and gets the answer): each round samples blockDim.x values of
// the remaining range with independent loads and narrows it by __syncthreads_count, so that
// n <= blockDim.x^r takes r rounds of one load each instead of a binary search's log2(n)
// dependent loads (a CTA that looks up its work item before its first copy waits on them).
CUTE_DEVICE int64_t cta_last_le(const int32_t* v, int64_t n, int32_t x) {
  int64_t lo = 0, len = n;
  while (len > 1) {
    const int64_t stride = (len + blockDim.x - 1) / blockDim.x;
    const int64_t s = lo + int64_t(threadIdx.x) * stride;
    const int taken = __syncthreads_count(s < lo + len && v[s] <= x);  // a prefix of the samples
    lo += int64_t(taken - 1) * stride;
    len = min(stride, len - int64_t(taken - 1) * stride);
  }
  return lo;
}

// Element conversion of a register tensor into another of the same shape.
template <class TSrc, class TDst>
CUTE_DEVICE void convert_into(TSrc const& src, TDst& dst) {
  using To = typename TDst::value_type;
  constexpr int N = decltype(size(src))::value;
  cutlass::NumericArrayConverter<To, float, N> conv;
  *reinterpret_cast<cutlass::Array<To, N>*>(dst.data()) =
      conv(*reinterpret_cast<cutlass::Array<float, N> const*>(src.data()));
}

}  // namespace msa::cuda::kern
