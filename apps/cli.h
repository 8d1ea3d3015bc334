// msa_main's command line: plain argv parsing ("--opt value" or "--opt=value"); print_usage()
// documents every option.
#pragma once

#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <algorithm>
#include <cstdlib>
#include <string>
#include <vector>

#include "device.h"
#include "msa/types.h"

namespace msa_app {

// Defaults are those of the CPU backend's shape; on a GPU, apply_gpu_defaults() replaces the shape
// options the command line did not give.
struct Config {
  std::vector<int64_t> seqlens{1536, 512};  // both longer than k*Bk: really sparse
  int32_t hq = 8, hkv = 2, d = 64;
  int32_t hi = 2, hik = 1, di = 64;
  int32_t bk = 64, topk = 4, sink = 0, local = 1;
  msa::DType dtype = msa::DType::kBFloat16;
  bool train = true;   // the sparse training step (selection, forward, backward)
  bool warmup = true;  // the warmup step (dense forward and backward with the KL)
  int iters = 0;       // timed repetitions; 0: 1 on the CPU, 20 on a GPU
  int warm = -1;       // untimed runs before timing; -1: 0 on the CPU, 3 on a GPU
  DeviceChoice device = DeviceChoice::kAuto;
  std::string csv;
  int64_t check_rows = 64;
  bool check = true;
  uint64_t seed = 1;
  std::vector<std::string> given;  // the options on the command line

  bool was_given(const char* opt) const { return std::find(given.begin(), given.end(), opt) != given.end(); }
};

// The GPU default shape, meaningful on an H200: sequences of 8192 and 4096 tokens, Hq=16, Hkv=2,
// Hi=2, Hik=1, D=Di=128, Bk=128, k=16 (each sequence attends to at most 2048 of its keys).
// Options given on the command line keep their values.
inline void apply_gpu_defaults(Config* c) {
  if (!c->was_given("--seqlens")) c->seqlens = {8192, 4096};
  struct {
    const char* opt;
    int32_t* dst;
    int32_t value;
  } const shape[] = {{"--hq", &c->hq, 16}, {"--hkv", &c->hkv, 2}, {"--d", &c->d, 128},   {"--hi", &c->hi, 2},
                     {"--hik", &c->hik, 1}, {"--di", &c->di, 128}, {"--bk", &c->bk, 128}, {"--topk", &c->topk, 16}};
  for (const auto& o : shape)
    if (!c->was_given(o.opt)) *o.dst = o.value;
}

inline void print_usage(std::FILE* f, const char* argv0) {
  std::fprintf(f,
R"(usage: %s [options]

Runs one MSA training step (selection, sparse forward with the exact KL value, backward with the
KL gradient), the warmup step (dense forward/backward with the KL over the full causal support)
and dense causal attention of the same shape, times each stage (median of --iters runs), checks a
random sample of rows against a double-precision reference written from the contract (docs/contract.md), and prints a
table: time, FLOPs of the selected work, throughput, speedup versus dense.

On a GPU (the CUDA backend: selection and forward kernels only) it runs the selection, the sparse
forward and the dense forward; the backward, the KL value and the warmup step run on the CPU
backend only (--device cpu) and are skipped there.

Shape (packed variable-length batch); defaults: CPU [GPU]:
  --seqlens L1,L2,...   sequence lengths; 0 is allowed (an empty sequence)   1536,512 [8192,4096]
  --hq N                main query heads Hq                                    8 [16]
  --hkv N               main KV heads Hkv (divides Hq)                         2 [2]
  --d N                 main head dim D                                        64 [128]
  --hi N                index query heads Hi (multiple of Hkv, divides Hq)     2 [2]
  --hik N               index key heads Hik (divides Hi)                       1 [1]
  --di N                index head dim Di                                      64 [128]
  --bk N                block size Bk in tokens                                64 [128]
  --topk N              blocks k selected per (token, index head)              4 [16]
  --sink N              forced sink blocks (first N of each sequence)          0
  --local N             forced local blocks (last N up to the own block)       1
  --dtype bf16|fp16|fp32  element type of q, k, v, q_idx, k_idx, dout          bf16
                        (the CUDA backend takes bf16 and fp16)

Run:
  --steps train|warmup|both  which training step(s) to run; dense always runs   [both]
  --iters N             timed repetitions per stage, the median is reported    [1 on CPU, 20 on GPU]
  --warm N              untimed runs per stage before timing                   [0 on CPU, 3 on GPU]
  --device auto|cpu|cuda  auto: CUDA when libmsa has a CUDA backend and a
                        compute capability 9.0 GPU is visible, else the CPU    [auto]
  --seed S              seed of the random inputs and of the check sample      [1]

Output and check:
  --csv PATH            also write the timing table as CSV to PATH
  --check-rows N        tokens sampled for the reference check, as query rows
                        (selection, out, lse, dq, dq_idx) and as key columns
                        (dk, dv, dk_idx); a full pass over every row adds the
                        exact KL value and all lse when it costs <= 25 GFLOP   [64]
  --no-check            skip the reference check
  -h, --help            this text

The CPU backend uses MSA_CPU_THREADS threads (default: all hardware threads). GPU times are CUDA
event times on the app's stream.
Exit status: 0 all checks passed; 1 a check failed; 2 bad command line or device; 3 an msa call
returned an error (its message is printed).
)",
               argv0);
}

