"""A `Profile` measured from warm-up steps of the real model under its elastic runtime.

    profile = measure_profile(model, batches, capacity_bytes=..., memory_bytes=...)   # on every rank

What is measured, per unit of the runtime (a decoder layer, or a weight that is its own unit),
in forward order:
- forward and backward compute time: module hooks time the unit's forward; a hook on the
  gradient of the unit's output marks the start of its backward, whose end is the start of the
  previous unit's backward (or the end of the whole backward). Only units whose every chunk is
  resident are timed, so no gather is in the times ([Note: profiling within a memory bound]);
  a quantized weight's per-use dequantization is, and is timed apart as well ([Note: timing
  the dequantization]).
  With two micro-batch sizes (the batch and its first half) the time is fitted as fixed +
  per-token; with one, fixed is 0.
- activation bytes per token: `saved_tensors_hooks` count the bytes each unit's forward saves
  for backward (storages counted once, parameters and the pool's pages never), and the bytes
  of its input (what a recomputed unit keeps);
- the all-gather and all-reduce links: timed collectives on the runtime's group at two sizes
  (a chunk's slice and a unit's worth of slices; the adapter gradients and a small buffer),
  median of 5 each, fitted as latency + bytes / bandwidth; the device copy link (a gather's
  pack and unpack run on the communication stream: [Note: the time model] in
  python_api/planner/cost.py) from timed device-to-device copies at the same two sizes;
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
  offload would move, read in a step from the tensors ElasticLoRAFunction hands to
  `save_for_backward` as activations (lora_x, xa, mask: their bytes in order, exactly what
  `ActivationOffload.offload` copies) with the weight whose linear saved each, and what that
  frees on the device: the storages that nothing but those activations saves (counted by the
  same saved-tensor hooks);
- quantized weights (ElasticPolicy.weight_format): the format, and per weight the seconds one
  use spends dequantizing it (`WeightProfile.dequant_s`), timed apart by the call its layer
  makes, on this device with the impl in force; each unit's times are stored net of its uses'
  dequantization, which the cost model adds back per use ([Note: timing the
  dequantization]); the dequant workspace's bytes are static;
Every rank measures; every timing and every byte count is then reduced with MAX across the
group (the slowest rank sets the pace, the largest count bounds memory), so every rank holds
the same profile and computes the same plan. The steps run with activation offload off and
prefetch depth 0 (restored after), and without the adapters' gradient all-reduce (`no_sync`:
it would fall into the first unit's backward window, with the ranks' skew, and is timed on
its own as the allreduce link).

[Note: timing the dequantization]
Each use of a quantized weight dequantizes all its chunks, whatever the residency, so the
units' timed windows (resident units, hooks around the unit) already hold their uses'
dequantization: in forward every weight, in backward those with a backward use. It is timed
apart, once per distinct (shape, chunking, format, weight and compute dtype, call pattern):
- on blobs quantized from normal random values of the weight's own shape (the kernels have
  no data-dependent branch; normal values give normal fp32 scales, so no denormal slows the
  CPU kernel); the blobs of one weight live only while it is timed;
- by the very call the layer makes (python_api/quant/workspace.py `dequantize_use`, with the
  impl in force on this device): one call over every chunk for a LoRA linear, one per chunk
  for a plain ElasticLinear (which computes chunk by chunk), into the runtime's workspace
  (grown to the largest weight by the profiling steps already: nothing is allocated), in the
  dtype the layer computes in (`op_dtype` of its input under the caller's autocast, recorded
  by the probe). That call is what a use pays: on CPU, for the tests' 64-wide weights of 13
  chunks, its Python work (formats, views, the split) is 4-8x the C++ kernel's time;
- as n back-to-back uses per window of about 0.2 ms, one sync per window (on a GPU the uses
  queue on the stream as the layers' do; a short window is seldom cut by the scheduler of a
  loaded host), the median of 9 windows, then the MAX over the ranks like every timing.
The unit's fit is stored net of it ([Note: dequantization in the time model] in
python_api/planner/cost.py): the forward dequant comes off fwd_s_fixed, the backward one off
bwd_s_fixed, and where a fixed part is smaller (the two-point fit is noisy) the rest comes off
the per-token part at the profiled micro-batch, so that the unit's time there, the dequant
added back, is what was measured (only a unit measured faster than its dequant alone, clamped
at 0, would differ). Timed apart, the dequant sees warm caches and no GEMM between calls, so
it may differ a little from the in-layer run; tests/quant/test_planner_quant.py checks it
against an independent timing of the same call on the same shapes.

[Note: profiling within a memory bound]
Profiling must fit where the plan must fit: a model whose frozen weights exceed the device
(70B on 8 x 40 GB, weights_on="host") cannot be made resident to be timed. `memory_bytes`
(default: capacity_bytes; on CUDA at most what the device has free plus what torch holds,
the MIN over the ranks) bounds every step profiling runs, by the memory model itself:
 1. a streamed step (nothing kept, prefetch depth 0: the least memory the runtime runs this
    micro-batch in without recompute) learns the order; a second measures every byte count
    (they do not depend on residency) and a third and fourth the backward windows' peaks
    with and without recompute, which give a conservative workspace (gather buffers are in
    those windows); if the memory model says even this exceeds the bound, profiling stops
    with an error naming both;
 2. rounds: units are grouped by what determines their time (weights' layouts, activation
    bytes, recomputable); a round keeps resident one unit of every group not yet timed,
    then more units, in forward order, while memory_curve of that residency (prefetch 0,
    the profile's micro-batch) stays within memory_bytes x (1 - 0.05) (the planner's default
    margin); its resident units are timed (a warm-up step fills them, then `steps` steps at
    each size) and its windows' peaks, now buffer-free, refit the workspace. With prefetch
    depth 0 a streamed unit's gathers are issued and waited inside its own timing window, so
    they never fall into a resident unit's or the outside's time;
 3. a unit not timed takes its group's median fit (decoder layers of one model are one or
    two groups: the first layer's q/k/v have no backward use). A unit too large to be
    resident alone within the bound is timed streamed, gathers included, with a warning.
With `memory_bytes` at least what keeping everything needs, this is one round with every
unit resident and timed (the profile of before). `report` (a dict) receives the rounds
(units resident and timed, predicted peak), the bound, the streamed step's predicted peak and
this rank's own byte counts before the MAX, and the units' measured (fwd fixed, fwd per token,
bwd fixed, bwd per token) before the dequantization is taken out, at `tokens` per micro-batch,
for tests and logs.

Side effects: the warm-up and timed steps run forward and backward (dropout draws random
numbers; adapter gradients are cleared before and after); residency, the pool budget and
the prefetch depth are restored at the end, and the chunks profiling made resident are
dropped (the pool's arena only shrinks by whole empty segments).
"""

