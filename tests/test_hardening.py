"""Contract violations found by outside testing (issue #11): each test fails on the old code.

Bad input must raise TypeError/ValueError naming the argument, the value and the
rule, before anything runs; nothing may reach a kernel (or torch.multinomial on
CUDA, where it becomes a device-side assert that kills the context).
"""

import math
import os

import pytest
import torch

import minipaged as mp
from minipaged import registry
from minipaged.engine import Engine
from minipaged.engine.sampler import sample

TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=64, vocab_size=97, max_position_embeddings=256)


def _backends_cpu():
    names = ["torch"]
    if registry.all_backends()["triton"].is_available("cpu")[0]:
        names.append("triton")
    return names


# ------------------------------------------------------------------ 1. head dim 0


@pytest.mark.parametrize("backend", _backends_cpu())
@pytest.mark.parametrize("B", [0, 1])
def test_head_dim_zero_is_the_head_dim_error(backend, B):
    q = torch.randn(B, 2, 3, 0)
    with pytest.raises(ValueError, match="head dim D=0"):
        mp.prefill_attention(q, q, q, backend=backend)
    qv = torch.randn(3 * B, 2, 0)
    cu = torch.tensor([0, 3 * B], dtype=torch.int32)
    with pytest.raises(ValueError, match="head dim D=0"):
        mp.prefill_attention_varlen(qv, qv, qv, cu, cu, backend=backend)
    kc = torch.randn(2, 4, 2, 0)
    with pytest.raises(ValueError, match="head dim D=0"):
        mp.decode_attention(torch.randn(B, 2, 0), kc, kc, torch.zeros(B, 1, dtype=torch.int32),
                            torch.zeros(B, dtype=torch.int32), backend=backend)
    with pytest.raises(ValueError, match="head dim D=0"):
        mp.paged_attention(qv, kc, kc, torch.zeros(1, 1, dtype=torch.int32), cu,
                           torch.full((1,), 3 * B, dtype=torch.int32), backend=backend)


# ------------------------------------------------------------------ 2. sampling arguments


@pytest.fixture(scope="module")
def tiny_engine():
    return Engine(TINY, dtype=torch.float32, device="cpu", backend="torch", num_blocks=64, max_num_seqs=4)


@pytest.mark.parametrize("kw, exc", [
    (dict(temperature=float("nan")), ValueError),
    (dict(temperature=float("inf")), ValueError),
    (dict(temperature=-1.0), ValueError),
    (dict(temperature="0.5"), TypeError),
    (dict(top_p=float("nan")), ValueError),
    (dict(top_p=0.0), ValueError),
    (dict(top_p=1.5), ValueError),
    (dict(top_p=float("inf")), ValueError),
    (dict(top_k=-1), ValueError),
    (dict(top_k=2.0), TypeError),
    (dict(top_k=True), TypeError),
    (dict(top_k="20"), TypeError),
    (dict(top_k=None), TypeError),
])
def test_generate_rejects_bad_sampling_before_running(tiny_engine, kw, exc, monkeypatch):
    ran = []
    monkeypatch.setattr(tiny_engine.runner, "run", lambda *a, **k: ran.append(1))
    with pytest.raises(exc, match="temperature|top_p|top_k"):
        tiny_engine.generate([[1, 2, 3]], max_new_tokens=2, **kw)
    assert not ran, "the model ran before the bad argument was rejected"
    assert tiny_engine.cache.num_free_blocks == tiny_engine.cache.num_blocks


def test_sampler_rejects_nan_temperature_and_survives_tiny_ones():
    logits = torch.randn(3, 11)
    with pytest.raises(ValueError, match="temperature"):
        sample(logits, temperature=float("nan"))
    # a tiny temperature must not overflow to NaN probabilities (multinomial would assert on CUDA)
    g = torch.Generator().manual_seed(0)
    out = sample(logits, temperature=1e-300, top_p=0.9, generator=g)
    assert torch.equal(out, logits.argmax(-1))


@pytest.mark.parametrize("prompt, exc", [
    ([[1, 1.7]], TypeError),
    ([[1, True]], TypeError),
    ([[1, "2"]], TypeError),
    ([[1, 97]], ValueError),
    ([[-1]], ValueError),
    ([1, 2], TypeError),
])
def test_generate_rejects_bad_token_ids(tiny_engine, prompt, exc):
    with pytest.raises(exc, match="prompt|token"):
        tiny_engine.generate(prompt, max_new_tokens=1)
    assert tiny_engine.cache.num_free_blocks == tiny_engine.cache.num_blocks


