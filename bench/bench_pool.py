"""PagePool per-operation cost from Python, single and batched, against torch.empty.

    python bench/bench_pool.py [--device cpu|cuda] [--pages 256] [--page-kib 1024]

In the same run, per page: get + pin + unpin (three calls), the batched lookup_pin +
unpin_many over all pages (amortized per page), allocate + free, and torch.empty + drop of
the same size on the same device. Issue 3's target: batched lookup + pin + unpin at most
1 µs per page on the development CPU. On CUDA the run also reports how many device
allocations torch's allocator made during the steady-state loops (0 expected: the pool's
segments are allocated once). Rows to bench/results/pool.csv.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench import harness  # noqa: E402
from elastic_kernels import PagePool  # noqa: E402


def _device_allocs(device) -> int:
    if device.type != "cuda":
        return 0
    return torch.cuda.memory_stats(device).get("num_device_alloc", 0)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--pages", type=int, default=256)
    p.add_argument("--page-kib", type=int, default=1024)
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--results", default=None)
    args = p.parse_args(argv)
    device = torch.device(args.device)
    page_bytes = args.page_kib << 10
    n = args.pages
    pool = PagePool(page_bytes, n * page_bytes, device=device)
    keys = list(range(n))
    for k in keys:
        pool.allocate(k)
    spare = n  # a key with no page, for allocate + free (budget: free one page first)
    pool.free(keys[-1])
    resident = keys[:-1]

    def single():
        for k in resident:
            pool.get(k)
            pool.pin(k)
            pool.unpin(k)

    def batched():
        pool.lookup_pin(resident)
        pool.unpin_many(resident)

    def alloc_free():
        for _ in range(len(resident)):
            pool.allocate(spare)
            pool.free(spare)

    def empty():
        for _ in range(len(resident)):
            torch.empty(page_bytes, dtype=torch.uint8, device=device)

    allocs_before = _device_allocs(device)
    times = {name: harness.measure(fn, device, repeats=args.repeats) / len(resident)
             for name, fn in (("get+pin+unpin", single), ("lookup_pin+unpin_many (batched)", batched),
                              ("allocate+free", alloc_free))}
    new_allocs = _device_allocs(device) - allocs_before  # the pool loops only
    times["torch.empty"] = harness.measure(empty, device, repeats=args.repeats) / len(resident)
    pool.close()
    ctx = harness.context(device)
    base = times["torch.empty"]
    rows = [{**ctx, "pages": n, "page_kib": args.page_kib, "op": op, "us_per_page": round(t * 1e6, 3),
             "vs_torch_empty": round(base / t, 2), "device_allocs_in_pool_loops": new_allocs}
            for op, t in times.items()]
    harness.print_table(rows, ["op", "us_per_page", "vs_torch_empty", "device_allocs_in_pool_loops"])
    print("rows appended to", harness.append_rows("pool", rows, args.results))


if __name__ == "__main__":
    main()
