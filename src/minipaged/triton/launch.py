"""Cached launches of compiled Triton kernels, for the host cost of eager calls.

`kernel[grid](*args, **kwargs)` makes Triton bind every argument, specialise each one (value 1,
divisibility by 16 and width of an int; dtype and 16-byte alignment of a tensor), hash a cache
key from them and the options, and only then call the compiled kernel's launcher. For
minipaged's 20-30 argument kernels that costs about as much host time as the launch itself,
and an eager engine step pays it for every kernel of every layer.

`fast(kernel)[grid](*args, **kwargs)` launches the same compiled kernel with the same
arguments. Its key is finer than Triton's, so a hit can only find the kernel Triton would pick:
  - an int argument by value; a tensor by dtype and 16-byte alignment of its data pointer; a
    float, bool or None by type; a tensor descriptor by its block shape, layout, shape,
    strides and its base tensor's dtype and alignment;
  - every keyword argument (constexprs and launch options) by value, a tensor among them as a
    tensor above;
  - the current device.
On a miss the call goes through Triton (compiling if needed) and its bound argument list
becomes the template a hit fills with the call's arguments before calling the compiled
kernel's launcher directly. Launch hooks, pre-run hooks, a callable grid, a constexpr given
by position, an argument of another type and the interpreter take Triton's path unchanged.

A compile that fails in an MLIR pass with no diagnostic is tried again (call_triton).

MINIPAGED_TRITON_FAST_LAUNCH=0 turns the cache off (module attribute ENABLED).
MINIPAGED_TRITON_LAUNCH_CHECK=1 (CHECK) runs Triton's binder on every hit too and raises if its
cache key differs from the one the entry was made for (the GPU tests run with it on).
"""

from __future__ import annotations

import inspect
import os
import warnings

import torch

ENABLED = os.environ.get("MINIPAGED_TRITON_FAST_LAUNCH", "1") != "0"
CHECK = os.environ.get("MINIPAGED_TRITON_LAUNCH_CHECK", "0") == "1"


# entries per kernel before the cache starts over (ints are keyed by value: one per shape)
MAX_ENTRIES = 4096
_Tensor = torch.Tensor


def _other_class(a):
    if a is None or type(a) in (float, bool):
        return type(a)
    base = getattr(a, "base", None)
    if isinstance(base, _Tensor) and hasattr(a, "block_shape"):
        return (type(a), id(base.dtype) * 2 + (base.data_ptr() % 16 == 0) + 0.5, tuple(a.block_shape),
                getattr(a, "layout", None), tuple(a.shape), tuple(a.strides), getattr(a, "padding", None))
    raise TypeError(f"no launch-cache class for {type(a).__name__}")


def launch_key(args: tuple, kwargs: dict, runtime_names: frozenset = frozenset()) -> tuple:
    """The cache key of a call without its device (see the module docstring; torch dtypes are
    singletons, so a dtype counts by id, and a tensor's class ends in .5, so it never equals an
    int's value). runtime_names: the kernel's non-constexpr parameters (keyword arguments not
    among them are hashed as they are). TypeError: an argument this cache does not handle."""
    key = [a if type(a) is int else id(a.dtype) * 2 + (a.data_ptr() % 16 == 0) + 0.5 if isinstance(a, _Tensor)
           else _other_class(a) for a in args]
    if runtime_names.isdisjoint(kwargs):
        key.append(tuple(kwargs.items()))
    else:
        for name, v in kwargs.items():
            key.append(name)
            key.append(id(v.dtype) * 2 + (v.data_ptr() % 16 == 0) + 0.5 if isinstance(v, _Tensor)
                       else v if name not in runtime_names or type(v) is int else _other_class(v))
    return tuple(key)


# Triton 3.6 on the GPU machines has now and then failed one compile in a sharded test run, each
# time in another MLIR pass (ConvertTritonToTritonGPU, TritonGPUPipeline, TritonGPUCoalesce,
# ConvertTritonGPUToLLVM), with no diagnostic but "PassManager::run failed". After one of them the
# engine's eager fallback compiled the same kernel in the same process, and 1,290 compiles of
# another such specialisation on the dev box never failed (bench/results/nvidia-h100/:
# gpu_tests_92e4b39/, gpu_tests_3e3bc37/, gpu_tests_99dda93/).
# A failed compile has launched nothing (minipaged's kernels are not autotuned, which would have
# launched other configs first), so compiling again is safe; a deterministic failure still
# raises, after COMPILE_RETRIES more tries.
COMPILE_RETRIES = 2
_PASS_FAILURE = "PassManager::run failed"


def call_triton(fn, grid, args: tuple, kwargs: dict):
    """fn[grid](*args, **kwargs), called again (with a RuntimeWarning) up to COMPILE_RETRIES times
    when Triton's compile fails in an MLIR pass with no diagnostic."""
    for attempt in range(COMPILE_RETRIES + 1):
        try:
            return fn[grid](*args, **kwargs)
        except RuntimeError as err:
            if _PASS_FAILURE not in str(err) or attempt == COMPILE_RETRIES:
                raise
            warnings.warn(f"Triton failed to compile {getattr(fn, '__name__', 'a kernel')} ({err}); "
                          f"compiling it again (try {attempt + 2} of {COMPILE_RETRIES + 1})",
                          RuntimeWarning, stacklevel=3)
    raise AssertionError("unreachable")


