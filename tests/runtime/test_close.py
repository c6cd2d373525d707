"""A converted model that is dropped frees its runtime (pool, shards, host memory), and
`close()` gives them back explicitly ([Note: closing a runtime] in python_api/runtime/runtime.py)."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

from tests._dist import run_distributed
from tests.runtime.test_runtime import DIMS, FP32, make_model

pytestmark = [pytest.mark.needs_ext]


def _train_step(model):
    model(torch.randn(3, DIMS[0], requires_grad=True)).sum().backward()


def _dropped_worker(rank, world_size, weights_on):
    from elastic_kernels.api import ElasticPolicy, elasticize, runtime_of

    model = make_model()
    elasticize(model, ElasticPolicy(chunk_bytes=24 * FP32 * 8, keep_ratio=0.5, persist_ratio=0.25,
                                    weights_on=weights_on))
    for _ in range(2):
        _train_step(model)
    rt = runtime_of(model)
    refs = {"runtime": weakref.ref(rt), "pool": weakref.ref(rt.pool)}
    if rt.tensors[0].shard is not None:
        refs["shard"] = weakref.ref(rt.tensors[0].shard)
    if rt.host_store is not None:
        refs["host store"] = weakref.ref(rt.host_store)
    del rt
    del model
    gc.collect()
    return sorted(name for name, r in refs.items() if r() is not None)


@pytest.mark.distributed
@pytest.mark.parametrize("weights_on", ["device", "host"])
def test_dropped_model_frees_its_runtime(weights_on):
    """Before the fix, the post-accumulate-grad hooks held the runtime: nothing was freed."""
    assert run_distributed(_dropped_worker, 2, weights_on, timeout=120) == [[], []]


def test_dropped_model_frees_its_runtime_single_process():
    from elastic_kernels.api import ElasticPolicy, elasticize, runtime_of

    model = make_model()
    elasticize(model, ElasticPolicy(chunk_bytes=24 * FP32 * 8))
    _train_step(model)
    ref = weakref.ref(runtime_of(model))
    del model
    gc.collect()
    assert ref() is None


def _close_worker(rank, world_size):
    from elastic_kernels.api import ElasticPolicy, elasticize, runtime_of
    from elastic_kernels.api.nn import close

    model = make_model()
    elasticize(model, ElasticPolicy(chunk_bytes=24 * FP32 * 8, keep_ratio=1.0, persist_ratio=1.0))
    _train_step(model)
    rt = runtime_of(model)
    pool = rt.pool
    # Budget all, every chunk PERSISTENT: the weights are runs ([Note: resident runs]), the
    # pool holds no page; the runs' buffers must go too.
    assert pool is not None and rt.run_bytes() > 0
    pool_ref = weakref.ref(pool)
    run_refs = [weakref.ref(et.run.buffer) for et in rt.tensors]
    del pool
    close(model)
    close(model)  # idempotent
    gc.collect()
    out = {"pool gone": pool_ref() is None and rt.pool is None,
           "shards gone": all(et.shard is None for et in rt.tensors),
           "runs gone": all(r() is None for r in run_refs) and all(et.run is None for et in rt.tensors),
           "closed": rt.closed}
    errors = []
    for call in (lambda: model(torch.randn(3, DIMS[0])), lambda: rt.set_pool_budget(0),
                 lambda: rt.full_weight(rt.tensors[0]), lambda: rt.prefetch(rt.tensors)):
        try:
            call()
            errors.append("no error")
        except RuntimeError as e:
            errors.append(str(e))
    out["errors"] = errors
    return out


@pytest.mark.distributed
def test_close_returns_everything_and_use_after_close_is_an_error():
    for out in run_distributed(_close_worker, 2, timeout=120):
        assert out["pool gone"] and out["shards gone"] and out["runs gone"] and out["closed"], out
        for msg in out["errors"]:
            assert "this runtime was closed" in msg, msg
