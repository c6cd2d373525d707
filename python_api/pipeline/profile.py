"""The pipeline models' input from a real model: `pipeline_profile(lm, lora, policy, measured)`,
and the tensor peak of a pipelined step (`measure_step_peak_bytes`).

[Note: a pipeline profile from a measured one]
The plain planner's `Profile` (python_api/planning/measure.py, measured on the pp = 1 model)
holds per unit what does not depend on the pipeline: compute per call (fixed + per token),
the bytes a layer saves for backward per token, which weights have a backward use, and the
head's compute, saved bytes and transients (`outside`). The pipeline profile takes those per
decoder layer and adds what the pipeline changes: the weights' shapes (from the HF model, so
chunks and slices are recomputed for the dp group instead of the profile's world), the
adapters per layer, what the first and last packs keep replicated (embeddings; final norm
and head unless the head is elastic), and the links. The P2P link is taken as the all-gather
link (same transport, one peer; an assumption of the model, stated here); the dp group's
all-gather and all-reduce as the profile's, fitted over the whole world (an upper bound on
latency for a smaller group).
"""

from __future__ import annotations

import torch
import torch.nn as nn

from python_api.config import ElasticPolicy
from python_api.nn import LoRAConfig, target_names
from python_api.nn.lora import is_conv1d, is_linear
from python_api.pipeline.hf_packs import architecture_of
from python_api.planner.pipeline_model import PipeLayer, PipelineProfile, PipeWeight
from python_api.planner.profile import Profile


def _shape(module: nn.Module) -> tuple[int, int]:
    w = module.weight
    return (int(w.shape[1]), int(w.shape[0])) if is_conv1d(module) else (int(w.shape[0]), int(w.shape[1]))


def _bytes(module: nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in list(module.parameters()) + list(module.buffers()))


def pipeline_profile(lm: nn.Module, lora: LoRAConfig, policy: ElasticPolicy, measured: Profile, *,
                     world_size: int, seq_len: int | None = None) -> PipelineProfile:
    """[Note: a pipeline profile from a measured one]. `lm` is the HF model (its parameters may
    be on the meta device: only shapes and dtypes are read); `measured` a Profile of the same
    model and LoRA under the elastic runtime at pp = 1."""
    arch = architecture_of(lm)
    layers_of = {layer.name: layer for layer in measured.layers}
    targets = set(target_names(lm, lora))
    prefix = arch.layer_prefix
    out = []
    for i, layer in enumerate(arch.layers(lm)):
        name = f"{prefix}{i}"
        lp = layers_of.get(name)
        if lp is None:
            raise ValueError(f"pipeline_profile: the measured profile has no unit {name!r} (units: "
                             f"{sorted(layers_of)[:4]}...)")
        backward = {w.name: w.backward for w in lp.weights}
        weights, adapters = [], 0
        for sub, m in layer.named_modules():
            full = f"{name}.{sub}"
            if not sub or not is_linear(m):
                continue
            rows, cols = _shape(m)
            if full in targets:
                adapters += lora.r_of(full) * (rows + cols)
            if full in backward:
                weights.append(PipeWeight(full, rows, cols, m.weight.element_size(), backward[full]))
        out.append(PipeLayer(name, lp.fwd_s_fixed, lp.fwd_s_per_token, lp.bwd_s_fixed, lp.bwd_s_per_token,
                             lp.act_bytes_per_token, tuple(weights), adapters))
    head = lm.lm_head
    head_unit = layers_of.get("lm_head")
    head_weights = ()
    head_fwd = measured.outside.fwd_s_per_token
    head_bwd = measured.outside.bwd_s_per_token
    if head_unit is not None:  # an elastic lm_head: its own unit in the profile
        rows, cols = _shape(head)
        head_weights = (PipeWeight("lm_head", rows, cols, head.weight.element_size(), True),)
        head_fwd += head_unit.fwd_s_per_token + head_unit.fwd_s_fixed / max(1, seq_len or measured.seq_len)
        head_bwd += head_unit.bwd_s_per_token + head_unit.bwd_s_fixed / max(1, seq_len or measured.seq_len)
    embed = arch.embedding(lm)
    first_static = _bytes(embed)
    if arch.name == "gpt2":
        first_static += _bytes(lm.transformer.wpe)
    norm = lm.model.norm if arch.name == "llama" else lm.transformer.ln_f
    head_bytes = 0 if head_weights else head.weight.numel() * head.weight.element_size()
    last_static = _bytes(norm) + head_bytes
    if head.bias is not None:
        last_static += head.bias.numel() * head.bias.element_size()
    act_elem = embed.weight.element_size()
    head_adapters = 0
    if "lm_head" in targets:
        rows, cols = _shape(head)
        head_adapters = lora.r_of("lm_head") * (rows + cols)
    return PipelineProfile(
        source=f"from {measured.source} profile", device=measured.device, world_size=world_size,
        seq_len=seq_len or measured.seq_len, hidden_size=arch.hidden_size(lm), act_element_size=act_elem,
        layers=tuple(out), chunk_bytes=policy.chunk_bytes, allgather=measured.allgather, allreduce=measured.allreduce,
        p2p=measured.allgather, capacity_bytes=measured.capacity_bytes, reserved_bytes=measured.reserved_bytes,
        embed_fwd_s_per_token=0.0, head_fwd_s_per_token=head_fwd, head_bwd_s_per_token=head_bwd,
        head_act_bytes_per_token=measured.outside.act_bytes_per_token,
        head_peak_bytes_per_token=measured.outside.peak_bytes_per_token,
        workspace_bytes_per_token=measured.outside.workspace_bytes_per_token,
        first_static_bytes=first_static, last_static_bytes=last_static, head_weights=head_weights,
        head_adapter_params=head_adapters, h2d=measured.h2d, weights_on=policy.weights_on,
        cpu_gloo=measured.device == "cpu", prefetch_depth=policy.prefetch_depth,
    )


def measure_step_peak_bytes(pipe, run) -> int:
    """The tensor peak while `run()` executes on this rank, as measure_peak_bytes counts it for
    one runtime (python_api/planning/measure.py): CUDA's max_memory_allocated, or on CPU the
    storages alive at the start (each pack's pool segments once) plus the profiler's
    allocation high-water mark during the call."""
    from python_api.planning.measure import _live_tensor_bytes, _profiled_growth

    device = pipe.device
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        run()
        torch.cuda.synchronize(device)
        return int(torch.cuda.max_memory_allocated(device))
    segments = [s for rt in pipe.runtimes.values() if rt.pool is not None for s in rt.pool.snapshot()]
    live = _live_tensor_bytes({s["data_ptr"] for s in segments}) + sum(s["bytes"] for s in segments)
    return live + _profiled_growth(run)


__all__ = ["measure_step_peak_bytes", "pipeline_profile"]
