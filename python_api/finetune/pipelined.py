"""The pipelined run of the CLI (`--pp N`, `--compare-pp N`): PipelinedEngine, the engine
interface (engine.py) on elastic_kernels.api.pipeline, trained by the loop of every engine
(loop.py); and the choice of the job's main engine (primary_engine, planned_engine).

[Note: the pipelined run and the global batch]
The global batch of a step stays --micro-batch x --grad-accum x world size sequences whatever
the pipeline degree. The world is pp x dp; dp group d (the ranks holding one replica of
every stage) takes the d-th of dp equal shares of the step's windows (`TokenWindows.batch`
with dp "ranks": the same set of windows as the pp = 1 run deals to its W ranks, [Note:
batches depend only on (seed, step)]), --micro-batch x --grad-accum x pp sequences, cut into
--micro-batches M micro-batches (default --grad-accum x pp: micro-batches of --micro-batch
sequences, so each has the size the pp = 1 run's have). Every rank of a dp group builds the
same batch: the first stage embeds it, the last computes the loss on it. The loss is the mean
over the dp x M micro-batches of equal size, the gradient that of that mean: the pp = 1 run's
numbers, summed in another order (within fp32 rounding; bit for bit when nothing is
reordered, tests/finetune/test_pipelined_finetune.py).

[Note: pipelined checkpoints]
A checkpoint of a pipelined run has the pp = 1 run's format: one PEFT adapter with every
stage's adapters (PipelinedModel.save_adapter), and optimizer.pt with AdamW's state of every
adapter parameter under the names and in the order the pp = 1 model lists them (each stage's
state gathered over the pp group, on the host: [Note: the optimizer state crosses ranks on
the host] in loop.py). Resuming maps them back onto each rank's own adapters.
The run configuration of a pipelined run adds pp, schedule and micro-batch count (they
change the order of the gradient sums), so a checkpoint resumes only at the same ones; the
pack layout, residency and window may change (they change no bit).
"""

from __future__ import annotations

import statistics

import torch
import torch.nn as nn

from ..distributed.agree import exchange
from ..loading import LoadError
from ..pipeline import PipelinedModel, PipelineError, PipelineLayout, pipeline_groups
from .agreement import agree_error
from .engine import Engine, steady
from .engines import ElasticEngine, _collective_build, _collective_build_on_meta, _nonfinite_loaded
from .errors import FinetuneError
from .models import lora_config
from .pipeline_layout import layout_of
from .policy import elastic_policy