namespace cli_detail {

inline bool parse_int(const std::string& s, int64_t lo, int64_t hi, int64_t* out) {
  if (s.empty()) return false;
  errno = 0;
  char* end = nullptr;
  const long long v = std::strtoll(s.c_str(), &end, 10);
  if (errno != 0 || *end != '\0' || v < lo || v > hi) return false;
  *out = v;
  return true;
}

inline bool parse_list(const std::string& s, std::vector<int64_t>* out) {
  out->clear();
  size_t pos = 0;
  while (true) {
    const size_t comma = s.find(',', pos);
    int64_t v;
    if (!parse_int(s.substr(pos, comma == std::string::npos ? std::string::npos : comma - pos), 0,
                   int64_t{1} << 30, &v))
      return false;
    out->push_back(v);
    if (comma == std::string::npos) return true;
    pos = comma + 1;
  }
}

}  // namespace cli_detail

enum class ParseResult { kOk, kHelp, kError };

inline ParseResult parse_args(int argc, char** argv, Config* cfg, std::string* error) {
  using cli_detail::parse_int;
  struct IntOpt {
    const char* name;
    int32_t* dst;
    int64_t lo;
  };
  const IntOpt int_opts[] = {
      {"--hq", &cfg->hq, 1},   {"--hkv", &cfg->hkv, 1},   {"--d", &cfg->d, 1},
      {"--hi", &cfg->hi, 1},   {"--hik", &cfg->hik, 1},   {"--di", &cfg->di, 1},
      {"--bk", &cfg->bk, 1},   {"--topk", &cfg->topk, 1}, {"--sink", &cfg->sink, 0},
      {"--local", &cfg->local, 1},
  };
  for (int a = 1; a < argc; ++a) {
    std::string opt = argv[a], val;
    if (opt == "-h" || opt == "--help") return ParseResult::kHelp;
    if (opt == "--no-check") {
      cfg->check = false;
      continue;
    }
    const size_t eq = opt.find('=');
    if (eq != std::string::npos) {
      val = opt.substr(eq + 1);
      opt = opt.substr(0, eq);
    } else if (opt.rfind("--", 0) == 0 && a + 1 < argc) {
      val = argv[++a];
    } else {
      *error = opt.rfind("--", 0) == 0 ? "option " + opt + " needs a value" : "unexpected argument '" + opt + "'";
      return ParseResult::kError;
    }
    cfg->given.push_back(opt);
    const std::string bad = "bad value '" + val + "' for " + opt;
    int64_t v = 0;
    bool known = false;
    for (const IntOpt& o : int_opts) {
      if (opt != o.name) continue;
      known = true;
      if (!parse_int(val, o.lo, int64_t{1} << 20, &v)) {
        *error = bad + ": expected an integer in [" + std::to_string(o.lo) + ", 2^20]";
        return ParseResult::kError;
      }
      *o.dst = static_cast<int32_t>(v);
    }
    if (known) continue;
    if (opt == "--seqlens") {
      if (!cli_detail::parse_list(val, &cfg->seqlens)) {
        *error = bad + ": expected comma-separated lengths in [0, 2^30], e.g. 2048,2048";
        return ParseResult::kError;
      }
    } else if (opt == "--dtype") {
      if (val == "bf16") cfg->dtype = msa::DType::kBFloat16;
      else if (val == "fp16") cfg->dtype = msa::DType::kFloat16;
      else if (val == "fp32") cfg->dtype = msa::DType::kFloat32;
      else {
        *error = bad + ": expected bf16, fp16 or fp32";
        return ParseResult::kError;
      }
    } else if (opt == "--steps") {
      if (val != "train" && val != "warmup" && val != "both") {
        *error = bad + ": expected train, warmup or both";
        return ParseResult::kError;
      }
      cfg->train = val != "warmup";
      cfg->warmup = val != "train";
    } else if (opt == "--device") {
      if (val == "auto") cfg->device = DeviceChoice::kAuto;
      else if (val == "cpu") cfg->device = DeviceChoice::kCpu;
      else if (val == "cuda") cfg->device = DeviceChoice::kCuda;
      else {
        *error = bad + ": expected auto, cpu or cuda";
        return ParseResult::kError;
      }
    } else if (opt == "--iters" || opt == "--warm") {
      if (!parse_int(val, opt == "--iters" ? 1 : 0, 1000000, &v)) {
        *error = bad + ": expected a " + (opt == "--iters" ? "positive" : "non-negative") + " integer";
        return ParseResult::kError;
      }
      (opt == "--iters" ? cfg->iters : cfg->warm) = static_cast<int>(v);
    } else if (opt == "--check-rows") {
      if (!parse_int(val, 0, int64_t{1} << 30, &cfg->check_rows)) {
        *error = bad + ": expected a non-negative integer";
        return ParseResult::kError;
      }
    } else if (opt == "--seed") {
      errno = 0;
      char* end = nullptr;
      cfg->seed = std::strtoull(val.c_str(), &end, 10);
      if (val.empty() || errno != 0 || *end != '\0' || val[0] == '-') {
        *error = bad + ": expected a non-negative integer";
        return ParseResult::kError;
      }
    } else if (opt == "--csv") {
      if (val.empty()) {
        *error = "--csv needs a path";
        return ParseResult::kError;
      }
      cfg->csv = val;
    } else {
      *error = "unknown option " + opt + " (see --help)";
      return ParseResult::kError;
    }
  }
  return ParseResult::kOk;
}

}  // namespace msa_app
