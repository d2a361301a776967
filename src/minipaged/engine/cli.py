"""`minipaged generate`: run the paged Qwen3 engine and report tokens/s.

Without --model the real Qwen3-0.6B shape runs with random weights on random
prompts (a throughput check). With a checkpoint folder holding a tokenizer,
--prompt TEXT is tokenised and the output printed as text.
"""

from __future__ import annotations

import argparse
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
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0, help="seed of random weights, prompts and sampling")
    p.add_argument("--device", default=None, help="cuda or cpu (default: cuda when available)")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--num-blocks", type=int, default=None, help="KV pages (default: from free memory)")
    p.add_argument("--max-num-seqs", type=int, default=None, help="default: --batch")
    p.add_argument("--no-cuda-graph", action="store_true", help="decode eagerly on CUDA")
    p.add_argument("--ignore-eos", action="store_true", help="always generate --max-new-tokens tokens")


def _load_tokenizer(model_dir: str | None):
    if model_dir is None:
        return None
    try:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    except Exception:  # noqa: BLE001 - no tokenizer files: token-id mode
        return None


def run(args: argparse.Namespace) -> int:
    import torch

    from .engine import Engine

    if args.batch < 1 or args.prompt_len < 1 or args.max_new_tokens < 0:
        print("error: --batch and --prompt-len must be >= 1, --max-new-tokens >= 0", file=sys.stderr)
        return 2
    tokenizer = _load_tokenizer(args.model)
    if args.prompt is not None and tokenizer is None:
        print("error: --prompt needs a tokenizer in --model DIR (tokenizer.json / tokenizer_config.json)",
              file=sys.stderr)
        return 2

    try:
        eng = Engine(args.model, dtype=args.dtype, device=args.device, backend=args.backend,
                     block_size=args.block_size, num_blocks=args.num_blocks,
                     max_num_seqs=args.max_num_seqs or args.batch, seed=args.seed,
                     cuda_graph=False if args.no_cuda_graph else None)
    except (OSError, ValueError, KeyError, NotImplementedError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(eng, file=sys.stderr)

    if args.prompt is not None:
        text = args.prompt
        if args.chat and getattr(tokenizer, "chat_template", None):
            text = tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                                 add_generation_prompt=True)
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
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        stop.append(int(tokenizer.eos_token_id))
    try:
        outs = eng.generate(prompts, max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                            top_p=args.top_p, seed=args.seed, progress=True, stop_token_ids=stop,
                            ignore_eos=args.ignore_eos)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2

    st = eng.stats
    if tokenizer is not None and args.prompt is not None:
        shown = outs if args.temperature > 0 else outs[:1]  # greedy copies are identical
        for i, o in enumerate(shown):
            print(f"--- output {i} ({len(o)} tokens)")
            print(tokenizer.decode(o, skip_special_tokens=True))
    else:
        print(f"first output tokens: {outs[0][:16]}{' ...' if len(outs[0]) > 16 else ''}")
    print(f"prefill: {st.prefill_tokens} tokens in {st.prefill_seconds * 1e3:.1f} ms "
          f"= {st.prefill_tokens_per_s:,.0f} tokens/s ({st.prefill_steps} steps)")
    print(f"decode : {st.decode_tokens} tokens in {st.decode_seconds * 1e3:.1f} ms "
          f"= {st.decode_tokens_per_s:,.0f} tokens/s ({st.decode_steps} steps, batch {args.batch}, "
          f"cuda graph {'on' if st.cuda_graph else 'off'}, preemptions {st.preemptions})")
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="minipaged generate", description=__doc__)
    add_arguments(p)
    return run(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
