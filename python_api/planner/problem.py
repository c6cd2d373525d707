"""One planning problem of the search ([Note: the search] in search.py) at one prefetch depth
and host fraction: the profile's fixed parts (`SearchProblem`), and per candidate (micro-batch,
recompute set, offload) its conservative activation peak, the chunks it may keep (`budget`), the
proposal (the longest prefix of the proxy's run order, proxy.py) and the cost model's exact time.
Pure Python, no torch.
"""

from __future__ import annotations

from bisect import bisect_left, insort
from itertools import accumulate
from operator import add

from .cost import ActivationEvents, activation_events, simulate_micro_batch
from .memory import (
    Choices,
    Offload,
    adapter_state_bytes,
    effective_host_fraction,
    host_chunk_count,
    offload_served,
    per_linear,
)
from .profile import Profile
from .proxy import Unit, proxy_runs


def _recompute_order(profile: Profile, rows: int) -> list[int]:
    """Recomputable layers that free memory, by bytes freed per second of recompute of `rows`
    rows (one sequence per adapter)."""
    def key(i):
        layer = profile.layers[i]
        cost = layer.fwd_s(rows)  # a recompute's dequantization included
        freed = layer.act_bytes_per_token - layer.input_bytes_per_token
        return (-(freed / cost) if cost > 0 else float("-inf"), i)

    cand = [i for i, layer in enumerate(profile.layers)
            if layer.recomputable and layer.act_bytes_per_token > layer.input_bytes_per_token]
    return sorted(cand, key=key)



class Candidate:
    """What a (micro-batch, recompute set) shares across offload on/off: windows, compute,
    the proposal's sorted runs."""

    __slots__ = ("m", "T", "rec", "windows", "fc", "bseq", "bc", "compute", "entries", "zero")


