"""Adapters in PEFT's format: `save_adapter` / `load_adapter` (adapter_model.safetensors +
adapter_config.json), `adapter_state_dict`, and folding them into the frozen weights
(`merge_adapters`, `merge_into`)."""

from __future__ import annotations

import json
import math
import os
import tempfile
import warnings

import torch
import torch.nn as nn

from ..distributed.agree import rank0_then_agree
from .convert import runtime_of
from .embedding import ElasticBlocksLinear, ElasticEmbedding, elastic_tensors_of
from .linear import RUNTIME_ATTR, ElasticLinear
from .lora import (
    DEFAULT_ADAPTER,
    ElasticLoRALinear,
    ElasticMultiLoRALinear,
    LoRAConfig,
    conv1d_class,
    is_positive_finite,
    is_positive_int,
    normalize_pattern,
)

ADAPTER_WEIGHTS = "adapter_model.safetensors"


ADAPTER_CONFIG = "adapter_config.json"


PEFT_PREFIX = "base_model.model."


def lora_layers(model: nn.Module) -> list[tuple[str, ElasticLoRALinear]]:
    layers = [(n, m) for n, m in model.named_modules() if isinstance(m, ElasticLoRALinear)]
    if not layers:
        raise ValueError("the model has no ElasticLoRALinear layers (call convert_to_elastic first)")
    return layers


def adapters_of(model: nn.Module) -> dict[str, LoRAConfig]:
    """`{name: LoRAConfig}` of a model converted with convert_to_elastic (one LoRAConfig:
    {"default": it})."""
    adapters = getattr(model, "_elastic_adapters", None)
    if adapters is None:
        lora = getattr(model, "_elastic_lora", None)
        if not isinstance(lora, LoRAConfig):
            raise ValueError("the model was not converted with convert_to_elastic")
        adapters = {DEFAULT_ADAPTER: lora}
    return adapters


def is_multi_adapter(model: nn.Module) -> bool:
    """Converted with named adapters ({name: LoRAConfig}), not one LoRAConfig."""
    return any(isinstance(m, ElasticMultiLoRALinear) for m in model.modules())


def _check_adapter(model: nn.Module, adapter: str, what: str) -> None:
    names = list(adapters_of(model))
    if not isinstance(adapter, str) or adapter not in names:
        raise ValueError(f"{what}: adapter {adapter!r} is not an adapter of this model; its adapters are {names}")


def adapter_slots(model: nn.Module, adapter: str) -> list[tuple[str, nn.Module, int, float, nn.Parameter, nn.Parameter]]:
    """(layer name, layer, r, scaling, A, B) of every layer carrying `adapter`, in module order
    ([Note: many adapters on one base] in lora.py)."""
    _check_adapter(model, adapter, "adapter")
    out = []
    for name, m in model.named_modules():
        if isinstance(m, ElasticLoRALinear):
            out.append((name, m, m.r, m.scaling, m.lora_A.weight, m.lora_B.weight))
        elif isinstance(m, ElasticMultiLoRALinear) and adapter in m.adapters:
            out.append((name, m, m.r[adapter], m.scaling[adapter], m.lora_A[adapter].weight, m.lora_B[adapter].weight))
    return out


def adapter_parameters(model: nn.Module, adapter: str = DEFAULT_ADAPTER) -> list[nn.Parameter]:
    """The trainable parameters of one adapter (A and B of every layer carrying it, in module
    order): what its own optimizer takes, e.g. `torch.optim.AdamW(adapter_parameters(model,
    "a"), lr=...)` ([Note: many adapters on one base] in lora.py)."""
    return [t for _, _, _, _, a, b in adapter_slots(model, adapter) for t in (a, b)]


def warn_quantized_merge(model: nn.Module) -> None:
    """Merging into a quantized base ([Note: quantized frozen weights] in python_api/quant/):
    W is the dequantized weight and W + s·B·A is stored in W's dtype, unquantized; PEFT warns
    the same way when merging into bitsandbytes layers."""
    formats = sorted({m.et.weight_format for m in model.modules()
                      if isinstance(m, (ElasticLoRALinear, ElasticMultiLoRALinear, ElasticLinear))
                      and m.et.weight_format is not None})
    if formats:
        warnings.warn(
            f"Merging LoRA into {'/'.join(formats)}-quantized base weights: the base is dequantized and the "
            f"adapters' delta added in full precision, so the merged model may produce different generations "
            f"than the quantized model with adapters due to rounding errors (as PEFT warns for 4-bit/8-bit layers)",
            UserWarning, stacklevel=3)


