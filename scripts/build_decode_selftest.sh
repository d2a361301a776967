#!/usr/bin/env bash
# build_decode_selftest.sh OUT JOBS [nvcc flags...]: scripts/decode_selftest.cu with the decode
# kernels into OUT, with gpu_check.sh's selftest_flags and the given ones. One nvcc per source
# (one nvcc for all of them compiles them one after another, about 4x the wall time), JOBS at a
# time (0: all at once, as on the GPU machine's 16 cores), objects in a scratch folder. Run from
# the repository root; gpu_check.sh (its decode stages) and gpu_bundle.sh (a prebuilt binary to
# carry) both build through it.
set -euo pipefail
out=$1 jobs=$2
shift 2
csrc=src/minipaged/cuda/csrc
eval "$(grep '^selftest_flags=' scripts/gpu_check.sh)"
# shellcheck disable=SC2206,SC2154
flags=($selftest_flags "$@")
objs=$(mktemp -d)
trap 'rm -rf "$objs"' EXIT
pids=()
for src in scripts/decode_selftest.cu $csrc/decode/launch.cu $csrc/decode/kernels_*.cu; do
  nvcc "${flags[@]}" -c "$src" -o "$objs/$(basename "$src" .cu).o" &
  pids+=($!)
  if [ "$jobs" -gt 0 ] && [ ${#pids[@]} -ge "$jobs" ]; then wait "${pids[0]}"; pids=("${pids[@]:1}"); fi
done
for pid in "${pids[@]}"; do wait "$pid"; done
nvcc "${flags[@]}" "$objs"/*.o -o "$out" -lgomp
