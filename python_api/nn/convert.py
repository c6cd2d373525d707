"""Putting a model under the elastic runtime, and reaching its runtime: `convert_to_elastic`
(LoRA on the targets, the other large frozen linears elastic), `elasticize` (frozen linears
only), `runtime_of`, `stats`, `reset_stats`, `set_pool_budget`, `no_sync`.

Both conversions end in `attach(model)`: the state-dict hooks (state_dict.py), the forward
pre-hook that hands gradient averaging to DDP (ddp.py), and every hook registered with
`register_conversion_hook` (the transformers integration registers its class swap:
python_api/hf/).

[Note: what convert_to_elastic does with each parameter]
- Linear layers matched by `target_modules` become `ElasticLoRALinear`: frozen weight elastic
  (sharded, gathered into pool pages), trainable adapters A [r, in] and B [out, r] replicated.
- Other frozen `nn.Linear` layers (lm_head, say) become `ElasticLinear` when their weight has
  at least `ElasticPolicy.replicate_below_bytes` bytes, else stay plain and replicated.
- With `ElasticPolicy.shard_embeddings=True` (default False), `nn.Embedding` tables of at
  least `replicate_below_bytes` bytes become `ElasticEmbedding`, and a frozen linear tied to
  one (a tied lm_head) an `ElasticLinear` on the same elastic tensor: one copy ([Note:
  embeddings under the runtime] in embedding.py). Otherwise embeddings stay replicated, and
  so does any linear whose weight is shared with another module: sharding one user of a
  tensor that another keeps whole saves nothing. A LoRA target tied to another module is
  refused.
- Norms and every other parameter stay replicated and frozen.
Everything but the adapters is frozen.

[Note: what QLoRA keeps in full precision]
bitsandbytes (`llm_int8_skip_modules`, filled by transformers with the output layer), PEFT's
QLoRA recipes and torchtune quantize the decoder's linears and keep the output layer in full
precision: the logits feed the loss directly, and the output layer is one weight among many
(on SmolLM2-135M a tied one; on Llama-3-8B 0.5 G of 8 G parameters). Quantizing it too made a
`--weight-format nf4` run here another run than the QLoRA users compare against. So with a
`weight_format`, `ElasticPolicy.quant_skip_modules` names the modules kept in full precision
and its default, None, means the model's output layer: resolved here to the name of
`model.get_output_embeddings()` when the model has one (transformers models), else `lm_head`,
and the runtime gets the policy with that tuple (the same on every rank: the same model). A
skipped weight is still elastic (sharded, gathered, cached): only its storage format changes.
A bitsandbytes 4-bit checkpoint decides by itself: its packed weights stay packed and every
weight it holds in full precision stays so (its lm_head, or whatever its own skip list kept),
never requantized; `quant_skip_modules` does not apply to it.
"""


from __future__ import annotations

import dataclasses

import torch
import torch.nn as nn

from ..config import ElasticPolicy
from ..distributed.agree import agree
from ..distributed.launch import ensure_default_group
from ..runtime import ElasticRuntime
from . import ddp, state_dict  # submodules (hooks installed by attach)
from .embedding import ElasticBlocksLinear, ElasticEmbedding, can_shard_embedding, table_blocks
from .linear import RUNTIME_ATTR, ElasticLinear
from .lora import (
    AdapterSelection,
    ElasticLoRALinear,
    ElasticMultiLoRALinear,
    LoRAConfig,
    frozen_weight,
    is_conv1d,
    is_linear,
    normalize_adapters,
    target_names,
)
from .units import assign_units

_ATTACHED_ATTR = "_elastic_attached"  # (runtime, forward pre-hook handle) of the last attach
_CONVERSION_HOOKS: list = []


def register_conversion_hook(fn) -> None:
    """`fn(model)` runs at the end of every conversion (after the runtime is attached), e.g. the
    transformers integration's class swap (python_api/hf/). Registering twice is a no-op."""
    if fn not in _CONVERSION_HOOKS:
        _CONVERSION_HOOKS.append(fn)


def _shared_params(model: nn.Module) -> set[int]:
    """ids of parameters registered under more than one module (tied weights)."""
    seen: dict[int, int] = {}
    for _, module in model.named_modules(remove_duplicate=False):
        for p in module.parameters(recurse=False):
            seen[id(p)] = seen.get(id(p), 0) + 1
    return {pid for pid, n in seen.items() if n > 1}


