"""A plan applied to a real model: the runtime does exactly what the plan says.

On a small Hugging Face Llama under convert_to_elastic (2 and 4 gloo ranks), plans with
arbitrary per-weight keep/persist counts, recomputed layers and micro-batch splits are applied
with `apply_plan`; each step's measured all-gather bytes must equal the plan's prediction
byte for byte, and the losses and adapter gradients must be bit-identical to the same model
under the default residency without recompute (residency and recompute never change a value),
computed chunk by chunk as the paged path does. A weight a plan keeps whole is held as a run
and computed in one GEMM ([Note: resident runs]): that changes the order of fp32 additions,
so a plan with runs is compared to fp32 rounding (a sum of <= 80 products per output, through
3 layers: 1e-4, as tests/nn/test_lora.py argues), its traffic still byte for byte.
The planner's own choice under a tight memory cap is checked the same way.
"""

from __future__ import annotations

import random

import pytest
import torch

from tests._dist import run_distributed

pytestmark = [pytest.mark.distributed, pytest.mark.needs_ext]

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
SEQ = 12


def _llama(seed=0):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=96, hidden_size=48, intermediate_size=80, num_hidden_layers=3,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                      tie_word_embeddings=False, use_cache=False)
    torch.manual_seed(seed)
    return LlamaForCausalLM(cfg).float()


def _elastic(seed=0, runs=True):
    """`runs` False: every weight in pages, computed chunk by chunk (the reference)."""
    from elastic_kernels.api import ElasticPolicy, LoRAConfig, convert_to_elastic

    model = convert_to_elastic(_llama(seed), LoRAConfig(r=4, alpha=8, target_modules=TARGETS, seed=3),
                               ElasticPolicy(chunk_bytes=48 * 4 * 5, all_reduce_grads=True, resident_runs=runs))
    with torch.no_grad():  # non-zero B, so the LoRA path carries gradient into every layer
        gen = torch.Generator().manual_seed(11)
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.05)
    model.train()
    return model


def _step(model, batches, accumulation):
    """One optimizer step's forward/backward over `accumulation` micro-batches (no update)."""
    from elastic_kernels.api import no_sync

    total = 0.0
    for a in range(accumulation):
        ctx = no_sync(model) if a < accumulation - 1 else torch.enable_grad()
        with ctx:
            loss = model(input_ids=batches[a], labels=batches[a]).loss
            (loss / accumulation).backward()
        total += loss.item()
    return total


def _grads(model):
    out = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
    for p in model.parameters():
        p.grad = None
    return out


def _random_choices(profile, rng, micro_batch):
    from elastic_kernels.api.planner.memory import Choices

    keep, persist = [], []
    for layer in profile.layers:
        ks, ps = [], []
        for w in layer.weights:
            k = rng.randint(0, w.chunks)
            ks.append(k)
            ps.append(rng.randint(0, k))
        keep.append(tuple(ks))
        persist.append(tuple(ps))
    recompute = tuple(rng.random() < 0.5 for _ in profile.layers)
    return Choices(micro_batch=micro_batch, keep=tuple(keep), persist=tuple(persist), recompute=recompute,
                   prefetch_depth=rng.randint(0, 2))


