"""Pipeline packs: pack size and schedule against throughput, memory, bubble and bytes moved,
measured beside the cost model's prediction, and the same table simulated for Tiny-Pipe's
setting.

    python bench/bench_packs.py [--world-size 4] [--layers 16] [--steps 3] [--no-measure] [--no-simulate]
    python bench/bench_packs.py --check [--overhead-ms STAGE,SCHEDULE]     # the model against packs.csv

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
latency + bytes / bandwidth) and the per-action overhead measured by
`measure_action_overhead` (every rank at once; [Note: measuring the per-action overhead] in
python_api/pipeline/profile.py), printed. The planner's choice among the measured
configurations (plan_pipeline on the same profile, restricted to them) is marked, with its
distance from the best measured tokens/s. Rows: bench/results/packs.csv; the two pipeline
profiles of the run (so that a later model can be checked against the same measurements):
one JSON line in bench/results/packs_profiles.jsonl.

Check (`--check`): the current model against the measured rows of packs.csv, per run (date
and commit): predicted tokens/s of every configuration from the run's saved profiles (or, for
a run that saved none, the 2026-12-02 one, a profile reconstructed from the run's own
predicted_tokens_per_s column: uniform layers whose forward and backward times, head times
and P2P latency (and for "peers" the all-gather link) are fitted so that the model without
per-action overhead reproduces those predictions; its fit error is printed), with the
per-action overhead measured now on --world-size ranks at once (or --overhead-ms). Printed:
Spearman's rank correlation of predicted and measured tokens/s (per source and over all the
run's rows) and, per source, the measured tokens/s of the configuration the planner would
pick divided by the best measured, beside the run's own planner_choice.

Simulated (`--no-measure` for this part alone): GPT-2 XL and Llama-2 7B on 4 x 24 GB PCIe GPUs
(planner/pipeline_synthetic.py PIPE_DEVICES["pcie-24g"], assumptions stated there), pp 4 x dp 1,
weights streamed from the host (Tiny-Pipe's setting), sequence 1024, global batch 16 and 128
(8x the micro-batches), every pack size giving 4 x v packs, looped-bfs and interleaved-1f1b,
residency phase, window 1: predicted step time, tokens/s, peak memory, bubble and bytes. These
rows are a SIMULATION (column kind = "simulation"), nothing ran on such GPUs. Rows:
bench/results/packs_simulated.csv.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
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
    from elastic_kernels.api.planner.profile import Link

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

    from elastic_kernels.api.distributed.collectives import all_gather_into
    from elastic_kernels.api.planner.profile import Link

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


def _profiles(rank, world_size, args, groups) -> dict:
    """The two pipeline profiles of the bench ("host", "peers"), on every rank at once: the
    plain planner's measured profile of the pp = 1 model, the links of this process group and
    the per-action overhead (module docstring)."""
    import copy

    import torch.distributed as dist

    from elastic_kernels.api import ElasticPolicy, LoRAConfig, convert_to_elastic
    from elastic_kernels.api.finetune.models import embedded_config, embedded_model
    from elastic_kernels.api.loading import empty_model
    from elastic_kernels.api.pipeline.profile import measure_action_overhead, pipeline_profile
    from elastic_kernels.api.planning.measure import measure_profile

    cfg = embedded_config(256, 688, args.layers, 8, 4)
    lora = LoRAConfig(r=8, alpha=16, target_modules=TARGETS)
    chunk = args.chunk_kib << 10
    solo = [dist.new_group([r]) for r in range(world_size)][rank]
    ids = torch.randint(0, cfg.vocab_size, (MBS, SEQ), generator=torch.Generator().manual_seed(7))
    ref = convert_to_elastic(embedded_model(cfg, 0), lora, ElasticPolicy(chunk_bytes=chunk), group=solo)
    measured = measure_profile(ref, [ids], capacity_bytes=16 << 30, host_tier=True)
    del ref
    links = _links(groups)
    overhead = measure_action_overhead(empty_model(copy.deepcopy(cfg)), seq_len=SEQ, micro_batch_size=MBS,
                                       p2p_latency_s=links["p2p"].latency_s)
    profiles = {}
    for source in ("host", "peers"):
        policy = ElasticPolicy(chunk_bytes=chunk, weights_on="host" if source == "host" else "device")
        prof = pipeline_profile(empty_model(copy.deepcopy(cfg)), lora, policy, measured, world_size=world_size,
                                micro_batch_size=MBS, action_overhead=overhead)
        profiles[source] = dataclasses.replace(prof, allgather=links["allgather"], p2p=links["p2p"], h2d=links["h2d"])
    return profiles


def _worker(rank, world_size, args, configs):
    import gc

    import torch.distributed as dist

    from elastic_kernels.api import ElasticPolicy, LoRAConfig
    from elastic_kernels.api.finetune.models import embedded_config, embedded_model
    from elastic_kernels.api.pipeline import PipelinedModel, PipelineLayout, pipeline_groups
    from elastic_kernels.api.pipeline.profile import measure_step_peak_bytes
    from elastic_kernels.api.planner.pipeline_model import simulate
    from elastic_kernels.api.planner.pipeline_search import plan_pipeline
    from elastic_kernels.api.planning.peaks import live_tensor_bytes

    torch.set_num_threads(1)
    cfg = embedded_config(256, 688, args.layers, 8, 4)
    lora = LoRAConfig(r=8, alpha=16, target_modules=TARGETS)
    chunk = args.chunk_kib << 10
    groups = pipeline_groups(args.pp, "cpu", timeout_s=600)
    profiles = _profiles(rank, world_size, args, groups)
    gen = torch.Generator().manual_seed(11)
    batches = [torch.randint(0, cfg.vocab_size, (groups.dp, M * MBS, SEQ), generator=gen) for _ in range(1 + args.steps)]
    results = {}
    for pass_ in (0, 1):
        for schedule, size, source in (configs if pass_ == 0 else list(reversed(configs))):
            layout = PipelineLayout.build(world_size, args.pp, args.layers, schedule, M, pack_size=size,
                                          residency=args.residency, window=args.window)
            policy = ElasticPolicy(chunk_bytes=chunk, weights_on="host" if source == "host" else "device")
            gc.collect()  # the previous configuration's model (its modules and hooks hold cycles)
            before = live_tensor_bytes()  # the batches, the profile: not this configuration's
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
        choice[source] = (lay.schedule, lay.n_layers // lay.n_packs)  # its boundaries may be balanced, not equal
    return results, preds, choice, profiles


def measure(args) -> None:
    configs = measured_configs(args.layers, args.pp)
    per_rank = run_distributed(_worker, args.world_size, args, configs, timeout=7200)
    results, preds, choice, profiles = per_rank[0]
    ctx = harness.context("cpu")
    prof = profiles["host"]
    print(f"per-action overhead (measured, MAX over the ranks): stage {prof.stage_overhead_s * 1e3:.3f} ms, "
          f"schedule {prof.schedule_overhead_s * 1e3:.3f} ms")
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
    path = os.path.join(harness.results_dir(args.results), "packs_profiles.jsonl")
    with open(path, "a") as f:
        f.write(json.dumps({"date": ctx["date"], "commit": ctx["commit"],
                            "profiles": {k: dataclasses.asdict(v) for k, v in profiles.items()}}) + "\n")
    print("profiles appended to", path)


# ---------------------------------------------------------------- the model against packs.csv

def profile_from_dict(d: dict):
    """A PipelineProfile from dataclasses.asdict of one (read back from JSON)."""
    from elastic_kernels.api.planner.pipeline_model import PipeLayer, PipelineProfile, PipeWeight
    from elastic_kernels.api.planner.profile import Link

    d = dict(d)
    for k in ("allgather", "allreduce", "p2p", "h2d"):
        if d.get(k) is not None:
            d[k] = Link(**d[k])
    d["layers"] = tuple(PipeLayer(**{**layer, "weights": tuple(PipeWeight(**w) for w in layer["weights"])})
                        for layer in d["layers"])
    d["head_weights"] = tuple(PipeWeight(**w) for w in d["head_weights"])
    return PipelineProfile(**d)


def _layout_of(row):
    from elastic_kernels.api.planner.pipeline import PipelineLayout

    return PipelineLayout.build(int(row["world_size"]), int(row["pp"]), int(row["model"].split()[2]),
                                row["schedule"], int(row["micro_batches"]), pack_size=int(row["pack_size"]),
                                residency=row["residency"], window=int(row["window"]))


def _predict(profile, rows) -> list[float]:
    from elastic_kernels.api.planner.pipeline_model import simulate

    out = []
    for r in rows:
        tokens = int(r["dp"]) * int(r["micro_batches"]) * int(r["micro_batch"]) * int(r["seq_len"])
        out.append(tokens / simulate(profile, _layout_of(r), int(r["micro_batch"])).step_s)
    return out


def _nelder_mead(f, x0, iters: int):
    """Minimise f from x0 (the plain Nelder-Mead simplex; no SciPy here)."""
    pts = [list(x0)] + [[v * (1.3 if j == i else 1.0) for j, v in enumerate(x0)] for i in range(len(x0))]
    vals = [f(p) for p in pts]
    for _ in range(iters):
        order = sorted(range(len(pts)), key=lambda i: vals[i])
        pts, vals = [pts[i] for i in order], [vals[i] for i in order]
        c = [sum(p[j] for p in pts[:-1]) / (len(pts) - 1) for j in range(len(x0))]
        xr = [2 * c[j] - pts[-1][j] for j in range(len(x0))]
        fr = f(xr)
        if fr < vals[0]:
            xe = [3 * c[j] - 2 * pts[-1][j] for j in range(len(x0))]
            fe = f(xe)
            pts[-1], vals[-1] = (xe, fe) if fe < fr else (xr, fr)
        elif fr < vals[-2]:
            pts[-1], vals[-1] = xr, fr
        else:
            xc = [(c[j] + pts[-1][j]) / 2 for j in range(len(x0))]
            fc = f(xc)
            if fc < vals[-1]:
                pts[-1], vals[-1] = xc, fc
            else:
                pts = [pts[0]] + [[(a + b) / 2 for a, b in zip(pts[0], p)] for p in pts[1:]]
                vals = [vals[0]] + [f(p) for p in pts[1:]]
    i = min(range(len(pts)), key=lambda i: vals[i])
    return pts[i], vals[i]


def reconstruct_profiles(rows, layers: int) -> dict:
    """Per source, a profile of the demo shape whose model without per-action overhead
    reproduces the rows' predicted_tokens_per_s (see the module docstring); the shapes, bytes
    and links but the fitted ones are those pipeline_profile builds for the bench's model."""
    import copy

    from elastic_kernels.api import ElasticPolicy, LoRAConfig
    from elastic_kernels.api.finetune.models import embedded_config
    from elastic_kernels.api.loading import empty_model
    from elastic_kernels.api.planner.profile import Link

    cfg = embedded_config(256, 688, layers, 8, 4)
    lora = LoRAConfig(r=8, alpha=16, target_modules=TARGETS)
    T = MBS * SEQ
    out = {}
    base_fit = None
    for source in ("host", "peers"):
        mine = [r for r in rows if r["source"] == source]
        target = [float(r["predicted_tokens_per_s"]) for r in mine]
        policy = ElasticPolicy(chunk_bytes=256 << 10, weights_on="host" if source == "host" else "device")
        shell = _shell_profile(empty_model(copy.deepcopy(cfg)), lora, policy, layers)

        def build(x, shell=shell, source=source):
            F, Bw, Hf, Hb, lat = (abs(v) for v in (x[:5] if source == "host" else base_fit[:4] + [x[0]]))
            kw = {"layers": tuple(dataclasses.replace(layer, fwd_s_fixed=0.0, fwd_s_per_token=F / T, bwd_s_fixed=0.0,
                                                      bwd_s_per_token=Bw / T) for layer in shell.layers),
                  "head_fwd_s_per_token": Hf / T, "head_bwd_s_per_token": Hb / T,
                  "p2p": Link(lat, 4.7e8), "h2d": Link(0.0, 2e10), "allgather": Link(0.0, 1e8)}
            if source == "peers":
                kw["allgather"] = Link(abs(x[1]) * 1e-3, abs(x[2]) * 1e8)
            return dataclasses.replace(shell, **kw)

        def loss(x, build=build, mine=mine, target=target):
            pred = _predict(build(x), mine)
            return sum((p / t - 1) ** 2 for p, t in zip(pred, target))

        x0 = [0.03, 0.06, 0.03, 0.06, 1e-3] if source == "host" else [1e-3, 4.0, 1.0]
        x, err = _nelder_mead(loss, x0, 300)
        x, err = _nelder_mead(loss, x, 200)
        if source == "host":
            base_fit = [abs(v) for v in x[:4]]
        out[source] = (build(x), (err / len(target)) ** 0.5)
    return out


