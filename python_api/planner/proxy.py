"""The search's proxy of the time, per unit ([Note: the search] in search.py): the keep order
of a unit's chunks, per prefix of it the peer and host bytes its uses miss (`Unit`), and the
runs of chunks by time saved per chunk (`proxy_runs`, the upper concave envelope of the proxy's
exposed time). Pure Python, no torch.
"""

from __future__ import annotations

from .memory import (
    BACKWARD,
    FORWARD,
    effective_host_fraction,
    host_chunk_count,
    is_host_chunk,
    use_at,
)
from .profile import Profile


class Unit:
    """The fixed part of one unit for the search: its keep order and, per prefix of it, the
    bytes its uses miss."""

    __slots__ = ("order", "blocks", "n", "sig", "stops", "f", "split", "ws", "q", "buf_all", "buf_bwd", "tab",
                 "bwd_segment")

    def __init__(self, profile: Profile, i: int, granularity: str, host_fraction: float, tables: dict):
        layer = profile.layers[i]
        W = profile.world_size
        q = W - 1 if not (W == 1 and profile.weights_on == "device") else 0
        # The source split ([Note: chunk sources and the host link] in cost.py): with host
        # chunks a unit's missing bytes are no longer linear in the chunks kept.
        self.f = effective_host_fraction(profile, host_fraction)
        self.split = self.f > 0 and not (W == 1 and profile.weights_on == "device")
        self.q = q
        # Keep order: weights with a backward use first (a kept chunk saves in every use),
        # then larger slices (more bytes saved per page), then profile order.
        self.order = sorted(range(len(layer.weights)),
                            key=lambda j: (not layer.weights[j].backward, -layer.weights[j].slice_bytes, j))
        self.blocks = []  # (x_start, chunks, received bytes per chunk, backward)
        x = 0
        for j in self.order:
            w = layer.weights[j]
            self.blocks.append((x, w.chunks, q * w.slice_bytes, w.backward))
            x += w.chunks
        self.n = x
        self.ws = [layer.weights[j] for j in self.order]
        self.bwd_segment = any(w.backward for w in layer.weights)  # memory.is_segment of its backward use
        # Where a prefix of the keep order may stop: every chunk, or every eighth of a weight
        # (k = round_half_up(j/8 x n), as the runtime rounds ratios).
        if granularity == "chunks":
            self.stops = None
        else:
            stops = {0}
            for x0, c, _, _ in self.blocks:
                stops.update(x0 + int(j * c / 8 + 0.5) for j in range(9))
            self.stops = tuple(sorted(stops))
        self.sig = (tuple(self.blocks), self.stops, self.f, self.split,
                    tuple((w.chunk_bytes, w.last_bytes) for w in self.ws) if self.split else None)
        tab = tables.get(self.sig)
        if tab is None:
            # Buffers of a use missing every chunk (forward, recompute) or every chunk with a
            # backward use (backward), as the memory model counts them (one definition:
            # memory.use_at); the same for every unit of this signature.
            bufs = (use_at(profile, i, FORWARD, tuple(w.chunks for w in layer.weights), self.f).buffer_bytes,
                    use_at(profile, i, BACKWARD, tuple(w.chunks if w.backward else 0
                                                       for w in layer.weights), self.f).buffer_bytes)
            tab = tables[self.sig] = (self._table(), bufs)
        self.tab, (self.buf_all, self.buf_bwd) = tab

    def _table(self) -> tuple[list[int], list[int], list[int], list[int]]:
        """Per x = 0..n (the first x chunks of the keep order kept): the peer (received) and
        host bytes a forward (or recompute) use misses, then those a backward use misses."""
        f, q = self.f, self.q
        parts = []  # per block: peer and host bytes missing with k = 0..c of it kept
        for (x0, c, _, _), w in zip(self.blocks, self.ws):
            per = q * w.slice_bytes
            if not self.split:
                parts.append(([per * (c - k) for k in range(c + 1)], [0] * (c + 1)))
                continue
            # host_chunk_count(c, k, f) = int(c f) - int(k f), inlined (memory.py); the ragged
            # last chunk is among the missing ones whenever any is (the missing are the last).
            top = int(c * f) if f < 1.0 else c
            ragged = (w.chunk_bytes - w.last_bytes) if is_host_chunk(c - 1, f) else 0
            hosts = [(top - (int(k * f) if f < 1.0 else k)) for k in range(c + 1)]
            parts.append(([per * (c - k - h) for k, h in enumerate(hosts)],
                          [(h * w.chunk_bytes - ragged) if h else 0 for h in hosts]))
        PF, HF, PB, HB = [], [], [], []
        nb = len(self.blocks)
        for bi, ((x0, c, _, bk), (peer, host)) in enumerate(zip(self.blocks, parts)):
            later = range(bi + 1, nb)
            rf = sum(parts[b][0][0] for b in later)
            rh = sum(parts[b][1][0] for b in later)
            rbf = sum(parts[b][0][0] for b in later if self.blocks[b][3])
            rbh = sum(parts[b][1][0] for b in later if self.blocks[b][3])
            lo = 0 if bi == 0 else 1
            PF.extend(p + rf for p in peer[lo:])
            HF.extend(h + rh for h in host[lo:])
            PB.extend((p + rbf for p in peer[lo:]) if bk else (rbf for _ in peer[lo:]))
            HB.extend((h + rbh for h in host[lo:]) if bk else (rbh for _ in host[lo:]))
        if not self.blocks:
            PF, HF, PB, HB = [0], [0], [0], [0]
        return PF, HF, PB, HB

    def missing(self, x) -> tuple[int, int, int, int]:
        """(peer, host) bytes missing in a forward (or recompute) use, then in a backward use,
        after keeping the first x chunks of the keep order (x an int) or keep[j] of weight j
        (x a tuple)."""
        if not isinstance(x, tuple):
            PF, HF, PB, HB = self.tab
            return PF[x], HF[x], PB[x], HB[x]
        pf = hf = pb = hb = 0
        f, q = self.f, self.q
        for (x0, c, _, bk), j, w in zip(self.blocks, self.order, self.ws):
            m = c - x[j]
            if not m:
                continue
            host = host_chunk_count(c, x[j], f) if self.split else 0
            peer = q * w.slice_bytes * (m - host)
            hbytes = w.host_bytes(host, is_host_chunk(c - 1, f)) if host else 0
            pf += peer
            hf += hbytes
            if bk:
                pb += peer
                hb += hbytes
        return pf, hf, pb, hb


