"""Which weights the elastic runtime holds for a job, and whether its weight formats
(--weight-format, --compare-format) can store them: checked in prepare() on every rank, before
the process group exists."""

from __future__ import annotations

import torch.nn as nn

from ..config import DEFAULT_QUANT_BLOCK, MAX_QUANT_BLOCK, MIN_QUANT_BLOCK
from ..nn import target_names
from ..nn.lora import is_conv1d, is_linear
from .errors import FinetuneError
from .models import lora_config_of
from .policy import policy_of


def elastic_weights(model: nn.Module, args, itemsize: int) -> list[str]:
    """The names of the linears whose weights the elastic runtime would hold (and, with a weight
    format, quantize) for this job: convert_to_elastic's rule ([Note: what convert_to_elastic
    does with each parameter] in python_api/nn/convert.py): the LoRA targets, and the other
    linears with a weight of at least `replicate_below_bytes` not shared with another module.
    `model` may be on the meta device; `itemsize` is the job's dtype's (a meta model's own
    dtype may differ)."""
    targets = target_names(model, lora_config_of(args))
    seen: dict[int, int] = {}
    for _, module in model.named_modules(remove_duplicate=False):
        for p in module.parameters(recurse=False):
            seen[id(p)] = seen.get(id(p), 0) + 1
    below = policy_of(args, None).replicate_below_bytes
    others = [n for n, m in model.named_modules()
              if n and is_linear(m) and n not in targets and seen[id(m.weight)] == 1
              and m.weight.numel() * itemsize >= below]
    return sorted(set(targets) | set(others))


def fitting_blocks(row: int) -> list[int]:
    """The quantization blocks (--quant-block's powers of two) that divide a row of `row` weights."""
    out, b = [], MIN_QUANT_BLOCK
    while b <= MAX_QUANT_BLOCK:
        if row % b == 0:
            out.append(b)
        b *= 2
    return out


# [Note: a block that does not fit is an option error]
# A weight format stores each row of a weight in whole blocks (ElasticPolicy.check_quantizable),
# so a block that does not divide a row cannot run. The runtime finds it when it converts the
# model, after the process group exists, and says it in the policy's terms
# (`ElasticPolicy.quant_block_size`): issue 31 found the user got a traceback on every rank
# (wrapped only under --pp). The check is a pure function of the options and the model's
# structure, so prepare() runs it on the meta model on every rank, for the main format and each
# --compare-format, and the message names the options (--weight-format, --quant-block), the
# first weight that does not fit and the blocks that would fit all of them (none: the format
# cannot store this model; the message says why). Every weight is checked once per distinct
# row length, so the real model's 30 layers cost no more than one.

def check_weight_formats(spec, args) -> None:
    """Raise FinetuneError unless every weight the elastic runs of the job hold can be stored in
    each weight format the job uses. See [Note: a block that does not fit is an option error]."""
    formats = [("--weight-format", args.weight_format)] + [("--compare-format", f) for f in args.compare_formats]
    formats = [(opt, f) for opt, f in formats if f != "none"]
    if not formats:
        return
    meta = spec.meta_model()
    rows: dict[int, tuple[str, tuple]] = {}  # row length -> the first weight with it
    for name in elastic_weights(meta, args, spec.dtype.itemsize):
        m = meta.get_submodule(name)
        shape = tuple(m.weight.shape)[::-1] if is_conv1d(m) else tuple(m.weight.shape)
        if len(shape) == 2:
            rows.setdefault(shape[1], (name, shape))
    fits_all = set(fitting_blocks(min(rows))) if rows else set()
    for r in rows:
        fits_all &= set(fitting_blocks(r))
    for opt, fmt in formats:
        block = args.quant_block if args.quant_block is not None else DEFAULT_QUANT_BLOCK[fmt]
        bad = sorted(r for r in rows if r % block)
        if not bad:
            continue
        name, shape = rows[bad[0]]
        given = (f"--quant-block {block}" if args.quant_block is not None
                 else f"its default block of {block} weights (--quant-block)")
        what = f"{opt} {fmt}" + (f" (the main run is --weight-format {args.weight_format})" if opt != "--weight-format" else "")
        if fits_all:
            hint = f"use --quant-block {' / '.join(map(str, sorted(fits_all)))} (the blocks that divide every row)"
        else:
            lengths = ", ".join(map(str, sorted(rows)))
            hint = (f"no --quant-block (a power of two in [{MIN_QUANT_BLOCK}, {MAX_QUANT_BLOCK}]) divides every row "
                    f"length of this model ({lengths}), so {fmt} cannot store it: run without {opt} {fmt}")
        raise FinetuneError(
            f"{what} with {given}: weight {name} of shape {list(shape)} has rows of {shape[1]} weights, not a multiple "
            f"of {block} (a row is stored in whole blocks); {hint}")

