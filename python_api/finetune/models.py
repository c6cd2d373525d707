"""The base model (embedded or a Hugging Face directory), its tokenizer, the data, and the
LoRA targets: resolved from the options, checked before anything runs."""

from __future__ import annotations

import copy
import os
from dataclasses import dataclass

import torch
import torch.nn as nn

from ..config import ElasticPolicy
from ..loading import LoadError, SafetensorsSource, checkpoint_dtype, read_config
from ..loading.bnb import PackedFormatError, compute_dtype, packed_format
from ..nn import LoRAConfig, target_names
from .configuration import FinetuneConfig, LoRAConfig as LoRAOptions, config_of
from .constants import EMBEDDED, EMBEDDED_MAX_POSITIONS, EMBEDDED_VOCAB, PROBE_SEQS
from .data import (
    ByteTokenizer,
    DataError,
    HFTokenizer,
    TokenWindows,
    embedded_documents,
    read_data_file,
    token_digest,
    tokenize,
)
from .errors import FinetuneError


@dataclass
class ModelSpec:
    """Where the base model comes from; `build()` makes a fresh copy on the CPU each time."""

    source: str  # "embedded" or an absolute directory
    config: object  # transformers.PretrainedConfig
    dtype: torch.dtype
    seed: int
    tokenizer: object
    # What a saved adapter names as its base (adapter_config.json's base_model_name_or_path):
    # the hub id, or the directory (the cached one for a known name or a .gguf); None for tiny.
    name: str | None = None
    # A bitsandbytes 4-bit checkpoint's format (loading/bnb.py Bnb4bitFormat), else None: its
    # packed weights are read as they are, by the elastic runtime only ([Note: the CLI reads
    # bitsandbytes 4-bit checkpoints]); `config` is then the checkpoint's without its
    # quantization_config (nothing in memory is bitsandbytes-packed).
    packed: object = None
    label: str | None = None  # how --model named it, where that is not the path (a known name, a .gguf file)

    @property
    def embedded(self) -> bool:
        return self.source == "embedded"

    def build(self) -> nn.Module:
        if self.embedded:
            return embedded_model(self.config, self.seed, self.dtype)
        if self.packed is not None:  # refused with the options in resolve_model; a direct caller gets this
            raise FinetuneError(f"model directory {self.source} is a {self.packed.describe()} checkpoint: only the "
                                "elastic runtime reads it (its packed weights, as they are)")
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
        what = ("tiny random Llama" if self.embedded else
                f"{self.label} ({c.model_type}, converted into {self.source})" if self.label else
                f"{c.model_type} from {self.name or self.source}")
        packed = "" if self.packed is None else f", {self.packed.describe()} checkpoint"
        return (f"{what}: {c.num_hidden_layers} layers, hidden {c.hidden_size}, intermediate "
                f"{getattr(c, 'intermediate_size', '?')}, vocab {c.vocab_size}, {str(self.dtype).replace('torch.', '')}"
                f"{packed}")


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


TINY = "tiny"  # --model tiny: the embedded random model (the suite's fast model)
DEFAULT_MODEL = "smollm2-135m-instruct"  # --model not given: the cached real model


# [Note: what --model names]
# `--model` is read in this order, the first that applies wins:
#   tiny                       the embedded random Llama (sizes from --hidden-size etc.)
#   a known pretrained name    (loading.pretrained.MODELS, e.g. smollm2-135m-instruct) its cached
#                              HF directory, fetched and converted on first use
#   an existing path           a directory (an HF model directory) or a .gguf file (converted
#                              into the cache, keyed by the file's digest)
#   owner/name                 a Hugging Face hub id, downloaded into the hub's cache
# Not given, it is smollm2-135m-instruct: a new user fine-tunes a real model; the suite and the
# size options say `--model tiny`. A name that is none of these is an error listing the forms.
# The hub is asked with local_files_only only when HF_HUB_OFFLINE is set or it cannot be
# reached (then the local cache is tried); when both fail the error names both attempts.
# Every rank resolves alike: the cache conversion runs under a lock, the hub's cache too.


