#!/usr/bin/env bash
# GPU check of the cuda paged attention / return_lse work, for one device run:
#   scripts/paged_gpu_check.sh OUTDIR [pytest -k expression] [stages]
# stages (comma list, default all): selftest,sanitize,pytest,bench
# Builds the torch-free self test (sm_90a) and the torch extension in parallel,
# then runs each stage under its own timeout; logs go to OUTDIR.
set -u
out=${1:?outdir}; kexpr=${2:-"paged or lse or cpp_errors"}; stages=${3:-selftest,sanitize,pytest,bench}
mkdir -p "$out"
export PYTHONPATH=src MAX_JOBS=16
csrc=src/minipaged/cuda/csrc
has() { [[ ",$stages," == *",$1,"* ]]; }
( nvcc -std=c++17 -O3 -lineinfo -gencode=arch=compute_90a,code=sm_90a -Xcompiler -fopenmp -DMINIPAGED_ENABLE_SM90A \
    -I $csrc scripts/paged_selftest.cu $csrc/prefill/paged*.cu $csrc/decode/launch.cu $csrc/decode/kernels_*.cu \
    -o /tmp/paged_selftest -lgomp > "$out/selftest_build.log" 2>&1
  echo "rc=$?" >> "$out/selftest_build.log" ) &
( timeout 200 python -c "from minipaged.cuda import ops, build; print(build.load())" > "$out/ext_build.log" 2>&1
  echo "rc=$?" >> "$out/ext_build.log" ) &
wait
tail -2 "$out/selftest_build.log" "$out/ext_build.log"
if has sanitize && [ -x /tmp/paged_selftest ]; then
  timeout 60 compute-sanitizer --tool memcheck /tmp/paged_selftest small > "$out/sanitize.log" 2>&1
  echo "rc=$?" >> "$out/sanitize.log"; tail -3 "$out/sanitize.log"
fi
if has selftest && [ -x /tmp/paged_selftest ]; then
  OMP_NUM_THREADS=16 timeout 80 /tmp/paged_selftest check > "$out/selftest.log" 2>&1
  echo "rc=$?" >> "$out/selftest.log"; grep -c PASS "$out/selftest.log"; grep FAIL "$out/selftest.log" | head -20; tail -2 "$out/selftest.log"
fi
if has pytest; then
  timeout ${PYTEST_TIMEOUT:-200} python -m pytest -m gpu -q tests/test_cuda.py -x -k "$kexpr" > "$out/pytest.log" 2>&1
  echo "rc=$?" >> "$out/pytest.log"; tail -15 "$out/pytest.log"
fi
if has bench; then
  timeout 45 python scripts/paged_bench.py > "$out/bench.log" 2>&1; echo "rc=$?" >> "$out/bench.log"; cat "$out/bench.log"
fi
