"""A pipelined step's measured tensor peak against the pipeline memory model
([Note: the pipeline memory model] in python_api/planner/pipeline_sim.py), per rank.

The demo model's shape with 8 layers (hidden 256), 2 gloo ranks (pp 2), weights in the host
store (so every pack has a pool: loads, releases and prefetches are real), three schedules and
residencies where different terms dominate: LoopedBFS with packs of 2 released between their
forwards and backwards (every micro-batch's activations in flight, two packs loaded at once),
1F1B at step residency (the whole stage resident, at most pp micro-batches in flight), GPipe
with transient packs (only the working set pooled). The model's inputs come from the plain
planner's measured profile of the pp = 1 model (per-layer saved bytes, the head's transients,
the backward workspace) and the weights' shapes ([Note: a pipeline profile from a measured
one]). Measured: `measure_step_peak_bytes` (live tensor storages at the step's start plus the
profiler's allocation high-water mark during it), after two warm-up steps (AdamW's state
exists). The planner plans the modelled peak under memory x (1 - margin), margin 5%
(plan_pipeline's default): so what must hold for a plan's cap to hold is measured <= modelled
/ (1 - 0.05); and the model must be close, within 10% either way (measured 2026-12-01:
-2.9% .. +0.8%, the part not modelled being the step's small tensors: batch, positions,
losses, optimizer counters; 2026-12-02, with the sent tensors kept to the step's end counted:
+0.1% .. +1.9%).
"""

from __future__ import annotations

import copy

import pytest
import torch

from tests._dist import run_distributed

pytestmark = [pytest.mark.distributed, pytest.mark.needs_ext]

SEQ, MBS = 64, 2
CONFIGS = [("looped-bfs", 4, 2, "phase", 1), ("1f1b", 2, None, "step", 1), ("gpipe", 2, None, "transient", 0)]
MARGIN = 0.05  # plan_pipeline's default
CLOSE = 0.10


def _worker(rank, world_size):
    from elastic_kernels.api import ElasticPolicy, LoRAConfig, convert_to_elastic
    from elastic_kernels.api.finetune.models import embedded_config, embedded_model
    from elastic_kernels.api.loading import empty_model
    from elastic_kernels.api.pipeline import PipelinedModel, PipelineLayout, pipeline_groups
    from elastic_kernels.api.pipeline.profile import ActionOverhead, measure_step_peak_bytes, pipeline_profile
    from elastic_kernels.api.planner.pipeline_model import simulate
    from elastic_kernels.api.planning.measure import measure_profile
    from elastic_kernels.api.planning.peaks import live_tensor_bytes
    from tests.pipeline._common import _solo_group

    torch.set_num_threads(1)
    cfg = embedded_config(256, 688, 8, 8, 4)
    lora = LoRAConfig(r=8, alpha=16, target_modules=("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                      "up_proj", "down_proj"))
    policy = ElasticPolicy(chunk_bytes=64 << 10, weights_on="host")
    gen = torch.Generator().manual_seed(7)
    ids = torch.randint(0, cfg.vocab_size, (MBS, SEQ), generator=gen)
    ref = convert_to_elastic(embedded_model(cfg, 0), lora, ElasticPolicy(chunk_bytes=64 << 10), group=_solo_group())
    measured_profile = measure_profile(ref, [ids], capacity_bytes=8 << 30, host_tier=True)
    del ref
    groups = pipeline_groups(2, "cpu", timeout_s=120)
    # the per-action overhead changes no byte: not measured here (tests/planner/test_pipeline_overhead.py)
    prof = pipeline_profile(empty_model(copy.deepcopy(cfg)), lora, policy, measured_profile, world_size=world_size,
                            action_overhead=ActionOverhead(0.0, 0.0))
    out = []
    for schedule, m, pack_size, residency, window in CONFIGS:
        layout = PipelineLayout.build(world_size, 2, 8, schedule, m, pack_size=pack_size, residency=residency,
                                      window=window)
        before = live_tensor_bytes()  # what earlier configurations left (their host stores, on CPU)
        pipe = PipelinedModel(embedded_model(cfg, 0), lora, policy, layout, groups, micro_batch_size=MBS, seq_len=SEQ)
        opt = torch.optim.AdamW(pipe.parameters(), lr=1e-4)
        batch = torch.randint(0, cfg.vocab_size, (m * MBS, SEQ), generator=torch.Generator().manual_seed(1))
        for _ in range(2):
            pipe.train_step(batch)
            opt.step()
            opt.zero_grad(set_to_none=True)
        measured = measure_step_peak_bytes(pipe, lambda p=pipe: p.train_step(batch)) - before
        predicted = simulate(prof, layout, MBS).peak_bytes[groups.pp_rank]
        out.append((f"{schedule} m={m} packs of {pack_size or 4} {residency}", measured, predicted))
        pipe.close()
        del pipe, opt
    return out


def test_measured_peak_within_the_models_bound():
    reports = run_distributed(_worker, 2, timeout=900)
    for rank, rows in enumerate(reports):
        for what, measured, predicted in rows:
            err = (predicted - measured) / measured
            print(f"rank {rank} {what}: measured {measured / 2**20:.2f} MiB, modelled {predicted / 2**20:.2f} MiB "
                  f"({err:+.1%})")
    for rank, rows in enumerate(reports):
        for what, measured, predicted in rows:
            assert measured <= predicted / (1 - MARGIN), f"rank {rank} {what}: measured {measured} above the bound"
            assert abs(predicted - measured) <= CLOSE * measured, f"rank {rank} {what}: modelled {predicted}, measured {measured}"
