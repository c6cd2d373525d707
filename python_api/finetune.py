"""elastic-finetune: LoRA fine-tuning of a causal language model across ranks on the elastic
runtime, optionally beside the same run under FSDP2.

    torchrun --nproc-per-node 4 -m python_api.finetune --baseline fsdp2 --save-dir out/demo
    torchrun --nproc-per-node 4 --no-python elastic-finetune ...          # the console script
    torchrun --nnodes 2 --node-rank R --master-addr HOST --master-port P --nproc-per-node 8 \\
        -m python_api.finetune --model /models/llama --data corpus.jsonl --dtype bfloat16
    python -m python_api.finetune ...                                     # one process

NCCL with one GPU per process (cuda:LOCAL_RANK) where CUDA is available, gloo on CPU otherwise
(`--device cpu` forces CPU).

Model: `--model DIR`, a Hugging Face directory (config.json + *.safetensors; its tokenizer if
it has one, else the byte-level tokenizer when the vocabulary has >= 256 ids), or by default
the embedded model: a Llama configuration built here (sizes from --hidden-size etc., vocabulary
257 = bytes + end-of-document) with random weights drawn from --seed. Data: `--data FILE`
(.txt or .jsonl with a "text" field), or by default the Python language reference shipped
with CPython (see python_api/data.py). Both are read without network access.

Writes into --save-dir (default out/finetune): results.md / results.csv (the table),
finetune.png (loss curves; throughput, traffic and memory bars), losses.csv, summary.json,
adapter/ (PEFT format: `PeftModel.from_pretrained(base, DIR/adapter)`), probe.safetensors (a
held-out batch and the trained elastic model's logits on it), checkpoint/.

[Note: what is compared with FSDP2, and the tolerance]
`--baseline fsdp2` trains the same base model (same weights), PEFT LoRA with the same r, alpha
and target modules and *the same initial adapter values* (copied from the elastic model), with
`fully_shard` per decoder layer (reshard_after_forward=True) and on the root, AdamW with the
same hyper-parameters, on the same batches. In exact arithmetic the two runs are the same
computation; in fp32 they differ only in summation order (the elastic GEMMs run chunk by
chunk, gradients are averaged by all-reduce instead of reduce-scatter, PEFT adds the LoRA term
after the base GEMM). Those differences start at fp32 rounding (~1e-7 relative) and grow only
as far as training amplifies them; the test bounds the loss curves' difference by 1e-5
absolute over its short run (measured: 1.2e-7; see tests/test_finetune.py for the
number). With `--lora-dropout` > 0 the runs draw different masks and are not comparable step
by step.

[Note: checkpoint layout and resume]
`--save-dir DIR` gets DIR/checkpoint/ every --save-every steps and at the end:
  config.json                the run configuration (what must match to resume) and info
  trainer_state.json         step, the loss of every step so far
  adapter_model.safetensors  the adapters at that step (PEFT format, with adapter_config.json)
  optimizer.pt               AdamW state and the parameter names it belongs to
  rng_rank{r}.pt             each rank's torch (and CUDA) and Python RNG states
Every rank writes its RNG file, rank 0 the shared files, all into DIR/.checkpoint-tmp/;
after a barrier rank 0 swaps the folder in by rename (the previous checkpoint is kept under
DIR/.checkpoint-old until the swap is done), so a checkpoint is never seen half-written.
The folder is assumed to be on a file system every rank sees (as the output folder is).
`--resume DIR` (DIR or DIR/checkpoint) restores all of it and continues to --steps. Batches
depend on (seed, step) only (python_api/data.py), the adapters and optimizer state are
restored bit for bit, and every RNG draw after the checkpoint (LoRA dropout) continues from the
saved states, so on CPU a resumed run reproduces the losses of an uninterrupted one bit for
bit (a test checks it). The elastic policy's residency knobs (--pool-budget, --keep-ratio,
--persist-ratio, --prefetch-depth, --collective-kib) may change on resume: they never change
a computed bit (ARCHITECTURE.md, correctness invariant). What changes numerics must match, and
a checkpoint that differs is refused before any step, naming the field: world size, model
configuration and dtype, tokenizer, data (token count and sha256), seq-len, micro-batch,
grad-accum, optimizer hyper-parameters, seed, LoRA r/alpha/dropout/targets, chunk size.
The base weights of a --model directory are identified by its configuration only.
Every file of a checkpoint is validated when it is read, before the process group starts
(JSON fields, adapter names/shapes, finite values, optimizer and RNG state structure): a
damaged or edited file is one error naming it, never a traceback during the run. A checkpoint
written at the last planned step (a run killed before its report) is resumed by training
nothing and writing the adapter, probe and report from it. Each process that trains part of a
run is one segment of trainer_state.json (see [Note: segments of a run]).

[Note: failures during the run]
Before step 1: every rank checks that all ranks run the same configuration ([Note: what
ranks must agree on]); --save-dir is probed for writability on every rank (a file created and
removed) and locked by rank 0 ([Note: the save-dir lock]). During the run, every write (the
checkpoint's files, the adapter, the report) is followed by an agreement: a write that fails
on any rank (disk full, a folder gone) stops every rank with one message naming the path;
the previous checkpoint stays whole. A non-finite loss names its likely cause (base weights,
checked when the model is built; overflow in the forward pass; divergence). Output files get
the permissions a plain open() gives (0666 minus the umask).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import errno
import fcntl
import gc
import hashlib
import json
import math
import os
import random
import shutil
import statistics
import socket
import sys
import tempfile
import time
import warnings
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn as nn

from python_api.data import (
    ByteTokenizer,
    DataError,
    HFTokenizer,
    TokenWindows,
    embedded_documents,
    read_documents,
    token_digest,
    tokenize,
)

PROG = "elastic-finetune"
CHECKPOINT_FORMAT = "elastic-finetune-checkpoint/1"
PROBE_SEQS = 4  # held-out windows at the end of the token stream (held-out loss, logits check)
ADAM_BETAS = (0.9, 0.999)
ADAM_EPS = 1e-8
DEFAULT_TARGETS = "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj"
EMBEDDED_VOCAB = 257  # UTF-8 bytes + end of document
EMBEDDED_MAX_POSITIONS = 4096

# The embedded model and the default run, sized so that `make demo` (4 gloo processes, the
# elastic run at full and at zero budget plus the FSDP2 baseline) finishes in under 5 minutes
# on the 2-core development machine; see NOTES.md ("The main job") for the measurement.
EMBEDDED = dict(hidden_size=256, intermediate_size=688, num_layers=4, num_heads=8, num_kv_heads=4)
DEFAULT_STEPS = 30
DEFAULT_SEQ_LEN = 128
DEFAULT_MICRO_BATCH = 2
DEFAULT_GRAD_ACCUM = 2


class FinetuneError(ValueError):
    """Bad input or an unusable setting: reported as one line, before any training step (or,
    for a failure during the run, on every rank at the same point)."""


class OutputError(FinetuneError):
    """An output file could not be written (disk full, read-only, removed folder)."""

    def __init__(self, path: str, exc: BaseException):
        reason = getattr(exc, "strerror", None) or f"{type(exc).__name__}: {exc}"
        code = getattr(exc, "errno", None)
        super().__init__(f"cannot write {path}: {reason}" + (f" ({errno.errorcode.get(code, code)})" if code else ""))
        self.path = path


# ============================================================================ command line


def _budget(text: str):
    """'all' -> None (every frozen chunk), 'N%' -> fraction, else bytes ('0', '64MiB', '2G')."""
    t = text.strip()
    if t.lower() in ("all", "none", "full"):
        return None
    if t.endswith("%"):
        try:
            pct = float(t[:-1])
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a percentage: {text!r}") from None
        if not 0.0 <= pct <= 100.0:
            raise argparse.ArgumentTypeError(f"a percentage in [0, 100] is expected, got {text!r}")
        return ("fraction", pct / 100.0)
    units = {"kib": 2**10, "mib": 2**20, "gib": 2**30, "k": 2**10, "m": 2**20, "g": 2**30, "b": 1, "": 1}
    num = t.rstrip("KMGBikmgb")
    unit = t[len(num):].lower()
    if unit not in units:
        raise argparse.ArgumentTypeError(f"unknown unit in {text!r} (use B, KiB, MiB, GiB, N% or all)")
    try:
        value = float(num)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 0, 64MiB, 50%, all)") from None
    if value < 0 or math.isnan(value):
        raise argparse.ArgumentTypeError(f"a budget must be >= 0, got {text!r}")
    if not value * units[unit] < _MAX_BYTES:
        raise argparse.ArgumentTypeError(f"a budget must be a finite size below 8 EiB (2**63 bytes), got {text!r}")
    return int(value * units[unit])


def _budget_label(spec) -> str:
    if spec is None:
        return "all"
    if isinstance(spec, tuple):
        return f"{spec[1] * 100:g}%"
    return _fmt_bytes(spec)


def _fmt_bytes(n: int) -> str:
    if n == 0:
        return "0"
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:g}{unit}"
    return f"{n}B"


# [Note: option ranges]
# Every number an option takes ends up in a fixed-width C/C++ or torch integer, a timedelta or
# a float computation: counts and sizes are capped at 2**31 - 1 (they index tensors and step
# seeds, see data._step_seed), the seed at 2**32 - 1 (data._step_seed keeps 32 bits of it:
# larger seeds would repeat smaller ones' batches), byte sizes below 2**63, the timeout at
# _MAX_TIMEOUT_S (a timedelta in milliseconds must fit the backends' int64 and stay
# meaningful), and floats must be finite. Out of range is an option error, before anything runs.
_MAX_INT = 2**31 - 1
_MAX_SEED = 2**32 - 1
_MAX_BYTES = 2**63
_MAX_TIMEOUT_S = 1e7  # ~115 days


def _int_in(low: int, high: int, what: str):
    def parse(text: str) -> int:
        try:
            v = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
        if not low <= v <= high:
            raise argparse.ArgumentTypeError(f"expected {what} (at most {high}), got {v}")
        return v

    parse.__name__ = what  # argparse names the type in some messages
    return parse


_positive_int = _int_in(1, _MAX_INT, "a positive integer")
_nonneg_int = _int_in(0, _MAX_INT, "an integer >= 0")
_seed_int = _int_in(0, _MAX_SEED, "an integer in [0, 2**32 - 1]")


def _positive_float(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}") from None
    if not v > 0 or math.isinf(v):
        raise argparse.ArgumentTypeError(f"expected a finite positive number, got {text!r}")
    return v


def _timeout(text: str) -> float:
    v = _positive_float(text)
    if v > _MAX_TIMEOUT_S:
        raise argparse.ArgumentTypeError(f"expected at most {_MAX_TIMEOUT_S:g} seconds, got {text!r}")
    return v


def _ratio(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number in [0, 1], got {text!r}") from None
    if not 0.0 <= v <= 1.0:
        raise argparse.ArgumentTypeError(f"expected a number in [0, 1], got {text!r}")
    return v


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows defaults, except None/False ones (their help says what happens without them)."""

    def _get_help_string(self, action):
        if action.default is None or action.default is False or action.default == "":
            return action.help
        return super()._get_help_string(action)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=PROG,
        description="LoRA fine-tuning across ranks with elastic frozen weights (launch with torchrun; "
                    "see the module docstring or README.md, 'The main job').",
        formatter_class=_HelpFormatter,
    )
    g = p.add_argument_group("model")
    g.add_argument("--model", default=None, metavar="DIR",
                   help="Hugging Face model directory (config.json + *.safetensors); default: the embedded Llama model")
    g.add_argument("--hidden-size", type=_positive_int, default=None, help=f"embedded model only (default {EMBEDDED['hidden_size']})")
    g.add_argument("--intermediate-size", type=_positive_int, default=None, help=f"embedded model only (default {EMBEDDED['intermediate_size']})")
    g.add_argument("--num-layers", type=_positive_int, default=None, help=f"embedded model only (default {EMBEDDED['num_layers']})")
    g.add_argument("--num-heads", type=_positive_int, default=None, help=f"embedded model only (default {EMBEDDED['num_heads']})")
    g.add_argument("--num-kv-heads", type=_positive_int, default=None, help=f"embedded model only (default {EMBEDDED['num_kv_heads']})")
    g.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default="float32", help="dtype of the model (adapters stay fp32 for bfloat16/float16, as PEFT keeps them)")
    g.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                   help="auto: cuda:LOCAL_RANK with NCCL where CUDA is available, else CPU with gloo")

    g = p.add_argument_group("data")
    g.add_argument("--data", default=None, metavar="FILE",
                   help=".txt (raw text) or .jsonl (a \"text\" field per line); default: the Python language reference (pydoc_data)")

    g = p.add_argument_group("training")
    g.add_argument("--steps", type=_positive_int, default=DEFAULT_STEPS, help="optimizer steps (total, counting resumed ones)")
    g.add_argument("--seq-len", type=_positive_int, default=DEFAULT_SEQ_LEN, help="tokens per sequence")
    g.add_argument("--micro-batch", type=_positive_int, default=DEFAULT_MICRO_BATCH, help="sequences per rank per micro-step")
    g.add_argument("--grad-accum", type=_positive_int, default=DEFAULT_GRAD_ACCUM, help="micro-steps per optimizer step")
    g.add_argument("--lr", type=_positive_float, default=2e-3, help="AdamW learning rate")
    g.add_argument("--warmup-steps", type=_nonneg_int, default=0, help="linear warm-up of the learning rate")
    g.add_argument("--weight-decay", type=float, default=0.0, help="AdamW weight decay")
    g.add_argument("--seed", type=_seed_int, default=0, help="embedded weights, adapter init, batches, dropout")

    g = p.add_argument_group("LoRA")
    g.add_argument("--lora-r", type=_positive_int, default=8, help="adapter rank")
    g.add_argument("--lora-alpha", type=_positive_float, default=16.0, help="scaling = alpha / r")
    g.add_argument("--lora-dropout", type=float, default=0.0,
                   help="dropout on the adapter input (the FSDP2 comparison is exact only without it)")
    g.add_argument("--lora-targets", default=DEFAULT_TARGETS,
                   help="comma-separated module names (PEFT's matching: a name or a suffix), or all-linear")

    g = p.add_argument_group("elastic policy")
    g.add_argument("--chunk-kib", type=_positive_int, default=256, help="chunk size of frozen weights, KiB")
    g.add_argument("--keep-ratio", type=_ratio, default=1.0, help="fraction of chunks kept from forward to backward")
    g.add_argument("--persist-ratio", type=_ratio, default=1.0, help="fraction of chunks kept across iterations")
    g.add_argument("--pool-budget", type=_budget, default=None, metavar="BUDGET",
                   help="cache budget per rank: all (the default), 0, a size (64MiB) or a percentage of the frozen bytes (50%%)")
    g.add_argument("--prefetch-depth", type=_nonneg_int, default=1, help="frozen weights gathered ahead of use, in the learned order")
    g.add_argument("--collective-kib", type=_positive_int, default=32 << 10, help="coalescing cap per all-gather, KiB per rank")
    g.add_argument("--timeout-s", type=_timeout, default=300.0, help="collective and process-group timeout, seconds")

    g = p.add_argument_group("comparison")
    g.add_argument("--baseline", choices=("none", "fsdp2"), default="none",
                   help="also train the same job with PEFT LoRA under FSDP2 (from scratch) and compare")
    g.add_argument("--compare-budgets", default="", metavar="B1,B2",
                   help="also train the elastic job from scratch at these pool budgets (e.g. 0,50%%) and compare")

    g = p.add_argument_group("output and checkpoints")
    g.add_argument("--save-dir", default=None, metavar="DIR",
                   help="results, adapter and checkpoint (default out/finetune; with --resume: the resumed folder)")
    g.add_argument("--save-every", type=_nonneg_int, default=0, help="checkpoint every N steps (0: only at the end)")
    g.add_argument("--resume", default=None, metavar="DIR", help="continue from DIR/checkpoint (or DIR itself)")
    g.add_argument("--overwrite", action="store_true", help="allow writing into a non-empty --save-dir")
    g.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p


