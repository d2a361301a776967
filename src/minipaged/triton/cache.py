"""Scatter new K/V tokens into the paged cache (one program per token).

With an fp8 (e4m3fn) cache the kernel quantises per KV head:
fp8(clamp(x / scale[h], -448, 448)), the exact bytes torch's own
`.to(torch.float8_e4m3fn)` gives for the clamped fp32 value. It writes those
bytes through a uint8 view of the cache and builds them with integer
operations (`_e4m3_bits`) instead of Triton's fp32 -> fp8e4nv cast: the
interpreter's cast rounds ties away from zero and truncates subnormals, so a
CPU test of the cast would not vouch for the GPU; the integer code is the same
on both. The division is tl.math.div_rn because a plain `/` on fp32 lowers to
an approximate divide on NVIDIA GPUs.
"""

from __future__ import annotations

import triton
import triton.language as tl

# fp32 bit patterns
_F32_MIN_NORMAL_E4M3 = tl.constexpr(121 << 23)  # 2**-6, the smallest normal e4m3 value
_F32_448 = tl.constexpr(0x43E00000)              # the largest finite e4m3 value
_F32_INF = tl.constexpr(0x7F800000)
_F32_2POW14 = tl.constexpr(141 << 23)            # 2**14: its fp32 ulp is 2**-9, the e4m3 subnormal step


@triton.jit
def _e4m3_bits(x, scale):
    """Byte of e4m3fn(clamp(x / scale, -448, 448)), round to nearest, ties to even.
    NaN gives 0x7F (sign kept where the division keeps it)."""
    y = tl.math.div_rn(x, scale)
    bits = y.to(tl.uint32, bitcast=True)
    sign = (bits >> 24) & 0x80
    mag = bits & 0x7FFFFFFF
    # below 2**-6: adding 2**14 makes fp32's own round-to-nearest-even round |y|
    # to a multiple of 2**-9; the low bits are then the e4m3 code (0..8, 8 being
    # the smallest normal)
    shifted = mag.to(tl.float32, bitcast=True) + 16384.0
    small = shifted.to(tl.uint32, bitcast=True) - _F32_2POW14
    # normal: rebias the exponent (127 -> 7) and drop 20 mantissa bits; adding
    # 0x7FFFF plus the kept lsb rounds half to even
    lsb = (mag >> 20) & 1
    normal = (mag - (120 << 23) + 0x7FFFF + lsb) >> 20
    code = tl.where(mag < _F32_MIN_NORMAL_E4M3, small, normal)
    code = tl.where(mag >= _F32_448, 0x7E, code)  # the clamp (448 and above, inf)
    code = tl.where(mag > _F32_INF, 0x7F, code)
    return (code | sign).to(tl.uint8)


@triton.jit
def _write_kv_kernel(
    K, V, K_cache, V_cache, slot_mapping, K_scale, V_scale,
    stride_kt, stride_kh,
    stride_vt, stride_vh,
    stride_kcblock, stride_kctok, stride_kchead,
    stride_vcblock, stride_vctok, stride_vchead,
    num_kv_heads,
    PAGE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEADS_POW2: tl.constexpr,
    KV_FP8: tl.constexpr,
):
    tok = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping + tok).to(tl.int64)
    # a negative slot (padding token) writes nothing; clamp keeps the address math sane
    offs_h = tl.arange(0, HEADS_POW2)
    offs_d = tl.arange(0, HEAD_DIM)
    # built as a tensor: the interpreter rejects a scalar bool in a mask expression
    keep = (offs_d[None, :] * 0 + slot) >= 0
    slot = tl.maximum(slot, 0)
    block = slot // PAGE
    offset = slot % PAGE
    head_ok = offs_h < num_kv_heads
    mask = head_ok[:, None] & keep
    k = tl.load(K + tok * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :], mask=mask)
    v = tl.load(V + tok * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :], mask=mask)
    if KV_FP8:
        # K_cache / V_cache are uint8 views of the fp8 caches
        k_s = tl.load(K_scale + offs_h, mask=head_ok, other=1.0)
        v_s = tl.load(V_scale + offs_h, mask=head_ok, other=1.0)
        k_out = _e4m3_bits(k.to(tl.float32), k_s[:, None])
        v_out = _e4m3_bits(v.to(tl.float32), v_s[:, None])
    else:
        k_out = k.to(K_cache.dtype.element_ty)
        v_out = v.to(V_cache.dtype.element_ty)
    tl.store(K_cache + block * stride_kcblock + offset * stride_kctok
             + offs_h[:, None] * stride_kchead + offs_d[None, :], k_out, mask=mask)
    tl.store(V_cache + block * stride_vcblock + offset * stride_vctok
             + offs_h[:, None] * stride_vchead + offs_d[None, :], v_out, mask=mask)
