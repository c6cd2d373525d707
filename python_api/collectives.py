"""Chunked all-gathers of frozen-weight shards into pool pages.

One `GatherWork` is one collective: the slices of several chunk runs (of one or several
weights) packed into one send buffer with `elastic::pack_shards`, all-gathered rank-major,
and copied out into pool pages with `elastic::unpack_gathered`.

[Note: where a gather runs and how its end is awaited]
- gloo (CPU): the collective is issued with async_op=True; gloo's worker thread moves the
  bytes while the main thread computes on chunks that are already resident. `wait()` blocks
  on the work handle (with the policy's timeout), checks the headers ([Note: collective
  headers]) and then unpacks on the main thread.
- NCCL (GPU): everything (pack, collective, unpack) is issued on the runtime's communication
  stream, which first waits for the runtime device's compute stream (so the shard and the
  pages are ready); an event recorded after the unpack is what the compute stream waits on in
  `wait()`: the host never blocks. The receive buffer is dropped as soon as the unpack is
  enqueued: it was allocated on the communication stream, so the caching allocator reuses it
  only after that stream's unpack (stream order), and it never outlives the gather as memory
  outside the pool's budget. The pages are `record_stream`-ed on the compute stream by the
  runtime so the pool hands them out again only after the kernels that read them are done.
  `collective_timeout_s` does not apply on this path (the host never waits on the
  collective): a hang on NCCL is bounded by the process group's own timeout
  (`init_process_group(timeout=...)`, enforced by NCCL's watchdog, which aborts the
  communicator and the process).

[Note: a failed gather fails once]
A collective that failed or timed out stores its error: every later `wait()` on it (one per
chunk of the use, the `finally` of `ElasticRuntime.use`, prefetch release) re-raises the same
error at once instead of waiting the full timeout again, so a rank whose peer died ends after
one `collective_timeout_s`. Pages of a failed gather never received data; the runtime frees
them (`GatherWork.failed`), so a caller that catches the error and retries gathers again.

[Note: collective headers]
On the host-waited (gloo) path every send buffer carries a 16-byte header after its payload,
packed as one more "run": (magic, sequence number of the collective on this runtime, crc32 of
the runs it carries (weight ids and chunk ranges), payload elements). On arrival every rank
compares all ranks' headers before unpacking: ranks that issue the same number of bytes but
not the same gathers (one rank evaluating alone, a budget changed on one rank, `generate()`
stopping at different lengths) fail at once, on every rank, with a message that names the
rule, instead of computing on another layer's weights. Ranks whose gathers differ in *size*
are stopped by the backend before any header can be read: gloo aborts the process with
"Received data size doesn't match expected size ... collective mismatch", and the surviving
ranks fail within `collective_timeout_s`. The header costs 16 bytes per rank per collective;
the traffic stats count payload bytes only.
"""

from __future__ import annotations

import datetime
import zlib
from typing import NamedTuple

import torch
import torch.distributed as dist
from torch.profiler import record_function

from elastic_kernels import pack_shards, unpack_gathered


# torch 2.14 deprecates all_gather_into_tensor in favour of all_gather_single; torch 2.11 (the
# GPU machine) has only the former. Looked up at call time so tests can wrap it.
ALL_GATHER_NAME = "all_gather_single" if hasattr(dist, "all_gather_single") else "all_gather_into_tensor"

_HEADER_BYTES = 16
_HEADER_MAGIC = 0x454C4153  # "ELAS"

SYMMETRY_RULE = (
    "every rank must run the same forward and backward passes through the elastic layers, in "
    "the same order (no evaluation or generation on some ranks only, the same number of "
    "micro-batches everywhere), and change the pool budget at the same point on every rank"
)


def all_gather_into(output: torch.Tensor, send: torch.Tensor, group, async_op: bool):
    return getattr(dist, ALL_GATHER_NAME)(output, send, group=group, async_op=async_op)


class ChunkRun(NamedTuple):
    """Chunks [begin, end) of one elastic tensor, landing in `pages` (chunk-shaped views)."""

    tensor: object  # python_api.runtime.ElasticTensor
    begin: int
    end: int
    pages: list


def _runs_digest(runs: list[ChunkRun]) -> int:
    text = ";".join(f"{r.tensor.wid}:{r.begin}-{r.end}" for r in runs)
    return zlib.crc32(text.encode()) & 0x7FFFFFFF


def _describe(runs: list[ChunkRun]) -> str:
    return ", ".join(f"{r.tensor.name} chunks {r.begin}..{r.end - 1}" for r in runs)


