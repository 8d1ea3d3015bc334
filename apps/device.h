// Where msa_main's tensors live: an allocator abstraction over the device memory, owning device
// tensors, and the choice of device.
//
// Today only the host implementation exists (the library's only backend is the CPU). A CUDA path
// needs exactly one more Allocator (cudaMalloc / cudaMemcpy / cudaMemset / cudaDeviceSynchronize)
// returned by make_allocator() for DeviceType::kCuda; everything else in the app reaches device
// memory only through this interface and reads results back with DeviceTensor::download().
#pragma once

#include <sys/stat.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <new>
#include <string>
#include <utility>
#include <vector>

#include "host_tensor.h"
#include "msa/api.h"
#include "msa/types.h"

namespace msa_app {

class Allocator {
 public:
  virtual ~Allocator() = default;
  virtual msa::Device device() const = 0;
  virtual void* allocate(size_t bytes) = 0;  // never null; throws std::bad_alloc
  virtual void release(void* p) = 0;
  virtual void copy_to_device(void* dst, const void* src, size_t bytes) = 0;
  virtual void copy_to_host(void* dst, const void* src, size_t bytes) = 0;
  virtual void fill(void* dst, unsigned char byte, size_t bytes) = 0;
  // Waits for all work queued on the device (before reading a timer). No-op on the host.
  virtual void synchronize() = 0;
};

class HostAllocator final : public Allocator {
 public:
  msa::Device device() const override { return {msa::DeviceType::kCpu, 0}; }
  void* allocate(size_t bytes) override {
    void* p = std::malloc(bytes > 0 ? bytes : 1);
    if (!p) throw std::bad_alloc();
    return p;
  }
  void release(void* p) override { std::free(p); }
  // (bytes == 0: an empty host vector may hand over a null pointer, which memcpy must not see.)
  void copy_to_device(void* dst, const void* src, size_t bytes) override {
    if (bytes) std::memcpy(dst, src, bytes);
  }
  void copy_to_host(void* dst, const void* src, size_t bytes) override {
    if (bytes) std::memcpy(dst, src, bytes);
  }
  void fill(void* dst, unsigned char byte, size_t bytes) override {
    if (bytes) std::memset(dst, byte, bytes);
  }
  void synchronize() override {}
};

// An owning contiguous tensor in the allocator's memory. Move-only.
class DeviceTensor {
 public:
  DeviceTensor() = default;
  DeviceTensor(Allocator& alloc, msa::DType dtype, std::vector<int64_t> shape)
      : alloc_(&alloc), dtype_(dtype), shape_(std::move(shape)) {
    int64_t n = 1;
    for (int64_t s : shape_) n *= s;
    bytes_ = static_cast<size_t>(n) * msa::dtype_size(dtype_);
    ptr_ = alloc_->allocate(bytes_);
  }
  DeviceTensor(const DeviceTensor&) = delete;
  DeviceTensor& operator=(const DeviceTensor&) = delete;
  DeviceTensor(DeviceTensor&& o) noexcept { *this = std::move(o); }
  DeviceTensor& operator=(DeviceTensor&& o) noexcept {
    if (this != &o) {
      reset();
      std::swap(alloc_, o.alloc_);
      std::swap(ptr_, o.ptr_);
      std::swap(bytes_, o.bytes_);
      dtype_ = o.dtype_;
      shape_ = std::move(o.shape_);
    }
    return *this;
  }
  ~DeviceTensor() { reset(); }

  bool defined() const { return ptr_ != nullptr; }
  const std::vector<int64_t>& shape() const { return shape_; }
  msa::DType dtype() const { return dtype_; }

  // The API's view: contiguous, on the allocator's device. Rank 0 ("not given") when undefined.
  msa::TensorRef ref() const {
    msa::TensorRef t;
    if (!defined()) return t;
    t.data = ptr_;
    t.dtype = dtype_;
    t.device = alloc_->device();
    t.rank = static_cast<int32_t>(shape_.size());
    int64_t stride = 1;
    for (int d = t.rank - 1; d >= 0; --d) {
      t.shape[d] = shape_[d];
      t.stride[d] = stride;
      stride *= shape_[d];
    }
    return t;
  }

