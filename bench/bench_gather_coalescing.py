"""How many chunks per all-gather: the measurement behind ElasticPolicy.collective_bytes.

    python bench/bench_gather_coalescing.py [--world-size 4] [--dim 2048] [--chunk-kib 256]

One frozen Linear(dim, dim) under the elastic runtime with keep = persist = 0, so every
forward gathers every chunk; `execute` computes each chunk as soon as its collective is done.
The forward is timed (median of repeats, slowest rank, barriers around it) for collective caps
of 1, 4 and 16 chunks and the whole layer; few tokens show the communication alone, more
tokens how much of it the per-chunk compute hides. Rows go to
bench/results/gather_coalescing.csv.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.nn as nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench import harness  # noqa: E402
from tests._dist import run_distributed  # noqa: E402


def _worker(rank, world_size, args, caps):
    from elastic_kernels.api import ElasticPolicy, elasticize

    out = {}
    for tokens in args.tokens:
        x = torch.randn(tokens, args.dim)
        for cap in caps:
            torch.manual_seed(0)
            model = nn.Sequential(nn.Linear(args.dim, args.dim))
            model.requires_grad_(False)
            policy = ElasticPolicy(
                chunk_bytes=args.chunk_kib << 10, keep_ratio=0.0, persist_ratio=0.0,
                collective_bytes=None if cap is None else cap * (args.chunk_kib << 10),
            )
            elasticize(model, policy)
            with torch.no_grad():
                for _ in range(2):
                    model(x)
                times = []
                for _ in range(args.repeats):
                    dist.barrier()
                    t0 = time.perf_counter()
                    model(x)
                    dist.barrier()
                    times.append(time.perf_counter() - t0)
            out[(tokens, cap)] = statistics.median(times)
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--world-size", type=int, default=4)
    p.add_argument("--dim", type=int, default=2048)
    p.add_argument("--chunk-kib", type=int, default=256)
    p.add_argument("--tokens", type=int, nargs="+", default=[8, 256])
    p.add_argument("--repeats", type=int, default=9)
    p.add_argument("--results", default=None)
    args = p.parse_args(argv)
    layer_chunks = -(-args.dim * args.dim * 4 // (args.chunk_kib << 10))
    caps = [c for c in (1, 4, 16) if c < layer_chunks] + [None]
    res = run_distributed(_worker, args.world_size, args, caps, timeout=1800)[0]
    ctx = harness.context("cpu")
    rows = []
    for tokens in args.tokens:
        base = res[(tokens, None)]
        for cap in caps:
            t = res[(tokens, cap)]
            rows.append({
                **ctx, "world_size": args.world_size, "dim": args.dim, "chunk_kib": args.chunk_kib,
                "tokens": tokens, "chunks_per_collective": cap or layer_chunks,
                "collectives_per_layer": -(-layer_chunks // (cap or layer_chunks)),
                "forward_ms": round(t * 1e3, 2), "speedup_vs_one_collective": round(base / t, 3),
            })
    harness.print_table(rows, ["tokens", "chunks_per_collective", "collectives_per_layer", "forward_ms", "speedup_vs_one_collective"])
    print("rows appended to", harness.append_rows("gather_coalescing", rows, args.results))


if __name__ == "__main__":
    main()