class _Entry:
    """A compiled kernel and the bound argument list of the call that made it (constexprs and
    defaults in place); a hit replaces the call's own arguments in it."""

    __slots__ = ("kernel", "function", "packed", "template", "num_args", "runtime_kw", "triton_key")

    def __init__(self, kernel, template: list, num_args: int, runtime_kw: tuple, triton_key):
        kernel.run  # noqa: B018 - loads the module and its function handle
        self.kernel = kernel
        self.function = kernel.function
        self.packed = kernel.packed_metadata
        self.template = template
        self.num_args = num_args
        self.runtime_kw = runtime_kw  # (position, name) of runtime params given by keyword
        self.triton_key = triton_key


class FastKernel:
    """A JITFunction's launches through the cache above; `fn` keeps the JITFunction (code that
    looks for compiled variants finds it there)."""

    def __init__(self, fn):
        self.fn = fn
        self.__name__ = getattr(fn, "__name__", "kernel")
        self._entries: dict = {}
        self._usable = hasattr(fn, "device_caches") and hasattr(fn, "params")
        if self._usable:
            self._signature = inspect.signature(fn.fn)
            self._position = {p.name: i for i, p in enumerate(fn.params)}
            self._constexpr = tuple(p.is_constexpr for p in fn.params)
            self._runtime_names = frozenset(p.name for p in fn.params if not p.is_constexpr)

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.launch(grid, args, kwargs)

    def launch(self, grid, args: tuple, kwargs: dict):
        """fn[grid](*args, **kwargs)."""
        if not (self._usable and ENABLED and type(grid) is tuple) or _hooks_set(self.fn):
            return call_triton(self.fn, grid, args, kwargs)
        try:
            key = (torch.cuda.current_device(), *launch_key(args, kwargs, self._runtime_names))
            entry = self._entries.get(key)
        except TypeError:  # an argument of another type, or an unhashable one
            return call_triton(self.fn, grid, args, kwargs)
        if entry is None:
            return self._miss(key, grid, args, kwargs)
        values = [*args, *entry.template[len(args):]]
        for pos, name in entry.runtime_kw:
            values[pos] = kwargs[name]
        if CHECK:
            _check(self.fn, entry, args, kwargs)
        n = len(grid)
        entry.kernel.run(grid[0], grid[1] if n > 1 else 1, grid[2] if n > 2 else 1, _raw_stream(key[0]),
                         entry.function, entry.packed, None, None, None, *values)
        return entry.kernel

    def _miss(self, key, grid, args: tuple, kwargs: dict):
        kernel = call_triton(self.fn, grid, args, kwargs)
        if kernel is None or any(self._constexpr[: len(args)]):
            return kernel  # a constexpr given by position (its key holds only its type): Triton's path always
        if len(self._entries) >= MAX_ENTRIES:
            self._entries.clear()
        params = {k: v for k, v in kwargs.items() if k in self._position}
        bound = self._signature.bind(*args, **params)
        bound.apply_defaults()
        runtime_kw = tuple((self._position[k], k) for k in params if k in self._runtime_names)
        template = list(bound.arguments.values())
        # a hit brings its own runtime arguments: the template keeps none of this call's tensors alive
        for pos in (*range(len(args)), *(p for p, _ in runtime_kw)):
            template[pos] = None
        self._entries[key] = _Entry(kernel, template, len(args), runtime_kw, _triton_key(self.fn, args, kwargs))
        return kernel

    def __len__(self) -> int:
        return len(self._entries)

    def clear(self) -> None:
        self._entries.clear()


def _raw_stream(device: int) -> int:
    return torch._C._cuda_getCurrentRawStream(device)


_runtime_knobs = None


def _hooks_set(fn) -> bool:
    global _runtime_knobs
    if _runtime_knobs is None:
        from triton import knobs

        _runtime_knobs = knobs.runtime
    rt = _runtime_knobs
    return _hook_set(rt.launch_enter_hook) or _hook_set(rt.launch_exit_hook) or bool(fn.pre_run_hooks)


def _hook_set(hook) -> bool:
    # newer Tritons hold a HookChain that is set when it has calls; older ones None or a function
    return hook is not None and (not hasattr(hook, "calls") or bool(hook.calls))


def _triton_key(fn, args: tuple, kwargs: dict):
    """What Triton's own cache key is made of for these arguments: its binder's specialisation and
    options (None where this Triton's internals differ)."""
    try:
        from triton import knobs

        binder = fn.device_caches[torch.cuda.current_device()][-1]
        kw = dict(kwargs)
        kw["debug"] = kw.get("debug", fn.debug) or knobs.runtime.debug
        for name in ("instrumentation_mode", "fpsan_homomorphic_casts"):
            if hasattr(knobs.compilation, name):
                kw[name] = getattr(knobs.compilation, name)
        _, specialization, options = binder(*args, **kw)
        return repr(specialization), repr(sorted(options.items()))
    except Exception:  # noqa: BLE001 - only the check mode reads it
        return None


def _check(fn, entry: _Entry, args: tuple, kwargs: dict) -> None:
    key = _triton_key(fn, args, kwargs)
    if key is None or entry.triton_key is None:
        raise AssertionError(f"launch cache of {fn.__name__}: check mode cannot read Triton's cache key")
    if key != entry.triton_key:
        raise AssertionError(f"launch cache of {fn.__name__}: a hit whose Triton key differs "
                             f"({key!r} != {entry.triton_key!r}); the caller's key misses something")


_wrappers: dict = {}


def fast(fn) -> FastKernel:
    """The FastKernel of a JITFunction, made once: `fast(kernel)[grid](...)` at a launch site
    keeps the module's kernel attribute itself a JITFunction (or whatever a test put there,
    which then runs as it is)."""
    wrapper = _wrappers.get(fn)
    if wrapper is None:
        wrapper = _wrappers[fn] = FastKernel(fn)
    return wrapper