def _shell_profile(lm, lora, policy, layers):
    """pipeline_profile's shapes and bytes for the bench's model, timings zero."""
    from elastic_kernels.api.pipeline.profile import ActionOverhead, pipeline_profile
    from elastic_kernels.api.planner.profile import LayerProfile, Link, OutsideProfile, Profile, WeightProfile

    prefix = "model.layers."
    unit = []
    for i in range(layers):
        names = [f"{prefix}{i}.{n}" for n in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
                                              "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")]
        # the first layer's q/k/v have no backward use (frozen embeddings), as measure_profile finds
        unit.append(LayerProfile(f"{prefix}{i}", True, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0,
                                 tuple(WeightProfile(n, 1, 1, 1, backward=not (i == 0 and n.split(".")[-1] in (
                                     "q_proj", "k_proj", "v_proj"))) for n in names)))
    measured = Profile(source="hand", device="cpu", world_size=4, seq_len=SEQ, capacity_bytes=1 << 34,
                       reserved_bytes=0, static_bytes=0, page_bytes=256 << 10, adapter_grad_bytes=0,
                       allgather=Link(0.0, 1e9), allreduce=Link(0.0, 1e9), layers=tuple(unit),
                       outside=OutsideProfile(0.0, 0.0, 0.0, 0.0), h2d=Link(0.0, 2e10))
    return pipeline_profile(lm, lora, policy, measured, world_size=4, seq_len=SEQ,
                            action_overhead=ActionOverhead(0.0, 0.0))


