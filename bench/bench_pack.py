"""GB/s of elastic::pack_shards and elastic::unpack_gathered, each impl against plain torch.

    python bench/bench_pack.py [--device cpu|cuda] [--results DIR] [--dtype bfloat16]

One gather = `--weights` weights (4: like the q/k/v/o of a layer) whose full size totals
1-64 MiB (CPU: up to 16 MiB), each cut into 4 chunks of 4096-element rows (the last weight has
half a chunk more: a ragged fifth chunk), at world sizes 2, 4 and 8. pack = one rank's send
buffer (all chunks); unpack = the whole all-gather output into one dest per chunk. GB/s counts
bytes read + bytes written.

Baselines, measured in the same run: pack -> `torch.cat` of the shard slices; unpack -> per
dest `copy_` from the [world_size, per_rank] view of the gathered buffer (two copy_ calls per
dest: its full slices at once, then the ragged tail). `memcpy` is `copy_` between two
contiguous, already allocated buffers of the same payload: the ceiling of a copy on this device
in this run (pack allocates its output, so on CPU the first touch of fresh pages is its cost too).
Impls: cpp (the registered C++/CUDA op), reference (pure torch), triton (CUDA only: under the
CPU interpreter its timing means nothing). Every impl's output is checked bitwise against the
reference before it is timed.
"""

from __future__ import annotations

import argparse
import math
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench import harness  # noqa: E402
from elastic_kernels import ChunkLayout, _ext  # noqa: E402
from elastic_kernels.ops.pack_reference import pack_shards_reference, unpack_gathered_reference  # noqa: E402

MIB = 2**20
COLS = 4096
CHUNKS_PER_WEIGHT = 4


