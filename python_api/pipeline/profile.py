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
layers' compute ([Note: the per-action overhead] in planner/pipeline_sim.py). It is measured
here with the machinery of a real step and nothing else, on every rank at once (so the cores
are as shared as in a step, as the layers' compute is measured): a ScheduleLoopedBFS (the
multi-stage runtime the pipelined schedules use) of `PackStage`s of this model's own pack
class, at the real micro-batch and sequence length (each pack recomputes its rotary
embeddings and causal mask from the positions, as in a run), whose decoder layer is replaced
by `_NoOpLayer`: it passes its input through and does `busy_s` of small matrix products in
forward and again in backward (work that keeps the core busy like a layer, timed apart);
activations 8 wide, so the copies and P2P bytes of the mini pipeline cost nothing (a real
activation's bytes are the P2P link's). The stages alternate between the two ranks of a pair
(ranks 2i and 2i + 1; one rank alone when the world size is odd), `packs` per rank, so that
every action hands its output to the other rank as at packs of 1: the P2P operations are
posted, waited for and, under the step's load, a receiver waits for its sender to be
scheduled. `warmup` steps, then `steps` timed; per action, the medians over the steps of the
time inside the stages' forward/backward minus the busy work give the stage's share; the
schedule's share is the overhead before each action with which the pipeline model itself
reproduces the measured step of the pair (`mini_pipeline_step`: the same model, every action
as long as measured inside, each handoff the profile's P2P latency; by bisection), so what
the model will do with it is what was measured; alone (odd world), the step's time outside
the actions. Then the MAX over the ranks: every rank plans with the same profile.
Measured on the 2-core CPU (4 gloo ranks, demo shape, micro-batch 2 x 128 tokens,
2026-12-02, the machine shared with other work): stage 1.0 ms and schedule 5.6 ms per
action at a load of about 5, stage 2.6 and schedule 19.7 ms at a load of 10-15. Not in it:
the elastic runtime's per-pass bookkeeping and the pack residency's before/after (~0.3 ms of
CPU per action in a step). Against a real step in the same run: the schedule share was
1.0-2.9x the mean gap between two actions of a rank whose input had already arrived (demo
shape, packs of 1, looped-bfs, 3 rounds at a load of 11-15), and 1.2-1.3x a tiny Llama step's
time outside its actions per action (tests/planner/test_pipeline_overhead.py). With the
defaults (16-action steps, 5 of them) it took 0.3-5 s here, depending on the load; the busy
work keeps it from being shorter: a process that has slept is scheduled ahead of the busy
ones for a while, so a burst of a few tens of milliseconds measured less than 1.5x its CPU
time while other work kept the machine at a load of 10, where the layers' compute, timed over
whole steps, gets the steady share.
"""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.pipelining import ScheduleLoopedBFS

from ..config import ElasticPolicy
from ..nn import LoRAConfig, target_names
from ..nn.lora import is_conv1d, is_linear
from ..planner.pipeline import PipelineError, PipelineLayout
from ..planner.pipeline_model import PipeLayer, PipelineProfile, PipeWeight, simulate
from ..planner.profile import Link, Profile
from .hf_packs import architecture_of
from .stage import PackStage, StepCounters


def _shape(module: nn.Module) -> tuple[int, int]:
    w = module.weight
    return (int(w.shape[1]), int(w.shape[0])) if is_conv1d(module) else (int(w.shape[0]), int(w.shape[1]))


def _bytes(module: nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in list(module.parameters()) + list(module.buffers()))


def pipeline_profile(lm: nn.Module, lora: LoRAConfig, policy: ElasticPolicy, measured: Profile, *,
                     world_size: int, seq_len: int | None = None, micro_batch_size: int = 1,
                     action_overhead: ActionOverhead | None = None) -> PipelineProfile:
    """[Note: a pipeline profile from a measured one]. `lm` is the HF model (its parameters may
    be on the meta device: only shapes and dtypes are read); `measured` a Profile of the same
    model and LoRA under the elastic runtime at pp = 1. `action_overhead`: None measures it
    ([Note: measuring the per-action overhead]: a collective, every rank of the default group
    calls this at once; at micro-batches of `micro_batch_size` sequences, each handoff at the
    profile's P2P latency, the all-gather link's)."""
    arch = architecture_of(lm)
    layers_of = {layer.name: layer for layer in measured.layers}
    targets = set(target_names(lm, lora))
    prefix = arch.layer_prefix
    fmt = measured.weight_format  # how the elastic weights are stored (None: as they are)
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
                weights.append(PipeWeight(full, rows, cols, m.weight.element_size(), backward[full], fmt))
        # A quantized model's unit times are stored net of their dequantization, one per use
        # ([Note: dequantization in the time model] in planner/cost.py): a pack's action is one
        # use of each of its layers, so it joins the fixed part.
        out.append(PipeLayer(name, lp.fwd_s_fixed + lp.dequant_fwd_s, lp.fwd_s_per_token,
                             lp.bwd_s_fixed + lp.dequant_bwd_s, lp.bwd_s_per_token,
                             lp.act_bytes_per_token, tuple(weights), adapters))
    head = lm.lm_head
    head_unit = layers_of.get("lm_head")
    head_weights = ()
    head_fwd = measured.outside.fwd_s_per_token
    head_bwd = measured.outside.bwd_s_per_token
    if head_unit is not None:  # an elastic lm_head: its own unit in the profile
        rows, cols = _shape(head)
        head_weights = (PipeWeight("lm_head", rows, cols, head.weight.element_size(), True, fmt),)
        per_seq = max(1, seq_len or measured.seq_len)
        head_fwd += head_unit.fwd_s_per_token + (head_unit.fwd_s_fixed + head_unit.dequant_fwd_s) / per_seq
        head_bwd += head_unit.bwd_s_per_token + (head_unit.bwd_s_fixed + head_unit.dequant_bwd_s) / per_seq
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
    if action_overhead is None:  # a collective: every rank is here
        action_overhead = measure_action_overhead(lm, seq_len=seq, micro_batch_size=micro_batch_size,
                                                  p2p_latency_s=measured.allgather.latency_s,
                                                  device=_device_of(measured.device))
    return PipelineProfile(
        source=f"from {measured.source} profile", device=measured.device, world_size=world_size,
        seq_len=seq, hidden_size=arch.hidden_size(lm), act_element_size=act_elem,
        layers=tuple(out), chunk_bytes=policy.chunk_bytes, allgather=measured.allgather, allreduce=measured.allreduce,
        p2p=measured.allgather, capacity_bytes=measured.capacity_bytes, reserved_bytes=measured.reserved_bytes,
        embed_fwd_s_per_token=0.0, head_fwd_s_per_token=head_fwd, head_bwd_s_per_token=head_bwd,
        head_act_bytes_per_token=measured.outside.act_bytes_per_token,
        head_peak_bytes_per_token=measured.outside.peak_bytes_per_token,
        workspace_bytes_per_token=measured.outside.workspace_bytes_per_token,
        first_static_bytes=first_static, last_static_bytes=last_static, head_weights=head_weights,
        head_adapter_params=head_adapters, h2d=measured.h2d, weights_on=policy.weights_on,
        cpu_gloo=measured.device == "cpu", prefetch_depth=policy.prefetch_depth,
        stage_overhead_s=action_overhead.stage_s, schedule_overhead_s=action_overhead.schedule_s,
    )


def _device_of(name: str) -> torch.device:
    """The device a measured profile was taken on (Profile.device: "cpu" or a CUDA name)."""
    return torch.device("cpu") if name == "cpu" or not torch.cuda.is_available() else \
        torch.device("cuda", torch.cuda.current_device())


def measure_step_peak_bytes(pipe, run) -> int:
    """The tensor peak while `run()` executes on this rank, as measure_peak_bytes counts it for
    one runtime (python_api/planning/peaks.py), over every pack's runtime on this stage, the
    host store included: on CPU its pages are the packs' memory (the pipeline memory model,
    python_api/planner/pipeline_sim.py, counts them whole)."""
    from ..planning.peaks import runtimes_peak_bytes

    return runtimes_peak_bytes(list(pipe.runtimes.values()), run, pipe.device, count_host_tier=True)


class _Busy(torch.autograd.Function):
    """`repeats` small matrix products in forward and again in backward: work that occupies the
    core like a layer's compute, the same in both directions."""

    @staticmethod
    def forward(ctx, h, zero, a, repeats, clock):
        ctx.a, ctx.repeats, ctx.clock = a, repeats, clock
        _spin(a, repeats, clock)
        return h + zero

    @staticmethod
    def backward(ctx, g):
        _spin(ctx.a, ctx.repeats, ctx.clock)
        return g, g.sum(), None, None, None


