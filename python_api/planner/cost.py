"""The cost model: all-gather bytes and predicted time of one optimizer step.

[Note: exact all-gather traffic]
Per micro-batch in steady state a rank receives (world_size - 1) x slice_bytes for each chunk
it gathers ([Note: the timeline of an iteration] in memory.py says which). Summed over the
uses, for a weight with n chunks, keep k, persist p, in a layer recomputed (r = 1) or not:
    backward use:     (W - 1) x slice_bytes x [(n - p) + (n - k) x (1 + r)]
    no backward use:  (W - 1) x slice_bytes x (n - p) x (1 + r)
and an optimizer step is `accumulation` micro-batches. World size 1 gathers nothing. The
formula is integer arithmetic and is what the runtime's `allgather_bytes` counter measures
when the pool never evicts a kept chunk (the plan's budget guarantees it).

[Note: the time model]
With T = micro_batch x seq_len tokens, each use u costs compute c(u):
    forward, recompute   fwd_s_fixed + fwd_s_per_token x T   (a recompute is the forward again)
    backward             bwd_s_fixed + bwd_s_per_token x T
Its all-gather takes g(u) = latency_s + received_bytes / bytes_per_s (0 when nothing is
missing). The runtime issues the gathers of a use when the `prefetch_depth` uses before it in
the same phase start ([Note: learned order and prefetch]; nothing is prefetched across the
forward/backward boundary), so the part of g(u) not hidden is
    exposed(u) = max(0, g(u) - sum of c(v) over the prefetch_depth uses before u in its phase)
(the first use of each phase hides nothing). Then
    step = accumulation x (sum_u c(u) + sum_u exposed(u) + outside compute) + allreduce
where the recompute's c(u) is the recompute cost, outside compute is
(outside fwd + bwd per token) x T, and allreduce = latency_s + adapter_grad_bytes /
bytes_per_s, once per optimizer step ([Note: gradient accumulation]; none at world size 1).
The model assumes a gather's window is its own: gathers that queue behind each other on the
link are not serialised. It is an estimate, checked against measured step times elsewhere.

[Note: chunk sources and the host link]
With a host fraction f (`Choices.host_fraction`; 1 in effect with weights_on="host", 0 at
world size 1 with the weights on the device) the missing chunks of a use split, per weight,
by the runtime's own rule ([Note: chunk sources] in python_api/host/sources.py): chunk c is a
host chunk iff int((c + 1) f) > int(c f). The missing chunks are the last ones (kept chunks
are the first), so a use missing m of n chunks has host_chunk_count(n, n - m, f) =
int(n f) - int((n - m) f) host chunks (memory.py, integer-exact, the runtime's float
products). Peer chunks are all-gathered as above; a host chunk moves its real bytes
(chunk_bytes, or last_chunk_bytes for the ragged last one) over the h2d link. Both are in
flight together, so a use's communication takes max(g(peer bytes), h(host bytes)), h the h2d
link's latency + bytes / bandwidth, and is exposed beyond the prefetch window as above.
Activation offload (memory.offload_served says which bytes move) adds, per layer that moves
M bytes, a D2H copy after its forward, exposed beyond the compute of the next forward use,
and an H2D copy one layer ahead of its backward, exposed beyond the compute of the
backward-phase use just before its backward: max(0, h(M) - that compute) each (the same
link both ways; contention with the weights' H2D copies is not modelled). Exact bytes per
micro-batch: all-gather = sum of the uses' received bytes; H2D = the uses' host-chunk bytes
+ the activations moved (each comes back once), what the runtime's `h2d_bytes` counts
(tests/planner/test_plan_host.py).
"""

from __future__ import annotations

from dataclasses import dataclass

from python_api.planner.memory import FORWARD, RECOMPUTE, Choices, Use, offload_served, timeline
from python_api.planner.profile import Profile


def allgather_bytes_per_micro_batch(profile: Profile, choices: Choices) -> int:
    """Bytes one rank receives in all-gathers per micro-batch ([Note: exact all-gather traffic])."""
    choices.check(profile)
    W = profile.world_size
    if W == 1:
        return 0
    if choices.host_fraction <= 0 and profile.weights_on == "device":
        total = 0
        for i, layer in enumerate(profile.layers):
            r = 1 if choices.recompute[i] else 0
            for w, k, p in zip(layer.weights, choices.keep[i], choices.persist[i]):
                n = w.chunks
                chunks = (n - p) + (n - k) * (1 + r) if w.backward else (n - p) * (1 + r)
                total += (W - 1) * w.slice_bytes * chunks
        return total
    forward, backward = timeline(profile, choices)  # [Note: chunk sources and the host link]
    return sum(u.received_bytes for u in forward + backward)


