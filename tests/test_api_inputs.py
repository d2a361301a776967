"""Inputs the shape rules do not cover: K/V that require grad, caches made under inference mode,
sparse / nested / meta tensors, scale tensors of the wrong kind. Each test failed on the old code."""

import pytest
import torch

import minipaged as mp


def _backends_cpu():
    # triton runs on CPU tensors under the interpreter (conftest sets TRITON_INTERPRET=1)
    return ["torch"] + (["triton"] if mp.available_backends("cpu")["triton"][0] else [])


def _write_problem():
    torch.manual_seed(0)
    k, v = torch.randn(3, 2, 64).half(), torch.randn(3, 2, 64).half()
    kc, vc = torch.randn(4, 4, 2, 64).half(), torch.randn(4, 4, 2, 64).half()
    return k, v, kc, vc, torch.tensor([0, 5, 15])


def _expected_write(k, v, kc, vc, slots):
    ek, ev = kc.clone(), vc.clone()
    for t, s in enumerate(slots.tolist()):
        ek[s // 4, s % 4], ev[s // 4, s % 4] = k[t], v[t]
    return ek, ev


@pytest.mark.parametrize("backend", _backends_cpu())
def test_write_kv_cache_keeps_the_cache_out_of_autograd_when_k_requires_grad(backend):
    # K/V straight from a projection that requires grad: the write must not make the cache an
    # autograd node (it then held the graph alive and the next write refused "k_cache requires grad")
    k, v, kc, vc, slots = _write_problem()
    ek, ev = _expected_write(k, v, kc, vc, slots)
    kg, vg = k.clone().requires_grad_(), v.clone().requires_grad_()
    mp.write_kv_cache(kg, vg, kc, vc, slots, backend=backend)
    assert not kc.requires_grad and not vc.requires_grad and kc.grad_fn is None
    mp.write_kv_cache(kg, vg, kc, vc, slots, backend=backend)  # a second step writes again
    assert torch.equal(kc, ek) and torch.equal(vc, ev)


@pytest.mark.parametrize("backend", _backends_cpu())
def test_write_kv_cache_into_a_cache_made_under_inference_mode(backend):
    # a PagedKVCache allocated under torch.inference_mode() and written outside it: triton wrote
    # it, the torch backend let torch's "Inplace update to inference tensor" RuntimeError escape
    k, v, kc0, vc0, slots = _write_problem()
    with torch.inference_mode():
        cache = mp.PagedKVCache(1, 2, 64, num_blocks=4, block_size=4)
    kc, vc = cache.k_caches[0], cache.v_caches[0]
    with torch.inference_mode():
        kc.copy_(kc0)
        vc.copy_(vc0)
    ek, ev = _expected_write(k, v, kc0, vc0, slots)
    mp.write_kv_cache(k, v, kc, vc, slots, backend=backend)
    assert torch.equal(kc, ek) and torch.equal(vc, ev)


def _sparse_calls():
    torch.manual_seed(0)
    q, k = torch.randn(1, 2, 4, 64).half(), torch.randn(1, 1, 6, 64).half()
    o, lse = torch.randn(3, 2, 64).half(), torch.randn(3, 2)
    kv = torch.randn(2, 1, 64).half()
    kc = torch.randn(4, 4, 1, 64).half()
    nested = torch.nested.nested_tensor([torch.randn(2, 1, 64), torch.randn(3, 1, 64)], layout=torch.jagged)
    return [
        ("q", lambda: mp.prefill_attention(q.to_sparse(), k, k)),
        ("k_cache", lambda: mp.write_kv_cache(kv, kv, kc.to_sparse(), kc.clone(), torch.tensor([0, 1]))),
        ("o_a", lambda: mp.merge_attention_states(o.to_sparse(), lse, o, lse)),
        ("k", lambda: mp.write_kv_cache(nested, kv, kc.clone(), kc.clone(), torch.tensor([0, 1]))),
    ]


@pytest.mark.parametrize("i", range(4))
def test_non_strided_tensors_are_type_errors(i):
    # sparse / nested tensors have no strides: raw torch RuntimeErrors (or a misleading
    # "broadcast (stride 0)" ValueError for a sparse cache) came out instead of the argument's name
    name, call = _sparse_calls()[i]
    with pytest.raises(TypeError, match=rf"{name} must be a dense \(strided\) tensor"):
        call()


@pytest.mark.parametrize("backend", _backends_cpu())
def test_merge_refuses_meta_tensors_like_the_other_ops(backend):
    # torch computed on meta, triton raised BackendUnavailableError; every other op says ValueError
    o, lse = torch.randn(3, 2, 64).half().to("meta"), torch.randn(3, 2).to("meta")
    with pytest.raises(ValueError, match="meta"):
        mp.merge_attention_states(o, lse, o, lse, backend=backend)


@pytest.mark.parametrize(
    "scale, exc, words",
    [
        (torch.tensor(True), TypeError, ["k_scale", "bool"]),
        (torch.tensor([1, 2]), TypeError, ["k_scale", "int64"]),
        (torch.tensor([0.5 + 1j, 2.0]), TypeError, ["k_scale", "complex"]),
        (torch.ones(2, device="meta"), ValueError, ["k_scale", "meta"]),
    ],
)
def test_paged_kv_cache_scale_tensors_are_checked_like_scalars(scale, exc, words):
    # a bool scalar was a TypeError but a bool tensor became scale 1.0; a complex one lost its
    # imaginary part with a warning; a meta one raised torch's NotImplementedError
    with pytest.raises(exc) as e:
        mp.PagedKVCache(1, 2, 64, num_blocks=2, dtype=torch.float8_e4m3fn, k_scale=scale)
    for w in words:
        assert w in str(e.value), (w, str(e.value))


def test_paged_kv_cache_still_takes_float_scale_tensors():
    c = mp.PagedKVCache(2, 2, 64, num_blocks=2, dtype=torch.float8_e4m3fn, k_scale=torch.tensor([0.5, 2.0]),
                        v_scale=torch.tensor(0.25, dtype=torch.float64))
    assert torch.equal(c.k_scales, torch.tensor([[0.5, 2.0], [0.5, 2.0]]))
    assert torch.equal(c.v_scales, torch.full((2, 2), 0.25))


def test_numpy_scalars_are_numbers():
    # scale / max_seqlen computed with numpy (np.float32, np.int64) were refused as "not a float/int";
    # the check_values=False fast path must hand the kernels a Python int on its second call too
    import numpy as np

    torch.manual_seed(1)
    q, k = torch.randn(1, 2, 5, 64), torch.randn(1, 1, 7, 64)
    assert torch.equal(mp.prefill_attention(q, k, k, scale=np.float32(0.125), backend="torch"),
                       mp.prefill_attention(q, k, k, scale=0.125, backend="torch"))
    qv, kv = torch.randn(5, 2, 64), torch.randn(7, 1, 64)
    cu_q, cu_k = torch.tensor([0, 5], dtype=torch.int32), torch.tensor([0, 7], dtype=torch.int32)
    want = mp.prefill_attention_varlen(qv, kv, kv, cu_q, cu_k, backend="torch")
    got = mp.prefill_attention_varlen(qv, kv, kv, cu_q, cu_k, max_seqlen_q=np.int64(5), max_seqlen_k=np.int32(7),
                                      backend="torch")
    assert torch.equal(got, want)
    kc, vc = torch.randn(3, 4, 1, 64), torch.randn(3, 4, 1, 64)
    bt, cl = torch.tensor([[2, 0]], dtype=torch.int32), torch.tensor([7], dtype=torch.int32)
    want = mp.paged_attention(qv, kc, vc, bt, cu_q, cl, backend="torch")
    for _ in range(2):
        got = mp.paged_attention(qv, kc, vc, bt, cu_q, cl, max_seqlen_q=np.int64(5), check_values=False,
                                 backend="torch")
        assert torch.equal(got, want)
    with pytest.raises(TypeError, match="scale must be a float"):
        mp.prefill_attention(q, k, k, scale=np.bool_(True), backend="torch")
    with pytest.raises(ValueError, match="max_seqlen_q must be a non-negative int"):
        mp.prefill_attention_varlen(qv, kv, kv, cu_q, cu_k, max_seqlen_q=np.float64(5.0), backend="torch")
    c = mp.PagedKVCache(1, 1, 64, num_blocks=2, dtype=torch.float8_e4m3fn, k_scale=np.float32(0.5))
    assert torch.equal(c.k_scales, torch.tensor([[0.5]]))


def test_write_kv_cache_traces_whole_under_torch_compile():
    # check_values=False leaves nothing that syncs: a step that writes its K/V must stay one graph.
    # Around the write, an is_inference() query stops dynamo, and an inference-mode context made
    # inductor fail on the torch backend's masked scatter (fp32 caches).
    k, v, kc, vc, slots = (t.float() if t.is_floating_point() else t for t in _write_problem())
    ek, ev = _expected_write(k, v, kc, vc, slots)

    def step(k, v, kc, vc, slots):
        mp.write_kv_cache(k, v, kc, vc, slots, backend="torch", check_values=False)
        return kc.float().sum()

    torch._dynamo.reset()
    torch.compile(step, fullgraph=True)(k, v, kc, vc, slots)
    assert torch.equal(kc, ek) and torch.equal(vc, ev)
