"""Argument checks of the `elastic` ops, shared by every Python impl (references, Triton ops,
fake impls). Shape-only where they can be, so they also run under FakeTensorMode; every error
names the argument at fault. The C++ twin of the pack checks is csrc/ops.cpp (same messages,
same exception types).

Nearly a leaf: it imports torch, and elastic_kernels.quant (the blob formats, torch only) for
the dequant checks.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch._subclasses.fake_tensor import is_fake

from elastic_kernels.quant import FORMATS, ChunkFormat, chunk_formats

_ELEM_SIZES = (1, 2, 4, 8)


def has_storage(t: torch.Tensor) -> bool:
    """Whether t has real memory (not a fake/meta tensor met while tracing)."""
    return t.device.type != "meta" and not is_fake(t)


# ---------------------------------------------------------------------------------------------
# pack_shards / unpack_gathered
# ---------------------------------------------------------------------------------------------


def int_list(op: str, name: str, values) -> list[int]:
    if isinstance(values, torch.Tensor) or not isinstance(values, Sequence):
        raise ValueError(f"{op}: {name} must be a sequence of ints, got {type(values).__name__}")
    out = []
    for k, v in enumerate(values):
        if isinstance(v, bool) or not isinstance(v, (int, torch.SymInt)):
            raise ValueError(f"{op}: {name}[{k}] must be an int, got {type(v).__name__}")
        out.append(v)
    return out


def tensor_list(op: str, name: str, values) -> list[torch.Tensor]:
    if isinstance(values, torch.Tensor) or not isinstance(values, Sequence):
        raise ValueError(f"{op}: {name} must be a sequence of tensors, got {type(values).__name__}")
    for k, t in enumerate(values):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{op}: {name}[{k}] must be a tensor, got {type(t).__name__}")
    return list(values)


def _check_elem_size(op: str, name: str, t: torch.Tensor) -> None:
    if t.element_size() not in _ELEM_SIZES:
        raise ValueError(
            f"{op}: {name} has dtype {t.dtype} with {t.element_size()}-byte elements; "
            f"supported element sizes are 1, 2, 4 and 8 bytes"
        )


def _check_len(op: str, name: str, got: int, ref: str, want: int) -> None:
    if got != want:
        raise ValueError(f"{op}: {name} has {got} entries but {ref} has {want} (one per weight)")


def check_pack_args(shards, slice_numels, chunk_begins, chunk_ends, *, op: str = "elastic::pack_shards"):
    """Validate pack_shards arguments; return (total numel, per-weight offsets in the output)."""
    shards = tensor_list(op, "shards", shards)
    slice_numels = int_list(op, "slice_numels", slice_numels)
    chunk_begins = int_list(op, "chunk_begins", chunk_begins)
    chunk_ends = int_list(op, "chunk_ends", chunk_ends)
    if not shards:
        raise ValueError(f"{op}: shards must not be empty (the send buffer takes its dtype and device from shards[0])")
    n = len(shards)
    _check_len(op, "slice_numels", len(slice_numels), "shards", n)
    _check_len(op, "chunk_begins", len(chunk_begins), "shards", n)
    _check_len(op, "chunk_ends", len(chunk_ends), "shards", n)
    first = shards[0]
    total, offsets = 0, []
    for i, t in enumerate(shards):
        name = f"shards[{i}]"
        if t.dtype != first.dtype:
            raise ValueError(f"{op}: {name} has dtype {t.dtype} but shards[0] has dtype {first.dtype}; all shards must have one dtype")
        if t.device != first.device:
            raise ValueError(f"{op}: {name} is on device {t.device} but shards[0] is on {first.device}; all shards must be on one device")
        _check_elem_size(op, name, t)
        if t.dim() != 1:
            raise ValueError(f"{op}: {name} must be 1-D (a flat shard), got shape {tuple(t.shape)}")
        if not t.is_contiguous():
            raise ValueError(f"{op}: {name} must be contiguous")
        s = slice_numels[i]
        if s < 1:
            raise ValueError(f"{op}: slice_numels[{i}] must be >= 1, got {s}")
        if t.numel() % s != 0:
            raise ValueError(f"{op}: {name} has {t.numel()} elements, not a multiple of slice_numels[{i}] = {s}")
        chunks = t.numel() // s
        cb, ce = chunk_begins[i], chunk_ends[i]
        if not 0 <= cb <= ce <= chunks:
            raise ValueError(
                f"{op}: chunk range [chunk_begins[{i}], chunk_ends[{i}]) = [{cb}, {ce}) is not within the "
                f"{chunks} chunks of {name} (need 0 <= begin <= end <= {chunks})"
            )
        offsets.append(total)
        total += (ce - cb) * s
    return total, offsets


def check_unpack_args(gathered, world_size, slice_numels, chunk_counts, dests, *, op: str = "elastic::unpack_gathered"):
    """Validate unpack_gathered arguments; return (per_rank, dest_weight, dest_base): per dest,
    the index of its weight and the offset of its chunk inside one rank's block."""
    if not isinstance(gathered, torch.Tensor):
        raise ValueError(f"{op}: gathered must be a tensor, got {type(gathered).__name__}")
    if isinstance(world_size, bool) or not isinstance(world_size, (int, torch.SymInt)):
        raise ValueError(f"{op}: world_size must be an int, got {type(world_size).__name__}")
    slice_numels = int_list(op, "slice_numels", slice_numels)
    chunk_counts = int_list(op, "chunk_counts", chunk_counts)
    dests = tensor_list(op, "dests", dests)
    if world_size < 1:
        raise ValueError(f"{op}: world_size must be >= 1, got {world_size}")
    _check_len(op, "chunk_counts", len(chunk_counts), "slice_numels", len(slice_numels))
    _check_elem_size(op, "gathered", gathered)
    if not gathered.is_contiguous():
        raise ValueError(f"{op}: gathered must be contiguous")
    per_rank, seg_offset = 0, []
    for i, (s, c) in enumerate(zip(slice_numels, chunk_counts)):
        if s < 1:
            raise ValueError(f"{op}: slice_numels[{i}] must be >= 1, got {s}")
        if c < 0:
            raise ValueError(f"{op}: chunk_counts[{i}] must be >= 0, got {c}")
        seg_offset.append(per_rank)
        per_rank += c * s
    if not (gathered.dim() == 1 or (gathered.dim() == 2 and gathered.shape[0] == world_size)):
        raise ValueError(
            f"{op}: gathered must be 1-D or [world_size, per_rank] = [{world_size}, {per_rank}], "
            f"got shape {tuple(gathered.shape)}"
        )
    if gathered.numel() != world_size * per_rank:
        raise ValueError(
            f"{op}: gathered has {gathered.numel()} elements but world_size * per_rank = "
            f"{world_size} * {per_rank} = {world_size * per_rank} (per_rank = sum of chunk_counts[i] * slice_numels[i])"
        )
    num_dests = sum(chunk_counts)
    if len(dests) != num_dests:
        raise ValueError(f"{op}: dests has {len(dests)} tensors but sum(chunk_counts) = {num_dests} (one dest per chunk)")
    dest_weight, dest_base = [], []
    k = 0
    for i, (s, c) in enumerate(zip(slice_numels, chunk_counts)):
        for j in range(c):
            d, name = dests[k], f"dests[{k}]"
            if d.dtype != gathered.dtype:
                raise ValueError(f"{op}: {name} has dtype {d.dtype} but gathered has dtype {gathered.dtype}")
            if d.device != gathered.device:
                raise ValueError(f"{op}: {name} is on device {d.device} but gathered is on {gathered.device}")
            if not d.is_contiguous():
                raise ValueError(f"{op}: {name} must be contiguous")
            if not 0 < d.numel() <= world_size * s:
                raise ValueError(
                    f"{op}: {name} (chunk {j} of weight {i}) has {d.numel()} elements; a chunk has between "
                    f"1 and world_size * slice_numels[{i}] = {world_size * s} elements"
                )
            dest_weight.append(i)
            dest_base.append(seg_offset[i] + j * s)
            k += 1
    _check_no_overlap(op, gathered, dests)
    return per_rank, dest_weight, dest_base


