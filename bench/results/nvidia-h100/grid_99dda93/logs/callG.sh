#!/usr/bin/env bash
# One call: the standard grid with FlashInfer and fp8 rows, then the decode selftest's rule timings
# at 16/8 heads, then with what time is left the page-order probe at 16/8 (large-batch rows).
R=$PWD; O=$OUT; T0=$SECONDS; mkdir -p /tmp/w
export MINIPAGED_GIT_COMMIT=$(cat $R/.gpubin/head.sha) OMP_NUM_THREADS=16
xz -dc $R/.gpubin/decode_selftest.xz > /tmp/ds && chmod +x /tmp/ds
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,power.limit --format=csv > /tmp/w/gpu.txt 2>&1
snap() { tar -czf $O/call.tgz.tmp -C /tmp w 2>/dev/null && mv $O/call.tgz.tmp $O/call.tgz; }
END=${END:-565}
( sleep $((END + 5)); snap ) > /dev/null 2>&1 &
wp=$!
gcap=${GCAP:-290}
OUT=/tmp/o/grid WORK=/tmp/w/grid STAGE_TIMEOUT_bench=$gcap \
  BENCH_ARGS="--op all --backends triton,cuda --kv-cache-dtype fp8 --no-progress --time-budget $((gcap * 55 / 100))" \
  bash scripts/gpu_check.sh bench > /tmp/w/grid.out 2>&1
echo "grid done at $((SECONDS - T0)) s" >> /tmp/w/sel.out
snap
left=$((END - (SECONDS - T0)))
if [ $left -gt 80 ]; then
  ( DECODE_TIME_HEADS=16,8,128 DECODE_TIME_VARIANTS=0,$((0x40000)),2048 DECODE_TIME_SKEW=1 \
    timeout $(( left > 140 ? 110 : left - 30 )) /tmp/ds time 100 > /tmp/w/time_rule_16_8.log 2>&1
    echo "time rule rc=$? at $((SECONDS - T0)) s" ) >> /tmp/w/sel.out
  snap
fi
for order in shuffled sorted contiguous; do
  left=$((END - (SECONDS - T0)))
  [ $left -gt 50 ] || break
  ( DECODE_PAGE_ORDER=$order DECODE_TIME_HEADS=16,8,128 DECODE_TIME_SHAPES=32004096,64008192,256001024 \
    DECODE_TIME_TILINGS=0 DECODE_TIME_VARIANTS=0 timeout 45 /tmp/ds time 100 > /tmp/w/time_order_$order.log 2>&1
    echo "time order $order rc=$? at $((SECONDS - T0)) s" ) >> /tmp/w/sel.out
  snap
done
kill $wp 2>/dev/null
snap
cat /tmp/w/gpu.txt /tmp/w/sel.out
grep -h "=== " /tmp/w/grid.out 2>/dev/null | tail -5
