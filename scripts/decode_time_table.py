"""One table from the `time` logs of scripts/decode_selftest.cu (gpu_check.sh's decode_ab,
decode_worklist stages write one log per round and build):

    python scripts/decode_time_table.py logs/decode_worklist_time1.log logs/decode_worklist_time2.log

Each row of a log is one (case, config): its split count, CTAs, median / p20 / p80 µs over the
replays, TB/s and the check against the case's first config. Printed: per case, every config's
median µs in each log, the median over the logs, and its ratio to the case's first config over
the same logs (the A/B's baseline: a time log times it first). A row whose check says neither
"ok" nor "timing only" is marked, and makes the exit status 1: a timed config that disagreed
with the baseline is not a result.
"""

from __future__ import annotations

import argparse
import re
import statistics
import sys
from dataclasses import dataclass, field

# case (e.g. "B=64 L=32k 1long fp8"), config ("tiling 0 worklist"), then the numbers
ROW = re.compile(
    r"^(?P<case>B=\d+ L=\d+k(?: (?:1long|rand|short|quarter|fp8))*)\s+(?P<config>tiling .*?)\s+(?P<splits>\d+)\s+"
    r"(?P<ctas>\d+)\s+(?P<med>[\d.]+)\s+(?P<p20>[\d.]+)\s+(?P<p80>[\d.]+)\s+(?P<tbs>[\d.]+)\s+(?P<check>.*)$"
)


@dataclass
class Cell:
    """One (case, config) over the logs: its medians (µs), one per log that timed it."""

    splits: int
    ctas: int
    medians: list[float] = field(default_factory=list)
    checks: list[str] = field(default_factory=list)

    @property
    def bad(self) -> bool:
        return any(not (c == "ok" or c.startswith("timing only")) for c in self.checks)


def parse(paths: list[str]) -> dict[str, dict[tuple[str, int, int], Cell]]:
    """{case: {(config, splits, n): Cell}}, in the order the first log gives them (a forced split
    sweep, DECODE_TIME_SPLITS, times one config at several split counts; n counts the rows of
    a log with the same case, config and splits, so that each cell has one median per log)."""
    table: dict[str, dict[tuple[str, int, int], Cell]] = {}
    for path in paths:
        seen: dict[tuple[str, str, int], int] = {}
        with open(path) as f:
            for line in f:
                m = ROW.match(line.rstrip("\n"))
                if m is None:
                    continue
                configs = table.setdefault(m["case"], {})
                row_key = (m["case"], m["config"], int(m["splits"]))
                seen[row_key] = n = seen.get(row_key, -1) + 1
                key = (m["config"], int(m["splits"]), n)
                cell = configs.setdefault(key, Cell(int(m["splits"]), int(m["ctas"])))
                cell.medians.append(float(m["med"]))
                cell.checks.append(m["check"].strip())
    return table


def render(table: dict[str, dict[tuple[str, int, int], Cell]], n_logs: int) -> tuple[str, bool]:
    """The markdown table and whether any row's check failed."""
    head = ["case", "config", "splits", "CTAs"] + [f"log {i + 1} µs" for i in range(n_logs)]
    head += ["median µs", "vs first config"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * 2 + "---:|" * (len(head) - 2)]
    any_bad = False
    for case, configs in table.items():
        base = statistics.median(next(iter(configs.values())).medians)
        for (config, _, _), cell in configs.items():
            med = statistics.median(cell.medians)
            per_log = [f"{x:.2f}" for x in cell.medians] + ["-"] * (n_logs - len(cell.medians))
            mark = " **check failed**" if cell.bad else ""
            any_bad |= cell.bad
            row = [case, config + mark, str(cell.splits), str(cell.ctas), *per_log, f"{med:.2f}", f"{med / base:.3f}"]
            lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines), any_bad


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("logs", nargs="+", help="decode_selftest `time` logs (one per round or build)")
    args = ap.parse_args(argv)
    try:
        table = parse(args.logs)
    except OSError as e:
        print(f"error: {e.filename}: {e.strerror}", file=sys.stderr)
        return 2
    if not table:
        print("error: no timed rows in " + ", ".join(args.logs), file=sys.stderr)
        return 2
    text, bad = render(table, len(args.logs))
    print(text)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