def gather_layouts(total_bytes: int, n_weights: int, world_size: int, elem_size: int) -> list[ChunkLayout]:
    rows = max(1, total_bytes // (n_weights * COLS * elem_size))
    rows_per_chunk = max(1, math.ceil(rows / CHUNKS_PER_WEIGHT))
    # the last weight is half a chunk longer: its last chunk is ragged (padded in the shards)
    extra = [0] * (n_weights - 1) + [rows_per_chunk // 2]
    return [ChunkLayout(rows + x, COLS, rows_per_chunk, world_size) for x in extra]


def impls(device: str):
    out = {"reference": (pack_shards_reference, unpack_gathered_reference)}
    if _ext.available() and (device == "cpu" or _ext.cuda_built()):
        out["cpp"] = (torch.ops.elastic.pack_shards, torch.ops.elastic.unpack_gathered)
    if device == "cuda":
        from elastic_kernels.ops import pack_triton

        pack_triton.register_ops()  # they register on first need (elastic_kernels/ops/_lazy.py)

        out["triton"] = (torch.ops.elastic.pack_shards_triton, torch.ops.elastic.unpack_gathered_triton)
    return out


def baseline_pack(shards, slice_numels, begins, ends):
    return torch.cat([t[b * s : e * s] for t, s, b, e in zip(shards, slice_numels, begins, ends)])


def baseline_unpack(gathered, world_size, slice_numels, counts, dests):
    blocks = gathered.view(world_size, -1)
    k, seg = 0, 0
    for s, count in zip(slice_numels, counts):
        for j in range(count):
            d = dests[k].view(-1)
            base = seg + j * s
            full, tail = divmod(d.numel(), s)
            if full:
                d[: full * s].view(full, s).copy_(blocks[:full, base : base + s])
            if tail:
                d[full * s :].copy_(blocks[full, base : base + tail])
            k += 1
        seg += count * s


def raw(t):
    return t.reshape(-1).view(torch.uint8)


def bench_one(device, dtype, total_mib, n_weights, world_size, fns, warmup, repeats):
    es = torch.empty((), dtype=dtype).element_size()
    layouts = gather_layouts(total_mib * MIB, n_weights, world_size, es)
    slice_numels = [lay.slice_numel for lay in layouts]
    begins = [0] * len(layouts)
    ends = [lay.num_chunks for lay in layouts]
    gen = torch.Generator().manual_seed(0)
    shards = [torch.randn(lay.shard_numel, generator=gen).to(dtype).to(device) for lay in layouts]
    per_rank = sum(lay.shard_numel for lay in layouts)
    gathered = torch.randn(world_size * per_rank, generator=gen).to(dtype).to(device)
    dests = [torch.empty(lay.chunk_shape(c), dtype=dtype, device=device) for lay in layouts for c in range(lay.num_chunks)]

    pack_args = (shards, slice_numels, begins, ends)
    unpack_args = (gathered, world_size, slice_numels, ends, dests)
    pack_bytes = 2 * per_rank * es
    unpack_bytes = 2 * sum(d.numel() for d in dests) * es
    want_pack = pack_shards_reference(*pack_args)
    want_dests = [torch.empty_like(d) for d in dests]
    unpack_gathered_reference(gathered, world_size, slice_numels, ends, want_dests)

    def measure(fn):
        return harness.measure(fn, device, warmup=warmup, repeats=repeats)

    results = []  # (op, impl, seconds, payload bytes)
    for op, nbytes in (("pack", pack_bytes), ("unpack", unpack_bytes)):
        src = torch.ones(nbytes // 2, dtype=torch.uint8, device=device)
        dst = torch.empty_like(src)
        results.append((op, "memcpy", measure(lambda: dst.copy_(src)), nbytes))
    results.append(("pack", "torch.cat", measure(lambda: baseline_pack(*pack_args)), pack_bytes))
    results.append(("unpack", "copy_", measure(lambda: baseline_unpack(*unpack_args)), unpack_bytes))
    for name, (pack, unpack) in fns.items():
        got = pack(*pack_args)
        assert torch.equal(raw(got), raw(want_pack)), f"{name} pack differs from the reference"
        for d in dests:
            d.zero_()
        unpack(*unpack_args)
        assert all(torch.equal(raw(d), raw(w)) for d, w in zip(dests, want_dests)), f"{name} unpack differs"
        results.append(("pack", name, measure(lambda: pack(*pack_args)), pack_bytes))
        results.append(("unpack", name, measure(lambda: unpack(*unpack_args)), unpack_bytes))
    return results, len(dests)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--results", default=None, help="folder for pack.csv (default bench/results or $ELASTIC_BENCH_RESULTS)")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--weights", type=int, default=4, help="weights coalesced in one gather")
    ap.add_argument("--sizes-mib", type=int, nargs="*", default=None, help="total gather sizes (default: 1 4 16, CUDA also 64)")
    ap.add_argument("--world-sizes", type=int, nargs="*", default=[2, 4, 8])
    ap.add_argument("--repeats", type=int, default=11)
    ap.add_argument("--threads", type=int, default=None, help="torch intra-op threads (CPU; default: torch's)")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)

    device = args.device
    if device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device available")
    dtype = getattr(torch, args.dtype)
    sizes = args.sizes_mib or ([1, 4, 16, 64] if device == "cuda" else [1, 4, 16])
    fns = impls(device)
    ctx = harness.context(device)
    print(f"bench_pack: {ctx['device']}, torch {ctx['torch']}, threads {torch.get_num_threads()}, "
          f"impls {sorted(fns)}, dtype {args.dtype}, {args.weights} weights per gather")

    rows = []
    for total_mib in sizes:
        for world_size in args.world_sizes:
            results, n_dests = bench_one(device, dtype, total_mib, args.weights, world_size, fns, 3, args.repeats)
            ceiling = {op: nbytes / t / 1e9 for op, impl, t, nbytes in results if impl == "memcpy"}
            base = {op: nbytes / t / 1e9 for op, impl, t, nbytes in results if impl in ("torch.cat", "copy_")}
            for op, impl, t, nbytes in results:
                gbps = nbytes / t / 1e9
                rows.append({
                    **ctx,
                    "threads": torch.get_num_threads() if device == "cpu" else 0,
                    "op": op,
                    "impl": impl,
                    "dtype": args.dtype,
                    "total_mib": total_mib,
                    "weights": args.weights,
                    "dests": n_dests,
                    "world_size": world_size,
                    "bytes_moved": nbytes,
                    "time_us": round(t * 1e6, 2),
                    "gbps": round(gbps, 2),
                    "vs_baseline": round(gbps / base[op], 3),
                    "pct_of_memcpy": round(100 * gbps / ceiling[op], 1),
                })
    harness.print_table(rows, ["op", "impl", "total_mib", "world_size", "dests", "time_us", "gbps", "vs_baseline", "pct_of_memcpy"])
    path = harness.append_rows("pack", rows, args.results)
    print(f"rows appended to {path}")


if __name__ == "__main__":
    main()
