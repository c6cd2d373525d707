"""The segmented LoRA kernels against K separate PEFT LoRA layers on the same rows (issue 29's
GPU check; runs under `make gpu-check`, skipped there with its reason when peft is missing,
since peft is imported at the top).

Each adapter k is a PEFT ``LoraLayer`` (``peft.tuners.lora.Linear``) around a frozen zero
weight, so its output is its LoRA term alone: ``lora_B(lora_A(x)) * scaling``. The rows of
adapter k go through layer k, forward and backward (dx, dA, dB by autograd); the op gets the
same adapters and all the rows at once. Tolerance (CONVENTIONS.md): the op's max error against
float64 at most 2x PEFT's own error in the same dtypes (bf16 activations, fp32 adapters: PEFT
runs the branch in fp32 and casts the output back to bf16, the op returns fp32, so the op's
error is the smaller one here, and the rule checks it is not larger).
"""

from __future__ import annotations

import peft  # noqa: F401 - collection fails without it: gpu-check reports the file skipped
import pytest
import torch
import torch.nn as nn
from peft import LoraConfig
from peft.tuners.lora import Linear as PeftLoraLinear

from elastic_kernels.ops import segmented_lora as sl
from tests.kernels.test_paged_linear import assert_k_rule
from tests.kernels.test_segmented_lora import d, exact, make_problem


def peft_layers(p):
    """One PEFT LoRA layer per adapter, holding the problem's A_k, B_k and s_k."""
    layers = []
    for k, r in enumerate(p.ranks):
        base = nn.Linear(p.IN, p.OUT, bias=False, device=p.x.device, dtype=p.dtype).requires_grad_(False)
        nn.init.zeros_(base.weight)  # the layer's output is its LoRA term alone
        alpha = p.scales[k] * r  # PEFT: scaling = lora_alpha / r
        layer = PeftLoraLinear(base, "default", LoraConfig(r=r, lora_alpha=alpha), r=r, lora_alpha=alpha)
        layer.lora_A["default"].to(p.adapter_dtype)  # what PEFT's autocast_adapter_dtype does for fp32
        layer.lora_B["default"].to(p.adapter_dtype)
        with torch.no_grad():
            layer.lora_A["default"].weight.copy_(p.lora_a[k])
            layer.lora_B["default"].weight.copy_(p.lora_b[k])
        assert layer.lora_A["default"].weight.dtype == p.adapter_dtype
        assert abs(layer.scaling["default"] - p.scales[k]) < 1e-12
        layers.append(layer)
    return layers


def peft_run(p, layers):
    """delta, dx, dA, dB of K PEFT layers, each on its rows."""
    x = p.lora_x.detach().clone().requires_grad_()
    outs = [layers[k](x[p.offs[k] : p.offs[k + 1]]) for k in range(len(layers))]
    torch.autograd.backward(outs, [p.dy[p.offs[k] : p.offs[k + 1]] for k in range(len(layers))])
    delta = torch.cat(outs).detach()
    return (delta, x.grad, [la.lora_A["default"].weight.grad for la in layers],
            [la.lora_B["default"].weight.grad for la in layers])


@pytest.mark.gpu
@pytest.mark.parametrize("adapter_dtype", [torch.bfloat16, torch.float32], ids=["bf16-adapters", "fp32-adapters"])
@pytest.mark.parametrize("shape", [
    (47, 33, 40, [0, 13, 13, 40, 47], [1, 8, 40, 16]),
    (4096, 2048, 1536, [0, 1000, 1000, 2500, 4096], [16, 8, 128, 64]),
], ids=["small", "4096x2048x1536-K4"])  # fmt: skip
def test_gpu_against_peft_layers(shape, adapter_dtype):
    p = make_problem(shape, torch.bfloat16, adapter_dtype, device="cuda")
    ex = exact(p)
    delta, xa = sl.segmented_lora_fwd(p.x, p.offs, p.lora_a, p.lora_b, p.scales, p.lora_x)
    dx, da, db = sl.segmented_lora_bwd(p.dy, p.lora_x, xa, p.offs, p.lora_a, p.lora_b, p.scales)
    pd, pdx, pda, pdb = peft_run(p, peft_layers(p))
    assert_k_rule(delta.to(pd.dtype), pd, ex.delta, "delta")
    assert_k_rule(dx.to(pdx.dtype), pdx, ex.dx, "dx")
    for k in range(len(p.ranks)):
        if p.offs[k] == p.offs[k + 1]:  # no rows: a zero gradient (an empty sum) from both
            assert not pda[k].any() and not da[k].any() and not db[k].any()
            continue
        assert_k_rule(da[k], pda[k], ex.da[k], f"dA[{k}]")
        assert_k_rule(db[k], pdb[k], ex.db[k], f"dB[{k}]")
    assert d(delta).shape == ex.delta.shape
