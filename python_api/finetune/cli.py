"""The entry point (`elastic-finetune`, `python -m elastic_kernels.api.finetune`): main() parses the
options, prepares the job, starts the process group, has the ranks agree on the
configuration, locks the save dir, runs, and reports a failure as one line."""

from __future__ import annotations

import datetime
import logging
import os
import sys
import traceback
import warnings

import torch
import torch.distributed as dist

from ..distributed.agree import PeerFailure
from ..loading import LoadWarning
from .agreement import agree_configuration, agree_error
from .checkpoints import CKPT
from .configuration import FinetuneConfig
from .constants import PROG
from .errors import FinetuneError
from .job import job_device, prepare
from .measure import fix_mmap_threshold
from .options import parse_config
from .runner import run
from .save_dir import lock_save_dir


def _dist_env() -> tuple[int, int, int]:
    """Rank, world size and local rank from torchrun's environment; a lone process (no
    torchrun) gets a one-process group on a free local port."""
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        import socket

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ.get("LOCAL_RANK", "0"))


# [Note: a rank that stops]
# A rank that dies closes its connections: its peers fail at once ("Connection closed by
# peer") and exit. A rank that stops (SIGSTOP, a hung driver, a swapped-out node) keeps them
# open: its peers wait in their next collective for --timeout-s (the process group's timeout
# and the runtime's collective timeout), then fail with "Timed out ..." and exit (reported by
# main() as one line). Nothing inside the stopped process runs, so no timeout of its own can
# fire, and nothing in this CLI can see it. What ends it is its torchrun agent: with the
# static rendezvous (--master-addr/--master-port) the agent only checks that its workers are
# alive, which a stopped one is, and waits forever; with --rdzv-backend c10d the agent syncs
# with the rendezvous store every --monitor-interval seconds, so when the store's host (the
# agent at --rdzv-endpoint) exits, the other agents fail their next sync and stop their
# workers (SIGTERM, then SIGKILL after the shutdown timeout, which ends a stopped process
# too). Measured on one machine (two 'nodes', --timeout-s 20, --monitor-interval 1):
# static, the surviving side exits after 25 s and the stopped side is still there 80 s later;
# c10d, 24 s and 56 s.


def _show_load_warnings(rank: int) -> None:
    """The loader's warnings (elastic_kernels.api.loading.LoadWarning: tied weights loaded untied, tensors
    of the files the model does not use) as one line on rank 0, like the CLI's own warnings;
    the other ranks see the same files and stay quiet. Each message once: every engine of the
    job (the main run, the comparisons) loads the same files."""
    real = warnings.showwarning
    shown: set[str] = set()

    def show(message, category, filename, lineno, file=None, line=None):
        if not issubclass(category, LoadWarning):
            return real(message, category, filename, lineno, file, line)
        if rank == 0 and str(message) not in shown:
            shown.add(str(message))
            sys.stderr.write(f"{PROG}: warning: {message}\n")
            sys.stderr.flush()

    warnings.showwarning = show
    warnings.simplefilter("always", LoadWarning)  # deduplicated by `show`, whichever module issued it


def _peer_failure(exc: BaseException) -> bool:
    """A collective that failed because of another rank (its exit, a stop, a timeout), as
    opposed to an error of this rank's own."""
    if isinstance(exc, (dist.DistError, PeerFailure)):
        return True
    text = str(exc)
    return isinstance(exc, RuntimeError) and any(s in text for s in (
        "Timed out", "timed out", "Connection closed by peer", "Connection reset by peer", "Broken pipe"))


def main(argv=None) -> int:
    # transformers 5.23 warns about its own deprecated attribute whenever FSDP2 inspects the
    # model; it says nothing about this job.
    warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.* is deprecated")
    # bitsandbytes (imported by PEFT) logs at import that an optional CPU kernel package is
    # absent; its CPU path works without it, and the line says nothing about this job.
    logging.getLogger("bitsandbytes.backends.cpu.ops").addFilter(
        lambda record: "kernels-community" not in record.getMessage())
    # Before the first big allocation: the resident set is comparable across engines only so
    # ([Note: a fixed mmap threshold] in measure.py; the report says whether it was fixed).
    fix_mmap_threshold()
    config = parse_config(argv)
    rank, world_size, local_rank = _dist_env()
    with warnings.catch_warnings():  # the loader's warnings as CLI lines, for this call only
        _show_load_warnings(rank)
        return _main(config, rank, world_size, local_rank)