def _check_no_overlap(op: str, gathered: torch.Tensor, dests: list[torch.Tensor]) -> None:
    """Raise if two of gathered, dests[0], ... share bytes (checked only on real memory)."""
    if not has_storage(gathered) or not all(has_storage(d) for d in dests):
        return
    ranges = [(d.data_ptr(), d.data_ptr() + d.numel() * d.element_size(), f"dests[{k}]") for k, d in enumerate(dests)]
    if gathered.numel() > 0:
        ranges.append((gathered.data_ptr(), gathered.data_ptr() + gathered.numel() * gathered.element_size(), "gathered"))
    ranges.sort()
    far = 0  # among the ranges before k (sorted by start), the one reaching furthest
    for k in range(1, len(ranges)):
        if ranges[k][0] < ranges[far][1]:
            raise ValueError(
                f"{op}: {ranges[far][2]} and {ranges[k][2]} overlap in memory; every dest must have "
                f"memory of its own, apart from gathered and from the other dests"
            )
        if ranges[k][1] > ranges[far][1]:
            far = k


# ---------------------------------------------------------------------------------------------
# paged_lora_linear_fwd / _dgrad, lora_adapter_grads ([Note: numerics of the paged LoRA ops] in
# paged_linear_reference.py says which dtypes go together)
# ---------------------------------------------------------------------------------------------


