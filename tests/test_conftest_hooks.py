"""tests/conftest.py's hooks, run in an inner pytest session (pytester)."""
import pathlib

from conftest import lost_cuda_context

pytest_plugins = ["pytester"]

_CONFTEST = pathlib.Path(__file__).with_name("conftest.py")


def test_lost_cuda_context_messages():
    assert lost_cuda_context("CUDA error: an illegal memory access was encountered")
    assert lost_cuda_context("CUDA error: device-side assert triggered\nCUDA kernel errors might be ...")
    assert not lost_cuda_context("CUDA error: out of memory")  # the context survives an OOM
    assert not lost_cuda_context("an illegal memory access")  # not a CUDA error
    assert not lost_cuda_context("expected 3 dims, got 2")


def test_lost_cuda_context_stops_the_session(pytester):
    # The culprit fails and nothing after it runs; an ordinary failure before it does not stop
    # the session.
    pytester.makeconftest(_CONFTEST.read_text())
    # (the modules the conftest imports, beside it)
    pytester.makepyfile(interpreter_patch_once=_CONFTEST.with_name("interpreter_patch_once.py").read_text())
    pytester.makepyfile(
        test_inner="""
        def test_a_plain_failure():
            assert 1 == 2

        def test_b_culprit():
            raise RuntimeError("CUDA error: an illegal memory access was encountered")

        def test_c_after():
            pass
        """
    )
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider")
    result.assert_outcomes(failed=2, passed=0)
    result.stdout.fnmatch_lines(["*the CUDA context was lost in test_inner.py::test_b_culprit*"])


def test_sharded_run_retries_a_test_that_ran_out_of_gpu_memory_once(pytester, monkeypatch):
    # Under MINIPAGED_TEST_SHARD a test whose first run raises torch.OutOfMemoryError runs once
    # more; a second out-of-memory error fails it, and so does any other error. Without sharding
    # nothing is retried.
    pytester.makeconftest(_CONFTEST.read_text())
    pytester.makepyfile(interpreter_patch_once=_CONFTEST.with_name("interpreter_patch_once.py").read_text())
    pytester.makepyfile(
        test_inner="""
        import torch

        calls = {"once": 0, "always": 0, "other": 0}

        def test_oom_once():
            calls["once"] += 1
            if calls["once"] == 1:
                raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 10.38 GiB")

        def test_oom_always():
            calls["always"] += 1
            raise torch.OutOfMemoryError(f"CUDA out of memory, run {calls['always']}")

        def test_other_error_is_not_retried():
            calls["other"] += 1
            assert calls["other"] == 2
        """
    )
    monkeypatch.setenv("MINIPAGED_TEST_SHARD", "0/1")
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-s")
    result.assert_outcomes(passed=1, failed=2)
    result.stdout.fnmatch_lines(["*test_oom_once: out of GPU memory beside the other shards*running it again*"])
    result.stdout.fnmatch_lines(["*OutOfMemoryError: CUDA out of memory, run 2*"])
    monkeypatch.delenv("MINIPAGED_TEST_SHARD")
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-s")
    result.assert_outcomes(passed=0, failed=3)
