"""The elastic frozen-weight runtime on gloo: parity, exact traffic, budgets, no hang, bad input.

Parity is against an independent single-process reference that computes every frozen linear
with the same chunking (see [Note: chunked compute and bit-exactness] in
python_api/nn/linear.py), so the comparison is bit for bit in fp32: the sharding, the
gathers, the pool, eviction and prefetch must not change a single bit. A second check compares
with plain `F.linear` to fp32 rounding.
"""

from __future__ import annotations

import contextlib
import copy
import itertools
import time

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from tests._dist import run_distributed

pytestmark = [pytest.mark.distributed, pytest.mark.needs_ext]

DIMS = (24, 40, 24, 33)  # frozen layers 24->40, 40->24, 24->33 (rows 40, 24, 33)
RANK_R = 3
FP32 = 4


class Block(nn.Module):
    """A frozen linear with a small trainable low-rank adapter beside it."""

    def __init__(self, d_in, d_out, r=RANK_R):
        super().__init__()
        self.base = nn.Linear(d_in, d_out)
        self.base.requires_grad_(False)
        self.A = nn.Linear(d_in, r, bias=False)
        self.B = nn.Linear(r, d_out, bias=False)

    def forward(self, x):
        return torch.tanh(self.base(x) + self.B(self.A(x)))


def make_model(dims=DIMS, seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(*[Block(a, b) for a, b in zip(dims[:-1], dims[1:])])


class _ChunkedLinearFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, rows_per_chunk):
        ctx.save_for_backward(weight)
        ctx.rows_per_chunk = rows_per_chunk
        if rows_per_chunk is None:  # the whole weight, one GEMM each way ([Note: resident runs])
            return F.linear(x, weight, bias)
        y = x.new_empty(x.shape[0], weight.shape[0])
        for r0 in range(0, weight.shape[0], rows_per_chunk):
            r1 = min(r0 + rows_per_chunk, weight.shape[0])
            y[:, r0:r1] = F.linear(x, weight[r0:r1], bias[r0:r1])
        return y

    @staticmethod
    def backward(ctx, dy):
        (weight,) = ctx.saved_tensors
        dx = None
        if ctx.needs_input_grad[0] and ctx.rows_per_chunk is None:
            dx = dy @ weight
        elif ctx.needs_input_grad[0]:
            dx = dy.new_zeros(dy.shape[0], weight.shape[1])
            for r0 in range(0, weight.shape[0], ctx.rows_per_chunk):
                r1 = min(r0 + ctx.rows_per_chunk, weight.shape[0])
                dx.addmm_(dy[:, r0:r1], weight[r0:r1])
        return dx, None, None, None


class ChunkedLinear(nn.Module):
    """Independent reference: a plain frozen linear computed chunk by chunk, one process
    (`rows_per_chunk` None: the whole weight in one GEMM, as a weight held as a run is)."""

    def __init__(self, linear, rows_per_chunk):
        super().__init__()
        self.weight, self.bias, self.rows_per_chunk = linear.weight, linear.bias, rows_per_chunk

    def forward(self, x):
        return _ChunkedLinearFn.apply(x, self.weight, self.bias, self.rows_per_chunk)


