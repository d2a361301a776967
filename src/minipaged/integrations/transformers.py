"""transformers integration: ``attn_implementation="minipaged"``.

    from minipaged.integrations import transformers as mpt
    mpt.register()                       # or register(backend="triton")
    model = Qwen3ForCausalLM.from_pretrained(path, attn_implementation="minipaged")

Every attention layer then runs minipaged's prefill kernels instead of
transformers' own attention. K/V are passed unrepeated (the kernels do GQA).
transformers keeps its own contiguous KV cache (DynamicCache), so a decode step
is a prefill with Nq = 1 < Nk; the kernels' bottom-right causal mask is exactly
what a query appended after a cached prefix needs.

Masks. `register()` also registers a mask function under the same name. For
the standard causal / bidirectional patterns it hands the attention function
the 2D padding mask [B, kv_len] (or None when nothing is padded), as
transformers does for FlashAttention. Padded batches are then *unpadded*:
valid query and key tokens are gathered into the varlen layout, attended with
`prefill_attention_varlen`, and scattered back; padded query rows of causal
attention get zeros. Non-causal attention computes every query row over the
valid keys (what eager gives it): the mask marks keys only, and in
cross-attention (encoder keys, e.g. T5Gemma, BERT decoders) the queries are
other tokens, of any number. Any other pattern (custom and/or mask functions,
packed sequences that transformers detected from position_ids, a 4D mask
passed by the caller) arrives as a 4D mask; it is accepted only if it is
exactly causal attention over the valid keys, causal attention within packed
segments, or full attention over the valid keys -- which is verified -- and
otherwise refused with NotImplementedError. A mask is never silently ignored,
and the result always equals what eager attention computes on the real
(non-padding) queries.
Explicitly packed batches (FlashAttention kwargs cu_seq_lens_q/k) go straight
to the varlen kernel.

Not supported (raise NotImplementedError, never ignored): dropout > 0 in
training, sliding windows, logit softcapping, attention sinks, an additive
position_bias, head_mask, output_attentions=True (the kernels never form the
attention weights). Forward only: the kernels define no backward, so
backward() through them raises (the torch backend runs under autograd).

Debug counters, off by default (the hot path then only reads one flag):
after `reset_counts()` (which switches them on) `call_counts()` counts calls
per layer_idx and `path_counts()` which path they took ("dense", "varlen"), so
tests can prove every layer went through minipaged; `stop_counting()` switches
them off again.
"""

from __future__ import annotations

import threading
import weakref
from collections import Counter
from dataclasses import dataclass

import torch

ATTN_IMPLEMENTATION = "minipaged"

_lock = threading.Lock()
_counting = False
_layer_calls: Counter = Counter()
_path_calls: Counter = Counter()
_registered: dict[str, object] = {}  # name -> the forward registered under it


# --------------------------------------------------------------------------- counters


def call_counts() -> dict:
    """{layer_idx: calls} since the last reset (layer_idx None for modules without one)."""
    with _lock:
        return dict(_layer_calls)


def call_count(layer_idx: int | None = None) -> int:
    """Calls of layer `layer_idx`, or of all layers together when None."""
    with _lock:
        if layer_idx is None:
            return sum(_layer_calls.values())
        return _layer_calls.get(layer_idx, 0)


def path_counts() -> dict:
    """{"dense": n, "varlen": n}: how the calls since the last reset were dispatched."""
    with _lock:
        return dict(_path_calls)


def reset_counts() -> None:
    """Start counting from zero (switches the debug counters on)."""
    global _counting
    with _lock:
        _layer_calls.clear()
        _path_calls.clear()
        _counting = True


def stop_counting() -> None:
    global _counting
    _counting = False


def _count(layer_idx, path: str) -> None:
    if not _counting:
        return
    with _lock:
        _layer_calls[layer_idx] += 1
        _path_calls[path] += 1


# --------------------------------------------------------------------------- unpadding


@dataclass
class _Unpad:
    """Where the valid tokens of a padded batch sit, in the varlen layout."""

    q_batch: torch.Tensor  # int64 [Tq]: batch row of each valid query
    q_pos: torch.Tensor  # int64 [Tq]: its position among the Nq queries
    k_batch: torch.Tensor  # int64 [Tk]
    k_pos: torch.Tensor  # int64 [Tk]
    cu_seqlens_q: torch.Tensor  # int32 [B + 1]
    cu_seqlens_k: torch.Tensor  # int32 [B + 1]
    max_seqlen_q: int
    max_seqlen_k: int


