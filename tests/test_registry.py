"""Backend selection: precedence, env vars, errors, and a light import."""

import importlib.util
import os
import subprocess
import sys

import pytest
import torch

import minipaged as mp
from minipaged import registry


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    for var in ("MINIPAGED_BACKEND", "MINIPAGED_PREFILL_BACKEND", "MINIPAGED_DECODE_BACKEND"):
        monkeypatch.delenv(var, raising=False)


def test_available_backends_lists_all_with_reasons():
    avail = mp.available_backends("cpu")
    assert set(avail) == {"torch", "triton", "cuda", "cuda-wmma"}
    for name, (ok, why) in avail.items():
        assert isinstance(ok, bool) and isinstance(why, str) and why
    assert avail["torch"][0]
    assert not avail["cuda"][0]


@pytest.mark.parametrize("device, exc", [("nope", ValueError), ("torch", ValueError), ("meta", ValueError),
                                         ("cuda:", ValueError), ("cuda:x", ValueError),
                                         (1, TypeError), (b"cpu", TypeError)])
def test_available_backends_refuses_a_device_it_cannot_mean(device, exc):
    # a backend name or a typo given as the device used to answer "nothing runs here"
    with pytest.raises(exc, match="device"):
        mp.available_backends(device)
    assert mp.available_backends(torch.device("cpu")) == mp.available_backends("cpu")
    assert set(mp.available_backends("cuda:0")) == set(mp.available_backends("cuda"))


def test_available_backends_without_device_counts_the_interpreter(monkeypatch):
    """No device given means any device here: on a machine without a GPU, triton under
    TRITON_INTERPRET=1 is available (it runs on CPU tensors); without the interpreter it is not,
    and the reason names what each device lacks."""
    monkeypatch.setattr(registry, "_cuda_available", lambda: False)
    monkeypatch.setattr(registry, "_availability", {})
    if importlib.util.find_spec("triton") is None:
        pytest.skip("triton is not installed")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    ok, why = mp.available_backends()["triton"]
    assert ok and "TRITON_INTERPRET" in why
    assert mp.get_backend("triton").is_available() == (ok, why)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    ok, why = mp.available_backends()["triton"]
    assert not ok and "cuda:" in why and "cpu:" in why and "TRITON_INTERPRET" in why
    assert mp.available_backends()["torch"][0] is True


def test_auto_on_cpu_is_torch():
    assert registry.resolve("prefill", "cpu").name == "torch"
    assert registry.resolve("decode", "cpu").name == "torch"


def test_precedence(monkeypatch):
    monkeypatch.setenv("MINIPAGED_BACKEND", "triton")
    assert registry.requested_name("prefill") == ("triton", "MINIPAGED_BACKEND")
    monkeypatch.setenv("MINIPAGED_PREFILL_BACKEND", "torch")
    assert registry.requested_name("prefill") == ("torch", "MINIPAGED_PREFILL_BACKEND")
    assert registry.requested_name("prefill_varlen")[0] == "torch"
    assert registry.requested_name("decode") == ("triton", "MINIPAGED_BACKEND")
    monkeypatch.setenv("MINIPAGED_DECODE_BACKEND", "cuda")
    assert registry.requested_name("decode")[0] == "cuda"
    assert registry.requested_name("write_kv_cache")[0] == "cuda"
    with mp.use_backend("cuda-wmma"):
        assert registry.requested_name("prefill")[0] == "cuda-wmma"
        assert registry.requested_name("prefill", "torch")[0] == "torch"  # argument wins
    assert registry.requested_name("prefill")[0] == "torch"


def test_env_var_is_used_for_calls(monkeypatch):
    q = torch.randn(1, 2, 3, 64)
    monkeypatch.setenv("MINIPAGED_BACKEND", "torch")
    mp.prefill_attention(q, q, q)
    monkeypatch.setenv("MINIPAGED_PREFILL_BACKEND", "cuda")
    with pytest.raises(mp.BackendUnavailableError, match="MINIPAGED_PREFILL_BACKEND"):
        mp.prefill_attention(q.half(), q.half(), q.half())
    # the argument beats the env var
    mp.prefill_attention(q, q, q, backend="torch")


def test_unknown_names(monkeypatch):
    with pytest.raises(ValueError, match="valid names"):
        mp.get_backend("nope")
    monkeypatch.setenv("MINIPAGED_BACKEND", "Nope")
    with pytest.raises(ValueError, match="MINIPAGED_BACKEND.*valid names"):
        registry.requested_name("prefill")
    with pytest.raises(ValueError):
        with mp.use_backend("nope"):
            pass


def test_get_backend_env(monkeypatch):
    monkeypatch.setenv("MINIPAGED_BACKEND", "torch")
    assert mp.get_backend().name == "torch"


def test_no_silent_fallback(monkeypatch):
    # triton on CPU without the interpreter is unavailable, and asking for it must say so
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    q = torch.randn(1, 2, 3, 64)
    with pytest.raises(mp.BackendUnavailableError, match="TRITON_INTERPRET"):
        mp.prefill_attention(q, q, q, backend="triton")


