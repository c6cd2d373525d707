"""Drop-in LoRA layers on elastic frozen weights, model conversion, PEFT-format adapters.

    model = convert_to_elastic(model, LoRAConfig(r=16, alpha=32, target_modules="all-linear"),
                               ElasticPolicy(chunk_bytes=4 << 20))
    ... train ...
    save_adapter(model, "out/adapter")      # loads with peft.PeftModel.from_pretrained

[Note: what convert_to_elastic does with each parameter]
- Linear layers matched by `target_modules` become `ElasticLoRALinear`: frozen weight elastic
  (sharded, gathered into pool pages), trainable adapters A [r, in] and B [out, r] replicated.
- Other frozen `nn.Linear` layers (lm_head, say) become `ElasticLinear` when their weight has
  at least `ElasticPolicy.replicate_below_bytes` bytes, else stay plain and replicated. A
  linear whose weight is shared with another module (tied lm_head/embeddings) stays replicated:
  sharding one user of a tensor that another keeps whole saves nothing.
- Embeddings, norms and every other parameter stay replicated and frozen: an embedding lookup
  reads arbitrary rows, which the chunked GEMM path does not serve.
Everything but the adapters is frozen.

[Note: initialisation and replication]
Adapters follow PEFT's default: A ~ kaiming_uniform(a=sqrt(5)) = U(-1/sqrt(in), 1/sqrt(in)),
B = 0, scaling = alpha / r (alpha / sqrt(r) with use_rslora). Each A is drawn from a generator
seeded with (LoRAConfig.seed, crc32 of the module name), so every rank builds identical
adapters without a broadcast, and a module's adapter does not depend on which others exist.
"""

from __future__ import annotations

import json
import math
import os
import re
import tempfile
import zlib
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from elastic_kernels import lora_adapter_grads, paged_lora_linear_dgrad, paged_lora_linear_fwd
from python_api.config import ElasticPolicy
from python_api.elastic_linear import _RUNTIME_ATTR, ElasticLinear, runtime_of
from python_api.runtime import ElasticRuntime, ElasticTensor, Phase

ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"
_PEFT_PREFIX = "base_model.model."


@dataclass(frozen=True)
class LoRAConfig:
    """LoRA hyper-parameters (PEFT's meaning for every field of the same name)."""

    r: int
    alpha: float
    dropout: float = 0.0
    target_modules: tuple[str, ...] | str = ("q_proj", "k_proj", "v_proj", "o_proj")
    use_rslora: bool = False
    seed: int = 0

    def __post_init__(self):
        if isinstance(self.r, bool) or not isinstance(self.r, int) or self.r <= 0:
            raise ValueError(f"LoRAConfig.r must be a positive int, got {self.r!r}")
        if not isinstance(self.alpha, (int, float)) or isinstance(self.alpha, bool) or self.alpha <= 0:
            raise ValueError(f"LoRAConfig.alpha must be a positive number, got {self.alpha!r}")
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


def _matches(cfg: LoRAConfig, name: str) -> bool:
    """PEFT's rule: a regex must match the whole name; a list matches a name or a suffix."""
    if isinstance(cfg.target_modules, str):
        return re.fullmatch(cfg.target_modules, name) is not None
    return any(name == t or name.endswith("." + t) for t in cfg.target_modules)


def _target_names(model: nn.Module, cfg: LoRAConfig) -> list[str]:
    linears = [n for n, m in model.named_modules() if n and isinstance(m, nn.Linear)]
    if cfg.target_modules == "all-linear":
        out_emb = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
        names = [n for n in linears if model.get_submodule(n) is not out_emb and n.rpartition(".")[2] != "lm_head"]
    else:
        names = [n for n in linears if _matches(cfg, n)]
    if not names:
        candidates = sorted({n.rpartition(".")[2] for n in linears})
        raise ValueError(
            f"LoRAConfig.target_modules={cfg.target_modules!r} matches no nn.Linear of the model; "
            f"candidate names: {candidates}"
        )
    return names


