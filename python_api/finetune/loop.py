"""The training loop: train() runs an engine for the job's steps (learning-rate schedule, RNG
seeding and restore, checkpoints at the cadence, a message for a non-finite loss) and
returns the run's measurements."""

from __future__ import annotations

import contextlib
import math
import random
import statistics
import sys
import time

import torch
import torch.distributed as dist

from ..nn import load_adapter
from .checkpoints import nonfinite, to_tuple, write_checkpoint
from .constants import ADAM_BETAS, ADAM_EPS
from .errors import FinetuneError
from .job import Job
from .options import budget_label, lr_at


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


def _lr_at(args, step: int) -> float:
    return lr_at(args, step)  # [Note: learning-rate defaults] in options.py


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
    args = job.args
    dtype = args.dtype
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
            f"diverged; lower --lr (now {args.lr:g}) or add --warmup-steps{fp16}")


def train_step(job: Job, engine, opt, step: int, counter) -> dict:
    """One optimizer step of `engine` (0-based `step`): its learning rate, the job's batch for
    that step, accumulation, the optimizer; returns the loss (averaged over the ranks), the
    step's time and its traffic. What train() runs per step, and what bench/bench_frontier.py
    interleaves across engines."""
    args, rank, W, device = job.args, job.rank, job.world_size, job.device
    model = engine.model
    for group in opt.param_groups:
        group["lr"] = _lr_at(args, step)
    # The split of this step's W x micro_batch x grad_accum sequences: the job's, or a
    # planned run's (which may change it at this step: the same global batch, the same
    # windows across the ranks, [Note: adaptive accumulation] in planning.py).
    engine.before_step(step)
    mb, accum = engine.micro_batch, engine.grad_accum
    batch = {k: v.to(device) for k, v in job.windows.inputs(args.seed, step, W, rank, mb, accum).items()}
    g0, c0, k0, h0 = engine.gathered_bytes(), counter.bytes, counter.calls, engine.h2d_bytes()
    _sync(device)
    t0 = time.perf_counter()
    total = torch.zeros((), dtype=torch.float64, device=device)
    for a in range(accum):
        with engine.accumulate(is_last=a == accum - 1):
            out = model(**model_inputs(batch, a))
            (out.loss / accum).backward()
        total += out.loss.detach().double()
    if hasattr(engine, "optimizer_step"):
        engine.optimizer_step()
    else:
        opt.step()
        opt.zero_grad(set_to_none=True)
    dist.all_reduce(total)
    loss = total.item() / (accum * W)
    _sync(device)
    elapsed = time.perf_counter() - t0
    return {"loss": loss, "time_s": elapsed, "gathered": engine.gathered_bytes() - g0,
            "counted": counter.bytes - c0, "calls": counter.calls - k0, "h2d": engine.h2d_bytes() - h0,
            "split": (mb, accum)}


