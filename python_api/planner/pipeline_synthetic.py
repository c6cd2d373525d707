"""Synthetic pipeline profiles: a model's shape (`PIPE_SHAPES`) on a GPU and its links
(`PIPE_DEVICES`) as the pipeline cost model's profile (pipeline_model.py), from FLOPs and bytes,
for planning models and machines this VM cannot run.
"""

from __future__ import annotations

from dataclasses import dataclass

from .pipeline import PipelineError
from .pipeline_model import PipeLayer, PipelineProfile, PipeWeight
from .profile import Link


@dataclass(frozen=True)
class PipeShape:
    """A decoder-only model's dimensions (Llama or GPT-2 style)."""

    kind: str  # "llama" | "gpt2"
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    vocab: int

    def projections(self) -> list[tuple[str, int, int]]:
        h, i = self.hidden, self.intermediate
        kv = h // self.heads * self.kv_heads
        if self.kind == "gpt2":
            return [("attn.c_attn", 3 * h, h), ("attn.c_proj", h, h), ("mlp.c_fc", i, h), ("mlp.c_proj", h, i)]
        return [("self_attn.q_proj", h, h), ("self_attn.k_proj", kv, h), ("self_attn.v_proj", kv, h),
                ("self_attn.o_proj", h, h), ("mlp.gate_proj", i, h), ("mlp.up_proj", i, h), ("mlp.down_proj", h, i)]


PIPE_SHAPES = {
    # GPT-2 XL (the Tiny-Pipe paper's model): 48 layers, 1600 wide, 25 heads, vocab 50257.
    "gpt2-xl": PipeShape("gpt2", 1600, 6400, 48, 25, 25, 50257),
    "llama2-7b": PipeShape("llama", 4096, 11008, 32, 32, 32, 32000),
    "llama2-70b": PipeShape("llama", 8192, 28672, 80, 64, 8, 32000),
}


# [Note: the per-action overhead]: the synthetic profiles' stage overhead per action.
SYNTHETIC_STAGE_OVERHEAD_S = 100e-6


@dataclass(frozen=True)
class PipeDevice:
    """A GPU and its links for synthetic pipeline profiles (rates achieved, not peak)."""

    name: str
    flops: float
    hbm_bytes_per_s: float
    capacity_bytes: int
    reserved_bytes: int
    allgather: Link
    allreduce: Link
    p2p: Link
    h2d: Link


GiB = 1 << 30
PIPE_DEVICES = {
    # Tiny-Pipe's setting: 4 x 24 GB GPUs on PCIe (RTX 3090 / A5000 class): ~71 TFLOP/s dense
    # bf16 peak taken at 50%; 936 GB/s memory; PCIe Gen4 x16 between GPUs through the host,
    # ~12 GB/s achieved for collectives and P2P (no NVLink), ~20 GB/s host -> device.
    # Assumptions, not measurements.
    "pcie-24g": PipeDevice("4 x 24 GB PCIe (synthetic)", 0.5 * 71e12, 936e9, 24 * GiB, 1 * GiB,
                           allgather=Link(60e-6, 12e9), allreduce=Link(120e-6, 12e9 / 1.5), p2p=Link(30e-6, 12e9),
                           h2d=Link(10e-6, 20e9)),
    # The plain planner's A100 40GB PCIe node (planner/shapes.py DEVICES["a100-40g-pcie"]): 8 GPUs,
    # ~25 GB/s all-gather bus bandwidth, 50% of 312 TFLOP/s, ~25 GB/s host -> device.
    "a100-40g-pcie": PipeDevice("8 x A100 40GB PCIe (synthetic)", 0.5 * 312e12, 1.555e12, 40 * GiB, 3 * GiB // 2,
                                allgather=Link(60e-6, 25e9), allreduce=Link(120e-6, 25e9 / 1.75),
                                p2p=Link(30e-6, 25e9), h2d=Link(10e-6, 25e9)),
}


def synthetic_pipeline_profile(shape: str, ranks: int, seq_len: int, device: str = "pcie-24g", *,
                               lora_rank: int = 16, chunk_bytes: int = 4 << 20, weights_on: str = "device",
                               element_size: int = 2) -> PipelineProfile:
    """The pipeline profile of `shape` on `ranks` GPUs of `device` from its FLOPs and bytes
    (the assumptions of [Note: synthetic profile assumptions] in planner/shapes.py: forward 2 x
    weights + attention per token, backward twice the attention and the LoRA terms and dX only,
    100/200 us fixed per call; saved activations as stated there; bf16; the per-action overhead
    of [Note: the per-action overhead])."""
    if shape not in PIPE_SHAPES:
        raise PipelineError(f"unknown shape {shape!r}; known: {', '.join(PIPE_SHAPES)}")
    if device not in PIPE_DEVICES:
        raise PipelineError(f"unknown device {device!r}; known: {', '.join(PIPE_DEVICES)}")
    s, dev = PIPE_SHAPES[shape], PIPE_DEVICES[device]
    h, i, r = s.hidden, s.intermediate, lora_rank
    proj = s.projections()
    params = sum(a * b for _, a, b in proj)
    lora = sum(r * (a + b) for _, a, b in proj)
    attn = 2 * seq_len * h
    fwd = (2 * params + attn + 2 * lora) / dev.flops
    bwd = (2 * params + 2 * attn + 4 * lora) / dev.flops
    kv = h // s.heads * s.kv_heads
    act = element_size * (6 * h + 2 * kv + 4 * i) + 4 * s.heads + len(proj) * 4 * r
    layers = []
    for li in range(s.layers):
        ws = tuple(PipeWeight(f"layers.{li}.{n}", a, b, element_size,
                              backward=not (li == 0 and n in ("self_attn.q_proj", "self_attn.k_proj",
                                                               "self_attn.v_proj", "attn.c_attn")))
                   for n, a, b in proj)
        layers.append(PipeLayer(f"layers.{li}", 100e-6, fwd, 200e-6, bwd, float(act), ws, lora))
    head_flops = 2 * s.vocab * h
    head_bytes = element_size * s.vocab * h
    tied = s.kind == "gpt2"
    embed = element_size * s.vocab * h + (element_size * 1024 * h if s.kind == "gpt2" else 0)
    return PipelineProfile(
        source=f"synthetic:{shape}", device=f"{dev.name} x{ranks}", world_size=ranks, seq_len=seq_len,
        hidden_size=h, act_element_size=element_size, layers=tuple(layers), chunk_bytes=chunk_bytes,
        allgather=dev.allgather, allreduce=dev.allreduce, p2p=dev.p2p, capacity_bytes=dev.capacity_bytes,
        reserved_bytes=dev.reserved_bytes, embed_fwd_s_per_token=0.0,
        head_fwd_s_per_token=head_flops / dev.flops + 10 * s.vocab / dev.hbm_bytes_per_s,
        head_bwd_s_per_token=head_flops / dev.flops + 10 * s.vocab / dev.hbm_bytes_per_s,
        head_act_bytes_per_token=float(element_size * h), head_peak_bytes_per_token=float(10 * s.vocab),
        first_static_bytes=embed, last_static_bytes=(head_bytes if tied else 0) + element_size * 2 * h,
        head_weights=() if tied else (PipeWeight("lm_head", s.vocab, h, element_size),),
        h2d=dev.h2d, weights_on=weights_on, stage_overhead_s=SYNTHETIC_STAGE_OVERHEAD_S, schedule_overhead_s=0.0,
    )


__all__ = ["PIPE_DEVICES", "PIPE_SHAPES", "PipeDevice", "PipeShape", "synthetic_pipeline_profile"]
