"""Scheduler: continuous batching, chunked prefill, prefix caching and preemption under random
request streams (hypothesis state machine).

No model and no kernels: each step is driven exactly as Engine._step drives it (schedule(), the
runner reads the plan, `plan.sampling` is taken, update(), then each sampled sequence gets its
token and may finish with "stop" / "length" / "max_model_len"), with a fake runner that

- "writes" K/V: slot -> a key of the token's whole prefix (as real K/V is a function of it),
  refusing slots in shared or named blocks (through cache.slot_mapping, which checks that);
- "reads" K/V: every position the chunk's attention sees ([0, end)) must hold this sequence's own
  prefix, so a prefix hit on the wrong block, a skipped or recomputed-out-of-order token, a
  table that lost pages or a shared page that was overwritten all show up;
- "samples": the next token is a pure function of the sequence's tokens (a greedy model), so each
  request's output is known in advance and must come out the same whatever the batching,
  chunking, prefix hits and preemptions.

The allocator itself is covered by the state machines of test_paged_cache.py; here the cache is
only checked for what the scheduler must keep: refcounts = table membership of the running
sequences, waiting sequences hold no pages, and no page leaks once every request is done or
aborted.
"""

from __future__ import annotations

import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

import minipaged as mp
from minipaged.engine.scheduler import Scheduler, peak_cached_tokens
from minipaged.engine.sequence import Sequence, SeqStatus

VOCAB = 12  # small, so prompts share prefixes and sampled tokens collide
STOP = 0
# a few shared prefixes (system prompts): prompts are a cut of one plus a random tail
PREFIXES = [[1] * 24, [1] * 8 + [2] * 16, [(3 * i + 1) % VOCAB for i in range(24)]]


# a request: (prefix, cut of it, random tail, max_new_tokens); cuts hit block boundaries often
REQUEST = st.tuples(st.integers(0, len(PREFIXES) - 1),
                    st.one_of(st.sampled_from([0, 1, 4, 8, 16, 24]), st.integers(0, 24)),
                    st.lists(st.integers(1, VOCAB - 1), max_size=10), st.integers(1, 10))
REQUESTS = st.lists(REQUEST, min_size=1, max_size=6)


def fake_token(tokens: list[int], draw: int) -> int:
    """The "model" and sampler: the next token from the whole sequence and the request's draw count
    (its sampling RNG advances once per sampled token, as the engine's per-request generator does:
    a preempted request that lost tokens, or sampled twice, would draw different ones)."""
    h = draw * 7919
    for t in tokens:
        h = (h * 1_000_003 + t + 1) & 0xFFFFFFFF
    return (h ^ (h >> 13) ^ len(tokens)) % VOCAB


def reference_output(prompt: list[int], max_new: int, max_model_len: int, stops: set[int]) -> list[int]:
    """What Engine._step would produce for the request alone: same stop / length rules, same order."""
    toks, out = list(prompt), []
    while True:
        t = fake_token(toks, len(out))
        toks.append(t)
        out.append(t)
        if t in stops or len(out) >= max_new or len(toks) >= max_model_len:
            return out


class SchedulerMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.cache = None

    # ------------------------------------------------------------------ set-up
    # the simplest draws (what hypothesis tries first) are the interesting ones: prefix caching on,
    # several seats, a cache small enough to preempt, a budget below a block
    @initialize(block_size=st.sampled_from([4, 1, 2, 8]),
                num_blocks=st.one_of(st.integers(6, 12), st.integers(2, 24)),
                budget=st.one_of(st.sampled_from([3, 1, 2, 7, 16]), st.integers(1, 40)),
                max_num_seqs=st.integers(0, 4).map(lambda k: 5 - k), max_model_len=st.sampled_from([33, 12, 64]),
                caching=st.booleans().map(lambda b: not b), use_stop=st.booleans(), reqs=REQUESTS)
    def setup(self, block_size, num_blocks, budget, max_num_seqs, max_model_len, caching, use_stop, reqs):
        self.bs = block_size
        self.cache = mp.PagedKVCache(1, 1, 64, num_blocks=num_blocks, block_size=block_size, dtype=torch.float32)
        self.budget = budget
        self.max_num_seqs = max_num_seqs
        self.max_model_len = max_model_len
        self.caching = caching
        self.stops = {STOP} if use_stop else set()
        self.kv: dict[int, int] = {}  # slot -> prefix key of the token whose K/V it holds
        self.keys: dict[int, list[int]] = {}  # seq id -> prefix keys of its tokens
        self._new_scheduler()
        for r in reqs:
            self._add(*r)

    def _new_scheduler(self):
        """What each Engine.generate() call does: a fresh Scheduler over the same cache (whose
        named blocks outlive it and give hits to the next one)."""
        self.sched = Scheduler(self.cache, max_num_seqs=self.max_num_seqs, max_num_batched_tokens=self.budget,
                               max_model_len=self.max_model_len, enable_prefix_caching=self.caching)
        self.seqs: list[Sequence] = []
        self.expected: dict[int, list[int]] = {}
        self.computed: dict[int, int] = {}  # our own count of each running sequence's computed tokens

    # ------------------------------------------------------------------ rules
    def _add(self, p, cut, tail, max_new):
        prompt = PREFIXES[p][:cut] + tail
        self._add_prompt(prompt or [PREFIXES[p][0]], max_new)

    def _add_prompt(self, prompt, max_new):
        seq = Sequence(prompt, max_new, index=len(self.seqs))
        need = -(-peak_cached_tokens(len(prompt), max_new, self.max_model_len) // self.bs)
        if len(prompt) > self.max_model_len or need > self.cache.num_blocks:
            try:
                self.sched.add(seq)
            except ValueError:
                return
            raise AssertionError(f"add() took a request that can never fit: {seq}, {self.cache}")
        self.sched.add(seq)
        assert seq.status is SeqStatus.WAITING and self.sched.waiting[-1] is seq
        self.seqs.append(seq)
        self.expected[seq.seq_id] = reference_output(prompt, max_new, self.max_model_len, self.stops)

    @rule(reqs=REQUESTS)
    def add_requests(self, reqs):
        """A burst of arrivals, at any point (before the first step, between steps, mid-prefill)."""
        for r in reqs:
            self._add(*r)

    @precondition(lambda self: self.seqs)
    @rule(data=st.data(), tail=st.lists(st.integers(1, VOCAB - 1), max_size=6), max_new=st.integers(1, 10))
    def repeat_request(self, data, tail, max_new):
        """A prompt seen before (as a system prompt is), often while its first copy is mid-prefill:
        the copy must wait for the blocks in flight, then hit them."""
        busy = [s for s in self.sched.running if not s.is_decoding] or self.seqs
        src = data.draw(st.sampled_from(busy))
        self._add_prompt(src.token_ids[: src.prompt_len] + tail, max_new)

    @precondition(lambda self: self.sched.has_work())
    @rule(n=st.integers(1, 12))
    def steps(self, n):
        for _ in range(n):
            if not self.sched.has_work():
                break
            self._step()

    @precondition(lambda self: self.sched.has_work())
    @rule()
    def abort_all(self):
        """generate() raised mid-run: every page comes back, and the next call starts afresh."""
        self.sched.abort_all()
        assert not self.sched.has_work()
        self._check_no_leak()
        self._new_scheduler()

    @precondition(lambda self: not self.sched.has_work())
    @rule()
    def next_round(self):
        self._check_done()
        self._new_scheduler()

    # ------------------------------------------------------------------ one engine step
    def _prefix_keys(self, seq: Sequence) -> list[int]:
        keys = self.keys.setdefault(seq.seq_id, [])
        for i in range(len(keys), len(seq)):
            keys.append(hash((keys[-1] if keys else 0, seq.token_ids[i])))
        return keys

    def _step(self):
        sched, cache, bs = self.sched, self.cache, self.bs
        running_before = list(sched.running)
        waiting_before = list(sched.waiting)
        tables_before = {s.seq_id: cache.block_table(s.seq_id) for s in running_before}
        preempts_before = {s.seq_id: s.num_preemptions for s in running_before}
        tokens_before = {s.seq_id: list(s.token_ids) for s in running_before}
        total_preempts_before = sched.num_preemptions
        free_before = cache.num_free_blocks
        need_page = [s for s in running_before if s.is_decoding and s.num_computed + 1 > cache.seq_len(s.seq_id)]

        plan = sched.schedule()

        # -- the plan: progress, budget, shape
        assert plan.chunks, "schedule() returned an empty plan while there is work (a spin)"
        assert plan.num_tokens <= self.budget, \
            f"{plan.num_tokens} tokens scheduled over a budget of {self.budget}: {plan.chunks}"
        ids = [c.seq.seq_id for c in plan.chunks]
        assert len(ids) == len(set(ids)), f"a sequence is scheduled twice in one step: {plan.chunks}"
        running = list(sched.running)
        assert len(running) <= self.max_num_seqs

        # -- preemption: only the newest give way, only when a decode lacked a page, and their
        #    count is reported
        preempted = [s for s in running_before if s.num_preemptions != preempts_before[s.seq_id]]
        for s in preempted:  # recompute keeps the prompt and every token generated so far
            assert s.token_ids[: len(tokens_before[s.seq_id])] == tokens_before[s.seq_id] \
                and len(s) == len(tokens_before[s.seq_id]), f"preemption changed the tokens of {s}"
        assert all(s.num_preemptions == preempts_before[s.seq_id] + 1 for s in preempted)
        assert sched.num_preemptions - total_preempts_before == len(preempted)
        assert preempted == running_before[len(running_before) - len(preempted):], \
            f"preempted {preempted}, but the newest were {running_before[-len(preempted):]}"
        if preempted:
            assert len(need_page) > free_before, \
                f"preempted {preempted} though {free_before} free pages covered {len(need_page)} decodes"
        kept = running_before[: len(running_before) - len(preempted)]
        for s in kept:  # an older sequence never loses K/V it will read: its table only grows
            table = cache.block_table(s.seq_id)
            assert table[: len(tables_before[s.seq_id])] == tables_before[s.seq_id], f"{s} lost pages"

        # -- queues: admission in the order of [preempted (oldest first), previous waiting queue];
        #    a sequence is passed over only while it waits for a block in flight (checked below)
        queue = preempted + waiting_before
        admitted = running[len(kept):]
        assert running[: len(kept)] == kept
        admitted_ids = {s.seq_id for s in admitted}
        assert admitted == [s for s in queue if s.seq_id in admitted_ids], "admission is out of queue order"
        assert list(sched.waiting) == [s for s in queue if s.seq_id not in admitted_ids], \
            "the sequences left waiting changed order"
        passed_over = [s for s in queue[: queue.index(admitted[-1])] if s.seq_id not in admitted_ids] \
            if admitted else []
        if not self.caching:
            assert not passed_over, f"{passed_over} passed over without prefix caching"
        self._check_queues()

        # -- every chunk: contiguous, in order, within its sequence, on its own pages
        hit_tokens = 0
        for i, c in enumerate(plan.chunks):
            seq = c.seq
            assert seq.status is SeqStatus.RUNNING and seq in running
            assert c.num_tokens >= 1 and c.end <= len(seq)
            if seq in admitted:
                hit = cache.prefix_hit_tokens(seq.seq_id)
                assert c.start == seq.num_computed == hit
                assert hit % bs == 0 and hit <= (len(seq) - 1) // bs * bs, \
                    f"prefix hit of {hit} tokens skips the last token of {seq}"
                if not self.caching:
                    assert hit == 0
                hit_tokens += hit
                self.computed[seq.seq_id] = hit
            assert c.start == self.computed[seq.seq_id], \
                f"chunk {c.start}..{c.end} of {seq} does not continue at {self.computed[seq.seq_id]}"
            if i < plan.num_decodes:  # a decode: only the last sampled token is missing
                assert c.num_tokens == 1 and seq.num_generated > 0 and c.start == len(seq) - 1, \
                    f"decode of {seq} whose prompt is not fully computed"
            else:
                assert not (seq in kept and seq.is_decoding), f"a decode of {seq} was scheduled among the prompt chunks"
            table = cache.block_table(seq.seq_id)
            assert len(table) == -(-len(seq) // bs) and cache.seq_len(seq.seq_id) == len(table) * bs, \
                f"{seq}: table of {len(table)} pages, cache length {cache.seq_len(seq.seq_id)}"
        assert plan.prefix_hit_tokens == hit_tokens
        if self.caching:  # a block another sequence is computing right now is waited for, not computed twice
            in_flight = {h for s in kept if not s.is_decoding for h in cache.pending_hashes(s.seq_id)}
            for s in queue:
                if s.seq_id in admitted_ids:
                    hit = cache.prefix_hit_tokens(s.seq_id) // bs
                    if hit < (len(s) - 1) // bs:
                        assert cache.block_hashes(s.token_ids)[hit] not in in_flight, \
                            f"{s} was admitted to compute block {hit}, which a running sequence is computing"
                    in_flight.update(cache.pending_hashes(s.seq_id))
                elif s in passed_over:  # (its matched prefix is held by the computing sequence: not evicted)
                    hit = cache.match_prefix(s.token_ids) // bs
                    assert hit < (len(s) - 1) // bs and cache.block_hashes(s.token_ids)[hit] in in_flight, \
                        f"{s} was passed over though its next block {hit} is not in flight"
        assert all(c.num_tokens == 1 for c in plan.chunks[: plan.num_decodes])

        # -- work-conserving: a running sequence is left out only when the budget is spent, and
        #    admission stops short only for want of pages, seats, budget or an in-flight block
        scheduled = {c.seq.seq_id for c in plan.chunks}
        if any(s.seq_id not in scheduled for s in running):
            assert plan.num_tokens == self.budget, f"{running} not all scheduled, {plan.num_tokens} tokens"
        if sched.waiting and len(running) < self.max_num_seqs and plan.num_tokens < self.budget:
            # every sequence before the first one that does not fit waits for a block in flight
            pending = {h for s in running if not s.is_decoding for h in cache.pending_hashes(s.seq_id)}
            for head in sched.waiting:
                if self.caching:
                    hit = cache.match_prefix(head.token_ids) // bs
                    if hit < (len(head) - 1) // bs and cache.block_hashes(head.token_ids)[hit] in pending:
                        continue
                cap = -(-len(head) // bs) * bs
                assert not cache.can_allocate(cap, head.token_ids if self.caching else None), \
                    f"{head} was left waiting with pages, seats and budget to spare"
                break

        # -- the runner: write the chunks' K/V, then every chunk reads [0, end) of its own prefix
        written = set()
        for c in plan.chunks:
            keys = self._prefix_keys(c.seq)
            slots = cache.slot_mapping(c.seq.seq_id, c.start, c.end).tolist()  # raises on a shared page
            for p, slot in zip(range(c.start, c.end), slots):
                assert slot not in written, f"slot {slot} written twice in one step"
                written.add(slot)
                self.kv[slot] = keys[p]
        for c in plan.chunks:
            keys = self._prefix_keys(c.seq)
            table = cache.block_table(c.seq.seq_id)
            for p in range(c.end):
                assert self.kv.get(table[p // bs] * bs + p % bs) == keys[p], \
                    f"{c.seq} reads wrong K/V at position {p} (chunk {c.start}..{c.end})"

        # -- sample, update, finish: exactly as Engine._step
        sampling = plan.sampling
        assert sampling == [c.seq for c in plan.chunks if c.end == len(c.seq)]
        tokens = [fake_token(s.token_ids, s.num_generated) for s in sampling]
        sched.update(plan)
        for c in plan.chunks:
            assert c.seq.num_computed == c.end
            self.computed[c.seq.seq_id] = c.end
        for seq, tok in zip(sampling, tokens):
            seq.token_ids.append(tok)
            if tok in self.stops:
                sched.finish(seq, "stop")
            elif seq.num_generated >= seq.max_new_tokens:
                sched.finish(seq, "length")
            elif len(seq) >= self.max_model_len:
                sched.finish(seq, "max_model_len")
            assert seq.output_ids == self.expected[seq.seq_id][: seq.num_generated], \
                f"{seq} generated {seq.output_ids}, want a prefix of {self.expected[seq.seq_id]}"
            if seq.status is SeqStatus.FINISHED:
                assert seq.output_ids == self.expected[seq.seq_id]
                assert seq.seq_id not in cache
        self._check_queues()
        if not sched.has_work():
            self._check_done()

    # ------------------------------------------------------------------ checks
    def _check_queues(self):
        sched, cache = self.sched, self.cache
        running, waiting = list(sched.running), list(sched.waiting)
        assert not {id(s) for s in running} & {id(s) for s in waiting}, "a sequence is both waiting and running"
        assert len({id(s) for s in running}) == len(running) and len({id(s) for s in waiting}) == len(waiting)
        assert all(s.status is SeqStatus.RUNNING for s in running)
        assert all(s.status is SeqStatus.WAITING and s.seq_id not in cache for s in waiting), \
            "a waiting sequence holds pages"
        assert all(s.num_computed == 0 for s in waiting if s.num_preemptions)
        assert set(cache.seq_ids) == {s.seq_id for s in running}, "pages held by no running sequence"
        for s in running:  # a running sequence never holds fewer pages than it computed
            assert cache.seq_len(s.seq_id) >= s.num_computed
            assert s.num_computed < len(s), f"{s} is running with nothing left to compute or sample"
        for s in self.seqs:
            if s.status is SeqStatus.FINISHED:
                assert s not in running and s not in waiting and s.seq_id not in cache
        # refcounts are exactly table membership; the rest of the pool is free
        refs = [0] * cache.num_blocks
        for s in running:
            for b in cache.block_table(s.seq_id):
                refs[b] += 1
        assert refs == [cache.ref_count(b) for b in range(cache.num_blocks)], "refcounts != table membership"
        assert cache.num_free_blocks == sum(r == 0 for r in refs)

    def _check_no_leak(self):
        cache = self.cache
        assert cache.seq_ids == []
        assert cache.num_free_blocks == cache.num_blocks, f"leaked pages: {cache}"
        assert all(cache.ref_count(b) == 0 for b in range(cache.num_blocks))

    def _check_done(self):
        self._check_no_leak()
        for s in self.seqs:
            assert s.status is SeqStatus.FINISHED and s.finish_reason in ("stop", "length", "max_model_len"), s
            # preempted or not, the same tokens as the request alone would get
            assert s.output_ids == self.expected[s.seq_id], \
                f"{s} (preempted {s.num_preemptions}x) generated {s.output_ids}, want {self.expected[s.seq_id]}"

    @invariant()
    def queues_consistent(self):
        if self.cache is not None:
            self._check_queues()

    def teardown(self):
        """Every request eventually finishes: drain with a bound on the steps (no livelock)."""
        if self.cache is None:
            return
        limit = 200 + 60 * sum(len(s) + s.max_new_tokens for s in self.seqs)
        n = 0
        while self.sched.has_work():
            n += 1
            assert n <= limit, f"no end after {limit} steps: {list(self.sched.running)} {list(self.sched.waiting)}"
            self._step()
        self._check_done()


# A run takes milliseconds: more examples than the ci profile's 12 (about 10 s in all on 2 CPU
# cores), else preemption mid-prefill and in-flight waits are drawn too rarely.
SchedulerMachine.TestCase.settings = settings(max_examples=max(settings.default.max_examples, 150),
                                              stateful_step_count=40)
test_scheduler_state_machine = SchedulerMachine.TestCase


def test_finish_of_a_waiting_sequence_leaves_the_queue():
    """finish() on a sequence that waits (never admitted, or preempted) takes it out of the waiting
    queue, so the next schedule() neither prefills it nor stalls on it."""
    cache = mp.PagedKVCache(1, 1, 64, num_blocks=8, block_size=4, dtype=torch.float32)
    sched = Scheduler(cache, max_num_seqs=4, max_num_batched_tokens=64, max_model_len=32,
                      enable_prefix_caching=False)
    a, b = Sequence([1, 2, 3], 4), Sequence([4, 5, 6, 7, 8], 4)
    sched.add(a)
    sched.add(b)
    sched.finish(a, "stop")
    assert list(sched.waiting) == [b] and a.status is SeqStatus.FINISHED
    plan = sched.schedule()
    assert [c.seq for c in plan.chunks] == [b]
    sched.update(plan)
    sched.preempt(b)
    assert list(sched.waiting) == [b] and b.seq_id not in cache
    sched.finish(b, "length")
    assert not sched.has_work() and cache.num_free_blocks == cache.num_blocks


def test_a_sequence_waiting_for_an_in_flight_block_does_not_hold_back_the_queue():
    """B shares A's 16-token prefix, which A (admitted first, its prompt cut into chunks) is still
    computing: B waits in its place for the hit, and C, unrelated, is admitted behind it in the
    same step. Once A has named the blocks, B is admitted with them as a prefix hit."""
    cache = mp.PagedKVCache(1, 1, 64, num_blocks=32, block_size=4, dtype=torch.float32)
    sched = Scheduler(cache, max_num_seqs=4, max_num_batched_tokens=10, max_model_len=64,
                      enable_prefix_caching=True)
    prefix = list(range(1, 17))
    a, b, c = Sequence(prefix + [20], 2), Sequence(prefix + [21, 22], 2), Sequence([30, 31, 32], 2)
    for s in (a, b, c):
        sched.add(s)
    plan = sched.schedule()
    assert [(ch.seq, ch.start, ch.num_tokens) for ch in plan.chunks] == [(a, 0, 10)]  # the budget: A only
    sched.update(plan)
    plan = sched.schedule()  # A's second chunk computes blocks 2-3 of the prefix: B waits, C goes in
    assert [ch.seq for ch in plan.chunks] == [a, c] and list(sched.waiting) == [b]
    sched.update(plan)
    plan = sched.schedule()
    assert b in [ch.seq for ch in plan.chunks] and not sched.waiting
    assert cache.prefix_hit_tokens(b.seq_id) == 16, "B computed A's prefix again"
