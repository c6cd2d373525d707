"""`PackStage`: torch.distributed.pipelining's PipelineStage for one pack, which tells the
pack residency when each of its actions starts and ends and counts what the rank computes
and sends (`StepCounters`).

It overrides only public methods of the stage, each calling the original: the per-micro-batch
forward and backward (every schedule runs its compute through them) and the four methods that
make the P2P operations of a micro-batch (every schedule, single or multi-stage, takes its
sends and receives from them). Arguments pass through untouched, so the signatures of torch
2.11 and 2.14 both fit.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from torch.distributed.pipelining import PipelineStage

from ..planner.pipeline import BACKWARD, FORWARD


@dataclass
class StepCounters:
    """What one rank did in the last step: seconds inside its stages' forwards and backwards
    (compute, the elastic layers' waits for their gathers included), P2P bytes it sent and
    received (activations forward, their gradients backward), and actions run."""

    compute_s: float = 0.0
    p2p_send_bytes: int = 0
    p2p_recv_bytes: int = 0
    forwards: int = 0
    backwards: int = 0

    def reset(self) -> None:
        self.compute_s = 0.0
        self.p2p_send_bytes = self.p2p_recv_bytes = 0
        self.forwards = self.backwards = 0

    def count(self, ops, send: bool) -> None:
        n = sum(op.tensor.numel() * op.tensor.element_size() for op in ops)
        if send:
            self.p2p_send_bytes += n
        else:
            self.p2p_recv_bytes += n


class PackStage(PipelineStage):
    """One pack as a pipeline stage. `residency` (a PackResidency, or None outside training
    steps) hears of every action; `counters` accumulates the step's figures."""

    def __init__(self, submodule, stage_index: int, num_stages: int, device, *, input_args, output_args, group,
                 residency, counters: StepCounters):
        super().__init__(submodule, stage_index, num_stages, device, input_args=input_args, output_args=output_args,
                         group=group)
        self.residency = residency
        self.track = True  # False during a forward-only pass (PipelinedModel.evaluate)
        self.counters = counters

    def _action(self, kind: str, mb: int, run):
        track = self.track and self.residency is not None
        if track:
            self.residency.before(kind, self.stage_index, mb)
        t0 = time.perf_counter()
        try:
            out = run()
        finally:
            self.counters.compute_s += time.perf_counter() - t0
        if kind == FORWARD:
            self.counters.forwards += 1
        else:
            self.counters.backwards += 1
        if track:
            self.residency.after(kind, self.stage_index, mb)
        return out

    def forward_one_chunk(self, fwd_chunk_id, *args, **kwargs):
        return self._action(FORWARD, fwd_chunk_id, lambda: super(PackStage, self).forward_one_chunk(
            fwd_chunk_id, *args, **kwargs))

    def backward_one_chunk(self, bwd_chunk_id, *args, **kwargs):
        if not self.has_backward:  # a forward-only schedule: nothing runs
            return super().backward_one_chunk(bwd_chunk_id, *args, **kwargs)
        return self._action(BACKWARD, bwd_chunk_id, lambda: super(PackStage, self).backward_one_chunk(
            bwd_chunk_id, *args, **kwargs))

    def get_fwd_send_ops(self, fwd_chunk_id):
        ops = super().get_fwd_send_ops(fwd_chunk_id)
        self.counters.count(ops, send=True)
        return ops

    def get_bwd_send_ops(self, bwd_chunk_id):
        ops = super().get_bwd_send_ops(bwd_chunk_id)
        self.counters.count(ops, send=True)
        return ops

    def get_fwd_recv_ops(self, fwd_chunk_id):
        ops = super().get_fwd_recv_ops(fwd_chunk_id)
        self.counters.count(ops, send=False)
        return ops

    def get_bwd_recv_ops(self, bwd_chunk_id):
        ops = super().get_bwd_recv_ops(bwd_chunk_id)
        self.counters.count(ops, send=False)
        return ops