class PipelinedEngine(Engine):
    """The job's model as a pipeline ([Note: the pipelined run and the global batch]): each
    step one PipelinedModel.train_step over M micro-batches; the checkpoint in the pp = 1
    format ([Note: pipelined checkpoints])."""

    kind = "pipelined"
    measures_tensor_peak = False  # a pipelined run reports its peak memory only (its last step is not profiled)

    def __init__(self, job, pp: int, layout: PipelineLayout | None = None, micro_batch_size: int | None = None,
                 plan=None, option: str = "--pp"):
        """`layout` and `micro_batch_size`: a planned layout (`plan`, a PipelinePlan); else the
        options' (`layout_of`). `option`: the option that asked for it, named in errors."""
        t = job.cfg.training
        if layout is None:
            layout, mbs = layout_of(t, job.cfg.pipeline, job.world_size, pp, job.spec.config, option)
        else:
            mbs = micro_batch_size
        self.layout, self.micro_batch_size, self.plan = layout, mbs, plan
        try:
            self.groups = pipeline_groups(pp, job.device, job.cfg.elastic.timeout_s)
        except PipelineError as exc:
            raise FinetuneError(f"{option} {pp}: {exc}") from exc
        if job.spec.embedded:
            lm, source = _collective_build(job), None
        else:
            lm, source = _collective_build_on_meta(job)
        try:
            self.model = PipelinedModel(lm, lora_config(job.cfg.lora, t.seed), elastic_policy(job.cfg, None), layout, self.groups,
                                        micro_batch_size=mbs, seq_len=t.seq_len, source=source, device=job.device)
        except (PipelineError, LoadError) as exc:  # raised on every rank (agreed)
            raise FinetuneError(f"{option} {pp}: {exc}") from exc
        if source is not None:
            errors = [_nonfinite_loaded(pack, rt, job.spec) for pack, rt in
                      zip(self.model.packs.values(), self.model.runtimes.values())]
            agree_error(next((e for e in errors if e), None), job.world_size)
        sizes = sorted({layout.boundaries[k + 1] - layout.boundaries[k] for k in range(layout.n_packs)})
        where = ", weights on host" if job.cfg.host.weights_on == "host" else ""
        self.name = (f"{'planned ' if plan is not None else ''}pipelined, pp {layout.pp} x dp {layout.dp}, "
                     f"{layout.schedule}, {layout.n_packs} packs of {'/'.join(map(str, sizes))} layers, "
                     f"{layout.residency[0]}{where}")
        self.frozen_bytes = self.model.frozen_bytes_of_packs()
        self.micro_batch, self.grad_accum = t.micro_batch, t.grad_accum
        self.weight_format = job.cfg.weights.weight_format

    # ------------------------------------------------------------ a step

    def params(self) -> list[tuple[str, nn.Parameter]]:
        return list(self.model.named_parameters())

    def train_mode(self) -> None:
        """Nothing: train_step puts this rank's packs in training mode."""

    def batch(self, job, step: int) -> torch.Tensor:
        """This dp group's share of step `step`: [M x micro-batch size, seq_len], on the device."""
        m = self.layout.micro_batches
        b = job.windows.batch(job.cfg.training.seed, step, self.groups.dp, self.groups.dp_rank, self.micro_batch_size, m)
        return b.reshape(m * self.micro_batch_size, -1).to(job.device)

    def run_step(self, job, batch: torch.Tensor, opt) -> float:
        loss = self.model.train_step(batch)  # the loss agreed over the world
        self.optimizer_step(opt)
        return loss

    def split(self) -> tuple[int, int]:
        return self.micro_batch_size, self.layout.micro_batches

    # ------------------------------------------------------------ figures

    def gathered_bytes(self) -> int:
        return self.model.stats()["allgather_bytes"]

    def h2d_bytes(self) -> int:
        return self.model.stats()["h2d_bytes"]

    def step_figures(self) -> dict:
        """The step's P2P bytes sent by this rank and each rank's idle share of it (the bubble)."""
        st = self.model.last_step
        return {"p2p": st["p2p_send_bytes"],
                "idle": [round(s / st["step_s"], 4) if st["step_s"] > 0 else 0.0 for s in st["idle_s_per_rank"]]}

    def run_figures(self, per_step: dict[str, list], tensor_peak: int | None, memory) -> dict:
        p2p, idle = per_step.get("p2p", []), per_step.get("idle", [])
        return {
            "p2p_bytes_per_step": p2p,
            "p2p_bytes_steady": steady(p2p),
            "bubble_per_rank_per_step": idle,
            "bubble_per_rank": [statistics.median(s[r] for s in idle[1:] or idle) for r in range(len(idle[0]))]
            if idle else [],
            "pipeline": self.layout.to_dict(),
            "pipeline_plan": None if self.plan is None else self.plan.to_dict(),
            "frozen_bytes": self.frozen_bytes,
            "frozen_bytes_held": self.model.frozen_bytes_held(),
            "runtime_stats": self.model.stats(),
        }

    # ------------------------------------------------------------ checkpoints

    def budget_label(self, elastic) -> str:
        return "pipelined"

    def param_order(self) -> list[str]:
        """The pp = 1 model's order ([Note: pipelined checkpoints])."""
        return self.model.param_order()

    def gather_states(self, mine: dict) -> list[dict]:
        """Every stage's optimizer state: a collective over the pp group."""
        return exchange(mine, self.model.groups.pp_group, what="gathering the optimizer state of every stage")

    def load_adapter(self, path: str) -> None:
        self.model.load_adapter(path)

    def save_adapter(self, job, folder: str, what: str) -> None:
        """PipelinedModel.save_adapter (a collective), its failure one message on every rank."""
        err = None
        try:
            self.model.save_adapter(folder)
        except PipelineError as exc:
            err = f"{what}: {exc}"
        agree_error(err, job.world_size)

    def adapters(self) -> dict:
        """Every stage's adapters under PEFT's names, a copy (a collective over the pp group)."""
        return {k: v.clone() for k, v in self.model.adapter_state_dict().items()}

    # ------------------------------------------------------------ the end

    def evaluate(self, job, logits: bool) -> tuple[float, torch.Tensor | None]:
        """The held-out loss of the probe batch, and its logits from a rank of dp group 0 that
        holds the last pack (a collective either way)."""
        heldout, mine = self.model.evaluate(job.windows.probe)
        every = exchange(None if mine is None or self.model.groups.dp_rank != 0 else mine.float().cpu(),
                         what="the probe's logits")
        return heldout, next(x for x in every if x is not None) if logits else None

    def close(self) -> None:
        self.model.close()