def parse_args(argv=None) -> argparse.Namespace:
    p = build_parser()
    args = p.parse_args(argv)
    try:
        args.compare_budgets = [_budget(b) for b in args.compare_budgets.split(",") if b.strip()]
    except argparse.ArgumentTypeError as exc:
        p.error(f"argument --compare-budgets: {exc}")
    if not 0.0 <= args.lora_dropout < 1.0:
        p.error(f"argument --lora-dropout: expected a number in [0, 1), got {args.lora_dropout}")
    if not 0 <= args.weight_decay < math.inf:
        p.error(f"argument --weight-decay: expected a finite number >= 0, got {args.weight_decay}")
    if args.keep_ratio < args.persist_ratio:
        p.error(f"--keep-ratio ({args.keep_ratio}) must be >= --persist-ratio ({args.persist_ratio})")
    targets = args.lora_targets.strip()
    if targets != "all-linear":
        names = [t.strip() for t in targets.split(",")]
        if not names or not all(names):
            p.error(f"argument --lora-targets: expected comma-separated module names or all-linear, got {args.lora_targets!r}")
        args.lora_targets = ",".join(names)
    return args


# ============================================================================ model


@dataclass
class ModelSpec:
    """Where the base model comes from; `build()` makes a fresh copy on the CPU each time."""

    source: str  # "embedded" or an absolute directory
    config: object  # transformers.PretrainedConfig
    dtype: torch.dtype
    seed: int
    tokenizer: object

    @property
    def embedded(self) -> bool:
        return self.source == "embedded"

    def build(self) -> nn.Module:
        if self.embedded:
            return embedded_model(self.config, self.seed, self.dtype)
        from transformers import AutoModelForCausalLM

        try:
            model, info = AutoModelForCausalLM.from_pretrained(
                self.source, local_files_only=True, dtype=self.dtype, output_loading_info=True
            )
        except Exception as exc:  # noqa: BLE001 - any loader failure is a bad model directory
            raise FinetuneError(f"model directory {self.source}: cannot load the model: {type(exc).__name__}: {exc}") from exc
        missing = [k for k in info.get("missing_keys", []) if "rotary_emb" not in k]
        if missing:
            raise FinetuneError(
                f"model directory {self.source}: the weights lack {len(missing)} parameters of the model, "
                f"e.g. {sorted(missing)[:3]} (they would be left randomly initialised)"
            )
        model.train()
        return model

    def meta_model(self) -> nn.Module:
        """The model's module structure without weights (to check target names early)."""
        from transformers import AutoModelForCausalLM

        with torch.device("meta"):
            return AutoModelForCausalLM.from_config(self.config)

    def description(self) -> str:
        c = self.config
        what = "embedded Llama" if self.embedded else f"{c.model_type} from {self.source}"
        return (f"{what}: {c.num_hidden_layers} layers, hidden {c.hidden_size}, intermediate "
                f"{getattr(c, 'intermediate_size', '?')}, vocab {c.vocab_size}, {str(self.dtype).replace('torch.', '')}")


def embedded_config(hidden_size: int, intermediate_size: int, num_layers: int, num_heads: int, num_kv_heads: int):
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=EMBEDDED_VOCAB, hidden_size=hidden_size, intermediate_size=intermediate_size,
        num_hidden_layers=num_layers, num_attention_heads=num_heads, num_key_value_heads=num_kv_heads,
        max_position_embeddings=EMBEDDED_MAX_POSITIONS, tie_word_embeddings=False,
        bos_token_id=None, eos_token_id=EMBEDDED_VOCAB - 1, pad_token_id=None,
    )


