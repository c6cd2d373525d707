"""From measurements to a `Profile` for measure_profile (measure.py): the dequantization
times ([Note: timing the dequantization] in measure.py), the per-unit fits of time (fixed +
per token, net of the dequantization), the backward workspaces fitted from the window peaks,
and the profile assembled."""

from __future__ import annotations

import dataclasses
import math
import statistics
import time

import torch
import torch.nn as nn

from elastic_kernels.quant import quantize_chunk

from ..nn.linear import ElasticLinear
from ..planner.memory import Choices, memory_curve
from ..planner.profile import LayerProfile, Link, OutsideProfile, Profile, WeightFormat, WeightProfile
from ..quant import dequantize_use
from .links import _fit, _sync, _timed


def _dequant_times(model: nn.Module, rt, op_dtypes: dict[str, torch.dtype], names: set[str]) -> dict[str, float]:
    """Per quantized weight of `names` (those profiled), the seconds one use spends
    dequantizing it ([Note: timing the dequantization]); {} when no weight is quantized."""
    per_chunk = {m.et.name for m in model.modules() if isinstance(m, ElasticLinear)}
    device, ws = rt.device, rt.dequant_workspace
    out: dict[str, float] = {}
    timed: dict[tuple, float] = {}
    for et in rt.tensors:
        q = et.qlayout
        if q is None or et.name not in names:
            continue
        dtype = op_dtypes.get(et.name, et.dtype)
        split = et.name in per_chunk
        key = (q.rows, q.cols, q.rows_per_chunk, q.fmt, q.block_size, q.nested, et.dtype, dtype, split)
        if key not in timed:
            gen = torch.Generator(device=device).manual_seed(0)
            blobs = [quantize_chunk(torch.randn(f.rows, f.cols, generator=gen, device=device).to(et.dtype), f)
                     for f in q.formats]
            if split:
                def use(blobs=blobs, q=q, dtype=dtype):
                    for c, b in enumerate(blobs):
                        dequantize_use(q, [b], dtype, ws, c)
            else:
                def use(blobs=blobs, q=q, dtype=dtype):
                    dequantize_use(q, blobs, dtype, ws)
            use()  # warm-up (a Triton kernel compiles on its first call)
            timed[key] = _timed_per_call(use, device)
            del blobs, use
        out[et.name] = timed[key]
    return out


def _timed_per_call(fn, device, window_s: float = 2e-4, repeats: int = 9) -> float:
    """Seconds per call of `fn`: the median over `repeats` windows of n back-to-back calls, one
    sync per window, n such that a window takes about `window_s` (at most 100 calls). A short
    call is then not dominated by the timer or the sync, and on a GPU the calls queue on the
    stream as the layers' do; a short window is seldom cut by the scheduler on a loaded host
    ([Note: timing the dequantization])."""
    one = _timed(fn, device)
    n = max(1, min(100, math.ceil(window_s / one))) if one > 0 else 100
    times = []
    for _ in range(repeats):
        _sync(device)
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        _sync(device)
        times.append((time.perf_counter() - t0) / n)
    return statistics.median(times)


def _net_of(fixed: float, per_token: float, dequant: float, tokens: int) -> tuple[float, float]:
    """A unit's (fixed, per-token) time less one use's dequantization ([Note: timing the
    dequantization]): off the fixed part, any rest off the per-token part at `tokens`."""
    if fixed >= dequant:
        return fixed - dequant, per_token
    return 0.0, max(0.0, per_token - (dequant - fixed) / tokens)


def _unit_fit(per_size: list[tuple], i: int) -> tuple[float, float, float, float]:
    """(fwd fixed, fwd per token, bwd fixed, bwd per token) of unit i from the sizes' times."""
    tokens, _, _, fu, bu = per_size[0]
    if len(per_size) == 2:
        t2 = per_size[1]
        return _fit(t2[0], t2[3][i], tokens, fu[i]) + _fit(t2[0], t2[4][i], tokens, bu[i])
    return (0.0, fu[i] / tokens, 0.0, bu[i] / tokens)


