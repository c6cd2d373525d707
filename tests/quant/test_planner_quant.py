"""The planner on a quantized model: its byte counts come from the runtime's tensors
(python_api/planning/measure.py reads et.slice_bytes / et.page_bytes / the pool's page), which
are the quantized chunk's, so a plan's predicted all-gather bytes are the measured ones."""

from __future__ import annotations

import pytest
import torch

from tests._dist import run_distributed
from tests.quant._models import quant_llama
from tests.quant.test_runtime_quant import _blob_bytes

pytestmark = [pytest.mark.distributed, pytest.mark.needs_ext]

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
SEQ = 12


def _worker(rank, world_size):
    from python_api import ElasticPolicy, reset_stats, stats
    from python_api.nn import LoRAConfig, convert_to_elastic
    from python_api.planner.memory import Choices
    from python_api.planner.search import plan_of
    from python_api.planning.apply import apply_plan
    from python_api.planning.measure import measure_profile

    model = convert_to_elastic(quant_llama(), LoRAConfig(r=4, alpha=8, target_modules=TARGETS, seed=3),
                               ElasticPolicy(chunk_bytes=64 * 4 * 5, weight_format="nf4"))
    with torch.no_grad():
        gen = torch.Generator().manual_seed(11)
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.05)
    model.train()
    gen = torch.Generator().manual_seed(100 + rank)
    profile = measure_profile(model, [torch.randint(0, 64, (2, SEQ), generator=gen)], capacity_bytes=1 << 30)
    sizes = [(w.name, w.chunks, w.slice_bytes, w.chunk_bytes, w.last_chunk_bytes)
             for layer in profile.layers for w in layer.weights]
    # Half of each weight's chunks kept to backward, none across steps (so every step gathers):
    # the planner's prediction from the profile's (quantized) byte counts.
    choices = Choices(micro_batch=2, keep=tuple(tuple(w.chunks // 2 for w in layer.weights) for layer in profile.layers),
                      persist=tuple(tuple(0 for _ in layer.weights) for layer in profile.layers),
                      recompute=tuple(False for _ in profile.layers), prefetch_depth=1)
    plan = plan_of(profile, choices, memory_bytes=1 << 30, global_batch=2 * world_size)
    apply_plan(model, plan)
    measured = []
    for _ in range(3):
        batch = torch.randint(0, 64, (plan.accumulation, plan.micro_batch, SEQ), generator=gen)
        reset_stats(model)
        for a in range(plan.accumulation):
            model(input_ids=batch[a], labels=batch[a]).loss.backward()
        measured.append(stats(model)["allgather_bytes"])
    return sizes, measured, plan.predicted_allgather_bytes_per_step, plan.kept_chunks, plan.total_chunks


def test_plan_on_quantized_weights_predicts_the_measured_bytes():
    (sizes, measured, predicted, kept, total), _ = run_distributed(_worker, 2, timeout=600)
    rows_per_chunk = 5
    for name, chunks, slice_bytes, chunk_bytes, last in sizes:
        cols = 128 if name.endswith("down_proj") else 64
        rpc = rows_per_chunk * 64 // cols  # chunk_bytes = 5 fp32 rows of a 64-wide weight
        assert chunk_bytes == _blob_bytes("nf4", None, False, rpc, cols), name
        assert slice_bytes == -(-chunk_bytes // 2), name
    assert kept < total
    assert measured[1:] == [predicted] * 2 and predicted > 0, (measured, predicted)
