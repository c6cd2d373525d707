"""Shards without padding ([Note: chunk-major shard layout] in elastic_kernels/layout.py): a
rank holds its real elements of every weight and nothing of the ragged last chunk's padding,
at every budget; what it sends is unchanged (the short last slice is zero-padded in a
temporary), so every gather and byte count is what it was.

The static memory per rank is measured as every live CPU tensor storage (each once) less
those of the model's parameters and buffers and less what was alive before the model was
built, after one step with its gradients dropped: exactly the runtime's shards or runs plus
its pool. It is compared, to the byte, with the analytic value computed here from the shapes
alone: per weight, this rank's real elements (full slices of the full chunks, then
min(S, max(0, L - r * S)) of the last chunk of L elements) x 4 bytes, or rows x cols x 4 for a
weight held as a run (budget all), plus the pool's pages x page bytes, a page being the
largest chunk (768 bytes) rounded up to 512 (page rounding: 1024 bytes). The pool's page
count is what it allocated (lazily, one segment per growth), bounded here by the budget's
pages plus the working set (the two largest units, prefetch depth 1).
"""

from __future__ import annotations

import time

import pytest
import torch

from tests._dist import run_distributed
from tests.runtime.test_runtime import FP32, make_model

pytestmark = [pytest.mark.distributed, pytest.mark.needs_ext]

# frozen layers 24->40, 40->24, 24->35 (rows 40, 24, 35); chunks of 8 rows of the 24-wide
# layers (192 elements) and 4 rows of the 40-wide one (160): the 35-row layer's last chunk is
# 3 rows, 72 elements. At 2 ranks (S = 96): rank 0 holds 72 of them, rank 1 none. At 4
# ranks (S = 48): rank 0 48 (a full slice), rank 1 24, ranks 2 and 3 none.
DIMS = (24, 40, 24, 35)
CHUNK = 24 * FP32 * 8
PAGE = 1024  # the largest chunk, 768 bytes, rounded up to PAGE_ALIGN = 512
BUDGETS = ("zero", "partial", "all")


def own_numel(rows: int, cols: int, world_size: int, rank: int, chunk_bytes: int = CHUNK) -> int:
    """This rank's real elements of a rows x cols weight (independent of ChunkLayout)."""
    rpc = min(rows, max(1, chunk_bytes // (cols * FP32)))
    chunks = -(-rows // rpc)
    s = -(-rpc * cols // world_size)
    last = (rows - (chunks - 1) * rpc) * cols
    return (chunks - 1) * s + min(s, max(0, last - rank * s))


def padded_numel(rows: int, cols: int, world_size: int, chunk_bytes: int = CHUNK) -> int:
    rpc = min(rows, max(1, chunk_bytes // (cols * FP32)))
    return -(-rows // rpc) * -(-rpc * cols // world_size)


def _static_worker(rank, world_size):
    from elastic_kernels.api import ElasticPolicy, elasticize, runtime_of, set_pool_budget
    from elastic_kernels.api.planning.peaks import live_tensor_bytes

    shapes = [(b, a) for a, b in zip(DIMS[:-1], DIMS[1:])]
    out = {}
    for budget in BUDGETS:
        base = live_tensor_bytes()
        model = make_model(DIMS)
        elasticize(model, ElasticPolicy(chunk_bytes=CHUNK))
        rt = runtime_of(model)
        budget_bytes = {"zero": 0, "partial": 3 * PAGE, "all": None}[budget]
        set_pool_budget(model, budget_bytes)
        x = torch.randn(3, DIMS[0])
        model(x).sum().backward()
        del x
        model.zero_grad(set_to_none=True)  # (no loop variable left holding a parameter into the next budget)
        held = {p.untyped_storage().data_ptr() for p in model.parameters()} | \
            {b.untyped_storage().data_ptr() for b in model.buffers()}
        pool = 0 if rt.pool is None else sum(seg["bytes"] for seg in rt.pool.snapshot())
        if budget == "all":  # every weight a run: its bytes once ([Note: resident runs])
            weights = sum(r * c for r, c in shapes) * FP32
        else:
            weights = sum(own_numel(r, c, world_size, rank) for r, c in shapes) * FP32
        analytic = weights + pool
        # A buffer released late (see test_runs.py's _memory_worker): read again while it differs.
        static = live_tensor_bytes(held) - base
        for _ in range(3):
            if static == analytic:
                break
            time.sleep(0.5)
            static = live_tensor_bytes(held) - base
        shards = [et.shard.numel() if et.shard is not None else None for et in rt.tensors]
        out[budget] = dict(static=static, analytic=analytic, weights=weights, pool=pool, shards=shards,
                           shard_bytes=sum(et.shard_bytes for et in rt.tensors),
                           runs=[et.run is not None for et in rt.tensors])
        rt.close()
        del model, rt
    return out


@pytest.mark.parametrize("world_size", [2, 4])
def test_static_memory_is_the_real_shards_plus_the_budget(world_size):
    """Static memory per rank = this rank's real elements of every weight (no padding of the
    ragged last chunk: a rank whose last slice is short holds fewer elements, one whose last
    slice is empty none of it) + the pool's pages, at budgets 0, partial (3 pages: less than any
    weight's bytes, so every weight stays in pages; a budget holding whole weights:
    test_runs.py's test_a_partial_budget_holds_whole_weights_that_fit) and all."""
    shapes = [(b, a) for a, b in zip(DIMS[:-1], DIMS[1:])]
    results = run_distributed(_static_worker, world_size, timeout=180)
    for rank, out in enumerate(results):
        for budget, m in out.items():
            where = (world_size, rank, budget, m)
            assert m["static"] == m["analytic"], where
            if budget == "all":
                assert all(m["runs"]) and m["pool"] == 0, where
                continue
            assert not any(m["runs"]), where
            assert m["shards"] == [own_numel(r, c, world_size, rank) for r, c in shapes], where
            assert m["shard_bytes"] == m["weights"], where
            # the budget's pages, page-rounded; at most the budget plus the working set (the
            # two largest units: 6 + 5 chunks)
            budget_pages = {"zero": 0, "partial": 3}[budget]
            assert m["pool"] % PAGE == 0 and 0 < m["pool"] <= (budget_pages + 11) * PAGE, where
        # the 35-row layer's last slice: shorter than S on rank 0 at 2 ranks, empty on rank 1
        last = own_numel(35, 24, world_size, rank) - (padded_numel(35, 24, world_size) - -(-192 // world_size))
        expected = {2: [72, 0], 4: [48, 24, 0, 0]}[world_size][rank]
        assert last == expected, (rank, last)
        padding = (padded_numel(35, 24, world_size) - own_numel(35, 24, world_size, rank)) * FP32
        assert padding > 0 or (world_size, rank) == (4, 0)
