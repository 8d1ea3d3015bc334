// Where msa_main's tensors live: an allocator abstraction over the device memory (with the stream
// the msa calls run on and a stage timer), owning device tensors, and the choice of device.
//
// HostAllocator serves the CPU backend. CudaAllocator (built when the library has its CUDA
// backend, MSA_WITH_CUDA) uses cudaMalloc on one compute capability 9.0 GPU, a non-blocking stream
// of its own for copies and msa calls, and CUDA events for timing. Everything else in the app
// reaches device memory only through this interface and reads results back with
// DeviceTensor::download().
#pragma once

#include <sys/stat.h>

#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <new>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "host_tensor.h"
#include "msa/api.h"
#include "msa/types.h"

#ifdef MSA_WITH_CUDA
#include <cuda_runtime.h>
#endif

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
  // Waits for all work queued on the device. No-op on the host.
  virtual void synchronize() = 0;
  // The stream msa calls run on (Launch.stream): null on the host.
  virtual void* stream() const { return nullptr; }
  // One line for the report: the device and what it is.
  virtual std::string describe() const = 0;
  // Times the work issued between the two calls (on the device: CUDA events on stream()).
  virtual void start_timer() = 0;
  virtual double stop_timer_ms() = 0;
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
  std::string describe() const override { return "cpu"; }
  void start_timer() override { t0_ = std::chrono::steady_clock::now(); }
  double stop_timer_ms() override {
    return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0_).count();
  }

 private:
  std::chrono::steady_clock::time_point t0_;
};

#ifdef MSA_WITH_CUDA
// Device memory of one GPU; copies, fills and msa calls are ordered on the allocator's own stream.
// CUDA errors throw std::runtime_error (msa_main reports them and exits with status 3).
class CudaAllocator final : public Allocator {
 public:
  explicit CudaAllocator(int device) : device_(device) {
    check(cudaSetDevice(device), "cudaSetDevice");
    cudaDeviceProp prop;
    check(cudaGetDeviceProperties(&prop, device), "cudaGetDeviceProperties");
    name_ = std::string(prop.name) + ", compute capability " + std::to_string(prop.major) + "." +
            std::to_string(prop.minor) + ", " + std::to_string(prop.totalGlobalMem >> 30) + " GiB";
    check(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking), "cudaStreamCreateWithFlags");
    check(cudaEventCreate(&start_), "cudaEventCreate");
    check(cudaEventCreate(&stop_), "cudaEventCreate");
  }
  ~CudaAllocator() override {
    cudaStreamSynchronize(stream_);
    cudaEventDestroy(start_);
    cudaEventDestroy(stop_);
    cudaStreamDestroy(stream_);
  }
  CudaAllocator(const CudaAllocator&) = delete;
  CudaAllocator& operator=(const CudaAllocator&) = delete;

  msa::Device device() const override { return {msa::DeviceType::kCuda, device_}; }
  void* allocate(size_t bytes) override {
    void* p = nullptr;
    if (cudaMalloc(&p, bytes > 0 ? bytes : 1) != cudaSuccess) {
      cudaGetLastError();
      throw std::bad_alloc();
    }
    return p;
  }
  void release(void* p) override {
    cudaStreamSynchronize(stream_);  // no queued work may still use it
    cudaFree(p);
  }
  // Both copies wait for the stream, so the host buffer is free to go when they return.
  void copy_to_device(void* dst, const void* src, size_t bytes) override {
    if (!bytes) return;
    check(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyHostToDevice, stream_), "cudaMemcpyAsync (to device)");
    synchronize();
  }
  void copy_to_host(void* dst, const void* src, size_t bytes) override {
    if (!bytes) return;
    check(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToHost, stream_), "cudaMemcpyAsync (to host)");
    synchronize();
  }
  void fill(void* dst, unsigned char byte, size_t bytes) override {
    if (bytes) check(cudaMemsetAsync(dst, byte, bytes, stream_), "cudaMemsetAsync");
  }
  void synchronize() override { check(cudaStreamSynchronize(stream_), "cudaStreamSynchronize"); }
  void* stream() const override { return stream_; }
  std::string describe() const override { return "cuda:" + std::to_string(device_) + " (" + name_ + ")"; }
  void start_timer() override { check(cudaEventRecord(start_, stream_), "cudaEventRecord"); }
  double stop_timer_ms() override {
    check(cudaEventRecord(stop_, stream_), "cudaEventRecord");
    check(cudaEventSynchronize(stop_), "cudaEventSynchronize");
    float ms = 0.f;
    check(cudaEventElapsedTime(&ms, start_, stop_), "cudaEventElapsedTime");
    return ms;
  }

  // The first GPU of compute capability 9.x (the one the library's kernels are built for), or -1.
  static int pick_device() {
    int n = 0;
    if (cudaGetDeviceCount(&n) != cudaSuccess) {
      cudaGetLastError();
      return -1;
    }
    for (int d = 0; d < n; ++d) {
      cudaDeviceProp prop;
      if (cudaGetDeviceProperties(&prop, d) == cudaSuccess && prop.major == 9) return d;
    }
    return -1;
  }

 private:
  static void check(cudaError_t e, const char* what) {
    if (e != cudaSuccess) throw std::runtime_error(std::string("CUDA error in ") + what + ": " + cudaGetErrorString(e));
  }

  int device_;
  std::string name_;
  cudaStream_t stream_ = nullptr;
  cudaEvent_t start_ = nullptr, stop_ = nullptr;
};
#endif

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

