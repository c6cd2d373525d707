"""The pipeline's layout: degree, packs, stage boundaries, placement, schedule orders and the
rules a schedule puts on them. Pure Python (the planner's room): the runtime side is
python_api/pipeline/, the cost and memory models of a layout are pipeline_model.py.

    layout = PipelineLayout.build(world_size=4, pp=2, n_layers=16, schedule="looped-bfs",
                                  micro_batches=8, pack_size=2)
    layout.packs_of_rank(0)      # (0, 2, 4, 6): round-robin
    layout.layers_of_pack(2)     # range(4, 6)
    layout.order(0)              # [("F", 0, 0), ("F", 0, 1), ...]: the schedule's actions on pp rank 0

[Note: packs, stages and placement]
The world is a (pp, dp) mesh: pp ranks along the pipeline, dp replicas of each. The decoder
layers are cut into n_packs = pp x v *packs*, runs of consecutive layers; a pack is one
virtual stage of torch.distributed.pipelining (one PipelineStage). Pack k runs on pp rank
k mod pp (round-robin: the multi-stage schedules compute a stage as local index x pp + rank,
and a contiguous placement fails their warm-up vote), so pp rank r holds packs r, r + pp, ...
The first pack also holds the embeddings, the last the final norm, the head and the loss.
GPipe and 1F1B run one stage per rank (v = 1: the pack is the rank's whole stage); LoopedBFS
and Interleaved 1F1B run v >= 1 packs per rank, which is what lets a pack process every
micro-batch of the step before the rank moves on (Tiny-Pipe's pack, LoopedBFS's order).
Boundaries are either given or balanced by compute, counting the embeddings' cost on the
first pack and the head's (norm, lm_head, loss) on the last: with one pack per rank, the
partition of the layers into contiguous runs whose largest cost is smallest (ties towards
longer earlier packs); with v > 1 packs per rank, what matters is each rank's sum over its v
packs, so the packs start equal and layers move across boundaries while that lowers the
largest rank load (`rank_balanced_boundaries`). Both are deterministic, so every rank
computes the same boundaries. With equal layers and negligible embedding/head costs every
pack gets n_layers / n_packs layers; a heavy head takes layers off the last rank.
`pack_size` P asks for n_packs = ceil(n_layers / P).

[Note: pack residency]
How long a pack's frozen chunks stay in its pool (python_api/pipeline/residency.py does it),
in the lifetimes of the residency vocabulary (docs/architecture.md, "Residency"):
  persistent  kept across steps: loaded once, then never again (0 loads per step)
  step        loaded at the pack's first action of the step, kept for every micro-batch's
              forward and backward, released after its last backward (1 load per step)
  phase       released after its last forward and loaded again for its backwards (2 loads
              per step: a forward-only load and a load of the weights that have a backward use)
  transient   every chunk gathered for each use and dropped after it (the runtime's
              TRANSIENT class: m loads of forward weights and m of backward weights per step)
The runtime's micro-batch lifetime (Residency.PEAK) is no pack mode: it would drop a pack's
chunks after every backward ([Note: one runtime per pack]).
`window` W is how many upcoming loads are prefetched (issued while earlier packs compute);
0 loads each pack when its first action starts.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass

SCHEDULES = ("gpipe", "1f1b", "looped-bfs", "interleaved-1f1b")
MULTI_STAGE_SCHEDULES = ("looped-bfs", "interleaved-1f1b")
RESIDENCIES = ("persistent", "step", "phase", "transient")
FORWARD, BACKWARD = "F", "B"


class PipelineError(ValueError):
    """A pipeline configuration that cannot run (the message names the problem)."""


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


# ---------------------------------------------------------------- boundaries

def balanced_boundaries(layer_costs, n_packs: int, first_cost: float = 0.0, last_cost: float = 0.0) -> tuple[int, ...]:
    """Start index of each of `n_packs` contiguous runs of the layers, plus the end: the
    partition whose largest run cost (the first run also paying `first_cost`, the last
    `last_cost`) is smallest ([Note: packs, stages and placement])."""
    costs = [float(c) for c in layer_costs]
    L = len(costs)
    if not _is_int(n_packs) or n_packs < 1:
        raise PipelineError(f"the number of packs must be a positive int, got {n_packs!r}")
    if n_packs > L:
        raise PipelineError(f"more pipeline stages ({n_packs}) than decoder layers ({L}): every stage needs a layer")
    if any(c < 0 or math.isnan(c) for c in costs) or first_cost < 0 or last_cost < 0:
        raise PipelineError("layer costs must be numbers >= 0")
    # Bottleneck search: `greedy(B)` packs greedily from the front, each run as long as its cost
    # (with the first run's and the last run's extras) stays <= B. Greedy is exact here: it
    # covers the longest prefix with any number of runs, so the last run is the shortest
    # suffix any partition can leave, and runs can always be split further (costs >= 0) to
    # make exactly n_packs. Bisection on B (60 halvings: the optimum to ~1e-18 of the total)
    # then greedy at the bound found; O(60 L).

    def greedy(B: float) -> list[int] | None:
        B = B * (1 + 1e-12)  # sums in another order than B's own must not miss it by an ulp
        starts, i = [0], 0
        for k in range(n_packs - 1):
            cap = B - (first_cost if k == 0 else 0.0)
            j, acc = i, 0.0
            # leave at least one layer for every later run
            while j < L - (n_packs - k - 1) and acc + costs[j] <= cap:
                acc += costs[j]
                j += 1
            if j == i:
                return None
            starts.append(j)
            i = j
        last = sum(costs[i:]) + last_cost + (first_cost if n_packs == 1 else 0.0)
        if i >= L or last > B:
            return None
        return starts + [L]

    lo = max(costs) if costs else 0.0
    hi = sum(costs) + first_cost + last_cost
    if greedy(lo) is not None:
        hi = lo
    else:
        for _ in range(60):
            mid = (lo + hi) / 2
            if greedy(mid) is None:
                lo = mid
            else:
                hi = mid
    out = greedy(hi)
    if out is None:  # cannot happen: hi is feasible by construction
        raise AssertionError("balanced_boundaries: the bound found is not feasible")
    return tuple(out)


def rank_balanced_boundaries(layer_costs, n_packs: int, pp: int, first_cost: float = 0.0,
                             last_cost: float = 0.0) -> tuple[int, ...]:
    """Boundaries of `n_packs` packs placed round-robin on `pp` ranks that balance the ranks'
    loads (the sum of their packs' costs), not the packs': from equal layer counts (the
    remainder to the first packs), move one layer across one boundary at a time while that
    lowers the largest rank load (ties: the smaller sum of squared rank loads, then the
    earlier boundary), so the head's cost takes layers off the last rank's packs rather than
    leaving one pack of one layer. With one pack per rank it is balanced_boundaries."""
    costs = [float(c) for c in layer_costs]
    L = len(costs)
    if n_packs <= pp:
        return balanced_boundaries(costs, n_packs, first_cost, last_cost)
    if n_packs > L:
        raise PipelineError(f"more pipeline stages ({n_packs}) than decoder layers ({L}): every stage needs a layer")
    base, rem = divmod(L, n_packs)
    b = [0]
    for k in range(n_packs):
        b.append(b[-1] + base + (1 if k < rem else 0))
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)

    def score(bounds):
        loads = [0.0] * pp
        for k in range(n_packs):
            loads[k % pp] += prefix[bounds[k + 1]] - prefix[bounds[k]] + (first_cost if k == 0 else 0.0) + \
                (last_cost if k == n_packs - 1 else 0.0)
        return (max(loads), sum(x * x for x in loads))

    best = score(b)
    for _ in range(4 * L):
        move = None
        for j in range(1, n_packs):
            for d in (-1, 1):
                nb = b[j] + d
                if not b[j - 1] < nb < b[j + 1]:
                    continue
                trial = b[:j] + [nb] + b[j + 1:]
                sc = score(trial)
                if sc[0] < best[0] * (1 - 1e-12) or (sc[0] <= best[0] * (1 + 1e-12) and sc[1] < best[1] * (1 - 1e-12)):
                    if move is None or sc < move[0]:
                        move = (sc, trial)
        if move is None:
            break
        best, b = move
    return tuple(b)


def packs_for_size(n_layers: int, pack_size: int) -> int:
    if not _is_int(pack_size) or pack_size < 1:
        raise PipelineError(f"the pack size must be a positive int, got {pack_size!r}")
    if pack_size > n_layers:
        raise PipelineError(f"pack size {pack_size} exceeds the model's {n_layers} decoder layers")
    return -(-n_layers // pack_size)


# ---------------------------------------------------------------- schedule rules and orders

def micro_batch_error(schedule: str, pp: int, packs_per_rank: int, m: int) -> str | None:
    """Why `schedule` cannot run `m` micro-batches on pp ranks with `packs_per_rank` packs
    each, or None (torch.distributed.pipelining's own rules, checked before it is built)."""
    if not _is_int(m) or m < 1:
        return f"the number of micro-batches must be a positive int, got {m!r}"
    if schedule == "1f1b" and m < pp:
        return (f"schedule 1f1b needs at least as many micro-batches as pipeline stages: {m} micro-batches "
                f"for {pp} stages (use --micro-batches {pp} or more, or gpipe)")
    if schedule == "interleaved-1f1b":
        rounds = max(1, m // pp)
        if m % rounds:
            ok = [x for x in range(max(1, m - pp), m + pp + 1) if x % max(1, x // pp) == 0]
            return (f"schedule interleaved-1f1b needs the number of micro-batches to be a multiple of its rounds "
                    f"(max(1, m // pp) = {rounds}): {m} micro-batches on {pp} stages; e.g. {ok[:4]}")
    return None


def schedule_order(schedule: str, pp: int, packs_per_rank: int, m: int, rank: int) -> list[tuple[str, int, int]]:
    """The actions (F or B, pack index, micro-batch) pp rank `rank` runs in one step, in order:
    the orders torch.distributed.pipelining 2.14 computes (ScheduleGPipe, Schedule1F1B,
    ScheduleLoopedBFS, ScheduleInterleaved1F1B), used by the cost model; the runtime learns
    the order it actually runs (python_api/pipeline/residency.py)."""
    v = packs_per_rank
    if schedule in ("gpipe", "1f1b") and v != 1:
        raise PipelineError(f"schedule {schedule} runs one stage per rank, got {v} packs per rank")
    if schedule == "gpipe":
        return [(FORWARD, rank, i) for i in range(m)] + [(BACKWARD, rank, i) for i in range(m)]
    if schedule == "1f1b":
        warm = min(m, pp - rank)
        out = [(FORWARD, rank, i) for i in range(warm)]
        f, b = warm, 0
        while f < m:
            out.append((BACKWARD, rank, b))
            b += 1
            out.append((FORWARD, rank, f))
            f += 1
        out.extend((BACKWARD, rank, i) for i in range(b, m))
        return out
    stages = [rank + k * pp for k in range(v)]
    if schedule == "looped-bfs":
        out = [(FORWARD, s, i) for s in stages for i in range(m)]
        out += [(BACKWARD, s, i) for s in reversed(stages) for i in reversed(range(m))]
        return out
    if schedule == "interleaved-1f1b":
        rounds = max(1, m // pp)
        per_round = m // rounds
        warm = min((v - 1) * per_round + 2 * (pp - 1 - rank), m * v)
        total = m * v
        steady = total - warm

        def fwd_stage(step):
            return ((step // per_round) % v) * pp + rank

        def bwd_stage(step):
            return (v - 1 - ((step - warm) // per_round) % v) * pp + rank

        fmb: dict[int, int] = {}
        bmb: dict[int, int] = {}
        out = []
        for op in range(warm + steady + (total - steady)):
            if op < warm + steady:
                s = fwd_stage(op)
                out.append((FORWARD, s, fmb.get(s, 0)))
                fmb[s] = fmb.get(s, 0) + 1
            if op >= warm:
                s = bwd_stage(op)
                out.append((BACKWARD, s, bmb.get(s, 0)))
                bmb[s] = bmb.get(s, 0) + 1
        return out
    raise PipelineError(f"unknown schedule {schedule!r}; known: {', '.join(SCHEDULES)}")


# ---------------------------------------------------------------- the layout

@dataclass(frozen=True)
class PipelineLayout:
    """What a pipelined run is made of; `check()` (run by the constructor) names whatever
    cannot run. See [Note: packs, stages and placement] and [Note: pack residency]."""

    world_size: int
    pp: int
    schedule: str
    micro_batches: int
    boundaries: tuple[int, ...]  # start layer of each pack, then the number of layers
    residency: tuple[str, ...]  # per pack
    window: int = 1

    def __post_init__(self):
        object.__setattr__(self, "boundaries", tuple(self.boundaries))
        object.__setattr__(self, "residency", tuple(self.residency))
        self.check()

    # -------------------------------------------------------- derived

    @property
    def dp(self) -> int:
        return self.world_size // self.pp

    @property
    def n_layers(self) -> int:
        return self.boundaries[-1]

    @property
    def n_packs(self) -> int:
        return len(self.boundaries) - 1

    @property
    def packs_per_rank(self) -> int:
        return self.n_packs // self.pp

    def rank_of_pack(self, k: int) -> int:
        return k % self.pp

    def packs_of_rank(self, pp_rank: int) -> tuple[int, ...]:
        return tuple(range(pp_rank, self.n_packs, self.pp))

    def layers_of_pack(self, k: int) -> range:
        return range(self.boundaries[k], self.boundaries[k + 1])

    def order(self, pp_rank: int) -> list[tuple[str, int, int]]:
        return schedule_order(self.schedule, self.pp, self.packs_per_rank, self.micro_batches, pp_rank)

    def loads_per_step(self, k: int) -> tuple[int, int]:
        """(loads of every forward weight, loads of the backward-used weights) of pack k per
        step in steady state ([Note: pack residency])."""
        mode = self.residency[k]
        m = self.micro_batches
        return {"persistent": (0, 0), "step": (1, 0), "phase": (1, 1), "transient": (m, m)}[mode]

    # -------------------------------------------------------- checks

    def check(self) -> None:
        W, pp = self.world_size, self.pp
        if not _is_int(W) or W < 1:
            raise PipelineError(f"world size must be a positive int, got {W!r}")
        if not _is_int(pp) or pp < 1:
            raise PipelineError(f"the pipeline degree must be a positive int, got {pp!r}")
        if W % pp:
            raise PipelineError(f"the pipeline degree {pp} does not divide the world size {W} "
                                f"(world = pp x dp; divisors of {W}: {divisors(W)})")
        if self.schedule not in SCHEDULES:
            raise PipelineError(f"unknown schedule {self.schedule!r}; known: {', '.join(SCHEDULES)}")
        b = self.boundaries
        if len(b) < 2 or not all(_is_int(x) for x in b) or b[0] != 0:
            raise PipelineError(f"pack boundaries must be ints starting at 0, got {b}")
        L = b[-1]
        n = len(b) - 1
        if n > L:
            raise PipelineError(f"more pipeline stages ({n}) than decoder layers ({L}): every stage needs a layer")
        empty = [k for k in range(n) if b[k + 1] <= b[k]]
        if empty:
            raise PipelineError(f"pack boundaries {b} leave pack(s) {empty} without layers")
        if n < pp:
            raise PipelineError(f"{n} packs for {pp} pipeline ranks leave rank(s) {list(range(n, pp))} without a "
                                f"stage (a pack size of at most {L // pp} gives every rank one)")
        if n % pp:
            raise PipelineError(f"{n} packs do not spread evenly over {pp} pipeline ranks (round-robin placement "
                                f"needs a multiple of {pp}): rank(s) {list(range(n % pp, pp))} would hold one pack "
                                f"fewer; pick a pack size giving a multiple of {pp} packs")
        if self.schedule not in MULTI_STAGE_SCHEDULES and n != pp:
            raise PipelineError(f"schedule {self.schedule} runs one stage per rank: {pp} packs of about "
                                f"{L // pp} layers, not {n} (for packs smaller than a stage use looped-bfs or "
                                f"interleaved-1f1b)")
        err = micro_batch_error(self.schedule, pp, n // pp, self.micro_batches)
        if err:
            raise PipelineError(err)
        if len(self.residency) != n:
            raise PipelineError(f"residency gives {len(self.residency)} modes for {n} packs")
        bad = sorted({r for r in self.residency if r not in RESIDENCIES})
        if bad:
            raise PipelineError(f"unknown pack residency {bad}; known: {', '.join(RESIDENCIES)}")
        if not _is_int(self.window) or self.window < 0:
            raise PipelineError(f"the prefetch window must be an int >= 0 (packs), got {self.window!r}")

    # -------------------------------------------------------- building

    @classmethod
    def build(cls, world_size: int, pp: int, n_layers: int, schedule: str, micro_batches: int, *,
              pack_size: int | None = None, boundaries=None, layer_costs=None, first_cost: float = 0.0,
              last_cost: float = 0.0, residency: str | tuple[str, ...] = "step", window: int = 1) -> PipelineLayout:
        """A layout with boundaries given, or balanced over `layer_costs` (default: equal) into
        ceil(n_layers / pack_size) packs (default: one pack per pipeline rank)."""
        if not _is_int(n_layers) or n_layers < 1:
            raise PipelineError(f"the model must have decoder layers, got {n_layers!r}")
        if not _is_int(pp) or pp < 1 or not _is_int(world_size) or world_size < 1 or world_size % pp:
            # The constructor says it with the divisors; get there without a bad division first.
            return cls(world_size, pp, schedule, micro_batches, (0, max(1, n_layers)), ("step",), window)
        if boundaries is not None:
            bounds = tuple(boundaries)
            if pack_size is not None:
                raise PipelineError("give pack boundaries or a pack size, not both")
            if not bounds or bounds[-1] != n_layers:
                raise PipelineError(f"pack boundaries {bounds} must end at the number of decoder layers ({n_layers})")
        else:
            n = pp if pack_size is None else packs_for_size(n_layers, pack_size)
            if n > n_layers:
                raise PipelineError(f"more pipeline stages ({n}) than decoder layers ({n_layers}): every stage "
                                    f"needs a layer")
            if n < pp:
                raise PipelineError(f"pack size {pack_size} gives {n} pack(s) of the {n_layers} layers for {pp} "
                                    f"pipeline ranks: rank(s) {list(range(n, pp))} would hold no stage (a pack size "
                                    f"of at most {n_layers // pp} gives every rank one)")
            costs = layer_costs if layer_costs is not None else [1.0] * n_layers
            if len(costs) != n_layers:
                raise PipelineError(f"{len(costs)} layer costs for {n_layers} layers")
            bounds = rank_balanced_boundaries(costs, n, pp, first_cost, last_cost)
        modes = (residency,) * (len(bounds) - 1) if isinstance(residency, str) else tuple(residency)
        return cls(world_size, pp, schedule, micro_batches, bounds, modes, window)

    # -------------------------------------------------------- JSON

    def to_dict(self) -> dict:
        out = asdict(self)
        out["boundaries"] = list(self.boundaries)
        out["residency"] = list(self.residency)
        return out

    @classmethod
    def from_dict(cls, d: dict) -> PipelineLayout:
        keys = ("world_size", "pp", "schedule", "micro_batches", "boundaries", "residency", "window")
        if not isinstance(d, dict) or set(d) != set(keys):
            raise PipelineError(f"a pipeline layout document has exactly the fields {keys}, got {sorted(d) if isinstance(d, dict) else d!r}")
        return cls(d["world_size"], d["pp"], d["schedule"], d["micro_batches"], tuple(d["boundaries"]),
                   tuple(d["residency"]), d["window"])

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)

    def describe(self) -> str:
        sizes = [self.boundaries[k + 1] - self.boundaries[k] for k in range(self.n_packs)]
        modes = sorted(set(self.residency))
        return (f"pp {self.pp} x dp {self.dp}, {self.schedule}, {self.micro_batches} micro-batches, "
                f"{self.n_packs} packs of {sizes if len(set(sizes)) > 1 else sizes[0]} layers "
                f"({self.packs_per_rank} per rank), residency {'/'.join(modes)}, window {self.window}")


# ---------------------------------------------------------------- residency over the order

def load_events(layout: PipelineLayout, order) -> list[tuple[int, int, str, int]]:
    """The loads of one step in steady state, in order: (index of the action that needs it,
    pack, FORWARD (every forward weight) or BACKWARD (the weights with a backward use), index
    of the action after which that pack was last released, -1 for before the step)
    ([Note: pack residency]; python_api/pipeline/residency.py issues them)."""
    events = []
    fwd: dict[int, int] = {}
    released: dict[int, int] = {}
    loaded: dict[int, bool] = {}
    for t, (kind, k, _) in enumerate(order):
        mode = layout.residency[k]
        if mode == "transient":
            continue
        if not loaded.get(k, False) and mode != "persistent":
            events.append((t, k, kind if mode == "phase" else FORWARD, released.get(k, -1)))
            loaded[k] = True
        if kind == FORWARD:
            fwd[k] = fwd.get(k, 0) + 1
            if fwd[k] == layout.micro_batches and mode == "phase":
                loaded[k], released[k] = False, t
    return events


def residency_trace(layout: PipelineLayout, pp_rank: int, fwd_bytes: dict, bwd_bytes: dict,
                    first_step: bool = False) -> tuple[list[int], list[int]]:
    """Pool bytes held by pp rank `pp_rank`'s packs over one step: (during each action, after
    it), as the pack residency runs it ([Note: pack residency]); `fwd_bytes[k]` are the page
    bytes of pack k's forward weights (all of them), `bwd_bytes[k]` those of its weights with
    a backward use. In steady state (persistent packs resident throughout; prefetch on), or
    the first step (nothing resident yet, nothing prefetched: the order is being learned).
    A transient pack holds pages only inside its own actions (its working set, bounded by
    the whole pack here)."""
    order = layout.order(pp_rank)
    m = layout.micro_batches
    events = load_events(layout, order)
    held: dict[int, int] = {}  # pack -> bytes resident
    for k in layout.packs_of_rank(pp_rank):
        if layout.residency[k] == "persistent" and not first_step:
            held[k] = fwd_bytes[k]
    issued: set[int] = set()
    fwd: dict[int, int] = {}
    bwd: dict[int, int] = {}
    during, after = [], []
    for t, (kind, k, _) in enumerate(order):
        mode = layout.residency[k]
        if not first_step and layout.window > 0:
            ahead = [i for i, e in enumerate(events) if e[0] > t][: layout.window]
            for i in ahead:
                e = events[i]
                if i not in issued and e[3] < t:
                    held[e[1]] = fwd_bytes[e[1]] if e[2] == FORWARD else bwd_bytes[e[1]]
                    issued.add(i)
        if k not in held:  # loaded by its own use
            held[k] = bwd_bytes[k] if kind == BACKWARD and mode in ("phase", "transient") else fwd_bytes[k]
        during.append(sum(held.values()))
        if kind == FORWARD:
            fwd[k] = fwd.get(k, 0) + 1
            if fwd[k] == m and mode == "phase":
                held.pop(k, None)
        else:
            bwd[k] = bwd.get(k, 0) + 1
            if bwd[k] == m and mode in ("phase", "step"):
                held.pop(k, None)
        if mode == "transient":
            held.pop(k, None)
        after.append(sum(held.values()))
    return during, after


__all__ = ["BACKWARD", "FORWARD", "MULTI_STAGE_SCHEDULES", "RESIDENCIES", "SCHEDULES", "PipelineError",
           "PipelineLayout", "balanced_boundaries", "divisors", "rank_balanced_boundaries", "load_events", "micro_batch_error", "packs_for_size",
           "residency_trace", "schedule_order"]
