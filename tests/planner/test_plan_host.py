"""Plans with the host tier applied to a real model: the runtime does exactly what they say.

On a small Hugging Face Llama under convert_to_elastic on 2 gloo ranks with a host store
(host_fraction > 0 at wrap time, or weights_on="host"), plans choosing host_fraction in
{0.25, 0.5, 1} and activation offload on/off (with random per-weight residency, recompute
and micro-batch splits) are applied with `apply_plan`; in steady steps the measured
all-gather bytes AND host -> device bytes (host chunks copied into pages plus activations
brought back) equal the plan's predictions byte for byte, and the losses and adapter
gradients are bit-identical to the plain elastic run (no host tier, default residency,
every weight in pages: computed chunk by chunk), or, where a plan keeps a weight whole as a
run (one GEMM, [Note: resident runs]), equal to fp32 rounding (1e-4, as
tests/planner/test_plan_runtime.py argues).
One model has a host budget that refuses part of the activations, so the offloader's budget
rule (power-of-two size classes) is checked too. The planner's own choice is checked the
same way.
"""

from __future__ import annotations

import random

import pytest
import torch

from tests._dist import run_distributed
from tests.planner.test_plan_runtime import SEQ, TARGETS, _grads, _llama, _random_choices, _step

pytestmark = [pytest.mark.distributed, pytest.mark.needs_ext]


def _elastic(seed=0, **policy):
    from elastic_kernels.api import ElasticPolicy, LoRAConfig, convert_to_elastic

    model = convert_to_elastic(_llama(seed), LoRAConfig(r=4, alpha=8, target_modules=TARGETS, seed=3),
                               ElasticPolicy(chunk_bytes=48 * 4 * 5, all_reduce_grads=True, **policy))
    with torch.no_grad():  # non-zero B, so the LoRA path carries gradient into every layer
        gen = torch.Generator().manual_seed(11)
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.05)
    model.train()
    return model


def _host_worker(rank, world_size, policy, fractions):
    import dataclasses

    from elastic_kernels.api import reset_stats, stats
    from elastic_kernels.api.planner.search import plan_from_profile, plan_of
    from elastic_kernels.api.planning.apply import apply_plan
    from elastic_kernels.api.planning.measure import measure_profile

    per_rank = 2
    global_batch = per_rank * world_size
    gen = torch.Generator().manual_seed(100 + rank)
    from elastic_kernels.api import runtime_of

    planned, reference = _elastic(**policy), _elastic(resident_runs=False)
    profile = measure_profile(planned, [torch.randint(0, 96, (per_rank, SEQ), generator=gen)],
                              capacity_bytes=1 << 30)
    assert profile.h2d is not None and profile.host_store
    assert profile.weights_on == policy.get("weights_on", "device")
    assert all(layer.offload_tensors_bytes_per_token for layer in profile.layers if layer.recomputable)
    rng = random.Random(5)  # the same plans on every rank
    plans = []
    for f in fractions:
        for off in (False, True):
            c = _random_choices(profile, rng, rng.choice([1, 2]))
            c = dataclasses.replace(c, host_fraction=f, offload=off)
            plans.append(plan_of(profile, c, memory_bytes=1 << 30, global_batch=global_batch))
    # ...and the planner's own choices, with the host dimensions searched: under an ample cap,
    # and at the least memory any plan fits in (feasibility is monotone), and just above it.
    from elastic_kernels.api.planner.search import least_memory

    ample = plan_from_profile(profile, 1 << 30, global_batch)
    lo = least_memory(profile, global_batch)
    plans += [ample, plan_from_profile(profile, lo, global_batch), plan_from_profile(profile, lo * 11 // 10,
                                                                                      global_batch)]
    report = []
    for i, plan in enumerate(plans):
        apply_plan(planned, plan)
        measured = []
        for step in range(3):
            batch = torch.randint(0, 96, (plan.accumulation, plan.micro_batch, SEQ), generator=gen)
            reset_stats(planned)
            loss = _step(planned, batch, plan.accumulation)
            s = stats(planned)
            measured.append((s["allgather_bytes"], s["h2d_bytes"], s["d2h_bytes"]))
            ref_loss = _step(reference, batch, plan.accumulation)
            g, r = _grads(planned), _grads(reference)
            if any(et.run is not None for et in runtime_of(planned).tensors):
                assert abs(loss - ref_loss) <= 1e-4 * abs(ref_loss), f"plan {i} step {step}: loss {loss} vs {ref_loss}"
                for name in g:
                    torch.testing.assert_close(g[name], r[name], rtol=1e-4, atol=1e-4,
                                               msg=f"plan {i} step {step}: gradient of {name}")
                continue
            assert loss == ref_loss, f"plan {i} step {step}: loss {loss} != reference {ref_loss}"
            for name in g:
                assert torch.equal(g[name], r[name]), f"plan {i} step {step}: gradient of {name} differs"
        report.append((measured, plan.predicted_allgather_bytes_per_step, plan.predicted_h2d_bytes_per_step,
                       plan.host_fraction, plan.offload_activations))
    return report


@pytest.mark.parametrize("policy,fractions", [
    (dict(host_fraction=0.5), (0.25, 0.5, 1.0)),
    (dict(weights_on="host", offload_activations=True, host_budget_bytes=20000), (1.0,)),
], ids=["host_fraction", "weights_on_host_budget"])
def test_runtime_follows_host_plans(policy, fractions):
    reports = run_distributed(_host_worker, 2, policy, fractions, timeout=600)
    for measured, gathered, h2d, f, off in reports[0]:
        steady = [(a, b) for a, b, _ in measured[1:]]
        assert steady == [(gathered, h2d)] * 2, \
            f"host_fraction {f} offload {off}: (all-gather, H2D) per step {measured}, plan predicts {(gathered, h2d)}"
        if f == 1.0:
            assert gathered == 0
        if not off:
            assert all(d == 0 for _, _, d in measured[1:])
    assert any(off and h2d for _, _, h2d, _, off in reports[0])
    assert all(r == reports[0] for r in reports[1:]), "ranks saw different traffic"


def _no_store_worker(rank, world_size):
    import dataclasses

    from elastic_kernels.api.planner.memory import Choices
    from elastic_kernels.api.planner.search import plan_of
    from elastic_kernels.api.planning.apply import apply_plan
    from elastic_kernels.api.planning.measure import measure_profile

    model = _elastic()
    profile = measure_profile(model, [torch.randint(0, 96, (2, SEQ))], capacity_bytes=1 << 30, host_tier=True)
    assert not profile.host_store
    # A plan for a profile with a store, applied to a runtime without one.
    profile = dataclasses.replace(profile, host_store=True)
    plan = plan_of(profile, Choices.uniform(profile, 1, host_fraction=0.5), memory_bytes=1 << 30,
                   global_batch=2 * world_size)
    try:
        apply_plan(model, plan)
    except ValueError as exc:
        return str(exc)
    return None


def test_host_plan_needs_a_store():
    msgs = run_distributed(_no_store_worker, 2, timeout=300)
    assert all(m is not None and "no host store" in m for m in msgs), msgs
