"""Lazy, cached JIT build of the CUDA kernels (torch.utils.cpp_extension.load).

The extension is built once per (torch version, CUDA and nvcc versions, GPU arch, csrc
content, extra flags) into its own folder under the cache root, under a file
lock so that parallel processes (pytest-xdist, several ranks) build it once and
the others wait and load the result. Later processes skip cpp_extension
entirely and load the cached library directly.

Environment:
    MINIPAGED_CACHE_DIR      cache root (default: $XDG_CACHE_HOME/minipaged or ~/.cache/minipaged)
    MINIPAGED_CUDA_ARCH      build for this arch instead of the device's, e.g. "90a" (default:
                             the device's, and "90a" on sm_90: the wgmma kernels need it)
    MINIPAGED_NVCC_FLAGS     extra nvcc flags (shell syntax), appended last
    MINIPAGED_BUILD_VERBOSE  1: show the compiler output
    MAX_JOBS                 parallel compile jobs (default: all cores)
"""

from __future__ import annotations

import hashlib
import os
import shlex
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

CSRC = Path(__file__).resolve().parent / "csrc"
LIB_NAMESPACE = "minipaged_cuda"
_lock = threading.Lock()
_loaded: dict[str, str] = {}  # arch -> path of the loaded library
last_build_seconds: float | None = None  # wall time of this process's build, if it built


def _source_files() -> list[Path]:
    """Every kernel, header and binding source under csrc (its subfolders included), sorted."""
    return sorted(p for p in CSRC.rglob("*") if p.suffix in (".cu", ".cuh", ".h", ".cpp"))


def cuda_sources() -> list[str]:
    """The translation units (.cu) under csrc, as paths relative to it ("decode/launch.cu", ...)."""
    return [p.relative_to(CSRC).as_posix() for p in _source_files() if p.suffix == ".cu"]


def device_arch(device: int | None = None) -> str:
    """"90a" for an H100/H200: the arch the kernels are built for (MINIPAGED_CUDA_ARCH wins)."""
    env = os.environ.get("MINIPAGED_CUDA_ARCH", "").strip()
    if env:
        return env.replace("sm_", "").replace(".", "")
    import torch

    major, minor = torch.cuda.get_device_capability(device)
    arch = f"{major}{minor}"
    if arch == "90":
        # wgmma / setmaxnreg exist only in the arch-specific sm_90a target; the
        # library is built for this very device, so nothing portable is lost.
        arch = "90a"
    return arch


def nvcc_flags(arch: str) -> list[str]:
    """nvcc flags for `arch` ("90", "90a", "80"...). No -std: torch picks the one its headers need."""
    num = arch.rstrip("a")
    flags = [
        "-O3",
        "-lineinfo",
        f"-gencode=arch=compute_{arch},code=sm_{arch}",
        # torch adds -D__CUDA_NO_HALF_OPERATORS__ & co. for its own headers;
        # these sources include none of them and want the plain cuda_fp16 API.
        "-U__CUDA_NO_HALF_OPERATORS__",
        "-U__CUDA_NO_HALF_CONVERSIONS__",
        "-U__CUDA_NO_BFLOAT16_CONVERSIONS__",
        "-U__CUDA_NO_HALF2_OPERATORS__",
        "--expt-relaxed-constexpr",
        f"-DMINIPAGED_SM={num}",
    ]
    if arch == "90a":
        # The wgmma prefill kernels hold real code only in an sm_90a build; the
        # macro lets the dispatcher know that at compile time (sm90a_flags()).
        flags += sm90a_flags()
    flags += shlex.split(os.environ.get("MINIPAGED_NVCC_FLAGS", ""))
    return flags


def sm90a_flags() -> list[str]:
    """Defines for an sm_90a build: the prefill dispatcher may pick the wgmma kernels."""
    return ["-DMINIPAGED_ENABLE_SM90A"]


def _cache_root() -> Path:
    env = os.environ.get("MINIPAGED_CACHE_DIR")
    if env:
        return Path(env).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg).expanduser() if xdg else Path.home() / ".cache") / "minipaged"


