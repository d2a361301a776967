"""Tables (terminal and markdown) and the files a benchmark run writes."""

from __future__ import annotations

import math

# One FLOP definition everywhere (flops.py, these titles, the README): exact causal
# FLOPs, 4*D per (query, key) pair the mask keeps, i.e. QK^T and PV, 2 FLOPs per
# multiply-add; masked pairs and softmax are not counted.
FLOP_DEFINITION = "exact causal FLOPs: 4*D per (query, key) pair the mask keeps"
_OP_TITLE = {
    "prefill": f"Prefill (causal; TFLOP/s of {FLOP_DEFINITION})",
    "decode": "Decode (paged KV; TB/s of K+V actually read + q + o)",
    "paged": ("Paged attention: chunked prefill, speculative verification, mixed batch "
              "(one paged_attention launch; TFLOP/s exact causal, TB/s of K+V read + q + o)"),
}

# The targets of the paged rows (issue #13): the case kind each applies to, the bound, and
# what the ratio divides. Ratios of medians; speed_* > 1 and time_* < 1 mean faster.
PAGED_TARGETS = {
    "speed_vs_dense": ("chunked", ">=", 0.9, "speed vs dense",
                       "dense varlen ms / paged ms, the same backend's prefill_attention_varlen on the "
                       "K/V made contiguous (gather not timed)"),
    "speed_vs_flashinfer": ("chunked", ">=", 1.0, "speed vs FlashInfer",
                            "FlashInfer ms / paged ms, its BatchPrefillWithPagedKVCacheWrapper on the same pages"),
    "time_vs_decode": ("spec", "<=", 1.3, "time/decode",
                       "paged ms / the same backend's decode_attention ms at the same B and context"),
    "time_vs_split": ("mixed", "<=", 1.1, "time/(chunk+decodes)",
                      "one-launch ms / (the faster of the backend's chunk-alone paged and dense varlen "
                      "times + its decodes-alone time)"),
}


# FP8 KV cache (issue #15): on these decode cases an fp8 row's time must be at most this
# fraction of the same backend's time on the 16-bit cache, i.e. speed_vs_16bit >= 1 / bound
FP8_NAME = "float8_e4m3fn"
FP8_TARGET_CASES = ("B=64 L=8192", "B=1 L=32768")
FP8_TIME_BOUND = 0.55


def is_fp8(r: dict) -> bool:
    return r.get("kv_dtype") == FP8_NAME


def fp8_verdict(r: dict) -> bool | None:
    """Whether an fp8 backend row meets the fp8 time target; None where it does not apply."""
    v = r.get("speed_vs_16bit")
    if (not is_fp8(r) or v is None or r.get("op") != "decode" or r.get("kind") != "backend"
            or r.get("case") not in FP8_TARGET_CASES):
        return None
    return 1.0 / v <= FP8_TIME_BOUND


def _fp8_cell(r) -> str:
    v = r.get("speed_vs_16bit")
    if v is None:
        return "-"
    verdict = fp8_verdict(r)
    return f"{v:.2f}x" + ("" if verdict is None else (" ok" if verdict else " MISS"))


def fp8_targets_lines(rows: list[dict]) -> list[str]:
    lines = []
    for r in rows:
        verdict = fp8_verdict(r)
        if verdict is not None:
            lines.append(f"{r['backend']} {r['case']}: fp8 / 16-bit time = {1.0 / r['speed_vs_16bit']:.2f} "
                         f"(target <= {FP8_TIME_BOUND}: {'met' if verdict else 'MISSED'})")
    return lines


FP8_LEGEND = (f"speed-up vs 16-bit = the same kernel's median on the 16-bit cache / its median on the fp8 "
              f"cache (target on decode {', '.join(FP8_TARGET_CASES)}: fp8 time <= {FP8_TIME_BOUND}x)")


