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
