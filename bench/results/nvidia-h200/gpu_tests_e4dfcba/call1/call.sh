R=$PWD; O=$OUT; rm -rf /tmp/clean && mkdir -p /tmp/clean && cd /tmp/clean && tar xzf $R/.gpubin/head.tgz && cp -r $R/.anchors . && mkdir -p .gpubin && xz -dc $R/.gpubin/decode_selftest_split.xz > .gpubin/decode_selftest && chmod +x .gpubin/decode_selftest
SHA=$(cat $R/.gpubin/head.sha)
(OUT=/tmp/xb WORK=/tmp/wb bash scripts/gpu_check.sh build > $O/build_driver.log 2>&1) & bp=$!
export OMP_NUM_THREADS=16
( nvidia-smi --query-gpu=name,driver_version --format=csv
  t=$SECONDS; timeout 90 compute-sanitizer --tool memcheck --error-exitcode 1 .gpubin/decode_selftest small > $O/memcheck_small.log 2>&1; echo "memcheck rc=$? $((SECONDS-t)) s"
  t=$SECONDS; timeout 150 .gpubin/decode_selftest check > $O/check.log 2>&1; echo "check rc=$? $((SECONDS-t)) s"
  wait $bp; echo "build wait done"
  export OUT=/tmp/xo WORK=/tmp/wx MINIPAGED_GIT_COMMIT=$SHA
  GPU_TESTS="${T2:-tests/test_cuda.py tests/test_cuda_fp8.py tests/test_cuda_decode_fused.py}" GPU_TESTS_K="${K2:-}" \
   GPU_TESTS_ARGS="-v --tb=short" HYPOTHESIS_PROFILE=gpu-short STAGE_TIMEOUT_tests=${TCAP:-360} TEST_SHARDS=${SHARDS:-3} \
   bash scripts/gpu_check.sh tests_par
) > $O/driver.log 2>&1
cp /tmp/wb/logs/build.log $O/build.log 2>/dev/null; cd /tmp/wx && tar czf $O/all.tgz logs bench 2>/dev/null
gzip -f $O/check.log $O/memcheck_small.log
cat $O/driver.log | grep -v "^  " | tail -40; grep "build " $O/build.log