def embedded_model(config, seed: int, dtype: torch.dtype = torch.float32) -> nn.Module:
    """The embedded base model: `LlamaForCausalLM(config)` with weights drawn after
    `torch.manual_seed(seed)` (the same on every rank and in every process). This is the base
    model a saved adapter of an embedded run belongs to."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).to(dtype)
    model.train()
    return model


def _resolve_model(args) -> ModelSpec:
    dtype = getattr(torch, args.dtype)
    dims = {k: getattr(args, k) for k in EMBEDDED}
    if args.model is None:
        d = {k: (v if v is not None else EMBEDDED[k]) for k, v in dims.items()}
        if d["hidden_size"] % d["num_heads"]:
            raise FinetuneError(f"--hidden-size {d['hidden_size']} is not a multiple of --num-heads {d['num_heads']}")
        if d["num_heads"] % d["num_kv_heads"]:
            raise FinetuneError(f"--num-heads {d['num_heads']} is not a multiple of --num-kv-heads {d['num_kv_heads']}")
        if (d["hidden_size"] // d["num_heads"]) % 2:
            raise FinetuneError(f"head size {d['hidden_size'] // d['num_heads']} must be even (rotary embeddings)")
        config = embedded_config(**d)
        return ModelSpec("embedded", config, dtype, args.seed, ByteTokenizer(eos=True))

    given = [f"--{k.replace('_', '-')}" for k, v in dims.items() if v is not None]
    if given:
        raise FinetuneError(f"{', '.join(given)} size the embedded model only; --model {args.model} brings its own configuration")
    path = os.path.abspath(args.model)
    if not os.path.exists(path):
        raise FinetuneError(f"model directory {args.model} does not exist")
    if not os.path.isdir(path):
        raise FinetuneError(f"--model {args.model} is not a directory (expected a Hugging Face model directory)")
    cfg_file = os.path.join(path, "config.json")
    if not os.path.isfile(cfg_file):
        raise FinetuneError(f"model directory {args.model} has no config.json (a Hugging Face model directory holds config.json and *.safetensors)")
    try:
        with open(cfg_file) as f:
            json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise FinetuneError(f"model directory {args.model}: config.json is not valid JSON: {exc}") from exc
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(path, local_files_only=True)
    except Exception as exc:  # noqa: BLE001
        raise FinetuneError(f"model directory {args.model}: cannot read config.json: {type(exc).__name__}: {exc}") from exc
    weights = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
    if not weights:
        raise FinetuneError(f"model directory {args.model} has no *.safetensors weights")
    from safetensors import safe_open

    for w in weights:
        try:
            with safe_open(os.path.join(path, w), framework="pt") as f:
                f.keys()
        except Exception as exc:  # noqa: BLE001 - header parse errors come in several types
            raise FinetuneError(f"model directory {args.model}: {w} is not a valid safetensors file: {exc}") from exc
    tokenizer = _resolve_tokenizer(path, args.model, config)
    return ModelSpec(path, config, dtype, args.seed, tokenizer)


def _resolve_tokenizer(path: str, shown: str, config):
    if any(os.path.isfile(os.path.join(path, f)) for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")):
        from transformers import AutoTokenizer

        try:
            return HFTokenizer(AutoTokenizer.from_pretrained(path, local_files_only=True), shown)
        except Exception as exc:  # noqa: BLE001
            raise FinetuneError(f"model directory {shown}: cannot load its tokenizer: {type(exc).__name__}: {exc}") from exc
    vocab = getattr(config, "vocab_size", None)
    if vocab is None or vocab < 256:
        raise FinetuneError(
            f"model directory {shown} has no tokenizer and a vocabulary of {vocab} ids: the byte-level "
            "tokenizer needs at least 256 (add the model's tokenizer files to the directory)"
        )
    return ByteTokenizer(eos=vocab > 256)


def _resolve_data(args, spec: ModelSpec):
    try:
        if args.data is None:
            docs, source = embedded_documents(), "embedded: pydoc_data.topics (Python language reference)"
        else:
            docs, source = read_documents(args.data), os.path.abspath(args.data)
        tokens = tokenize(docs, spec.tokenizer)
        vocab = spec.config.vocab_size
        if tokens.numel() and int(tokens.max()) >= vocab:
            raise DataError(
                f"the tokenizer ({spec.tokenizer.name}) produced id {int(tokens.max())}, outside the model's "
                f"vocabulary of {vocab}"
            )
        max_pos = getattr(spec.config, "max_position_embeddings", None)
        if max_pos is not None and args.seq_len > max_pos:
            raise DataError(f"--seq-len {args.seq_len} exceeds the model's max_position_embeddings ({max_pos})")
        windows = TokenWindows(tokens, args.seq_len, PROBE_SEQS, args.data or "the embedded corpus")
    except DataError as exc:
        raise FinetuneError(str(exc)) from exc
    info = {"source": source, "documents": len(docs), "tokens": int(tokens.numel()), "sha256": token_digest(tokens)}
    return windows, info


def _target_list(args) -> list[str] | str:
    return "all-linear" if args.lora_targets == "all-linear" else args.lora_targets.split(",")


def _lora_config(args):
    from python_api.lora import LoRAConfig

    t = _target_list(args)
    return LoRAConfig(r=args.lora_r, alpha=args.lora_alpha, dropout=args.lora_dropout,
                      target_modules=t if isinstance(t, str) else tuple(t), seed=args.seed)


def _resolved_targets(spec: ModelSpec, args) -> tuple[list[str], dict]:
    """The adapted module names, and the adapter tensors they get: PEFT key -> shape (None
    where the module is not an nn.Linear and the shape is not derived here)."""
    from python_api.lora import _target_names

    meta = spec.meta_model()
    try:
        targets = _target_names(meta, _lora_config(args))
    except ValueError as exc:
        raise FinetuneError(f"--lora-targets {args.lora_targets}: {exc}") from exc
    shapes = {}
    for name in targets:
        m = meta.get_submodule(name)
        linear = isinstance(m, nn.Linear)
        shapes[f"base_model.model.{name}.lora_A.weight"] = (args.lora_r, m.in_features) if linear else None
        shapes[f"base_model.model.{name}.lora_B.weight"] = (m.out_features, args.lora_r) if linear else None
    return targets, shapes


# ============================================================================ configuration


_VOLATILE_CONFIG_KEYS = {
    "transformers_version", "_name_or_path", "architectures", "dtype", "torch_dtype", "id2label", "label2id",
    "output_attentions", "output_hidden_states", "return_dict", "use_cache", "_attn_implementation_autoset",
}


def run_configuration(args, spec: ModelSpec, data_info: dict, targets: list[str], world_size: int) -> dict:
    """What a checkpoint must agree with to be resumed (see [Note: checkpoint layout and resume])."""
    model_cfg = {k: v for k, v in spec.config.to_dict().items() if k not in _VOLATILE_CONFIG_KEYS}
    return {
        "world_size": world_size,
        "model": {
            "kind": "embedded" if spec.embedded else "directory",
            "config": json.loads(json.dumps(model_cfg, default=str)),
            "dtype": args.dtype,
            "init_seed": spec.seed if spec.embedded else None,
        },
        "tokenizer": spec.tokenizer.fingerprint,
        "data": {"tokens": data_info["tokens"], "sha256": data_info["sha256"]},
        "seq_len": args.seq_len,
        "micro_batch": args.micro_batch,
        "grad_accum": args.grad_accum,
        "optimizer": {"name": "AdamW", "lr": args.lr, "warmup_steps": args.warmup_steps,
                      "weight_decay": args.weight_decay, "betas": list(ADAM_BETAS), "eps": ADAM_EPS},
        "seed": args.seed,
        "lora": {"r": args.lora_r, "alpha": args.lora_alpha, "dropout": args.lora_dropout, "targets": targets},
        "policy": {"chunk_bytes": args.chunk_kib << 10, "all_reduce_grads": True,
                   "replicate_below_bytes": _policy(args, None).replicate_below_bytes},
    }


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
    "optimizer.weight_decay": "--weight-decay", "lora.r": "--lora-r", "lora.alpha": "--lora-alpha",
    "lora.dropout": "--lora-dropout", "lora.targets": "--lora-targets", "model.dtype": "--dtype",
    "policy.chunk_bytes": "--chunk-kib", "residency.pool_budget": "--pool-budget",
    "residency.keep_ratio": "--keep-ratio", "residency.persist_ratio": "--persist-ratio",
    "residency.prefetch_depth": "--prefetch-depth", "residency.collective_bytes": "--collective-kib",
    "runs.baseline": "--baseline", "runs.compare_budgets": "--compare-budgets", "data.sha256": "--data",
    "data.tokens": "--data", "model.kind": "--model", "tokenizer": "--model",
}


def _file_sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def agreed_configuration(job) -> dict:
    """What every rank of a run must have equal (see [Note: what ranks must agree on])."""
    a = job.args
    r = job.resume
    return {
        **job.config,
        "steps": a.steps,
        "save_every": a.save_every,
        "residency": {"pool_budget": _budget_label(a.pool_budget), "keep_ratio": a.keep_ratio,
                      "persist_ratio": a.persist_ratio, "prefetch_depth": a.prefetch_depth,
                      "collective_bytes": a.collective_kib << 10},
        "runs": {"baseline": a.baseline, "compare_budgets": [_budget_label(b) for b in a.compare_budgets]},
        "resume": None if r is None else {"step": r.step, "adapters_sha256": _file_sha256(
            os.path.join(r.path, "adapter_model.safetensors")), "optimizer_sha256": _file_sha256(
            os.path.join(r.path, "optimizer.pt"))},
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


def _agree_configuration(job) -> None:
    """Collective: refuse the run on every rank if the ranks' configurations differ."""
    configs = [None] * job.world_size
    dist.all_gather_object(configs, agreed_configuration(job))
    diffs = rank_differences(configs)
    if diffs:
        raise FinetuneError(
            f"the ranks were started with different settings ({len(diffs)} field{'s' if len(diffs) > 1 else ''} "
            "differ; every rank needs the same options, model, data and checkpoint): " + "; ".join(diffs[:6])
            + (f"; and {len(diffs) - 6} more" if len(diffs) > 6 else "")
        )


def _policy(args, budget):
    from python_api.config import ElasticPolicy

    return ElasticPolicy(
        chunk_bytes=args.chunk_kib << 10, keep_ratio=args.keep_ratio, persist_ratio=args.persist_ratio,
        pool_budget_bytes=budget if isinstance(budget, int) else None, prefetch_depth=args.prefetch_depth,
        collective_bytes=args.collective_kib << 10, collective_timeout_s=args.timeout_s,
    )


