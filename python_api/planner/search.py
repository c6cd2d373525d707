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
Whole weights: a second proposal per candidate (`SearchProblem.proposal_whole`) walks the
same order but rounds each entry up to the end of the weight it ends in, charging a weight
the runtime can hold as a run ([Note: resident runs] in python_api/runtime/tensor.py) its
run_bytes less its shard_bytes (what a run adds to the static shard: the memory model's
count), any other weight a page per chunk, within the same bytes (the chunk budget's pages);
both proposals are judged by the model and the faster is kept (ties: the chunk proposal). A
page per kept chunk duplicates the rank's slice that the shard already holds, so below keeping
everything the chunk proposal alone left memory unused that whole weights turn into kept
bytes: on SmolLM2-135M at 2 ranks its plans at caps of 716 and 776 MiB (668.8 and 687.8 MiB of
tensor peak, 1.03x and 1.13x budget 0's tokens/s) were both dominated by the plain budget 25%
(666.6 MiB, 1.18x), which holds whole weights (bench/results/2026-12-04_frontier_real.md).
With this proposal the intermediate cap there was still dominated (703.3 MiB, 1.09x: same
file): the memory bound above, not the proposal, leaves it few bytes to keep.
Monotone: more memory only extends a candidate's prefix (a superset of chunks kept), and the
model's time is a max-plus expression in which fewer missing bytes never make anything later
(cost.py), so each candidate's time is non-increasing in the memory; the plan is a minimum
over a fixed set of such functions (two per candidate), so it is monotone too.
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

from .plan import Plan, PlanningError, plan_of
from .problem import SearchProblem
from .profile import Profile

GRANULARITIES = ("chunks", "eighths")
# The host fractions the search tries when the profile has a host store ([Note: the host
# dimensions of the search]).
HOST_FRACTIONS = (0.0, 0.25, 0.5, 0.75, 1.0)
PREFETCH_DEPTHS = (1, 2)  # the prefetch windows tried when prefetch_depth=None


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
            keep_only=None, host_fractions=None, offload=None, stats=None, num_adapters=1) -> Plan:
    t_start = time.perf_counter()
    _check_args(profile, memory_bytes, global_batch, margin, prefetch_depth, granularity)
    if isinstance(num_adapters, bool) or not isinstance(num_adapters, int) or num_adapters < 1:
        raise PlanningError(f"num_adapters must be an int >= 1, got {num_adapters!r}")
    per_rank = global_batch // profile.world_size
    limit = int(memory_bytes * (1.0 - margin))
    L = len(profile.layers)
    candidates = _micro_batch_candidates(per_rank, micro_batches)
    depths = PREFETCH_DEPTHS if prefetch_depth is None else (
        tuple(prefetch_depth) if isinstance(prefetch_depth, (tuple, list)) else (prefetch_depth,))
    pairs = host_candidates(profile, host_fractions, offload)
    fractions = list(dict.fromkeys(f for f, _ in pairs))
    offloads = list(dict.fromkeys(o for _, o in pairs))
    # every adapter's gradients in one all-reduce ([Note: several adapters in the models])
    allreduce = (profile.allreduce.time(num_adapters * profile.adapter_grad_bytes) if profile.world_size > 1
                 else 0.0)
    best = None  # (step seconds, candidate key, search, candidate, kept, offload)
    shortfall = None
    tables: dict = {}
    events: dict = {}
    evaluated = visited = bounded = 0
    for di, d in enumerate(depths):
        for fi, f in enumerate(fractions):
            s = SearchProblem(profile, d, granularity, f, tables, events, num_adapters)
            s.keep_only = keep_only
            live = list(enumerate(offloads))  # offload choices that can still fit a larger micro-batch
            for mi, m in enumerate(candidates):
                if not live:
                    break
                acc = per_rank // m
                T = s.rows(m)
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
                        key = (di, fi, oi, mi, R)
                        whole = s.proposal_whole(c, budget)
                        for kept in [s.proposal(c, budget)] + ([] if whole is None else [whole]):
                            if best is not None and acc * s.lower_bound(c, kept) + allreduce > best[0] * (1 + 1e-12):
                                bounded += 1
                                continue
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
                      host_fractions=None, offload=None, num_adapters: int = 1) -> Plan:
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
    num_adapters   K adapters trained together on one base, each on `global_batch` sequences
                   per step (a micro-batch holds micro_batch sequences for each): one plan
                   for all of them ([Note: several adapters in the models]).
    Raises PlanningError naming the shortfall in bytes when nothing fits.
    """
    return _search(profile, memory_bytes, global_batch, micro_batches, margin, prefetch_depth, granularity,
                   host_fractions=host_fractions, offload=offload, num_adapters=num_adapters)


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
                        offload=None, num_adapters: int = 1) -> Plan:
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
                   keep_only=keep_only, host_fractions=host_fractions, offload=offload, num_adapters=num_adapters)
