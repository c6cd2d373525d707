"""Measurements shared by the fine-tuning CLI and the benchmarks: all-gather traffic and peak memory.

    with AllGatherCounter() as counter:      # counts every all-gather, FSDP2's included
        ...
    counter.bytes, counter.calls

    mem = PeakMemory(device)
    mem.set_baseline()                       # before the model is built
    mem.reset_peak()                         # before the steps to measure
    ...
    mem.peak_above_baseline()                # bytes, or None where it cannot be measured

[Note: what "peak memory" means here]
GPU: `torch.cuda.max_memory_allocated` since `reset_peak`, minus the bytes allocated at
`set_baseline` (tensors only; the caching allocator's reserve is not counted). CPU: the
process's peak resident set since `reset_peak` (VmHWM, reset through /proc/self/clear_refs)
minus its resident set at `set_baseline`, both taken after `gc.collect()` and `malloc_trim(0)`
so freed heap is not counted. On CPU this covers everything the process touches: shards, cached
or unsharded weights, activations, gradients, optimizer state, communication buffers. Linux
only; elsewhere the CPU figure is None. The resident set is comparable across engines only
with glibc's mmap threshold fixed ([Note: a fixed mmap threshold]); `describe()` says which.
The tensor peak (`tensor_peak`) is the figure engines are compared by: on GPU the same
`max_memory_allocated`; on CPU the live tensor bytes before a step plus the profiler's
allocation high-water during it, minus the tensors alive at `set_baseline` (the pool's arena
counted from its own snapshot, the host store left out: host memory on a GPU machine).
"""

from __future__ import annotations

import ctypes
import gc
import os
import platform
import threading

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

_GATHER_NAMES = ("all_gather_single", "all_gather_into_tensor", "_all_gather_base")


class AllGatherCounter:
    """Counts the bytes each rank *receives* from its peers in every all-gather into a tensor:
    (world_size - 1) x input bytes, the same definition as the elastic runtime's
    `allgather_bytes`; `calls` counts the all-gathers. Use as a context manager; not
    re-entrant across instances.

    [Note: what the all-gather counter wraps]
    It replaces `all_gather_single`, `all_gather_into_tensor` and `_all_gather_base` both in
    `torch.distributed` (where FSDP2, the runtime and DeepSpeed's TorchBackend look them up)
    and in `torch.distributed.distributed_c10d` (where torch's own functions call each other:
    in torch 2.14 `all_gather_into_tensor` calls the module's `all_gather_single`, so a
    reference taken before `install`, as DeepSpeed's TorchBackend takes one when it is built,
    is still counted there). One may call the other, so only the outermost call counts (a
    thread-local depth). Callers pass the tensors positionally (FSDP2, the runtime) or by
    keyword (`output_tensor=`, `input_tensor=`: DeepSpeed 0.19.8, comm/torch.py), so the
    wrapper takes `*args, **kwargs` and forwards them unchanged."""

    def __init__(self):
        self.bytes = 0
        self.calls = 0
        self._depth = threading.local()
        self._real: list[tuple[object, str, object]] = []

    def install(self) -> AllGatherCounter:
        if self._real:
            raise RuntimeError("AllGatherCounter is already installed")
        for module in (dist, c10d):
            for name in _GATHER_NAMES:
                if hasattr(module, name):
                    real = getattr(module, name)
                    self._real.append((module, name, real))
                    setattr(module, name, self._wrap(real))
        return self

    def uninstall(self) -> None:
        for module, name, real in reversed(self._real):
            setattr(module, name, real)
        self._real = []

    def __enter__(self) -> AllGatherCounter:
        return self.install()

    def __exit__(self, *exc) -> None:
        self.uninstall()

    def _wrap(self, real):
        def counted(*args, **kwargs):
            depth = getattr(self._depth, "d", 0)
            if depth == 0:
                inp = args[1] if len(args) > 1 else kwargs.get("input_tensor")
                group = args[2] if len(args) > 2 else kwargs.get("group")
                if isinstance(inp, torch.Tensor):
                    self.bytes += (dist.get_world_size(group) - 1) * inp.numel() * inp.element_size()
                    self.calls += 1
            self._depth.d = depth + 1
            try:
                return real(*args, **kwargs)
            finally:
                self._depth.d = depth

        counted.__wrapped__ = real
        return counted


def _vm_hwm_bytes() -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def _malloc_trim() -> None:
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def reset_rss_peak() -> int | None:
    """Return freed heap to the OS, reset the resident-set high-water mark, return the
    current resident set in bytes (None where /proc does not allow it)."""
    gc.collect()
    _malloc_trim()
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return None
    return _vm_hwm_bytes()


