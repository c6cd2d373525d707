"""The planned run of the CLI (`--plan auto`, `--compare-planned`): profile the model, plan
under the memory cap, write plan.json, apply the plan, and re-plan when the memory changes.

[Note: adaptive accumulation]
The global batch of a step (world_size x micro_batch x grad_accum sequences, the options'
values) never changes; how a rank splits its share into micro-batches does. Before every
optimizer step the planned run takes the memory it may use now: the --memory-cap in force at
that step (--memory-cap-change STEP:SIZE), and on CUDA with `--memory-cap auto` also what the
device has left (free memory plus what torch holds), then the MIN of that over the ranks by
one all-reduce. What the device has left counts the memory that is not ours (other processes,
the CUDA context) out already, while the planner's memory model counts it in (the profile's
reserved_bytes, [Note: what the memory model counts]); so under `--memory-cap auto` the
memory a plan may use is free + torch's + the profile's reserved bytes: not ours is taken off
once (it was twice, leaving 1-3 GB per GPU unused). A departure of more than 5% from the memory the current plan was made for
re-plans from the same profile (deterministic: every rank computes the same plan from the same
numbers); a plan that differs is applied on every rank at that step (residency, pool budget,
recompute, and the micro-batch split of the step's batch). The windows of a step are the same
set whatever the split (python_api/finetune/data.py draws world_size x micro_batch x grad_accum starts
per step and deals them out), so the loss and the averaged gradient are the same sums in
another order: equal to a fixed-split run within fp32 summation-order rounding.
"""

from __future__ import annotations

import dataclasses
import os
import time

import torch
import torch.distributed as dist

from ..planner.profile import ProfileError
from ..planner.search import PlanningError
from ..planning.apply import apply_plan, plan
from ..planning.layer_reuse import ALL_LAYERS_ENV
from ..planning.measure import ProfileBelowTensorsError, ProfileBoundError, measure_profile
from .constants import PROG
from .errors import FinetuneError
from .files import agreed_write, write_json
from .option_values import fmt_bytes

_REPLAN_TOLERANCE = 0.05


def _host_memory_share() -> int:
    """This process's share of the machine's memory: MemTotal / local ranks."""
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemTotal:"):
                total = int(line.split()[1]) * 1024
                break
        else:
            raise FinetuneError("--memory-cap auto: cannot read MemTotal from /proc/meminfo; give a size")
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1)
    return total // max(1, local)


# The least cap is extrapolated from per-token figures measured at the requested micro-batch:
# 0.14% below the figure measured at one sequence on the test's tiny model (See Note [refusing
# a cap before profiling] in python_api/planning/measure.py).
_LEAST_MARGIN = 1.02


def _mib_up(n: float) -> str:
    """`n` bytes as a --memory-cap value, rounded up to whole MiB (never below `n`)."""
    return f"{-(-int(n) // 2**20)}MiB"


def plan_document(plan, events: list[dict], profile_seconds: float) -> dict:
    """plan.json: the plan in force (what `Plan.load` reads back) with the run's record of it:
    its adaptations (one entry per plan applied, `JobPlanner._event`) and the profiling time."""
    doc = plan.to_dict()
    doc["adaptations"] = list(events)
    doc["profile_seconds"] = float(profile_seconds)
    return doc


