#!/usr/bin/env bash
# One call on the GPU machine: build the CUDA extension once, run the GPU tests,
# run the benchmarks, and leave logs + JSON under $OUT (bundled into one tarball,
# since only a few files come back).
#   scripts/gpu_check.sh [build] [probe] [tests] [tests_par] [bench] [e2e] [serving] [overhead] [engine_step] [launch_profile] [invariant] [power] [paged_selftest]
#                        [ws] [ws_ncu] [ws_ab] [paged_ws] [ws8_ab] [decode_selftest] [decode_ab] [decode_bits_ab] [two_warp_ab] [decode_worklist] [decode_worklist_bench] [decode_ncu] [decode_trace] [triton_ab] [triton_paged_ab] [triton_paged_fp8_ab] [triton_paged_ncu] [triton_fp8_ab] [triton_worklist] [spec_bench] [spec_ncu] [spec_fp8_ab]
#                        [bench_fp8 | bench_fp8_decode | bench_fp8_paged] [fp8_accuracy] [sanitize] [diag] [ncu] [triton_cache]
#   (default: build probe bench tests e2e; diag and ncu are the decode tuning runs
#   of scripts/decode_diag.py)
# Each stage has a wall-clock cap (STAGE_TIMEOUT_<stage>, seconds) and is stopped
# with SIGINT, so pytest still prints its summary and bench keeps its JSON (then SIGABRT, which
# makes Python print its stacks, then SIGKILL).
# The device copy has no .git: pass MINIPAGED_GIT_COMMIT=<sha> for the records. FlashInfer (the
# bench's FA3 and decode anchors) comes in when the call carries .anchors (see below; gpu.txt says
# whether it imported).
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
OUT=${OUT:-/tmp/minipaged_out}
# Only a few files come back from $OUT: work in WORK and re-pack it into
# $OUT/results.tgz after every stage, so a run cut short still returns its logs.
WORK=${WORK:-/tmp/minipaged_work}
mkdir -p "$OUT" "$WORK/logs" "$WORK/bench"
stages=${*:-build probe bench tests e2e}
# The torch-free selftests (scripts/*_selftest.cu): one set of flags; binaries prebuilt on the
# dev box (same nvcc) may be carried in .gpubin/, else they are built here.
csrc=src/minipaged/cuda/csrc
bin=${WS_BIN:-.gpubin}
selftest_flags="-std=c++17 -O3 -lineinfo -gencode=arch=compute_90a,code=sm_90a -DMINIPAGED_ENABLE_SM90A -Xcompiler -fopenmp -I $csrc"
status=0
run() {  # run NAME CMD...: log to $WORK/logs/NAME.log, remember failures
  local name=$1; shift
  local t0=$SECONDS
  local cap_var="STAGE_TIMEOUT_$name"
  local cap=${!cap_var:-600}
  echo "=== $name (cap ${cap}s): $*"
  # at the cap: SIGINT (pytest prints its summary and writes its JUnit file), 15 s later SIGABRT
  # (Python's faulthandler prints every thread's stack: a process that ignored the SIGINT, e.g.
  # blocked in C code, still says where), 5 s later SIGKILL; rc 124 as timeout(1) gives
  # (a background job starts with SIGINT ignored in a script; the trap restores it)
  ( trap - INT; exec "$@" ) > "$WORK/logs/$name.log" 2>&1 &
  local pid=$!
  # (the watcher's sleeps die with it, so none outlives the stage holding the call's output open)
  ( trap 'kill ${nap:-} 2>/dev/null; exit 0' TERM
    nap_for() { sleep "$1" & nap=$!; wait $nap; }
    nap_for "$cap"; touch "$WORK/logs/$name.capped"; kill -INT "$pid" 2>/dev/null || exit 0; nap_for 15
    kill -ABRT "$pid" 2>/dev/null || exit 0; nap_for 5; kill -KILL "$pid" 2>/dev/null ) > /dev/null 2>&1 &
  local watcher=$!
  wait "$pid"
  local rc=$?
  kill "$watcher" 2>/dev/null
  if [ -e "$WORK/logs/$name.capped" ]; then rc=124; rm -f "$WORK/logs/$name.capped"; fi
  echo "=== $name: rc=$rc in $((SECONDS - t0)) s"
  tail -n 25 "$WORK/logs/$name.log"
  [ $rc -eq 0 ] || status=1
  tar -czf "$OUT/results.tgz" -C "$WORK" logs bench 2>/dev/null
  return $rc  # (a stage run in the background reports through its job's exit status)
}

# decode_selftest_bin LOG NAME [nvcc flags...]: a decode_selftest build at $bin/NAME, as carried in
# (.gpubin/NAME, or NAME.xz as scripts/gpu_bundle.sh prebuilds it on the dev box with the same nvcc
# and flags), else built here by scripts/build_decode_selftest.sh under the run name LOG (cap
# STAGE_TIMEOUT_LOG, default 150 s), its sources all compiling at once.
decode_selftest_bin() {
  local log=$1 name=$2
  shift 2
  mkdir -p "$bin"
  [ -x "$bin/$name" ] && return 0
  if [ -f "$bin/$name.xz" ]; then xz -dc "$bin/$name.xz" > "$bin/$name" && chmod +x "$bin/$name" && return 0; fi
  local cap_var="STAGE_TIMEOUT_$log"
  export "$cap_var=${!cap_var:-150}"
  run "$log" bash scripts/build_decode_selftest.sh "$bin/$name" 0 "$@"
}

nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv > "$WORK/logs/gpu.txt" 2>&1
# Triton's kernel cache: most of a fresh machine's first minutes of GPU tests go to compiling
# Triton kernels. The `triton_cache` stage packs the cache into $OUT (xz, 15 MiB parts); parts
# carried back in $bin/triton_cache/ are unpacked here first, so a later call (H100 or H200, both
# sm_90) finds every kernel whose source, options and triton version are unchanged. Unpack at the
# path they were packed from: Triton's group files name their members by absolute path. The unpack
# line also goes to logs/triton_cache_unpack.log, which a later run of this script in the same call
# does not rewrite (gpu.txt it does).
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-/tmp/minipaged_triton_cache}
mkdir -p "$TRITON_CACHE_DIR"
tc_parts=("$bin"/triton_cache/triton_cache.tar.xz.*)
if [ -f "${tc_parts[0]}" ] && [ -z "$(ls -A "$TRITON_CACHE_DIR")" ]; then
  if cat "${tc_parts[@]}" | xz -dc | tar -xf - -C "$TRITON_CACHE_DIR"; then
    echo "triton cache: $(ls "$TRITON_CACHE_DIR" | wc -l) entries unpacked from ${#tc_parts[@]} carried part(s)" \
      | tee -a "$WORK/logs/gpu.txt" >> "$WORK/logs/triton_cache_unpack.log"
  else
    echo "triton cache: the carried parts did not unpack; compiling from scratch" \
      | tee -a "$WORK/logs/gpu.txt" >> "$WORK/logs/triton_cache_unpack.log"
    rm -rf "${TRITON_CACHE_DIR:?}"/* 2>/dev/null
  fi
fi
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())" | tee -a "$WORK/logs/gpu.txt"
# FlashInfer, the bench's FA3 and decode anchors: when the call carried .anchors/flashinfer (the
# run tool's carry) and it does not import yet, make it importable here, so that no later export
# of PYTHONPATH in the calling command can drop it (FLASHINFER=0: leave it out). Say which.
if [ "${FLASHINFER:-1}" = 1 ] && [ -f .anchors/flashinfer/env.sh ] && [ -f .anchors/flashinfer/fi_bundle.tar.xz ] &&
   ! python3 -c "import flashinfer" > /dev/null 2>&1; then
  # shellcheck disable=SC1091
  source .anchors/flashinfer/env.sh .anchors/flashinfer/fi_bundle.tar.xz > "$WORK/logs/fi_env.log" 2>&1
fi
python3 -c "import flashinfer; print('flashinfer', flashinfer.__version__)" >> "$WORK/logs/gpu.txt" 2>/dev/null ||
  echo "flashinfer: not importable (no FA3 / FlashInfer decode anchors in this call)" | tee -a "$WORK/logs/gpu.txt"

for s in $stages; do
  case $s in
    probe)
      # The sm_90a wgmma prefill is picked automatically on sm_90. If it fails the
      # oracle here, rebuild without it so the rest of the run measures the
      # mma.sync path, and say so loudly.
      run probe python3 scripts/probe_cuda_prefill.py
      if [ "$(tail -n 1 "$WORK/logs/probe.log")" != "probe: 0 failure(s)" ]; then
        echo "!!! cuda prefill failed the probe: rebuilding with -DMINIPAGED_DISABLE_WGMMA"
        export MINIPAGED_NVCC_FLAGS="${MINIPAGED_NVCC_FLAGS:-} -DMINIPAGED_DISABLE_WGMMA"
        echo "MINIPAGED_DISABLE_WGMMA" > "$WORK/logs/wgmma_disabled.txt"
        run build_nowgmma python3 -c "from minipaged.cuda import build; build.load()"
        run probe_nowgmma python3 scripts/probe_cuda_prefill.py
      fi;;
    build) run build python3 -c "import time; t=time.time(); from minipaged.cuda import build; build.load(); print(f'build {time.time()-t:.1f} s')";;
    tests)
      # TESTS_LOG names the log (and the stage); STAGE_TIMEOUT_tests caps it under any name.
      # GPU_TESTS_K: a pytest -k expression (it may hold spaces; GPU_TESTS is split on them).
      # GPU_TESTS_ARGS: more pytest arguments (e.g. "--tb=line"). The stage runs -v: each result
      # line names its test, so a shard stopped at its cap, which writes no JUnit file, still names
      # its failures and passes (scripts/junit_passed.py reads the log for the next call's exclude).
      [ -n "${TESTS_LOG:-}" ] && [ -n "${STAGE_TIMEOUT_tests:-}" ] && export "STAGE_TIMEOUT_${TESTS_LOG}=${STAGE_TIMEOUT_tests}"
      # MINIPAGED_LOG_EXAMPLES: the hypothesis cross-checks print each drawn case, so a failing draw
      # and hypothesis's silent re-runs of it show in the log (gpu_tests_3e3bc37/)
      run ${TESTS_LOG:-tests} env HYPOTHESIS_PROFILE=${HYPOTHESIS_PROFILE:-gpu} \
        MINIPAGED_LOG_EXAMPLES=${MINIPAGED_LOG_EXAMPLES:-1} python3 -m pytest -m gpu -v -ra -s --durations=20 -p no:cacheprovider \
        --junitxml "$WORK/logs/${TESTS_LOG:-tests}.xml" ${GPU_TESTS_K:+-k "$GPU_TESTS_K"} ${GPU_TESTS_ARGS:-} \
        ${GPU_TESTS:-tests/};;
    tests_par)
      # The GPU tests of GPU_TESTS (default tests/) dealt to TEST_SHARDS (default 4) pytest
      # processes that run at once (one GPU, 16 cores: the Triton JIT and the fp64
      # oracles are CPU-bound), by test (MINIPAGED_TEST_SHARD, tests/conftest.py), so one
      # slow file no longer holds a shard; logs tests_shard<i>.log.
      # The extension is built once here first (a no-op when cached): a shard that reaches a CUDA
      # test would otherwise build it while the others wait on its lock, all under their caps.
      # TESTS_PAR_BUILD=0 skips that for Triton-only selections.
      # GPU_TESTS_PASSED: files naming tests an earlier call passed at the same kernels (JUnit
      # .xml, verbose logs, id lists .txt; any of them .gz), left out here together with any
      # MINIPAGED_TEST_EXCLUDE file (scripts/junit_passed.py; the list is logs/tests_excluded.txt).
      if [ -n "${GPU_TESTS_PASSED:-}" ]; then
        # shellcheck disable=SC2086  # a list of paths or globs
        { python3 scripts/junit_passed.py $GPU_TESTS_PASSED; cat "${MINIPAGED_TEST_EXCLUDE:-/dev/null}"; } |
          sort -u > "$WORK/logs/tests_excluded.txt"
        export MINIPAGED_TEST_EXCLUDE="$WORK/logs/tests_excluded.txt"
        echo "tests_par: leaving out $(wc -l < "$MINIPAGED_TEST_EXCLUDE") tests passed earlier"
      fi
      [ "${TESTS_PAR_BUILD:-1}" = 1 ] && run build python3 -c "from minipaged.cuda import build; build.load()"
      n=${TEST_SHARDS:-4}
      for ((i = 0; i < n; i++)); do
        MINIPAGED_TEST_SHARD="$i/$n" TESTS_LOG=tests_shard$i bash "$0" tests > "$WORK/logs/tests_shard$i.out" 2>&1 &
      done
      wait
      grep -h "=== tests_shard\|passed\|failed" "$WORK"/logs/tests_shard*.out;;
    bench) run bench python3 -m minipaged.cli bench ${BENCH_ARGS:-} --out "$WORK/bench";;
    e2e) run e2e python3 bench/bench_e2e.py ${E2E_ARGS:-} --out "$WORK/bench";;
    serving) run serving python3 bench/bench_serving.py ${SERVING_ARGS:-} --out "$WORK/bench";;
    overhead) run overhead python3 bench/bench_overhead.py --json "$WORK/bench/overhead.json";;
    engine_step) run engine_step${ENGINE_STEP_TAG:-} python3 scripts/engine_decode_step.py ${ENGINE_STEP_ARGS:-} \
      --json "$WORK/bench/engine_step${ENGINE_STEP_TAG:-}.json";;
    launch_profile) run launch_profile python3 scripts/triton_launch_profile.py ${LAUNCH_PROFILE_ARGS:-} --json "$WORK/bench/launch_profile.json";;
    invariant) run invariant python3 scripts/invariant_bench.py --out "$WORK/bench/invariant.json";;
    power) run power python3 scripts/power_probe.py ${POWER_ARGS:-} --json "$WORK/bench/power.json";;
    paged_selftest)
      run paged_selftest_build nvcc $selftest_flags scripts/paged_selftest.cu $csrc/prefill/paged*.cu \
        $csrc/decode/launch.cu $csrc/decode/kernels_*.cu -o /tmp/paged_selftest -lgomp
      run paged_memcheck compute-sanitizer --tool memcheck /tmp/paged_selftest small
      OMP_NUM_THREADS=16 run paged_selftest /tmp/paged_selftest check;;
    ws)
      # Warp-specialised TMA prefill (issue #16) and the current wgmma kernel for the
      # previous-step figure.
      # WS_STEPS: any of small check sanitize time fast_time fast_check (default all); WS_SCHEDULES
      # (read by ws_selftest) limits its schedules; FAST_TIME_FILTER the timed fast_selftest
      # variants and FAST_CHECK_FILTER the checked ones.
      steps=" ${WS_STEPS:-small check sanitize time fast_time fast_check} "
      mkdir -p "$bin"
      [ -x "$bin/ws_selftest" ] || run ws_build nvcc $selftest_flags scripts/ws_selftest.cu -o "$bin/ws_selftest" -lgomp
      # fast_selftest only when a fast_* step needs it
      [ -x "$bin/fast_selftest" ] || [[ $steps != *" fast_"* ]] || run fast_build nvcc $selftest_flags \
        scripts/fast_selftest.cu $csrc/prefill/fast*.cu -o "$bin/fast_selftest" -lgomp
      export OMP_NUM_THREADS=16
      [[ $steps == *" small "* ]] && STAGE_TIMEOUT_ws_small=60 run ws_small "$bin/ws_selftest" small
      [[ $steps == *" check "* ]] && STAGE_TIMEOUT_ws_check=${STAGE_TIMEOUT_ws_check:-240} run ws_check "$bin/ws_selftest" check
      if [[ $steps == *" sanitize "* ]]; then
        export STAGE_TIMEOUT_ws_memcheck=${STAGE_TIMEOUT_ws_memcheck:-120} STAGE_TIMEOUT_ws_racecheck=${STAGE_TIMEOUT_ws_racecheck:-120} \
          STAGE_TIMEOUT_ws_synccheck=${STAGE_TIMEOUT_ws_synccheck:-120}
        for tool in memcheck racecheck synccheck; do
          run ws_$tool compute-sanitizer --tool $tool --error-exitcode 1 "$bin/ws_selftest" small
        done
      fi
      [[ $steps == *" time "* ]] && STAGE_TIMEOUT_ws_time=${STAGE_TIMEOUT_ws_time:-120} run ws_time "$bin/ws_selftest" time 20
      [[ $steps == *" fast_time "* ]] && STAGE_TIMEOUT_fast_time=180 run fast_time "$bin/fast_selftest" time 20 ${FAST_TIME_FILTER:-}
      [[ $steps == *" fast_check "* ]] && STAGE_TIMEOUT_fast_check=240 run fast_check "$bin/fast_selftest" check ${FAST_CHECK_FILTER:-}
      (cuobjdump -sass "$bin/ws_selftest" | grep -c USETMAXREG) > "$WORK/logs/ws_setmaxnreg.txt" 2>&1;;
    ws_ncu)
      # Full ncu sections for the pp+overlap and the serial schedule at B=1 N=8k causal:
      # tensor-pipe activity, stall reasons at the barriers, shared-memory traffic.
      mkdir -p "$bin"
      [ -x "$bin/ws_selftest" ] || run ws_build nvcc $selftest_flags scripts/ws_selftest.cu -o "$bin/ws_selftest" -lgomp
      # WS_NCU_SCHEDULES: the ws_selftest schedules to profile (default 4 0).
      for s in ${WS_NCU_SCHEDULES:-4 0}; do
        export STAGE_TIMEOUT_ws_ncu_$s=${STAGE_TIMEOUT_ws_ncu:-300}
        run ws_ncu_$s ncu --clock-control none --set full -k regex:prefill_ws_kernel \
          --launch-skip 1 --launch-count 1 "$bin/ws_selftest" profile $s
      done;;
    ws_ab)
      # Schedules WS_SCHEDULES (e.g. 12,16) at B=1 N=WS_AB_N causal: interleaved timing (ws_selftest
      # ab), energy per call under sustained load (ws_selftest power, NVML), and ncu's DRAM / L2
      # counters of one launch of each.
      mkdir -p "$bin"
      [ -x "$bin/ws_selftest" ] || run ws_build nvcc $selftest_flags scripts/ws_selftest.cu -o "$bin/ws_selftest" -lgomp
      n=${WS_AB_N:-16384}
      STAGE_TIMEOUT_ws_ab=${STAGE_TIMEOUT_ws_ab:-120} run ws_ab "$bin/ws_selftest" ab "$n" ${WS_AB_ROUNDS:-3} ${WS_AB_REPS:-40}
      STAGE_TIMEOUT_ws_power=${STAGE_TIMEOUT_ws_power:-90} run ws_power "$bin/ws_selftest" power "$n" ${WS_POWER_SECONDS:-2} ${WS_POWER_ROUNDS:-2}
      for s in ${WS_SCHEDULES//,/ }; do
        export STAGE_TIMEOUT_ws_ab_ncu_$s=90
        run ws_ab_ncu_$s ncu --clock-control none -k regex:prefill_ws_kernel --launch-skip 1 --launch-count 1 \
          --metrics gpu__time_duration.sum,dram__bytes_read.sum,dram__bytes_write.sum,lts__t_sectors.sum,lts__t_sector_hit_rate.pct,sm__cycles_elapsed.avg.per_second \
          "$bin/ws_selftest" profile "$s" "$n"
      done;;
    paged_ws)
      # Paged attention through the warp-specialised TMA kernel and the mixed-batch split
      # (scripts/paged_ws_selftest.cu): check, small under memcheck/racecheck/synccheck, time.
      # The binary compiles the decode kernels in (the routed variants and the decode anchor of
      # the mixed timing need them).
      # PAGED_WS_FLAGS: more nvcc flags, e.g. -DMINIPAGED_DISABLE_WS_FP8 (the dispatch variants then send
      # FP8 chunks through the mma.sync FP8 kernels, as the extension built with that flag would).
      flags="$selftest_flags -Xptxas -v ${PAGED_WS_FLAGS:-}"
      mkdir -p "$bin"
      [ -x "$bin/paged_ws_selftest" ] || STAGE_TIMEOUT_paged_ws_build=400 run paged_ws_build nvcc $flags \
        scripts/paged_ws_selftest.cu $csrc/prefill/paged*.cu -o "$bin/paged_ws_selftest" -lgomp
      export OMP_NUM_THREADS=16
      # PAGED_WS_STEPS: any of small check sanitize time time1w (default the first four; time1w times
      # the mirrored block pairs on one-wave causal chunks); PAGED_WS_CHECK_FILTER limits the checked
      # variants (a substring of their names, e.g. ws_mirror).
      steps=" ${PAGED_WS_STEPS:-small check sanitize time} "
      [[ $steps == *" small "* ]] && STAGE_TIMEOUT_paged_ws_small=90 run paged_ws_small "$bin/paged_ws_selftest" small
      [[ $steps == *" check "* ]] && STAGE_TIMEOUT_paged_ws_check=${STAGE_TIMEOUT_paged_ws_check:-420} \
        run paged_ws_check "$bin/paged_ws_selftest" check ${PAGED_WS_CHECK_FILTER:-}
      if [[ $steps == *" sanitize "* ]]; then
        export STAGE_TIMEOUT_paged_ws_memcheck=${STAGE_TIMEOUT_paged_ws_memcheck:-180} \
          STAGE_TIMEOUT_paged_ws_racecheck=${STAGE_TIMEOUT_paged_ws_racecheck:-240} \
          STAGE_TIMEOUT_paged_ws_synccheck=${STAGE_TIMEOUT_paged_ws_synccheck:-180}
        for tool in memcheck racecheck synccheck; do
          run paged_ws_$tool compute-sanitizer --tool $tool --error-exitcode 1 "$bin/paged_ws_selftest" small
        done
      fi
      [[ $steps == *" time "* ]] && STAGE_TIMEOUT_paged_ws_time=${STAGE_TIMEOUT_paged_ws_time:-240} \
        run paged_ws_time "$bin/paged_ws_selftest" time 20
      [[ $steps == *" time1w "* ]] && STAGE_TIMEOUT_paged_ws_time1w=${STAGE_TIMEOUT_paged_ws_time1w:-180} \
        run paged_ws_time1w "$bin/paged_ws_selftest" time1w 40;;
    ws8_ab)
      # The FP8 TMA prefill's widening producer: the exhaustive e4m3 widening check
      # (scripts/fp8_widen_selftest.cu), then `time8` (ws_fp8 against the 16-bit kernel, both dtypes,
      # plus the fp8 small and reduced-shape checks) of each paged_ws_selftest binary in WS8_BINS
      # (names under $bin, e.g. built with different -DMINIPAGED_WS8_WIDEN).
      mkdir -p "$bin"
      [ -x "$bin/fp8_widen_selftest" ] || run fp8_widen_build nvcc -std=c++17 -O3 -gencode=arch=compute_90a,code=sm_90a \
        -I $csrc scripts/fp8_widen_selftest.cu -o "$bin/fp8_widen_selftest"
      STAGE_TIMEOUT_fp8_widen=30 run fp8_widen "$bin/fp8_widen_selftest"
      export OMP_NUM_THREADS=16
      for b in ${WS8_BINS:-paged_ws_selftest}; do
        export STAGE_TIMEOUT_time8_$b=${STAGE_TIMEOUT_time8:-90}
        run time8_$b "$bin/$b" time8 ${WS8_REPS:-20}
      done;;
    spec_bench) run spec_bench python3 scripts/spec_bench.py ${SPEC_BENCH_ARGS:-} --json "$WORK/bench/spec_bench.json";;
    spec_fp8_ab)
      # FP8 speculative runs over 16 rows per KV head, two extension builds (built at once, then
      # timed in two alternating rounds): the default (the decode kernel's two row blocks within
      # one wave of its CTAs, the packed kernel past it) and the decode kernel at any batch.
      # SPEC_FP8_AB_ARGS: spec_bench's --heads / --q-lens / --rows (default 16/8, q_len 16).
      ab_flags=("" "-DMINIPAGED_SPEC_DECODE_FP8_MAX_ROWS=32")
      for i in 0 1; do
        export STAGE_TIMEOUT_spec_fp8_ab_build$i=400
        MINIPAGED_NVCC_FLAGS="${ab_flags[$i]}" \
          run spec_fp8_ab_build$i python3 -c "from minipaged.cuda import build; build.load()" &
        build_pids[$i]=$!
      done
      for i in 0 1; do wait "${build_pids[$i]}" || status=1; done
      MINIPAGED_NVCC_FLAGS="${ab_flags[1]}" STAGE_TIMEOUT_spec_fp8_ab_tests=${STAGE_TIMEOUT_spec_fp8_ab_tests:-240} \
        run spec_fp8_ab_tests python3 -m pytest -m gpu -q -ra -p no:cacheprovider -k spec tests/test_cuda_fp8.py
      for round in 1 2; do
        for i in 0 1; do
          export STAGE_TIMEOUT_spec_fp8_ab_r${round}_b$i=90
          MINIPAGED_NVCC_FLAGS="${ab_flags[$i]}" \
            run spec_fp8_ab_r${round}_b$i python3 scripts/spec_bench.py --columns "fp8 cuda" \
            ${SPEC_FP8_AB_ARGS:---q-lens 16 --rows 1x4096,1x32768,8x4096,32x4096,64x4096,128x1024} \
            --json "$WORK/bench/spec_fp8_ab_r${round}_b$i.json"
        done
      done;;
    spec_ncu)
      # Where the multi-query decode kernel spends the time a decode does not: ncu's warp-state
      # sampling per SASS instruction of one spec launch and one decode launch on the same cache
      # (spec_bench --profile 2: spec, decode, spec, decode; the first pair is skipped), exported
      # as CSV (bench/spec_ncu_sass.csv) next to the details page. SPEC_NCU_ARGS: spec_bench's
      # --rows / --q-lens (default 128x1024, q_len 8).
      STAGE_TIMEOUT_spec_ncu=${STAGE_TIMEOUT_spec_ncu:-240} run spec_ncu ncu --clock-control none \
        --section SourceCounters --section WarpStateStats --section SchedulerStats --section SpeedOfLight \
        --section LaunchStats -k regex:paged_decode_mma --launch-skip 2 --launch-count 2 -f -o "$WORK/bench/spec_ncu" \
        python3 scripts/spec_bench.py --profile 2 ${SPEC_NCU_ARGS:---rows 128x1024 --q-lens 8}
      run spec_ncu_details ncu --import "$WORK/bench/spec_ncu.ncu-rep" --page details
      ncu --import "$WORK/bench/spec_ncu.ncu-rep" --page source --print-source sass --csv \
        > "$WORK/bench/spec_ncu_sass.csv" 2> "$WORK/logs/spec_ncu_sass.err";;
    triton_ab) run triton_ab python3 scripts/triton_hopper_ab.py ${TRITON_AB_ARGS:-} --json "$WORK/bench/triton_hopper_ab.json";;
    triton_fp8_ab) run triton_fp8_ab python3 scripts/triton_fp8_decode_ab.py ${TRITON_FP8_AB_ARGS:-} --json "$WORK/bench/triton_fp8_decode_ab.json";;
    triton_worklist)
      # Triton's work-list decode (configs.decode_worklist): its GPU tests (uneven batches against
      # the oracle, graph replays that follow new lengths), then the A/B against the plain plan
      # on the standard decode grid, 16-bit and fp8 caches
      STAGE_TIMEOUT_triton_worklist_tests=${STAGE_TIMEOUT_triton_worklist_tests:-240} \
        run triton_worklist_tests python3 -m pytest -q -ra -m gpu tests/test_triton.py tests/test_triton_paged.py tests/test_triton_fp8.py \
        -k "worklist or graph or lse" -p no:cacheprovider --junitxml "$WORK/logs/triton_worklist_tests.xml"
      STAGE_TIMEOUT_triton_worklist_ab=${STAGE_TIMEOUT_triton_worklist_ab:-420} run triton_worklist_ab \
        python3 scripts/triton_decode_worklist_ab.py ${TRITON_WORKLIST_AB_ARGS:-} --json "$WORK/bench/triton_worklist_ab.json";;
    triton_paged_fp8_ab) run triton_paged_fp8_ab python3 scripts/triton_paged_fp8_ab.py ${TRITON_PAGED_FP8_AB_ARGS:-} --json "$WORK/bench/triton_paged_fp8_ab.json";;
    triton_paged_ab) run triton_paged_ab python3 scripts/triton_paged_ab.py ${TRITON_PAGED_AB_ARGS:-} --json "$WORK/bench/triton_paged_ab.json";;
    triton_paged_ncu)
      # ncu sections of the Triton dense varlen kernel and the paged long-chunk kernel on the same
      # work (scripts/triton_paged_ncu.py; two launches of each inside NVTX ranges).
      STAGE_TIMEOUT_triton_paged_ncu=${STAGE_TIMEOUT_triton_paged_ncu:-180} run triton_paged_ncu ncu --clock-control none \
        --nvtx --nvtx-include "dense/" --nvtx-include "paged/" --section SpeedOfLight --section MemoryWorkloadAnalysis \
        --section WarpStateStats --section InstructionStats --section SchedulerStats --section LaunchStats --section Occupancy \
        python3 scripts/triton_paged_ncu.py ${TRITON_PAGED_NCU_ARGS:-};;
    sanitize) run sanitize python3 -m pytest -m gpu -q -ra -k sanitizer tests/test_cuda.py;;
    triton_cache)
      # The Triton kernel cache as $OUT/triton_cache.tar.xz.NN (TRITON_CACHE_PART_SIZE, default
      # 15 MiB parts; at most 8 files of 16 MiB come back from $OUT, 64 MiB in all). Copy them
      # into .gpubin/triton_cache/ on the dev box to carry them (see the top of this script).
      # TRITON_CACHE_SLIM=0 packs the IR text too; by default scripts/triton_cache_slim.py leaves
      # it out (a cache hit reads only each kernel's metadata and binary: about an eighth).
      rm -f "$OUT"/triton_cache.tar.xz.*
      tc_src=$TRITON_CACHE_DIR
      if [ "${TRITON_CACHE_SLIM:-1}" != 0 ]; then
        rm -rf "$WORK/triton_cache_slim"
        python3 scripts/triton_cache_slim.py "$TRITON_CACHE_DIR" "$WORK/triton_cache_slim" &&
          tc_src=$WORK/triton_cache_slim
      fi
      run triton_cache bash -c 'tar -cf - -C "$3" . | xz -T0 -6 | split -b "$2" -d - "$1/triton_cache.tar.xz."
        echo "$(ls "$3" | wc -l) entries, $(du -sh "$3" | cut -f1) raw:"; ls -la "$1"/triton_cache.tar.xz.*' \
        _ "$OUT" "${TRITON_CACHE_PART_SIZE:-15m}" "$tc_src";;
    diag) run diag python3 scripts/decode_diag.py time "$WORK/bench/decode_diag.json";;
    ncu) run ncu ncu --clock-control none -k regex:decode --csv \
           --metrics gpu__time_duration.sum,dram__bytes_read.sum,dram__bytes_write.sum,launch__grid_size,launch__occupancy_limit_registers,sm__warps_active.avg.pct_of_peak_sustained_active \
           python3 scripts/decode_diag.py ncu;;
    bench_fp8|bench_fp8_decode|bench_fp8_paged)
      # FP8 KV caches (issue #15): the standard decode grid with fp8 rows next to the bf16 ones (every
      # anchor that exists here: SDPA, copy, FlashInfer when importable -- carry .anchors, which the
      # top of this script sources; its fp8 decode is not in the bundle, JIT-builds once and is timed after every other decode
      # row), then the paged grid with fp8 rows and no anchors (the fp8 rows' reference is the same
      # backend's bf16 row). The caps keep bench_fp8 + fp8_accuracy inside one 10-minute call.
      [ $s = bench_fp8_paged ] || STAGE_TIMEOUT_bench_fp8_decode=${STAGE_TIMEOUT_bench_fp8_decode:-270} \
        run bench_fp8_decode python3 -m minipaged.cli bench --op decode --kv-cache-dtype fp8 --no-progress \
          ${BENCH_FP8_ARGS:-} --out "$WORK/bench/fp8_decode"
      [ $s = bench_fp8_decode ] || STAGE_TIMEOUT_bench_fp8_paged=${STAGE_TIMEOUT_bench_fp8_paged:-150} \
        run bench_fp8_paged python3 -m minipaged.cli bench --op paged --kv-cache-dtype fp8 --anchors none \
          --no-progress ${BENCH_FP8_ARGS:-} --out "$WORK/bench/fp8_paged";;
    fp8_accuracy)
      STAGE_TIMEOUT_fp8_accuracy=${STAGE_TIMEOUT_fp8_accuracy:-150} \
        run fp8_accuracy python3 bench/bench_fp8_accuracy.py ${FP8_ACCURACY_ARGS:-} --json "$WORK/bench/fp8_accuracy.json";;
    decode_selftest)
      # Paged decode, torch-free (scripts/decode_selftest.cu): the two-launch and the fused
      # (variant bit 0x400) split reduction and the register-ring tilings 13-16 against fp64,
      # fused vs two-launch bitwise, counter reset, graph replays; small under the three
      # sanitizers; then the standard decode grid for every tiling, both reductions. A binary
      # prebuilt on the dev box (same nvcc) may be carried in .gpubin/; DECODE_SELFTEST_REBUILD=1
      # rebuilds it here. The caps add up to one 10-minute call with the build.
      # DECODE_SELFTEST_NAME runs another prebuilt binary under $bin (e.g. decode_selftest_et,
      # built with -DMINIPAGED_DECODE_EARLY_TRIGGER=0) through the same steps.
      sbin="$bin/${DECODE_SELFTEST_NAME:-decode_selftest}"
      [ -n "${DECODE_SELFTEST_REBUILD:-}" ] && rm -f "$bin/decode_selftest" "$bin/decode_selftest.xz"
      decode_selftest_bin decode_selftest_build decode_selftest -Xptxas -v
      export OMP_NUM_THREADS=16
      # DECODE_SELFTEST_STEPS: any of check sanitize time roofline paged_read (default the first
      # three); roofline times the plainest read of each grid row's bytes in the same harness,
      # paged_read the large-batch rows' paged K/V read per KV head, 2, 4 or 8 heads at a time,
      # balanced and contiguous, with no math.
      steps=" ${DECODE_SELFTEST_STEPS:-check sanitize time} "
      [[ $steps == *" check "* ]] && STAGE_TIMEOUT_decode_selftest_check=${STAGE_TIMEOUT_decode_selftest_check:-120} \
        run decode_selftest_check "$sbin" check
      export STAGE_TIMEOUT_decode_selftest_memcheck=${STAGE_TIMEOUT_decode_selftest_memcheck:-60}
      export STAGE_TIMEOUT_decode_selftest_racecheck=${STAGE_TIMEOUT_decode_selftest_racecheck:-180}
      export STAGE_TIMEOUT_decode_selftest_synccheck=${STAGE_TIMEOUT_decode_selftest_synccheck:-60}
      if [[ $steps == *" sanitize "* ]]; then
        # DECODE_SANITIZE_MODE=small_worklist: the work-list case alone (racecheck over the whole
        # of small takes more than its cap)
        for tool in memcheck racecheck synccheck; do
          run decode_selftest_$tool compute-sanitizer --tool $tool --error-exitcode 1 "$sbin" \
            ${DECODE_SANITIZE_MODE:-small}
        done
      fi
      [[ $steps == *" time "* ]] && STAGE_TIMEOUT_decode_selftest_time=${STAGE_TIMEOUT_decode_selftest_time:-110} \
        run decode_selftest_time "$sbin" time ${DECODE_SELFTEST_REPS:-100}
      [[ $steps == *" roofline "* ]] && STAGE_TIMEOUT_decode_selftest_roofline=${STAGE_TIMEOUT_decode_selftest_roofline:-150} \
        run decode_selftest_roofline "$sbin" roofline ${DECODE_SELFTEST_REPS:-100}
      [[ $steps == *" paged_read "* ]] && STAGE_TIMEOUT_decode_selftest_paged_read=${STAGE_TIMEOUT_decode_selftest_paged_read:-150} \
        run decode_selftest_paged_read "$sbin" paged_read ${DECODE_SELFTEST_REPS:-100};;
    decode_ab)
      # A/B of decode_selftest builds (names under $bin in DECODE_AB_BINS, e.g. one built with
      # -DMINIPAGED_DECODE_EARLY_TABLE=1): `check` of each, then `time` of each; DECODE_AB_ROUNDS
      # (e.g. "1 2") repeats the timing round, the builds alternating, so clock drift does not
      # favour one. The prebuilt binaries must be carried in .gpubin/.
      export OMP_NUM_THREADS=16
      for b in ${DECODE_AB_BINS:-decode_selftest}; do
        export STAGE_TIMEOUT_check_$b=${STAGE_TIMEOUT_decode_ab_check:-120}
        run check_$b "$bin/$b" check
      done
      for r in ${DECODE_AB_ROUNDS:-1}; do
        for b in ${DECODE_AB_BINS:-decode_selftest}; do
          export STAGE_TIMEOUT_time${r}_$b=${STAGE_TIMEOUT_decode_ab_time:-110}
          DECODE_TIME_TILINGS=${DECODE_AB_TILINGS:-} run time${r}_$b "$bin/$b" time ${DECODE_SELFTEST_REPS:-100}
        done
      done;;
    decode_bits_ab)
      # A/B of variant bits in one decode_selftest build (built here if not carried): `check` with
      # DECODE_AB_BITS (default 0x40000: the warp-merge rule flipped) ORed into every call, memcheck
      # of `small` with them, then `time` of variants 0, the bits and 0x800 (the split kernel alone) at each
      # head layout of DECODE_AB_HEADS (default "16,8,128 64,8,128"), uneven rows included.
      decode_selftest_bin decode_selftest_build decode_selftest
      export OMP_NUM_THREADS=16
      bits=${DECODE_AB_BITS:-0x40000}
      STAGE_TIMEOUT_bits_check=${STAGE_TIMEOUT_bits_check:-150} DECODE_CHECK_BITS=$bits \
        run bits_check "$bin/decode_selftest" check
      STAGE_TIMEOUT_bits_memcheck=${STAGE_TIMEOUT_bits_memcheck:-60} DECODE_CHECK_BITS=$bits \
        run bits_memcheck compute-sanitizer --tool memcheck --error-exitcode 1 "$bin/decode_selftest" small
      for h in ${DECODE_AB_HEADS:-16,8,128 64,8,128}; do
        export STAGE_TIMEOUT_bits_time_${h//,/_}=${STAGE_TIMEOUT_bits_time:-60}
        DECODE_TIME_HEADS=$h DECODE_TIME_VARIANTS=0,$((bits)),2048 DECODE_TIME_SKEW=1 \
          run bits_time_${h//,/_} "$bin/decode_selftest" time ${DECODE_SELFTEST_REPS:-100}
      done;;
    two_warp_ab)
      # The two-warp tensor-core decode (decode/launch.cu with_two_warp, tilings 20-22) and the row
      # merge (decode/mma.cuh MINIPAGED_DECODE_ROW_MERGE), for each selftest in TWO_WARP_BINS
      # (builds carried in .gpubin/, e.g. with another MINIPAGED_DECODE_TWO_WARP_MAX_TABLE_TOKENS;
      # default: decode_selftest, the shipped build, built here if not carried): memcheck of `small` and
      # `check` of TWO_WARP_CHECK_TILINGS for the binaries of TWO_WARP_CHECK_BINS (default: all),
      # both with TWO_WARP_CHECK_BITS ORed into every call
      # (DECODE_CHECK_BITS; default 0x20000, the rule flipped); then `time` of the standard grid plus
      # short rows (TWO_WARP_SHAPES) for each head layout in TWO_WARP_HEADS, caches of
      # TWO_WARP_KV bits (16, or 8: FP8), tilings TWO_WARP_TILINGS (16-bit) or variants
      # TWO_WARP_VARIANTS (when set: exactly those); every 16-bit row is also timed with the rule
      # flipped. TWO_WARP_SKEWS=0,2 times the short rows at equal and at random lengths.
      export OMP_NUM_THREADS=16
      tw_bins=${TWO_WARP_BINS:-decode_selftest}
      [ -n "${TWO_WARP_BINS:-}" ] || decode_selftest_bin two_warp_build decode_selftest
      for b in ${TWO_WARP_CHECK_BINS:-$tw_bins}; do
        export STAGE_TIMEOUT_memcheck_$b=${STAGE_TIMEOUT_two_warp_memcheck:-60}
        DECODE_CHECK_BITS=${TWO_WARP_CHECK_BITS:-0x20000} \
          run memcheck_$b compute-sanitizer --tool memcheck --error-exitcode 1 "$bin/$b" small
        export STAGE_TIMEOUT_check_$b=${STAGE_TIMEOUT_two_warp_check:-120}
        DECODE_CHECK_BITS=${TWO_WARP_CHECK_BITS:-0x20000} DECODE_CHECK_TILINGS=${TWO_WARP_CHECK_TILINGS:-0,10,22} \
          run check_$b "$bin/$b" check
      done
      for heads in ${TWO_WARP_HEADS:-16,8,128 32,8,128 64,8,128}; do
        for b in $tw_bins; do
          name=time_${b}_kv${TWO_WARP_KV:-16}_${heads//,/_}
          export STAGE_TIMEOUT_$name=${STAGE_TIMEOUT_two_warp_time:-60}
          DECODE_TIME_HEADS=$heads DECODE_TIME_KV=${TWO_WARP_KV:-16} DECODE_TIME_TILINGS=${TWO_WARP_TILINGS:-0,22} \
            DECODE_TIME_VARIANTS=${TWO_WARP_VARIANTS:-} \
            DECODE_TIME_EXTRA_SHAPES=${TWO_WARP_SHAPES:-64000192,128000256,64000512,256000192} \
            DECODE_TIME_EXTRA_SKEWS=${TWO_WARP_SKEWS:-0} \
            run $name "$bin/$b" time ${DECODE_SELFTEST_REPS:-100}
        done
      done;;
    decode_worklist)
      # Work-list decode (DecodeParams::worklist, decode/worklist.cuh) in the shipped selftest
      # build: memcheck of the uneven B=64 rows in `time` (work-list plans, every config checked
      # against the plan without it), then `time` of the grid with the uneven and wide-table rows
      # (DECODE_TIME_SKEW=1): each row whose gate allows a work list is timed without it first,
      # then with it (params.h kDecodeVariantWorklistToggle flips the default): the A/B is in one
      # binary. `check` (its work-list cases included) is the decode_selftest stage's.
      # DECODE_WORKLIST_VARIANTS=0,32768 times the fixed-runs bit (0x8000) next to the default plan;
      # 0,65536,0 the merge grouping flipped (0x10000), with the baseline repeated last (a row's first config
      # can read slow: decode_worklist_early_merge_32e566e).
      decode_selftest_bin decode_worklist_build decode_selftest
      export OMP_NUM_THREADS=16
      DECODE_TIME_SKEW=1 DECODE_TIME_SHAPES=64032768,64016384 DECODE_TIME_TILINGS=0 DECODE_TIME_VARIANTS=0 \
        STAGE_TIMEOUT_decode_worklist_memcheck=${STAGE_TIMEOUT_decode_worklist_memcheck:-150} \
        run decode_worklist_memcheck compute-sanitizer --tool memcheck --error-exitcode 1 "$bin/decode_selftest" time 2
      for r in ${DECODE_AB_ROUNDS:-1 2}; do
        # (a computed name cannot prefix a command as an assignment: export it)
        export STAGE_TIMEOUT_decode_worklist_time$r=${STAGE_TIMEOUT_decode_worklist_time:-110}
        DECODE_TIME_SKEW=1 DECODE_TIME_TILINGS=${DECODE_AB_TILINGS:-0} \
          DECODE_TIME_VARIANTS=${DECODE_WORKLIST_VARIANTS:-0} \
          run decode_worklist_time$r "$bin/decode_selftest" time ${DECODE_SELFTEST_REPS:-100}
      done
      # the rounds as one table (medians, ratios to each row's plan without the work list)
      logs=(); for r in ${DECODE_AB_ROUNDS:-1 2}; do logs+=("$WORK/logs/decode_worklist_time$r.log"); done
      run decode_worklist_table python3 scripts/decode_time_table.py "${logs[@]}";;
    decode_worklist_bench)
      # The decode grid (bf16 and fp8 rows) of the cuda backend and FlashInfer's decode, twice in
      # one call: a build with the work list off by default (-DMINIPAGED_DECODE_WORKLIST_DEFAULT=0
      # through MINIPAGED_NVCC_FLAGS: its own cached build, ~140 s cold), then the default build
      # (on), so the grid's uneven rows are compared with and without it against the same
      # anchor. Carry .anchors (FlashInfer).
      # (FlashInfer's fp8 decode JIT-builds, so it is
      # left out unless DECODE_WORKLIST_BENCH_ANCHORS names it)
      for wl in 0 1; do
        export STAGE_TIMEOUT_decode_worklist_bench$wl=${STAGE_TIMEOUT_decode_worklist_bench:-240}
        flags=${MINIPAGED_NVCC_FLAGS:-}
        [ $wl = 0 ] && flags="$flags -DMINIPAGED_DECODE_WORKLIST_DEFAULT=0"
        # (each build first, under its own cap: a cold one inside the bench's cut the bench short)
        export STAGE_TIMEOUT_decode_worklist_build$wl=${STAGE_TIMEOUT_decode_worklist_build:-300}
        MINIPAGED_NVCC_FLAGS="$flags" run decode_worklist_build$wl python3 -c "from minipaged.cuda import build; build.load()"
        MINIPAGED_NVCC_FLAGS="$flags" run decode_worklist_bench$wl python3 -m minipaged.cli bench --op decode \
          --backends cuda --anchors ${DECODE_WORKLIST_BENCH_ANCHORS:-flashinfer-decode} --kv-cache-dtype fp8 \
          --no-progress --no-plots --out "$WORK/bench/decode_worklist_default$wl"
      done;;
    decode_trace)
      # decode_selftest built with -DMINIPAGED_DECODE_TRACE=1 (decode/trace.cuh): `time` prints, per
      # row, one traced replay's timeline over CTAs (entry, first / last K/V tile, loop end, exit, the
      # merge) and how many CTAs each SM ran. DECODE_TRACE_VARIANTS: the exact variants (default 0);
      # DECODE_TIME_SHAPES / DECODE_TIME_KV narrow the grid. Prebuilt as .gpubin/decode_selftest_trace
      # (nvcc $selftest_flags -DMINIPAGED_DECODE_TRACE=1 -DMINIPAGED_DECODE_BENCH_TILINGS=0), else built here.
      decode_selftest_bin decode_trace_build decode_selftest_trace -DMINIPAGED_DECODE_TRACE=1 \
        -DMINIPAGED_DECODE_BENCH_TILINGS=0
      export OMP_NUM_THREADS=16
      DECODE_TIME_VARIANTS=${DECODE_TRACE_VARIANTS:-0} STAGE_TIMEOUT_decode_trace=${STAGE_TIMEOUT_decode_trace:-120} \
        run decode_trace "$bin/decode_selftest_trace" time ${DECODE_SELFTEST_REPS:-50};;
    decode_ncu)
      # Nsight Compute, full set, of one split-kernel launch per decode_selftest row: DECODE_NCU_ROWS
      # is a list of KV:SHAPE[:VARIANT] (KV 16 or 8 (fp8), SHAPE B*1000000+L as DECODE_TIME_SHAPES,
      # VARIANT the exact variant, default 0), e.g. "16:1032768 8:1032768". The second launch is
      # profiled (the first is the selftest's eager check). The prebuilt binary comes in .gpubin/.
      for row in ${DECODE_NCU_ROWS:-16:1032768 8:1032768}; do
        IFS=: read -r kv shape variant <<< "$row"
        export STAGE_TIMEOUT_decode_ncu_${kv}_${shape}=${STAGE_TIMEOUT_decode_ncu:-120}
        DECODE_TIME_KV=$kv DECODE_TIME_SHAPES=$shape DECODE_TIME_VARIANTS=${variant:-0} \
          run decode_ncu_${kv}_${shape} ncu --clock-control none --set full -k regex:paged_decode \
          --launch-skip 1 --launch-count 1 "$bin/decode_selftest" time 50
      done;;
    *) echo "unknown stage $s"; status=1;;
  esac
done
tar -czf "$OUT/results.tgz" -C "$WORK" logs bench 2>/dev/null
exit $status
