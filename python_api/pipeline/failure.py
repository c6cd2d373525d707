"""Ending every rank when one pipeline stage fails mid-step (`FailureWatch`).

[Note: a stage that fails mid-step]
When a stage raises inside a step (a bad batch, an out-of-memory, a bug), its peers are
blocked in a P2P wait for activations or gradients that will never come (measured on gloo:
inside `_wait_batch_p2p`, FINDINGS.md Q5). Nothing wakes them but the sockets closing (the
failing process exiting: 6-10 s of interpreter teardown on the development VM) or the group's
timeout ([Note: the mesh and its timeouts]); `_abort_process_group()` is NCCL-only and does
not unblock a gloo wait. A rank that catches the error and carries on into another
collective just meets peers still blocked in the step's P2P. So:
- the failing rank writes "rank R: <error>" under this pipeline's key in the default group's
  store, then re-raises;
- every rank runs a daemon thread that polls that key every 0.2 s while the rank is inside a
  step, and when it appears writes "elastic pipeline: ... a peer failed: rank R: <error>" to
  stderr and ends the process with exit code 1 (`os._exit`: a rank blocked in a gloo receive
  cannot be woken any other way; measured: every rank gone within 0.13 s);
- a rank that is not inside a step when the key appears raises PipelineError naming the
  failed rank at its next step, before any collective.
`fail_fast=False` leaves only the group timeouts (every blocked rank raises after timeout_s).
"""

from __future__ import annotations

import os
import sys
import threading
from contextlib import contextmanager

import torch.distributed as dist

from ..planner.pipeline import PipelineError

EXIT_CODE = 1
_POLL_S = 0.2
_instances = 0


def error_text(exc: BaseException) -> str:
    """"Type: first line", followed by " <- Type: first line" for each cause (torch wraps a
    stage's error in "[Stage k] failed to run forward": the cause is what happened)."""
    parts, seen = [], set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        lines = [ln.strip() for ln in str(exc).strip().splitlines() if ln.strip()]
        parts.append(f"{type(exc).__name__}: {(lines[0] if lines else '')[:300]}")
        exc = exc.__cause__
    return " <- ".join(parts)


def _store():
    try:
        return dist.distributed_c10d._get_default_store()
    except (AttributeError, RuntimeError, ValueError):
        return None


class FailureWatch:
    """[Note: a stage that fails mid-step]. Every rank builds one per pipeline, in the same
    order (the key is the instance's number)."""

    def __init__(self, rank: int, fail_fast: bool = True):
        global _instances
        _instances += 1
        self.rank = rank
        self.key = f"elastic_kernels/pipeline/{_instances}/failed"
        self.store = _store()
        self.fail_fast = bool(fail_fast) and self.store is not None
        self._in_step = False
        self._stop = threading.Event()
        self._thread = None
        if self.fail_fast:
            self._thread = threading.Thread(target=self._watch, name="elastic-pipeline-failure-watch", daemon=True)
            self._thread.start()

    def _peer_error(self) -> str | None:
        if self.store is None:
            return None
        try:
            if not self.store.check([self.key]):
                return None
            return self.store.get(self.key).decode(errors="replace")
        except Exception:  # noqa: BLE001 - the store itself gone: the collectives will say it
            return None

    def _watch(self) -> None:
        while not self._stop.wait(_POLL_S):
            if not self._in_step:
                continue
            error = self._peer_error()
            if error is not None and self._in_step:
                sys.stderr.flush()
                os.write(2, (f"elastic pipeline: rank {self.rank}: a peer stage failed during the step "
                             f"({error}); ending this rank, which was waiting for it in a pipeline P2P\n").encode())
                os._exit(EXIT_CODE)

    @contextmanager
    def step(self):
        """Around one step on this rank; raises the peer's failure if one was recorded."""
        error = self._peer_error()
        if error is not None:
            raise PipelineError(f"a pipeline stage failed in an earlier step ({error}); rebuild the pipeline")
        self._in_step = True
        try:
            yield
        except BaseException as exc:
            self._in_step = False
            if self.store is not None:
                text = f"rank {self.rank}: {error_text(exc)}"
                try:
                    self.store.set(self.key, text)
                except Exception:  # noqa: BLE001 - best effort; the timeouts still bound the peers
                    pass
            raise
        finally:
            self._in_step = False

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2 * _POLL_S + 1)
            self._thread = None

    def __del__(self):
        self._stop.set()


def wait_s() -> float:
    """How long a watcher may take to notice a failure (for tests)."""
    return _POLL_S + 0.05


__all__ = ["EXIT_CODE", "FailureWatch", "error_text", "wait_s"]
