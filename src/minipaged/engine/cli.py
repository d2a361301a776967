"""`minipaged generate`: run the paged Qwen3 engine and report tokens/s.

Without --model the real Qwen3-0.6B shape runs with random weights on random
prompts (a throughput check). With a checkpoint folder holding a tokenizer,
--prompt TEXT is tokenised and the output printed as text.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", metavar="DIR", default=None,
                   help="local Qwen3 checkpoint folder (default: Qwen3-0.6B shape, random weights)")
    p.add_argument("--batch", type=int, default=8, metavar="N", help="number of prompts (default 8)")
    p.add_argument("--prompt-len", type=int, default=128, metavar="N",
                   help="tokens per random prompt when --prompt is not given (default 128)")
    p.add_argument("--max-new-tokens", type=int, default=64, metavar="N", help="default 64")
    p.add_argument("--backend", default=None, help="attention backend: auto, torch, triton, cuda (default: env / auto)")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "float16", "bfloat16"],
                   help="auto: bfloat16 on CUDA, float32 on CPU")
    p.add_argument("--prompt", default=None, metavar="TEXT",
                   help="text prompt (needs a tokenizer in --model); repeated --batch times")
    p.add_argument("--chat", action="store_true", help="wrap --prompt in the tokenizer's chat template")
    p.add_argument("--no-thinking", action="store_true",
                   help="with --chat: pass enable_thinking=False to the template (Qwen3's switch to answer "
                        "without a <think> block)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus mass in (0, 1] (default 1: off)")
    p.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens (default 0: off)")
    p.add_argument("--presence-penalty", type=float, default=0.0,
                   help="subtracted from the logit of every token already generated, in [-2, 2] (default 0)")
    p.add_argument("--frequency-penalty", type=float, default=0.0,
                   help="subtracted once per earlier occurrence in the output, in [-2, 2] (default 0)")
    p.add_argument("--repetition-penalty", type=float, default=1.0,
                   help="divides positive / multiplies negative logits of prompt and output tokens, > 0 (default 1)")
    p.add_argument("--seed", type=int, default=0, help="seed of random weights, prompts and sampling")
    p.add_argument("--device", default=None, help="cuda or cpu (default: cuda when available)")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--num-blocks", type=int, default=None, help="KV pages (default: from free memory)")
    p.add_argument("--max-num-seqs", type=int, default=None, help="default: --batch")
    p.add_argument("--no-cuda-graph", action="store_true", help="decode eagerly on CUDA")
    p.add_argument("--max-num-batched-tokens", type=int, default=8192, metavar="N",
                   help="token budget of one step: running decodes, then prompt chunks (default 8192)")
    p.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8"],
                   help="auto: the model dtype; fp8: float8_e4m3fn KV pages with per-head scales (the "
                        "checkpoint's, else from the first prompt step's K/V amax with an 8x margin)")
    p.add_argument("--no-prefix-caching", action="store_true",
                   help="recompute shared prompt prefixes instead of reusing their cached blocks")
    p.add_argument("--ignore-eos", action="store_true", help="always generate --max-new-tokens tokens")
    p.add_argument("--stream", action="store_true",
                   help="print the text as it is generated (needs --prompt and --batch 1; runs the engine's "
                        "online API, add_request / step)")
    p.add_argument("--batch-invariant", action="store_true",
                   help="batch-invariant kernels (triton): a request's tokens do not depend on its batch, its "
                        "chunks or prefix-cache hits; slower")


# Files of a Hugging Face tokenizer: without one of them AutoTokenizer may still return an
# empty tokenizer (vocab of 1, eos id 0) instead of raising.
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def _has_tokenizer(model_dir: str) -> bool:
    return any(os.path.isfile(os.path.join(model_dir, f)) for f in _TOKENIZER_FILES)


def _load_tokenizer(model_dir: str | None):
    """(tokenizer or None, why it could not be loaded or None)."""
    if model_dir is None or not _has_tokenizer(model_dir):
        return None, None
    try:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(model_dir, local_files_only=True), None
    except Exception as e:  # noqa: BLE001 - no usable tokenizer: token-id mode
        return None, f"{type(e).__name__}: {' '.join(str(e).split())[:200]}"


# Counts of tokens, sequences and blocks: the engine keeps them in int32 tensors (block tables,
# positions), so larger values are refused here rather than failing inside the engine.
_INT32_MAX = 2**31 - 1


def _positive(flag: str, value, *, allow_none: bool = False, minimum: int = 1, maximum: int = _INT32_MAX) -> None:
    if value is None and allow_none:
        return
    if value is None or not minimum <= value <= maximum:
        shown = value if value is None or len(str(value)) <= 20 else f"a {len(str(value))}-digit number"
        raise ValueError(f"{flag} must be an integer from {minimum} to {maximum}, got {shown}")


def validate(args: argparse.Namespace) -> None:
    """Every flag is checked here, before the tokenizer, the weights or the KV
    cache exist. Raises ValueError / BackendUnavailableError naming the flag,
    the value and the rule (the CLI prints it as one `error:` line, exit 2)."""
    import torch

    from .. import registry
    from ..api import MAX_BLOCK_SIZE, is_block_size
    from .sampler import SAMPLING_FIELDS, make_sampling_params

    _positive("--batch", args.batch)
    _positive("--prompt-len", args.prompt_len)
    _positive("--max-new-tokens", args.max_new_tokens, minimum=0)
    _positive("--num-blocks", args.num_blocks, allow_none=True)
    # 0 is not "use the default": only leaving the flag out is
    _positive("--max-num-seqs", args.max_num_seqs, allow_none=True)
    _positive("--max-num-batched-tokens", args.max_num_batched_tokens)
    # torch.manual_seed takes any 64-bit pattern
    _positive("--seed", args.seed, minimum=-(2**63), maximum=2**64 - 1)
    if not is_block_size(args.block_size):
        raise ValueError(f"--block-size must be a power of two from 1 to {MAX_BLOCK_SIZE}, got {args.block_size}")
    _positive("--top-k", args.top_k, minimum=0)
    # the engine's own sampling rules, with the flags named in the message
    try:
        make_sampling_params(args.temperature, args.top_p, args.top_k, args.presence_penalty,
                             args.frequency_penalty, args.repetition_penalty)
    except ValueError as e:
        msg = str(e)
        for name in SAMPLING_FIELDS:
            msg = msg.replace(name, "--" + name.replace("_", "-"))
        raise ValueError(msg) from None
    if args.chat and args.prompt is None:
        raise ValueError("--chat needs --prompt TEXT (it wraps that text in the chat template)")
    if args.stream and (args.prompt is None or args.batch != 1):
        raise ValueError("--stream prints one request's text as it is generated: it needs --prompt TEXT and "
                         "--batch 1")
    if args.no_thinking and not args.chat:
        raise ValueError("--no-thinking needs --chat (it is a switch of the chat template)")
    if args.prompt is not None and args.model is None:
        raise ValueError("--prompt needs --model DIR: the random-weight model has no tokenizer "
                         "(leave --prompt out to time random token prompts)")
    if args.model is not None and os.path.exists(args.model) and not os.path.isdir(args.model):
        # (a config.json or .safetensors path was reported as "no such folder")
        raise NotADirectoryError(f"--model {args.model!r} is a file; pass the checkpoint folder (config.json "
                                 "and *.safetensors)")
    if args.model is not None and not os.path.isdir(args.model):
        raise FileNotFoundError(f"--model {args.model!r}: no such folder (a local Qwen3 checkpoint "
                                "folder with config.json and *.safetensors)")
    # optional packages the run would import only after the weights or the engine exist (a traceback there)
    if args.model is not None and importlib.util.find_spec("safetensors") is None:
        raise ValueError("--model needs the safetensors package to read the checkpoint: pip install safetensors "
                         "(or minipaged[hf])")
    if args.prompt is not None and importlib.util.find_spec("transformers") is None:
        raise ValueError("--prompt needs the transformers package for the tokenizer: pip install transformers "
                         "(or minipaged[hf])")
    if args.prompt == "" and not args.chat:
        # (refused only after the weights were loaded, as "prompt 0 is empty")
        raise ValueError("--prompt is empty; a prompt needs at least one token")
    if args.batch_invariant and args.kv_cache_dtype == "fp8" and args.model is None:
        # the engine refuses this pair without checkpoint K/V scales; random weights have none, and
        # the 0.6B random weights would be drawn first
        raise ValueError("--batch-invariant with --kv-cache-dtype fp8 needs a --model whose checkpoint has "
                         "k_scale/v_scale tensors (random weights have none)")
    if args.prompt is not None and not _has_tokenizer(args.model):
        raise ValueError(f"--prompt needs a tokenizer in --model {args.model!r} "
                         f"(one of {', '.join(_TOKENIZER_FILES)})")
    if args.prompt is None:
        _check_lengths(args)

    device = _device(args.device)
    dtype = (torch.bfloat16 if device.type == "cuda" else torch.float32) if args.dtype == "auto" \
        else getattr(torch, args.dtype)
    if args.kv_cache_dtype == "fp8" and dtype not in (torch.float16, torch.bfloat16):
        raise ValueError(f"--kv-cache-dtype fp8 needs --dtype float16 or bfloat16, got {str(dtype)[6:]}")
    dtype_name = str(dtype).replace("torch.", "")
    # the ops the engine runs, resolved as it will: --backend, else the MINIPAGED_* variables, else auto
    if args.backend is not None and args.backend.strip().lower() not in registry.backend_names():
        raise ValueError(f"--backend {args.backend!r}: unknown backend; valid names are "
                         f"{', '.join(registry.backend_names())}")
    backend_flag = "--backend"
    if args.batch_invariant:
        if args.backend is not None and args.backend.strip().lower() not in ("auto", "triton"):
            raise ValueError(f"--batch-invariant runs on the triton kernels; got --backend {args.backend}")
        if args.backend is None:
            # errors below name the flag the user gave (they said "--backend triton" to one who had not)
            backend_flag = "--batch-invariant"
        args.backend = "triton"  # what the engine will bind: resolved and checked below like any --backend
    for op in _ENGINE_OPS:
        if op not in registry.OPS:
            continue
        _chosen, source = registry.requested_name(op, args.backend)
        flag = backend_flag if source == "backend=" else source
        fp8 = args.kv_cache_dtype == "fp8" and op != "prefill_varlen"
        try:
            b = registry.resolve(op, device.type, args.backend, fp8_kv=fp8)
        except registry.BackendUnavailableError as e:
            if source != "backend=":
                raise
            shown = f"--backend {args.backend}" if backend_flag == "--backend" else f"{backend_flag} (triton)"
            raise registry.BackendUnavailableError(f"{shown}: {e}".replace(" (from backend=)", "")) from None
        named = "--batch-invariant (triton)" if flag == "--batch-invariant" else f"{flag}={b.name}"
        if dtype_name not in b.dtypes:
            raise ValueError(f"{named}: backend {b.name!r} does not run {dtype_name} "
                             f"(its dtypes: {', '.join(b.dtypes)}); pick --dtype from those")
        if fp8 and not b.fp8_kv:
            raise ValueError(f"{named}: --kv-cache-dtype fp8 needs a backend with FP8 KV-cache "
                             f"kernels ({', '.join(n for n, x in registry.all_backends().items() if x.fp8_kv)})")
        if b.name == "triton" and device.type == "cpu" and dtype == torch.bfloat16:
            raise ValueError(f"{named} with --dtype bfloat16 on CPU: the Triton interpreter's "
                             "bf16 tl.dot gives wrong results; use --dtype float16 or float32")


def _check_lengths(args: argparse.Namespace) -> None:
    """--prompt-len against the model's length limit and, when given, --num-blocks: as the engine
    would find them, but before its weights are built."""
    from .config import Qwen3Config, qwen3_0_6b_config
    from .engine import default_max_model_len
    from .scheduler import peak_cached_tokens

    try:
        cfg = qwen3_0_6b_config() if args.model is None else Qwen3Config.from_any(args.model)
    except Exception:  # noqa: BLE001 - a bad config.json is reported by the engine with its context
        return
    max_len = default_max_model_len(cfg)
    if args.prompt_len > max_len:
        raise ValueError(f"--prompt-len {args.prompt_len} exceeds the model's max_model_len={max_len}")
    if args.num_blocks is not None:
        need = -(-peak_cached_tokens(args.prompt_len, args.max_new_tokens, max_len) // args.block_size)
        if need > args.num_blocks:
            raise ValueError(f"--num-blocks {args.num_blocks}: a prompt of {args.prompt_len} tokens with "
                             f"--max-new-tokens {args.max_new_tokens} needs up to {need} blocks of "
                             f"{args.block_size} tokens")


# the registry ops Engine calls (paged is used once the engine has chunked prefill)
_ENGINE_OPS = ("prefill_varlen", "decode", "paged", "write_kv_cache")


def _device(name: str | None):
    import torch

    if name is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(name)
    except (RuntimeError, ValueError):
        dev = None
    if dev is None or dev.type not in ("cpu", "cuda") or (dev.type == "cpu" and dev.index is not None):
        raise ValueError(f"--device must be cpu, cuda or cuda:N, got {name!r}")
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            why = "this torch build has no CUDA support" if torch.version.cuda is None \
                else "torch sees no CUDA device"
            raise ValueError(f"--device {name}: {why} (torch {torch.__version__}); use --device cpu")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise ValueError(f"--device {name}: only {torch.cuda.device_count()} CUDA device(s) visible")
    return dev


def run(args: argparse.Namespace) -> int:
    """Run after validate(args) (minipaged.cli.run_checked calls both)."""
    import torch

    from .. import registry
    from .engine import Engine

    tokenizer, why = _load_tokenizer(args.model)
    if args.prompt is not None and tokenizer is None:
        # (the files are there, validate() checked: say why they could not be read, not that they are missing)
        return _error(f"--prompt: the tokenizer in --model {args.model!r} cannot be loaded"
                      f"{' (' + why + ')' if why else ''}")

    try:
        eng = Engine(args.model, dtype=args.dtype, device=args.device, backend=args.backend,
                     block_size=args.block_size, num_blocks=args.num_blocks,
                     max_num_seqs=args.max_num_seqs if args.max_num_seqs is not None else args.batch,
                     seed=args.seed, cuda_graph=False if args.no_cuda_graph else None,
                     max_num_batched_tokens=args.max_num_batched_tokens,
                     enable_prefix_caching=not args.no_prefix_caching,
                     kv_cache_dtype="fp8" if args.kv_cache_dtype == "fp8" else None,
                     batch_invariant=args.batch_invariant)
    except (OSError, ValueError, KeyError, NotImplementedError, registry.BackendUnavailableError) as e:
        # the flags passed validate(); what is left is the checkpoint folder's content
        return _error(e)
    except RuntimeError as e:
        # a --num-blocks whose KV cache the device cannot hold (an out-of-memory error, or a size
        # torch cannot even compute) is a usage error too; anything else is a failure
        text = str(e).lower()
        if args.num_blocks is not None and (isinstance(e, torch.cuda.OutOfMemoryError) or "alloc" in text
                                            or "out of memory" in text or "overflow" in text):
            return _error(f"--num-blocks {args.num_blocks}: the KV cache cannot be allocated on "
                          f"{_device(args.device)} ({' '.join(str(e).split())[:160]})")
        raise
    print(eng, file=sys.stderr)

    if args.prompt is not None:
        text = args.prompt
        if args.chat and getattr(tokenizer, "chat_template", None):
            # (a template that does not read enable_thinking ignores it)
            extra = {"enable_thinking": False} if args.no_thinking else {}
            text = tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                                 add_generation_prompt=True, **extra)
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        prompts = [list(ids) for _ in range(args.batch)]
    else:
        g = torch.Generator().manual_seed(args.seed)
        vocab = eng.config.vocab_size
        prompts = [torch.randint(0, vocab, (args.prompt_len,), generator=g).tolist() for _ in range(args.batch)]

    if eng.device.type == "cuda":
        print("warming up (kernel JIT, CUDA graph capture) ...", file=sys.stderr)
        eng.warmup()
    stop = []
    # the tokenizer's EOS is one more EOS id: --ignore-eos ignores it as well
    if tokenizer is not None and tokenizer.eos_token_id is not None and not args.ignore_eos:
        stop.append(int(tokenizer.eos_token_id))
    sampling = dict(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                    presence_penalty=args.presence_penalty, frequency_penalty=args.frequency_penalty,
                    repetition_penalty=args.repetition_penalty, seed=args.seed, stop_token_ids=stop,
                    ignore_eos=args.ignore_eos)
    try:
        if args.stream and args.max_new_tokens > 0:
            outs = [_stream(eng, tokenizer, prompts[0], args.max_new_tokens, sampling)]
        else:
            outs = eng.generate(prompts, max_new_tokens=args.max_new_tokens, progress=True, **sampling)
    except ValueError as e:  # e.g. a tokenizer producing ids outside the model's vocabulary
        return _error(e)

    st = eng.stats
    if args.stream:
        pass  # the text is printed
    elif tokenizer is not None and args.prompt is not None:
        shown = outs if args.temperature > 0 else outs[:1]  # greedy copies are identical
        for i, o in enumerate(shown):
            print(f"--- output {i} ({len(o)} tokens)")
            print(tokenizer.decode(o, skip_special_tokens=True))
    else:
        print(f"first output tokens: {outs[0][:16]}{' ...' if len(outs[0]) > 16 else ''}")
    print(f"prefill: {st.prefill_tokens} tokens in {st.prefill_seconds * 1e3:.1f} ms "
          f"= {st.prefill_tokens_per_s:,.0f} tokens/s ({st.prefill_steps} steps, {st.mixed_steps} with decodes; "
          f"prefix cache hit {st.prefix_hit_tokens} tokens)")
    print(f"decode : {st.decode_tokens} tokens in {st.decode_seconds * 1e3:.1f} ms "
          f"= {st.decode_tokens_per_s:,.0f} tokens/s ({st.decode_steps} steps, batch {args.batch}, "
          f"cuda graph {'on' if st.cuda_graph else 'off'}, preemptions {st.preemptions})")
    print(f"latency: time to first token p50 {st.ttft_percentile(50) * 1e3:.1f} ms, p99 "
          f"{st.ttft_percentile(99) * 1e3:.1f} ms; inter-token p50 {st.itl_percentile(50) * 1e3:.2f} ms, "
          f"p99 {st.itl_percentile(99) * 1e3:.2f} ms ({st.steps} steps, {st.total_seconds:.2f} s)")
    return 0


def _stream(eng, tokenizer, prompt: list[int], max_new_tokens: int, sampling: dict) -> list[int]:
    """One request through add_request / step, its text printed as it grows. The whole output is
    decoded each step and only what extends the text printed so far is written, so tokens that
    decode differently once followed (a multi-byte character split across tokens, shown as U+FFFD
    until complete) are held back until they settle."""
    eng.add_request(prompt, max_new_tokens, **sampling)
    print("--- output 0 (streamed)")
    shown, out = "", []
    while eng.has_unfinished_requests():
        for o in eng.step():
            out = o.output_ids
            text = tokenizer.decode(out, skip_special_tokens=True).rstrip("\ufffd")
            if text.startswith(shown) and len(text) > len(shown):
                sys.stdout.write(text[len(shown):])
                sys.stdout.flush()
                shown = text
    text = tokenizer.decode(out, skip_special_tokens=True)
    # (anything the held-back rule kept back, or a final text that no longer extends what was shown)
    sys.stdout.write(text[len(shown):] if text.startswith(shown) else "\n" + text)
    print()
    return out


def _error(e) -> int:
    from ..cli import print_error

    return print_error(e)


def main(argv: list[str] | None = None) -> int:
    from ..cli import ArgumentParser, run_checked

    p = ArgumentParser(prog="minipaged generate", description=__doc__)
    add_arguments(p)
    p.set_defaults(func=run, validate=validate)
    return run_checked(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
