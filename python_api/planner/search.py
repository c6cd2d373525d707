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
keeps (p = k). A persist below keep (or a chunk kept across iterations but not through the
activation peak) pays off only once the runtime shrinks the arena before the peak and refills
it after; the runtime does not (the PagePool releases only whole empty segments, and nothing
evicts before a predicted peak), so neither does the plan.

[Note: the search]
Candidates: the prefetch depth d (given, or PREFETCH_DEPTHS), the host fraction f and
activation offload on/off ([Note: the host dimensions of the search]), every micro-batch m
dividing G / world_size (or those given), and the first R layers of one fixed recompute
order (recomputable layers by activation bytes freed per second of recompute, largest
first), R = 0, 1, ... Every candidate is judged by the cost model itself, exactly: the
search's estimate of a candidate is `simulate_micro_batch` (cost.py) on that candidate's
choices, so the reported step time is the model's and the plan is the fastest candidate by
it (ties to the first in the order d, f ascending, offload off before on, m, R).
Which chunks a candidate keeps (its *proposal*): the memory left for kept chunks is what
remains of the limit after reserved + static, the working set and the activation peak,
with communication buffers bounded by their size when every chunk is missing (so the exact
peak of the plan, which has fewer missing chunks, is at most this bound); the one exception
is exact: when every chunk fits with no buffers at all (nothing is gathered), the candidate
keeps everything. Every kept chunk costs one page, so the candidate can keep K =
floor(left / page_bytes) chunks (every chunk when the pool would hold them all). The K
chunks are chosen by a separable proxy of the time: each use's exposed transfer is taken as
max(0, max(gather, host copy) - window), the window being the compute of the d uses before
it in its phase, as if the use had the links to itself (exact for d = 1 with no host tier;
optimistic with queueing, which the final judgement by the model corrects). Within a unit,
chunks are taken in a fixed order (weights with a backward use first, larger slices first),
and the unit's proxy time after keeping its first x chunks (a table of missing bytes per x,
shared by equal units) is cut into runs at weight boundaries and where a use's proxy
exposure reaches zero (bisection: it is non-increasing in x); adjacent runs are merged where
a later run saves more per chunk than an earlier one (the upper concave envelope), and all
runs of all units are sorted by time saved per chunk (ties: run index, then unit index) into
one order that does not depend on the memory; the proposal is the longest prefix of that
order with K chunks (the last run cut at a chunk, or at an eighth with
granularity="eighths").
Monotone: more memory only extends a candidate's prefix (a superset of chunks kept), and the
model's time is a max-plus expression in which fewer missing bytes never make anything later
(cost.py), so each candidate's time is non-increasing in the memory; the plan is a minimum
over a fixed set of such functions, so it is monotone too.
Pruning, exact (it never changes the result): (1) a candidate's compute alone (every use's
compute, the outside, the recomputes, x accumulation, + the all-reduce) is a lower bound of
its step time and grows with R, so once it exceeds the best step time found, larger R are
not visited; (2) the end-of-forward point alone (every saved activation, offload credited
in full, the outside's activations and peak) bounds the activation peak from below in O(1)
per R, so a candidate it proves infeasible skips the exact memory pass, unless its shortfall
could still be the one a refusal reports; (3) where no R fits micro-batch m, no larger m fits
(activations grow with m); (4) a candidate that keeps every chunk without offload ends its R
loop (recomputing more only adds compute). Planning time, Llama-2-70B, 80 layers, 8 ranks,
seq 4096, global batch 64, every dimension searched (d in {1, 2}, five host fractions,
offload on/off), H100-80G profile with +-1% per-layer timing jitter: see bench/bench_planner.py
(rows in bench/results/planner_jitter.csv).
The greedy is not an exhaustive search: the recomputed layers are a prefix of one order, not
any set, and chunks are taken by the proxy's local rate. Against exhaustive search over small
random profiles (every micro-batch, recompute set and kept count per weight, judged by the
same models; re-measured 2026-12-01): without the host tier at depth 1, optimal on 449 of
450, one 11.5% slower; with every dimension (depth 1 and 2, host fractions, offload) at
memory below keeping everything, optimal on 177 of 180, worst 17.2%; every miss recomputes
another layer than the best (tests/planner/test_planner.py, test_close_to_exhaustive_*).

[Note: the host dimensions of the search]
When the profile has the host tier (`h2d`), the search also chooses the host fraction (from
HOST_FRACTIONS = {0, 1/4, 1/2, 3/4, 1} when the runtime has a host store at world size > 1;
only 1 with weights_on="host"; only 0 without a store) and activation offload on or off
(when some layer has offloadable activations and the host budget is not 0). Each pair is
one more fixed candidate dimension: a unit's missing peer and host bytes depend on f (host
chunks need no gather buffer and go over the H2D link, [Note: chunk sources and the host
link] in cost.py; with host chunks a unit's missing bytes are not linear in the chunks kept,
the Bresenham spread, which the per-x tables handle), and offload changes the activation
peak ([Note: activation offload in the memory model]) and the time (the copies share the
H2D link: [Note: activation copies in the time model]); the proposal's runs do not depend on
offload, so both offload choices share them. Each candidate is non-increasing in memory as
argued above, and a minimum over a fixed set of such functions is monotone. The prefetch
window (prefetch_depth: segments gathered ahead) is one more dimension when it is not given
(prefetch_depth=None: PREFETCH_DEPTHS, 1 and 2): a deeper window lets the links run ahead of
compute where a use's gather is short, at the cost of the buffers and working-set pages of
one more unit in flight; with the links as queues it is no longer two windows' worth of
compute per gather, so it is chosen only where the model says it pays. The runtime takes
the plan's between steps (`ElasticRuntime.set_prefetch_depth`). A plan that keeps every
chunk may name any host fraction (nothing is fetched then): the candidate whose conservative
buffer bound let it fit first wins.
"""

from __future__ import annotations

import time
from bisect import bisect_left, insort
from itertools import accumulate
from operator import add

from .cost import ActivationEvents, activation_events, simulate_micro_batch
from .memory import (
    BACKWARD,
    FORWARD,
    Choices,
    Offload,
    effective_host_fraction,
    host_chunk_count,
    is_host_chunk,
    offload_served,
    per_linear,
    use_at,
)
from .plan import Plan, PlanningError, plan_of
from .profile import Profile

GRANULARITIES = ("chunks", "eighths")
# The host fractions the search tries when the profile has a host store ([Note: the host
# dimensions of the search]).
HOST_FRACTIONS = (0.0, 0.25, 0.5, 0.75, 1.0)
PREFETCH_DEPTHS = (1, 2)  # the prefetch windows tried when prefetch_depth=None


# ---------------------------------------------------------------- units


class _Unit:
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


def _unit_time(u: _Unit, x, rec: bool, windows: tuple, links: tuple) -> float:
    """The proxy's exposed time of one unit's uses in one micro-batch after keeping its first
    x chunks (x an int), or keep[j] chunks of weight j (x a tuple)."""
    pf, hf, pb, hb = u.missing(x)
    glat, gbw, hlat, hbw = links
    wf, wr, wb = windows
    t = _exposure(glat, gbw, pf, hlat, hbw, hf, wf) + _exposure(glat, gbw, pb, hlat, hbw, hb, wb)
    if rec:
        t += _exposure(glat, gbw, pf, hlat, hbw, hf, wr)
    return t


def _runs(u: _Unit, rec: bool, windows: tuple, links: tuple) -> list[tuple[int, int, float]]:
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


def _recompute_order(profile: Profile) -> list[int]:
    """Recomputable layers that free memory, by bytes freed per second of recompute."""
    def key(i):
        layer = profile.layers[i]
        cost = layer.fwd_s(profile.seq_len)  # a recompute's dequantization included
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


class _Candidate:
    """What a (micro-batch, recompute set) shares across offload on/off: windows, compute,
    the proposal's sorted runs."""

    __slots__ = ("m", "T", "rec", "windows", "fc", "bseq", "bc", "compute", "entries", "zero")


