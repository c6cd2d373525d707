"""The Triton kernels of the paged LoRA linear (``@triton.jit`` only; launched by paged_linear.py).

Bottom to top: ``_lora_down_kernel`` (``xa = lora_x·Aᵀ`` / ``dyb = dy·B``, once per row block,
in the adapter dtype), ``_paged_linear_fwd_kernel`` (``x·Wᵀ`` through the page table, the LoRA
term ``s·xa·Bᵀ`` fused in the same kernel, bias at the store), ``_paged_linear_dgrad_kernel``
(``dy·W`` through the page table, ``s·dyb·A`` fused likewise), ``_lora_grad_kernel``
(``s·aᵀ·b`` over tokens, split for parallelism). How W is addressed: [Note: page table as
element offsets] in paged_linear.py; where the LoRA term is added: [Note: LoRA term as the
initial accumulator]; fp32 adapters with 16-bit activations: [Note: adapter dtype in the
kernels] (both below).
"""

from __future__ import annotations

import triton
import triton.language as tl


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
# sm_90a without a GPU: `python tests/kernels/_aot_compile.py` (TRITON_INTERPRET unset), Triton 3.8.
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
# every variant of `tests/kernels/_aot_compile.py` gave the same PTX (debug info aside), and under the
# interpreter the same operations run (fp32/bf16/fp16 results compared with torch.equal against
# the previous commit), so their results are bit for bit unchanged. Cost on a
# GPU: not measured (no GPU here); each LoRA product is r/K or r/N of its base GEMM's work
# (16/4096 at rank 16). Under the interpreter a bf16 operand's cast to fp32 is exact (it is
# what [Note: bf16 under the interpreter] already does) and fp32 outputs need no `_store_dtype`.