def train(job: Job, engine, counter, primary: bool) -> dict:
    """Train `engine.model` for the job's steps; return the run's measurements."""
    from tqdm import tqdm

    args, rank, W, device = job.args, job.rank, job.world_size, job.device
    model = engine.model
    named = engine.params()
    names = [n for n, _ in named]
    # An engine that drives its own optimizer (DeepSpeed's, [Note: engines that own their
    # optimizer step] in python_api/finetune/peers/__init__.py) hands it over; else plain AdamW.
    opt = getattr(engine, "optimizer", None) or adamw([p for _, p in named], args)
    start, losses, segments = 0, [], []
    if primary and job.resume is not None:
        r = job.resume
        if r.param_names != names:
            raise FinetuneError(f"checkpoint {r.path}: its optimizer state belongs to other parameters than this model's adapters")
        try:
            load_adapter(model, r.path)
            opt.load_state_dict(r.optimizer)
        except (ValueError, KeyError, TypeError, RuntimeError) as exc:
            # read_checkpoint checked the files; this is the last line, on every rank alike.
            raise FinetuneError(f"checkpoint {r.path} cannot be loaded: {type(exc).__name__}: {exc}") from exc
        start, losses, segments = r.step, list(r.losses), list(r.segments)
        _restore_rng(r.rng, device)
        job.checkpoint_step = r.step
    else:
        _seed_rng(args.seed, rank, device)
    mem = job.memory
    mem.reset_peak()
    # [Note: what "peak memory" means here] in measure.py: on CPU the tensor peak of the last
    # step, profiled, when this process runs 3 steps or more (the first warms up).
    profile_last = device.type == "cpu" and args.steps - start >= 3 and getattr(mem, "live_baseline", None) is not None
    tensor_peak = rss_peak = None
    tokens_per_step = W * args.micro_batch * args.grad_accum * args.seq_len
    times, gathered, counted, calls, h2d, splits = [], [], [], [], [], []

    def segment(peak) -> dict:
        return {"first_step": start + 1, "last_step": start + len(times), "pool_budget": budget_label(args.pool_budget),
                "step_times_s": list(times), "allgather_bytes_per_step": list(gathered),
                "allgather_bytes_counted_per_step": list(counted), "peak_memory_bytes": peak}

    bar = tqdm(total=args.steps, initial=start, desc=engine.name, disable=(rank != 0 or args.no_progress),
               dynamic_ncols=True, leave=True, file=sys.stderr)
    model.train()
    try:
        for step in range(start, args.steps):
            if profile_last and step == args.steps - 1:
                # The last step measures the tensor peak under the profiler: the resident
                # set is read before it, and its time is left out of tokens/s.
                rss_peak = mem.peak_above_baseline()
                box = {}
                tensor_peak = mem.tensor_peak(lambda: box.update(r=train_step(job, engine, opt, step, counter)),
                                              engine)
                r = box["r"]
            else:
                r = train_step(job, engine, opt, step, counter)
            loss = r["loss"]
            splits.append(r["split"])
            times.append(r["time_s"])
            gathered.append(r["gathered"])
            counted.append(r["counted"])
            calls.append(r["calls"])
            h2d.append(r["h2d"])
            if not math.isfinite(loss):
                # The loss is all-reduced and the adapters replicated: every rank raises alike.
                raise FinetuneError(nan_message(job, engine, loss, step, start, named))
            losses.append(loss)
            steady = _tokens_per_s(times[:-1] if tensor_peak is not None else times, tokens_per_step)
            bar.set_postfix(loss=f"{loss:.4f}", tok_s=f"{steady:.0f}" if steady else "-")
            bar.update(1)
            if primary and args.save_every and (step + 1) % args.save_every == 0 and step + 1 < args.steps:
                write_checkpoint(job, model, opt, names, step + 1, losses, segments + [segment(mem.peak_above_baseline())])
        bar.close()
        peak = rss_peak if profile_last else mem.peak_above_baseline()
        if device.type == "cuda":
            tensor_peak = peak
        first_step = start + 1
        if primary and times:
            segments = segments + [segment(peak)]
            write_checkpoint(job, model, opt, names, args.steps, losses, segments)
        elif primary and segments:
            # Resumed at the last step: nothing trained; report the figures of the process that
            # trained the last steps (see [Note: segments of a run]).
            last = segments[-1]
            times, gathered, counted = last["step_times_s"], last["allgather_bytes_per_step"], last["allgather_bytes_counted_per_step"]
            peak, first_step = last["peak_memory_bytes"], last["first_step"]
        model.eval()
        with torch.no_grad():
            out = model(**model_inputs({k: v.to(device) for k, v in job.windows.probe_inputs().items()}))
        model.train()
    except BaseException as exc:
        # [Note: a run that fails after training steps] (runner.py): what was trained is
        # reported, marked as failed, before the error goes on.
        bar.close()
        if times:
            partial = {"name": engine.name, "kind": engine.kind, "weight_format": getattr(engine, "weight_format", "none"),
                       "status": "failed", "losses": list(losses),
                       "steps_run": len(times), "first_step": start + 1, "step_times_s": list(times),
                       "tokens_per_step": tokens_per_step, "tokens_per_s": _tokens_per_s(times, tokens_per_step),
                       "peak_memory_bytes": mem.peak_above_baseline(), "allgather_bytes_per_step": list(gathered),
                       "allgather_bytes_counted_per_step": list(counted),
                       "allgather_calls_per_step": list(calls),
                       "allgather_bytes_first_step": gathered[0] if gathered else 0,
                       "allgather_bytes_steady": _steady(gathered), "h2d_bytes_per_step": list(h2d),
                       "h2d_bytes_steady": _steady(h2d), "micro_batch_splits": list(splits),
                       "final_loss": losses[-1] if losses else None, "heldout_loss": None}
            with contextlib.suppress(AttributeError, TypeError):  # a few built-in exceptions take no attributes
                exc.partial_run = partial
        raise
    first = gathered[0] if gathered else 0
    steady_bytes = _steady(gathered)
    h2d_steady = _steady(h2d)
    result = {
        "name": engine.name,
        "kind": engine.kind,
        "weight_format": getattr(engine, "weight_format", "none"),  # the numerics its losses are compared within
        "status": "complete",
        "losses": losses,
        "steps_run": len(times),
        "first_step": first_step,
        "step_times_s": times,
        "tokens_per_step": tokens_per_step,
        "tokens_per_s": _tokens_per_s(times[:-1] if profile_last else times, tokens_per_step)
        or (tokens_per_step / times[0] if times else None),
        "peak_memory_bytes": peak,
        "tensor_peak_bytes": tensor_peak,
        "memory_measure": mem.describe() if hasattr(mem, "describe") else None,
        "allgather_bytes_per_step": gathered,
        "allgather_bytes_counted_per_step": counted,
        "allgather_calls_per_step": calls,
        "allgather_calls_steady": statistics.median(calls[1:]) if len(calls) > 1 else (calls[0] if calls else 0),
        "allgather_bytes_first_step": first,
        "allgather_bytes_steady": steady_bytes,
        "h2d_bytes_per_step": h2d,
        "h2d_bytes_steady": h2d_steady,
        "micro_batch_splits": splits,
        "final_loss": losses[-1],
        "heldout_loss": float(out.loss),
    }
    if primary:
        result["segments"] = [{k: v for k, v in seg.items() if k in ("first_step", "last_step", "pool_budget")}
                              for seg in segments]
        label = _segments_label(segments)
        if label is not None:
            result["losses_label"] = label
    if engine.kind in ("elastic", "planned"):
        result["budget_bytes"] = engine.budget_bytes
        result["frozen_bytes"] = engine.frozen_bytes
        result["runtime_stats"] = engine.runtime.stats()
    planner = getattr(engine, "planner", None)
    if planner is not None:
        result.update(planner.report())
    if primary:
        result["probe_logits"] = out.logits.detach().float().cpu()
    return result