def _exposure(glat: float, gbw: float, peer: int, hlat: float, hbw: float, host: int, window: float) -> float:
    """max(0, max(g(peer), h(host)) - window): both sources in flight together (the proxy of
    [Note: the search])."""
    comm = (glat + peer / gbw) if peer > 0 else 0.0
    if host > 0:
        h = hlat + host / hbw
        if h > comm:
            comm = h
    return comm - window if comm > window else 0.0


def _unit_time(u: Unit, x, rec: bool, windows: tuple, links: tuple) -> float:
    """The proxy's exposed time of one unit's uses in one micro-batch after keeping its first
    x chunks (x an int), or keep[j] chunks of weight j (x a tuple)."""
    pf, hf, pb, hb = u.missing(x)
    glat, gbw, hlat, hbw = links
    wf, wr, wb = windows
    t = _exposure(glat, gbw, pf, hlat, hbw, hf, wf) + _exposure(glat, gbw, pb, hlat, hbw, hb, wb)
    if rec:
        t += _exposure(glat, gbw, pf, hlat, hbw, hf, wr)
    return t


def proxy_runs(u: Unit, rec: bool, windows: tuple, links: tuple) -> list[tuple[int, int, float]]:
    """(x0, x1, time saved) runs of a unit under the proxy, merged to save less and less per
    chunk (the upper concave envelope)."""
    if u.stops is not None:
        cuts = list(u.stops)
    else:
        cuts = {0, u.n}
        for x0, c, _, _ in u.blocks:
            cuts.add(x0)
            cuts.add(x0 + c)
        glat, gbw, hlat, hbw = links
        PF, HF, PB, HB = u.tab
        for k, window in enumerate(windows):
            if window is None or (k == 1 and not rec):
                continue
            P, H = (PB, HB) if k == 2 else (PF, HF)
            if _exposure(glat, gbw, P[0], hlat, hbw, H[0], window) <= 0:
                continue
            lo, hi = 0, u.n  # exposure(lo) > 0, exposure(hi) == 0 (non-increasing in x)
            while hi - lo > 1:
                mid = (lo + hi) // 2
                if _exposure(glat, gbw, P[mid], hlat, hbw, H[mid], window) > 0:
                    lo = mid
                else:
                    hi = mid
            cuts.update((lo, hi))
        cuts = sorted(cuts)
    times = [_unit_time(u, x, rec, windows, links) for x in cuts]
    stack: list[list] = []  # [x0, x1, saved]
    for a in range(len(cuts) - 1):
        run = [cuts[a], cuts[a + 1], times[a] - times[a + 1]]
        while stack and run[2] * (stack[-1][1] - stack[-1][0]) > stack[-1][2] * (run[1] - run[0]):
            prev = stack.pop()  # the later run saves more per chunk: merge (concave envelope)
            run = [prev[0], run[1], prev[2] + run[2]]
        stack.append(run)
    return [tuple(r) for r in stack]
