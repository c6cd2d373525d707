"""How much stays resident: per-weight residency, the pool and its budget, the sources and
the prefetch window, changed between steps (ElasticRuntime's residency, a mixin of
runtime.py).

[Note: pool budget and working set]
`ElasticPolicy.pool_budget_bytes` is the memory for chunks kept *beyond their use*. The chunks
of the layers in flight (the one running plus `prefetch_depth` ahead) are pinned while in use,
which is the memory FSDP2 spends on unsharded parameters; the runtime sizes the pool as
budget + that working set (bounded by the pages of the `1 + prefetch_depth` largest units,

[Note: symmetric residency]
Every rank must issue the same all-gathers in the same order. Hits and misses depend only on
the sequence of pool calls (the same on every rank: same model, same policy, same budget
changes), never on timing, so ranks agree; a mismatch shows up as a size mismatch error in
the collective, not as silent corruption. Budget changes must therefore be made on every
rank at the same point (the planner and adaptive accumulation do).
"""

from __future__ import annotations

import dataclasses

from elastic_kernels import PagePool

from ..config import PAGE_ALIGN
from ..host.sources import host_chunks
from .tensor import ElasticTensor, Phase, Residency, residency_of_counts


class _Residency:
    """page size, pool sizing and budget, set_residency / set_host_fraction / set_prefetch_depth /
    set_offload_activations, drop_cached."""

    @property
    def cache_budget(self) -> int | None:
        """The cache budget in force: bytes for chunks kept beyond their use (None: every
        chunk), as `set_pool_budget` last set it ([Note: pool budget and working set])."""
        return self._cache_budget

    def page_bytes(self) -> int:
        """Pool page size: `policy.page_bytes`, else the largest real chunk rounded up to PAGE_ALIGN
        bytes (never more than `chunk_bytes` asks for: a model smaller than one configured chunk
        gets pages of its own size)."""
        if self.policy.page_bytes is not None:
            largest = max((et.page_bytes for et in self.tensors), default=0)
            if largest > self.policy.page_bytes:
                raise ValueError(
                    f"ElasticPolicy.page_bytes ({self.policy.page_bytes}) is smaller than the largest chunk "
                    f"({largest} bytes): a chunk must fit in one page"
                )
            return self.policy.page_bytes
        largest = max((et.page_bytes for et in self.tensors), default=1)
        return -(-largest // PAGE_ALIGN) * PAGE_ALIGN

    def set_residency(self, et: ElasticTensor, keep_chunks: int, persist_chunks: int) -> None:
        """Residency of one weight by chunk counts (0 <= persist <= keep <= chunks), e.g. from a
        plan. Between steps and on every rank alike ([Note: symmetric residency]). Resident
        chunks that are no longer PERSISTENT are released now, so the next step already
        gathers exactly what the new residency implies."""
        n = et.num_chunks
        for what, v in (("keep_chunks", keep_chunks), ("persist_chunks", persist_chunks)):
            if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v <= n:
                raise ValueError(f"set_residency({et.name}): {what} must be an int in [0, {n}], got {v!r}")
        if persist_chunks > keep_chunks:
            raise ValueError(f"set_residency({et.name}): persist_chunks ({persist_chunks}) > keep_chunks ({keep_chunks})")
        if self.phase is not Phase.IDLE or self._prefetched:
            raise RuntimeError(f"set_residency({et.name}): change residency between steps, not inside a forward or backward")
        et.residency = residency_of_counts(n, keep_chunks, persist_chunks)
        self._sync_runs(promote=False)
        if self.pool is not None:
            stale = [k for c, k in enumerate(et.keys) if et.residency[c] is not Residency.PERSISTENT
                     and self.pool.contains(k) and self.pool.pin_count(k) == 0]
            if stale:
                self.pool.free_many(stale)

    def set_host_fraction(self, fraction: float) -> None:
        """The share of missing chunks filled from the host store ([Note: chunk sources]), e.g.
        from a plan; between steps and on every rank alike. Needs the host store, which exists
        when the policy asked for the host tier (weights_on="host" or host_fraction > 0 at
        wrap time); with weights_on="host" the only value is 1."""
        if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) or not 0.0 <= fraction <= 1.0:
            raise ValueError(f"set_host_fraction: expected a number in [0, 1], got {fraction!r}")
        if self.phase is not Phase.IDLE or self._prefetched:
            raise RuntimeError("set_host_fraction: change the sources between steps, not inside a forward or backward")
        if fraction > 0 and self.host_store is None:
            raise ValueError("set_host_fraction: this runtime has no host store (wrap with weights_on='host' or "
                             "host_fraction > 0 to build one)")
        if self.policy.weights_on == "host" and fraction != 1.0:
            raise ValueError(f"set_host_fraction({fraction}): with weights_on='host' every chunk comes from the host store")
        self.policy = dataclasses.replace(self.policy, host_fraction=float(fraction))
        for et in self.tensors:
            et.from_host = host_chunks(et.num_chunks, self.policy.source_fraction)
        self._sync_runs(promote=False)

    def set_prefetch_depth(self, depth: int) -> None:
        """Segments gathered ahead of the running one ([Note: learned order and prefetch]), e.g.
        from a plan; between steps, on every rank alike. The pool's working set follows
        ([Note: pool budget and working set])."""
        if isinstance(depth, bool) or not isinstance(depth, int) or depth < 0:
            raise ValueError(f"set_prefetch_depth: expected an int >= 0, got {depth!r}")
        if self.phase is not Phase.IDLE or self._prefetched:
            raise RuntimeError("set_prefetch_depth: change the prefetch window between steps, not inside a forward or backward")
        self.policy = dataclasses.replace(self.policy, prefetch_depth=depth)
        if self.pool is not None:
            self.pool.set_budget(self._pool_budget())
            self.pool.drain_evicted()

    def set_offload_activations(self, enabled: bool) -> None:
        """Activation offload on or off from the next forward (python_api/host/offload.py),
        e.g. from a plan; between steps, on every rank alike."""
        if not isinstance(enabled, bool):
            raise ValueError(f"set_offload_activations: expected True or False, got {enabled!r}")
        # The policy checks the host budget when offload is on (a bad one raises here).
        self.policy = dataclasses.replace(self.policy, offload_activations=enabled)
        if self.activation_offload is not None:
            # Off: the host buffers go back to the OS now, and those still held by live graphs
            # when they return ([Note: trimming returns memory] in python_api/host/offload.py).
            self.activation_offload.set_enabled(enabled)

    def _working_set_pages(self) -> int:
        """Pages of the `1 + prefetch_depth` largest units, counting the weights held in pages
        (a run needs none: [Note: resident runs])."""
        units: dict[str, int] = {}
        for et in self.tensors:
            if et.run is None:
                units[et.unit] = units.get(et.unit, 0) + et.num_chunks
        counts = sorted(units.values(), reverse=True)
        return sum(counts[: 1 + self.policy.prefetch_depth])

    def _total_pages(self) -> int:
        """Chunks of the weights held in pages (not in runs)."""
        return sum(et.num_chunks for et in self.tensors if et.run is None)

    def run_bytes(self) -> int:
        """Bytes of the weights held as runs now ([Note: resident runs]): charged against the
        cache budget, so the pool's budget is the cache budget less these."""
        return sum(et.run_bytes for et in self.tensors if et.run is not None)

    def _pool_budget(self) -> int:
        page = self.page_bytes()
        total = self._total_pages() * page
        if self._cache_budget is None:
            return max(total, page)
        cache = max(0, self._cache_budget - self.run_bytes())
        return max(page, min(total, cache + self._working_set_pages() * page))

    def _ensure_pool(self) -> None:
        self.check_open("use")
        if self.pool is None and not self._local_only():
            if self._runs_dirty:
                self._sync_runs(promote=True)  # before the first use: nothing is in flight
            self.pool = PagePool(self.page_bytes(), self._pool_budget(), device=self.device)

    # Runs: see [Note: resident runs] in python_api/runtime/tensor.py.

    def _run_candidates(self) -> list[ElasticTensor]:
        """The weights to hold as runs: every chunk PERSISTENT, none from the host store, a
        layout whose padded chunks lie back to back, a device shard, a runtime that gathers.
        All of them when the cache budget holds every kept chunk of the model in pages (None,
        or at least sum(keep_chunks) pages: no kept chunk is ever evicted, so the runs change
        no byte of traffic). A smaller budget holds whole weights in the order of
        registration, each that still fits (its run_bytes, the same on every rank), and the
        rest in pages ([Note: resident runs], "Partial budgets")."""
        out = [et for et in self.tensors if self.can_hold_as_run(et) and not any(et.from_host)
               and all(r is Residency.PERSISTENT for r in et.residency)]
        if out and self._cache_budget is not None:
            kept = sum(et.keep_chunks for et in self.tensors) * self.page_bytes()
            if kept > self._cache_budget:
                chosen, used = [], 0
                for et in out:
                    if used + et.run_bytes <= self._cache_budget:
                        chosen.append(et)
                        used += et.run_bytes
                return chosen
        return out

    def can_hold_as_run(self, et: ElasticTensor) -> bool:
        """The conditions of a run that do not depend on residency, sources or budget: a
        runtime that gathers, the weights on the device, `resident_runs`, and a layout whose
        padded chunks lie back to back (not quantized). What the planner's profile records
        as `run_bytes` (python_api/planning/measure.py)."""
        return (not self._local_only() and self.policy.weights_on == "device" and self.policy.resident_runs
                and et.on_device and et.run_layout_ok)

    def _sync_runs(self, promote: bool) -> None:
        """Demote the runs that are no longer wanted (at once: their memory goes back now);
        with `promote`, also hold the wanted weights as runs (only where no use is in flight:
        before the first use, and at the start of a forward pass). The pool's budget follows."""
        wanted = {et.wid for et in self._run_candidates()}
        changed = False
        for et in self.tensors:
            if et.run is not None and et.wid not in wanted:
                self._demote(et)
                changed = True
        if promote:
            for et in self.tensors:
                if et.run is None and et.wid in wanted:
                    if self.pool is not None:  # pages of its chunks: dead once it is a run
                        cached = [k for k in et.keys if self.pool.contains(k) and self.pool.pin_count(k) == 0]
                        if cached:
                            self.pool.free_many(cached)
                    et.to_run()
                    changed = True
            self._runs_dirty = False
        else:
            self._runs_dirty = True
        self._run_peak = max(self._run_peak, self.run_bytes())
        if changed and self.pool is not None:
            self.pool.set_budget(self._pool_budget())
            self.pool.drain_evicted()

    def _demote(self, et: ElasticTensor, keep_pages: bool = True) -> None:
        """A run back to a shard and pages: the own slices copied out to a fresh shard, the run
        freed; with `keep_pages`, the chunks still PERSISTENT of a filled run copied into pages
        while the pool has room without evicting (so a plan that keeps them gathers nothing
        more)."""
        run = et.run
        et.to_shard()
        if self.pool is None or not run.filled or not keep_pages:
            return
        self.pool.set_budget(self._pool_budget())
        page = self.pool.page_bytes
        for c, key in enumerate(et.keys):
            s = self.pool.stats()
            if et.residency[c] is not Residency.PERSISTENT or s["in_use_bytes"] + page > s["budget_bytes"]:
                break
            et.chunk_view(self.pool.allocate(key), c).copy_(run.chunks[c])

    def set_pool_budget(self, budget_bytes: int | None) -> None:
        """Change the cache budget (bytes beyond the working set) at any moment, on every rank."""
        self.check_open("set_pool_budget")
        if budget_bytes is not None and (isinstance(budget_bytes, bool) or not isinstance(budget_bytes, int) or budget_bytes < 0):
            raise ValueError(f"set_pool_budget: expected None or an int >= 0, got {budget_bytes!r}")
        self._cache_budget = budget_bytes
        self._sync_runs(promote=False)  # a budget that cannot hold the runs demotes them now
        if self.pool is not None:
            self.pool.set_budget(self._pool_budget())
            self.pool.drain_evicted()  # see _finish_phase

    def drop_cached(self, et: ElasticTensor) -> None:
        """Free the pool pages holding chunks of `et` (after its shard changed), or its run
        (back to a shard of its own; held as a run again from the next forward pass). Local;
        not while a use of `et` is running."""
        if et.run is not None:
            self._demote(et, keep_pages=False)  # its data is about to change
            self._runs_dirty = True
            if self.pool is not None:
                self.pool.set_budget(self._pool_budget())
                self.pool.drain_evicted()
        if self.pool is None:
            return
        cached = [k for k in et.keys if self.pool.contains(k)]
        if any(self.pool.pin_count(k) > 0 for k in cached):
            raise RuntimeError(f"{et.name} is in use by a forward or backward; change it between steps")
        if cached:
            self.pool.free_many(cached)
