"""Measured tensor memory: the peak of a run (`measure_peak_bytes`, what the memory model
predicts), the bytes allocated during a call on CPU from the profiler's memory events
(`profiled_growth`), per unit the peak of its backward window (`backward_window_peaks`), and the
live tensor bytes reachable from Python (`live_tensor_bytes`). Used by the profiler
(measure.py), the CLI's report, the pipeline profile and the benchmarks; see [Note: what "peak
memory" means here] in python_api/finetune/measure.py.
"""

from __future__ import annotations

import contextlib
import os
import re
import sys
import tempfile

import torch
import torch.nn as nn

from ..nn.convert import runtime_of


def first_tensor(value):
    if isinstance(value, torch.Tensor):
        return value
    if isinstance(value, (tuple, list)):
        for v in value:
            t = first_tensor(v)
            if t is not None:
                return t
    if isinstance(value, dict):
        for v in value.values():
            t = first_tensor(v)
            if t is not None:
                return t
    return None


def backward_window_peaks(modules: dict[str, nn.Module], run, device: torch.device) -> dict[str, int]:
    """Per unit, the peak of the bytes allocated since `run()` started, during that unit's
    backward (from the gradient of its output reaching it to the next unit's). CUDA:
    `max_memory_allocated`, reset at each boundary. CPU: the profiler's memory events between
    markers the boundaries emit."""
    from torch.profiler import ProfilerActivity, profile, record_function

    marks: list[tuple[str, int]] = []
    cuda = device.type == "cuda"
    base = [0]

    def boundary(name):
        if cuda:
            torch.cuda.synchronize(device)
            marks.append((name, int(torch.cuda.max_memory_allocated(device)) - base[0]))
            torch.cuda.reset_peak_memory_stats(device)
        else:
            with record_function(f"elastic::backward_of::{name}"):
                pass

    def post(name):
        def hook(_module, _args, output):
            out = first_tensor(output)
            if out is not None and out.requires_grad:
                out.register_hook(lambda _g: boundary(name))
        return hook

    handles = [m.register_forward_hook(post(n)) for n, m in modules.items()]
    try:
        if cuda:
            torch.cuda.synchronize(device)
            base[0] = int(torch.cuda.memory_allocated(device))
            torch.cuda.reset_peak_memory_stats(device)
            run()
            torch.cuda.synchronize(device)
            marks.append(("", int(torch.cuda.max_memory_allocated(device)) - base[0]))
            # marks[k] holds the peak of the window that ended at boundary k: shift by one
            return {marks[k][0]: marks[k + 1][1] for k in range(len(marks) - 1)}
        with _kineto_quiet():  # See [Note: the CPU profiler's log lines]
            with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
                run()
            events = _trace_events(prof)
    finally:
        for h in handles:
            h.remove()
    starts = sorted((e["ts"], e["name"].split("::", 2)[2]) for e in events
                    if e.get("ph") == "X" and e.get("name", "").startswith("elastic::backward_of::"))
    memory = _allocated_since_start(events)
    peaks = {}
    for k, (t0, name) in enumerate(starts):
        t1 = starts[k + 1][0] if k + 1 < len(starts) else float("inf")
        peaks[name] = max([0] + [b for t, b in memory if t0 <= t < t1])
    return peaks


def _trace_events(prof) -> list[dict]:
    import json

    fd, path = tempfile.mkstemp(suffix=".json")
    os.close(fd)
    try:
        prof.export_chrome_trace(path)
        with open(path) as f:
            return json.load(f)["traceEvents"]
    finally:
        os.unlink(path)


def _allocated_since_start(events: list[dict]) -> list[tuple[float, int]]:
    """(timestamp, bytes allocated since the profiling session started) at each memory event.
    The profiler's "Total Allocated" counts every allocation made under any profiling session
    of the process that is still alive (its CPU reporter keeps them across sessions), so the
    session's own baseline is taken off: the counter before its first event."""
    memory = sorted((e["ts"], e["args"]["Total Allocated"], e["args"]["Bytes"]) for e in events
                    if e.get("name") == "[memory]")
    if not memory:
        return []
    base = memory[0][1] - memory[0][2]
    return [(ts, total - base) for ts, total, _ in memory]


def profiled_growth(run) -> int:
    """CPU: the high-water mark of the bytes allocated during `run()` (profiler memory events)."""
    from torch.profiler import ProfilerActivity, profile

    with _kineto_quiet():  # See [Note: the CPU profiler's log lines]
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            run()
        events = _trace_events(prof)
    return max([0] + [b for _, b in _allocated_since_start(events)])


