"""The common tail of the A/B scripts (triton_*_ab.py): report the run's time, write its results
as JSON, and return the exit status."""

from __future__ import annotations

import json
import time


def finish(results: dict, json_path: str | None, t0: float, failed: bool) -> int:
    """Prints how long the run took since t0 (time.time()), writes `results` to json_path when
    one is given, and returns the process exit status: 1 if `failed`, else 0."""
    print(f"took {time.time() - t0:.1f} s")
    if json_path:
        with open(json_path, "w") as f:
            json.dump(results, f, indent=1)
        print(f"wrote {json_path}")
    return 1 if failed else 0
