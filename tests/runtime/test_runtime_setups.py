"""The runtime in the setups real training runs use (issue: real training setups; reliability).

One process without a process group, activation checkpointing (recompute inside backward),
per-unit coalesced gathers, failure paths (a failed gather, an error while starting a use,
no_grad), a hung peer costing one timeout, ranks that diverge or disagree, pages sized from
real chunks, and policy values that must be refused. Parity is bit for bit against the
independent chunked reference of tests/runtime/test_runtime.py, or against the same model run without
the feature under test (same ranks, same data).
"""

from __future__ import annotations

import math
import os
import time

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.utils.checkpoint as cp

from tests._dist import run_distributed
from tests.runtime.test_runtime import DIMS, FP32, Block, adapter_params, make_model, reference_of

pytestmark = [pytest.mark.needs_ext]


# ------------------------------------------------------------------- one process, no group


def test_single_process_without_process_group():
    from elastic_kernels.api import ElasticPolicy, elasticize, runtime_of, stats

    assert not dist.is_initialized()
    chunk = 24 * FP32 * 7
    model = make_model()
    ref = reference_of(model, chunk)
    elasticize(model, ElasticPolicy(chunk_bytes=chunk, keep_ratio=0.0, persist_ratio=0.0))
    assert runtime_of(model).world_size == 1
    x = torch.randn(3, DIMS[0], requires_grad=True)
    loss, ref_loss = model(x).sum(), ref(x).sum()
    loss.backward()
    ref_loss.backward()
    assert torch.equal(loss, ref_loss)
    for p, q in zip(adapter_params(model), adapter_params(ref)):
        assert torch.equal(p.grad, q.grad)
    assert stats(model)["allgather_calls"] == 0


# ------------------------------------------------------------------- activation checkpointing


class CkptModel(nn.Module):
    """make_model's blocks, each run through torch.utils.checkpoint when `mode` says so."""

    def __init__(self, blocks: nn.Sequential, mode: str | None):
        super().__init__()
        self.blocks, self.mode = blocks, mode

    def forward(self, x):
        for b in self.blocks:
            if self.mode is None:
                x = b(x)
            else:
                x = cp.checkpoint(b, x, use_reentrant=self.mode == "reentrant")
        return x


def _count_all_reduce():
    calls = []
    real = dist.all_reduce

    def counting(t, *a, **k):
        calls.append(t.numel())
        return real(t, *a, **k)

    dist.all_reduce = counting
    return calls, lambda: setattr(dist, "all_reduce", real)


def _ckpt_worker(rank, world_size, mode, keep, persist):
    from elastic_kernels.api import ElasticPolicy, elasticize, reset_stats, stats

    policy = ElasticPolicy(chunk_bytes=24 * FP32 * 8, keep_ratio=keep, persist_ratio=persist)
    plain = CkptModel(elasticize(make_model(), policy), None)
    ckpt = CkptModel(elasticize(make_model(), policy), mode)
    calls, restore = _count_all_reduce()
    out = []
    try:
        for it in range(3):
            torch.manual_seed(100 * it + rank)
            x = torch.randn(5, DIMS[0], requires_grad=True)
            row = {}
            for name, m in (("plain", plain), ("ckpt", ckpt)):
                reset_stats(m.blocks)
                calls.clear()
                xi = x.detach().clone().requires_grad_(True)
                m(xi).square().sum().backward()
                row[name] = (
                    [p.grad.clone() for p in adapter_params(m)], xi.grad.clone(), len(calls), dict(stats(m.blocks)),
                )
                for p in adapter_params(m):
                    p.grad = None
            out.append(row)
    finally:
        restore()
    return out


@pytest.mark.distributed
@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("mode", ["non-reentrant", "reentrant"])
def test_checkpointing_is_bit_identical_with_one_all_reduce(world_size, mode):
    for rows in run_distributed(_ckpt_worker, world_size, mode, 1.0, 0.0, timeout=240):
        for it, row in enumerate(rows):
            (g0, dx0, n0, s0), (g1, dx1, n1, s1) = row["plain"], row["ckpt"]
            assert all(torch.equal(a, b) for a, b in zip(g0, g1)), f"iteration {it}: adapter grads differ"
            assert torch.equal(dx0, dx1)
            assert n0 == 1 and n1 == 1, f"all-reduces per step: plain {n0}, checkpointed {n1} (one expected)"
            if mode == "non-reentrant":
                # The forward keeps PEAK chunks (grad enabled); the recompute and the backward
                # find them resident: exactly the plain run's traffic and misses.
                assert s1["allgather_bytes"] == s0["allgather_bytes"], (it, s0, s1)
                assert s1["pool_misses"] == s0["pool_misses"], (it, s0, s1)
            else:
                # Reentrant: the first forward runs under no_grad and keeps nothing for a
                # backward it cannot know of; the recompute gathers the non-persistent chunks
                # again, once: one forward's worth more.
                assert s1["allgather_bytes"] > s0["allgather_bytes"]
                assert s1["allgather_bytes"] <= 2 * s0["allgather_bytes"]


