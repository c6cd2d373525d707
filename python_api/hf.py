"""Saving, loading and DDP for converted models: full state dicts, `save_pretrained`, the Trainer.

`convert_to_elastic` and `elasticize` call `attach(model)`, which installs:
- on every elastic layer, a state-dict post-hook that puts the *whole* frozen weight under its
  original name (`<layer>.weight`, gathered with `ElasticRuntime.full_weight`), and a
  load pre-hook that takes this rank's shard back out of such a full weight;
- on the root module, a forward pre-hook that hands gradient averaging to DDP while the model
  runs inside `DistributedDataParallel` (see [Note: DDP and the runtime's all-reduce]);
- on a `transformers.PreTrainedModel`, a class swap (as FSDP2's `fully_shard` does) adding
  `save_pretrained(..., merged=False)` and a `num_parameters()` that counts the elastic weights.

[Note: the full state dict is a collective]
Every rank holds 1/W of each frozen weight, so `model.state_dict()` all-gathers each weight in
turn (like FSDP's FULL_STATE_DICT) and must be called on every rank of the runtime's group, in
the same order. Gathered weights are moved to the CPU one by one (FSDP's offload_to_cpu), so
the device never holds more than one extra weight. Before each gather the ranks meet in the
process group's store, not in a collective: a rank that calls `state_dict()` alone (rank 0 of
a Trainer on several ranks, say) fails with a clear message after
`ElasticPolicy.collective_timeout_s` instead of hanging, and no collective is left half-issued.
Exports meet by their order number (a rank's n-th weight export pairs with the others' n-th;
a rank that gave up takes its arrival back), so they must be made alike on every rank, as
collectives must.
`load_state_dict` of a full state dict is local: every rank cuts its shard out of the full
weight with the tensor's layout and drops the pool's cached chunks of it (they would be stale).

[Note: what save_pretrained writes]
`save_pretrained(dir)` on a converted model writes what a plain HF model plus a PEFT adapter
would: `config.json` and `model.safetensors` with the base weights under their original names
(no LoRA keys), and `adapter_config.json` + `adapter_model.safetensors` with the adapters under
PEFT's names. Measured with transformers 5.23 / peft 0.21 (tests/test_hf_save.py):
`AutoModelForCausalLM.from_pretrained(dir)` loads the base and, through transformers' PEFT
integration, attaches the adapter found beside it (same logits as the trained model), and
`PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(dir), dir)` gives the same
logits too (PEFT warns that the model already carries an adapter). `merged=True` writes
W + s·B·A instead and no adapter files: a plain checkpoint for tools that know nothing of PEFT.

[Note: DDP and the runtime's all-reduce]
The runtime averages adapter gradients itself (`ElasticPolicy.all_reduce_grads`). Wrapped in
DDP (the HF Trainer does it on several ranks), DDP averages them too: right numbers, twice the
traffic. DDP cannot be told to ignore the adapters instead: a module with nothing left to
reduce is refused ("DistributedDataParallel is not needed when a module doesn't have any
parameter that requires a gradient", torch 2.14). So DDP keeps the reduction (it buckets and
overlaps it with backward, and honours its own `no_sync`, which accelerate uses for gradient
accumulation), and the runtime's is switched off for every forward run inside a DDP that
reduces all of the model's trainable parameters, and back to the policy's own setting for a
forward run outside DDP. Setting `ElasticPolicy(all_reduce_grads=False)` yourself does the same
for any other data-parallel wrapper.
"""

from __future__ import annotations

import datetime
import json
import logging
import math
import os
from contextlib import contextmanager

import torch
import torch.distributed as dist
import torch.nn as nn

from python_api.runtime import ElasticRuntime, ElasticTensor

logger = logging.getLogger(__name__)

_RUNTIME_ATTR = "_elastic_runtime"  # same name as python_api.elastic_linear._RUNTIME_ATTR
_ATTACHED_ATTR = "_elastic_hf_attached"


def _runtime(model: nn.Module) -> ElasticRuntime | None:
    return getattr(model, _RUNTIME_ATTR, None)


