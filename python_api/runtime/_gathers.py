"""Uses and gathers: pinning a weight's resident chunks for one use, filling the missing ones
(all-gathers from peers, copies from the host store), waiting for them chunk by chunk, and
releasing them per residency (ElasticRuntime's gathers, a mixin of runtime.py).

[Note: pages freed on the error path]
A page that a use allocated to be filled (a gather on the communication stream, a host copy
on the copy stream) is freed without data when the use ends before the compute stream waited
for its fill: `_start_uses` failed part-way (a later gather could not be issued, the pool was
exhausted, a header mismatch) and ends every use it started with `failed=True`, or a gather
failed. Recording only the compute stream on such a page is not enough on CUDA: nothing on
the compute stream is ordered after the fill, so the pool could hand the page to the next
gather on the communication stream while the late H2D copy still runs on the copy stream,
and that copy would overwrite the peer chunk: a retried step would compute on corrupted
weights. So a page freed without data is recorded on every side stream that could still be
writing it (communication and copy) besides the compute stream: the pool reuses it only
after the work queued on them by then has completed ([Note: stream-ordered reuse] in
csrc/pool/page_pool.cpp). Pages whose fill was waited for are ordered through the compute
stream, which waited on the fill's event, and need nothing more.
"""

from __future__ import annotations

import torch
from torch.profiler import record_function

from elastic_kernels import dequantize, unpack_gathered

from ..distributed.collectives import ChunkRun, GatherWork, all_gather_into
from ..host.sources import HostCopyWork
from .tensor import ElasticTensor, Residency


class _Use:
    """Chunks of one tensor pinned for one use (a forward or backward of its layer)."""

    __slots__ = ("tensor", "chunks", "works", "keys_pinned", "fresh", "ended", "run")

    def __init__(self, tensor: ElasticTensor):
        self.tensor = tensor
        self.run = tensor.run  # held as a run ([Note: resident runs]): its chunks are views of it
        self.chunks: list[torch.Tensor | None] = [None] * tensor.num_chunks
        self.works: list[GatherWork | None] = [None] * tensor.num_chunks
        self.keys_pinned: list[int] = []
        self.fresh: set[int] = set()  # keys whose pages this use allocated for a gather
        self.ended = False


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
        run = self._use.run
        if run is not None and run.filled:
            for c, chunk in enumerate(run.chunks):
                fn(c, chunk)
            return
        for c in range(self._use.tensor.num_chunks):
            fn(c, self._wait(c))

    def chunks(self) -> list[torch.Tensor]:
        """Every chunk, after all gathers of this use completed."""
        run = self._use.run
        if run is not None and run.filled:
            return list(run.chunks)
        return [self._wait(c) for c in range(self._use.tensor.num_chunks)]

    def whole(self) -> torch.Tensor | None:
        """The weight as one tensor ([rows, cols], after this use's gathers completed) when it
        is held as a run ([Note: resident runs]), else None: then it exists only as chunks."""
        run = self._use.run
        if run is None:
            return None
        if not run.filled:
            for c in range(self._use.tensor.num_chunks):
                self._wait(c)
        return run.whole

    def table(self) -> list[torch.Tensor]:
        """The page table a paged op takes: [the whole weight] for a run (one GEMM), else
        every chunk (`chunks()`)."""
        whole = self.whole()
        return [whole] if whole is not None else self.chunks()


