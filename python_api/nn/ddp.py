"""A converted model inside `DistributedDataParallel`: DDP averages the adapter gradients, so
the runtime's own all-reduce is switched off while it does.

[Note: DDP and the runtime's all-reduce]
The runtime averages adapter gradients itself (`ElasticPolicy.all_reduce_grads`). Wrapped in
DDP (the HF Trainer does it on several ranks), DDP averages them too: right numbers, twice the
traffic. DDP cannot be told to ignore the adapters instead: a module with nothing left to
reduce is refused ("DistributedDataParallel is not needed when a module doesn't have any
parameter that requires a gradient", torch 2.14). So DDP keeps the reduction (it buckets and
overlaps it with backward, and honours its own `no_sync`, which accelerate uses for gradient
accumulation), and the runtime's is switched off for every forward run inside a DDP that
reduces all of the model's trainable parameters, and back to the policy's own setting for a
forward run outside DDP. Setting `ElasticPolicy(all_reduce_grads=False)` yourself does the same
for any other data-parallel wrapper.
"""

from __future__ import annotations

import logging

import torch.nn as nn

from .linear import RUNTIME_ATTR

logger = logging.getLogger(__name__)


def _ddp_reduces_all(ddp, model: nn.Module) -> bool:
    ignored = getattr(ddp, "parameters_to_ignore", set())
    reduced = {
        id(p) for n, p in ddp.module.named_parameters()
        if n not in ignored and p.requires_grad and not getattr(p, "_ddp_ignored", False)
    }
    trainable = [p for p in model.parameters() if p.requires_grad]
    return bool(trainable) and all(id(p) in reduced for p in trainable)


def pre_forward(model: nn.Module, args) -> None:
    """See [Note: DDP and the runtime's all-reduce]."""
    rt = getattr(model, RUNTIME_ATTR, None)
    if rt is None or rt.world_size == 1:
        return
    from torch.nn.parallel import DistributedDataParallel

    ddp = DistributedDataParallel._get_active_ddp_module()
    under_ddp = False
    if ddp is not None:
        cache = ddp.__dict__.setdefault("_elastic_reduces_all", {})
        if id(model) not in cache:
            cache[id(model)] = _ddp_reduces_all(ddp, model)
            if cache[id(model)]:
                logger.info("elastic: the model runs under DDP, which averages the adapter gradients; "
                            "the runtime's own all-reduce is off while it does")
            else:
                logger.warning("elastic: the model runs under a DDP that ignores some of its trainable "
                               "parameters; the runtime keeps averaging all of them, so the others are "
                               "reduced twice (set ElasticPolicy(all_reduce_grads=False) to leave them to DDP)")
        under_ddp = cache[id(model)]
    rt.set_grad_reduction(False if under_ddp else None)