def _follow_worker(rank, world_size, n_plans):
    from elastic_kernels.api import reset_stats, stats
    from elastic_kernels.api.planner.search import least_memory, plan_from_profile, plan_of
    from elastic_kernels.api.planning.apply import apply_plan, recomputes
    from elastic_kernels.api.planning.measure import measure_profile

    per_rank = 2
    global_batch = per_rank * world_size
    gen = torch.Generator().manual_seed(100 + rank)
    planned, reference = _elastic(), _elastic(runs=False)
    profile_batch = torch.randint(0, 96, (per_rank, SEQ), generator=gen)
    profile = measure_profile(planned, [profile_batch], capacity_bytes=1 << 30)
    rng = random.Random(5)  # the same plans on every rank
    plans = [plan_of(profile, _random_choices(profile, rng, mb), memory_bytes=1 << 30, global_batch=global_batch)
             for mb in [1, 2] * (n_plans // 2)]
    # ...and the planner's own choice under a cap that leaves room for part of the weights.
    floor = plan_from_profile(profile, 1 << 30, global_batch, prefetch_depth=None)
    assert floor.kept_chunks == floor.total_chunks, "an ample cap keeps everything"
    # The tightest plan: at the least memory any plan fits in (feasibility is monotone).
    lo = least_memory(profile, global_batch, prefetch_depth=None)
    tight = plan_from_profile(profile, lo, global_batch, prefetch_depth=None)
    assert tight.to_dict() | {"planning_seconds": 0, "memory_bytes": 0} != \
        floor.to_dict() | {"planning_seconds": 0, "memory_bytes": 0}, "the tight plan is the ample one"
    plans.append(tight)
    report = []
    for i, plan in enumerate(plans):
        apply_plan(planned, plan)
        for layer in plan.layers:
            assert recomputes(planned.get_submodule(layer.name)) == layer.recompute
        from elastic_kernels.api import runtime_of

        assert runtime_of(planned).policy.prefetch_depth == plan.prefetch_depth
        measured = []
        rt = runtime_of(planned)
        for step in range(3):
            batch = torch.randint(0, 96, (plan.accumulation, plan.micro_batch, SEQ), generator=gen)
            reset_stats(planned)
            loss = _step(planned, batch, plan.accumulation)
            measured.append(stats(planned)["allgather_bytes"])
            runs = sum(et.run is not None for et in rt.tensors)
            whole = {et.name for et in rt.tensors if et.persist_chunks == et.num_chunks}
            # The plans' budgets hold every kept chunk: exactly the weights kept whole are runs.
            assert {et.name for et in rt.tensors if et.run is not None} == whole
            ref_loss = _step(reference, batch, plan.accumulation)
            g, r = _grads(planned), _grads(reference)
            if runs:
                assert abs(loss - ref_loss) <= 1e-4 * abs(ref_loss), f"plan {i} step {step}: loss {loss} vs {ref_loss}"
                for name in g:
                    torch.testing.assert_close(g[name], r[name], rtol=1e-4, atol=1e-4,
                                               msg=f"plan {i} step {step}: gradient of {name}")
                continue
            assert loss == ref_loss, f"plan {i} step {step}: loss {loss} != reference {ref_loss}"
            for name in g:
                assert torch.equal(g[name], r[name]), f"plan {i} step {step}: gradient of {name} differs"
        report.append((measured, plan.predicted_allgather_bytes_per_step, sum(lp.recompute for lp in plan.layers),
                       runs))
    return report


@pytest.mark.parametrize("world_size,n_plans", [(2, 6), (4, 2)])
def test_runtime_follows_the_plan(world_size, n_plans):
    reports = run_distributed(_follow_worker, world_size, n_plans, timeout=600)
    for measured, predicted, _, _ in reports[0]:
        assert measured[1:] == [predicted] * 2, f"all-gather bytes per step {measured}, plan predicts {predicted}"
    assert any(rec for _, _, rec, _ in reports[0]), "no plan recomputed a layer"
    assert any(runs for *_, runs in reports[0]), "no plan kept a weight whole (no run)"
    assert all(r == reports[0] for r in reports[1:])


def _recompute_worker(rank, world_size):
    """The same residency with and without recompute: the extra bytes are the plan's."""
    import dataclasses

    from elastic_kernels.api import reset_stats, stats
    from elastic_kernels.api.planner.search import plan_of
    from elastic_kernels.api.planning.apply import apply_plan
    from elastic_kernels.api.planning.measure import measure_profile

    gen = torch.Generator().manual_seed(7 + rank)
    model = _elastic()
    profile = measure_profile(model, [torch.randint(0, 96, (2, SEQ), generator=gen)], capacity_bytes=1 << 30)
    rng = random.Random(9)
    choices = _random_choices(profile, rng, 2)
    out = {}
    for rec in (False, True):
        c = dataclasses.replace(choices, recompute=tuple([rec] * len(profile.layers)))
        plan = plan_of(profile, c, memory_bytes=1 << 30, global_batch=2 * world_size)
        apply_plan(model, plan)
        g0 = torch.Generator().manual_seed(42 + rank)
        for step in range(3):
            batch = torch.randint(0, 96, (1, 2, SEQ), generator=g0)
            reset_stats(model)
            loss = _step(model, batch, 1)
            out.setdefault(rec, []).append((loss, _grads(model), stats(model)["allgather_bytes"]))
        out[rec, "predicted"] = plan.predicted_allgather_bytes_per_step
    for (l0, g0_, _), (l1, g1, _) in zip(out[False], out[True]):
        assert l0 == l1
        for name in g0_:
            assert torch.equal(g0_[name], g1[name]), f"recompute changed the gradient of {name}"
    measured = [b for _, _, b in out[True]][1:], [b for _, _, b in out[False]][1:]
    return measured, out[True, "predicted"], out[False, "predicted"]


def test_planned_recompute_is_exact():
    reports = run_distributed(_recompute_worker, 2, timeout=400)
    (with_rec, without), predicted_rec, predicted_plain = reports[0]
    assert with_rec == [predicted_rec] * 2 and without == [predicted_plain] * 2, reports[0]
    assert predicted_rec > predicted_plain, "recompute of a layer with TRANSIENT chunks gathers them again"
