"""The quantized image of a registered weight, and each rank's shard of it ([Note: quantized
frozen weights] in python_api/quant/__init__.py)."""

from __future__ import annotations

import abc

import torch

from elastic_kernels import ChunkLayout
from elastic_kernels.quant import QuantizedLayout, chunk_format, quantize_chunk


class PackedRows(abc.ABC):
    """A weight that its file holds already quantized (a bitsandbytes 4-bit checkpoint:
    python_api/loading/bnb.py, [Note: loading a bitsandbytes 4-bit checkpoint]). The runtime
    takes it where it takes a reader of rows (`ElasticTensor(rows=...)`), and then stores the
    file's codes and scales as they are instead of quantizing rows:

      rows(b, e)                  rows [b, e) dequantized, in the weight's dtype (what a reader
                                  of rows returns: the fingerprint reads a few)
      layout(policy, name, shape, rows_per_chunk)
                                  the QuantizedLayout its image is stored in (ValueError when
                                  the policy's format cannot hold the file's values exactly)
      image_reader(qlayout, device)
                                  `read(b, e)`: bytes [b, e) of the image, within one chunk's
                                  blob, copied from the file's packed bytes (only those)
      nonfinite                   non-finite weights among the blocks whose scales
                                  `image_reader` has read (a NaN or Inf scale)
    """

    nonfinite = 0

    @abc.abstractmethod
    def __call__(self, b: int, e: int) -> torch.Tensor: ...

    @abc.abstractmethod
    def layout(self, policy, name: str, shape, rows_per_chunk: int) -> QuantizedLayout: ...

    @abc.abstractmethod
    def image_reader(self, qlayout: QuantizedLayout, device): ...


def quantized_layout(policy, name: str, shape, rows_per_chunk: int, packed: PackedRows | None = None
                     ) -> QuantizedLayout | None:
    """The QuantizedLayout of weight `name` of `shape` under `policy` (None: not quantized);
    with `packed`, the layout that holds its file's quantized values (`PackedRows.layout`).
    Raises ValueError naming the weight and its shape when it cannot be stored in the format."""
    if not policy.quantizes(name):  # no format, or a module kept in full precision
        return None
    policy.check_quantizable(name, shape)
    if packed is not None:
        return packed.layout(policy, name, shape, rows_per_chunk)
    # rows_per_chunk is the runtime's, rounded to whole blocks (ElasticPolicy.weight_rows_per_chunk);
    # QuantizedLayout refuses one that is not, naming the multiple.
    rows, cols = int(shape[0]), int(shape[1])
    return QuantizedLayout(rows, cols, min(rows_per_chunk, rows), policy.weight_format, policy.block_size,
                           policy.quant_nested)


