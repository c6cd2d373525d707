"""The real model (SmolLM2-135M-Instruct, 30 layers, tied embedding) on 2 gloo ranks against PEFT
in one process: `load_elastic` reads each rank's rows of the cached checkpoint, both models start
from the same adapters (B non-zero: B = 0 would hide the LoRA path from A's gradient), and two
SGD steps on one global batch give the same losses and adapter gradients.

Tolerances: fp32 (tests/nn/test_lora.py's TOL, rtol = atol = 1e-4): the elastic layers compute
x·Wᵀ in chunks of rows and add the LoRA term in another order than PEFT's dense layers, so the
two differ only in summation order, which after 30 layers is well below 1e-4 of the values
(the measured figures are printed). The gradient of rank r is its half's and the runtime averages
the halves across ranks; each half has the same number of predicted tokens, so the average is
the full batch's gradient, PEFT's. A wrong chunk, a missing LoRA term or a gradient not averaged
moves these by far more than 1e-4."""

from __future__ import annotations

import pytest
import torch

from tests._dist import run_distributed

pytestmark = [pytest.mark.distributed, pytest.mark.needs_ext]

TARGETS = ("q_proj", "v_proj")
R, ALPHA, LR, STEPS = 8, 16, 1e-2, 2
BATCH, SEQ = 4, 32  # the global batch; each of the 2 ranks trains BATCH // 2 rows


def _batch(model_dir: str) -> torch.Tensor:
    """The first SEQ tokens of BATCH topics of the Python reference (pydoc_data, shipped with
    CPython): text the model knows, so its loss is a pretrained model's."""
    from pydoc_data.topics import topics

    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    texts = [topics[k] for k in ("assert", "for", "lambda", "with")[:BATCH]]
    return torch.tensor([tok(t)["input_ids"][:SEQ] for t in texts])


def _adapter_values(names_shapes):
    """Fixed adapter values, the same on every rank and for PEFT."""
    gen = torch.Generator().manual_seed(7)
    return {n: (torch.randn(a, generator=gen) * 0.02, torch.randn(b, generator=gen) * 0.02) for n, a, b in names_shapes}


def _train(model, layers, ids):
    """STEPS plain SGD steps; (losses, {name: (grad A, grad B)} of every step)."""
    losses, grads = [], []
    params = [p for _, (a, b) in layers for p in (a, b)]
    for _ in range(STEPS):
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        losses.append(loss.detach().clone())
        grads.append({n: (a.grad.clone(), b.grad.clone()) for n, (a, b) in layers})
        with torch.no_grad():
            for p in params:
                p -= LR * p.grad
                p.grad = None
    return losses, grads


def _elastic_worker(rank, world_size, model_dir):
    import torch.distributed as dist

    from elastic_kernels.api import ElasticPolicy, load_elastic
    from elastic_kernels.api.nn import LoRAConfig, lora_layers

    model = load_elastic(model_dir, LoRAConfig(r=R, alpha=ALPHA, target_modules=TARGETS), ElasticPolicy(chunk_bytes=1 << 18))
    layers = [(n, (m.lora_A.weight, m.lora_B.weight)) for n, m in lora_layers(model)]
    values = _adapter_values([(n, a.shape, b.shape) for n, (a, b) in layers])
    with torch.no_grad():
        for n, (a, b) in layers:
            a.copy_(values[n][0])
            b.copy_(values[n][1])
    ids = _batch(model_dir)
    half = BATCH // world_size
    losses, grads = _train(model, layers, ids[rank * half:(rank + 1) * half])
    mean = torch.stack(losses)
    dist.all_reduce(mean)
    return (mean / world_size).tolist(), grads if rank == 0 else None


def test_real_model_two_ranks_match_peft(real_model):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    results = run_distributed(_elastic_worker, 2, real_model, timeout=900)
    losses, grads = results[0]
    assert results[1][0] == losses  # the averaged loss is the same on both ranks

    base = AutoModelForCausalLM.from_pretrained(real_model, dtype=torch.float32)
    peft = get_peft_model(base, LoraConfig(r=R, lora_alpha=ALPHA, target_modules=list(TARGETS), lora_dropout=0.0))
    layers = []
    for n in grads[0]:
        m = peft.base_model.model.get_submodule(n)
        layers.append((n, (m.lora_A["default"].weight, m.lora_B["default"].weight)))
    assert len(layers) == 2 * 30
    values = _adapter_values([(n, a.shape, b.shape) for n, (a, b) in layers])
    with torch.no_grad():
        for n, (a, b) in layers:
            a.copy_(values[n][0])
            b.copy_(values[n][1])
    ref_losses, ref_grads = _train(peft, layers, _batch(real_model))

    ref_losses = [x.item() for x in ref_losses]
    print(f"losses elastic {losses} PEFT {ref_losses}")
    assert 1.0 < ref_losses[0] < 5.0  # a pretrained model's loss on text it knows (ln 49152 = 10.8 untrained)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-4, atol=1e-4)
    worst = 0.0
    for step in range(STEPS):
        for n, (ga, gb) in ref_grads[step].items():
            for ours, ref, ab in zip(grads[step][n], (ga, gb), "AB"):
                scale = ref.abs().max().item()
                assert scale > 0, f"step {step + 1} {n}.lora_{ab}: zero gradient"
                worst = max(worst, (ours - ref).abs().max().item() / scale)
                torch.testing.assert_close(ours, ref, rtol=1e-4, atol=1e-4 * scale,
                                           msg=lambda m: f"step {step + 1} {n}.lora_{ab}: {m}")
    print(f"largest adapter-gradient difference / the gradient's largest value: {worst:.3g}")