def _cu_seqlens(lens: torch.Tensor) -> torch.Tensor:
    cu = torch.zeros(lens.numel() + 1, dtype=torch.int32, device=lens.device)
    cu[1:] = torch.cumsum(lens, 0)
    return cu


def _unpad_from_valid(q_valid: torch.Tensor, kv_valid: torch.Tensor) -> _Unpad:
    """q_valid [B, Nq], kv_valid [B, Nk] bool -> gather indices and cu_seqlens.

    Tokens are kept in order inside each row, so a query keeps its rank among
    the valid queries and the kernels' bottom-right alignment lines it up with
    the valid keys at or before its own position (see _verify_* below).
    """
    q_batch, q_pos = q_valid.nonzero(as_tuple=True)
    k_batch, k_pos = kv_valid.nonzero(as_tuple=True)
    q_lens, k_lens = q_valid.sum(1), kv_valid.sum(1)
    max_q, max_k = (int(x) for x in torch.stack([q_lens.max(), k_lens.max()]).tolist())
    return _Unpad(q_batch, q_pos, k_batch, k_pos, _cu_seqlens(q_lens), _cu_seqlens(k_lens), max_q, max_k)


def _valid_from_2d(mask: torch.Tensor, num_q: int, num_k: int,
                   causal: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """A 2D padding mask [B, L] (1 = real token) -> (q_valid [B, Nq], kv_valid [B, Nk]).

    As for FlashAttention in transformers: the mask covers the keys from the
    left; a mask shorter than the keys (a StaticCache's unused tail) marks the
    rest invalid, a longer one is cut from the left (only the last Nk keys are
    here). Causal: the queries are the last Nq tokens the mask covers.
    Non-causal: every query is computed over the valid keys, as eager does. The
    mask marks keys only: in cross-attention (encoder keys) the queries are other
    tokens, of any number, and a query row's output never depends on its own slot.
    """
    mask = mask.to(torch.bool)
    if mask.shape[1] > num_k:
        mask = mask[:, -num_k:]
    length = mask.shape[1]
    if causal and length < num_q:
        raise ValueError(
            f"attention_mask covers {length} tokens but the query has {num_q}; a 2D mask must cover at least the queries"
        )
    kv_valid = mask
    if length < num_k:
        kv_valid = torch.zeros(mask.shape[0], num_k, dtype=torch.bool, device=mask.device)
        kv_valid[:, :length] = mask
    if not causal:
        return torch.ones(mask.shape[0], num_q, dtype=torch.bool, device=mask.device), kv_valid
    return mask[:, length - num_q :], kv_valid


def _allowed_from_4d(mask: torch.Tensor, batch: int, num_q: int, num_k: int) -> torch.Tensor:
    """A 4D mask (bool: True = attend; float: additive 0 / very negative) -> bool [B, Nq, Nk].

    Dims of size 1 broadcast as in eager/sdpa: batch, heads, and queries ([B, 1, 1, Nk], the
    classic BERT-style key padding mask).
    """
    if mask.shape[-1] != num_k or mask.shape[-2] not in (1, num_q) or mask.shape[0] not in (1, batch):
        raise ValueError(
            f"attention_mask of shape {tuple(mask.shape)} does not fit query length {num_q}, key length {num_k}, batch {batch}"
        )
    if mask.dtype == torch.bool:
        allowed = mask
    elif mask.is_floating_point():
        blocked = mask <= torch.finfo(mask.dtype).min / 2
        if bool(((mask != 0) & ~blocked).any()):
            raise NotImplementedError(
                "minipaged attention: the 4D float attention_mask holds values other than 0 and -inf/min "
                "(an additive bias); only masking is supported"
            )
        allowed = ~blocked
    else:
        allowed = mask != 0
    if allowed.shape[1] != 1:
        if bool((allowed != allowed[:, :1]).any()):
            raise NotImplementedError("minipaged attention: a 4D attention_mask that differs per head is not supported")
    return allowed[:, 0].expand(batch, num_q, num_k)


def _valid_from_4d(allowed: torch.Tensor, queries_are_keys: bool = True):
    """Recognise allowed [B, Nq, Nk] as one of the patterns the varlen kernels compute.

    Returns (q_valid [B, Nq], kv_valid [B, Nk], causal, segment_starts or None):
      * causal over the valid keys, queries at key offset `o` (o = Nk - Nq with a
        DynamicCache, the past length with a StaticCache);
      * causal within packed segments (Nq == Nk, no cache): block-diagonal;
      * full attention over the valid keys: every row that sees a key is computed.
    In the causal patterns, rows of padded queries (which see no key, or whose own
    key is padding) are not compared: their output is zeros. queries_are_keys False (a non-causal
    module, e.g. cross-attention, whose queries are not among the keys): a row
    whose "own key" is padding is a real query all the same, so only rows that see
    no key may be zeros. Anything else (sliding windows, custom mask functions)
    raises NotImplementedError.
    """
    batch, num_q, num_k = allowed.shape
    dev = allowed.device
    kv_valid = allowed.any(1)
    rows_any = allowed.any(2)
    i = torch.arange(num_q, device=dev)
    j = torch.arange(num_k, device=dev)

    def same(expected, q_valid) -> bool:
        if not queries_are_keys and bool((rows_any & ~q_valid).any()):
            return False  # it would zero a row that sees keys
        return bool(((expected == allowed) | ~q_valid[:, :, None]).all())

    # Causal: the last key a real query sees is its own token, at offset + i.
    last = torch.where(allowed, j, torch.full_like(j, -1)).amax(2)
    offset = int((last - i)[rows_any].max()) if bool(rows_any.any()) else num_k - num_q
    if 0 <= offset <= num_k - num_q:
        q_valid = kv_valid[:, offset : offset + num_q]
        causal = (j[None, :] <= offset + i[:, None])[None]
        # valid keys after the last query would break the bottom-right alignment
        tail_empty = not bool(kv_valid[:, offset + num_q :].any())
        if tail_empty and same(kv_valid[:, None, :] & causal, q_valid):
            return q_valid, kv_valid, True, None
        if offset == 0 and num_q == num_k and tail_empty:
            # packed segments: a segment's first token sees only itself
            starts = q_valid & (allowed.sum(2) == 1)
            seg = torch.cumsum(starts.long(), 1)
            same_seg = seg[:, :, None] == seg[:, None, :]
            if same(kv_valid[:, None, :] & causal & same_seg, q_valid):
                return q_valid, kv_valid, True, starts
    # Full attention: every row sees the same keys, so a padded query cannot be told from its row, and
    # in cross-attention the queries are not the keys at all: compute every row that sees a key (what
    # eager gives it too); rows that see none are zeros.
    q_valid = rows_any
    if same(kv_valid[:, None, :].expand_as(allowed), q_valid):
        return q_valid, kv_valid, False, None
    raise NotImplementedError(
        "minipaged attention: the attention_mask is neither causal (per sequence or packed segment) nor full "
        "attention over a set of valid keys (e.g. sliding windows, custom mask functions); use another attn_implementation"
    )


def _unpad_segments(valid: torch.Tensor, starts: torch.Tensor) -> _Unpad:
    """Packed rows: every segment of valid tokens is its own varlen sequence (q and k alike)."""
    b, n = valid.nonzero(as_tuple=True)
    seg = torch.cumsum(starts[b, n].long(), 0) - 1
    lens = torch.bincount(seg, minlength=1) if seg.numel() else seg.new_zeros(0)
    cu = _cu_seqlens(lens)
    max_len = int(lens.max()) if lens.numel() else 0
    return _Unpad(b, n, b, n, cu, cu, max_len, max_len)


class _UnpadCache(threading.local):
    """The metadata of the last mask seen: every layer of a forward shares one mask.

    A hit needs the same tensor object, unchanged since (its version counter). Inference tensors
    (torch.inference_mode) have no version counter, and a caller may rewrite one in place between
    two forwards (a preallocated mask buffer): those hit only later in the same forward, i.e. for
    a layer_idx above the last one that used the entry.
    """

    def __init__(self):
        self.key = None
        self.ref = None
        self.value = None
        self.layer = None

    @staticmethod
    def _version(tensor: torch.Tensor):
        return None if tensor.is_inference() else tensor._version

    def get(self, tensor: torch.Tensor, key: tuple, layer_idx=None):
        if self.ref is None or self.ref() is not tensor or self.key != (self._version(tensor), *key):
            return None
        if tensor.is_inference():
            if not isinstance(layer_idx, int) or self.layer is None or layer_idx <= self.layer:
                return None
            self.layer = layer_idx
        return self.value

    def put(self, tensor: torch.Tensor, key: tuple, value, layer_idx=None) -> None:
        try:
            self.ref = weakref.ref(tensor)
        except TypeError:
            self.ref = None
            return
        self.key = (self._version(tensor), *key)
        self.value = value
        self.layer = layer_idx if isinstance(layer_idx, int) else None


_mask_cache = _UnpadCache()


def _plan_from_mask(mask: torch.Tensor, batch: int, num_q: int, num_k: int, causal: bool, layer_idx=None):
    """(unpad or None for 'no padding: dense', causal) for a 2D or 4D mask, cached per mask tensor."""
    key = (batch, num_q, num_k, causal, mask.shape, mask.device)
    hit = _mask_cache.get(mask, key, layer_idx)
    if hit is not None:
        return hit
    if mask.dim() == 2:
        if mask.shape[0] != batch:
            raise ValueError(f"attention_mask has batch {mask.shape[0]} but the query has {batch}")
        q_valid, kv_valid = _valid_from_2d(mask, num_q, num_k, causal)
    elif mask.dim() == 4:
        # a causal module's queries are its last keys; a non-causal one may attend to other tokens
        q_valid, kv_valid, causal, starts = _valid_from_4d(_allowed_from_4d(mask, batch, num_q, num_k), causal)
        if starts is not None:
            plan = (_unpad_segments(q_valid, starts), True)
            _mask_cache.put(mask, key, plan, layer_idx)
            return plan
    else:
        raise ValueError(f"attention_mask must be 2D [B, kv_len] or 4D [B, 1, Nq, Nk], got shape {tuple(mask.shape)}")
    if bool(kv_valid.all()) and bool(q_valid.all()):
        plan = (None, causal)
    else:
        plan = (_unpad_from_valid(q_valid, kv_valid), causal)
    _mask_cache.put(mask, key, plan, layer_idx)
    return plan


# --------------------------------------------------------------------------- the attention function


class _NoBackward(torch.autograd.Function):
    """Identity whose backward raises: a kernel output without a grad_fn would otherwise let backward()
    succeed through the rest of the model with no gradient for q/k/v, i.e. silently wrong."""

    @staticmethod
    def forward(ctx, out, backend, *inputs):
        ctx.backend = backend
        return out.view_as(out)

    @staticmethod
    def backward(ctx, *grad_outputs):
        raise NotImplementedError(
            f"minipaged attention (backend={ctx.backend!r}) ran a kernel that has no backward; train with "
            "register(backend='torch') (plain PyTorch, differentiable) or another attn_implementation"
        )


def _forward_only(out, query, key, value, backend):
    if out.requires_grad or not torch.is_grad_enabled():
        return out
    if not (query.requires_grad or key.requires_grad or value.requires_grad):
        return out
    return _NoBackward.apply(out, backend, query, key, value)


def _attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, *, backend=None, **kwargs):
    import minipaged as mp

    layer_idx = getattr(module, "layer_idx", None)
    if dropout and getattr(module, "training", False):
        raise NotImplementedError(
            f"minipaged attention has no dropout (got dropout={dropout} in training mode); set attention_dropout=0"
        )
    # The kwarg, when the model passes one, says what this layer does: Exaone4-style modules keep the
    # config's window on every layer and pass sliding_window=None for their full-attention layers.
    # The attribute is the fallback for models that pass nothing.
    if "sliding_window" in kwargs:
        sliding_window = kwargs["sliding_window"]
    else:
        sliding_window = getattr(module, "sliding_window", None)
    if sliding_window is not None:
        raise NotImplementedError(
            f"minipaged attention does not implement sliding-window attention (layer {layer_idx}: sliding_window={sliding_window})"
        )
    if kwargs.get("softcap") is not None:
        raise NotImplementedError("minipaged attention does not implement logit softcapping")
    if kwargs.get("s_aux") is not None or kwargs.get("sinks") is not None:
        raise NotImplementedError("minipaged attention does not implement attention sinks")
    # an additive score bias (T5-style relative positions, ALiBi) would be dropped: wrong output
    if kwargs.get("position_bias") is not None:
        raise NotImplementedError("minipaged attention does not implement an additive position_bias on the scores")
    # transformers 5 forwards model(head_mask=...) down to here; eager drops it, we refuse rather than ignore it
    if kwargs.get("head_mask") is not None:
        raise NotImplementedError("minipaged attention does not implement head_mask (masking whole heads)")
    # the kernels never form the attention probabilities: without this, output_attentions=True
    # silently returns an empty tuple of attentions
    if kwargs.get("output_attentions"):
        raise NotImplementedError(
            "minipaged attention cannot return attention weights (output_attentions=True); "
            "use attn_implementation='eager' for them"
        )
    # before the mask is read (its analysis syncs): the kernels' own check would come after it
    if query.device.type not in ("cpu", "cuda"):
        raise ValueError(f"the tensors are on {query.device}: minipaged runs on cpu and cuda tensors")
    is_causal = kwargs.get("is_causal")
    if is_causal is None:
        is_causal = getattr(module, "is_causal", True)
    is_causal = bool(is_causal)

    batch, num_q_heads, num_q, head_dim = query.shape
    num_k = key.shape[2]
    scale = None if scaling is None else float(scaling)

    plan = None
    cu_q, cu_k = kwargs.get("cu_seq_lens_q"), kwargs.get("cu_seq_lens_k")
    if cu_q is not None and cu_k is not None:
        # the caller already packed the batch (FlashAttention kwargs): [1, H, T, D]
        if batch != 1:
            raise ValueError(f"cu_seq_lens_q/k need a packed batch of size 1, got batch {batch}")
        return _run_packed(query, key, value, cu_q.to(torch.int32), cu_k.to(torch.int32), kwargs, is_causal, scale, backend, layer_idx)
    if attention_mask is not None:
        plan, is_causal = _plan_from_mask(attention_mask, batch, num_q, num_k, is_causal, layer_idx)

    if plan is None:
        _count(layer_idx, "dense")
        out = mp.prefill_attention(query, key, value, causal=is_causal, scale=scale, backend=backend)
        return _forward_only(out.transpose(1, 2), query, key, value, backend), None

    _count(layer_idx, "varlen")
    # [B, H, N, D] viewed as [B, N, H, D]; advanced indexing gathers [T, H, D]
    q_tok = query.transpose(1, 2)[plan.q_batch, plan.q_pos]
    k_tok = key.transpose(1, 2)[plan.k_batch, plan.k_pos]
    v_tok = value.transpose(1, 2)[plan.k_batch, plan.k_pos]
    o_tok = mp.prefill_attention_varlen(
        q_tok,
        k_tok,
        v_tok,
        plan.cu_seqlens_q,
        plan.cu_seqlens_k,
        max_seqlen_q=plan.max_seqlen_q,
        max_seqlen_k=plan.max_seqlen_k,
        causal=is_causal,
        scale=scale,
        backend=backend,
        check_values=False,
    )
    out = query.new_zeros(batch, num_q, num_q_heads, head_dim, dtype=o_tok.dtype)
    out[plan.q_batch, plan.q_pos] = o_tok
    return _forward_only(out, query, key, value, backend), None


