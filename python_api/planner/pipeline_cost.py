"""What one pack of a pipeline layout costs (PackCost: compute, bytes gathered or read from the
host, pages, gather buffers, saved activations, per layer load and compute times) and the
static bytes of a pp rank: the terms of [Note: the pipeline cost model] and [Note: the
pipeline memory model] (pipeline_sim.py) per pack. Pure Python.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..config import PAGE_ALIGN
from .pipeline import FORWARD, PipelineLayout
from .pipeline_profile import PipelineProfile, PipeWeight

ADAPTER_BYTES_PER_PARAM = 16  # fp32 value, gradient, AdamW's two moments


@dataclass(frozen=True)
class PackCost:
    weights: tuple[PipeWeight, ...]
    fwd_s: float
    bwd_s: float
    act_bytes: int  # saved per micro-batch
    fwd_gather: int
    bwd_gather: int
    fwd_host: int
    bwd_host: int
    fwd_pages: int  # bytes of pages
    bwd_pages: int
    fwd_buffers: int
    bwd_buffers: int
    shard_bytes: int
    adapter_bytes: int
    working_set: int  # pages of its 1 + prefetch_depth largest layers (a transient pack's pool)
    fwd_unit_buffers: int  # gather buffers of its 1 + prefetch_depth largest layers (a load on demand)
    bwd_unit_buffers: int
    store_bytes: int  # its weights in the host store (weights_on="host")
    layer_times: tuple  # per layer: (fwd compute, bwd compute, fwd load s, bwd load s)


def pack_cost(profile: PipelineProfile, layout: PipelineLayout, k: int, micro_batch_size: int,
              cache: dict | None = None) -> PackCost:
    """Compute, bytes and pages of pack k (memoised in `cache` by what they depend on)."""
    key = (layout.boundaries[k], layout.boundaries[k + 1], k == 0, k == layout.n_packs - 1, micro_batch_size,
           layout.dp)
    if cache is not None and key in cache:
        return cache[key]
    out = _pack_cost(profile, *key, cache=cache)
    if cache is not None:
        cache[key] = out
    return out


def _unit_sums(profile: PipelineProfile, weights, dp: int) -> tuple:
    """Per group of weights (a layer, or the head) at dp: (largest page, chunks, backward
    chunks, gather bytes, backward gather bytes, host bytes, backward host bytes, slice bytes x
    chunks, backward slice bytes x chunks, shard bytes, store bytes)."""
    page = chunks = bchunks = g = bg = h = bh = sl = bsl = shard = store = 0
    host = profile.weights_on == "host"
    for w in weights:
        n, cb, slc, real = w.layout(profile.chunk_bytes, dp)
        page = max(page, -(-cb // PAGE_ALIGN) * PAGE_ALIGN)
        shard += (n - 1) * slc + min(slc, real - (n - 1) * cb)  # rank 0's real bytes: no padding
        store += real
        chunks += n
        sl += slc * n
        if host:
            h += real
        else:
            g += (dp - 1) * slc * n
        if w.backward:
            bchunks += n
            bsl += slc * n
            if host:
                bh += real
            else:
                bg += (dp - 1) * slc * n
    return page, chunks, bchunks, g, bg, h, bh, sl, bsl, shard, store


def _pack_cost(profile: PipelineProfile, start: int, end: int, first: bool, last: bool, micro_batch_size: int,
               dp: int, cache: dict | None = None) -> PackCost:
    T = micro_batch_size * profile.seq_len
    layers = profile.layers[start:end]
    units = []
    for i in range(start, end):
        key = ("layer", i, dp)
        u = cache.get(key) if cache is not None else None
        if u is None:
            u = _unit_sums(profile, profile.layers[i].weights, dp)
            if cache is not None:
                cache[key] = u
        units.append(u)
    if last and profile.head_weights:
        units.append(_unit_sums(profile, profile.head_weights, dp))
    fwd = sum(layer.fwd_s(T) for layer in layers) + (profile.embed_fwd_s_per_token * T if first else 0.0) \
        + (profile.head_fwd_s_per_token * T if last else 0.0)
    bwd = sum(layer.bwd_s(T) for layer in layers) + (profile.head_bwd_s_per_token * T if last else 0.0)
    act = int(sum(layer.act_bytes_per_token for layer in layers) * T
              + (profile.head_act_bytes_per_token * T if last else 0))
    host = profile.weights_on == "host"
    local_only = dp == 1 and not host
    page = max((u[0] for u in units), default=0)
    scratch = dp if profile.cpu_gloo else 0
    tot = [sum(u[j] for u in units) for j in range(11)]
    _, chunks, bchunks, fg, bg, fh, bh, sl, bsl, shard, store = tot
    if local_only:
        fp = bp = fb = bb = fg = bg = 0
    else:
        fp, bp = chunks * page, bchunks * page
        fb = 0 if host else (dp + 1 + scratch) * sl
        bb = 0 if host else (dp + 1 + scratch) * bsl

    def load_s(g, h):
        t = profile.allgather.time(g) if g else 0.0
        if h:
            t = max(t, profile.h2d.time(h))
        return t

    unit_buffers = [(0, 0) if host or local_only else ((dp + 1 + scratch) * u[7], (dp + 1 + scratch) * u[8])
                    for u in units]
    keep = 1 + profile.prefetch_depth
    fub = sum(sorted((b[0] for b in unit_buffers), reverse=True)[:keep])
    bub = sum(sorted((b[1] for b in unit_buffers), reverse=True)[:keep])
    per_layer, layer_pages = [], []
    for layer, u in zip(layers, units):
        lg, lbg, lh, lbh = (0, 0, 0, 0) if local_only else (u[3], u[4], u[5], u[6])
        per_layer.append((layer.fwd_s(T), layer.bwd_s(T), load_s(lg, lh), load_s(lbg, lbh)))
        layer_pages.append(0 if local_only else u[1] * page)
    adapters = sum(layer.adapter_params for layer in layers) + (profile.head_adapter_params if last else 0)
    ws = sum(sorted(layer_pages, reverse=True)[: 1 + profile.prefetch_depth])
    weights = tuple(w for layer in layers for w in layer.weights) + (tuple(profile.head_weights) if last else ())
    return PackCost(weights, fwd, bwd, act, fg, bg, fh if not local_only else 0, bh if not local_only else 0,
                    fp, bp, fb, bb, 0 if host else shard, ADAPTER_BYTES_PER_PARAM * adapters, ws, fub, bub,
                    store if host else 0, tuple(per_layer))


def _load_time(profile: PipelineProfile, c: PackCost, kind: str) -> float:
    g, h = (c.fwd_gather, c.fwd_host) if kind == FORWARD else (c.bwd_gather, c.bwd_host)
    t = profile.allgather.time(g) if g else 0.0
    if h:
        t = max(t, profile.h2d.time(h))
    return t


def _transient_exposed(c: PackCost, kind: str) -> float:
    """In-action gathers of a transient pack, each layer prefetched one layer ahead."""
    total, prev = 0.0, 0.0
    seq = c.layer_times if kind == FORWARD else tuple(reversed(c.layer_times))
    for fc, bc, fl, bl in seq:
        load = fl if kind == FORWARD else bl
        total += max(0.0, load - prev)
        prev = fc if kind == FORWARD else bc
    return total


def _static_bytes(profile: PipelineProfile, layout: PipelineLayout, r: int, costs: dict, micro_batch_size: int) -> int:
    n = layout.n_packs
    p2p = micro_batch_size * profile.seq_len * profile.hidden_size * profile.act_element_size
    total = profile.reserved_bytes
    for k in layout.packs_of_rank(r):
        c = costs[k]
        total += c.shard_bytes + c.adapter_bytes
        if profile.cpu_gloo and profile.weights_on == "host":  # on CPU the host store is in the same memory
            total += c.store_bytes
        total += ((k > 0) + (k < n - 1)) * layout.micro_batches * p2p
        if k == 0:
            total += profile.first_static_bytes
        if k == n - 1:
            total += profile.last_static_bytes
    return total


__all__ = ["ADAPTER_BYTES_PER_PARAM", "PackCost", "pack_cost"]