def _is_elastic_layer(module: nn.Module) -> bool:
    return isinstance(getattr(module, "et", None), ElasticTensor)


# ---------------------------------------------------------------------------- rank agreement

_rendezvous_counts: dict[tuple, int] = {}


def _store():
    try:
        return dist.distributed_c10d._get_default_store()
    except (AttributeError, RuntimeError, ValueError):
        return None


def _rendezvous(rt: ElasticRuntime, what: str) -> None:
    """Wait until every rank of the runtime's group has reached this point (the n-th export
    call of this process on this group), or raise after `collective_timeout_s`. Uses the
    store only: a rank that is alone never leaves a collective half-issued.
    See [Note: the full state dict is a collective]."""
    if rt.world_size == 1:
        return
    store = _store()
    if store is None:  # no store to meet in: the collective itself will have to do
        return
    ranks = tuple(dist.get_process_group_ranks(rt.group))
    n = _rendezvous_counts.get(ranks, 0)
    _rendezvous_counts[ranks] = n + 1
    prefix = f"elastic_kernels/export/{'-'.join(map(str, ranks))}/{n}"
    mine = f"{prefix}/{rt.rank}"
    store.set(mine, b"1")
    keys = [f"{prefix}/{r}" for r in range(rt.world_size)]
    timeout = rt.policy.collective_timeout_s
    try:
        if timeout is None:
            store.wait(keys)
        else:
            store.wait(keys, datetime.timedelta(seconds=timeout))
    except RuntimeError as exc:
        missing = [r for r, k in enumerate(keys) if not store.check([k])]
        # Undo this arrival so that the ranks' counts stay equal: the next export on every
        # rank meets at this same n again.
        _rendezvous_counts[ranks] = n
        try:
            store.delete_key(mine)
        except RuntimeError:
            pass
        raise RuntimeError(
            f"elastic: {what} is a collective (every frozen weight is sharded across the "
            f"{rt.world_size} ranks), but ranks {missing} did not call it within "
            f"{timeout} s (ElasticPolicy.collective_timeout_s). Call state_dict()/save_pretrained() "
            "on every rank. With transformers.Trainer on several ranks only rank 0 saves: use "
            "python_api.hf.ElasticTrainer (or ElasticTrainerMixin), which gathers on every rank first."
        ) from exc


def rank0_then_agree(rt: ElasticRuntime, fn, what: str) -> None:
    """Run `fn()` on rank 0 of the runtime's group, then make every rank raise the same error if
    it failed (a broadcast of the error text), instead of leaving the others in a barrier."""
    error = None
    if rt.rank == 0:
        try:
            fn()
        except Exception as exc:  # noqa: BLE001 - re-raised below, on every rank
            error = exc
    if rt.world_size > 1:
        box = [None if error is None else f"{type(error).__name__}: {error}"]
        dist.broadcast_object_list(box, src=dist.get_global_rank(rt.group, 0), group=rt.group)
        message = box[0]
    else:
        message = None if error is None else f"{type(error).__name__}: {error}"
    if message is not None:
        raise RuntimeError(f"{what} failed on rank 0: {message}") from error


# ---------------------------------------------------------------------------- state dict hooks


_gather_only = False  # set by gather_only(): take part in the gathers, keep nothing


@contextmanager
def gather_only():
    """`state_dict()` inside this context joins every gather but keeps no gathered weight (they
    are left out of the returned dict): for the ranks that do not write, so that only the
    writer ever holds the whole model in host memory."""
    global _gather_only
    previous, _gather_only = _gather_only, True
    try:
        yield
    finally:
        _gather_only = previous


def _state_dict_post_hook(module: nn.Module, state_dict: dict, prefix: str, local_metadata) -> None:
    et: ElasticTensor = module.et
    rt = et.runtime
    _rendezvous(rt, f"state_dict() ({et.name})")
    weight = rt.full_weight(et)
    if _gather_only:
        return
    if getattr(module, "fan_in_fan_out", False):
        weight = weight.t().contiguous()  # Conv1D stores [in, out]; the runtime holds [out, in]
    if weight.device.type != "cpu":
        weight = weight.cpu()  # one weight at a time on the device: see [Note: the full state dict is a collective]
    # This module's keys are the last ones (its subtree was just saved): re-add them after the
    # weight so the order is nn.Linear's (weight, bias, then the adapters).
    own = {k: state_dict.pop(k) for k in [k for k in state_dict if k.startswith(prefix)]}
    state_dict[prefix + "weight"] = weight
    state_dict.update(own)


