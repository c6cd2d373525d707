"""The planner's pure core: profile and plan JSON, the memory and cost models against hand
computation, and the search's guarantees (budget, monotone, deterministic, trivial cases,
speed). CPU only, no torch.distributed, no model."""

from __future__ import annotations

import json
import math
import os
import random
import subprocess
import sys

import pytest

from elastic_kernels.api.planner import (
    Choices,
    LayerProfile,
    Link,
    OutsideProfile,
    Plan,
    PlanningError,
    Profile,
    ProfileError,
    WeightProfile,
    allgather_bytes_per_micro_batch,
    allgather_bytes_per_step,
    memory_curve,
    plan_from_profile,
    plan_with_residency,
    step_cost,
    synthetic_profile,
    timeline,
)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


# ---------------------------------------------------------------- profiles

def tiny_profile(world_size=2, **overrides) -> Profile:
    """Two units: A (recomputable; one weight of 2 chunks) and B (one weight of 1 chunk).
    The hand computations below use these numbers."""
    kw = dict(
        source="hand", device="test", world_size=world_size, seq_len=10, capacity_bytes=10**6,
        reserved_bytes=100, static_bytes=200, page_bytes=1000, adapter_grad_bytes=1000,
        allgather=Link(0.001, 5000.0), allreduce=Link(0.002, 1e6),
        layers=(
            LayerProfile("A", True, 0.01, 0.02, 0.0, 0.0, 10.0, 2.0,
                         (WeightProfile("wa", 2, 1000 // world_size, 1000),)),
            LayerProfile("B", False, 0.005, 0.01, 0.0, 0.0, 4.0, 4.0,
                         (WeightProfile("wb", 1, 600 // world_size, 600),)),
        ),
        outside=OutsideProfile(0.0, 0.0, 1.0, 50.0),
    )
    kw.update(overrides)
    return Profile(**kw)


def random_profile(rng: random.Random) -> Profile:
    W = rng.choice([1, 2, 3, 4, 8])
    page = 512 * rng.randint(1, 8)
    layers = []
    for i in range(rng.randint(1, 7)):
        weights = []
        for j in range(rng.randint(1, 4)):
            chunk = rng.randint(1, page)
            weights.append(WeightProfile(f"w{j}", rng.randint(1, 9), -(-chunk // W) if W > 1 else chunk, chunk,
                                         backward=rng.random() > 0.2))
        act = rng.uniform(0, 200)
        layers.append(LayerProfile(
            f"layer{i}", rng.random() > 0.2, rng.uniform(0, 1e-3), rng.uniform(0, 2e-3), rng.uniform(0, 1e-2),
            rng.uniform(0, 2e-2), act, rng.uniform(0, act), tuple(weights)))
    return Profile(
        source="hand", device="random", world_size=W, seq_len=rng.choice([1, 16, 100]), capacity_bytes=10**12,
        reserved_bytes=rng.randint(0, 10**4), static_bytes=rng.randint(0, 10**5), page_bytes=page,
        adapter_grad_bytes=rng.randint(0, 10**6), allgather=Link(rng.uniform(0, 1e-3), rng.uniform(1e5, 1e8)),
        allreduce=Link(rng.uniform(0, 1e-3), rng.uniform(1e6, 1e9)), layers=tuple(layers),
        outside=OutsideProfile(rng.uniform(0, 1e-4), rng.uniform(0, 1e-4), rng.uniform(0, 50), rng.uniform(0, 500),
                               rng.choice([0.0, rng.uniform(0, 100)]), rng.choice([0.0, rng.uniform(0, 100)])),
    )


def fsdp_need(profile: Profile, micro_batch: int, recompute: bool, prefetch_depth: int = 1) -> int:
    """Peak of the FSDP configuration (nothing kept) by the memory model."""
    return memory_curve(profile, Choices.uniform(profile, micro_batch, 0.0, recompute=recompute,
                                                 prefetch_depth=prefetch_depth)).peak_bytes


# ---------------------------------------------------------------- JSON

def test_profile_json_round_trip(tmp_path):
    p = synthetic_profile("llama2-7b", ranks=8, seq_len=2048)
    assert Profile.from_json(p.to_json()) == p
    path = tmp_path / "profile.json"
    p.save(str(path))
    assert Profile.load(str(path)) == p
    q = tiny_profile()
    assert Profile.from_json(q.to_json()) == q


@pytest.mark.parametrize("edit, message", [
    (lambda d: d.pop("page_bytes"), "missing field(s) page_bytes"),
    (lambda d: d.update(world_size=0), "profile.world_size must be an int >= 1"),
    (lambda d: d.update(source="guessed"), "profile.source"),
    (lambda d: d.update(extra=1), "unknown field(s) extra"),
    (lambda d: d["allgather"].update(bytes_per_s=0), "profile.allgather.bytes_per_s"),
    (lambda d: d["layers"][1]["weights"][0].update(chunks=-1), "profile.layers[1].weights[0].chunks"),
    (lambda d: d["layers"][0].update(recomputable="yes"), "profile.layers[0].recomputable"),
    (lambda d: d["layers"][0]["weights"][0].update(chunk_bytes=5000), "exceeds profile.page_bytes"),
    (lambda d: d["layers"][0]["weights"][0].update(slice_bytes=10), "the slices must cover a chunk"),
    (lambda d: d["layers"][0].update(fwd_s_per_token=float("nan")), "profile.layers[0].fwd_s_per_token"),
    (lambda d: d["layers"][1].update(name="A"), "duplicate layer name"),
    (lambda d: d.update(version=2), "profile.version is 2"),
    (lambda d: d.update(static_bytes=10**7), "exceeds capacity_bytes"),
])
def test_profile_validation_names_the_field(edit, message):
    d = json.loads(tiny_profile().to_json())
    edit(d)
    with pytest.raises(ProfileError) as err:
        Profile.from_dict(d)
    assert message in str(err.value)


def test_profile_bad_json():
    with pytest.raises(ProfileError, match="not valid JSON"):
        Profile.from_json("{")


def test_plan_json_round_trip_and_validation(tmp_path):
    p = synthetic_profile("llama2-13b", ranks=4, seq_len=1024)
    plan = plan_from_profile(p, 40 * 10**9, 16)
    assert Plan.from_json(plan.to_json()) == plan
    path = tmp_path / "plan.json"
    plan.save(str(path))
    assert Plan.load(str(path)) == plan
    plan.check_profile(p)
    d = json.loads(plan.to_json())
    d["accumulation"] += 1
    with pytest.raises(ProfileError, match="!= global_batch"):
        Plan.from_dict(d)
    d = json.loads(plan.to_json())
    d["layers"][3]["weights"][2]["persist_chunks"] = d["layers"][3]["weights"][2]["chunks"] + 1
    with pytest.raises(ProfileError, match=r"plan.layers\[3\] \(model.layers.3\).weights\[2\] \(v_proj\)"):
        Plan.from_dict(d)
    d = json.loads(plan.to_json())
    del d["predicted_peak_bytes"]
    with pytest.raises(ProfileError, match="missing field.*predicted_peak_bytes"):
        Plan.from_dict(d)
    with pytest.raises(ProfileError, match="world_size"):
        plan.check_profile(synthetic_profile("llama2-13b", ranks=2, seq_len=1024))


# ---------------------------------------------------------------- models against hand computation

def test_traffic_formula_by_hand():
    # W = 4; weight x: n=5, slice 100, keep 3, persist 1, has a backward use;
    # weight y: n=3, slice 40, keep 2, persist 2, no backward use.
    W = 4
    prof = tiny_profile(world_size=W, page_bytes=1024, layers=(
        LayerProfile("L", True, 0.0, 0.0, 0.0, 0.0, 1.0, 1.0, (
            WeightProfile("x", 5, 100, 400), WeightProfile("y", 3, 40, 160, backward=False))),))
    for recompute, per_mb in (
        # x: (n-p) + (n-k) = 4 + 2 chunks; y: (n-p) = 1 chunk; each chunk (W-1) x slice bytes
        (False, 3 * 100 * (4 + 2) + 3 * 40 * 1),
        # recomputed: x gathers its n-k missing chunks once more, y its n-p
        (True, 3 * 100 * (4 + 2 + 2) + 3 * 40 * (1 + 1)),
    ):
        ch = Choices(1, ((3, 2),), ((1, 2),), (recompute,))
        assert allgather_bytes_per_micro_batch(prof, ch) == per_mb
        assert allgather_bytes_per_step(prof, ch, 3) == 3 * per_mb
        fwd, bwd = timeline(prof, ch)
        assert sum(u.received_bytes for u in fwd + bwd) == per_mb
    one = tiny_profile(world_size=1)
    assert allgather_bytes_per_step(one, Choices.uniform(one, 1, 0.0, recompute=True), 4) == 0


def test_memory_curve_by_hand():
    p = tiny_profile()  # W=2, page 1000, T = 10 tokens
    ch = Choices(1, ((1,), (0,)), ((1,), (0,)), (False, False))
    curve = memory_curve(p, ch)
    # pool: 3 chunks in all, working set = the 2 largest units = 3 pages -> 3000 bytes
    # base = reserved 100 + static 200 + pool 3000 + outside act 1 x 10 = 3310
    # buffers, (W + 1) x slice per missing chunk (the packed send slice and the W-slice
    # output): A misses 1 chunk (3 x 500), B 1 chunk (3 x 300), forward and backward alike
    assert dict(curve.points) == {
        "forward A": 3310 + 0 + 100 + 1500 + 900,
        "forward B": 3310 + 100 + 40 + 900,
        "end of forward": 3310 + 140 + 500,
        "backward B": 3310 + 100 + 40 + 900 + 1500,
        "backward A": 3310 + 0 + 100 + 1500,
    }
    assert curve.peak_bytes == 5850 and curve.peak_point == "backward B"
    rec = memory_curve(p, Choices(1, ((1,), (0,)), ((1,), (0,)), (True, False)))
    # A recomputed: keeps its input (2 x 10) in forward; its recompute holds input + activations
    assert dict(rec.points) == {
        "forward A": 3310 + 100 + 2400,
        "forward B": 3310 + 20 + 40 + 900,
        "end of forward": 3310 + 60 + 500,
        "backward B": 3310 + 20 + 40 + 900 + 1500,
        "recompute A": 3310 + 0 + 100 + 20 + 1500 + 1500,
        "backward A": 3310 + 0 + 100 + 20 + 1500,
    }
    assert rec.peak_bytes == 6430


def test_search_bound_is_the_memory_model():
    # The search's fast activation bound is memory_curve with nothing kept, minus the
    # constant parts; with buffers=False it is memory_curve with everything kept.
    from elastic_kernels.api.planner.problem import SearchProblem

    rng = random.Random(11)
    for prof in [synthetic_profile("llama2-70b", ranks=8, seq_len=4096)] + [random_profile(rng) for _ in range(30)]:
        s = SearchProblem(prof, 1, "chunks")
        for m in (1, 3):
            rec = [layer.recomputable and rng.random() < 0.5 for layer in prof.layers]
            for fraction, buffers in ((0.0, True), (1.0, False)):
                c = memory_curve(prof, Choices.uniform(prof, m, fraction, recompute=rec))
                assert s.act_peak(m * prof.seq_len, rec, buffers) == c.peak_bytes - c.fixed_bytes - c.pool_bytes


def test_search_estimate_is_the_cost_model():
    # The search compares candidates by a telescoped sum of run savings; for any candidate
    # (micro-batch, recompute set, memory) it must equal the cost model of the choices it
    # makes (so "more memory never slower" holds for the reported time), and those choices
    # must fit under the exact memory model.
    from elastic_kernels.api.planner.problem import SearchProblem

    rng = random.Random(8)
    checked = 0
    for _ in range(80):
        prof = random_profile(rng)
        per_rank = rng.choice([1, 2, 4])
        for granularity in ("chunks", "eighths"):
            s = SearchProblem(prof, 1, granularity)
            for m in [d for d in range(1, per_rank + 1) if per_rank % d == 0]:
                rec = [layer.recomputable and rng.random() < 0.5 for layer in prof.layers]
                need = memory_curve(prof, Choices.uniform(prof, m, 0.0, recompute=rec)).peak_bytes
                limit = int(need * rng.uniform(0.9, 1.5))
                estimate, kept, _ = s.evaluate(m, rec, limit)
                if estimate is None:
                    continue
                assert s.lower_bound(s.candidate(m, rec), kept) <= estimate * (1 + 1e-12)
                ch = s.choices(m, rec, kept, False)
                allreduce = prof.allreduce.time(prof.adapter_grad_bytes) if prof.world_size > 1 else 0.0
                assert estimate == pytest.approx(step_cost(prof, ch, 1).step_s - allreduce, rel=1e-9, abs=1e-12)
                assert memory_curve(prof, ch).peak_bytes <= limit
                checked += 1
    assert checked > 100


def test_step_cost_by_hand():
    p = tiny_profile()  # latency 1 ms, 5000 B/s; T = 10
    ch = Choices(1, ((1,), (0,)), ((1,), (0,)), (False, False))
    c = step_cost(p, ch, accumulation=2)
    # compute: A fwd 0.1, B fwd 0.05, B bwd 0.1, A bwd 0.2 = 0.45 per micro-batch
    # gathers: A misses 500 B (0.101 s), B 300 B (0.061 s)
    # forward A: nothing before it -> 0.101; forward B: hidden behind A (0.1) -> 0
    # backward B: first of its phase -> 0.061; backward A: 0.101 - 0.1 (B bwd) = 0.001
    exposed = 0.101 + 0.061 + 0.001
    assert c.exposed_comm_s == pytest.approx(2 * exposed, rel=1e-12)
    assert c.allreduce_s == pytest.approx(0.002 + 1000 / 1e6, rel=1e-12)
    assert c.step_s == pytest.approx(2 * (0.45 + exposed) + 0.003, rel=1e-12)
    rec = step_cost(p, Choices(1, ((1,), (0,)), ((1,), (0,)), (True, False)), accumulation=1)
    # the recompute of A (0.1 s) runs after B's backward: its gather (0.101) hides behind
    # B bwd (0.1) -> 0.001; A's backward now hides behind the recompute: 0.101 - 0.1 = 0.001
    assert rec.recompute_s == pytest.approx(0.1, rel=1e-12)
    assert rec.exposed_comm_s == pytest.approx(0.101 + 0.061 + 0.001 + 0.001, rel=1e-12)


# ---------------------------------------------------------------- search guarantees

def _check_plan(profile: Profile, plan: Plan, memory: int, margin: float, global_batch: int):
    """A plan's predictions against independent references (tests/planner/_reference.py:
    memory point by point, traffic chunk by chunk; tests/planner/_event_sim.py: time), and its
    shape."""
    from tests.planner import _reference
    from tests.planner._event_sim import latency_slack, step_seconds

    assert plan.predicted_peak_bytes <= int(memory * (1 - margin))
    assert plan.predicted_peak_bytes == _reference.peak_bytes(profile, plan)
    gathered, h2d = _reference.traffic_per_step(profile, plan)
    assert (plan.predicted_allgather_bytes_per_step, plan.predicted_h2d_bytes_per_step) == (gathered, h2d)
    sim = step_seconds(profile, plan)
    assert -1e-9 * sim <= sim - plan.predicted_step_time_s <= latency_slack(profile, plan) + 1e-9 * sim
    assert plan.micro_batch * plan.accumulation * profile.world_size == global_batch
    assert plan.pool_budget_bytes == profile.page_bytes * plan.kept_chunks
    for layer, lp in zip(profile.layers, plan.layers):
        assert not lp.recompute or layer.recomputable
        for w in lp.weights:
            assert 0 <= w.persist_chunks <= w.keep_chunks <= w.chunks


def test_budget_never_exceeded_random():
    rng = random.Random(1234)
    planned = refused = 0
    for trial in range(200):
        prof = random_profile(rng)
        G = prof.world_size * rng.choice([1, 2, 4, 6])
        floor = min(fsdp_need(prof, 1, True), fsdp_need(prof, 1, False))
        top = memory_curve(prof, Choices.uniform(prof, G // prof.world_size, 1.0)).peak_bytes
        memory = int(rng.uniform(0.9 * floor, 1.2 * top) / 0.95) + 1
        granularity = rng.choice(["chunks", "eighths"])
        depth = rng.choice([0, 1, 2])
        try:
            plan = plan_from_profile(prof, memory, G, prefetch_depth=depth, granularity=granularity)
        except PlanningError as exc:
            assert "short by" in str(exc)
            refused += 1
            continue
        planned += 1
        _check_plan(prof, plan, memory, 0.05, G)
        if granularity == "eighths":
            for lp in plan.layers:
                for w in lp.weights:
                    assert w.keep_chunks in {int(j * w.chunks / 8 + 0.5) for j in range(9)}
        # never slower than FSDP (nothing kept) under the same memory (which may not fit where
        # keeping everything does: with everything kept no receive buffer exists)
        try:
            fsdp = plan_with_residency(prof, memory, G, [[0] * len(lp.weights) for lp in plan.layers],
                                       prefetch_depth=depth)
        except PlanningError:
            assert plan.kept_chunks == prof.total_chunks
            continue
        assert plan.predicted_step_time_s <= fsdp.predicted_step_time_s * (1 + 1e-12)
    assert planned > 100 and refused > 0


def test_refusal_is_exact_about_the_shortfall():
    rng = random.Random(7)
    for _ in range(30):
        prof = random_profile(rng)
        G = prof.world_size
        # micro-batch 1 is the only choice; recomputing every layer or none are candidates, and
        # with a single layer those are the only ones
        prof = Profile.from_dict({**json.loads(prof.to_json()), "layers": [json.loads(prof.to_json())["layers"][0]]})
        # the least memory: nothing kept, or everything kept (then nothing is gathered and no
        # receive buffer exists), each with and without recompute
        need = min(memory_curve(prof, Choices.uniform(prof, 1, f, recompute=r)).peak_bytes
                   for f in (0.0, 1.0) for r in (False, True))
        margin = 0.0
        plan = plan_from_profile(prof, need, G, margin=margin)
        assert plan.predicted_peak_bytes <= need
        with pytest.raises(PlanningError, match=f"needs {need} bytes: short by 1 bytes"):
            plan_from_profile(prof, need - 1, G, margin=margin)


def test_monotone_in_memory():
    rng = random.Random(99)
    profiles = [synthetic_profile("llama2-7b", ranks=8, seq_len=2048)] + [random_profile(rng) for _ in range(12)]
    for prof in profiles:
        G = prof.world_size * 4
        lo = min(fsdp_need(prof, 1, True), fsdp_need(prof, 1, False))
        hi = memory_curve(prof, Choices.uniform(prof, 4, 1.0)).peak_bytes
        first = int(lo / 0.95) + 1
        assert first <= prof.capacity_bytes
        hi = max(first, min(int(hi * 1.1 / 0.95) + 1, prof.capacity_bytes))
        prev = math.inf
        steps = 40
        for s in range(steps + 1):
            memory = first + (hi - first) * s // steps
            plan = plan_from_profile(prof, memory, G)
            assert plan.predicted_step_time_s <= prev * (1 + 1e-12), (prof.source, memory)
            prev = plan.predicted_step_time_s


def test_deterministic():
    prof = synthetic_profile("llama2-13b", ranks=8, seq_len=4096)
    a = json.loads(plan_from_profile(prof, 40 * 10**9, 64).to_json())
    b = json.loads(plan_from_profile(Profile.from_json(prof.to_json()), 40 * 10**9, 64).to_json())
    a.pop("planning_seconds")
    b.pop("planning_seconds")
    assert a == b


def test_memory_for_everything_keeps_everything_persistent():
    rng = random.Random(5)
    for prof in [tiny_profile(), synthetic_profile("llama2-7b", ranks=8, seq_len=1024, device="h100-sxm")] + \
            [random_profile(rng) for _ in range(20)]:
        plan = plan_from_profile(prof, prof.capacity_bytes, prof.world_size)
        for lp in plan.layers:
            assert not lp.recompute
            for w in lp.weights:
                assert w.keep_chunks == w.persist_chunks == w.chunks
        assert plan.pool_budget_bytes == prof.page_bytes * prof.total_chunks
        # steady state: nothing is gathered
        assert plan.predicted_allgather_bytes_per_step == 0


def test_memory_for_nothing_extra_is_fsdp():
    # The least memory of any FSDP configuration (nothing kept, micro-batch 1, the first R
    # decoder layers recomputed; recomputing the last one too would cost its input at its
    # backward for nothing): the planner must return nothing kept at exactly that peak, and
    # refuse one byte less.
    prof = synthetic_profile("llama2-70b", ranks=8, seq_len=4096)
    L = len(prof.layers) - 1  # decoder layers; lm_head is not recomputable
    needs = [fsdp_need(prof, 1, [i < R for i in range(L)] + [False]) for R in range(L + 1)]
    need = min(needs)
    assert needs.index(need) > 0  # recompute is needed to fit at all
    plan = plan_from_profile(prof, need, 64, margin=0.0)
    assert plan.kept_chunks == 0 and plan.pool_budget_bytes == 0
    assert sum(lp.recompute for lp in plan.layers) == needs.index(need)
    assert plan.micro_batch == 1 and plan.accumulation == 8
    assert plan.predicted_peak_bytes == need
    # FSDP/ZeRO-3 traffic: forward and backward gather everything, recompute once more
    # (the first layer's q/k/v have no backward use)
    W = 8
    by_hand = 0
    for i, layer in enumerate(prof.layers):
        for w in layer.weights:
            r = 1 if plan.layers[i].recompute else 0
            uses = 2 + r if w.backward else 1 + r
            by_hand += (W - 1) * w.slice_bytes * w.chunks * uses
    assert plan.predicted_allgather_bytes_per_step == 8 * by_hand
    with pytest.raises(PlanningError, match="short by 1 bytes"):
        plan_from_profile(prof, need - 1, 64, margin=0.0)
    # a model with room for its activations: FSDP with no recompute
    # (eight units, so the working set, the 2 largest units, holds 3 of 9 chunks; and
    # recomputing A frees 80 bytes, less than a page)
    base = tiny_profile()
    extra = tuple(LayerProfile(f"B{j}", False, 0.005, 0.01, 0.0, 0.0, 4.0, 4.0,
                               (WeightProfile("wb", 1, 300, 600),)) for j in range(6))
    small = tiny_profile(layers=base.layers + extra)
    assert small.working_set_pages(1) < small.total_chunks
    need = fsdp_need(small, 1, False)
    assert need < fsdp_need(small, 1, True)
    plan = plan_from_profile(small, need, 2, margin=0.0)
    assert plan.kept_chunks == 0 and not any(lp.recompute for lp in plan.layers)


def test_llama2_70b_plans_quickly():
    prof = synthetic_profile("llama2-70b", ranks=8, seq_len=4096)
    plan = plan_from_profile(prof, 40 * 10**9, 64)
    # the benchmark reports the real figure (bench/bench_planner.py); loose here for a shared machine
    assert plan.planning_seconds < 3.0
    assert 0 < plan.kept_chunks < plan.total_chunks


def test_synthetic_shapes_by_hand():
    p = synthetic_profile("llama2-70b", ranks=8, seq_len=4096)
    assert len(p.layers) == 81 and p.layers[-1].name == "lm_head"
    w = {x.name: x for x in p.layers[5].weights}
    # q_proj 8192 x 8192 bf16: row 16 KiB, 256 rows per 4 MiB chunk, 32 chunks, slice 4 MiB / 8
    assert (w["q_proj"].chunks, w["q_proj"].chunk_bytes, w["q_proj"].slice_bytes) == (32, 4 << 20, (4 << 20) // 8)
    # k_proj: 8 kv heads x 128 = 1024 rows
    assert w["k_proj"].chunks == 4
    # down_proj 8192 x 28672: row 57344 B, 73 rows per chunk, ceil(8192 / 73) = 113 chunks
    assert w["down_proj"].chunks == 113 and w["down_proj"].chunk_bytes == 73 * 57344
    assert w["down_proj"].slice_bytes == 2 * math.ceil(73 * 28672 / 8)
    assert p.page_bytes == 4 << 20
    assert not any(x.backward for x in p.layers[0].weights[:3]) and all(x.backward for x in p.layers[1].weights)
    # Held as runs when kept whole, as the runtime would (can_hold_as_run): the weight's own
    # bytes, for every weight of a device-resident bf16 model on more than one rank.
    assert w["q_proj"].run_bytes == 8192 * 8192 * 2 and w["down_proj"].run_bytes == 8192 * 28672 * 2
    assert all(x.run_bytes is not None for layer in p.layers for x in layer.weights)
    # Not on one rank (nothing is gathered), not from the host store, not quantized, and not
    # where a full chunk's elements do not split evenly over the ranks (no chunk of this model
    # has a factor 3: 256 x 8192, 73 x 28672, ...).
    for other in (synthetic_profile("llama2-7b", ranks=1, seq_len=4096),
                  synthetic_profile("llama2-70b", ranks=8, seq_len=4096, weights_on="host"),
                  synthetic_profile("llama2-70b", ranks=8, seq_len=4096, weight_format="nf4"),
                  synthetic_profile("llama2-70b", ranks=3, seq_len=4096, device="h100-sxm")):
        assert all(x.run_bytes is None for layer in other.layers for x in layer.weights)


# ---------------------------------------------------------------- CLI

def _cli(*args):
    return subprocess.run([sys.executable, "-m", "elastic_kernels.api.planner", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)


def _cli_here(*args):
    """The module run as `python -m` runs it (runpy as __main__, sys.argv, the exit status of
    sys.exit or argparse's error), in this process: no interpreter start and import of torch
    per call (~4 s of CPU each). `_cli` runs the real command once in test_cli."""
    import contextlib
    import io
    import runpy

    out, err, argv, code = io.StringIO(), io.StringIO(), sys.argv, 0
    sys.argv = ["elastic_kernels.api.planner", *args]
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            runpy.run_module("elastic_kernels.api.planner", run_name="__main__", alter_sys=True)
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    finally:
        sys.argv = argv
    return subprocess.CompletedProcess(args, code, out.getvalue(), err.getvalue())


def test_cli():
    out = _cli("--shape", "llama2-7b", "--ranks", "8", "--memory", "40GB", "--seq-len", "2048")
    assert out.returncode == 0, out.stderr
    assert "micro-batch" in out.stdout and "model.layers.31" in out.stdout and "planning_seconds" in out.stdout
    js = _cli_here("--shape", "llama2-7b", "--ranks", "8", "--memory", "40GiB", "--global-batch", "16", "--json")
    assert js.returncode == 0, js.stderr
    plan = Plan.from_json(js.stdout)
    assert plan.memory_bytes == 40 << 30 and plan.global_batch == 16 and "planning_seconds" in js.stderr
    bad = _cli_here("--shape", "llama2-7b", "--ranks", "8", "--memory", "forty")
    assert bad.returncode == 2 and "argument --memory: 'forty' is not a size" in bad.stderr
    small = _cli_here("--shape", "llama2-70b", "--ranks", "8", "--memory", "4000000000")
    assert small.returncode == 2 and "short by" in small.stderr
    odd = _cli_here("--shape", "llama2-7b", "--ranks", "8", "--memory", "40GB", "--global-batch", "12")
    assert odd.returncode == 2 and "not a multiple of world_size 8" in odd.stderr
    host = _cli_here("--shape", "llama2-13b", "--ranks", "8", "--memory", "40GB", "--weights-on", "host", "--json")
    assert host.returncode == 0, host.stderr
    plan = Plan.from_json(host.stdout)
    assert plan.host_fraction == 1.0 and plan.predicted_allgather_bytes_per_step == 0


def test_close_to_exhaustive_search_on_small_profiles():
    # Every (micro-batch, recompute set, kept chunks per weight) of small random profiles,
    # evaluated with the same models: the planner's greedy (one recompute order, runs by time
    # saved per page) is optimal in most cases and never far off. Measured with this
    # generator (re-measured with the queued-link model of issue 17, 2026-12-01, the same
    # figures as before it: at depth 1 without the host tier the model did not change): optimal
    # on 449 of the 450 profiles of seeds 3, 4, 5, one 11.5% slower (it recomputes another
    # layer: the recomputed layers are a prefix of one fixed order, not any set); the 60
    # checked here (seed 3) are all optimal. The host tier and the prefetch depth searched:
    # test_close_to_exhaustive_search_with_the_host_tier.
    import itertools

    rng = random.Random(3)
    checked = optimal = 0
    worst = 0.0
    while checked < 60:
        prof = random_profile(rng)
        if len(prof.layers) > 3 or prof.total_chunks > 9:
            continue
        G = prof.world_size * rng.choice([1, 2, 4])
        per_rank = G // prof.world_size
        lo = memory_curve(prof, Choices.uniform(prof, 1, 0.0, recompute=True)).peak_bytes
        hi = memory_curve(prof, Choices.uniform(prof, per_rank, 1.0)).peak_bytes
        memory = int(rng.uniform(lo, hi * 1.05) / 0.95) + 1
        limit = int(memory * 0.95)
        best = None
        weights = [w for layer in prof.layers for w in layer.weights]
        for m in [d for d in range(1, per_rank + 1) if per_rank % d == 0]:
            for ks in itertools.product(*[range(w.chunks + 1) for w in weights]):
                it = iter(ks)
                keep = tuple(tuple(next(it) for _ in layer.weights) for layer in prof.layers)
                for rec in itertools.product(*[(False, True) if layer.recomputable else (False,)
                                               for layer in prof.layers]):
                    ch = Choices(m, keep, keep, rec)
                    if memory_curve(prof, ch).peak_bytes <= limit:
                        t = step_cost(prof, ch, per_rank // m).step_s
                        best = t if best is None else min(best, t)
        checked += 1
        try:
            plan = plan_from_profile(prof, memory, G)
        except PlanningError:
            assert best is None, "the planner refused a memory some plan fits in"
            continue
        assert best is not None and plan.predicted_step_time_s >= best * (1 - 1e-12)
        gap = plan.predicted_step_time_s / best - 1
        worst = max(worst, gap)
        optimal += gap <= 1e-9
    assert optimal >= 0.9 * checked and worst < 0.15, (optimal, checked, worst)


# ---------------------------------------------------------------- the host tier

def test_close_to_exhaustive_search_with_the_host_tier():
    """As above with every dimension: prefetch depth 1 and 2 (where gathers queue), the host
    fractions and activation offload (copies per linear on the shared link), judged by the
    same models, at memory below what keeping everything needs at micro-batch 1. Measured
    (2026-12-01, seeds 11, 12, 13, 60 profiles each): optimal on 177 of 180, 178 within 1%,
    worst 17.2% (seed 13: it recomputes layer 1 where recomputing layer 0 is faster, the
    fixed recompute order again); the 30 checked here (seed 11) are all optimal."""
    import dataclasses
    import itertools

    from elastic_kernels.api.planner.search import host_candidates, least_memory

    rng = random.Random(11)
    checked = optimal = 0
    worst = 0.0
    while checked < 30:
        prof = random_host_profile(rng)
        layers = []
        for layer in prof.layers:  # each offloaded tensor belongs to a linear, in forward order
            owners = sorted(rng.randrange(len(layer.weights)) for _ in layer.offload_tensors_bytes_per_token)
            layers.append(dataclasses.replace(layer, offload_tensors_weight=tuple(layer.weights[o].name
                                                                                  for o in owners)))
        prof = dataclasses.replace(prof, layers=tuple(layers), copy=Link(rng.uniform(0, 1e-4), rng.uniform(1e6, 1e9)))
        if len(prof.layers) > 3 or prof.total_chunks > 6:
            continue
        G = prof.world_size * rng.choice([1, 2, 4])
        per_rank = G // prof.world_size
        try:
            least = least_memory(prof, G, prefetch_depth=None)
        except PlanningError:
            continue
        keep_all = int(memory_curve(prof, Choices.uniform(prof, 1, 1.0)).peak_bytes / 0.95)
        if least >= keep_all:
            continue
        memory = rng.randint(least, keep_all - 1)
        limit = int(memory * 0.95)
        best = None
        weights = [w for layer in prof.layers for w in layer.weights]
        for m in [d for d in range(1, per_rank + 1) if per_rank % d == 0]:
            for ks in itertools.product(*[range(w.chunks + 1) for w in weights]):
                it = iter(ks)
                keep = tuple(tuple(next(it) for _ in layer.weights) for layer in prof.layers)
                for rec in itertools.product(*[(False, True) if layer.recomputable else (False,)
                                               for layer in prof.layers]):
                    for depth in (1, 2):
                        for f, off in host_candidates(prof):
                            ch = Choices(m, keep, keep, rec, depth, f, off)
                            if memory_curve(prof, ch).peak_bytes <= limit:
                                t = step_cost(prof, ch, per_rank // m).step_s
                                best = t if best is None else min(best, t)
        checked += 1
        plan = plan_from_profile(prof, memory, G, prefetch_depth=None)
        assert best is not None and plan.predicted_step_time_s >= best * (1 - 1e-12)
        gap = plan.predicted_step_time_s / best - 1
        worst = max(worst, gap)
        optimal += gap <= 1e-9
    assert optimal >= 0.9 * checked and worst < 0.2, (optimal, checked, worst)


def random_host_profile(rng: random.Random) -> Profile:
    """random_profile with the host tier: an h2d link, a store (or weights_on="host"), ragged
    last chunks, offloadable activations per layer and a host budget (None or a few buffers)."""
    import dataclasses

    prof = random_profile(rng)
    on = rng.choice(["device", "device", "host"])
    layers = []
    for layer in prof.layers:
        weights = tuple(dataclasses.replace(w, last_chunk_bytes=rng.choice([None, rng.randint(1, w.chunk_bytes)]))
                        for w in layer.weights)
        offl = tuple(float(rng.randint(1, 64)) for _ in range(rng.randint(0, 4)))
        freed = min(layer.act_bytes_per_token, rng.uniform(0, sum(offl))) if offl else 0.0
        owners = sorted(rng.randrange(len(weights)) for _ in offl)  # each tensor's linear, in forward order
        layers.append(dataclasses.replace(layer, weights=weights, offload_tensors_bytes_per_token=offl,
                                          offload_freed_bytes_per_token=freed,
                                          offload_tensors_weight=tuple(weights[o].name for o in owners)))
    static = prof.static_bytes if on == "device" else rng.randint(0, 10**4)
    return dataclasses.replace(
        prof, layers=tuple(layers), static_bytes=static, h2d=Link(rng.uniform(0, 1e-3), rng.uniform(1e5, 1e8)),
        host_store=True, weights_on=on, host_budget_bytes=rng.choice([None, None, 0, 512 * rng.randint(1, 40)]))


def test_host_chunk_count_is_the_runtime_rule():
    from elastic_kernels.api.host.sources import host_chunks
    from elastic_kernels.api.planner.memory import host_chunk_count, is_host_chunk

    rng = random.Random(3)
    fractions = [0.0, 0.25, 0.5, 0.75, 1.0, 0.3, 1 / 3, 0.1, 0.7, 0.9999] + [rng.random() for _ in range(30)]
    for f in fractions:
        for n in list(range(1, 60)) + [127, 128, 500, 4097]:
            flags = host_chunks(n, f)
            for x in {0, 1, n // 3, n // 2, n - 1, n}:
                assert host_chunk_count(n, x, f) == sum(flags[x:]), (n, x, f)
            assert is_host_chunk(n - 1, f) == flags[-1]


def test_offload_size_class_is_the_offloaders():
    from elastic_kernels.api.host.offload import MIN_HOST_BUFFER_BYTES, size_class
    from elastic_kernels.api.planner.memory import MIN_HOST_BUFFER_BYTES as OURS, offload_size_class

    assert OURS == MIN_HOST_BUFFER_BYTES
    for nbytes in list(range(1, 2000)) + [4095, 4096, 4097, 10**6]:
        assert offload_size_class(nbytes) == size_class(nbytes)


def test_host_traffic_by_hand():
    import dataclasses

    from elastic_kernels.api.planner import h2d_bytes_per_micro_batch

    # Two ranks, wa: 2 chunks of 1000 B (slice 500), wb: 1 chunk of 600 B with a ragged... no:
    # wa's last chunk is 700 B. host_fraction 0.5: wa chunk 1 is the host chunk (int(2 x .5) >
    # int(1 x .5)), chunk 0 a peer chunk; wb (1 chunk): int(.5) == int(0): a peer chunk.
    p = tiny_profile()
    p = dataclasses.replace(p, layers=(dataclasses.replace(p.layers[0], weights=(
        dataclasses.replace(p.layers[0].weights[0], last_chunk_bytes=700),)), p.layers[1]),
        h2d=Link(0.0, 1e6), host_store=True)
    ch = Choices(1, ((0,), (0,)), ((0,), (0,)), (False, False), host_fraction=0.5)
    # forward and backward each miss everything: wa chunk 0 gathered (500 B), chunk 1 copied
    # (700 B), wb gathered (300 B)
    assert allgather_bytes_per_micro_batch(p, ch) == 2 * (500 + 300)
    assert h2d_bytes_per_micro_batch(p, ch) == 2 * 700
    # keeping wa's first chunk leaves only the host chunk missing
    ch = dataclasses.replace(ch, keep=((1,), (0,)), persist=((1,), (0,)))
    assert allgather_bytes_per_micro_batch(p, ch) == 2 * 300
    assert h2d_bytes_per_micro_batch(p, ch) == 2 * 700
    # a host chunk needs no gather buffer: the peak drops by wa's buffers
    full = memory_curve(p, dataclasses.replace(ch, host_fraction=0.0)).peak_bytes
    assert memory_curve(p, ch).peak_bytes <= full
    # offload: A moves 3 tokens x 10 tensors... per token (10 tokens): 2 tensors of 1 and 2 B
    q = dataclasses.replace(p, layers=(dataclasses.replace(p.layers[0], offload_tensors_bytes_per_token=(1.0, 2.0),
                                                           offload_freed_bytes_per_token=3.0), p.layers[1]))
    on = dataclasses.replace(ch, offload=True)
    assert h2d_bytes_per_micro_batch(q, on) == 2 * 700 + 30
    assert h2d_bytes_per_micro_batch(q, dataclasses.replace(on, recompute=(True, False))) == \
        h2d_bytes_per_micro_batch(q, dataclasses.replace(ch, recompute=(True, False)))
    # a budget of one 512 B buffer serves the first (10 B, class 512) and refuses the second
    q1 = dataclasses.replace(q, host_budget_bytes=512)
    assert h2d_bytes_per_micro_batch(q1, on) == 2 * 700 + 10


def test_restored_copies_are_pairs_of_consecutive_linears():
    """[Note: activation offload in the memory model]: during a linear's backward its own
    restored copy and the one started ahead for the linear before it are alive; across
    layers the chain goes on from the previous offloading layer's last linear."""
    from elastic_kernels.api.planner.memory import per_linear, restored_bytes

    served = (((0, 10), (0, 1), (1, 5)), (), ((0, 7), (2, 3)), ((4, 2),))
    assert per_linear(served[0]) == [11, 5] and per_linear(()) == []
    # layer 0: max(0 + 11, 11 + 5); layer 1 (recomputed) holds layer 0's last linear (5);
    # layer 2: max(5 + 7, 7 + 3); layer 3: 3 + 2
    assert restored_bytes(served) == (16, 5, 12, 5)


def test_host_search_bound_is_the_memory_model():
    from elastic_kernels.api.planner.problem import SearchProblem

    rng = random.Random(12)
    for prof in [synthetic_profile("llama2-13b", ranks=8, seq_len=4096, host_tier=True)] + \
            [random_host_profile(rng) for _ in range(40)]:
        for f, off in ((0.5, True), (1.0, False), (0.25, True)):
            if prof.weights_on == "host":
                f = 1.0
            s = SearchProblem(prof, 1, "chunks", f)
            for m in (1, 3):
                rec = [layer.recomputable and rng.random() < 0.5 for layer in prof.layers]
                for fraction, buffers in ((0.0, True), (1.0, False)):
                    c = memory_curve(prof, Choices.uniform(prof, m, fraction, recompute=rec, host_fraction=f,
                                                           offload=off))
                    assert s.act_peak(m * prof.seq_len, rec, buffers, off) == \
                        c.peak_bytes - c.fixed_bytes - c.pool_bytes


def test_host_search_estimate_is_the_cost_model():
    from elastic_kernels.api.planner.problem import SearchProblem

    rng = random.Random(18)
    checked = 0
    for _ in range(60):
        prof = random_host_profile(rng)
        for granularity in ("chunks", "eighths"):
            f = 1.0 if prof.weights_on == "host" else rng.choice([0.25, 0.5, 0.75, 1.0])
            off = rng.random() < 0.5
            s = SearchProblem(prof, 1, granularity, f)
            for m in (1, 2):
                rec = [layer.recomputable and rng.random() < 0.5 for layer in prof.layers]
                need = memory_curve(prof, Choices.uniform(prof, m, 0.0, recompute=rec, host_fraction=f,
                                                          offload=off)).peak_bytes
                limit = int(need * rng.uniform(0.9, 1.5))
                estimate, kept, _ = s.evaluate(m, rec, limit, off)
                if estimate is None:
                    continue
                # the pruning bound never exceeds the model ([Note: the search])
                assert s.lower_bound(s.candidate(m, rec), kept) <= estimate * (1 + 1e-12)
                ch = s.choices(m, rec, kept, off)
                allreduce = prof.allreduce.time(prof.adapter_grad_bytes) if prof.world_size > 1 else 0.0
                assert estimate == pytest.approx(step_cost(prof, ch, 1).step_s - allreduce, rel=1e-9, abs=1e-12)
                assert memory_curve(prof, ch).peak_bytes <= limit
                checked += 1
    assert checked > 60


def test_host_budget_never_exceeded_and_monotone_random():
    from elastic_kernels.api.planner import h2d_bytes_per_step

    rng = random.Random(4321)
    planned = 0
    for trial in range(40):
        prof = random_host_profile(rng)
        G = prof.world_size * rng.choice([1, 2, 4])
        lo = min(memory_curve(prof, Choices.uniform(prof, 1, 0.0, recompute=r, host_fraction=1.0, offload=o)).peak_bytes
                 for r in (False, True) for o in (False, True))
        hi = memory_curve(prof, Choices.uniform(prof, G // prof.world_size, 1.0)).peak_bytes
        first = int(lo / 0.95) + 1
        hi = max(first, int(hi * 1.1 / 0.95) + 1)
        prev = math.inf
        for s in range(13):
            memory = first + (hi - first) * s // 12
            try:
                plan = plan_from_profile(prof, memory, G)
            except PlanningError:
                assert prev == math.inf, "a plan fitted in less memory"
                continue
            planned += 1
            _check_plan(prof, plan, memory, 0.05, G)
            ch = plan.choices()
            assert plan.predicted_h2d_bytes_per_step == h2d_bytes_per_step(prof, ch, plan.accumulation)
            if prof.weights_on == "host":
                assert plan.host_fraction == 1.0
                assert plan.predicted_allgather_bytes_per_step == 0 or prof.world_size == 1
            assert plan.predicted_step_time_s <= prev * (1 + 1e-12), (trial, memory)
            prev = plan.predicted_step_time_s
    assert planned > 200


def test_host_trivial_cases_and_determinism():
    prof = synthetic_profile("llama2-7b", ranks=8, seq_len=2048, host_tier=True)
    # memory for everything: every chunk kept and persistent, no recompute, nothing moved
    plan = plan_from_profile(prof, prof.capacity_bytes, 8 * 8, micro_batches=1)
    if plan.kept_chunks == plan.total_chunks:
        assert not any(lp.recompute for lp in plan.layers)
        assert plan.predicted_allgather_bytes_per_step == 0
        assert plan.predicted_h2d_bytes_per_step == 0 or plan.offload_activations
    big = synthetic_profile("llama2-7b", ranks=8, seq_len=512, host_tier=True)
    plan = plan_from_profile(big, big.capacity_bytes, 8)
    assert plan.kept_chunks == plan.total_chunks and not any(lp.recompute for lp in plan.layers)
    assert plan.predicted_allgather_bytes_per_step == 0 and not plan.offload_activations
    assert plan.predicted_h2d_bytes_per_step == 0 and plan.host_fraction == 0.0
    # weights on the host: only host fraction 1, nothing all-gathered
    host = synthetic_profile("llama2-70b", ranks=8, seq_len=4096, weights_on="host")
    a = plan_from_profile(host, 30 * 10**9, 64)
    assert a.host_fraction == 1.0 and a.predicted_allgather_bytes_per_step == 0
    assert a.predicted_h2d_bytes_per_step > 0
    assert json.loads(a.to_json()) | {"planning_seconds": 0} == \
        json.loads(plan_from_profile(host, 30 * 10**9, 64).to_json()) | {"planning_seconds": 0}
    dev = synthetic_profile("llama2-70b", ranks=8, seq_len=4096, host_tier=True)
    b = plan_from_profile(dev, 41 * 10**9, 64)
    assert json.loads(b.to_json()) | {"planning_seconds": 0} == \
        json.loads(plan_from_profile(dev, 41 * 10**9, 64).to_json()) | {"planning_seconds": 0}
    # the host dimensions never make a plan slower than the plan without them
    nohost = plan_from_profile(dev, 41 * 10**9, 64, host_fractions=[0.0], offload=False)
    assert b.predicted_step_time_s <= nohost.predicted_step_time_s
    # restricting the search: bad requests are refused
    with pytest.raises(PlanningError, match="host_fraction must|every chunk comes from the host store"):
        plan_from_profile(host, 30 * 10**9, 64, host_fractions=[0.5])
    with pytest.raises(PlanningError, match="needs a host store"):
        plan_from_profile(synthetic_profile("llama2-7b", ranks=8), 40 * 10**9, 64, host_fractions=[0.5])


def test_llama2_70b_plans_quickly_with_the_host_tier():
    prof = synthetic_profile("llama2-70b", ranks=8, seq_len=4096, host_tier=True)
    times = sorted(plan_from_profile(prof, 41 * 10**9, 64).planning_seconds for _ in range(3))
    assert times[1] < 2.0, times  # measured ~0.45 s median in bench/bench_planner.py; loose on shared CPUs


def test_llama2_70b_plans_quickly_on_a_jittered_profile_with_every_dimension():
    """Issue 17: every dimension searched (depth 1 and 2, five host fractions, offload), the
    layers' timings jittered by +-1% so no two units share their work, H100-80G shape."""
    prof = synthetic_profile("llama2-70b", ranks=8, seq_len=4096, device="h100-sxm", host_tier=True, jitter=0.01,
                             seed=1)
    assert len({(layer.fwd_s_per_token, layer.bwd_s_per_token) for layer in prof.layers}) == len(prof.layers)
    times = sorted(plan_from_profile(prof, 80 * 10**9, 64, prefetch_depth=None).planning_seconds for _ in range(3))
    # measured 0.70-0.87 s at a load average of 13 on 2 cores (bench/results/planner_jitter.csv); loose here
    assert times[1] < 3.0, times


def test_host_documents_round_trip_and_old_ones_load(tmp_path):
    prof = synthetic_profile("llama2-7b", ranks=8, seq_len=2048, host_tier=True, host_budget_bytes=1 << 30)
    assert Profile.from_json(prof.to_json()) == prof
    old = json.loads(synthetic_profile("llama2-7b", ranks=8, seq_len=2048).to_json())
    assert "h2d" not in old and Profile.from_dict(old).h2d is None
    plan = plan_from_profile(prof, 30 * 10**9, 64)
    path = tmp_path / "plan.json"
    plan.save(str(path))
    assert Plan.load(str(path)) == plan
    assert "predicted_h2d_bytes_per_step" in plan.table() or "H2D" in plan.table()
    d = json.loads(plan.to_json())
    for k in ("host_fraction", "offload_activations", "predicted_h2d_bytes_per_step"):
        del d[k]
    legacy = Plan.from_dict(d)
    assert (legacy.host_fraction, legacy.offload_activations, legacy.predicted_h2d_bytes_per_step) == (0.0, False, 0)


def test_prefetch_window_is_searched_and_monotone():
    """prefetch_depth=None searches PREFETCH_DEPTHS: never slower than either fixed depth
    where that fits, monotone in memory, and quick on the 70B shape with the host tier."""
    from elastic_kernels.api.planner.search import PREFETCH_DEPTHS

    prof = synthetic_profile("llama2-13b", ranks=8, seq_len=4096)
    previous = None
    for gb in (20, 25, 30, 35, 40):
        mem = gb * 10**9
        searched = plan_from_profile(prof, mem, 64, prefetch_depth=None)
        assert searched.prefetch_depth in PREFETCH_DEPTHS
        for d in PREFETCH_DEPTHS:
            try:
                fixed = plan_from_profile(prof, mem, 64, prefetch_depth=d)
            except PlanningError:
                continue
            assert searched.predicted_step_time_s <= fixed.predicted_step_time_s
        if previous is not None:
            assert searched.predicted_step_time_s <= previous
        previous = searched.predicted_step_time_s
    big = synthetic_profile("llama2-70b", ranks=8, seq_len=4096, host_tier=True)
    times = sorted(plan_from_profile(big, 41 * 10**9, 64, prefetch_depth=None).planning_seconds for _ in range(3))
    assert times[1] < 3.0, times
    with pytest.raises(PlanningError, match="prefetch_depth"):
        plan_from_profile(prof, 40 * 10**9, 64, prefetch_depth=-1)
    with pytest.raises(PlanningError, match="prefetch_depth"):
        plan_from_profile(prof, 40 * 10**9, 64, prefetch_depth=())


# ---------------------------------------------------------------- resident runs

def _with_run(p: Profile, run_bytes: int = 1700) -> Profile:
    """tiny_profile with wa (2 chunks of 1000 B, slices of 500 B: a 1000 B shard) held as a run
    of `run_bytes` when every chunk of it persists (a ragged last chunk of 700 B: 1700 B)."""
    import dataclasses

    wa = dataclasses.replace(p.layers[0].weights[0], run_bytes=run_bytes)
    return dataclasses.replace(p, layers=(dataclasses.replace(p.layers[0], weights=(wa,)), p.layers[1]))


def test_memory_model_counts_runs_by_hand():
    # [Note: what the memory model counts]: a weight held as a run costs run_bytes in place of
    # its shard (in static_bytes) and its pages (kept and working set).
    import dataclasses

    from elastic_kernels.api.planner import pool_pages

    paged, runs = tiny_profile(), _with_run(tiny_profile())
    every = Choices.uniform(paged, 1, 1.0)
    # Pages: wa 2 + wb 1 chunks all kept, working set = both units: min(3, 3 + 3) = 3 pages.
    # Runs: wa is a run; wb's 1 page kept + working set (units of 0 and 1 paged chunks: 1).
    assert pool_pages(paged, every) == 3 and pool_pages(runs, every) == 1
    c0, c1 = memory_curve(paged, every), memory_curve(runs, every)
    assert (c0.fixed_bytes, c0.pool_bytes) == (100 + 200, 3000)
    assert (c1.fixed_bytes, c1.pool_bytes) == (100 + 200 - 1000 + 1700, 1000)
    # Nothing else moves: activations and buffers at every point are the same.
    assert [b - c1.fixed_bytes - c1.pool_bytes for _, b in c1.points] == \
        [b - c0.fixed_bytes - c0.pool_bytes for _, b in c0.points]
    assert c1.peak_bytes == c0.peak_bytes + 1700 - 1000 - 2 * 1000  # the run, less the shard and 2 pages
    # Not a run: a chunk of wa not persistent (keep half: 1 of 2), or kept but not persisted,
    # or a host chunk of it (host fraction 0.5: its chunk 1).
    for ch in (Choices.uniform(paged, 1, 0.5), Choices(1, ((2,), (1,)), ((1,), (1,)), (False, False))):
        assert memory_curve(runs, ch) == memory_curve(paged, ch)
    hosted = dataclasses.replace(runs, h2d=Link(0.0, 1e6), host_store=True)
    ch = Choices.uniform(hosted, 1, 1.0, host_fraction=0.5)
    assert memory_curve(hosted, ch).pool_bytes == 3000
    assert memory_curve(hosted, Choices.uniform(hosted, 1, 1.0)).pool_bytes == 1000


def test_profile_run_bytes_json_and_validation():
    import dataclasses

    p = _with_run(tiny_profile())
    back = Profile.from_dict(json.loads(json.dumps(p.to_dict())))
    assert back == p and back.layers[0].weights[0].run_bytes == 1700
    assert "run_bytes" not in json.dumps(tiny_profile().to_dict())  # absent: never a run
    with pytest.raises(ProfileError, match=r"run_bytes is set, but a weight on the host"):
        dataclasses.replace(p, h2d=Link(0.0, 1e6), host_store=True, weights_on="host")
    d = p.to_dict()
    d["layers"][0]["weights"][0]["run_bytes"] = 0
    with pytest.raises(ProfileError, match=r"run_bytes"):
        Profile.from_dict(d)


def test_search_keeps_everything_where_the_runs_fit():
    # Everything kept costs fewer bytes with runs; the search counts them exactly there, so a
    # cap of exactly that peak keeps everything (counting pages it would not: 2650 bytes here
    # against 3950), and one byte less must keep less or recompute.
    p = _with_run(tiny_profile())
    need = memory_curve(p, Choices.uniform(p, 1, 1.0)).peak_bytes
    assert need < memory_curve(tiny_profile(), Choices.uniform(p, 1, 1.0)).peak_bytes
    plan = plan_from_profile(p, need, p.world_size, micro_batches=[1], margin=0.0)
    assert plan.kept_chunks == p.total_chunks and plan.predicted_peak_bytes == need
    less = plan_from_profile(p, need - 1, p.world_size, micro_batches=[1], margin=0.0)
    assert less.predicted_peak_bytes <= need - 1
    assert less.kept_chunks < p.total_chunks or any(lp.recompute for lp in less.layers)


# ---------------------------------------------------------------- whole weights

def test_whole_weights_beat_pages_below_keep_all():
    """[Note: the search], "Whole weights": where weights can be runs, the planner also
    proposes keeping weights whole (a run adds run_bytes - shard_bytes, a page per chunk adds
    the chunk beside its slice in the shard). Against the same profile with no runs (every
    kept chunk a page: the chunk proposal only), at the same memory: never slower, faster
    somewhere below keep-all, weights kept whole there, and the plan's predicted peak within
    the memory. 2 ranks: a page duplicates half of its chunk."""
    import dataclasses

    from elastic_kernels.api.planner.search import least_memory

    p = synthetic_profile("llama2-7b", ranks=2, seq_len=4096)
    paged = dataclasses.replace(p, layers=tuple(
        dataclasses.replace(layer, weights=tuple(dataclasses.replace(w, run_bytes=None) for w in layer.weights))
        for layer in p.layers))
    G, lo = 8, least_memory(p, 8)
    faster = []
    for f in (1.02, 1.05, 1.1, 1.2, 1.3):
        m = int(lo * f)
        a, b = plan_from_profile(p, m, G), plan_from_profile(paged, m, G)
        assert a.predicted_step_time_s <= b.predicted_step_time_s * (1 + 1e-12), (f, a.predicted_step_time_s,
                                                                                   b.predicted_step_time_s)
        assert a.predicted_peak_bytes <= m
        whole = sum(w.keep_chunks == w.chunks for layer in a.layers for w in layer.weights)
        if a.predicted_step_time_s < b.predicted_step_time_s * (1 - 1e-3):
            faster.append((f, whole))
    assert faster and all(whole > 0 for _, whole in faster), faster
