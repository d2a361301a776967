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
