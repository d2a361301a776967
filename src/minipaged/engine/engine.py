"""Engine: load Qwen3 weights, own a PagedKVCache, generate with continuous batching."""

from __future__ import annotations

import numbers
import os
import time
from dataclasses import dataclass, field
from typing import Any, Sequence as Seq

import numpy as np
import torch

from ..api import MAX_BLOCK_SIZE, integer_number, is_block_size, real_number
from ..paged_cache import check_device
from .config import Qwen3Config, qwen3_0_6b_config
from .loader import KV_SCALE_NAMES, check_state_dict, load_checkpoint, random_state_dict
from .model import AttentionMetadata, Qwen3Model
from .runner import ModelRunner
from .sampler import SAMPLING_FIELDS, SamplingParams, apply_penalties, make_sampling_params, sample_checked
from .scheduler import Scheduler
from .sequence import Sequence

_DTYPES = {
    "float32": torch.float32, "fp32": torch.float32,
    "float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
}


def resolve_device(device: Any) -> torch.device:
    """The engine's device: cuda (with its index) when available and none is given, else cpu.
    An unknown device, or cuda without a usable GPU, is a ValueError."""
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    dev = check_device(device)
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    return dev


# Engine(max_num_batched_tokens=...) when not given (or None), and the CLI's default
DEFAULT_MAX_NUM_BATCHED_TOKENS = 8192


def default_max_model_len(cfg: Qwen3Config) -> int:
    """The engine's max_model_len when none is given: the model's positions, at most 4096."""
    return min(cfg.max_position_embeddings, 4096)


def _positive_int(name: str, val: Any) -> int:
    # numpy integers are ints here as everywhere else in the engine (np.int64(8) was refused as
    # "must be a positive int, got np.int64(8)")
    if not integer_number(val) or val < 1:
        raise ValueError(f"{name} must be a positive int, got {val!r}")
    return int(val)


def _check_block_size(block_size: Any) -> int:
    if not integer_number(block_size) or not is_block_size(int(block_size)):
        raise ValueError(f"block_size must be a power of two in [1, {MAX_BLOCK_SIZE}], got {block_size!r}")
    return int(block_size)


# torch.Generator.manual_seed takes any 64-bit pattern: [-2**63, 2**64); past it torch raised
# "Overflow when unpacking long long", which named no argument
_SEED_MIN, _SEED_MAX = -(2**63), 2**64 - 1


def _iterable_ids(where: str, ids: Any) -> Any:
    """`ids` when it can be read as a sequence of token ids, else a TypeError naming `where` (an int,
    None or a 0-d tensor raised Python's bare "'int' object is not iterable" / "iteration over a 0-d
    tensor"; a str would be read character by character)."""
    if isinstance(ids, (str, bytes, numbers.Number)) or not hasattr(ids, "__iter__") \
            or (isinstance(ids, (torch.Tensor, np.ndarray)) and ids.ndim != 1):
        raise TypeError(f"{where} must be a list of token ids, got {type(ids).__name__}"
                        f"{' of ' + str(ids.ndim) + ' dims' if isinstance(ids, (torch.Tensor, np.ndarray)) else ''}")
    return ids


def _token_id(where: str, t: Any, vocab: int) -> int:
    # ints and numpy integers; floats (1.7) and bools are not token ids
    if isinstance(t, torch.Tensor) and t.dim() == 0 and not t.dtype.is_floating_point and t.dtype != torch.bool:
        t = int(t)
    if not integer_number(t):
        raise TypeError(f"{where} holds {t!r} ({type(t).__name__}); token ids must be ints")
    t = int(t)
    if not 0 <= t < vocab:
        raise ValueError(f"{where} holds token id {t} outside the vocabulary [0, {vocab})")
    return t


def _token_ids(where: str, ids: Any, vocab: int) -> list[int]:
    """A fresh list of the token ids in `ids`. The common case, a list of Python ints, is
    checked at C speed (a long prompt costs microseconds, not a Python call per token);
    anything else goes through _token_id one element at a time, which also names a bad one."""
    _iterable_ids(where, ids)
    if type(ids) is list and ids and set(map(type, ids)) == {int} and min(ids) >= 0 and max(ids) < vocab:
        return list(ids)
    return [_token_id(where, t, vocab) for t in ids]


def _stop_token_ids(stop_token_ids: Any, vocab: int) -> list[int]:
    if stop_token_ids is None:
        return []
    try:
        _iterable_ids("stop_token_ids", stop_token_ids)
    except TypeError:
        raise TypeError(f"stop_token_ids must be a list of token ids or None, got {stop_token_ids!r}") from None
    return [_token_id("stop_token_ids", t, vocab) for t in stop_token_ids]


def _checkpoint_kv_scales(state: dict, cfg: Qwen3Config) -> tuple:
    """(k_scale, v_scale) as float32 [num_layers, Hkv] from a checkpoint's per-layer scale tensors
    (the names FP8 checkpoints use: self_attn.k_scale / v_scale, scalar or per KV head), or
    (None, None) when it has none. A checkpoint with scales for only some layers is an error."""
    out = []
    for kind in ("k", "v"):
        rows = []
        for i in range(cfg.num_hidden_layers):
            t = next((state[f"model.layers.{i}.{n.format(kind)}"] for n in KV_SCALE_NAMES
                      if f"model.layers.{i}.{n.format(kind)}" in state), None)
            rows.append(t)
        if all(t is None for t in rows):
            out.append(None)
            continue
        if any(t is None for t in rows):
            raise ValueError(f"the checkpoint has {kind}_scale tensors for some layers only")
        Hkv = cfg.num_key_value_heads
        try:
            out.append(torch.stack([t.detach().float().reshape(-1).expand(Hkv) if t.numel() == 1
                                    else t.detach().float().reshape(Hkv) for t in rows]))
        except RuntimeError:
            raise ValueError(f"{kind}_scale tensors must hold 1 or {Hkv} (per KV head) values per layer") from None
    if (out[0] is None) != (out[1] is None):
        raise ValueError("the checkpoint has k_scale but not v_scale tensors (or the reverse)")
    return out[0], out[1]


