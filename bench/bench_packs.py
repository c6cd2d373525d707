"""Pipeline packs: pack size and schedule against throughput, memory, bubble and bytes moved,
measured beside the cost model's prediction, and the same table simulated for Tiny-Pipe's
setting.

    python bench/bench_packs.py [--world-size 4] [--layers 16] [--steps 3] [--no-measure] [--no-simulate]

Measured (4 gloo ranks, pp 2 x dp 2): the demo model's shape with 16 layers (hidden 256,
intermediate 688, 8 heads / 4 KV heads, vocabulary 257), 128-token sequences, global batch 16
(micro-batch 2 x 2 accumulation x 4 ranks: each dp group's 8 sequences in 4 micro-batches of
2), LoRA r 8 on the 7 projections. Pack sizes 8 (one pack per rank: gpipe, 1f1b), 4, 2 and 1
(2, 4 and 8 packs per rank: looped-bfs, interleaved-1f1b), at residency "phase" (Tiny-Pipe's:
a pack is loaded for its forwards, released, loaded again for its backwards) with a window of
one pack, the frozen weights streamed from the host store ("host") or gathered from the dp
peer ("peers"). Every configuration is run twice, in two passes of opposite order (the second
pass reversed), each time on a fresh model: its median step time over --steps steps after one
warm-up step gives tokens/s, the bubble is the measured idle fraction per rank
(PipelinedModel.last_step), bytes are rank 0's per step, the peak is rank 0's tensor peak of one
step (measure_step_peak_bytes, pass 1). The prediction is `simulate` on a pipeline profile
built from the plain planner's measured profile of the pp = 1 model (every rank measuring its
own copy at once, so the cores are as contended as in the runs) with the links of this
process group measured here (dp all-gather, P2P, host-store copy: two sizes, median of 5,
latency + bytes / bandwidth). The planner's choice among the measured configurations
(plan_pipeline on the same profile, restricted to them) is marked, with its distance from the
best measured tokens/s. Rows: bench/results/packs.csv.

Simulated (`--no-measure` for this part alone): GPT-2 XL and Llama-2 7B on 4 x 24 GB PCIe GPUs
(planner/pipeline_model.py PIPE_DEVICES["pcie-24g"], assumptions stated there), pp 4 x dp 1,
weights streamed from the host (Tiny-Pipe's setting), sequence 1024, global batch 16 and 128
(8x the micro-batches), every pack size giving 4 x v packs, looped-bfs and interleaved-1f1b,
residency phase, window 1: predicted step time, tokens/s, peak memory, bubble and bytes. These
rows are a SIMULATION (column kind = "simulation"), nothing ran on such GPUs. Rows:
bench/results/packs_simulated.csv.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench import harness  # noqa: E402
from tests._dist import run_distributed  # noqa: E402

MiB = 2**20
SEQ, MBS, M = 128, 2, 4
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def measured_configs(layers: int, pp: int) -> list[tuple]:
    """(schedule, pack size, source) of the measured table."""
    out = []
    for source in ("host", "peers"):
        stage = layers // pp
        for schedule in ("gpipe", "1f1b"):
            out.append((schedule, stage, source))
        for size in (stage // 2, stage // 4, stage // 8):
            if size >= 1:
                for schedule in ("looped-bfs", "interleaved-1f1b"):
                    out.append((schedule, size, source))
    return out


def _time_link(fn, sizes) -> tuple[float, float]:
    """latency, bytes/s from the median of 5 timed calls at two sizes."""
    from python_api.planner.profile import Link

    ts = []
    for n in sizes:
        fn(n)
        runs = []
        for _ in range(5):
            t0 = time.perf_counter()
            fn(n)
            runs.append(time.perf_counter() - t0)
        ts.append(statistics.median(runs))
    per_byte = max(1e-15, (ts[1] - ts[0]) / (sizes[1] - sizes[0]))
    return Link(latency_s=max(0.0, ts[0] - per_byte * sizes[0]), bytes_per_s=1.0 / per_byte)


def _links(groups):
    """The dp group's all-gather, the pp group's P2P and a host-store-like copy, timed here;
    MAX over the ranks (one decision everywhere)."""
    import torch.distributed as dist

    from python_api.distributed.collectives import all_gather_into
    from python_api.planner.profile import Link

    def gather(n):
        x = torch.empty(n // 4 // groups.dp)
        out = torch.empty(x.numel() * groups.dp)
        all_gather_into(out, x, groups.dp_group, async_op=False)

    peer = groups.pp_group
    me, other = dist.get_rank(peer), 1 - dist.get_rank(peer)
    ranks = dist.get_process_group_ranks(peer)

    def p2p(n):
        t = torch.empty(n // 4)
        if me == 0:
            dist.send(t, ranks[other], group=peer)
            dist.recv(t, ranks[other], group=peer)
        else:
            dist.recv(t, ranks[other], group=peer)
            dist.send(t, ranks[other], group=peer)

    src, dst = torch.empty(16 << 20, dtype=torch.uint8), torch.empty(16 << 20, dtype=torch.uint8)

    def copy(n):
        dst[:n].copy_(src[:n])

    links = {"allgather": _time_link(gather, (1 << 20, 8 << 20)),
             "p2p": _time_link(p2p, (64 << 10, 1 << 20)),
             "h2d": _time_link(copy, (1 << 20, 16 << 20))}
    t = torch.tensor([[v.latency_s, 1.0 / v.bytes_per_s] for v in links.values()], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    for (k, _), row in zip(list(links.items()), t.tolist()):
        links[k] = Link(row[0], 1.0 / row[1])
    # p2p was timed as a round trip: one direction is half
    links["p2p"] = Link(links["p2p"].latency_s / 2, links["p2p"].bytes_per_s * 2)
    return links


def _worker(rank, world_size, args, configs):
    import copy
    import gc

    import torch.distributed as dist

    from python_api import ElasticPolicy, LoRAConfig, convert_to_elastic
    from python_api.finetune.models import embedded_config, embedded_model
    from python_api.loading import empty_model
    from python_api.pipeline import PipelinedModel, PipelineLayout, pipeline_groups
    from python_api.pipeline.profile import measure_step_peak_bytes, pipeline_profile
    from python_api.planner.pipeline_model import plan_pipeline, simulate
    from python_api.planning.measure import _live_tensor_bytes, measure_profile

    torch.set_num_threads(1)
    cfg = embedded_config(256, 688, args.layers, 8, 4)
    lora = LoRAConfig(r=8, alpha=16, target_modules=TARGETS)
    chunk = args.chunk_kib << 10
    groups = pipeline_groups(args.pp, "cpu", timeout_s=600)
    solo = [dist.new_group([r]) for r in range(world_size)][rank]
    ids = torch.randint(0, cfg.vocab_size, (MBS, SEQ), generator=torch.Generator().manual_seed(7))
    ref = convert_to_elastic(embedded_model(cfg, 0), lora, ElasticPolicy(chunk_bytes=chunk), group=solo)
    measured = measure_profile(ref, [ids], capacity_bytes=16 << 30, host_tier=True)
    del ref
    links = _links(groups)
    profiles = {}
    for source in ("host", "peers"):
        policy = ElasticPolicy(chunk_bytes=chunk, weights_on="host" if source == "host" else "device")
        prof = pipeline_profile(empty_model(copy.deepcopy(cfg)), lora, policy, measured, world_size=world_size)
        profiles[source] = dataclasses.replace(prof, allgather=links["allgather"], p2p=links["p2p"], h2d=links["h2d"])
    gen = torch.Generator().manual_seed(11)
    batches = [torch.randint(0, cfg.vocab_size, (groups.dp, M * MBS, SEQ), generator=gen) for _ in range(1 + args.steps)]
    results = {}
    for pass_ in (0, 1):
        for schedule, size, source in (configs if pass_ == 0 else list(reversed(configs))):
            layout = PipelineLayout.build(world_size, args.pp, args.layers, schedule, M, pack_size=size,
                                          residency=args.residency, window=args.window)
            policy = ElasticPolicy(chunk_bytes=chunk, weights_on="host" if source == "host" else "device")
            gc.collect()  # the previous configuration's model (its modules and hooks hold cycles)
            before = _live_tensor_bytes()  # the batches, the profile: not this configuration's
            pipe = PipelinedModel(embedded_model(cfg, 0), lora, policy, layout, groups, micro_batch_size=MBS,
                                  seq_len=SEQ)
            opt = torch.optim.AdamW(pipe.parameters(), lr=1e-4)
            times, idle, st = [], [], None
            for s, b in enumerate(batches):
                dist.barrier()
                t0 = time.perf_counter()
                pipe.train_step(b[groups.dp_rank])
                opt.step()
                opt.zero_grad(set_to_none=True)
                dist.barrier()
                if s:
                    times.append(time.perf_counter() - t0)
                    idle.append(pipe.last_step["idle_fraction"])
                st = dict(pipe.last_step)
            peak = measure_step_peak_bytes(pipe, lambda p=pipe: p.train_step(batches[0][groups.dp_rank])) - before \
                if pass_ == 0 else None
            key = (schedule, size, source)
            r = results.setdefault(key, {"times": [], "idle": [], "peak": None})
            r["times"] += times
            r["idle"] += idle
            r["peak"] = peak if peak is not None else r["peak"]
            r["bytes"] = (st["allgather_bytes"], st["h2d_bytes"], st["p2p_send_bytes"])
            pipe.close()
            pipe = opt = None
    preds = {}
    for schedule, size, source in configs:
        layout = PipelineLayout.build(world_size, args.pp, args.layers, schedule, M, pack_size=size,
                                      residency=args.residency, window=args.window)
        p = simulate(profiles[source], layout, MBS)
        preds[(schedule, size, source)] = (p.step_s, p.peak_bytes[groups.pp_rank], p.bubble[groups.pp_rank],
                                           p.allgather_bytes[groups.pp_rank], p.h2d_bytes[groups.pp_rank],
                                           p.p2p_send_bytes[groups.pp_rank])
    choice = {}
    for source in ("host", "peers"):
        stage = args.layers // args.pp
        plan = plan_pipeline(profiles[source], 16 << 30, groups.dp * M * MBS, pp=args.pp, micro_batches=M,
                             residencies=(args.residency,), windows=(args.window,),
                             pack_sizes=[s for s in (stage, stage // 2, stage // 4, stage // 8) if s >= 1],
                             simulate_top=32)
        lay = plan.prediction.layout
        choice[source] = (lay.schedule, lay.layers_of_pack(0).stop - lay.layers_of_pack(0).start)
    return results, preds, choice


def measure(args) -> None:
    configs = measured_configs(args.layers, args.pp)
    per_rank = run_distributed(_worker, args.world_size, args, configs, timeout=7200)
    results, preds, choice = per_rank[0]
    ctx = harness.context("cpu")
    tokens = (args.world_size // args.pp) * M * MBS * SEQ  # the global batch: 16 sequences of 128
    rows = []
    for key in configs:
        schedule, size, source = key
        r, p = results[key], preds[key]
        step = statistics.median(r["times"])
        rows.append({
            **ctx, "kind": "measured", "model": f"embedded Llama {args.layers} layers hidden 256",
            "world_size": args.world_size, "pp": args.pp, "dp": args.world_size // args.pp, "schedule": schedule,
            "pack_size": size, "packs": args.layers // size, "residency": args.residency, "window": args.window,
            "source": source, "micro_batches": M, "micro_batch": MBS, "seq_len": SEQ,
            "steps_per_pass": args.steps, "tokens_per_s": round(tokens / step, 1),
            "predicted_tokens_per_s": round(tokens / p[0], 1),
            "step_s_pass1": round(statistics.median(r["times"][: args.steps]), 4),
            "step_s_pass2": round(statistics.median(r["times"][args.steps:]), 4),
            "peak_MiB": round(r["peak"] / MiB, 2), "predicted_peak_MiB": round(p[1] / MiB, 2),
            "bubble": round(statistics.median(r["idle"]), 3), "predicted_bubble": round(p[2], 3),
            "allgather_MiB": round(r["bytes"][0] / MiB, 3), "predicted_allgather_MiB": round(p[3] / MiB, 3),
            "h2d_MiB": round(r["bytes"][1] / MiB, 3), "predicted_h2d_MiB": round(p[4] / MiB, 3),
            "p2p_MiB": round(r["bytes"][2] / MiB, 3), "predicted_p2p_MiB": round(p[5] / MiB, 3),
            "planner_choice": (schedule, size) == choice[source],
        })
    for source in ("host", "peers"):
        mine = [r for r in rows if r["source"] == source]
        best = max(r["tokens_per_s"] for r in mine)
        for r in mine:
            r["vs_best_measured"] = round(r["tokens_per_s"] / best, 3)
    harness.print_table(rows, ["source", "schedule", "pack_size", "tokens_per_s", "predicted_tokens_per_s",
                               "peak_MiB", "predicted_peak_MiB", "bubble", "predicted_bubble", "allgather_MiB",
                               "h2d_MiB", "p2p_MiB", "planner_choice", "vs_best_measured"])
    print("rows appended to", harness.append_rows("packs", rows, args.results))


def simulate_tiny_pipe(args) -> None:
    from python_api.planner.pipeline import PipelineLayout, divisors
    from python_api.planner.pipeline_model import simulate as sim, synthetic_pipeline_profile

    ctx = harness.context("cpu")
    rows = []
    for shape in ("gpt2-xl", "llama2-7b"):
        prof = synthetic_pipeline_profile(shape, 4, 1024, "pcie-24g", weights_on="host")
        L = len(prof.layers)
        for global_batch in (16, 128):
            m = global_batch  # micro-batches of one sequence: Tiny-Pipe's
            best = None
            mine = []
            for v in [d for d in divisors(L // 4)]:
                size = L // (4 * v)
                for schedule in ("looped-bfs", "interleaved-1f1b"):
                    try:
                        layout = PipelineLayout.build(4, 4, L, schedule, m, pack_size=size, residency="phase", window=1)
                    except Exception:  # noqa: BLE001 - a schedule rule (rounds): not a candidate
                        continue
                    p = sim(prof, layout, 1)
                    row = {**ctx, "kind": "simulation", "model": shape, "device": prof.device, "world_size": 4,
                           "pp": 4, "dp": 1, "schedule": schedule, "pack_size": size, "packs": layout.n_packs,
                           "residency": "phase", "window": 1, "source": "host", "global_batch": global_batch,
                           "micro_batches": m, "micro_batch": 1, "seq_len": 1024,
                           "predicted_step_s": round(p.step_s, 4), "predicted_tokens_per_s": round(p.tokens_per_s, 1),
                           "predicted_peak_GiB": round(p.peak / 2**30, 2), "fits_24GB": p.peak <= 24 * 2**30,
                           "predicted_bubble": round(max(p.bubble), 3),
                           "predicted_h2d_GiB_per_step_rank0": round(p.h2d_bytes[0] / 2**30, 3),
                           "predicted_p2p_MiB_per_step_rank0": round(p.p2p_send_bytes[0] / MiB, 1)}
                    mine.append(row)
                    if row["fits_24GB"] and (best is None or p.step_s < best):
                        best = p.step_s
            for row in mine:
                row["best_fitting"] = best is not None and row["predicted_step_s"] == round(best, 4)
            rows += mine
    harness.print_table(rows, ["model", "global_batch", "schedule", "pack_size", "predicted_step_s",
                               "predicted_peak_GiB", "predicted_bubble", "predicted_h2d_GiB_per_step_rank0",
                               "best_fitting"])
    print("SIMULATION (no such GPUs ran); rows appended to", harness.append_rows("packs_simulated", rows, args.results))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--world-size", type=int, default=4)
    p.add_argument("--pp", type=int, default=2)
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--steps", type=int, default=3, help="timed steps per configuration and pass")
    p.add_argument("--residency", default="phase")
    p.add_argument("--window", type=int, default=1)
    p.add_argument("--chunk-kib", type=int, default=256)
    p.add_argument("--no-measure", action="store_true")
    p.add_argument("--no-simulate", action="store_true")
    p.add_argument("--results", default=None, help="results folder (default bench/results)")
    args = p.parse_args(argv)
    if not args.no_simulate:
        simulate_tiny_pipe(args)
    if not args.no_measure:
        measure(args)


if __name__ == "__main__":
    main()