def _spin(a: torch.Tensor, repeats: int, clock: list) -> None:
    t0 = time.perf_counter()
    x = a
    for _ in range(repeats):
        x = torch.mm(x, a)
        x = x / x.abs().max().clamp_min(1e-6)
    if x.is_cuda:
        torch.cuda.synchronize(x.device)
    clock[0] += time.perf_counter() - t0


class _NoOpLayer(nn.Module):
    """A decoder layer that passes its input through (plus a zero parameter, so the backward
    runs), doing `repeats` products of a 64 x 64 matrix in forward and in backward (timed into
    `clock[0]`)."""

    def __init__(self, repeats: int, clock: list):
        super().__init__()
        self.zero = nn.Parameter(torch.zeros(()))
        self.register_buffer("a", torch.randn(64, 64, generator=torch.Generator().manual_seed(0)) / 8)
        self.repeats, self.clock = repeats, clock

    def forward(self, h, *args, **kwargs):
        return _Busy.apply(h, self.zero, self.a, self.repeats, self.clock)


def _no_op_pack(lm: nn.Module, arch, layer: int, device: torch.device, repeats: int, clock: list) -> nn.Module:
    """This model's pack class around decoder layer `layer`, the layer replaced by a
    `_NoOpLayer`; what else the pack holds (e.g. Llama's rotary embedding) is rebuilt from the
    model's config where it is on the meta device. `lm` is left untouched (a pack holds its own
    containers)."""
    pack = arch.pack(lm, [layer], first=False, last=False)
    pack.set_submodule(f"{arch.layer_prefix}{layer}", _NoOpLayer(repeats, clock))
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