def resolve_dtype(dtype: Any, device: torch.device) -> torch.dtype:
    if dtype is None or dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if isinstance(dtype, torch.dtype):
        return dtype
    try:
        return _DTYPES[str(dtype).replace("torch.", "")]
    except KeyError:
        raise ValueError(f"dtype must be one of auto, {sorted(set(_DTYPES))}, got {dtype!r}") from None


def _eos_from_generation_config(folder: str, eos: list[int]) -> list[int]:
    """config.json's EOS ids plus generation_config.json's (Qwen3 lists <|im_end|> and <|endoftext|> there)."""
    import json

    path = os.path.join(folder, "generation_config.json")
    try:
        with open(path) as f:
            extra = json.load(f)
    except (OSError, ValueError):
        return eos
    # a file that is not an object, or an eos_token_id that is not a token id (a dict, null, "x"),
    # raised AttributeError / TypeError / int()'s bare ValueError: a traceback in `minipaged generate`
    extra = extra.get("eos_token_id") if isinstance(extra, dict) else None
    if extra is None:
        return eos
    ids = extra if isinstance(extra, list) else [extra]
    if not all(integer_number(e) for e in ids):
        raise ValueError(f"{path}: eos_token_id must be a token id or a list of them, got {extra!r}")
    return list(dict.fromkeys([*eos, *(int(e) for e in ids)]))


def percentile(xs: Seq[float], q: float) -> float:
    """Linear-interpolated percentile (q in 0..100, numpy's default, as the benchmarks use); 0.0 for
    no samples, so a stats line never fails on a run that produced none."""
    return float(np.percentile(np.asarray(xs, dtype=np.float64), q)) if len(xs) else 0.0


@dataclass
class RequestOutput:
    """What one step() gave one online request: its new token, all its tokens so far (a copy),
    once finished why ("stop", "length" or "max_model_len"), and the new token's natural-log
    probability under the model's own distribution (before penalties, temperature and cuts)."""

    request_id: int
    token_id: int
    output_ids: list[int]
    finished: bool
    finish_reason: str | None = None
    logprob: float | None = None


@dataclass
class GenerateStats:
    """What the last generate() call, or the online requests since the queue was last empty, did
    and how long it took (wall clock, synchronised per step).

    A *prefill step* runs at least one prompt chunk (decodes may ride along in it);
    a *decode step* runs decodes only. Times per request are measured from its
    submission: the start of generate(), or its add_request(). Online requests enter the
    per-request lists (ttft_seconds, token_seconds) as they finish.
    """

    prefill_tokens: int = 0          # prompt tokens computed (chunks), recomputation after preemption included
    prefix_hit_tokens: int = 0       # prompt tokens whose K/V came from the prefix cache instead
    prefill_seconds: float = 0.0
    decode_tokens: int = 0
    decode_seconds: float = 0.0
    decode_steps: int = 0
    prefill_steps: int = 0
    mixed_steps: int = 0             # prefill steps that also ran decodes
    preemptions: int = 0
    cuda_graph: bool = False
    step_batch_sizes: list[int] = field(default_factory=list)
    decode_batch_sizes: list[int] = field(default_factory=list)
    step_tokens: list[int] = field(default_factory=list)
    ttft_seconds: list[float] = field(default_factory=list)   # per request that got a token, in prompt order
    itl_seconds: list[float] = field(default_factory=list)    # gaps between consecutive tokens, all requests
    token_seconds: list[list[float]] = field(default_factory=list)  # per request: when each token came
    total_seconds: float = 0.0

    @property
    def steps(self) -> int:
        return self.prefill_steps + self.decode_steps

    @property
    def computed_prompt_tokens(self) -> int:
        return self.prefill_tokens

    @property
    def prefill_tokens_per_s(self) -> float:
        return self.prefill_tokens / self.prefill_seconds if self.prefill_seconds else 0.0

    @property
    def decode_tokens_per_s(self) -> float:
        return self.decode_tokens / self.decode_seconds if self.decode_seconds else 0.0

    def itl_percentile(self, q: float) -> float:
        """Inter-token latency percentile (q in 0..100), seconds."""
        return percentile(self.itl_seconds, q)

    def ttft_percentile(self, q: float) -> float:
        return percentile(self.ttft_seconds, q)

    def summary(self) -> dict:
        return dict(
            steps=self.steps, prefill_steps=self.prefill_steps, decode_steps=self.decode_steps,
            mixed_steps=self.mixed_steps, computed_prompt_tokens=self.prefill_tokens,
            prefix_hit_tokens=self.prefix_hit_tokens, generated_tokens=len(self.itl_seconds) + len(self.ttft_seconds),
            preemptions=self.preemptions, cuda_graph=self.cuda_graph, total_s=self.total_seconds,
            ttft_p50_s=self.ttft_percentile(50), ttft_p99_s=self.ttft_percentile(99),
            itl_p50_s=self.itl_percentile(50), itl_p90_s=self.itl_percentile(90), itl_p99_s=self.itl_percentile(99),
        )


def _record_latencies(st: GenerateStats, times: list[float], submitted: float) -> None:
    """One request's token times (perf_counter) into the stats, measured from its submission."""
    st.token_seconds.append([t - submitted for t in times])
    if times:
        st.ttft_seconds.append(times[0] - submitted)
        st.itl_seconds.extend(b - a for a, b in zip(times, times[1:]))


