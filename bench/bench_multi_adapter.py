"""K LoRA adapters trained in one elastic model against the same K adapters trained one after
another (K elastic models, the same policy), on the same process group (issue 29, the library
part; the CLI's --sweep / --compare-sequential are the job-level version).

    python -m torch.distributed.run --nproc_per_node 2 bench/bench_multi_adapter.py --k 4

Every adapter gets the same rows in both jobs (one sequence of --seq tokens per adapter per
step). Rounds are interleaved (round i: the K-adapter step, then the K solo steps; round i+1 in
the reverse order) and the figure is the median over rounds of (time of the K solo steps) /
(time of the K-adapter step): the aggregate tokens/s ratio. Also printed: the frozen-weight
bytes each rank gathers per step (stats()["allgather_bytes"]) in both jobs.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist

from elastic_kernels.api import ElasticPolicy, LoRAConfig, adapter_parameters, load_elastic
from elastic_kernels.api.loading.pretrained import pretrained_dir
from elastic_kernels.api.nn import reset_stats, stats


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--budget", choices=["0", "all"], default="0")
    args = ap.parse_args()
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    rank = dist.get_rank()
    policy = (ElasticPolicy(pool_budget_bytes=0, keep_ratio=0.0, persist_ratio=0.0) if args.budget == "0"
              else ElasticPolicy(keep_ratio=1.0, persist_ratio=1.0))
    cfgs = {f"s{i}": LoRAConfig(r=8, alpha=16, target_modules=("q_proj", "v_proj"), seed=i) for i in range(args.k)}
    path = pretrained_dir(args.model)
    multi = load_elastic(path, cfgs, policy)
    solo = {n: load_elastic(path, c, policy) for n, c in cfgs.items()}
    opt_m = {n: torch.optim.AdamW(adapter_parameters(multi, n), lr=1e-4) for n in cfgs}
    opt_s = {n: torch.optim.AdamW(adapter_parameters(solo[n]), lr=1e-4) for n in cfgs}
    names = list(cfgs)
    vocab = multi.config.vocab_size
    gen = torch.Generator().manual_seed(rank)
    bytes_ = {}

    def multi_step(ids):
        reset_stats(multi)
        multi(input_ids=ids, labels=ids, adapter_names=names).loss.backward()
        for o in opt_m.values():
            o.step()
            o.zero_grad(set_to_none=True)
        bytes_["multi"] = stats(multi)["allgather_bytes"]

    def solo_steps(ids):
        total = 0
        for i, n in enumerate(names):
            reset_stats(solo[n])
            solo[n](input_ids=ids[i:i + 1], labels=ids[i:i + 1]).loss.backward()
            opt_s[n].step()
            opt_s[n].zero_grad(set_to_none=True)
            total += stats(solo[n])["allgather_bytes"]
        bytes_["solo"] = total

    def timed(fn, ids):
        dist.barrier()
        t0 = time.perf_counter()
        fn(ids)
        dist.barrier()
        return time.perf_counter() - t0

    ratios = []
    for r in range(args.rounds + 1):  # round 0: warm-up (learned orders, first gathers)
        ids = torch.randint(0, vocab, (args.k, args.seq), generator=gen)
        order = [("multi", multi_step), ("solo", solo_steps)]
        if r % 2:
            order.reverse()
        t = {name: timed(fn, ids) for name, fn in order}
        if r:
            ratios.append(t["solo"] / t["multi"])
        if rank == 0:
            print(f"round {r}: multi {t['multi']:.2f} s, {args.k} solo {t['solo']:.2f} s, "
                  f"ratio {t['solo'] / t['multi']:.3f}{' (warm-up)' if not r else ''}", flush=True)
    if rank == 0:
        print(f"K={args.k} budget {args.budget}, seq {args.seq}, world {dist.get_world_size()}: "
              f"aggregate tokens/s ratio (K-adapter job / {args.k} sequential) median {statistics.median(ratios):.3f} "
              f"over {len(ratios)} rounds {[round(x, 3) for x in ratios]}; gathered bytes per step per rank: "
              f"K-adapter {bytes_['multi']}, {args.k} solo together {bytes_['solo']}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
