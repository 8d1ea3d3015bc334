// Programmatic dependent launch (sm_90), where the library is built with MSA_CUDA_PDL (CMake
// option MSA_CUDA_PDL, on by default). Then host/common.h's launch_grid() launches every kernel
// with programmatic stream serialisation: a kernel's CTAs may be scheduled while the previous
// kernel on the stream still runs, and start the moment it completes instead of after the launch
// gap. Every kernel of this library begins with grid_dependency_begin(): it waits until the
// previous grid has completed and its memory is visible (griddepcontrol.wait), so no access
// moves ahead of the stream's order, then lets the next kernel be scheduled early
// (griddepcontrol.launch_dependents; that kernel waits in turn). Without the option it is empty.
//
// Built with MSA_CUDA_POISON_SMEM = a byte (CMake cache variable, OFF by default: a debugging
// build), the call also fills the CTA's dynamic shared memory with that byte and waits for the
// whole CTA: a kernel that reads shared memory it has not written then computes with the same
// poison every time, which the tests' checks of the outputs see, instead of with whatever the
// SM's last CTA left there. 0xff (ON) reads as NaN in every floating-point format the kernels
// use and -1 as an integer; 0x7f as 3.4e38 and 2139062143 (a count or index runs out of range).
#pragma once

#include <cstdint>

namespace msa::cuda {

__device__ __forceinline__ void grid_dependency_begin() {
#if defined(MSA_CUDA_PDL) && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
#if defined(MSA_CUDA_POISON_SMEM) && defined(__CUDA_ARCH__)
  extern __shared__ __align__(16) uint4 poisoned_smem[];
  uint32_t bytes;
  asm volatile("mov.u32 %0, %%dynamic_smem_size;\n" : "=r"(bytes));
  const uint32_t threads = blockDim.x * blockDim.y * blockDim.z;
  const uint32_t tid = threadIdx.x + blockDim.x * (threadIdx.y + blockDim.y * threadIdx.z);
  constexpr uint32_t kWord = (static_cast<uint32_t>(MSA_CUDA_POISON_SMEM) & 0xffu) * 0x01010101u;
  for (uint32_t i = tid; i < bytes / 16; i += threads) poisoned_smem[i] = make_uint4(kWord, kWord, kWord, kWord);
  for (uint32_t i = bytes / 16 * 16 + tid; i < bytes; i += threads)  // a size not a multiple of 16
    reinterpret_cast<unsigned char*>(poisoned_smem)[i] = static_cast<unsigned char>(kWord);
  __syncthreads();
#endif
}

}  // namespace msa::cuda
