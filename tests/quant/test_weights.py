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
        for i in range(f.rows):
            if f.nested:
                need.add(base + i)
                continue
            k = f.numel // f.codes_bytes
            per_row_blocks = f.cols // f.block_size
            spans = [(i * f.cols // k, (i + 1) * f.cols // k),
                     (f.scales_offset + 4 * i * per_row_blocks, f.scales_offset + 4 * (i + 1) * per_row_blocks)]
            if any(a < hi and lo < b for a, b in spans):
                need.add(base + i)
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
