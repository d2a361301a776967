"""Quick go/no-go for the `cuda` prefill on this GPU: a few shapes against the
fp64 oracle. Exit 0 when every case is within the FlashAttention-style bound.
gpu_check.sh uses it to decide whether the sm_90a wgmma path may stay on."""

import sys

import torch

sys.path.insert(0, "tests")
import minipaged as mp  # noqa: E402
from strategies import PrefillCase, VarlenCase, assert_close, attention_fp64, make_prefill_inputs, make_varlen_inputs, varlen_to_dense  # noqa: E402

failures = 0
for dtype in (torch.bfloat16, torch.float16):
    for case in (
        PrefillCase(1, 8, 2, 1000, 1000, 128, True),
        PrefillCase(2, 2, 4, 97, 300, 128, True),
        PrefillCase(1, 2, 1, 333, 129, 64, True),
        PrefillCase(2, 4, 2, 1500, 1500, 128, False),
        PrefillCase(1, 8, 2, 4096, 4096, 128, True),
        PrefillCase(1, 8, 2, 2049, 2049, 64, True),
    ):
        q, k, v = make_prefill_inputs(case, dtype, "cuda", seed=7)
        try:
            out = mp.prefill_attention(q, k, v, causal=case.causal, backend="cuda")
            torch.cuda.synchronize()
            ref = attention_fp64(q, k, v, case.causal)
            base = attention_fp64(q, k, v, case.causal, lowp_dtype=dtype)
            assert_close(out, ref, base, dtype, f"{case} {dtype}")
            print("ok  ", case, dtype)
        except Exception as e:  # noqa: BLE001 - report every case
            failures += 1
            print("FAIL", case, dtype, type(e).__name__, str(e)[:300])
    vc = VarlenCase((0, 17, 700, 64), (5, 17, 900, 1), 2, 4, 128, True)
    q, k, v, cq, ck = make_varlen_inputs(vc, dtype, "cuda", seed=3)
    try:
        out = mp.prefill_attention_varlen(q, k, v, cq, ck, backend="cuda")
        for s in range(4):
            qs, ks, vs = varlen_to_dense(q, k, v, cq, ck, s)
            o = out[int(cq[s]) : int(cq[s + 1])].transpose(0, 1).unsqueeze(0)
            assert_close(o, attention_fp64(qs, ks, vs, True), attention_fp64(qs, ks, vs, True, lowp_dtype=dtype), dtype, f"varlen seq {s}")
        print("ok   varlen", dtype)
    except Exception as e:  # noqa: BLE001
        failures += 1
        print("FAIL varlen", dtype, type(e).__name__, str(e)[:300])
print(f"probe: {failures} failure(s)")
sys.exit(1 if failures else 0)
