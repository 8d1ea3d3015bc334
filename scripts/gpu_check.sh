#!/usr/bin/env bash
# The GPU machine's check, run from the repository root with the prebuilt build/ (libmsa.so,
# msa_tests) present:
#
#   scripts/gpu_check.sh
#
# Stages, each logged under $OUT (default ./gpu-out); a failing stage does not stop the later
# ones, and the exit status is non-zero when any stage failed:
#   build      the Python binding for this machine's python3, staged in build-gpu-py/
#              (scripts/build_binding.sh)                                        -> build.log
#   ptxas      scripts/check_ptxas.sh on the carried build's build.log            -> ptxas.log
#   gtest      build/msa_tests (the C++ suite, its CUDA tests included), GTEST_SHARDS shards
#              side by side (scripts/gtest_shards.sh)                             -> gtest.log
#   pytest     tests/python against the staged package                          -> pytest.log
#   memcheck   compute-sanitizer --tool memcheck on a few small CUDA tests      -> memcheck.log
#   racecheck  compute-sanitizer --tool racecheck on the same tests             -> racecheck.log
#              (both with MSA_TEST_GUARDS=0: each test tensor its own allocation, whose exact
#              bounds the tool checks; the gtest stage's tensors sit between guard bytes instead)
#   poison     the CUDA tests (POISON_FILTER, default Cuda*:*/*Cuda*) on the library of
#              MSA_POISON_BUILD_DIR (default build-poison; skipped where it has no libmsa.so),
#              built with -DMSA_CUDA_POISON_SMEM=0xff: every CTA's shared memory starts as NaN
#              words and -1 integers, so that a read of a word never written shows  -> poison.log
#   bench      bench/bench_forward.py                  -> bench.log, bench.csv, bench.json
#   bench_bwd  bench/bench_backward.py (training step)  -> bench_bwd.log, bench_bwd.csv
#   bench_serving  bench/bench_serving.py (decode, prefill) -> bench_serving.log, .csv, .json
#   variants   (not by default) each library scripts/build_variants.sh made (VARIANTS_DIR,
#              default build-variants/lib: base and one per patch set), with the binding of
#              the build stage: the gtest filter VARIANT_GTEST, then the benchmark command
#              VARIANT_BENCH (a script of bench/ and its arguments; --out is added), the
#              variants taken in turn VARIANT_ROUNDS times (the order reversed every other
#              round)                            -> variants/NAME-*.log, NAME-rK.csv
#   bench_cp   (not by default; two or more GPUs) bench/bench_cp.py under torchrun over every
#              visible GPU, NVLink multicast off                    -> bench_cp.log, bench_cp.csv
#   cp_scaling (not by default; two or more GPUs) bench/cp_scaling.py the same way: strong and
#              weak scaling over 1, 2, 4, ... of them    -> cp_scaling.log, cp_scaling.csv, .png
# and, where matplotlib is installed, bench/plot_bench.py draws PNGs next to the CSVs.
# A summary table (stage, result, counts, seconds) and the benchmark's tables come last.
#
# Environment:
#   OUT               log folder (default ./gpu-out)
#   PYTHON            interpreter (default python3)
#   MSA_BUILD_DIR     the prebuilt build folder (default build)
#   GTEST_ARGS        extra arguments of the gtest stage (e.g. --gtest_filter=...)
#   PYTEST_ARGS       extra arguments of pytest (e.g. "-k cuda -x")
#   SANITIZER_FILTER  gtest filter of the sanitizer stages
#   BENCH_ARGS        arguments of the benchmark (default --with-1m; --quick for a smoke run)
#   BENCH_BWD_ARGS    arguments of the training benchmark (default none)
#   BENCH_SERVING_ARGS  arguments of the serving benchmark (default none)
#   BENCH_CP_ARGS     arguments of the context-parallel benchmark (default --quick; e.g.
#                     "--call keys --lengths 256K,512K" or "--call keys --fit 1M,1536K,2M")
#   CP_SCALING_ARGS   arguments of the scaling runs (default --phases; e.g. "--strong 1M,2M
#                     --weak 256K --index mixed")
#   VARIANTS_DIR, VARIANT_GTEST, VARIANT_BENCH, VARIANT_ROUNDS  the variants stage (above);
#                     VARIANT_GTEST_ARGS (e.g. --gtest_repeat=3) and VARIANT_SANITIZER (a
#                     compute-sanitizer tool the gtest runs under, the guards off), e.g.
#                     STAGES="build variants" VARIANT_GTEST='*SelectBlocks*'
#                     VARIANT_BENCH="bench/bench_select_fp8.py --lengths 131072 --levels mixed,random"
#   GTEST_SHARDS      shards of the gtest and poison stages and of VARIANT_GTEST run side by
#                     side (default: half the cores, two CPU threads a shard; shards are
#                     planned from scripts/gtest-times.txt; VARIANT_GTEST under a sanitizer
#                     runs as one process)
#   MSA_POISON_BUILD_DIR  the poison build folder (default build-poison: its libmsa.so alone,
#                     e.g. cmake -S . -B build-poison -G Ninja -DMSA_CUDA_FAST_BUILD=ON
#                     -DMSA_CUDA_POISON_SMEM=0xff && cmake --build build-poison --target msa)
#   STAGES            the stages to run (default: build ptxas gtest pytest memcheck racecheck
#                     poison bench bench_bwd bench_serving)
#   GPU_CHECK_BUDGET  seconds for everything (default 560); each stage also has a cap,
#                     e.g. PYTEST_TIMEOUT=300 (BUILD_, GTEST_, MEMCHECK_, RACECHECK_, BENCH_)
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
root="$PWD"

