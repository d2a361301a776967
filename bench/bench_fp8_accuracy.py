"""FP8 KV cache accuracy in the engine: logits with a float8_e4m3fn cache and with the
16-bit cache, each against a transformers fp32 forward on the same weights (issue #15).

The real Qwen3-0.6B configuration with random weights in bf16 (transformers' own seeded
init; the engine loads that model's state dict, and an fp32 copy of the same weights is
the reference). For each backend with fp8 KV kernels (registry `fp8_kv`):

- the engine prefills the prompts (one packed varlen step; with an fp8 cache this step
  also fixes the per-layer, per-KV-head scales from the prompts' K/V amax, as
  Engine(kv_cache_dtype="fp8") does on its first prompt step), then decodes a fixed
  continuation one token per step, teacher-forced (the fed tokens are the given ones,
  not the sampled ones), through the engine's decode path (CUDA graphs where it captures
  them) — once with kv_cache_dtype="fp8" and once with the bf16 cache;
- transformers runs prompt + continuation in fp32 in one forward;
- reported at the decode positions (the rows whose attention reads the cache): logits
  relative L2 error (||a - b|| / ||b|| over all rows) and top-1 agreement of bf16 vs fp32,
  fp8 vs fp32 and fp8 vs bf16; transformers bf16 vs fp32 gives the noise floor of bf16
  itself. The prefill's last row is reported apart: its attention runs on the fresh
  16-bit K/V, so fp8 and bf16 must agree there exactly.

    PYTHONPATH=src python3 bench/bench_fp8_accuracy.py --json OUT.json            # GPU
    PYTHONPATH=src python3 bench/bench_fp8_accuracy.py --device cpu --backend torch \\
        --prompt-lens 24,40 --decode-steps 4 --json OUT.json                      # CPU check

Uses engine internals (Engine.model.forward for the prefill, Engine.runner.decode for the
steps, Sequence objects whose computed length is set per step) and changes no engine code.
"""

from __future__ import annotations

import argparse
import copy
import datetime as _dt
import json
import math
import os
import platform
import sys
import time
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
if os.path.join(ROOT, "src") not in sys.path:
    sys.path.insert(0, os.path.join(ROOT, "src"))

import torch  # noqa: E402

from minipaged.benchmark.timing import git_commit  # noqa: E402

DEFAULT_LENS_GPU = "31,509,2047"
DEFAULT_LENS_CPU = "24,40"


def _versions() -> dict:
    v = {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda}
    for mod in ("triton", "transformers", "minipaged"):
        try:
            v[mod] = __import__(mod).__version__
        except Exception as e:  # noqa: BLE001 - a missing module is recorded, not fatal
            v[mod] = f"unavailable ({type(e).__name__})"
    return v


def _positive_ints(flag: str, text: str) -> list[int]:
    try:
        vals = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"{flag} must be comma-separated integers, got {text!r}") from None
    if not vals or any(v < 1 for v in vals):
        raise ValueError(f"{flag} must be integers >= 1, got {text!r}")
    return vals


def tiny_config():
    """A 2-layer Qwen3 (hidden 128, 4 q / 2 kv heads, D 64) for the CPU test of this script."""
    from minipaged.engine import Qwen3Config

    return Qwen3Config(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=1024)


def hf_model(cfg, dtype, device, seed: int, init_std: float | None = None):
    """transformers Qwen3ForCausalLM of the engine config, seeded random init, eval mode."""
    import transformers

    d = {k: v for k, v in cfg.to_hf_dict().items() if k != "architectures"}
    if init_std is not None:
        d["initializer_range"] = init_std
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):  # a small test vocabulary lacks them
        ids = d.get(key)
        if isinstance(ids, int) and ids >= cfg.vocab_size or isinstance(ids, list) and any(i >= cfg.vocab_size for i in ids):
            d[key] = None
    hf_cfg = transformers.Qwen3Config(**d)
    torch.manual_seed(seed)
    with torch.device(device):
        try:
            m = transformers.Qwen3ForCausalLM._from_config(hf_cfg, attn_implementation="sdpa", dtype=dtype)
        except TypeError:  # older transformers spell it torch_dtype
            m = transformers.Qwen3ForCausalLM._from_config(hf_cfg, attn_implementation="sdpa", torch_dtype=dtype)
    return m.to(device=device, dtype=dtype).eval()


