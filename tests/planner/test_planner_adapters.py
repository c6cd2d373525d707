"""The planner's models with K adapters trained together ([Note: several adapters in the
models] in python_api/planner/memory.py): activations and compute grow with the rows of all
adapters, adapter state and its all-reduce K times, gathers not at all.

The profile is a synthetic Llama-2 7B on 2 ranks (python_api/planner/shapes.py): every
per-token byte count in it is an integer, so the memory model's int(bytes x T) is exact and
the K = 4 prediction can be compared with the K = 1 one byte for byte.
"""

from __future__ import annotations

import dataclasses

import pytest

from elastic_kernels.api.planner.cost import allgather_bytes_per_micro_batch, h2d_bytes_per_micro_batch, step_cost
from elastic_kernels.api.planner.memory import Choices, adapter_state_bytes, memory_curve, timeline
from elastic_kernels.api.planner.plan import Plan, PlanningError
from elastic_kernels.api.planner.profile import ProfileError
from elastic_kernels.api.planner.search import least_memory, plan_from_profile
from elastic_kernels.api.planner.shapes import synthetic_profile

K = 4


@pytest.fixture(scope="module")
def profile():
    return synthetic_profile("llama2-7b", ranks=2, seq_len=512, device="h100-sxm")


def _choices(profile, k=1, micro_batch=1, **kw):
    kw.setdefault("keep_fraction", 0.5)
    kw.setdefault("persist_fraction", 0.25)
    return Choices.uniform(profile, micro_batch, num_adapters=k, **kw)


def _no_activations(profile):
    """The profile with every per-token byte count zero: its curve is fixed + pool + buffers."""
    layers = tuple(dataclasses.replace(layer, act_bytes_per_token=0.0, input_bytes_per_token=0.0)
                   for layer in profile.layers)
    outside = dataclasses.replace(profile.outside, act_bytes_per_token=0.0, peak_bytes_per_token=0.0,
                                  workspace_bytes_per_token=0.0, recompute_workspace_bytes_per_token=0.0)
    return dataclasses.replace(profile, layers=layers, outside=outside)


@pytest.mark.parametrize("recompute", [False, True], ids=["saved", "recomputed"])
def test_memory_grows_by_the_other_adapters_activations_and_state(profile, recompute):
    """Every point of the K = 4 curve is the K = 1 point plus 3 x (that point's activations +
    one adapter's parameters, gradients and AdamW moments); so is the peak."""
    rec = True if recompute else None
    one = memory_curve(profile, _choices(profile, recompute=rec))
    four = memory_curve(profile, _choices(profile, K, recompute=rec))
    bare = memory_curve(_no_activations(profile), _choices(profile, recompute=rec))
    state = adapter_state_bytes(profile)
    assert state == 16 * profile.adapter_grad_bytes // 4 == 4 * profile.adapter_grad_bytes > 0
    assert [label for label, _ in four.points] == [label for label, _ in one.points]
    expected = []
    for (label, b1), (_, b4), (_, b0) in zip(one.points, four.points, bare.points):
        acts = b1 - b0  # the point's activations with one adapter
        assert acts > 0, label
        assert b4 == b1 + (K - 1) * (acts + state), label
        expected.append(b1 + (K - 1) * (acts + state))
    assert four.peak_bytes == max(expected)
    assert four.pool_bytes == one.pool_bytes
    assert four.fixed_bytes == one.fixed_bytes + (K - 1) * state
    # The end of forward, from the profile's fields alone: every saved activation (or the
    # input of a recomputed layer), the outside activations and the logits' peak, per row.
    rows = profile.seq_len
    per_row = sum(int(layer.input_bytes_per_token if (recompute and layer.recomputable) else layer.act_bytes_per_token)
                  for layer in profile.layers)
    per_row += int(profile.outside.act_bytes_per_token) + int(profile.outside.peak_bytes_per_token)
    eof1, eof4 = dict(one.points)["end of forward"], dict(four.points)["end of forward"]
    assert eof4 - eof1 == (K - 1) * (per_row * rows + 4 * profile.adapter_grad_bytes)


def test_k_adapters_are_one_adapter_on_k_times_the_rows_plus_state(profile):
    a = memory_curve(profile, _choices(profile, K, micro_batch=1))
    b = memory_curve(profile, _choices(profile, 1, micro_batch=K))
    state = adapter_state_bytes(profile)
    assert [x + (K - 1) * state for _, x in b.points] == [x for _, x in a.points]


@pytest.mark.parametrize("host_fraction", [0.0, 0.5])
def test_gathers_do_not_grow(profile, host_fraction):
    kw = dict(recompute=True, host_fraction=host_fraction)
    p = synthetic_profile("llama2-7b", ranks=2, seq_len=512, device="h100-sxm", host_tier=True) if host_fraction else profile
    one, four = _choices(p, **kw), _choices(p, K, **kw)
    assert allgather_bytes_per_micro_batch(p, four) == allgather_bytes_per_micro_batch(p, one) > 0
    assert timeline(p, four) == timeline(p, one)
    if host_fraction:
        assert h2d_bytes_per_micro_batch(p, four) == h2d_bytes_per_micro_batch(p, one) > 0


