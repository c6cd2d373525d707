"""The `Plan`: what the planner chose, per layer and weight, with the models' predictions; its
JSON form (what the CLI writes and `Plan.load` reads), its table, and `plan_of` (a plan for
given choices, predicted by the memory and cost models). The search that picks the choices:
search.py.

A plan records the weight format of the profile it was made for (`weight_format`: None for
weights stored as they are). The format is the user's choice, never a planner dimension (it
changes the model's numerics): every plan of a profile has the profile's format, and
`check_profile` / `elastic_kernels.api.planning.apply_plan` refuse a plan whose format is not the
profile's / the model's."""

from __future__ import annotations

import json
from dataclasses import dataclass

from .cost import allgather_bytes_per_step, h2d_bytes_per_step, step_cost
from .memory import Choices, effective_host_fraction, memory_curve, pool_budget_bytes
from .profile import (
    Profile,
    ProfileError,
    WeightFormat,
    check_bool,
    check_int,
    check_keys,
    check_num,
    check_str,
)

PLAN_VERSION = 1


class PlanningError(ValueError):
    """No plan fits the memory (the message names the shortfall in bytes), or bad arguments."""


@dataclass(frozen=True)
class WeightPlan:
    """One weight's residency as chunk counts, in the lifetimes of docs/architecture.md
    ("Residency"): its first `keep_chunks` chunks live at least a micro-batch (from forward to
    backward), the first `persist_chunks` of those are persistent (across steps), the rest are
    transient (gathered for each use): `ElasticRuntime.set_residency`'s arguments."""

    name: str
    keep_chunks: int
    persist_chunks: int
    chunks: int


@dataclass(frozen=True)
class LayerPlan:
    name: str
    recompute: bool
    weights: tuple[WeightPlan, ...]


_PLAN_FIELDS = ("version", "world_size", "memory_bytes", "global_batch", "micro_batch", "accumulation",
                "prefetch_depth", "pool_budget_bytes", "layers", "predicted_peak_bytes",
                "predicted_allgather_bytes_per_step", "predicted_step_time_s", "planning_seconds", "profile_source")
# Optional in a plan document (absent in plans written before the host tier): their defaults.
_PLAN_HOST_FIELDS = {"host_fraction": 0.0, "offload_activations": False, "predicted_h2d_bytes_per_step": 0}
# Optional (absent in plans written before several adapters; one adapter), written when not 1.
_PLAN_ADAPTER_FIELDS = {"num_adapters": 1}
# Optional too (absent in plans written before quantized weights: unquantized), always written.
_PLAN_FORMAT_FIELD = "weight_format"
# What the CLI adds to the plan it writes (python_api/finetune/planning.py `plan_document`):
# the run's record of the plan, not part of it; read and checked for shape, not kept.
_PLAN_RUN_FIELDS = ("adaptations", "profile_seconds")