class ElasticLoRAFunction(torch.autograd.Function):
    """y = x·Wᵀ + b + s·(dropout(x)·Aᵀ)·Bᵀ with W read from pool pages; saves the input (and
    the dropout mask), never W; backward re-gathers W through the runtime for dx only."""

    @staticmethod
    def forward(ctx, x, bias, lora_a, lora_b, et: ElasticTensor, scale: float, dropout: float, training: bool):
        rt = et.runtime
        x2 = x.reshape(-1, x.shape[-1])
        mask = None
        lora_x = x2
        if dropout > 0.0 and training:
            mask = torch.empty_like(x2).bernoulli_(1.0 - dropout).div_(1.0 - dropout)
            lora_x = x2 * mask
        with rt.use(et, Phase.FORWARD, needs_backward=ctx.needs_input_grad[0]) as resident:
            y, xa = paged_lora_linear_fwd(x2, resident.chunks(), bias, lora_x, lora_a, lora_b, scale)
        ctx.save_for_backward(lora_x, xa, lora_a, lora_b, mask)
        ctx.et, ctx.scale, ctx.x_shape = et, scale, x.shape
        return y.view(*x.shape[:-1], y.shape[-1])

    @staticmethod
    def backward(ctx, dy):
        lora_x, xa, lora_a, lora_b, mask = ctx.saved_tensors
        et, s = ctx.et, ctx.scale
        dy2 = dy.reshape(-1, dy.shape[-1]).contiguous()
        dx = db = None
        if ctx.needs_input_grad[0]:
            with et.runtime.use(et, Phase.BACKWARD) as resident:
                if mask is None:
                    dx, dyb = paged_lora_linear_dgrad(dy2, resident.chunks(), lora_a, lora_b, s)
                else:
                    # The LoRA path saw x·mask: its share of dx is masked too.
                    dx, _ = paged_lora_linear_dgrad(dy2, resident.chunks(), None, None, s)
                    dyb = dy2 @ lora_b
                    dx = dx + (dyb @ lora_a).mul_(s).mul_(mask)
            dx = dx.view(ctx.x_shape)
        else:
            dyb = dy2 @ lora_b
        da, dB = lora_adapter_grads(lora_x, xa, dy2, dyb, s)
        if ctx.needs_input_grad[1]:
            db = dy2.sum(0)
        return (
            dx, db,
            da if ctx.needs_input_grad[2] else None,
            dB if ctx.needs_input_grad[3] else None,
            None, None, None, None,
        )


class ElasticLoRALinear(nn.Module):
    """Drop-in for `nn.Linear` (same call, `in_features`, `out_features`, `bias`) with a frozen
    elastic weight and trainable LoRA adapters `lora_A` [r, in], `lora_B` [out, r]."""

    def __init__(self, et: ElasticTensor, bias: nn.Parameter | None, lora: LoRAConfig, name: str):
        super().__init__()
        self.et = et
        self.out_features, self.in_features = et.shape
        self.bias = bias
        if bias is not None:
            bias.requires_grad_(False)
        self.lora = lora
        self.scaling = lora.scaling
        device = et.shard.device
        self.lora_A = nn.Linear(self.in_features, lora.r, bias=False, device=device, dtype=et.dtype)
        self.lora_B = nn.Linear(lora.r, self.out_features, bias=False, device=device, dtype=et.dtype)
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
        layer = cls(rt.register(linear.weight, name), linear.bias, lora, name)
        rt.check_ranks_agree()
        rt.set_trainable([layer.lora_A.weight, layer.lora_B.weight])
        object.__setattr__(layer, _RUNTIME_ATTR, rt)
        return layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype != self.et.dtype:
            raise TypeError(f"{self.et.name}: input dtype {x.dtype} differs from the layer's weight dtype {self.et.dtype}")
        if x.shape[-1] != self.in_features:
            raise ValueError(f"{self.et.name}: input has {x.shape[-1]} features, the layer expects {self.in_features}")
        return ElasticLoRAFunction.apply(
            x, self.bias, self.lora_A.weight, self.lora_B.weight, self.et,
            self.scaling, self.lora.dropout, self.training,
        )

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
            f"r={self.lora.r}, scaling={self.scaling:g}, chunks={self.et.num_chunks}"
        )


def _shared_params(model: nn.Module) -> set[int]:
    """ids of parameters registered under more than one module (tied weights)."""
    seen: dict[int, int] = {}
    for _, module in model.named_modules(remove_duplicate=False):
        for p in module.parameters(recurse=False):
            seen[id(p)] = seen.get(id(p), 0) + 1
    return {pid for pid, n in seen.items() if n > 1}


