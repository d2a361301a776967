"""The one timing harness behind `minipaged bench` and bench/*.py.

Rules it enforces (so every figure in this project is comparable):
- warm-up calls first (they absorb Triton JIT/autotuning, CUDA extension builds,
  torch.compile), never counted;
- on CUDA: one CUDA event pair around each call, and a cold L2 for each call:
  a buffer at least 2x the L2 size (256 MiB minimum) is read *between* the
  event pairs, so flushing costs no measured time (see `l2_flush_mode`);
- the number of timed calls is bounded by both `reps` and a time budget, never
  below `min_reps`;
- figures are order statistics (median, min, p20, p80) of the per-call times;
- on CPU: time.perf_counter around each (synchronous) call, no cache flush.

`environment()` records what a result needs to be reproducible: device name,
SM count, versions of torch/triton/CUDA/cuDNN, git commit, date.
"""

from __future__ import annotations

import datetime as _dt
import importlib.metadata
import os
import platform
import subprocess
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

import torch

_MIN_FLUSH_BYTES = 256 * 1024 * 1024
_flush_buffers: dict[str, torch.Tensor] = {}


@dataclass
class Timing:
    """Per-call times (milliseconds) of one measured function."""

    median_ms: float
    min_ms: float
    p20_ms: float
    p80_ms: float
    mean_ms: float
    reps: int
    warmup: int
    cold_l2: bool
    clock: str  # "cuda-events" or "perf_counter"

    def as_dict(self) -> dict:
        return asdict(self)


def percentile(sorted_values: list[float], q: float) -> float:
    """Linear-interpolated percentile (q in [0, 100]) of an already sorted list."""
    if not sorted_values:
        raise ValueError("percentile of an empty list")
    if len(sorted_values) == 1:
        return float(sorted_values[0])
    pos = (len(sorted_values) - 1) * q / 100.0
    lo = int(pos)
    hi = min(lo + 1, len(sorted_values) - 1)
    frac = pos - lo
    return float(sorted_values[lo] * (1.0 - frac) + sorted_values[hi] * frac)


def summarize(times_ms: list[float], *, warmup: int, cold_l2: bool, clock: str) -> Timing:
    s = sorted(float(t) for t in times_ms)
    return Timing(
        median_ms=percentile(s, 50),
        min_ms=s[0],
        p20_ms=percentile(s, 20),
        p80_ms=percentile(s, 80),
        mean_ms=sum(s) / len(s),
        reps=len(s),
        warmup=warmup,
        cold_l2=cold_l2,
        clock=clock,
    )


def l2_cache_bytes(device: torch.device | str | None = None) -> int:
    """L2 size of a CUDA device in bytes (0 if unknown or not CUDA)."""
    device = torch.device(device) if device is not None else torch.device("cuda")
    if device.type != "cuda":
        return 0
    props = torch.cuda.get_device_properties(device)
    return int(getattr(props, "L2_cache_size", 0) or 0)


