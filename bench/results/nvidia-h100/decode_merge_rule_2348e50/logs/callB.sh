#!/usr/bin/env bash
# Follow-up: the CUDA FP8 and fused-decode GPU test files at 2348e50 (3 shards), snapshotting as it goes.
R=$PWD; O=$OUT
rm -rf /tmp/clean && mkdir -p /tmp/clean /tmp/w && cd /tmp/clean && tar xzf $R/.gpubin/head.tgz && cp -r $R/.anchors .
export MINIPAGED_GIT_COMMIT=$(cat $R/.gpubin/head.sha)
nvidia-smi --query-gpu=name,driver_version --format=csv > /tmp/w/gpu.txt 2>&1
( sleep ${CAP:-240}; tar czf $O/b.tgz -C /tmp w ) > /dev/null 2>&1 &
WORK=/tmp/w/t OUT=/tmp/o/t STAGE_TIMEOUT_tests=${CAP:-240} TEST_SHARDS=3 \
  GPU_TESTS="tests/test_cuda_fp8.py tests/test_cuda_decode_fused.py" GPU_TESTS_ARGS="-q --tb=short" \
  bash scripts/gpu_check.sh tests_par > /tmp/w/t.out 2>&1
tar czf $O/b.tgz -C /tmp w
cat /tmp/w/gpu.txt; tail -4 /tmp/w/t.out; grep -hE "passed|failed" /tmp/w/t/logs/tests_shard*.log | tail -4
