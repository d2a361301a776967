"""The Triton launch cache (minipaged.triton.launch) on CPU: its key against Triton's own
specialisation, and its bookkeeping against a stand-in JITFunction that records what each
launch receives. The real kernels go through it in the GPU tests (with its check mode on)."""

from __future__ import annotations

import inspect

import pytest
import torch

pytest.importorskip("triton")

from minipaged.triton import launch  # noqa: E402


def _native_class(value):
    from triton._C.libtriton import native_specialize_impl

    try:
        from triton.backends.nvidia.compiler import CUDABackend
    except ImportError:
        pytest.skip("this Triton has no CUDA backend class")
    return native_specialize_impl(CUDABackend, value, False, True, True)


def test_launch_key_is_as_fine_as_triton():
    # two arguments with one launch-cache key must be one Triton specialisation (the reverse may
    # fail: a finer key only costs entries)
    base = torch.empty(64, dtype=torch.float16)
    values = [0, 1, 16, 17, 2 ** 31, 2 ** 63, True, False, 0.5, -3.0, None,
              base, base[1:], base[8:], base[2:], base[16:], torch.empty(64, dtype=torch.bfloat16),
              torch.empty(64, dtype=torch.bfloat16)[3:], torch.empty(3, dtype=torch.int32)]
    seen = {}
    for v in values:
        seen.setdefault(launch.launch_key((v,), {}), set()).add(_native_class(v))
    for key, natives in seen.items():
        assert len(natives) == 1, (key, natives)
    assert len(seen) >= 14  # ints by value; dtypes and both alignments told apart
    # keyword arguments by value, a runtime tensor among them by dtype and alignment
    assert launch.launch_key((), dict(A=1, B="x")) != launch.launch_key((), dict(A=1, B="y"))
    rt = frozenset({"t"})
    assert launch.launch_key((), dict(t=base, A=1), rt) == launch.launch_key((), dict(t=base[8:], A=1), rt)
    assert launch.launch_key((), dict(t=base, A=1), rt) != launch.launch_key((), dict(t=base[1:], A=1), rt)
    assert launch.launch_key((), dict(t=base, A=1), rt) != launch.launch_key((), dict(t=base, A=2), rt)
    with pytest.raises(TypeError):
        launch.launch_key((object(),), {})


class _Param:
    def __init__(self, p: inspect.Parameter):
        self.name = p.name
        self.is_constexpr = "constexpr" in str(p.annotation)


class _Compiled:
    function, packed_metadata = "fn-handle", "meta"

    def __init__(self, log, key):
        self.log, self.key = log, key

    def run(self, g0, g1, g2, stream, function, packed, meta, enter, exit_, *values):
        assert (function, packed, meta, enter, exit_) == ("fn-handle", "meta", None, None, None)
        self.log.append(("hit", self.key, (g0, g1, g2), stream, list(values)))


class _FakeJIT:
    """What FastKernel reads of a JITFunction: fn, params, device_caches, pre_run_hooks and
    fn[grid](...) (Triton's path), which 'compiles' one kernel per constexpr set and logs."""

    def __init__(self, pyfn):
        self.fn = pyfn
        self.__name__ = pyfn.__name__
        self.params = [_Param(p) for p in inspect.signature(pyfn).parameters.values()]
        self.device_caches, self.pre_run_hooks, self.log, self.compiled = {}, [], [], {}

    def __getitem__(self, grid):
        def run(*args, **kwargs):
            bound = inspect.signature(self.fn).bind(*args, **{k: v for k, v in kwargs.items() if k != "num_warps"})
            bound.apply_defaults()
            key = tuple((k, v) for k, v in bound.arguments.items() if k.isupper()) + (kwargs.get("num_warps"),)
            kernel = self.compiled.setdefault(key, _Compiled(self.log, key))
            self.log.append(("triton", key, grid, list(bound.arguments.values())))
            return kernel
        return run


def _kernel(x_ptr, n, scale, flag, y_ptr=None, BLOCK: "tl.constexpr" = 64, MODE: "tl.constexpr" = 0):  # noqa: F821
    pass


@pytest.fixture
def fake(monkeypatch):
    monkeypatch.setattr(launch, "ENABLED", True)
    monkeypatch.setattr(launch, "CHECK", False)
    monkeypatch.setattr(launch, "_raw_stream", lambda device: 77)
    monkeypatch.setattr(launch, "_runtime_knobs", None)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    fn = _FakeJIT(_kernel)
    return fn, launch.FastKernel(fn)


