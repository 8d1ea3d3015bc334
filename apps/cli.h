// msa_main's command line: plain argv parsing ("--opt value" or "--opt=value"); print_usage()
// documents every option, apply_defaults() fills in what depends on the mode and the device.
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

enum class RunMode { kTrain, kServe };

// Defaults are those of the CPU backend's training shape; apply_defaults() replaces the shape
// options the command line did not give with those of the mode (serve) and the device (GPU).
struct Config {
  RunMode mode = RunMode::kTrain;
  std::vector<int64_t> seqlens{1536, 512};  // both longer than k*Bk: really sparse
  int32_t hq = 8, hkv = 2, d = 64;
  int32_t hi = 2, hik = 1, di = 64;
  int32_t bk = 64, topk = 4, sink = 0, local = 1;
  msa::DType dtype = msa::DType::kBFloat16;
  bool train = true;   // the sparse training step (selection, forward, backward)
  bool warmup = true;  // the warmup step (dense forward and backward with the KL)
  // --mode serve: prefill chunks of `chunk` tokens (0: the device's default), then `decode_steps`
  // steps of `q_len` new tokens per request.
  int64_t chunk = 0;
  int32_t decode_steps = 4, q_len = 4;
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

// Fills in the defaults that depend on the mode and the device; options given on the command
// line keep their values.
//   train, GPU: sequences of 8192 and 4096 tokens, Hq=16, Hkv=2, Hi=2, Hik=1, D=Di=128, Bk=128,
//               k=16 (each sequence attends to at most 2048 of its keys), meaningful on an H200.
//   serve, CPU: prompts of 1536, 600 and 120 tokens (one ends on a page boundary, two decode across
//               partial pages), the training heads, prefill chunks of 512.
//   serve, GPU: 4 prompts of 32768 tokens, the paper's heads Hq=64, Hkv=4, Hi=4, Hik=1,
//               D=Di=128, Bk=128, k=16, prefill chunks of 2048.
inline void apply_defaults(Config* c, bool gpu) {
  const bool serve = c->mode == RunMode::kServe;
  if (!c->was_given("--seqlens") && (gpu || serve))
    c->seqlens = serve ? (gpu ? std::vector<int64_t>(4, 32768) : std::vector<int64_t>{1536, 600, 120})
                       : std::vector<int64_t>{8192, 4096};
  if (c->chunk == 0) c->chunk = gpu ? 2048 : 512;
  if (!gpu) return;
  const int32_t heads = serve ? 64 : 16, groups = serve ? 4 : 2;
  struct {
    const char* opt;
    int32_t* dst;
    int32_t value;
  } const shape[] = {{"--hq", &c->hq, heads},  {"--hkv", &c->hkv, groups}, {"--d", &c->d, 128},
                     {"--hi", &c->hi, groups}, {"--hik", &c->hik, 1},      {"--di", &c->di, 128},
                     {"--bk", &c->bk, 128},    {"--topk", &c->topk, 16}};
  for (const auto& o : shape)
    if (!c->was_given(o.opt)) *o.dst = o.value;
}

inline void print_usage(std::FILE* f, const char* argv0) {
  std::fprintf(f,
R"(usage: %s [options]

--mode train (the default) runs one MSA training step (selection, sparse forward with the exact KL
value, backward with the KL gradient), the warmup step (dense forward/backward with the KL over
the full causal support) and dense causal attention of the same shape, times each stage (median of
--iters runs), checks a random sample of rows against a double-precision reference written from
the contract (docs/contract.md), and prints a table: time, FLOPs of the selected work,
throughput, speedup versus dense. On a GPU the KL branch (KL value, backward with the KL gradient,
warmup step) needs Di == D; with another Di those stages are skipped there.

--mode serve serves a batch of requests from a paged KV cache (docs/contract.md section 6): pages
of Bk tokens behind a shuffled page table, one request per --seqlens entry (its prompt length).
It prefills every prompt in chunks of --chunk tokens (each call: paged_append of the chunk's k, v,
k_idx, then paged_forward with selection over the chunk), then decodes --decode-steps steps of
--q-len new tokens per request (multi-token prediction: paged_append, paged_forward with selection
and max_q_len = q-len; paged_select_blocks alone is timed too). Dense attention over the same
cache (paged_forward, kDense) is timed beside every call. Inputs are random (the check is against
the contract, not a model). A sample of the new tokens' rows (selection, out, lse; sparse and
dense) is checked against the reference applied to the contiguous sequences.

Shape (packed variable-length batch; serve: the prompts); defaults: CPU [GPU]:
  --seqlens L1,L2,...   sequence lengths; 0 is allowed (an empty sequence)   1536,512 [8192,4096]
                        serve: 1536,600,120 [4 x 32768]
  --hq N                main query heads Hq                                    8 [16; serve 64]
  --hkv N               main KV heads Hkv (divides Hq)                         2 [2; serve 4]
  --d N                 main head dim D                                        64 [128]
  --hi N                index query heads Hi (multiple of Hkv, divides Hq)     2 [2; serve 4]
  --hik N               index key heads Hik (divides Hi)                       1 [1]
  --di N                index head dim Di                                      64 [128]
  --bk N                block size Bk in tokens (serve: the page size)         64 [128]
  --topk N              blocks k selected per (token, index head)              4 [16]
  --sink N              forced sink blocks (first N of each sequence)          0
  --local N             forced local blocks (last N up to the own block)       1
  --dtype bf16|fp16|fp32  element type of q, k, v, q_idx, k_idx, dout          bf16
                        (the CUDA backend takes bf16 and fp16)

Run:
  --mode train|serve    a training step, or serving from a paged KV cache      [train]
  --steps train|warmup|both  train: which training step(s) to run; dense
                        always runs                                            [both]
  --chunk N             serve: prefill chunk, tokens per request per call      [512 on CPU, 2048 on GPU]
  --decode-steps N      serve: decode steps after the prefill                  [4]
  --q-len N             serve: new tokens per request per decode step, 1..16   [4]
  --iters N             timed repetitions per stage, the median is reported    [1 on CPU, 20 on GPU]
  --warm N              untimed runs per stage before timing                   [0 on CPU, 3 on GPU]
  --device auto|cpu|cuda  auto: CUDA when libmsa has a CUDA backend and a
                        compute capability 9.0 GPU is visible, else the CPU    [auto]
  --seed S              seed of the random inputs and of the check sample      [1]

Output and check:
  --csv PATH            also write the timing table as CSV to PATH
  --check-rows N        train: tokens sampled for the reference check, as query
                        rows (selection, out, lse, dq, dq_idx) and as key
                        columns (dk, dv, dk_idx); a full pass over every row
                        adds the exact KL value and all lse when it costs
                        <= 25 GFLOP. serve: new-token rows sampled over the
                        prefill calls, and as many over the decode steps       [64]
  --no-check            skip the reference check
  -h, --help            this text

The CPU backend uses MSA_CPU_THREADS threads (default: all hardware threads). GPU times are CUDA
event times on the app's stream; serve times its GPU calls with launch.check_values = false (one
checked, untimed call comes first).
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
    } else if (opt == "--mode") {
      if (val != "train" && val != "serve") {
        *error = bad + ": expected train or serve";
        return ParseResult::kError;
      }
      cfg->mode = val == "serve" ? RunMode::kServe : RunMode::kTrain;
    } else if (opt == "--chunk") {
      if (!parse_int(val, 1, int64_t{1} << 30, &cfg->chunk)) {
        *error = bad + ": expected a positive integer";
        return ParseResult::kError;
      }
    } else if (opt == "--decode-steps" || opt == "--q-len") {
      const bool steps = opt == "--decode-steps";
      if (!parse_int(val, steps ? 0 : 1, steps ? 1000000 : 16, &v)) {
        *error = bad + (steps ? ": expected a non-negative integer" : ": expected an integer in [1, 16]");
        return ParseResult::kError;
      }
      (steps ? cfg->decode_steps : cfg->q_len) = static_cast<int32_t>(v);
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
  // Options of the other mode are refused rather than ignored.
  const char* const serve_only[] = {"--chunk", "--decode-steps", "--q-len"};
  for (const char* o : serve_only)
    if (cfg->mode == RunMode::kTrain && cfg->was_given(o)) {
      *error = std::string(o) + " applies to --mode serve";
      return ParseResult::kError;
    }
  if (cfg->mode == RunMode::kServe && cfg->was_given("--steps")) {
    *error = "--steps applies to --mode train";
    return ParseResult::kError;
  }
  return ParseResult::kOk;
}

}  // namespace msa_app