@dataclass(frozen=True)
class ActionOverhead:
    """What a pipelined step pays per action beyond its layers' compute, in seconds
    ([Note: the per-action overhead] in planner/pipeline_sim.py): inside the stage's forward /
    backward, and in the schedule between actions."""

    stage_s: float
    schedule_s: float


def _mini_step(lm, arch, group, across: int, packs: int, micro_batches: int, steps: int, warmup: int, seq_len: int,
               micro_batch_size: int, width: int, repeats: int, device: torch.device) -> tuple[float, float, float]:
    """A ScheduleLoopedBFS step of `packs` no-op packs per rank over the `across` ranks of
    `group` (stage j on rank j mod across), timed: medians over `steps` steps after `warmup` of
    (wall, inside the stages, inside the busy work), per action."""
    me = dist.get_rank(group)
    n_layers = len(arch.layers(lm))
    counters, clock = StepCounters(), [0.0]
    dtype = arch.embedding(lm).weight.dtype
    stages = []
    for j in range(packs):
        idx = me + across * j
        pack = _no_op_pack(lm, arch, idx % n_layers, device, repeats, clock)
        x = torch.zeros(micro_batch_size, seq_len, width, dtype=dtype, device=device, requires_grad=idx > 0)
        y = torch.zeros(micro_batch_size, seq_len, width, dtype=dtype, device=device, requires_grad=True)
        stages.append(PackStage(pack, idx, across * packs, device, input_args=(x,), output_args=(y,), group=group,
                                residency=None, counters=counters))
    schedule = ScheduleLoopedBFS(stages, n_microbatches=micro_batches, loss_fn=lambda out, target: out.float().mean())
    B = micro_batches * micro_batch_size
    x = torch.randn(B, seq_len, width, generator=torch.Generator().manual_seed(0)).to(device=device, dtype=dtype)
    target = torch.zeros(B, dtype=torch.long, device=device)
    positions = torch.arange(seq_len, device=device).unsqueeze(0).expand(B, -1).contiguous()
    actions = 2 * packs * micro_batches
    out = []
    for s in range(warmup + steps):
        counters.reset()
        clock[0] = 0.0
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        schedule.step(*((x,) if me == 0 else ()), target=target if me == across - 1 else None,
                      losses=[] if me == across - 1 else None, position_ids=positions)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        wall = time.perf_counter() - t0
        if counters.forwards + counters.backwards != actions:
            raise AssertionError(f"measure_action_overhead: {counters.forwards} forwards and {counters.backwards} "
                                 f"backwards ran, {actions} actions expected")
        if s >= warmup:
            out.append((wall / actions, counters.compute_s / actions, clock[0] / actions))
    return tuple(statistics.median(o[i] for o in out) for i in range(3))


