"""`ElasticRuntime`: the state of the elastic frozen-weight runtime of one model, and the
lifecycle of one use (`use`). Its concerns live in private modules, one mixin each:

  tensor.py         ElasticTensor (a frozen weight: layout, shard, residency), Residency, Phase
  _registration.py  register, the ranks' agreement on what they wrap, the host store
  _residency.py     residency per weight, the pool, its budget, sources, prefetch window
  _gathers.py       uses: pin, gather / copy the missing chunks, wait, release (Resident)
  _order.py         phases, learned orders and segments, prefetch
  _grads.py         gradient reduction of the adapters, no_sync

Every attribute is created in ElasticRuntime.__init__ (below); the mixins only read and
change them.

[Note: single process]
Without an initialised process group (a plain script), the runtime has world size 1: no
collective is ever issued, chunks are views of the local weight, and adapter gradients are
left as they are. A process group is needed only for world size > 1.
"""

from __future__ import annotations

import contextlib
import os
from contextlib import contextmanager

import torch
import torch.distributed as dist

from elastic_kernels import PagePool

from ..config import ElasticPolicy
from ..distributed.collectives import GatherBuffers
from ..quant import DequantWorkspace
from ._gathers import Resident, _Gathers, _Use
from ._grads import _GradReduction
from ._order import _Order, in_backward
from ._registration import _Registration
from ._residency import _Residency
from .tensor import ElasticTensor, Phase, Residency


def check_nccl_device(device: torch.device, current: int, device_count: int, local_rank: str | None) -> None:
    """NCCL issues each collective on the *current* CUDA device (the runtime's gathers, and the
    exchanges of python_api/distributed/agree.py, which put their tensors there): a runtime
    whose weights live on another device, or a process whose current device is not its
    LOCAL_RANK's, hangs or fails deep inside NCCL (several ranks on one GPU). Library users
    must call `torch.cuda.set_device(local_rank)` before building the model (the CLI does).
    `current`/`device_count`: torch.cuda's; `local_rank`: the LOCAL_RANK variable (None
    without torchrun). With one visible device per process (CUDA_VISIBLE_DEVICES set per
    rank) device 0 is right whatever LOCAL_RANK says."""
    if device.index is not None and device.index != current:
        raise RuntimeError(
            f"ElasticRuntime: the weights are on {device}, but the current CUDA device is cuda:{current}; NCCL runs "
            f"every collective on the current device: call torch.cuda.set_device({device.index}) first")
    if local_rank is not None and device_count > 1:
        try:
            local = int(local_rank)
        except ValueError:
            return
        if 0 <= local < device_count and current != local:
            raise RuntimeError(
                f"ElasticRuntime: LOCAL_RANK is {local} but the current CUDA device is cuda:{current}: with NCCL each "
                f"local rank needs its own GPU; call torch.cuda.set_device(int(os.environ['LOCAL_RANK'])) before "
                f"init_process_group and before building the model")


