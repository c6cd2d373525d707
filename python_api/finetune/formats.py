"""Which weights the elastic runtime holds for a job, and whether its weight formats
(--weight-format, --compare-format) can store them: checked in prepare() on every rank, before
the process group exists."""

from __future__ import annotations

import dataclasses

import torch.nn as nn

from ..nn import target_names
from ..nn.lora import is_conv1d, is_linear
from .configuration import FinetuneConfig
from .errors import FinetuneError
from .models import lora_config
from .policy import elastic_policy


def elastic_weights(model: nn.Module, cfg: FinetuneConfig, itemsize: int) -> list[str]:
    """The names of the linears whose weights the elastic runtime would hold (and, with a weight
    format, quantize) for this job: convert_to_elastic's rule ([Note: what convert_to_elastic
    does with each parameter] in python_api/nn/convert.py): the LoRA targets, and the other
    linears with a weight of at least `replicate_below_bytes` not shared with another module.
    `model` may be on the meta device; `itemsize` is the job's dtype's (a meta model's own
    dtype may differ). Reads the configuration's LoRA group and seed, and the policy of its
    elastic, host and weight-format groups."""
    targets = target_names(model, lora_config(cfg.lora, cfg.training.seed))
    seen: dict[int, int] = {}
    for _, module in model.named_modules(remove_duplicate=False):
        for p in module.parameters(recurse=False):
            seen[id(p)] = seen.get(id(p), 0) + 1
    below = elastic_policy(cfg, None).replicate_below_bytes
    others = [n for n, m in model.named_modules()
              if n and is_linear(m) and n not in targets and seen[id(m.weight)] == 1
              and m.weight.numel() * itemsize >= below]
    return sorted(set(targets) | set(others))


# [Note: a weight a format cannot store is an option error]
# The weight formats store any 2-D weight: blocks run over the weight flattened, as
# bitsandbytes', and a chunk holds whole blocks (ElasticPolicy.weight_rows_per_chunk), so every
# --quant-block fits every row length (issue 28; before it a block had to divide each row, and
# issue 31 asked the refusal to name the blocks that would). What ElasticPolicy.check_quantizable
# still refuses (a weight that is not 2-D [out, in]) the runtime would find when it converts the
# model, after the process group exists, as a traceback on every rank; the check is a pure
# function of the options and the model's structure, so prepare() runs it on the meta model on
# every rank, for the main format and each --compare-format, and the message names the option
# and the weight.

def check_weight_formats(spec, cfg: FinetuneConfig) -> None:
    """Raise FinetuneError unless every weight the elastic runs of the job hold can be stored in
    each weight format the job uses (--weight-format: cfg.weights, --compare-format: cfg.peers).
    See [Note: a weight a format cannot store is an option error]."""
    w = cfg.weights
    formats = [("--weight-format", w.weight_format)] + [("--compare-format", f) for f in cfg.peers.compare_formats]
    formats = [(opt, f) for opt, f in formats if f != "none"]
    if not formats:
        return
    meta = spec.meta_model()
    for opt, fmt in formats:
        policy = dataclasses.replace(elastic_policy(cfg, None), weight_format=fmt, quant_block_size=w.quant_block,
                                     quant_nested=bool(w.quant_nested) and fmt == "nf4")
        for name in elastic_weights(meta, cfg, spec.dtype.itemsize):
            m = meta.get_submodule(name)
            shape = tuple(m.weight.shape)[::-1] if is_conv1d(m) else tuple(m.weight.shape)
            try:
                policy.check_quantizable(name, shape)
            except ValueError as exc:
                what = f"{opt} {fmt}" + (f" (the main run is --weight-format {w.weight_format})"
                                         if opt != "--weight-format" else "")
                raise FinetuneError(f"{what}: {exc}; run without {opt} {fmt}") from None