def mini_pipeline_step(inside_s: float, schedule_s: float, p2p_latency_s: float, packs: int,
                       micro_batches: int) -> float:
    """The pipeline model's step time per action of the two-rank mini pipeline of
    measure_action_overhead: LoopedBFS, `packs` packs per rank, every action `inside_s` long
    (its compute and the stage's overhead), `schedule_s` before each, each handoff
    `p2p_latency_s`."""
    n = 2 * packs
    layers = tuple(PipeLayer(f"l{i}", inside_s, 0.0, inside_s, 0.0, 0.0, ()) for i in range(n))
    layout = PipelineLayout(2, 2, "looped-bfs", micro_batches, tuple(range(n + 1)), ("persistent",) * n, 0)
    free = Link(0.0, 1e18)
    prof = PipelineProfile(source="mini pipeline", device="cpu", world_size=2, seq_len=1, hidden_size=1,
                           act_element_size=1, layers=layers, chunk_bytes=1, allgather=free, allreduce=free,
                           p2p=Link(p2p_latency_s, 1e18), capacity_bytes=1 << 40, schedule_overhead_s=schedule_s)
    return simulate(prof, layout, 1).step_s / (2 * packs * micro_batches)


def _fit_schedule(wall: float, inside: float, p2p_latency_s: float, packs: int, micro_batches: int) -> float:
    """The schedule overhead with which the model reproduces a measured two-rank mini step."""
    if mini_pipeline_step(inside, 0.0, p2p_latency_s, packs, micro_batches) >= wall:
        return 0.0
    lo, hi = 0.0, wall
    for _ in range(40):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if mini_pipeline_step(inside, mid, p2p_latency_s, packs, micro_batches) < wall else (lo, mid)
    return (lo + hi) / 2


