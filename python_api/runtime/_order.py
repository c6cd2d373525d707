"""Phases and orders: which pass is running, the order in which layers use their weights
(learned in the first forward and backward), its segments, and the prefetch that follows it
(ElasticRuntime's order, a mixin of runtime.py).

[Note: learned order and prefetch]
The order in which layers use their weights is recorded in the first forward and the first
backward; from then on, when layer i starts, the missing chunks of the next `prefetch_depth`
layers of that order are gathered. Nothing is prefetched before the order is known, so no
byte is gathered that a later use does not consume; if the observed order departs from the
learned one, outstanding prefetches are completed and released and the order is relearned.

[Note: units and coalesced gathers]
A *unit* is a group of weights used together, e.g. the linears of one decoder layer (the HF
`_no_split_modules` block, or an explicit grouping). Once the order of a phase is learned, it
is cut into *segments*: maximal runs of consecutive uses of one unit. The first use of a
segment gathers the missing chunks of every weight of the segment in one coalesced set of
collectives (at most `collective_bytes` each), and prefetch runs `prefetch_depth` segments
ahead, so a decoder layer costs one all-gather per use as under FSDP2 rather than one per
weight. Only weights used in that segment of that phase are gathered (a layer whose input
needs no gradient has no backward use, and nothing is gathered for it). Before an order is
learned (the first iteration) every weight is gathered at its own use.

[Note: recompute inside backward]
Activation checkpointing (`torch.utils.checkpoint`, reentrant or not; HF
`gradient_checkpointing_enable()`) runs a layer's forward again inside backward. Such a use
is recognised by the autograd engine running a graph task on this thread
(`torch._C._current_graph_task_id() != -1`) and belongs to the BACKWARD phase: it does not
start a new forward pass, keeps the learned orders (the recompute uses are part of the
backward order, so they are prefetched like backward uses), keeps other layers' PEAK chunks,
and ends with keep=PEAK so the backward use right after it finds its chunks resident. The
end-of-backward callback is queued once, on the graph task that is running when the phase
changes to BACKWARD (the outermost one: a reentrant checkpoint recomputes in the outer task
before it runs its nested backward), so adapter gradients are all-reduced once per step
whatever the number of checkpointed layers. With reentrant checkpointing the first forward runs
under no_grad, so its PEAK chunks are released (no backward is known to follow) and the
recompute gathers them again; non-reentrant checkpointing keeps them.
"""

from __future__ import annotations

import torch

from ._gathers import _Use
from .tensor import ElasticTensor, Phase, Residency


def in_backward() -> bool:
    """The autograd engine is running a backward on this thread ([Note: recompute inside
    backward])."""
    return torch._C._current_graph_task_id() != -1


