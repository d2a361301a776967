"""attn_implementation="minipaged" in transformers' Qwen3 vs transformers' eager attention.

The article's integration pattern (section 20): run every layer of a Qwen3
model once through transformers' eager attention and once through minipaged,
compare the logits (max / mean abs error, relative L2, last-token cosine,
top-1 agreement) and prove with a counter that every attention layer really
went through minipaged. On top: padded batches against unpadded per-sequence
runs, greedy generate() through transformers' DynamicCache (decode = Nq 1 < Nk),
non-causal attention, packed sequences and hand-made 4D masks.

CPU tests run in fp32 on every CPU backend available (torch; triton under
TRITON_INTERPRET=1). The GPU test runs the real Qwen3-0.6B shape in bf16.
"""

from __future__ import annotations

import copy
import functools
import math

import pytest
import torch

import minipaged as mp

transformers = pytest.importorskip("transformers")
from transformers import Qwen3Config, Qwen3ForCausalLM  # noqa: E402

from minipaged.integrations import transformers as mpt  # noqa: E402
import oracle  # noqa: E402

IMPL = mpt.register()

CPU_BACKENDS = [name for name, (ok, _why) in mp.available_backends("cpu").items() if ok]
# The Triton interpreter costs ~0.5 s per kernel call even for a decode step, so
# on CPU the triton runs use 2 layers and shorter sequences than torch's.
SLOW_ON_CPU = {"triton"}


def num_layers_for(backend: str) -> int:
    return 2 if backend in SLOW_ON_CPU else 3

# (num_attention_heads, num_key_value_heads, head_dim): GQA 2:1 and 4:1, both head dims
SHAPES = [(4, 2, 64), (8, 2, 128)]
VOCAB = 512


# --------------------------------------------------------------------------- helpers


@functools.lru_cache(maxsize=None)
def tiny_qwen3(num_heads: int, num_kv_heads: int, head_dim: int, num_layers: int = 3) -> Qwen3ForCausalLM:
    """A small random fp32 Qwen3 (QK-norm, RoPE, GQA, tied embeddings as in 0.6B).

    initializer_range 0.1 (not 0.02) spreads the logits, so that top-1 is not
    decided by near-ties at the 1e-6 level of fp32 summation-order noise.
    """
    torch.manual_seed(1234 + num_heads * 10 + head_dim)
    cfg = Qwen3Config(
        vocab_size=VOCAB,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        head_dim=head_dim,
        max_position_embeddings=512,
        rope_theta=1_000_000.0,
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
        initializer_range=0.1,
        attention_dropout=0.0,
    )
    model = Qwen3ForCausalLM(cfg).eval()
    return model


def forward_logits(model, impl: str, input_ids, **kwargs) -> torch.Tensor:
    model.set_attn_implementation(impl)
    with torch.no_grad():
        return model(input_ids=input_ids, **kwargs).logits.float()


def logit_metrics(ref: torch.Tensor, out: torch.Tensor, last_index=None) -> dict:
    """ref/out [B, N, V] (or [T, V]); last_index [B]: each sequence's last real position."""
    ref, out = ref.double(), out.double()
    diff = (out - ref).abs()
    if last_index is None:
        last_ref, last_out = ref[..., -1, :], out[..., -1, :]
    else:
        rows = torch.arange(ref.shape[0])
        last_ref, last_out = ref[rows, last_index], out[rows, last_index]
    cos = torch.nn.functional.cosine_similarity(last_ref.reshape(-1, ref.shape[-1]), last_out.reshape(-1, ref.shape[-1]), dim=-1)
    return {
        "max_abs": diff.max().item(),
        "mean_abs": diff.mean().item(),
        "rel_l2": ((out - ref).norm() / ref.norm()).item(),
        "last_token_cos_min": cos.min().item(),
        "top1_agree": (ref.argmax(-1) == out.argmax(-1)).double().mean().item(),
    }


def fmt(m: dict) -> str:
    return " ".join(f"{k}={v:.3g}" for k, v in m.items())


def assert_fp32_close(m: dict) -> None:
    # fp32 everywhere: the only difference is summation order in attention
    # (~1e-6 relative); 1e-4 leaves room for 3 layers of accumulation, not for a bug.
    assert m["max_abs"] < 1e-4, fmt(m)
    assert m["rel_l2"] < 1e-5, fmt(m)
    assert m["last_token_cos_min"] > 1 - 1e-8, fmt(m)
    assert m["top1_agree"] == 1.0, fmt(m)


def left_padded(seqs: list[torch.Tensor], pad_id: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    n = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), n), pad_id, dtype=torch.long)
    mask = torch.zeros(len(seqs), n, dtype=torch.long)
    for b, s in enumerate(seqs):
        ids[b, n - len(s) :] = s
        mask[b, n - len(s) :] = 1
    return ids, mask


def right_padded(seqs: list[torch.Tensor], pad_id: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    n = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), n), pad_id, dtype=torch.long)
    mask = torch.zeros(len(seqs), n, dtype=torch.long)
    for b, s in enumerate(seqs):
        ids[b, : len(s)] = s
        mask[b, : len(s)] = 1
    return ids, mask


def cache_kwarg(model) -> str:
    """transformers renamed forward's `past_key_values` to `cache` (5.2x); use what this version takes."""
    import inspect

    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def decode_step_logits(model, impl: str, ids, mask, nxt) -> torch.Tensor:
    """Prefill `ids` (padded per `mask`) into a fresh DynamicCache with attention
    `impl`, then one Nq=1 step on `nxt`; returns that step's fp32 logits."""
    from transformers import DynamicCache

    full_mask = torch.cat([mask, torch.ones_like(mask[:, :1])], 1)
    position_ids = (full_mask.cumsum(-1) - 1).clamp_min(0)
    model.set_attn_implementation(impl)
    cache = {cache_kwarg(model): DynamicCache(config=model.config)}
    with torch.no_grad():
        model(input_ids=ids, attention_mask=mask, position_ids=position_ids[:, :-1], use_cache=True, **cache)
        return model(
            input_ids=nxt, attention_mask=full_mask, position_ids=position_ids[:, -1:], use_cache=True, **cache
        ).logits.float()