def _build_nvcc() -> list[str] | None:
    """The nvcc command cpp_extension compiles with: PYTORCH_NVCC, else $CUDA_HOME/bin/nvcc as torch found it."""
    if os.environ.get("PYTORCH_NVCC"):
        return shlex.split(os.environ["PYTORCH_NVCC"])
    from torch.utils import cpp_extension

    if cpp_extension.CUDA_HOME is None:
        return None
    return [os.path.join(cpp_extension.CUDA_HOME, "bin", "nvcc")]


def _nvcc_version() -> str:
    """`nvcc --version` of the build's nvcc ("" without one): a toolkit update must not reuse an old build."""
    cmd = _build_nvcc()
    if not cmd:
        return ""
    try:
        return subprocess.run([*cmd, "--version"], capture_output=True, text=True).stdout
    except OSError:
        return ""


def build_key(arch: str) -> str:
    """The cache key: everything that changes the built library."""
    import torch

    h = hashlib.sha256()
    for p in _source_files():
        h.update(p.relative_to(CSRC).as_posix().encode())
        h.update(p.read_bytes())
    h.update(repr(nvcc_flags(arch)).encode())
    h.update(torch.__version__.encode())
    h.update(str(torch.version.cuda).encode())
    h.update(_nvcc_version().encode())
    h.update(sys.version.split()[0].encode())
    return h.hexdigest()[:16]


def build_dir(arch: str | None = None) -> Path:
    import torch

    arch = arch or device_arch()
    tag = f"torch{torch.__version__}-cu{torch.version.cuda}-sm{arch}-{build_key(arch)}"
    return _cache_root() / tag.replace("+", "_")


def load(verbose: bool | None = None) -> str:
    """Build (once, cached) and load the kernels into torch.ops.minipaged_cuda; returns the library path."""
    global last_build_seconds
    import torch

    arch = device_arch()
    with _lock:
        if arch in _loaded:
            return _loaded[arch]
        if verbose is None:
            verbose = os.environ.get("MINIPAGED_BUILD_VERBOSE", "0") == "1"
        directory = build_dir(arch)
        name = f"{LIB_NAMESPACE}_{directory.name.rsplit('-', 1)[-1]}"
        lib_path = directory / f"{name}.so"
        done = directory / "BUILD_OK"
        if done.exists() and lib_path.exists():
            # BUILD_OK is written last, so the folder is complete: no lock, which a read-only
            # (shared, prebuilt) cache could not create.
            torch.ops.load_library(str(lib_path))
            _loaded[arch] = str(lib_path)
            return str(lib_path)
        nvcc = _build_nvcc()
        if nvcc is None or shutil.which(nvcc[0]) is None:
            from ..registry import BackendUnavailableError

            # cpp_extension runs $CUDA_HOME/bin/nvcc whatever is on PATH; without it the build
            # would fail deep inside ninja.
            raise BackendUnavailableError(
                f"nvcc not found at {nvcc[0] if nvcc else '$CUDA_HOME/bin/nvcc (CUDA_HOME unset)'}: set CUDA_HOME "
                "(or PYTORCH_NVCC) to build the CUDA kernels")
        directory.mkdir(parents=True, exist_ok=True)

        from filelock import FileLock

        with FileLock(str(directory / "build.lock")):
            if done.exists() and lib_path.exists():
                torch.ops.load_library(str(lib_path))
            else:
                from torch.utils import cpp_extension

                # Rebuilding (the library went missing): until it succeeds the folder is not complete.
                done.unlink(missing_ok=True)
                # cpp_extension's own baton, a plain file that a killed build leaves behind and that
                # the next build would wait on forever; every build here holds build.lock, so it is stale.
                (directory / "lock").unlink(missing_ok=True)
                os.environ.setdefault("MAX_JOBS", str(os.cpu_count() or 4))
                print(
                    f"minipaged: compiling CUDA kernels for sm_{arch} (once, cached in {directory})",
                    file=sys.stderr,
                    flush=True,
                )
                sources = [str(p) for p in _source_files() if p.suffix in (".cu", ".cpp")]
                # cpp_extension names each object after its source's base name.
                stems = [Path(src).stem for src in sources]
                assert len(set(stems)) == len(stems), f"csrc sources must have distinct base names: {stems}"
                t0 = time.perf_counter()
                try:
                    cpp_extension.load(
                        name=name,
                        sources=sources,
                        extra_cflags=["-O3"],
                        extra_cuda_cflags=nvcc_flags(arch),
                        extra_include_paths=[str(CSRC)],
                        build_directory=str(directory),
                        is_python_module=False,
                        verbose=verbose,
                    )
                except BaseException:
                    # cpp_extension remembers the sources of each name and, asked again in this process,
                    # skips the build and loads whatever (missing, partial) library is there.
                    cpp_extension.JIT_EXTENSION_VERSIONER.entries.pop(name, None)
                    raise
                last_build_seconds = time.perf_counter() - t0
                done.write_text(f"{last_build_seconds:.1f} s\n")
        _loaded[arch] = str(lib_path)
        return str(lib_path)


