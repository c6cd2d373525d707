"""The drop-in LoRA layer on an elastic frozen weight: `LoRAConfig`, `ElasticLoRAFunction`,
`ElasticLoRALinear`, and which linears of a model LoRA targets. Converting a model:
convert.py; its adapters in PEFT's format: adapters.py.

[Note: initialisation and replication]
Adapters follow PEFT's default: A ~ kaiming_uniform(a=sqrt(5)) = U(-1/sqrt(in), 1/sqrt(in)),
B = 0, scaling = alpha / r (alpha / sqrt(r) with use_rslora). Each A is drawn from a generator
seeded with (LoRAConfig.seed, crc32 of the module name), so every rank builds identical
adapters without a broadcast, and a module's adapter does not depend on which others exist.
The generator's seed is the crc32 of the name started from the seed folded to 32 bits
(`_init_seed`): torch's CPU generator (mt19937) keeps only the low 32 bits of its seed, so the
former (seed << 32) ^ crc32(name) gave every seed the adapters of seed 0 (found by the CLI's
`--sweep seed=0,5`, whose adapters trained alike). Seed 0 keeps its former values; distinct
seeds below 2**32 give distinct generator seeds per module (a CRC's start value maps one to one).

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

import elastic_kernels
from elastic_kernels import lora_adapter_grads, paged_lora_linear_dgrad, paged_lora_linear_fwd

from ..config import ElasticPolicy
from ..host.offload import activation_offload_of, save_for_backward, saved_for_backward
from ..runtime import ElasticRuntime, ElasticTensor, Phase, in_backward
from .linear import (
    LOW_PRECISION,
    RUNTIME_ATTR,
    dequantized_views,
    keeps_for_backward,
    no_autocast,
    op_dtype,
    refuse_conversion,
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
                y, xa = paged_lora_linear_fwd(x2, dequantized_views(et, resident.table(), dtype), bias_c, lx2, a, b, scale)
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
                    chunks = dequantized_views(et, resident.table(), dtype)
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


def _init_seed(seed: int, name: str) -> int:
    """The 32-bit generator seed of module `name`'s A under LoRAConfig.seed `seed`
    ([Note: initialisation and replication])."""
    return zlib.crc32(name.encode(), (seed ^ (seed >> 32)) & 0xFFFFFFFF)


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
        gen = torch.Generator().manual_seed(_init_seed(lora.seed, name))
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


# [Note: many adapters on one base]
# convert_to_elastic(model, {"name": LoRAConfig, ...}, policy) puts K named adapters on one
# converted model (a single LoRAConfig is the one adapter "default", PEFT's name, and keeps
# ElasticLoRALinear and its fused path untouched, bit for bit).
# - Shared: every frozen weight, its shards, pool pages, host-tier copy and quantized blobs,
#   and each use of it. A layer carrying several adapters makes its weight resident once per
#   use (one `rt.use` in forward, one in backward for dx), runs the base product once over
#   all rows of the batch, and adds the LoRA terms per adapter over that adapter's rows. So
#   the frozen-weight bytes gathered per step are those of the one-adapter job at the same
#   budget (tests/nn/test_multi_adapter.py asserts equality).
# - Per adapter: its targets, r, alpha, dropout, rank/alpha patterns and seed (a layer
#   targeted by only some adapters carries only those: rows of the others get the base
#   only), its A and B (`lora_A.<name>`, `lora_B.<name>`, PEFT's in-memory names), its
#   dropout mask (its own rate), its optimizer (`adapter_parameters(model, name)`) and its
#   PEFT folder (`save_adapter(..., adapter=name)`). An adapter initialises as it would
#   alone ([Note: initialisation and replication]: the seed and the module name only).
#   A linear that one adapter's solo job would leave plain (below replicate_below_bytes) is
#   elastic here when another adapter targets it, and so stored in the policy's
#   weight_format: with nf4 that is another base for the first adapter's rows than its
#   solo job's (replicate_below_bytes=0 makes both alike).
# - Rows: `model(..., adapter_names=[...])` names the adapter of each row of the batch; the
#   root module's pre-hook checks the list (on every rank alike: an agreed error) and sets it
#   on the model's AdapterSelection for the call (restored on exit, error or not; kept for a
#   recompute inside the following backward: gradient checkpointing). A layer's input
#   [B, ..., in] maps its leading dimension to the batch rows. Its token rows are stably
#   sorted by adapter (the layer's adapter order); `segmented_lora_fwd` / `_bwd` compute
#   the LoRA terms over the row segments, one adapter per segment: the pair a fused
#   segmented kernel replaces on CUDA.
# - Gradients: an adapter's A and B enter the layer's autograd node only when the adapter
#   has rows in the batch, so the gradients of an adapter reach only its parameters, and an
#   adapter absent from a micro-batch adds nothing to its .grad. On several ranks the
#   runtime's bucketed all-reduce has the rule of [Note: gradients absent on some ranks] in
#   python_api/runtime/_grads.py: a parameter without a gradient on a rank contributes
#   zeros when any rank has one, and stays None (its optimizer skips it) when no rank has.
# - Numerics: fp32 adapters and the products in the accumulation dtype as the fused ops do
#   ([Note: adapter dtype]); the base product and the LoRA term are rounded to the op dtype
#   separately and then added (K=1's fused op adds before rounding), so with 16-bit
#   activations a row's output may differ from the solo run's by one rounding of the op
#   dtype; in fp32, by fp32 rounding.

DEFAULT_ADAPTER = "default"


def normalize_adapters(lora) -> dict[str, LoRAConfig]:
    """`{name: LoRAConfig}` from what convert_to_elastic takes: one LoRAConfig (the adapter
    "default"), a dict, or (name, LoRAConfig) pairs. Names: unique non-empty identifiers."""
    if isinstance(lora, LoRAConfig):
        return {DEFAULT_ADAPTER: lora}
    if isinstance(lora, dict):
        items = list(lora.items())
    elif isinstance(lora, (list, tuple)) and all(isinstance(p, (list, tuple)) and len(p) == 2 for p in lora):
        items = [tuple(p) for p in lora]
    else:
        raise TypeError(f"lora must be a LoRAConfig or a dict {{adapter name: LoRAConfig}}, got {type(lora).__name__}")
    if not items:
        raise ValueError("lora: no adapters given (an empty dict); give at least one {name: LoRAConfig}")
    out: dict[str, LoRAConfig] = {}
    for name, cfg in items:
        if not isinstance(name, str) or not name.isidentifier():
            raise ValueError(f"lora: adapter name {name!r} is not valid; a name must be a non-empty identifier "
                             f"(letters, digits, underscores, not starting with a digit)")
        if name in out:
            raise ValueError(f"lora: adapter name {name!r} is given twice; adapter names must be unique")
        if not isinstance(cfg, LoRAConfig):
            raise TypeError(f"lora[{name!r}] must be a LoRAConfig, got {type(cfg).__name__}")
        out[name] = cfg
    return out


# Which implementation segmented_lora_fwd / _bwd use: "auto" (the segmented Triton kernels of
# elastic_kernels/ops/segmented_lora.py for CUDA tensors, one launch over every adapter; the
# per-adapter loop below otherwise), "triton" (the kernels for any tensors: the tests run them
# under the Triton interpreter on CPU) or "loop".
SEGMENTED_IMPL = "auto"


def _segmented_kernel(t: torch.Tensor) -> bool:
    if SEGMENTED_IMPL not in ("auto", "triton", "loop"):
        raise ValueError(f"SEGMENTED_IMPL must be 'auto', 'triton' or 'loop', got {SEGMENTED_IMPL!r}")
    if SEGMENTED_IMPL == "auto":
        return t.device.type == "cuda" and t.dtype in (torch.float32, torch.bfloat16, torch.float16)
    return SEGMENTED_IMPL == "triton"


def segmented_lora_fwd(lora_x: torch.Tensor, offsets: list[int], lora_as: list[torch.Tensor],
                       lora_bs: list[torch.Tensor], scales: list[float]) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The LoRA terms of rows grouped by adapter ([Note: many adapters on one base]).

    lora_x   [N, in]  the rows (dropout applied), sorted so that rows offsets[k]:offsets[k+1]
                      belong to adapter k; in the activation dtype
    offsets  K+1 ints, non-decreasing, offsets[0] = 0, offsets[K] = N
    lora_as  K tensors [r_k, in], lora_bs K tensors [out, r_k], in the adapter dtype (the
             activation dtype, or fp32 with 16-bit activations)
    scales   K floats
    Returns (delta [N, out] in the accumulation dtype, fp32 for 16-bit activations; xa: K
    tensors [n_k, r_k] in the adapter dtype), with delta_k = s_k·(x_k·A_kᵀ)·B_kᵀ and xa_k
    rounded to the adapter dtype as the fused op rounds it (paged_lora_linear_fwd).
    """
    if not lora_as:
        raise ValueError("segmented_lora_fwd: no adapters (K = 0)")
    acc = _acc_dtype(lora_x.dtype)
    if _segmented_kernel(lora_x):
        delta, xa = elastic_kernels.segmented_lora_fwd(lora_x, offsets, lora_as, lora_bs, scales, impl="triton")
        return delta.to(acc), [xa[r0:r1, :a.shape[0]] for r0, r1, a in zip(offsets, offsets[1:], lora_as)]
    delta = lora_x.new_empty((lora_x.shape[0], lora_bs[0].shape[0]), dtype=acc)
    xas = []
    for k, (a, b, s) in enumerate(zip(lora_as, lora_bs, scales)):
        r0, r1 = offsets[k], offsets[k + 1]
        xa = (lora_x[r0:r1].to(acc) @ a.to(acc).t()).to(a.dtype)
        torch.mm(xa.to(acc), b.to(acc).t(), out=delta[r0:r1])
        delta[r0:r1].mul_(float(s))
        xas.append(xa)
    return delta, xas