class SearchProblem:
    """One planning problem at one (prefetch depth, host fraction): the profile's fixed parts,
    evaluated per candidate (micro-batch, recompute set, offload)."""

    def __init__(self, profile: Profile, prefetch_depth: int, granularity: str, host_fraction: float = 0.0,
                 tables: dict | None = None, events: dict | None = None, num_adapters: int = 1):
        self.p = profile
        self.k = num_adapters  # adapters trained together ([Note: several adapters in the models])
        self.events = {} if events is None else events
        self.d = prefetch_depth
        self.f = host_fraction
        tables = {} if tables is None else tables
        self.units = [Unit(profile, i, granularity, host_fraction, tables) for i in range(len(profile.layers))]
        gl = profile.gather_link()
        h2d = profile.h2d
        self.links = (gl.latency_s, gl.bytes_per_s) + ((h2d.latency_s, h2d.bytes_per_s) if h2d is not None
                                                      else (0.0, 1.0))
        self.gl, self.h2d = gl, h2d
        self.total = profile.total_chunks
        self.ws = profile.working_set_pages(prefetch_depth)
        self.page = profile.page_bytes
        self.fixed = (profile.reserved_bytes + profile.static_bytes
                      + (num_adapters - 1) * adapter_state_bytes(profile))
        # Every chunk kept (p = k = n): the weights the runtime can hold as runs are runs, the
        # rest are pages; memory.memory_curve's fixed + pool then, exactly ([Note: what the
        # memory model counts]). Below that the chunk budget counts a page per kept chunk
        # (a run costs less: the bound stays conservative).
        f = effective_host_fraction(profile, host_fraction)
        runs = [w for layer in profile.layers for w in layer.weights
                if w.run_bytes is not None and host_chunk_count(w.chunks, 0, f) == 0]
        self.all_kept_bytes = (sum(w.run_bytes - w.shard_bytes for w in runs)
                               + (self.total - sum(w.chunks for w in runs)) * self.page)
        # Per unit, in its keep order: what keeping each weight whole adds (a run: run_bytes -
        # shard_bytes; None: it stays in pages); empty when no weight can be a run.
        ids = {id(w) for w in runs}
        self.run_costs = [[w.run_bytes - w.shard_bytes if id(w) in ids else None for w in u.ws]
                          for u in self.units] if runs else []
        self.rec_order = _recompute_order(profile, self.rows(1))
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

    def rows(self, m: int) -> int:
        """T of micro-batch m: m sequences for each adapter (memory.rows_per_micro_batch)."""
        return self.k * m * self.p.seq_len

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

    def candidate(self, m: int, rec: list[bool]) -> Candidate:
        """The parts of candidate (m, rec) that do not depend on memory or offload: per unit the
        proxy's prefetch windows of its (forward, recompute, backward) uses (None when the use
        does not exist): independent windows, the compute from the entry of the segment
        prefetch_depth segments before it (where the runtime issues its gathers) to its own
        entry, in its phase ([Note: the search]: with these windows the proxy of one link
        alone is a lower bound); and the compute of every use."""
        layers, d = self.p.layers, self.d
        L = len(layers)
        T = self.rows(m)
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
        c = Candidate()
        c.m, c.T, c.rec = m, T, list(rec)
        c.windows = [(wf[i], wr[i], wb[i]) for i in range(L)]
        c.fc, c.bseq, c.bc = fc, bseq, bc
        c.compute = sum(fc) + sum(bc) + self.outside_per_token * T
        c.entries = None
        return c

    def lower_bound(self, c: Candidate, kept: list) -> float:
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
        all_kept = self.fixed + self.all_kept_bytes + end
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
        all_kept = self.fixed + self.all_kept_bytes + act_no_buffers
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

    def _entries(self, c: Candidate) -> list:
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

    def _unit_entries(self, u: Unit, i: int, key) -> list:
        rec, windows = key
        ckey = (u.sig, rec, windows)
        runs = self.run_cache.get(ckey)
        if runs is None:
            runs = self.run_cache[ckey] = proxy_runs(u, rec, windows, self.links)
        return [(-(saved / (x1 - x0)), j, i, x0, x1) for j, (x0, x1, saved) in enumerate(runs)]

    def proposal(self, c: Candidate, budget: int) -> list:
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

    def proposal_whole(self, c: Candidate, budget: int) -> list | None:
        """Chunks kept per unit when kept weights are whole ([Note: the search], "Whole
        weights"): the candidate's run order with each entry rounded up to the end of the
        weight it ends in, a weight the runtime holds as a run charged its run_bytes less its
        shard_bytes, any other chunk a page; the longest prefix within `budget` pages' bytes.
        None where it is the chunk proposal's business (a given residency, everything kept,
        or no weight that can be a run)."""
        if self.keep_only is not None or budget >= self.total or not self.run_costs:
            return None
        left = budget * self.page
        kept = [0] * len(self.units)
        for _, _, i, _, x1 in self._entries(c):
            u, costs = self.units[i], self.run_costs[i]
            if kept[i] >= x1:
                continue
            end, cost = kept[i], 0
            for (x0, n, _, _), run_cost in zip(u.blocks, costs):
                if x0 + n <= kept[i]:
                    continue
                if x0 >= x1:
                    break
                cost += run_cost if run_cost is not None else n * self.page  # kept[i] ends a weight
                end = x0 + n
            if cost > left:
                break
            kept[i], left = end, left - cost
        return kept

    def exact(self, c: Candidate, kept: list, offload: bool, act: ActivationEvents | None = None) -> float:
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
            return Choices(m, keep, keep, tuple(rec), self.d, self.f, offload, self.k)
        keep = []
        for u, x in zip(self.units, kept):
            ks = [0] * len(u.order)
            for (x0, c, _, _), j in zip(u.blocks, u.order):
                ks[j] = max(0, min(c, x - x0))
            keep.append(tuple(ks))
        keep = tuple(keep)
        return Choices(m, keep, keep, tuple(rec), self.d, self.f, offload, self.k)


    def evaluate(self, m: int, rec: list[bool], limit: int, offload: bool = False):
        """(seconds of one micro-batch by the cost model, kept chunks per unit, shortfall) of
        candidate (m, rec, offload) under `limit` bytes; (None, None, shortfall) when it does
        not fit."""
        budget, short = self.budget(self.rows(m), rec, limit, offload)
        if budget is None:
            return None, None, short
        c = self.candidate(m, rec)
        kept = self.proposal(c, budget)
        return self.exact(c, kept, offload), kept, 0