# ============================================================================ checkpoints


CKPT = "checkpoint"
_CKPT_TMP = ".checkpoint-tmp"
_CKPT_OLD = ".checkpoint-old"
_SHARED_FILES = ("config.json", "trainer_state.json", "adapter_model.safetensors", "adapter_config.json", "optimizer.pt")


def _rng_file(rank: int) -> str:
    return f"rng_rank{rank}.pt"


@dataclass
class Resume:
    path: str
    step: int
    losses: list[float]
    optimizer: dict
    param_names: list[str]
    rng: dict
    segments: list[dict] = field(default_factory=list)  # see [Note: segments of a run]


def _find_checkpoint(path: str) -> str:
    if not os.path.exists(path):
        raise FinetuneError(f"--resume {path}: no such directory")
    if not os.path.isdir(path):
        raise FinetuneError(f"--resume {path}: not a directory")
    inner = os.path.join(path, CKPT)
    if os.path.isdir(inner):
        return inner
    if os.path.isfile(os.path.join(path, "trainer_state.json")):
        return path
    if os.path.isdir(os.path.join(path, _CKPT_OLD)):
        raise FinetuneError(
            f"--resume {path}: no {CKPT}/ folder, but {_CKPT_OLD}/ exists: a checkpoint swap was interrupted; "
            f"rename {os.path.join(path, _CKPT_OLD)} to {inner} to resume from the previous checkpoint"
        )
    raise FinetuneError(f"--resume {path}: no checkpoint there (expected {inner}/ written by --save-dir {path})")


def _read_json(path: str, what: str):
    try:
        with open(path) as f:
            return json.load(f)
    except FileNotFoundError:
        raise FinetuneError(f"checkpoint {os.path.dirname(path)} is incomplete: {os.path.basename(path)} is missing") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise FinetuneError(f"checkpoint {what} {path} is not valid JSON: {exc}") from exc


def _torch_load(path: str, what: str):
    if not os.path.isfile(path):
        raise FinetuneError(f"checkpoint {os.path.dirname(path)} is incomplete: {os.path.basename(path)} is missing")
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001 - a truncated or foreign file
        raise FinetuneError(f"checkpoint {what} {path} cannot be read: {type(exc).__name__}: {exc}") from exc


def _nonfinite(t: torch.Tensor) -> bool:
    return t.is_floating_point() and not bool(torch.isfinite(t).all())


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _check_segments(segments, step: int, where: str) -> list[dict]:
    """trainer_state.json's "segments" (absent in older checkpoints): see [Note: segments of a run]."""
    if segments is None:
        return []
    bad = FinetuneError(f"{where}: \"segments\" is malformed (edited or damaged file)")
    if not isinstance(segments, list):
        raise bad
    last = None  # the first segment may start after step 1 (a checkpoint of a version without segments, resumed)
    for seg in segments:
        if not isinstance(seg, dict) or not all(_is_int(seg.get(k)) for k in ("first_step", "last_step")):
            raise bad
        if seg["first_step"] < 1 or (last is not None and seg["first_step"] != last + 1):
            raise bad
        if seg["last_step"] < seg["first_step"] - 1 or not isinstance(seg.get("pool_budget"), str):
            raise bad
        for k in ("step_times_s", "allgather_bytes_per_step", "allgather_bytes_counted_per_step"):
            v = seg.get(k)
            if not isinstance(v, list) or len(v) != seg["last_step"] - seg["first_step"] + 1 or not all(
                    _is_number(x) and math.isfinite(x) for x in v):
                raise bad
        if not (seg.get("peak_memory_bytes") is None or _is_int(seg["peak_memory_bytes"])):
            raise bad
        last = seg["last_step"]
    if segments and last != step:
        raise bad
    return segments


def read_checkpoint(path: str, rank: int, current: dict, steps: int, adapter_shapes: dict | None = None) -> Resume:
    """Read and check everything this rank needs from a checkpoint (no collective): every
    field of its JSON files that is used, the adapters' names, shapes and values, the
    optimizer state's structure and values, this rank's RNG state. A damaged or edited file is
    refused here, before the process group exists, never by a traceback during the run.
    `adapter_shapes`: PEFT key -> expected shape (None: not checked), from prepare()."""
    ckpt = _find_checkpoint(path)
    cfile = os.path.join(ckpt, "config.json")
    config = _read_json(cfile, "configuration")
    if not isinstance(config, dict) or config.get("format") != CHECKPOINT_FORMAT or not isinstance(config.get("run"), dict):
        raise FinetuneError(f"checkpoint {ckpt}: config.json is not an {PROG} checkpoint configuration ({CHECKPOINT_FORMAT})")
    diffs = configuration_differences(config["run"], current)
    if diffs:
        raise FinetuneError(
            f"checkpoint {ckpt} was written by a different configuration ({len(diffs)} field"
            f"{'s' if len(diffs) > 1 else ''} differ): " + "; ".join(diffs[:5])
        )
    sfile = os.path.join(ckpt, "trainer_state.json")
    state = _read_json(sfile, "state")
    if not isinstance(state, dict) or not _is_int(state.get("step")) or not isinstance(state.get("losses"), list):
        raise FinetuneError(f"checkpoint {ckpt}: trainer_state.json lacks a valid step (an integer) and losses (a list)")
    step, losses = state["step"], state["losses"]
    if step < 1:
        raise FinetuneError(f"checkpoint {ckpt}: trainer_state.json has step {step}; a checkpoint is at step 1 or later")
    if not all(_is_number(x) and math.isfinite(x) for x in losses):
        raise FinetuneError(f"checkpoint {ckpt}: trainer_state.json has a loss that is not a finite number "
                            "(a run stops at a non-finite loss and never saves it: the file was damaged or edited)")
    losses = [float(x) for x in losses]
    if len(losses) != step:
        raise FinetuneError(f"checkpoint {ckpt}: trainer_state.json has {len(losses)} losses for step {step}")
    segments = _check_segments(state.get("segments"), step, f"checkpoint {ckpt}: trainer_state.json")
    if step > steps:
        raise FinetuneError(f"checkpoint {ckpt} is at step {step}, past --steps {steps}; pass --steps {step} or more")
    wfile = os.path.join(ckpt, "adapter_model.safetensors")
    acfile = os.path.join(ckpt, "adapter_config.json")
    if not os.path.isfile(wfile) or not os.path.isfile(acfile):
        raise FinetuneError(f"checkpoint {ckpt} is incomplete: adapter_model.safetensors / adapter_config.json missing")
    aconf = _read_json(acfile, "adapter configuration")
    lora = current.get("lora", {})
    if not isinstance(aconf, dict) or aconf.get("peft_type") != "LORA":
        raise FinetuneError(f"checkpoint {ckpt}: adapter_config.json is not a PEFT LoRA configuration (peft_type LORA)")
    for key, want in (("r", lora.get("r")), ("lora_alpha", lora.get("alpha")), ("use_rslora", False)):
        got = aconf.get(key, False if key == "use_rslora" else "<absent>")
        if got != want or type(got) is bool and type(want) is not bool:
            raise FinetuneError(f"checkpoint {ckpt}: adapter_config.json has {key}={got!r}, this run (and the "
                                f"checkpoint's config.json) {want!r}: the file was damaged or edited")
    from safetensors.torch import load_file

    try:
        adapters = load_file(wfile)  # read now so a damaged file is refused before any step; train() loads it
    except Exception as exc:  # noqa: BLE001
        raise FinetuneError(f"checkpoint adapters {wfile} cannot be read: {exc}") from exc
    if adapter_shapes is not None:
        if set(adapters) != set(adapter_shapes):
            extra, lack = sorted(set(adapters) - set(adapter_shapes)), sorted(set(adapter_shapes) - set(adapters))
            raise FinetuneError(f"checkpoint adapters {wfile} do not fit this model's adapters"
                                + (f"; unknown: {extra[:3]}" if extra else "") + (f"; missing: {lack[:3]}" if lack else ""))
        for key, shape in adapter_shapes.items():
            if shape is not None and tuple(adapters[key].shape) != shape:
                raise FinetuneError(f"checkpoint adapters {wfile}: {key} has shape {tuple(adapters[key].shape)}, "
                                    f"this model's adapter {shape}")
    for key, t in adapters.items():
        if not t.is_floating_point():
            raise FinetuneError(f"checkpoint adapters {wfile}: {key} is {t.dtype}, not a floating-point tensor")
        if _nonfinite(t):
            raise FinetuneError(f"checkpoint adapters {wfile}: {key} holds NaN or Inf values (training never saves "
                                "them: the file was damaged or edited)")
    opt = _torch_load(os.path.join(ckpt, "optimizer.pt"), "optimizer state")
    if not isinstance(opt, dict) or "state_dict" not in opt or "param_names" not in opt:
        raise FinetuneError(f"checkpoint {ckpt}: optimizer.pt is not an {PROG} optimizer state")
    _check_optimizer_state(opt, adapters, ckpt)
    rng = _torch_load(os.path.join(ckpt, _rng_file(rank)), f"RNG state of rank {rank}")
    _check_rng_state(rng, os.path.join(ckpt, _rng_file(rank)))
    return Resume(ckpt, step, losses, opt["state_dict"], list(opt["param_names"]), rng, segments)


