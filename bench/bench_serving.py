"""Serving workloads for the engine: prefix caching, chunked-prefill interference, throughput.

Qwen3-0.6B shape, random bf16 weights (shared with transformers for the
throughput anchor), greedy, EOS ignored. For every backend asked for:

  shared_prefix   64 requests = one 2,048-token system prompt + a unique 128-token
                  suffix, 128 new tokens each; caching on (cold cache at the start)
                  vs off: prompt-phase time (steps that run prompt chunks), TTFT,
                  total time, computed prompt tokens, identical outputs.
  interference    32 requests with 1k-token prompts decode while 4 prompts of 16k
                  tokens arrive behind them; inter-token latency p50/p99 of the 32
                  with chunked prefill (budget 8192) vs a budget that holds a whole
                  16k prompt (so one step prefills it).
  throughput      256 requests, prompt and output lengths uniform in 100..1024
                  (the nano-vllm benchmark shape): generated tokens/s of the engine
                  vs transformers generate (sdpa), the latter on a left-padded
                  subset (--hf-requests) whose useful tokens are counted.
  arrivals        the throughput requests arriving one by one at random (Poisson,
                  --request-rate per second) through the online API (add_request /
                  step): time to first token and inter-token latency percentiles,
                  each from the request's arrival, and the generated tokens/s.

throughput and arrivals run Engine.warmup(), as a server does at start, then serve the same
requests on other tokens, untimed (the cold run: Triton compiles the warm-up missed fall there);
its tokens/s or TTFT and the Triton variants it compiled are reported next to the timed run's
(cold_*, triton_compiles). arrivals also reports its slowest steps and, per pass, how much the
Triton ops' plan caches and the CUDA allocator's retry count grew (host_cache_growth).

Backend "triton-invariant" is the engine's batch_invariant=True (minipaged.triton.invariant:
pinned-tile matmul, RMSNorm and paged attention), whose shared-prefix outputs must be
identical with caching on and off; its other rows give the cost of that guarantee.

    PYTHONPATH=src python3 bench/bench_serving.py [--backends cuda,triton,triton-invariant] [--out DIR] [--quick]
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import random
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, os.path.join(ROOT, "src"))
sys.path.insert(0, HERE)

import torch  # noqa: E402

from bench_e2e import build_hf_model, token_agreement  # noqa: E402
from minipaged.benchmark.timing import environment  # noqa: E402


def _sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def triton_variant_keys() -> set[tuple[str, str, tuple[str, ...]]]:
    """(kernel@device, Triton's cache key, the kernel's argument names) of every compiled variant
    held by minipaged's Triton kernels (every device). A key that appears during a run is a JIT compile (or a disk-cache load) the run
    waited for; its text names the specialisation (int classes, tensor alignment, constexprs) that
    was new."""
    try:
        from triton.runtime.jit import JITFunction
    except ImportError:
        return set()
    seen, keys = set(), set()
    for name, mod in list(sys.modules.items()):
        if not name.startswith("minipaged.triton") or mod is None:
            continue
        for obj in vars(mod).values():
            # an autotuner wraps its JITFunction in .fn (a JITFunction's own .fn is its Python function)
            fn = obj if isinstance(obj, JITFunction) else getattr(obj, "fn", None)
            if isinstance(fn, JITFunction) and id(fn) not in seen:
                seen.add(id(fn))
                names = tuple(getattr(fn, "arg_names", ()))
                for device, cache in getattr(fn, "device_caches", {}).items():
                    keys.update((f"{fn.__name__}@{device}", str(key), names) for key in cache[0])
    return keys


def triton_variants() -> int:
    """How many compiled variants minipaged's Triton kernels hold (triton_variant_keys)."""
    return len(triton_variant_keys())


def _key_fields(key: str) -> list | None:
    """The per-argument part of a Triton cache key's text (a list of (type, specialisation) pairs, then
    the options), or None where the text has another form."""
    import ast

    head = key.split("]{", 1)[0] + "]" if "]{" in key else key
    try:
        fields = ast.literal_eval(head)
    except (ValueError, SyntaxError):
        return None
    return fields if isinstance(fields, list) else None


