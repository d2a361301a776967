"""Batch-invariant kernels (minipaged.triton.invariant) and the engine's batch_invariant mode.

The property under test is bitwise: a row computed alone, at another offset of its tile, in
a larger batch, in another chunk of its prompt or with its prefix read from the prefix cache
has exactly the same bits. Each kernel is also checked against an fp64 oracle written here,
within twice what the same computation gets in the same low precision.

On CPU the kernels run in the Triton interpreter, whose tl.dot calls BLAS: OpenBLAS's
result for a row depends on where the row sits in its micro-kernel (the GPU's MMA
instructions do not), so the interpreter's dot is swapped for a row-wise einsum here, and
these tests check the kernels' design (pinned tiles, no splits, uniform masking) rather
than OpenBLAS. The `gpu` tests check the real instructions.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from minipaged import registry
from minipaged.testing import assert_close, cu_seqlens, gather_kv, paged_kv, paged_ref, randn

pytest.importorskip("triton")

ON_GPU = torch.cuda.is_available()
DEV = "cuda" if ON_GPU else "cpu"
gpu = pytest.mark.gpu
CPU_DTYPES = (torch.float32, torch.float16)


@pytest.fixture(autouse=True, scope="module")
def _row_invariant_interpreter_dot():
    if ON_GPU:
        yield
        return
    from triton.runtime import interpreter

    builder = interpreter.InterpreterBuilder
    blas_dot = builder.create_dot

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        if getattr(a.dtype, "primitive_bitwidth", 16) == 8 or getattr(b.dtype, "primitive_bitwidth", 16) == 8:
            return blas_dot(self, a, b, d, input_precision, max_num_imprecise_acc)
        acc = d.data.dtype
        out = np.einsum("...ik,...kj->...ij", a.data.astype(acc), b.data.astype(acc), optimize=False)
        return interpreter.TensorHandle(out + d.data, d.dtype.scalar)

    builder.create_dot = create_dot
    try:
        yield
    finally:
        builder.create_dot = blas_dot


def _triton_or_skip():
    ok, why = registry.all_backends()["triton"].is_available(DEV)
    if not ok:
        pytest.skip(why)


def _invariant():
    _triton_or_skip()
    from minipaged.triton import invariant

    return invariant


def _gen(seed):
    return torch.Generator().manual_seed(seed)


# ---------------------------------------------------------------------------- linear


def _linear_case(M, N, K, dtype, bias, seed=0):
    g = _gen(seed)
    x = randn((M, K), dtype, DEV, g)
    w = randn((N, K), dtype, DEV, g) * K ** -0.5
    b = randn((N,), dtype, DEV, g) if bias else None
    return x, w.to(dtype), b


def _linear_oracle(x, w, b):
    y = x.double() @ w.double().T
    return y + b.double() if b is not None else y


def _linear_lowp(x, w, b):
    # the same product rounded at the same places (fp32 accumulation, one rounding at the end)
    y = x.float() @ w.float().T
    return (y + b.float() if b is not None else y).to(x.dtype)


def _check_rows(lin, x, w, b, cuts):
    full = lin(x, w, b)
    for lo, hi in cuts:
        part = lin(x[lo:hi], w, b)
        assert torch.equal(part, full[lo:hi]), f"rows {lo}:{hi} alone differ from the same rows in M={len(x)}"
    return full


@pytest.mark.parametrize("dtype", CPU_DTYPES)
@pytest.mark.parametrize("bias", [False, True])
def test_linear_rows_do_not_depend_on_the_batch(dtype, bias):
    inv = _invariant()
    # K, N not multiples of the tiles (the interpreter's tile is 16 x 128 x 64: two N tiles, two
    # K steps, each with a masked tail); M = 67 so that every slice starts at another tile offset
    x, w, b = _linear_case(67, 197, 80, dtype, bias)
    full = _check_rows(inv.linear, x, w, b, [(0, 1), (5, 6), (3, 22), (17, 67), (66, 67), (0, 33)])
    assert_close(full, _linear_oracle(x, w, b), _linear_lowp(x, w, b), "vs fp64")
    # a row whose neighbours change keeps its bits
    x2 = x.clone()
    x2[1:] = randn(x2[1:].shape, dtype, DEV, _gen(9))
    assert torch.equal(inv.linear(x2, w, b)[0], full[0])


def test_linear_strided_rows_and_empty():
    inv = _invariant()
    x, w, _ = _linear_case(20, 48, 64, torch.float32, False)
    wide = torch.cat([x, x[:, :16]], dim=1)  # rows with stride 80: a view, not a copy
    assert torch.equal(inv.linear(wide[:, :64], w), inv.linear(x, w))
    assert inv.linear(x[:0], w).shape == (0, 48)


# ---------------------------------------------------------------------------- rms_norm


def _norm_oracle(x, w, eps):
    x64 = x.double()
    return x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + eps) * w.double()


def _norm_lowp(x, w, eps):
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * w.float()).to(x.dtype)


@pytest.mark.parametrize("dtype", CPU_DTYPES)
def test_rms_norm_rows_do_not_depend_on_the_batch(dtype):
    inv = _invariant()
    g = _gen(1)
    eps = 1e-6
    # [T, D] with weight [D]
    x = randn((37, 96), dtype, DEV, g) * 3
    w = randn((96,), dtype, DEV, g)
    y = inv.rms_norm(x, w, eps)
    assert_close(y, _norm_oracle(x, w, eps), _norm_lowp(x, w, eps), "vs fp64")
    for lo, hi in [(0, 1), (3, 4), (5, 29), (36, 37)]:
        assert torch.equal(inv.rms_norm(x[lo:hi], w, eps), y[lo:hi])
    # per-head weights over a strided [T, H, D] view (the engine's q|k heads inside the qkv output)
    T, H, D = 23, 6, 64
    qkv = randn((T, (H + 2) * D), dtype, DEV, g)
    heads = qkv[:, : H * D].view(T, H, D)
    wh = randn((H, D), dtype, DEV, g)
    yh = inv.rms_norm(heads, wh, eps)
    assert yh.shape == (T, H, D) and yh.is_contiguous()
    assert_close(yh, _norm_oracle(heads, wh, eps), _norm_lowp(heads, wh, eps), "vs fp64")
    for lo, hi in [(0, 1), (7, 8), (2, 19)]:
        assert torch.equal(inv.rms_norm(heads[lo:hi], wh, eps), yh[lo:hi])
    assert inv.rms_norm(heads[:0], wh, eps).shape == (0, H, D)


# ---------------------------------------------------------------------------- paged attention


def _paged(q, kv, tables, cu, ctx, max_q, scale):
    from minipaged.triton import ops

    return ops.paged(q, kv.k_cache, kv.v_cache, tables, cu, ctx, max_q, True, scale, batch_invariant=True)


def _invariance_case(L, hq, hkv, D, page, dtype, cuts, seed=0):
    """One sequence of L tokens whose K/V sit in a NaN-poisoned paged cache, attended (a) as
    one whole prompt, (b) in chunks cut at `cuts` (each chunk over everything before it),
    (c) one row at a time (decodes), (d) inside a batch with two other sequences, its
    pages elsewhere and at another page size. -> rows of (a), after checking that (b),
    (c), (d) have the same bits and (a) is within the bound of the fp64 oracle."""
    _triton_or_skip()
    g = _gen(seed)
    scale = D ** -0.5
    kv = paged_kv([L], hkv, D, page, dtype, DEV, gen=g, spare_blocks=3)
    q = randn((L, hq, D), dtype, DEV, g)
    whole = _paged(q, kv, kv.block_tables, cu_seqlens([L], DEV), kv.context_lens, L, scale)

    keys, vals = gather_kv(kv.k_cache, kv.v_cache, kv.block_tables, kv.context_lens)
    truth = paged_ref(q, keys, vals, cu_seqlens([L], DEV), causal=True, scale=scale)[0]
    lowp = paged_ref(q, keys, vals, cu_seqlens([L], DEV), causal=True, scale=scale, lowp=True)[0]
    assert_close(whole, truth, lowp, "invariant paged vs fp64")

    bounds = [0] + sorted(cuts) + [L]
    for lo, hi in zip(bounds, bounds[1:]):
        if lo == hi:
            continue
        part = _paged(q[lo:hi], kv, kv.block_tables, cu_seqlens([hi - lo], DEV), torch.tensor([hi], dtype=torch.int32,
                      device=DEV), hi - lo, scale)
        assert torch.equal(part, whole[lo:hi]), f"chunk [{lo}, {hi}) differs from the whole prompt's rows"
    for i in sorted({0, 1, page - 1, page, L // 2, L - 1} & set(range(L))):
        one = _paged(q[i:i + 1], kv, kv.block_tables, cu_seqlens([1], DEV), torch.tensor([i + 1], dtype=torch.int32,
                     device=DEV), 1, scale)
        assert torch.equal(one[0], whole[i]), f"row {i} as a decode differs"

    # (d): other sequences before and after it, a page size twice as large, new page order
    others = [randn((n, hkv, D), dtype, DEV, g) for n in (5, 2 * page + 3)]
    page2 = page * 2 if page < 256 else page // 2
    big = paged_kv([5, L, 2 * page + 3], hkv, D, page2, dtype, DEV, gen=g, spare_blocks=2,
                   keys=[others[0], keys[0], others[1]], vals=[others[0], vals[0], others[1]])
    q_lens = [5, L - cuts[0], 1] if cuts else [5, L, 1]
    qb = torch.cat([randn((5, hq, D), dtype, DEV, g), q[L - q_lens[1]:], randn((1, hq, D), dtype, DEV, g)])
    ob = _paged(qb, big, big.block_tables, cu_seqlens(q_lens, DEV), big.context_lens, max(q_lens), scale)
    assert torch.equal(ob[5:5 + q_lens[1]], whole[L - q_lens[1]:]), "the rows differ inside a batch"
    return whole


@pytest.mark.parametrize("dtype", CPU_DTYPES)
@pytest.mark.parametrize("hq,hkv,D,page", [(4, 2, 64, 4), (2, 2, 32, 1), (8, 1, 64, 16)])
def test_paged_rows_do_not_depend_on_chunks_or_batch(dtype, hq, hkv, D, page):
    # a chunk starting at lo has context_len - q_len = lo: starts at every residue of the
    # interpreter's 16-key tile (2, 4, .., 14 and 17, 19, .., 31 besides 0), and one at 44
    cuts = sorted({r + 16 * (r % 2) for r in range(1, 16)} | {44})
    assert sorted({c % 16 for c in [0] + cuts}) == list(range(16))
    _invariance_case(45, hq, hkv, D, page, dtype, cuts=cuts)


@pytest.mark.parametrize("dtype", CPU_DTYPES)
def test_paged_invariant_split_and_unsplit_launches_agree(dtype, monkeypatch):
    """The launcher may run a batch's key segments as separate programs (then folded by
    invariant_reduce) or in one program per tile: forced each way, every row (a chunk, a short
    run, decodes; a sequence with no queries and no context among them) has the same bits,
    outputs and lse, and the split launch really splits."""
    _triton_or_skip()
    from minipaged.triton import configs, ops

    g = _gen(7)
    hq, hkv, D, page = 4, 2, 64, 4
    kv = paged_kv([70, 33, 0, 1, 9], hkv, D, page, dtype, DEV, gen=g, spare_blocks=2)
    q_lens = [70, 5, 0, 1, 1]
    q = randn((sum(q_lens), hq, D), dtype, DEV, g)
    args = (q, kv.k_cache, kv.v_cache, kv.block_tables, cu_seqlens(q_lens, DEV), kv.context_lens, max(q_lens), True,
            D ** -0.5)
    seen = []
    real = configs.invariant_paged_splits

    def forced(n):
        def splits(*a):
            seen.append(real(*a) if n is None else n)
            return seen[-1]
        return splits

    outs = {}
    segments = -(-kv.block_tables.shape[1] * page // (configs.invariant_segment_tiles(q.device) * 16))
    assert segments >= 3
    for n in (1, segments):
        monkeypatch.setattr(configs, "invariant_paged_splits", forced(n))
        outs[n] = ops.paged(*args, batch_invariant=True, return_lse=True)
    assert seen == [1, segments]
    assert torch.equal(outs[1][0], outs[segments][0]) and torch.equal(outs[1][1], outs[segments][1])
    keys, vals = gather_kv(kv.k_cache, kv.v_cache, kv.block_tables, kv.context_lens)
    truth, truth_lse = paged_ref(q, keys, vals, cu_seqlens(q_lens, DEV), causal=True, scale=D ** -0.5)
    lowp = paged_ref(q, keys, vals, cu_seqlens(q_lens, DEV), causal=True, scale=D ** -0.5, lowp=True)[0]
    assert_close(outs[1][0], truth, lowp, "invariant paged (lse) vs fp64", lse=outs[1][1], truth_lse=truth_lse)


def test_paged_invariant_tile_is_pinned(monkeypatch):
    """The pinned tile ignores tuning overrides and the heuristics' inputs (q length, batch)."""
    from minipaged.triton import configs

    a = configs.invariant_paged_config(128, 2, torch.device(DEV))
    monkeypatch.setitem(configs.OVERRIDES, "paged", (128, 128, 8, 3))
    assert configs.invariant_paged_config(128, 2, torch.device(DEV)) == a


