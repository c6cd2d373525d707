"""Frozen linear layers whose weight is an elastic tensor: `ElasticLinear` and its autograd
function, plus what every elastic layer shares (the op dtype under autocast, per-use chunk
casts, refusing `.to()` conversions). The LoRA layer is lora.py; putting a model under the
runtime, convert.py.

`ElasticLinear` is a frozen linear whose weight lives as chunk-major shards plus pool pages;
its autograd function computes chunk by chunk as chunks arrive (`execute`), saves no weight,
and re-gathers in backward whatever was discarded.

[Note: chunked compute and bit-exactness]
Forward computes y[:, rows_c] = x·W_cᵀ (+ b[rows_c]) per chunk; backward accumulates
dx += dy[:, rows_c]·W_c over chunks in index order. A CPU GEMM over a column block is not
bit-identical to the same columns of a full GEMM (blocking changes the reduction), so the
elastic layer matches plain `F.linear` to fp32 rounding, and matches bit for bit any
computation with the same chunking (that is what the parity tests compare against: the
distributed machinery must not change a single bit).

[Note: mixed precision]
The layers follow autocast as `nn.Linear` does. The *op dtype* is autocast's
(`torch.get_autocast_dtype(device_type)`) when autocast is enabled for the input's device and
the input is fp32/fp16/bf16 (autocast leaves fp64 alone), else the input's dtype, which must
then equal the frozen weight's: outside autocast a mismatch is a TypeError, as in a plain
GEMM. The input, the bias and every chunk are cast to the op dtype *per use*, inside the
autograd function, forward and backward alike (backward re-gathers chunks, so it casts
again; no cast copy of a weight outlives its use, which is what autocast does for a frozen
`nn.Linear` weight too: its cast cache holds only tensors that require grad). The function
body runs with autocast disabled, so the reference ops compute in exactly the dtypes given.
dx goes back in the input's dtype. The shards themselves never change dtype or device:
`.to(dtype)`, `.half()`, `.to(device)` on a converted model cannot reach them, so `_apply`
refuses any conversion that would change the frozen weight and lets no-ops through
(Trainer and HF call `model.to(device)` on a model already there).

[Note: torch.compile]
The forward of an elastic layer is `torch.compiler.disable`d: it talks to the runtime
(phases, learned order, prefetch, pool pins), which must run once per real call, never be
traced into a graph or replayed from one. Dynamo breaks the graph at each elastic layer and
compiles everything between them; the layer runs eagerly under the real autocast state.
The autograd functions save only their inputs or fresh intermediates, never a view or
no-op alias of an input (AOTAutograd rejects a saved intermediate that aliases an input: the
"intermediate tensor 'x2' ... aliases an input" of the original report), so they stay
correct if a later change lets the compiler trace them. Checked by hand with the forward's
`torch.compiler.disable` removed and a runtime dynamo traces through (the one before commit
fb177b8): the model then compiles with the LoRA function traced as a higher-order op, and
loss and adapter gradients match eager (aot_eager, 1e-8); tests/nn/test_lora_setups.py checks
the disabled form and that no saved tensor is a view of the input.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..quant import dequantize_use
from ..runtime import ElasticRuntime, ElasticTensor, Phase

# The attribute of a converted model (or of a layer built alone) that holds its runtime.
RUNTIME_ATTR = "_elastic_runtime"

_AUTOCAST_ELIGIBLE = (torch.float32, torch.float16, torch.bfloat16)


LOW_PRECISION = (torch.bfloat16, torch.float16)


def op_dtype(x: torch.Tensor, weight_dtype: torch.dtype, name: str) -> torch.dtype:
    """The dtype an elastic layer computes in for input `x` ([Note: mixed precision])."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name}: the input must be a torch.Tensor, got {type(x).__name__}")
    if x.dim() == 0:
        raise ValueError(f"{name}: the input is a scalar; a linear layer needs at least one dimension (features)")
    device_type = x.device.type
    if x.dtype in _AUTOCAST_ELIGIBLE and torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    if x.dtype != weight_dtype:
        raise TypeError(
            f"{name}: input dtype {x.dtype} differs from the layer's weight dtype {weight_dtype} "
            f"(cast the input, or run the model under torch.autocast for mixed precision)"
        )
    return weight_dtype


def no_autocast(device_type: str):
    """The body of an elastic autograd function runs in the dtypes it was given."""
    return torch.autocast(device_type, enabled=False)


def cast_chunks(chunks: list[torch.Tensor], dtype: torch.dtype) -> list[torch.Tensor]:
    """Chunks in the op dtype, for this use only (no-op when they already are)."""
    return chunks if not chunks or chunks[0].dtype == dtype else [c.to(dtype) for c in chunks]


def dequantized_views(et: ElasticTensor, chunks: list[torch.Tensor], dtype: torch.dtype,
                      first_chunk: int = 0) -> list[torch.Tensor]:
    """What the GEMM reads for the use's chunks `first_chunk`, ...: [rows, cols] views in the
    op dtype, not the pool's chunks: a full-precision chunk cast (itself when it already is in
    that dtype), a quantized weight's blobs dequantized once into the runtime's workspace
    ([Note: quantized frozen weights] in python_api/quant/__init__.py)."""
    if et.qlayout is None:
        return cast_chunks(chunks, dtype)
    return dequantize_use(et.qlayout, chunks, dtype, et.runtime.dequant_workspace, first_chunk)


weight_chunks = dequantized_views  # the former name, kept for callers outside the library


