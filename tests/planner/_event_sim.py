"""An independent event simulation of one optimizer step under a plan, to check the planner's
cost model (python_api/planner/cost.py) against. It is written from what the runtime does, not
from the model's code, and shares nothing with python_api/planner but the profile's numbers:

- the program walks every *weight* use in order (forward: the units' weights in profile
  order; backward phase: per layer in reverse, its recompute (the weights in forward order)
  when the plan recomputes it, then its backward (the weights with a backward use, in
  reverse order)), as `ElasticRuntime.use` is called;
- segments are maximal runs of uses of one unit; at the first weight use of a segment the
  runtime issues that segment's gathers (unless prefetched) and those of the next
  `prefetch_depth` segments of the phase, never across the forward/backward boundary
  (python_api/runtime/_order.py);
- a missing chunk c of a weight is a host chunk iff int((c + 1) f) > int(c f)
  (python_api/host/sources.py), walked chunk by chunk here; kept chunks are the first ones;
  missing in forward n - persist, in recompute n - keep (n - persist without a backward use),
  in backward n - keep;
- device semantics, streams as FIFO queues: an all-gather (its pack, the collective, its
  unpack) runs on the communication stream after the compute enqueued before its issue
  (`wait_stream`), host chunk copies on the weights' copy stream likewise, each holding its
  link (the network; the PCIe host->device direction); the compute of a weight waits for the
  events of its own chunks;
- activation offload as python_api/host/offload.py does it: the offloader's pool (power-of-two
  classes, budget, no eviction) decides per tensor, in forward order; each LoRA linear's D2H
  copies follow its forward on the offloader's stream (PCIe device->host direction); the
  backward of a linear restores: its own copy-back if nobody issued it, then the previous
  offloading linear's, on the offloader's stream and the host->device link, and waits for its
  own. Compute of a layer is spread over its linears by weight bytes, as the cost model
  assumes (the profile has no per-linear time).

Issue times are the device times of those program points: the host is assumed never to run
ahead of the device (what the cost model assumes too).
"""

from __future__ import annotations


class _Device:
    """Resources (streams, links) with the time each is free again."""

    def __init__(self):
        self.free: dict[str, float] = {}

    def run(self, resources: tuple[str, ...], ready: float, duration: float) -> float:
        start = max([ready] + [self.free.get(r, 0.0) for r in resources])
        end = start + duration
        for r in resources:
            self.free[r] = end
        return end


def _size_class(nbytes: int, minimum: int) -> int:
    cap = 1
    while cap < nbytes:
        cap *= 2
    return max(minimum, cap)


def _served(profile, tokens: int, recompute, min_buffer: int):
    """Per layer: [(weight index, bytes)] of the tensors the offloader serves (its pool rule)."""
    held, refused, out = 0, set(), []
    budget = profile.host_budget_bytes
    for i, layer in enumerate(profile.layers):
        mine = []
        if not recompute[i]:
            names = list(getattr(layer, "offload_tensors_weight", ())) or [layer.weights[-1].name] * len(
                layer.offload_tensors_bytes_per_token)
            index = {w.name: j for j, w in enumerate(layer.weights)}
            for b, name in zip(layer.offload_tensors_bytes_per_token, names):
                nbytes = int(round(b * tokens))
                if nbytes <= 0:
                    continue
                cap = _size_class(nbytes, min_buffer)
                if budget is not None and (cap in refused or held + cap > budget):
                    refused.add(cap)
                    continue
                held += cap
                mine.append((index[name], nbytes))
        out.append(mine)
    return out


def _missing_chunks(n: int, kept: int, f: float) -> tuple[list[int], list[int]]:
    """(peer chunks, host chunks) among the missing chunks kept..n-1."""
    peer, host = [], []
    for c in range(kept, n):
        is_host = f >= 1.0 or (f > 0.0 and int((c + 1) * f) > int(c * f))
        (host if is_host else peer).append(c)
    return peer, host


