#!/usr/bin/env bash
# Builds the library once per variant for an A/B run on the GPU machine (scripts/gpu_check.sh,
# stage `variants`):
#
#   scripts/build_variants.sh NAME=PATCH[+PATCH...] ...
#
# e.g.  scripts/build_variants.sh rsq=select-fp8-q-registers lst=select-list-scores \
#                                 both=select-fp8-q-registers+select-list-scores
#
# Every variant is HEAD (committed; the working tree's own changes are not in it) with its
# patches applied in order; a PATCH is a path, or the name of docs/experiments/PATCH.patch. The
# variant `base` (HEAD alone) is always built too, so that a run compares each change with the
# library it was made against on the same machine. The builds happen in a worktree of HEAD
# (build-variants/src) and one build tree (build-variants/build), so that only the translation
# units a patch touches are compiled again; the results are
#
#   build-variants/lib/NAME/libmsa.so.xz   the library, xz-compressed (about 2.5 MB for the
#                                          default configuration, so that several travel together)
#   build-variants/lib/NAME/build.log      its compiler output (scripts/check_ptxas.sh reads it)
#   build-variants/lib/NAME/variant.txt    HEAD's commit and the patches
#
# Only the lib/ folder needs to travel to the GPU machine. Environment:
#   MSA_VARIANT_CMAKE_ARGS  configuration of the build tree (default: -DMSA_CUDA_FAST_BUILD=ON,
#                           the bf16 / D = 128 / Bk = 128 kernels the benchmarks use)
#   MSA_VARIANT_JOBS        parallel compile jobs (default: nproc)
#   MSA_VARIANT_DIR         the folder of worktree, build tree and lib/ (default build-variants;
#                           another configuration, e.g. -DMSA_CUDA_POISON_SMEM=0x7f, needs a
#                           folder of its own: the build tree is configured once)
set -euo pipefail
cd "$(dirname "$0")/.."
root="$PWD"
die() { echo "build_variants: $*" >&2; exit 1; }

(($# > 0)) || die "usage: scripts/build_variants.sh NAME=PATCH[+PATCH...] ... (see the header)"
command -v nvcc >/dev/null 2>&1 || [ -x /usr/local/cuda/bin/nvcc ] || die "no CUDA compiler (nvcc)"
command -v nvcc >/dev/null 2>&1 || export PATH=/usr/local/cuda/bin:$PATH

top="${MSA_VARIANT_DIR:-build-variants}"
mkdir -p "$top"
top="$(cd "$top" && pwd)"
src="$top/src"
bld="$top/build"
head="$(git rev-parse HEAD)"

# Each variant's patches as absolute paths, checked before anything is built.
names=(base)
declare -A patches=([base]="")
for spec in "$@"; do
  [[ "$spec" == *=* ]] || die "'$spec' is not NAME=PATCH[+PATCH...]"
  name="${spec%%=*}"
  [[ "$name" =~ ^[A-Za-z0-9_.-]+$ ]] || die "variant name '$name': letters, digits, '.', '_' and '-' only"
  [[ -z "${patches[$name]+x}" ]] || die "variant '$name' given twice (or named base)"
  list=""
  IFS='+' read -r -a parts <<<"${spec#*=}"
  for p in "${parts[@]}"; do
    f="$p"
    [ -f "$f" ] || f="docs/experiments/$p.patch"
    [ -f "$f" ] || die "variant '$name': no patch '$p' (a path, or docs/experiments/$p.patch)"
    list+="$(cd "$(dirname "$f")" && pwd)/$(basename "$f") "
  done
  names+=("$name")
  patches[$name]="$list"
done

# The worktree, at HEAD.
if [ ! -e "$src/.git" ]; then
  rm -rf "$src"
  git worktree prune
  git worktree add -q --detach "$src" "$head"
fi
reset_src() {
  git -C "$src" checkout -q --detach "$head"
  git -C "$src" reset -q --hard "$head"
  git -C "$src" clean -qfdx
}

# The build tree, configured once. The worktree has no .venv: CMake asks this checkout's for the
# CUTLASS headers (Python_EXECUTABLE comes first in its lookup).
if [ ! -f "$bld/build.ninja" ]; then
  reset_src
  read -r -a cmake_args <<<"${MSA_VARIANT_CMAKE_ARGS:--DMSA_CUDA_FAST_BUILD=ON}"
  venv=()
  [ -x "$root/.venv/bin/python" ] && venv=(-DPython_EXECUTABLE="$root/.venv/bin/python")
  cmake -S "$src" -B "$bld" -G Ninja -DMSA_BUILD_TESTS=OFF -DMSA_BUILD_APPS=OFF "${venv[@]}" \
    "${cmake_args[@]}" >"$top/configure.log" 2>&1 || { tail -20 "$top/configure.log"; die "configure failed"; }
fi

# The libraries of this call only: gpu_check.sh runs every one it finds.
rm -rf "$top/lib"
failed=0
for name in "${names[@]}"; do
  out="$top/lib/$name"
  mkdir -p "$out"
  reset_src
  ok=1
  for p in ${patches[$name]}; do
    if ! err="$(git -C "$src" apply "$p" 2>&1)"; then
      echo "build_variants: $name: $(basename "$p") does not apply to $(git rev-parse --short "$head"):" >&2
      echo "$err" >&2
      ok=0
      break
    fi
  done
  if [ "$ok" = 1 ]; then
    t0=$SECONDS
    if cmake --build "$bld" --target msa -j "${MSA_VARIANT_JOBS:-$(nproc)}" >"$out/build.log" 2>&1; then
      xz -T0 -3 -c "$bld/libmsa.so" >"$out/libmsa.so.xz"
      {
        echo "commit $head"
        for p in ${patches[$name]}; do echo "patch $(basename "$p") $(sha256sum "$p" | cut -c1-16)"; done
      } >"$out/variant.txt"
      ptxas="$("$root/scripts/check_ptxas.sh" "$out/build.log" 2>&1 | tail -n 1)" || ptxas="check_ptxas FAILED: $ptxas"
      echo "build_variants: $name built in $((SECONDS - t0)) s; $ptxas" >&2
    else
      tail -n 30 "$out/build.log" >&2
      echo "build_variants: $name FAILED to build (log: $out/build.log)" >&2
      ok=0
    fi
  fi
  [ "$ok" = 1 ] || { failed=1; rm -f "$out/libmsa.so.xz"; }
done
reset_src
echo "build_variants: libraries in $top/lib (copy that folder to the GPU machine; gpu_check.sh STAGES=variants)" >&2
exit "$failed"
