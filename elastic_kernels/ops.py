"""User-facing copy ops of chunked gathers: ``pack_shards`` and ``unpack_gathered``.

Each has four implementations with one meaning (layout.py [Note: chunk-major shard layout]):
the C++ CPU and CUDA kernels behind ``torch.ops.elastic.*`` (schemas in csrc/ops.cpp), the
Triton kernels ``torch.ops.elastic.*_triton`` (triton_pack.py), and the pure-torch references
(reference.py). This module also holds the argument checks shared by every Python impl and the
fake impls of the C++ ops.

[Note: which impl runs]
``impl="auto"`` (the default) picks, by the device of the data:
  - the registered C++ op when ``_C`` is loaded and has a kernel for that device (CPU always;
    CUDA when ``_C`` was built with its CUDA part). One dispatcher call, one kernel launch.
  - else, on CUDA: the Triton op (the package installed without the extension, or built
    without CUDA, still runs on GPUs);
  - else: the pure-torch reference (CPU without ``_C``, e.g. installed with ELASTIC_SKIP_EXT=1).
Triton is never chosen on CPU: under TRITON_INTERPRET=1 it is correct but orders of magnitude
slower than the reference. ``impl="cpp" | "triton" | "reference"`` forces one impl and raises
when it cannot run (``_C`` missing, Triton on CPU without the interpreter), never falling back
silently. Every impl checks its arguments and raises ValueError naming the argument at fault.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from elastic_kernels import _ext

IMPLS = ("auto", "cpp", "triton", "reference")
_ELEM_SIZES = (1, 2, 4, 8)


# ---------------------------------------------------------------------------------------------
# Argument checks shared by the Python impls (reference, Triton, fakes). The C++ twin is
# csrc/ops.cpp; both raise ValueError with the argument's name.
# ---------------------------------------------------------------------------------------------


def _has_storage(t: torch.Tensor) -> bool:
    """Whether t has real memory (not a fake/meta tensor met while tracing)."""
    from torch._subclasses.fake_tensor import is_fake

    return t.device.type != "meta" and not is_fake(t)


def _int_list(op: str, name: str, values) -> list[int]:
    if isinstance(values, torch.Tensor) or not isinstance(values, Sequence):
        raise ValueError(f"{op}: {name} must be a sequence of ints, got {type(values).__name__}")
    out = []
    for k, v in enumerate(values):
        if isinstance(v, bool) or not isinstance(v, (int, torch.SymInt)):
            raise ValueError(f"{op}: {name}[{k}] must be an int, got {type(v).__name__}")
        out.append(v)
    return out


def _tensor_list(op: str, name: str, values) -> list[torch.Tensor]:
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
    shards = _tensor_list(op, "shards", shards)
    slice_numels = _int_list(op, "slice_numels", slice_numels)
    chunk_begins = _int_list(op, "chunk_begins", chunk_begins)
    chunk_ends = _int_list(op, "chunk_ends", chunk_ends)
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
    slice_numels = _int_list(op, "slice_numels", slice_numels)
    chunk_counts = _int_list(op, "chunk_counts", chunk_counts)
    dests = _tensor_list(op, "dests", dests)
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
    if not _has_storage(gathered) or not all(_has_storage(d) for d in dests):
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
# Dispatch [Note: which impl runs]
# ---------------------------------------------------------------------------------------------


def _resolve(impl: str, device: torch.device) -> str:
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
    if impl != "auto":
        return impl
    if _ext.available() and (device.type != "cuda" or _ext.cuda_built()):
        return "cpp"
    return "triton" if device.type == "cuda" else "reference"


def _device_of(tensors: list[torch.Tensor]) -> torch.device:
    # no tensor at all: nothing to run on, and the impl's checks name the problem
    return tensors[0].device if tensors else torch.device("cpu")


def pack_shards(
    shards: Sequence[torch.Tensor],
    slice_numels: Sequence[int],
    chunk_begins: Sequence[int],
    chunk_ends: Sequence[int],
    *,
    impl: str = "auto",
) -> torch.Tensor:
    """The send buffer of one (possibly coalesced) chunked all-gather: for each weight i in
    order, ``shards[i][chunk_begins[i]*slice_numels[i] : chunk_ends[i]*slice_numels[i]]``,
    concatenated into a new 1-D tensor."""
    op = "elastic_kernels.pack_shards"
    shards = _tensor_list(op, "shards", shards)
    slice_numels = _int_list(op, "slice_numels", slice_numels)
    chunk_begins = _int_list(op, "chunk_begins", chunk_begins)
    chunk_ends = _int_list(op, "chunk_ends", chunk_ends)
    which = _resolve(impl, _device_of(shards))
    if which == "cpp":
        _ext.require()
        return torch.ops.elastic.pack_shards(shards, slice_numels, chunk_begins, chunk_ends)
    if which == "triton":
        from elastic_kernels import triton_pack  # noqa: F401 - registers elastic::*_triton

        return torch.ops.elastic.pack_shards_triton(shards, slice_numels, chunk_begins, chunk_ends)
    from elastic_kernels.reference import pack_shards_reference

    return pack_shards_reference(shards, slice_numels, chunk_begins, chunk_ends)


def unpack_gathered(
    gathered: torch.Tensor,
    world_size: int,
    slice_numels: Sequence[int],
    chunk_counts: Sequence[int],
    dests: Sequence[torch.Tensor],
    *,
    impl: str = "auto",
) -> None:
    """Write a rank-major all-gather of ``pack_shards`` outputs (``world_size`` blocks) into
    ``dests``: one contiguous tensor per chunk (weight 0's chunks, then weight 1's, ...), each
    holding the chunk's real elements (padding of a ragged chunk is dropped, never written)."""
    op = "elastic_kernels.unpack_gathered"
    if not isinstance(gathered, torch.Tensor):
        raise ValueError(f"{op}: gathered must be a tensor, got {type(gathered).__name__}")
    slice_numels = _int_list(op, "slice_numels", slice_numels)
    chunk_counts = _int_list(op, "chunk_counts", chunk_counts)
    dests = _tensor_list(op, "dests", dests)
    which = _resolve(impl, gathered.device)
    if which == "cpp":
        _ext.require()
        torch.ops.elastic.unpack_gathered(gathered, world_size, slice_numels, chunk_counts, dests)
        return None
    if which == "triton":
        from elastic_kernels import triton_pack  # noqa: F401 - registers elastic::*_triton

        torch.ops.elastic.unpack_gathered_triton(gathered, world_size, slice_numels, chunk_counts, dests)
        return None
    from elastic_kernels.reference import unpack_gathered_reference

    unpack_gathered_reference(gathered, world_size, slice_numels, chunk_counts, dests)
    return None


# ---------------------------------------------------------------------------------------------
# Fake impls of the C++ ops (the schemas live in csrc/ops.cpp, whose set_python_module names
# this module). Registered only when _C, and so the schemas, is loaded.
# ---------------------------------------------------------------------------------------------


def _pack_shards_fake(shards, slice_numels, chunk_begins, chunk_ends):
    total, _ = check_pack_args(shards, slice_numels, chunk_begins, chunk_ends)
    return shards[0].new_empty(total)


def _unpack_gathered_fake(gathered, world_size, slice_numels, chunk_counts, dests):
    check_unpack_args(gathered, world_size, slice_numels, chunk_counts, dests)
    return None


if _ext.available():
    torch.library.register_fake("elastic::pack_shards")(_pack_shards_fake)
    torch.library.register_fake("elastic::unpack_gathered")(_unpack_gathered_fake)
