#!/usr/bin/env bash
# Call 1 of session 62 (written in session 61): why FP8 decode is slower over 64-token pages than over 16-token ones with the
# same bytes in the same place (contiguous pages): every fp8 and 16-bit tiling at B=32 L=4k and
# B=64 L=8k, pages of 16 and 64; Nsight Compute of the default fp8 kernel at B=64 L=8k on both;
# then the decode grid against its anchors at both page sizes. Results are packed after each step.
set -u
export MINIPAGED_GIT_COMMIT=$(cat .gpubin/head.sha)
W=/tmp/minipaged_work
rm -rf "$W/logs" "$W/bench" "$W"/bench_p*
pack() { nvidia-smi -q -d POWER,CLOCK > $W/logs/nvidia_smi.txt 2>&1
         tar -czf "$OUT/results.tgz" -C $W logs $(cd $W && ls -d bench_p* 2>/dev/null); }
echo "gpu: $(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)"
export DECODE_SELFTEST_STEPS=time DECODE_SELFTEST_REPS=100 DECODE_PAGE_ORDER=contiguous
export DECODE_TIME_SHAPES=32004096,64008192 STAGE_TIMEOUT_decode_selftest_time=60
# 64 first and again last, so that a drift over the call cannot pass for the page size
n=0
for page in 64 16 64; do
  n=$((n + 1))
  DECODE_TIME_PAGE=$page DECODE_TIME_KV=8 DECODE_TIME_TILINGS=0,6,7,8,10,18,19,23,24 \
    bash scripts/gpu_check.sh decode_selftest
  mv $W/logs/decode_selftest_time.log $W/logs/time_fp8_p${page}_$n.log
  DECODE_TIME_PAGE=$page DECODE_TIME_KV=16 DECODE_TIME_TILINGS=0,10,11,12,20,21,22 \
    bash scripts/gpu_check.sh decode_selftest
  mv $W/logs/decode_selftest_time.log $W/logs/time_16_p${page}_$n.log
  pack
done
for page in 16 64; do
  DECODE_TIME_PAGE=$page DECODE_NCU_ROWS=8:64008192 STAGE_TIMEOUT_decode_ncu=100 bash scripts/gpu_check.sh decode_ncu
  mv $W/logs/decode_ncu_8_64008192.log $W/logs/ncu_fp8_b64_p$page.log
  pack
done
# The decode grid against cuDNN on contiguous K/V and FlashInfer, at pages of 16 and 64 tokens.
for page in 16 64; do
  BENCH_ARGS="--op decode --backends cuda,triton --kv-cache-dtype fp8 --page-size $page --no-progress --no-plots \
    --time-budget 60" STAGE_TIMEOUT_bench=120 bash scripts/gpu_check.sh bench
  mv $W/bench $W/bench_p$page; mv $W/logs/bench.log $W/logs/bench_p$page.log
  pack
done
