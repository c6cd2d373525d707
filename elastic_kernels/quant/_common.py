"""What the formats share: the block checks, and blob/weight argument checks (torch only)."""

from __future__ import annotations

import math

import torch

MIN_BLOCK, MAX_BLOCK = 32, 4096  # csrc/include/elastic/quant_blob.h kMinBlock / kMaxBlock


def check_block(fmt: str, rows: int, cols: int, block_size: int) -> None:
    """The checks every format shares: positive shape, a supported block. Any shape is
    accepted: blocks run over the chunk's weights flattened row-major, the last one partial
    when the block does not divide rows x cols ([Note: quantized chunk blob])."""
    for name, v in (("rows", rows), ("cols", cols), ("block_size", block_size)):
        if isinstance(v, bool) or not isinstance(v, int):
            raise TypeError(f"{fmt}: {name} must be an int, got {type(v).__name__}")
    if rows < 1 or cols < 1:
        raise ValueError(f"{fmt}: a chunk needs at least one row and one column, got shape ({rows}, {cols})")
    if not (MIN_BLOCK <= block_size <= MAX_BLOCK and block_size & (block_size - 1) == 0):
        raise ValueError(
            f"{fmt}: block_size must be a power of two between {MIN_BLOCK} and {MAX_BLOCK}, got {block_size}"
        )


def rows_multiple(cols: int, block_size: int) -> int:
    """The fewest rows of ``cols`` weights that hold whole blocks of ``block_size``:
    block / gcd(cols, block). Every chunk of a weight but its last holds a multiple of it
    ([Note: quantized chunk blob]); 1 when the block divides the row."""
    return block_size // math.gcd(cols, block_size)


def f32_copy(b: torch.Tensor) -> torch.Tensor:
    return b.clone().view(torch.float32)  # a fresh, aligned copy: the bytes may start anywhere


def check_blob(blob: torch.Tensor, fmt) -> None:
    if not isinstance(blob, torch.Tensor) or blob.dtype != torch.uint8 or blob.dim() != 1:
        raise ValueError(f"a blob is a 1-D torch.uint8 tensor, got {getattr(blob, 'dtype', type(blob).__name__)}")
    if blob.numel() != fmt.total_bytes:
        raise ValueError(f"blob has {blob.numel()} bytes but {fmt} has {fmt.total_bytes}")


def check_weight(w: torch.Tensor, fmt: str) -> None:
    if not isinstance(w, torch.Tensor):
        raise TypeError(f"quantize_{fmt}: w must be a tensor, got {type(w).__name__}")
    if w.dim() != 2:
        raise ValueError(f"quantize_{fmt}: w must be 2-D [rows, cols] (a chunk's rows), got shape {tuple(w.shape)}")
    if w.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise TypeError(f"quantize_{fmt}: w has dtype {w.dtype}; supported are float32, bfloat16 and float16")


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)
