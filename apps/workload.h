// The problem msa_main runs: its shape, random inputs, output tensors per variant, and the calls
// into the public API (select_blocks, forward, backward) that make up the stages.
#pragma once

#include <cmath>
#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "cli.h"
#include "device.h"
#include "host_tensor.h"
#include "msa/msa.h"

namespace msa_app {

// The shape of a run, with the packed batch layout resolved.
struct Shape {
  std::vector<int64_t> seqlens;
  std::vector<int64_t> cu;      // [nseq + 1] offsets
  std::vector<int32_t> seq_of;  // [T] sequence of each token
  int64_t T = 0;
  int32_t Hq = 0, Hkv = 0, D = 0, Hi = 0, Hik = 0, Di = 0;
  int32_t Bk = 0, k = 0, sink = 0, local = 0;
  msa::DType dtype = msa::DType::kBFloat16;
  float scale = 0.f, scale_idx = 0.f;  // passed explicitly, so the reference uses the same values

  int64_t nseq() const { return static_cast<int64_t>(seqlens.size()); }
  int64_t base_of(int64_t g) const { return cu[seq_of[g]]; }  // first token of g's sequence
  int64_t len_of(int64_t g) const { return seqlens[seq_of[g]]; }
  int32_t group() const { return Hq / Hkv; }           // query heads per KV head
  int32_t heads_per_idx() const { return Hq / Hi; }    // query heads per index head
  int32_t idx_per_key() const { return Hi / Hik; }     // index heads per index key head
};

inline Shape make_shape(const Config& c) {
  Shape s;
  s.seqlens = c.seqlens;
  s.cu.assign(1, 0);
  for (int64_t len : s.seqlens) s.cu.push_back(s.cu.back() + len);
  s.T = s.cu.back();
  s.seq_of.resize(s.T);
  for (int64_t q = 0; q < s.nseq(); ++q)
    for (int64_t g = s.cu[q]; g < s.cu[q + 1]; ++g) s.seq_of[g] = static_cast<int32_t>(q);
  s.Hq = c.hq, s.Hkv = c.hkv, s.D = c.d, s.Hi = c.hi, s.Hik = c.hik, s.Di = c.di;
  s.Bk = c.bk, s.k = c.topk, s.sink = c.sink, s.local = c.local;
  s.dtype = c.dtype;
  s.scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(s.D)));
  s.scale_idx = static_cast<float>(1.0 / std::sqrt(static_cast<double>(s.Di)));
  return s;
}

inline std::string shape_string(const Shape& s) {
  std::string lens;
  for (size_t q = 0; q < s.seqlens.size(); ++q) lens += (q ? "," : "") + std::to_string(s.seqlens[q]);
  return "T=" + std::to_string(s.T) + " (" + std::to_string(s.nseq()) + " seqs: " + lens +
         ") Hq=" + std::to_string(s.Hq) + " Hkv=" + std::to_string(s.Hkv) + " D=" + std::to_string(s.D) +
         " Hi=" + std::to_string(s.Hi) + " Hik=" + std::to_string(s.Hik) + " Di=" + std::to_string(s.Di) +
         " Bk=" + std::to_string(s.Bk) + " k=" + std::to_string(s.k) + " sink=" + std::to_string(s.sink) +
         " local=" + std::to_string(s.local) + " dtype=" + short_dtype_name(s.dtype);
}

// ---- inputs -------------------------------------------------------------------------------------

struct HostInputs {
  HostTensor q, k, v, q_idx, k_idx, dout, cu_seqlens;
};

// Standard normal values rounded to the dtype, never zero (a value that rounds to 0 is redrawn).
inline HostTensor random_tensor(msa::DType dt, std::vector<int64_t> shape, std::mt19937_64& rng) {
  HostTensor t(dt, std::move(shape));
  std::normal_distribution<float> normal(0.f, 1.f);
  for (int64_t x = 0; x < t.numel(); ++x) {
    do t.set(x, normal(rng));
    while (t.get(x) == 0.0);
  }
  return t;
}

