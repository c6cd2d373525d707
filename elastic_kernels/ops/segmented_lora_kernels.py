"""The Triton kernels of the segmented multi-LoRA ops (``@triton.jit`` only; launched by
segmented_lora.py). How a program finds its adapter and rows: [Note: segmented LoRA kernel]
in segmented_lora.py.

  ``_seg_down_kernel``  out[t, :r_k] = a[t]·M_k, M_k = A_kᵀ (xa = lora_x·A_kᵀ) or B_k (dyb = dy·B_k),
                        columns r_k..R of the row written as zeros; grid (tiles, rank blocks)
  ``_seg_up_kernel``    out[t] = s_k·in[t, :r_k]·M_k, M_k = B_kᵀ (delta) or A_k (dx);
                        grid (tiles, column blocks)
  ``_seg_grad_kernel``  out_k = s_k·a[seg k]ᵀ·b[seg k]: dA_k = s_k·dybᵀ·lora_x, dB_k = s_k·dyᵀ·xa;
                        grid (adapters, row blocks, column blocks)

Every product goes through ``_lora_dot`` (fp32 "ieee" products when an operand is fp32, fp32
accumulation: [Note: adapter dtype in the kernels] in paged_linear_kernels.py).
"""

from __future__ import annotations

import triton
import triton.language as tl

from elastic_kernels.ops.paged_linear_kernels import _lora_dot


@triton.jit
def _tile(tile_adapter_ptr, tile_row_ptr, seg_end_ptr, rank_ptr, w_off_ptr, pid):
    """(adapter k, first row, end of k's segment, r_k, element offset of k's matrix) of tile `pid`."""
    k = tl.load(tile_adapter_ptr + pid)
    row0 = tl.load(tile_row_ptr + pid)
    row_end = tl.load(seg_end_ptr + k)
    r_k = tl.load(rank_ptr + k)
    w_off = tl.load(w_off_ptr + k)
    return k, row0, row_end, r_k, w_off


@triton.jit
def _seg_down_kernel(
    a_ptr,  # [T, L] rows (activation dtype), row stride stride_at, unit column stride
    w_ptr,  # adapter 0's matrix (lora_a[0] if W_IS_A else lora_b[0]); adapter k's at w_ptr + w_off[k]
    w_off_ptr,  # [K] int64 element offset of adapter k's matrix from w_ptr
    rank_ptr,  # [K] int64 r_k
    tile_adapter_ptr,  # [tiles] int64 adapter of each tile
    tile_row_ptr,  # [tiles] int64 first row of each tile
    seg_end_ptr,  # [K] int64 end of adapter k's segment (exclusive)
    out_ptr,  # [T, R] output (adapter dtype), row stride stride_ot, unit column stride
    L,
    R,  # max rank: the width of out
    stride_at,
    stride_ot,
    W_IS_A: tl.constexpr,  # M_k = A_kᵀ: A_k [r_k, L] contiguous; else M_k = B_k [L, r_k] contiguous
    EVEN_L: tl.constexpr,  # L % BLOCK_L == 0
    DOT_PRECISION: tl.constexpr,
    UPCAST_DOT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_L: tl.constexpr,
    BLOCK_R: tl.constexpr,
):
    """out[rows of the tile, rank block] = a[rows]·M_k, the tile's rows all of adapter k."""
    k, row0, row_end, r_k, w_off = _tile(tile_adapter_ptr, tile_row_ptr, seg_end_ptr, rank_ptr, w_off_ptr,
                                         tl.program_id(0))
    offs_m = row0 + tl.arange(0, BLOCK_M)
    rows = tl.minimum(offs_m, row_end - 1).to(tl.int64)  # ragged tile: re-read the last row, drop at store
    offs_l = tl.arange(0, BLOCK_L)
    offs_r = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)
    r_ok = offs_r[None, :] < r_k
    if W_IS_A:  # element (l, j) of A_kᵀ is A_k[j, l]
        stride_wl = 1
        stride_wj = L
    else:  # element (l, j) of B_k [L, r_k]
        stride_wl = r_k
        stride_wj = 1
    a_ptrs = a_ptr + rows[:, None] * stride_at + offs_l[None, :]
    w_ptrs = w_ptr + w_off + offs_l.to(tl.int64)[:, None] * stride_wl + offs_r.to(tl.int64)[None, :] * stride_wj
    acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    for lb in range(0, tl.cdiv(L, BLOCK_L)):
        if EVEN_L:
            a = tl.load(a_ptrs)
            w = tl.load(w_ptrs, mask=r_ok, other=0.0)
        else:
            l_ok = offs_l < L - lb * BLOCK_L
            a = tl.load(a_ptrs, mask=l_ok[None, :], other=0.0)
            w = tl.load(w_ptrs, mask=l_ok[:, None] & r_ok, other=0.0)
        acc = _lora_dot(a, w, acc, UPCAST_DOT, DOT_PRECISION, "ieee")
        a_ptrs += BLOCK_L
        w_ptrs += BLOCK_L * stride_wl
    # Columns r_k..R of the tile's rows are stored too: zeros (the masked loads), so the output
    # holds no garbage where a smaller adapter's rows meet a larger rank.
    out_ptrs = out_ptr + offs_m.to(tl.int64)[:, None] * stride_ot + offs_r[None, :]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=(offs_m[:, None] < row_end) & (offs_r[None, :] < R))


