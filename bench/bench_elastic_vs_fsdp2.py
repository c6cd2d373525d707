"""Elastic frozen weights against FSDP2, one model, one batch, all in one run (CPU, gloo).

    python bench/bench_elastic_vs_fsdp2.py [--world-size 4] [--layers 8] [--dim 1024]

Model: a stack of frozen Linear(dim, dim) layers, each with a trainable rank-r adapter beside
it (y = tanh(W x + b + B A x)); one SGD step on the adapters per iteration. Configurations,
each on a fresh copy of the same model, in the same process group:
  fsdp2-reshard      fully_shard per block, reshard_after_forward=True
  fsdp2-no-reshard   fully_shard per block, reshard_after_forward=False
  elastic-0%         keep = persist = 1, pool budget 0% of the frozen bytes
  elastic-50%        ... 50%
  elastic-100%       ... 100%
Per configuration: median step time over the repeats (after warm-up; barriers around each
step, so it is the slowest rank's time), all-gather bytes received per rank per step (every
all-gather wrapped and counted, FSDP2's too), and rank 0's peak resident memory during a step
above its baseline before any model was built (freed heap returned with malloc_trim, then
VmHWM reset through /proc/self/clear_refs before each step): shards, cached or unsharded
weights, activations and optimizer state. The counter and the memory probes live in
python_api/finetune/measure.py, shared with the fine-tuning CLI. Rows go to
bench/results/elastic_vs_fsdp2.csv.
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
from elastic_kernels.api.finetune.measure import AllGatherCounter, reset_rss_peak, rss_peak_bytes  # noqa: E402
from tests._dist import run_distributed  # noqa: E402

CONFIGS = ["fsdp2-reshard", "fsdp2-no-reshard", "elastic-0%", "elastic-50%", "elastic-100%"]


class Block(nn.Module):
    def __init__(self, dim, r):
        super().__init__()
        self.base = nn.Linear(dim, dim)
        self.base.requires_grad_(False)
        self.A = nn.Linear(dim, r, bias=False)
        self.B = nn.Linear(r, dim, bias=False)

    def forward(self, x):
        return torch.tanh(self.base(x) + self.B(self.A(x)))


def _build(kind, args, world_size):
    from elastic_kernels.api import ElasticPolicy, elasticize

    torch.manual_seed(0)
    model = nn.Sequential(*[Block(args.dim, args.rank) for _ in range(args.layers)])
    if kind.startswith("fsdp2"):
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (world_size,))
        for block in model:
            fully_shard(block, mesh=mesh, reshard_after_forward=(kind == "fsdp2-reshard"))
        fully_shard(model, mesh=mesh)
    else:
        frac = float(kind.split("-")[1].rstrip("%")) / 100
        frozen = args.layers * args.dim * args.dim * 4
        policy = ElasticPolicy(
            chunk_bytes=args.chunk_kib << 10, keep_ratio=1.0, persist_ratio=1.0,
            pool_budget_bytes=int(frac * frozen), collective_bytes=args.collective_kib << 10,
        )
        elasticize(model, policy)
    return model


def _worker(rank, world_size, args):
    torch.manual_seed(100 + rank)
    x = torch.randn(args.tokens, args.dim)
    counter = AllGatherCounter().install()
    baseline = reset_rss_peak()
    out = {}
    for kind in CONFIGS:
        model = _build(kind, args, world_size)
        opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=1e-3)

        def step():
            loss = model(x).square().mean()
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

        for _ in range(args.warmup):
            step()
        times, gathered, peaks = [], [], []
        for _ in range(args.repeats):
            dist.barrier()
            reset_rss_peak()
            before = counter.bytes
            t0 = time.perf_counter()
            step()
            dist.barrier()
            times.append(time.perf_counter() - t0)
            gathered.append(counter.bytes - before)
            peaks.append(rss_peak_bytes() - baseline)
        out[kind] = (statistics.median(times), statistics.median(gathered), max(peaks))
        model = opt = None  # free them before the next configuration (not del: step() closes over them)
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--world-size", type=int, default=4)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--dim", type=int, default=1024)
    p.add_argument("--rank", type=int, default=8, help="adapter rank r")
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--chunk-kib", type=int, default=1024)
    p.add_argument("--collective-kib", type=int, default=32 << 10)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--results", default=None, help="results folder (default bench/results)")
    args = p.parse_args(argv)

    per_rank = run_distributed(_worker, args.world_size, args, timeout=1800)
    base_t = per_rank[0]["fsdp2-reshard"][0]
    ctx = harness.context("cpu")
    rows = []
    for kind in CONFIGS:
        t, b, peak = per_rank[0][kind]
        rows.append({
            **ctx,
            "world_size": args.world_size, "layers": args.layers, "dim": args.dim, "tokens": args.tokens,
            "adapter_rank": args.rank, "chunk_kib": args.chunk_kib, "config": kind,
            "step_ms": round(t * 1e3, 2), "speedup_vs_fsdp2_reshard": round(base_t / t, 3),
            "allgather_MiB_per_step": round(b / 2**20, 3), "peak_rss_MiB": round(peak / 2**20, 1),
        })
    harness.print_table(rows, ["config", "step_ms", "speedup_vs_fsdp2_reshard", "allgather_MiB_per_step", "peak_rss_MiB"])
    print("rows appended to", harness.append_rows("elastic_vs_fsdp2", rows, args.results))


if __name__ == "__main__":
    main()
