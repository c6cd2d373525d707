"""Building a model on the meta device and loading it from its files, each rank reading only
what it keeps: `load_elastic`, `empty_model`, `params_on_meta`.

    model = load_elastic("path/to/hf_model", LoRAConfig(r=16, alpha=32), ElasticPolicy())

or, step by step (the same thing):

    source = SafetensorsSource("path/to/hf_model", device="cuda")
    model = empty_model("path/to/hf_model", torch.bfloat16)      # parameters on meta
    model = convert_to_elastic(model, lora, policy, source=source)

[Note: loading from files]
`convert_to_elastic` on a model already built in memory needs every rank to hold the whole
model first (one copy per rank). With a `source`, the model is built with its parameters on the
meta device (`empty_model`: shapes and dtypes only; buffers real, as
`accelerate.init_empty_weights(include_buffers=False)` makes them, so non-persistent buffers
such as rotary `inv_freq` keep the values the model's constructor computes), and then
1. `source.check(model)` compares every parameter (and every persistent buffer the files hold)
   with the files' headers: present, same shape, same dtype (or, with `allow_cast`, a floating
   dtype cast on load, as `from_pretrained(dtype=...)` does). Nothing else is read before it
   passes, on every rank (the ranks agree on the outcome in one collective, so a rank whose
   files differ fails all of them instead of leaving its peers waiting);
2. each elastic weight is registered with `rows=source.rows(name)`: the runtime reads only the
   rows its shard needs (`ChunkLayout.shard_from_rows`), about 1/W of the weight, plus 16 rows
   for the fingerprint. A transformers `Conv1D` stores its weight [in, out]; the elastic weight
   is [out, in], so its rows are columns of the stored tensor (`rows(name, transpose=True)`).
   With `ElasticPolicy.weight_format` the rank quantizes on load, one chunk at a time, only the
   rows its slice of each chunk's blob depends on (every row of the chunk with nested scales),
   cast to the model's dtype first: bit for bit the shard quantizing after an in-memory
   conversion gives ([Note: quantized frozen weights] in python_api/quant/__init__.py). A
   checkpoint saved quantized by bitsandbytes 4-bit nf4 (`quantization_config`) loads from
   its packed codes and scales as they are, never requantized, with a policy of the same
   format; other quantized checkpoints are refused before any read ([Note: loading a
   bitsandbytes 4-bit checkpoint] in python_api/loading/bnb.py);
3. every other parameter (embeddings, norms, biases, small replicated linears, a tied lm_head)
   is read whole onto the target device, one tensor at a time, and tied parameters get one
   tensor for all their names, unless the files hold the tied names as different tensors
   (a config saying `tie_word_embeddings=true` over files with their own `lm_head.weight`):
   those are untied, each read from its own tensor, with a LoadWarning, as transformers'
   `from_pretrained` does (`SafetensorsSource.untie_differing`; tying would replace the files'
   head by the embeddings without a word). Tensors of the files that no parameter takes (a
   config with fewer layers than the files) are named in a LoadWarning, as `from_pretrained`
   lists its unexpected keys.
Peak host memory per rank is then its share of the frozen weights + the replicated parameters +
one read at a time (a chunk's rows; a whole Conv1D weight for a column read), never a whole
model: see `tests/loading/test_loading.py::test_meta_loading_peak_rss` for the measured figures.
"""

from __future__ import annotations

import json
import math
import os
import warnings
from contextlib import contextmanager

import torch
import torch.nn as nn

from ..config import ElasticPolicy
from ..distributed.agree import agree, exchange
from ..distributed.launch import ensure_default_group
from ..nn import LoRAConfig, convert_to_elastic, runtime_of
from ..nn.lora import normalize_adapters
from .bnb import PackedFormatError, compute_dtype, packed_format
from .source import LoadError, LoadWarning, SafetensorsSource, check_regular_file, list_directory

# ---------------------------------------------------------------------- building on meta


