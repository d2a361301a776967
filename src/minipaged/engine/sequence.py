"""One request's state: its tokens, its pages and where it is in its life."""

from __future__ import annotations

import enum
import itertools

_ids = itertools.count()


class SeqStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Sequence:
    """Prompt + generated tokens of one request.

    `num_cached` counts the tokens whose K/V are in the paged cache; the last
    sampled token is never cached until the next decode step feeds it in.
    `block_table` mirrors the cache's page list for this sequence so the runner
    can compute slots and build tables without asking the cache per token.
    """

    __slots__ = ("seq_id", "index", "token_ids", "prompt_len", "max_new_tokens", "status",
                 "block_table", "num_cached", "prefill_slots", "num_preemptions", "finish_reason")

    def __init__(self, prompt: list[int], max_new_tokens: int, index: int = 0) -> None:
        self.seq_id = next(_ids)
        self.index = index
        self.token_ids = list(prompt)
        self.prompt_len = len(prompt)
        self.max_new_tokens = max_new_tokens
        self.status = SeqStatus.WAITING
        self.block_table: list[int] = []
        self.num_cached = 0
        self.prefill_slots = None
        self.num_preemptions = 0
        self.finish_reason: str | None = None

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def num_generated(self) -> int:
        return len(self.token_ids) - self.prompt_len

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[self.prompt_len:]

    @property
    def last_token(self) -> int:
        return self.token_ids[-1]

    def __repr__(self) -> str:
        return (f"Sequence(id={self.seq_id}, len={len(self)}, prompt={self.prompt_len}, "
                f"cached={self.num_cached}, blocks={len(self.block_table)}, {self.status.value})")
