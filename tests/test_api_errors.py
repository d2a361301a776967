"""Every DESIGN.md rule: bad input raises TypeError/ValueError naming the argument,
before any kernel runs."""

import pytest
import torch

import minipaged as mp


def _prefill(B=1, Hq=4, Hkv=2, Nq=5, Nk=7, D=64, dtype=torch.float32):
    return (torch.randn(B, Hq, Nq, D, dtype=dtype), torch.randn(B, Hkv, Nk, D, dtype=dtype), torch.randn(B, Hkv, Nk, D, dtype=dtype))


def _decode(B=2, Hq=4, Hkv=2, D=64, num_blocks=6, bs=4, dtype=torch.float32):
    q = torch.randn(B, Hq, D, dtype=dtype)
    kc = torch.randn(num_blocks, bs, Hkv, D, dtype=dtype)
    vc = torch.randn_like(kc)
    tables = torch.tensor([[0, 1, -1], [2, 3, 4]], dtype=torch.int32)[:B]
    lens = torch.tensor([5, 9], dtype=torch.int32)[:B]
    return q, kc, vc, tables, lens


def _varlen(D=64):
    q = torch.randn(7, 4, D)
    k = torch.randn(9, 2, D)
    v = torch.randn(9, 2, D)
    return q, k, v, torch.tensor([0, 3, 7], dtype=torch.int32), torch.tensor([0, 4, 9], dtype=torch.int32)


# ------------------------------------------------------------------ prefill


@pytest.mark.parametrize(
    "mutate, exc, words",
    [
        (lambda q, k, v: (q.double(), k, v), TypeError, ["q", "float64"]),
        (lambda q, k, v: (q, k.half(), v), TypeError, ["k", "dtype"]),
        (lambda q, k, v: (q.int(), k, v), TypeError, ["q"]),
        (lambda q, k, v: ("q", k, v), TypeError, ["q", "Tensor"]),
        (lambda q, k, v: (q[0], k, v), ValueError, ["q", "4-D"]),
        (lambda q, k, v: (q, k[..., :32], v), ValueError, ["head dim"]),
        (lambda q, k, v: (q, k, v[:, :, :3]), ValueError, ["v", "shape"]),
        (lambda q, k, v: (q[:, :3], k, v), ValueError, ["Hq % Hkv"]),
        (lambda q, k, v: (torch.cat([q, q]), k, v), ValueError, ["batch"]),
        (lambda q, k, v: (q[..., :48], k[..., :48], v[..., :48]), ValueError, ["head dim", "48"]),
        (lambda q, k, v: (q, k.to("meta"), v), ValueError, ["device"]),
    ],
)
def test_prefill_rejects(mutate, exc, words):
    q, k, v = mutate(*_prefill())
    with pytest.raises(exc) as e:
        mp.prefill_attention(q, k, v, backend="torch")
    for w in words:
        assert w in str(e.value), (w, str(e.value))


def test_prefill_rejects_bad_scale_and_causal():
    q, k, v = _prefill()
    with pytest.raises(ValueError, match="scale"):
        mp.prefill_attention(q, k, v, scale=-1.0)
    with pytest.raises(ValueError, match="scale"):
        mp.prefill_attention(q, k, v, scale=float("nan"))
    with pytest.raises(TypeError, match="scale"):
        mp.prefill_attention(q, k, v, scale="0.1")
    with pytest.raises(TypeError, match="causal"):
        mp.prefill_attention(q, k, v, causal=1)


def test_unknown_backend_lists_valid_names():
    q, k, v = _prefill()
    with pytest.raises(ValueError) as e:
        mp.prefill_attention(q, k, v, backend="flash9000")
    for name in ("auto", "torch", "triton", "cuda", "cuda-wmma"):
        assert name in str(e.value)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU error path")
def test_unavailable_backend_raises_with_reason():
    q, k, v = _prefill(dtype=torch.float16)
    with pytest.raises(mp.BackendUnavailableError, match="no CUDA device|CUDA tensors|runs on"):
        mp.prefill_attention(q, k, v, backend="cuda")


def test_cuda_backend_rejects_fp32_before_availability_matters(monkeypatch):
    # the dtype rule of a backend names the supported dtypes
    from minipaged import registry

    b = registry.all_backends()["cuda"]
    assert "float32" not in b.dtypes
    assert "float32" in registry.all_backends()["triton"].dtypes


