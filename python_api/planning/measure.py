"""A `Profile` measured from warm-up steps of the real model under its elastic runtime.

    profile = measure_profile(model, batches, capacity_bytes=...)    # on every rank

What is measured, per unit of the runtime (a decoder layer, or a weight that is its own unit),
in forward order:
- forward and backward compute time: module hooks time the unit's forward; a hook on the
  gradient of the unit's output marks the start of its backward, whose end is the start of the
  previous unit's backward (or the end of the whole backward). The steps run with every chunk
  resident (all weights PERSISTENT for the duration, pool unbounded, one warm-up step first),
  so no gather is in these times: they are compute alone. With two micro-batch sizes (the
  batch and its first half) the time is fitted as fixed + per-token; with one, fixed is 0.
- activation bytes per token: `saved_tensors_hooks` count the bytes each unit's forward saves
  for backward (storages counted once, parameters and the pool's pages never), and the bytes
  of its input (what a recomputed unit keeps);
- the all-gather and all-reduce links: timed collectives on the runtime's group at two sizes
  (a chunk's slice and a unit's worth of slices; the adapter gradients and a small buffer),
  median of 5 each, fitted as latency + bytes / bandwidth;
- static bytes (shards, replicated parameters and buffers, adapters with their gradients and
  AdamW's two states), the page size, and on CUDA the device's capacity and the memory that is
  not ours (total - free - what torch has reserved). On CPU the capacity is the caller's
  (`capacity_bytes`, the CLI's --memory-cap) and nothing is counted as not ours: the measured
  peaks the model is checked against are above the process's baseline.
- the host tier, when the runtime has one (a host store, or activation offload on; or
  `host_tier=True`): the h2d link from timed copies host store -> device memory of the
  runtime (`HostCopyWork`, as the runtime copies a host chunk into its page, on its copy
  stream) at two sizes (one chunk, the largest unit's chunks), median of 5 each, fitted like
  the collectives (without a store: a plain host -> device copy, pinned on CUDA); whether a
  store exists, weights_on and host_budget_bytes from the policy; per unit, what activation
  offload would move, read in the timed step from the tensors ElasticLoRAFunction hands to
  `save_for_backward` as activations (lora_x, xa, mask: their bytes in order, exactly what
  `ActivationOffload.offload` copies), and what that frees on the device: the storages that
  nothing but those activations saves (counted by the same saved-tensor hooks);
Every rank measures; timings are then reduced with MAX across the group (the slowest rank sets
the pace), so every rank holds the same profile and computes the same plan. The steps run with
activation offload off (it is restored after).

Side effects: the warm-up and timed steps run forward and backward (dropout draws random
numbers; adapter gradients are cleared before and after); residency and the pool budget are
restored at the end.
"""

from __future__ import annotations

import contextlib
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn as nn

from python_api.distributed.collectives import all_gather_into
from python_api.host.offload import observe_activations
from python_api.host.sources import HostCopyWork
from python_api.nn.convert import runtime_of
from python_api.planner.memory import Choices, memory_curve
from python_api.planner.profile import LayerProfile, Link, OutsideProfile, Profile, WeightProfile
from python_api.planning.apply import set_recompute
from python_api.runtime import Phase

_REPEATS = 5


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _hf_loss(model: nn.Module, batch: torch.Tensor) -> torch.Tensor:
    return model(input_ids=batch, labels=batch).loss


def _first_tensor(value):
    if isinstance(value, torch.Tensor):
        return value
    if isinstance(value, (tuple, list)):
        for v in value:
            t = _first_tensor(v)
            if t is not None:
                return t
    if isinstance(value, dict):
        for v in value.values():
            t = _first_tensor(v)
            if t is not None:
                return t
    return None


