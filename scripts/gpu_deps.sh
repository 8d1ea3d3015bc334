#!/usr/bin/env bash
# Copies what scripts/gpu_build.sh needs and a GPU machine without package access lacks into
# .deps/ (git-ignored): the CUTLASS headers of the nvidia-cutlass package in .venv and the
# GoogleTest sources of Debian's googletest package. Carry .deps with the working tree.
set -euo pipefail
cd "$(dirname "$0")/.."
grep -qx '/.deps/' .git/info/exclude 2>/dev/null || echo '/.deps/' >>.git/info/exclude
src="$(.venv/bin/python -c 'import os, cutlass_library; print(os.path.join(os.path.dirname(cutlass_library.__file__), "source"))')"
rm -rf .deps/cutlass .deps/googletest && mkdir -p .deps/cutlass/tools/util
cp -r "$src/include" .deps/cutlass/include
cp -r "$src/tools/util/include" .deps/cutlass/tools/util/include
cp -r /usr/src/googletest .deps/googletest
du -sh .deps
