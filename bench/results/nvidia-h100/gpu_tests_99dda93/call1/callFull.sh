#!/usr/bin/env bash
# The GPU suite in one capped call: SHARDS shards (default 4), leaving out the ids in
# .gpubin/$EXCLUDE (tests an earlier call passed at the same kernels); JUnit XMLs and gzipped logs
# come back in full.tgz (-v: a shard killed at the cap writes no XML, but its log names each pass),
# snapshotted just before the cap too.
R=$PWD; O=$OUT; mkdir -p /tmp/w
export MINIPAGED_GIT_COMMIT=$(cat $R/.gpubin/head.sha)
[ -n "${EXCLUDE:-}" ] && export MINIPAGED_TEST_EXCLUDE=$R/.gpubin/$EXCLUDE
nvidia-smi --query-gpu=name,driver_version --format=csv > /tmp/w/gpu.txt 2>&1
snap() { for f in /tmp/w/full/logs/*.log; do [ -f "$f" ] && gzip -c "$f" > "$f.gz"; done
  tar czf $O/full.tgz.tmp --exclude='*.log' -C /tmp w 2>/dev/null; mv $O/full.tgz.tmp $O/full.tgz; }
( sleep $(( ${CAP:-480} + 15 )); snap ) > /dev/null 2>&1 &
WORK=/tmp/w/full OUT=/tmp/o/full STAGE_TIMEOUT_tests=${CAP:-480} TEST_SHARDS=${SHARDS:-4} \
  GPU_TESTS_ARGS="-v --tb=short -o faulthandler_timeout=200" bash scripts/gpu_check.sh tests_par > /tmp/w/full.out 2>&1
snap
cat /tmp/w/gpu.txt; grep -h "=== tests_shard\|passed\|failed" /tmp/w/full.out | tail -20
