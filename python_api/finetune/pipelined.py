"""The pipelined run of the CLI (`--pp N`, `--compare-pp N`): PipelinedEngine and its training
loop, checkpoints and adapter, on elastic_kernels.api.pipeline.

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
state gathered over the pp group). Resuming maps them back onto each rank's own adapters.
The run configuration of a pipelined run adds pp, schedule and micro-batch count (they
change the order of the gradient sums), so a checkpoint resumes only at the same ones; the
pack layout, residency and window may change (they change no bit).
"""

from __future__ import annotations

import math
import statistics
import sys
import time

import torch
import torch.nn as nn

from ..distributed.agree import exchange
from ..loading import LoadError
from ..nn import PEFT_PREFIX, adapter_state_dict
from ..pipeline import PipelinedModel, PipelineError, PipelineLayout, pipeline_groups
from .agreement import agree_error
from .checkpoints import write_checkpoint
from .constants import ADAM_BETAS, ADAM_EPS
from .engines import ElasticEngine, _collective_build, _collective_build_on_meta, _nonfinite_loaded
from .errors import FinetuneError
from .files import save_adapter_agreed as save_elastic_adapter_agreed
from .loop import (
    _lr_at,
    _restore_rng,
    _seed_rng,
    _segments_label,
    _sync,
    _tokens_per_s,
    nan_message,
    train,
)
from .models import lora_config_of
from .options import policy_of
from .pipeline_layout import compare_pp_is_main, layer_costs, layout_of, pipeline_notices  # noqa: F401 - re-exported


class PipelinedEngine:
    """The job's model as a pipeline ([Note: the pipelined run and the global batch])."""

    kind = "pipelined"

    def __init__(self, job, pp: int, layout: PipelineLayout | None = None, micro_batch_size: int | None = None,
                 plan=None, option: str = "--pp"):
        """`layout` and `micro_batch_size`: a planned layout (`plan`, a PipelinePlan); else the
        options' (`layout_of`). `option`: the option that asked for it, named in errors."""
        args = job.args
        if layout is None:
            layout, mbs = layout_of(args, job.world_size, pp, job.spec.config, option)
        else:
            mbs = micro_batch_size
        self.layout, self.micro_batch_size, self.plan = layout, mbs, plan
        try:
            self.groups = pipeline_groups(pp, job.device, args.timeout_s)
        except PipelineError as exc:
            raise FinetuneError(f"{option} {pp}: {exc}") from exc
        if job.spec.embedded:
            lm, source = _collective_build(job), None
        else:
            lm, source = _collective_build_on_meta(job)
        try:
            self.model = PipelinedModel(lm, lora_config_of(args), policy_of(args, None), layout, self.groups,
                                        micro_batch_size=mbs, seq_len=args.seq_len, source=source, device=job.device)
        except (PipelineError, LoadError) as exc:  # raised on every rank (agreed)
            raise FinetuneError(f"{option} {pp}: {exc}") from exc
        if source is not None:
            errors = [_nonfinite_loaded(pack, rt, job.spec) for pack, rt in
                      zip(self.model.packs.values(), self.model.runtimes.values())]
            agree_error(next((e for e in errors if e), None), job.world_size)
        sizes = sorted({layout.boundaries[k + 1] - layout.boundaries[k] for k in range(layout.n_packs)})
        where = ", weights on host" if args.weights_on == "host" else ""
        self.name = (f"{'planned ' if plan is not None else ''}pipelined, pp {layout.pp} x dp {layout.dp}, "
                     f"{layout.schedule}, {layout.n_packs} packs of {'/'.join(map(str, sizes))} layers, "
                     f"{layout.residency[0]}{where}")
        self.frozen_bytes = self.model.frozen_bytes_of_packs()
        self.micro_batch, self.grad_accum = args.micro_batch, args.grad_accum

    def params(self) -> list[tuple[str, nn.Parameter]]:
        return list(self.model.named_parameters())

    def batch(self, job, step: int) -> torch.Tensor:
        """This dp group's share of step `step`: [M x micro-batch size, seq_len]."""
        m = self.layout.micro_batches
        b = job.windows.batch(job.args.seed, step, self.groups.dp, self.groups.dp_rank, self.micro_batch_size, m)
        return b.reshape(m * self.micro_batch_size, -1)

    def close(self) -> None:
        self.model.close()


