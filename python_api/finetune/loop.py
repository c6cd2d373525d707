"""The training loop of every engine (elastic, planned, pipelined, the peers): train() runs
one for the job's steps (RNG seeding or a checkpoint's restore, the learning-rate schedule,
the step through the engine's interface, checkpoints at the cadence, a message for a
non-finite loss) and returns the run's measurements. What an engine provides: [Note: the
engine interface] in engine.py."""

from __future__ import annotations

import contextlib
import math
import random
import statistics
import sys
import time

import torch

from .checkpoints import nonfinite, to_tuple, write_checkpoint
from .constants import ADAM_BETAS, ADAM_EPS
from .engine import steady
from .errors import FinetuneError
from .job import Job


def _seed_rng(seed: int, rank: int, device: torch.device) -> None:
    s = (seed * 1_000_003 + rank) & 0xFFFFFFFFFFFF
    torch.manual_seed(s)
    random.seed(s)
    if device.type == "cuda":
        torch.cuda.manual_seed(s)


def _restore_rng(rng: dict, device: torch.device) -> None:
    torch.set_rng_state(rng["torch"])
    random.setstate(to_tuple(rng["python"]))
    if device.type == "cuda" and rng.get("cuda") is not None:
        torch.cuda.set_rng_state(rng["cuda"], device)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# [Note: segments of a run]
# A run resumed one or more times is trained by several processes, each from some step to
# another, each possibly at its own pool budget (residency only: the losses are the same).
# trainer_state.json keeps one segment per process: its steps, pool budget, and the figures
# the report is made of (step times, all-gather bytes, peak memory). The report's figures are
# those of the last segment (the process that trained last); losses.csv and the loss curve
# span every step, labelled with each segment's budget. A resume of a checkpoint written at
# the planned last step (the process was killed after it, before the report) trains nothing
# and writes the adapter and the report from the checkpoint and its last segment.


def _segments_label(segments: list[dict]) -> str | None:
    """'elastic, budget all (steps 1-4), 0 (steps 5-8)', or None when one budget covers all."""
    if len({seg["pool_budget"] for seg in segments}) < 2:
        return None
    parts = [f"{seg['pool_budget']} (step{'s' if seg['last_step'] > seg['first_step'] else ''} {seg['first_step']}"
             f"{'-' + str(seg['last_step']) if seg['last_step'] > seg['first_step'] else ''})"
             for seg in segments if seg["last_step"] >= seg["first_step"]]
    return "elastic, budget " + ", ".join(parts)


def nan_message(job: Job, engine, loss: float, step: int, start: int, named) -> str:
    """Tell apart what a non-finite loss can come from. The base weights were checked when
    the model was built, and a resumed checkpoint's adapters and optimizer state when it was
    read, so: a non-finite loss on the first step of this process, before any update, is the
    forward pass overflowing in the model's dtype; a later one is training diverging (or,
    in float16, an update that overflowed)."""
    dtype = job.cfg.model.dtype
    broken = [n for n, p in named if nonfinite(p.detach())]
    head = f"{engine.name}: the loss is {loss} at step {step + 1}"
    if step == start:
        origin = "the initial adapters" if job.resume is None else f"the adapters of checkpoint {job.resume.path}"
        return (f"{head}, before any update, with finite base weights and {origin}: the forward pass overflows in "
                f"{dtype}" + ("; use --dtype bfloat16 (float32's range) or float32" if dtype == "float16" else
                              "; check the data and the model (this is not a learning-rate problem)"))
    updates = step - start
    adapters = (f"the adapters hold NaN/Inf ({broken[0]}{' and more' if len(broken) > 1 else ''})" if broken
                else "the adapters are still finite")
    fp16 = "; in float16, also try --dtype bfloat16" if dtype == "float16" else ""
    return (f"{head}, after {updates} update{'s' if updates > 1 else ''} from finite weights ({adapters}): training "
            f"diverged; lower --lr (now {job.cfg.training.lr:g}) or add --warmup-steps{fp16}")


