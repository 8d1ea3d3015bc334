#!/usr/bin/env bash
# Runs every test: the C++ suite (GoogleTest through CTest) and the Python suite (pytest) on the
# pip-installed package. Installs what it needs first (scripts/setup.sh).
set -euo pipefail
cd "$(dirname "$0")/.."

# A CUDA toolkit in the default place is used even when it is not on PATH (CMake's
# MSA_WITH_CUDA=AUTO turns the CUDA backend on when it finds nvcc, off when there is none).
if ! command -v nvcc >/dev/null 2>&1 && [ -x "${CUDA_HOME:-/usr/local/cuda}/bin/nvcc" ]; then
  export PATH="${CUDA_HOME:-/usr/local/cuda}/bin:$PATH"
fi

scripts/setup.sh python

jobs="$(nproc)"
cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release -DMSA_BUILD_TESTS=ON -DMSA_BUILD_APPS=ON >/dev/null
# The build's output is kept in build/build.log: ptxas's spill and local-memory warnings for the
# CUDA kernels must name only functions listed in scripts/ptxas-allow.txt (nothing to check when
# no CUDA file was compiled).
cmake --build build -j "$jobs" 2>&1 | tee build/build.log
scripts/check_ptxas.sh build/build.log
ctest --test-dir build --output-on-failure -j "$jobs"

# The installed tree as a C++ engine sees it: find_package(msa), msa::msa, a small real call
# (tests/consumer, a CMake project of its own configured against the install prefix).
rm -rf build/install build/consumer
cmake --install build --prefix "$PWD/build/install" >/dev/null
cmake -S tests/consumer -B build/consumer -G Ninja -DCMAKE_BUILD_TYPE=Release \
  -DCMAKE_PREFIX_PATH="$PWD/build/install" >/dev/null
cmake --build build/consumer
build/consumer/msa_consumer
# Kept only when something above failed: build/ (which the GPU machine's check is given) holds
# one copy of libmsa, not two.
rm -rf build/install build/consumer

# The package's binding links the library built above (no second compile of the CUDA kernels).
.venv/bin/python -m pip install -q --no-cache-dir --no-build-isolation \
  --config-settings=cmake.define.MSA_PREBUILT_LIBRARY="$PWD/build/libmsa.so" .
# Run from outside the source tree so that `import msa` is the installed package.
cd tests/python
../../.venv/bin/python -m pytest -q -p no:cacheprovider .