def convert_to_elastic(model: nn.Module, lora: LoRAConfig, policy: ElasticPolicy, group=None) -> nn.Module:
    """Replace the target linears of `model` in place (see [Note: what convert_to_elastic does
    with each parameter]); call on every rank of `group` with the same model. Returns `model`."""
    if not isinstance(lora, LoRAConfig):
        raise TypeError(f"lora must be a LoRAConfig, got {type(lora).__name__}")
    if getattr(model, _RUNTIME_ATTR, None) is not None:
        raise RuntimeError("convert_to_elastic: this model is already under an elastic runtime")
    targets = _target_names(model, lora)
    shared = _shared_params(model)
    others = [
        n for n, m in model.named_modules()
        if n and isinstance(m, nn.Linear) and n not in targets and id(m.weight) not in shared
        and m.weight.numel() * m.weight.element_size() >= policy.replicate_below_bytes
    ]
    tied = [n for n in targets if id(model.get_submodule(n).weight) in shared]
    if tied:
        raise ValueError(f"convert_to_elastic: target linears {tied} share their weight with another module (tied)")
    device = model.get_submodule(targets[0]).weight.device
    runtime = ElasticRuntime(policy, group=group, device=device)
    model.requires_grad_(False)
    replacements = []
    chosen = set(targets) | set(others)
    for name, module in [(n, m) for n, m in model.named_modules() if n in chosen]:
        et = runtime.register(module.weight, name)
        new = ElasticLoRALinear(et, module.bias, lora, name) if name in targets else ElasticLinear(et, module.bias)
        replacements.append((name, new))
    runtime.check_ranks_agree()
    for name, new in replacements:
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name) if parent_name else model, child, new)
    runtime.set_trainable([p for p in model.parameters() if p.requires_grad])
    object.__setattr__(model, _RUNTIME_ATTR, runtime)
    object.__setattr__(model, "_elastic_lora", lora)
    return model


def _lora_layers(model: nn.Module) -> list[tuple[str, ElasticLoRALinear]]:
    layers = [(n, m) for n, m in model.named_modules() if isinstance(m, ElasticLoRALinear)]
    if not layers:
        raise ValueError("the model has no ElasticLoRALinear layers (call convert_to_elastic first)")
    return layers


def merge_adapters(model: nn.Module) -> nn.Module:
    """Replace every elastic layer by a plain `nn.Linear` holding W + s·B·A (or W), in place,
    and detach the runtime. A collective: call it on every rank. Returns the model."""
    rt = runtime_of(model)
    for name, module in [(n, m) for n, m in model.named_modules() if isinstance(m, (ElasticLoRALinear, ElasticLinear))]:
        weight = rt.full_weight(module.et)
        if isinstance(module, ElasticLoRALinear):
            with torch.no_grad():
                delta = (module.lora_B.weight.double() @ module.lora_A.weight.double()) * module.scaling
                weight = (weight.double() + delta).to(weight.dtype)
        plain = nn.Linear(module.in_features, module.out_features, bias=module.bias is not None,
                          device=weight.device, dtype=weight.dtype)
        with torch.no_grad():
            plain.weight.copy_(weight)
            if module.bias is not None:
                plain.bias.copy_(module.bias)
        plain.requires_grad_(False)
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name) if parent_name else model, child, plain)
    object.__setattr__(model, _RUNTIME_ATTR, None)
    return model


def _peft_config(lora: LoRAConfig, targets: list[str]) -> dict:
    target = lora.target_modules if isinstance(lora.target_modules, str) and lora.target_modules != "all-linear" \
        else sorted({t.rpartition(".")[2] for t in targets})
    return {
        "peft_type": "LORA",
        "task_type": None,
        "r": lora.r,
        "lora_alpha": lora.alpha,
        "lora_dropout": lora.dropout,
        "target_modules": target,
        "use_rslora": lora.use_rslora,
        "bias": "none",
        "fan_in_fan_out": False,
        "init_lora_weights": True,
        "modules_to_save": None,
        "inference_mode": True,
        "base_model_name_or_path": None,
    }


