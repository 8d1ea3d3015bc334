#!/usr/bin/env bash
# Runs a GoogleTest binary as N shards side by side and reports them as one run:
#
#   scripts/gtest_shards.sh N BINARY [ARGS...]
#
# Each test runs in exactly one shard. The shards are planned by scripts/gtest_plan.py from the
# tests' earlier durations (scripts/gtest-times.txt, or GTEST_TIMES), longest first onto the
# least loaded shard, and each runs its list as a --gtest_filter in place of the caller's (which
# chose the tests); without python3, or where listing the tests fails, shard i runs with
# GTEST_TOTAL_SHARDS=N and GTEST_SHARD_INDEX=i instead. Every shard runs with MSA_CPU_THREADS =
# cores / N (unless set) for the CPU references the CUDA tests compare with: those references,
# not the GPU, take most of a CUDA suite's time.
# The shards' outputs follow one another on stdout, then a summary in GoogleTest's own words
# ("[  PASSED  ] N tests." and so on, summed over the shards) that scripts/gpu_check.sh counts.
# The exit status is the first non-zero status of a shard, or 0. Killed (SIGTERM, e.g. by
# `timeout`), it prints what the shards wrote so far and exits with 124.
set -uo pipefail
die() { echo "gtest_shards: $*" >&2; exit 2; }
(($# >= 2)) || die "usage: scripts/gtest_shards.sh N BINARY [ARGS...]"
n=$1
shift
[[ "$n" =~ ^[1-9][0-9]*$ ]] || die "N must be a positive integer, got '$n'"
cores="$(nproc 2>/dev/null || echo 1)"
threads=$((cores / n))
((threads < 1)) && threads=1
tmp="$(mktemp -d)"
pids=()

status=()  # each shard's exit status, once it has ended

report() {  # prints every shard's output and the summed summary
  local i p f s tp=0 tf=0 ts=0 broken=()
  for ((i = 0; i < n; ++i)); do
    echo "[----------] shard $i of $n"
    cat "$tmp/$i.log" 2>/dev/null
    p="$(sed -n 's/^\[  PASSED  \] \([0-9]*\) test.*/\1/p' "$tmp/$i.log" 2>/dev/null | tail -1)"
    f="$(sed -n 's/^\[  FAILED  \] \([0-9]*\) test.*/\1/p' "$tmp/$i.log" 2>/dev/null | tail -1)"
    s="$(sed -n 's/^\[  SKIPPED \] \([0-9]*\) test.*/\1/p' "$tmp/$i.log" 2>/dev/null | tail -1)"
    # A shard that failed without naming a failed test (a crash, an abort) counts as one.
    if [ -z "$f" ] && [ "${status[$i]:-0}" -ne 0 ]; then
      f=1
      broken+=("shard $i of $n: exited with status ${status[$i]} before its summary")
    fi
    tp=$((tp + ${p:-0}))
    tf=$((tf + ${f:-0}))
    ts=$((ts + ${s:-0}))
  done
  echo "[==========] $n shards"
  echo "[  PASSED  ] $tp tests."
  ((ts > 0)) && echo "[  SKIPPED ] $ts tests."
  if ((tf > 0)); then
    echo "[  FAILED  ] $tf tests, listed below:"
    grep -h '^\[  FAILED  \] .*, where\|^\[  FAILED  \] [^0-9].* ([0-9]* ms)$' "$tmp"/*.log | sed 's/ ([0-9]* ms)$//' | sort -u
    for b in "${broken[@]}"; do echo "[  FAILED  ] $b"; done
  fi
}

on_term() {
  kill "${pids[@]}" 2>/dev/null
  wait 2>/dev/null
  report
  echo "gtest_shards: stopped before every shard finished" >&2
  rm -rf "$tmp"
  exit 124
}
trap on_term TERM INT

# The planned shards: the caller's arguments less its --gtest_filter, plus each shard's list.
here="$(cd "$(dirname "$0")" && pwd)"
times=("${GTEST_TIMES:-$here/gtest-times.txt}")
[ -f "${times[0]}" ] || times=()
plan=()
if command -v python3 >/dev/null 2>&1 && "$@" --gtest_list_tests >"$tmp/list.txt" 2>/dev/null &&
  mapfile -t plan < <(python3 "$here/gtest_plan.py" "$n" "${times[@]}" <"$tmp/list.txt") && ((${#plan[@]} == n)); then
  args=()
  for a in "${@:2}"; do [[ "$a" == --gtest_filter=* ]] || args+=("$a"); done
  for ((i = 0; i < n; ++i)); do
    if [ -z "${plan[$i]}" ]; then  # more shards than tests
      echo "[  PASSED  ] 0 tests." >"$tmp/$i.log"
      continue
    fi
    MSA_CPU_THREADS="${MSA_CPU_THREADS:-$threads}" \
      "$1" "${args[@]}" --gtest_filter="${plan[$i]}" >"$tmp/$i.log" 2>&1 &
    pids[i]=$!
  done
else
  for ((i = 0; i < n; ++i)); do
    GTEST_TOTAL_SHARDS=$n GTEST_SHARD_INDEX=$i MSA_CPU_THREADS="${MSA_CPU_THREADS:-$threads}" \
      "$@" >"$tmp/$i.log" 2>&1 &
    pids[i]=$!
  done
fi
rc=0
for i in "${!pids[@]}"; do
  wait "${pids[$i]}"
  status[i]=$?
  ((rc == 0 && status[i] != 0)) && rc=${status[i]}
done
report
rm -rf "$tmp"
exit "$rc"