# ------------------------------------------------------------------ varlen


def test_varlen_rules():
    q, k, v, cq, ck = _varlen()
    with pytest.raises(TypeError, match="cu_seqlens_q must be int32"):
        mp.prefill_attention_varlen(q, k, v, cq.long(), ck)
    with pytest.raises(ValueError, match="cu_seqlens_q must start at 0"):
        mp.prefill_attention_varlen(q, k, v, torch.tensor([1, 3, 7], dtype=torch.int32), ck)
    with pytest.raises(ValueError, match="non-decreasing"):
        mp.prefill_attention_varlen(q, k, v, cq, torch.tensor([0, 5, 4], dtype=torch.int32))
    with pytest.raises(ValueError, match=r"cu_seqlens_k\[-1\] is 8"):
        mp.prefill_attention_varlen(q, k, v, cq, torch.tensor([0, 4, 8], dtype=torch.int32))
    with pytest.raises(ValueError, match="len\\(cu_seqlens_k\\)"):
        mp.prefill_attention_varlen(q, k, v, cq, torch.tensor([0, 9], dtype=torch.int32))
    with pytest.raises(ValueError, match="max_seqlen_q=2 is below"):
        mp.prefill_attention_varlen(q, k, v, cq, ck, max_seqlen_q=2, max_seqlen_k=5)
    with pytest.raises(ValueError, match="max_seqlen_k"):
        mp.prefill_attention_varlen(q, k, v, cq, ck, max_seqlen_q=4, max_seqlen_k=-1)
    with pytest.raises(ValueError, match="3-D"):
        mp.prefill_attention_varlen(q[None], k, v, cq, ck)
    # the opt-out skips value checks that need a sync (caller built the tensors)
    out = mp.prefill_attention_varlen(q, k, v, cq, ck, max_seqlen_q=4, max_seqlen_k=5, check_values=False)
    assert out.shape == q.shape


# ------------------------------------------------------------------ decode


def test_decode_rules():
    q, kc, vc, t, lens = _decode()
    with pytest.raises(TypeError, match="block_tables must be int32"):
        mp.decode_attention(q, kc, vc, t.long(), lens)
    with pytest.raises(TypeError, match="context_lens must be int32"):
        mp.decode_attention(q, kc, vc, t, lens.long())
    with pytest.raises(TypeError, match="k_cache"):
        mp.decode_attention(q, kc.half(), vc, t, lens)
    bad = t.clone()
    bad[1, 2] = 6  # == num_blocks, and sequence 1 reads column 2
    with pytest.raises(ValueError, match=r"block_tables\[1, 2\]=6 is outside \[0, num_blocks=6\)"):
        mp.decode_attention(q, kc, vc, bad, lens)
    bad[1, 2] = -1
    with pytest.raises(ValueError, match=r"block_tables\[1, 2\]=-1"):
        mp.decode_attention(q, kc, vc, bad, lens)
    with pytest.raises(ValueError, match="exceeds the block table's capacity"):
        mp.decode_attention(q, kc, vc, t, torch.tensor([5, 13], dtype=torch.int32))
    with pytest.raises(ValueError, match="context_lens must be >= 0"):
        mp.decode_attention(q, kc, vc, t, torch.tensor([-1, 3], dtype=torch.int32))
    with pytest.raises(ValueError, match="power of two"):
        kc3 = torch.randn(6, 3, 2, 64)
        mp.decode_attention(q, kc3, kc3.clone(), t, lens)
    with pytest.raises(ValueError, match="power of two"):
        kc512 = torch.randn(1, 512, 2, 64)
        mp.decode_attention(q, kc512, kc512.clone(), t, lens)
    with pytest.raises(ValueError, match="Hq % Hkv"):
        mp.decode_attention(q[:, :3], kc, vc, t, lens)
    with pytest.raises(ValueError, match="one block-table row per query"):
        mp.decode_attention(q, kc, vc, t[:1], lens)
    with pytest.raises(ValueError, match="v_cache must have the shape"):
        mp.decode_attention(q, kc, vc[:5], t, lens)
    # entries past a sequence's pages are never read, so -1 there is fine
    out = mp.decode_attention(q, kc, vc, t, lens)
    assert out.shape == q.shape and not torch.isnan(out).any()
    # opting out skips the range check (caller's responsibility)
    out2 = mp.decode_attention(q, kc, vc, t, lens, check_values=False)
    torch.testing.assert_close(out, out2)


