"""scripts/gpu_bundle.sh, the CPU-side preparation of a device call, in a scratch repository (the
selftest build itself is test_cuda_build.py's: a carried decode_selftest.xz is kept, not rebuilt)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "gpu_bundle.sh"


def _git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", *args], cwd=repo, check=True, capture_output=True, text=True).stdout.strip()


@pytest.mark.skipif(shutil.which("git") is None, reason="needs git")
def test_gpu_bundle_marks_and_keeps(tmp_path):
    repo = tmp_path / "repo"
    (repo / "scripts").mkdir(parents=True)
    shutil.copy(SCRIPT, repo / "scripts" / "gpu_bundle.sh")
    _git(repo, "init", "-q")
    _git(repo, "-c", "user.name=t", "-c", "user.email=t@t", "add", "scripts")
    _git(repo, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", "seed")
    (repo / ".gpubin").mkdir()
    carried = b"\xfd7zXZ not rebuilt"
    (repo / ".gpubin" / "decode_selftest.xz").write_bytes(carried)
    for _ in range(2):  # a second run adds nothing twice
        run = subprocess.run(["bash", "scripts/gpu_bundle.sh"], cwd=repo, capture_output=True, text=True)
        assert run.returncode == 0, run.stderr
    exclude = (repo / ".git" / "info" / "exclude").read_text().splitlines()
    assert exclude.count(".gpubin/") == 1 and exclude.count(".anchors/") == 1
    assert (repo / ".gpubin" / "head.sha").read_text().strip() == _git(repo, "rev-parse", "--short", "HEAD")
    assert (repo / ".gpubin" / "decode_selftest.xz").read_bytes() == carried
    assert _git(repo, "status", "--porcelain") == ""  # everything it wrote is ignored
    assert "working tree differs" not in run.stderr
    (repo / "scripts" / "gpu_bundle.sh").write_text((repo / "scripts" / "gpu_bundle.sh").read_text() + "\n")
    run = subprocess.run(["bash", "scripts/gpu_bundle.sh"], cwd=repo, capture_output=True, text=True)
    assert run.returncode == 0 and "working tree differs from HEAD" in run.stderr