def _check_tensor(t, name: str, ndim: int) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != ndim:
        raise ValueError(f"{name} must be {ndim}-D, got shape {tuple(t.shape)}")


def _check_like(t: torch.Tensor, name: str, ref: torch.Tensor, ref_name: str) -> None:
    if t.dtype != ref.dtype:
        raise TypeError(f"{name} has dtype {t.dtype}, but {ref_name} has dtype {ref.dtype}; they must match")
    if t.device != ref.device:
        raise ValueError(f"{name} is on {t.device}, but {ref_name} is on {ref.device}; they must be on one device")


def check_chunks(chunks: Sequence[torch.Tensor], x: torch.Tensor, x_name: str, k: int | None) -> tuple[int, int, int]:
    """Validate a page table; return (N = total rows, K = row length, rows_per_chunk).

    ``k`` is the row length the caller expects (None: take it from the chunks).
    """
    if isinstance(chunks, torch.Tensor) or not isinstance(chunks, (list, tuple)):
        raise TypeError(f"chunks must be a list of 2-D tensors, got {type(chunks).__name__}")
    if len(chunks) == 0:
        raise ValueError("chunks is empty: a weight needs at least one chunk")
    for i, c in enumerate(chunks):
        _check_tensor(c, f"chunks[{i}]", 2)
        _check_like(c, f"chunks[{i}]", x, x_name)
        if not c.is_contiguous():
            raise ValueError(f"chunks[{i}] is not contiguous (strides {c.stride()}); a chunk must be a contiguous page")
    rows_per_chunk = int(chunks[0].shape[0])
    cols = int(chunks[0].shape[1])
    if rows_per_chunk < 1:
        raise ValueError("chunks[0] has no rows")
    if cols < 1:
        raise ValueError("chunks[0] has no columns (in_features must be positive)")
    if k is not None and cols != k:
        raise ValueError(f"chunks[0] has {cols} columns but {x_name} has {k} features (K mismatch)")
    total = 0
    last = len(chunks) - 1
    for i, c in enumerate(chunks):
        rows, ccols = int(c.shape[0]), int(c.shape[1])
        if ccols != cols:
            raise ValueError(
                f"chunks[{i}] has {ccols} columns but chunks[0] has {cols}; every chunk must have the same K"
            )
        if i < last and rows != rows_per_chunk:
            raise ValueError(
                f"chunks[{i}] has {rows} rows but rows_per_chunk is {rows_per_chunk} (rows of chunks[0]); "
                f"only the last chunk may be ragged"
            )
        if i == last and not 1 <= rows <= rows_per_chunk:
            raise ValueError(
                f"chunks[{i}] (the last chunk) has {rows} rows; it must have 1..{rows_per_chunk} (rows_per_chunk)"
            )
        total += rows
    return total, cols, rows_per_chunk


