"""Profiling identical layers once: the layer classes of a model, the model truncated to one
or a few layers of each class for profiling, and the profile of the whole model rebuilt from
the truncated one's.

[Note: profiling identical layers once]
A profile's figures of a decoder layer are a function of what the layer is (its modules,
their frozen weights' shapes, formats and chunk layouts, the adapters' shapes, the modules'
settings) and of where it sits (the first layer of a model whose embeddings are frozen has
q/k/v without a backward use). Every timing step of `measure_profile` runs the whole model, so
a model of 30 identical decoder layers paid for 30 where 2-3 tell the same (issue 31:
profiling SmolLM2-135M took 142.5 s, of which the layers' forward and backward were most).
So, before any step:
 1. the repeated layers: an `nn.ModuleList` whose every child is a unit of the runtime (the HF
    decoder layers: `model.model.layers`), at least 3 of them, and every frozen weight under
    a child belonging to that child's unit;
 2. its classes: children with equal signatures (`layer_signature`: per submodule, its path
    in the layer, its class and its plain settings (numbers, strings, None; `layer_idx` and
    private fields left out, the layer's own path in a string replaced); per parameter and
    buffer, path, shape, dtype and requires_grad; per frozen weight, path, shape, dtypes,
    chunk layout, quantized layout and which chunks come from the host). The first child is
    a class of its own (its position: its input comes from outside the list);
 3. the representatives: the first `per_class` children of each class (default 2, whose
    times are averaged); the list keeps only them while profiling (its `_modules` is cut to
    their keys, so `get_submodule` still finds them by their own names and the model's loop
    over the list runs them alone), and the runtime's learned orders are put back after (the
    cut steps' orders are not the whole model's: the first step after profiling learns them,
    without prefetch, as a first step does; whole-model profiling used to leave them learned);
 4. the profile of the truncated model is measured as any other, then rebuilt for the whole
    model (`expand`): the units in forward order with the list's children in its place, each
    child a copy of its class (weights renamed), times the median of the representatives'
    fits, byte counts their MAX; the static bytes and the adapters' gradient bytes are the
    whole model's; the workspace per token, the outside, the links and the dequant times are
    the truncated model's (they do not depend on the number of layers).
The memory bound of [Note: profiling within a memory bound] is checked on the rebuilt profile
(the whole model's streamed step), so a cap is refused, or the micro-batch halved, exactly as
without reuse; the truncated steps themselves need less than the whole model's.
What the signature cannot see makes two layers differ without it knowing: a hook on one layer,
weights whose values change the time (none of the kernels branches on values). The env
ELASTIC_PROFILE_ALL_LAYERS=1 (or `measure_profile(..., all_layers=True)`) profiles every
layer, for a check; tests/planner/test_layer_reuse.py asserts the plans agree on a model with
repeated layers, and bench/results/2026-12-03_planner_real.md gives the real model's error.
A model whose loop does not follow the list (its forward order of the truncated model is not
the representatives in the list's order, or its first step raises) is profiled whole, with a
warning naming why.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
import statistics

import torch.nn as nn

from ..planner.profile import LayerProfile, Profile

ALL_LAYERS_ENV = "ELASTIC_PROFILE_ALL_LAYERS"
PER_CLASS = 2  # representatives profiled per class; their times are averaged (median)

_SCALARS = (bool, int, float, str, type(None))
_SKIPPED_ATTRS = {"layer_idx"}  # the layer's index: what makes identical layers differ by name only


class ReuseUnsupported(RuntimeError):
    """The model's steps do not follow the truncated list: profile every layer."""


def all_layers_requested(all_layers: bool | None) -> bool:
    """`all_layers` as given, else the env ELASTIC_PROFILE_ALL_LAYERS ("1", "true", "yes")."""
    if all_layers is not None:
        if not isinstance(all_layers, bool):
            raise ValueError(f"measure_profile: all_layers must be True, False or None, got {all_layers!r}")
        return all_layers
    value = os.environ.get(ALL_LAYERS_ENV, "").strip().lower()
    if value in ("", "0", "false", "no"):
        return False
    if value in ("1", "true", "yes"):
        return True
    raise ValueError(f"{ALL_LAYERS_ENV}={os.environ[ALL_LAYERS_ENV]!r}: give 1 (profile every layer) or 0")