def segmented_lora_bwd(dy: torch.Tensor, lora_x: torch.Tensor, xas: list[torch.Tensor], offsets: list[int],
                       lora_as: list[torch.Tensor], lora_bs: list[torch.Tensor], scales: list[float],
                       mask: torch.Tensor | None, need_dx: bool
                       ) -> tuple[torch.Tensor | None, list[torch.Tensor], list[torch.Tensor]]:
    """Backward of `segmented_lora_fwd`: dy [N, out] (rows as lora_x, activation dtype), the
    forward's lora_x and xa, `mask` [N, in] (the dropout scaling applied to x, None: none).
    Returns (dx share of the LoRA path [N, in] in the accumulation dtype, masked, or None
    without need_dx; dA_k [r_k, in]; dB_k [out, r_k]) with dA_k = s_k·(dy_k·B_k)ᵀ·x_k and
    dB_k = s_k·dy_kᵀ·xa_k in the adapter dtype, as lora_adapter_grads computes them."""
    acc = _acc_dtype(dy.dtype)
    if _segmented_kernel(dy):
        # The kernels take xa as one [N, max r_k] tensor, columns past an adapter's rank zero.
        xa = lora_x.new_zeros((lora_x.shape[0], max(a.shape[0] for a in lora_as)), dtype=xas[0].dtype)
        for r0, r1, t in zip(offsets, offsets[1:], xas):
            xa[r0:r1, :t.shape[1]] = t
        dx, das, dbs = elastic_kernels.segmented_lora_bwd(dy, lora_x, xa, offsets, lora_as, lora_bs, scales,
                                                          impl="triton")
        dx = None if not need_dx else dx.to(acc)
        if dx is not None and mask is not None:
            dx.mul_(mask.to(acc))
        return dx, list(das), list(dbs)
    dx = None if not need_dx else dy.new_empty((dy.shape[0], lora_x.shape[1]), dtype=acc)
    das, dbs = [], []
    for k, (a, b, s) in enumerate(zip(lora_as, lora_bs, scales)):
        r0, r1 = offsets[k], offsets[k + 1]
        dy_k = dy[r0:r1]
        dyb = (dy_k.to(acc) @ b.to(acc)).to(b.dtype)  # rounded to the adapter dtype, as the fused dgrad
        if dx is not None:
            torch.mm(dyb.to(acc), a.to(acc), out=dx[r0:r1])
            dx[r0:r1].mul_(float(s))
        da, db = lora_adapter_grads(lora_x[r0:r1], xas[k], dy_k, dyb, s)
        das.append(da)
        dbs.append(db)
    if dx is not None and mask is not None:
        dx.mul_(mask.to(acc))
    return dx, das, dbs


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float32 if dtype in LOW_PRECISION else dtype


