"""Paged LoRA linear: launch configurations and launchers of the Triton kernels
(paged_linear_kernels.py), their ``torch.library.triton_op`` registrations, and the dispatch
wrappers that choose between them and the pure-torch reference (paged_linear_reference.py).

Ops (namespace ``elastic``; math, shapes and numerics in ``paged_linear_reference``):

    elastic::paged_lora_linear_fwd(x, chunks, bias, lora_x, lora_a, lora_b, scale) -> (y, xa)
    elastic::paged_lora_linear_dgrad(dy, chunks, lora_a, lora_b, scale) -> (dx, dyb)
    elastic::lora_adapter_grads(lora_x, xa, dy, dyb, scale) -> (dA, dB)


[Note: page table as element offsets]
A weight's chunks are separate pool pages, so the kernels cannot address W with one base
pointer and a row stride. Each launch gets ``page_ptr``, an int64 tensor with one entry per
chunk: the element offset of the chunk's first row from ``chunks[0]`` (passed as ``w_ptr``).
Row n of W lives at ``w_ptr + page[n // rows_per_chunk] + (n % rows_per_chunk) * K``; a kernel
computes that per row of its tile, so a tile may straddle chunks (any rows_per_chunk, 1 row per
chunk included) and one launch covers every chunk. Offsets rather than raw page addresses cast
to pointers in the kernel (``.to(tl.pointer_type(...), bitcast=True)``, which works under the
interpreter too) keep W a typed pointer argument, so Triton specialises its
alignment and, with ``tl.multiple_of`` on the row offsets (``W_ALIGN``: every offset and K a
multiple of 16 bytes, true for pool pages), still vectorises the W loads along K. Differences
of addresses in one flat address space are valid on the GPU (UVA) and under the interpreter,
which reads CPU tensors in place (checked by the tests with chunks in separate allocations).
On CUDA the table is staged through pinned memory with a non-blocking copy and cached per
(device, stream, offsets), so a steady state costs no copy; an entry is a function of its key,
so a stale entry cannot exist. A table is host data, so a launch cannot be captured in a CUDA
graph (this raises a clear error under capture).

[Note: the ops are opaque to tracing]
``triton_op`` normally lets AOTDispatcher trace *into* the op so Inductor sees the kernels. That
is unsound here: the page table is derived from the chunks' addresses, not their values, and a
traced graph would either bake stale addresses in or lose track of which buffers the kernel
reads (only ``chunks[0]`` is a kernel argument). So each op registers a FunctionalTensorMode rule
that keeps it as one opaque node (what ``torch.export`` does for every triton_op); the fake impl
is still the op's own function, which stops after allocating its outputs when the inputs are
fake. ``torch.library.opcheck`` passes on CPU under ``TRITON_INTERPRET=1`` (tests).
"""

from __future__ import annotations

import collections
import functools
import threading
from collections.abc import Sequence

import torch
import triton
from torch._subclasses.fake_tensor import is_fake
from torch._subclasses.functional_tensor import FunctionalTensorMode
from torch.library import triton_op, wrap_triton

from elastic_kernels.ops import paged_linear_reference as ref
from elastic_kernels.ops._checks import check_adapter_grad_args, check_dgrad_args, check_fwd_args
from elastic_kernels.ops._lazy import LazyOps
from elastic_kernels.ops.paged_linear_kernels import (
    _lora_down_kernel,
    _lora_grad_kernel,
    _paged_linear_dgrad_kernel,
    _paged_linear_fwd_kernel,
)

try:  # TRITON_INTERPRET=1 makes @triton.jit return InterpretedFunction (Triton 3.x)
    from triton.runtime.interpreter import InterpretedFunction as _InterpretedFunction
except ImportError:  # pragma: no cover - every supported Triton has it
    _InterpretedFunction = ()

TRITON_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
IMPLS = ("auto", "triton", "reference")


# =============================================================================================
# Launch configurations
# =============================================================================================

