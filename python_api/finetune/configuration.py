"""The CLI's configuration as types: the options parsed once (options.py: parse_args, checked
together by option_checks.check_options) into frozen dataclasses, one per option group of the
parser, and the whole (`FinetuneConfig`), which the job carries and each component reads its
part of. Saved runs record it as JSON (`to_json`, in the checkpoint's config.json and the save
dir's configuration.json); `--resume` reads the checkpoint's record back (`from_dict`) and
compares the fields a resume must keep (`resume_differences`).

[Note: configuration as types]
A field's name is its option's argparse destination (`--lora-r` is `lora.lora_r`), so a reader
finds the option from the field and back; the values are the checked ones (check_options:
--baseline as the tuple `baselines` and its normalized text, --compare-format as
`compare_formats`, --compare-budgets parsed, --lora-targets stripped). Lists become tuples (the
dataclasses are frozen and hashable). Three groups of fields are settled only when the job is
prepared, from the model it loads: `model.model` (the default model when not given),
`model.dtype` (the checkpoint's when not given) and the learning-rate defaults of `training`
([Note: learning-rate defaults] in policy.py); `prepare` replaces them (dataclasses.replace),
so the job's configuration names what the run does, as the checkpoints and the report do.
`OptionView` reads a configuration by destination name (`view.lora_r`), read-only, for the
modules that have not yet moved to their parts.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from dataclasses import dataclass, fields

from .errors import FinetuneError

# The JSON record's format: a record of another format is not compared field by field.
CONFIG_FORMAT = "elastic-finetune-config/1"
CONFIG_FILE = "configuration.json"  # the record in the save dir, beside summary.json


@dataclass(frozen=True)
class ModelConfig:
    model: str | None = None
    tokenizer: str | None = None
    hidden_size: int | None = None
    intermediate_size: int | None = None
    num_layers: int | None = None
    num_heads: int | None = None
    num_kv_heads: int | None = None
    dtype: str | None = None
    device: str = "auto"


@dataclass(frozen=True)
class DataConfig:
    data: str | None = None
    loss_on: str = "assistant"
    pad_records: bool = False


@dataclass(frozen=True)
class TrainingConfig:
    steps: int = 0
    seq_len: int = 0
    micro_batch: int = 0
    grad_accum: int = 0
    lr: float | None = None
    lr_schedule: str | None = None
    warmup_steps: int | None = None
    weight_decay: float = 0.0
    seed: int = 0
    sweep: tuple = ()  # ((key, (value, ...)), ...): --sweep ([Note: the sweep's keys and adapter names])


@dataclass(frozen=True)
class LoRAConfig:
    lora_r: int = 8
    lora_alpha: float = 16.0
    lora_dropout: float = 0.0
    lora_targets: str = ""


@dataclass(frozen=True)
class ElasticConfig:
    """The elastic policy's options (ElasticPolicy is built from these with the host tier's and
    the weight format's: policy.policy_of)."""
    chunk_kib: int = 256
    keep_ratio: float = 1.0
    persist_ratio: float = 1.0
    pool_budget: object = None  # None (all), an int of bytes or a percentage (option_values._budget)
    prefetch_depth: int = 1
    collective_kib: int = 32 << 10
    timeout_s: float = 300.0


@dataclass(frozen=True)
class WeightFormatConfig:
    weight_format: str = "none"
    quant_block: int | None = None
    quant_nested: bool = False


@dataclass(frozen=True)
class HostConfig:
    weights_on: str = "device"
    host_fraction: float | None = None
    offload_activations: bool = False
    host_budget: int | None = None


@dataclass(frozen=True)
class PlannerConfig:
    plan: str = "none"
    memory_cap: object = "auto"  # "auto" or an int of bytes
    memory_cap_change: tuple = ()  # ((step, bytes), ...)


@dataclass(frozen=True)
class PipelineConfig:
    pp: object = 1  # an int or "auto"
    pack_size: object = "auto"
    schedule: str = "1f1b"
    micro_batches: int | None = None
    pack_residency: str = "step"
    pack_window: int = 1
    compare_pp: int | None = None


