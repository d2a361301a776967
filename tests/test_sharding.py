"""MINIPAGED_TEST_SHARD's dealing (tests/conftest.py::shard_of): every test in exactly one
shard, neighbours together, and the long Triton cross-check alone on the last shard."""

import pytest
from conftest import _SHARD_RUN, shard_of

HEAVY = ["tests/test_crosscheck.py::test_paged_cuda[triton-float16]",
         "tests/test_crosscheck.py::test_paged_cuda[triton-bfloat16]"]


def _ids(n):
    return [f"tests/test_x.py::test_{i}" for i in range(n)]


@pytest.mark.parametrize("count", [1, 2, 3, 4, 6])
def test_every_test_in_one_shard_and_runs_kept_together(count):
    ids = _ids(37)
    shards = shard_of(ids, count)
    assert len(shards) == len(ids) and all(0 <= s < count for s in shards)
    for start in range(0, len(ids), _SHARD_RUN):
        assert len(set(shards[start:start + _SHARD_RUN])) == 1
    # without the long cross-check among them, every shard gets ordinary tests
    assert set(shards) == set(range(count))


@pytest.mark.parametrize("count", [3, 4, 6])
def test_long_cross_check_alone_on_the_last_shard(count):
    ids = _ids(10) + HEAVY + _ids(30)[10:]
    shards = shard_of(ids, count)
    last = [nodeid for nodeid, s in zip(ids, shards) if s == count - 1]
    assert last == HEAVY
    # the ordinary tests are dealt over the other shards, runs kept together
    rest = [s for nodeid, s in zip(ids, shards) if nodeid not in HEAVY]
    assert set(rest) == set(range(count - 1))
    assert rest == [(j // _SHARD_RUN) % (count - 1) for j in range(len(rest))]


def test_two_shards_deal_the_cross_check_like_any_test():
    ids = _ids(6) + HEAVY
    assert shard_of(ids, 2) == [0, 0, 0, 0, 1, 1, 1, 1]
