"""End-to-end decode throughput: the minipaged engine vs transformers' generate.

Qwen3-0.6B shape, random bf16 weights shared by both (the engine loads the
transformers model's state dict), the same random prompts (equal lengths, so
transformers needs no padding), greedy, a fixed number of new tokens (EOS
ignored on both sides). For every batch size and every available attention
backend:

    decode tokens/s = B * (N - 1) / (t(N new tokens) - t(1 new token))

i.e. generation wall time minus the prefill-only wall time, medians of
--repeats runs, for both the engine and transformers (attn_implementation
"sdpa", default dynamic cache), measured in the same process. Writes JSON under
--out (default bench/results/) and prints a table.

    PYTHONPATH=src python3 bench/bench_e2e.py [--quick] [--out DIR]
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import platform
import statistics
import sys
import time
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
if os.path.join(ROOT, "src") not in sys.path:
    sys.path.insert(0, os.path.join(ROOT, "src"))

import torch  # noqa: E402

from minipaged.benchmark.timing import git_commit  # noqa: E402


def _versions() -> dict:
    v = {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda}
    for mod in ("triton", "transformers", "minipaged"):
        try:
            v[mod] = __import__(mod).__version__
        except Exception as e:  # noqa: BLE001
            v[mod] = f"unavailable ({type(e).__name__})"
    return v


def _sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _sync_time(fn):
    _sync()
    t0 = time.perf_counter()
    out = fn()
    _sync()
    return time.perf_counter() - t0, out


def _median_time(fn, repeats: int):
    times, out = [], None
    for _ in range(repeats):
        t, out = _sync_time(fn)
        times.append(t)
    return statistics.median(times), out


def token_agreement(outs_a: list[list[int]], outs_b: list[list[int]]) -> dict:
    """How far two runs' generated token lists agree, request by request: the share with the
    same first token, the requests identical throughout, and the mean number of tokens
    before the first difference."""
    common = [next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
              for a, b in zip(outs_a, outs_b)]
    n = max(1, len(common))
    return dict(first_token_agreement=sum(c > 0 for c in common) / n,
                identical_requests=sum(a == b for a, b in zip(outs_a, outs_b)),
                mean_common_prefix=statistics.mean(common) if common else 0.0)


def build_hf_model(cfg, attn: str, device, dtype):
    """transformers Qwen3ForCausalLM of the engine config on `device`, its own random init."""
    import transformers

    d = {k: v for k, v in cfg.to_hf_dict().items() if k != "architectures"}
    hf_cfg = transformers.Qwen3Config(**d)
    with torch.device(device):
        try:
            model = transformers.Qwen3ForCausalLM._from_config(hf_cfg, attn_implementation=attn, dtype=dtype)
        except TypeError:  # older transformers spell it torch_dtype
            model = transformers.Qwen3ForCausalLM._from_config(hf_cfg, attn_implementation=attn, torch_dtype=dtype)
    model = model.to(device=device, dtype=dtype).eval()
    return model


def hf_generate(model, input_ids: torch.Tensor, new_tokens: int) -> torch.Tensor:
    return model.generate(input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=new_tokens,
                          min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=os.path.join(HERE, "results"), help="folder for the JSON result")
    p.add_argument("--quick", action="store_true", help="prompt 128, 64 new tokens, 2 repeats")
    p.add_argument("--backends", default="torch,triton,cuda")
    p.add_argument("--batches", default="1,16,64")
    p.add_argument("--prompt-len", type=int, default=None, help="default 256 (quick: 128)")
    p.add_argument("--new-tokens", type=int, default=None, help="default 256 (quick: 64)")
    p.add_argument("--repeats", type=int, default=None, help="default 3 (quick: 2)")
    p.add_argument("--no-hf", action="store_true", help="skip transformers")
    p.add_argument("--no-eager-rows", action="store_true", help="skip the CUDA-graphs-off comparison rows")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--smoke-cpu", action="store_true", help=argparse.SUPPRESS)  # tiny model on CPU: tests the script
    args = p.parse_args(argv)

    if not torch.cuda.is_available() and not args.smoke_cpu:
        print("bench_e2e needs a CUDA GPU", file=sys.stderr)
        return 2
    import minipaged as mp
    from minipaged.engine import Engine, Qwen3Config

    P = args.prompt_len or (128 if args.quick else 256)
    N = args.new_tokens or (64 if args.quick else 256)
    R = args.repeats or (2 if args.quick else 3)
    batches = [int(b) for b in args.batches.split(",") if b]
    max_b = max(batches)
    if args.smoke_cpu:
        dev, dtype = torch.device("cpu"), torch.float32
        cfg = Qwen3Config(vocab_size=1000, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=1024)
    else:
        dev, dtype = torch.device("cuda"), torch.bfloat16
        cfg = Qwen3Config()  # the Qwen3-0.6B shape
    result = {
        "bench": "e2e_decode",
        "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else platform.processor() or "cpu",
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "versions": _versions(),
        "git_commit": git_commit(),
        "model": "tiny Qwen3 (smoke test)" if args.smoke_cpu else "Qwen3-0.6B shape, random bf16 weights",
        "prompt_len": P, "new_tokens": N, "repeats": R, "batches": batches,
        "metric": "decode tokens/s = B*(N-1) / (t_generate(N) - t_generate(1)), medians",
        "transformers": [], "engine": [], "errors": [],
    }
    print(f"device {result['device']}  versions {result['versions']}  commit {result['git_commit']}")
    print(f"prompt {P} tokens, {N} new tokens, repeats {R}, batches {batches}")

    os.makedirs(args.out, exist_ok=True)
    stamp = _dt.datetime.now(_dt.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    path = os.path.join(args.out, f"e2e_{'quick_' if args.quick else ''}{stamp}.json")

    def dump() -> None:  # after every stage, so a run cut short still leaves its numbers
        with open(path, "w") as f:
            json.dump(result, f, indent=2)

    gen = torch.Generator().manual_seed(args.seed)
    prompts = torch.randint(0, cfg.vocab_size, (max_b, P), generator=gen)

    torch.manual_seed(args.seed)
    hf = None
    try:
        hf = build_hf_model(cfg, "sdpa", dev, dtype)
        state = hf.state_dict()
    except Exception as e:  # noqa: BLE001 - no transformers: the engine still runs with its own weights
        result["errors"].append(f"transformers model: {type(e).__name__}: {e}")
        print(f"transformers unavailable ({e}); engine only", file=sys.stderr)
        from minipaged.engine.loader import random_state_dict

        state = random_state_dict(cfg, seed=args.seed, dtype=dtype, device=dev)

    hf_tokens: dict[int, list[list[int]]] = {}
    if hf is not None and not args.no_hf:
        with torch.inference_mode():
            hf_generate(hf, prompts[:1].to(dev), 2)  # warm-up
            for B in batches:
                ids = prompts[:B].to(dev)
                t_full, out = _median_time(lambda: hf_generate(hf, ids, N), max(1, R - 1))
                t_pre, _ = _median_time(lambda: hf_generate(hf, ids, 1), max(1, R - 1))
                tps = B * (N - 1) / max(t_full - t_pre, 1e-9)
                hf_tokens[B] = out[:, P:].tolist()
                row = {"batch": B, "decode_tok_s": tps, "t_generate_s": t_full, "t_prefill_s": t_pre,
                       "ms_per_step": (t_full - t_pre) / (N - 1) * 1e3}
                result["transformers"].append(row)
                print(f"transformers sdpa  B={B:3d}: {tps:10,.0f} tok/s  ({row['ms_per_step']:.2f} ms/step)")

    dump()
    avail = mp.available_backends()
    for name in [b for b in args.backends.split(",") if b]:
        ok, why = avail.get(name, (False, "unknown backend"))
        if not ok:
            result["errors"].append(f"{name}: unavailable: {why}")
            print(f"{name}: unavailable ({why})")
            continue
        eng = None
        try:
            # prefix caching off: repeats of the same prompts must not turn into cache hits
            eng = Engine.from_state_dict(cfg, state, device=dev, dtype=dtype, backend=name,
                                         enable_prefix_caching=False,
                                         max_num_seqs=max_b, max_model_len=P + N + 16,
                                         num_blocks=max_b * (-(-(P + N + 16) // 16)) + max_b)
            prompt_lists = prompts.tolist()
            eng.generate(prompt_lists[:max_b], max_new_tokens=4, ignore_eos=True)  # warm-up, graph capture
            modes = [("graph" if eng.runner.graphs_active else "eager", None)]
            if eng.runner.graphs_active and not args.no_eager_rows:
                modes.append(("eager", {1, max_b}))
            for mode, only in modes:
                if mode == "eager":
                    eng.runner.use_cuda_graph, saved = False, eng.runner.use_cuda_graph
                for B in batches:
                    if only is not None and B not in only:
                        continue
                    pl = prompt_lists[:B]
                    t_full, out = _median_time(lambda: eng.generate(pl, max_new_tokens=N, ignore_eos=True), R)
                    st = eng.stats
                    t_pre, _ = _median_time(lambda: eng.generate(pl, max_new_tokens=1, ignore_eos=True), R)
                    tps = B * (N - 1) / max(t_full - t_pre, 1e-9)
                    row = {"backend": name, "mode": mode, "batch": B, "decode_tok_s": tps,
                           "t_generate_s": t_full, "t_prefill_s": t_pre,
                           "ms_per_step": (t_full - t_pre) / (N - 1) * 1e3,
                           "prefill_tok_s": B * P / t_pre,
                           "engine_internal_decode_tok_s": st.decode_tokens_per_s,
                           "preemptions": st.preemptions}
                    ref = next((r for r in result["transformers"] if r["batch"] == B), None)
                    if ref:
                        row["speedup_vs_transformers"] = tps / ref["decode_tok_s"]
                    if B in hf_tokens:
                        # random bf16 weights: small logit margins, so later tokens may drift apart
                        agree = token_agreement(out, hf_tokens[B])
                        row["first_token_agreement"] = agree["first_token_agreement"]
                        row["mean_common_prefix"] = agree["mean_common_prefix"]
                    result["engine"].append(row)
                    sp = f" x{row['speedup_vs_transformers']:.2f}" if ref else ""
                    print(f"engine {name:7s} {mode:5s} B={B:3d}: {tps:10,.0f} tok/s ({row['ms_per_step']:.2f} ms/step)"
                          f"{sp}  prefill {row['prefill_tok_s']:,.0f} tok/s")
                if mode == "eager":
                    eng.runner.use_cuda_graph = saved
            if eng.runner.graph_error:
                result["errors"].append(f"{name}: CUDA graph capture failed: {eng.runner.graph_error}")
        except Exception as e:  # noqa: BLE001 - one backend failing must not lose the others
            msg = f"{name}: {type(e).__name__}: {e}"
            result["errors"].append(msg)
            print(msg, file=sys.stderr)
            traceback.print_exc()
        finally:
            eng = None
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
            dump()

    print()
    print(f"{result['model']}, prompt {P}, {N} new tokens — decode tokens/s")
    print(f"{'backend':<14}{'mode':<7}{'batch':>6}{'tok/s':>12}{'ms/step':>9}{'vs HF':>8}{'1st tok agree':>15}")
    for r in result["transformers"]:
        print(f"{'transformers':<14}{'sdpa':<7}{r['batch']:>6}{r['decode_tok_s']:>12,.0f}{r['ms_per_step']:>9.2f}")
    for r in result["engine"]:
        sp = f"{r['speedup_vs_transformers']:.2f}x" if "speedup_vs_transformers" in r else "-"
        ag = f"{r['first_token_agreement']:.2f}" if "first_token_agreement" in r else "-"
        print(f"{r['backend']:<14}{r['mode']:<7}{r['batch']:>6}{r['decode_tok_s']:>12,.0f}{r['ms_per_step']:>9.2f}"
              f"{sp:>8}{ag:>15}")
    for e in result["errors"]:
        print(f"note: {e}")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