@contextmanager
def params_on_meta():
    """Inside, every parameter a module registers is moved to the meta device as it is
    registered; buffers stay where they are built (accelerate's
    `init_empty_weights(include_buffers=False)`). A parameter's own initialisation (which runs
    after it is registered, in `reset_parameters`) then costs nothing; the tensor a constructor
    allocates before registering is freed at once, untouched."""
    real_register = nn.Module.register_parameter

    def register_on_meta(module, name, param):
        real_register(module, name, param)
        p = module._parameters.get(name)
        if p is not None and not p.is_meta:
            meta = type(p)(p.to("meta"), requires_grad=p.requires_grad)
            meta.__dict__.update(p.__dict__)
            module._parameters[name] = meta

    nn.Module.register_parameter = register_on_meta
    try:
        yield
    finally:
        nn.Module.register_parameter = real_register


def config_dtype(config) -> torch.dtype | None:
    """The dtype a Hugging Face config names (`dtype`, formerly `torch_dtype`), or None."""
    # transformers 5 names it `dtype` (reading `torch_dtype` there only warns that it is deprecated).
    d = config.dtype if hasattr(config, "dtype") else getattr(config, "torch_dtype", None)
    if isinstance(d, str):
        d = getattr(torch, d, None)
    return d if isinstance(d, torch.dtype) else None


def checkpoint_dtype(config, source: SafetensorsSource) -> torch.dtype:
    """The dtype a model directory is in: its config's (`dtype`, formerly `torch_dtype`), else
    the first floating dtype of its files, else float32 (the dtype `load_elastic` and the
    CLI's `--model DIR` use when none is given)."""
    return config_dtype(config) or next(
        (e.dtype for e in source.entries.values() if e.dtype is not None and e.dtype.is_floating_point), torch.float32)


def read_config(path: str | os.PathLike):
    """The Hugging Face config of model directory `path`, or a LoadError that says why not:
    the directory cannot be listed, config.json is missing, a dangling link, a FIFO (never
    opened: it would block) or unreadable, not JSON, or not a config transformers knows."""
    from transformers import AutoConfig

    path = os.path.abspath(os.fspath(path))
    if not os.path.isdir(path):
        what = "does not exist" if not os.path.lexists(path) else "is not a directory"
        raise LoadError(f"{path} {what} (a Hugging Face model directory holds config.json and *.safetensors)")
    if "config.json" not in list_directory(path):
        raise LoadError(f"{path} has no config.json (a Hugging Face model directory holds config.json and "
                        "*.safetensors)")
    cfg_file = os.path.join(path, "config.json")
    check_regular_file(cfg_file, "the model's config")
    try:
        with open(cfg_file, encoding="utf-8") as f:
            json.load(f)
    except OSError as exc:
        raise LoadError(f"cannot read the model's config {cfg_file}: {exc.strerror or exc}") from exc
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise LoadError(f"the model's config {cfg_file} is not valid JSON: {exc}") from exc
    try:
        return AutoConfig.from_pretrained(path, local_files_only=True)
    except Exception as exc:  # noqa: BLE001 - an unknown model_type, a bad field: a bad model directory
        raise LoadError(f"{path}: cannot read the model's config: {type(exc).__name__}: {exc}") from exc


def _check_model_class(model_class, config) -> None:
    """`model_class` must be an nn.Module class that takes this config (a transformers model
    class declares its `config_class`): another architecture's class fails deep inside its
    constructor otherwise."""
    if not (isinstance(model_class, type) and issubclass(model_class, nn.Module)):
        raise TypeError(f"model_class must be an nn.Module class (e.g. transformers.LlamaForCausalLM), got "
                        f"{model_class!r}")
    want = getattr(model_class, "config_class", None)
    if isinstance(want, type) and not isinstance(config, want):
        raise ValueError(f"model_class {model_class.__name__} takes a {want.__name__}, but the model's config is a "
                         f"{type(config).__name__} (model_type {getattr(config, 'model_type', '?')!r}): pass the "
                         f"class of that architecture, or leave model_class out (AutoModelForCausalLM)")