def test_generate_reads_prompts_from_any_iterable(tiny_engine):
    """A generator of prompts is read once: its prompts are generated, not silently dropped."""
    want = tiny_engine.generate([[1, 2, 3], [4, 5]], max_new_tokens=2)
    assert len(want) == 2 and all(len(o) == 2 for o in want)
    assert tiny_engine.generate((p for p in [[1, 2, 3], [4, 5]]), max_new_tokens=2) == want
    assert tiny_engine.generate(iter([[1, 2, 3], [4, 5]]), max_new_tokens=2) == want


@pytest.mark.parametrize("stop", [5, "5", 2.0])
def test_generate_rejects_a_stop_token_that_is_not_a_list(tiny_engine, stop):
    with pytest.raises(TypeError, match="stop_token_ids"):
        tiny_engine.generate([[1, 2, 3]], max_new_tokens=2, stop_token_ids=stop)
    assert tiny_engine.cache.num_free_blocks == tiny_engine.cache.num_blocks


@pytest.mark.parametrize("flag, value", [("ignore_eos", "no"), ("ignore_eos", 1), ("progress", "yes"),
                                         ("return_stats", None)])
def test_generate_flags_must_be_bools(tiny_engine, flag, value):
    # a truthy string would have turned the flag on: ignore_eos="no" generated past EOS
    with pytest.raises(TypeError, match=flag):
        tiny_engine.generate([[1, 2, 3]], max_new_tokens=2, **{flag: value})
    assert tiny_engine.cache.num_free_blocks == tiny_engine.cache.num_blocks


@pytest.mark.parametrize("kw, exc, words", [
    (dict(seed="x"), TypeError, "seed"),
    (dict(seed=1.5), TypeError, "seed"),
    (dict(seed=None), TypeError, "seed"),
    (dict(max_model_len=TINY["max_position_embeddings"] + 1), ValueError, "max_model_len"),
])
def test_engine_rejects_bad_arguments_by_name(kw, exc, words):
    with pytest.raises(exc, match=words):
        Engine(TINY, dtype=torch.float32, device="cpu", backend="torch", num_blocks=8, **kw)


def test_engine_max_num_batched_tokens_none_is_the_default():
    eng = Engine(TINY, dtype=torch.float32, device="cpu", backend="torch", num_blocks=16,
                 max_num_batched_tokens=None)
    assert eng.max_num_batched_tokens == 8192
    assert len(eng.generate([[1, 2, 3]], max_new_tokens=2)[0]) == 2


def test_generate_accepts_numpy_and_tensor_ints(tiny_engine):
    import numpy as np

    a = tiny_engine.generate([[1, 2, 3]], max_new_tokens=2)
    b = tiny_engine.generate([list(np.array([1, 2, 3]))], max_new_tokens=2)
    c = tiny_engine.generate([torch.tensor([1, 2, 3])], max_new_tokens=2)
    assert a == b == c


# ------------------------------------------------------------------ 3. engine construction


@pytest.mark.parametrize("kw, match", [
    (dict(block_size=0), "block_size"),
    (dict(block_size=0, num_blocks=8), "block_size"),
    (dict(block_size=3), "block_size"),
    (dict(block_size=True), "block_size"),
    (dict(max_num_seqs=0), "max_num_seqs"),
    (dict(num_blocks=0), "num_blocks"),
    (dict(max_model_len=-4), "max_model_len"),
    (dict(max_num_batched_tokens=0), "max_num_batched_tokens"),
    (dict(device="foo"), "device"),
    (dict(gpu_memory_fraction=0.0), "gpu_memory_fraction"),
])
def test_engine_validates_before_building(kw, match):
    with pytest.raises(ValueError, match=match):
        Engine(TINY, dtype=torch.float32, backend="torch", **{"device": "cpu", **kw})


@pytest.mark.skipif(torch.cuda.is_available(), reason="the no-GPU path")
def test_engine_cuda_without_gpu_is_a_value_error():
    with pytest.raises(ValueError, match="no CUDA device"):
        Engine(TINY, device="cuda")