def check_fwd_args(x, chunks, bias, lora_x, lora_a, lora_b) -> tuple[int, int, int, int, int]:
    """Validate the forward's arguments; return (T, K, N, r, rows_per_chunk) (r = 0 without LoRA)."""
    _check_tensor(x, "x", 2)
    t, k = int(x.shape[0]), int(x.shape[1])
    n, _, rows_per_chunk = check_chunks(chunks, x, "x", k)
    if bias is not None:
        _check_tensor(bias, "bias", 1)
        _check_like(bias, "bias", x, "x")
        if int(bias.shape[0]) != n:
            raise ValueError(f"bias has {int(bias.shape[0])} elements but the chunks hold {n} rows (out_features)")
    r = _check_lora(lora_a, lora_b, x, "x", k, n)
    if lora_x is not None:
        _check_tensor(lora_x, "lora_x", 2)
        _check_like(lora_x, "lora_x", x, "x")
        if tuple(lora_x.shape) != tuple(x.shape):
            raise ValueError(f"lora_x has shape {tuple(lora_x.shape)} but x has shape {tuple(x.shape)}")
    return t, k, n, r, rows_per_chunk


def adapter_dtypes(activation: torch.dtype) -> tuple[torch.dtype, ...]:
    """The adapter dtypes allowed with `activation` ([Note: numerics of the paged LoRA ops])."""
    return (activation,) if activation == torch.float32 else (activation, torch.float32)


def _check_adapter_dtype(t: torch.Tensor, name: str, ref: torch.Tensor, ref_name: str) -> None:
    """t is in the adapter dtype of ref's activations (ref's dtype or fp32), on ref's device."""
    if t.dtype not in adapter_dtypes(ref.dtype):
        raise TypeError(
            f"{name} has dtype {t.dtype}, but {ref_name} has dtype {ref.dtype}; {name} must have "
            f"{ref_name}'s dtype or torch.float32 (the adapter dtype)"
        )
    if t.device != ref.device:
        raise ValueError(f"{name} is on {t.device}, but {ref_name} is on {ref.device}; they must be on one device")


def _check_lora(lora_a, lora_b, ref, ref_name: str, k: int, n: int) -> int:
    if (lora_a is None) != (lora_b is None):
        missing = "lora_a" if lora_a is None else "lora_b"
        raise ValueError(f"{missing} is None but the other adapter is given; pass both or neither")
    if lora_a is None:
        return 0
    _check_tensor(lora_a, "lora_a", 2)
    _check_tensor(lora_b, "lora_b", 2)
    _check_adapter_dtype(lora_a, "lora_a", ref, ref_name)
    _check_adapter_dtype(lora_b, "lora_b", ref, ref_name)
    if lora_b.dtype != lora_a.dtype:
        raise TypeError(
            f"lora_b has dtype {lora_b.dtype}, but lora_a has dtype {lora_a.dtype}; the two adapters "
            f"must share one dtype"
        )
    r = int(lora_a.shape[0])
    if r < 1:
        raise ValueError(f"lora_a has {r} rows: the LoRA rank r must be positive")
    if int(lora_a.shape[1]) != k:
        raise ValueError(f"lora_a has {int(lora_a.shape[1])} columns but the weight has K = {k} (in_features)")
    if int(lora_b.shape[1]) != r:
        raise ValueError(f"lora_b has {int(lora_b.shape[1])} columns but lora_a has r = {r} rows (rank mismatch)")
    if int(lora_b.shape[0]) != n:
        raise ValueError(f"lora_b has {int(lora_b.shape[0])} rows but the chunks hold {n} rows (out_features)")
    return r


