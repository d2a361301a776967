"""Quick GPU timing of the Triton ops next to torch SDPA (flash), for tuning the
config table. Not the project benchmark (that is `minipaged bench`).

    PYTHONPATH=src python scripts/triton_tune.py [prefill] [decode] [sweep] [paged]

Medians of minipaged.benchmark.timing.time_fn (cold, clean L2 before every
timed call, as `minipaged bench`), the benchmark's random inputs
(minipaged.testing), bf16, Qwen3-0.6B heads (Hq 16, Hkv 8, D 128).
"""

from __future__ import annotations

import math
import sys

import torch
import torch.nn.functional as F
import triton

from minipaged.benchmark import timing
from minipaged.testing import DecodeCase, PagedCase, PrefillCase, make_decode_inputs, make_paged_inputs, \
    make_prefill_inputs
from minipaged.triton import configs, ops

HQ, HKV, D = 16, 8, 128
DT = torch.bfloat16


def _sdpa_flash(q, k, v, causal):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal)


def _bench(fn):
    """Median ms of eager calls, cold L2."""
    return timing.time_fn(fn, device="cuda", reps=60, warmup=10, max_time_s=0).median_ms


def _prefill_inputs(B, N, d=D):
    return make_prefill_inputs(PrefillCase(B, N, N, HQ, HKV, d), DT, "cuda", seed=None)


