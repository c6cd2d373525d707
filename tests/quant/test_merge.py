"""Merging adapters into a quantized base, and state dicts of a quantized model."""

from __future__ import annotations

import pytest
import torch

from tests._dist import run_distributed
from tests.quant._models import TARGETS, dequantized, quant_llama


def _block(fmt):
    return 64 if fmt == "int8" else None  # int8's default 256 divides no row of this model


def _convert(fmt, nested):
    from elastic_kernels.api import ElasticPolicy
    from elastic_kernels.api.nn import LoRAConfig, convert_to_elastic, lora_layers

    model = quant_llama()
    base = {k: v.clone() for k, v in model.state_dict().items()}
    policy = ElasticPolicy(chunk_bytes=64 * 4 * 7, weight_format=fmt, quant_nested=nested,
                           quant_block_size=_block(fmt))
    elastic = convert_to_elastic(model, LoRAConfig(r=4, alpha=8, target_modules=TARGETS), policy)
    gen = torch.Generator().manual_seed(5)
    for _, layer in lora_layers(elastic):
        with torch.no_grad():
            layer.lora_B.weight.copy_(torch.randn(layer.lora_B.weight.shape, generator=gen) * 0.1)
    return elastic, base, policy


def _merge_worker(rank, world_size, fmt, nested):
    from elastic_kernels.api.nn import lora_layers, merge_adapters

    elastic, base, policy = _convert(fmt, nested)
    expected = {}
    for name, layer in lora_layers(elastic):
        w = base[f"{name}.weight"]
        deq = dequantized(w, policy.rows_per_chunk(w.shape[1] * 4), fmt, _block(fmt), nested)
        delta = (layer.lora_B.weight.double() @ layer.lora_A.weight.double()) * layer.scaling
        expected[name] = (deq.double() + delta).to(w.dtype)
    sd = elastic.state_dict()
    for name in expected:  # the state dict holds the dequantized base
        w = base[f"{name}.weight"]
        assert torch.equal(sd[f"{name}.weight"], dequantized(w, policy.rows_per_chunk(w.shape[1] * 4), fmt, _block(fmt), nested))
    with pytest.warns(UserWarning, match=rf"Merging LoRA into {fmt}-quantized base weights"):
        merged = merge_adapters(elastic)
    for name, want in expected.items():
        got = merged.get_submodule(name).weight
        assert isinstance(merged.get_submodule(name), torch.nn.Linear)
        assert torch.equal(got, want), name
    return True


@pytest.mark.parametrize("fmt,nested", [("nf4", False), ("nf4", True), ("int8", False)])
@pytest.mark.parametrize("world_size", [1, 2])
def test_merge_dequantizes_then_adds_the_delta(world_size, fmt, nested):
    assert run_distributed(_merge_worker, world_size, fmt, nested, timeout=240) == [True] * world_size


def test_load_state_dict_requantizes():
    """Loading full-precision weights into a quantized model stores them quantized: the layer
    then computes with their dequantized values (the shard is the image of the new values)."""
    from elastic_kernels.api.nn import lora_layers

    elastic, base, policy = _convert("nf4", False)
    name, layer = lora_layers(elastic)[0]
    new = torch.randn(base[f"{name}.weight"].shape, generator=torch.Generator().manual_seed(9))
    sd = elastic.state_dict()
    sd[f"{name}.weight"] = new
    elastic.load_state_dict(sd)
    et = layer.et
    assert torch.equal(et.shard, et.storage.shard(et.qlayout.quantize(new), 0, padded=False))  # no padding
    assert torch.equal(elastic.state_dict()[f"{name}.weight"],
                       dequantized(new, policy.rows_per_chunk(new.shape[1] * 4), "nf4", None, False))
