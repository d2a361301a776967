#!/usr/bin/env python3
"""Node ids of the tests that passed in pytest JUnit XML files (scripts/gpu_check.sh writes one
per test stage under logs/) or in verbose pytest logs (the stage's own, which name each result
as it ends: a shard killed at its cap writes no XML), one per line: a later call can leave them
out with MINIPAGED_TEST_EXCLUDE=FILE (tests/conftest.py) and run only what a capped call did not
reach.

    python scripts/junit_passed.py logs/*.xml logs/*.log > passed.txt
"""

from __future__ import annotations

import glob
import gzip
import re
import sys
import xml.etree.ElementTree as ET

# "tests/test_x.py::name[params] " starts a test's line under -v; what the test prints (-s) may
# come before its outcome, which ends a line (then pytest's "[ 12%]" where it prints one), and the
# next test's id, or the first "=====" section line after the last test, ends its text.
_TEST_LINE = re.compile(r"^(tests/\S+\.py::\S+) ", re.M)
_SECTION = re.compile(r"^={5,} ", re.M)
_OUTCOME = re.compile(r"\b(PASSED|FAILED|SKIPPED|ERROR|XFAIL|XPASS)(?: \(.*\))?(?:\s+\[\s*\d+%\])?$", re.M)


def passed_in_log(text: str) -> list[str]:
    """The ids a verbose (-v) pytest log reports PASSED; a test cut off before its outcome is not.
    A test's outcome is the last one in its text, after anything it printed."""
    starts = list(_TEST_LINE.finditer(text))
    out = []
    for i, m in enumerate(starts):
        end = starts[i + 1].start() if i + 1 < len(starts) else len(text)
        section = _SECTION.search(text, m.end(), end)  # the session's summary after the last test
        outcomes = list(_OUTCOME.finditer(text, m.end(), section.start() if section else end))
        if outcomes and outcomes[-1].group(1) == "PASSED":
            out.append(m.group(1))
    return out


def passed(path: str) -> list[str]:
    """The ids `path` reports passed: a JUnit file (.xml), an id list (.txt) or a log, any of them
    gzipped (.gz)."""
    with (gzip.open if path.endswith(".gz") else open)(path, "rt", errors="replace") as f:
        text = f.read()
    if path.removesuffix(".gz").endswith(".txt"):  # an id list, as this script writes one
        return [line.strip() for line in text.splitlines() if "::" in line]
    if not path.removesuffix(".gz").endswith(".xml"):
        return passed_in_log(text)
    out = []
    for case in ET.fromstring(text).iter("testcase"):
        if any(child.tag in ("failure", "error", "skipped") for child in case):
            continue
        module = case.get("classname", "").replace(".", "/")
        name = case.get("name", "")
        # classname "tests.test_x" (or "tests.test_x.TestClass") -> node id "tests/test_x.py::name"
        parts = module.split("/")
        i = next((k for k, p in enumerate(parts) if p.startswith("test_")), len(parts) - 1)
        node = "/".join(parts[: i + 1]) + ".py"
        rest = parts[i + 1:]
        out.append("::".join([node, *rest, name]))
    return out


def main(argv: list[str]) -> int:
    if not argv:
        print(__doc__, file=sys.stderr)
        return 2
    for pattern in argv:
        # a shell leaves a glob that matches nothing as it is (gpu_check.sh passes GPU_TESTS_PASSED
        # unquoted): such a pattern names no file, and says so, rather than ending the list early
        paths = sorted(glob.glob(pattern)) if glob.has_magic(pattern) else [pattern]
        if not paths:
            print(f"junit_passed: no file matches {pattern}", file=sys.stderr)
        for path in paths:
            for node in passed(path):
                print(node)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