def meets_target(key: str, value, kind: str | None = None) -> bool | None:
    """Whether a ratio meets its target; None when not measured, or measured on a case kind
    the target is not about (e.g. speed vs dense on a mixed batch: shown, not judged)."""
    target_kind, rel, bound, _, _ = PAGED_TARGETS[key]
    if value is None or (kind is not None and kind != target_kind):
        return None
    return value >= bound if rel == ">=" else value <= bound


def _kind(r) -> str | None:
    return (r.get("shape") or {}).get("kind")


def _ratio_cell(key: str):
    def cell(r):
        v = r.get(key)
        if v is None:
            return "-"
        verdict = meets_target(key, v, _kind(r))
        return f"{v:.2f}" + ("" if verdict is None else (" ok" if verdict else " MISS"))
    return cell


def _us(x):
    return None if x is None else x * 1000.0


def _f(x, fmt="{:.3f}", none="-"):
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return none
    return fmt.format(x)


def _paged_columns():
    cols = [("case", lambda r: r["case"]),
            ("backend", lambda r: r["backend"] + ("*" if r["kind"] == "anchor" else "")),
            ("median µs", lambda r: _f(_us(r["median_ms"]), "{:.1f}")),
            ("p20-p80 µs", lambda r: (f"{_us(r['p20_ms']):.1f}-{_us(r['p80_ms']):.1f}"
                                      if r["p20_ms"] is not None else "-")),
            ("TFLOP/s", lambda r: _f(r["tflops"], "{:.1f}" if (r["tflops"] or 0) >= 1 else "{:.3g}")),
            ("TB/s", lambda r: _f(r["tbps"], "{:.3f}" if (r["tbps"] or 0) >= 0.01 else "{:.3g}"))]
    for key, (_, rel, bound, title, _) in PAGED_TARGETS.items():
        cols.append((f"{title} {rel}{bound}", _ratio_cell(key)))
    cols += [("vs best anchor", lambda r: _f(r.get("vs_best_anchor"), "{:.2f}x" if (r.get("vs_best_anchor") or 0) >= 0.01
                                             else "{:.2g}x")),
             ("reps", lambda r: str(r["reps"]) if r["status"] == "ok" else "-"),
             ("note", lambda r: r["note"] if r["status"] == "ok"
              else f"{r['status'].upper()}: {r['error']}")]
    return cols


def paged_targets_lines(rows: list[dict]) -> list[str]:
    """One line per (backend row, target ratio) that was measured: value, bound, met or missed."""
    lines = []
    for r in rows:
        if r["op"] != "paged" or r["kind"] == "anchor" or r["status"] != "ok":
            continue
        for key, (_, rel, bound, title, _) in PAGED_TARGETS.items():
            verdict = meets_target(key, r.get(key), _kind(r))
            if verdict is not None:
                lines.append(f"{r['backend']} {r['case']}: {title} = {r[key]:.2f} (target {rel} {bound}: "
                             f"{'met' if verdict else 'MISSED'})")
    return lines


def paged_legend() -> list[str]:
    return [f"{title} ({kind} rows, target {rel} {bound}): {what}"
            for kind, rel, bound, title, what in PAGED_TARGETS.values()]


def _columns(op: str, with_copy: bool = True, with_fp8: bool = False):
    cols = _columns16(op, with_copy)
    if with_fp8:  # before "vs best anchor"
        at = next(i for i, (name, _) in enumerate(cols) if name == "vs best anchor")
        cols.insert(at, ("speed-up vs 16-bit", _fp8_cell))
    return cols


