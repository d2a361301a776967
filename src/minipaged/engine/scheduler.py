"""Continuous batching with chunked prefill and prefix caching over a PagedKVCache.

Each step runs at most `max_num_batched_tokens` tokens, in this order:
1. every running decode (one token each, oldest first);
2. the next chunk of every running sequence whose prompt is not yet computed;
3. newly admitted sequences, as many as fit in max_num_seqs and the free pages,
   each with a first chunk of what is left of the budget.
Decodes and chunks run as one forward (see ModelRunner). A prompt longer than
the budget is prefilled over several steps, so it never stalls the running
decodes for more than one budget's worth of tokens; chunk boundaries fall
anywhere, also inside a block.

Admission allocates blocks for the whole prompt at once, sharing the cached
blocks of its longest cached prefix (prefix caching: those tokens are never
computed). After every step `update()` names the blocks that became full, so
later sequences can hit them. A waiting sequence whose next uncached block is
one that a running sequence is computing right now waits in its place instead
of computing it a second time (once the block is named it is a hit), and the
sequences behind it are admitted meanwhile, as vLLM passes over requests whose
K/V is still arriving; otherwise admission is first come, first served and stops
at the first sequence that does not fit, so none overtakes it for pages. When a
decode needs a page and none is free, the newest running sequence gives up its
pages (preemption by recompute, as vLLM does): it returns to the front of the
waiting queue with its prompt and the tokens generated so far; blocks it had
named stay cached, so its re-admission usually hits them. Older sequences are
never touched, so no running sequence ever loses K/V it will still read.

The cache owns the blocks; sequences only count their computed tokens.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from .sequence import Sequence, SeqStatus


@dataclass
class Chunk:
    """Tokens [start, start + num_tokens) of `seq`, computed in one step."""

    seq: Sequence
    start: int
    num_tokens: int

    @property
    def end(self) -> int:
        return self.start + self.num_tokens

    @property
    def samples(self) -> bool:
        """This chunk reaches the sequence's last token, so its last row's logits are sampled."""
        return self.end == len(self.seq)


@dataclass
class StepPlan:
    """One step: decodes first (one token each), then prompt chunks."""

    chunks: list[Chunk] = field(default_factory=list)
    num_decodes: int = 0
    prefix_hit_tokens: int = 0  # reused at this step's admissions

    @property
    def decode_only(self) -> bool:
        return self.num_decodes == len(self.chunks)

    @property
    def num_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks)

    @property
    def sampling(self) -> list[Sequence]:
        return [c.seq for c in self.chunks if c.samples]


def peak_cached_tokens(prompt_len: int, max_new_tokens: int, max_model_len: int) -> int:
    """Most K/V slots a request ever holds. The last sampled token is never fed back, so it
    needs no slot."""
    return min(prompt_len + max(max_new_tokens, 1) - 1, max_model_len)


class Scheduler:
    def __init__(self, cache, *, max_num_seqs: int, max_num_batched_tokens: int, max_model_len: int,
                 enable_prefix_caching: bool = True) -> None:
        self.cache = cache
        self.block_size = cache.block_size
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.enable_prefix_caching = enable_prefix_caching
        self.waiting: deque[Sequence] = deque()
        self.running: deque[Sequence] = deque()  # admission order: oldest first
        self.num_preemptions = 0

    # ------------------------------------------------------------------ admission
    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def check_fits(self, seq: Sequence) -> None:
        """Raise if `seq` could never run to completion, even alone in the cache."""
        if seq.prompt_len == 0:
            raise ValueError("empty prompt: a prompt needs at least one token")
        if seq.prompt_len > self.max_model_len:
            raise ValueError(f"prompt of {seq.prompt_len} tokens exceeds max_model_len={self.max_model_len}")
        peak = peak_cached_tokens(seq.prompt_len, seq.max_new_tokens, self.max_model_len)
        need = self.blocks_for(peak)
        if need > self.cache.num_blocks:
            raise ValueError(
                f"a prompt of {seq.prompt_len} tokens with max_new_tokens={seq.max_new_tokens} needs up to "
                f"{peak} cached tokens = {need} blocks of {self.block_size}, but the cache has only "
                f"{self.cache.num_blocks} blocks; raise num_blocks or lower max_new_tokens"
            )

    def add(self, seq: Sequence) -> None:
        self.check_fits(seq)
        seq.status = SeqStatus.WAITING
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # ------------------------------------------------------------------ scheduling
    def schedule(self) -> StepPlan:
        plan = StepPlan()
        budget = self.max_num_batched_tokens
        # 1. decodes, oldest first; a decode that needs a page may preempt the newest sequences
        for seq in list(self.running):
            if seq.status is not SeqStatus.RUNNING or not seq.is_decoding:
                continue
            if not self._reserve_next_slot(seq):
                continue  # it preempted itself
            plan.chunks.append(Chunk(seq, seq.num_computed, 1))
            budget -= 1
        plan.num_decodes = len(plan.chunks)
        # 2. chunks of running prompts, oldest first
        for seq in self.running:
            if budget <= 0:
                break
            if not seq.is_decoding:
                n = min(len(seq) - seq.num_computed, budget)
                plan.chunks.append(Chunk(seq, seq.num_computed, n))
                budget -= n
        # 3. admissions, in queue order; one that waits for an in-flight block keeps its place
        in_flight = self._in_flight_blocks()
        passed: list[Sequence] = []
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            capacity = self.blocks_for(len(seq)) * self.block_size
            tokens = seq.token_ids if self.enable_prefix_caching else None
            hashes = self.cache.block_hashes(tokens) if tokens is not None else None  # hashed once per try
            if tokens is not None and in_flight and self._waits_for_in_flight(tokens, hashes, in_flight):
                passed.append(self.waiting.popleft())
                continue
            if not self.cache.try_allocate(seq.seq_id, capacity, token_ids=tokens, block_hashes=hashes):
                break
            self.waiting.popleft()
            if tokens is not None:
                in_flight.update(self.cache.pending_hashes(seq.seq_id))
            seq.num_computed = self.cache.prefix_hit_tokens(seq.seq_id)
            plan.prefix_hit_tokens += seq.num_computed
            seq.status = SeqStatus.RUNNING
            self.running.append(seq)
            n = min(len(seq) - seq.num_computed, budget)
            plan.chunks.append(Chunk(seq, seq.num_computed, n))
            budget -= n
        self.waiting.extendleft(reversed(passed))
        if not plan.chunks and self.has_work():
            # Unreachable when check_fits holds; better a loud error than a silent spin.
            raise RuntimeError(f"scheduler stalled: {len(self.waiting)} waiting, {len(self.running)} running, "
                               f"{self.cache.num_free_blocks}/{self.cache.num_blocks} blocks free")
        return plan

    def _in_flight_blocks(self) -> set[int]:
        """Hashes of the prompt blocks that running sequences are computing and will name."""
        if not self.enable_prefix_caching:
            return set()
        out: set[int] = set()
        for seq in self.running:
            if not seq.is_decoding:
                out.update(self.cache.pending_hashes(seq.seq_id))
        return out

    def _waits_for_in_flight(self, tokens: list[int], hashes: list[int], in_flight: set[int]) -> bool:
        """The first block of `tokens` that is not cached yet is one a running sequence is
        computing: admitting now would compute it twice, waiting a step or two makes it a hit.
        `hashes` are the tokens' block hashes."""
        hit = self.cache.match_prefix(tokens, block_hashes=hashes) // self.block_size
        return hit < (len(tokens) - 1) // self.block_size and hashes[hit] in in_flight

    def _reserve_next_slot(self, seq: Sequence) -> bool:
        """Make room for position seq.num_computed; False if `seq` had to preempt itself."""
        bs = self.block_size
        while seq.num_computed + 1 > self.cache.seq_len(seq.seq_id):
            if self.cache.can_append(seq.seq_id, bs):
                self.cache.append(seq.seq_id, bs, return_slots=False)
                return True
            victim = self.running[-1]  # the newest gives way
            self.preempt(victim)
            if victim is seq:
                return False
        return True

    def update(self, plan: StepPlan) -> None:
        """After the step's forward: the chunks' K/V are written; full blocks get named."""
        for c in plan.chunks:
            c.seq.num_computed = c.end
            if self.enable_prefix_caching:
                self.cache.commit(c.seq.seq_id, c.seq.token_ids, c.end)

    def preempt(self, seq: Sequence) -> None:
        self.cache.free(seq.seq_id)
        seq.num_computed = 0
        seq.status = SeqStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.running.remove(seq)
        self.waiting.appendleft(seq)

    # ------------------------------------------------------------------ bookkeeping
    def finish(self, seq: Sequence, reason: str) -> None:
        seq.status = SeqStatus.FINISHED
        seq.finish_reason = reason
        if seq.seq_id in self.cache:
            self.cache.free(seq.seq_id)
        # (a waiting sequence, e.g. one preempted this step, leaves its queue too: left there, the
        # next schedule() would prefill a finished request)
        for queue in (self.running, self.waiting):
            try:
                queue.remove(seq)
            except ValueError:
                pass

    def abort_all(self) -> None:
        """Free every page (used when a step raised, so the cache is reusable)."""
        for seq in list(self.running) + list(self.waiting):
            if seq.seq_id in self.cache:
                self.cache.free(seq.seq_id)
        self.running.clear()
        self.waiting.clear()