def _main(config: FinetuneConfig, rank: int, world_size: int, local_rank: int) -> int:
    job, error = None, None
    timeout_s = config.elastic.timeout_s
    try:
        job = prepare(config, rank, world_size, local_rank)
    except FinetuneError as exc:
        error = str(exc)
    try:
        device = job.device if job is not None else job_device(config.model, local_rank)
    except FinetuneError:
        device = torch.device("cpu")
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s),
                            device_id=device if device.type == "cuda" else None)
    lock = None
    try:
        agree_error(error, world_size)
        agree_configuration(job)
        error = None
        if rank == 0:
            try:
                lock = lock_save_dir(job.save_dir)
            except FinetuneError as exc:
                error = str(exc)
        agree_error(error, world_size)
        run(job)
    except FinetuneError as exc:
        # One write per message: several ranks share the terminal or pipe.
        sys.stderr.flush()
        os.write(2, f"{PROG}: error: {exc}\n".encode())
        return 2
    except Exception as exc:  # noqa: BLE001 - only a peer's failure is reported here; the rest re-raised
        if not _peer_failure(exc):
            raise
        first = (str(exc).strip().splitlines() or [""])[0][:300]
        sys.stderr.flush()
        os.write(2, (f"{PROG}: error: rank {rank}: a collective did not complete ({type(exc).__name__}: {first}): "
                     f"another rank stopped, crashed, was killed or fell more than --timeout-s ({timeout_s:g} s) "
                     f"behind; see that rank's output (checkpoints, if any: "
                     f"{os.path.join(job.save_dir, CKPT) if job is not None else '--save-dir'}). A stopped, not "
                     f"dead, rank on another node is not ended by torchrun's static rendezvous: launch with "
                     f"--rdzv-backend c10d (see [Note: a rank that stops] in python_api/finetune/cli.py)\n").encode())
        return 1
    finally:
        if lock is not None:
            os.close(lock)  # releases the save-dir lock (so does the process's exit)
        dist.destroy_process_group()
    return 0


# [Note: workers end with their launcher]
# torchrun's agent ends its workers when it is told to stop (SIGTERM, SIGINT), but an agent that
# is SIGKILLed (the OOM killer, `kill -9`, a scheduler's hard stop) leaves them training: they
# hold the node's host store, their device memory and the save-dir lock until killed by hand.
# So each worker started by torchrun (TORCHELASTIC_RUN_ID in its environment) asks the kernel to
# send it SIGKILL when its parent dies: prctl(PR_SET_PDEATHSIG). SIGKILL, not SIGTERM, because a
# worker blocked inside a collective or a CUDA call must end too, and nothing it holds outlives
# the process (the host store is an anonymous memfd, the lock a flock). The signal follows the
# death of the thread that forked the worker; torchrun starts its workers from the agent's main
# thread (torch/distributed/elastic/multiprocessing/api.py, SubprocessContext._start). The race:
# a parent that died before the call leaves the worker re-parented and no signal ever comes, so
# the parent's pid is read when this module is imported (the earliest point of the CLI's own
# code) and compared after the call; a worker whose parent changed in between exits at once.
# A parent that dies before this module is imported (during `import torch`) is not seen. Not
# set for a process started without torchrun (`python -m elastic_kernels.api.finetune` under nohup
# must outlive its shell).
_PARENT_AT_IMPORT = os.getppid()
_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    """See [Note: workers end with their launcher]. Linux only; elsewhere nothing is done."""
    if "TORCHELASTIC_RUN_ID" not in os.environ or not sys.platform.startswith("linux"):
        return
    import ctypes
    import signal

    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
        err = ctypes.get_errno()
        sys.stderr.write(f"{PROG}: warning: prctl(PR_SET_PDEATHSIG) failed ({os.strerror(err)}): this worker will "
                         f"not end by itself if its launcher is killed\n")
        return
    if os.getppid() != _PARENT_AT_IMPORT:
        sys.stderr.write(f"{PROG}: error: the launcher (pid {_PARENT_AT_IMPORT}) exited before this worker started; "
                         "exiting\n")
        sys.stderr.flush()
        os._exit(1)


def entry() -> None:
    """The process entry point (`python -m elastic_kernels.api.finetune`, the `elastic-finetune` script):
    `main()`, then exit without the interpreter's teardown.

    [Note: exiting without teardown]
    Twice in this project's test runs (2026-12-01, two of some hundred 2-rank launches on the
    loaded 2-core VM) a rank that had finished its job, written every file and destroyed its
    process group died at interpreter exit with "terminate called without an active
    exception" (SIGABRT), failing the launch. That is gloo's known teardown problem: its worker
    threads can still hold work objects whose tensors point into Python while the interpreter
    is being finalized (pytorch/pytorch#179291, #190489). Everything the job writes is
    written, agreed and closed before `main()` returns, so the process flushes its streams
    and leaves with `os._exit`, skipping the finalization that can crash. A worker started by
    torchrun ends with its launcher ([Note: workers end with their launcher]).
    Every way out of `main()` leaves so (issue 31, item 4): an error that is not the CLI's own
    (a bug, an unexpected exception of a library) is printed as Python prints it, with its
    traceback, and the process exits 1; argparse's exits (`--help`, a bad option) and Ctrl-C
    keep their codes (0/2, 130). `_main` has destroyed the process group before any of them
    reaches here. Before, such an exception left through the interpreter's finalization, the
    path on which gloo's threads abort."""
    _die_with_parent()
    try:
        code = main()
    except SystemExit as exc:  # argparse (--help, a bad option); sys.exit(...) anywhere below
        if isinstance(exc.code, int) or exc.code is None:
            code = exc.code or 0
        else:  # sys.exit("message"): Python prints the message and exits 1
            sys.stderr.write(f"{exc.code}\n")
            code = 1
    except KeyboardInterrupt:
        traceback.print_exc()
        code = 130
    except BaseException:  # noqa: BLE001 - printed in full, then the same exit as every other path
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