def _columns16(op: str, with_copy: bool = True):
    if op == "paged":
        return _paged_columns()
    cols = [("case", lambda r: r["case"]),
            ("backend", lambda r: r["backend"] + ("*" if r["kind"] == "anchor" else "")),
            ("median ms", lambda r: _f(r["median_ms"], "{:.4f}")),
            ("p20-p80 ms", lambda r: (f"{r['p20_ms']:.4f}-{r['p80_ms']:.4f}"
                                      if r["p20_ms"] is not None else "-"))]
    if op == "prefill":
        cols.append(("TFLOP/s", lambda r: _f(r["tflops"], "{:.1f}" if (r["tflops"] or 0) >= 1 else "{:.3g}")))
    else:
        cols.append(("TB/s", lambda r: _f(r["tbps"], "{:.3f}" if (r["tbps"] or 0) >= 0.01 else "{:.3g}")))
        if with_copy:  # only where a device copy was measured (GPU): see anchors.anchors_for
            cols.append(("% copy BW", lambda r: _f(r["pct_copy_bw"], "{:.0f}%")))
    cols += [("vs best anchor", lambda r: _f(r["vs_best_anchor"], "{:.2f}x" if (r["vs_best_anchor"] or 0) >= 0.01 else "{:.2g}x")),
             ("reps", lambda r: str(r["reps"]) if r["status"] == "ok" else "-"),
             ("note", lambda r: r["note"] if r["status"] == "ok"
              else f"{r['status'].upper()}: {r['error']}")]
    return cols


def shapes_line(rows: list[dict], op: str) -> str:
    """The head shape the cases of `op` share, e.g. "Hq=16 Hkv=8 D=128, block size 16"."""
    seen = []
    for r in rows:
        sh = r.get("shape")
        if r["op"] != op or not sh:
            continue
        text = f"Hq={sh['num_q_heads']} Hkv={sh['num_kv_heads']} D={sh['head_dim']}"
        if op in ("decode", "paged"):
            text += f", block size {sh['block_size']}, pages scattered at random"
        if text not in seen:
            seen.append(text)
    return "; ".join(seen)


def _table_cells(rows, op, with_copy=True):
    cols = _columns(op, with_copy, with_fp8=any(is_fp8(r) for r in rows if r["op"] == op))
    body = [[fn(r) for _, fn in cols] for r in rows if r["op"] == op]
    return [name for name, _ in cols], body


def text_table(rows: list[dict], op: str, copy_tbps: float | None = None, max_note: int = 70) -> str:
    header, body = _table_cells(rows, op, with_copy=bool(copy_tbps))
    body = [row[:-1] + [row[-1] if len(row[-1]) <= max_note else row[-1][: max_note - 3] + "..."]
            for row in body]
    widths = [max(len(h), *(len(b[i]) for b in body)) if body else len(h) for i, h in enumerate(header)]
    lines = [f"== {_OP_TITLE[op]} ==  (* = anchor; vs best anchor > 1 means faster)"]
    if shapes_line(rows, op):
        lines.append(shapes_line(rows, op))
    if op == "decode" and copy_tbps:
        lines.append(f"device copy bandwidth: {copy_tbps:.3g} TB/s (bytes read + written)")
    if op == "paged":
        lines.append("ratios: " + "; ".join(paged_legend()))
    lines.append("  ".join(h.ljust(w) for h, w in zip(header, widths)))
    lines.append("  ".join("-" * w for w in widths))
    prev_case = None
    for b in body:
        if prev_case is not None and b[0] != prev_case:
            lines.append("")
        prev_case = b[0]
        lines.append("  ".join(c.ljust(w) for c, w in zip(b, widths)).rstrip())
    if not body:
        lines.append("(no rows)")
    if op == "paged" and paged_targets_lines(rows):
        lines += ["", "targets:"] + ["  " + x for x in paged_targets_lines(rows)]
    fp8_rows = [r for r in rows if r["op"] == op and is_fp8(r)]
    if fp8_rows:
        lines += ["", FP8_LEGEND]
        lines += (["fp8 targets:"] + ["  " + x for x in fp8_targets_lines(fp8_rows)]) if fp8_targets_lines(fp8_rows) else []
    return "\n".join(lines)


