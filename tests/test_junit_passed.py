"""scripts/junit_passed.py, which lists the tests a capped GPU call passed so the next call can
leave them out: from a real verbose pytest log with -s prints (whole and cut off mid-test, as a
shard killed at its cap leaves it) and from the same run's JUnit file."""

from __future__ import annotations

import gzip
import importlib.util
import subprocess
import sys
import textwrap
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "junit_passed.py"

_CASES = textwrap.dedent('''
    import pytest

    def test_plain():
        pass

    @pytest.mark.parametrize("n", [1, 2])
    def test_prints_first(n):
        print(f"[case] n={n}")
        print("selftest says: ALL PASSED")

    def test_prints_then_fails():
        print("PASSED")
        print("this check PASSED before the failure")
        assert False

    def test_skipped():
        pytest.skip("not here")

    def test_last():
        print("[case] last")
''')


def _load():
    spec = importlib.util.spec_from_file_location("junit_passed", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_passed_ids_from_a_verbose_log_and_from_junit(tmp_path):
    root = tmp_path / "proj"
    (root / "tests").mkdir(parents=True)
    (root / "tests" / "test_cases.py").write_text(_CASES)
    xml = tmp_path / "run.xml"
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-v", "-v", "-s", "-p", "no:cacheprovider",
                          "-o", "addopts=", "--junitxml", str(xml), "tests/test_cases.py"],
                         cwd=root, capture_output=True, text=True)
    assert run.returncode == 1, run.stdout  # one failure
    log = run.stdout
    jp = _load()
    want = ["tests/test_cases.py::test_plain", "tests/test_cases.py::test_prints_first[1]",
            "tests/test_cases.py::test_prints_first[2]", "tests/test_cases.py::test_last"]
    assert jp.passed_in_log(log) == want
    assert jp.passed(str(xml)) == want
    xml_gz = tmp_path / "run.xml.gz"
    xml_gz.write_bytes(gzip.compress(xml.read_bytes()))
    assert jp.passed(str(xml_gz)) == want
    # cut off inside test_last (after its print, before its outcome): it did not pass
    cut = log[: log.index("[case] last") + len("[case] last\n")]
    assert jp.passed_in_log(cut) == want[:-1]
    # the command line: .log and .log.gz read alike
    path = tmp_path / "shard.log"
    path.write_text(cut)
    path_gz = tmp_path / "shard.log.gz"
    path_gz.write_bytes(gzip.compress(cut.encode()))
    for p in (path, path_gz):
        out = subprocess.run([sys.executable, str(SCRIPT), str(p)], capture_output=True, text=True, check=True)
        assert out.stdout.split() == want[:-1]
    # its own output, an id list (.txt, .txt.gz), reads back as it is
    ids = tmp_path / "passed.txt"
    ids.write_text(out.stdout)
    ids_gz = tmp_path / "passed.txt.gz"
    ids_gz.write_bytes(gzip.compress(out.stdout.encode()))
    assert jp.passed(str(ids)) == jp.passed(str(ids_gz)) == want[:-1]


def test_globs_expand_and_one_matching_nothing_only_warns(tmp_path):
    (tmp_path / "a.txt").write_text("tests/test_a.py::one\n")
    (tmp_path / "b.txt").write_text("tests/test_b.py::two\n")
    # a glob the shell left as it is, because it matched nothing, comes first: it must not stop
    # the files after it from counting
    out = subprocess.run([sys.executable, str(SCRIPT), str(tmp_path / "logs*" / "*.log*"), str(tmp_path / "*.txt")],
                         capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["tests/test_a.py::one", "tests/test_b.py::two"]
    assert "no file matches" in out.stderr
