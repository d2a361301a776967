#!/usr/bin/env bash
# Does the cold-L2 flush itself cost the timed kernel? Decode grid twice in one
# call: L2 emptied by a write (dirty lines left behind) and by a read (clean lines).
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD/src"
W=/tmp/l2exp; mkdir -p $W
python3 -c "from minipaged.cuda import build; build.load()" > $W/build.log 2>&1
for mode in write read; do
  MINIPAGED_BENCH_L2_FLUSH=$mode timeout 120 python3 -m minipaged.cli bench --op decode --backends triton,cuda --no-crosscheck \
    --no-plots --no-progress --out $W/decode_$mode > $W/decode_$mode.log 2>&1
  echo "== flush=$mode rc=$?"
  grep -E "^B=|copy bandwidth" $W/decode_$mode.log | grep -vE "torch |cuda-wmma"
done
tar -czf $OUT/l2exp.tgz -C $W .