class Engine:
    """Lean Qwen3 generation over paged K/V.

    Args:
        model: a local transformers Qwen3 checkpoint folder (config.json +
            *.safetensors); None for the Qwen3-0.6B shape with seeded random
            weights; or a config (Qwen3Config, dict, transformers config) for
            random weights of that shape.
        dtype: torch dtype or name; default bf16 on CUDA, fp32 on CPU.
        device: default "cuda" when available, else "cpu".
        backend: minipaged backend name for every attention op (None: env / auto).
        block_size, num_blocks: the paged cache (num_blocks None: 40% of free GPU
            memory on CUDA, room for max_num_seqs * min(max_model_len, 2048) tokens on CPU).
        max_num_seqs: most sequences running at once.
        max_model_len: longest prompt + output (default min(max_position_embeddings, 4096)).
        max_num_batched_tokens: token budget of one step: every running decode, then
            prompt chunks (a longer prompt is prefilled over several steps). Default 8192 (None: the default).
        enable_prefix_caching: share the cached full blocks of a new prompt's longest
            cached prefix instead of recomputing them (default True).
        kv_cache_dtype: None (the model dtype) or "fp8": float8_e4m3fn pages, half the
            bytes of bf16, with per-layer, per-KV-head scales: the checkpoint's
            `self_attn.k_scale` / `self_attn.v_scale` tensors when it has them, else
            computed from the K/V amax of the first prompt step, with a margin of 8x
            for later tokens (the amax maps to 448 / 8), and fixed thereafter
            (`warmup()` does not fix them). Needs a float16/bfloat16 model; every
            backend has FP8 kernels.
        cuda_graph: capture the decode step in CUDA graphs (default: on for CUDA
            with a non-torch backend; falls back to eager if capture fails).
        batch_invariant: run every matmul, RMSNorm and attention through kernels whose
            output rows do not depend on the rest of the batch (minipaged.triton.invariant:
            one pinned tile per op, no split-K, keys split only at fixed positions, every
            step through one paged_attention launch). A request's tokens are then
            bit-for-bit the same whatever it is batched with, however its prompt is chunked
            and whether its prefix came from the prefix cache. Needs the triton backend (on
            CPU under TRITON_INTERPRET=1) and, with kv_cache_dtype="fp8", the checkpoint's
            K/V scales (calibrated scales would depend on the first prompt step). Slower
            than the default kernels (scripts/invariant_bench.py and
            bench/bench_serving.py --backends triton-invariant measure it).
        seed: seed of the random weights when model is None or a config.
    """

    def __init__(
        self,
        model: Any = None,
        *,
        dtype: Any = None,
        device: Any = None,
        backend: str | None = None,
        block_size: int = 16,
        num_blocks: int | None = None,
        max_num_seqs: int = 64,
        max_model_len: int | None = None,
        max_num_batched_tokens: int | None = DEFAULT_MAX_NUM_BATCHED_TOKENS,
        enable_prefix_caching: bool = True,
        kv_cache_dtype: str | None = None,
        cuda_graph: bool | None = None,
        batch_invariant: bool = False,
        gpu_memory_fraction: float = 0.4,
        seed: int = 0,
        state_dict: dict[str, torch.Tensor] | None = None,
    ) -> None:
        import minipaged as mp
        from minipaged import registry

        # Every argument is checked before anything is built or allocated.
        self.device = resolve_device(device)
        self.dtype = resolve_dtype(dtype, self.device)
        if backend is not None and not isinstance(backend, str):
            raise TypeError(f"backend must be a str or None, got {type(backend).__name__}")
        block_size = _check_block_size(block_size)
        max_num_seqs = _positive_int("max_num_seqs", max_num_seqs)
        if max_num_batched_tokens is None:
            max_num_batched_tokens = DEFAULT_MAX_NUM_BATCHED_TOKENS
        if not integer_number(seed):
            raise TypeError(f"seed must be an int, got {type(seed).__name__}")
        if not _SEED_MIN <= seed <= _SEED_MAX:
            raise ValueError(f"seed must be in [-2**63, 2**64) (a 64-bit generator seed), got {seed}")
        seed = int(seed)  # (torch's manual_seed refuses numpy integers)
        if num_blocks is not None:
            num_blocks = _positive_int("num_blocks", num_blocks)
        if max_model_len is not None:
            max_model_len = _positive_int("max_model_len", max_model_len)
        max_num_batched_tokens = _positive_int("max_num_batched_tokens", max_num_batched_tokens)
        if kv_cache_dtype not in (None, "fp8"):
            raise ValueError(f"kv_cache_dtype must be None (the model dtype) or 'fp8', got {kv_cache_dtype!r}")
        fp8 = kv_cache_dtype == "fp8"
        self.kv_cache_dtype = torch.float8_e4m3fn if fp8 else self.dtype
        if fp8 and self.dtype not in (torch.float16, torch.bfloat16):
            raise ValueError(f"kv_cache_dtype='fp8' needs a float16 or bfloat16 model, got dtype {self.dtype} "
                             "(on CPU pass dtype=torch.bfloat16)")
        if not isinstance(enable_prefix_caching, bool):
            raise TypeError(f"enable_prefix_caching must be a bool, got {type(enable_prefix_caching).__name__}")
        if cuda_graph is not None and not isinstance(cuda_graph, bool):
            raise TypeError(f"cuda_graph must be a bool or None, got {type(cuda_graph).__name__}")
        if not isinstance(batch_invariant, bool):
            raise TypeError(f"batch_invariant must be a bool, got {type(batch_invariant).__name__}")
        if batch_invariant:
            if backend not in (None, "auto", "triton"):
                raise ValueError(f"batch_invariant=True runs on the triton backend's pinned-tile kernels; "
                                 f"got backend={backend!r} (pass backend='triton' or leave it unset)")
            backend = "triton"
        self.backend = backend
        self.batch_invariant = batch_invariant
        if state_dict is not None and not isinstance(state_dict, dict):
            raise TypeError(f"state_dict must be a dict of tensors keyed by transformers' names, or None, "
                            f"got {type(state_dict).__name__}")
        # (numpy floats too, as for the sampling numbers: np.float32(0.5) was "must be in (0, 1]")
        if not real_number(gpu_memory_fraction) or not 0.0 < gpu_memory_fraction <= 1.0:
            raise ValueError(f"gpu_memory_fraction must be in (0, 1], got {gpu_memory_fraction!r}")
        # Resolved once: an unusable backend fails here, not mid-generate, and the
        # forward calls the bound functions with no per-call lookup.
        self.ops = registry.bind(backend, self.device.type, fp8_kv=fp8)
        dname = str(self.dtype).replace("torch.", "")
        for op, name in self.ops.backends.items():
            dtypes, why = registry.all_backends()[name].supported_dtypes(self.device.type)
            if dname not in dtypes:
                raise TypeError(f"backend {name!r} ({op}) supports dtypes {list(dtypes)} on {self.device.type}, "
                                f"got {dname}{': ' + why if why else ''}")

        self.model_path: str | None = None
        if isinstance(model, (str, os.PathLike)):
            self.model_path = os.fspath(model)
            if os.path.exists(self.model_path) and not os.path.isdir(self.model_path):
                # (a config.json or .safetensors path was reported as a folder that "does not exist")
                raise NotADirectoryError(f"model {self.model_path!r} is a file; pass the checkpoint folder "
                                         "(config.json + *.safetensors)")
            if not os.path.isdir(self.model_path):
                raise FileNotFoundError(f"model folder {self.model_path!r} does not exist")
            cfg = Qwen3Config.from_any(self.model_path)
            cfg.eos_token_ids = _eos_from_generation_config(self.model_path, cfg.eos_token_ids)
        else:
            cfg = qwen3_0_6b_config() if model is None else Qwen3Config.from_any(model)
        # what the config alone decides is checked before the weights are read or drawn
        if max_model_len is not None and max_model_len > cfg.max_position_embeddings:
            raise ValueError(f"max_model_len={max_model_len} exceeds the model's max_position_embeddings="
                             f"{cfg.max_position_embeddings}")
        if cfg.head_dim not in registry.all_backends()[self.ops.backends["paged"]].head_dims:
            raise ValueError(f"head_dim {cfg.head_dim} of this model is not supported by backend "
                             f"{self.ops.backends['paged']!r}")
        if batch_invariant and fp8 and self.model_path is None and state_dict is None:
            # random weights never carry K/V scales: refused before they are drawn, not after (the
            # check below, once a checkpoint's tensors are read)
            raise ValueError("batch_invariant=True with kv_cache_dtype='fp8' needs k_scale/v_scale tensors in the "
                             "checkpoint, and random weights have none")
        if state_dict is None:
            state_dict = load_checkpoint(self.model_path, cfg) if self.model_path is not None \
                else random_state_dict(cfg, seed=seed, dtype=self.dtype, device=self.device)
        state = check_state_dict(state_dict, cfg)
        self.config = cfg

        self.max_model_len = int(max_model_len or default_max_model_len(cfg))
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.enable_prefix_caching = enable_prefix_caching
        ckpt_scales = _checkpoint_kv_scales(state, cfg) if fp8 else (None, None)
        if batch_invariant and fp8 and ckpt_scales[0] is None:
            raise ValueError("batch_invariant=True with kv_cache_dtype='fp8' needs k_scale/v_scale tensors in the "
                             "checkpoint: scales calibrated on the first prompt step depend on what that step holds")
        self.model = Qwen3Model(cfg, state, dtype=self.dtype, device=self.device, ops=self.ops,
                                max_positions=self.max_model_len, batch_invariant=batch_invariant)
        del state, state_dict

        if num_blocks is None:
            num_blocks = self._default_num_blocks(block_size, gpu_memory_fraction)
        scales = ckpt_scales
        # without checkpoint scales, the first prompt step sets them (see kv_cache_dtype above)
        self._calibrate_kv = fp8 and scales[0] is None
        self.cache = mp.PagedKVCache(cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim,
                                     num_blocks=int(num_blocks), block_size=block_size,
                                     dtype=self.kv_cache_dtype, device=self.device,
                                     k_scale=scales[0], v_scale=scales[1])
        if cuda_graph is None:
            cuda_graph = self.device.type == "cuda" and self.ops.backends["decode"] != "torch"
        self.runner = ModelRunner(self.model, self.cache, max_num_seqs=max_num_seqs,
                                  max_model_len=self.max_model_len, use_cuda_graph=cuda_graph)
        self.stats = GenerateStats()
        self._online: Scheduler | None = None  # add_request() / step(): created on first use
        self._online_seqs: dict[int, Sequence] = {}  # unfinished online requests by id
        self._online_arrival: dict[int, float] = {}  # their add_request() times (perf_counter)
        self._online_start = 0.0  # when the current busy period began

    # ------------------------------------------------------------------ constructors
    @classmethod
    def from_config(cls, config: Any, **kwargs) -> "Engine":
        """Random weights (seed=kwargs.get('seed', 0)) for a config object / dict."""
        return cls(Qwen3Config.from_any(config), **kwargs)

    @classmethod
    def from_state_dict(cls, config: Any, state_dict: dict[str, torch.Tensor], **kwargs) -> "Engine":
        """Weights from a transformers-named state dict (e.g. Qwen3ForCausalLM.state_dict())."""
        if not isinstance(state_dict, dict):
            # (None reached Engine(state_dict=None): random weights, silently)
            raise TypeError(f"state_dict must be a dict of tensors keyed by transformers' names, "
                            f"got {type(state_dict).__name__}")
        return cls(Qwen3Config.from_any(config), state_dict=state_dict, **kwargs)

    # ------------------------------------------------------------------ helpers
    def kv_bytes_per_block(self, block_size: int) -> int:
        cfg = self.config
        elem = torch.empty((), dtype=self.kv_cache_dtype).element_size()
        return 2 * cfg.num_hidden_layers * block_size * cfg.num_key_value_heads * cfg.head_dim * elem

    def _default_num_blocks(self, block_size: int, fraction: float) -> int:
        per_block = self.kv_bytes_per_block(block_size)
        # never more than every running sequence at full length can use
        useful = self.max_num_seqs * (-(-self.max_model_len // block_size))
        if self.device.type == "cuda":
            free, _total = torch.cuda.mem_get_info(self.device)
            n = int(free * fraction) // per_block
        else:
            n = self.max_num_seqs * (-(-min(self.max_model_len, 2048) // block_size))
            n = min(n, max(64, (4 << 30) // per_block))  # at most ~4 GiB of host memory
        n = min(n, useful)
        if n < 1:
            raise RuntimeError(f"not enough memory for even one KV block ({per_block} bytes)")
        return n

    @property
    def eos_token_ids(self) -> list[int]:
        return list(self.config.eos_token_ids)

    # ------------------------------------------------------------------ generation
    @torch.inference_mode()
    def generate(
        self,
        prompts: Seq[Seq[int]],
        max_new_tokens: int | Seq[int] = 32,
        temperature: float = 0.0,
        top_p: float = 1.0,
        stop_token_ids: Seq[int] | None = None,
        seed: int | None = None,
        progress: bool = False,
        ignore_eos: bool = False,
        return_stats: bool = False,
        top_k: int = 0,
        presence_penalty: float = 0.0,
        frequency_penalty: float = 0.0,
        repetition_penalty: float = 1.0,
    ):
        """New tokens per prompt, in prompt order (a stop token, when hit, is included).

        max_new_tokens and every sampling argument are each one value for every prompt, or a list
        of one per prompt (greedy and sampled requests may share a call). Sampling (temperature > 0)
        keeps the top_k most likely tokens (0: all), then the top_p nucleus of those; Qwen3's model
        card suggests temperature 0.6, top_p 0.95, top_k 20 for thinking mode, and a
        presence_penalty up to 2 against endless repetition. Penalties apply before sampling and
        to greedy requests too (sampler.apply_penalties: repetition_penalty over prompt and
        output, as transformers; presence and frequency over the output, as OpenAI and vLLM).
        With return_stats=True returns (outputs, GenerateStats): prefix-cache hit tokens,
        computed prompt tokens, steps, time to first token per request and inter-token
        latencies. The same stats are kept in `engine.stats` until the next call.
        """
        # (a 0-d tensor has __len__ but no length: it is one value, refused below with the rule, not by iteration)
        per_request = not isinstance(max_new_tokens, numbers.Integral) and hasattr(max_new_tokens, "__len__") \
            and not (isinstance(max_new_tokens, (torch.Tensor, np.ndarray)) and max_new_tokens.ndim == 0)
        for n in (max_new_tokens if per_request else [max_new_tokens]):
            if not integer_number(n) or n < 0:
                raise ValueError(f"max_new_tokens must be a non-negative int or one per prompt, got {n!r}")
        sampling_args = {"temperature": temperature, "top_p": top_p, "top_k": top_k,
                         "presence_penalty": presence_penalty, "frequency_penalty": frequency_penalty,
                         "repetition_penalty": repetition_penalty}
        for name, value in sampling_args.items():
            if isinstance(value, (list, tuple)):
                sampling_args[name] = list(value)
            elif isinstance(value, (str, bytes)) or hasattr(value, "__len__"):
                raise TypeError(f"{name} must be a number or a list of one per prompt, got {type(value).__name__}")
        # every value is checked (and normalised) here; the lengths of per-prompt lists once the prompts are read
        for name, value in sampling_args.items():
            checked = [getattr(make_sampling_params(**{name: v}), name) for v in
                       (value if isinstance(value, list) else [value])]
            sampling_args[name] = checked if isinstance(value, list) else checked[0]
        if seed is not None and not integer_number(seed):
            raise TypeError(f"seed must be an int or None, got {type(seed).__name__}")
        # a generator is read once, here
        prompts = None if isinstance(prompts, (str, bytes)) or not hasattr(prompts, "__iter__") else list(prompts)
        if prompts is None or any(isinstance(p, (numbers.Number, str, bytes)) or not hasattr(p, "__iter__")
                                  for p in prompts):
            raise TypeError("prompts must be a list of token-id lists (one list per prompt), "
                            "e.g. [[151644, 872], [9707]]")
        vocab = self.config.vocab_size
        prompts = [_token_ids(f"prompt {i}", p, vocab) for i, p in enumerate(prompts)]
        for i, p in enumerate(prompts):
            if not p:
                raise ValueError(f"prompt {i} is empty; a prompt needs at least one token")
        stop_token_ids = _stop_token_ids(stop_token_ids, vocab)
        for flag, value in (("return_stats", return_stats), ("ignore_eos", ignore_eos), ("progress", progress)):
            if not isinstance(value, bool):  # (ignore_eos="no" would be truthy: generation past EOS)
                raise TypeError(f"{flag} must be a bool, got {type(value).__name__}")
        if per_request and len(max_new_tokens) != len(prompts):
            raise ValueError(f"max_new_tokens has {len(max_new_tokens)} entries for {len(prompts)} prompts")
        for name, value in sampling_args.items():
            if isinstance(value, list) and len(value) != len(prompts):
                raise ValueError(f"{name} has {len(value)} entries for {len(prompts)} prompts")
        per_prompt = {name: value if isinstance(value, list) else [value] * len(prompts)
                      for name, value in sampling_args.items()}
        new_tokens = [int(n) for n in max_new_tokens] if per_request else [int(max_new_tokens)] * len(prompts)
        sched = self._new_scheduler()
        seqs = [Sequence(p, n, index=i) for i, (p, n) in enumerate(zip(prompts, new_tokens))]
        for s in seqs:
            # all or nothing: reject before running anything. Also when no prompt asks for a token: a
            # prompt over max_model_len or the cache was accepted alone with max_new_tokens=0 and
            # refused next to a prompt that asked for one.
            sched.check_fits(s)
        self.stats = GenerateStats()
        if not any(new_tokens):
            outputs = [[] for _ in prompts]
            return (outputs, self.stats) if return_stats else outputs

        self._check_no_online_requests("generate()")
        stops = self._stop_set(stop_token_ids, ignore_eos)
        for s in seqs:
            s.sampling = SamplingParams(**{name: per_prompt[name][s.index] for name in SAMPLING_FIELDS})
            s.stop_ids = stops
        if any(s.sampling.temperature > 0 for s in seqs):
            # One generator per sampled request, seeded by (seed, prompt index): a request's draws
            # do not depend on what else shares its steps (so caching on/off or other budgets give
            # the same tokens for the same seed).
            base = int(torch.randint(0, 2**62, ()).item()) if seed is None else int(seed)
            for s in seqs:
                if s.sampling.temperature > 0:
                    s.generator = torch.Generator(device=self.device)
                    s.generator.manual_seed((base * 1_000_003 + s.index) % (2**63))
        for s in seqs:
            if s.max_new_tokens > 0:  # a request for no tokens never runs
                sched.add(s)

        bar = None
        if progress:
            from tqdm.auto import tqdm

            bar = tqdm(total=sum(new_tokens), unit="tok", desc="generate", dynamic_ncols=True)
        t_start = time.perf_counter()
        try:
            while sched.has_work():
                self._step(sched, bar)
        except BaseException:
            sched.abort_all()
            raise
        finally:
            if bar is not None:
                bar.close()
        st = self.stats
        st.total_seconds = time.perf_counter() - t_start
        st.preemptions = sched.num_preemptions
        st.cuda_graph = self.runner.graphs_active
        for s in seqs:
            _record_latencies(st, s.token_times, t_start)
        outputs = [s.output_ids for s in seqs]
        return (outputs, st) if return_stats else outputs

    def _stop_set(self, stop_token_ids: list[int], ignore_eos: bool) -> frozenset[int]:
        return frozenset(stop_token_ids) | (frozenset() if ignore_eos else frozenset(self.config.eos_token_ids))

    def _new_scheduler(self) -> Scheduler:
        return Scheduler(self.cache, max_num_seqs=self.max_num_seqs, max_num_batched_tokens=self.max_num_batched_tokens,
                         max_model_len=self.max_model_len, enable_prefix_caching=self.enable_prefix_caching)

    def _step(self, sched: Scheduler, bar, logprobs: bool = False) -> list[tuple[Sequence, int, float | None]]:
        """One scheduler step: forward, sample, append, finish. Returns (sequence, token, its
        log-probability under the model's own distribution, or None without `logprobs`) per sample."""
        t0 = time.perf_counter()
        plan = sched.schedule()
        calibrate = self._calibrate_kv and not plan.decode_only
        logits = self.runner.run(plan, calibrate_kv=calibrate)
        if calibrate:
            self._calibrate_kv = False
        sampling = plan.sampling
        params = [s.sampling for s in sampling]
        raw = logits
        if any(p.penalized for p in params):
            logits = apply_penalties(logits, params, [s.token_ids for s in sampling], [s.prompt_len for s in sampling])
        chosen = sample_checked(logits, params, generators=[s.generator for s in sampling]) if sampling else None
        tokens = chosen.tolist() if sampling else []
        token_logprobs = [None] * len(tokens)
        if logprobs and sampling:
            # before penalties, temperature and cuts: what the model itself gives the token (vLLM's default)
            z = raw.float()
            token_logprobs = (z.gather(1, chosen.view(-1, 1)).squeeze(1) - torch.logsumexp(z, dim=-1)).tolist()
        now = time.perf_counter()  # .tolist() synchronised the device
        dt = now - t0
        sched.update(plan)
        st = self.stats
        st.step_batch_sizes.append(len(plan.chunks))
        st.step_tokens.append(plan.num_tokens)
        st.prefix_hit_tokens += plan.prefix_hit_tokens
        if plan.decode_only:
            st.decode_steps += 1
            st.decode_batch_sizes.append(len(plan.chunks))
            st.decode_tokens += len(plan.chunks)
            st.decode_seconds += dt
        else:
            st.prefill_steps += 1
            st.mixed_steps += plan.num_decodes > 0
            st.prefill_tokens += plan.num_tokens - plan.num_decodes
            st.prefill_seconds += dt
        for seq, tok in zip(sampling, tokens):
            seq.token_ids.append(tok)
            seq.token_times.append(now)
            if tok in seq.stop_ids:
                sched.finish(seq, "stop")
            elif seq.num_generated >= seq.max_new_tokens:
                sched.finish(seq, "length")
            elif len(seq) >= self.max_model_len:
                sched.finish(seq, "max_model_len")
        if bar is not None:
            bar.update(len(sampling))
        return list(zip(sampling, tokens, token_logprobs))

    # ------------------------------------------------------------------ online requests
    def add_request(
        self,
        prompt: Seq[int],
        max_new_tokens: int = 32,
        *,
        temperature: float = 0.0,
        top_p: float = 1.0,
        top_k: int = 0,
        presence_penalty: float = 0.0,
        frequency_penalty: float = 0.0,
        repetition_penalty: float = 1.0,
        seed: int | None = None,
        stop_token_ids: Seq[int] | None = None,
        ignore_eos: bool = False,
    ) -> int:
        """Queue one request for step() and return its id; it joins the running batch at the next
        step that has room (continuous batching), whatever else is in flight. The arguments follow
        generate()'s rules for one prompt; max_new_tokens must be at least 1. A request without a
        seed draws its RNG seed from torch's global generator."""
        vocab = self.config.vocab_size
        prompt = _token_ids("prompt", prompt, vocab)
        if not prompt:
            raise ValueError("prompt is empty; a prompt needs at least one token")
        if not integer_number(max_new_tokens) or max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be an int >= 1, got {max_new_tokens!r}")
        sampling = make_sampling_params(temperature, top_p, top_k, presence_penalty, frequency_penalty,
                                        repetition_penalty)
        if seed is not None and not integer_number(seed):
            raise TypeError(f"seed must be an int or None, got {type(seed).__name__}")
        stops = _stop_token_ids(stop_token_ids, vocab)
        if not isinstance(ignore_eos, bool):
            raise TypeError(f"ignore_eos must be a bool, got {type(ignore_eos).__name__}")
        seq = Sequence(prompt, int(max_new_tokens))
        if self._online is None or not self._online.has_work():
            # a new busy period: its own scheduler (preemption count) and stats
            self._online, self.stats = self._new_scheduler(), GenerateStats()
            self._online_start = time.perf_counter()
        self._online.check_fits(seq)
        seq.sampling = sampling
        seq.stop_ids = self._stop_set(stops, ignore_eos)
        if sampling.temperature > 0:
            seq.generator = torch.Generator(device=self.device)
            seq.generator.manual_seed(int(torch.randint(0, 2**62, ()).item()) if seed is None else int(seed) % 2**63)
        self._online.add(seq)
        self._online_seqs[seq.seq_id] = seq
        self._online_arrival[seq.seq_id] = time.perf_counter()
        return seq.seq_id

    @torch.inference_mode()
    def step(self) -> list["RequestOutput"]:
        """Run one step over the requests queued with add_request(): every running decode plus
        prompt chunks up to max_num_batched_tokens. Returns one RequestOutput per request that got
        a token (none for requests still prefilling). [] when nothing is queued. If the step
        raises, every online request is aborted and its pages freed."""
        sched = self._online
        if sched is None or not sched.has_work():
            return []
        try:
            sampled = self._step(sched, None, logprobs=True)
        except BaseException:
            sched.abort_all()
            self._online_seqs.clear()
            self._online_arrival.clear()
            raise
        st = self.stats
        st.preemptions = sched.num_preemptions
        st.cuda_graph = self.runner.graphs_active
        st.total_seconds = time.perf_counter() - self._online_start
        outputs = []
        for seq, tok, logprob in sampled:
            finished = seq.finish_reason is not None
            if finished:
                del self._online_seqs[seq.seq_id]
                _record_latencies(st, seq.token_times, self._online_arrival.pop(seq.seq_id))
            outputs.append(RequestOutput(seq.seq_id, tok, seq.output_ids, finished, seq.finish_reason, logprob))
        return outputs

    def has_unfinished_requests(self) -> bool:
        """Requests added with add_request() that have not finished nor been aborted."""
        return bool(self._online_seqs)

    def abort_request(self, request_id: int) -> None:
        """Drop an unfinished online request and free its pages (its named prefix blocks stay
        cached). KeyError for an id that is not an unfinished request."""
        if isinstance(request_id, bool) or not integer_number(request_id) or request_id not in self._online_seqs:
            raise KeyError(f"no unfinished request with id {request_id!r}")
        self._online.finish(self._online_seqs.pop(request_id), "abort")
        self._online_arrival.pop(request_id)

    def _check_no_online_requests(self, what: str) -> None:
        if self._online_seqs:
            raise RuntimeError(f"{what} while {len(self._online_seqs)} request(s) added with add_request() are "
                               "unfinished: step() them to completion or abort_request() them first")

    def warmup(self) -> None:
        """Compile kernels and capture decode graphs now, so that later requests time only generation.

        It runs the step kinds a server meets: a batch of short prompts (prefill, then decode steps
        in graphs); a prompt that joins while another request decodes (a mixed step), in chunks
        when the token budget is smaller than it; and, with prefix caching on, the same prompt
        again, whose tail then attends over cached pages; and a prompt of a whole token budget
        (half the cache at most) joining one decode, then it and the medium prompt joining as
        many decodes as max_num_seqs and the cache allow. Triton still compiles a variant the
        first time a shape class the warm-up missed reaches one of its kernels. fp8 scales that
        the warm-up set are released: the next real prompt sets them."""
        self._check_no_online_requests("warmup()")
        recalibrate = self._calibrate_kv
        # prompts shortened to what max_model_len and the cache hold, since a request that could
        # never fit is refused
        room = min(self.max_model_len, self.cache.num_blocks * self.cache.block_size)
        prompt_len = max(1, min(4, room - 2))
        new = min(3, room - prompt_len + 1)
        self.generate([[0] * prompt_len] * min(2, self.max_num_seqs), max_new_tokens=new, ignore_eos=True)
        # a prompt a few blocks long (beyond the token budget when that is small), one short of
        # whole blocks so that its cached copy leaves a tail to compute
        long_len = max(1, min(room - 1, 3 * self.cache.block_size - 1, self.max_num_batched_tokens + 5))
        if self.max_num_seqs >= 2 and room > prompt_len + 1:
            self.add_request([1] * prompt_len, new, ignore_eos=True)
            self.step()  # its prefill; it decodes while the next one prefills
            self.add_request([2] * long_len, 2, ignore_eos=True)
            while self.has_unfinished_requests():
                self.step()
        if self.enable_prefix_caching and long_len > self.cache.block_size:
            self.add_request([2] * long_len, 1, ignore_eos=True)
            while self.has_unfinished_requests():
                self.step()
        # Mixed steps of a whole token budget of prompt next to one decode and next to as many as
        # the engine holds: the paged kernels pick other variants for a long chunk (Gluon's and the
        # long kernel's tiles, the decode part's packed queries) and for a batch that fills the GPU
        # (no split), and Triton would otherwise compile them under the first busy step.
        chunk_len = max(1, min(room // 2, self.max_num_batched_tokens))  # half the room: the rest decodes
        if chunk_len > long_len:
            self._warm_mixed_step(1, prompt_len, [chunk_len])
        # (and the warm-up's medium prompt again, beside a full batch: the paged long kernel's tiles)
        self._warm_mixed_step(self.max_num_seqs - 1, prompt_len, sorted({chunk_len, min(long_len, chunk_len)}))
        self._calibrate_kv = recalibrate
        self.stats = GenerateStats()
        if recalibrate:
            self.cache.reset_prefix_cache()  # blocks named under the warm-up scales

    def _warm_mixed_step(self, decodes: int, prompt_len: int, chunk_lens: Seq[int]) -> None:
        """warmup(): up to `decodes` requests of prompt_len tokens prefill and start decoding, then
        prompts of chunk_lens tokens join them one after the other (as many decodes as the cache
        holds beside the longest)."""
        bs, budget = self.cache.block_size, self.max_num_batched_tokens
        chunk_blocks = -(-(max(chunk_lens) + 1) // bs)
        decodes = min(decodes, budget - 1)  # a token of the budget left for the chunk
        while True:
            # enough new tokens that the first requests admitted still decode when the last chunk comes
            prefill_steps = -(-decodes * prompt_len // budget)
            chunk_steps = sum(-(-n // max(1, budget - decodes)) for n in chunk_lens)
            new = min(prefill_steps + chunk_steps + 3, self.max_model_len - prompt_len)
            fit = (self.cache.num_blocks - chunk_blocks) // -(-(prompt_len + new) // bs)
            if fit >= decodes or decodes < 1:
                break
            decodes = max(fit, decodes // 2)  # fewer decodes need fewer new tokens each
        if decodes < 1 or new < 2:
            return
        for _ in range(decodes):
            self.add_request([3 % self.config.vocab_size] * prompt_len, new, ignore_eos=True)
        for _ in range(prefill_steps):
            self.step()
        for i, n in enumerate(chunk_lens):
            # (a prompt of its own each: with prefix caching on, an earlier one's would be a hit)
            rid = self.add_request([(4 + 2 * min(decodes, 2) + i) % self.config.vocab_size] * n, 1,
                                   ignore_eos=True)
            while rid in self._online_seqs:
                self.step()
        while self.has_unfinished_requests():
            self.step()

    # ------------------------------------------------------------------ testing aid
    @torch.inference_mode()
    def prefill_logits(self, prompts: Seq[Seq[int]]) -> list[torch.Tensor]:
        """Full-sequence logits [len_i, V] (fp32) of one packed prefill, through the paged cache
        (no prefix cache: every token is computed)."""
        # generate()'s rules: a prompt past max_model_len indexed past the RoPE tables (an IndexError on
        # the CPU, a device-side assert on a GPU); no prompt at all failed in max()
        prompts = None if isinstance(prompts, (str, bytes)) or not hasattr(prompts, "__iter__") else list(prompts)
        if prompts is None:
            raise TypeError("prompts must be a list of token-id lists (one list per prompt), "
                            "e.g. [[151644, 872], [9707]]")
        seqs = [Sequence(_token_ids(f"prompt {i}", p, self.config.vocab_size), 1, index=i)
                for i, p in enumerate(prompts)]
        for s in seqs:
            if len(s) > self.max_model_len:
                raise ValueError(f"prompt {s.index} of {len(s)} tokens exceeds max_model_len={self.max_model_len}")
        if not seqs:
            return []
        bs = self.cache.block_size
        try:
            slots = []
            for s in seqs:
                slots.append(self.cache.allocate(s.seq_id, -(-len(s) // bs) * bs)[: len(s)])
            dev = self.device
            ids = torch.tensor([t for s in seqs for t in s.token_ids], dtype=torch.int64, device=dev)
            pos = torch.tensor([i for s in seqs for i in range(len(s))], dtype=torch.int64, device=dev)
            cu = [0]
            for s in seqs:
                cu.append(cu[-1] + len(s))
            tables = [self.cache.block_table(s.seq_id) for s in seqs]
            width = max(len(t) for t in tables)
            # the block tables too: a batch-invariant model attends through paged_attention
            meta = AttentionMetadata("prefill", torch.cat(slots).to(dev),
                                     cu_seqlens=torch.tensor(cu, dtype=torch.int32, device=dev),
                                     max_seqlen_q=max(len(s) for s in seqs),
                                     block_tables=torch.tensor([t + [-1] * (width - len(t)) for t in tables],
                                                               dtype=torch.int32, device=dev),
                                     context_lens=torch.tensor([len(s) for s in seqs], dtype=torch.int32,
                                                               device=dev))
            hidden = self.model.forward(ids, pos, meta, self.cache)
            logits = self.model.logits(hidden).float()
            return [logits[cu[i]:cu[i + 1]] for i in range(len(seqs))]
        finally:
            for s in seqs:
                if s.seq_id in self.cache:
                    self.cache.free(s.seq_id)

    def __repr__(self) -> str:
        c = self.config
        return (f"Engine(layers={c.num_hidden_layers}, hidden={c.hidden_size}, heads={c.num_attention_heads}/"
                f"{c.num_key_value_heads}, D={c.head_dim}, {self.dtype}, {self.device}, backend={self.backend}, "
                f"cache={self.cache.num_blocks}x{self.cache.block_size}, graphs={self.runner.use_cuda_graph}"
                f"{', batch_invariant' if self.batch_invariant else ''})")
