"""The cost and memory models of a pipelined run. Pure Python. The layout they evaluate is
planner/pipeline.py's; the runtime is python_api/pipeline/; the planner's search over pipelines
is pipeline_search.py; synthetic profiles of large models are pipeline_synthetic.py.

    profile = PipelineProfile(...)                      # or pipeline_synthetic.synthetic_pipeline_profile(...)
    pred = simulate(profile, layout, micro_batch_size)  # step time, bubble, memory, bytes per rank
    best = plan_pipeline(profile, memory_bytes, global_batch, pp1_step_s=...)  # pipeline_search.py

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

import math
from dataclasses import dataclass

from ..config import PAGE_ALIGN, quant_rows_per_chunk
from .pipeline import (
    BACKWARD,
    FORWARD,
    MULTI_STAGE_SCHEDULES,
    PipelineError,
    PipelineLayout,
    load_events,
    residency_trace,
)
from .profile import Link, WeightFormat

ADAPTER_BYTES_PER_PARAM = 16  # fp32 value, gradient, AdamW's two moments


@dataclass(frozen=True)
class PipeWeight:
    """One frozen elastic weight: [rows = out, cols = in] of `element_size` bytes, stored in
    `fmt` (None: as is; a WeightFormat: each chunk one quantized blob)."""

    name: str
    rows: int
    cols: int
    element_size: int
    backward: bool = True
    fmt: WeightFormat | None = None

    def layout(self, chunk_bytes: int, dp: int) -> tuple[int, int, int, int]:
        """(chunks, chunk bytes (full), slice bytes per rank, real bytes), as the runtime lays
        it out: rows per chunk from the weight's own row bytes (ElasticTensor.layout; quantized,
        rounded to whole blocks as ElasticPolicy.weight_rows_per_chunk rounds them); stored
        as is, ChunkLayout's slices; quantized, the image's (QuantizedLayout.image_layout:
        chunk c is blob c, a full blob's bytes split over dp, the real bytes the blobs' sum)."""
        row = self.cols * self.element_size
        rpc = min(self.rows, max(1, chunk_bytes // row))
        if self.fmt is not None:  # whole blocks per chunk (ElasticPolicy.weight_rows_per_chunk)
            rpc = quant_rows_per_chunk(rpc, self.rows, self.cols, self.fmt.block_size)
        chunks = -(-self.rows // rpc)
        if self.fmt is None:
            return chunks, rpc * row, -(-(rpc * self.cols) // dp) * self.element_size, self.rows * row
        blob = self.fmt.blob_bytes(rpc, self.cols)
        last = self.fmt.blob_bytes(self.rows - (chunks - 1) * rpc, self.cols)
        return chunks, blob, -(-blob // dp), (chunks - 1) * blob + last


@dataclass(frozen=True)
class PipeLayer:
    """One decoder layer: compute per call (fixed + per token), bytes it saves for backward
    per token, its frozen weights and its adapter parameters."""

    name: str
    fwd_s_fixed: float
    fwd_s_per_token: float
    bwd_s_fixed: float
    bwd_s_per_token: float
    act_bytes_per_token: float
    weights: tuple[PipeWeight, ...]
    adapter_params: int = 0

    def fwd_s(self, tokens: int) -> float:
        return self.fwd_s_fixed + self.fwd_s_per_token * tokens

    def bwd_s(self, tokens: int) -> float:
        return self.bwd_s_fixed + self.bwd_s_per_token * tokens


@dataclass(frozen=True)
class PipelineProfile:
    """What the pipeline models need about one model on one machine (per rank, bytes and
    seconds): its layers, the embeddings and head, the links, the memory."""

    source: str
    device: str
    world_size: int
    seq_len: int
    hidden_size: int
    act_element_size: int
    layers: tuple[PipeLayer, ...]
    chunk_bytes: int
    allgather: Link
    allreduce: Link
    p2p: Link
    capacity_bytes: int
    reserved_bytes: int = 0
    embed_fwd_s_per_token: float = 0.0
    head_fwd_s_per_token: float = 0.0
    head_bwd_s_per_token: float = 0.0
    head_act_bytes_per_token: float = 0.0
    head_peak_bytes_per_token: float = 0.0
    first_static_bytes: int = 0  # replicated on the first pack (embeddings)
    last_static_bytes: int = 0  # replicated on the last pack (final norm, head when replicated)
    head_weights: tuple[PipeWeight, ...] = ()  # an elastic lm_head (last pack)
    head_adapter_params: int = 0
    h2d: Link | None = None
    weights_on: str = "device"
    cpu_gloo: bool = False  # gloo's all-gather scratch copy ([Note: the pipeline memory model])
    workspace_bytes_per_token: float = 0.0  # a backward's transient beyond the saved activations
    prefetch_depth: int = 1  # the runtime's in-pack window: a transient pack's pool holds 1 + this layers
    # [Note: the per-action overhead]: seconds per action (F or B of one pack on one micro-batch)
    # beyond its layers' compute, inside the stage's forward/backward (counted busy) and in the
    # schedule between actions (the rank is occupied, the measured bubble counts it idle).
    stage_overhead_s: float = 0.0
    schedule_overhead_s: float = 0.0

    def __post_init__(self):
        if not self.layers:
            raise PipelineError("a pipeline profile needs decoder layers")
        for name in ("stage_overhead_s", "schedule_overhead_s"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
                raise PipelineError(f"{name} must be a finite number of seconds >= 0, got {v!r}")
        if self.weights_on not in ("device", "host"):
            raise PipelineError(f'weights_on must be "device" or "host", got {self.weights_on!r}')
        if self.weights_on == "host" and self.h2d is None:
            raise PipelineError("a profile with weights_on='host' needs the h2d link")


@dataclass(frozen=True)
class PackCost:
    weights: tuple[PipeWeight, ...]
    fwd_s: float
    bwd_s: float
    act_bytes: int  # saved per micro-batch
    fwd_gather: int
    bwd_gather: int
    fwd_host: int
    bwd_host: int
    fwd_pages: int  # bytes of pages
    bwd_pages: int
    fwd_buffers: int
    bwd_buffers: int
    shard_bytes: int
    adapter_bytes: int
    working_set: int  # pages of its 1 + prefetch_depth largest layers (a transient pack's pool)
    fwd_unit_buffers: int  # gather buffers of its 1 + prefetch_depth largest layers (a load on demand)
    bwd_unit_buffers: int
    store_bytes: int  # its weights in the host store (weights_on="host")
    layer_times: tuple  # per layer: (fwd compute, bwd compute, fwd load s, bwd load s)


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


# ---------------------------------------------------------------- per pack

def pack_cost(profile: PipelineProfile, layout: PipelineLayout, k: int, micro_batch_size: int,
              cache: dict | None = None) -> PackCost:
    """Compute, bytes and pages of pack k (memoised in `cache` by what they depend on)."""
    key = (layout.boundaries[k], layout.boundaries[k + 1], k == 0, k == layout.n_packs - 1, micro_batch_size,
           layout.dp)
    if cache is not None and key in cache:
        return cache[key]
    out = _pack_cost(profile, *key, cache=cache)
    if cache is not None:
        cache[key] = out
    return out


def _unit_sums(profile: PipelineProfile, weights, dp: int) -> tuple:
    """Per group of weights (a layer, or the head) at dp: (largest page, chunks, backward
    chunks, gather bytes, backward gather bytes, host bytes, backward host bytes, slice bytes x
    chunks, backward slice bytes x chunks, shard bytes, store bytes)."""
    page = chunks = bchunks = g = bg = h = bh = sl = bsl = shard = store = 0
    host = profile.weights_on == "host"
    for w in weights:
        n, cb, slc, real = w.layout(profile.chunk_bytes, dp)
        page = max(page, -(-cb // PAGE_ALIGN) * PAGE_ALIGN)
        shard += (n - 1) * slc + min(slc, real - (n - 1) * cb)  # rank 0's real bytes: no padding
        store += real
        chunks += n
        sl += slc * n
        if host:
            h += real
        else:
            g += (dp - 1) * slc * n
        if w.backward:
            bchunks += n
            bsl += slc * n
            if host:
                bh += real
            else:
                bg += (dp - 1) * slc * n
    return page, chunks, bchunks, g, bg, h, bh, sl, bsl, shard, store


def _pack_cost(profile: PipelineProfile, start: int, end: int, first: bool, last: bool, micro_batch_size: int,
               dp: int, cache: dict | None = None) -> PackCost:
    T = micro_batch_size * profile.seq_len
    layers = profile.layers[start:end]
    units = []
    for i in range(start, end):
        key = ("layer", i, dp)
        u = cache.get(key) if cache is not None else None
        if u is None:
            u = _unit_sums(profile, profile.layers[i].weights, dp)
            if cache is not None:
                cache[key] = u
        units.append(u)
    if last and profile.head_weights:
        units.append(_unit_sums(profile, profile.head_weights, dp))
    fwd = sum(layer.fwd_s(T) for layer in layers) + (profile.embed_fwd_s_per_token * T if first else 0.0) \
        + (profile.head_fwd_s_per_token * T if last else 0.0)
    bwd = sum(layer.bwd_s(T) for layer in layers) + (profile.head_bwd_s_per_token * T if last else 0.0)
    act = int(sum(layer.act_bytes_per_token for layer in layers) * T
              + (profile.head_act_bytes_per_token * T if last else 0))
    host = profile.weights_on == "host"
    local_only = dp == 1 and not host
    page = max((u[0] for u in units), default=0)
    scratch = dp if profile.cpu_gloo else 0
    tot = [sum(u[j] for u in units) for j in range(11)]
    _, chunks, bchunks, fg, bg, fh, bh, sl, bsl, shard, store = tot
    if local_only:
        fp = bp = fb = bb = fg = bg = 0
    else:
        fp, bp = chunks * page, bchunks * page
        fb = 0 if host else (dp + 1 + scratch) * sl
        bb = 0 if host else (dp + 1 + scratch) * bsl

    def load_s(g, h):
        t = profile.allgather.time(g) if g else 0.0
        if h:
            t = max(t, profile.h2d.time(h))
        return t

    unit_buffers = [(0, 0) if host or local_only else ((dp + 1 + scratch) * u[7], (dp + 1 + scratch) * u[8])
                    for u in units]
    keep = 1 + profile.prefetch_depth
    fub = sum(sorted((b[0] for b in unit_buffers), reverse=True)[:keep])
    bub = sum(sorted((b[1] for b in unit_buffers), reverse=True)[:keep])
    per_layer, layer_pages = [], []
    for layer, u in zip(layers, units):
        lg, lbg, lh, lbh = (0, 0, 0, 0) if local_only else (u[3], u[4], u[5], u[6])
        per_layer.append((layer.fwd_s(T), layer.bwd_s(T), load_s(lg, lh), load_s(lbg, lbh)))
        layer_pages.append(0 if local_only else u[1] * page)
    adapters = sum(layer.adapter_params for layer in layers) + (profile.head_adapter_params if last else 0)
    ws = sum(sorted(layer_pages, reverse=True)[: 1 + profile.prefetch_depth])
    weights = tuple(w for layer in layers for w in layer.weights) + (tuple(profile.head_weights) if last else ())
    return PackCost(weights, fwd, bwd, act, fg, bg, fh if not local_only else 0, bh if not local_only else 0,
                    fp, bp, fb, bb, 0 if host else shard, ADAPTER_BYTES_PER_PARAM * adapters, ws, fub, bub,
                    store if host else 0, tuple(per_layer))


def _load_time(profile: PipelineProfile, c: PackCost, kind: str) -> float:
    g, h = (c.fwd_gather, c.fwd_host) if kind == FORWARD else (c.bwd_gather, c.bwd_host)
    t = profile.allgather.time(g) if g else 0.0
    if h:
        t = max(t, profile.h2d.time(h))
    return t


def _transient_exposed(c: PackCost, kind: str) -> float:
    """In-action gathers of a transient pack, each layer prefetched one layer ahead."""
    total, prev = 0.0, 0.0
    seq = c.layer_times if kind == FORWARD else tuple(reversed(c.layer_times))
    for fc, bc, fl, bl in seq:
        load = fl if kind == FORWARD else bl
        total += max(0.0, load - prev)
        prev = fc if kind == FORWARD else bc
    return total


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


def _static_bytes(profile: PipelineProfile, layout: PipelineLayout, r: int, costs: dict, micro_batch_size: int) -> int:
    n = layout.n_packs
    p2p = micro_batch_size * profile.seq_len * profile.hidden_size * profile.act_element_size
    total = profile.reserved_bytes
    for k in layout.packs_of_rank(r):
        c = costs[k]
        total += c.shard_bytes + c.adapter_bytes
        if profile.cpu_gloo and profile.weights_on == "host":  # on CPU the host store is in the same memory
            total += c.store_bytes
        total += ((k > 0) + (k < n - 1)) * layout.micro_batches * p2p
        if k == 0:
            total += profile.first_static_bytes
        if k == n - 1:
            total += profile.last_static_bytes
    return total


# ---------------------------------------------------------------- the simulation

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


# ---------------------------------------------------------------- closed-form screening

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


__all__ = ["PackCost", "PipeLayer", "PipeWeight", "PipelinePrediction", "PipelineProfile", "estimate", "pack_cost",
           "pp1_time_of", "simulate"]
