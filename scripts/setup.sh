#!/usr/bin/env bash
# Installs what the project needs on a fresh Debian machine; idempotent, quick when all is there.
#   scripts/setup.sh cpp      compilers, CMake, Ninja, GoogleTest (enough for the C++ core and main job);
#                             with a CUDA toolkit, also the CUTLASS headers (nvidia-cutlass, into .venv)
#   scripts/setup.sh python   the above plus .venv with torch and the Python build/test tools
set -euo pipefail
cd "$(dirname "$0")/.."

what="${1:-python}"

# A CUDA toolkit in the default place is used even when it is not on PATH (CMake's
# MSA_WITH_CUDA=AUTO looks for nvcc on PATH).
if ! command -v nvcc >/dev/null 2>&1 && [ -x "${CUDA_HOME:-/usr/local/cuda}/bin/nvcc" ]; then
  export PATH="${CUDA_HOME:-/usr/local/cuda}/bin:$PATH"
fi
have_nvcc=0
command -v nvcc >/dev/null 2>&1 && have_nvcc=1

apt_packages=(g++ cmake ninja-build libgtest-dev)
if [ "$what" != "cpp" ] || [ "$have_nvcc" = 1 ]; then
  apt_packages+=(python3-venv)
fi
missing=()
for pkg in "${apt_packages[@]}"; do
  dpkg -s "$pkg" >/dev/null 2>&1 || missing+=("$pkg")
done
if ((${#missing[@]})); then
  echo "setup: installing ${missing[*]}" >&2
  SUDO=""
  [ "$(id -u)" -ne 0 ] && SUDO="sudo"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${missing[@]}" >/dev/null
fi

PY="${PYTHON:-python3}"
make_venv() {
  if [ ! -x .venv/bin/python ]; then
    echo "setup: creating .venv with $($PY --version)" >&2
    "$PY" -m venv .venv
  fi
}

if [ "$what" = "cpp" ]; then
  # The CUDA backend needs the CUTLASS headers: the nvidia-cutlass package pinned in
  # requirements-dev.txt, headers only (no dependencies).
  if [ "$have_nvcc" = 1 ] && ! { [ -x .venv/bin/python ] && .venv/bin/python -c "import cutlass_library" 2>/dev/null; }; then
    cutlass_req="$(grep -E '^nvidia-cutlass' requirements-dev.txt)"
    make_venv
    echo "setup: installing $cutlass_req (CUTLASS headers of the CUDA backend)" >&2
    .venv/bin/python -m pip install -q --no-cache-dir --no-deps "$cutlass_req"
  fi
  exit 0
fi

make_venv
stamp=.venv/.requirements-installed
if [ ! -f "$stamp" ] || ! cmp -s requirements-dev.txt "$stamp"; then
  echo "setup: installing Python requirements (torch included; a few minutes the first time)" >&2
  .venv/bin/python -m pip install -q --no-cache-dir --upgrade pip
  .venv/bin/python -m pip install -q --no-cache-dir -r requirements-dev.txt
  cp requirements-dev.txt "$stamp"
fi