class AdapterSelection:
    """Which adapter each row of the current batch uses ([Note: many adapters on one base]):
    shared by the root module's pre-hook (which sets it for a call) and every layer of a
    model with named adapters (which read it)."""

    def __init__(self, names: tuple[str, ...]):
        self.names = names
        self.index = {n: i for i, n in enumerate(names)}
        self.current: tuple[int, ...] | None = None  # adapter index per batch row, during a call
        self.last: tuple[int, ...] | None = None  # the last call's, for a recompute in backward
        self.stack: list = []  # the selections of the enclosing calls (the pre-hook pushes, the hook pops)
        self._plans: dict = {}

    def check(self, adapter_names, batch: int | None) -> str | None:
        """The error text for a bad `adapter_names`, or None."""
        if not isinstance(adapter_names, (list, tuple)) or not all(isinstance(n, str) for n in adapter_names):
            return (f"adapter_names must be a list of adapter names (str), one per row of the batch, got "
                    f"{type(adapter_names).__name__}" + ("" if not isinstance(adapter_names, (list, tuple))
                                                         else f" holding {sorted({type(n).__name__ for n in adapter_names})}"))
        unknown = sorted({n for n in adapter_names if n not in self.index})
        if unknown:
            return f"adapter_names: {unknown} {'is not an adapter' if len(unknown) == 1 else 'are not adapters'} of this model; its adapters are {list(self.names)}"
        if batch is not None and len(adapter_names) != batch:
            return (f"adapter_names has {len(adapter_names)} names but the batch has {batch} rows; "
                    f"give one adapter name per row")
        return None

    def rows(self, in_backward: bool) -> tuple[int, ...] | None:
        if self.current is not None:
            return self.current
        return self.last if in_backward else None

    def plan(self, rows: tuple[int, ...], layer_names: tuple[str, ...], tokens_per_row: int, device):
        """(perm, offsets, present): the token rows of this layer's adapters sorted stably by
        adapter (the layer's order), the segment offsets, and the layer's adapters present."""
        key = (rows, layer_names, tokens_per_row, str(device))
        got = self._plans.get(key)
        if got is None:
            if len(self._plans) > 64:
                self._plans.clear()
            order = {self.index[n]: k for k, n in enumerate(layer_names)}
            per_row = [order.get(i, -1) for i in rows]
            present = sorted({k for k in per_row if k >= 0})
            perm, offsets = [], [0]
            for k in present:
                for b, kk in enumerate(per_row):
                    if kk == k:
                        perm.extend(range(b * tokens_per_row, (b + 1) * tokens_per_row))
                offsets.append(len(perm))
            # Rows already in adapter order (a sweep: row k is adapter k's) need no permutation:
            # None lets the layer read and write them in place.
            identity = perm == list(range(len(rows) * tokens_per_row))
            got = (None if identity else torch.tensor(perm, dtype=torch.long, device=device), offsets, tuple(present))
            self._plans[key] = got
        return got


