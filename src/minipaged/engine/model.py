"""The lean Qwen3 forward: torch ops for everything except attention.

Token-major layout throughout: hidden states are [T, hidden] for T tokens of
any number of sequences packed back to back (no padding). Attention goes
through the minipaged kernels; K/V are written to, and read back from, the
paged cache only.

Numerics follow transformers' Qwen3 (RMSNorm statistics in fp32, RoPE cos/sin
cast to the model dtype, residual adds in the model dtype): greedy tokens match
it in fp32; in bf16 the fused RMSNorm rounds once where transformers rounds
twice, well inside bf16 noise.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..registry import BoundOps
from .config import Qwen3Config


@dataclass
class AttentionMetadata:
    """What one forward needs besides the tokens.

    kind "prefill": fresh prompts only (no cached context): cu_seqlens int32 [S+1], max_seqlen_q.
    kind "paged": chunks over cached context and/or decodes: cu_seqlens (query rows per sequence),
        max_seqlen_q, block_tables int32 [S, max_blocks], context_lens int32 [S] (new tokens included).
    kind "decode": one token per sequence: block_tables, context_lens (and cu_seqlens 0..S,
        max_seqlen_q 1, which a batch-invariant model attends through).
    slot_mapping int64 [T]: where each new token's K/V goes (negative: nowhere).
    """

    kind: str
    slot_mapping: torch.Tensor
    cu_seqlens: torch.Tensor | None = None
    max_seqlen_q: int | None = None
    block_tables: torch.Tensor | None = None
    context_lens: torch.Tensor | None = None
    calibrate_kv: bool = False  # fp8 cache: set each layer's k/v scales from this step's K/V


FP8_MAX = 448.0
# Calibrated scales are fixed after the first prompt step, whose amax may lie well below what later
# tokens bring (a one-token first prompt gives each KV head one vector): those would saturate at
# +-448. A power-of-two margin only shifts e4m3's exponent, so the values the first step covered
# keep their bits down to e4m3's subnormals, which start about 12 binades under the amax at 8x.
FP8_CALIBRATION_HEADROOM = 8.0


def _amax_scale(x: torch.Tensor) -> torch.Tensor:
    """[T, Hkv, D] -> float32 [Hkv]: the scale that maps each KV head's largest |value| to
    448 / FP8_CALIBRATION_HEADROOM (values up to that many times larger still fit)."""
    return (x.float().abs().amax(dim=(0, 2)) / (FP8_MAX / FP8_CALIBRATION_HEADROOM)).clamp_min(1e-8)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim, statistics in fp32 (one fused kernel where torch has one).

    weight may be [D], or [H, D] for per-head weights over x [T, H, D].
    """
    if weight.dim() == 1:
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    return F.rms_norm(x, (x.shape[-1],), None, eps) * weight


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    """Neox (rotate-half) RoPE. x [T, H, D]; cos, sin_signed [T, D] in x's dtype.

    rotate_half(x) * sin == roll(x, D/2) * cat(-sin, sin): one roll instead of
    slice + negate + cat, same values (negation is exact).
    """
    rolled = torch.roll(x, x.shape[-1] // 2, dims=-1)
    return x * cos[:, None, :] + rolled * sin_signed[:, None, :]


class Qwen3Model:
    """Fused weights + forward. Built from a transformers-named state dict."""

    def __init__(
        self,
        cfg: Qwen3Config,
        state: dict[str, torch.Tensor],
        *,
        dtype: torch.dtype,
        device: torch.device,
        ops: BoundOps,
        max_positions: int | None = None,
        batch_invariant: bool = False,
    ) -> None:
        self.cfg = cfg
        self.dtype = dtype
        self.device = device
        self.ops = ops
        self.scale = cfg.head_dim**-0.5
        # batch_invariant: every matmul, norm and attention through the pinned-tile Triton
        # kernels (triton/invariant.py), so a token's bits do not depend on its batch, its
        # chunk or whether its prefix came from the prefix cache
        self.batch_invariant = batch_invariant
        if batch_invariant:
            from ..triton import invariant

            assert ops.backends["paged"] == "triton", "the batch-invariant attention is the triton paged op's"

            self.linear, self.norm = invariant.linear, invariant.rms_norm
        else:
            self.linear, self.norm = F.linear, rms_norm

        def w(name: str) -> torch.Tensor:
            return state[name].to(device=device, dtype=dtype).contiguous()

        self.embed = w("model.embed_tokens.weight")
        if state["lm_head.weight"] is state["model.embed_tokens.weight"]:
            self.lm_head = self.embed
        else:
            self.lm_head = w("lm_head.weight")
        self.final_norm = w("model.norm.weight")
        self.layers: list[dict[str, torch.Tensor | None]] = []
        for i in range(cfg.num_hidden_layers):
            p = f"model.layers.{i}."
            # One matmul for q|k|v and one for gate|up: fewer, larger GEMMs.
            qkv = torch.cat([w(p + "self_attn.q_proj.weight"), w(p + "self_attn.k_proj.weight"),
                             w(p + "self_attn.v_proj.weight")], dim=0)
            qkv_bias = None
            if cfg.attention_bias:
                qkv_bias = torch.cat([w(p + "self_attn.q_proj.bias"), w(p + "self_attn.k_proj.bias"),
                                      w(p + "self_attn.v_proj.bias")], dim=0)
            gate_up = torch.cat([w(p + "mlp.gate_proj.weight"), w(p + "mlp.up_proj.weight")], dim=0)
            # q and k heads sit side by side in the qkv output: one norm call covers both
            qk_norm = torch.cat([w(p + "self_attn.q_norm.weight").expand(cfg.num_attention_heads, -1),
                                 w(p + "self_attn.k_norm.weight").expand(cfg.num_key_value_heads, -1)])
            self.layers.append({
                "input_norm": w(p + "input_layernorm.weight"),
                "qkv": qkv,
                "qkv_bias": qkv_bias,
                "qk_norm": qk_norm.contiguous(),
                "o": w(p + "self_attn.o_proj.weight"),
                "post_norm": w(p + "post_attention_layernorm.weight"),
                "gate_up": gate_up,
                "down": w(p + "mlp.down_proj.weight"),
            })

        # RoPE table, computed like transformers (fp32 angle = pos * inv_freq, then cast).
        n_pos = max_positions or cfg.max_position_embeddings
        D = cfg.head_dim
        inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, D, 2, dtype=torch.float, device=device) / D))
        pos = torch.arange(n_pos, dtype=torch.float, device=device)
        freqs = pos[:, None] * inv_freq[None, :]
        self.cos_table = torch.cat((freqs.cos(), freqs.cos()), dim=-1).to(dtype)
        self.sin_table = torch.cat((-freqs.sin(), freqs.sin()), dim=-1).to(dtype)
        self.max_positions = n_pos

    # ------------------------------------------------------------------ forward
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        cache,
    ) -> torch.Tensor:
        """input_ids/positions [T] -> final normed hidden states [T, hidden]; K/V go to and come
        from `cache` (a PagedKVCache; an fp8 one brings per-layer k/v scales).

        Attention calls the bound backend functions directly: the tensors are built
        here (views with a stride-1 last dim and 16-byte aligned rows), so the API's
        checks and layout fixes have nothing to do. batch_invariant: every kind of step
        attends through the one pinned paged launch (meta then carries block tables,
        context_lens and cu_seqlens for prefill and decode steps too)."""
        cfg, ops = self.cfg, self.ops
        linear, norm = self.linear, self.norm
        T = input_ids.shape[0]
        Hq, Hkv, D = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        q_size, kv_size = cfg.q_size, cfg.kv_size
        eps = cfg.rms_norm_eps
        cos = self.cos_table[positions]
        sin = self.sin_table[positions]

        h = self.embed[input_ids]
        for li, L in enumerate(self.layers):
            x = norm(h, L["input_norm"], eps)
            qkv = linear(x, L["qkv"], L["qkv_bias"])
            qk = qkv[:, :q_size + kv_size].view(T, Hq + Hkv, D)
            v = qkv[:, q_size + kv_size:].view(T, Hkv, D)
            # QK-norm (per head, before RoPE), then RoPE, for q and k heads at once
            qk = apply_rope(norm(qk, L["qk_norm"], eps), cos, sin)
            q, k = qk[:, :Hq], qk[:, Hq:]
            kc, vc = cache.k_caches[li], cache.v_caches[li]
            sc = ()
            if cache.is_fp8:
                if meta.calibrate_kv:
                    # first write of this layer: scales from this prompt's K/V amax per KV head, then fixed
                    cache.k_scales[li].copy_(_amax_scale(k))
                    cache.v_scales[li].copy_(_amax_scale(v))
                sc = (cache.k_scales[li], cache.v_scales[li])
            ops.write_kv_cache(k, v, kc, vc, meta.slot_mapping, *sc)
            if self.batch_invariant:
                o = ops.paged(q, kc, vc, meta.block_tables, meta.cu_seqlens, meta.context_lens,
                              meta.max_seqlen_q, True, self.scale, False, *sc, batch_invariant=True)
            elif meta.kind == "prefill":
                # No cached context: attend over the fresh K/V (already in the cache too).
                o = ops.prefill_varlen(q, k, v, meta.cu_seqlens, meta.cu_seqlens, meta.max_seqlen_q,
                                       meta.max_seqlen_q, True, self.scale, False)
            elif meta.kind == "paged":
                o = ops.paged(q, kc, vc, meta.block_tables, meta.cu_seqlens, meta.context_lens,
                              meta.max_seqlen_q, True, self.scale, False, *sc)
            else:
                o = ops.decode(q, kc, vc, meta.block_tables, meta.context_lens, self.scale, False, *sc)
            h = h + linear(o.reshape(T, q_size), L["o"])
            x = norm(h, L["post_norm"], eps)
            gate_up = linear(x, L["gate_up"])
            inter = gate_up.shape[-1] // 2
            h = h + linear(F.silu(gate_up[:, :inter]) * gate_up[:, inter:], L["down"])
        return norm(h, self.final_norm, eps)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.linear(hidden, self.lm_head)
