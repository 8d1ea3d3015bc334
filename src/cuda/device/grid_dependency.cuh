// Programmatic dependent launch (sm_90), where the library is built with MSA_CUDA_PDL (CMake
// option MSA_CUDA_PDL, on by default). Then host/common.h's launch_grid() launches every kernel
// with programmatic stream serialisation: a kernel's CTAs may be scheduled while the previous
// kernel on the stream still runs, and start the moment it completes instead of after the launch
// gap. Every kernel of this library begins with grid_dependency_begin(): it waits until the
// previous grid has completed and its memory is visible (griddepcontrol.wait), so no access
// moves ahead of the stream's order, then lets the next kernel be scheduled early
// (griddepcontrol.launch_dependents; that kernel waits in turn). Without the option it is empty.
#pragma once

namespace msa::cuda {

__device__ __forceinline__ void grid_dependency_begin() {
#if defined(MSA_CUDA_PDL) && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
}

}  // namespace msa::cuda
