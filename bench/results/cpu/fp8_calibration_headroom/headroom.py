"""How the engine's FP8 scale calibration (first prompt step's K/V amax, fixed thereafter) and its
margin change the fp8-vs-bf16 logits error at teacher-forced decode positions (torch backend,
CPU, bf16 random weights: transformers' seeded init, as bench/bench_fp8_accuracy.py).

    PYTHONPATH=src python bench/results/cpu/fp8_calibration_headroom/headroom.py tiny
    PYTHONPATH=src python bench/results/cpu/fp8_calibration_headroom/headroom.py qwen3 4 1,4,16,64

For each first prompt (none: the measured prompts' own prefill calibrates; else a 1/4/32-token
prompt run first) and each margin h (the amax maps to 448 / h), the engine decodes the same
teacher-forced continuations of two prompts (200 and 300 tokens) with the fp8 cache, and the
logits are compared with the bf16-cache engine's.
"""
import os
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "..", "..", "bench"))
import bench_fp8_accuracy as B  # noqa: E402

import minipaged.engine.model as M  # noqa: E402
from minipaged.engine import Engine, Qwen3Config  # noqa: E402

torch.set_num_threads(2)
tiny = len(sys.argv) > 1 and sys.argv[1] == "tiny"
cfg = B.tiny_config() if tiny else Qwen3Config(num_hidden_layers=int(sys.argv[2]) if len(sys.argv) > 2 else 4)
margins = [float(x) for x in (sys.argv[3] if len(sys.argv) > 3 else "1,2,4,8").split(",")]
hf16 = B.hf_model(cfg, torch.bfloat16, torch.device("cpu"), 0, None)
state = {k: v.detach().clone() for k, v in hf16.state_dict().items()}
del hf16
gen = torch.Generator().manual_seed(1)
lens, steps = [200, 300], 8
prompts = [torch.randint(0, cfg.vocab_size, (n,), generator=gen).tolist() for n in lens]
conts = [torch.randint(0, cfg.vocab_size, (steps,), generator=gen).tolist() for _ in lens]
firsts = {n: torch.randint(0, cfg.vocab_size, (n,), generator=gen).tolist() for n in (1, 4, 32)}
kw = dict(device="cpu", dtype=torch.bfloat16, backend="torch", block_size=16, num_blocks=64, max_num_seqs=4,
          max_model_len=512, enable_prefix_caching=False)


def decode_logits(kv, first=None):
    eng = Engine.from_state_dict(cfg, state, kv_cache_dtype=kv, **kw)
    if kv and first is not None:
        eng.generate([first], max_new_tokens=1)  # the engine's first prompt step fixes the scales
        assert not eng._calibrate_kv
        forward = eng.model.forward

        def no_calibration(ids, pos, meta, cache):  # engine_logits' prefill would calibrate again
            meta.calibrate_kv = False
            return forward(ids, pos, meta, cache)

        eng.model.forward = no_calibration
    return B.engine_logits(eng, prompts, conts)[0]


t0 = time.time()
ref = decode_logits(None)
print(f"{'tiny Qwen3' if tiny else 'Qwen3-0.6B shape'}, {cfg.num_hidden_layers} layers, torch {torch.__version__}")
for first_n in (None, 32, 4, 1):
    for h in margins:
        M.FP8_CALIBRATION_HEADROOM = h
        c = B.compare(decode_logits("fp8", firsts.get(first_n)), ref, slice(1, steps + 1))
        where = "the measured prompts' prefill" if first_n is None else f"a {first_n}-token first prompt"
        print(f"scales from {where:>30}, margin {h:>3.0f}x: fp8-vs-bf16 logits rel-L2 {c['rel_l2']:.4f}, "
              f"top-1 {c['top1']:.3f}", flush=True)
print(f"{time.time() - t0:.0f} s")