def step_seconds(profile, plan, min_buffer: int = 512, unit_waits: bool = True) -> float:
    """The simulated seconds of one optimizer step of `plan` (a elastic_kernels.api Plan) on `profile`.
    `unit_waits`: a weight's compute waits for everything its unit's use misses (what the
    cost model assumes); False: only for its own chunks (what the runtime does)."""
    W = profile.world_size
    T = plan.micro_batch * profile.seq_len
    layers = profile.layers
    d = plan.prefetch_depth
    f = 1.0 if profile.weights_on == "host" else (0.0 if W == 1 else plan.host_fraction)
    local = W == 1 and profile.weights_on == "device"  # chunks are views of the local weight
    rec = [lp.recompute for lp in plan.layers]
    keep = [[w.keep_chunks for w in lp.weights] for lp in plan.layers]
    persist = [[w.persist_chunks for w in lp.weights] for lp in plan.layers]

    def gather_seconds(slices: int) -> float:
        t = profile.allgather.latency_s + (W - 1) * slices / profile.allgather.bytes_per_s
        copy = getattr(profile, "copy", None)  # absent in profiles older than issue 17
        if copy is not None:  # pack (slices) and unpack (W x slices): two copy kernels
            t += 2 * copy.latency_s + (W + 1) * slices / copy.bytes_per_s
        return t

    def host_seconds(nbytes: int) -> float:
        return profile.h2d.latency_s + nbytes / profile.h2d.bytes_per_s

    def shares(i: int):
        size = [(w.chunks - 1) * w.chunk_bytes + w.last_bytes for w in layers[i].weights]
        total = sum(size) or 1
        bsize = [b if w.backward else 0 for b, w in zip(size, layers[i].weights)]
        btotal = sum(bsize)
        return [b / total for b in size], ([b / btotal for b in bsize] if btotal else [1 / len(size)] * len(size))

    def phases():
        """Per phase, the program: (layer, kind, weight, chunks kept before the use, a use?)
        in order; kind "bwd" steps without a use are a LoRA backward that only restores."""
        fwd = [(i, "fwd", j, persist[i][j], True) for i in range(len(layers)) for j in range(len(layers[i].weights))]
        bwd = []
        for i in reversed(range(len(layers))):
            ws = layers[i].weights
            if rec[i]:
                bwd += [(i, "rec", j, keep[i][j] if ws[j].backward else persist[i][j], True) for j in range(len(ws))]
            bwd += [(i, "bwd", j, keep[i][j], ws[j].backward) for j in reversed(range(len(ws)))]
        return fwd, bwd

    served = _served(profile, T, rec, min_buffer) if plan.offload_activations else [[] for _ in layers]
    linears, number = [], {}  # offloading linears in forward order: seconds of their copies
    for i, tensors in enumerate(served):
        per: dict[int, float] = {}
        for j, nbytes in tensors:
            per[j] = per.get(j, 0.0) + host_seconds(nbytes)
        for j in sorted(per):
            number[i, j] = len(linears)
            linears.append(per[j])

    total = 0.0
    for _ in range(plan.accumulation):
        dev = _Device()
        clock = 0.0  # the compute stream's end: what a wait_stream(compute) waits for
        back: dict[int, float] = {}  # copy-backs issued: linear -> end
        for phase_name, program in zip(("forward", "backward"), phases()):
            uses = [k for k, step in enumerate(program) if step[4]]
            segments: list[list[int]] = []  # maximal runs of uses of one unit and kind
            for k in uses:
                if segments and program[segments[-1][0]][:2] == program[k][:2]:
                    segments[-1].append(k)
                else:
                    segments.append([k])
            segment_of = {k: s for s, ks in enumerate(segments) for k in ks}
            ready: dict[int, float] = {}
            issued: set[int] = set()

            def issue(s: int) -> None:
                """_start_uses: each weight's host chunks on the copy stream, then the
                segment's peer chunks in one collective (below the collective cap)."""
                if s in issued or s >= len(segments):
                    return
                issued.add(s)
                slices, gathered = 0, []
                for k in segments[s]:
                    i, _, j, kept, _ = program[k]
                    w = layers[i].weights[j]
                    ready[k] = 0.0
                    if local:
                        continue
                    peer, host = _missing_chunks(w.chunks, kept, f)
                    if host:
                        nbytes = sum(w.last_bytes if c == w.chunks - 1 else w.chunk_bytes for c in host)
                        ready[k] = dev.run(("wcopy", "h2d"), clock, host_seconds(nbytes))
                    if peer:
                        slices += len(peer) * w.slice_bytes
                        gathered.append(k)
                if gathered:
                    end = dev.run(("comm", "net"), clock, gather_seconds(slices))
                    for k in gathered:
                        ready[k] = max(ready[k], end)
                if unit_waits:
                    latest = max(ready[k] for k in segments[s])
                    for k in segments[s]:
                        ready[k] = latest

            for k, (i, kind, j, _, is_use) in enumerate(program):
                fshare, bshare = shares(i)
                lin = number.get((i, j))
                if kind == "bwd" and lin is not None:  # saved_for_backward: restore, then the use
                    for target in (lin, lin - 1):
                        if target >= 0 and target not in back:
                            back[target] = dev.run(("act", "h2d"), clock, linears[target])
                    clock = max(clock, back[lin])
                if is_use:
                    s = segment_of[k]
                    if segments[s][0] == k:  # the segment's first use issues it and prefetches
                        for a in range(s, s + d + 1):
                            issue(a)
                    clock = max(clock, ready[k])
                c = layers[i].fwd_s(T) if kind in ("fwd", "rec") else layers[i].bwd_s(T)
                clock += c * (bshare[j] if kind == "bwd" else fshare[j])
                if kind == "fwd" and lin is not None:  # its activations go to host after its forward
                    dev.run(("act", "d2h"), clock, linears[lin])
            if phase_name == "forward":
                clock += (profile.outside.fwd_s_per_token + profile.outside.bwd_s_per_token) * T
        total += clock
    if W > 1:
        total += profile.allreduce.latency_s + profile.adapter_grad_bytes / profile.allreduce.bytes_per_s
    return total


def latency_slack(prof, plan) -> float:
    """What the simulation adds to the model by the runtime's granularity: one host copy per
    weight of a use (the model: one per use, one latency), per micro-batch, times the
    accumulation. Every simulated time is a max-plus expression of the durations, so the
    simulated step exceeds the model's by at least 0 and at most the sum of the added
    durations (1-Lipschitz in each)."""
    if prof.h2d is None:
        return 0.0
    f = 1.0 if prof.weights_on == "host" else (0.0 if prof.world_size == 1 else plan.host_fraction)
    if f <= 0:
        return 0.0
    extra = 0
    for i, (layer, lp) in enumerate(zip(prof.layers, plan.layers)):
        keep = [w.keep_chunks for w in lp.weights]
        persist = [w.persist_chunks for w in lp.weights]
        uses = [persist] + ([[k if w.backward else p for w, k, p in zip(layer.weights, keep, persist)]]
                            if lp.recompute else []) + [[k if w.backward else w.chunks for w, k in
                                                         zip(layer.weights, keep)]]
        for kept in uses:
            k = sum(1 for w, x in zip(layer.weights, kept) if _missing_chunks(w.chunks, x, f)[1])
            extra += max(0, k - 1)
    return plan.accumulation * extra * prof.h2d.latency_s