# ------------------------------------------------------------------ write_kv_cache


def test_write_kv_cache_refuses_aliasing_caches():
    kc = torch.full((1, 4, 2, 64), float("nan")).expand(3, 4, 2, 64)
    with pytest.raises(ValueError, match="k_cache has a broadcast"):
        mp.write_kv_cache(torch.randn(1, 2, 64), torch.randn(1, 2, 64), kc, kc.clone(), torch.tensor([0]))


def test_write_kv_cache_rules():
    kc = torch.full((4, 4, 2, 64), float("nan"))
    vc = kc.clone()
    k, v = torch.randn(3, 2, 64), torch.randn(3, 2, 64)
    with pytest.raises(TypeError, match="slot_mapping must be int32 or int64"):
        mp.write_kv_cache(k, v, kc, vc, torch.tensor([0.0, 1.0, 2.0]))
    with pytest.raises(ValueError, match="outside the cache's num_blocks \\* block_size = 16"):
        mp.write_kv_cache(k, v, kc, vc, torch.tensor([0, 1, 16]))
    with pytest.raises(ValueError, match="one slot per token"):
        mp.write_kv_cache(k, v, kc, vc, torch.tensor([0, 1]))
    with pytest.raises(ValueError, match="Hkv"):
        mp.write_kv_cache(k[:, :1], v[:, :1], kc, vc, torch.tensor([0, 1, 2]))
    with pytest.raises(TypeError, match="dtype"):
        mp.write_kv_cache(k.half(), v.half(), kc, vc, torch.tensor([0, 1, 2]))
    assert torch.isnan(kc).all(), "a rejected call must not write"
    mp.write_kv_cache(k, v, kc, vc, torch.tensor([5, -1, 15], dtype=torch.int32))
    torch.testing.assert_close(kc[1, 1], k[0])
    torch.testing.assert_close(vc[3, 3], v[2])
    assert torch.isnan(kc).sum() == kc.numel() - 2 * 2 * 64


# ------------------------------------------------------------------ input-validation audit
# Each input below escaped the rules before (a raw torch error, a message that named nothing, or
# a silent wrong result); the comment of each test says what came out.


def _cpu_backends():
    # triton runs on CPU tensors under the interpreter (conftest sets TRITON_INTERPRET=1)
    return ["torch"] + (["triton"] if mp.available_backends("cpu")["triton"][0] else [])


def _fp8_paged():
    q = torch.randn(2, 4, 64, dtype=torch.float16)
    kc = torch.randn(6, 4, 2, 64).to(torch.float8_e4m3fn)
    tables = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32)
    return q, kc, kc.clone(), tables, torch.tensor([5, 8], dtype=torch.int32)


_NOT_DENSE = {
    "sparse": lambda: torch.ones(2).to_sparse(),
    "nested": lambda: torch.nested.nested_tensor([torch.ones(2)]),  # (the default, strided-nested layout)
}


@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors")
@pytest.mark.parametrize("kind", sorted(_NOT_DENSE))
@pytest.mark.parametrize("backend", _cpu_backends())
def test_fp8_scale_tensors_must_be_dense(backend, kind):
    # a sparse k_scale / v_scale escaped as NotImplementedError ("aten::ne.Scalar ... SparseCPU"), a
    # nested one as RuntimeError ("NestedTensorImpl doesn't support sizes"), and PagedKVCache's as
    # RuntimeError ("expand is unsupported for Sparse tensors")
    q, kc, vc, tables, lens = _fp8_paged()
    cu = torch.tensor([0, 1, 2], dtype=torch.int32)
    calls = {
        "k_scale": lambda s: mp.decode_attention(q, kc, vc, tables, lens, k_scale=s, backend=backend),
        "v_scale": lambda s: mp.paged_attention(q, kc, vc, tables, cu, lens, v_scale=s, backend=backend),
    }
    for name, call in calls.items():
        with pytest.raises(TypeError, match=rf"{name} must be a dense \(strided\) tensor"):
            call(_NOT_DENSE[kind]())
    k = torch.randn(2, 2, 64, dtype=torch.float16)
    before = kc.view(torch.uint8).clone()
    with pytest.raises(TypeError, match=r"k_scale must be a dense \(strided\) tensor"):
        mp.write_kv_cache(k, k, kc, vc, torch.tensor([0, 1]), k_scale=_NOT_DENSE[kind](), backend=backend)
    assert torch.equal(kc.view(torch.uint8), before), "a rejected write must not write"
    with pytest.raises(TypeError, match=r"v_scale must be a dense \(strided\) tensor"):
        mp.PagedKVCache(1, 2, 64, num_blocks=2, dtype=torch.float8_e4m3fn, v_scale=_NOT_DENSE[kind]())