# ---------------------------------------------------------------- checkpoints

def gathered_optimizer_state(model: PipelinedModel, opt: torch.optim.Optimizer, names: list[str]) -> dict:
    """optimizer.pt's content in the pp = 1 format ([Note: pipelined checkpoints]); a
    collective over the pp group."""
    sd = opt.state_dict()
    # On the host before pickling: a CUDA tensor unpickles onto the device it was saved from, so
    # every rank would allocate on the other stages' devices, and optimizer.pt would name them.
    mine = {names[i]: {k: v.detach().cpu() if torch.is_tensor(v) else v for k, v in entry.items()}
            for i, entry in sd["state"].items()}
    every = exchange(mine, model.groups.pp_group, what="gathering the optimizer state of every stage")
    full = {}
    for part in every:
        full.update(part)
    order = model.param_order()
    group = {k: v for k, v in sd["param_groups"][0].items() if k != "params"}
    group["params"] = list(range(len(order)))
    return {"state_dict": {"state": {i: full[n] for i, n in enumerate(order) if n in full}, "param_groups": [group]},
            "param_names": order}


def local_optimizer_state(state: dict, param_names: list[str], names: list[str]) -> dict:
    """The entries of a pp = 1-format optimizer state for this rank's parameters `names`."""
    index = {n: i for i, n in enumerate(param_names)}
    group = {k: v for k, v in state["param_groups"][0].items() if k != "params"}
    group["params"] = list(range(len(names)))
    return {"state": {j: state["state"][index[n]] for j, n in enumerate(names) if index[n] in state["state"]},
            "param_groups": [group]}


def save_adapter_agreed(job, model: PipelinedModel, folder: str, what: str) -> None:
    """PipelinedModel.save_adapter, its failure one message on every rank."""
    err = None
    try:
        model.save_adapter(folder)
    except PipelineError as exc:
        err = f"{what}: {exc}"
    agree_error(err, job.world_size)


# ---------------------------------------------------------------- training