def adapter_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The adapters under PEFT's saved key names."""
    out = {}
    for name, layer in _lora_layers(model):
        out[f"{_PEFT_PREFIX}{name}.lora_A.weight"] = layer.lora_A.weight.detach().cpu().contiguous()
        out[f"{_PEFT_PREFIX}{name}.lora_B.weight"] = layer.lora_B.weight.detach().cpu().contiguous()
    return out


def _atomic_write(path: str, write) -> None:
    folder = os.path.dirname(path) or "."
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=folder)
    os.close(fd)
    try:
        # mkstemp creates the file 0600; give the result the permissions a plain open() would.
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)
        write(tmp)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def save_adapter(model: nn.Module, path: str) -> None:
    """Write `adapter_model.safetensors` and `adapter_config.json` in PEFT's format under
    `path` (rank 0 writes, each file to a temporary name then renamed; every rank returns
    after the files exist)."""
    from safetensors.torch import save_file

    lora = getattr(model, "_elastic_lora", None)
    if lora is None:
        raise ValueError("save_adapter: the model was not converted with convert_to_elastic")
    layers = _lora_layers(model)
    rt = runtime_of(model)
    if rt.rank == 0:
        os.makedirs(path, exist_ok=True)
        state = adapter_state_dict(model)
        _atomic_write(os.path.join(path, ADAPTER_WEIGHTS), lambda p: save_file(state, p, metadata={"format": "pt"}))
        config = _peft_config(lora, [n for n, _ in layers])
        _atomic_write(
            os.path.join(path, ADAPTER_CONFIG),
            lambda p: open(p, "w").write(json.dumps(config, indent=2, sort_keys=True) + "\n"),
        )
    if rt.world_size > 1:
        dist.barrier(group=rt.group)


def load_adapter(model: nn.Module, path: str) -> None:
    """Load a PEFT LoRA adapter (these key names, these shapes) into an elastic model. Every
    adapter of the model must be in the file and every tensor of the file must fit one."""
    from safetensors.torch import load_file

    lora = getattr(model, "_elastic_lora", None)
    if lora is None:
        raise ValueError("load_adapter: the model was not converted with convert_to_elastic")
    wfile, cfile = os.path.join(path, ADAPTER_WEIGHTS), os.path.join(path, ADAPTER_CONFIG)
    for f in (wfile, cfile):
        if not os.path.isfile(f):
            raise FileNotFoundError(f"load_adapter: {f} does not exist")
    with open(cfile) as f:
        try:
            config = json.load(f)
        except json.JSONDecodeError as exc:
            raise ValueError(f"load_adapter: {cfile} is not valid JSON: {exc}") from exc
    if config.get("peft_type") != "LORA":
        raise ValueError(f"load_adapter: {cfile} has peft_type={config.get('peft_type')!r}, expected 'LORA'")
    file_scaling = config["lora_alpha"] / (math.sqrt(config["r"]) if config.get("use_rslora") else config["r"])
    if not math.isclose(file_scaling, lora.scaling, rel_tol=1e-12):
        raise ValueError(
            f"load_adapter: the adapter's scaling (lora_alpha={config['lora_alpha']}, r={config['r']}) is "
            f"{file_scaling:g}, the model's LoRAConfig gives {lora.scaling:g}"
        )
    state = load_file(wfile)
    expected = {}
    for name, layer in _lora_layers(model):
        expected[f"{_PEFT_PREFIX}{name}.lora_A.weight"] = layer.lora_A.weight
        expected[f"{_PEFT_PREFIX}{name}.lora_B.weight"] = layer.lora_B.weight
    for key in state:
        if key not in expected:
            raise KeyError(f"load_adapter: {wfile} has {key!r}, which no adapter of this model matches")
    for key, param in expected.items():
        if key not in state:
            raise KeyError(f"load_adapter: {wfile} lacks {key!r}")
        if tuple(state[key].shape) != tuple(param.shape):
            raise ValueError(
                f"load_adapter: {key!r} has shape {tuple(state[key].shape)} in {wfile}, the model expects {tuple(param.shape)}"
            )
    with torch.no_grad():
        for key, param in expected.items():
            param.copy_(state[key].to(device=param.device, dtype=param.dtype))
