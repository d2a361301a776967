#!/usr/bin/env bash
# Second call of the GPU suite: collect each shard's ids here (the same exclude as call 1), turn
# call 1's capped logs (.gpubin/logs1) into the ids they passed, and run what is left, -vv so that
# each result line names its test.
R=$PWD; O=$OUT; mkdir -p /tmp/w/col
export MINIPAGED_GIT_COMMIT=$(cat $R/.gpubin/head.sha)
nvidia-smi --query-gpu=name,driver_version --format=csv > /tmp/w/gpu.txt 2>&1
for i in 0 1 2 3; do
  MINIPAGED_TEST_EXCLUDE=$R/.gpubin/passed_2348e50.txt MINIPAGED_TEST_SHARD=$i/4 timeout 120 python3 -m pytest -m gpu \
    --collect-only -q -p no:cacheprovider tests/ > /tmp/w/col/col$i.txt 2>&1 &
done
wait
cp $R/.gpubin/passed_2348e50.txt /tmp/w/exclude.txt
for i in 0 1 2; do
  python3 $R/.gpubin/progress_passed.py $R/.gpubin/logs1/s$i.log.gz /tmp/w/col/col$i.txt > /tmp/w/col/passed$i.txt \
    2>> /tmp/w/col/parse.err && cat /tmp/w/col/passed$i.txt >> /tmp/w/exclude.txt
done
cat /tmp/w/col/parse.err; wc -l /tmp/w/exclude.txt
export MINIPAGED_TEST_EXCLUDE=/tmp/w/exclude.txt
snap() { for f in /tmp/w/full/logs/*.log; do [ -f "$f" ] && gzip -c "$f" > "$f.gz"; done
  tar czf $O/rest.tgz.tmp --exclude='*.log' -C /tmp w 2>/dev/null; mv $O/rest.tgz.tmp $O/rest.tgz; }
( sleep $(( ${CAP:-380} + 40 )); snap ) > /dev/null 2>&1 &
WORK=/tmp/w/full OUT=/tmp/o/full STAGE_TIMEOUT_tests=${CAP:-380} TEST_SHARDS=4 \
  GPU_TESTS_ARGS="-vv --tb=short -o faulthandler_timeout=300" bash scripts/gpu_check.sh tests_par > /tmp/w/full.out 2>&1
snap
cat /tmp/w/gpu.txt; grep -h "=== tests_shard\|passed\|failed" /tmp/w/full.out | tail -20