@dataclass(frozen=True)
class Plan:
    """What the runtime follows: per-weight residency in chunk counts (the first keep_chunks
    chunks are kept, the first persist_chunks of those persist), per-layer recompute, the
    micro-batch split and the pool budget; with the models' predictions for it (per rank)."""

    world_size: int
    memory_bytes: int
    global_batch: int
    micro_batch: int
    accumulation: int
    prefetch_depth: int
    pool_budget_bytes: int
    layers: tuple[LayerPlan, ...]
    predicted_peak_bytes: int
    predicted_allgather_bytes_per_step: int
    predicted_step_time_s: float
    planning_seconds: float
    profile_source: str
    version: int = PLAN_VERSION
    host_fraction: float = 0.0  # share of missing chunks from the host store (runtime's host_fraction)
    offload_activations: bool = False
    predicted_h2d_bytes_per_step: int = 0  # host-chunk copies + activations brought back, per rank
    weight_format: WeightFormat | None = None  # the profile's (the user's choice); None: unquantized
    # adapters trained together, micro_batch sequences each ([Note: several adapters in the models])
    num_adapters: int = 1

    def __post_init__(self):
        self.validate()

    def validate(self) -> None:
        check_int("plan.version", self.version, 1)
        if self.version != PLAN_VERSION:
            raise ProfileError(f"plan.version is {self.version}; this planner reads version {PLAN_VERSION}")
        for name in ("world_size", "memory_bytes", "global_batch", "micro_batch", "accumulation"):
            check_int(f"plan.{name}", getattr(self, name), 1)
        for name in ("prefetch_depth", "pool_budget_bytes", "predicted_peak_bytes",
                     "predicted_allgather_bytes_per_step"):
            check_int(f"plan.{name}", getattr(self, name))
        check_num("plan.predicted_step_time_s", self.predicted_step_time_s)
        check_num("plan.planning_seconds", self.planning_seconds)
        check_str("plan.profile_source", self.profile_source)
        check_num("plan.host_fraction", self.host_fraction)
        if self.host_fraction > 1:
            raise ProfileError(f"plan.host_fraction must be in [0, 1], got {self.host_fraction}")
        check_bool("plan.offload_activations", self.offload_activations)
        check_int("plan.predicted_h2d_bytes_per_step", self.predicted_h2d_bytes_per_step)
        check_int("plan.num_adapters", self.num_adapters, 1)
        if self.weight_format is not None and not isinstance(self.weight_format, WeightFormat):
            raise ProfileError(f"plan.weight_format must be a WeightFormat or None, got "
                               f"{type(self.weight_format).__name__}")
        if self.micro_batch * self.accumulation * self.world_size != self.global_batch:
            raise ProfileError(
                f"plan: micro_batch x accumulation x world_size ({self.micro_batch} x {self.accumulation} x "
                f"{self.world_size}) != global_batch ({self.global_batch})"
            )
        if not isinstance(self.layers, tuple) or not self.layers:
            raise ProfileError("plan.layers must be a non-empty tuple of LayerPlan")
        names = set()
        for i, layer in enumerate(self.layers):
            if not isinstance(layer, LayerPlan):
                raise ProfileError(f"plan.layers[{i}] must be a LayerPlan, got {type(layer).__name__}")
            if layer.name in names:
                raise ProfileError(f"plan.layers[{i}].name: duplicate layer name {layer.name!r}")
            names.add(layer.name)
            for j, w in enumerate(layer.weights):
                where = f"plan.layers[{i}] ({layer.name}).weights[{j}] ({w.name})"
                if not 0 <= w.persist_chunks <= w.keep_chunks <= w.chunks:
                    raise ProfileError(f"{where}: need 0 <= persist_chunks ({w.persist_chunks}) <= keep_chunks "
                                       f"({w.keep_chunks}) <= chunks ({w.chunks})")

    # -------------------------------------------------------- views

    @property
    def kept_chunks(self) -> int:
        return sum(w.keep_chunks for layer in self.layers for w in layer.weights)

    @property
    def total_chunks(self) -> int:
        return sum(w.chunks for layer in self.layers for w in layer.weights)

    def choices(self) -> Choices:
        """The plan in the form the memory and cost models evaluate."""
        return Choices(
            micro_batch=self.micro_batch,
            keep=tuple(tuple(w.keep_chunks for w in layer.weights) for layer in self.layers),
            persist=tuple(tuple(w.persist_chunks for w in layer.weights) for layer in self.layers),
            recompute=tuple(layer.recompute for layer in self.layers),
            prefetch_depth=self.prefetch_depth,
            host_fraction=self.host_fraction,
            offload=self.offload_activations,
            num_adapters=self.num_adapters,
        )

    def check_profile(self, profile: Profile) -> None:
        """Raise unless the plan was made for `profile`'s units, weights and chunk counts."""
        if profile.world_size != self.world_size:
            raise ProfileError(f"plan is for world_size {self.world_size}, the profile has {profile.world_size}")
        if profile.weight_format != self.weight_format:
            raise ProfileError(f"plan is for weights stored {format_name(self.weight_format)}, the profile's are "
                               f"{format_name(profile.weight_format)}: plan from this profile")
        if len(profile.layers) != len(self.layers):
            raise ProfileError(f"plan has {len(self.layers)} layers, the profile {len(profile.layers)}")
        for lp, layer in zip(self.layers, profile.layers):
            ours = [(w.name, w.chunks) for w in lp.weights]
            theirs = [(w.name, w.chunks) for w in layer.weights]
            if lp.name != layer.name or ours != theirs:
                raise ProfileError(f"plan layer {lp.name} {ours} differs from profile layer {layer.name} {theirs}")

    def table(self) -> str:
        """A readable table: a header with the split, budget and predictions; per layer the
        kept and persistent chunks (and %) and whether it is recomputed."""
        gib = float(1 << 30)
        recomputed = sum(layer.recompute for layer in self.layers)
        lines = [
            f"plan for {self.world_size} rank(s), profile {self.profile_source}, weights "
            f"{format_name(self.weight_format)}",
            f"  global batch {self.global_batch} = micro-batch {self.micro_batch} x accumulation "
            f"{self.accumulation} x {self.world_size} rank(s); prefetch depth {self.prefetch_depth}"
            + (f"; {self.num_adapters} adapters, micro-batch {self.micro_batch} sequences each"
               if self.num_adapters > 1 else ""),
            f"  memory {self.memory_bytes / gib:.2f} GiB per rank; pool budget {self.pool_budget_bytes / gib:.2f} GiB "
            f"(+ working set)",
            f"  predicted: peak {self.predicted_peak_bytes / gib:.2f} GiB, step {self.predicted_step_time_s:.4g} s, "
            f"all-gather {self.predicted_allgather_bytes_per_step / gib:.2f} GiB/step per rank, "
            f"H2D {self.predicted_h2d_bytes_per_step / gib:.2f} GiB/step per rank",
            f"  host tier: {100.0 * self.host_fraction:.0f}% of missing chunks from the host store, activation "
            f"offload {'on' if self.offload_activations else 'off'}",
            f"  kept {self.kept_chunks}/{self.total_chunks} chunks "
            f"({100.0 * self.kept_chunks / max(1, self.total_chunks):.1f}%), {recomputed} layer(s) recomputed; "
            f"planned in {self.planning_seconds:.3f} s",
            "",
        ]
        rows = [("layer", "kept", "kept %", "persistent", "persist %", "recompute")]
        for layer in self.layers:
            n = sum(w.chunks for w in layer.weights)
            k = sum(w.keep_chunks for w in layer.weights)
            p = sum(w.persist_chunks for w in layer.weights)
            rows.append((layer.name, f"{k}/{n}", f"{100.0 * k / n:.1f}", f"{p}/{n}", f"{100.0 * p / n:.1f}",
                         "yes" if layer.recompute else "no"))
        widths = [max(len(r[c]) for r in rows) for c in range(len(rows[0]))]
        for r in rows:
            lines.append("  ".join(r[0].ljust(widths[0]) if c == 0 else r[c].rjust(widths[c])
                                   for c in range(len(r))))
        return "\n".join(lines)

    # -------------------------------------------------------- JSON

    def to_dict(self) -> dict:
        out = {k: getattr(self, k) for k in _PLAN_FIELDS if k != "layers"}
        out.update({k: getattr(self, k) for k in _PLAN_HOST_FIELDS})
        out[_PLAN_FORMAT_FIELD] = None if self.weight_format is None else self.weight_format.to_dict()
        out.update({k: getattr(self, k) for k, default in _PLAN_ADAPTER_FIELDS.items()
                    if getattr(self, k) != default})
        out["layers"] = [
            {"name": layer.name, "recompute": layer.recompute,
             "weights": [{"name": w.name, "keep_chunks": w.keep_chunks, "persist_chunks": w.persist_chunks,
                          "chunks": w.chunks} for w in layer.weights]}
            for layer in self.layers
        ]
        return out

    def to_json(self, indent: int | None = 1) -> str:
        return json.dumps(self.to_dict(), indent=indent)

    @classmethod
    def from_dict(cls, d) -> Plan:
        """The plan of a document: one `to_dict` wrote, or the CLI's plan.json (whose run
        record, adaptations and profile_seconds, is checked and left out)."""
        check_keys("plan", d, _PLAN_FIELDS, tuple(_PLAN_HOST_FIELDS) + (_PLAN_FORMAT_FIELD,) + _PLAN_RUN_FIELDS
                   + tuple(_PLAN_ADAPTER_FIELDS))
        if "adaptations" in d and not (isinstance(d["adaptations"], list)
                                       and all(isinstance(e, dict) for e in d["adaptations"])):
            raise ProfileError(f"plan.adaptations must be a list of objects, got {d['adaptations']!r:.80}")
        if "profile_seconds" in d:
            check_num("plan.profile_seconds", d["profile_seconds"])
        if not isinstance(d["layers"], list):
            raise ProfileError(f"plan.layers must be a list, got {type(d['layers']).__name__}")
        layers = []
        for i, x in enumerate(d["layers"]):
            where = f"plan.layers[{i}]"
            check_keys(where, x, ("name", "recompute", "weights"))
            if not isinstance(x["weights"], list) or not x["weights"]:
                raise ProfileError(f"{where}.weights must be a non-empty list")
            weights = []
            for j, w in enumerate(x["weights"]):
                ww = f"{where}.weights[{j}]"
                check_keys(ww, w, ("name", "keep_chunks", "persist_chunks", "chunks"))
                weights.append(WeightPlan(check_str(f"{ww}.name", w["name"]),
                                          check_int(f"{ww}.keep_chunks", w["keep_chunks"]),
                                          check_int(f"{ww}.persist_chunks", w["persist_chunks"]),
                                          check_int(f"{ww}.chunks", w["chunks"], 1)))
            layers.append(LayerPlan(check_str(f"{where}.name", x["name"]),
                                    check_bool(f"{where}.recompute", x["recompute"]), tuple(weights)))
        kwargs = {k: d[k] for k in _PLAN_FIELDS if k != "layers"}
        kwargs.update({k: d.get(k, default) for k, default in _PLAN_HOST_FIELDS.items()})
        kwargs.update({k: d.get(k, default) for k, default in _PLAN_ADAPTER_FIELDS.items()})
        fmt = d.get(_PLAN_FORMAT_FIELD)
        kwargs[_PLAN_FORMAT_FIELD] = None if fmt is None else WeightFormat.from_dict("plan.weight_format", fmt)
        return cls(layers=tuple(layers), **kwargs)

    @classmethod
    def from_json(cls, text: str) -> Plan:
        try:
            d = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ProfileError(f"plan: not valid JSON ({exc})") from None
        return cls.from_dict(d)

    def save(self, path: str) -> None:
        with open(path, "w") as f:
            f.write(self.to_json())
            f.write("\n")

    @classmethod
    def load(cls, path: str) -> Plan:
        with open(path) as f:
            return cls.from_json(f.read())