inline HostInputs make_inputs(const Shape& s, uint64_t seed) {
  std::mt19937_64 rng(seed);
  HostInputs in;
  in.q = random_tensor(s.dtype, {s.T, s.Hq, s.D}, rng);
  in.k = random_tensor(s.dtype, {s.T, s.Hkv, s.D}, rng);
  in.v = random_tensor(s.dtype, {s.T, s.Hkv, s.D}, rng);
  in.q_idx = random_tensor(s.dtype, {s.T, s.Hi, s.Di}, rng);
  in.k_idx = random_tensor(s.dtype, {s.T, s.Hik, s.Di}, rng);
  in.dout = random_tensor(s.dtype, {s.T, s.Hq, s.D}, rng);
  in.cu_seqlens = HostTensor(msa::DType::kInt32, {s.nseq() + 1});
  for (int64_t q = 0; q <= s.nseq(); ++q) in.cu_seqlens.i32()[q] = static_cast<int32_t>(s.cu[q]);
  return in;
}

struct DeviceInputs {
  DeviceTensor q, k, v, q_idx, k_idx, dout, cu_seqlens;
};

inline DeviceInputs upload_inputs(Allocator& a, const HostInputs& h) {
  DeviceInputs d;
  d.q = DeviceTensor::upload(a, h.q);
  d.k = DeviceTensor::upload(a, h.k);
  d.v = DeviceTensor::upload(a, h.v);
  d.q_idx = DeviceTensor::upload(a, h.q_idx);
  d.k_idx = DeviceTensor::upload(a, h.k_idx);
  d.dout = DeviceTensor::upload(a, h.dout);
  d.cu_seqlens = DeviceTensor::upload(a, h.cu_seqlens);
  return d;
}

// ---- variants and their outputs -----------------------------------------------------------------

// kSparse: the MSA training step. kWarmup: dense causal attention with the KL over the full
// causal support (docs/contract.md §5). kDense: plain dense causal attention, no index branch (comparison).
enum class Variant { kSparse, kWarmup, kDense };

inline const char* variant_name(Variant v) {
  switch (v) {
    case Variant::kSparse: return "sparse";
    case Variant::kWarmup: return "warmup";
    case Variant::kDense: return "dense";
  }
  return "?";
}

inline bool has_index(Variant v) { return v != Variant::kDense; }

template <class T>
struct OutputSet {  // DeviceTensor or HostTensor; undefined members are not produced
  T block_idx, out, lse, kl, dq, dk, dv, dq_idx, dk_idx;
};
using DeviceOutputs = OutputSet<DeviceTensor>;
using HostOutputs = OutputSet<HostTensor>;

// What a device computes. The CPU backend: everything. The CUDA backend: everything too, except
// the KL branch (value and gradient) when the index head dim differs from the main one.
struct Capabilities {
  bool kl = true;        // the exact KL value in the forward
  bool backward = true;  // backward with the KL gradient
};

inline Capabilities capabilities(msa::DeviceType dev, const Shape& s) {
  if (dev == msa::DeviceType::kCuda && s.Di != s.D) return {false, false};
  return {};
}

// The outputs of one variant; those the device does not compute stay undefined (not passed).
inline DeviceOutputs make_outputs(Allocator& a, const Shape& s, Variant v, const Capabilities& can) {
  DeviceOutputs o;
  const msa::DType f32 = msa::DType::kFloat32;
  if (v == Variant::kSparse) o.block_idx = DeviceTensor(a, msa::DType::kInt32, {s.T, s.Hi, s.k});
  o.out = DeviceTensor(a, s.dtype, {s.T, s.Hq, s.D});
  o.lse = DeviceTensor(a, f32, {s.T, s.Hq});
  if (can.backward) {
    o.dq = DeviceTensor(a, s.dtype, {s.T, s.Hq, s.D});
    o.dk = DeviceTensor(a, s.dtype, {s.T, s.Hkv, s.D});
    o.dv = DeviceTensor(a, s.dtype, {s.T, s.Hkv, s.D});
  }
  if (has_index(v) && can.kl) o.kl = DeviceTensor(a, f32, {1});
  if (has_index(v) && can.backward) {
    o.dq_idx = DeviceTensor(a, s.dtype, {s.T, s.Hi, s.Di});
    o.dk_idx = DeviceTensor(a, s.dtype, {s.T, s.Hik, s.Di});
  }
  for (DeviceTensor* t : {&o.block_idx, &o.out, &o.lse, &o.kl, &o.dq, &o.dk, &o.dv, &o.dq_idx, &o.dk_idx})
    t->poison();
  return o;
}

