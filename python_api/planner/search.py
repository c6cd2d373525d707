"""The planner: choose residency, recompute, micro-batch and pool budget from a profile.

    plan = plan_from_profile(profile, memory_bytes=40 * 10**9, global_batch=64)
    print(plan.table()); plan.save("plan.json")

[Note: what the planner chooses]
For a fixed global batch G (sequences per optimizer step), the planner picks the micro-batch
m (sequences per rank per micro-batch) and accumulation a with m x a x world_size == G, the
set of recomputed layers, and per weight the chunks kept (k) and persisted (p), minimizing the
cost model's step time (cost.py) under peak <= memory_bytes x (1 - margin) (memory.py).
The pool budget follows: page_bytes x sum_w k_w.

Persisting a kept chunk is free in this model: the pool's arena never shrinks and reaches its
high-water mark at the end of forward, where every kept chunk is alive anyway, while a
persisted chunk also saves the next forward's gather. So the planner persists every chunk it
keeps (p = k). A persist below keep pays off only once the runtime shrinks the budget before
the activation peak and refills it after (evicting persistent chunks in planner order), which
the plan format already allows (`persist_chunks` per weight) but the search does not use.

[Note: the search]
Candidates: every micro-batch m dividing G / world_size (or those given), and for each, the
first R layers of one fixed recompute order (recomputable layers by activation bytes freed per
second of recompute, largest first), R = 0, 1, ... For a candidate, the memory left for kept
chunks is what remains of the limit after reserved + static, the working set and the
activation peak, with communication buffers bounded by their size when every chunk is
missing (so the exact peak of the plan, which has fewer missing chunks, is at most this bound);
the one exception is exact: when every chunk fits with no buffers at all (nothing is gathered),
the candidate keeps everything. Every kept chunk costs one page, so the candidate can keep
K = floor(left / page_bytes) chunks (every chunk when the pool would hold them all).
Activations grow with m, so once no R fits a micro-batch m, no larger m is tried.
Which chunks: within a unit, chunks are taken in a fixed order (weights with a backward use
first, larger slices first), and the unit's time t_i(x) after keeping its first x chunks is
exact under the cost model (each use's exposed gather is max(0, g(D) - window), D the missing
bytes). t_i is cut into runs at weight boundaries and where a use's exposure reaches zero;
adjacent runs are merged where a later run saves more per chunk than an earlier one (the
upper concave envelope), so the runs of a unit save less and less per chunk. All runs of all
units are sorted by time saved per chunk (ties: run index, then unit index) into one order that
does not depend on the memory; a candidate keeps the longest prefix of that order with K
chunks (the last run cut at a chunk, or at an eighth with granularity="eighths"). So for one
candidate more memory only extends the prefix, and its time never increases; the plan is the
fastest candidate, a minimum over a fixed set of non-increasing functions of the memory, so
it is monotone too. Equal layers (the same weights, recompute choice and prefetch windows)
share their runs, which is what makes an 80-layer model plan in a fraction of a second
(Llama-2-70B on 8 ranks: 0.021 s median on a 2-core AMD EPYC, bench/bench_planner.py).
The time a candidate is compared by is the cost model's, exactly (the savings of a unit's
runs telescope to t_i(0) - t_i(x)); the result is evaluated with memory_curve and step_cost
for the report. The greedy is not an exhaustive search: the recomputed layers are a prefix of
one order, not any set, and chunks are taken by a local rate. Against exhaustive search over
small random profiles it was optimal on 449 of 450, one 11.5% slower, by recomputing another
layer (tests/planner/test_planner.py).

[Note: the host dimensions of the search]
When the profile has the host tier (`h2d`), the search also chooses the host fraction (from
HOST_FRACTIONS = {0, 1/4, 1/2, 3/4, 1} when the runtime has a host store at world size > 1;
only 1 with weights_on="host"; only 0 without a store) and activation offload on or off
(when some layer has offloadable activations and the host budget is not 0). Each pair is
one more fixed candidate dimension: for each (f, offload) the search above runs unchanged
with that pair's units (a unit's time and its buffer bound depend on f: host chunks need no
gather buffer and cost max(gather, H2D), [Note: chunk sources and the host link] in cost.py)
and that pair's activations ([Note: activation offload in the memory model]), and the plan
is the fastest over every (f, offload, m, R), ties to the first in the order f ascending,
offload off before on. Each candidate is non-increasing in memory as argued above (with the
source split a unit's missing peer and host bytes are each non-increasing in the chunks
kept, so its time is), and a minimum over a fixed set of such functions is monotone.
With host chunks a unit's missing bytes are not linear in the chunks kept (the Bresenham
spread); the runs are then cut where each use's exposure reaches zero by bisection, and the
partial run a candidate ends in is still evaluated exactly. The prefetch window
(prefetch_depth: segments gathered ahead) is one more dimension when it is not given
(prefetch_depth=None: PREFETCH_DEPTHS, 1 and 2): a deeper window hides more of each gather
behind compute and costs the buffers and working-set pages of one more unit in flight; the
runtime takes the plan's between steps (`ElasticRuntime.set_prefetch_depth`). Each depth is one
more fixed set of candidates, so the minimum stays monotone; it doubles the planning time.
Planning time: ten (f, offload) pairs for weights_on="device" with a store, two with
weights_on="host". Llama-2-70B on 8 ranks (A100 PCIe profile, seq 4096, 40 GB, global batch
64): 0.21 s median with a store and the weights on the device, 0.094 s with weights_on="host"
(2-core AMD EPYC, bench/bench_planner.py, bench/results/planner_host.csv); without the host
tier unchanged (0.021 s). A plan that keeps every chunk may name any host fraction (nothing
is fetched then): the candidate whose conservative buffer bound let it fit first wins.
"""