def _load_state_dict_pre_hook(
    module: nn.Module, state_dict: dict, prefix: str, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
) -> None:
    key = prefix + "weight"
    if key not in state_dict:
        if strict:
            missing_keys.append(key)
        return
    full = state_dict.pop(key)  # not a Parameter of this module: it would count as unexpected
    et: ElasticTensor = module.et
    conv1d = getattr(module, "fan_in_fan_out", False)  # Conv1D saves [in, out]; the runtime holds [out, in]
    expected = et.shape[::-1] if conv1d else et.shape
    if tuple(full.shape) != expected:
        error_msgs.append(
            f"size mismatch for {key}: copying a param with shape {tuple(full.shape)} from checkpoint, "
            f"the shape in current model is {torch.Size(expected)}."
        )
        return
    load_full_weight(et, full.t() if conv1d else full)


def load_full_weight(et: ElasticTensor, full: torch.Tensor) -> None:
    """Replace the frozen weight of `et` by `full` (its whole value, on every rank): each rank
    keeps its own shard; cached chunks of the old value are dropped from the pool. Local (no
    collective); not while a forward or backward is using the weight."""
    rt = et.runtime
    try:
        rt.drop_cached(et)  # before the copy: a weight in use is refused with nothing changed
    except RuntimeError as exc:
        raise RuntimeError(f"load_state_dict: {exc}") from None
    with torch.no_grad():
        full = full.detach().to(et.dtype)
        if et.shard is not None:
            shard = et.layout.shard(full, rt.rank)  # cut where the source lives
            et.shard.copy_(shard)  # in place: world size 1 keeps chunk views of the shard
        if et.store_offset is not None:
            # Every local rank writes the same bytes into the node's store ([Note: chunk sources]).
            rt.host_store.view(et.store_offset, et.dtype, (et.layout.rows, et.layout.cols)).copy_(
                full.reshape(et.layout.rows, et.layout.cols))


# ---------------------------------------------------------------------------- DDP


def _ddp_reduces_all(ddp, model: nn.Module) -> bool:
    ignored = getattr(ddp, "parameters_to_ignore", set())
    reduced = {
        id(p) for n, p in ddp.module.named_parameters()
        if n not in ignored and p.requires_grad and not getattr(p, "_ddp_ignored", False)
    }
    trainable = [p for p in model.parameters() if p.requires_grad]
    return bool(trainable) and all(id(p) in reduced for p in trainable)


def _ddp_pre_forward(model: nn.Module, args) -> None:
    """See [Note: DDP and the runtime's all-reduce]."""
    rt = _runtime(model)
    if rt is None or rt.world_size == 1:
        return
    from torch.nn.parallel import DistributedDataParallel

    ddp = DistributedDataParallel._get_active_ddp_module()
    under_ddp = False
    if ddp is not None:
        cache = ddp.__dict__.setdefault("_elastic_reduces_all", {})
        if id(model) not in cache:
            cache[id(model)] = _ddp_reduces_all(ddp, model)
            if cache[id(model)]:
                logger.info("elastic: the model runs under DDP, which averages the adapter gradients; "
                            "the runtime's own all-reduce is off while it does")
            else:
                logger.warning("elastic: the model runs under a DDP that ignores some of its trainable "
                               "parameters; the runtime keeps averaging all of them, so the others are "
                               "reduced twice (set ElasticPolicy(all_reduce_grads=False) to leave them to DDP)")
        under_ddp = cache[id(model)]
    rt.set_grad_reduction(False if under_ddp else None)


# ---------------------------------------------------------------------------- transformers


def _is_hf_model(model: nn.Module) -> bool:
    return any(c.__name__ == "PreTrainedModel" and c.__module__.startswith("transformers.")
               for c in type(model).__mro__)