def resolve_model_path(model: str) -> tuple[str, str]:
    """(kind, absolute HF directory) for `--model` (see [Note: what --model names]); kind is
    "pretrained", "gguf", "directory" or "hub". Raises FinetuneError."""
    from ..loading.pretrained import MODELS, PretrainedError, gguf_dir, pretrained_dir

    try:
        if model in MODELS:
            return "pretrained", str(pretrained_dir(model))
        path = os.path.abspath(os.path.expanduser(model))
        if os.path.lexists(path):
            if os.path.isdir(path):
                return "directory", path
            if path.lower().endswith(".gguf"):
                return "gguf", str(gguf_dir(path))
            raise FinetuneError(f"--model {model} is not a directory or a .gguf file (expected a Hugging Face model "
                                "directory, a .gguf file, a hub id, tiny or one of " + ", ".join(sorted(MODELS)) + ")")
    except PretrainedError as exc:
        raise FinetuneError(f"--model {model}: {exc}") from exc
    if _HUB_ID.fullmatch(model) and not model.lower().endswith(".gguf"):
        return "hub", _hub_snapshot(model)
    raise FinetuneError(
        f"--model {model}: no such directory or file, and not a hub id (owner/name); --model takes a Hugging Face "
        f"model directory, a .gguf file, a hub id, tiny (the random test model) or one of {', '.join(sorted(MODELS))}")


_HUB_ID = __import__("re").compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9][A-Za-z0-9_.-]*")
_HUB_FILES = ["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja", "*.tiktoken"]


def _hub_snapshot(repo_id: str) -> str:
    """The local snapshot of hub model `repo_id`: downloaded when the hub can be reached, else
    (HF_HUB_OFFLINE set, or no connection) the hub's local cache. Raises FinetuneError naming
    what was tried."""
    try:
        from huggingface_hub import snapshot_download
        from huggingface_hub.utils import HfHubHTTPError
    except ImportError as exc:
        raise FinetuneError(f"--model {repo_id}: a hub id needs the huggingface_hub package") from exc
    from huggingface_hub import constants

    tried = []
    if not constants.HF_HUB_OFFLINE:
        try:
            return snapshot_download(repo_id, allow_patterns=_HUB_FILES)
        except HfHubHTTPError as exc:  # the hub answered: the repository is missing, gated or private
            status = getattr(getattr(exc, "response", None), "status_code", None)
            if status is not None and status < 500:
                raise FinetuneError(f"--model {repo_id}: the hub refused it ({type(exc).__name__}: "
                                    f"{str(exc).splitlines()[0]})") from exc
            tried.append(f"downloading from the hub failed ({type(exc).__name__})")
        except Exception as exc:  # noqa: BLE001 - no connection, DNS, timeouts: fall back to the local cache
            tried.append(f"downloading from the hub failed ({type(exc).__name__}: {str(exc).splitlines()[0][:160]})"
                         if str(exc) else f"downloading from the hub failed ({type(exc).__name__})")
    else:
        tried.append("HF_HUB_OFFLINE is set, so the hub was not asked")
    try:
        return snapshot_download(repo_id, allow_patterns=_HUB_FILES, local_files_only=True)
    except Exception as exc:  # noqa: BLE001 - not in the local cache
        tried.append(f"the local hub cache ({constants.HF_HUB_CACHE}) has no snapshot of it ({type(exc).__name__})")
    raise FinetuneError(f"--model {repo_id}: cannot find this hub model: " + "; ".join(tried) +
                        "; pass a local directory (--model DIR) or run once with network access")