def _embeddings_to_shard(model: nn.Module, policy: ElasticPolicy, targets: set[str],
                         shared: set[int]) -> tuple[dict[str, list[str]], dict[str, str]]:
    """The embeddings to put under the runtime ({name: [names of the frozen linears tied to
    it]}) and those tied heads ({head: embedding}): [Note: embeddings under the runtime] in
    embedding.py. An embedding whose table another module uses otherwise stays replicated."""
    if not policy.shard_embeddings:
        return {}, {}
    users: dict[int, list[tuple[str, nn.Module]]] = {}
    for n, m in model.named_modules(remove_duplicate=False):
        for p in m.parameters(recurse=False):
            users.setdefault(id(p), []).append((n, m))
    embeddings, heads = {}, {}
    for name, m in model.named_modules():
        if not name or not can_shard_embedding(m):
            continue
        if m.weight.numel() * m.weight.element_size() < policy.replicate_below_bytes:
            continue
        tied = []
        if id(m.weight) in shared:
            others = [(n, u) for n, u in users[id(m.weight)] if u is not m]
            ok = all(isinstance(u, nn.Linear) and not is_conv1d(u) and n not in targets and u.weight is m.weight
                     for n, u in others)
            if not ok or len({id(u) for _, u in others}) != len(others):
                continue  # used some other way: stays replicated
            tied = sorted({n for n, _ in others})
        embeddings[name] = tied
        heads.update({t: name for t in tied})
    return embeddings, heads


def _untied_head_in_blocks(model: nn.Module, policy: ElasticPolicy, others: list[str]) -> str | None:
    """With `shard_embeddings`, the model's output layer when it is an untied frozen linear put
    under the runtime (not a LoRA target, not a Conv1D, not quantized): it is held in row
    blocks like a table ([Note: a table in row blocks] in embedding.py). Else None."""
    if not policy.shard_embeddings:
        return None
    name = _output_layer(model)
    if name not in others or is_conv1d(model.get_submodule(name)) or policy.quantizes(name):
        return None
    return name


def _block_limit(model: nn.Module, policy: ElasticPolicy, units: dict, tables: set) -> int | None:
    """The most bytes of one row block of a table ([Note: a table in row blocks] in
    embedding.py): `policy.table_block_bytes`, else the largest unit of the other weights
    (a decoder layer); None (one block) when there is none."""
    if policy.table_block_bytes is not None:
        return policy.table_block_bytes
    per_unit: dict[str, int] = {}
    for name, unit in units.items():
        if name not in tables:
            w = model.get_submodule(name).weight
            per_unit[unit or name] = per_unit.get(unit or name, 0) + w.numel() * w.element_size()
    return max(per_unit.values(), default=None)


def _register_blocks(runtime: ElasticRuntime, policy: ElasticPolicy, name: str, weight: torch.Tensor, rows,
                     limit: int | None) -> tuple:
    """Register `weight` [rows, cols] as its row blocks, each its own unit, named
    "<name>.rows<begin>-<end>" (just `name` when one block holds it all)."""
    n, cols = weight.shape
    row_bytes = cols * weight.element_size()
    rpc = policy.weight_rows_per_chunk(name, weight.shape, row_bytes)
    blocks = table_blocks(n, row_bytes, rpc, limit if limit is not None else n * row_bytes)
    out = []
    for r0, r1 in blocks:
        read = None if rows is None else (lambda b, e, r0=r0: rows(r0 + b, r0 + e))
        block_name = name if len(blocks) == 1 else f"{name}.rows{r0}-{r1}"
        out.append(runtime.register(weight[r0:r1], block_name, None, rows=read))
    return tuple(out)


def _output_layer(model: nn.Module) -> str:
    """The name of the model's output layer: its `get_output_embeddings()` (transformers), else
    "lm_head"."""
    get = getattr(model, "get_output_embeddings", None)
    out = get() if callable(get) else None
    if out is not None:
        for name, module in model.named_modules():
            if module is out:
                return name
    return "lm_head"


def resolve_quant_skip(model: nn.Module, policy: ElasticPolicy, chosen, source=None) -> ElasticPolicy:
    """The policy the runtime gets: `quant_skip_modules` made explicit ([Note: what QLoRA keeps
    in full precision]). Without a weight_format, `policy` as it is."""
    if policy.weight_format is None:
        return policy
    if source is not None and getattr(source, "packed_format", None) is not None:
        prefix = getattr(model, "base_model_prefix", None) or None
        skip = tuple(sorted(n for n in chosen if not source.is_packed(f"{n}.weight", prefix)))
    elif policy.quant_skip_modules is None:
        skip = (_output_layer(model),)
    else:
        return policy
    return dataclasses.replace(policy, quant_skip_modules=skip)


