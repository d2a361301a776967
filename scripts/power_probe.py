"""Energy and clocks of a prefill kernel under sustained load (issue #16, the 16k row).

The standard grid times up to 100 calls in a row, and at B=1 N=16k causal the `cuda` kernel
reads 626-645 TFLOP/s there against 690-704 over 20 calls of the same binary; nvidia-smi
showed the SW power-cap clock reason in bursts (bench/results/prefill_ablation.md, run 6).
FA3 loses less. This probe runs each backend back to back (no cache flush) for a fixed time
and reads NVML directly (ctypes, no pynvml needed): the board's energy counter before and
after, and the SM clock and clock-event reasons sampled every couple of milliseconds from a
thread. It reports per backend: calls, median time of the first 20 and of the last half,
TFLOP/s, joules per call, mean power, mean SM clock, and the share of samples with the
SW power cap / HW slowdown / thermal reasons set. Backends run in alternation (A B A B) so a
drift of the board's state shows up as a difference between the two rounds. Backends: cuda,
triton, torch, triton-l2 / triton-plain (the Gluon kernel's L2 sections forced on / off), the
SDPA anchors and flashinfer-ragged.

    python3 scripts/power_probe.py [--n 16384] [--seconds 2] [--backends cuda,flashinfer-ragged]
                                   [--json out.json]
"""
from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
import math
import statistics
import sys
import threading
import time

import torch

from minipaged.benchmark.flops import prefill_flops

# NVML clock-event reason bits (nvml.h: nvmlClocksEventReason*)
_REASONS = {"sw_power_cap": 0x4, "hw_slowdown": 0x8, "sw_thermal": 0x20, "hw_thermal": 0x40,
            "hw_power_brake": 0x80}


class Nvml:
    """The few NVML calls the probe needs, through ctypes."""

    def __init__(self, index: int = 0):
        self.lib = ctypes.CDLL("libnvidia-ml.so.1")
        self._check(self.lib.nvmlInit_v2(), "nvmlInit_v2")
        self.handle = ctypes.c_void_p()
        self._check(self.lib.nvmlDeviceGetHandleByIndex_v2(index, ctypes.byref(self.handle)), "GetHandleByIndex")
        self._reasons = getattr(self.lib, "nvmlDeviceGetCurrentClocksEventReasons", None) or \
            self.lib.nvmlDeviceGetCurrentClocksThrottleReasons

    @staticmethod
    def _check(rc: int, what: str) -> None:
        if rc != 0:
            raise RuntimeError(f"NVML {what} failed with code {rc}")

    def energy_mj(self) -> int:
        v = ctypes.c_ulonglong()
        self._check(self.lib.nvmlDeviceGetTotalEnergyConsumption(self.handle, ctypes.byref(v)), "energy")
        return int(v.value)

    def sm_clock_mhz(self) -> int:
        v = ctypes.c_uint()
        self._check(self.lib.nvmlDeviceGetClockInfo(self.handle, 1, ctypes.byref(v)), "clock")  # NVML_CLOCK_SM
        return int(v.value)

    def reasons(self) -> int:
        v = ctypes.c_ulonglong()
        self._check(self._reasons(self.handle, ctypes.byref(v)), "clock event reasons")
        return int(v.value)


class Sampler(threading.Thread):
    """SM clock and clock-event reasons every `period_s` until stopped."""

    def __init__(self, nvml: Nvml, period_s: float = 0.002):
        super().__init__(daemon=True)
        self.nvml, self.period_s = nvml, period_s
        self.samples: list[tuple[int, int]] = []
        self._stop_flag = threading.Event()

    def run(self) -> None:
        while not self._stop_flag.is_set():
            self.samples.append((self.nvml.sm_clock_mhz(), self.nvml.reasons()))
            time.sleep(self.period_s)

    def stop(self) -> list[tuple[int, int]]:
        self._stop_flag.set()
        self.join()
        return self.samples


def make_call(name: str, q, k, v, scale: float):
    if name in ("cuda", "triton", "torch"):
        import minipaged as mp
        return lambda: mp.prefill_attention(q, k, v, causal=True, scale=scale, backend=name)
    if name in ("triton-l2", "triton-plain"):  # triton with the Gluon kernel's L2 sections forced on / off
        import minipaged as mp
        from minipaged.triton import configs

        class Forced:
            """The triton call; `active()` holds the override around a backend's whole run, so the
            timed loop pays no per-call host work for it."""

            def __call__(self):
                return mp.prefill_attention(q, k, v, causal=True, scale=scale, backend="triton")

            @contextlib.contextmanager
            def active(self):
                configs.set_override("gluon_l2_sections", int(name == "triton-l2"))
                try:
                    yield
                finally:
                    configs.set_override("gluon_l2_sections", None)
        return Forced()
    from minipaged.benchmark import anchors
    if name == anchors.FI_RAGGED:
        return anchors.prepare_flashinfer_ragged(q, k, v, causal=True, scale=scale).fn
    prep = anchors.prepare_sdpa_prefill(name, q, k, v, causal=True, scale=scale)

    def call():
        with prep.context():
            return prep.fn()
    return call


