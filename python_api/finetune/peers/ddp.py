"""DDP + PEFT LoRA: the peer with replicated weights (`--baseline ddp`).

Every rank holds the whole base model, PEFT LoRA with the elastic run's initial adapters, and
DistributedDataParallel over the PEFT model all-reduces the adapter gradients once per
optimizer step (`no_sync` on the other micro-steps). No weight is ever communicated: this is
the limit an elastic run whose pool holds every frozen chunk approaches, at the memory of a
whole model per rank.

[Note: DDP's settings]
- Only the adapters require grad, so only they get DDP buckets; every adapter is used in every
  forward: `find_unused_parameters=False`.
- `static_graph=False`: with `static_graph=True` the first backward inside `no_sync` fails
  with "expect_autograd_hooks_ INTERNAL ASSERT FAILED" (reducer.cpp:1732, torch 2.14.1;
  measured in the issue 18 spike on 2 gloo ranks, grad-accum 2).
- `broadcast_buffers=False`: the only buffers (rotary frequencies) are computed identically
  on every rank and never change; the base weights are identical on every rank already
  (built from the same seed or files, checked finite by `_collective_build`).
"""

from __future__ import annotations

import contextlib
import warnings

from ..engine import Engine
from ..engines import _collective_build, peft_with_initial_adapters
from ..job import Job


class DDPEngine(Engine):
    """The base model replicated on every rank, PEFT LoRA, DistributedDataParallel."""

    kind = "ddp"
    name = "DDP + PEFT (replicated weights)"

    def __init__(self, job: Job, counter):
        from torch.nn.parallel import DistributedDataParallel

        base = _collective_build(job)
        peft_model = peft_with_initial_adapters(job, base)
        device_ids = [job.device.index] if job.device.type == "cuda" else None
        with warnings.catch_warnings():
            # torch 2.14 deprecates broadcast_buffers for forward_sync_buffers, which torch 2.11
            # lacks; False means the same in both.
            warnings.filterwarnings("ignore", message=".*broadcast_buffers.* is deprecated")
            self.model = DistributedDataParallel(peft_model, device_ids=device_ids, find_unused_parameters=False,
                                                 static_graph=False, broadcast_buffers=False)
        self.counter = counter
        self.micro_batch, self.grad_accum = job.cfg.training.micro_batch, job.cfg.training.grad_accum

    def accumulate(self, is_last: bool):
        return contextlib.nullcontext() if is_last else self.model.no_sync()

    def gathered_bytes(self) -> int:
        return self.counter.bytes