def empty_model(config_or_dir, dtype: torch.dtype | None = None, model_class=None) -> nn.Module:
    """The model of a Hugging Face config (or model directory) with its parameters on the meta
    device and its buffers real, in eval mode (as `from_pretrained` returns it). `dtype`:
    default the config's dtype, else float32. `model_class`: default `AutoModelForCausalLM`."""
    from transformers import AutoModelForCausalLM

    config = config_or_dir
    if isinstance(config_or_dir, (str, os.PathLike)):
        config = read_config(config_or_dir)
    if model_class is not None:
        _check_model_class(model_class, config)
    if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise TypeError(f"dtype must be a floating torch.dtype (e.g. torch.bfloat16), got {dtype!r}")
    dtype = dtype or config_dtype(config) or torch.float32
    with params_on_meta():
        if model_class is None:
            model = AutoModelForCausalLM.from_config(config, dtype=dtype)
        else:
            model = model_class._from_config(config, dtype=dtype) if hasattr(model_class, "_from_config") \
                else model_class(config)
    return model.eval()


def load_elastic(path: str | os.PathLike, lora, policy, group=None, device: torch.device | str | None = None,
                 unit_modules=None, dtype: torch.dtype | None = None, model_class=None,
                 allow_nonfinite: bool = False) -> nn.Module:
    """The Hugging Face model in directory `path` under an elastic runtime with LoRA adapters,
    read from its safetensors files without any rank holding it whole ([Note: loading from
    files]): `convert_to_elastic(empty_model(path, dtype), lora, policy, group, unit_modules,
    source=SafetensorsSource(path, device))`. `dtype`: default the config's dtype (else the
    files' dtype, else float32; a bitsandbytes 4-bit checkpoint's `bnb_4bit_compute_dtype`),
    and then the files must hold it; given, floating weights of another dtype are cast on load. A collective: call it on every rank of `group`. The model
    comes back in eval mode (as `from_pretrained` returns it): call `.train()` to train with
    dropout. Weights holding NaN or Inf (a NaN `absmax` of a bitsandbytes checkpoint, say) are
    a LoadError on every rank naming them; `allow_nonfinite=True` loads them with a
    NonFiniteWeightsWarning instead ([Note: non-finite weights on load])."""
    # Arguments: the same on every rank (a programming error, raised before any collective).
    if not isinstance(lora, (LoRAConfig, dict)):
        raise TypeError(f"load_elastic: lora must be a elastic_kernels.api.LoRAConfig or a dict {{adapter name: "
                        f"LoRAConfig}}, got {type(lora).__name__}")
    if isinstance(lora, dict):  # named adapters ([Note: many adapters on one base] in python_api/nn/lora.py)
        try:
            normalize_adapters(lora)
        except (TypeError, ValueError) as exc:
            raise type(exc)(f"load_elastic: lora must be a elastic_kernels.api.LoRAConfig or a dict {{adapter name: "
                            f"LoRAConfig}}: {exc}") from None
    if not isinstance(policy, ElasticPolicy):
        raise TypeError(f"load_elastic: policy must be a elastic_kernels.api.ElasticPolicy, got {type(policy).__name__} "
                        f"(ElasticPolicy() for the defaults)")
    device = _load_device(device)
    if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise TypeError(f"load_elastic: dtype must be a floating torch.dtype (e.g. torch.bfloat16), got {dtype!r}")
    if model_class is not None and not (isinstance(model_class, type) and issubclass(model_class, nn.Module)):
        raise TypeError(f"load_elastic: model_class must be an nn.Module class (e.g. transformers.LlamaForCausalLM), "
                        f"got {model_class!r}")
    # Before the first collective: [Note: converting under a launcher creates the process group]
    if group is None:
        ensure_default_group(device, "load_elastic")
    error, model, source, packed = None, None, None, None
    try:
        source = SafetensorsSource(path, device=device, allow_cast=dtype is not None)
        config = read_config(source.path)
        compute = compute_dtype(config)  # before read_checkpoint_format drops the quantization_config
        packed = read_checkpoint_format(source, config, policy)
        if packed is not None and dtype is None and compute is not None:
            # A bitsandbytes checkpoint computes in bnb_4bit_compute_dtype: the model's dtype
            # ([Note: loading a bitsandbytes 4-bit checkpoint]); other tensors are cast to it.
            dtype = compute
            source.allow_cast = True
        if model_class is not None:
            _check_model_class(model_class, config)
        model = empty_model(config, dtype or checkpoint_dtype(config, source), model_class)
    except LoadError as exc:
        error = str(exc)
    except ValueError as exc:  # model_class of another architecture: the same on every rank, but agreed anyway
        error = str(exc)
    agree(error, group, error_type=LoadError)
    model = convert_to_elastic(model, lora, policy, group=group, unit_modules=unit_modules, source=source)
    bad = nonfinite_weights(model, group)
    if bad:
        listed = ", ".join(f"{name} ({n} of {numel})" for name, (n, numel) in list(bad.items())[:_NONFINITE_LISTED])
        more = f" and {len(bad) - _NONFINITE_LISTED} more" if len(bad) > _NONFINITE_LISTED else ""
        why = (f" (the checkpoint is {packed.describe()}: a packed weight's absmax or nested_absmax scales are not "
               f"finite, or its weights were not when it was quantized)" if packed is not None else "")
        msg = (f"{source.path}: {len(bad)} weight(s) hold NaN or Inf values: {listed}{more}{why}; the model's "
               f"outputs through them are NaN or wrong")
        if not allow_nonfinite:
            raise LoadError(msg + "; pass allow_nonfinite=True to load them anyway")
        warnings.warn(NonFiniteWeightsWarning(msg), stacklevel=2)
    return model


