// Dispatch over the kernel variants of this build (the table in src/cuda/sources.cmake, as the
// generated msa_cuda_variants.h): a call names (dtype, head dim, block size) and runs the
// instantiation of that variant, or gets kNotSupported saying it is not built.
#pragma once

#include <string>

#include "msa_cuda_variants.h"
#include "common.h"

namespace msa::cuda {

// One variant, as the tag a dispatch functor receives.
template <class Element_, int kDim_, int kBlockN_>
struct Variant {
  using Element = Element_;
  static constexpr int kDim = kDim_;
  static constexpr int kBlockN = kBlockN_;
};

// Calls f(Variant<...>{}) for the variant (dtype, head dim, block size); `arg` names the argument
// whose dtype and head dim pick it. The kernels' own limits (head dims 64 and 128, block sizes 64
// and 128, 16-bit types) are checked first by the callers' can_* checks (plan.h).
template <class F>
Status dispatch(const char* fn, const char* arg, DType dt, int32_t dim, int32_t bk, F&& f) {
#define MSA_X(E, DT, D, BK) \
  if (dt == DType::DT && dim == D && bk == BK) return f(Variant<E, D, BK>{});
  MSA_CUDA_FOR_EACH_VARIANT(MSA_X)
#undef MSA_X
  return fail(fn, arg,
              std::string(dtype_name(dt)) + " with head dim " + std::to_string(dim) +
                  " and block_size " + std::to_string(bk) +
                  " is not built into this library (MSA_CUDA_FAST_BUILD builds bfloat16, 128, 128 only)");
}

}  // namespace msa::cuda
