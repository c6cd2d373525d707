"""The Hugging Face Trainer on a converted model: `ElasticTrainerMixin` and `ElasticTrainer`."""

from __future__ import annotations

import os

from ..nn.adapters import ADAPTER_WEIGHTS, load_adapter
from ..nn.linear import RUNTIME_ATTR
from ..nn.state_dict import gather_only


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
        rt = getattr(self.model, RUNTIME_ATTR, None)
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
        target = self.model if model is None else model
        if getattr(target, "_elastic_lora", None) is not None and getattr(target, RUNTIME_ATTR, None) is not None \
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
