"""Pure-torch reference of the paged LoRA linear ops, and the argument checks they share.

A frozen weight ``W [N, K]`` (out_features N, in_features K) arrives as a *page table*
``chunks``: a list of contiguous ``[rows_c, K]`` views of pool pages, every chunk with
``rows_per_chunk = chunks[0].shape[0]`` rows except a ragged last one (see
``elastic_kernels.layout``, [Note: chunk-major shard layout]). LoRA adds ``A [r, K]``,
``B [N, r]`` and a scale ``s``. The three ops:

    paged_lora_linear_fwd(x, chunks, bias, lora_x, lora_a, lora_b, s) -> (y, xa)
        xa = lora_x·Aᵀ                                   [T, r]
        y  = x·Wᵀ + bias + s·xa·Bᵀ                       [T, N]
    paged_lora_linear_dgrad(dy, chunks, lora_a, lora_b, s) -> (dx, dyb)
        dyb = dy·B                                       [T, r]
        dx  = dy·W + s·dyb·A                             [T, K]
    lora_adapter_grads(lora_x, xa, dy, dyb, s) -> (dA, dB)
        dA = s·dybᵀ·lora_x                               [r, K]
        dB = s·dyᵀ·xa                                    [N, r]

[Note: numerics of the paged LoRA ops]
Two dtypes. The *activation dtype* is that of x, the chunks, bias and lora_x (forward), of dy
(dgrad), of lora_x and dy (adapter gradients): they must agree. The *adapter dtype* is that of
lora_a and lora_b (which must agree) and of the xa / dyb the ops return and take back; it is
the activation dtype, or float32 (PEFT's autocast_adapter_dtype: fp32 adapters on a bf16/fp16
model). Any other combination (fp16 adapters with bf16 x, fp64 adapters with fp32 x, ...) is
a TypeError naming the arguments. (fp32 adapters with fp64 activations are accepted too, by
the reference only, since only it takes fp64; the accumulation is then fp64.)
- Every product accumulates in fp32 (in fp64 when the activations are fp64); a 16-bit operand
  meeting an fp32 one is widened exactly, never the fp32 one narrowed.
- ``xa = lora_x·Aᵀ`` and ``dyb = dy·B`` are rounded once to the adapter dtype, and the LoRA term
  ``s·xa·Bᵀ`` / ``s·dyb·A`` is computed from that rounded value, *before* it joins the fp32
  accumulator of ``y`` / ``dx``: they are also returned (autograd saves ``xa`` for ``dB`` and
  uses ``dyb`` for ``dA``), so the forward and backward see one value. With 16-bit adapters
  this is eager PEFT's rounding (``lora_B(lora_A(x))`` in bf16 rounds ``x·Aᵀ``); with fp32
  adapters it is no rounding at all (fp32 is the accumulator), as in PEFT, which casts x to
  the adapters' fp32 for the LoRA branch.
- ``y`` and ``dx`` are in the activation dtype, rounded once from the fp32 sum of base product,
  bias and LoRA term (eager PEFT rounds the base product and the sum separately).
- ``dA`` and ``dB`` are in the adapter dtype, each rounded once from its fp32 accumulator.
The Triton kernels in ``paged_linear`` do the same ([Note: adapter dtype in the kernels]), so
both impls define one op; the one difference beyond the order of fp32 additions: on a GPU,
with fp32 adapters, the LoRA term fused into y / dx multiplies in tf32x3 (each product within
~3·2^-22 relative of the fp32 one, far below y's / dx's 16-bit rounding). Same-dtype calls are
exactly what they were before fp32 adapters.
Without LoRA, ``xa`` / ``dyb`` are empty ``[T, 0]`` tensors in the activation dtype (an op
returns tensors, not None).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

_LOW_PRECISION = (torch.bfloat16, torch.float16)


# ---------------------------------------------------------------------------------------------
# Argument checks (shared by the reference and the Triton ops; shape-only, so they also run
# under FakeTensorMode). Every error names the argument at fault.
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


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """Accumulation dtype of the ops for activations of `dtype`: fp32 for 16-bit, `dtype`
    otherwise (fp32 or fp64, never narrower than the adapter dtype)."""
    return torch.float32 if dtype in _LOW_PRECISION else dtype


def chunk_row_ranges(chunks: Sequence[torch.Tensor]) -> list[tuple[int, int]]:
    """[begin, end) row range of each chunk in the whole weight."""
    out, begin = [], 0
    for c in chunks:
        out.append((begin, begin + int(c.shape[0])))
        begin += int(c.shape[0])
    return out


# ---------------------------------------------------------------------------------------------
# References. Each reads W chunk by chunk (never concatenates it) and follows
# [Note: numerics of the paged LoRA ops].
# ---------------------------------------------------------------------------------------------


def paged_lora_linear_fwd_reference(
    x: torch.Tensor,
    chunks: Sequence[torch.Tensor],
    bias: torch.Tensor | None = None,
    lora_x: torch.Tensor | None = None,
    lora_a: torch.Tensor | None = None,
    lora_b: torch.Tensor | None = None,
    scale: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    t, k, n, r, _ = check_fwd_args(x, chunks, bias, lora_x, lora_a, lora_b)
    acc = acc_dtype(x.dtype)
    xacc_t = x.to(acc).t()
    # yᵀ [N, T], chunk c filling rows [begin, end): a chunk is then the row operand of its GEMM
    # and writes a contiguous block. Writing y[:, begin:end] instead (a chunk as the column
    # operand, out= a strided slice) measured 1.3-1.5x slower than dense F.linear for pages of 93
    # rows, this ~1.05x (CPU, 1 thread, T=256, K=2816, N=1024, min of 21 calls; NOTES.md).
    y_t = torch.empty((n, t), dtype=acc, device=x.device)
    for c, (begin, end) in zip(chunks, chunk_row_ranges(chunks)):
        torch.mm(c.to(acc), xacc_t, out=y_t[begin:end])
    if bias is not None:
        y_t.add_(bias.to(acc)[:, None])
    if r:
        lx = x if lora_x is None else lora_x
        xa = (lx.to(acc) @ lora_a.to(acc).t()).to(lora_a.dtype)  # rounded to the adapter dtype
        y_t.addmm_(lora_b.to(acc), xa.to(acc).t(), alpha=float(scale))
    else:
        xa = x.new_empty((t, 0))
    y = torch.empty((t, n), dtype=x.dtype, device=x.device)
    y.copy_(y_t.t())  # one pass: transpose and round to x's dtype
    return y, xa


def paged_lora_linear_dgrad_reference(
    dy: torch.Tensor,
    chunks: Sequence[torch.Tensor],
    lora_a: torch.Tensor | None = None,
    lora_b: torch.Tensor | None = None,
    scale: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    t, k, n, r, _ = check_dgrad_args(dy, chunks, lora_a, lora_b)
    acc = acc_dtype(dy.dtype)
    dyacc = dy.to(acc)
    dx = torch.zeros((t, k), dtype=acc, device=dy.device)
    for c, (begin, end) in zip(chunks, chunk_row_ranges(chunks)):
        dx.addmm_(dyacc[:, begin:end], c.to(acc))
    if r:
        dyb = (dyacc @ lora_b.to(acc)).to(lora_b.dtype)  # rounded to the adapter dtype
        dx.addmm_(dyb.to(acc), lora_a.to(acc), alpha=float(scale))
    else:
        dyb = dy.new_empty((t, 0))
    return dx.to(dy.dtype), dyb


def lora_adapter_grads_reference(
    lora_x: torch.Tensor,
    xa: torch.Tensor,
    dy: torch.Tensor,
    dyb: torch.Tensor,
    scale: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    check_adapter_grad_args(lora_x, xa, dy, dyb)
    acc = acc_dtype(lora_x.dtype)  # the activation dtype's: fp32 for 16-bit, so also for fp32 xa
    s = float(scale)
    grad_a = torch.mm(dyb.to(acc).t(), lora_x.to(acc)).mul_(s)
    grad_b = torch.mm(dy.to(acc).t(), xa.to(acc)).mul_(s)
    return grad_a.to(xa.dtype), grad_b.to(xa.dtype)  # the adapter dtype