def markdown_table(rows: list[dict], op: str, with_copy: bool = True) -> str:
    header, body = _table_cells(rows, op, with_copy)
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    for b in body:
        lines.append("| " + " | ".join(c.replace("|", "\\|") for c in b) + " |")
    return "\n".join(lines)


def crosscheck_table(rows: list[dict], dtype=None, markdown: bool = False) -> str:
    if not rows:
        return "(no cross-check)"
    header = ["op", "case", "backend", "max abs err", "tolerance", "result"]
    body = []
    for r in rows:
        if r["backend"] == "torch" and r.get("error") is None:
            result = "oracle (output rounding)"
        elif r.get("error"):
            result = f"ERROR: {r['error']}"
        else:
            result = "ok" if r["ok"] else "FAIL" + (f" ({r['note']})" if r.get("note") else "")
        body.append([r["op"] + (" fp8" if is_fp8(r) else ""), r["case"],
                     r["backend"] + ("*" if r.get("kind") == "anchor" else ""), _f(r.get("max_abs_err"), "{:.3e}", none="nan"),
                     _f(r.get("tol"), "{:.3e}"), result])
    if markdown:
        lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
        lines += ["| " + " | ".join(c.replace("|", "\\|") for c in b) + " |" for b in body]
        return "\n".join(lines)
    body = [b[:-1] + [b[-1] if len(b[-1]) <= 90 else b[-1][:87] + "..."] for b in body]
    widths = [max(len(h), *(len(b[i]) for b in body)) for i, h in enumerate(header)]
    title = "== Cross-check against the torch oracle (fp32)"
    if dtype is not None:
        title += f"; inputs {str(dtype).replace('torch.', '')}"
    lines = [title + " ==",
             "  ".join(h.ljust(w) for h, w in zip(header, widths)),
             "  ".join("-" * w for w in widths)]
    lines += ["  ".join(c.ljust(w) for c, w in zip(b, widths)).rstrip() for b in body]
    failed_anchors = [r for r in rows if not r.get("ok") and r.get("kind") == "anchor"]
    lines.append(crosscheck_verdict(rows))
    if failed_anchors:
        lines.append(f"{len(failed_anchors)} anchor check(s) failing (* rows): their timings compare "
                     "against a different computation")
    return "\n".join(lines)


def compared_backends(rows: list[dict]) -> list[str]:
    """Backends (not the torch oracle, not anchors) that the rows compare with the oracle."""
    return list(dict.fromkeys(r["backend"] for r in rows
                              if r.get("kind") != "anchor" and r.get("backend") not in ("torch", "-")))


def crosscheck_verdict(rows: list[dict]) -> str:
    """One line that claims only what the rows show."""
    failed = [r for r in rows if not r.get("ok") and r.get("kind") != "anchor"]
    if failed:
        return f"{len(failed)} failing"
    names = compared_backends(rows)
    if not names:
        return "only torch ran; nothing to compare"
    return f"{', '.join(names)} agree{'s' if len(names) == 1 else ''} with the oracle on every case"


def crosscheck_plan_text(compared, skipped) -> str:
    """Which backends were compared with the oracle and which were skipped, with the reason
    (compared [(backend, op)], skipped [(backend, op | None, reason)], see runner.crosscheck_plan)."""
    by_backend: dict[str, list[str]] = {}
    for b, op in compared:
        if b != "torch":
            by_backend.setdefault(b, []).append(op)
    lines = ["compared with the torch oracle: "
             + (", ".join(f"{b} ({', '.join(ops)})" for b, ops in by_backend.items()) or "none")]
    for b, op, why in skipped:
        lines.append(f"skipped: {b}{' ' + op if op else ''}: {why}")
    return "\n".join(lines)


