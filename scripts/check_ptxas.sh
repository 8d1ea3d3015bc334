#!/usr/bin/env bash
# Fails when a build log shows ptxas spilling registers or using local memory, or serialising a
# kernel's wgmma pipeline, in a function that scripts/ptxas-allow.txt does not list. The CUDA
# compile options carry -Xptxas=--warn-on-spills and -Xptxas=--warn-on-local-memory-usage, so
# ptxas prints
#   ptxas warning : Registers are spilled to local memory in function '<name>', ...
#   ptxas warning : Local memory used for function '<name>', ...
# for every such function it compiles; and it always prints its wgmma performance notes,
#   ptxas info    : (C75xx) Potential Performance Loss: wgmma.mma_async instructions are
#                   serialized ... in the function '<name>'
#   ptxas info    : (C7517) warpgroup.wait is injected ... in function '<name>'
# (one such note cost the forward 1.6x once: see kernels/fwd_kernel.cuh).
#
#   scripts/check_ptxas.sh LOG [ALLOWLIST]     (ALLOWLIST default: scripts/ptxas-allow.txt)
#
# LOG is the captured output of `cmake --build`. A log without such warnings passes, an empty one
# included (nothing was compiled: an incremental build). Exit status: 0 clean, 1 a function not in
# the allowlist, 2 usage error.
set -euo pipefail

if [ $# -lt 1 ] || [ $# -gt 2 ]; then
  echo "usage: $0 LOG [ALLOWLIST]" >&2
  exit 2
fi
log=$1
allow=${2:-"$(cd "$(dirname "$0")" && pwd)/ptxas-allow.txt"}
if [ ! -f "$log" ]; then
  echo "check_ptxas: no build log '$log'" >&2
  exit 2
fi
if [ ! -f "$allow" ]; then
  echo "check_ptxas: no allowlist '$allow'" >&2
  exit 2
fi

compiled=$(grep -c 'Building CUDA object' "$log" || true)
warnings=$(grep -E "ptxas warning : (Registers are spilled to local memory in|Local memory used for) function '|ptxas info +: \(C75[0-9][0-9]\).* function '" "$log" || true)
if [ -z "$warnings" ]; then
  if [ "$compiled" -gt 0 ]; then
    echo "check_ptxas: $compiled CUDA object(s) compiled, no register spills, local memory or serialised wgmma"
  fi
  exit 0
fi

patterns=()
while IFS= read -r line || [ -n "$line" ]; do
  line="${line#"${line%%[![:space:]]*}"}"  # trim
  line="${line%"${line##*[![:space:]]}"}"
  [ -z "$line" ] && continue
  [[ "$line" == \#* ]] && continue
  patterns+=("$line")
done <"$allow"

demangle() {
  if command -v c++filt >/dev/null 2>&1; then c++filt -- "$1"; else printf '%s\n' "$1"; fi
}

allowed() {  # mangled demangled
  local pat
  for pat in "${patterns[@]+"${patterns[@]}"}"; do
    # shellcheck disable=SC2053  # the pattern is a glob on purpose
    if [[ "$1" == $pat ]] || [[ "$2" == $pat ]]; then return 0; fi
  done
  return 1
}

bad=()
n_allowed=0
while IFS= read -r name; do
  pretty="$(demangle "$name")"
  if allowed "$name" "$pretty"; then
    n_allowed=$((n_allowed + 1))
  else
    bad+=("$name")
  fi
done < <(printf '%s\n' "$warnings" | sed -E "s/.* function '([^']+)'.*/\1/" | sort -u)

if ((${#bad[@]} == 0)); then
  echo "check_ptxas: $n_allowed function(s) spill, use local memory or serialise wgmma, all listed in $allow"
  exit 0
fi

echo "check_ptxas: FAILED: ptxas reports register spills, local memory or serialised wgmma in ${#bad[@]} function(s) not listed in $allow:" >&2
for name in "${bad[@]}"; do
  echo "  $(demangle "$name")" >&2
  grep -F "'$name'" "$log" | sort -u | sed 's/^/      /' >&2
done
echo "check_ptxas: remove the spill (registers, launch bounds, tile shape) or the serialisation, or add a pattern for the" >&2
echo "check_ptxas: function to $allow with the reason in the commit message." >&2
exit 1
