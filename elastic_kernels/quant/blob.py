"""The blob of a quantized chunk, and the layout of a quantized weight as blobs.

[Note: quantized chunk blob]
A frozen weight stored quantized (ARCHITECTURE.md, wave 3: weight format) is cut into chunks of
``rows_per_chunk`` whole rows exactly as an unquantized one (layout.py [Note: chunk-major shard
layout]), and every chunk becomes ONE 1-D ``torch.uint8`` tensor, its *blob*, holding every
byte that is needed to dequantize it and nothing else, section after section:

    nf4             codes | scales (fp32 absmax per block)
    nf4, nested     codes | scale codes (uint8 per block) | nested scales (fp32 per 256 scales) | offset (fp32)
    int8            codes (int8 per weight) | scales (fp32 step absmax/127 per block)

(byte offsets: NF4ChunkFormat / Int8ChunkFormat, and their C++ twin
csrc/include/elastic/quant_blob.h). Why one opaque blob per chunk:

- The runtime moves bytes, never values. A weight's *image* is the concatenation of its
  chunks' blobs, one 1-D uint8 tensor, and ``QuantizedLayout.image_layout(world_size)`` is the
  plain ``ChunkLayout(total_bytes, 1, full_blob_bytes, world_size)`` of that image: its chunk c
  is exactly blob c (every full chunk's blob has the same size; a ragged last chunk's blob is
  the blob of its own rows, smaller, like the ragged last chunk of any weight). So the shards,
  ``pack_shards`` / ``unpack_gathered``, the all-gather, the host store and the pool pages all
  work unchanged on uint8, and the bytes a gather moves are the analytic quantized size
  (``QuantizedLayout.total_bytes``) plus only the slice padding every weight has.
- Blocks run over the weight flattened row-major, as bitsandbytes blocks it (its
  ``quantize_4bit`` of a [R, 688] weight has blocks that start mid-row), so every shape is
  accepted. A chunk holds whole rows AND whole blocks: ``rows_per_chunk`` is a multiple of
  ``rows_multiple(cols, block) = block / gcd(cols, block)`` (4 rows of 688 for block 64; 1 when
  the block divides the row), so every full chunk's weights are a whole number of blocks and
  chunk c's blocks are exactly the weight's blocks [c x rows_per_chunk x cols / block, ...).
  Only the weight's last chunk may end in a partial block (bitsandbytes' last block: its
  absmax over its own weights; an odd count of NF4 codes ends in a half byte, low nibble 7).
  The runtime rounds rows_per_chunk so (``ElasticPolicy.weight_rows_per_chunk``); a layout
  whose full chunks would end mid-block is refused, naming the multiple. A block thus never
  straddles two chunks, so any chunk dequantizes alone, from its own page, in any order; the
  nested scales and the offset of double quantization are per chunk too (bitsandbytes'
  ``compress_statistics`` applied to the chunk's weights: the offset is the mean of *this
  chunk's* absmax), for the same reason.
- No padding inside a blob, so nothing is moved that is not data. The fp32 sections may thus
  start at any byte (e.g. after an odd number of nested scale codes); every impl reads them
  without an alignment assumption (the Triton kernels take an aligned fast path when every
  blob's fp32 sections happen to be 4-byte aligned, the common case).
- The codebooks (NF4's 16 values, the 8-bit dynamic map of the nested scales) are constants of
  the format, not stored per blob.

What the formats mean, value by value, is in nf4.py and int8.py; the dequantization ops are
elastic_kernels/ops/dequant.py.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from elastic_kernels.layout import ChunkLayout
from elastic_kernels.quant._common import rows_multiple
from elastic_kernels.quant.int8 import INT8_DEFAULT_BLOCK, Int8ChunkFormat, quantize_int8
from elastic_kernels.quant.nf4 import NF4_DEFAULT_BLOCK, NF4ChunkFormat, quantize_nf4

FORMATS = ("nf4", "int8")
ChunkFormat = NF4ChunkFormat | Int8ChunkFormat


def default_block_size(fmt: str) -> int:
    if fmt == "nf4":
        return NF4_DEFAULT_BLOCK
    if fmt == "int8":
        return INT8_DEFAULT_BLOCK
    raise ValueError(f"format must be one of {FORMATS}, got {fmt!r}")


def chunk_format(fmt: str, rows: int, cols: int, block_size: int | None = None, nested: bool = False) -> ChunkFormat:
    """The blob format of a chunk of ``rows`` x ``cols`` weights in format ``fmt``."""
    if fmt not in FORMATS:
        raise ValueError(f"format must be one of {FORMATS}, got {fmt!r}")
    block = default_block_size(fmt) if block_size is None else block_size
    if fmt == "nf4":
        return NF4ChunkFormat(rows, cols, block, nested)
    if nested:
        raise ValueError("nested (double quantization of the scales) is an NF4 option; int8 has no nested scales")
    return Int8ChunkFormat(rows, cols, block)


def chunk_formats(
    fmt: str, rows: int, cols: int, rows_per_chunk: int, block_size: int | None = None, nested: bool = False
) -> list[ChunkFormat]:
    """The formats of the blobs of a weight of ``rows`` x ``cols`` cut into chunks of
    ``rows_per_chunk`` rows (the last one ragged when rows_per_chunk does not divide rows)."""
    for name, v in (("rows", rows), ("cols", cols), ("rows_per_chunk", rows_per_chunk)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must be a positive int, got {v!r}")
    chunk_format(fmt, rows, cols, block_size, nested)  # errors name the weight's shape, not a chunk's
    full = chunk_format(fmt, min(rows_per_chunk, rows), cols, block_size, nested)
    if rows_per_chunk < rows and (rows_per_chunk * cols) % full.block_size:
        m = rows_multiple(cols, full.block_size)
        raise ValueError(
            f"{fmt}: weight shape ({rows}, {cols}) in chunks of {rows_per_chunk} rows: a chunk of "
            f"{rows_per_chunk * cols} weights is not a whole number of blocks of {full.block_size}; a chunk holds "
            f"whole blocks (only the weight's last may end in a partial one), so rows_per_chunk must be a multiple "
            f"of {m} (block / gcd(row length, block)) or at least {rows}"
        )
    n = -(-rows // rows_per_chunk)
    last_rows = rows - (n - 1) * rows_per_chunk
    if last_rows == full.rows:
        return [full] * n
    return [full] * (n - 1) + [full.with_rows(last_rows)]


@dataclass(frozen=True)
class QuantizedLayout:
    """A quantized weight as blobs ([Note: quantized chunk blob]): ``rows`` x ``cols`` weights
    in chunks of ``rows_per_chunk`` rows, each chunk one blob of format ``fmt``."""

    rows: int
    cols: int
    rows_per_chunk: int
    fmt: str = "nf4"
    block_size: int | None = None
    nested: bool = False

    def __post_init__(self):
        if self.block_size is None:
            object.__setattr__(self, "block_size", default_block_size(self.fmt))
        self.formats  # noqa: B018 - validates every parameter now (raises ValueError naming it)
        if self.rows_per_chunk > self.rows:
            object.__setattr__(self, "rows_per_chunk", self.rows)  # one chunk, as ChunkLayout does

    @property
    def formats(self) -> list[ChunkFormat]:
        return chunk_formats(self.fmt, self.rows, self.cols, self.rows_per_chunk, self.block_size, self.nested)

    @property
    def num_chunks(self) -> int:
        return -(-self.rows // self.rows_per_chunk)

    @property
    def blob_bytes(self) -> list[int]:
        return [f.total_bytes for f in self.formats]

    @property
    def full_blob_bytes(self) -> int:
        """Bytes of a full chunk's blob: the size of a pool page that holds any chunk of it."""
        return self.formats[0].total_bytes

    @property
    def total_bytes(self) -> int:
        """Bytes of the whole quantized weight (the sum of its blobs; no padding)."""
        return sum(self.blob_bytes)

    def blob_offset(self, c: int) -> int:
        """Byte offset of chunk c's blob in the image."""
        if not 0 <= c < self.num_chunks:
            raise IndexError(f"chunk {c} out of range [0, {self.num_chunks})")
        return c * self.full_blob_bytes

    def blob_span(self, b: int, e: int) -> tuple[int, int, int]:
        """(c, lo, hi): image bytes [b, e) are bytes [lo, hi) of chunk c's blob. Raises
        ValueError unless they lie within that one blob (a reader of the image is asked for one
        chunk's bytes at a time)."""
        full = self.full_blob_bytes
        c = b // full
        lo, hi = b - c * full, e - c * full
        if not (0 <= c < self.num_chunks and 0 <= lo < hi <= self.formats[c].total_bytes):
            raise ValueError(f"image bytes [{b}, {e}) are not within chunk {c}'s blob")
        return c, lo, hi

    def image_layout(self, world_size: int) -> ChunkLayout:
        """The ChunkLayout that shards the image (1-D uint8) so that its chunk c is blob c."""
        return ChunkLayout(self.total_bytes, 1, self.full_blob_bytes, world_size)

    def quantize(self, weight: torch.Tensor) -> torch.Tensor:
        """The image of ``weight`` [rows, cols]: its chunks' blobs, concatenated (1-D uint8)."""
        if tuple(weight.shape) != (self.rows, self.cols):
            raise ValueError(f"weight has shape {tuple(weight.shape)} but the layout is for ({self.rows}, {self.cols})")
        blobs = []
        for c, f in enumerate(self.formats):
            r0 = c * self.rows_per_chunk
            blobs.append(quantize_chunk(weight[r0 : r0 + f.rows], f))
        return torch.cat(blobs)

    def blobs(self, image: torch.Tensor) -> list[torch.Tensor]:
        """Views of the image's blobs, chunk by chunk."""
        if image.dtype != torch.uint8 or image.dim() != 1 or image.numel() != self.total_bytes:
            raise ValueError(
                f"image must be a 1-D torch.uint8 tensor of {self.total_bytes} bytes, got "
                f"{image.dtype} of shape {tuple(image.shape)}"
            )
        return [image[self.blob_offset(c) : self.blob_offset(c) + b] for c, b in enumerate(self.blob_bytes)]


def quantize_chunk(rows: torch.Tensor, fmt: ChunkFormat) -> torch.Tensor:
    """The blob of ``rows`` (a chunk's weights, [fmt.rows, fmt.cols]) in format ``fmt``."""
    if tuple(rows.shape) != (fmt.rows, fmt.cols):
        raise ValueError(f"rows have shape {tuple(rows.shape)} but the format is for ({fmt.rows}, {fmt.cols})")
    if isinstance(fmt, NF4ChunkFormat):
        return quantize_nf4(rows, block_size=fmt.block_size, nested=fmt.nested)
    return quantize_int8(rows, block_size=fmt.block_size)
