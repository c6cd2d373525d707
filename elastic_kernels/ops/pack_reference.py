"""Pure-torch references of the elastic:: copy ops: the meaning every fast impl must match bit
for bit, and the CPU default where the extension is absent (pack.py [Note: which impl runs]).

They restate layout.py [Note: chunk-major shard layout] with slicing and reshapes instead of
index arithmetic, so they share no code with the kernels beyond the argument checks.
"""

from __future__ import annotations

import torch

from elastic_kernels.ops._checks import check_pack_args, check_unpack_args


def pack_shards_reference(shards, slice_numels, chunk_begins, chunk_ends) -> torch.Tensor:
    """For each weight i: shards[i][chunk_begins[i]*s_i : chunk_ends[i]*s_i], concatenated."""
    check_pack_args(shards, slice_numels, chunk_begins, chunk_ends, op="pack_shards_reference")
    pieces = [t[cb * s : ce * s] for t, s, cb, ce in zip(shards, slice_numels, chunk_begins, chunk_ends)]
    return torch.cat(pieces)


def unpack_gathered_reference(gathered, world_size, slice_numels, chunk_counts, dests) -> None:
    """Viewed as [world_size, per_rank], the columns of one chunk are its slices, rank after
    rank: flattening them row-major gives the zero-padded chunk, whose head is the dest."""
    per_rank, _, _ = check_unpack_args(
        gathered, world_size, slice_numels, chunk_counts, dests, op="unpack_gathered_reference"
    )
    blocks = gathered.reshape(world_size, per_rank)
    k, seg = 0, 0
    for s, count in zip(slice_numels, chunk_counts):
        for j in range(count):
            padded_chunk = blocks[:, seg + j * s : seg + (j + 1) * s].reshape(-1)
            dest = dests[k]
            dest.view(-1).copy_(padded_chunk[: dest.numel()])
            k += 1
        seg += count * s
