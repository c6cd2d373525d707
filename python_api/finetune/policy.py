"""What the options make of a run's settings: the elastic policy (policy_of, quant_fields)
and the learning rate (its defaults, resolve_training_defaults, and its schedule, lr_at)."""

from __future__ import annotations

import math

from ..config import ElasticPolicy


def host_fraction_used(args, world_size: int | None, weights_on: str) -> bool:
    """Whether --host-fraction can take anything from the host store: not with the weights on
    host (every chunk comes from there), and not on one rank with the weights on the device
    (nothing is ever missing: the local shard is the whole weight, so no store is built)."""
    return weights_on == "device" and not (world_size == 1) and bool(args.host_fraction)


def policy_of(args, budget, weights_on: str | None = None, world_size: int | None = None):
    weights_on = weights_on or args.weights_on
    return ElasticPolicy(
        chunk_bytes=args.chunk_kib << 10, keep_ratio=args.keep_ratio, persist_ratio=args.persist_ratio,
        pool_budget_bytes=budget if isinstance(budget, int) else None, prefetch_depth=args.prefetch_depth,
        collective_bytes=args.collective_kib << 10, collective_timeout_s=args.timeout_s,
        weights_on=weights_on,
        host_fraction=args.host_fraction if host_fraction_used(args, world_size, weights_on) else None,
        offload_activations=args.offload_activations, host_budget_bytes=args.host_budget,
        **quant_fields(args),
    )


def quant_fields(args) -> dict:
    """ElasticPolicy's weight-format fields from --weight-format / --quant-block / --quant-nested
    (none: today's defaults)."""
    fmt = getattr(args, "weight_format", "none")
    if fmt == "none":
        return {}
    return {"weight_format": fmt, "quant_block_size": args.quant_block, "quant_nested": bool(args.quant_nested)}


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


def lr_at(args, step: int) -> float:
    """The learning rate of optimizer step `step` (0-based): the linear warm-up ((step + 1) /
    warmup of the peak), then --lr-schedule over the remaining steps."""
    warmup = args.warmup_steps or 0
    if warmup and step < warmup:
        return args.lr * (step + 1) / warmup
    schedule = getattr(args, "lr_schedule", None) or "constant"
    if schedule == "constant":
        return args.lr
    progress = (step - warmup) / max(1, args.steps - warmup)
    if schedule == "linear":
        return args.lr * (1.0 - progress)
    return args.lr * 0.5 * (1.0 + math.cos(math.pi * progress))