def split_state_dict(model: nn.Module, state_dict: dict) -> tuple[dict, dict]:
    """(base, adapters): the base weights under their original names, and the LoRA adapters
    under PEFT's saved names (`base_model.model.<layer>.lora_A.weight`)."""
    from python_api.lora import _PEFT_PREFIX, ElasticLoRALinear

    lora_names = {n for n, m in model.named_modules() if isinstance(m, ElasticLoRALinear)}
    base, adapters = {}, {}
    for key, value in state_dict.items():
        layer, _, rest = key.rpartition(".lora_")
        if layer in lora_names and rest in ("A.weight", "B.weight"):
            adapters[f"{_PEFT_PREFIX}{key}"] = value
        else:
            base[key] = value
    return base, adapters


def _merge_into(model: nn.Module, base: dict, adapters: dict) -> dict:
    """base with W + s·B·A for every LoRA layer (computed in float64, stored in W's dtype)."""
    from python_api.lora import _PEFT_PREFIX, ElasticLoRALinear

    out = dict(base)
    for name, layer in model.named_modules():
        if isinstance(layer, ElasticLoRALinear):
            a = adapters[f"{_PEFT_PREFIX}{name}.lora_A.weight"].double().cpu()
            b = adapters[f"{_PEFT_PREFIX}{name}.lora_B.weight"].double().cpu()
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

    from python_api.lora import ADAPTER_CONFIG, ADAPTER_WEIGHTS, _atomic_write, _lora_layers, _peft_config

    os.makedirs(path, exist_ok=True)
    tensors = {k: v.detach().cpu().contiguous() for k, v in adapters.items()}
    _atomic_write(os.path.join(path, ADAPTER_WEIGHTS), lambda p: save_file(tensors, p, metadata={"format": "pt"}))
    layers = _lora_layers(model)
    fan_in_fan_out = any(getattr(m, "fan_in_fan_out", False) for _, m in layers)  # Conv1D layers
    config = _peft_config(model._elastic_lora, [n for n, _ in layers], *([True] if fan_in_fan_out else []))
    _atomic_write(
        os.path.join(path, ADAPTER_CONFIG),
        lambda p: open(p, "w").write(json.dumps(config, indent=2, sort_keys=True) + "\n"),
    )


class ElasticPreTrainedMixin:
    """Put before a `transformers.PreTrainedModel` class by `attach` (class swap); every method
    falls back to the plain one once the runtime is gone (after `merge_adapters`)."""

    def num_parameters(self, only_trainable: bool = False, exclude_embeddings: bool = False) -> int:
        """`PreTrainedModel.num_parameters` plus the frozen elastic weights (not Parameters)."""
        n = super().num_parameters(only_trainable=only_trainable, exclude_embeddings=exclude_embeddings)
        rt = _runtime(self)
        if rt is not None and not only_trainable:
            n += sum(math.prod(et.shape) for et in rt.tensors)
        return n

    def save_pretrained(self, save_directory, *args, state_dict: dict | None = None, is_main_process: bool = True,
                        merged: bool = False, **kwargs):
        """See [Note: what save_pretrained writes]. Without `state_dict`, a collective: call it
        on every rank (rank 0 writes; every rank raises if writing failed). With `state_dict`
        (a full one, as the Trainer passes) it runs on the writing rank alone."""
        rt = _runtime(self)
        if rt is None:
            return super().save_pretrained(save_directory, *args, state_dict=state_dict,
                                           is_main_process=is_main_process, **kwargs)
        what = f"save_pretrained({str(save_directory)!r})"
        if state_dict is None:  # a collective: every rank gathers, rank 0 writes
            if rt.rank != 0:
                with gather_only():  # this rank writes nothing: keep no gathered weight
                    self.state_dict()
                rank0_then_agree(rt, lambda: None, what)
                return
            state_dict = self.state_dict()
            collective = True
        else:
            collective = False

        def write():
            base, adapters = split_state_dict(self, state_dict)
            if merged:
                base = _merge_into(self, base, adapters)
            super(ElasticPreTrainedMixin, self).save_pretrained(
                save_directory, *args, state_dict=base, is_main_process=True, **kwargs)
            if adapters and not merged:
                write_adapter(self, str(save_directory), adapters)

        if collective:
            rank0_then_agree(rt, write if is_main_process else (lambda: None), what)
        elif is_main_process:
            write()


