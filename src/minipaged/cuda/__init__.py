"""The hand-written CUDA backends `cuda` and `cuda-wmma`.

Nothing is compiled on import: the kernels (csrc/*.cu plus the one binding,
csrc/binding.cpp) are JIT-built by `minipaged.cuda.build` on first use, once
per GPU arch and source hash, and cached on disk. The backends themselves are
registered in `minipaged.registry`, which points at `minipaged.cuda.ops`.
"""

from __future__ import annotations

from pathlib import Path

CSRC_DIR = Path(__file__).resolve().parent / "csrc"


def load() -> str:
    """Build (once, cached) and load the kernels; returns the shared library's path."""
    from . import ops

    ops.ensure_loaded()
    from . import build

    return build.load()


__all__ = ["CSRC_DIR", "load"]
