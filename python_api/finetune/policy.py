"""What the options make of a run's settings: the elastic policy (elastic_policy, format_fields;
policy_of and quant_fields for options held by name) and the learning rate (its defaults,
resolve_training_defaults, and its schedule, lr_at)."""

from __future__ import annotations

import math

from ..config import ElasticPolicy
from .configuration import FinetuneConfig, WeightFormatConfig, config_of


def host_fraction_used(host, world_size: int | None, weights_on: str) -> bool:
    """Whether --host-fraction can take anything from the host store: not with the weights on
    host (every chunk comes from there), and not on one rank with the weights on the device
    (nothing is ever missing: the local shard is the whole weight, so no store is built).
    `host`: the host-tier options (a HostConfig; anything with `host_fraction` reads the same)."""
    return weights_on == "device" and not (world_size == 1) and bool(host.host_fraction)


def elastic_policy(cfg: FinetuneConfig, budget, weights_on: str | None = None,
                   world_size: int | None = None) -> ElasticPolicy:
    """The ElasticPolicy of a run of the job: its elastic, host-tier and weight-format groups,
    at pool budget `budget` (bytes; anything else: the whole pool), with the weights on
    `weights_on` (None: --weights-on) on `world_size` ranks (None: not known here)."""
    e, h = cfg.elastic, cfg.host
    weights_on = weights_on or h.weights_on
    return ElasticPolicy(
        chunk_bytes=e.chunk_kib << 10, keep_ratio=e.keep_ratio, persist_ratio=e.persist_ratio,
        pool_budget_bytes=budget if isinstance(budget, int) else None, prefetch_depth=e.prefetch_depth,
        collective_bytes=e.collective_kib << 10, collective_timeout_s=e.timeout_s,
        weights_on=weights_on,
        host_fraction=h.host_fraction if host_fraction_used(h, world_size, weights_on) else None,
        offload_activations=h.offload_activations, host_budget_bytes=h.host_budget,
        **format_fields(cfg.weights),
    )


def policy_of(options, budget, weights_on: str | None = None, world_size: int | None = None) -> ElasticPolicy:
    """elastic_policy of options held by name (parse_args' namespace or an OptionView), for the
    callers not yet converted to the typed configuration."""
    return elastic_policy(config_of(options), budget, weights_on, world_size)


def format_fields(weights: WeightFormatConfig) -> dict:
    """ElasticPolicy's weight-format fields from --weight-format / --quant-block / --quant-nested
    (none: today's defaults)."""
    if weights.weight_format == "none":
        return {}
    return {"weight_format": weights.weight_format, "quant_block_size": weights.quant_block,
            "quant_nested": bool(weights.quant_nested)}


def quant_fields(options) -> dict:
    """format_fields of options held by name (parse_args' namespace or an OptionView)."""
    return format_fields(config_of(options).weights)


# [Note: learning-rate defaults]
# A pretrained model is fine-tuned with LoRA the way PEFT's and TRL's examples do it: a peak
# of 2e-4, a linear warm-up over the first tenth of the steps, cosine decay to 0 at the last
# step (on the real model 2e-3 memorised 96 records in 8 steps: the held-out loss rose). The
# tiny random model keeps what its figures were measured with: 2e-3, constant, no warm-up
# (its random weights need the larger steps to show a curve in a few steps). Every value is
# resolved before the run configuration is built, so checkpoints and the report name them.

def training_defaults(training, pretrained: bool) -> dict:
    """--lr, --lr-schedule and --warmup-steps of `training` (the training options: a
    TrainingConfig or parse_args' namespace) with the defaults filled in where they were not
    given ([Note: learning-rate defaults])."""
    return {"lr": (2e-4 if pretrained else 2e-3) if training.lr is None else training.lr,
            "lr_schedule": ("cosine" if pretrained else "constant") if training.lr_schedule is None
            else training.lr_schedule,
            "warmup_steps": (-(-training.steps // 10) if pretrained else 0) if training.warmup_steps is None
            else training.warmup_steps}


def resolve_training_defaults(args, pretrained: bool) -> None:
    """training_defaults set on parse_args' namespace (prepare() replaces them in the job's
    configuration instead)."""
    for k, v in training_defaults(args, pretrained).items():
        setattr(args, k, v)


def lr_at(training, step: int) -> float:
    """The learning rate of optimizer step `step` (0-based): the linear warm-up ((step + 1) /
    warmup of the peak), then --lr-schedule over the remaining steps. `training`: the training
    options (a TrainingConfig, as the loop passes; parse_args' namespace reads the same)."""
    warmup = training.warmup_steps or 0
    if warmup and step < warmup:
        return training.lr * (step + 1) / warmup
    schedule = getattr(training, "lr_schedule", None) or "constant"
    if schedule == "constant":
        return training.lr
    progress = (step - warmup) / max(1, training.steps - warmup)
    if schedule == "linear":
        return training.lr * (1.0 - progress)
    return training.lr * 0.5 * (1.0 + math.cos(math.pi * progress))