def merge_adapters(model: nn.Module, adapter: str | None = None) -> nn.Module:
    """Replace every elastic layer by a plain `nn.Linear` holding W + s·B·A (or W), in place,
    and detach the runtime. A collective: call it on every rank. Returns the model. A
    quantized base weight is dequantized first (and a warning says the merge rounds). With
    named adapters, `adapter` names the one merged (the others are dropped)."""
    rt = runtime_of(model)
    multi = is_multi_adapter(model)
    if multi and adapter is None:
        raise ValueError(f"merge_adapters: the model has adapters {list(adapters_of(model))}; name the one to merge "
                         f"with merge_adapters(model, adapter=name)")
    if adapter is not None:
        _check_adapter(model, adapter, "merge_adapters")
    slots = {n: (m.scaling, m.lora_A.weight, m.lora_B.weight) for n, m in model.named_modules()
             if isinstance(m, ElasticLoRALinear)}
    if multi:
        slots = {n: (sc, a, b) for n, _, _, sc, a, b in adapter_slots(model, adapter)}
    warn_quantized_merge(model)
    # An embedding and its tied output layer share one elastic tensor: gathered once, and the
    # merged layers share one Parameter ([Note: embeddings under the runtime] in embedding.py).
    plain_of: dict[int, nn.Parameter] = {}
    for name, module in [(n, m) for n, m in model.named_modules()
                         if isinstance(m, (ElasticLoRALinear, ElasticMultiLoRALinear, ElasticLinear, ElasticEmbedding,
                                           ElasticBlocksLinear))]:
        parent_name, _, child = name.rpartition(".")
        ets = elastic_tensors_of(module)  # a table's row blocks: [Note: a table in row blocks] in embedding.py
        tied = plain_of.get(ets[0].wid)
        if tied is not None and name not in slots:
            if isinstance(module, ElasticEmbedding):
                plain = nn.Embedding(module.num_embeddings, module.embedding_dim, padding_idx=module.padding_idx,
                                     device="meta", dtype=tied.dtype)
                plain.weight = tied
            else:
                plain = nn.Linear(module.in_features, module.out_features, bias=False, device="meta", dtype=tied.dtype)
                plain.weight = tied
                plain.bias = module.bias
            setattr(model.get_submodule(parent_name) if parent_name else model, child, plain)
            continue
        weight = rt.full_weight(ets[0]) if len(ets) == 1 else torch.cat([rt.full_weight(et) for et in ets])
        if isinstance(module, ElasticEmbedding):
            plain = nn.Embedding(module.num_embeddings, module.embedding_dim, padding_idx=module.padding_idx,
                                 device=weight.device, dtype=weight.dtype)
            with torch.no_grad():
                plain.weight.copy_(weight)
            plain.requires_grad_(False)
            plain_of[ets[0].wid] = plain.weight
            setattr(model.get_submodule(parent_name) if parent_name else model, child, plain)
            continue
        if name in slots:
            scaling, lora_a, lora_b = slots[name]
            with torch.no_grad():
                delta = (lora_b.double() @ lora_a.double()) * scaling
                weight = (weight.double() + delta).to(weight.dtype)
        if module.fan_in_fan_out:  # [Note: Conv1D]: back to the layout the model came with
            plain = conv1d_class()(module.out_features, module.in_features).to(device=weight.device, dtype=weight.dtype)
            weight = weight.t()
        else:
            plain = nn.Linear(module.in_features, module.out_features, bias=module.bias is not None,
                              device=weight.device, dtype=weight.dtype)
        with torch.no_grad():
            plain.weight.copy_(weight)
            if module.bias is not None:
                plain.bias.copy_(module.bias)
            elif module.fan_in_fan_out:
                plain.bias.zero_()
        plain.requires_grad_(False)
        if name not in slots and not module.fan_in_fan_out:
            plain_of[ets[0].wid] = plain.weight
        setattr(model.get_submodule(parent_name) if parent_name else model, child, plain)
    object.__setattr__(model, RUNTIME_ATTR, None)
    return model


def adapter_metadata(model: nn.Module) -> dict:
    """What PEFT's loaders need beyond the LoRA hyper-parameters ([Note: adapters that load
    everywhere]): `task_type` ("CAUSAL_LM" for a transformers `...ForCausalLM`, else None) and
    `base_model_name_or_path` (the model's `name_or_path`, as `from_pretrained` set it: a hub
    id or a directory; None for a model built in code)."""
    names = [c.__name__ for c in type(model).__mro__ if c.__module__.startswith("transformers.")]
    task = "CAUSAL_LM" if any(n.endswith("ForCausalLM") for n in names) else None
    base = getattr(model, "name_or_path", None) or getattr(getattr(model, "config", None), "_name_or_path", None)
    return {"task_type": task, "base_model_name_or_path": str(base) if base else None}