def train_step(job: Job, engine, opt, step: int, counter) -> dict:
    """One optimizer step of `engine` (0-based `step`): its learning rate, its batch, the
    step ([Note: the engine interface] in engine.py); returns the loss (averaged over the
    ranks), the step's time and its traffic. What train() runs per step, and what
    bench/bench_frontier.py interleaves across engines."""
    device = job.device
    engine.set_learning_rate(opt, job.cfg.training, step)
    # The split of this step's W x micro_batch x grad_accum sequences: the job's, or a
    # planned run's (which may change it at this step: the same global batch, the same
    # windows across the ranks, [Note: adaptive accumulation] in planning.py).
    engine.before_step(step)
    batch = engine.batch(job, step)
    g0, c0, k0, h0 = engine.gathered_bytes(), counter.bytes, counter.calls, engine.h2d_bytes()
    _sync(device)
    t0 = time.perf_counter()
    loss = engine.run_step(job, batch, opt)
    _sync(device)
    elapsed = time.perf_counter() - t0
    return {"loss": loss, "time_s": elapsed, "gathered": engine.gathered_bytes() - g0,
            "counted": counter.bytes - c0, "calls": counter.calls - k0, "h2d": engine.h2d_bytes() - h0,
            "split": engine.split(), **engine.step_figures()}


# [Note: the optimizer state crosses ranks on the host]
# optimizer.pt is made of every rank's part of the optimizer state (a pipeline's stages each
# hold some: Engine.gather_states exchanges them) with every tensor copied to the host first,
# for every engine. A CUDA tensor pickled by one rank unpickles onto the device it was saved
# from: every rank would allocate on the other stages' devices, and optimizer.pt would name
# them (issue 30's review finding; tests/finetune/test_loop.py). Resuming maps the state back
# onto each rank's own parameters by name (`local_optimizer_state`).

def optimizer_state(engine, opt, names: list[str]) -> dict:
    """optimizer.pt's content: the state of every parameter of `engine.param_order()` under
    its name, in that order (a collective for an engine whose ranks hold parts of it)."""
    sd = opt.state_dict()
    mine = {names[i]: {k: v.detach().cpu() if torch.is_tensor(v) else v for k, v in entry.items()}
            for i, entry in sd["state"].items()}
    full = {}
    for part in engine.gather_states(mine):
        full.update(part)
    order = engine.param_order()
    group = {k: v for k, v in sd["param_groups"][0].items() if k != "params"}
    group["params"] = list(range(len(order)))
    return {"state_dict": {"state": {i: full[n] for i, n in enumerate(order) if n in full}, "param_groups": [group]},
            "param_names": order}


def local_optimizer_state(state: dict, param_names: list[str], names: list[str]) -> dict:
    """The entries of a checkpoint's optimizer state (its parameters `param_names`) for this
    rank's parameters `names`, as the optimizer's load_state_dict takes them."""
    index = {n: i for i, n in enumerate(param_names)}
    group = {k: v for k, v in state["param_groups"][0].items() if k != "params"}
    group["params"] = list(range(len(names)))
    return {"state": {j: state["state"][index[n]] for j, n in enumerate(names) if index[n] in state["state"]},
            "param_groups": [group]}


