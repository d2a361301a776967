"""PagedKVCache: allocator invariants under random interleavings (state machine)."""

import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

import minipaged as mp

LAYERS, HKV, D = 2, 2, 64


class CacheMachine(RuleBasedStateMachine):
    """Every sequence's tokens are written through write_kv_cache with a value
    that encodes (seq, position, layer); the invariants re-read them through
    the block tables, so any block handed to two sequences, any leak and any
    half-done failed allocation shows up."""

    def __init__(self):
        super().__init__()
        self.block_size = 4
        self.cache = None
        self.model: dict[int, int] = {}  # seq id -> length
        self.next_id = 0

    @rule(block_size=st.sampled_from([1, 2, 4, 16]), num_blocks=st.integers(1, 24))
    @precondition(lambda self: self.cache is None)
    def create(self, block_size, num_blocks):
        self.block_size = block_size
        self.cache = mp.PagedKVCache(LAYERS, HKV, D, num_blocks=num_blocks, block_size=block_size, dtype=torch.float32)
        for t in (*self.cache.k_caches, *self.cache.v_caches):
            t.fill_(float("nan"))

    def _value(self, seq, pos, layer, kind):
        return seq * 10_000 + pos * 10 + layer * 2 + kind

    def _write(self, seq, start, slots):
        n = slots.numel()
        pos = torch.arange(start, start + n, dtype=torch.float32)
        for layer in range(LAYERS):
            k = self._value(seq, pos, layer, 0)[:, None, None].expand(n, HKV, D)
            v = self._value(seq, pos, layer, 1)[:, None, None].expand(n, HKV, D)
            mp.write_kv_cache(k, v, self.cache.k_caches[layer], self.cache.v_caches[layer], slots)

    @precondition(lambda self: self.cache is not None)
    @rule(n=st.integers(0, 40))
    def allocate(self, n):
        seq = self.next_id
        self.next_id += 1
        free_before = self.cache.num_free_blocks
        need = self.cache.blocks_needed(None, n)
        if need > free_before:
            with pytest.raises(mp.CacheFullError):
                self.cache.allocate(seq, n)
            assert seq not in self.cache and self.cache.num_free_blocks == free_before
            return
        slots = self.cache.allocate(seq, n)
        assert slots.dtype == torch.int64 and slots.numel() == n
        self.model[seq] = n
        self._write(seq, 0, slots)

    @precondition(lambda self: self.cache is not None and self.model)
    @rule(data=st.data(), n=st.integers(1, 9))
    def append(self, data, n):
        seq = data.draw(st.sampled_from(sorted(self.model)))
        free_before = self.cache.num_free_blocks
        table_before = self.cache.block_table(seq)
        if not self.cache.can_append(seq, n):
            with pytest.raises(mp.CacheFullError):
                self.cache.append(seq, n)
            assert self.cache.num_free_blocks == free_before
            assert self.cache.block_table(seq) == table_before
            assert self.cache.seq_len(seq) == self.model[seq]
            return
        start = self.model[seq]
        slots = self.cache.append(seq, n)
        self.model[seq] = start + n
        self._write(seq, start, slots)

    @precondition(lambda self: self.cache is not None and self.model)
    @rule(data=st.data())
    def free(self, data):
        seq = data.draw(st.sampled_from(sorted(self.model)))
        self.cache.free(seq)
        del self.model[seq]
        assert seq not in self.cache

    @invariant()
    def blocks_partitioned(self):
        if self.cache is None:
            return
        owned = [b for s in self.model for b in self.cache.block_table(s)]
        assert len(owned) == len(set(owned)), "a block belongs to two sequences"
        assert len(owned) + self.cache.num_free_blocks == self.cache.num_blocks, "leaked blocks"
        for s, n in self.model.items():
            assert len(self.cache.block_table(s)) == -(-n // self.block_size)

    @invariant()
    def contents_intact(self):
        if self.cache is None or not self.model:
            return
        seqs = sorted(self.model)
        tables = self.cache.block_tables(seqs)
        lens = self.cache.context_lens(seqs)
        assert tables.dtype == torch.int32 and lens.dtype == torch.int32
        assert lens.tolist() == [self.model[s] for s in seqs]
        bs = self.block_size
        for row, s in enumerate(seqs):
            n = self.model[s]
            pos = torch.arange(n)
            blk = tables[row].long()[pos // bs]
            for layer in range(LAYERS):
                k = self.cache.k_caches[layer][blk, pos % bs][:, 0, 0]
                v = self.cache.v_caches[layer][blk, pos % bs][:, 0, 0]
                want = self._value(s, pos.float(), layer, 0)
                assert torch.equal(k, want), f"seq {s} layer {layer} K corrupted"
                assert torch.equal(v, want + 1), f"seq {s} layer {layer} V corrupted"


CacheMachine.TestCase.settings = settings(max_examples=40, stateful_step_count=25, deadline=None)
TestCacheMachine = CacheMachine.TestCase


def test_slot_mapping_and_tables():
    c = mp.PagedKVCache(1, 1, 64, num_blocks=8, block_size=4)
    s0 = c.allocate("a", 6)
    assert s0.tolist() == [0, 1, 2, 3, 4, 5]
    s1 = c.allocate("b", 1)
    assert s1.tolist() == [8]
    assert c.append("a", 3).tolist() == [6, 7, 12]
    assert c.append("b", 1, return_slots=False) is None and c.seq_len("b") == 2
    assert c.slot_mapping("b", 1, 2).tolist() == [9]
    assert c.block_tables(["a", "b"]).tolist() == [[0, 1, 3], [2, -1, -1]]
    assert c.context_lens(["a", "b"]).tolist() == [9, 2]
    c.free("a")
    assert c.num_free_blocks == 7
    with pytest.raises(KeyError):
        c.append("a")
    with pytest.raises(ValueError, match="already allocated"):
        c.allocate("b", 1)
    with pytest.raises(mp.CacheFullError, match="needs 8 free blocks"):
        c.allocate("c", 30)
    assert "c" not in c and c.num_free_blocks == 7


def test_bad_construction():
    with pytest.raises(ValueError, match="power of two"):
        mp.PagedKVCache(1, 1, 64, num_blocks=4, block_size=3)
    with pytest.raises(ValueError, match="num_blocks"):
        mp.PagedKVCache(1, 1, 64, num_blocks=0)


def test_cache_feeds_decode():
    """A cache built by the allocator serves decode_attention through its own tables."""
    torch.manual_seed(0)
    c = mp.PagedKVCache(1, 2, 64, num_blocks=16, block_size=4, dtype=torch.float32)
    c.k_caches[0].fill_(float("nan"))
    c.v_caches[0].fill_(float("nan"))
    lens = {"x": 7, "y": 0, "z": 13}
    ks, vs = {}, {}
    for s, n in lens.items():
        slots = c.allocate(s, n)
        ks[s], vs[s] = torch.randn(n, 2, 64), torch.randn(n, 2, 64)
        mp.write_kv_cache(ks[s], vs[s], c.k_caches[0], c.v_caches[0], slots)
    seqs = list(lens)
    q = torch.randn(3, 4, 64)
    out = mp.decode_attention(q, c.k_caches[0], c.v_caches[0], c.block_tables(seqs), c.context_lens(seqs))
    for i, s in enumerate(seqs):
        ref = mp.prefill_attention(q[i : i + 1, :, None], ks[s].transpose(0, 1)[None], vs[s].transpose(0, 1)[None])
        torch.testing.assert_close(out[i], ref[0, :, 0])
