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


CacheMachine.TestCase.settings = settings(max_examples=max(settings.default.max_examples, 40), stateful_step_count=25,
                                          deadline=None)
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
    # no ids: every live sequence in allocation order
    assert c.block_tables().tolist() == [[0, 1, 3], [2, -1, -1]]
    assert c.context_lens().tolist() == [9, 2]
    assert c.block_tables(["b"], pad=0).tolist() == [[2]]
    c.free("a")
    assert c.block_tables().tolist() == [[2]] and c.context_lens().tolist() == [2]
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


# ------------------------------------------------------------------ prefix caching


def _content(tokens) -> float:
    """What a token's K holds in the machine below: a function of its whole prefix (as real K/V
    is, through the layers), exactly representable in fp32."""
    return float(hash(tuple(tokens)) % (1 << 20))


class PrefixCacheMachine(RuleBasedStateMachine):
    """Sequences drawn from a few shared prefixes are admitted with token_ids, computed chunk by
    chunk (write then commit), finished or preempted in any order. Invariants: refcounts equal
    table membership, no block is free while referenced, nothing leaks, a named block's contents
    never change, every live sequence reads its own prefix's values through its table, and a hit
    never exceeds what is really cached."""

    PREFIXES = [[7] * 40, [7] * 12 + [9] * 28, list(range(40))]

    def __init__(self):
        super().__init__()
        self.cache = None
        self.seqs: dict[int, dict] = {}  # id -> {"tokens", "computed"}
        self.snap: dict[int, float] = {}  # named block -> its K contents at naming
        self.next_id = 0

    @rule(block_size=st.sampled_from([1, 4, 8]), num_blocks=st.integers(4, 40))
    @precondition(lambda self: self.cache is None)
    def create(self, block_size, num_blocks):
        self.bs = block_size
        self.cache = mp.PagedKVCache(1, 1, 64, num_blocks=num_blocks, block_size=block_size, dtype=torch.float32)
        self.cache.k_caches[0].fill_(float("nan"))

    @precondition(lambda self: self.cache is not None)
    @rule(p=st.integers(0, 2), cut=st.integers(1, 40), tail=st.lists(st.integers(100, 103), max_size=9),
          use_try=st.booleans())
    def admit(self, p, cut, tail, use_try):
        """A new sequence, through allocate (after can_allocate) or try_allocate (the scheduler's)."""
        tokens = self.PREFIXES[p][:cut] + tail
        sid = self.next_id
        self.next_id += 1
        free_before = self.cache.num_free_blocks
        expect_hit = self.cache.match_prefix(tokens)
        fits = self.cache.can_allocate(len(tokens), tokens)
        if use_try:
            assert self.cache.try_allocate(sid, len(tokens), token_ids=tokens) == fits
        elif not fits:
            with pytest.raises(mp.CacheFullError):
                self.cache.allocate(sid, len(tokens), token_ids=tokens)
        if not fits:
            assert sid not in self.cache and self.cache.num_free_blocks == free_before
            return
        hit = self.cache.prefix_hit_tokens(sid) if use_try else None
        slots = (self.cache.slot_mapping(sid, hit, len(tokens)) if use_try
                 else self.cache.allocate(sid, len(tokens), token_ids=tokens))
        hit = self.cache.prefix_hit_tokens(sid)
        assert hit == expect_hit and hit % self.bs == 0 and hit <= len(tokens) - 1
        assert slots.numel() == len(tokens) - hit
        self.seqs[sid] = {"tokens": tokens, "computed": hit}

    @precondition(lambda self: self.cache is not None and any(s["computed"] < len(s["tokens"]) for s in self.seqs.values()))
    @rule(data=st.data(), n=st.integers(1, 13))
    def compute_chunk(self, data, n):
        sid = data.draw(st.sampled_from(sorted(i for i, s in self.seqs.items() if s["computed"] < len(s["tokens"]))))
        s = self.seqs[sid]
        start, end = s["computed"], min(len(s["tokens"]), s["computed"] + n)
        slots = self.cache.slot_mapping(sid, start, end)  # raises if any slot is in a shared/named block
        vals = torch.tensor([_content(s["tokens"][: p + 1]) for p in range(start, end)])
        kv = vals[:, None, None].expand(-1, 1, 64).contiguous()
        mp.write_kv_cache(kv, kv, self.cache.k_caches[0], self.cache.k_caches[0].clone(), slots)
        s["computed"] = end
        self.cache.commit(sid, s["tokens"], end)

    @precondition(lambda self: self.cache is not None and self.seqs)
    @rule(data=st.data())
    def release(self, data):
        """Completion or preemption: both just drop the sequence's references."""
        sid = data.draw(st.sampled_from(sorted(self.seqs)))
        self.cache.free(sid)
        del self.seqs[sid]

    @precondition(lambda self: self.cache is not None)
    @rule()
    def reset_prefix_cache(self):
        self.cache.reset_prefix_cache()

    @invariant()
    def refcounts_and_no_leak(self):
        if self.cache is None:
            return
        c = self.cache
        count = [0] * c.num_blocks
        for sid in self.seqs:
            for b in c.block_table(sid):
                count[b] += 1
        for b in range(c.num_blocks):
            assert c.ref_count(b) == count[b], f"block {b}: ref {c.ref_count(b)} but in {count[b]} tables"
        referenced = sum(1 for x in count if x)
        assert referenced + c.num_free_blocks == c.num_blocks, "leaked or double-counted blocks"
        assert set(c._free).isdisjoint(c._evictable)
        assert all(count[b] == 0 for b in (*c._free, *c._evictable)), "a block is free while referenced"

    @invariant()
    def named_blocks_never_change(self):
        if self.cache is None:
            return
        k = self.cache.k_caches[0]
        live = {b for b in range(self.cache.num_blocks) if self.cache.is_cached(b)}
        for b in list(self.snap):
            if b not in live:
                del self.snap[b]  # evicted: it may be reused
        for b in live:
            cur = k[b, :, 0, 0].clone()
            if b in self.snap:
                assert torch.equal(cur, self.snap[b]), f"named block {b} was written"
            else:
                assert not torch.isnan(cur).any(), f"block {b} was named before it was full"
                self.snap[b] = cur

    @invariant()
    def contents_intact(self):
        if self.cache is None:
            return
        bs = self.bs
        k = self.cache.k_caches[0]
        for sid, s in self.seqs.items():
            table = self.cache.block_table(sid)
            for p in range(s["computed"]):
                got = k[table[p // bs], p % bs, 0, 0].item()
                assert got == _content(s["tokens"][: p + 1]), f"seq {sid} position {p} reads the wrong K"


PrefixCacheMachine.TestCase.settings = settings(max_examples=max(settings.default.max_examples, 60),
                                                stateful_step_count=30, deadline=None)
TestPrefixCacheMachine = PrefixCacheMachine.TestCase


def test_prefix_hit_reuse_lru_eviction_and_preemption():
    c = mp.PagedKVCache(1, 1, 64, num_blocks=6, block_size=4)
    sys_prompt = list(range(8))
    a = sys_prompt + [50, 51, 52]
    c.allocate("a", len(a), token_ids=a)
    assert c.prefix_hit_tokens("a") == 0
    c.commit("a", a, len(a))
    assert c.num_cached_blocks == 2  # two full blocks named, the partial third is not
    b = sys_prompt + [60]
    assert c.match_prefix(b) == 8
    slots = c.allocate("b", len(b), token_ids=b)
    assert c.prefix_hit_tokens("b") == 8 and slots.numel() == 1
    assert c.block_table("b")[:2] == c.block_table("a")[:2] and c.ref_count(c.block_table("a")[0]) == 2
    # the last token is always computed: a prompt of exactly two full blocks hits only one
    assert c.match_prefix(sys_prompt) == 4
    # "a" preempted, "b" finished: named blocks stay cached, unreferenced
    shared = c.block_table("a")[:2]
    c.free("a")
    c.free("b")
    assert c.num_free_blocks == 6 and c.num_cached_blocks == 2
    # a hit after preemption reuses what is still cached
    c.allocate("a2", len(a), token_ids=a)
    assert c.prefix_hit_tokens("a2") == 8 and c.block_table("a2")[:2] == shared
    c.free("a2")
    # filling the pool evicts the cached blocks, least recently released first
    c.allocate("big", 6 * 4)
    assert c.num_cached_blocks == 0 and c.match_prefix(a) == 0
    c.free("big")
    # a hash collision or a different token never hits
    c.allocate("x", 5, token_ids=[1, 2, 3, 4, 5])
    c.commit("x", [1, 2, 3, 4, 5], 5)
    assert c.match_prefix([1, 2, 3, 9, 5]) == 0 and c.match_prefix([1, 2, 3, 4, 6]) == 4


def test_named_blocks_refuse_writes():
    c = mp.PagedKVCache(1, 1, 64, num_blocks=4, block_size=2)
    t = [1, 2, 3, 4, 5]
    c.allocate("a", 5, token_ids=t)
    c.commit("a", t, 4)
    with pytest.raises(RuntimeError, match="never be written"):
        c.slot_mapping("a", 3, 5)
    assert c.slot_mapping("a", 4, 5).numel() == 1
