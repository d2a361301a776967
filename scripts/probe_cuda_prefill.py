"""Quick go/no-go for the `cuda` prefill on this GPU: a few shapes against the
fp64 oracle. Exit 0 when every case is within the FlashAttention-style bound.
gpu_check.sh uses it to decide whether the sm_90a wgmma path may stay on."""

import sys

import torch

import minipaged as mp
from minipaged.testing import (
    PrefillCase,
    VarlenCase,
    assert_close,
    make_prefill_inputs,
    make_varlen_inputs,
    prefill_ref,
    varlen_ref,
)

failures = 0
for dtype in (torch.bfloat16, torch.float16):
    for case in (
        PrefillCase(1, 1000, 1000, 16, 8, 128, True),
        PrefillCase(2, 97, 300, 8, 2, 128, True),
        PrefillCase(1, 333, 129, 2, 2, 64, True),
        PrefillCase(2, 1500, 1500, 8, 4, 128, False),
        PrefillCase(1, 4096, 4096, 16, 8, 128, True),
        PrefillCase(1, 2049, 2049, 16, 8, 64, True),
    ):
        q, k, v = make_prefill_inputs(case, dtype, "cuda", seed=7)
        try:
            out = mp.prefill_attention(q, k, v, causal=case.causal, backend="cuda")
            torch.cuda.synchronize()
            ref, ref_lse = prefill_ref(q, k, v, causal=case.causal)
            base, _ = prefill_ref(q, k, v, causal=case.causal, lowp=True)
            assert_close(out, ref, base, f"{case} {dtype}", truth_lse=ref_lse)
            print("ok  ", case, dtype)
        except Exception as e:  # noqa: BLE001 - report every case
            failures += 1
            print("FAIL", case, dtype, type(e).__name__, str(e)[:300])
    vc = VarlenCase((0, 17, 700, 64), (5, 17, 900, 1), 8, 2, 128, True)
    q, k, v, cq, ck = make_varlen_inputs(vc, dtype, "cuda", seed=3)
    try:
        out = mp.prefill_attention_varlen(q, k, v, cq, ck, backend="cuda")
        ref, ref_lse = varlen_ref(q, k, v, cq, ck)
        base, _ = varlen_ref(q, k, v, cq, ck, lowp=True)
        assert_close(out, ref, base, f"varlen {vc} {dtype}", truth_lse=ref_lse)
        print("ok   varlen", dtype)
    except Exception as e:  # noqa: BLE001
        failures += 1
        print("FAIL varlen", dtype, type(e).__name__, str(e)[:300])
print(f"probe: {failures} failure(s)")
sys.exit(1 if failures else 0)
