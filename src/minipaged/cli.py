"""`minipaged info | check | bench | generate`.

Every command checks its arguments (and the MINIPAGED_*BACKEND variables)
before doing any work; bad input prints one `error: ...` line on stderr and
exits 2. Errors raised later, while the work runs, are not caught here: they
are bugs or failures worth a traceback, not usage errors.
"""

from __future__ import annotations

import argparse
import importlib
import sys

# What argument checks raise for bad user input (registry.BackendUnavailableError
# is added in _user_errors(): importing the registry here would be cheap, but keep
# `minipaged --help` independent of the package's import).
_USER_ERROR_TYPES = (ValueError, TypeError, OSError)


def _user_errors() -> tuple[type[BaseException], ...]:
    from .registry import BackendUnavailableError

    return (*_USER_ERROR_TYPES, BackendUnavailableError)


def print_error(e: BaseException | str) -> int:
    """Print `error: <message>` as one line on stderr; returns the usage-error exit code 2."""
    # (a KeyError's str() is the repr of its message: quoted)
    msg = e.args[0] if isinstance(e, KeyError) and len(e.args) == 1 and isinstance(e.args[0], str) else e
    text = " ".join(str(msg).split()) or type(e).__name__
    print(f"error: {text}", file=sys.stderr)
    return 2


class ArgumentParser(argparse.ArgumentParser):
    """argparse, with its usage errors (a missing command, an unknown flag, a value that is not
    an int or not among the choices) printed as the one `error:` line every other bad input
    gets, exit 2; `--help` still prints the usage."""

    def error(self, message: str):
        print_error(f"{self.prog}: {message} (see `{self.prog} --help`)")
        sys.exit(2)


def check_backend_env() -> None:
    """An unknown name in MINIPAGED_BACKEND / MINIPAGED_{PREFILL,DECODE}_BACKEND is a
    ValueError naming the variable and the valid names (never ignored)."""
    from . import registry

    for op in registry.OPS:
        registry.requested_name(op)


def run_checked(args: argparse.Namespace) -> int:
    """Validate (args.validate, if the command has one), then run args.func.

    Only the validation step turns exceptions into `error:` lines; the run itself
    reports its own expected failures and lets anything else propagate."""
    validate = getattr(args, "validate", None)
    try:
        check_backend_env()
        if validate is not None:
            validate(args)
    except _user_errors() as e:
        return print_error(e)
    return int(args.func(args) or 0)


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
            dtypes, dtype_why = b.supported_dtypes(dev_type)
            if dtype_why and ok:
                why = f"{why}; {dtype_why}"
            rows.append((name, dev_type, "yes" if ok else "no", ", ".join(dtypes), ",".join(map(str, b.head_dims)), why))
    header = ("backend", "device", "available", "dtypes", "head dims", "why")
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    for r in [header, *rows]:
        print("  ".join(str(c).ljust(w) for c, w in zip(r, widths)).rstrip())
    print()
    for op in registry.OPS:
        chosen, source = registry.requested_name(op)
        try:
            b = registry.resolve(op, device, None)
            print(f"{op:<14}: {b.name} on {device} (from {source}={chosen})" if source != "auto"
                  else f"{op:<14}: auto picks {b.name} on {device}")
        except registry.BackendUnavailableError as e:
            # a status command reports what the environment asks for and why it cannot run
            print(f"{op:<14}: {type(e).__name__}: {e}")
    return 0


_CHECK_OPS = ("prefill", "decode")


def _check_setup(args):
    import torch

    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    dtype = getattr(torch, args.dtype) if args.dtype else (torch.bfloat16 if device.type == "cuda" else torch.float32)
    return device, dtype


def _check_validate(args) -> None:
    """--heads and --page-size as the bench takes them (ValueError / TypeError: one `error:` line, exit 2)."""
    from .benchmark import runner

    runner.check_page_size(args.page_size)
    if args.heads is None:
        return
    heads = runner.check_heads(runner.parse_heads(args.heads))
    why = heads[2] is not None and runner.head_dim_reason("torch", heads[2])
    if why:
        raise ValueError(f"--heads {args.heads}: the torch oracle cannot run it: {why}")


