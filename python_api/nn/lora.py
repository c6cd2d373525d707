"""The drop-in LoRA layer on an elastic frozen weight: `LoRAConfig`, `ElasticLoRAFunction`,
`ElasticLoRALinear`, and which linears of a model LoRA targets. Converting a model:
convert.py; its adapters in PEFT's format: adapters.py.

[Note: initialisation and replication]
Adapters follow PEFT's default: A ~ kaiming_uniform(a=sqrt(5)) = U(-1/sqrt(in), 1/sqrt(in)),
B = 0, scaling = alpha / r (alpha / sqrt(r) with use_rslora). Each A is drawn from a generator
seeded with (LoRAConfig.seed, crc32 of the module name), so every rank builds identical
adapters without a broadcast, and a module's adapter does not depend on which others exist.

[Note: adapter dtype]
With `LoRAConfig.autocast_adapter_dtype` (PEFT's name, meaning and default) the adapters of a
bf16/fp16 frozen weight are fp32; otherwise they take the frozen weight's dtype. AdamW's
update of a 16-bit parameter is rounded to the parameter's ulp: at lr 1e-5 a bf16 entry of
magnitude 0.1 (ulp 2^-11 ~ 4.9e-4) does not move, so most of A never trains; in fp32 every
entry moves. Gradients follow the parameters, so the runtime's all-reduce (grouped by dtype)
reduces fp32 gradients. The paged ops take fp32 adapters with 16-bit activations (xa, dyb and
the adapter gradients in fp32; y, dx in the activation dtype), which is PEFT's numerics: PEFT
casts x to the adapters' fp32 for the LoRA branch. Under autocast the adapters are passed as
they are when fp32 (the ops' contract), or cast to the op dtype otherwise.

[Note: Conv1D]
transformers' `Conv1D` (GPT-2 and relatives) is a linear whose weight is stored [in, out]
(y = x·W + b). convert_to_elastic registers its transpose ([out, in], a copy) as the elastic
weight, so the layers, ops and runtime see one layout; adapters are A [r, in], B [out, r] as
PEFT makes them for Conv1D, and the saved adapter says fan_in_fan_out=true, as PEFT's does.
merge_adapters rebuilds a `Conv1D` (weight [in, out]) for such a layer, so the merged model's
state dict has the original model's layout.

[Note: per-module rank and alpha]
`LoRAConfig.rank_pattern` / `alpha_pattern` map a pattern to an r / alpha for the modules it
matches, PEFT's rule: pattern p matches module name n when `re.match(rf"(.*\\.)?({p})$", n)`,
the first matching pattern (in the order given) wins, else `r` / `alpha`. They are stored as
tuples of (pattern, value) pairs (the config is frozen and hashable) and written as dicts to
adapter_config.json. load_adapter computes every module's r and scaling from the file's
config by the same rule and refuses a file whose value for any module differs from the
layer's, naming the module: adapters of another rank do not fit, and another scaling would
silently change the model's function.
"""

from __future__ import annotations

import math
import re
import sys
import zlib
from dataclasses import dataclass

import torch
import torch.nn as nn

from elastic_kernels import lora_adapter_grads, paged_lora_linear_dgrad, paged_lora_linear_fwd

from ..config import ElasticPolicy
from ..host.offload import activation_offload_of, save_for_backward, saved_for_backward
from ..runtime import ElasticRuntime, ElasticTensor, Phase, in_backward
from .linear import (
    LOW_PRECISION,
    RUNTIME_ATTR,
    keeps_for_backward,
    no_autocast,
    op_dtype,
    refuse_conversion,
    weight_chunks,
)


