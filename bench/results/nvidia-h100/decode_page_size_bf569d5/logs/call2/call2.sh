#!/usr/bin/env bash
# Call 2 (session 61): decode time (tiling 0, the default plan) at pages of 16, 64 and 256 tokens,
# shuffled and contiguous; then, on an H200, the standard grid.
set -u
export MINIPAGED_GIT_COMMIT=$(cat .gpubin/head.sha)
W=/tmp/minipaged_work
rm -rf "$W/logs" "$W/bench"
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
echo "gpu: $gpu"
export DECODE_TIME_TILINGS=0 DECODE_SELFTEST_REPS=100 DECODE_SELFTEST_STEPS=time STAGE_TIMEOUT_decode_selftest_time=60
for page in 16 64 256; do
  for order in shuffled contiguous; do
    DECODE_TIME_PAGE=$page DECODE_PAGE_ORDER=$order bash scripts/gpu_check.sh decode_selftest
    mv $W/logs/decode_selftest_time.log $W/logs/time_p${page}_${order}.log
  done
done
if [[ $gpu == *H200* ]]; then
  BENCH_ARGS="--op all --backends triton,cuda --kv-cache-dtype fp8 --no-progress --time-budget 150" \
    bash scripts/gpu_check.sh bench
fi
nvidia-smi -q -d POWER,CLOCK > $W/logs/nvidia_smi.txt 2>&1
tar -czf "$OUT/results.tgz" -C $W logs $( [ -d $W/bench ] && echo bench )
