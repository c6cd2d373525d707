"""The pipeline planner's search: every candidate layout (`layouts`), estimated in closed form,
the best simulated (`plan_pipeline`), against pp = 1. The cost and memory models it judges by:
pipeline_model.py; synthetic profiles of large models: pipeline_synthetic.py.

[Note: the pipeline search]
Candidates: every pp dividing the world size (2 and more; pp = 1 is the plain planner's, given
as `pp1`), every micro-batch count m dividing the dp group's share of the global batch, every
schedule and pack size (one pack per rank for gpipe/1f1b; every size giving a multiple of pp
packs for looped-bfs/interleaved-1f1b), every residency and window 0 or 1 (2 and more when
asked for: they change the estimate nothing, only the simulated step). Each is first
estimated in closed form (the compute of the slowest rank stretched by the bubble
(pp - 1) / (m + pp - 1), or (pp - 1) / (v m + pp - 1) with v packs per rank, plus its exposed
loads; its memory bounded by every local pack resident and the schedule's most micro-batches
in flight), the estimates are sorted, and the `simulate_top` best that fit the memory bound
are simulated exactly; the fastest simulated one that fits wins, ties to the earlier candidate
(pp ascending, then m, schedule, pack size, residency, window: every rank computes the same
plan). pp = 1 stays the answer unless a pipeline's simulated step is strictly shorter than
pp1's predicted step (or pp1 does not fit).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from .pipeline import (
    MULTI_STAGE_SCHEDULES,
    RESIDENCIES,
    SCHEDULES,
    PipelineError,
    PipelineLayout,
    divisors,
    rank_balanced_boundaries,
)
from .pipeline_model import PipelinePrediction, PipelineProfile, estimate, simulate


@dataclass
class PipelinePlan:
    """The planner's choice among pipelines and pp = 1 ([Note: the pipeline search])."""

    pipelined: bool
    prediction: PipelinePrediction | None  # the chosen pipeline's (None: pp = 1 chosen and no pipeline fits)
    pp1_step_s: float | None
    memory_bytes: int
    global_batch: int
    candidates: int
    simulated: int
    planning_seconds: float
    ranking: list = field(default_factory=list)  # the simulated candidates: (step_s, peak, layout dict, mbs)

    def to_dict(self) -> dict:
        return {"pipelined": self.pipelined, "prediction": None if self.prediction is None else self.prediction.to_dict(),
                "pp1_step_s": self.pp1_step_s, "memory_bytes": self.memory_bytes, "global_batch": self.global_batch,
                "candidates": self.candidates, "simulated": self.simulated, "planning_seconds": self.planning_seconds,
                "ranking": self.ranking}

    def describe(self) -> str:
        if self.prediction is None:
            return "pp 1 (no pipeline fits)"
        p = self.prediction
        what = (f"{p.layout.describe()}, micro-batches of {p.micro_batch_size}: predicted {p.step_s:.4g} s/step, "
                f"bubble {max(p.bubble):.0%}, peak {p.peak / 2**20:.1f} MiB")
        pp1 = "no pp 1 plan fits" if self.pp1_step_s is None else f"pp 1 {self.pp1_step_s:.4g} s/step"
        return f"{'pipeline' if self.pipelined else 'pp 1'} ({what}; {pp1})"