def spearman(a, b) -> float:
    """Spearman's rank correlation (average ranks for ties)."""
    def ranks(x):
        order = sorted(range(len(x)), key=lambda i: x[i])
        r = [0.0] * len(x)
        i = 0
        while i < len(order):
            j = i
            while j + 1 < len(order) and x[order[j + 1]] == x[order[i]]:
                j += 1
            for t in range(i, j + 1):
                r[order[t]] = (i + j) / 2
            i = j + 1
        return r

    ra, rb = ranks(a), ranks(b)
    ma, mb = sum(ra) / len(ra), sum(rb) / len(rb)
    cov = sum((x - ma) * (y - mb) for x, y in zip(ra, rb))
    va, vb = sum((x - ma) ** 2 for x in ra), sum((y - mb) ** 2 for y in rb)
    return cov / (va * vb) ** 0.5 if va > 0 and vb > 0 else 0.0


def _check_worker(rank, world_size, args):
    from elastic_kernels.api.pipeline import pipeline_groups

    torch.set_num_threads(1)
    groups = pipeline_groups(args.pp, "cpu", timeout_s=600)
    profiles = _profiles(rank, world_size, args, groups)
    return profiles, groups.pp_rank


def check(args) -> None:
    import csv

    from elastic_kernels.api.planner.pipeline_model import simulate
    from elastic_kernels.api.planner.pipeline_search import plan_pipeline

    path = os.path.join(harness.results_dir(args.results), "packs.csv")
    rows = [r for r in csv.DictReader(open(path)) if r["kind"] == "measured"]
    saved = {}
    ppath = os.path.join(harness.results_dir(args.results), "packs_profiles.jsonl")
    if os.path.exists(ppath):
        for line in open(ppath):
            d = json.loads(line)
            saved[(d["date"], d["commit"])] = {k: profile_from_dict(v) for k, v in d["profiles"].items()}
    runs = {}
    for r in rows:
        runs.setdefault((r["date"], r["commit"]), []).append(r)
    now = None
    if not args.overhead_ms and any(key not in saved for key in runs):
        now = run_distributed(_check_worker, args.world_size, args, timeout=1800)[0][0]
        o = now["host"]
        print(f"profiles measured now on {args.world_size} ranks (the bench's own code): per-action overhead "
              f"stage {o.stage_overhead_s * 1e3:.3f} ms, schedule {o.schedule_overhead_s * 1e3:.3f} ms")
    for key, mine in runs.items():
        if key in saved and not args.overhead_ms:
            profiles = saved[key]
            print(f"run {key}: the run's saved profiles (their own per-action overhead)")
        else:
            rec = saved.get(key) or reconstruct_profiles(mine, int(mine[0]["model"].split()[2]))
            if key not in saved:
                print(f"run {key}: no saved profile; reconstructed, rms error of the fit to predicted_tokens_per_s: "
                      + ", ".join(f"{s} {v[1]:.1%}" for s, v in rec.items()))
                rec = {s: v[0] for s, v in rec.items()}
            if args.overhead_ms:
                stage, sched = (float(v) / 1e3 for v in args.overhead_ms.split(","))
                how = "given"
            else:
                stage, sched = now["host"].stage_overhead_s, now["host"].schedule_overhead_s
                how = f"measured now on {args.world_size} ranks at once"
            print(f"  per-action overhead ({how}): stage {stage * 1e3:.3f} ms, schedule {sched * 1e3:.3f} ms")
            profiles = {s: dataclasses.replace(p, stage_overhead_s=stage, schedule_overhead_s=sched)
                        for s, p in rec.items()}
        all_m, all_p = [], []
        for source in ("host", "peers"):
            part = [r for r in mine if r["source"] == source]
            if not part:
                continue
            meas = [float(r["tokens_per_s"]) for r in part]
            pred = _predict(profiles[source], part)
            all_m += meas
            all_p += pred
            r0 = part[0]
            sizes = sorted({int(r["pack_size"]) for r in part}, reverse=True)
            plan = plan_pipeline(profiles[source], 16 << 30, int(r0["dp"]) * int(r0["micro_batches"]) * int(r0["micro_batch"]),
                                 pp=int(r0["pp"]), micro_batches=int(r0["micro_batches"]), residencies=(r0["residency"],),
                                 windows=(int(r0["window"]),), pack_sizes=sizes, simulate_top=64)
            lay = plan.prediction.layout
            pick = (lay.schedule, lay.n_layers // lay.n_packs)  # the planner balances boundaries; the bench ran equal packs
            picked = [r for r in part if (r["schedule"], int(r["pack_size"])) == pick]
            old = [r for r in part if r["planner_choice"] == "True"]
            best = max(meas)
            print(f"  {source}: Spearman {spearman(meas, pred):+.2f} (the run's own predictions: "
                  f"{spearman(meas, [float(r['predicted_tokens_per_s']) for r in part]):+.2f}); planner picks "
                  f"{pick[0]} packs of {pick[1]}: {float(picked[0]['tokens_per_s']) / best:.3f} of the best measured "
                  f"(the run's choice {old[0]['schedule']} packs of {old[0]['pack_size']}: "
                  f"{float(old[0]['tokens_per_s']) / best:.3f})")
            for r, p in zip(part, pred):
                print(f"    {r['schedule']:>16} packs of {r['pack_size']}: measured {float(r['tokens_per_s']):7.1f}, "
                      f"predicted {p:7.1f} (the run's {float(r['predicted_tokens_per_s']):7.1f})")
        print(f"  all {len(all_m)} rows: Spearman {spearman(all_m, all_p):+.2f} (the run's own predictions: "
              f"{spearman(all_m, [float(r['predicted_tokens_per_s']) for r in mine]):+.2f})")
        bytes_of = saved.get(key) or now  # the memory model needs the real bytes (a reconstruction has none)
        if bytes_of is None:
            continue
        print("  memory (rank 0's peak, MiB): measured, the run's model, the current model"
              + ("" if key in saved else " on the bytes of the profiles measured now"))
        for source in ("host", "peers"):
            errs = []
            for r in (r for r in mine if r["source"] == source):
                peak = simulate(bytes_of[source], _layout_of(r), int(r["micro_batch"])).peak_bytes[0] / MiB
                meas = float(r["peak_MiB"])
                errs.append((peak - meas) / meas)
                print(f"    {source:>5} {r['schedule']:>16} packs of {r['pack_size']}: {meas:7.2f}, "
                      f"{float(r['predicted_peak_MiB']):7.2f} ({(float(r['predicted_peak_MiB']) - meas) / meas:+.1%}), "
                      f"{peak:7.2f} ({errs[-1]:+.1%})")
            print(f"    {source}: the current model {min(errs):+.1%}..{max(errs):+.1%} of the measured peaks")


def simulate_tiny_pipe(args) -> None:
    from elastic_kernels.api.planner.pipeline import PipelineLayout, divisors
    from elastic_kernels.api.planner.pipeline_model import simulate as sim
    from elastic_kernels.api.planner.pipeline_synthetic import synthetic_pipeline_profile

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
    p.add_argument("--check", action="store_true", help="only check the current model against packs.csv")
    p.add_argument("--overhead-ms", default=None, help="with --check: STAGE,SCHEDULE ms per action instead of "
                   "measuring them")
    g = p.add_argument_group("the real model (bench/packs_real.py: interleaved rounds)")
    g.add_argument("--model", default=None, help="a pretrained model name (e.g. smollm2-135m-instruct): measure it "
                   "with interleaved rounds instead of the tiny model")
    g.add_argument("--rounds", type=int, default=4, help="with --model: rounds of one step of every configuration")
    g.add_argument("--sizes", default="15,5,3", help="with --model: pack sizes measured (at most this many layers "
                   "per pack), beside the planner's pick")
    g.add_argument("--sources", default="host,peers", help="with --model: host and/or peers")
    g.add_argument("--block", type=int, default=3, help="with --model: configurations alive at once (the "
                   "planner's pick and block - 1 others; memory)")
    g.add_argument("--seed", type=int, default=0, help="with --model: the windows' seed")
    g.add_argument("--configs", default=None, help="with --model: SCHEDULE:PACKS,... measured beside the pick "
                   "(instead of --sizes' grid)")
    g.add_argument("--partial", default=None, help="with --model: a JSONL file rank 0 appends every timed step to")
    g.add_argument("--from-raw", default=None, help="with --model: redo the tables from a run's raw result")
    g.add_argument("--recheck", action="store_true", help="with --model --from-raw: the current model with ranks "
                   "sharing cores against the run (busy_speed measured now, or --busy-speed)")
    g.add_argument("--busy-speed", default=None, help="with --recheck: S1,...,1 instead of measuring it")
    g.add_argument("--speed-rounds", type=int, default=5, help="with --recheck: rounds of measure_busy_speed")
    g.add_argument("--no-save", action="store_true", help="with --model: print, append no rows")
    args = p.parse_args(argv)
    if args.model is not None:
        from bench.packs_real import measure_real

        if args.rounds < 1:
            p.error(f"--rounds must be >= 1, got {args.rounds}")
        if args.recheck:
            from bench.packs_real import recheck_real

            if not args.from_raw:
                p.error("--recheck needs --from-raw (a run's raw result)")
            recheck_real(args)
            return
        measure_real(args)
        return
    if args.check:
        check(args)
        return
    if not args.no_simulate:
        simulate_tiny_pipe(args)
    if not args.no_measure:
        measure(args)


if __name__ == "__main__":
    main()
