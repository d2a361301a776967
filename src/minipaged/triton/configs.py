"""Launch configurations for the Triton kernels.

A small measured table instead of `triton.autotune`: autotuning re-times every
config on the first call of each new shape key, which would pollute benchmarks
and break CUDA-graph capture of decode. The table is keyed on what changes the
best tile: head dim, element size, causal or not, and whether there are enough
query tiles to fill the GPU. Under TRITON_INTERPRET=1 every op uses small fixed
tiles so the CPU interpreter stays fast.

Nothing here imports triton: the numbers are plain ints.
"""

from __future__ import annotations

import contextlib
import functools
import os
from dataclasses import dataclass

import torch


class _Launched:
    """A tile whose dataclass has num_warps, num_stages and maxnreg (None: the compiler's
    choice of registers)."""

    def launch_options(self) -> dict:
        """num_warps / num_stages (and maxnreg when set), as a launch takes them."""
        opts = {"num_warps": self.num_warps, "num_stages": self.num_stages}
        if self.maxnreg is not None:
            opts["maxnreg"] = self.maxnreg
        return opts


@dataclass(frozen=True)
class PrefillConfig(_Launched):
    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    # a register cap per thread (triton's `maxnreg`), so that two programs fit on an SM; None: the
    # compiler's choice
    maxnreg: int | None = None


@dataclass(frozen=True)
class DecodeConfig(_Launched):
    block_n: int
    num_warps: int
    num_stages: int
    # a register cap per thread (triton's `maxnreg`): more programs resident per SM, so more
    # K/V tiles in flight; None: the compiler's choice. The "decode" override sets it as its
    # fourth number (BLOCK_N, WARPS, STAGES, MAXNREG).
    maxnreg: int | None = None
    # the full tiles read their block ids a tile ahead (decode.py, TABLE_AHEAD), so that the
    # pipeliner keeps num_stages - 1 K/V tiles in flight; the "decode_table_ahead" override wins
    table_ahead: bool = False


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