def convert_to_elastic(model: nn.Module, lora, policy: ElasticPolicy, group=None,
                       unit_modules=None, source=None) -> nn.Module:
    """Replace the target linears of `model` in place (see [Note: what convert_to_elastic does
    with each parameter]); call on every rank of `group` with the same model. `lora`: one
    `LoRAConfig` (the adapter "default"), or `{name: LoRAConfig}` for several named adapters
    on one base, each with its own targets ([Note: many adapters on one base] in lora.py;
    forwards then take `adapter_names=[...]`, one name per batch row). `unit_modules`
    groups the weights gathered in one collective (default: the HF decoder layers,
    `_no_split_modules`; see `elastic_kernels.api.nn.units.assign_units`). `source` (a
    `elastic_kernels.api.loading.SafetensorsSource`): the weights come from its files, not from `model`,
    whose parameters may be on the meta device; each rank reads only its shard of each elastic
    weight and the replicated tensors, on `source.device` ([Note: loading from files] in
    python_api/loading/). Returns `model`."""
    single = isinstance(lora, LoRAConfig)
    adapters = normalize_adapters(lora)  # checks names and configs; see [Note: many adapters on one base]
    if getattr(model, RUNTIME_ATTR, None) is not None:
        raise RuntimeError("convert_to_elastic: this model is already under an elastic runtime")
    targets_of = {}
    for adapter, cfg in adapters.items():
        try:
            targets_of[adapter] = set(target_names(model, cfg))
        except ValueError as exc:
            raise ValueError(f"adapter {adapter!r}: {exc}" if not single else str(exc)) from None
    union = set().union(*targets_of.values())
    targets = [n for n, _ in model.named_modules() if n in union]
    shared = _shared_params(model)
    tied = [n for n in targets if id(model.get_submodule(n).weight) in shared]
    if tied:
        raise ValueError(f"convert_to_elastic: target linears {tied} share their weight with another module (tied)")
    device = source.device if source is not None else model.get_submodule(targets[0]).weight.device
    # Under torchrun, before TrainingArguments made the group:
    # [Note: converting under a launcher creates the process group] in python_api/distributed/launch.py
    if group is None:
        ensure_default_group(device, "convert_to_elastic")
    if source is not None:
        source.check(model, group=group)  # every rank, before anything is read
        # Files that hold a tied pair as different tensors untie it (materialize would do it
        # below): the ties are decided on what will be loaded.
        source.untie_differing(model)
        shared = _shared_params(model)
    embeddings, tied_heads = _embeddings_to_shard(model, policy, set(targets), shared)
    others = [
        n for n, m in model.named_modules()
        if n and is_linear(m) and n not in targets and id(m.weight) not in shared
        and m.weight.numel() * m.weight.element_size() >= policy.replicate_below_bytes
    ]
    chosen = set(targets) | set(others)
    policy = resolve_quant_skip(model, policy, chosen, source)
    if embeddings and policy.weight_format is not None:
        # Never quantized, nor a tied head with them: [Note: embeddings under the runtime]
        skip = tuple(policy.quant_skip_modules or ())
        policy = dataclasses.replace(policy, quant_skip_modules=skip + tuple(e for e in embeddings if e not in skip))
    for name in sorted(chosen):  # before anything is read, sharded or gathered
        m = model.get_submodule(name)
        policy.check_quantizable(name, tuple(m.weight.shape)[::-1] if is_conv1d(m) else m.weight.shape)
    blocked_head = _untied_head_in_blocks(model, policy, others)
    runtime = ElasticRuntime(policy, group=group, device=device)
    model.requires_grad_(False)
    replacements = []
    selection = None if single else AdapterSelection(tuple(adapters))
    units = assign_units(model, sorted(chosen | set(embeddings)), unit_modules)
    block_limit = _block_limit(model, policy, units, set(embeddings) | {blocked_head})
    if source is not None:  # biases and every replicated tensor
        source.materialize(model, skip_modules=chosen | set(embeddings) | set(tied_heads))
    ets = {}  # embedding name -> its elastic tensor (a tied head uses it too)
    for name, module in [(n, m) for n, m in model.named_modules() if n in chosen or n in embeddings]:
        rows = None if source is None else source.rows(f"{name}.weight", transpose=is_conv1d(module))
        if name in embeddings or name == blocked_head:  # [Note: a table in row blocks] in embedding.py
            blocks = _register_blocks(runtime, policy, name, frozen_weight(module), rows, block_limit)
            if name == blocked_head:
                replacements.append((name, ElasticBlocksLinear(blocks, module.bias)))
                continue
            ets[name] = blocks
            if embeddings[name]:
                for et in blocks:  # a lookup kept whole uses each block too: [Note: a lookup reads only its rows]
                    et.uses_per_forward = 2
            replacements.append((name, ElasticEmbedding(blocks, module.padding_idx)))
            continue
        et = runtime.register(frozen_weight(module), name, units[name], rows=rows)
        conv = is_conv1d(module)
        if name not in union:
            new = ElasticLinear(et, module.bias, fan_in_fan_out=conv)
        elif single:
            new = ElasticLoRALinear(et, module.bias, lora, name, fan_in_fan_out=conv)
        else:
            new = ElasticMultiLoRALinear(et, module.bias, {a: c for a, c in adapters.items() if name in targets_of[a]},
                                         name, selection, fan_in_fan_out=conv)
        replacements.append((name, new))
    for name, emb in tied_heads.items():  # the embedding's tensor: one copy ([Note: embeddings under the runtime])
        replacements.append((name, ElasticBlocksLinear(ets[emb], model.get_submodule(name).bias)))
    runtime.finish_registration()
    for name, new in replacements:
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name) if parent_name else model, child, new)
    # With named adapters a parameter may have no gradient on some ranks: [Note: gradients
    # absent on some ranks] in python_api/runtime/_grads.py.
    runtime.set_trainable([p for p in model.parameters() if p.requires_grad], absent_grads=not single)
    object.__setattr__(model, RUNTIME_ATTR, runtime)
    object.__setattr__(model, "_elastic_lora", lora if single else adapters)
    object.__setattr__(model, "_elastic_adapters", adapters)
    if not single:
        object.__setattr__(model, "_elastic_selection", selection)
        model.register_forward_pre_hook(_select_adapters, with_kwargs=True)
        model.register_forward_hook(_end_selection, always_call=True)
    return attach(model)


