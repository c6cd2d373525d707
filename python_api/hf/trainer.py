"""The Hugging Face Trainer on a converted model: `ElasticTrainerMixin` and `ElasticTrainer`.

[Note: what an ElasticTrainer checkpoint holds]
The frozen base weights never change, so writing them into every checkpoint (what the plain
Trainer does through `save_pretrained`) costs their bytes per checkpoint for nothing: 538 MB
beside a 9.8 MB adapter on SmolLM2-135M, about 140 GB per checkpoint at 70B, and a gather of
the whole model on every rank. PEFT under the Trainer saves the adapter only, and so does
`ElasticTrainer`: `save_model` and every `checkpoint-N/` hold `adapter_model.safetensors` +
`adapter_config.json` (PEFT's layout and names, with `task_type` and `base_model_name_or_path`,
so `AutoPeftModelForCausalLM` loads them), the tokenizer when the Trainer has one, and
`training_args.bin`; checkpoints add the Trainer's own optimizer, scheduler, RNG and trainer
state. Adapters are replicated, so the writing rank writes them with no collective. Resuming
loads the adapter into the converted model (the base comes from where the model was loaded);
with the same chunking it is bit for bit the state saved. The full model is written only when
asked: `ElasticTrainer(..., save_full_model=True)` (the base under its original names beside
the adapter, gathered on every rank), or `model.save_pretrained(dir, merged=True)`.

A plain Trainer on several ranks is refused (python_api/hf/guard.py):
[Note: a plain Trainer on several ranks is refused].
"""

from __future__ import annotations

import os

import torch

from ..nn.adapters import ADAPTER_WEIGHTS, adapter_state_dict, load_adapter, write_adapter
from ..nn.embedding import elastic_tensors_of
from ..nn.linear import RUNTIME_ATTR
from ..nn.state_dict import gather_only

# What the Trainer writes as full weights (transformers' WEIGHTS_NAME and friends).
_FULL_WEIGHTS = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin", "pytorch_model.bin.index.json")
_TRAINING_ARGS = "training_args.bin"  # transformers' TRAINING_ARGS_NAME


def _elastic_lora_model(model) -> bool:
    return getattr(model, "_elastic_lora", None) is not None and getattr(model, RUNTIME_ATTR, None) is not None


def _adapter_only(path: str) -> bool:
    """A checkpoint written by ElasticTrainer without the base: adapter files, no full weights."""
    return (os.path.isfile(os.path.join(path, ADAPTER_WEIGHTS))
            and not any(os.path.isfile(os.path.join(path, f)) for f in _FULL_WEIGHTS))


def _check_trl_head(cls, model) -> None:
    """TRL's trainers (1.x) compute the loss with a fused LM head that reads
    `get_output_embeddings().weight` itself; an output layer under the runtime has no whole
    weight to read (its shards live in the runtime), which failed at the first step with
    "'ElasticLinear' object has no attribute 'weight'". Refused when the trainer is built."""
    if model is None or not any(c.__module__.startswith("trl.") for c in cls.__mro__):
        return
    get = getattr(model, "get_output_embeddings", None)
    head = get() if callable(get) else None
    ets = elastic_tensors_of(head) if head is not None else ()
    if ets and not hasattr(head, "weight"):  # ElasticLinear / ElasticLoRALinear / ElasticBlocksLinear
        nbytes = sum(et.layout.rows * et.layout.cols * et.dtype.itemsize for et in ets)
        raise ValueError(
            f"{cls.__name__}: TRL computes the loss with a fused LM head that reads the output layer's weight whole, "
            f"and this model's output layer is under the elastic runtime (sharded, {nbytes} bytes). Keep it "
            f"replicated: convert with ElasticPolicy(replicate_below_bytes > {nbytes}) (also keeps smaller frozen "
            f"linears and embeddings replicated), or, for an output layer tied to the embeddings, "
            f"ElasticPolicy(shard_embeddings=False)")


