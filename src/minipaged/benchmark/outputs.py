"""What a benchmark run leaves on disk: results.json (strict JSON), results.md
(report.py) and the plots (plots.py). The one module that uses both, so report and
plots never import each other.

Re-render plots and results.md from a results.json (e.g. one fetched from a GPU
machine without matplotlib):

    python -m minipaged.benchmark.outputs RESULTS [--out DIR]
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from . import plots as plots_mod
from . import report


def finite(obj):
    """Strict JSON: NaN/inf become null (a NaN error is also spelled out in the row's error)."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [finite(v) for v in obj]
    return obj


def _write_json_md(result: dict, out_dir: Path) -> tuple[Path, Path]:
    json_path = out_dir / "results.json"
    json_path.write_text(json.dumps(finite(result), indent=1, default=str, allow_nan=False) + "\n")
    md_path = out_dir / "results.md"
    md_path.write_text(report.markdown_report(result))
    return json_path, md_path


def write_all(result: dict, out_dir, *, plots: bool = True, log=None) -> list[Path]:
    """results.json and results.md always; prefill.png / decode.png when matplotlib is there."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    if plots:
        made, why = plots_mod.make_plots(result, out_dir)
        written += made
        if why:
            result.setdefault("notes", [])
            if why not in result["notes"]:
                result["notes"].append(why)
            if log:
                log(f"note: {why}")
    return [*_write_json_md(result, out_dir), *written]


def main(argv=None) -> int:
    """Re-render plots and results.md from a results.json:
    python -m minipaged.benchmark.outputs RESULTS [--out DIR]."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m minipaged.benchmark.outputs", description=main.__doc__)
    parser.add_argument("results", help="results.json, or the folder holding it")
    parser.add_argument("--out", default=None, help="folder to write into (default: the results' folder)")
    args = parser.parse_args(argv)
    src = Path(args.results)
    if src.is_dir():
        src = src / "results.json"
    result = json.loads(src.read_text())
    out = Path(args.out) if args.out else src.parent
    out.mkdir(parents=True, exist_ok=True)
    result["notes"] = [n for n in result.get("notes", []) if not n.startswith("plots skipped")]
    paths, why = plots_mod.make_plots(result, out)
    if why:
        print(why)
        return 1
    _, md = _write_json_md(result, out)
    for p in [*paths, md]:
        print(f"wrote {p}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
