"""python_api/distributed/agree.py: the one message for per-rank errors, and a peer that does
not take part ending the collective with PeerFailure (what the CLI reports as a peer's failure,
not as an agreed error of its own)."""

import time

import pytest

from elastic_kernels.api.distributed.agree import PeerFailure, agree, agreed_message, exchange
from tests._dist import run_distributed


def test_agreed_message():
    assert agreed_message([None, None]) is None
    assert agreed_message(["disk full", "disk full"]) == "disk full"
    assert agreed_message([None, "disk full", None]) == "disk full (on rank 1)"
    assert agreed_message(["a", None, "a"]) == "a (on ranks 0, 2)"
    assert agreed_message(["a", "b", None]) == "rank 0: a; rank 1: b"


def _absent_peer(rank, world_size, call):
    """Rank 1 never joins: rank 0's collective must end within its timeout with PeerFailure."""
    if rank == 1:
        return None
    start = time.monotonic()
    try:
        if call == "exchange":
            exchange("x", timeout_s=2, what="the digests")
        else:
            agree(None, timeout_s=2, what="the check")
    except PeerFailure as exc:
        return type(exc).__name__, str(exc), time.monotonic() - start
    return "returned", "", time.monotonic() - start


def _agreed_error(rank, world_size):
    try:
        agree("disk full" if rank == 1 else None, what="save", error_type=ValueError)
    except ValueError as exc:
        return str(exc)
    return None


@pytest.mark.distributed
@pytest.mark.parametrize("call", ["exchange", "agree"])
def test_a_peer_that_does_not_take_part_is_a_peer_failure(call):
    name, text, took = run_distributed(_absent_peer, 2, call, timeout=60)[0]
    assert name == "PeerFailure", (name, text)
    assert ("the digests" if call == "exchange" else "the check") in text and "a peer rank probably failed" in text
    assert took < 30, took  # bounded by timeout_s (2 s), not by the process group's 60 s
    from elastic_kernels.api.finetune.cli import _peer_failure

    assert _peer_failure(PeerFailure(text))


@pytest.mark.distributed
def test_an_error_on_one_rank_is_raised_on_every_rank():
    assert run_distributed(_agreed_error, 3, timeout=60) == ["save: disk full (on rank 1)"] * 3
