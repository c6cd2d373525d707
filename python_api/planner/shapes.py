"""Synthetic profiles for named model shapes on named devices (no model is built).

    profile = synthetic_profile("llama2-70b", ranks=8, seq_len=4096, device="a100-40g-pcie")

[Note: synthetic profile assumptions]
Model: Llama-2 decoder layers with the real dimensions (`SHAPES`), bf16 frozen weights, LoRA
adapters of rank `lora_rank` (default 16) on the 7 projections of every decoder layer, fp32
adapters trained with Adam. Units: the decoder layers (recomputable), then `lm_head` (its own
unit, not recomputable); the embedding is replicated (it is not a linear).
Chunking, as the runtime lays a weight out (`ElasticPolicy.rows_per_chunk`, `ChunkLayout`):
rows_per_chunk = chunk_bytes // row_bytes (at most the rows), n = ceil(rows / rows_per_chunk),
slice = ceil(rows_per_chunk x cols / W) elements; page = the largest chunk rounded up to 512.
A bf16 weight on the device, on more than one rank, whose full chunks split evenly over the
ranks (rows_per_chunk x cols a multiple of W, or one chunk) has run_bytes = rows x cols x 2:
kept whole, the runtime holds it as one run ([Note: resident runs]), as in a measured profile.
Compute, per token (FLOPs), divided by the device's achieved FLOP rate:
  forward   2 x P_layer (the 7 GEMMs) + 2 x seq x h (causal attention: QK^T and AV, half the
            square) + 2 x r x (in + out) per adapted projection (the LoRA GEMMs)
  backward  2 x P_layer (dX only: the base weights are frozen, no dW) + 2x the attention
            forward + 2x the LoRA forward (dA, dB and dX through the adapter)
  fixed     100 us per forward and 200 us per backward call (launch overheads of ~20/~40
            kernels); elementwise work (norms, SiLU, RoPE) is not counted.
lm_head: 2 x V x h per token forward and backward (dX only); the head's loss and norm are
`outside`, timed by the bytes they move at the device's memory bandwidth.
Activations saved for backward per token per decoder layer (bf16 = 2 bytes per element):
  input-norm input h, its output h (input of q/k/v), q and k after RoPE h + kv, v kv,
  attention output h (input of o_proj), post-attention norm input h and output h (input of
  gate/up), gate g I, up u I, silu(g) I, silu(g) x u I (input of down)
  = 2 x (6h + 2kv + 4I) bytes, + 4 x heads (fp32 softmax log-sum-exp) + 7 x 4 x r (each
  adapter's x A^T in fp32). A recomputed layer keeps its input: 2h bytes per token.
Outside: act = 2h per token (the final norm's input); peak = 10 V per token (bf16 logits, their
fp32 copy for the loss, and the fp32 gradient of the logits).
Static per rank: the shards of every elastic weight (their real bytes, `WeightProfile.shard_bytes`), the replicated
embedding (V x h bf16) and norms, and the adapters with their gradients and Adam moments
(16 bytes per fp32 parameter); adapter_grad_bytes = 4 bytes per adapter parameter.
Links: an all-gather where a rank receives B bytes takes latency + B / busbw (nccl-tests'
bus bandwidth is exactly received bytes per second). Over several nodes, of the B bytes a
fraction (W - G) / (W - 1) crosses nodes (G GPUs per node, one NIC per GPU, so each GPU's
NIC carries its own share) and the rest NVLink, in parallel: B x max(f / inter, (1 - f) / intra).
The all-reduce of the adapter gradients is a ring: 2 (W - 1) / W x bytes at the slowest bus
bandwidth. A gather's pack and unpack are device memory copies on the communication stream
(`copy`: every byte copied is read and written once, so half the HBM bandwidth, and 5 us per
copy kernel).
Host tier (`host_tier=True`; assumptions, not measurements): the host link of each GPU is its
PCIe link at an achieved rate (`DeviceSpec.h2d_bytes_per_s`: A100 PCIe Gen4 x16 ~25 GB/s, H100
SXM Gen5 x16 ~50 GB/s, 10 us per copy batch), each GPU with its own link (no sharing of a
PCIe switch or of host memory bandwidth is modelled); the store exists (`host_store`), with
weights_on="host" no shard is in static_bytes; the host budget is `host_budget_bytes`.
Quantized weights (`weight_format="nf4" | "int8"`, with `quant_block_size` and `quant_nested`
as ElasticPolicy has them; the user's choice): each weight is cut into the same chunks of whole
rows as in bf16 (rows_per_chunk from the bf16 row), rounded as the runtime rounds them so that
a chunk holds whole blocks (`quant_rows_per_chunk`: a multiple of block / gcd(cols, block)
rows; unchanged when the block divides the row), and every chunk is its blob
(WeightFormat.blob_bytes: nf4 0.5 byte per weight + 4 per block of 64; int8 1 byte + 4 per
block of 256; blocks over the chunk's flattened weights), so chunk, slice, last-chunk and page bytes, the shards in static_bytes and
every link's bytes follow the format. Each use dequantizes a weight into bf16 (one launch per
LoRA projection; lm_head, a plain ElasticLinear, one per chunk): dequant_s = launches x
`DeviceSpec.dequant_latency_s` + (rows x cols x 2 bytes of output) / `dequant_bytes_per_s`.
The rate is an ASSUMPTION, not a measurement: 80% of the device copy bandwidth (the copy
link's rate, HBM / 2), the goal issue 20 sets for our Triton dequant kernel (bench/
bench_quant.py under `make gpu-check`; no GPU figure is measured yet, NOTES.md). A memory-
bound kernel that reads 0.28 (nf4) / 0.52 (int8) byte per byte of bf16 it writes moves less
than a copy of its output (2 bytes per byte), so the goal is not optimistic if the kernel is
bandwidth-bound. Launch latency 5 us, as a copy kernel's. The recycled dequant workspace
(python_api/quant/workspace.py: the largest weight one call dequantizes, in bf16) is static.
What activation offload moves per decoder layer and token: each of the 7 LoRA linears' input
(bf16: q, k, v each copy the normed hidden state, o the attention output, gate and up the
normed hidden state, down silu(g) x u) and x A^T (fp32, r values), no dropout mask:
2 x (6h + I) + 7 x 4 r bytes moved, of which 2 x (3h + I) + 7 x 4 r are freed on the device
(the shared inputs once); the attention output is assumed referenced by nothing else.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

from ..config import DEFAULT_QUANT_BLOCK, PAGE_ALIGN, WEIGHT_FORMATS, quant_rows_per_chunk
from .profile import LayerProfile, Link, OutsideProfile, Profile, WeightFormat, WeightProfile

BF16 = 2  # bytes per element of the frozen weights and activations
DEFAULT_CHUNK_BYTES = 4 << 20  # ElasticPolicy.chunk_bytes default


@dataclass(frozen=True)
class ModelShape:
    """Dimensions of a Llama-2 model (from its Hugging Face config.json)."""

    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    vocab: int = 32000

    @property
    def kv_dim(self) -> int:
        return self.hidden // self.heads * self.kv_heads

    def projections(self) -> list[tuple[str, int, int]]:
        """(name, rows = out features, cols = in features) of the 7 projections of a layer."""
        h, kv, i = self.hidden, self.kv_dim, self.intermediate
        return [("q_proj", h, h), ("k_proj", kv, h), ("v_proj", kv, h), ("o_proj", h, h),
                ("gate_proj", i, h), ("up_proj", i, h), ("down_proj", h, i)]


SHAPES = {
    "llama2-7b": ModelShape(hidden=4096, intermediate=11008, layers=32, heads=32, kv_heads=32),
    "llama2-13b": ModelShape(hidden=5120, intermediate=13824, layers=40, heads=40, kv_heads=40),
    "llama2-70b": ModelShape(hidden=8192, intermediate=28672, layers=80, heads=64, kv_heads=8),
}


@dataclass(frozen=True)
class DeviceSpec:
    """One kind of GPU and its links. Rates are *achieved*, not peak: see each spec."""

    name: str
    flops: float  # achieved bf16 FLOP/s of the GEMMs
    hbm_bytes_per_s: float  # memory bandwidth (for the memory-bound loss and norm)
    capacity_bytes: int  # device memory
    reserved_bytes: int  # CUDA context, NCCL buffers, allocator slack: not ours
    gpus_per_node: int
    intra_bytes_per_s: float  # all-gather bus bandwidth within a node
    intra_latency_s: float
    inter_bytes_per_s: float  # per-GPU bandwidth between nodes (one NIC per GPU)
    inter_latency_s: float
    h2d_bytes_per_s: float = 25e9  # host <-> device copies over the GPU's PCIe link (achieved; assumption)
    h2d_latency_s: float = 10e-6
    copy_latency_s: float = 5e-6  # one device-to-device copy kernel (a gather's pack or unpack)
    # Dequantization of quantized weights, bytes of bf16 output per second; None: 80% of the
    # copy rate, an assumption ([Note: synthetic profile assumptions], quantized weights).
    dequant_bytes_per_s: float | None = None
    dequant_latency_s: float = 5e-6  # one dequant kernel launch

    def h2d(self) -> Link:
        return Link(self.h2d_latency_s, self.h2d_bytes_per_s)

    def copy(self) -> Link:
        """Device memory copies: each byte copied is read and written, half the HBM bandwidth."""
        return Link(self.copy_latency_s, self.hbm_bytes_per_s / 2)

    def dequant(self) -> Link:
        """Dequantization: latency per launch + output bytes / rate."""
        rate = self.dequant_bytes_per_s if self.dequant_bytes_per_s is not None else 0.8 * self.copy().bytes_per_s
        return Link(self.dequant_latency_s, rate)

    def allgather(self, ranks: int) -> Link:
        if ranks <= self.gpus_per_node:
            return Link(self.intra_latency_s, self.intra_bytes_per_s)
        f = (ranks - self.gpus_per_node) / (ranks - 1)  # share of received bytes that cross nodes
        seconds_per_byte = max(f / self.inter_bytes_per_s, (1 - f) / self.intra_bytes_per_s)
        return Link(self.inter_latency_s, 1.0 / seconds_per_byte)

    def allreduce(self, ranks: int) -> Link:
        bus = self.intra_bytes_per_s if ranks <= self.gpus_per_node else self.inter_bytes_per_s
        latency = self.intra_latency_s if ranks <= self.gpus_per_node else self.inter_latency_s
        factor = 2 * (ranks - 1) / ranks if ranks > 1 else 1.0
        return Link(2 * latency, bus / factor)


GiB = 1 << 30
DEVICES = {
    # A100 40GB PCIe: 312 TFLOP/s dense bf16 peak, taken at 50% (a typical achieved fraction
    # for these GEMM shapes); 1.555 TB/s HBM2. 8 per node on PCIe: all-gather bus bandwidth
    # ~25 GB/s (the mTuner paper's setting). Single node only (8 ranks).
    "a100-40g-pcie": DeviceSpec(
        name="a100-40g-pcie", flops=0.5 * 312e12, hbm_bytes_per_s=1.555e12, capacity_bytes=40 * GiB,
        reserved_bytes=3 * GiB // 2, gpus_per_node=8, intra_bytes_per_s=25e9, intra_latency_s=60e-6,
        inter_bytes_per_s=12.5e9, inter_latency_s=20e-6 + 60e-6,
        # PCIe Gen4 x16: 32 GB/s line rate, ~25 GB/s achieved per GPU (assumption).
        h2d_bytes_per_s=25e9, h2d_latency_s=10e-6,
    ),
    # H100 SXM5 80GB: 989 TFLOP/s dense bf16 peak, taken at 50%; 3.35 TB/s HBM3. 8 per node on
    # NVLink/NVSwitch: ~350 GB/s all-gather bus bandwidth within a node. Between nodes
    # (assumption): one 400 Gb/s NDR InfiniBand NIC per GPU, 50 GB/s line rate, ~40 GB/s achieved.
    "h100-sxm": DeviceSpec(
        name="h100-sxm", flops=0.5 * 989e12, hbm_bytes_per_s=3.35e12, capacity_bytes=80 * GiB,
        reserved_bytes=2 * GiB, gpus_per_node=8, intra_bytes_per_s=350e9, intra_latency_s=20e-6,
        inter_bytes_per_s=40e9, inter_latency_s=40e-6,
        # PCIe Gen5 x16 to the host: 64 GB/s line rate, ~50 GB/s achieved per GPU (assumption).
        h2d_bytes_per_s=50e9, h2d_latency_s=10e-6,
    ),
}

FWD_FIXED_S = 100e-6
BWD_FIXED_S = 200e-6


def _weight(name: str, rows: int, cols: int, ranks: int, chunk_bytes: int, backward: bool = True,
            fmt: WeightFormat | None = None, dequant: Link | None = None, per_chunk: bool = False,
            on_device: bool = True) -> WeightProfile:
    """A bf16 weight's chunk layout; with `fmt`, its chunks are blobs and each use dequantizes
    it (`dequant`: one launch, or one per chunk when `per_chunk`). `on_device`: the weight's
    shard lives on the device (not in the host store), so it can be held as a run."""
    row_bytes = cols * BF16
    if row_bytes > chunk_bytes:
        raise ValueError(f"chunk_bytes ({chunk_bytes}) is smaller than one row of {name} ({row_bytes} bytes)")
    rows_per_chunk = min(rows, chunk_bytes // row_bytes)
    if fmt is not None:  # whole blocks per chunk, as the runtime (ElasticPolicy.weight_rows_per_chunk)
        rows_per_chunk = quant_rows_per_chunk(rows_per_chunk, rows, cols, fmt.block_size)
    chunk_numel = rows_per_chunk * cols
    chunks = math.ceil(rows / rows_per_chunk)
    last_rows = rows - (chunks - 1) * rows_per_chunk
    last = None if last_rows == rows_per_chunk else last_rows * cols * BF16
    if fmt is None:
        # Held whole as a run when every chunk is kept, as the runtime does (can_hold_as_run:
        # a runtime that gathers, the weight on the device, full chunks whose elements split
        # evenly over the ranks; [Note: resident runs]): its own bytes, no page, no padding.
        run = rows * cols * BF16 if on_device and ranks > 1 and (chunks == 1 or chunk_numel % ranks == 0) else None
        return WeightProfile(name=name, chunks=chunks,
                             slice_bytes=math.ceil(chunk_numel / ranks) * BF16, chunk_bytes=chunk_numel * BF16,
                             backward=backward, last_chunk_bytes=last, run_bytes=run)
    blob = fmt.blob_bytes(rows_per_chunk, cols)
    launches = chunks if per_chunk else 1
    return WeightProfile(name=name, chunks=chunks, slice_bytes=math.ceil(blob / ranks), chunk_bytes=blob,
                         backward=backward, last_chunk_bytes=None if last is None else fmt.blob_bytes(last_rows, cols),
                         dequant_s=launches * dequant.latency_s + rows * cols * BF16 / dequant.bytes_per_s)


def shape_of(shape: str) -> ModelShape:
    if shape not in SHAPES:
        raise ValueError(f"unknown shape {shape!r}; known: {', '.join(SHAPES)}")
    return SHAPES[shape]


def device_of(device: str | DeviceSpec) -> DeviceSpec:
    if isinstance(device, DeviceSpec):
        return device
    if device not in DEVICES:
        raise ValueError(f"unknown device spec {device!r}; known: {', '.join(DEVICES)}")
    return DEVICES[device]


def synthetic_profile(shape: str, ranks: int, seq_len: int = 4096, device: str | DeviceSpec = "a100-40g-pcie", *,
                      chunk_bytes: int = DEFAULT_CHUNK_BYTES, lora_rank: int = 16, host_tier: bool = False,
                      weights_on: str = "device", host_budget_bytes: int | None = None, jitter: float = 0.0,
                      seed: int = 0, weight_format: str | None = None, quant_block_size: int | None = None,
                      quant_nested: bool = False) -> Profile:
    """The profile of Llama-2 `shape` on `ranks` GPUs of `device` ([Note: synthetic profile
    assumptions]); with `host_tier` (implied by weights_on="host") the host link, a host store
    and the offloadable activations are in it. `jitter`: each decoder layer's four timings
    scaled by independent factors uniform in [1 - jitter, 1 + jitter] (drawn from `seed`), as
    a measured profile's layers differ (no two are equal, so the search cannot share their work).
    `weight_format` ("nf4" | "int8"; `quant_block_size`, `quant_nested` as in ElasticPolicy):
    the frozen weights stored quantized, their bytes the blobs' and each use's dequantization
    at the device's dequant rate (an assumption: the Note)."""
    if isinstance(jitter, bool) or not isinstance(jitter, (int, float)) or not 0.0 <= jitter < 1.0:
        raise ValueError(f"jitter must be a number in [0, 1), got {jitter!r}")
    rng = random.Random(seed)
    if weights_on not in ("device", "host"):
        raise ValueError(f'weights_on must be "device" or "host", got {weights_on!r}')
    host_tier = host_tier or weights_on == "host"
    m = shape_of(shape)
    dev = device_of(device)
    if weight_format is None:
        if quant_block_size is not None or quant_nested:
            raise ValueError("quant_block_size / quant_nested describe a quantized format: give weight_format too")
        fmt = None
    elif weight_format not in WEIGHT_FORMATS:
        raise ValueError(f"weight_format must be None or one of {list(WEIGHT_FORMATS)}, got {weight_format!r}")
    else:
        block = DEFAULT_QUANT_BLOCK[weight_format] if quant_block_size is None else quant_block_size
        fmt = WeightFormat(weight_format, block, quant_nested)
    dequant = dev.dequant() if fmt is not None else None
    if not isinstance(ranks, int) or isinstance(ranks, bool) or ranks < 1:
        raise ValueError(f"ranks must be a positive int, got {ranks!r}")
    if not isinstance(seq_len, int) or isinstance(seq_len, bool) or seq_len < 1:
        raise ValueError(f"seq_len must be a positive int, got {seq_len!r}")
    h, kv, inter, r = m.hidden, m.kv_dim, m.intermediate, lora_rank
    projections = m.projections()
    layer_params = sum(rows * cols for _, rows, cols in projections)
    lora_params = sum(r * (rows + cols) for _, rows, cols in projections)
    attn_fwd = 2 * seq_len * h  # causal QK^T + AV per token
    fwd_flops = 2 * layer_params + attn_fwd + 2 * lora_params
    bwd_flops = 2 * layer_params + 2 * attn_fwd + 4 * lora_params
    act = BF16 * (6 * h + 2 * kv + 4 * inter) + 4 * m.heads + 7 * 4 * r
    # Activation offload, per LoRA linear in forward order: its input (bf16), then x A^T (fp32).
    ins = {"q_proj": h, "k_proj": h, "v_proj": h, "o_proj": h, "gate_proj": h, "up_proj": h, "down_proj": inter}
    offl = tuple(float(b) for name, _, _ in projections for b in (BF16 * ins[name], 4 * r)) if host_tier else ()
    owners = tuple(name for name, _, _ in projections for _ in range(2)) if host_tier else ()
    freed = float(BF16 * (3 * h + inter) + 7 * 4 * r) if host_tier else 0.0
    layers = []
    for li in range(m.layers):
        # The first layer's q/k/v read the norm of the frozen embedding: no input gradient,
        # so no backward use (the runtime gathers them in forward only).
        weights = tuple(_weight(name, rows, cols, ranks, chunk_bytes,
                                backward=not (li == 0 and name in ("q_proj", "k_proj", "v_proj")),
                                fmt=fmt, dequant=dequant, on_device=weights_on == "device")
                        for name, rows, cols in projections)
        j = [1.0 + rng.uniform(-jitter, jitter) if jitter else 1.0 for _ in range(4)]
        layers.append(LayerProfile(
            name=f"model.layers.{li}", recomputable=True,
            fwd_s_per_token=j[0] * fwd_flops / dev.flops, bwd_s_per_token=j[1] * bwd_flops / dev.flops,
            fwd_s_fixed=j[2] * FWD_FIXED_S, bwd_s_fixed=j[3] * BWD_FIXED_S,
            act_bytes_per_token=float(act), input_bytes_per_token=float(BF16 * h), weights=weights,
            offload_tensors_bytes_per_token=offl, offload_freed_bytes_per_token=freed, offload_tensors_weight=owners,
        ))
    head = _weight("lm_head", m.vocab, h, ranks, chunk_bytes, fmt=fmt, dequant=dequant, per_chunk=True,
                   on_device=weights_on == "device")
    layers.append(LayerProfile(
        name="lm_head", recomputable=False,
        fwd_s_per_token=2 * m.vocab * h / dev.flops, bwd_s_per_token=2 * m.vocab * h / dev.flops,
        fwd_s_fixed=FWD_FIXED_S / 10, bwd_s_fixed=BWD_FIXED_S / 10,
        act_bytes_per_token=0.0, input_bytes_per_token=0.0, weights=(head,),
    ))
    largest_chunk = max(w.chunk_bytes for layer in layers for w in layer.weights)
    page = -(-largest_chunk // PAGE_ALIGN) * PAGE_ALIGN
    shards = sum(w.shard_bytes for layer in layers for w in layer.weights)  # real bytes, no padding
    replicated = BF16 * (m.vocab * h + (2 * m.layers + 1) * h)  # embedding + norms
    adapters = m.layers * lora_params
    loss_bytes = 10 * m.vocab  # bytes per token moved by the loss, forward and backward
    # The dequant workspace: the most one call writes (a whole projection; one chunk of lm_head).
    head_rows = min(m.vocab, chunk_bytes // (BF16 * h))  # rows of one lm_head chunk
    workspace = 0 if fmt is None else BF16 * max([rows * cols for _, rows, cols in projections] + [head_rows * h])
    return Profile(
        source=f"synthetic:{shape}",
        device=f"{dev.name} x{ranks} (synthetic)",
        world_size=ranks,
        seq_len=seq_len,
        capacity_bytes=dev.capacity_bytes,
        reserved_bytes=dev.reserved_bytes,
        static_bytes=(shards if weights_on == "device" else 0) + replicated + 16 * adapters + workspace,
        page_bytes=page,
        adapter_grad_bytes=4 * adapters,
        allgather=dev.allgather(ranks),
        allreduce=dev.allreduce(ranks),
        layers=tuple(layers),
        outside=OutsideProfile(fwd_s_per_token=loss_bytes / dev.hbm_bytes_per_s,
                               bwd_s_per_token=loss_bytes / dev.hbm_bytes_per_s,
                               act_bytes_per_token=float(BF16 * h), peak_bytes_per_token=float(10 * m.vocab)),
        h2d=dev.h2d() if host_tier else None,
        host_store=host_tier,
        weights_on=weights_on,
        host_budget_bytes=host_budget_bytes,
        copy=dev.copy(),
        weight_format=fmt,
    )