def _check_no_sharding_plugin(cls, model, args) -> None:
    """Refuse the Trainer's FSDP or DeepSpeed integration (TrainingArguments `fsdp=` /
    `deepspeed=`, or accelerate's FSDP / DeepSpeed plugin chosen by `accelerate launch`) on an
    elastic model: its frozen weights are sharded already, and the adapters' gradients are
    averaged by the runtime; wrapping it again would shard the replicated parameters a second
    time under another engine's rules."""
    if args is None or not _elastic_lora_model(model):
        return
    env = {k for k in ("ACCELERATE_USE_FSDP", "ACCELERATE_USE_DEEPSPEED")
           if os.environ.get(k, "").lower() in ("1", "true", "yes")}
    asked = [what for what, on in (("TrainingArguments(fsdp=...)", bool(getattr(args, "fsdp", None))),
                                   ("TrainingArguments(deepspeed=...)", getattr(args, "deepspeed", None) is not None),
                                   *((f"{k}=true (accelerate launch's plugin)", True) for k in sorted(env)))
             if on]
    if asked:
        raise ValueError(
            f"{cls.__name__}: {', '.join(asked)} on a model converted by elastic_kernels: its frozen weights are "
            f"sharded by the elastic runtime already, and FSDP / DeepSpeed would wrap it a second time. Leave them "
            f"out: under torchrun or accelerate launch (multi-process, no FSDP or DeepSpeed plugin) the runtime "
            f"shards the weights and averages the adapter gradients")


class ElasticTrainerMixin:
    """`class MyTrainer(ElasticTrainerMixin, transformers.Trainer)` (or `ElasticTrainer`;
    TRL: `class ElasticSFTTrainer(ElasticTrainerMixin, SFTTrainer)`).

    - Saving: `save_model` and checkpoints write the adapter only, in PEFT's layout, plus the
      tokenizer and, in checkpoints, the Trainer's optimizer, scheduler, RNG and state ([Note:
      what an ElasticTrainer checkpoint holds]). `save_full_model=True` writes the base weights
      too (gathered on every rank, then written by rank 0).
    - Resuming (`train(resume_from_checkpoint=...)`, `load_best_model_at_end`): loads the
      adapters, which the plain Trainer reads only for PEFT models."""

    _elastic_trainer = True  # read by guard.py: this Trainer may drive a model on several ranks

    def __init__(self, *args, save_full_model: bool = False, **kwargs):
        if not isinstance(save_full_model, bool):
            raise TypeError(f"{type(self).__name__}: save_full_model must be True or False, got {save_full_model!r}")
        self.save_full_model = save_full_model
        model = kwargs.get("model", args[0] if args else None)
        _check_trl_head(type(self), model)
        _check_no_sharding_plugin(type(self), model, kwargs.get("args", args[1] if len(args) > 1 else None))
        super().__init__(*args, **kwargs)

    def _save(self, output_dir=None, state_dict=None):
        model = self.model
        if not _elastic_lora_model(model) or self.save_full_model or state_dict is not None:
            return self._save_full(output_dir, state_dict)
        output_dir = output_dir if output_dir is not None else self.args.output_dir
        if not self.args.should_save:  # adapters are replicated: the writing rank alone writes
            return
        os.makedirs(output_dir, exist_ok=True)
        write_adapter(model, output_dir, adapter_state_dict(model))
        tokenizer = self.processing_class
        if tokenizer is None and getattr(self.data_collator, "tokenizer", None) is not None:
            tokenizer = self.data_collator.tokenizer
        if tokenizer is not None:
            tokenizer.save_pretrained(output_dir)
        torch.save(self.args, os.path.join(output_dir, _TRAINING_ARGS))

    def _save_full(self, output_dir, state_dict):
        """The base weights too: the Trainer calls `_save` on every rank but saves on rank 0
        alone, which cannot gather sharded weights by itself; gather the full state dict on
        every rank first, then let rank 0 write it."""
        rt = getattr(self.model, RUNTIME_ATTR, None)
        if state_dict is None and rt is not None and rt.world_size > 1:
            if self.args.should_save:
                state_dict = self.model.state_dict()  # every rank: a collective
            else:
                with gather_only():  # only the writer holds the whole model
                    self.model.state_dict()
        return super()._save(output_dir, state_dict=state_dict)

    def _load_from_checkpoint(self, resume_from_checkpoint, model=None):
        """An adapter-only checkpoint: load the adapter (the plain Trainer would look for full
        weights). A full one: the Trainer loads model.safetensors (base weights: scattered back
        into the shards by the load hook), then the adapters beside it."""
        target = self.model if model is None else model
        if _elastic_lora_model(target) and _adapter_only(resume_from_checkpoint):
            load_adapter(target, resume_from_checkpoint)
            return
        super()._load_from_checkpoint(resume_from_checkpoint, model=model)
        if _elastic_lora_model(target) and os.path.isfile(os.path.join(resume_from_checkpoint, ADAPTER_WEIGHTS)):
            load_adapter(target, resume_from_checkpoint)

    def _load_best_model(self):
        best = self.state.best_model_checkpoint
        if _elastic_lora_model(self.model) and best is not None and _adapter_only(best):
            load_adapter(self.model, best)
            return
        super()._load_best_model()


__all__ = ["ElasticTrainerMixin"]

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
