"""One frozen weight under the runtime (`ElasticTensor`: its layout, its shard on this rank,
the residency of its chunks, where each chunk comes from) and the enums of the runtime.

[Note: residency classes]
Chunk c of a weight with n chunks is PERSISTENT if c < round(persist_ratio * n), else PEAK if
c < round(keep_ratio * n), else TRANSIENT (round half up, so keep >= persist carries over to
chunk counts). A plan sets the counts per weight instead (`ElasticRuntime.set_residency`,
python_api/planning/apply.py); the ratios are only the default. The kept chunks are the *first* ones because `execute` walks chunks in index
order, forward and backward: whatever is resident is computed on at once while the missing,
higher-index chunks are still being gathered.
- TRANSIENT: gathered for each use, discarded right after it.
- PEAK: kept from a forward use to the backward use of the same layer, discarded after it (and
  right after forward when no backward will come: no_grad, or no input needs a gradient).
- PERSISTENT: kept across iterations; the pool may still evict it under a shrinking budget,
  which only turns the next use into a miss.
In the project's one residency vocabulary (docs/architecture.md, "Residency") these are the
lifetimes transient, micro-batch and persistent; `Residency.MICRO_BATCH` is PEAK's other name.
"""

from __future__ import annotations

import enum
import zlib

import torch

from elastic_kernels import ChunkLayout, PagePool

from ..host.sources import host_chunks
from ..quant import PackedRows, fill_image_share, quantized_layout, quantized_shard


class Residency(enum.IntEnum):
    """How long a gathered chunk stays in the pool ([Note: residency classes]; the lifetimes of
    docs/architecture.md, "Residency"). MICRO_BATCH is an alias of PEAK (same member)."""
    TRANSIENT = 0
    PEAK = 1
    PERSISTENT = 2
    MICRO_BATCH = 1  # the lifetime's name in the residency vocabulary: an alias of PEAK


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


