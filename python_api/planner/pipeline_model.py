"""The cost and memory models of a pipelined run. Pure Python. The layout they evaluate is
planner/pipeline.py's; the runtime is python_api/pipeline/; the planner's search over pipelines
is pipeline_search.py; synthetic profiles of large models are pipeline_synthetic.py.

    profile = PipelineProfile(...)                      # or pipeline_synthetic.synthetic_pipeline_profile(...)
    pred = simulate(profile, layout, micro_batch_size)  # step time, bubble, memory, bytes per rank
    best = plan_pipeline(profile, memory_bytes, global_batch, pp1_step_s=...)  # pipeline_search.py

By role: the profile types (pipeline_profile.py), the per-pack costs (pipeline_cost.py), the
simulation of one step with [Note: the pipeline cost model], [Note: the per-action overhead]
and [Note: the pipeline memory model] (pipeline_sim.py), and here the closed-form screening
(`estimate`) and a pp = 1 step in the model's terms (`pp1_time_of`). The names of all of
them import from here too.
"""

from __future__ import annotations

from .pipeline import BACKWARD, FORWARD, MULTI_STAGE_SCHEDULES, PipelineLayout
from .pipeline_cost import PackCost, _load_time, _static_bytes, _transient_exposed, pack_cost
from .pipeline_profile import PipeLayer, PipelineProfile, PipeWeight, check_busy_speed
from .pipeline_sim import PipelinePrediction, shared_core_warp, simulate


def _in_flight_max(schedule: str, pp: int, v: int, m: int, r: int) -> int:
    """Most pack-micro-batches in flight on pp rank r (closed form, for screening)."""
    if schedule == "gpipe":
        return m
    if schedule == "1f1b":
        return min(m, pp - r)
    if schedule == "looped-bfs":
        return m * v
    rounds = max(1, m // pp)
    return min(m * v, (v - 1) * (m // rounds) + 2 * (pp - 1 - r) + 1)


def estimate(profile: PipelineProfile, layout: PipelineLayout, micro_batch_size: int,
             cache: dict | None = None, memory_cutoff: int | None = None) -> PipelinePrediction | None:
    """[Note: the pipeline search] in pipeline_search.py: a quick estimate (time and a memory upper bound); None
    when the memory bound of some rank exceeds `memory_cutoff`."""
    pp, n, m, v = layout.pp, layout.n_packs, layout.micro_batches, layout.packs_per_rank
    costs = {k: pack_cost(profile, layout, k, micro_batch_size, cache) for k in range(n)}
    T = micro_batch_size * profile.seq_len
    p2p_bytes = T * profile.hidden_size * profile.act_element_size
    p2p_s = profile.p2p.time(p2p_bytes) if pp > 1 else 0.0
    peaks = []
    for r in range(pp):
        local = layout.packs_of_rank(r)
        static = _static_bytes(profile, layout, r, costs, micro_batch_size)
        pool = sum(costs[k].fwd_pages + costs[k].fwd_buffers for k in local)
        acts = _in_flight_max(layout.schedule, pp, v, m, r) * max(costs[k].act_bytes for k in local)
        peaks.append(static + pool + acts + int(profile.head_peak_bytes_per_token * T))
        if memory_cutoff is not None and peaks[-1] > memory_cutoff:
            return None
    work = []
    for r in range(pp):
        local = layout.packs_of_rank(r)
        w = 0.0
        for j, k in enumerate(local):
            c = costs[k]
            w += m * (c.fwd_s + c.bwd_s + 2 * (profile.stage_overhead_s + profile.schedule_overhead_s))
            mode = layout.residency[k]
            if mode == "transient":
                w += m * (_transient_exposed(c, FORWARD) + _transient_exposed(c, BACKWARD))
            elif mode in ("step", "phase"):
                hide = 0.0 if (j == 0 or layout.window == 0) else m * costs[local[j - 1]].fwd_s
                w += max(0.0, _load_time(profile, c, FORWARD) - hide)
                if mode == "phase":
                    later = local[j + 1] if j + 1 < len(local) else None
                    hide = 0.0 if (later is None or layout.window == 0) else m * costs[later].bwd_s
                    w += max(0.0, _load_time(profile, c, BACKWARD) - hide)
        work.append(w)
    vv = v if layout.schedule in MULTI_STAGE_SCHEDULES else 1
    stretch = (vv * m + pp - 1) / (vv * m)
    if profile.busy_speed and pp > 1:  # the ramps run with 1..pp-1 ranks busy ([Note: ranks sharing cores])
        stretch = 1 + (stretch - 1) / (sum(profile.busy_speed[:pp - 1]) / (pp - 1))
    step = max(work) * stretch + 2 * (n - 1) * p2p_s / max(1, vv)
    tokens = layout.dp * m * micro_batch_size * profile.seq_len
    return PipelinePrediction(layout, micro_batch_size, step, work, [1 - 1 / stretch] * pp, peaks, [0] * pp,
                              [0] * pp, [0] * pp, tokens, estimate=True)


def pp1_time_of(profile: PipelineProfile, micro_batch_size: int, accumulation: int, *, keep_all: bool) -> float:
    """A pp = 1 step in this model's terms, for a profile without a plain planner Profile: every
    rank runs every layer on its micro-batches; with `keep_all` the weights stay resident (no
    gather), else every layer is gathered for each use, prefetched one layer ahead (FSDP's
    regime)."""
    T = micro_batch_size * profile.seq_len
    dp = profile.world_size
    layout = PipelineLayout(dp, 1, "gpipe", 1, (0, len(profile.layers)), ("transient",), 0)
    c = pack_cost(profile, layout, 0, micro_batch_size)
    per = c.fwd_s + c.bwd_s + profile.embed_fwd_s_per_token * T
    if not keep_all:
        per += _transient_exposed(c, FORWARD) + _transient_exposed(c, BACKWARD)
    grads = c.adapter_bytes // 4
    return accumulation * per + (profile.allreduce.time(grads) if dp > 1 else 0.0)


__all__ = ["PackCost", "PipeLayer", "PipeWeight", "PipelinePrediction", "PipelineProfile", "check_busy_speed", "estimate",
           "pack_cost", "pp1_time_of", "shared_core_warp", "simulate"]
