"""PNG plots of a benchmark result (matplotlib is optional: the `bench` extra)."""

from __future__ import annotations

from pathlib import Path


def _series(rows, op):
    """{backend: [(row, ...)]} for successful rows of `op`, in grid order."""
    out: dict[str, list[dict]] = {}
    for r in rows:
        if r["op"] == op and r["status"] == "ok":
            out.setdefault(r["backend"], []).append(r)
    return out


def _style(backend: str, kind: str) -> dict:
    return dict(marker="o" if kind == "backend" else "s",
                linestyle="-" if kind == "backend" else "--",
                linewidth=2.0 if kind == "backend" else 1.2)


def _y_axis(ax, values, label: str) -> None:
    """Log y when the plotted values span more than a decade (a CPU run's interpreted
    Triton is ~1000x slower than torch, and would sit on zero on a linear axis)."""
    pos = [v for v in values if v and v > 0]
    if pos and max(pos) / min(pos) > 10:
        ax.set_yscale("log")
        label += " (log scale)"
    ax.set_ylabel(label)


def make_plots(result: dict, out_dir) -> tuple[list[Path], str | None]:
    """Write prefill.png (TFLOP/s against N, one panel per batch size) and
    decode.png (TB/s against B x L). Returns (paths, note-or-None)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return [], "plots skipped: matplotlib is not installed (pip install 'minipaged[bench]')"
    out_dir = Path(out_dir)
    env = result["env"]
    subtitle = (f"{env['device_name']}, {result['config']['dtype']}, torch {env['torch']}, "
                f"commit {str(env['git_commit'])[:10]}")
    paths = []

    prefill = _series(result["rows"], "prefill")
    if prefill:
        batches = sorted({r["shape"]["batch"] for rs in prefill.values() for r in rs})
        fig, axes = plt.subplots(1, len(batches), figsize=(6.5 * len(batches), 4.8), squeeze=False)
        for ax, batch in zip(axes[0], batches):
            ys = []
            for backend, rs in prefill.items():
                pts = sorted((r["shape"]["seqlen_q"], r["tflops"]) for r in rs if r["shape"]["batch"] == batch)
                if pts:
                    ys += [p[1] for p in pts]
                    ax.plot([p[0] for p in pts], [p[1] for p in pts],
                            label=backend + (" (anchor)" if rs[0]["kind"] == "anchor" else ""),
                            **_style(backend, rs[0]["kind"]))
            ax.set_xscale("log", base=2)
            ns = sorted({r["shape"]["seqlen_q"] for rs in prefill.values() for r in rs
                         if r["shape"]["batch"] == batch})
            ax.set_xticks(ns)
            ax.set_xticklabels([f"{n // 1024}k" if n % 1024 == 0 else str(n) for n in ns])
            ax.minorticks_off()
            ax.set_xlabel("sequence length N (Nq = Nk)")
            _y_axis(ax, ys, "TFLOP/s (exact causal FLOPs)")
            ax.set_title(f"causal prefill, B={batch}")
            ax.grid(True, alpha=0.3)
            ax.legend(fontsize=8)
        fig.suptitle(f"minipaged prefill - {subtitle}", fontsize=9)
        fig.tight_layout()
        p = out_dir / "prefill.png"
        fig.savefig(p, dpi=120)
        plt.close(fig)
        paths.append(p)

    decode = _series(result["rows"], "decode")
    if decode:
        # x: total cached tokens (B*L for a uniform batch), categorical so two cases with equal
        # totals both show; an uneven batch is labelled with its mean length
        cases = []
        for rs in decode.values():
            for r in rs:
                lens = r["shape"]["context_lens"]
                key = (sum(lens), r["shape"]["batch"], r["case"], len(set(lens)) > 1)
                if key not in cases:
                    cases.append(key)
        cases.sort()
        xpos = {c[2]: i for i, c in enumerate(cases)}
        fig, ax = plt.subplots(figsize=(8.5, 4.8))
        ys = []
        for backend, rs in decode.items():
            pts = sorted((xpos[r["case"]], r["tbps"]) for r in rs)
            ys += [p[1] for p in pts]
            ax.plot([p[0] for p in pts], [p[1] for p in pts],
                    label=backend + (" (anchor)" if rs[0]["kind"] == "anchor" else ""),
                    **_style(backend, rs[0]["kind"]))
        if result.get("copy_bandwidth_tbps"):
            ys.append(result["copy_bandwidth_tbps"])
            ax.axhline(result["copy_bandwidth_tbps"], color="gray", linestyle=":",
                       label=f"device copy {result['copy_bandwidth_tbps']:.3g} TB/s")
        ax.set_xticks(range(len(cases)))
        ax.set_xticklabels([f"B={c[1]}\nL={'~' if c[3] else ''}{c[0] // c[1]}"
                            + (f"\n({c[0] // 1024}k tok)" if c[0] >= 1024 else "") for c in cases], fontsize=8)
        ax.set_xlabel("batch x context length (sorted by cached tokens; ~: mean of an uneven batch)")
        _y_axis(ax, ys, "TB/s (K+V read + q + o)")
        ax.set_title("paged decode")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
        fig.suptitle(f"minipaged decode - {subtitle}", fontsize=9)
        fig.tight_layout()
        p = out_dir / "decode.png"
        fig.savefig(p, dpi=120)
        plt.close(fig)
        paths.append(p)
    return paths, None