def _check_optimizer_state(opt: dict, adapters: dict, ckpt: str) -> None:
    """The AdamW state_dict's structure (one group over the named parameters, exp_avg and
    exp_avg_sq of each parameter's shape), and finite values."""
    where = f"checkpoint {ckpt}: optimizer.pt"
    names, sd = opt["param_names"], opt["state_dict"]
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
        raise FinetuneError(f"{where}: param_names is not a list of names")
    if not isinstance(sd, dict) or not isinstance(sd.get("state"), dict) or not isinstance(sd.get("param_groups"), list):
        raise FinetuneError(f"{where}: not an AdamW state (state, param_groups)")
    groups = sd["param_groups"]
    if len(groups) != 1 or not isinstance(groups[0], dict) or list(groups[0].get("params", [])) != list(range(len(names))):
        raise FinetuneError(f"{where}: expected one parameter group over its {len(names)} named parameters")
    for index, entry in sd["state"].items():
        if not _is_int(index) or not 0 <= index < len(names) or not isinstance(entry, dict):
            raise FinetuneError(f"{where}: a state entry belongs to no parameter ({index!r})")
        adapter = adapters.get(f"base_model.model.{names[index]}")
        for key in ("exp_avg", "exp_avg_sq", "step"):
            t = entry.get(key)
            if not isinstance(t, torch.Tensor):
                raise FinetuneError(f"{where}: {names[index]} lacks {key}")
            if key != "step" and adapter is not None and t.shape != adapter.shape:
                raise FinetuneError(f"{where}: {key} of {names[index]} has shape {tuple(t.shape)}, "
                                    f"the adapter {tuple(adapter.shape)}")
            if _nonfinite(t):
                raise FinetuneError(f"{where}: {key} of {names[index]} holds NaN or Inf values (the file was damaged or edited)")


def _check_rng_state(rng, path: str) -> None:
    """What _restore_rng will set: refused here rather than by a RuntimeError in the run."""
    if not isinstance(rng, dict) or not isinstance(rng.get("torch"), torch.Tensor):
        raise FinetuneError(f"checkpoint {path} is not an RNG state")
    want = torch.get_rng_state()
    if rng["torch"].dtype != want.dtype or rng["torch"].shape != want.shape:
        raise FinetuneError(f"checkpoint {path}: the torch RNG state has the wrong size (damaged or edited file)")
    try:
        random.Random().setstate(_to_tuple(rng.get("python")))
    except (TypeError, ValueError) as exc:
        raise FinetuneError(f"checkpoint {path}: the Python RNG state is invalid: {exc}") from exc


def _file_mode() -> int:
    """The permissions a plain open() gives a new file: 0666 minus the umask."""
    umask = os.umask(0)
    os.umask(umask)
    return 0o666 & ~umask


def _remove_quietly(path: str | None) -> None:
    if path is not None:
        with contextlib.suppress(OSError):
            os.unlink(path)


def _write_bytes_atomic(path: str, write) -> None:
    """`write(tmp)` into a temporary file next to `path`, then rename it over `path` (a reader
    never sees half a file). The mode is set on the *written* file, just before the rename:
    safetensors' save_file replaces the file it is given, so a mode set before writing would be
    lost (the file would stay mkstemp's 0600). A failed write raises OutputError naming `path`."""
    from safetensors import SafetensorError

    tmp = None
    try:
        fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=os.path.dirname(path) or ".")
        os.close(fd)
        write(tmp)
        os.chmod(tmp, _file_mode())
        os.replace(tmp, path)
    except (OSError, SafetensorError) as exc:
        _remove_quietly(tmp)
        raise OutputError(path, exc) from exc
    except BaseException:
        _remove_quietly(tmp)
        raise


def _torch_save_atomic(obj, path: str) -> None:
    # Through a file object: torch.save(obj, name) derives its archive name from the file
    # name, and the temporary ".tmp-*" names are not valid archive names.
    def write(p):
        with open(p, "wb") as f:
            torch.save(obj, f)

    _write_bytes_atomic(path, write)


def _collective(job, fn, what: str) -> None:
    """Collective: run `fn()` on this rank (it may do nothing on some), then agree. An output
    error on any rank stops every rank with one message naming the path: alone, the failing
    rank would die with a traceback while the others wait in their next collective until the
    timeout, or die of "Connection closed by peer"."""
    err = None
    try:
        fn()
    except FinetuneError as exc:
        err = f"{what}: {exc}"
    except OSError as exc:  # makedirs, rename: the path is in the exception
        err = f"{what}: {OutputError(exc.filename or job.save_dir, exc)}"
    _agree(err, job.world_size)


def _save_adapter_agreed(job, model, folder: str, what: str) -> None:
    """lora.save_adapter into `folder`, its write failures stopping every rank with one
    message, and the permissions a plain open() gives on the weights file.

    save_adapter writes on rank 0. Where it reports rank 0's failure on every rank itself (a
    RuntimeError "save_adapter(...) failed on rank 0: ..." on each), that message is agreed
    as is. Where it ends with a barrier instead, a write failure escapes on rank 0 before that
    barrier while the others wait in it: rank 0 joins the barrier, then the error is agreed."""
    from safetensors import SafetensorError

    from python_api.elastic_linear import runtime_of
    from python_api.lora import ADAPTER_WEIGHTS, save_adapter

    err = None
    try:
        save_adapter(model, folder)
    except (OSError, SafetensorError) as exc:
        err = f"{what}: {OutputError(folder, exc)}"
        if job.world_size > 1:
            dist.barrier(group=runtime_of(model).group)
    except RuntimeError as exc:
        if isinstance(exc, dist.DistError):
            raise  # the group itself failed: no agreement is possible over it
        err = f"{what}: {exc}"
    else:
        # save_adapter's mode is lost to safetensors (it replaces the file it was given; see
        # _write_bytes_atomic): set it here.
        if job.rank == 0:
            weights = os.path.join(folder, ADAPTER_WEIGHTS)
            try:
                os.chmod(weights, _file_mode())
            except OSError as exc:
                err = f"{what}: {OutputError(weights, exc)}"
    _agree(err, job.world_size)


def write_checkpoint(job, model, opt, param_names, step: int, losses: list[float], segments: list[dict]) -> None:
    """Collective: every rank calls it at the same step (see [Note: checkpoint layout and
    resume]). A write that fails on any rank (disk full, folder gone) stops every rank with
    one message naming the path; the previous checkpoint is left as it was."""
    save_dir, rank = job.save_dir, job.rank
    tmp = os.path.join(save_dir, _CKPT_TMP)
    final = os.path.join(save_dir, CKPT)
    kept = (f"; {final} still holds the checkpoint of step {job.checkpoint_step}" if job.checkpoint_step
            else "; no checkpoint was written")
    what = f"the checkpoint of step {step} was not written{kept}"

    def fresh_folder():
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
            os.makedirs(tmp)

    def files():
        rng = {"torch": torch.get_rng_state(), "python": random.getstate(),
               "cuda": torch.cuda.get_rng_state(job.device) if job.device.type == "cuda" else None}
        _torch_save_atomic(rng, os.path.join(tmp, _rng_file(rank)))
        if rank == 0:
            _torch_save_atomic({"state_dict": opt.state_dict(), "param_names": param_names},
                               os.path.join(tmp, "optimizer.pt"))
            _write_json(os.path.join(tmp, "trainer_state.json"), {"step": step, "losses": losses, "segments": segments})
            _write_json(os.path.join(tmp, "config.json"), {
                "format": CHECKPOINT_FORMAT, "run": job.config,
                "info": {"step": step, "steps_planned": job.args.steps, "written": _now(),
                         "model_source": job.spec.source, "data_source": job.data_info["source"],
                         "policy": {k: getattr(_policy(job.args, job.args.pool_budget), k) for k in (
                             "chunk_bytes", "keep_ratio", "persist_ratio", "prefetch_depth", "collective_bytes")},
                         "pool_budget": _budget_label(job.args.pool_budget)},
            })

    def swap():
        if rank != 0:
            return
        missing = [f for f in _SHARED_FILES + tuple(_rng_file(r) for r in range(job.world_size))
                   if not os.path.isfile(os.path.join(tmp, f))]
        if missing:
            raise FinetuneError(f"{missing} are missing from {tmp} (every rank must see --save-dir on one shared file system)")
        old = os.path.join(save_dir, _CKPT_OLD)
        shutil.rmtree(old, ignore_errors=True)
        if os.path.exists(final):
            os.replace(final, old)
        os.replace(tmp, final)
        shutil.rmtree(old, ignore_errors=True)

    _collective(job, fresh_folder, what)
    _collective(job, files, what)
    _save_adapter_agreed(job, model, tmp, what)
    _collective(job, swap, what)
    job.checkpoint_step = step


def _write_json(path: str, obj) -> None:
    def write(p):
        with open(p, "w") as f:
            json.dump(obj, f, indent=1)
            f.write("\n")

    _write_bytes_atomic(path, write)


def _write_text(path: str, text: str) -> None:
    def write(p):
        with open(p, "w") as f:
            f.write(text)

    _write_bytes_atomic(path, write)


def _now() -> str:
    return datetime.datetime.now().isoformat(timespec="seconds")


# ============================================================================ preparation


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
    memory: object = None  # python_api.measure.PeakMemory, set by run()
    checkpoint_step: int | None = None  # the step of the last complete checkpoint in save_dir/checkpoint


def _device(args, local_rank: int) -> torch.device:
    if args.device == "cpu" or (args.device == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise FinetuneError("--device cuda, but torch sees no CUDA device")
    if local_rank >= torch.cuda.device_count():
        raise FinetuneError(f"local rank {local_rank} has no GPU ({torch.cuda.device_count()} visible); use fewer processes per node")
    return torch.device("cuda", local_rank)


LOCK_FILE = ".elastic-finetune.lock"

# [Note: the save-dir lock]
# Rank 0 holds an exclusive flock on save_dir/LOCK_FILE from before the first write to its
# exit (the kernel drops it when the process ends, however it ends), and writes its pid and
# host into it. A second run into the same folder is refused: prepare() tries the lock
# (without writing) to refuse before anything starts, and the lock taken after the process
# group is up closes the window between two runs that pass prepare() at the same moment. The
# file stays (removing a lock file races with a run that has just opened it) and does not
# count as content of the folder. flock works across nodes on NFS (Linux emulates it with
# POSIX locks there).


def _lock_holder(fd: int) -> str:
    with contextlib.suppress(OSError, UnicodeDecodeError):
        text = os.pread(fd, 200, 0).decode().split()
        if len(text) >= 2:
            return f" (pid {text[0]} on {text[1]})"
    return ""


def _check_not_locked(save_dir: str) -> None:
    """prepare()'s test of the lock: fails if another run holds it; writes nothing."""
    path = os.path.join(save_dir, LOCK_FILE)
    try:
        fd = os.open(path, os.O_RDWR)  # read-write: NFS's emulation of flock needs it for LOCK_EX
    except OSError:
        return  # no lock file (or unreadable: the write probe tells)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        raise FinetuneError(
            f"--save-dir {save_dir} is in use by another {PROG} run{_lock_holder(fd)} (it holds {path}); "
            f"wait for it to finish or pass another --save-dir"
        ) from None
    except OSError:
        pass  # a file system without locks: the lock taken at the start will say so
    finally:
        os.close(fd)  # also releases the probe's lock