class _StepProbe:
    """Hooks that time each unit's forward and backward and count what it saves."""

    def __init__(self, model: nn.Module, units: dict[str, nn.Module], device: torch.device):
        self.units = units
        self.device = device
        self.param_storages = {p.untyped_storage().data_ptr() for p in model.parameters()}
        self.param_storages |= {b.untyped_storage().data_ptr() for b in model.buffers()}
        self.handles = []
        self.active: list[str] = []
        self.reset()
        for name, module in units.items():
            self.handles.append(module.register_forward_pre_hook(self._pre(name), with_kwargs=True))
            self.handles.append(module.register_forward_hook(self._post(name)))

    def reset(self) -> None:
        self.pack_counts: dict[int, int] = {}  # storage -> times saved (every saved tensor)
        self.offl: dict[str, list[int]] = {n: [] for n in self.units}  # per unit: activation bytes, in order
        self.offl_storages: dict[int, tuple[str, int, int]] = {}  # storage -> (unit, bytes, times as activation)
        self.fwd_s = {n: 0.0 for n in self.units}
        self.bwd_start: dict[str, float] = {}
        self.saved = {n: 0 for n in self.units}
        self.saved_outside = 0
        self.input_bytes = {n: 0 for n in self.units}
        self.seen: set[int] = set()
        self._t0: dict[str, float] = {}

    def _pre(self, name):
        def hook(_module, args, kwargs):
            x = _first_tensor(args) if args else _first_tensor(kwargs)
            if x is not None and torch.is_grad_enabled():
                self.input_bytes[name] += x.numel() * x.element_size()
            _sync(self.device)
            self.active.append(name)
            self._t0[name] = time.perf_counter()
        return hook

    def _post(self, name):
        def hook(_module, _args, output):
            _sync(self.device)
            self.fwd_s[name] += time.perf_counter() - self._t0.pop(name)
            self.active.pop()
            out = _first_tensor(output)
            if out is not None and out.requires_grad:
                def on_grad(_g, name=name):
                    _sync(self.device)
                    self.bwd_start.setdefault(name, time.perf_counter())
                out.register_hook(on_grad)
        return hook

    def record_activations(self, tensors: tuple, activations: tuple[int, ...]) -> None:
        """What activation offload would copy from this save_for_backward (the offloader's
        own rule: non-empty tensors at the activation positions, in order)."""
        if not self.active:
            return
        unit = self.active[-1]
        for i in activations:
            t = tensors[i]
            if t is None or t.numel() == 0:
                continue
            self.offl[unit].append(t.nbytes)
            st = t.untyped_storage()
            u, nb, k = self.offl_storages.get(st.data_ptr(), (unit, st.nbytes(), 0))
            self.offl_storages[st.data_ptr()] = (u, nb, k + 1)

    def freed(self) -> dict[str, int]:
        """Per unit, bytes of the storages saved only as offloadable activations."""
        out = {n: 0 for n in self.units}
        for ptr, (unit, nbytes, k) in self.offl_storages.items():
            if self.pack_counts.get(ptr, 0) == k:
                out[unit] += nbytes
        return out

    def pack(self, t: torch.Tensor):
        ptr = t.untyped_storage().data_ptr()
        self.pack_counts[ptr] = self.pack_counts.get(ptr, 0) + 1
        if ptr not in self.param_storages and ptr not in self.seen:
            self.seen.add(ptr)
            nbytes = t.untyped_storage().nbytes()
            if self.active:
                self.saved[self.active[-1]] += nbytes
            else:
                self.saved_outside += nbytes
        return t

    def close(self) -> None:
        for h in self.handles:
            h.remove()


def _unit_modules(model: nn.Module, rt) -> tuple[list[str], dict[str, nn.Module]]:
    """The runtime's units in forward order and the module of each."""
    order = rt.learned_order(Phase.FORWARD)
    if order is None:
        raise RuntimeError("measure_profile: the runtime has not learned the forward order (run a step first)")
    names = list(dict.fromkeys(rt.tensors[w].unit for w in order))
    modules = {}
    for u in names:
        path = u[len("weight:"):] if u.startswith("weight:") else u
        modules[u] = model.get_submodule(path)
    return names, modules


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


def _link(rt, sizes: list[int], kind: str) -> Link:
    """Fit latency + bytes / bandwidth to timed collectives of `sizes` bytes per rank."""
    if rt.world_size == 1:
        return Link(latency_s=0.0, bytes_per_s=1e18)
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
    (b0, t0), (b1, t1) = points
    latency, per_byte = _fit(b0, t0, b1, t1)
    return Link(latency_s=latency, bytes_per_s=1.0 / per_byte if per_byte > 0 else 1e18)


