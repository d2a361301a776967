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