def test_hit_passes_the_new_arguments_in_signature_order(fake):
    fn, fk = fake
    x, y = torch.randn(32), torch.randn(32)
    fk[(4,)](x, 48, 0.5, True, y_ptr=y, BLOCK=128, num_warps=4)
    assert [e[0] for e in fn.log] == ["triton"]
    x2, y2 = torch.randn(64), torch.randn(64)
    fk[(7, 2)](x2, 48, 0.25, False, y_ptr=y2, BLOCK=128, num_warps=4)
    kind, key, grid, stream, values = fn.log[-1]
    assert kind == "hit" and grid == (7, 2, 1) and stream == 77
    assert values[0] is x2 and values[1:4] == [48, 0.25, False] and values[4] is y2 and values[5:] == [128, 0]
    assert len(fn.log) == 2


@pytest.mark.parametrize("change", ["constexpr", "option", "int", "dtype", "alignment", "none"])
def test_a_new_specialisation_goes_through_triton(fake, change):
    fn, fk = fake
    base = torch.randn(64)
    args = dict(x=base, n=48, kw=dict(y_ptr=base, BLOCK=128, num_warps=4))
    fk[(1,)](args["x"], args["n"], 0.5, True, **args["kw"])
    fk[(1,)](args["x"], args["n"], 0.5, True, **args["kw"])
    assert [e[0] for e in fn.log] == ["triton", "hit"]
    x, n, kw = base, 48, dict(args["kw"])
    if change == "constexpr":
        kw["MODE"] = 1
    elif change == "option":
        kw["num_warps"] = 8
    elif change == "int":
        n = 47
    elif change == "dtype":
        x = base.to(torch.float16)
    elif change == "alignment":
        x = base[1:]
    else:
        kw["y_ptr"] = None
    fk[(1,)](x, n, 0.5, True, **kw)
    assert fn.log[-1][0] == "triton"
    fk[(1,)](x, n, 0.5, True, **kw)
    assert fn.log[-1][0] == "hit" and fn.log[-1][4][0] is x


def test_what_it_does_not_handle_goes_through_triton(fake, monkeypatch):
    fn, fk = fake
    x = torch.randn(8)
    for _ in range(2):
        fk[(1,)](x, object(), 0.5, True)          # an argument of another type
        fk[lambda meta: (1,)](x, 3, 0.5, True)    # a callable grid
    fk[(1,)](x, 3, 0.5, True, None, 64)           # a constexpr given by position: never cached
    fk[(1,)](x, 3, 0.5, True, None, 64)
    monkeypatch.setattr(launch, "ENABLED", False)
    fk[(1,)](x, 3, 0.5, True)
    fk[(1,)](x, 3, 0.5, True)
    assert [e[0] for e in fn.log] == ["triton"] * 8


def test_fast_keeps_what_is_not_a_jit_function():
    class Stand:
        calls = 0

        def __getitem__(self, grid):
            def call(*a, **k):
                Stand.calls += 1
            return call

    s = Stand()
    launch.fast(s)[(1,)](1, 2, X=3)
    assert Stand.calls == 1 and launch.fast(s) is launch.fast(s)


def test_interpreted_kernels_go_through_triton(monkeypatch):
    # under the interpreter a kernel is an InterpretedFunction, without the compiled caches
    import triton.language as tl

    from minipaged.triton import configs

    if not configs.interpreting():
        pytest.skip("interpreter only")
    from minipaged.triton.merge import _merge_kernel

    assert not launch.FastKernel(_merge_kernel)._usable
    a = torch.randn(5, 3, 16)
    lse = torch.randn(5, 3)
    out, out_lse = __import__("minipaged.triton.ops", fromlist=["ops"]).merge_attention_states(a, lse, a, lse)
    torch.testing.assert_close(out, a)
    torch.testing.assert_close(out_lse, lse + torch.log(torch.tensor(2.0)))
    assert tl is not None