# ------------------------------------------------------------------ 4. bf16 under the interpreter


@pytest.mark.skipif(not registry.all_backends()["triton"].is_available("cpu")[0],
                    reason="needs TRITON_INTERPRET=1 on a machine without a GPU")
def test_triton_refuses_bf16_under_the_interpreter():
    q = torch.randn(1, 2, 5, 64, dtype=torch.bfloat16)
    with pytest.raises(TypeError, match="interpreter"):
        mp.prefill_attention(q, q, q, backend="triton")
    kc = torch.randn(2, 4, 2, 64, dtype=torch.bfloat16)
    with pytest.raises(TypeError, match="interpreter"):
        mp.decode_attention(torch.randn(1, 2, 64, dtype=torch.bfloat16), kc, kc,
                            torch.zeros(1, 1, dtype=torch.int32), torch.ones(1, dtype=torch.int32), backend="triton")
    dtypes, why = registry.all_backends()["triton"].supported_dtypes("cpu")
    assert "bfloat16" not in dtypes and "interpreter" in why
    # fp16 still runs
    mp.prefill_attention(q.half(), q.half(), q.half(), backend="triton")


# ------------------------------------------------------------------ 5. PagedKVCache arguments


@pytest.mark.parametrize("kw, exc, match", [
    (dict(dtype=torch.int32), TypeError, "dtype"),
    (dict(dtype=torch.float64), TypeError, "dtype"),
    (dict(dtype="float16"), TypeError, "dtype"),
    (dict(head_dim=96), ValueError, "head_dim"),
    (dict(num_blocks=True), ValueError, "num_blocks"),
    (dict(num_blocks=2.0), ValueError, "num_blocks"),
    (dict(block_size=0), ValueError, "block_size"),
    (dict(device="foo"), ValueError, "device"),
])
def test_paged_cache_validates(kw, exc, match):
    args = {"num_blocks": 4, **kw}
    with pytest.raises(exc, match=match):
        mp.PagedKVCache(1, 2, args.pop("head_dim", 64), **args)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the no-GPU path")
def test_paged_cache_cuda_without_gpu_is_a_value_error():
    with pytest.raises(ValueError, match="no CUDA device"):
        mp.PagedKVCache(1, 2, 64, num_blocks=4, device="cuda")


# ------------------------------------------------------------------ 6. check_values is a bool


@pytest.mark.parametrize("flag", ["no", 0, 1, None])
def test_check_values_must_be_bool(flag):
    q = torch.randn(2, 4, 64)
    kc = torch.randn(4, 4, 2, 64)
    tables = torch.tensor([[0], [1]], dtype=torch.int32)
    lens = torch.tensor([3, 4], dtype=torch.int32)
    cu = torch.tensor([0, 1, 2], dtype=torch.int32)
    with pytest.raises(TypeError, match="check_values"):
        mp.decode_attention(q, kc, kc, tables, lens, check_values=flag)
    with pytest.raises(TypeError, match="check_values"):
        mp.prefill_attention_varlen(q, q, q, cu, cu, check_values=flag)
    with pytest.raises(TypeError, match="check_values"):
        mp.paged_attention(q, kc, kc, tables, cu, lens, check_values=flag)
    with pytest.raises(TypeError, match="check_values"):
        mp.write_kv_cache(q[:, :2], q[:, :2], kc, kc, torch.tensor([0, 1]), check_values=flag)


# ------------------------------------------------------------------ registry caching


def test_resolve_is_memoised_and_follows_the_environment(monkeypatch):
    registry.reset_caches()
    calls = []
    b = registry.all_backends()["torch"]
    real = b.availability

    monkeypatch.setattr(registry, "_BACKENDS", dict(registry._BACKENDS))
    import dataclasses

    registry._BACKENDS["torch"] = dataclasses.replace(b, availability=lambda d: (calls.append(d), real(d))[1])
    try:
        for _ in range(5):
            assert registry.resolve("decode", "cpu").name == "torch"
        assert calls == ["cpu"], "availability must be probed once per device"
        monkeypatch.setenv("MINIPAGED_DECODE_BACKEND", "bogus")
        with pytest.raises(ValueError, match="MINIPAGED_DECODE_BACKEND"):
            registry.resolve("decode", "cpu")
        with pytest.raises(ValueError, match="MINIPAGED_DECODE_BACKEND"):
            registry.resolve("paged", "cpu")
        assert registry.resolve("prefill", "cpu").name == "torch"
    finally:
        registry.reset_caches()


