"""Pure-torch reference of the segmented multi-LoRA ops (their meaning; the argument checks are
in _checks.py), grouped per adapter: one pair of GEMMs per segment.

K adapters share one layer's rows: rows ``[seg_offsets[k], seg_offsets[k+1])`` of the input
belong to adapter k (rows sorted by adapter; a segment may be empty). Adapter k has
``A_k [r_k, in]``, ``B_k [out, r_k]`` and a scale ``s_k``; ranks may differ. With
``R = max_k r_k`` and ``lx`` the LoRA input (``lora_x``, the dropout-applied rows, or x):

    segmented_lora_fwd(x, seg_offsets, lora_a, lora_b, scales, lora_x) -> (delta, xa)
        xa[seg k, :r_k]    = lx[seg k]·A_kᵀ                 [T, R], xa[seg k, r_k:] = 0
        delta[seg k]       = s_k·xa[seg k, :r_k]·B_kᵀ       [T, out]
    segmented_lora_bwd(dy, lora_x, xa, seg_offsets, lora_a, lora_b, scales) -> (dx, dA, dB)
        dyb[seg k]         = dy[seg k]·B_k                  [n_k, r_k]  (internal)
        dx[seg k]          = s_k·dyb[seg k]·A_k             [T, in]   (the LoRA part of dx only)
        dA[k]              = s_k·dyb[seg k]ᵀ·lx[seg k]      [r_k, in]
        dB[k]              = s_k·dy[seg k]ᵀ·xa[seg k, :r_k] [out, r_k]

The base product (x·Wᵀ, dy·W) is not part of these ops: the caller computes it once over the
rows of every adapter (the paged ops without LoRA) and adds ``delta`` / ``dx``.

Numerics: [Note: numerics of the paged LoRA ops] (paged_linear_reference.py) for each segment,
with one difference: ``delta`` and ``dx`` are a term of their own, returned in the *adapter
dtype* (each rounded once from its fp32 accumulator), so with fp32 adapters on 16-bit
activations nothing of the LoRA branch is rounded to 16 bits before the caller adds it to the
16-bit base output (PEFT's numerics: its LoRA branch runs in the adapters' fp32 and the sum
is rounded once); with same-dtype adapters it is eager PEFT's ``lora_B(lora_A(x)) * s``
rounded once instead of three times. ``xa`` and ``dyb`` are rounded to the adapter dtype, and
the products after them use those rounded values, as in the paged ops. An empty segment gives
zero gradients for its adapter (an empty sum).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from elastic_kernels.ops._checks import check_segmented_bwd_args, check_segmented_fwd_args
from elastic_kernels.ops.paged_linear_reference import acc_dtype


def segmented_lora_fwd_reference(
    x: torch.Tensor,
    seg_offsets: Sequence[int],
    lora_a: Sequence[torch.Tensor],
    lora_b: Sequence[torch.Tensor],
    scales: Sequence[float],
    lora_x: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    t, _, n, offs, ranks = check_segmented_fwd_args(x, seg_offsets, lora_a, lora_b, scales, lora_x)
    adapter = lora_a[0].dtype
    acc = acc_dtype(x.dtype)
    lx = x if lora_x is None else lora_x
    xa = torch.zeros((t, max(ranks)), dtype=adapter, device=x.device)
    delta = torch.empty((t, n), dtype=adapter, device=x.device)
    for k, (a, b, s) in enumerate(zip(lora_a, lora_b, scales)):
        lo, hi = offs[k], offs[k + 1]
        if lo == hi:
            continue
        r = ranks[k]
        xk = (lx[lo:hi].to(acc) @ a.to(acc).t()).to(adapter)  # rounded to the adapter dtype
        xa[lo:hi, :r] = xk
        delta[lo:hi] = torch.mm(xk.to(acc), b.to(acc).t()).mul_(float(s)).to(adapter)
    return delta, xa


def segmented_lora_bwd_reference(
    dy: torch.Tensor,
    lora_x: torch.Tensor,
    xa: torch.Tensor,
    seg_offsets: Sequence[int],
    lora_a: Sequence[torch.Tensor],
    lora_b: Sequence[torch.Tensor],
    scales: Sequence[float],
) -> tuple[torch.Tensor, list[torch.Tensor], list[torch.Tensor]]:
    t, k_in, _, offs, ranks = check_segmented_bwd_args(dy, lora_x, xa, seg_offsets, lora_a, lora_b, scales)
    adapter = lora_a[0].dtype
    acc = acc_dtype(lora_x.dtype)
    dx = torch.empty((t, k_in), dtype=adapter, device=dy.device)
    grad_a, grad_b = [], []
    for k, (a, b, s) in enumerate(zip(lora_a, lora_b, scales)):
        lo, hi = offs[k], offs[k + 1]
        s = float(s)
        dyk = dy[lo:hi].to(acc)
        dyb = (dyk @ b.to(acc)).to(adapter)  # rounded to the adapter dtype, as the paged dgrad
        dx[lo:hi] = torch.mm(dyb.to(acc), a.to(acc)).mul_(s).to(adapter)
        grad_a.append(torch.mm(dyb.to(acc).t(), lora_x[lo:hi].to(acc)).mul_(s).to(adapter))
        grad_b.append(torch.mm(dyk.t(), xa[lo:hi, : ranks[k]].to(acc)).mul_(s).to(adapter))
    return dx, grad_a, grad_b
