#!/usr/bin/env bash
# Installs what the project needs on a fresh Debian machine; idempotent, quick when all is there.
#   scripts/setup.sh cpp      compilers, CMake, Ninja, GoogleTest (enough for the C++ core and main job)
#   scripts/setup.sh python   the above plus .venv with torch and the Python build/test tools
set -euo pipefail
cd "$(dirname "$0")/.."

what="${1:-python}"

apt_packages=(g++ cmake ninja-build libgtest-dev)
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

[ "$what" = "cpp" ] && exit 0

PY="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
  echo "setup: creating .venv with $($PY --version)" >&2
  "$PY" -m venv .venv
fi
stamp=.venv/.requirements-installed
if [ ! -f "$stamp" ] || ! cmp -s requirements-dev.txt "$stamp"; then
  echo "setup: installing Python requirements (torch included; a few minutes the first time)" >&2
  .venv/bin/python -m pip install -q --upgrade pip
  .venv/bin/python -m pip install -q -r requirements-dev.txt
  cp requirements-dev.txt "$stamp"
fi