class _Gathers:
    """full_weight, and the start, fill and end of uses."""

    def full_weight(self, et: ElasticTensor) -> torch.Tensor:
        """The whole weight as one new tensor (for export and merging; a collective: call it
        on every rank). Bypasses the pool; counted in the all-gather stats. A quantized weight
        is gathered quantized and returned dequantized, in its dtype."""
        self.check_open("full_weight")
        st = et.storage
        if et.qlayout is None:
            out = torch.empty(et.shape, dtype=et.dtype, device=self.device)
        else:
            out = torch.empty(st.numel, dtype=torch.uint8, device=self.device)  # the image
        cols = st.cols
        flat = out.view(-1)
        dests = []
        for c in range(et.num_chunks):
            r0, r1 = st.chunk_rows(c)
            dests.append(flat[r0 * cols : r1 * cols].view(et.chunk_shape(c)))
        if self._local_only():
            for d, src in zip(dests, et._local_chunks):
                d.copy_(src)
        elif et.run is not None and et.run.filled:  # every rank holds it whole: nothing to gather
            out.copy_(et.run.whole)
        elif not et.on_device:  # weights_on="host": the store holds the whole weight
            for c, d in enumerate(dests):
                d.copy_(et.host_chunk(c))
        else:
            shard = et.padded_shard()  # a run's own elements, copied and padded
            gathered = shard.new_empty(self.world_size * shard.numel())
            with record_function("elastic::gather_full"):
                all_gather_into(gathered, shard, self.group, async_op=False)
            unpack_gathered(gathered, self.world_size, [st.slice_numel], [et.num_chunks], dests)
            self._stats["allgather_calls"] += 1
            self._stats["allgather_bytes"] += (self.world_size - 1) * shard.numel() * shard.element_size()
        if et.qlayout is None:
            return out
        return dequantize(dests, et.qlayout.formats[0], et.shape[0], dtype=et.dtype)

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
                if use.run is not None:  # [Note: resident runs]
                    if use.run.filled:
                        use.works = ()  # nothing to wait for: O(1) on a hit
                        self._stats["pool_hits"] += et.num_chunks
                        continue
                    use.chunks = list(use.run.chunks)
                    self._stats["pool_misses"] += et.num_chunks
                    pending.extend(self._runs(use, list(range(et.num_chunks))))
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
        for i, c in enumerate(chunks):
            use.works[c] = work.part(i)  # chunk c waits for its own copy only
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
            if batches and (cap is None or size + b <= cap) and use.tensor.storage_dtype == batches[-1][0][0].tensor.storage_dtype:
                batches[-1].append((use, run))
                size += b
            else:
                batches.append([(use, run)])
                size = b
        for batch in batches:
            chunk_runs = []
            for use, run in batch:
                et = use.tensor
                if use.run is not None:  # the gather lands in the run ([Note: resident runs])
                    chunk_runs.append(ChunkRun(et, run[0], run[-1] + 1, use.run.chunks[run[0] : run[-1] + 1]))
                    if self.comm_stream is not None:  # unpacked there: not reused before it is done
                        use.run.buffer.record_stream(self.comm_stream)
                    continue
                pages = []
                for c in run:
                    page = self.pool.allocate_pinned(et.keys[c])
                    use.keys_pinned.append(et.keys[c])
                    use.fresh.add(et.keys[c])
                    pages.append(et.chunk_view(page, c))
                chunk_runs.append(ChunkRun(et, run[0], run[-1] + 1, pages))
            work = GatherWork(
                chunk_runs, self.group, self.world_size, self.comm_stream, self.policy.collective_timeout_s,
                seq=self._seq, device=self.device, channel=self._header_channel(), buffers=self._gather_buffers,
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

    def _header_channel(self):
        """[Note: headers off the prefetch path] in python_api/distributed/collectives.py: the
        channel of the host-waited path, set up at registration (None: headers on the group)."""
        return self._channel

    def _end_use(self, use: _Use, keep: Residency, failed: bool = False) -> None:
        """Unpin the use's chunks; discard those whose residency is below `keep`, and those
        whose gather failed or never completed (their pages hold no data)."""
        if use.ended:
            return
        use.ended = True
        for work in {id(w): w for w in use.works if hasattr(w, "cancel") and not w.done}.values():
            work.cancel()  # never waited (an error while starting uses): its data is never issued
        if use.run is not None:
            # A run holds no pages: it is filled once every gather of its chunks arrived.
            if not failed and use.works and all(w is not None and w.done and not w.failed for w in use.works):
                use.run.filled = True
            return
        if not use.keys_pinned:
            return
        et = use.tensor
        wid_shift = self._KEY_BITS
        no_data = set()
        for key in use.keys_pinned:
            work = use.works[key - (et.wid << wid_shift)]
            if key in use.fresh and (failed or work is None or work.failed or not work.done):
                no_data.add(key)
        if self.comm_stream is not None:
            for key, stream in self._page_streams(use, no_data, torch.cuda.current_stream(self.device)):
                self.pool.record_stream(key, stream)
        self.pool.unpin_many(use.keys_pinned)
        for key in use.keys_pinned:
            c = key - (et.wid << wid_shift)
            if (et.residency[c] < keep or key in no_data) and self.pool.pin_count(key) == 0 and self.pool.contains(key):
                self.pool.free(key)
        use.keys_pinned = []

    def _page_streams(self, use: _Use, no_data: set[int], compute) -> list[tuple[int, object]]:
        """(key, stream) pairs to record on the use's pages before they are unpinned, on CUDA
        ([Note: pages freed on the error path])."""
        side = [s for s in (self.comm_stream, self.copy_stream) if s is not None]
        out = []
        for key in use.keys_pinned:
            out.append((key, compute))
            if key in no_data:
                out.extend((key, s) for s in side)
        return out