def check_dgrad_args(dy, chunks, lora_a, lora_b) -> tuple[int, int, int, int, int]:
    """Validate the dgrad's arguments; return (T, K, N, r, rows_per_chunk)."""
    _check_tensor(dy, "dy", 2)
    t = int(dy.shape[0])
    n, k, rows_per_chunk = check_chunks(chunks, dy, "dy", None)
    if int(dy.shape[1]) != n:
        raise ValueError(f"dy has {int(dy.shape[1])} columns but the chunks hold {n} rows (out_features)")
    r = _check_lora(lora_a, lora_b, dy, "dy", k, n)
    return t, k, n, r, rows_per_chunk


def check_adapter_grad_args(lora_x, xa, dy, dyb) -> tuple[int, int, int, int]:
    """Validate the adapter gradients' arguments; return (T, K, N, r)."""
    _check_tensor(lora_x, "lora_x", 2)
    _check_tensor(xa, "xa", 2)
    _check_tensor(dy, "dy", 2)
    _check_tensor(dyb, "dyb", 2)
    # lora_x, dy: the activation dtype; xa, dyb: the adapter dtype (lora_x's dtype or fp32).
    _check_adapter_dtype(xa, "xa", lora_x, "lora_x")
    _check_like(dy, "dy", lora_x, "lora_x")
    _check_like(dyb, "dyb", xa, "xa")
    t, k = int(lora_x.shape[0]), int(lora_x.shape[1])
    for ten, name in ((xa, "xa"), (dy, "dy"), (dyb, "dyb")):
        if int(ten.shape[0]) != t:
            raise ValueError(f"{name} has {int(ten.shape[0])} rows (tokens) but lora_x has {t}")
    r = int(xa.shape[1])
    if r < 1:
        raise ValueError("xa has 0 columns: adapter gradients need a LoRA rank r >= 1")
    if int(dyb.shape[1]) != r:
        raise ValueError(f"dyb has {int(dyb.shape[1])} columns but xa has r = {r} (rank mismatch)")
    if k < 1:
        raise ValueError("lora_x has 0 columns (in_features must be positive)")
    n = int(dy.shape[1])
    if n < 1:
        raise ValueError("dy has 0 columns (out_features must be positive)")
    return t, k, n, r


# ---------------------------------------------------------------------------------------------
# dequant_chunks / dequant_chunks_into (elastic_kernels/quant/blob.py [Note: quantized chunk
# blob]); the C++ twin is check_dequant_args in csrc/ops.cpp (same messages, same types)
# ---------------------------------------------------------------------------------------------

DEQUANT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_DTYPE_NAMES = "torch.float32, torch.bfloat16 or torch.float16"


def _check_dequant_dtype(op: str, name: str, dtype) -> None:
    if dtype not in DEQUANT_DTYPES:
        raise TypeError(f"{op}: {name} must be {_DTYPE_NAMES} (the compute dtype), got {dtype}")


