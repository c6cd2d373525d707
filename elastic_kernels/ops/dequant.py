"""Dequantization of quantized chunk blobs (elastic_kernels/quant/blob.py [Note: quantized chunk
blob]): launchers of the Triton kernels (dequant_kernels.py) and their ``triton_op``
registrations, the dispatch wrapper ``dequantize``, and the fake impls of the C++ schemas
(csrc/ops.cpp, which names this module with ``set_python_module``).

Ops (namespace ``elastic``; the same arguments for every impl):

    dequant_chunks(Tensor[] blobs, str format, int rows, int cols, int rows_per_chunk,
                   int block_size, bool nested, ScalarType dtype) -> Tensor
    dequant_chunks_into(Tensor[] blobs, str format, int rows, int cols, int rows_per_chunk,
                        int block_size, bool nested, Tensor(a!) out) -> ()

``blobs`` are a weight's chunks, one 1-D uint8 blob each (a page table: any separate tensors),
chunk c holding rows [c * rows_per_chunk, ...) of the weight, every chunk full but the last;
``rows`` x ``cols`` is the weight they cover, ``format`` "nf4" or "int8". The result (new, or
written into ``out``) is [rows, cols] in the compute dtype (fp32, bf16 or fp16), equal bit for
bit to bitsandbytes' ``dequantize_4bit(..., quant_type="nf4", blocksize=block_size)`` of each
chunk for NF4, with or without nested scales (quant/nf4.py says the arithmetic).

Impls: the C++ CPU kernel behind ``torch.ops.elastic.dequant_chunks*`` (csrc/quant/
dequant_cpu.cpp), the Triton ops ``elastic::dequant_chunks_triton`` / ``_into_triton`` (CUDA,
or CPU under TRITON_INTERPRET=1), the pure-torch references (dequant_reference.py).

[Note: which dequant impl runs]
As pack.py [Note: which impl runs], with one difference: ``_C`` has no CUDA kernel for these
ops, so CUDA tensors always go to Triton. ``impl="auto"``: CUDA -> Triton; CPU -> the C++ op
when ``_C`` is loaded, else the reference. ``impl="cpp" | "triton" | "reference"`` forces one
and raises when it cannot run (``_C`` missing or CUDA tensors for "cpp", CPU tensors without
the interpreter for "triton"), never falling back silently.

[Note: the dequant Triton ops]
- One launch per call covers every chunk, through a page table of byte offsets from blobs[0]
  (``paged_linear.page_table``, cached on CUDA per (device, stream, offsets)). As for the paged
  LoRA ops ([Note: the ops are opaque to tracing] in paged_linear.py), only blobs[0] is a
  kernel argument, so each op registers a FunctionalTensorMode rule that keeps it one opaque
  node instead of letting AOTDispatcher trace into its kernel.
- Alignment: blobs are pool pages, 16-byte aligned in practice; the launch then passes
  BASE_ALIGN=16 (``tl.multiple_of`` on the page offsets), so the code bytes load 16 at a time
  (compiled for sm_90a: one ld.global.v4 per thread per tile instead of 16 byte loads, 40
  registers instead of 68 for nested NF4), and ALIGNED when every fp32 section is 4-byte
  aligned too. Unaligned blobs (any view of a byte buffer) take the byte-wise paths: same bits.
- Nested scales: ``fl(fl(code * absmax2) + offset)`` must not become one FMA (bitsandbytes
  rounds twice), and Triton fuses a multiply and an add by default: the NF4 launch passes
  ``enable_fp_fusion=False`` (the fp32 multiplies of the plain path have no add to fuse with).
- bf16 under the interpreter ([Note: bf16 under the interpreter] in paged_linear.py): the
  interpreter's fp32 -> bf16 cast truncates instead of rounding to nearest even, so under the
  interpreter a bf16 result is stored by the kernel as fp32 and rounded by torch (``.to`` /
  ``copy_``, round to nearest even like the GPU's cvt.rn.bf16.f32 and bitsandbytes). fp16 needs
  nothing (the interpreter's numpy cast rounds to nearest even); compiled kernels never do this.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
from torch._subclasses.fake_tensor import is_fake
from torch._subclasses.functional_tensor import FunctionalTensorMode
from torch.library import triton_op, wrap_triton

from elastic_kernels import _ext
from elastic_kernels.ops._checks import check_dequant_args, tensor_list
from elastic_kernels.ops._lazy import LazyOps
from elastic_kernels.ops.dequant_kernels import _dequant_int8_kernel, _dequant_nf4_kernel
from elastic_kernels.ops.dequant_reference import dequant_chunks_into_reference, dequant_chunks_reference
from elastic_kernels.ops.paged_linear import page_table
from elastic_kernels.quant import ChunkFormat, Int8ChunkFormat, NF4ChunkFormat
from elastic_kernels.quant.nf4 import table

try:  # TRITON_INTERPRET=1 makes @triton.jit return InterpretedFunction (Triton 3.x)
    from triton.runtime.interpreter import InterpretedFunction as _InterpretedFunction
except ImportError:  # pragma: no cover - every supported Triton has it
    _InterpretedFunction = ()

IMPLS = ("auto", "cpp", "triton", "reference")
INTERPRETED = isinstance(_dequant_nf4_kernel, _InterpretedFunction) if _InterpretedFunction else False

# Weights per program on a GPU: 4096 (8 KiB of bf16 out, 2 KiB of NF4 codes) over 4 warps, 32
# per thread; under the interpreter 4 blocks per program, so the tests' small chunks span
# several programs and the ragged last chunk masks part of its last one.
_GPU_TILE = 4096
_GPU_WARPS = 4
_INTERP_GROUP = 4


# =============================================================================================
# Launchers
# =============================================================================================


def _no_launch(t: torch.Tensor) -> bool:
    """True when only shapes are wanted: fake/meta tensors (fake impl, tracing)."""
    return t.device.type == "meta" or is_fake(t)


def _check_launchable(op: str, t: torch.Tensor) -> None:
    if t.device.type != "cuda" and not INTERPRETED:
        raise RuntimeError(
            f"{op}: the blobs are on {t.device}; the Triton kernels need CUDA tensors (or TRITON_INTERPRET=1 "
            f"set before triton is imported); use impl='cpp', 'reference' or 'auto' for CPU tensors"
        )


def _group(fmt: ChunkFormat) -> int:
    """Blocks per program, at most the blocks of a full chunk (rounded up to a power of two)."""
    want = _INTERP_GROUP if INTERPRETED else max(1, _GPU_TILE // fmt.block_size)
    return min(want, triton.next_power_of_2(fmt.num_blocks))


def _aligned(blobs: list[torch.Tensor], formats: list[ChunkFormat]) -> bool:
    """Every blob's fp32 sections start at a multiple of 4 bytes (the kernels' fast path)."""
    return all(b.data_ptr() % 4 == 0 for b in blobs) and all(f.fp32_sections_aligned() for f in formats)


def _launch(blobs: list[torch.Tensor], formats: list[ChunkFormat], rows: int, rows_per_chunk: int, dest: torch.Tensor):
    """Write the weight into ``dest`` [rows, cols] (contiguous) with one kernel launch."""
    full = formats[0]
    group = _group(full)
    tiles_per_chunk = triton.cdiv(full.num_blocks, group)
    grid = (tiles_per_chunk * len(blobs),)
    pages, _ = page_table(blobs, 1)
    extra = {} if INTERPRETED else {"num_warps": _GPU_WARPS}
    aligned = _aligned(blobs, formats)
    base_align = 16 if all(b.data_ptr() % 16 == 0 for b in blobs) else 1
    partial = formats[-1].numel % full.block_size != 0  # only the last chunk can end mid-block
    if isinstance(full, NF4ChunkFormat):
        wrap_triton(_dequant_nf4_kernel)[grid](
            blobs[0], pages, table("nf4", dest.device), table("dynamic", dest.device), dest,
            rows, full.cols, rows_per_chunk, tiles_per_chunk,
            BLOCK=full.block_size, GROUP=group, NESTED=full.nested, ALIGNED=aligned, BASE_ALIGN=base_align,
            PARTIAL=partial, enable_fp_fusion=False, **extra,
        )  # fmt: skip
    else:
        wrap_triton(_dequant_int8_kernel)[grid](
            blobs[0], pages, dest, rows, full.cols, rows_per_chunk, tiles_per_chunk,
            BLOCK=full.block_size, GROUP=group, ALIGNED=aligned, BASE_ALIGN=base_align, PARTIAL=partial, **extra,
        )  # fmt: skip


def _store_dtype(dtype: torch.dtype) -> torch.dtype:
    """Dtype the kernel stores a ``dtype`` result in ([Note: the dequant Triton ops], bf16)."""
    return torch.float32 if INTERPRETED and dtype == torch.bfloat16 else dtype


def _dequant_chunks_triton_impl(
    blobs: list[torch.Tensor],
    format: str,
    rows: int,
    cols: int,
    rows_per_chunk: int,
    block_size: int,
    nested: bool,
    dtype: torch.dtype,
) -> torch.Tensor:
    op = "elastic::dequant_chunks_triton"
    formats = check_dequant_args(blobs, format, rows, cols, rows_per_chunk, block_size, nested, dtype, None, op=op)
    first = blobs[0]
    if _no_launch(first):
        return first.new_empty((rows, cols), dtype=dtype)
    _check_launchable(op, first)
    dest = first.new_empty((rows, cols), dtype=_store_dtype(dtype))
    _launch(blobs, formats, rows, rows_per_chunk, dest)
    return dest.to(dtype)


def _dequant_chunks_into_triton_impl(
    blobs: list[torch.Tensor],
    format: str,
    rows: int,
    cols: int,
    rows_per_chunk: int,
    block_size: int,
    nested: bool,
    out: torch.Tensor,
) -> None:
    op = "elastic::dequant_chunks_into_triton"
    formats = check_dequant_args(blobs, format, rows, cols, rows_per_chunk, block_size, nested, None, out, op=op)
    if _no_launch(blobs[0]) or _no_launch(out):
        return
    _check_launchable(op, blobs[0])
    if _store_dtype(out.dtype) == out.dtype:
        _launch(blobs, formats, rows, rows_per_chunk, out)
    else:
        tmp = out.new_empty((rows, cols), dtype=_store_dtype(out.dtype))
        _launch(blobs, formats, rows, rows_per_chunk, tmp)
        out.copy_(tmp)


def _opaque_under_functionalization(mode, op, types, args, kwargs):
    # [Note: the dequant Triton ops]: keep the op as one node instead of tracing into it.
    return mode.__torch_dispatch__(op, types, args, kwargs)


def _register_ops() -> dict:
    """The ``elastic::*_triton`` dequant ops ([Note: Triton ops register lazily] in _lazy.py)."""
    new = triton_op("elastic::dequant_chunks_triton", mutates_args=())(_dequant_chunks_triton_impl)
    into = triton_op("elastic::dequant_chunks_into_triton", mutates_args=("out",))(_dequant_chunks_into_triton_impl)
    for op in (new, into):
        op.register_torch_dispatch(FunctionalTensorMode, _opaque_under_functionalization)
    return {"_dequant_chunks_triton": new, "_dequant_chunks_into_triton": into, "TRITON_OPS": (new, into)}


# _dequant_chunks_triton, _dequant_chunks_into_triton and TRITON_OPS are bound by _register_ops on
# first need (_LAZY.get, or an attribute access), not at import.
_LAZY = LazyOps(__name__, ("_dequant_chunks_triton", "_dequant_chunks_into_triton", "TRITON_OPS"), _register_ops)
register_ops = _LAZY.ensure


def __getattr__(name: str):
    return _LAZY.get(name)


# =============================================================================================
# Dispatch [Note: which dequant impl runs]
# =============================================================================================


def _resolve(impl: str, device: torch.device) -> str:
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
    if impl == "cpp" and device.type == "cuda":
        raise RuntimeError(
            "impl='cpp': elastic::dequant_chunks has no CUDA kernel in _C (CUDA tensors run the Triton "
            "kernels: impl='triton' or 'auto')"
        )
    if impl != "auto":
        return impl
    if device.type == "cuda":
        return "triton"
    return "cpp" if _ext.available() else "reference"


def dequantize(
    blobs: torch.Tensor | Sequence[torch.Tensor],
    fmt: ChunkFormat,
    rows: int | None = None,
    *,
    dtype: torch.dtype = torch.bfloat16,
    out: torch.Tensor | None = None,
    impl: str = "auto",
) -> torch.Tensor:
    """The weight [rows, cols] held by ``blobs`` (one blob, or a weight's chunks in order) in
    the compute dtype ``dtype`` (fp32, bf16, fp16), or written into ``out`` [rows, cols] (whose
    dtype is then the compute dtype) and returned.

    ``fmt`` is the format of a full chunk (``NF4ChunkFormat`` / ``Int8ChunkFormat``: its rows
    are rows_per_chunk); ``rows`` is the rows the blobs cover (default: every chunk full,
    ``len(blobs) * fmt.rows``; fewer when the last chunk is ragged). ``impl``: [Note: which
    dequant impl runs]."""
    blobs = [blobs] if isinstance(blobs, torch.Tensor) else tensor_list("elastic_kernels.dequantize", "blobs", blobs)
    if not isinstance(fmt, (NF4ChunkFormat, Int8ChunkFormat)):
        raise TypeError(f"fmt must be an NF4ChunkFormat or Int8ChunkFormat, got {type(fmt).__name__}")
    rows = len(blobs) * fmt.rows if rows is None else rows
    args = (blobs, fmt.name, rows, fmt.cols, fmt.rows, fmt.block_size, fmt.nested)
    which = _resolve(impl, blobs[0].device if blobs else torch.device("cpu"))
    if out is None:
        if which == "cpp":
            _ext.require()
            return torch.ops.elastic.dequant_chunks(*args, dtype)
        if which == "triton":
            return _LAZY.get("_dequant_chunks_triton")(*args, dtype)
        return dequant_chunks_reference(*args, dtype)
    if which == "cpp":
        _ext.require()
        torch.ops.elastic.dequant_chunks_into(*args, out)
    elif which == "triton":
        _LAZY.get("_dequant_chunks_into_triton")(*args, out)
    else:
        dequant_chunks_into_reference(*args, out)
    return out


# =============================================================================================
# Fake impls of the C++ ops, registered only when _C, and so the schemas, is loaded.
# =============================================================================================


def _dequant_chunks_fake(blobs, format, rows, cols, rows_per_chunk, block_size, nested, dtype):
    check_dequant_args(
        blobs, format, rows, cols, rows_per_chunk, block_size, nested, dtype, None, op="elastic::dequant_chunks"
    )
    return blobs[0].new_empty((rows, cols), dtype=dtype)


def _dequant_chunks_into_fake(blobs, format, rows, cols, rows_per_chunk, block_size, nested, out):
    check_dequant_args(
        blobs, format, rows, cols, rows_per_chunk, block_size, nested, None, out, op="elastic::dequant_chunks_into"
    )


if _ext.available():
    torch.library.register_fake("elastic::dequant_chunks")(_dequant_chunks_fake)
    torch.library.register_fake("elastic::dequant_chunks_into")(_dequant_chunks_into_fake)
