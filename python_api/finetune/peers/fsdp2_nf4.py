"""FSDP2 over torchao NF4 weights + PEFT LoRA: the peer of `--baseline fsdp2-nf4`, torchtune's
QLoRA path (frozen base weights as torchao `NF4Tensor`s, sharded by `fully_shard` per decoder
layer, all-gathered packed and dequantized per use).

    error = shape_error(job)                 # None, or why torchao's NF4 cannot shard this model here
    engine = FSDP2NF4Engine(job, counter)    # a collective build, like the other peers

[Note: FSDP2-NF4 as a peer]
What the peer does, and what torchtune does that it follows (ideas, not code; torchtune's
`training/_distributed.py` and torchao's `NF4Tensor`):
- Which weights: exactly those the elastic run stores quantized (`nf4_weights`: the LoRA
  targets and the frozen non-target linears of at least `replicate_below_bytes`, but the output
  layer, kept in full precision as torchtune does: [Note: what QLoRA keeps in full precision]
  in python_api/nn/convert.py), so both runs quantize the same tensors; everything else
  (embeddings, norms, the output layer, the adapters) stays in the model's dtype and is sharded
  by FSDP2 as for `--baseline fsdp2`.
- Quantization: each rank builds the base model, and each such weight becomes
  `to_nf4(weight, block_size, 256)` (torchao 0.18: `torchao.quantization.to_nf4`; before, in
  `torchao.dtypes.nf4tensor`), the whole weight at once as torchtune does (its
  `load_from_full_model_state_dict` quantizes the full tensor on every rank, then chunks it):
  the double-quantization offset (`scaler_mean`) is the mean over the whole weight, so no
  rank could quantize its shard alone. The block size is the job's nf4 block (`--quant-block`,
  default 64 = bitsandbytes'); the scaler block is torchao's fixed 256 (bitsandbytes' nested
  block). The weight goes into the module as a frozen `nn.Parameter(NF4Tensor)`; PEFT's
  `base_layer(x)` is `F.linear(x, nf4)`, which torchao routes to `linear_nf4` (dequantize to
  the input's dtype, then the GEMM; backward the same for dgrad; no weight gradient).
- Sharding: `fully_shard` per decoder layer (`reshard_after_forward=True`, torchtune's
  setting) and on the root. FSDP2 shards an NF4Tensor by `torch.chunk` on dim 0, which torchao
  implements by splitting its packed codes, int8 scalers and per-256 fp32 factors into W equal
  parts (`nf4_split`), and gathers it through the tensor's FSDP2 extensions:
  `fsdp_pre_all_gather` hands FSDP2 the three packed tensors of the shard (not a dequantized
  weight), `fsdp_post_all_gather` rebuilds an NF4Tensor from the gathered ones (the offset and
  the 16-value codebook travel as metadata, replicated). So the all-gathers move
  numel/2 + numel/block + 4 numel/(block x 256) bytes per NF4 weight: 4.127 bits per weight
  at block 64 (`nf4_gathered_bytes`), plus FSDP2's fp32 (or --dtype) bytes of the rest.
  Counted by the job's AllGatherCounter at the collective, as for every peer.
- The limit, and padding ([Note: NF4 weights torchao cannot split]): torchao's split needs
  every packed part of a weight to divide by W, i.e. its element count a multiple of block x 256
  x W (32,768 at block 64 on 2 ranks) and its rows of W. A weight that is not (every attention
  projection of the real model: k_proj 192 x 576 = 110,592) is stored as its flattened weight
  padded to the next such multiple, one NF4Tensor of (padded / block) rows of one block each,
  and its module becomes `PaddedNF4Linear` (dequantize, drop the padding, F.linear). What is
  refused (`shape_error`, checked before any run on every rank alike by `peers.check`, naming
  the weights): an element count that is no multiple of the block (torchao quantizes whole
  blocks), nn.Linear only (torchao implements F.linear, not transformers' Conv1D's addmm), and
  fewer than 2 ranks: on a one-rank mesh FSDP2 (torch 2.14.1, `FSDPParamGroup.wait_for_unshard`)
  skips the all-gather and copies only `all_gather_inputs[0]` into the unsharded parameter,
  so torchao's `fsdp_post_all_gather`, which expects its three parts, fails at the first
  forward (found running the CLI on one process: after the elastic and FSDP2 runs had trained).
- Building: the whole base model on every rank (`_collective_build`), then quantized and
  sharded; with `--model DIR` that is a full-precision copy per rank while building (torchtune
  holds the full state dict likewise). The peak-memory figure starts after the build.
- Numerics ([Note: the NF4 peer's loss tolerance] in report.py): torchao's NF4 is not
  bitsandbytes' (codebook rounded to 4 decimals, scalers always double-quantized linearly to
  int8 around the weight's mean absmax, where bitsandbytes keeps fp32 absmax or, nested, an
  8-bit dynamic code around the chunk's mean), so this peer's losses agree with an elastic
  `--weight-format nf4` run only within a measured tolerance, never bit for bit; against a
  single-process model whose base weights are torchao's dequantized values they agree within
  fp32 rounding (tests/quant/test_fsdp2_nf4.py).

[Note: NF4 weights torchao cannot split]
No split into row pieces can hold the real model's attention weights: torchao's `to_nf4`
needs an element count that is a multiple of block x 256 (its scalers are double-quantized
in groups of 256 blocks; it asserts otherwise) and FSDP2 W times that, and k_proj's 110,592
elements (1,728 blocks of 64) are not a multiple of 16,384, so no set of pieces each a whole
number of 64 x 256 blocks adds up to it; a piece with a smaller scaler group, or pieces each
quantized alone, would change the double quantization (each `to_nf4` takes its own mean of the
block absmaxes). So the peer pads instead (`quantize_padded`): the flattened weight, then
(padded - numel) weights all equal to m, the mean of the weight's block absmaxes (torchao's
`scalers_1_mean` of the weight alone), quantized by one `to_nf4` of shape (padded / block,
block); its int8 scalers and per-256 factors are then recomputed as torchao's
`double_quantize_scalers` computes them, around m itself with padding scalers of exactly 0
(to_nf4's own mean of the padded blocks is m only up to fp32 rounding of the longer sum: it
moved 13,001 of a 64 x 256 weight's 16,384 values, by up to 1.5e-8). Against torchao's algorithm
on the whole weight (which torchao itself refuses for these shapes), that changes:
- the NF4 codes and block absmaxes: nothing (a block is 64 consecutive weights of the flattened
  weight; the weight's own blocks come first, the padding starts at a block edge);
- the double quantization: nothing, but that the weight's last group of 256 scalers may be
  partial (filled with zeros, which do not raise its absmax): torchao's algorithm on a whole
  weight with a partial last group, which torchao does not allow. A group of padding alone
  gets factor 1 (torchao's 256 / 0 would be inf);
- the bytes: the padding is stored, gathered and dequantized (on 2 ranks the real model's k/v
  +18.5%, q/o +8.6%, gate/up/down none); the engine's name says how many weights are padded.
Checked bit for bit (tests/quant/test_fsdp2_nf4_padded.py): against `to_nf4` of the whole
weight where torchao takes it (64 x 256 on 2 ranks is padded to 32,768), and against a
re-implementation of torchao's algorithm with a partial last group on the real model's shapes.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from ...config import ElasticPolicy
from ...nn.convert import resolve_quant_skip
from ..configuration import FinetuneConfig
from ..engines import (
    FSDP2Engine,
    _collective_build,
    peft_with_initial_adapters,
)
from ..errors import FinetuneError
from ..formats import elastic_weights
from ..job import Job

SCALER_BLOCK = 256  # torchao's scaler_block_size (bitsandbytes' nested block is 256 too)
# The demo model (python_api/finetune/constants.py EMBEDDED: hidden 256, 8 heads) sized so this
# peer takes every quantized weight unpadded, as bench_quant --demo and bench_frontier --preset
# nf4 run it (`make demo` runs QLoRA on the real model, padded: [Note: NF4 weights torchao cannot
# split]): its intermediate size 688 is no multiple of the nf4 block (64) and its k/v projections
# (4 KV heads: 128 x 256) hold 32768 weights, which torchao cannot split over 4 ranks. With
# intermediate 768 and 8 KV heads every quantized weight holds a multiple of 65536 = 64 x 256 x 4
# (q/k/v/o 256 x 256, gate/up 768 x 256, down 256 x 768): it splits on 2 and 4 ranks (not 3,
# nor 8), and every row length is a multiple of the nf4 and int8 blocks (64, 256).
NF4_DEMO_OPTIONS = ("--model", "tiny", "--intermediate-size", "768", "--num-kv-heads", "8")
DEFAULT_BLOCK = 64  # bitsandbytes' and torchao's NF4 block
INSTALL_HINT = "pip install torchao (requirements.txt pins 0.18.0)"


def import_to_nf4():
    """torchao's `to_nf4` (0.18: torchao.quantization; before: torchao.dtypes.nf4tensor), or
    ImportError with the install hint."""
    try:
        from torchao.quantization import to_nf4
    except ImportError:
        try:
            from torchao.dtypes.nf4tensor import to_nf4
        except ImportError as exc:
            raise ImportError(f"torchao cannot be imported ({exc}): {INSTALL_HINT}") from exc
    return to_nf4


def nf4_block(cfg: FinetuneConfig) -> int:
    """The peer's NF4 block: the job's --quant-block where an elastic run of the job is nf4 (the
    same codebook settings: --weight-format or --compare-format), else 64."""
    formats = [cfg.weights.weight_format] + list(cfg.peers.compare_formats)
    if "nf4" in formats and cfg.weights.quant_block is not None:
        return cfg.weights.quant_block
    return DEFAULT_BLOCK


def nf4_weights(model: nn.Module, cfg: FinetuneConfig, itemsize: int) -> list[str]:
    """The weights this peer stores as torchao NF4: those an nf4 elastic run of the job
    quantizes (its elastic weights but the full-precision output layer: [Note: what QLoRA
    keeps in full precision] in python_api/nn/convert.py)."""
    names = elastic_weights(model, cfg, itemsize)
    policy = resolve_quant_skip(model, ElasticPolicy(weight_format="nf4"), names)
    return [n for n in names if policy.quantizes(n)]


def nf4_gathered_bytes(numel: int, block: int = DEFAULT_BLOCK) -> int:
    """Bytes of torchao's packed NF4 parts of a weight of `numel` elements: the codes (two per
    byte), one int8 scaler per block, one fp32 factor per SCALER_BLOCK scalers."""
    return numel // 2 + numel // block + 4 * (numel // (block * SCALER_BLOCK))


def nf4_unit(block: int, world_size: int) -> int:
    """The element counts torchao's NF4 splits over `world_size` ranks are multiples of this."""
    return block * SCALER_BLOCK * world_size