def test_engine_bind_resolves_once():
    ops = registry.bind("torch", "cpu")
    assert ops.backends == {"prefill_varlen": "torch", "decode": "torch", "paged": "torch", "write_kv_cache": "torch"}
    from minipaged import reference

    assert ops.paged is reference.paged


# ------------------------------------------------------------------ GPU: bad input never costs the context


@pytest.mark.gpu
def test_bad_inputs_on_cuda_leave_the_context_usable():
    """Feed every bad input of issue #11 to the engine and the ops on CUDA; afterwards a decode
    must still run and be correct (a device-side assert would make every later call fail)."""
    dev = "cuda"
    eng = Engine(TINY, dtype=torch.bfloat16, device=dev, num_blocks=64, max_num_seqs=4)
    for kw in (dict(temperature=float("nan")), dict(temperature=float("inf")), dict(top_p=float("nan")),
               dict(top_p=2.0), dict(temperature=-1.0)):
        with pytest.raises((ValueError, TypeError)):
            eng.generate([[1, 2, 3]], max_new_tokens=2, **kw)
    for prompt in ([[1, 1.7]], [[1, 97]], [[-1]]):
        with pytest.raises((ValueError, TypeError)):
            eng.generate(prompt, max_new_tokens=2)
    q = torch.randn(2, 4, 64, device=dev, dtype=torch.bfloat16)
    kc = torch.randn(8, 16, 2, 64, device=dev, dtype=torch.bfloat16)
    tables = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32, device=dev)
    lens = torch.tensor([20, 31], dtype=torch.int32, device=dev)
    cu = torch.tensor([0, 1, 2], dtype=torch.int32, device=dev)
    for backend in ("cuda", "triton"):
        if not registry.all_backends()[backend].is_available("cuda")[0]:
            continue
        bad_tables = tables.clone()
        bad_tables[1, 1] = 1000
        with pytest.raises(ValueError):
            mp.decode_attention(q, kc, kc, bad_tables, lens, backend=backend)
        with pytest.raises(ValueError):
            mp.paged_attention(q, kc, kc, bad_tables, cu, lens, backend=backend)
        with pytest.raises(ValueError):
            mp.decode_attention(q, kc, kc, tables, torch.tensor([20, 999], dtype=torch.int32, device=dev),
                                backend=backend)
        with pytest.raises(ValueError):
            mp.write_kv_cache(q, q, kc, kc, torch.tensor([0, 10**6], device=dev), backend=backend)
        with pytest.raises(ValueError, match="head dim"):
            mp.decode_attention(q[..., :0], kc[..., :0], kc[..., :0], tables, lens, backend=backend)
        out = mp.decode_attention(q, kc, kc, tables, lens, backend=backend)
        ref = mp.decode_attention(q.float(), kc.float(), kc.float(), tables, lens, backend="torch")
        assert (out.float() - ref).abs().max().item() < 3e-2
    torch.cuda.synchronize()
    assert len(eng.generate([[1, 2, 3], [4, 5]], max_new_tokens=4)) == 2


def test_validated_fast_path_never_skips_a_rule():
    """decode/paged with check_values=False remember metadata that passed the checks; a later call
    that differs in any checked fact (dtype, device, shape, a bool given as an int, layout) must
    still be checked."""
    q = torch.randn(2, 4, 64)
    kc = torch.randn(4, 4, 2, 64)
    tables = torch.tensor([[0], [1]], dtype=torch.int32)
    lens = torch.tensor([3, 4], dtype=torch.int32)
    cu = torch.tensor([0, 1, 2], dtype=torch.int32)
    good = mp.decode_attention(q, kc, kc, tables, lens, check_values=False)
    assert torch.equal(mp.decode_attention(q, kc, kc, tables, lens, check_values=False), good)
    with pytest.raises(TypeError, match="return_lse"):
        mp.decode_attention(q, kc, kc, tables, lens, check_values=False, return_lse=1)
    with pytest.raises(TypeError, match="scale"):
        mp.decode_attention(q, kc, kc, tables, lens, check_values=False, scale=True)
    with pytest.raises(TypeError, match="k_cache"):
        mp.decode_attention(q, kc.half(), kc, tables, lens, check_values=False)
    with pytest.raises(ValueError, match="device"):
        mp.decode_attention(q, kc, kc, tables.to("meta"), lens, check_values=False)
    strided = torch.randn(2, 4, 128)[..., ::2]
    torch.testing.assert_close(mp.decode_attention(strided, kc, kc, tables, lens, check_values=False),
                               mp.decode_attention(strided.contiguous(), kc, kc, tables, lens))
    mp.paged_attention(q, kc, kc, tables, cu, lens, max_seqlen_q=1, check_values=False)
    with pytest.raises(TypeError, match="causal"):
        mp.paged_attention(q, kc, kc, tables, cu, lens, max_seqlen_q=1, causal=1, check_values=False)
    with pytest.raises(ValueError, match="max_seqlen_q"):
        mp.paged_attention(q, kc, kc, tables, cu, lens, max_seqlen_q=-1, check_values=False)