def every_layer_once_per_forward(num_layers: int, forwards: int) -> dict:
    return {layer: forwards for layer in range(num_layers)}


# --------------------------------------------------------------------------- registration


def test_register_is_idempotent_and_validates_backend():
    first = transformers.AttentionInterface()[IMPL]
    assert mpt.register() == IMPL
    assert transformers.AttentionInterface()[IMPL] is first
    assert mpt.is_registered()
    with pytest.raises(ValueError, match="unknown backend"):
        mpt.register(backend="no-such-backend", name="minipaged-bad")
    name = mpt.register(backend="torch", name="minipaged-torch-test")
    assert transformers.AttentionInterface()[name].backend == "torch"
    assert mpt.register(backend="torch", name="minipaged-torch-test") == name


def test_backend_chosen_at_register_time_is_used():
    model = tiny_qwen3(4, 2, 64)
    ids = torch.randint(0, VOCAB, (1, 9), generator=torch.Generator().manual_seed(3))
    name = mpt.register(backend="torch", name="minipaged-torch-test")
    ref = forward_logits(model, "eager", ids)
    # a use_backend scope naming a backend that cannot run here must lose to register(backend=)
    unavailable = [n for n, (ok, _) in mp.available_backends("cpu").items() if not ok]
    mpt.reset_counts()
    if unavailable:
        with mp.use_backend(unavailable[0]):
            out = forward_logits(model, name, ids)
    else:  # pragma: no cover - every backend runs on CPU
        out = forward_logits(model, name, ids)
    assert_fp32_close(logit_metrics(ref, out))
    assert mpt.call_counts() == every_layer_once_per_forward(3, 1)


# --------------------------------------------------------------------------- full model, fp32, CPU


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", SHAPES)
def test_qwen3_logits_match_eager(backend, num_heads, num_kv_heads, head_dim):
    model = tiny_qwen3(num_heads, num_kv_heads, head_dim, num_layers_for(backend))
    num_layers = model.config.num_hidden_layers
    shape = (1, 19) if backend in SLOW_ON_CPU else (2, 37)
    ids = torch.randint(0, VOCAB, shape, generator=torch.Generator().manual_seed(0))
    ref = forward_logits(model, "eager", ids)
    mpt.reset_counts()
    with mp.use_backend(backend):
        out = forward_logits(model, IMPL, ids)
    m = logit_metrics(ref, out)
    print(f"\n[{backend} Hq={num_heads} Hkv={num_kv_heads} D={head_dim}] minipaged vs eager: {fmt(m)}")
    assert_fp32_close(m)
    # the counter proves every attention layer went through minipaged, once
    assert mpt.call_counts() == every_layer_once_per_forward(num_layers, 1)
    assert mpt.path_counts() == {"dense": num_layers}


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("padding", ["left", "right"])
def test_padded_batch_matches_unpadded_runs(backend, padding):
    model = tiny_qwen3(8, 2, 128, num_layers_for(backend))
    num_layers = model.config.num_hidden_layers
    gen = torch.Generator().manual_seed(1)
    lengths = [9, 4, 1] if backend in SLOW_ON_CPU else [23, 8, 15, 1]
    seqs = [torch.randint(1, VOCAB, (n,), generator=gen) for n in lengths]
    ids, mask = (left_padded if padding == "left" else right_padded)(seqs)
    mpt.reset_counts()
    with mp.use_backend(backend):
        out = forward_logits(model, IMPL, ids, attention_mask=mask)
    assert mpt.call_counts() == every_layer_once_per_forward(num_layers, 1)
    assert mpt.path_counts() == {"varlen": num_layers}, "padding must take the unpadded varlen path"
    assert torch.isfinite(out).all()
    n = ids.shape[1]
    for b, s in enumerate(seqs):
        ref = forward_logits(model, "eager", s[None])[0]
        valid = slice(n - len(s), n) if padding == "left" else slice(0, len(s))
        m = logit_metrics(ref[None], out[b, valid][None])
        print(f"\n[{backend} {padding} len={len(s)}] padded minipaged vs unpadded eager: {fmt(m)}")
        assert_fp32_close(m)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_generate_matches_eager_greedy(backend):
    """Decode through transformers' DynamicCache: every step after the first is Nq=1 < Nk."""
    model = tiny_qwen3(4, 2, 64, num_layers_for(backend))
    num_layers = model.config.num_hidden_layers
    gen = torch.Generator().manual_seed(2)
    slow = backend in SLOW_ON_CPU
    new_tokens = 3 if slow else 6
    seqs = [torch.randint(1, VOCAB, (n,), generator=gen) for n in ((5, 3, 9) if slow else (11, 5, 17))]
    ids, mask = left_padded(seqs)
    kwargs = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)

    def generate(impl, ids, mask):
        model.set_attn_implementation(impl)
        with torch.no_grad():
            return model.generate(input_ids=ids, attention_mask=mask, **kwargs)[:, ids.shape[1] :]

    ref = generate("eager", ids, mask)
    mpt.reset_counts()
    with mp.use_backend(backend):
        out = generate(IMPL, ids, mask)
    assert out.tolist() == ref.tolist()
    # one prefill + (new_tokens - 1) decode steps, each through every layer
    assert mpt.call_counts() == every_layer_once_per_forward(num_layers, new_tokens)
    assert mpt.path_counts() == {"varlen": num_layers * new_tokens}

    # unpadded: the dense path, whose decode steps rely on bottom-right causal alignment
    one = seqs[2][None]
    ref = generate("eager", one, torch.ones_like(one))
    mpt.reset_counts()
    with mp.use_backend(backend):
        out = generate(IMPL, one, torch.ones_like(one))
    assert out.tolist() == ref.tolist()
    assert mpt.path_counts() == {"dense": num_layers * new_tokens}


