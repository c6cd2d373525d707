"""The Triton kernels of the dequant ops (``@triton.jit`` only; launched by dequant.py).

``_dequant_nf4_kernel`` and ``_dequant_int8_kernel`` write a weight [rows, cols] (row-major,
contiguous) from its chunks' blobs, every chunk in one launch: chunk c's blob is at
``blob_ptr + page[c]`` bytes (a page table of byte offsets from blobs[0], as paged_linear.py
[Note: page table as element offsets]), and its rows start at output row c * rows_per_chunk.
Blob layout: elastic_kernels/quant/blob.py [Note: quantized chunk blob] (byte offsets restated
below, as in csrc/include/elastic/quant_blob.h). Grid: one program per GROUP quantization
blocks of one chunk, (tiles per full chunk) x (chunks) flattened to one axis; the ragged last
chunk masks its missing blocks. A program's tile is [GROUP, BLOCK] weights, so a block's scale
is loaded once per block, not per weight, and every weight's block index is the tile row.
Blocks run over a chunk's n weights flattened; the weight's last chunk may end in a partial
block (n not a multiple of BLOCK, possibly odd), so loads and stores are masked weight by
weight (code bytes below ceil(n / 2), weights below n), not only block by block. Those masks
are compiled in only when the launch says a partial block exists (PARTIAL), so the common
case keeps its block-uniform masks and its vectorised 16-byte loads.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _load_f32(ptr, mask, ALIGNED: tl.constexpr):
    """fp32 values at byte addresses ``ptr`` (a block of uint8 pointers), little-endian.
    ALIGNED: every address is a multiple of 4 (checked by the launcher), one 4-byte load; else
    four byte loads assembled, since a blob's fp32 sections may start at any byte."""
    if ALIGNED:
        v = tl.load(ptr.to(tl.pointer_type(tl.float32), bitcast=True), mask=mask, other=0.0)
    else:
        b0 = tl.load(ptr, mask=mask, other=0).to(tl.uint32)
        b1 = tl.load(ptr + 1, mask=mask, other=0).to(tl.uint32)
        b2 = tl.load(ptr + 2, mask=mask, other=0).to(tl.uint32)
        b3 = tl.load(ptr + 3, mask=mask, other=0).to(tl.uint32)
        v = (b0 | (b1 << 8) | (b2 << 16) | (b3 << 24)).to(tl.float32, bitcast=True)
    return v


@triton.jit
def _blob(blob_ptr, page_ptr, c, BASE_ALIGN: tl.constexpr):
    """Chunk c's blob: blob_ptr + page[c]. BASE_ALIGN: every blob starts at a multiple of it
    (checked by the launcher), so the code loads vectorise (16-byte loads instead of bytes)."""
    page = tl.load(page_ptr + c)
    if BASE_ALIGN > 1:
        page = tl.multiple_of(page, BASE_ALIGN)
    return blob_ptr + page


