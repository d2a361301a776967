#!/usr/bin/env python3
"""Node ids of the tests that passed in pytest JUnit XML files (scripts/gpu_check.sh writes one
per test stage under logs/), one per line: a later call can leave them out with
MINIPAGED_TEST_EXCLUDE=FILE (tests/conftest.py) and run only what a capped call did not reach.

    python scripts/junit_passed.py logs/*.xml > passed.txt
"""

from __future__ import annotations

import sys
import xml.etree.ElementTree as ET


def passed(path: str) -> list[str]:
    out = []
    for case in ET.parse(path).getroot().iter("testcase"):
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
    for path in argv:
        for node in passed(path):
            print(node)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
