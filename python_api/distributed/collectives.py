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

[Note: nothing outlives its step]
No collective work handle (and so none of its tensors, nor the process group it belongs to)
is kept past the use that consumed it: `wait()` drops the work and its buffers once the
pages hold the data (the buffers go to the runtime's `GatherBuffers` until the phase's last
use ends: [Note: receive buffers are reused]), and also when the gather failed; the header
exchange's work is a local that an exception's traceback does not keep (it is cleared before
raising); the
runtime's prefetched uses are consumed or released by the end of their phase. A gloo work
still referenced when the interpreter shuts down is destroyed without the Python runtime that
its tensors need, and gloo's threads then abort the process at exit ("terminate called
without an active exception", pytorch#190489), even after `destroy_process_group`
(tests/runtime/test_clean_exit.py runs a user's 2-rank script twice per variant and expects exit code 0).

[Note: receive buffers are reused]
On the host-waited (gloo) path a gather's receive buffer (world_size x its send buffer, 13.5
MiB for a decoder layer of SmolLM2-135M) and its packed send buffer were new tensors each
time. With glibc's mmap threshold fixed (as the benchmarks fix it: [Note: a fixed mmap
threshold] in python_api/finetune/measure.py) every such allocation is a fresh mapping that the kernel
zero-fills page by page as it is written, and is unmapped when freed. So the runtime keeps
the receive and send buffers of completed gathers (`GatherBuffers`, one per runtime, CPU
only: on CUDA the caching allocator already reuses memory in stream order) and hands them to
the next gather of the same size (a decoder layer's gather is the same size at every layer),
at most two per size; the send buffer is packed into its kept buffer (`pack_shards(...,
out=)`). Memory: while a use computes, its own gather's buffer is now kept beside the
next use's in flight (before, only the latter was alive), at most two per size beyond the
gathers in flight; the planner's memory model already counts both ([Note: what the memory
model counts], `window_buffers` in python_api/planner/memory.py). None of it may reach the
peak: the runtime drops every kept buffer at the end of the last use of a phase's learned
order (the end of forward comes right before the loss, where activations peak) and when a
phase ends or the runtime closes. A buffer is kept only after its gather completed and was
unpacked (a failed gather's buffers are dropped with it), so no collective can still write
it, and it holds no work handle ([Note: nothing outlives its step]). Measured on SmolLM2-135M at 2 and
4 gloo ranks, budget 0, interleaved with FSDP2, receive buffers kept: 1.21x against 1.13x with
new buffers, the same tensor peak; send buffers kept too: NOTES.md
(bench/results/2026-12-04_buffers.md).

[Note: collective headers]
On the host-waited (gloo) path every gather is preceded by a header exchange: each rank
all-gathers 4 int64 (magic, sequence number of the collective on this runtime, crc32 of the
runs it carries (weight ids and chunk ranges), payload elements), waits for it (bounded by
`collective_timeout_s`) and compares all ranks' headers before the data collective is issued.
Ranks that diverge (one rank evaluating alone, `generate()` stopping at different lengths, a
budget changed on one rank) then fail at once, on every rank, with a message that names the
rule, whatever the sizes of their gathers: a data all-gather whose sizes differ across ranks
is what gloo cannot survive (its worker thread aborts the process, "Received data size doesn't
match expected size"). The header is a fixed 32 bytes per rank, so the exchange itself cannot
mismatch in size against another gather's header; it can against a *different* collective on
the peer (an all-reduce of gradients), which the rule forbids too. Cost: one small collective
round trip per data collective, on the host; measured in NOTES.md (make demo). It uses
`dist.all_gather` (not the all-gather the data uses), and the traffic stats count payload
bytes only. On NCCL no header is exchanged (the host never waits there: the check would cost
a device sync per gather).

[Note: headers off the prefetch path]
Exchanged and waited for right before the data collective, on the runtime's group, a header
queued behind the prefetch all-gather in flight: at budget 0 on the real model it cost 6.9
ms against 0.47 ms alone, 21% of rank 0's step (issue 27). So on gloo, for a runtime on the
default group, headers and data go on two private groups of the same ranks (a
`HeaderChannel`, one per default group, created once by the first runtime's registration,
on every rank): a gather issues its header exchange asynchronously and returns; its data
all-gather is issued only once its header has been compared, either as soon as the header
has arrived (checked without blocking when the next gather is issued or a gather is waited
on) or, at the latest, when the gather is waited on. The guarantee stays: no data
collective is issued before every rank's header for it was compared equal, and a mismatch
fails every rank (each compares the same set of headers) with the rule quoted. Why private
groups: data collectives are issued at moments that depend on timing (when a header
arrived), so nothing else may share their group; every gather of the process goes through
the one channel in the order its headers were issued (the program's order, the same on
every rank), so the data group sees the same sequence on every rank, and the header group
carries fixed-size headers only, never behind a data transfer. Collectives the runtime
issues at fixed points (adapter gradient buckets, full_weight, agreements) stay on the
runtime's group. A runtime on a subgroup (a pipeline's stage or data-parallel group) keeps
the blocking exchange on its group: creating groups there would need every rank of the
world to take part, at a point they do not all reach.

Off by default, on only with ELASTIC_HEADER_CHANNEL=1 (read when a runtime registers): on
this 2-core VM the channel made the planner's memory test flaky and once hung it. Measured
2026-12-03 (`tests/planner/test_memory_model.py -k fitting_points`, 3 rounds of 2 concurrent
runs, commit 3136c38): with the channel 3 of 6 runs failed (two measured peaks 10.5-10.6%
below the model's bound, the gathers of a prefetch window no longer all in flight at once; one
"Operation timed out" in a data all-gather), and the whole suite at 42339ab hung 300 s in the
same test; with blocking headers 6 of 6 passed. Its speed gain was not distinguishable from
noise (budget 0 0.947x, budget all 1.067x its blocking twin, bench/results/2026-12-03_frontier.md),
and on NCCL there are no headers. The timeout is not explained yet: until it is, the blocking
exchange is the default.
"""

from __future__ import annotations

import datetime
import os
import zlib
from typing import NamedTuple

import torch
import torch.distributed as dist
from torch.profiler import record_function

from elastic_kernels import pack_shards, unpack_gathered

# torch 2.14 deprecates all_gather_into_tensor in favour of all_gather_single; torch 2.11 (the
# GPU machine) has only the former. Looked up at call time so tests can wrap it.
ALL_GATHER_NAME = "all_gather_single" if hasattr(dist, "all_gather_single") else "all_gather_into_tensor"

_HEADER_MAGIC = 0x454C4153  # "ELAS"
HEADER_CHANNEL_ENV = "ELASTIC_HEADER_CHANNEL"  # "1": [Note: headers off the prefetch path]

SYMMETRY_RULE = (
    "every rank must run the same forward and backward passes through the elastic layers, in "
    "the same order (no evaluation or generation on some ranks only, the same number of "
    "micro-batches everywhere), and change the pool budget at the same point on every rank"
)


def all_gather_into(output: torch.Tensor, send: torch.Tensor, group, async_op: bool):
    return getattr(dist, ALL_GATHER_NAME)(output, send, group=group, async_op=async_op)


class ChunkRun(NamedTuple):
    """Chunks [begin, end) of one elastic tensor, landing in `pages` (chunk-shaped views)."""

    tensor: object  # elastic_kernels.api.runtime.ElasticTensor
    begin: int
    end: int
    pages: list


def _runs_digest(runs: list[ChunkRun]) -> int:
    text = ";".join(f"{r.tensor.wid}:{r.begin}-{r.end}" for r in runs)
    return zlib.crc32(text.encode()) & 0x7FFFFFFF


class HeaderChannel:
    """The private header and data groups of one default group, and the gathers whose header
    is exchanged but whose data collective is not issued yet, in issue order ([Note: headers
    off the prefetch path])."""

    def __init__(self, parent):
        ranks = dist.get_process_group_ranks(parent)
        self.parent = parent
        self.header_group = dist.new_group(ranks, backend="gloo")
        self.data_group = dist.new_group(ranks, backend="gloo")
        self.pending: list[GatherWork] = []

    def alive(self) -> bool:
        pg_map = dist.distributed_c10d._world.pg_map
        return self.header_group in pg_map and self.data_group in pg_map

    def advance(self, until: GatherWork | None = None) -> None:
        """Issue the data collectives of pending gathers, in order, whose header has arrived;
        with `until`, block on headers (bounded by each gather's timeout) until that one is
        issued. A header mismatch or failure is stored in its gather (raised where it is
        waited on) and the next ones are still checked."""
        while self.pending:
            work = self.pending[0]
            if until is None and not work.header_arrived():
                return
            self.pending.pop(0)
            work._check_and_issue()
            if work is until:
                return

    def cancel(self, work: GatherWork) -> None:
        if work in self.pending:
            self.pending.remove(work)


class GatherBuffers:
    """Send and receive buffers of the host-waited (gloo) gathers kept for the next gather of
    the same size ([Note: receive buffers are reused]): at most `per_size` free buffers of each
    (elements, dtype), all dropped by `clear()`."""

    def __init__(self, per_size: int = 2):
        self.per_size = per_size
        self._free: dict[tuple[int, torch.dtype], list[torch.Tensor]] = {}
        self.reused = 0  # buffers handed out again (tests, NOTES.md)

    def take(self, like: torch.Tensor, numel: int) -> torch.Tensor:
        free = self._free.get((numel, like.dtype))
        if free:
            self.reused += 1
            return free.pop()
        return like.new_empty(numel)

    def give(self, buf: torch.Tensor) -> None:
        free = self._free.setdefault((buf.numel(), buf.dtype), [])
        if len(free) < self.per_size:
            free.append(buf)

    def held_bytes(self) -> int:
        return sum(b.numel() * b.element_size() for free in self._free.values() for b in free)

    def clear(self) -> None:
        self._free = {}


_CHANNELS: dict[int, HeaderChannel] = {}


def header_channel(group) -> HeaderChannel | None:
    """The channel of `group` on gloo when it is the default group and ELASTIC_HEADER_CHANNEL=1,
    created on first call (a collective of every rank); None otherwise ([Note: headers off the
    prefetch path])."""
    if os.environ.get(HEADER_CHANNEL_ENV) != "1":  # off by default: see the Note
        return None
    if group is not dist.group.WORLD or dist.get_backend(group) != "gloo":
        return None
    ch = _CHANNELS.get(id(group))
    if ch is None or ch.parent is not group or not ch.alive():
        _CHANNELS.clear()  # a destroyed default group's channel: never used again
        ch = _CHANNELS[id(group)] = HeaderChannel(group)
    return ch


def _describe(runs: list[ChunkRun]) -> str:
    return ", ".join(f"{r.tensor.name} chunks {r.begin}..{r.end - 1}" for r in runs)


class GatherWork:
    """One all-gather in flight. `wait()` makes its pages hold the gathered chunks."""

    def __init__(self, runs: list[ChunkRun], group, world_size: int, comm_stream=None, timeout_s=None,
                 seq: int = 0, device: torch.device | None = None, channel: HeaderChannel | None = None,
                 buffers: GatherBuffers | None = None):
        self.runs = runs
        self.buffers = None if comm_stream is not None else buffers  # host-waited path only
        self._send_kept = None  # the send buffer taken from `buffers`, given back after the collective
        self.world_size = world_size
        self.timeout_s = timeout_s
        self.done = False
        self.error: RuntimeError | None = None
        slices = [r.tensor.storage.slice_numel for r in runs]  # as stored (a quantized weight's image)
        self._slices = slices
        self._counts = [r.end - r.begin for r in runs]
        self.payload_numel = sum(c * s for c, s in zip(self._counts, slices))
        # What pack_shards reads: a range of each shard, or a run's own slices one by one
        # (ElasticTensor.send_parts); the send buffer is the same bytes in the same order.
        parts = [r.tensor.send_parts(r.begin, r.end) for r in runs]
        shards = [t for p in parts for t in p[0]]
        packing = ([s for p in parts for s in p[1]], [b for p in parts for b in p[2]], [e for p in parts for e in p[3]])
        self.send_bytes = self.payload_numel * shards[0].element_size()
        self.seq = seq
        self.device = device
        self.event = None
        self.work = None
        self.channel = channel
        self.header_work = None
        with record_function("elastic::gather"):
            if comm_stream is not None:
                compute = torch.cuda.current_stream(device)
                comm_stream.wait_stream(compute)
                with torch.cuda.stream(comm_stream):
                    send = pack_shards(shards, *packing)
                    self.output = send.new_empty(world_size * send.numel())
                    all_gather_into(self.output, send, group, async_op=False)
                    self._unpack()
                    self.event = torch.cuda.Event()
                    self.event.record(comm_stream)
                # See [Note: where a gather runs ...]: stream-ordered, safe to drop now.
                self.output = None
            elif channel is not None:
                # [Note: headers off the prefetch path]: the header now, the data once it compared equal.
                self._send = self._send_buffer(shards, packing)
                self._header = self._header_of(runs, seq, shards[0].device)
                self._every = [torch.empty_like(self._header) for _ in range(world_size)]
                self.header_work = dist.all_gather(self._every, self._header, group=channel.header_group,
                                                   async_op=True)
                channel.pending.append(self)
                channel.advance()
            else:
                self._check_headers(runs, group, seq, shards[0].device)
                send = self._send_buffer(shards, packing)
                self.output = self._receive_buffer(send)
                self.work = all_gather_into(self.output, send, group, async_op=True)

    def _send_buffer(self, shards: list[torch.Tensor], packing) -> torch.Tensor:
        """The packed send buffer: into a kept buffer on the host-waited path ([Note: receive
        buffers are reused]), remembered to be given back once the collective completed."""
        if self.buffers is None:
            return pack_shards(shards, *packing)
        slices, begins, ends = packing
        numel = sum((e - b) * s for s, b, e in zip(slices, begins, ends))
        self._send_kept = pack_shards(shards, *packing, out=self.buffers.take(shards[0], numel))
        return self._send_kept

    def _receive_buffer(self, send: torch.Tensor) -> torch.Tensor:
        numel = self.world_size * send.numel()
        return send.new_empty(numel) if self.buffers is None else self.buffers.take(send, numel)

    @property
    def received_bytes(self) -> int:
        """Payload bytes this rank receives from its peers in this collective."""
        return (self.world_size - 1) * self.send_bytes

    @property
    def failed(self) -> bool:
        return self.error is not None

    def _unpack(self) -> None:
        dests = [p for r in self.runs for p in r.pages]
        unpack_gathered(self.output, self.world_size, self._slices, self._counts, dests)

    def _header_of(self, runs: list[ChunkRun], seq: int, device) -> torch.Tensor:
        return torch.tensor([_HEADER_MAGIC, seq, _runs_digest(runs), self.payload_numel], dtype=torch.int64,
                            device=device)

    def header_arrived(self) -> bool:
        return self.header_work is None or self.header_work.is_completed()

    def _check_and_issue(self) -> None:
        """Channel path: wait for the header (bounded), compare, then issue the data
        all-gather on the channel's data group. A failure is stored, raised by `wait()`."""
        work, every, send = self.header_work, self._every, self._send
        self.header_work = self._every = self._send = None
        try:
            self._wait_header(work, every, self._header, self.runs)
            del work
            self.output = self._receive_buffer(send)
            self.work = all_gather_into(self.output, send, self.channel.data_group, async_op=True)
        except RuntimeError as exc:
            self.error = exc
            self.output = self._send_kept = None
            self.work = None

    def _check_headers(self, runs: list[ChunkRun], group, seq: int, device) -> None:
        """[Note: collective headers]: exchange and compare before the data collective."""
        mine = self._header_of(runs, seq, device)
        every = [torch.empty_like(mine) for _ in range(self.world_size)]
        work = dist.all_gather(every, mine, group=group, async_op=True)
        self._wait_header(work, every, mine, runs)

    def _wait_header(self, work, every: list[torch.Tensor], mine: torch.Tensor, runs: list[ChunkRun]) -> None:
        seq = int(mine[1])
        try:
            if self.timeout_s is None:
                work.wait()
            else:
                work.wait(datetime.timedelta(seconds=self.timeout_s))
        except Exception as exc:  # noqa: BLE001 - re-raised with context
            work = None  # noqa: F841 - the traceback keeps this frame: not the work ([Note: nothing outlives its step])
            raise RuntimeError(
                f"elastic: the all-gather of {_describe(runs)} failed or timed out before it started "
                f"(timeout {self.timeout_s} s); a peer rank probably failed: {exc}"
            ) from exc
        bad = [r for r in range(self.world_size) if not torch.equal(every[r], mine)]
        if bad:
            other = every[bad[0]].tolist()
            what = "no elastic all-gather header" if other[0] != _HEADER_MAGIC else (
                f"all-gather #{other[1]} (runs digest {other[2]:#x}, {other[3]} elements)"
            )
            raise RuntimeError(
                f"elastic: ranks diverged: this rank's all-gather #{seq} carries {_describe(runs)} "
                f"(runs digest {int(mine[2]):#x}, {self.payload_numel} elements), rank(s) {bad} "
                f"issued {what}. Rule: {SYMMETRY_RULE}."
            )

    def cancel(self) -> None:
        """A use that ends before this gather was waited on (an error while starting uses):
        its data collective is never issued (every rank cancels the same gathers)."""
        if self.channel is not None and self.work is None and not self.done and self.error is None:
            self.channel.cancel(self)
            self.header_work = self._every = self._send = self._send_kept = None
            self.error = RuntimeError("elastic: a gather cancelled before it was waited on")

    def wait(self, what: str) -> None:
        if self.channel is not None:
            pending = self.work is None and self.error is None and not self.done
            self.channel.advance(until=self if pending else None)
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
                    # [Note: nothing outlives its step]: the failed work and its buffers go now.
                    self.output = self._send_kept = None
                    self.work = None
                    raise self.error from exc
                self._unpack()
                if self.buffers is not None:  # [Note: receive buffers are reused]
                    self.buffers.give(self.output)
                    self.buffers.give(self._send_kept)
        self.output = self._send_kept = None  # the pages hold the data now
        self.work = None  # it holds the send buffer: drop both now, not when the use ends
        self.done = True
