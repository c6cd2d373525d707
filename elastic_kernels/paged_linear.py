"""Paged LoRA linear: Triton kernels, their ``torch.library.triton_op`` registrations and the
dispatch wrappers that choose between them and the pure-torch reference.

Ops (namespace ``elastic``; math, shapes and numerics in ``paged_linear_reference``):

    elastic::paged_lora_linear_fwd(x, chunks, bias, lora_x, lora_a, lora_b, scale) -> (y, xa)
    elastic::paged_lora_linear_dgrad(dy, chunks, lora_a, lora_b, scale) -> (dx, dyb)
    elastic::lora_adapter_grads(lora_x, xa, dy, dyb, scale) -> (dA, dB)

Kernels, bottom to top: ``_lora_down_kernel`` (``xa = lora_x·Aᵀ`` / ``dyb = dy·B``, once per
row block, in the adapter dtype), ``_paged_linear_fwd_kernel`` (``x·Wᵀ`` through the page
table, the LoRA term ``s·xa·Bᵀ`` fused in the same kernel, bias at the store), ``_paged_linear_dgrad_kernel``
(``dy·W`` through the page table, ``s·dyb·A`` fused likewise), ``_lora_grad_kernel``
(``s·aᵀ·b`` over tokens, split for parallelism). Where in the kernel the LoRA term is added:
[Note: LoRA term as the initial accumulator]. fp32 adapters with 16-bit activations:
[Note: adapter dtype in the kernels].

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
import triton.language as tl
from torch._subclasses.fake_tensor import is_fake
from torch._subclasses.functional_tensor import FunctionalTensorMode
from torch.library import triton_op, wrap_triton

from elastic_kernels import paged_linear_reference as ref

try:  # TRITON_INTERPRET=1 makes @triton.jit return InterpretedFunction (Triton 3.x)
    from triton.runtime.interpreter import InterpretedFunction as _InterpretedFunction
except ImportError:  # pragma: no cover - every supported Triton has it
    _InterpretedFunction = ()

TRITON_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
IMPLS = ("auto", "triton", "reference")


# =============================================================================================
# Kernels
# =============================================================================================


@triton.jit
def _dot_in(t, UPCAST_DOT: tl.constexpr):
    """A tl.dot operand; fp32 under the interpreter for bf16 ([Note: bf16 under the interpreter])."""
    if UPCAST_DOT:
        return t.to(tl.float32)
    return t


@triton.jit
def _lora_dot(a, b, acc, UPCAST_DOT: tl.constexpr, DOT_PRECISION: tl.constexpr, FP32_PRECISION: tl.constexpr):
    """acc + a·b for a LoRA product, one of whose operands may be fp32 (an fp32 adapter, xa or
    dyb) and the other 16-bit (an activation) ([Note: adapter dtype in the kernels])."""
    if (a.dtype == tl.float32) or (b.dtype == tl.float32):
        # tl.dot needs one operand dtype: the 16-bit operand is cast UP to fp32 (exact), never
        # the fp32 one down (that would round the adapter / xa / dyb to 16 bits); the product
        # is an fp32 one at FP32_PRECISION ("ieee", or "tf32x3" for fp32 adapters in the fused
        # GEMMs), accumulated in fp32. With fp32 activations every caller passes "ieee", the
        # dot the kernels always did for fp32 (DOT_PRECISION is "ieee" for fp32).
        out = tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision=FP32_PRECISION)
    else:  # (not an early return: the compiler would also build the dot below, of mixed operands)
        out = tl.dot(_dot_in(a, UPCAST_DOT), _dot_in(b, UPCAST_DOT), acc, input_precision=DOT_PRECISION)
    return out


@triton.jit
def _grouped_pid(pid, M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """Program id -> (row block, column block), GROUP_M row blocks at a time so that programs
    running together share their column tiles of W in L2."""
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(N, BLOCK_N)
    per_group = GROUP_M * num_n
    group = pid // per_group
    first_m = group * GROUP_M
    size_m = tl.minimum(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % size_m
    pid_n = (pid % per_group) // size_m
    return pid_m, pid_n


@triton.jit
def _page_row_offsets(
    page_ptr,  # [num_chunks] int64 element offsets of the chunks from w_ptr
    rows,  # [BLOCK] int32 rows of W, all < N
    rows_per_chunk,  # rows of every chunk but the last
    K,  # row length of W (elements)
    W_ALIGN: tl.constexpr,  # every offset is a multiple of this many elements
):
    """Element offset of each row of W from w_ptr ([Note: page table as element offsets])."""
    chunk = rows // rows_per_chunk
    off = tl.load(page_ptr + chunk) + (rows - chunk * rows_per_chunk).to(tl.int64) * K
    if W_ALIGN > 1:
        off = tl.multiple_of(off, W_ALIGN)
    return off


@triton.jit
def _lora_down_kernel(
    a_ptr,  # [T, L] rows of the input, activation dtype (row stride stride_at, unit column stride)
    b_ptr,  # [L, R] the adapter, adapter dtype; element (l, j) at b_ptr + l * stride_bl + j * stride_bj
    out_ptr,  # [T, R] output a·b in the adapter dtype (row stride stride_ot, unit column stride)
    T,
    L,
    R,
    stride_at,
    stride_bl,
    stride_bj,
    stride_ot,
    EVEN_L: tl.constexpr,  # L % BLOCK_L == 0
    EVEN_R: tl.constexpr,  # R == BLOCK_R
    DOT_PRECISION: tl.constexpr,
    UPCAST_DOT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_L: tl.constexpr,
    BLOCK_R: tl.constexpr,  # >= R, power of two >= 16
):
    """out = a·b for a skinny b (R = LoRA rank): xa = lora_x·Aᵀ (b = Aᵀ) and dyb = dy·B."""
    pid = tl.program_id(0)
    offs_m = pid * BLOCK_M + tl.arange(0, BLOCK_M)
    rows = tl.minimum(offs_m, T - 1).to(tl.int64)  # ragged tile: re-read the last row, drop at store
    offs_l = tl.arange(0, BLOCK_L)
    offs_r = tl.arange(0, BLOCK_R)
    r_ok = offs_r[None, :] < R
    a_ptrs = a_ptr + rows[:, None] * stride_at + offs_l[None, :]
    b_ptrs = b_ptr + offs_l.to(tl.int64)[:, None] * stride_bl + offs_r[None, :] * stride_bj
    acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    for lb in range(0, tl.cdiv(L, BLOCK_L)):
        if EVEN_L:
            a = tl.load(a_ptrs)
            if EVEN_R:
                b = tl.load(b_ptrs)
            else:
                b = tl.load(b_ptrs, mask=r_ok, other=0.0)
        else:
            l_ok = offs_l < L - lb * BLOCK_L
            a = tl.load(a_ptrs, mask=l_ok[None, :], other=0.0)
            b = tl.load(b_ptrs, mask=l_ok[:, None] & r_ok, other=0.0)
        acc = _lora_dot(a, b, acc, UPCAST_DOT, DOT_PRECISION, "ieee")  # xa / dyb: true fp32 products
        a_ptrs += BLOCK_L
        b_ptrs += BLOCK_L * stride_bl
    out_ptrs = out_ptr + offs_m.to(tl.int64)[:, None] * stride_ot + offs_r[None, :]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=(offs_m[:, None] < T) & r_ok)


@triton.jit
def _paged_linear_fwd_kernel(
    x_ptr,  # [T, K] input (row stride stride_xt, unit column stride)
    w_ptr,  # [rows_per_chunk, K] chunks[0]: the base of every page offset
    page_ptr,  # [num_chunks] int64 element offset of chunk c's first row from w_ptr
    bias_ptr,  # [N] bias (read only if HAS_BIAS)
    xa_ptr,  # [T, R] lora_x·Aᵀ in the adapter dtype, row stride stride_xat (read only if HAS_LORA)
    b_ptr,  # [N, R] lora_b (adapter dtype), contiguous (read only if HAS_LORA)
    y_ptr,  # [T, N] output (row stride stride_yt, unit column stride)
    T,
    N,
    K,
    R,
    rows_per_chunk,
    stride_xt,
    stride_xat,
    stride_yt,
    scale,  # LoRA scale s
    T_BUCKET,  # autotune key only: next power of two of T, so a new T does not retune
    HAS_BIAS: tl.constexpr,
    HAS_LORA: tl.constexpr,
    EVEN_K: tl.constexpr,  # K % BLOCK_K == 0
    EVEN_R: tl.constexpr,  # R == BLOCK_R
    W_ALIGN: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    UPCAST_DOT: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    """y = x·Wᵀ (+ bias) (+ s·xa·Bᵀ), W read row by row through the page table."""
    pid_m, pid_n = _grouped_pid(tl.program_id(0), T, N, BLOCK_M, BLOCK_N, GROUP_M)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    # Ragged tiles re-read the last valid row of x / W: every load is in bounds without a mask
    # on the tile's rows, and the duplicated rows are dropped by the store's mask.
    rows_m = tl.minimum(offs_m, T - 1).to(tl.int64)
    rows_n = tl.minimum(offs_n, N - 1)
    w_rows = _page_row_offsets(page_ptr, rows_n, rows_per_chunk, K, W_ALIGN)
    offs_k = tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + rows_m[:, None] * stride_xt + offs_k[None, :]
    w_ptrs = w_ptr + w_rows[:, None] + offs_k[None, :]
    if HAS_LORA:
        # [Note: LoRA term as the initial accumulator]
        offs_r = tl.arange(0, BLOCK_R)
        xa_ptrs = xa_ptr + rows_m[:, None] * stride_xat + offs_r[None, :]
        bt_ptrs = b_ptr + rows_n.to(tl.int64)[:, None] * R + offs_r[None, :]
        if EVEN_R:
            xa = tl.load(xa_ptrs)
            bt = tl.load(bt_ptrs)
        else:
            xa = tl.load(xa_ptrs, mask=offs_r[None, :] < R, other=0.0)
            bt = tl.load(bt_ptrs, mask=offs_r[None, :] < R, other=0.0)
        if xa_ptr.dtype.element_ty == x_ptr.dtype.element_ty:
            acc = _lora_dot(xa, tl.trans(bt), None, UPCAST_DOT, DOT_PRECISION, "ieee")
        else:  # fp32 adapters, 16-bit x: [Note: adapter dtype in the kernels] (why tf32x3)
            acc = _lora_dot(xa, tl.trans(bt), None, UPCAST_DOT, DOT_PRECISION, "tf32x3")
        acc = acc * scale
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kb in range(0, tl.cdiv(K, BLOCK_K)):
        if EVEN_K:
            a = tl.load(x_ptrs)
            w = tl.load(w_ptrs)
        else:
            k_ok = offs_k[None, :] < K - kb * BLOCK_K
            a = tl.load(x_ptrs, mask=k_ok, other=0.0)
            w = tl.load(w_ptrs, mask=k_ok, other=0.0)
        acc = tl.dot(_dot_in(a, UPCAST_DOT), tl.trans(_dot_in(w, UPCAST_DOT)), acc, input_precision=DOT_PRECISION)
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    if HAS_BIAS:
        acc += tl.load(bias_ptr + rows_n).to(tl.float32)[None, :]
    y_ptrs = y_ptr + offs_m.to(tl.int64)[:, None] * stride_yt + offs_n[None, :]
    tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=(offs_m[:, None] < T) & (offs_n[None, :] < N))


@triton.jit
def _paged_linear_dgrad_kernel(
    dy_ptr,  # [T, N] upstream gradient (row stride stride_dyt, unit column stride)
    w_ptr,  # [rows_per_chunk, K] chunks[0]: the base of every page offset
    page_ptr,  # [num_chunks] int64 element offset of chunk c's first row from w_ptr
    dyb_ptr,  # [T, R] dy·B in the adapter dtype, row stride stride_dybt (read only if HAS_LORA)
    a_ptr,  # [R, K] lora_a (adapter dtype), contiguous (read only if HAS_LORA)
    dx_ptr,  # [T, K] output (row stride stride_dxt, unit column stride)
    T,
    N,
    K,
    R,
    rows_per_chunk,
    stride_dyt,
    stride_dybt,
    stride_dxt,
    scale,  # LoRA scale s
    T_BUCKET,  # autotune key only (see the forward)
    HAS_LORA: tl.constexpr,
    EVEN_N: tl.constexpr,  # N % BLOCK_K == 0 (N is the reduction here)
    EVEN_OUT: tl.constexpr,  # K % BLOCK_N == 0 (K is the output width here)
    EVEN_R: tl.constexpr,  # R == BLOCK_R
    W_ALIGN: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    UPCAST_DOT: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_M: tl.constexpr,  # tokens per tile
    BLOCK_N: tl.constexpr,  # features of dx (columns of W) per tile
    BLOCK_K: tl.constexpr,  # rows of W (out_features) per reduction step
    GROUP_M: tl.constexpr,
):
    """dx = dy·W (+ s·dyb·A), the rows of W (the reduction) read through the page table."""
    pid_m, pid_n = _grouped_pid(tl.program_id(0), T, K, BLOCK_M, BLOCK_N, GROUP_M)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rows_m = tl.minimum(offs_m, T - 1).to(tl.int64)
    col_ok = offs_n[None, :] < K
    offs_k = tl.arange(0, BLOCK_K)
    dy_ptrs = dy_ptr + rows_m[:, None] * stride_dyt + offs_k[None, :]
    if HAS_LORA:
        # [Note: LoRA term as the initial accumulator]
        offs_r = tl.arange(0, BLOCK_R)
        gb_ptrs = dyb_ptr + rows_m[:, None] * stride_dybt + offs_r[None, :]
        at_ptrs = a_ptr + offs_r.to(tl.int64)[:, None] * K + offs_n[None, :]
        if EVEN_R:
            gb = tl.load(gb_ptrs)
        else:
            gb = tl.load(gb_ptrs, mask=offs_r[None, :] < R, other=0.0)
        if EVEN_R and EVEN_OUT:
            at = tl.load(at_ptrs)
        else:
            at = tl.load(at_ptrs, mask=(offs_r[:, None] < R) & col_ok, other=0.0)
        if dyb_ptr.dtype.element_ty == dy_ptr.dtype.element_ty:
            acc = _lora_dot(gb, at, None, UPCAST_DOT, DOT_PRECISION, "ieee")
        else:  # fp32 adapters, 16-bit dy: as in the forward
            acc = _lora_dot(gb, at, None, UPCAST_DOT, DOT_PRECISION, "tf32x3")
        acc = acc * scale
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kb in range(0, tl.cdiv(N, BLOCK_K)):
        rows = kb * BLOCK_K + offs_k
        if EVEN_N:
            w_rows = _page_row_offsets(page_ptr, rows, rows_per_chunk, K, W_ALIGN)
            g = tl.load(dy_ptrs)
            if EVEN_OUT:
                w = tl.load(w_ptr + w_rows[:, None] + offs_n[None, :])
            else:
                w = tl.load(w_ptr + w_rows[:, None] + offs_n[None, :], mask=col_ok, other=0.0)
        else:
            row_ok = rows < N
            w_rows = _page_row_offsets(page_ptr, tl.minimum(rows, N - 1), rows_per_chunk, K, W_ALIGN)
            g = tl.load(dy_ptrs, mask=row_ok[None, :], other=0.0)
            if EVEN_OUT:
                w = tl.load(w_ptr + w_rows[:, None] + offs_n[None, :], mask=row_ok[:, None], other=0.0)
            else:
                w = tl.load(w_ptr + w_rows[:, None] + offs_n[None, :], mask=row_ok[:, None] & col_ok, other=0.0)
        acc = tl.dot(_dot_in(g, UPCAST_DOT), _dot_in(w, UPCAST_DOT), acc, input_precision=DOT_PRECISION)
        dy_ptrs += BLOCK_K
    dx_ptrs = dx_ptr + offs_m.to(tl.int64)[:, None] * stride_dxt + offs_n[None, :]
    tl.store(dx_ptrs, acc.to(dx_ptr.dtype.element_ty), mask=(offs_m[:, None] < T) & col_ok)


@triton.jit
def _lora_grad_kernel(
    a_ptr,  # [T, M] (row stride stride_at, unit column stride); dyb (adapter dtype) or dy (activation)
    b_ptr,  # [T, P] (row stride stride_bt, unit column stride); lora_x (activation) or xa (adapter)
    out_ptr,  # [SPLIT, M, P] contiguous: split s holds scale·aᵀ·b over its token range
    T,
    M,
    P,
    stride_at,
    stride_bt,
    tokens_per_split,  # a multiple of BLOCK_T
    scale,
    DOT_PRECISION: tl.constexpr,
    UPCAST_DOT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_P: tl.constexpr,
    BLOCK_T: tl.constexpr,
):
    """out[s] = scale · a[tokens of s]ᵀ · b[tokens of s]: dA = s·dybᵀ·lora_x, dB = s·dyᵀ·xa."""
    pid_m = tl.program_id(0)
    pid_p = tl.program_id(1)
    pid_s = tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_p = pid_p * BLOCK_P + tl.arange(0, BLOCK_P)
    m_ok = offs_m < M
    p_ok = offs_p < P
    t_begin = pid_s * tokens_per_split
    t_end = tl.minimum(T, t_begin + tokens_per_split)
    offs_t = tl.arange(0, BLOCK_T)
    acc = tl.zeros((BLOCK_M, BLOCK_P), dtype=tl.float32)
    for i in range(0, tl.cdiv(t_end - t_begin, BLOCK_T)):
        toks = t_begin + i * BLOCK_T + offs_t
        t_ok = toks[:, None] < t_end
        toks64 = toks.to(tl.int64)
        at = tl.load(a_ptr + toks64[:, None] * stride_at + offs_m[None, :], mask=t_ok & m_ok[None, :], other=0.0)
        bt = tl.load(b_ptr + toks64[:, None] * stride_bt + offs_p[None, :], mask=t_ok & p_ok[None, :], other=0.0)
        acc = _lora_dot(tl.trans(at), bt, acc, UPCAST_DOT, DOT_PRECISION, "ieee")  # dA / dB: true fp32 products
    out_ptrs = out_ptr + pid_s.to(tl.int64) * M * P + offs_m.to(tl.int64)[:, None] * P + offs_p[None, :]
    tl.store(out_ptrs, (acc * scale).to(out_ptr.dtype.element_ty), mask=m_ok[:, None] & p_ok[None, :])


# [Note: LoRA term as the initial accumulator]
# The LoRA term s·xa·Bᵀ (forward) / s·dyb·A (dgrad) is fused into the paged GEMM, computed from
# the xa / dyb that `_lora_down_kernel` produced once per row block. It is computed *before* the
# K loop, as the accumulator's initial value, rather than after it: added after the loop, its
# product needs a second fp32 tile beside the accumulator: for a 128×256 tile with 8 warps,
# ptxas (sm_90a) then used 255 registers and spilled 1552 bytes per thread; computed first, the
# forward uses 186 registers and no spill (the plain kernel: 182). Measured by compiling for
# sm_90a without a GPU: `python tests/_aot_compile.py` (TRITON_INTERPRET unset), Triton 3.8.
# The math is the same up to the order of fp32 additions; the bias is still added at the store.

# [Note: adapter dtype in the kernels]
# The adapters (lora_a, lora_b) may be fp32 while x, W, bias and dy are bf16/fp16 (PEFT's
# autocast_adapter_dtype); the op contract is [Note: numerics of the paged LoRA ops]. The kernels
# take each dtype from their pointers' element types (compile-time), so one source serves both:
# `_lora_down_kernel` stores xa / dyb in out_ptr's dtype, the adapter dtype (fp32: never rounded
# to 16 bits); the paged GEMMs read xa / dyb and the adapter in that dtype; `_lora_grad_kernel`
# stores dA / dB in it. tl.dot needs one operand dtype, so every product with an fp32 operand
# goes through `_lora_dot`, which casts the 16-bit operand UP to fp32 (exact) and never the fp32
# one down (that would round the adapter / xa / dyb to 16 bits, what fp32 adapters avoid), then
# accumulates in fp32 as everywhere. The products' precision:
# - `_lora_down_kernel` (xa, dyb) and `_lora_grad_kernel` (dA, dB): "ieee", true fp32 products
#   on the FMA units, as the reference; their outputs are fp32 and kept. Compiled for sm_90a,
#   none spills, once the dA / dB kernel steps 32 tokens instead of 64 (`_lora_grad_block_t`).
# - the LoRA term fused into the paged GEMMs (s·xa·Bᵀ, s·dyb·A): "tf32x3", fp32 operands split
#   into two TF32 parts on the tensor cores, each product within ~3·2^-22 relative (vs 2^-24 for
#   "ieee"). Reason: with "ieee" the 128×256 forward spilled 2552 bytes per thread (255
#   registers; tf32x3: 188 registers, no spill), sm_90a, Triton 3.8. The term is summed into an
#   fp32 accumulator and y / dx are then rounded to 16 bits (up to 2^-8 / 2^-11 relative), so the
#   difference from true fp32 products is far below what the output can represent; the tests'
#   bound accounts for it. The interpreter ignores input_precision (its dot is a numpy fp32
#   matmul), so on CPU these products are plain fp32: the tf32x3 numerics run only on a GPU.
# The base GEMM (x·Wᵀ, dy·W) is untouched: 16-bit operands, tensor cores. Same-dtype calls take
# the same dots at the same precisions as before fp32 adapters existed: compiled for sm_90a,
# every variant of `tests/_aot_compile.py` gave the same PTX (debug info aside), and under the
# interpreter the same operations run (fp32/bf16/fp16 results compared with torch.equal against
# the previous commit), so their results are bit for bit unchanged. Cost on a
# GPU: not measured (no GPU here); each LoRA product is r/K or r/N of its base GEMM's work
# (16/4096 at rank 16). Under the interpreter a bf16 operand's cast to fp32 is exact (it is
# what [Note: bf16 under the interpreter] already does) and fp32 outputs need no `_store_dtype`.

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
# flight, the depth the forward gets from num_stages=3 (Triton 3.8, `tests/_aot_compile.py`
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


@triton_op("elastic::paged_lora_linear_fwd", mutates_args=())
def _paged_lora_linear_fwd_op(
    x: torch.Tensor,
    chunks: list[torch.Tensor],
    bias: torch.Tensor | None,
    lora_x: torch.Tensor | None,
    lora_a: torch.Tensor | None,
    lora_b: torch.Tensor | None,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    t, k, n, r, rows_per_chunk = ref.check_fwd_args(x, chunks, bias, lora_x, lora_a, lora_b)
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


@triton_op("elastic::paged_lora_linear_dgrad", mutates_args=())
def _paged_lora_linear_dgrad_op(
    dy: torch.Tensor,
    chunks: list[torch.Tensor],
    lora_a: torch.Tensor | None,
    lora_b: torch.Tensor | None,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    t, k, n, r, rows_per_chunk = ref.check_dgrad_args(dy, chunks, lora_a, lora_b)
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


@triton_op("elastic::lora_adapter_grads", mutates_args=())
def _lora_adapter_grads_op(
    lora_x: torch.Tensor,
    xa: torch.Tensor,
    dy: torch.Tensor,
    dyb: torch.Tensor,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    t, k, n, r = ref.check_adapter_grad_args(lora_x, xa, dy, dyb)
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


OPS = (_paged_lora_linear_fwd_op, _paged_lora_linear_dgrad_op, _lora_adapter_grads_op)
for _op in OPS:
    _op.register_torch_dispatch(FunctionalTensorMode, _opaque_under_functionalization)


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
        return _paged_lora_linear_fwd_op(x, _as_list(chunks), bias, lora_x, lora_a, lora_b, float(scale))
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
        return _paged_lora_linear_dgrad_op(dy, _as_list(chunks), lora_a, lora_b, float(scale))
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
        return _lora_adapter_grads_op(lora_x, xa, dy, dyb, float(scale))
    return ref.lora_adapter_grads_reference(lora_x, xa, dy, dyb, scale)


def _as_list(chunks) -> list[torch.Tensor]:
    # The op's schema takes Tensor[]: a wrong type must fail here with the reference's message,
    # not in the dispatcher's argument parser.
    if isinstance(chunks, torch.Tensor) or not isinstance(chunks, (list, tuple)):
        raise TypeError(f"chunks must be a list of 2-D tensors, got {type(chunks).__name__}")
    return list(chunks)
