"""Python face of the host store (``csrc/host/``): one shared host-memory segment per node.

A :class:`HostStore` is one segment of ``nbytes`` bytes that every local process maps
(``MAP_SHARED``): the creator makes it (:meth:`HostStore.create`), hands its :attr:`handle` (a
string) to the other local processes, which :meth:`HostStore.attach` it, and once all of them
have, calls :meth:`close_fd`: from then on the memory lives exactly as long as some process maps
it and nothing can be left behind, whatever way the processes end. Who creates, the exchange of
handles and the parallel fill are the node handshake in ``python_api/host/store.py``
(``node_host_store``); this module is the mechanism only.

The design notes are ``[Note: ...]`` blocks in ``csrc/host/host_store.cpp``:

- ``[Note: a segment that cannot leak]``: an anonymous memfd opened by the others through
  ``/proc/<creator pid>/fd/<fd>``; no name in ``/dev/shm`` ever;
- ``[Note: the shm fallback and its window]``: ``kind="shm"`` for processes in different PID
  namespaces, and the short window in which a SIGKILL can leave a ``/dev/shm/elastic-hs-*``;
- ``[Note: reserving the pages]``: ``create`` reserves every page, so a shortage is an error at
  create time, never a SIGBUS during the fill;
- ``[Note: pinning a shared mapping]``: :meth:`pin` (``cudaHostRegister``) per process.

Two implementations behind one contract: the compiled ``_C.HostStore`` when the extension is
loaded, and a pure-Python one (``os.memfd_create`` + ``mmap``) where it is not (an install with
``ELASTIC_SKIP_EXT=1``). Handles are the same string in both, so either can attach to the other.
The pure-Python one cannot pin (:meth:`pin` returns False) and its ``mmap`` object keeps a
private duplicate of the fd while the store is open (Python's ``mmap`` dups it; the duplicate is
close-on-exec and dies with the mapping, so it never outlives the process).

Errors: an operating-system failure (no memory, permission, a handle whose process is gone or
whose fd was closed, a size that does not match the segment) raises :class:`HostStoreError`, an
``OSError`` whose ``errno`` is set and whose message names the segment and the errno text; bad
arguments raise ``ValueError`` / ``TypeError``.
"""

from __future__ import annotations

import errno as _errno
import fcntl
import math
import mmap
import os
import secrets
from collections.abc import Sequence

import torch

from elastic_kernels import _ext

__all__ = ["HostStore", "HostStoreError"]

KINDS = ("memfd", "shm")
NAME_PREFIX = "elastic-hs-"


class HostStoreError(OSError):
    """An operating-system failure on a host store segment (``errno`` is set)."""


def _check_nbytes(what: str, nbytes) -> int:
    if not isinstance(nbytes, int) or isinstance(nbytes, bool):
        raise TypeError(f"{what}: nbytes must be an int, got {type(nbytes).__name__}")
    if nbytes <= 0:
        raise ValueError(f"{what}: nbytes must be positive, got {nbytes}")
    return nbytes


def _human(n: int) -> str:
    return f"{n} bytes" + (f" ({n >> 20} MiB)" if n >= 1 << 20 else "")


def _errtext(exc: OSError) -> str:
    return f"{os.strerror(exc.errno)} (errno {exc.errno})" if exc.errno else str(exc)


def _hint(err: int | None) -> str:
    if err in (_errno.ENOMEM, _errno.ENOSPC):
        return "; not enough free memory (or cgroup / /dev/shm limit) for the segment"
    if err in (_errno.EACCES, _errno.EPERM):
        return "; permission denied (another user, or a PID namespace without access)"
    return ""