class ElasticMultiLoRAFunction(torch.autograd.Function):
    """y = x·Wᵀ + b, plus s_k·(dropout_k(x)·A_kᵀ)·B_kᵀ on the rows of each adapter k present
    ([Note: many adapters on one base]); W made resident once per use; `ab` = A_1, B_1, A_2,
    B_2, ... of the adapters present, in segment order."""

    @staticmethod
    def forward(ctx, x, bias, et: ElasticTensor, dtype: torch.dtype, keep_for_backward: bool,
                perm: torch.Tensor, offsets: list[int], scales: list[float], dropouts: list[float],
                training: bool, *ab):
        rt = et.runtime
        offload = activation_offload_of(rt)
        with no_autocast(x.device.type):
            xc = x if x.dtype == dtype else x.to(dtype)
            x2 = xc.reshape(-1, x.shape[-1])
            bias_c = None if bias is None else bias.to(dtype)
            with rt.use(et, Phase.FORWARD, needs_backward=keep_for_backward) as resident:
                y, _ = paged_lora_linear_fwd(x2, dequantized_views(et, resident.table(), dtype), bias_c)
            # The rows by adapter: a fresh tensor ([Note: torch.compile]), or, when they already
            # are in adapter order (perm None), x's own rows, saved as xc (x itself or a cast).
            lora_x = x2 if perm is None else x2.index_select(0, perm)
            mask, xas = None, []
            if ab and training and any(p > 0.0 for p in dropouts):
                mask = torch.ones_like(lora_x)
                for k, p in enumerate(dropouts):
                    if p > 0.0:
                        mask[offsets[k]:offsets[k + 1]].bernoulli_(1.0 - p).div_(1.0 - p)
                lora_x = lora_x * mask
            lora_as = [_adapter_operand(t, dtype) for t in ab[0::2]]
            lora_bs = [_adapter_operand(t, dtype) for t in ab[1::2]]
            if ab:  # else no row of the batch uses an adapter of this layer: the base only
                delta, xas = segmented_lora_fwd(lora_x, offsets, lora_as, lora_bs, scales)
                if perm is None:
                    y.add_(delta.to(y.dtype))
                else:
                    y.index_add_(0, perm, delta.to(y.dtype))
        saved_x = xc if perm is None and mask is None else lora_x
        xa_flat = torch.cat([xa.reshape(-1) for xa in xas]) if xas else lora_x.new_empty(0)
        save_for_backward(ctx, offload, (saved_x, xa_flat, mask, perm, *ab), activations=(0, 1, 2),
                          recompute=in_backward())
        ctx.et, ctx.dtype, ctx.offsets, ctx.scales = et, dtype, offsets, scales
        ctx.x_shape, ctx.x_dtype = x.shape, x.dtype
        ctx.bias_dtype = None if bias is None else bias.dtype
        return y.view(*x.shape[:-1], y.shape[-1])

    @staticmethod
    def backward(ctx, dy):
        lora_x, xa_flat, mask, perm, *ab = saved_for_backward(ctx)
        lora_x = lora_x.reshape(-1, lora_x.shape[-1])
        et, dtype, offsets, scales = ctx.et, ctx.dtype, ctx.offsets, ctx.scales
        dx = db = None
        with no_autocast(dy.device.type):
            lora_as = [_adapter_operand(t, dtype) for t in ab[0::2]]
            lora_bs = [_adapter_operand(t, dtype) for t in ab[1::2]]
            xas, at = [], 0
            for k, a in enumerate(lora_as):
                n = (offsets[k + 1] - offsets[k]) * a.shape[0]
                xas.append(xa_flat[at:at + n].view(offsets[k + 1] - offsets[k], a.shape[0]))
                at += n
            dy2 = dy.reshape(-1, dy.shape[-1]).to(dtype).contiguous()
            need_dx = ctx.needs_input_grad[0]
            if need_dx:
                with et.runtime.use(et, Phase.BACKWARD) as resident:
                    dx, _ = paged_lora_linear_dgrad(dy2, dequantized_views(et, resident.table(), dtype))
            das = dbs = []
            if ab:
                dys = dy2 if perm is None else dy2.index_select(0, perm)
                lora_dx, das, dbs = segmented_lora_bwd(dys, lora_x, xas, offsets, lora_as, lora_bs, scales, mask, need_dx)
            if need_dx and ab:
                wide = dx if dx.dtype == lora_dx.dtype else dx.to(lora_dx.dtype)  # 16-bit: the sum rounds once
                if perm is None:
                    wide.add_(lora_dx)
                else:
                    wide.index_add_(0, perm, lora_dx)
                dx = wide.to(dtype)
            if need_dx:
                dx = dx.view(ctx.x_shape).to(ctx.x_dtype)
            if ctx.needs_input_grad[1]:
                db = dy2.sum(0).to(ctx.bias_dtype)
        grads = []
        for k in range(len(lora_as)):
            a, b = ab[2 * k], ab[2 * k + 1]
            grads.append(das[k].to(a.dtype) if ctx.needs_input_grad[10 + 2 * k] else None)
            grads.append(dbs[k].to(b.dtype) if ctx.needs_input_grad[11 + 2 * k] else None)
        return (dx, db, None, None, None, None, None, None, None, None, *grads)


