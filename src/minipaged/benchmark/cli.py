"""`minipaged bench` arguments and entry point (minipaged/cli.py calls
add_arguments(parser), then validate(args) and run(args)); also
`python -m minipaged.benchmark.cli`."""

from __future__ import annotations

import argparse
import sys


def add_arguments(parser: argparse.ArgumentParser, *, with_op: bool = True) -> None:
    if with_op:
        parser.add_argument("--op", choices=["prefill", "decode", "paged", "all"], default="all",
                            help="which op to benchmark: prefill, decode, paged (paged_attention: chunked "
                                 "prefill, speculative verification, a mixed batch) or all (default)")
    parser.add_argument("--backends", default=None,
                        help="comma-separated backends to time (default: every available one of "
                             "torch, triton, cuda, cuda-wmma); a named backend that cannot run here is an error")
    parser.add_argument("--anchors", default=None,
                        help="comma-separated anchors or 'none' (default: all that exist here). On a GPU: "
                             "sdpa-flash, sdpa-cudnn, sdpa-efficient, flex (prefill), copy (decode), "
                             "flashinfer-ragged, flashinfer-paged (prefill, paged), flashinfer-decode, "
                             "flashinfer-decode-tc (decode), flashinfer-decode-fp8 (decode, with --kv-cache-dtype fp8) when "
                             "flashinfer imports; on CPU: sdpa-cpu "
                             "(torch's CPU kernel); both: same-backend (paged: the backend's dense varlen / "
                             "decode / split launches). A named anchor that cannot run here is an error")
    parser.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], default=None,
                        help="input dtype (default: bfloat16 on a GPU, float32 in the CPU quick mode)")
    parser.add_argument("--kv-cache-dtype", default="auto", dest="kv_cache_dtype", metavar="{auto,fp8}",
                        help="auto (default): caches in the input dtype. fp8: the decode and paged grids also "
                             "run every backend with float8_e4m3fn KV kernels on an fp8 copy of each case's "
                             "cache (per-KV-head scales; TB/s at 1 byte per cached element), next to its "
                             "16-bit rows (a speed-up column), with an fp8 cross-check against the torch "
                             "oracle on the same fp8 cache and FlashInfer's fp8 decode (flashinfer-decode-fp8) "
                             "when it imports. Needs --dtype bfloat16/float16 (CPU default: float16)")
    parser.add_argument("--heads", default=None, metavar="HQ/HKV[/D]",
                        help="head layout of every case (prefill, decode, paged and the cross-check): query "
                             "heads / KV heads [/ head dim], HQ a multiple of HKV, e.g. 32/8 (Qwen3-8B) or "
                             "64/8/128 (Qwen3-32B). Default: 16/8/128 (Qwen3-0.6B) on the standard grid, "
                             "4/2/64 on the quick grid; without D the grid's head dim (128 / 64). A backend "
                             "named in --backends that cannot run the head dim is an error; one not named is "
                             "left out with a note")
    parser.add_argument("--page-size", type=int, default=16, dest="page_size", metavar="N",
                        help="tokens per KV-cache page in every decode and paged case and their cross-checks "
                             "(the fp8 one included): a power of two from 1 to 256 (default 16). The prefill "
                             "grid reads no pages and ignores it")
    parser.add_argument("--out", default=None,
                        help="results folder (default: ./minipaged-bench-results/<device>[-quick], with "
                             "-h<HQ>x<HKV>x<D> appended when --heads differs from the grid's default and "
                             "-p<N> when --page-size is not 16; printed at the end)")
    parser.add_argument("--quick", action="store_true",
                        help="small shapes; on a machine without a GPU the quick grid (torch and "
                             "Triton-interpreter rows) is chosen anyway, and the run says so")
    parser.add_argument("--reps", type=int, default=None,
                        help="most timed calls per row, >= 1 (default 100 on GPU, 5 on CPU); fewer when "
                             "--max-time runs out first")
    parser.add_argument("--max-time", type=float, default=None, dest="max_time",
                        help="seconds of timed calls per row (default 0.3 GPU / 0.5 CPU; <= 0: exactly --reps)")
    parser.add_argument("--time-budget", type=float, default=None, dest="time_budget",
                        help="after this many seconds, remaining rows use the minimum rep count")
    parser.add_argument("--no-crosscheck", action="store_true", help="skip the cross-check against torch")
    parser.add_argument("--no-plots", action="store_true", help="write no PNG plots")
    parser.add_argument("--no-progress", action="store_true", help="no tqdm progress bar")
    parser.add_argument("--strict", action="store_true",
                        help="exit 1 when a backend fails the cross-check (default: report and exit 0)")
    parser.add_argument("--seed", type=int, default=0)


def _names(value):
    if value is None:
        return None
    value = value.strip()
    if value.lower() in ("", "none"):
        return []
    return [v.strip().lower() for v in value.split(",") if v.strip()]


def _config(args: argparse.Namespace, op: str | None):
    from .runner import BenchConfig, parse_heads

    heads = getattr(args, "heads", None)

    return BenchConfig(
        op=op or getattr(args, "op", "all"),
        backends=_names(args.backends),
        anchors=_names(args.anchors),
        dtype=args.dtype,
        out=args.out,
        quick=args.quick,
        reps=args.reps,
        max_time_s=args.max_time,
        time_budget_s=args.time_budget,
        crosscheck=not args.no_crosscheck,
        plots=not args.no_plots,
        progress=not args.no_progress,
        seed=args.seed,
        kv_cache_dtype=getattr(args, "kv_cache_dtype", "auto"),
        heads=None if heads is None else parse_heads(heads),
        page_size=getattr(args, "page_size", 16),
    )


def validate(args: argparse.Namespace, *, op: str | None = None) -> None:
    """Check every flag before anything is timed (raises ValueError, TypeError,
    BackendUnavailableError or OSError; the CLI prints it as one `error:` line, exit 2).
    Decides about the Triton interpreter first: without a GPU it is the only way the
    triton rows can run, and it must be set before anything imports triton kernels."""
    from .runner import check_config

    cfg = _config(args, op)
    if cfg.backends == [] and cfg.anchors == []:
        # (it timed nothing, printed "(no rows)", wrote empty results and exited 0)
        raise ValueError(f"--backends {args.backends!r} and --anchors {args.anchors!r} leave nothing to time; "
                         "name a backend or an anchor, or leave a flag out for its default")
    args.bench_config, args.bench_plan = cfg, check_config(cfg)


def run(args: argparse.Namespace, *, op: str | None = None) -> int:
    """Run after validate(args) (minipaged.cli.run_checked calls both)."""
    from .runner import results_exit_code, run_bench

    if getattr(args, "bench_plan", None) is None:
        validate(args, op=op)
    result = run_bench(args.bench_config, args.bench_plan)
    return results_exit_code(result) if args.strict else 0


def main(argv=None, *, op: str | None = None, prog: str = "minipaged bench") -> int:
    from ..cli import ArgumentParser, run_checked

    parser = ArgumentParser(prog=prog, description="Benchmark minipaged's attention "
                            "backends against PyTorch's SDPA/FlexAttention, FlashInfer (when importable) "
                            "and copy bandwidth.")
    add_arguments(parser, with_op=op is None)
    parser.set_defaults(func=lambda a: run(a, op=op), validate=lambda a: validate(a, op=op))
    return run_checked(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