from __future__ import annotations

import contextlib
import dataclasses
import statistics
import warnings

import torch
import torch.nn as nn

from ..host.offload import observe_activations
from ..nn.convert import runtime_of
from ..planner.profile import Link, Profile
from ..runtime import Phase
from .layer_reuse import ReuseUnsupported, all_layers_requested, expand, full_order, layer_classes, truncated
from .links import _fit_link, _link_measurements
from .profile_fit import _dequant_times, _net_of, _profile_of, _unit_fit, _with_workspace
from .rounds import _choose_round, _group_key, _residency_peak
from .step_probe import (
    _hf_loss,
    _max_over_ranks,
    _run_step,
    _static_bytes,
    _StepProbe,
    _timings,
    _unit_modules,
    _window_peaks,
)

_PROFILE_MARGIN = 0.05  # the planner's default margin, kept below the bound when choosing a round


class ProfileBoundError(ValueError):
    """The profiling bound is below what streaming every weight needs at the micro-batch given
    (the memory model's figure, the same on every rank): profile a smaller micro-batch.
    `needed_bytes` is that figure, `bound_bytes` the bound (optional arguments: unpickling
    calls the class with the message alone, then restores them)."""

    def __init__(self, message: str, needed_bytes: int | None = None, bound_bytes: int | None = None,
                 least_bytes: int | None = None):
        super().__init__(message)
        self.needed_bytes, self.bound_bytes, self.least_bytes = needed_bytes, bound_bytes, least_bytes