@dataclass(frozen=True)
class PeersConfig:
    """The comparison runs: the peers of --baseline and the elastic runs compared."""
    baseline: str = "none"
    baselines: tuple = ()
    fsdp2_reshard: object = None
    ds_persistence_threshold: int | None = None
    ds_max_live_parameters: int | None = None
    ds_max_reuse_distance: int | None = None
    ds_prefetch_bucket_size: int | None = None
    ds_quantized_weights: bool = False
    ds_quantized_nontrainable_weights: bool = False
    compare_budgets: tuple = ()
    compare_host: bool = False
    compare_format: str = ""
    compare_formats: tuple = ()
    compare_planned: bool = False
    compare_sequential: bool = False


@dataclass(frozen=True)
class OutputConfig:
    save_dir: str | None = None
    save_every: int = 0
    resume: str | None = None
    overwrite: bool = False
    no_progress: bool = False
    sample_tokens: int = 32
    save_probe: bool = False


# The groups, in the parser's order: (attribute of FinetuneConfig, its type).
GROUPS = (("model", ModelConfig), ("data", DataConfig), ("training", TrainingConfig), ("lora", LoRAConfig),
          ("elastic", ElasticConfig), ("weights", WeightFormatConfig), ("host", HostConfig),
          ("planner", PlannerConfig), ("pipeline", PipelineConfig), ("peers", PeersConfig),
          ("output", OutputConfig))
_GROUP_OF = {f.name: g for g, cls in GROUPS for f in fields(cls)}  # destination -> group


def _frozen(v):
    """Lists (and lists of lists) as tuples."""
    return tuple(_frozen(x) for x in v) if isinstance(v, (list, tuple)) else v


@dataclass(frozen=True)
class FinetuneConfig:
    """The whole configuration of a run: one frozen group per option group ([Note: configuration
    as types]); `given` the destinations given on the command line, `argv` the command line
    main() parsed (None: sys.argv)."""
    model: ModelConfig = ModelConfig()
    data: DataConfig = DataConfig()
    training: TrainingConfig = TrainingConfig()
    lora: LoRAConfig = LoRAConfig()
    elastic: ElasticConfig = ElasticConfig()
    weights: WeightFormatConfig = WeightFormatConfig()
    host: HostConfig = HostConfig()
    planner: PlannerConfig = PlannerConfig()
    pipeline: PipelineConfig = PipelineConfig()
    peers: PeersConfig = PeersConfig()
    output: OutputConfig = OutputConfig()
    given: frozenset = frozenset()
    argv: tuple | None = None

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> FinetuneConfig:
        """The configuration of a namespace parse_args returned (checked): every destination of
        the parser lands in its group; one the groups do not name is an error here, so an
        option added to the parser and not to a group is found at once."""
        values = {k: v for k, v in vars(args).items() if not k.startswith("_")}
        unknown = sorted(set(values) - set(_GROUP_OF))
        if unknown:
            raise FinetuneError(f"options without a configuration group: {', '.join(unknown)} "
                                "(add them to python_api/finetune/configuration.py)")
        parts = {}
        for g, group in GROUPS:
            parts[g] = group(**{f.name: _frozen(values[f.name]) for f in fields(group) if f.name in values})
        argv = getattr(args, "_argv", None)
        return cls(**parts, given=frozenset(getattr(args, "_given", ())),
                   argv=None if argv is None else tuple(argv))

    def replace(self, group: str, **changes) -> FinetuneConfig:
        """This configuration with fields of one group changed."""
        return dataclasses.replace(self, **{group: dataclasses.replace(getattr(self, group), **changes)})

    def options(self) -> OptionView:
        return OptionView(self)

    # ------------------------------------------------------------ the JSON record

    def to_dict(self) -> dict:
        out = {"format": CONFIG_FORMAT}
        for g, _ in GROUPS:
            out[g] = {f.name: _jsonable(getattr(getattr(self, g), f.name)) for f in fields(getattr(self, g))}
        out["given"] = sorted(self.given)
        return out

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True)

    @classmethod
    def from_dict(cls, d: dict) -> FinetuneConfig:
        """The configuration a record holds; FinetuneError naming what is wrong with it."""
        if not isinstance(d, dict) or d.get("format") != CONFIG_FORMAT:
            raise FinetuneError(f"not a configuration record ({CONFIG_FORMAT})")
        parts = {}
        for g, group in GROUPS:
            vals = d.get(g)
            if not isinstance(vals, dict):
                raise FinetuneError(f"configuration record: group {g!r} missing")
            names = {f.name for f in fields(group)}
            extra = sorted(set(vals) - names)
            if extra:
                raise FinetuneError(f"configuration record: {g} has unknown fields {extra}")
            parts[g] = group(**{k: _frozen(v) for k, v in vals.items()})
        return cls(**parts, given=frozenset(d.get("given", ())))


