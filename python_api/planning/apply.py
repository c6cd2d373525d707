"""A plan meets a model: `plan(model, profile, ...)` and `apply_plan(model, plan)`.

`apply_plan` makes the runtime do exactly what the plan says, so the plan's predicted traffic
is the measured traffic:
- per weight, `keep_chunks` / `persist_chunks` become its residency (`set_residency`: the first
  chunks PERSISTENT, then PEAK, the rest TRANSIENT; chunks no longer PERSISTENT are released
  at once, so the very next step gathers what the plan predicts);
- the pool's cache budget becomes the plan's (every kept chunk fits: nothing kept is evicted);
- the layers the plan recomputes run under activation checkpointing (non-reentrant, which
  keeps their PEAK chunks: [Note: recompute inside backward] in python_api/runtime/), the
  others do not. Hugging Face decoder layers (`GradientCheckpointingLayer`) are switched
  through their own flag; any other unit module gets its forward wrapped.
- the host tier: `host_fraction` through `set_host_fraction` (the runtime must have its host
  store: it was wrapped with weights_on="host" or host_fraction > 0; with weights_on="host"
  only 1), activation offload through `set_offload_activations`; with offload on, the
  offloader's free host buffers are trimmed so its pool serves the plan's shapes from empty,
  as the memory model assumes ([Note: activation offload in the memory model]).
The micro-batch size and the accumulation count are the training loop's to follow
(`plan.micro_batch`, `plan.accumulation`).

Every rank must apply the same plan: `apply_plan` checks that with one collective (a digest of
the plan's JSON) and fails on every rank, naming the ranks, if they differ.
"""

from __future__ import annotations

import functools

import torch
import torch.nn as nn
import torch.utils.checkpoint

from ..distributed.agree import digest, exchange
from ..nn.convert import runtime_of
from ..planner.plan import format_name
from ..planner.profile import WeightFormat
from ..planner.search import plan_from_profile

_WRAPPED = "_elastic_recompute_forward"


def _checkpoint_fn():
    return functools.partial(torch.utils.checkpoint.checkpoint, use_reentrant=False)


def set_recompute(module: nn.Module, on: bool) -> None:
    """Activation checkpointing of one unit module, on or off."""
    try:
        from transformers.modeling_layers import GradientCheckpointingLayer
    except ImportError:  # older transformers: the generic path below
        GradientCheckpointingLayer = ()  # noqa: N806
    if GradientCheckpointingLayer and isinstance(module, GradientCheckpointingLayer):
        module.gradient_checkpointing = on
        if on:
            module._gradient_checkpointing_func = _checkpoint_fn()
        return
    wrapped = module.__dict__.get(_WRAPPED)
    if on and wrapped is None:
        inner = module.forward

        def forward(*args, **kwargs):
            if module.training and torch.is_grad_enabled():
                return torch.utils.checkpoint.checkpoint(inner, *args, use_reentrant=False, **kwargs)
            return inner(*args, **kwargs)

        module.__dict__[_WRAPPED] = inner
        module.forward = forward
    elif not on and wrapped is not None:
        del module.__dict__[_WRAPPED]
        del module.forward  # back to the class's forward


def recomputes(module: nn.Module) -> bool:
    """Whether `apply_plan` left this unit module under activation checkpointing."""
    if _WRAPPED in module.__dict__:
        return True
    return bool(getattr(module, "gradient_checkpointing", False)) and callable(
        getattr(module, "_gradient_checkpointing_func", None))


def _module_of_unit(model: nn.Module, unit: str) -> nn.Module:
    path = unit[len("weight:"):] if unit.startswith("weight:") else unit
    return model.get_submodule(path)


def _check_ranks_apply_the_same(rt, plan) -> None:
    if rt.world_size == 1:
        return
    # planning_seconds is a timing, the one field ranks may differ in without harm.
    doc = {k: v for k, v in plan.to_dict().items() if k != "planning_seconds"}
    every = exchange(digest(doc), rt.group, timeout_s=rt.policy.collective_timeout_s, what="apply_plan")
    differ = [r for r, d in enumerate(every) if d != every[0]]
    if differ:
        raise ValueError(
            f"apply_plan: the ranks were given different plans (digest {every[0]} on rank 0, "
            f"{[every[r] for r in differ]} on rank(s) {differ}); every rank must apply the same plan "
            "(plan from the same profile, or broadcast rank 0's)"
        )