def test_time_grows_with_rows_and_adapter_gradients(profile):
    one = step_cost(profile, _choices(profile), 2)
    four = step_cost(profile, _choices(profile, K), 2)
    rows4 = step_cost(profile, _choices(profile, 1, micro_batch=K), 2)
    assert four.compute_s == pytest.approx(rows4.compute_s, rel=1e-12)
    assert four.compute_s > one.compute_s
    assert four.allreduce_s == pytest.approx(profile.allreduce.time(K * profile.adapter_grad_bytes), rel=1e-12)
    assert one.allreduce_s == pytest.approx(profile.allreduce.time(profile.adapter_grad_bytes), rel=1e-12)
    assert four.step_s == pytest.approx(rows4.step_s - rows4.allreduce_s + four.allreduce_s, rel=1e-12)


def test_one_adapter_is_the_default(profile):
    plain = Choices.uniform(profile, 2, keep_fraction=0.5)
    assert plain.num_adapters == 1
    assert plain == _choices(profile, 1, micro_batch=2, persist_fraction=0.5)
    legacy = Choices(2, plain.keep, plain.persist, plain.recompute, 1, 0.0, False)  # positional, as search.py builds it
    assert memory_curve(profile, legacy) == memory_curve(profile, plain)


@pytest.mark.parametrize("bad", [0, -1, True, 1.5, "4"])
def test_bad_num_adapters(profile, bad):
    with pytest.raises(ValueError, match=r"num_adapters must be an int >= 1"):
        _choices(profile, bad)


# ---------------------------------------------------------------- the search with K adapters


def _as_one_adapter(profile, k):
    """The one-adapter profile that the Note says K adapters are: sequences K times as long
    (T = K x micro_batch x seq_len), the other adapters' state in static, and their gradients
    in the all-reduce."""
    return dataclasses.replace(profile, seq_len=k * profile.seq_len,
                               static_bytes=profile.static_bytes + (k - 1) * adapter_state_bytes(profile),
                               adapter_grad_bytes=k * profile.adapter_grad_bytes)


def _residency(plan):
    return ([[(w.keep_chunks, w.persist_chunks) for w in layer.weights] for layer in plan.layers],
            [layer.recompute for layer in plan.layers], plan.micro_batch, plan.accumulation, plan.prefetch_depth)


@pytest.mark.parametrize("gib", [24, 40])
def test_search_plans_k_adapters_as_one_adapter_on_k_times_the_rows(profile, gib):
    """The search with num_adapters=K picks what it picks for the equivalent one-adapter
    profile, and its plan's predictions are the models' for K adapters."""
    cap, batch = gib << 30, 16
    plan_k = plan_from_profile(profile, cap, batch, num_adapters=K)
    plan_1 = plan_from_profile(_as_one_adapter(profile, K), cap, batch)
    assert plan_k.num_adapters == K and plan_1.num_adapters == 1
    assert _residency(plan_k) == _residency(plan_1)
    assert plan_k.predicted_step_time_s == pytest.approx(plan_1.predicted_step_time_s, rel=1e-12)
    assert plan_k.predicted_peak_bytes == memory_curve(profile, plan_k.choices()).peak_bytes
    assert plan_k.predicted_peak_bytes == plan_1.predicted_peak_bytes
    assert plan_k.predicted_peak_bytes <= cap * (1 - 0.05)
    assert plan_k.choices().num_adapters == K


def test_k_adapters_need_more_memory_and_a_cap_can_fit_one_but_not_k(profile):
    batch = 16
    one, four = least_memory(profile, batch), least_memory(profile, batch, num_adapters=K)
    assert four > one
    assert plan_from_profile(profile, one, batch).num_adapters == 1
    with pytest.raises(PlanningError, match=r"short by \d+ bytes"):
        plan_from_profile(profile, one, batch, num_adapters=K)
    # At the least cap that fits one adapter, that plan's peak with K adapters is over the cap.
    plan = plan_from_profile(profile, one, batch)
    k_peak = memory_curve(profile, dataclasses.replace(plan.choices(), num_adapters=K)).peak_bytes
    assert k_peak > one * (1 - 0.05)


def test_plan_json_keeps_num_adapters(profile):
    plan = plan_from_profile(profile, 40 << 30, 16, num_adapters=K)
    doc = plan.to_dict()
    assert doc["num_adapters"] == K
    assert Plan.from_json(plan.to_json()) == plan
    one = plan_from_profile(profile, 40 << 30, 16)
    assert "num_adapters" not in one.to_dict()  # a one-adapter plan is written as before
    assert Plan.from_dict(one.to_dict()).num_adapters == 1
    assert f"{K} adapters" in plan.table() and "adapters" not in one.table()
    with pytest.raises(ProfileError, match=r"plan.num_adapters must be an int >= 1"):
        Plan.from_dict({**doc, "num_adapters": 0})


@pytest.mark.parametrize("bad", [0, True, 2.0])
def test_search_refuses_bad_num_adapters(profile, bad):
    with pytest.raises(PlanningError, match=r"num_adapters must be an int >= 1"):
        plan_from_profile(profile, 40 << 30, 16, num_adapters=bad)
