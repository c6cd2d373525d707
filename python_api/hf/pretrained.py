"""The transformers integration of converted models: a class swap (as FSDP2's `fully_shard`
does) adding `save_pretrained(..., merged=False)` and a `num_parameters()` that counts the
elastic weights. Registered as a conversion hook by python_api/hf/__init__.py.

[Note: what save_pretrained writes]
`save_pretrained(dir)` on a converted model writes what a plain HF model plus a PEFT adapter
would: `config.json` and `model.safetensors` with the base weights under their original names
(no LoRA keys), and `adapter_config.json` + `adapter_model.safetensors` with the adapters under
PEFT's names. Measured with transformers 5.23 / peft 0.21 (tests/hf/test_hf_save.py):
`AutoModelForCausalLM.from_pretrained(dir)` loads the base and, through transformers' PEFT
integration, attaches the adapter found beside it (same logits as the trained model), and
`PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(dir), dir)` gives the same
logits too (PEFT warns that the model already carries an adapter). `merged=True` writes
W + s·B·A instead and no adapter files: a plain checkpoint for tools that know nothing of PEFT.
"""

from __future__ import annotations

import math

import torch.nn as nn

from ..distributed.agree import rank0_then_agree
from ..nn.adapters import merge_into, split_state_dict, write_adapter
from ..nn.embedding import ElasticEmbedding
from ..nn.linear import RUNTIME_ATTR
from ..nn.state_dict import gather_only
from .guard import is_hf_model, refuse_plain_trainer


class ElasticPreTrainedMixin:
    """Put before a `transformers.PreTrainedModel` class by `attach` (class swap); every method
    falls back to the plain one once the runtime is gone (after `merge_adapters`)."""

    def num_parameters(self, only_trainable: bool = False, exclude_embeddings: bool = False) -> int:
        """`PreTrainedModel.num_parameters` plus the frozen elastic weights (not Parameters)."""
        n = super().num_parameters(only_trainable=only_trainable, exclude_embeddings=exclude_embeddings)
        rt = getattr(self, RUNTIME_ATTR, None)
        if rt is not None and not only_trainable:
            # exclude_embeddings: transformers leaves out the nn.Embedding tables (and a head
            # tied to one: the same Parameter); an ElasticEmbedding's table is its tensor.
            skip = {et.wid for m in self.modules() if isinstance(m, ElasticEmbedding)
                    for et in m.ets} if exclude_embeddings else set()
            n += sum(math.prod(et.shape) for et in rt.tensors if et.wid not in skip)
        return n

    @property
    def is_distributed_loading_by_transformers(self) -> bool:
        """transformers' own flag (False for a converted model: transformers did not shard it);
        read by `Trainer.__init__`, where a plain Trainer on several ranks is refused ([Note: a
        plain Trainer on several ranks is refused] in python_api/hf/guard.py)."""
        refuse_plain_trainer(self)
        return super().is_distributed_loading_by_transformers

    def save_pretrained(self, save_directory, *args, state_dict: dict | None = None, is_main_process: bool = True,
                        merged: bool = False, **kwargs):
        """See [Note: what save_pretrained writes]. Without `state_dict`, a collective: call it
        on every rank (rank 0 writes; every rank raises if writing failed). With `state_dict`
        (a full one, as the Trainer passes) it runs on the writing rank alone."""
        rt = getattr(self, RUNTIME_ATTR, None)
        if rt is None:
            return super().save_pretrained(save_directory, *args, state_dict=state_dict,
                                           is_main_process=is_main_process, **kwargs)
        what = f"save_pretrained({str(save_directory)!r})"
        if state_dict is None:  # a collective: every rank gathers, rank 0 writes
            if rt.rank != 0:
                with gather_only():  # this rank writes nothing: keep no gathered weight
                    self.state_dict()
                rank0_then_agree(lambda: None, rt.group, what=what)
                return
            state_dict = self.state_dict()
            collective = True
        else:
            collective = False

        def write():
            base, adapters = split_state_dict(self, state_dict)
            if merged:
                base = merge_into(self, base, adapters)
            super(ElasticPreTrainedMixin, self).save_pretrained(
                save_directory, *args, state_dict=base, is_main_process=True, **kwargs)
            if adapters and not merged:
                write_adapter(self, str(save_directory), adapters)

        if collective:
            rank0_then_agree(write if is_main_process else (lambda: None), rt.group, what=what)
        elif is_main_process:
            write()


_swapped: dict[type, type] = {}


def swap_class_of_hf_model(model: nn.Module) -> None:
    """Give a converted transformers `PreTrainedModel` the methods of `ElasticPreTrainedMixin`
    (a conversion hook; other models are left alone)."""
    if not is_hf_model(model):
        return
    cls = type(model)
    if issubclass(cls, ElasticPreTrainedMixin):
        return
    if cls not in _swapped:
        # Same name, qualname and module: save_pretrained records config.architectures from
        # the class name, which must stay the model's own.
        _swapped[cls] = type(cls.__name__, (ElasticPreTrainedMixin, cls),
                             {"__module__": cls.__module__, "__qualname__": cls.__qualname__})
    model.__class__ = _swapped[cls]
