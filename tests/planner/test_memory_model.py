"""The memory and cost models against measurement, on the CLI's demo model (embedded Llama,
4 layers, hidden 256, 128-token sequences) on 2 gloo ranks.

Measured peak: `measure_peak_bytes` (tensor memory: the storages alive at the start of a step
plus the profiler's allocation high-water mark during it; on GPU it would be
`torch.cuda.max_memory_allocated`). The memory model must predict it within 10% for plans
that keep everything, trade kept chunks for recompute, and keep nothing (only the working set):
the three regimes where different terms (pool, saved activations, gather buffers) dominate.
The cost model's step time is compared with the measured one and the error printed (on these
shared CPUs timings are noise; the figure is reported in NOTES.md, not asserted).
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


def _worker(rank, world_size):
    from python_api import ElasticPolicy, LoRAConfig, convert_to_elastic
    from python_api.finetune.models import embedded_config, embedded_model
    from python_api.planner.memory import Choices
    from python_api.planner.search import plan_from_profile, plan_of
    from python_api.planning.apply import apply_plan
    from python_api.planning.measure import measure_peak_bytes, measure_profile

    torch.set_num_threads(1)
    cfg = embedded_config(256, 688, 4, 8, 4)
    model = convert_to_elastic(embedded_model(cfg, 0), LoRAConfig(r=8, alpha=16, target_modules=TARGETS),
                               ElasticPolicy(chunk_bytes=256 << 10))
    model.train()
    gen = torch.Generator().manual_seed(rank)
    ids = torch.randint(0, cfg.vocab_size, (MB, SEQ), generator=gen)
    profile = measure_profile(model, [ids], capacity_bytes=1 << 30)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-5)

    def step():
        model(input_ids=ids, labels=ids).loss.backward()

    everything = plan_from_profile(profile, 1 << 30, MB * world_size, micro_batches=[MB])
    plans = {
        "keep everything": everything,
        "planner, 80% of that": plan_from_profile(profile, int(everything.predicted_peak_bytes * 0.8 / 0.95),
                                                  MB * world_size, micro_batches=[MB]),
        "keep nothing, recompute none": plan_of(profile, Choices.uniform(profile, MB, 0.0), memory_bytes=1 << 30,
                                                global_batch=MB * world_size),
        "keep nothing, recompute all": plan_of(profile, Choices.uniform(profile, MB, 0.0, recompute=True),
                                               memory_bytes=1 << 30, global_batch=MB * world_size),
    }
    out = {}
    for name, plan in plans.items():
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
        out[name] = (plan.predicted_peak_bytes, measured, plan.predicted_step_time_s, statistics.median(times[1:]),
                     plan.kept_chunks, sum(lp.recompute for lp in plan.layers))
    return out


def test_memory_model_predicts_the_measured_peak():
    reports = run_distributed(_worker, 2, timeout=600)
    for rank, report in enumerate(reports):
        for name, (predicted, measured, step_pred, step_meas, kept, rec) in report.items():
            err = (predicted - measured) / measured
            print(f"rank {rank} {name} (kept {kept}, recompute {rec}): predicted peak {predicted / 2**20:.2f} MiB, "
                  f"measured {measured / 2**20:.2f} MiB ({err:+.1%}); step time predicted {step_pred:.3f} s, "
                  f"measured {step_meas:.3f} s ({(step_pred - step_meas) / step_meas:+.0%})")
            assert abs(err) <= TOLERANCE, f"{name}: predicted {predicted}, measured {measured} ({err:+.1%})"
