"""Chunked all-gathers of frozen-weight shards into pool pages.

One `GatherWork` is one collective: the slices of several chunk runs (of one or several
weights) packed into one send buffer with `elastic::pack_shards`, all-gathered rank-major,
and copied out into pool pages with `elastic::unpack_gathered`.

[Note: where a gather runs and how its end is awaited]
- gloo (CPU): the collective is issued with async_op=True; gloo's worker thread moves the
  bytes while the main thread computes on chunks that are already resident. `wait()` blocks
  on the work handle (with the policy's timeout) and then unpacks on the main thread.
- NCCL (GPU): everything (pack, collective, unpack) is issued on the runtime's communication
  stream, which first waits for the compute stream (so the shard and the pages are ready);
  an event recorded after the unpack is what the compute stream waits on in `wait()`: the host
  never blocks. The pages are then `record_stream`-ed on the compute stream so the pool hands
  them out again only after the kernels that read them are done.
"""

from __future__ import annotations

import datetime
from typing import NamedTuple

import torch
import torch.distributed as dist
from torch.profiler import record_function

from elastic_kernels import pack_shards, unpack_gathered


# torch 2.14 deprecates all_gather_into_tensor in favour of all_gather_single; torch 2.11 (the
# GPU machine) has only the former. Looked up at call time so tests can wrap it.
ALL_GATHER_NAME = "all_gather_single" if hasattr(dist, "all_gather_single") else "all_gather_into_tensor"


def all_gather_into(output: torch.Tensor, send: torch.Tensor, group, async_op: bool):
    return getattr(dist, ALL_GATHER_NAME)(output, send, group=group, async_op=async_op)


class ChunkRun(NamedTuple):
    """Chunks [begin, end) of one elastic tensor, landing in `pages` (chunk-shaped views)."""

    tensor: object  # python_api.runtime.ElasticTensor
    begin: int
    end: int
    pages: list


class GatherWork:
    """One all-gather in flight. `wait()` makes its pages hold the gathered chunks."""

    def __init__(self, runs: list[ChunkRun], group, world_size: int, comm_stream=None, timeout_s=None):
        self.runs = runs
        self.world_size = world_size
        self.timeout_s = timeout_s
        self.done = False
        shards = [r.tensor.shard for r in runs]
        slices = [r.tensor.layout.slice_numel for r in runs]
        self._slices = slices
        self._counts = [r.end - r.begin for r in runs]
        self.send_bytes = sum(c * s for c, s in zip(self._counts, slices)) * shards[0].element_size()
        self.event = None
        self.work = None
        with record_function("elastic::gather"):
            if comm_stream is not None:
                compute = torch.cuda.current_stream()
                comm_stream.wait_stream(compute)
                with torch.cuda.stream(comm_stream):
                    send = pack_shards(shards, slices, [r.begin for r in runs], [r.end for r in runs])
                    self.output = send.new_empty(world_size * send.numel())
                    all_gather_into(self.output, send, group, async_op=False)
                    self._unpack()
                    self.event = torch.cuda.Event()
                    self.event.record(comm_stream)
            else:
                send = pack_shards(shards, slices, [r.begin for r in runs], [r.end for r in runs])
                self.output = send.new_empty(world_size * send.numel())
                self.work = all_gather_into(self.output, send, group, async_op=True)

    @property
    def received_bytes(self) -> int:
        """Bytes this rank receives from its peers in this collective."""
        return (self.world_size - 1) * self.send_bytes

    def _unpack(self) -> None:
        dests = [p for r in self.runs for p in r.pages]
        unpack_gathered(self.output, self.world_size, self._slices, self._counts, dests)

    def wait(self, what: str) -> None:
        if self.done:
            return
        with record_function("elastic::gather_wait"):
            if self.event is not None:
                torch.cuda.current_stream().wait_event(self.event)
            else:
                try:
                    if self.timeout_s is None:
                        self.work.wait()
                    else:
                        self.work.wait(datetime.timedelta(seconds=self.timeout_s))
                except Exception as exc:  # noqa: BLE001 - re-raised with context
                    raise RuntimeError(
                        f"elastic: the all-gather of {what} failed or timed out "
                        f"(timeout {self.timeout_s} s); a peer rank probably failed: {exc}"
                    ) from exc
                self._unpack()
        self.output = None  # the pages hold the data now
        self.done = True