def _batch_rows(args, kwargs) -> int | None:
    """The batch size of a model call: the leading dimension of input_ids / inputs_embeds
    (or the first positional tensor)."""
    for key in ("input_ids", "inputs_embeds"):
        t = kwargs.get(key)
        if isinstance(t, torch.Tensor) and t.dim() >= 1:
            return t.shape[0]
    if args and isinstance(args[0], torch.Tensor) and args[0].dim() >= 1:
        return args[0].shape[0]
    return None


def _select_adapters(model: nn.Module, args, kwargs):
    """The forward pre-hook of a model with named adapters: takes `adapter_names` out of the
    call, checks it (an agreed error, on every rank before any compute) and sets it for the
    call ([Note: many adapters on one base] in lora.py)."""
    sel: AdapterSelection = model._elastic_selection
    sel.stack.append(sel.current)  # _end_selection restores it, also when this raises
    names = kwargs.pop("adapter_names", None)
    rt = getattr(model, RUNTIME_ATTR, None)
    if rt is None:  # merge_adapters(model, adapter=name) made it a plain model
        if names is not None:
            raise ValueError("adapter_names: the model's adapters were merged (merge_adapters), it has none to "
                             "select; call it without adapter_names")
        return args, kwargs
    if names is None:
        err = None if len(sel.names) == 1 else (
            f"the model has {len(sel.names)} adapters {list(sel.names)}: say which one each row of the batch "
            f"uses with model(..., adapter_names=[...]), one name per row (e.g. adapter_names=[{sel.names[0]!r}] * batch)")
    else:
        err = sel.check(names, _batch_rows(args, kwargs))
    if rt.world_size > 1:
        agree(err, rt.group, what="adapter_names", timeout_s=rt.policy.collective_timeout_s, error_type=ValueError)
    elif err is not None:
        raise ValueError(f"adapter_names: {err}")
    if names is not None:
        sel.current = tuple(sel.index[n] for n in names)
    sel.last = sel.current
    return args, kwargs


def _end_selection(model: nn.Module, args, output):
    sel: AdapterSelection = model._elastic_selection
    if sel.stack:
        sel.current = sel.stack.pop()


