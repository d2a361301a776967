#!/usr/bin/env bash
# Prepares, on the CPU machine, what a device call carries besides the working tree (the device
# tool's `carry`: .gpubin and .anchors), so that the call spends its minutes on the GPU:
#   .gpubin/decode_selftest.xz  scripts/decode_selftest.cu with the decode kernels for sm_90a,
#                               with gpu_check.sh's selftest flags (about 5 min on 2 cores), when
#                               missing or with --selftest; xz keeps it far under the carry
#                               limit, and gpu_check.sh's decode stages unpack it
#   .gpubin/head.sha            the commit, for MINIPAGED_GIT_COMMIT (the device copy has no .git)
#   .anchors/flashinfer         ../shared/anchors/flashinfer, the benchmark's FA3 / decode anchors
# Both folders go into .git/info/exclude. Usage: scripts/gpu_bundle.sh [--selftest]
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
exclude=$(git rev-parse --git-path info/exclude)
mkdir -p .gpubin "$(dirname "$exclude")"
for p in .gpubin/ .anchors/; do grep -qxF "$p" "$exclude" 2>/dev/null || echo "$p" >> "$exclude"; done
git rev-parse --short HEAD > .gpubin/head.sha
[ -z "$(git status --porcelain --untracked-files=no)" ] ||
  echo "note: the working tree differs from HEAD; the device runs the working tree" >&2
if [ ! -d .anchors/flashinfer ] && [ -d ../shared/anchors/flashinfer ]; then
  mkdir -p .anchors && cp -r ../shared/anchors/flashinfer .anchors/
fi
if [ "${1:-}" = --selftest ] || [ ! -f .gpubin/decode_selftest.xz ]; then
  csrc=src/minipaged/cuda/csrc
  eval "$(grep '^selftest_flags=' scripts/gpu_check.sh)"  # the device's own build flags
  objs=$(mktemp -d)  # outside .gpubin: the objects alone pass the carry limit
  trap 'rm -rf "$objs"' EXIT
  pids=()
  for src in scripts/decode_selftest.cu $csrc/decode/launch.cu $csrc/decode/kernels_*.cu; do
    # shellcheck disable=SC2086
    nvcc $selftest_flags -c "$src" -o "$objs/$(basename "$src" .cu).o" &
    pids+=($!)
    if [ ${#pids[@]} -ge 2 ]; then wait "${pids[0]}"; pids=("${pids[@]:1}"); fi  # two cores here
  done
  for p in "${pids[@]}"; do wait "$p"; done
  # shellcheck disable=SC2086
  nvcc $selftest_flags "$objs"/*.o -o "$objs/decode_selftest" -lgomp
  xz -T2 -c "$objs/decode_selftest" > .gpubin/decode_selftest.xz
  rm -f .gpubin/decode_selftest  # a stale raw binary would win over the new one
fi
ls -la .gpubin
echo "carry [\".gpubin\", \".anchors\"];" \
  "command e.g. MINIPAGED_GIT_COMMIT=$(cat .gpubin/head.sha) bash scripts/gpu_check.sh decode_selftest"