from __future__ import annotations

import time

from python_api.planner.cost import offload_exposed_s
from python_api.planner.memory import (
    BACKWARD,
    FORWARD,
    Choices,
    Offload,
    effective_host_fraction,
    host_chunk_count,
    is_host_chunk,
    offload_served,
    use_at,
)
from python_api.planner.plan import Plan, PlanningError, plan_of
from python_api.planner.profile import Profile

GRANULARITIES = ("chunks", "eighths")
# The host fractions the search tries when the profile has a host store ([Note: the host
# dimensions of the search]).
HOST_FRACTIONS = (0.0, 0.25, 0.5, 0.75, 1.0)
PREFETCH_DEPTHS = (1, 2)  # the prefetch windows tried when prefetch_depth=None


# ---------------------------------------------------------------- the search

def _exposure(lat: float, bw: float, nbytes: int, window: float) -> float:
    """max(0, g - window) with g the gather time of `nbytes` (as Link.time computes it)."""
    return 0.0 if nbytes <= 0 else max(0.0, (lat + nbytes / bw) - window)


class _Unit:
    """The fixed part of one unit for the search: its keep order and missing-byte curves."""

    __slots__ = ("order", "blocks", "n", "n_bwd", "d_fwd", "d_bwd", "buf_all", "buf_bwd", "sig", "stops",
                 "f", "split", "ws", "hlat", "hbw", "q")

    def __init__(self, profile: Profile, i: int, granularity: str, host_fraction: float = 0.0):
        layer = profile.layers[i]
        W = profile.world_size
        q = W - 1 if not (W == 1 and profile.weights_on == "device") else 0
        # The source split ([Note: chunk sources and the host link] in cost.py): with host
        # chunks a unit's missing bytes are no longer linear in the chunks kept.
        self.f = effective_host_fraction(profile, host_fraction)
        self.split = self.f > 0 and not (W == 1 and profile.weights_on == "device")
        self.q = q
        self.hlat, self.hbw = (profile.h2d.latency_s, profile.h2d.bytes_per_s) if profile.h2d is not None \
            else (0.0, 1.0)
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
        self.n_bwd = sum(layer.weights[j].chunks for j in self.order if layer.weights[j].backward)
        self.d_fwd = sum(c * b for _, c, b, _ in self.blocks)  # received bytes of a use missing every chunk
        self.d_bwd = sum(c * b for _, c, b, bk in self.blocks if bk)
        # Buffers of a use missing every chunk (forward, recompute) or every chunk with a
        # backward use (backward), as the memory model counts them (one definition: memory.use_at).
        self.buf_all = use_at(profile, i, FORWARD, tuple(w.chunks for w in layer.weights), self.f).buffer_bytes
        self.buf_bwd = use_at(profile, i, BACKWARD, tuple(w.chunks if w.backward else 0
                                                         for w in layer.weights), self.f).buffer_bytes
        self.ws = [layer.weights[j] for j in self.order]
        # Where a prefix of the keep order may stop: every chunk, or every eighth of a weight
        # (k = round_half_up(j/8 x n), as the runtime rounds ratios).
        if granularity == "chunks":
            self.stops = None
        else:
            stops = {0}
            for x0, c, _, _ in self.blocks:
                stops.update(x0 + int(j * c / 8 + 0.5) for j in range(9))
            self.stops = tuple(sorted(stops))
        self.sig = (tuple(self.blocks), self.stops, self.f,
                    tuple(w.last_bytes for w in self.ws) if self.split else None)

    def missing_split(self, x) -> tuple[int, int, int, int]:
        """(peer bytes, host bytes) missing in a forward (or recompute) use, then in a backward
        use, after keeping the first x chunks (x an int) or keep[j] of weight j (x a tuple)."""
        pf = hf = pb = hb = 0
        f, q = self.f, self.q
        for (x0, c, _, bk), j, w in zip(self.blocks, self.order, self.ws):
            k = keep_of(x, x0, c, j)
            m = c - k
            if not m:
                continue
            host = host_chunk_count(c, k, f)
            peer = q * w.slice_bytes * (m - host)
            hbytes = w.host_bytes(host, is_host_chunk(c - 1, f)) if host else 0
            pf += peer
            hf += hbytes
            if bk:
                pb += peer
                hb += hbytes
        return pf, hf, pb, hb

    def removed_by_weight(self, keep: tuple[int, ...]) -> tuple[int, int]:
        """Received bytes no longer missing (forward, backward) when weight j keeps keep[j]."""
        rf = rb = 0
        for (x0, c, b, bk), j in zip(self.blocks, self.order):
            rf += keep[j] * b
            if bk:
                rb += keep[j] * b
        return rf, rb

    def removed(self, x: int) -> tuple[int, int]:
        """Received bytes no longer missing (forward, backward) after keeping x chunks."""
        rf = rb = 0
        for x0, c, b, bk in self.blocks:
            if x <= x0:
                break
            take = min(c, x - x0) * b
            rf += take
            if bk:
                rb += take
        return rf, rb


