// How fast are narrow warpgroup MMAs on Hopper? dQ^T = K^T dS^T over one key block is a
// 64 x N x 128 product per warpgroup with N the columns of one or two tokens (8 or 16), where
// today's dQ = dS K takes 64 rows (16 tokens at Gi = 4) whatever the tokens selected. This
// times, per SM, G independent accumulators of 64 x N, each taking eight k16 steps (one 128-key
// block) per round, A from registers (RS) or shared memory (SS), B from shared memory, and the
// warp-level mma.sync m16n8k16 for comparison. Values are not checked: only the issue rate.
//
//   nvcc -std=c++17 -O3 -arch=sm_90a --expt-relaxed-constexpr -I$CUTLASS/include \
//     bench/micro/wgmma_narrow.cu -o build/wgmma_narrow && build/wgmma_narrow
#include <cstdio>
#include <cute/tensor.hpp>
#include <cutlass/gemm/collective/builders/sm90_common.inl>

using namespace cute;
using Element = cutlass::bfloat16_t;

template <int N, bool kRS, int kGroups>
struct Cfg {
  static constexpr int kM = 64, kK = 128;
  using AtomA = decltype(cutlass::gemm::collective::detail::ss_smem_selector<
                         GMMA::Major::K, Element, Int<kM>, Int<kK>>());
  using AtomB = decltype(cutlass::gemm::collective::detail::ss_smem_selector<
                         GMMA::Major::K, Element, Int<N>, Int<kK>>());
  using LayoutA = decltype(tile_to_shape(AtomA{}, Shape<Int<kM>, Int<kK>>{}));
  using LayoutB = decltype(tile_to_shape(AtomB{}, Shape<Int<N>, Int<kK>>{}));
  using Op = std::conditional_t<
      kRS,
      decltype(GMMA::rs_op_selector<Element, Element, float, Shape<Int<kM>, Int<N>, Int<kK>>,
                                    GMMA::Major::K, GMMA::Major::K>()),
      decltype(GMMA::ss_op_selector<Element, Element, float, Shape<Int<kM>, Int<N>, Int<kK>>,
                                    GMMA::Major::K, GMMA::Major::K>())>;
  using Mma = decltype(make_tiled_mma(Op{}));
};

template <int N, bool kRS, int kGroups, int kWarpGroups>
__global__ void __launch_bounds__(128 * kWarpGroups, 1) wgmma_kernel(int rounds, float* out) {
  using C = Cfg<N, kRS, kGroups>;
  extern __shared__ __align__(1024) char smem[];
  auto sa = reinterpret_cast<Element(*)[C::kM * C::kK]>(smem);
  auto sb = reinterpret_cast<Element(*)[kGroups][N * C::kK]>(smem + kWarpGroups * C::kM * C::kK * 2);
  const int wg = threadIdx.x / 128, lt = threadIdx.x % 128;
  for (int i = threadIdx.x; i < kWarpGroups * C::kM * C::kK; i += blockDim.x)
    (&sa[0][0])[i] = Element(float(i % 7) * 0.01f);
  for (int i = threadIdx.x; i < kWarpGroups * kGroups * N * C::kK; i += blockDim.x)
    (&sb[0][0][0])[i] = Element(float(i % 5) * 0.01f);
  __syncthreads();
  Tensor tA = make_tensor(make_smem_ptr(sa[wg]), typename C::LayoutA{});
  typename C::Mma mma;
  auto thr = mma.get_thread_slice(lt);
  Tensor sA = thr.partition_A(tA);
  Tensor rA = thr.partition_fragment_A(tA);
  if constexpr (kRS) copy(sA, rA);  // K^T once in registers (a real kernel: ldmatrix per block)
  using Acc = decltype(partition_fragment_C(mma, Shape<Int<C::kM>, Int<N>>{}));
  Acc acc[kGroups];
  CUTE_UNROLL
  for (int g = 0; g < kGroups; ++g) clear(acc[g]);
  for (int r = 0; r < rounds; ++r) {
    if constexpr (kRS) warpgroup_fence_operand(rA);
    warpgroup_arrive();
    CUTE_UNROLL
    for (int g = 0; g < kGroups; ++g) {
      Tensor tB = make_tensor(make_smem_ptr(sb[wg][g]), typename C::LayoutB{});
      Tensor rB = thr.partition_fragment_B(tB);
      warpgroup_fence_operand(acc[g]);
      CUTE_UNROLL
      for (int kb = 0; kb < size<2>(rA); ++kb) {
        if constexpr (kRS) {
          cute::gemm(mma, rA(_, _, kb), rB(_, _, kb), acc[g]);
        } else {
          Tensor dA = thr.partition_fragment_A(tA);
          cute::gemm(mma, dA(_, _, kb), rB(_, _, kb), acc[g]);
        }
      }
      warpgroup_fence_operand(acc[g]);
    }
    warpgroup_commit_batch();
    warpgroup_wait<0>();
  }
  float s = 0.f;
  CUTE_UNROLL
  for (int g = 0; g < kGroups; ++g)
    for (int i = 0; i < size(acc[g]); ++i) s += acc[g](i);
  if (s == 12345.f) out[threadIdx.x] = s;
}