def test_op_lookup_names_the_backends_that_have_it():
    b = registry.Backend(name="x", load=lambda: None, provides=frozenset(), devices=("cpu",),
                         availability=lambda d: (True, ""))
    with pytest.raises(mp.BackendUnavailableError, match="backends that do"):
        b.op("decode")


def test_import_is_light():
    code = "import sys, minipaged; bad=[m for m in ('triton','minipaged.triton','minipaged.cuda.ops','minipaged.engine') if m in sys.modules]; print(bad)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=dict(os.environ))
    assert out.stdout.strip() == "[]", out.stdout


def test_cli_info_runs():
    out = subprocess.run([sys.executable, "-m", "minipaged.cli", "info"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "torch" in out.stdout and "prefill" in out.stdout and "cuda-wmma" in out.stdout


def _reset_registry_caches():
    for fn in ("reset_caches", "reset_cache"):
        if hasattr(registry, fn):
            getattr(registry, fn)()


@pytest.fixture
def fake_availability(monkeypatch):
    """Make availability on CUDA whatever the test says, for every backend, whatever is cached."""
    avail = {}
    real = registry.Backend.is_available

    def is_available(self, device=None):
        if device is not None and str(device).split(":")[0] == "cuda":
            return avail.get(self.name, (False, "patched: unavailable"))
        return real(self, device)

    monkeypatch.setattr(registry.Backend, "is_available", is_available)
    _reset_registry_caches()
    yield avail
    monkeypatch.undo()
    _reset_registry_caches()


def test_auto_on_cuda_prefers_cuda_then_triton_then_torch(fake_availability):
    """DESIGN: `auto` on CUDA tensors is the fastest available of cuda, triton, torch."""
    ops = [op for op in registry.OPS if op in registry.all_backends()["cuda"].provides]
    assert {"prefill", "prefill_varlen", "decode", "write_kv_cache"} <= set(ops)
    fake_availability.update(cuda=(True, "patched"), triton=(True, "patched"), torch=(True, "patched"))
    _reset_registry_caches()
    for op in ops:
        assert registry.resolve(op, "cuda").name == "cuda", op
        assert registry.resolve(op, "cuda:0").name == "cuda", op
    fake_availability["cuda"] = (False, "patched: no nvcc")
    _reset_registry_caches()
    for op in ops:
        assert registry.resolve(op, "cuda").name == "triton", op
    fake_availability["triton"] = (False, "patched: no triton")
    _reset_registry_caches()
    for op in ops:
        assert registry.resolve(op, "cuda").name == "torch", op
    # never the teaching kernel, and CPU tensors are torch's whatever CUDA has
    fake_availability.update(cuda=(True, "patched"), triton=(True, "patched"))
    _reset_registry_caches()
    assert all(registry.resolve(op, "cuda").name != "cuda-wmma" for op in ops)
    assert registry.resolve("prefill", "cpu").name == "torch"


def _merge_inputs():
    g = torch.Generator().manual_seed(3)
    o = torch.randn(2, 3, 8, generator=g)
    lse = torch.randn(2, 3, generator=g)
    return o, lse, o.flip(0), lse.flip(0)


def test_merge_backend_follows_the_selection_rules(monkeypatch):
    """merge_attention_states picks its backend as the other ops do: unknown names list the valid
    ones, use_backend() and MINIPAGED_BACKEND count, and a cuda backend (whose merge is the Triton
    kernel) asked for on CPU tensors raises instead of falling back."""
    args = _merge_inputs()
    with pytest.raises(ValueError, match="unknown backend 'bogus'.*valid names"):
        mp.merge_attention_states(*args, backend="bogus")
    with pytest.raises(TypeError, match="backend name must be a str"):
        mp.merge_attention_states(*args, backend=3)
    for name in ("cuda", "cuda-wmma"):
        with pytest.raises(mp.BackendUnavailableError, match=name):
            mp.merge_attention_states(*args, backend=name)
        with mp.use_backend(name), pytest.raises(mp.BackendUnavailableError, match="use_backend"):
            mp.merge_attention_states(*args)
    monkeypatch.setenv("MINIPAGED_BACKEND", "cuda")
    with pytest.raises(mp.BackendUnavailableError, match="MINIPAGED_BACKEND"):
        mp.merge_attention_states(*args)
    # the argument wins over the variable, and torch agrees with an fp64 merge
    o, lse = mp.merge_attention_states(*args, backend="torch")
    o_a, lse_a, o_b, lse_b = (x.double() for x in args)
    want_lse = torch.logaddexp(lse_a, lse_b)
    want = torch.exp(lse_a - want_lse)[..., None] * o_a + torch.exp(lse_b - want_lse)[..., None] * o_b
    torch.testing.assert_close(lse.double(), want_lse, atol=1e-6, rtol=0)
    torch.testing.assert_close(o.double(), want, atol=1e-6, rtol=0)
    # triton without the interpreter cannot run CPU tensors: named, it raises
    monkeypatch.setenv("MINIPAGED_BACKEND", "triton")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(mp.BackendUnavailableError, match="triton"):
        mp.merge_attention_states(*args)
