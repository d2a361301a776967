import gc
import os
import tempfile

import pytest
import torch
from hypothesis import HealthCheck, settings

# Without a GPU, Triton kernels run under the interpreter. It must be switched
# on before anything imports triton, and this file is imported first.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
# The interpreter re-patches triton.language on every device-function call; once per launch is
# enough (interpreter_patch_once.py). MINIPAGED_TEST_INTERPRETER_PATCH=0 keeps Triton's own way.
if os.environ.get("TRITON_INTERPRET") == "1" and os.environ.get("MINIPAGED_TEST_INTERPRETER_PATCH", "1") != "0":
    import interpreter_patch_once

    interpreter_patch_once.install()

# Every profile: no deadline (first calls compile kernels) and no health checks
# that trip on large tensors or slow interpreted Triton.
_common = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
# ci: derandomized, no example database, few examples, CPU.
settings.register_profile("ci", max_examples=12, derandomize=True, database=None, print_blob=True, **_common)
settings.register_profile("dev", max_examples=40, **_common)
# soak: fresh random examples, many of them, for a long CPU run (HYPOTHESIS_PROFILE=soak); tests
# that pin their own max_examples keep it.
settings.register_profile("soak", max_examples=1000, database=None, print_blob=True, **_common)
# gpu: hundreds of examples on the H200 (`HYPOTHESIS_PROFILE=gpu pytest -m gpu`).
settings.register_profile("gpu", max_examples=300, database=None, print_blob=True, **_common)
# gpu-short: a bounded GPU pass for one device call that also runs the benchmarks.
settings.register_profile("gpu-short", max_examples=20, derandomize=True, database=None, print_blob=True, **_common)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


# MINIPAGED_TEST_SHARD="i/n": keep only shard i of n of the selected tests, so
# several pytest processes can share one GPU machine (scripts/gpu_check.sh
# tests_par). Tests are dealt in runs of _SHARD_RUN neighbours, which mostly
# share their compiled Triton variants, so a shard rarely compiles what another
# one compiles too.
_SHARD_RUN = 4
# Tests that alone take minutes of Triton compiling on the GPU machine (the hypothesis
# cross-check of the Triton paged op draws hundreds of constexpr combinations): with three or
# more shards they get the last shard to themselves, so they hold back no other test.
_SHARD_ALONE = ("tests/test_crosscheck.py::test_paged_cuda[triton-",)


