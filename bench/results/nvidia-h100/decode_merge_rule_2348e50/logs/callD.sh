#!/usr/bin/env bash
# The whole GPU suite in one call: 8 shards (7 + the two slow Triton cross-checks alone), leaving
# out EXCLUDE's ids (tests an earlier call passed at the same kernels; empty: run everything).
R=$PWD; O=$OUT
rm -rf /tmp/clean && mkdir -p /tmp/clean /tmp/w && cd /tmp/clean && tar xzf $R/.gpubin/head.tgz && cp -r $R/.anchors .
export MINIPAGED_GIT_COMMIT=$(cat $R/.gpubin/head.sha)
[ -n "${EXCLUDE:-}" ] && export MINIPAGED_TEST_EXCLUDE=$R/.gpubin/$EXCLUDE
nvidia-smi --query-gpu=name,driver_version --format=csv > /tmp/w/gpu.txt 2>&1
snap() { for f in /tmp/w/full/logs/*.log; do [ -f "$f" ] && gzip -c "$f" > "$f.gz"; done
  tar czf $O/full.tgz.tmp --exclude='*.log' -C /tmp w 2>/dev/null; mv $O/full.tgz.tmp $O/full.tgz; }
( sleep $(( ${CAP:-500} + 20 )); snap ) > /dev/null 2>&1 &
WORK=/tmp/w/full OUT=/tmp/o/full STAGE_TIMEOUT_tests=${CAP:-500} TEST_SHARDS=${SHARDS:-8} \
  GPU_TESTS_ARGS="-q --tb=short -o faulthandler_timeout=200" bash scripts/gpu_check.sh tests_par > /tmp/w/full.out 2>&1
snap
cat /tmp/w/gpu.txt; grep -h "=== tests_shard\|passed\|failed" /tmp/w/full.out | tail -20