@pytest.mark.parametrize("interpret", ["1", "0"])
def test_info_lists_paged_and_the_interpreter_dtypes(interpret):
    import subprocess
    import sys

    env = dict(os.environ, TRITON_INTERPRET=interpret, MINIPAGED_DECODE_BACKEND="torch")
    out = subprocess.run([sys.executable, "-m", "minipaged.cli", "info"], capture_output=True, text=True,
                         env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    device = "cuda" if torch.cuda.is_available() else "cpu"  # the device `info` resolves for
    assert f"paged         : torch on {device} (from MINIPAGED_DECODE_BACKEND=torch)" in out.stdout
    triton_cpu = next(line for line in out.stdout.splitlines() if line.startswith("triton") and " cpu " in line)
    dtypes = triton_cpu.split("64,128")[0]
    assert "float16, float32" in dtypes and "bfloat16" not in dtypes, triton_cpu
    if interpret == "1":
        assert "bfloat16" in triton_cpu.split("64,128")[1], "the reason for the missing bf16 is printed"


def test_kernel_ready_copies_misaligned_contiguous_views():
    """A contiguous view that starts 2 bytes off a 16-byte boundary: `.contiguous()` would hand the
    GPU kernels the same misaligned pointer; the API gives them an aligned copy with equal values,
    and leaves aligned tensors (and the torch backend's inputs) alone."""
    from types import SimpleNamespace

    from minipaged import api

    gpu, oracle = SimpleNamespace(name="cuda"), SimpleNamespace(name="torch")
    base = torch.randn(8 * 64 + 1, dtype=torch.float16)
    view = base[1:].view(2, 4, 64)
    assert view.is_contiguous() and view.data_ptr() % 16 != 0
    for fix in (api._kernel_ready, api._cache_ready):
        out = fix(gpu, view)
        assert out.data_ptr() % 16 == 0 and out.is_contiguous() and torch.equal(out, view)
        aligned = base[:-1].view(2, 4, 64)
        assert fix(gpu, aligned).data_ptr() == aligned.data_ptr()
    assert api._kernel_ready(oracle, view).data_ptr() == view.data_ptr()
    # the metadata fast path must not skip the copy either
    assert not api._layout_ok(view, ()) and not api._layout_ok(base[:-1].view(2, 4, 64), (view,))


# ------------------------------------------------------------------ write_kv_cache into cache views
# (a conformance audit against DESIGN.md: "Inputs may be non-contiguous"; the GPU backends used
# to refuse any non-contiguous cache)


def _check_write_into_views(backend, device, dtype):
    # Caches that are views: the K and V halves of one [nb, bs, 2, Hkv, D] tensor (last dim
    # stride 1, written in place by every kernel) and every other element of a wider last dim
    # (stride 2: written through a contiguous copy). Both must hold exactly what torch writes
    # into plain caches, and nothing else may change (NaN elsewhere stays NaN).
    g = torch.Generator().manual_seed(3)
    k = torch.randn(5, 2, 64, generator=g).to(device, dtype)
    v = torch.randn(5, 2, 64, generator=g).to(device, dtype)
    slots = torch.tensor([0, 7, -1, 13, 30], dtype=torch.int32, device=device)
    want_k = torch.full((8, 4, 2, 64), float("nan"), dtype=dtype, device=device)
    want_v = want_k.clone()
    mp.write_kv_cache(k, v, want_k, want_v, slots, backend="torch")
    kv = torch.full((8, 4, 2, 2, 64), float("nan"), dtype=dtype, device=device)
    wide = torch.full((2, 8, 4, 2, 128), float("nan"), dtype=dtype, device=device)
    for kc, vc in ((kv[:, :, 0], kv[:, :, 1]), (wide[0, ..., ::2], wide[1, ..., ::2])):
        assert not kc.is_contiguous()
        mp.write_kv_cache(k, v, kc, vc, slots, backend=backend)
        torch.testing.assert_close(kc, want_k, rtol=0, atol=0, equal_nan=True)
        torch.testing.assert_close(vc, want_v, rtol=0, atol=0, equal_nan=True)
    assert torch.isnan(wide[..., 1::2]).all(), "the elements between the strided cache's must stay NaN"


@pytest.mark.parametrize("backend", _backends_cpu())
def test_write_kv_cache_into_views(backend):
    _check_write_into_views(backend, "cpu", torch.float16 if backend == "triton" else torch.float32)


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["triton", "cuda", "cuda-wmma"])
def test_write_kv_cache_into_views_gpu(backend):
    if not torch.cuda.is_available() or not registry.all_backends()[backend].is_available("cuda")[0]:
        pytest.skip(f"{backend} unavailable on cuda")
    _check_write_into_views(backend, "cuda", torch.bfloat16)