# [Note: launch configurations]
# The two paged GEMMs (forward: T×N output, K reduction; dgrad: T×K output, N reduction) share
# one tile vocabulary: BLOCK_M tokens × BLOCK_N output columns, BLOCK_K reduction per step,
# GROUP_M row blocks per L2 group. On a GPU, problems of at least 2^29 multiply-adds are
# autotuned over a short list of the configurations that are best for bf16 dense GEMMs on
# Hopper/Ampere (the Triton matmul tutorial's list, trimmed to 128×256, 256×128 and 128×128
# tiles), keyed on (N, K, next power of two of T) so varying token counts do not retune;
# BLOCK_K is fixed per dtype (64 for 16-bit, 32 for fp32, so 3–4 pipeline stages of both
# operand tiles fit in shared memory) and not tuned, because the EVEN_* flags depend on it.
# Smaller problems are latency-bound and take one 64×64 tile. Under the interpreter every
# kernel runs 32-wide tiles, so the tests' 127/130-sized shapes cross several tiles and both
# the masked (ragged) and unmasked (EVEN_*) branches.

_AUTOTUNE_MIN_MACS = 1 << 29
_GEMM_CONFIGS = [
    triton.Config({"BLOCK_M": 128, "BLOCK_N": 256, "GROUP_M": 8}, num_warps=8, num_stages=3),
    triton.Config({"BLOCK_M": 256, "BLOCK_N": 128, "GROUP_M": 8}, num_warps=8, num_stages=3),
    triton.Config({"BLOCK_M": 128, "BLOCK_N": 128, "GROUP_M": 8}, num_warps=8, num_stages=4),
    triton.Config({"BLOCK_M": 128, "BLOCK_N": 128, "GROUP_M": 8}, num_warps=4, num_stages=4),
]
# The dgrad reads the page table inside its reduction loop (rows of W are the reduction), so
# Triton's pipeliner gives the table load a stage of its own and the W / dy tiles a shorter
# prefetch distance: compiled for sm_90a, num_stages=3 yields 2 shared-memory buffers and a full
# wait (`async_wait num=0`) every iteration, num_stages=5 yields 3 buffers with 3 copies in
# flight, the depth the forward gets from num_stages=3 (Triton 3.8, `tests/kernels/_aot_compile.py`
# shows the shared memory of each). Hence two more stages here.
_DGRAD_CONFIGS = [
    triton.Config({"BLOCK_M": 128, "BLOCK_N": 256, "GROUP_M": 8}, num_warps=8, num_stages=5),
    triton.Config({"BLOCK_M": 256, "BLOCK_N": 128, "GROUP_M": 8}, num_warps=8, num_stages=5),
    triton.Config({"BLOCK_M": 128, "BLOCK_N": 128, "GROUP_M": 8}, num_warps=8, num_stages=6),
    triton.Config({"BLOCK_M": 128, "BLOCK_N": 128, "GROUP_M": 8}, num_warps=4, num_stages=6),
]
# Every BLOCK_N above divides this, so "K % 256 == 0" is a valid EVEN_OUT for the dgrad under
# any tuned configuration.
_GEMM_BLOCK_N_LCM = 256
_SMALL_GEMM = dict(BLOCK_M=64, BLOCK_N=64, GROUP_M=8, num_warps=4, num_stages=3)
_INTERP_GEMM = dict(BLOCK_M=32, BLOCK_N=32, GROUP_M=2)
_INTERP_BLOCK = 32

# The key names the constexpr flags that change the work (LoRA, bias): the autotuner's cache
# key holds only the listed arguments and the tensor dtypes, so without them the plain and the
# LoRA variant would share one tuned configuration.
_paged_linear_fwd_kernel_tuned = triton.autotune(
    configs=_GEMM_CONFIGS, key=["N", "K", "T_BUCKET", "HAS_LORA", "HAS_BIAS"]
)(
    _paged_linear_fwd_kernel
)
_paged_linear_dgrad_kernel_tuned = triton.autotune(configs=_DGRAD_CONFIGS, key=["N", "K", "T_BUCKET", "HAS_LORA"])(
    _paged_linear_dgrad_kernel
)

INTERPRETED = isinstance(_paged_linear_fwd_kernel, _InterpretedFunction) if _InterpretedFunction else False


def _block_k(dtype: torch.dtype) -> int:
    if INTERPRETED:
        return _INTERP_BLOCK
    return 64 if dtype in (torch.bfloat16, torch.float16) else 32


