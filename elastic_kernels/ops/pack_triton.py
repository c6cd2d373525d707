"""Triton impls of the chunked-gather copies: ``elastic::pack_shards_triton`` and
``elastic::unpack_gathered_triton`` (same meaning and checks as ``elastic::pack_shards`` /
``elastic::unpack_gathered``; layout.py [Note: chunk-major shard layout]).

Importing this module imports triton: on a machine without a GPU set TRITON_INTERPRET=1 first
(tests/conftest.py does), and the kernels run on CPU tensors under the interpreter.

[Note: Triton launches one kernel per segment]
Like the CUDA impl, both ops are batches of *runs*, contiguous ranges copied src -> dst
(chunk_layout.h [Note: one copy descriptor for pack and unpack]): a pack segment is one run; an
unpack dest is ceil(numel / s) runs, run r = rank r's slice of the chunk. The CUDA kernel takes a
device table of raw addresses and does every dest in one launch. A Triton kernel could do the
same by loading int64 addresses from a table and casting them to pointers, and the interpreter
supports that (with Triton 3.8, a kernel reading (src, dst) addresses from an int64 table copied
three CPU tensors correctly under TRITON_INTERPRET=1). But the table is built from
`Tensor.data_ptr()`, and a `triton_op` body doubles as its fake impl: under FakeTensorMode
(opcheck, torch.compile) data_ptr() is 0 with a warning that this is undefined behaviour, and
writes through addresses hidden in a table are invisible to the compiler's mutation analysis.
So this impl launches `_chunk_copy_kernel` once per pack segment and once per unpack dest, every
tensor a real kernel argument: traceable (checked with make_fx + functionalization, symbolic
shapes), checkable by opcheck, same meaning. The price is one launch per dest (a few
microseconds each on a GPU; not measured, no GPU was lent to this work); the C++/CUDA op,
`impl="auto"`'s choice wherever `_C` is built, is the single-launch path.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch.library import triton_op, wrap_triton

from elastic_kernels.ops._checks import check_pack_args, check_unpack_args, has_storage
from elastic_kernels.ops._lazy import LazyOps

try:  # TRITON_INTERPRET=1 makes @triton.jit return InterpretedFunction (Triton 3.x)
    from triton.runtime.interpreter import InterpretedFunction as _InterpretedFunction
except ImportError:  # pragma: no cover - every supported Triton has it
    _InterpretedFunction = ()

# Bytes one program copies at most; a block is also never much longer than a run (slice).
_PROGRAM_BYTES = 16384
_MIN_BLOCK = 128

# Copies move raw bits: every dtype is viewed as the integer type of its width, so no value is
# ever converted (NaN payloads and -0.0 survive) and one compiled kernel serves all dtypes of a
# width.
_BITS = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


@triton.jit
def _chunk_copy_kernel(
    src_ptr,  # run r's elements start at src_ptr + r * src_stride: [runs, src_stride] (rank-major)
    dst_ptr,  # [numel] contiguous: run r is dst[r * slice_numel : r * slice_numel + run numel]
    numel,  # elements of dst (a dest's unpadded chunk, or a whole pack segment)
    slice_numel,  # elements of a full run
    src_stride,  # elements between the starts of consecutive runs in src
    BLOCK: tl.constexpr,  # elements per program
):
    # grid: (cdiv(slice_numel, BLOCK), runs); axis 1 is the run, i.e. the rank
    run = tl.program_id(1).to(tl.int64)
    o = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)  # offset in the run (int64)
    e = run * slice_numel + o  # element of dst
    mask = (o < slice_numel) & (e < numel)  # padding past the dest's numel is dropped
    x = tl.load(src_ptr + run * src_stride + o, mask=mask)
    tl.store(dst_ptr + e, x, mask=mask)


def _block_for(slice_numel: int, elem_size: int) -> int:
    return max(_MIN_BLOCK, min(triton.next_power_of_2(slice_numel), _PROGRAM_BYTES // elem_size))


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(_BITS[t.element_size()])


def _check_runnable(op: str, t: torch.Tensor) -> None:
    """Triton runs CPU tensors only under the interpreter: say so instead of failing deep inside."""
    if not has_storage(t) or t.device.type == "cuda":
        return
    if not _interpreted():
        raise RuntimeError(
            f"{op}: the Triton impl got tensors on {t.device}; Triton runs them only under its "
            f"interpreter: set TRITON_INTERPRET=1 before triton is imported (or use impl='cpp' / "
            f"'reference' on CPU)"
        )


def _interpreted() -> bool:
    return bool(_InterpretedFunction) and isinstance(_chunk_copy_kernel, _InterpretedFunction)


def _launch(src: torch.Tensor, dst: torch.Tensor, numel: int, slice_numel: int, src_stride: int) -> None:
    runs = triton.cdiv(numel, slice_numel)
    block = _block_for(slice_numel, src.element_size())
    grid = (triton.cdiv(slice_numel, block), runs)
    wrap_triton(_chunk_copy_kernel)[grid](src, dst, numel, slice_numel, src_stride, BLOCK=block)


def pack_shards_triton(
    shards: list[torch.Tensor], slice_numels: list[int], chunk_begins: list[int], chunk_ends: list[int]
) -> torch.Tensor:
    op = "elastic::pack_shards_triton"
    total, offsets = check_pack_args(shards, slice_numels, chunk_begins, chunk_ends, op=op)
    _check_runnable(op, shards[0])
    out = shards[0].new_empty(total)
    out_bits = _bits(out)
    for t, s, cb, ce, off in zip(shards, slice_numels, chunk_begins, chunk_ends, offsets):
        count = (ce - cb) * s
        if count == 0:
            continue
        # one run: the segment's slices are contiguous in the shard and in the send buffer
        _launch(_bits(t)[cb * s : ce * s], out_bits[off : off + count], count, count, 0)
    return out


def unpack_gathered_triton(
    gathered: torch.Tensor, world_size: int, slice_numels: list[int], chunk_counts: list[int], dests: list[torch.Tensor]
) -> None:
    op = "elastic::unpack_gathered_triton"
    per_rank, dest_weight, dest_base = check_unpack_args(gathered, world_size, slice_numels, chunk_counts, dests, op=op)
    if not dests:
        return
    _check_runnable(op, gathered)
    src = _bits(gathered).reshape(-1)
    for dest, i, base in zip(dests, dest_weight, dest_base):
        # run r (rank r's slice of this chunk) starts at src[r * per_rank + base]
        _launch(src[base:], _bits(dest).view(-1), dest.numel(), slice_numels[i], per_rank)


def _pack_shards_triton_fake(shards, slice_numels, chunk_begins, chunk_ends):
    total, _ = check_pack_args(shards, slice_numels, chunk_begins, chunk_ends, op="elastic::pack_shards_triton")
    return shards[0].new_empty(total)


def _unpack_gathered_triton_fake(gathered, world_size, slice_numels, chunk_counts, dests):
    check_unpack_args(gathered, world_size, slice_numels, chunk_counts, dests, op="elastic::unpack_gathered_triton")


def _register(name, fn, mutates_args, fake):
    """[Note: Triton ops under the interpreter] With compiled Triton, `triton_op` makes the op
    traceable: torch.compile sees through it to the kernels (wrap_triton). Under
    TRITON_INTERPRET=1, wrap_triton returns the interpreted function itself, so a trace would
    run (or, on fake tensors, skip) the kernel at trace time instead of capturing it: opcheck's
    test_aot_dispatch_dynamic showed such a graph returning garbage. There the op is a plain
    opaque `custom_op` with its own fake impl instead: compiled graphs call it at run time."""
    if _interpreted():
        op = torch.library.custom_op(name, fn, mutates_args=mutates_args)
        op.register_fake(fake)
        return op
    return triton_op(name, fn, mutates_args=mutates_args)


def _register_ops() -> dict:
    """The ``elastic::*_triton`` copy ops ([Note: Triton ops register lazily] in _lazy.py)."""
    return {
        "pack_shards_triton_op": _register(
            "elastic::pack_shards_triton", pack_shards_triton, (), _pack_shards_triton_fake
        ),
        "unpack_gathered_triton_op": _register(
            "elastic::unpack_gathered_triton", unpack_gathered_triton, ("dests",), _unpack_gathered_triton_fake
        ),
    }


# pack_shards_triton_op and unpack_gathered_triton_op are bound by _register_ops on first access
# (pack.py reaches them as attributes of this module), not at import.
_LAZY = LazyOps(__name__, ("pack_shards_triton_op", "unpack_gathered_triton_op"), _register_ops)
register_ops = _LAZY.ensure


def __getattr__(name: str):
    return _LAZY.get(name)