# ------------------------------------------------------------------ findings of an API fuzzer


def _fp8_decode_problem():
    torch.manual_seed(0)
    q = torch.randn(1, 4, 64, dtype=torch.float16)
    kc = torch.randn(2, 4, 2, 64).to(torch.float8_e4m3fn)
    vc = torch.randn(2, 4, 2, 64).to(torch.float8_e4m3fn)
    return q, kc, vc, torch.tensor([[0, 1]], dtype=torch.int32), torch.tensor([7], dtype=torch.int32)


@pytest.mark.parametrize("backend", _backends_cpu())
@pytest.mark.parametrize("op", ["decode", "paged"])
def test_fast_path_reads_a_copied_scale_afresh(backend, op):
    # check_values=False remembers a validated call; a scale tensor the API had to copy (a
    # non-contiguous [Hkv] view) used to be remembered too, so an in-place update of the
    # caller's tensor was ignored (the output 4x too small here)
    q, kc, vc, bt, cl = _fp8_decode_problem()
    v_scale = torch.ones(4)[::2]
    cu = torch.tensor([0, 1], dtype=torch.int32)

    def call(check):
        if op == "decode":
            return mp.decode_attention(q, kc, vc, bt, cl, v_scale=v_scale, backend=backend, check_values=check)
        return mp.paged_attention(q, kc, vc, bt, cu, cl, max_seqlen_q=1, v_scale=v_scale, backend=backend,
                                  check_values=check)

    first = call(False)
    v_scale.mul_(4.0)
    again = call(False)
    torch.testing.assert_close(again, call(True), rtol=0, atol=0)
    torch.testing.assert_close(again.float(), 4 * first.float(), rtol=2e-3, atol=2e-3)


@pytest.mark.parametrize("backend", _backends_cpu())
def test_oversized_max_seqlen_bounds_are_harmless(backend):
    # a bound far past the packed totals used to size the triton grid from it (a hang at 2**20,
    # an OverflowError at 2**63 and 2**64)
    g = torch.Generator().manual_seed(5)
    q = torch.randn(9, 4, 64, generator=g).half()
    k, v = torch.randn(13, 2, 64, generator=g).half(), torch.randn(13, 2, 64, generator=g).half()
    cu_q = torch.tensor([0, 4, 9], dtype=torch.int32)
    cu_k = torch.tensor([0, 6, 13], dtype=torch.int32)
    want = mp.prefill_attention_varlen(q, k, v, cu_q, cu_k, backend=backend)
    for bound in (2**20, 2**64):
        got = mp.prefill_attention_varlen(q, k, v, cu_q, cu_k, max_seqlen_q=bound, max_seqlen_k=bound,
                                          backend=backend)
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    qd, kc, vc, bt, cl = _fp8_decode_problem()
    kc, vc = kc.half(), vc.half()
    cu = torch.tensor([0, 1], dtype=torch.int32)
    want = mp.paged_attention(qd, kc, vc, bt, cu, cl, backend=backend)
    for check in (True, False):
        got = mp.paged_attention(qd, kc, vc, bt, cu, cl, max_seqlen_q=2**64, backend=backend, check_values=check)
        torch.testing.assert_close(got, want, rtol=0, atol=0)