class NonFiniteWeightsWarning(LoadWarning):
    """load_elastic(..., allow_nonfinite=True) loaded weights that hold NaN or Inf values."""


_NONFINITE_LISTED = 8  # weights named in the message; the rest counted


# [Note: non-finite weights on load]
# A checkpoint whose weights hold NaN or Inf (a damaged file; a bitsandbytes checkpoint with a
# NaN `absmax`, an Inf `nested_absmax`, or NaN weights before it was quantized) loads without a
# word and its first loss is NaN (issue 31). The CLI refuses such weights before step 1; the
# library does the same by default: a NaN weight makes the outputs through it NaN, whatever the
# adapters or the learning rate (or, worse, silently wrong: CPU attention turned one NaN query
# feature into a finite loss in the test), so there is nothing sound to train, and a refusal that
# names the tensors is found at once where a warning scrolls by. The flag
# `allow_nonfinite=True` is for a caller that means to repair or inspect the weights: it loads
# them with a NonFiniteWeightsWarning (a LoadWarning: the CLI shows those as one line) naming the
# same tensors. The check costs one pass over what each rank holds (its shard of every elastic
# weight, or its share of its node's host store, and the replicated tensors) and one exchange
# of counts: no rank reads a weight whole. A quantized weight is counted as it is read: the
# rows it was quantized from, or for a packed checkpoint the weights of its blocks whose scale
# is not finite (BnbNF4Weight counts those), since the codes of a packed image hold no value a
# finiteness check could read. Every rank gets the same totals, so every rank raises alike.

_COUNT_SLICE = 1 << 18  # elements per finiteness test: a 256 KiB bool temporary


def _count_nonfinite(t: torch.Tensor) -> int:
    """NaN and Inf values of `t` (0 unless floating), tested a slice at a time: loading is
    bounded by a rank's share of the weights (tests/loading/test_loading.py's peak RSS test);
    isfinite(...).sum() over a whole shard added 30 MiB per rank there (measured on its 225 MiB
    model: a bool per element and the sum's int64 widening)."""
    if not t.is_floating_point():
        return 0
    flat, n = t.reshape(-1), 0
    for i in range(0, flat.numel(), _COUNT_SLICE):
        ok = torch.isfinite(flat[i:i + _COUNT_SLICE])
        if not bool(ok.all()):  # counted only where some value is not finite (the sum widens to int64)
            n += int(ok.numel() - ok.sum())
    return n


