"""The elastic frozen-weight runtime: elastic tensors, residency, gathers, prefetch, budget.

[Note: residency classes]
Chunk c of a weight with n chunks is PERSISTENT if c < round(persist_ratio * n), else PEAK if
c < round(keep_ratio * n), else TRANSIENT (round half up, so keep >= persist carries over to
chunk counts). A plan sets the counts per weight instead (`ElasticRuntime.set_residency`,
python_api/planner/apply.py); the ratios are only the default. The kept chunks are the *first* ones because `execute` walks chunks in index
order, forward and backward: whatever is resident is computed on at once while the missing,
higher-index chunks are still being gathered.
- TRANSIENT: gathered for each use, discarded right after it.
- PEAK: kept from a forward use to the backward use of the same layer, discarded after it (and
  right after forward when no backward will come: no_grad, or no input needs a gradient).
- PERSISTENT: kept across iterations; the pool may still evict it under a shrinking budget,
  which only turns the next use into a miss.

[Note: pool budget and working set]
`ElasticPolicy.pool_budget_bytes` is the memory for chunks kept *beyond their use*. The chunks
of the layers in flight (the one running plus `prefetch_depth` ahead) are pinned while in use,
which is the memory FSDP2 spends on unsharded parameters; the runtime sizes the pool as
budget + that working set (bounded by the pages of the `1 + prefetch_depth` largest units,
[Note: units and coalesced gathers]), so a budget of zero means "FSDP2 behaviour": nothing is
kept beyond the working set's pages (which still serve a hit while LRU has not reused them,
e.g. the last forward layers at the start of backward), nothing fails. The pool's own
budget is never exceeded except by pinned pages, and with this sizing it never needs to be.

[Note: symmetric residency]
Every rank must issue the same all-gathers in the same order. Hits and misses depend only on
the sequence of pool calls (the same on every rank: same model, same policy, same budget
changes), never on timing, so ranks agree; a mismatch shows up as a size mismatch error in
the collective, not as silent corruption. Budget changes must therefore be made on every
rank at the same point (the planner and adaptive accumulation do).

[Note: learned order and prefetch]
The order in which layers use their weights is recorded in the first forward and the first
backward; from then on, when layer i starts, the missing chunks of the next `prefetch_depth`
layers of that order are gathered. Nothing is prefetched before the order is known, so no
byte is gathered that a later use does not consume; if the observed order departs from the
learned one, outstanding prefetches are completed and released and the order is relearned.

[Note: gradient accumulation]
With `policy.all_reduce_grads` the adapter gradients are averaged across the group at the end
of every backward. Over k micro-batches that is k all-reduces of every adapter gradient where
one suffices: averaging is linear, so mean_r(sum_i g_ri) = sum_i mean_r(g_ri) up to rounding.
`no_sync()` skips the reduction for the backward passes run inside it (their gradients
accumulate locally in .grad); the backward of the last micro-batch, run outside, averages the
accumulated sums once. Every rank must use the same micro-batch count, or the ranks issue
different numbers of all-reduces (a collective mismatch, as with DDP's no_sync).

[Note: recompute inside backward]
Activation checkpointing (`torch.utils.checkpoint`, reentrant or not; HF
`gradient_checkpointing_enable()`) runs a layer's forward again inside backward. Such a use
is recognised by the autograd engine running a graph task on this thread
(`torch._C._current_graph_task_id() != -1`) and belongs to the BACKWARD phase: it does not
start a new forward pass, keeps the learned orders (the recompute uses are part of the
backward order, so they are prefetched like backward uses), keeps other layers' PEAK chunks,
and ends with keep=PEAK so the backward use right after it finds its chunks resident. The
end-of-backward callback is queued once, on the graph task that is running when the phase
changes to BACKWARD (the outermost one: a reentrant checkpoint recomputes in the outer task
before it runs its nested backward), so adapter gradients are all-reduced once per step
whatever the number of checkpointed layers. With reentrant checkpointing the first forward runs
under no_grad, so its PEAK chunks are released (no backward is known to follow) and the
recompute gathers them again; non-reentrant checkpointing keeps them.

[Note: units and coalesced gathers]
A *unit* is a group of weights used together, e.g. the linears of one decoder layer (the HF
`_no_split_modules` block, or an explicit grouping). Once the order of a phase is learned, it
is cut into *segments*: maximal runs of consecutive uses of one unit. The first use of a
segment gathers the missing chunks of every weight of the segment in one coalesced set of
collectives (at most `collective_bytes` each), and prefetch runs `prefetch_depth` segments
ahead, so a decoder layer costs one all-gather per use as under FSDP2 rather than one per
weight. Only weights used in that segment of that phase are gathered (a layer whose input
needs no gradient has no backward use, and nothing is gathered for it). Before an order is
learned (the first iteration) every weight is gathered at its own use.

[Note: single process]
Without an initialised process group (a plain script), the runtime has world size 1: no
collective is ever issued, chunks are views of the local weight, and adapter gradients are
left as they are. A process group is needed only for world size > 1.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import zlib
from contextlib import contextmanager

import torch
import torch.distributed as dist
from torch.profiler import record_function

from elastic_kernels import ChunkLayout, PagePool, unpack_gathered
from python_api.collectives import ChunkRun, GatherWork, all_gather_into
from python_api.config import ElasticPolicy
from python_api.host_tier import HostCopyWork, host_chunks, store_offsets


class Residency(enum.IntEnum):
    TRANSIENT = 0
    PEAK = 1
    PERSISTENT = 2


class Phase(enum.Enum):
    IDLE = "idle"
    FORWARD = "forward"
    BACKWARD = "backward"


def _round_half_up(x: float) -> int:
    return int(x + 0.5)


def residency_classes(num_chunks: int, keep_ratio: float, persist_ratio: float) -> list[Residency]:
    return residency_of_counts(num_chunks, _round_half_up(keep_ratio * num_chunks),
                               _round_half_up(persist_ratio * num_chunks))


def residency_of_counts(num_chunks: int, keep_chunks: int, persist_chunks: int) -> list[Residency]:
    """The first `persist_chunks` chunks PERSISTENT, then PEAK up to `keep_chunks`, the rest
    TRANSIENT ([Note: residency classes])."""
    return [
        Residency.PERSISTENT if c < persist_chunks else Residency.PEAK if c < keep_chunks else Residency.TRANSIENT
        for c in range(num_chunks)
    ]


class ElasticTensor:
    """One frozen weight: its chunk-major shard on this rank and the residency of its chunks."""

    def __init__(self, runtime: ElasticRuntime, wid: int, name: str, weight: torch.Tensor, unit: str | None = None,
                 rows=None):
        """`rows(begin, end)`, if given, reads rows [begin, end) of the weight (e.g. from a
        memory-mapped file) and `weight` may be a meta tensor giving only shape and dtype: only
        the rows this rank's shard needs are read ([Note: loading from files])."""
        policy = runtime.policy
        self.runtime = runtime
        self.wid = wid
        self.name = name
        self.unit = unit if unit is not None else f"weight:{name}"
        self.shape = tuple(weight.shape)
        self.dtype = weight.dtype
        row_bytes = (weight.shape[1] if weight.dim() == 2 else 1) * weight.element_size()
        self.layout = ChunkLayout.for_weight(weight.shape, policy.rows_per_chunk(row_bytes, name), runtime.world_size)
        self.residency = residency_classes(self.layout.num_chunks, policy.keep_ratio, policy.persist_ratio)
        self.keys = [runtime.key(wid, c) for c in range(self.layout.num_chunks)]
        # [Note: chunk sources] in python_api/host_tier.py
        self.from_host = host_chunks(self.layout.num_chunks, policy.source_fraction)
        self.store_offset: int | None = None  # byte offset in the runtime's host store
        # Until the host store is filled (ElasticRuntime.finish_registration): a reader of rows.
        self._reader = None
        with torch.no_grad():
            if rows is None:
                self.fingerprint = _fingerprint(weight)
                if policy.uses_host_store:
                    w = weight.detach()
                    self._reader = lambda b, e: w[b:e]
            else:
                self.fingerprint = _fingerprint_rows(rows, self.layout.rows)
                self._reader = rows
            # weights_on="host": no device shard at all, every chunk comes from the host store.
            self.shard = None
            if policy.weights_on == "device":
                if rows is None:
                    self.shard = self.layout.shard(weight.detach().to(runtime.device), runtime.rank)
                else:
                    self.shard = self.layout.shard_from_rows(
                        lambda b, e: rows(b, e).to(device=runtime.device, dtype=self.dtype), runtime.rank,
                        self.dtype, runtime.device)
        # World size 1: the shard *is* the (padded) weight; chunks are views of it, always resident.
        self._local_chunks = None
        if runtime.world_size == 1 and self.shard is not None:
            self._local_chunks = [
                self.shard[c * self.layout.slice_numel : c * self.layout.slice_numel + self.layout.chunk_numel_of(c)].view(
                    self.layout.chunk_shape(c)
                )
                for c in range(self.layout.num_chunks)
            ]

    @property
    def num_chunks(self) -> int:
        return self.layout.num_chunks

    @property
    def keep_chunks(self) -> int:
        """Chunks kept from forward to backward (PEAK or PERSISTENT)."""
        return sum(1 for r in self.residency if r >= Residency.PEAK)

    @property
    def persist_chunks(self) -> int:
        """Chunks kept across iterations (PERSISTENT)."""
        return sum(1 for r in self.residency if r is Residency.PERSISTENT)

    @property
    def element_size(self) -> int:
        return torch.empty((), dtype=self.dtype).element_size()

    @property
    def nbytes(self) -> int:
        """Bytes of the whole weight."""
        return self.layout.numel * self.element_size

    @property
    def device(self) -> torch.device:
        return self.runtime.device

    @property
    def slice_bytes(self) -> int:
        """Bytes of this rank's slice of one chunk (what a peer sends for a missing chunk)."""
        return self.layout.slice_numel * self.element_size

    def chunk_bytes_of(self, c: int) -> int:
        """Real bytes of chunk c (what a host copy moves)."""
        return self.layout.chunk_numel_of(c) * self.element_size

    def host_chunk(self, c: int) -> torch.Tensor:
        """Chunk c as a view of the host store."""
        rt = self.runtime
        r0, _ = self.layout.chunk_rows(c)
        offset = self.store_offset + r0 * self.layout.cols * self.element_size
        return rt.host_store.view(offset, self.dtype, self.layout.chunk_shape(c))

    def chunk_view(self, page: torch.Tensor, c: int) -> torch.Tensor:
        return PagePool.view(page, self.dtype, self.layout.chunk_shape(c))

    @property
    def page_bytes(self) -> int:
        """Bytes of the largest chunk of this weight (what one pool page must hold)."""
        return self.layout.chunk_numel * self.element_size

    def signature(self) -> dict:
        """What must be equal on every rank for this weight (checked at wrap time)."""
        return {
            "name": self.name,
            "shape": self.shape,
            "dtype": str(self.dtype),
            "rows_per_chunk": self.layout.rows_per_chunk,
            "residency": "".join(str(int(r)) for r in self.residency),
            "unit": self.unit,
            "content fingerprint": self.fingerprint,
        }