def keep_of(x, x0: int, c: int, j: int) -> int:
    """Chunks kept of the weight at keep-order block (x0, c), weight index j."""
    return x[j] if isinstance(x, tuple) else max(0, min(c, x - x0))


def _exposure2(lat: float, bw: float, peer: int, hlat: float, hbw: float, host: int, window: float) -> float:
    """max(0, max(g(peer), h(host)) - window): both sources in flight together."""
    comm = (lat + peer / bw) if peer > 0 else 0.0
    if host > 0:
        comm = max(comm, hlat + host / hbw)
    return max(0.0, comm - window)


def _unit_time(u: _Unit, x, rec: bool, windows: tuple, lat: float, bw: float) -> float:
    """Exposed gather time of one unit's uses in one micro-batch after keeping its first x
    chunks (x an int), or keep[j] chunks of weight j (x a tuple)."""
    if u.split:
        pf, hf, pb, hb = u.missing_split(x)
        wf, wr, wb = windows
        t = _exposure2(lat, bw, pf, u.hlat, u.hbw, hf, wf) + _exposure2(lat, bw, pb, u.hlat, u.hbw, hb, wb)
        if rec:
            t += _exposure2(lat, bw, pf, u.hlat, u.hbw, hf, wr)
        return t
    rf, rb = u.removed(x) if isinstance(x, int) else u.removed_by_weight(x)
    wf, wr, wb = windows
    t = _exposure(lat, bw, u.d_fwd - rf, wf) + _exposure(lat, bw, u.d_bwd - rb, wb)
    if rec:
        t += _exposure(lat, bw, u.d_fwd - rf, wr)
    return t


