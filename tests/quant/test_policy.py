"""ElasticPolicy's weight format fields: their checks, and the errors a weight that cannot be
stored in the format gets before anything is sharded or gathered."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from elastic_kernels.api import ElasticPolicy
from elastic_kernels.api.config import DEFAULT_QUANT_BLOCK, MAX_QUANT_BLOCK, MIN_QUANT_BLOCK, WEIGHT_FORMATS


def test_policy_constants_are_the_kernels_layers():
    """config.py repeats the kernels layer's formats and block limits (it stays torch-free)."""
    from elastic_kernels.quant import FORMATS, default_block_size
    from elastic_kernels.quant._common import MAX_BLOCK, MIN_BLOCK

    assert WEIGHT_FORMATS == FORMATS
    assert {f: default_block_size(f) for f in FORMATS} == DEFAULT_QUANT_BLOCK
    assert (MIN_QUANT_BLOCK, MAX_QUANT_BLOCK) == (MIN_BLOCK, MAX_BLOCK)


def test_default_is_unquantized():
    p = ElasticPolicy()
    assert p.weight_format is None and p.block_size is None and p.quant_nested is False
    assert ElasticPolicy(weight_format="nf4").block_size == 64
    assert ElasticPolicy(weight_format="int8").block_size == 256
    assert ElasticPolicy(weight_format="int8", quant_block_size=128).block_size == 128