def test_flag_and_scale_errors_name_numpy_types():
    # numpy's bool is named "bool" too: the message read "causal must be a bool, got bool"
    np = pytest.importorskip("numpy")
    q, k, v = _prefill()
    for kw in ("causal", "return_lse"):
        with pytest.raises(TypeError, match=rf"{kw} must be a bool, got numpy\.bool"):
            mp.prefill_attention(q, k, v, backend="torch", **{kw: np.bool_(True)})
    with pytest.raises(TypeError, match=r"scale must be a float or None, got numpy\.bool"):
        mp.prefill_attention(q, k, v, scale=np.bool_(True), backend="torch")
    with pytest.raises(TypeError, match=r"check_values must be a bool, got numpy\.bool"):
        mp.decode_attention(*_decode(), check_values=np.bool_(True))
    with pytest.raises(TypeError, match=r"q must be a torch\.Tensor, got numpy\.ndarray"):
        mp.prefill_attention(q.numpy(), k, v, backend="torch")


@pytest.mark.parametrize("device, exc", [("foo", ValueError), ("meta", ValueError), ("CPU", ValueError),
                                         ("cuda:x", ValueError), (3, TypeError)])
def test_get_backend_refuses_bad_devices_like_available_backends(device, exc):
    # get_backend(device="foo") raised BackendUnavailableError "auto found no backend for prefill
    # on foo", as if "foo" were a device that nothing runs on; available_backends refused it
    with pytest.raises(exc, match="device must be"):
        mp.available_backends(device)
    with pytest.raises(exc, match="device must be"):
        mp.get_backend(device=device)
    with pytest.raises(exc, match="device must be"):
        mp.get_backend("torch", device=device)
    assert mp.get_backend("torch", device="cpu").name == "torch"
    assert mp.get_backend("torch", device=torch.device("cpu")).name == "torch"


@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors")
def test_fast_path_refuses_nested_and_storageless_tensors():
    # check_values=False built its memo key from .shape, which a strided-nested tensor refuses with
    # RuntimeError ("NestedTensorImpl doesn't support sizes"); an mkldnn q of a remembered shape
    # reached data_ptr() ("Cannot access data pointer of Tensor that doesn't have storage")
    q = torch.randn(2, 4, 64)
    kc = torch.randn(4, 4, 2, 64)
    tables = torch.tensor([[0], [1]], dtype=torch.int32)
    lens = torch.tensor([3, 4], dtype=torch.int32)
    cu = torch.tensor([0, 1, 2], dtype=torch.int32)
    nested = torch.nested.nested_tensor([torch.randn(4, 64), torch.randn(4, 64)])
    nested_lens = torch.nested.nested_tensor([torch.tensor([3], dtype=torch.int32)] * 2)
    with pytest.raises(TypeError, match=r"q must be a dense \(strided\) tensor"):
        mp.decode_attention(nested, kc, kc, tables, lens, check_values=False)
    with pytest.raises(TypeError, match=r"context_lens must be a dense \(strided\) tensor"):
        mp.decode_attention(q, kc, kc, tables, nested_lens, check_values=False)
    with pytest.raises(TypeError, match=r"q must be a dense \(strided\) tensor"):
        mp.paged_attention(nested, kc, kc, tables, cu, lens, max_seqlen_q=1, check_values=False)
    if not torch.backends.mkldnn.is_available():
        return
    mp.decode_attention(q, kc, kc, tables, lens, check_values=False)  # remembered: the next call takes the memo
    mp.paged_attention(q, kc, kc, tables, cu, lens, max_seqlen_q=1, check_values=False)
    with pytest.raises(TypeError, match=r"q must be a dense \(strided\) tensor"):
        mp.decode_attention(q.to_mkldnn(), kc, kc, tables, lens, check_values=False)
    with pytest.raises(TypeError, match=r"q must be a dense \(strided\) tensor"):
        mp.paged_attention(q.to_mkldnn(), kc, kc, tables, cu, lens, max_seqlen_q=1, check_values=False)