def refuse_conversion(module: nn.Module, fn) -> None:
    """Raise if `fn` (what `Module._apply` applies) would change the frozen weight's dtype or
    device; a no-op conversion passes ([Note: mixed precision])."""
    et = module.et
    probe = torch.empty(0, dtype=et.dtype, device=et.device)
    try:
        out = fn(probe)
    except Exception:  # noqa: BLE001 - not a conversion we can judge: let _apply do what it does
        return
    if isinstance(out, torch.Tensor) and (out.dtype != probe.dtype or out.device != probe.device):
        raise RuntimeError(
            f"{et.name}: cannot move or cast an elastic layer to {out.dtype} on {out.device}: its frozen weight "
            f"({et.dtype} on {probe.device}) lives as shards in the elastic runtime, which .to()/.half()/.float()/"
            f".cuda() do not reach. Convert the model to the dtype and device you want before "
            f"convert_to_elastic/elasticize, or keep it as it is and use torch.autocast for mixed precision. "
            f"(Modules visited before this one may already have been converted: rebuild the model.)"
        )


class ElasticLinearFunction(torch.autograd.Function):
    """y = x·Wᵀ + b in `dtype` ([Note: mixed precision]), chunk by chunk as chunks arrive;
    saves nothing, backward re-gathers W for dx."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, bias: torch.Tensor | None, et: ElasticTensor, dtype: torch.dtype,
                keep_for_backward: bool):
        rt = et.runtime
        out_features = et.shape[0]
        with no_autocast(x.device.type):
            x2 = x.reshape(-1, x.shape[-1]).to(dtype)
            b = None if bias is None else bias.to(dtype)

            def fwd_chunk(c, w):
                r0, r1 = et.layout.chunk_rows(c)
                w = dequantized_views(et, [w], dtype, c)[0]
                y[:, r0:r1] = F.linear(x2, w.to(dtype), None if b is None else b[r0:r1])

            with rt.use(et, Phase.FORWARD, needs_backward=keep_for_backward) as resident:
                whole = resident.whole()
                if whole is not None:  # one GEMM ([Note: resident runs] in python_api/runtime/tensor.py)
                    y = F.linear(x2, whole.to(dtype), b)
                else:
                    y = x2.new_empty(x2.shape[0], out_features)
                    resident.execute(fwd_chunk)
        ctx.et, ctx.dtype = et, dtype
        ctx.x_shape, ctx.x_dtype = x.shape, x.dtype
        ctx.bias_dtype = None if bias is None else bias.dtype
        return y.view(*x.shape[:-1], out_features)

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        et, dtype = ctx.et, ctx.dtype
        dx = db = None
        with no_autocast(dy.device.type):
            dy2 = dy.reshape(-1, et.shape[0]).to(dtype)
            if ctx.needs_input_grad[0]:
                low = dtype in LOW_PRECISION
                acc = []  # dx of the chunked path, allocated only there

                def dgrad_chunk(c, w):
                    if not acc:
                        # 16-bit: each chunk's product is rounded once to the op dtype; the sum
                        # over chunks is kept in fp32, so many chunks do not add one rounding each.
                        acc.append(torch.zeros(dy2.shape[0], et.shape[1], device=dy2.device,
                                               dtype=torch.float32 if low else dtype))
                    r0, r1 = et.layout.chunk_rows(c)
                    w = dequantized_views(et, [w], dtype, c)[0]
                    if low:
                        acc[0].add_(dy2[:, r0:r1] @ w.to(dtype))
                    else:
                        acc[0].addmm_(dy2[:, r0:r1], w.to(dtype))

                with et.runtime.use(et, Phase.BACKWARD) as resident:
                    whole = resident.whole()
                    if whole is not None:  # one GEMM, rounded once to the op dtype
                        dx = dy2 @ whole.to(dtype)
                    else:
                        resident.execute(dgrad_chunk)
                        dx = acc[0]
                dx = dx.view(ctx.x_shape).to(ctx.x_dtype)
            if ctx.needs_input_grad[1]:
                db = dy2.sum(0).to(ctx.bias_dtype)
        return dx, db, None, None, None


def keeps_for_backward(x: torch.Tensor) -> bool:
    """Will a backward need this layer's weight (dx)? Only with grad enabled *and* an input that
    requires grad: inside an autograd.Function's forward grad mode is always off and
    `ctx.needs_input_grad` ignores it, so the layer decides before `apply` (under no_grad no
    backward comes, and PEAK chunks must not be kept for one)."""
    return torch.is_grad_enabled() and x.requires_grad


class ElasticLinear(nn.Module):
    """A frozen linear layer whose weight is an elastic tensor (same call as `nn.Linear`)."""

    def __init__(self, et: ElasticTensor, bias: nn.Parameter | None, *, fan_in_fan_out: bool = False):
        super().__init__()
        self.et = et
        self.out_features, self.in_features = et.shape
        self.bias = bias
        # True when the weight came from a transformers Conv1D (stored [in, out]); the elastic
        # weight is always [out, in]. Only merge/export look at it.
        self.fan_in_fan_out = fan_in_fan_out

    @classmethod
    def from_linear(cls, linear: nn.Linear, runtime: ElasticRuntime, name: str, unit: str | None = None) -> ElasticLinear:
        et = runtime.register(linear.weight, name, unit)
        return cls(et, linear.bias)

    @torch.compiler.disable  # [Note: torch.compile]
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = op_dtype(x, self.et.dtype, self.et.name)
        if x.shape[-1] != self.in_features:
            raise ValueError(f"{self.et.name}: input has {x.shape[-1]} features, the layer expects {self.in_features}")
        return ElasticLinearFunction.apply(x, self.bias, self.et, dtype, keeps_for_backward(x))

    def _apply(self, fn, recurse=True):
        refuse_conversion(self, fn)
        return super()._apply(fn, recurse)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
            f"chunks={self.et.num_chunks}, world_size={self.et.layout.world_size}"
        )
