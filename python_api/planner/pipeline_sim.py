"""One step of a pipelined run, simulated action by action on every pp rank (`simulate`): step
time, bubble, peak memory and bytes moved per rank (PipelinePrediction). Pure Python; the
per-pack terms are pipeline_cost.py's.

[Note: the pipeline cost model]
One step is simulated action by action on every pp rank, in the order its schedule runs
(`schedule_order`): an action (F or B of pack k on micro-batch i) starts when the rank is free,
its input has arrived (F: the F of pack k - 1 on micro-batch i, plus one P2P of the activation
[micro_batch, seq, hidden] when that pack is on another rank; B: the B of pack k + 1, plus one
P2P of its gradient) and its pack is loaded. Compute per action, with T = micro_batch x seq
tokens: the sum over the pack's layers of fixed + per_token x T (the first pack adds the
embeddings', the last the head's: norm, lm_head, loss). A P2P takes the p2p link's latency +
bytes / bandwidth. Loads follow the residency model ([Note: pack residency] in
planner/pipeline.py; the same `load_events`): a load is issued at the action the prefetch
window says (or by the action that needs it), queues behind the rank's earlier loads on its
link, and takes the link's time for its bytes: (dp - 1) x slice per chunk gathered from dp
peers (the all-gather link), or the chunks' real bytes from the host store (the h2d link);
the action needing it waits for it inside its compute (the runtime gathers at first use), so
its exposed part counts as busy time, as the measured compute does. A transient pack gathers
each layer per use, prefetched one layer ahead: per action, sum over its layers of
max(0, gather of layer l - compute of layer l - 1). The step ends when the last rank's last
action and its adapter-gradient all-reduce over the dp group (allreduce link) are done. The
bubble of a rank is 1 - its busy time / the step time, the measured quantity
(PipelinedModel.last_step["idle_s_per_rank"]). Every action also pays the per-action overhead
([Note: the per-action overhead]). Not modelled: P2P contention, compute slowed by concurrent
copies, the optimizer step, and on a CPU the cores freed by idle ranks (the compute is timed
with every rank busy).

[Note: the per-action overhead]
An action costs more than its layers' compute: the stage's forward_one_chunk/backward_one_chunk
(argument handling, autograd bookkeeping, and the pack recomputing its rotary embeddings and
causal mask from the positions) and, between actions, the schedule's loop (posting the P2P
operations, waiting for them, and under load waiting for the peer to be scheduled; our pack
residency). None of it depends on how many layers the pack has, so a step of v packs per rank
pays it 2 m v times: 8 times per rank at one pack of 8 layers, 64 times at packs of 1 (pp 2,
m 4, 16 layers). The profile gives it per action as `stage_overhead_s` (inside the stage:
added to the action's work, counted busy, as the measured compute counts it) and
`schedule_overhead_s` (before the action: the rank is occupied, the wait for the input can
hide it, the bubble counts it idle, as the measurement does): begin = max(free +
schedule_overhead_s, input arrival), end = begin + work + stage_overhead_s. Measured for a real
model ([Note: measuring the per-action overhead] in python_api/pipeline/profile.py); synthetic
GPU profiles assume 100 us of stage overhead (the prologue's and the stage's kernels, at the
100 us per call the layers' fixed cost assumes) and no schedule overhead (host-side Python,
hidden while the host runs ahead of the device: an assumption that fails when an action's
device time drops below the ~2 ms of Python per action counted on CPU below).
Why (issue 19; bench/results/packs.csv, 4 gloo ranks on 2 cores, pp 2 x dp 2, 16 layers of
the demo shape, m 4): without this term the model predicted +20% tokens/s from packs of 8 to
packs of 1, the bench measured packs of 1 slower than packs of 2 by 3-23%, and the measured
bubble at packs of 1 was 0.16-0.19 against 0.05 predicted. Counted in steps of that model
(main-thread CPU time per action at packs of 1, looped-bfs, same run, machine shared): the
stage's infrastructure 0.5-0.7 ms per forward or backward, the causal mask 0.5-0.6 ms per
forward, posting and waiting for the P2P operations 0.3-0.4 ms, the residency 0.3-0.4 ms,
the rest of the schedule's loop 0.3-0.4 ms: about 2 ms per action against 14-18 ms per
layer forward and per layer backward, so ~12% of a step's CPU at packs of 1 and ~2% at
packs of 8, the size of the bubble the smaller packs save (0.2 -> 0.05). Timestamps of every
action (4 ranks, same run) put the time between two actions of a rank alike whether or not it
waited for its input (mean 5-9 ms wall under a load of 13): the cost is per action, not a
slow P2P link. With the overhead measured on that machine (stage 1.0 ms, schedule 5.6 ms,
at a load of 5-10), `python bench/bench_packs.py --check` on that run's rows: Spearman's rank
correlation of predicted and measured tokens/s +0.17 (host), +0.19 (peers), +0.20 (all 16),
from -0.67, -0.21, -0.44; the planner's choice among them measures 0.895 (host) and 0.902
(peers) of the best, from 0.779 and 0.819. What the model still misses there: packs of 8
measured 2-25% faster than predicted (likely a CPU effect, not modelled: the compute is timed
with every rank busy, while during a step's bubble the working ranks get the idle ranks'
cores), and the noise (the two schedules at one pack size differ by up to 14%, a
configuration's two passes by 2-45%).

[Note: the pipeline memory model]
Per rank, at each action, in bytes:
  reserved + static: the shards of its packs' frozen weights (1/dp of every chunk, their real
      bytes: the ragged last chunk unpadded, rank 0's as the largest; none with
      weights_on="host", except on CPU, where the host store's pages of its packs are the same
      memory: counted whole, as a rank maps the whole store), what its packs keep replicated (embeddings on the first, norm and
      head on the last), its adapters with their gradients and AdamW's two moments (16 bytes
      per fp32 parameter), and the stages' P2P buffers (PipelineStage keeps, per stage and
      micro-batch, one receive buffer of the activation and one of its gradient);
  + pool: `residency_trace`'s bytes during the action (pages of the resident packs: 1 per
      chunk, a page being the pack's largest chunk rounded up to 512 bytes), plus for a
      transient pack its working set (the pages of its two largest layers);
  + gather buffers of loads in flight: (dp + 1) x slice per chunk (send and receive), plus on
      CPU dp x slice (gloo's scratch copy of the output): a prefetched pack load
      (ElasticRuntime.prefetch, issued by the residency ahead of the pack's action) issues
      every chunk of the pack at once; a load on demand (no window, or a load that could not
      be prefetched: its pack was released just before) is the runtime's own gathering, unit
      by unit with its in-pack prefetch, so at most the buffers of 1 + prefetch_depth layers
      (the largest) are in flight;
  + activations: for each local pack, the micro-batches whose forward is done and backward not
      (the one in its forward or backward counted) times the pack's saved bytes per micro-batch
      (act_bytes_per_token x T over its layers, the head's on the last pack), plus during the
      last pack's actions the head's transient (logits, their fp32 copy, their gradient);
  + the tensors handed to P2P sends (micro_batch x seq x hidden each): a non-last pack's
      output from its forward until its backward (the stage keeps it for the backward), and
      with GPipe, LoopedBFS and Interleaved 1F1B every output and every input gradient a
      non-first pack sent, until the step ends: torch.distributed.pipelining keeps their send
      works, which hold the tensors, until then (ScheduleGPipe in lists it waits after each
      phase, the multi-stage runtime in `send_ops` it waits at the end of step()); Schedule1F1B
      keeps only its latest send's work (one input gradient).
The peak is the maximum over the actions.
Checked against bench/results/packs.csv (2026-12-02, 16 configurations, rank 0's measured
peaks; `python bench/bench_packs.py --check`): without the on-demand rule and the sent
tensors, +22% / +33% for one 8-layer pack with peers' weights (both of its loads are on
demand: a phase pack cannot be prefetched into the action right after its release, and every
chunk's buffers were counted at once) and -6.6% at interleaved-1f1b packs of 1 (60 sends of
256 KiB per step on rank 0 not counted); with them -0.6..+3.0% (host) and -2.2..+5.0%
(peers). Not separated: the +3..+5% left at small packs with looped-bfs (perhaps the receive
buffers, counted in the static bytes and again as the saved input of the pack's first layer).
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

from .pipeline import BACKWARD, FORWARD, PipelineError, PipelineLayout, load_events, residency_trace
from .pipeline_cost import _load_time, _static_bytes, _transient_exposed, pack_cost
from .pipeline_profile import PipelineProfile


@dataclass
class PipelinePrediction:
    """What the models predict for one layout (per pp rank lists, index = pp rank)."""

    layout: PipelineLayout
    micro_batch_size: int
    step_s: float
    busy_s: list[float]
    bubble: list[float]
    peak_bytes: list[int]
    allgather_bytes: list[int]
    h2d_bytes: list[int]
    p2p_send_bytes: list[int]
    tokens_per_step: int
    estimate: bool = False  # closed form (screening) rather than simulated

    @property
    def tokens_per_s(self) -> float:
        return self.tokens_per_step / self.step_s if self.step_s > 0 else 0.0

    @property
    def peak(self) -> int:
        return max(self.peak_bytes)

    def to_dict(self) -> dict:
        return {"layout": self.layout.to_dict(), "micro_batch_size": self.micro_batch_size, "step_s": self.step_s,
                "tokens_per_s": self.tokens_per_s, "busy_s": self.busy_s, "bubble": self.bubble,
                "peak_bytes": self.peak_bytes, "allgather_bytes": self.allgather_bytes, "h2d_bytes": self.h2d_bytes,
                "p2p_send_bytes": self.p2p_send_bytes, "tokens_per_step": self.tokens_per_step}


def simulate(profile: PipelineProfile, layout: PipelineLayout, micro_batch_size: int,
             first_step: bool = False, cache: dict | None = None) -> PipelinePrediction:
    """[Note: the pipeline cost model] and [Note: the pipeline memory model], exactly as
    stated, for one step (steady state, or the first step: nothing resident, no prefetch)."""
    if layout.world_size != profile.world_size:
        raise PipelineError(f"the layout is for {layout.world_size} ranks, the profile for {profile.world_size}")
    pp, n, m = layout.pp, layout.n_packs, layout.micro_batches
    T = micro_batch_size * profile.seq_len
    costs = {k: pack_cost(profile, layout, k, micro_batch_size, cache) for k in range(n)}
    p2p_bytes = T * profile.hidden_size * profile.act_element_size
    p2p_s = profile.p2p.time(p2p_bytes) if pp > 1 else 0.0
    orders = [layout.order(r) for r in range(pp)]
    head_peak = int(profile.head_peak_bytes_per_token * T)
    # Per rank: the issue action of each load event ([Note: following the schedule's order]).
    plans = []
    for r in range(pp):
        events = load_events(layout, orders[r])
        issue = {}
        W = layout.window
        for i, (idx, k, kind, released) in enumerate(events):
            # Before action t the residency issues the first W loads after t whose pack is
            # released: load i is among them once load i - W's action has started.
            at = idx
            if not first_step and W > 0:
                t = max(released + 1, events[i - W][0] if i >= W else 0)
                if t < idx:
                    at = t
            issue.setdefault(at, []).append((idx, k, kind))
        plans.append(issue)
    end: dict = {}
    start_of: dict = {}
    pos = [0] * pp
    free = [0.0] * pp
    link = [0.0] * pp
    ready: list[dict] = [{} for _ in range(pp)]  # action index -> time its load completes
    busy = [0.0] * pp
    buffers_at: list[dict] = [{} for _ in range(pp)]  # action index -> gather-buffer bytes in flight
    remaining = sum(len(o) for o in orders)
    loads_in_flight: list[list] = [[] for _ in range(pp)]  # (issue index, need index, buffer bytes)
    while remaining:
        progressed = False
        for r in range(pp):
            while pos[r] < len(orders[r]):
                t = pos[r]
                kind, k, i = orders[r][t]
                deps = []
                if kind == FORWARD and k > 0:
                    deps.append((FORWARD, k - 1, i))
                if kind == BACKWARD and k < n - 1:
                    deps.append((BACKWARD, k + 1, i))
                if any(d not in end for d in deps):
                    break
                arrive = max((end[d] + (p2p_s if d[1] % pp != r else 0.0) for d in deps), default=0.0)
                # [Note: the per-action overhead]: the schedule's share runs before the wait
                # for the input (it may hide under it), the stage's share inside the action.
                begin = max(free[r] + profile.schedule_overhead_s, arrive)
                # loads issued at this action's start (prefetch) or by it (demand)
                for idx, kk, lk in plans[r].get(t, []):
                    c = costs[kk]
                    s0 = max(begin, link[r])
                    link[r] = s0 + _load_time(profile, c, lk)
                    ready[r][idx] = link[r]
                    if idx == t:  # on demand: the runtime gathers unit by unit, prefetch_depth ahead
                        held = c.fwd_unit_buffers if lk == FORWARD else c.bwd_unit_buffers
                    else:  # a prefetch (ElasticRuntime.prefetch): every chunk of the pack at once
                        held = c.fwd_buffers if lk == FORWARD else c.bwd_buffers
                    loads_in_flight[r].append((t, idx, held))
                c = costs[k]
                work = (c.fwd_s if kind == FORWARD else c.bwd_s) + profile.stage_overhead_s
                if layout.residency[k] == "transient":
                    work += _transient_exposed(c, kind)
                finish = max(begin, ready[r].get(t, begin)) + work
                buffers_at[r][t] = sum(b for a, need, b in loads_in_flight[r] if a <= t <= need)
                start_of[(kind, k, i)] = begin
                end[(kind, k, i)] = finish
                busy[r] += finish - begin
                free[r] = finish
                pos[r] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            raise PipelineError(f"the orders of schedule {layout.schedule} deadlock (a bug in schedule_order)")
    if profile.busy_speed:  # [Note: ranks sharing cores]
        warp = shared_core_warp([[(start_of[a], end[a]) for a in orders[r]] for r in range(pp)], profile.busy_speed)
        busy = [sum(warp(end[a]) - warp(start_of[a]) for a in orders[r]) for r in range(pp)]
        free = [warp(f) for f in free]
    allreduce = []
    for r in range(pp):
        grads = sum(costs[k].adapter_bytes for k in layout.packs_of_rank(r)) // 4  # fp32 gradients: 4 of 16 bytes
        allreduce.append(profile.allreduce.time(grads) if layout.dp > 1 else 0.0)
    step = max(free[r] + allreduce[r] for r in range(pp))
    # memory
    peaks, gathers, h2ds, sends = [], [], [], []
    for r in range(pp):
        local = layout.packs_of_rank(r)
        static = _static_bytes(profile, layout, r, costs, micro_batch_size)
        # A transient pack's pool keeps its working set reserved for the whole run.
        transient = [k for k in local if layout.residency[k] == "transient"]
        static += sum(costs[k].working_set for k in transient)
        during, _ = residency_trace(layout, r, {k: 0 if k in transient else costs[k].fwd_pages for k in local},
                                    {k: 0 if k in transient else costs[k].bwd_pages for k in local},
                                    first_step=first_step)
        inflight = {k: 0 for k in local}
        peak = 0
        # tensors handed to P2P sends ([Note: the pipeline memory model]): outputs sent by
        # forwards whose backward has not run, outputs of finished ones, input gradients sent
        retains = layout.schedule != "1f1b"
        out_live = out_done = grads_sent = 0
        workspace = int(profile.workspace_bytes_per_token * T)
        for t, (kind, k, i) in enumerate(orders[r]):
            if kind == FORWARD:
                inflight[k] += 1
            sent = out_live + (out_done + grads_sent if retains else min(grads_sent, 1))
            acts = sum(inflight[j] * costs[j].act_bytes for j in local) + sent * p2p_bytes
            extra = workspace if kind == BACKWARD else 0
            if k in transient:  # its gathers' buffers, one layer ahead
                extra += 2 * max(costs[k].fwd_buffers, costs[k].bwd_buffers) // max(1, len(costs[k].layer_times))
            head = head_peak if k == n - 1 else 0
            peak = max(peak, static + during[t] + extra + buffers_at[r][t] + acts + head)
            if kind == BACKWARD:
                inflight[k] -= 1
            if kind == FORWARD and k < n - 1:
                out_live += 1
            if kind == BACKWARD and k < n - 1:
                out_live, out_done = out_live - 1, out_done + 1
            if kind == BACKWARD and k > 0:
                grads_sent += 1
        peaks.append(peak)
        g = h = 0
        for k in local:
            nf, nb = layout.loads_per_step(k)
            if first_step and layout.residency[k] == "persistent":
                nf, nb = 1, 0
            g += nf * costs[k].fwd_gather + nb * costs[k].bwd_gather
            h += nf * costs[k].fwd_host + nb * costs[k].bwd_host
        gathers.append(g)
        h2ds.append(h)
        sends.append(sum(m * p2p_bytes * ((k < n - 1) + (k > 0)) for k in local))
    bubble = [1.0 - busy[r] / step if step > 0 else 0.0 for r in range(pp)]
    tokens = layout.dp * m * micro_batch_size * profile.seq_len
    return PipelinePrediction(layout, micro_batch_size, step, busy, bubble, peaks, gathers, h2ds, sends, tokens)


__all__ = ["PipelinePrediction", "simulate"]


# ---------------------------------------------------------------- ranks sharing cores

# [Note: ranks sharing cores]
# On a CPU whose cores the ranks share (4 gloo ranks on the 2-core VM), a rank waiting for its
# input blocks (gloo's receive sleeps), and the ranks still computing get its core: a layer's
# compute is timed with every rank busy, but during a pipeline's ramp-up and ramp-down, when
# only b of the pp ranks compute, they run busy_speed[b - 1] times as fast. The simulation
# keeps its order of events and warps its timeline: a stretch of time during which b >= 1 pp
# ranks are inside an action lasts 1 / busy_speed[b - 1] of its simulated length (b = 0: as
# simulated: links, latencies). The warp is monotone, so every dependency still holds; it is
# an approximation (the durations of the links and of the schedule overhead inside such a
# stretch shrink with it). The closed-form estimate divides its bubble share by the mean of
# busy_speed[: pp - 1]. Measured by measure_busy_speed (python_api/pipeline/profile.py).
# Why (issue 31): the model predicted one pack per rank ~20% slower than measured on the tiny
# model (2026-12-02: measured bubble 0.17-0.20 against 0.26 predicted), and on the real model
# (bench/results/2026-12-03_packs_real.md) 1F1B with one pack per rank measured a bubble of
# 0.15-0.19 against 0.31 predicted. Measured on the 2-core VM, 4 gloo ranks as pp 2 x dp 2, at
# a load of 13: busy_speed (2.14, 1), a rank alone runs about twice as fast. It changed no pick
# there (the same interleaved-1f1b, 10 packs; one pack per rank predicted 0.94-0.96x of it
# instead of 0.84-0.86x; measured 0.88x / 0.98x, within the noise).

def shared_core_warp(intervals, speed):
    """[Note: ranks sharing cores]: the map from simulated time to time with shared cores, given
    per rank its busy intervals [(start, end), ...] (not overlapping within a rank) and
    speed[b - 1] for b busy ranks (len(speed) = the number of ranks)."""
    if len(speed) != len(intervals):
        raise PipelineError(f"busy_speed has {len(speed)} entries for {len(intervals)} pipeline ranks")
    delta: dict = {}
    for ivs in intervals:
        for a, b in ivs:
            if b > a:
                delta[a] = delta.get(a, 0) + 1
                delta[b] = delta.get(b, 0) - 1
    def rate(busy: int) -> float:
        return speed[busy - 1] if busy > 0 else 1.0

    knots, busy, acc, prev = [(0.0, 0.0, 0)], 0, 0.0, 0.0  # (time, warped time, ranks busy after it)
    for t in sorted(delta):
        acc += (t - prev) / rate(busy)
        busy += delta[t]
        knots.append((t, acc, busy))
        prev = t
    xs = [k[0] for k in knots]

    def warp(t: float) -> float:
        x0, y0, b = knots[max(0, bisect.bisect_right(xs, t) - 1)]
        return y0 + (t - x0) / rate(b)

    return warp
