#!/usr/bin/env bash
# One call: the merge rule's GPU tests (spec / mixed / routed paged rows and the warp-merge tests,
# 3 shards), then the standard grid with FlashInfer (--op all, fp8 rows), then with what time is
# left the decode selftest check (default merges) and the rule's timings at 32/8 and 64/8 heads.
R=$PWD; O=$OUT; T0=$SECONDS
rm -rf /tmp/clean && mkdir -p /tmp/clean /tmp/w/sel && cd /tmp/clean && tar xzf $R/.gpubin/head.tgz && cp -r $R/.anchors .
export MINIPAGED_GIT_COMMIT=$(cat $R/.gpubin/head.sha) OMP_NUM_THREADS=16
xz -dc $R/.gpubin/decode_selftest.xz > /tmp/ds && chmod +x /tmp/ds
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv > /tmp/w/gpu.txt 2>&1
snap() { tar -czf $O/call.tgz.tmp -C /tmp w 2>/dev/null && mv $O/call.tgz.tmp $O/call.tgz; }
END=${END:-560}
( sleep $((END + 5)); snap ) > /dev/null 2>&1 &
wp=$!
WORK=/tmp/w/tests OUT=/tmp/o/tests STAGE_TIMEOUT_tests=${TCAP:-200} GPU_TESTS=tests/test_cuda.py TEST_SHARDS=3 \
  GPU_TESTS_K="warp_merge or merge_launch_order or spec or mixed or routed" GPU_TESTS_ARGS="-v --tb=short" \
  bash scripts/gpu_check.sh tests_par > /tmp/w/tests.out 2>&1
echo "tests done at $((SECONDS - T0)) s" >> /tmp/w/sel.out
snap
left=$((END - (SECONDS - T0)))
if [ $left -gt 200 ]; then
  gcap=$(( left - 30 < 260 ? left - 30 : 260 ))
  OUT=/tmp/o/grid WORK=/tmp/w/grid STAGE_TIMEOUT_bench=$gcap \
    BENCH_ARGS="--op all --backends triton,cuda --kv-cache-dtype fp8 --no-progress --time-budget $((gcap * 55 / 100))" \
    bash scripts/gpu_check.sh bench > /tmp/w/grid.out 2>&1
  echo "grid done at $((SECONDS - T0)) s" >> /tmp/w/sel.out
  snap
fi
left=$((END - (SECONDS - T0)))
if [ $left -gt 60 ]; then
  ( timeout $(( left - 20 < 150 ? left - 20 : 150 )) /tmp/ds check > /tmp/w/check_default.log 2>&1; echo "check rc=$?" ) >> /tmp/w/sel.out
  echo "check done at $((SECONDS - T0)) s" >> /tmp/w/sel.out
  snap
fi
for h in 32,8,128 64,8,128; do
  left=$((END - (SECONDS - T0)))
  [ $left -gt 60 ] || break
  ( DECODE_TIME_HEADS=$h DECODE_TIME_VARIANTS=0,$((0x40000)),2048 DECODE_TIME_SKEW=1 \
    timeout $(( left > 150 ? 120 : left - 30 )) /tmp/ds time 100 > /tmp/w/time_${h//,/_}.log 2>&1
    echo "time $h rc=$? at $((SECONDS - T0)) s" ) >> /tmp/w/sel.out
  snap
done
kill $wp 2>/dev/null
snap
cat /tmp/w/gpu.txt /tmp/w/sel.out
grep -hE "passed|failed|error" /tmp/w/tests/logs/tests_shard*.log | grep -v PASSED | tail -8
grep -h "=== " /tmp/w/grid.out 2>/dev/null
grep -c PASS /tmp/w/check_default.log 2>/dev/null; grep -E "ALL PASSED|FAIL" /tmp/w/check_default.log 2>/dev/null | head -5