def _run_packed(query, key, value, cu_q, cu_k, kwargs, is_causal, scale, backend, layer_idx):
    import minipaged as mp

    _count(layer_idx, "varlen")
    max_q, max_k = kwargs.get("max_length_q"), kwargs.get("max_length_k")
    o = mp.prefill_attention_varlen(
        query[0].transpose(0, 1),
        key[0].transpose(0, 1),
        value[0].transpose(0, 1),
        cu_q,
        cu_k,
        max_seqlen_q=None if max_q is None else int(max_q),
        max_seqlen_k=None if max_k is None else int(max_k),
        causal=is_causal,
        scale=scale,
        backend=backend,
    )
    return _forward_only(o.unsqueeze(0), query, key, value, backend), None


def _make_forward(backend: str | None):
    def minipaged_attention_forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        """transformers attention function: query [B, Hq, Nq, D], key/value [B, Hkv, Nk, D]
        (unrepeated) -> (attn_output [B, Nq, Hq, D], None)."""
        return _attention(module, query, key, value, attention_mask, scaling, dropout, backend=backend, **kwargs)

    minipaged_attention_forward.backend = backend
    return minipaged_attention_forward


# The forward with minipaged's own backend selection (backend= None: use_backend / env vars / auto).
minipaged_attention_forward = _make_forward(None)


