"""Blockwise symmetric int8, as DeepSpeed ZeRO++'s quantized weights (qwZ).

Blocks of ``block_size`` consecutive weights of the chunk, flattened row-major, share one absmax
a (the last block partial when the block does not divide the chunk's weights: its absmax over
its own weights, as bitsandbytes' blockwise quantizers do); weight w becomes
``q = round_half_even(fl32(fl32(w / a) * 127))`` in [-127, 127] (0 for a block of zeros), and the
blob keeps the fp32 *step* ``d = fl32(a / 127)`` per block, so that dequantization is one
multiply: ``fl32(q * d)``, then rounded to the compute dtype (round to nearest even).

[Note: int8 block size]
``INT8_DEFAULT_BLOCK = 256``. The block trades bytes on the wire (4 bytes of step per block,
4 / block_size bytes per weight) against round-trip error (a larger block has a larger absmax,
so a coarser step). Measured on a Llama-like 1024 x 4096 weight (Student-t(5) values times 0.02,
columns scaled by exp(N(0, 0.3)); `python bench/bench_quant.py --threads 1 --error-sweep`,
bench/results/quant_int8_blocks.csv), relative RMS error by block: 32: 0.73%, 64: 0.88%,
128: 1.05%, 256: 1.24%, 512: 1.45%, 1024: 1.70%, 4096: 2.29%: each doubling costs ~17% more
error. At 256 the steps are 1.6% of the codes' bytes (8.125 bits per weight); going to 512
would save only 0.8% of the bytes for 17% more error, going to 128 would cost 1.6% more bytes
for 15% less error. 256 is the smallest block whose steps cost under 2% of the bytes. The C++
kernel's speed showed no trend with the block (1.2-3.8 GB/s single-threaded across 32-4096 on
the 2-core VM, non-monotonic: its noise), so throughput does not weigh in.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from elastic_kernels.quant._common import as_bytes, check_blob, check_block, check_weight, f32_copy

INT8_DEFAULT_BLOCK = 256
INT8_LEVELS = 127


@dataclass(frozen=True)
class Int8ChunkFormat:
    """The blob of one int8 chunk of ``rows`` x ``cols`` weights ([Note: quantized chunk blob]).

    Any shape: blocks of ``block_size`` (a power of two in [32, 4096], default 256, [Note: int8
    block size]) run over the weights flattened row-major, the last one partial when the block
    does not divide rows x cols. Byte sections: codes (int8, one per weight), then steps (fp32
    absmax / 127 per block).
    """

    rows: int
    cols: int
    block_size: int = INT8_DEFAULT_BLOCK

    name = "int8"
    nested = False

    def __post_init__(self):
        check_block("int8", self.rows, self.cols, self.block_size)

    @property
    def numel(self) -> int:
        return self.rows * self.cols

    @property
    def num_blocks(self) -> int:
        """Blocks, the last one partial when block_size does not divide numel."""
        return -(-self.numel // self.block_size)

    @property
    def codes_offset(self) -> int:
        return 0

    @property
    def codes_bytes(self) -> int:
        return self.numel

    @property
    def scales_offset(self) -> int:
        return self.codes_bytes

    @property
    def scales_bytes(self) -> int:
        return 4 * self.num_blocks

    @property
    def total_bytes(self) -> int:
        return self.scales_offset + self.scales_bytes

    def fp32_sections_aligned(self) -> bool:
        return self.scales_offset % 4 == 0

    def with_rows(self, rows: int) -> Int8ChunkFormat:
        return Int8ChunkFormat(rows, self.cols, self.block_size)

    def split(self, blob: torch.Tensor) -> dict[str, torch.Tensor]:
        """``codes`` (int8) and ``scales`` (fp32 steps, a copy) of ``blob``."""
        check_blob(blob, self)
        return {
            "codes": blob[: self.codes_bytes].view(torch.int8),
            "scales": f32_copy(blob[self.scales_offset : self.total_bytes]),
        }


def quantize_int8(w: torch.Tensor, *, block_size: int = INT8_DEFAULT_BLOCK) -> torch.Tensor:
    """The int8 blob (1-D uint8, ``Int8ChunkFormat(*w.shape, block_size)``) of a chunk's rows
    ``w`` [rows, cols] (fp32, bf16 or fp16)."""
    check_weight(w, "int8")
    fmt = Int8ChunkFormat(int(w.shape[0]), int(w.shape[1]), block_size)
    flat = w.reshape(-1).float()
    pad = fmt.num_blocks * block_size - fmt.numel  # the partial last block, padded with zeros:
    blocks = torch.nn.functional.pad(flat, (0, pad)).view(fmt.num_blocks, block_size)  # |0| adds no absmax
    absmax = blocks.abs().amax(dim=1, keepdim=True)
    q = torch.round(blocks / absmax * INT8_LEVELS).clamp(-INT8_LEVELS, INT8_LEVELS)
    q = torch.where(absmax > 0, q, torch.zeros_like(q)).to(torch.int8)  # 0 / 0 of a zero block
    step = (absmax / INT8_LEVELS).reshape(-1)
    return torch.cat([as_bytes(q.reshape(-1)[: fmt.numel]), as_bytes(step)])
