"""Independent references for a plan's predictions, written from the notes' text (memory.py
[Note: what the memory model counts], [Note: activation offload in the memory model], cost.py
[Note: exact all-gather traffic]) and the runtime's rules, not from the planner's code:
traffic by enumerating every missing chunk of every use, the peak by walking the points of an
iteration one by one. The time reference is tests/planner/_event_sim.py."""

from __future__ import annotations

from tests.planner._event_sim import _missing_chunks, _served

MIN_BUFFER = 512  # elastic_kernels.api.config.MIN_HOST_BUFFER_BYTES (the offloader's smallest buffer)


def _fraction(profile, plan) -> float:
    if profile.weights_on == "host":
        return 1.0
    return 0.0 if profile.world_size == 1 else plan.host_fraction


def _uses(profile, plan):
    """Per phase, (layer, kind, kept chunks per weight before the use); a backward use of a
    layer without any backward weight is marked as no segment (the runtime never calls use)."""
    fwd, bwd = [], []
    for i, (layer, lp) in enumerate(zip(profile.layers, plan.layers)):
        fwd.append((i, "forward", [w.persist_chunks for w in lp.weights], True))
    for i in reversed(range(len(profile.layers))):
        layer, lp = profile.layers[i], plan.layers[i]
        if lp.recompute:
            bwd.append((i, "recompute", [w.keep_chunks if p.backward else w.persist_chunks
                                         for w, p in zip(lp.weights, layer.weights)], True))
        bwd.append((i, "backward", [w.keep_chunks if p.backward else p.chunks for w, p in zip(lp.weights, layer.weights)],
                    any(p.backward for p in layer.weights)))
    return fwd, bwd


def _use_bytes(profile, plan, use):
    """(received, send + receive buffers, host bytes) of one use, chunk by chunk."""
    W = profile.world_size
    if W == 1 and profile.weights_on == "device":
        return 0, 0, 0
    f = _fraction(profile, plan)
    i, _, kept, _ = use
    received = buffers = host_bytes = 0
    for w, k in zip(profile.layers[i].weights, kept):
        peer, host = _missing_chunks(w.chunks, k, f)
        received += (W - 1) * w.slice_bytes * len(peer)
        buffers += (W + 1) * w.slice_bytes * len(peer)
        if profile.device == "cpu":  # gloo's scratch copy of the output
            buffers += W * w.slice_bytes * len(peer)
        host_bytes += sum(w.last_bytes if c == w.chunks - 1 else w.chunk_bytes for c in host)
    return received, buffers, host_bytes


def traffic_per_step(profile, plan) -> tuple[int, int]:
    """(all-gather bytes received, host -> device bytes) per optimizer step, steady state."""
    fwd, bwd = _uses(profile, plan)
    received = host = 0
    for use in fwd + bwd:
        r, _, h = _use_bytes(profile, plan, use)
        received += r
        host += h
    if plan.offload_activations:
        T = plan.micro_batch * profile.seq_len
        host += sum(nb for tensors in _served(profile, T, [lp.recompute for lp in plan.layers], MIN_BUFFER)
                    for _, nb in tensors)
    return plan.accumulation * received, plan.accumulation * host


def peak_bytes(profile, plan) -> int:
    """The memory model's peak, point by point: every forward use, the end of forward, every
    backward-phase use."""
    T = plan.micro_batch * profile.seq_len
    layers = profile.layers
    d = plan.prefetch_depth
    rec = [lp.recompute for lp in plan.layers]
    kept = sum(w.keep_chunks for lp in plan.layers for w in lp.weights)
    units = sorted((sum(w.chunks for w in layer.weights) for layer in layers), reverse=True)
    working_set = min(profile.total_chunks, sum(units[: 1 + d]))
    pool = min(profile.total_chunks, kept + working_set) * profile.page_bytes
    base = profile.reserved_bytes + profile.static_bytes + pool + int(profile.outside.act_bytes_per_token * T)
    # activation offload: served tensors, what stays saved, what comes back ahead
    served = _served(profile, T, rec, MIN_BUFFER) if plan.offload_activations else [[] for _ in layers]
    credit = []
    for i, layer in enumerate(layers):
        m = sum(nb for _, nb in served[i])
        wanted = [int(round(b * T)) for b in layer.offload_tensors_bytes_per_token if int(round(b * T)) > 0]
        every = m > 0 and len(served[i]) == len(wanted)  # a refused request: nothing credited
        credit.append(min(int(layer.offload_freed_bytes_per_token * T), int(layer.act_bytes_per_token * T))
                      if every else 0)
    # restored copies alive at once in each layer's backward phase: a linear's own and the one
    # before it in forward order (the chain runs across layers); recomputed layers hold the
    # copy started ahead for the previous offloading layer's last linear
    restored, last = [], 0
    for i in range(len(layers)):
        linears = {}
        for owner, nb in served[i]:
            linears[owner] = linears.get(owner, 0) + nb
        chain = [last] + [linears[o] for o in sorted(linears)]
        restored.append(max(chain[k] + chain[k + 1] for k in range(len(chain) - 1)) if linears else last)
        if linears:
            last = linears[max(linears)]
    saved = [int((layer.input_bytes_per_token if rec[i] else layer.act_bytes_per_token) * T) - credit[i]
             for i, layer in enumerate(layers)]
    fwd, bwd = _uses(profile, plan)
    fbuf = [_use_bytes(profile, plan, u)[1] for u in fwd]
    bbuf = [_use_bytes(profile, plan, u)[1] for u in bwd]
    points = []
    for j, (i, _, _, _) in enumerate(fwd):
        buffers = sum(fbuf[j : j + 1 + d])
        points.append(base + sum(saved[:i]) + int(layers[i].act_bytes_per_token * T) + buffers)
    points.append(base + sum(saved) + int(profile.outside.peak_bytes_per_token * T))
    for j, (i, kind, _, seg) in enumerate(bwd):
        need = d + 1 if seg else d  # its own buffers (a segment) and the next d segments'
        buffers, k = 0, j
        while need and k < len(bwd):
            if bwd[k][3]:
                buffers += bbuf[k]
                need -= 1
            k += 1
        own = int(layers[i].act_bytes_per_token * T) + (saved[i] if rec[i] else 0) + restored[i]
        if kind == "backward":
            own += -credit[i] + int(profile.outside.workspace_bytes_per_token * T)
            if rec[i]:
                own += int(profile.outside.recompute_workspace_bytes_per_token * T)
        points.append(base + sum(saved[:i]) + own + buffers)
    return max(points)