def test_generate_with_static_cache_matches_eager():
    """StaticCache: keys are the whole preallocated cache, the 2D mask covers only the
    tokens seen so far, so the unused tail must count as padding (varlen path)."""
    model = tiny_qwen3(4, 2, 64)
    gen = torch.Generator().manual_seed(9)
    seqs = [torch.randint(1, VOCAB, (n,), generator=gen) for n in (10, 4)]
    ids, mask = left_padded(seqs)
    kwargs = dict(max_new_tokens=5, min_new_tokens=5, do_sample=False, pad_token_id=0, cache_implementation="static")

    def generate(impl):
        model.set_attn_implementation(impl)
        with torch.no_grad():
            return model.generate(input_ids=ids, attention_mask=mask, **kwargs)[:, ids.shape[1] :]

    ref = generate("eager")
    mpt.reset_counts()
    out = generate(IMPL)
    assert out.tolist() == ref.tolist()
    assert mpt.call_counts() == every_layer_once_per_forward(model.config.num_hidden_layers, 5)
    assert mpt.path_counts() == {"varlen": model.config.num_hidden_layers * 5}


def test_static_cache_without_attention_mask_matches_eager():
    """No attention_mask at all: the StaticCache's unused slots are still keys handed to the
    attention function, and must not be attended (prefill, then one decode step)."""
    from transformers import StaticCache

    model = tiny_qwen3(4, 2, 64)
    gen = torch.Generator().manual_seed(13)
    ids = torch.randint(1, VOCAB, (2, 7), generator=gen)
    nxt = torch.randint(1, VOCAB, (2, 1), generator=gen)

    def run(impl):
        model.set_attn_implementation(impl)
        cache = {cache_kwarg(model): StaticCache(config=model.config, max_cache_len=24)}
        with torch.no_grad():
            prefill = model(input_ids=ids, use_cache=True, **cache).logits
            step = model(input_ids=nxt, use_cache=True, **cache).logits
        return torch.cat([prefill, step], 1).float()

    assert_fp32_close(logit_metrics(run("eager"), run(IMPL)))


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_decode_step_logits_match_eager(backend):
    """Prefill then one Nq=1 step with transformers' DynamicCache: compare the step's logits."""
    model = tiny_qwen3(8, 2, 128, num_layers_for(backend))
    gen = torch.Generator().manual_seed(5)
    seqs = [torch.randint(1, VOCAB, (n,), generator=gen) for n in ((9, 4) if backend in SLOW_ON_CPU else (19, 6))]
    ids, mask = left_padded(seqs)
    nxt = torch.randint(1, VOCAB, (2, 1), generator=gen)
    ref = decode_step_logits(model, "eager", ids, mask, nxt)
    with mp.use_backend(backend):
        out = decode_step_logits(model, IMPL, ids, mask, nxt)
    m = logit_metrics(ref, out)
    print(f"\n[{backend}] decode step (Nq=1) minipaged vs eager: {fmt(m)}")
    assert_fp32_close(m)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_non_causal_matches_eager(backend):
    """module.is_causal False (and config.is_causal False, so eager builds a full mask)."""
    base = tiny_qwen3(4, 2, 64, num_layers_for(backend))
    model = copy.deepcopy(base)
    model.config.is_causal = False
    for layer in model.model.layers:
        layer.self_attn.is_causal = False
    gen = torch.Generator().manual_seed(4)
    n = 11 if backend in SLOW_ON_CPU else 21
    ids = torch.randint(1, VOCAB, (2, n), generator=gen)
    ref = forward_logits(model, "eager", ids)
    causal_ref = forward_logits(base, "eager", ids)
    assert (ref - causal_ref).abs().max() > 1e-2, "the test must see a difference between causal and full"
    with mp.use_backend(backend):
        out = forward_logits(model, IMPL, ids)
    assert_fp32_close(logit_metrics(ref, out))

    seqs = [ids[0, :n], ids[1, : n // 2]]
    pids, pmask = right_padded(seqs)
    mpt.reset_counts()
    with mp.use_backend(backend):
        out = forward_logits(model, IMPL, pids, attention_mask=pmask)
    assert mpt.path_counts() == {"varlen": model.config.num_hidden_layers}
    for b, s in enumerate(seqs):
        ref = forward_logits(model, "eager", s[None])
        assert_fp32_close(logit_metrics(ref, out[b : b + 1, : len(s)]))


def test_packed_position_ids_match_separate_runs():
    """Padding-free packing (no mask, position_ids restart): each segment attends only to itself."""
    model = tiny_qwen3(4, 2, 64)
    gen = torch.Generator().manual_seed(6)
    seqs = [torch.randint(1, VOCAB, (n,), generator=gen) for n in (7, 12, 4)]
    ids = torch.cat(seqs)[None]
    position_ids = torch.cat([torch.arange(len(s)) for s in seqs])[None]
    mpt.reset_counts()
    out = forward_logits(model, IMPL, ids, position_ids=position_ids, use_cache=False)[0]
    assert mpt.path_counts() == {"varlen": model.config.num_hidden_layers}
    # eager (without a cache) builds the same block-diagonal mask from the position_ids
    eager = forward_logits(model, "eager", ids, position_ids=position_ids, use_cache=False)[0]
    assert_fp32_close(logit_metrics(eager[None], out[None]))
    start = 0
    for s in seqs:
        ref = forward_logits(model, "eager", s[None])
        assert_fp32_close(logit_metrics(ref, out[None, start : start + len(s)]))
        start += len(s)


def test_4d_mask_from_caller_is_honoured():
    """A caller-made 4D additive mask (causal + left padding) reaches the attention function as-is."""
    model = tiny_qwen3(4, 2, 64)
    gen = torch.Generator().manual_seed(7)
    seqs = [torch.randint(1, VOCAB, (n,), generator=gen) for n in (13, 6)]
    ids, mask = left_padded(seqs)
    n = ids.shape[1]
    allowed = mask.bool()[:, None, None, :] & torch.ones(n, n, dtype=torch.bool).tril()[None, None]
    additive = torch.zeros(allowed.shape).masked_fill(~allowed, torch.finfo(torch.float32).min)
    ref = forward_logits(model, "eager", ids, attention_mask=additive)
    for m4 in (additive, allowed):
        mpt.reset_counts()
        out = forward_logits(model, IMPL, ids, attention_mask=m4)
        assert mpt.path_counts() == {"varlen": model.config.num_hidden_layers}
        for b, s in enumerate(seqs):
            assert_fp32_close(logit_metrics(ref[b : b + 1, n - len(s) :], out[b : b + 1, n - len(s) :]))


# --------------------------------------------------------------------------- the attention function itself


class _Module(torch.nn.Module):
    def __init__(self, num_kv_groups: int, is_causal: bool = True):
        super().__init__()
        self.num_key_value_groups = num_kv_groups
        self.is_causal = is_causal
        self.layer_idx = 0
        self.sliding_window = None


def _eager_reference(q, k, v, allowed, scale):
    """fp64 attention with an explicit boolean mask [B, Nq, Nk]; rows seeing nothing -> 0."""
    group = q.shape[1] // k.shape[1]
    kr = k.double().repeat_interleave(group, 1)
    vr = v.double().repeat_interleave(group, 1)
    s = torch.einsum("bhqd,bhkd->bhqk", q.double(), kr) * scale
    s = s.masked_fill(~allowed[:, None], float("-inf"))
    p = torch.softmax(s, -1).nan_to_num(0.0)
    return torch.einsum("bhqk,bhkd->bqhd", p, vr)


def _mask_cases():
    # (name, Nq, Nk, 2D mask over the keys [B, Nk]) ; queries are the last Nq keys
    def m(rows):
        return torch.tensor(rows, dtype=torch.bool)

    yield "left-pad prefill", 6, 6, m([[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1], [0, 0, 0, 0, 0, 1]])
    yield "right-pad prefill", 6, 6, m([[1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 1], [1, 0, 0, 0, 0, 0]])
    yield "holes", 7, 7, m([[1, 0, 1, 1, 0, 1, 1], [0, 1, 1, 0, 1, 1, 0]])
    yield "decode after left pad", 1, 9, m([[0, 0, 0, 1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1, 1, 1, 1]])
    yield "chunk after cached prefix", 4, 11, m([[0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 1], [0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 0]])
    yield "all padding", 3, 3, m([[0, 0, 0], [0, 0, 0]])


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("is_causal", [True, False])
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", SHAPES)
def test_attention_function_unpads_2d_and_4d_masks(backend, is_causal, num_heads, num_kv_heads, head_dim):
    if backend in SLOW_ON_CPU and head_dim != 64:
        pytest.skip("interpreter time: the mask logic is backend-independent, D=128 runs on torch")
    fwd = transformers.AttentionInterface()[IMPL]
    module = _Module(num_heads // num_kv_heads, is_causal)
    gen = torch.Generator().manual_seed(8)
    scale = 0.7 / math.sqrt(head_dim)
    for name, nq, nk, mask2d in _mask_cases():
        B = mask2d.shape[0]
        q = torch.randn(B, num_heads, nq, head_dim, generator=gen)
        k = torch.randn(B, num_kv_heads, nk, head_dim, generator=gen)
        v = torch.randn(B, num_kv_heads, nk, head_dim, generator=gen)
        rows = torch.arange(nq)[:, None] + (nk - nq)
        visible = torch.arange(nk)[None, :] <= rows if is_causal else torch.ones(nq, nk, dtype=torch.bool)
        allowed = mask2d[:, None, :] & visible[None]
        # causal: a padded query (its own key is padding) gives zeros; non-causal: every row that sees a
        # key equals eager (a key mask says nothing about the queries: cross-attention's are other tokens)
        q_valid = mask2d[:, nk - nq :] if is_causal else allowed.any(-1)
        ref = _eager_reference(q, k, v, allowed, scale)
        additive = torch.zeros(B, 1, nq, nk).masked_fill(~allowed[:, None], float("-inf"))
        kinds = (("2d", mask2d.long()), ("4d-bool", allowed[:, None]), ("4d-float", additive))
        if backend in SLOW_ON_CPU:
            kinds = kinds[:1]
        for kind, mask in kinds:
            with mp.use_backend(backend):
                out, weights = fwd(module, q, k, v, mask, scaling=scale)
            assert weights is None
            assert out.shape == (B, nq, num_heads, head_dim)
            sel = q_valid[:, :, None, None].expand_as(out)
            err = (out.double() - ref)[sel].abs().max().item() if sel.any() else 0.0
            assert err < 2e-5, f"{name} {kind}: max err {err}"
            # padded query rows (non-causal: rows that see no key) are exact zeros (never NaN)
            assert (out[~sel] == 0).all(), f"{name} {kind}: padded rows not zero"


def test_attention_function_flash_kwargs_packed_batch():
    """cu_seq_lens_q/k (transformers' FlashAttention kwargs for padding-free batches) go to varlen."""
    fwd = transformers.AttentionInterface()[IMPL]
    module = _Module(2)
    gen = torch.Generator().manual_seed(10)
    lengths = [5, 1, 9]
    total = sum(lengths)
    q = torch.randn(1, 4, total, 64, generator=gen)
    k = torch.randn(1, 2, total, 64, generator=gen)
    v = torch.randn(1, 2, total, 64, generator=gen)
    cu = torch.tensor([0, 5, 6, 15], dtype=torch.int32)
    mpt.reset_counts()
    out, _ = fwd(module, q, k, v, None, scaling=0.125, cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=9, max_length_k=9)
    assert mpt.path_counts() == {"varlen": 1}
    seg = torch.repeat_interleave(torch.arange(3), torch.tensor(lengths))
    allowed = (seg[:, None] == seg[None, :]) & torch.ones(total, total, dtype=torch.bool).tril()
    ref = _eager_reference(q, k, v, allowed[None], 0.125)
    assert (out.double() - ref).abs().max() < 2e-5


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_non_default_scaling_reaches_every_path(backend):
    """transformers passes `scaling` (Qwen3: head_dim**-0.5, other models their own);
    0.3 is far from 1/sqrt(64) = 0.125, so a path that drops it fails by a lot."""
    fwd = transformers.AttentionInterface()[IMPL]
    module = _Module(2)
    gen = torch.Generator().manual_seed(12)
    scale = 0.3
    with mp.use_backend(backend):
        # dense: no mask
        q, k, v = torch.randn(2, 4, 11, 64, generator=gen), torch.randn(2, 2, 11, 64, generator=gen), torch.randn(2, 2, 11, 64, generator=gen)
        mpt.reset_counts()
        out, _ = fwd(module, q, k, v, None, scaling=scale)
        assert mpt.path_counts() == {"dense": 1}
        want = oracle.attention_fp64(q, k, v, True, scale).transpose(1, 2)
        assert (out.double() - want).abs().max() < 2e-5, "dense path ignores scaling"
        # padded: a 2D mask sends it through the varlen kernel
        mask = torch.ones(2, 11, dtype=torch.long)
        mask[1, :4] = 0
        mpt.reset_counts()
        out, _ = fwd(module, q, k, v, mask, scaling=scale)
        assert mpt.path_counts() == {"varlen": 1}
        assert (out[0].double() - want[0]).abs().max() < 2e-5, "padded path ignores scaling"
        want1 = oracle.attention_fp64(q[1:, :, 4:], k[1:, :, 4:], v[1:, :, 4:], True, scale).transpose(1, 2)
        assert (out[1, 4:].double() - want1[0]).abs().max() < 2e-5, "padded path ignores scaling"
        # packed: FlashAttention kwargs
        lengths = [5, 1, 9]
        cu = torch.tensor([0, 5, 6, 15], dtype=torch.int32)
        q, k, v = torch.randn(1, 4, 15, 64, generator=gen), torch.randn(1, 2, 15, 64, generator=gen), torch.randn(1, 2, 15, 64, generator=gen)
        mpt.reset_counts()
        out, _ = fwd(module, q, k, v, None, scaling=scale, cu_seq_lens_q=cu, cu_seq_lens_k=cu,
                     max_length_q=9, max_length_k=9)
        assert mpt.path_counts() == {"varlen": 1}
        for a, b in zip(cu.tolist(), cu.tolist()[1:]):
            w = oracle.attention_fp64(q[:, :, a:b], k[:, :, a:b], v[:, :, a:b], True, scale).transpose(1, 2)
            assert (out[:, a:b].double() - w).abs().max() < 2e-5, f"packed path ignores scaling ({lengths})"


def test_attention_function_refuses_what_it_cannot_do():
    fwd = transformers.AttentionInterface()[IMPL]
    module = _Module(2)
    q = torch.randn(1, 4, 5, 64)
    k = v = torch.randn(1, 2, 5, 64)
    # a mask that is neither causal nor full over valid keys (sliding-window-like band)
    i, j = torch.arange(5)[:, None], torch.arange(5)[None, :]
    band = ((j <= i) & (j > i - 2))[None, None]
    with pytest.raises(NotImplementedError, match="neither causal"):
        fwd(module, q, k, v, band)
    # an additive bias is not a mask
    with pytest.raises(NotImplementedError, match="bias"):
        fwd(module, q, k, v, torch.randn(1, 1, 5, 5))
    with pytest.raises(NotImplementedError, match="sliding"):
        fwd(module, q, k, v, None, sliding_window=4)
    module.train()
    with pytest.raises(NotImplementedError, match="dropout"):
        fwd(module, q, k, v, None, dropout=0.1)
    module.eval()
    out, _ = fwd(module, q, k, v, None, dropout=0.1)  # eval: dropout is not applied anywhere
    assert out.shape == (1, 5, 4, 64)


def test_kernel_without_backward_raises_on_backward(monkeypatch):
    """The GPU/Triton kernels define no backward: their output has no grad_fn, so q/k/v would
    silently get no gradient through attention. backward() must raise instead; the torch
    backend, which runs under autograd, keeps its gradients."""
    fwd = transformers.AttentionInterface()[IMPL]
    module = _Module(2)
    gen = torch.Generator().manual_seed(14)
    mask = torch.ones(1, 6, dtype=torch.long)
    mask[0, 0] = 0
    cu = torch.tensor([0, 2, 6], dtype=torch.int32)
    calls = {"dense": {}, "varlen": dict(attention_mask=mask), "packed": dict(cu_seq_lens_q=cu, cu_seq_lens_k=cu)}

    def qkv():
        return [torch.randn(1, h, 6, 64, generator=gen, requires_grad=True) for h in (4, 2, 2)]

    for path, kwargs in calls.items():
        q, k, v = qkv()
        mask_arg = kwargs.pop("attention_mask", None)
        with mp.use_backend("torch"):
            out, _ = fwd(module, q, k, v, mask_arg, scaling=0.125, **kwargs)
        out.sum().backward()
        assert q.grad is not None and q.grad.abs().max() > 0, path
        kwargs["attention_mask"] = mask_arg
    for op in ("prefill_attention", "prefill_attention_varlen"):
        kernel = getattr(mp, op)
        monkeypatch.setattr(mp, op, lambda *a, _kernel=kernel, **kw: _kernel(*a, **kw).detach())
    for path, kwargs in calls.items():
        q, k, v = qkv()
        mask_arg = kwargs.pop("attention_mask", None)
        with mp.use_backend("torch"):
            out, _ = fwd(module, q, k, v, mask_arg, scaling=0.125, **kwargs)
            with torch.no_grad():
                ref, _ = fwd(module, q, k, v, mask_arg, scaling=0.125, **kwargs)
        assert torch.equal(out, ref), path
        with pytest.raises(NotImplementedError, match="backward"):
            out.sum().backward()
    # in a model the o_proj weights still get gradients, so without the guard backward() would succeed
    model = tiny_qwen3(4, 2, 64)
    model.set_attn_implementation(IMPL)
    ids = torch.randint(1, VOCAB, (1, 8), generator=gen)
    loss = model(input_ids=ids, labels=ids).loss
    with pytest.raises(NotImplementedError, match="backward"):
        loss.backward()
    model.zero_grad(set_to_none=True)


def test_sliding_window_model_raises():
    cfg = tiny_qwen3(4, 2, 64).config.to_dict()
    cfg.update(use_sliding_window=True, sliding_window=4, max_window_layers=0, layer_types=None)
    model = Qwen3ForCausalLM(Qwen3Config(**cfg)).eval()
    if all(getattr(layer.self_attn, "sliding_window", None) is None for layer in model.model.layers):
        pytest.skip("this transformers version builds no sliding layer from this config")
    with pytest.raises(NotImplementedError, match="sliding"):
        forward_logits(model, IMPL, torch.randint(0, VOCAB, (1, 8)))


# --------------------------------------------------------------------------- cross-attention, inference mode, refusals


@functools.lru_cache(maxsize=None)
def tiny_t5gemma():
    """A small random encoder-decoder (T5Gemma: Gemma2-like, supports attention backends) with
    plain attention: no softcapping, no sliding layers (sliding_window must be set, but no layer uses it)."""
    from transformers import T5GemmaConfig, T5GemmaForConditionalGeneration

    sub = dict(vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, head_dim=64, query_pre_attn_scalar=64, attn_logit_softcapping=None,
               final_logit_softcapping=None, sliding_window=4096, layer_types=["full_attention"] * 2)
    cfg = T5GemmaConfig(encoder=dict(sub), decoder=dict(sub), vocab_size=VOCAB, pad_token_id=0, eos_token_id=1,
                        bos_token_id=2, decoder_start_token_id=2)
    torch.manual_seed(21)
    return T5GemmaForConditionalGeneration(cfg).eval()


def test_cross_attention_matches_eager():
    """Encoder-decoder cross-attention: the 2D mask marks encoder keys, the queries are decoder tokens.
    Before: decoder queries at the slots where the (right-padded) encoder mask is 0 got zeros, a decoder
    longer than the encoder raised, and with no encoder mask a decoder shorter than the encoder only saw
    its first dec_len encoder tokens (the StaticCache rule)."""
    model = tiny_t5gemma()
    gen = torch.Generator().manual_seed(22)
    enc = torch.randint(3, VOCAB, (2, 9), generator=gen)
    enc_mask = torch.ones_like(enc)
    enc_mask[1, 5:] = 0
    # (decoder shorter than a padded encoder: the attention-function test below)
    for dec_len, mask in ((9, enc_mask), (12, enc_mask), (4, None)):
        dec = torch.randint(3, VOCAB, (2, dec_len), generator=gen)
        kwargs = dict(input_ids=enc, attention_mask=mask, decoder_input_ids=dec)
        ref = forward_logits(model, "eager", **kwargs)
        out = forward_logits(model, IMPL, **kwargs)
        m = logit_metrics(ref, out)
        print(f"\n[cross-attention dec_len={dec_len} enc_mask={mask is not None}] minipaged vs eager: {fmt(m)}")
        assert_fp32_close(m)
    kwargs = dict(max_new_tokens=4, min_new_tokens=4, do_sample=False)
    model.set_attn_implementation("eager")
    with torch.no_grad():
        ref = model.generate(input_ids=enc, attention_mask=enc_mask, **kwargs)
    model.set_attn_implementation(IMPL)
    with torch.no_grad():
        out = model.generate(input_ids=enc, attention_mask=enc_mask, **kwargs)
    assert out.tolist() == ref.tolist()


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_attention_function_non_causal_keys_are_not_queries(backend):
    """Non-causal calls (cross-attention) with Nq != Nk and a key mask: every query row sees the valid keys,
    through a 2D mask, a 4D mask and a broadcast [B, 1, 1, Nk] mask (BERT style, which used to be refused)."""
    fwd = transformers.AttentionInterface()[IMPL]
    module = _Module(2, is_causal=False)
    gen = torch.Generator().manual_seed(23)
    mixed = torch.tensor([[1, 1, 1, 1, 1, 1, 0, 0, 0], [0, 0, 1, 1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1, 1, 1, 1]]).bool()
    # every encoder right-padded: a 4D mask then also reads as causal with an offset, whose "padded"
    # query rows (the slots of the padding keys) used to be zeros
    right = torch.tensor([[1, 1, 1, 1, 1, 1, 0, 0, 0], [1, 1, 1, 1, 1, 0, 0, 0, 0]]).bool()
    for keys in (mixed, right):
        B = keys.shape[0]
        for nq in ((3, 12) if backend in SLOW_ON_CPU else (1, 3, 9, 12)):
            q = torch.randn(B, 4, nq, 64, generator=gen)
            k = torch.randn(B, 2, 9, 64, generator=gen)
            v = torch.randn(B, 2, 9, 64, generator=gen)
            allowed = keys[:, None, :].expand(B, nq, 9)
            ref = _eager_reference(q, k, v, allowed, 0.125)
            masks = {"2d": keys.long(), "4d": allowed[:, None], "4d-broadcast": keys[:, None, None, :]}
            for kind, mask in masks.items():
                if backend in SLOW_ON_CPU and (kind != "2d") == (keys is mixed):
                    continue  # interpreter time: one mask kind per key set
                with mp.use_backend(backend):
                    out, _ = fwd(module, q, k, v, mask, scaling=0.125)
                err = (out.double() - ref).abs().max().item()
                assert err < 2e-5, f"B={B} Nq={nq} {kind}: max err {err}"


def test_inference_mode_masks():
    """Under torch.inference_mode masks are inference tensors, which have no version counter: the mask
    cache used to raise RuntimeError on them. Its hits must also stay within one forward: a mask buffer
    rewritten in place between two forwards must not be served from the cache."""
    model = tiny_qwen3(4, 2, 64)
    gen = torch.Generator().manual_seed(24)
    seqs = [torch.randint(1, VOCAB, (n,), generator=gen) for n in (7, 3)]
    ids, mask = left_padded(seqs)
    kwargs = dict(max_new_tokens=3, min_new_tokens=3, do_sample=False, pad_token_id=0)
    results = []
    for impl in ("eager", IMPL):
        model.set_attn_implementation(impl)
        with torch.inference_mode():
            results.append(model.generate(input_ids=ids, attention_mask=mask, **kwargs).tolist())
    assert results[0] == results[1]

    fwd = transformers.AttentionInterface()[IMPL]
    module = _Module(2)
    q = torch.randn(1, 4, 6, 64, generator=gen)
    k, v = torch.randn(1, 2, 6, 64, generator=gen), torch.randn(1, 2, 6, 64, generator=gen)
    causal = torch.ones(6, 6, dtype=torch.bool).tril()
    with torch.inference_mode():
        buf = causal[None, None].clone()
        fwd(module, q, k, v, buf, scaling=0.125)
        buf[..., :2] = False  # the same tensor, now left-padded by two
        buf[..., :2, :] = False
        out, _ = fwd(module, q, k, v, buf, scaling=0.125)
    ref = _eager_reference(q, k, v, buf[:, 0].clone(), 0.125)
    assert (out[:, 2:].double() - ref[:, 2:]).abs().max() < 2e-5
    assert (out[:, :2] == 0).all()


def test_full_layers_of_a_windowed_config_run():
    """Exaone4 keeps config.sliding_window on every attention module and passes sliding_window=None for
    its full-attention layers: with no sliding layer at all the model used to be refused; sliding layers
    still are."""
    from transformers import Exaone4Config, Exaone4ForCausalLM

    base = dict(vocab_size=VOCAB, hidden_size=256, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=64, pad_token_id=0, eos_token_id=1, bos_token_id=2)
    torch.manual_seed(25)
    model = Exaone4ForCausalLM(Exaone4Config(**base, sliding_window=4, layer_types=["full_attention"] * 2)).eval()
    seqs = [torch.randint(1, VOCAB, (n,), generator=torch.Generator().manual_seed(25)) for n in (9, 5)]
    ids, mask = left_padded(seqs)
    ref = forward_logits(model, "eager", ids, attention_mask=mask)
    mpt.reset_counts()
    out = forward_logits(model, IMPL, ids, attention_mask=mask)
    assert mpt.call_counts() == every_layer_once_per_forward(2, 1)
    for b, s in enumerate(seqs):
        assert_fp32_close(logit_metrics(ref[b : b + 1, -len(s) :], out[b : b + 1, -len(s) :]))
    hybrid = Exaone4Config(**base, sliding_window=4, layer_types=["sliding_attention", "full_attention"])
    with pytest.raises(NotImplementedError, match="sliding"):
        forward_logits(Exaone4ForCausalLM(hybrid).eval(), IMPL, ids, attention_mask=mask)


def test_unsupported_kwargs_are_refused():
    """Features a kernel cannot honour raise, naming the feature, instead of being dropped."""
    fwd = transformers.AttentionInterface()[IMPL]
    module = _Module(2)
    q = torch.randn(1, 4, 5, 64)
    k = v = torch.randn(1, 2, 5, 64)
    with pytest.raises(NotImplementedError, match="position_bias"):
        fwd(module, q, k, v, None, position_bias=torch.zeros(1, 4, 5, 5))
    with pytest.raises(NotImplementedError, match="head_mask"):
        fwd(module, q, k, v, None, head_mask=torch.ones(4))
    with pytest.raises(NotImplementedError, match="output_attentions"):
        fwd(module, q, k, v, None, output_attentions=True)
    fwd(module, q, k, v, None, output_attentions=False)  # asking for none is fine
    # an unsupported device is named before the mask is read (that read used to fail on meta tensors)
    meta = [t.to("meta") for t in (q, k, v)]
    with pytest.raises(ValueError, match="meta"):
        fwd(module, *meta, torch.ones(1, 5, device="meta"))
    # through a model: output_attentions used to return an empty tuple, head_mask was ignored
    model = tiny_qwen3(4, 2, 64)
    ids = torch.randint(1, VOCAB, (1, 6))
    with pytest.raises(NotImplementedError, match="output_attentions"):
        forward_logits(model, IMPL, ids, output_attentions=True)
    with pytest.raises(NotImplementedError, match="head_mask"):
        forward_logits(model, IMPL, ids, head_mask=torch.ones(4))


# --------------------------------------------------------------------------- GPU: the real Qwen3-0.6B shape in bf16


def qwen3_06b_config(**overrides) -> Qwen3Config:
    cfg = dict(
        vocab_size=151936,
        hidden_size=1024,
        intermediate_size=3072,
        num_hidden_layers=28,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=128,
        max_position_embeddings=40960,
        rope_theta=1_000_000.0,
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
        attention_bias=False,
        attention_dropout=0.0,
        hidden_act="silu",
    )
    cfg.update(overrides)
    return Qwen3Config(**cfg)


def _gpu_backends() -> list[str]:
    if not torch.cuda.is_available():
        return ["torch"]  # collected but skipped by the gpu mark on CPU machines
    return [name for name, (ok, _why) in mp.available_backends("cuda").items() if ok]


@pytest.mark.gpu
def test_qwen3_06b_bf16_gpu_all_backends():
    """Qwen3-0.6B shape, seeded random weights, bf16 on CUDA: every GPU backend vs eager.

    Bounds. Both sides run in bf16, but not the same bf16 computation: eager
    rounds the QK^T scores and the probabilities to bf16 before P@V, the kernels
    keep scores in fp32 and round only P (and O). Through 28 layers these
    roundings move the logits by about bf16 noise. So we
    (1) measure the noise floor of eager bf16 itself against fp32 (the same
        bf16-rounded weights, upcast) and require minipaged's relative L2 error
        against fp32 to be at most twice that floor + 1e-3 -- the FlashAttention
        test criterion, and the sharp check;
    (2) require last-token cosine > 0.99 and top-1 agreement >= 0.9 with eager bf16.
    Calibration on CPU (this config, 2x64 tokens, torch backend in bf16): logits
    std 0.64, median top-1/top-2 gap 0.088; eager bf16 vs fp32: rel_l2 0.0144,
    top-1 0.984; minipaged bf16 vs fp32: rel_l2 0.0139; minipaged vs eager bf16:
    cosine 0.9999, top-1 0.961 (sdpa vs eager bf16: 0.977) -- near-flat random
    logits let bf16 noise flip a few percent of argmaxes legitimately. Deliberate
    bugs on the same model in fp32 (KV heads tiled instead of interleaved, scale
    1/128, no causal mask) gave top-1 agreement 0, 0.06, 0 and cosine -0.01, 0.85,
    0.08, so 0.9 / 0.99 still separate right from wrong.
    """
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    failures = check_bf16_model_vs_eager(qwen3_06b_config(), "cuda", _gpu_backends(), seq=200, short=77)
    assert not failures, "; ".join(failures)


def random_bf16_model(cfg, device: str, seed: int):
    torch.manual_seed(seed)
    # initialise on the device itself: 0.6B parameters are slow to initialise on a CPU
    with torch.device(device):
        model = Qwen3ForCausalLM(cfg)
    return model.to(device=device, dtype=torch.bfloat16).eval()


def check_bf16_model_vs_eager(cfg, device: str, backends: list[str], seq: int, short: int) -> list[str]:
    """The bf16 comparison behind the GPU test (also runnable on CPU with a small cfg).

    Returns the failed checks, one string per failing backend; prints the metrics.
    """
    model = random_bf16_model(cfg, device, seed=0)
    gen = torch.Generator().manual_seed(0)
    batch = 2
    ids = torch.randint(0, cfg.vocab_size, (batch, seq), generator=gen)
    # padded batch: lengths seq and short, left padded
    pids, pmask = left_padded([ids[0], ids[1, :short]])
    ids, pids, pmask = ids.to(device), pids.to(device), pmask.to(device)

    ref_bf16 = forward_logits(model, "eager", ids)
    ref_pad = forward_logits(model, "eager", pids, attention_mask=pmask)
    model32 = model.float()  # the same bf16-rounded weights, upcast: the fp32 truth
    ref_fp32 = forward_logits(model32, "eager", ids)
    model = model32.to(torch.bfloat16)
    del model32
    floor = logit_metrics(ref_fp32, ref_bf16)
    print(f"\n[noise floor] eager bf16 vs eager fp32: {fmt(floor)}")

    assert backends, "no backend available"
    failures = []
    for backend in backends:
        mpt.reset_counts()
        with mp.use_backend(backend):
            out = forward_logits(model, IMPL, ids)
            out_pad = forward_logits(model, IMPL, pids, attention_mask=pmask)
        counts = mpt.call_counts()
        vs_eager = logit_metrics(ref_bf16, out)
        vs_fp32 = logit_metrics(ref_fp32, out)
        # positions where both rows hold real tokens (row 1 is left padded)
        pad_vs_eager = logit_metrics(ref_pad[:, seq - short :], out_pad[:, seq - short :])
        print(f"[{backend}] vs eager bf16: {fmt(vs_eager)}")
        print(f"[{backend}] vs eager fp32: {fmt(vs_fp32)}")
        print(f"[{backend}] padded batch (last {short} positions) vs eager bf16 padded batch: {fmt(pad_vs_eager)}")
        checks = {
            "every layer twice": counts == every_layer_once_per_forward(cfg.num_hidden_layers, 2),
            "finite": bool(torch.isfinite(out).all()) and bool(torch.isfinite(out_pad[pmask.bool()]).all()),
            "cos>0.99": vs_eager["last_token_cos_min"] > 0.99,
            "top1>=0.9": vs_eager["top1_agree"] >= 0.9,
            "rel_l2 vs fp32 <= 2*floor+1e-3": vs_fp32["rel_l2"] <= 2 * floor["rel_l2"] + 1e-3,
            "padded cos>0.99": pad_vs_eager["last_token_cos_min"] > 0.99,
            "padded top1>=0.9": pad_vs_eager["top1_agree"] >= 0.9,
        }
        bad = [k for k, ok in checks.items() if not ok]
        if bad:
            failures.append(f"{backend}: failed {bad} (counts={counts})")
    return failures


@pytest.mark.gpu
def test_qwen3_06b_bf16_gpu_decode_step():
    """One Nq=1 decode step after a left-padded prefill, through DynamicCache, per GPU backend."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    failures = check_bf16_decode_step(qwen3_06b_config(num_hidden_layers=8), "cuda", _gpu_backends(), (131, 40))
    assert not failures, "; ".join(failures)


def check_bf16_decode_step(cfg, device: str, backends: list[str], lengths) -> list[str]:
    model = random_bf16_model(cfg, device, seed=1)
    gen = torch.Generator().manual_seed(1)
    seqs = [torch.randint(0, cfg.vocab_size, (n,), generator=gen) for n in lengths]
    ids, mask = left_padded(seqs)
    nxt = torch.randint(0, cfg.vocab_size, (len(lengths), 1), generator=gen)
    ids, mask, nxt = ids.to(device), mask.to(device), nxt.to(device)
    ref = decode_step_logits(model, "eager", ids, mask, nxt)
    failures = []
    for backend in backends:
        mpt.reset_counts()
        with mp.use_backend(backend):
            out = decode_step_logits(model, IMPL, ids, mask, nxt)
        m = logit_metrics(ref, out)
        counts = mpt.call_counts()
        print(f"\n[{backend}] decode step (Nq=1, DynamicCache, left padded) vs eager bf16: {fmt(m)}")
        if not (m["last_token_cos_min"] > 0.99 and counts == every_layer_once_per_forward(cfg.num_hidden_layers, 2)):
            failures.append(f"{backend}: {fmt(m)} counts={counts}")
    return failures