def test_paged_kv_cache_refuses_non_integer_token_ids():
    # token ids were cast to int64 silently: [1.9, 2.9, ...] hashed as [1, 2, ...] and reused the
    # cached blocks of another prompt (a silent wrong K/V); "7" parsed as 7, b"..." read as raw bytes
    np = pytest.importorskip("numpy")
    c = mp.PagedKVCache(1, 2, 64, num_blocks=8, block_size=2)
    c.allocate("a", 5, token_ids=[1, 2, 3, 4, 5])
    c.commit("a", [1, 2, 3, 4, 5], 5)
    free = c.num_free_blocks
    with pytest.raises(TypeError, match="token ids must be"):
        c.allocate("b", 5, token_ids=[1.9, 2.9, 3.9, 4.9, 5.9])
    assert "b" not in c and c.num_free_blocks == free, "a refused allocation must leave the cache as it was"
    with pytest.raises(TypeError, match="token ids must be"):
        c.match_prefix([1.0, 2.0, 3.0, 4.0, 5.0], block_hashes=c.block_hashes([1, 2, 3, 4]))
    c.allocate("c", 4)
    with pytest.raises(TypeError, match="token ids must be"):
        c.commit("c", ["1", "2", "3", "4"], 4)
    assert c.num_cached_blocks == 2, "a refused commit must name no block"
    for bad in (["1", "2"], [None, 1], [[1], [2]], [1.5, 2], np.array([1.5, 2.5]), torch.tensor([1.0, 2.0]),
                np.array([True, False]), torch.tensor([[1, 2]]), b"\x01" * 16, "12"):
        with pytest.raises(TypeError, match="token ids must be"):
            c.block_hashes(bad)
    with pytest.raises(ValueError, match="token ids must fit in int64"):
        c.block_hashes(np.array([2**63, 1], dtype=np.uint64))
    # integers of every kind hash as before
    want = c.block_hashes([1, 2, 3, 4])
    for ints in ((1, 2, 3, 4), range(1, 5), np.arange(1, 5, dtype=np.int32), np.array([1, 2, 3, 4], dtype=np.uint8),
                 torch.tensor([1, 2, 3, 4]), [np.int64(1), 2, torch.tensor(3), 4]):
        assert c.block_hashes(ints) == want, ints
    assert c.match_prefix([1, 2, 3, 4, 5]) == 4
    c.commit("c", [7, 8, 9, 10], 4)
    assert c.num_cached_blocks == 4


def test_cache_dtype_errors_name_the_fp8_dtype():
    # an FP8 cache of another FP8 format (e5m2, or vLLM's uint8 pages) read as "must have the dtype of
    # q", as if a 16-bit q took no FP8 cache at all
    q, _, _, tables, lens = _decode(dtype=torch.float16)
    u8 = torch.zeros(6, 4, 2, 64, dtype=torch.uint8)
    with pytest.raises(TypeError, match=r"k_cache must have the dtype of q \(torch.float16\) or float8_e4m3fn, "
                                        r"got torch.uint8"):
        mp.decode_attention(q, u8, u8.clone(), tables, lens)
    k = torch.randn(2, 2, 64, dtype=torch.float16)
    e5m2 = torch.zeros(6, 4, 2, 64, dtype=torch.float8_e5m2)
    with pytest.raises(TypeError, match=r"k_cache must have the dtype of k \(torch.float16\) or float8_e4m3fn"):
        mp.write_kv_cache(k, k, e5m2, e5m2.clone(), torch.tensor([0, 1]))
    # a float32 q takes no FP8 cache: no FP8 dtype is offered there
    with pytest.raises(TypeError) as e:
        mp.decode_attention(q.float(), u8, u8.clone(), tables, lens)
    assert "float8" not in str(e.value) and "k_cache must have the dtype of q (torch.float32)" in str(e.value)
