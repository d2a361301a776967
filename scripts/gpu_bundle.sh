#!/usr/bin/env bash
# Prepares, on the CPU machine, what a device call carries besides the working tree (the device
# tool's `carry`: .gpubin and .anchors), so that the call spends its minutes on the GPU:
#   .gpubin/decode_selftest.xz  scripts/decode_selftest.cu with the decode kernels for sm_90a,
#                               with gpu_check.sh's selftest flags (about a minute on 2 cores), when
#                               missing or with --selftest; xz keeps it far under the carry
#                               limit, and gpu_check.sh's decode stages unpack it
#   .gpubin/head.sha            the commit, for MINIPAGED_GIT_COMMIT (the device copy has no .git)
#   .anchors/flashinfer         ../shared/anchors/flashinfer, the benchmark's FA3 / decode anchors
# and, not made here, .gpubin/triton_cache/: the parts of Triton's kernel cache that gpu_check.sh's
# triton_cache stage returned from an earlier call (its top unpacks them).
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
  tmp=$(mktemp -d)  # outside .gpubin: the raw binary is ten times the compressed one
  trap 'rm -rf "$tmp"' EXIT
  bash scripts/build_decode_selftest.sh "$tmp/decode_selftest" 2  # two cores here
  xz -T2 -c "$tmp/decode_selftest" > .gpubin/decode_selftest.xz
  rm -f .gpubin/decode_selftest  # a stale raw binary would win over the new one
fi
ls -la .gpubin
echo "carry [\".gpubin\", \".anchors\"];" \
  "command e.g. MINIPAGED_GIT_COMMIT=$(cat .gpubin/head.sha) bash scripts/gpu_check.sh decode_selftest"
