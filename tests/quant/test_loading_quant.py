"""Quantize on load (`load_elastic` with a weight_format): each rank quantizes its shard from
the rows it reads of the fp32/bf16 safetensors files, bit for bit what quantizing after an
in-memory conversion gives."""

from __future__ import annotations

import pytest
import torch

from tests._dist import run_distributed
from tests.quant._models import TARGETS, quant_llama

FORMATS = [("nf4", None, False), ("nf4", None, True), ("int8", 64, False)]


def _save(path, file_dtype):
    model = quant_llama().to(file_dtype)
    model.save_pretrained(path, safe_serialization=True, max_shard_size="60KB")  # several files


def _worker(rank, world_size, path, fmt, block, nested, load_dtype):
    from transformers import LlamaForCausalLM

    from python_api import ElasticPolicy, load_elastic
    from python_api.nn import LoRAConfig, convert_to_elastic

    lora = LoRAConfig(r=4, alpha=8, target_modules=TARGETS)
    policy = ElasticPolicy(chunk_bytes=64 * 4 * 7, weight_format=fmt, quant_block_size=block, quant_nested=nested,
                           replicate_below_bytes=0)
    loaded = load_elastic(path, lora, policy, dtype=load_dtype)
    in_memory = convert_to_elastic(LlamaForCausalLM.from_pretrained(path, dtype=load_dtype).eval(), lora, policy)
    a, b = loaded._elastic_runtime, in_memory._elastic_runtime
    assert [et.name for et in a.tensors] == [et.name for et in b.tensors]
    for x, y in zip(a.tensors, b.tensors):
        assert x.qlayout == y.qlayout and x.qlayout is not None, x.name
        assert x.shard.dtype == torch.uint8 and torch.equal(x.shard, y.shard), f"rank {rank}: {x.name} shard differs"
    ids = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(3))
    la = loaded(input_ids=ids, labels=ids).loss
    lb = in_memory(input_ids=ids, labels=ids).loss
    assert torch.equal(la, lb)
    return len(a.tensors)


@pytest.mark.parametrize("fmt,block,nested", FORMATS, ids=["nf4", "nf4-nested", "int8-64"])
@pytest.mark.parametrize("file_dtype,load_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.float32),
                                                   (torch.bfloat16, torch.bfloat16)],
                         ids=["fp32", "bf16-as-fp32", "bf16"])
def test_quantize_on_load_equals_quantize_after_convert(tmp_path, file_dtype, load_dtype, fmt, block, nested):
    _save(str(tmp_path), file_dtype)
    counts = run_distributed(_worker, 2, str(tmp_path), fmt, block, nested, load_dtype, timeout=300)
    assert counts[0] == counts[1] == 2 * 7 + 1  # 7 linears per layer and lm_head, all quantized


def test_prequantized_checkpoint_is_refused_before_reading(tmp_path, monkeypatch):
    """A checkpoint whose config carries a quantization_config (as transformers writes for a
    bitsandbytes 4-bit model) is refused with a LoadError naming it, before any tensor is read."""
    import json

    from python_api import ElasticPolicy, load_elastic
    from python_api.loading import LoadError
    from python_api.loading.source import SafetensorsSource
    from python_api.nn import LoRAConfig

    _save(str(tmp_path), torch.float32)
    cfg_file = tmp_path / "config.json"
    cfg = json.loads(cfg_file.read_text())
    cfg["quantization_config"] = {"quant_method": "bitsandbytes", "load_in_4bit": True,
                                  "bnb_4bit_quant_type": "nf4", "bnb_4bit_use_double_quant": False}
    cfg_file.write_text(json.dumps(cfg))

    def no_reads(*a, **k):
        raise AssertionError("a tensor was read")

    monkeypatch.setattr(SafetensorsSource, "rows", no_reads)
    monkeypatch.setattr(SafetensorsSource, "tensor", no_reads)
    with pytest.raises(LoadError, match=r"saved quantized \(quantization_config: quant_method='bitsandbytes', "
                                        r"load_in_4bit=True, bnb_4bit_quant_type='nf4'\)"):
        load_elastic(str(tmp_path), LoRAConfig(r=4, alpha=8, target_modules=TARGETS),
                     ElasticPolicy(weight_format="nf4"))