# --------------------------------------------------------------------------- mask function


def _torch_at_least(major: int, minor: int) -> bool:
    try:
        got = tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2])
    except ValueError:  # pragma: no cover - exotic version strings
        return True
    return got >= (major, minor)


def minipaged_mask(batch_size, q_length, kv_length, q_offset=None, kv_offset=0, mask_function=None, attention_mask=None,
                   **kwargs):
    """Mask function registered in transformers' AttentionMaskInterface.

    Standard causal / bidirectional masks: the 2D padding mask (None when nothing
    is padded), like FlashAttention's. Any other mask function: a materialised 4D
    boolean mask, which the attention function verifies or refuses.
    """
    from transformers import masking_utils as mu

    standard = (getattr(mu, "causal_mask_function", None), getattr(mu, "bidirectional_mask_function", None))
    if mask_function is None or mask_function in standard:
        if attention_mask is None:
            # A StaticCache hands every slot to attention as a key: those past the queries hold no token
            # yet. (A transformers that does not say where the queries start gets the old answer.) Only
            # for causal masks: a bidirectional one is also made for cross-attention, where kv_length is
            # the encoder's length and q_offset 0 has nothing to do with it (eager then attends every key).
            bidirectional = mask_function is not None and mask_function is standard[1]
            seen = None if q_offset is None or bidirectional else int(q_offset) + q_length - int(kv_offset)
            if seen is None or seen >= kv_length:
                return None
            return torch.ones(batch_size, seen, dtype=torch.bool, device=kwargs.get("device"))
        attention_mask = attention_mask[:, -kv_length:]
        if attention_mask.shape[1] == kv_length and bool(attention_mask.all()):
            return None
        return attention_mask
    kwargs.update(allow_is_causal_skip=False, allow_is_bidirectional_skip=False)
    if not _torch_at_least(2, 5):
        # older transformers "fix" fully masked rows for old torch by unmasking them;
        # that would turn padding into keys here (newer versions deprecate the flag)
        kwargs["allow_torch_fix"] = False
    return mu.sdpa_mask(
        batch_size=batch_size,
        q_length=q_length,
        kv_length=kv_length,
        q_offset=0 if q_offset is None else q_offset,
        kv_offset=kv_offset,
        mask_function=mask_function,
        attention_mask=attention_mask,
        **kwargs,
    )