def _check(args) -> int:
    """Cross-check every backend that can run here against the fp32 torch oracle.

    Prints which backends were compared and which were skipped (with the reason).
    Exit 0: at least one backend besides torch was compared and all agree;
    1: a mismatch or an error, or nothing besides the oracle could run (then
    nothing was verified, so the check did not pass)."""
    import torch

    if not torch.cuda.is_available():
        from .benchmark.runner import enable_triton_interpreter

        enable_triton_interpreter()
    from .benchmark import cases, report, runner

    device, dtype = _check_setup(args)
    quick = device.type == "cpu"
    heads = cases.grid_heads(quick, None if args.heads is None else runner.parse_heads(args.heads))
    compared, skipped = runner.crosscheck_plan(list(_available_all()), device, dtype, _CHECK_OPS)
    # a backend that cannot run the layout's head dim is skipped with the reason, as one that cannot run here
    unfit = {b: why for b in {b for b, _ in compared} if (why := runner.head_dim_reason(b, heads["head_dim"]))}
    skipped += [(b, None, unfit[b]) for b in sorted(unfit)]
    compared = [(b, op) for b, op in compared if b not in unfit]
    runnable = sorted({b for b, _ in compared}, key=list(_available_all()).index)
    rows, _failures = runner.crosscheck(runnable, device, dtype, quick, print, _CHECK_OPS, heads=heads,
                                        page_size=args.page_size)
    print(report.crosscheck_table(rows, dtype))
    print(report.crosscheck_plan_text(compared, skipped))
    bad = [r for r in rows if not r.get("ok")]
    for r in bad:
        print(f"FAIL {r['backend']} {r['op']} {r['case']}: {r.get('error') or r.get('max_abs_err')}")
    if bad:
        return 1
    if not any(b != "torch" for b, _ in compared):
        print("exit 1: no backend besides the torch oracle could be verified here")
        return 1
    return 0


def _available_all():
    from . import registry

    return registry.all_backends()


def _version() -> str:
    from . import __version__

    return __version__


# subcommand -> module providing add_arguments(parser), validate(args) and run(args) -> int
_DELEGATES = {
    "bench": ("minipaged.benchmark.cli", "cross-check every backend, then benchmark prefill/decode against PyTorch's attention"),
    "generate": ("minipaged.engine.cli", "generate text with the paged Qwen3 engine"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(prog="minipaged", description=__doc__,
                            formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("info", help="backends, device, versions, and what auto picks")
    p.set_defaults(func=_info)
    p = sub.add_parser("check", help="cross-check every available backend against the torch oracle",
                       description=_check.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], default=None,
                   help="input dtype (default: bfloat16 on a GPU, float32 on CPU)")
    p.add_argument("--heads", default=None, metavar="HQ/HKV[/D]",
                   help="head layout of the cases, as `minipaged bench --heads` takes it (e.g. 32/8); "
                        "default 16/8/128 on a GPU, 4/2/64 on CPU; a backend that cannot run the head "
                        "dim is skipped with the reason")
    p.add_argument("--page-size", type=int, default=16, dest="page_size", metavar="N",
                   help="tokens per KV-cache page of the decode cases, as `minipaged bench --page-size` takes "
                        "it: a power of two from 1 to 256 (default 16)")
    p.set_defaults(func=_check, validate=_check_validate)
    for name, (module, help_text) in _DELEGATES.items():
        p = sub.add_parser(name, help=help_text)
        try:
            mod = importlib.import_module(module)
        except ImportError as e:
            p.set_defaults(func=lambda args, e=e, name=name: _missing(name, e))
            continue
        mod.add_arguments(p)
        p.set_defaults(func=mod.run, validate=getattr(mod, "validate", None))
    return parser


def _missing(name: str, err: Exception) -> int:
    return print_error(f"minipaged {name} is unavailable: {err}")


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return run_checked(args)


if __name__ == "__main__":
    sys.exit(main())