# [Note: resident runs]
# A weight every chunk of which is kept across iterations (PERSISTENT) costs, in pages, its
# shard twice (the shard, and its rows inside the pool's full chunks), page rounding, and one
# pin / view / unpin and one GEMM per chunk on every use (issue 27: budget all ran at 0.84x
# DDP's tokens/s at +290..320 MiB of tensor peak on SmolLM2-135M). Such a weight is instead
# held as a *run*: one tensor of exactly rows * cols elements, the weight in row order
# (`Run.whole`). When every full chunk's elements are a multiple of the world size (W slices
# of S = chunk_numel / W, no padding), chunk c starts at c*W*S and rank r's slice of a full
# chunk c is run[(c*W + r)*S : (c*W + r + 1)*S], exactly as in the padded chunk-major order
# of [Note: chunk-major shard layout]; only the ragged last chunk is padded in that layout,
# and a run does not hold its padding: rank r's share of it is its slice's real elements,
# run[base + min(r*S, L) : base + min((r+1)*S, L)] (base = (n-1)*W*S, L the last chunk's
# elements: S of them, fewer, or none). That is where the shard lives: the separate shard
# tensor is freed, `ElasticTensor.shard` is None, `run.own[c]` are this rank's elements
# (`own_parts()`, `shard_bytes`; demotion copies them into a fresh shard, which holds no
# padding either). No second copy, no padding. A use of a filled run is O(1) Python (no pool
# call, nothing to wait for) and one GEMM: `Resident.whole()` / `Resident.table()` give the
# layers one [rows, cols] tensor (nn/linear.py: one F.linear / one mm; nn/lora.py: the paged
# op with a single chunk).
# - Which weights: every chunk PERSISTENT, none from the host store, not quantized, weights on
#   the device, a runtime that gathers (world size > 1 or force_pool), the layout above, and a
#   cache budget that holds every kept chunk of the model in pages (None, or >= the kept
#   chunks' pages: exactly when no kept chunk is ever evicted, so traffic is unchanged to the
#   byte; a smaller budget: the next bullet). Budget all and a plan keeping weights whole
#   qualify; partly resident, streamed, host-tier and quantized weights keep the paged path.
#   At world size 1 without force_pool the shard is already the weight and nothing changes.
#   On SmolLM2-135M at 256 KiB chunks every linear qualifies at 2 and 4 ranks (in_features
#   576 and 1536 are multiples of 4, so every chunk is), so no per-chunk padding with
#   strided views was needed.
# - Partial budgets: a cache budget below every kept chunk's pages holds whole weights as runs,
#   in the order of registration, each whose run_bytes still fit beside the runs already
#   chosen (the full weight's bytes are charged, a rank-independent figure, so every rank
#   chooses the same weights: [Note: symmetric residency]), and the rest in pages through
#   what the budget has left (their kept chunks evicted in LRU order as before). A weight
#   held as a run costs its bytes once; in pages a kept chunk cost a page beside the shard,
#   which already holds the rank's slice of it. So budget b holds at most the shard plus b,
#   and less by the shard bytes of the weights held whole: on SmolLM2-135M at 2 ranks the
#   tensor peaks of budgets 50% and 75% were 826.1 and 927.5 MiB in pages, above budget all's
#   784.4 (bench/results/2026-12-03_frontier_real.md); held whole they fall between budget 0
#   and budget all (bench/results/2026-12-04_frontier_real.md). Traffic: a run misses nothing
#   after its fill, the pages of the rest miss as LRU makes them; budget 0 and budget all are
#   unchanged to the byte.
# - The ragged last chunk: the layout (gathers, pages, every byte count) keeps its equal
#   padded slices; neither a run nor a shard holds the padding ([Note: chunk-major shard
#   layout]: a shard too, since 2026-12-03). Filling a run sends this rank's slice of the last
#   chunk as a new zero-padded tensor of S elements (`send_parts`, one per weight, alive for
#   that one gather; a shard's gathers do the same), and the gathered last chunk is unpacked
#   into the run's chunk view, whose padding `unpack_gathered` drops as for a page. So a run
#   costs the weight's bytes, nothing more, and the traffic is unchanged to the byte. Not
#   chosen: a slice size of its own for the last chunk in the layout (ceil(L / W)): it would
#   trim the last chunk's gathers too, but changes every byte count of the gathers, the
#   planner's profile and the pack arithmetic; for a run or a shard it saves nothing more.
# - Measured (bench/results/2026-12-03_runs.md, 2 gloo ranks, interleaved, loaded VM): budget
#   all's tensor peak 810.5 MiB against 1027.4 paged and 784.4 for DDP with the padded last
#   chunk in each run (26.10 MiB over the 210 linears by the layout's arithmetic, the
#   measured gap). Without it (bench/results/2026-12-03_ragged.md, 2 and 4 ranks): 784.387
#   MiB, 0.0012 MiB below DDP's 784.389 at both; tokens/s 0.990x DDP's at 2 ranks and 1.001x
#   at 4 (median of per-round ratios; spread 0.79-1.29 on the loaded VM).
# - Filling: the first use after a weight became a run gathers every chunk through the usual
#   coalesced gathers (headers, prefetch, byte counts unchanged), whose pages are the run's
#   chunk views: the received slices are unpacked into the run, own slice included (same
#   values). Not one all_gather_into_tensor in place: that lands rank-major, and the run is
#   chunk-major, so in place it would take one collective per chunk; the receive buffer is
#   the usual one (at most collective_bytes * W) and lives only during that one step.
#   `run.filled` is set once every gather of the use completed; a failed gather leaves it
#   unfilled and the next use gathers again.
# - Accounting: a run's bytes (the weight's, no padding, no page rounding) are charged
#   against the cache budget: the pool's budget is the cache budget less the runs'
#   bytes, its working set and its cap count only the weights held in pages, and `stats()`
#   reports `run_bytes` and adds the runs to `pool_peak_bytes`. The planner's memory model
#   counts runs the same way ([Note: what the memory model counts] in
#   python_api/planner/memory.py; a measured profile's `run_bytes`, from `can_hold_as_run`).
# - Changes (on every rank alike, like every residency change): a budget, residency or source
#   change that no longer admits a run demotes it at once (its own slices copied out to a fresh
#   shard, the run freed; the chunks still PERSISTENT of a filled run copied into pages while
#   the pool has room without evicting), and `drop_cached` does too. Promotion (a weight
#   becoming a run: its own slices copied in, its cached pages freed, filled by its next use)
#   waits for a point where no use is in flight: the first use, or the start of a forward pass.