@torch.inference_mode()
def hf_logits(model, prompts, conts, device) -> list[torch.Tensor]:
    """fp32 logits [N+1, V] of each prompt+continuation at positions P-1 .. P+N-1 (the rows the
    engine's prefill-last and decode steps produce), one forward per sequence."""
    out = []
    for p, c in zip(prompts, conts):
        ids = torch.tensor([p + c], device=device)
        hidden = model.model(input_ids=ids).last_hidden_state[0]
        rows = hidden[len(p) - 1: len(p) + len(c)]
        out.append(model.lm_head(rows).float())
    return out


@torch.inference_mode()
def engine_logits(eng, prompts, conts) -> tuple[list[torch.Tensor], dict]:
    """Teacher-forced engine logits [N+1, V] (fp32) per sequence: row 0 from the packed prefill
    of the prompts (its last position), row 1 + t from decode step t, which feeds conts[t] at
    position P + t and reads the cache. Returns (logits, info)."""
    from minipaged.engine.model import AttentionMetadata
    from minipaged.engine.sequence import Sequence

    cache, dev = eng.cache, eng.device
    seqs = [Sequence(p + c, 0, index=i) for i, (p, c) in enumerate(zip(prompts, conts))]
    try:
        slots = [cache.allocate(s.seq_id, len(s)) for s in seqs]
        ids = torch.tensor([t for p in prompts for t in p], dtype=torch.int64, device=dev)
        pos = torch.cat([torch.arange(len(p)) for p in prompts]).to(dev)
        slot = torch.cat([sl[: len(p)] for sl, p in zip(slots, prompts)]).to(dev)
        cu = [0]
        for p in prompts:
            cu.append(cu[-1] + len(p))
        # the engine's first prompt step: an fp8 cache without checkpoint scales takes them from here
        meta = AttentionMetadata("prefill", slot, cu_seqlens=torch.tensor(cu, dtype=torch.int32, device=dev),
                                 max_seqlen_q=max(len(p) for p in prompts), calibrate_kv=cache.is_fp8)
        hidden = eng.model.forward(ids, pos, meta, cache)
        last = torch.tensor(cu[1:], device=dev) - 1
        rows = [eng.model.logits(hidden[last]).float()]
        for t in range(len(conts[0])):
            for s, p, c in zip(seqs, prompts, conts):
                s.token_ids = p + c[: t + 1]   # last token = the one this step feeds
                s.num_computed = len(p) + t    # the K/V of everything before it are cached
            rows.append(eng.runner.decode(seqs).float())
        if dev.type == "cuda":
            torch.cuda.synchronize()
        logits = torch.stack(rows, dim=1)  # [B, N+1, V]
        info = {"cuda_graphs": bool(eng.runner.graphs_active), "graph_error": eng.runner.graph_error,
                "kv_cache_dtype": str(cache.dtype).replace("torch.", "")}
        if cache.is_fp8:
            ks, vs = torch.stack(list(cache.k_scales)).float(), torch.stack(list(cache.v_scales)).float()
            info["k_scale_min_max"] = [ks.min().item(), ks.max().item()]
            info["v_scale_min_max"] = [vs.min().item(), vs.max().item()]
        return [logits[i] for i in range(len(seqs))], info
    finally:
        for s in seqs:
            if s.seq_id in cache:
                cache.free(s.seq_id)


def compare(got: list[torch.Tensor], ref: list[torch.Tensor], rows: slice) -> dict:
    """rel-L2 (||got - ref|| / ||ref|| over all selected rows of all sequences), top-1 agreement,
    max |diff|, and the rel-L2 of each sequence."""
    g = torch.cat([x[rows].float() for x in got])
    r = torch.cat([x[rows].float().to(g.device) for x in ref])
    diff = g - r
    per_seq = [((a[rows].float() - b[rows].float().to(a.device)).norm() / b[rows].float().norm().clamp_min(1e-30)).item()
               for a, b in zip(got, ref)]
    return {
        "rel_l2": (diff.norm() / r.norm().clamp_min(1e-30)).item(),
        "top1": (g.argmax(-1) == r.argmax(-1)).float().mean().item(),
        "max_abs": diff.abs().max().item() if diff.numel() else 0.0,
        "rows": int(g.shape[0]),
        "rel_l2_per_prompt": per_seq,
    }


def default_backends(device: torch.device) -> list[str]:
    """Every backend with fp8 KV kernels that runs bf16 on `device` (not triton on CPU: the
    interpreter's bf16 is wrong); on a GPU the torch oracle is left out unless named (it is the
    reference of the kernels, not a GPU backend)."""
    from minipaged import registry

    names = [n for n, b in registry.all_backends().items() if b.fp8_kv and b.is_available(device.type)[0]
             and "bfloat16" in b.supported_dtypes(device.type)[0]]
    if device.type == "cuda":
        names = [n for n in names if n != "torch"]
    return names


