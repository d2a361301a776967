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


GPU_CHECK = SCRIPT.parent / "gpu_check.sh"


@pytest.mark.skipif(shutil.which("xz") is None or shutil.which("split") is None, reason="needs xz and split")
def test_triton_cache_round_trip(tmp_path):
    """gpu_check.sh's triton_cache stage packs the cache into parts under $OUT; carried in
    $WS_BIN/triton_cache/, they unpack into an empty cache of the next call; a damaged part
    leaves the cache empty (compiling from scratch), not half unpacked."""
    import os
    import random

    cache = tmp_path / "cache"
    for i in range(3):
        (cache / f"entry{i}").mkdir(parents=True)
        (cache / f"entry{i}" / "k.json").write_text(f'{{"name": "k{i}"}}')
    # incompressible, so the archive takes two parts of 64 KiB
    (cache / "entry0" / "k.cubin").write_bytes(random.Random(0).randbytes(100 << 10))
    repo = SCRIPT.parents[1]

    def stage(name, cache_dir, out, work, ws_bin):
        env = dict(os.environ, TRITON_CACHE_DIR=str(cache_dir), OUT=str(out), WORK=str(work), WS_BIN=str(ws_bin),
                   FLASHINFER="0", TRITON_CACHE_PART_SIZE="64k")
        return subprocess.run(["bash", str(GPU_CHECK), name], cwd=repo, env=env, capture_output=True, text=True)

    run = stage("triton_cache", cache, tmp_path / "out1", tmp_path / "work1", tmp_path / "nobin")
    assert run.returncode == 0, run.stdout + run.stderr
    parts = sorted((tmp_path / "out1").glob("triton_cache.tar.xz.*"))
    assert len(parts) == 2 and all(p.stat().st_size <= 64 << 10 for p in parts)
    carried = tmp_path / "bin" / "triton_cache"
    carried.mkdir(parents=True)
    for p in parts:
        shutil.copy(p, carried / p.name)
    fresh = tmp_path / "fresh"
    stage("triton_cache", fresh, tmp_path / "out2", tmp_path / "work2", tmp_path / "bin")
    assert "3 entries unpacked from 2 carried part(s)" in (tmp_path / "work2" / "logs" / "gpu.txt").read_text()
    for f in cache.rglob("*"):
        if f.is_file():
            assert (fresh / f.relative_to(cache)).read_bytes() == f.read_bytes()
    # a damaged part
    (carried / parts[0].name).write_bytes(b"not xz")
    broken = tmp_path / "broken"
    stage("triton_cache", broken, tmp_path / "out3", tmp_path / "work3", tmp_path / "bin")
    assert "did not unpack" in (tmp_path / "work3" / "logs" / "gpu.txt").read_text()
    assert not any(broken.iterdir())


def test_tests_par_leaves_out_what_passed(tmp_path):
    """GPU_TESTS_PASSED: the ids of every listed file (here an id list and a gzipped one) and of
    MINIPAGED_TEST_EXCLUDE's file go, once each, into the exclude list the shards read."""
    import gzip
    import os

    a, b, c = (f"tests/test_x.py::test_{n}" for n in "abc")
    (tmp_path / "one.txt").write_text(f"{a}\n{b}\n")
    (tmp_path / "two.txt.gz").write_bytes(gzip.compress(f"{b}\n".encode()))
    (tmp_path / "earlier.txt").write_text(f"{c}\n")
    work = tmp_path / "work"
    env = dict(os.environ, OUT=str(tmp_path / "out"), WORK=str(work), FLASHINFER="0", TESTS_PAR_BUILD="0",
               TEST_SHARDS="1", GPU_TESTS=str(tmp_path / "none"), STAGE_TIMEOUT_tests="60",
               GPU_TESTS_PASSED=f"{tmp_path}/one.txt {tmp_path}/two.txt.gz",
               MINIPAGED_TEST_EXCLUDE=str(tmp_path / "earlier.txt"), TRITON_CACHE_DIR=str(tmp_path / "tc"))
    run = subprocess.run(["bash", str(GPU_CHECK), "tests_par"], cwd=SCRIPT.parents[1], env=env,
                         capture_output=True, text=True)
    assert "leaving out 3 tests passed earlier" in run.stdout, run.stdout + run.stderr
    assert (work / "logs" / "tests_excluded.txt").read_text().split() == [a, b, c]