# ---------------------------------------------------------------------------- engine

VOCAB = 500


@pytest.fixture(scope="module")
def tiny(serving_ckpt):
    folder, hf = serving_ckpt
    assert hf.config.vocab_size == VOCAB
    g = _gen(1)
    system = torch.randint(0, VOCAB, (26,), generator=g).tolist()  # 6 full blocks of 4 + 2
    prompts = [system + torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in (3, 9, 5)]
    return folder, hf, prompts


def _recording_run(eng, prompts, new):
    """generate(), keeping every logits row the engine sampled from, by (request, position)."""
    rows = {}
    run = eng.runner.run

    def record(plan, **kw):
        out = run(plan, **kw)
        for seq, row in zip(plan.sampling, out):
            rows[(seq.index, len(seq.token_ids))] = row.clone()
        return out

    eng.runner.run = record
    try:
        out, st = eng.generate(prompts, max_new_tokens=new, return_stats=True)
    finally:
        eng.runner.run = run
    return out, rows, st


def _differing(a, b):
    assert a.keys() == b.keys()
    return sum(not torch.equal(a[k], b[k]) for k in a)


def test_engine_batch_invariant_bits_do_not_depend_on_caching_chunks_or_batch(tiny):
    """Caching on (the shared prefix hit), off, prompts cut mid-block by a 7-token budget, one
    sequence at a time with preemption: every logits row sampled is bit-for-bit the same, and
    the tokens are transformers' greedy ones. The same comparison on the default kernels
    finds rows that differ, so it can fail."""
    from minipaged.engine import Engine

    _triton_or_skip()
    torch.set_num_threads(1)
    folder, hf, prompts = tiny
    dtype = torch.float32

    def run(invariant, **kw):
        eng = Engine(folder, device=DEV, dtype=dtype, backend="triton", block_size=4,
                     batch_invariant=invariant, **{"num_blocks": 96, **kw})
        return _recording_run(eng, prompts, 3)

    base = run(True, enable_prefix_caching=True, max_num_batched_tokens=64)
    assert base[2].prefix_hit_tokens > 0
    variants = {
        "caching off, 7-token budget": run(True, enable_prefix_caching=False, max_num_batched_tokens=7),
        "one sequence at a time, 11-token budget": run(True, max_num_batched_tokens=11, max_num_seqs=1),
        "preempted (few blocks)": run(True, num_blocks=25, enable_prefix_caching=False),
    }
    for what, (out, rows, st) in variants.items():
        assert out == base[0], what
        assert _differing(base[1], rows) == 0, f"{what}: logits bits differ"
    assert variants["preempted (few blocks)"][2].preemptions > 0

    with torch.inference_mode():
        for p, got in zip(prompts, base[0]):
            ids = torch.tensor([p])
            ref = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=3, do_sample=False,
                              pad_token_id=0)[0, len(p):].tolist()
            assert got == ref

    default_on = run(False, enable_prefix_caching=True, max_num_batched_tokens=64)
    default_off = run(False, enable_prefix_caching=False, max_num_batched_tokens=7)
    assert _differing(default_on[1], default_off[1]) > 0, "control: the default kernels should differ here"


