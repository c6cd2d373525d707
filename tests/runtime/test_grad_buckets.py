"""Adapter gradients reduced in buckets while backward runs ([Note: gradient buckets] in
python_api/runtime/_grads.py): bit-identical on 2 gloo ranks to one concatenated all-reduce of
the local gradients (the former path, computed here by hand on an unreduced twin model), one
all-reduce per bucket per step, buckets launched before the end of backward; with gradient
accumulation and activation checkpointing (reentrant or not)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.utils.checkpoint import checkpoint

from tests._dist import run_distributed
from tests.runtime.test_runtime import FP32, make_model

pytestmark = [pytest.mark.distributed, pytest.mark.needs_ext]

DIMS = (24, 40, 24, 33, 24, 40)  # 5 frozen layers, 10 adapter matrices of 72-120 floats


def _forward(model, x, mode):
    if mode.startswith("checkpoint"):
        for block in model:
            x = checkpoint(block, x, use_reentrant=mode == "checkpoint-reentrant")
        return x
    return model(x)


def _worker(rank, world_size, mode, cap):
    from elastic_kernels.api import ElasticPolicy, elasticize, runtime_of

    policy = dict(chunk_bytes=24 * FP32 * 8, keep_ratio=0.5, persist_ratio=0.0, grad_bucket_bytes=cap)
    new, ref = make_model(DIMS), make_model(DIMS)
    elasticize(new, ElasticPolicy(**policy))
    elasticize(ref, ElasticPolicy(**policy, all_reduce_grads=False))  # local gradients
    rt, rt_ref = runtime_of(new), runtime_of(ref)
    calls = []
    real = dist.all_reduce

    def counting(tensor, *a, **k):
        calls.append(tensor.numel())
        return real(tensor, *a, **k)

    out = {"buckets": len(rt._buckets), "steps": []}
    micro = 3 if mode == "accumulation" else 1
    for step in range(2):
        for m in (new, ref):
            for p in m.parameters():
                p.grad = None
        early0 = rt._buckets_launched_in_backward
        calls.clear()
        for i in range(micro):
            torch.manual_seed(100 * step + 10 * i + rank)  # different data on each rank
            x = torch.randn(3, DIMS[0], requires_grad=True)
            for m, r in ((new, rt), (ref, rt_ref)):
                dist.all_reduce = counting if m is new else real
                try:
                    with r.no_sync() if i < micro - 1 else torch.enable_grad():
                        _forward(m, x, mode).pow(2).sum().backward()
                finally:
                    dist.all_reduce = real
        grads = [p.grad for p in ref.parameters() if p.requires_grad]
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat)
        flat.div_(world_size)
        got = torch.cat([p.grad.reshape(-1) for p in new.parameters() if p.requires_grad])
        out["steps"].append({"equal": torch.equal(got, flat), "max_diff": (got - flat).abs().max().item(),
                             "reduced": not torch.equal(got, torch.cat([g.reshape(-1) for g in grads])),
                             "calls": len(calls), "early": rt._buckets_launched_in_backward - early0})
    return out


@pytest.mark.parametrize("mode", ["plain", "accumulation", "checkpoint", "checkpoint-reentrant"])
def test_bucketed_gradients_equal_one_concatenated_all_reduce(mode):
    cap = 128 * FP32  # one or two adapter matrices per bucket
    for out in run_distributed(_worker, 2, mode, cap, timeout=120):
        assert out["buckets"] >= 5, out
        for s in out["steps"]:
            assert s["reduced"] and s["equal"], (mode, s)
            assert s["calls"] == out["buckets"], (mode, s)  # one all-reduce per bucket per step
            # Every bucket but the last launched while backward ran (the last is the first
            # layer's adapters: complete only when backward is).
            assert s["early"] >= out["buckets"] - 1, (mode, s)


def test_one_bucket_when_unbounded():
    for out in run_distributed(_worker, 2, "plain", None, timeout=120):
        assert out["buckets"] == 1 and all(s["equal"] and s["calls"] == 1 for s in out["steps"]), out


def test_three_ranks_agree_to_fp32_rounding():
    """On 3 ranks gloo's ring may add the ranks' values in an order that depends on the
    element's offset in its buffer ([Note: gradient buckets]): equal to fp32 rounding of a sum
    of 3 terms of |g| <= ~10 (max_diff is absolute)."""
    for out in run_distributed(_worker, 3, "plain", 128 * FP32, timeout=120):
        for s in out["steps"]:
            assert s["reduced"] and s["max_diff"] <= 1e-5, s
            assert s["calls"] == out["buckets"] and s["early"] >= out["buckets"] - 1, s