@triton.jit
def _seg_up_kernel(
    x_ptr,  # [T, R] xa or dyb (adapter dtype), row stride stride_xt, unit column stride
    w_ptr,  # adapter 0's matrix (lora_a[0] if W_IS_A else lora_b[0]); adapter k's at w_ptr + w_off[k]
    w_off_ptr,  # [K] int64 element offset of adapter k's matrix from w_ptr
    rank_ptr,  # [K] int64 r_k
    scale_ptr,  # [K] fp32 s_k
    tile_adapter_ptr,  # [tiles] int64
    tile_row_ptr,  # [tiles] int64
    seg_end_ptr,  # [K] int64
    out_ptr,  # [T, N] output (adapter dtype), row stride stride_ot, unit column stride
    N,
    stride_xt,
    stride_ot,
    W_IS_A: tl.constexpr,  # M_k = A_k [r_k, N] (dx); else M_k = B_kᵀ, B_k [N, r_k] (delta)
    DOT_PRECISION: tl.constexpr,
    UPCAST_DOT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_R: tl.constexpr,
):
    """out[rows of the tile, column block] = s_k·x[rows, :r_k]·M_k."""
    k, row0, row_end, r_k, w_off = _tile(tile_adapter_ptr, tile_row_ptr, seg_end_ptr, rank_ptr, w_off_ptr,
                                         tl.program_id(0))
    offs_m = row0 + tl.arange(0, BLOCK_M)
    rows = tl.minimum(offs_m, row_end - 1).to(tl.int64)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n[None, :] < N
    if W_IS_A:  # element (j, n) of A_k [r_k, N]
        stride_wj = N
        stride_wn = 1
    else:  # element (j, n) of B_kᵀ is B_k[n, j]
        stride_wj = 1
        stride_wn = r_k
    offs_r = tl.arange(0, BLOCK_R)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for rb in range(0, tl.cdiv(r_k, BLOCK_R)):
        js = rb * BLOCK_R + offs_r
        j_ok = js < r_k
        x = tl.load(x_ptr + rows[:, None] * stride_xt + js[None, :], mask=j_ok[None, :], other=0.0)
        w = tl.load(w_ptr + w_off + js.to(tl.int64)[:, None] * stride_wj + offs_n.to(tl.int64)[None, :] * stride_wn,
                    mask=j_ok[:, None] & n_ok, other=0.0)
        acc = _lora_dot(x, w, acc, UPCAST_DOT, DOT_PRECISION, "ieee")
    acc = acc * tl.load(scale_ptr + k)
    out_ptrs = out_ptr + offs_m.to(tl.int64)[:, None] * stride_ot + offs_n[None, :]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=(offs_m[:, None] < row_end) & n_ok)


@triton.jit
def _seg_grad_kernel(
    a_ptr,  # [T, M] dyb (adapter dtype) or dy (activation dtype), row stride stride_at, unit column stride
    b_ptr,  # [T, P] lora_x (activation dtype) or xa (adapter dtype), row stride stride_bt, unit column stride
    out_ptr,  # adapter 0's gradient; adapter k's [M_k, P_k] (contiguous) at out_ptr + out_off[k]
    out_off_ptr,  # [K] int64 element offset of adapter k's gradient from out_ptr
    rank_ptr,  # [K] int64 r_k
    scale_ptr,  # [K] fp32 s_k
    seg_start_ptr,  # [K] int64 first row of adapter k's segment
    seg_end_ptr,  # [K] int64 end of adapter k's segment (exclusive)
    M,  # columns of a the gradient spans when RANK_IS_M is false (out_features for dB)
    P,  # columns of b the gradient spans when RANK_IS_M is true (in_features for dA)
    stride_at,
    stride_bt,
    RANK_IS_M: tl.constexpr,  # dA_k [r_k, P]: M_k = r_k; else dB_k [M, r_k]: P_k = r_k
    DOT_PRECISION: tl.constexpr,
    UPCAST_DOT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_P: tl.constexpr,
    BLOCK_T: tl.constexpr,
):
    """out_k[m block, p block] = s_k·Σ_{t in segment k} a[t, m]·b[t, p]; an empty segment stores zeros."""
    k = tl.program_id(0)
    r_k = tl.load(rank_ptr + k)
    if RANK_IS_M:
        m_k = r_k
        p_k = P
    else:
        m_k = M
        p_k = r_k
    t_begin = tl.load(seg_start_ptr + k)
    t_end = tl.load(seg_end_ptr + k)
    offs_m = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_p = tl.program_id(2) * BLOCK_P + tl.arange(0, BLOCK_P)
    m_ok = offs_m < m_k
    p_ok = offs_p < p_k
    offs_t = tl.arange(0, BLOCK_T)
    acc = tl.zeros((BLOCK_M, BLOCK_P), dtype=tl.float32)
    # A block past this adapter's rank (ranks differ) does no work and stores nothing.
    n_steps = tl.where((tl.program_id(1) * BLOCK_M < m_k) & (tl.program_id(2) * BLOCK_P < p_k),
                       tl.cdiv(t_end - t_begin, BLOCK_T), 0)
    for i in range(0, n_steps):
        toks = t_begin + i * BLOCK_T + offs_t
        t_ok = toks[:, None] < t_end
        toks64 = toks.to(tl.int64)
        at = tl.load(a_ptr + toks64[:, None] * stride_at + offs_m[None, :], mask=t_ok & m_ok[None, :], other=0.0)
        bt = tl.load(b_ptr + toks64[:, None] * stride_bt + offs_p[None, :], mask=t_ok & p_ok[None, :], other=0.0)
        acc = _lora_dot(tl.trans(at), bt, acc, UPCAST_DOT, DOT_PRECISION, "ieee")
    acc = acc * tl.load(scale_ptr + k)
    out_ptrs = out_ptr + tl.load(out_off_ptr + k) + offs_m.to(tl.int64)[:, None] * p_k + offs_p[None, :]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=m_ok[:, None] & p_ok[None, :])