def lock_save_dir(save_dir: str) -> int:
    """Create save_dir and take its lock (see [Note: the save-dir lock]); returns the file
    descriptor that holds it (close it to release)."""
    path = os.path.join(save_dir, LOCK_FILE)
    try:
        os.makedirs(save_dir, exist_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
    except OSError as exc:
        raise OutputError(path, exc) from exc
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = _lock_holder(fd)
        os.close(fd)
        raise FinetuneError(
            f"--save-dir {save_dir} is in use by another {PROG} run{holder} (it holds {path}); "
            f"wait for it to finish or pass another --save-dir"
        ) from None
    except OSError as exc:
        os.close(fd)
        raise FinetuneError(f"--save-dir {save_dir}: cannot lock {path}: {exc.strerror}") from exc
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()} {socket.gethostname()}\n".encode(), 0)
    except OSError as exc:
        os.close(fd)
        raise OutputError(path, exc) from exc
    return fd


def _check_writable(save_dir: str) -> None:
    """Create and remove a file in save_dir (or, when it does not exist yet, a folder in its
    nearest existing ancestor): a read-only mount or folder, or a path under a regular file,
    is refused now rather than by the first checkpoint after training. Leaves nothing."""
    existing = save_dir
    while not os.path.exists(existing):
        parent = os.path.dirname(existing)
        if parent == existing:
            break
        existing = parent
    if not os.path.isdir(existing):
        raise FinetuneError(f"--save-dir {save_dir} cannot be created: {existing} is a file, not a directory")
    try:
        if existing == save_dir:
            fd, probe = tempfile.mkstemp(prefix=".write-probe-", dir=save_dir)
            os.close(fd)
            os.unlink(probe)
        else:
            os.rmdir(tempfile.mkdtemp(prefix=".write-probe-", dir=existing))
    except OSError as exc:
        where = "" if existing == save_dir else f" (cannot create it in {existing})"
        raise FinetuneError(f"--save-dir {save_dir} is not writable{where}: {exc.strerror or exc}") from exc


def _check_save_dir(args, resume_ckpt: str | None) -> str:
    save_dir = args.save_dir
    if save_dir is None:
        save_dir = os.path.dirname(resume_ckpt) if resume_ckpt and os.path.basename(resume_ckpt) == CKPT else (
            resume_ckpt if resume_ckpt else os.path.join("out", "finetune"))
    save_dir = os.path.abspath(save_dir)
    if os.path.exists(save_dir) and not os.path.isdir(save_dir):
        raise FinetuneError(f"--save-dir {save_dir} exists and is not a directory")
    if os.path.isdir(save_dir):
        _check_not_locked(save_dir)
    content = os.path.isdir(save_dir) and [f for f in os.listdir(save_dir) if f != LOCK_FILE]
    if content and not args.overwrite:
        own = resume_ckpt is not None and os.path.realpath(os.path.join(save_dir, CKPT)) == os.path.realpath(resume_ckpt)
        own = own or (resume_ckpt is not None and os.path.realpath(save_dir) == os.path.realpath(resume_ckpt))
        if not own:
            raise FinetuneError(
                f"--save-dir {save_dir} is not empty (results or a checkpoint of another run); pass --overwrite "
                f"to replace them, --resume {save_dir} to continue that run, or another --save-dir"
            )
    _check_writable(save_dir)
    return save_dir


def prepare(args, rank: int, world_size: int, local_rank: int) -> Job:
    """Everything that can be checked before the first collective: options, model directory,
    tokenizer, data, targets, output folder, checkpoint. Raises FinetuneError."""
    if args.resume is not None and (args.baseline != "none" or args.compare_budgets):
        raise FinetuneError(
            "--resume continues the elastic run only; --baseline and --compare-budgets train from scratch "
            "(run them without --resume)"
        )
    device = _device(args, local_rank)
    spec = _resolve_model(args)
    windows, data_info = _resolve_data(args, spec)
    targets, adapter_shapes = _resolved_targets(spec, args)
    config = run_configuration(args, spec, data_info, targets, world_size)
    resume = None
    resume_ckpt = _find_checkpoint(args.resume) if args.resume is not None else None
    save_dir = _check_save_dir(args, resume_ckpt)
    if args.resume is not None:
        resume = read_checkpoint(args.resume, rank, config, args.steps, adapter_shapes)
    return Job(args, rank, world_size, local_rank, device, spec, windows, data_info, targets, config, save_dir, resume)


# ============================================================================ engines


class ElasticEngine:
    """The model under convert_to_elastic; gradient accumulation through the runtime's no_sync."""

    kind = "elastic"

    def __init__(self, job: Job, budget):
        from python_api.elastic_linear import runtime_of
        from python_api.lora import convert_to_elastic

        model = _collective_build(job)
        self.model = convert_to_elastic(model, _lora_config(job.args), _policy(job.args, budget))
        self.runtime = runtime_of(self.model)
        frozen = sum(math.prod(et.shape) * et.shard.element_size() for et in self.runtime.tensors)
        self.frozen_bytes = frozen
        if isinstance(budget, tuple):
            self.budget_bytes = int(budget[1] * frozen)
        else:
            self.budget_bytes = budget
        self.runtime.set_pool_budget(self.budget_bytes)
        self.name = f"elastic, budget {_budget_label(budget)}"

    def params(self) -> list[tuple[str, nn.Parameter]]:
        return [(n, p) for n, p in self.model.named_parameters() if p.requires_grad]

    def accumulate(self, is_last: bool):
        return contextlib.nullcontext() if is_last else self.runtime.no_sync()

    def gathered_bytes(self) -> int:
        return self.runtime.stats()["allgather_bytes"]


class FSDP2Engine:
    """The same base model with PEFT LoRA (same initial adapters), fully_shard per decoder layer
    (reshard_after_forward=True) and on the root."""

    kind = "fsdp2"
    name = "FSDP2 + PEFT (reshard after forward)"

    def __init__(self, job: Job, counter):
        from peft import LoraConfig, get_peft_model
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        args = job.args
        base = _collective_build(job)
        self.model = get_peft_model(base, LoraConfig(
            r=args.lora_r, lora_alpha=args.lora_alpha, lora_dropout=args.lora_dropout,
            target_modules=_target_list(args), use_rslora=False,
        ))
        _adapters_into_peft(self.model, job.initial_adapters)
        layer_types = set(getattr(base, "_no_split_modules", None) or [])
        layers = [m for m in self.model.modules() if type(m).__name__ in layer_types]
        if not layers:
            raise FinetuneError(f"--baseline fsdp2: cannot find the decoder layers of {type(base).__name__} (_no_split_modules)")
        mesh = init_device_mesh(job.device.type, (job.world_size,))
        for layer in layers:
            fully_shard(layer, mesh=mesh, reshard_after_forward=True)
        fully_shard(self.model, mesh=mesh)
        self.counter = counter

    def params(self):
        return [(n, p) for n, p in self.model.named_parameters() if p.requires_grad]

    def accumulate(self, is_last: bool):
        self.model.set_requires_gradient_sync(is_last)
        return contextlib.nullcontext()

    def gathered_bytes(self) -> int:
        return self.counter.bytes


def _adapters_into_peft(peft_model, state: dict) -> None:
    """Copy adapters saved under PEFT's file names (base_model.model.<module>.lora_A.weight)
    into a PEFT model's modules; every LoRA module must get one, and every tensor must land."""
    from peft.tuners.lora import LoraLayer

    inner = peft_model.base_model.model
    names = {n for n, m in inner.named_modules() if isinstance(m, LoraLayer)}
    wanted = {k[len("base_model.model."):].rsplit(".lora_", 1)[0] for k in state}
    if names != wanted:
        raise FinetuneError(
            f"--baseline fsdp2: PEFT put LoRA on {len(names)} modules, the elastic model on {len(wanted)}; "
            f"differing: {sorted(names ^ wanted)[:4]}"
        )
    with torch.no_grad():
        for key, value in state.items():
            module_name, _, rest = key[len("base_model.model."):].rpartition(".lora_")
            which = "lora_A" if rest.startswith("A.") else "lora_B"
            getattr(inner.get_submodule(module_name), which)["default"].weight.copy_(value)


def _agree(error: str | None, world_size: int) -> None:
    """Collective: raise FinetuneError on every rank if any rank has an error."""
    errors = [None] * world_size
    dist.all_gather_object(errors, error)
    bad = [(r, e) for r, e in enumerate(errors) if e]
    if not bad:
        return
    if len({e for _, e in bad}) == 1:
        msg = bad[0][1]
        if len(bad) < world_size:
            msg += f" (on rank{'s' if len(bad) > 1 else ''} {', '.join(str(r) for r, _ in bad)})"
        raise FinetuneError(msg)
    raise FinetuneError("; ".join(f"rank {r}: {e}" for r, e in bad))


def _collective_build(job: Job) -> nn.Module:
    """Build the base model on every rank and check its weights are finite; a failure
    anywhere is an error everywhere."""
    model, err = None, None
    try:
        model = job.spec.build()
        _check_finite_weights(model, job.spec)
        model = model.to(job.device)
    except FinetuneError as exc:
        err = str(exc)
    _agree(err, job.world_size)
    return model


