"""The quantized pool path on one process, on CPU (gloo) and on a GPU (NCCL, communication
stream, Triton dequant into the recycled workspace, stream-ordered page reuse): world size 1
forced through the pool and the collectives (`ElasticRuntime(force_pool=True)`), for every
format, so the first GPU this project gets checks the quantized runtime (`make gpu-check`
runs the `gpu`-marked case).

Reference: plain frozen linears on the dequantized weights (tests/quant/_models.py, on the CPU
kernel, moved to the device: the Triton dequant is bit-identical to it, tests/kernels), computed
chunk by chunk with the same GEMM shapes: bit for bit, forward and dx."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from tests._dist import run_distributed
from tests.quant._models import dequantized

pytestmark = [pytest.mark.needs_ext]

DIMS = (64, 192, 128, 64)  # row lengths 64, 192, 128: multiples of every block used
FORMATS = [("nf4", None, False), ("nf4", None, True), ("int8", 32, False)]


def _worker(rank, world_size, device_type, fmt, block, nested, keep, persist, budget):
    from elastic_kernels.api import ElasticLinear, ElasticPolicy, ElasticRuntime
    from tests.runtime.test_runtime import _ChunkedLinearFn

    if device_type == "cuda":
        device = torch.device("cuda", 0)
        torch.cuda.set_device(device)
        group = dist.new_group([0], backend="nccl")
    else:
        device, group = torch.device("cpu"), None
    torch.manual_seed(0)
    linears = [nn.Linear(a, b).requires_grad_(False) for a, b in zip(DIMS[:-1], DIMS[1:])]
    rows = 8
    policy = ElasticPolicy(chunk_bytes=rows * max(DIMS) * 4, keep_ratio=keep, persist_ratio=persist,
                           pool_budget_bytes=budget, weight_format=fmt, quant_block_size=block, quant_nested=nested)
    rt = ElasticRuntime(policy, group=group, device=device, force_pool=True)
    layers = [ElasticLinear.from_linear(lin.to(device), rt, f"l{i}") for i, lin in enumerate(linears)]
    rt.check_ranks_agree()
    rpc = [et.layout.rows_per_chunk for et in rt.tensors]
    deq = [dequantized(lin.weight.cpu(), r, fmt, block, nested).to(device) for lin, r in zip(linears, rpc)]
    results, allocated = [], []
    for it in range(4):
        torch.manual_seed(it)
        x = torch.randn(6, DIMS[0], device=device, requires_grad=True)
        xr = x.detach().clone().requires_grad_(True)
        y, yr = x, xr
        for layer, lin, w, r in zip(layers, linears, deq, rpc):
            y = torch.tanh(layer(y))
            yr = torch.tanh(_ChunkedLinearFn.apply(yr, w, lin.bias, r))
        y.square().sum().backward()
        yr.square().sum().backward()
        if device_type == "cuda":
            torch.cuda.synchronize()
            allocated.append(torch.cuda.memory_allocated(device))
        results.append((torch.equal(y, yr), torch.equal(x.grad, xr.grad), dict(rt.stats())))
    pages = {et.name: et.page_bytes for et in rt.tensors}
    return results, allocated, pages, rt.pool.page_bytes


def _check(results, allocated, pages, page, persist):
    fp32_chunk = 8 * max(DIMS) * 4  # every weight's fp32 chunk: whole rows of chunk_bytes
    assert all(p <= 0.3 * fp32_chunk for p in pages.values()), pages  # pages of the quantized chunk
    assert page == -(-max(pages.values()) // 512) * 512
    for it, (same_y, same_dx, st) in enumerate(results):
        assert same_y and same_dx, f"iteration {it}: the quantized pool path changed a bit"
        assert st["allgather_calls"] > 0 or (it > 0 and persist == 1.0)
    if persist == 1.0:
        assert results[-1][2]["allgather_bytes"] == 0
    if allocated:  # steady state: the workspace and pages are recycled, nothing grows
        assert allocated[-1] == allocated[-2] == allocated[-3], allocated


RESIDENCY = [(0.0, 0.0, 0), (1.0, 0.5, None), (1.0, 1.0, None)]


@pytest.mark.distributed
@pytest.mark.parametrize("fmt,block,nested", FORMATS, ids=["nf4", "nf4-nested", "int8-32"])
@pytest.mark.parametrize("keep,persist,budget", RESIDENCY, ids=["budget0", "partial", "all"])
def test_quantized_pool_path_cpu(keep, persist, budget, fmt, block, nested):
    results, allocated, pages, page = run_distributed(_worker, 1, "cpu", fmt, block, nested, keep, persist, budget,
                                                      timeout=120)[0]
    _check(results, allocated, pages, page, persist)


@pytest.mark.gpu
@pytest.mark.parametrize("fmt,block,nested", FORMATS, ids=["nf4", "nf4-nested", "int8-32"])
@pytest.mark.parametrize("keep,persist,budget", RESIDENCY, ids=["budget0", "partial", "all"])
def test_quantized_pool_path_cuda(keep, persist, budget, fmt, block, nested):
    results, allocated, pages, page = run_distributed(_worker, 1, "cuda", fmt, block, nested, keep, persist, budget,
                                                      timeout=180)[0]
    _check(results, allocated, pages, page, persist)
