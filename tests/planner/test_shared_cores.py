"""Ranks sharing cores in the pipeline cost model ([Note: ranks sharing cores] in
python_api/planner/pipeline_model.py) and its measurement (measure_busy_speed in
python_api/pipeline/profile.py).

The pure tests check the warped simulation against a closed form derived by hand: GPipe on
2 ranks, one pack each of equal compute, no links, m micro-batches of forward F and backward
B per pack. Rank 0's forwards run over [0, mF], rank 1's over [F, (m + 1)F]; rank 1's
backwards over [(m + 1)F, (m + 1)F + mB], rank 0's one B later. So one rank alone computes
for F at the start of the forwards, F at their end, B at the start of the backwards and B at
their end, and both for the rest: with the one-rank speed s the step is
(m - 1)(F + B) + 2 (F + B) / s (s = 1: the unshared (m + 1)(F + B)), each rank busy
(m - 1)(F + B) + (F + B) / s. The closed-form estimate's bubble share is divided by s.
One distributed test (2 gloo ranks as pp 2): the measurement gives every rank the same
tuple, positive and finite, its last entry 1.
"""

from __future__ import annotations

import math

import pytest

from elastic_kernels.api.planner.pipeline import PipelineError, PipelineLayout
from elastic_kernels.api.planner.pipeline_model import (
    PipeLayer,
    PipelineProfile,
    estimate,
    shared_core_warp,
    simulate,
)
from elastic_kernels.api.planner.profile import Link

FREE = Link(0.0, 1e30)
T = 128


def _profile(fwd=1e-5, bwd=2e-5, **kw):
    layers = tuple(PipeLayer(f"l{i}", 0.0, fwd, 0.0, bwd, 0.0, (), 0) for i in range(8))
    return PipelineProfile(source="hand", device="test", world_size=2, seq_len=T, hidden_size=64,
                           act_element_size=4, layers=layers, chunk_bytes=64 << 10, allgather=FREE, allreduce=FREE,
                           p2p=FREE, capacity_bytes=1 << 40, **kw)


def _gpipe(m):
    return PipelineLayout.build(2, 2, 8, "gpipe", m, residency="persistent")


@pytest.mark.parametrize("m", [1, 4, 7])
@pytest.mark.parametrize("s", [1.0, 1.25, 2.0])
def test_a_rank_alone_runs_faster_in_the_ramps(m, s):
    F, B = 4 * 1e-5 * T, 4 * 2e-5 * T  # one pack of 4 layers per rank
    pred = simulate(_profile(busy_speed=(s, 1.0)), _gpipe(m), 1)
    assert pred.step_s == pytest.approx((m - 1) * (F + B) + 2 * (F + B) / s, rel=1e-9)
    for r in range(2):
        assert pred.busy_s[r] == pytest.approx((m - 1) * (F + B) + (F + B) / s, rel=1e-9)
    plain = simulate(_profile(), _gpipe(m), 1)
    if s == 1.0:  # no sharing: the unwarped simulation, exactly
        assert pred.step_s == pytest.approx(plain.step_s, rel=1e-12)
    else:
        assert pred.step_s < plain.step_s


def test_the_estimate_divides_its_bubble_share():
    m, s = 4, 2.0
    plain = estimate(_profile(), _gpipe(m), 1)
    shared = estimate(_profile(busy_speed=(s, 1.0)), _gpipe(m), 1)
    work = max(plain.busy_s)
    stretch = (m + 1) / m
    assert plain.step_s == pytest.approx(work * stretch, rel=1e-9)
    assert shared.step_s == pytest.approx(work * (1 + (stretch - 1) / s), rel=1e-9)


def test_the_warp_follows_the_number_of_busy_ranks():
    # rank 0 busy [0, 2] and [5, 6]; rank 1 busy [1, 4]: segments 0-1 (1 busy), 1-2 (2), 2-4 (1),
    # 4-5 (none), 5-6 (1)
    warp = shared_core_warp([[(0.0, 2.0), (5.0, 6.0)], [(1.0, 4.0)]], (2.0, 1.0))
    expect = {0.0: 0.0, 1.0: 0.5, 2.0: 1.5, 3.0: 2.0, 4.0: 2.5, 5.0: 3.5, 6.0: 4.0, 7.0: 5.0}
    for t, w in expect.items():
        assert warp(t) == pytest.approx(w, rel=1e-12)


@pytest.mark.parametrize("bad", [(2.0,), (2.0, 0.9), (0.0, 1.0), (math.inf, 1.0), [1.5, 1.0], (True, 1.0)])
def test_bad_busy_speed_is_refused(bad):
    with pytest.raises(PipelineError, match="busy_speed"):
        _profile(busy_speed=bad)


def test_busy_speed_of_another_degree_is_refused():
    with pytest.raises(PipelineError, match="busy_speed has 3 entries for 2 pipeline ranks"):
        simulate(_profile(busy_speed=(1.5, 1.2, 1.0)), _gpipe(2), 1)


def _speed_worker(rank, world_size):
    import torch

    from elastic_kernels.api.pipeline import pipeline_groups
    from elastic_kernels.api.pipeline.profile import measure_busy_speed

    torch.set_num_threads(1)
    groups = pipeline_groups(2, "cpu", timeout_s=120)
    return measure_busy_speed(groups, seconds=0.1, rounds=2)


def test_measured_busy_speed_is_agreed_and_ends_at_one():
    from tests._dist import run_distributed

    out = run_distributed(_speed_worker, 2, timeout=300)
    assert out[0] == out[1]
    speed = out[0]
    assert len(speed) == 2 and speed[-1] == 1.0
    assert math.isfinite(speed[0]) and 0 < speed[0] < 100