# [Note: adapters that load everywhere]
# `AutoPeftModelForCausalLM.from_pretrained(adapter_dir)` reads `task_type` to pick the model
# class and `base_model_name_or_path` to load the base, so an adapter_config.json with either
# null fails there ("Cannot infer the auto class"). Every save path (save_adapter,
# save_pretrained, the Trainer's saves, the CLI, pipelines) writes both from the model
# (adapter_metadata) unless the caller names the base itself (the CLI names the directory or
# hub id it loaded). A model built in code has no name to record: its base stays null, as
# PEFT writes it.


def peft_config(lora: LoRAConfig, targets: list[str], fan_in_fan_out: bool = False, *,
                task_type: str | None = None, base_model_name_or_path: str | None = None) -> dict:
    target = lora.target_modules if isinstance(lora.target_modules, str) and lora.target_modules != "all-linear" \
        else sorted({t.rpartition(".")[2] for t in targets})
    return {
        "peft_type": "LORA",
        "task_type": task_type,
        "r": lora.r,
        "lora_alpha": lora.alpha,
        "lora_dropout": lora.dropout,
        "target_modules": target,
        "use_rslora": lora.use_rslora,
        "bias": "none",
        "fan_in_fan_out": fan_in_fan_out,  # [Note: Conv1D]
        "rank_pattern": dict(lora.rank_pattern),
        "alpha_pattern": dict(lora.alpha_pattern),
        "init_lora_weights": True,
        "modules_to_save": None,
        "inference_mode": True,
        "base_model_name_or_path": base_model_name_or_path,
    }


def adapter_state_dict(model: nn.Module, adapter: str | None = None) -> dict[str, torch.Tensor]:
    """The adapters under PEFT's saved key names (one adapter's: with named adapters,
    `adapter` says which)."""
    if adapter is None:
        if is_multi_adapter(model):
            raise ValueError(f"adapter_state_dict: the model has adapters {list(adapters_of(model))}; "
                             f"name one with adapter=name")
        out = {}
        for name, layer in lora_layers(model):
            out[f"{PEFT_PREFIX}{name}.lora_A.weight"] = layer.lora_A.weight.detach().cpu().contiguous()
            out[f"{PEFT_PREFIX}{name}.lora_B.weight"] = layer.lora_B.weight.detach().cpu().contiguous()
        return out
    out = {}
    for name, _, _, _, a, b in adapter_slots(model, adapter):
        out[f"{PEFT_PREFIX}{name}.lora_A.weight"] = a.detach().cpu().contiguous()
        out[f"{PEFT_PREFIX}{name}.lora_B.weight"] = b.detach().cpu().contiguous()
    return out


def atomic_write(path: str, write) -> None:
    folder = os.path.dirname(path) or "."
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=folder)
    os.close(fd)
    try:
        write(tmp)
        # mkstemp creates the file 0600, and a writer may replace the file (safetensors does):
        # give the finished file the permissions a plain open() would, right before the rename.
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def save_adapter(model: nn.Module, path: str, base_model_name_or_path: str | None = None,
                 adapter: str | None = None) -> None:
    """Write `adapter_model.safetensors` and `adapter_config.json` in PEFT's format under
    `path` (rank 0 writes, each file to a temporary name then renamed; every rank returns
    after the files exist). `base_model_name_or_path` overrides the model's own name in the
    config ([Note: adapters that load everywhere]). With named adapters ([Note: many adapters
    on one base] in lora.py): `adapter=name` writes that one under `path`; without it every
    adapter goes to `path/<name>/`."""
    from safetensors.torch import save_file

    if getattr(model, "_elastic_lora", None) is None:
        raise ValueError("save_adapter: the model was not converted with convert_to_elastic")
    adapters = adapters_of(model)
    if adapter is not None:
        _check_adapter(model, adapter, "save_adapter")
    multi = is_multi_adapter(model)
    if not multi:
        lora_layers(model)  # raises without LoRA layers
    jobs = ([(adapter or DEFAULT_ADAPTER, path)] if adapter is not None or not multi
            else [(a, os.path.join(path, a)) for a in adapters])
    rt = runtime_of(model)

    def write():
        for name, folder in jobs:
            slots = adapter_slots(model, name)
            os.makedirs(folder, exist_ok=True)
            state = adapter_state_dict(model) if not multi else adapter_state_dict(model, name)
            atomic_write(os.path.join(folder, ADAPTER_WEIGHTS), lambda p: save_file(state, p, metadata={"format": "pt"}))
            meta = adapter_metadata(model)
            if base_model_name_or_path is not None:
                meta["base_model_name_or_path"] = str(base_model_name_or_path)
            config = peft_config(adapters[name], [n for n, *_ in slots], any(m.fan_in_fan_out for _, m, *_ in slots),
                                 **meta)
            atomic_write(
                os.path.join(folder, ADAPTER_CONFIG),
                lambda p: open(p, "w").write(json.dumps(config, indent=2, sort_keys=True) + "\n"),
            )

    rank0_then_agree(write, rt.group, what=f"save_adapter({path!r})")  # every rank raises rank 0's error


