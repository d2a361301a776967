#!/usr/bin/env bash
# One call on the GPU machine: build the CUDA extension once, run the GPU tests,
# run the benchmarks, and leave logs + JSON under $OUT (bundled into one tarball,
# since only a few files come back).
#   scripts/gpu_check.sh [build] [tests] [bench] [e2e] [sanitize]   (default: all)
# Each stage has a wall-clock cap (STAGE_TIMEOUT_<stage>, seconds) and is stopped
# with SIGINT, so pytest still prints its summary and bench keeps its JSON.
# The device copy has no .git: pass MINIPAGED_GIT_COMMIT=<sha> for the records.
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
OUT=${OUT:-/tmp/minipaged_out}
mkdir -p "$OUT/logs" "$OUT/bench"
stages=${*:-build tests bench e2e}
status=0
run() {  # run NAME CMD...: log to $OUT/logs/NAME.log, remember failures
  local name=$1; shift
  local t0=$SECONDS
  local cap_var="STAGE_TIMEOUT_$name"
  local cap=${!cap_var:-600}
  echo "=== $name (cap ${cap}s): $*"
  timeout -s INT -k 15 "$cap" "$@" > "$OUT/logs/$name.log" 2>&1
  local rc=$?
  echo "=== $name: rc=$rc in $((SECONDS - t0)) s"
  tail -n 25 "$OUT/logs/$name.log"
  [ $rc -eq 0 ] || status=1
}

nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv > "$OUT/logs/gpu.txt" 2>&1
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())" | tee -a "$OUT/logs/gpu.txt"

for s in $stages; do
  case $s in
    build) run build python3 -c "import time; t=time.time(); from minipaged.cuda import build; build.load(); print(f'build {time.time()-t:.1f} s')";;
    tests) run tests env HYPOTHESIS_PROFILE=${HYPOTHESIS_PROFILE:-gpu} python3 -m pytest -m gpu -q -ra -s --durations=20 -p no:cacheprovider ${GPU_TESTS:-tests/};;
    bench) run bench python3 -m minipaged.cli bench --out "$OUT/bench";;
    e2e) run e2e python3 bench/bench_e2e.py ${E2E_ARGS:-} --out "$OUT/bench";;
    sanitize) run sanitize python3 -m pytest -m gpu -q -ra -k sanitizer tests/test_cuda.py;;
    *) echo "unknown stage $s"; status=1;;
  esac
done
tar -czf "$OUT/results.tgz" -C "$OUT" logs bench 2>/dev/null
exit $status