def _h2d_link(rt, sizes_chunks: list[list]) -> Link:
    """Fit latency + bytes / bandwidth to timed host -> device copies. With a host store: of
    host chunks into device memory, by the runtime's `HostCopyWork` on its copy stream
    (`sizes_chunks`: lists of (tensor, chunk) to copy together); without: a plain copy of the
    same byte counts from host memory (pinned on CUDA)."""

    device = rt.device
    points = []
    for group in sizes_chunks:
        if rt.host_store is not None:
            pairs = [(et.host_chunk(c), torch.empty(et.layout.chunk_shape(c), dtype=et.dtype, device=device))
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
    (b0, t0), (b1, t1) = points
    latency, per_byte = _fit(b0, t0, b1, t1)
    return Link(latency_s=latency, bytes_per_s=1.0 / per_byte if per_byte > 0 else 1e18)


def _run_step(model, batch, forward_loss, probe: _StepProbe | None, device):
    """Forward and backward of one micro-batch; returns (forward seconds, backward seconds)."""
    _sync(device)
    t0 = time.perf_counter()
    if probe is not None:
        with torch.autograd.graph.saved_tensors_hooks(probe.pack, lambda t: t):
            loss = forward_loss(model, batch)
    else:
        loss = forward_loss(model, batch)
    _sync(device)
    t1 = time.perf_counter()
    loss.backward()
    _sync(device)
    t2 = time.perf_counter()
    for p in model.parameters():
        p.grad = None
    return t1 - t0, t2 - t1, t1, t2, loss


def _static_bytes(model: nn.Module, rt) -> int:
    shards = sum(et.shard.numel() * et.shard.element_size() for et in rt.tensors if et.shard is not None)
    params = 0
    for p in model.parameters():
        b = p.numel() * p.element_size()
        params += b * 4 if p.requires_grad else b  # trainable: value, gradient, AdamW's two states
    buffers = sum(b.numel() * b.element_size() for b in model.buffers())
    return shards + params + buffers


def measure_profile(model: nn.Module, batches: list[torch.Tensor], *, forward_loss=None,
                    capacity_bytes: int | None = None, steps: int = 2, host_tier: bool | None = None) -> Profile:
    """Measure a `Profile` of `model` (under convert_to_elastic / elasticize) on `batches`
    (at least one micro-batch of input ids [B, T]). A collective: call on every rank alike.
    `host_tier`: measure the host tier's fields (None: when the runtime has a host store or
    its policy offloads activations)."""
    if not batches:
        raise ValueError("measure_profile: give at least one micro-batch")
    rt = runtime_of(model)
    device = rt.device
    forward_loss = forward_loss or _hf_loss
    batch = batches[0]
    if batch.dim() != 2:
        raise ValueError(f"measure_profile: a micro-batch is input ids [B, T], got shape {tuple(batch.shape)}")
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        capacity = int(total) if capacity_bytes is None else int(capacity_bytes)
        reserved = int(total - free - torch.cuda.memory_reserved(device))
    else:
        if capacity_bytes is None:
            raise ValueError("measure_profile: on CPU give capacity_bytes (the memory to plan for)")
        capacity, reserved = int(capacity_bytes), 0

    saved = [(et, et.keep_chunks, et.persist_chunks) for et in rt.tensors]
    budget = rt.cache_budget
    was_training = model.training
    if host_tier is None:
        host_tier = rt.host_store is not None or rt.policy.offload_activations
    host_tier = host_tier or rt.policy.weights_on == "host"
    offload_was = rt.policy.offload_activations
    model.train()
    try:
        if offload_was:
            rt.set_offload_activations(False)  # every step below saves its activations on the device
        for et in rt.tensors:
            rt.set_residency(et, et.num_chunks, et.num_chunks)
        rt.set_pool_budget(None)
        _run_step(model, batch, forward_loss, None, device)  # learns the order, gathers everything
        names, modules = _unit_modules(model, rt)
        probe = _StepProbe(model, modules, device)
        try:
            sizes = [batch] + ([batch[: batch.shape[0] // 2]] if batch.shape[0] >= 2 else [])
            per_size = []
            offload_bytes, freed = {n: [] for n in names}, {n: 0 for n in names}
            for si, b in enumerate(sizes):
                rows = []
                for step in range(steps):
                    probe.reset()
                    record = si == 0 and step == 0
                    # What activation offload would copy, read from the layers' saves (a supported
                    # probe hook of python_api/host/offload.py).
                    observing = observe_activations(probe.record_activations) if record else contextlib.nullcontext()
                    with observing:
                        fwd, bwd, t_fwd_end, t_bwd_end, loss = _run_step(model, b, forward_loss, probe, device)
                    if record:
                        offload_bytes, freed = dict(probe.offl), probe.freed()
                    starts = [probe.bwd_start.get(n) for n in names]
                    bwd_units = []
                    for i, n in enumerate(names):
                        if starts[i] is None:
                            bwd_units.append(0.0)
                            continue
                        end = next((starts[j] for j in range(i - 1, -1, -1) if starts[j] is not None), t_bwd_end)
                        bwd_units.append(max(0.0, end - starts[i]))
                    rows.append((fwd, bwd, [probe.fwd_s[n] for n in names], bwd_units))
                tokens = b.numel()
                med = lambda xs: statistics.median(xs)  # noqa: E731
                per_size.append((tokens,
                                 med([r[0] for r in rows]), med([r[1] for r in rows]),
                                 [med([r[2][i] for r in rows]) for i in range(len(names))],
                                 [med([r[3][i] for r in rows]) for i in range(len(names))],
                                 dict(probe.saved), probe.saved_outside, dict(probe.input_bytes)))
        finally:
            probe.close()
        # Which weights have a backward use, from the steps above (the recompute step below
        # adds forward uses inside backward to the learned backward order).
        backward_wids = set(rt.learned_order(Phase.BACKWARD) or ())
        # Each unit's backward allocation peak with every chunk resident (no gathers): what the
        # memory model's activations miss of it is the backward workspace.
        window_peaks = _backward_window_peaks(modules, lambda: _run_step(model, batch, forward_loss, None, device),
                                              device)
        # ...and the same step with every decoder layer recomputed (activation checkpointing).
        layers_of = {n: m for n, m in modules.items() if not n.startswith("weight:")}
        for m in layers_of.values():
            set_recompute(m, True)
        try:
            recompute_peaks = _backward_window_peaks(
                modules, lambda: _run_step(model, batch, forward_loss, None, device), device)
        finally:
            for m in layers_of.values():
                set_recompute(m, False)
    finally:
        if offload_was:
            rt.set_offload_activations(True)
        for et, k, p in saved:
            rt.set_residency(et, k, p)
            # Give the pool back what the profile made resident: its arena only shrinks by
            # whole empty segments, and the plan sizes the pool from nothing.
            rt.drop_cached(et)
        rt.set_pool_budget(budget)
        model.train(was_training)

    tokens, fwd, bwd, fwd_units, bwd_units, act, act_out, inputs = per_size[0]
    # Timings: fixed + per token from the two sizes (per token only with one size).
    fits_f, fits_b = [], []
    for i in range(len(names)):
        if len(per_size) == 2:
            t2 = per_size[1]
            fits_f.append(_fit(t2[0], t2[3][i], tokens, fwd_units[i]))
            fits_b.append(_fit(t2[0], t2[4][i], tokens, bwd_units[i]))
        else:
            fits_f.append((0.0, fwd_units[i] / tokens))
            fits_b.append((0.0, bwd_units[i] / tokens))
    out_fwd = max(0.0, fwd - sum(fwd_units)) / tokens
    out_bwd = max(0.0, bwd - sum(bwd_units)) / tokens
    # Reduce timings with MAX and byte counts with MAX over the ranks: one profile everywhere.
    flat = [x for f in fits_f for x in f] + [x for f in fits_b for x in f] + [out_fwd, out_bwd]
    if rt.world_size > 1:
        tensor = torch.tensor(flat, dtype=torch.float64, device=device)
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=rt.group)
        flat = tensor.tolist()
    n = len(names)
    fits_f = [(flat[2 * i], flat[2 * i + 1]) for i in range(n)]
    fits_b = [(flat[2 * n + 2 * i], flat[2 * n + 2 * i + 1]) for i in range(n)]
    out_fwd, out_bwd = flat[4 * n], flat[4 * n + 1]

    layers = []
    for i, u in enumerate(names):
        weights = tuple(
            WeightProfile(name=et.name, chunks=et.num_chunks, slice_bytes=et.slice_bytes,
                          chunk_bytes=et.page_bytes, backward=et.wid in backward_wids,
                          last_chunk_bytes=(None if et.chunk_bytes_of(et.num_chunks - 1) == et.page_bytes
                                            else et.chunk_bytes_of(et.num_chunks - 1)))
            for et in rt.tensors if et.unit == u
        )
        recomputable = not u.startswith("weight:")
        a = act[u] / tokens
        x = inputs[u] / tokens
        layers.append(LayerProfile(
            name=u, recomputable=recomputable and x <= a,
            fwd_s_fixed=fits_f[i][0], fwd_s_per_token=fits_f[i][1],
            bwd_s_fixed=fits_b[i][0], bwd_s_per_token=fits_b[i][1],
            act_bytes_per_token=a, input_bytes_per_token=min(x, a), weights=weights,
            offload_tensors_bytes_per_token=tuple(nb / tokens for nb in offload_bytes[u]) if host_tier else (),
            offload_freed_bytes_per_token=freed[u] / tokens if host_tier else 0.0,
        ))
    logits_bytes = _logits_bytes_per_token(model, batch)
    adapter_grad = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    allgather = _link(rt, [max(et.slice_bytes for et in rt.tensors),
                           max(sum(w.slice_bytes * w.chunks for w in layer.weights) for layer in layers)], "allgather")
    allreduce = _link(rt, [4096, max(8192, adapter_grad)], "allreduce")
    h2d = None
    if host_tier:
        big = max(rt.tensors, key=lambda et: et.page_bytes)
        unit = max(names, key=lambda n: sum(et.num_chunks for et in rt.tensors if et.unit == n))
        h2d = _h2d_link(rt, [[(big, 0)], [(et, c) for et in rt.tensors if et.unit == unit
                                         for c in range(et.num_chunks)]])
    profile = Profile(
        source="measured", device=_device_name(device), world_size=rt.world_size, seq_len=int(batch.shape[1]),
        capacity_bytes=capacity, reserved_bytes=max(0, reserved), static_bytes=_static_bytes(model, rt),
        page_bytes=rt.page_bytes(), adapter_grad_bytes=adapter_grad, allgather=allgather, allreduce=allreduce,
        layers=tuple(layers),
        outside=OutsideProfile(fwd_s_per_token=out_fwd, bwd_s_per_token=out_bwd,
                               act_bytes_per_token=act_out / tokens, peak_bytes_per_token=logits_bytes),
        h2d=h2d, host_store=host_tier and rt.host_store is not None,
        weights_on=rt.policy.weights_on if host_tier else "device",
        host_budget_bytes=rt.policy.host_budget_bytes if host_tier else None,
    )
    profile = _with_workspace(profile, window_peaks, recompute_peaks, int(batch.shape[0]))
    if rt.world_size > 1:
        # Links and the memory not ours are rank 0's (timings are already the MAX over ranks).
        box = [profile.to_dict()]
        dist.broadcast_object_list(box, src=dist.get_global_rank(rt.group, 0), group=rt.group)
        profile = Profile.from_dict(box[0])
    return profile


def _backward_window_peaks(modules: dict[str, nn.Module], run, device: torch.device) -> dict[str, int]:
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
            out = _first_tensor(output)
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
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            run()
        events = _trace_events(prof)
    finally:
        for h in handles:
            h.remove()
    starts = sorted((e["ts"], e["name"].split("::", 2)[2]) for e in events
                    if e.get("ph") == "X" and e.get("name", "").startswith("elastic::backward_of::"))
    memory = sorted((e["ts"], e["args"]["Total Allocated"]) for e in events if e.get("name") == "[memory]")
    peaks = {}
    for k, (t0, name) in enumerate(starts):
        t1 = starts[k + 1][0] if k + 1 < len(starts) else float("inf")
        peaks[name] = max([0] + [b for t, b in memory if t0 <= t < t1])
    return peaks


def _trace_events(prof) -> list[dict]:
    import json
    import os
    import tempfile

    fd, path = tempfile.mkstemp(suffix=".json")
    os.close(fd)
    try:
        prof.export_chrome_trace(path)
        with open(path) as f:
            return json.load(f)["traceEvents"]
    finally:
        os.unlink(path)


def _profiled_growth(run) -> int:
    """CPU: the high-water mark of "Total Allocated" in the profiler's memory events."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        run()
    return max([0] + [e["args"]["Total Allocated"] for e in _trace_events(prof) if e.get("name") == "[memory]"])


def _excess(profile: Profile, window_peaks: dict[str, int], micro_batch: int, recompute: bool) -> int:
    """The most a unit's measured backward window (recompute included) exceeds the memory
    model's points for it, with every chunk resident; adapter gradients taken out (the model
    counts them as static)."""
    choices = Choices.uniform(profile, micro_batch, keep_fraction=1.0, recompute=True if recompute else None)
    curve = memory_curve(profile, choices)
    modelled: dict[str, int] = {}
    for label, b in curve.points:
        kind, _, name = label.partition(" ")
        if kind in ("backward", "recompute"):
            modelled[name] = max(modelled.get(name, 0), b - curve.fixed_bytes - curve.pool_bytes)
    excess = 0
    for name, peak in window_peaks.items():
        if name in modelled:
            excess = max(excess, peak - profile.adapter_grad_bytes - modelled[name])
    return excess


def _with_workspace(profile: Profile, window_peaks: dict[str, int], recompute_peaks: dict[str, int],
                    micro_batch: int) -> Profile:
    """The profile with the backward workspaces fitted ([Note: what the memory model counts]
    in memory.py): `workspace_bytes_per_token` from a step without recompute, then
    `recompute_workspace_bytes_per_token` from a step recomputing every layer, with the first
    already in the model; per token, at least 0."""
    import dataclasses

    tokens = micro_batch * profile.seq_len
    ws = max(0, _excess(profile, window_peaks, micro_batch, recompute=False)) / tokens
    profile = dataclasses.replace(profile, outside=dataclasses.replace(profile.outside, workspace_bytes_per_token=ws))
    if not any(layer.recomputable for layer in profile.layers):
        return profile
    rws = max(0, _excess(profile, recompute_peaks, micro_batch, recompute=True)) / tokens
    return dataclasses.replace(profile, outside=dataclasses.replace(
        profile.outside, recompute_workspace_bytes_per_token=rws))


def _logits_bytes_per_token(model: nn.Module, batch: torch.Tensor) -> float:
    """The end-of-forward transient per token: the logits, their fp32 copy for the loss and
    the loss's gradient of the same shape (3 x vocab x 4 bytes for an HF causal LM head)."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    vocab = getattr(head, "out_features", None) or getattr(getattr(model, "config", None), "vocab_size", 0) or 0
    return 3.0 * vocab * 4


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return "cpu"


# ---------------------------------------------------------------------------- measured peaks


def _live_tensor_bytes(exclude: set[int] = frozenset()) -> int:
    """Bytes of every tensor storage reachable from Python (each storage once), but those
    whose data pointer is in `exclude`."""
    import gc

    gc.collect()  # garbage (e.g. a finished use's page views) would count its storage
    seen, total = set(exclude), 0
    for obj in gc.get_objects():
        try:
            if not isinstance(obj, torch.Tensor) or obj.device.type != "cpu" or obj.is_meta:
                continue
            storage = obj.untyped_storage()
        except Exception:  # noqa: BLE001 - half-built or exotic tensors: not ours to count
            continue
        ptr = storage.data_ptr()
        if ptr and ptr not in seen:
            seen.add(ptr)
            total += storage.nbytes()
    return total


def measure_peak_bytes(model: nn.Module, run, device: torch.device | None = None) -> int:
    """The peak of tensor memory while `run()` executes: what the memory model predicts.

    CUDA: `torch.cuda.max_memory_allocated` over the call (every tensor, the pool's arena
    included). CPU, where torch keeps no allocator statistics: the bytes of the tensors alive
    when `run` starts (storages reachable from Python, each once, plus the pool's arena, which
    lives in C++) plus the high-water mark of the bytes allocated during it, from the
    profiler's memory events ("Total Allocated" counts allocations minus frees since the
    profile started). Non-tensor memory of the process (the interpreter, libraries, thread
    stacks) is in neither figure."""
    rt = runtime_of(model)
    device = device or rt.device
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        run()
        torch.cuda.synchronize(device)
        return int(torch.cuda.max_memory_allocated(device))
    # The pool's segments count once, as the pool reports them (cached page views that
    # Python can see share those storages).
    segments = rt.pool.snapshot() if rt.pool is not None else []
    live = _live_tensor_bytes({s["data_ptr"] for s in segments}) + sum(s["bytes"] for s in segments)
    return live + _profiled_growth(run)
