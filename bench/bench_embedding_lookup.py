"""The lookup of a sharded table: only the rows it reads, or the gathered table (issue 27 item 5,
[Note: a lookup reads only its rows] in python_api/nn/embedding.py).

    OMP_NUM_THREADS=1 .venv/bin/python -m torch.distributed.run --standalone --nproc-per-node 2 \\
        bench/bench_embedding_lookup.py [--model smollm2-135m-instruct] [--tokens 128] [--rounds 10]

The real model's input embedding under the runtime (shard_embeddings, budget 0), each rank
looking up `--tokens` random ids (distinct ids are the worst case for the rows): (a) the
ElasticEmbedding's lookup (an exchange of the rows read), (b) every row block gathered
through the runtime (`use`, as the head does) and the rows read from its chunks. Interleaved
(round k: a then b, round k+1 reversed), median of per-round time ratios b/a [min, max];
bytes received per lookup from the runtime's stats; CPU tensor growth during one lookup
(profiler memory events). Both give the table's bits (checked).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--rounds", type=int, default=10)
    opts = p.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    from transformers import AutoModelForCausalLM

    from elastic_kernels.api import ElasticPolicy
    from elastic_kernels.api.loading.pretrained import pretrained_dir
    from elastic_kernels.api.nn import LoRAConfig, convert_to_elastic, runtime_of
    from elastic_kernels.api.planning.peaks import profiled_growth
    from elastic_kernels.api.runtime import Phase

    model = AutoModelForCausalLM.from_pretrained(pretrained_dir(opts.model), dtype=torch.float32)
    table = model.get_input_embeddings().weight.detach().clone()
    model = convert_to_elastic(model, LoRAConfig(r=8, alpha=16, target_modules=("q_proj", "v_proj")),
                               ElasticPolicy(pool_budget_bytes=0, keep_ratio=0.0, persist_ratio=0.0,
                                             shard_embeddings=True))
    rt, emb = runtime_of(model), model.get_input_embeddings()
    ids = torch.randint(0, emb.num_embeddings, (opts.tokens,), generator=torch.Generator().manual_seed(rank))

    def rows():
        return emb(ids)

    def gathered():
        out = torch.empty(ids.numel(), emb.embedding_dim)
        for et, start in zip(emb.ets, emb._starts):
            with rt.use(et, Phase.FORWARD) as resident:
                chunks = resident.chunks()
                rpc = et.layout.rows_per_chunk
                for i, t in enumerate(ids.tolist()):
                    if start <= t < start + et.shape[0]:
                        c, q = divmod(t - start, rpc)
                        out[i] = chunks[c][q]
        return out

    ways = {"rows": rows, "gathered table": gathered}
    stats = {}
    for name, fn in ways.items():
        assert torch.equal(fn(), table[ids]), name
        rt.reset_stats()
        fn()
        st = rt.stats()
        stats[name] = {"bytes": st["allgather_bytes"], "calls": st["allgather_calls"], "growth": profiled_growth(fn)}
    times = {n: [] for n in ways}
    for k in range(opts.rounds):
        for name in (list(ways) if k % 2 == 0 else list(ways)[::-1]):
            dist.barrier()
            t0 = time.perf_counter()
            ways[name]()
            times[name].append(time.perf_counter() - t0)
    ratios = [b / a for a, b in zip(times["rows"], times["gathered table"])]
    if rank == 0:
        distinct = torch.unique(ids).numel()
        print(f"{opts.model}: table {emb.num_embeddings} x {emb.embedding_dim} in {len(emb.ets)} blocks, "
              f"{opts.tokens} ids per rank ({distinct} distinct on rank 0), {dist.get_world_size()} ranks")
        print("| lookup | all-gather bytes received | collectives | tensor growth MiB | median ms |")
        print("|---|---:|---:|---:|---:|")
        for name in ways:
            s = stats[name]
            print(f"| {name} | {s['bytes']:,} | {s['calls']} | {s['growth'] / 2**20:.2f} | "
                  f"{1e3 * statistics.median(times[name]):.2f} |")
        print(f"gathered table / rows, time per lookup: median of {len(ratios)} per-round ratios "
              f"{statistics.median(ratios):.1f}x [{min(ratios):.1f}, {max(ratios):.1f}]")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