def reference_of(model, chunk_bytes, whole=False):
    """`whole`: every frozen linear in one GEMM (the runtime holds every weight as a run), or
    per layer, a list of such flags."""
    ref = copy.deepcopy(model)
    for block, w in zip(ref, _per_layer(whole, len(ref))):
        rows = max(1, chunk_bytes // (block.base.in_features * FP32))
        block.base = ChunkedLinear(block.base, None if w else rows)
    return ref


def _per_layer(whole, n):
    return list(whole) if isinstance(whole, (list, tuple)) else [whole] * n


def set_whole(ref, whole, chunk_bytes):
    """Switch the reference's chunking (the runtime's runs came or went with a budget change)."""
    for block, w in zip(ref, _per_layer(whole, len(ref))):
        block.base.rows_per_chunk = None if w else max(1, chunk_bytes // (block.base.weight.shape[1] * FP32))


def held_as_runs(dims, chunk_bytes, world_size, keep, persist, budget):
    """Analytic, per frozen layer: whether the runtime holds the weight as a run ([Note:
    resident runs] in python_api/runtime/tensor.py): every chunk PERSISTENT (keep = persist =
    1), and a budget (bytes; None: all) that holds every kept chunk's page (then every
    weight), or else, in order, each weight whose bytes still fit beside those chosen before
    it ("Partial budgets"). Each full chunk's elements must be a multiple of the world size
    (true of every geometry used here)."""
    from elastic_kernels import ChunkLayout
    from elastic_kernels.api.config import PAGE_ALIGN

    lays = []
    for d_in, d_out in zip(dims[:-1], dims[1:]):
        lay = ChunkLayout.for_weight((d_out, d_in), max(1, chunk_bytes // (d_in * FP32)), world_size)
        assert lay.num_chunks == 1 or lay.chunk_numel % world_size == 0, "a geometry that is not a run"
        lays.append((lay, d_in * d_out * FP32))
    if not keep == persist == 1.0:
        return [False] * len(lays)
    page = -(-max(lay.chunk_numel * FP32 for lay, _ in lays) // PAGE_ALIGN) * PAGE_ALIGN
    if budget is None or sum(lay.num_chunks for lay, _ in lays) * page <= budget:
        return [True] * len(lays)
    out, used = [], 0
    for _, nbytes in lays:
        out.append(used + nbytes <= budget)
        used += nbytes if out[-1] else 0
    return out


def adapter_params(model):
    return [p for p in model.parameters() if p.requires_grad]


def layer_chunks(dims, chunk_bytes, world_size, keep, persist):
    """Per frozen layer: (all-gather output bytes of one chunk, {residency class: chunk count})."""
    from elastic_kernels import ChunkLayout
    from elastic_kernels.api import Residency, residency_classes

    out = []
    for d_in, d_out in zip(dims[:-1], dims[1:]):
        lay = ChunkLayout.for_weight((d_out, d_in), max(1, chunk_bytes // (d_in * FP32)), world_size)
        classes = residency_classes(lay.num_chunks, keep, persist)
        out.append((lay.slice_numel * world_size * FP32, {cls: classes.count(cls) for cls in Residency}))
    return out


# ------------------------------------------------------------------------------------ parity

def _parity_worker(rank, world_size, configs, iters):
    from elastic_kernels.api import ElasticPolicy, elasticize, runtime_of, stats

    torch.manual_seed(1234 + rank)
    frozen_total = sum(a * b for a, b in zip(DIMS[:-1], DIMS[1:])) * FP32
    report = []
    for chunk_bytes, keep, persist, budget_frac, group_kind, depth in configs:
        group = None
        if group_kind == "pairs":
            pairs = [dist.new_group([2 * i, 2 * i + 1]) for i in range(world_size // 2)]
            group = pairs[rank // 2]
        model = make_model()
        budget = None if budget_frac is None else int(budget_frac * frozen_total)
        whole = held_as_runs(DIMS, chunk_bytes, dist.get_world_size(group), keep, persist, budget)
        ref = reference_of(model, chunk_bytes, whole)
        policy = ElasticPolicy(
            chunk_bytes=chunk_bytes, keep_ratio=keep, persist_ratio=persist,
            pool_budget_bytes=budget, all_reduce_grads=False, collective_bytes=3 * chunk_bytes // 2,
            prefetch_depth=depth,
        )
        elasticize(model, policy, group=group)
        for it in range(iters):
            x = torch.randn(5, DIMS[0])
            loss = model(x).square().mean()
            loss.backward()
            ref_loss = ref(x).square().mean()
            ref_loss.backward()
            cfg = f"chunk={chunk_bytes} keep={keep} persist={persist} budget={budget_frac} group={group_kind} depth={depth} iter={it}"
            runs = [et.run is not None for et in runtime_of(model).tensors]
            assert runs == whole, f"weights held as runs {runs}, expected {whole} at {cfg}"
            assert torch.equal(loss, ref_loss), f"loss differs ({loss.item()} vs {ref_loss.item()}) at {cfg}"
            for (name, p), q in zip(
                ((n, p) for n, p in model.named_parameters() if p.requires_grad), adapter_params(ref)
            ):
                assert torch.equal(p.grad, q.grad), f"grad of {name} differs at {cfg}"
            with torch.no_grad():
                for p, q in zip(adapter_params(model), adapter_params(ref)):
                    p -= 0.1 * p.grad
                    q -= 0.1 * q.grad
                    p.grad = None
                    q.grad = None
        # Eval forward (no_grad) after training: still bit-identical.
        with torch.no_grad():
            x = torch.randn(4, DIMS[0])
            assert torch.equal(model(x), ref(x)), f"no_grad forward differs at {cfg}"
        report.append(stats(model))
    return report


PARITY_CONFIGS = [
    # chunk_bytes: 8 rows of 24 floats divide 40 and 24 rows but not 33; 7 rows divide none
    (cb, keep, persist, budget, "world", 1)
    for cb, (keep, persist), budget in itertools.product(
        (24 * FP32 * 8, 24 * FP32 * 7),
        ((0.0, 0.0), (0.5, 0.0), (0.5, 0.5), (1.0, 0.0), (1.0, 0.5), (1.0, 1.0)),
        (0.0, 0.5, None),
    )
] + [
    # prefetch depth: none, and two layers ahead (whose gathers share one collective)
    (24 * FP32 * 7, 0.5, 0.0, 0.5, "world", 0),
    (24 * FP32 * 7, 1.0, 0.5, 0.0, "world", 2),
]


@pytest.mark.parametrize("world_size", [2, 4])
def test_parity_bit_identical(world_size):
    configs = PARITY_CONFIGS
    if world_size == 4:
        configs = configs[::3] + [(24 * FP32 * 5, 1.0, 0.5, 0.5, "pairs", 1)]
    reports = run_distributed(_parity_worker, world_size, configs, 3, timeout=300)
    # Every rank saw the same traffic (symmetric residency).
    assert all(r == reports[0] for r in reports[1:])


def _plain_linear_worker(rank, world_size):
    from elastic_kernels.api import ElasticPolicy, elasticize

    model = make_model()
    plain = copy.deepcopy(model)
    elasticize(model, ElasticPolicy(chunk_bytes=24 * FP32 * 7, keep_ratio=0.5, persist_ratio=0.0))
    x = torch.randn(6, DIMS[0])
    model(x).sum().backward()
    plain(x).sum().backward()
    # fp32: chunked vs whole GEMMs differ only in summation order; K <= 40 terms of O(1)
    # magnitude give |error| <= ~40 * 2^-24 * |terms|, so 1e-5 absolute is a tight bound.
    y1, y2 = model(x), plain(x)
    torch.testing.assert_close(y1, y2, rtol=0, atol=1e-5)
    for p, q in zip(adapter_params(model), adapter_params(plain)):
        # Gradients were all-reduced (averaged) across ranks; every rank had the same x.
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6)
    return True


def test_matches_plain_linear_and_averages_grads():
    assert run_distributed(_plain_linear_worker, 2, timeout=120) == [True, True]


# ------------------------------------------------------------------------------- exact traffic

@contextlib.contextmanager
def counting_all_gathers():
    """A list that receives, per all-gather call the runtime makes, the bytes this rank receives
    ((world - 1) x its send bytes), counted at the collective itself, independently of the
    runtime's own stats."""
    from elastic_kernels.api.distributed.collectives import ALL_GATHER_NAME

    received = []
    real = getattr(dist, ALL_GATHER_NAME)

    def counting(output, inp, group=None, async_op=False):
        received.append((dist.get_world_size(group) - 1) * inp.numel() * inp.element_size())
        return real(output, inp, group=group, async_op=async_op)

    setattr(dist, ALL_GATHER_NAME, counting)
    try:
        yield received
    finally:
        setattr(dist, ALL_GATHER_NAME, real)


def _traffic_worker(rank, world_size, chunk_bytes, keep, persist, input_grad, iters):
    from elastic_kernels.api import ElasticPolicy, elasticize, reset_stats, stats

    with counting_all_gathers() as received:
        model = make_model()
        elasticize(model, ElasticPolicy(chunk_bytes=chunk_bytes, keep_ratio=keep, persist_ratio=persist))
        per_iter, stat_bytes, peaks = [], [], []
        for _ in range(iters):
            received.clear()
            reset_stats(model)
            x = torch.randn(3, DIMS[0], requires_grad=input_grad)
            model(x).sum().backward()
            per_iter.append(sum(received))
            stat_bytes.append(stats(model)["allgather_bytes"])
            peaks.append(stats(model)["pool_peak_bytes"])
        return per_iter, stat_bytes, peaks


@pytest.mark.parametrize(
    "world_size,keep,persist,input_grad",
    [(2, 0.0, 0.0, True), (2, 0.0, 0.0, False), (2, 0.5, 0.0, True), (2, 1.0, 0.5, False), (2, 1.0, 1.0, True),
     (2, 0.5, 0.5, True), (4, 0.0, 0.0, True), (4, 1.0, 0.5, True)],
)
def test_exact_traffic(world_size, keep, persist, input_grad):
    from elastic_kernels.api import Residency

    chunk_bytes, iters = 24 * FP32 * 8, 3
    results = run_distributed(_traffic_worker, world_size, chunk_bytes, keep, persist, input_grad, iters, timeout=120)
    T, P, K = Residency.TRANSIENT, Residency.PEAK, Residency.PERSISTENT
    layers = layer_chunks(DIMS, chunk_bytes, world_size, keep, persist)
    frac = (world_size - 1) / world_size
    needs_dgrad = [input_grad] + [True] * (len(layers) - 1)
    # Forward: every non-persistent chunk (every chunk in the first iteration). Backward: the
    # TRANSIENT chunks of the layers that need dgrad (a layer whose input needs no gradient has
    # no backward; its PEAK chunks were dropped right after forward).
    fwd_first = sum(b * sum(n.values()) for b, n in layers)
    fwd_steady = sum(b * (n[T] + n[P]) for b, n in layers)
    bwd = sum(b * n[T] for (b, n), nd in zip(layers, needs_dgrad) if nd)
    expected = [int((fwd_first + bwd) * frac)] + [int((fwd_steady + bwd) * frac)] * (iters - 1)
    # Memory: pages held at the peak are the kept chunks (PEAK/PERSISTENT) of every layer plus
    # the working set: the transient chunks of the running layer and of the prefetched one.
    page = 1024  # chunk_bytes = 768, rounded up to a multiple of 512
    transient = sorted((n[T] for _, n in layers), reverse=True)
    peak_bound = (sum(n[P] + n[K] for _, n in layers) + sum(transient[:2])) * page
    for per_iter, stat_bytes, peaks in results:
        assert per_iter == expected, f"wire bytes per iteration {per_iter}, analytic {expected}"
        assert stat_bytes == expected, f"stats allgather_bytes {stat_bytes}, analytic {expected}"
        assert 0 < max(peaks) <= peak_bound, f"pool peak {peaks} above the analytic bound {peak_bound}"
    if keep == persist == 0.0 and input_grad:
        # FSDP2 with reshard_after_forward=True: twice the frozen bytes x (W-1)/W per iteration
        # (8 rows x 24/40 cols split evenly over 2 ranks: no padding in this geometry except 33).
        assert expected[-1] == int(2 * fwd_first * frac)
    if persist == 1.0:
        assert expected[1:] == [0] * (iters - 1)


# ------------------------------------------------------------------------------------- no hang

def _failing_worker(rank, world_size, where):
    from elastic_kernels.api import ElasticPolicy, elasticize

    model = make_model()
    elasticize(model, ElasticPolicy(chunk_bytes=24 * FP32 * 8, keep_ratio=0.0, persist_ratio=0.0, collective_timeout_s=10))

    def boom(*_):
        raise RuntimeError(f"injected failure on rank {rank} in {where}")

    for it in range(3):
        x = torch.randn(3, DIMS[0], requires_grad=True)
        if it == 1 and rank == 1:
            if where == "forward":
                model[1].register_forward_pre_hook(boom)
            else:
                model[1].base.register_full_backward_pre_hook(boom)
        model(x).sum().backward()
    return "finished"


@pytest.mark.parametrize("where", ["forward", "backward"])
def test_failure_on_one_rank_fails_every_rank(where):
    start = time.monotonic()
    with pytest.raises(AssertionError) as info:
        run_distributed(_failing_worker, 2, where, timeout=90)
    msg = str(info.value)
    assert "2 of 2 ranks failed" in msg, msg
    assert "injected failure on rank 1" in msg
    assert "were still running" not in msg
    assert time.monotonic() - start < 80


# ------------------------------------------------------------------------------------ bad input

def test_policy_rejects_bad_ratios_and_sizes():
    from elastic_kernels.api import ElasticPolicy

    with pytest.raises(ValueError, match="keep_ratio must be in"):
        ElasticPolicy(keep_ratio=1.5)
    with pytest.raises(ValueError, match="persist_ratio must be in"):
        ElasticPolicy(persist_ratio=-0.1)
    with pytest.raises(ValueError, match="keep_ratio .* must be >= persist_ratio"):
        ElasticPolicy(keep_ratio=0.2, persist_ratio=0.5)
    with pytest.raises(ValueError, match="larger than the pool page"):
        ElasticPolicy(chunk_bytes=4096, page_bytes=1024)
    with pytest.raises(ValueError, match="chunk_bytes must be a positive int"):
        ElasticPolicy(chunk_bytes=0)


def _bad_input_worker(rank, world_size):
    from elastic_kernels.api import ElasticPolicy, elasticize

    errors = {}
    # Chunk smaller than one row.
    model = make_model()
    try:
        elasticize(model, ElasticPolicy(chunk_bytes=16))
    except ValueError as e:
        errors["row"] = str(e)
    assert isinstance(model[0].base, nn.Linear), "a failed elasticize must leave the model untouched"
    # A trainable weight handed over as frozen.
    model = make_model()
    try:
        elasticize(model, ElasticPolicy(), should_wrap=lambda n, m: isinstance(m, nn.Linear) and n.endswith("A"))
    except ValueError as e:
        errors["trainable"] = str(e)
    # Shapes that differ across ranks.
    model = make_model(dims=(24, 40 + rank, 24))
    try:
        elasticize(model, ElasticPolicy())
    except ValueError as e:
        errors["shape"] = str(e)
    # Dtypes that differ across ranks.
    model = make_model()
    if rank == 1:
        model[1].base.to(torch.float64)
    try:
        elasticize(model, ElasticPolicy())
    except ValueError as e:
        errors["dtype"] = str(e)
    # Input dtype differing from the layer's.
    model = elasticize(make_model(), ElasticPolicy())
    try:
        model(torch.randn(2, DIMS[0], dtype=torch.float64))
    except TypeError as e:
        errors["input"] = str(e)
    return errors


def test_bad_input_errors_on_every_rank():
    for errors in run_distributed(_bad_input_worker, 2, timeout=120):
        assert "smaller than one row of 0.base" in errors["row"]
        assert "0.A requires grad" in errors["trainable"]
        assert "ranks do not agree" in errors["shape"] and "(0.base) shape" in errors["shape"]
        assert "ranks do not agree" in errors["dtype"] and "float64" in errors["dtype"]
        assert "input dtype torch.float64 differs" in errors["input"]


# ---------------------------------------------------------------------------- budget and world 1

def _budget_worker(rank, world_size):
    from elastic_kernels.api import ElasticPolicy, elasticize, runtime_of, set_pool_budget, stats

    chunk_bytes = 24 * FP32 * 8
    model = make_model()
    ref = reference_of(model, chunk_bytes, whole=True)
    elasticize(model, ElasticPolicy(chunk_bytes=chunk_bytes, keep_ratio=1.0, persist_ratio=1.0))
    rt = runtime_of(model)
    seen = []
    for it in range(6):
        if it == 2:
            # Shrink mid-training: the runs are demoted at once, persistent chunks are evicted.
            set_pool_budget(model, 0)
            assert not any(et.run is not None for et in rt.tensors) and rt.run_bytes() == 0
            set_whole(ref, False, chunk_bytes)
        if it == 4:
            set_pool_budget(model, None)  # grow back: runs again from the next forward
            set_whole(ref, True, chunk_bytes)
        x = torch.randn(3, DIMS[0])
        before = stats(model)["allgather_bytes"]
        loss = model(x).sum()
        loss.backward()
        ref_loss = ref(x).sum()
        ref_loss.backward()
        assert torch.equal(loss, ref_loss)
        for p, q in zip(adapter_params(model), adapter_params(ref)):
            torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=0)
            p.grad = q.grad = None
        seen.append(stats(model)["allgather_bytes"] - before)
        assert rt.pool.stats()["in_use_bytes"] <= rt.pool.stats()["budget_bytes"]
        assert rt.pool.drain_evicted() == [], "evicted keys pile up in the pool between iterations"
    return seen


def test_budget_changes_at_run_time():
    seen = run_distributed(_budget_worker, 2, timeout=120)[0]
    assert seen[0] > 0 and seen[1] == 0  # ample budget, persist=1: nothing after warm-up
    assert seen[2] > 0 and seen[3] > 0  # budget 0: gathered again every iteration
    assert seen[4] > 0 and seen[5] == 0  # regrown: refilled once, then nothing


def _world_one_worker(rank, world_size):
    from elastic_kernels.api import ElasticPolicy, elasticize, stats

    model = make_model()
    ref = reference_of(model, 24 * FP32 * 7)
    elasticize(model, ElasticPolicy(chunk_bytes=24 * FP32 * 7, keep_ratio=0.0, persist_ratio=0.0))
    x = torch.randn(3, DIMS[0])
    loss, ref_loss = model(x).sum(), ref(x).sum()
    loss.backward()
    ref_loss.backward()
    assert torch.equal(loss, ref_loss)
    for p, q in zip(adapter_params(model), adapter_params(ref)):
        assert torch.equal(p.grad, q.grad)
    s = stats(model)
    assert s["allgather_calls"] == 0 and s["allgather_bytes"] == 0 and s["pool_misses"] == 0
    return True


def test_world_size_one_needs_no_communication():
    assert run_distributed(_world_one_worker, 1, timeout=60) == [True]


def _recover_worker(rank, world_size):
    from elastic_kernels.api import ElasticPolicy, elasticize

    model = make_model()
    elasticize(model, ElasticPolicy(chunk_bytes=24 * FP32 * 8, keep_ratio=0.5, persist_ratio=0.0))
    fail = {"on": True}

    def boom(*_):
        if fail["on"]:
            raise RuntimeError("injected backward failure")

    model[1].base.register_full_backward_pre_hook(boom)
    x = torch.randn(3, DIMS[0], requires_grad=True)
    try:
        model(x).sum().backward()
        raise AssertionError("the injected failure did not propagate")
    except RuntimeError as e:
        assert "injected backward failure" in str(e)
    for p in adapter_params(model):
        p.grad = None
    fail["on"] = False
    torch.manual_seed(50 + rank)  # different data per rank: averaged grads differ from local ones
    model(torch.randn(3, DIMS[0], requires_grad=True)).sum().backward()
    grads = torch.cat([p.grad.reshape(-1) for p in adapter_params(model)])
    every = [torch.empty_like(grads) for _ in range(world_size)]
    dist.all_gather(every, grads)
    return [torch.equal(every[0], g) for g in every]


def test_gradients_still_averaged_after_a_failed_backward():
    for same in run_distributed(_recover_worker, 2, timeout=120):
        assert all(same), "adapter gradients differ across ranks: the all-reduce did not run"
