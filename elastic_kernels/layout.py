"""Chunk and shard layout of one frozen weight (ARCHITECTURE.md: chunk, shard, chunk-major).

[Note: chunk-major shard layout]
A weight of ``rows x cols`` elements is flattened row-major and cut into chunks of
``rows_per_chunk`` whole rows: ``chunk_numel = rows_per_chunk * cols`` elements, the last chunk
ragged (``rows % rows_per_chunk`` rows when that is not zero). Every chunk, the ragged one too, is
split into ``world_size`` equal *slices* of ``slice_numel = ceil(chunk_numel / world_size)``
elements, zero-padded at the end of the chunk. Rank r's *shard* is the concatenation over chunks
of slice r of each chunk:

    shard_r[c * slice_numel + o] = padded_chunk_c[r * slice_numel + o]

so the shard has ``num_chunks * slice_numel`` elements and the slices of any range of chunks
are one contiguous range of the shard (a send buffer needs no gather). Using the same
slice_numel for the ragged chunk wastes at most one chunk of padding per weight (in the
shards together, and in what gathering that chunk moves) and keeps all index math a
multiply-add; a weight the runtime keeps whole holds none of it (python_api/runtime/tensor.py,
[Note: resident runs]); `pack_shards` / `unpack_gathered` and their kernels use exactly this
arithmetic (csrc/include/elastic/chunk_layout.h is its C++ twin).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ChunkLayout:
    rows: int
    cols: int
    rows_per_chunk: int
    world_size: int

    def __post_init__(self):
        for name in ("rows", "cols", "rows_per_chunk", "world_size"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"ChunkLayout.{name} must be a positive int, got {v!r}")
        if self.rows_per_chunk > self.rows:
            # A chunk larger than the weight is legal only as "one chunk": clamp explicitly.
            object.__setattr__(self, "rows_per_chunk", self.rows)

    @classmethod
    def for_weight(cls, shape: torch.Size | tuple, rows_per_chunk: int, world_size: int) -> ChunkLayout:
        if len(shape) == 1:
            rows, cols = int(shape[0]), 1
        elif len(shape) == 2:
            rows, cols = int(shape[0]), int(shape[1])
        else:
            raise ValueError(f"ChunkLayout.for_weight: expected a 1-D or 2-D weight, got shape {tuple(shape)}")
        return cls(rows, cols, rows_per_chunk, world_size)

    @property
    def numel(self) -> int:
        return self.rows * self.cols

    @property
    def num_chunks(self) -> int:
        return -(-self.rows // self.rows_per_chunk)

    @property
    def chunk_numel(self) -> int:
        """Elements of a full (non-ragged) chunk."""
        return self.rows_per_chunk * self.cols

    @property
    def slice_numel(self) -> int:
        return -(-self.chunk_numel // self.world_size)

    @property
    def shard_numel(self) -> int:
        return self.num_chunks * self.slice_numel

    def chunk_rows(self, c: int) -> tuple[int, int]:
        """Row range [begin, end) of chunk c."""
        self._check_chunk(c)
        begin = c * self.rows_per_chunk
        return begin, min(begin + self.rows_per_chunk, self.rows)

    def chunk_numel_of(self, c: int) -> int:
        begin, end = self.chunk_rows(c)
        return (end - begin) * self.cols

    def chunk_shape(self, c: int) -> tuple[int, ...]:
        begin, end = self.chunk_rows(c)
        return (end - begin, self.cols)

    def _check_chunk(self, c: int) -> None:
        if not 0 <= c < self.num_chunks:
            raise IndexError(f"chunk {c} out of range [0, {self.num_chunks})")

    # ---- reference sharding (pure torch; the source of truth for tests and wrap time) ----

    def shard(self, weight: torch.Tensor, rank: int) -> torch.Tensor:
        """Rank `rank`'s chunk-major shard of `weight` (a new contiguous 1-D tensor)."""
        if weight.numel() != self.numel:
            raise ValueError(f"weight has {weight.numel()} elements, layout expects {self.numel}")
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} out of range for world_size {self.world_size}")
        padded = weight.new_zeros(self.num_chunks * self.world_size * self.slice_numel)
        flat = weight.detach().reshape(-1)
        view = padded.view(self.num_chunks, self.world_size * self.slice_numel)
        for c in range(self.num_chunks):
            begin, end = self.chunk_rows(c)
            n = (end - begin) * self.cols
            view[c, :n] = flat[begin * self.cols : begin * self.cols + n]
        per_rank = padded.view(self.num_chunks, self.world_size, self.slice_numel)
        return per_rank[:, rank, :].contiguous().reshape(-1)

    def slice_rows(self, c: int, rank: int) -> tuple[int, int]:
        """Row range [begin, end) of the weight that rank `rank`'s slice of chunk c overlaps
        (empty when the slice is all padding)."""
        begin, end = self.chunk_rows(c)
        n = (end - begin) * self.cols
        lo, hi = min(rank * self.slice_numel, n), min((rank + 1) * self.slice_numel, n)
        if lo >= hi:
            return begin, begin
        return begin + lo // self.cols, begin + -(-hi // self.cols)

    def shard_from_rows(self, read_rows, rank: int, dtype: torch.dtype, device=None) -> torch.Tensor:
        """`shard(weight, rank)` without the whole weight: `read_rows(begin, end)` returns rows
        [begin, end) of the weight (any shape with (end - begin) * cols elements); only the rows
        that rank's slices overlap are read (about 1/world_size of the weight)."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} out of range for world_size {self.world_size}")
        out = torch.zeros(self.shard_numel, dtype=dtype, device=device)
        for c in range(self.num_chunks):
            r0, r1 = self.slice_rows(c, rank)
            if r0 == r1:
                continue
            begin, end = self.chunk_rows(c)
            n = (end - begin) * self.cols
            lo, hi = rank * self.slice_numel, min((rank + 1) * self.slice_numel, n)
            rows = read_rows(r0, r1)
            if rows.numel() != (r1 - r0) * self.cols:
                raise ValueError(f"read_rows({r0}, {r1}) returned {rows.numel()} elements, "
                                 f"expected {(r1 - r0) * self.cols}")
            flat = rows.reshape(-1)
            skip = lo - (r0 - begin) * self.cols
            out[c * self.slice_numel : c * self.slice_numel + (hi - lo)] = flat[skip : skip + hi - lo]
        return out

    def assemble(self, shards: list[torch.Tensor]) -> torch.Tensor:
        """Inverse of `shard`: the full weight (rows, cols) from every rank's shard."""
        if len(shards) != self.world_size:
            raise ValueError(f"expected {self.world_size} shards, got {len(shards)}")
        stacked = torch.stack([s.reshape(self.num_chunks, self.slice_numel) for s in shards], dim=1)
        chunks = stacked.reshape(self.num_chunks, self.world_size * self.slice_numel)
        out = chunks.new_empty(self.numel)
        for c in range(self.num_chunks):
            begin, end = self.chunk_rows(c)
            n = (end - begin) * self.cols
            out[begin * self.cols : begin * self.cols + n] = chunks[c, :n]
        return out.view(self.rows, self.cols)