inline HostOutputs download(const DeviceOutputs& d) {
  HostOutputs h;
  h.block_idx = d.block_idx.download();
  h.out = d.out.download();
  h.lse = d.lse.download();
  h.kl = d.kl.download();
  h.dq = d.dq.download();
  h.dk = d.dk.download();
  h.dv = d.dv.download();
  h.dq_idx = d.dq_idx.download();
  h.dk_idx = d.dk_idx.download();
  return h;
}

// ---- the stages: one API call each ----------------------------------------------------------------

inline msa::Options options_for(const Shape& s, Variant v) {
  msa::Options o;
  o.mode = v == Variant::kSparse ? msa::Mode::kSparse : msa::Mode::kDense;
  o.block_size = s.Bk;
  o.top_k = s.k;
  o.sink_blocks = s.sink;
  o.local_blocks = s.local;
  o.scale = s.scale;
  o.scale_idx = s.scale_idx;
  return o;
}

// Workspace and stream of one call (0 bytes on the CPU backend, which allocates host memory
// itself; the stream is the allocator's).
class Workspace {
 public:
  explicit Workspace(Allocator& a) : alloc_(a) {}
  template <class P>
  void attach(P* p) {
    p->launch.stream = alloc_.stream();
    const size_t need = msa::workspace_size(*p);
    if (need > 0 && (!buf_.defined() || buf_.shape()[0] < static_cast<int64_t>(need)))
      buf_ = DeviceTensor(alloc_, msa::DType::kInt32, {static_cast<int64_t>((need + 3) / 4)});
    p->launch.workspace = need > 0 ? buf_.ref().data : nullptr;
    p->launch.workspace_bytes = need > 0 ? static_cast<size_t>(buf_.shape()[0]) * 4 : 0;
  }

 private:
  Allocator& alloc_;
  DeviceTensor buf_;
};

inline msa::Status run_select(const Shape& s, const DeviceInputs& in, DeviceOutputs& o, Workspace& ws) {
  msa::SelectParams p;
  p.q_idx = in.q_idx.ref();
  p.k_idx = in.k_idx.ref();
  p.cu_seqlens = in.cu_seqlens.ref();
  p.block_idx = o.block_idx.ref();
  p.opts = options_for(s, Variant::kSparse);
  ws.attach(&p);
  return msa::select_blocks(p);
}

// kSparse reads the block_idx written by run_select; the index variants also return the exact KL
// when the outputs hold it (o.kl undefined: not requested).
inline msa::Status run_forward(const Shape& s, Variant v, const DeviceInputs& in, DeviceOutputs& o,
                               Workspace& ws) {
  msa::ForwardParams p;
  p.q = in.q.ref();
  p.k = in.k.ref();
  p.v = in.v.ref();
  p.cu_seqlens = in.cu_seqlens.ref();
  p.block_idx = o.block_idx.ref();
  if (has_index(v)) {
    p.q_idx = in.q_idx.ref();
    p.k_idx = in.k_idx.ref();
    p.kl = o.kl.ref();
  }
  p.out = o.out.ref();
  p.lse = o.lse.ref();
  p.opts = options_for(s, v);
  ws.attach(&p);
  return msa::forward(p);
}

// dout random; the index variants add the KL gradient (kl_weight 1) into dq_idx and dk_idx.
inline msa::Status run_backward(const Shape& s, Variant v, const DeviceInputs& in, DeviceOutputs& o,
                                Workspace& ws) {
  msa::BackwardParams p;
  p.q = in.q.ref();
  p.k = in.k.ref();
  p.v = in.v.ref();
  p.out = o.out.ref();
  p.lse = o.lse.ref();
  p.dout = in.dout.ref();
  p.cu_seqlens = in.cu_seqlens.ref();
  p.block_idx = o.block_idx.ref();
  p.dq = o.dq.ref();
  p.dk = o.dk.ref();
  p.dv = o.dv.ref();
  if (has_index(v)) {
    p.q_idx = in.q_idx.ref();
    p.k_idx = in.k_idx.ref();
    p.dq_idx = o.dq_idx.ref();
    p.dk_idx = o.dk_idx.ref();
    p.kl_weight = 1.f;
  }
  p.opts = options_for(s, v);
  ws.attach(&p);
  return msa::backward(p);
}

}  // namespace msa_app