// Whether an NVIDIA GPU's device node exists (for the message of a build without CUDA).
inline bool gpu_present() {
  struct stat st;
  return stat("/dev/nvidia0", &st) == 0 || stat("/dev/nvidiactl", &st) == 0;
}

// Why the CUDA backend cannot run here (msa::backend_available(kCuda) is false).
inline std::string cuda_unavailable_reason() {
#ifdef MSA_WITH_CUDA
  return "no GPU of compute capability 9.0 is visible (libmsa's CUDA kernels are built for sm_90a)";
#else
  return gpu_present() ? "libmsa was built without its CUDA backend although a GPU is visible "
                         "(configure with a CUDA toolkit on PATH, -DMSA_WITH_CUDA=ON)"
                       : "libmsa was built without its CUDA backend";
#endif
}

// The allocator for a device, or nullptr with the reason in *why.
inline std::unique_ptr<Allocator> make_allocator(msa::Device device, std::string* why) {
  if (device.type == msa::DeviceType::kCpu) return std::make_unique<HostAllocator>();
#ifdef MSA_WITH_CUDA
  const int d = CudaAllocator::pick_device();
  if (d >= 0) return std::make_unique<CudaAllocator>(d);
#endif
  *why = cuda_unavailable_reason();
  return nullptr;
}

struct DeviceSetup {
  std::unique_ptr<Allocator> allocator;
  std::string note;  // why auto picked what it picked
};

// --device auto: CUDA when the library's CUDA backend can run here, else the CPU.
inline bool resolve_device(DeviceChoice choice, DeviceSetup* setup, std::string* error) {
  const msa::Device cpu{msa::DeviceType::kCpu, 0}, cuda{msa::DeviceType::kCuda, 0};
  const bool lib_cuda = msa::backend_available(msa::DeviceType::kCuda);
  std::string why;
  if (choice == DeviceChoice::kCuda) {
    if (!lib_cuda) {
      *error = "--device cuda: " + cuda_unavailable_reason();
      return false;
    }
    setup->allocator = make_allocator(cuda, &why);
    if (!setup->allocator) *error = "--device cuda: " + why;
    return setup->allocator != nullptr;
  }
  if (choice == DeviceChoice::kAuto) {
    if (!lib_cuda) {
      setup->note = "auto: " + cuda_unavailable_reason();
    } else if ((setup->allocator = make_allocator(cuda, &why))) {
      setup->note = "auto: CUDA backend and a compute capability 9.0 GPU";
      return true;
    } else {
      setup->note = "auto: " + why;
    }
  }
  setup->allocator = make_allocator(cpu, &why);
  return true;
}

}  // namespace msa_app