def measure_action_overhead(lm: nn.Module, *, seq_len: int, micro_batch_size: int = 1, p2p_latency_s: float = 0.0,
                            packs: int = 2, micro_batches: int = 4, steps: int = 4, warmup: int = 1,
                            busy_s: float = 2e-3, device: torch.device | str = "cpu",
                            width: int = 8) -> ActionOverhead:
    """The per-action overhead of a pipelined step ([Note: measuring the per-action overhead]);
    `p2p_latency_s` is the latency the model charges per handoff (the profile's P2P link). A
    collective: every rank of the default process group calls it at once; the figures are the
    MAX over the ranks."""
    for what, v in (("seq_len", seq_len), ("micro_batch_size", micro_batch_size), ("packs", packs),
                    ("micro_batches", micro_batches), ("steps", steps), ("width", width)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise PipelineError(f"measure_action_overhead: {what} must be a positive int, got {v!r}")
    if isinstance(warmup, bool) or not isinstance(warmup, int) or warmup < 0:
        raise PipelineError(f"measure_action_overhead: warmup must be an int >= 0, got {warmup!r}")
    for what, v in (("busy_s", busy_s), ("p2p_latency_s", p2p_latency_s)):
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
            raise PipelineError(f"measure_action_overhead: {what} must be a finite number >= 0, got {v!r}")
    if not dist.is_available() or not dist.is_initialized():
        raise PipelineError("measuring the per-action overhead runs pipeline stages, which need an initialised "
                            "process group (or pass action_overhead to pipeline_profile)")
    device = torch.device(device)
    arch = architecture_of(lm)
    world = dist.get_world_size()
    # the busy work: products per action for about busy_s on an idle core
    a, clock = torch.randn(64, 64, generator=torch.Generator().manual_seed(0)).to(device) / 8, [0.0]
    _spin(a, 20, clock)
    clock[0] = 0.0
    _spin(a, 100, clock)
    repeats = max(1, round(busy_s / max(clock[0] / 100, 1e-9))) if busy_s > 0 else 0
    across = 2 if world % 2 == 0 else 1
    group, _ = dist.new_subgroups(group_size=across) if world > across else (dist.group.WORLD, None)
    try:
        wall, inside, busy = _mini_step(lm, arch, group, across, packs, micro_batches, steps, warmup, seq_len,
                                        micro_batch_size, width, repeats, device)
    finally:
        if world > across:
            dist.destroy_process_group(group)
    stage_s = max(0.0, inside - busy)
    if across == 1:
        schedule_s = max(0.0, wall - inside)
    else:
        schedule_s = _fit_schedule(wall, inside, p2p_latency_s, packs, micro_batches)
    if world > 1:  # on NCCL the reduction needs a device tensor
        t = torch.tensor([stage_s, schedule_s], dtype=torch.float64,
                         device=device if dist.get_backend() == "nccl" else "cpu")
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        stage_s, schedule_s = (float(v) for v in t.cpu())
    return ActionOverhead(stage_s, schedule_s)


def measure_busy_speed(groups, *, seconds: float = 0.5, rounds: int = 3, width: int = 576) -> tuple[float, ...]:
    """[Note: ranks sharing cores] in planner/pipeline_model.py: busy_speed[b - 1], the speed of
    a rank's compute while only the ranks of pp ranks 0..b-1 compute and the others wait in a
    barrier (blocked, as a rank waits for its input), relative to every rank computing. The
    work: products of [256, width] by [width, width] (a layer's GEMM), as many as take about
    `seconds` with every rank busy (rank 0's count); `rounds` rounds with b = pp..1, then
    1..pp, ...; per b the median over rounds of the slowest busy rank's time. A collective over
    the default group; every rank gets the same tuple, its last entry 1."""
    for what, v in (("rounds", rounds), ("width", width)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise PipelineError(f"measure_busy_speed: {what} must be a positive int, got {v!r}")
    if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not (0 < seconds < math.inf):
        raise PipelineError(f"measure_busy_speed: seconds must be a positive finite number, got {seconds!r}")
    pp = groups.pp
    gen = torch.Generator().manual_seed(groups.rank)
    x, w = torch.randn(256, width, generator=gen), torch.randn(width, width, generator=gen) / width ** 0.5

    def work(n: int) -> float:
        t0 = time.perf_counter()
        y = x
        for _ in range(n):
            y = torch.tanh(y @ w)
        return time.perf_counter() - t0

    work(2)
    dist.barrier()
    calib = torch.tensor([work(10) / 10], dtype=torch.float64)
    dist.broadcast(calib, src=0)
    n = max(1, round(seconds / max(float(calib), 1e-9)))
    times = {b: [] for b in range(1, pp + 1)}
    for k in range(rounds):
        for b in (range(pp, 0, -1) if k % 2 == 0 else range(1, pp + 1)):
            dist.barrier()
            t = work(n) if groups.pp_rank < b else 0.0
            dist.barrier()
            times[b].append(t)
    med = torch.tensor([statistics.median(times[b]) for b in range(1, pp + 1)], dtype=torch.float64)
    dist.all_reduce(med, op=dist.ReduceOp.MAX)  # the slowest busy rank (an idle one gives 0)
    full = float(med[-1])
    return tuple(full / float(t) for t in med[:-1]) + (1.0,)


__all__ = ["ActionOverhead", "measure_action_overhead", "measure_busy_speed", "measure_step_peak_bytes",
           "mini_pipeline_step", "pipeline_profile"]
