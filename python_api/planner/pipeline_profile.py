"""The inputs of the pipeline models: one model on one machine, per rank (PipelineProfile), its
decoder layers (PipeLayer) and their frozen weights (PipeWeight). Pure Python. Measured by
python_api/pipeline/profile.py or synthesised by pipeline_synthetic.py; the models that read
them: pipeline_cost.py, pipeline_sim.py, pipeline_model.py.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..config import quant_rows_per_chunk
from .pipeline import PipelineError
from .profile import Link, WeightFormat


@dataclass(frozen=True)
class PipeWeight:
    """One frozen elastic weight: [rows = out, cols = in] of `element_size` bytes, stored in
    `fmt` (None: as is; a WeightFormat: each chunk one quantized blob)."""

    name: str
    rows: int
    cols: int
    element_size: int
    backward: bool = True
    fmt: WeightFormat | None = None

    def layout(self, chunk_bytes: int, dp: int) -> tuple[int, int, int, int]:
        """(chunks, chunk bytes (full), slice bytes per rank, real bytes), as the runtime lays
        it out: rows per chunk from the weight's own row bytes (ElasticTensor.layout; quantized,
        rounded to whole blocks as ElasticPolicy.weight_rows_per_chunk rounds them); stored
        as is, ChunkLayout's slices; quantized, the image's (QuantizedLayout.image_layout:
        chunk c is blob c, a full blob's bytes split over dp, the real bytes the blobs' sum)."""
        row = self.cols * self.element_size
        rpc = min(self.rows, max(1, chunk_bytes // row))
        if self.fmt is not None:  # whole blocks per chunk (ElasticPolicy.weight_rows_per_chunk)
            rpc = quant_rows_per_chunk(rpc, self.rows, self.cols, self.fmt.block_size)
        chunks = -(-self.rows // rpc)
        if self.fmt is None:
            return chunks, rpc * row, -(-(rpc * self.cols) // dp) * self.element_size, self.rows * row
        blob = self.fmt.blob_bytes(rpc, self.cols)
        last = self.fmt.blob_bytes(self.rows - (chunks - 1) * rpc, self.cols)
        return chunks, blob, -(-blob // dp), (chunks - 1) * blob + last


@dataclass(frozen=True)
class PipeLayer:
    """One decoder layer: compute per call (fixed + per token), bytes it saves for backward
    per token, its frozen weights and its adapter parameters."""

    name: str
    fwd_s_fixed: float
    fwd_s_per_token: float
    bwd_s_fixed: float
    bwd_s_per_token: float
    act_bytes_per_token: float
    weights: tuple[PipeWeight, ...]
    adapter_params: int = 0

    def fwd_s(self, tokens: int) -> float:
        return self.fwd_s_fixed + self.fwd_s_per_token * tokens

    def bwd_s(self, tokens: int) -> float:
        return self.bwd_s_fixed + self.bwd_s_per_token * tokens


@dataclass(frozen=True)
class PipelineProfile:
    """What the pipeline models need about one model on one machine (per rank, bytes and
    seconds): its layers, the embeddings and head, the links, the memory."""

    source: str
    device: str
    world_size: int
    seq_len: int
    hidden_size: int
    act_element_size: int
    layers: tuple[PipeLayer, ...]
    chunk_bytes: int
    allgather: Link
    allreduce: Link
    p2p: Link
    capacity_bytes: int
    reserved_bytes: int = 0
    embed_fwd_s_per_token: float = 0.0
    head_fwd_s_per_token: float = 0.0
    head_bwd_s_per_token: float = 0.0
    head_act_bytes_per_token: float = 0.0
    head_peak_bytes_per_token: float = 0.0
    first_static_bytes: int = 0  # replicated on the first pack (embeddings)
    last_static_bytes: int = 0  # replicated on the last pack (final norm, head when replicated)
    head_weights: tuple[PipeWeight, ...] = ()  # an elastic lm_head (last pack)
    head_adapter_params: int = 0
    h2d: Link | None = None
    weights_on: str = "device"
    cpu_gloo: bool = False  # gloo's all-gather scratch copy ([Note: the pipeline memory model])
    workspace_bytes_per_token: float = 0.0  # a backward's transient beyond the saved activations
    prefetch_depth: int = 1  # the runtime's in-pack window: a transient pack's pool holds 1 + this layers
    # [Note: the per-action overhead]: seconds per action (F or B of one pack on one micro-batch)
    # beyond its layers' compute, inside the stage's forward/backward (counted busy) and in the
    # schedule between actions (the rank is occupied, the measured bubble counts it idle).
    stage_overhead_s: float = 0.0
    schedule_overhead_s: float = 0.0
    # [Note: ranks sharing cores]: busy_speed[b - 1] = the compute speed of a rank while b of
    # the pp ranks compute, relative to all of them computing (the speed the layers were timed
    # at); () = no sharing (a GPU per rank).
    busy_speed: tuple = ()

    def __post_init__(self):
        if not self.layers:
            raise PipelineError("a pipeline profile needs decoder layers")
        check_busy_speed(self.busy_speed)
        for name in ("stage_overhead_s", "schedule_overhead_s"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
                raise PipelineError(f"{name} must be a finite number of seconds >= 0, got {v!r}")
        if self.weights_on not in ("device", "host"):
            raise PipelineError(f'weights_on must be "device" or "host", got {self.weights_on!r}')
        if self.weights_on == "host" and self.h2d is None:
            raise PipelineError("a profile with weights_on='host' needs the h2d link")


__all__ = ["PipeLayer", "PipeWeight", "PipelineProfile"]


def check_busy_speed(speed) -> None:
    """A profile's busy_speed: () or positive finite numbers, the last (every rank busy) 1."""
    if not isinstance(speed, tuple):
        raise PipelineError(f"busy_speed must be a tuple, got {type(speed).__name__}")
    for v in speed:
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
            raise PipelineError(f"busy_speed must hold positive finite numbers, got {speed!r}")
    if speed and speed[-1] != 1:
        raise PipelineError(f"busy_speed[-1] (every rank busy, the speed the compute was timed at) must be 1, "
                            f"got {speed!r}")
