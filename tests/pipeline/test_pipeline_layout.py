"""The pipeline's layout (python_api/planner/pipeline.py), pure Python: balanced boundaries
against brute force, the schedule rules and orders, and the errors a bad configuration gets."""

from __future__ import annotations

import itertools
import random

import pytest

from elastic_kernels.api.planner.pipeline import (
    PipelineError,
    PipelineLayout,
    balanced_boundaries,
    load_events,
    residency_trace,
    schedule_order,
)


def _brute(costs, n, first, last):
    L = len(costs)
    best = None
    for cuts in itertools.combinations(range(1, L), n - 1):
        b = (0,) + cuts + (L,)
        v = max(sum(costs[b[k]:b[k + 1]]) + (first if k == 0 else 0) + (last if k == n - 1 else 0) for k in range(n))
        best = v if best is None or v < best else best
    return best


def test_balanced_boundaries_are_optimal():
    rng = random.Random(0)
    for _ in range(400):
        L = rng.randint(1, 9)
        n = rng.randint(1, L)
        costs = [rng.choice([0.0, 1.0, rng.random()]) for _ in range(L)]
        first, last = rng.choice([0.0, rng.random() * 2]), rng.choice([0.0, rng.random() * 2])
        b = balanced_boundaries(costs, n, first, last)
        assert len(b) == n + 1 and b[0] == 0 and b[-1] == L and all(b[k] < b[k + 1] for k in range(n))
        got = max(sum(costs[b[k]:b[k + 1]]) + (first if k == 0 else 0) + (last if k == n - 1 else 0) for k in range(n))
        assert got == pytest.approx(_brute(costs, n, first, last), rel=1e-9, abs=1e-12)


def test_balanced_boundaries_count_embeddings_and_head():
    assert balanced_boundaries([1.0] * 8, 4) == (0, 2, 4, 6, 8)
    # A head costing 3 layers leaves the last pack one layer; the embeddings' cost moves layers off the first.
    assert balanced_boundaries([1.0] * 8, 2, 0.0, 3.0) == (0, 6, 8)  # max(6, 2 + 3): ties go to the longer first pack
    b = balanced_boundaries([1.0] * 16, 4, 2.0, 6.0)
    sizes = [b[k + 1] - b[k] for k in range(4)]
    assert sizes[-1] < sizes[1] and sizes[0] <= sizes[1], sizes


def test_layout_placement_and_packs():
    layout = PipelineLayout.build(4, 2, 16, "looped-bfs", 8, pack_size=2)
    assert layout.dp == 2 and layout.n_packs == 8 and layout.packs_per_rank == 4
    assert layout.packs_of_rank(0) == (0, 2, 4, 6) and layout.packs_of_rank(1) == (1, 3, 5, 7)
    assert list(layout.layers_of_pack(3)) == [6, 7]
    assert PipelineLayout.from_dict(layout.to_dict()) == layout
    assert PipelineLayout.build(2, 2, 4, "1f1b", 2).boundaries == (0, 2, 4)


@pytest.mark.parametrize("schedule,pp,v,m", [("gpipe", 4, 1, 3), ("1f1b", 4, 1, 8), ("1f1b", 2, 1, 2),
                                             ("looped-bfs", 2, 3, 5), ("interleaved-1f1b", 4, 2, 8),
                                             ("interleaved-1f1b", 2, 2, 3)])
def test_orders_run_every_action_once_after_its_dependencies(schedule, pp, v, m):
    orders = [schedule_order(schedule, pp, v, m, r) for r in range(pp)]
    n = pp * v
    for r, order in enumerate(orders):
        assert sorted(order) == sorted((kind, s, i) for s in range(r, n, pp) for kind in "FB" for i in range(m))
        seen = set()
        for kind, s, i in order:
            if kind == "B":
                assert ("F", s, i) in seen, (schedule, r, s, i)
            seen.add((kind, s, i))
    # A global execution exists: simulate unit-time actions rank by rank.
    done, pos = set(), [0] * pp
    progress = True
    while progress:
        progress = False
        for r in range(pp):
            if pos[r] == len(orders[r]):
                continue
            kind, s, i = orders[r][pos[r]]
            deps = [("F", s - 1, i)] if kind == "F" and s > 0 else []
            if kind == "B" and s < n - 1:
                deps.append(("B", s + 1, i))
            if all(d in done for d in deps):
                done.add((kind, s, i))
                pos[r] += 1
                progress = True
    assert all(pos[r] == len(orders[r]) for r in range(pp)), f"{schedule}: the orders deadlock"


@pytest.mark.parametrize("kwargs,message", [
    (dict(world_size=4, pp=3, n_layers=8, schedule="1f1b", micro_batches=4), "does not divide the world size 4"),
    (dict(world_size=4, pp=4, n_layers=2, schedule="gpipe", micro_batches=4), "more pipeline stages (4) than decoder layers (2)"),
    (dict(world_size=2, pp=2, n_layers=8, schedule="1f1b", micro_batches=1), "at least as many micro-batches as pipeline stages"),
    (dict(world_size=4, pp=4, n_layers=4, schedule="looped-bfs", micro_batches=4, pack_size=2), "would hold no stage"),
    (dict(world_size=2, pp=2, n_layers=6, schedule="looped-bfs", micro_batches=2, pack_size=2), "do not spread evenly"),
    (dict(world_size=2, pp=2, n_layers=8, schedule="1f1b", micro_batches=4, pack_size=2), "runs one stage per rank"),
    (dict(world_size=2, pp=2, n_layers=8, schedule="interleaved-1f1b", micro_batches=5, pack_size=2), "multiple of its rounds"),
    (dict(world_size=2, pp=2, n_layers=8, schedule="zero-bubble", micro_batches=4), "unknown schedule"),
    (dict(world_size=2, pp=2, n_layers=8, schedule="1f1b", micro_batches=4, residency="pinned"), "unknown pack residency"),
    (dict(world_size=2, pp=2, n_layers=8, schedule="gpipe", micro_batches=4, boundaries=(0, 4, 4, 8)), "without layers"),
])
def test_bad_layouts_are_refused_naming_the_problem(kwargs, message):
    with pytest.raises(PipelineError) as info:
        PipelineLayout.build(**kwargs)
    assert message in str(info.value)


def test_residency_model_loads_as_often_as_the_layout_says():
    """Over the modelled trace, each pack is loaded (its bytes appear) as often as
    loads_per_step says, and the window prefetches before the load's action."""
    for schedule, v, m in (("looped-bfs", 2, 4), ("interleaved-1f1b", 2, 4), ("1f1b", 1, 4), ("gpipe", 1, 2)):
        for mode in ("step", "phase", "persistent"):
            layout = PipelineLayout.build(2, 2, 8, schedule, m, pack_size=8 // (2 * v), residency=mode, window=1)
            for r in range(2):
                events = load_events(layout, layout.order(r))
                for k in layout.packs_of_rank(r):
                    nf, nb = layout.loads_per_step(k)
                    assert sum(1 for e in events if e[1] == k) == nf + nb, (schedule, mode, k)
                fwd = {k: 100 * (k + 1) for k in layout.packs_of_rank(r)}
                bwd = {k: 10 * (k + 1) for k in layout.packs_of_rank(r)}
                during, after = residency_trace(layout, r, fwd, bwd)
                assert max(during) <= sum(fwd.values()) and after[-1] == (sum(fwd.values()) if mode == "persistent" else 0)