@pytest.mark.parametrize("call, words", [
    (lambda: mp.prefill_attention(*_qkv(), scale=1e300), "scale"),
    (lambda: mp.prefill_attention(*_qkv(), scale=10**400), "scale"),
    (lambda: mp.prefill_attention(*_qkv(), scale=1e-46), "scale"),
    (lambda: mp.decode_attention(*_fp8_decode_problem(), k_scale=1e39), "k_scale"),
    (lambda: mp.decode_attention(*_fp8_decode_problem(), v_scale=10**400), "v_scale"),
    (lambda: mp.PagedKVCache(1, 2, 64, num_blocks=2, dtype=torch.float8_e4m3fn, k_scale=1e39), "k_scale"),
])
def test_scales_outside_float32_are_value_errors(call, words):
    # they escaped as OverflowError / RuntimeError, or (softmax scale 1e300) gave NaN
    with pytest.raises(ValueError, match=words):
        call()


def _qkv():
    return torch.randn(1, 4, 5, 64), torch.randn(1, 2, 5, 64), torch.randn(1, 2, 5, 64)


@pytest.mark.parametrize("backend", _backends_cpu())
def test_write_kv_cache_refuses_zero_kv_heads_and_grad_caches(backend):
    k = torch.randn(3, 0, 64).half()
    kc = torch.zeros(2, 4, 0, 64).half()
    with pytest.raises(ValueError, match="at least one KV head"):
        mp.write_kv_cache(k, k, kc, kc.clone(), torch.tensor([0, 1, 2]), backend=backend)
    k = torch.randn(3, 2, 64).half()
    kc = torch.zeros(2, 4, 2, 64).half().requires_grad_()
    with pytest.raises(ValueError, match="k_cache requires grad"):
        mp.write_kv_cache(k, k, kc, torch.zeros(2, 4, 2, 64).half(), torch.tensor([0, 1, 2]), backend=backend)


def test_merge_without_output_elements_still_merges_lse():
    lse_a, lse_b = torch.zeros(2, 3), torch.zeros(2, 3)
    o, lse = mp.merge_attention_states(torch.empty(2, 3, 0), lse_a, torch.empty(2, 3, 0), lse_b)
    assert o.shape == (2, 3, 0)
    torch.testing.assert_close(lse, torch.full((2, 3), math.log(2.0)))
    # the backend name is spelled as the other ops take it
    o, _ = mp.merge_attention_states(torch.ones(2, 3, 4), lse_a, torch.ones(2, 3, 4), lse_b, backend=" TORCH ")
    assert (o == 1).all()


def test_meta_tensors_and_non_str_backend_names():
    q, k, v = (t.to("meta") for t in _qkv())
    with pytest.raises(ValueError, match="meta"):
        mp.prefill_attention(q, k, v)
    for bad in (1, None):
        with pytest.raises(TypeError, match="must be a str"):
            with mp.use_backend(bad):
                pass
    with pytest.raises(TypeError, match="must be a str"):
        mp.get_backend(1)


def test_paged_kv_cache_argument_ranges():
    with pytest.raises(ValueError, match="num_blocks must be at most"):
        mp.PagedKVCache(1, 1, 64, num_blocks=2**40)
    with pytest.raises(ValueError, match="more elements than torch can address"):
        mp.PagedKVCache(2**62, 1, 64, num_blocks=4)
    c = mp.PagedKVCache(1, 1, 64, num_blocks=4, block_size=2)
    c.allocate("a", 3)
    for pad in (1.5, 2**40, True):
        with pytest.raises(ValueError, match="pad must be an int32"):
            c.block_tables(pad=pad)
    for block in (-1, 4, 0.0):
        with pytest.raises(ValueError, match="block must be an int"):
            c.ref_count(block)
        with pytest.raises(ValueError, match="block must be an int"):
            c.is_cached(block)
    with pytest.raises(ValueError, match="token ids must fit in int64"):
        c.block_hashes([2**63] * 4)