def _check_adapter_config(config, cfile: str) -> None:
    """Every field load_adapter reads, checked before the model is touched."""
    if not isinstance(config, dict):
        raise ValueError(f"load_adapter: {cfile} must hold a JSON object, got {type(config).__name__}")
    if config.get("peft_type") != "LORA":
        raise ValueError(f"load_adapter: {cfile} has peft_type={config.get('peft_type')!r}, expected 'LORA'")
    if "r" not in config:
        raise ValueError(f"load_adapter: {cfile} has no 'r' (the LoRA rank)")
    if not is_positive_int(config["r"]):
        raise ValueError(f"load_adapter: {cfile} has r={config['r']!r}; it must be a positive int")
    if not is_positive_finite(config.get("lora_alpha")):
        raise ValueError(f"load_adapter: {cfile} has lora_alpha={config.get('lora_alpha')!r}; it must be a finite positive number")
    if not isinstance(config.get("use_rslora", False), bool):
        raise ValueError(f"load_adapter: {cfile} has use_rslora={config.get('use_rslora')!r}; it must be a bool")
    if not isinstance(config.get("fan_in_fan_out", False), bool):
        raise ValueError(f"load_adapter: {cfile} has fan_in_fan_out={config.get('fan_in_fan_out')!r}; it must be a bool")
    for key, check, kind in (("rank_pattern", is_positive_int, "a positive int"),
                             ("alpha_pattern", is_positive_finite, "a finite positive number")):
        value = config.get(key) or {}
        if not isinstance(value, dict):
            raise ValueError(f"load_adapter: {cfile} has {key}={value!r}; it must be an object {{pattern: value}}")
        normalize_pattern(value, f"load_adapter: {cfile}: {key}", check, kind)


def load_adapter(model: nn.Module, path: str, adapter: str | None = None) -> None:
    """Load a PEFT LoRA adapter (these key names, these shapes) into an elastic model. Every
    adapter of the model must be in the file and every tensor of the file must fit one; every
    module's rank and scaling, by the file's r, lora_alpha, use_rslora, rank_pattern and
    alpha_pattern ([Note: per-module rank and alpha]), must be the layer's. Everything is
    checked before any adapter changes. With named adapters, `adapter=name` loads that one
    from `path`; without it every adapter from `path/<name>/`, as save_adapter writes them."""
    if getattr(model, "_elastic_lora", None) is None:
        raise ValueError("load_adapter: the model was not converted with convert_to_elastic")
    if adapter is not None:
        _check_adapter(model, adapter, "load_adapter")
    if adapter is not None or not is_multi_adapter(model):
        if not is_multi_adapter(model):
            lora_layers(model)  # raises without LoRA layers
        _load_checked(model, path, adapter or DEFAULT_ADAPTER)()
        return
    # Every adapter checked before any changes.
    loads = [_load_checked(model, os.path.join(path, a), a) for a in adapters_of(model)]
    for load in loads:
        load()