def _hf_ckpt_worker(rank, world_size, reentrant):
    from transformers import LlamaConfig, LlamaForCausalLM

    from elastic_kernels.api import ElasticPolicy, LoRAConfig, convert_to_elastic, stats

    def build():
        torch.manual_seed(0)
        cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)
        m = LlamaForCausalLM(cfg)
        return convert_to_elastic(m, LoRAConfig(r=4, alpha=8, target_modules="all-linear"),
                                  ElasticPolicy(chunk_bytes=32 * 4 * 4, keep_ratio=1.0, persist_ratio=0.0))

    plain, ckpt = build(), build()
    ckpt.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    ckpt.enable_input_require_grads()
    plain.enable_input_require_grads()
    ckpt.train(), plain.train()
    calls, restore = _count_all_reduce()
    res = []
    try:
        for it in range(2):
            torch.manual_seed(10 * it + rank)
            ids = torch.randint(0, 64, (2, 9))
            row = []
            for m in (plain, ckpt):
                calls.clear()
                before = stats(m)["allgather_bytes"]
                m(input_ids=ids, labels=ids).loss.backward()
                grads = [p.grad.clone() for p in m.parameters() if p.requires_grad]
                row.append((grads, len(calls), stats(m)["allgather_bytes"] - before))
                for p in m.parameters():
                    p.grad = None
            res.append(row)
    finally:
        restore()
    return res


@pytest.mark.distributed
@pytest.mark.parametrize("reentrant", [False, True])
def test_hf_gradient_checkpointing(reentrant):
    for rows in run_distributed(_hf_ckpt_worker, 2, reentrant, timeout=300):
        for (g0, n0, b0), (g1, n1, b1) in rows:
            assert len(g0) == len(g1) > 0
            assert all(torch.equal(a, b) for a, b in zip(g0, g1))
            assert n0 == n1 == 1, (n0, n1)
            if not reentrant:
                assert b0 == b1


# ------------------------------------------------------------------------------ units


class Pair(nn.Module):
    """Two frozen linears used one after the other (a 'decoder layer' unit)."""

    def __init__(self, d):
        super().__init__()
        self.up, self.down = Block(d, d + 8), Block(d + 8, d)

    def forward(self, x):
        return self.down(self.up(x))


def _units_worker(rank, world_size, unit_modules):
    from elastic_kernels.api import ElasticPolicy, elasticize, reset_stats, stats

    torch.manual_seed(0)
    model = nn.Sequential(Pair(24), Pair(24), Pair(24))
    elasticize(model, ElasticPolicy(chunk_bytes=32 * FP32 * 8, keep_ratio=0.0, persist_ratio=0.0),
               unit_modules=unit_modules)
    out = []
    for it in range(3):
        reset_stats(model)
        torch.manual_seed(it + 7)
        x = torch.randn(4, 24, requires_grad=True)
        model(x).sum().backward()
        out.append((stats(model)["allgather_calls"], stats(model)["allgather_bytes"],
                    [p.grad.clone() for p in adapter_params(model)], x.grad.clone()))
        for p in adapter_params(model):
            p.grad = None
    return out


@pytest.mark.distributed
def test_units_coalesce_gathers_per_layer():
    per_weight = run_distributed(_units_worker, 2, False, timeout=180)[0]
    per_unit = run_distributed(_units_worker, 2, [Pair], timeout=180)[0]
    for it, ((c0, b0, g0, x0), (c1, b1, g1, x1)) in enumerate(zip(per_weight, per_unit)):
        assert b0 == b1, "grouping must not change the bytes gathered"
        assert all(torch.equal(a, b) for a, b in zip(g0, g1)) and torch.equal(x0, x1)
        if it == 0:
            assert c1 == c0  # the order is learned in the first iteration
        else:
            # 3 units x (forward + backward), one collective each, against 6 weights x 2.
            assert (c0, c1) == (12, 6), (c0, c1)


# ------------------------------------------------------------------------------ failure paths


class _FailingWork:
    def wait(self, *_a, **_k):
        raise RuntimeError("injected all-gather failure")


