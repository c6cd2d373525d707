"""The real-model part of bench/bench_packs.py (`--model NAME`): pipeline layouts of a
pretrained causal LM on --world-size gloo ranks as pp x dp, measured beside the pipeline cost
model's prediction and the planner's pick, their steps INTERLEAVED in one process group.

    python bench/bench_packs.py --model smollm2-135m-instruct [--rounds 3] [--block 4]
        [--sizes 15,5,3 | --configs 1f1b:2,interleaved-1f1b:6] [--partial FILE]
    python bench/bench_packs.py --model smollm2-135m-instruct --from-raw RAW.pkl [--recheck [--busy-speed S,1]]

The shape is the CLI's pipelined default: --seq-len 128, --micro-batch 2, --grad-accum 2, so
each dp group's share is 8 sequences in M = grad_accum x pp = 4 micro-batches of 2; text
windows of the embedded corpus (pydoc topics, first 200 documents) tokenized by the model's
tokenizer, the CLI's TokenWindows (the pipelined runs train text windows only). Weights are read
from the model's safetensors (each rank its share, as the CLI's `_collective_build_on_meta`),
float32 (the checkpoint's). Residency "phase" with a window of one pack (as the tiny table),
weights from the host store ("host") or the dp peer ("peers").

The layouts are the planner's own candidates (pipeline_search.layouts at this pp, M,
residency and window, boundaries balanced on the profile's layer, embedding and head costs):
the planner's pick (plan_pipeline over all of them) and those of --sizes (or --configs).
Memory forbids keeping every configuration alive (~190 MiB of anonymous memory per
configuration per rank on the real model, 4 ranks), so per source the pick is built first
and kept, the others come in blocks of --block - 1 beside it; after one warm-up step of each
(in which rank 0's tensor peak of the step is taken), --rounds rounds of one step (+ optimizer
step) of every configuration of the block between barriers, odd rounds reversed. Per
configuration: its per-round tokens/s ratio to the pick (the pick's step time / its own in the
same round), the median and [min, max]; the best measured is the one with the highest median;
the pick's ratio to the best is 1 / the best's median ratio to the pick (measured in the same
rounds). Spearman's rank correlation of predicted tokens/s and those medians per source.

The profile: `measure_profile` of the pp = 1 elastic model (the whole model on every rank,
each its own copy, every rank at once; identical layers profiled once and reused,
[Note: profiling identical layers once]), the links of this process group (bench_packs
`_links`) and `measure_action_overhead`; rank 0's for every rank (each rank profiled its own
copy, and ranks planning on different profiles would build different layouts). Rows appended
to bench/results/packs_real.csv, profiles to bench/results/packs_real_profiles.jsonl, the
worker's raw result pickled to /tmp (`--from-raw` redoes the tables; `--recheck` puts the
current model, with ranks sharing cores ([Note: ranks sharing cores] in
planner/pipeline_model.py; busy_speed measured now or given), against the run).
"""

from __future__ import annotations

import dataclasses
import json
import os
import statistics
import time

import torch

MiB = 2**20
SEQ, MBS, M = 128, 2, 4


def _windows(path: str):
    from transformers import AutoTokenizer

    from elastic_kernels.api.finetune.constants import PROBE_SEQS
    from elastic_kernels.api.finetune.data import HFTokenizer, TokenWindows, embedded_documents, tokenize

    tok = HFTokenizer(AutoTokenizer.from_pretrained(path), path)
    docs = embedded_documents()[:200]  # ~ a few hundred thousand tokens: plenty of windows
    return TokenWindows(tokenize(docs, tok), SEQ, PROBE_SEQS, "the embedded corpus")