def _jsonable(v):
    return [_jsonable(x) for x in v] if isinstance(v, tuple) else v


def resume_fields(c: FinetuneConfig) -> dict:
    """The options a resumed run must keep, by field: those of agreement.run_configuration
    (what --resume compares: [Note: checkpoint layout and resume] in checkpoints.py), under the
    same conditions: the schedule's length (--steps) only for a schedule that decays, the
    quantization block and nesting only for a quantized format, the pipeline's schedule and
    micro-batches only for a pipelined run (the micro-batches as the run counts them). The
    LoRA targets are compared resolved (the run configuration's module names), not here."""
    t, w, p = c.training, c.weights, c.pipeline
    out = {"model.dtype": c.model.dtype, "training.seq_len": t.seq_len, "training.micro_batch": t.micro_batch,
           "training.grad_accum": t.grad_accum, "training.lr": t.lr, "training.warmup_steps": t.warmup_steps,
           "training.weight_decay": t.weight_decay, "training.seed": t.seed,
           "training.lr_schedule": t.lr_schedule or "constant", "lora.lora_r": c.lora.lora_r,
           "lora.lora_alpha": c.lora.lora_alpha, "lora.lora_dropout": c.lora.lora_dropout,
           "elastic.chunk_kib": c.elastic.chunk_kib, "weights.weight_format": w.weight_format,
           "pipeline.pp": p.pp, "training.sweep": t.sweep}
    if out["training.lr_schedule"] != "constant":
        out["training.steps"] = t.steps
    if w.weight_format != "none":
        out.update({"weights.quant_block": w.quant_block, "weights.quant_nested": bool(w.quant_nested)})
    if p.pp == "auto":
        out["pipeline.micro_batches"] = p.micro_batches
    elif p.pp != 1:
        out.update({"pipeline.schedule": p.schedule, "pipeline.micro_batches": p.micro_batches or t.grad_accum * p.pp})
    return out


def resume_differences(saved: FinetuneConfig, current: FinetuneConfig) -> list[str]:
    """The fields of resume_fields that differ, one line each in the words of
    agreement.configuration_differences ("field: checkpoint has X, this run Y")."""
    a, b = resume_fields(saved), resume_fields(current)
    return [f"{k}: checkpoint has {_jsonable(a.get(k, '<absent>'))!r}, this run {_jsonable(b.get(k, '<absent>'))!r}"
            for k in sorted(set(a) | set(b)) if a.get(k, "<absent>") != b.get(k, "<absent>")]


class OptionView:
    """A configuration read by option destination (`view.lora_r` is `config.lora.lora_r`),
    read-only, with the namespace's private names `_given` and `_argv`: what the modules that
    still read the options by name see ([Note: configuration as types])."""

    __slots__ = ("_config",)

    def __init__(self, config: FinetuneConfig):
        object.__setattr__(self, "_config", config)

    def __getattr__(self, name: str):
        c = object.__getattribute__(self, "_config")
        if name == "_given":
            return set(c.given)
        if name == "_argv":
            return None if c.argv is None else list(c.argv)
        g = _GROUP_OF.get(name)
        if g is None:
            raise AttributeError(f"no option {name!r}")
        return getattr(getattr(c, g), name)

    def __setattr__(self, name, value):
        raise AttributeError(f"the configuration is frozen: {name} cannot be set (FinetuneConfig.replace)")


def config_of(options) -> FinetuneConfig:
    """The configuration of `options`: a FinetuneConfig as it is, an OptionView's own, or
    parse_args' namespace converted (FinetuneConfig.from_args: every destination in its
    group). Anything else is a TypeError naming what was passed. What the by-name entry points
    that callers not yet converted still use (policy_of, quant_fields, lora_config_of,
    target_list, compare_pp_is_main) turn their argument into, so each rule is written once,
    on the typed groups ([Note: configuration as types])."""
    if isinstance(options, FinetuneConfig):
        return options
    if isinstance(options, OptionView):
        return object.__getattribute__(options, "_config")
    if isinstance(options, argparse.Namespace):
        return FinetuneConfig.from_args(options)
    raise TypeError(f"expected a FinetuneConfig, an OptionView or parse_args' namespace, not {type(options).__name__}")