_swapped: dict[type, type] = {}


def _swap_class(model: nn.Module) -> None:
    cls = type(model)
    if issubclass(cls, ElasticPreTrainedMixin):
        return
    if cls not in _swapped:
        # Same name, qualname and module: save_pretrained records config.architectures from
        # the class name, which must stay the model's own.
        _swapped[cls] = type(cls.__name__, (ElasticPreTrainedMixin, cls),
                             {"__module__": cls.__module__, "__qualname__": cls.__qualname__})
    model.__class__ = _swapped[cls]


def attach(model: nn.Module) -> nn.Module:
    """Install the hooks of this module on a model just put under an elastic runtime."""
    rt = _runtime(model)
    if rt is None:
        raise ValueError("attach: the model is not under an elastic runtime")
    previous = getattr(model, _ATTACHED_ATTR, None)  # (runtime, forward pre-hook handle)
    if previous is not None:
        if previous[0] is rt:
            return model
        previous[1].remove()  # converted again after merge_adapters: a new runtime
    for module in model.modules():
        if _is_elastic_layer(module):
            module.register_state_dict_post_hook(_state_dict_post_hook)
            module.register_load_state_dict_pre_hook(_load_state_dict_pre_hook)
    handle = model.register_forward_pre_hook(_ddp_pre_forward)
    if _is_hf_model(model):
        _swap_class(model)
    object.__setattr__(model, _ATTACHED_ATTR, (rt, handle))
    return model


# ---------------------------------------------------------------------------- the Trainer


class ElasticTrainerMixin:
    """`class MyTrainer(ElasticTrainerMixin, transformers.Trainer)` (or `ElasticTrainer`).

    - Saving: the Trainer calls `_save` on every rank but saves on rank 0 alone, which cannot
      gather sharded weights by itself; this gathers the full state dict on every rank first,
      then lets rank 0 write it (the plain Trainer fails on rank 0 after
      `collective_timeout_s` with a message pointing here; on one process it works as is).
    - Resuming (`train(resume_from_checkpoint=...)`): also loads the adapters, which the plain
      Trainer reads only for PEFT models (it would restore the base weights and leave the
      adapters as initialised, with a missing-keys warning)."""

    def _save(self, output_dir=None, state_dict=None):
        rt = _runtime(self.model)
        if state_dict is None and rt is not None and rt.world_size > 1:
            if self.args.should_save:
                state_dict = self.model.state_dict()  # every rank: a collective
            else:
                with gather_only():  # only the writer holds the whole model
                    self.model.state_dict()
        return super()._save(output_dir, state_dict=state_dict)

    def _load_from_checkpoint(self, resume_from_checkpoint, model=None):
        """The Trainer loads model.safetensors (base weights: scattered back into the shards by
        the load hook); the adapters sit beside it in PEFT's format, which the plain Trainer
        reads only for PEFT models: load them too."""
        super()._load_from_checkpoint(resume_from_checkpoint, model=model)
        from python_api.lora import ADAPTER_WEIGHTS, load_adapter

        target = self.model if model is None else model
        if getattr(target, "_elastic_lora", None) is not None and _runtime(target) is not None \
                and os.path.isfile(os.path.join(resume_from_checkpoint, ADAPTER_WEIGHTS)):
            load_adapter(target, resume_from_checkpoint)


_trainer_class = None


def __getattr__(name):
    # ElasticTrainer = ElasticTrainerMixin + transformers.Trainer, built on first use so that
    # importing this module does not import transformers.
    global _trainer_class
    if name == "ElasticTrainer":
        if _trainer_class is None:
            from transformers import Trainer

            _trainer_class = type("ElasticTrainer", (ElasticTrainerMixin, Trainer), {"__module__": __name__})
        return _trainer_class
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