def _load_checked(model: nn.Module, path: str, adapter: str):
    """Check the PEFT adapter under `path` against `adapter`'s layers; returns the function
    that copies it in."""
    from safetensors.torch import load_file

    wfile, cfile = os.path.join(path, ADAPTER_WEIGHTS), os.path.join(path, ADAPTER_CONFIG)
    for f in (wfile, cfile):
        if not os.path.isfile(f):
            raise FileNotFoundError(f"load_adapter: {f} does not exist")
    with open(cfile) as f:
        try:
            config = json.load(f)
        except json.JSONDecodeError as exc:
            raise ValueError(f"load_adapter: {cfile} is not valid JSON: {exc}") from exc
    _check_adapter_config(config, cfile)
    file_cfg = LoRAConfig(
        r=config["r"], alpha=config["lora_alpha"], use_rslora=config.get("use_rslora", False),
        rank_pattern=config.get("rank_pattern") or {}, alpha_pattern=config.get("alpha_pattern") or {},
    )
    slots = adapter_slots(model, adapter)
    for name, _, layer_r, layer_scaling, _, _ in slots:
        r, scaling = file_cfg.r_of(name), file_cfg.scaling_of(name)
        if r != layer_r or not math.isclose(scaling, layer_scaling, rel_tol=1e-12):
            raise ValueError(
                f"load_adapter: for {name} the adapter in {cfile} has r={r}, scaling={scaling:g} "
                f"(lora_alpha={file_cfg.alpha_of(name)}, from r, lora_alpha, use_rslora, rank_pattern, "
                f"alpha_pattern); the model's layer has r={layer_r}, scaling={layer_scaling:g}. Convert the model "
                f"with a LoRAConfig giving the same values (LoRAConfig.rank_pattern / alpha_pattern for per-module ones)"
            )
    state = load_file(wfile)
    expected = {}
    for name, _, _, _, a, b in slots:
        expected[f"{PEFT_PREFIX}{name}.lora_A.weight"] = a
        expected[f"{PEFT_PREFIX}{name}.lora_B.weight"] = b
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
        if not state[key].is_floating_point() or not torch.isfinite(state[key]).all():
            raise ValueError(f"load_adapter: {key!r} in {wfile} has non-finite values (NaN or inf) or is not floating point")

    def copy_in():
        with torch.no_grad():
            for key, param in expected.items():
                param.copy_(state[key].to(device=param.device, dtype=param.dtype))

    return copy_in


def split_state_dict(model: nn.Module, state_dict: dict) -> tuple[dict, dict]:
    """(base, adapters): the base weights under their original names, and the LoRA adapters
    under PEFT's saved names (`base_model.model.<layer>.lora_A.weight`)."""
    if is_multi_adapter(model):
        raise ValueError(f"this model has named adapters {list(adapters_of(model))}: save them with "
                         f"save_adapter(model, dir) (one folder each) or save_adapter(model, dir, adapter=name), "
                         f"or merge one first with merge_adapters(model, adapter=name)")
    lora_names = {n for n, m in model.named_modules() if isinstance(m, ElasticLoRALinear)}
    base, adapters = {}, {}
    for key, value in state_dict.items():
        layer, _, rest = key.rpartition(".lora_")
        if layer in lora_names and rest in ("A.weight", "B.weight"):
            adapters[f"{PEFT_PREFIX}{key}"] = value
        else:
            base[key] = value
    return base, adapters


def merge_into(model: nn.Module, base: dict, adapters: dict) -> dict:
    """base with W + s·B·A for every LoRA layer (computed in float64, stored in W's dtype; a
    quantized layer's W in `base` is its dequantized value, and a warning says so)."""
    warn_quantized_merge(model)
    out = dict(base)
    for name, layer in model.named_modules():
        if isinstance(layer, ElasticLoRALinear):
            a = adapters[f"{PEFT_PREFIX}{name}.lora_A.weight"].double().cpu()
            b = adapters[f"{PEFT_PREFIX}{name}.lora_B.weight"].double().cpu()
            w = out[f"{name}.weight"]
            delta = (b @ a) * layer.scaling
            if getattr(layer, "fan_in_fan_out", False):
                delta = delta.t()  # Conv1D layout [in, out]
            out[f"{name}.weight"] = (w.double().cpu() + delta).to(w.dtype)
    return out


def write_adapter(model: nn.Module, path: str, adapters: dict) -> None:
    """Write adapter_model.safetensors + adapter_config.json (PEFT's format) under `path`
    (on the calling process only; each file to a temporary name, then renamed)."""
    from safetensors.torch import save_file

    if is_multi_adapter(model):
        raise ValueError(f"this model has named adapters {list(adapters_of(model))}: write them with "
                         f"save_adapter(model, dir) (one folder each) or save_adapter(model, dir, adapter=name)")
    os.makedirs(path, exist_ok=True)
    tensors = {k: v.detach().cpu().contiguous() for k, v in adapters.items()}
    atomic_write(os.path.join(path, ADAPTER_WEIGHTS), lambda p: save_file(tensors, p, metadata={"format": "pt"}))
    layers = lora_layers(model)
    fan_in_fan_out = any(getattr(m, "fan_in_fan_out", False) for _, m in layers)  # Conv1D layers
    config = peft_config(model._elastic_lora, [n for n, _ in layers], fan_in_fan_out, **adapter_metadata(model))
    atomic_write(
        os.path.join(path, ADAPTER_CONFIG),
        lambda p: open(p, "w").write(json.dumps(config, indent=2, sort_keys=True) + "\n"),
    )