def padded_numel(shape, block: int, world_size: int) -> int:
    """The element count the peer stores for a weight of `shape`: its own where torchao's NF4
    under FSDP2 takes the weight as it is, else the next multiple of block x 256 x W
    ([Note: NF4 weights torchao cannot split])."""
    rows, numel = shape[0], math.prod(shape)
    unit = nf4_unit(block, world_size)
    if numel % unit == 0 and rows % world_size == 0:
        return numel
    return -(-numel // unit) * unit


def quantize_padded(weight: torch.Tensor, block: int, world_size: int, to_nf4):
    """torchao's NF4 of `weight` flattened and padded to `padded_numel`, shaped (padded / block,
    block), its scalers double-quantized as torchao's `to_nf4` of the weight alone would
    ([Note: NF4 weights torchao cannot split])."""
    flat = weight.detach().reshape(-1)
    numel = flat.numel()
    if numel % block:
        raise FinetuneError(f"a weight of {numel} elements is no whole number of NF4 blocks of {block}")
    padded = padded_numel(tuple(weight.shape), block, world_size)
    absmax = flat.view(-1, block).abs().amax(dim=1)  # torchao's get_block_absmax
    mean = absmax.mean()  # torchao's scalers_1_mean, of the weight's own blocks
    nf4 = to_nf4(torch.cat([flat, mean.expand(padded - numel)]).view(padded // block, block),
                 block_size=block, scaler_block_size=SCALER_BLOCK)
    # The scalers again, around the weight's own mean (to_nf4's mean of the padded blocks moves by
    # fp32 rounding): torchao's double_quantize_scalers with padding scalers of exactly 0.
    scalers = torch.cat([absmax - mean, absmax.new_zeros(padded // block - numel // block)])
    groups = scalers.view(-1, SCALER_BLOCK)
    group_absmax = groups.abs().amax(dim=1)
    # a group of padding alone has absmax 0, where torchao's 256 / 0 would give inf and NaN codes
    factor = 256 / (2 * torch.where(group_absmax > 0, group_absmax, torch.ones_like(group_absmax)))
    nf4.quantized_scalers = (groups * factor[:, None]).round().clamp(-128, 127).flatten().to(torch.int8)
    nf4.quantization_factor = factor.contiguous()
    nf4.scaler_mean = mean
    return nf4


class _PaddedLinearNF4(torch.autograd.Function):
    """torchao's LinearNF4 for a padded weight: dequantize to the input's dtype, drop the padding,
    F.linear; backward the same for dgrad (the weight is frozen). The NF4 weight is what is saved,
    as torchao saves it."""

    @staticmethod
    def forward(ctx, x, weight, shape):
        ctx.save_for_backward(weight)
        ctx.shape = shape
        return F.linear(x, dequantize_padded(weight, x.dtype, shape))

    @staticmethod
    def backward(ctx, grad_output):
        (weight,) = ctx.saved_tensors
        return grad_output @ dequantize_padded(weight, grad_output.dtype, ctx.shape), None, None


def dequantize_padded(weight, dtype: torch.dtype, shape) -> torch.Tensor:
    """The weight of `shape` a padded NF4Tensor holds, in `dtype`."""
    return weight.to(dtype).reshape(-1)[: math.prod(shape)].view(shape)


class PaddedNF4Linear(nn.Linear):
    """An nn.Linear (so PEFT wraps it as one) whose frozen weight is a padded torchao NF4Tensor of
    shape (padded / block, block) ([Note: NF4 weights torchao cannot split]); in_features,
    out_features and the bias are the original layer's."""

    def __init__(self, linear: nn.Linear, weight):
        nn.Module.__init__(self)  # not nn.Linear's: it would allocate a weight of the full shape
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.bias = linear.bias
        self.numel = linear.in_features * linear.out_features

    def forward(self, x):
        y = _PaddedLinearNF4.apply(x, self.weight, (self.out_features, self.in_features))
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, nf4 padded {self.numel} -> {self.weight.numel()}"


def shape_error(job: Job) -> str | None:
    """Why torchao's NF4 under FSDP2 cannot hold this job's quantized weights on its world size
    ([Note: FSDP2-NF4 as a peer]: the limit), or None. From the model's structure on the meta
    device: the same on every rank, before anything is built."""
    W, block = job.world_size, nf4_block(job.cfg)
    if W < 2:
        return ("--baseline fsdp2-nf4 needs at least 2 ranks: on a one-rank mesh FSDP2 (torch 2.14) copies only the "
                "first of a tensor subclass's all-gather inputs into the unsharded parameter, and torchao's NF4 has "
                "three (its fsdp_post_all_gather fails: 'expected 3, got 1')")
    meta = job.spec.meta_model()
    bad, kinds = [], []
    for name in nf4_weights(meta, job.cfg, job.spec.dtype.itemsize):
        m = meta.get_submodule(name)
        if not isinstance(m, nn.Linear):
            kinds.append(f"{name} ({type(m).__name__})")
            continue
        rows, cols = m.weight.shape
        if (rows * cols) % block:
            bad.append(f"{name}.weight ({rows} x {cols} = {rows * cols} elements)")
    if kinds:
        return (f"--baseline fsdp2-nf4: torchao's NF4 replaces nn.Linear weights only (it implements F.linear); "
                f"these quantized modules are not nn.Linear: {', '.join(kinds[:4])}")
    if bad:
        more = f" and {len(bad) - 4} more" if len(bad) > 4 else ""
        return (f"--baseline fsdp2-nf4: torchao's NF4 quantizes whole blocks of {block} weights of the flattened "
                f"weight (the peer pads a weight to a multiple of block x {SCALER_BLOCK} x ranks, but not inside a "
                f"block), and the element count of these weights is no multiple of {block}: "
                f"{', '.join(bad[:4])}{more}. Use a --quant-block that divides every row "
                f"(with --compare-format nf4), or leave fsdp2-nf4 out")
    return None


class FSDP2NF4Engine(FSDP2Engine):
    """The base model with torchao NF4 weights where the elastic run quantizes, PEFT LoRA (the
    elastic run's initial adapters), `fully_shard` per decoder layer and on the root
    ([Note: FSDP2-NF4 as a peer]). The training interface is FSDP2Engine's."""

    kind = "fsdp2-nf4"
    weight_format = "nf4"  # the numerics its losses are compared within (torchao's NF4, not bitsandbytes')

    def __init__(self, job: Job, counter):
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        to_nf4 = import_to_nf4()
        error = shape_error(job)  # checked before any run by peers.check; kept here for direct callers
        if error:
            raise FinetuneError(error)
        base = _collective_build(job)
        self.block = nf4_block(job.cfg)
        self.nf4_weights = nf4_weights(base, job.cfg, job.spec.dtype.itemsize)
        self.nf4_numel = 0
        self.padded = {}  # name -> (elements, padded elements): [Note: NF4 weights torchao cannot split]
        for name in self.nf4_weights:
            linear = base.get_submodule(name)
            shape = tuple(linear.weight.shape)
            self.nf4_numel += math.prod(shape)
            padded = padded_numel(shape, self.block, job.world_size)
            if padded == math.prod(shape):
                linear.weight = nn.Parameter(to_nf4(linear.weight.detach().contiguous(), block_size=self.block,
                                                    scaler_block_size=SCALER_BLOCK), requires_grad=False)
            else:
                parent, _, attr = name.rpartition(".")
                nf4 = quantize_padded(linear.weight, self.block, job.world_size, to_nf4)
                setattr(base.get_submodule(parent), attr, PaddedNF4Linear(linear, nf4))
                self.padded[name] = (math.prod(shape), padded)
        self.model = peft_with_initial_adapters(job, base)
        layer_types = set(getattr(base, "_no_split_modules", None) or [])
        layers = [m for m in self.model.modules() if type(m).__name__ in layer_types]
        if not layers:
            raise FinetuneError(f"--baseline fsdp2-nf4: cannot find the decoder layers of {type(base).__name__} "
                                "(_no_split_modules)")
        mesh = init_device_mesh(job.device.type, (job.world_size,))
        for layer in layers:
            fully_shard(layer, mesh=mesh, reshard_after_forward=True)
        fully_shard(self.model, mesh=mesh)
        self.reshard_after_forward = True
        pad = ""
        if self.padded:
            extra = sum(p - n for n, p in self.padded.values())
            pad = f", {len(self.padded)} of {len(self.nf4_weights)} padded: +{100 * extra / self.nf4_numel:.1f}% NF4 weights"
        self.name = f"FSDP2-NF4 + PEFT (torchao NF4 block {self.block}{pad})"
        self.counter = counter
        self.micro_batch, self.grad_accum = job.cfg.training.micro_batch, job.cfg.training.grad_accum
