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

[Note: measuring the per-action overhead]
A pipelined step runs 2 x m x (packs per rank) actions per rank, and each costs more than its
layers' compute ([Note: the per-action overhead] in planner/pipeline_model.py). What it costs
is measured here, on every rank at once (so the cores are as shared as in a step, as the
layers' compute is measured), with the machinery of a real step and nothing else:
`PackStage`s of this model's own pack class whose decoder layers are replaced by a
pass-through (`_NoOpLayer`: h + a zero parameter, so the backward runs), the real micro-batch
and sequence length (the pack recomputes its rotary embeddings and mask from them as in a
run), activations 8 wide (the pass-through, the copies and the autograd bookkeeping of a
tensor of that size cost nothing; the bytes of a real activation are the P2P link's), on a
ScheduleLoopedBFS over `packs` such packs on a group of this rank alone (the multi-stage
runtime the pipelined schedules use; no P2P: a handoff between ranks is the P2P link's
latency + bytes / bandwidth in the model). `warmup` steps, then `steps` timed steps; per
step the time inside the stages' forward_one_chunk / backward_one_chunk (StepCounters) per
action is the stage's share, the rest of the step per action the schedule's; the median
over the steps, then the MAX over the ranks (every rank plans with the same profile).
Why not shorter: a process that has slept is scheduled ahead of the busy ones for a while
(the scheduler's credit for sleeping), so a burst of a few tens of milliseconds measured
less than 1.5x its CPU time while other work kept the 2-core machine at a load of 10; the
layers' compute is timed over whole steps, in the steady share of the cores. The defaults
run 8 steps of 32 actions (on that CPU about 0.3 s uncontended).
What it leaves out, measured on the 2-core CPU of 2026-12-02 (main-thread CPU per action at
packs of 1, 4 gloo ranks): posting the P2P operations (~0.3 ms), the pack residency's
before/after (~0.3 ms), the elastic runtime's per-pass bookkeeping (not separated); what it
covers there: the stage's infrastructure (~0.5-0.6 ms per forward or backward), the mask and
rotary recomputation (~0.55 ms per forward), the schedule's loop.
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist
import torch.nn as nn

from python_api.config import ElasticPolicy
from python_api.nn import LoRAConfig, target_names
from python_api.nn.lora import is_conv1d, is_linear
from python_api.pipeline.hf_packs import architecture_of
from python_api.pipeline.stage import PackStage, StepCounters
from python_api.planner.pipeline import PipelineError
from python_api.planner.pipeline_model import PipeLayer, PipelineProfile, PipeWeight
from python_api.planner.profile import Profile


def _shape(module: nn.Module) -> tuple[int, int]:
    w = module.weight
    return (int(w.shape[1]), int(w.shape[0])) if is_conv1d(module) else (int(w.shape[0]), int(w.shape[1]))


def _bytes(module: nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in list(module.parameters()) + list(module.buffers()))


def pipeline_profile(lm: nn.Module, lora: LoRAConfig, policy: ElasticPolicy, measured: Profile, *,
                     world_size: int, seq_len: int | None = None, micro_batch_size: int = 1,
                     action_overhead: tuple[float, float] | None = None) -> PipelineProfile:
    """[Note: a pipeline profile from a measured one]. `lm` is the HF model (its parameters may
    be on the meta device: only shapes and dtypes are read); `measured` a Profile of the same
    model and LoRA under the elastic runtime at pp = 1. `action_overhead` (stage, schedule
    seconds per action): None measures it ([Note: measuring the per-action overhead]: a
    collective, every rank of the default group calls this at once, at micro-batches of
    `micro_batch_size` sequences)."""
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
    seq = seq_len or measured.seq_len
    if action_overhead is None:
        action_overhead = measure_action_overhead(lm, seq_len=seq, micro_batch_size=micro_batch_size,
                                                  device=_device_of(measured.device))
    stage_s, schedule_s = action_overhead
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
        stage_overhead_s=stage_s, schedule_overhead_s=schedule_s,
    )


def _device_of(name: str) -> torch.device:
    """The device a measured profile was taken on (Profile.device: "cpu" or a CUDA name)."""
    return torch.device("cpu") if name == "cpu" or not torch.cuda.is_available() else \
        torch.device("cuda", torch.cuda.current_device())


class _NoOpLayer(nn.Module):
    """A decoder layer that passes its input through (plus a zero parameter: the backward runs)."""

    def __init__(self):
        super().__init__()
        self.zero = nn.Parameter(torch.zeros(()))

    def forward(self, h, *args, **kwargs):
        return h + self.zero


def _no_op_pack(lm: nn.Module, arch, layer: int, device: torch.device) -> nn.Module:
    """This model's pack class around decoder layer `layer`, the layer replaced by a
    pass-through; what else the pack holds (e.g. Llama's rotary embedding) is rebuilt from
    the model's config where it is on the meta device. `lm` is left untouched (a pack holds
    its own containers)."""
    pack = arch.pack(lm, [layer], first=False, last=False)
    pack.set_submodule(f"{arch.layer_prefix}{layer}", _NoOpLayer())
    for name, module in list(pack.named_modules()):
        own = list(module.parameters(recurse=False)) + list(module.buffers(recurse=False))
        if name and any(t.is_meta for t in own):
            try:
                pack.set_submodule(name, type(module)(lm.config))
            except Exception as exc:  # noqa: BLE001 - named below
                raise PipelineError(f"measuring the per-action overhead: {name} ({type(module).__name__}) of a "
                                    f"{arch.name} pack is on the meta device and cannot be rebuilt from the "
                                    f"config ({exc}); pass action_overhead to pipeline_profile") from exc
    left = [n for n, t in list(pack.named_parameters()) + list(pack.named_buffers()) if t.is_meta]
    if left:
        raise PipelineError(f"measuring the per-action overhead: {left[:3]} of the pack stay on the meta device")
    return pack.to(device)


def measure_action_overhead(lm: nn.Module, *, seq_len: int, micro_batch_size: int = 1, packs: int = 2,
                            micro_batches: int = 8, steps: int = 6, warmup: int = 2,
                            device: torch.device | str = "cpu", width: int = 8) -> tuple[float, float]:
    """(stage, schedule) seconds per action of a pipelined step beyond its layers' compute
    ([Note: measuring the per-action overhead]). A collective when the default process group
    is initialised (every rank calls it at once; the result is the MAX over the ranks)."""
    from torch.distributed.pipelining import ScheduleLoopedBFS

    for what, v in (("seq_len", seq_len), ("micro_batch_size", micro_batch_size), ("packs", packs),
                    ("micro_batches", micro_batches), ("steps", steps), ("warmup", warmup), ("width", width)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise PipelineError(f"measure_action_overhead: {what} must be a positive int, got {v!r}")
    if not dist.is_available() or not dist.is_initialized():
        raise PipelineError("measuring the per-action overhead runs pipeline stages, which need an initialised "
                            "process group (or pass action_overhead to pipeline_profile)")
    device = torch.device(device)
    arch = architecture_of(lm)
    n_layers = len(arch.layers(lm))
    world = dist.get_world_size()
    own, groups = dist.new_subgroups(group_size=1) if world > 1 else (dist.group.WORLD, [])
    try:
        counters = StepCounters()
        dtype = arch.embedding(lm).weight.dtype
        stages = []
        for j in range(packs):
            pack = _no_op_pack(lm, arch, j % n_layers, device)
            x = torch.zeros(micro_batch_size, seq_len, width, dtype=dtype, device=device, requires_grad=j > 0)
            y = torch.zeros(micro_batch_size, seq_len, width, dtype=dtype, device=device, requires_grad=True)
            stages.append(PackStage(pack, j, packs, device, input_args=(x,), output_args=(y,), group=own,
                                    residency=None, counters=counters))
        schedule = ScheduleLoopedBFS(stages, n_microbatches=micro_batches,
                                     loss_fn=lambda out, target: out.float().mean())
        B = micro_batches * micro_batch_size
        x = torch.randn(B, seq_len, width, generator=torch.Generator().manual_seed(0)).to(device=device, dtype=dtype)
        target = torch.zeros(B, dtype=torch.long, device=device)
        positions = torch.arange(seq_len, device=device).unsqueeze(0).expand(B, -1).contiguous()
        actions = 2 * packs * micro_batches
        per_step = []
        for s in range(warmup + steps):
            counters.reset()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            t0 = time.perf_counter()
            schedule.step(x, target=target, losses=[], position_ids=positions)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            wall = time.perf_counter() - t0
            if counters.forwards + counters.backwards != actions:
                raise AssertionError(f"measure_action_overhead: {counters.forwards} forwards and "
                                     f"{counters.backwards} backwards ran, {actions} actions expected")
            if s >= warmup:
                per_step.append((counters.compute_s / actions, max(0.0, wall - counters.compute_s) / actions))
    finally:
        if world > 1:
            dist.destroy_process_group(own)
    stage_s = statistics.median(p[0] for p in per_step)
    schedule_s = statistics.median(p[1] for p in per_step)
    if world > 1:
        t = torch.tensor([stage_s, schedule_s], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        stage_s, schedule_s = float(t[0]), float(t[1])
    return stage_s, schedule_s


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


__all__ = ["measure_action_overhead", "measure_step_peak_bytes", "pipeline_profile"]