def shard_of(nodeids: list[str], count: int) -> list[int]:
    """The shard (0..count-1) of each test id: runs of _SHARD_RUN neighbours dealt in turn,
    and, from three shards up, the _SHARD_ALONE tests (when selected) on the last shard, alone."""
    alone = count >= 3 and any(nodeid.startswith(_SHARD_ALONE) for nodeid in nodeids)
    out, j = [], 0
    for nodeid in nodeids:
        if alone and nodeid.startswith(_SHARD_ALONE):
            out.append(count - 1)
            continue
        out.append((j // _SHARD_RUN) % (count - 1 if alone else count))
        j += 1
    return out


@pytest.hookimpl(trylast=True)  # after -m / -k have deselected
def pytest_collection_modifyitems(config, items):
    # MINIPAGED_TEST_EXCLUDE=FILE: leave out the node ids listed in FILE (one per line; e.g. the
    # tests an earlier, capped GPU call already passed: scripts/junit_passed.py lists them).
    exclude = os.environ.get("MINIPAGED_TEST_EXCLUDE")
    if exclude:
        with open(exclude) as f:
            done = {line.strip() for line in f if line.strip()}
        config.hook.pytest_deselected(items=[it for it in items if it.nodeid in done])
        items[:] = [it for it in items if it.nodeid not in done]
    spec = os.environ.get("MINIPAGED_TEST_SHARD")
    if spec:
        index, count = (int(x) for x in spec.split("/"))
        if not 0 <= index < count:
            raise pytest.UsageError(f"MINIPAGED_TEST_SHARD={spec!r}: want i/n with 0 <= i < n")
        shards = shard_of([it.nodeid for it in items], count)
        keep = [it for it, sh in zip(items, shards) if sh == index]
        drop = [it for it, sh in zip(items, shards) if sh != index]
        config.hook.pytest_deselected(items=drop)
        items[:] = keep
    # A gpu test that silently skips would read as passed: fail loudly instead
    # when the user asked for them (-m gpu) on a machine without a GPU.
    if torch.cuda.is_available():
        return
    markexpr = config.getoption("-m") or ""
    if "gpu" in markexpr and "not gpu" not in markexpr:
        raise pytest.UsageError("-m gpu was requested but torch sees no CUDA device")


# Errors after which the process's CUDA context is gone: every later CUDA call fails with the
# same message, so each test after the culprit would fail too and bury it.
_LOST_CONTEXT = ("illegal memory access", "misaligned address", "unspecified launch failure",
                 "device-side assert triggered", "illegal instruction")


def lost_cuda_context(message: str) -> bool:
    """Whether an error message says the CUDA context can no longer run anything."""
    return "CUDA error" in message and any(m in message for m in _LOST_CONTEXT)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    # The first test whose error kills the CUDA context stops the session: it is the one to read
    # (the GPU tests after it could only fail on the dead context).
    outcome = yield
    report = outcome.get_result()
    if report.failed and call.excinfo is not None and lost_cuda_context(str(call.excinfo.value)):
        item.session.shouldstop = (f"the CUDA context was lost in {item.nodeid}; "
                                   "later tests cannot run in this process")


# Sharded runs (MINIPAGED_TEST_SHARD) put several pytest processes on one GPU. Each process's
# caching allocator keeps what its biggest test reserved, so on an 80 GB card one shard holding
# 50 GB from an earlier test made another shard's large test fail with an out-of-memory error
# that says nothing about the code under test. So a shard returns its cached blocks after any
# test that left more than _SHARD_KEEP_BYTES reserved, and a test that runs out of GPU memory is
# run once more, alone among the retries (a file lock), after this process has freed its cache.
_SHARD_KEEP_BYTES = 1 << 30
_SHARD_RETRY_LOCK = os.path.join(tempfile.gettempdir(), "minipaged-test-oom-retry.lock")


def _release_cuda_cache() -> None:
    gc.collect()
    torch.cuda.empty_cache()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    if not os.environ.get("MINIPAGED_TEST_SHARD"):
        return (yield)
    try:
        return (yield)
    except torch.OutOfMemoryError as first:
        from filelock import FileLock  # (torch's own dependency)

        if torch.cuda.is_available():
            _release_cuda_cache()
        with FileLock(_SHARD_RETRY_LOCK):
            print(f"\n{item.nodeid}: out of GPU memory beside the other shards ({first}); running it again")
            return item.runtest()


@pytest.hookimpl(trylast=True)
def pytest_runtest_teardown(item):
    if (os.environ.get("MINIPAGED_TEST_SHARD") and torch.cuda.is_available() and torch.cuda.is_initialized()
            and torch.cuda.memory_reserved() > _SHARD_KEEP_BYTES):
        _release_cuda_cache()


@pytest.fixture(scope="module")
def one_torch_thread():
    """torch on one thread for a module (`pytestmark = pytest.mark.usefixtures("one_torch_thread")`):
    the engine tests' tiny matmuls on a 2-core CI box lose more to thread hand-offs than they gain."""
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


@pytest.fixture(scope="session")
def serving_ckpt(tmp_path_factory):
    """A tiny random Qwen3 checkpoint (2 layers, 4/2 heads of 64, vocab 500, no EOS) saved by
    transformers, and the transformers model itself: (folder, hf). The engine-serving and
    batch-invariance tests build their engines from it and compare with its generate()."""
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("safetensors")
    torch.manual_seed(0)
    cfg = transformers.Qwen3Config(
        vocab_size=500, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=64, max_position_embeddings=512, tie_word_embeddings=True,
        initializer_range=0.1, eos_token_id=None, bos_token_id=None, pad_token_id=None)
    hf = transformers.Qwen3ForCausalLM(cfg).eval()
    folder = str(tmp_path_factory.mktemp("qwen3_serving"))
    hf.save_pretrained(folder)
    return folder, hf