class ElasticRuntime(_Registration, _Residency, _Gathers, _Order, _GradReduction):
    """Owns the pool, the elastic tensors of one model, the learned order and the stats.

    Every rank of `group` must create its runtime with the same policy and register the same
    weights in the same order. Without an initialised process group the runtime runs alone
    (world size 1; see [Note: single process]).
    """

    def __init__(self, policy: ElasticPolicy, group=None, device: torch.device | str | None = None,
                 force_pool: bool = False):
        """`force_pool` (for tests and `make gpu-check`): at world size 1, run every use through
        the pool and the collectives (communication stream, events, record_stream) as at world
        size > 1, instead of reading the local weight directly. Needs a process group."""
        if not isinstance(policy, ElasticPolicy):
            raise TypeError(f"policy must be an ElasticPolicy, got {type(policy).__name__}")
        distributed = dist.is_available() and dist.is_initialized()
        if group is not None and not distributed:
            raise RuntimeError("ElasticRuntime: a process group was given but torch.distributed is not initialised")
        if force_pool and not distributed:
            raise RuntimeError("ElasticRuntime(force_pool=True) issues collectives: initialise a process group first")
        self.policy = policy
        self._force_pool = bool(force_pool)
        if distributed:
            self.group = group if group is not None else dist.group.WORLD
            self.rank = dist.get_rank(self.group)
            self.world_size = dist.get_world_size(self.group)
        else:
            self.group, self.rank, self.world_size = None, 0, 1
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        if distributed and self.device.type == "cuda" and dist.get_backend(self.group) == "nccl":
            check_nccl_device(self.device, torch.cuda.current_device(), torch.cuda.device_count(),
                              os.environ.get("LOCAL_RANK"))
        self.tensors: list[ElasticTensor] = []
        # Quantized weights dequantize each use into these recycled buffers ([Note: the dequant
        # workspace] in python_api/quant/workspace.py).
        self.dequant_workspace = DequantWorkspace()
        self.pool: PagePool | None = None
        self._cache_budget = policy.pool_budget_bytes
        # The communication stream: all-gathers, their pack/unpack copies. Created here only.
        self.comm_stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        # The copy stream: host store -> page copies ([Note: host copies are stream ordered]).
        self.copy_stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" and policy.uses_host_store else None
        self.host_store = None  # built by finish_registration when the policy uses the host tier
        self.host_node = None  # NodeStoreInfo of this rank (python_api/host/store.py), with the store
        self.activation_offload = None  # python_api/host/offload.py, created on first use
        self.phase = Phase.IDLE
        self._order = {Phase.FORWARD: None, Phase.BACKWARD: None}  # learned wid sequences
        # per phase, per position of the learned order: (first, end) positions of its segment
        self._segments: dict[Phase, list[tuple[int, int]] | None] = {Phase.FORWARD: None, Phase.BACKWARD: None}
        self._seq = 0  # collectives issued (carried in each one's header)
        # [Note: receive buffers are reused] in python_api/distributed/collectives.py
        self._gather_buffers = GatherBuffers() if self.device.type == "cpu" else None
        # gloo on the default group: the private header and data groups of its gathers
        # ([Note: headers off the prefetch path] in python_api/distributed/collectives.py)
        self._channel = None
        self._observed: list[int] = []
        self._cursor = 0
        self._prefetched: dict[int, _Use] = {}  # wid -> use whose gathers are in flight
        self._end_of_backward_queued = False
        self._grad_params: list[torch.nn.Parameter] = []
        self._sync_grads = True  # False inside no_sync(): see [Note: gradient accumulation]
        # Whether the end of backward averages adapter gradients: the policy's setting, turned
        # off while another wrapper (DDP) reduces them (set_grad_reduction).
        self._reduce_grads = policy.all_reduce_grads
        self._grad_hooks: list = []  # handles of the gradient-ready hooks (set_trainable)
        # [Note: gradient buckets] in _grads.py: the buckets, which parameters are ready in
        # this backward, the next bucket to launch, and a count for tests and profiles.
        self._buckets: list = []
        self._bucket_of: dict[int, object] = {}
        self._params_ready: set[int] = set()
        self._next_bucket = 0
        self._buckets_launched_in_backward = 0
        self._closed = False  # see [Note: closing a runtime]
        # [Note: resident runs] in tensor.py: whether the weights held as runs may have to
        # change (set by residency, budget and source changes; applied where nothing is in
        # flight), and the most bytes held in runs since the stats were reset.
        self._runs_dirty = True
        self._run_peak = 0
        self._stats = {"allgather_bytes": 0, "allgather_calls": 0, "pool_hits": 0, "pool_misses": 0, "h2d_bytes": 0}
        self._weight_bytes: dict[str, int] = {}  # all-gather bytes received per weight (stats)

    def stats(self, per_weight: bool = False) -> dict:
        """Cumulative per-rank counters; `per_weight` adds "allgather_bytes_per_weight"
        (name -> bytes received for that weight's chunks, `full_weight` excluded).
        h2d_bytes: host -> device bytes (host-store chunks and activations brought back);
        d2h_bytes: activations offloaded; host_store_bytes: the size of this rank's node's host
        store (the same on every rank of the node: not a per-rank share);
        host_pinned_bytes: page-locked host bytes this rank accounts for: its activation offload
        buffers, and the node's store on one rank per node only (the lowest local rank whose
        registration succeeded; [Note: pinned bytes are counted once per node] in
        python_api/host/store.py), so the sum over a node's ranks is the node's locked memory;
        0 for the store where pinning failed or is not possible (CPU)."""
        out = dict(self._stats)
        # The cache's bytes: the pool's pages and the runs ([Note: resident runs]); runs change
        # only between steps, so their peak adds to the pages' as an upper bound.
        out["run_bytes"] = self.run_bytes()
        out["pool_peak_bytes"] = (self.pool.stats()["peak_in_use_bytes"] if self.pool is not None else 0) + self._run_peak
        out["d2h_bytes"] = 0
        out["host_store_bytes"] = self.host_store.nbytes if self.host_store is not None else 0
        reports = self.host_store is not None and self.host_node is not None and self.host_node.reports_pinned
        out["host_pinned_bytes"] = self.host_store.pinned_bytes if reports else 0
        if self.activation_offload is not None:
            act = self.activation_offload.stats()
            out["h2d_bytes"] += act["h2d_bytes"]
            out["d2h_bytes"] += act["d2h_bytes"]
            out["host_pinned_bytes"] += act["host_pinned_bytes"]
        if per_weight:
            out["allgather_bytes_per_weight"] = {et.name: self._weight_bytes.get(et.name, 0) for et in self.tensors}
        return out

    def count_gather(self, per_weight: dict[str, int], other_bytes: int = 0, calls: int = 1) -> None:
        """Count a collective issued outside the pool for the runtime's weights (the row
        exchange of an embedding lookup, [Note: a lookup reads only its rows] in
        python_api/nn/embedding.py): `per_weight` bytes received per weight name, `other_bytes`
        received for no weight (token ids), `calls` collectives."""
        self._stats["allgather_calls"] += calls
        self._stats["allgather_bytes"] += other_bytes + sum(per_weight.values())
        for name, n in per_weight.items():
            self._weight_bytes[name] = self._weight_bytes.get(name, 0) + n

    def reset_stats(self) -> None:
        for k in self._stats:
            self._stats[k] = 0
        self._weight_bytes.clear()
        if self.activation_offload is not None:
            self.activation_offload.reset_stats()
        if self.pool is not None:
            self.pool.reset_peak()
        self._run_peak = self.run_bytes()

    # [Note: closing a runtime]
    # A runtime owns the pool (every page of its device memory), the shards, the host store's
    # mapping and the activation offload's host buffers. `close()` gives all of them back now,
    # on the rank that calls it (no collective): in-flight gathers are waited for and dropped
    # first, the gradient-ready hooks are removed, the pool is closed, the store unmapped,
    # the shards dropped. It is idempotent; any later use (a forward, backward, prefetch,
    # full_weight, a budget change) raises a RuntimeError that says the runtime was closed.
    # Without close(), dropping the model frees the same: nothing outside the model holds the
    # runtime strongly. The hooks on the adapter parameters reach it through a weak
    # reference (a hook lives in the parameter's C++ autograd metadata, which the garbage
    # collector cannot traverse: a strong reference there kept the runtime, its pool and
    # shards alive for the rest of the process; issue 27). tests/runtime/test_close.py drops
    # a converted model and checks with weak references that runtime, pool and shards went.

    @property
    def closed(self) -> bool:
        return self._closed

    def check_open(self, what: str) -> None:
        """Raise if the runtime was closed ([Note: closing a runtime])."""
        if self._closed:
            raise RuntimeError(f"ElasticRuntime.{what}: this runtime was closed (close() gave back its pool, "
                               "shards and host memory); convert the model again to use it")

    def close(self) -> None:
        """Give back the pool, the shards, the host store's mapping and the activation offload's
        buffers now; idempotent, local to this rank. See [Note: closing a runtime]."""
        if self._closed:
            return
        self._closed = True
        try:
            self._release_prefetched()
        except RuntimeError:
            pass  # a failed gather: its pages are freed with the pool below
        finally:
            self._prefetched = {}
            if self._gather_buffers is not None:
                self._gather_buffers.clear()
            for h in self._grad_hooks:
                h.remove()
            self._grad_hooks = []
            self._drop_grad_state()
            self._grad_params = []
            if self.pool is not None:
                self.pool.close()
                self.pool = None
            if self.host_store is not None:
                self.host_store.unpin()
                self.host_store.close()
                self.host_store = None
            if self.activation_offload is not None:
                self.activation_offload.set_enabled(False)
                self.activation_offload = None
            for et in self.tensors:
                et.shard = None
                et.run = None
                et._local_chunks = None
                et._reader = None
            self.dequant_workspace = DequantWorkspace()

    def _device_guard(self):
        return torch.cuda.device(self.device) if self.device.type == "cuda" else contextlib.nullcontext()

    @contextmanager
    def use(self, et: ElasticTensor, phase: Phase, needs_backward: bool = False):
        """Gather `et` for one use in `phase`; yields a `Resident` (its page table).

        `resident.execute(fn)` calls fn(c, chunk) for every chunk in index order as soon as
        that chunk's gather has completed; `resident.chunks()` waits for every gather and
        returns the page table (one chunk-shaped view per chunk) for kernels that read the
        whole weight in one launch. On exit the chunks are unpinned and discarded per
        residency: after forward, TRANSIENT (and PEAK when no backward will come:
        `needs_backward` False); after backward, everything but PERSISTENT. A forward use
        inside backward is a recompute ([Note: recompute inside backward]). Pages whose
        gather failed are freed, so a caller that catches the error can retry.
        """
        self.check_open("use")
        with self._device_guard():
            recompute = phase is Phase.FORWARD and in_backward()
            if recompute:
                phase = Phase.BACKWARD
                needs_backward = True
            elif phase is Phase.BACKWARD:
                self._queue_end_of_backward()
            self._enter(phase, et)
            use = None
            try:
                use = self._start_use(et)
                self._prefetch_next(et)
                yield Resident(use)
            finally:
                if use is not None:
                    # Gathers issued for this use must finish before their pages are released.
                    for c, work in enumerate(use.works):
                        if work is not None and not work.done:
                            try:
                                work.wait(f"{et.name} chunk {c}")
                            except RuntimeError:
                                pass  # remembered by the work; its pages are freed below
                    if phase is Phase.FORWARD:
                        keep = Residency.PEAK if needs_backward else Residency.PERSISTENT
                    elif recompute:
                        keep = Residency.PEAK
                    else:
                        keep = Residency.PERSISTENT
                    if self.pool is not None:
                        self._end_use(use, keep)
                    order = self._order[self.phase]
                    if self._gather_buffers is not None and order is not None and self._cursor >= len(order):
                        # the phase's last use: nothing more to receive before the peak
                        self._gather_buffers.clear()