class ElasticMultiLoRALinear(nn.Module):
    """Drop-in for `nn.Linear` with a frozen elastic weight and several named LoRA adapters
    (`lora_A[name]` [r, in], `lora_B[name]` [out, r], PEFT's layout); each row of the batch
    uses the adapter the model's `adapter_names` gives it ([Note: many adapters on one base])."""

    def __init__(self, et: ElasticTensor, bias: nn.Parameter | None, adapters: dict[str, LoRAConfig], name: str,
                 selection: AdapterSelection, *, fan_in_fan_out: bool = False):
        super().__init__()
        if not adapters:
            raise ValueError(f"{name}: an ElasticMultiLoRALinear needs at least one adapter")
        self.et = et
        self.out_features, self.in_features = et.shape
        self.bias = bias
        if bias is not None:
            bias.requires_grad_(False)
        self.fan_in_fan_out = fan_in_fan_out  # [Note: Conv1D]
        self.adapters = dict(adapters)  # name -> LoRAConfig, in the model's adapter order
        self.r = {n: cfg.r_of(name) for n, cfg in adapters.items()}
        self.scaling = {n: cfg.scaling_of(name) for n, cfg in adapters.items()}
        self.lora_A = nn.ModuleDict()
        self.lora_B = nn.ModuleDict()
        for n, cfg in adapters.items():
            # The same module as the adapter alone: same shapes, dtype and initial values.
            solo = ElasticLoRALinear(et, None, cfg, name, fan_in_fan_out=fan_in_fan_out)
            self.lora_A[n], self.lora_B[n] = solo.lora_A, solo.lora_B
        object.__setattr__(self, "_selection", selection)  # shared, not a submodule

    @torch.compiler.disable  # [Note: torch.compile] in linear.py
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = op_dtype(x, self.et.dtype, self.et.name)
        if x.shape[-1] != self.in_features:
            raise ValueError(f"{self.et.name}: input has {x.shape[-1]} features, the layer expects {self.in_features}")
        sel = self._selection
        rows = sel.rows(in_backward())
        if rows is None:
            if len(sel.names) != 1:
                raise ValueError(
                    f"{self.et.name}: the model has {len(sel.names)} adapters {list(sel.names)}; say which one "
                    f"each row of the batch uses: model(input_ids, ..., adapter_names=[...]) (one name per row)")
            rows = (0,) * (x.shape[0] if x.dim() > 1 else 1)
        if x.dim() < 2 or x.shape[0] != len(rows):
            raise ValueError(
                f"{self.et.name}: the input's leading dimension ({tuple(x.shape)}) must be the batch, whose "
                f"adapter_names has {len(rows)} names")
        tokens = x.numel() // (x.shape[0] * x.shape[-1]) if x.numel() else 0
        names = tuple(self.adapters)
        perm, offsets, present = sel.plan(rows, names, tokens, x.device)
        ab = []
        for k in present:
            ab += [self.lora_A[names[k]].weight, self.lora_B[names[k]].weight]
        return ElasticMultiLoRAFunction.apply(
            x, self.bias, self.et, dtype, keeps_for_backward(x), perm, offsets,
            [self.scaling[names[k]] for k in present], [self.adapters[names[k]].dropout for k in present],
            self.training, *ab,
        )

    def _apply(self, fn, recurse=True):
        refuse_conversion(self, fn)  # [Note: mixed precision] in linear.py
        return super()._apply(fn, recurse)

    def extra_repr(self) -> str:
        ads = ", ".join(f"{n}: r={self.r[n]}, scaling={self.scaling[n]:g}" for n in self.adapters)
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"adapters={{{ads}}}, chunks={self.et.num_chunks}")
