"""Models and references shared by the tests of the quant room."""

from __future__ import annotations

import torch

from elastic_kernels import dequantize
from elastic_kernels.quant import QuantizedLayout

# Every projection's row length (64 or 128) is a multiple of nf4's 64 and of the int8 block
# used below; the 7-row chunks divide none of the weights (ragged last chunks everywhere).
HIDDEN, INTER = 64, 128
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")


def quant_llama(seed: int = 0):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=64, hidden_size=HIDDEN, intermediate_size=INTER, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    return LlamaForCausalLM(cfg).float().eval()


def dequantized(w: torch.Tensor, rows_per_chunk: int, fmt: str, block: int | None, nested: bool) -> torch.Tensor:
    """The values a weight stored in `fmt` computes with: each chunk of `rows_per_chunk` rows
    quantized alone and dequantized to the weight's dtype (the kernels layer's quantizer and
    dequantizer, each checked against bitsandbytes or the int8 reference in tests/kernels)."""
    ql = QuantizedLayout(w.shape[0], w.shape[1], rows_per_chunk, fmt, block, nested)
    return dequantize(ql.blobs(ql.quantize(w)), ql.formats[0], w.shape[0], dtype=w.dtype)


def dequantize_model_(model, names, rows_per_chunk_of, fmt, block, nested) -> None:
    """Replace the weights of the linears `names` by their dequantized values, in place."""
    with torch.no_grad():
        for name in names:
            lin = model.get_submodule(name)
            lin.weight.copy_(dequantized(lin.weight, rows_per_chunk_of(lin.weight), fmt, block, nested))
