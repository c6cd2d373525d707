"""Pack residency over a step: when each pack's frozen chunks are loaded, kept, prefetched and
released, following the order the schedule actually runs (`PackResidency`).

[Note: one runtime per pack]
Each pack (virtual stage) has its own ElasticRuntime on the dp group, with its own pool. The
runtime's phases are per pass: a pack's forward of one micro-batch is one forward pass of its
layers, its backward of that micro-batch one backward pass, so the runtime's learned orders and
in-pack prefetch work unchanged when the schedule interleaves forwards and backwards of
different micro-batches (1F1B: F0 F1 B0 F2 B1 ...), and of different packs (interleaved
1F1B). What the runtime alone would do wrong is residency: its PEAK class keeps a chunk from
*a* forward to the next backward and drops it after that backward, so under 1F1B every
backward would drop what the next forward needs. So a pack's chunks are either PERSISTENT for
the runtime (never dropped by a use or a phase sweep) and released *here*, at the points the
pack's mode says ([Note: pack residency] in python_api/planner/pipeline.py), or TRANSIENT
(mode "transient": the runtime gathers them for each use). Releasing is `drop_cached` of the
pack's weights plus `trim` of its pool, which gives the pool's empty segments back, so a
released pack holds no memory. The runtime's adapter-gradient reduction is off (its
end-of-backward callback runs after every micro-batch's backward); the pipeline reduces
gradients over the dp group once per step, after the schedule's last backward.

[Note: following the schedule's order]
Which pack runs when is the schedule's business; this class only sees each action (F or B of
pack k for micro-batch i) start and end, through PackStage. Releases need no order: a pack
has exactly m forwards and m backwards per step, so its last forward (mode "phase") and its
last backward are known by counting. Prefetch needs the order ahead: the first step records
the actions as they run, and from the second step on, before action t, the loads of the next
`window` load events after t (a pack's first action in the step; with "phase" also its first
backward after its last forward) are issued (`ElasticRuntime.prefetch`), each once the pack
it loads has been released. The order is a pure function of (schedule, pp, packs per rank,
m, pp rank), identical on every dp replica of a stage, so the replicas issue the same
gathers in the same order; if a step's order ever departs from the learned one it is
relearned (and nothing is prefetched in that step beyond what was already issued).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..planner.pipeline import BACKWARD, FORWARD, PipelineLayout, load_events
from ..runtime import ElasticRuntime, Phase


@dataclass
class _PackState:
    runtime: ElasticRuntime
    mode: str
    forwards: int = 0
    backwards: int = 0
    loaded_once: bool = False


@dataclass(frozen=True)
class _Load:
    index: int  # the action that needs it
    pack: int
    kind: str  # FORWARD: every forward weight; BACKWARD: the weights with a backward use
    released_at: int  # the action after which the pack is released before this load (-1: before the step)


@dataclass
class ResidencyTrace:
    """Per action of the last step: (action, resident pool bytes of every local pack after it)."""

    points: list = field(default_factory=list)

    @property
    def peak_bytes(self) -> int:
        return max((b for _, b in self.points), default=0)


class PackResidency:
    """The packs of one pp rank ([Note: one runtime per pack], [Note: following the schedule's
    order])."""

    def __init__(self, layout: PipelineLayout, runtimes: dict[int, ElasticRuntime], trace: bool = False):
        self.layout = layout
        self.m = layout.micro_batches
        self.window = layout.window
        self.packs = {k: _PackState(rt, layout.residency[k]) for k, rt in runtimes.items()}
        self.order: list[tuple[str, int, int]] | None = None
        self._seen: list[tuple[str, int, int]] = []
        self._loads: list[_Load] = []
        self._issued: set[int] = set()  # indices into _loads issued this step
        self._released_at: dict[int, int] = {}
        self._trace_on = trace
        self.trace = ResidencyTrace()

    # -------------------------------------------------------- the step

    def begin_step(self) -> None:
        self._seen = []
        self._issued = set()
        self._released_at = {k: -1 for k in self.packs}
        for p in self.packs.values():
            p.forwards = p.backwards = 0
        if self._trace_on:
            self.trace = ResidencyTrace()

    def before(self, kind: str, k: int, mb: int) -> None:
        t = len(self._seen)
        self._seen.append((kind, k, mb))
        if self.order is not None and (t >= len(self.order) or self.order[t] != (kind, k, mb)):
            self.order, self._loads = None, []  # departed from the learned order: relearn
        if self.order is not None and self.window > 0:
            self._prefetch_after(t)

    def after(self, kind: str, k: int, mb: int) -> None:
        p = self.packs[k]
        t = len(self._seen) - 1
        if kind == FORWARD:
            p.forwards += 1
            p.loaded_once = True
            if p.forwards == self.m and p.mode == "phase":
                self.release(k, t)
        else:
            p.backwards += 1
            if p.backwards == self.m and p.mode in ("phase", "step"):
                self.release(k, t)
        if self._trace_on:
            self.trace.points.append((f"{kind}{k}.{mb}", self.resident_bytes()))

    def end_step(self) -> None:
        if self.order is None or self.order != self._seen:
            self.order = list(self._seen)
            self._loads = self._load_events(self.order)

    # -------------------------------------------------------- loads and releases

    def _load_events(self, order) -> list[_Load]:
        return [_Load(*e) for e in load_events(self.layout, order)]

    def _prefetch_after(self, t: int) -> None:
        ahead = [i for i, e in enumerate(self._loads) if e.index > t][: self.window]
        for i in ahead:
            e = self._loads[i]
            if i in self._issued or e.released_at >= t:
                continue
            rt = self.packs[e.pack].runtime
            phase = Phase.FORWARD if e.kind == FORWARD else Phase.BACKWARD
            wids = rt.learned_order(phase)
            if not wids:
                continue
            rt.prefetch([rt.tensors[w] for w in dict.fromkeys(wids)])
            self._issued.add(i)

    def release(self, k: int, t: int = -1) -> None:
        """Drop pack k's chunks and give its pool's empty segments back (after action t)."""
        rt = self.packs[k].runtime
        for et in rt.tensors:
            rt.drop_cached(et)
        if rt.pool is not None:
            rt.pool.trim()
        self._released_at[k] = t

    def resident_bytes(self) -> int:
        """Bytes of the pool pages that hold chunks, over this rank's packs."""
        return sum(p.runtime.pool.stats()["in_use_bytes"] for p in self.packs.values() if p.runtime.pool is not None)

    def reserved_bytes(self) -> int:
        return sum(p.runtime.pool.stats()["reserved_bytes"] for p in self.packs.values() if p.runtime.pool is not None)


__all__ = ["BACKWARD", "FORWARD", "PackResidency", "ResidencyTrace"]