def _profile_of(rt, names, weights_of, backward_wids, measured, owners, tokens, batch, model, capacity,
                host_tier, adapter_grad: int) -> Profile:
    """The profile's byte fields from the (MAX-reduced) measurements; timings zero, links
    placeholders (filled by measure_profile)."""
    layers = []
    for i, u in enumerate(names):
        weights = tuple(
            WeightProfile(name=et.name, chunks=et.num_chunks, slice_bytes=et.slice_bytes,
                          chunk_bytes=et.page_bytes, backward=et.wid in backward_wids,
                          last_chunk_bytes=(None if et.chunk_bytes_of(et.num_chunks - 1) == et.page_bytes
                                            else et.chunk_bytes_of(et.num_chunks - 1)),
                          run_bytes=et.run_bytes if rt.can_hold_as_run(et) else None)
            for et in weights_of[u])
        recomputable = not u.startswith("weight:")
        a = measured["act"][i] / tokens
        x = measured["input"][i] / tokens
        offl = measured["offload"][i] if host_tier else []
        names_w = [w.name for w in weights]
        own = [o for o in owners[i]] if host_tier else []
        if own and (any(o not in names_w for o in own)
                    or any(names_w.index(b) < names_w.index(a_) for a_, b in zip(own, own[1:]))):
            own = []  # not in the weights' forward order: one linear per layer (LayerProfile)
        layers.append(LayerProfile(
            name=u, recomputable=recomputable and x <= a,
            fwd_s_fixed=0.0, fwd_s_per_token=0.0, bwd_s_fixed=0.0, bwd_s_per_token=0.0,
            act_bytes_per_token=a, input_bytes_per_token=min(x, a), weights=weights,
            offload_tensors_bytes_per_token=tuple(nb / tokens for nb in offl),
            offload_freed_bytes_per_token=measured["freed"][i] / tokens if host_tier else 0.0,
            offload_tensors_weight=tuple(own),
        ))
    placeholder = Link(0.0, 1e18)
    return Profile(
        source="measured", device=_device_name(rt.device), world_size=rt.world_size, seq_len=int(batch.shape[1]),
        capacity_bytes=capacity, reserved_bytes=measured["reserved"], static_bytes=measured["static"],
        page_bytes=rt.page_bytes(), adapter_grad_bytes=adapter_grad, allgather=placeholder, allreduce=placeholder,
        layers=tuple(layers),
        outside=OutsideProfile(fwd_s_per_token=0.0, bwd_s_per_token=0.0,
                               act_bytes_per_token=measured["outside"] / tokens,
                               peak_bytes_per_token=_logits_bytes_per_token(model, batch)),
        h2d=placeholder if host_tier else None, host_store=host_tier and rt.host_store is not None,
        weights_on=rt.policy.weights_on if host_tier else "device",
        host_budget_bytes=rt.policy.host_budget_bytes if host_tier else None,
        weight_format=WeightFormat.of_policy(rt.policy),
    )


def _excess(profile: Profile, window_peaks: dict[str, int], micro_batch: int, recompute: bool) -> int:
    """The most a unit's measured backward window (recompute included) exceeds the memory
    model's points for it without gather buffers (exact for a unit that was resident, prefetch
    depth 0; an upper bound for a streamed one, whose window also held its gather's buffers);
    adapter gradients taken out (the model counts them as static)."""
    choices = Choices.uniform(profile, micro_batch, keep_fraction=1.0, recompute=True if recompute else None,
                              prefetch_depth=0)
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
    in memory.py) from the windows of the units in `window_peaks`: `workspace_bytes_per_token`
    from a step without recompute, then `recompute_workspace_bytes_per_token` from a step
    recomputing every layer, with the first already in the model; per token, at least 0."""
    tokens = micro_batch * profile.seq_len
    profile = dataclasses.replace(profile, outside=dataclasses.replace(
        profile.outside, workspace_bytes_per_token=0.0, recompute_workspace_bytes_per_token=0.0))
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
