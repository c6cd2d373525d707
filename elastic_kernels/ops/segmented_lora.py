"""Segmented multi-LoRA: K adapters over the row segments of one layer's input. Launchers of the
Triton kernels (segmented_lora_kernels.py), their ``torch.library.triton_op`` registrations,
and the dispatch wrappers that choose between them and the pure-torch reference
(segmented_lora_reference.py: the math, shapes and numerics).

Ops (namespace ``elastic``):

    elastic::segmented_lora_fwd(x, seg_offsets, lora_a, lora_b, scales, lora_x) -> (delta, xa)
    elastic::segmented_lora_bwd(dy, lora_x, xa, seg_offsets, lora_a, lora_b, scales) -> (dx, dA[], dB[])

[Note: segmented LoRA kernel]
One launch per product, over every adapter at once, no Python loop over adapters on the GPU.
The rows are sorted by adapter (segment k = rows [off[k], off[k+1])), so the host cuts each
segment into tiles of BLOCK_M rows (a tile never straddles two adapters; an empty segment has
no tile) and writes a *tile table*: per tile, its adapter and first row. A program of the
row-wise kernels (xa = lora_x·A_kᵀ, dyb = dy·B_k, delta = s_k·xa·B_kᵀ, dx = s_k·dyb·A_k) reads
its tile's entry, the end of that adapter's segment and the adapter's rank, and masks its rows
and rank columns with them; grid (tiles, rank or column blocks), at most T/BLOCK_M + K tiles.
The adapter gradients (dA_k, dB_k: a reduction over the rows of one segment) take one program
per (adapter, row block, column block) of the gradient.
Adapters are addressed by *pointer tables*, not by padding: the kernels get adapter 0's
tensor and, per adapter, the element offset of adapter k's tensor from it (the trick of
[Note: page table as element offsets] in paged_linear.py: differences of addresses in one
flat address space, valid on the GPU and under the interpreter), plus r_k (the row stride of
B_k [out, r_k] and the extent of every rank mask). The gradients are written the same way
into K separate output tensors. Padding the adapters to a power-of-two rank would copy every
adapter into a stacked buffer at every call and the gradients back out of one; the tables
read the parameters in place and write each gradient where autograd wants it. Ranks are
covered in blocks of BLOCK_R (>= 16, the smallest tl.dot), so any mix of ranks runs in the same
launch; a block past a small adapter's rank computes zeros (stored as the padding of xa) or, in
the gradients, nothing. On a GPU BLOCK_R is at most 32, and 16 with fp32 adapters on 16-bit
activations: compiled for sm_90a at the launch parameters (Triton 3.8,
`python tests/kernels/_aot_compile_segmented.py`, every dtype pair, ranks 16 and 64) no
variant spills (largest: the fp32-adapter dA, 255 registers), while 64-rank blocks spilled
260-1664 bytes per thread in the xa kernel and 32-rank blocks 736 bytes in the fp32-adapter
dA and 44 in its xa kernel. Compiled the same way with Triton 3.6.0 (the GPU machine's; the
kernels module loaded without torch), every variant builds, one spill of 4 bytes (fp32 dA,
rank 16). The price: a rank above the block reads its rows once per rank block in the down
kernels (rank 64 with fp32 adapters: 4 reads of lora_x / dy).
All tables (tiles, segment bounds, ranks, offsets; the scales in fp32) are host data: on CUDA
they travel in two small tensors through pinned memory with non-blocking copies, cached per
(device, stream, contents) as the page table is, so a steady state with the same segments
copies nothing. Like the paged ops, a launch cannot be captured in a CUDA graph.
Tiles: BLOCK_M = 64 rows on a GPU (32 under the interpreter). The gradient kernels do not
split a segment's rows over programs (a segment of n rows is one sequential reduction per
gradient tile); on a GPU this parallelises over K x (in / 128) programs for dA and K x
(out / 128) for dB. Not tuned (no GPU measurement yet: bench/bench_segmented_lora.py).
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Sequence

import torch
import triton
from torch._subclasses.functional_tensor import FunctionalTensorMode
from torch.library import triton_op, wrap_triton

from elastic_kernels.ops import segmented_lora_reference as ref
from elastic_kernels.ops._checks import check_seg_offsets, check_segmented_bwd_args, check_segmented_fwd_args
from elastic_kernels.ops._lazy import LazyOps
from elastic_kernels.ops.paged_linear import (
    _INTERP_BLOCK,
    INTERPRETED,
    TRITON_DTYPES,
    _block_k,
    _block_r,
    _check_launchable,
    _check_triton_dtype,
    _dot_precision,
    _lora_grad_block_t,
    _no_launch,
    _opaque_under_functionalization,
    _rows,
    _store_dtype,
    _upcast_dot,
    _use_triton,
)
from elastic_kernels.ops.segmented_lora_kernels import _seg_down_kernel, _seg_grad_kernel, _seg_up_kernel

# =============================================================================================
# Tables ([Note: segmented LoRA kernel])
# =============================================================================================


def _block_m() -> int:
    return _INTERP_BLOCK if INTERPRETED else 64


def _rank_block(r_max: int, act_dtype: torch.dtype, adapter_dtype: torch.dtype) -> int:
    """Ranks per block ([Note: segmented LoRA kernel]): 32 at most on a GPU, 16 with fp32
    adapters on 16-bit activations (their fp32 "ieee" dots hold more in registers)."""
    if INTERPRETED:
        return min(_INTERP_BLOCK, _block_r(r_max))
    return min(16 if adapter_dtype != act_dtype else 32, _block_r(r_max))


def down_meta(act_dtype: torch.dtype, adapter_dtype: torch.dtype, r_max: int, length: int, w_is_a: bool) -> dict:
    """Meta-parameters of `_seg_down_kernel` (xa: w_is_a; dyb: not) as launched."""
    block_l = _INTERP_BLOCK if INTERPRETED else 2 * _block_k(act_dtype)
    extra = {} if INTERPRETED else dict(num_warps=4, num_stages=3)
    return dict(W_IS_A=w_is_a, EVEN_L=length % block_l == 0, DOT_PRECISION=_dot_precision(act_dtype),
                UPCAST_DOT=_upcast_dot(act_dtype), BLOCK_M=_block_m(), BLOCK_L=block_l,
                BLOCK_R=_rank_block(r_max, act_dtype, adapter_dtype), **extra)


def up_meta(act_dtype: torch.dtype, adapter_dtype: torch.dtype, r_max: int, w_is_a: bool) -> dict:
    """Meta-parameters of `_seg_up_kernel` (dx: w_is_a; delta: not) as launched."""
    extra = {} if INTERPRETED else dict(num_warps=4, num_stages=3)
    return dict(W_IS_A=w_is_a, DOT_PRECISION=_dot_precision(act_dtype), UPCAST_DOT=_upcast_dot(act_dtype),
                BLOCK_M=_block_m(), BLOCK_N=_INTERP_BLOCK if INTERPRETED else 64,
                BLOCK_R=_rank_block(r_max, act_dtype, adapter_dtype), **extra)


def grad_meta(act_dtype: torch.dtype, adapter_dtype: torch.dtype, r_max: int, rank_is_m: bool) -> dict:
    """Meta-parameters of `_seg_grad_kernel` (dA: rank_is_m; dB: not) as launched."""
    if INTERPRETED:
        block_t, block_big, extra = _INTERP_BLOCK, _INTERP_BLOCK, {}
    else:
        block_t, block_big = _lora_grad_block_t(act_dtype, adapter_dtype), 128
        extra = dict(num_warps=4, num_stages=3)
    block_rank = _rank_block(r_max, act_dtype, adapter_dtype)
    return dict(RANK_IS_M=rank_is_m, DOT_PRECISION=_dot_precision(act_dtype), UPCAST_DOT=_upcast_dot(act_dtype),
                BLOCK_M=block_rank if rank_is_m else block_big, BLOCK_P=block_big if rank_is_m else block_rank,
                BLOCK_T=block_t, **extra)


def tile_table(seg_offsets: Sequence[int], block_m: int) -> tuple[list[int], list[int]]:
    """(adapter, first row) of every tile: each segment cut into tiles of `block_m` rows."""
    adapters, rows = [], []
    for k in range(len(seg_offsets) - 1):
        starts = range(seg_offsets[k], seg_offsets[k + 1], block_m)
        adapters.extend([k] * len(starts))
        rows.extend(starts)
    return adapters, rows


def element_offsets(tensors: Sequence[torch.Tensor], name: str) -> list[int]:
    """Element offset of each tensor's data from tensors[0]'s (one dtype, one device)."""
    base = tensors[0].data_ptr()
    esize = tensors[0].element_size()
    out = []
    for i, t in enumerate(tensors):
        delta = t.data_ptr() - base
        if delta % esize:
            raise ValueError(
                f"{name}[{i}] starts {delta} bytes from {name}[0], not a multiple of the element size ({esize}); "
                f"the adapters must be element-aligned tensors"
            )
        out.append(delta // esize)
    return out


_TABLE_CACHE: collections.OrderedDict = collections.OrderedDict()
_TABLE_CACHE_SIZE = 256
_TABLE_LOCK = threading.Lock()


def device_table(values: Sequence, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """`values` as a 1-D tensor on `device`; on CUDA through pinned memory, cached per (device,
    stream, dtype, values) ([Note: segmented LoRA kernel])."""
    if device.type != "cuda":
        return torch.tensor(values, dtype=dtype, device=device)
    if torch.cuda.is_current_stream_capturing():
        raise RuntimeError(
            "segmented LoRA ops cannot be captured in a CUDA graph: their tile and adapter tables are built "
            "on the host at each call"
        )
    stream = torch.cuda.current_stream(device)
    key = (device.index, stream.cuda_stream, dtype, tuple(values))
    with _TABLE_LOCK:
        table = _TABLE_CACHE.get(key)
        if table is not None:
            _TABLE_CACHE.move_to_end(key)
            return table
    host = torch.tensor(values, dtype=dtype).pin_memory()
    table = host.to(device, non_blocking=True)  # ordered on `stream`, the stream of every later use
    with _TABLE_LOCK:
        _TABLE_CACHE[key] = table
        while len(_TABLE_CACHE) > _TABLE_CACHE_SIZE:
            _TABLE_CACHE.popitem(last=False)
    return table


class _Tables:
    """The device tables of one call, as views of one int64 tensor (and one fp32 for scales)."""

    def __init__(self, offs, ranks, a_offsets, b_offsets, scales, device, extra=()):
        k = len(ranks)
        tile_adapter, tile_row = tile_table(offs, _block_m())
        self.tiles = len(tile_adapter)
        parts = [tile_adapter, tile_row, offs[:-1], offs[1:], ranks, a_offsets, b_offsets, *extra]
        flat = [v for p in parts for v in p]
        ints = device_table(flat, torch.int64, device)
        bounds, at = [], 0
        for p in parts:
            bounds.append(ints[at : at + len(p)])
            at += len(p)
        (self.tile_adapter, self.tile_row, self.seg_start, self.seg_end, self.rank, self.a_off,
         self.b_off) = bounds[:7]
        self.extra = bounds[7:]
        self.scale = device_table([float(s) for s in scales], torch.float32, device)
        assert len(self.seg_end) == k


# =============================================================================================
# Launchers
# =============================================================================================


def _down(a: torch.Tensor, w0: torch.Tensor, w_off, tb: _Tables, r_max: int, w_is_a: bool,
          adapter_dtype: torch.dtype) -> torch.Tensor:
    """[T, R] = a·M_k per row (xa or dyb), rounded to the adapter dtype."""
    t, l_ = a.shape
    out = a.new_empty((t, r_max), dtype=_store_dtype(adapter_dtype))
    meta = down_meta(a.dtype, adapter_dtype, r_max, l_, w_is_a)
    wrap_triton(_seg_down_kernel)[(tb.tiles, triton.cdiv(r_max, meta["BLOCK_R"]))](
        a, w0, w_off, tb.rank, tb.tile_adapter, tb.tile_row, tb.seg_end, out,
        l_, r_max, a.stride(0), out.stride(0), **meta,
    )  # fmt: skip
    return out.to(adapter_dtype)


def _up(x: torch.Tensor, w0: torch.Tensor, w_off, tb: _Tables, n: int, r_max: int, w_is_a: bool,
        act_dtype: torch.dtype) -> torch.Tensor:
    """[T, N] = s_k·x[:, :r_k]·M_k per row (delta or dx), in x's dtype (the adapter dtype)."""
    t = x.shape[0]
    out = x.new_empty((t, n), dtype=_store_dtype(x.dtype))
    meta = up_meta(act_dtype, x.dtype, r_max, w_is_a)
    wrap_triton(_seg_up_kernel)[(tb.tiles, triton.cdiv(n, meta["BLOCK_N"]))](
        x, w0, w_off, tb.rank, tb.scale, tb.tile_adapter, tb.tile_row, tb.seg_end, out,
        n, x.stride(0), out.stride(0), **meta,
    )  # fmt: skip
    return out.to(x.dtype)