def _blocks_of_bytes(fmt, lo: int, hi: int) -> list[tuple[int, int]]:
    """Block ranges [k0, k1) of a chunk (format `fmt`, without nested scales) whose codes or
    scales lie in bytes [lo, hi) of its blob: codes of consecutive weights first, then one
    fp32 scale per block (blob.py's sections; blocks run over the chunk's weights flattened)."""
    out = []
    per_code_byte = 2 if fmt.name == "nf4" else 1  # weights per code byte
    a, b = max(lo, fmt.codes_offset), min(hi, fmt.codes_offset + fmt.codes_bytes)
    if a < b:
        out.append(((a - fmt.codes_offset) * per_code_byte // fmt.block_size,
                    -(-((b - fmt.codes_offset) * per_code_byte) // fmt.block_size)))
    a, b = max(lo, fmt.scales_offset) - fmt.scales_offset, min(hi, fmt.scales_offset + fmt.scales_bytes) - fmt.scales_offset
    if a < b:
        out.append((a // 4, -(-b // 4)))
    return out


def _quantize_blocks(fmt, base: int, k0: int, k1: int, rows_as):
    """(format, blob) of blocks [k0, k1) of the chunk whose first row is weight row `base`
    (format `fmt`, without nested scales), quantized alone: the weights of those blocks,
    flattened, as a one-row chunk. Blocks are independent without nested scales, so its codes
    and scales are the chunk's bytes of those blocks; only the rows they touch are read."""
    cols, block = fmt.cols, fmt.block_size
    w0, w1 = k0 * block, min(k1 * block, fmt.numel)
    r0, r1 = w0 // cols, -(-w1 // cols)
    flat = rows_as(base + r0, base + r1).reshape(-1)[w0 - r0 * cols: w1 - r0 * cols]
    sub = chunk_format(fmt.name, 1, w1 - w0, block)
    return sub, quantize_chunk(flat.reshape(1, -1), sub)


def _sub_blob_bytes(fmt, k0: int, sub_fmt, sub: torch.Tensor, lo: int, hi: int, dest: torch.Tensor) -> None:
    """Write into dest (bytes [lo, hi) of the chunk's blob) the bytes that the blob `sub` of
    the chunk's blocks [k0, ...) determines (`_quantize_blocks`: its codes and scales are the
    same bytes in either blob; block_size is even, so the codes of a block start on a byte)."""
    per_code_byte = 2 if fmt.name == "nf4" else 1
    sections = (
        (fmt.codes_offset, fmt.codes_bytes, sub_fmt.codes_offset, k0 * fmt.block_size // per_code_byte,
         sub_fmt.codes_bytes),
        (fmt.scales_offset, fmt.scales_bytes, sub_fmt.scales_offset, 4 * k0, sub_fmt.scales_bytes),
    )
    for off, size, sub_off, first, sub_size in sections:
        # Bytes [first, first + sub_size) of this section are the sub-blob's section.
        a = max(lo, off + first)
        b = min(hi, off + size, off + first + sub_size)
        if a < b:
            src = sub_off + (a - off - first)
            dest[a - lo : b - lo] = sub[src : src + (b - a)]


def _rows_as(qlayout: QuantizedLayout, read_rows, dtype: torch.dtype, device):
    """`rows_as(r0, r1)`: rows [r0, r1) of the weight from `read_rows`, [r1 - r0, cols] in
    `dtype` (the weight's own) on `device` (where every rank's quantizer runs)."""

    def rows_as(r0: int, r1: int) -> torch.Tensor:
        w = read_rows(r0, r1)
        return w.reshape(r1 - r0, qlayout.cols).to(device=device, dtype=dtype)

    return rows_as


def image_reader(qlayout: QuantizedLayout, read_rows, dtype: torch.dtype, device):
    """`read(b, e)`: bytes [b, e) of the weight's image, within one chunk's blob, quantized
    from the rows `read_rows(r0, r1)` returns (cast to `dtype`, the weight's own dtype, on
    `device`). Reads and quantizes only the blocks those bytes depend on, and the rows they
    touch (every row of the chunk with nested scales); nothing is kept between calls."""
    formats = qlayout.formats
    rows_as = _rows_as(qlayout, read_rows, dtype, device)

    def read(b: int, e: int) -> torch.Tensor:
        c, lo, hi = qlayout.blob_span(b, e)
        fmt = formats[c]
        base = c * qlayout.rows_per_chunk
        if fmt.nested:
            return quantize_chunk(rows_as(base, base + fmt.rows), fmt)[lo:hi]
        out = torch.empty(hi - lo, dtype=torch.uint8, device=device)
        for k0, k1 in _blocks_of_bytes(fmt, lo, hi):
            sub_fmt, sub = _quantize_blocks(fmt, base, k0, k1, rows_as)
            _sub_blob_bytes(fmt, k0, sub_fmt, sub, lo, hi, out)
        return out

    return read


def quantized_shard(qlayout: QuantizedLayout, storage: ChunkLayout, read_rows, rank: int, dtype: torch.dtype,
                    device, padded: bool = True) -> torch.Tensor:
    """Rank `rank`'s shard (1-D uint8, `storage.shard_numel` bytes, or `storage.own_numel(rank)`
    without the last blob's padding when not `padded`) of the weight's image,
    i.e. `storage.shard(qlayout.quantize(weight), rank, padded)`, without the image: chunk by chunk,
    each rank quantizes only what its slice of each blob needs (`image_reader`). A
    `PackedRows` (a weight its file holds quantized) gives its bytes as they are instead:
    nothing is quantized."""
    if isinstance(read_rows, PackedRows):
        read = read_rows.image_reader(qlayout, device)
    else:
        read = image_reader(qlayout, read_rows, dtype, device)
    return storage.shard_from_rows(read, rank, torch.uint8, device, padded=padded)


def fill_image_share(qlayout: QuantizedLayout, read_rows, r0: int, r1: int, dest: torch.Tensor, dtype: torch.dtype,
                     device) -> None:
    """Write into `dest` (the weight's whole image, 1-D uint8, e.g. its place in the host store)
    the bytes that a local rank whose share is rows [r0, r1) of the weight fills ([Note:
    filling the host store] in python_api/host/sources.py): without nested scales the codes
    and scales of the blocks whose first weight is in those rows, quantizing only them (blocks
    are independent; a block that runs on into the next row reads that row too); with nested
    scales the whole blobs of the chunks whose first row is in [r0, r1) (their statistics need
    every row of the chunk). Shares that partition the rows write disjoint bytes covering
    the whole image. Quantized on `device`, one chunk's rows at a time, as the shards are
    (`quantized_shard`), so the store holds the same bytes as the shards and the pool."""
    if tuple(dest.shape) != (qlayout.total_bytes,) or dest.dtype != torch.uint8:
        raise ValueError(f"fill_image_share: dest must be the image, ({qlayout.total_bytes},) uint8, "
                         f"got {tuple(dest.shape)} {dest.dtype}")
    if not 0 <= r0 <= r1 <= qlayout.rows:
        raise ValueError(f"fill_image_share: rows [{r0}, {r1}) are not within the weight's {qlayout.rows} rows")
    rows_as = _rows_as(qlayout, read_rows, dtype, device)
    formats, rpc, full = qlayout.formats, qlayout.rows_per_chunk, qlayout.full_blob_bytes
    for c in range(r0 // rpc, -(-r1 // rpc)):
        fmt = formats[c]
        base = c * rpc
        blob = dest[c * full : c * full + fmt.total_bytes]
        if fmt.nested:
            if r0 <= base < r1:
                blob.copy_(quantize_chunk(rows_as(base, base + fmt.rows), fmt))
            continue
        a, b = max(r0, base) - base, min(r1, base + fmt.rows) - base
        # the blocks whose first weight is in local rows [a, b): [ceil(a cols / B), ceil(b cols / B))
        k0, k1 = -(-(a * fmt.cols) // fmt.block_size), -(-(b * fmt.cols) // fmt.block_size)
        if a < b and k0 < k1:
            sub_fmt, sub = _quantize_blocks(fmt, base, k0, k1, rows_as)
            _sub_blob_bytes(fmt, k0, sub_fmt, sub.to(blob.device), 0, fmt.total_bytes, blob)
