"""The per-node handshake of the host store: one shared segment per node, filled in parallel.

    store = node_host_store(nbytes, group=None, fill=None, timeout_s=None, device=None)
    store, info = build_node_host_store(...)   # the same, and where this rank is (NodeStoreInfo)

Collective over ``group`` (every rank calls it with the same ``nbytes``). The mechanism is
``elastic_kernels.HostStore`` (``csrc/host/``); this module decides who creates, who attaches
and when the creator lets go, per [Note: the node handshake].

[Note: the node handshake]
1. Who is where: every rank contributes (host name + kernel boot id, its PID namespace); ranks
   with the same host name and boot id are one *node* (no environment variable is assumed:
   LOCAL_RANK is not needed). Local ranks are numbered by rank; the lowest rank of each node
   is its *creator*.
2. The creator of each node creates the segment (``HostStore.create``: refused when the node
   has not that much memory available, else reserved, zeroed, sealed); the handles (or the
   creators' errors) are exchanged.
3. The other local ranks attach (map) it. Every rank's outcome is exchanged, so a failure
   anywhere is an error everywhere, never a hang; the stores are closed on the way out.
4. The creator closes its fd (``close_fd``; kind "shm": unlinks the name). From here on the
   memory exists only as the mappings of live processes: any way a process ends, nothing is
   left once the last one has gone ([Note: a segment that cannot leak] in
   csrc/host/host_store.cpp).
5. With a CUDA ``device`` every rank page-locks its own mapping (``pin``) under that device. A
   registration that fails (``cudaHostRegister``: too much locked memory, a driver limit) is a
   warning, not an error: that rank copies from pageable memory, slower but correct, and its
   stats say so ([Note: pinned bytes are counted once per node]).
6. ``fill(store, local_rank, local_world)`` runs on every rank, each writing its share (see
   ``local_share``) in parallel; the outcome (fill errors, and which ranks pinned) is
   exchanged, which is also the final barrier: when node_host_store returns, every rank's
   share is written.

Kind: the memfd is reached through ``/proc/<creator pid>/fd``, which works only inside one PID
namespace; local ranks whose PID namespaces differ use kind "shm" from the start
([Note: the shm fallback and its window]), and if attaching a memfd fails anyway (a /proc
mounted without access, another user) the handshake runs once more with "shm" on the nodes
where it failed ([Note: the shm retry is decided by every rank alike]). ``kind=`` forces one.

[Note: the shm retry is decided by every rank alike]
Whether to run steps 2-3 once more is a collective decision: the ranks that retry issue the
collectives of a second round, and a rank that does not would leave them waiting. So it is
taken from the exchanged per-rank outcomes (each rank's node, its node's kind, its error),
identical on every rank, never from this rank's own node: nodes of different kinds (one whose
ranks share a PID namespace and use a memfd, one that uses shm from the start) would otherwise
take different paths. Retry iff every failure is a failed attach of a memfd that shm can get
around (/proc/<pid>/fd could not be opened: EACCES, EPERM, ENOENT; not a size mismatch); then
every rank takes part in the second round: nodes where an attach failed switch to "shm" and
create again, the other nodes keep the segment they already mapped and only join the
exchanges.

[Note: the set-up's own time bound]
Creating a store zeroes every page (the creator, about memset speed), filling it copies the
frozen weights in (from the model files: disk speed), pinning registers every rank's mapping
with the driver; for a 140 GB store that can take longer than the collective timeout
(``timeout_s``, 300 s by default, which also bounds every collective of the process group),
and the error would then blame a peer for what is only a slow stage. So the two long waits
(for the creators' zeroing, and for every rank's pin and fill) are not collectives: each rank
writes a key into the process group's store when it has finished its part (and, before each
part, which part it is in) and waits for every rank's key with the set-up bound
``setup_timeout_s``: by default ``timeout_s`` (or the store's timeout) plus one second per
``SETUP_BYTES_PER_S`` (256 MiB/s, a slow disk) of the store, or the value given
(``ElasticPolicy.host_setup_timeout_s``). A rank that gives up writes an abort key that the
others find after their own wait, and its error names the stage, the ranks that had not
finished it and what each of them was doing (zeroing, pinning, filling) and for how long this
rank's own part took. Once every rank has finished, the outcomes are exchanged by a (short)
collective bounded by ``timeout_s``. Without a store to meet in (a process group set up
without one) the waits are collectives bounded by the set-up bound, which the process group's
own timeout may cut short. A rank that *dies* during the fill is then noticed only when the
bound expires (a store cannot tell a dead rank from a slow one); its launcher (torchrun) ends
the others sooner.

Timeouts: each short collective of the handshake waits at most ``timeout_s`` (on gloo; on NCCL
the process group's own timeout applies, as for every collective of the runtime); ``None``
means the process group's timeout. A rank that dies (SIGKILL, SIGTERM) makes the others fail
with :class:`HostStoreSetupError` within the set-up bound, or at once when a collective sees
the connection drop.
"""

