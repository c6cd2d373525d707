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
only; elsewhere the CPU figure is None.
"""

from __future__ import annotations

import ctypes
import gc
import os
import platform
import threading

import torch
import torch.distributed as dist

_GATHER_NAMES = ("all_gather_single", "all_gather_into_tensor")


class AllGatherCounter:
    """Counts the bytes each rank *receives* from its peers in every all-gather into a tensor:
    (world_size - 1) x input bytes, the same definition as the elastic runtime's
    `allgather_bytes`. Installed by replacing `torch.distributed.all_gather_single` /
    `all_gather_into_tensor` (FSDP2 and the runtime look them up at call time); one may call
    the other, so only the outermost call counts. Use as a context manager; not re-entrant
    across instances."""

    def __init__(self):
        self.bytes = 0
        self.calls = 0
        self._depth = threading.local()
        self._real: dict[str, object] = {}

    def install(self) -> AllGatherCounter:
        if self._real:
            raise RuntimeError("AllGatherCounter is already installed")
        for name in _GATHER_NAMES:
            if hasattr(dist, name):
                self._real[name] = getattr(dist, name)
                setattr(dist, name, self._wrap(self._real[name]))
        return self

    def uninstall(self) -> None:
        for name, real in self._real.items():
            setattr(dist, name, real)
        self._real = {}

    def __enter__(self) -> AllGatherCounter:
        return self.install()

    def __exit__(self, *exc) -> None:
        self.uninstall()

    def _wrap(self, real):
        def counted(output, inp, group=None, async_op=False, **kwargs):
            depth = getattr(self._depth, "d", 0)
            if depth == 0:
                self.bytes += (dist.get_world_size(group) - 1) * inp.numel() * inp.element_size()
                self.calls += 1
            self._depth.d = depth + 1
            try:
                return real(output, inp, group=group, async_op=async_op, **kwargs)
            finally:
                self._depth.d = depth

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


def rss_peak_bytes() -> int | None:
    return _vm_hwm_bytes()


class PeakMemory:
    """Peak memory of a phase above a baseline; see [Note: what "peak memory" means here]."""

    def __init__(self, device: torch.device | str):
        self.device = torch.device(device)
        self.baseline: int | None = None

    def set_baseline(self) -> None:
        if self.device.type == "cuda":
            gc.collect()
            torch.cuda.synchronize(self.device)
            self.baseline = torch.cuda.memory_allocated(self.device)
        else:
            self.baseline = reset_rss_peak()

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