class Run:
    """The whole weight of one rank in one tensor ([Note: resident runs]): `buffer` holds the
    weight's elements and nothing else (numel of them, in row order: chunk c at
    c * world_size * slice_numel, the ragged last chunk unpadded), `whole` is `buffer` viewed
    [rows, cols], `chunks[c]` chunk c's [rows_c, cols] view, `own[c]` this rank's real
    elements of chunk c (where the shard lives: slice_numel elements, or fewer, possibly none,
    of the ragged last chunk, whose padding a run does not hold).
    `filled`: every peer's slices have arrived (until then only `own` holds data)."""

    __slots__ = ("buffer", "whole", "chunks", "own", "filled")

    def __init__(self, et: ElasticTensor):
        st, w, r = et.storage, et.storage.world_size, et.runtime.rank
        n, s = st.num_chunks, st.slice_numel
        self.buffer = torch.empty(st.numel, dtype=et.storage_dtype, device=et.device)
        self.whole = self.buffer.view(et.shape)
        self.chunks = [self.buffer[c * w * s : c * w * s + st.chunk_numel_of(c)].view(et.chunk_shape(c))
                       for c in range(n)]
        self.own = []
        for c in range(n):
            base, real = c * w * s, st.chunk_numel_of(c)
            self.own.append(self.buffer[base + min(r * s, real) : base + min((r + 1) * s, real)])
        self.filled = False

    @property
    def nbytes(self) -> int:
        return self.buffer.numel() * self.buffer.element_size()