def test_engine_batch_invariant_argument_errors(tiny):
    from minipaged.engine import Engine

    folder = tiny[0]
    with pytest.raises(TypeError, match="batch_invariant"):
        Engine(folder, device="cpu", dtype=torch.float32, batch_invariant=1)
    for backend in ("torch", "cuda"):
        with pytest.raises(ValueError, match="batch_invariant=True runs on the triton"):
            Engine(folder, device="cpu", dtype=torch.float32, backend=backend, batch_invariant=True)
    _triton_or_skip()
    with pytest.raises(ValueError, match="needs k_scale/v_scale tensors in the checkpoint"):
        Engine(folder, device=DEV, dtype=torch.float16, kv_cache_dtype="fp8", batch_invariant=True, num_blocks=8)


def test_generate_cli_batch_invariant_errors(capsys):
    from minipaged.cli import main

    assert main(["generate", "--batch-invariant", "--backend", "torch", "--device", "cpu"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["error: --batch-invariant runs on the triton kernels; got --backend torch"]


# ---------------------------------------------------------------------------- GPU


@gpu
@pytest.mark.parametrize("N,K", [(4096, 1024), (1024, 2048), (6144, 1024), (1024, 3072)])
def test_linear_rows_invariant_gpu(N, K):
    inv = _invariant()
    for dtype in (torch.bfloat16, torch.float16):
        x, w, _ = _linear_case(2100, N, K, dtype, False)
        full = _check_rows(inv.linear, x, w, None, [(0, 1), (1, 2), (3, 67), (64, 128), (100, 2100), (2099, 2100)])
        assert_close(full, _linear_oracle(x, w, None), _linear_lowp(x, w, None), "vs fp64")


@gpu
def test_rms_norm_rows_invariant_gpu():
    inv = _invariant()
    g = _gen(3)
    for dtype in (torch.bfloat16, torch.float16):
        x = randn((3000, 1024), dtype, DEV, g)
        w = randn((1024,), dtype, DEV, g)
        y = inv.rms_norm(x, w, 1e-6)
        assert_close(y, _norm_oracle(x, w, 1e-6), _norm_lowp(x, w, 1e-6), "vs fp64")
        for lo, hi in [(0, 1), (5, 6), (7, 300), (2999, 3000)]:
            assert torch.equal(inv.rms_norm(x[lo:hi], w, 1e-6), y[lo:hi])
        qkv = randn((700, 32 * 128), dtype, DEV, g)
        heads = qkv[:, : 24 * 128].view(700, 24, 128)
        wh = randn((24, 128), dtype, DEV, g)
        yh = inv.rms_norm(heads, wh, 1e-6)
        assert_close(yh, _norm_oracle(heads, wh, 1e-6), _norm_lowp(heads, wh, 1e-6), "vs fp64")
        for lo, hi in [(0, 1), (9, 10), (3, 500)]:
            assert torch.equal(inv.rms_norm(heads[lo:hi], wh, 1e-6), yh[lo:hi])


@gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("hq,hkv,D,page", [(16, 8, 128, 16), (32, 8, 128, 1), (16, 16, 64, 256), (8, 1, 128, 64)])
def test_paged_rows_invariant_gpu(dtype, hq, hkv, D, page):
    # chunk cuts at every residue of the 64-key tile (cut 64 k + r for r = 0..63), past one and several tiles
    L = 1500
    cuts = sorted({64 * (r % 22) + r for r in range(1, 64)} | {1023, 1024, 1499})
    _invariance_case(L, hq, hkv, D, page, dtype, cuts=cuts, seed=4)


@gpu
def test_engine_batch_invariant_gpu():
    """Qwen3-0.6B heads and widths (4 layers, random bf16 weights): shared-prefix requests with
    caching on and off, a budget that cuts prompts mid-block, one sequence at a time, CUDA
    graphs and eager decode: the logits rows sampled are bit-for-bit the same."""
    from minipaged.engine import Engine
    from minipaged.engine.config import qwen3_0_6b_config

    cfg = qwen3_0_6b_config()
    cfg.num_hidden_layers = 4
    g = _gen(5)
    system = torch.randint(0, cfg.vocab_size, (600,), generator=g).tolist()
    prompts = [system + torch.randint(0, cfg.vocab_size, (n,), generator=g).tolist() for n in (17, 97, 130, 1)]

    def run(**kw):
        eng = Engine(cfg, device="cuda", dtype=torch.bfloat16, batch_invariant=True, max_model_len=1024,
                     num_blocks=400, **kw)
        return _recording_run(eng, prompts, 24)

    base = run(enable_prefix_caching=True)
    assert base[2].prefix_hit_tokens > 0 and base[2].cuda_graph
    for what, kw in {"caching off, 203-token budget": dict(enable_prefix_caching=False, max_num_batched_tokens=203),
                     "one at a time": dict(max_num_seqs=1, max_num_batched_tokens=512),
                     "eager decode": dict(cuda_graph=False)}.items():
        out, rows, _ = run(**kw)
        assert out == base[0], what
        assert _differing(base[1], rows) == 0, f"{what}: logits bits differ"

    # sampling: one RNG per request over bit-identical logits draws the same tokens
    sampled = []
    for kw in (dict(enable_prefix_caching=True), dict(enable_prefix_caching=False, max_num_batched_tokens=203)):
        eng = Engine(cfg, device="cuda", dtype=torch.bfloat16, batch_invariant=True, max_model_len=1024,
                     num_blocks=400, **kw)
        sampled.append(eng.generate(prompts, max_new_tokens=24, temperature=0.8, top_p=0.9, seed=11))
    assert sampled[0] == sampled[1]


def test_generate_cli_batch_invariant_runs(tiny, capsys):
    """`minipaged generate --batch-invariant` end to end on the tiny checkpoint: the engine it
    builds says batch_invariant, and its greedy tokens are the same with and without
    --no-prefix-caching and a budget that cuts the prompts (printed token ids compared)."""
    from minipaged.engine import cli

    _triton_or_skip()
    outs = []
    for extra in ([], ["--no-prefix-caching", "--max-num-batched-tokens", "5"]):
        rc = cli.main(["--model", tiny[0], "--batch", "2", "--prompt-len", "9", "--max-new-tokens", "3",
                       "--device", DEV, "--dtype", "float32", "--batch-invariant", *extra])
        cap = capsys.readouterr()
        assert rc == 0, cap.err
        assert "batch_invariant" in cap.err and "backend=triton" in cap.err
        outs.append([line for line in cap.out.splitlines() if "output tokens" in line])
    assert outs[0] and outs[0] == outs[1]
