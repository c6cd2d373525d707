"""The planner's input: a `Profile` of one model on one machine, per rank.

A profile holds what the memory and cost models need and nothing about how it was obtained:
measured from warm-up steps of the real model (`source="measured"`), built from a named
shape (`"synthetic:<shape>"`, python_api/planner/shapes.py) or written by hand for another
machine (`"hand"`). It is a small JSON document:

    profile.save("profile.json"); Profile.load("profile.json")

Every quantity is *per rank*, in bytes and seconds. `layers` are the runtime's units in
forward order ([Note: units and coalesced gathers] in python_api/runtime/): a decoder layer,
or a weight that is its own unit (e.g. an elastic `lm_head`). Each weight is described by its
chunk layout exactly as the runtime lays it out (`ChunkLayout`): `chunks` (n), `chunk_bytes`
(bytes of one full chunk: rows_per_chunk x row bytes) and `slice_bytes` (bytes of one
chunk's per-rank slice, padding included: ceil(chunk_numel / world_size) x element size).
A rank receives (world_size - 1) x slice_bytes for every chunk it gathers, ragged last chunk
included (what is sent is chunk-major with equal slices; a shard holds no padding, so the
shards in `static_bytes` are `WeightProfile.shard_bytes`).

`backward` (optional, default true) says whether the weight has a backward use: false for
a frozen weight whose input needs no gradient (the q/k/v projections of the first decoder
layer of a LoRA model whose embeddings are frozen), which the runtime gathers in forward
only and, when its layer is recomputed, again in the recompute.

The host tier (all optional; absent = no host tier, and older documents load unchanged):
`h2d` is the host->device copy link (latency + bytes / bandwidth, also used for the
device->host copies of activation offload); `host_store` says whether the runtime has the
node's host store (built when the policy had weights_on="host" or host_fraction > 0 at wrap
time), so the planner may choose a host fraction; `weights_on` ("device" | "host": with
"host" no device shard exists, `static_bytes` has none, and every chunk is a host chunk);
`host_budget_bytes` caps the activation offload's host buffers (None: no cap). Per weight,
`last_chunk_bytes` is the real bytes of its last (possibly ragged) chunk, what a host copy of
it moves (default: chunk_bytes). Per layer, `offload_tensors_bytes_per_token` are the bytes per
token of each tensor the activation offload moves after the layer's forward, in the order it
moves them (what `ActivationOffload` copies: lora_x, xa and the dropout mask of each elastic
LoRA linear), and `offload_freed_bytes_per_token` the device bytes that leaves free (an input
shared by q/k/v is copied three times but freed once). See [Note: chunk sources and the host
link] in cost.py and [Note: activation offload in the memory model] in memory.py.

Resident runs (optional; absent = never, and older documents load unchanged): per weight,
`run_bytes` is what the weight costs when every chunk of it is kept across iterations and the
runtime holds it as one run ([Note: resident runs] in python_api/runtime/tensor.py): its bytes
once, no shard beside it, no page. Present only where the runtime can do so (a measured
profile sets it for a weight on the device, not quantized, whose full chunks split evenly
over the ranks, at world size > 1, with `ElasticPolicy.resident_runs`); the memory model
counts it ([Note: what the memory model counts] in memory.py).

Quantized frozen weights (optional; absent = stored as they are, and older documents load
unchanged): `weight_format` ({"name": "nf4" | "int8", "block_size", "nested"}) records the
format the runtime stores the weights in, the user's choice (ElasticPolicy.weight_format): the
byte fields of every weight are then its quantized chunks' (blobs), and per weight `dequant_s`
is the seconds one use of it spends dequantizing its chunks into the compute dtype, added to
every use's compute ([Note: dequantization in the time model] in cost.py). A document without
them has no format and a dequant time of 0: measured before this field existed, its layer
times already hold any dequantization (they were timed with it inside), so nothing is lost or
counted twice. The planner never changes the format: a plan records it (plan.py).
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from functools import cached_property

from ..config import MAX_QUANT_BLOCK, MIN_QUANT_BLOCK, WEIGHT_FORMATS

PROFILE_VERSION = 1

# Scales per nested (fp32) scale of NF4's double quantization (elastic_kernels/quant/nf4.py
# NESTED_BLOCK; repeated because the planner is torch-free, tests/quant/test_planner_quant.py
# checks that the blob sizes below equal the kernels layer's).
NF4_NESTED_BLOCK = 256


class ProfileError(ValueError):
    """A profile (or plan) document that is malformed; the message names the bad field."""


# ---------------------------------------------------------------- field checks

def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v) -> bool:
    return (isinstance(v, (int, float)) and not isinstance(v, bool)) and math.isfinite(v)


def check_int(where: str, v, minimum: int = 0) -> int:
    if not _is_int(v) or v < minimum:
        raise ProfileError(f"{where} must be an int >= {minimum}, got {v!r}")
    return v


def check_num(where: str, v, minimum: float = 0.0, positive: bool = False) -> float:
    if not _is_num(v) or v < minimum or (positive and v <= 0):
        bound = f"> {minimum}" if positive else f">= {minimum}"
        raise ProfileError(f"{where} must be a finite number {bound}, got {v!r}")
    return float(v)


def check_str(where: str, v) -> str:
    if not isinstance(v, str) or not v:
        raise ProfileError(f"{where} must be a non-empty string, got {v!r}")
    return v


def check_bool(where: str, v) -> bool:
    if not isinstance(v, bool):
        raise ProfileError(f"{where} must be true or false, got {v!r}")
    return v


def check_keys(where: str, d, required: tuple[str, ...], optional: tuple[str, ...] = ()) -> dict:
    if not isinstance(d, dict):
        raise ProfileError(f"{where} must be an object, got {type(d).__name__}")
    missing = [k for k in required if k not in d]
    if missing:
        raise ProfileError(f"{where}: missing field(s) {', '.join(missing)}")
    unknown = sorted(set(d) - set(required) - set(optional))
    if unknown:
        raise ProfileError(f"{where}: unknown field(s) {', '.join(unknown)}")
    return d


# ---------------------------------------------------------------- parts

@dataclass(frozen=True)
class Link:
    """A collective's time: latency_s + bytes / bytes_per_s. For the all-gather, bytes are
    what each rank *receives*; for the all-reduce, the bytes of the buffer reduced."""

    latency_s: float
    bytes_per_s: float

    def time(self, nbytes: int) -> float:
        return 0.0 if nbytes <= 0 else self.latency_s + nbytes / self.bytes_per_s

    @classmethod
    def from_dict(cls, where: str, d) -> Link:
        check_keys(where, d, ("latency_s", "bytes_per_s"))
        return cls(check_num(f"{where}.latency_s", d["latency_s"]),
                   check_num(f"{where}.bytes_per_s", d["bytes_per_s"], positive=True))


@dataclass(frozen=True)
class WeightFormat:
    """How the frozen weights are stored: `name` "nf4" or "int8", `block_size` weights per
    quantization block, `nested` (nf4 only) double quantization of the scales. The user's
    choice (ElasticPolicy.weight_format, quant_block_size, quant_nested), never the planner's:
    it changes the model's numerics. [Note: quantized chunk blob] in
    elastic_kernels/quant/blob.py says the bytes."""

    name: str
    block_size: int
    nested: bool = False

    def __post_init__(self):
        if self.name not in WEIGHT_FORMATS:
            raise ProfileError(f"weight_format.name must be one of {list(WEIGHT_FORMATS)}, got {self.name!r}")
        b = self.block_size
        if not _is_int(b) or not MIN_QUANT_BLOCK <= b <= MAX_QUANT_BLOCK or b & (b - 1):
            raise ProfileError(f"weight_format.block_size must be a power of two in [{MIN_QUANT_BLOCK}, "
                               f"{MAX_QUANT_BLOCK}], got {b!r}")
        check_bool("weight_format.nested", self.nested)
        if self.nested and self.name != "nf4":
            raise ProfileError(f"weight_format.nested is an nf4 option; {self.name} has no nested scales")

    @classmethod
    def of_policy(cls, policy) -> WeightFormat | None:
        """The format an ElasticPolicy stores the weights in (None: unquantized)."""
        if policy.weight_format is None:
            return None
        return cls(policy.weight_format, policy.block_size, bool(policy.quant_nested))

    def blob_bytes(self, rows: int, cols: int) -> int:
        """Bytes of the blob of a chunk of `rows` x `cols` weights (codes, then scales; nested:
        scale codes, nested fp32 scales and the offset), as NF4ChunkFormat / Int8ChunkFormat:
        blocks run over the chunk's weights flattened, the last one partial when the block does
        not divide them (nf4 codes: ceil(numel / 2) bytes)."""
        numel = rows * cols
        blocks = -(-numel // self.block_size)
        if self.name == "int8":
            return numel + 4 * blocks
        if self.nested:
            return (numel + 1) // 2 + blocks + 4 * -(-blocks // NF4_NESTED_BLOCK) + 4
        return (numel + 1) // 2 + 4 * blocks

    def describe(self) -> str:
        return f"{self.name} (block {self.block_size}{', nested scales' if self.nested else ''})"

    @classmethod
    def from_dict(cls, where: str, d) -> WeightFormat:
        check_keys(where, d, ("name", "block_size"), ("nested",))
        return cls(check_str(f"{where}.name", d["name"]), d["block_size"], d.get("nested", False))

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class WeightProfile:
    """One frozen weight of a unit, by its chunk layout (see the module docstring)."""

    name: str
    chunks: int
    slice_bytes: int
    chunk_bytes: int
    backward: bool = True
    last_chunk_bytes: int | None = None  # None: chunk_bytes (the last chunk is full)
    dequant_s: float = 0.0  # one use's dequantization of every chunk (quantized weights; 0: none)
    run_bytes: int | None = None  # held as a run when every chunk persists (None: never; module doc)

    @property
    def shard_bytes(self) -> int:
        """The largest shard of the weight as `static_bytes` counts it (rank 0's, whose static
        bytes are the MAX over ranks): its real bytes, no padding ([Note: chunk-major shard
        layout]): (chunks - 1) x slice_bytes for the full chunks, plus its slice of the last
        chunk, slice_bytes or the last chunk's bytes when fewer."""
        return (self.chunks - 1) * self.slice_bytes + min(self.slice_bytes, self.last_bytes)

    @property
    def last_bytes(self) -> int:
        """Real bytes of the last chunk (what its host copy moves)."""
        return self.chunk_bytes if self.last_chunk_bytes is None else self.last_chunk_bytes

    def host_bytes(self, chunks: int, last: bool) -> int:
        """Bytes a host copy of `chunks` chunks moves, the last chunk among them when `last`."""
        return chunks * self.chunk_bytes - ((self.chunk_bytes - self.last_bytes) if last and chunks else 0)

    @classmethod
    def from_dict(cls, where: str, d) -> WeightProfile:
        check_keys(where, d, ("name", "chunks", "slice_bytes", "chunk_bytes"),
                   ("backward", "last_chunk_bytes", "dequant_s", "run_bytes"))
        last = d.get("last_chunk_bytes")
        run = d.get("run_bytes")
        out = cls(
            name=check_str(f"{where}.name", d["name"]),
            chunks=check_int(f"{where}.chunks", d["chunks"], 1),
            slice_bytes=check_int(f"{where}.slice_bytes", d["slice_bytes"], 1),
            chunk_bytes=check_int(f"{where}.chunk_bytes", d["chunk_bytes"], 1),
            backward=check_bool(f"{where}.backward", d.get("backward", True)),
            last_chunk_bytes=None if last is None else check_int(f"{where}.last_chunk_bytes", last, 1),
            dequant_s=check_num(f"{where}.dequant_s", d.get("dequant_s", 0.0)),
            run_bytes=None if run is None else check_int(f"{where}.run_bytes", run, 1),
        )
        if out.last_bytes > out.chunk_bytes:
            raise ProfileError(f"{where}.last_chunk_bytes ({out.last_bytes}) exceeds chunk_bytes ({out.chunk_bytes})")
        return out

    def to_dict(self) -> dict:
        out = asdict(self)
        if self.last_chunk_bytes is None:
            del out["last_chunk_bytes"]
        if not self.dequant_s:
            del out["dequant_s"]
        if self.run_bytes is None:
            del out["run_bytes"]
        return out


