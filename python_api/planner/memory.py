"""The memory model: device bytes per rank at each point of a training iteration.

[Note: the timeline of an iteration]
An iteration of one micro-batch is a sequence of *uses* of the units (the profile's layers):
forward uses in layer order, then the backward phase in reverse layer order, where a
recomputed layer contributes two uses, its recompute (a forward run inside backward, by
non-reentrant activation checkpointing) followed by its backward ([Note: recompute inside
backward] in python_api/runtime/; the recompute and the backward of one layer are separate
segments of the learned order because a weight repeats, so each is prefetched like any use).
A use of weight w (n chunks, keep k, persist p, 0 <= p <= k <= n) misses, in steady state:
    forward     n - p     (only PERSISTENT chunks survive the previous iteration)
    recompute   n - k     (PEAK and PERSISTENT chunks were kept since forward)
    backward    n - k     (the recompute ends with keep=PEAK, so it leaves the same chunks)
A weight with no backward use (`backward: false`: its input needs no gradient) keeps nothing
after forward, so its recompute misses n - p and it has no backward use.
This holds when the pool never evicts a kept chunk, which the plan guarantees by its budget:
pool_budget_bytes = page_bytes x sum_w k_w (every kept chunk is alive at the end of forward),
the runtime adding the working set on top ([Note: pool budget and working set]).

[Note: what the memory model counts]
At each point (a use, and the end of forward), with T = micro_batch x seq_len tokens (times
num_adapters: [Note: several adapters in the models]):
    reserved + static                      constant (not ours; plan-independent per rank)
  + (num_adapters - 1) x 4 x adapter_grad_bytes   the other adapters' state (same Note)
  + runs: sum over the weights held as runs of (run_bytes - shard_bytes)   constant
  + pool                                   constant: min(all chunks, sum_w k_w + working set)
                                           pages, over the weights not held as runs. The
                                           PagePool adds segments lazily and gives
                                           none back, so after the first iteration it holds
                                           its high-water mark, which is reached at the end
                                           of forward, where every kept chunk is alive.
  + saved activations of the layers before this one in forward order:
        act_bytes_per_token x T, or input_bytes_per_token x T when recomputed
  + this layer's own activations: act x T (during its forward, its backward, or its
    rematerialisation inside backward; a recomputed layer also still holds its input then)
  + during a backward, the workspace of its gradients (outside.workspace_bytes_per_token x T,
    plus outside.recompute_workspace_bytes_per_token x T for a recomputed layer; both
    measured at profile time)
  + outside.act_bytes_per_token x T        (embeddings/head activations saved for backward)
  + buffers of the gathers in flight: (world_size + 1) x slice_bytes per missing chunk of
    the current use and of the `prefetch_depth` segments after it in the same phase (a
    backward use of a layer none of whose weights has a backward use is no segment: the
    runtime never calls `use` for it, `is_segment`; at such a point the next `prefetch_depth`
    segments are in flight) (the packed
    send buffer and the all-gather output, alive until the output is unpacked into pages),
    plus on CPU (gloo) world_size x slice_bytes more: gloo's all-gather fills a flat scratch
    tensor of the output's size and copies it into the output (measured on the demo model:
    tests/planner/test_memory_model.py; it counts for every gather in the window, an upper bound
    since the scratch lives only while its collective runs)
and at the end of forward: every saved activation + outside act + outside peak (logits and
loss). With the host tier, only the *peer* chunks of a use have gather buffers: a host chunk
is copied from the host store straight into its page ([Note: chunk sources] in
python_api/host/sources.py), so a use's buffers are (world_size + 1) x slice_bytes per missing
peer chunk (+ gloo's scratch). With weights_on="host" static_bytes holds no shard (the
profile measures static as it is). Everything is for ONE micro-batch: gradient accumulation keeps only adapter
gradients across micro-batches, and those are in `static_bytes`.
The peak is the maximum over the points.
A weight is held as a run ([Note: resident runs] in python_api/runtime/tensor.py) when its
profile has `run_bytes` (the runtime can hold it so), every chunk persists (p = n) and none
comes from the host store: the runtime's condition, whose last part (a cache budget that
holds every kept chunk in pages) a plan's budget always meets (`pool_budget_bytes`). Its
shard lives in the run (static_bytes counted it: its real bytes, `WeightProfile.shard_bytes`,
rank 0's, no padding since 2026-12-03 ([Note: chunk-major shard layout]); replaced by
run_bytes), and it has no page: neither among the kept chunks nor in the working set (the
runtime's `_working_set_pages` counts the weights held in pages only). It misses nothing, as
any weight with p = n. Until 2026-12-03 the model counted shard + n pages for it, and
over-predicted plans that keep weights whole (+15.3% on the demo model's "keep half").

[Note: several adapters in the models]
A job may train K adapters on one base at once (issue 29: `Choices.num_adapters`, default 1,
with which every result is what it was). The profile describes ONE adapter: a measured one is
taken from a one-adapter job, a synthetic one has one adapter per projection, so its
`static_bytes` holds one adapter's parameters, gradients and AdamW moments (4 x
adapter_grad_bytes: value, gradient and two moments of the parameter's size, what
python_api/planning/measure.py and shapes.py count) and `adapter_grad_bytes` one adapter's
gradients. With K adapters, each adapter gets `micro_batch` sequences per micro-batch (a sweep
gives every adapter the same batch; a mixed micro-batch is cut the same way), and the base
product runs once over the rows of all of them ([Note: segmented LoRA kernel] in
elastic_kernels/ops/segmented_lora.py), so:
  - rows: T = K x micro_batch x seq_len. Everything the models scale by the tokens of a
    micro-batch scales with it: saved activations, the layer's own, the backward workspaces,
    the outside activations and the logits' peak, the offloaded activations (memory), and the
    per-token compute of every use and of the outside (time). Activations and compute of K
    adapters on their own rows are those of one adapter on K times the rows: the LoRA terms
    are per row (each row meets one adapter's A and B), the base terms are per row too.
  - adapters: static + (K - 1) x 4 x adapter_grad_bytes (every adapter has its own parameters,
    gradients and optimizer state); the adapter-gradient all-reduce moves K x
    adapter_grad_bytes once per step.
  - gathers: unchanged. The frozen weights are gathered per use, whatever the rows (issue
    29's exactness: the bytes of a K-adapter job equal the one-adapter job's), so the
    timeline, the gather buffers, the pool and the traffic formula do not depend on K; a
    use's fixed compute (launches) does not either.
So a K-adapter plan differs from a one-adapter plan with a K-times micro-batch only by the
adapters' state and all-reduce (tests/planner/test_planner_adapters.py checks the memory
curve point by point against that). Ranks that differ between adapters are not modelled: all
K are the profiled adapter's size.

[Note: activation offload in the memory model]
With `Choices.offload` the activation offload (python_api/host/offload.py) copies the
activations of every elastic LoRA linear of a layer to host buffers after that layer's
forward, unless the layer is recomputed (its forward runs under checkpointing's saved-tensor
hooks, and the recompute inside backward offloads nothing). Which tensors the bounded pool
serves is the offloader's rule, modelled exactly (`offload_served`): requests in forward
order, each of size class max(512, next power of two of its bytes); a request is served from
a free buffer of its class or by a new buffer while the pool's held bytes (free + in use) stay
within host_budget_bytes, else refused (the tensor stays on the device). In steady state the
pool's buffers are all free at the start of every micro-batch (each is returned once its
copy-back is issued), and held bytes only grow, so the first request of a class that is
refused makes every later one of that class refused: the served set is the same every
micro-batch and is the one this rule computes from an empty pool (apply_plan trims the pool
of free buffers of other shapes). Per layer i with every request served, what stays saved
on the device is act - offload_freed bytes (measured: storages referenced only by the
offloaded activations); a layer with a refused request is credited nothing (conservative:
which part is freed is not modelled). Backward brings them back as fresh tensors, one LoRA
linear ahead: when a linear's backward asks for its tensors, its own copy-back is issued (if
the linear after it in forward order has not issued it already) and that of the linear before
it is started, and each linear's restored copies die after its backward. So during the
backward of a linear the device holds the restored copies of two linears, its own and the
one before it in forward order (across layers: the last linear of the previous offloading
layer), and `restored` is, per layer, the largest such pair over its linears; a layer that
offloads nothing (recomputed) holds, through its whole backward phase, the copy started
ahead for the last linear of the previous offloading layer. Each restored copy is separate,
so an input shared by q/k/v comes back three times. This assumes autograd runs a layer's
linears in reverse forward order (its order by sequence number); a linear out of order has
its copy issued late, not early, and can hold a third pair member. Measured against the
tensor peak with offload on (tests/planner/test_memory_model.py, host-tier test). Until
2026-12-01 the model counted the previous layer's and the layer's own whole moved bytes, an
upper bound 10-15% above the measured peak once the CPU measurement stopped counting the
pool's idle host buffers as device tensors (NOTES.md, issue 17).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from ..config import MIN_HOST_BUFFER_BYTES
from .profile import Profile, ProfileError

FORWARD, RECOMPUTE, BACKWARD = "forward", "recompute", "backward"


@dataclass(frozen=True)
class Choices:
    """What a plan decides, in the form the models evaluate: per layer and per weight, chunks
    kept (k) and persisted (p); per layer, recompute; the micro-batch (sequences per rank per
    micro-batch) and the prefetch depth."""

    micro_batch: int
    keep: tuple[tuple[int, ...], ...]
    persist: tuple[tuple[int, ...], ...]
    recompute: tuple[bool, ...]
    prefetch_depth: int = 1
    host_fraction: float = 0.0  # the runtime's host_fraction ([Note: chunk sources]); 1 in effect
    # whatever it says with weights_on="host" (effective_host_fraction)
    offload: bool = False  # activation offload on
    # Adapters trained together, `micro_batch` sequences each ([Note: several adapters in the models])
    num_adapters: int = 1

    def check(self, profile: Profile) -> None:
        if not isinstance(self.micro_batch, int) or self.micro_batch < 1:
            raise ValueError(f"micro_batch must be an int >= 1, got {self.micro_batch!r}")
        if isinstance(self.num_adapters, bool) or not isinstance(self.num_adapters, int) or self.num_adapters < 1:
            raise ValueError(f"num_adapters must be an int >= 1, got {self.num_adapters!r}")
        f = self.host_fraction
        if isinstance(f, bool) or not isinstance(f, (int, float)) or not 0.0 <= f <= 1.0:
            raise ValueError(f"host_fraction must be a number in [0, 1], got {f!r}")
        if f > 0 and not profile.host_store and not (profile.world_size == 1 and profile.weights_on == "device"):
            raise ValueError(f"host_fraction {f} needs a host store; the profile has none")
        if self.offload and profile.h2d is None:
            raise ValueError("activation offload needs the profile's h2d link; the profile has none")
        if not isinstance(self.prefetch_depth, int) or self.prefetch_depth < 0:
            raise ValueError(f"prefetch_depth must be an int >= 0, got {self.prefetch_depth!r}")
        L = len(profile.layers)
        if not (len(self.keep) == len(self.persist) == len(self.recompute) == L):
            raise ValueError(f"choices cover {len(self.keep)}/{len(self.persist)}/{len(self.recompute)} layers, "
                             f"the profile has {L}")
        for i, layer in enumerate(profile.layers):
            if self.recompute[i] and not layer.recomputable:
                raise ValueError(f"layer {layer.name} is not recomputable")
            if len(self.keep[i]) != len(layer.weights) or len(self.persist[i]) != len(layer.weights):
                raise ValueError(f"layer {layer.name}: choices for {len(self.keep[i])} weights, "
                                 f"the profile has {len(layer.weights)}")
            for w, k, p in zip(layer.weights, self.keep[i], self.persist[i]):
                if not 0 <= p <= k <= w.chunks:
                    raise ValueError(f"{layer.name}.{w.name}: need 0 <= persist ({p}) <= keep ({k}) <= chunks "
                                     f"({w.chunks})")

    @classmethod
    def uniform(cls, profile: Profile, micro_batch: int, keep_fraction: float = 0.0, persist_fraction=None,
                recompute=None, prefetch_depth: int = 1, host_fraction: float = 0.0, offload: bool = False,
                num_adapters: int = 1) -> Choices:
        """Every weight keeps round(keep_fraction x n) chunks, persists round(persist_fraction
        x n) (default: as many as it keeps), rounding half up as the runtime does.
        `recompute`: None (no layer), True (every recomputable layer) or a per-layer sequence."""
        pf = keep_fraction if persist_fraction is None else persist_fraction
        keep = tuple(tuple(int(keep_fraction * w.chunks + 0.5) for w in layer.weights) for layer in profile.layers)
        persist = tuple(tuple(int(pf * w.chunks + 0.5) for w in layer.weights) for layer in profile.layers)
        if recompute is None or recompute is False:
            rec = tuple(False for _ in profile.layers)
        elif recompute is True:
            rec = tuple(layer.recomputable for layer in profile.layers)
        else:
            rec = tuple(bool(r) for r in recompute)
        choices = cls(micro_batch, keep, persist, rec, prefetch_depth, host_fraction, offload, num_adapters)
        choices.check(profile)
        return choices


def rows_per_micro_batch(profile: Profile, choices: Choices) -> int:
    """T, the rows of one micro-batch: micro_batch sequences of seq_len tokens for each of the
    num_adapters adapters ([Note: several adapters in the models])."""
    return choices.num_adapters * choices.micro_batch * profile.seq_len


def adapter_state_bytes(profile: Profile) -> int:
    """One adapter's parameters, gradients and AdamW moments: 4 x adapter_grad_bytes (static
    counts them so: [Note: several adapters in the models])."""
    return 4 * profile.adapter_grad_bytes


class Use(NamedTuple):
    """One use of a unit: the chunks it misses per weight and the bytes that costs."""

    layer: int
    kind: str  # FORWARD | RECOMPUTE | BACKWARD
    missing: tuple[int, ...]  # per weight of the layer
    received_bytes: int  # per rank: (world_size - 1) x sum slice_bytes x missing peer chunks
    buffer_bytes: int  # send + receive buffers: (world_size + 1) x sum slice_bytes x missing peer chunks
    h2d_bytes: int = 0  # real bytes of the missing host chunks, copied host store -> page


def effective_host_fraction(profile: Profile, host_fraction: float) -> float:
    """The fraction the runtime's source split uses: 1 with weights_on="host"; 0 at world size
    1 with the weights on the device (chunks are views of the local weight, nothing is
    fetched: [Note: single process] in python_api/runtime/)."""
    if profile.weights_on == "host":
        return 1.0
    if profile.world_size == 1:
        return 0.0
    return float(host_fraction)


def host_chunk_count(n: int, x: int, f: float) -> int:
    """How many of chunks x..n-1 of a weight with n chunks are host chunks under fraction f:
    exactly `sum(host_chunks(n, f)[x:])` (python_api/host/sources.py), in O(1). The runtime's
    test for chunk c is int((c + 1) * f) > int(c * f); for 0 < f < 1 consecutive values of
    int(c * f) differ by 0 or 1, so the count telescopes to int(n * f) - int(x * f), with the
    very same float products (tests/planner/test_planner.py checks it against the runtime's list)."""
    if f >= 1.0:
        return n - x
    if f <= 0.0:
        return 0
    return int(n * f) - int(x * f)


def is_host_chunk(c: int, f: float) -> bool:
    """host_chunks(n, f)[c], as the runtime computes it."""
    if f >= 1.0:
        return True
    if f <= 0.0:
        return False
    return int((c + 1) * f) > int(c * f)


def use_at(profile: Profile, i: int, kind: str, missing: tuple[int, ...], host_fraction: float = 0.0) -> Use:
    W = profile.world_size
    f = effective_host_fraction(profile, host_fraction)
    if W == 1 and profile.weights_on == "device":  # [Note: single process]: views of the local weight
        return Use(i, kind, tuple(0 for _ in missing), 0, 0, 0)
    slices = h2d = 0
    for w, m in zip(profile.layers[i].weights, missing):
        # The missing chunks are the last m (kept chunks are the first ones).
        host = host_chunk_count(w.chunks, w.chunks - m, f)
        slices += w.slice_bytes * (m - host)
        if host:
            h2d += w.host_bytes(host, is_host_chunk(w.chunks - 1, f))
    # gloo (CPU) gathers into a flat scratch tensor of the output's size and copies it out
    # while the collective runs; NCCL writes the output in place (see the Note above).
    scratch = W * slices if profile.device == "cpu" else 0
    return Use(i, kind, missing, (W - 1) * slices, (W + 1) * slices + scratch, h2d)


def timeline(profile: Profile, choices: Choices) -> tuple[list[Use], list[Use]]:
    """The forward uses and the backward-phase uses of one micro-batch, in execution order
    ([Note: the timeline of an iteration])."""
    choices.check(profile)
    f = choices.host_fraction
    forward, backward = [], []
    for i, layer in enumerate(profile.layers):
        ks, ps = choices.keep[i], choices.persist[i]
        forward.append(use_at(profile, i, FORWARD, tuple(w.chunks - p for w, p in zip(layer.weights, ps)), f))
    for i in reversed(range(len(profile.layers))):
        layer = profile.layers[i]
        ks, ps = choices.keep[i], choices.persist[i]
        if choices.recompute[i]:
            backward.append(use_at(profile, i, RECOMPUTE, tuple(
                w.chunks - (k if w.backward else p) for w, k, p in zip(layer.weights, ks, ps)), f))
        backward.append(use_at(profile, i, BACKWARD, tuple(
            (w.chunks - k) if w.backward else 0 for w, k in zip(layer.weights, ks)), f))
    return forward, backward




def offload_size_class(nbytes: int) -> int:
    """elastic_kernels.api.host.offload.size_class: the next power of two, at least the minimum."""
    return max(MIN_HOST_BUFFER_BYTES, 1 << max(0, nbytes - 1).bit_length())


class Offload(NamedTuple):
    """Per layer, what the activation offload does in one micro-batch (all zero when off)."""

    moved: tuple[int, ...]  # bytes copied device -> host after forward (and back before backward)
    credit: tuple[int, ...]  # device bytes freed between forward and backward
    restored: tuple[int, ...]  # restored copies alive at once during the layer's backward phase
    # per layer, the tensors served, in forward order: (index of the weight whose LoRA linear
    # saved it, bytes); what the cost model times ([Note: activation copies in the time model])
    served: tuple[tuple[tuple[int, int], ...], ...] = ()


def per_linear(tensors) -> list[int]:
    """A layer's served tensors ((owner, bytes), forward order) as bytes per LoRA linear, in
    forward order (one linear's tensors are saved together)."""
    out: list[int] = []
    owner = None
    for o, nbytes in tensors:
        if out and o == owner:
            out[-1] += nbytes
        else:
            out.append(nbytes)
            owner = o
    return out


def restored_bytes(served) -> tuple[int, ...]:
    """Per layer, the restored copies alive at once in its backward phase ([Note: activation
    offload in the memory model]): the largest pair of consecutive linears, the first of the
    layer paired with the last linear of the previous offloading layer; a layer without
    served tensors holds that last linear's copy."""
    out, last = [], 0
    for tensors in served:
        linears = per_linear(tensors)
        if linears:
            out.append(max(a + b for a, b in zip([last] + linears[:-1], linears)))
            last = linears[-1]
        else:
            out.append(last)
    return tuple(out)


def offload_served(profile: Profile, tokens: int, recompute, offload: bool) -> Offload:
    """The offloader's rule ([Note: activation offload in the memory model]), exact."""
    L = len(profile.layers)
    if not offload:
        zero = (0,) * L
        return Offload(zero, zero, zero, ((),) * L)
    budget = profile.host_budget_bytes
    held = 0
    refused_classes: set[int] = set()
    moved, credit, served = [], [], []
    for i, layer in enumerate(profile.layers):
        if recompute[i] or not layer.offload_tensors_bytes_per_token:
            moved.append(0)
            credit.append(0)
            served.append(())
            continue
        m, every = 0, True
        mine = []
        for b, owner in zip(layer.offload_tensors_bytes_per_token, layer.offload_owner_indices()):
            nbytes = int(round(b * tokens))
            if nbytes <= 0:
                continue
            cap = offload_size_class(nbytes)
            if budget is not None and (cap in refused_classes or held + cap > budget):
                refused_classes.add(cap)
                every = False
                continue
            held += cap
            m += nbytes
            mine.append((owner, nbytes))
        served.append(tuple(mine))
        moved.append(m)
        credit.append(min(int(layer.offload_freed_bytes_per_token * tokens), int(layer.act_bytes_per_token * tokens))
                      if every and m else 0)
    return Offload(tuple(moved), tuple(credit), restored_bytes(served), tuple(served))


def held_as_runs(profile: Profile, choices: Choices) -> tuple[tuple[bool, ...], ...]:
    """Per layer and weight, whether the runtime holds the weight as a run under `choices`
    ([Note: what the memory model counts]): run_bytes known, every chunk persistent, no host
    chunk."""
    f = effective_host_fraction(profile, choices.host_fraction)
    return tuple(tuple(w.run_bytes is not None and p == w.chunks and host_chunk_count(w.chunks, 0, f) == 0
                       for w, p in zip(layer.weights, ps))
                 for layer, ps in zip(profile.layers, choices.persist))


def run_extra_bytes(profile: Profile, choices: Choices) -> int:
    """What the runs add to static_bytes: run_bytes - shard_bytes per weight held as a run (at
    most 0: a run holds the shard's real elements and the peers', no padding)."""
    runs = held_as_runs(profile, choices)
    return sum(w.run_bytes - w.shard_bytes for layer, rs in zip(profile.layers, runs)
               for w, r in zip(layer.weights, rs) if r)


def pool_pages(profile: Profile, choices: Choices) -> int:
    """Pages the runtime's pool reaches: the plan's budget (every kept chunk) plus the working
    set, at most every chunk ([Note: pool budget and working set] in python_api/runtime/),
    counting the weights not held as runs only."""
    runs = held_as_runs(profile, choices)
    paged = [sum(w.chunks for w, r in zip(layer.weights, rs) if not r) for layer, rs in zip(profile.layers, runs)]
    kept = sum(k for ks, rs in zip(choices.keep, runs) for k, r in zip(ks, rs) if not r)
    counts = sorted(paged, reverse=True)
    working_set = sum(counts[: 1 + choices.prefetch_depth])
    return min(sum(paged), kept + working_set)


def pool_budget_bytes(profile: Profile, choices: Choices) -> int:
    """The `pool_budget_bytes` a plan gives the runtime: one page per kept chunk."""
    return profile.page_bytes * sum(sum(ks) for ks in choices.keep)


@dataclass(frozen=True)
class MemoryCurve:
    """Bytes per rank at each point of an iteration, and what they are made of."""

    points: tuple[tuple[str, int], ...]  # (label, bytes), in execution order
    fixed_bytes: int  # reserved + static
    pool_bytes: int

    @property
    def peak_bytes(self) -> int:
        return max(b for _, b in self.points)

    @property
    def peak_point(self) -> str:
        return max(self.points, key=lambda p: p[1])[0]


def memory_curve(profile: Profile, choices: Choices) -> MemoryCurve:
    """The memory model ([Note: what the memory model counts])."""
    forward, backward = timeline(profile, choices)
    T = rows_per_micro_batch(profile, choices)
    d = choices.prefetch_depth
    # static holds one adapter's state; each further adapter adds its own
    fixed = profile.reserved_bytes + profile.static_bytes + (choices.num_adapters - 1) * adapter_state_bytes(profile)
    fixed += run_extra_bytes(profile, choices)  # the runs: their bytes in place of their shards
    pool = pool_pages(profile, choices) * profile.page_bytes
    base = fixed + pool + int(profile.outside.act_bytes_per_token * T)
    layers = profile.layers
    off = offload_served(profile, T, choices.recompute, choices.offload)
    saved = [int((layer.input_bytes_per_token if choices.recompute[i] else layer.act_bytes_per_token) * T)
             - off.credit[i] for i, layer in enumerate(layers)]
    before = [0] * (len(layers) + 1)  # saved activations of layers < i
    for i, s in enumerate(saved):
        before[i + 1] = before[i] + s
    points = []
    for j, u in enumerate(forward):
        buffers = sum(v.buffer_bytes for v in forward[j : j + 1 + d])
        own = int(layers[u.layer].act_bytes_per_token * T)
        points.append((f"forward {layers[u.layer].name}", base + before[u.layer] + own + buffers))
    points.append(("end of forward", base + before[-1] + int(profile.outside.peak_bytes_per_token * T)))
    segment = [is_segment(profile, u) for u in backward]
    for j, u in enumerate(backward):
        buffers = window_buffers(backward, segment, j, d)
        i = u.layer
        own = int(layers[i].act_bytes_per_token * T) + (saved[i] if choices.recompute[i] else 0) + off.restored[i]
        if u.kind == BACKWARD:
            own -= off.credit[i]
            own += int(profile.outside.workspace_bytes_per_token * T)
            if choices.recompute[i]:
                own += int(profile.outside.recompute_workspace_bytes_per_token * T)
        points.append((f"{u.kind} {layers[i].name}", base + before[i] + own + buffers))
    return MemoryCurve(tuple(points), fixed, pool)


def is_segment(profile: Profile, u: Use) -> bool:
    """Whether the runtime calls `use` for this use, so that it is a segment of the learned
    order, issues gathers and counts in the prefetch window: every forward and recompute
    use; a backward use when some weight of the layer has a backward use (otherwise the
    layer's backward runs only its adapters' gradients)."""
    return u.kind != BACKWARD or any(w.backward for w in profile.layers[u.layer].weights)


def window_buffers(uses: list[Use], segment: list[bool], j: int, d: int) -> int:
    """Gather buffers alive at use j: its own and those of the next `d` segments (prefetched);
    at a use that is not a segment, those of the next `d` segments."""
    need = d + 1 if segment[j] else d
    total = 0
    k = j
    while need and k < len(uses):
        if segment[k]:
            total += uses[k].buffer_bytes
            need -= 1
        k += 1
    return total


def peak_bytes(profile: Profile, choices: Choices) -> int:
    return memory_curve(profile, choices).peak_bytes


__all__ = ["BACKWARD", "Choices", "FORWARD", "MemoryCurve", "Offload", "ProfileError", "RECOMPUTE", "Use",
           "adapter_state_bytes", "effective_host_fraction", "held_as_runs", "host_chunk_count", "is_host_chunk", "is_segment", "memory_curve",
           "offload_served", "peak_bytes", "per_linear", "restored_bytes", "pool_budget_bytes", "pool_pages", "rows_per_micro_batch", "run_extra_bytes", "timeline",
           "window_buffers"]