def _new_variants(before: set, after: set) -> list[str]:
    """The variants compiled between two triton_variant_keys() readings, one line each: the kernel,
    then the arguments in which the new variant differs from the closest one it already had (names
    from the kernel's signature; the specialisation where that differs, an int's: "D" a multiple of
    16, "" none, None unspecialised; else the type), or its whole key where it had none."""
    lines = []
    for name, key, names in sorted(after - before):
        fields = _key_fields(key)
        best = None
        for other_name, other, _ in after:
            other_fields = _key_fields(other) if other_name == name and other != key else None
            if fields is None or other_fields is None or len(other_fields) != len(fields):
                continue
            diff = [i for i, (a, b) in enumerate(zip(fields, other_fields)) if a != b]
            if diff and (best is None or len(diff) < len(best[0])):
                best = (diff, other_fields)
        if best is None:
            lines.append(f"{name}: {key}")
            continue
        diff, other_fields = best
        # the specialisation where it differs, else the type (a dtype, say)
        part = [1 if fields[i][1] != other_fields[i][1] else 0 for i in range(len(fields))]
        what = ", ".join(f"{names[i] if i < len(names) else i}={fields[i][part[i]]!r} "
                         f"(had {other_fields[i][part[i]]!r})" for i in diff)
        lines.append(f"{name}: {what}")
    return lines


INVARIANT_SUFFIX = "-invariant"


def _engine(cfg, state, backend, dev, dtype, **kw):
    from minipaged.engine import Engine

    if backend.endswith(INVARIANT_SUFFIX):
        backend, kw["batch_invariant"] = backend[: -len(INVARIANT_SUFFIX)], True
    return Engine.from_state_dict(cfg, state, device=dev, dtype=dtype, backend=backend, **kw)


def shared_prefix(cfg, state, backend, dev, dtype, q):
    rnd = random.Random(1)
    n_req, sys_len, suffix, new = (16, 512, 64, 32) if q else (64, 2048, 128, 128)
    def make_prompts():
        system = [rnd.randrange(cfg.vocab_size) for _ in range(sys_len)]
        return [system + [rnd.randrange(cfg.vocab_size) for _ in range(suffix)] for _ in range(n_req)]

    prompts = make_prompts()
    # Warm-up: the same workload on other tokens, untimed, so every kernel shape the timed run
    # meets is compiled (Triton's JIT) and captured (decode graphs) before the clock starts.
    warm = make_prompts()
    rows, outs = {}, {}
    for caching in (False, True):
        eng = _engine(cfg, state, backend, dev, dtype, enable_prefix_caching=caching, max_num_seqs=n_req,
                      max_model_len=sys_len + suffix + new + 16)
        eng.generate(warm, max_new_tokens=new, ignore_eos=True)
        eng.cache.reset_prefix_cache()
        _sync()
        out, st = eng.generate(prompts, max_new_tokens=new, ignore_eos=True, return_stats=True)
        outs[caching] = out
        rows["on" if caching else "off"] = dict(
            prompt_phase_s=st.prefill_seconds, total_s=st.total_seconds, computed_prompt_tokens=st.prefill_tokens,
            prefix_hit_tokens=st.prefix_hit_tokens, ttft_p50_s=st.ttft_percentile(50),
            ttft_p99_s=st.ttft_percentile(99), steps=st.steps)
        del eng
        torch.cuda.empty_cache()
    on, off = rows["on"], rows["off"]
    return dict(workload="shared_prefix", requests=n_req, system_tokens=sys_len, suffix_tokens=suffix,
                new_tokens=new, caching_off=off, caching_on=on,
                prompt_phase_ratio_on_over_off=on["prompt_phase_s"] / off["prompt_phase_s"],
                prefill_work_ratio_off_over_on=off["computed_prompt_tokens"] / max(1, on["computed_prompt_tokens"]),
                identical_outputs=outs[True] == outs[False],
                # bf16 with random weights: where caching on and off part, and how many agree throughout
                agreement=token_agreement(outs[True], outs[False]),
                target="prompt phase <= 1/5 with caching on")


