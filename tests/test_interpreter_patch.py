"""The test harness's interpreter speed-up (interpreter_patch_once.py) changes no result: a kernel
whose loop calls device functions (its own and tl.sum / tl.max) gives the same bits with it and
with Triton's own patching, patches the language far fewer times, and leaves the language as
Triton leaves it."""

import os

import pytest
import torch

import interpreter_patch_once

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1" or not interpreter_patch_once.originals,
                                reason="needs the Triton interpreter with the harness's patch installed")


triton = pytest.importorskip("triton")
tl = triton.language


@triton.jit
def _scaled(x, s):
    return x * s


@triton.jit
def _row_step(x_ptr, out_ptr, n, BLOCK: tl.constexpr, STEPS: tl.constexpr):
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    m = -float("inf")
    for i in range(STEPS):
        x = tl.load(x_ptr + row * n + i * BLOCK + offs, mask=i * BLOCK + offs < n, other=-float("inf"))
        acc += _scaled(tl.where(i * BLOCK + offs < n, x, 0.0), 0.5 + i)
        m = tl.maximum(m, tl.max(x, axis=0))
    tl.store(out_ptr + row, tl.sum(acc, axis=0) + m)


def _run(kernel):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, 97, generator=g)
    out = torch.full((5,), float("nan"))
    kernel[(5,)](x, out, 97, BLOCK=32, STEPS=4)
    return x, out


def test_patch_once_gives_the_same_bits_with_fewer_patches(monkeypatch):
    from triton.runtime import interpreter

    original_patch, original_call = interpreter_patch_once.originals
    calls = []

    def counting(fn):
        calls.append(fn.__name__)
        return original_patch(fn)

    kernel = _row_step
    with monkeypatch.context() as m:
        # Triton's own functions, counted
        m.setattr(interpreter, "_patch_lang", counting)
        m.setattr(interpreter.GridExecutor, "__call__", original_call)
        x, triton_own = _run(kernel)
        triton_own_calls = len(calls)
        calls.clear()
        # the harness's in front of them
        patch_lang, call = interpreter_patch_once.wrap(counting, original_call)
        m.setattr(interpreter, "_patch_lang", patch_lang)
        m.setattr(interpreter.GridExecutor, "__call__", call)
        _, once = _run(kernel)
    ref = (x.view(5, 1, 97)[:, 0, :] * torch.tensor([0.5 + i // 32 for i in range(97)])).sum(1) + x.max(1).values
    torch.testing.assert_close(triton_own, ref, rtol=1e-5, atol=1e-5)
    assert torch.equal(once, triton_own)
    # Triton's own: a patch per launch, per program's call of _scaled, tl.max, tl.sum (5 programs x 4 steps)
    assert triton_own_calls > 40
    # patch once: the launch's patch and the first tl.max (triton.language.core, which the kernel's
    # module does not see)
    assert len(calls) <= 3, calls


def test_language_is_restored_after_a_launch():
    _run(_row_step)
    assert tl.core.is_builtin(tl.program_id) and tl.core.is_builtin(tl.load)