def markdown_report(result: dict) -> str:
    env, cfg = result["env"], result["config"]
    lines = [
        "# minipaged benchmark results",
        "",
        f"- Device: {env['device_name']}"
        + (f", {env['sm_count']} SMs, compute capability {env['compute_capability']}" if env.get("sm_count") else ""),
        f"- Date (UTC): {env['date_utc']}",
        f"- Commit: `{env['git_commit']}`",
        f"- torch {env['torch']}, triton {env['triton']}, CUDA {env['cuda']}, cuDNN {env['cudnn']}",
        f"- dtype {cfg['dtype']}, {'quick grid' if cfg['quick'] else 'standard grid'}"
        + (", Triton interpreter" if env.get("triton_interpret") else ""),
        "",
        ("Median of many calls, each with a cold L2 (a buffer of at least 2x L2 is "
         + ("read" if env.get("l2_flush") == "read" else "overwritten")
         + " between calls, outside the timed CUDA events), random inputs, warm-up and compilation excluded. "
         if env.get("device_type") == "cuda" else
         "CPU run (time.perf_counter, no cache flush): it shows the harness works, not GPU speed. ")
        + "Anchors (marked *) ran in the same process. `vs best anchor` = fastest anchor's median "
        "/ this row's median (> 1: faster than every anchor).",
        "",
    ]
    if not result.get("complete"):
        lines += ["**Partial results: the run did not finish.**", ""]
    if result.get("crosscheck"):
        lines += ["## Cross-check", "", crosscheck_table(result["crosscheck"], markdown=True), "",
                  crosscheck_verdict(result["crosscheck"]) + ".", ""]
        for s in result.get("crosscheck_skipped", []):
            lines.append(f"- skipped: {s['backend']}{' ' + s['op'] if s.get('op') else ''}: {s['reason']}")
        if result.get("crosscheck_skipped"):
            lines.append("")
    for op in ("prefill", "decode", "paged"):
        if any(r["op"] == op for r in result["rows"]):
            lines += [f"## {_OP_TITLE[op]}", "", f"Shapes: {shapes_line(result['rows'], op)}.", ""]
            if op == "decode" and result.get("copy_bandwidth_tbps"):
                lines += [f"Device copy bandwidth: {result['copy_bandwidth_tbps']:.3f} TB/s "
                          "(bytes read + written).", ""]
            if op == "paged":
                lines += ["Cases: `chunked` = chunked prefill (q new tokens at the end of a context of L, "
                          "new ones included), `spec` = speculative verification, `mixed` = one prefill "
                          "chunk and many decodes in one launch. Anchor rows (`*`) named `<backend> <role>` "
                          "are that backend's own kernels on the same data: `dense` (prefill_attention_varlen "
                          "on the K/V made contiguous), `decode` (decode_attention, one query per sequence), "
                          "`chunk-paged` / `chunk-dense` / `decodes` (the mixed batch split into separate "
                          "launches). Decode-like cases (q <= 16) are timed as CUDA-graph replays on a GPU.", "",
                          "Target ratios (`ok` / `MISS`):", ""]
                lines += [f"- {x}" for x in paged_legend()] + [""]
            fp8_rows = [r for r in result["rows"] if r["op"] == op and is_fp8(r)]
            if fp8_rows:
                lines += ["FP8 KV cache rows (`<backend> fp8`, float8_e4m3fn pages with per-KV-head scales, "
                          "1 byte per cached element in TB/s) sit next to the 16-bit rows of the same run; "
                          f"{FP8_LEGEND}.", ""]
            lines += [markdown_table(result["rows"], op, with_copy=bool(result.get("copy_bandwidth_tbps"))), ""]
            if op == "paged" and paged_targets_lines(result["rows"]):
                lines += ["Targets measured:", ""] + [f"- {x}" for x in paged_targets_lines(result["rows"])] + [""]
            if fp8_targets_lines(fp8_rows):
                lines += ["FP8 targets measured:", ""] + [f"- {x}" for x in fp8_targets_lines(fp8_rows)] + [""]
    for note in result.get("notes", []):
        lines.append(f"- {note}")
    return "\n".join(lines) + "\n"
