"""ShardedOptimizer (ZeRO stage 1 for the replicated adapters, [Note: sharded optimizer state]
in python_api/distributed/zero.py) against the replicated AdamW it replaces: the same bits
of every parameter and of the whole state after several steps and learning rates, 1/W of the
state per rank, state dicts that move between the two and across world sizes."""

from __future__ import annotations

import copy

import pytest
import torch

from tests._dist import run_distributed

pytestmark = [pytest.mark.distributed]

SHAPES = [(8, 24), (40, 8), (33,), (8, 40), (24, 8), (7, 3)]


def _params(shapes, dtype=torch.float32):
    g = torch.Generator().manual_seed(0)
    return [torch.nn.Parameter(torch.randn(s, generator=g).to(dtype)) for s in shapes]


def _grads(params, step):
    g = torch.Generator().manual_seed(100 + step)  # the same on every rank: averaged gradients
    for p in params:
        p.grad = torch.randn(p.shape, generator=g).to(p.dtype)


def _adamw(ps):
    return torch.optim.AdamW(ps, lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1)


def _worker(rank, world_size, shapes):
    from elastic_kernels.api.distributed.zero import ShardedOptimizer

    ref_params = _params(shapes)
    ref = _adamw(ref_params)
    params = _params(shapes)
    opt = ShardedOptimizer(params, _adamw)
    for step in range(4):
        for o in (ref, opt):
            for group in o.param_groups:
                group["lr"] = 1e-2 / (step + 1)
        _grads(ref_params, step)
        _grads(params, step)
        ref.step()
        opt.step()
        ref.zero_grad(set_to_none=True)
        opt.zero_grad(set_to_none=True)
        for p, q in zip(params, ref_params):
            assert torch.equal(p, q), f"step {step}: a parameter differs from the replicated AdamW's"
    full, want = opt.state_dict(), ref.state_dict()
    assert full["param_groups"] == want["param_groups"]
    assert full["state"].keys() == want["state"].keys()
    for i, entry in want["state"].items():
        for k, v in entry.items():
            assert torch.equal(full["state"][i][k], v), (i, k)
    # The moments this rank holds: its share only.
    owned = sum(p.numel() for p in opt.owned) * 4 * 2
    moments = opt.state_bytes() - sum(4 for _ in opt.owned)  # less the fp32 step counters
    assert moments == owned
    # The state dict moves: into a fresh sharded optimizer and into a plain AdamW.
    again_params, plain_params = _params(shapes), _params(shapes)
    for dst, src in ((again_params, params), (plain_params, params)):
        with torch.no_grad():
            for d, s in zip(dst, src):
                d.copy_(s)
    again = ShardedOptimizer(again_params, _adamw)
    again.load_state_dict(copy.deepcopy(full))  # (a state dict holds the live tensors, as torch's)
    plain = _adamw(plain_params)
    plain.load_state_dict(copy.deepcopy(full))
    for params_, o in ((again_params, again), (plain_params, plain), (params, opt)):
        _grads(params_, 9)
        o.step()
    for a, b, c in zip(again_params, plain_params, params):
        assert torch.equal(a, c), ("sharded", (a - c).abs().max())
        assert torch.equal(b, c), ("plain", (b - c).abs().max())
    return [len(opt.owned), opt.state_bytes()]


@pytest.mark.parametrize("world_size,shapes", [(2, SHAPES), (4, SHAPES), (4, SHAPES[:3])])
def test_sharded_optimizer_is_the_replicated_adamw(world_size, shapes):
    out = run_distributed(_worker, world_size, shapes, timeout=120)
    owned = [o for o, _ in out]
    assert sum(owned) == len(shapes)
    if len(shapes) >= world_size:
        assert all(o > 0 for o in owned)
    else:
        assert 0 in owned  # a rank that owns nothing still steps, shares and saves


def test_partition_is_contiguous_and_balanced():
    from elastic_kernels.api.distributed.zero import partition

    numels = [100] * 8 + [10] * 4
    for w in (1, 2, 3, 4, 12, 16):
        bounds = partition(numels, w)
        assert bounds[0][0] == 0 and bounds[-1][1] == len(numels)
        assert all(a[1] == b[0] for a, b in zip(bounds, bounds[1:]))
    loads = [sum(numels[b:e]) for b, e in partition(numels, 4)]
    assert max(loads) - min(loads) <= 100, loads


def test_bad_input_is_refused():
    from elastic_kernels.api.distributed.zero import ShardedOptimizer

    p = torch.nn.Parameter(torch.zeros(3))
    with pytest.raises(ValueError, match="no parameters"):
        ShardedOptimizer([], _adamw)
    with pytest.raises(ValueError, match="given twice"):
        ShardedOptimizer([p, p], _adamw)
    with pytest.raises(ValueError, match="one parameter group"):
        ShardedOptimizer([p], lambda ps: torch.optim.AdamW([{"params": ps}, {"params": [torch.nn.Parameter(torch.zeros(1))]}]))
    opt = ShardedOptimizer([p], _adamw)
    with pytest.raises(ValueError, match="closure"):
        opt.step(lambda: 0.0)
    with pytest.raises(ValueError, match="one parameter group of 1 parameters"):
        opt.load_state_dict({"state": {}, "param_groups": [{"params": [0, 1]}]})


def test_one_process_without_a_process_group_is_the_plain_adamw():
    """The public class (elastic_kernels.api) in a script that never starts a process group."""
    import torch.distributed as dist

    from elastic_kernels.api import ShardedOptimizer

    assert not dist.is_initialized()
    params, ref_params = _params(SHAPES), _params(SHAPES)
    opt, ref = ShardedOptimizer(params, _adamw), _adamw(ref_params)
    assert opt.owned == params
    # torch's schedulers take it (a torch Optimizer) and set the inner optimizer's rate.
    scheds = [torch.optim.lr_scheduler.LambdaLR(o, lambda k: 1.0 / (k + 1)) for o in (opt, ref)]
    for step in range(3):
        _grads(params, step)
        _grads(ref_params, step)
        opt.step()
        ref.step()
        for s in scheds:
            s.step()
    assert opt.inner.param_groups[0]["lr"] == ref.param_groups[0]["lr"] == 1e-2 / 4
    assert all(torch.equal(p, q) for p, q in zip(params, ref_params))
    with pytest.raises(ValueError, match="partitioned at construction"):
        opt.add_param_group({"params": [torch.nn.Parameter(torch.zeros(2))]})
    assert opt.state_dict()["state"].keys() == ref.state_dict()["state"].keys()


def _mismatch_worker(rank, world_size, case):
    from elastic_kernels.api.distributed.zero import ShardedOptimizer

    shapes = list(SHAPES)
    if rank == 1:
        shapes = {"shape": SHAPES[:2] + [(34,)] + SHAPES[3:], "count": SHAPES[:-1], "none": []}[case]
    try:
        ShardedOptimizer(_params(shapes), _adamw)
    except ValueError as exc:
        return str(exc)
    return None


@pytest.mark.parametrize("case,message", [
    ("shape", r"parameter 2 is \(34,\) torch.float32 on rank 1, \(33,\) torch.float32 on rank 0"),
    ("count", r"5 parameters on rank 1, 6 on rank 0"),
    ("none", r"no parameters \(on rank 1\)"),
])
def test_ranks_that_pass_different_parameters_fail_together(case, message):
    """A rank's different parameter list fails every rank at construction, naming it (not a
    hang or a size error in the first step's all-gather)."""
    import re

    for err in run_distributed(_mismatch_worker, 2, case, timeout=120):
        assert err is not None and re.search(message, err), err
