#!/usr/bin/env bash
# One GPU call: build, the CUDA decode GPU tests, the decode sweep, ncu per-kernel times.
set -uo pipefail
export PYTHONPATH="$PWD/src" PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/diag}; mkdir -p "$OUT"
t0=$SECONDS
python3 -c "from minipaged.cuda import build; build.load()" > "$OUT/build.log" 2>&1; echo "build rc=$? $((SECONDS-t0))s"
timeout ${T_TESTS:-150} python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_cuda.py \
  -k "test_decode or graph or compile or public_api ${EXTRA_K:-}" > "$OUT/tests.log" 2>&1
echo "tests rc=$? $((SECONDS-t0))s"; tail -3 "$OUT/tests.log"
timeout ${T_TIME:-240} python3 scripts/decode_diag.py time "$OUT/diag.json" > "$OUT/diag.log" 2>&1
echo "time rc=$? $((SECONDS-t0))s"
if [ "${NCU:-1}" = 1 ]; then
timeout ${T_NCU:-120} ncu --clock-control none -k regex:decode --csv \
  --metrics gpu__time_duration.sum,dram__bytes_read.sum,dram__bytes_write.sum,launch__grid_size,launch__occupancy_limit_registers,sm__warps_active.avg.pct_of_peak_sustained_active \
  python3 scripts/decode_diag.py ncu > "$OUT/ncu.csv" 2> "$OUT/ncu.err"
echo "ncu rc=$? $((SECONDS-t0))s"
fi
