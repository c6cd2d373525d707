"""The per-node handshake of the host store: one shared segment per node, filled in parallel.

    store = node_host_store(nbytes, group=None, fill=None, timeout_s=None, device=None)

Collective over ``group`` (every rank calls it with the same ``nbytes``). The mechanism is
``elastic_kernels.HostStore`` (``csrc/host/``); this module decides who creates, who attaches
and when the creator lets go, per [Note: the node handshake].

[Note: the node handshake]
1. Who is where: every rank contributes (host name + kernel boot id, its PID namespace); ranks
   with the same host name and boot id are one *node* (no environment variable is assumed:
   LOCAL_RANK is not needed). Local ranks are numbered by rank; the lowest rank of each node
   is its *creator*.
2. The creator of each node creates the segment (``HostStore.create``: reserved, zeroed,
   sealed); the handles (or the creators' errors) are exchanged.
3. The other local ranks attach (map) it. Every rank's outcome is agreed by a collective, so a
   failure anywhere is an error everywhere, never a hang; the stores are closed on the way out.
4. The creator closes its fd (``close_fd``; kind "shm": unlinks the name). From here on the
   memory exists only as the mappings of live processes: any way a process ends, nothing is
   left once the last one has gone ([Note: a segment that cannot leak] in
   csrc/host/host_store.cpp).
5. With a CUDA ``device`` every rank page-locks its own mapping (``pin``) under that device.
6. ``fill(store, local_rank, local_world)`` runs on every rank, each writing its share (see
   ``local_share``) in parallel; the outcome (fill or pin errors) is agreed, which is also the
   final barrier: when node_host_store returns, every rank's share is written.

Kind: the memfd is reached through ``/proc/<creator pid>/fd``, which works only inside one PID
namespace; local ranks whose PID namespaces differ use kind "shm" from the start
([Note: the shm fallback and its window]), and if attaching a memfd fails anyway (a /proc
mounted without access, another user) the handshake runs once more with "shm" before it
gives up. ``kind=`` forces one.

Timeouts: each collective of the handshake waits at most ``timeout_s`` (on gloo; on NCCL the
process group's own timeout applies, as for every collective of the runtime); ``None`` means the
process group's timeout. The last collective waits for the slowest rank's fill: size
``timeout_s`` to cover it. A rank that dies (SIGKILL, SIGTERM) makes the others fail with
:class:`HostStoreSetupError` within one timeout, or at once when gloo sees the connection drop.
"""

from __future__ import annotations

import os
import socket
import warnings
from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.distributed as dist

from elastic_kernels.host_store import HostStore
from python_api.distributed.agree import agree, exchange

__all__ = ["HostStoreSetupError", "NodeLayout", "local_share", "node_host_store", "node_identity"]

Fill = Callable[[HostStore, int, int], object]


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


# ---------------------------------------------------------------------------------- collectives


def _exchange(obj, group, timeout_s: float | None, what: str) -> list:
    return exchange(obj, group, timeout_s=timeout_s, what=f"node_host_store ({what})", error_type=HostStoreSetupError)


def _agree(error: str | None, group, timeout_s: float | None, what: str) -> None:
    agree(error, group, timeout_s=timeout_s, what=f"node_host_store ({what}) failed", error_type=HostStoreSetupError)


