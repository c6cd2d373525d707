"""The memory and cost models against measurement, on the CLI's demo model (embedded Llama,
4 layers, hidden 256, 128-token sequences) on 2 gloo ranks.

The profile is measured at micro-batch 2 with every unit resident; its two fitted quantities,
the backward workspaces, come from that step without and with every layer recomputed. The
memory model is then validated only on what was not fitted: other micro-batches (1 and 4:
128 and 512 tokens, extrapolated per token) and other regimes (a subset of layers recomputed,
part of the chunks kept, nothing kept with a deeper prefetch window so that two units'
gathers are in flight, the planner's own choice under a cap), each of which weighs a
different term (pool, saved activations, gather buffers). Measured peak: `measure_peak_bytes`
(tensor memory: the storages alive at the start of a step plus the profiler's allocation
high-water mark during it; on GPU `torch.cuda.max_memory_allocated`).

Tolerance 10%, two-sided: what the model counts is exact integer arithmetic of the profile's
byte counts; what it cannot see is allocator and gloo transients (gloo's scratch copy of a
gather's output lives only while its collective runs, the model counts it for every gather in
the window, an upper bound; the recompute's transients are one fitted per-token figure).
Measured on this machine (2026-12-01, `pytest -s tests/planner/test_memory_model.py`): -3.0% to +6.0%;
2026-12-03 (commit 91384bf, shards without padding, load average ~24): -0.0% to +8.7% on the
device-weight plans, -0.0% to +1.8% with the weights on the host.
The device-weight model holds the weights a plan keeps whole as runs ([Note: resident runs]):
every 1-chunk weight (q/k/v/o at 256 KiB chunks) in "keep half", every weight in "keep
everything", which the memory model counts as runs (run_bytes in place of shard + pages:
[Note: what the memory model counts]); until 2026-12-03 it counted shard + pages and this test
ran with `resident_runs=False` (+15.3% on "keep half" with runs). The step time is
printed next to it, not asserted here (tests/planner/test_cost_model.py has the time model's
checks; these shared CPUs make a single step time noise).
"""

from __future__ import annotations

import statistics
import time

import pytest
import torch

from tests._dist import run_distributed

pytestmark = [pytest.mark.distributed, pytest.mark.needs_ext]

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
SEQ, MB = 128, 2
TOLERANCE = 0.10


def _plans(profile, world_size):
    """Plans on regimes and micro-batches the profile was not fitted on."""
    import dataclasses

    from elastic_kernels.api.planner.memory import Choices
    from elastic_kernels.api.planner.search import plan_from_profile, plan_of

    def of(choices):
        return plan_of(profile, choices, memory_bytes=1 << 30, global_batch=4 * world_size)

    layers = profile.layers
    half = tuple(i % 2 == 1 and layer.recomputable for i, layer in enumerate(layers))
    keep_half = Choices.uniform(profile, 1, 0.5)
    ample = plan_from_profile(profile, 1 << 30, 4 * world_size, micro_batches=[4])
    return {
        "micro-batch 1, keep half, recompute odd layers": of(dataclasses.replace(keep_half, recompute=half)),
        "micro-batch 4, keep nothing, prefetch 2": of(Choices.uniform(profile, 4, 0.0, prefetch_depth=2)),
        "micro-batch 1, keep everything, recompute odd layers": of(Choices.uniform(profile, 1, 1.0, recompute=half)),
        "micro-batch 4, planner at 75% of keeping everything": plan_from_profile(
            profile, int(ample.predicted_peak_bytes * 0.75 / 0.95), 4 * world_size, micro_batches=[4]),
    }


def _worker(rank, world_size):
    from elastic_kernels.api import ElasticPolicy, LoRAConfig, convert_to_elastic
    from elastic_kernels.api.finetune.models import embedded_config, embedded_model
    from elastic_kernels.api.planning.apply import apply_plan
    from elastic_kernels.api.planning.measure import measure_profile
    from elastic_kernels.api.planning.peaks import measure_peak_bytes

    torch.set_num_threads(1)
    cfg = embedded_config(256, 688, 4, 8, 4)
    model = convert_to_elastic(embedded_model(cfg, 0), LoRAConfig(r=8, alpha=16, target_modules=TARGETS),
                               ElasticPolicy(chunk_bytes=256 << 10))
    model.train()
    gen = torch.Generator().manual_seed(rank)
    profile = measure_profile(model, [torch.randint(0, cfg.vocab_size, (MB, SEQ), generator=gen)],
                              capacity_bytes=1 << 30)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-5)
    out = {}
    for name, plan in _plans(profile, world_size).items():
        ids = torch.randint(0, cfg.vocab_size, (plan.micro_batch, SEQ), generator=gen)

        def step():
            model(input_ids=ids, labels=ids).loss.backward()

        apply_plan(model, plan)
        times = []
        for _ in range(3):  # warm: the pool reaches its size, AdamW creates its state
            t0 = time.perf_counter()
            step()
            opt.step()
            opt.zero_grad(set_to_none=True)
            times.append(time.perf_counter() - t0)
        measured = measure_peak_bytes(model, step)
        opt.zero_grad(set_to_none=True)
        out[name] = (plan.predicted_peak_bytes, measured, plan.predicted_step_time_s / plan.accumulation,
                     statistics.median(times[1:]), plan.kept_chunks, sum(lp.recompute for lp in plan.layers))
    return out


