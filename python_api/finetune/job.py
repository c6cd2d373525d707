"""The job: everything a run needs, and prepare(), which builds it from the options and checks
all that can be checked before the first collective."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field

import torch

from .agreement import run_configuration
from .checkpoints import Resume, find_checkpoint, read_checkpoint
from .data import TokenWindows
from .errors import FinetuneError
from .formats import check_weight_formats
from .models import ModelSpec, resolve_data, resolve_model, resolved_targets
from .option_checks import ignored_options
from .pipeline_layout import pipeline_notices
from .policy import resolve_training_defaults
from .save_dir import check_save_dir


@dataclass
class Job:
    args: argparse.Namespace
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


def job_device(args, local_rank: int) -> torch.device:
    if args.device == "cpu" or (args.device == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise FinetuneError("--device cuda, but torch sees no CUDA device")
    if local_rank >= torch.cuda.device_count():
        raise FinetuneError(f"local rank {local_rank} has no GPU ({torch.cuda.device_count()} visible); use fewer processes per node")
    return torch.device("cuda", local_rank)


def prepare(args, rank: int, world_size: int, local_rank: int) -> Job:
    """Everything that can be checked before the first collective: options, model directory,
    tokenizer, data, targets, output folder, checkpoint. Raises FinetuneError."""
    if args.resume is not None and (args.baseline != "none" or args.compare_budgets or args.compare_formats):
        raise FinetuneError(
            "--resume continues the elastic run only; --baseline, --compare-budgets and --compare-format train from "
            "scratch (run them without --resume)"
        )
    device = job_device(args, local_rank)
    spec = resolve_model(args)
    resolve_training_defaults(args, pretrained=not spec.embedded)
    windows, data_info = resolve_data(args, spec)
    if data_info["format"] != "text" and (args.pp != 1 or args.compare_pp is not None):
        raise FinetuneError(
            f"--pp / --compare-pp: a pipelined run trains text windows only, and the data is {data_info['format']} "
            f"records ({'--data ' + args.data if args.data else 'the default instruction set of a model with a chat template'}); "
            "pass --data FILE.txt (or a .jsonl of {\"text\"} lines), or train without --pp / --compare-pp")
    targets, adapter_shapes = resolved_targets(spec, args)
    check_weight_formats(spec, args)  # [Note: a weight a format cannot store is an option error]
    config = run_configuration(args, spec, data_info, targets, world_size)
    resume = None
    resume_ckpt = find_checkpoint(args.resume) if args.resume is not None else None
    save_dir = check_save_dir(args, resume_ckpt)
    if args.resume is not None:
        resume = read_checkpoint(args.resume, rank, config, args.steps, adapter_shapes)
    job = Job(args, rank, world_size, local_rank, device, spec, windows, data_info, targets, config, save_dir, resume)

    job.notices = ignored_options(args, world_size) + pipeline_notices(args, world_size, spec.config)
    if getattr(args, "tokenizer", None) == "bytes" and not spec.embedded:
        # [Note: the tokenizer is never silently replaced] (models.py): asked for by name, and said
        job.notices.append(f"--tokenizer bytes: the byte-level tokenizer (UTF-8 bytes as token ids) stands in for the "
                           f"model's own ({spec.config.vocab_size} ids); the adapter fits only byte-level input")
    if data_info["format"] == "text":
        for opt, given in (("--loss-on", getattr(args, "loss_on", "assistant") != "assistant"),
                           ("--pad-records", getattr(args, "pad_records", False))):
            if given:
                job.notices.append(f"{opt} is ignored: the data is text (a token stream in windows, every token "
                                   "trained); it applies to chat and prompt-completion records")
    job.run_id = resume.run_id if resume is not None else None
    return job