def _retry_worker(rank, world_size):
    import elastic_kernels.api.distributed.collectives as coll
    from elastic_kernels.api import ElasticPolicy, elasticize, runtime_of

    chunk = 24 * FP32 * 8
    model = make_model()
    ref = reference_of(model, chunk, whole=True)  # budget all, all PERSISTENT: runs, one GEMM each
    elasticize(model, ElasticPolicy(chunk_bytes=chunk, keep_ratio=1.0, persist_ratio=1.0, collective_timeout_s=30))
    rt = runtime_of(model)
    x = torch.randn(3, DIMS[0])
    real = coll.all_gather_into
    coll.all_gather_into = lambda out, send, group, async_op: _FailingWork()
    try:
        with torch.no_grad():
            model(x)
        raise AssertionError("the injected failure did not propagate")
    except RuntimeError as e:
        assert "injected all-gather failure" in str(e)
    finally:
        coll.all_gather_into = real
    assert all(rt.pool.pin_count(k) == 0 for k in rt.pool.keys()), "a failed use left pages pinned"
    with torch.no_grad():
        y, y_ref = model(x), ref(x)
    return torch.equal(y, y_ref), float((y - y_ref).abs().max())


@pytest.mark.distributed
def test_retry_after_a_failed_gather_computes_on_real_data():
    for same, err in run_distributed(_retry_worker, 2, timeout=120):
        assert same, f"the retry computed on pages that never received data (max error {err})"


def _start_error_worker(rank, world_size):
    import elastic_kernels.api.distributed.collectives as coll
    from elastic_kernels.api import ElasticPolicy, elasticize, runtime_of

    model = make_model()
    elasticize(model, ElasticPolicy(chunk_bytes=24 * FP32 * 8, keep_ratio=1.0, persist_ratio=1.0))
    rt = runtime_of(model)
    real = coll.GatherWork.__init__

    def boom(self, *a, **k):
        raise RuntimeError("injected error while issuing a gather")

    coll.GatherWork.__init__ = boom
    try:
        model(torch.randn(3, DIMS[0]))
        raise AssertionError("the injected failure did not propagate")
    except RuntimeError as e:
        assert "injected error while issuing" in str(e)
    finally:
        coll.GatherWork.__init__ = real
    pinned = [k for k in rt.pool.keys() if rt.pool.pin_count(k) > 0]
    return pinned, len(rt.pool.keys())


@pytest.mark.distributed
def test_error_while_starting_a_use_leaves_nothing_pinned():
    for pinned, resident in run_distributed(_start_error_worker, 2, timeout=120):
        assert pinned == [] and resident == 0, (pinned, resident)


def _no_grad_worker(rank, world_size):
    from elastic_kernels.api import ElasticPolicy, elasticize, runtime_of

    model = make_model()
    elasticize(model, ElasticPolicy(chunk_bytes=24 * FP32 * 8, keep_ratio=1.0, persist_ratio=0.0))
    rt = runtime_of(model)
    with torch.no_grad():
        model(torch.randn(3, DIMS[0], requires_grad=True))
    rt._finish_phase()
    return len(rt.pool.keys())


@pytest.mark.distributed
def test_no_grad_forward_keeps_no_peak_chunks():
    assert run_distributed(_no_grad_worker, 2, timeout=120) == [0, 0]


def _hung_peer_worker(rank, world_size, timeout_s, failed):
    from elastic_kernels.api import ElasticPolicy, elasticize

    model = make_model()
    # 8 chunks per weight: before the fix each chunk waited the full timeout again.
    elasticize(model, ElasticPolicy(chunk_bytes=24 * FP32 * 5, keep_ratio=0.0, persist_ratio=0.0,
                                    collective_timeout_s=timeout_s, prefetch_depth=0))
    model(torch.randn(3, DIMS[0])).sum()
    dist.barrier()
    if rank == 1:
        # A hung peer: never joins the next gather, for 4 timeouts or until rank 0 has failed
        # (it writes the file `failed`): the rest of the wait proves nothing.
        until = time.monotonic() + 4 * timeout_s
        while time.monotonic() < until and not os.path.exists(failed):
            time.sleep(0.05)
        return None
    start = time.monotonic()
    try:
        model(torch.randn(3, DIMS[0]))
    except RuntimeError as e:
        elapsed = time.monotonic() - start
        with open(failed, "w") as f:
            f.write(str(elapsed))
        return elapsed, str(e)
    raise AssertionError("rank 0 did not fail while its peer hung")


@pytest.mark.distributed
def test_hung_peer_costs_one_timeout(tmp_path):
    timeout_s = 3.0
    elapsed, msg = run_distributed(_hung_peer_worker, 2, timeout_s, str(tmp_path / "rank0_failed"), timeout=120)[0]
    assert "timed out" in msg or "failed" in msg
    assert elapsed < 2 * timeout_s, f"rank 0 took {elapsed:.1f} s to fail with a {timeout_s} s timeout"


def _diverge_worker(rank, world_size):
    from elastic_kernels.api import ElasticPolicy, elasticize

    model = make_model(dims=(24, 24, 24))  # two frozen layers of one shape: equal-sized gathers
    elasticize(model, ElasticPolicy(chunk_bytes=24 * FP32 * 8, keep_ratio=0.0, persist_ratio=0.0,
                                    collective_timeout_s=30, prefetch_depth=0))
    x = torch.randn(3, 24)
    model(x)
    try:
        with torch.no_grad():
            model[rank](x)  # rank 0 evaluates layer 0, rank 1 layer 1: a broken symmetry
    except RuntimeError as e:
        return str(e)
    return "no error"


