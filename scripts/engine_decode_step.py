"""The engine's decode step per backend (Qwen3-0.6B shape, random bf16 weights): graph or eager,
the capture error if any, and where a step's time goes.

    PYTHONPATH=src python3 scripts/engine_decode_step.py [--backends cuda,triton] [--json PATH]
        [--batch 1] [--prompt-lens 128,128] [--max-num-seqs 8] [--max-model-len 2048]

--batch sequences decode together, their prompt lengths drawn uniformly from --prompt-lens (seeded);
the graph replayed is the engine's for that batch (the smallest captured size that holds it,
padded rows reading nothing).

A decode step's wall time is taken from the engine's own stats (decode seconds /
decode steps, each step synchronised by the sampler's .tolist()). With
graphs active the replay of one step is also timed alone (minipaged.benchmark.timing,
median, cold L2), so host work outside the graph (input copies, sampling) shows
as the difference. With graphs active, the kernels of 10 replays are also listed from
torch.profiler (CUPTI sees the kernels inside a graph): name, launches per step and device
time per step, the largest first, so the backends' steps can be compared op by op.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch


def _replay_kernels(graph, replays: int, top: int) -> list[dict]:
    """Kernels of `replays` graph replays: [{name, per_step, us_per_step}], most time first."""
    from torch.profiler import ProfilerActivity, profile

    graph.replay()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(replays):
            graph.replay()
        torch.cuda.synchronize()
    rows = []
    for evt in prof.key_averages():
        us = getattr(evt, "self_device_time_total", None)
        if us is None:  # older torch
            us = getattr(evt, "self_cuda_time_total", 0.0)
        if us > 0:
            rows.append(dict(name=evt.key[:120], per_step=evt.count / replays, us_per_step=us / replays))
    rows.sort(key=lambda r: -r["us_per_step"])
    total = sum(r["us_per_step"] for r in rows)
    print(f"  kernels of one replay: {total:.1f} us of device time", flush=True)
    for r in rows[:top]:
        print(f"    {r['us_per_step']:9.1f} us  x{r['per_step']:5.1f}  {r['name']}", flush=True)
    return rows[:top] + [dict(name="(all kernels)", per_step=sum(r["per_step"] for r in rows), us_per_step=total)]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--backends", default="cuda,triton")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--json", default=None)
    ap.add_argument("--top", type=int, default=15, help="kernels listed per backend")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--prompt-lens", default="128,128", help="lo,hi: prompt lengths drawn in [lo, hi]")
    ap.add_argument("--max-num-seqs", type=int, default=8)
    ap.add_argument("--max-model-len", type=int, default=2048)
    args = ap.parse_args(argv)
    lo, hi = (int(x) for x in args.prompt_lens.split(","))
    if not (1 <= args.batch <= args.max_num_seqs and 1 <= lo <= hi and hi + args.new_tokens + 8 <= args.max_model_len):
        print("error: need 1 <= --batch <= --max-num-seqs and 1 <= lo <= hi, hi + --new-tokens + 8 <= "
              "--max-model-len", file=sys.stderr)
        return 2
    from minipaged.benchmark import timing
    from minipaged.engine import Engine

    rows = []
    for name in args.backends.split(","):
        blocks = args.batch * -(-args.max_model_len // 16) + 64
        eng = Engine(None, backend=name, max_num_seqs=args.max_num_seqs, max_model_len=args.max_model_len,
                     num_blocks=max(1024, blocks))
        gen = torch.Generator().manual_seed(0)
        lens = torch.randint(lo, hi + 1, (args.batch,), generator=gen).tolist()
        prompt = [torch.randint(0, eng.config.vocab_size, (n,), generator=gen).tolist() for n in lens]
        eng.generate(prompt, max_new_tokens=4, ignore_eos=True)
        out, st = eng.generate(prompt, max_new_tokens=args.new_tokens, ignore_eos=True, return_stats=True)
        step_ms = st.decode_seconds / max(1, st.decode_steps) * 1e3
        row = dict(backend=name, batch=args.batch, prompt_lens=[lo, hi], max_model_len=args.max_model_len,
                   graph=st.cuda_graph, graph_error=eng.runner.graph_error, step_ms=step_ms,
                   itl_p50_ms=st.itl_percentile(50) * 1e3)
        if eng.runner.graphs_active:
            size = min(b for b in eng.runner.graphs if b >= args.batch)
            row["graph_batch"] = size
            g = eng.runner.graphs[size]
            row["replay_ms"] = timing.time_fn(g.replay, device="cuda", reps=20, warmup=3, max_time_s=0).median_ms
            row["kernels"] = _replay_kernels(g, replays=10, top=args.top)
        rows.append(row)
        print({k: v for k, v in row.items() if k != "kernels"}, flush=True)
        del eng
        torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
