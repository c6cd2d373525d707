"""The planner against hand-picked settings on this machine (part of bench/bench_planner.py).

    python bench/bench_planner.py --demo [--world-size 4] [--steps 5]

The demo model (the CLI's embedded Llama: 4 layers, hidden 256) on `world_size` gloo ranks,
global batch world_size x 4 sequences of 128 tokens. One profile is measured; three memory
caps are derived from it (just above the least memory any plan needs, the midpoint, and what
keeping everything needs). A grid of hand-picked settings (keep fraction 0 / 0.5 / 1,
micro-batch 1 / 2 / 4, recompute none / every layer: 18 settings) is trained, each from a
fresh model for `steps` steps; under each cap the settings whose predicted peak fits are the
candidates a user could have picked, and the planned run is compared with the best and the
worst of them by measured tokens/s (median step time after the first, slowest rank, over two
passes in opposite orders). Bytes
gathered per step are measured; peak memory is both predicted (the memory model) and measured
(resident set growth, rank 0). Rows go to bench/results/planner_demo.csv.
"""

from __future__ import annotations

import gc
import statistics
import time

import torch
import torch.distributed as dist

SEQ = 128
PER_RANK = 4
CHUNK = 256 << 10
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _model():
    from elastic_kernels.api import ElasticPolicy, LoRAConfig, convert_to_elastic
    from elastic_kernels.api.finetune.models import embedded_config, embedded_model

    cfg = embedded_config(256, 688, 4, 8, 4)
    model = convert_to_elastic(embedded_model(cfg, 0), LoRAConfig(r=8, alpha=16, target_modules=TARGETS),
                               ElasticPolicy(chunk_bytes=CHUNK))
    model.train()
    return model, cfg.vocab_size


def _batches(vocab: int, rank: int, steps: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 + rank)
    return [torch.randint(0, vocab, (PER_RANK, SEQ), generator=gen) for _ in range(steps)]


def _train(plan, steps: int, world_size: int) -> dict:
    """A fresh model under `plan` for `steps` steps: tokens/s, bytes per step, peak RSS."""
    from elastic_kernels.api import no_sync, reset_stats, stats
    from elastic_kernels.api.finetune.measure import PeakMemory
    from elastic_kernels.api.planning.apply import apply_plan

    mem = PeakMemory("cpu")
    mem.set_baseline()
    model, vocab = _model()
    apply_plan(model, plan)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    mem.reset_peak()
    times, gathered = [], []
    for batch in _batches(vocab, dist.get_rank(), steps):
        micro = batch.view(plan.accumulation, plan.micro_batch, SEQ)
        reset_stats(model)
        dist.barrier()
        t0 = time.perf_counter()
        for a in range(plan.accumulation):
            ctx = no_sync(model) if a < plan.accumulation - 1 else torch.enable_grad()
            with ctx:
                (model(input_ids=micro[a], labels=micro[a]).loss / plan.accumulation).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        t = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        times.append(float(t))
        gathered.append(stats(model)["allgather_bytes"])
    peak = mem.peak_above_baseline()
    del model, opt
    gc.collect()
    return {"step_times_s": times[1:] or times, "allgather_bytes_per_step": gathered[-1], "measured_peak_bytes": peak}


def _measure_all(plans: dict, steps: int, world_size: int) -> dict:
    """Every plan trained twice, in two passes of opposite order (a drift of the shared machine
    during the run then weighs on every plan alike); tokens/s from the median steady step of
    both passes, peak memory the larger of the two."""
    names = list(plans)
    runs: dict[str, list[dict]] = {n: [] for n in names}
    for order in (names, names[::-1]):
        for n in order:
            runs[n].append(_train(plans[n], steps, world_size))
    out = {}
    for n, rs in runs.items():
        times = [t for r in rs for t in r["step_times_s"]]
        peaks = [r["measured_peak_bytes"] for r in rs if r["measured_peak_bytes"] is not None]
        out[n] = {"tokens_per_s": world_size * PER_RANK * SEQ / statistics.median(times),
                  "allgather_bytes_per_step": rs[-1]["allgather_bytes_per_step"],
                  "measured_peak_bytes": max(peaks) if peaks else None}
    return out


def _caps(profile, global_batch: int) -> list[int]:
    from elastic_kernels.api.planner.search import least_memory, plan_from_profile

    lo = least_memory(profile, global_batch)
    everything = plan_from_profile(profile, profile.capacity_bytes, global_batch)
    full = int(everything.predicted_peak_bytes / 0.95) + 1
    least = int(lo * 1.02)
    return [least, (least + full) // 2, full]


def grid_worker(rank: int, world_size: int, steps: int) -> list[dict]:
    from elastic_kernels.api.planner.memory import Choices
    from elastic_kernels.api.planner.search import plan_from_profile, plan_of
    from elastic_kernels.api.planning.measure import measure_profile

    torch.set_num_threads(1)
    global_batch = world_size * PER_RANK
    model, vocab = _model()
    profile = measure_profile(model, [_batches(vocab, rank, 1)[0]], capacity_bytes=1 << 34)
    del model
    gc.collect()
    grid = []
    for keep in (0.0, 0.5, 1.0):
        for mb in (1, 2, 4):
            for rec in (False, True):
                c = Choices.uniform(profile, mb, keep_fraction=keep, recompute=rec)
                plan = plan_of(profile, c, memory_bytes=profile.capacity_bytes, global_batch=global_batch)
                grid.append((f"keep {keep:g}, micro-batch {mb}, recompute {'all' if rec else 'none'}", plan))
    caps = _caps(profile, global_batch)
    planned_by_cap = {cap: plan_from_profile(profile, cap, global_batch) for cap in caps}
    plans = dict(grid)
    plans.update({f"planned for {cap}": p for cap, p in planned_by_cap.items()})
    measured = _measure_all(plans, steps, world_size)
    rows = []
    for cap in caps:
        planned = planned_by_cap[cap]
        result = measured[f"planned for {cap}"]
        fits = [(name, plan) for name, plan in grid if plan.predicted_peak_bytes <= cap * 0.95]
        ranked = sorted(fits, key=lambda np: measured[np[0]]["tokens_per_s"])
        entries = [("planned", f"micro-batch {planned.micro_batch}, kept {planned.kept_chunks}/{planned.total_chunks}, "
                               f"recompute {sum(lp.recompute for lp in planned.layers)}", planned, result)]
        if ranked:
            worst, best = ranked[0], ranked[-1]
            entries.append(("best hand-picked", best[0], best[1], measured[best[0]]))
            entries.append(("worst hand-picked", worst[0], worst[1], measured[worst[0]]))
        for kind, setting, plan, m in entries:
            rows.append({"memory_cap_bytes": cap, "run": kind, "setting": setting,
                         "fitting_settings": len(fits), "tokens_per_s": m["tokens_per_s"],
                         "allgather_bytes_per_step": m["allgather_bytes_per_step"],
                         "predicted_allgather_bytes_per_step": plan.predicted_allgather_bytes_per_step,
                         "predicted_peak_bytes": plan.predicted_peak_bytes,
                         "measured_peak_bytes_rank0": m["measured_peak_bytes"],
                         "predicted_step_time_s": plan.predicted_step_time_s})
    return rows