def h2d_bytes_per_micro_batch(profile: Profile, choices: Choices) -> int:
    """Host -> device bytes per micro-batch: host chunks copied into pages plus activations
    brought back ([Note: chunk sources and the host link])."""
    forward, backward = timeline(profile, choices)
    weights = sum(u.h2d_bytes for u in forward + backward)
    off = offload_served(profile, choices.micro_batch * profile.seq_len, choices.recompute, choices.offload)
    return weights + sum(off.moved)


def h2d_bytes_per_step(profile: Profile, choices: Choices, accumulation: int) -> int:
    """Host -> device bytes per optimizer step, steady state (weights and activations)."""
    return accumulation * h2d_bytes_per_micro_batch(profile, choices)


def offload_exposed_s(profile: Profile, tokens: int, recompute, offload: bool, served=None) -> float:
    """Exposed time of the activation copies of one micro-batch ([Note: chunk sources and the
    host link]): per moving layer, its D2H beyond the next forward use's compute and its H2D
    beyond the compute of the backward-phase use before its backward."""
    if not offload or profile.h2d is None:
        return 0.0
    off = served if served is not None else offload_served(profile, tokens, recompute, offload)
    if not any(off.moved):
        return 0.0
    layers = profile.layers
    L = len(layers)
    fc = [layer.fwd_s(tokens) for layer in layers]
    # The backward-phase use just before layer i's backward: its own recompute, else the
    # backward of layer i + 1 (none for the last layer).
    total = 0.0
    for i, m in enumerate(off.moved):
        if not m:
            continue
        t = profile.h2d.time(m)
        after = fc[i + 1] if i + 1 < L else (profile.outside.fwd_s_per_token * tokens)
        before_bwd = fc[i] if recompute[i] else (layers[i + 1].bwd_s(tokens) if i + 1 < L else 0.0)
        total += max(0.0, t - after) + max(0.0, t - before_bwd)
    return total


def allgather_bytes_per_step(profile: Profile, choices: Choices, accumulation: int) -> int:
    """Bytes one rank receives in all-gathers per optimizer step, steady state."""
    return accumulation * allgather_bytes_per_micro_batch(profile, choices)


def use_compute_s(profile: Profile, u: Use, tokens: int) -> float:
    layer = profile.layers[u.layer]
    return layer.fwd_s(tokens) if u.kind in (FORWARD, RECOMPUTE) else layer.bwd_s(tokens)


def exposed_s(profile: Profile, uses: list[Use], compute: list[float], prefetch_depth: int) -> list[float]:
    """Exposed communication of each use of one phase ([Note: the time model]; both sources
    in flight together: [Note: chunk sources and the host link])."""
    out = []
    for j, u in enumerate(uses):
        window = sum(compute[max(0, j - prefetch_depth) : j])
        comm = profile.allgather.time(u.received_bytes)
        if u.h2d_bytes:
            comm = max(comm, profile.h2d.time(u.h2d_bytes))
        out.append(max(0.0, comm - window))
    return out


@dataclass(frozen=True)
class StepCost:
    """Predicted time of one optimizer step and its parts (seconds)."""

    compute_s: float  # forward + backward of the units and the outside, all micro-batches
    recompute_s: float  # the recomputes' forward again, all micro-batches
    exposed_comm_s: float  # all-gather time not hidden behind compute, all micro-batches
    allreduce_s: float  # the adapter-gradient all-reduce, once
    step_s: float
    exposed_per_use: tuple[tuple[str, float], ...]  # (use label, seconds) for one micro-batch


def step_cost(profile: Profile, choices: Choices, accumulation: int) -> StepCost:
    """The time model ([Note: the time model])."""
    if not isinstance(accumulation, int) or accumulation < 1:
        raise ValueError(f"accumulation must be an int >= 1, got {accumulation!r}")
    forward, backward = timeline(profile, choices)
    T = choices.micro_batch * profile.seq_len
    compute = recompute = exposed = 0.0
    per_use = []
    for uses in (forward, backward):
        c = [use_compute_s(profile, u, T) for u in uses]
        e = exposed_s(profile, uses, c, choices.prefetch_depth)
        for u, cu, eu in zip(uses, c, e):
            if u.kind == RECOMPUTE:
                recompute += cu
            else:
                compute += cu
            exposed += eu
            per_use.append((f"{u.kind} {profile.layers[u.layer].name}", eu))
    compute += (profile.outside.fwd_s_per_token + profile.outside.bwd_s_per_token) * T
    act = offload_exposed_s(profile, T, choices.recompute, choices.offload)
    if act:
        exposed += act
        per_use.append(("activation offload", act))
    allreduce = profile.allreduce.time(profile.adapter_grad_bytes) if profile.world_size > 1 else 0.0
    step = accumulation * (compute + exposed + recompute) + allreduce
    return StepCost(accumulation * compute, accumulation * recompute, accumulation * exposed, allreduce, step,
                    tuple(per_use))


def step_time_s(profile: Profile, choices: Choices, accumulation: int) -> float:
    return step_cost(profile, choices, accumulation).step_s
