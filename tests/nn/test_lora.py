"""ElasticLoRALinear / convert_to_elastic against PEFT on a small LlamaForCausalLM.

fp32 tolerances: the elastic layer computes x·Wᵀ per chunk of rows and dx = Σ_chunks dy_c·W_c,
which differ from one whole GEMM only in summation order. With hidden sizes <= 48 and O(1)
activations, each output is a sum of <= 48 products: rounding differences stay below
~48 · 2^-24 · |sum of |terms|| ~ 1e-5 relative; losses and gradients pass through a few such
layers, so rtol = atol = 1e-4 leaves a factor of ~10 and still catches any wrong chunk, wrong
scaling or missing term (those change results at the 1e-2 level or more).
"""

from __future__ import annotations

import copy
import json
import os

import pytest
import torch
import torch.nn as nn

from tests._dist import run_distributed

pytestmark = [pytest.mark.distributed, pytest.mark.needs_ext]

TARGETS = ("q_proj", "v_proj", "down_proj")
TOL = dict(rtol=1e-4, atol=1e-4)


def tiny_llama(seed=0):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    return LlamaForCausalLM(cfg).float().eval()


def _peft_of(model, r, alpha, targets):
    from peft import LoraConfig, get_peft_model

    return get_peft_model(copy.deepcopy(model), LoraConfig(r=r, lora_alpha=alpha, target_modules=list(targets), lora_dropout=0.0))


def _copy_adapters_into_peft(elastic, peft_model, seed=7):
    """Give the elastic adapters random non-zero values (B = 0 would hide the LoRA path), and
    copy them into the PEFT model."""
    from elastic_kernels.api.nn import lora_layers

    gen = torch.Generator().manual_seed(seed)
    for name, layer in lora_layers(elastic):
        with torch.no_grad():
            layer.lora_B.weight.copy_(torch.randn(layer.lora_B.weight.shape, generator=gen) * 0.1)
        pm = peft_model.base_model.model.get_submodule(name)
        with torch.no_grad():
            pm.lora_A["default"].weight.copy_(layer.lora_A.weight)
            pm.lora_B["default"].weight.copy_(layer.lora_B.weight)


def _peft_worker(rank, world_size, policy_kwargs):
    from elastic_kernels.api import ElasticPolicy
    from elastic_kernels.api.nn import LoRAConfig, convert_to_elastic, lora_layers

    model = tiny_llama()
    peft_model = _peft_of(model, 4, 8, TARGETS)
    elastic = convert_to_elastic(model, LoRAConfig(r=4, alpha=8, target_modules=TARGETS), ElasticPolicy(**policy_kwargs))
    _copy_adapters_into_peft(elastic, peft_model)
    torch.manual_seed(3)  # same batch on every rank: averaged gradients equal each rank's own
    ids = torch.randint(0, 64, (2, 9))
    for it in range(2):
        out = elastic(input_ids=ids, labels=ids)
        ref = peft_model(input_ids=ids, labels=ids)
        torch.testing.assert_close(out.logits, ref.logits, **TOL)
        torch.testing.assert_close(out.loss, ref.loss, **TOL)
        out.loss.backward()
        ref.loss.backward()
        for name, layer in lora_layers(elastic):
            pm = peft_model.base_model.model.get_submodule(name)
            for ours, theirs in ((layer.lora_A.weight, pm.lora_A["default"].weight), (layer.lora_B.weight, pm.lora_B["default"].weight)):
                assert ours.grad is not None and theirs.grad is not None, name
                torch.testing.assert_close(ours.grad, theirs.grad, **TOL, msg=lambda m: f"{name}: {m}")
        with torch.no_grad():  # one SGD step on both, then compare again
            for name, layer in lora_layers(elastic):
                pm = peft_model.base_model.model.get_submodule(name)
                for ours, theirs in ((layer.lora_A.weight, pm.lora_A["default"].weight), (layer.lora_B.weight, pm.lora_B["default"].weight)):
                    ours -= 0.5 * ours.grad
                    theirs -= 0.5 * theirs.grad
                    ours.grad = theirs.grad = None
    return True


