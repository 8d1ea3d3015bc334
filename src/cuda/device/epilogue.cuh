// Epilogues: rows of a wgmma accumulator to a [T, H, D] tensor in global memory, rounded to the
// element type in pairs (4-byte stores: the host asks for even strides and 4-byte aligned rows).
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/array.h>

#include "utils.cuh"

namespace msa::cuda::kern {

// Row r of `acc` (row/column view) times `scale` to dst[col], col from the identity view `coord`.
template <class Element, class TAcc, class TCoord>
__device__ __forceinline__ void store_row(Element* dst, const TAcc& acc, const TCoord& coord, int r,
                                          float scale) {
#pragma unroll
  for (int c = 0; c < size<1>(acc); c += 2) {
    cutlass::Array<Element, 2> pair;
    pair[0] = static_cast<Element>(acc(r, c) * scale);
    pair[1] = static_cast<Element>(acc(r, c + 1) * scale);
    *reinterpret_cast<cutlass::Array<Element, 2>*>(dst + get<1>(coord(r, c))) = pair;
  }
}

}  // namespace msa::cuda::kern