def _plain(value, unit: str):
    if isinstance(value, str):
        return re.sub(re.escape(unit) + r"(?=\.|$)", "<unit>", value)
    if isinstance(value, float) and value != value:  # NaN: equal to itself for the signature
        return "nan"
    return value


def layer_signature(module: nn.Module, unit: str, tensors) -> tuple:
    """What a layer's profile figures are a function of, as far as its modules tell
    ([Note: profiling identical layers once]); `tensors`: the runtime's frozen weights of
    the unit."""
    parts: list[tuple] = []
    for rel, sub in module.named_modules():
        settings = tuple(sorted((k, _plain(v, unit)) for k, v in vars(sub).items()
                                if not k.startswith("_") and k not in _SKIPPED_ATTRS and isinstance(v, _SCALARS)))
        parts.append(("module", rel, type(sub).__module__, type(sub).__qualname__, settings))
    for rel, p in module.named_parameters():
        parts.append(("param", rel, tuple(p.shape), str(p.dtype), bool(p.requires_grad)))
    for rel, b in module.named_buffers():
        parts.append(("buffer", rel, tuple(b.shape), str(b.dtype)))
    for et in sorted(tensors, key=lambda t: t.name):
        q = et.qlayout
        parts.append(("frozen", et.name[len(unit):], et.shape, str(et.dtype), str(et.storage_dtype), repr(et.layout),
                      repr(et.storage) if q is not None else None,
                      None if q is None else (q.fmt, q.block_size, q.nested, q.rows_per_chunk),
                      tuple(et.from_host)))
    return tuple(parts)


@dataclasses.dataclass(frozen=True)
class LayerClasses:
    """The repeated layers of a model and their classes ([Note: profiling identical layers
    once]). `units`: the list's children as units, in the list's order; `classes`: each
    class's units in that order; `representatives`: those profiled (per class, its first
    `per_class`)."""

    path: str
    container: nn.ModuleList
    keys: tuple[str, ...]
    units: tuple[str, ...]
    classes: tuple[tuple[str, ...], ...]
    representatives: tuple[tuple[str, ...], ...]

    @property
    def profiled(self) -> tuple[str, ...]:
        """The representatives in the list's order."""
        chosen = {u for reps in self.representatives for u in reps}
        return tuple(u for u in self.units if u in chosen)

    def class_of(self, unit: str) -> int:
        return next(k for k, members in enumerate(self.classes) if unit in members)


def layer_classes(model: nn.Module, rt, per_class: int = PER_CLASS) -> list[LayerClasses]:
    """The lists of repeated layers of `model` that profiling can cut (each saves at least one
    layer), with their classes ([Note: profiling identical layers once])."""
    if isinstance(per_class, bool) or not isinstance(per_class, int) or per_class < 1:
        raise ValueError(f"layer_classes: per_class must be an int >= 1, got {per_class!r}")
    by_unit: dict[str, list] = {}
    for et in rt.tensors:
        by_unit.setdefault(et.unit, []).append(et)
    out = []
    for path, container in model.named_modules():
        if not isinstance(container, nn.ModuleList) or len(container) < 3:
            continue
        keys = tuple(container._modules)
        units = tuple(f"{path}.{k}" if path else k for k in keys)
        if not all(u in by_unit for u in units):
            continue
        # Every frozen weight under a child must be that child's (no finer units inside).
        owners = [next((u for u in units if et.name.startswith(u + ".")), None) for et in rt.tensors]
        if any(o is not None and et.unit != o for o, et in zip(owners, rt.tensors)):
            continue
        signatures: dict[tuple, list[str]] = {}
        first = units[0]
        for k, u in zip(keys, units):
            sig = ("first",) if u == first else layer_signature(container._modules[k], u, by_unit[u])
            signatures.setdefault(sig, []).append(u)
        classes = tuple(tuple(m) for m in signatures.values())
        reps = tuple(tuple(m[:per_class]) for m in classes)
        if sum(len(r) for r in reps) < len(units):
            out.append(LayerClasses(path, container, keys, units, classes, reps))
    return out