class ElasticTensor:
    """One frozen weight: its chunk-major shard on this rank and the residency of its chunks."""

    def __init__(self, runtime, wid: int, name: str, weight: torch.Tensor, unit: str | None = None,
                 rows=None):
        """`rows(begin, end)`, if given, reads rows [begin, end) of the weight (e.g. from a
        memory-mapped file) and `weight` may be a meta tensor giving only shape and dtype: only
        the rows this rank's shard needs are read ([Note: loading from files])."""
        policy = runtime.policy
        self.runtime = runtime
        self.wid = wid
        self.name = name
        self.unit = unit if unit is not None else f"weight:{name}"
        # Uses of this weight in one forward pass: 2 for an embedding table its output layer
        # is tied to (python_api/nn/embedding.py); read where a pass is learned (_order.py).
        self.uses_per_forward = 1
        self.shape = tuple(weight.shape)
        self.dtype = weight.dtype  # the weight's own dtype (a quantized weight dequantizes to it)
        row_bytes = (weight.shape[1] if weight.dim() == 2 else 1) * weight.element_size()
        # The weight's rows: what the layers compute with (chunk c is rows chunk_rows(c)); a
        # quantized weight's chunks hold whole blocks too (ElasticPolicy.weight_rows_per_chunk).
        self.layout = ChunkLayout.for_weight(weight.shape, policy.weight_rows_per_chunk(name, weight.shape, row_bytes),
                                             runtime.world_size)
        # [Note: quantized frozen weights] in python_api/quant/__init__.py: a quantized weight
        # stores its image (1-D uint8, chunk c = blob c); `storage` is the layout of what is
        # stored, sharded, gathered and cached, `storage_dtype` its element type.
        # A PackedRows (a weight its file holds quantized) chooses the layout that holds its values.
        packed = rows if isinstance(rows, PackedRows) else None
        self.qlayout = quantized_layout(policy, name, weight.shape, self.layout.rows_per_chunk, packed)
        if self.qlayout is None:
            self.storage, self.storage_dtype = self.layout, self.dtype
        else:
            self.storage, self.storage_dtype = self.qlayout.image_layout(runtime.world_size), torch.uint8
        self.residency = residency_classes(self.layout.num_chunks, policy.keep_ratio, policy.persist_ratio)
        self.keys = [runtime.key(wid, c) for c in range(self.layout.num_chunks)]
        # [Note: chunk sources] in python_api/host/sources.py
        self.from_host = host_chunks(self.layout.num_chunks, policy.source_fraction)
        self.store_offset: int | None = None  # byte offset in the runtime's host store
        # Quantized only: row -> its non-finite values, over the rows this rank read to quantize
        # (its shard, its share of the host store); a row read twice counts once.
        self._bad_rows: dict[int, int] = {}
        self._nonfinite_packed = 0  # a weight its file holds quantized: its non-finite values
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
            # Held as a run ([Note: resident runs]): the shard then lives in it (`run.own`, its
            # real elements only) and `shard` is None; `on_device` is true for both.
            self.run: Run | None = None
            if policy.weights_on == "device":
                if rows is None:
                    self.shard = self.shard_of_weight(weight)
                else:
                    self.shard = self.shard_of(rows)
        # World size 1: the shard *is* the weight (a slice is a whole chunk, so an unpadded
        # shard holds exactly the weight's elements); chunks are views of it, always resident.
        self._local_chunks = None
        if runtime.world_size == 1 and self.shard is not None:
            st = self.storage
            self._local_chunks = [
                self.shard[c * st.slice_numel : c * st.slice_numel + st.chunk_numel_of(c)].view(
                    self.chunk_shape(c))
                for c in range(st.num_chunks)
            ]

    @property
    def run_layout_ok(self) -> bool:
        """Whether the padded chunks lie back to back, so that a run's first rows * cols
        elements are the weight ([Note: resident runs]): not quantized, and every full chunk's
        elements a multiple of the world size (the ragged last chunk is padded at the end)."""
        st = self.layout
        return self.qlayout is None and (st.num_chunks == 1 or st.chunk_numel % st.world_size == 0)

    @property
    def run_bytes(self) -> int:
        """Bytes of this weight held as a run: the weight's own bytes, nothing more (the ragged
        last chunk is not padded in a run)."""
        return self.storage.numel * self.element_size

    @property
    def on_device(self) -> bool:
        """Whether this rank holds its share of the weight on the device: a shard, or a run."""
        return self.shard is not None or self.run is not None

    def own_parts(self) -> list[torch.Tensor]:
        """The tensors holding this rank's share as it is held now: [the shard] (its real
        elements: no padding, [Note: chunk-major shard layout]), or a run's own elements chunk
        by chunk; [] with weights_on="host"."""
        if self.run is not None:
            return list(self.run.own)
        return [] if self.shard is None else [self.shard]

    @property
    def shard_bytes(self) -> int:
        """Bytes of this rank's share as held now (`own_parts`)."""
        return sum(t.numel() for t in self.own_parts()) * self.element_size

    def padded_shard(self) -> torch.Tensor:
        """This rank's shard padded as in the gathers ([Note: chunk-major shard layout]:
        num_chunks * slice_numel elements, the ragged last slice zero-padded): the shard itself
        when its last slice is full, else a new zero-padded copy (of the shard, or of a run's
        own elements)."""
        st = self.storage
        return st.pad_shard(self.shard if self.run is None else self._shard_from_run(), self.runtime.rank)

    def _shard_from_run(self) -> torch.Tensor:
        """A new shard (own_numel elements, no padding) holding the run's own elements."""
        st = self.storage
        n, s = st.num_chunks, st.slice_numel
        shard = torch.empty(st.own_numel(self.runtime.rank), dtype=self.storage_dtype, device=self.device)
        if n > 1:
            shard[: (n - 1) * s].view(n - 1, s).copy_(self._run_full_own(self.run))
        shard[(n - 1) * s :].copy_(self.run.own[n - 1])
        return shard

    def _run_full_own(self, run: Run) -> torch.Tensor:
        """The run's own slices of the full chunks 0..n-2, one [n - 1, slice_numel] view (they
        are world_size slices apart)."""
        st = self.storage
        n, w, s = st.num_chunks, st.world_size, st.slice_numel
        return run.buffer[: (n - 1) * w * s].view(n - 1, w, s)[:, self.runtime.rank, :]

    def to_run(self) -> None:
        """Hold the weight as a run: its own elements move into it, the separate shard is freed
        (nothing of the peers' slices yet: `run.filled` is False)."""
        st = self.storage
        n, s = st.num_chunks, st.slice_numel
        run = Run(self)
        if n > 1:
            self._run_full_own(run).copy_(self.shard[: (n - 1) * s].view(n - 1, s))
        last = run.own[n - 1]
        last.copy_(self.shard[(n - 1) * s : (n - 1) * s + last.numel()])
        self.run, self.shard = run, None

    def to_shard(self) -> None:
        """Back to a shard of its own (a fresh tensor of its real elements, the run freed): the
        inverse of `to_run`."""
        shard = self._shard_from_run()
        self.run, self.shard = None, shard

    def send_parts(self, begin: int, end: int) -> tuple[list[torch.Tensor], list[int], list[int], list[int]]:
        """This rank's slices of chunks [begin, end) as `pack_shards` takes them (shards,
        slice sizes, chunk begins, chunk ends): one contiguous range of the shard, or, held as
        a run, one slice per chunk (in the run they are world_size slices apart). Neither holds
        the ragged last chunk's padding: a last slice shorter than slice_numel is sent as a
        new zero-padded copy (`_padded_last`), so the send buffer is what it was when shards
        were padded ([Note: chunk-major shard layout])."""
        s = self.storage.slice_numel
        last = self.num_chunks - 1
        if self.run is None:
            if end <= last or self.shard.numel() == self.storage.shard_numel:
                # whole slices only, as pack_shards checks (the short last one left out)
                return [self.shard[: end * s]], [s], [begin], [end]
            full = self.shard[: last * s]  # the full slices: a whole number of them, as pack_shards checks
            tail = self._padded_last(self.shard[last * s :])
            if begin == last:
                return [tail], [s], [0], [1]
            return [full, tail], [s, s], [begin, 0], [last, 1]
        k = end - begin
        parts = self.run.own[begin:end]
        if end == self.num_chunks and parts[-1].numel() < s:
            parts[-1] = self._padded_last(parts[-1])
        return parts, [s] * k, [0] * k, [1] * k

    def _padded_last(self, real: torch.Tensor) -> torch.Tensor:
        """This rank's slice of the last chunk as sent: its real elements `real`, zero-padded to
        slice_numel in a new tensor alive for one gather."""
        padded = torch.zeros(self.storage.slice_numel, dtype=self.storage_dtype, device=self.device)
        padded[: real.numel()].copy_(real)
        if self.runtime.comm_stream is not None:  # packed there: not reused before it is done
            padded.record_stream(self.runtime.comm_stream)
        return padded

    def chunk_shape(self, c: int) -> tuple[int, ...]:
        """Shape of chunk c as the layers get it from the runtime: [rows, cols], or a quantized
        weight's blob (bytes,)."""
        if self.qlayout is not None:
            return (self.storage.chunk_numel_of(c),)
        return self.layout.chunk_shape(c)

    def _counted(self, rows):
        """`rows`, recording the non-finite values of every row it reads (`nonfinite_read`):
        the quantized image holds no value a finiteness check could read (its scales of a NaN
        block are NaN, its codes are not), so the rows are checked as they are quantized."""
        bad = self._bad_rows

        def counted(b, e):
            w = rows(b, e)
            if w.is_floating_point():
                per_row = (~torch.isfinite(w.reshape(e - b, -1))).sum(dim=1)
                for i in per_row.nonzero().flatten().tolist():
                    bad[b + i] = int(per_row[i])
            return w

        return counted

    @property
    def nonfinite_read(self) -> int:
        """Quantized only: the non-finite values in the rows this rank read to quantize (its
        shard, its share of the host store), or those of a weight its file holds quantized."""
        return sum(self._bad_rows.values()) + self._nonfinite_packed

    def nonfinite_parts(self) -> dict[tuple, int]:
        """Quantized only: `nonfinite_read` by what it was read from, so that counts of several
        ranks can be merged without counting twice a row two ranks both read: {("row", r): its
        non-finite values} for the rows quantized here, and {("packed", rank): n} for a weight
        its file holds quantized (each rank counts the scales of its own slices)."""
        out: dict[tuple, int] = {("row", r): n for r, n in self._bad_rows.items()}
        if self._nonfinite_packed:
            out[("packed", self.runtime.rank)] = self._nonfinite_packed
        return out

    def shard_of(self, rows) -> torch.Tensor:
        """This rank's shard of the weight whose rows [begin, end) `rows(begin, end)` returns,
        as stored (quantized when the policy says so), its real elements only (`own_numel`):
        only the rows the shard needs are read."""
        rt = self.runtime
        if self.qlayout is not None and isinstance(rows, PackedRows):
            # The file's codes and scales, as they are: the non-finite weights are those of its
            # blocks whose scale is not finite.
            shard = quantized_shard(self.qlayout, self.storage, rows, rt.rank, self.dtype, rt.device, padded=False)
            self._nonfinite_packed = rows.nonfinite
            return shard
        if self.qlayout is not None:
            return quantized_shard(self.qlayout, self.storage, self._counted(rows), rt.rank, self.dtype, rt.device,
                                   padded=False)
        return self.layout.shard_from_rows(
            lambda b, e: rows(b, e).to(device=rt.device, dtype=self.dtype), rt.rank, self.dtype, rt.device,
            padded=False)

    def shard_of_weight(self, weight: torch.Tensor) -> torch.Tensor:
        """This rank's shard of the whole weight `weight` (its value in any dtype), as stored."""
        if self.qlayout is not None:
            w = weight.detach()
            self._bad_rows = {}  # a new value: what was read of the old one no longer counts
            return self.shard_of(lambda b, e: w[b:e])
        return self.layout.shard(weight.detach().to(device=self.runtime.device, dtype=self.dtype), self.runtime.rank,
                                 padded=False)

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
        """Bytes of one stored element (1 for a quantized weight's image)."""
        return torch.empty((), dtype=self.storage_dtype).element_size()

    @property
    def nbytes(self) -> int:
        """Bytes of the whole weight as stored (the quantized size when quantized)."""
        return self.storage.numel * self.element_size

    @property
    def weight_format(self) -> str | None:
        return None if self.qlayout is None else self.qlayout.fmt

    @property
    def device(self) -> torch.device:
        return self.runtime.device

    @property
    def slice_bytes(self) -> int:
        """Bytes of this rank's slice of one chunk (what a peer sends for a missing chunk)."""
        return self.storage.slice_numel * self.element_size

    def chunk_bytes_of(self, c: int) -> int:
        """Real bytes of chunk c as stored (what a host copy moves)."""
        return self.storage.chunk_numel_of(c) * self.element_size

    def host_chunk(self, c: int) -> torch.Tensor:
        """Chunk c as a view of the host store, as stored: [rows, cols] of the weight's dtype,
        or a quantized weight's blob (1-D uint8): what a host copy moves into its page."""
        st = self.storage
        r0, _ = st.chunk_rows(c)
        offset = self.store_offset + r0 * st.cols * self.element_size
        return self.runtime.host_store.view(offset, self.storage_dtype, self.chunk_shape(c))

    def fill_host_share(self, store, local_rank: int, local_world: int) -> None:
        """Write local rank `local_rank` of `local_world`'s share of this weight into the node's
        host `store` (at `store_offset`), reading the rows through the reader kept since
        registration ([Note: filling the host store] in python_api/host/sources.py)."""
        rows = self.layout.rows
        r0, r1 = rows * local_rank // local_world, rows * (local_rank + 1) // local_world
        if self.qlayout is not None:
            dest = store.view(self.store_offset, torch.uint8, (self.nbytes,))
            fill_image_share(self.qlayout, self._counted(self._reader), r0, r1, dest, self.dtype, self.runtime.device)
            return
        if r0 == r1:
            return
        cols = self.layout.cols
        dst = store.view(self.store_offset + r0 * cols * self.element_size, self.dtype, (r1 - r0, cols))
        dst.copy_(self._reader(r0, r1).reshape(r1 - r0, cols).to(dtype=self.dtype))

    def write_host(self, full: torch.Tensor) -> None:
        """Write the whole weight `full` (its value, in this weight's dtype) into the host store,
        as stored (its quantized image when quantized)."""
        store = self.runtime.host_store
        if self.qlayout is not None:
            image = self.qlayout.quantize(full.reshape(self.layout.rows, self.layout.cols).to(self.runtime.device))
            store.view(self.store_offset, torch.uint8, (self.nbytes,)).copy_(image)
            return
        store.view(self.store_offset, self.dtype, (self.layout.rows, self.layout.cols)).copy_(
            full.reshape(self.layout.rows, self.layout.cols))

    def chunk_view(self, page: torch.Tensor, c: int) -> torch.Tensor:
        """Chunk c in `page`: [rows, cols] of the weight's dtype, or for a quantized weight its
        blob (1-D uint8)."""
        return PagePool.view(page, self.storage_dtype, self.chunk_shape(c))

    @property
    def page_bytes(self) -> int:
        """Bytes of the largest chunk of this weight as stored (what one pool page must hold)."""
        return self.storage.chunk_numel * self.element_size

    def signature(self) -> dict:
        """What must be equal on every rank for this weight (checked at wrap time)."""
        return {
            "name": self.name,
            "shape": self.shape,
            "dtype": str(self.dtype),
            "rows_per_chunk": self.layout.rows_per_chunk,
            "format": None if self.qlayout is None else
            f"{self.qlayout.fmt}/{self.qlayout.block_size}{'/nested' if self.qlayout.nested else ''}",
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