def layouts(world_size: int, n_layers: int, global_batch: int, *, pp=None, schedules=SCHEDULES, pack_sizes=None,
            micro_batches=None, residencies=RESIDENCIES, windows=(0, 1), layer_costs=None, first_cost: float = 0.0,
            last_cost: float = 0.0, weights_on: str = "device"):
    """Every candidate layout and its micro-batch size, in the order ties are broken by. With
    dp = 1 and the weights on the device a rank holds its packs whole (nothing is loaded), so
    residency and window change nothing there and only (persistent, 0) is listed."""
    degrees = [d for d in divisors(world_size) if d > 1] if pp is None else [pp] if isinstance(pp, int) else list(pp)
    out = []
    bounds_cache: dict = {}
    for d in degrees:
        dp = world_size // d
        if global_batch % dp:
            continue
        share = global_batch // dp
        ms = divisors(share) if micro_batches is None else [x for x in (
            [micro_batches] if isinstance(micro_batches, int) else micro_batches) if share % x == 0]
        for m in ms:
            for schedule in schedules:
                if schedule in MULTI_STAGE_SCHEDULES:
                    counts = sorted({-(-n_layers // p) for p in range(1, n_layers + 1)} if pack_sizes is None else
                                    {-(-n_layers // p) for p in pack_sizes})
                    counts = [c for c in counts if c >= d and c % d == 0 and c <= n_layers]
                else:
                    counts = [d] if d <= n_layers else []
                for count in counts:
                    key = (count, d)
                    if key not in bounds_cache:
                        bounds_cache[key] = rank_balanced_boundaries(layer_costs or [1.0] * n_layers, count, d,
                                                                     first_cost, last_cost)
                    local = dp == 1 and weights_on == "device"
                    for res in (("persistent",) if local else residencies):
                        for w in ((0,) if res == "transient" or local else windows):
                            try:
                                layout = PipelineLayout(world_size, d, schedule, m, bounds_cache[key],
                                                        (res,) * count, w)
                            except PipelineError:
                                continue
                            out.append((layout, share // m))
    return out


def plan_pipeline(profile: PipelineProfile, memory_bytes: int, global_batch: int, *, pp1_step_s: float | None = None,
                  simulate_top: int = 8, margin: float = 0.05, **candidates) -> PipelinePlan:
    """[Note: the pipeline search]. `pp1_step_s`: the plain planner's predicted step time at
    pp = 1 (None: no pp = 1 plan fits). `candidates` narrows the search (pp, schedules,
    pack_sizes, micro_batches, residencies, windows)."""
    t0 = time.perf_counter()
    if not isinstance(memory_bytes, int) or memory_bytes < 1:
        raise PipelineError(f"memory_bytes must be a positive int, got {memory_bytes!r}")
    limit = int(memory_bytes * (1 - margin))
    layer_costs = [layer.fwd_s(profile.seq_len) + layer.bwd_s(profile.seq_len) for layer in profile.layers]
    head = (profile.head_fwd_s_per_token + profile.head_bwd_s_per_token) * profile.seq_len
    cands = layouts(profile.world_size, len(profile.layers), global_batch, layer_costs=layer_costs,
                    first_cost=profile.embed_fwd_s_per_token * profile.seq_len, last_cost=head,
                    weights_on=profile.weights_on, **candidates)
    screened = []
    cache: dict = {}
    for order, (layout, mbs) in enumerate(cands):
        e = estimate(profile, layout, mbs, cache, memory_cutoff=int(limit * 1.5))
        if e is not None:  # else beyond the limit even allowing for the bound's slack
            screened.append((e.step_s, order, layout, mbs, e.peak))
    screened.sort(key=lambda x: (x[0], x[1]))
    best, ranking, simulated = None, [], 0
    for step_est, order, layout, mbs, peak_bound in screened:
        if simulated >= simulate_top:
            break
        pred = simulate(profile, layout, mbs, cache=cache)
        simulated += 1
        ranking.append((pred.step_s, pred.peak, layout.to_dict(), mbs))
        if pred.peak <= limit and (best is None or (pred.step_s, order) < (best[0].step_s, best[1])):
            best = (pred, order)
    chosen = best[0] if best is not None else None
    pipelined = chosen is not None and (pp1_step_s is None or chosen.step_s < pp1_step_s)
    return PipelinePlan(pipelined, chosen, pp1_step_s, memory_bytes, global_batch, len(cands), simulated,
                        time.perf_counter() - t0, ranking)


__all__ = ["PipelinePlan", "layouts", "plan_pipeline"]