@triton.jit
def _tile(pid, rows, cols, rows_per_chunk, tiles_per_chunk, BLOCK: tl.constexpr, GROUP: tl.constexpr):
    """(chunk c, its weights n, block indices [GROUP] of this program inside the chunk, their mask)."""
    c = (pid // tiles_per_chunk).to(tl.int64)
    t = (pid % tiles_per_chunk).to(tl.int64)
    chunk_rows = tl.minimum(rows - c * rows_per_chunk, rows_per_chunk)
    n = chunk_rows * cols  # weights of chunk c (the last chunk may be ragged)
    blk = t * GROUP + tl.arange(0, GROUP)  # int64 block index inside the chunk
    return c, n, blk, blk < (n + BLOCK - 1) // BLOCK  # the last block may be partial


@triton.jit
def _dequant_nf4_kernel(
    blob_ptr,  # uint8: blobs[0]; chunk c's blob starts at blob_ptr + page[c]
    page_ptr,  # [num_chunks] int64 byte offsets of the blobs from blobs[0]
    nf4_ptr,  # [16] fp32 NF4 codebook
    dyn_ptr,  # [256] fp32 dynamic map of the nested scale codes (read only when NESTED)
    out_ptr,  # [rows, cols] contiguous, the compute dtype (fp32 for bf16 under the interpreter)
    rows,  # rows of the weight (all chunks)
    cols,  # row length (any: rows_per_chunk x cols is a multiple of BLOCK unless one chunk)
    rows_per_chunk,  # rows of every chunk but the last
    tiles_per_chunk,  # programs per chunk: cdiv(blocks of a full chunk, GROUP)
    BLOCK: tl.constexpr,  # weights per quantization block (power of two)
    GROUP: tl.constexpr,  # blocks per program
    NESTED: tl.constexpr,  # scales double-quantized (uint8 codes, nested fp32 scales, offset)
    ALIGNED: tl.constexpr,  # every blob's fp32 sections start at a multiple of 4 bytes
    BASE_ALIGN: tl.constexpr,  # every blob starts at a multiple of this many bytes (16 or 1)
    PARTIAL: tl.constexpr,  # the last chunk ends in a partial block: mask weight by weight
):
    c, n, blk, bmask = _tile(tl.program_id(0), rows, cols, rows_per_chunk, tiles_per_chunk, BLOCK, GROUP)
    base = _blob(blob_ptr, page_ptr, c, BASE_ALIGN)
    scales_at = (n + 1) // 2  # codes take ceil(n / 2) bytes
    if NESTED:
        nblocks = (n + BLOCK - 1) // BLOCK
        nested_at = scales_at + nblocks  # one uint8 code per block
        q = tl.load(base + scales_at + blk, mask=bmask, other=0)
        absmax2 = _load_f32(base + nested_at + 4 * (blk // 256), bmask, ALIGNED)
        offset_at = nested_at + 4 * ((nblocks + 255) // 256)
        offset = _load_f32(base + offset_at + 0 * blk, bmask, ALIGNED)
        # fl(fl(code * absmax2) + offset): the launch passes enable_fp_fusion=False, so this is
        # never one FMA (bitsandbytes rounds the product, then the sum).
        scale = tl.load(dyn_ptr + q.to(tl.int32)) * absmax2 + offset
    else:
        scale = _load_f32(base + scales_at + 4 * blk, bmask, ALIGNED)
    j = tl.arange(0, BLOCK // 2)
    at = blk[:, None] * (BLOCK // 2) + j[None, :]  # code byte index inside the chunk
    if PARTIAL:
        byte = tl.load(base + at, mask=bmask[:, None] & (at < (n + 1) // 2), other=0)
    else:
        byte = tl.load(base + at, mask=bmask[:, None], other=0)
    first = tl.load(nf4_ptr + (byte >> 4).to(tl.int32)) * scale[:, None]  # element 2k: high nibble
    second = tl.load(nf4_ptr + (byte & 0x0F).to(tl.int32)) * scale[:, None]  # element 2k + 1
    values = tl.interleave(first, second)  # [GROUP, BLOCK]
    k = blk[:, None] * BLOCK + tl.arange(0, BLOCK)[None, :]  # weight index inside the chunk
    e = c * rows_per_chunk * cols + k
    if PARTIAL:
        tl.store(out_ptr + e, values.to(out_ptr.dtype.element_ty), mask=bmask[:, None] & (k < n))
    else:
        tl.store(out_ptr + e, values.to(out_ptr.dtype.element_ty), mask=bmask[:, None])


@triton.jit
def _dequant_int8_kernel(
    blob_ptr,  # uint8: blobs[0]; chunk c's blob starts at blob_ptr + page[c]
    page_ptr,  # [num_chunks] int64 byte offsets of the blobs from blobs[0]
    out_ptr,  # [rows, cols] contiguous, the compute dtype (fp32 for bf16 under the interpreter)
    rows,  # rows of the weight (all chunks)
    cols,  # row length (any: rows_per_chunk x cols is a multiple of BLOCK unless one chunk)
    rows_per_chunk,  # rows of every chunk but the last
    tiles_per_chunk,  # programs per chunk: cdiv(blocks of a full chunk, GROUP)
    BLOCK: tl.constexpr,  # weights per quantization block (power of two)
    GROUP: tl.constexpr,  # blocks per program
    ALIGNED: tl.constexpr,  # every blob's step section starts at a multiple of 4 bytes
    BASE_ALIGN: tl.constexpr,  # every blob starts at a multiple of this many bytes (16 or 1)
    PARTIAL: tl.constexpr,  # the last chunk ends in a partial block: mask weight by weight
):
    c, n, blk, bmask = _tile(tl.program_id(0), rows, cols, rows_per_chunk, tiles_per_chunk, BLOCK, GROUP)
    base = _blob(blob_ptr, page_ptr, c, BASE_ALIGN)
    step = _load_f32(base + n + 4 * blk, bmask, ALIGNED)  # codes take n bytes
    k = blk[:, None] * BLOCK + tl.arange(0, BLOCK)[None, :]  # weight index inside the chunk
    if PARTIAL:
        mask = bmask[:, None] & (k < n)  # the last block is partial
    else:
        mask = bmask[:, None]
    codes = tl.load(base + k, mask=mask, other=0)
    values = codes.to(tl.int8, bitcast=True).to(tl.float32) * step[:, None]
    e = c * rows_per_chunk * cols + k
    tl.store(out_ptr + e, values.to(out_ptr.dtype.element_ty), mask=mask)