def _fmt(d: dict | None) -> str:
    if not d:
        return "-"
    return f"rel-L2 {d['rel_l2']:.4g}, top-1 {d['top1']:.3f}, max|d| {d['max_abs']:.3g}"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default=None, help="cuda or cpu (default: cuda when available)")
    p.add_argument("--backends", "--backend", dest="backends", default=None,
                   help="comma-separated backends (default: every one with fp8 KV kernels here; torch "
                        "only when named on a GPU)")
    p.add_argument("--prompt-lens", default=None,
                   help=f"comma-separated prompt lengths (default GPU {DEFAULT_LENS_GPU}, CPU {DEFAULT_LENS_CPU})")
    p.add_argument("--decode-steps", type=int, default=None,
                   help="teacher-forced decode steps per prompt (default GPU 64, CPU 4)")
    p.add_argument("--tiny", action="store_true", help="a 2-layer Qwen3 instead of Qwen3-0.6B (tests)")
    p.add_argument("--init-std", type=float, default=None,
                   help="std of the random weights (default: the config's initializer_range, 0.02)")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, help="write the result here (JSON)")
    args = p.parse_args(argv)

    try:
        dev = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
        if dev.type == "cuda" and not torch.cuda.is_available():
            raise ValueError("--device cuda: no CUDA device visible to torch")
        if dev.type not in ("cuda", "cpu"):
            raise ValueError(f"--device must be cuda or cpu, got {args.device!r}")
        lens = _positive_ints("--prompt-lens", args.prompt_lens or (DEFAULT_LENS_GPU if dev.type == "cuda"
                                                                    else DEFAULT_LENS_CPU))
        steps = args.decode_steps if args.decode_steps is not None else (64 if dev.type == "cuda" else 4)
        if steps < 1:
            raise ValueError(f"--decode-steps must be >= 1, got {steps}")
        if dev.type == "cpu":
            os.environ.setdefault("TRITON_INTERPRET", "1")  # before anything imports minipaged.triton
        from minipaged import registry

        backends = (default_backends(dev) if args.backends is None
                    else [b.strip().lower() for b in args.backends.split(",") if b.strip()])
        known = registry.all_backends()
        for b in backends:
            if b not in known:
                raise ValueError(f"--backends: unknown backend {b!r}; valid names are {list(known)}")
            if not known[b].fp8_kv:
                raise ValueError(f"--backends {b}: no float8_e4m3fn KV-cache kernels (registry fp8_kv is False); "
                                 f"backends that have them: {[n for n, x in known.items() if x.fp8_kv]}")
            ok, why = known[b].is_available(dev.type)
            if not ok:
                raise ValueError(f"--backends {b}: unavailable on {dev.type}: {why}")
            dtypes, why = known[b].supported_dtypes(dev.type)
            if "bfloat16" not in dtypes:
                raise ValueError(f"--backends {b}: the model runs in bfloat16, which {b} refuses on {dev.type}: {why}")
        if not backends:
            raise ValueError(f"no backend with fp8 KV kernels is available on {dev.type}")
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2

    from minipaged.engine import Engine, Qwen3Config

    cfg = tiny_config() if args.tiny else Qwen3Config()
    dtype = torch.bfloat16
    gen = torch.Generator().manual_seed(args.seed + 1)
    prompts = [torch.randint(0, cfg.vocab_size, (n,), generator=gen).tolist() for n in lens]
    conts = [torch.randint(0, cfg.vocab_size, (steps,), generator=gen).tolist() for _ in lens]
    decode_rows, prefill_row = slice(1, steps + 1), slice(0, 1)

    result = {
        "bench": "fp8_accuracy",
        "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else (platform.processor() or "cpu"),
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "versions": _versions(),
        "git_commit": git_commit(),
        "model": ("tiny Qwen3 (2 layers, test)" if args.tiny else "Qwen3-0.6B configuration") +
                 f", random bf16 weights (transformers init, std {args.init_std or cfg.initializer_range}, seed {args.seed})",
        "prompt_lens": lens, "decode_steps": steps, "block_size": args.block_size,
        "reference": "transformers Qwen3ForCausalLM in fp32 on the same weights, one forward over prompt + continuation",
        "metrics": ("at the decode positions (teacher-forced; attention reads the paged cache): rel_l2 = "
                    "||a - b|| / ||b|| over all rows of all prompts, top1 = fraction of rows with the same argmax; "
                    "prefill_last: the prefill's last row (attention on the fresh 16-bit K/V)"),
        "hf_bf16_vs_fp32": None, "backends": {}, "errors": [],
    }
    print(f"device {result['device']}, {result['model']}")
    print(f"prompts {lens}, {steps} teacher-forced decode steps, backends {backends}")

    def dump():
        if args.json:
            os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
            with open(args.json, "w") as f:
                json.dump(result, f, indent=1, allow_nan=True)

    if dev.type == "cuda":  # the fp32 reference must be fp32, not TF32
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    t0 = time.perf_counter()
    hf16 = hf_model(cfg, dtype, dev, args.seed, args.init_std)
    state = {k: v.detach().clone() for k, v in hf16.state_dict().items()}
    hf32 = copy.deepcopy(hf16).to(torch.float32)  # the same weights, fp32 (keeps the embedding tie)
    ref = hf_logits(hf32, prompts, conts, dev)
    del hf32
    try:
        ref16 = hf_logits(hf16, prompts, conts, dev)
        result["hf_bf16_vs_fp32"] = {"decode": compare(ref16, ref, decode_rows),
                                     "prefill_last": compare(ref16, ref, prefill_row)}
        del ref16
    except Exception as e:  # noqa: BLE001 - the floor is context, not the measurement
        result["errors"].append(f"transformers bf16 forward: {type(e).__name__}: {e}")
    del hf16
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    print(f"reference built in {time.perf_counter() - t0:.1f} s; transformers bf16 vs fp32 (decode rows): "
          f"{_fmt((result['hf_bf16_vs_fp32'] or {}).get('decode'))}")
    dump()

    max_len = max(lens) + steps
    bs = args.block_size
    num_blocks = sum(-(-(n + steps) // bs) for n in lens) + len(lens) + 2
    failed = 0
    for name in backends:
        entry = {"error": None}
        result["backends"][name] = entry
        try:
            logits = {}
            for kv in (None, "fp8"):
                t1 = time.perf_counter()
                eng = Engine.from_state_dict(cfg, state, device=dev, dtype=dtype, backend=name, kv_cache_dtype=kv,
                                             block_size=bs, num_blocks=num_blocks, max_num_seqs=len(lens),
                                             max_model_len=max_len + bs, enable_prefix_caching=False)
                key = "fp8" if kv else "bf16"
                logits[key], entry[f"{key}_engine"] = engine_logits(eng, prompts, conts)
                entry[f"{key}_engine"]["seconds"] = time.perf_counter() - t1
                del eng
                if dev.type == "cuda":
                    torch.cuda.empty_cache()
            for a, b, label in (("bf16", None, "bf16_vs_fp32"), ("fp8", None, "fp8_vs_fp32"),
                                ("fp8", "bf16", "fp8_vs_bf16")):
                other = ref if b is None else logits[b]
                entry[label] = {"decode": compare(logits[a], other, decode_rows),
                                "prefill_last": compare(logits[a], other, prefill_row)}
            del logits
            print(f"[{name}] bf16 cache vs fp32: {_fmt(entry['bf16_vs_fp32']['decode'])}")
            print(f"[{name}] fp8 cache  vs fp32: {_fmt(entry['fp8_vs_fp32']['decode'])}")
            print(f"[{name}] fp8 vs bf16 cache : {_fmt(entry['fp8_vs_bf16']['decode'])}  "
                  f"(prefill last row: rel-L2 {entry['fp8_vs_bf16']['prefill_last']['rel_l2']:.3g}); "
                  f"graphs {entry['fp8_engine']['cuda_graphs']}")
        except Exception as e:  # noqa: BLE001 - one backend failing must not lose the others
            failed += 1
            entry["error"] = f"{type(e).__name__}: {e}"
            entry["traceback"] = traceback.format_exc()[-4000:]
            result["errors"].append(f"{name}: {entry['error']}")
            print(f"[{name}] FAILED: {entry['error']}", file=sys.stderr)
            if dev.type == "cuda":
                try:
                    torch.cuda.synchronize()
                    torch.cuda.empty_cache()
                except Exception:  # noqa: BLE001 - a lost context: later backends will say so too
                    pass
        dump()
    result["seconds"] = time.perf_counter() - t0
    dump()
    if args.json:
        print(f"wrote {args.json}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
