#!/usr/bin/env python3
"""Copy a Triton kernel cache without the IR text that a cache hit never reads.

    python scripts/triton_cache_slim.py SRC DST

A compiled kernel's cache entry holds every stage Triton went through (.source, .ttir, .ttgir,
.llir, .ptx), its metadata (.json), its binary (.cubin) and a group file (__grp__NAME.json) that
lists them all by absolute path. A later compile that finds the group loads the kernel from the
metadata and the binary alone (triton.compiler.CompiledKernel), but only when every file the
group lists still exists. So this copies each entry without the IR text and rewrites its group to
list only what is kept, with the paths unchanged: DST's contents must be unpacked at SRC for the
paths to hold, as gpu_check.sh's triton_cache stage does. Anything else in the cache (the
launcher and driver-utility .so files, entries without a group) is copied as it is.

The IR is most of the bytes: a GPU test run's 1.1 GB cache keeps about an eighth. A kernel loaded
from a slim entry has only `cubin` in its `.asm`; scripts that read the PTX or TTGIR of a kernel
compile it afresh.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

# the stages' text: what Triton writes besides the metadata and the binary
IR_SUFFIXES = frozenset({".source", ".ttir", ".ttgir", ".llir", ".ptx", ".amdgcn"})


def slim(src: Path, dst: Path) -> tuple[int, int]:
    """Copy src into dst (which must not exist) without the IR text of grouped entries. Returns
    the bytes of src and of dst."""
    dropped: set[Path] = set()
    groups: dict[Path, dict] = {}
    for grp in src.glob("*/__grp__*.json"):
        try:
            data = json.loads(grp.read_text())
            child_paths = dict(data["child_paths"])
        except (ValueError, KeyError, TypeError):
            continue  # a corrupt group is copied as it is: Triton ignores it too
        keep = {}
        for name, path in child_paths.items():
            if Path(name).suffix in IR_SUFFIXES:
                dropped.add(grp.parent / Path(path).name)
            else:
                keep[name] = path
        groups[grp] = {**data, "child_paths": keep}
    total = kept = 0
    for path in sorted(src.rglob("*")):
        if not path.is_file():
            continue
        size = path.stat().st_size
        total += size
        if path in dropped:
            continue
        out = dst / path.relative_to(src)
        out.parent.mkdir(parents=True, exist_ok=True)
        if path in groups:
            out.write_text(json.dumps(groups[path]))
        else:
            shutil.copy2(path, out)
        kept += out.stat().st_size
    dst.mkdir(parents=True, exist_ok=True)
    return total, kept


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print(__doc__, file=sys.stderr)
        return 2
    src, dst = Path(argv[0]), Path(argv[1])
    if dst.exists():
        print(f"triton_cache_slim: {dst} exists", file=sys.stderr)
        return 2
    total, kept = slim(src, dst)
    print(f"triton_cache_slim: {kept / 2**20:.1f} MiB of {total / 2**20:.1f} MiB kept")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