def model_inputs(batch: dict, a: int | None = None) -> dict:
    """The forward's keyword arguments: micro-step `a` of a batch (or the whole batch). Packed
    records carry position ids, which confine attention to each record only without a KV cache
    (transformers' masking_utils detects packed sequences when no cache is passed), hence
    use_cache=False ([Note: records are packed, attention stays in each record] in sft.py)."""
    out = {k: (v if a is None else v[a]) for k, v in batch.items()}
    if "position_ids" in out:
        out["use_cache"] = False
    return out


def _steady(per_step: list) -> float:
    """The mean of a per-step figure over the steps after the first (the first alone if only it ran)."""
    if len(per_step) > 1:
        return sum(per_step[1:]) / (len(per_step) - 1)
    return float(per_step[0] if per_step else 0)


def adamw(params, args) -> torch.optim.AdamW:
    """The optimizer of every run: AdamW with the job's hyper-parameters."""
    return torch.optim.AdamW(params, lr=args.lr, betas=ADAM_BETAS, eps=ADAM_EPS, weight_decay=args.weight_decay)


def _tokens_per_s(times: list[float], tokens_per_step: int) -> float | None:
    """Steady state: global tokens per step over the median time of the steps after the first
    of this process (the first learns the layer order, gathers everything and warms the
    allocators). The median, not the mean: on a shared machine a few steps stall for reasons
    that have nothing to do with the run."""
    if len(times) < 2:
        return None
    return tokens_per_step / statistics.median(times[1:])