def interference(cfg, state, backend, dev, dtype, q):
    rnd = random.Random(2)
    n_dec, dec_len, n_long, long_len, new = (8, 256, 2, 4096, 64) if q else (32, 1024, 4, 16384, 256)
    decoders = [[rnd.randrange(cfg.vocab_size) for _ in range(dec_len)] for _ in range(n_dec)]
    longs = [[rnd.randrange(cfg.vocab_size) for _ in range(long_len)] for _ in range(n_long)]
    res = {}
    for label, budget in (("chunked", 8192), ("whole_prompt", long_len + n_dec + n_long)):
        eng = _engine(cfg, state, backend, dev, dtype, max_num_batched_tokens=budget, max_num_seqs=n_dec + n_long,
                      max_model_len=long_len + new + 16, enable_prefix_caching=False)
        eng.generate([decoders[0][:32]], max_new_tokens=4, ignore_eos=True)
        _sync()
        out, st = eng.generate(decoders + longs, max_new_tokens=new, ignore_eos=True, return_stats=True)
        # the decoders' gaps while the long prompts were being prefilled
        last_long_first = max(st.token_seconds[i][0] for i in range(n_dec, n_dec + n_long))
        gaps = []
        for times in st.token_seconds[:n_dec]:
            gaps += [b - a for a, b in zip(times, times[1:]) if a <= last_long_first]
        from minipaged.engine.engine import percentile

        p50, p99 = percentile(gaps, 50), percentile(gaps, 99)
        res[label] = dict(budget=budget, itl_p50_s=p50, itl_p99_s=p99, p99_over_p50=p99 / p50 if p50 else None,
                          gaps=len(gaps), long_ttft_s=[st.ttft_seconds[i] for i in range(n_dec, n_dec + n_long)],
                          total_s=st.total_seconds, steps=st.steps, mixed_steps=st.mixed_steps)
        del eng
        torch.cuda.empty_cache()
    return dict(workload="interference", decoders=n_dec, decoder_prompt=dec_len, long_prompts=n_long,
                long_prompt_tokens=long_len, new_tokens=new, **res,
                target="chunked: decode p99 ITL <= 3x p50 while the long prompts prefill")