def _real_profiles(rank, world_size, args, groups, path, lora, config) -> dict:
    import torch.distributed as dist

    from bench.bench_packs import _links
    from elastic_kernels.api import ElasticPolicy, convert_to_elastic
    from elastic_kernels.api.loading import SafetensorsSource, empty_model
    from elastic_kernels.api.pipeline.profile import measure_action_overhead, pipeline_profile
    from elastic_kernels.api.planning.measure import measure_profile

    chunk = args.chunk_kib << 10
    solo = [dist.new_group([r]) for r in range(world_size)][rank]
    ids = torch.randint(0, config.vocab_size, (MBS, SEQ), generator=torch.Generator().manual_seed(7))
    t0 = time.perf_counter()
    ref = convert_to_elastic(empty_model(config).train(), lora, ElasticPolicy(chunk_bytes=chunk), group=solo,
                             source=SafetensorsSource(path, device="cpu", allow_cast=True))
    measured = measure_profile(ref, [ids], capacity_bytes=16 << 30, host_tier=True)
    del ref
    links = _links(groups)
    overhead = measure_action_overhead(empty_model(config), seq_len=SEQ, micro_batch_size=MBS,
                                       p2p_latency_s=links["p2p"].latency_s)
    if rank == 0:
        print(f"profile measured in {time.perf_counter() - t0:.0f} s", flush=True)
    profiles = {}
    for source in ("host", "peers"):
        policy = ElasticPolicy(chunk_bytes=chunk, weights_on="host" if source == "host" else "device")
        prof = pipeline_profile(empty_model(config), lora, policy, measured, world_size=world_size,
                                micro_batch_size=MBS, action_overhead=overhead)
        profiles[source] = dataclasses.replace(prof, allgather=links["allgather"], p2p=links["p2p"], h2d=links["h2d"])
    return profiles