@dataclass(frozen=True)
class LoRAConfig:
    """LoRA hyper-parameters (PEFT's meaning for every field of the same name)."""

    r: int
    alpha: float
    dropout: float = 0.0
    target_modules: tuple[str, ...] | str = ("q_proj", "k_proj", "v_proj", "o_proj")
    use_rslora: bool = False
    seed: int = 0
    autocast_adapter_dtype: bool = True  # [Note: adapter dtype]
    rank_pattern: tuple[tuple[str, int], ...] = ()  # [Note: per-module rank and alpha]; a dict is accepted
    alpha_pattern: tuple[tuple[str, float], ...] = ()

    def __post_init__(self):
        if not is_positive_int(self.r):
            raise ValueError(f"LoRAConfig.r must be a positive int, got {self.r!r}")
        if not is_positive_finite(self.alpha):
            raise ValueError(f"LoRAConfig.alpha must be a finite positive number, got {self.alpha!r}")
        if not isinstance(self.autocast_adapter_dtype, bool):
            raise ValueError(f"LoRAConfig.autocast_adapter_dtype must be a bool, got {self.autocast_adapter_dtype!r}")
        for field_name, check, what in (
            ("rank_pattern", is_positive_int, "a positive int"),
            ("alpha_pattern", is_positive_finite, "a finite positive number"),
        ):
            object.__setattr__(self, field_name, normalize_pattern(getattr(self, field_name), f"LoRAConfig.{field_name}", check, what))
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"LoRAConfig.dropout must be in [0, 1), got {self.dropout!r}")
        if isinstance(self.target_modules, (list, tuple)):
            if not self.target_modules or not all(isinstance(t, str) and t for t in self.target_modules):
                raise ValueError(f"LoRAConfig.target_modules must be non-empty names, got {self.target_modules!r}")
            object.__setattr__(self, "target_modules", tuple(self.target_modules))
        elif isinstance(self.target_modules, str):
            if self.target_modules != "all-linear":
                try:
                    re.compile(self.target_modules)
                except re.error as exc:
                    raise ValueError(f"LoRAConfig.target_modules is not a valid regex: {exc}") from exc
        else:
            raise ValueError(f"LoRAConfig.target_modules must be names, a regex or 'all-linear', got {self.target_modules!r}")

    @property
    def scaling(self) -> float:
        return self.alpha / (math.sqrt(self.r) if self.use_rslora else self.r)

    def r_of(self, name: str) -> int:
        """The rank of module `name` ([Note: per-module rank and alpha])."""
        return _pattern_value(self.rank_pattern, name, self.r)

    def alpha_of(self, name: str) -> float:
        return _pattern_value(self.alpha_pattern, name, self.alpha)

    def scaling_of(self, name: str) -> float:
        r = self.r_of(name)
        return self.alpha_of(name) / (math.sqrt(r) if self.use_rslora else r)


def is_positive_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v > 0