def nonfinite_weights(model: nn.Module, group=None) -> dict[str, tuple[int, int]]:
    """{name: (non-finite values, values)} of the weights of an elastic `model` that hold NaN or
    Inf, over every rank of `group` (a collective: call it on every rank). See [Note: non-finite
    weights on load]."""
    rt = runtime_of(model)
    node = rt.host_node.layout if rt.host_node is not None else None
    local_rank, local_world = (node.local_rank, node.local_world) if node is not None else (0, 1)
    # Each rank's counts keyed by what they were read from, merged over ranks by key (a row two
    # ranks read to quantize their slices, a host-store chunk every node holds: counted once).
    mine: dict[str, dict[tuple, int]] = {}
    numel: dict[str, int] = {}
    for et in rt.tensors:
        name = f"{et.name}.weight"
        numel[name] = math.prod(et.shape)
        if et.qlayout is not None:
            parts = et.nonfinite_parts()
        elif et.on_device:  # a shard, or its own elements in a run
            parts = {("shard", rt.rank): sum(_count_nonfinite(t) for t in et.own_parts())}
        else:
            parts = {("chunk", c): _count_nonfinite(et.host_chunk(c)) for c in range(local_rank, et.num_chunks, local_world)}
        parts = {k: n for k, n in parts.items() if n}
        if parts:
            mine[name] = parts
    replicated = {}
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        if t.device.type != "meta":
            n = _count_nonfinite(t.detach())
            if n:
                replicated[name] = (n, t.numel())
    every = exchange((mine, replicated), group, what="load_elastic's finiteness check")
    out: dict[str, tuple[int, int]] = {}
    for name in numel:
        merged: dict[tuple, int] = {}
        for m, _ in every:
            for k, n in m.get(name, {}).items():
                merged[k] = max(merged.get(k, 0), n)
        if merged:
            out[name] = (sum(merged.values()), numel[name])
    for m in every:  # replicated: the same tensors on every rank
        for name, v in m[1].items():
            out.setdefault(name, v)
    return out


def read_checkpoint_format(source: SafetensorsSource, config, policy):
    """Before any tensor is read: the checkpoint's quantization (its config's
    `quantization_config`) checked against `policy`, and `source` set to read it
    ([Note: loading a bitsandbytes 4-bit checkpoint] in python_api/loading/bnb.py). A
    bitsandbytes 4-bit nf4 checkpoint: the source reads its packed weights as they are and
    `config` loses its quantization_config (nothing in memory will be bitsandbytes-packed, and
    save_pretrained writes the dequantized weights); returns its Bnb4bitFormat. A full-precision
    checkpoint: None, nothing changes. Anything else (another format, a policy that disagrees):
    a LoadError naming what was found. What load_elastic does; call it too when building a
    model from `empty_model(config)` and a SafetensorsSource by hand (e.g. for a pipeline)."""
    try:
        fmt = packed_format(config, policy)
    except PackedFormatError as exc:
        raise LoadError(f"{source.path}: {exc}") from exc
    if fmt is not None:
        source.read_packed(fmt)
        del config.quantization_config
    return fmt


def _load_device(device) -> torch.device:
    """The device load_elastic puts the model on: CPU by default, or a CUDA device; anything
    else (meta: no memory to load into) is refused here rather than deep inside a read."""
    if device is None:
        return torch.device("cpu")
    try:
        d = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise ValueError(f"load_elastic: device {device!r} is not a torch device: {exc}") from exc
    if d.type == "meta":
        raise ValueError("load_elastic: device='meta' holds no data, so nothing can be loaded into it; for the "
                         "model's structure without its weights use elastic_kernels.api.loading.empty_model(path)")
    if d.type not in ("cpu", "cuda"):
        raise ValueError(f"load_elastic: device {str(d)!r}: the elastic runtime runs on 'cpu' or 'cuda' devices")
    if d.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"load_elastic: device {str(d)!r}, but torch sees no CUDA device")
        if d.index is not None and d.index >= torch.cuda.device_count():
            raise ValueError(f"load_elastic: device {str(d)!r}, but only {torch.cuda.device_count()} CUDA device(s) "
                             "are visible")
    return d
