"""The Triton launch cache (minipaged.triton.launch) against Triton's own launch path, on the GPU.

For engine-shaped calls of the triton backend (decode at B=1 and B=8, fp8 decode, a mixed paged
step, write_kv_cache, a varlen prefill), bf16: the outputs with the cache off, then with it on
(a miss, then hits), must be bitwise equal (same kernels, same arguments); then with the check
mode on, each hit's Triton specialisation must equal its entry's. Prints one line per case and
exits 1 on any difference.

    PYTHONPATH=src python3 scripts/launch_cache_check.py
"""

from __future__ import annotations

import sys
import traceback

import torch


def _cases(dev, dt):
    from minipaged import registry
    from triton_launch_profile import mixed_step_inputs  # this script's folder

    Hq, Hkv, D, page = 16, 8, 128, 16
    g = torch.Generator(device=dev).manual_seed(0)
    nblk = 2048
    kc = torch.randn(nblk, page, Hkv, D, device=dev, dtype=dt, generator=g)
    vc = torch.randn_like(kc)
    scale = D ** -0.5
    op = {name: registry.resolve(name, "cuda", "triton").op(name)
          for name in ("decode", "paged", "write_kv_cache", "prefill_varlen")}

    def decode_case(batch, ctx):
        width = -(-ctx // page)
        tab = torch.randperm(nblk, device=dev, generator=g)[: batch * width].int().reshape(batch, width)
        q = torch.randn(batch, Hq, D, device=dev, dtype=dt, generator=g)
        lens = torch.full((batch,), ctx, dtype=torch.int32, device=dev)
        return lambda: op["decode"](q, kc, vc, tab, lens, scale, True)

    kc8 = (kc * 0.25).to(torch.float8_e4m3fn)
    vc8 = (vc * 0.25).to(torch.float8_e4m3fn)
    ks = torch.full((Hkv,), 4.0, device=dev)
    tab8 = torch.randperm(nblk, device=dev, generator=g)[:64].int().reshape(1, 64)
    q8 = torch.randn(1, Hq, D, device=dev, dtype=dt, generator=g)
    lens8 = torch.full((1,), 1000, dtype=torch.int32, device=dev)
    dec8 = registry.resolve("decode", "cuda", "triton").op("decode")

    qm, tabm, cu, lensm = mixed_step_inputs(dev, dt, Hq, D, page, nblk, g)

    k_new = torch.randn(272, Hkv, D, device=dev, dtype=dt, generator=g)
    v_new = torch.randn_like(k_new)
    kw, vw = torch.zeros_like(kc[:64]), torch.zeros_like(vc[:64])
    slots_w = torch.randperm(64 * page, device=dev, generator=g)[:272]

    def write():
        kw.zero_(), vw.zero_()
        op["write_kv_cache"](k_new, v_new, kw, vw, slots_w)
        return kw.clone(), vw.clone()

    seqs = [300, 77, 1024]
    cu_p = torch.tensor([0] + list(torch.tensor(seqs).cumsum(0)), dtype=torch.int32, device=dev)
    qp = torch.randn(sum(seqs), Hq, D, device=dev, dtype=dt, generator=g)
    kp = torch.randn(sum(seqs), Hkv, D, device=dev, dtype=dt, generator=g)
    vp = torch.randn_like(kp)
    return {
        "decode B=1 L=4k": decode_case(1, 4096),
        "decode B=8 L=1k": decode_case(8, 1000),
        "decode fp8 B=1": lambda: dec8(q8, kc8, vc8, tab8, lens8, scale, True, ks, ks),
        "paged 256-chunk + 15 decodes": lambda: op["paged"](qm, kc, vc, tabm, cu, lensm, 256, True, scale, True),
        "write_kv_cache 272 tokens": write,
        "prefill_varlen 3 seqs": lambda: op["prefill_varlen"](qp, kp, vp, cu_p, cu_p, 1024, 1024, True, scale, True),
    }


def _flat(res):
    return [t.clone() for t in (res if isinstance(res, tuple) else (res,))]


def main() -> int:
    if not torch.cuda.is_available():
        print("error: launch_cache_check needs a CUDA GPU", file=sys.stderr)
        return 2
    from minipaged.triton import launch

    bad = 0
    for name, call in _cases(torch.device("cuda"), torch.bfloat16).items():
        launch.ENABLED, launch.CHECK = False, False
        ref = _flat(call())
        launch.ENABLED = True
        got = [_flat(call()) for _ in range(3)]  # a miss (Triton's path), then hits
        torch.cuda.synchronize()
        same = all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for g in got for a, b in zip(ref, g))
        launch.CHECK = True
        try:
            call()
            torch.cuda.synchronize()
            check = "ok"
        except Exception as e:  # noqa: BLE001 - reported
            check = f"{type(e).__name__}: {e}"[:600]
            traceback.print_exc()
        launch.CHECK = False
        print(f"{name}: bitwise {'equal' if same else 'DIFFERENT'}; check mode: {check}", flush=True)
        bad += (not same) + (check != "ok")
    print(f"launch_cache_check: {bad} problem(s)")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