def _default_filter(name: str, module: nn.Module) -> bool:
    return isinstance(module, nn.Linear) and not module.weight.requires_grad


def elasticize(model: nn.Module, policy: ElasticPolicy, group=None, should_wrap=None, device=None,
               unit_modules=None) -> nn.Module:
    """Put the frozen `nn.Linear` layers of `model` under one elastic runtime, in place.

    `should_wrap(name, module)` picks the layers (default: every `nn.Linear` whose weight does
    not require grad). `unit_modules` groups the weights gathered together (default: HF
    decoder layers; see `elastic_kernels.api.nn.units.assign_units`). Call it on every rank of `group`
    with the same model and policy.
    Returns the model; `stats(model)`, `reset_stats(model)`, `set_pool_budget(model, b)` reach
    its runtime.
    """
    if getattr(model, RUNTIME_ATTR, None) is not None:
        raise RuntimeError("elasticize: this model is already under an elastic runtime")
    should_wrap = should_wrap or _default_filter
    targets = [(n, m) for n, m in model.named_modules() if n and should_wrap(n, m)]
    if device is None:
        first = next((m.weight.device for _, m in targets), None)
        device = first if first is not None else torch.device("cpu")
    for name, module in targets:
        if not isinstance(module, nn.Linear):
            raise TypeError(f"elasticize: {name} is a {type(module).__name__}, only nn.Linear can be wrapped here")
    policy = resolve_quant_skip(model, policy, [n for n, _ in targets])
    for name, module in targets:  # before anything is sharded or gathered
        policy.check_quantizable(name, module.weight.shape)
    if group is None:  # See [Note: converting under a launcher creates the process group]
        ensure_default_group(device, "elasticize")
    # Build everything (and agree across ranks) before touching the model, so a failure
    # leaves it as it was.
    runtime = ElasticRuntime(policy, group=group, device=device)
    units = assign_units(model, [n for n, _ in targets], unit_modules)
    replacements = [(name, ElasticLinear.from_linear(module, runtime, name, units[name])) for name, module in targets]
    runtime.finish_registration()
    for name, new in replacements:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, new)
    runtime.set_trainable([p for p in model.parameters() if p.requires_grad])
    object.__setattr__(model, RUNTIME_ATTR, runtime)
    return attach(model)


def runtime_of(model: nn.Module) -> ElasticRuntime:
    rt = getattr(model, RUNTIME_ATTR, None)
    if rt is None:
        raise ValueError("this model is not under an elastic runtime (call elasticize / convert_to_elastic first)")
    return rt


def close(model: nn.Module) -> None:
    """Give back the pool, shards and host memory of `model`'s runtime now (idempotent; the
    model cannot run afterwards). Dropping the model frees the same; see [Note: closing a
    runtime] in python_api/runtime/runtime.py."""
    runtime_of(model).close()


def stats(model: nn.Module) -> dict:
    """Cumulative per-rank stats: allgather_bytes, allgather_calls, pool_hits, pool_misses, pool_peak_bytes."""
    return runtime_of(model).stats()


def reset_stats(model: nn.Module) -> None:
    runtime_of(model).reset_stats()


def set_pool_budget(model: nn.Module, budget_bytes: int | None) -> None:
    runtime_of(model).set_pool_budget(budget_bytes)


def no_sync(model: nn.Module):
    """Context manager: backward passes inside it do not average adapter gradients across
    ranks (gradient accumulation; see [Note: gradient accumulation] in python_api/runtime/_grads.py)."""
    return runtime_of(model).no_sync()


def attach(model: nn.Module) -> nn.Module:
    """Install the hooks of a model just put under an elastic runtime (see the module's
    docstring); converting again after `merge_adapters` replaces the previous ones."""
    rt = getattr(model, RUNTIME_ATTR, None)
    if rt is None:
        raise ValueError("attach: the model is not under an elastic runtime")
    previous = getattr(model, _ATTACHED_ATTR, None)
    if previous is not None:
        if previous[0] is rt:
            return model
        previous[1].remove()  # converted again after merge_adapters: a new runtime
    state_dict.install_hooks(model)
    handle = model.register_forward_pre_hook(ddp.pre_forward)
    object.__setattr__(model, _ATTACHED_ATTR, (rt, handle))
    for fn in _CONVERSION_HOOKS:
        fn(model)
    return model
