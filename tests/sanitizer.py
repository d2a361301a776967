"""compute-sanitizer around a Python script, for the GPU tests of every backend."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

SRC = Path(__file__).resolve().parents[1] / "src"


def run_under_sanitizer(tool, script, text, *script_args):
    """Run `text` as a Python script under compute-sanitizer `tool`; it must finish and be clean."""
    sanitizer = shutil.which("compute-sanitizer")
    if sanitizer is None:
        for home in (os.environ.get("CUDA_HOME"), "/usr/local/cuda"):
            cand = home and os.path.join(home, "bin", "compute-sanitizer")
            if cand and os.path.exists(cand):
                sanitizer = cand
    if sanitizer is None:
        pytest.skip("compute-sanitizer not found")
    script.write_text(text)
    env = dict(os.environ, PYTHONPATH=str(SRC) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    cmd = [sanitizer, "--tool", tool, sys.executable, str(script), *script_args]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    log = proc.stdout + proc.stderr
    if "sanitize script done" not in log and ("CUDA error: out of memory" in log or "CUDA out of memory" in log):
        # (as torch's own error, so a sharded run tries it once more: tests/conftest.py)
        raise torch.OutOfMemoryError(f"the script under compute-sanitizer ran out of GPU memory:\n{log[-2000:]}")
    assert "sanitize script done" in log, log[-4000:]
    # memcheck / synccheck end with "ERROR SUMMARY: 0 errors", racecheck with
    # "RACECHECK SUMMARY: 0 hazards displayed (0 errors, 0 warnings)"
    clean = "ERROR SUMMARY: 0 errors" in log or "0 hazards displayed (0 errors, 0 warnings)" in log
    assert clean and proc.returncode == 0, log[-4000:]
