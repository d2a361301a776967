"""Batch-invariant kernels: a row's output bits depend on that row's inputs only.

Serving reorders the same arithmetic all the time: a token is computed in a batch of 1 or of
64, inside an 8k-token prefill step or as a decode, with its prefix computed in the same
step or read back from the prefix cache. Default kernels pick their algorithm from the
batch (cuBLAS chooses tiles and split-K from M, torch's reductions split a row over several
blocks when there are few rows, the attention kernels choose tiles and KV splits from the
batch), and each choice changes the order of a floating-point sum, so the same token gets
different last bits and, after a few layers and a near-tie, a different greedy pick.

The kernels here remove that freedom:
- `linear`: one tile shape per (device, dtype), never chosen from M; no split-K; the row
  count is not specialised on, so a batch of 1 and one of 8192 run the same machine code
  and every output element is reduced over K in the same order.
- `rms_norm`: a fixed number of rows per program, each row reduced in registers by the
  same instructions wherever it sits in its tile.
- attention: `ops.paged(..., batch_invariant=True)`: one pinned tile for every query length
  (decode, chunk, whole prompt), keys in segments cut at fixed positions and folded in
  order (run as separate programs for small batches, in one program otherwise: the same
  bits), and every key tile through the masked online-softmax step, so whether a tile
  counts as "fully visible" (which depends on the other rows of the query tile) never
  changes a row's arithmetic (see paged._invariant_tile).
Element-wise ops (RoPE, SiLU, residual adds) and gathers are invariant already.

The engine's `batch_invariant=True` runs every matmul, norm and attention of its forward
through these, at some speed cost (bench/bench_serving.py measures it).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import configs
from .launch import call_triton
from .ops import _device_scope, _dot_precision


@triton.jit(do_not_specialize=["M"])
def _linear_kernel(
    X, W, Bias, Y,
    M, N, K,
    stride_xm, stride_wn, stride_ym,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """Y [M, N] = X [M, K] @ W [N, K]^T (+ Bias [N]), fp32 accumulation. Programs walk the
    output in groups of GROUP_M row tiles (weight tiles reused from L2); which program
    computes a tile never changes how it is computed."""
    pid = tl.program_id(0)
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(N, BLOCK_N)
    per_group = GROUP_M * num_n
    first_m = pid // per_group * GROUP_M
    rows_in_group = tl.minimum(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % rows_in_group
    pid_n = (pid % per_group) // rows_in_group

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_ok = offs_m < M
    n_ok = offs_n < N
    x_ptrs = X + offs_m[:, None].to(tl.int64) * stride_xm + offs_k[None, :]
    w_ptrs = W + offs_n[:, None].to(tl.int64) * stride_wn + offs_k[None, :]
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k in range(0, K, BLOCK_K):
        k_ok = offs_k < K - k
        x = tl.load(x_ptrs, mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_ptrs, mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        acc = tl.dot(x, tl.trans(w), acc, input_precision=DOT_PRECISION)
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    if HAS_BIAS:
        acc += tl.load(Bias + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    y_ptrs = Y + offs_m[:, None].to(tl.int64) * stride_ym + offs_n[None, :]
    tl.store(y_ptrs, acc.to(Y.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


@triton.jit(do_not_specialize=["num_rows"])
def _rms_norm_kernel(
    X, W, Y,
    num_rows, heads, dim, eps,
    stride_xt, stride_xh,
    W_ROWS: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """Rows r = t * heads + h of X (token stride stride_xt, head stride stride_xh, unit
    column stride) to Y [num_rows, dim] contiguous: x / sqrt(mean(x^2) + eps) * W[r % W_ROWS],
    statistics and product in fp32, one rounding to Y's dtype."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.arange(0, BLOCK_D)
    row_ok = rows < num_rows
    col_ok = cols < dim
    ok = row_ok[:, None] & col_ok[None, :]
    t = (rows // heads).to(tl.int64)
    h = (rows % heads).to(tl.int64)
    x = tl.load(X + (t * stride_xt + h * stride_xh)[:, None] + cols[None, :], mask=ok, other=0.0).to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, 1) / dim + eps)
    w_row = (rows % W_ROWS).to(tl.int64)
    w = tl.load(W + (w_row * dim)[:, None] + cols[None, :], mask=ok, other=0.0).to(tl.float32)
    y = x * rstd[:, None] * w
    tl.store(Y + rows[:, None].to(tl.int64) * dim + cols[None, :], y.to(Y.dtype.element_ty), mask=ok)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear with batch-invariant rows: x [M, K] (unit column stride), weight [N, K]
    contiguous, bias [N] or None -> [M, N] in x's dtype. Row i of the result has the same
    bits whatever M is and whatever the other rows hold."""
    M, K = x.shape
    N = weight.shape[0]
    assert weight.shape == (N, K) and weight.is_contiguous(), "weight must be a contiguous [N, K]"
    assert weight.dtype == x.dtype and (bias is None or bias.shape == (N,))
    if x.stride(1) != 1:
        x = x.contiguous()
    y = torch.empty((M, N), dtype=x.dtype, device=x.device)
    if M == 0:
        return y
    cfg = configs.invariant_linear_config(x.dtype, x.device)
    grid = (triton.cdiv(M, cfg.block_m) * triton.cdiv(N, cfg.block_n),)
    with _device_scope(x):
        call_triton(_linear_kernel, grid, (
            x, weight, bias if bias is not None else weight, y,
            M, N, K,
            x.stride(0), weight.stride(0), y.stride(0),
        ), dict(
            HAS_BIAS=bias is not None,
            BLOCK_M=cfg.block_m,
            BLOCK_N=cfg.block_n,
            BLOCK_K=cfg.block_k,
            GROUP_M=8,
            DOT_PRECISION=_dot_precision(x.dtype),
            num_warps=cfg.num_warps,
            num_stages=cfg.num_stages,
        ))
    return y


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim with batch-invariant rows (the engine's model.rms_norm
    contract): x [T, D] with weight [D], or x [T, H, D] with weight [D] or per-head [H, D];
    x's last dim must have unit stride. -> a contiguous tensor of x's shape and dtype."""
    dim = x.shape[-1]
    assert x.stride(-1) == 1, "rms_norm needs a unit stride along the normalised dim"
    if x.dim() == 2:
        tokens, heads = x.shape[0], 1
        stride_t, stride_h = x.stride(0), 0
    else:
        assert x.dim() == 3
        tokens, heads = x.shape[0], x.shape[1]
        stride_t, stride_h = x.stride(0), x.stride(1)
    w_rows = 1 if weight.dim() == 1 else weight.shape[0]
    assert weight.shape[-1] == dim and weight.is_contiguous() and (w_rows == 1 or w_rows == heads)
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    num_rows = tokens * heads
    if num_rows == 0:
        return y
    block_d = triton.next_power_of_2(dim)
    block_r = configs.invariant_norm_rows(block_d, x.device)
    with _device_scope(x):
        call_triton(_rms_norm_kernel, (triton.cdiv(num_rows, block_r),), (
            x, weight, y,
            num_rows, heads, dim, float(eps),
            stride_t, stride_h,
        ), dict(
            W_ROWS=w_rows,
            BLOCK_R=block_r,
            BLOCK_D=block_d,
            num_warps=4,
        ))
    return y

