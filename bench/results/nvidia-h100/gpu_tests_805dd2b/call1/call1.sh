#!/usr/bin/env bash
# Call 1 (session 60): the TMA paged-read probe, then the grid on an H200, else the remaining GPU tests.
set -u
export MINIPAGED_GIT_COMMIT=$(cat .gpubin/head.sha)
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
echo "gpu: $gpu"
export STAGE_TIMEOUT_decode_selftest_paged_read=120 DECODE_SELFTEST_STEPS=paged_read DECODE_SELFTEST_REPS=${PR_REPS:-60}
if [[ $gpu == *H200* ]]; then
  BENCH_ARGS="--op all --backends triton,cuda --kv-cache-dtype fp8 --no-progress --time-budget 150" \
    bash scripts/gpu_check.sh decode_selftest bench
else
  GPU_TESTS_PASSED=".gpubin/passed_*.txt" TEST_SHARDS=4 STAGE_TIMEOUT_tests=340 \
    bash scripts/gpu_check.sh decode_selftest tests_par triton_cache
fi
nvidia-smi -q -d POWER,CLOCK > /tmp/minipaged_work/logs/nvidia_smi.txt 2>&1
tar -czf "$OUT/results.tgz" -C /tmp/minipaged_work logs bench
