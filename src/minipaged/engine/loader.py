"""Weights: read a transformers Qwen3 checkpoint folder, or make seeded random ones.

Both produce a dict keyed by transformers' parameter names (without the
"model." prefix handling leaking out: keys are normalised to
"model.layers.0.self_attn.q_proj.weight" style), so the same dict can be loaded
into `Qwen3ForCausalLM` for comparisons.
"""

from __future__ import annotations

import glob
import os


import torch

from .config import Qwen3Config

_LAYER_PARAMS = (
    ("self_attn.q_proj.weight", "q"),
    ("self_attn.k_proj.weight", "kv"),
    ("self_attn.v_proj.weight", "kv"),
    ("self_attn.o_proj.weight", "o"),
    ("self_attn.q_norm.weight", "head_norm"),
    ("self_attn.k_norm.weight", "head_norm"),
    ("mlp.gate_proj.weight", "up"),
    ("mlp.up_proj.weight", "up"),
    ("mlp.down_proj.weight", "down"),
    ("input_layernorm.weight", "norm"),
    ("post_attention_layernorm.weight", "norm"),
)


def expected_shapes(cfg: Qwen3Config) -> dict[str, tuple[int, ...]]:
    """Every parameter name the engine reads, with its shape (lm_head only when untied)."""
    H, I, D = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    kinds = {
        "q": (cfg.q_size, H),
        "kv": (cfg.kv_size, H),
        "o": (H, cfg.q_size),
        "head_norm": (D,),
        "up": (I, H),
        "down": (H, I),
        "norm": (H,),
    }
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (cfg.vocab_size, H), "model.norm.weight": (H,)}
    for layer in range(cfg.num_hidden_layers):
        for name, kind in _LAYER_PARAMS:
            shapes[f"model.layers.{layer}.{name}"] = kinds[kind]
        if cfg.attention_bias:
            shapes[f"model.layers.{layer}.self_attn.q_proj.bias"] = (cfg.q_size,)
            shapes[f"model.layers.{layer}.self_attn.k_proj.bias"] = (cfg.kv_size,)
            shapes[f"model.layers.{layer}.self_attn.v_proj.bias"] = (cfg.kv_size,)
    if not cfg.tie_word_embeddings:
        shapes["lm_head.weight"] = (cfg.vocab_size, H)
    return shapes


# Per-layer K/V scale tensors of FP8-KV checkpoints (Engine(kv_cache_dtype="fp8") reads them); "{}" is k or v
KV_SCALE_NAMES = ("self_attn.{}_scale", "self_attn.attn.{}_scale", "self_attn.{}_proj.output_scale")


def _is_kv_scale(name: str) -> bool:
    parts = name.split(".", 3)  # model, layers, i, rest
    return len(parts) == 4 and parts[:2] == ["model", "layers"] and parts[2].isdigit() \
        and any(parts[3] == n.format(kind) for n in KV_SCALE_NAMES for kind in "kv")


def _normalise_key(key: str) -> str:
    # A checkpoint of the bare Qwen3Model has no "model." prefix.
    if key.startswith(("model.", "lm_head.")):
        return key
    return "model." + key


def load_checkpoint(folder: str, cfg: Qwen3Config) -> dict[str, torch.Tensor]:
    """Read every *.safetensors file of `folder` (sharded or not) with the safetensors library."""
    from safetensors import safe_open

    files = sorted(glob.glob(os.path.join(folder, "*.safetensors")))
    if not files:
        raise FileNotFoundError(f"no *.safetensors file in {folder!r} (only safetensors checkpoints are read)")
    wanted = expected_shapes(cfg)
    wanted_with_lm_head = set(wanted) | {"lm_head.weight"}
    state: dict[str, torch.Tensor] = {}
    for path in files:
        try:
            with safe_open(path, framework="pt", device="cpu") as f:
                for key in f.keys():
                    name = _normalise_key(key)
                    # (the K/V scales too: they were dropped here, so a folder's scales were never used)
                    if name in wanted_with_lm_head or _is_kv_scale(name):
                        state[name] = f.get_tensor(key)
        except (OSError, MemoryError):
            raise
        except Exception as e:  # noqa: BLE001 - safetensors raises its own error types for damaged files
            raise ValueError(f"checkpoint file {path!r} cannot be read as safetensors "
                             f"({type(e).__name__}: {e})") from e
    return state