POLICIES = [
    dict(chunk_bytes=32 * 4 * 5),  # 5 rows per chunk: divides no projection of this model
    dict(chunk_bytes=32 * 4 * 8, keep_ratio=0.5, persist_ratio=0.0, pool_budget_bytes=0),
    dict(chunk_bytes=48 * 4 * 3, keep_ratio=1.0, persist_ratio=0.5, replicate_below_bytes=0),  # lm_head elastic too
]


@pytest.mark.parametrize("world_size,policy", [(1, POLICIES[0]), (2, POLICIES[1]), (2, POLICIES[2]), (4, POLICIES[0])])
def test_matches_peft(world_size, policy):
    assert run_distributed(_peft_worker, world_size, policy, timeout=240) == [True] * world_size


def _roundtrip_worker(rank, world_size, tmp):
    from peft import PeftModel

    from elastic_kernels.api import ElasticPolicy
    from elastic_kernels.api.nn import (
        ElasticLoRALinear,
        LoRAConfig,
        convert_to_elastic,
        load_adapter,
        merge_adapters,
        save_adapter,
    )

    policy = ElasticPolicy(chunk_bytes=32 * 4 * 6)
    lora = LoRAConfig(r=4, alpha=8, target_modules=TARGETS)
    elastic = convert_to_elastic(tiny_llama(), lora, policy)
    peft_model = _peft_of(tiny_llama(), 4, 8, TARGETS)
    _copy_adapters_into_peft(elastic, peft_model, seed=11)
    ids = torch.randint(0, 64, (2, 7), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        want = elastic(input_ids=ids).logits

    # elastic -> PEFT: PeftModel.from_pretrained on a plain model reproduces the logits.
    save_adapter(elastic, os.path.join(tmp, "ours"))
    loaded = PeftModel.from_pretrained(tiny_llama(), os.path.join(tmp, "ours"))
    with torch.no_grad():
        torch.testing.assert_close(loaded(input_ids=ids).logits, want, **TOL)

    # PEFT -> elastic: a PEFT-saved adapter loads into a fresh elastic model.
    if rank == 0:
        peft_model.save_pretrained(os.path.join(tmp, "theirs"))
    torch.distributed.barrier()
    fresh = convert_to_elastic(tiny_llama(), lora, policy)
    load_adapter(fresh, os.path.join(tmp, "theirs"))
    with torch.no_grad():
        torch.testing.assert_close(fresh(input_ids=ids).logits, peft_model(input_ids=ids).logits, **TOL)

    # Merged model: plain nn.Linear layers, same outputs.
    merged = merge_adapters(elastic)
    assert not any(isinstance(m, ElasticLoRALinear) for m in merged.modules())
    assert isinstance(merged.model.layers[0].self_attn.q_proj, nn.Linear)
    with torch.no_grad():
        torch.testing.assert_close(merged(input_ids=ids).logits, want, **TOL)

    # A file whose shapes do not fit: the error names the key; the model is unchanged.
    if rank == 0:
        bad = os.path.join(tmp, "bad")
        os.makedirs(bad, exist_ok=True)
        from safetensors.torch import load_file, save_file

        state = load_file(os.path.join(tmp, "ours", "adapter_model.safetensors"))
        key = "base_model.model.model.layers.1.mlp.down_proj.lora_A.weight"
        state[key] = torch.zeros(4, 5)
        save_file(state, os.path.join(bad, "adapter_model.safetensors"))
        with open(os.path.join(tmp, "ours", "adapter_config.json")) as f:
            cfg = json.load(f)
        with open(os.path.join(bad, "adapter_config.json"), "w") as f:
            json.dump(cfg, f)
    torch.distributed.barrier()
    before = [p.detach().clone() for p in fresh.parameters() if p.requires_grad]
    with pytest.raises(ValueError, match=r"down_proj\.lora_A\.weight.*shape \(4, 5\)"):
        load_adapter(fresh, os.path.join(tmp, "bad"))
    assert all(torch.equal(a, b) for a, b in zip(before, [p for p in fresh.parameters() if p.requires_grad]))
    return True


def test_adapter_round_trips_with_peft_and_merge(tmp_path):
    assert run_distributed(_roundtrip_worker, 2, str(tmp_path), timeout=240) == [True, True]


def _bad_input_worker(rank, world_size):
    from elastic_kernels.api import ElasticPolicy
    from elastic_kernels.api.nn import LoRAConfig, convert_to_elastic

    errors = {}
    try:
        convert_to_elastic(tiny_llama(), LoRAConfig(r=2, alpha=4, target_modules=("qkv_proj",)), ElasticPolicy())
    except ValueError as e:
        errors["targets"] = str(e)
    model = convert_to_elastic(tiny_llama(), LoRAConfig(r=2, alpha=4, target_modules=r".*\.(q|v)_proj"), ElasticPolicy())
    layer = model.model.layers[0].self_attn.q_proj
    try:
        layer(torch.randn(3, 32, dtype=torch.float64))
    except TypeError as e:
        errors["dtype"] = str(e)
    errors["regex_layers"] = sorted(n for n, m in model.named_modules() if type(m).__name__ == "ElasticLoRALinear")
    return errors


def test_bad_input():
    from elastic_kernels.api.nn import LoRAConfig

    with pytest.raises(ValueError, match="r must be a positive int"):
        LoRAConfig(r=0, alpha=8)
    with pytest.raises(ValueError, match="r must be a positive int"):
        LoRAConfig(r=-3, alpha=8)
    with pytest.raises(ValueError, match="not a valid regex"):
        LoRAConfig(r=2, alpha=8, target_modules="(")
    (errors,) = run_distributed(_bad_input_worker, 1, timeout=120)
    assert "matches no nn.Linear" in errors["targets"]
    for name in ("q_proj", "k_proj", "down_proj", "lm_head"):
        assert name in errors["targets"], errors["targets"]  # candidates are listed
    assert "input dtype torch.float64 differs" in errors["dtype"]
    assert errors["regex_layers"] == [f"model.layers.{i}.self_attn.{p}_proj" for i in (0, 1) for p in ("q", "v")]


def _init_worker(rank, world_size):
    from elastic_kernels.api import ElasticPolicy
    from elastic_kernels.api.nn import LoRAConfig, convert_to_elastic, lora_layers

    model = convert_to_elastic(tiny_llama(), LoRAConfig(r=4, alpha=8, target_modules="all-linear", seed=3), ElasticPolicy())
    names = [n for n, _ in lora_layers(model)]
    a = {n: l.lora_A.weight.detach().clone() for n, l in lora_layers(model)}
    b_zero = all(torch.count_nonzero(l.lora_B.weight) == 0 for _, l in lora_layers(model))
    trainable = sorted(n for n, p in model.named_parameters() if p.requires_grad)
    return names, a, b_zero, trainable


def test_init_all_linear_and_replication():
    (n0, a0, bz0, tr0), (n1, a1, bz1, tr1) = run_distributed(_init_worker, 2, timeout=120)
    assert "lm_head" not in " ".join(n0)  # PEFT's all-linear leaves the output layer out
    assert len(n0) == 2 * 7  # q, k, v, o, gate, up, down per layer
    assert bz0 and bz1
    for n in n0:
        assert torch.equal(a0[n], a1[n]), f"{n}: ranks built different adapters"
        bound = 1 / (48 ** 0.5 if n.endswith("down_proj") else 32 ** 0.5)
        assert a0[n].abs().max() <= bound and a0[n].std() > bound / 4  # U(-1/sqrt(in), 1/sqrt(in))
    assert tr0 == sorted(f"{n}.lora_{x}.weight" for n in n0 for x in "AB")
