"""Run a function on N gloo processes and turn any rank's failure into a test failure.

    results = run_distributed(fn, world_size, *args, timeout=120)

`fn(rank, world_size, *args, **kwargs)` runs in a fresh process per rank (forked from a server
that has imported the heavy modules once) with the default process group initialised (gloo,
file:// rendezvous in a private temporary folder).
Its return value must be picklable; the list of them, indexed by rank, is returned.

Failure modes, each an AssertionError carrying the details:
  - a rank raises: its traceback (and those of any other rank that failed) is in the message;
    ranks still blocked in a collective are killed after a short grace period;
  - a rank dies without reporting (segfault, os._exit): its exit code is reported;
  - nothing finished within `timeout` seconds: the ranks that did not finish are named.
The helper never waits longer than `timeout` plus a few seconds of cleanup.

[Note: ranks start from a fork server]
Every call starts fresh processes (no state is carried from one test to the next), but not by
`spawn`: a spawned rank imports torch, transformers, peft and the library anew, 5-10 s of CPU
per rank on this 2-core machine, paid hundreds of times by the suite. The ranks come from
multiprocessing's fork server instead, which imports those modules once (`_PRELOAD`) and forks
a clean copy of itself for each rank: the same modules, none of the test process's state, and
no thread or CUDA context (the server runs no torch op and never touches CUDA). The parent's
environment travels with each call (the server was started with the environment of its first
use), so a variable set in a test reaches its ranks as it did with spawn.
"""

from __future__ import annotations

import datetime
import multiprocessing as mp
import os
import pickle
import queue
import sys
import tempfile
import time
import traceback

# After the first rank fails, how long the others get to report their own error before they
# are killed (a rank blocked in a collective with a dead peer would otherwise wait for the
# gloo timeout).
_GRACE_S = 5.0


# What the fork server imports once, before it forks the ranks ([Note: ranks start from a
# fork server]). A module missing here is imported by each rank as needed, as with spawn.
_PRELOAD = ["torch", "torch.distributed", "elastic_kernels", "elastic_kernels.api", "transformers", "peft", "tests._dist"]


def _context():
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)
    return ctx


def _worker(fn, rank, world_size, init_file, results, args, kwargs, timeout, environ=None):
    """One rank: init the group, run fn, end the group, report, and leave without the
    interpreter's teardown.

    [Note: how a test rank ends]
    The process group is destroyed before the result goes back, and the result is flushed
    (the queue's feeder thread joined) before the process leaves with os._exit: gloo's worker
    threads can abort a process at interpreter teardown ("terminate called without an active
    exception", pytorch#190489), even after destroy_process_group, and a rank that aborted
    before its queued result was written would be reported as lost. The CLI ends the same way
    ([Note: exiting without teardown] in python_api/finetune/cli.py)."""
    if environ is not None:
        os.environ.clear()
        os.environ.update(environ)
    import torch
    import torch.distributed as dist

    # 2-4 ranks share a 2-core machine: one intra-op thread each avoids oversubscription.
    torch.set_num_threads(1)
    try:
        dist.init_process_group(
            "gloo",
            init_method=f"file://{init_file}",
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=timeout),
        )
        out = fn(rank, world_size, *args, **kwargs)
        # Plain pickle to bytes: a tensor put on a multiprocessing queue as is travels as a
        # shared-memory handle that dies with this process, before the parent reads it.
        message = ("ok", rank, pickle.dumps(out))
    except BaseException:  # noqa: BLE001 - everything goes back to the parent
        message = ("err", rank, traceback.format_exc())
    try:
        if dist.is_initialized():
            dist.destroy_process_group()
    except BaseException:  # noqa: BLE001
        message = ("err", rank, (message[2] if message[0] == "err" else "") + "destroy_process_group failed:\n"
                   + traceback.format_exc())
    results.put(message)
    results.close()
    results.join_thread()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_distributed(fn, world_size: int, *args, timeout: float = 120.0, **kwargs):
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    ctx = _context()
    with tempfile.TemporaryDirectory(prefix="elastic_dist_") as tmp:
        init_file = os.path.join(tmp, "rendezvous")
        results = ctx.Queue()
        procs = [
            ctx.Process(
                target=_worker,
                args=(fn, rank, world_size, init_file, results, args, kwargs, timeout, dict(os.environ)),
                daemon=True,
            )
            for rank in range(world_size)
        ]
        for p in procs:
            p.start()
        ok, errors = {}, {}
        deadline = time.monotonic() + timeout
        try:
            while len(ok) + len(errors) < world_size:
                now = time.monotonic()
                if now >= deadline:
                    break
                try:
                    kind, rank, payload = results.get(timeout=min(0.2, deadline - now))
                except queue.Empty:
                    for rank, p in enumerate(procs):
                        if p.exitcode is not None and rank not in ok and rank not in errors:
                            # Give its queued message a moment to arrive before calling it lost.
                            try:
                                kind, r, payload = results.get(timeout=1.0)
                                (ok if kind == "ok" else errors)[r] = payload
                            except queue.Empty:
                                errors[rank] = f"rank {rank} exited with code {p.exitcode} without reporting"
                    continue
                (ok if kind == "ok" else errors)[rank] = payload
                if errors:
                    deadline = min(deadline, time.monotonic() + _GRACE_S)
        finally:
            for p in procs:
                if p.is_alive():
                    p.kill()
            for p in procs:
                p.join(timeout=10)
    if errors:
        msg = "\n".join(f"--- rank {r} ---\n{errors[r]}" for r in sorted(errors))
        missing = sorted(set(range(world_size)) - set(ok) - set(errors))
        if missing:
            msg += f"\n(ranks {missing} were still running and were killed)"
        raise AssertionError(f"{len(errors)} of {world_size} ranks failed:\n{msg}")
    if len(ok) < world_size:
        missing = sorted(set(range(world_size)) - set(ok))
        raise AssertionError(f"ranks {missing} did not finish within {timeout:.0f}s (hang?)")
    return [pickle.loads(ok[r]) for r in range(world_size)]
