"""`minipaged info | check | bench | generate`."""

from __future__ import annotations

import argparse
import importlib
import sys


def _info(args) -> int:
    import torch

    from . import registry

    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda":
        props = torch.cuda.get_device_properties(0)
        dev = f"{props.name} (sm_{props.major}{props.minor}, {props.multi_processor_count} SMs, {props.total_memory / 2**30:.0f} GiB)"
    else:
        dev = "CPU only (no CUDA device visible to torch)"
    try:
        import triton

        triton_v = triton.__version__
    except Exception as e:  # noqa: BLE001 - any import failure is worth printing
        triton_v = f"not importable ({type(e).__name__})"
    print("minipaged", _version())
    print(f"device : {dev}")
    print(f"torch  : {torch.__version__} (CUDA {torch.version.cuda})")
    print(f"triton : {triton_v}")
    print()
    rows = []
    for name, b in registry.all_backends().items():
        for dev_type in b.devices:
            ok, why = b.is_available(dev_type)
            rows.append((name, dev_type, "yes" if ok else "no", ", ".join(b.dtypes), ",".join(map(str, b.head_dims)), why))
    header = ("backend", "device", "available", "dtypes", "head dims", "why")
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    for r in [header, *rows]:
        print("  ".join(str(c).ljust(w) for c, w in zip(r, widths)).rstrip())
    print()
    for op in ("prefill", "decode"):
        chosen, source = registry.requested_name(op)
        try:
            b = registry.resolve(op, device, None)
            print(f"{op:<8}: {b.name} on {device} (from {source}={chosen})" if source != "auto" else f"{op:<8}: auto picks {b.name} on {device}")
        except Exception as e:  # noqa: BLE001 - report, don't crash, in a status command
            print(f"{op:<8}: {type(e).__name__}: {e}")
    return 0


def _check(args) -> int:
    """Cross-check every available backend against the fp32 torch oracle; exit 1 on a mismatch."""
    import torch

    if not torch.cuda.is_available():
        from .benchmark.runner import enable_triton_interpreter

        enable_triton_interpreter()
    from .benchmark import report, runner

    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    dtype = getattr(torch, args.dtype) if args.dtype else (torch.bfloat16 if device.type == "cuda" else torch.float32)
    backends = [b for b, (ok, _) in _available(device.type).items() if ok]
    rows, failures = runner.crosscheck(backends, device, dtype, device.type == "cpu", print)
    print(report.crosscheck_table(rows, dtype))
    bad = [r for r in rows if not r.get("ok")]
    for r in bad:
        print(f"FAIL {r['backend']} {r['op']} {r['case']}: {r.get('error') or r.get('max_abs_err')}")
    return 1 if bad else 0


def _available(device: str):
    from . import registry

    return registry.available_backends(device)


def _version() -> str:
    from . import __version__

    return __version__


# subcommand -> module providing add_arguments(parser) and run(args) -> int
_DELEGATES = {
    "bench": ("minipaged.benchmark.cli", "cross-check every backend, then benchmark prefill/decode against PyTorch's attention"),
    "generate": ("minipaged.engine.cli", "generate text with the paged Qwen3 engine"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="minipaged", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("info", help="backends, device, versions, and what auto picks")
    p.set_defaults(func=_info)
    p = sub.add_parser("check", help="cross-check every available backend against the torch oracle")
    p.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], default=None)
    p.set_defaults(func=_check)
    for name, (module, help_text) in _DELEGATES.items():
        p = sub.add_parser(name, help=help_text)
        try:
            mod = importlib.import_module(module)
        except ImportError as e:
            p.set_defaults(func=lambda args, e=e, name=name: _missing(name, e))
            continue
        mod.add_arguments(p)
        p.set_defaults(func=mod.run)
    return parser


def _missing(name: str, err: Exception) -> int:
    print(f"minipaged {name} is unavailable: {err}", file=sys.stderr)
    return 2


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
