"""The host tier of the elastic runtime: where each chunk comes from, the host store's layout,
and the copies host store -> pool page.

[Note: chunk sources]
A chunk missing from the pool is filled from one of two sources:
- peers: the chunked all-gather of every rank's device shard (python_api/distributed/collectives.py), on
  the communication stream; each rank receives (W - 1) x slice bytes per chunk;
- the host store: one whole copy per node of every frozen weight in shared host memory
  (elastic_kernels.HostStore, page-locked on CUDA machines; python_api/host/store.py maps it
  on every local rank), copied into the page on the runtime's copy stream; the chunk's real
  bytes (rows x cols x element size, no padding) cross the host link.
Which source serves chunk c of a weight with n chunks is a pure function of c and the policy's
effective host fraction f (`ElasticPolicy.source_fraction`): c is a *host chunk* iff
floor((c + 1) f) > floor(c f). That spreads the floor(n f) host chunks evenly over the weight,
so a run of misses keeps both sources in flight together, and it is the same on every rank
(every rank issues the same all-gathers: [Note: symmetric residency] in
python_api/runtime/_residency.py). With
`weights_on="host"` (f = 1) every chunk is a host chunk and no device shard exists at all:
device memory holds only the pool, which then streams a window of layers ahead of compute
(`prefetch_depth`). The pool caches a chunk the same way whatever its source.

Host store layout: the weights in registration order, each whole and row-major (so chunk c,
rows [r0, r1), is one contiguous byte range), each starting at a multiple of PAGE_ALIGN (512) bytes.
Local ranks fill it in parallel, each a contiguous share of every weight's rows, then meet
at a barrier (python_api/host/store.py `node_host_store`).

[Note: host copies are stream ordered]
On CUDA the copies of one use run on the runtime's copy stream, which first waits for the
compute stream (the pages it writes may have been read by kernels just before being handed
out again), one `copy_(non_blocking=True)` per chunk from the page-locked store (a true async
DMA); an event recorded after them is what the compute stream waits on in `wait()`. The host
never blocks and no device sync is issued. On CPU the copy is done when the work is created.
"""

from __future__ import annotations

import torch
from torch.profiler import record_function

from python_api.config import PAGE_ALIGN


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
    """The host -> page copies of the host chunks of one use; `wait(what)` as GatherWork's."""

    def __init__(self, pairs: list[tuple[torch.Tensor, torch.Tensor]], copy_stream=None, device=None):
        self.device = device
        self.event = None
        self.error: RuntimeError | None = None
        self.done = False
        self.bytes = sum(src.numel() * src.element_size() for src, _ in pairs)
        with record_function("elastic::host_copy"):
            if copy_stream is not None:
                copy_stream.wait_stream(torch.cuda.current_stream(device))
                with torch.cuda.stream(copy_stream):
                    for src, dst in pairs:
                        dst.copy_(src, non_blocking=True)
                    self.event = torch.cuda.Event()
                    self.event.record(copy_stream)
            else:
                for src, dst in pairs:
                    dst.copy_(src)
                self.done = True

    @property
    def failed(self) -> bool:
        return self.error is not None

    def wait(self, what: str) -> None:
        if self.error is not None:
            raise self.error
        if self.done:
            return
        with record_function("elastic::host_copy_wait"):
            torch.cuda.current_stream(self.device).wait_event(self.event)
        self.done = True
