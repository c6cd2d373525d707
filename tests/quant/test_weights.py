"""Each rank's shard of a quantized weight (python_api/quant/weights.py): equal bit for bit to
the rank's slice of the whole image, built from only the rows it needs."""

from __future__ import annotations

import pytest
import torch

from elastic_kernels.api.quant.weights import quantized_shard
from elastic_kernels.quant import QuantizedLayout

CASES = [
    # rows, cols, rows_per_chunk, fmt, block, nested
    (37, 128, 8, "nf4", 64, False),  # ragged last chunk of 5 rows
    (37, 128, 8, "nf4", 64, True),
    (20, 256, 20, "nf4", 128, False),  # one chunk
    (33, 64, 4, "int8", 32, False),
    (9, 512, 2, "int8", 256, False),
    (600, 64, 600, "nf4", 64, True),  # 600 blocks: three groups of nested scales
    # issue 28: blocks over the flattened weight, starting mid-row; every last chunk ends in a
    # partial block (5 rows of 688: 53.75 blocks of 64), an odd count of weights (13 x 687)
    (37, 688, 8, "nf4", 64, False),
    (37, 688, 8, "nf4", 64, True),
    (37, 688, 16, "int8", 256, False),
    (13, 687, 64, "nf4", 64, False),
    (130, 101, 64, "int8", 64, False),
]


def _needed_rows(ql: QuantizedLayout, storage, rank: int) -> set[int]:
    """Brute force: the rows of the weight whose bytes (codes, scales) lie in this rank's
    slices; with nested scales every row of a chunk whose slice is not empty (the chunk's
    statistics depend on all of them)."""
    need = set()
    for c, f in enumerate(ql.formats):
        lo = rank * storage.slice_numel
        hi = min((rank + 1) * storage.slice_numel, f.total_bytes)
        if lo >= hi:
            continue
        base = c * ql.rows_per_chunk
        if f.nested:
            need.update(range(base, base + f.rows))
            continue
        per = 2 if f.name == "nf4" else 1  # weights per code byte
        for k in range(f.num_blocks):  # block k: weights [w0, w1) of the chunk, flattened
            w0, w1 = k * f.block_size, min((k + 1) * f.block_size, f.numel)
            spans = [(w0 // per, -(-w1 // per)), (f.scales_offset + 4 * k, f.scales_offset + 4 * k + 4)]
            if any(a < hi and lo < b for a, b in spans):
                need.update(range(base + w0 // f.cols, base + -(-w1 // f.cols)))
    return need


@pytest.mark.parametrize("case", CASES, ids=[f"{c[0]}x{c[1]}/{c[2]}-{c[3]}{c[4]}{'n' if c[5] else ''}" for c in CASES])
@pytest.mark.parametrize("world_size", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_shard_is_the_slice_of_the_image(case, world_size, dtype):
    rows, cols, rpc, fmt, block, nested = case
    w = (torch.randn(rows, cols, generator=torch.Generator().manual_seed(rows + cols)) *
         torch.linspace(0.1, 3.0, cols)).to(dtype)
    ql = QuantizedLayout(rows, cols, rpc, fmt, block, nested)
    storage = ql.image_layout(world_size)
    image = ql.quantize(w)
    for rank in range(world_size):
        read = []

        def rows_of(b, e):
            read.extend(range(b, e))
            return w[b:e].float()  # the reader casts back to the weight's dtype: exact

        shard = quantized_shard(ql, storage, rows_of, rank, dtype, "cpu")
        want = storage.shard(image, rank)
        assert shard.dtype == torch.uint8 and torch.equal(shard, want), f"rank {rank}"
        assert set(read) == _needed_rows(ql, storage, rank), f"rank {rank} read rows it does not need"
    if world_size >= 4 and not nested and rpc >= 8:  # a middle rank reads about 1/W of each chunk
        assert len(_needed_rows(ql, storage, 1)) < rows


@pytest.mark.parametrize("case", CASES, ids=[f"{c[0]}x{c[1]}/{c[2]}-{c[3]}{c[4]}{'n' if c[5] else ''}" for c in CASES])
def test_host_store_shares_tile_the_image(case):
    """fill_image_share ([Note: filling the host store]): shares of rows that partition the
    weight (cut anywhere, mid-chunk and, for rows no block divides, mid-block) write disjoint
    bytes that together are the whole image, bit for bit."""
    from elastic_kernels.api.quant.weights import fill_image_share

    rows, cols, rpc, fmt, block, nested = case
    w = torch.randn(rows, cols, generator=torch.Generator().manual_seed(rows * cols))
    ql = QuantizedLayout(rows, cols, rpc, fmt, block, nested)
    image = ql.quantize(w)
    cuts = sorted({0, rows, 1, rows // 3, rows // 2 + 1, rows - 1})
    written = torch.zeros(ql.total_bytes, dtype=torch.int32)
    store = torch.zeros(ql.total_bytes, dtype=torch.uint8)
    for r0, r1 in zip(cuts, cuts[1:]):
        mine = torch.full((ql.total_bytes,), 0xA5, dtype=torch.uint8)
        fill_image_share(ql, lambda b, e: w[b:e], r0, r1, mine, torch.float32, "cpu")
        probe = torch.full((ql.total_bytes,), 0x5A, dtype=torch.uint8)
        fill_image_share(ql, lambda b, e: w[b:e], r0, r1, probe, torch.float32, "cpu")
        touched = mine != 0xA5
        touched |= probe != 0x5A  # a byte written with the sentinel's own value shows in the other
        written += touched.int()
        store[touched] = mine[touched]  # a byte equal to 0xA5 is that value, written
    assert bool((written == 1).all()), f"bytes written {int((written == 0).sum())} times 0, {int((written > 1).sum())} twice"
    assert torch.equal(store, image)


def test_nonfinite_rows_are_counted_while_quantizing():
    """A quantized shard holds no value a finiteness check could read (codes are integers), so
    the rows read to build it are counted: what the CLI's load check reports
    (python_api/finetune/engines.py, _nonfinite_loaded)."""
    import torch.nn as nn

    from elastic_kernels.api import ElasticPolicy
    from elastic_kernels.api.nn import elasticize

    lin = nn.Linear(64, 16).requires_grad_(False)
    with torch.no_grad():
        lin.weight[3, 5] = float("nan")
        lin.weight[9, 0] = float("inf")
    model = elasticize(nn.Sequential(lin), ElasticPolicy(weight_format="nf4", replicate_below_bytes=0))
    assert model[0].et.nonfinite_read == 2
    clean = elasticize(nn.Sequential(nn.Linear(64, 16).requires_grad_(False)),
                       ElasticPolicy(weight_format="int8", quant_block_size=32, replicate_below_bytes=0))
    assert clean[0].et.nonfinite_read == 0
