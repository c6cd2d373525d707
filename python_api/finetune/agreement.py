"""What must agree: a checkpoint with the run resuming it (run_configuration), every rank
with every other (agreed_configuration, before step 1), and an error on one rank with all
(agree_error, a collective)."""

from __future__ import annotations

import json

from ..distributed.agree import agree, exchange
from .configuration import FinetuneConfig, config_of
from .constants import ADAM_BETAS, ADAM_EPS
from .errors import FinetuneError
from .models import ModelSpec
from .option_values import DS_OPTIONS, budget_label
from .policy import elastic_policy, format_fields

_VOLATILE_CONFIG_KEYS = {
    "transformers_version", "_name_or_path", "architectures", "dtype", "torch_dtype", "id2label", "label2id",
    "output_attentions", "output_hidden_states", "return_dict", "use_cache", "_attn_implementation_autoset",
}


def run_configuration(cfg: FinetuneConfig, spec: ModelSpec, data_info: dict, targets: list[str],
                      world_size: int) -> dict:
    """What a checkpoint must agree with to be resumed (see [Note: checkpoint layout and resume]),
    from the job's configuration (its model dtype, training, LoRA, elastic, weight-format and
    pipeline groups). A public name: options held by name (parse_args' namespace, an
    OptionView) are still accepted, converted once (configuration.config_of)."""
    cfg = config_of(cfg)
    t, lora, p = cfg.training, cfg.lora, cfg.pipeline
    model_cfg = {k: v for k, v in spec.config.to_dict().items() if k not in _VOLATILE_CONFIG_KEYS}
    out = {
        "world_size": world_size,
        "model": {
            "kind": "embedded" if spec.embedded else "directory",
            "config": json.loads(json.dumps(model_cfg, default=str)),
            "dtype": cfg.model.dtype,
            "init_seed": spec.seed if spec.embedded else None,
        },
        "tokenizer": spec.tokenizer.fingerprint,
        "data": {"tokens": data_info["tokens"], "sha256": data_info["sha256"]},
        "seq_len": t.seq_len,
        "micro_batch": t.micro_batch,
        "grad_accum": t.grad_accum,
        "optimizer": {"name": "AdamW", "lr": t.lr, "warmup_steps": t.warmup_steps,
                      "weight_decay": t.weight_decay, "betas": list(ADAM_BETAS), "eps": ADAM_EPS},
        "seed": t.seed,
        "lora": {"r": lora.lora_r, "alpha": lora.lora_alpha, "dropout": lora.lora_dropout, "targets": targets},
        "policy": {"chunk_bytes": cfg.elastic.chunk_kib << 10, "all_reduce_grads": True,
                   "replicate_below_bytes": elastic_policy(cfg, None).replicate_below_bytes},
    }
    if t.lr_schedule not in (None, "constant"):
        # Absent for a constant rate, so checkpoints written before --lr-schedule still match.
        out["optimizer"]["schedule"] = t.lr_schedule
        out["optimizer"]["schedule_steps"] = t.steps  # the decay ends at --steps: a resume keeps it
    quant = format_fields(cfg.weights)
    if quant:
        # The weight format changes the model's numerics: a checkpoint resumes only in its format.
        # Absent for --weight-format none, so checkpoints written before the option still match.
        out["policy"].update(quant)
    if p.pp != 1:
        # A pipelined run sums its micro-batch gradients in its schedule's order
        # (python_api/finetune/pipelined.py): these change bits, the pack layout does not.
        if p.pp == "auto":  # chosen by the planner when the run starts (python_api/finetune/pipelined.py)
            out["pipeline"] = {"pp": "auto", "schedule": None, "micro_batches": p.micro_batches}
        else:
            out["pipeline"] = {"pp": p.pp, "schedule": p.schedule,
                               "micro_batches": p.micro_batches or t.grad_accum * p.pp}
    return out


def _flatten(d: dict, prefix: str = "") -> dict:
    """{"lora": {"r": 4}} -> {"lora.r": 4} (field names for error messages)."""
    out = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict) and v:
            out.update(_flatten(v, key + "."))
        else:
            out[key] = v
    return out


def configuration_differences(saved: dict, current: dict) -> list[str]:
    a, b = _flatten(saved), _flatten(current)
    diffs = []
    for key in sorted(set(a) | set(b)):
        if a.get(key, "<absent>") != b.get(key, "<absent>"):
            diffs.append(f"{key}: checkpoint has {a.get(key, '<absent>')!r}, this run {b.get(key, '<absent>')!r}")
    return diffs


# [Note: what ranks must agree on]
# torchrun starts every rank with its own command line, environment and files; nothing makes
# them equal. A rank with another --lr trains other adapters (the replicated adapters drift
# apart silently: every rank applies the averaged gradient with its own step), one with
# another --steps or --save-every issues more collectives than its peers (a hang until the
# timeout), one with another pool budget or ratio gathers other chunks (a wrong result or a
# hang). So before step 1 every rank sends agreed_configuration() to every other (one
# all_gather_object) and every rank refuses the run, with the same message, if any field
# differs: the resume configuration (run_configuration: model, dtype, data digest, batch
# shape, optimizer, LoRA, chunk size, world size) plus everything else that changes what is
# computed or how many collectives run: steps, the checkpoint cadence, the residency policy,
# the extra runs, the checkpoint resumed from (step and file digests). Not compared: paths
# (nodes may mount the same folder at different places), the timeout, the progress bar.