def prefill_table(cfgs=None):
    print("## prefill (causal, bf16, Hq16 Hkv8 D128); TFLOP/s counts the causal half")
    print(f"{'B':>3} {'N':>6} {'config':>16} {'triton ms':>10} {'TFLOP/s':>8} {'sdpa ms':>9} {'TFLOP/s':>8}")
    for B, N in ((1, 1024), (1, 4096), (1, 8192), (1, 16384), (8, 1024)):
        q, k, v = _prefill_inputs(B, N)
        flops = 4 * B * HQ * N * N * D / 2
        kr, vr = k.repeat_interleave(HQ // HKV, 1), v.repeat_interleave(HQ // HKV, 1)
        t_sdpa = _bench(lambda: _sdpa_flash(q, kr, vr, True))
        ref = _sdpa_flash(q, kr, vr, True).float()
        for cfg in (cfgs or [None]):
            if cfg is not None:
                configs.set_override("prefill", cfg)
            else:
                configs.set_override("prefill", None)
            try:
                out = ops.prefill(q, k, v, True, 1 / math.sqrt(D))
                err = (out.float() - ref).abs().max().item()
                t = _bench(lambda: ops.prefill(q, k, v, True, 1 / math.sqrt(D)))
                print(f"{B:>3} {N:>6} {cfg or 'table':>16} {t:>10.3f} {flops / t / 1e9:>8.1f} "
                      f"{t_sdpa:>9.3f} {flops / t_sdpa / 1e9:>8.1f}  maxdiff_vs_sdpa={err:.2e}", flush=True)
            except Exception as e:  # a config that does not fit is a result too
                print(f"{B:>3} {N:>6} {cfg:>16} FAILED {type(e).__name__}: {str(e)[:120]}", flush=True)
        configs.set_override("prefill", None)
        del q, k, v, kr, vr


def _paged(B, L, page=16):
    return make_decode_inputs(DecodeCase(B, L, HQ, HKV, D, page), DT, "cuda", seed=None, poison=False,
                              spare_columns=0)


def _graph_us(args):
    """GPU time per decode call: CUDA-graph replays, cold L2 (no host launch cost)."""
    t = timing.time_fn(lambda: ops.decode(*args, 0.088), device="cuda", reps=30, max_time_s=0, cuda_graph=True)
    return t.median_ms * 1e3


def _set_env(splits, cfg):
    configs.set_override("decode_splits", splits)
    configs.set_override("decode", cfg)


def decode_table(sweep=False):
    print("## decode (bf16, Hq16 Hkv8 D128, page 16); TB/s = bytes of K+V read / time")
    print("## eager = the Python call (cold L2); graph = GPU time per call as a CUDA-graph replay (cold L2)")
    print(f"{'B':>4} {'L':>6} {'variant':>14} {'eager us':>9} {'TB/s':>6} {'graph us':>9} {'TB/s':>6} {'sdpa us':>8} {'TB/s':>6}")
    for B, L in ((1, 4096), (1, 32768), (8, 4096), (32, 4096), (64, 8192), (256, 1024)):
        nbytes = 2 * B * L * HKV * D * 2
        q, kc, vc, tables, ctx = _paged(B, L)
        kd = kc[tables.long()].reshape(B, L, HKV, D).transpose(1, 2)
        vd = vc[tables.long()].reshape(B, L, HKV, D).transpose(1, 2)
        kr, vr = kd.repeat_interleave(HQ // HKV, 1), vd.repeat_interleave(HQ // HKV, 1)
        del kd, vd
        q4 = q[:, :, None]
        try:
            t_sdpa = _bench(lambda: _sdpa_flash(q4, kr, vr, False)) * 1e3
            ref = _sdpa_flash(q4, kr, vr, False)[:, :, 0].float()
        except Exception:
            t_sdpa, ref = float("nan"), None
        del kr, vr
        variants = [(None, None)]
        if sweep:
            variants += [(None, c) for c in ("64,4,3", "128,4,2", "128,4,3", "32,4,2", "64,8,2")]
            variants += [(str(x), None) for x in (1, 2, 4, 8, 16, 32, 64)]
        for splits, cfg in variants:
            _set_env(splits, cfg)
            label = f"s={splits}" if splits else (f"cfg={cfg}" if cfg else "auto")
            try:
                out = ops.decode(q, kc, vc, tables, ctx, 1 / math.sqrt(D))
                err = (out.float() - ref).abs().max().item() if ref is not None else float("nan")
                t = _bench(lambda: ops.decode(q, kc, vc, tables, ctx, 1 / math.sqrt(D))) * 1e3
                tg = _graph_us((q, kc, vc, tables, ctx))
                print(f"{B:>4} {L:>6} {label:>14} {t:>9.1f} {nbytes / t / 1e6:>6.2f} {tg:>9.1f} "
                      f"{nbytes / tg / 1e6:>6.2f} {t_sdpa:>8.1f} {nbytes / t_sdpa / 1e6:>6.2f}  maxdiff_vs_sdpa={err:.2e}",
                      flush=True)
            except Exception as e:
                print(f"{B:>4} {L:>6} {label:>14} FAILED {type(e).__name__}: {str(e)[:160]}", flush=True)
        _set_env(None, None)
        del q, kc, vc
        torch.cuda.empty_cache()


def prefill_extra():
    """Head dim 64 and non-causal, and the small-grid rule (B=1, N=1k)."""
    print("## prefill extras (bf16, Hq16 Hkv8)")
    for B, N, d, causal, cfgs in ((1, 8192, 64, True, [None, "128,128,8,3", "128,64,4,3"]),
                                  (1, 8192, 128, False, [None, "128,128,8,3"]),
                                  (1, 1024, 128, True, [None, "128,64,8,3", "64,64,4,3", "64,128,4,3", "64,64,4,2"]),
                                  (2, 2048, 128, True, [None, "128,64,8,3", "64,64,4,3"])):
        q, k, v = _prefill_inputs(B, N, d)
        flops = 4 * B * HQ * N * N * d / (2 if causal else 1)
        kr, vr = k.repeat_interleave(HQ // HKV, 1), v.repeat_interleave(HQ // HKV, 1)
        t_sdpa = _bench(lambda: _sdpa_flash(q, kr, vr, causal))
        ref = _sdpa_flash(q, kr, vr, causal).float()
        for cfg in cfgs:
            if cfg is None:
                configs.set_override("prefill", None)
            else:
                configs.set_override("prefill", cfg)
            try:
                out = ops.prefill(q, k, v, causal, 1 / math.sqrt(d))
                err = (out.float() - ref).abs().max().item()
                t = _bench(lambda: ops.prefill(q, k, v, causal, 1 / math.sqrt(d)))
                print(f"B={B} N={N} D={d} causal={causal} {cfg or 'table':>12}: {t:.3f} ms "
                      f"{flops / t / 1e9:.1f} TFLOP/s | sdpa {t_sdpa:.3f} ms {flops / t_sdpa / 1e9:.1f}"
                      f"  maxdiff={err:.2e}", flush=True)
            except Exception as e:
                print(f"B={B} N={N} D={d} {cfg} FAILED {type(e).__name__}: {str(e)[:160]}", flush=True)
        configs.set_override("prefill", None)


def host_overhead():
    """Back-to-back eager calls without flushes: max(host launch cost, GPU time) per call.
    A throughput of launches, not a kernel time, so not timing.time_fn's per-call events."""
    import time

    q, kc, vc, tables, ctx = _paged(1, 256)
    for splits in ("1", None):
        _set_env(splits, None)
        ops.decode(q, kc, vc, tables, ctx, 0.088)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(300):
            ops.decode(q, kc, vc, tables, ctx, 0.088)
        torch.cuda.synchronize()
        print(f"## eager decode B=1 L=256 splits={splits or 'auto'}: "
              f"{(time.perf_counter() - t0) / 300 * 1e6:.1f} us per call back-to-back", flush=True)
    _set_env(None, None)
    a = torch.randn(16, 16, 128, device="cuda")
    t0 = time.perf_counter()
    for _ in range(300):
        torch.empty_like(a)
    torch.cuda.synchronize()
    print(f"## torch.empty: {(time.perf_counter() - t0) / 300 * 1e6:.2f} us", flush=True)


def _paged_problem(q_lens, ctxs, page=16):
    case = PagedCase("mixed", tuple(q_lens), tuple(ctxs), HQ, HKV, D, page)
    return make_paged_inputs(case, DT, "cuda", seed=None, poison=False, spare_columns=0)


def _paged_variant(gather, cfg):
    ops.PAGED_GATHER = gather
    if cfg is None:
        configs.set_override("paged", None)
    else:
        configs.set_override("paged", cfg)
    return f"gather={gather} cfg={cfg or 'table'}"


def paged_table(sweep=False):
    """ops.paged next to the kernels it generalises, on the same work."""
    print("## paged (bf16, Hq16 Hkv8 D128, page 16), medians, cold L2")
    scale = 1 / math.sqrt(D)
    default_gather = ops.PAGED_GATHER
    variants = [(default_gather, None)]
    if sweep:
        variants = [(g, None) for g in (0, 1, 2)]
    # short queries next to decode at the same batch and context
    for B, qn, L in ((32, 4, 4096), (32, 1, 4096), (1, 4, 32768), (8, 4, 4096)):
        q, kc, vc, tables, cu, ctx = _paged_problem([qn] * B, [L] * B)
        qd = q.view(B, qn, HQ, D)[:, -1].contiguous()
        t_d = _bench(lambda: ops.decode(qd, kc, vc, tables, ctx, scale)) * 1e3
        nbytes = 2 * B * L * HKV * D * 2
        for gather, cfg in variants:
            label = _paged_variant(gather, cfg)
            try:
                t_p = _bench(lambda: ops.paged(q, kc, vc, tables, cu, ctx, qn, True, scale)) * 1e3
            except Exception as e:
                print(f"B={B} q_len={qn} {label} FAILED {type(e).__name__}: {str(e)[:160]}", flush=True)
                continue
            print(f"B={B:>3} q_len={qn} ctx={L:>6} {label}: paged {t_p:8.1f} us ({nbytes / t_p / 1e6:.2f} TB/s) | "
                  f"decode (q_len 1) {t_d:8.1f} us ({nbytes / t_d / 1e6:.2f} TB/s)", flush=True)
    if sweep:
        variants += [(default_gather, c) for c in ("128,64,8,2", "128,32,8,3", "64,64,4,3")]
    # chunks over a cached prefix next to prefill_varlen on the same K/V made contiguous
    for S, new, cached in ((8, 512, 4096), (1, 2048, 30000), (4, 1024, 8192)):
        L = new + cached
        q, kc, vc, tables, cu, ctx = _paged_problem([new] * S, [L] * S)
        k = kc[tables.long()].reshape(S * L, HKV, D)
        v = vc[tables.long()].reshape(S * L, HKV, D)
        cu_k = torch.arange(0, S * L + 1, L, dtype=torch.int32, device="cuda")
        t_v = _bench(lambda: ops.prefill_varlen(q, k, v, cu, cu_k, new, L, True, scale))
        o_v = ops.prefill_varlen(q, k, v, cu, cu_k, new, L, True, scale)
        flops = 4 * S * HQ * D * new * (cached + (new + 1) / 2)
        for gather, cfg in variants:
            label = _paged_variant(gather, cfg)
            try:
                t_p = _bench(lambda: ops.paged(q, kc, vc, tables, cu, ctx, new, True, scale))
                o_p = ops.paged(q, kc, vc, tables, cu, ctx, new, True, scale)
                print(f"S={S} new={new} cached={cached} {label}: paged {t_p * 1e3:8.1f} us "
                      f"({flops / t_p / 1e9:.0f} TFLOP/s) | prefill_varlen {t_v * 1e3:8.1f} us "
                      f"({flops / t_v / 1e9:.0f} TFLOP/s)  maxdiff={(o_p.float() - o_v.float()).abs().max().item():.2e}",
                      flush=True)
            except Exception as e:
                print(f"S={S} new={new} {label} FAILED {type(e).__name__}: {str(e)[:160]}", flush=True)
        del k, v
    _paged_variant(default_gather, None)


if __name__ == "__main__":
    args = sys.argv[1:] or ["prefill", "decode"]
    print(torch.cuda.get_device_name(), "triton", triton.__version__, "torch", torch.__version__, flush=True)
    if "prefill" in args:
        prefill_table()
    if "extra" in args:
        prefill_extra()
    if "overhead" in args:
        host_overhead()
    if "decode" in args:
        decode_table(sweep="sweep" in args)
    if "paged" in args:
        paged_table(sweep="sweep" in args)