  static DeviceTensor upload(Allocator& alloc, const HostTensor& h) {
    DeviceTensor t(alloc, h.dtype(), h.shape());
    alloc.copy_to_device(t.ptr_, h.data(), h.bytes());
    return t;
  }

  HostTensor download() const {
    HostTensor h(dtype_, shape_);
    if (defined()) alloc_->copy_to_host(h.data(), ptr_, bytes_);
    return h;
  }

  // Fills the tensor with a pattern no backend writes (NaN for floats, a huge value for int32),
  // so that an element an entry point forgot to write fails the reference check.
  void poison() {
    if (defined()) alloc_->fill(ptr_, dtype_ == msa::DType::kInt32 ? 0x7f : 0xff, bytes_);
  }

 private:
  void reset() {
    if (ptr_) alloc_->release(ptr_);
    ptr_ = nullptr;
  }

  Allocator* alloc_ = nullptr;
  void* ptr_ = nullptr;
  size_t bytes_ = 0;
  msa::DType dtype_ = msa::DType::kFloat32;
  std::vector<int64_t> shape_;
};

// ---- device choice ----------------------------------------------------------------------------

enum class DeviceChoice { kAuto, kCpu, kCuda };

// Whether an NVIDIA GPU is visible to this process (its device node exists). A CUDA allocator
// would rather ask cudaGetDeviceCount(); the app does not link the CUDA runtime today.
inline bool gpu_present() {
  struct stat st;
  return stat("/dev/nvidia0", &st) == 0 || stat("/dev/nvidiactl", &st) == 0;
}

// The allocator for a device, or nullptr with the reason in *why.
inline std::unique_ptr<Allocator> make_allocator(msa::Device device, std::string* why) {
  if (device.type == msa::DeviceType::kCpu) return std::make_unique<HostAllocator>();
  // CUDA: add a CudaAllocator (cudaMalloc, cudaMemcpy, cudaMemset, cudaDeviceSynchronize) here.
  *why = "msa_main has no CUDA allocator yet (apps/device.h: make_allocator)";
  return nullptr;
}

struct DeviceSetup {
  std::unique_ptr<Allocator> allocator;
  std::string note;  // why auto picked what it picked
};

// --device auto: CUDA when the library has a CUDA backend and a GPU is present, else the CPU.
inline bool resolve_device(DeviceChoice choice, DeviceSetup* setup, std::string* error) {
  const msa::Device cpu{msa::DeviceType::kCpu, 0}, cuda{msa::DeviceType::kCuda, 0};
  const bool lib_cuda = msa::backend_available(msa::DeviceType::kCuda);
  std::string why;
  if (choice == DeviceChoice::kCuda) {
    if (!lib_cuda) {
      *error = "--device cuda: this libmsa has no CUDA backend (msa::backend_available(kCuda) is false)";
      return false;
    }
    if (!gpu_present()) {
      *error = "--device cuda: no NVIDIA GPU is visible";
      return false;
    }
    setup->allocator = make_allocator(cuda, &why);
    if (!setup->allocator) *error = "--device cuda: " + why;
    return setup->allocator != nullptr;
  }
  if (choice == DeviceChoice::kAuto) {
    if (!lib_cuda) {
      setup->note = "auto: libmsa has no CUDA backend";
    } else if (!gpu_present()) {
      setup->note = "auto: no GPU visible";
    } else if ((setup->allocator = make_allocator(cuda, &why))) {
      setup->note = "auto: CUDA backend and GPU present";
      return true;
    } else {
      setup->note = "auto: " + why;
    }
  }
  setup->allocator = make_allocator(cpu, &why);
  return true;
}

}  // namespace msa_app