def check_dequant_args(
    blobs, fmt, rows, cols, rows_per_chunk, block_size, nested, dtype, out, *, op: str
) -> list[ChunkFormat]:
    """Validate the arguments of a dequant op; return the format of each blob's chunk.

    ``out`` None: the functional op (``dtype`` is the output dtype); else the output tensor
    (``dtype`` is ignored). Shape-only where it can be, so it runs under FakeTensorMode too.
    """
    blobs = tensor_list(op, "blobs", blobs)
    if not blobs:
        raise ValueError(f"{op}: blobs must not be empty (one blob per chunk)")
    if fmt not in FORMATS:
        raise ValueError(f"{op}: format must be one of {FORMATS}, got {fmt!r}")
    for name, v in (("rows", rows), ("cols", cols), ("rows_per_chunk", rows_per_chunk), ("block_size", block_size)):
        if isinstance(v, bool) or not isinstance(v, int):
            raise TypeError(f"{op}: {name} must be an int, got {type(v).__name__}")
        if v < 1:
            raise ValueError(f"{op}: {name} must be >= 1, got {v}")
    n = len(blobs)
    if not (n - 1) * rows_per_chunk < rows <= n * rows_per_chunk:
        raise ValueError(
            f"{op}: {n} blobs of rows_per_chunk = {rows_per_chunk} rows hold {(n - 1) * rows_per_chunk + 1} to "
            f"{n * rows_per_chunk} rows, but rows = {rows} (every chunk but the last is full)"
        )
    try:
        formats = chunk_formats(fmt, rows, cols, rows_per_chunk, block_size, bool(nested))
    except ValueError as e:
        raise ValueError(f"{op}: {e}") from None
    first = blobs[0]
    for i, (b, f) in enumerate(zip(blobs, formats)):
        name = f"blobs[{i}]"
        if b.dtype != torch.uint8:
            raise TypeError(f"{op}: {name} has dtype {b.dtype}; a blob is bytes (torch.uint8)")
        if b.device != first.device:
            raise ValueError(f"{op}: {name} is on device {b.device} but blobs[0] is on {first.device}; all blobs must be on one device")
        if b.dim() != 1:
            raise ValueError(f"{op}: {name} must be 1-D (one chunk's bytes), got shape {tuple(b.shape)}")
        if not b.is_contiguous():
            raise ValueError(f"{op}: {name} must be contiguous")
        if b.numel() != f.total_bytes:
            raise ValueError(
                f"{op}: {name} has {b.numel()} bytes but the {fmt} blob of its chunk ({f.rows} x {cols} weights, "
                f"block {block_size}{', nested' if f.nested else ''}) has {f.total_bytes}"
            )
    if out is None:
        _check_dequant_dtype(op, "dtype", dtype)
        return formats
    if not isinstance(out, torch.Tensor):
        raise TypeError(f"{op}: out must be a tensor, got {type(out).__name__}")
    _check_dequant_dtype(op, "out's dtype", out.dtype)
    if out.device != first.device:
        raise ValueError(f"{op}: out is on device {out.device} but blobs[0] is on {first.device}")
    if tuple(out.shape) != (rows, cols):
        raise ValueError(f"{op}: out must have shape [rows, cols] = [{rows}, {cols}], got {list(out.shape)}")
    if not out.is_contiguous():
        raise ValueError(f"{op}: out must be contiguous")
    if has_storage(out) and all(has_storage(b) for b in blobs):
        lo, hi = out.data_ptr(), out.data_ptr() + out.numel() * out.element_size()
        for i, b in enumerate(blobs):
            if b.data_ptr() < hi and lo < b.data_ptr() + b.numel():
                raise ValueError(f"{op}: out and blobs[{i}] overlap in memory; out must have memory of its own")
    return formats


# ---------------------------------------------------------------------------------------------
# segmented_lora_fwd / segmented_lora_bwd (segmented_lora_reference.py says what they compute;
# the dtypes go together as in [Note: numerics of the paged LoRA ops])
# ---------------------------------------------------------------------------------------------