def _runs(u: _Unit, rec: bool, windows: tuple, lat: float, bw: float) -> list[tuple[int, int, float]]:
    """(x0, x1, time saved) runs of a unit, merged to save less and less per chunk."""
    if u.stops is not None:
        cuts = list(u.stops)
    elif u.split:
        # Where each use's exposure reaches zero, by bisection (it is non-increasing in x).
        cuts = {0, u.n}
        for x0, c, _, _ in u.blocks:
            cuts.add(x0)
            cuts.add(x0 + c)
        for k, window in enumerate(windows):
            if window is None:
                continue
            def exp(x, k=k, window=window):
                pf, hf, pb, hb = u.missing_split(x)
                if k == 2:
                    return _exposure2(lat, bw, pb, u.hlat, u.hbw, hb, window)
                return _exposure2(lat, bw, pf, u.hlat, u.hbw, hf, window)
            if exp(0) <= 0:
                continue
            lo, hi = 0, u.n  # exp(lo) > 0, exp(hi) == 0
            while hi - lo > 1:
                mid = (lo + hi) // 2
                if exp(mid) > 0:
                    lo = mid
                else:
                    hi = mid
            cuts.update((lo, hi))
        cuts = sorted(cuts)
    else:
        cuts = {0, u.n}
        for x0, c, b, bk in u.blocks:
            cuts.add(x0)
            cuts.add(x0 + c)
        # where a use's exposure reaches zero: missing bytes D with lat + D/bw <= window
        for window, base, bwd_only in ((windows[0], u.d_fwd, False), (windows[1], u.d_fwd, False),
                                       (windows[2], u.d_bwd, True)):
            if window is None:
                continue
            target = base - (window - lat) * bw  # bytes to remove to hide the gather
            if target <= 0:
                continue
            removed = 0
            for x0, c, b, bk in u.blocks:
                if bwd_only and not bk:
                    break
                if removed + c * b >= target:
                    x = x0 + int(-(-(target - removed) // b))
                    cuts.update((max(x0, x - 1), min(x0 + c, x)))
                    break
                removed += c * b
        cuts = sorted(cuts)
    times = [_unit_time(u, x, rec, windows, lat, bw) for x in cuts]
    stack: list[list] = []  # [x0, x1, saved]
    for a in range(len(cuts) - 1):
        run = [cuts[a], cuts[a + 1], times[a] - times[a + 1]]
        while stack and run[2] * (stack[-1][1] - stack[-1][0]) > stack[-1][2] * (run[1] - run[0]):
            prev = stack.pop()  # the later run saves more per chunk: merge (concave envelope)
            run = [prev[0], run[1], prev[2] + run[2]]
        stack.append(run)
    return [tuple(r) for r in stack]


def _recompute_order(profile: Profile) -> list[int]:
    """Recomputable layers that free memory, by bytes freed per second of recompute."""
    def key(i):
        layer = profile.layers[i]
        cost = layer.fwd_s_per_token * profile.seq_len + layer.fwd_s_fixed
        freed = layer.act_bytes_per_token - layer.input_bytes_per_token
        return (-(freed / cost) if cost > 0 else float("-inf"), i)

    cand = [i for i, layer in enumerate(profile.layers)
            if layer.recomputable and layer.act_bytes_per_token > layer.input_bytes_per_token]
    return sorted(cand, key=key)


def _micro_batch_candidates(per_rank: int, micro_batches) -> list[int]:
    divisors = [m for m in range(1, per_rank + 1) if per_rank % m == 0]
    if micro_batches is None:
        return divisors
    given = [micro_batches] if isinstance(micro_batches, int) and not isinstance(micro_batches, bool) \
        else list(micro_batches)
    for m in given:
        if not isinstance(m, int) or isinstance(m, bool) or m < 1:
            raise PlanningError(f"micro_batches: expected positive ints, got {m!r}")
        if per_rank % m:
            raise PlanningError(f"micro-batch {m} does not divide global_batch / world_size = {per_rank}")
    return sorted(set(given))


class _Search:
    """One planning problem: the profile's fixed parts, evaluated per candidate (m, R)."""

    def __init__(self, profile: Profile, prefetch_depth: int, granularity: str, host_fraction: float = 0.0,
                 offload: bool = False):
        self.p = profile
        self.d = prefetch_depth
        self.f, self.offload = host_fraction, offload
        self.units = [_Unit(profile, i, granularity, host_fraction) for i in range(len(profile.layers))]
        self.lat, self.bw = profile.allgather.latency_s, profile.allgather.bytes_per_s
        self.total = profile.total_chunks
        self.ws = profile.working_set_pages(prefetch_depth)
        self.page = profile.page_bytes
        self.fixed = profile.reserved_bytes + profile.static_bytes
        self.rec_order = _recompute_order(profile)
        self.run_cache: dict = {}
        self._offload_cache: dict = {}
        self.keep_only = None  # fixed residency (baselines): per unit, chunks kept
        self.act_per_token = [layer.act_bytes_per_token for layer in profile.layers]
        self.input_per_token = [layer.input_bytes_per_token for layer in profile.layers]
        fbuf = [u.buf_all for u in self.units]
        self.fwd_window_buffers = [sum(fbuf[i : i + 1 + prefetch_depth]) for i in range(len(fbuf))]

    # -------------------------------------------------------- activation peak (conservative)

    def act_peak(self, T: int, rec: list[bool], buffers: bool = True) -> int:
        """memory_curve's peak minus fixed and pool, with every chunk missing (FSDP buffers), or
        with none missing (`buffers=False`: no buffers): the same integer arithmetic as
        memory.memory_curve."""
        return self.act_peaks(T, rec)[0 if buffers else 1]

    def act_peaks(self, T: int, rec: list[bool]) -> tuple[int, int]:
        """act_peak with and without buffers, in one pass."""
        p, d, units = self.p, self.d, self.units
        layers = p.layers
        acts = [int(a * T) for a in self.act_per_token]
        off = self.offload_of(T, rec)
        saved = [(int(x * T) if r else a) - cr for x, r, a, cr in zip(self.input_per_token, rec, acts, off.credit)]
        fwin = self.fwd_window_buffers
        best = best0 = 0
        before = 0
        for i in range(len(layers)):
            v = before + acts[i]
            if v + fwin[i] > best:
                best = v + fwin[i]
            if v > best0:
                best0 = v
            before += saved[i]
        end = before + int(p.outside.peak_bytes_per_token * T)
        best, best0 = max(best, end), max(best0, end)
        workspace = int(p.outside.workspace_bytes_per_token * T)
        rworkspace = int(p.outside.recompute_workspace_bytes_per_token * T)
        seq = []  # (layer, buffer, is the backward use) of the backward-phase uses
        for i in reversed(range(len(layers))):
            if rec[i]:
                seq.append((i, units[i].buf_all, False))
            seq.append((i, units[i].buf_bwd, True))
        prefix = [0]
        for _, b, _ in seq:
            prefix.append(prefix[-1] + b)
        n_seq = len(seq)
        for j, (i, _, is_bwd) in enumerate(seq):
            if j == 0 or seq[j - 1][0] != i:
                before -= saved[i]
            window = prefix[min(n_seq, j + 1 + d)] - prefix[j]
            v = before + acts[i] + (saved[i] if rec[i] else 0) + off.prev[i] \
                + ((workspace + off.moved[i] - off.credit[i]) if is_bwd else 0) \
                + (rworkspace if is_bwd and rec[i] else 0)
            if v + window > best:
                best = v + window
            if v > best0:
                best0 = v
        out_act = int(p.outside.act_bytes_per_token * T)
        return out_act + best, out_act + best0

    def offload_of(self, T: int, rec: list[bool]):
        """memory.offload_served for this candidate; without a host budget (every request
        served) from per-layer sums cached per micro-batch, the same integers."""
        p = self.p
        if not self.offload or p.host_budget_bytes is not None:
            return offload_served(p, T, rec, self.offload)
        per = self._offload_cache.get(T)
        if per is None:
            per = []
            for layer in p.layers:
                m = sum(int(round(b * T)) for b in layer.offload_tensors_bytes_per_token)
                per.append((m, min(int(layer.offload_freed_bytes_per_token * T), int(layer.act_bytes_per_token * T))
                            if m else 0))
            self._offload_cache[T] = per
        moved, credit, prev = [], [], []
        last = 0
        for (m, c), r in zip(per, rec):
            prev.append(last)
            if r or not m:
                moved.append(0)
                credit.append(0)
            else:
                moved.append(m)
                credit.append(c)
                last = m
        return Offload(tuple(moved), tuple(credit), tuple(prev))

    # -------------------------------------------------------- windows

    def windows(self, T: int, rec: list[bool]) -> tuple[list[tuple], list[float]]:
        """Per unit, the prefetch windows of its (forward, recompute, backward) uses (None when
        the use does not exist), as cost.exposed_s sums them; and the compute of every use."""
        layers, d = self.p.layers, self.d
        L = len(layers)
        fc = [layer.fwd_s(T) for layer in layers]
        wf = [sum(fc[max(0, i - d) : i]) for i in range(L)]
        bseq, bc = [], []
        for i in reversed(range(L)):
            if rec[i]:
                bseq.append((i, 1))
                bc.append(fc[i])
            bseq.append((i, 2))
            bc.append(layers[i].bwd_s(T))
        wr: list = [None] * L
        wb = [0.0] * L
        for j, (i, kind) in enumerate(bseq):
            w = sum(bc[max(0, j - d) : j])
            if kind == 1:
                wr[i] = w
            else:
                wb[i] = w
        return [(wf[i], wr[i], wb[i]) for i in range(L)], fc + bc

    # -------------------------------------------------------- one candidate

    def evaluate(self, m: int, rec: list[bool], limit: int):
        """(time per micro-batch, kept chunks per unit, shortfall) of candidate (m, rec)."""
        p = self.p
        T = m * p.seq_len
        act, act_no_buffers = self.act_peaks(T, rec)
        avail = limit - self.fixed - act
        min_pool = min(self.ws, self.total) * self.page
        # Exact, not bounded: with every chunk kept nothing is gathered and no buffer exists.
        all_kept = self.fixed + self.total * self.page + act_no_buffers
        if self.keep_only is not None and sum(sum(ks) for ks in self.keep_only) < self.total:
            all_kept = limit + max(1, min_pool - avail)  # not a candidate under a given residency
        if all_kept <= limit:
            budget = self.total
        elif avail < min_pool:
            return None, None, min(min_pool - avail, all_kept - limit)
        elif avail >= self.total * self.page:
            budget = self.total
        else:
            budget = avail // self.page - self.ws
        windows, compute = self.windows(T, rec)
        units = self.units
        lat, bw = self.lat, self.bw
        base = sum(compute) + (p.outside.fwd_s_per_token + p.outside.bwd_s_per_token) * T \
            + offload_exposed_s(p, T, rec, self.offload, self.offload_of(T, rec) if self.offload else None)
        if self.keep_only is not None:  # fixed residency: feasible only if it fits
            kept = sum(sum(ks) for ks in self.keep_only)
            if kept > budget:
                return None, None, (kept - budget) * self.page
            t = base + sum(_unit_time(u, ks, rec[i], windows[i], lat, bw)
                           for i, (u, ks) in enumerate(zip(units, self.keep_only)))
            return t, list(self.keep_only), 0
        # Group equal units: same structure, recompute choice and windows give the same runs.
        groups: dict = {}
        for i, u in enumerate(units):
            key = (u.sig, rec[i], windows[i])
            g = groups.get(key)
            if g is None:
                groups[key] = [i]
            else:
                g.append(i)
        entries = []
        zero = 0.0
        for key, members in groups.items():
            i0 = members[0]
            u = units[i0]
            ckey = (key, lat, bw)
            runs = self.run_cache.get(ckey)
            if runs is None:
                runs = _runs(u, rec[i0], windows[i0], lat, bw)
                t0 = _unit_time(u, 0, rec[i0], windows[i0], lat, bw)
                runs = (runs, t0)
                self.run_cache[ckey] = runs
            zero += runs[1] * len(members)
            for j, (x0, x1, saved) in enumerate(runs[0]):
                entries.append((-(saved / (x1 - x0)), j, i0, x0, x1, saved, members))
        entries.sort(key=lambda e: e[:3])
        kept = [0] * len(units)
        left = budget
        saved_total = 0.0
        for _, _, i0, x0, x1, saved, members in entries:
            c = x1 - x0
            full = min(len(members), left // c)
            for i in members[:full]:
                kept[i] = x1
            saved_total += full * saved
            left -= full * c
            if full < len(members):
                i = members[full]
                u = units[i]
                x = x0 + left
                if u.stops is not None:
                    x = max(s for s in u.stops if s <= x)
                if x > x0:
                    kept[i] = x
                    saved_total += (_unit_time(u, x0, rec[i], windows[i], lat, bw)
                                    - _unit_time(u, x, rec[i], windows[i], lat, bw))
                break
        return base + zero - saved_total, kept, 0

    def choices(self, m: int, rec: list[bool], kept: list) -> Choices:
        """Choices keeping, per unit, its first kept[i] chunks (or, with a given residency,
        kept[i][j] chunks of weight j); every kept chunk persists ([Note: what the planner
        chooses])."""
        if self.keep_only is not None:
            keep = tuple(tuple(ks) for ks in kept)
            return Choices(m, keep, keep, tuple(rec), self.d, self.f, self.offload)
        keep = []
        for i, (u, x) in enumerate(zip(self.units, kept)):
            ks = [0] * len(u.order)
            for (x0, c, _, _), j in zip(u.blocks, u.order):
                ks[j] = max(0, min(c, x - x0))
            keep.append(tuple(ks))
        keep = tuple(keep)
        return Choices(m, keep, keep, tuple(rec), self.d, self.f, self.offload)


def _check_args(profile, memory_bytes, global_batch, margin, prefetch_depth, granularity):
    if not isinstance(profile, Profile):
        raise TypeError(f"profile must be a Profile, got {type(profile).__name__}")
    for name, v in (("memory_bytes", memory_bytes), ("global_batch", global_batch)):
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise PlanningError(f"{name} must be a positive int, got {v!r}")
    if memory_bytes > profile.capacity_bytes:
        raise PlanningError(f"memory_bytes ({memory_bytes}) exceeds the profile's capacity_bytes "
                            f"({profile.capacity_bytes}) on {profile.device}")
    if isinstance(margin, bool) or not isinstance(margin, (int, float)) or not 0 <= margin < 1:
        raise PlanningError(f"margin must be a number in [0, 1), got {margin!r}")
    depths = PREFETCH_DEPTHS if prefetch_depth is None else (
        prefetch_depth if isinstance(prefetch_depth, (tuple, list)) else (prefetch_depth,))
    if not depths:
        raise PlanningError("prefetch_depth: an empty sequence of depths")
    for d in depths:
        if not isinstance(d, int) or isinstance(d, bool) or d < 0:
            raise PlanningError(f"prefetch_depth must be None, an int >= 0 or a sequence of them, got {prefetch_depth!r}")
    if granularity not in GRANULARITIES:
        raise PlanningError(f"granularity must be one of {GRANULARITIES}, got {granularity!r}")
    if global_batch % profile.world_size:
        raise PlanningError(f"global_batch {global_batch} is not a multiple of world_size {profile.world_size}: "
                            "every rank runs the same micro-batches")


def host_candidates(profile: Profile, host_fractions=None, offload=None) -> list[tuple[float, bool]]:
    """The (host fraction, activation offload) pairs the search tries ([Note: the host
    dimensions of the search]), in the fixed order ties are broken by."""
    if profile.h2d is None:
        fractions, offloads = (0.0,), (False,)
    else:
        if profile.weights_on == "host":
            fractions = (1.0,)
        elif profile.host_store and profile.world_size > 1:
            fractions = HOST_FRACTIONS
        else:
            fractions = (0.0,)
        can_offload = any(layer.offload_tensors_bytes_per_token for layer in profile.layers) \
            and profile.host_budget_bytes != 0
        offloads = (False, True) if can_offload else (False,)
    if host_fractions is not None:
        given = [host_fractions] if isinstance(host_fractions, (int, float)) else list(host_fractions)
        for f in given:
            if isinstance(f, bool) or not isinstance(f, (int, float)) or not 0.0 <= f <= 1.0:
                raise PlanningError(f"host_fractions: expected numbers in [0, 1], got {f!r}")
            if f > 0 and profile.weights_on == "device" and not profile.host_store:
                raise PlanningError(f"host fraction {f} needs a host store; the profile has none (wrap with "
                                    "host_fraction > 0 or weights_on='host' and profile again)")
            if profile.weights_on == "host" and f != 1.0:
                raise PlanningError(f'host fraction {f}: with weights_on="host" every chunk comes from the host store')
        fractions = tuple(sorted(set(float(f) for f in given)))
    if offload is not None:
        if not isinstance(offload, bool):
            raise PlanningError(f"offload must be None, True or False, got {offload!r}")
        if offload and profile.h2d is None:
            raise PlanningError("activation offload needs a profile with the host link (h2d)")
        offloads = (offload,)
    return [(f, o) for f in fractions for o in offloads]


def _search(profile, memory_bytes, global_batch, micro_batches, margin, prefetch_depth, granularity,
            keep_only=None, host_fractions=None, offload=None) -> Plan:
    t_start = time.perf_counter()
    _check_args(profile, memory_bytes, global_batch, margin, prefetch_depth, granularity)
    per_rank = global_batch // profile.world_size
    limit = int(memory_bytes * (1.0 - margin))
    best = None  # (time, search, m, rec, kept)
    shortfall = None
    L = len(profile.layers)
    candidates = _micro_batch_candidates(per_rank, micro_batches)
    depths = PREFETCH_DEPTHS if prefetch_depth is None else (
        tuple(prefetch_depth) if isinstance(prefetch_depth, (tuple, list)) else (prefetch_depth,))
    for d, (f, off) in [(d, fo) for d in depths for fo in host_candidates(profile, host_fractions, offload)]:
        s = _Search(profile, d, granularity, f, off)
        s.keep_only = keep_only
        for m in candidates:
            rec = [False] * L
            fits = False
            for R in range(len(s.rec_order) + 1):
                if R:
                    rec[s.rec_order[R - 1]] = True
                t, kept, short = s.evaluate(m, rec, limit)
                if t is None:
                    shortfall = short if shortfall is None else min(shortfall, short)
                    continue
                fits = True
                t_step = (per_rank // m) * t
                if best is None or t_step < best[0]:
                    best = (t_step, s, m, list(rec), kept)
                if sum(sum(k) if isinstance(k, tuple) else k for k in kept) >= s.total:
                    break  # everything kept: recomputing more only adds time
            if not fits:
                break  # activations grow with the micro-batch: a larger one cannot fit either
    if best is None:
        raise PlanningError(
            f"no plan fits in memory_bytes x (1 - margin) = {limit} bytes per rank: the smallest plan "
            f"({'the given residency' if keep_only is not None else 'every chunk TRANSIENT, or every chunk kept'}, "
            f"micro-batch and recomputed layers chosen to fit) needs {limit + shortfall} bytes: short by "
            f"{shortfall} bytes"
        )
    _, s, m, rec, kept = best
    choices = s.choices(m, rec, kept)
    return plan_of(profile, choices, memory_bytes=memory_bytes, global_batch=global_batch,
                   planning_seconds=time.perf_counter() - t_start)


def plan_from_profile(profile: Profile, memory_bytes: int, global_batch: int, *, micro_batches=None,
                      margin: float = 0.05, prefetch_depth=1, granularity: str = "chunks",
                      host_fractions=None, offload=None) -> Plan:
    """The fastest plan under the cost model whose peak stays within memory_bytes x (1 -
    margin) ([Note: the search]).

    memory_bytes   device memory per rank the plan may use (at most profile.capacity_bytes);
                   the peak counts reserved and static bytes too.
    global_batch   sequences per optimizer step over all ranks: micro_batch x accumulation x
                   world_size.
    micro_batches  None: every divisor of global_batch / world_size; an int or a sequence:
                   only those micro-batch sizes.
    granularity    "chunks": keep counts are any chunk count; "eighths": round_half_up(j/8 x
                   n) for j = 0..8, per weight.
    prefetch_depth an int (the runtime's window, fixed), a sequence of them, or None:
                   PREFETCH_DEPTHS searched ([Note: the host dimensions of the search]).
    host_fractions None: HOST_FRACTIONS when the profile has a host store (only 1 with
                   weights_on="host"), else 0; a number or a sequence: only those.
    offload        None: activation offload on and off are both tried when the profile has
                   the host link and offloadable activations; True / False: only that.
    Raises PlanningError naming the shortfall in bytes when nothing fits.
    """
    return _search(profile, memory_bytes, global_batch, micro_batches, margin, prefetch_depth, granularity,
                   host_fractions=host_fractions, offload=offload)


def least_memory(profile: Profile, global_batch: int, **kwargs) -> int:
    """The least `memory_bytes` for which `plan_from_profile(profile, memory_bytes,
    global_batch, **kwargs)` finds a plan: a bisection (feasibility is monotone in memory) up
    to the profile's capacity. Raises PlanningError when nothing fits even there."""
    lo, hi = 1, profile.capacity_bytes
    plan_from_profile(profile, hi, global_batch, **kwargs)
    while lo < hi:
        mid = (lo + hi) // 2
        try:
            plan_from_profile(profile, mid, global_batch, **kwargs)
            hi = mid
        except PlanningError:
            lo = mid + 1
    return lo


def plan_with_residency(profile: Profile, memory_bytes: int, global_batch: int, keep: list[list[int]], *,
                        micro_batches=None, margin: float = 0.05, prefetch_depth: int = 1, host_fractions=None,
                        offload=None) -> Plan:
    """A plan whose per-weight kept (= persisted) chunk counts are given (`keep[layer][weight]`,
    e.g. all zero for FSDP/ZeRO-3 or whole small weights for a static persistence threshold);
    the micro-batch and the recomputed layers are searched as in `plan_from_profile`. For the
    baselines of bench/simulate_mtuner.py."""
    if len(keep) != len(profile.layers):
        raise PlanningError(f"keep covers {len(keep)} layers, the profile has {len(profile.layers)}")
    keep_only = []
    for i, (layer, ks) in enumerate(zip(profile.layers, keep)):
        ks = tuple(ks)
        if len(ks) != len(layer.weights) or any(
                isinstance(k, bool) or not isinstance(k, int) or not 0 <= k <= w.chunks
                for k, w in zip(ks, layer.weights)):
            raise PlanningError(f"keep[{i}] ({layer.name}) must give 0..chunks for each of its "
                                f"{len(layer.weights)} weights, got {ks!r}")
        keep_only.append(ks)
    return _search(profile, memory_bytes, global_batch, micro_batches, margin, prefetch_depth, "chunks",
                   keep_only=keep_only, host_fractions=host_fractions, offload=offload)