// mma.sync m16n8k16 bf16: each warp kGroups independent accumulators, eight k16 steps a round.
template <int kGroups>
__global__ void __launch_bounds__(256, 1) mma_sync_kernel(int rounds, float* out) {
  uint32_t a[4] = {0x3c003c00u ^ threadIdx.x, 0x3c003c00u, 0x3c003c00u, 0x3c003c00u};
  uint32_t b[2] = {0x3c003c00u, 0x3c003c00u ^ threadIdx.x};
  float d[kGroups][4] = {};
  for (int r = 0; r < rounds; ++r) {
#pragma unroll
    for (int kb = 0; kb < 8; ++kb) {
#pragma unroll
      for (int g = 0; g < kGroups; ++g)
        asm volatile(
            "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
            "{%8,%9}, {%0,%1,%2,%3};\n"
            : "+f"(d[g][0]), "+f"(d[g][1]), "+f"(d[g][2]), "+f"(d[g][3])
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
    }
  }
  float s = 0.f;
  for (int g = 0; g < kGroups; ++g) s += d[g][0] + d[g][1] + d[g][2] + d[g][3];
  if (s == 12345.f) out[threadIdx.x] = s;
}

static int g_sms = 0;
static float* g_out = nullptr;

template <class F>
static float time_ms(F launch) {
  cudaEvent_t e0, e1;
  cudaEventCreate(&e0);
  cudaEventCreate(&e1);
  launch();
  cudaEventRecord(e0);
  for (int i = 0; i < 5; ++i) launch();
  cudaEventRecord(e1);
  cudaEventSynchronize(e1);
  float ms = 0.f;
  cudaEventElapsedTime(&ms, e0, e1);
  return ms / 5;
}

template <int N, bool kRS, int kGroups, int kWarpGroups>
static void run_wgmma() {
  const int rounds = 4096;
  auto k = wgmma_kernel<N, kRS, kGroups, kWarpGroups>;
  const int smem = kWarpGroups * (64 + kGroups * N) * 128 * 2;
  cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  const float ms = time_ms([&] { k<<<g_sms, 128 * kWarpGroups, smem>>>(rounds, g_out); });
  const double flop = 2.0 * 64 * N * 128 * kGroups * double(rounds) * kWarpGroups * g_sms;
  const cudaError_t err = cudaGetLastError();
  printf("wgmma %s m64n%-3dk16  groups %2d  warpgroups/SM %d : %7.1f TFLOP/s%s\n",
         kRS ? "RS" : "SS", N, kGroups, kWarpGroups, flop / ms * 1e-9,
         err == cudaSuccess ? "" : cudaGetErrorString(err));
}

template <int kGroups>
static void run_mma_sync() {
  const int rounds = 4096;
  const float ms = time_ms([&] { mma_sync_kernel<kGroups><<<g_sms, 256>>>(rounds, g_out); });
  const double flop = 2.0 * 16 * 8 * 16 * 8 * kGroups * double(rounds) * 8 * g_sms;
  printf("mma.sync m16n8k16  groups %2d  warps/SM 8        : %7.1f TFLOP/s\n", kGroups,
         flop / ms * 1e-9);
}

int main() {
  cudaDeviceGetAttribute(&g_sms, cudaDevAttrMultiProcessorCount, 0);
  cudaMalloc(&g_out, 1024 * sizeof(float));
  run_wgmma<8, true, 8, 2>();
  run_wgmma<8, true, 16, 2>();
  run_wgmma<8, true, 8, 3>();
  run_wgmma<8, false, 8, 2>();
  run_wgmma<16, true, 8, 2>();
  run_wgmma<16, true, 8, 3>();
  run_wgmma<16, false, 8, 2>();
  run_wgmma<32, true, 4, 2>();
  run_wgmma<64, true, 2, 2>();
  run_wgmma<64, false, 2, 2>();
  run_wgmma<128, true, 1, 2>();
  run_wgmma<128, false, 1, 2>();
  run_mma_sync<4>();
  run_mma_sync<8>();
  return 0;
}