@dataclass(frozen=True)
class LayerProfile:
    """One unit (gathered as a whole). Times per call: fixed + per_token x tokens, plus the
    dequantization of its quantized weights (`dequant_fwd_s` per forward or recompute use,
    `dequant_bwd_s` per backward use: [Note: dequantization in the time model] in cost.py),
    which the fixed and per-token parts do not hold.

    act_bytes_per_token    saved for backward when the layer is not recomputed (and, during
                           its own forward or backward, the working activations of the layer)
    input_bytes_per_token  what a recomputed layer keeps: its input
    """

    name: str
    recomputable: bool
    fwd_s_per_token: float
    bwd_s_per_token: float
    fwd_s_fixed: float
    bwd_s_fixed: float
    act_bytes_per_token: float
    input_bytes_per_token: float
    weights: tuple[WeightProfile, ...]
    offload_tensors_bytes_per_token: tuple[float, ...] = ()
    offload_freed_bytes_per_token: float = 0.0
    offload_tensors_weight: tuple[str, ...] = ()  # per offloaded tensor: the weight whose LoRA linear saved it

    @property
    def offloadable_bytes_per_token(self) -> float:
        """Bytes per token the activation offload moves after this layer's forward (D2H) and
        back before its backward (H2D), when the host budget serves every request."""
        return float(sum(self.offload_tensors_bytes_per_token))

    @property
    def chunks(self) -> int:
        return sum(w.chunks for w in self.weights)

    @cached_property
    def dequant_fwd_s(self) -> float:
        """Dequantization in one forward (or recompute) use: every weight of the unit."""
        return sum(w.dequant_s for w in self.weights)

    @cached_property
    def dequant_bwd_s(self) -> float:
        """Dequantization in one backward use: the weights with a backward use."""
        return sum(w.dequant_s for w in self.weights if w.backward)

    def fwd_s(self, tokens: int) -> float:
        """One forward (or recompute) use's compute, its dequantization included."""
        return self.fwd_s_fixed + self.fwd_s_per_token * tokens + self.dequant_fwd_s

    def bwd_s(self, tokens: int) -> float:
        """One backward use's compute, its dequantization included."""
        return self.bwd_s_fixed + self.bwd_s_per_token * tokens + self.dequant_bwd_s

    @classmethod
    def from_dict(cls, where: str, d) -> LayerProfile:
        check_keys(where, d, ("name", "recomputable", "fwd_s_per_token", "bwd_s_per_token", "fwd_s_fixed",
                              "bwd_s_fixed", "act_bytes_per_token", "input_bytes_per_token", "weights"),
                   ("offload_tensors_bytes_per_token", "offload_freed_bytes_per_token", "offload_tensors_weight"))
        offl = d.get("offload_tensors_bytes_per_token", [])
        if not isinstance(offl, list):
            raise ProfileError(f"{where}.offload_tensors_bytes_per_token must be a list, got {type(offl).__name__}")
        owners = d.get("offload_tensors_weight", [])
        if not isinstance(owners, list):
            raise ProfileError(f"{where}.offload_tensors_weight must be a list, got {type(owners).__name__}")
        ws = d["weights"]
        if not isinstance(ws, list):
            raise ProfileError(f"{where}.weights must be a list, got {type(ws).__name__}")
        weights = tuple(WeightProfile.from_dict(f"{where}.weights[{j}]", w) for j, w in enumerate(ws))
        names = [w.name for w in weights]
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise ProfileError(f"{where}.weights: duplicate weight name(s) {', '.join(dup)}")
        return cls(
            name=check_str(f"{where}.name", d["name"]),
            recomputable=check_bool(f"{where}.recomputable", d["recomputable"]),
            fwd_s_per_token=check_num(f"{where}.fwd_s_per_token", d["fwd_s_per_token"]),
            bwd_s_per_token=check_num(f"{where}.bwd_s_per_token", d["bwd_s_per_token"]),
            fwd_s_fixed=check_num(f"{where}.fwd_s_fixed", d["fwd_s_fixed"]),
            bwd_s_fixed=check_num(f"{where}.bwd_s_fixed", d["bwd_s_fixed"]),
            act_bytes_per_token=check_num(f"{where}.act_bytes_per_token", d["act_bytes_per_token"]),
            input_bytes_per_token=check_num(f"{where}.input_bytes_per_token", d["input_bytes_per_token"]),
            weights=weights,
            offload_tensors_bytes_per_token=tuple(
                check_num(f"{where}.offload_tensors_bytes_per_token[{j}]", b, positive=True) for j, b in enumerate(offl)),
            offload_freed_bytes_per_token=check_num(f"{where}.offload_freed_bytes_per_token",
                                                    d.get("offload_freed_bytes_per_token", 0.0)),
            offload_tensors_weight=tuple(check_str(f"{where}.offload_tensors_weight[{j}]", n)
                                         for j, n in enumerate(owners)),
        )

    def to_dict(self) -> dict:
        out = asdict(self)
        out["weights"] = [w.to_dict() for w in self.weights]
        out["offload_tensors_bytes_per_token"] = list(self.offload_tensors_bytes_per_token)
        out["offload_tensors_weight"] = list(self.offload_tensors_weight)
        if not self.offload_tensors_weight:
            del out["offload_tensors_weight"]
        if not self.offload_tensors_bytes_per_token and not self.offload_freed_bytes_per_token:
            del out["offload_tensors_bytes_per_token"], out["offload_freed_bytes_per_token"]
        return out

    def offload_owner_indices(self) -> tuple[int, ...]:
        """Per offloaded tensor, the index in `weights` of the LoRA linear that saved it; without
        `offload_tensors_weight` (older profiles) every tensor is the last weight's (the layer
        is then one offloading linear, restored first in its backward)."""
        if not self.offload_tensors_weight:
            return (len(self.weights) - 1,) * len(self.offload_tensors_bytes_per_token)
        index = {w.name: j for j, w in enumerate(self.weights)}
        return tuple(index[n] for n in self.offload_tensors_weight)