def is_loaded() -> bool:
    return bool(_loaded)


# ---------------------------------------------------------------------------
# Standalone nvcc compiles (no torch): CI build check and the ptxas report.

def nvcc_path() -> str | None:
    found = shutil.which("nvcc")
    if found:
        return found
    for home in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if home and os.path.exists(os.path.join(home, "bin", "nvcc")):
            return os.path.join(home, "bin", "nvcc")
    return None


def standalone_object(source: Path | str, arch, out_dir: Path | str) -> Path:
    """The object compile_standalone writes for `source` and `arch` (one arch or a list) in out_dir."""
    archs = [arch] if isinstance(arch, str) else list(arch)
    return Path(out_dir) / f"{Path(source).stem}.sm{'_'.join(archs)}.o"


def compile_standalone(source: Path | str, arch, out_dir: Path | str, extra: list[str] | None = None):
    """nvcc -c `source` for sm_`arch` (one arch or a list: one nvcc run, one ptxas
    pass per arch) with -Xptxas -v. With "90a" among the archs the sm_90a defines
    are added, so the wgmma kernels are compiled (as __trap() stubs for the other
    archs of the same run). Returns (returncode, combined output)."""
    import subprocess

    nvcc = nvcc_path()
    if nvcc is None:
        raise FileNotFoundError("nvcc not found")
    archs = [arch] if isinstance(arch, str) else list(arch)
    source = Path(source)
    obj = standalone_object(source, archs, out_dir)
    cmd = [nvcc, "-std=c++17", "-O3", "-lineinfo"]
    cmd += [f"-gencode=arch=compute_{a},code=sm_{a}" for a in archs]
    cmd += ["-Xptxas", "-v", "-I", str(CSRC), "-c", str(source), "-o", str(obj)]
    cmd += (sm90a_flags() if "90a" in archs else []) + list(extra or [])
    proc = subprocess.run(cmd, capture_output=True, text=True)
    return proc.returncode, proc.stdout + proc.stderr


def parse_ptxas(log: str) -> list[dict]:
    """[{kernel, arch, registers, smem, stack, spill_stores, spill_loads}] from `-Xptxas -v` output."""
    import re

    kernels: list[dict] = []
    cur: dict | None = None
    for line in log.splitlines():
        m = re.search(r"Compiling entry function '([^']+)' for '(\w+)'", line)
        if m:
            cur = {"kernel": m.group(1), "arch": m.group(2), "registers": None, "smem": 0,
                   "stack": 0, "spill_stores": 0, "spill_loads": 0}
            kernels.append(cur)
            continue
        if cur is None:
            continue
        m = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", line)
        if m:
            cur["stack"], cur["spill_stores"], cur["spill_loads"] = map(int, m.groups())
        m = re.search(r"Used (\d+) registers", line)
        if m:
            cur["registers"] = int(m.group(1))
            s = re.search(r"(\d+) bytes smem", line)
            cur["smem"] = int(s.group(1)) if s else 0
    return kernels
