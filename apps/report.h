// msa_main's timing table: stdout text and optional CSV.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <string>
#include <vector>

namespace msa_app {

struct TableRow {
  std::string stage;
  double ms = NAN;            // median time of the stage (a step: the sum of its stages' medians)
  double flops = NAN;         // counted FLOPs (flops.h)
  double dense_ms = NAN;      // the dense stage it is compared with; NaN: no comparison
  double dense_flops = NAN;

  double rate() const { return flops / (ms * 1e-3); }             // FLOP/s
  double speedup() const { return dense_ms / ms; }                // measured, vs dense
  double ideal() const { return dense_flops / flops; }            // from the FLOP ratio
};

// `tera`: report TFLOP/s (GPU) instead of GFLOP/s (CPU).
inline void print_table(std::FILE* f, const std::vector<TableRow>& rows, bool tera) {
  const double unit = tera ? 1e12 : 1e9;
  // prec < 0: |prec| significant digits (%g), for values of any size.
  auto num = [](double x, int prec, int width) {
    char buf[64];
    if (std::isfinite(x) && prec < 0) std::snprintf(buf, sizeof buf, "%*.*g", width, -prec, x);
    else if (std::isfinite(x)) std::snprintf(buf, sizeof buf, "%*.*f", width, prec, x);
    else std::snprintf(buf, sizeof buf, "%*s", width, "-");
    return std::string(buf);
  };
  int width = 26;  // the stage column: as wide as the longest name
  for (const TableRow& r : rows) width = std::max(width, static_cast<int>(r.stage.size()));
  std::fprintf(f, "%-*s %11s %10s %10s %9s %7s\n", width, "stage", "time ms", "GFLOP", tera ? "TFLOP/s" : "GFLOP/s",
               "vs dense", "ideal");
  for (const TableRow& r : rows) {
    const std::string sp = std::isfinite(r.speedup()) ? num(r.speedup(), 2, 8) + "x" : num(NAN, 0, 9);
    const std::string id = std::isfinite(r.ideal()) ? num(r.ideal(), 2, 6) + "x" : num(NAN, 0, 7);
    const int ms_digits = r.ms < 1 ? 3 : r.ms < 10 ? 2 : 1;  // serving calls take microseconds on a GPU
    std::fprintf(f, "%-*s %s %s %s %s %s\n", width, r.stage.c_str(), num(r.ms, ms_digits, 11).c_str(),
                 num(r.flops / 1e9, -4, 10).c_str(), num(r.rate() / unit, tera ? 1 : 2, 10).c_str(), sp.c_str(),
                 id.c_str());
  }
}

inline bool write_csv(const std::string& path, const std::vector<TableRow>& rows, std::string* error) {
  std::FILE* f = std::fopen(path.c_str(), "w");
  if (!f) {
    *error = "cannot open " + path + " for writing";
    return false;
  }
  auto num = [](double x) {
    char buf[64];
    if (!std::isfinite(x)) return std::string();
    std::snprintf(buf, sizeof buf, "%.6g", x);
    return std::string(buf);
  };
  std::fprintf(f, "stage,time_ms,flops,flops_per_s,speedup_vs_dense,ideal_speedup\n");
  for (const TableRow& r : rows)
    std::fprintf(f, "%s,%s,%s,%s,%s,%s\n", r.stage.c_str(), num(r.ms).c_str(), num(r.flops).c_str(),
                 num(r.rate()).c_str(), num(r.speedup()).c_str(), num(r.ideal()).c_str());
  const bool ok = std::fclose(f) == 0;
  if (!ok) *error = "error writing " + path;
  return ok;
}

}  // namespace msa_app
