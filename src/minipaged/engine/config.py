"""Qwen3 model configuration: the handful of fields the lean forward needs.

Reads a transformers `config.json` (or its dict / a transformers config object)
in both the old layout (`rope_theta` at top level, `rope_scaling`) and the
transformers-5 layout (`rope_parameters`).
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from typing import Any

from ..api import integer_number


@dataclass
class Qwen3Config:
    vocab_size: int = 151936
    hidden_size: int = 1024
    intermediate_size: int = 3072
    num_hidden_layers: int = 28
    num_attention_heads: int = 16
    num_key_value_heads: int = 8
    head_dim: int = 128
    rope_theta: float = 1_000_000.0
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = True
    max_position_embeddings: int = 40960
    attention_bias: bool = False
    initializer_range: float = 0.02
    bos_token_id: int | None = 151643
    eos_token_ids: list[int] = field(default_factory=lambda: [151645])
    torch_dtype: str | None = "bfloat16"

    def __post_init__(self) -> None:
        # zero or negative sizes would build an empty model or divide by zero while sizing the cache
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                     "num_key_value_heads", "max_position_embeddings"):
            val = getattr(self, name)
            if not integer_number(val) or val < 1:
                raise ValueError(f"config {name} must be a positive int, got {val!r}")
        if not 0 < self.rope_theta < float("inf"):
            raise ValueError(f"config rope_theta must be a positive finite number, got {self.rope_theta!r}")
        # a negative (or NaN) epsilon made every RMSNorm NaN: the engine generated token 0 with no error
        if not 0 <= self.rms_norm_eps < float("inf"):
            raise ValueError(f"config rms_norm_eps must be a finite number >= 0, got {self.rms_norm_eps!r}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        if self.head_dim not in (64, 128, 256):
            raise ValueError(f"head_dim {self.head_dim} is not supported by the kernels (64, 128, 256)")

    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_key_value_heads * self.head_dim

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Qwen3Config":
        d = dict(d)

        def num(name: str, default: Any, kind: type = int):
            # a config.json value of the wrong type names its field, not only int()'s complaint
            val = d.get(name, default)
            try:
                out = kind(val)
            except (TypeError, ValueError, OverflowError):
                out = None
            # (int() truncated a head_dim of 64.7 to 64, and read true as 1)
            if out is None or isinstance(val, bool) or (kind is int and isinstance(val, float) and out != val):
                raise ValueError(f"config {name} must be {'an int' if kind is int else 'a number'}, "
                                 f"got {val!r}") from None
            return out

        def flag(name: str) -> bool:
            # bool("false") is True: a quoted "false" for tie_word_embeddings silently tied the lm_head
            val = d.get(name)
            if val is None or isinstance(val, bool) or val in (0, 1) and not isinstance(val, float):
                return bool(val)
            raise ValueError(f"config {name} must be true or false, got {val!r}")

        mt = d.get("model_type")
        if mt is not None and mt != "qwen3":
            raise ValueError(f"config model_type is {mt!r}; the engine runs only 'qwen3'")
        if flag("use_sliding_window"):
            raise NotImplementedError("sliding-window attention (use_sliding_window=true) is not supported")
        hidden_act = d.get("hidden_act", "silu")
        if hidden_act != "silu":
            raise NotImplementedError(f"hidden_act {hidden_act!r} (only silu)")

        rope = d.get("rope_parameters") or d.get("rope_scaling") or {}
        if not isinstance(rope, dict):
            raise ValueError(f"config rope_parameters / rope_scaling must be an object, got {rope!r}")
        rope_type = rope.get("rope_type", rope.get("type", "default")) if rope else "default"
        if rope_type not in (None, "default"):
            raise NotImplementedError(f"rope_type {rope_type!r} (only the default RoPE)")
        theta = rope.get("rope_theta") if rope else None
        if theta is None:
            theta = d.get("rope_theta", 10000.0)
        try:
            theta = float(theta)
        except (TypeError, ValueError):
            raise ValueError(f"config rope_theta must be a number, got {theta!r}") from None

        eos = d.get("eos_token_ids", d.get("eos_token_id"))
        try:
            eos_list = [] if eos is None else [int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos])]
        except (TypeError, ValueError):
            raise ValueError(f"config eos_token_id must be a token id or a list of them, got {eos!r}") from None

        n_heads = num("num_attention_heads", cls.num_attention_heads)
        hidden = num("hidden_size", cls.hidden_size)
        # a head count below 1 is reported by __post_init__, not divided by here
        head_dim = num("head_dim", None) if d.get("head_dim") is not None else hidden // max(n_heads, 1)
        kv_heads = num("num_key_value_heads", None) if d.get("num_key_value_heads") is not None else n_heads
        dtype = d.get("torch_dtype", d.get("dtype"))
        if dtype is not None and not isinstance(dtype, str):
            dtype = str(dtype).replace("torch.", "")
        return cls(
            vocab_size=num("vocab_size", cls.vocab_size),
            hidden_size=hidden,
            intermediate_size=num("intermediate_size", cls.intermediate_size),
            num_hidden_layers=num("num_hidden_layers", cls.num_hidden_layers),
            num_attention_heads=n_heads,
            num_key_value_heads=kv_heads,
            head_dim=head_dim,
            rope_theta=theta,
            rms_norm_eps=num("rms_norm_eps", 1e-6, float),
            # transformers' PretrainedConfig default is True; Qwen3Config's own default is False,
            # but every published Qwen3 config states it explicitly.
            tie_word_embeddings=flag("tie_word_embeddings"),
            max_position_embeddings=num("max_position_embeddings", 40960),
            attention_bias=flag("attention_bias"),
            initializer_range=num("initializer_range", 0.02, float),
            bos_token_id=d.get("bos_token_id"),
            eos_token_ids=eos_list,
            torch_dtype=dtype,
        )

    @classmethod
    def from_any(cls, cfg: Any) -> "Qwen3Config":
        """A Qwen3Config, a dict, a transformers config object or a folder / config.json path."""
        if isinstance(cfg, cls):
            return cfg
        if isinstance(cfg, dict):
            return cls.from_dict(cfg)
        if isinstance(cfg, (str, os.PathLike)):
            path = os.fspath(cfg)
            if os.path.isdir(path):
                path = os.path.join(path, "config.json")
                if not os.path.isfile(path):
                    raise FileNotFoundError(f"{os.fspath(cfg)!r} has no config.json (a Qwen3 checkpoint folder "
                                            "holds config.json and *.safetensors)")
            with open(path) as f:
                try:
                    d = json.load(f)
                except ValueError as e:
                    raise ValueError(f"{path} is not valid JSON: {e}") from None
            if not isinstance(d, dict):
                raise ValueError(f"{path} must hold a JSON object, got a {type(d).__name__}")
            return cls.from_dict(d)
        if hasattr(cfg, "to_dict"):
            return cls.from_dict(cfg.to_dict())
        raise TypeError(f"cannot read a Qwen3 configuration from {type(cfg).__name__}")

    def to_hf_dict(self) -> dict[str, Any]:
        """A transformers-style config.json dict (both rope layouts, so old and new versions read it)."""
        eos = self.eos_token_ids
        return {
            "architectures": ["Qwen3ForCausalLM"],
            "model_type": "qwen3",
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "rope_theta": self.rope_theta,
            "rope_parameters": {"rope_type": "default", "rope_theta": self.rope_theta},
            "rope_scaling": None,
            "rms_norm_eps": self.rms_norm_eps,
            "tie_word_embeddings": self.tie_word_embeddings,
            "max_position_embeddings": self.max_position_embeddings,
            "attention_bias": self.attention_bias,
            "attention_dropout": 0.0,
            "initializer_range": self.initializer_range,
            "use_sliding_window": False,
            "sliding_window": None,
            "max_window_layers": self.num_hidden_layers,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": (eos[0] if len(eos) == 1 else (list(eos) or None)),
            "torch_dtype": self.torch_dtype or "float32",
            "use_cache": True,
        }

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def qwen3_0_6b_config() -> Qwen3Config:
    """The published Qwen3-0.6B shape (weights not included)."""
    return Qwen3Config()