@functools.lru_cache(maxsize=None)
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of `device`; a small stand-in on CPU (interpreter)."""
    if device.type != "cuda":
        return 4
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _sm_count(index)


# (head_dim, element_bytes, causal) -> config for long sequences on sm_90.
# Measured entries come from H200 sweeps (bench/results/nvidia-h200/triton_config_notes.md);
# the others are conservative choices that fit 227 KB of shared memory.
_PREFILL_SM90 = {
    (64, 2, True): PrefillConfig(128, 64, 8, 3),
    (64, 2, False): PrefillConfig(128, 64, 8, 3),
    # the fastest of the swept tiles for long causal prompts (numbers in the notes)
    (128, 2, True): PrefillConfig(128, 64, 8, 3),
    (128, 2, False): PrefillConfig(128, 64, 8, 3),
    (256, 2, True): PrefillConfig(128, 64, 8, 2),
    (256, 2, False): PrefillConfig(128, 64, 8, 2),
    # fp32 runs its dots as exact FMA (not TF32): register bound, correctness over speed
    (64, 4, True): PrefillConfig(64, 64, 8, 2),
    (64, 4, False): PrefillConfig(64, 64, 8, 2),
    (128, 4, True): PrefillConfig(64, 32, 8, 2),
    (128, 4, False): PrefillConfig(64, 32, 8, 2),
    (256, 4, True): PrefillConfig(32, 32, 8, 1),
    (256, 4, False): PrefillConfig(32, 32, 8, 1),
}

# Tuning scripts force a config through set_override(); the hot path only reads this dict.
# "prefill": (BM, BN, WARPS, STAGES[, MAXNREG]), "decode": (BN, WARPS, STAGES[, MAXNREG]), "decode_splits": int,
# "decode_worklist": 0 or 1;
# "paged": (BM, BN, WARPS, STAGES[, MAXNREG]), "prefill_variant": one of PREFILL_VARIANTS;
# paged long chunks and mixed batches: "paged_long_kernel" (PAGED_LONG_KERNELS),
# "paged_mixed" (PAGED_MIXED_MODES), "paged_short": (ROWS, BN, WARPS, STAGES),
# "paged_prefetch": 0 or 1; "paged_heads_fastest": 0 or 1; "paged_fp8_f16": 0 or 1; "decode_fp8_f16": 0 or 1;
# "decode_fp8_words": 0, 1 (words) or 2 (planes); "decode_table_ahead": 0 or 1; "prefill_lazy_rescale": 0..12;
# the Gluon paged loader: "gluon_table_ahead" and "gluon_split_loader", 0 or 1; the Gluon kernels'
# ablation steps: "gluon_overlap" 0 or 1, "gluon_regs": (consumer, loader) registers per thread;
# "gluon_l2_sections" 0 or 1; "paged_packed_kernel": "v1" or "v2".
OVERRIDES: dict[str, object] = {}
# bumped by set_override so that cached launch plans are recomputed
overrides_version = 0


def set_override(name: str, value) -> None:
    """Force (value) or release (None) one config for tuning runs; see OVERRIDES.
    "prefill_variant" takes a name from PREFILL_VARIANTS instead of numbers."""
    global overrides_version
    if name not in ("prefill", "decode", "decode_splits", "decode_worklist", "decode_fp8_f16", "decode_fp8_words",
                    "decode_table_ahead",
                    "paged",
                    "prefill_variant", "prefill_lazy_rescale", "gluon_table_ahead", "gluon_split_loader",
                    "gluon_overlap", "gluon_regs", "gluon_l2_sections", *_PAGED_OVERRIDES):
        raise ValueError(f"unknown override {name!r}")
    named = {"prefill_variant": PREFILL_VARIANTS, "paged_long_kernel": PAGED_LONG_KERNELS,
             "paged_mixed": PAGED_MIXED_MODES, "paged_packed_kernel": PAGED_LONG_KERNELS}
    if value is None:
        OVERRIDES.pop(name, None)
    elif name in named:
        if value not in named[name]:
            raise ValueError(f"{name} must be one of {named[name]}, got {value!r}")
        OVERRIDES[name] = value
    elif name in ("paged_prefetch", "paged_heads_fastest", "decode_fp8_f16", "decode_table_ahead", "paged_fp8_f16",
                  "decode_worklist",
                  "gluon_table_ahead",
                  "gluon_split_loader", "gluon_overlap", "gluon_l2_sections"):
        OVERRIDES[name] = bool(int(value))
    elif name == "prefill_lazy_rescale":
        if not 0 <= int(value) <= _MAX_LAZY_RESCALE:
            raise ValueError(f"prefill_lazy_rescale must be in [0, {_MAX_LAZY_RESCALE}], got {value!r}")
        OVERRIDES[name] = int(value)
    elif name == "decode_fp8_words":
        if int(value) not in (0, 1, 2):
            raise ValueError(f"decode_fp8_words must be 0, 1 (words) or 2 (planes), got {value!r}")
        OVERRIDES[name] = int(value)
    else:
        OVERRIDES[name] = tuple(int(x) for x in str(value).split(",")) if isinstance(value, str) else value
    overrides_version += 1


@contextlib.contextmanager
def overriding(**values):
    """set_override of each name for the block (None releases one); the overrides from before
    come back on exit, even on failure."""
    saved = {name: OVERRIDES.get(name) for name in values}
    try:
        for name, value in values.items():
            set_override(name, value)
        yield
    finally:
        for name, value in saved.items():
            set_override(name, value)  # through set_override: it also bumps overrides_version

_SHORT_CAUSAL_Q = 1024


def prefill_config(head_dim: int, dtype: torch.dtype, causal: bool, batch_heads: int,
                   max_seqlen_q: int, device: torch.device, max_seqlen_k: int | None = None) -> PrefillConfig:
    """The pointer kernel's tile for a prefill of batch_heads (sequence, query head) pairs whose
    longest sequence has max_seqlen_q queries and max_seqlen_k keys (None: as many as queries)."""
    if interpreting() or device.type != "cuda":
        return PrefillConfig(16, 16, 4, 1)
    if "prefill" in OVERRIDES:
        return PrefillConfig(*OVERRIDES["prefill"])
    elem = dtype.itemsize
    major, _ = torch.cuda.get_device_capability(device)
    cfg = _PREFILL_SM90.get((head_dim, elem, causal), PrefillConfig(64, 32, 4, 2))
    if major < 9:
        # Ampere-class shared memory (~164 KB) and mma.sync: smaller N tiles.
        cfg = PrefillConfig(cfg.block_m, min(cfg.block_n, 64), cfg.num_warps, 2)
    # Too few query tiles to fill the SMs (short prompts, small batch): halve BLOCK_M.
    if cfg.block_m > 64 and batch_heads * -(-max_seqlen_q // cfg.block_m) < sm_count(device):
        cfg = PrefillConfig(64, min(cfg.block_n, 64), 4, cfg.num_stages)
    # Short causal prompts at D 128 on sm_90 (at most 1k queries and 1k keys per sequence):
    # 64-row tiles as well, whatever the grid. With 1k keys a 128-row tile has at most 16 key
    # tiles, so its masked diagonal band is a large share of its work; and a 64-row program
    # takes 112 KB of shared memory, so two can share an SM. A short chunk over a long prefix
    # keeps the 128-row tile (measured: bench/results/nvidia-h200/triton_config_notes.md).
    elif (major >= 9 and causal and head_dim == 128 and elem == 2 and cfg.block_m > 64
          and max(max_seqlen_q, max_seqlen_k or 0) <= _SHORT_CAUSAL_Q):
        cfg = PrefillConfig(64, 64, 4, 3)
    return cfg


# ----------------------------------------------------------------- Hopper prefill variants

# How the prefill kernel moves its tiles (issue #16): "pointer" is prefill._attn_fwd (pointer
# loads, software-pipelined by the compiler), "tma" is prefill_tma._attn_fwd_tma with tensor
# descriptors (TMA loads and stores), "tma_ws" the same with the key loop warp-specialised by
# the compiler (a producer warpgroup issuing TMA, two consumer warpgroups), "gluon" is
# prefill_gluon._attn_fwd_gluon, the same split written by hand in Gluon (a loader warp, two
# consumer warpgroups that run independently, Q K^T of the next tile issued before the P V
# of this one): sm_90 GPUs only, no interpreter.
PREFILL_VARIANTS = ("pointer", "tma", "tma_ws", "gluon")

# >>> The one switch: the variant prefill uses on sm_90 when nothing is overridden. <<<
# "pointer" until scripts/triton_hopper_ab.py, run on the H200, shows a Hopper variant ahead of
# the pointer kernel on the standard prefill grid (causal and not, D 64 and 128, dense and
# varlen); then set it to that variant's name. Other GPUs, fp32, and layouts that TMA cannot
# address (prefill_tma.usable) always take the pointer kernel.
SM90_PREFILL_VARIANT = "gluon"
# The Gluon kernel runs by default on sm_90 for D 128 and at least this many keys per sequence
# on average (dense: Nk; varlen: packed keys / sequences, known on the host). Below, its per-program
# descriptors and 128-row blocks lose to the pointer kernel's short-prompt tiles (B=1 N=1k causal
# 0.83x, a batch of 8 prompts averaging 1.6k keys 0.89x; 4k and up 1.08-1.26x:
# bench/results/nvidia-h200/triton_gluon_984f7c1/). At D 64 it loses on dense rows (causal B=1
# 1k-16k 0.81-0.96x the pointer kernel) and wins only chunks over long prefixes, so D 64 stays on
# the pointer kernel (bench/results/nvidia-h200/gluon_ablation_fff05a4/).
GLUON_MIN_AVG_KEYS = 2048
GLUON_HEAD_DIMS = (128,)
# Paged long chunks on sm_90 (D 128, 16-bit caches of >= 16-token pages, no forced tile): the
# long launch runs prefill_gluon._paged_fwd_gluon when its longest chunk has at least this many
# new tokens (two of the kernel's 128-row blocks; a choice, not a measured crossover).
GLUON_PAGED_MIN_Q = 256
# The Gluon paged loader reads a key tile's block-table entries once for K and V, a tile
# ahead, every lane holding them all (prefill_gluon._tile_pages); False: one scalar load per
# page copy, for K and again for V (the kernel measured at 27d67dc).
GLUON_PAGED_TABLE_AHEAD = True
# The same loader as two warps, one for K and one for V, each issuing half the page copies (the
# three warps the warpgroup round-up leaves idle hold them for free). At page 16 one warp's
# copies were the bottleneck: 264.9 against 281.2 us on the B=8 q=512 chunk row, 801.2 against
# 834.6 at 2k over 32k; a tie at page 32 (bench/results/nvidia-h200/gluon_loader_cf84eb6/).
GLUON_PAGED_SPLIT_LOADER = True


def gluon_table_ahead() -> bool:
    return OVERRIDES.get("gluon_table_ahead", GLUON_PAGED_TABLE_AHEAD)


def gluon_split_loader() -> bool:
    return OVERRIDES.get("gluon_split_loader", GLUON_PAGED_SPLIT_LOADER)


def gluon_overlap() -> bool:
    """Whether the Gluon consumers issue the next tile's Q K^T before this tile's P V (always, but
    for the ablation's serial step)."""
    return OVERRIDES.get("gluon_overlap", True)


# The Gluon dense kernel's programs in L2 sections (prefill_gluon.l2_section: whole GQA groups
# whose K/V fit in half the L2, one section after the other) when a grid's K/V exceed the L2, as
# the CUDA kernel's CfgWsL2. At B=1 N=16k under sustained load on the H200: 593.8 against 577.8
# TFLOP/s and 3-5% less energy per call (bench/results/nvidia-h200/gluon_ablation_fff05a4/).
GLUON_L2_SECTIONS = True


def gluon_l2_sections() -> bool:
    return OVERRIDES.get("gluon_l2_sections", GLUON_L2_SECTIONS)


def gluon_regs(consumer: int, loader: int) -> tuple[int, int]:
    """(consumer, loader) registers per thread of the Gluon partitions: the defaults given, or
    the ablation's override (equal to the launch cap: no reallocation)."""
    return tuple(OVERRIDES.get("gluon_regs", (consumer, loader)))


# (variant, head_dim) -> tile for 16-bit inputs on sm_90, causal or not. Shared memory from the
# sm_90 compile (scripts/triton_sm90_compile.py); none of these is measured yet.
# tma_ws needs num_warps=4: the pass turns that one warpgroup into a producer and two consumer
# warpgroups of BLOCK_M/2 rows each (12 warps in all), and leaves 8-warp kernels unspecialised.
_PREFILL_SM90_HOPPER = {
    ("tma", 64): PrefillConfig(128, 128, 8, 2),      # 81 KB
    ("tma", 128): PrefillConfig(128, 64, 8, 3),      # 129 KB, the pointer kernel's tile
    ("tma_ws", 64): PrefillConfig(128, 128, 4, 3),   # 129 KB
    ("tma_ws", 128): PrefillConfig(128, 128, 4, 2),  # 193 KB; 3 stages would need 257 KB
    # gluon: BLOCK_M is two consumers' 64 rows, num_stages the K and V ring depth
    ("gluon", 64): PrefillConfig(128, 128, 4, 2),     # 81 KB
    ("gluon", 128): PrefillConfig(128, 128, 4, 2),    # 161 KB
}
# The pointer kernel's unmasked key loop rescales acc and l only when some row's max grew by
# more than this many log2 units in the tile (softmax._softmax_step_lazy); 0: every tile, as
# FlashAttention-2 does. At most 12 keeps a 16-bit P finite (p <= 2^12). Under triton 3.6 the
# sm_90 loop is 330 instructions per tile without it; with 8 about 290 on tiles that skip
# the rescale (362 with it), at the price of a tile-wide max and two more CTA barriers per
# tile (compiled ahead of time: scripts/triton_sm90_compile.py --only bf16_d128_causal_dense
# lists the loop lengths). Off: on the H200 it was slower on every row of its A/B, 0.81-0.93x the
# plain kernel's speed (geomean 0.855x; bench/results/nvidia-h200/triton_hopper_ab_a1d04f7/):
# the extra barriers cost more than the skipped rescales save. Kept as an A/B variant.
PREFILL_LAZY_RESCALE = 0
_MAX_LAZY_RESCALE = 12


def prefill_lazy_rescale() -> int:
    return int(OVERRIDES.get("prefill_lazy_rescale", PREFILL_LAZY_RESCALE))


# head dims the default selection sends to a Hopper variant (the others were never compiled
# for it); a forced variant runs any head dim
HOPPER_PREFILL_HEAD_DIMS = (64, 128)


def prefill_variant(dtype: torch.dtype, device: torch.device, head_dim: int | None = None,
                    avg_keys: float | None = None) -> str:
    """Which prefill kernel to launch (before the layout check prefill_tma.usable). With the
    problem's head_dim and average keys per sequence, the Gluon default also applies its size
    rule; without them, the sm_90 default itself."""
    if "prefill_variant" in OVERRIDES:
        # forced (tuning, tests): also under the interpreter, which runs descriptors too
        return OVERRIDES["prefill_variant"]
    if interpreting() or device.type != "cuda" or dtype not in (torch.float16, torch.bfloat16):
        return "pointer"
    major, _ = torch.cuda.get_device_capability(device)
    if major != 9:
        return "pointer"
    if SM90_PREFILL_VARIANT == "gluon" and head_dim is not None and (
            head_dim not in GLUON_HEAD_DIMS or avg_keys is None or avg_keys < GLUON_MIN_AVG_KEYS):
        return "pointer"
    return SM90_PREFILL_VARIANT


def prefill_hopper_config(variant: str, head_dim: int, dtype: torch.dtype, device: torch.device) -> PrefillConfig:
    """Tile of a Hopper prefill variant. No BLOCK_M halving for short prompts (unlike
    prefill_config): the warp-specialised kernel splits BLOCK_M between two consumer
    warpgroups, each of which needs the 64 rows of one wgmma."""
    if interpreting() or device.type != "cuda":
        return PrefillConfig(16, 16, 4, 1)
    if "prefill" in OVERRIDES:
        return PrefillConfig(*OVERRIDES["prefill"])
    cfg = _PREFILL_SM90_HOPPER.get((variant, head_dim), PrefillConfig(64, 64, 4, 2))
    if dtype.itemsize == 4:
        cfg = PrefillConfig(64, 32, cfg.num_warps, 2)
    return cfg


def decode_config(head_dim: int, dtype: torch.dtype, device: torch.device, kv_fp8: bool = False,
                  num_programs: int = 0) -> DecodeConfig:
    """The decode kernel's tile for q of `dtype` over a 16-bit cache, or an e4m3 one (kv_fp8);
    num_programs: the launch's sequences x KV heads (0: not known, as for the paged tiles)."""
    if interpreting() or device.type != "cuda":
        return DecodeConfig(16, 4, 1)
    if "decode" in OVERRIDES:
        return DecodeConfig(*OVERRIDES["decode"])
    elem = dtype.itemsize
    if elem == 4:
        return DecodeConfig(32, 8, 2)
    if head_dim >= 256:
        return DecodeConfig(32, 4, 2)
    if head_dim == 128 and torch.cuda.get_device_capability(device)[0] == 9:
        if kv_fp8 and decode_fp8_f16() and decode_fp8_words() == 2:
            return _DECODE_FP8_SM90_D128
        if not kv_fp8 and num_programs >= _DECODE_BATCHED_MIN_PROGRAMS:
            return _DECODE_BATCHED_SM90_D128
    # two stages beat three at every measured batch (triton_config_notes.md)
    return DecodeConfig(64, 4, 2)


# FP8 pages, the planes loop, on sm_90 at D 128: the block ids a tile ahead give two K/V
# buffers per program, and the 128-register cap keeps 4 programs per SM (the split planner's
# target; at 3 the largest grid rows take two waves), so an SM holds twice the fp8 bytes in
# flight of the 16-bit tile (bench/results/nvidia-h200/triton_fp8_ab_e0cf24e/; the compiles:
# triton_fp8_inflight_offline/).
_DECODE_FP8_SM90_D128 = DecodeConfig(64, 4, 3, maxnreg=128, table_ahead=True)

# 16-bit pages on sm_90 at D 128, from 8 sequences of 8 KV heads up: 32-key tiles with the ids
# ahead keep two 16 KB buffers per program (4 programs per SM, as 64/4/2; the 102-register cap it
# was measured with changes no occupancy), so a program always has a tile on its way. Below,
# each split is too few 32-key tiles and the 64-key tile is faster
# (bench/results/nvidia-h200/triton_decode_tiles_8afc205/).
_DECODE_BATCHED_SM90_D128 = DecodeConfig(32, 4, 3, maxnreg=102, table_ahead=True)
_DECODE_BATCHED_MIN_PROGRAMS = 64


# Split-KV target: about this many programs per SM; the best measured split count
# always put B*Hkv*splits near 4 per SM (triton_config_notes.md).
_SPLIT_PROGRAMS_PER_SM = 4
MAX_SPLITS = 128


def decode_num_splits(batch: int, num_kv_heads: int, max_context_capacity: int,
                      block_n: int, device: torch.device) -> int:
    """How many KV splits (flash-decoding) per (sequence, KV head).

    Uses the block-table capacity (max_blocks * block_size), an upper bound of
    every context length, instead of context_lens.max(): that would need a
    device->host sync and would make decode impossible to capture in a CUDA
    graph. Splits are sized per sequence inside the kernel from its own
    context length, so an over-estimate only leaves some splits empty.
    """
    if "decode_splits" in OVERRIDES:
        n = OVERRIDES["decode_splits"]
        return max(1, min(int(n[0] if isinstance(n, tuple) else n), MAX_SPLITS))
    programs = max(batch * num_kv_heads, 1)
    want = round(_SPLIT_PROGRAMS_PER_SM * sm_count(device) / programs)
    # at least one KV tile per split
    tiles = -(-max_context_capacity // block_n)
    return max(1, min(want, tiles, MAX_SPLITS))


# Work-list decode (decode.py, WORKLIST): each program finds its (sequence, split) from
# context_lens, so that the splits follow the lengths instead of the table's width. Without
# it a batch of 64 takes one program per (sequence, KV head) whatever the lengths, and one 32k
# sequence among 1k ones runs its 32k keys in 8 programs while the rest of the GPU idles.
# It costs equal lengths a little (every program computes the plan's prefix sums; the reduce
# reads more slots) and saves an uneven batch several times that
# (bench/results/nvidia-h200/triton_worklist_a49fe9c/). The plan sees shapes only, so it is
# taken where the plain plan can leave one program alone with more than WORKLIST_MIN_SPAN keys
# (the table's width over the plain plan's splits), which is where an uneven batch costs the
# plain plan most.
WORKLIST_MIN_SPAN = 8192
# the plan's context_lens vector is one block of this many lanes in every program
MAX_WORKLIST_BATCH = 1024


def decode_split_plan(batch: int, num_kv_heads: int, max_context_capacity: int, block_n: int,
                      device: torch.device) -> tuple[bool, int]:
    """(work list?, split count) of a plain decode of `batch` sequences. The work list is taken
    when the "decode_worklist" override says so, else when the plain plan's split of the
    table's width (max_context_capacity / decode_num_splits) exceeds WORKLIST_MIN_SPAN keys;
    only for 2..MAX_WORKLIST_BATCH sequences (one has nothing to balance; the plan's lanes are
    bounded). The work list's split budget is decode_num_splits of one sequence: what the plain
    plan gives a batch of one, so equal lengths get about the plain plan's splits."""
    plain_splits = decode_num_splits(batch, num_kv_heads, max_context_capacity, block_n, device)
    if not 2 <= batch <= MAX_WORKLIST_BATCH:
        return False, plain_splits
    if "decode_worklist" in OVERRIDES:
        worklist = bool(OVERRIDES["decode_worklist"])
    else:
        worklist = max_context_capacity > WORKLIST_MIN_SPAN * plain_splits
    if not worklist:
        return False, plain_splits
    return True, decode_num_splits(1, num_kv_heads, max_context_capacity, block_n, device)


def decode_worklist(batch: int, num_kv_heads: int, max_context_capacity: int, block_n: int,
                    device: torch.device) -> bool:
    """Whether a plain decode of `batch` sequences takes the work list (decode_split_plan)."""
    return decode_split_plan(batch, num_kv_heads, max_context_capacity, block_n, device)[0]


# ----------------------------------------------------------------- paged (any q_len)


@dataclass(frozen=True)
class PagedConfig(_Launched):
    block_m: int   # rows of one tl.dot: packed (query position, head of the GQA group) pairs
    block_n: int   # keys per KV tile
    num_warps: int
    num_stages: int
    # a decode-like tile (a few rows, several programs resident per SM) rather than a
    # prefill-like one (about one per SM): decides how eagerly KV is split
    packed: bool = True
    maxnreg: int | None = None  # as PrefillConfig.maxnreg

    def block_q(self, group: int) -> int:
        """Query positions per program: every row holds one of them for one head."""
        return self.block_m // group


# Up to this many (position, head) rows a sequence's whole query run is one
# decode-like tile; beyond, prefill-like tiles of 128 rows.
_PACKED_MAX_ROWS = 64
_INTERPRET_PACKED_MAX_ROWS = 32


def _next_pow2(n: int) -> int:
    return 1 << max(int(n) - 1, 0).bit_length()


# Long chunks over 16-bit pages on sm_90, D 128, GQA groups up to 2: 64-row tiles of one warpgroup.
# Two programs share an SM (112 KB of shared memory each), and their warpgroups do not run in lock
# step as the two of a 128-row program do (its loop has two CTA barriers per key tile), so one's
# softmax overlaps the other's MMAs. On the H200 it took 0.98x / 0.976x the time of the 128-row
# tile on the chunked-prefill rows (bench/results/nvidia-h200/triton_paged_tiles_4ed51f6/).
# Larger groups and FP8 pages keep the 128-row tile, measured faster there: a 64-row tile holds only
# 16 / 8 query positions at G 4 / 8, and over FP8 pages it widens each K/V tile for half as many
# queries (bench/results/nvidia-h200/triton_paged_groups_a40847b/).
_PAGED_LONG_SM90_D128 = (64, 64, 4, 3)
# Packed tiles of this many rows (e.g. a speculative run of 4 tokens at GQA group 8) read 128 keys
# per step on sm_90 (D 128, 16-bit pages), not the decode kernel's 64: measured faster for that
# row (bench/results/nvidia-h200/triton_paged_groups_a40847b/).
_PACKED_WIDE_KEYS_ROWS = 32
# 16-row packed tiles (decodes and runs of up to 8 tokens at G 2) on sm_90 (D 128, 16-bit q):
# 32 keys in 3 stages, through v2: 133.1 / 492.5 us on the spec row / a B=64 L=8k decode step
# through paged, against 133.3 / 610.6 for the decode kernel's 64 keys in 2 stages and 136.9 /
# 496.5 for 128 keys; over FP8 pages 107.7 against 132.9 us on the spec row (fp16 dots)
# (bench/results/nvidia-h200/triton_packed_702270f/).
_PACKED_NARROW_SM90_D128 = (16, 32, 4, 3)
# FP8 pages' own 16-row tile: at 32 keys a stage holds 8 KB of fp8, so 4 programs per SM keep
# 64 KB in flight against 128 KB of 16-bit; 64 keys capped at 128 registers keep 4 programs and
# 128 KB (scripts/triton_paged_sm90.py --inflight). fp8 over the 16-bit time on the H200: 0.80 ->
# 0.70 on the spec row, 0.79 -> 0.66 on a B=64 L=8k decode step through paged, 0.84 -> 0.79 at
# B=8 L=4k (bench/results/nvidia-h200/triton_paged_fp8_packed_6cebbae/)
_PACKED_NARROW_FP8_SM90_D128 = (16, 64, 4, 3, True, 128)


def paged_config(head_dim: int, dtype: torch.dtype, causal: bool, max_seqlen_q: int, group: int,
                 device: torch.device, kv_fp8: bool = False) -> PagedConfig:
    """Tile of the paged kernel, from host values only (max_seqlen_q, not q_lens)."""
    rows = max(int(max_seqlen_q), 1) * group
    min_m = max(16, _next_pow2(group))  # tl.dot needs M >= 16; one position must fit all heads
    if interpreting() or device.type != "cuda":
        # small tiles, and the GPU's choice between a packed and a prefill-like tile
        # (at a lower row count) so the CPU tests run both kinds of launch
        if rows <= _INTERPRET_PACKED_MAX_ROWS:
            return PagedConfig(max(min_m, _next_pow2(rows)), 16, 4, 1)
        return PagedConfig(max(min_m, 32), 16, 4, 1, False)
    if "paged" in OVERRIDES:
        bm, bn, w, s, *cap = OVERRIDES["paged"]
        return PagedConfig(max(bm, min_m), bn, w, s, rows <= _PACKED_MAX_ROWS, *cap)
    # the measured sm_90 tiles: D 128 with a 16-bit q (sm90_d128: over 16-bit pages too)
    sm90_d128_q16 = head_dim == 128 and dtype.itemsize == 2 and torch.cuda.get_device_capability(device)[0] == 9
    sm90_d128 = sm90_d128_q16 and not kv_fp8
    if rows <= _PACKED_MAX_ROWS:
        dec = decode_config(head_dim, dtype, device)
        block_m = max(min_m, _next_pow2(rows))
        if sm90_d128_q16 and block_m == _PACKED_NARROW_SM90_D128[0]:
            return PagedConfig(*(_PACKED_NARROW_FP8_SM90_D128 if kv_fp8 else _PACKED_NARROW_SM90_D128))
        block_n = 128 if sm90_d128 and block_m == _PACKED_WIDE_KEYS_ROWS else dec.block_n
        return PagedConfig(block_m, block_n, dec.num_warps, dec.num_stages)
    if sm90_d128 and group <= 2:
        return PagedConfig(*_PAGED_LONG_SM90_D128, False)
    pre = prefill_config(head_dim, dtype, causal, 1 << 30, 1 << 30, device)  # the long-prompt entry
    return PagedConfig(max(pre.block_m, min_m), pre.block_n, pre.num_warps, pre.num_stages, False)


def paged_num_splits(num_seqs: int, total_q: int, max_seqlen_q: int, num_kv_heads: int,
                     kv_capacity: int, cfg: PagedConfig, group: int, device: torch.device) -> int:
    """KV splits per (sequence, query tile, KV head), from shapes only (no device sync).

    The number of query tiles that do work is not known on the host (it needs the
    q_lens); it is at most one per sequence more than total_q / BLOCK_Q and at
    most num_seqs * ceil(max_seqlen_q / BLOCK_Q). Decode-like tiles aim at the
    decode kernel's programs per SM; prefill-like tiles (one resident per SM)
    split only when the work does not make a single wave.
    """
    block_q = cfg.block_q(group)
    tiles = min(num_seqs * -(-max_seqlen_q // block_q), -(-total_q // block_q) + num_seqs)
    programs = max(tiles * num_kv_heads, 1)
    per_sm = _SPLIT_PROGRAMS_PER_SM if cfg.packed else 1
    want = round(per_sm * sm_count(device) / programs)
    key_tiles = -(-kv_capacity // cfg.block_n)
    return max(1, min(want, key_tiles, MAX_SPLITS))


# ----------------------------------------------------------------- paged: long chunks and mixed batches

# How a paged call whose max_seqlen_q * group exceeds _PACKED_MAX_ROWS (a long chunk
# somewhere in the batch) is launched (ops.paged):
#   long kernel "v1": paged._paged_kernel with the prefill-like tile (a grid of
#     num_seqs * ceil(max_seqlen_q / BLOCK_Q) programs per KV head); "v2":
#     paged._paged_long_kernel (page offsets built once per program, a compile-time page
#     stride, block ids read a tile ahead, a compact tile space for ragged batches).
#   mixed "one": that kernel runs every sequence, so a decode in a batch that also
#     holds a long chunk gets a whole 128-row tile; "split": sequences of at most
#     block_q(group) tokens of the short tile (paged_short_config) run in a second,
#     GQA-packed launch, and the long launch skips them (both decide on the device, from
#     cu_seqlens_q; the host skips the short launch when the shapes rule short
#     sequences out: total_q > short_q + (num_seqs - 1) * max_seqlen_q).
#     "decode": the q_len == 1 sequences run through the decode kernel (decode.py,
#     PACKED_Q: its programs of other sequences return at once; its own split count from
#     decode_num_splits and its own reduce), the long launch skips them (MIN_Q = 1);
#     sequences of 2..short tokens stay in the long launch. Same device-side rule and
#     host skip as "split" (with 1 for short_q). Written for the mixed batch, where the
#     decodes inside the paged launches cost more than the same decodes through decode.
# v2 is the default: on the H200 (scripts/triton_paged_ab.py, oracle check first, then
# timing; bench/results/nvidia-h200/triton_paged_ab_b170871/) it is 12-16% faster than v1 on
# the chunked-prefill rows and on the mixed batch; with v2, "one" and "split" time within 1%
# of each other on the mixed batch, and "decode" is 12% faster than both (1.03x the chunk
# alone + the decodes alone, against 1.17x; triton_paged_ab_788832e/), so it is the default.
PAGED_LONG_KERNELS = ("v1", "v2")
PAGED_LONG_KERNEL = "v2"
PAGED_MIXED_MODES = ("one", "split", "decode")
PAGED_MIXED = "decode"
# v2 reads the next tile's block ids one iteration ahead (see paged._long_inner);
# without it the sm_90 pipeliner keeps K/V only one tile ahead
PAGED_PREFETCH = True
# v2's program order: KV heads vary fastest (paged._paged_long_kernel), so the GPU starts the
# tiles of every head in order of decreasing work, as the dense prefill's grid does. With heads
# on a grid axis of their own it starts every tile of head 0, longest to shortest, before any
# of head 1, and a single long chunk (two waves of programs) leaves long tiles of the last
# heads for the second wave (scripts/wave_model.py). On the H200: 385.4 against 413.7 us on the
# mixed row, 1185.3 against 1210.7 us on the 2k-over-32k chunk
# (bench/results/nvidia-h200/triton_paged_ab_a1d04f7/).
PAGED_HEADS_FASTEST = True
# packed (position, head) rows of the short launch of a mixed batch: 16 covers a decode
# at any group <= 16 and a speculative run of 16 // group tokens
_PAGED_SHORT_ROWS = 16
_PAGED_OVERRIDES = ("paged_long_kernel", "paged_mixed", "paged_short", "paged_prefetch", "paged_heads_fastest",
                    "paged_fp8_f16", "paged_packed_kernel")
# v2 finds a program's sequence in two vector loads of SEARCH slot starts: S <= SEARCH^2
PAGED_SEARCH = 128


def paged_long_kernel() -> str:
    return OVERRIDES.get("paged_long_kernel", PAGED_LONG_KERNEL)


# Packed tiles (decode-like and speculative calls: every query run in one tile) through "v1"
# (paged._paged_kernel, the page offset of every key recomputed per tile in 64-bit arithmetic)
# or "v2" (paged._paged_long_kernel: offsets built once, block ids a tile ahead, FP8_F16 dots over
# FP8 pages). v2 needs the contiguous cache layout (ops._v2_usable); v1 serves the rest. On the
# H200 (bf16 16/8/128, page 16, graph replays, cold L2) v2 took 133.3 against 169.5 us on the
# speculative row (B=32 q=4 L=4k; decode 134.9 us) and 610.6 against 628.7 us on a decode step of
# B=64 L=8k through paged at the same tile; over FP8 pages 133.1 against 174.1 us on the spec row
# (bench/results/nvidia-h200/triton_packed_702270f/).
PAGED_PACKED_KERNEL = "v2"


def paged_packed_kernel() -> str:
    return OVERRIDES.get("paged_packed_kernel", PAGED_PACKED_KERNEL)


def paged_mixed_mode() -> str:
    return OVERRIDES.get("paged_mixed", PAGED_MIXED)


def paged_prefetch() -> bool:
    return OVERRIDES.get("paged_prefetch", PAGED_PREFETCH)


def paged_heads_fastest() -> bool:
    return OVERRIDES.get("paged_heads_fastest", PAGED_HEADS_FASTEST)


# v2 over FP8 pages under a bf16 q: dots in fp16 (paged._paged_long_kernel FP8_F16), as decode
# does (DECODE_FP8_F16): no fp16 -> bf16 conversion of the widened tiles, which runs at a quarter
# of the FMA rate. Faster on the H200 (bench/results/nvidia-h200/ws8_ab_6230e97/).
PAGED_FP8_F16 = True


def paged_fp8_f16(q_dtype: torch.dtype) -> bool:
    """Whether v2 runs its dots in fp16 over an FP8 cache for this q dtype. The override forces
    it for fp16 q too (a no-op in value there), which lets the interpreter test the path."""
    if "paged_fp8_f16" in OVERRIDES:
        return OVERRIDES["paged_fp8_f16"]
    return PAGED_FP8_F16 and q_dtype == torch.bfloat16


# FP8 caches in the decode kernel: True runs the dots in fp16: q scaled by a power of two into
# fp16's range once per program (exact; the softmax scale takes the power back), K/V widened to
# fp16 only. False widens the e4m3 tiles to q's dtype (for bf16 q: e4m3 -> fp16 two bytes per
# instruction, then fp16 -> bf16 one element per instruction), which leaves the fp8 rows as slow
# as the 16-bit ones; the fp16 dots take 0.82-0.93x the 16-bit time
# (bench/results/nvidia-h200/selftests_fe05090/, triton_fp8_decode_ab).
DECODE_FP8_F16 = True


def decode_fp8_f16() -> bool:
    return OVERRIDES.get("decode_fp8_f16", DECODE_FP8_F16)


# With the fp16 dots: read the full fp8 tiles as int32 words and widen them in registers
# (decode.py, FP8_WORDS): 1 interleaves the widened halves back into one tile, 2 ("planes")
# keeps them as four column planes and runs four dots of D / 4. Per 64-token tile of the sm_90
# loop (compiled ahead of time): 640 instructions without words under triton 3.6, 554 with 1,
# 478 with 2 (bf16: 423); triton 3.9: 642 and 431 for 1. On the H200 the planes take 0.66-0.96x
# the 16-bit time against 0.75-0.97x for the fp16 dots alone and 0.81-1.00x for 1, faster on
# every row (bench/results/nvidia-h200/triton_fp8_ab_40e115d/).
DECODE_FP8_WORDS = 2


def decode_fp8_words() -> int:
    return int(OVERRIDES.get("decode_fp8_words", DECODE_FP8_WORDS))


def decode_table_ahead(cfg) -> bool:
    """Whether the decode launch of tile `cfg` reads its block ids a tile ahead (a DecodeConfig's
    table_ahead; never for the paged tiles that launch the decode kernel) unless overridden."""
    return OVERRIDES.get("decode_table_ahead", getattr(cfg, "table_ahead", False))


@functools.lru_cache(maxsize=None)
def _has_e4m3_cvt(device_index: int) -> bool:
    return torch.cuda.get_device_capability(device_index) >= (8, 9)


def e4m3_cvt(device: torch.device) -> bool:
    """Whether kernels on `device` may widen e4m3 with cvt.rn.f16x2.e4m3x2 (sm_89+; never under
    the interpreter, which runs no PTX)."""
    if interpreting() or device.type != "cuda":
        return False
    return _has_e4m3_cvt(device.index if device.index is not None else torch.cuda.current_device())


def paged_short_config(head_dim: int, dtype: torch.dtype, group: int, device: torch.device) -> PagedConfig:
    """The packed tile of a mixed batch's short launch; it serves sequences of at most
    block_q(group) tokens."""
    min_m = max(16, _next_pow2(group))
    if "paged_short" in OVERRIDES:
        rows, bn, w, s = OVERRIDES["paged_short"]
    elif interpreting() or device.type != "cuda":
        rows, bn, w, s = _PAGED_SHORT_ROWS, 16, 4, 1
    else:
        dec = decode_config(head_dim, dtype, device)
        rows, bn, w, s = _PAGED_SHORT_ROWS, dec.block_n, dec.num_warps, dec.num_stages
    return PagedConfig(max(min_m, _next_pow2(rows)), bn, w, s, True)


# ----------------------------------------------------------------- batch-invariant tiles
#
# One tile per (device kind, dtype) for every call, whatever the batch: a row's arithmetic
# must not depend on M, the query length or the number of sequences (invariant.py). One
# tile serves an 8k-token prefill and a 1-token decode: a decode step is bound by reading
# the weights, whatever rows its tile computes, so the tile is the prefill's (128 x 128,
# two consumer warpgroups; 96 KB of shared memory in 3 stages fits every sm_80+ part).
# None of these follow OVERRIDES: a tuning script must not change them mid-run.


@dataclass(frozen=True)
class LinearConfig:
    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


def invariant_linear_config(dtype: torch.dtype, device: torch.device) -> LinearConfig:
    if interpreting() or device.type != "cuda":
        # the interpreter pays per program and per loop step: few, wide tiles keep CI's engine tests short
        return LinearConfig(16, 128, 64, 4, 1)
    if dtype == torch.float32:
        return LinearConfig(64, 64, 32, 4, 3)
    return LinearConfig(128, 128, 64, 8, 3)


def invariant_norm_rows(block_d: int, device: torch.device) -> int:
    """Rows per program of the invariant RMSNorm (a [rows, block_d] fp32 tile in registers)."""
    if interpreting() or device.type != "cuda":
        return 16
    return max(1, 4096 // block_d)


# Keys per segment of the batch-invariant paged path, in key tiles: segments are cut at
# fixed key positions (multiples of this times BLOCK_N) whatever the batch, so a decode
# batch may run them in parallel (split) and a prefill in one program with the same bits.
# The interpreter's tile is 16 keys: 2 tiles make segments of 32, so CPU tests cross them.
def invariant_segment_tiles(device: torch.device) -> int:
    return 2 if interpreting() or device.type != "cuda" else 16


# A split launch stores fp32 partials for every (row, segment); above this many bytes of them
# the launch does not split (a long prefill fills the GPU anyway).
_INVARIANT_PARTIAL_BYTES = 64 << 20


def invariant_paged_splits(num_seqs: int, total_q: int, max_seqlen_q: int, num_q_heads: int, num_kv_heads: int,
                           head_dim: int, kv_capacity: int, cfg: PagedConfig, device: torch.device) -> int:
    """Segments of the batch-invariant paged launch to run as separate programs: every
    segment the widest table can hold when the query tiles alone leave the GPU short of
    programs (and the partials fit _INVARIANT_PARTIAL_BYTES), else 1. Host values only.
    Any answer gives the same bits (paged._invariant_tile)."""
    block_q = cfg.block_q(num_q_heads // num_kv_heads)
    tiles = min(num_seqs * -(-max(max_seqlen_q, 1) // block_q), -(-total_q // block_q) + num_seqs)
    segments = max(1, -(-kv_capacity // (invariant_segment_tiles(device) * cfg.block_n)))
    if segments == 1 or tiles * num_kv_heads >= 2 * sm_count(device):
        return 1
    if total_q * num_q_heads * segments * (head_dim + 1) * 4 > _INVARIANT_PARTIAL_BYTES:
        return 1
    return segments


def invariant_paged_config(head_dim: int, group: int, device: torch.device) -> PagedConfig:
    """The paged-attention tile of every batch-invariant call (decode, chunk or whole
    prompt): BLOCK_M packed (position, head) rows; splits only at the fixed segments of
    invariant_paged_splits. packed=True: one launch of paged._paged_kernel for the whole batch
    (ops._paged_launches)."""
    min_m = max(16, _next_pow2(group))
    if interpreting() or device.type != "cuda":
        return PagedConfig(min_m, 16, 4, 1)
    # 8 warps: the unsplit launch holds two [BLOCK_M, D] fp32 states (segment and running
    # result); with 4 warps triton 3.6 spills them at D 128 (sm_90, scripts/triton_invariant_sm90.py)
    return PagedConfig(max(64, min_m), 32 if head_dim > 128 else 64, 8, 2)