def _parse_handle(handle) -> tuple[str, int, int, int, str]:
    if not isinstance(handle, str):
        raise TypeError(f"HostStore.attach: handle must be a str, got {type(handle).__name__}")
    parts = handle.split(":", 4)
    expected = "expected '<memfd|shm>:<pid>:<fd>:<inode>:<name>', as HostStore.handle gives"
    if len(parts) != 5 or parts[0] not in KINDS:
        raise ValueError(f"HostStore.attach: malformed handle {handle!r} ({expected})")
    try:
        pid, fd, ino = int(parts[1]), int(parts[2]), int(parts[3])
    except ValueError:
        raise ValueError(f"HostStore.attach: malformed handle {handle!r} (non-numeric pid, fd or inode; {expected})") from None
    name = parts[4]
    if pid <= 0 or fd < 0 or ino < 0 or not name.startswith(NAME_PREFIX) or "/" in name:
        raise ValueError(f"HostStore.attach: malformed handle {handle!r} ({expected})")
    return parts[0], pid, fd, ino, name


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class _PyStore:
    """The pure-Python implementation (no extension): same contract as ``_C.HostStore``."""

    def __init__(self, kind, creator, nbytes, name, handle, fd, mm):
        self.kind, self.creator, self.nbytes, self.name, self.handle = kind, creator, nbytes, name, handle
        self._fd, self._mm = fd, mm

    @classmethod
    def create(cls, nbytes: int, kind: str = "memfd") -> _PyStore:
        name = f"{NAME_PREFIX}{os.getpid()}-{secrets.token_hex(8)}"
        what = f"HostStore.create({_human(nbytes)}, {kind} segment {name})"
        try:
            if kind == "memfd":
                fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
            else:
                import _posixshmem

                fd = _posixshmem.shm_open("/" + name, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
                os.set_inheritable(fd, False)
        except OSError as exc:
            raise HostStoreError(exc.errno, f"{what}: {'memfd_create' if kind == 'memfd' else 'shm_open'} failed: "
                                 f"{_errtext(exc)}{_hint(exc.errno)}") from None
        step = "ftruncate"
        try:
            os.ftruncate(fd, nbytes)
            step = "fallocate (reserving the pages)"
            try:  # [Note: reserving the pages]
                os.posix_fallocate(fd, 0, nbytes)
            except OSError as exc:
                if exc.errno != _errno.EOPNOTSUPP:
                    raise
            if kind == "memfd":
                try:
                    fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL)
                except OSError:
                    pass
            step = "fstat"
            ino = os.fstat(fd).st_ino
            step = "mmap"
            mm = mmap.mmap(fd, nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except OSError as exc:
            os.close(fd)
            if kind == "shm":
                _shm_unlink_quietly(name)
            raise HostStoreError(exc.errno, f"{what}: {step} failed: {_errtext(exc)}{_hint(exc.errno)}") from None
        handle = f"{kind}:{os.getpid()}:{fd}:{ino}:{name}"
        return cls(kind, True, nbytes, name, handle, fd, mm)

    @classmethod
    def attach(cls, handle: str, nbytes: int) -> _PyStore:
        kind, pid, fd_no, ino, name = _parse_handle(handle)
        what = f"HostStore.attach({handle}, {_human(nbytes)})"
        if kind == "memfd":
            path = f"/proc/{pid}/fd/{fd_no}"
            try:
                fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
            except OSError as exc:
                if not _alive(pid):
                    why = f"; the creating process {pid} is gone (or lives in another PID namespace: use kind 'shm')"
                elif exc.errno == _errno.ENOENT:
                    why = (f"; process {pid} no longer has fd {fd_no} open (the creator called close_fd(): "
                           "attach before it does)")
                else:
                    why = _hint(exc.errno)
                raise HostStoreError(exc.errno, f"{what}: cannot open {path}: {_errtext(exc)}{why}") from None
            try:
                target = os.readlink(path)
            except OSError:
                target = ""
            if f"memfd:{name}" not in target:
                os.close(fd)
                raise HostStoreError(_errno.ESTALE, f"{what}: {path} is {target!r}, not the memfd {name} "
                                     "(the creator closed it and reused the fd number)")
        else:
            try:
                import _posixshmem

                fd = _posixshmem.shm_open("/" + name, os.O_RDWR, 0)
                os.set_inheritable(fd, False)
            except OSError as exc:
                why = (f"; no segment /dev/shm/{name} (the creator unlinked it: attach before it calls close_fd(), "
                       "or it is gone, or lives in another IPC namespace)") if exc.errno == _errno.ENOENT else _hint(exc.errno)
                raise HostStoreError(exc.errno, f"{what}: shm_open(/{name}) failed: {_errtext(exc)}{why}") from None
        try:
            st = os.fstat(fd)
            if st.st_ino != ino:
                raise HostStoreError(_errno.ESTALE, f"{what}: the file opened has inode {st.st_ino}, the handle names "
                                     f"inode {ino} (not the same segment)")
            if st.st_size != nbytes:
                raise HostStoreError(_errno.EINVAL, f"{what}: size mismatch: segment {name} has {_human(st.st_size)}, "
                                     f"attach asked for {_human(nbytes)}")
            try:
                mm = mmap.mmap(fd, nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
            except OSError as exc:
                raise HostStoreError(exc.errno, f"{what}: mmap failed: {_errtext(exc)}{_hint(exc.errno)}") from None
        finally:
            os.close(fd)  # the mapping holds the segment from here on
        return cls(kind, False, nbytes, name, handle, -1, mm)

    @staticmethod
    def can_pin() -> bool:
        return False

    @property
    def fd_open(self) -> bool:
        return self._fd >= 0

    def close_fd(self) -> None:
        if self._fd < 0:
            return
        if self.kind == "shm":
            _shm_unlink_quietly(self.name)
        os.close(self._fd)
        self._fd = -1

    @property
    def data_ptr(self) -> int:
        return self.tensor().data_ptr()

    pinned = False
    pinned_bytes = 0

    def pin(self) -> bool:
        return False

    def unpin(self) -> None:
        return None

    def tensor(self) -> torch.Tensor:
        # frombuffer keeps a reference to the mmap object: the mapping outlives the tensor.
        return torch.frombuffer(self._mm, dtype=torch.uint8)

    def __del__(self):
        try:
            self.close_fd()
        except Exception:  # noqa: BLE001 - interpreter teardown
            pass


def _shm_unlink_quietly(name: str) -> None:
    try:
        import _posixshmem

        _posixshmem.shm_unlink("/" + name)
    except OSError:
        pass


def _backend(impl: str):
    if impl == "auto":
        return _ext.load().HostStore if _ext.available() else _PyStore
    if impl == "cpp":
        return _ext.require().HostStore
    if impl == "python":
        return _PyStore
    raise ValueError(f"HostStore: impl must be 'auto', 'cpp' or 'python', got {impl!r}")


class HostStore:
    """One shared host-memory segment (see the module docstring).

    ``HostStore.create(nbytes)`` / ``HostStore.attach(handle, nbytes)``; :meth:`tensor` is a
    ``uint8`` CPU tensor over the whole segment whose lifetime keeps the mapping alive (also
    after :meth:`close`), :meth:`view` a typed view at a byte offset. ``impl`` picks the
    implementation: ``"auto"`` (the compiled one when the extension is loaded), ``"cpp"``,
    ``"python"``.
    """

    __slots__ = ("_impl", "_tensor", "_handle", "_nbytes", "_kind", "_creator", "_impl_name", "__weakref__")

    def __init__(self, impl_obj, impl_name: str):
        # Use create() or attach().
        self._impl = impl_obj
        self._tensor = None
        self._handle = impl_obj.handle
        self._nbytes = impl_obj.nbytes
        self._kind = impl_obj.kind
        self._creator = impl_obj.creator
        self._impl_name = impl_name

    @classmethod
    def create(cls, nbytes: int, *, kind: str = "memfd", impl: str = "auto") -> HostStore:
        """A new zeroed segment of ``nbytes`` bytes, its pages reserved, mapped here; this
        process keeps it open for others to attach until :meth:`close_fd`."""
        _check_nbytes("HostStore.create", nbytes)
        if kind not in KINDS:
            raise ValueError(f"HostStore.create: kind must be one of {KINDS}, got {kind!r}")
        backend = _backend(impl)
        return cls(backend.create(nbytes, kind), "python" if backend is _PyStore else "cpp")

    @classmethod
    def attach(cls, handle: str, nbytes: int, *, impl: str = "auto") -> HostStore:
        """Map the segment another local process created (its :attr:`handle`); it must have
        exactly ``nbytes`` bytes."""
        _check_nbytes("HostStore.attach", nbytes)
        _parse_handle(handle)  # one message for a malformed handle, whichever implementation
        backend = _backend(impl)
        return cls(backend.attach(handle, nbytes), "python" if backend is _PyStore else "cpp")

    @staticmethod
    def can_pin(impl: str = "auto") -> bool:
        """Whether :meth:`pin` page-locks on this build and machine (CUDA build, GPU visible)."""
        return bool(_backend(impl).can_pin())

    # ---- properties ----

    @property
    def handle(self) -> str:
        return self._handle

    @property
    def nbytes(self) -> int:
        return self._nbytes

    @property
    def kind(self) -> str:
        return self._kind

    @property
    def creator(self) -> bool:
        return self._creator

    @property
    def impl(self) -> str:
        """``"cpp"`` or ``"python"``."""
        return self._impl_name

    @property
    def closed(self) -> bool:
        return self._impl is None

    @property
    def fd_open(self) -> bool:
        return self._impl is not None and self._impl.fd_open

    @property
    def pinned(self) -> bool:
        return self._impl is not None and bool(self._impl.pinned)

    @property
    def pinned_bytes(self) -> int:
        return int(self._impl.pinned_bytes) if self._impl is not None else 0

    @property
    def data_ptr(self) -> int:
        return self.tensor().data_ptr()

    # ---- handshake ----

    def close_fd(self) -> None:
        """Creator: let go of the fd (kind ``"shm"``: unlink the name) once every local process
        has attached; no-op elsewhere and the second time."""
        if self._impl is not None:
            self._impl.close_fd()

    # ---- memory ----

    def _live(self, what: str):
        if self._impl is None:
            raise RuntimeError(f"HostStore.{what}: the store {self._handle} is closed")
        return self._impl

    def tensor(self) -> torch.Tensor:
        """The whole segment as a 1-D ``uint8`` CPU tensor (the same tensor on every call)."""
        impl = self._live("tensor")
        if self._tensor is None:
            self._tensor = impl.tensor()
        return self._tensor

    def view(self, offset: int, dtype: torch.dtype, shape: int | Sequence[int]) -> torch.Tensor:
        """``prod(shape)`` elements of ``dtype`` from byte ``offset`` (a multiple of the
        element size), as a tensor sharing the segment's memory."""
        if not isinstance(offset, int) or isinstance(offset, bool) or offset < 0:
            raise ValueError(f"HostStore.view: offset must be a non-negative int, got {offset!r}")
        if not isinstance(dtype, torch.dtype):
            raise TypeError(f"HostStore.view: dtype must be a torch.dtype, got {dtype!r}")
        dims = (shape,) if isinstance(shape, int) else tuple(shape)
        for d in dims:
            if not isinstance(d, int) or isinstance(d, bool) or d < 0:
                raise ValueError(f"HostStore.view: shape must be non-negative ints, got {shape!r}")
        itemsize = dtype.itemsize
        n = math.prod(dims) * itemsize
        if offset % itemsize:
            raise ValueError(f"HostStore.view: offset {offset} is not a multiple of the {itemsize}-byte elements of {dtype}")
        if offset + n > self._nbytes:
            raise ValueError(f"HostStore.view: bytes [{offset}, {offset + n}) for a {dims} tensor of {dtype} "
                             f"are outside the store's {self._nbytes} bytes")
        return self.tensor()[offset:offset + n].view(dtype).view(dims)

    def pin(self, device: torch.device | str | int | None = None) -> bool:
        """Page-lock this process's mapping (``cudaHostRegister``) so host-to-device copies from
        it are asynchronous DMA; returns :attr:`pinned`. False, and nothing done, on a build
        without CUDA, without a visible GPU, or with the pure-Python implementation.
        ``device``: the CUDA device made current for the call (give the rank's own: the first
        CUDA call of a process creates a context on the current device)."""
        impl = self._live("pin")
        if device is not None and torch.device(device).type == "cuda" and impl.can_pin():
            with torch.cuda.device(torch.device(device)):
                return bool(impl.pin())
        return bool(impl.pin())

    def unpin(self) -> None:
        if self._impl is not None:
            self._impl.unpin()

    def close(self) -> None:
        """Close the fd (creator) and drop this object's mapping: the memory goes when no
        tensor from :meth:`tensor` / :meth:`view` is left either (never a dangling view).
        Idempotent."""
        impl, self._impl, self._tensor = self._impl, None, None
        if impl is not None:
            impl.close_fd()

    def __enter__(self) -> HostStore:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._impl is None else ("pinned" if self.pinned else "unpinned")
        return f"HostStore({self._handle!r}, nbytes={self._nbytes}, impl={self._impl_name!r}, {state})"