def train_pipelined(job, engine: PipelinedEngine, counter, primary: bool) -> dict:
    """train() of python_api/finetune/loop.py for a pipelined engine: the same learning rate,
    RNG, checkpoints and measurements, one PipelinedModel.train_step per optimizer step."""
    from tqdm import tqdm

    args, rank, W, device = job.args, job.rank, job.world_size, job.device
    model = engine.model
    named = engine.params()
    names = [n for n, _ in named]
    opt = torch.optim.AdamW([p for _, p in named], lr=args.lr, betas=ADAM_BETAS, eps=ADAM_EPS,
                            weight_decay=args.weight_decay)
    start, losses, segments = 0, [], []
    if primary and job.resume is not None:
        r = job.resume
        if r.param_names != model.param_order():
            raise FinetuneError(f"checkpoint {r.path}: its optimizer state belongs to other parameters than this "
                                "model's adapters")
        try:
            model.load_adapter(r.path)
            opt.load_state_dict(local_optimizer_state(r.optimizer, r.param_names, names))
        except (PipelineError, ValueError, KeyError, TypeError, RuntimeError) as exc:
            raise FinetuneError(f"checkpoint {r.path} cannot be loaded: {type(exc).__name__}: {exc}") from exc
        start, losses, segments = r.step, list(r.losses), list(r.segments)
        _restore_rng(r.rng, device)
        job.checkpoint_step = r.step
    else:
        _seed_rng(args.seed, rank, device)
    mem = job.memory
    mem.reset_peak()
    tokens_per_step = W * args.micro_batch * args.grad_accum * args.seq_len
    times, gathered, counted, h2d, p2p, idle = [], [], [], [], [], []

    def segment(peak) -> dict:
        return {"first_step": start + 1, "last_step": start + len(times), "pool_budget": "pipelined",
                "step_times_s": list(times), "allgather_bytes_per_step": list(gathered),
                "allgather_bytes_counted_per_step": list(counted), "peak_memory_bytes": peak}

    def checkpoint(step: int, segs: list[dict]) -> None:
        state = gathered_optimizer_state(model, opt, names)
        write_checkpoint(job, model, opt, names, step, losses, segs, optimizer_state=state,
                         save_adapter=lambda folder, what: save_adapter_agreed(job, model, folder, what))

    bar = tqdm(total=args.steps, initial=start, desc=engine.name, disable=(rank != 0 or args.no_progress),
               dynamic_ncols=True, leave=True, file=sys.stderr)
    for step in range(start, args.steps):
        for group in opt.param_groups:
            group["lr"] = _lr_at(args, step)
        batch = engine.batch(job, step).to(device)
        c0 = counter.bytes
        _sync(device)
        t0 = time.perf_counter()
        loss = model.train_step(batch)
        opt.step()
        opt.zero_grad(set_to_none=True)
        _sync(device)
        times.append(time.perf_counter() - t0)
        st = model.last_step
        gathered.append(st["allgather_bytes"])
        counted.append(counter.bytes - c0)
        h2d.append(st["h2d_bytes"])
        p2p.append(st["p2p_send_bytes"])
        idle.append([round(s / st["step_s"], 4) if st["step_s"] > 0 else 0.0 for s in st["idle_s_per_rank"]])
        if not math.isfinite(loss):
            raise FinetuneError(nan_message(job, engine, loss, step, start, named))
        losses.append(loss)
        steady = _tokens_per_s(times, tokens_per_step)
        bar.set_postfix(loss=f"{loss:.4f}", tok_s=f"{steady:.0f}" if steady else "-")
        bar.update(1)
        if primary and args.save_every and (step + 1) % args.save_every == 0 and step + 1 < args.steps:
            checkpoint(step + 1, segments + [segment(mem.peak_above_baseline())])
    bar.close()
    peak = mem.peak_above_baseline()
    first_step = start + 1
    if primary and times:
        segments = segments + [segment(peak)]
        checkpoint(args.steps, segments)
    elif primary and segments:  # resumed at the last step: the figures of the process that trained last
        last = segments[-1]
        times, gathered, counted = last["step_times_s"], last["allgather_bytes_per_step"], \
            last["allgather_bytes_counted_per_step"]
        peak, first_step = last["peak_memory_bytes"], last["first_step"]
    heldout, logits = model.evaluate(job.windows.probe)
    every = exchange(None if logits is None or model.groups.dp_rank != 0 else logits.float().cpu(),
                     what="the probe's logits")
    probe_logits = next(x for x in every if x is not None)

    def steady_of(xs):
        return (sum(xs[1:]) / (len(xs) - 1)) if len(xs) > 1 else float(xs[0] if xs else 0)

    result = {
        "name": engine.name,
        "kind": engine.kind,
        "losses": losses,
        "steps_run": len(times),
        "first_step": first_step,
        "step_times_s": times,
        "tokens_per_step": tokens_per_step,
        "tokens_per_s": _tokens_per_s(times, tokens_per_step) or (tokens_per_step / times[0] if times else None),
        "peak_memory_bytes": peak,
        "allgather_bytes_per_step": gathered,
        "allgather_bytes_counted_per_step": counted,
        "allgather_bytes_first_step": gathered[0] if gathered else 0,
        "allgather_bytes_steady": steady_of(gathered),
        "h2d_bytes_per_step": h2d,
        "h2d_bytes_steady": steady_of(h2d),
        "p2p_bytes_per_step": p2p,
        "p2p_bytes_steady": steady_of(p2p),
        "bubble_per_rank_per_step": idle,
        "bubble_per_rank": [statistics.median(s[r] for s in idle[1:] or idle) for r in range(W)] if idle else [],
        "micro_batch_splits": [(engine.micro_batch_size, engine.layout.micro_batches)] * len(times),
        "final_loss": losses[-1],
        "heldout_loss": heldout,
        "pipeline": engine.layout.to_dict(),
        "pipeline_plan": None if engine.plan is None else engine.plan.to_dict(),
        "frozen_bytes": engine.frozen_bytes,
        "frozen_bytes_held": model.frozen_bytes_held(),
        "runtime_stats": model.stats(),
    }
    if primary:
        result["segments"] = [{k: v for k, v in seg.items() if k in ("first_step", "last_step", "pool_budget")}
                              for seg in segments]
        label = _segments_label(segments)
        if label is not None:
            result["losses_label"] = label
        result["probe_logits"] = probe_logits
    return result