@dataclass(frozen=True)
class OutsideProfile:
    """What the planner does not plan: embeddings, final norm, head, loss.

    act_bytes_per_token   saved from forward to backward
    peak_bytes_per_token  the transient at the end of forward / start of backward (logits,
                          their fp32 copy for the loss, the loss's gradient)
    workspace_bytes_per_token  the transient of a layer's backward beyond its saved
                          activations (gradient buffers); measured by the profiler as what the
                          measured peak of a step without gathers exceeds the model by
                          (python_api/planning/measure.py), 0 when unknown
    recompute_workspace_bytes_per_token  what the backward of a recomputed layer takes
                          beyond that (the recompute's own transients), measured the same way
                          on a step that recomputes every layer
    """

    fwd_s_per_token: float
    bwd_s_per_token: float
    act_bytes_per_token: float
    peak_bytes_per_token: float
    workspace_bytes_per_token: float = 0.0
    recompute_workspace_bytes_per_token: float = 0.0

    @classmethod
    def from_dict(cls, where: str, d) -> OutsideProfile:
        check_keys(where, d, ("fwd_s_per_token", "bwd_s_per_token", "act_bytes_per_token", "peak_bytes_per_token"),
                   ("workspace_bytes_per_token", "recompute_workspace_bytes_per_token"))
        return cls(**{k: check_num(f"{where}.{k}", d[k]) for k in d})