def primary_engine(job):
    """The job's main engine: pipelined with --pp > 1, else the elastic one (planned with --plan
    auto); with --plan auto and --pp auto or > 1, the one the planner chooses ([Note: planning a
    pipeline])."""
    plan, pp = job.cfg.planner.plan, job.cfg.pipeline.pp
    if plan == "auto" and (pp == "auto" or pp > 1):
        return planned_engine(job)
    if pp != 1:
        return PipelinedEngine(job, pp)
    return ElasticEngine(job, job.cfg.elastic.pool_budget, planned=plan == "auto")


# [Note: planning a pipeline]
# `--plan auto --pp auto`: the pp = 1 model is built and profiled (measure_profile: per-layer
# compute and saved bytes, the links; timings MAX-reduced over the ranks, so every rank holds
# the same profile), the plain planner plans it under --memory-cap (its predicted step: pp1),
# the pipeline planner searches pipelines on the same profile (planner/pipeline_search.py,
# [Note: the pipeline search]) and a pipeline is run only if its predicted step is shorter
# than pp1's; otherwise the planned pp = 1 run of python_api/finetune/planning.py. The decision
# and every simulated candidate go to pipeline_plan.json. `--plan auto --pp N` (N > 1) searches
# only degree N, pp = 1 not a candidate. --micro-batches, if given, is kept.


def planned_engine(job):
    import gc

    from ..pipeline.profile import pipeline_profile
    from ..planner.pipeline_search import plan_pipeline
    from ..planner.search import PlanningError
    from ..planning.apply import plan as plan_pp1
    from ..planning.measure import measure_profile
    from .files import agreed_write, write_json
    from .planning import _host_memory_share

    W = job.world_size
    t, pp_options, budget = job.cfg.training, job.cfg.pipeline, job.cfg.elastic.pool_budget
    memory_cap = job.cfg.planner.memory_cap
    cap = memory_cap if isinstance(memory_cap, int) else (
        _host_memory_share() if job.device.type == "cpu" else None)
    elastic = ElasticEngine(job, budget)
    batch = job.windows.batch(t.seed, 0, W, job.rank, t.micro_batch, 1)[0].to(job.device)
    profile = measure_profile(elastic.model, [batch], capacity_bytes=cap if job.device.type == "cpu" else None)
    cap = min(cap, profile.capacity_bytes) if cap is not None else profile.capacity_bytes
    global_batch = W * t.micro_batch * t.grad_accum
    try:
        pp1 = plan_pp1(elastic.model, profile, cap, global_batch).predicted_step_time_s
    except PlanningError:
        pp1 = None
    restrict = {}
    if pp_options.pp != "auto":
        restrict["pp"] = pp_options.pp
    if pp_options.micro_batches:
        restrict["micro_batches"] = pp_options.micro_batches
    try:
        pprof = pipeline_profile(job.spec.meta_model(), lora_config(job.cfg.lora, t.seed), elastic_policy(job.cfg, None), profile,
                                 world_size=W, seq_len=t.seq_len)
        pplan = plan_pipeline(pprof, cap, global_batch, pp1_step_s=pp1 if pp_options.pp == "auto" else None, **restrict)
    except PipelineError as exc:
        raise FinetuneError(f"--plan auto: {exc}") from exc
    del elastic
    gc.collect()
    if job.rank == 0:
        print(f"elastic-finetune: pipeline planner: {pplan.describe()} ({pplan.candidates} candidates, "
              f"{pplan.simulated} simulated, {pplan.planning_seconds:.2f} s)", flush=True)
    agreed_write(job, lambda: write_json(f"{job.save_dir}/pipeline_plan.json", pplan.to_dict()) if job.rank == 0
                 else None, "pipeline_plan.json was not written")
    if pplan.pipelined:
        pred = pplan.prediction
        return PipelinedEngine(job, pred.layout.pp, layout=pred.layout, micro_batch_size=pred.micro_batch_size,
                               plan=pplan)
    if pp1 is None:
        raise FinetuneError(f"--plan auto: no plan fits {cap} bytes per rank, at pp 1 or pipelined")
    return ElasticEngine(job, budget, planned=True)
