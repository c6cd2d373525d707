"""Dequantizing the chunks of one use into the compute dtype ([Note: quantized frozen weights]
in python_api/quant/__init__.py).

[Note: the dequant workspace]
A use of a quantized weight dequantizes its chunks once, right before the GEMM, into a buffer
the runtime keeps and recycles: one flat buffer per (device, dtype), grown to the largest
weight asked for and never shrunk (its size is one dequantized weight, what FSDP2 would hold
unsharded for the layer running). The layers consume the dequantized chunks inside the use
and keep nothing of them (the paged ops save no weight; the chunk-by-chunk path writes y or
dx as it goes), so the next use may overwrite the buffer: on CPU the ops have returned; on a
GPU every reader and the next writer are on the compute stream, so stream order makes the
reuse safe with no sync. A use that must outlive the next one (none today) would need its
own buffer: `dequantize_use(..., out=None)` allocates one.
"""

from __future__ import annotations

import torch

from elastic_kernels import dequantize
from elastic_kernels.quant import QuantizedLayout


class DequantWorkspace:
    """The recycled buffers of [Note: the dequant workspace]: `get(numel, dtype, device)`."""

    def __init__(self):
        self._buffers: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}

    def get(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A 1-D tensor of `numel` elements (a view of the recycled buffer)."""
        key = (torch.device(device), dtype)
        buf = self._buffers.get(key)
        if buf is None or buf.numel() < numel:
            buf = torch.empty(numel, dtype=dtype, device=device)
            self._buffers[key] = buf
        return buf[:numel]

    @property
    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self._buffers.values())


def dequantize_use(qlayout: QuantizedLayout, blobs: list[torch.Tensor], dtype: torch.dtype,
                   workspace: DequantWorkspace | None, first_chunk: int = 0) -> list[torch.Tensor]:
    """The chunks `first_chunk`, ... of a quantized weight held by `blobs` (its pages, in
    order), dequantized in one call into `dtype` ([rows of each chunk, cols] views of one
    [rows, cols] tensor, in the workspace when given)."""
    if not blobs:
        return []
    formats = qlayout.formats
    n = len(blobs)
    last = first_chunk + n - 1
    chunk_rows = [formats[c].rows for c in range(first_chunk, last + 1)]
    rows = sum(chunk_rows)
    device = blobs[0].device
    if workspace is None:
        out = torch.empty(rows, qlayout.cols, dtype=dtype, device=device)
    else:
        out = workspace.get(rows * qlayout.cols, dtype, device).view(rows, qlayout.cols)
    dequantize([b.reshape(-1) for b in blobs], formats[0], rows, dtype=dtype, out=out)
    return list(out.split(chunk_rows))