def _flush_buffer(device: torch.device) -> torch.Tensor:
    key = str(device)
    buf = _flush_buffers.get(key)
    if buf is None:
        nbytes = max(_MIN_FLUSH_BYTES, 2 * l2_cache_bytes(device))
        buf = torch.empty(nbytes // 4, dtype=torch.int32, device=device)
        _flush_buffers[key] = buf
    return buf


def l2_flush_mode() -> str:
    """How L2 is emptied between timed calls (MINIPAGED_BENCH_L2_FLUSH).

    "read" (default) streams the flush buffer: the timed call starts with none
    of its data in L2 and with L2 full of *clean* lines. "write" overwrites the
    buffer, as `triton.testing.do_bench` does; that leaves up to a whole L2 of
    dirty lines, and their write-back to HBM lands inside the next timed call,
    charging short memory-bound kernels for the flush itself (measured in
    bench/results/nvidia-h200/triton_config_notes.md), so it is not the default.
    """
    mode = os.environ.get("MINIPAGED_BENCH_L2_FLUSH", "read")
    if mode not in ("write", "read"):
        raise ValueError(f"MINIPAGED_BENCH_L2_FLUSH must be 'write' or 'read', got {mode!r}")
    return mode


def _flush(buf: torch.Tensor, mode: str) -> None:
    if mode == "write":
        buf.zero_()
    else:
        buf.sum()


def release_flush_buffers() -> None:
    _flush_buffers.clear()


def time_fn(
    fn: Callable[[], object],
    *,
    device: torch.device | str,
    reps: int = 100,
    min_reps: int = 5,
    warmup: int = 2,
    max_time_s: float = 0.5,
    cold_l2: bool = True,
    cuda_graph: bool = False,
) -> Timing:
    """Time `fn()` (no arguments; it closes over its inputs).

    `warmup` untimed calls come first (the first also pays any compilation).
    Then the cost of one call is estimated and the number of timed calls is
    min(reps, max_time_s / cost), at least min_reps (max_time_s <= 0: reps).

    cuda_graph: capture fn() once into a CUDA graph and time its replays, so a
    microsecond kernel is measured rather than Python's launch path (decode
    runs this way in a serving engine). Falls back to eager calls, with
    clock "cuda-events", when fn cannot be captured.
    """
    device = torch.device(device)
    if reps < 1:
        raise ValueError(f"reps must be >= 1, got {reps}")
    min_reps = max(1, min(min_reps, reps))
    if device.type == "cuda":
        clock = "cuda-events"
        if cuda_graph:
            with torch.cuda.device(device):
                for _ in range(max(1, warmup)):
                    fn()
                torch.cuda.synchronize()
                graph = _capture(fn)
            if graph is not None:
                fn, clock = graph.replay, "cuda-graph"
        return _time_cuda(fn, device, reps, min_reps, warmup, max_time_s, cold_l2, clock)
    return _time_cpu(fn, reps, min_reps, warmup, max_time_s)


def _count(reps: int, min_reps: int, max_time_s: float, est_ms: float) -> int:
    # max_time_s <= 0 means no time bound: exactly `reps` timed calls
    if est_ms <= 0 or max_time_s <= 0:
        return reps
    return int(max(min_reps, min(reps, (max_time_s * 1000.0) // est_ms)))


def _time_cpu(fn, reps, min_reps, warmup, max_time_s) -> Timing:
    # the last warm-up call doubles as the cost estimate (interpreted Triton
    # calls take seconds: no call is spent on estimating alone)
    est_ms = 0.0
    for _ in range(max(1, warmup)):
        t0 = time.perf_counter()
        fn()
        est_ms = (time.perf_counter() - t0) * 1000.0
    n = _count(reps, min_reps, max_time_s, est_ms)
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1000.0)
    return summarize(times, warmup=max(1, warmup), cold_l2=False, clock="perf_counter")


def _capture(fn):
    """fn captured into a CUDA graph, or None when it cannot be (host syncs, CPU work)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    try:
        with torch.cuda.stream(side):
            fn()  # allocations of a first call on the capture stream's pool happen here
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
        torch.cuda.synchronize()
        return graph
    except Exception:  # noqa: BLE001 - not capturable: time it eagerly instead
        torch.cuda.synchronize()
        return None


def _time_cuda(fn, device, reps, min_reps, warmup, max_time_s, cold_l2, clock="cuda-events") -> Timing:
    with torch.cuda.device(device):
        flush = _flush_buffer(device) if cold_l2 else None
        mode = l2_flush_mode()
        for _ in range(max(1, warmup)):
            fn()
        torch.cuda.synchronize()
        # cost of one (flush + call), to fit the rep count into the time budget
        n_est = 3
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        wall0 = time.perf_counter()
        start.record()
        for _ in range(n_est):
            if flush is not None:
                _flush(flush, mode)
            fn()
        end.record()
        torch.cuda.synchronize()
        # CPU launch overhead bounds throughput as much as GPU time does
        est_ms = max(start.elapsed_time(end), (time.perf_counter() - wall0) * 1000.0) / n_est
        n = _count(reps, min_reps, max_time_s, est_ms)
        starts = [torch.cuda.Event(enable_timing=True) for _ in range(n)]
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(n)]
        for i in range(n):
            if flush is not None:
                _flush(flush, mode)
            starts[i].record()
            fn()
            ends[i].record()
        torch.cuda.synchronize()
        times = [s.elapsed_time(e) for s, e in zip(starts, ends)]
    return summarize(times, warmup=max(1, warmup), cold_l2=cold_l2, clock=clock)


# ----------------------------------------------------------------------------- environment


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def git_commit() -> str:
    """$MINIPAGED_GIT_COMMIT if set, else HEAD of the source checkout (+"-dirty"), else "unknown"."""
    env = os.environ.get("MINIPAGED_GIT_COMMIT")
    if env:
        return env
    root = Path(__file__).resolve().parents[3]
    if not (root / "src" / "minipaged").is_dir():  # an installed package: no checkout to ask
        return "unknown"
    try:
        head = subprocess.run(
            ["git", "-C", str(root), "rev-parse", "HEAD"],
            capture_output=True, text=True, timeout=10,
        )
        if head.returncode == 0 and head.stdout.strip():
            commit = head.stdout.strip()
            dirty = subprocess.run(
                ["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
                capture_output=True, text=True, timeout=10,
            )
            if dirty.returncode == 0 and dirty.stdout.strip():
                commit += "-dirty"
            return commit
    except (OSError, subprocess.SubprocessError):
        pass
    return "unknown"


def device_name(device: torch.device | str) -> str:
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"CPU ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)"


def device_slug(device: torch.device | str) -> str:
    """A folder name for a device: "nvidia-h200", "cpu"."""
    device = torch.device(device)
    if device.type != "cuda":
        return "cpu"
    name = torch.cuda.get_device_name(device).lower()
    slug = "".join(c if c.isalnum() else "-" for c in name)
    while "--" in slug:
        slug = slug.replace("--", "-")
    return slug.strip("-") or "cuda"


def environment(device: torch.device | str) -> dict:
    """What a benchmark result needs to be reproduced: device, versions, commit, date."""
    device = torch.device(device)
    env = {
        "device_type": device.type,
        "device_name": device_name(device),
        "sm_count": None,
        "compute_capability": None,
        "l2_cache_bytes": None,
        "total_memory_bytes": None,
        "torch": torch.__version__,
        "triton": _version("triton"),
        "cuda": torch.version.cuda,
        "cudnn": None,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "git_commit": git_commit(),
        "date_utc": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "triton_interpret": os.environ.get("TRITON_INTERPRET", "0") == "1",
        "l2_flush": l2_flush_mode() if device.type == "cuda" else None,
    }
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        env["sm_count"] = int(props.multi_processor_count)
        env["compute_capability"] = f"{props.major}.{props.minor}"
        env["l2_cache_bytes"] = l2_cache_bytes(device)
        env["total_memory_bytes"] = int(props.total_memory)
        try:
            env["cudnn"] = torch.backends.cudnn.version()
        except Exception:  # noqa: BLE001 - a missing cuDNN is just "unknown"
            env["cudnn"] = None
    return env