def _grads(a: torch.Tensor, b: torch.Tensor, outs: list[torch.Tensor], out_off, tb: _Tables, r_max: int,
           rank_is_m: bool, act_dtype: torch.dtype, adapter_dtype: torch.dtype) -> None:
    """outs[k] = s_k·a[seg k]ᵀ·b[seg k] (dA_k when rank_is_m, else dB_k), written in place."""
    m, p = a.shape[1], b.shape[1]
    meta = grad_meta(act_dtype, adapter_dtype, r_max, rank_is_m)
    grid = (len(outs), triton.cdiv(r_max if rank_is_m else m, meta["BLOCK_M"]),
            triton.cdiv(p if rank_is_m else r_max, meta["BLOCK_P"]))
    wrap_triton(_seg_grad_kernel)[grid](
        a, b, outs[0], out_off, tb.rank, tb.scale, tb.seg_start, tb.seg_end,
        m, p, a.stride(0), b.stride(0), **meta,
    )  # fmt: skip


def _adapters(lora_a, lora_b) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    return [a.contiguous() for a in lora_a], [b.contiguous() for b in lora_b]


# =============================================================================================
# Ops
# =============================================================================================


def _segmented_lora_fwd(
    x: torch.Tensor,
    seg_offsets: list[int],
    lora_a: list[torch.Tensor],
    lora_b: list[torch.Tensor],
    scales: list[float],
    lora_x: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    t, _, n, offs, ranks = check_segmented_fwd_args(x, seg_offsets, lora_a, lora_b, scales, lora_x)
    _check_triton_dtype(x.dtype, "x")
    adapter = lora_a[0].dtype
    r_max = max(ranks)
    if t == 0 or _no_launch(x):
        return x.new_empty((t, n), dtype=adapter), x.new_zeros((t, r_max), dtype=adapter)
    _check_launchable(x, "x")
    lora_a, lora_b = _adapters(lora_a, lora_b)
    tb = _Tables(offs, ranks, element_offsets(lora_a, "lora_a"), element_offsets(lora_b, "lora_b"), scales,
                 x.device)
    lx = _rows(x if lora_x is None else lora_x)
    xa = _down(lx, lora_a[0], tb.a_off, tb, r_max, True, adapter)
    delta = _up(xa, lora_b[0], tb.b_off, tb, n, r_max, False, x.dtype)
    return delta, xa


def _segmented_lora_bwd(
    dy: torch.Tensor,
    lora_x: torch.Tensor,
    xa: torch.Tensor,
    seg_offsets: list[int],
    lora_a: list[torch.Tensor],
    lora_b: list[torch.Tensor],
    scales: list[float],
) -> tuple[torch.Tensor, list[torch.Tensor], list[torch.Tensor]]:
    t, k_in, n, offs, ranks = check_segmented_bwd_args(dy, lora_x, xa, seg_offsets, lora_a, lora_b, scales)
    _check_triton_dtype(lora_x.dtype, "lora_x")
    adapter = lora_a[0].dtype
    r_max = max(ranks)
    if t == 0 or _no_launch(dy):
        # No rows: the gradients are zero (an empty sum), not garbage.
        return (dy.new_empty((t, k_in), dtype=adapter),
                [dy.new_zeros((r, k_in), dtype=adapter) for r in ranks],
                [dy.new_zeros((n, r), dtype=adapter) for r in ranks])
    _check_launchable(dy, "dy")
    lora_a, lora_b = _adapters(lora_a, lora_b)
    store = _store_dtype(adapter)
    grad_a = [dy.new_empty((r, k_in), dtype=store) for r in ranks]
    grad_b = [dy.new_empty((n, r), dtype=store) for r in ranks]
    tb = _Tables(offs, ranks, element_offsets(lora_a, "lora_a"), element_offsets(lora_b, "lora_b"), scales,
                 dy.device, extra=(element_offsets(grad_a, "dA"), element_offsets(grad_b, "dB")))
    ga_off, gb_off = tb.extra
    dy, lora_x, xa = _rows(dy), _rows(lora_x), _rows(xa)
    dyb = _down(dy, lora_b[0], tb.b_off, tb, r_max, False, adapter)  # rounded to the adapter dtype
    dx = _up(dyb, lora_a[0], tb.a_off, tb, k_in, r_max, True, dy.dtype)
    _grads(dyb, lora_x, grad_a, ga_off, tb, r_max, True, lora_x.dtype, adapter)
    _grads(dy, xa, grad_b, gb_off, tb, r_max, False, lora_x.dtype, adapter)
    return dx, [g.to(adapter) for g in grad_a], [g.to(adapter) for g in grad_b]


def _register_ops() -> dict:
    """The ``elastic::`` ops of this family ([Note: Triton ops register lazily] in _lazy.py)."""
    fwd = triton_op("elastic::segmented_lora_fwd", mutates_args=())(_segmented_lora_fwd)
    bwd = triton_op("elastic::segmented_lora_bwd", mutates_args=())(_segmented_lora_bwd)
    for op in (fwd, bwd):  # [Note: the ops are opaque to tracing] (paged_linear.py): addresses, not values
        op.register_torch_dispatch(FunctionalTensorMode, _opaque_under_functionalization)
    return {"_segmented_lora_fwd_op": fwd, "_segmented_lora_bwd_op": bwd, "OPS": (fwd, bwd)}


# _segmented_lora_fwd_op, _segmented_lora_bwd_op and OPS are bound by _register_ops on first need
# (_LAZY.get, or an attribute access), not at import.
_LAZY = LazyOps(__name__, ("_segmented_lora_fwd_op", "_segmented_lora_bwd_op", "OPS"), _register_ops)
register_ops = _LAZY.ensure


def __getattr__(name: str):
    return _LAZY.get(name)


# =============================================================================================
# Dispatch wrappers
# =============================================================================================


def segmented_lora_fwd(
    x: torch.Tensor,
    seg_offsets: Sequence[int],
    lora_a: Sequence[torch.Tensor],
    lora_b: Sequence[torch.Tensor],
    scales: Sequence[float],
    lora_x: torch.Tensor | None = None,
    *,
    impl: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(delta, xa)`` of K adapters over the row segments of x ([T, in], rows sorted by adapter):
    for rows [off[k], off[k+1]), ``xa = lx·A_kᵀ`` (columns r_k.. zero) and
    ``delta = s_k·xa·B_kᵀ``, with lx = ``lora_x`` (the dropout-applied rows) or x.

    ``seg_offsets``: K + 1 ints from 0 to T, non-decreasing (a segment may be empty);
    ``lora_a[k]`` [r_k, in], ``lora_b[k]`` [out, r_k] (ranks may differ), ``scales[k]``.
    The adapters share one dtype: x's, or float32 with bf16/fp16 x. ``delta`` [T, out] and
    ``xa`` [T, max r_k] are in the adapter dtype (segmented_lora_reference.py). ``impl``:
    "auto" (Triton for CUDA tensors of fp32/bf16/fp16, the reference otherwise), "triton" or
    "reference"."""
    if _use_triton(impl, x):
        op = _LAZY.get("_segmented_lora_fwd_op")
        return op(x, _int_list(seg_offsets), _tensors(lora_a, "lora_a"), _tensors(lora_b, "lora_b"), _floats(scales),
                  lora_x)
    return ref.segmented_lora_fwd_reference(x, seg_offsets, lora_a, lora_b, scales, lora_x)


def segmented_lora_bwd(
    dy: torch.Tensor,
    lora_x: torch.Tensor,
    xa: torch.Tensor,
    seg_offsets: Sequence[int],
    lora_a: Sequence[torch.Tensor],
    lora_b: Sequence[torch.Tensor],
    scales: Sequence[float],
    *,
    impl: str = "auto",
) -> tuple[torch.Tensor, list[torch.Tensor], list[torch.Tensor]]:
    """``(dx, dA, dB)`` for the upstream gradient dy [T, out]: per segment k,
    ``dx = s_k·(dy·B_k)·A_k`` (the LoRA part of the input gradient, in the adapter dtype),
    ``dA[k] = s_k·(dy·B_k)ᵀ·lora_x``, ``dB[k] = s_k·dyᵀ·xa[:, :r_k]`` (adapter dtype, fp32
    accumulation). ``lora_x`` is the LoRA input of the forward (x when it had none), ``xa`` what
    the forward returned."""
    if _use_triton(impl, dy):
        op = _LAZY.get("_segmented_lora_bwd_op")
        return op(dy, lora_x, xa, _int_list(seg_offsets), _tensors(lora_a, "lora_a"), _tensors(lora_b, "lora_b"),
                  _floats(scales))
    return ref.segmented_lora_bwd_reference(dy, lora_x, xa, seg_offsets, lora_a, lora_b, scales)


# The ops' schemas take int[] / Tensor[] / float[]: a wrong type must fail with the checks'
# message, not in the dispatcher's argument parser.


def _int_list(v) -> list:
    if isinstance(v, (torch.Tensor, str)) or not isinstance(v, Sequence) or not all(
        isinstance(i, int) and not isinstance(i, bool) for i in v
    ):
        check_seg_offsets(v, len(v) - 1 if isinstance(v, Sequence) else 0)  # raises the error naming the problem
        raise TypeError(f"seg_offsets must be a list of ints, got {v!r}")
    return list(v)


def _tensors(v, name: str) -> list:
    if isinstance(v, torch.Tensor) or not isinstance(v, (list, tuple)):
        raise TypeError(f"{name} must be a list of K tensors (one per adapter), got {type(v).__name__}")
    for i, t in enumerate(v):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name}[{i}] must be a torch.Tensor, got {type(t).__name__}")
    return list(v)


def _floats(v) -> list:
    if isinstance(v, torch.Tensor) or not isinstance(v, (list, tuple)):
        raise TypeError(f"scales must be a list of K floats, got {type(v).__name__}")
    out = []
    for i, s in enumerate(v):
        if isinstance(s, bool) or not isinstance(s, (int, float)):
            raise TypeError(f"scales[{i}] must be a finite float, got {s!r}")
        out.append(float(s))
    return out


# OPS (registered lazily: [Note: Triton ops register lazily]) is left out, so that a star import
# does not register the ops.
__all__ = ["TRITON_DTYPES", "device_table", "element_offsets", "segmented_lora_bwd", "segmented_lora_fwd",
           "tile_table"]
