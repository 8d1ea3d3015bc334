// msa._C: a thin nanobind binding of the public MSA C++ API (include/msa/api.h).
//
// Tensors arrive through DLPack (nb::ndarray<>, so torch tensors are accepted as they are) and
// become msa::TensorRef views; nothing here includes or links torch, so the extension depends on
// the Python version only. The Python layer (python/msa/_ops.py) allocates every output.
//
// Errors: kInvalidArgument -> ValueError, kNotSupported -> NotImplementedError, else RuntimeError.
// Integer options arrive as Python ints of any size; one outside int32 is a ValueError naming it.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>

#include <climits>
#include <cstdint>
#include <optional>
#include <string>

#include "msa/api.h"

namespace nb = nanobind;

namespace {

using Array = nb::ndarray<>;
using OptArray = std::optional<nb::ndarray<>>;

[[noreturn]] void raise(PyObject* type, const std::string& msg) {
  PyErr_SetString(type, msg.c_str());
  throw nb::python_error();
}

void check(const msa::Status& s) {
  if (s.ok()) return;
  switch (s.code) {
    case msa::StatusCode::kInvalidArgument: raise(PyExc_ValueError, s.message);
    case msa::StatusCode::kNotSupported: raise(PyExc_NotImplementedError, s.message);
    default: raise(PyExc_RuntimeError, s.message);
  }
}

[[noreturn]] void bad_arg(const char* name, const std::string& what) {
  raise(PyExc_ValueError, std::string("msa: argument '") + name + "': " + what);
}

// DLPack's type code of float8 e4m3fn (torch.float8_e4m3fn), newer than nanobind's enum.
constexpr uint8_t kDLFloat8E4M3FN = 10;

msa::DType to_dtype(const char* name, nb::dlpack::dtype dt) {
  using nb::dlpack::dtype_code;
  if (dt.lanes == 1) {
    if (dt.code == static_cast<uint8_t>(dtype_code::Float)) {
      if (dt.bits == 16) return msa::DType::kFloat16;
      if (dt.bits == 32) return msa::DType::kFloat32;
      if (dt.bits == 64) return msa::DType::kFloat64;
    } else if (dt.code == static_cast<uint8_t>(dtype_code::Bfloat) && dt.bits == 16) {
      return msa::DType::kBFloat16;
    } else if (dt.code == static_cast<uint8_t>(dtype_code::Int) && dt.bits == 32) {
      return msa::DType::kInt32;
    } else if (dt.code == kDLFloat8E4M3FN && dt.bits == 8) {
      return msa::DType::kFloat8E4M3;
    }
  }
  bad_arg(name, "unsupported dtype (DLPack code " + std::to_string(dt.code) + ", " +
                    std::to_string(dt.bits) + " bits, " + std::to_string(dt.lanes) +
                    " lanes); expected float16, bfloat16, float32, float64, int32 or float8_e4m3fn");
}

msa::TensorRef to_ref(const char* name, const Array& a) {
  msa::TensorRef t;
  const size_t rank = a.ndim();
  if (rank == 0) bad_arg(name, "expected a tensor of rank >= 1, got a 0-dim tensor");
  if (rank > static_cast<size_t>(msa::kMaxRank))
    bad_arg(name, "rank " + std::to_string(rank) + " is above the supported maximum " +
                      std::to_string(msa::kMaxRank));
  t.dtype = to_dtype(name, a.dtype());
  switch (a.device_type()) {
    case nb::device::cpu::value: t.device = {msa::DeviceType::kCpu, 0}; break;
    case nb::device::cuda::value: t.device = {msa::DeviceType::kCuda, a.device_id()}; break;
    default:
      bad_arg(name, "unsupported device (DLPack device type " + std::to_string(a.device_type()) +
                        "); expected CPU or CUDA");
  }
  t.data = a.data();
  t.rank = static_cast<int32_t>(rank);
  for (size_t d = 0; d < rank; ++d) {
    t.shape[d] = static_cast<int64_t>(a.shape(d));
    t.stride[d] = a.stride(d);
  }
  return t;
}

msa::TensorRef to_ref(const char* name, const OptArray& a) {
  return a ? to_ref(name, *a) : msa::TensorRef{};
}

// A Python int that must fit the C++ API's int32_t: out of range (any size) is a ValueError
// naming the argument; the library checks the value's meaning.
int32_t int32_arg(const char* name, const nb::int_& v) {
  int overflow = 0;
  const long long x = PyLong_AsLongLongAndOverflow(v.ptr(), &overflow);
  if (x == -1 && PyErr_Occurred()) throw nb::python_error();
  if (overflow != 0 || x < INT32_MIN || x > INT32_MAX)
    bad_arg(name, "must fit in a 32-bit signed integer, got " + std::string(nb::str(v).c_str()));
  return static_cast<int32_t>(x);
}

msa::KlPass kl_pass_arg(const std::string& s) {
  if (s == "auto") return msa::KlPass::kAuto;
  if (s == "fused") return msa::KlPass::kFused;
  if (s == "separate") return msa::KlPass::kSeparate;
  if (s == "teacher") return msa::KlPass::kTeacher;
  bad_arg("kl_pass", "expected 'auto', 'fused', 'separate' or 'teacher', got '" + s + "'");
}

msa::DqPass dq_pass_arg(const std::string& s) {
  if (s == "auto") return msa::DqPass::kAuto;
  if (s == "query_tile") return msa::DqPass::kQueryTile;
  if (s == "from_ds") return msa::DqPass::kFromDs;
  bad_arg("dq_pass", "expected 'auto', 'query_tile' or 'from_ds', got '" + s + "'");
}

msa::FwdPass fwd_pass_arg(const std::string& s) {
  if (s == "auto") return msa::FwdPass::kAuto;
  if (s == "query_tile") return msa::FwdPass::kQueryTile;
  if (s == "kv_block") return msa::FwdPass::kKvBlock;
  if (s == "split") return msa::FwdPass::kSplit;
  bad_arg("fwd_pass", "expected 'auto', 'query_tile', 'kv_block' or 'split', got '" + s + "'");
}

msa::SelectScores select_scores_arg(const std::string& s) {
  if (s == "input") return msa::SelectScores::kInput;
  if (s == "fp8") return msa::SelectScores::kFp8;
  bad_arg("select_scores", "expected 'input' or 'fp8', got '" + s + "'");
}

// Options.select_scores, Options.fp8_rerank and Options.fp8_rerank_slots.
void set_scores(msa::Options* o, const std::string& select_scores, const nb::int_& fp8_rerank,
                const nb::int_& fp8_rerank_slots = nb::int_(0)) {
  o->select_scores = select_scores_arg(select_scores);
  o->fp8_rerank = int32_arg("fp8_rerank", fp8_rerank);
  o->fp8_rerank_slots = int32_arg("fp8_rerank_slots", fp8_rerank_slots);
}

msa::Options options(const nb::int_& mode, const nb::int_& block_size, const nb::int_& top_k,
                     const nb::int_& sink_blocks, const nb::int_& local_blocks, float scale,
                     float scale_idx, bool deterministic) {
  const int32_t m = int32_arg("mode", mode);
  if (m != 0 && m != 1) bad_arg("mode", "must be 0 (sparse) or 1 (dense), got " + std::to_string(m));
  msa::Options o;
  o.mode = static_cast<msa::Mode>(m);
  o.block_size = int32_arg("block_size", block_size);
  o.top_k = int32_arg("top_k", top_k);
  o.sink_blocks = int32_arg("sink_blocks", sink_blocks);
  o.local_blocks = int32_arg("local_blocks", local_blocks);
  o.scale = scale;
  o.scale_idx = scale_idx;
  o.deterministic = deterministic;
  return o;
}

// Fills `launch` (stream, value checks, workspace) and runs `call` without the GIL. A backend
// that needs device workspace gets it from `alloc(nbytes)`, a Python callable returning a uint8
// tensor on the tensors' device, kept alive for the duration of the call. `check_values`: see
// msa::Launch (a CUDA call that checks values waits for the check; one being captured into a
// CUDA graph must pass false).
//
// `workspace` (the serving calls' plan/run: a buffer sized once by the caller) replaces `alloc`
// when given: the call then allocates nothing; too small a buffer is a ValueError naming it.
template <class P, class F>
void run(P& p, uintptr_t stream, bool check_values, const nb::object& alloc, F&& call,
         const OptArray& workspace = std::nullopt) {
  p.launch.stream = reinterpret_cast<void*>(stream);
  p.launch.check_values = check_values;
  const size_t need = msa::workspace_size(p);
  nb::object ws_obj;
  std::optional<Array> ws;
  if (workspace) {
    if (workspace->nbytes() < need)
      bad_arg("workspace", "this call needs " + std::to_string(need) + " bytes of workspace, got " +
                               std::to_string(workspace->nbytes()));
    p.launch.workspace = workspace->nbytes() > 0 ? workspace->data() : nullptr;
    p.launch.workspace_bytes = workspace->nbytes();
  } else if (need > 0) {
    if (alloc.is_none()) bad_arg("workspace_alloc", "this call needs " + std::to_string(need) + " bytes of workspace but no allocator was given");
    ws_obj = alloc(need);
    ws = nb::cast<Array>(ws_obj);
    if (ws->nbytes() < need) bad_arg("workspace_alloc", "returned fewer than " + std::to_string(need) + " bytes");
    p.launch.workspace = ws->data();
    p.launch.workspace_bytes = ws->nbytes();
  }
  msa::Status s;
  {
    nb::gil_scoped_release release;
    s = call(p);
  }
  check(s);
}

msa::DeviceType parse_device(const std::string& d) {
  if (d == "cpu") return msa::DeviceType::kCpu;
  if (d == "cuda") return msa::DeviceType::kCuda;
  bad_arg("device_type", "expected 'cpu' or 'cuda', got '" + d + "'");
}

// The scales of float8_e4m3 cache tensors (each optional).
struct Scales {
  OptArray k, v, k_idx;
};

msa::PagedCache paged_cache(const OptArray& k, const OptArray& v, const OptArray& k_idx, const Array& page_table,
                            const Array& seq_lens, const Scales& scales = {}) {
  msa::PagedCache c;
  c.k = to_ref("cache.k", k);
  c.v = to_ref("cache.v", v);
  c.k_idx = to_ref("cache.k_idx", k_idx);
  c.page_table = to_ref("cache.page_table", page_table);
  c.seq_lens = to_ref("cache.seq_lens", seq_lens);
  c.k_scale = to_ref("cache.k_scale", scales.k);
  c.v_scale = to_ref("cache.v_scale", scales.v);
  c.k_idx_scale = to_ref("cache.k_idx_scale", scales.k_idx);
  return c;
}

msa::PagedSelectParams paged_select_params(const Array& q_idx, const Array& cu_seqlens_q, const Array& k_idx_cache,
                                           const Array& page_table, const Array& seq_lens, const Array& block_idx,
                                           const nb::int_& max_q_len, const nb::int_& block_size,
                                           const nb::int_& top_k, const nb::int_& sink_blocks,
                                           const nb::int_& local_blocks, float scale_idx,
                                           const OptArray& k_idx_scale, const std::string& select_scores,
                                           const nb::int_& fp8_rerank, const nb::int_& fp8_rerank_slots) {
  msa::PagedSelectParams p;
  p.q_idx = to_ref("q_idx", q_idx);
  p.cu_seqlens_q = to_ref("cu_seqlens_q", cu_seqlens_q);
  p.cache = paged_cache(std::nullopt, std::nullopt, k_idx_cache, page_table, seq_lens,
                        {std::nullopt, std::nullopt, k_idx_scale});
  p.block_idx = to_ref("block_idx", block_idx);
  p.max_q_len = int32_arg("max_q_len", max_q_len);
  p.opts = options(nb::int_(0), block_size, top_k, sink_blocks, local_blocks, 0.f, scale_idx, false);
  set_scores(&p.opts, select_scores, fp8_rerank, fp8_rerank_slots);
  return p;
}

msa::PagedForwardParams paged_forward_params(const Array& q, const Array& cu_seqlens_q, const Array& k_cache,
                                             const Array& v_cache, const OptArray& k_idx_cache,
                                             const Array& page_table, const Array& seq_lens,
                                             const OptArray& block_idx, bool select, const OptArray& q_idx,
                                             const Array& out, const OptArray& lse, const nb::int_& max_q_len,
                                             const nb::int_& mode, const nb::int_& block_size,
                                             const nb::int_& top_k, const nb::int_& sink_blocks,
                                             const nb::int_& local_blocks, float scale, float scale_idx,
                                             const Scales& scales, const OptArray& q_scale) {
  msa::PagedForwardParams p;
  p.q = to_ref("q", q);
  p.q_scale = to_ref("q_scale", q_scale);
  p.cu_seqlens_q = to_ref("cu_seqlens_q", cu_seqlens_q);
  p.cache = paged_cache(k_cache, v_cache, k_idx_cache, page_table, seq_lens, scales);
  p.block_idx = to_ref("block_idx", block_idx);
  p.select = select;
  p.q_idx = to_ref("q_idx", q_idx);
  p.out = to_ref("out", out);
  p.lse = to_ref("lse", lse);
  p.max_q_len = int32_arg("max_q_len", max_q_len);
  p.opts = options(mode, block_size, top_k, sink_blocks, local_blocks, scale, scale_idx, false);
  return p;
}

}  // namespace

