"""Backend records, the MINIPAGED_* environment variables and `auto` selection.

A backend is a record, not a module: its ops are named as "module:function"
strings and imported on first use, so `import minipaged` never imports Triton
or builds CUDA. Every op receives arguments that `api.py` has already checked:

    prefill(q, k, v, causal, scale) -> o                       q [B, Hq, Nq, D]
    prefill_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k,
                   max_seqlen_q, max_seqlen_k, causal, scale) -> o   q [Tq, Hq, D]
    decode(q, k_cache, v_cache, block_tables, context_lens, scale) -> o   q [B, Hq, D]
    write_kv_cache(k, v, k_cache, v_cache, slot_mapping) -> None
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import os
import shutil
import threading
from dataclasses import dataclass, field
from typing import Callable, Iterator, Mapping

OPS = ("prefill", "prefill_varlen", "decode", "write_kv_cache")
# which environment variable overrides MINIPAGED_BACKEND for an op
_OP_ENV = {
    "prefill": "MINIPAGED_PREFILL_BACKEND",
    "prefill_varlen": "MINIPAGED_PREFILL_BACKEND",
    "decode": "MINIPAGED_DECODE_BACKEND",
    "write_kv_cache": "MINIPAGED_DECODE_BACKEND",
}
AUTO = "auto"
# `auto` on CUDA tensors tries these in order; CPU tensors always get torch.
_AUTO_CUDA_ORDER = ("cuda", "triton", "torch")


class BackendUnavailableError(RuntimeError):
    """A backend was asked for by name but cannot run here (the message says why)."""


@dataclass(frozen=True)
class Backend:
    """One backend: its name, the ops it provides and where it can run.

    `ops` maps an op name (see OPS) to "module:function"; `devices` lists the
    device types it runs on; `availability(device_type)` returns (ok, reason).
    """

    name: str
    ops: Mapping[str, str]
    devices: tuple[str, ...]
    availability: Callable[[str], tuple[bool, str]]
    dtypes: tuple[str, ...] = ("float16", "bfloat16")
    head_dims: tuple[int, ...] = (64, 128)
    description: str = ""
    _resolved: dict = field(default_factory=dict, compare=False, repr=False)

    def is_available(self, device: str | None = None) -> tuple[bool, str]:
        """(ok, reason) for running on `device` ("cpu"/"cuda"; None: the best device here)."""
        if device is None:
            device = "cuda" if _cuda_available() and "cuda" in self.devices else self.devices[0]
        device = str(device).split(":")[0]
        if device not in self.devices:
            return False, f"runs on {', '.join(self.devices)}, not {device}"
        return self.availability(device)

    def provides(self, op: str) -> bool:
        return op in self.ops

    def require(self, op: str) -> None:
        """Raise BackendUnavailableError naming the backends that have `op` when this one lacks it."""
        if op not in self.ops:
            have = [b.name for b in _BACKENDS.values() if b.provides(op)]
            raise BackendUnavailableError(
                f"backend {self.name!r} does not implement {op!r}; backends that do: {have}"
            )

    def op(self, op: str) -> Callable:
        """The function implementing `op`, imported on first use."""
        self.require(op)
        fn = self._resolved.get(op)
        if fn is None:
            module, attr = self.ops[op].split(":")
            fn = getattr(importlib.import_module(module), attr)
            self._resolved[op] = fn
        return fn


def _cuda_available() -> bool:
    # torch is imported lazily so that `minipaged.registry` stays cheap to import.
    import torch

    return torch.cuda.is_available()


def _torch_availability(device: str) -> tuple[bool, str]:
    if device == "cuda" and not _cuda_available():
        return False, "no CUDA device visible to torch"
    return True, "plain PyTorch"


def _triton_availability(device: str) -> tuple[bool, str]:
    if importlib.util.find_spec("triton") is None:
        return False, "the triton package is not installed"
    if device == "cpu":
        if os.environ.get("TRITON_INTERPRET", "0") != "1":
            return False, "CPU tensors need TRITON_INTERPRET=1 (the Triton interpreter)"
        return True, "Triton interpreter (TRITON_INTERPRET=1)"
    if not _cuda_available():
        return False, "no CUDA device visible to torch"
    if os.environ.get("TRITON_INTERPRET", "0") == "1":
        return False, "TRITON_INTERPRET=1 is set, so Triton cannot run on the GPU"
    return True, "Triton JIT on the GPU"


def _cuda_ext_availability(device: str) -> tuple[bool, str]:
    if device != "cuda":
        return False, "hand-written CUDA kernels need CUDA tensors"
    import torch

    if not torch.cuda.is_available():
        return False, "no CUDA device visible to torch"
    if torch.version.cuda is None:
        return False, "this torch build has no CUDA support"
    major, minor = torch.cuda.get_device_capability()
    if major < 8:
        return False, f"GPU arch sm_{major}{minor} is below the sm_80 the kernels need"
    from torch.utils.cpp_extension import CUDA_HOME

    nvcc = shutil.which("nvcc") or (CUDA_HOME and os.path.join(CUDA_HOME, "bin", "nvcc"))
    if not nvcc or not os.path.exists(nvcc):
        return False, "nvcc not found (set CUDA_HOME or put nvcc on PATH) to JIT-build the kernels"
    return True, f"JIT-built for sm_{major}{minor} on first use"


_CUDA_OPS = "minipaged.cuda.ops"
_BACKENDS: dict[str, Backend] = {
    b.name: b
    for b in (
        Backend(
            name="torch",
            ops={op: f"minipaged.reference:{op}" for op in OPS},
            devices=("cpu", "cuda"),
            availability=_torch_availability,
            dtypes=("float16", "bfloat16", "float32"),
            head_dims=(64, 128, 256),
            description="plain PyTorch, fp32 softmax: the oracle",
        ),
        Backend(
            name="triton",
            ops={op: f"minipaged.triton.ops:{op}" for op in OPS},
            devices=("cuda", "cpu"),
            availability=_triton_availability,
            dtypes=("float16", "bfloat16", "float32"),
            head_dims=(64, 128, 256),
            description="Triton: FA2 prefill, split-KV paged decode",
        ),
        Backend(
            name="cuda",
            ops={op: f"{_CUDA_OPS}:{op}" for op in OPS},
            devices=("cuda",),
            availability=_cuda_ext_availability,
            description="hand-written CUDA: mma.sync prefill, paged decode",
        ),
        Backend(
            name="cuda-wmma",
            ops={
                "prefill": f"{_CUDA_OPS}:prefill_wmma",
                "prefill_varlen": f"{_CUDA_OPS}:prefill_varlen_wmma",
                "decode": f"{_CUDA_OPS}:decode",
                "write_kv_cache": f"{_CUDA_OPS}:write_kv_cache",
            },
            devices=("cuda",),
            availability=_cuda_ext_availability,
            description="the article's WMMA teaching prefill kernel (decode shared with cuda)",
        ),
    )
}

_local = threading.local()


def backend_names() -> list[str]:
    return [AUTO, *_BACKENDS]


def all_backends() -> dict[str, Backend]:
    return dict(_BACKENDS)


def available_backends(device: str | None = None) -> dict[str, tuple[bool, str]]:
    """{name: (available, reason)} for every backend, on `device` (None: the best here)."""
    return {name: b.is_available(device) for name, b in _BACKENDS.items()}


def _validate_name(name: str, source: str) -> str:
    name = name.strip().lower()
    if name != AUTO and name not in _BACKENDS:
        raise ValueError(f"{source}: unknown backend {name!r}; valid names are {backend_names()}")
    return name


def requested_name(op: str | None = None, name: str | None = None) -> tuple[str, str]:
    """The backend name asked for and where it came from, by the documented precedence:
    argument > use_backend() scope > MINIPAGED_{PREFILL,DECODE}_BACKEND > MINIPAGED_BACKEND > auto."""
    if name is not None:
        return _validate_name(name, "backend="), "backend="
    scoped = getattr(_local, "stack", None)
    if scoped:
        return scoped[-1], "use_backend()"
    if op is not None:
        var = _OP_ENV[op]
        if os.environ.get(var):
            return _validate_name(os.environ[var], var), var
    if os.environ.get("MINIPAGED_BACKEND"):
        return _validate_name(os.environ["MINIPAGED_BACKEND"], "MINIPAGED_BACKEND"), "MINIPAGED_BACKEND"
    return AUTO, "auto"


def resolve(op: str, device: str, name: str | None = None) -> Backend:
    """The backend that runs `op` on tensors of `device` ("cpu"/"cuda")."""
    device = str(device).split(":")[0]
    chosen, source = requested_name(op, name)
    if chosen == AUTO:
        order = _AUTO_CUDA_ORDER if device == "cuda" else ("torch",)
        reasons = []
        for cand in order:
            b = _BACKENDS[cand]
            ok, why = b.is_available(device)
            if ok and b.provides(op):
                return b
            reasons.append(f"{cand}: {why}")
        raise BackendUnavailableError(f"auto found no backend for {op} on {device}: {reasons}")
    b = _BACKENDS[chosen]
    b.require(op)
    ok, why = b.is_available(device)
    if not ok:
        raise BackendUnavailableError(f"backend {chosen!r} (from {source}) is unavailable on {device}: {why}")
    return b


def get_backend(name: str | None = None, *, op: str = "prefill", device: str | None = None) -> Backend:
    """The Backend that `name` (None: use_backend scope, env vars, then auto) selects.

    With `auto` this is what a call on `device` (default: cuda if present, else cpu)
    would run for `op`. Raises ValueError for an unknown name and
    BackendUnavailableError for a backend that cannot run here.
    """
    if device is None:
        device = "cuda" if _cuda_available() else "cpu"
    return resolve(op, device, name)


@contextlib.contextmanager
def use_backend(name: str) -> Iterator[None]:
    """Run every minipaged call inside the `with` block on backend `name` (thread-local).

    An explicit `backend=` argument still wins; the environment variables lose.
    """
    name = _validate_name(name, "use_backend")
    stack = getattr(_local, "stack", None)
    if stack is None:
        stack = _local.stack = []
    stack.append(name)
    try:
        yield
    finally:
        stack.pop()
