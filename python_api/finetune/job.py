"""The job: everything a run needs, and prepare(), which builds it from the configuration
(configuration.py) and checks all that can be checked before the first collective."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field

import torch

from .agreement import run_configuration
from .checkpoints import Resume, find_checkpoint, read_checkpoint
from .configuration import FinetuneConfig, OptionView
from .data import TokenWindows
from .errors import FinetuneError
from .formats import check_weight_formats
from .models import ModelSpec, dtype_name, resolve_data, resolve_model, resolved_model_name, resolved_targets
from .option_checks import ignored_options
from .pipeline_layout import pipeline_notices
from .policy import training_defaults
from .save_dir import check_save_dir


@dataclass
class Job:
    cfg: FinetuneConfig  # the run's configuration, resolved (the model's name and dtype, the learning-rate defaults)
    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    spec: ModelSpec
    windows: TokenWindows
    data_info: dict
    targets: list[str]
    config: dict
    save_dir: str
    resume: Resume | None
    initial_adapters: dict = field(default_factory=dict)  # the elastic run's, copied into the baseline
    memory: object = None  # elastic_kernels.api.finetune.measure.PeakMemory, set by run()
    checkpoint_step: int | None = None  # the step of the last complete checkpoint in save_dir/checkpoint
    notices: list[str] = field(default_factory=list)  # options this job ignores ([Note: options a run ignores])
    samples: dict | None = None  # rank 0: the reloaded adapter's held-out losses and samples (samples.py)
    run_id: str | None = None  # the run's identity: a resumed run's, else agreed when it starts (runner.run)

    @property
    def args(self) -> OptionView:
        """The configuration read by option name, for the modules not yet given their part
        ([Note: configuration as types] in configuration.py)."""
        return self.cfg.options()


def job_device(model, local_rank: int) -> torch.device:
    """The device of --device (`model`: the model options, ModelConfig) for this local rank."""
    if model.device == "cpu" or (model.device == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise FinetuneError("--device cuda, but torch sees no CUDA device")
    if local_rank >= torch.cuda.device_count():
        raise FinetuneError(f"local rank {local_rank} has no GPU ({torch.cuda.device_count()} visible); use fewer processes per node")
    return torch.device("cuda", local_rank)


def prepare(config: FinetuneConfig | argparse.Namespace, rank: int, world_size: int, local_rank: int) -> Job:
    """Everything that can be checked before the first collective: options, model directory,
    tokenizer, data, targets, output folder, checkpoint. Raises FinetuneError. `config`: the
    configuration (options.parse_config), or parse_args' namespace, converted here once."""
    cfg = FinetuneConfig.from_args(config) if isinstance(config, argparse.Namespace) else config
    peers, out = cfg.peers, cfg.output
    if out.resume is not None and (peers.baseline != "none" or peers.compare_budgets or peers.compare_formats):
        raise FinetuneError(
            "--resume continues the elastic run only; --baseline, --compare-budgets and --compare-format train from "
            "scratch (run them without --resume)"
        )
    device = job_device(cfg.model, local_rank)
    spec = resolve_model(cfg)
    # [Note: configuration as types]: the values settled by the model, in the job's configuration
    cfg = cfg.replace("model", model=resolved_model_name(cfg.model.model), dtype=dtype_name(spec.dtype))
    cfg = cfg.replace("training", **training_defaults(cfg.training, pretrained=not spec.embedded))
    windows, data_info = resolve_data(cfg.data, cfg.training.seq_len, spec)
    pp = cfg.pipeline
    if data_info["format"] != "text" and (pp.pp != 1 or pp.compare_pp is not None):
        data = cfg.data.data
        raise FinetuneError(
            f"--pp / --compare-pp: a pipelined run trains text windows only, and the data is {data_info['format']} "
            f"records ({'--data ' + data if data else 'the default instruction set of a model with a chat template'}); "
            "pass --data FILE.txt (or a .jsonl of {\"text\"} lines), or train without --pp / --compare-pp")
    targets, adapter_shapes = resolved_targets(spec, cfg.lora, cfg.training.seed)
    check_weight_formats(spec, cfg)  # [Note: a weight a format cannot store is an option error]
    config = run_configuration(cfg, spec, data_info, targets, world_size)
    resume = None
    resume_ckpt = find_checkpoint(out.resume) if out.resume is not None else None
    save_dir = check_save_dir(out, resume_ckpt)
    if out.resume is not None:
        resume = read_checkpoint(out.resume, rank, config, cfg.training.steps, adapter_shapes, configuration=cfg)
    job = Job(cfg, rank, world_size, local_rank, device, spec, windows, data_info, targets, config, save_dir, resume)

    job.notices = ignored_options(cfg.options(), world_size) + pipeline_notices(cfg, world_size, spec.config)
    if cfg.model.tokenizer == "bytes" and not spec.embedded:
        # [Note: the tokenizer is never silently replaced] (models.py): asked for by name, and said
        job.notices.append(f"--tokenizer bytes: the byte-level tokenizer (UTF-8 bytes as token ids) stands in for the "
                           f"model's own ({spec.config.vocab_size} ids); the adapter fits only byte-level input")
    if data_info["format"] == "text":
        for opt, given in (("--loss-on", cfg.data.loss_on != "assistant"), ("--pad-records", cfg.data.pad_records)):
            if given:
                job.notices.append(f"{opt} is ignored: the data is text (a token stream in windows, every token "
                                   "trained); it applies to chat and prompt-completion records")
    job.run_id = resume.run_id if resume is not None else None
    return job
