"""Pure-torch references of the dequant ops (``elastic::dequant_chunks`` and
``elastic::dequant_chunks_into``): the meaning every fast impl must match bit for bit, and the
CPU default where the extension is absent (dequant.py [Note: which dequant impl runs]).

They decode each blob through its format's sections (``ChunkFormat.split``) with whole-tensor
torch ops, sharing no code with the kernels beyond the argument checks. The arithmetic, per
weight, is bitsandbytes' (nf4.py): ``fl32(NF4_CODE[code] * absmax)``, with nested scales
``absmax = fl32(fl32(DYNAMIC_CODE[q] * absmax2) + offset)`` (two torch ops, two roundings), and
for int8 ``fl32(q * step)``; then one round-to-nearest-even cast to the compute dtype.
"""

from __future__ import annotations

import torch

from elastic_kernels.ops._checks import check_dequant_args
from elastic_kernels.quant import NESTED_BLOCK, ChunkFormat, NF4ChunkFormat
from elastic_kernels.quant.nf4 import table


def dequant_chunk_fp32(blob: torch.Tensor, fmt: ChunkFormat) -> torch.Tensor:
    """The fp32 values [fmt.rows, fmt.cols] of one blob, before the cast to the compute dtype.
    Blocks run over the chunk's weights flattened (the last one may be partial): each weight
    is multiplied by its block's scale, ``scales[e // block_size]``."""
    parts = fmt.split(blob)
    n = fmt.numel
    if isinstance(fmt, NF4ChunkFormat):
        scales = parts["scales"]
        if fmt.nested:
            absmax2 = parts["nested_scales"].repeat_interleave(NESTED_BLOCK)[: fmt.num_blocks]
            scales = table("dynamic", blob.device)[scales.long()] * absmax2
            scales = scales + parts["offset"]  # bitsandbytes' `absmax += offset`: a separate rounding
        codes = parts["codes"]
        nf4 = table("nf4", blob.device)
        # element 2k is the high nibble of byte k, element 2k + 1 the low one (an odd count of
        # weights leaves the last low nibble unused)
        values = torch.stack([nf4[(codes >> 4).long()], nf4[(codes & 0x0F).long()]], dim=1).reshape(-1)[:n]
    else:
        values = parts["codes"].to(torch.float32)
        scales = parts["scales"]
    values = values * scales.repeat_interleave(fmt.block_size)[:n]
    return values.reshape(fmt.rows, fmt.cols)


def dequant_chunks_reference(blobs, fmt, rows, cols, rows_per_chunk, block_size, nested, dtype) -> torch.Tensor:
    """The weight [rows, cols] in ``dtype`` that the chunk blobs ``blobs`` hold, chunk after chunk."""
    formats = check_dequant_args(
        blobs, fmt, rows, cols, rows_per_chunk, block_size, nested, dtype, None, op="dequant_chunks_reference"
    )
    return torch.cat([dequant_chunk_fp32(b, f).to(dtype) for b, f in zip(blobs, formats)])


def dequant_chunks_into_reference(blobs, fmt, rows, cols, rows_per_chunk, block_size, nested, out) -> None:
    """``dequant_chunks_reference`` written into ``out`` [rows, cols] (its dtype is the compute dtype)."""
    formats = check_dequant_args(
        blobs, fmt, rows, cols, rows_per_chunk, block_size, nested, None, out, op="dequant_chunks_into_reference"
    )
    for c, (b, f) in enumerate(zip(blobs, formats)):
        r0 = c * rows_per_chunk
        out[r0 : r0 + f.rows].copy_(dequant_chunk_fp32(b, f))  # copy_ rounds to nearest even, as .to()