_FINGERPRINT_SAMPLES = 4096


def _fingerprint(weight: torch.Tensor) -> int:
    """crc32 of the bytes of up to 4096 evenly strided elements of `weight` (a cheap check that
    every rank was given the same frozen weight: another seed or revision differs here)."""
    flat = weight.detach().reshape(-1)
    n = flat.numel()
    if n == 0:
        return 0
    idx = torch.linspace(0, n - 1, steps=min(n, _FINGERPRINT_SAMPLES), device=flat.device).round().long()
    sample = flat[idx].contiguous().cpu()
    return zlib.crc32(sample.view(torch.uint8).numpy().tobytes())


_FINGERPRINT_ROWS = 16


def _fingerprint_rows(rows, num_rows: int) -> int:
    """The fingerprint of a weight read through `rows(begin, end)`: crc32 of up to 16 evenly
    spaced whole rows (cheap on a memory-mapped file; compared only between ranks that all
    load the same way)."""
    picks = sorted({round(i * (num_rows - 1) / max(1, _FINGERPRINT_ROWS - 1)) for i in range(min(num_rows, _FINGERPRINT_ROWS))})
    crc = 0
    for r in picks:
        row = rows(r, r + 1).detach().contiguous().cpu()
        crc = zlib.crc32(row.view(torch.uint8).numpy().tobytes(), crc)
    return crc