def _check_finite_weights(model: nn.Module, spec: ModelSpec) -> None:
    """NaN or Inf in the base weights makes every loss NaN from step 1, whatever the learning
    rate: say so before training (one pass over the weights, on the CPU copy)."""
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        if _nonfinite(t):
            what = "the embedded model" if spec.embedded else f"the model in {spec.source}"
            cast = (f" (or values beyond the range of {str(spec.dtype).replace('torch.', '')} became Inf when "
                    f"loaded in it: try --dtype float32 or bfloat16)") if spec.dtype == torch.float16 else ""
            raise FinetuneError(
                f"the base weights of {what} hold NaN or Inf values ({name}, {int((~torch.isfinite(t)).sum())} of "
                f"{t.numel()}): the weights are damaged{cast}; every loss would be NaN, whatever --lr"
            )


# ============================================================================ training


def _seed_rng(seed: int, rank: int, device: torch.device) -> None:
    s = (seed * 1_000_003 + rank) & 0xFFFFFFFFFFFF
    torch.manual_seed(s)
    random.seed(s)
    if device.type == "cuda":
        torch.cuda.manual_seed(s)


def _restore_rng(rng: dict, device: torch.device) -> None:
    torch.set_rng_state(rng["torch"])
    random.setstate(_to_tuple(rng["python"]))
    if device.type == "cuda" and rng.get("cuda") is not None:
        torch.cuda.set_rng_state(rng["cuda"], device)


def _to_tuple(x):
    return tuple(_to_tuple(v) for v in x) if isinstance(x, (list, tuple)) else x


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _lr_at(args, step: int) -> float:
    if args.warmup_steps and step < args.warmup_steps:
        return args.lr * (step + 1) / args.warmup_steps
    return args.lr


# [Note: segments of a run]
# A run resumed one or more times is trained by several processes, each from some step to
# another, each possibly at its own pool budget (residency only: the losses are the same).
# trainer_state.json keeps one segment per process: its steps, pool budget, and the figures
# the report is made of (step times, all-gather bytes, peak memory). The report's figures are
# those of the last segment (the process that trained last); losses.csv and the loss curve
# span every step, labelled with each segment's budget. A resume of a checkpoint written at
# the planned last step (the process was killed after it, before the report) trains nothing
# and writes the adapter and the report from the checkpoint and its last segment.


def _segments_label(segments: list[dict]) -> str | None:
    """'elastic, budget all (steps 1-4), 0 (steps 5-8)', or None when one budget covers all."""
    if len({seg["pool_budget"] for seg in segments}) < 2:
        return None
    parts = [f"{seg['pool_budget']} (step{'s' if seg['last_step'] > seg['first_step'] else ''} {seg['first_step']}"
             f"{'-' + str(seg['last_step']) if seg['last_step'] > seg['first_step'] else ''})"
             for seg in segments if seg["last_step"] >= seg["first_step"]]
    return "elastic, budget " + ", ".join(parts)


def _nan_message(job: Job, engine, loss: float, step: int, start: int, named) -> str:
    """Tell apart what a non-finite loss can come from. The base weights were checked when
    the model was built, and a resumed checkpoint's adapters and optimizer state when it was
    read, so: a non-finite loss on the first step of this process, before any update, is the
    forward pass overflowing in the model's dtype; a later one is training diverging (or,
    in float16, an update that overflowed)."""
    args = job.args
    dtype = args.dtype
    broken = [n for n, p in named if _nonfinite(p.detach())]
    head = f"{engine.name}: the loss is {loss} at step {step + 1}"
    if step == start:
        origin = "the initial adapters" if job.resume is None else f"the adapters of checkpoint {job.resume.path}"
        return (f"{head}, before any update, with finite base weights and {origin}: the forward pass overflows in "
                f"{dtype}" + ("; use --dtype bfloat16 (float32's range) or float32" if dtype == "float16" else
                              "; check the data and the model (this is not a learning-rate problem)"))
    updates = step - start
    adapters = (f"the adapters hold NaN/Inf ({broken[0]}{' and more' if len(broken) > 1 else ''})" if broken
                else "the adapters are still finite")
    fp16 = "; in float16, also try --dtype bfloat16" if dtype == "float16" else ""
    return (f"{head}, after {updates} update{'s' if updates > 1 else ''} from finite weights ({adapters}): training "
            f"diverged; lower --lr (now {args.lr:g}) or add --warmup-steps{fp16}")


def train(job: Job, engine, counter, primary: bool) -> dict:
    """Train `engine.model` for the job's steps; return the run's measurements."""
    from tqdm import tqdm

    args, rank, W, device = job.args, job.rank, job.world_size, job.device
    model = engine.model
    named = engine.params()
    names = [n for n, _ in named]
    opt = torch.optim.AdamW([p for _, p in named], lr=args.lr, betas=ADAM_BETAS, eps=ADAM_EPS, weight_decay=args.weight_decay)
    start, losses, segments = 0, [], []
    if primary and job.resume is not None:
        from python_api.lora import load_adapter

        r = job.resume
        if r.param_names != names:
            raise FinetuneError(f"checkpoint {r.path}: its optimizer state belongs to other parameters than this model's adapters")
        try:
            load_adapter(model, r.path)
            opt.load_state_dict(r.optimizer)
        except (ValueError, KeyError, TypeError, RuntimeError) as exc:
            # read_checkpoint checked the files; this is the last line, on every rank alike.
            raise FinetuneError(f"checkpoint {r.path} cannot be loaded: {type(exc).__name__}: {exc}") from exc
        start, losses, segments = r.step, list(r.losses), list(r.segments)
        _restore_rng(r.rng, device)
        job.checkpoint_step = r.step
    else:
        _seed_rng(args.seed, rank, device)
    mem = job.memory
    mem.reset_peak()
    tokens_per_step = W * args.micro_batch * args.grad_accum * args.seq_len
    times, gathered, counted = [], [], []

    def segment(peak) -> dict:
        return {"first_step": start + 1, "last_step": start + len(times), "pool_budget": _budget_label(args.pool_budget),
                "step_times_s": list(times), "allgather_bytes_per_step": list(gathered),
                "allgather_bytes_counted_per_step": list(counted), "peak_memory_bytes": peak}

    bar = tqdm(total=args.steps, initial=start, desc=engine.name, disable=(rank != 0 or args.no_progress),
               dynamic_ncols=True, leave=True, file=sys.stderr)
    model.train()
    for step in range(start, args.steps):
        for group in opt.param_groups:
            group["lr"] = _lr_at(args, step)
        batch = job.windows.batch(args.seed, step, W, rank, args.micro_batch, args.grad_accum).to(device)
        g0, c0 = engine.gathered_bytes(), counter.bytes
        _sync(device)
        t0 = time.perf_counter()
        total = torch.zeros((), dtype=torch.float64, device=device)
        for a in range(args.grad_accum):
            with engine.accumulate(is_last=a == args.grad_accum - 1):
                out = model(input_ids=batch[a], labels=batch[a])
                (out.loss / args.grad_accum).backward()
            total += out.loss.detach().double()
        opt.step()
        opt.zero_grad(set_to_none=True)
        dist.all_reduce(total)
        loss = total.item() / (args.grad_accum * W)
        _sync(device)
        times.append(time.perf_counter() - t0)
        gathered.append(engine.gathered_bytes() - g0)
        counted.append(counter.bytes - c0)
        if not math.isfinite(loss):
            # The loss is all-reduced and the adapters replicated: every rank raises alike.
            raise FinetuneError(_nan_message(job, engine, loss, step, start, named))
        losses.append(loss)
        steady = _tokens_per_s(times, tokens_per_step)
        bar.set_postfix(loss=f"{loss:.4f}", tok_s=f"{steady:.0f}" if steady else "-")
        bar.update(1)
        if primary and args.save_every and (step + 1) % args.save_every == 0 and step + 1 < args.steps:
            write_checkpoint(job, model, opt, names, step + 1, losses, segments + [segment(mem.peak_above_baseline())])
    bar.close()
    peak = mem.peak_above_baseline()
    first_step = start + 1
    if primary and times:
        segments = segments + [segment(peak)]
        write_checkpoint(job, model, opt, names, args.steps, losses, segments)
    elif primary and segments:
        # Resumed at the last step: nothing trained; report the figures of the process that
        # trained the last steps (see [Note: segments of a run]).
        last = segments[-1]
        times, gathered, counted = last["step_times_s"], last["allgather_bytes_per_step"], last["allgather_bytes_counted_per_step"]
        peak, first_step = last["peak_memory_bytes"], last["first_step"]
    model.eval()
    with torch.no_grad():
        probe = job.windows.probe.to(device)
        out = model(input_ids=probe, labels=probe)
    model.train()
    first = gathered[0] if gathered else 0
    steady_bytes = (sum(gathered[1:]) / (len(gathered) - 1)) if len(gathered) > 1 else float(first)
    result = {
        "name": engine.name,
        "kind": engine.kind,
        "losses": losses,
        "steps_run": len(times),
        "first_step": first_step,
        "step_times_s": times,
        "tokens_per_step": tokens_per_step,
        "tokens_per_s": _tokens_per_s(times, tokens_per_step) or (tokens_per_step / times[0] if times else None),
        "peak_memory_bytes": peak,
        "allgather_bytes_per_step": gathered,
        "allgather_bytes_counted_per_step": counted,
        "allgather_bytes_first_step": first,
        "allgather_bytes_steady": steady_bytes,
        "final_loss": losses[-1],
        "heldout_loss": float(out.loss),
    }
    if primary:
        result["segments"] = [{k: v for k, v in seg.items() if k in ("first_step", "last_step", "pool_budget")}
                              for seg in segments]
        label = _segments_label(segments)
        if label is not None:
            result["losses_label"] = label
    if engine.kind == "elastic":
        result["budget_bytes"] = engine.budget_bytes
        result["frozen_bytes"] = engine.frozen_bytes
        result["runtime_stats"] = engine.runtime.stats()
    if primary:
        result["probe_logits"] = out.logits.detach().float().cpu()
    return result


def _tokens_per_s(times: list[float], tokens_per_step: int) -> float | None:
    """Steady state: global tokens per step over the median time of the steps after the first
    of this process (the first learns the layer order, gathers everything and warms the
    allocators). The median, not the mean: on a shared machine a few steps stall for reasons
    that have nothing to do with the run."""
    if len(times) < 2:
        return None
    return tokens_per_step / statistics.median(times[1:])


