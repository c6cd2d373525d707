"""Per-page cost of the PagePool's calls from Python, against torch.empty of a page.

    python bench/bench_pool.py [--device cpu|cuda] [--pages N] [--page-kib K ...] [--results DIR]

For each page size, in one run: the baseline (`torch.empty(page_bytes, uint8)` per page on the
same device) and the pool's hot paths, single calls and batched calls, each as the median of
several repeats over N pages (nanoseconds per page, amortized):

  get+pin+unpin            pool.get(k); pool.pin(k); pool.unpin(k)          (all resident)
  lookup_pin+unpin_many    pool.lookup_pin(keys); pool.unpin_many(keys)     (target: <= 1 us)
  allocate+free            pool.allocate(k); pool.free(k)                   (pages cached)
  allocate_many+free_many  pool.allocate_many(keys); pool.free_many(keys)
  allocate(evicting)       pool.allocate(k) into a full pool: evicts the LRU page each time

`torch_allocs_per_iter` counts torch allocations per measured iteration (N pages): on CUDA from
torch.cuda.memory_stats()["allocation.all.allocated"] (an independent count), on CPU from the
pool's own segment_allocs (the baseline makes N by construction). After warm-up the pool makes
none. Rows go to bench/results/pool.csv (or --results / $ELASTIC_BENCH_RESULTS).
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench import harness  # noqa: E402
from elastic_kernels import PagePool  # noqa: E402

TARGET_NS = 1000.0  # batched lookup+pin+unpin per page, issue 3


def _device_allocs(device) -> int | None:
    if torch.device(device).type != "cuda":
        return None
    return torch.cuda.memory_stats(device)["allocation.all.allocated"]


def bench_page_size(device, page_bytes: int, n: int, repeats: int) -> list[dict]:
    rows = []
    keys = list(range(n))
    fresh = list(range(n, 2 * n))

    def row(op, pages, seconds, baseline_ns, allocs):
        ns = seconds / pages * 1e9
        return {
            **harness.context(device),
            "op": op,
            "page_bytes": page_bytes,
            "pages_per_iter": pages,
            "ns_per_page": round(ns, 1),
            "baseline": "torch.empty",
            "baseline_ns_per_page": round(baseline_ns, 1),
            "speedup_vs_baseline": round(baseline_ns / ns, 2),
            "torch_allocs_per_iter": allocs,
        }

    def timed(fn, pool=None):
        """(median seconds, torch allocations per measured iteration after warm-up)."""
        fn()  # warm-up beyond measure's own, so segments exist before counting
        d0, s0 = _device_allocs(device), pool.stats()["segment_allocs"] if pool else None
        seconds = harness.measure(fn, device, warmup=2, repeats=repeats)
        iters = 2 + repeats
        if d0 is not None:
            allocs = round((_device_allocs(device) - d0) / iters, 2)
        elif pool is not None:
            allocs = round((pool.stats()["segment_allocs"] - s0) / iters, 2)
        else:
            allocs = n  # torch.empty: one allocation per page by construction
        return seconds, allocs

    def baseline():
        for _ in range(n):
            torch.empty(page_bytes, dtype=torch.uint8, device=device)

    t_base, a_base = timed(baseline)
    base_ns = t_base / n * 1e9
    rows.append(row("torch.empty", n, t_base, base_ns, a_base))

    # Resident pages: lookups, single and batched.
    with PagePool(page_bytes, 2 * n * page_bytes, device) as pool:
        for k in keys:
            pool.allocate(k)

        def single_lookup():
            get, pin, unpin = pool.get, pool.pin, pool.unpin
            for k in keys:
                get(k)
                pin(k)
                unpin(k)

        def batched_lookup():
            pool.lookup_pin(keys)
            pool.unpin_many(keys)

        t, a = timed(single_lookup, pool)
        rows.append(row("get+pin+unpin", n, t, base_ns, a))
        t, a = timed(batched_lookup, pool)
        rows.append(row("lookup_pin+unpin_many", n, t, base_ns, a))

        # Allocation with room in the budget (the second half is cached free pages).
        def single_alloc():
            allocate, free = pool.allocate, pool.free
            for k in fresh:
                allocate(k)
                free(k)

        def batched_alloc():
            pool.allocate_many(fresh)
            pool.free_many(fresh)

        t, a = timed(single_alloc, pool)
        rows.append(row("allocate+free", n, t, base_ns, a))
        t, a = timed(batched_alloc, pool)
        rows.append(row("allocate_many+free_many", n, t, base_ns, a))

    # Allocation into a full pool: every allocate evicts the least recently used page.
    with PagePool(page_bytes, n * page_bytes, device) as pool:
        counter = iter(range(10**12))
        for _ in range(n):
            pool.allocate(next(counter))

        def evicting():
            allocate = pool.allocate
            for _ in range(n):
                allocate(next(counter))
            pool.drain_evicted()

        t, a = timed(evicting, pool)
        rows.append(row("allocate(evicting)", n, t, base_ns, a))
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--pages", type=int, default=512, help="pages per measured iteration")
    ap.add_argument("--page-kib", type=int, nargs="+", default=[64, 2048])
    ap.add_argument("--repeats", type=int, default=11)
    ap.add_argument("--results", default=None, help="folder for pool.csv (default bench/results)")
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda":
        device = torch.device("cuda", torch.cuda.current_device())

    rows = []
    for kib in args.page_kib:
        rows += bench_page_size(device, kib * 1024, args.pages, args.repeats)
    harness.print_table(
        rows,
        ["op", "page_bytes", "ns_per_page", "baseline_ns_per_page", "speedup_vs_baseline", "torch_allocs_per_iter"],
    )
    batched = [r["ns_per_page"] for r in rows if r["op"] == "lookup_pin+unpin_many"]
    print(
        f"batched lookup+pin+unpin: {max(batched):.0f} ns/page at worst "
        f"(target <= {TARGET_NS:.0f} ns/page: {'met' if max(batched) <= TARGET_NS else 'MISSED'})"
    )
    path = harness.append_rows("pool", rows, args.results)
    print(f"rows appended to {path}")


if __name__ == "__main__":
    main()