def train(job: Job, engine, counter, primary: bool) -> dict:
    """Train `engine.model` for the job's steps; return the run's measurements."""
    from tqdm import tqdm

    t, out, rank, W, device = job.cfg.training, job.cfg.output, job.rank, job.world_size, job.device
    named = engine.params()
    names = [n for n, _ in named]
    # An engine that drives its own optimizer (DeepSpeed's, [Note: engines that own their
    # optimizer step] in python_api/finetune/peers/__init__.py) hands it over; else plain AdamW.
    opt = engine.optimizer or adamw([p for _, p in named], t)
    start, losses, segments = 0, [], []
    if primary and job.resume is not None:
        r = job.resume
        if r.param_names != engine.param_order():
            raise FinetuneError(f"checkpoint {r.path}: its optimizer state belongs to other parameters than this model's adapters")
        try:
            engine.load_adapter(r.path)
            opt.load_state_dict(local_optimizer_state(r.optimizer, r.param_names, names))
        except (ValueError, KeyError, TypeError, RuntimeError) as exc:  # PipelineError is a ValueError
            # read_checkpoint checked the files; this is the last line, on every rank alike.
            raise FinetuneError(f"checkpoint {r.path} cannot be loaded: {type(exc).__name__}: {exc}") from exc
        start, losses, segments = r.step, list(r.losses), list(r.segments)
        _restore_rng(r.rng, device)
        job.checkpoint_step = r.step
    else:
        _seed_rng(t.seed, rank, device)
    mem = job.memory
    mem.reset_peak()
    # [Note: what "peak memory" means here] in measure.py: on CPU the tensor peak of the last
    # step, profiled, when this process runs 3 steps or more (the first warms up).
    profile_last = (engine.measures_tensor_peak and device.type == "cpu" and t.steps - start >= 3
                    and getattr(mem, "live_baseline", None) is not None)
    tensor_peak = rss_peak = None
    tokens_per_step = W * t.micro_batch * t.grad_accum * t.seq_len * engine.sequence_copies
    times, gathered, counted, h2d, splits = [], [], [], [], []
    per_step: dict[str, list] = {"calls": []}  # and the engine's own figures (Engine.step_figures)

    def segment(peak) -> dict:
        return {"first_step": start + 1, "last_step": start + len(times), "pool_budget": engine.budget_label(job.cfg.elastic),
                "step_times_s": list(times), "allgather_bytes_per_step": list(gathered),
                "allgather_bytes_counted_per_step": list(counted), "peak_memory_bytes": peak}

    def checkpoint(step: int, segs: list[dict]) -> None:
        write_checkpoint(job, step, losses, segs, optimizer_state(engine, opt, names), engine.save_adapter)

    bar = tqdm(total=t.steps, initial=start, desc=engine.name, disable=(rank != 0 or out.no_progress),
               dynamic_ncols=True, leave=True, file=sys.stderr)
    engine.train_mode()
    try:
        for step in range(start, t.steps):
            if profile_last and step == t.steps - 1:
                # The last step measures the tensor peak under the profiler: the resident
                # set is read before it, and its time is left out of tokens/s.
                rss_peak = mem.peak_above_baseline()
                box = {}
                tensor_peak = mem.tensor_peak(lambda: box.update(r=train_step(job, engine, opt, step, counter)),
                                              engine)
                r = box["r"]
            else:
                r = train_step(job, engine, opt, step, counter)
            loss = r.pop("loss")
            splits.append(r.pop("split"))
            times.append(r.pop("time_s"))
            gathered.append(r.pop("gathered"))
            counted.append(r.pop("counted"))
            h2d.append(r.pop("h2d"))
            for k, v in r.items():
                per_step.setdefault(k, []).append(v)
            if not math.isfinite(loss):
                # The loss is all-reduced and the adapters replicated: every rank raises alike.
                raise FinetuneError(nan_message(job, engine, loss, step, start, named))
            losses.append(loss)
            tok_s = _tokens_per_s(times[:-1] if tensor_peak is not None else times, tokens_per_step)
            bar.set_postfix(loss=f"{loss:.4f}", tok_s=f"{tok_s:.0f}" if tok_s else "-")
            bar.update(1)
            if primary and out.save_every and (step + 1) % out.save_every == 0 and step + 1 < t.steps:
                checkpoint(step + 1, segments + [segment(mem.peak_above_baseline())])
        bar.close()
        peak = rss_peak if profile_last else mem.peak_above_baseline()
        if device.type == "cuda" and engine.measures_tensor_peak:
            tensor_peak = peak
        first_step = start + 1
        if primary and times:
            segments = segments + [segment(peak)]
            checkpoint(t.steps, segments)
        elif primary and segments:
            # Resumed at the last step: nothing trained; report the figures of the process that
            # trained the last steps (see [Note: segments of a run]).
            last = segments[-1]
            times, gathered, counted = last["step_times_s"], last["allgather_bytes_per_step"], last["allgather_bytes_counted_per_step"]
            peak, first_step = last["peak_memory_bytes"], last["first_step"]
        heldout, probe_logits = engine.evaluate(job, logits=primary)
    except BaseException as exc:
        # [Note: a run that fails after training steps] (runner.py): what was trained is
        # reported, marked as failed, before the error goes on.
        bar.close()
        if times:
            partial = {"name": engine.name, "kind": engine.kind, "weight_format": engine.weight_format,
                       "status": "failed", "losses": list(losses),
                       "steps_run": len(times), "first_step": start + 1, "step_times_s": list(times),
                       "tokens_per_step": tokens_per_step, "tokens_per_s": _tokens_per_s(times, tokens_per_step),
                       "peak_memory_bytes": mem.peak_above_baseline(), "allgather_bytes_per_step": list(gathered),
                       "allgather_bytes_counted_per_step": list(counted),
                       "allgather_calls_per_step": list(per_step["calls"]),
                       "allgather_bytes_first_step": gathered[0] if gathered else 0,
                       "allgather_bytes_steady": steady(gathered), "h2d_bytes_per_step": list(h2d),
                       "h2d_bytes_steady": steady(h2d), "micro_batch_splits": list(splits),
                       "final_loss": losses[-1] if losses else None, "heldout_loss": None}
            with contextlib.suppress(AttributeError, TypeError):  # a few built-in exceptions take no attributes
                exc.partial_run = partial
        raise
    result = {
        "name": engine.name,
        "kind": engine.kind,
        "weight_format": engine.weight_format,  # the numerics its losses are compared within
        "status": "complete",
        "losses": losses,
        "steps_run": len(times),
        "first_step": first_step,
        "step_times_s": times,
        "tokens_per_step": tokens_per_step,
        "tokens_per_s": _tokens_per_s(times[:-1] if profile_last else times, tokens_per_step)
        or (tokens_per_step / times[0] if times else None),
        "peak_memory_bytes": peak,
        "allgather_bytes_per_step": gathered,
        "allgather_bytes_counted_per_step": counted,
        "allgather_bytes_first_step": gathered[0] if gathered else 0,
        "allgather_bytes_steady": steady(gathered),
        "h2d_bytes_per_step": h2d,
        "h2d_bytes_steady": steady(h2d),
        "micro_batch_splits": splits,
        "final_loss": losses[-1],
        "heldout_loss": heldout,
    }
    result.update(engine.run_figures(per_step, tensor_peak, mem))
    if primary:
        result["segments"] = [{k: v for k, v in seg.items() if k in ("first_step", "last_step", "pool_budget")}
                              for seg in segments]
        label = _segments_label(segments)
        if label is not None:
            result["losses_label"] = label
        result["probe_logits"] = probe_logits
    return result


def adamw(params, training) -> torch.optim.AdamW:
    """The optimizer of every run: AdamW with the job's hyper-parameters (`training`: the
    training options, TrainingConfig)."""
    return torch.optim.AdamW(params, lr=training.lr, betas=ADAM_BETAS, eps=ADAM_EPS, weight_decay=training.weight_decay)


def _tokens_per_s(times: list[float], tokens_per_step: int) -> float | None:
    """Steady state: global tokens per step over the median time of the steps after the first
    of this process (the first learns the layer order, gathers everything and warms the
    allocators). The median, not the mean: on a shared machine a few steps stall for reasons
    that have nothing to do with the run."""
    if len(times) < 2:
        return None
    return tokens_per_step / statistics.median(times[1:])