if [ -z "${OUT:-}" ]; then
  OUT="$root/gpu-out"
  mkdir -p "$OUT"
  printf '*\n' >"$OUT/.gitignore"
fi
mkdir -p "$OUT"
OUT="$(cd "$OUT" && pwd)"
PY="${PYTHON:-python3}"
if [[ "$PY" == */* ]]; then
  PY="$(cd "$(dirname "$PY")" && pwd)/$(basename "$PY")"  # absolute: stages change folders
fi
build_dir="${MSA_BUILD_DIR:-build}"
stage_dir="$root/build-gpu-py"
stages="${STAGES:-build ptxas gtest pytest memcheck racecheck poison bench bench_bwd bench_serving}"
cores="$(nproc 2>/dev/null || echo 2)"
gtest_shards="${GTEST_SHARDS:-$((cores >= 4 ? cores / 2 : 1))}"  # two CPU threads a shard
bench_args_text="${BENCH_ARGS---with-1m}"
read -r -a bench_args <<<"$bench_args_text"
read -r -a gtest_args <<<"${GTEST_ARGS:-}"
read -r -a pytest_args <<<"${PYTEST_ARGS:-}"
sanitizer_filter="${SANITIZER_FILTER:-Shapes/CudaVsCpu.*/G1_D128_Di128_Bk128:Shapes/CudaVsCpu.*/G16_D128_Bk128_varlen_fp16:Cuda.AllSequencesEmpty:Cuda.FusedQkvStrides:Cuda.VarlenNanStaysInItsSequence:Cuda.ValueChecks*:Cuda.KlPassOption:Cuda.AutoPassRunsTheChosenPass:Shapes/PagedCudaVsCpu.*/case0:CudaPaged.*:Layouts/CudaKeysApart.SparseForwardEachPass/Mixed_G2_Bk64_fp16:Layouts/CudaKeysApart.SparseBackwardEachPass/Mixed_G2_Bk64_fp16:CudaKeysApartValidation.*}"
budget="${GPU_CHECK_BUDGET:-560}"
export PYTHONUNBUFFERED=1
# msa_tests may carry the absolute build path of the machine it was linked on as its runpath:
# its stages let the loader find libmsa.so in this checkout's build folder.
test_lib_path="$root/$build_dir"
[[ "$build_dir" == /* ]] && test_lib_path="$build_dir"
test_lib_path="$test_lib_path${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"

start=$SECONDS
failed=0
summary=()

enabled() { [[ " $stages " == *" $1 "* ]]; }

# The stages in the order they run; a stage's reserve (below) is kept only where a stage after it
# is enabled, so that a call of one stage may use the whole budget.
stage_order=(build ptxas gtest pytest memcheck racecheck poison bench bench_bwd bench_serving variants bench_cp cp_scaling)
later_enabled() {  # name -> status 0 when a stage after it is enabled
  local seen=0 s
  for s in "${stage_order[@]}"; do
    if ((seen)) && enabled "$s"; then return 0; fi
    [ "$s" = "$1" ] && seen=1
  done
  return 1
}

# Seconds stage `name` may take: its cap, within what the budget leaves after `reserve` seconds
# kept for the stages after it.
stage_limit() {
  local name=$1 cap=$2 reserve=$3
  later_enabled "$name" || reserve=0
  local left=$((budget - (SECONDS - start) - reserve))
  if ((left < cap)); then echo "$left"; else echo "$cap"; fi
}

note() {  # stage result detail seconds
  summary+=("$(printf '| %-9s | %-7s | %s | %s |' "$1" "$2" "$3" "$4")")
  case "$2" in ok | skipped) ;; *) failed=1 ;; esac
}

# run_stage NAME LOG CAP RESERVE CMD...: runs CMD with a time limit, output to LOG; sets rc.
run_stage() {
  local name=$1 log=$2 cap=$3 reserve=$4
  shift 4
  local limit
  limit="$(stage_limit "$name" "$cap" "$reserve")"
  if ((limit < 10)); then
    echo "no time left in the budget of ${budget}s" >>"$log"
    rc=200
    stage_seconds=0
    return
  fi
  echo "== $name (limit ${limit}s): $*" | tee -a "$log" >&2
  local t0=$SECONDS
  timeout --kill-after=15 "$limit" "$@" >>"$log" 2>&1
  rc=$?
  stage_seconds=$((SECONDS - t0))
  echo "== $name: exit $rc after ${stage_seconds}s" >&2
}

result_of() {  # rc -> result word
  case "$1" in
    0) echo ok ;;
    124 | 137) echo timeout ;;
    200) echo "no time" ;;
    *) echo FAILED ;;
  esac
}

gtest_counts() {  # log -> "N passed, M failed, S skipped"
  local p f s
  p="$(sed -n 's/^\[  PASSED  \] \([0-9]*\) test.*/\1/p' "$1" | tail -1)"
  f="$(sed -n 's/^\[  FAILED  \] \([0-9]*\) test.*/\1/p' "$1" | tail -1)"
  s="$(sed -n 's/^\[  SKIPPED \] \([0-9]*\) test.*/\1/p' "$1" | tail -1)"
  echo "${p:-0} passed, ${f:-0} failed, ${s:-0} skipped"
}

tail_of_failure() {  # name log
  echo "---- last lines of $2 ($1) ----"
  tail -n 25 "$2"
}
failures=()

# ---- environment ---------------------------------------------------------------------------
{
  echo "gpu_check: $(date -u '+%Y-%m-%d %H:%M:%S') UTC, commit $(git rev-parse --short HEAD 2>/dev/null || echo '?')"
  command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L
  "$PY" -c 'import sys, torch; print("python", sys.version.split()[0], "| torch", torch.__version__, "| cuda", torch.version.cuda, "| gpu", torch.cuda.get_device_name() if torch.cuda.is_available() else None)' 2>&1
} | tee "$OUT/build.log"

# ---- build: the binding for this python ----------------------------------------------------
binding_ok=0
if enabled build; then
  if [ ! -f "$build_dir/libmsa.so" ]; then
    echo "no $build_dir/libmsa.so: carry the prebuilt build folder" >>"$OUT/build.log"
    note build FAILED "no $build_dir/libmsa.so" 0
  else
    run_stage build "$OUT/build.log" "${BUILD_TIMEOUT:-150}" 240 \
      env MSA_LIBRARY="$build_dir/libmsa.so" scripts/build_binding.sh "$PY" "$stage_dir"
    res="$(result_of "$rc")"
    detail="$(grep -m1 '^build_binding: [0-9]' "$OUT/build.log" | sed 's/^build_binding: /python /; s/, core .*//')"
    note build "$res" "${detail:-see build.log}" "${stage_seconds:-0}"
    [ "$rc" -eq 0 ] && binding_ok=1
    [ "$rc" -ne 0 ] && failures+=("build $OUT/build.log")
  fi
elif [ -f "$stage_dir/msa/__init__.py" ]; then
  binding_ok=1
fi

# ---- ptxas: the carried build's log has no new spill -----------------------------------------
if enabled ptxas; then
  if [ -f "$build_dir/build.log" ]; then
    if scripts/check_ptxas.sh "$build_dir/build.log" >"$OUT/ptxas.log" 2>&1; then
      note ptxas ok "$(tail -n 1 "$OUT/ptxas.log")" 0
    else
      note ptxas FAILED "see ptxas.log" 0
      failures+=("ptxas $OUT/ptxas.log")
    fi
  else
    note ptxas skipped "no $build_dir/build.log" 0
  fi
fi

# ---- gtest --------------------------------------------------------------------------------
if enabled gtest; then
  : >"$OUT/gtest.log"
  if [ ! -x "$build_dir/msa_tests" ]; then
    note gtest FAILED "no $build_dir/msa_tests" 0
  else
    run_stage gtest "$OUT/gtest.log" "${GTEST_TIMEOUT:-240}" 210 \
      env LD_LIBRARY_PATH="$test_lib_path" scripts/gtest_shards.sh "$gtest_shards" \
      "$build_dir/msa_tests" --gtest_color=no "${gtest_args[@]}"
    note gtest "$(result_of "$rc")" "$(gtest_counts "$OUT/gtest.log")" "$stage_seconds"
    [ "$rc" -ne 0 ] && failures+=("gtest $OUT/gtest.log")
  fi
fi

# ---- pytest -------------------------------------------------------------------------------
if enabled pytest; then
  : >"$OUT/pytest.log"
  if [ "$binding_ok" -ne 1 ]; then
    note pytest skipped "no binding built" 0
    failed=1
  else
    # From tests/python, so that `import msa` is the staged package.
    # shellcheck disable=SC2016  # $0 and $@ belong to the inner shell
    run_stage pytest "$OUT/pytest.log" "${PYTEST_TIMEOUT:-300}" 150 \
      env PYTHONPATH="$stage_dir" bash -c 'cd tests/python && exec "$0" -m pytest -q -ra -p no:cacheprovider "$@" .' \
      "$PY" "${pytest_args[@]}"
    counts="$(grep -E '[0-9]+ (passed|failed|errors?|skipped|deselected)|no tests ran' "$OUT/pytest.log" | tail -n 1 | sed 's/^=* *//; s/ *=*$//')"
    note pytest "$(result_of "$rc")" "${counts:-see pytest.log}" "$stage_seconds"
    [ "$rc" -ne 0 ] && failures+=("pytest $OUT/pytest.log")
  fi
fi

# ---- compute-sanitizer ----------------------------------------------------------------------
sanitizer=""
if command -v compute-sanitizer >/dev/null 2>&1; then
  sanitizer="$(command -v compute-sanitizer)"
elif [ -x /usr/local/cuda/bin/compute-sanitizer ]; then
  sanitizer=/usr/local/cuda/bin/compute-sanitizer
fi
for tool in memcheck racecheck; do
  enabled "$tool" || continue
  log="$OUT/$tool.log"
  : >"$log"
  if [ -z "$sanitizer" ]; then
    note "$tool" FAILED "compute-sanitizer not found" 0
    continue
  fi
  if [ ! -x "$build_dir/msa_tests" ]; then
    note "$tool" FAILED "no $build_dir/msa_tests" 0
    continue
  fi
  upper="$(echo "$tool" | tr '[:lower:]' '[:upper:]')"
  cap_var="${upper}_TIMEOUT"
  reserve=60
  [ "$tool" = memcheck ] && reserve=90
  run_stage "$tool" "$log" "${!cap_var:-120}" "$reserve" \
    env LD_LIBRARY_PATH="$test_lib_path" MSA_TEST_GUARDS=0 \
    "$sanitizer" --tool "$tool" --error-exitcode 99 --print-limit 20 \
    "$build_dir/msa_tests" --gtest_color=no --gtest_filter="$sanitizer_filter"
  if [ "$tool" = memcheck ]; then
    found="$(grep -m1 'ERROR SUMMARY' "$log" | sed 's/.*ERROR SUMMARY: //')"
  else
    found="$(grep -m1 'RACECHECK SUMMARY' "$log" | sed 's/.*RACECHECK SUMMARY: //')"
  fi
  counts="$(gtest_counts "$log")"
  res="$(result_of "$rc")"
  if [ "$rc" -eq 0 ] && [[ "$counts" == "0 passed, 0 failed"* ]]; then
    res="FAILED"
    found="the filter matched no test (set SANITIZER_FILTER)"
  fi
  note "$tool" "$res" "${found:-?}; tests: $counts" "$stage_seconds"
  [ "$res" != ok ] && failures+=("$tool $log")
done

# ---- poison: the CUDA suites on a build whose kernels fill their shared memory first ---------
# Every CTA writes MSA_CUDA_POISON_SMEM's byte over its shared memory before it starts (0xff:
# NaN floats, -1 integers), so that a kernel which reads a word it never wrote gets a value that
# shows in its results instead of a stale one that happens to be harmless.
if enabled poison; then
  : >"$OUT/poison.log"
  poison_dir="${MSA_POISON_BUILD_DIR:-build-poison}"
  if [ ! -f "$poison_dir/libmsa.so" ]; then
    note poison skipped "no $poison_dir/libmsa.so (a -DMSA_CUDA_POISON_SMEM=0xff build)" 0
  elif [ ! -x "$build_dir/msa_tests" ]; then
    note poison FAILED "no $build_dir/msa_tests" 0
  else
    poison_lib="$(cd "$poison_dir" && pwd)"
    run_stage poison "$OUT/poison.log" "${POISON_TIMEOUT:-240}" 0 \
      env LD_LIBRARY_PATH="$poison_lib:$test_lib_path" scripts/gtest_shards.sh "$gtest_shards" \
      "$build_dir/msa_tests" --gtest_color=no --gtest_filter="${POISON_FILTER:-Cuda*:*/*Cuda*}"
    note poison "$(result_of "$rc")" "$(gtest_counts "$OUT/poison.log")" "$stage_seconds"
    [ "$rc" -ne 0 ] && failures+=("poison $OUT/poison.log")
  fi
fi

# ---- bench --------------------------------------------------------------------------------
if enabled bench; then
  : >"$OUT/bench.log"
  if [ "$binding_ok" -ne 1 ]; then
    note bench skipped "no binding built" 0
    failed=1
  else
    run_stage bench "$OUT/bench.log" "${BENCH_TIMEOUT:-300}" 0 \
      env PYTHONPATH="$stage_dir" "$PY" bench/bench_forward.py "${bench_args[@]}" --out "$OUT/bench"
    note bench "$(result_of "$rc")" "args: ${bench_args_text:-none}" "$stage_seconds"
    [ "$rc" -ne 0 ] && failures+=("bench $OUT/bench.log")
  fi
fi

# ---- bench_bwd ----------------------------------------------------------------------------
if enabled bench_bwd; then
  : >"$OUT/bench_bwd.log"
  read -r -a bench_bwd_args <<<"${BENCH_BWD_ARGS:-}"
  if [ "$binding_ok" -ne 1 ]; then
    note bench_bwd skipped "no binding built" 0
    failed=1
  else
    run_stage bench_bwd "$OUT/bench_bwd.log" "${BENCH_BWD_TIMEOUT:-300}" 0 \
      env PYTHONPATH="$stage_dir" "$PY" bench/bench_backward.py "${bench_bwd_args[@]}" --out "$OUT/bench_bwd"
    note bench_bwd "$(result_of "$rc")" "args: ${BENCH_BWD_ARGS:-none}" "$stage_seconds"
    [ "$rc" -ne 0 ] && failures+=("bench_bwd $OUT/bench_bwd.log")
  fi
fi

# ---- bench_serving ------------------------------------------------------------------------
if enabled bench_serving; then
  : >"$OUT/bench_serving.log"
  read -r -a bench_serving_args <<<"${BENCH_SERVING_ARGS:-}"
  if [ "$binding_ok" -ne 1 ]; then
    note bench_serving skipped "no binding built" 0
    failed=1
  else
    run_stage bench_serving "$OUT/bench_serving.log" "${BENCH_SERVING_TIMEOUT:-300}" 0 \
      env PYTHONPATH="$stage_dir" "$PY" bench/bench_serving.py "${bench_serving_args[@]}" --out "$OUT/bench_serving"
    note bench_serving "$(result_of "$rc")" "args: ${BENCH_SERVING_ARGS:-none}" "$stage_seconds"
    [ "$rc" -ne 0 ] && failures+=("bench_serving $OUT/bench_serving.log")
  fi
fi

# ---- variants: the same tests and benchmark on each library of scripts/build_variants.sh ----
if enabled variants; then
  vdir="${VARIANTS_DIR:-build-variants/lib}"
  vout="$OUT/variants"
  mkdir -p "$vout"
  read -r -a variant_bench <<<"${VARIANT_BENCH:-}"
  variant_names=()
  for d in "$vdir"/*/; do
    [ -f "$d/libmsa.so.xz" ] || continue
    variant_names+=("$(basename "$d")")
  done
  if [ "${#variant_names[@]}" -eq 0 ]; then
    note variants FAILED "no library under $vdir (scripts/build_variants.sh)" 0
    failures+=("variants $vout/none.log")
    echo "no variant library under $vdir" >"$vout/none.log"
  elif [ -n "${VARIANT_SANITIZER:-}" ] && [ -z "$sanitizer" ]; then
    note variants FAILED "VARIANT_SANITIZER=$VARIANT_SANITIZER: compute-sanitizer not found" 0
  elif [ -n "${VARIANT_BENCH:-}" ] && [ "$binding_ok" -ne 1 ]; then
    note variants skipped "no binding built (the build stage)" 0
    failed=1
  else
    # Each variant: its library next to a copy of the staged package.
    for name in "${variant_names[@]}"; do
      d="$root/build-gpu-variants/$name"
      rm -rf "$d"
      mkdir -p "$d"
      xz -dc "$vdir/$name/libmsa.so.xz" >"$d/libmsa.so"
      if [ "$binding_ok" -eq 1 ]; then
        cp -r "$stage_dir/msa" "$d/msa"
        for f in "$d"/msa/libmsa.so*; do cp "$d/libmsa.so" "$f"; done
      fi
    done
    rounds="${VARIANT_ROUNDS:-1}"
    order=("${variant_names[@]}")
    for ((round = 1; round <= rounds; ++round)); do
      for name in "${order[@]}"; do
        d="$root/build-gpu-variants/$name"
        if [ -n "${VARIANT_GTEST:-}" ] && [ "$round" -eq 1 ]; then
          log="$vout/$name-gtest.log"
          : >"$log"
          tool_cmd=()
          tool_env=()
          if [ -n "${VARIANT_SANITIZER:-}" ]; then
            # Each tensor an allocation of its own, as in the sanitizer stages.
            tool_cmd=("$sanitizer" --tool "$VARIANT_SANITIZER" --print-limit 20)
            tool_env=(MSA_TEST_GUARDS=0)
          fi
          read -r -a variant_gtest_args <<<"${VARIANT_GTEST_ARGS:-}"
          # Shards side by side, as the gtest stage (one process under a sanitizer).
          shard_cmd=(scripts/gtest_shards.sh "$gtest_shards")
          [ -n "${VARIANT_SANITIZER:-}" ] && shard_cmd=()
          run_stage "variants" "$log" "${VARIANT_GTEST_TIMEOUT:-240}" 0 \
            env LD_LIBRARY_PATH="$d${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" "${tool_env[@]}" "${shard_cmd[@]}" "${tool_cmd[@]}" \
            "$build_dir/msa_tests" --gtest_color=no --gtest_filter="$VARIANT_GTEST" "${variant_gtest_args[@]}"
          found=""
          [ -n "${VARIANT_SANITIZER:-}" ] && found="; $(grep -m1 -E '(ERROR|RACECHECK) SUMMARY' "$log" | sed 's/.*SUMMARY: //')"
          note "$name" "$(result_of "$rc")" "gtest${VARIANT_SANITIZER:+ under $VARIANT_SANITIZER}: $(gtest_counts "$log")$found" "$stage_seconds"
          [ "$rc" -ne 0 ] && failures+=("$name $log")
        fi
        if [ -n "${VARIANT_BENCH:-}" ]; then
          log="$vout/$name-bench-r$round.log"
          : >"$log"
          run_stage "variants" "$log" "${VARIANT_BENCH_TIMEOUT:-300}" 0 \
            env PYTHONPATH="$d" "$PY" "${variant_bench[@]}" --out "$vout/$name-r$round"
          note "$name" "$(result_of "$rc")" "bench round $round: $VARIANT_BENCH" "$stage_seconds"
          [ "$rc" -ne 0 ] && failures+=("$name $log")
        fi
      done
      # The next round in the other order, so that no variant always runs first.
      rev=()
      for ((i = ${#order[@]} - 1; i >= 0; --i)); do rev+=("${order[$i]}"); done
      order=("${rev[@]}")
    done
  fi
fi

# ---- bench_cp, cp_scaling: torchrun over every visible GPU ----------------------------------
# cp_stage NAME SCRIPT ARGS TIMEOUT: bench/SCRIPT under torchrun, NVLink multicast off.
cp_stage() {
  local name=$1 script=$2 args_text=$3 cap=$4 ngpu
  : >"$OUT/$name.log"
  read -r -a stage_args <<<"$args_text"
  ngpu=$("$PY" -c 'import torch; print(torch.cuda.device_count())' 2>/dev/null || echo 0)
  if [ "$binding_ok" -ne 1 ]; then
    note "$name" skipped "no binding built" 0
    failed=1
  elif [ "${ngpu:-0}" -lt 2 ]; then
    note "$name" skipped "needs 2 or more GPUs, $ngpu visible" 0
  else
    run_stage "$name" "$OUT/$name.log" "$cap" 0 \
      env PYTHONPATH="$stage_dir" NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 \
      "$PY" -m torch.distributed.run --standalone --nproc-per-node "$ngpu" "bench/$script" \
      "${stage_args[@]}" --out "$OUT/$name"
    note "$name" "$(result_of "$rc")" "$ngpu GPUs, args: $args_text" "$stage_seconds"
    [ "$rc" -ne 0 ] && failures+=("$name $OUT/$name.log")
  fi
}
enabled bench_cp && cp_stage bench_cp bench_cp.py "${BENCH_CP_ARGS---quick}" "${BENCH_CP_TIMEOUT:-400}"
enabled cp_scaling && cp_stage cp_scaling cp_scaling.py "${CP_SCALING_ARGS---phases}" \
  "${CP_SCALING_TIMEOUT:-540}"

# ---- plots of the benchmarks' CSVs (where matplotlib is installed) --------------------------
plots=()
for f in "$OUT/bench.csv" "$OUT/bench_bwd.csv"; do [ -f "$f" ] && plots+=("$f"); done
if [ "${#plots[@]}" -gt 0 ] && "$PY" -c 'import matplotlib' >/dev/null 2>&1; then
  "$PY" bench/plot_bench.py "${plots[@]}" >"$OUT/plots.log" 2>&1 || echo "plot_bench failed: see $OUT/plots.log"
fi

# ---- summary ------------------------------------------------------------------------------
echo
for f in "${failures[@]}"; do
  tail_of_failure "${f%% *}" "${f#* }"
done
echo
echo "## gpu_check summary ($((SECONDS - start)) s, logs in $OUT)"
echo
echo "| stage     | result  | detail | s |"
echo "|---|---|---|---|"
printf '%s\n' "${summary[@]}"
if enabled bench && [ -s "$OUT/bench.log" ] && grep -q '^| target' "$OUT/bench.log"; then
  echo
  sed -n '/^| target/,$p' "$OUT/bench.log"
fi
if enabled bench_bwd && [ -s "$OUT/bench_bwd.log" ] && grep -q '^## MSA training' "$OUT/bench_bwd.log"; then
  echo
  sed -n '/^## MSA training/,$p' "$OUT/bench_bwd.log"
fi
if enabled bench_serving && [ -s "$OUT/bench_serving.log" ] && grep -q '^## MSA serving' "$OUT/bench_serving.log"; then
  echo
  sed -n '/^## MSA serving/,$p' "$OUT/bench_serving.log"
fi
for name in bench_cp cp_scaling; do
  if enabled "$name" && [ -s "$OUT/$name.log" ] && grep -q '^## ' "$OUT/$name.log"; then
    echo
    sed -n '/^## /,$p' "$OUT/$name.log"
  fi
done
if enabled variants && [ -d "$OUT/variants" ]; then
  for f in "$OUT"/variants/*-bench-r*.log; do
    [ -f "$f" ] || continue
    echo
    echo "### $(basename "$f" .log)"
    tail -n "${VARIANT_TAIL:-12}" "$f"
  done
fi
exit "$failed"