class GatherWork:
    """One all-gather in flight. `wait()` makes its pages hold the gathered chunks."""

    def __init__(self, runs: list[ChunkRun], group, world_size: int, comm_stream=None, timeout_s=None,
                 seq: int = 0, device: torch.device | None = None):
        self.runs = runs
        self.world_size = world_size
        self.timeout_s = timeout_s
        self.done = False
        self.error: RuntimeError | None = None
        shards = [r.tensor.shard for r in runs]
        slices = [r.tensor.layout.slice_numel for r in runs]
        self._slices = slices
        self._counts = [r.end - r.begin for r in runs]
        self.payload_numel = sum(c * s for c, s in zip(self._counts, slices))
        self.send_bytes = self.payload_numel * shards[0].element_size()
        self.seq = seq
        self.device = device
        self.event = None
        self.work = None
        self._header = None
        with record_function("elastic::gather"):
            if comm_stream is not None:
                compute = torch.cuda.current_stream(device)
                comm_stream.wait_stream(compute)
                with torch.cuda.stream(comm_stream):
                    send = pack_shards(shards, slices, [r.begin for r in runs], [r.end for r in runs])
                    self.output = send.new_empty(world_size * send.numel())
                    all_gather_into(self.output, send, group, async_op=False)
                    self._unpack()
                    self.event = torch.cuda.Event()
                    self.event.record(comm_stream)
                # See [Note: where a gather runs ...]: stream-ordered, safe to drop now.
                self.output = None
            else:
                dtype = shards[0].dtype
                h = _HEADER_BYTES // shards[0].element_size()
                words = torch.tensor(
                    [_HEADER_MAGIC, seq & 0x7FFFFFFF, _runs_digest(runs), self.payload_numel & 0x7FFFFFFF],
                    dtype=torch.int32, device=shards[0].device,
                )
                header = words.view(torch.uint8).view(dtype)
                send = pack_shards(
                    shards + [header], slices + [h],
                    [r.begin for r in runs] + [0], [r.end for r in runs] + [1],
                )  # fmt: skip
                self._header = (h, words)
                self.output = send.new_empty(world_size * send.numel())
                self.work = all_gather_into(self.output, send, group, async_op=True)

    @property
    def received_bytes(self) -> int:
        """Payload bytes this rank receives from its peers in this collective."""
        return (self.world_size - 1) * self.send_bytes

    @property
    def failed(self) -> bool:
        return self.error is not None

    def _unpack(self) -> None:
        dests = [p for r in self.runs for p in r.pages]
        if self._header is None:
            unpack_gathered(self.output, self.world_size, self._slices, self._counts, dests)
            return
        h, _ = self._header
        scratch = self.output.new_empty(self.world_size * h)
        unpack_gathered(self.output, self.world_size, self._slices + [h], self._counts + [1], dests + [scratch])

    def _check_headers(self) -> None:
        h, mine = self._header
        per_rank = self.output.view(self.world_size, -1)[:, -h:].contiguous()
        theirs = per_rank.view(torch.uint8).view(torch.int32).view(self.world_size, 4)
        bad = [r for r in range(self.world_size) if not torch.equal(theirs[r], mine)]
        if bad:
            r = bad[0]
            other = theirs[r].tolist()
            what = "no elastic all-gather header" if other[0] != _HEADER_MAGIC else (
                f"collective #{other[1]} (runs digest {other[2]:#x})"
            )
            raise RuntimeError(
                f"elastic: ranks diverged: this rank's all-gather #{int(mine[1])} carries "
                f"{_describe(self.runs)} (runs digest {int(mine[2]):#x}), rank(s) {bad} sent {what}. "
                f"Rule: {SYMMETRY_RULE}."
            )

    def wait(self, what: str) -> None:
        if self.error is not None:
            raise self.error
        if self.done:
            return
        with record_function("elastic::gather_wait"):
            if self.event is not None:
                torch.cuda.current_stream(self.device).wait_event(self.event)
            else:
                try:
                    if self.timeout_s is None:
                        self.work.wait()
                    else:
                        self.work.wait(datetime.timedelta(seconds=self.timeout_s))
                except Exception as exc:  # noqa: BLE001 - re-raised with context, once
                    self.error = RuntimeError(
                        f"elastic: the all-gather of {what} failed or timed out "
                        f"(timeout {self.timeout_s} s); a peer rank probably failed: {exc}"
                    )
                    self.error.__cause__ = exc
                    self.output = None
                    raise self.error from exc
                try:
                    self._check_headers()
                except RuntimeError as exc:
                    self.error = exc
                    self.output = None
                    raise
                self._unpack()
        self.output = None  # the pages hold the data now
        self.done = True
