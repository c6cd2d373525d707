"""The distributed test helper itself: results come back, failures and hangs fail fast."""

import os
import time

import pytest
import torch
import torch.distributed as dist

from tests._dist import run_distributed

pytestmark = pytest.mark.distributed


def _allreduce_rank(rank, world_size):
    t = torch.tensor([float(rank)])
    dist.all_reduce(t)
    return t.item()


def _raise_on_rank_one(rank, world_size):
    if rank == 1:
        raise ValueError("boom on rank one")
    dist.barrier()  # the other ranks block here on the dead peer
    return rank


def _sleep_forever(rank, world_size):
    time.sleep(3600)


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_results_by_rank(world_size):
    expected = float(sum(range(world_size)))
    assert run_distributed(_allreduce_rank, world_size) == [expected] * world_size


def test_rank_exception_fails_with_its_traceback():
    start = time.monotonic()
    with pytest.raises(AssertionError) as info:
        run_distributed(_raise_on_rank_one, 2, timeout=60)
    assert "--- rank 1 ---" in str(info.value)
    assert "ValueError: boom on rank one" in str(info.value)
    assert time.monotonic() - start < 30  # grace period, not the 60 s timeout


def test_hang_fails_within_timeout():
    start = time.monotonic()
    with pytest.raises(AssertionError, match=r"did not finish within 8s"):
        run_distributed(_sleep_forever, 2, timeout=8)
    assert time.monotonic() - start < 25


def _state_of_rank(rank, world_size, key):
    import sys

    seen = os.environ.get(key)
    leftover = getattr(sys, "_elastic_dist_test_mark", None)
    sys._elastic_dist_test_mark = rank  # a fresh rank never sees the previous call's mark
    return seen, leftover, os.getpid()


def test_ranks_are_fresh_processes_with_the_callers_environment(monkeypatch):
    """[Note: ranks start from a fork server]: a variable set after the server started reaches
    the ranks, and no state (a module attribute, the process) survives from one call to the next."""
    monkeypatch.setenv("ELASTIC_DIST_TEST_VAR", "first")
    first = run_distributed(_state_of_rank, 2, "ELASTIC_DIST_TEST_VAR")
    monkeypatch.setenv("ELASTIC_DIST_TEST_VAR", "second")
    second = run_distributed(_state_of_rank, 2, "ELASTIC_DIST_TEST_VAR")
    assert [s[:2] for s in first] == [("first", None)] * 2
    assert [s[:2] for s in second] == [("second", None)] * 2
    pids = {s[2] for s in first + second}
    assert len(pids) == 4 and os.getpid() not in pids
