"""The copy ops of chunked gathers, ``pack_shards`` and ``unpack_gathered``: dispatch, and the
fake impls of their C++ schemas (csrc/ops.cpp, whose ``set_python_module`` names this module).

Each has four implementations with one meaning (layout.py [Note: chunk-major shard layout]):
the C++ CPU and CUDA kernels behind ``torch.ops.elastic.*``, the Triton kernels
``torch.ops.elastic.*_triton`` (pack_triton.py), and the pure-torch references
(pack_reference.py); the argument checks they share are in _checks.py.

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
from elastic_kernels.ops import pack_triton  # its ops register on first access (_lazy.py)
from elastic_kernels.ops._checks import check_pack_args, check_unpack_args, int_list, tensor_list
from elastic_kernels.ops.pack_reference import pack_shards_reference, unpack_gathered_reference

IMPLS = ("auto", "cpp", "triton", "reference")


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
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """The send buffer of one (possibly coalesced) chunked all-gather: for each weight i in
    order, ``shards[i][chunk_begins[i]*slice_numels[i] : chunk_ends[i]*slice_numels[i]]``,
    concatenated into a new 1-D tensor, or into ``out`` (1-D, contiguous, exactly that many
    elements of the shards' dtype on their device: a buffer the caller reuses; never resized)
    with one copy per weight (``impl`` is then not used)."""
    op = "elastic_kernels.pack_shards"
    shards = tensor_list(op, "shards", shards)
    slice_numels = int_list(op, "slice_numels", slice_numels)
    chunk_begins = int_list(op, "chunk_begins", chunk_begins)
    chunk_ends = int_list(op, "chunk_ends", chunk_ends)
    if out is not None:
        total, _ = check_pack_args(shards, slice_numels, chunk_begins, chunk_ends, op=op)
        if not isinstance(out, torch.Tensor) or out.dim() != 1 or not out.is_contiguous():
            raise ValueError(f"{op}: out must be a 1-D contiguous tensor")
        if out.dtype != shards[0].dtype or out.device != shards[0].device or out.numel() != total:
            raise ValueError(f"{op}: out must hold {total} elements of {shards[0].dtype} on {shards[0].device}, "
                             f"got {out.numel()} of {out.dtype} on {out.device}")
        offset = 0
        for t, s, cb, ce in zip(shards, slice_numels, chunk_begins, chunk_ends):
            n = (ce - cb) * s
            out[offset : offset + n].copy_(t[cb * s : ce * s])
            offset += n
        return out
    which = _resolve(impl, _device_of(shards))
    if which == "cpp":
        _ext.require()
        return torch.ops.elastic.pack_shards(shards, slice_numels, chunk_begins, chunk_ends)
    if which == "triton":
        return pack_triton.pack_shards_triton_op(shards, slice_numels, chunk_begins, chunk_ends)
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
    slice_numels = int_list(op, "slice_numels", slice_numels)
    chunk_counts = int_list(op, "chunk_counts", chunk_counts)
    dests = tensor_list(op, "dests", dests)
    which = _resolve(impl, gathered.device)
    if which == "cpp":
        _ext.require()
        torch.ops.elastic.unpack_gathered(gathered, world_size, slice_numels, chunk_counts, dests)
        return None
    if which == "triton":
        pack_triton.unpack_gathered_triton_op(gathered, world_size, slice_numels, chunk_counts, dests)
        return None
    unpack_gathered_reference(gathered, world_size, slice_numels, chunk_counts, dests)
    return None


# ---------------------------------------------------------------------------------------------
# Fake impls of the C++ ops, registered only when _C, and so the schemas, is loaded.
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