NB_MODULE(_C, m) {
  m.doc() = "Low-level binding of the MSA C++ API (DLPack tensors, caller-allocated outputs)";

  m.def("version", []() { return std::string(msa::version()); });
  m.def("backend_available",
        [](const std::string& device_type) { return msa::backend_available(parse_device(device_type)); },
        nb::arg("device_type"));

  m.def(
      "select_blocks",
      [](const Array& q_idx, const Array& k_idx, const OptArray& cu_seqlens, const Array& block_idx,
         const OptArray& lse_idx, const nb::int_& block_size, const nb::int_& top_k,
         const nb::int_& sink_blocks, const nb::int_& local_blocks, float scale_idx,
         const std::string& select_scores, const nb::int_& fp8_rerank, uintptr_t stream,
         bool check_values, const nb::object& workspace_alloc, const OptArray& cu_seqlens_k,
         const nb::int_& fp8_rerank_slots) {
        msa::SelectParams p;
        p.q_idx = to_ref("q_idx", q_idx);
        p.k_idx = to_ref("k_idx", k_idx);
        p.cu_seqlens = to_ref("cu_seqlens", cu_seqlens);
        p.cu_seqlens_k = to_ref("cu_seqlens_k", cu_seqlens_k);
        p.block_idx = to_ref("block_idx", block_idx);
        p.lse_idx = to_ref("lse_idx", lse_idx);
        p.opts = options(nb::int_(0), block_size, top_k, sink_blocks, local_blocks, 0.f, scale_idx, false);
        set_scores(&p.opts, select_scores, fp8_rerank, fp8_rerank_slots);
        run(p, stream, check_values, workspace_alloc, [](const msa::SelectParams& x) { return msa::select_blocks(x); });
      },
      nb::arg("q_idx"), nb::arg("k_idx"), nb::arg("cu_seqlens").none(), nb::arg("block_idx"),
      nb::arg("lse_idx").none() = nb::none(), nb::arg("block_size") = 128, nb::arg("top_k") = 16,
      nb::arg("sink_blocks") = 0, nb::arg("local_blocks") = 1, nb::arg("scale_idx") = 0.f,
      nb::arg("select_scores") = "input", nb::arg("fp8_rerank") = 4, nb::arg("stream") = 0, nb::arg("check_values") = true,
      nb::arg("workspace_alloc") = nb::none(), nb::arg("cu_seqlens_k").none() = nb::none(),
      nb::arg("fp8_rerank_slots") = 0);

  m.def(
      "forward",
      [](const Array& q, const Array& k, const Array& v, const OptArray& cu_seqlens,
         const OptArray& block_idx, bool select, const OptArray& q_idx, const OptArray& k_idx,
         const Array& out, const Array& lse, const OptArray& kl, const nb::int_& mode,
         const nb::int_& block_size, const nb::int_& top_k, const nb::int_& sink_blocks,
         const nb::int_& local_blocks, float scale, float scale_idx, bool deterministic,
         const std::string& fwd_pass, const nb::int_& fwd_chunk_tokens, const std::string& select_scores,
         const nb::int_& fp8_rerank, uintptr_t stream, bool check_values, const nb::object& workspace_alloc,
         const OptArray& cu_seqlens_k, const nb::int_& fp8_rerank_slots) {
        msa::ForwardParams p;
        p.q = to_ref("q", q);
        p.k = to_ref("k", k);
        p.v = to_ref("v", v);
        p.cu_seqlens = to_ref("cu_seqlens", cu_seqlens);
        p.cu_seqlens_k = to_ref("cu_seqlens_k", cu_seqlens_k);
        p.block_idx = to_ref("block_idx", block_idx);
        p.select = select;
        p.q_idx = to_ref("q_idx", q_idx);
        p.k_idx = to_ref("k_idx", k_idx);
        p.out = to_ref("out", out);
        p.lse = to_ref("lse", lse);
        p.kl = to_ref("kl", kl);
        p.opts = options(mode, block_size, top_k, sink_blocks, local_blocks, scale, scale_idx, deterministic);
        p.opts.fwd_pass = fwd_pass_arg(fwd_pass);
        p.opts.fwd_chunk_tokens = int32_arg("fwd_chunk_tokens", fwd_chunk_tokens);
        set_scores(&p.opts, select_scores, fp8_rerank, fp8_rerank_slots);
        run(p, stream, check_values, workspace_alloc, [](const msa::ForwardParams& x) { return msa::forward(x); });
      },
      nb::arg("q"), nb::arg("k"), nb::arg("v"), nb::arg("cu_seqlens").none(),
      nb::arg("block_idx").none(), nb::arg("select"), nb::arg("q_idx").none(),
      nb::arg("k_idx").none(), nb::arg("out"), nb::arg("lse"), nb::arg("kl").none() = nb::none(),
      nb::arg("mode") = 0, nb::arg("block_size") = 128, nb::arg("top_k") = 16,
      nb::arg("sink_blocks") = 0, nb::arg("local_blocks") = 1, nb::arg("scale") = 0.f,
      nb::arg("scale_idx") = 0.f, nb::arg("deterministic") = false, nb::arg("fwd_pass") = "auto",
      nb::arg("fwd_chunk_tokens") = 0, nb::arg("select_scores") = "input", nb::arg("fp8_rerank") = 4,
      nb::arg("stream") = 0,
      nb::arg("check_values") = true, nb::arg("workspace_alloc") = nb::none(),
      nb::arg("cu_seqlens_k").none() = nb::none(), nb::arg("fp8_rerank_slots") = 0);

  m.def(
      "backward",
      [](const Array& q, const Array& k, const Array& v, const Array& out, const Array& lse,
         const Array& dout, const OptArray& cu_seqlens, const OptArray& block_idx, const Array& dq,
         const Array& dk, const Array& dv, const OptArray& q_idx, const OptArray& k_idx,
         const OptArray& dq_idx, const OptArray& dk_idx, const OptArray& kl_grad, float kl_weight,
         const nb::int_& mode, const nb::int_& block_size, float scale, float scale_idx,
         bool deterministic, const std::string& kl_pass, const std::string& dq_pass,
         const nb::int_& bwd_chunk_tokens, uintptr_t stream, bool check_values,
         const nb::object& workspace_alloc, const OptArray& cu_seqlens_k) {
        msa::BackwardParams p;
        p.q = to_ref("q", q);
        p.k = to_ref("k", k);
        p.v = to_ref("v", v);
        p.out = to_ref("out", out);
        p.lse = to_ref("lse", lse);
        p.dout = to_ref("dout", dout);
        p.cu_seqlens = to_ref("cu_seqlens", cu_seqlens);
        p.cu_seqlens_k = to_ref("cu_seqlens_k", cu_seqlens_k);
        p.block_idx = to_ref("block_idx", block_idx);
        p.dq = to_ref("dq", dq);
        p.dk = to_ref("dk", dk);
        p.dv = to_ref("dv", dv);
        p.q_idx = to_ref("q_idx", q_idx);
        p.k_idx = to_ref("k_idx", k_idx);
        p.dq_idx = to_ref("dq_idx", dq_idx);
        p.dk_idx = to_ref("dk_idx", dk_idx);
        p.kl_grad = to_ref("kl_grad", kl_grad);
        p.kl_weight = kl_weight;
        p.opts = options(mode, block_size, nb::int_(16), nb::int_(0), nb::int_(1), scale, scale_idx, deterministic);
        p.opts.kl_pass = kl_pass_arg(kl_pass);
        p.opts.dq_pass = dq_pass_arg(dq_pass);
        p.opts.bwd_chunk_tokens = int32_arg("bwd_chunk_tokens", bwd_chunk_tokens);
        run(p, stream, check_values, workspace_alloc, [](const msa::BackwardParams& x) { return msa::backward(x); });
      },
      nb::arg("q"), nb::arg("k"), nb::arg("v"), nb::arg("out"), nb::arg("lse"), nb::arg("dout"),
      nb::arg("cu_seqlens").none(), nb::arg("block_idx").none(), nb::arg("dq"), nb::arg("dk"),
      nb::arg("dv"), nb::arg("q_idx").none() = nb::none(), nb::arg("k_idx").none() = nb::none(),
      nb::arg("dq_idx").none() = nb::none(), nb::arg("dk_idx").none() = nb::none(),
      nb::arg("kl_grad").none() = nb::none(), nb::arg("kl_weight") = 1.f, nb::arg("mode") = 0,
      nb::arg("block_size") = 128, nb::arg("scale") = 0.f, nb::arg("scale_idx") = 0.f,
      nb::arg("deterministic") = false, nb::arg("kl_pass") = "auto", nb::arg("dq_pass") = "auto",
      nb::arg("bwd_chunk_tokens") = 0, nb::arg("stream") = 0,
      nb::arg("check_values") = true, nb::arg("workspace_alloc") = nb::none(),
      nb::arg("cu_seqlens_k").none() = nb::none());

  m.def(
      "kl_divergence",
      [](const Array& q, const Array& k, const Array& lse, const Array& q_idx, const Array& k_idx,
         const OptArray& cu_seqlens, const OptArray& block_idx, const Array& kl,
         const OptArray& kl_rows, const nb::int_& mode, const nb::int_& block_size, float scale,
         float scale_idx, uintptr_t stream, bool check_values, const nb::object& workspace_alloc,
         const OptArray& cu_seqlens_k) {
        msa::KlParams p;
        p.q = to_ref("q", q);
        p.k = to_ref("k", k);
        p.lse = to_ref("lse", lse);
        p.q_idx = to_ref("q_idx", q_idx);
        p.k_idx = to_ref("k_idx", k_idx);
        p.cu_seqlens = to_ref("cu_seqlens", cu_seqlens);
        p.cu_seqlens_k = to_ref("cu_seqlens_k", cu_seqlens_k);
        p.block_idx = to_ref("block_idx", block_idx);
        p.kl = to_ref("kl", kl);
        p.kl_rows = to_ref("kl_rows", kl_rows);
        p.opts = options(mode, block_size, nb::int_(16), nb::int_(0), nb::int_(1), scale, scale_idx, false);
        run(p, stream, check_values, workspace_alloc, [](const msa::KlParams& x) { return msa::kl_divergence(x); });
      },
      nb::arg("q"), nb::arg("k"), nb::arg("lse"), nb::arg("q_idx"), nb::arg("k_idx"),
      nb::arg("cu_seqlens").none(), nb::arg("block_idx").none(), nb::arg("kl"),
      nb::arg("kl_rows").none() = nb::none(), nb::arg("mode") = 0, nb::arg("block_size") = 128,
      nb::arg("scale") = 0.f, nb::arg("scale_idx") = 0.f, nb::arg("stream") = 0,
      nb::arg("check_values") = true, nb::arg("workspace_alloc") = nb::none(),
      nb::arg("cu_seqlens_k").none() = nb::none());

  // ---- serving over a paged cache (docs/contract.md §6) ----------------------------------------

  m.def(
      "paged_select_blocks",
      [](const Array& q_idx, const Array& cu_seqlens_q, const Array& k_idx_cache, const Array& page_table,
         const Array& seq_lens, const Array& block_idx, const nb::int_& max_q_len, const nb::int_& block_size,
         const nb::int_& top_k, const nb::int_& sink_blocks, const nb::int_& local_blocks, float scale_idx,
         uintptr_t stream, bool check_values, const nb::object& workspace_alloc, const OptArray& workspace,
         const OptArray& k_idx_scale, const std::string& select_scores, const nb::int_& fp8_rerank,
         const nb::int_& fp8_rerank_slots) {
        msa::PagedSelectParams p = paged_select_params(q_idx, cu_seqlens_q, k_idx_cache, page_table, seq_lens,
                                                       block_idx, max_q_len, block_size, top_k, sink_blocks,
                                                       local_blocks, scale_idx, k_idx_scale, select_scores,
                                                       fp8_rerank, fp8_rerank_slots);
        run(p, stream, check_values, workspace_alloc,
            [](const msa::PagedSelectParams& x) { return msa::paged_select_blocks(x); }, workspace);
      },
      nb::arg("q_idx"), nb::arg("cu_seqlens_q"), nb::arg("k_idx_cache"), nb::arg("page_table"),
      nb::arg("seq_lens"), nb::arg("block_idx"), nb::arg("max_q_len") = 0, nb::arg("block_size") = 128,
      nb::arg("top_k") = 16, nb::arg("sink_blocks") = 0, nb::arg("local_blocks") = 1,
      nb::arg("scale_idx") = 0.f, nb::arg("stream") = 0, nb::arg("check_values") = true,
      nb::arg("workspace_alloc") = nb::none(), nb::arg("workspace").none() = nb::none(),
      nb::arg("k_idx_scale").none() = nb::none(), nb::arg("select_scores") = "input", nb::arg("fp8_rerank") = 4,
      nb::arg("fp8_rerank_slots") = 0);

  m.def(
      "paged_select_workspace_size",
      [](const Array& q_idx, const Array& cu_seqlens_q, const Array& k_idx_cache, const Array& page_table,
         const Array& seq_lens, const Array& block_idx, const nb::int_& max_q_len, const nb::int_& block_size,
         const nb::int_& top_k, const nb::int_& sink_blocks, const nb::int_& local_blocks, float scale_idx,
         const OptArray& k_idx_scale, const std::string& select_scores, const nb::int_& fp8_rerank,
         const nb::int_& fp8_rerank_slots) {
        const msa::PagedSelectParams p = paged_select_params(q_idx, cu_seqlens_q, k_idx_cache, page_table,
                                                             seq_lens, block_idx, max_q_len, block_size, top_k,
                                                             sink_blocks, local_blocks, scale_idx, k_idx_scale,
                                                             select_scores, fp8_rerank, fp8_rerank_slots);
        return msa::workspace_size(p);
      },
      nb::arg("q_idx"), nb::arg("cu_seqlens_q"), nb::arg("k_idx_cache"), nb::arg("page_table"),
      nb::arg("seq_lens"), nb::arg("block_idx"), nb::arg("max_q_len") = 0, nb::arg("block_size") = 128,
      nb::arg("top_k") = 16, nb::arg("sink_blocks") = 0, nb::arg("local_blocks") = 1,
      nb::arg("scale_idx") = 0.f, nb::arg("k_idx_scale").none() = nb::none(), nb::arg("select_scores") = "input",
      nb::arg("fp8_rerank") = 4,
      nb::arg("fp8_rerank_slots") = 0);

  m.def(
      "paged_forward",
      [](const Array& q, const Array& cu_seqlens_q, const Array& k_cache, const Array& v_cache,
         const OptArray& k_idx_cache, const Array& page_table, const Array& seq_lens, const OptArray& block_idx,
         bool select, const OptArray& q_idx, const Array& out, const OptArray& lse, const nb::int_& max_q_len,
         const nb::int_& mode, const nb::int_& block_size, const nb::int_& top_k, const nb::int_& sink_blocks,
         const nb::int_& local_blocks, float scale, float scale_idx, uintptr_t stream, bool check_values,
         const nb::object& workspace_alloc, const OptArray& workspace, const OptArray& k_scale,
         const OptArray& v_scale, const OptArray& k_idx_scale, const OptArray& q_scale,
         const std::string& fwd_pass, const nb::int_& fwd_chunk_tokens, const std::string& select_scores,
         const nb::int_& fp8_rerank,
         const nb::int_& fp8_rerank_slots) {
        msa::PagedForwardParams p = paged_forward_params(
            q, cu_seqlens_q, k_cache, v_cache, k_idx_cache, page_table, seq_lens, block_idx, select, q_idx, out,
            lse, max_q_len, mode, block_size, top_k, sink_blocks, local_blocks, scale, scale_idx,
            {k_scale, v_scale, k_idx_scale}, q_scale);
        p.opts.fwd_pass = fwd_pass_arg(fwd_pass);
        p.opts.fwd_chunk_tokens = int32_arg("fwd_chunk_tokens", fwd_chunk_tokens);
        set_scores(&p.opts, select_scores, fp8_rerank, fp8_rerank_slots);
        run(p, stream, check_values, workspace_alloc,
            [](const msa::PagedForwardParams& x) { return msa::paged_forward(x); }, workspace);
      },
      nb::arg("q"), nb::arg("cu_seqlens_q"), nb::arg("k_cache"), nb::arg("v_cache"),
      nb::arg("k_idx_cache").none(), nb::arg("page_table"), nb::arg("seq_lens"), nb::arg("block_idx").none(),
      nb::arg("select"), nb::arg("q_idx").none(), nb::arg("out"), nb::arg("lse").none(),
      nb::arg("max_q_len") = 0, nb::arg("mode") = 0, nb::arg("block_size") = 128, nb::arg("top_k") = 16,
      nb::arg("sink_blocks") = 0, nb::arg("local_blocks") = 1, nb::arg("scale") = 0.f,
      nb::arg("scale_idx") = 0.f, nb::arg("stream") = 0, nb::arg("check_values") = true,
      nb::arg("workspace_alloc") = nb::none(), nb::arg("workspace").none() = nb::none(),
      nb::arg("k_scale").none() = nb::none(), nb::arg("v_scale").none() = nb::none(),
      nb::arg("k_idx_scale").none() = nb::none(), nb::arg("q_scale").none() = nb::none(),
      nb::arg("fwd_pass") = "auto", nb::arg("fwd_chunk_tokens") = 0, nb::arg("select_scores") = "input",
      nb::arg("fp8_rerank") = 4,
      nb::arg("fp8_rerank_slots") = 0);

  m.def(
      "paged_forward_workspace_size",
      [](const Array& q, const Array& cu_seqlens_q, const Array& k_cache, const Array& v_cache,
         const OptArray& k_idx_cache, const Array& page_table, const Array& seq_lens, const OptArray& block_idx,
         bool select, const OptArray& q_idx, const Array& out, const OptArray& lse, const nb::int_& max_q_len,
         const nb::int_& mode, const nb::int_& block_size, const nb::int_& top_k, const nb::int_& sink_blocks,
         const nb::int_& local_blocks, float scale, float scale_idx, const OptArray& k_scale,
         const OptArray& v_scale, const OptArray& k_idx_scale, const OptArray& q_scale,
         const std::string& fwd_pass, const nb::int_& fwd_chunk_tokens, const std::string& select_scores,
         const nb::int_& fp8_rerank,
         const nb::int_& fp8_rerank_slots) {
        msa::PagedForwardParams p = paged_forward_params(
            q, cu_seqlens_q, k_cache, v_cache, k_idx_cache, page_table, seq_lens, block_idx, select, q_idx, out,
            lse, max_q_len, mode, block_size, top_k, sink_blocks, local_blocks, scale, scale_idx,
            {k_scale, v_scale, k_idx_scale}, q_scale);
        p.opts.fwd_pass = fwd_pass_arg(fwd_pass);
        p.opts.fwd_chunk_tokens = int32_arg("fwd_chunk_tokens", fwd_chunk_tokens);
        set_scores(&p.opts, select_scores, fp8_rerank, fp8_rerank_slots);
        return msa::workspace_size(p);
      },
      nb::arg("q"), nb::arg("cu_seqlens_q"), nb::arg("k_cache"), nb::arg("v_cache"),
      nb::arg("k_idx_cache").none(), nb::arg("page_table"), nb::arg("seq_lens"), nb::arg("block_idx").none(),
      nb::arg("select"), nb::arg("q_idx").none(), nb::arg("out"), nb::arg("lse").none(),
      nb::arg("max_q_len") = 0, nb::arg("mode") = 0, nb::arg("block_size") = 128, nb::arg("top_k") = 16,
      nb::arg("sink_blocks") = 0, nb::arg("local_blocks") = 1, nb::arg("scale") = 0.f,
      nb::arg("scale_idx") = 0.f, nb::arg("k_scale").none() = nb::none(),
      nb::arg("v_scale").none() = nb::none(), nb::arg("k_idx_scale").none() = nb::none(),
      nb::arg("q_scale").none() = nb::none(), nb::arg("fwd_pass") = "auto", nb::arg("fwd_chunk_tokens") = 0,
      nb::arg("select_scores") = "input", nb::arg("fp8_rerank") = 4,
      nb::arg("fp8_rerank_slots") = 0);

  m.def(
      "paged_append",
      [](const OptArray& k, const OptArray& v, const OptArray& k_idx, const Array& cu_seqlens_q,
         const OptArray& k_cache, const OptArray& v_cache, const OptArray& k_idx_cache, const Array& page_table,
         const Array& seq_lens, const nb::int_& block_size, uintptr_t stream, bool check_values,
         const OptArray& k_scale, const OptArray& v_scale, const OptArray& k_idx_scale) {
        msa::PagedAppendParams p;
        p.k = to_ref("k", k);
        p.v = to_ref("v", v);
        p.k_idx = to_ref("k_idx", k_idx);
        p.cu_seqlens_q = to_ref("cu_seqlens_q", cu_seqlens_q);
        p.cache = paged_cache(k_cache, v_cache, k_idx_cache, page_table, seq_lens, {k_scale, v_scale, k_idx_scale});
        p.block_size = int32_arg("block_size", block_size);
        p.launch.stream = reinterpret_cast<void*>(stream);
        p.launch.check_values = check_values;
        msa::Status s;
        {
          nb::gil_scoped_release release;
          s = msa::paged_append(p);
        }
        check(s);
      },
      nb::arg("k").none(), nb::arg("v").none(), nb::arg("k_idx").none(), nb::arg("cu_seqlens_q"),
      nb::arg("k_cache").none(), nb::arg("v_cache").none(), nb::arg("k_idx_cache").none(),
      nb::arg("page_table"), nb::arg("seq_lens"), nb::arg("block_size") = 128, nb::arg("stream") = 0,
      nb::arg("check_values") = true, nb::arg("k_scale").none() = nb::none(),
      nb::arg("v_scale").none() = nb::none(), nb::arg("k_idx_scale").none() = nb::none());
}