# [Note: the CPU profiler's log lines]
# The CPU memory peaks come from torch.profiler's memory events, and its C++ library (kineto)
# writes its own log lines to fd 2 at every use: "USDT: ... profiler_start", and on a machine
# without CUDA "ERROR: ... gpuGetDeviceCount failed with code 35" (issue 31: every CPU run
# printed it; nothing is wrong). They are C++ writes, so Python's sys.stderr cannot filter them:
# fd 2 is pointed at a temporary file while the profiler runs and exports, and what was written
# there is written back afterwards, less kineto's lines (a line of its log format: LEVEL:date
# time pid:tid File.cpp:line]). Anything else written meanwhile (a warning of another thread)
# comes out, only later.
_KINETO_LINE = re.compile(r"^(?:USDT|STAGE|INFO|WARNING|ERROR):\d{4}-\d\d-\d\d \d\d:\d\d:\d\d \d+:\d+ \S+\.cpp:\d+\]")


@contextlib.contextmanager
def _kineto_quiet():
    """See [Note: the CPU profiler's log lines]."""
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as tmp:
        os.dup2(tmp.fileno(), 2)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            tmp.seek(0)
            kept = [ln for ln in tmp.read().decode(errors="replace").splitlines(keepends=True)
                    if not _KINETO_LINE.match(ln)]
            if kept:
                os.write(2, "".join(kept).encode())


def live_tensor_bytes(exclude: set[int] = frozenset()) -> int:
    """Bytes of every tensor storage reachable from Python (each storage once), but those
    whose data pointer is in `exclude`."""
    import gc
    import warnings

    gc.collect()  # garbage (e.g. a finished use's page views) would count its storage
    seen, total = set(exclude), 0
    with warnings.catch_warnings():  # isinstance() on deprecated objects (dist.reduce_op) warns
        warnings.simplefilter("ignore", FutureWarning)
        for obj in gc.get_objects():
            try:
                if not isinstance(obj, torch.Tensor) or obj.device.type != "cpu" or obj.is_meta:
                    continue
                storage = obj.untyped_storage()
                ptr = storage.data_ptr()  # raises for a storage freed underneath (DeepSpeed's partitioned params)
            except Exception:  # noqa: BLE001 - half-built, exotic or freed tensors: nothing to count
                continue
            if ptr and ptr not in seen:
                seen.add(ptr)
                total += storage.nbytes()
    return total


def host_tier_storages(rt) -> set[int]:
    """Data pointers of the host tier's host memory (the store's mapping, the activation
    offload's buffers not in use): host memory, not the device memory the model counts.
    Between steps no offload buffer is in use, but those given back during the last backward
    wait in the pool's return queue until the next request files them; they are idle too
    (`HostBufferPool.idle_buffers`). Counted as device tensors, they overstated the CPU peak
    by the pool's size, which grows with the micro-batch (NOTES.md, issue 17)."""
    out = set()
    if rt.host_store is not None:
        out.add(rt.host_store.tensor().untyped_storage().data_ptr())
    off = getattr(rt, "activation_offload", None)
    if off is not None:
        out.update(b.untyped_storage().data_ptr() for b in off.pool.idle_buffers())
    return out


def measure_peak_bytes(model: nn.Module, run, device: torch.device | None = None) -> int:
    """The peak of tensor memory while `run()` executes: what the memory model predicts.

    CUDA: `torch.cuda.max_memory_allocated` over the call (every tensor, the pool's arena
    included). CPU, where torch keeps no allocator statistics: the bytes of the tensors alive
    when `run` starts (storages reachable from Python, each once, plus the pool's arena, which
    lives in C++; not the host tier's host memory: the store's mapping and the offload's
    buffers, which are host memory on a GPU machine too) plus the high-water mark of the bytes
    allocated during it, from the profiler's memory events. Non-tensor memory of the process
    (the interpreter, libraries, thread stacks) is in neither figure."""
    rt = runtime_of(model)
    return runtimes_peak_bytes([rt], run, device or rt.device)


def runtimes_peak_bytes(runtimes, run, device: torch.device, count_host_tier: bool = False) -> int:
    """measure_peak_bytes over several runtimes on one device (a pipeline stage's packs): each
    runtime's pool segments count once; its host tier's storages only with `count_host_tier`
    (the pipeline memory model counts a CPU rank's host store: python_api/planner/pipeline_sim.py)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        run()
        torch.cuda.synchronize(device)
        return int(torch.cuda.max_memory_allocated(device))
    # The pool's segments count once, as the pool reports them (cached page views that
    # Python can see share those storages).
    segments = [s for rt in runtimes if rt.pool is not None for s in rt.pool.snapshot()]
    exclude = {s["data_ptr"] for s in segments}
    if not count_host_tier:
        for rt in runtimes:
            exclude |= host_tier_storages(rt)
    live = live_tensor_bytes(exclude) + sum(s["bytes"] for s in segments)
    return live + profiled_growth(run)
