#!/usr/bin/env bash
# The main job: builds the library and msa_main, then runs one MSA training step (selection,
# forward, backward with the KL gradient) and the warmup step on the default shape, checks a
# sample against the reference and prints the timing table. Arguments go to msa_main
# (scripts/run_main.sh --help lists them).
set -euo pipefail
cd "$(dirname "$0")/.."

scripts/setup.sh cpp
cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release -DMSA_BUILD_TESTS=ON -DMSA_BUILD_APPS=ON >/dev/null
cmake --build build -j "$(nproc)" --target msa_main >&2
exec build/msa_main "$@"