def _candidates(profile, world_size: int, pp: int, residency: str, window: int):
    """The planner's own candidate layouts (pipeline_search.layouts, called as plan_pipeline
    calls it: boundaries balanced on the profile's layer, embedding and head costs) at this
    degree, M, residency and window, by (schedule, number of packs)."""
    from elastic_kernels.api.planner.pipeline_search import layouts

    layer_costs = [layer.fwd_s(profile.seq_len) + layer.bwd_s(profile.seq_len) for layer in profile.layers]
    head = (profile.head_fwd_s_per_token + profile.head_bwd_s_per_token) * profile.seq_len
    cands = layouts(world_size, len(profile.layers), (world_size // pp) * M * MBS, pp=pp, micro_batches=M,
                    residencies=(residency,), windows=(window,), layer_costs=layer_costs,
                    first_cost=profile.embed_fwd_s_per_token * profile.seq_len, last_cost=head,
                    weights_on=profile.weights_on)
    return {(lay.schedule, lay.n_packs): lay for lay, mbs in cands if mbs == MBS}


def _real_worker(rank, world_size, args):
    import gc
    import resource
    import warnings

    import torch.distributed as dist

    from bench.bench_packs import TARGETS
    from elastic_kernels.api import ElasticPolicy, LoRAConfig
    from elastic_kernels.api.loading import LoadWarning, SafetensorsSource, empty_model, read_config
    from elastic_kernels.api.loading.pretrained import pretrained_dir
    from elastic_kernels.api.pipeline import PipelinedModel, PipelineError, pipeline_groups
    from elastic_kernels.api.pipeline.profile import measure_step_peak_bytes
    from elastic_kernels.api.planner.pipeline_model import simulate
    from elastic_kernels.api.planner.pipeline_search import plan_pipeline
    from elastic_kernels.api.planning.peaks import live_tensor_bytes

    warnings.simplefilter("ignore", LoadWarning)  # each pack reads only its layers: said once per build
    torch.set_num_threads(1)
    path = str(pretrained_dir(args.model))
    config = read_config(path)
    n_layers = config.num_hidden_layers
    lora = LoRAConfig(r=8, alpha=16, target_modules=TARGETS)
    chunk = args.chunk_kib << 10
    groups = pipeline_groups(args.pp, "cpu", timeout_s=1800)
    log = (lambda *a: print(*a, flush=True)) if rank == 0 else (lambda *a: None)
    t0 = time.perf_counter()
    profiles = [_real_profiles(rank, world_size, args, groups, path, lora, config)]
    # each rank profiled its own copy (solo groups: nothing MAX-reduced); rank 0's profile for
    # every rank, so that all of them plan, balance and build the same layouts
    dist.broadcast_object_list(profiles, src=0)
    profiles = profiles[0]
    gc.collect()
    windows = _windows(path)
    sources = args.sources.split(",")
    # the grid: the planner's candidates at the pack sizes asked for, and the planner's pick
    grid, picks, preds = {}, {}, {}
    for source in sources:
        cands = _candidates(profiles[source], world_size, args.pp, args.residency, args.window)
        plan = plan_pipeline(profiles[source], 16 << 30, groups.dp * M * MBS, pp=args.pp, micro_batches=M,
                             residencies=(args.residency,), windows=(args.window,), simulate_top=len(cands))
        pick = (plan.prediction.layout.schedule, plan.prediction.layout.n_packs)
        picks[source] = pick
        want = [(s, -(-n_layers // size)) for size in args.sizes for s in SCHEDULES_OF(n_layers, args.pp, size)]
        if args.configs:  # SCHEDULE:PACKS,... instead of the sizes' grid
            want = [(c.split(":")[0], int(c.split(":")[1])) for c in args.configs.split(",")]
            missing = [k for k in want if k not in cands]
            if missing:
                raise PipelineError(f"--configs: {missing} are not among the planner's candidates {sorted(cands)}")
        keys = [pick] + [k for k in dict.fromkeys(want) if k != pick and k in cands]
        for k in keys:
            grid[(k[0], k[1], source)] = cands[k]
        for k, lay in cands.items():  # every candidate's prediction (the ranking), measured or not
            p = simulate(profiles[source], lay, MBS)
            preds[(k[0], k[1], source)] = (p.step_s, p.peak_bytes[groups.pp_rank], p.bubble[groups.pp_rank],
                                           tuple(lay.boundaries))
        log(f"{source}: planner picks {pick[0]} with {pick[1]} packs {plan.prediction.layout.boundaries} "
            f"(predicted {plan.prediction.tokens_per_s:.1f} tokens/s); measuring {keys}")

    def batch(step):
        b = windows.batch(args.seed, step, groups.dp, groups.dp_rank, MBS, M)
        return b.reshape(M * MBS, -1)

    def build(key):
        policy = ElasticPolicy(chunk_bytes=chunk, weights_on="host" if key[2] == "host" else "device")
        gc.collect()
        before = live_tensor_bytes()
        pipe = PipelinedModel(empty_model(config).train(), lora, policy, grid[key], groups, micro_batch_size=MBS,
                              seq_len=SEQ, source=SafetensorsSource(path, device="cpu", allow_cast=True))
        opt = torch.optim.AdamW(pipe.parameters(), lr=1e-4)
        held = live_tensor_bytes() - before

        def warm(pipe=pipe, opt=opt, b=batch(0)):
            pipe.train_step(b)
            opt.step()
            opt.zero_grad(set_to_none=True)

        base = live_tensor_bytes()
        peak = measure_step_peak_bytes(pipe, warm) - base + held
        log(f"  built + warm-up {key}: {time.perf_counter() - t0:.0f} s, rank 0: {_rss()}, maxrss "
            f"{resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f} MiB, tensor peak {peak / MiB:.0f} MiB")
        return pipe, opt, peak

    times, idle, peaks, block_of = {}, {}, {}, {}
    step_no = 1
    for source in sources:
        anchor = (picks[source][0], picks[source][1], source)
        others = [k for k in grid if k[2] == source and k != anchor]
        blocks = [others[i:i + args.block - 1] for i in range(0, len(others), args.block - 1)] or [[]]
        a_pipe, a_opt, peaks[anchor] = build(anchor)
        for bi, block in enumerate(blocks):
            alive = {anchor: (a_pipe, a_opt)}
            for key in block:
                pipe, opt, peaks[key] = build(key)
                alive[key] = (pipe, opt)
            members = list(alive)
            for key in members:
                block_of[key] = block_of.get(key, []) + [(source, bi)]
            for k in range(args.rounds):
                order = members if k % 2 == 0 else list(reversed(members))
                b = batch(step_no)
                step_no += 1
                for key in order:
                    pipe, opt = alive[key]
                    dist.barrier()
                    t = time.perf_counter()
                    pipe.train_step(b)
                    opt.step()
                    opt.zero_grad(set_to_none=True)
                    dist.barrier()
                    times.setdefault((key, bi), []).append(time.perf_counter() - t)
                    idle.setdefault(key, []).append(pipe.last_step["idle_fraction"])
                    if rank == 0 and args.partial:  # what a killed run leaves
                        with open(args.partial, "a") as f:
                            f.write(json.dumps({"key": list(key), "block": bi, "round": k,
                                                "step_s": times[(key, bi)][-1],
                                                "idle": idle[key][-1]}) + "\n")
                log(f"  {source} block {bi + 1}/{len(blocks)} round {k + 1}/{args.rounds}: "
                    f"{time.perf_counter() - t0:.0f} s, rank 0: {_rss()}")
            for key in block:
                alive[key][0].close()
            alive = pipe = opt = None
        a_pipe.close()
        a_pipe = a_opt = None
    return {"times": times, "idle": idle, "peaks": peaks, "preds": preds, "picks": picks, "grid":
            {k: tuple(v.boundaries) for k, v in grid.items()}, "profiles": profiles, "n_layers": n_layers}


def SCHEDULES_OF(n_layers: int, pp: int, size: int) -> tuple[str, ...]:
    """The schedules measured at a pack size: gpipe and 1f1b for one pack per rank, looped-bfs
    and interleaved-1f1b for more."""
    return ("gpipe", "1f1b") if -(-n_layers // size) == pp else ("looped-bfs", "interleaved-1f1b")


def _rss() -> str:
    """This process's resident memory now: anonymous and file-backed (the mapped safetensors)."""
    with open("/proc/self/status") as f:
        d = dict(line.split(":", 1) for line in f if line.startswith(("RssAnon", "RssFile")))
    return ", ".join(f"{k} {int(v.split()[0]) / 1024:.0f} MiB" for k, v in d.items())


def anchored_ratios(times: dict, anchor) -> dict:
    """Per configuration, its per-round tokens/s ratios to the anchor's (anchor step time / its
    step time) in the rounds of the block(s) they shared; `times` maps (configuration, block)
    to its step times, round by round."""
    out = {anchor: []}
    for (key, block), ts in times.items():
        if key != anchor:
            out[key] = out.get(key, []) + [a / t for a, t in zip(times[(anchor, block)], ts)]
    blocks = [b for (key, b) in times if key == anchor]
    out[anchor] = [1.0] * sum(len(times[(anchor, b)]) for b in blocks)
    return out


def measure_real(args) -> None:
    from bench import harness
    from bench.bench_packs import spearman
    from tests._dist import run_distributed

    args.sizes = [int(s) for s in args.sizes.split(",")]
    if args.block < 2:
        raise SystemExit(f"--block must be >= 2 (the planner's pick and one more), got {args.block}")
    t_start = time.time()
    load0 = os.getloadavg()
    if args.from_raw:
        import pickle

        with open(args.from_raw, "rb") as f:
            res, wall, load0, load1 = pickle.load(f)
    else:
        import pickle

        res = run_distributed(_real_worker, args.world_size, args, timeout=7200)[0]
        load1 = os.getloadavg()
        wall = time.time() - t_start
        raw = f"/tmp/packs_real_raw_{os.getpid()}.pkl"
        with open(raw, "wb") as f:  # the worker's result, so the tables can be redone (--from-raw)
            pickle.dump((res, wall, load0, load1), f)
        print("raw result in", raw)
    ctx = harness.context("cpu")
    tokens = (args.world_size // args.pp) * M * MBS * SEQ
    rows, summary = [], []
    all_m, all_p = [], []
    for source in args.sources.split(","):
        pick = res["picks"][source]
        anchor = (pick[0], pick[1], source)
        mine = {kb: v for kb, v in res["times"].items() if kb[0][2] == source}
        q = anchored_ratios(mine, anchor)
        med = {k: statistics.median(v) for k, v in q.items()}
        best = max(med, key=lambda k: med[k])
        for key in [k for k in res["grid"] if k[2] == source]:
            schedule, packs, _ = key
            p = res["preds"][key]
            bounds = p[3]
            sizes = sorted({bounds[i + 1] - bounds[i] for i in range(len(bounds) - 1)})
            ts = [t for (k, _), v in mine.items() if k == key for t in v]
            rows.append({
                **ctx, "kind": "measured", "model": args.model, "layers": res["n_layers"],
                "world_size": args.world_size, "pp": args.pp, "dp": args.world_size // args.pp,
                "schedule": schedule, "packs": packs, "pack_sizes": "/".join(map(str, sizes)),
                "boundaries": " ".join(map(str, bounds)), "residency": args.residency, "window": args.window,
                "source": source, "micro_batches": M, "micro_batch": MBS, "seq_len": SEQ, "rounds": args.rounds,
                "block": args.block, "tokens_per_s": round(tokens / statistics.median(ts), 1),
                "ratio_vs_pick": round(med[key], 3), "ratio_vs_pick_min": round(min(q[key]), 3),
                "ratio_vs_pick_max": round(max(q[key]), 3), "ratio_vs_best": round(med[key] / med[best], 3),
                "best": key == best, "planner_choice": key == anchor,
                "predicted_tokens_per_s": round(tokens / p[0], 1),
                "peak_MiB": round(res["peaks"][key] / MiB, 1), "predicted_peak_MiB": round(p[1] / MiB, 1),
                "bubble": round(statistics.median(res["idle"][key]), 3), "predicted_bubble": round(p[2], 3),
                "step_s": ";".join(f"{t:.2f}" for t in ts),
            })
        part = [r for r in rows if r["source"] == source]
        meas = [r["ratio_vs_pick"] for r in part]
        pred = [r["predicted_tokens_per_s"] for r in part]
        all_m += meas
        all_p += pred
        qb = q[best]
        inv = [1 / x for x in qb] if best != anchor else [1.0]
        summary.append(f"{source}: planner picks {pick[0]} with {pick[1]} packs: {1 / med[best]:.3f}x of the best "
                       f"measured ({best[0]} with {best[1]} packs) [{min(inv):.3f}, {max(inv):.3f}] (median of "
                       f"per-round ratios, {len(qb)} rounds); Spearman of predicted tokens/s and measured "
                       f"{spearman(meas, pred):+.2f} over {len(part)} configurations")
    harness.print_table(rows, ["source", "schedule", "packs", "pack_sizes", "tokens_per_s", "ratio_vs_pick",
                               "ratio_vs_pick_min", "ratio_vs_pick_max", "ratio_vs_best", "predicted_tokens_per_s",
                               "peak_MiB", "predicted_peak_MiB", "bubble", "predicted_bubble", "planner_choice"])
    for line in summary:
        print(line)
    print(f"all: Spearman {spearman(all_m, all_p):+.2f} (within a source the ratios are to its own pick)")
    print(f"wall {wall:.0f} s, load average {load0[0]:.2f} at the start, {load1[0]:.2f} at the end")
    prof = res["profiles"]["host"]
    print(f"per-action overhead (measured): stage {prof.stage_overhead_s * 1e3:.3f} ms, schedule "
          f"{prof.schedule_overhead_s * 1e3:.3f} ms")
    print("all candidates' predictions (tokens/s): " + "; ".join(
        f"{k[2]} {k[0]} {k[1]} packs {tokens / v[0]:.1f}" for k, v in sorted(res["preds"].items(),
                                                                       key=lambda kv: kv[1][0])))
    if not args.no_save:
        print("rows appended to", harness.append_rows("packs_real", rows, args.results))
        path = os.path.join(harness.results_dir(args.results), "packs_real_profiles.jsonl")
        with open(path, "a") as f:
            f.write(json.dumps({"date": ctx["date"], "commit": ctx["commit"], "model": args.model,
                                "profiles": {k: dataclasses.asdict(v) for k, v in res["profiles"].items()}}) + "\n")
        print("profiles appended to", path)


def _speed_worker(rank, world_size, args):
    from elastic_kernels.api.pipeline import pipeline_groups
    from elastic_kernels.api.pipeline.profile import measure_busy_speed

    torch.set_num_threads(1)
    groups = pipeline_groups(args.pp, "cpu", timeout_s=600)
    return measure_busy_speed(groups, rounds=args.speed_rounds)


def recheck_real(args) -> None:
    """The current model against a run's raw result (--from-raw), with ranks sharing cores:
    busy_speed given (--busy-speed) or measured now on --world-size ranks (measure_busy_speed);
    per source the planner's pick and its measured ratio to the best (through the run's
    anchor: its ratio to the pick of the run divided by the best's), Spearman's rank
    correlation of the new predictions with the measured ratios."""
    import pickle

    from bench.bench_packs import spearman
    from elastic_kernels.api.planner.pipeline_model import simulate
    from elastic_kernels.api.planner.pipeline_search import plan_pipeline
    from tests._dist import run_distributed

    with open(args.from_raw, "rb") as f:
        res, wall, load0, load1 = pickle.load(f)
    if args.busy_speed:
        speed = tuple(float(v) for v in args.busy_speed.split(","))
        how = "given"
    else:
        load = os.getloadavg()[0]
        speed = run_distributed(_speed_worker, args.world_size, args, timeout=1200)[0]
        how = f"measured now on {args.world_size} ranks at a load of {load:.1f} -> {os.getloadavg()[0]:.1f}"
    print(f"busy_speed ({how}): {', '.join(f'{v:.3f}' for v in speed)}")
    tokens = (args.world_size // args.pp) * M * MBS * SEQ
    n_layers = res["n_layers"]
    all_m, all_p, all_o = [], [], []
    for source in args.sources.split(","):
        prof = dataclasses.replace(res["profiles"][source], busy_speed=speed)
        anchor = (*res["picks"][source], source)
        mine = {kb: v for kb, v in res["times"].items() if kb[0][2] == source}
        q = anchored_ratios(mine, anchor)
        med = {k: statistics.median(v) for k, v in q.items()}
        best = max(med, key=lambda k: med[k])
        cands = _candidates(prof, args.world_size, args.pp, args.residency, args.window)
        plan = plan_pipeline(prof, 16 << 30, (args.world_size // args.pp) * M * MBS, pp=args.pp, micro_batches=M,
                             residencies=(args.residency,), windows=(args.window,), simulate_top=len(cands))
        pick = (plan.prediction.layout.schedule, plan.prediction.layout.n_packs, source)
        keys = [k for k in res["grid"] if k[2] == source]
        new = {k: tokens / simulate(prof, cands[k[:2]], MBS).step_s for k in keys}
        old = {k: tokens / res["preds"][k][0] for k in keys}
        meas = [med[k] for k in keys]
        all_m += meas
        all_p += [new[k] for k in keys]
        all_o += [old[k] for k in keys]
        line = f"{source}: the planner now picks {pick[0]} with {pick[1]} packs"
        if pick in med:
            line += f": {med[pick] / med[best]:.3f}x of the best measured ({best[0]} with {best[1]} packs)"
            if pick == best:
                line += " (it is the best)"
        else:
            line += " (not measured in this run)"
        print(line + f"; Spearman {spearman(meas, [new[k] for k in keys]):+.2f} (the run's model "
              f"{spearman(meas, [old[k] for k in keys]):+.2f}), the run's pick {anchor[0]} {anchor[1]} packs: "
              f"{1 / med[best]:.3f}x")
        for k in keys:
            print(f"    {k[0]:>16} {k[1]:2d} packs: measured ratio to the run's pick {med[k]:.3f} "
                  f"[{min(q[k]):.3f}, {max(q[k]):.3f}], predicted tokens/s now {new[k]:6.1f} (the run's {old[k]:6.1f})")
        print(f"    all {len(cands)} candidates now: " + "; ".join(
            f"{s} {n} {tokens / simulate(prof, lay, MBS).step_s:.1f}" for (s, n), lay in sorted(cands.items())))
    print(f"all: Spearman {spearman(all_m, all_p):+.2f} (the run's model {spearman(all_m, all_o):+.2f})")
    del n_layers
