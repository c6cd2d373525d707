"""The options checked together: check_options, the rules between options that parse_args
applies (an option error before anything runs), and ignored_options, the options a run of
this job ignores (a warning each)."""

from __future__ import annotations

import argparse
import math

from ..config import ElasticPolicy
from .option_values import DS_OPTIONS, SWEEP_KEYS, _baselines, _budget, _compare_formats, budget_label, fmt_bytes
from .policy import host_fraction_used


def check_options(p: argparse.ArgumentParser, args) -> None:
    """The values of the options that list several (--compare-budgets, --baseline, --compare-format,
    --lora-targets) into lists, and the rules between options: a rule broken is an option
    error (`p.error`: the usage and one line, exit 2), before anything runs."""
    try:
        args.compare_budgets = [_budget(b) for b in args.compare_budgets.split(",") if b.strip()]
    except argparse.ArgumentTypeError as exc:
        p.error(f"argument --compare-budgets: {exc}")
    labels = [budget_label(b) for b in args.compare_budgets]  # 0 and 0B, 50% and 50.0% are one budget
    twice = sorted({b for b in labels if labels.count(b) > 1})
    if twice:
        p.error(f"argument --compare-budgets: budget(s) {twice} given twice (each would train the same run)")
    if budget_label(args.pool_budget) in labels:
        p.error(f"argument --compare-budgets: {budget_label(args.pool_budget)} is the main run's budget (--pool-budget "
                f"{budget_label(args.pool_budget)}, all when not given)")
    try:
        args.baselines = _baselines(args.baseline)
    except argparse.ArgumentTypeError as exc:
        p.error(f"argument --baseline: {exc}")
    args.baseline = ",".join(args.baselines) or "none"
    ds_given = [f"--{k.replace('_', '-')}" for k in DS_OPTIONS if getattr(args, k) is not None and getattr(args, k) is not False]
    if ds_given and "deepspeed" not in args.baselines:
        p.error(f"{', '.join(ds_given)}: DeepSpeed options need --baseline deepspeed")
    if args.fsdp2_reshard is not None and "fsdp2" not in args.baselines:
        p.error("--fsdp2-reshard: needs --baseline fsdp2")
    if not 0.0 <= args.lora_dropout < 1.0:
        p.error(f"argument --lora-dropout: expected a number in [0, 1), got {args.lora_dropout}")
    if not 0 <= args.weight_decay < math.inf:
        p.error(f"argument --weight-decay: expected a finite number >= 0, got {args.weight_decay}")
    if args.keep_ratio < args.persist_ratio:
        p.error(f"--keep-ratio ({args.keep_ratio}) must be >= --persist-ratio ({args.persist_ratio})")
    if args.weights_on == "host" and args.host_fraction not in (None, 1.0):
        p.error(f"--host-fraction {args.host_fraction}: with --weights-on host every chunk comes from the host store "
                "(there is no device shard to gather from); leave --host-fraction out or set it to 1")
    try:
        args.compare_formats = _compare_formats(args.compare_format, args.weight_format)
    except argparse.ArgumentTypeError as exc:
        p.error(f"argument --compare-format: {exc}")
    if args.weight_format == "none":
        if (args.quant_block is not None or args.quant_nested) and not set(args.compare_formats) - {"none"}:
            p.error("--quant-block / --quant-nested need --weight-format nf4 or int8 (or --compare-format nf4 / int8)")
    else:
        if args.quant_block is not None and args.quant_block & (args.quant_block - 1):
            p.error(f"argument --quant-block: expected a power of two in [32, 4096], got {args.quant_block}")
        if args.quant_nested and args.weight_format != "nf4":
            p.error("--quant-nested is an nf4 option (double quantization of its scales)")
    _check_compare_formats(p, args)
    _check_sweep(p, args)
    if args.host_budget is not None and 0 < args.host_budget < 512:
        p.error(f"argument --host-budget: {args.host_budget} bytes is less than one 512-byte page")
    steps = [s for s, _ in args.memory_cap_change]
    if len(set(steps)) != len(steps):
        p.error(f"--memory-cap-change: step(s) {sorted({s for s in steps if steps.count(s) > 1})} given twice")
    if args.memory_cap_change and args.plan != "auto" and not args.compare_planned:
        p.error("--memory-cap-change needs --plan auto or --compare-planned (only a planned run adapts)")
    if args.pp == "auto" and args.plan != "auto":
        p.error("--pp auto needs --plan auto (the planner chooses the pipeline degree)")
    pipelined = args.pp == "auto" or args.pp > 1 or args.compare_pp is not None
    if pipelined:
        if args.pool_budget is not None or args.keep_ratio != 1.0 or args.persist_ratio != 1.0:
            p.error("--pool-budget / --keep-ratio / --persist-ratio do not apply to a pipelined run (--pp > 1, "
                    "--compare-pp): a pack's residency is --pack-residency")
        if args.offload_activations or (args.host_fraction not in (None, 0.0, 1.0)):
            p.error("--offload-activations and a partial --host-fraction are not supported with --pp > 1 / "
                    "--compare-pp (whole packs come from the host store with --weights-on host)")
        if args.compare_pp is not None and args.compare_pp < 2:
            p.error("--compare-pp must be at least 2 (a pipelined comparison)")
    elif any(getattr(args, k) != d for k, d in (("pack_size", "auto"), ("schedule", "1f1b"), ("micro_batches", None),
                                                 ("pack_residency", "step"), ("pack_window", 1))):
        p.error("--pack-size, --schedule, --micro-batches, --pack-residency and --pack-window need --pp > 1 "
                "or --compare-pp")
    targets = args.lora_targets.strip()
    if targets != "all-linear":
        names = [t.strip() for t in targets.split(",")]
        if not names or not all(names):
            p.error(f"argument --lora-targets: expected comma-separated module names or all-linear, got {args.lora_targets!r}")
        args.lora_targets = ",".join(names)