def check_plan_matches(model: nn.Module, plan) -> None:
    """The plan names exactly this model's elastic weights, with their chunk counts, and was
    made for the format they are stored in (the user's choice: a plan never changes it, and
    one made for another format predicts other bytes and times)."""
    rt = runtime_of(model)
    if plan.world_size != rt.world_size:
        raise ValueError(f"apply_plan: the plan is for {plan.world_size} ranks, the runtime has {rt.world_size}")
    fmt = WeightFormat.of_policy(rt.policy)
    if plan.weight_format != fmt:
        raise ValueError(f"apply_plan: the plan is for weights stored {format_name(plan.weight_format)}, this model's "
                         f"are stored {format_name(fmt)} (ElasticPolicy.weight_format): the planner never changes "
                         "the format; plan from a profile of this model")
    mine = {et.name: et for et in rt.tensors}
    planned = {}
    for layer in plan.layers:
        for w in layer.weights:
            planned[w.name] = (layer, w)
    missing = sorted(set(mine) - set(planned))
    extra = sorted(set(planned) - set(mine))
    if missing or extra:
        raise ValueError(f"apply_plan: the plan does not match the model's elastic weights: "
                         f"not in the plan {missing[:5]}, not in the model {extra[:5]}")
    for name, (layer, w) in planned.items():
        et = mine[name]
        if w.chunks != et.num_chunks:
            raise ValueError(f"apply_plan: {name} has {et.num_chunks} chunks, the plan says {w.chunks} "
                             "(another chunk size or world size?)")
        if et.unit != layer.name:
            raise ValueError(f"apply_plan: {name} belongs to unit {et.unit!r}, the plan puts it in {layer.name!r}")
    f = plan.host_fraction
    if f > 0 and rt.host_store is None and not (rt.world_size == 1 and rt.policy.weights_on == "device"):
        raise ValueError(f"apply_plan: the plan fetches {100 * f:.0f}% of missing chunks from the host store, but this "
                         "runtime has no host store: wrap the model with ElasticPolicy(host_fraction > 0) or "
                         "weights_on='host' so it builds one")
    if rt.policy.weights_on == "host" and f != 1.0:
        raise ValueError(f"apply_plan: the plan has host_fraction {f}, but the runtime has weights_on='host' (no device "
                         "shard): every chunk comes from the host store, host_fraction must be 1")


def apply_plan(model: nn.Module, plan) -> None:
    """Make the runtime follow `plan` (see the module docstring). Between steps, on every rank."""
    rt = runtime_of(model)
    check_plan_matches(model, plan)
    _check_ranks_apply_the_same(rt, plan)
    by_name = {et.name: et for et in rt.tensors}
    for layer in plan.layers:
        if layer.recompute and layer.name.startswith("weight:"):
            raise ValueError(f"apply_plan: {layer.name} is a single weight, not a layer: it cannot be recomputed")
    for layer in plan.layers:
        for w in layer.weights:
            rt.set_residency(by_name[w.name], w.keep_chunks, w.persist_chunks)
    rt.set_prefetch_depth(plan.prefetch_depth)
    rt.set_pool_budget(plan.pool_budget_bytes)
    if rt.host_store is not None:
        rt.set_host_fraction(plan.host_fraction)
    rt.set_offload_activations(plan.offload_activations)
    offloader = getattr(rt, "activation_offload", None)
    if plan.offload_activations and offloader is not None:
        offloader.trim()
    for layer in plan.layers:
        if not layer.name.startswith("weight:"):
            set_recompute(_module_of_unit(model, layer.name), layer.recompute)
    object.__setattr__(model, "_elastic_plan", plan)


def plan(model: nn.Module, profile, memory_bytes: int, global_batch: int, **kwargs):
    """Plan for `model` from `profile` (measured on this model, or written for it): the
    planner's choice under `memory_bytes` per rank for `global_batch` sequences per optimizer
    step (all ranks together). Keyword arguments go to `plan_from_profile`."""
    runtime_of(model)  # a model under the runtime, or a clear error
    kwargs.setdefault("prefetch_depth", None)  # searched: PREFETCH_DEPTHS
    result = plan_from_profile(profile, memory_bytes, global_batch, **kwargs)
    check_plan_matches(model, result)
    return result
