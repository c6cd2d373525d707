"""The host tier of the elastic runtime: where each chunk comes from, the host store's layout,
and the copies host store -> pool page.

[Note: chunk sources]
A chunk missing from the pool is filled from one of two sources:
- peers: the chunked all-gather of every rank's device shard (python_api/distributed/collectives.py), on
  the communication stream; each rank receives (W - 1) x slice bytes per chunk;
- the host store: one whole copy per node of every frozen weight in shared host memory
  (elastic_kernels.HostStore, page-locked on CUDA machines; python_api/host/store.py maps it
  on every local rank), copied into the page on the runtime's copy stream; the chunk's real
  bytes as stored cross the host link: rows x cols x element size (no padding), or a quantized
  weight's blob of the chunk (exactly `QuantizedLayout.blob_bytes[c]`).
Which source serves chunk c of a weight with n chunks is a pure function of c and the policy's
effective host fraction f (`ElasticPolicy.source_fraction`): c is a *host chunk* iff
floor((c + 1) f) > floor(c f). That spreads the floor(n f) host chunks evenly over the weight,
so a run of misses keeps both sources in flight together, and it is the same on every rank
(every rank issues the same all-gathers: [Note: symmetric residency] in
python_api/runtime/_residency.py). With
`weights_on="host"` (f = 1) every chunk is a host chunk and no device shard exists at all:
device memory holds only the pool, which then streams a window of layers ahead of compute
(`prefetch_depth`). The pool caches a chunk the same way whatever its source.

Host store layout: the weights in registration order, each whole and as stored, each starting
at a multiple of PAGE_ALIGN (512) bytes: row-major (so chunk c, rows [r0, r1), is one contiguous
byte range), or for a quantized weight its image (its chunks' blobs concatenated, blob c at
byte c x full blob: [Note: quantized chunk blob] in elastic_kernels/quant/blob.py), the same
bytes its shards, its pool pages and its all-gathers hold. Local ranks fill it in parallel, then
meet at a barrier (python_api/host/store.py `node_host_store`).

[Note: filling the host store]
Local rank i of L owns rows [i R / L, (i + 1) R / L) of every weight of R rows and writes what
those rows determine (`ElasticTensor.fill_host_share`), reading only them (from the weight, or
from its file through the loader's reader):
- a full-precision weight: those rows, cast to the weight's dtype;
- a quantized weight ([Note: quantized frozen weights] in python_api/quant/__init__.py):
  quantized once, here, by the rank that reads them, and only they are
  (`elastic_kernels.api.quant.fill_image_share`): without nested scales the codes and scales of
  the blocks whose first weight is in its rows (blocks run over the flattened weight, so a block
  may run on into the next share's first row, which is then read too; each block belongs to one
  share, so the shares' bytes are disjoint); with nested scales
  a chunk's statistics need all its rows, so the rank owning a chunk's first row quantizes
  that whole chunk. The store never holds a full-precision copy, and each row of a node's
  store is read and quantized once, by one local rank (a rank with a device shard as well,
  host_fraction < 1, quantizes its shard's rows again for the shard, as without the host
  tier). The rows are quantized on the rank's device, by the same code as its
  shard (`quantized_shard`), then copied into the store, so a chunk's blob is the same bytes
  whichever source fills the page (a CPU and a GPU reduction may round the nested scales'
  mean differently: one device, one rounding).

[Note: host copies are stream ordered]
On CUDA the copies of one use run on the runtime's copy stream, which first waits for the
compute stream (the pages it writes may have been read by kernels just before being handed
out again), one `copy_(non_blocking=True)` per chunk from the page-locked store (a true async
DMA), each followed by its own event: chunk i's event is what the compute stream waits on
before computing on chunk i (`HostCopyWork.part(i).wait`), so `execute` starts on the first
host chunk while the later ones are still copying, as it does on gathered chunks (events of
one stream complete in order, so waiting for the whole work is waiting for its last event).
The host never blocks and no device sync is issued. On CPU the copy is done when the work is
created. A use that ends before its copies were waited for (an error while the use was
starting) has its fresh pages recorded on the copy stream before they are freed, so the pool
hands them out again only after the copies that write them have run ([Note: pages freed on
the error path] in python_api/runtime/_gathers.py).
"""

from __future__ import annotations

import torch
from torch.profiler import record_function

from ..config import PAGE_ALIGN


def host_chunks(num_chunks: int, fraction: float) -> list[bool]:
    """Which chunks of a weight come from the host store ([Note: chunk sources])."""
    if fraction >= 1.0:
        return [True] * num_chunks
    if fraction <= 0.0:
        return [False] * num_chunks
    return [int((c + 1) * fraction) > int(c * fraction) for c in range(num_chunks)]


def store_offsets(tensors) -> tuple[list[int], int]:
    """Byte offset of each weight in the host store, and the store's size."""
    offsets, size = [], 0
    for et in tensors:
        offsets.append(size)
        size += -(-et.nbytes // PAGE_ALIGN) * PAGE_ALIGN
    return offsets, max(size, PAGE_ALIGN)


class HostCopyWork:
    """The host -> page copies of the host chunks of one use ([Note: host copies are stream
    ordered]): `wait(what)` as GatherWork's, for every chunk; `part(i)` waits for pair i only."""

    def __init__(self, pairs: list[tuple[torch.Tensor, torch.Tensor]], copy_stream=None, device=None):
        self.device = device
        self.stream = copy_stream  # where the copies run (None: done synchronously, on CPU)
        self.events: list = []  # one per pair, recorded on the copy stream right after its copy
        self.error: RuntimeError | None = None
        self.done = False
        self.bytes = sum(src.numel() * src.element_size() for src, _ in pairs)
        with record_function("elastic::host_copy"):
            if copy_stream is not None:
                copy_stream.wait_stream(torch.cuda.current_stream(device))
                with torch.cuda.stream(copy_stream):
                    for src, dst in pairs:
                        dst.copy_(src, non_blocking=True)
                        event = torch.cuda.Event()
                        event.record(copy_stream)
                        self.events.append(event)
            else:
                for src, dst in pairs:
                    dst.copy_(src)
                self.done = True
        self.parts = [_HostChunkCopy(self, i) for i in range(len(pairs))]

    @property
    def failed(self) -> bool:
        return self.error is not None

    def part(self, i: int) -> _HostChunkCopy:
        """The copy of pair i alone."""
        return self.parts[i]

    def _wait_event(self, i: int) -> None:
        with record_function("elastic::host_copy_wait"):
            torch.cuda.current_stream(self.device).wait_event(self.events[i])

    def wait(self, what: str) -> None:
        if self.error is not None:
            raise self.error
        if self.done:
            return
        if self.events:
            self._wait_event(len(self.events) - 1)  # the last of one stream's events: all of them
        self.done = True
        for p in self.parts:
            p.done = True


class _HostChunkCopy:
    """One chunk's copy of a `HostCopyWork`: what a use waits on before computing on it."""

    __slots__ = ("work", "index", "done")

    def __init__(self, work: HostCopyWork, index: int):
        self.work, self.index, self.done = work, index, work.done

    @property
    def failed(self) -> bool:
        return self.work.failed

    @property
    def stream(self):
        return self.work.stream

    def wait(self, what: str) -> None:
        if self.work.error is not None:
            raise self.work.error
        if self.done:
            return
        self.work._wait_event(self.index)
        self.done = True