def check_seg_offsets(seg_offsets, t: int, k: int | None = None) -> list[int]:
    """Validate segment offsets over `t` rows (K + 1 non-decreasing ints from 0 to t); return them."""
    if isinstance(seg_offsets, torch.Tensor):
        raise TypeError(
            "seg_offsets must be a list of ints (host data: the kernels' tile table is built from it), "
            "got a tensor; pass seg_offsets.tolist()"
        )
    if not isinstance(seg_offsets, Sequence):
        raise TypeError(f"seg_offsets must be a list of ints, got {type(seg_offsets).__name__}")
    offs = []
    for i, v in enumerate(seg_offsets):
        if isinstance(v, bool) or not isinstance(v, (int, torch.SymInt)):
            raise TypeError(f"seg_offsets[{i}] must be an int, got {type(v).__name__}")
        offs.append(v)
    if len(offs) < 2:
        raise ValueError(f"seg_offsets has {len(offs)} entries; it needs K + 1 >= 2 (one segment per adapter)")
    if k is not None and len(offs) != k + 1:
        raise ValueError(f"seg_offsets has {len(offs)} entries but there are {k} adapters (lora_a); it needs K + 1 = {k + 1}")
    if offs[0] != 0:
        raise ValueError(f"seg_offsets[0] is {offs[0]}; the first segment must start at row 0")
    for i in range(1, len(offs)):
        if offs[i] < offs[i - 1]:
            raise ValueError(
                f"seg_offsets is not non-decreasing: seg_offsets[{i}] = {offs[i]} < seg_offsets[{i - 1}] = {offs[i - 1]} "
                f"(rows must be sorted by adapter; an empty segment repeats an offset)"
            )
    if offs[-1] != t:
        raise ValueError(f"seg_offsets ends at {offs[-1]} but there are {t} rows; the last offset must be T = {t}")
    return offs


def check_segmented_adapters(lora_a, lora_b, scales, ref: torch.Tensor, ref_name: str, k_in: int,
                             n_out: int | None) -> tuple[int, int, list[int]]:
    """Validate K adapters (lora_a[k] [r_k, in], lora_b[k] [out, r_k], scales[k]) against the
    activations `ref`; return (K, out_features, ranks)."""
    for name, v, what in (("lora_a", lora_a, "[r_k, in_features]"), ("lora_b", lora_b, "[out_features, r_k]")):
        if isinstance(v, torch.Tensor) or not isinstance(v, Sequence):
            raise TypeError(f"{name} must be a list of K tensors {what} (one per adapter), got {type(v).__name__}")
        for i, t in enumerate(v):
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"{name}[{i}] must be a torch.Tensor, got {type(t).__name__}")
    if isinstance(scales, torch.Tensor) or not isinstance(scales, Sequence):
        raise TypeError(f"scales must be a list of K floats, got {type(scales).__name__}")
    k = len(lora_a)
    n_name = "dy has" if n_out is not None else ""
    if k == 0:
        raise ValueError("lora_a is empty: the segmented LoRA op needs at least one adapter")
    if len(lora_b) != k:
        raise ValueError(f"lora_b has {len(lora_b)} adapters but lora_a has {k}; one of each per adapter")
    if len(scales) != k:
        raise ValueError(f"scales has {len(scales)} entries but lora_a has {k} adapters; one scale per adapter")
    ranks = []
    for i, (a, b, s) in enumerate(zip(lora_a, lora_b, scales)):
        _check_tensor(a, f"lora_a[{i}]", 2)
        _check_tensor(b, f"lora_b[{i}]", 2)
        _check_adapter_dtype(a, f"lora_a[{i}]", ref, ref_name)
        _check_adapter_dtype(b, f"lora_b[{i}]", ref, ref_name)
        if a.dtype != lora_a[0].dtype or b.dtype != lora_a[0].dtype:
            raise TypeError(
                f"lora_a[{i}] / lora_b[{i}] have dtypes {a.dtype} / {b.dtype}, but lora_a[0] has {lora_a[0].dtype}; "
                f"every adapter must have one dtype (the adapter dtype)"
            )
        if isinstance(s, bool) or not isinstance(s, (int, float)) or s != s or s in (float("inf"), float("-inf")):
            raise TypeError(f"scales[{i}] must be a finite float, got {s!r}")
        r = int(a.shape[0])
        if r < 1:
            raise ValueError(f"lora_a[{i}] has {r} rows: the LoRA rank r must be positive")
        if int(a.shape[1]) != k_in:
            raise ValueError(f"lora_a[{i}] has {int(a.shape[1])} columns but {ref_name} has {k_in} features (in_features)")
        if int(b.shape[1]) != r:
            raise ValueError(f"lora_b[{i}] has {int(b.shape[1])} columns but lora_a[{i}] has r = {r} rows (rank mismatch)")
        if n_out is None:
            n_out, n_name = int(b.shape[0]), "lora_b[0] has"
        if int(b.shape[0]) != n_out:
            raise ValueError(
                f"lora_b[{i}] has {int(b.shape[0])} rows (out_features) but {n_name} {n_out}; every adapter "
                f"has the layer's out_features"
            )
        ranks.append(r)
    if n_out < 1:
        raise ValueError("lora_b[0] has 0 rows (out_features must be positive)")
    return k, n_out, ranks


