R=$PWD; O=$OUT; rm -rf /tmp/clean && mkdir -p /tmp/clean && cd /tmp/clean && tar xzf $R/.gpubin/head.tgz && cp -r $R/.anchors .
export MINIPAGED_GIT_COMMIT=$(cat $R/.gpubin/head.sha) OMP_NUM_THREADS=16
T="tests/test_paged.py tests/test_triton.py tests/test_triton_fp8.py tests/test_triton_hopper.py tests/test_triton_paged.py tests/test_crosscheck.py tests/test_edges.py tests/test_hardening.py tests/test_fp8.py tests/test_batch_invariant.py tests/test_api_fuzz.py tests/test_benchmark.py"
( OUT=/tmp/ot WORK=/tmp/w/tests GPU_TESTS="$T" GPU_TESTS_ARGS="-v --tb=short" HYPOTHESIS_PROFILE=gpu-short \
   STAGE_TIMEOUT_tests=${TCAP:-380} TEST_SHARDS=${SHARDS:-4} bash scripts/gpu_check.sh tests_par
) > $O/driver.log 2>&1
cd /tmp/w && tar czf $O/all.tgz . 2>/dev/null
grep -v "^  " $O/driver.log | grep "===\|passed\|failed\|error" | tail -40
