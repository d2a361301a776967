#!/usr/bin/env bash
# One call: the three CUDA decode test files (4 shards) alongside the selftest checks (default
# merges, then the warp-merge bit), then, with the GPU to itself, the warp-merge timings.
export MINIPAGED_GIT_COMMIT=e8e95bd OMP_NUM_THREADS=16
T0=$SECONDS
mkdir -p /tmp/w/sel /tmp/w/tests
snap() { tar -czf $OUT/call.tgz.tmp -C /tmp w 2>/dev/null && mv $OUT/call.tgz.tmp $OUT/call.tgz; }
( sleep $((${END:-570} + 5)); snap ) > /dev/null 2>&1 &
wp=$!
( WORK=/tmp/w/tests OUT=/tmp/o/tests STAGE_TIMEOUT_tests=${TCAP:-330} \
  GPU_TESTS="tests/test_cuda.py tests/test_cuda_fp8.py tests/test_cuda_decode_fused.py" \
  bash scripts/gpu_check.sh tests_par > /tmp/w/tests.out 2>&1 ) &
tp=$!
mkdir -p /tmp/w/sel
WORK=/tmp/w/sel OUT=/tmp/o/sel DECODE_SELFTEST_STEPS="check" bash scripts/gpu_check.sh decode_selftest > /tmp/w/sel.out 2>&1
WORK=/tmp/w/sel OUT=/tmp/o/sel DECODE_AB_HEADS=" " bash scripts/gpu_check.sh decode_bits_ab >> /tmp/w/sel.out 2>&1
echo "checks done at $((SECONDS - T0)) s" >> /tmp/w/sel.out
wait $tp
echo "tests done at $((SECONDS - T0)) s" >> /tmp/w/sel.out
snap
left=$((${END:-570} - (SECONDS - T0)))
if [ $left -gt 90 ]; then
  DECODE_TIME_HEADS=16,8,128 DECODE_TIME_VARIANTS=0,$((0x40000)),2048 DECODE_TIME_SKEW=1 DECODE_TIME_SPLITS=1,2 \
    timeout $((left - 10)) .gpubin/decode_selftest time 100 > /tmp/w/time_16_8_128.log 2>&1
  echo "time rc=$? at $((SECONDS - T0)) s" >> /tmp/w/sel.out
fi
kill $wp 2>/dev/null
snap
grep -E '^=== |ALL PASSED|FAIL|mismatch|done at' /tmp/w/sel.out | head -40
grep -h "passed\|failed\|error" /tmp/w/tests/logs/tests_shard*.log | tail -8
