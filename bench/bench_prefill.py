#!/usr/bin/env python3
"""Benchmark minipaged's prefill: every available backend against PyTorch's
attention anchors, same grid, harness and outputs as `minipaged bench --op prefill`.

    python bench/bench_prefill.py [--backends torch,triton,cuda] [--dtype bfloat16] [--out DIR] [--quick]
"""

import sys
from pathlib import Path

try:
    import minipaged  # noqa: F401
except ImportError:  # run from a checkout without installing
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from minipaged.benchmark.cli import main

if __name__ == "__main__":
    sys.exit(main(op="prefill", prog="bench_prefill.py"))
