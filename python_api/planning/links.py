"""Timed collectives and copies for measure_profile (measure.py): each link (the all-gather, the
all-reduce, the device copy, host -> device) timed at two sizes, median of `_REPEATS`, and
fitted as latency + bytes / bandwidth."""

from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist

from ..distributed.collectives import all_gather_into
from ..host.sources import HostCopyWork
from ..planner.profile import Link, Profile

_REPEATS = 5  # median of this many timed repeats per link point


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(fn, device) -> float:
    times = []
    for _ in range(_REPEATS):
        _sync(device)
        t0 = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _fit(x0: float, t0: float, x1: float, t1: float) -> tuple[float, float]:
    """(fixed, per_unit) of a line through two points, both clamped at >= 0."""
    if x1 == x0:
        return 0.0, t1 / x1 if x1 else 0.0
    slope = max(0.0, (t1 - t0) / (x1 - x0))
    return max(0.0, t1 - slope * x1), slope


def _link_points(rt, sizes: list[int], kind: str) -> list[tuple[int, float]]:
    """Timed collectives of `sizes` bytes per rank: (bytes, seconds) to fit latency + bytes /
    bandwidth to (bytes received for the all-gather, reduced for the all-reduce)."""
    if rt.world_size == 1:
        return [(1, 0.0), (2, 0.0)]
    W, device = rt.world_size, rt.device
    points = []
    for size in sizes:
        numel = max(1, size // 4)
        send = torch.zeros(numel, dtype=torch.float32, device=device)
        if kind == "allgather":
            out = torch.empty(W * numel, dtype=torch.float32, device=device)
            t = _timed(lambda: all_gather_into(out, send, rt.group, async_op=False), device)
            points.append(((W - 1) * numel * 4, t))
        else:
            t = _timed(lambda: dist.all_reduce(send, group=rt.group), device)
            points.append((numel * 4, t))
    return points


def _copy_points(rt, sizes: list[int]) -> list[tuple[int, float]]:
    """Timed device-to-device copies of `sizes` bytes (a gather's pack and unpack are such
    copies, on the communication stream): (bytes, seconds), median of 5 each."""
    device, points = rt.device, []
    for size in sizes:
        src = torch.zeros(max(1, size), dtype=torch.uint8, device=device)
        dst = torch.empty_like(src)
        dst.copy_(src)  # warm-up
        points.append((src.numel(), _timed(lambda src=src, dst=dst: dst.copy_(src), device)))
    return points


def _fit_link(points: list[tuple[int, float]]) -> Link:
    (b0, t0), (b1, t1) = points
    latency, per_byte = _fit(b0, t0, b1, t1)
    return Link(latency_s=latency, bytes_per_s=1.0 / per_byte if per_byte > 0 else 1e18)


def _h2d_points(rt, sizes_chunks: list[list]) -> list[tuple[int, float]]:
    """Timed host -> device copies, (bytes, seconds) to fit a link to. With a host store: of
    host chunks into device memory, by the runtime's `HostCopyWork` on its copy stream
    (`sizes_chunks`: lists of (tensor, chunk) to copy together); without: a plain copy of the
    same byte counts from host memory (pinned on CUDA)."""

    device = rt.device
    points = []
    for group in sizes_chunks:
        if rt.host_store is not None:
            pairs = [(et.host_chunk(c), torch.empty(et.chunk_shape(c), dtype=et.storage_dtype, device=device))
                     for et, c in group]

            def copy(pairs=pairs):
                work = HostCopyWork(pairs, rt.copy_stream, device)
                work.wait("h2d link")
            nbytes = sum(src.numel() * src.element_size() for src, _ in pairs)
        else:
            nbytes = sum(et.chunk_bytes_of(c) for et, c in group)
            src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=device.type == "cuda")
            dst = torch.empty(nbytes, dtype=torch.uint8, device=device)

            def copy(src=src, dst=dst):
                dst.copy_(src, non_blocking=device.type == "cuda")
        copy()  # warm-up
        points.append((nbytes, _timed(copy, device)))
    return points


def _link_measurements(rt, profile: Profile, names, host_tier: bool) -> dict:
    """The timed points of every link ([Note: the time model]): all-gather, all-reduce, device
    copies, host -> device."""
    slice_max = max(w.slice_bytes for layer in profile.layers for w in layer.weights)
    unit_max = max(sum(w.slice_bytes * w.chunks for w in layer.weights) for layer in profile.layers)
    adapter = profile.adapter_grad_bytes
    out = {"allgather": _link_points(rt, [slice_max, unit_max], "allgather"),
           "allreduce": _link_points(rt, [4096, max(8192, adapter)], "allreduce"),
           "copy": _copy_points(rt, [slice_max, (rt.world_size + 1) * unit_max])}
    if host_tier:
        big = max(rt.tensors, key=lambda et: et.page_bytes)
        unit = max(names, key=lambda n: sum(et.num_chunks for et in rt.tensors if et.unit == n))
        out["h2d"] = _h2d_points(rt, [[(big, 0)], [(et, c) for et in rt.tensors if et.unit == unit
                                                    for c in range(et.num_chunks)]])
    return out