def throughput(cfg, state, hf, backend, dev, dtype, q, hf_requests):
    rnd = random.Random(3)
    n_req, lo, hi = (32, 50, 256) if q else (256, 100, 1024)
    prompts = [[rnd.randrange(cfg.vocab_size) for _ in range(rnd.randint(lo, hi))] for _ in range(n_req)]
    outs = [rnd.randint(lo, hi) for _ in range(n_req)]
    eng = _engine(cfg, state, backend, dev, dtype, max_num_seqs=n_req, max_model_len=2 * hi + 16,
                  enable_prefix_caching=False)
    # the engine's own warm-up, as a server runs it at start; then an untimed pass of the same
    # lengths on other tokens: the same steps, so the Triton compiles the warm-up missed happen
    # there; its time and compile count are reported as the cold run
    eng.warmup()
    keys = triton_variant_keys()
    t0 = time.perf_counter()
    eng.generate(_other_tokens(prompts, cfg.vocab_size), max_new_tokens=outs, ignore_eos=True)
    _sync()
    cold_s, after = time.perf_counter() - t0, triton_variant_keys()
    cold_new, keys = _new_variants(keys, after), after
    t0 = time.perf_counter()
    out = eng.generate(prompts, max_new_tokens=outs, ignore_eos=True)  # each request its own length
    _sync()
    t = time.perf_counter() - t0
    new = _new_variants(keys, triton_variant_keys())
    produced = sum(len(o) for o in out)
    row = dict(workload="throughput", requests=n_req, prompt_range=[lo, hi], output_range=[lo, hi],
               engine_tok_s=produced / t, engine_s=t, generated_tokens=produced,
               prompt_tokens=sum(map(len, prompts)), triton_compiles=len(new), triton_compiled=new,
               cold_tok_s=produced / cold_s, cold_triton_compiles=len(cold_new), cold_triton_compiled=cold_new)
    del eng
    torch.cuda.empty_cache()
    if hf is not None and hf_requests > 0:
        sub = list(zip(prompts, outs))[:hf_requests]
        width = max(len(p) for p, _ in sub)
        ids = torch.zeros(len(sub), width, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, (p, _) in enumerate(sub):
            ids[i, width - len(p):] = torch.tensor(p)
            mask[i, width - len(p):] = 1
        max_new = max(n for _, n in sub)
        _sync()
        t0 = time.perf_counter()
        with torch.inference_mode():
            hf.generate(ids.to(dev), attention_mask=mask.to(dev), max_new_tokens=max_new, min_new_tokens=max_new,
                        do_sample=False, pad_token_id=0)
        _sync()
        t_hf = time.perf_counter() - t0
        useful = sum(n for _, n in sub)
        row.update(hf_requests=len(sub), hf_s=t_hf, hf_useful_tok_s=useful / t_hf,
                   speedup_vs_transformers=row["engine_tok_s"] / (useful / t_hf),
                   target=">= 10x transformers generate tokens/s")
    return row


def _host_caches() -> dict:
    """Sizes of the per-shape plan and launch caches of the Triton ops (a miss builds a plan on the host) and
    the CUDA allocator's retry count (a retry frees cached blocks and waits for the device)."""
    out = {}
    ops = sys.modules.get("minipaged.triton.ops")
    for name in ("_paged_plans", "_decode_plans", "_decode_launch_kwargs"):
        out[name] = len(getattr(ops, name, {}) or {}) if ops is not None else 0
    launch = sys.modules.get("minipaged.triton.launch")
    # entries of the launch cache (minipaged.triton.launch): a miss pays Triton's own launch path
    out["launch_entries"] = sum(len(w) for w in launch._wrappers.values() if hasattr(w, "_entries")) if launch else 0
    out["alloc_retries"] = torch.cuda.memory_stats().get("num_alloc_retries", 0) if torch.cuda.is_available() else 0
    return out


@contextlib.contextmanager
def gc_pauses():
    """Yields a dict that, on exit, holds how long Python's garbage collector ran inside the block:
    total_s, max_s and the collections of each generation (gc.callbacks)."""
    stats = dict(total_s=0.0, max_s=0.0, collections=[0, 0, 0])
    started = []

    def on_gc(phase, info):
        if phase == "start":
            started.append(time.perf_counter())
        elif started:
            took = time.perf_counter() - started.pop()
            stats["total_s"] += took
            stats["max_s"] = max(stats["max_s"], took)
            stats["collections"][info["generation"]] += 1

    gc.callbacks.append(on_gc)
    try:
        yield stats
    finally:
        gc.callbacks.remove(on_gc)


def _grown(before: dict, after: dict) -> dict:
    return {k: after[k] - before.get(k, 0) for k in after}


def _other_tokens(prompts: list[list[int]], vocab: int) -> list[list[int]]:
    """The same prompt lengths with other token ids (a warm-up that shares no prefix)."""
    rnd = random.Random(99)
    return [[rnd.randrange(vocab) for _ in p] for p in prompts]


def serve_arrivals(eng, prompts, new_tokens, arrive_s, clock=time.perf_counter, sleep=time.sleep, step_s=None):
    """Feed request i to `eng` (add_request) once `arrive_s[i]` seconds have passed, step while any
    is unfinished, idle until the next arrival otherwise. Returns (outputs in request order, per
    request: arrival time and token times, seconds from the start); each step's duration is
    appended to `step_s` when given."""
    t0 = clock()
    order = sorted(range(len(prompts)), key=lambda i: arrive_s[i])
    ids, times, outputs = {}, {}, [None] * len(prompts)
    nxt = 0
    while nxt < len(order) or eng.has_unfinished_requests():
        now = clock() - t0
        while nxt < len(order) and arrive_s[order[nxt]] <= now:
            i = order[nxt]
            ids[eng.add_request(prompts[i], new_tokens[i], ignore_eos=True)] = i
            times[i] = [now]
            nxt += 1
        if not eng.has_unfinished_requests():
            sleep(max(0.0, arrive_s[order[nxt]] - now))
            continue
        begun = clock() - t0 if step_s is not None else None
        outs = eng.step()  # (it returns after the device finished the step: its tokens were read)
        done = clock() - t0
        if step_s is not None:
            step_s.append(done - begun)
        for o in outs:
            i = ids[o.request_id]
            times[i].append(done)
            if o.finished:
                outputs[i] = o.output_ids
    return outputs, [dict(arrival_s=t[0], token_s=t[1:]) for t in (times[i] for i in range(len(prompts)))]


def arrivals(cfg, state, backend, dev, dtype, q, rate):
    from minipaged.engine.engine import percentile

    rnd = random.Random(4)
    n_req, lo, hi = (32, 50, 256) if q else (256, 100, 1024)
    prompts = [[rnd.randrange(cfg.vocab_size) for _ in range(rnd.randint(lo, hi))] for _ in range(n_req)]
    outs = [rnd.randint(lo, hi) for _ in range(n_req)]
    arrive, t = [], 0.0
    for _ in range(n_req):
        t += rnd.expovariate(rate)
        arrive.append(t)
    eng = _engine(cfg, state, backend, dev, dtype, max_num_seqs=n_req, max_model_len=2 * hi + 16,
                  enable_prefix_caching=False)
    # the engine's own warm-up, as a server runs it at start; then an untimed pass of the same
    # requests on other tokens and arrival times, so the Triton compiles the warm-up missed fall
    # there (reported as the cold run), not in the measured pass
    eng.warmup()
    cold_arrive, t = [], 0.0
    for _ in range(n_req):
        t += rnd.expovariate(rate)
        cold_arrive.append(t)
    keys, caches = triton_variant_keys(), _host_caches()
    _, cold = serve_arrivals(eng, _other_tokens(prompts, cfg.vocab_size), outs, cold_arrive)
    after, grown = triton_variant_keys(), _host_caches()
    cold_new, cold_caches = _new_variants(keys, after), _grown(caches, grown)
    cold_ttft = [r["token_s"][0] - r["arrival_s"] for r in cold]
    _sync()
    steps = []
    keys, caches = after, grown
    with gc_pauses() as gcs:
        out, rec = serve_arrivals(eng, prompts, outs, arrive, step_s=steps)
    new, caches = _new_variants(keys, triton_variant_keys()), _grown(caches, _host_caches())
    ttft = [r["token_s"][0] - r["arrival_s"] for r in rec]
    itl = [b - a for r in rec for a, b in zip(r["token_s"], r["token_s"][1:])]
    span = max(r["token_s"][-1] for r in rec)
    produced = sum(len(o) for o in out)
    del eng
    torch.cuda.empty_cache()
    return dict(workload="arrivals", requests=n_req, request_rate_per_s=rate, prompt_range=[lo, hi],
                output_range=[lo, hi], generated_tokens=produced, span_s=span, tok_s=produced / span,
                ttft_p50_s=percentile(ttft, 50), ttft_p99_s=percentile(ttft, 99),
                itl_p50_s=percentile(itl, 50), itl_p99_s=percentile(itl, 99),
                last_arrival_s=arrive[-1], steps=len(steps), step_p50_s=percentile(steps, 50),
                step_max_s=max(steps), steps_over_100ms=sum(t > 0.1 for t in steps),
                triton_compiles=len(new), triton_compiled=new,
                cold_ttft_p50_s=percentile(cold_ttft, 50), cold_ttft_p99_s=percentile(cold_ttft, 99),
                cold_triton_compiles=len(cold_new), cold_triton_compiled=cold_new,
                host_cache_growth=caches, cold_host_cache_growth=cold_caches,
                slowest_steps_s=sorted(steps)[-8:], gc_pause_total_s=gcs["total_s"], gc_pause_max_s=gcs["max_s"],
                gc_collections=gcs["collections"])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backends", default="cuda,triton")
    ap.add_argument("--workloads", default="shared_prefix,interference,throughput,arrivals")
    ap.add_argument("--out", default=os.path.join(HERE, "results", "serving"))
    ap.add_argument("--quick", action="store_true", help="smaller versions of every workload")
    ap.add_argument("--hf-requests", type=int, default=64, help="requests in transformers' padded batch (0: skip)")
    ap.add_argument("--request-rate", type=float, default=16.0,
                    help="arrivals workload: mean requests per second (Poisson; default 16)")
    args = ap.parse_args(argv)
    if not (args.request_rate > 0 and args.request_rate < float("inf")):
        print(f"error: --request-rate must be a positive number, got {args.request_rate}", file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print("error: bench_serving needs a CUDA GPU", file=sys.stderr)
        return 2
    from minipaged.engine import Qwen3Config

    dev, dtype = torch.device("cuda"), torch.bfloat16
    cfg = Qwen3Config()
    torch.manual_seed(0)
    hf = build_hf_model(cfg, "sdpa", dev, dtype)
    state = hf.state_dict()
    result = dict(bench="serving", env=environment(dev), quick=args.quick, rows=[], errors=[])
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, f"serving{'_quick' if args.quick else ''}.json")
    for backend in [b for b in args.backends.split(",") if b]:
        for w in [w for w in args.workloads.split(",") if w]:
            t0 = time.perf_counter()
            try:
                if w == "shared_prefix":
                    row = shared_prefix(cfg, state, backend, dev, dtype, args.quick)
                elif w == "interference":
                    row = interference(cfg, state, backend, dev, dtype, args.quick)
                elif w == "throughput":
                    row = throughput(cfg, state, hf, backend, dev, dtype, args.quick, args.hf_requests)
                elif w == "arrivals":
                    row = arrivals(cfg, state, backend, dev, dtype, args.quick, args.request_rate)
                else:
                    raise ValueError(f"unknown workload {w!r}")
                row["backend"] = backend
                row["bench_seconds"] = time.perf_counter() - t0
                result["rows"].append(row)
                print(json.dumps(row, indent=1, default=str), flush=True)
            except Exception as e:  # noqa: BLE001 - one failing workload must not lose the others
                import traceback

                traceback.print_exc()
                result["errors"].append(f"{backend}/{w}: {type(e).__name__}: {e}")
            with open(path, "w") as f:
                json.dump(result, f, indent=1, default=str)
    print(f"wrote {path}")
    return 1 if result["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
