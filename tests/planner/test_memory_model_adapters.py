"""The memory model with K adapters against measurement (issue 29: "the planner's memory model
predicts [the K-adapter job's peak] within 10%"), on the CLI's demo model (embedded Llama,
4 layers, hidden 256, 128-token sequences) on 2 gloo ranks, as tests/planner/test_memory_model.py
does for one adapter.

The profile is measured on a ONE-adapter model ([Note: several adapters in the models]: a
profile describes one adapter); that model is then dropped and a model with K = 4 adapters
(the same targets and rank) is built, and each regime's plan for K = 4 (`plan_of` with
`Choices.num_adapters = 4`: activations of 4 x micro_batch rows, three more adapters' state)
is applied to it and its step measured: `adapter_names` gives each adapter `micro_batch`
rows. Measured peak: `measure_peak_bytes` (tensor memory, as in test_memory_model.py).

Tolerance 10%, two-sided: the issue's bound; what the model cannot see is the same allocator
and gloo transients as with one adapter, plus the per-adapter grouping of the LoRA terms (the
rows of each adapter gathered for its product: a transient of one adapter's rows).
Neither regime keeps a weight whole, so no weight is a resident run.
"""

from __future__ import annotations

import pytest
import torch

from tests._dist import run_distributed

pytestmark = [pytest.mark.distributed, pytest.mark.needs_ext]

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
SEQ, MB, K = 128, 2, 4
TOLERANCE = 0.10


def _one_adapter_profile(cfg, lora, policy, gen):
    """The profile of the one-adapter model, and a weak reference to its runtime (in a function
    of its own: the model must not stay reachable from a frame's locals once it returns)."""
    import weakref

    from elastic_kernels.api import convert_to_elastic
    from elastic_kernels.api.finetune.models import embedded_model
    from elastic_kernels.api.nn.convert import runtime_of
    from elastic_kernels.api.planning.measure import measure_profile

    one = convert_to_elastic(embedded_model(cfg, 0), lora, policy)
    one.train()
    profile = measure_profile(one, [torch.randint(0, cfg.vocab_size, (MB, SEQ), generator=gen)],
                              capacity_bytes=1 << 30)
    return weakref.ref(runtime_of(one)), profile


def _worker(rank, world_size):
    import dataclasses
    import gc

    from elastic_kernels.api import ElasticPolicy, LoRAConfig, convert_to_elastic
    from elastic_kernels.api.finetune.models import embedded_config, embedded_model
    from elastic_kernels.api.planner.memory import Choices
    from elastic_kernels.api.planner.search import plan_of
    from elastic_kernels.api.planning.apply import apply_plan
    from elastic_kernels.api.planning.peaks import measure_peak_bytes

    torch.set_num_threads(1)
    cfg = embedded_config(256, 688, 4, 8, 4)
    policy = ElasticPolicy(chunk_bytes=256 << 10)
    lora = LoRAConfig(r=8, alpha=16, target_modules=TARGETS)
    gen = torch.Generator().manual_seed(rank)

    gone, profile = _one_adapter_profile(cfg, lora, policy, gen)
    gc.collect()
    assert gone() is None, "the one-adapter model's runtime outlived it: its tensors would count in the peak"

    names = [f"a{i}" for i in range(K)]
    model = convert_to_elastic(embedded_model(cfg, 0), {n: lora for n in names}, policy)
    model.train()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-5)
    layers = profile.layers
    half = tuple(i % 2 == 1 and layer.recomputable for i, layer in enumerate(layers))
    regimes = {
        "micro-batch 1, keep nothing": Choices.uniform(profile, 1, 0.0, num_adapters=K),
        "micro-batch 1, keep half, recompute odd layers": dataclasses.replace(
            Choices.uniform(profile, 1, 0.5, num_adapters=K), recompute=half),
    }
    out = {}
    for label, choices in regimes.items():
        plan = plan_of(profile, choices, memory_bytes=1 << 30, global_batch=world_size)
        assert plan.num_adapters == K
        rows = [n for n in names for _ in range(plan.micro_batch)]  # micro_batch sequences per adapter
        ids = torch.randint(0, cfg.vocab_size, (len(rows), SEQ), generator=gen)

        def step():
            model(input_ids=ids, labels=ids, adapter_names=rows).loss.backward()

        apply_plan(model, plan)
        for _ in range(3):  # warm: the pool reaches its size, AdamW creates every adapter's state
            step()
            opt.step()
            opt.zero_grad(set_to_none=True)
        # The peak of three steps: whether the next layer's prefetch is in flight at the peak
        # moment follows the ranks' timing (about 3 MiB here, seen both ways from one run to
        # the next); the model counts it, as a peak it can reach.
        measured = max(measure_peak_bytes(model, step) for _ in range(3))
        opt.zero_grad(set_to_none=True)
        one_adapter = plan_of(profile, dataclasses.replace(choices, num_adapters=1), memory_bytes=1 << 30,
                              global_batch=world_size)
        out[label] = (plan.predicted_peak_bytes, measured, one_adapter.predicted_peak_bytes)
    return out


def test_memory_model_predicts_the_k_adapter_peak():
    """The model predicts the peak of the rank that holds the most (the profile's static bytes
    are the maximum over ranks; since shards hold no padding, a rank whose slices of the ragged
    last chunks are short holds less: here rank 1, about 1 MiB), so its prediction is set
    against the largest measured peak of the ranks."""
    reports = run_distributed(_worker, 2, timeout=900)
    for name in reports[0]:
        predicted, one = reports[0][name][0], reports[0][name][2]
        assert all(r[name][0] == predicted for r in reports)  # one plan, one prediction on every rank
        measured = max(r[name][1] for r in reports)
        err = (predicted - measured) / measured
        print(f"{name}, {K} adapters: predicted peak {predicted / 2**20:.2f} MiB, measured (the largest of "
              f"{', '.join(f'{r[name][1] / 2**20:.2f}' for r in reports)} MiB) {measured / 2**20:.2f} MiB "
              f"({err:+.1%}); one adapter predicted {one / 2**20:.2f} MiB")
        assert predicted > one  # the other adapters' rows and state are counted
        assert abs(err) <= TOLERANCE, f"{name}: predicted {predicted}, measured {measured} ({err:+.1%})"
