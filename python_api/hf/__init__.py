"""The transformers integration, on top of elastic_kernels.api.nn (nothing in nn/ imports it):

  pretrained.py  the class swap of a converted `PreTrainedModel`: save_pretrained(merged=...),
                 num_parameters (registered below as a conversion hook, so every conversion
                 of an HF model gets it)
  trainer.py     ElasticTrainerMixin and ElasticTrainer (the Trainer saving adapter-only
                 checkpoints and resuming from them, on one rank or several)
  guard.py       a plain Trainer on a model sharded across ranks refused before step 1

`ElasticTrainer` is built on first use, so importing this package does not import transformers.
"""

from ..nn.convert import register_conversion_hook
from . import trainer
from .guard import install_trainer_guard
from .pretrained import ElasticPreTrainedMixin, swap_class_of_hf_model
from .trainer import ElasticTrainerMixin

register_conversion_hook(swap_class_of_hf_model)
register_conversion_hook(install_trainer_guard)

__all__ = ["ElasticPreTrainedMixin", "ElasticTrainer", "ElasticTrainerMixin"]


def __getattr__(name):
    if name == "ElasticTrainer":  # built by trainer.py on first use
        return trainer.ElasticTrainer
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
