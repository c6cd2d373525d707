"""Agreeing across ranks: one object exchange with a bounded wait, and what is built on it.

    every = exchange(obj, group, timeout_s=30, what="who is where")   # obj of every rank, by rank
    agree(error_or_none, group, what="load", error_type=LoadError)   # every rank raises, or none
    rank0_then_agree(write, group, what="save_adapter(dir)")          # rank 0 acts, all learn how it went
    digest(obj)                                                       # a short hash of a JSON-able value

[Note: agreeing across ranks]
A check that fails on one rank must fail on every rank, with one message, instead of leaving
the others waiting in their next collective until a timeout (ARCHITECTURE.md: errors agreed
across ranks). So every such check ends in `agree(error)`: each rank contributes its error
text or None, and every rank raises the same exception if any text is set. The message is the
error itself, followed by " (on rank 1)" / " (on ranks 0, 2)" when only some ranks failed; when
ranks failed differently, "rank 0: ...; rank 2: ..." lists them all.

`exchange` is `all_gather_object` with a timeout: a fixed-size length exchange, then the
padded pickled payloads, both issued async and waited for at most `timeout_s` (None: the
process group's own timeout), so a peer that died or stopped makes the call fail with
`error_type` (PeerFailure unless the caller names another) naming `what` instead of hanging
forever (`dist.all_gather_object` has no timeout of its own). The tensors live where the
group's backend wants them: on the current CUDA device for NCCL, on the CPU otherwise.
Without an initialised process group, or in a group of one, nothing is exchanged.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import pickle

import torch
import torch.distributed as dist

__all__ = ["PeerFailure", "agree", "agreed_message", "digest", "exchange", "group_size", "rank0_then_agree",
           "ranks_text"]


class PeerFailure(RuntimeError):
    """A collective that did not complete: a peer rank died, stopped or fell behind past the
    timeout. Not this rank's own error, so a launcher reports it as a peer's failure
    (python_api/finetune/cli.py) rather than as an agreed error."""


def group_size(group=None) -> int:
    """World size of `group` (the default group when None); 1 without a process group."""
    if not (dist.is_available() and dist.is_initialized()):
        return 1
    return dist.get_world_size(group)


def _device(group) -> torch.device:
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _wait(work, timeout_s: float | None, what: str, error_type: type[Exception]) -> None:
    try:
        if timeout_s is None:
            work.wait()
        else:
            work.wait(datetime.timedelta(seconds=timeout_s))
    except Exception as exc:  # noqa: BLE001 - re-raised with context
        del work  # the traceback keeps this frame: not the work ([Note: nothing outlives its step] in collectives.py)
        limit = "the process group's timeout" if timeout_s is None else f"timeout {timeout_s} s"
        raise error_type(
            f"{what}: a collective failed or timed out ({limit}); a peer rank probably failed or "
            f"stopped: {exc}"
        ) from exc


def exchange(obj, group=None, *, timeout_s: float | None = None, what: str = "exchange",
             error_type: type[Exception] = PeerFailure) -> list:
    """The picklable `obj` of every rank of `group`, in group rank order ([Note: agreeing
    across ranks]). A collective: every rank of the group must call it. Raises `error_type`
    naming `what` when a peer does not take part within `timeout_s`."""
    world = group_size(group)
    if world == 1:
        return [obj]
    dev = _device(group)
    payload = pickle.dumps(obj)
    size = torch.tensor([len(payload)], dtype=torch.int64, device=dev)
    sizes = [torch.empty_like(size) for _ in range(world)]
    _wait(dist.all_gather(sizes, size, group=group, async_op=True), timeout_s, what, error_type)
    lengths = [int(s.item()) for s in sizes]
    buf = torch.zeros(max(lengths), dtype=torch.uint8)
    buf[: len(payload)] = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
    buf = buf.to(dev)
    bufs = [torch.empty_like(buf) for _ in range(world)]
    _wait(dist.all_gather(bufs, buf, group=group, async_op=True), timeout_s, what, error_type)
    return [pickle.loads(b[:n].cpu().numpy().tobytes()) for b, n in zip(bufs, lengths)]


def ranks_text(ranks: list[int]) -> str:
    """"rank 1" / "ranks 0, 2"."""
    return f"rank{'s' if len(ranks) > 1 else ''} {', '.join(str(r) for r in ranks)}"


def agree(error: str | None, group=None, *, what: str = "", timeout_s: float | None = None,
          error_type: type[Exception] = RuntimeError, collective_error_type: type[Exception] = PeerFailure) -> None:
    """Raise `error_type` on every rank of `group` if any rank passes an error text; return on
    every rank otherwise ([Note: agreeing across ranks]). `what` prefixes the message
    ("what: error"). A collective (local without a process group); if the exchange itself
    fails (a peer died or stopped), `collective_error_type` is raised instead, so that a
    caller can tell a peer's failure from an agreed error."""
    errors = exchange(error, group, timeout_s=timeout_s, what=what or "agree", error_type=collective_error_type)
    msg = agreed_message(errors)
    if msg is not None:
        raise error_type(f"{what}: {msg}" if what else msg)


def agreed_message(errors: list) -> str | None:
    """The one message for a list of per-rank error texts (None where no rank failed): the
    text once, with the ranks that raised it when not all did, or each rank's text."""
    bad = [(r, e) for r, e in enumerate(errors) if e]
    if not bad:
        return None
    if len({e for _, e in bad}) == 1:
        msg = bad[0][1]
        if len(bad) < len(errors):
            msg += f" (on {ranks_text([r for r, _ in bad])})"
        return msg
    return "; ".join(f"rank {r}: {e}" for r, e in bad)


def rank0_then_agree(fn, group=None, *, what: str, timeout_s: float | None = None,
                     error_type: type[Exception] = RuntimeError, collective_error_type: type[Exception] = PeerFailure
                     ) -> None:
    """Run `fn()` on rank 0 of `group`, then make every rank raise the same error if it failed
    ("what failed on rank 0: Type: message"), instead of leaving the others in a barrier.
    A collective (local without a process group)."""
    error, text = None, None
    if group_size(group) == 1 or dist.get_rank(group) == 0:
        try:
            fn()
        except Exception as exc:  # noqa: BLE001 - re-raised below, on every rank
            error, text = exc, f"{type(exc).__name__}: {exc}"
    texts = exchange(text, group, timeout_s=timeout_s, what=what, error_type=collective_error_type)
    if texts[0] is not None:
        raise error_type(f"{what} failed on rank 0: {texts[0]}") from error


def digest(obj) -> str:
    """A 16-hex-digit sha256 of `obj` as canonical JSON (for checking that ranks hold equal
    documents without sending them whole)."""
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:16]
