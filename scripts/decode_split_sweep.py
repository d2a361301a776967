"""Decode split-count sweep, timed exactly as `minipaged bench` times decode
(CUDA-graph replay, cold L2, median): where the small-batch targets stand and
which split count each backend would need."""

import json
import sys

import torch

from minipaged.triton import configs

from minipaged.benchmark import cases as cs
from minipaged.benchmark import timing
from minipaged.cuda import ops as cuda_ops
from minipaged.registry import all_backends

out_path = sys.argv[1] if len(sys.argv) > 1 else "decode_split_sweep.json"
rows = []
triton_decode = all_backends()["triton"].op("decode")
for B, L in ((1, 4096), (1, 32768), (8, 4096)):
    case = cs.DecodeCase(batch=B, context_len=L, num_q_heads=16, num_kv_heads=8, head_dim=128)
    torch.manual_seed(0)
    q, kc, vc, bt, cl = cs.make_decode_inputs(case, torch.bfloat16, "cuda", seed=None, poison=False, spare_columns=0)
    nbytes = case.bytes(2)
    scale = 128**-0.5
    for splits in (0, 16, 32, 64, 96, 128):
        configs.set_override("decode_splits", None)
        if splits:
            configs.set_override("decode_splits", str(splits))
        runs = {"triton": lambda: triton_decode(q, kc, vc, bt, cl, scale)}
        for variant in (0, 6, 7):
            runs[f"cuda-v{variant}"] = lambda v=variant, s=splits: cuda_ops.decode(q, kc, vc, bt, cl, scale, False, num_splits=s, variant=v)
        for name, fn in runs.items():
            try:
                t = timing.time_fn(fn, device="cuda", reps=100, max_time_s=0.2, cuda_graph=True)
                row = dict(B=B, L=L, backend=name, splits=splits, us=t.median_ms * 1e3, tbps=nbytes / t.median_ms / 1e9, clock=t.clock)
            except Exception as e:  # noqa: BLE001
                row = dict(B=B, L=L, backend=name, splits=splits, error=f"{type(e).__name__}: {str(e)[:120]}")
            rows.append(row)
            print(row, flush=True)
configs.set_override("decode_splits", None)
json.dump(rows, open(out_path, "w"), indent=1)
