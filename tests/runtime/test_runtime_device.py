"""The runtime's pool path on one process, on CPU (gloo) and on a GPU (NCCL, communication
stream, events, record_stream): world size 1 forced through the pool and the collectives
(`ElasticRuntime(force_pool=True)`), so the first GPU this project gets checks the runtime,
not only the kernels (`make gpu-check` runs the `gpu`-marked case).

Reference: the same frozen linears computed chunk by chunk with plain `F.linear` on the same
device (same GEMM shapes, so bit for bit), and plain `F.linear` on the whole weight to fp32
rounding.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from tests._dist import run_distributed

pytestmark = [pytest.mark.needs_ext]

DIMS = (64, 96, 64, 80)
FP32 = 4


def _chunked(x, w, b, rows):
    from tests.runtime.test_runtime import _ChunkedLinearFn  # the chunk-by-chunk reference, fwd and bwd

    return _ChunkedLinearFn.apply(x, w, b, rows)


def _worker(rank, world_size, device_type, keep, persist, budget):
    from elastic_kernels.api import ElasticLinear, ElasticPolicy, ElasticRuntime

    if device_type == "cuda":
        device = torch.device("cuda", 0)
        torch.cuda.set_device(device)
        group = dist.new_group([0], backend="nccl")
    else:
        device, group = torch.device("cpu"), None
    torch.manual_seed(0)
    linears = [nn.Linear(a, b, device=device) for a, b in zip(DIMS[:-1], DIMS[1:])]
    for lin in linears:
        lin.requires_grad_(False)
    rows = 8
    policy = ElasticPolicy(chunk_bytes=rows * max(DIMS) * FP32, keep_ratio=keep, persist_ratio=persist,
                           pool_budget_bytes=budget)
    rt = ElasticRuntime(policy, group=group, device=device, force_pool=True)
    layers = nn.ModuleList(ElasticLinear.from_linear(lin, rt, f"l{i}") for i, lin in enumerate(linears))
    rt.check_ranks_agree()
    # Every chunk PERSISTENT at budget all: the weights are runs, one GEMM per use
    # ([Note: resident runs]); the reference computes them whole too.
    whole = keep == persist == 1.0 and budget is None
    rpc = [None if whole else et.layout.rows_per_chunk for et in rt.tensors]
    results = []
    allocated = []
    for it in range(4):
        torch.manual_seed(it)
        x = torch.randn(6, DIMS[0], device=device, requires_grad=True)
        xr = x.detach().clone().requires_grad_(True)
        y, yr, yp = x, xr, xr.detach()
        for layer, lin, r in zip(layers, linears, rpc):
            y = torch.tanh(layer(y))
            yr = torch.tanh(_chunked(yr, lin.weight, lin.bias, r))
            yp = torch.tanh(F.linear(yp, lin.weight, lin.bias))
        y.square().sum().backward()
        yr.square().sum().backward()
        assert [et.run is not None for et in rt.tensors] == [whole] * len(rt.tensors)
        if device_type == "cuda":
            torch.cuda.synchronize()
            allocated.append(torch.cuda.memory_allocated(device))
        results.append((
            torch.equal(y, yr), torch.equal(x.grad, xr.grad),
            float((y.detach() - yp).abs().max()), dict(rt.stats()),
        ))
    return results, allocated, rt.pool.page_bytes


def _check(results, allocated, keep, persist):
    for it, (same_y, same_dx, err, st) in enumerate(results):
        assert same_y and same_dx, f"iteration {it}: the pool path changed a bit"
        assert err < 1e-5, err
        assert st["allgather_calls"] > 0 or (it > 0 and persist == 1.0)
    if persist == 1.0:
        assert results[-1][3]["allgather_bytes"] == 0
    if allocated:
        # Steady state: no device memory grows across iterations (receive buffers are dropped
        # after their unpack, pages are reused through the pool).
        assert allocated[-1] == allocated[-2] == allocated[-3], allocated


@pytest.mark.distributed
@pytest.mark.parametrize("keep,persist,budget", [(0.0, 0.0, 0), (1.0, 0.5, None), (1.0, 1.0, None)])
def test_pool_path_world_size_one_cpu(keep, persist, budget):
    results, allocated, _ = run_distributed(_worker, 1, "cpu", keep, persist, budget, timeout=120)[0]
    _check(results, allocated, keep, persist)


@pytest.mark.gpu
@pytest.mark.parametrize("keep,persist,budget", [(0.0, 0.0, 0), (1.0, 0.5, None), (1.0, 1.0, None)])
def test_pool_path_world_size_one_cuda(keep, persist, budget):
    results, allocated, _ = run_distributed(_worker, 1, "cuda", keep, persist, budget, timeout=180)[0]
    _check(results, allocated, keep, persist)