from __future__ import annotations

import datetime
import errno
import os
import socket
import time
import warnings
import zlib
from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.distributed as dist

from elastic_kernels.host_store import HostStore, HostStoreError

from ..distributed.agree import agreed_message, exchange

__all__ = [
    "SETUP_BYTES_PER_S", "HostStoreSetupError", "NodeLayout", "NodeStoreInfo", "build_node_host_store", "local_share",
    "node_host_store", "node_identity", "setup_bound_s",
]

Fill = Callable[[HostStore, int, int], object]

# The slowest rate assumed for a node to zero, fill and pin its store: the default set-up bound
# adds one second per this many bytes ([Note: the set-up's own time bound]).
SETUP_BYTES_PER_S = 256 << 20


class HostStoreSetupError(RuntimeError):
    """The node handshake failed on some rank; raised on every rank."""


class NodeLayout(NamedTuple):
    """This rank's place among the ranks of ``group`` (ranks are ranks in the group)."""

    node: int  # index of this rank's node, nodes numbered by their lowest rank
    local_rank: int
    local_world: int
    creator: int  # the group rank that creates this node's segment
    local_ranks: tuple[int, ...]
    kind: str  # "memfd" or "shm": what this node's segment will be


class NodeStoreInfo(NamedTuple):
    """Where this rank stands in its node's store ([Note: pinned bytes are counted once per node]).

    [Note: pinned bytes are counted once per node]
    Every local rank maps the one segment and registers (pins) its own mapping, but the
    physical pages are the node's, locked once however many registrations hold them. A
    per-rank counter that reported the whole store on every local rank would make the sum over
    a node's ranks L times the memory locked. So the store's pinned bytes are reported by one
    rank per node: the lowest local rank whose registration succeeded (`reports_pinned`); a
    rank whose registration failed copies from pageable memory and reports none of it. Summed
    over the ranks of a node, `host_pinned_bytes` is the node's page-locked memory."""

    layout: NodeLayout
    pinned: tuple[bool, ...]  # per local rank of this node (layout.local_ranks order): mapping page-locked
    reports_pinned: bool  # this rank is the one that counts the store's pinned bytes


