// Entry points: validate, then dispatch on the tensors' device. Backends that are not compiled
// in answer kNotSupported with the reason; nothing falls back silently.
#include "msa/api.h"

#include <exception>
#include <new>
#include <string>

#include "../cpu/backend.h"
#include "validate.h"
#ifdef MSA_WITH_CUDA
#include "../cuda/backend.h"
#endif

namespace msa {
namespace {

using detail::Problem;

Status not_built(const char* fn, Device device) {
  return Status::NotSupported(std::string("msa::") + fn + ": no backend for device type " +
                              (device.type == DeviceType::kCuda ? "CUDA" : "?") +
                              " is built into this library");
}

#ifdef MSA_WITH_CUDA
// Whether the CUDA backend can run here: asked once per process.
bool cuda_usable() {
  static const bool usable = cuda::available();
  return usable;
}

// What the CUDA backend takes beyond validation: 16-bit inputs (`arg` holds the call's dtype; every
// other floating input has the same one) and a Hopper GPU.
Status cuda_ready(const char* fn, const char* arg, const Problem& prob) {
  if (prob.dtype != DType::kFloat16 && prob.dtype != DType::kBFloat16)
    return Status::NotSupported(std::string("msa::") + fn + ": argument '" + arg +
                                "': the CUDA backend takes float16 or bfloat16, got " +
                                dtype_name(prob.dtype) + " (float32 and float64 run on the CPU backend only)");
  if (!cuda_usable())
    return Status::NotSupported(std::string("msa::") + fn +
                                ": no GPU of compute capability 9.0 is visible; the CUDA kernels of this "
                                "library are built for sm_90a (Hopper)");
  return Status::Ok();
}
#endif

// Runs `body` (which returns a Status) and turns exceptions into kInternal.
template <class F>
Status guarded(const char* fn, F&& body) {
  try {
    return body();
  } catch (const std::bad_alloc&) {
    return Status::Internal(std::string("msa::") + fn + ": out of host memory");
  } catch (const std::exception& e) {
    return Status::Internal(std::string("msa::") + fn + ": " + e.what());
  }
}

}  // namespace

Status select_blocks(const SelectParams& p) {
  return guarded("select_blocks", [&]() -> Status {
    Problem prob;
    MSA_TRY(detail::validate(p, &prob));
    if (p.q_idx.device.type != DeviceType::kCpu) {
#ifdef MSA_WITH_CUDA
      if (p.q_idx.device.type == DeviceType::kCuda) {
        MSA_TRY(cuda_ready("select_blocks", "q_idx", prob));
        return cuda::select_blocks(prob, p);
      }
#endif
      return not_built("select_blocks", p.q_idx.device);
    }
    return cpu::select_blocks(prob, p.q_idx, p.k_idx, p.block_idx, p.lse_idx);
  });
}

Status forward(const ForwardParams& p) {
  return guarded("forward", [&]() -> Status {
    Problem prob;
    MSA_TRY(detail::validate(p, &prob));
    if (p.q.device.type != DeviceType::kCpu) {
#ifdef MSA_WITH_CUDA
      if (p.q.device.type == DeviceType::kCuda) {
        MSA_TRY(cuda_ready("forward", "q", prob));
        return cuda::attention_forward(prob, p);
      }
#endif
      return not_built("forward", p.q.device);
    }
    const bool sparse = prob.opts.mode == Mode::kSparse;
    if (sparse && p.select) MSA_TRY(cpu::select_blocks(prob, p.q_idx, p.k_idx, p.block_idx, TensorRef{}));
    MSA_TRY(cpu::attention_forward(prob, p));
    if (!p.kl.defined()) return Status::Ok();
    return cpu::kl_divergence(prob, detail::kl_params_of(p));
  });
}

Status backward(const BackwardParams& p) {
  return guarded("backward", [&]() -> Status {
    Problem prob;
    MSA_TRY(detail::validate(p, &prob));
    if (p.q.device.type != DeviceType::kCpu) {
#ifdef MSA_WITH_CUDA
      if (p.q.device.type == DeviceType::kCuda) {
        MSA_TRY(cuda_ready("backward", "q", prob));
        return cuda::attention_backward(prob, p);
      }
#endif
      return not_built("backward", p.q.device);
    }
    return cpu::attention_backward(prob, p);
  });
}

Status kl_divergence(const KlParams& p) {
  return guarded("kl_divergence", [&]() -> Status {
    Problem prob;
    MSA_TRY(detail::validate(p, &prob));
    if (p.q.device.type != DeviceType::kCpu) {
#ifdef MSA_WITH_CUDA
      if (p.q.device.type == DeviceType::kCuda) {
        MSA_TRY(cuda_ready("kl_divergence", "q", prob));
        return cuda::kl_divergence(prob, p);
      }
#endif
      return not_built("kl_divergence", p.q.device);
    }
    return cpu::kl_divergence(prob, p);
  });
}

Status paged_select_blocks(const PagedSelectParams& p) {
  return guarded("paged_select_blocks", [&]() -> Status {
    Problem prob;
    MSA_TRY(detail::validate(p, &prob));
    if (p.q_idx.device.type != DeviceType::kCpu) {
#ifdef MSA_WITH_CUDA
      if (p.q_idx.device.type == DeviceType::kCuda) {
        MSA_TRY(cuda_ready("paged_select_blocks", "q_idx", prob));
        return cuda::paged_select_blocks(prob, p);
      }
#endif
      return not_built("paged_select_blocks", p.q_idx.device);
    }
    return cpu::paged_select_blocks(prob, p);
  });
}

Status paged_forward(const PagedForwardParams& p) {
  return guarded("paged_forward", [&]() -> Status {
    Problem prob;
    MSA_TRY(detail::validate(p, &prob));
    if (p.q.device.type != DeviceType::kCpu) {
#ifdef MSA_WITH_CUDA
      if (p.q.device.type == DeviceType::kCuda) {
        // FP8 queries: the call's dtype is out's.
        MSA_TRY(cuda_ready("paged_forward", p.q.dtype == DType::kFloat8E4M3 ? "out" : "q", prob));
        return cuda::paged_forward(prob, p);
      }
#endif
      return not_built("paged_forward", p.q.device);
    }
    return cpu::paged_forward(prob, p);
  });
}

Status paged_append(const PagedAppendParams& p) {
  return guarded("paged_append", [&]() -> Status {
    Problem prob;
    MSA_TRY(detail::validate(p, &prob));
    const Device device = p.cu_seqlens_q.device;
    if (device.type != DeviceType::kCpu) {
#ifdef MSA_WITH_CUDA
      if (device.type == DeviceType::kCuda) {
        // 16-bit rows are copied; rows into an E4M3 cache (float32, bfloat16 or float16) quantised.
        if (!cuda_usable())
          return Status::NotSupported("msa::paged_append: no GPU of compute capability 9.0 is visible; the CUDA "
                                      "kernels of this library are built for sm_90a (Hopper)");
        return cuda::paged_append(p);
      }
#endif
      return not_built("paged_append", device);
    }
    return cpu::paged_append(prob, p);
  });
}

// The CPU backend allocates host memory itself; the CUDA backend's backward and KL value use
// device workspace (reverse index, fixed-point sums), and so do FP8 selection scores (the
// E4M3 copies) and the KV-block forward (partial outputs).
namespace {
template <class P, class F>
size_t cuda_workspace(const P& p, const TensorRef& lead, F&& size_of) {
#ifdef MSA_WITH_CUDA
  if (lead.device.type != DeviceType::kCuda) return 0;
  Problem prob;
  if (!detail::validate(p, &prob).ok()) return 0;  // refused by the call
  return size_of(prob, p);
#else
  (void)p;
  (void)lead;
  (void)size_of;
  return 0;
#endif
}
}  // namespace

size_t workspace_size(const SelectParams& p) {
#ifdef MSA_WITH_CUDA
  return cuda_workspace(p, p.q_idx, [](const Problem& pr, const SelectParams& x) { return cuda::select_workspace(pr, x); });
#else
  return cuda_workspace(p, p.q_idx, 0);
#endif
}

size_t workspace_size(const ForwardParams& p) {
#ifdef MSA_WITH_CUDA
  return cuda_workspace(p, p.q, [](const Problem& pr, const ForwardParams& x) { return cuda::forward_workspace(pr, x); });
#else
  return cuda_workspace(p, p.q, 0);
#endif
}
size_t workspace_size(const BackwardParams& p) {
#ifdef MSA_WITH_CUDA
  return cuda_workspace(p, p.q, [](const Problem& pr, const BackwardParams& x) { return cuda::backward_workspace(pr, x); });
#else
  return cuda_workspace(p, p.q, 0);
#endif
}
size_t workspace_size(const KlParams& p) {
#ifdef MSA_WITH_CUDA
  return cuda_workspace(p, p.q, [](const Problem& pr, const KlParams& x) { return cuda::kl_workspace(pr, x); });
#else
  return cuda_workspace(p, p.q, 0);
#endif
}

size_t workspace_size(const PagedSelectParams& p) {
#ifdef MSA_WITH_CUDA
  return cuda_workspace(p, p.q_idx, [](const Problem& pr, const PagedSelectParams& x) { return cuda::paged_select_workspace(pr, x); });
#else
  return cuda_workspace(p, p.q_idx, 0);
#endif
}
size_t workspace_size(const PagedForwardParams& p) {
#ifdef MSA_WITH_CUDA
  return cuda_workspace(p, p.q, [](const Problem& pr, const PagedForwardParams& x) { return cuda::paged_forward_workspace(pr, x); });
#else
  return cuda_workspace(p, p.q, 0);
#endif
}

bool backend_available(DeviceType device) {
#ifdef MSA_WITH_CUDA
  if (device == DeviceType::kCuda) return cuda_usable();
#endif
  return device == DeviceType::kCpu;
}

const char* version() { return MSA_VERSION_STRING; }

}  // namespace msa