@pytest.mark.distributed
def test_diverged_ranks_fail_with_the_rule():
    for msg in run_distributed(_diverge_worker, 2, timeout=120):
        assert "ranks diverged" in msg and "every rank must run the same forward and backward passes" in msg, msg


def _diverge_sizes_worker(rank, world_size, units):
    from elastic_kernels.api import ElasticPolicy, elasticize

    torch.manual_seed(0)
    model = nn.Sequential(Pair(24), Pair(24))
    elasticize(model, ElasticPolicy(chunk_bytes=32 * FP32 * 8, keep_ratio=0.0, persist_ratio=0.0,
                                    collective_timeout_s=30), unit_modules=[Pair] if units else False)
    for _ in range(2):
        model(torch.randn(3, 24, requires_grad=True)).sum().backward()
    start = time.monotonic()
    try:
        if rank == 0:
            with torch.no_grad():
                model(torch.randn(3, 24))  # evaluation on rank 0 only
        model(torch.randn(3, 24, requires_grad=True)).sum().backward()
    except RuntimeError as e:
        return str(e), time.monotonic() - start
    return "no error", time.monotonic() - start


@pytest.mark.distributed
@pytest.mark.parametrize("units", [True, False])
def test_rank_evaluating_alone_fails_every_rank_with_the_rule(units):
    """Gathers of *different sizes* (a whole decoder layer on one rank, one weight's on the
    other): gloo would abort the process; the header exchange catches it first, on every rank."""
    for msg, elapsed in run_distributed(_diverge_sizes_worker, 2, units, timeout=120):
        assert "ranks diverged" in msg and "Rule: every rank must run" in msg, msg
        assert elapsed < 10, elapsed


def _disagree_worker(rank, world_size, what):
    from elastic_kernels.api import ElasticPolicy, elasticize

    chunk = 24 * FP32 * 8
    seed = 0
    if what == "chunk_bytes" and rank == 1:
        chunk = 24 * FP32 * 4
    if what == "seed" and rank == 1:
        seed = 1
    try:
        elasticize(make_model(seed=seed), ElasticPolicy(chunk_bytes=chunk))
    except ValueError as e:
        return str(e)
    return "no error"


@pytest.mark.distributed
@pytest.mark.parametrize("what,needle", [("chunk_bytes", "'chunk_bytes'"), ("seed", "content fingerprint")])
def test_ranks_that_disagree_fail_at_wrap_time(what, needle):
    for msg in run_distributed(_disagree_worker, 2, what, timeout=120):
        assert "ranks do not agree" in msg and needle in msg and "rank(s) [1]" in msg, msg


def _page_worker(rank, world_size):
    from elastic_kernels.api import ElasticPolicy, elasticize, runtime_of

    model = make_model()
    elasticize(model, ElasticPolicy(chunk_bytes=1 << 35))  # 32 GiB asked, KiB-sized weights
    model(torch.randn(3, DIMS[0])).sum().backward()
    return runtime_of(model).pool.page_bytes


@pytest.mark.distributed
def test_pages_are_sized_from_real_chunks():
    largest = max(a * b for a, b in zip(DIMS[:-1], DIMS[1:])) * FP32
    for page in run_distributed(_page_worker, 2, timeout=120):
        assert page == -(-largest // 512) * 512


# ------------------------------------------------------------------------------ bad values


@pytest.mark.parametrize(
    "field,value",
    [("collective_timeout_s", math.inf), ("collective_timeout_s", 1e15), ("collective_timeout_s", math.nan),
     ("collective_timeout_s", True), ("all_reduce_grads", "no"), ("pool_budget_bytes", True),
     ("pool_budget_bytes", 1.5), ("prefetch_depth", True), ("chunk_bytes", True), ("keep_ratio", math.inf)],
)
def test_policy_refuses_bad_values(field, value):
    from elastic_kernels.api import ElasticPolicy

    with pytest.raises(ValueError, match=f"ElasticPolicy.{field}"):
        ElasticPolicy(**{field: value})


def test_runtime_refuses_bad_arguments():
    from elastic_kernels.api import ElasticPolicy, ElasticRuntime, elasticize

    with pytest.raises(TypeError, match="policy must be an ElasticPolicy"):
        ElasticRuntime(None)
    model = elasticize(make_model(), ElasticPolicy())
    from elastic_kernels.api import set_pool_budget

    for bad in (math.inf, -1, True, 2.5):
        with pytest.raises(ValueError, match="set_pool_budget"):
            set_pool_budget(model, bad)