def resolve_model(cfg: FinetuneConfig) -> ModelSpec:
    """The base model of the configuration ([Note: what --model names]): its model group and
    seed, and for a bitsandbytes checkpoint the groups that must not need full-precision
    weights (_bnb_checkpoint). `--dtype` not given (None): float32 for the tiny model, the
    checkpoint's dtype otherwise (the spec's dtype: prepare() records it, and the model's name
    resolved (resolved_model_name), in the job's configuration, which the run configuration,
    the checkpoints and the messages name)."""
    m, seed = cfg.model, cfg.training.seed
    dtype = None if m.dtype is None else getattr(torch, m.dtype)
    dims = {k: getattr(m, k) for k in EMBEDDED}
    given = [f"--{k.replace('_', '-')}" for k, v in dims.items() if v is not None]
    if m.model is None:
        if given:
            raise FinetuneError(f"{', '.join(given)} size the tiny random model: add --model tiny (the default "
                                f"model, {DEFAULT_MODEL}, brings its own configuration)")
    model = resolved_model_name(m.model)
    if model == TINY:
        dtype = dtype or torch.float32
        d = {k: (v if v is not None else EMBEDDED[k]) for k, v in dims.items()}
        if d["hidden_size"] % d["num_heads"]:
            raise FinetuneError(f"--hidden-size {d['hidden_size']} is not a multiple of --num-heads {d['num_heads']}")
        if d["num_heads"] % d["num_kv_heads"]:
            raise FinetuneError(f"--num-heads {d['num_heads']} is not a multiple of --num-kv-heads {d['num_kv_heads']}")
        if (d["hidden_size"] // d["num_heads"]) % 2:
            raise FinetuneError(f"head size {d['hidden_size'] // d['num_heads']} must be even (rotary embeddings)")
        config = embedded_config(**d)
        if m.tokenizer not in (None, "bytes"):
            raise FinetuneError(f"--tokenizer {m.tokenizer}: the tiny model's vocabulary is the byte-level "
                                "tokenizer's (257 ids); leave --tokenizer out")
        return ModelSpec("embedded", config, dtype, seed, ByteTokenizer(eos=True))

    if given:
        raise FinetuneError(f"{', '.join(given)} size the tiny model only; --model {model} brings its own configuration")
    kind, path = resolve_model_path(model)
    # The loader's own checks (python_api/loading/): what cannot be listed, read or parsed is
    # named with its reason (permission, a FIFO, a dangling link), never a raw traceback.
    try:
        config = read_config(path)
        source = SafetensorsSource(path)  # every weights file's header (the files the loader will read)
    except LoadError as exc:
        raise FinetuneError(f"--model {model}: {exc}") from exc
    packed = _bnb_checkpoint(cfg, model, config, path, source)
    if dtype is None:  # --dtype not given: the checkpoint's own (a bf16 checkpoint trains in bf16)
        # A bitsandbytes checkpoint computes in its bnb_4bit_compute_dtype, as load_elastic does.
        dtype = (compute_dtype(config) if packed is not None else None) or checkpoint_dtype(config, source)
    if packed is not None:
        config = copy.deepcopy(config)
        del config.quantization_config
    tokenizer = _resolve_tokenizer(path, model, config, m.tokenizer)
    return ModelSpec(path, config, dtype, seed, tokenizer, name=model if kind == "hub" else path,
                     packed=packed, label=model if kind in ("pretrained", "gguf") else None)


def resolved_model_name(model: str | None) -> str:
    """--model as the run names it: the default model when not given."""
    return DEFAULT_MODEL if model is None else model


def dtype_name(dtype: torch.dtype) -> str:
    """--dtype's spelling of a torch dtype (torch.bfloat16 -> "bfloat16")."""
    return str(dtype).replace("torch.", "")


def _bnb_checkpoint(cfg: FinetuneConfig, model: str, config, path, source):
    """The bitsandbytes 4-bit format of `--model`'s checkpoint (None: full precision), checked
    against the files (`source`: their headers) and the configuration (its weight-format,
    peers, pipeline and host-tier groups).

    [Note: the CLI reads bitsandbytes 4-bit checkpoints]
    As `load_elastic` does ([Note: loading a bitsandbytes 4-bit checkpoint] in
    python_api/loading/bnb.py): the elastic runs read the packed codes and scales as they are,
    so the options must store that format (`--weight-format nf4`, `--quant-nested` as the
    checkpoint's double quantization, no other `--quant-block`), and nothing else may need the
    full-precision weights, which the files do not hold: not the peers (`--baseline`), not a
    `--compare-format` run of another format, not pipeline stages (`--pp`: each pack quantizes
    from rows), not the host tier (its store is filled from full-precision rows). Each is refused here, naming the option, before anything runs. The
    run's header names the format (ModelSpec.description) and the dtype is the checkpoint's
    `bnb_4bit_compute_dtype` unless `--dtype` is given.

    [Note: a config that claims quantized weights]
    A config whose `quantization_config` says bitsandbytes 4-bit over files that hold no packed
    tensor is refused, as load_elastic refuses it, and before the options are weighed: the
    weights are full precision and the fix is in config.json (the CLI once ignored the claim
    and trained the full-precision tensors, issue 31). Any other quantization method is refused
    with load_elastic's reason (PackedFormatError)."""
    if getattr(config, "quantization_config", None) is None:
        return None
    where = f"--model {model}"
    d = config.quantization_config
    d = d if isinstance(d, dict) else (d.to_dict() if hasattr(d, "to_dict") else dict(vars(d)))
    nested = bool(d.get("bnb_4bit_use_double_quant", False))
    try:  # what the files are, with the policy that reads them
        fmt = packed_format(config, ElasticPolicy(weight_format="nf4", quant_nested=nested))
    except PackedFormatError as exc:
        raise FinetuneError(f"{where}: {exc}") from exc
    if not source.packed:
        raise FinetuneError(
            f"model directory {path}: the config says the checkpoint is saved quantized ({fmt.describe()}), but no "
            f"tensor of its files is packed (no *.quant_state.bitsandbytes__nf4 record); load_elastic refuses it too. "
            f"If the weights are full precision, remove quantization_config from config.json (--weight-format nf4 "
            f"quantizes them on load)")
    want = "--weight-format nf4" + (" --quant-nested" if nested else "")
    w, peers, pp, host = cfg.weights, cfg.peers, cfg.pipeline, cfg.host
    if w.weight_format != "nf4" or bool(w.quant_nested) != nested or w.quant_block not in (None, 64):
        given = f"--weight-format {w.weight_format}" + (" --quant-nested" if w.quant_nested else "") + (
            f" --quant-block {w.quant_block}" if w.quant_block is not None else "")
        raise FinetuneError(f"{where} is a {fmt.describe()} checkpoint, trained from its packed weights as they are: "
                            f"pass {want} (not {given})")
    others = [f for f in peers.compare_formats if f != "nf4"]
    if others:
        raise FinetuneError(f"{where} is a {fmt.describe()} checkpoint: --compare-format {','.join(others)} would need "
                            f"full-precision weights, which its files do not hold")
    if peers.baselines:
        raise FinetuneError(f"{where} is a {fmt.describe()} checkpoint: --baseline {','.join(peers.baselines)} builds the model "
                            f"from full-precision weights, which its files do not hold (leave --baseline out)")
    if pp.pp == "auto" or pp.pp > 1 or pp.compare_pp is not None:
        raise FinetuneError(f"{where} is a {fmt.describe()} checkpoint: pipeline stages (--pp, --compare-pp) "
                            f"quantize their packs from full-precision rows, which its files do not hold")
    if host.weights_on == "host" or host.host_fraction or peers.compare_host:
        raise FinetuneError(f"{where} is a {fmt.describe()} checkpoint: the host tier (--weights-on host, "
                            f"--host-fraction, --compare-host) fills its store from full-precision rows, which would "
                            f"quantize the weights again; leave them out")
    return fmt


_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")


# [Note: the tokenizer is never silently replaced]
# A model directory without tokenizer files used to train on the byte-level fallback whenever
# its vocabulary had >= 256 ids: the real model's weights without its tokenizer trained (first
# loss 6.78 against 3.64) and exited 0, with an adapter useless beside the real tokenizer. Now:
# the tokenizer is the model directory's, or the one `--tokenizer DIR` names; the byte-level
# fallback is used without asking only when the vocabulary is exactly 256 or 257 ids (bytes,
# and bytes + end-of-document: what the fallback's ids can mean), and otherwise only by name
# (`--tokenizer bytes`), said in the header, results.md and summary.json. A larger vocabulary
# without a tokenizer is refused, naming both fixes.

def _load_hf_tokenizer(path: str, shown: str):
    from transformers import AutoTokenizer

    try:
        return HFTokenizer(AutoTokenizer.from_pretrained(path, local_files_only=True), path)
    except Exception as exc:  # noqa: BLE001
        raise FinetuneError(f"{shown}: cannot load its tokenizer: {type(exc).__name__}: {exc}") from exc


def _resolve_tokenizer(path: str, shown: str, config, choice: str | None = None):
    """The run's tokenizer ([Note: the tokenizer is never silently replaced]): `choice` is
    --tokenizer (None: the model's; "bytes": the byte-level one; else a directory)."""
    vocab = getattr(config, "vocab_size", None)
    if choice == "bytes":
        if vocab is None or vocab < 256:
            raise FinetuneError(f"--tokenizer bytes: the model's vocabulary of {vocab} ids cannot hold the 256 byte ids")
        return ByteTokenizer(eos=vocab > 256)
    if choice is not None:
        tdir = os.path.abspath(os.path.expanduser(choice))
        if not os.path.isdir(tdir):
            raise FinetuneError(f"--tokenizer {choice}: not a directory (expected a folder with tokenizer.json or "
                                "tokenizer_config.json, or `bytes` for the byte-level tokenizer)")
        if not any(os.path.isfile(os.path.join(tdir, f)) for f in _TOKENIZER_FILES):
            raise FinetuneError(f"--tokenizer {choice}: the folder has none of {', '.join(_TOKENIZER_FILES)}")
        tok = _load_hf_tokenizer(tdir, f"--tokenizer {choice}")
    elif any(os.path.isfile(os.path.join(path, f)) for f in _TOKENIZER_FILES):
        return _load_hf_tokenizer(path, f"model directory {shown}")
    elif vocab in (256, 257):
        return ByteTokenizer(eos=vocab > 256)
    else:
        raise FinetuneError(
            f"model directory {shown} has no tokenizer files ({', '.join(_TOKENIZER_FILES)}) and a vocabulary of "
            f"{vocab} ids: its token ids mean nothing without its tokenizer. Pass --tokenizer DIR (a folder with the "
            "model's tokenizer files), add them to the model directory, or ask for the byte-level tokenizer by name "
            "with --tokenizer bytes (its adapters will not work with the model's own tokenizer)")
    if len(tok.tok) > (vocab or 0):
        raise FinetuneError(f"--tokenizer {choice}: its vocabulary has {len(tok.tok)} ids, more than the model's "
                            f"{vocab}: it is not this model's tokenizer")
    return tok


def resolve_data(data_options, seq_len: int, spec: ModelSpec):
    """The job's data: TokenWindows over a text stream, or sft.RecordRows of chat /
    prompt-completion records. --data not given: the embedded instruction set where the
    tokenizer has a chat template (the real model), else the language reference as text.
    `data_options`: the data options (DataConfig); `seq_len`: --seq-len."""
    data = data_options.data
    from .sft import embedded_instructions, has_chat_template, read_jsonl, sft_rows, split_heldout

    try:
        max_pos = getattr(spec.config, "max_position_embeddings", None)
        if max_pos is not None and seq_len > max_pos:
            raise DataError(f"--seq-len {seq_len} exceeds the model's max_position_embeddings ({max_pos})")
        records = None
        if data is None and has_chat_template(spec.tokenizer):
            train, held = embedded_instructions()
            records, source = (train, held), ("embedded: instructions from pydoc_data.topics (\"Explain the Python "
                                              "`<topic>` statement ...\"), held out: " + ", ".join(
                                                  f"`{m.messages[0]['content'].split('`')[1]}`" for m in held))
        elif data is None:
            docs, source = embedded_documents(), "embedded: pydoc_data.topics (Python language reference)"
        else:
            source = os.path.abspath(data)
            ext, content = read_data_file(data)
            if ext == ".txt":
                if not content.strip():
                    raise DataError(f"data file {data} is empty")
                docs = [content]
            else:
                fmt, items = read_jsonl(data, content)
                if fmt == "text":
                    docs = items
                else:
                    records = split_heldout(items)
        if records is not None:
            windows, info = sft_rows(records[0], records[1], spec.tokenizer, data_options, seq_len,
                                     data or "the embedded instructions")
            ids = torch.cat([windows.rows.input_ids.flatten(), windows.probe.flatten()])
            _check_ids(ids, spec)
            info = {"source": source, **info}
            return windows, info
        tokens = tokenize(docs, spec.tokenizer)
        _check_ids(tokens, spec)
        windows = TokenWindows(tokens, seq_len, PROBE_SEQS, data or "the embedded corpus")
    except DataError as exc:
        raise FinetuneError(str(exc)) from exc
    info = {"source": source, "format": "text", "documents": len(docs), "tokens": int(tokens.numel()),
            "sha256": token_digest(tokens)}
    return windows, info


def _check_ids(tokens: torch.Tensor, spec: ModelSpec) -> None:
    vocab = spec.config.vocab_size
    if tokens.numel() and int(tokens.max()) >= vocab:
        raise DataError(f"the tokenizer ({spec.tokenizer.name}) produced id {int(tokens.max())}, outside the model's "
                        f"vocabulary of {vocab}")


def targets_of(lora: LoRAOptions) -> list[str] | str:
    """--lora-targets as PEFT's target_modules: "all-linear" or the list of names."""
    return "all-linear" if lora.lora_targets == "all-linear" else lora.lora_targets.split(",")


def target_list(lora) -> list[str] | str:
    """targets_of of anything with `lora_targets`: the LoRA group, or options held by name
    (parse_args' namespace, an OptionView), as engines.py still passes them."""
    return targets_of(lora)


def lora_config(lora: LoRAOptions, seed: int) -> LoRAConfig:
    """The library's LoRAConfig of the LoRA options, its adapters drawn from `seed`
    (--seed: [Note: initialisation and replication] in python_api/nn/lora.py)."""
    t = targets_of(lora)
    return LoRAConfig(r=lora.lora_r, alpha=lora.lora_alpha, dropout=lora.lora_dropout,
                      target_modules=t if isinstance(t, str) else tuple(t), seed=seed)


def lora_config_of(options) -> LoRAConfig:
    """lora_config of options held by name (parse_args' namespace or an OptionView)."""
    c = config_of(options)
    return lora_config(c.lora, c.training.seed)


def resolved_targets(spec: ModelSpec, lora: LoRAOptions, seed: int) -> tuple[list[str], dict]:
    """The adapted module names, and the adapter tensors they get: PEFT key -> shape (None
    where the module is not an nn.Linear and the shape is not derived here)."""
    meta = spec.meta_model()
    try:
        targets = target_names(meta, lora_config(lora, seed))
    except ValueError as exc:
        raise FinetuneError(f"--lora-targets {lora.lora_targets}: {exc}") from exc
    shapes = {}
    for name in targets:
        m = meta.get_submodule(name)
        linear = isinstance(m, nn.Linear)
        shapes[f"base_model.model.{name}.lora_A.weight"] = (lora.lora_r, m.in_features) if linear else None
        shapes[f"base_model.model.{name}.lora_B.weight"] = (m.out_features, lora.lora_r) if linear else None
    return targets, shapes
