"""The runtime's host tier: chunks from the host store and from peers ([Note: chunk sources]).

Parity is bit for bit in fp32 against the chunked single-process reference of test_runtime.py
(where a chunk comes from must not change a bit), and the traffic of each source per step is
compared with its analytic value computed here from the layout, independently of the runtime.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from tests._dist import run_distributed
from tests.runtime.test_runtime import DIMS, FP32, adapter_params, held_as_runs, make_model, reference_of

pytestmark = [pytest.mark.distributed, pytest.mark.needs_ext]

CHUNK = 24 * FP32 * 7  # 7 rows of 24 floats: divides none of the layers' row counts


def _train(model, ref, iters, seed):
    """`iters` steps of model and reference side by side; assert bit equality each step."""
    gen = torch.Generator().manual_seed(seed)
    for it in range(iters):
        x = torch.randn(5, DIMS[0], generator=gen)
        loss = model(x).square().mean()
        loss.backward()
        ref_loss = ref(x).square().mean()
        ref_loss.backward()
        assert torch.equal(loss, ref_loss), f"loss differs at step {it}: {loss.item()} vs {ref_loss.item()}"
        for (name, p), q in zip(((n, p) for n, p in model.named_parameters() if p.requires_grad), adapter_params(ref)):
            assert torch.equal(p.grad, q.grad), f"grad of {name} differs at step {it}"
        with torch.no_grad():
            for p, q in zip(adapter_params(model), adapter_params(ref)):
                p -= 0.1 * p.grad
                q -= 0.1 * q.grad
                p.grad = q.grad = None


CONFIGS = [
    # (weights_on, host_fraction, keep, persist, budget fraction of the frozen bytes)
    (on, hf, keep, persist, budget)
    for (on, hf), (keep, persist), budget in itertools.product(
        (("device", None), ("device", 0.5), ("device", 1.0), ("host", None)),
        ((0.0, 0.0), (1.0, 0.5), (1.0, 1.0)),
        (0.0, 0.5, None),
    )
]


def _parity_worker(rank, world_size, configs, iters):
    from elastic_kernels.api import ElasticPolicy, elasticize, runtime_of, stats

    frozen = sum(a * b for a, b in zip(DIMS[:-1], DIMS[1:])) * FP32
    out = []
    for on, hf, keep, persist, budget in configs:
        model = make_model()
        # Every chunk PERSISTENT, none from the host: the weights the budget holds whole are runs,
        # computed in one GEMM ([Note: resident runs]); the reference follows.
        budget_bytes = None if budget is None else int(budget * frozen)
        whole = held_as_runs(DIMS, CHUNK, world_size, keep, persist, budget_bytes) if on == "device" and not hf \
            else [False] * (len(DIMS) - 1)
        ref = reference_of(model, CHUNK, whole=whole)
        policy = ElasticPolicy(chunk_bytes=CHUNK, keep_ratio=keep, persist_ratio=persist, weights_on=on,
                               host_fraction=hf, all_reduce_grads=False, pool_budget_bytes=budget_bytes)
        elasticize(model, policy)
        _train(model, ref, iters, seed=7 + rank)
        assert [et.run is not None for et in runtime_of(model).tensors] == whole
        s = stats(model)
        out.append((on, hf, s["allgather_bytes"], s["h2d_bytes"], s["host_store_bytes"]))
    return out


@pytest.mark.parametrize("world_size", [2, 4])
def test_parity_every_source(world_size):
    configs = CONFIGS if world_size == 2 else CONFIGS[::4]
    reports = run_distributed(_parity_worker, world_size, configs, 3, timeout=400)
    for on, hf, gathered, h2d, store in reports[0]:
        frac = 1.0 if on == "host" else (hf or 0.0)
        assert store > 0 if (on == "host" or frac > 0) else store == 0
        if frac == 1.0:
            assert gathered == 0, f"{on} host_fraction={hf}: {gathered} bytes all-gathered"
        if frac == 0.0:
            assert h2d == 0
    assert all(r == reports[0] for r in reports[1:]), "ranks saw different traffic"


def test_world_size_one_streams_from_the_host():
    """No process group: weights_on="host" runs through the pool, every chunk from the store."""
    from elastic_kernels.api import ElasticPolicy, elasticize, runtime_of, stats

    dims = (24, 40, 24, 40, 24, 40, 24)  # six layers: the frozen bytes exceed a two-layer window
    for budget in (0, None):
        model = make_model(dims)
        ref = reference_of(model, CHUNK)
        elasticize(model, ElasticPolicy(chunk_bytes=CHUNK, weights_on="host", keep_ratio=0.0, persist_ratio=0.0,
                                        pool_budget_bytes=budget))
        rt = runtime_of(model)
        assert all(et.shard is None for et in rt.tensors), "weights_on='host' must keep no device shard"
        _train(model, ref, 3, seed=3)
        s = stats(model)
        frozen = sum(a * b for a, b in zip(dims[:-1], dims[1:])) * FP32
        assert s["allgather_bytes"] == 0
        # keep = persist = 0: every chunk is copied for forward and again for backward (the
        # first layer's input needs no gradient: no backward use), three steps.
        first = dims[0] * dims[1] * FP32
        assert s["h2d_bytes"] == 3 * (2 * frozen - first), s
        if budget == 0:
            # The frozen weights exceed the pool: it holds the layers in flight (the one running
            # and the one prefetched), never the whole model.
            page = rt.page_bytes()
            window = sum(sorted((et.num_chunks for et in rt.tensors), reverse=True)[:2]) * page
            assert 0 < s["pool_peak_bytes"] <= window < frozen, (s["pool_peak_bytes"], window, frozen)


def _traffic_worker(rank, world_size, on, hf, keep, persist, iters):
    from elastic_kernels.api import ElasticPolicy, elasticize, reset_stats, stats

    model = make_model()
    elasticize(model, ElasticPolicy(chunk_bytes=CHUNK, keep_ratio=keep, persist_ratio=persist,
                                    weights_on=on, host_fraction=hf))
    per_step = []
    for _ in range(iters):
        reset_stats(model)
        x = torch.randn(3, DIMS[0], requires_grad=True)
        model(x).sum().backward()
        s = stats(model)
        per_step.append((s["allgather_bytes"], s["h2d_bytes"]))
    return per_step


def _analytic(world_size, on, hf, keep, persist):
    """(all-gather bytes, H2D bytes) of a steady-state step, from the layout alone."""
    from elastic_kernels import ChunkLayout

    f = 1.0 if on == "host" else (hf or 0.0)
    gathered = h2d = 0
    for d_in, d_out in zip(DIMS[:-1], DIMS[1:]):
        lay = ChunkLayout.for_weight((d_out, d_in), CHUNK // (d_in * FP32), world_size)
        n = lay.num_chunks
        n_keep, n_persist = int(keep * n + 0.5), int(persist * n + 0.5)
        for c in range(n):
            host = int((c + 1) * f) > int(c * f)
            uses = (c >= n_persist) + (c >= n_keep)  # forward miss, backward miss
            if host:
                h2d += uses * lay.chunk_numel_of(c) * FP32
            else:
                gathered += uses * (world_size - 1) * lay.slice_numel * FP32
    return gathered, h2d


@pytest.mark.parametrize("world_size,on,hf,keep,persist", [
    (2, "device", 0.5, 0.0, 0.0), (2, "device", 1.0, 1.0, 0.5), (2, "host", None, 0.5, 0.0),
    (4, "device", 0.5, 1.0, 0.0), (2, "device", 0.3, 0.5, 0.5),
])
def test_exact_traffic_per_source(world_size, on, hf, keep, persist):
    iters = 3
    results = run_distributed(_traffic_worker, world_size, on, hf, keep, persist, iters, timeout=200)
    expected = _analytic(world_size, on, hf, keep, persist)
    for per_step in results:
        assert per_step[1:] == [expected] * (iters - 1), f"(all-gather, H2D) per step {per_step}, analytic {expected}"
    if on == "host" or hf == 1.0:
        assert expected[0] == 0


def test_policy_rejects_bad_host_knobs():
    from elastic_kernels.api import ElasticPolicy

    for kwargs, needle in [
        (dict(host_fraction=1.5), "host_fraction"),
        (dict(host_fraction=-0.1), "host_fraction"),
        (dict(host_fraction=float("nan")), "host_fraction"),
        (dict(weights_on="gpu"), "weights_on"),
        (dict(weights_on="host", host_fraction=0.5), "host_fraction must be 1"),
        (dict(host_budget_bytes=-1), "host_budget_bytes"),
        (dict(offload_activations="yes"), "offload_activations"),
    ]:
        with pytest.raises(ValueError, match=needle):
            ElasticPolicy(**kwargs)


def test_state_dict_round_trip_with_host_weights():
    """load_state_dict writes the host store; state_dict reads it back."""
    from elastic_kernels.api import ElasticPolicy, elasticize, runtime_of

    model = make_model()
    plain = make_model(seed=5)
    elasticize(model, ElasticPolicy(chunk_bytes=CHUNK, weights_on="host"))
    rt = runtime_of(model)
    for et, block in zip(rt.tensors, plain):
        from elastic_kernels.api.nn import load_full_weight

        load_full_weight(et, block.base.weight)
        assert torch.equal(rt.full_weight(et), block.base.weight)
    x = torch.randn(4, DIMS[0])
    ref = reference_of(plain, CHUNK)
    with torch.no_grad():
        for mb, rb in zip(model, ref):  # adapters and biases of the plain model differ: copy them
            mb.A.load_state_dict(rb.A.state_dict())
            mb.B.load_state_dict(rb.B.state_dict())
            mb.base.bias.copy_(rb.base.bias)
        assert torch.equal(model(x), ref(x))


def _load_worker(rank, world_size, fake_nodes):
    import elastic_kernels.api.host.store as hs
    import elastic_kernels.api.nn.state_dict as sd
    from elastic_kernels.api import ElasticPolicy, elasticize, runtime_of

    if fake_nodes:  # ranks 0,1 / 2,3: two nodes, two stores
        hs.node_identity = lambda: f"fake-node-{rank // 2}"
    writes = []
    real_copy = torch.Tensor.copy_
    store_ptrs = []

    def counting_copy(self, src, non_blocking=False):
        # A write whose destination lies inside this rank's mapping of the store.
        if store_ptrs and store_ptrs[0] <= self.data_ptr() < store_ptrs[1]:
            writes.append(self.numel())
        return real_copy(self, src, non_blocking)

    model = make_model()
    elasticize(model, ElasticPolicy(chunk_bytes=CHUNK, weights_on="host"))
    rt = runtime_of(model)
    base = rt.host_store.data_ptr
    store_ptrs[:] = [base, base + rt.host_store.nbytes]
    new = make_model(seed=5)  # the same on every rank
    torch.Tensor.copy_ = counting_copy
    try:
        for et, block in zip(rt.tensors, new):
            sd.load_full_weight(et, block.base.weight)
    finally:
        torch.Tensor.copy_ = real_copy
    ok = all(torch.equal(rt.full_weight(et), block.base.weight) for et, block in zip(rt.tensors, new))
    chunks_ok = all(torch.equal(et.host_chunk(c), block.base.weight[slice(*et.layout.chunk_rows(c))])
                    for et, block in zip(rt.tensors, new) for c in range(et.num_chunks))
    return dict(ok=ok, chunks_ok=chunks_ok, writes=len(writes), weights=len(rt.tensors),
                handle=rt.host_store.handle)


@pytest.mark.parametrize("world_size,fake_nodes", [(2, False), (4, True)])
def test_load_state_dict_writes_the_store_once_per_node(world_size, fake_nodes):
    """Issue 17 #6: loading a weight into the host store is done by one rank per node, between
    barriers; every rank of every node then reads the new weight (through its own mapping)."""
    out = run_distributed(_load_worker, world_size, fake_nodes, timeout=300)
    assert all(o["ok"] and o["chunks_ok"] for o in out), out
    n = out[0]["weights"]
    per_node = 2 if fake_nodes else world_size
    expected = [n if r % per_node == 0 else 0 for r in range(world_size)]
    assert [o["writes"] for o in out] == expected, ([o["writes"] for o in out], expected)
    if fake_nodes:
        assert out[0]["handle"] == out[1]["handle"] != out[2]["handle"] == out[3]["handle"]


def _nonfinite_worker(rank, world_size):
    from types import SimpleNamespace

    import elastic_kernels.api.host.store as hs
    from elastic_kernels.api import ElasticPolicy, elasticize, runtime_of
    from elastic_kernels.api.finetune.engines import _nonfinite_loaded
    from elastic_kernels.api.runtime import ElasticTensor

    hs.node_identity = lambda: f"fake-node-{rank // 2}"
    model = make_model()
    elasticize(model, ElasticPolicy(chunk_bytes=CHUNK, weights_on="host"))
    rt = runtime_of(model)
    import torch.distributed as dist

    spec = SimpleNamespace(embedded=True, source=None, dtype=torch.float32)
    checked = []
    real = ElasticTensor.host_chunk
    ElasticTensor.host_chunk = lambda self, c: checked.append((self.name, c)) or real(self, c)
    try:
        clean = _nonfinite_loaded(model, rt, spec)  # intact: every chunk this rank checks
    finally:
        ElasticTensor.host_chunk = real
    dist.barrier()
    if rank == 2:  # damage chunk 0 of the first weight in node 1's store only
        rt.tensors[0].host_chunk(0).view(-1)[3] = float("nan")
    dist.barrier()
    err = _nonfinite_loaded(model, rt, spec)
    every = {(et.name, c) for et in rt.tensors for c in range(et.num_chunks)}
    return err, checked, sorted(every), clean


def test_nonfinite_check_covers_every_nodes_store_once():
    """Issue 17 #9: with weights_on="host" on several nodes the NaN/Inf check of the base weights
    covers every chunk of every node's store exactly once per node (4 ranks as 2 nodes; a NaN
    in node 1's store, where the check by global rank would never look)."""
    out = run_distributed(_nonfinite_worker, 4, timeout=300)
    every = out[0][2]
    for node in (0, 1):
        checked = out[2 * node][1] + out[2 * node + 1][1]
        assert sorted(checked) == every, f"node {node} checked {sorted(checked)}, its store holds {every}"
    assert [o[3] for o in out] == [None] * 4
    errors = [o[0] for o in out]
    assert errors[0] is None and errors[1] is None, errors  # node 0's store is intact
    assert any(e is not None and "NaN or Inf" in e for e in errors[2:]), errors