# ---------------------------------------------------------------- what runner.run calls

def primary_engine(job):
    """The job's main engine: pipelined with --pp > 1, else the elastic one (planned with --plan
    auto); with --plan auto and --pp auto or > 1, the one the planner chooses ([Note: planning a
    pipeline])."""
    args = job.args
    if args.plan == "auto" and (args.pp == "auto" or args.pp > 1):
        return planned_engine(job)
    if args.pp != 1:
        return PipelinedEngine(job, args.pp)
    return ElasticEngine(job, args.pool_budget, planned=args.plan == "auto")


# [Note: planning a pipeline]
# `--plan auto --pp auto`: the pp = 1 model is built and profiled (measure_profile: per-layer
# compute and saved bytes, the links; timings MAX-reduced over the ranks, so every rank holds
# the same profile), the plain planner plans it under --memory-cap (its predicted step: pp1),
# the pipeline planner searches pipelines on the same profile (planner/pipeline_model.py,
# [Note: the pipeline search]) and a pipeline is run only if its predicted step is shorter
# than pp1's; otherwise the planned pp = 1 run of python_api/finetune/planning.py. The decision
# and every simulated candidate go to pipeline_plan.json. `--plan auto --pp N` (N > 1) searches
# only degree N, pp = 1 not a candidate. --micro-batches, if given, is kept.


def planned_engine(job):
    import gc

    from ..pipeline.profile import pipeline_profile
    from ..planner.pipeline_model import plan_pipeline
    from ..planner.search import PlanningError
    from ..planning.apply import plan as plan_pp1
    from ..planning.measure import measure_profile
    from .files import agreed_write, write_json
    from .planning import _host_memory_share

    args, W = job.args, job.world_size
    cap = args.memory_cap if isinstance(args.memory_cap, int) else (
        _host_memory_share() if job.device.type == "cpu" else None)
    elastic = ElasticEngine(job, args.pool_budget)
    batch = job.windows.batch(args.seed, 0, W, job.rank, args.micro_batch, 1)[0].to(job.device)
    profile = measure_profile(elastic.model, [batch], capacity_bytes=cap if job.device.type == "cpu" else None)
    cap = min(cap, profile.capacity_bytes) if cap is not None else profile.capacity_bytes
    global_batch = W * args.micro_batch * args.grad_accum
    try:
        pp1 = plan_pp1(elastic.model, profile, cap, global_batch).predicted_step_time_s
    except PlanningError:
        pp1 = None
    restrict = {}
    if args.pp != "auto":
        restrict["pp"] = args.pp
    if args.micro_batches:
        restrict["micro_batches"] = args.micro_batches
    try:
        pprof = pipeline_profile(job.spec.meta_model(), lora_config_of(args), policy_of(args, None), profile,
                                 world_size=W, seq_len=args.seq_len)
        pplan = plan_pipeline(pprof, cap, global_batch, pp1_step_s=pp1 if args.pp == "auto" else None, **restrict)
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
    return ElasticEngine(job, args.pool_budget, planned=True)


def train_engine(job, engine, counter, primary: bool) -> dict:
    return (train_pipelined if engine.kind == "pipelined" else train)(job, engine, counter, primary=primary)


def engine_adapters(engine) -> dict:
    """The engine's adapters under PEFT's names, a copy (every stage's: a collective for a pipeline)."""
    full = engine.model.adapter_state_dict() if engine.kind == "pipelined" else adapter_state_dict(engine.model)
    return {k: v.clone() for k, v in full.items() if k.startswith(PEFT_PREFIX)}


def save_engine_adapter(job, engine, folder: str, what: str) -> None:
    if engine.kind == "pipelined":
        save_adapter_agreed(job, engine.model, folder, what)
    else:
        save_elastic_adapter_agreed(job, engine.model, folder, what)


def close_engine(engine) -> None:
    """Release what an engine holds beyond its model (a pipeline's groups, DeepSpeed's hooks
    and buffers); the engines without a close() hold nothing more."""
    if hasattr(engine, "close"):
        engine.close()
