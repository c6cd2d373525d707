"""Refusing a plain `transformers.Trainer` on a model sharded across ranks.

[Note: a plain Trainer on several ranks is refused]
The plain Trainer saves on rank 0 alone, which cannot gather a sharded model, and would resume
without the adapters; found at the first save, after `save_steps` steps of work and a
collective timeout. So a converted model whose runtime spans several ranks refuses a
`transformers.Trainer` (TRL's trainers included) that is not an `ElasticTrainerMixin`, when
the Trainer is built (it reads `model.is_distributed_loading_by_transformers`) and, should a
version of transformers not read it, at the first training forward: the check walks the
caller's frames for a Trainer instance (what drives the model is known nowhere else), at most
64 of them: 12 us at a depth of 10, 27 us at 64 per training forward on the 2-core VM
(bench/results/2026-12-03_hf.md), on models sharded across ranks only. One process keeps working
with the plain Trainer (rank 0 holds the whole model).
"""

from __future__ import annotations

import sys

import torch

from ..nn.linear import RUNTIME_ATTR

_GUARD_ATTR = "_elastic_trainer_guard"  # the forward pre-hook's handle, once installed


def is_hf_model(model) -> bool:
    """A transformers `PreTrainedModel`, known by its classes (no import of transformers)."""
    return any(c.__name__ == "PreTrainedModel" and c.__module__.startswith("transformers.")
               for c in type(model).__mro__)


def _is_plain_trainer(obj) -> bool:
    if getattr(type(obj), "_elastic_trainer", False):  # ElasticTrainerMixin (trainer.py)
        return False
    return any(c.__name__ == "Trainer" and c.__module__.startswith("transformers.") for c in type(obj).__mro__)


def plain_trainer_on_stack(max_depth: int = 64):
    """The first `transformers.Trainer` (not an ElasticTrainerMixin) found as `self` in the
    caller's frames, or None."""
    frame = sys._getframe(1)
    for _ in range(max_depth):
        if frame is None:
            return None
        obj = frame.f_locals.get("self")
        if obj is not None and _is_plain_trainer(obj):
            return obj
        frame = frame.f_back
    return None


def refuse_plain_trainer(model) -> None:
    """Raise if a plain Trainer drives `model` across several ranks."""
    rt = getattr(model, RUNTIME_ATTR, None)
    if rt is None or rt.world_size <= 1:
        return
    trainer = plain_trainer_on_stack()
    if trainer is not None:
        name = type(trainer).__name__
        fix = ("use elastic_kernels.api.hf.ElasticTrainer instead of Trainer" if type(trainer).__module__.startswith(
            "transformers.") else f"use class Elastic{name}(ElasticTrainerMixin, {name}) instead of {name}, with "
            f"ElasticTrainerMixin from elastic_kernels.api.hf (what ElasticTrainer is for the plain Trainer)")
        raise TypeError(
            f"{name} on a model converted by elastic_kernels across {rt.world_size} ranks: the plain Trainer saves on "
            f"rank 0 alone (which cannot gather the sharded weights) and resumes without the adapters; {fix}")


def _guard_hook(module, args):
    if module.training and torch.is_grad_enabled():
        refuse_plain_trainer(module)


def install_trainer_guard(model) -> None:
    """A conversion hook (python_api/hf/__init__.py): the first-forward half of the refusal,
    on transformers models only, installed once."""
    if is_hf_model(model) and getattr(model, _GUARD_ATTR, None) is None:
        object.__setattr__(model, _GUARD_ATTR, model.register_forward_pre_hook(_guard_hook))
