// msa_main: the project's main job, in two modes.
//
// --mode train (the default) runs an MSA training step (selection, sparse forward with the exact
// KL value, backward with the KL gradient), the warmup step and dense causal attention of the same
// shape through the public API, times every stage, checks a sample of the results against a
// double-precision reference written from the contract (docs/contract.md), and prints a table.
//
// --mode serve serves a batch of requests from a paged KV cache (docs/contract.md §6): it prefills
// their prompts in chunks (paged_append, then paged_forward with selection over the chunk) and
// decodes a few steps of multi-token prediction (q_len new tokens per request and step), times
// every call beside dense attention over the same cache, checks a sample of the new tokens' rows
// against the reference applied to the contiguous sequences (apps/serve.h), and prints a table.
//
// On a GPU (the CUDA backend, when libmsa has it and a compute capability 9.0 GPU is visible) both
// modes run on a larger default shape (training: the KL branch there needs Di == D; with another
// Di the KL value, the backward and the warmup step are reported skipped).
//
// Progress goes to stderr; the report (shape, backend, KL values, table, check) to stdout.
// Run with --help for the options. Helpers: apps/*.h.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <random>
#include <stdexcept>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "cli.h"
#include "device.h"
#include "flops.h"
#include "msa/msa.h"
#include "reference.h"
#include "report.h"
#include "serve.h"
#include "workload.h"

namespace msa_app {
namespace {

enum ExitCode { kExitOk = 0, kExitCheckFailed = 1, kExitUsage = 2, kExitApiError = 3 };

// An msa call returned a non-ok Status.
struct ApiError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

void ensure_ok(const msa::Status& st, const std::string& stage) {
  if (!st.ok()) throw ApiError(stage + ": " + st.message);
}

// The CPU backend's thread count, resolved as it resolves it (MSA_CPU_THREADS, else all threads).
int cpu_threads(std::string* how) {
  if (const char* env = std::getenv("MSA_CPU_THREADS")) {
    const int v = std::atoi(env);
    if (v > 0) {
      *how = std::string("MSA_CPU_THREADS=") + env;
      return v;
    }
  }
  *how = "all hardware threads; set MSA_CPU_THREADS to change";
  return std::max(1, static_cast<int>(std::thread::hardware_concurrency()));
}

// ---- timed stages -------------------------------------------------------------------------------

// Runs `fn` warm + iters times, the latter timed; returns the median in ms.
double median_ms(Allocator& alloc, int warm, int iters, const std::string& label,
                 const std::function<msa::Status()>& fn) {
  for (int w = 0; w < warm; ++w) ensure_ok(fn(), label);
  std::vector<double> ms;
  for (int it = 0; it < iters; ++it) {
    alloc.synchronize();
    alloc.start_timer();
    const msa::Status st = fn();
    const double t = alloc.stop_timer_ms();
    ensure_ok(st, label);
    ms.push_back(t);
  }
  std::sort(ms.begin(), ms.end());
  const size_t n = ms.size();
  return n % 2 ? ms[n / 2] : 0.5 * (ms[n / 2 - 1] + ms[n / 2]);
}

class StageRunner {
 public:
  StageRunner(Allocator& alloc, int warm, int iters, int total) : alloc_(alloc), warm_(warm), iters_(iters), total_(total) {}

  // Runs `fn` warm + iters times, the latter timed; returns the median in ms.
  double run(const std::string& label, const std::function<msa::Status()>& fn) {
    std::fprintf(stderr, "[%d/%d] %s ...", ++done_, total_, label.c_str());
    std::fflush(stderr);
    const double median = median_ms(alloc_, warm_, iters_, label, fn);
    std::fprintf(stderr, " %.1f ms\n", median);
    return median;
  }

  // A progress line for an untimed stage (the check).
  void announce(const std::string& label) {
    std::fprintf(stderr, "[%d/%d] %s", ++done_, total_, label.c_str());
  }

