#!/usr/bin/env bash
# Builds the Python binding msa._C for one Python against a prebuilt libmsa.so and stages an
# importable package:
#
#   scripts/build_binding.sh [python] [outdir]      (defaults: python3, build-binding)
#
# Result: outdir/msa/ holds python/msa/*.py, _C*.so and a copy of libmsa.so, so that
#   PYTHONPATH=outdir python -c "import msa"
# works. The CMake build tree is outdir/cmake. Environment:
#   MSA_LIBRARY      the prebuilt core (default: build/libmsa.so)
#   CXX              the C++ compiler (default: /usr/bin/g++ when present, else CMake's choice)
#   MSA_BINDING_JOBS parallel compile jobs (default: nproc)
set -euo pipefail
cd "$(dirname "$0")/.."
root="$PWD"

py="${1:-python3}"
outdir="${2:-build-binding}"
lib="${MSA_LIBRARY:-build/libmsa.so}"

die() { echo "build_binding: $*" >&2; exit 1; }

command -v "$py" >/dev/null 2>&1 || die "no Python interpreter '$py'"
py="$(command -v "$py")"
case "$py" in
  /*) ;;
  *) py="$(cd "$(dirname "$py")" && pwd)/$(basename "$py")" ;;  # absolute, links kept (venvs)
esac
[ -f "$lib" ] || die "no prebuilt library at '$lib' (set MSA_LIBRARY or build the core first)"
lib="$(cd "$(dirname "$lib")" && pwd)/$(basename "$lib")"
mkdir -p "$outdir"
outdir="$(cd "$outdir" && pwd)"

"$py" -c 'import nanobind' 2>/dev/null || die "nanobind is not installed for $py"
pyinc="$("$py" -c 'import sysconfig; print(sysconfig.get_paths()["include"])')"
[ -f "$pyinc/Python.h" ] || die "no Python.h in '$pyinc' (the Python development headers of $py are needed)"

if [ -z "${CXX:-}" ] && [ -x /usr/bin/g++ ]; then
  # The system compiler links libstdc++ dynamically, like libmsa.so and torch do.
  export CXX=/usr/bin/g++
fi

generator=()
if command -v ninja >/dev/null 2>&1; then
  generator=(-G Ninja)
fi

echo "build_binding: $("$py" -c 'import sys; print(sys.version.split()[0])') ($py)," \
     "nanobind $("$py" -c 'import nanobind; print(nanobind.__version__)')," \
     "compiler ${CXX:-default}, core $lib" >&2

cmake_dir="$outdir/cmake"
if [ -f "$cmake_dir/CMakeCache.txt" ] && ! grep -q "^Python_EXECUTABLE:[A-Z]*=$py\$" "$cmake_dir/CMakeCache.txt"; then
  rm -rf "$cmake_dir"  # configured for another Python: start over
fi
cmake -S bindings/python -B "$cmake_dir" "${generator[@]}" \
  -DCMAKE_BUILD_TYPE=Release \
  -DPython_EXECUTABLE="$py" \
  -DMSA_LIBRARY="$lib" \
  -DMSA_INCLUDE_DIR="$root/include" >/dev/null
cmake --build "$cmake_dir" -j "${MSA_BINDING_JOBS:-$(nproc)}"

# Stage the package.
pkg="$outdir/msa"
rm -rf "$pkg"
mkdir -p "$pkg"
cp python/msa/*.py "$pkg/"
ext=("$cmake_dir"/_C*.so)
[ -f "${ext[0]}" ] || die "the build produced no _C*.so in $cmake_dir"
cp "${ext[0]}" "$pkg/"
soname="$(basename "$lib")"
if command -v readelf >/dev/null 2>&1; then
  s="$(readelf -d "$lib" | sed -n 's/.*(SONAME).*\[\(.*\)\].*/\1/p')"
  [ -n "$s" ] && soname="$s"
fi
cp "$lib" "$pkg/$soname"

# Shared libraries the loader cannot find would only show at import time: say so now.
if command -v ldd >/dev/null 2>&1; then
  missing="$(cd "$pkg" && { ldd "$(basename "${ext[0]}")" "$soname" 2>/dev/null | grep 'not found'; } ; true)"
  [ -z "$missing" ] || echo "build_binding: warning: unresolved libraries:"$'\n'"$missing" >&2
fi

PYTHONPATH="$outdir" "$py" -c \
  'import msa; print("build_binding: import msa OK, version", msa.version(), "| cuda backend:", msa.backend_available("cuda"))' \
  || die "the staged package does not import (PYTHONPATH=$outdir)"
echo "$outdir"