def run(job: Job) -> dict:
    """The whole job on every rank; rank 0 writes the report. Returns the summary."""
    from python_api.lora import adapter_state_dict
    from python_api.measure import AllGatherCounter, PeakMemory

    args = job.args
    job.memory = PeakMemory(job.device)
    runs = []
    if job.rank == 0:
        print(f"{PROG}: {job.spec.description()}; {job.world_size} ranks on {job.device.type} "
              f"({dist.get_backend()}); data {job.data_info['source']}, {job.data_info['tokens']} tokens; "
              f"{job.world_size * args.micro_batch * args.grad_accum} sequences x {args.seq_len} tokens per step; "
              f"LoRA r={args.lora_r} alpha={args.lora_alpha:g} on {len(job.targets)} modules; output {job.save_dir}",
              flush=True)
        if job.resume is not None:
            print(f"{PROG}: resuming from {job.resume.path} at step {job.resume.step}", flush=True)
    with AllGatherCounter() as counter:
        # 1. the elastic run (checkpointed, its adapter exported)
        job.memory.set_baseline()
        engine = ElasticEngine(job, args.pool_budget)
        # A copy: adapter_state_dict's CPU tensors share storage with the parameters.
        job.initial_adapters = {k: v.clone() for k, v in adapter_state_dict(engine.model).items()}
        result = train(job, engine, counter, primary=True)
        _save_adapter_agreed(job, engine.model, os.path.join(job.save_dir, "adapter"), "the trained adapter was not saved")
        probe_logits = result.pop("probe_logits")

        def probe():
            if job.rank == 0:
                from safetensors.torch import save_file

                _write_bytes_atomic(os.path.join(job.save_dir, "probe.safetensors"), lambda p: save_file(
                    {"input_ids": job.windows.probe.contiguous(), "logits": probe_logits.contiguous()}, p))

        _collective(job, probe, "the probe batch was not saved")  # also the barrier after the elastic run
        runs.append(result)
        del engine
        gc.collect()
        # 2. more elastic budgets, from scratch
        for budget in args.compare_budgets:
            job.memory.set_baseline()
            engine = ElasticEngine(job, budget)
            runs.append(train(job, engine, counter, primary=False))
            del engine
            gc.collect()
            dist.barrier()
        # 3. the FSDP2 baseline, from scratch
        if args.baseline == "fsdp2":
            job.memory.set_baseline()
            engine = FSDP2Engine(job, counter)
            runs.append(train(job, engine, counter, primary=False))
            del engine
            gc.collect()
            dist.barrier()
    summary = _summary(job, runs)
    _collective(job, lambda: _write_report(job, runs, summary) if job.rank == 0 else None,
                "the report was not written (the adapter and checkpoint were)")
    return summary


def _summary(job: Job, runs: list[dict]) -> dict:
    from python_api.measure import device_name

    base = next((r for r in runs if r["kind"] == "fsdp2"), None)
    for r in runs:
        if base is not None and r is not base:
            n = min(len(r["losses"]), len(base["losses"]))
            r["max_abs_loss_diff_vs_fsdp2"] = max(abs(a - b) for a, b in zip(r["losses"][:n], base["losses"][:n]))
            r["steps_compared_with_fsdp2"] = n
    return {
        "command": " ".join([PROG] + sys.argv[1:]) if job.args._argv is None else " ".join([PROG] + job.args._argv),
        "date": _now(),
        "machine": device_name(job.device),
        "world_size": job.world_size,
        "backend": dist.get_backend(),
        "torch": torch.__version__,
        "model": job.spec.description(),
        "data": job.data_info,
        "config": job.config,
        "save_dir": job.save_dir,
        "resumed_from": job.resume.path if job.resume is not None else None,
        "runs": runs,
    }


def _write_report(job: Job, runs: list[dict], summary: dict) -> None:
    from python_api import report

    d = job.save_dir
    rows = report.table_rows(runs)
    args = job.args
    caption = (f"{summary['date'][:10]} · {summary['machine']} · {job.world_size} ranks ({summary['backend']}) · "
               f"{job.spec.description()} · {job.world_size * args.micro_batch * args.grad_accum}x{args.seq_len} "
               f"tokens/step · LoRA r={args.lora_r}")
    md = (f"Command: `{summary['command']}`  \n"
          f"Date: {summary['date']}; machine: {summary['machine']}; {job.world_size} ranks, {summary['backend']}; "
          f"torch {summary['torch']}  \n"
          f"Model: {summary['model']}; data: {job.data_info['source']} ({job.data_info['tokens']} tokens)\n\n"
          + report.markdown_table(rows))
    for r in runs:
        if "max_abs_loss_diff_vs_fsdp2" in r:
            md += (f"\n{r['name']}: max |loss - FSDP2 loss| over {r['steps_compared_with_fsdp2']} steps = "
                   f"{r['max_abs_loss_diff_vs_fsdp2']:.3g}  ")
    md += "\n"
    _write_text(os.path.join(d, "results.md"), md)
    _write_text(os.path.join(d, "results.csv"), report.csv_text(rows))
    _write_text(os.path.join(d, "losses.csv"), report.losses_csv(runs))
    _write_json(os.path.join(d, "summary.json"), summary)
    png = os.path.join(d, "finetune.png")
    _write_bytes_atomic(png, lambda p: report.plot(runs, p, caption))
    print()
    print(report.text_table(rows), end="")
    for r in runs:
        if "max_abs_loss_diff_vs_fsdp2" in r:
            print(f"{r['name']}: max |loss - FSDP2 loss| = {r['max_abs_loss_diff_vs_fsdp2']:.3g}")
    print(f"\ntable:   {os.path.join(d, 'results.md')} (and results.csv)")
    print(f"picture: {png}")
    print(f"adapter: {os.path.join(d, 'adapter')} (PEFT format)")
    print(f"checkpoint: {os.path.join(d, CKPT)}; losses: {os.path.join(d, 'losses.csv')}; all figures: {os.path.join(d, 'summary.json')}")


# ============================================================================ entry point


def _dist_env() -> tuple[int, int, int]:
    """Rank, world size and local rank from torchrun's environment; a lone process (no
    torchrun) gets a one-process group on a free local port."""
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        import socket

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ.get("LOCAL_RANK", "0"))


# [Note: a rank that stops]
# A rank that dies closes its connections: its peers fail at once ("Connection closed by
# peer") and exit. A rank that stops (SIGSTOP, a hung driver, a swapped-out node) keeps them
# open: its peers wait in their next collective for --timeout-s (the process group's timeout
# and the runtime's collective timeout), then fail with "Timed out ..." and exit (reported by
# main() as one line). Nothing inside the stopped process runs, so no timeout of its own can
# fire, and nothing in this CLI can see it. What ends it is its torchrun agent: with the
# static rendezvous (--master-addr/--master-port) the agent only checks that its workers are
# alive, which a stopped one is, and waits forever; with --rdzv-backend c10d the agent syncs
# with the rendezvous store every --monitor-interval seconds, so when the store's host (the
# agent at --rdzv-endpoint) exits, the other agents fail their next sync and stop their
# workers (SIGTERM, then SIGKILL after the shutdown timeout, which ends a stopped process
# too). Measured on one machine (two 'nodes', --timeout-s 20, --monitor-interval 1):
# static, the surviving side exits after 25 s and the stopped side is still there 80 s later;
# c10d, 24 s and 56 s.


def _peer_failure(exc: BaseException) -> bool:
    """A collective that failed because of another rank (its exit, a stop, a timeout), as
    opposed to an error of this rank's own."""
    if isinstance(exc, dist.DistError):
        return True
    text = str(exc)
    return isinstance(exc, RuntimeError) and any(s in text for s in (
        "Timed out", "timed out", "Connection closed by peer", "Connection reset by peer", "Broken pipe"))


def main(argv=None) -> int:
    # transformers 5.23 warns about its own deprecated attribute whenever FSDP2 inspects the
    # model; it says nothing about this job.
    warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.* is deprecated")
    args = parse_args(argv)
    args._argv = None if argv is None else list(argv)
    rank, world_size, local_rank = _dist_env()
    job, error = None, None
    try:
        job = prepare(args, rank, world_size, local_rank)
    except FinetuneError as exc:
        error = str(exc)
    try:
        device = job.device if job is not None else _device(args, local_rank)
    except FinetuneError:
        device = torch.device("cpu")
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=args.timeout_s),
                            device_id=device if device.type == "cuda" else None)
    lock = None
    try:
        _agree(error, world_size)
        _agree_configuration(job)
        error = None
        if rank == 0:
            try:
                lock = lock_save_dir(job.save_dir)
            except FinetuneError as exc:
                error = str(exc)
        _agree(error, world_size)
        run(job)
    except FinetuneError as exc:
        # One write per message: several ranks share the terminal or pipe.
        sys.stderr.flush()
        os.write(2, f"{PROG}: error: {exc}\n".encode())
        return 2
    except Exception as exc:  # noqa: BLE001 - only a peer's failure is reported here; the rest re-raised
        if not _peer_failure(exc):
            raise
        first = (str(exc).strip().splitlines() or [""])[0][:300]
        sys.stderr.flush()
        os.write(2, (f"{PROG}: error: rank {rank}: a collective did not complete ({type(exc).__name__}: {first}): "
                     f"another rank stopped, crashed, was killed or fell more than --timeout-s ({args.timeout_s:g} s) "
                     f"behind; see that rank's output (checkpoints, if any: "
                     f"{os.path.join(job.save_dir, CKPT) if job is not None else '--save-dir'}). A stopped, not "
                     f"dead, rank on another node is not ended by torchrun's static rendezvous: launch with "
                     f"--rdzv-backend c10d (see [Note: a rank that stops] in python_api/finetune.py)\n").encode())
        return 1
    finally:
        if lock is not None:
            os.close(lock)  # releases the save-dir lock (so does the process's exit)
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