# ---------------------------------------------------------------- the profile

_SCALARS = ("version", "source", "device", "world_size", "seq_len", "capacity_bytes", "reserved_bytes",
            "static_bytes", "page_bytes", "adapter_grad_bytes")


@dataclass(frozen=True)
class Profile:
    """Per-rank quantities of one model on one machine (see the module docstring)."""

    source: str
    device: str
    world_size: int
    seq_len: int
    capacity_bytes: int
    reserved_bytes: int
    static_bytes: int
    page_bytes: int
    adapter_grad_bytes: int
    allgather: Link
    allreduce: Link
    layers: tuple[LayerProfile, ...]
    outside: OutsideProfile
    version: int = PROFILE_VERSION
    h2d: Link | None = None  # host -> device copies (and device -> host); None: no host tier
    host_store: bool = False  # the runtime has the node's host store: a host fraction may be chosen
    weights_on: str = "device"  # "host": no device shard, every chunk from the host store
    host_budget_bytes: int | None = None  # the activation offload's host buffer cap (None: none)
    copy: Link | None = None  # device memory copies (a gather's pack and unpack); None: not timed
    weight_format: WeightFormat | None = None  # None: the frozen weights are stored unquantized

    @property
    def has_host_tier(self) -> bool:
        return self.h2d is not None

    def __post_init__(self):
        self.validate()

    # -------------------------------------------------------- validation

    def validate(self) -> None:
        check_int("profile.version", self.version, 1)
        if self.version != PROFILE_VERSION:
            raise ProfileError(f"profile.version is {self.version}; this planner reads version {PROFILE_VERSION}")
        src = check_str("profile.source", self.source)
        if not (src in ("measured", "hand") or (src.startswith("synthetic:") and len(src) > len("synthetic:"))):
            raise ProfileError(f"profile.source must be 'measured', 'hand' or 'synthetic:<shape>', got {src!r}")
        check_str("profile.device", self.device)
        check_int("profile.world_size", self.world_size, 1)
        check_int("profile.seq_len", self.seq_len, 1)
        check_int("profile.capacity_bytes", self.capacity_bytes, 1)
        check_int("profile.reserved_bytes", self.reserved_bytes)
        check_int("profile.static_bytes", self.static_bytes)
        check_int("profile.page_bytes", self.page_bytes, 1)
        check_int("profile.adapter_grad_bytes", self.adapter_grad_bytes)
        for name in ("allgather", "allreduce"):
            if not isinstance(getattr(self, name), Link):
                raise ProfileError(f"profile.{name} must be a Link, got {type(getattr(self, name)).__name__}")
        if self.h2d is not None and not isinstance(self.h2d, Link):
            raise ProfileError(f"profile.h2d must be a Link or None, got {type(self.h2d).__name__}")
        if self.copy is not None and not isinstance(self.copy, Link):
            raise ProfileError(f"profile.copy must be a Link or None, got {type(self.copy).__name__}")
        check_bool("profile.host_store", self.host_store)
        if self.weights_on not in ("device", "host"):
            raise ProfileError(f'profile.weights_on must be "device" or "host", got {self.weights_on!r}')
        if (self.host_store or self.weights_on == "host") and self.h2d is None:
            raise ProfileError("profile.h2d is missing: a profile with a host store needs the host link")
        if self.weights_on == "host" and not self.host_store:
            raise ProfileError('profile.weights_on is "host" but host_store is false: the weights live in the store')
        if self.host_budget_bytes is not None:
            check_int("profile.host_budget_bytes", self.host_budget_bytes)
        if self.weight_format is not None and not isinstance(self.weight_format, WeightFormat):
            raise ProfileError(f"profile.weight_format must be a WeightFormat or None, got "
                               f"{type(self.weight_format).__name__}")
        if not isinstance(self.outside, OutsideProfile):
            raise ProfileError(f"profile.outside must be an OutsideProfile, got {type(self.outside).__name__}")
        if not isinstance(self.layers, tuple) or not self.layers:
            raise ProfileError("profile.layers must be a non-empty tuple of LayerProfile")
        seen = set()
        for i, layer in enumerate(self.layers):
            if not isinstance(layer, LayerProfile):
                raise ProfileError(f"profile.layers[{i}] must be a LayerProfile, got {type(layer).__name__}")
            if layer.name in seen:
                raise ProfileError(f"profile.layers[{i}].name: duplicate layer name {layer.name!r}")
            seen.add(layer.name)
            if not layer.weights:
                raise ProfileError(f"profile.layers[{i}] ({layer.name}).weights is empty: a unit has frozen weights")
            if layer.input_bytes_per_token > layer.act_bytes_per_token and layer.recomputable:
                raise ProfileError(
                    f"profile.layers[{i}] ({layer.name}).input_bytes_per_token ({layer.input_bytes_per_token}) exceeds "
                    f"act_bytes_per_token ({layer.act_bytes_per_token}): a recomputed layer keeps its input, part of "
                    "what it would otherwise save"
                )
            owners = layer.offload_tensors_weight
            if owners:
                where = f"profile.layers[{i}] ({layer.name}).offload_tensors_weight"
                if len(owners) != len(layer.offload_tensors_bytes_per_token):
                    raise ProfileError(f"{where} names {len(owners)} weight(s) for "
                                       f"{len(layer.offload_tensors_bytes_per_token)} offloaded tensor(s)")
                index = {w.name: j for j, w in enumerate(layer.weights)}
                unknown = sorted({n for n in owners if n not in index})
                if unknown:
                    raise ProfileError(f"{where}: {', '.join(unknown)} is not a weight of this layer")
                seq = [index[n] for n in owners]
                if any(b < a for a, b in zip(seq, seq[1:])):
                    raise ProfileError(f"{where} must follow the weights' (forward) order, got {list(owners)}")
            for j, w in enumerate(layer.weights):
                where = f"profile.layers[{i}] ({layer.name}).weights[{j}] ({w.name})"
                check_num(f"{where}.dequant_s", w.dequant_s)
                if w.dequant_s and self.weight_format is None:
                    raise ProfileError(f"{where}.dequant_s is {w.dequant_s} but profile.weight_format is absent: "
                                       "only a quantized weight is dequantized")
                if w.chunk_bytes > self.page_bytes:
                    raise ProfileError(f"{where}.chunk_bytes ({w.chunk_bytes}) exceeds profile.page_bytes "
                                       f"({self.page_bytes}): a chunk must fit in one page")
                if w.slice_bytes * self.world_size < w.chunk_bytes:
                    raise ProfileError(f"{where}.slice_bytes ({w.slice_bytes}) x world_size ({self.world_size}) is "
                                       f"less than chunk_bytes ({w.chunk_bytes}): the slices must cover a chunk")
                if w.run_bytes is not None and (self.weights_on == "host" or self.weight_format is not None):
                    raise ProfileError(f"{where}.run_bytes is set, but a weight {'on the host' if self.weights_on == 'host' else 'stored quantized'} "
                                       "is never held as a run")
                if self.world_size == 1 and w.slice_bytes != w.chunk_bytes:
                    raise ProfileError(f"{where}.slice_bytes ({w.slice_bytes}) must equal chunk_bytes "
                                       f"({w.chunk_bytes}) at world_size 1")
        if self.reserved_bytes + self.static_bytes > self.capacity_bytes:
            raise ProfileError(
                f"profile.reserved_bytes + static_bytes ({self.reserved_bytes} + {self.static_bytes}) exceeds "
                f"capacity_bytes ({self.capacity_bytes})"
            )

    # -------------------------------------------------------- derived quantities

    def gather_link(self) -> Link:
        """What one use's gather occupies the communication stream for, as a function of the
        bytes it receives ([Note: the time model] in cost.py): the all-gather itself plus its
        pack (the slices, S bytes, into the send buffer) and unpack (W x S bytes into pages)
        copies, which run on the same stream: with received bytes D = (W - 1) S,
            latency (all-gather + 2 copy kernels) + D / all-gather rate + (W + 1) S / copy rate
        folded into one latency and one rate (received bytes per second)."""
        W = self.world_size
        if self.copy is None or W == 1:
            return self.allgather
        per_byte = 1.0 / self.allgather.bytes_per_s + (W + 1) / ((W - 1) * self.copy.bytes_per_s)
        return Link(self.allgather.latency_s + 2.0 * self.copy.latency_s, 1.0 / per_byte)

    @property
    def total_chunks(self) -> int:
        return sum(layer.chunks for layer in self.layers)

    def working_set_pages(self, prefetch_depth: int) -> int:
        """Pages the runtime adds to the cache budget: the chunks of the `1 + prefetch_depth`
        largest units (`ElasticRuntime._working_set_pages`), at most every chunk."""
        counts = sorted((layer.chunks for layer in self.layers), reverse=True)
        return min(self.total_chunks, sum(counts[: 1 + prefetch_depth]))

    # -------------------------------------------------------- JSON

    def to_dict(self) -> dict:
        out = {k: getattr(self, k) for k in _SCALARS}
        out["allgather"] = asdict(self.allgather)
        out["allreduce"] = asdict(self.allreduce)
        out["outside"] = asdict(self.outside)
        out["layers"] = [layer.to_dict() for layer in self.layers]
        if self.h2d is not None:
            out["h2d"] = asdict(self.h2d)
            out["host_store"] = self.host_store
            out["weights_on"] = self.weights_on
            out["host_budget_bytes"] = self.host_budget_bytes
        if self.copy is not None:
            out["copy"] = asdict(self.copy)
        if self.weight_format is not None:
            out["weight_format"] = self.weight_format.to_dict()
        return out

    def to_json(self, indent: int | None = 1) -> str:
        return json.dumps(self.to_dict(), indent=indent)

    @classmethod
    def from_dict(cls, d) -> Profile:
        check_keys("profile", d, _SCALARS + ("allgather", "allreduce", "layers", "outside"),
                   ("h2d", "host_store", "weights_on", "host_budget_bytes", "copy", "weight_format"))
        layers = d["layers"]
        if not isinstance(layers, list):
            raise ProfileError(f"profile.layers must be a list, got {type(layers).__name__}")
        return cls(
            version=d["version"],
            source=d["source"],
            device=d["device"],
            world_size=d["world_size"],
            seq_len=d["seq_len"],
            capacity_bytes=d["capacity_bytes"],
            reserved_bytes=d["reserved_bytes"],
            static_bytes=d["static_bytes"],
            page_bytes=d["page_bytes"],
            adapter_grad_bytes=d["adapter_grad_bytes"],
            allgather=Link.from_dict("profile.allgather", d["allgather"]),
            allreduce=Link.from_dict("profile.allreduce", d["allreduce"]),
            layers=tuple(LayerProfile.from_dict(f"profile.layers[{i}]", x) for i, x in enumerate(layers)),
            outside=OutsideProfile.from_dict("profile.outside", d["outside"]),
            h2d=None if d.get("h2d") is None else Link.from_dict("profile.h2d", d["h2d"]),
            host_store=d.get("host_store", False),
            weights_on=d.get("weights_on", "device"),
            host_budget_bytes=d.get("host_budget_bytes"),
            copy=None if d.get("copy") is None else Link.from_dict("profile.copy", d["copy"]),
            weight_format=(None if d.get("weight_format") is None
                           else WeightFormat.from_dict("profile.weight_format", d["weight_format"])),
        )

    @classmethod
    def from_json(cls, text: str) -> Profile:
        try:
            d = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ProfileError(f"profile: not valid JSON ({exc})") from None
        return cls.from_dict(d)

    def save(self, path: str) -> None:
        with open(path, "w") as f:
            f.write(self.to_json())
            f.write("\n")

    @classmethod
    def load(cls, path: str) -> Profile:
        with open(path) as f:
            return cls.from_json(f.read())