# [Note: refusing a cap before profiling]
# A --memory-cap too small for any plan was found only by profiling: each try measured a few
# steps at a micro-batch, found streaming did not fit, and halved it, down to one sequence (85 s
# on the real model before the refusal, issue 31). Two checks end it early, each with the
# memory model's own terms, so neither refuses a cap some plan fits:
# 1. before any step: the tensors alive at a step's start (`_static_bytes`: shards, replicated
#    tensors, trainable parameters with gradient and AdamW's two states, the dequant workspace)
#    are in every plan's peak, whatever it keeps or recomputes; a bound below them is refused
#    at once (ProfileBelowTensorsError, `needed_bytes` that figure). It is a lower bound of the
#    least plan, not the least plan: activations and gather buffers need a step to be measured;
# 2. after the first byte-count step: ProfileBoundError carries `least_bytes`, the model's peak
#    of profiling itself at one sequence (every weight streamed), which the per-token figures
#    give without another step; a cap below it is refused naming it, not profiled again at
#    smaller micro-batches. It is the least cap a planned run can start with: the least plan
#    (one sequence, every layer recomputed) can need less, but it must be profiled first (the
#    tiny model of tests/planner/test_cap_refusal.py: 525 KB for that plan, 565 KB to profile).


class ProfileBelowTensorsError(ProfileBoundError):
    """The bound is below the model's own tensors ([Note: refusing a cap before profiling]):
    no micro-batch helps. `needed_bytes`: those tensors' bytes (MAX over ranks)."""


def measure_profile(model: nn.Module, batches: list[torch.Tensor], *, forward_loss=None,
                    capacity_bytes: int | None = None, memory_bytes: int | None = None, steps: int = 2,
                    host_tier: bool | None = None, report: dict | None = None,
                    all_layers: bool | None = None) -> Profile:
    """Measure a `Profile` of `model` (under convert_to_elastic / elasticize) on `batches`
    (at least one micro-batch of input ids [B, T]). A collective: call on every rank alike.
    `memory_bytes`: the bound every profiling step stays within, per rank ([Note: profiling
    within a memory bound]; None: capacity_bytes, on CUDA at most what is free now).
    `host_tier`: measure the host tier's fields (None: when the runtime has a host store or
    its policy offloads activations). `report`: a dict that receives the rounds.
    `all_layers`: profile every layer of a list of identical layers (None: the env
    ELASTIC_PROFILE_ALL_LAYERS, default no: one class of identical layers is profiled on a
    few representatives, [Note: profiling identical layers once] in layer_reuse.py)."""
    if not batches:
        raise ValueError("measure_profile: give at least one micro-batch")
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(f"measure_profile: steps must be an int >= 1, got {steps!r}")
    if memory_bytes is not None and (isinstance(memory_bytes, bool) or not isinstance(memory_bytes, int)
                                     or memory_bytes <= 0):
        raise ValueError(f"measure_profile: memory_bytes must be a positive int or None, got {memory_bytes!r}")
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
        capacity, reserved, total = int(capacity_bytes), 0, None
    # The model's peak counts the memory not ours (reserved) too, so the device's total is the
    # physical limit of a step ([Note: what the memory model counts]).
    bound = capacity if memory_bytes is None else memory_bytes
    if total is not None:
        bound = min(bound, int(total))
    bound = -_max_over_ranks(-bound, rt, "measure_profile: the memory bound")  # the MIN over the ranks
    # See [Note: refusing a cap before profiling]: the tensors alive before any step, counted
    # as the memory model counts them, are below every plan's peak.
    static = _max_over_ranks(_static_bytes(model.parameters(), model.buffers(), rt), rt,
                             "measure_profile: the model's tensors")
    if static > bound:
        raise ProfileBelowTensorsError(
            f"measure_profile: the model's own tensors need {static} bytes per rank (the shards of the frozen weights, "
            f"the replicated tensors, the adapters with their gradients and AdamW state), above the bound "
            f"{bound}; no plan fits, whatever is kept or recomputed", static, bound)

    # See [Note: profiling identical layers once] (layer_reuse.py).
    lists = [] if all_layers_requested(all_layers) else layer_classes(model, rt)
    if lists:
        # Every rank cuts the same layers (ranks whose models differ fail here, together).
        _max_over_ranks([list(lc.profiled) for lc in lists], rt, "measure_profile: the layers profiled")
        try:
            return _measure(model, rt, batch, forward_loss, capacity, reserved, bound, steps, host_tier, report,
                            lists)
        except ReuseUnsupported as exc:
            warnings.warn(f"measure_profile: profiling every layer: {exc}", stacklevel=2)
    return _measure(model, rt, batch, forward_loss, capacity, reserved, bound, steps, host_tier, report, [])