class _Search:
    """One planning problem at one (prefetch depth, host fraction): the profile's fixed parts,
    evaluated per candidate (micro-batch, recompute set, offload)."""

    def __init__(self, profile: Profile, prefetch_depth: int, granularity: str, host_fraction: float = 0.0,
                 tables: dict | None = None, events: dict | None = None):
        self.p = profile
        self.events = {} if events is None else events
        self.d = prefetch_depth
        self.f = host_fraction
        tables = {} if tables is None else tables
        self.units = [_Unit(profile, i, granularity, host_fraction, tables) for i in range(len(profile.layers))]
        gl = profile.gather_link()
        h2d = profile.h2d
        self.links = (gl.latency_s, gl.bytes_per_s) + ((h2d.latency_s, h2d.bytes_per_s) if h2d is not None
                                                      else (0.0, 1.0))
        self.gl, self.h2d = gl, h2d
        self.total = profile.total_chunks
        self.ws = profile.working_set_pages(prefetch_depth)
        self.page = profile.page_bytes
        self.fixed = profile.reserved_bytes + profile.static_bytes
        self.rec_order = _recompute_order(profile)
        self.run_cache: dict = {}
        self._order: dict = {}  # micro-batch -> (per unit (rec, windows), sorted run entries)
        self._offload_cache: dict = {}
        self._no_offload = None
        self._eof: dict = {}
        self.keep_only = None  # fixed residency (baselines): per unit, chunks kept
        self.act_per_token = [layer.act_bytes_per_token for layer in profile.layers]
        self.input_per_token = [layer.input_bytes_per_token for layer in profile.layers]
        fbuf = [u.buf_all for u in self.units]
        self.fwd_window_buffers = [sum(fbuf[i : i + 1 + prefetch_depth]) for i in range(len(fbuf))]
        self.buf_all, self.buf_bwd = fbuf, [u.buf_bwd for u in self.units]
        self.bwd_segment = [u.bwd_segment for u in self.units]
        self._per_T: dict = {}
        self.outside_per_token = profile.outside.fwd_s_per_token + profile.outside.bwd_s_per_token
        self.evaluated = 0  # exact evaluations (for the benchmark)

    # -------------------------------------------------------- activation peak (conservative)

    def act_peak(self, T: int, rec: list[bool], buffers: bool = True, offload: bool = False) -> int:
        """memory_curve's peak minus fixed and pool, with every chunk missing (FSDP buffers), or
        with none missing (`buffers=False`: no buffers): the same integer arithmetic as
        memory.memory_curve."""
        return self.act_peaks(T, rec, offload)[0 if buffers else 1]

    def _tokens(self, T: int):
        """Per-token quantities of the memory bound at T tokens, as memory.memory_curve rounds
        them (cached per micro-batch)."""
        k = self._per_T.get(T)
        if k is None:
            p = self.p
            acts = [int(a * T) for a in self.act_per_token]
            k = (acts, [int(x * T) for x in self.input_per_token],
                 [a + w for a, w in zip(acts, self.fwd_window_buffers)],
                 int(p.outside.peak_bytes_per_token * T), int(p.outside.workspace_bytes_per_token * T),
                 int(p.outside.recompute_workspace_bytes_per_token * T), int(p.outside.act_bytes_per_token * T))
            self._per_T[T] = k
        return k

    def act_peaks(self, T: int, rec: list[bool], offload: bool) -> tuple[int, int]:
        """act_peak with and without buffers, in one pass (the integers of memory.memory_curve)."""
        acts, inputs, acts_fwin, peak, workspace, rworkspace, out_act = self._tokens(T)
        off = self.offload_of(T, rec, offload)
        credit, restored = off.credit, off.restored
        saved = [(x if r else a) - cr for x, r, a, cr in zip(inputs, rec, acts, credit)]
        before = list(accumulate(saved, initial=0))  # saved activations of the layers before i
        best = max(max(map(add, before, acts_fwin)), before[-1] + peak)
        best0 = max(max(map(add, before, acts)), before[-1] + peak)
        # The backward-phase uses in order, with their buffers, and each use's window of buffers.
        # (memory.window_buffers: the segments' buffers; a backward use that is no segment sees
        # the next d segments')
        buf_all, buf_bwd, d, segment = self.buf_all, self.buf_bwd, self.d, self.bwd_segment
        seq = []
        for i in range(len(acts) - 1, -1, -1):
            if rec[i]:
                seq.append(buf_all[i])
            if segment[i]:
                seq.append(buf_bwd[i])
        prefix = list(accumulate(seq, initial=0))
        prefix += [prefix[-1]] * (d + 1)  # the window of the last uses ends with the phase
        j = 0  # segments before the current use
        for i in range(len(acts) - 1, -1, -1):
            v = before[i] + acts[i] + restored[i]
            if rec[i]:
                v += saved[i]
                w = v + prefix[j + 1 + d] - prefix[j]  # the recompute use
                if w > best:
                    best = w
                if v > best0:
                    best0 = v
                j += 1
                v += rworkspace
            v += workspace - credit[i]  # the backward use
            if segment[i]:
                w = v + prefix[j + 1 + d] - prefix[j]
                j += 1
            else:
                w = v + prefix[j + d] - prefix[j]
            if w > best:
                best = w
            if v > best0:
                best0 = v
        return out_act + best, out_act + best0

    def offload_of(self, T: int, rec: list[bool], offload: bool) -> Offload:
        """memory.offload_served for this candidate; without a host budget (every request
        served) from per-layer sums cached per micro-batch, the same integers."""
        p = self.p
        if not offload:
            zero = self._no_offload
            if zero is None or len(zero.moved) != len(rec):
                zero = self._no_offload = offload_served(p, T, rec, False)
            return zero
        if p.host_budget_bytes is not None:
            return offload_served(p, T, rec, offload)
        per = self._offload_cache.get(T)
        if per is None:
            per = []
            for layer in p.layers:
                served = tuple((o, nb) for o, b in zip(layer.offload_owner_indices(), layer.offload_tensors_bytes_per_token)
                               if (nb := int(round(b * T))) > 0)
                m = sum(nb for _, nb in served)
                linears = per_linear(served)
                first = linears[0] if linears else 0
                inner = max((a + b for a, b in zip(linears, linears[1:])), default=0)
                per.append((m, min(int(layer.offload_freed_bytes_per_token * T), int(layer.act_bytes_per_token * T))
                            if m else 0, served, first, inner, linears[-1] if linears else 0))
            self._offload_cache[T] = per
        moved, credit, restored, served = [], [], [], []
        last = 0  # memory.restored_bytes, from the cached pairs
        for (m, c, sv, first, inner, final), r in zip(per, rec):
            if r or not m:
                moved.append(0)
                credit.append(0)
                served.append(())
                restored.append(last)
            else:
                moved.append(m)
                credit.append(c)
                served.append(sv)
                restored.append(max(last + first, inner))
                last = final
        return Offload(tuple(moved), tuple(credit), tuple(restored), tuple(served))

    # -------------------------------------------------------- windows

    def candidate(self, m: int, rec: list[bool]) -> _Candidate:
        """The parts of candidate (m, rec) that do not depend on memory or offload: per unit the
        proxy's prefetch windows of its (forward, recompute, backward) uses (None when the use
        does not exist): independent windows, the compute from the entry of the segment
        prefetch_depth segments before it (where the runtime issues its gathers) to its own
        entry, in its phase ([Note: the search]: with these windows the proxy of one link
        alone is a lower bound); and the compute of every use."""
        layers, d = self.p.layers, self.d
        L = len(layers)
        T = m * self.p.seq_len
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
        prefix = list(accumulate(bc, initial=0.0))
        entries = []  # positions of the segment uses (a backward use of a unit with no backward weight is none)
        segment = self.bwd_segment
        for j, (i, kind) in enumerate(bseq):
            if kind == 1 or segment[i]:
                entries.append(j)
                start = entries[-1 - d] if len(entries) > d else 0
            else:
                start = entries[-d] if d and len(entries) >= d else j  # no use, no gather: window unused
            w = prefix[j] - prefix[start]
            if kind == 1:
                wr[i] = w
            else:
                wb[i] = w
        c = _Candidate()
        c.m, c.T, c.rec = m, T, list(rec)
        c.windows = [(wf[i], wr[i], wb[i]) for i in range(L)]
        c.fc, c.bseq, c.bc = fc, bseq, bc
        c.compute = sum(fc) + sum(bc) + self.outside_per_token * T
        c.entries = None
        return c

    def lower_bound(self, c: _Candidate, kept: list) -> float:
        """A lower bound of `exact(c, kept, offload)` for either offload ([Note: the search]):
        the compute, plus the larger of the proxy's exposure of the all-gathers alone and of
        the host copies alone. Dropping one link and the activation copies only removes work
        from the model's fixed-order max-plus system; with one FIFO link, a use's exposure is
        at least its transfer minus its independent window (the compute from its issue to its
        entry: if no use in between waited, the window is exactly that; if one did, the link
        was busy with earlier gathers until then, so its own could not start before)."""
        glat, gbw, hlat, hbw = self.links
        eg = eh = 0.0
        for u, x, (wf, wr, wb), r in zip(self.units, kept, c.windows, c.rec):
            pf, hf, pb, hb = u.missing(x)
            for peer, host, w in ((pf, hf, wf), (pb, hb, wb)) + (((pf, hf, wr),) if r else ()):
                if peer > 0:
                    t = glat + peer / gbw - w
                    if t > 0:
                        eg += t
                if host > 0:
                    t = hlat + host / hbw - w
                    if t > 0:
                        eh += t
        return c.compute + (eg if eg > eh else eh)

    # -------------------------------------------------------- one candidate

    def end_of_forward(self, T: int, offload: bool) -> tuple[int, list[int]]:
        """A lower bound of act_peaks (both) with no layer recomputed, from the end-of-forward
        point alone: every saved activation (with offload, as if every request were served: a
        layer credits at most that) plus the outside's activations and peak; and per layer what
        recomputing it changes that bound by (its input instead of what it saves)."""
        key = (T, offload)
        hit = self._eof.get(key)
        if hit is None:
            acts, inputs, _, peak, _, _, out_act = self._tokens(T)
            credit = self._unbudgeted_credit(T) if offload else [0] * len(acts)
            saved = [a - c for a, c in zip(acts, credit)]
            hit = self._eof[key] = (out_act + peak + sum(saved), [x - v for x, v in zip(inputs, saved)])
        return hit

    def _unbudgeted_credit(self, T: int) -> list[int]:
        """Per layer, the credit of the offload when the host budget serves every request."""
        out = []
        for layer in self.p.layers:
            moved = sum(int(round(b * T)) for b in layer.offload_tensors_bytes_per_token)
            out.append(min(int(layer.offload_freed_bytes_per_token * T), int(layer.act_bytes_per_token * T))
                       if moved > 0 else 0)
        return out

    def infeasible_by(self, end: int, limit: int) -> int:
        """A lower bound of the shortfall of any candidate whose act peaks are at least `end`
        (0: it may fit): the budget's two conditions ([Note: the search]) with end for act."""
        avail = limit - self.fixed - end
        min_pool = min(self.ws, self.total) * self.page
        all_kept = self.fixed + self.total * self.page + end
        if self.keep_only is not None and sum(sum(ks) for ks in self.keep_only) < self.total:
            return max(0, min_pool - avail) if avail < min_pool else 0
        return max(0, min(min_pool - avail, all_kept - limit))

    def budget(self, T: int, rec: list[bool], limit: int, offload: bool):
        """(chunks candidate (T tokens, rec, offload) may keep, shortfall in bytes): the memory
        left for kept chunks under the conservative buffer bound ([Note: the search]); None
        chunks when nothing fits."""
        act, act_no_buffers = self.act_peaks(T, rec, offload)
        avail = limit - self.fixed - act
        min_pool = min(self.ws, self.total) * self.page
        # Exact, not bounded: with every chunk kept nothing is gathered and no buffer exists.
        all_kept = self.fixed + self.total * self.page + act_no_buffers
        if self.keep_only is not None:
            kept = sum(sum(ks) for ks in self.keep_only)
            if kept < self.total:
                all_kept = limit + max(1, min_pool - avail)  # not a candidate under a given residency
        if all_kept <= limit:
            budget = self.total
        elif avail < min_pool:
            return None, min(min_pool - avail, all_kept - limit)
        elif avail >= self.total * self.page:
            budget = self.total
        else:
            budget = avail // self.page - self.ws
        if self.keep_only is not None:  # fixed residency: feasible only if it fits
            kept = sum(sum(ks) for ks in self.keep_only)
            if kept > budget:
                return None, (kept - budget) * self.page
        return budget, 0

    def _entries(self, c: _Candidate) -> list:
        """The proxy's runs of every unit of candidate c, (-time saved per chunk, run index,
        unit, x0, x1), sorted (ties: run index, then unit index): one order that does not
        depend on the memory. Kept sorted per micro-batch and updated where a unit's
        recompute choice or windows changed (one more recomputed layer changes a few)."""
        if c.entries is not None:
            return c.entries
        keys = [(r, w) for r, w in zip(c.rec, c.windows)]
        state = self._order.get(c.m)
        if state is None:
            old_keys, entries = [None] * len(keys), []
        else:
            old_keys, entries = state
        for i, (key, old) in enumerate(zip(keys, old_keys)):
            if key == old:
                continue
            u = self.units[i]
            if old is not None:
                for e in self._unit_entries(u, i, old):
                    del entries[bisect_left(entries, e)]
            for e in self._unit_entries(u, i, key):
                insort(entries, e)
        self._order[c.m] = (keys, entries)
        c.entries = entries  # valid until the next candidate of this micro-batch
        return entries

    def _unit_entries(self, u: _Unit, i: int, key) -> list:
        rec, windows = key
        ckey = (u.sig, rec, windows)
        runs = self.run_cache.get(ckey)
        if runs is None:
            runs = self.run_cache[ckey] = _runs(u, rec, windows, self.links)
        return [(-(saved / (x1 - x0)), j, i, x0, x1) for j, (x0, x1, saved) in enumerate(runs)]

    def proposal(self, c: _Candidate, budget: int) -> list:
        """Chunks kept per unit: the longest prefix of the candidate's run order with `budget`
        chunks, the last run cut at a chunk (or a stop); or the given residency."""
        if self.keep_only is not None:
            return list(self.keep_only)
        if budget >= self.total:
            return [u.n for u in self.units]
        kept = [0] * len(self.units)
        left = budget
        for _, _, i, x0, x1 in self._entries(c):
            n = x1 - x0
            if n <= left:
                kept[i] = x1
                left -= n
                continue
            u = self.units[i]
            x = x0 + left
            if u.stops is not None:
                x = max(st for st in u.stops if st <= x)
            if x > x0:
                kept[i] = x
            break
        return kept

    def exact(self, c: _Candidate, kept: list, offload: bool, act: ActivationEvents | None = None) -> float:
        """Seconds of one micro-batch of candidate c keeping `kept`: the cost model's
        simulation ([Note: the time model] in cost.py) on inputs built from the units' missing
        bytes, which are the memory model's timeline for these choices (tested)."""
        self.evaluated += 1
        gl, h2d = self.gl, self.h2d
        miss = [u.missing(x) for u, x in zip(self.units, kept)]
        fwd = [(i, fc, gl.time(pf), h2d.time(hf) if hf else 0.0, False, True)
               for i, (fc, (pf, hf, _, _)) in enumerate(zip(c.fc, miss))]
        bwd = []
        segment = self.bwd_segment
        for (i, kind), bc in zip(c.bseq, c.bc):
            pf, hf, pb, hb = miss[i]
            if kind == 1:
                bwd.append((i, bc, gl.time(pf), h2d.time(hf) if hf else 0.0, False, True))
            else:
                bwd.append((i, bc, gl.time(pb), h2d.time(hb) if hb else 0.0, True, segment[i]))
        if offload and act is None:
            key = (c.T, tuple(c.rec))
            act = self.events.get(key)  # the same for every prefetch depth and host fraction
            if act is None:
                act = self.events[key] = activation_events(self.p, c.T, c.rec, True,
                                                            self.offload_of(c.T, c.rec, True))
        total, _, _ = simulate_micro_batch(fwd, bwd, self.d, self.outside_per_token * c.T, act)
        return total

    def choices(self, m: int, rec: list[bool], kept: list, offload: bool) -> Choices:
        """Choices keeping, per unit, its first kept[i] chunks (or, with a given residency,
        kept[i][j] chunks of weight j); every kept chunk persists ([Note: what the planner
        chooses])."""
        if self.keep_only is not None:
            keep = tuple(tuple(ks) for ks in kept)
            return Choices(m, keep, keep, tuple(rec), self.d, self.f, offload)
        keep = []
        for u, x in zip(self.units, kept):
            ks = [0] * len(u.order)
            for (x0, c, _, _), j in zip(u.blocks, u.order):
                ks[j] = max(0, min(c, x - x0))
            keep.append(tuple(ks))
        keep = tuple(keep)
        return Choices(m, keep, keep, tuple(rec), self.d, self.f, offload)


    def evaluate(self, m: int, rec: list[bool], limit: int, offload: bool = False):
        """(seconds of one micro-batch by the cost model, kept chunks per unit, shortfall) of
        candidate (m, rec, offload) under `limit` bytes; (None, None, shortfall) when it does
        not fit."""
        budget, short = self.budget(m * self.p.seq_len, rec, limit, offload)
        if budget is None:
            return None, None, short
        c = self.candidate(m, rec)
        kept = self.proposal(c, budget)
        return self.exact(c, kept, offload), kept, 0


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
            keep_only=None, host_fractions=None, offload=None, stats=None) -> Plan:
    t_start = time.perf_counter()
    _check_args(profile, memory_bytes, global_batch, margin, prefetch_depth, granularity)
    per_rank = global_batch // profile.world_size
    limit = int(memory_bytes * (1.0 - margin))
    L = len(profile.layers)
    candidates = _micro_batch_candidates(per_rank, micro_batches)
    depths = PREFETCH_DEPTHS if prefetch_depth is None else (
        tuple(prefetch_depth) if isinstance(prefetch_depth, (tuple, list)) else (prefetch_depth,))
    pairs = host_candidates(profile, host_fractions, offload)
    fractions = list(dict.fromkeys(f for f, _ in pairs))
    offloads = list(dict.fromkeys(o for _, o in pairs))
    allreduce = profile.allreduce.time(profile.adapter_grad_bytes) if profile.world_size > 1 else 0.0
    best = None  # (step seconds, candidate key, search, candidate, kept, offload)
    shortfall = None
    tables: dict = {}
    events: dict = {}
    evaluated = visited = bounded = 0
    for di, d in enumerate(depths):
        for fi, f in enumerate(fractions):
            s = _Search(profile, d, granularity, f, tables, events)
            s.keep_only = keep_only
            live = list(enumerate(offloads))  # offload choices that can still fit a larger micro-batch
            for mi, m in enumerate(candidates):
                if not live:
                    break
                acc = per_rank // m
                T = m * profile.seq_len
                rec = [False] * L
                open_ = list(live)
                fits = {oi: False for oi, _ in live}
                complete = True  # the recompute loop was not cut by the lower bound
                compute = sum(layer.fwd_s(T) + layer.bwd_s(T) for layer in profile.layers) + s.outside_per_token * T
                eof = {oi: list(s.end_of_forward(T, off)) for oi, off in live}
                for R in range(len(s.rec_order) + 1):
                    if R:
                        r = s.rec_order[R - 1]
                        rec[r] = True
                        compute += profile.layers[r].fwd_s(T)
                        for e in eof.values():
                            e[0] += e[1][r]
                    visited += 1
                    # [Note: the search]: compute alone is a lower bound, and it grows with R.
                    if best is not None and acc * compute + allreduce > best[0] * (1 + 1e-12):
                        complete = False
                        break
                    feasible = []
                    for oi, off in open_:
                        # An O(1)-ish necessary condition first: the end-of-forward point alone.
                        quick = s.infeasible_by(eof[oi][0], limit)
                        if quick and (best is not None or (shortfall is not None and quick >= shortfall)):
                            continue  # cannot fit, and cannot lower the shortfall reported
                        budget, short = s.budget(T, rec, limit, off)
                        if budget is None:
                            shortfall = short if shortfall is None else min(shortfall, short)
                        else:
                            fits[oi] = True
                            feasible.append((oi, off, budget))
                    if not feasible:
                        continue
                    c = s.candidate(m, rec)
                    for oi, off, budget in feasible:
                        kept = s.proposal(c, budget)
                        key = (di, fi, oi, mi, R)
                        if best is not None and acc * s.lower_bound(c, kept) + allreduce > best[0] * (1 + 1e-12):
                            bounded += 1
                        else:
                            t_step = acc * s.exact(c, kept, off) + allreduce
                            evaluated += 1
                            if best is None or (t_step, key) < best[:2]:
                                best = (t_step, key, s, c, kept, off)
                        if not off and budget >= s.total:
                            open_.remove((oi, off))  # everything kept: recomputing more only adds time
                    if not open_:
                        break
                if complete:
                    # activations grow with the micro-batch: where no R fits m, no larger m fits
                    live = [(oi, off) for oi, off in live if fits[oi]]
    if stats is not None:
        stats.update(visited=visited, evaluated=evaluated, bounded=bounded)
    if best is None:
        raise PlanningError(
            f"no plan fits in memory_bytes x (1 - margin) = {limit} bytes per rank: the smallest plan "
            f"({'the given residency' if keep_only is not None else 'every chunk TRANSIENT, or every chunk kept'}, "
            f"micro-batch and recomputed layers chosen to fit) needs {limit + shortfall} bytes: short by "
            f"{shortfall} bytes"
        )
    _, _, s, c, kept, off = best
    choices = s.choices(c.m, c.rec, kept, off)
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