def _dot_precision(dtype: torch.dtype) -> str:
    # fp32 inputs: exact fp32 products like eager torch (allow_tf32 is off by default).
    return "ieee" if dtype == torch.float32 else "tf32"


def _upcast_dot(dtype: torch.dtype) -> bool:
    # [Note: bf16 under the interpreter]
    # The Triton interpreter keeps bf16 as uint16 bit patterns and its tl.dot multiplies those
    # bits (triton-lang/triton#11584; its debugging guide says bf16 arithmetic is unsupported and
    # to cast to fp32). Under the interpreter, bf16 dot operands are cast to fp32 first: a bf16
    # product is exact in fp32 and the accumulation is fp32 either way, so this is the same math
    # the tensor cores do. Its fp32 -> bf16 cast also truncates instead of rounding to nearest
    # even (what the GPU and torch do), so under the interpreter bf16 results are stored as fp32
    # and rounded by torch (`_store_dtype`). Compiled kernels never do either.
    return INTERPRETED and dtype == torch.bfloat16


def _store_dtype(dtype: torch.dtype) -> torch.dtype:
    """Dtype a kernel stores a `dtype` result in ([Note: bf16 under the interpreter])."""
    return torch.float32 if _upcast_dot(dtype) else dtype


def _block_r(r: int) -> int:
    return max(16, triton.next_power_of_2(max(r, 1)))


@functools.lru_cache(maxsize=None)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def _gemm_launch(kernel, kernel_tuned, grid_m: int, grid_n: int, macs: int):
    """(kernel, grid, launch meta-parameters) for a paged GEMM ([Note: launch configurations])."""
    if INTERPRETED:
        meta = dict(_INTERP_GEMM)
        return kernel, (triton.cdiv(grid_m, meta["BLOCK_M"]) * triton.cdiv(grid_n, meta["BLOCK_N"]),), meta
    if macs < _AUTOTUNE_MIN_MACS:
        meta = dict(_SMALL_GEMM)
        return kernel, (triton.cdiv(grid_m, meta["BLOCK_M"]) * triton.cdiv(grid_n, meta["BLOCK_N"]),), meta

    def grid(meta):
        return (triton.cdiv(grid_m, meta["BLOCK_M"]) * triton.cdiv(grid_n, meta["BLOCK_N"]),)

    return kernel_tuned, grid, {}


# =============================================================================================
# Page tables
# =============================================================================================

_TABLE_CACHE: collections.OrderedDict = collections.OrderedDict()
_TABLE_CACHE_SIZE = 256
_TABLE_LOCK = threading.Lock()