def active(call):
    """The context a call needs around its run (a forced override), else none."""
    return call.active() if hasattr(call, "active") else contextlib.nullcontext()


def probe(name: str, call, nvml: Nvml, seconds: float, flops: float) -> dict:
    with active(call):
        return _probe(name, call, nvml, seconds, flops)


def _probe(name: str, call, nvml: Nvml, seconds: float, flops: float) -> dict:
    for _ in range(5):
        call()
    torch.cuda.synchronize()
    time.sleep(1.0)  # let the board's power settle between backends
    sampler = Sampler(nvml)
    e0 = nvml.energy_mj()
    sampler.start()
    starts, ends = [], []
    t0 = time.perf_counter()
    t_end = t0 + seconds
    while time.perf_counter() < t_end:
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        call()
        e.record()
        starts.append(s)
        ends.append(e)
        if len(starts) % 8 == 0:
            ends[-8].synchronize()  # keep the queue short: the GPU never idles, the host never runs far ahead
    torch.cuda.synchronize()
    wall_s = time.perf_counter() - t0
    e1 = nvml.energy_mj()
    samples = sampler.stop()
    ms = [a.elapsed_time(b) for a, b in zip(starts, ends)]
    first = statistics.median(ms[:20])
    last = statistics.median(ms[len(ms) // 2:])
    joules = (e1 - e0) / 1e3
    row = {
        "backend": name, "calls": len(ms),
        "median_ms_first20": first, "median_ms_last_half": last,
        "tflops_first20": flops / (first * 1e-3) / 1e12, "tflops_last_half": flops / (last * 1e-3) / 1e12,
        "joules_per_call": joules / len(ms), "mean_power_w": joules / wall_s,
        "gpu_busy_share": sum(ms) / 1e3 / wall_s,
        "mean_sm_clock_mhz": statistics.fmean(c for c, _ in samples) if samples else math.nan,
        "samples": len(samples),
    }
    for key, bit in _REASONS.items():
        row[f"share_{key}"] = sum(1 for _, r in samples if r & bit) / len(samples) if samples else math.nan
    return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=16384, help="sequence length (B=1, causal)")
    ap.add_argument("--seconds", type=float, default=2.0, help="back-to-back run per backend and round")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--backends", default="cuda,flashinfer-ragged")
    ap.add_argument("--json")
    ap.add_argument("--ncu-once", action="store_true",
                    help="no probe: one call per backend inside an NVTX range named ncu_<backend>, for "
                         "ncu --nvtx --nvtx-include ncu_<backend>/")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("error: power_probe needs a CUDA device", file=sys.stderr)
        return 2
    nvml = Nvml(torch.cuda.current_device())
    hq, hkv, d = 16, 8, 128
    gen = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(1, hq, args.n, d, device="cuda", generator=gen).to(torch.bfloat16)
    k = torch.randn(1, hkv, args.n, d, device="cuda", generator=gen).to(torch.bfloat16)
    v = torch.randn(1, hkv, args.n, d, device="cuda", generator=gen).to(torch.bfloat16)
    scale = 1 / math.sqrt(d)
    flops = prefill_flops(1, hq, args.n, args.n, d, causal=True)
    calls = {}
    for name in args.backends.split(","):
        try:
            calls[name] = make_call(name, q, k, v, scale)
            with active(calls[name]):
                calls[name]()
        except Exception as e:  # noqa: BLE001 - an anchor that cannot run is reported, not fatal
            print(f"{name}: skipped ({type(e).__name__}: {e})", flush=True)
            calls.pop(name, None)
    if args.ncu_once:
        for name, call in calls.items():
            torch.cuda.synchronize()
            torch.cuda.nvtx.range_push(f"ncu_{name}")
            with active(call):
                call()
            torch.cuda.synchronize()
            torch.cuda.nvtx.range_pop()
        print(f"ncu-once: one call each of {', '.join(calls)}", flush=True)
        return 0
    rows = []
    for rnd in range(args.rounds):
        for name, call in calls.items():
            row = probe(name, call, nvml, args.seconds, flops)
            row["round"] = rnd
            rows.append(row)
            print(f"round {rnd} {name:18s} calls {row['calls']:5d}  TFLOP/s first20 {row['tflops_first20']:6.1f} "
                  f"last half {row['tflops_last_half']:6.1f}  {row['joules_per_call'] * 1e3:7.2f} mJ/call  "
                  f"{row['mean_power_w']:6.1f} W  SM {row['mean_sm_clock_mhz']:6.0f} MHz  "
                  f"power-cap {row['share_sw_power_cap']:.2f}  hw-slowdown {row['share_hw_slowdown']:.2f}",
                  flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"n": args.n, "seconds": args.seconds, "device": torch.cuda.get_device_name(),
                       "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