def _check_sweep(p: argparse.ArgumentParser, args) -> None:
    """--sweep's items as ((key, values), ...) in the order given, and what a sweep job cannot
    serve, refused rather than run as something else ([Note: a sweep job] in sweep.py)."""
    given = getattr(args, "_given", set())
    keys = [k for k, _ in args.sweep]
    twice = sorted({k for k in keys if keys.count(k) > 1})
    if twice:
        p.error(f"argument --sweep: key(s) {', '.join(twice)} given twice (give each key once, with all its values)")
    args.sweep = [[k, list(v)] for k, v in args.sweep]
    if not args.sweep:
        if args.compare_sequential:
            p.error("--compare-sequential needs --sweep (it compares a sweep with its adapters trained one by one)")
        return
    for key in keys:  # seed is not --seed's whole meaning in a sweep: the adapter's initialization only
        dest = SWEEP_KEYS[key][2][2:].replace("-", "_")
        if key == "seed":
            continue
        if dest in given:
            p.error(f"{SWEEP_KEYS[key][2]} and --sweep {key}=... both set {key}: give it once")
    refused = [(args.pp != 1, "--pp (a sweep is one elastic model on every rank)"),
               (args.compare_pp is not None, "--compare-pp"),
               (args.plan == "auto", "--plan auto (the planner profiles one adapter's model)"),
               (args.compare_planned, "--compare-planned"),
               (args.resume is not None, "--resume (a sweep job writes no checkpoint: rerun it)"),
               (args.save_every > 0, "--save-every (a sweep job writes no checkpoint)"),
               (bool(args.compare_budgets), "--compare-budgets"),
               (bool(args.compare_formats), "--compare-format"),
               (args.compare_host, "--compare-host"),
               (args.save_probe, "--save-probe (one model's logits)"),
               (bool(args.baselines) and not args.compare_sequential,
                "--baseline without --compare-sequential (the peers train each adapter one after another)")]
    refused.append((args.compare_sequential and args.steps < 2,
                    "--compare-sequential with --steps 1 (round 1 warms up; the rounds after it are timed)"))
    bad = [what for cond, what in refused if cond]
    if bad:
        p.error(f"--sweep cannot be combined with {'; '.join(bad)}")


