"""Weight formats of quantized frozen chunks (ARCHITECTURE.md, wave 3: weight format): the
kernels layer's half, torch only (it imports nothing from elastic_kernels.api, nor from ops/).

  blob.py   [Note: quantized chunk blob]: one opaque uint8 blob per chunk; a weight's image
            and its ChunkLayout (QuantizedLayout)
  nf4.py    NF4 exactly as bitsandbytes (codebook, blocks of 64, nibble order, double
            quantization of the scales), NF4ChunkFormat, quantize_nf4
  int8.py   blockwise symmetric int8 (ZeRO++ qwZ), Int8ChunkFormat, quantize_int8

Dequantization is the op family elastic::dequant_chunks* (elastic_kernels/ops/dequant.py).
"""

from elastic_kernels.quant._common import rows_multiple
from elastic_kernels.quant.blob import (
    FORMATS,
    ChunkFormat,
    QuantizedLayout,
    chunk_format,
    chunk_formats,
    default_block_size,
    quantize_chunk,
)
from elastic_kernels.quant.int8 import INT8_DEFAULT_BLOCK, Int8ChunkFormat, quantize_int8
from elastic_kernels.quant.nf4 import (
    DYNAMIC_CODE,
    NESTED_BLOCK,
    NF4_CODE,
    NF4_DEFAULT_BLOCK,
    NF4ChunkFormat,
    quantize_nf4,
)

__all__ = [
    "DYNAMIC_CODE",
    "FORMATS",
    "INT8_DEFAULT_BLOCK",
    "NESTED_BLOCK",
    "NF4_CODE",
    "NF4_DEFAULT_BLOCK",
    "ChunkFormat",
    "Int8ChunkFormat",
    "NF4ChunkFormat",
    "QuantizedLayout",
    "chunk_format",
    "chunk_formats",
    "default_block_size",
    "quantize_chunk",
    "quantize_int8",
    "quantize_nf4",
    "rows_multiple",
]