# [Note: a fixed mmap threshold]
# glibc serves an allocation above M_MMAP_THRESHOLD with its own mmap, given back to the OS
# when freed; below it from the heap, which keeps freed memory resident. By default the
# threshold is dynamic: each freed mmapped block raises it to that block's size (up to 32
# MiB), so after the first freed gather buffer or activation every later one of that size
# comes from the heap and stays resident when freed. The resident set then says more about
# the allocation history than about what an engine holds (FSDP2: 2,061 MiB of RSS for a 646
# MiB tensor peak; budget 0 read as high as budget all: issue 27). Fixing the threshold with
# mallopt (any explicit setting turns the dynamic adjustment off) at start-up, before the
# big allocations, makes the RSS growth of each engine comparable: buffers of 128 KiB and
# more go back to the OS when freed. The CLI and bench/bench_frontier.py do it and say so.
MMAP_THRESHOLD_BYTES = 128 << 10  # glibc's initial value
_M_MMAP_THRESHOLD = -3  # malloc.h


def fix_mmap_threshold(nbytes: int = MMAP_THRESHOLD_BYTES) -> bool:
    """Fix glibc's mmap threshold (see [Note: a fixed mmap threshold]); False where it cannot
    be set (not glibc)."""
    try:
        ok = bool(ctypes.CDLL("libc.so.6").mallopt(_M_MMAP_THRESHOLD, int(nbytes)))
    except (OSError, AttributeError):
        ok = False
    _MMAP["fixed"] = _MMAP["fixed"] or ok
    return ok


_MMAP = {"fixed": False}


def mmap_threshold_fixed() -> bool:
    return _MMAP["fixed"]


def live_tensor_bytes_of(engine) -> int:
    """Live CPU tensor bytes now, the pool's arena of `engine`'s runtime counted once from its
    snapshot and its host store left out (host memory on a GPU machine)."""
    from ..planning.peaks import live_tensor_bytes

    exclude, pool_bytes = set(), 0
    runtime = getattr(engine, "runtime", None)
    if runtime is not None:
        if runtime.pool is not None:
            segments = runtime.pool.snapshot()
            exclude |= {seg["data_ptr"] for seg in segments}
            pool_bytes = sum(seg["bytes"] for seg in segments)
        if getattr(runtime, "host_store", None) is not None:
            exclude.add(runtime.host_store.tensor().untyped_storage().data_ptr())
    return live_tensor_bytes(exclude) + pool_bytes


def rss_peak_bytes() -> int | None:
    return _vm_hwm_bytes()


class PeakMemory:
    """Peak memory of a phase above a baseline; see [Note: what "peak memory" means here]."""

    def __init__(self, device: torch.device | str):
        self.device = torch.device(device)
        self.baseline: int | None = None
        self.live_baseline: int | None = None  # CPU: live tensor bytes at set_baseline

    def set_baseline(self) -> None:
        if self.device.type == "cuda":
            gc.collect()
            torch.cuda.synchronize(self.device)
            self.baseline = torch.cuda.memory_allocated(self.device)
        else:
            from ..planning.peaks import live_tensor_bytes

            self.live_baseline = live_tensor_bytes()
            self.baseline = reset_rss_peak()

    def describe(self) -> str:
        """What peak_above_baseline measures, for the report."""
        if self.device.type == "cuda":
            return "max_memory_allocated above the level before the build"
        if mmap_threshold_fixed():
            return "resident-set growth over the build and steps (glibc's mmap threshold fixed at 128 KiB)"
        return "resident-set growth (glibc's dynamic mmap threshold: not comparable across engines)"

    def tensor_peak(self, step, engine) -> int | None:
        """The tensor peak of one call of `step()` ([Note: what "peak memory" means here]);
        on GPU the max_memory_allocated figure over everything since reset_peak."""
        if self.device.type == "cuda":
            step()
            return self.peak_above_baseline()
        if self.live_baseline is None:
            step()
            return None
        from ..planning.peaks import profiled_growth

        live = live_tensor_bytes_of(engine)
        return live + profiled_growth(step) - self.live_baseline

    def reset_peak(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
        else:
            reset_rss_peak()

    def peak_above_baseline(self) -> int | None:
        if self.baseline is None:
            return None
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            return torch.cuda.max_memory_allocated(self.device) - self.baseline
        peak = rss_peak_bytes()
        return None if peak is None else peak - self.baseline


def device_name(device: torch.device | str) -> str:
    """'NVIDIA H100 80GB HBM3', or 'CPU <model name> x<logical CPUs>'."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return f"CPU {cpu} x{os.cpu_count()}"