def _check_compare_formats(p: argparse.ArgumentParser, args) -> None:
    """--compare-format's runs are elastic runs of the job in another weight format: each gets the
    policy's own checks now (its block and nesting), before anything runs."""
    if args.weight_format == "none" and set(args.compare_formats) - {"none"}:
        if args.quant_block is not None and args.quant_block & (args.quant_block - 1):
            p.error(f"argument --quant-block: expected a power of two in [32, 4096], got {args.quant_block}")
        if args.quant_nested and "nf4" not in args.compare_formats:
            p.error("--quant-nested is an nf4 option (double quantization of its scales)")
    for fmt in args.compare_formats:
        if fmt == "none":
            continue
        try:
            ElasticPolicy(weights_on=args.weights_on, host_fraction=args.host_fraction, weight_format=fmt,
                          quant_block_size=args.quant_block, quant_nested=bool(args.quant_nested) and fmt == "nf4")
        except ValueError as exc:
            p.error(f"--compare-format {fmt}: {exc}")


# [Note: options a run ignores]
# An option that changes nothing in a run is said so, one warning line each on rank 0 (and in
# summary.json / results.md), never silently dropped: a user who passed it expects it to act.
# The rules are pure functions of the options and the world size (the same on every rank).

def ignored_options(args, world_size: int) -> list[str]:
    """One line per option (or combination) this job ignores, and why."""
    given = getattr(args, "_given", set())
    planned = args.plan == "auto" or args.compare_planned
    host_tier_profile = args.weights_on == "host" or bool(args.host_fraction) or args.offload_activations
    out = []
    if args.host_budget is not None and not args.offload_activations and not (planned and host_tier_profile):
        out.append(f"--host-budget {fmt_bytes(args.host_budget)} is ignored: it bounds the host memory of the "
                   "activation offload, which no run of this job uses (add --offload-activations)")
    late = sorted(step for step, _ in args.memory_cap_change if step > args.steps)
    if late:
        out.append(f"--memory-cap-change at step{'s' if len(late) > 1 else ''} {', '.join(map(str, late))} "
                   f"{'are' if len(late) > 1 else 'is'} ignored: after the last step (--steps {args.steps})")
    if "memory_cap" in given and not planned:
        out.append("--memory-cap is ignored: only a planned run (--plan auto or --compare-planned) uses a memory cap")
    if args.plan == "auto":
        overridden = [o for o, dest in (("--pool-budget", "pool_budget"), ("--keep-ratio", "keep_ratio"),
                                        ("--persist-ratio", "persist_ratio"), ("--prefetch-depth", "prefetch_depth"))
                      if dest in given]
        if overridden:
            out.append(f"--plan auto: the plan chooses the planned run's pool budget, per-weight keep/persist "
                       f"chunks and prefetch depth, so {', '.join(overridden)} {'are' if len(overridden) > 1 else 'is'}"
                       f" not used by it")
        chosen = ([f"--host-fraction {args.host_fraction:g}"] if "host_fraction" in given
                  and host_fraction_used(args, world_size, args.weights_on) else [])
        chosen += ["--offload-activations"] if args.offload_activations else []
        if chosen:
            out.append(f"--plan auto: {' and '.join(chosen)} only put{'s' if len(chosen) == 1 else ''} the host tier "
                       "into the profile; the plan picks the planned run's host fraction and activation offload itself")
    if args.compare_pp is not None and args.plan != "auto" and args.pp == args.compare_pp:
        out.append(f"--compare-pp {args.compare_pp} is ignored: the main run is already --pp {args.pp} with the same "
                   "options (the comparison would train the same run twice)")
    if args.weights_on == "host" and args.compare_host:
        out.append("--compare-host is ignored: with --weights-on host the main run already has its weights in the host "
                   "store (the comparison would train the same run twice)")
    if args.sweep and "sample_tokens" in given and args.sample_tokens:
        out.append(f"--sample-tokens {args.sample_tokens} is ignored: a sweep job writes no samples (its adapters' "
                   "held-out losses are in the report)")
    if world_size == 1 and args.weights_on == "device" and args.host_fraction:
        out.append(f"--host-fraction {args.host_fraction:g} is ignored on one rank: nothing is ever missing (the local "
                   "shard is the whole weight), so no chunk would come from the host store and none is built")
    return out
