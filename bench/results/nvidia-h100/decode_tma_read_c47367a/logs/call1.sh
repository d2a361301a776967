#!/usr/bin/env bash
# Call 1 (session 61): the TMA paged-read probe (every page order), then the grid on an H200, else the
# decode selftest's timings (16/8/128) for the same rows.
set -u
export MINIPAGED_GIT_COMMIT=$(cat .gpubin/head.sha)
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
echo "gpu: $gpu"
export STAGE_TIMEOUT_decode_selftest_paged_read=150 DECODE_SELFTEST_REPS=${PR_REPS:-60}
if [[ $gpu == *H200* ]]; then
  DECODE_SELFTEST_STEPS=paged_read BENCH_ARGS="--op all --backends triton,cuda --kv-cache-dtype fp8 --no-progress --time-budget 150" \
    bash scripts/gpu_check.sh decode_selftest bench
else
  DECODE_SELFTEST_STEPS="paged_read time" bash scripts/gpu_check.sh decode_selftest
  mv /tmp/minipaged_work/logs/decode_selftest_paged_read.log /tmp/minipaged_work/logs/paged_read_shuffled.log
  for order in sorted contiguous; do
    DECODE_PAGE_ORDER=$order STAGE_TIMEOUT_decode_selftest_paged_read=100 DECODE_SELFTEST_STEPS=paged_read \
      bash scripts/gpu_check.sh decode_selftest
    mv /tmp/minipaged_work/logs/decode_selftest_paged_read.log /tmp/minipaged_work/logs/paged_read_$order.log
  done
fi
nvidia-smi -q -d POWER,CLOCK > /tmp/minipaged_work/logs/nvidia_smi.txt 2>&1
tar -czf "$OUT/results.tgz" -C /tmp/minipaged_work logs bench
