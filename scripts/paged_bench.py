"""Quick timing of the cuda paged attention (ops.paged) against the cuda varlen
prefill on the same K/V made contiguous (what paged saves: no gather copy, but
it pays the page-table indirection). bf16, Hq=16, Hkv=8, D=128, page 16; the
benchmark's inputs (minipaged.testing) and timer (minipaged.benchmark.timing).

    PYTHONPATH=src python scripts/paged_bench.py
"""

from __future__ import annotations

import torch

from minipaged.benchmark import timing
from minipaged.benchmark.cases import gather_varlen_kv
from minipaged.cuda import ops
from minipaged.testing import PagedCase, make_paged_inputs

Hq, Hkv, D, BS = 16, 8, 128, 16
SCALE = D ** -0.5


def timed(fn, reps=30):
    """Median microseconds, cold L2."""
    return timing.time_fn(fn, device="cuda", reps=reps, warmup=3, max_time_s=0).median_ms * 1e3


def case(q_lens, cached, label):
    ctx = [c + n for c, n in zip(cached, q_lens)]
    pc = PagedCase("mixed", tuple(q_lens), tuple(ctx), Hq, Hkv, D, BS)
    q, kc, vc, bt, cu_q, cl = make_paged_inputs(pc, torch.bfloat16, "cuda", seed=None, poison=False,
                                                spare_columns=0)
    k, v, cu_k = gather_varlen_kv(kc, vc, bt, ctx)
    mq, mk = max(q_lens), max(ctx)
    t_paged = timed(lambda: ops.paged(q, kc, vc, bt, cu_q, cl, mq, True, SCALE))
    t_varlen = timed(lambda: ops.prefill_varlen(q, k, v, cu_q, cu_k, mq, mk, True, SCALE))
    t_lse = timed(lambda: ops.paged(q, kc, vc, bt, cu_q, cl, mq, True, SCALE, True))
    flops = sum(4 * Hq * D * sum(min(c, c - n + i + 1) for i in range(n)) for n, c in zip(q_lens, ctx))
    diff = (ops.paged(q, kc, vc, bt, cu_q, cl, mq, True, SCALE).float()
            - ops.prefill_varlen(q, k, v, cu_q, cu_k, mq, mk, True, SCALE).float()).abs().max().item()
    if 1 < mq <= 16:  # the packed-GQA kernel is the default there; variant 1 is the unpacked one
        # (with max_seqlen_q == 1 the decode kernels run and variant is a decode tiling)
        t_unpacked = timed(lambda: ops.paged(q, kc, vc, bt, cu_q, cl, mq, True, SCALE, variant=1))
        print(f"{label:34s} unpacked GQA rows: {t_unpacked:9.1f} us")
    print(f"{label:34s} paged {t_paged:9.1f} us ({flops / t_paged / 1e6:6.1f} TFLOP/s)  "
          f"+lse {t_lse:9.1f} us  varlen(contiguous) {t_varlen:9.1f} us ({flops / t_varlen / 1e6:6.1f} TFLOP/s)"
          f"  max|diff| {diff:.2e}", flush=True)


if __name__ == "__main__":
    print(torch.cuda.get_device_name(), torch.__version__)
    case([512] * 8, [4096] * 8, "8 x 512 new over 4k cached")
    case([2048], [30 * 1024], "1 x 2k new over 30k cached")
    case([4] * 32, [4096] * 32, "32 x 4 (speculative) over 4k")
    case([1] * 32 + [512] * 2, [4096] * 34, "32 decode + 2 x 512 chunks over 4k")
    case([1] * 64, [4096] * 64, "64 decode over 4k (decode kernels)")
