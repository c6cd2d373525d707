"""The output folder (--save-dir): checked before anything starts (not a file, empty unless
--overwrite or resumed, writable) and locked by rank 0 for the run."""

from __future__ import annotations

import contextlib
import fcntl
import os
import socket
import tempfile

from .checkpoints import CKPT
from .constants import PROG
from .errors import FinetuneError, OutputError

LOCK_FILE = ".elastic-finetune.lock"

# [Note: the save-dir lock]
# Rank 0 holds an exclusive flock on save_dir/LOCK_FILE from before the first write to its
# exit (the kernel drops it when the process ends, however it ends), and writes its pid and
# host into it. A second run into the same folder is refused: prepare() tries the lock
# (without writing) to refuse before anything starts, and the lock taken after the process
# group is up closes the window between two runs that pass prepare() at the same moment (the
# test is a shared lock, so that the ranks of one job, probing together, do not refuse each
# other). The
# file stays (removing a lock file races with a run that has just opened it) and does not
# count as content of the folder. flock works across nodes on NFS (Linux emulates it with
# POSIX locks there).


def _lock_holder(fd: int) -> str:
    with contextlib.suppress(OSError, UnicodeDecodeError):
        text = os.pread(fd, 200, 0).decode().split()
        if len(text) >= 2:
            return f" (pid {text[0]} on {text[1]})"
    return ""


def _check_not_locked(save_dir: str) -> None:
    """prepare()'s test of the lock: fails if another run holds it; writes nothing."""
    path = os.path.join(save_dir, LOCK_FILE)
    try:
        fd = os.open(path, os.O_RDWR)  # read-write, as lock_save_dir opens it (NFS's flock emulation)
    except OSError:
        return  # no lock file (or unreadable: the write probe tells)
    try:
        # Shared: every rank of a job probes in prepare(), at the same moment on one node; two
        # exclusive probes refused each other ("in use by another run", seen once in the suite
        # on an idle machine), shared ones do not, and a run's exclusive lock refuses them all.
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        raise FinetuneError(
            f"--save-dir {save_dir} is in use by another {PROG} run{_lock_holder(fd)} (it holds {path}); "
            f"wait for it to finish or pass another --save-dir"
        ) from None
    except OSError:
        pass  # a file system without locks: the lock taken at the start will say so
    finally:
        os.close(fd)  # also releases the probe's lock


def lock_save_dir(save_dir: str) -> int:
    """Create save_dir and take its lock (see [Note: the save-dir lock]); returns the file
    descriptor that holds it (close it to release)."""
    path = os.path.join(save_dir, LOCK_FILE)
    try:
        os.makedirs(save_dir, exist_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
    except OSError as exc:
        raise OutputError(path, exc) from exc
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = _lock_holder(fd)
        os.close(fd)
        raise FinetuneError(
            f"--save-dir {save_dir} is in use by another {PROG} run{holder} (it holds {path}); "
            f"wait for it to finish or pass another --save-dir"
        ) from None
    except OSError as exc:
        os.close(fd)
        raise FinetuneError(f"--save-dir {save_dir}: cannot lock {path}: {exc.strerror}") from exc
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()} {socket.gethostname()}\n".encode(), 0)
    except OSError as exc:
        os.close(fd)
        raise OutputError(path, exc) from exc
    return fd


def _check_writable(save_dir: str) -> None:
    """Create and remove a file in save_dir (or, when it does not exist yet, a folder in its
    nearest existing ancestor): a read-only mount or folder, or a path under a regular file,
    is refused now rather than by the first checkpoint after training. Leaves nothing."""
    existing = save_dir
    while not os.path.exists(existing):
        parent = os.path.dirname(existing)
        if parent == existing:
            break
        existing = parent
    if not os.path.isdir(existing):
        raise FinetuneError(f"--save-dir {save_dir} cannot be created: {existing} is a file, not a directory")
    try:
        if existing == save_dir:
            fd, probe = tempfile.mkstemp(prefix=".write-probe-", dir=save_dir)
            os.close(fd)
            os.unlink(probe)
        else:
            os.rmdir(tempfile.mkdtemp(prefix=".write-probe-", dir=existing))
    except OSError as exc:
        where = "" if existing == save_dir else f" (cannot create it in {existing})"
        raise FinetuneError(f"--save-dir {save_dir} is not writable{where}: {exc.strerror or exc}") from exc


def check_save_dir(output, resume_ckpt: str | None) -> str:
    """The save dir of the output options (`output`: OutputConfig) checked: a directory, not
    locked by another run, empty unless --overwrite or the checkpoint resumed is its own,
    writable. Returns its absolute path."""
    save_dir = output.save_dir
    if save_dir is None:
        save_dir = os.path.dirname(resume_ckpt) if resume_ckpt and os.path.basename(resume_ckpt) == CKPT else (
            resume_ckpt if resume_ckpt else os.path.join("out", "finetune"))
    save_dir = os.path.abspath(save_dir)
    if os.path.exists(save_dir) and not os.path.isdir(save_dir):
        raise FinetuneError(f"--save-dir {save_dir} exists and is not a directory")
    if os.path.isdir(save_dir):
        _check_not_locked(save_dir)
    content = os.path.isdir(save_dir) and [f for f in os.listdir(save_dir) if f != LOCK_FILE]
    if content and not output.overwrite:
        own = resume_ckpt is not None and os.path.realpath(os.path.join(save_dir, CKPT)) == os.path.realpath(resume_ckpt)
        own = own or (resume_ckpt is not None and os.path.realpath(save_dir) == os.path.realpath(resume_ckpt))
        if not own:
            raise FinetuneError(
                f"--save-dir {save_dir} is not empty (results or a checkpoint of another run); pass --overwrite "
                f"to replace them, --resume {save_dir} to continue that run, or another --save-dir"
            )
    _check_writable(save_dir)
    return save_dir