# --------------------------------------------------------------------------- registration


def register(backend: str | None = None, *, name: str = ATTN_IMPLEMENTATION) -> str:
    """Register `name` (default "minipaged") as a transformers attn_implementation. Idempotent.

    backend: "torch", "triton", "cuda", "cuda-wmma", "auto" or None (None:
    minipaged's own selection per call: use_backend() scope, MINIPAGED_* env
    vars, then auto). Registering the same name again replaces its backend.
    Returns the name to pass as attn_implementation.
    """
    try:
        from transformers import AttentionInterface
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError(
            "minipaged.integrations.transformers needs transformers >= 4.48 (AttentionInterface); "
            "install the extra: pip install 'minipaged[hf]'"
        ) from e
    from minipaged import registry

    if backend is not None:
        if not isinstance(backend, str) or backend.strip().lower() not in registry.backend_names():
            raise ValueError(f"register(backend=): unknown backend {backend!r}; valid names are {registry.backend_names()}")
        backend = backend.strip().lower()
    with _lock:
        fn = _registered.get(name)
        if fn is None or getattr(fn, "backend", None) != backend:
            fn = minipaged_attention_forward if backend is None else _make_forward(backend)
            _registered[name] = fn
    AttentionInterface.register(name, fn)
    try:
        from transformers.masking_utils import AttentionMaskInterface
    except ImportError:
        # transformers < 4.53 builds 4D masks itself; _valid_from_4d handles them
        AttentionMaskInterface = None
    if AttentionMaskInterface is not None:
        AttentionMaskInterface.register(name, minipaged_mask)
    return name


def is_registered(name: str = ATTN_IMPLEMENTATION) -> bool:
    try:
        from transformers import AttentionInterface
    except ImportError:
        return False
    return name in _registered and name in AttentionInterface()


__all__ = [
    "ATTN_IMPLEMENTATION",
    "register",
    "is_registered",
    "minipaged_attention_forward",
    "minipaged_mask",
    "call_count",
    "call_counts",
    "path_counts",
    "reset_counts",
    "stop_counting",
]