def test_memory_model_predicts_the_measured_peak_off_its_fitting_points():
    reports = run_distributed(_worker, 2, timeout=900)
    for rank, report in enumerate(reports):
        for name, (predicted, measured, step_pred, step_meas, kept, rec) in report.items():
            err = (predicted - measured) / measured
            print(f"rank {rank} {name} (kept {kept}, recompute {rec}): predicted peak {predicted / 2**20:.2f} MiB, "
                  f"measured {measured / 2**20:.2f} MiB ({err:+.1%}); one micro-batch predicted {step_pred:.3f} s, "
                  f"measured {step_meas:.3f} s")
            assert abs(err) <= TOLERANCE, f"{name}: predicted {predicted}, measured {measured} ({err:+.1%})"


def _host_worker(rank, world_size):
    """The host tier's terms of the memory model (issue 17): the frozen weights in the node's
    host store (no device shard: the pool is the only device copy; host chunks need no receive
    buffer), at three keep fractions and micro-batches, with activation offload off and on
    (on: the activations of every elastic LoRA layer in host buffers between forward and
    backward, the credit of [Note: activation offload in the memory model]), against the
    measured tensor peak. The offload's host buffers are host memory, not counted: on this
    CPU-only machine they are CPU tensors too, told apart by `measure_peak_bytes`."""
    from elastic_kernels.api import ElasticPolicy, LoRAConfig, convert_to_elastic
    from elastic_kernels.api.finetune.models import embedded_config, embedded_model
    from elastic_kernels.api.planner.memory import Choices
    from elastic_kernels.api.planner.search import plan_of
    from elastic_kernels.api.planning.apply import apply_plan
    from elastic_kernels.api.planning.measure import measure_profile
    from elastic_kernels.api.planning.peaks import measure_peak_bytes

    torch.set_num_threads(1)
    cfg = embedded_config(256, 688, 4, 8, 4)
    model = convert_to_elastic(embedded_model(cfg, 0), LoRAConfig(r=8, alpha=16, target_modules=TARGETS),
                               ElasticPolicy(chunk_bytes=256 << 10, weights_on="host"))
    model.train()
    gen = torch.Generator().manual_seed(rank)
    profile = measure_profile(model, [torch.randint(0, cfg.vocab_size, (MB, SEQ), generator=gen)],
                              capacity_bytes=1 << 30)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-5)
    plans = {f"weights on host, keep {k:g}, micro-batch {m}, offload {'on' if off else 'off'}": plan_of(
        profile, Choices.uniform(profile, m, k, host_fraction=1.0, offload=off), memory_bytes=1 << 30,
        global_batch=4 * world_size) for k, off, m in [(0.0, False, 1), (0.5, False, 2), (1.0, False, 4),
                                                        (1.0, True, 1), (0.5, True, 2), (0.0, True, 4)]}
    out = {}
    for name, plan in plans.items():
        ids = torch.randint(0, cfg.vocab_size, (plan.micro_batch, SEQ), generator=gen)

        def step():
            model(input_ids=ids, labels=ids).loss.backward()

        apply_plan(model, plan)
        for _ in range(3):
            step()
            opt.step()
            opt.zero_grad(set_to_none=True)
        measured = measure_peak_bytes(model, step)
        opt.zero_grad(set_to_none=True)
        out[name] = (plan.predicted_peak_bytes, measured)
    return out


def test_host_tier_memory_model_predicts_the_measured_peak():
    """Same tolerance as above: the host store adds only exact byte counts (the pool as the
    only device copy, no receive buffers for host chunks)."""
    reports = run_distributed(_host_worker, 2, timeout=900)
    bad = []
    for rank, report in enumerate(reports):
        for name, (predicted, measured) in report.items():
            err = (predicted - measured) / measured
            print(f"rank {rank} {name}: predicted peak {predicted / 2**20:.2f} MiB, measured {measured / 2**20:.2f} MiB "
                  f"({err:+.1%})")
            if abs(err) > TOLERANCE:
                bad.append(f"{name}: predicted {predicted}, measured {measured} ({err:+.1%})")
    assert not bad, bad