def page_table(chunks: Sequence[torch.Tensor], k: int) -> tuple[torch.Tensor, int]:
    """(int64 element offsets of each chunk from chunks[0], on the chunks' device; W_ALIGN).

    See [Note: page table as element offsets]. ``k`` is the row length of the weight.
    """
    base = chunks[0]
    esize = base.element_size()
    base_ptr = base.data_ptr()
    offsets = []
    for i, c in enumerate(chunks):
        delta = c.data_ptr() - base_ptr
        if delta % esize:
            raise ValueError(
                f"chunks[{i}] starts {delta} bytes from chunks[0], not a multiple of the element size "
                f"({esize}); chunks must be element-aligned views"
            )
        offsets.append(delta // esize)
    vec = 16 // esize
    aligned = base_ptr % 16 == 0 and k % vec == 0 and all(o % vec == 0 for o in offsets)
    w_align = vec if aligned else 1
    device = base.device
    if device.type != "cuda":
        return torch.tensor(offsets, dtype=torch.int64, device=device), w_align
    if torch.cuda.is_current_stream_capturing():
        raise RuntimeError(
            "paged linear ops cannot be captured in a CUDA graph: the page table is built from the "
            "chunks' addresses on the host at each call"
        )
    stream = torch.cuda.current_stream(device)
    key = (device.index, stream.cuda_stream, tuple(offsets))
    with _TABLE_LOCK:
        table = _TABLE_CACHE.get(key)
        if table is not None:
            _TABLE_CACHE.move_to_end(key)
            return table, w_align
    host = torch.tensor(offsets, dtype=torch.int64).pin_memory()
    table = host.to(device, non_blocking=True)  # ordered on `stream`, the stream of every later use
    with _TABLE_LOCK:
        _TABLE_CACHE[key] = table
        while len(_TABLE_CACHE) > _TABLE_CACHE_SIZE:
            _TABLE_CACHE.popitem(last=False)
    return table, w_align


# =============================================================================================
# Ops
# =============================================================================================


def _check_triton_dtype(dtype: torch.dtype, name: str) -> None:
    if dtype not in TRITON_DTYPES:
        raise TypeError(
            f"{name} has dtype {dtype}; the Triton kernels support {', '.join(map(str, TRITON_DTYPES))} "
            f"(use impl='reference' for other dtypes)"
        )


def _no_launch(t: torch.Tensor) -> bool:
    """True when only shapes are wanted: fake/meta tensors (fake impl, tracing)."""
    return t.device.type == "meta" or is_fake(t)


def _check_launchable(t: torch.Tensor, name: str) -> None:
    if t.device.type != "cuda" and not INTERPRETED:
        raise RuntimeError(
            f"{name} is on {t.device}: the Triton kernels need CUDA tensors (or TRITON_INTERPRET=1 set "
            f"before triton is imported); use impl='reference' or impl='auto' for CPU tensors"
        )


def _rows(t: torch.Tensor) -> torch.Tensor:
    """t with unit column stride (row stride free), copying only when needed."""
    return t if t.stride(-1) == 1 or t.shape[-1] == 1 else t.contiguous()


def _lora_down(a: torch.Tensor, b: torch.Tensor, b_is_transposed: bool, r: int) -> torch.Tensor:
    """[T, R] = a[T, L]·b in b's dtype (the adapter dtype), b = lora_a [R, L] read transposed, or
    lora_b [L, R]; a is in the activation dtype ([Note: adapter dtype in the kernels])."""
    t, l_ = a.shape
    out = a.new_empty((t, r), dtype=_store_dtype(b.dtype))
    if b_is_transposed:
        stride_bl, stride_bj = 1, b.stride(0)
    else:
        stride_bl, stride_bj = b.stride(0), 1
    block_m = _INTERP_BLOCK if INTERPRETED else 64
    block_l = _INTERP_BLOCK if INTERPRETED else 2 * _block_k(a.dtype)
    extra = {} if INTERPRETED else dict(num_warps=4, num_stages=3)
    wrap_triton(_lora_down_kernel)[(triton.cdiv(t, block_m),)](
        a, b, out, t, l_, r, a.stride(0), stride_bl, stride_bj, out.stride(0),
        EVEN_L=l_ % block_l == 0, EVEN_R=r == _block_r(r),
        DOT_PRECISION=_dot_precision(a.dtype), UPCAST_DOT=_upcast_dot(a.dtype),
        BLOCK_M=block_m, BLOCK_L=block_l, BLOCK_R=_block_r(r), **extra,
    )  # fmt: skip
    return out.to(b.dtype)


def _paged_lora_linear_fwd(
    x: torch.Tensor,
    chunks: list[torch.Tensor],
    bias: torch.Tensor | None,
    lora_x: torch.Tensor | None,
    lora_a: torch.Tensor | None,
    lora_b: torch.Tensor | None,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    t, k, n, r, rows_per_chunk = check_fwd_args(x, chunks, bias, lora_x, lora_a, lora_b)
    _check_triton_dtype(x.dtype, "x")
    # xa is in the adapter dtype (x's dtype, or fp32 with fp32 adapters; x's dtype without LoRA).
    xa_dtype = lora_a.dtype if r else x.dtype
    if t == 0 or _no_launch(x):
        return x.new_empty((t, n)), x.new_empty((t, r), dtype=xa_dtype)
    _check_launchable(x, "x")
    x = _rows(x)
    table, w_align = page_table(chunks, k)
    y = x.new_empty((t, n), dtype=_store_dtype(x.dtype))
    if r:
        lora_a = lora_a.contiguous()
        lora_b = lora_b.contiguous()
        xa = _lora_down(x if lora_x is None else _rows(lora_x), lora_a, True, r)
    else:
        xa = x.new_empty((t, 0))
    assert xa.dtype == xa_dtype
    if bias is not None:
        bias = bias.contiguous()
    kernel, grid, meta = _gemm_launch(
        _paged_linear_fwd_kernel, _paged_linear_fwd_kernel_tuned, t, n, t * n * k
    )
    block_k = _block_k(x.dtype)
    wrap_triton(kernel)[grid](
        x, chunks[0], table,
        bias if bias is not None else y,
        xa if r else y,
        lora_b if r else y,
        y,
        t, n, k, r, rows_per_chunk,
        x.stride(0), xa.stride(0) if r else 0, y.stride(0),
        float(scale), triton.next_power_of_2(t),
        HAS_BIAS=bias is not None, HAS_LORA=r > 0, EVEN_K=k % block_k == 0, EVEN_R=r == _block_r(r),
        W_ALIGN=w_align, DOT_PRECISION=_dot_precision(x.dtype), UPCAST_DOT=_upcast_dot(x.dtype),
        BLOCK_R=_block_r(r), BLOCK_K=block_k, **meta,
    )  # fmt: skip
    return y.to(x.dtype), xa


def _paged_lora_linear_dgrad(
    dy: torch.Tensor,
    chunks: list[torch.Tensor],
    lora_a: torch.Tensor | None,
    lora_b: torch.Tensor | None,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    t, k, n, r, rows_per_chunk = check_dgrad_args(dy, chunks, lora_a, lora_b)
    _check_triton_dtype(dy.dtype, "dy")
    dyb_dtype = lora_b.dtype if r else dy.dtype  # the adapter dtype, as xa in the forward
    if t == 0 or _no_launch(dy):
        return dy.new_empty((t, k)), dy.new_empty((t, r), dtype=dyb_dtype)
    _check_launchable(dy, "dy")
    dy = _rows(dy)
    table, w_align = page_table(chunks, k)
    dx = dy.new_empty((t, k), dtype=_store_dtype(dy.dtype))
    if r:
        lora_a = lora_a.contiguous()
        lora_b = lora_b.contiguous()
        dyb = _lora_down(dy, lora_b, False, r)
    else:
        dyb = dy.new_empty((t, 0))
    assert dyb.dtype == dyb_dtype
    kernel, grid, meta = _gemm_launch(
        _paged_linear_dgrad_kernel, _paged_linear_dgrad_kernel_tuned, t, k, t * n * k
    )
    block_k = _block_k(dy.dtype)
    even_out = k % (meta["BLOCK_N"] if meta else _GEMM_BLOCK_N_LCM) == 0
    wrap_triton(kernel)[grid](
        dy, chunks[0], table,
        dyb if r else dx,
        lora_a if r else dx,
        dx,
        t, n, k, r, rows_per_chunk,
        dy.stride(0), dyb.stride(0) if r else 0, dx.stride(0),
        float(scale), triton.next_power_of_2(t),
        HAS_LORA=r > 0, EVEN_N=n % block_k == 0, EVEN_OUT=even_out, EVEN_R=r == _block_r(r),
        W_ALIGN=w_align, DOT_PRECISION=_dot_precision(dy.dtype), UPCAST_DOT=_upcast_dot(dy.dtype),
        BLOCK_R=_block_r(r), BLOCK_K=block_k, **meta,
    )  # fmt: skip
    return dx.to(dy.dtype), dyb


def _lora_grad_block_t(a_dtype: torch.dtype, b_dtype: torch.dtype) -> int:
    """Tokens per step of `_lora_grad_kernel` on a GPU. 32 when one operand is fp32 and the other
    16-bit (fp32 adapters): its fp32 "ieee" dot runs on the FMA units with the operands in
    registers, and at 64 tokens the dA variant (fp32 dyb transposed × bf16 lora_x) spilled 472
    bytes per thread with 16x128 tiles (332 with 128x16; sm_90a, Triton 3.8), at 32 none."""
    return 64 if a_dtype == b_dtype else 32


def _lora_grad(
    a: torch.Tensor, b: torch.Tensor, scale: float, act_dtype: torch.dtype, out_dtype: torch.dtype
) -> torch.Tensor:
    """scale · aᵀ·b, [M, P], the token reduction split over programs when the tiles are few.

    One of a / b is in the activation dtype ``act_dtype``, the other in the adapter dtype
    ``out_dtype`` (the same dtype, or fp32: [Note: adapter dtype in the kernels])."""
    t, m = a.shape
    p = b.shape[1]
    if INTERPRETED:
        block_t, block_big, extra, target = _INTERP_BLOCK, _INTERP_BLOCK, {}, 4
    else:
        block_t, block_big, extra = _lora_grad_block_t(a.dtype, b.dtype), 128, dict(num_warps=4, num_stages=3)
        target = 2 * _sm_count(a.device.index if a.device.index is not None else torch.cuda.current_device())
    block_m = _block_r(m) if m <= 64 else block_big
    block_p = _block_r(p) if p <= 64 else block_big
    tiles = triton.cdiv(m, block_m) * triton.cdiv(p, block_p)
    t_blocks = triton.cdiv(t, block_t)
    split = max(1, min(t_blocks, target // tiles))
    tokens_per_split = triton.cdiv(t_blocks, split) * block_t
    split = triton.cdiv(t, tokens_per_split)
    # One split writes the result directly; several write fp32 partials, summed in fp32 (a
    # deterministic order, no atomics).
    out = a.new_empty((split, m, p), dtype=_store_dtype(out_dtype) if split == 1 else torch.float32)
    wrap_triton(_lora_grad_kernel)[(triton.cdiv(m, block_m), triton.cdiv(p, block_p), split)](
        a, b, out, t, m, p, a.stride(0), b.stride(0), tokens_per_split, float(scale),
        DOT_PRECISION=_dot_precision(act_dtype), UPCAST_DOT=_upcast_dot(act_dtype),
        BLOCK_M=block_m, BLOCK_P=block_p, BLOCK_T=block_t, **extra,
    )  # fmt: skip
    return (out[0] if split == 1 else out.sum(0)).to(out_dtype)


def _lora_adapter_grads(
    lora_x: torch.Tensor,
    xa: torch.Tensor,
    dy: torch.Tensor,
    dyb: torch.Tensor,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    t, k, n, r = check_adapter_grad_args(lora_x, xa, dy, dyb)
    _check_triton_dtype(lora_x.dtype, "lora_x")
    adapter_dtype = xa.dtype  # lora_x's dtype or fp32 (checked): dA and dB come out in it
    if t == 0 or _no_launch(lora_x):
        # No tokens: the gradients are zero (an empty sum), not garbage.
        return lora_x.new_zeros((r, k), dtype=adapter_dtype), lora_x.new_zeros((n, r), dtype=adapter_dtype)
    _check_launchable(lora_x, "lora_x")
    grad_a = _lora_grad(_rows(dyb), _rows(lora_x), scale, lora_x.dtype, adapter_dtype)
    grad_b = _lora_grad(_rows(dy), _rows(xa), scale, lora_x.dtype, adapter_dtype)
    return grad_a, grad_b


def _opaque_under_functionalization(mode, op, types, args, kwargs):
    # [Note: the ops are opaque to tracing]: keep the op as one node instead of tracing into it.
    return mode.__torch_dispatch__(op, types, args, kwargs)


def _register_ops() -> dict:
    """The ``elastic::`` ops of this family ([Note: Triton ops register lazily] in _lazy.py)."""
    fwd = triton_op("elastic::paged_lora_linear_fwd", mutates_args=())(_paged_lora_linear_fwd)
    dgrad = triton_op("elastic::paged_lora_linear_dgrad", mutates_args=())(_paged_lora_linear_dgrad)
    grads = triton_op("elastic::lora_adapter_grads", mutates_args=())(_lora_adapter_grads)
    ops = (fwd, dgrad, grads)
    for op in ops:
        op.register_torch_dispatch(FunctionalTensorMode, _opaque_under_functionalization)
    return {"_paged_lora_linear_fwd_op": fwd, "_paged_lora_linear_dgrad_op": dgrad, "_lora_adapter_grads_op": grads,
            "OPS": ops}


# _paged_lora_linear_fwd_op, _paged_lora_linear_dgrad_op, _lora_adapter_grads_op and OPS are
# bound by _register_ops on first need (_LAZY.get, or an attribute access), not at import.
_LAZY = LazyOps(__name__, ("_paged_lora_linear_fwd_op", "_paged_lora_linear_dgrad_op", "_lora_adapter_grads_op", "OPS"),
                _register_ops)
register_ops = _LAZY.ensure


def __getattr__(name: str):
    return _LAZY.get(name)


# =============================================================================================
# Dispatch wrappers
# =============================================================================================


def _use_triton(impl: str, t: torch.Tensor) -> bool:
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
    if impl == "auto":
        return isinstance(t, torch.Tensor) and t.device.type == "cuda" and t.dtype in TRITON_DTYPES
    return impl == "triton"


def paged_lora_linear_fwd(
    x: torch.Tensor,
    chunks: Sequence[torch.Tensor],
    bias: torch.Tensor | None = None,
    lora_x: torch.Tensor | None = None,
    lora_a: torch.Tensor | None = None,
    lora_b: torch.Tensor | None = None,
    scale: float = 1.0,
    *,
    impl: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(y, xa)``: ``xa = lora_x·Aᵀ``, ``y = x·Wᵀ + bias + scale·xa·Bᵀ``, W given as ``chunks``.

    ``lora_x`` is the dropout-applied input (None: x itself). Without LoRA (lora_a and lora_b
    None) it is a plain paged linear and ``xa`` is ``[T, 0]``. x, chunks, bias and lora_x share
    the activation dtype; lora_a and lora_b share the adapter dtype, which is the activation
    dtype or float32 (fp32 adapters with bf16/fp16 activations). ``y`` is in the activation
    dtype, ``xa`` in the adapter dtype (not rounded to 16 bits with fp32 adapters); numerics in
    [Note: numerics of the paged LoRA ops]. ``impl``: "auto" (Triton for CUDA tensors of
    fp32/bf16/fp16, the reference otherwise), "triton" or "reference".
    """
    if _use_triton(impl, x):
        return _LAZY.get("_paged_lora_linear_fwd_op")(x, _as_list(chunks), bias, lora_x, lora_a, lora_b, float(scale))
    return ref.paged_lora_linear_fwd_reference(x, chunks, bias, lora_x, lora_a, lora_b, scale)


def paged_lora_linear_dgrad(
    dy: torch.Tensor,
    chunks: Sequence[torch.Tensor],
    lora_a: torch.Tensor | None = None,
    lora_b: torch.Tensor | None = None,
    scale: float = 1.0,
    *,
    impl: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(dx, dyb)``: ``dyb = dy·B``, ``dx = dy·W + scale·dyb·A`` (``dyb`` is ``[T, 0]`` without LoRA).

    ``dx`` is in dy's dtype, ``dyb`` in the adapter dtype (dy's dtype or float32), as in the forward.
    """
    if _use_triton(impl, dy):
        return _LAZY.get("_paged_lora_linear_dgrad_op")(dy, _as_list(chunks), lora_a, lora_b, float(scale))
    return ref.paged_lora_linear_dgrad_reference(dy, chunks, lora_a, lora_b, scale)


def lora_adapter_grads(
    lora_x: torch.Tensor,
    xa: torch.Tensor,
    dy: torch.Tensor,
    dyb: torch.Tensor,
    scale: float = 1.0,
    *,
    impl: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(dA, dB)``: ``dA = scale·dybᵀ·lora_x``, ``dB = scale·dyᵀ·xa``, in the adapter dtype.

    lora_x and dy share the activation dtype; xa and dyb (as the forward / dgrad returned them)
    share the adapter dtype, the activation dtype or float32. Accumulated in fp32.
    """
    if _use_triton(impl, lora_x):
        return _LAZY.get("_lora_adapter_grads_op")(lora_x, xa, dy, dyb, float(scale))
    return ref.lora_adapter_grads_reference(lora_x, xa, dy, dyb, scale)


def _as_list(chunks) -> list[torch.Tensor]:
    # The op's schema takes Tensor[]: a wrong type must fail here with the reference's message,
    # not in the dispatcher's argument parser.
    if isinstance(chunks, torch.Tensor) or not isinstance(chunks, (list, tuple)):
        raise TypeError(f"chunks must be a list of 2-D tensors, got {type(chunks).__name__}")
    return list(chunks)
