#!/usr/bin/env python3
"""Benchmark minipaged's paged attention (chunked prefill over a cached prefix,
speculative verification, a mixed chunk + decodes batch): every available backend
against its own dense varlen / decode kernels, SDPA and FlashInfer (when importable),
same grid, harness and outputs as `minipaged bench --op paged`.

    python bench/bench_paged.py [--backends triton,cuda] [--dtype bfloat16] [--out DIR] [--quick]
"""

import sys
from pathlib import Path

try:
    import minipaged  # noqa: F401
except ImportError:  # run from a checkout without installing
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from minipaged.benchmark.cli import main

if __name__ == "__main__":
    sys.exit(main(op="paged", prog="bench_paged.py"))
