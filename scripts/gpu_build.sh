#!/usr/bin/env bash
# Builds the library with its CUDA backend and the C++ tests on the GPU machine itself, with all
# its cores, when the machine has neither CUTLASS nor GoogleTest installed:
#
#   scripts/gpu_build.sh [build-dir]        (default: build)
#
# It takes the CUTLASS headers from .deps/cutlass (a CUTLASS source root: include/,
# tools/util/include/) and the GoogleTest sources from .deps/googletest, both git-ignored
# copies made on the development machine (scripts/gpu_deps.sh) and carried along. The build's
# compiler output goes to <build-dir>/build.log; scripts/check_ptxas.sh then checks it.
set -euo pipefail
cd "$(dirname "$0")/.."
build="${1:-build}"
deps="$PWD/.deps"
[ -f "$deps/cutlass/include/cute/tensor.hpp" ] || { echo "gpu_build: no $deps/cutlass" >&2; exit 1; }
[ -f "$deps/googletest/CMakeLists.txt" ] || { echo "gpu_build: no $deps/googletest" >&2; exit 1; }
jobs="$(nproc)"
if [ ! -f /tmp/gtest/lib/libgtest.a ] && [ ! -f /tmp/gtest/lib64/libgtest.a ]; then
  cmake -S "$deps/googletest" -B /tmp/gtest-build -G Ninja -DCMAKE_BUILD_TYPE=Release \
    -DCMAKE_INSTALL_PREFIX=/tmp/gtest -DBUILD_GMOCK=OFF >/dev/null
  cmake --build /tmp/gtest-build -j "$jobs" >/dev/null
  cmake --install /tmp/gtest-build >/dev/null
fi
export PATH="/usr/local/cuda/bin:$PATH"
cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DMSA_WITH_CUDA=ON \
  -DMSA_CUTLASS_DIR="$deps/cutlass" -DCMAKE_PREFIX_PATH=/tmp/gtest >/dev/null
start=$SECONDS
set -o pipefail
cmake --build "$build" -j "$jobs" 2>&1 | tee "$build/build.log" | grep -E "error|warning|FAILED" || true
echo "gpu_build: built in $((SECONDS - start)) s with $jobs jobs"
[ -x scripts/check_ptxas.sh ] && scripts/check_ptxas.sh "$build/build.log"
test -f "$build/libmsa.so" && test -x "$build/msa_tests"
