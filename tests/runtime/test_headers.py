"""[Note: headers off the prefetch path] in python_api/distributed/collectives.py: with
ELASTIC_HEADER_CHANNEL=1 on gloo a prefetch issues its header exchange without waiting for it; the data collective follows once
the headers compared equal, on private groups. (Diverged ranks still fail on every rank with
the rule: tests/runtime/test_runtime_setups.py.)"""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist

from tests._dist import run_distributed
from tests.runtime.test_runtime import DIMS, FP32, make_model

pytestmark = [pytest.mark.distributed, pytest.mark.needs_ext]

LATE_S = 2.0


def _late_peer_worker(rank, world_size):
    from elastic_kernels.api import ElasticPolicy, elasticize, runtime_of
    from elastic_kernels.api.distributed import collectives

    model = make_model()
    elasticize(model, ElasticPolicy(chunk_bytes=24 * FP32 * 8, keep_ratio=1.0, persist_ratio=0.0))
    rt = runtime_of(model)
    groups = []
    real_gather, real_into = dist.all_gather, collectives.all_gather_into
    dist.all_gather = lambda *a, **k: (groups.append(("header", k["group"])), real_gather(*a, **k))[1]
    collectives.all_gather_into = lambda out, send, group, async_op: (
        groups.append(("data", group)), real_into(out, send, group, async_op))[1]
    dist.barrier()
    if rank == 1:
        time.sleep(LATE_S)  # a peer that reaches the prefetch late
    start = time.monotonic()
    rt.prefetch(rt.tensors)
    issued = time.monotonic() - start
    x = torch.randn(3, DIMS[0])
    y = model(x)  # consumes the prefetched gathers
    waited = time.monotonic() - start
    dist.all_gather, collectives.all_gather_into = real_gather, real_into
    ch = rt._channel
    kinds = {(kind, g is ch.header_group, g is ch.data_group, g is dist.group.WORLD) for kind, g in groups}
    return issued, waited, sorted(kinds), bool(torch.isfinite(y).all())


def test_prefetch_does_not_wait_for_the_headers(monkeypatch):
    monkeypatch.setenv("ELASTIC_HEADER_CHANNEL", "1")  # opt in: off by default (see the Note)
    (issued, waited, kinds, finite), _ = run_distributed(_late_peer_worker, 2, timeout=120)
    assert issued < LATE_S / 4, f"rank 0's prefetch blocked {issued:.2f} s on its late peer's header"
    assert waited >= LATE_S * 0.75, f"rank 0 used the weights after {waited:.2f} s without its peer's data"
    # headers on the private header group, data on the private data group, nothing on the world group
    assert kinds == [("data", False, True, False), ("header", True, False, False)], kinds
    assert finite


def _default_worker(rank, world_size):
    from elastic_kernels.api import ElasticPolicy, elasticize, runtime_of

    model = make_model()
    elasticize(model, ElasticPolicy(chunk_bytes=24 * FP32 * 8))
    return runtime_of(model)._channel is None


def test_the_channel_is_off_by_default(monkeypatch):
    """Blocking headers on the runtime's group unless ELASTIC_HEADER_CHANNEL=1 (the channel made
    the planner's memory test flaky and once hung it: the Note's figures)."""
    monkeypatch.delenv("ELASTIC_HEADER_CHANNEL", raising=False)
    assert run_distributed(_default_worker, 2, timeout=120) == [True, True]
