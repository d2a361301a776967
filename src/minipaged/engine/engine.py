"""Engine: load Qwen3 weights, own a PagedKVCache, generate with continuous batching."""

from __future__ import annotations

import math
import numbers
import os
import time
from dataclasses import dataclass, field
from typing import Any, Sequence as Seq

import torch

from .config import Qwen3Config, qwen3_0_6b_config
from .loader import check_state_dict, load_checkpoint, random_state_dict
from .model import AttentionMetadata, Qwen3Model
from .runner import ModelRunner
from .sampler import check_sampling, sample
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
    if not isinstance(device, (str, torch.device)):
        raise TypeError(f"device must be a str, torch.device or None, got {type(device).__name__}")
    try:
        dev = torch.device(device)
    except (RuntimeError, ValueError):
        raise ValueError(f"device must be 'cpu' or 'cuda[:N]', got {device!r}") from None
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(f"device must be 'cpu' or 'cuda[:N]', got {device!r}")
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device={device!r} but torch sees no CUDA device"
                             f"{' (this torch build has no CUDA)' if torch.version.cuda is None else ''}")
        if dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
        elif dev.index >= torch.cuda.device_count():
            raise ValueError(f"device={device!r} but only {torch.cuda.device_count()} CUDA device(s) are visible")
    return dev


def _positive_int(name: str, val: Any) -> int:
    if isinstance(val, bool) or not isinstance(val, int) or val < 1:
        raise ValueError(f"{name} must be a positive int, got {val!r}")
    return val


def _check_block_size(block_size: Any) -> None:
    if isinstance(block_size, bool) or not isinstance(block_size, int) or not 1 <= block_size <= 256 \
            or block_size & (block_size - 1):
        raise ValueError(f"block_size must be a power of two in [1, 256], got {block_size!r}")


def _token_id(where: str, t: Any, vocab: int) -> int:
    # numbers.Integral covers int and numpy integers; floats (1.7) and bools are not token ids
    if isinstance(t, torch.Tensor) and t.dim() == 0 and not t.dtype.is_floating_point and t.dtype != torch.bool:
        t = int(t)
    if isinstance(t, bool) or not isinstance(t, numbers.Integral):
        raise TypeError(f"{where} holds {t!r} ({type(t).__name__}); token ids must be ints")
    t = int(t)
    if not 0 <= t < vocab:
        raise ValueError(f"{where} holds token id {t} outside the vocabulary [0, {vocab})")
    return t


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
            extra = json.load(f).get("eos_token_id")
    except (OSError, ValueError):
        return eos
    if extra is None:
        return eos
    extra = extra if isinstance(extra, list) else [extra]
    return list(dict.fromkeys([*eos, *(int(e) for e in extra)]))


