"""Benchmarks: one timing harness (timing.py), the grids (cases.py), FLOP/byte
counts (flops.py), PyTorch anchors (anchors.py) and the `minipaged bench` runner."""

from .flops import decode_bytes, decode_flops, prefill_flops, visible_pairs
from .timing import Timing, environment, time_fn

__all__ = ["Timing", "decode_bytes", "decode_flops", "environment", "prefill_flops",
           "time_fn", "visible_pairs"]