@pytest.mark.parametrize("kwargs,match", [
    (dict(weight_format="fp8"), r"weight_format must be None or one of \['nf4', 'int8'\], got 'fp8'"),
    (dict(weight_format="NF4"), r"weight_format must be None or one of"),
    (dict(weight_format="nf4", quant_block_size=48), r"quant_block_size must be None or a power of two in \[32, 4096\], got 48"),
    (dict(weight_format="nf4", quant_block_size=16), r"power of two in \[32, 4096\], got 16"),
    (dict(weight_format="int8", quant_block_size=8192), r"got 8192"),
    (dict(weight_format="nf4", quant_block_size=True), r"got True"),
    (dict(weight_format="int8", quant_nested=True), r"quant_nested is an nf4 option"),
    (dict(weight_format="nf4", quant_nested=1), r"quant_nested must be True or False"),
    (dict(quant_block_size=64), r"set without a weight_format"),
    (dict(quant_nested=True), r"set without a weight_format"),
    (dict(weight_format="nf4", quant_skip_modules="lm_head"), r"quant_skip_modules must be None or a list of module"),
    (dict(weight_format="nf4", quant_skip_modules=["lm_head", ""]), r"quant_skip_modules must be None or a list"),
    (dict(weight_format="nf4", quant_skip_modules=[".lm_head"]), r"quant_skip_modules must be None or a list"),
])
def test_bad_policy(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ElasticPolicy(**kwargs)


def test_check_quantizable_names_weight_and_shape():
    p = ElasticPolicy(weight_format="nf4")
    p.check_quantizable("w", (10, 128))
    p.check_quantizable("layers.0.up", (10, 96))  # any row length (issue 28): blocks over the flattened weight
    with pytest.raises(ValueError, match=r"bias: weight_format='nf4' stores 2-D weights .* shape \(10,\)"):
        p.check_quantizable("bias", (10,))
    ElasticPolicy().check_quantizable("anything", (3, 5))  # no format: nothing to check


def test_weight_rows_per_chunk_holds_whole_blocks():
    """A quantized weight's chunks hold whole blocks: rows_per_chunk rounded down to a multiple
    of block / gcd(row length, block), up to one multiple when fewer rows fit, at most the rows."""
    from elastic_kernels.api.config import quant_rows_multiple
    from elastic_kernels.quant import rows_multiple

    p = ElasticPolicy(weight_format="nf4", chunk_bytes=688 * 2 * 6)
    assert p.weight_rows_per_chunk("down", (2048, 688), 688 * 2) == 4  # 6 fit; 64 / gcd(688, 64) = 4
    assert p.weight_rows_per_chunk("up", (688, 2048), 2048 * 2) == 2  # 2 fit; 64 divides the row
    assert p.weight_rows_per_chunk("odd", (100, 687), 687 * 2) == 64  # 64 / gcd(687, 64): more than fit
    assert p.weight_rows_per_chunk("odd", (10, 687), 687 * 2) == 10  # one chunk, its last block partial
    assert ElasticPolicy(chunk_bytes=688 * 2 * 6).weight_rows_per_chunk("down", (2048, 688), 688 * 2) == 6
    i8 = ElasticPolicy(weight_format="int8", chunk_bytes=688 * 2 * 40)
    assert i8.weight_rows_per_chunk("down", (2048, 688), 688 * 2) == 32  # 256 / gcd(688, 256) = 16
    for cols in (1, 33, 66, 688, 687, 4096, 4097):
        for block in (32, 64, 256, 4096):
            assert quant_rows_multiple(cols, block) == rows_multiple(cols, block)


class _Two(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(64, 32)
        self.b = nn.Linear(32, 48)  # row length 32: two rows per block of 64


def test_any_row_length_converts():
    """Issue 28: a row length the block does not divide converts (before, it was refused by
    name); its chunks are rounded to whole blocks and it dequantizes to bitsandbytes' values."""
    from elastic_kernels.api.nn import LoRAConfig, convert_to_elastic
    from tests.kernels.test_quant import bits_equal, bnb_dequant_chunks

    torch.manual_seed(0)
    w = _Two().b.weight.detach().clone()
    for chunk_rows, rpc in ((5, 4), (1, 2)):  # 5 fp32 rows fit: 4; 1 fits: 2 (a chunk holds a whole block)
        torch.manual_seed(0)
        model = _Two()
        model = convert_to_elastic(model, LoRAConfig(r=2, alpha=4, target_modules=("b",)),
                                   ElasticPolicy(weight_format="nf4", chunk_bytes=32 * 4 * chunk_rows))
        et = model.b.et
        assert (et.layout.rows_per_chunk, et.qlayout.rows_per_chunk, et.num_chunks) == (rpc, rpc, 48 // rpc)
        assert bits_equal(model._elastic_runtime.full_weight(et), bnb_dequant_chunks(w, rpc, False, torch.float32))


def test_block_that_divides_every_row_converts():
    from elastic_kernels.api.nn import LoRAConfig, convert_to_elastic

    model = convert_to_elastic(_Two(), LoRAConfig(r=2, alpha=4, target_modules=("a", "b")),
                               ElasticPolicy(weight_format="nf4", quant_block_size=32))
    et = model.b.et
    assert et.weight_format == "nf4" and et.qlayout.block_size == 32 and et.shard.dtype == torch.uint8
    assert et.nbytes == et.qlayout.total_bytes == 48 * 32 // 2 + 4 * 48 * 32 // 32


def test_quant_skip_modules_matches_whole_components():
    default = ElasticPolicy(weight_format="nf4")
    assert not default.quantizes("lm_head") and not default.quantizes("model.lm_head")
    assert default.quantizes("lm_head_2") and default.quantizes("model.layers.0.mlp.down_proj")
    p = ElasticPolicy(weight_format="nf4", quant_skip_modules=["mlp.down_proj", "model.layers.1"])
    assert p.quant_skip_modules == ("mlp.down_proj", "model.layers.1")  # a tuple: the policy stays hashable
    assert not p.quantizes("model.layers.0.mlp.down_proj") and not p.quantizes("model.layers.1.mlp.up_proj")
    assert p.quantizes("model.layers.0.mlp.up_proj") and p.quantizes("model.layers.10.mlp.up_proj")
    assert p.quantizes("lm_head")  # a list replaces the default
    assert ElasticPolicy(weight_format="nf4", quant_skip_modules=[]).quantizes("lm_head")
    assert not ElasticPolicy().quantizes("model.layers.0.mlp.up_proj")  # no format


def test_output_layer_stays_full_precision_by_default():
    """As bitsandbytes and PEFT's QLoRA: the output layer (found by get_output_embeddings, not
    by its name) stays full precision and elastic; [] quantizes it too; named modules stay too."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from elastic_kernels.api.nn import LoRAConfig, convert_to_elastic

    def model():
        torch.manual_seed(0)
        m = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False))
        return m.float().eval()

    def formats(m):
        return {et.name: et.weight_format for et in m._elastic_runtime.tensors}

    lora = LoRAConfig(r=2, alpha=4, target_modules=("q_proj", "v_proj"))
    plain = model()
    head = plain.lm_head.weight.detach().clone()
    m = convert_to_elastic(plain, lora, ElasticPolicy(weight_format="nf4", replicate_below_bytes=0))
    f = formats(m)
    assert f.pop("lm_head") is None and set(f.values()) == {"nf4"} and len(f) == 2 * 7, f
    assert m._elastic_runtime.policy.quant_skip_modules == ("lm_head",)
    assert torch.equal(m.state_dict()["lm_head.weight"], head)  # as it was, not requantized
    assert set(formats(convert_to_elastic(model(), lora, ElasticPolicy(
        weight_format="nf4", replicate_below_bytes=0, quant_skip_modules=[]))).values()) == {"nf4"}
    f = formats(convert_to_elastic(model(), lora, ElasticPolicy(
        weight_format="int8", quant_block_size=64, replicate_below_bytes=0, quant_skip_modules=["down_proj", "lm_head"])))
    assert {n for n, v in f.items() if v is None} == {"lm_head", "model.layers.0.mlp.down_proj",
                                                      "model.layers.1.mlp.down_proj"}, f
    # Another name: found as the output embeddings.
    other = model()
    other.output = other.lm_head
    del other.lm_head
    other.get_output_embeddings = lambda: other.output
    f = formats(convert_to_elastic(other, lora, ElasticPolicy(weight_format="nf4", replicate_below_bytes=0)))
    assert f["output"] is None and set(v for n, v in f.items() if n != "output") == {"nf4"}, f
