"""scripts/gpu_bundle.sh, the CPU-side preparation of a device call, in a scratch repository (the
selftest build itself is test_cuda_build.py's: a carried decode_selftest.xz is kept, not rebuilt)."""

from __future__ import annotations

import shutil
import subprocess
import sys
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


SLIM = SCRIPT.parent / "triton_cache_slim.py"
_COMPILE = '''
import sys
import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource


@triton.jit
def twice(X, Y, N, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(Y + i, tl.load(X + i, mask=i < N) * 2, mask=i < N)


src = ASTSource(twice, signature={"X": "*fp32", "Y": "*fp32", "N": "i32", "BLOCK": "constexpr"},
                constexprs={"BLOCK": 128})
try:
    kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32))
except Exception as err:  # no NVIDIA backend or ptxas in this triton
    print("NO-COMPILE", type(err).__name__, err)
    sys.exit(0)
print("ASM", " ".join(sorted(kernel.asm.keys())))
'''


def _compile(cache: Path, tmp_path: Path) -> str:
    import os

    script = tmp_path / "compile_twice.py"
    script.write_text(_COMPILE)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # compile, not interpret
    run = subprocess.run([sys.executable, str(script)], env=dict(env, TRITON_CACHE_DIR=str(cache)),
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    return run.stdout


def test_triton_cache_slim_keeps_a_cache_hit(tmp_path):
    """A Triton compile for sm_90 (no GPU needed) fills a cache; its slim copy, put back at the
    same path, still serves the same compile from the cache: the kernel comes back with only its
    binary in `.asm`, where a fresh compile has every stage."""
    cache = tmp_path / "cache"
    first = _compile(cache, tmp_path)
    if "NO-COMPILE" in first:
        pytest.skip(f"triton here cannot compile for sm_90: {first.strip()}")
    assert "ptx" in first.split() and "cubin" in first.split()
    slim = tmp_path / "slim"
    run = subprocess.run([sys.executable, str(SLIM), str(cache), str(slim)], capture_output=True, text=True)
    assert run.returncode == 0 and "kept" in run.stdout, run.stdout + run.stderr
    assert not list(slim.rglob("*.ptx")) and not list(slim.rglob("*.llir")) and list(slim.rglob("*.cubin"))
    shutil.rmtree(cache)
    slim.rename(cache)
    assert _compile(cache, tmp_path).split() == ["ASM", "cubin"]  # a hit: nothing was compiled again
    # without the group rewrite the hit is lost (Triton wants every listed file), and it compiles
    for grp in cache.glob("*/__grp__*.json"):
        missing = '"child_paths": {"twice.ptx": "/nowhere/twice.ptx", '
        grp.write_text(grp.read_text().replace('"child_paths": {', missing, 1))
    assert "ptx" in _compile(cache, tmp_path).split()


def test_triton_cache_slim_leaves_other_files_alone(tmp_path):
    """Files outside a group (launcher .so files, an entry cut short) and a corrupt group are
    copied as they are; only IR that a group lists goes."""
    import json

    src = tmp_path / "src"
    (src / "A").mkdir(parents=True)
    (src / "B").mkdir()
    (src / "C").mkdir()
    for name in ("k.json", "k.cubin", "k.ptx", "k.ttgir", "k.source"):
        (src / "A" / name).write_text(name)
    paths = {n: f"/tmp/cache/A/{n}" for n in ("k.json", "k.cubin", "k.ptx", "k.ttgir", "k.source")}
    (src / "A" / "__grp__k.json").write_text(json.dumps({"child_paths": paths}))
    (src / "B" / "cuda_utils.so").write_bytes(b"\x7fELF")
    (src / "B" / "orphan.ptx").write_text("no group lists me")
    (src / "C" / "__grp__bad.json").write_text("{not json")
    (src / "C" / "bad.ptx").write_text("kept with its corrupt group")
    run = subprocess.run([sys.executable, str(SLIM), str(src), str(tmp_path / "dst")], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    dst = tmp_path / "dst"
    assert sorted(p.name for p in (dst / "A").iterdir()) == ["__grp__k.json", "k.cubin", "k.json"]
    assert json.loads((dst / "A" / "__grp__k.json").read_text())["child_paths"] == {
        "k.json": "/tmp/cache/A/k.json", "k.cubin": "/tmp/cache/A/k.cubin"}
    for rel in ("B/cuda_utils.so", "B/orphan.ptx", "C/__grp__bad.json", "C/bad.ptx"):
        assert (dst / rel).read_bytes() == (src / rel).read_bytes()
    again = subprocess.run([sys.executable, str(SLIM), str(src), str(dst)], capture_output=True, text=True)
    assert again.returncode == 2 and "exists" in again.stderr
