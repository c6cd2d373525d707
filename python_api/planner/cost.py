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
One micro-batch is the forward uses of the units, the outside compute (embeddings, head,
loss: (outside fwd + bwd per token) x T), then the backward-phase uses ([Note: the timeline of
an iteration]), with T = micro_batch x seq_len tokens (times num_adapters: [Note: several
adapters in the models] in memory.py). Each use u has compute c(u)
    forward, recompute   fwd_s_fixed + fwd_s_per_token x T + dequant_fwd_s   (a recompute is the forward again)
    backward             bwd_s_fixed + bwd_s_per_token x T + dequant_bwd_s
(the dequant terms: quantized weights only, [Note: dequantization in the time model])
and what it misses arrives over two links, each a FIFO queue served in the order the runtime
issues to it:
  - the communication stream (NCCL; the gloo worker on CPU): every all-gather of the rank,
    with its pack and unpack copies, which run on that stream too: g(u) =
    gather_link.time(received bytes) (Profile.gather_link: latency + received / all-gather
    rate + (W + 1) x slice bytes / copy rate);
  - the host -> device link (one PCIe link per GPU): the host chunks' copies h(u) =
    h2d.time(host bytes) AND the activation copy-backs ([Note: activation copies in the time
    model]), in issue order.
The runtime issues a use's gathers and copies when the use `prefetch_depth` uses before it in
the same phase is entered (the first use of a phase issues its own and the next
prefetch_depth; nothing crosses the forward/backward boundary: [Note: learned order and
prefetch] in python_api/runtime/_order.py). So, in program order, with `entry` the time the
previous use's compute ended:
    at entry(j): issue use j + prefetch_depth (and, at the phase's first use, uses 0..d):
        comm_end(k) = max(entry(j), comm_end of the previous gather) + g(k)    (g(k) > 0)
        host_end(k) = max(entry(j), the link's previous end) + h(k)            (h(k) > 0)
    compute of j starts at max(entry(j), comm_end(j), host_end(j)) and takes c(j) (plus any
    wait for an activation copy-back inside it); exposed(j) = its start - entry(j) + those waits.
    step = accumulation x (time of one micro-batch) + allreduce
with allreduce = latency_s + adapter_grad_bytes / bytes_per_s once per optimizer step
([Note: gradient accumulation]; none at world size 1). With prefetch_depth 1 and no host link
this is exactly the independent-window model of before, exposed(j) = max(0, g(j) - c(j-1)):
gather j is issued when use j-1 is entered and the link frees when use j-1's own gather ends,
which is when j-1's compute starts. With a deeper window the gathers queue: gather j + 2 waits
for gather j + 1 on the one stream, so it does not get two uses' compute to itself (the model
before this gave it both, and chose depth 2 where it is slower: issue 17).
Every time is a max-plus expression of the inputs in a fixed program order, so fewer missing
bytes never make a step slower (the planner's monotonicity rests on it), and dropping the
host link or the activation copies gives a lower bound ([Note: the search] in search.py).
Granularity: a unit's compute waits for its whole gather (the runtime starts a weight as soon
as its own chunks arrived, so the model is an upper bound there); one latency per use and
link (the runtime issues one collective per 32 MiB per rank and one copy per host chunk; the
measured links are fitted on the same shapes, python_api/planning/measure.py).

[Note: dequantization in the time model]
A use of a quantized weight dequantizes its chunks into the compute dtype right before its
GEMMs (python_api/quant/workspace.py), on the compute stream: it is compute, which no link
hides, and it happens at every use whatever the residency (a kept chunk stays quantized in its
page; the dequantized copy lives for one use). So a use's compute is its unit's plus the
dequantization: a forward or recompute use dequantizes every weight of the unit
(LayerProfile.dequant_fwd_s), a backward use the weights with a backward use (dequant_bwd_s:
dgrad reads W again, in the same dtype). Per weight, `dequant_s` is one use's dequantization
of all its chunks (one call for a LoRA linear; one per chunk for a plain ElasticLinear, which
computes chunk by chunk). What changes it with the plan is the number of uses, never the
residency: a recomputed layer dequantizes once more, and each of the accumulation x micro-
batches dequantizes once, so a larger micro-batch amortizes it over more tokens. Longer
compute can hide more of a gather, so the step grows by at most the dequant of its uses
(exactly that when nothing is exposed), and fewer missing bytes still never make it slower.
Not counted twice: a measured profile times each unit with its dequantization inside (the
unit's hooks enclose it) and, apart, the dequant op itself on the weight's shapes and dtype
(python_api/planning/measure.py), and stores the unit's times net of it (taken off the fixed
part; any rest off the per-token part, so the time at the profiled micro-batch is unchanged);
the model adds it back per use. At the profiled micro-batch a plan's compute is thus what was
measured; the explicit term makes the per-use part right at other micro-batches and
recompute counts (instead of leaving it to the two-point fit), and lets a synthetic profile
(shapes.py: the device's dequant rate) or a hand-written one state it. A profile without a
weight format has no dequant term (older measured ones hold any dequant in their layer times).

[Note: chunk sources and the host link]
With a host fraction f (`Choices.host_fraction`; 1 in effect with weights_on="host", 0 at
world size 1 with the weights on the device) the missing chunks of a use split, per weight,
by the runtime's own rule ([Note: chunk sources] in python_api/host/sources.py): chunk c is a
host chunk iff int((c + 1) f) > int(c f). The missing chunks are the last ones (kept chunks
are the first), so a use missing m of n chunks has host_chunk_count(n, n - m, f) =
int(n f) - int((n - m) f) host chunks (memory.py, integer-exact, the runtime's float
products). Peer chunks are all-gathered as above; a host chunk moves its real bytes
(chunk_bytes, or last_chunk_bytes for the ragged last one) over the h2d link. Exact bytes per
micro-batch: all-gather = sum of the uses' received bytes; H2D = the uses' host-chunk bytes +
the activations moved (each comes back once), what the runtime's `h2d_bytes` counts
(tests/planner/test_plan_host.py).

[Note: activation copies in the time model]
The activation offload (python_api/host/offload.py; which tensors it serves:
memory.offload_served) works per LoRA linear: each linear's forward copies its activations to
host buffers (D2H, on the offloader's copy stream, right after that linear's forward), and the
backward of a linear first issues its own copy-back if nobody did and then the copy-back of
the linear that offloaded just before it in forward order, and waits for its own. So a
linear's copy-back is issued when the backward of the next offloading linear (in forward
order) begins: one LoRA linear ahead, not one decoder layer. Within a layer the model places
each linear in the layer's compute at a share proportional to its weight's bytes (the GEMMs'
FLOPs; forward in the layers' weight order, which is the forward order; backward in reverse,
and only weights with a backward use take backward time), a linear's D2H issued at the end of
its forward share and its restore at the start of its backward share. The offloader's stream
is one FIFO for both directions (a copy-back waits for every earlier D2H); D2H has the PCIe
link's device->host direction to itself; copy-backs share the host->device direction with the
host chunks' copies (the FIFO above). Each tensor is one copy: h2d.time(its bytes) both ways.
The first linear restored in backward (the last that offloaded) has no window; a layer whose
down_proj input is the largest tensor gets only the window of the next layer's q_proj share.
On CPU the offloader's and the host store's copies are synchronous memcpys (the runtime's
CPU path, for tests); the model times them as the GPU's asynchronous copies.
"""

from __future__ import annotations

from dataclasses import dataclass

from .memory import FORWARD, RECOMPUTE, Choices, Use, is_segment, offload_served, rows_per_micro_batch, timeline
from .profile import Profile


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
    off = offload_served(profile, rows_per_micro_batch(profile, choices), choices.recompute, choices.offload)
    return weights + sum(off.moved)


def h2d_bytes_per_step(profile: Profile, choices: Choices, accumulation: int) -> int:
    """Host -> device bytes per optimizer step, steady state (weights and activations)."""
    return accumulation * h2d_bytes_per_micro_batch(profile, choices)


def allgather_bytes_per_step(profile: Profile, choices: Choices, accumulation: int) -> int:
    """Bytes one rank receives in all-gathers per optimizer step, steady state."""
    return accumulation * allgather_bytes_per_micro_batch(profile, choices)


def use_compute_s(profile: Profile, u: Use, tokens: int) -> float:
    """The use's compute, its dequantization included ([Note: dequantization in the time model])."""
    layer = profile.layers[u.layer]
    return layer.fwd_s(tokens) if u.kind in (FORWARD, RECOMPUTE) else layer.bwd_s(tokens)


def use_dequant_s(profile: Profile, u: Use) -> float:
    """The part of the use's compute that dequantizes its weights."""
    layer = profile.layers[u.layer]
    return layer.dequant_fwd_s if u.kind in (FORWARD, RECOMPUTE) else layer.dequant_bwd_s


# ---------------------------------------------------------------- the simulation


class ActivationEvents:
    """The activation copies of one micro-batch, placed in the layers' compute ([Note:
    activation copies in the time model]): `forward[i]` is, for layer i's forward use, a
    tuple of (duration, D2H seconds issued at the piece's end; 0.0: none) pieces, one per
    weight in forward order; `backward[i]` is (lead, pieces) for its backward use, pieces
    (duration, index of the offloading linear restored at the piece's start; -1: none) per
    weight in reverse order, the first `lead` of them restored before the use issues its
    gathers (a linear restores before it calls the runtime's use, and the first weight with a
    backward use is the one that issues); `copy_back[l]` is the H2D time of offloading linear
    l (numbered in forward order). Layers without copies have no entry (one piece)."""

    __slots__ = ("forward", "backward", "copy_back")

    def __init__(self, forward: dict, backward: dict, copy_back: list):
        self.forward, self.backward, self.copy_back = forward, backward, copy_back


def _shares(profile: Profile, i: int) -> tuple[list[float], list[float]]:
    """Layer i's per-weight fractions of its forward and of its backward compute."""
    layer = profile.layers[i]
    size = [float(w.host_bytes(w.chunks, True)) for w in layer.weights]
    total = sum(size) or 1.0
    fwd = [b / total for b in size]
    bsize = [b if w.backward else 0.0 for b, w in zip(size, layer.weights)]
    btotal = sum(bsize)
    bwd = [b / btotal for b in bsize] if btotal else [1.0 / len(size)] * len(size)
    return fwd, bwd


def activation_events(profile: Profile, tokens: int, recompute, offload: bool, served=None) -> ActivationEvents | None:
    """The activation copies of one micro-batch ([Note: activation copies in the time model]);
    None when nothing moves."""
    if not offload or profile.h2d is None:
        return None
    off = served if served is not None else offload_served(profile, tokens, recompute, offload)
    if not any(off.moved):
        return None
    h2d = profile.h2d
    forward, backward, copy_back = {}, {}, []
    for i, tensors in enumerate(off.served):
        if not tensors:
            continue
        layer = profile.layers[i]
        fshare, bshare = _shares(profile, i)
        per_weight = [0.0] * len(layer.weights)
        for owner, nbytes in tensors:
            per_weight[owner] += h2d.time(nbytes)
        cf, cb = layer.fwd_s(tokens), layer.bwd_s(tokens)
        forward[i] = tuple((cf * fs, t) for fs, t in zip(fshare, per_weight))
        ids = [-1] * len(layer.weights)
        for j, t in enumerate(per_weight):
            if t > 0.0:
                ids[j] = len(copy_back)
                copy_back.append(t)
        order = list(reversed(range(len(layer.weights))))
        lead = next((k + 1 for k, j in enumerate(order) if layer.weights[j].backward), len(order))
        backward[i] = (lead, tuple((cb * bshare[j], ids[j]) for j in order))
    return ActivationEvents(forward, backward, copy_back)


def simulate_micro_batch(fwd: list, bwd: list, depth: int, outside_s: float,
                         act: ActivationEvents | None = None) -> tuple[float, list[float], list[float]]:
    """One micro-batch under [Note: the time model]: `fwd` and `bwd` are the phases' uses in
    execution order, each (layer, compute s, gather s, host copy s, is the layer's backward
    use, is a segment: memory.is_segment); returns (seconds, exposed per forward use, exposed
    per backward-phase use). The issue rule counts segments: a use that is none issues
    nothing and misses nothing."""
    t = 0.0
    comm = link = stream = 0.0  # when the comm stream, the H2D link and the offloader's stream free up
    fwaits, bwaits = [], []
    issued_back: list[float | None] = [None] * len(act.copy_back) if act is not None else []

    def copy_back(lin: int, at: float) -> None:
        nonlocal link, stream
        end = max(at, stream, link) + act.copy_back[lin]
        issued_back[lin] = end
        stream = link = end

    def restore(lin: int, at: float) -> None:
        """A linear's backward restores: its own copy-back unless issued, then the previous one's."""
        if issued_back[lin] is None:
            copy_back(lin, at)
        if lin > 0 and issued_back[lin - 1] is None:
            copy_back(lin - 1, at)

    for phase, waits in ((fwd, fwaits), (bwd, bwaits)):
        segs = [j for j, row in enumerate(phase) if row[5]]
        n = len(segs)
        ready = [0.0] * len(phase)
        issued = 0  # segments issued so far
        p = 0  # segments entered so far
        for j in range(len(phase)):
            entry = t
            layer, c, _, _, is_bwd, seg = phase[j]
            pieces = lead = None
            at = entry  # when the use issues: after the waits of the restores before it
            if act is not None:
                if is_bwd:
                    hit = act.backward.get(layer)
                    if hit is not None:
                        lead, pieces = hit
                        for _, lin in pieces[:lead]:
                            if lin >= 0:
                                restore(lin, at)
                                if issued_back[lin] > at:
                                    at = issued_back[lin]
                elif phase is fwd:
                    pieces = act.forward.get(layer)
            if seg:
                p += 1
            top = min(n, p + depth) if seg else issued
            while issued < top:
                k = segs[issued]
                _, _, g, h, _, _ = phase[k]
                r = 0.0
                if g > 0.0:
                    comm = (at if at > comm else comm) + g
                    r = comm
                if h > 0.0:
                    link = (at if at > link else link) + h
                    if link > r:
                        r = link
                ready[k] = r
                issued += 1
            s = ready[j] if ready[j] > at else at
            if pieces is None:
                t = s + c
                waits.append(s - entry)
                continue
            wait = s - entry
            if lead is None:  # forward: each linear's D2H after its share
                for dur, d2h in pieces:
                    s += dur
                    if d2h > 0.0:
                        stream = (s if s > stream else stream) + d2h
            else:
                for k, (dur, lin) in enumerate(pieces):
                    if lin >= 0 and k >= lead:
                        restore(lin, s)
                        end = issued_back[lin]
                        if end > s:
                            wait += end - s
                            s = end
                    s += dur
            t = s
            waits.append(wait)
        if phase is fwd:
            t += outside_s
    return t, fwaits, bwaits


def phase_inputs(profile: Profile, choices: Choices):
    """The forward and backward-phase uses of one micro-batch as `simulate_micro_batch` reads
    them, from the memory model's timeline; and the timeline."""
    forward, backward = timeline(profile, choices)
    T = rows_per_micro_batch(profile, choices)
    gl, h2d = profile.gather_link(), profile.h2d

    def row(u: Use):
        return (u.layer, use_compute_s(profile, u, T), gl.time(u.received_bytes),
                h2d.time(u.h2d_bytes) if u.h2d_bytes else 0.0, u.kind not in (FORWARD, RECOMPUTE),
                is_segment(profile, u))
    return [row(u) for u in forward], [row(u) for u in backward], forward, backward


@dataclass(frozen=True)
class StepCost:
    """Predicted time of one optimizer step and its parts (seconds)."""

    compute_s: float  # forward + backward of the units and the outside, all micro-batches
    recompute_s: float  # the recomputes' forward again, all micro-batches
    exposed_comm_s: float  # time compute waits for gathers, host copies and copy-backs, all micro-batches
    allreduce_s: float  # the adapter-gradient all-reduce, once
    step_s: float
    exposed_per_use: tuple[tuple[str, float], ...]  # (use label, seconds) for one micro-batch
    dequant_s: float = 0.0  # of compute_s + recompute_s: dequantizing quantized weights, all uses and micro-batches


def step_cost(profile: Profile, choices: Choices, accumulation: int) -> StepCost:
    """The time model ([Note: the time model])."""
    if not isinstance(accumulation, int) or accumulation < 1:
        raise ValueError(f"accumulation must be an int >= 1, got {accumulation!r}")
    fwd, bwd, forward, backward = phase_inputs(profile, choices)
    T = rows_per_micro_batch(profile, choices)
    outside = (profile.outside.fwd_s_per_token + profile.outside.bwd_s_per_token) * T
    act = activation_events(profile, T, choices.recompute, choices.offload)
    total, fw, bw = simulate_micro_batch(fwd, bwd, choices.prefetch_depth, outside, act)
    compute = sum(r[1] for r in fwd) + sum(r[1] for r, u in zip(bwd, backward) if u.kind != RECOMPUTE) + outside
    recompute = sum(r[1] for r, u in zip(bwd, backward) if u.kind == RECOMPUTE)
    exposed = sum(fw) + sum(bw)
    per_use = tuple((f"{u.kind} {profile.layers[u.layer].name}", e)
                    for u, e in zip(forward + backward, fw + bw))
    # every adapter's gradients ([Note: several adapters in the models] in memory.py)
    allreduce = (profile.allreduce.time(choices.num_adapters * profile.adapter_grad_bytes)
                 if profile.world_size > 1 else 0.0)
    step = accumulation * total + allreduce
    dequant = sum(use_dequant_s(profile, u) for u in forward + backward)
    return StepCost(accumulation * compute, accumulation * recompute, accumulation * exposed, allreduce, step,
                    per_use, accumulation * dequant)


def step_time_s(profile: Profile, choices: Choices, accumulation: int) -> float:
    return step_cost(profile, choices, accumulation).step_s
