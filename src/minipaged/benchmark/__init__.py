"""Benchmarks: one timing harness (timing.py), the grids (cases.py; case classes and
inputs are minipaged.testing's), FLOP/byte counts (flops.py), PyTorch anchors
(anchors.py), the `minipaged bench` runner and what it writes (outputs.py: JSON,
report.py's markdown, plots.py's figures)."""

from .flops import decode_bytes, decode_flops, prefill_flops, visible_pairs
from .timing import Timing, environment, time_fn

__all__ = ["Timing", "decode_bytes", "decode_flops", "environment", "prefill_flops",
           "time_fn", "visible_pairs"]
