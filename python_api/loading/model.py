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
   is [out, in], so its rows are columns of the stored tensor (`rows(name, transpose=True)`);
3. every other parameter (embeddings, norms, biases, small replicated linears, a tied lm_head)
   is read whole onto the target device, one tensor at a time, and tied parameters get one
   tensor for all their names (then `tie_weights()` for a Hugging Face model).
Peak host memory per rank is then its share of the frozen weights + the replicated parameters +
one read at a time (a chunk's rows; a whole Conv1D weight for a column read), never a whole
model: see `tests/loading/test_loading.py::test_meta_loading_peak_rss` for the measured figures.
"""

from __future__ import annotations

import os
from contextlib import contextmanager

import torch
import torch.nn as nn

from python_api.distributed.agree import agree
from python_api.loading.source import LoadError, SafetensorsSource
from python_api.nn import convert_to_elastic

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


def empty_model(config_or_dir, dtype: torch.dtype | None = None, model_class=None) -> nn.Module:
    """The model of a Hugging Face config (or model directory) with its parameters on the meta
    device and its buffers real, in eval mode (as `from_pretrained` returns it). `dtype`:
    default the config's dtype, else float32. `model_class`: default `AutoModelForCausalLM`."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = config_or_dir
    if isinstance(config_or_dir, (str, os.PathLike)):
        config = AutoConfig.from_pretrained(os.fspath(config_or_dir), local_files_only=True)
    dtype = dtype or config_dtype(config) or torch.float32
    with params_on_meta():
        if model_class is None:
            model = AutoModelForCausalLM.from_config(config, dtype=dtype)
        else:
            model = model_class._from_config(config, dtype=dtype) if hasattr(model_class, "_from_config") \
                else model_class(config)
    return model.eval()


def load_elastic(path: str | os.PathLike, lora, policy, group=None, device: torch.device | str | None = None,
                 unit_modules=None, dtype: torch.dtype | None = None, model_class=None) -> nn.Module:
    """The Hugging Face model in directory `path` under an elastic runtime with LoRA adapters,
    read from its safetensors files without any rank holding it whole ([Note: loading from
    files]): `convert_to_elastic(empty_model(path, dtype), lora, policy, group, unit_modules,
    source=SafetensorsSource(path, device))`. `dtype`: default the config's dtype (else the
    files' dtype, else float32), and then the files must hold it; given, floating weights of
    another dtype are cast on load. A collective: call it on every rank of `group`. The model
    comes back in eval mode (as `from_pretrained` returns it): call `.train()` to train with
    dropout."""
    from transformers import AutoConfig

    error, model, source = None, None, None
    try:
        source = SafetensorsSource(path, device=device, allow_cast=dtype is not None)
        try:
            config = AutoConfig.from_pretrained(source.path, local_files_only=True)
        except Exception as exc:  # noqa: BLE001 - no or bad config.json: a bad model directory
            raise LoadError(f"{source.path}: cannot read the model's config: {type(exc).__name__}: {exc}") from exc
        if dtype is None:
            dtype = config_dtype(config) or next(
                (e.dtype for e in source.entries.values() if e.dtype is not None and e.dtype.is_floating_point), torch.float32)
        model = empty_model(config, dtype, model_class)
    except LoadError as exc:
        error = str(exc)
    agree(error, group, error_type=LoadError)
    return convert_to_elastic(model, lora, policy, group=group, unit_modules=unit_modules, source=source)
