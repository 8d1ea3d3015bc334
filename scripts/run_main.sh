#!/usr/bin/env bash
# The main job: builds the library and msa_main, then runs one MSA training step (selection,
# forward, backward with the KL gradient) and the warmup step on the default shape, checks a
# sample against the reference and prints the timing table; with --mode serve, chunked prefill and
# decode from a paged KV cache instead. Arguments go to msa_main (scripts/run_main.sh --help lists
# them).
set -euo pipefail
cd "$(dirname "$0")/.."

# A CUDA toolkit in the default place is used even when it is not on PATH (CMake's
# MSA_WITH_CUDA=AUTO turns the CUDA backend on when it finds nvcc, off when there is none).
if ! command -v nvcc >/dev/null 2>&1 && [ -x "${CUDA_HOME:-/usr/local/cuda}/bin/nvcc" ]; then
  export PATH="${CUDA_HOME:-/usr/local/cuda}/bin:$PATH"
fi

scripts/setup.sh cpp
cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release -DMSA_BUILD_TESTS=ON -DMSA_BUILD_APPS=ON >/dev/null
cmake --build build -j "$(nproc)" --target msa_main >&2
exec build/msa_main "$@"
