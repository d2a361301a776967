"""Continuous batching over a PagedKVCache.

Each step is either a prefill of newly admitted sequences (as many as fit in
max_num_seqs, max_num_batched_tokens and the free pages) or one decode token for
every running sequence. A running sequence that needs a page when none is free
makes the newest running sequence give up its pages (preemption by recompute,
as vLLM does): it returns to the front of the waiting queue with its prompt and
the tokens generated so far, and is prefilled again later. Older sequences are
never touched, so no running sequence ever loses K/V it will still read.

Pages are reserved a whole block at a time (the cache's length for a sequence is
its reserved capacity, a multiple of block_size); the sequence itself tracks how
many tokens are actually cached. That keeps the per-token path free of tensor
work: slots and block tables are computed from plain Python lists.
"""

from __future__ import annotations

from collections import deque

from .sequence import Sequence, SeqStatus


class Scheduler:
    def __init__(self, cache, *, max_num_seqs: int, max_num_batched_tokens: int, max_model_len: int) -> None:
        self.cache = cache
        self.block_size = cache.block_size
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.waiting: deque[Sequence] = deque()
        self.running: deque[Sequence] = deque()
        self.num_preemptions = 0

    # ------------------------------------------------------------------ admission
    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def check_fits(self, seq: Sequence) -> None:
        """Raise if `seq` could never run to completion, even alone in the cache."""
        if seq.prompt_len == 0:
            raise ValueError("empty prompt: a prompt needs at least one token")
        # The last sampled token is never fed back, so it needs no slot.
        peak = seq.prompt_len + max(seq.max_new_tokens, 1) - 1
        if seq.prompt_len > self.max_model_len:
            raise ValueError(f"prompt of {seq.prompt_len} tokens exceeds max_model_len={self.max_model_len}")
        peak = min(peak, self.max_model_len)
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
    def schedule(self) -> tuple[list[Sequence], bool]:
        """The sequences to run this step and whether it is a prefill step."""
        batch = self._schedule_prefill()
        if batch:
            return batch, True
        batch = self._schedule_decode()
        if not batch and self.has_work():
            # Unreachable when check_fits holds; better a loud error than a silent spin.
            raise RuntimeError(f"scheduler stalled: {len(self.waiting)} waiting, {len(self.running)} running, "
                               f"{self.cache.num_free_blocks}/{self.cache.num_blocks} blocks free")
        return batch, False

    def _schedule_prefill(self) -> list[Sequence]:
        batch: list[Sequence] = []
        num_tokens = 0
        while self.waiting and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            n = len(seq)
            # A prompt longer than the token budget still runs, alone (there is no chunked prefill).
            if batch and num_tokens + n > self.max_num_batched_tokens:
                break
            capacity = self.blocks_for(n) * self.block_size
            if not self.cache.can_allocate(capacity):
                break
            self.waiting.popleft()
            slots = self.cache.allocate(seq.seq_id, capacity)
            seq.prefill_slots = slots[:n]
            seq.block_table = self.cache.block_table(seq.seq_id)
            seq.status = SeqStatus.RUNNING
            self.running.append(seq)
            batch.append(seq)
            num_tokens += n
        return batch

    def _needs_block(self, seq: Sequence) -> bool:
        return seq.num_cached + 1 > len(seq.block_table) * self.block_size

    def _schedule_decode(self) -> list[Sequence]:
        scheduled: list[Sequence] = []
        while self.running:
            seq = self.running.popleft()
            preempted_self = False
            while self._needs_block(seq) and not self.cache.can_append(seq.seq_id, self.block_size):
                if self.running:
                    self.preempt(self.running.pop())  # the newest one gives way
                else:
                    self.preempt(seq)
                    preempted_self = True
                    break
            if preempted_self:
                continue
            if self._needs_block(seq):
                self.cache.append(seq.seq_id, self.block_size)
                seq.block_table = self.cache.block_table(seq.seq_id)
            scheduled.append(seq)
        self.running.extend(scheduled)
        return scheduled

    def preempt(self, seq: Sequence) -> None:
        self.cache.free(seq.seq_id)
        seq.block_table = []
        seq.num_cached = 0
        seq.prefill_slots = None
        seq.status = SeqStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    # ------------------------------------------------------------------ bookkeeping
    def finish(self, seq: Sequence, reason: str) -> None:
        seq.status = SeqStatus.FINISHED
        seq.finish_reason = reason
        if seq.seq_id in self.cache:
            self.cache.free(seq.seq_id)
        seq.block_table = []
        try:
            self.running.remove(seq)
        except ValueError:
            pass

    def abort_all(self) -> None:
        """Free every page (used when a step raised, so the cache is reusable)."""
        for seq in list(self.running) + list(self.waiting):
            if seq.seq_id in self.cache:
                self.cache.free(seq.seq_id)
            seq.block_table = []
        self.running.clear()
        self.waiting.clear()