def test_gluon_descriptors_validated_once_per_shape():
    from minipaged.triton import prefill_gluon

    if not prefill_gluon._HAVE_GLUON:
        pytest.skip("this Triton has no Gluon")
    cache = torch.randn(8, 16, 2, 64, dtype=torch.bfloat16)
    other = torch.randn_like(cache)
    shape, strides = [8 * 16, 2 * 64], [2 * 64, 1]
    prefill_gluon._descriptor_fields.clear()
    first = prefill_gluon._descriptor(cache, shape, strides, [16, 64])
    again = prefill_gluon._descriptor(other, shape, strides, [16, 64])
    full = prefill_gluon.TensorDescriptor(other, shape, strides, [16, 64], prefill_gluon._layout())
    assert type(again) is type(full) and again.base is other and first.base is cache
    assert {k: v for k, v in vars(again).items() if k != "base"} == {k: v for k, v in vars(full).items() if k != "base"}
    assert len(prefill_gluon._descriptor_fields) == 1
    # another shape or block is validated (and keyed) on its own
    prefill_gluon._descriptor(cache[1:], [7 * 16, 2 * 64], strides, [16, 64])
    prefill_gluon._descriptor(cache, shape, strides, [8, 64])
    assert len(prefill_gluon._descriptor_fields) == 3


def test_entries_keep_no_argument_alive(fake):
    import gc
    import weakref

    fn, fk = fake
    x, y = torch.randn(32), torch.randn(32)
    refs = [weakref.ref(x), weakref.ref(y)]
    fk[(1,)](x, 48, 0.5, True, y_ptr=y, BLOCK=128)
    fn.log.clear()  # the stand-in's own log holds the call's arguments
    del x, y
    gc.collect()
    assert all(r() is None for r in refs)
    x2, y2 = torch.randn(32), torch.randn(32)
    fk[(1,)](x2, 48, 0.5, True, y_ptr=y2, BLOCK=128)
    assert fn.log[-1][0] == "hit" and fn.log[-1][4][0] is x2 and fn.log[-1][4][4] is y2


def test_a_tensor_never_shares_a_key_with_an_int():
    t = torch.empty(8, dtype=torch.float16)
    tensor_key = launch.launch_key((t,), {})[0]
    assert launch.launch_key((int(tensor_key),), {}) != launch.launch_key((t,), {})
    assert launch.launch_key((int(tensor_key) + 1,), {}) != launch.launch_key((t,), {})


class _Flaky:
    """fn[grid](...) whose first `failures` calls raise `error` (as Triton's compile does when an
    MLIR pass fails), then returns "kernel"; counts every call."""

    def __init__(self, failures: int, error: str = "PassManager::run failed"):
        self.failures, self.error, self.calls = failures, error, 0
        self.__name__ = "_flaky_kernel"

    def __getitem__(self, grid):
        def run(*args, **kwargs):
            self.calls += 1
            if self.calls <= self.failures:
                raise RuntimeError(self.error)
            return "kernel"
        return run


@pytest.mark.parametrize("failures", [1, launch.COMPILE_RETRIES])
def test_a_failed_compile_pass_is_compiled_again(failures):
    fn = _Flaky(failures)
    with pytest.warns(RuntimeWarning, match="_flaky_kernel.*PassManager::run failed.*compiling it again") as rec:
        assert launch.fast(fn)[(1,)](1, X=2) == "kernel"
    assert fn.calls == failures + 1
    assert len([w for w in rec if issubclass(w.category, RuntimeWarning)]) == failures


def test_a_compile_that_keeps_failing_raises():
    fn = _Flaky(launch.COMPILE_RETRIES + 1)
    with pytest.warns(RuntimeWarning), pytest.raises(RuntimeError, match="PassManager::run failed"):
        launch.call_triton(fn, (1,), (), {})
    assert fn.calls == launch.COMPILE_RETRIES + 1


def test_other_errors_are_not_retried(recwarn):
    fn = _Flaky(1, error="out of resource: shared memory")
    with pytest.raises(RuntimeError, match="out of resource"):
        launch.call_triton(fn, (1,), (), {})
    assert fn.calls == 1 and not recwarn.list


def test_a_cache_miss_retries_the_compile_and_caches_the_kernel(fake, monkeypatch):
    fn, fk = fake
    real = fn.__getitem__
    failed = []

    def flaky_getitem(grid):
        run = real(grid)

        def once(*args, **kwargs):
            if not failed:
                failed.append(True)
                raise RuntimeError("PassManager::run failed")
            return run(*args, **kwargs)
        return once

    monkeypatch.setattr(type(fn), "__getitem__", lambda self, grid: flaky_getitem(grid))
    x = torch.randn(16)
    with pytest.warns(RuntimeWarning, match="_kernel"):
        fk[(2,)](x, 16, 0.5, True, BLOCK=64)
    fk[(2,)](x, 16, 0.5, True, BLOCK=64)
    assert failed and [e[0] for e in fn.log] == ["triton", "hit"]