def _measure(model, rt, batch, forward_loss, capacity, reserved, bound, steps, host_tier, report, lists) -> Profile:
    """measure_profile's steps, on the model cut to the representatives of `lists` (none:
    the whole model), and the whole model's profile."""
    device = rt.device
    params = list(model.parameters())  # the whole model's, before any cut
    buffers = list(model.buffers())
    adapter_grad = sum(p.numel() * p.element_size() for p in params if p.requires_grad)
    cut = truncated(lists, rt) if lists else contextlib.nullcontext()
    order = None  # the whole model's units in forward order, when cut
    saved = [(et, et.keep_chunks, et.persist_chunks) for et in rt.tensors]
    budget = rt.cache_budget
    depth = rt.policy.prefetch_depth
    was_training = model.training
    if host_tier is None:
        host_tier = rt.host_store is not None or rt.policy.offload_activations
    host_tier = host_tier or rt.policy.weights_on == "host"
    offload_was = rt.policy.offload_activations
    tokens = batch.numel()
    B = int(batch.shape[0])
    sizes = [batch] + ([batch[: B // 2]] if B >= 2 else [])
    rounds: list[dict] = []
    model.train()
    # The adapters' gradient all-reduce at the end of backward would fall into the first unit's
    # backward window (with the ranks' skew); it is timed on its own (the allreduce link) and
    # the steps here drop their gradients anyway.
    no_sync = rt.no_sync()
    no_sync.__enter__()
    cutting = contextlib.ExitStack()  # the cut model, closed before anything is restored
    try:
        cutting.enter_context(cut)
        if offload_was:
            rt.set_offload_activations(False)  # every step below saves its activations on the device
        rt.set_prefetch_depth(0)  # a streamed unit's gathers stay inside its own timing window
        for et in rt.tensors:
            rt.set_residency(et, 0, 0)
        rt.set_pool_budget(0)
        try:
            _run_step(model, batch, forward_loss, None, device)  # learns the order, streams everything
        except Exception as exc:
            if lists:  # the model's own loop does not take the cut list: profile it whole
                raise ReuseUnsupported(f"the first step of the model cut to {[lc.profiled for lc in lists]} raised "
                                       f"{type(exc).__name__}: {exc}") from exc
            raise
        names, modules = _unit_modules(model, rt)
        if lists:
            order = full_order(names, lists)
        probe = _StepProbe(model, modules, device)
        try:
            # 1. Byte counts (the same at every residency), read from one step.
            probe.reset()
            with observe_activations(probe.record_activations):
                _run_step(model, batch, forward_loss, probe, device)
            backward_wids = set(rt.learned_order(Phase.BACKWARD) or ())
            forward_order = {wid: k for k, wid in enumerate(rt.learned_order(Phase.FORWARD))}
            measured = {
                "act": [probe.saved[n] for n in names], "input": [probe.input_bytes[n] for n in names],
                "outside": probe.saved_outside, "freed": [probe.freed()[n] for n in names],
                "offload": [list(probe.offl[n]) for n in names], "static": _static_bytes(params, buffers, rt),
                "reserved": max(0, reserved),
            }
            owners = [list(probe.offl_owner[n]) for n in names]
            layers_of = {n: m for n, m in modules.items() if not n.startswith("weight:")}
            # A conservative workspace first: streamed windows hold gather buffers too.
            measured["window0"], measured["rwindow0"] = _window_peaks(model, batch, forward_loss, modules, layers_of,
                                                                     names, device)
            local_bytes = {k: v for k, v in measured.items() if k in ("act", "input", "outside", "freed", "static")}
            measured = _max_over_ranks(measured, rt, "measure_profile: the measured bytes")
            weights_of = {u: sorted((et for et in rt.tensors if et.unit == u), key=lambda et: forward_order.get(et.wid, 0))
                          for u in names}
            prelim = _profile_of(rt, names, weights_of, backward_wids, measured, owners, tokens, batch, model,
                                 capacity, host_tier, adapter_grad)
            prelim = _with_workspace(prelim, dict(zip(names, measured["window0"])),
                                     dict(zip(names, measured["rwindow0"])), B)
            limit = int(bound * (1.0 - _PROFILE_MARGIN))
            # The bound is the whole model's: its streamed step, not the cut one's.
            whole = expand(prelim, lists, order, prelim.static_bytes, adapter_grad, rt) if lists else prelim
            least = _residency_peak(whole, [], B)
            if least > bound:
                # What profiling needs at one sequence (streamed, as here), by the same model: a
                # caller need not try smaller micro-batches under a bound below it.
                least_one = _residency_peak(whole, [], 1)
                raise ProfileBoundError(
                    f"measure_profile: streaming every weight at this micro-batch ({B} x {batch.shape[1]} tokens) "
                    f"needs {least} bytes per rank by the memory model, above the profiling bound memory_bytes = "
                    f"{bound}: profile with a smaller micro-batch, or give more memory", least, bound, least_one)
            # 2. Rounds of resident units, timed.
            fits: dict[int, tuple] = {}  # unit -> (fwd fixed, fwd per token, bwd fixed, bwd per token)
            outside = None
            workspace_peaks, recompute_peaks = {}, {}
            untimed = list(range(len(names)))
            local = rt.world_size == 1 and rt.policy.weights_on == "device" and not rt._force_pool
            while untimed:
                # At world size 1 with the weights on the device nothing is gathered at all.
                resident = list(range(len(names))) if local else _choose_round(prelim, limit, B, untimed)
                timed = [i for i in resident if i in untimed]
                streamed = False
                if not timed:  # nothing untimed fits resident even alone: time it streamed
                    timed, streamed = [untimed[0]], True
                    warnings.warn(f"measure_profile: unit {names[untimed[0]]} does not fit resident within "
                                  f"memory_bytes = {bound}; its times include its gathers", stacklevel=2)
                keep_units = set(resident)
                index = {n: i for i, n in enumerate(names)}  # the layers cut away: -1, streamed (unused)
                for et in rt.tensors:
                    n = et.num_chunks if index.get(et.unit, -1) in keep_units else 0
                    rt.set_residency(et, n, n)
                rt.set_pool_budget(rt.page_bytes() * sum(et.num_chunks for et in rt.tensors
                                                         if index.get(et.unit, -1) in keep_units))
                _run_step(model, batch, forward_loss, None, device)  # fills the resident units
                per_size = _timings(model, sizes, forward_loss, probe, names, device, steps)
                for i in timed:
                    fits[i] = _unit_fit(per_size, i)
                if outside is None:
                    t0, fwd, bwd, fu, bu = per_size[0]
                    outside = (max(0.0, fwd - sum(fu)) / t0, max(0.0, bwd - sum(bu)) / t0)
                if not streamed:
                    w, r = _window_peaks(model, batch, forward_loss, modules, layers_of, names, device)
                    for i in resident:
                        workspace_peaks[names[i]], recompute_peaks[names[i]] = w[i], r[i]
                rounds.append({"resident": [names[i] for i in resident], "timed": [names[i] for i in timed],
                               "predicted_peak_bytes": _residency_peak(prelim, resident, B),
                               "predicted_recompute_peak_bytes": _residency_peak(prelim, resident, B, True)})
                untimed = [i for i in untimed if i not in timed]
                # A unit of a timed group needs no round of its own: its group's median serves it.
                done = {_group_key(prelim.layers[i]) for i in fits}
                untimed = [i for i in untimed if _group_key(prelim.layers[i]) not in done]
        finally:
            probe.close()
    except BaseException:
        # The step that failed may have left the runtime inside a phase, where residency cannot
        # change: restore what can be, and let the original error through.
        with contextlib.suppress(Exception):
            cutting.close()
            _restore(rt, model, saved, budget, depth, offload_was, was_training)
        raise
    finally:
        cutting.close()
        no_sync.__exit__(None, None, None)
    _restore(rt, model, saved, budget, depth, offload_was, was_training)

    # 3. Every unit's fit: its own, else its group's median; timings MAX over the ranks.
    by_group: dict = {}
    for i, f in fits.items():
        by_group.setdefault(_group_key(prelim.layers[i]), []).append(f)
    timings = {"units": [list(fits.get(i) or tuple(statistics.median(f[k] for f in by_group[_group_key(prelim.layers[i])])
                                                     for k in range(4))) for i in range(len(names))],
               "outside": list(outside),
               "links": _link_measurements(rt, prelim, names, host_tier),
               "peaks": [workspace_peaks.get(n, 0) for n in names], "rpeaks": [recompute_peaks.get(n, 0) for n in names],
               "dequant": _dequant_times(model, rt, probe.op_dtypes,
                                         {w.name for layer in prelim.layers for w in layer.weights})}
    timings = _max_over_ranks(timings, rt, "measure_profile: the timings")
    dequant = timings["dequant"]
    layers = []
    for layer, u in zip(prelim.layers, timings["units"]):
        weights = tuple(dataclasses.replace(w, dequant_s=dequant.get(w.name, 0.0)) for w in layer.weights)
        dq = dataclasses.replace(layer, weights=weights)  # its dequant_fwd_s / dequant_bwd_s
        ff, fp = _net_of(u[0], u[1], dq.dequant_fwd_s, tokens)
        bf, bp = _net_of(u[2], u[3], dq.dequant_bwd_s, tokens)
        layers.append(dataclasses.replace(dq, fwd_s_fixed=ff, fwd_s_per_token=fp, bwd_s_fixed=bf, bwd_s_per_token=bp))
    layers = tuple(layers)
    links = timings["links"]
    profile = dataclasses.replace(
        prelim, layers=layers,
        outside=dataclasses.replace(prelim.outside, fwd_s_per_token=timings["outside"][0],
                                    bwd_s_per_token=timings["outside"][1], workspace_bytes_per_token=0.0,
                                    recompute_workspace_bytes_per_token=0.0),
        allgather=_fit_link(links["allgather"]) if rt.world_size > 1 else Link(0.0, 1e18),
        allreduce=_fit_link(links["allreduce"]) if rt.world_size > 1 else Link(0.0, 1e18),
        copy=_fit_link(links["copy"]), h2d=_fit_link(links["h2d"]) if host_tier else None)
    profile = _with_workspace(profile, {n: p for n, p in zip(names, timings["peaks"]) if n in workspace_peaks},
                              {n: p for n, p in zip(names, timings["rpeaks"]) if n in recompute_peaks}, B)
    if lists:  # See [Note: profiling identical layers once] (layer_reuse.py)
        profile = expand(profile, lists, order, profile.static_bytes, adapter_grad, rt)
    if report is not None:
        report.update(bound_bytes=bound, rounds=rounds, least_bytes=least, local_bytes=local_bytes,
                      unit_times=[tuple(u) for u in timings["units"]], tokens=tokens, profiled_units=list(names),
                      layer_classes=[[list(c) for c in lc.classes] for lc in lists])
    return profile


def _restore(rt, model, saved, budget, depth, offload_was, was_training) -> None:
    """Residency, budget, prefetch depth, offload and training mode as they were before
    profiling; the chunks profiling made resident dropped (the pool's arena only shrinks by
    whole empty segments, and the plan sizes the pool from nothing)."""
    if offload_was:
        rt.set_offload_activations(True)
    rt.set_prefetch_depth(depth)
    for et, k, p in saved:
        rt.set_residency(et, k, p)
        rt.drop_cached(et)
    rt.set_pool_budget(budget)
    model.train(was_training)