def format_name(fmt: WeightFormat | None) -> str:
    return "unquantized" if fmt is None else fmt.describe()


def plan_of(profile: Profile, choices: Choices, *, memory_bytes: int, global_batch: int,
            planning_seconds: float = 0.0) -> Plan:
    """A `Plan` for `choices`, with the exact models' predictions."""
    per_rank = global_batch // profile.world_size
    accumulation = per_rank // choices.micro_batch
    if accumulation * choices.micro_batch * profile.world_size != global_batch:
        raise PlanningError(f"micro-batch {choices.micro_batch} x {profile.world_size} rank(s) does not divide "
                            f"global_batch {global_batch}")
    layers = tuple(
        LayerPlan(layer.name, bool(choices.recompute[i]), tuple(
            WeightPlan(w.name, choices.keep[i][j], choices.persist[i][j], w.chunks)
            for j, w in enumerate(layer.weights)))
        for i, layer in enumerate(profile.layers)
    )
    return Plan(
        world_size=profile.world_size,
        memory_bytes=int(memory_bytes),
        global_batch=global_batch,
        micro_batch=choices.micro_batch,
        accumulation=accumulation,
        prefetch_depth=choices.prefetch_depth,
        pool_budget_bytes=pool_budget_bytes(profile, choices),
        layers=layers,
        predicted_peak_bytes=memory_curve(profile, choices).peak_bytes,
        predicted_allgather_bytes_per_step=allgather_bytes_per_step(profile, choices, accumulation),
        predicted_step_time_s=step_cost(profile, choices, accumulation).step_s,
        planning_seconds=float(planning_seconds),
        profile_source=profile.source,
        host_fraction=effective_host_fraction(profile, choices.host_fraction) if profile.host_store else 0.0,
        offload_activations=bool(choices.offload),
        predicted_h2d_bytes_per_step=h2d_bytes_per_step(profile, choices, accumulation),
        weight_format=profile.weight_format,  # the user's choice, as profiled: never the planner's
        num_adapters=choices.num_adapters,
    )