def _error_text(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


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


def _map_segment(nbytes: int, layout: NodeLayout, group, timeout_s, impl: str) -> HostStore:
    """Steps 2-3: the creator creates, the others attach; agreed. Returns this rank's store."""
    me = dist.get_rank(group)
    store, err = None, None
    if me == layout.creator:
        try:
            store = HostStore.create(nbytes, kind=layout.kind, impl=impl)
        except (OSError, ValueError, TypeError) as exc:
            err = f"creating the {layout.kind} segment of node {layout.node} failed: {_error_text(exc)}"
    try:
        handles = _exchange((store.handle if store is not None else None, err), group, timeout_s, "handles")
        bad = [(r, e) for r, (_, e) in enumerate(handles) if e]  # the same list on every rank
        if bad:
            raise HostStoreSetupError("node_host_store (create) failed: " + "; ".join(f"rank {r}: {e}" for r, e in bad))
        if me != layout.creator:
            try:
                store = HostStore.attach(handles[layout.creator][0], nbytes, impl=impl)
            except (OSError, ValueError) as exc:
                err = f"attaching node {layout.node}'s segment failed: {_error_text(exc)}"
        _agree(err, group, timeout_s, f"attach ({layout.kind})")
    except BaseException:
        if store is not None:
            store.close()
        raise
    return store


def node_host_store(
    nbytes: int,
    group=None,
    fill: Fill | None = None,
    timeout_s: float | None = None,
    *,
    device: torch.device | str | None = None,
    kind: str | None = None,
    impl: str = "auto",
) -> HostStore:
    """One shared host store of ``nbytes`` per node, mapped by every rank of ``group`` on it,
    filled by ``fill(store, local_rank, local_world)`` on every rank ([Note: the node
    handshake]). Collective. ``device``: the runtime's device; a CUDA device makes every rank
    pin its mapping. ``kind``: force "memfd" or "shm" (default: chosen per node). ``impl``:
    as ``HostStore.create``. Without a process group (or a group of one) it just creates.

    Raises HostStoreSetupError on every rank when any rank fails (creation, attach, pin, fill,
    a dead peer); this rank's store is closed before it raises."""
    if not isinstance(nbytes, int) or isinstance(nbytes, bool) or nbytes <= 0:
        raise ValueError(f"node_host_store: nbytes must be a positive int, got {nbytes!r}")
    if kind not in (None, "memfd", "shm"):
        raise ValueError(f"node_host_store: kind must be None, 'memfd' or 'shm', got {kind!r}")
    if timeout_s is not None and not timeout_s > 0:
        raise ValueError(f"node_host_store: timeout_s must be positive or None, got {timeout_s!r}")
    pin_device = torch.device(device) if device is not None else None
    if pin_device is not None and pin_device.type != "cuda":
        pin_device = None

    distributed = dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1
    if not distributed:
        store = HostStore.create(nbytes, kind=kind or "memfd", impl=impl)
        try:
            store.close_fd()
            _pin(store, pin_device)
            if fill is not None:
                fill(store, 0, 1)
        except BaseException:
            store.close()
            raise
        return store

    layout = _layout(group, timeout_s, kind)
    try:
        store = _map_segment(nbytes, layout, group, timeout_s, impl)
    except HostStoreSetupError as exc:
        # A memfd that a local rank could not open (a /proc without access): once more as shm.
        if kind is not None or layout.kind != "memfd" or "attach (memfd)" not in str(exc):
            raise
        layout = layout._replace(kind="shm")
        try:
            store = _map_segment(nbytes, layout, group, timeout_s, impl)
        except HostStoreSetupError as exc2:
            raise HostStoreSetupError(f"{exc2}; before that, with kind 'memfd': {exc}") from exc2

    try:
        store.close_fd()  # step 4: every local rank has mapped it (agreed above)
        err, stage = None, "pin"
        try:
            _pin(store, pin_device)
            stage = "fill"
            if fill is not None:
                fill(store, layout.local_rank, layout.local_world)
        except Exception as exc:  # noqa: BLE001 - agreed, then raised on every rank
            err = f"{stage} failed on local rank {layout.local_rank} of node {layout.node}: {_error_text(exc)}"
        _agree(err, group, timeout_s, "pin and fill")
    except BaseException:
        store.close()
        raise
    return store


def _pin(store: HostStore, device: torch.device | None) -> None:
    if device is None:
        return
    if not store.pin(device):
        warnings.warn(
            f"node_host_store: the host store could not be page-locked on {device} ({store.impl} implementation"
            f"{'' if store.impl == 'cpp' else ': build the extension for pinning'}); host-to-device copies "
            "from it will be staged by the driver", RuntimeWarning, stacklevel=3,
        )
