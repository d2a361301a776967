"""Lean Qwen3 paged generation engine (see DESIGN.md, "Qwen3: transformers and the engine")."""

from .config import Qwen3Config, qwen3_0_6b_config
from .engine import Engine, GenerateStats, RequestOutput

__all__ = ["Engine", "GenerateStats", "Qwen3Config", "RequestOutput", "qwen3_0_6b_config"]
