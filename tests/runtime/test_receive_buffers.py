"""Send and receive buffers reused across gathers on gloo ([Note: receive buffers are reused] in
python_api/distributed/collectives.py): handed out again to gathers of the same size, none
kept at the end of a phase's last use (right before the loss), and not a bit of any result
changed against a new buffer per gather."""

from __future__ import annotations

import pytest
import torch

from tests._dist import run_distributed
from tests.runtime.test_runtime import FP32, adapter_params, make_model

pytestmark = [pytest.mark.distributed, pytest.mark.needs_ext]

DIMS = (24,) * 5  # four frozen layers of one shape: one gather size


def _worker(rank, world_size):
    from elastic_kernels.api import ElasticPolicy, elasticize, runtime_of

    models, runtimes = [], []
    for fresh in (False, True):
        model = elasticize(make_model(DIMS), ElasticPolicy(chunk_bytes=24 * FP32 * 8, pool_budget_bytes=0))
        rt = runtime_of(model)
        if fresh:
            rt._gather_buffers = None  # a new receive buffer per gather: the reference
        models.append(model)
        runtimes.append(rt)
    held_before_loss = []
    for it in range(4):
        x = torch.randn(3, DIMS[0], generator=torch.Generator().manual_seed(it))
        losses = []
        for model, rt in zip(models, runtimes):
            out = model(x)
            if rt._gather_buffers is not None:
                held_before_loss.append(rt._gather_buffers.held_bytes())
            loss = out.square().mean()
            loss.backward()
            losses.append(loss.detach())
        assert torch.equal(losses[0], losses[1]), f"iteration {it}: the loss changed"
        for p, q in zip(adapter_params(models[0]), adapter_params(models[1])):
            assert torch.equal(p.grad, q.grad), f"iteration {it}: a gradient changed"
            with torch.no_grad():
                p -= 0.1 * p.grad
                q -= 0.1 * q.grad
            p.grad = q.grad = None
    return held_before_loss, runtimes[0]._gather_buffers.reused, runtimes[0].stats()["allgather_calls"]


@pytest.mark.parametrize("world_size", [2, 4])
def test_receive_buffers_are_reused_and_dropped_before_the_loss(world_size):
    for held, reused, calls in run_distributed(_worker, world_size, timeout=180):
        # Gathers of one size follow each other within a phase: some found kept buffers (17
        # gathers in 4 iterations at 2 ranks; the working set's pages hit the other uses).
        assert 0 < reused < 2 * calls, (reused, calls)  # a send and a receive buffer per gather
        # ... and none is kept once forward's last use ended (the first iteration has no
        # learned order: its buffers go when the phase ends, after the loss).
        assert held[1:] == [0, 0, 0], held