@contextlib.contextmanager
def truncated(lists: list[LayerClasses], rt):
    """The model with each list cut to its representatives (their own keys kept), and the
    runtime's learned orders as they were afterwards."""
    saved_orders = (dict(rt._order), dict(rt._segments))
    saved = []
    try:
        # Learned afresh from the cut model's steps: a pass that ends early (the cut list's
        # last layer, then no elastic weight) is not seen as a departure from an order learned
        # on the whole model, which would stay in force.
        for phase in rt._order:
            rt._order[phase] = rt._segments[phase] = None
        for lc in lists:
            modules = dict(lc.container._modules)
            saved.append((lc.container, modules))
            keep = {u for u in lc.profiled}
            lc.container._modules.clear()
            lc.container._modules.update({k: m for k, m, u in zip(lc.keys, modules.values(), lc.units) if u in keep})
        yield
    finally:
        for container, modules in saved:
            container._modules.clear()
            container._modules.update(modules)
        rt._order.clear()
        rt._order.update(saved_orders[0])
        rt._segments.clear()
        rt._segments.update(saved_orders[1])


def full_order(names: list[str], lists: list[LayerClasses]) -> list[str]:
    """The whole model's units in forward order from the truncated model's `names`: each
    list's representatives, which must appear together and in the list's order, replaced by
    all its children. Raises ReuseUnsupported otherwise."""
    out = list(names)
    for lc in lists:
        reps = list(lc.profiled)
        at = [i for i, n in enumerate(out) if n in lc.units]
        if [out[i] for i in at] != reps or at != list(range(at[0], at[0] + len(at))):
            raise ReuseUnsupported(f"the truncated {lc.path} ran its layers as {[out[i] for i in at]}, "
                                   f"not {reps} in a row")
        out[at[0]: at[-1] + 1] = list(lc.units)
    return out


def _renamed(layer: LayerProfile, src: str, dst: str) -> LayerProfile:
    def name(n: str) -> str:
        if not n.startswith(src + "."):
            raise ReuseUnsupported(f"weight {n} of {src} is not named under it")
        return dst + n[len(src):]
    return dataclasses.replace(
        layer, name=dst, weights=tuple(dataclasses.replace(w, name=name(w.name)) for w in layer.weights),
        offload_tensors_weight=tuple(name(n) for n in layer.offload_tensors_weight))


def _class_layer(reps: list[LayerProfile]) -> LayerProfile:
    """One layer standing for a class: the first representative with the median of the
    representatives' times and the MAX of their byte counts (identical when the signature is
    right)."""
    base = reps[0]
    med = statistics.median
    times = {k: med(getattr(r, k) for r in reps)
             for k in ("fwd_s_fixed", "fwd_s_per_token", "bwd_s_fixed", "bwd_s_per_token")}
    offl = base.offload_tensors_bytes_per_token
    if all(len(r.offload_tensors_bytes_per_token) == len(offl) for r in reps):
        offl = tuple(max(r.offload_tensors_bytes_per_token[j] for r in reps) for j in range(len(offl)))
    act = max(r.act_bytes_per_token for r in reps)
    return dataclasses.replace(
        base, **times, act_bytes_per_token=act,
        input_bytes_per_token=min(act, max(r.input_bytes_per_token for r in reps)),
        offload_tensors_bytes_per_token=offl,
        offload_freed_bytes_per_token=max(r.offload_freed_bytes_per_token for r in reps),
        recomputable=all(r.recomputable for r in reps))


def expand(profile: Profile, lists: list[LayerClasses], order: list[str], static_bytes: int,
           adapter_grad_bytes: int, rt) -> Profile:
    """The whole model's profile from the truncated model's `profile` ([Note: profiling
    identical layers once]): units in `order` (full_order), each list child its class's
    figures under its own name."""
    by_name = {layer.name: layer for layer in profile.layers}
    of_class: dict[tuple[int, int], LayerProfile] = {}
    member: dict[str, tuple[int, int]] = {}
    for j, lc in enumerate(lists):
        for k, reps in enumerate(lc.representatives):
            of_class[j, k] = _class_layer([_renamed(by_name[r], r, reps[0]) for r in reps])
            for u in lc.classes[k]:
                member[u] = (j, k)
    names = {et.name for et in rt.tensors}
    layers = []
    for u in order:
        if u in member:
            j, k = member[u]
            src = of_class[j, k]
            layer = _renamed(src, src.name, u)
            missing = [w.name for w in layer.weights if w.name not in names]
            if missing:
                raise ReuseUnsupported(f"{u} has no frozen weight(s) {missing} its class has")
            layers.append(layer)
        else:
            layers.append(by_name[u])
    return dataclasses.replace(profile, layers=tuple(layers), static_bytes=static_bytes,
                               adapter_grad_bytes=adapter_grad_bytes)