def check_state_dict(state: dict[str, torch.Tensor], cfg: Qwen3Config) -> dict[str, torch.Tensor]:
    """Validate names/shapes; tie lm_head to the embedding when the checkpoint has none."""
    state = {_normalise_key(k): v for k, v in state.items()}
    wanted = expected_shapes(cfg)
    for name in (*wanted, "lm_head.weight", *filter(_is_kv_scale, state)):
        v = state.get(name)
        if v is None:
            continue
        if not isinstance(v, torch.Tensor):  # (was: AttributeError on .shape / .numel)
            raise TypeError(f"{name} must be a tensor, got {type(v).__name__}")
        if _is_kv_scale(name):
            continue  # (any real dtype: read as float32)
        if not v.dtype.is_floating_point or v.element_size() < 2:
            # fp8 / int8 / int4-packed weights of a quantized checkpoint were cast to the model dtype without
            # their scales: the engine generated garbage without an error
            raise ValueError(f"{name} is {str(v.dtype).replace('torch.', '')}: quantized weights are not supported "
                             "(the engine reads float32/float16/bfloat16 weights; kv_cache_dtype='fp8' quantises "
                             "only the KV cache)")
    missing = [k for k in wanted if k not in state]
    if missing == ["lm_head.weight"]:
        # An untied config whose checkpoint still lacks lm_head: the only sensible reading is tying.
        missing = []
    if missing:
        more = f" (and {len(missing) - 5} more)" if len(missing) > 5 else ""
        raise KeyError(f"checkpoint lacks {missing[:5]}{more}")
    for name, shape in wanted.items():
        if name in state and tuple(state[name].shape) != shape:
            raise ValueError(f"{name}: checkpoint shape {tuple(state[name].shape)}, config expects {shape}")
    if "lm_head.weight" not in state and not cfg.tie_word_embeddings:
        import warnings

        warnings.warn("the checkpoint has no lm_head.weight though tie_word_embeddings is false; "
                      "using the input embedding as the output projection", stacklevel=3)
    if "lm_head.weight" not in state or cfg.tie_word_embeddings:
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    elif tuple(state["lm_head.weight"].shape) != (cfg.vocab_size, cfg.hidden_size):
        raise ValueError(f"lm_head.weight has shape {tuple(state['lm_head.weight'].shape)}")
    return state


def random_state_dict(
    cfg: Qwen3Config,
    *,
    seed: int = 0,
    std: float | None = None,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
) -> dict[str, torch.Tensor]:
    """Seeded N(0, std) weights (norm weights 1, biases 0), drawn on `device` for speed.

    The same (seed, device) gives the same weights; CPU and CUDA draws differ.
    """
    std = cfg.initializer_range if std is None else std
    gen = torch.Generator(device=device)
    gen.manual_seed(seed)
    state: dict[str, torch.Tensor] = {}
    for name, shape in expected_shapes(cfg).items():
        if name.endswith("norm.weight"):
            state[name] = torch.ones(shape, dtype=dtype, device=device)
        elif name.endswith(".bias"):
            state[name] = torch.zeros(shape, dtype=dtype, device=device)
        else:
            t = torch.empty(shape, dtype=torch.float32, device=device)
            t.normal_(0.0, std, generator=gen)
            state[name] = t.to(dtype)
    if cfg.tie_word_embeddings:
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    return state


def save_checkpoint(folder: str, cfg: Qwen3Config, state: dict[str, torch.Tensor]) -> None:
    """Write config.json + model.safetensors that transformers' from_pretrained reads."""
    import json

    from safetensors.torch import save_file

    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(cfg.to_hf_dict(), f, indent=2)
    out = {}
    for k, v in state.items():
        if k == "lm_head.weight" and cfg.tie_word_embeddings:
            continue  # shared storage cannot be saved twice; transformers re-ties it
        out[k] = v.detach().contiguous().cpu()
    save_file(out, os.path.join(folder, "model.safetensors"), metadata={"format": "pt"})


