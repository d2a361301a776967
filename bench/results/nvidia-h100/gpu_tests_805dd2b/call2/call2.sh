#!/usr/bin/env bash
# Call 2 (session 60): the GPU tests not passed yet at these kernels (.gpubin/passed_*.txt and the
# logs of earlier calls this session in .gpubin/logs*/), then Triton's cache.
set -u
export MINIPAGED_GIT_COMMIT=$(cat .gpubin/head.sha)
GPU_TESTS_PASSED=".gpubin/passed_*.txt .gpubin/logs*/*.log*" TEST_SHARDS=4 STAGE_TIMEOUT_tests=${TESTS_CAP:-420} \
  bash scripts/gpu_check.sh tests_par triton_cache
nvidia-smi -q -d POWER,CLOCK > /tmp/minipaged_work/logs/nvidia_smi.txt 2>&1
tar -czf "$OUT/results.tgz" -C /tmp/minipaged_work logs bench
