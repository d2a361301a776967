R=$PWD; O=$OUT; rm -rf /tmp/clean && mkdir -p /tmp/clean && cd /tmp/clean && tar xzf $R/.gpubin/head.tgz && cp -r $R/.anchors .
export MINIPAGED_GIT_COMMIT=$(cat $R/.gpubin/head.sha) OMP_NUM_THREADS=16
( OUT=/tmp/o1 WORK=/tmp/w/grid STAGE_TIMEOUT_bench=${GCAP:-290} \
  BENCH_ARGS="--op all --backends triton,cuda --kv-cache-dtype fp8 --no-progress --time-budget ${GB:-150}" \
  bash scripts/gpu_check.sh build bench
  for h in 32/8 64/8; do n=h${h%/*}
    OUT=/tmp/o$n WORK=/tmp/w/$n STAGE_TIMEOUT_bench=${HCAP:-70} \
    BENCH_ARGS="--op decode --backends triton,cuda --heads $h --no-progress --no-crosscheck --time-budget ${HB:-40}" \
    bash scripts/gpu_check.sh bench
  done
  OUT=/tmp/ot WORK=/tmp/w/tests GPU_TESTS="tests/test_engine.py tests/test_engine_inputs.py tests/test_engine_online.py tests/test_engine_serving.py tests/test_transformers_integration.py" \
   GPU_TESTS_ARGS="-v --tb=short" HYPOTHESIS_PROFILE=gpu-short STAGE_TIMEOUT_tests=${TCAP:-100} TEST_SHARDS=${SHARDS:-3} \
   bash scripts/gpu_check.sh tests_par
) > $O/driver.log 2>&1
cd /tmp/w && tar czf $O/all.tgz . 2>/dev/null
grep -v "^  " $O/driver.log | grep "===\|passed\|failed\|error" | tail -40