 private:
  Allocator& alloc_;
  int warm_, iters_, total_, done_ = 0;
};

struct StepTimes {  // medians in ms; NaN when not run
  double select = NAN, forward = NAN, backward = NAN;
};

struct VariantRun {
  Variant variant;
  DeviceOutputs dev;
  HostOutputs host;
  StepTimes ms;
  SupportSize support;
};

VariantRun run_variant(Variant v, const Shape& s, const DeviceInputs& in, Allocator& alloc, Workspace& ws,
                       const Capabilities& can, StageRunner& stages) {
  VariantRun r{v, make_outputs(alloc, s, v, can), {}, {}, {}};
  const std::string name = variant_name(v);
  if (v == Variant::kSparse)
    r.ms.select = stages.run("selection", [&] { return run_select(s, in, r.dev, ws); });
  r.ms.forward = stages.run(name + " forward" + (r.dev.kl.defined() ? " + KL" : ""),
                            [&] { return run_forward(s, v, in, r.dev, ws); });
  if (can.backward)
    r.ms.backward = stages.run(name + " backward" + (has_index(v) ? " + KL grad" : ""),
                               [&] { return run_backward(s, v, in, r.dev, ws); });
  r.host = download(r.dev);
  r.support = v == Variant::kSparse ? sparse_support(s, r.host.block_idx) : dense_support(s);
  return r;
}

// ---- report ---------------------------------------------------------------------------------------

std::vector<TableRow> table_rows(const Shape& s, const std::vector<VariantRun>& runs) {
  const VariantRun& dense = runs.back();  // always run, always last
  const double dfwd = forward_flops(s, dense.support, false), dbwd = backward_flops(s, dense.support, false);
  std::vector<TableRow> rows;
  for (const VariantRun& r : runs) {
    const bool kl_value = !r.host.kl.empty(), backward = std::isfinite(r.ms.backward);
    const bool kl = has_index(r.variant), cmp = r.variant != Variant::kDense;
    const std::string name = variant_name(r.variant);
    const double sel_flops = r.variant == Variant::kSparse ? select_flops(s) : 0.0;
    const double fwd = forward_flops(s, r.support, kl_value), bwd = backward_flops(s, r.support, kl);
    if (r.variant == Variant::kSparse) rows.push_back({"selection", r.ms.select, sel_flops});
    rows.push_back({name + " forward" + (kl_value ? " + KL" : ""), r.ms.forward, fwd, cmp ? dense.ms.forward : NAN,
                    cmp ? dfwd : NAN});
    if (!backward) {  // forward-only device: the sparse "step" is selection + forward
      if (r.variant == Variant::kSparse)
        rows.push_back({"sparse selection + forward", r.ms.select + r.ms.forward, sel_flops + fwd, dense.ms.forward,
                        dfwd});
      continue;
    }
    rows.push_back({name + " backward" + (kl ? " + KL grad" : ""), r.ms.backward, bwd,
                    cmp ? dense.ms.backward : NAN, cmp ? dbwd : NAN});
    const double step_ms = (r.variant == Variant::kSparse ? r.ms.select : 0.0) + r.ms.forward + r.ms.backward;
    rows.push_back({name + " step", step_ms, sel_flops + fwd + bwd,
                    cmp ? dense.ms.forward + dense.ms.backward : NAN, cmp ? dfwd + dbwd : NAN});
  }
  return rows;
}

void print_backend(const DeviceSetup& dev) {
  const bool cpu = dev.allocator->device().type == msa::DeviceType::kCpu;
  std::string how;
  if (cpu) {
    const int threads = cpu_threads(&how);
    std::printf("backend: cpu, %d thread%s (%s)%s%s\n", threads, threads == 1 ? "" : "s", how.c_str(),
                dev.note.empty() ? "" : "; ", dev.note.c_str());
  } else {
    std::printf("backend: %s%s%s\n", dev.allocator->describe().c_str(), dev.note.empty() ? "" : "; ",
                dev.note.c_str());
  }
}

void print_header(const Config& cfg, const Shape& s, const DeviceSetup& dev, int iters, int warm,
                  const std::vector<VariantRun>& runs) {
  std::printf("msa_main (libmsa %s)\n", msa::version());
  std::printf("shape:   %s\n", shape_string(s).c_str());
  const bool cpu = dev.allocator->device().type == msa::DeviceType::kCpu;
  print_backend(dev);
  const Capabilities can = capabilities(dev.allocator->device().type, s);
  if (!can.backward || !can.kl)
    std::printf("stages:  the CUDA KL kernels need Di == D: the backward with the KL gradient, the exact\n"
                "         KL value and the warmup step are skipped here (--device cpu runs them)\n");
  std::printf("timing:  median of %d run(s) per stage after %d untimed%s; seed %llu\n", iters, warm,
              cpu ? "" : " (CUDA events)", static_cast<unsigned long long>(cfg.seed));
  for (const VariantRun& r : runs)
    if (!r.host.kl.empty()) std::printf("KL (%s): %.9g\n", variant_name(r.variant), r.host.kl.get(0));
}

// ---- check ----------------------------------------------------------------------------------------

// Prints one line per quantity; returns whether all passed.
bool report_check(Variant v, const CheckStats& st, size_t sampled) {
  bool ok = true;
  if (st.tokens < static_cast<int64_t>(sampled))
    std::printf("  %-7s (%lld of the %zu sampled tokens checked: reference budget)\n", variant_name(v),
                static_cast<long long>(st.tokens), sampled);
  for (int x = 0; x < CheckStats::kCount; ++x) {
    const ErrStat& e = st.*CheckStats::members()[x];
    if (e.skipped) {
      std::printf("  %-7s %-10s SKIP  (%s)\n", variant_name(v), CheckStats::name(x), e.note.c_str());
      continue;
    }
    ok = ok && e.pass();
    std::printf("  %-7s %-10s %s  ", variant_name(v), CheckStats::name(x), e.pass() ? "PASS" : "FAIL");
    if (&e == &st.selection)
      std::printf("max score deficit %.3g (%.2f of tol), %lld rows, %lld identical to the reference\n", e.max_err,
                  e.worst, static_cast<long long>(e.count), static_cast<long long>(st.selection_identical));
    else
      std::printf("max err %.3g (%.2f of tol), max |ref| %.3g, %lld values\n", e.max_err, e.worst, e.max_ref,
                  static_cast<long long>(e.count));
    if (!e.pass())
      std::printf("          %lld failure(s), first: %s\n", static_cast<long long>(e.failures), e.first_failure.c_str());
  }
  return ok;
}

bool run_checks(const Config& cfg, const Shape& s, const HostInputs& in, const std::vector<VariantRun>& runs,
                msa::DeviceType dev, StageRunner& stages) {
  const std::vector<int64_t> tokens = sample_tokens(s, cfg.check_rows, cfg.seed);
  const Tolerances tol = tolerances_for(s.dtype, dev);
  std::string how;
  const int threads = cpu_threads(&how);
  stages.announce("reference check, " + std::to_string(tokens.size()) + " sampled tokens:");
  std::vector<CheckStats> stats;
  for (const VariantRun& r : runs) {
    const auto t0 = std::chrono::steady_clock::now();
    stats.push_back(Reference(s, in, r.variant, r.host, tol, threads).run(tokens, cfg.seed));
    std::fprintf(stderr, " %s %.1f s", variant_name(r.variant),
                 std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  }
  std::fprintf(stderr, "\n");
  std::printf("\nreference check (%zu sampled tokens as query rows and key columns; rtol %.3g):\n",
              tokens.size(), tol.rtol);
  bool ok = true;
  for (size_t x = 0; x < runs.size(); ++x) ok = report_check(runs[x].variant, stats[x], tokens.size()) && ok;
  return ok;
}

int run_main(const Config& cfg, const DeviceSetup& dev) {
  Allocator& alloc = *dev.allocator;
  const bool cpu = alloc.device().type == msa::DeviceType::kCpu;
  const int iters = cfg.iters > 0 ? cfg.iters : (cpu ? 1 : 20);
  const int warm = cfg.warm >= 0 ? cfg.warm : (cpu ? 0 : 3);
  const Shape s = make_shape(cfg);

  std::string error;
  if (!cfg.csv.empty() && !write_csv(cfg.csv, {}, &error)) {  // fail before the run, not after it
    std::fprintf(stderr, "msa_main: %s\n", error.c_str());
    return kExitUsage;
  }
  const HostInputs host_in = make_inputs(s, cfg.seed);
  const DeviceInputs in = upload_inputs(alloc, host_in);
  Workspace ws(alloc);
  const Capabilities can = capabilities(alloc.device().type, s);
  // The warmup step differs from dense attention only by its KL value and gradient.
  const bool warmup = cfg.warmup && (can.kl || can.backward);
  if (cfg.warmup && !warmup)
    std::fprintf(stderr, "msa_main: the warmup step (dense + KL) needs the KL value or the backward: "
                         "not available for this shape on this device, skipped\n");
  const int bwd = can.backward ? 1 : 0;
  const int total = (cfg.train ? 2 + bwd : 0) + (warmup ? 1 + bwd : 0) + 1 + bwd + (cfg.check ? 1 : 0);
  StageRunner stages(alloc, warm, iters, total);

  std::vector<VariantRun> runs;
  if (cfg.train) runs.push_back(run_variant(Variant::kSparse, s, in, alloc, ws, can, stages));
  if (warmup) runs.push_back(run_variant(Variant::kWarmup, s, in, alloc, ws, can, stages));
  runs.push_back(run_variant(Variant::kDense, s, in, alloc, ws, can, stages));

  print_header(cfg, s, dev, iters, warm, runs);
  const std::vector<TableRow> rows = table_rows(s, runs);
  std::printf("\n");
  print_table(stdout, rows, !cpu);
  std::printf("FLOPs: selected work only (apps/flops.h); KL rows include the KL value / gradient work;\n"
              "step = sum of its stages; vs dense = dense time / this time; ideal = dense FLOPs / these FLOPs.\n");
  if (!can.backward) std::printf("backward: not run (the CUDA KL kernels need Di == D; --device cpu runs it)\n");
  std::fflush(stdout);
  if (!cfg.csv.empty() && !write_csv(cfg.csv, rows, &error)) {
    std::fprintf(stderr, "msa_main: %s\n", error.c_str());
    return kExitUsage;
  }
  if (!cfg.check) {
    std::printf("\nreference check: skipped (--no-check)\n");
    return kExitOk;
  }
  const bool ok = run_checks(cfg, s, host_in, runs, alloc.device().type, stages);
  std::printf("\nresult: %s\n", ok ? "PASS" : "FAIL");
  return ok ? kExitOk : kExitCheckFailed;
}


// ---- serve mode ---------------------------------------------------------------------------------------

struct CallTimes {  // medians in ms; NaN when not run
  double append = NAN, select = NAN, sparse = NAN, dense = NAN;
};

// Times one serving call. On a GPU one call with launch.check_values comes first (untimed; it
// checks the values of cu_seqlens_q, seq_lens and the page table), the timed ones skip the check,
// as a serving loop would. (The CPU backend always checks the values, at no cost.)
template <class P>
double time_call(Allocator& alloc, int warm, int iters, bool gpu, const std::string& label, P params,
                 msa::Status (*api)(const P&)) {
  if (gpu) {
    params.launch.check_values = true;
    ensure_ok(api(params), label);
  }
  params.launch.check_values = !gpu;
  return median_ms(alloc, warm, iters, label, [&] { return api(params); });
}

// The rows of one phase (prefill or decode) and mode (sparse or dense) the reference can afford:
// taken in a seeded random order while their estimated cost fits kSampleBudget.
std::vector<const ServeRow*> affordable_rows(const ServeReference& ref, const std::vector<ServeRow>& rows, bool decode,
                                             bool dense, uint64_t seed) {
  std::vector<const ServeRow*> all, keep;
  for (const ServeRow& r : rows)
    if (r.decode == decode) all.push_back(&r);
  std::shuffle(all.begin(), all.end(), std::mt19937_64(seed + (decode ? 31 : 17) + (dense ? 1 : 0)));
  double cost = 0;
  for (const ServeRow* r : all) {
    cost += ref.cost(*r, dense);
    if (cost > kSampleBudget && !keep.empty()) break;
    keep.push_back(r);
  }
  return keep;
}

bool report_serve_check(const char* phase, const char* mode, const ServeStats& st, size_t sampled) {
  if (st.rows < static_cast<int64_t>(sampled))
    std::printf("  %-7s %-6s (%lld of the %zu sampled rows checked: reference budget)\n", phase, mode,
                static_cast<long long>(st.rows), sampled);
  const bool dense = std::string(mode) == "dense";
  const std::pair<const char*, const ErrStat*> stats[] = {{"selection", &st.selection}, {"out", &st.out}, {"lse", &st.lse}};
  bool ok = true;
  for (const auto& x : stats) {
    const ErrStat& e = *x.second;
    if (dense && x.second == &st.selection) continue;  // no selection
    ok = ok && e.pass();
    std::printf("  %-7s %-6s %-9s %s  ", phase, mode, x.first, e.pass() ? "PASS" : "FAIL");
    if (x.second == &st.selection)
      std::printf("max score deficit %.3g (%.2f of tol), %lld (token, index head) rows, %lld identical to the reference\n",
                  e.max_err, e.worst, static_cast<long long>(e.count), static_cast<long long>(st.identical));
    else
      std::printf("max err %.3g (%.2f of tol), max |ref| %.3g, %lld values\n", e.max_err, e.worst, e.max_ref,
                  static_cast<long long>(e.count));
    if (!e.pass())
      std::printf("          %lld failure(s), first: %s\n", static_cast<long long>(e.failures), e.first_failure.c_str());
  }
  return ok;
}

bool run_serve_checks(const Config& cfg, const ServePlan& plan, const ServeHost& host, const std::vector<ServeRow>& rows,
                      msa::DeviceType dev) {
  const Tolerances tol = tolerances_for(plan.full.dtype, dev);
  const ServeReference ref(plan, host, tol);
  std::string how;
  const int threads = cpu_threads(&how);
  std::fprintf(stderr, "reference check, %zu sampled new-token rows:", rows.size());
  std::printf("\nreference check (sampled new-token rows against the contract on the contiguous sequences; rtol %.3g):\n",
              tol.rtol);
  bool ok = true;
  if (rows.empty()) std::printf("  no rows sampled (--check-rows 0)\n");
  for (const bool decode : {false, true}) {
    size_t sampled = 0;
    for (const ServeRow& r : rows) sampled += r.decode == decode;
    if (sampled == 0) continue;
    for (const bool dense : {false, true}) {
      const auto t0 = std::chrono::steady_clock::now();
      const std::vector<const ServeRow*> todo = affordable_rows(ref, rows, decode, dense, cfg.seed);
      std::vector<ServeStats> per(std::max(1, threads));
      parallel_items(static_cast<int64_t>(todo.size()), std::max(1, threads),
                     [&](int64_t x, int w) { ref.check(*todo[x], dense, per[w]); });
      ServeStats st;
      for (const ServeStats& p : per) st.merge(p);
      ok = report_serve_check(decode ? "decode" : "prefill", dense ? "dense" : "sparse", st, sampled) && ok;
      std::fprintf(stderr, " %s %s %.1f s", decode ? "decode" : "prefill", dense ? "dense" : "sparse",
                   std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
    }
  }
  std::fprintf(stderr, "\n");
  return ok;
}

std::vector<TableRow> serve_rows(const ServePlan& plan, const std::vector<CallTimes>& ms,
                                 const std::vector<CallFlops>& fl) {
  std::vector<TableRow> rows;
  const int np = plan.prefill_calls, nd = plan.decode_calls();
  auto sum = [&](int from, int to, auto field) {
    double x = 0;
    for (int c = from; c < to; ++c) x += field(c);
    return x;
  };
  auto phase = [&](const char* name, int from, int to, bool mean) {
    if (to <= from) return;
    const double div = mean ? to - from : 1;
    const double a = sum(from, to, [&](int c) { return ms[c].append; }) / div;
    const double sel = sum(from, to, [&](int c) { return ms[c].select; }) / div;
    const double sp = sum(from, to, [&](int c) { return ms[c].sparse; }) / div;
    const double dn = sum(from, to, [&](int c) { return ms[c].dense; }) / div;
    const double fsel = sum(from, to, [&](int c) { return fl[c].select; }) / div;
    const double fsp = sum(from, to, [&](int c) { return fl[c].select + fl[c].sparse; }) / div;
    const double fdn = sum(from, to, [&](int c) { return fl[c].dense; }) / div;
    const std::string p = name;
    rows.push_back({p + ": append", a, NAN});
    if (std::isfinite(sel)) rows.push_back({p + ": selection only", sel, fsel});
    rows.push_back({p + ": select + attention", sp, fsp, dn, fdn});
    rows.push_back({p + ": dense attention", dn, fdn});
    rows.push_back({p + (mean ? ": step" : ": all chunks"), a + sp, fsp, a + dn, fdn});
  };
  phase("prefill", 0, np, false);
  if (np > 1) {
    const int c = np - 1;
    rows.push_back({"prefill: last chunk", ms[c].append + ms[c].sparse, fl[c].select + fl[c].sparse,
                    ms[c].append + ms[c].dense, fl[c].dense});
  }
  phase("decode", np, np + nd, true);
  return rows;
}

int run_serve(const Config& cfg, const DeviceSetup& dev) {
  Allocator& alloc = *dev.allocator;
  const bool cpu = alloc.device().type == msa::DeviceType::kCpu;
  const int iters = cfg.iters > 0 ? cfg.iters : (cpu ? 1 : 20);
  const int warm = cfg.warm >= 0 ? cfg.warm : (cpu ? 0 : 3);
  std::string error, how;
  if (!cfg.csv.empty() && !write_csv(cfg.csv, {}, &error)) {  // fail before the run, not after it
    std::fprintf(stderr, "msa_main: %s\n", error.c_str());
    return kExitUsage;
  }
  const int threads = cpu_threads(&how);
  const ServePlan plan = make_serve_plan(cfg);
  const Shape& f = plan.full;
  const ServeHost host = make_serve_host(plan, cfg.seed, threads);
  ServeDevice d = make_serve_device(alloc, plan);
  Workspace ws(alloc);

  const int np = plan.prefill_calls, nd = plan.decode_calls(), ncalls = np + nd;
  const int64_t check_rows = cfg.check ? cfg.check_rows : 0;
  std::mt19937_64 rng(cfg.seed ^ 0x9e3779b97f4a7c15ull);
  std::vector<CallTimes> ms;
  std::vector<CallFlops> fl;
  std::vector<ServeRow> rows;
  for (int ci = 0; ci < ncalls; ++ci) {
    const ServeCall& c = plan.calls[ci];
    const std::string name = c.name(c.decode ? nd : np);
    std::fprintf(stderr, "[%d/%d] %s, %lld new tokens:", ci + 1, ncalls, name.c_str(), static_cast<long long>(c.Tq()));
    std::fflush(stderr);
    const ServeCallHost h = load_call(alloc, plan, host, c, d, cfg.seed, threads);
    CallTimes t;
    msa::PagedAppendParams ap = append_params(plan, d, c);
    ap.launch.stream = alloc.stream();
    t.append = time_call(alloc, warm, iters, !cpu, name + ": paged_append", ap, &msa::paged_append);
    if (c.decode) {  // the indexer alone (paged_forward below selects again)
      msa::PagedSelectParams sp = select_params(plan, d, c);
      ws.attach(&sp);
      t.select = time_call(alloc, warm, iters, !cpu, name + ": paged_select_blocks", sp, &msa::paged_select_blocks);
    }
    msa::PagedForwardParams fp = forward_params(plan, d, c, false);
    ws.attach(&fp);
    t.sparse = time_call(alloc, warm, iters, !cpu, name + ": paged_forward (select)", fp, &msa::paged_forward);
    msa::PagedForwardParams dp = forward_params(plan, d, c, true);
    ws.attach(&dp);
    t.dense = time_call(alloc, warm, iters, !cpu, name + ": paged_forward (dense)", dp, &msa::paged_forward);
    ms.push_back(t);
    fl.push_back(call_flops(plan, c, d.block_idx.download()));
    const int64_t calls_of_phase = c.decode ? nd : np;
    const int64_t quota = (check_rows + calls_of_phase - 1) / calls_of_phase;
    for (int64_t x : sample_call_rows(c, quota, rng)) rows.push_back(capture_row(alloc, plan, c, ci, h, d, x));
    std::fprintf(stderr, " append %.3g ms,", t.append);
    if (c.decode) std::fprintf(stderr, " selection %.3g ms,", t.select);
    std::fprintf(stderr, " select + attention %.3g ms, dense %.3g ms\n", t.sparse, t.dense);
  }

  std::printf("msa_main (libmsa %s), serving from a paged KV cache\n", msa::version());
  std::printf("batch:   %s\n", serve_string(plan).c_str());
  const double mib = 1.0 / (1 << 20), esz = static_cast<double>(msa::dtype_size(f.dtype));
  std::printf("cache:   %lld pages of %d tokens behind a shuffled page table (%lld columns); K+V %.1f MiB, "
              "k_idx %.1f MiB\n",
              static_cast<long long>(plan.pages), f.Bk, static_cast<long long>(plan.max_pages),
              2.0 * plan.pages * f.Bk * f.Hkv * f.D * esz * mib, 1.0 * plan.pages * f.Bk * f.Hik * f.Di * esz * mib);
  print_backend(dev);
  std::printf("timing:  median of %d run(s) per call after %d untimed%s; seed %llu\n", iters, warm,
              cpu ? "" : " (CUDA events; launch.check_values off, after one checked call)",
              static_cast<unsigned long long>(cfg.seed));
  const std::vector<TableRow> table = serve_rows(plan, ms, fl);
  std::printf("\n");
  print_table(stdout, table, !cpu);
  std::printf("FLOPs: selected work only at the new tokens' positions (apps/serve.h); prefill rows: sums over\n"
              "the chunks; decode rows: means over the steps; append has none; vs dense = the same row with\n"
              "dense attention over the same cache in place of select + attention; ideal = the FLOP ratio.\n");
  if (nd > 0) {
    double sp = 0, dn = 0;
    for (int c = np; c < ncalls; ++c) sp += ms[c].append + ms[c].sparse, dn += ms[c].append + ms[c].dense;
    const double tokens = static_cast<double>(f.nseq()) * plan.q_len;
    std::printf("decode:  %.0f new tokens per step (%lld requests x q_len %d): %.4g tokens/s sparse, %.4g dense\n",
                tokens, static_cast<long long>(f.nseq()), plan.q_len, tokens * nd / (sp * 1e-3),
                tokens * nd / (dn * 1e-3));
  }
  std::fflush(stdout);
  if (!cfg.csv.empty() && !write_csv(cfg.csv, table, &error)) {
    std::fprintf(stderr, "msa_main: %s\n", error.c_str());
    return kExitUsage;
  }
  if (!cfg.check) {
    std::printf("\nreference check: skipped (--no-check)\n");
    return kExitOk;
  }
  const bool ok = run_serve_checks(cfg, plan, host, rows, alloc.device().type);
  std::printf("\nresult: %s\n", ok ? "PASS" : "FAIL");
  return ok ? kExitOk : kExitCheckFailed;
}

}  // namespace
}  // namespace msa_app

int main(int argc, char** argv) {
  using namespace msa_app;
  Config cfg;
  std::string error;
  switch (parse_args(argc, argv, &cfg, &error)) {
    case ParseResult::kHelp:
      print_usage(stdout, argv[0]);
      return kExitOk;
    case ParseResult::kError:
      std::fprintf(stderr, "msa_main: %s\n", error.c_str());
      return kExitUsage;
    case ParseResult::kOk:
      break;
  }
  DeviceSetup dev;
  try {
    if (!resolve_device(cfg.device, &dev, &error)) {
      std::fprintf(stderr, "msa_main: %s\n", error.c_str());
      return kExitUsage;
    }
  } catch (const std::exception& e) {  // a CUDA error while setting up the device
    std::fprintf(stderr, "msa_main: %s\n", e.what());
    return kExitUsage;
  }
  const bool gpu = dev.allocator->device().type == msa::DeviceType::kCuda;
  apply_defaults(&cfg, gpu);
  if (gpu) {
    if (cfg.dtype != msa::DType::kBFloat16 && cfg.dtype != msa::DType::kFloat16) {
      std::fprintf(stderr, "msa_main: --dtype fp32: the CUDA backend takes bf16 and fp16 (fp32 runs with --device cpu)\n");
      return kExitUsage;
    }
  }
  try {
    return cfg.mode == RunMode::kServe ? run_serve(cfg, dev) : run_main(cfg, dev);
  } catch (const ApiError& e) {
    std::fflush(stdout);
    std::fprintf(stderr, "\nmsa_main: msa call failed in %s\n", e.what());
    return kExitApiError;
  } catch (const std::exception& e) {
    std::fflush(stdout);
    std::fprintf(stderr, "\nmsa_main: %s\n", e.what());
    return kExitApiError;
  }
}
