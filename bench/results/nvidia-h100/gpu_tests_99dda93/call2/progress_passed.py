#!/usr/bin/env python3
"""Passed node ids from a capped pytest log written at default verbosity (per-file progress
characters, test prints interleaved) and the same shard's collected ids (--collect-only -q),
in collection order. Checks that each file's characters fall on that file's ids."""
import re, sys, gzip

def progress(log_text):
    out = []  # (file, char)
    cur = None
    for line in log_text.splitlines():
        m = re.match(r"^(tests/\S+\.py) ?(.*)$", line)
        if m:
            cur, rest = m.group(1), m.group(2)
        else:
            rest = line
        run = re.match(r"^[.sFExX]*", rest).group(0)
        if cur is None:
            continue
        out.extend((cur, ch) for ch in run)
    return out

def main(log, ids):
    text = (gzip.open if log.endswith(".gz") else open)(log, "rt").read()
    body = text.split("collected", 1)[1].split("\n", 1)[1]
    ids = [l.strip() for l in open(ids) if "::" in l]
    prog = progress(body)
    assert len(prog) <= len(ids), (len(prog), len(ids))
    passed = []
    for (f, ch), nid in zip(prog, ids):
        assert nid.startswith(f + "::"), (f, nid)
        if ch == ".":
            passed.append(nid)
    from collections import Counter
    print(f"{log}: {len(prog)} of {len(ids)} ran: {dict(Counter(c for _, c in prog))}", file=sys.stderr)
    print("\n".join(passed))

if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