class _Order:
    """Phase tracking, the learned orders and their segments, prefetch."""

    def learned_order(self, phase: Phase) -> tuple[int, ...] | None:
        """The weight ids (`ElasticTensor.wid`) in the order `phase` used them, as learned in
        the first pass of that phase (None until then, or after the model took another path);
        recompute uses inside backward belong to the backward order."""
        order = self._order[phase]
        return None if order is None else tuple(order)

    def _enter(self, phase: Phase, et: ElasticTensor) -> None:
        """Track phase changes and the position of `et` in the learned order of `phase`."""
        if phase is Phase.FORWARD:
            order = self._order[Phase.FORWARD]
            new_pass = self.phase is not Phase.FORWARD or (
                order is not None and self._cursor >= len(order)
            ) or (order is None and self._observed and self._observed[0] == et.wid
                  and self._observed.count(et.wid) >= et.uses_per_forward)
            if new_pass:
                self._finish_phase()
                if self._runs_dirty and self.pool is not None:
                    self._sync_runs(promote=True)  # [Note: resident runs]: nothing is in flight here
                self.phase = Phase.FORWARD
                # A backward that raised never ran its queued callback: allow a new one, and
                # drop the gradient buckets it launched ([Note: gradient buckets]).
                self._end_of_backward_queued = False
                if self._params_ready or self._next_bucket:
                    self._reset_grad_round()
        elif self.phase is not Phase.BACKWARD:
            self._finish_phase()
            self.phase = Phase.BACKWARD
            self._queue_end_of_backward()
        order = self._order[self.phase]
        if order is not None and (self._cursor >= len(order) or order[self._cursor] != et.wid):
            # The model took another path: forget the order, release what was prefetched for it.
            self._release_prefetched()
            self._order[self.phase] = None
            self._segments[self.phase] = None
        self._observed.append(et.wid)
        self._cursor += 1

    def _learn(self, phase: Phase, order: list[int]) -> None:
        """Record the order of `phase` and cut it into segments ([Note: units and coalesced
        gathers])."""
        segments: list[tuple[int, int]] = []
        first = 0
        for i in range(1, len(order) + 1):
            if i == len(order) or self.tensors[order[i]].unit != self.tensors[order[first]].unit \
                    or order[i] in order[first:i]:
                segments.extend([(first, i)] * (i - first))
                first = i
        self._order[phase] = order
        self._segments[phase] = segments

    def _finish_phase(self) -> None:
        """Close the current phase: learn its order, release prefetches, sweep non-persistent chunks."""
        if self.phase is not Phase.IDLE and self._order[self.phase] is None and self._observed:
            self._learn(self.phase, list(self._observed))
        try:
            self._release_prefetched()
        finally:
            self._observed = []
            self._cursor = 0
            if self._gather_buffers is not None:
                self._gather_buffers.clear()  # [Note: receive buffers are reused]
            if self.pool is not None and self.phase is not Phase.IDLE:
                keep = Residency.PEAK if self.phase is Phase.FORWARD else Residency.PERSISTENT
                self._sweep(keep)
                # The runtime keeps no page views across uses (a miss is found by lookup_pin), so
                # it only empties the pool's list of evicted keys, which would otherwise grow by
                # every eviction for the whole run.
                self.pool.drain_evicted()
            self.phase = Phase.IDLE

    def _sweep(self, keep: Residency) -> None:
        """Discard resident, unpinned chunks below residency `keep`."""
        for et in self.tensors:
            if et.run is not None:
                continue  # no pages ([Note: resident runs])
            for c, key in enumerate(et.keys):
                if et.residency[c] < keep and self.pool.contains(key) and self.pool.pin_count(key) == 0:
                    self.pool.free(key)

    def _segment_wids(self, position: int) -> list[int]:
        """Weights used from `position` to the end of its segment in the current phase's
        learned order (those before it in the segment have had their use)."""
        order, segments = self._order[self.phase], self._segments[self.phase]
        if order is None or position >= len(order):
            return []
        return list(dict.fromkeys(order[position : segments[position][1]]))

    def _start_use(self, et: ElasticTensor) -> _Use:
        """The use of `et` now: prefetched, or started together with the rest of its segment."""
        use = self._prefetched.pop(et.wid, None)
        if use is not None:
            return use
        others = [self.tensors[w] for w in self._segment_wids(self._cursor - 1)
                  if w != et.wid and w not in self._prefetched and not self._filled_run(w)]
        uses = self._start_uses([et] + others)
        for u in uses[1:]:
            self._prefetched[u.tensor.wid] = u
        return uses[0]

    def _filled_run(self, wid: int) -> bool:
        """A weight held as a filled run needs nothing gathered ([Note: resident runs])."""
        run = self.tensors[wid].run
        return run is not None and run.filled

    def _prefetch_next(self, et: ElasticTensor) -> None:
        """Start the segments following the current one, `prefetch_depth` of them."""
        order = self._order[self.phase]
        depth = self.policy.prefetch_depth
        if order is None or depth == 0 or self._local_only():
            return
        position = self._cursor - 1
        ahead: list[int] = []
        for _ in range(depth):
            position = self._segments[self.phase][position][1] if position < len(order) else position
            if position >= len(order):
                break
            ahead.extend(self._segment_wids(position))
        ahead = [w for w in dict.fromkeys(ahead) if w not in self._prefetched and w != et.wid
                 and not self._filled_run(w)]
        if ahead:
            for use in self._start_uses([self.tensors[w] for w in ahead]):
                self._prefetched[use.tensor.wid] = use

    def prefetch(self, tensors) -> None:
        """Start filling the missing chunks of `tensors` into the pool now, without waiting (a
        prefetch the caller times: a pipeline loading the next pack while the current one
        computes, python_api/pipeline/residency.py). The next use of such a weight finds its
        gathers in flight; a phase change before that use completes them and releases them
        per residency, so chunks that outlive their use (PERSISTENT) are then resident and
        the others are dropped. Every rank of the group alike (it issues collectives)."""
        self.check_open("prefetch")
        if self._local_only():
            return
        wanted = [et for et in dict.fromkeys(tensors) if et.wid not in self._prefetched]
        if wanted:
            with self._device_guard():
                for use in self._start_uses(wanted):
                    self._prefetched[use.tensor.wid] = use

    def _release_prefetched(self) -> None:
        """Complete and release prefetches that no use consumed (the model changed its path).
        Every one is released even if a gather failed; the first failure is raised after."""
        error = None
        prefetched, self._prefetched = self._prefetched, {}
        for use in prefetched.values():
            for c, work in enumerate(use.works):
                if work is not None:
                    try:
                        work.wait(f"{use.tensor.name} (prefetch) chunk {c}")
                    except RuntimeError as exc:
                        error = error or exc
            self._end_use(use, keep=Residency.PERSISTENT)
        if error is not None:
            raise error
