"""One measured step for measure_profile (measure.py): the probe whose hooks time each unit's
forward and backward and count the bytes it saves for backward, the step itself, the timed
steps at each micro-batch size, the backward-window peaks, and the static bytes (MAX over the
ranks)."""

from __future__ import annotations

import contextlib
import statistics
import time

import torch
import torch.nn as nn

from ..nn.linear import op_dtype
from ..runtime import Phase
from .apply import set_recompute
from .links import _sync
from .peaks import (
    backward_window_peaks,
    first_tensor,
)


def _hf_loss(model: nn.Module, batch: torch.Tensor) -> torch.Tensor:
    return model(input_ids=batch, labels=batch).loss


class _StepProbe:
    """Hooks that time each unit's forward and backward and count what it saves."""

    def __init__(self, model: nn.Module, units: dict[str, nn.Module], device: torch.device):
        self.units = units
        self.device = device
        self.param_storages = {p.untyped_storage().data_ptr() for p in model.parameters()}
        self.param_storages |= {b.untyped_storage().data_ptr() for b in model.buffers()}
        self.handles = []
        self.active: list[str] = []
        self.linear: list[str] = []  # the elastic weight whose layer is running (offload owners)
        self.op_dtypes: dict[str, torch.dtype] = {}  # elastic weight -> the dtype its layer computes in
        self.reset()
        for name, module in units.items():
            self.handles.append(module.register_forward_pre_hook(self._pre(name), with_kwargs=True))
            self.handles.append(module.register_forward_hook(self._post(name)))
            for sub in module.modules():
                et = getattr(sub, "et", None)
                if et is not None and hasattr(et, "num_chunks"):  # an elastic layer (ElasticLinear / LoRA)
                    self.handles.append(sub.register_forward_pre_hook(
                        lambda _m, a, n=et.name, d=et.dtype: self._linear_enter(n, d, a)))
                    self.handles.append(sub.register_forward_hook(self._linear_done))

    def _linear_enter(self, name: str, weight_dtype: torch.dtype, args) -> None:
        self.linear.append(name)
        if name not in self.op_dtypes and args and isinstance(args[0], torch.Tensor):
            with contextlib.suppress(TypeError, ValueError):  # the layer itself reports a bad input
                self.op_dtypes[name] = op_dtype(args[0], weight_dtype, name)

    def _linear_done(self, _module, _args, _output) -> None:
        self.linear.pop()  # returns None: a forward hook's return value would replace the output

    def reset(self) -> None:
        self.pack_counts: dict[int, int] = {}  # storage -> times saved (every saved tensor)
        self.offl: dict[str, list[int]] = {n: [] for n in self.units}  # per unit: activation bytes, in order
        self.offl_owner: dict[str, list[str]] = {n: [] for n in self.units}  # ...and the weight that saved each
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
            x = first_tensor(args) if args else first_tensor(kwargs)
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
            out = first_tensor(output)
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
            self.offl_owner[unit].append(self.linear[-1] if self.linear else "")
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


def _static_bytes(parameters, buffers, rt) -> int:
    """The tensors alive at a step's start: of the runtime `rt`, and `parameters` and `buffers`
    (the whole model's, also while profiling runs a model cut to a few layers)."""
    shards = sum(et.shard_bytes for et in rt.tensors)  # a run's own elements where held as a run
    params = 0
    for p in parameters:
        b = p.numel() * p.element_size()
        params += b * 4 if p.requires_grad else b  # trainable: value, gradient, AdamW's two states
    buffers = sum(b.numel() * b.element_size() for b in buffers)
    # The recycled dequant workspace (quantized weights): grown to the largest weight a call
    # dequantized by the step before, and never shrunk ([Note: the dequant workspace]).
    return shards + params + buffers + rt.dequant_workspace.nbytes


def _max_over_ranks(obj, rt, what: str):
    """`obj` (nested dicts / lists / tuples of numbers) reduced element-wise with MAX over the
    runtime's group: one collective; ranks whose structures differ fail together."""
    if rt.world_size == 1:
        return obj
    from ..distributed.agree import exchange

    every = exchange(obj, rt.group, timeout_s=rt.policy.collective_timeout_s, what=what, error_type=RuntimeError)

    def merge(values, where):
        first = values[0]
        if isinstance(first, dict):
            if any(not isinstance(v, dict) or v.keys() != first.keys() for v in values):
                raise RuntimeError(f"{what}: the ranks measured different structures at {where}")
            return {k: merge([v[k] for v in values], f"{where}.{k}") for k in first}
        if isinstance(first, (list, tuple)):
            if any(not isinstance(v, (list, tuple)) or len(v) != len(first) for v in values):
                raise RuntimeError(f"{what}: the ranks measured different structures at {where} "
                                   f"(lengths {[len(v) for v in values]})")
            return type(first)(merge([v[i] for v in values], f"{where}[{i}]") for i in range(len(first)))
        if isinstance(first, str):
            if any(v != first for v in values):
                raise RuntimeError(f"{what}: the ranks measured different values at {where}: {values}")
            return first
        return max(values)

    return merge(every, "profile")


def _timings(model, sizes, forward_loss, probe, names, device, steps: int) -> list[tuple]:
    """Per micro-batch size: (tokens, forward s, backward s, per unit forward s, per unit
    backward s), medians of `steps` steps."""
    out = []
    for b in sizes:
        rows = []
        for _ in range(steps):
            probe.reset()
            fwd, bwd, _, t_bwd_end, _ = _run_step(model, b, forward_loss, probe, device)
            starts = [probe.bwd_start.get(n) for n in names]
            bwd_units = []
            for i in range(len(names)):
                if starts[i] is None:
                    bwd_units.append(0.0)
                    continue
                end = next((starts[j] for j in range(i - 1, -1, -1) if starts[j] is not None), t_bwd_end)
                bwd_units.append(max(0.0, end - starts[i]))
            rows.append((fwd, bwd, [probe.fwd_s[n] for n in names], bwd_units))
        med = statistics.median
        out.append((b.numel(), med(r[0] for r in rows), med(r[1] for r in rows),
                    [med(r[2][i] for r in rows) for i in range(len(names))],
                    [med(r[3][i] for r in rows) for i in range(len(names))]))
    return out


def _window_peaks(model, batch, forward_loss, modules, layers_of, names, device) -> tuple[list[int], list[int]]:
    """Each unit's backward window peak in a step without, then with, every decoder layer
    recomputed (`backward_window_peaks`), in `names` order."""
    plain = backward_window_peaks(modules, lambda: _run_step(model, batch, forward_loss, None, device), device)
    for m in layers_of.values():
        set_recompute(m, True)
    try:
        rec = backward_window_peaks(modules, lambda: _run_step(model, batch, forward_loss, None, device), device)
    finally:
        for m in layers_of.values():
            set_recompute(m, False)
    return [plain.get(n, 0) for n in names], [rec.get(n, 0) for n in names]