class _Use:
    """Chunks of one tensor pinned for one use (a forward or backward of its layer)."""

    __slots__ = ("tensor", "chunks", "works", "keys_pinned", "fresh", "ended")

    def __init__(self, tensor: ElasticTensor):
        self.tensor = tensor
        self.chunks: list[torch.Tensor | None] = [None] * tensor.num_chunks
        self.works: list[GatherWork | None] = [None] * tensor.num_chunks
        self.keys_pinned: list[int] = []
        self.fresh: set[int] = set()  # keys whose pages this use allocated for a gather
        self.ended = False


class ElasticRuntime:
    """Owns the pool, the elastic tensors of one model, the learned order and the stats.

    Every rank of `group` must create its runtime with the same policy and register the same
    weights in the same order. Without an initialised process group the runtime runs alone
    (world size 1; see [Note: single process]).
    """

    _KEY_BITS = 32  # key = wid << 32 | chunk

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
        self.tensors: list[ElasticTensor] = []
        self.pool: PagePool | None = None
        self._cache_budget = policy.pool_budget_bytes
        # The communication stream: all-gathers, their pack/unpack copies. Created here only.
        self.comm_stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        # The copy stream: host store -> page copies ([Note: host copies are stream ordered]).
        self.copy_stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" and policy.uses_host_store else None
        self.host_store = None  # built by finish_registration when the policy uses the host tier
        self.activation_offload = None  # python_api/activation_offload.py, created on first use
        self.phase = Phase.IDLE
        self._order = {Phase.FORWARD: None, Phase.BACKWARD: None}  # learned wid sequences
        # per phase, per position of the learned order: (first, end) positions of its segment
        self._segments: dict[Phase, list[tuple[int, int]] | None] = {Phase.FORWARD: None, Phase.BACKWARD: None}
        self._seq = 0  # collectives issued (carried in each one's header)
        self._observed: list[int] = []
        self._cursor = 0
        self._prefetched: dict[int, _Use] = {}  # wid -> use whose gathers are in flight
        self._end_of_backward_queued = False
        self._grad_params: list[torch.nn.Parameter] = []
        self._sync_grads = True  # False inside no_sync(): see [Note: gradient accumulation]
        # Whether the end of backward averages adapter gradients: the policy's setting, turned
        # off while another wrapper (DDP) reduces them (set_grad_reduction).
        self._reduce_grads = policy.all_reduce_grads
        self._stats = {"allgather_bytes": 0, "allgather_calls": 0, "pool_hits": 0, "pool_misses": 0, "h2d_bytes": 0}
        self._weight_bytes: dict[str, int] = {}  # all-gather bytes received per weight (stats)

    # ---------------------------------------------------------------- registration

    def key(self, wid: int, chunk: int) -> int:
        return (wid << self._KEY_BITS) | chunk

    def register(self, weight: torch.Tensor, name: str, unit: str | None = None, rows=None) -> ElasticTensor:
        """Shard `weight` under the runtime. `unit` groups weights gathered together (see
        [Note: units and coalesced gathers]); None: the weight is its own unit. With `rows`
        (a callable reading rows [begin, end) of the weight), `weight` may be on the meta
        device and only this rank's rows are read."""
        if self.pool is not None:
            raise RuntimeError("ElasticRuntime.register: all weights must be registered before the first use")
        if weight.requires_grad:
            raise ValueError(
                f"{name} requires grad: only frozen weights go under the elastic runtime "
                "(freeze it with requires_grad_(False), or keep it trainable and replicated)"
            )
        if weight.dim() not in (1, 2):
            raise ValueError(f"{name}: expected a 1-D or 2-D frozen weight, got shape {tuple(weight.shape)}")
        if rows is None and weight.is_meta:
            raise ValueError(f"{name} is on the meta device: pass `rows` to read it from its file")
        et = ElasticTensor(self, len(self.tensors), name, weight, unit, rows)
        self.tensors.append(et)
        return et

    def _agreement(self) -> dict:
        policy = {k: v for k, v in vars(self.policy).items() if k != "collective_timeout_s"}
        return {"policy": policy, "weights": [et.signature() for et in self.tensors]}

    def check_ranks_agree(self) -> None:
        """Fail on every rank, naming the field and the ranks, unless every rank registered
        the same frozen weights (names, shapes, dtypes, chunk layout, residency, units and a
        fingerprint of their contents) under the same policy. One collective, at wrap time."""
        if self.world_size == 1:
            return
        mine = self._agreement()
        every = [None] * self.world_size
        dist.all_gather_object(every, mine, group=self.group)
        problems = []
        ref = every[0]
        for field, value in ref["policy"].items():
            differ = [r for r in range(self.world_size) if every[r]["policy"].get(field) != value]
            if differ:
                problems.append(f"policy field {field!r}: {value!r} on rank 0, "
                                f"{[every[r]['policy'].get(field) for r in differ]} on rank(s) {differ}")
        counts = [len(e["weights"]) for e in every]
        if len(set(counts)) > 1:
            problems.append(f"number of frozen weights: {counts} on ranks {list(range(self.world_size))}")
        else:
            for i, sig in enumerate(ref["weights"]):
                for field, value in sig.items():
                    differ = [r for r in range(self.world_size) if every[r]["weights"][i][field] != value]
                    if differ:
                        problems.append(f"frozen weight #{i} ({sig['name']}) {field}: {value!r} on rank 0, "
                                        f"{[every[r]['weights'][i][field] for r in differ]} on rank(s) {differ}")
                        break
                if len(problems) >= 3:
                    break
        if problems:
            raise ValueError(
                "elastic: the ranks do not agree on what they wrap (every rank must build the same model "
                "with the same weights and the same ElasticPolicy): " + "; ".join(problems[:3])
            )

    def finish_registration(self) -> None:
        """After the last `register`, on every rank: check that the ranks agree, then build the
        host store when the policy uses the host tier ([Note: chunk sources])."""
        self.check_ranks_agree()
        if self.policy.offload_activations:
            from python_api.activation_offload import check_host_budget

            check_host_budget(self.policy.host_budget_bytes)  # bad input fails at wrap time
        if self.policy.uses_host_store and self.host_store is None:
            self._build_host_store()

    def _build_host_store(self) -> None:
        from python_api.host_store import node_host_store

        offsets, size = store_offsets(self.tensors)
        for et, off in zip(self.tensors, offsets):
            et.store_offset = off

        def fill(store, local_rank: int, local_world: int) -> None:
            # Each local rank writes a contiguous share of every weight's rows.
            for et in self.tensors:
                rows = et.layout.rows
                r0, r1 = rows * local_rank // local_world, rows * (local_rank + 1) // local_world
                if r0 == r1:
                    continue
                cols = et.layout.cols
                dst = store.view(et.store_offset + r0 * cols * et.element_size, et.dtype, (r1 - r0, cols))
                dst.copy_(et._reader(r0, r1).reshape(r1 - r0, cols).to(dtype=et.dtype))

        self.host_store = node_host_store(size, group=self.group, fill=fill,
                                          timeout_s=self.policy.collective_timeout_s, device=self.device)
        for et in self.tensors:
            et._reader = None

    def set_trainable(self, params: list[torch.nn.Parameter]) -> None:
        """Replicated trainable parameters whose gradients are averaged at the end of backward."""
        self._grad_params = list(params)
        for p in self._grad_params:
            p.register_post_accumulate_grad_hook(lambda _p: self._queue_end_of_backward())

    # ---------------------------------------------------------------- pool and budget

    def page_bytes(self) -> int:
        """Pool page size: `policy.page_bytes`, else the largest real chunk rounded up to 512
        bytes (never more than `chunk_bytes` asks for: a model smaller than one configured chunk
        gets pages of its own size)."""
        if self.policy.page_bytes is not None:
            largest = max((et.page_bytes for et in self.tensors), default=0)
            if largest > self.policy.page_bytes:
                raise ValueError(
                    f"ElasticPolicy.page_bytes ({self.policy.page_bytes}) is smaller than the largest chunk "
                    f"({largest} bytes): a chunk must fit in one page"
                )
            return self.policy.page_bytes
        largest = max((et.page_bytes for et in self.tensors), default=1)
        return -(-largest // 512) * 512

    def set_residency(self, et: ElasticTensor, keep_chunks: int, persist_chunks: int) -> None:
        """Residency of one weight by chunk counts (0 <= persist <= keep <= chunks), e.g. from a
        plan. Between steps and on every rank alike ([Note: symmetric residency]). Resident
        chunks that are no longer PERSISTENT are released now, so the next step already
        gathers exactly what the new residency implies."""
        n = et.num_chunks
        for what, v in (("keep_chunks", keep_chunks), ("persist_chunks", persist_chunks)):
            if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v <= n:
                raise ValueError(f"set_residency({et.name}): {what} must be an int in [0, {n}], got {v!r}")
        if persist_chunks > keep_chunks:
            raise ValueError(f"set_residency({et.name}): persist_chunks ({persist_chunks}) > keep_chunks ({keep_chunks})")
        if self.phase is not Phase.IDLE or self._prefetched:
            raise RuntimeError(f"set_residency({et.name}): change residency between steps, not inside a forward or backward")
        et.residency = residency_of_counts(n, keep_chunks, persist_chunks)
        if self.pool is not None:
            stale = [k for c, k in enumerate(et.keys) if et.residency[c] is not Residency.PERSISTENT
                     and self.pool.contains(k) and self.pool.pin_count(k) == 0]
            if stale:
                self.pool.free_many(stale)

    def set_host_fraction(self, fraction: float) -> None:
        """The share of missing chunks filled from the host store ([Note: chunk sources]), e.g.
        from a plan; between steps and on every rank alike. Needs the host store, which exists
        when the policy asked for the host tier (weights_on="host" or host_fraction > 0 at
        wrap time); with weights_on="host" the only value is 1."""
        if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) or not 0.0 <= fraction <= 1.0:
            raise ValueError(f"set_host_fraction: expected a number in [0, 1], got {fraction!r}")
        if self.phase is not Phase.IDLE or self._prefetched:
            raise RuntimeError("set_host_fraction: change the sources between steps, not inside a forward or backward")
        if fraction > 0 and self.host_store is None:
            raise ValueError("set_host_fraction: this runtime has no host store (wrap with weights_on='host' or "
                             "host_fraction > 0 to build one)")
        if self.policy.weights_on == "host" and fraction != 1.0:
            raise ValueError(f"set_host_fraction({fraction}): with weights_on='host' every chunk comes from the host store")
        self.policy = dataclasses.replace(self.policy, host_fraction=float(fraction))
        for et in self.tensors:
            et.from_host = host_chunks(et.num_chunks, self.policy.source_fraction)

    def set_prefetch_depth(self, depth: int) -> None:
        """Segments gathered ahead of the running one ([Note: learned order and prefetch]), e.g.
        from a plan; between steps, on every rank alike. The pool's working set follows
        ([Note: pool budget and working set])."""
        if isinstance(depth, bool) or not isinstance(depth, int) or depth < 0:
            raise ValueError(f"set_prefetch_depth: expected an int >= 0, got {depth!r}")
        if self.phase is not Phase.IDLE or self._prefetched:
            raise RuntimeError("set_prefetch_depth: change the prefetch window between steps, not inside a forward or backward")
        self.policy = dataclasses.replace(self.policy, prefetch_depth=depth)
        if self.pool is not None:
            self.pool.set_budget(self._pool_budget())
            self.pool.drain_evicted()

    def set_offload_activations(self, enabled: bool) -> None:
        """Activation offload on or off from the next forward (python_api/activation_offload.py),
        e.g. from a plan; between steps, on every rank alike."""
        if not isinstance(enabled, bool):
            raise ValueError(f"set_offload_activations: expected True or False, got {enabled!r}")
        if enabled:
            from python_api.activation_offload import check_host_budget

            check_host_budget(self.policy.host_budget_bytes)
        self.policy = dataclasses.replace(self.policy, offload_activations=enabled)

    def _working_set_pages(self) -> int:
        units: dict[str, int] = {}
        for et in self.tensors:
            units[et.unit] = units.get(et.unit, 0) + et.num_chunks
        counts = sorted(units.values(), reverse=True)
        return sum(counts[: 1 + self.policy.prefetch_depth])

    def _total_pages(self) -> int:
        return sum(et.num_chunks for et in self.tensors)

    def _pool_budget(self) -> int:
        page = self.page_bytes()
        total = self._total_pages() * page
        if self._cache_budget is None:
            return max(total, page)
        return max(page, min(total, self._cache_budget + self._working_set_pages() * page))

    def _ensure_pool(self) -> None:
        if self.pool is None and not self._local_only():
            self.pool = PagePool(self.page_bytes(), self._pool_budget(), device=self.device)

    def set_pool_budget(self, budget_bytes: int | None) -> None:
        """Change the cache budget (bytes beyond the working set) at any moment, on every rank."""
        if budget_bytes is not None and (isinstance(budget_bytes, bool) or not isinstance(budget_bytes, int) or budget_bytes < 0):
            raise ValueError(f"set_pool_budget: expected None or an int >= 0, got {budget_bytes!r}")
        self._cache_budget = budget_bytes
        if self.pool is not None:
            self.pool.set_budget(self._pool_budget())
            self.pool.drain_evicted()  # see _finish_phase

    # ---------------------------------------------------------------- stats

    def stats(self, per_weight: bool = False) -> dict:
        """Cumulative per-rank counters; `per_weight` adds "allgather_bytes_per_weight"
        (name -> bytes received for that weight's chunks, `full_weight` excluded).
        h2d_bytes: host -> device bytes (host-store chunks and activations brought back);
        d2h_bytes: activations offloaded; host_store_bytes: the node's host store;
        host_pinned_bytes: page-locked host bytes (the store when pinned, on CUDA, and the
        activation offload's buffers)."""
        out = dict(self._stats)
        out["pool_peak_bytes"] = self.pool.stats()["peak_in_use_bytes"] if self.pool is not None else 0
        out["d2h_bytes"] = 0
        out["host_store_bytes"] = self.host_store.nbytes if self.host_store is not None else 0
        out["host_pinned_bytes"] = self.host_store.pinned_bytes if self.host_store is not None else 0
        if self.activation_offload is not None:
            act = self.activation_offload.stats()
            out["h2d_bytes"] += act["h2d_bytes"]
            out["d2h_bytes"] += act["d2h_bytes"]
            out["host_pinned_bytes"] += act["host_pinned_bytes"]
        if per_weight:
            out["allgather_bytes_per_weight"] = {et.name: self._weight_bytes.get(et.name, 0) for et in self.tensors}
        return out

    def reset_stats(self) -> None:
        for k in self._stats:
            self._stats[k] = 0
        self._weight_bytes.clear()
        if self.activation_offload is not None:
            self.activation_offload.reset_stats()
        if self.pool is not None:
            self.pool.reset_peak()

    # ---------------------------------------------------------------- phases and order

    @staticmethod
    def _in_backward() -> bool:
        """The autograd engine is running a backward on this thread ([Note: recompute inside
        backward])."""
        return torch._C._current_graph_task_id() != -1

    def _enter(self, phase: Phase, et: ElasticTensor) -> None:
        """Track phase changes and the position of `et` in the learned order of `phase`."""
        if phase is Phase.FORWARD:
            order = self._order[Phase.FORWARD]
            new_pass = self.phase is not Phase.FORWARD or (
                order is not None and self._cursor >= len(order)
            ) or (order is None and self._observed and self._observed[0] == et.wid)
            if new_pass:
                self._finish_phase()
                self.phase = Phase.FORWARD
                # A backward that raised never ran its queued callback: allow a new one.
                self._end_of_backward_queued = False
        elif self.phase is not Phase.BACKWARD:
            self._finish_phase()
            self.phase = Phase.BACKWARD
            self._queue_end_of_backward()
        order = self._order[self.phase]
        if order is not None and (self._cursor >= len(order) or order[self._cursor] != et.wid):
            # The model took another path: forget the order, release what was prefetched for it.
            self._release_prefetched()
            self._order[self.phase] = None
            self._segments[self.phase] = None
        self._observed.append(et.wid)
        self._cursor += 1

    def _learn(self, phase: Phase, order: list[int]) -> None:
        """Record the order of `phase` and cut it into segments ([Note: units and coalesced
        gathers])."""
        segments: list[tuple[int, int]] = []
        first = 0
        for i in range(1, len(order) + 1):
            if i == len(order) or self.tensors[order[i]].unit != self.tensors[order[first]].unit \
                    or order[i] in order[first:i]:
                segments.extend([(first, i)] * (i - first))
                first = i
        self._order[phase] = order
        self._segments[phase] = segments

    def _finish_phase(self) -> None:
        """Close the current phase: learn its order, release prefetches, sweep non-persistent chunks."""
        if self.phase is not Phase.IDLE and self._order[self.phase] is None and self._observed:
            self._learn(self.phase, list(self._observed))
        try:
            self._release_prefetched()
        finally:
            self._observed = []
            self._cursor = 0
            if self.pool is not None and self.phase is not Phase.IDLE:
                keep = Residency.PEAK if self.phase is Phase.FORWARD else Residency.PERSISTENT
                self._sweep(keep)
                # The runtime keeps no page views across uses (a miss is found by lookup_pin), so
                # it only empties the pool's list of evicted keys, which would otherwise grow by
                # every eviction for the whole run.
                self.pool.drain_evicted()
            self.phase = Phase.IDLE

    def _sweep(self, keep: Residency) -> None:
        """Discard resident, unpinned chunks below residency `keep`."""
        for et in self.tensors:
            for c, key in enumerate(et.keys):
                if et.residency[c] < keep and self.pool.contains(key) and self.pool.pin_count(key) == 0:
                    self.pool.free(key)

    def _queue_end_of_backward(self) -> None:
        if self._end_of_backward_queued:
            return
        self._end_of_backward_queued = True
        torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)

    def _end_of_backward(self) -> None:
        self._end_of_backward_queued = False
        if self.phase is Phase.BACKWARD:
            self._finish_phase()
        if self._reduce_grads and self._sync_grads and self.world_size > 1:
            with self._device_guard():
                self._all_reduce_grads()

    def set_grad_reduction(self, enabled: bool | None) -> None:
        """Turn the end-of-backward gradient averaging on or off (None: the policy's
        `all_reduce_grads`), e.g. off while DDP averages the same gradients. On every rank."""
        self._reduce_grads = self.policy.all_reduce_grads if enabled is None else bool(enabled)

    @property
    def reduces_grads(self) -> bool:
        return self._reduce_grads

    def drop_cached(self, et: ElasticTensor) -> None:
        """Free the pool pages holding chunks of `et` (after its shard changed). Local; not
        while a use of `et` is running."""
        if self.pool is None:
            return
        cached = [k for k in et.keys if self.pool.contains(k)]
        if any(self.pool.pin_count(k) > 0 for k in cached):
            raise RuntimeError(f"{et.name} is in use by a forward or backward; change it between steps")
        if cached:
            self.pool.free_many(cached)

    @contextmanager
    def no_sync(self):
        """Backward passes run inside this context leave the gradients of the trainable
        parameters unreduced (local sums); the first backward after it averages the
        accumulated sums. See [Note: gradient accumulation]. Enter it on every rank alike."""
        previous = self._sync_grads
        self._sync_grads = False
        try:
            yield
        finally:
            self._sync_grads = previous

    def _all_reduce_grads(self) -> None:
        grads = [p.grad for p in self._grad_params if p.grad is not None]
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for g in grads:
            by_dtype.setdefault(g.dtype, []).append(g)
        with record_function("elastic::all_reduce_grads"):
            for gs in by_dtype.values():
                flat = torch.cat([g.reshape(-1) for g in gs])
                dist.all_reduce(flat, group=self.group)
                flat.div_(self.world_size)
                offset = 0
                for g in gs:
                    g.copy_(flat[offset : offset + g.numel()].view_as(g))
                    offset += g.numel()

    # ---------------------------------------------------------------- whole weights

    def full_weight(self, et: ElasticTensor) -> torch.Tensor:
        """The whole weight as one new tensor (for export and merging; a collective: call it
        on every rank). Bypasses the pool; counted in the all-gather stats."""
        out = torch.empty(et.shape, dtype=et.dtype, device=self.device)
        cols = et.layout.cols
        flat = out.view(-1)
        dests = []
        for c in range(et.num_chunks):
            r0, r1 = et.layout.chunk_rows(c)
            dests.append(flat[r0 * cols : r1 * cols].view(et.layout.chunk_shape(c)))
        if self._local_only():
            for d, src in zip(dests, et._local_chunks):
                d.copy_(src)
            return out
        if et.shard is None:  # weights_on="host": the store holds the whole weight
            for c, d in enumerate(dests):
                d.copy_(et.host_chunk(c))
            return out
        gathered = et.shard.new_empty(self.world_size * et.shard.numel())
        with record_function("elastic::gather_full"):
            all_gather_into(gathered, et.shard, self.group, async_op=False)
        unpack_gathered(gathered, self.world_size, [et.layout.slice_numel], [et.num_chunks], dests)
        self._stats["allgather_calls"] += 1
        self._stats["allgather_bytes"] += (self.world_size - 1) * et.shard.numel() * et.shard.element_size()
        return out

    # ---------------------------------------------------------------- gather / discard

    def _start_uses(self, tensors: list[ElasticTensor]) -> list[_Use]:
        """Pin the resident chunks of `tensors` and issue the all-gathers of the missing ones
        (not waited for); missing chunks of several tensors share collectives up to the cap."""
        self._ensure_pool()
        uses, pending = [], []
        try:
            for et in tensors:
                use = _Use(et)
                uses.append(use)
                if self._local_only():
                    use.chunks = list(et._local_chunks)
                    self._stats["pool_hits"] += et.num_chunks
                    continue
                slots = self.pool.lookup_pin(et.keys)
                missing = []
                for c, slot in enumerate(slots):
                    if slot >= 0:
                        use.chunks[c] = et.chunk_view(self.pool.page(slot), c)
                        use.keys_pinned.append(et.keys[c])
                    else:
                        missing.append(c)
                self._stats["pool_hits"] += et.num_chunks - len(missing)
                self._stats["pool_misses"] += len(missing)
                from_host = [c for c in missing if et.from_host[c]]
                if from_host:
                    self._copy_from_host(use, from_host)
                pending.extend(self._runs(use, [c for c in missing if not et.from_host[c]]))
            self._issue_gathers(pending)
        except BaseException:
            # Nothing of a use that failed to start may stay pinned or hold pages without data.
            for use in uses:
                self._end_use(use, Residency.PERSISTENT, failed=True)
            raise
        return uses

    def _local_only(self) -> bool:
        return self.world_size == 1 and not self._force_pool and self.policy.weights_on == "device"

    def _copy_from_host(self, use: _Use, chunks: list[int]) -> None:
        """Fill `chunks` of the use from the host store ([Note: chunk sources])."""
        et = use.tensor
        pairs = []
        for c in chunks:
            page = self.pool.allocate_pinned(et.keys[c])
            use.keys_pinned.append(et.keys[c])
            use.fresh.add(et.keys[c])
            use.chunks[c] = et.chunk_view(page, c)
            pairs.append((et.host_chunk(c), use.chunks[c]))
        work = HostCopyWork(pairs, self.copy_stream, self.device)
        for c in chunks:
            use.works[c] = work
        self._stats["h2d_bytes"] += work.bytes

    def _runs(self, use: _Use, missing: list[int]) -> list[tuple[_Use, list[int]]]:
        """Missing chunks as runs of consecutive indices of at most `collective_bytes` per rank."""
        cap = self.policy.collective_bytes
        per_chunk = use.tensor.slice_bytes
        runs: list[list[int]] = []
        for c in missing:
            if runs and c == runs[-1][-1] + 1 and (cap is None or (len(runs[-1]) + 1) * per_chunk <= cap):
                runs[-1].append(c)
            else:
                runs.append([c])
        return [(use, run) for run in runs]

    def _issue_gathers(self, runs: list[tuple[_Use, list[int]]]) -> None:
        """Coalesce runs (of one or several tensors) into collectives of at most the cap."""
        cap = self.policy.collective_bytes
        batches: list[list[tuple[_Use, list[int]]]] = []
        size = 0
        for use, run in runs:
            b = len(run) * use.tensor.slice_bytes
            if batches and (cap is None or size + b <= cap) and use.tensor.dtype == batches[-1][0][0].tensor.dtype:
                batches[-1].append((use, run))
                size += b
            else:
                batches.append([(use, run)])
                size = b
        for batch in batches:
            chunk_runs = []
            for use, run in batch:
                et = use.tensor
                pages = []
                for c in run:
                    page = self.pool.allocate_pinned(et.keys[c])
                    use.keys_pinned.append(et.keys[c])
                    use.fresh.add(et.keys[c])
                    pages.append(et.chunk_view(page, c))
                chunk_runs.append(ChunkRun(et, run[0], run[-1] + 1, pages))
            work = GatherWork(
                chunk_runs, self.group, self.world_size, self.comm_stream, self.policy.collective_timeout_s,
                seq=self._seq, device=self.device,
            )
            self._seq += 1
            self._stats["allgather_calls"] += 1
            self._stats["allgather_bytes"] += work.received_bytes
            for (use, run), r in zip(batch, chunk_runs):
                name = use.tensor.name
                self._weight_bytes[name] = self._weight_bytes.get(name, 0) + \
                    (self.world_size - 1) * len(run) * use.tensor.slice_bytes
                for c, page in zip(run, r.pages):
                    use.works[c] = work
                    use.chunks[c] = page

    def _segment_wids(self, position: int) -> list[int]:
        """Weights used from `position` to the end of its segment in the current phase's
        learned order (those before it in the segment have had their use)."""
        order, segments = self._order[self.phase], self._segments[self.phase]
        if order is None or position >= len(order):
            return []
        return list(dict.fromkeys(order[position : segments[position][1]]))

    def _start_use(self, et: ElasticTensor) -> _Use:
        """The use of `et` now: prefetched, or started together with the rest of its segment."""
        use = self._prefetched.pop(et.wid, None)
        if use is not None:
            return use
        others = [self.tensors[w] for w in self._segment_wids(self._cursor - 1)
                  if w != et.wid and w not in self._prefetched]
        uses = self._start_uses([et] + others)
        for u in uses[1:]:
            self._prefetched[u.tensor.wid] = u
        return uses[0]

    def _prefetch_next(self, et: ElasticTensor) -> None:
        """Start the segments following the current one, `prefetch_depth` of them."""
        order = self._order[self.phase]
        depth = self.policy.prefetch_depth
        if order is None or depth == 0 or self._local_only():
            return
        position = self._cursor - 1
        ahead: list[int] = []
        for _ in range(depth):
            position = self._segments[self.phase][position][1] if position < len(order) else position
            if position >= len(order):
                break
            ahead.extend(self._segment_wids(position))
        ahead = [w for w in dict.fromkeys(ahead) if w not in self._prefetched and w != et.wid]
        if ahead:
            for use in self._start_uses([self.tensors[w] for w in ahead]):
                self._prefetched[use.tensor.wid] = use

    def _release_prefetched(self) -> None:
        """Complete and release prefetches that no use consumed (the model changed its path).
        Every one is released even if a gather failed; the first failure is raised after."""
        error = None
        prefetched, self._prefetched = self._prefetched, {}
        for use in prefetched.values():
            for c, work in enumerate(use.works):
                if work is not None:
                    try:
                        work.wait(f"{use.tensor.name} (prefetch) chunk {c}")
                    except RuntimeError as exc:
                        error = error or exc
            self._end_use(use, keep=Residency.PERSISTENT)
        if error is not None:
            raise error

    def _end_use(self, use: _Use, keep: Residency, failed: bool = False) -> None:
        """Unpin the use's chunks; discard those whose residency is below `keep`, and those
        whose gather failed or never completed (their pages hold no data)."""
        if use.ended:
            return
        use.ended = True
        if not use.keys_pinned:
            return
        et = use.tensor
        if self.comm_stream is not None:
            compute = torch.cuda.current_stream(self.device)
            for key in use.keys_pinned:
                self.pool.record_stream(key, compute)
        self.pool.unpin_many(use.keys_pinned)
        wid_shift = self._KEY_BITS
        for key in use.keys_pinned:
            c = key - (et.wid << wid_shift)
            work = use.works[c]
            no_data = key in use.fresh and (failed or work is None or work.failed or not work.done)
            if (et.residency[c] < keep or no_data) and self.pool.pin_count(key) == 0 and self.pool.contains(key):
                self.pool.free(key)
        use.keys_pinned = []

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
        with self._device_guard():
            recompute = phase is Phase.FORWARD and self._in_backward()
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


class Resident:
    """The page table of one use of an elastic tensor (valid inside `ElasticRuntime.use`)."""

    __slots__ = ("_use",)

    def __init__(self, use: _Use):
        self._use = use

    def _wait(self, c: int) -> torch.Tensor:
        work = self._use.works[c]
        if work is not None:
            work.wait(f"{self._use.tensor.name} chunk {c}")
        return self._use.chunks[c]

    def execute(self, fn) -> None:
        """fn(c, chunk) for each chunk in index order, each as soon as it has arrived."""
        for c in range(self._use.tensor.num_chunks):
            fn(c, self._wait(c))

    def chunks(self) -> list[torch.Tensor]:
        """Every chunk, after all gathers of this use completed."""
        return [self._wait(c) for c in range(self._use.tensor.num_chunks)]
