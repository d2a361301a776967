"""Where a kernel's warps wait, by region of its SASS: ncu's warp-state samples per instruction
(`ncu --import R.ncu-rep --page source --print-source sass --csv`, the gpu_check `spec_ncu`
stage) summed over the prologue, the main loop and the epilogue of each profiled kernel.

    python scripts/ncu_sass_regions.py spec_ncu_sass.csv [--top 12] [--loop-min 40000]

The loop is the address range of the instructions executed at least --loop-min times (warp
level); what lies before it is the prologue, what lies after it the epilogue. ncu repeats a
kernel's table once per profiled result; repeated tables are shown once.
"""

from __future__ import annotations

import argparse
import collections
import csv

SAMPLES = "Warp Stall Sampling (All Samples)"
EXECUTED = "Instructions Executed"


def _kernels(path: str) -> list[dict]:
    kernels, cur = [], None
    with open(path, newline="") as f:
        for row in csv.reader(f):
            if not row:
                continue
            if row[0] == "Kernel Name":
                cur = {"name": row[1], "rows": []}
                kernels.append(cur)
            elif row[0] == "Address":
                cur["col"] = {name: i for i, name in enumerate(row)}
            else:
                cur["rows"].append(row)
    seen, unique = set(), []
    for k in kernels:
        key = (k["name"], tuple(r[0] for r in k["rows"][:4]), len(k["rows"]))
        if key not in seen:
            seen.add(key)
            unique.append(k)
    return unique


def _int(row: list[str], col: int) -> int:
    return int(row[col] or 0)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("csv")
    ap.add_argument("--top", type=int, default=12)
    ap.add_argument("--loop-min", type=int, default=40000)
    args = ap.parse_args()
    for k in _kernels(args.csv):
        col, rows = k["col"], k["rows"]
        stalls = [n for n in col if n.startswith("stall_") and "Not Issued" not in n]
        warps = max(_int(r, col[EXECUTED]) for r in rows[:8]) or 1  # the entry runs once per warp
        loop = [i for i, r in enumerate(rows) if _int(r, col[EXECUTED]) >= args.loop_min]
        lo, hi = (loop[0], loop[-1]) if loop else (len(rows), len(rows) - 1)
        regions = {"prologue": rows[:lo], "loop": rows[lo:hi + 1], "epilogue": rows[hi + 1:]}
        total = sum(_int(r, col[SAMPLES]) for r in rows)
        print(f"{k['name'][:160]}\n  {len(rows)} instructions, {warps} warps, {total} samples")
        for name, part in regions.items():
            samples = sum(_int(r, col[SAMPLES]) for r in part)
            executed = sum(_int(r, col[EXECUTED]) for r in part)
            reasons = collections.Counter()
            for r in part:
                for s in stalls:
                    reasons[s] += _int(r, col[s])
            top = ", ".join(f"{s[6:]} {n}" for s, n in reasons.most_common(5))
            print(f"  {name:9s} {samples:6d} samples ({100 * samples / max(total, 1):4.1f}%), "
                  f"{executed / warps:7.0f} instructions per warp; {top}")
        print(f"  top {args.top} instructions by samples:")
        for i in sorted(range(len(rows)), key=lambda i: -_int(rows[i], col[SAMPLES]))[:args.top]:
            r = rows[i]
            main_reason = max(stalls, key=lambda s: _int(r, col[s]))[6:]
            print(f"    #{i:5d} {_int(r, col[SAMPLES]):6d} {main_reason:15s} {r[col['Source']].strip()[:70]}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