@dataclass
class GenerateStats:
    """Timings of the last generate() call (wall clock, synchronised per step)."""

    prefill_tokens: int = 0
    prefill_seconds: float = 0.0
    decode_tokens: int = 0
    decode_seconds: float = 0.0
    decode_steps: int = 0
    prefill_steps: int = 0
    preemptions: int = 0
    cuda_graph: bool = False
    step_batch_sizes: list[int] = field(default_factory=list)
    decode_batch_sizes: list[int] = field(default_factory=list)

    @property
    def prefill_tokens_per_s(self) -> float:
        return self.prefill_tokens / self.prefill_seconds if self.prefill_seconds else 0.0

    @property
    def decode_tokens_per_s(self) -> float:
        return self.decode_tokens / self.decode_seconds if self.decode_seconds else 0.0


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
        max_num_batched_tokens: token budget of one prefill step.
        cuda_graph: capture the decode step in CUDA graphs (default: on for CUDA
            with a non-torch backend; falls back to eager if capture fails).
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
        max_num_batched_tokens: int | None = None,
        cuda_graph: bool | None = None,
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
        self.backend = backend
        _check_block_size(block_size)
        _positive_int("max_num_seqs", max_num_seqs)
        for name, val in (("num_blocks", num_blocks), ("max_model_len", max_model_len),
                          ("max_num_batched_tokens", max_num_batched_tokens)):
            if val is not None:
                _positive_int(name, val)
        if cuda_graph is not None and not isinstance(cuda_graph, bool):
            raise TypeError(f"cuda_graph must be a bool or None, got {type(cuda_graph).__name__}")
        if isinstance(gpu_memory_fraction, bool) or not isinstance(gpu_memory_fraction, (int, float)) \
                or not 0.0 < gpu_memory_fraction <= 1.0:
            raise ValueError(f"gpu_memory_fraction must be in (0, 1], got {gpu_memory_fraction!r}")
        for op in ("prefill_varlen", "decode", "write_kv_cache"):
            registry.resolve(op, self.device.type, backend)  # an unusable backend fails here, not mid-generate

        self.model_path: str | None = None
        if isinstance(model, (str, os.PathLike)):
            self.model_path = os.fspath(model)
            if not os.path.isdir(self.model_path):
                raise FileNotFoundError(f"model folder {self.model_path!r} does not exist")
            cfg = Qwen3Config.from_any(self.model_path)
            cfg.eos_token_ids = _eos_from_generation_config(self.model_path, cfg.eos_token_ids)
            state = state_dict if state_dict is not None else load_checkpoint(self.model_path, cfg)
        else:
            cfg = qwen3_0_6b_config() if model is None else Qwen3Config.from_any(model)
            if state_dict is None:
                state_dict = random_state_dict(cfg, seed=seed, dtype=self.dtype, device=self.device)
            state = state_dict
        state = check_state_dict(state, cfg)
        self.config = cfg

        self.max_model_len = int(max_model_len or min(cfg.max_position_embeddings, 4096))
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = int(max_num_batched_tokens or max(8192, self.max_model_len))
        self.model = Qwen3Model(cfg, state, dtype=self.dtype, device=self.device, backend=backend,
                                max_positions=self.max_model_len)
        del state, state_dict

        if num_blocks is None:
            num_blocks = self._default_num_blocks(block_size, gpu_memory_fraction)
        self.cache = mp.PagedKVCache(cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim,
                                     num_blocks=int(num_blocks), block_size=block_size,
                                     dtype=self.dtype, device=self.device)
        if cuda_graph is None:
            cuda_graph = self.device.type == "cuda" and self._resolved_backend_name("decode") != "torch"
        self.runner = ModelRunner(self.model, self.cache, max_num_seqs=max_num_seqs,
                                  max_model_len=self.max_model_len, use_cuda_graph=cuda_graph)
        self.stats = GenerateStats()

    # ------------------------------------------------------------------ constructors
    @classmethod
    def from_config(cls, config: Any, **kwargs) -> "Engine":
        """Random weights (seed=kwargs.get('seed', 0)) for a config object / dict."""
        return cls(Qwen3Config.from_any(config), **kwargs)

    @classmethod
    def from_state_dict(cls, config: Any, state_dict: dict[str, torch.Tensor], **kwargs) -> "Engine":
        """Weights from a transformers-named state dict (e.g. Qwen3ForCausalLM.state_dict())."""
        return cls(Qwen3Config.from_any(config), state_dict=state_dict, **kwargs)

    # ------------------------------------------------------------------ helpers
    def _resolved_backend_name(self, op: str) -> str | None:
        try:
            from minipaged import registry

            return registry.resolve(op, self.device.type, self.backend).name
        except Exception:  # noqa: BLE001 - only used to pick a default
            return None

    def kv_bytes_per_block(self, block_size: int) -> int:
        cfg = self.config
        elem = torch.empty((), dtype=self.dtype).element_size()
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
        max_new_tokens: int = 32,
        temperature: float = 0.0,
        top_p: float = 1.0,
        stop_token_ids: Seq[int] | None = None,
        seed: int | None = None,
        progress: bool = False,
        ignore_eos: bool = False,
    ) -> list[list[int]]:
        """New tokens per prompt, in prompt order (a stop token, when hit, is included)."""
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be a non-negative int, got {max_new_tokens!r}")
        temperature, top_p = check_sampling(temperature, top_p)
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
            raise TypeError(f"seed must be an int or None, got {type(seed).__name__}")
        if isinstance(prompts, (str, bytes)) or not hasattr(prompts, "__iter__") or any(
                isinstance(p, (numbers.Number, str, bytes)) or not hasattr(p, "__iter__") for p in prompts):
            raise TypeError("prompts must be a list of token-id lists (one list per prompt), "
                            "e.g. [[151644, 872], [9707]]")
        vocab = self.config.vocab_size
        prompts = [[_token_id(f"prompt {i}", t, vocab) for t in p] for i, p in enumerate(prompts)]
        for i, p in enumerate(prompts):
            if not p:
                raise ValueError(f"prompt {i} is empty; a prompt needs at least one token")
        stop_token_ids = [_token_id("stop_token_ids", t, vocab) for t in (stop_token_ids or ())]
        self.stats = GenerateStats()
        if max_new_tokens == 0 or not prompts:
            return [[] for _ in prompts]

        stops = set() if ignore_eos else set(self.config.eos_token_ids)
        stops |= {int(t) for t in (stop_token_ids or ())}
        generator = None
        if temperature > 0:
            generator = torch.Generator(device=self.device)
            if seed is None:
                generator.seed()
            else:
                generator.manual_seed(int(seed))

        sched = Scheduler(self.cache, max_num_seqs=self.max_num_seqs,
                          max_num_batched_tokens=self.max_num_batched_tokens,
                          max_model_len=self.max_model_len)
        seqs = [Sequence(p, max_new_tokens, index=i) for i, p in enumerate(prompts)]
        for s in seqs:
            sched.check_fits(s)  # all or nothing: reject before running anything
        for s in seqs:
            sched.add(s)

        bar = None
        if progress:
            from tqdm.auto import tqdm

            bar = tqdm(total=len(seqs) * max_new_tokens, unit="tok", desc="generate", dynamic_ncols=True)
        try:
            while sched.has_work():
                self._step(sched, stops, temperature, top_p, generator, bar)
        except BaseException:
            sched.abort_all()
            raise
        finally:
            if bar is not None:
                bar.close()
        self.stats.preemptions = sched.num_preemptions
        self.stats.cuda_graph = self.runner.graphs_active
        return [s.output_ids for s in seqs]

    def _step(self, sched: Scheduler, stops: set[int], temperature: float, top_p: float,
              generator, bar) -> None:
        t0 = time.perf_counter()
        batch, is_prefill = sched.schedule()
        if is_prefill:
            logits = self.runner.prefill(batch)
        else:
            logits = self.runner.decode(batch)
        tokens = sample(logits, temperature=temperature, top_p=top_p, generator=generator).tolist()
        dt = time.perf_counter() - t0  # .tolist() synchronised the device
        st = self.stats
        st.step_batch_sizes.append(len(batch))
        if is_prefill:
            st.prefill_steps += 1
            st.prefill_tokens += sum(len(s) for s in batch)
            st.prefill_seconds += dt
        else:
            st.decode_steps += 1
            st.decode_batch_sizes.append(len(batch))
            st.decode_tokens += len(batch)
            st.decode_seconds += dt
        for seq, tok in zip(batch, tokens):
            seq.token_ids.append(tok)
            if tok in stops:
                sched.finish(seq, "stop")
            elif seq.num_generated >= seq.max_new_tokens:
                sched.finish(seq, "length")
            elif len(seq) >= self.max_model_len:
                sched.finish(seq, "max_model_len")
        if bar is not None:
            bar.update(len(batch))

    def warmup(self) -> None:
        """Compile kernels and capture decode graphs now, so the next generate() times only generation."""
        n = min(2, self.max_num_seqs)
        self.generate([[0] * 4] * n, max_new_tokens=3, ignore_eos=True)

    # ------------------------------------------------------------------ testing aid
    @torch.inference_mode()
    def prefill_logits(self, prompts: Seq[Seq[int]]) -> list[torch.Tensor]:
        """Full-sequence logits [len_i, V] (fp32) of one packed prefill, through the paged cache."""
        seqs = [Sequence([int(t) for t in p], 1, index=i) for i, p in enumerate(prompts)]
        bs = self.cache.block_size
        try:
            for s in seqs:
                cap = -(-len(s) // bs) * bs
                s.prefill_slots = self.cache.allocate(s.seq_id, cap)[: len(s)]
            dev = self.device
            ids = torch.tensor([t for s in seqs for t in s.token_ids], dtype=torch.int64, device=dev)
            pos = torch.tensor([i for s in seqs for i in range(len(s))], dtype=torch.int64, device=dev)
            cu = [0]
            for s in seqs:
                cu.append(cu[-1] + len(s))
            meta = AttentionMetadata(True, torch.cat([s.prefill_slots.to(dev) for s in seqs]),
                                     cu_seqlens=torch.tensor(cu, dtype=torch.int32, device=dev),
                                     max_seqlen=max(len(s) for s in seqs))
            hidden = self.model.forward(ids, pos, meta, self.cache.k_caches, self.cache.v_caches)
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
                f"cache={self.cache.num_blocks}x{self.cache.block_size}, graphs={self.runner.use_cuda_graph})")
