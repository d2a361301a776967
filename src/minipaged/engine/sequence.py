"""One request's state: its tokens, how many of them are computed, where it is in its life."""

from __future__ import annotations

import enum
import itertools

from .sampler import SamplingParams

_ids = itertools.count()


class SeqStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Sequence:
    """Prompt + generated tokens of one request.

    `num_computed` counts the leading tokens whose K/V are in the paged cache
    (computed here, or reused from cached prefix blocks). Until all its tokens
    are computed it runs prompt chunks (a preempted sequence re-runs its
    generated tokens too); once only its last sampled token is missing, it
    decodes, one token per step. Its pages belong to the cache
    (`cache.block_table(seq_id)`).
    """

    __slots__ = ("seq_id", "index", "token_ids", "prompt_len", "max_new_tokens", "status", "num_computed",
                 "num_preemptions", "finish_reason", "generator", "token_times", "sampling", "stop_ids")

    def __init__(self, prompt: list[int], max_new_tokens: int, index: int = 0) -> None:
        self.seq_id = next(_ids)
        self.index = index
        self.token_ids = list(prompt)
        self.prompt_len = len(prompt)
        self.max_new_tokens = max_new_tokens
        self.status = SeqStatus.WAITING
        self.num_computed = 0
        self.num_preemptions = 0
        self.finish_reason: str | None = None
        self.generator = None  # per-request sampling RNG: draws do not depend on batch composition
        self.sampling = SamplingParams()  # greedy unless the request says otherwise
        self.stop_ids: frozenset[int] = frozenset()  # sampling one of these finishes the request
        self.token_times: list[float] = []  # perf_counter() when each new token was sampled

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def is_decoding(self) -> bool:
        """Everything but the last sampled token is computed: the next step feeds that token."""
        return self.num_generated > 0 and self.num_computed == len(self.token_ids) - 1

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
                f"computed={self.num_computed}, {self.status.value})")