def is_positive_finite(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v > 0


def normalize_pattern(pattern, what: str, check, kind: str) -> tuple:
    """A dict or pairs -> a tuple of (regex, value) pairs, each checked."""
    if pattern is None:
        return ()
    if isinstance(pattern, dict):
        items = list(pattern.items())
    elif isinstance(pattern, (list, tuple)) and all(isinstance(p, (list, tuple)) and len(p) == 2 for p in pattern):
        items = [tuple(p) for p in pattern]
    else:
        raise ValueError(f"{what} must be a dict {{pattern: value}}, got {pattern!r}")
    for key, value in items:
        if not isinstance(key, str) or not key:
            raise ValueError(f"{what} keys must be non-empty strings, got {key!r}")
        try:
            re.compile(key)
        except re.error as exc:
            raise ValueError(f"{what} key {key!r} is not a valid regex: {exc}") from exc
        if not check(value):
            raise ValueError(f"{what}[{key!r}] must be {kind}, got {value!r}")
    return tuple(items)


def _pattern_value(pairs, name: str, default):
    """PEFT's get_pattern_key: the first pattern p with re.match(rf"(.*\\.)?({p})$", name)."""
    for key, value in pairs:
        if re.match(rf"(.*\.)?({key})$", name):
            return value
    return default


def conv1d_class():
    """transformers' Conv1D, if transformers is loaded (a model cannot hold one otherwise);
    looked up lazily so importing this module does not import transformers."""
    mod = sys.modules.get("transformers.pytorch_utils")
    return getattr(mod, "Conv1D", None)


def is_conv1d(module: nn.Module) -> bool:
    cls = conv1d_class()
    return cls is not None and isinstance(module, cls)


def is_linear(module: nn.Module) -> bool:
    """nn.Linear or transformers' Conv1D ([Note: Conv1D])."""
    return isinstance(module, nn.Linear) or is_conv1d(module)


def frozen_weight(module: nn.Module) -> torch.Tensor:
    """The [out, in] weight to register: Conv1D stores [in, out] ([Note: Conv1D])."""
    return module.weight.detach().t().contiguous() if is_conv1d(module) else module.weight


def _matches(cfg: LoRAConfig, name: str) -> bool:
    """PEFT's rule: a regex must match the whole name; a list matches a name or a suffix."""
    if isinstance(cfg.target_modules, str):
        return re.fullmatch(cfg.target_modules, name) is not None
    return any(name == t or name.endswith("." + t) for t in cfg.target_modules)


def target_names(model: nn.Module, cfg: LoRAConfig) -> list[str]:
    linears = [n for n, m in model.named_modules() if n and is_linear(m)]
    if cfg.target_modules == "all-linear":
        out_emb = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
        names = [n for n in linears if model.get_submodule(n) is not out_emb and n.rpartition(".")[2] != "lm_head"]
    else:
        names = [n for n in linears if _matches(cfg, n)]
    if not names:
        candidates = sorted({n.rpartition(".")[2] for n in linears})
        raise ValueError(
            f"LoRAConfig.target_modules={cfg.target_modules!r} matches no nn.Linear (or transformers Conv1D) "
            f"of the model; "
            f"candidate names: {candidates}"
        )
    return names


def _adapter_operand(a: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """An adapter as the paged ops take it with activations of `dtype`: as it is when it has
    that dtype or is fp32 with 16-bit activations (the ops' contract), else cast."""
    if a.dtype == dtype or (a.dtype == torch.float32 and dtype in LOW_PRECISION):
        return a
    return a.to(dtype)


class ElasticLoRAFunction(torch.autograd.Function):
    """y = x·Wᵀ + b + s·(dropout(x)·Aᵀ)·Bᵀ with W read from pool pages, computed in `dtype`
    ([Note: mixed precision] in linear.py); saves the LoRA input (x itself or a fresh
    tensor, never a view of x: [Note: torch.compile]) and the dropout mask, never W; backward
    re-gathers W through the runtime for dx only."""

    @staticmethod
    def forward(ctx, x, bias, lora_a, lora_b, et: ElasticTensor, scale: float, dropout: float, training: bool,
                dtype: torch.dtype, keep_for_backward: bool):
        rt = et.runtime
        offload = activation_offload_of(rt)  # None unless policy.offload_activations
        with no_autocast(x.device.type):
            # Not x.to(dtype) when x already has it: under tracing that is a new tensor aliasing
            # x, and a saved alias of an input is what AOTAutograd refuses ([Note: torch.compile]).
            xc = x if x.dtype == dtype else x.to(dtype)
            mask = None
            lora_x = xc
            if dropout > 0.0 and training:
                mask = torch.empty_like(xc).bernoulli_(1.0 - dropout).div_(1.0 - dropout)
                lora_x = xc * mask
            a, b = _adapter_operand(lora_a, dtype), _adapter_operand(lora_b, dtype)
            x2, lx2 = xc.reshape(-1, x.shape[-1]), lora_x.reshape(-1, x.shape[-1])
            bias_c = None if bias is None else bias.to(dtype)
            with rt.use(et, Phase.FORWARD, needs_backward=keep_for_backward) as resident:
                y, xa = paged_lora_linear_fwd(x2, weight_chunks(et, resident.table(), dtype), bias_c, lx2, a, b, scale)
        if torch.compiler.is_compiling():
            # Only when a compiler traces this function (the layers' forward is compiler-
            # disabled, so not today): the reference op's xa is a no-op .to() of a traced
            # intermediate, which dynamo counts as an alias and refuses to save
            # ([Note: torch.compile]); a copy of [T, r] costs nothing.
            xa = xa.clone()
        # The activations may go to host memory until backward ([Note: activation offload] in
        # python_api/host/offload.py); the adapters are always saved as they are.
        save_for_backward(ctx, offload, (lora_x, xa, lora_a, lora_b, mask), activations=(0, 1, 4),
                          recompute=in_backward())
        ctx.et, ctx.scale, ctx.dtype = et, scale, dtype
        ctx.x_shape, ctx.x_dtype = x.shape, x.dtype
        ctx.bias_dtype = None if bias is None else bias.dtype
        return y.view(*x.shape[:-1], y.shape[-1])

    @staticmethod
    def backward(ctx, dy):
        lora_x, xa, lora_a, lora_b, mask = saved_for_backward(ctx)
        et, s, dtype = ctx.et, ctx.scale, ctx.dtype
        dx = db = None
        with no_autocast(dy.device.type):
            a, b = _adapter_operand(lora_a, dtype), _adapter_operand(lora_b, dtype)
            dy2 = dy.reshape(-1, dy.shape[-1]).to(dtype).contiguous()
            lx2 = lora_x.reshape(-1, lora_x.shape[-1])
            if ctx.needs_input_grad[0]:
                with et.runtime.use(et, Phase.BACKWARD) as resident:
                    chunks = weight_chunks(et, resident.table(), dtype)
                    if mask is None:
                        dx, dyb = paged_lora_linear_dgrad(dy2, chunks, a, b, s)
                    else:
                        # The LoRA path saw x·mask: its share of dx is masked too. dyb and the
                        # LoRA share are in the adapter dtype, the sum rounds once to `dtype`.
                        dx, _ = paged_lora_linear_dgrad(dy2, chunks, None, None, s)
                        dyb = dy2.to(b.dtype) @ b
                        lora_dx = (dyb @ a).mul_(s).mul_(mask.reshape(-1, mask.shape[-1]))
                        dx = (dx.to(lora_dx.dtype) + lora_dx).to(dtype)
                dx = dx.view(ctx.x_shape).to(ctx.x_dtype)
            else:
                dyb = dy2.to(b.dtype) @ b
            da, dB = lora_adapter_grads(lx2, xa, dy2, dyb, s)
            if ctx.needs_input_grad[1]:
                db = dy2.sum(0).to(ctx.bias_dtype)
        return (
            dx, db,
            da.to(lora_a.dtype) if ctx.needs_input_grad[2] else None,
            dB.to(lora_b.dtype) if ctx.needs_input_grad[3] else None,
            None, None, None, None, None, None,
        )


class ElasticLoRALinear(nn.Module):
    """Drop-in for `nn.Linear` (same call, `in_features`, `out_features`, `bias`) with a frozen
    elastic weight and trainable LoRA adapters `lora_A` [r, in], `lora_B` [out, r]."""

    def __init__(self, et: ElasticTensor, bias: nn.Parameter | None, lora: LoRAConfig, name: str,
                 *, fan_in_fan_out: bool = False):
        super().__init__()
        self.et = et
        self.out_features, self.in_features = et.shape
        self.bias = bias
        if bias is not None:
            bias.requires_grad_(False)
        self.lora = lora
        self.r = lora.r_of(name)
        self.scaling = lora.scaling_of(name)
        self.fan_in_fan_out = fan_in_fan_out  # [Note: Conv1D]
        device = et.device
        dtype = torch.float32 if lora.autocast_adapter_dtype and et.dtype in LOW_PRECISION else et.dtype
        self.lora_A = nn.Linear(self.in_features, self.r, bias=False, device=device, dtype=dtype)
        self.lora_B = nn.Linear(self.r, self.out_features, bias=False, device=device, dtype=dtype)
        gen = torch.Generator().manual_seed((lora.seed << 32) ^ zlib.crc32(name.encode()))
        bound = 1.0 / math.sqrt(self.in_features)
        with torch.no_grad():
            a = torch.rand(self.lora_A.weight.shape, generator=gen, dtype=torch.float64) * (2 * bound) - bound
            self.lora_A.weight.copy_(a)
            self.lora_B.weight.zero_()

    @classmethod
    def from_linear(
        cls, linear: nn.Linear, lora: LoRAConfig, policy: ElasticPolicy, group=None, name: str = "linear"
    ) -> ElasticLoRALinear:
        """A single layer under its own runtime (for one-layer use; models use convert_to_elastic)."""
        linear.requires_grad_(False)
        rt = ElasticRuntime(policy, group=group, device=linear.weight.device)
        layer = cls(rt.register(frozen_weight(linear), name), linear.bias, lora, name, fan_in_fan_out=is_conv1d(linear))
        rt.finish_registration()
        rt.set_trainable([layer.lora_A.weight, layer.lora_B.weight])
        object.__setattr__(layer, RUNTIME_ATTR, rt)
        return layer

    @torch.compiler.disable  # [Note: torch.compile] in linear.py
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = op_dtype(x, self.et.dtype, self.et.name)
        if x.shape[-1] != self.in_features:
            raise ValueError(f"{self.et.name}: input has {x.shape[-1]} features, the layer expects {self.in_features}")
        return ElasticLoRAFunction.apply(
            x, self.bias, self.lora_A.weight, self.lora_B.weight, self.et,
            self.scaling, self.lora.dropout, self.training, dtype, keeps_for_backward(x),
        )

    def _apply(self, fn, recurse=True):
        refuse_conversion(self, fn)  # [Note: mixed precision] in linear.py
        return super()._apply(fn, recurse)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
            f"r={self.r}, scaling={self.scaling:g}, chunks={self.et.num_chunks}"
        )