def node_identity() -> str:
    """Host name and kernel boot id: equal exactly for processes that can share memory."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = "no-boot-id"
    return f"{socket.gethostname()}/{boot}"


def _pid_namespace() -> int | None:
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return None


def local_share(nbytes: int, local_rank: int, local_world: int, align: int = 4096) -> tuple[int, int]:
    """Bytes ``[start, stop)`` of a ``nbytes`` store that ``local_rank`` of ``local_world``
    fills: contiguous, cut at multiples of ``align`` (pages never shared between writers),
    every byte in exactly one share."""
    if not 0 <= local_rank < local_world:
        raise ValueError(f"local_share: local_rank {local_rank} is not in [0, {local_world})")
    units = -(-nbytes // align)
    start = min(nbytes, (units * local_rank // local_world) * align)
    stop = min(nbytes, (units * (local_rank + 1) // local_world) * align)
    return start, stop


def setup_bound_s(nbytes: int, timeout_s: float | None, setup_timeout_s: float | None = None) -> float | None:
    """The set-up bound of a store of ``nbytes`` ([Note: the set-up's own time bound]):
    ``setup_timeout_s`` when given, else ``timeout_s`` plus one second per SETUP_BYTES_PER_S;
    None (the process group's or the store's own timeout) when both are None."""
    if setup_timeout_s is not None:
        return float(setup_timeout_s)
    if timeout_s is None:
        return None
    return float(timeout_s) + nbytes / SETUP_BYTES_PER_S


# ---------------------------------------------------------------------------------- collectives


def _exchange(obj, group, timeout_s: float | None, what: str) -> list:
    return exchange(obj, group, timeout_s=timeout_s, what=f"node_host_store ({what})", error_type=HostStoreSetupError)


def _raise_if_any(errors: list, what: str) -> None:
    """Raise the same HostStoreSetupError on every rank when any entry of the exchanged list
    (an error text per rank, identical on every rank) is set."""
    msg = agreed_message(errors)
    if msg is not None:
        raise HostStoreSetupError(f"node_host_store ({what}) failed: {msg}")


def _error_text(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


def _human(n: int) -> str:
    return f"{n} bytes ({n / 2**30:.2f} GiB)" if n >= 1 << 30 else f"{n} bytes ({n >> 20} MiB)"


class _SetupWait:
    """The long waits of the set-up, in the process group's store ([Note: the set-up's own
    time bound]). One per node_host_store call on every rank of the group; stages are waited
    for in the same order everywhere."""

    _calls: dict[tuple[int, ...], int] = {}  # per group: node_host_store calls so far (same on every rank)

    def __init__(self, group, nbytes: int, bound_s: float | None, setup_timeout_s: float | None):
        self.group, self.nbytes, self.bound_s, self.explicit = group, nbytes, bound_s, setup_timeout_s is not None
        self.rank, self.world = dist.get_rank(group), dist.get_world_size(group)
        try:
            self.store = dist.distributed_c10d._get_default_store()
        except (AttributeError, RuntimeError, ValueError):
            self.store = None
        ranks = tuple(dist.get_process_group_ranks(group))
        n = self._calls.get(ranks, 0)
        self._calls[ranks] = n + 1
        tag = zlib.crc32(",".join(map(str, ranks)).encode()) & 0xFFFFFFFF
        self.prefix = f"elastic_kernels/host_store/{tag:08x}/{n}"
        self.started = {}

    def _key(self, stage: str, what: str, rank: int | None = None) -> str:
        return f"{self.prefix}/{stage}/{what}/{self.rank if rank is None else rank}"

    def doing(self, stage: str, activity: str) -> None:
        """This rank is now doing `activity` (named in a peer's timeout error)."""
        self.started[stage] = self.started.get(stage, time.monotonic())
        if self.store is not None:
            self.store.set(self._key(stage, "doing"), f"{activity}@{time.time():.3f}")

    def wait_all(self, stage: str, description: str) -> None:
        """This rank has finished `stage`; wait for every rank of the group to finish it."""
        mine = time.monotonic() - self.started.get(stage, time.monotonic())
        bound = self.bound_s
        if self.store is None:  # no store: a barrier collective, bounded by the set-up bound
            _raise_if_any(_exchange(None, self.group, bound, f"waiting for every rank's {description}"), stage)
            return
        store = self.store
        store.set(self._key(stage, "done"), "1")
        keys = [self._key(stage, "done", r) for r in range(self.world)]
        abort = f"{self.prefix}/{stage}/abort"
        try:
            if bound is None:
                store.wait(keys)
            else:
                store.wait(keys, datetime.timedelta(seconds=bound))
        except Exception as exc:  # noqa: BLE001 - a timeout (or the store went away): say what was slow
            msg = self._slow_message(stage, description, keys, mine, bound, exc)
            try:
                store.set(abort, msg)
            except Exception:  # noqa: BLE001, S110 - the store itself is gone: the message says enough
                pass
            raise HostStoreSetupError(msg) from exc
        if store.check([abort]):
            raise HostStoreSetupError(store.get(abort).decode())

    def _slow_message(self, stage, description, keys, mine, bound, exc) -> str:
        missing, doing = [], []
        now = time.time()
        for r, k in enumerate(keys):
            try:
                if self.store.check([k]):
                    continue
                missing.append(r)
                dk = self._key(stage, "doing", r)
                if self.store.check([dk]):
                    activity, _, since = self.store.get(dk).decode().rpartition("@")
                    doing.append(f"rank {r} {activity} for {now - float(since):.0f} s")
                else:
                    doing.append(f"rank {r} not started")
            except Exception:  # noqa: BLE001 - the store went away meanwhile
                missing.append(r)
        how = ("ElasticPolicy.host_setup_timeout_s" if self.explicit else
               f"the collective timeout plus 1 s per {SETUP_BYTES_PER_S >> 20} MiB of the store; set "
               "ElasticPolicy.host_setup_timeout_s (node_host_store(setup_timeout_s=...)) to allow more")
        limit = "the store's timeout" if bound is None else f"{bound:.0f} s"
        return (f"node_host_store ({stage}): timed out: the host store's set-up ({_human(self.nbytes)}) did not finish "
                f"{description} within {limit} ({how}): not finished on rank(s) {missing} "
                f"({'; '.join(doing) or 'unknown'}); this rank's own part took {mine:.1f} s. Either that stage is "
                f"slower there than the bound allows (a slow disk, memory pressure) or a peer rank probably failed or "
                f"stopped (a store cannot tell which); the wait reported: {exc}")


# ---------------------------------------------------------------------------------- the handshake


def _layout(group, timeout_s, kind: str | None) -> NodeLayout:
    me = dist.get_rank(group)
    every = _exchange((node_identity(), _pid_namespace()), group, timeout_s, "who is where")
    nodes: dict[str, list[int]] = {}
    for r, (ident, _) in enumerate(every):
        nodes.setdefault(ident, []).append(r)
    my_node = every[me][0]
    local = tuple(nodes[my_node])
    if kind is None:
        same_ns = len({every[r][1] for r in local}) == 1 and every[local[0]][1] is not None
        kind = "memfd" if same_ns else "shm"
    return NodeLayout(
        node=list(nodes).index(my_node), local_rank=local.index(me), local_world=len(local),
        creator=local[0], local_ranks=local, kind=kind,
    )


class _Attach(NamedTuple):
    """One rank's outcome of steps 2-3, exchanged: identical on every rank."""

    node: int
    kind: str  # the kind of this rank's node in this round
    error: str | None  # attach error (None: mapped)
    errno: int | None  # its errno, when the operating system gave one


# Attach errors of a memfd that kind "shm" can get around: /proc/<pid>/fd could not be opened
# (no access: another user, a /proc mounted without it; or the creator is not visible: another
# PID namespace). A size mismatch or a stale handle would fail the same way with shm.
_SHM_CURES = (errno.EACCES, errno.EPERM, errno.ENOENT)


def _map_segment(nbytes: int, layout: NodeLayout, group, timeout_s, impl: str, wait: _SetupWait,
                 keep: HostStore | None = None, stage: str = "create") -> tuple[HostStore | None, list[_Attach]]:
    """Steps 2-3: the creator creates, the others attach. Returns this rank's store (None when
    its attach failed) and every rank's outcome; a creation failure anywhere raises on every
    rank. `keep`: this rank's node already has its segment (a retry elsewhere): only take part.
    `stage`: the name of this round's wait (each round its own)."""
    me = dist.get_rank(group)
    store, err = keep, None
    if keep is None and me == layout.creator:
        wait.doing(stage, f"creating and zeroing the {layout.kind} segment")
        try:
            store = HostStore.create(nbytes, kind=layout.kind, impl=impl)
        except (OSError, ValueError, TypeError) as exc:
            err = f"creating the {layout.kind} segment of node {layout.node} failed: {_error_text(exc)}"
    try:
        wait.wait_all(stage, "creating and zeroing every node's segment")
        handles = _exchange((store.handle if store is not None and keep is None else None, err), group, timeout_s,
                            "handles")
        _raise_if_any([e for _, e in handles], "create")  # the same list on every rank
        code = None
        if keep is None and me != layout.creator:
            try:
                store = HostStore.attach(handles[layout.creator][0], nbytes, impl=impl)
            except (OSError, ValueError) as exc:
                err = f"attaching node {layout.node}'s {layout.kind} segment failed: {_error_text(exc)}"
                code = getattr(exc, "errno", None)
        outcomes = [_Attach(*o) for o in _exchange((layout.node, layout.kind, err, code), group, timeout_s, "attach")]
    except BaseException:
        if store is not None and store is not keep:
            store.close()
        raise
    if err is not None:
        store = None
    return store, outcomes


def _attach_failure(outcomes: list[_Attach]) -> str:
    return agreed_message([o.error for o in outcomes])


def node_host_store(
    nbytes: int,
    group=None,
    fill: Fill | None = None,
    timeout_s: float | None = None,
    *,
    device: torch.device | str | None = None,
    kind: str | None = None,
    impl: str = "auto",
    setup_timeout_s: float | None = None,
) -> HostStore:
    """One shared host store of ``nbytes`` per node, mapped by every rank of ``group`` on it,
    filled by ``fill(store, local_rank, local_world)`` on every rank ([Note: the node
    handshake]). Collective. ``device``: the runtime's device; a CUDA device makes every rank
    pin its mapping (a failed registration warns and leaves that rank unpinned). ``kind``:
    force "memfd" or "shm" (default: chosen per node). ``impl``: as ``HostStore.create``.
    ``setup_timeout_s``: the bound of the long stages ([Note: the set-up's own time bound];
    None: scaled with ``nbytes``). Without a process group (or a group of one) it just creates.

    Raises HostStoreSetupError on every rank when any rank fails (creation, attach, fill, a
    stage past its bound, a dead peer); this rank's store is closed before it raises."""
    return build_node_host_store(nbytes, group, fill, timeout_s, device=device, kind=kind, impl=impl,
                                 setup_timeout_s=setup_timeout_s)[0]


def build_node_host_store(
    nbytes: int,
    group=None,
    fill: Fill | None = None,
    timeout_s: float | None = None,
    *,
    device: torch.device | str | None = None,
    kind: str | None = None,
    impl: str = "auto",
    setup_timeout_s: float | None = None,
) -> tuple[HostStore, NodeStoreInfo]:
    """`node_host_store`, and this rank's `NodeStoreInfo` (its node layout, which local ranks
    pinned, whether it reports the store's pinned bytes)."""
    if not isinstance(nbytes, int) or isinstance(nbytes, bool) or nbytes <= 0:
        raise ValueError(f"node_host_store: nbytes must be a positive int, got {nbytes!r}")
    if kind not in (None, "memfd", "shm"):
        raise ValueError(f"node_host_store: kind must be None, 'memfd' or 'shm', got {kind!r}")
    for name, value in (("timeout_s", timeout_s), ("setup_timeout_s", setup_timeout_s)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0):
            raise ValueError(f"node_host_store: {name} must be a positive number or None, got {value!r}")
    pin_device = torch.device(device) if device is not None else None
    if pin_device is not None and pin_device.type != "cuda":
        pin_device = None

    distributed = dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1
    if not distributed:
        store = HostStore.create(nbytes, kind=kind or "memfd", impl=impl)
        try:
            store.close_fd()
            pinned = _pin(store, pin_device, "local rank 0 of node 0")
            if fill is not None:
                fill(store, 0, 1)
        except BaseException:
            store.close()
            raise
        layout = NodeLayout(node=0, local_rank=0, local_world=1, creator=0, local_ranks=(0,), kind=store.kind)
        return store, NodeStoreInfo(layout, (pinned,), pinned)

    layout = _layout(group, timeout_s, kind)
    wait = _SetupWait(group, nbytes, setup_bound_s(nbytes, timeout_s, setup_timeout_s), setup_timeout_s)
    store, outcomes = _map_segment(nbytes, layout, group, timeout_s, impl, wait)
    failed = [o for o in outcomes if o.error]
    if failed:
        # [Note: the shm retry is decided by every rank alike]: from the exchanged outcomes only.
        retry = kind is None and all(o.kind == "memfd" and o.errno in _SHM_CURES for o in failed)
        if not retry:
            if store is not None:
                store.close()
            raise HostStoreSetupError(f"node_host_store (attach) failed: {_attach_failure(outcomes)}")
        if any(o.node == layout.node for o in failed):  # this node's segment failed somewhere: recreate as shm
            if store is not None:
                store.close()
            store, layout = None, layout._replace(kind="shm")
        try:
            store, outcomes2 = _map_segment(nbytes, layout, group, timeout_s, impl, wait, keep=store,
                                            stage="create (retry as shm)")
        except HostStoreSetupError as exc2:
            raise HostStoreSetupError(f"{exc2}; before that, with kind 'memfd': {_attach_failure(outcomes)}") from exc2
        if any(o.error for o in outcomes2):
            if store is not None:
                store.close()
            raise HostStoreSetupError(f"node_host_store (attach, retried with kind 'shm') failed: "
                                      f"{_attach_failure(outcomes2)}; before that, with kind 'memfd': "
                                      f"{_attach_failure(outcomes)}")

    try:
        store.close_fd()  # step 4: every local rank has mapped it (exchanged above)
        err, pinned = None, False
        try:
            if pin_device is not None:
                wait.doing("fill", "page-locking its mapping (cudaHostRegister)")
                pinned = _pin(store, pin_device, f"local rank {layout.local_rank} of node {layout.node}")
            if fill is not None:
                wait.doing("fill", "filling its share of the store")
                fill(store, layout.local_rank, layout.local_world)
        except Exception as exc:  # noqa: BLE001 - exchanged, then raised on every rank
            err = f"fill failed on local rank {layout.local_rank} of node {layout.node}: {_error_text(exc)}"
        wait.wait_all("fill", "page-locking and filling every rank's share")
        every = _exchange((err, pinned), group, timeout_s, "pin and fill")
        _raise_if_any([e for e, _ in every], "pin and fill")
    except BaseException:
        store.close()
        raise
    pins = tuple(every[r][1] for r in layout.local_ranks)
    reports = pinned and layout.local_rank == min(i for i, p in enumerate(pins) if p)
    return store, NodeStoreInfo(layout, pins, reports)


def _pin(store: HostStore, device: torch.device | None, who: str) -> bool:
    """Page-lock this rank's mapping on `device` (a CUDA device; None: nothing to do). A
    failed registration is a warning: the copies from this mapping are then staged by the
    driver (pageable memory), slower but correct. Returns whether the mapping is pinned."""
    if device is None:
        return False
    try:
        if store.pin(device):
            return True
        why = (f"{store.impl} implementation{'' if store.impl == 'cpp' else ': build the extension for pinning'}")
    except HostStoreError as exc:
        why = f"cudaHostRegister failed: {exc}"
    warnings.warn(
        f"node_host_store: the host store ({_human(store.nbytes)}) could not be page-locked on {device} by {who} "
        f"({why}); this rank continues with pageable memory: its host-to-device copies are staged by the driver "
        "(synchronous, slower), and its stats count none of the store as pinned", RuntimeWarning, stacklevel=3,
    )
    return False
