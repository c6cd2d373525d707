"""Pure-torch reference of the paged LoRA linear ops (their meaning; the argument checks are in _checks.py).

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
The Triton kernels (paged_linear_kernels.py) do the same ([Note: adapter dtype in the kernels]), so
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

from elastic_kernels.ops._checks import check_adapter_grad_args, check_dgrad_args, check_fwd_args

_LOW_PRECISION = (torch.bfloat16, torch.float16)


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

