"""Chunk and shard layout of one frozen weight (ARCHITECTURE.md: chunk, shard, chunk-major).

[Note: chunk-major shard layout]
A weight of ``rows x cols`` elements is flattened row-major and cut into chunks of
``rows_per_chunk`` whole rows: ``chunk_numel = rows_per_chunk * cols`` elements, the last chunk
ragged (``rows % rows_per_chunk`` rows when that is not zero). Every chunk, the ragged one too, is
split into ``world_size`` equal *slices* of ``slice_numel = ceil(chunk_numel / world_size)``
elements, zero-padded at the end of the chunk. Rank r's *padded shard* is the concatenation
over chunks of slice r of each chunk:

    shard_r[c * slice_numel + o] = padded_chunk_c[r * slice_numel + o]

so it has ``num_chunks * slice_numel`` elements (`shard_numel`) and the slices of any range of
chunks are one contiguous range of it (a send buffer needs no gather). Using the same
slice_numel for the ragged chunk keeps all index math a multiply-add; `pack_shards` /
`unpack_gathered` and their kernels use exactly this arithmetic (csrc/include/elastic/
chunk_layout.h is its C++ twin), and it is what every gather sends and receives.
- What a rank holds has no padding: its shard is the padded shard cut after its real elements
  (`own_numel(r)` = (num_chunks - 1) * slice_numel + `last_slice_numel(r)`, the last being
  slice_numel, fewer, or 0; `shard(..., padded=False)`, `shard_from_rows(..., padded=False)`).
  The padding is zeros that no one reads, so it is made only where something is sent: a
  gather whose range covers the last chunk sends this rank's short last slice as a temporary
  zero-padded copy of slice_numel elements (python_api/runtime/tensor.py, `send_parts`;
  `pad_shard` for a whole-shard gather), and the receive side drops padding as it always did.
  So the wire format, every gather's bytes, the pages and the pack kernels are unchanged (the
  pack still takes shards of whole slices: the full part of the shard, then the temporary).
  This is the approach of a run ([Note: resident runs]); until 2026-12-03 a shard held the
  padding, at most one slice of one chunk per weight and rank (13.1 MiB per rank of 269.6 MiB
  on SmolLM2-135M at 256 KiB chunks and 2 ranks: bench/results/2026-12-03_ragged.md).
- World size 1: one slice is a whole chunk, so the shard is exactly the weight.
- Quantized weights: the layout is the image's (chunk c = blob c); the shard is cut the same
  way, the blobs' padding was not structural (never read, never dequantized).
- Not chosen: a slice size of its own for the last chunk (ceil(L / W)): it would also trim
  what gathering the last chunk moves, but changes every byte count of the gathers, the
  planner's profile and the pack arithmetic, for at most one slice per weight per gather.
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
        """Elements of a *padded* shard (every slice full): what a gather of all chunks sends."""
        return self.num_chunks * self.slice_numel

    def last_slice_numel(self, rank: int) -> int:
        """Real elements of rank `rank`'s slice of the last chunk: slice_numel, fewer, or 0."""
        self._check_rank(rank)
        return max(0, min(self.slice_numel, self.chunk_numel_of(self.num_chunks - 1) - rank * self.slice_numel))

    def own_numel(self, rank: int) -> int:
        """Elements of rank `rank`'s shard as the runtime holds it: its real elements only
        (the full slices of chunks 0..n-2, then its part of the last chunk, unpadded)."""
        return (self.num_chunks - 1) * self.slice_numel + self.last_slice_numel(rank)

    def pad_shard(self, shard: torch.Tensor, rank: int) -> torch.Tensor:
        """`shard` (padded, or holding rank `rank`'s real elements only) as a padded shard of
        shard_numel elements: `shard` itself when it is padded, else a new zero-padded copy."""
        own = self.own_numel(rank)
        if shard.numel() == self.shard_numel:
            return shard
        if shard.numel() != own:
            raise ValueError(f"shard of rank {rank} has {shard.numel()} elements, expected {own} (unpadded) "
                             f"or {self.shard_numel} (padded)")
        out = shard.new_zeros(self.shard_numel)
        out[:own].copy_(shard)
        return out

    def _check_rank(self, rank: int) -> None:
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} out of range for world_size {self.world_size}")

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

    def shard(self, weight: torch.Tensor, rank: int, padded: bool = True) -> torch.Tensor:
        """Rank `rank`'s chunk-major shard of `weight` (a new contiguous 1-D tensor): padded
        (shard_numel elements), or with `padded=False` its real elements only (own_numel)."""
        if weight.numel() != self.numel:
            raise ValueError(f"weight has {weight.numel()} elements, layout expects {self.numel}")
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} out of range for world_size {self.world_size}")
        every = weight.new_zeros(self.num_chunks * self.world_size * self.slice_numel)  # every padded chunk
        flat = weight.detach().reshape(-1)
        view = every.view(self.num_chunks, self.world_size * self.slice_numel)
        for c in range(self.num_chunks):
            begin, end = self.chunk_rows(c)
            n = (end - begin) * self.cols
            view[c, :n] = flat[begin * self.cols : begin * self.cols + n]
        per_rank = every.view(self.num_chunks, self.world_size, self.slice_numel)
        out = per_rank[:, rank, :].contiguous().reshape(-1)
        return out if padded else out[: self.own_numel(rank)].clone()

    def slice_rows(self, c: int, rank: int) -> tuple[int, int]:
        """Row range [begin, end) of the weight that rank `rank`'s slice of chunk c overlaps
        (empty when the slice is all padding)."""
        begin, end = self.chunk_rows(c)
        n = (end - begin) * self.cols
        lo, hi = min(rank * self.slice_numel, n), min((rank + 1) * self.slice_numel, n)
        if lo >= hi:
            return begin, begin
        return begin + lo // self.cols, begin + -(-hi // self.cols)

    def shard_from_rows(self, read_rows, rank: int, dtype: torch.dtype, device=None,
                        padded: bool = True) -> torch.Tensor:
        """`shard(weight, rank, padded)` without the whole weight: `read_rows(begin, end)`
        returns rows [begin, end) of the weight (any shape with (end - begin) * cols elements);
        only the rows that rank's slices overlap are read (about 1/world_size of the weight)."""
        self._check_rank(rank)
        out = torch.zeros(self.shard_numel if padded else self.own_numel(rank), dtype=dtype, device=device)
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
        """Inverse of `shard`: the full weight (rows, cols) from every rank's shard (padded or
        not)."""
        if len(shards) != self.world_size:
            raise ValueError(f"expected {self.world_size} shards, got {len(shards)}")
        shards = [self.pad_shard(s.reshape(-1), r) for r, s in enumerate(shards)]
        stacked = torch.stack([s.reshape(self.num_chunks, self.slice_numel) for s in shards], dim=1)
        chunks = stacked.reshape(self.num_chunks, self.world_size * self.slice_numel)
        out = chunks.new_empty(self.numel)
        for c in range(self.num_chunks):
            begin, end = self.chunk_rows(c)
            n = (end - begin) * self.cols
            out[begin * self.cols : begin * self.cols + n] = chunks[c, :n]
        return out.view(self.rows, self.cols)