def check_segmented_fwd_args(x, seg_offsets, lora_a, lora_b, scales, lora_x) -> tuple[int, int, int, list[int], list[int]]:
    """Validate the segmented forward's arguments; return (T, in, out, seg_offsets, ranks)."""
    _check_tensor(x, "x", 2)
    t, k_in = int(x.shape[0]), int(x.shape[1])
    if k_in < 1:
        raise ValueError("x has 0 columns (in_features must be positive)")
    if lora_x is not None:
        _check_tensor(lora_x, "lora_x", 2)
        _check_like(lora_x, "lora_x", x, "x")
        if tuple(lora_x.shape) != tuple(x.shape):
            raise ValueError(f"lora_x has shape {tuple(lora_x.shape)} but x has shape {tuple(x.shape)}")
    k, n, ranks = check_segmented_adapters(lora_a, lora_b, scales, x, "x", k_in, None)
    offs = check_seg_offsets(seg_offsets, t, k)
    return t, k_in, n, offs, ranks


def check_segmented_bwd_args(dy, lora_x, xa, seg_offsets, lora_a, lora_b, scales) -> tuple[int, int, int, list[int], list[int]]:
    """Validate the segmented backward's arguments; return (T, in, out, seg_offsets, ranks)."""
    _check_tensor(dy, "dy", 2)
    _check_tensor(lora_x, "lora_x", 2)
    _check_tensor(xa, "xa", 2)
    _check_like(dy, "dy", lora_x, "lora_x")
    t, k_in, n = int(lora_x.shape[0]), int(lora_x.shape[1]), int(dy.shape[1])
    if int(dy.shape[0]) != t:
        raise ValueError(f"dy has {int(dy.shape[0])} rows but lora_x has {t}")
    if k_in < 1:
        raise ValueError("lora_x has 0 columns (in_features must be positive)")
    k, n, ranks = check_segmented_adapters(lora_a, lora_b, scales, lora_x, "lora_x", k_in, n)
    offs = check_seg_offsets(seg_offsets, t, k)
    if xa.dtype != lora_a[0].dtype:
        raise TypeError(f"xa has dtype {xa.dtype}, but the adapters have {lora_a[0].dtype}; xa is in the adapter dtype "
                        f"(as segmented_lora_fwd returned it)")
    if xa.device != lora_x.device:
        raise ValueError(f"xa is on {xa.device}, but lora_x is on {lora_x.device}; they must be on one device")
    if tuple(xa.shape) != (t, max(ranks)):
        raise ValueError(f"xa has shape {tuple(xa.shape)} but segmented_lora_fwd returns [T, max rank] = "
                         f"[{t}, {max(ranks)}]")
    return t, k_in, n, offs, ranks