_OPTION_OF = {
    "steps": "--steps", "save_every": "--save-every", "seq_len": "--seq-len", "micro_batch": "--micro-batch",
    "grad_accum": "--grad-accum", "seed": "--seed", "optimizer.lr": "--lr", "optimizer.warmup_steps": "--warmup-steps",
    "optimizer.schedule": "--lr-schedule", "optimizer.schedule_steps": "--steps (the learning-rate schedule's length)",
    "optimizer.weight_decay": "--weight-decay", "lora.r": "--lora-r", "lora.alpha": "--lora-alpha",
    "lora.dropout": "--lora-dropout", "lora.targets": "--lora-targets", "model.dtype": "--dtype",
    "policy.chunk_bytes": "--chunk-kib", "policy.weight_format": "--weight-format",
    "policy.quant_block_size": "--quant-block", "policy.quant_nested": "--quant-nested", "residency.pool_budget": "--pool-budget",
    "residency.keep_ratio": "--keep-ratio", "residency.persist_ratio": "--persist-ratio",
    "residency.prefetch_depth": "--prefetch-depth", "residency.collective_bytes": "--collective-kib",
    "runs.baseline": "--baseline", "runs.compare_budgets": "--compare-budgets", "data.sha256": "--data",
    "data.tokens": "--data", "model.kind": "--model", "tokenizer": "--model / --tokenizer",
    "pipeline_options.pp": "--pp", "pipeline_options.pack_size": "--pack-size", "pipeline_options.schedule": "--schedule",
    "pipeline_options.micro_batches": "--micro-batches", "pipeline_options.pack_residency": "--pack-residency",
    "pipeline_options.pack_window": "--pack-window", "pipeline_options.compare_pp": "--compare-pp",
}


def agreed_configuration(job) -> dict:
    """What every rank of a run must have equal (see [Note: what ranks must agree on])."""
    c, r = job.cfg, job.resume
    e, peers, pp = c.elastic, c.peers, c.pipeline
    return {
        **job.config,
        "steps": c.training.steps,
        "save_every": c.output.save_every,
        "residency": {"pool_budget": budget_label(e.pool_budget), "keep_ratio": e.keep_ratio,
                      "persist_ratio": e.persist_ratio, "prefetch_depth": e.prefetch_depth,
                      "collective_bytes": e.collective_kib << 10},
        "runs": {"baseline": peers.baseline, "compare_budgets": [budget_label(b) for b in peers.compare_budgets],
                 "peer_settings": {k: getattr(peers, k) for k in ("fsdp2_reshard",) + DS_OPTIONS}},
        "pipeline_options": {k: getattr(pp, k) for k in ("pp", "pack_size", "schedule", "micro_batches",
                                                          "pack_residency", "pack_window", "compare_pp")},
        # The checkpoint resumed from: its run and step, and the digests of its shared files, as
        # its manifest lists them (each rank verified its files against them).
        "resume": None if r is None else {"step": r.step, "run_id": r.run_id, "sha256": r.digests},
    }


def _ranks_text(ranks: list[int]) -> str:
    return f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}"


def rank_differences(configs: list[dict]) -> list[str]:
    """One line per field whose value is not the same on every rank: the field (and its
    option), each value and the ranks that have it."""
    flat = [_flatten(c) for c in configs]
    out = []
    for key in sorted(set().union(*flat)):
        groups: dict[str, list[int]] = {}
        for rank, f in enumerate(flat):
            text = json.dumps(f[key], sort_keys=True, default=str) if key in f else "<absent>"
            groups.setdefault(text, []).append(rank)
        if len(groups) > 1:
            option = f" ({_OPTION_OF[key]})" if key in _OPTION_OF else ""
            out.append(f"{key}{option}: " + ", ".join(f"{v} on {_ranks_text(rs)}" for v, rs in groups.items()))
    return out


def agree_configuration(job) -> None:
    """Collective: refuse the run on every rank if the ranks' configurations differ."""
    configs = exchange(agreed_configuration(job), what="the ranks' configurations")
    diffs = rank_differences(configs)
    if diffs:
        raise FinetuneError(
            f"the ranks were started with different settings ({len(diffs)} field{'s' if len(diffs) > 1 else ''} "
            "differ; every rank needs the same options, model, data and checkpoint): " + "; ".join(diffs[:6])
            + (f"; and {len(diffs) - 6} more" if len(diffs) > 6 else "")
        )


def agree_error(error: str | None, world_size: int) -> None:
    """Collective: raise FinetuneError on every rank if any rank has an error."""
    agree(error, error_type=FinetuneError)