class JobPlanner:
    """Profile, plan and adapt one planned elastic run (see the module docstring)."""

    def __init__(self, job, engine):
        t, planner = job.cfg.training, job.cfg.planner
        self.job, self.engine = job, engine
        # With --weights-on host, --host-fraction > 0 or --offload-activations the profile has the
        # host tier (measure_profile), and the planner chooses the host fraction (a grid; only 1
        # with --weights-on host) and activation offload on/off too; plan.json carries them.
        self.global_batch = job.world_size * t.micro_batch * t.grad_accum
        self.changes = sorted(planner.memory_cap_change)
        self.device_auto = planner.memory_cap == "auto" and job.device.type == "cuda"
        if planner.memory_cap == "auto":
            self.base_cap = None if job.device.type == "cuda" else _host_memory_share()
        else:
            self.base_cap = planner.memory_cap
        caps = [c for c in [self.base_cap] + [c for _, c in self.changes] if c is not None]
        batch = job.windows.batch(t.seed, 0, job.world_size, job.rank, t.micro_batch, 1)[0].to(job.device)
        t0 = time.perf_counter()
        while True:
            # [Note: profiling a smaller micro-batch]
            # Where the cap is below what streaming every weight needs at --micro-batch (the plan
            # can still fit it, by recomputing), the profile is measured on half the micro-batch,
            # down to one sequence; the profile's per-token figures extrapolate to the
            # micro-batches the planner tries.
            # The decision comes from the memory model on MAX-reduced counts and the MIN bound:
            # the same on every rank.
            report: dict = {}
            try:
                profile = measure_profile(engine.model, [batch],
                                          capacity_bytes=max(caps) if caps and not self.device_auto else None,
                                          report=report)
                break
            except ProfileBelowTensorsError as exc:  # See [Note: refusing a cap before profiling] (measure.py)
                raise FinetuneError(
                    f"--memory-cap {fmt_bytes(exc.bound_bytes)}: no plan fits; the model's own tensors need "
                    f"{fmt_bytes(exc.needed_bytes)} per rank (the shards of the frozen weights, the replicated tensors, "
                    f"the adapters with their gradients and AdamW state), before any activation or gathered weight: "
                    f"give more than {_mib_up(exc.needed_bytes)} (found before profiling)") from exc
            except ProfileBoundError as exc:
                if exc.least_bytes is not None and exc.least_bytes > exc.bound_bytes:
                    raise FinetuneError(
                        f"--memory-cap {fmt_bytes(exc.bound_bytes)}: too small to plan; profiling the model at one "
                        f"sequence per micro-batch, every weight streamed, needs {fmt_bytes(exc.least_bytes)} per rank "
                        f"of tensor memory by the memory model: give --memory-cap "
                        f"{_mib_up(exc.least_bytes * _LEAST_MARGIN)} or more (found after one profiling step, "
                        f"extrapolated from {batch.shape[0]} sequences)") from exc
                if batch.shape[0] == 1:
                    raise FinetuneError(f"no plan: the memory cap leaves no room to profile the model ({exc})") from exc
                batch = batch[: batch.shape[0] // 2]
                if job.rank == 0:
                    print(f"{PROG}: the memory cap leaves no room to profile {batch.shape[0] * 2} sequences "
                          f"streamed; profiling {batch.shape[0]}", flush=True)
            except ProfileError as exc:
                raise FinetuneError(f"no plan: the memory cap leaves no room for the model ({exc})") from exc
        self.profile_seconds = time.perf_counter() - t0
        # See [Note: profiling identical layers once] (python_api/planning/layer_reuse.py).
        classes = [c for lc in report.get("layer_classes", []) for c in lc]
        reused = ""
        if classes:
            layers = sum(len(c) for c in classes)
            profiled = sum(u in report["profiled_units"] for c in classes for u in c)
            reused = (f" ({profiled} of {layers} layers run: identical layers take their class's figures; "
                      f"{ALL_LAYERS_ENV}=1 profiles every layer)")
        if caps and max(caps) > profile.capacity_bytes:
            profile = dataclasses.replace(profile, capacity_bytes=max(caps))
        self.profile = profile
        self.apply_plan, self.PlanningError = apply_plan, PlanningError
        self.cap = self._agreed_cap(0)
        self.plan = self._plan(self.cap, step=1)
        self.apply_plan(engine.model, self.plan)
        engine.budget_bytes = self.plan.pool_budget_bytes
        engine.micro_batch, engine.grad_accum = self.plan.micro_batch, self.plan.accumulation
        self.events = [self._event(1, None)]
        if job.rank == 0:
            print(f"{PROG}: profiled in {self.profile_seconds:.1f} s{reused}, planned in {self.plan.planning_seconds:.3f} s "
                  f"for {fmt_bytes(self.cap)} of tensor memory per rank (the cap bounds the tensors' peak, not the "
                  f"process's resident memory):", flush=True)
            print(self.plan.table(), flush=True)
        self._write()

    # ------------------------------------------------------------ memory

    def cap_label(self) -> str:
        return "auto" if self.base_cap is None else fmt_bytes(self.base_cap)

    def _cap_at(self, step: int) -> int:
        """The cap in force at optimizer step `step` (0-based) on this rank."""
        cap = self.base_cap
        for at, size in self.changes:
            if at <= step + 1:
                cap = size
        if self.device_auto:
            dev = self.job.device
            free, _ = torch.cuda.mem_get_info(dev)
            # [Note: adaptive accumulation]: what we may use, in the model's terms (it counts
            # the memory not ours, the profile's reserved_bytes, within the peak).
            available = int(free + torch.cuda.memory_reserved(dev)) + self.profile.reserved_bytes
            cap = available if cap is None else min(cap, available)
        return int(cap)

    def _agreed_cap(self, step: int) -> int:
        """The MIN over the ranks of the cap each observes: one decision for every rank."""
        mine = torch.tensor([self._cap_at(step)], dtype=torch.int64, device=self.job.device)
        if self.job.world_size > 1:
            dist.all_reduce(mine, op=dist.ReduceOp.MIN)
        return int(mine.item())

    def _plan(self, cap: int, step: int):
        try:
            return plan(self.engine.model, self.profile, min(cap, self.profile.capacity_bytes), self.global_batch)
        except self.PlanningError as exc:
            raise FinetuneError(f"the planner found no plan for {fmt_bytes(cap)} per rank at step {step}: {exc}") from exc

    # ------------------------------------------------------------ adapting

    def before_step(self, step: int) -> None:
        cap = self._agreed_cap(step)
        if abs(cap - self.cap) <= _REPLAN_TOLERANCE * self.cap:
            return
        old = self.plan
        new = self._plan(cap, step + 1)
        self.cap = cap
        if new.to_dict() | {"planning_seconds": 0} == old.to_dict() | {"planning_seconds": 0}:
            return
        self.apply_plan(self.engine.model, new)
        self.plan = new
        self.engine.budget_bytes = new.pool_budget_bytes
        self.engine.micro_batch, self.engine.grad_accum = new.micro_batch, new.accumulation
        self.events.append(self._event(step + 1, old))
        if self.job.rank == 0:
            print(f"{PROG}: step {step + 1}: memory {fmt_bytes(cap)} per rank: micro-batch x accumulation "
                  f"{old.micro_batch}x{old.accumulation} -> {new.micro_batch}x{new.accumulation}, pool budget "
                  f"{fmt_bytes(old.pool_budget_bytes)} -> {fmt_bytes(new.pool_budget_bytes)}, recomputed layers "
                  f"{sum(lp.recompute for lp in old.layers)} -> {sum(lp.recompute for lp in new.layers)}", flush=True)
        self._write()

    def _event(self, step: int, old) -> dict:
        p = self.plan
        return {"step": step, "memory_bytes": self.cap, "micro_batch": p.micro_batch, "accumulation": p.accumulation,
                "pool_budget_bytes": p.pool_budget_bytes, "recomputed_layers": sum(lp.recompute for lp in p.layers),
                "host_fraction": p.host_fraction, "offload_activations": p.offload_activations,
                "predicted_allgather_bytes_per_step": p.predicted_allgather_bytes_per_step,
                "predicted_h2d_bytes_per_step": p.predicted_h2d_bytes_per_step,
                "predicted_peak_bytes": p.predicted_peak_bytes, "predicted_step_time_s": p.predicted_step_time_s}

    def _write(self) -> None:
        job = self.job

        def write():
            if job.rank == 0:
                write_json(os.path.join(job.save_dir, "plan.json"),
                           plan_document(self.plan, self.events, self.profile_seconds))
                write_json(os.path.join(job.save_dir, "profile.json"), self.profile.to_dict())

        agreed_write(job, write, "plan.json was not written")

    def report(self) -> dict:
        """What the run's entry in summary.json carries about its plan."""
        p = self.plan
        return {"plan": {"memory_bytes": p.memory_bytes, "micro_batch": p.micro_batch, "accumulation": p.accumulation,
                         "pool_budget_bytes": p.pool_budget_bytes,
                         "recomputed_layers": [lp.name for lp in p.layers if lp.recompute],
                         "host_fraction": p.host_fraction, "offload_activations": p.offload_activations,
                         "predicted_h2d_bytes_per_step": p.predicted_h2d_bytes_per_step,
                         "predicted_peak_bytes": p.predicted_peak_bytes,
                         "predicted_allgather_bytes_per_step": p.predicted_allgather_bytes_per_step,
                         "predicted_step_time_s": p.predicted_step_time_s,
                         "planning_seconds": p.planning_seconds, "profile_seconds": self.profile_seconds},
                "plan_adaptations": self.events}
