"""The bounded residency rounds of measure_profile (measure.py, [Note: profiling within a memory
bound]): which units one round makes resident under the bound, and the memory model's peak of
a residency."""

from __future__ import annotations

from ..planner.memory import Choices, memory_curve
from ..planner.profile import LayerProfile, Profile


def _group_key(layer: LayerProfile) -> tuple:
    """What a unit's compute time is a function of, as far as the profile can tell."""
    return (layer.recomputable, layer.act_bytes_per_token, layer.input_bytes_per_token,
            tuple((w.chunks, w.chunk_bytes, w.slice_bytes, w.backward, w.last_chunk_bytes) for w in layer.weights))


def _choose_round(profile: Profile, limit: int, micro_batch: int, untimed: list[int]) -> list[int]:
    """Units to keep resident in one profiling round ([Note: profiling within a memory bound]):
    a unit of every group with a unit in `untimed` first, then the others, in forward order,
    while the memory model of that residency stays within `limit`."""
    groups: dict = {}
    for i in untimed:
        groups.setdefault(_group_key(profile.layers[i]), []).append(i)
    first = [members[0] for members in groups.values()]
    order = first + [i for i in range(len(profile.layers)) if i not in first]
    chosen: list[int] = []
    for i in order:
        trial = sorted(chosen + [i])
        if _residency_peak(profile, trial, micro_batch) <= limit:
            chosen = trial
    return chosen


def _residency_peak(profile: Profile, resident: list[int], micro_batch: int, recompute: bool = False) -> int:
    """The memory model's peak of a profiling step: units `resident` keep every chunk, the
    rest none, prefetch depth 0, no offload."""
    keep = tuple(tuple(w.chunks if i in resident else 0 for w in layer.weights)
                 for i, layer in enumerate(profile.layers))
    rec = tuple(layer.recomputable and recompute for layer in profile.layers)
    return memory_curve(profile, Choices(micro_batch, keep, keep, rec, prefetch_depth=0)).peak_bytes
