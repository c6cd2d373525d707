"""Frozen `nn.Linear` layers under the elastic runtime, and the model wrapper.

`ElasticLinear` is a frozen linear whose weight lives as chunk-major shards plus pool pages;
its autograd function computes chunk by chunk as chunks arrive (`execute`), saves no weight,
and re-gathers in backward whatever was discarded. Trainable parameters (adapters, anything
with requires_grad) stay replicated; their gradients are averaged across the group at the end
of backward.

[Note: chunked compute and bit-exactness]
Forward computes y[:, rows_c] = x·W_cᵀ (+ b[rows_c]) per chunk; backward accumulates
dx += dy[:, rows_c]·W_c over chunks in index order. A CPU GEMM over a column block is not
bit-identical to the same columns of a full GEMM (blocking changes the reduction), so the
elastic layer matches plain `F.linear` to fp32 rounding, and matches bit for bit any
computation with the same chunking (that is what the parity tests compare against: the
distributed machinery must not change a single bit).
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from python_api.config import ElasticPolicy
from python_api.runtime import ElasticRuntime, ElasticTensor, Phase

_RUNTIME_ATTR = "_elastic_runtime"


class ElasticLinearFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, bias: torch.Tensor | None, et: ElasticTensor):
        rt = et.runtime
        out_features = et.shape[0]
        x2 = x.reshape(-1, x.shape[-1])
        y = x2.new_empty(x2.shape[0], out_features)

        def fwd_chunk(c, w):
            r0, r1 = et.layout.chunk_rows(c)
            y[:, r0:r1] = F.linear(x2, w, None if bias is None else bias[r0:r1])

        with rt.use(et, Phase.FORWARD, needs_backward=ctx.needs_input_grad[0]) as resident:
            resident.execute(fwd_chunk)
        ctx.et = et
        ctx.x_shape = x.shape
        return y.view(*x.shape[:-1], out_features)

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        et = ctx.et
        dy2 = dy.reshape(-1, et.shape[0])
        dx = db = None
        if ctx.needs_input_grad[0]:
            dx = dy2.new_zeros(dy2.shape[0], et.shape[1])

            def dgrad_chunk(c, w):
                r0, r1 = et.layout.chunk_rows(c)
                dx.addmm_(dy2[:, r0:r1], w)

            with et.runtime.use(et, Phase.BACKWARD) as resident:
                resident.execute(dgrad_chunk)
            dx = dx.view(ctx.x_shape)
        if ctx.needs_input_grad[1]:
            db = dy2.sum(0)
        return dx, db, None


class ElasticLinear(nn.Module):
    """A frozen linear layer whose weight is an elastic tensor (same call as `nn.Linear`)."""

    def __init__(self, et: ElasticTensor, bias: nn.Parameter | None):
        super().__init__()
        self.et = et
        self.out_features, self.in_features = et.shape
        self.bias = bias

    @classmethod
    def from_linear(cls, linear: nn.Linear, runtime: ElasticRuntime, name: str) -> ElasticLinear:
        et = runtime.register(linear.weight, name)
        return cls(et, linear.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype != self.et.dtype:
            raise TypeError(f"{self.et.name}: input dtype {x.dtype} differs from the layer's weight dtype {self.et.dtype}")
        if x.shape[-1] != self.in_features:
            raise ValueError(f"{self.et.name}: input has {x.shape[-1]} features, the layer expects {self.in_features}")
        return ElasticLinearFunction.apply(x, self.bias, self.et)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
            f"chunks={self.et.num_chunks}, world_size={self.et.layout.world_size}"
        )


def _default_filter(name: str, module: nn.Module) -> bool:
    return isinstance(module, nn.Linear) and not module.weight.requires_grad


def elasticize(model: nn.Module, policy: ElasticPolicy, group=None, should_wrap=None, device=None) -> nn.Module:
    """Put the frozen `nn.Linear` layers of `model` under one elastic runtime, in place.

    `should_wrap(name, module)` picks the layers (default: every `nn.Linear` whose weight does
    not require grad). Call it on every rank of `group` with the same model and policy.
    Returns the model; `stats(model)`, `reset_stats(model)`, `set_pool_budget(model, b)` reach
    its runtime.
    """
    if getattr(model, _RUNTIME_ATTR, None) is not None:
        raise RuntimeError("elasticize: this model is already under an elastic runtime")
    should_wrap = should_wrap or _default_filter
    targets = [(n, m) for n, m in model.named_modules() if n and should_wrap(n, m)]
    if device is None:
        first = next((m.weight.device for _, m in targets), None)
        device = first if first is not None else torch.device("cpu")
    for name, module in targets:
        if not isinstance(module, nn.Linear):
            raise TypeError(f"elasticize: {name} is a {type(module).__name__}, only nn.Linear can be wrapped here")
    # Build everything (and agree across ranks) before touching the model, so a failure
    # leaves it as it was.
    runtime = ElasticRuntime(policy, group=group, device=device)
    replacements = [(name, ElasticLinear.from_linear(module, runtime, name)) for name, module in targets]
    runtime.check_ranks_agree()
    for name, new in replacements:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, new)
    runtime.set_trainable([p for p in model.parameters() if p.requires_grad])
    object.__setattr__(model, _RUNTIME_ATTR, runtime)
    return model


def runtime_of(model: nn.Module) -> ElasticRuntime:
    rt = getattr(model, _RUNTIME_ATTR, None)
    if rt is None:
        raise ValueError("this model is not under an elastic runtime (call elasticize / convert_to_elastic first)")
    return rt


def stats(model: nn.Module) -> dict:
    """Cumulative per-rank stats: allgather_bytes, allgather_calls, pool_hits, pool_misses, pool_peak_bytes."""
    return runtime_of(model).stats()


def reset_stats(model: nn.Module) -> None:
    runtime_of(model).reset_stats()


def set_pool_budget(model: nn.Module, budget_bytes: int | None) -> None:
    runtime_of(model).set_pool_budget(budget_bytes)


def no_sync(model: nn.Module):
    """Context manager: backward passes inside it do not average adapter gradients across
    ranks (gradient accumulation; see [Note: gradient accumulation] in runtime.py)."""
    return runtime_of(model).no_sync()
