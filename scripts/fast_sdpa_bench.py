"""Anchor timings for the fast prefill: torch SDPA (flash / cuDNN backends) at the
shapes fast_selftest times (bf16, Hq=16, Hkv=8, D=128, causal), cold L2, median
(minipaged.benchmark.timing, as `minipaged bench`)."""
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from minipaged.benchmark import timing
from minipaged.testing import PrefillCase, make_prefill_inputs

SHAPES = [(1, 1024), (1, 4096), (1, 8192), (1, 16384), (8, 1024)]
HQ, HKV, D = 16, 8, 128


def bench(fn, reps=20):
    return timing.time_fn(fn, device="cuda", reps=reps, warmup=3, max_time_s=0).median_ms


def main():
    print("sdpa backend      " + "".join(f"  B={b},N={n:<6d}" for b, n in SHAPES) + "   (TFLOP/s)")
    for name, backend in [("sdpa_flash", SDPBackend.FLASH_ATTENTION), ("sdpa_cudnn", SDPBackend.CUDNN_ATTENTION)]:
        row = f"{name:<16s}"
        for b, n in SHAPES:
            q, k, v = make_prefill_inputs(PrefillCase(b, n, n, HQ, HKV, D), torch.bfloat16, "cuda", seed=None)
            try:
                with sdpa_kernel(backend):
                    try:
                        F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
                        fn = lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
                    except RuntimeError:
                        k2, v2 = k.repeat_interleave(HQ // HKV, 1), v.repeat_interleave(HQ // HKV, 1)
                        fn = lambda: F.scaled_dot_product_attention(q, k2, v2, is_causal=True)
                    ms = bench(fn)
                flops = 4.0 * b * HQ * n * n * D / 2
                row += f"  {flops / (ms * 1e-3) / 1e12:12.1f}"
            except Exception as exc:  # backend missing on this build
                row += f"  {'n/a':>12s}"
                print(f"# {name} B={b} N={n}: {type(exc).__name__}: {str(exc)[:120]}")
        print(row, flush=True)


if __name__ == "__main__":
    main()
