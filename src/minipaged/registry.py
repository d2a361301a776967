"""Backends, the MINIPAGED_* environment variables and `auto` selection.

A backend is a record (`Backend`) plus a loader that imports its module and
returns its functions as a `BackendOps`. Loading happens on first use, so
`import minipaged` imports no Triton and builds no CUDA. Each function receives
arguments that `api.py` has already checked and made kernel-ready; the
positional signatures are:

    prefill(q, k, v, causal, scale, return_lse)                      q [B, Hq, Nq, D]
    prefill_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k,
                   max_seqlen_q, max_seqlen_k, causal, scale, return_lse)   q [Tq, Hq, D]
    decode(q, k_cache, v_cache, block_tables, context_lens, scale, return_lse)   q [B, Hq, D]
    paged(q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens,
          max_seqlen_q, causal, scale, return_lse)                    q [Tq, Hq, D]
    write_kv_cache(k, v, k_cache, v_cache, slot_mapping) -> None
    merge_attention_states(o_a, lse_a, o_b, lse_b) -> (o, lse)

The attention ops return o, or (o, lse) with return_lse (lse float32, natural log).

Availability is probed once per (backend, device type) and cached, and
`resolve` is memoised on everything that can change its answer (the op, the
device type, the explicit name, the environment variables, the `use_backend`
scope); `reset_caches()` forgets both (tests that patch availability use it).
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import shutil
import threading
from dataclasses import dataclass, fields
from typing import Callable, Iterator

OPS = ("prefill", "prefill_varlen", "decode", "paged", "write_kv_cache")
# which environment variable overrides MINIPAGED_BACKEND for an op
_OP_ENV = {
    "prefill": "MINIPAGED_PREFILL_BACKEND",
    "prefill_varlen": "MINIPAGED_PREFILL_BACKEND",
    "decode": "MINIPAGED_DECODE_BACKEND",
    "paged": "MINIPAGED_DECODE_BACKEND",
    "write_kv_cache": "MINIPAGED_DECODE_BACKEND",
}
AUTO = "auto"
# `auto` on CUDA tensors tries these in order; CPU tensors always get torch.
_AUTO_CUDA_ORDER = ("cuda", "triton", "torch")


class BackendUnavailableError(RuntimeError):
    """A backend was asked for by name but cannot run here (the message says why)."""


@dataclass(frozen=True)
class BackendOps:
    """The functions of one backend module (signatures in this module's docstring)."""

    prefill: Callable
    prefill_varlen: Callable
    decode: Callable
    paged: Callable
    write_kv_cache: Callable
    merge_attention_states: Callable | None = None


@dataclass(frozen=True)
class Backend:
    """One backend: its name, the ops it provides and where it can run.

    `load()` imports the backend's module and returns its `BackendOps`;
    `availability(device_type)` returns (ok, reason) and is called once per
    device type (cached). `dtypes_by_device` narrows `dtypes` on a device where
    some dtype cannot be computed correctly (bf16 under the Triton interpreter).
    """

    name: str
    load: Callable[[], BackendOps]
    devices: tuple[str, ...]
    availability: Callable[[str], tuple[bool, str]]
    provides: frozenset[str] = frozenset(OPS)
    dtypes: tuple[str, ...] = ("float16", "bfloat16")
    head_dims: tuple[int, ...] = (64, 128)
    dtypes_by_device: tuple[tuple[str, tuple[str, ...], str], ...] = ()
    fp8_kv: bool = False  # decode, paged and write_kv_cache take float8_e4m3fn caches
    description: str = ""

    def is_available(self, device: str | None = None) -> tuple[bool, str]:
        """(ok, reason) for running on `device` ("cpu"/"cuda"; None: on any device here, the GPU
        first: triton under TRITON_INTERPRET=1 on a CPU-only machine is available)."""
        if device is None:
            order = sorted(self.devices, key=lambda d: d != "cuda" or not _cuda_available())
            results = [(d, self.is_available(d)) for d in order]
            for _, hit in results:
                if hit[0]:
                    return hit
            if len(results) == 1:
                return results[0][1]
            return False, "; ".join(f"{d}: {why}" for d, (_, why) in results)
        device = str(device).split(":")[0]
        if device not in self.devices:
            return False, f"runs on {', '.join(self.devices)}, not {device}"
        key = (self.name, device, os.environ.get("TRITON_INTERPRET"))
        hit = _availability.get(key)
        if hit is None:
            hit = _availability[key] = self.availability(device)
        return hit

    def supported_dtypes(self, device: str) -> tuple[tuple[str, ...], str]:
        """(dtype names this backend computes correctly on `device`, why the others are missing)."""
        device = str(device).split(":")[0]
        for dev, dtypes, why in self.dtypes_by_device:
            if dev == device:
                return dtypes, why
        return self.dtypes, ""

    def require(self, op: str) -> None:
        """Raise BackendUnavailableError naming the backends that have `op` when this one lacks it."""
        if op not in self.provides:
            have = [b.name for b in _BACKENDS.values() if op in b.provides]
            raise BackendUnavailableError(f"backend {self.name!r} does not implement {op!r}; backends that do: {have}")

    def ops(self) -> BackendOps:
        """The backend's functions, imported on first use."""
        fns = _loaded.get(self.name)
        if fns is None:
            fns = _loaded[self.name] = self.load()
        return fns

    def op(self, op: str) -> Callable:
        """The function implementing `op`."""
        self.require(op)
        return getattr(self.ops(), op)


_availability: dict[tuple, tuple[bool, str]] = {}
_loaded: dict[str, BackendOps] = {}
_resolved: dict[tuple, "Backend"] = {}


_generation = 0  # bumped by reset_caches so that caches keyed on selection_key() miss


def reset_caches() -> None:
    """Forget probed availability and memoised resolutions (loaded modules stay loaded)."""
    global _generation
    _availability.clear()
    _resolved.clear()
    _generation += 1


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def _cuda_available() -> bool:
    # torch is imported lazily so that `minipaged.registry` stays cheap to import.
    import torch

    return torch.cuda.is_available()


# --------------------------------------------------------------------------- availability


def _torch_availability(device: str) -> tuple[bool, str]:
    if device == "cuda" and not _cuda_available():
        return False, "no CUDA device visible to torch"
    return True, "plain PyTorch"


def _triton_availability(device: str) -> tuple[bool, str]:
    if importlib.util.find_spec("triton") is None:
        return False, "the triton package is not installed"
    if device == "cpu":
        if not _interpreting():
            return False, "CPU tensors need TRITON_INTERPRET=1 (the Triton interpreter)"
        return True, "Triton interpreter (TRITON_INTERPRET=1)"
    if not _cuda_available():
        return False, "no CUDA device visible to torch"
    if _interpreting():
        return False, "TRITON_INTERPRET=1 is set, so Triton cannot run on the GPU"
    return True, "Triton JIT on the GPU"


def _cuda_ext_availability(device: str) -> tuple[bool, str]:
    if device != "cuda":
        return False, "hand-written CUDA kernels need CUDA tensors"
    import torch

    if torch.version.cuda is None:
        return False, "this torch build has no CUDA support"
    if not torch.cuda.is_available():
        return False, "no CUDA device visible to torch"
    major, minor = torch.cuda.get_device_capability()
    if major < 8:
        return False, f"GPU arch sm_{major}{minor} is below the sm_80 the kernels need"
    from torch.utils.cpp_extension import CUDA_HOME

    nvcc = shutil.which("nvcc") or (CUDA_HOME and os.path.join(CUDA_HOME, "bin", "nvcc"))
    if not nvcc or not os.path.exists(nvcc):
        return False, "nvcc not found (set CUDA_HOME or put nvcc on PATH) to JIT-build the kernels"
    return True, f"JIT-built for sm_{major}{minor} on first use"


# --------------------------------------------------------------------------- loaders


def _load_torch() -> BackendOps:
    from . import reference

    return reference.OPS


def _load_triton() -> BackendOps:
    from .triton import ops

    return ops.OPS


def _load_cuda() -> BackendOps:
    from .cuda import ops

    return ops.OPS


def _load_cuda_wmma() -> BackendOps:
    from .cuda import ops

    return ops.WMMA_OPS


_INTERPRETER_BF16 = (
    "the Triton interpreter (TRITON_INTERPRET=1) computes bfloat16 tl.dot wrongly, so bfloat16 is refused "
    "on CPU; use float16/float32 there, or run triton on a GPU"
)

_BACKENDS: dict[str, Backend] = {
    b.name: b
    for b in (
        Backend(
            name="torch",
            load=_load_torch,
            devices=("cpu", "cuda"),
            availability=_torch_availability,
            dtypes=("float16", "bfloat16", "float32"),
            head_dims=(64, 128, 256),
            fp8_kv=True,
            description="plain PyTorch, fp32 softmax: the oracle",
        ),
        Backend(
            name="triton",
            load=_load_triton,
            devices=("cuda", "cpu"),
            availability=_triton_availability,
            dtypes=("float16", "bfloat16", "float32"),
            dtypes_by_device=(("cpu", ("float16", "float32"), _INTERPRETER_BF16),),
            head_dims=(64, 128, 256),
            fp8_kv=True,
            description="Triton: FA2 prefill, GQA-packed paged attention, split-KV decode",
        ),
        Backend(
            name="cuda",
            load=_load_cuda,
            devices=("cuda",),
            availability=_cuda_ext_availability,
            fp8_kv=True,
            description="hand-written CUDA: warp-specialised TMA / wgmma / mma.sync prefill, paged attention, decode",
        ),
        Backend(
            name="cuda-wmma",
            load=_load_cuda_wmma,
            devices=("cuda",),
            availability=_cuda_ext_availability,
            fp8_kv=True,
            description="the article's WMMA teaching prefill kernel (paged ops shared with cuda)",
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
    if device is not None:
        _check_device(device)
    return {name: b.is_available(device) for name, b in _BACKENDS.items()}


def _check_device(device) -> None:
    """A device argument must name cpu or cuda[:N]: a typo, or a backend name given as the device,
    would otherwise read as "nothing runs here" (BackendUnavailableError)."""
    kind = device if isinstance(device, str) else getattr(device, "type", None)
    if not isinstance(kind, str):
        raise TypeError(f"device must be a str or torch.device, got {type(device).__name__}")
    base, colon, index = kind.partition(":")
    if base not in ("cpu", "cuda") or colon and not index.isdigit():
        raise ValueError(f"device must be 'cpu' or 'cuda[:N]', got {device!r}")


def _validate_name(name: str, source: str) -> str:
    if not isinstance(name, str):
        raise TypeError(f"{source}: a backend name must be a str, got {type(name).__name__}")
    name = name.strip().lower()
    if name != AUTO and name not in _BACKENDS:
        raise ValueError(f"{source}: unknown backend {name!r}; valid names are {backend_names()}")
    return name


def _scope() -> str | None:
    stack = getattr(_local, "stack", None)
    return stack[-1] if stack else None


def requested_name(op: str | None = None, name: str | None = None) -> tuple[str, str]:
    """The backend name asked for and where it came from, by the documented precedence:
    argument > use_backend() scope > MINIPAGED_{PREFILL,DECODE}_BACKEND > MINIPAGED_BACKEND > auto."""
    if name is not None:
        return _validate_name(name, "backend="), "backend="
    scoped = _scope()
    if scoped:
        return scoped, "use_backend()"
    if op is not None:
        var = _OP_ENV[op]
        if os.environ.get(var):
            return _validate_name(os.environ[var], var), var
    if os.environ.get("MINIPAGED_BACKEND"):
        return _validate_name(os.environ["MINIPAGED_BACKEND"], "MINIPAGED_BACKEND"), "MINIPAGED_BACKEND"
    return AUTO, "auto"


if os.name == "posix" and isinstance(getattr(os.environ, "_data", None), dict):
    # os.environ.get costs about a microsecond (Mapping.get, key encoding) and resolve reads
    # three variables per call; the mapping's own dict, which os.environ's setters keep
    # current, is read directly with pre-encoded keys.
    _ENV_DATA = os.environ._data
    _ENC = {k: os.environ.encodekey(k) for k in (*set(_OP_ENV.values()), "MINIPAGED_BACKEND", "TRITON_INTERPRET")}

    def _env(name: str):
        return _ENV_DATA.get(_ENC[name])
else:  # pragma: no cover - non-POSIX
    def _env(name: str):
        return os.environ.get(name)


def selection_key(op: str, device: str, name: str | None) -> tuple:
    """Everything a resolution depends on, as a dict key (cheap: no string formatting)."""
    stack = getattr(_local, "stack", None)
    return (op, device, name, stack[-1] if stack else None, _env(_OP_ENV[op]), _env("MINIPAGED_BACKEND"),
            _env("TRITON_INTERPRET"), _generation)


def resolve(op: str, device: str, name: str | None = None, *, fp8_kv: bool = False) -> Backend:
    """The backend that runs `op` on tensors of `device` ("cpu"/"cuda"); memoised.
    fp8_kv: the call has float8_e4m3fn caches, so `auto` skips backends without FP8 kernels
    (a backend asked for by name is returned as is; the API then says it cannot)."""
    if op not in _OP_ENV:
        raise ValueError(f"unknown op {op!r}; ops are {list(OPS)}")
    device = str(device).split(":")[0]
    key = (selection_key(op, device, name), fp8_kv)
    b = _resolved.get(key)
    if b is None:
        b = _resolved[key] = _resolve(op, device, name, fp8_kv)
    return b


def _resolve(op: str, device: str, name: str | None, fp8_kv: bool = False) -> Backend:
    chosen, source = requested_name(op, name)
    if chosen == AUTO:
        order = _AUTO_CUDA_ORDER if device == "cuda" else ("torch",)
        reasons = []
        for cand in order:
            b = _BACKENDS[cand]
            ok, why = b.is_available(device)
            if ok and fp8_kv and not b.fp8_kv:
                ok, why = False, "no float8_e4m3fn KV-cache kernels"
            if ok and op in b.provides:
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
    would run for `op`. Raises ValueError for an unknown name or a device other than
    cpu / cuda[:N] (TypeError for a non-device) and BackendUnavailableError for a backend
    that cannot run here.
    """
    if device is None:
        device = "cuda" if _cuda_available() else "cpu"
    else:
        _check_device(device)  # (resolve would call device="foo" a device no backend runs on)
    return resolve(op, device, name)


@dataclass(frozen=True)
class BoundOps:
    """The functions that one backend choice resolves to for one device, bound once
    (the engine's way to call kernels without resolving per call). Fields hold the
    backend functions themselves (arguments must be kernel-ready, see api.py); the
    `backends` field records which backend serves which op."""

    prefill_varlen: Callable
    decode: Callable
    paged: Callable
    write_kv_cache: Callable
    backends: dict


def bind(name: str | None, device: str, *, fp8_kv: bool = False) -> BoundOps:
    """Resolve the engine's ops for `device` under `name` (None: scope, env vars, auto) once.
    fp8_kv: the cache is float8_e4m3fn (every op but the fresh-prompt prefill reads or writes it)."""
    fns, names = {}, {}
    for f in fields(BoundOps):
        if f.name == "backends":
            continue
        needs_fp8 = fp8_kv and f.name != "prefill_varlen"
        b = resolve(f.name, device, name, fp8_kv=needs_fp8)
        if needs_fp8 and not b.fp8_kv:
            raise BackendUnavailableError(
                f"backend {b.name!r} has no float8_e4m3fn KV-cache kernels for {f.name}; backends that do: "
                f"{[x.name for x in _BACKENDS.values() if x.fp8_kv]}")
        fns[f.name], names[f.name] = b.op(f.name), b.name
    return BoundOps(**fns, backends=names)


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
