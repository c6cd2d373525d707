"""The memory-throughput frontier: every peer configuration and the elastic runtime, in one
process group and one run, on the fine-tuning CLI's job.

    torchrun --standalone --nproc-per-node 4 bench/bench_frontier.py [--model smollm2-135m-instruct |
        --preset demo|large|tiny|nf4] [--steps 6] [--passes 2] [--budgets 0,25%,50%,75%,all] [--host-budgets 0,50%,all]
        [--planned-caps 3] [--peers fsdp2,deepspeed,ddp[,fsdp2-nf4]] [--fsdp2-reshard true,false,2]
        [--ds-grid defaults,no-persistence,...] [--pairs 'budget 0=fsdp2:reshard,budget all=ddp:replicated']
        [--groups N] [--anchor LABEL] [--results DIR] [--png PATH] [finetune options ...]

The model: the real one by default (`--model`, any name `pretrained_dir` knows or an HF
directory; seq 128, micro-batch 1, no accumulation unless the finetune options say
otherwise), or one of the embedded presets (`--preset`).

Each configuration trains the CLI's job (python_api/finetune: the same base weights, the
elastic run's initial adapters, batches and AdamW, through the same loop) from scratch:
- elastic: the pool budget at each of --budgets (a share of the frozen bytes, or all);
- elastic, weights on host: the host tier at each of --host-budgets;
- elastic, paged (`--paged-budgets`, none by default): the pool budget at each of them with
  every weight in pool pages beside its shard, none held as a run (the layout before
  [Note: resident runs]), for a same-run A/B of runs;
- elastic, other embeddings (`--other-embedding-budgets`, none by default): the pool budget
  at each of them with ElasticPolicy.shard_embeddings flipped from its default (the embedding
  tables, and an output layer tied to one, sharded under the runtime or replicated: [Note:
  embeddings under the runtime]), for a same-run A/B;
- elastic, legacy sync (`--legacy-budgets`, none by default): the pool budget at each of them
  with the runtime's synchronization as it was before issue 27 (the blocking header exchange
  on the runtime's group before each gather, the adapter gradients in one all-reduce at the
  end of backward), for a same-run A/B of [Note: headers off the prefetch path] and
  [Note: gradient buckets];
- planned: the planner under --planned-caps memory caps spread from the least memory any
  plan needs to what keeping everything needs (its own memory model, from a measured
  profile);
- FSDP2 + PEFT at reshard_after_forward true, false and every int the mesh allows;
- DeepSpeed ZeRO-3 + PEFT over a grid of its four stage3 knobs (DS_GRID below; element
  counts scaled to the model's decoder layer, so that some settings do not fetch the whole
  model in one call);
- DDP + PEFT: replicated weights, no weight communication;
- FSDP2-NF4 + PEFT (`--peers ...,fsdp2-nf4`): FSDP2 over torchao NF4 weights, torchtune's QLoRA
  (python_api/finetune/peers/fsdp2_nf4.py); with `--weight-format nf4` in the finetune options
  the elastic points are nf4 too (system "elastic nf4"). `--preset nf4` is the demo model sized
  for it (NF4_DEMO_OPTIONS there: every quantized weight splits over 4 ranks).

[Note: what the frontier's memory is]
Measured for each configuration, in two parts.
- Memory, each configuration alone (built, 3 steps, closed and freed before the next): the
  tensor peak (GPU: `max_memory_allocated` above the level before the build; CPU: the live
  tensor bytes before the third step plus the profiler's allocation high-water during it,
  minus the tensors alive before the build; the pool's arena counted from its own snapshot,
  the host store not counted, as it is host memory on a GPU machine) and, on CPU, the growth
  of the resident set over the build and the first two steps (VmHWM above the resident set
  before the build) with glibc's mmap threshold fixed at start-up (`fix_mmap_threshold` in
  python_api/finetune/measure.py: freed large buffers go back to the OS instead of staying
  resident under the dynamic threshold, which made engines incomparable: FSDP2 read 2,061 MiB
  of RSS for a 646 MiB tensor peak, issue 27).
- Speed, all configurations alive at once, interleaved step by step in one process group:
  a warm-up round (one step of each, in order: the elastic runs learn their order and fill
  their pools), then passes x (steps - 1) timed rounds, round k running one step of each
  configuration, in the listed order for odd k and in the reverse order for even k, so a
  drift of the shared machine weighs on all alike. Each step's time is the slowest rank's.
  tokens/s = global tokens per step over the median step time. For each pair of --pairs (an
  elastic point against a peer) the report gives the median of the per-round ratios
  (peer's step time over the elastic point's in the same round: its tokens/s ratio) with
  their spread, beside the ratio of the medians. Sequential runs of one command gave budget
  0 at 0.85x and then 1.85x FSDP2 on this machine (issue 27): only ratios taken within one
  round hold.
[Note: frontier groups]
With --groups N no more than N configurations are alive at once (every one of them holds its
own model: 20 configurations of the real model at 4 ranks need more memory than a shared
24 GiB machine has). The configurations are split into groups, run one after another in
one process group, each group interleaved as above; every group holds the anchor (--anchor,
by default the first configuration: elastic budget 0), and the two configurations of each
--pairs pair are kept in one group, so its per-round ratios are taken within rounds. A
configuration's speed is then its tokens/s over the anchor's in the same round, median of
its group's timed rounds [min, max]; its tokens/s in the table is that median times the
anchor's tokens/s over all its rounds in every group (a common scale for the frontier; only
the ratios are measurements of the same rounds). Memory is unchanged: each configuration
built alone, so comparable across groups. The anchor's losses are compared between groups
(they must be equal: the same job from the same seed).
Also: all-gathered bytes and all-gather calls per step (steady state, counted by one wrapper
around every all-gather), and losses (every run's, step by step, against the first run of
its weight format: the largest difference is printed, flagged beyond fp32 rounding, or for
nf4 beyond the NF4 tolerance of [Note: the NF4 peer's loss tolerance] in
python_api/finetune/report.py). An elastic point is set against the peers of its own
weights only. Rows go to bench/results/frontier.csv; the picture (tokens/s against tensor
peak, one marker per configuration, each system's Pareto frontier as a line) to
bench/results/frontier.png (frontier_<preset>.png for presets other than demo,
frontier_<model>.png for a real model). The table states, for each elastic point, the
fastest peer configuration at less or equal memory and the ratio.
"""

from __future__ import annotations

import argparse
import gc
import os
import shutil
import statistics
import sys
import tempfile
import textwrap
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from bench.harness import append_rows, context, results_dir, start_group  # noqa: E402
from elastic_kernels.api.finetune.peers.fsdp2_nf4 import NF4_DEMO_OPTIONS  # noqa: E402

PRESETS = {
    "tiny": ["--model", "tiny", "--hidden-size", "32", "--intermediate-size", "48", "--num-layers", "2", "--num-heads", "4",
             "--num-kv-heads", "2", "--seq-len", "24", "--chunk-kib", "1", "--lora-r", "4", "--lora-alpha", "8"],
    "demo": ["--model", "tiny"],  # the tiny model's defaults: 4 layers, hidden 256, seq 128, micro-batch 2 x accumulation 2
    "large": ["--hidden-size", "512", "--intermediate-size", "1376", "--num-layers", "8", "--num-heads", "8",
              "--num-kv-heads", "4"],
    "nf4": list(NF4_DEMO_OPTIONS),  # the demo model sized for the fsdp2-nf4 peer on up to 4 ranks
}

REAL_MODEL = "smollm2-135m-instruct"
REAL_OPTIONS = ["--seq-len", "128", "--micro-batch", "1", "--grad-accum", "1"]  # issue 27's measurement
DEFAULT_PAIRS = "budget 0=fsdp2:reshard,budget all=ddp:replicated"

# DeepSpeed settings: name -> knobs, in elements; "L" is one decoder layer's parameter count,
# "ALL" one more than the largest parameter's (every parameter persistent).
DS_GRID = {
    "defaults": {},  # persistence 1e5, max live 1e9, reuse 1e9, prefetch 5e7
    "no-persistence": {"persistence_threshold": 0},
    "prefetch-layer": {"persistence_threshold": 0, "prefetch_bucket_size": "L"},
    "bounded": {"persistence_threshold": 0, "max_reuse_distance": 0, "prefetch_bucket_size": "L",
                "max_live_parameters": "2L"},
    "per-use": {"persistence_threshold": 0, "max_reuse_distance": 0, "prefetch_bucket_size": 0},
    "all-persistent": {"persistence_threshold": "ALL"},
}


def _parse(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    p.add_argument("--model", default=REAL_MODEL, help="the real model (a pretrained_dir name or an HF directory)")
    p.add_argument("--preset", choices=sorted(PRESETS), default=None, help="an embedded model instead of --model")
    p.add_argument("--steps", type=int, default=6, help="steps per configuration and pass (a pass's first is warm-up)")
    p.add_argument("--passes", type=int, default=2,
                   help="timed rounds = passes x (steps - 1), after one warm-up round")
    p.add_argument("--pairs", default=DEFAULT_PAIRS,
                   help="elastic point=peer system:configuration pairs whose per-round ratios are reported")
    p.add_argument("--budgets", default="0,25%,50%,75%,all", help="elastic pool budgets")
    p.add_argument("--host-budgets", default="0,50%,all", help="pool budgets with the weights in the host store ('' none)")
    p.add_argument("--legacy-budgets", default="", help="pool budgets run with the pre-issue-27 synchronization (A/B)")
    p.add_argument("--paged-budgets", default="", help="pool budgets run with no weight held as a run (A/B)")
    p.add_argument("--fresh-buffer-budgets", default="",
                   help="pool budgets run with new send and receive buffers for every gather (A/B)")
    p.add_argument("--replicated-optimizer-budgets", default="",
                   help="pool budgets run with every rank holding all the adapters' AdamW state (A/B)")
    p.add_argument("--other-embedding-budgets", default="",
                   help="pool budgets run with ElasticPolicy.shard_embeddings flipped from its default (A/B)")
    p.add_argument("--planned-caps", type=int, default=3, help="planned runs at this many memory caps (0: none)")
    p.add_argument("--peers", default="fsdp2,deepspeed,ddp")
    p.add_argument("--fsdp2-reshard", default=None, help="FSDP2 settings (default: true, false, every int the mesh allows)")
    p.add_argument("--ds-grid", default=",".join(DS_GRID), help=f"DeepSpeed settings, by name: {', '.join(DS_GRID)}")
    p.add_argument("--groups", type=int, default=0,
                   help="at most this many configurations alive at once, each group with the anchor "
                        "([Note: frontier groups]; 0: all in one group)")
    p.add_argument("--anchor", default=None,
                   help="the configuration in every group, by label (default: the first, budget 0)")
    p.add_argument("--results", default=None, help="folder for frontier.csv (default bench/results)")
    p.add_argument("--png", default=None, help="picture (default <results>/frontier.png, frontier_<preset>.png)")
    opts, rest = p.parse_known_args(argv)
    if opts.steps < 2 or opts.passes < 1:
        p.error("--steps must be >= 2 (the first step is warm-up) and --passes >= 1")
    bad = [x for x in opts.pairs.split(",") if x.strip() and ("=" not in x or ":" not in x.partition("=")[2])]
    if bad:
        p.error(f"--pairs: {bad} is not 'elastic configuration=peer system:peer configuration' "
                "(e.g. 'budget 0=fsdp2:reshard')")
    opts.ds_grid = [n.strip() for n in opts.ds_grid.split(",") if n.strip()]
    unknown = [n for n in opts.ds_grid if n not in DS_GRID]
    if unknown:
        p.error(f"--ds-grid: unknown setting(s) {unknown}; known: {', '.join(DS_GRID)}")
    # The CLI's own parsers, so that a bad value is an argument error on every rank, before any
    # process group or model exists (not a traceback once the runs are being built).
    from elastic_kernels.api.finetune.option_values import PEERS, _budget, _reshard

    for flag in ("budgets", "host_budgets", "legacy_budgets", "paged_budgets", "fresh_buffer_budgets",
                 "replicated_optimizer_budgets", "other_embedding_budgets"):
        for b in (x for x in getattr(opts, flag).split(",") if x.strip()):
            try:
                _budget(b)
            except argparse.ArgumentTypeError as exc:
                p.error(f"--{flag.replace('_', '-')}: {exc}")
    peers = [x.strip() for x in opts.peers.split(",") if x.strip()]
    unknown = [x for x in peers if x not in PEERS]
    if unknown:
        p.error(f"--peers: unknown peer(s) {unknown}; known: {', '.join(PEERS)} ('' for none)")
    if opts.fsdp2_reshard is not None:
        for r in (x for x in opts.fsdp2_reshard.split(",") if x.strip()):
            try:
                _reshard(r)
            except argparse.ArgumentTypeError as exc:
                p.error(f"--fsdp2-reshard: {exc}")
    if opts.planned_caps < 0:
        p.error(f"--planned-caps: a number of caps >= 0 is expected, got {opts.planned_caps}")
    if opts.groups == 1 or opts.groups < 0:
        p.error(f"--groups: 0 (one group) or a group size >= 2 (the anchor and one more) is expected, "
                f"got {opts.groups}")
    return opts, rest


class Config:
    """One point of the plane: how to build its engine, and what it measured."""

    def __init__(self, system: str, label: str, build, weight_format: str = "none"):
        self.system, self.label, self.build = system, label, build
        self.weight_format = weight_format  # the numerics its losses are compared within
        self.passes: list[dict] = []  # bench_quant's sequential passes (_run)
        self.tensor_peak: int | None = None  # GPU: max_memory_allocated ([Note: what the frontier's memory is])
        self.static: int | None = None  # CPU: live tensor bytes once built, before its first step
        self.rss_growth: int | None = None  # CPU, at a fixed mmap threshold
        self.steps_run: list[dict] = []  # interleaved steps: loss, time, traffic
        self.times: list[float] = []  # the slowest rank's time of each interleaved step
        self.times_in: dict[int, list[float]] = {}  # group -> its times there ([Note: frontier groups])
        self.vs_anchor: dict | None = None  # its tokens/s over the anchor's, round by round, in its group


def _layer_elements(job) -> int:
    meta = job.spec.meta_model()
    layer = next(m for m in meta.modules() if type(m).__name__ in set(meta._no_split_modules or []))
    return sum(p.numel() for p in layer.parameters())


def _ds_setting(name: str, job):
    from elastic_kernels.api.finetune.peers.zero3 import ZeRO3Setting

    L = _layer_elements(job)
    biggest = max(p.numel() for p in job.spec.meta_model().parameters())
    scale = {"L": L, "2L": 2 * L, "ALL": biggest + 1}
    knobs = {k: scale.get(v, v) if isinstance(v, str) else v for k, v in DS_GRID[name].items()}
    return ZeRO3Setting(**knobs)


def _planned_caps(job, n: int) -> list[int]:
    """n caps from just above the least memory a planned run needs to what keeping everything
    needs (the planner's memory model on a profile measured here). A planned run profiles the
    model under its cap first, streaming every weight without recomputing, down to one
    sequence ([Note: profiling a smaller micro-batch] in python_api/finetune/planning.py),
    which can need more than the least plan (one that recomputes): the lowest cap is the
    larger of the two, the profiler's figures (ProfileBoundError's, asked for with a bound just
    above the model's tensors) taken 5% over, as they vary a little between runs."""
    from elastic_kernels.api.finetune.engines import ElasticEngine
    from elastic_kernels.api.planner.search import least_memory, plan_from_profile
    from elastic_kernels.api.planning.measure import ProfileBelowTensorsError, ProfileBoundError, measure_profile

    args = job.args
    engine = ElasticEngine(job, None)
    batch = job.windows.batch(args.seed, 0, job.world_size, job.rank, args.micro_batch, 1)[0].to(job.device)
    profile = measure_profile(engine.model, [batch], capacity_bytes=1 << 40)
    # What the planned run's profiling will need under its cap (python_api/finetune/planning.py):
    # streaming one sequence, as extrapolated from the first step at --micro-batch (what its
    # "too small to plan" check compares) and as measured at one sequence (where it halves to).
    # A bound below the model's own tensors is refused before any step (ProfileBelowTensorsError,
    # whose figure is those tensors only), so each is asked for just above them.
    needs = []
    for b in ([batch] if batch.shape[0] == 1 else [batch, batch[:1]]):
        bound = 1
        while True:
            try:
                measure_profile(engine.model, [b], capacity_bytes=1 << 40, memory_bytes=bound)
                raise AssertionError(f"measure_profile profiled within a bound of {bound} bytes")
            except ProfileBelowTensorsError as exc:
                bound = exc.needed_bytes + 1
            except ProfileBoundError as exc:
                needs += [n for n in (exc.needed_bytes if b.shape[0] == 1 else None, exc.least_bytes) if n]
                break
    profiling = int(max(needs) * 1.05)
    del engine
    gc.collect()
    global_batch = job.world_size * args.micro_batch * args.grad_accum
    least = max(int(least_memory(profile, global_batch) * 1.02), profiling)
    full = int(plan_from_profile(profile, profile.capacity_bytes, global_batch).predicted_peak_bytes / 0.95) + 1
    if n == 1:
        return [full]
    return [least + (full - least) * i // (n - 1) for i in range(n)]


def configurations(opts, job, counter) -> list[Config]:
    from elastic_kernels.api import ElasticPolicy
    from elastic_kernels.api.finetune.engines import ElasticEngine, FSDP2Engine
    from elastic_kernels.api.finetune.option_values import _budget, _reshard, budget_label, fmt_bytes
    from elastic_kernels.api.finetune.peers import DDPEngine, ZeRO3Engine, import_deepspeed
    from elastic_kernels.api.finetune.peers.frontier import system_of
    from elastic_kernels.api.finetune.peers.fsdp2_nf4 import FSDP2NF4Engine, import_to_nf4, shape_error

    W = job.world_size
    fmt = job.args.weight_format
    elastic = system_of("elastic", fmt)
    out = []
    for b in (x for x in opts.budgets.split(",") if x.strip()):
        budget = _budget(b)
        out.append(Config(elastic, f"budget {budget_label(budget)}", lambda budget=budget: ElasticEngine(job, budget),
                          fmt))
    for b in (x for x in opts.legacy_budgets.split(",") if x.strip()):
        budget = _budget(b)
        out.append(Config(elastic, f"legacy-sync budget {budget_label(budget)}",
                          lambda budget=budget: legacy_sync(ElasticEngine(job, budget)), fmt))
    for b in (x for x in opts.paged_budgets.split(",") if x.strip()):
        budget = _budget(b)
        out.append(Config(elastic, f"paged budget {budget_label(budget)}",
                          lambda budget=budget: paged_only(ElasticEngine(job, budget)), fmt))
    for b in (x for x in opts.fresh_buffer_budgets.split(",") if x.strip()):
        budget = _budget(b)
        out.append(Config(elastic, f"fresh buffers budget {budget_label(budget)}",
                          lambda budget=budget: fresh_buffers(ElasticEngine(job, budget)), fmt))
    for b in (x for x in opts.replicated_optimizer_budgets.split(",") if x.strip()):
        budget = _budget(b)
        out.append(Config(elastic, f"replicated optimizer budget {budget_label(budget)}",
                          lambda budget=budget: replicated_optimizer(ElasticEngine(job, budget)), fmt))
    flipped = not ElasticPolicy().shard_embeddings
    for b in (x for x in opts.other_embedding_budgets.split(",") if x.strip()):
        budget = _budget(b)
        out.append(Config(elastic, f"{'sharded' if flipped else 'replicated'} embeddings budget {budget_label(budget)}",
                          lambda budget=budget: other_embeddings(job, budget, flipped), fmt))
    for b in (x for x in opts.host_budgets.split(",") if x.strip()):
        budget = _budget(b)
        out.append(Config(elastic, f"host, budget {budget_label(budget)}",
                          lambda budget=budget: ElasticEngine(job, budget, weights_on="host"), fmt))
    if opts.planned_caps:
        for cap in _planned_caps(job, opts.planned_caps):
            def planned(cap=cap):
                job.cfg = job.cfg.replace("planner", memory_cap=cap)  # the configuration is frozen: a copy
                return ElasticEngine(job, None, planned=True)
            out.append(Config(elastic, f"planned, cap {fmt_bytes(cap)}", planned, fmt))
    peers = [p.strip() for p in opts.peers.split(",") if p.strip()]
    if "fsdp2" in peers:
        if opts.fsdp2_reshard is None:
            settings = [True, False] + [n for n in range(2, W) if W % n == 0]
        else:
            settings = [_reshard(s) for s in opts.fsdp2_reshard.split(",") if s.strip()]
        for r in settings:
            label = "reshard" if r is True else "no reshard" if r is False else f"reshard to {r}"
            out.append(Config("fsdp2", label, lambda r=r: FSDP2Engine(job, counter, r)))
    if "deepspeed" in peers:
        try:
            import_deepspeed(job.device)
            for name in opts.ds_grid:
                setting = _ds_setting(name, job)
                out.append(Config("deepspeed", f"{name} ({setting.label})",
                                  lambda s=setting: ZeRO3Engine(job, counter, s)))
        except ImportError as exc:
            if job.rank == 0:
                print(f"bench_frontier: DeepSpeed left out: {exc}", flush=True)
    if "ddp" in peers:
        out.append(Config("ddp", "replicated", lambda: DDPEngine(job, counter)))
    if "fsdp2-nf4" in peers:
        try:
            import_to_nf4()
            err = shape_error(job)  # the same on every rank: all stop before anything runs
            if err:
                raise SystemExit(f"bench_frontier: {err}")
            out.append(Config("fsdp2-nf4", "reshard", lambda: FSDP2NF4Engine(job, counter), "nf4"))
        except ImportError as exc:
            if job.rank == 0:
                print(f"bench_frontier: FSDP2-NF4 left out: {exc}", flush=True)
    return out


def paged_only(engine):
    """Every weight in pool pages beside its shard, none held as a run (the layout before
    [Note: resident runs]), for an A/B in one run."""
    import dataclasses

    rt = engine.runtime
    rt.policy = dataclasses.replace(rt.policy, resident_runs=False)
    rt._sync_runs(promote=False)
    return engine


def fresh_buffers(engine):
    """Every gather packs and receives into new tensors (before [Note: receive buffers are
    reused] in python_api/distributed/collectives.py), for an A/B in one run."""
    engine.runtime._gather_buffers = None
    return engine


def replicated_optimizer(engine):
    """The loop's AdamW over every adapter on every rank (before [Note: sharded optimizer
    state] in python_api/distributed/zero.py), for an A/B in one run."""
    engine.optimizer = None
    return engine


def other_embeddings(job, budget, shard: bool):
    """The elastic engine with ElasticPolicy(shard_embeddings=shard), the other value than the
    default ([Note: embeddings under the runtime]), for an A/B in one run: the CLI's policy
    with that one field changed."""
    import dataclasses

    from elastic_kernels.api.finetune import engines

    plain = engines.elastic_policy  # the name engines.py calls (finetune/policy.py's)
    engines.elastic_policy = lambda *a, **k: dataclasses.replace(plain(*a, **k), shard_embeddings=shard)
    try:
        return engines.ElasticEngine(job, budget)
    finally:
        engines.elastic_policy = plain


def legacy_sync(engine):
    """The runtime's synchronization before issue 27, for an A/B in one run: headers exchanged
    and waited for on the runtime's group before each gather (no header channel), the adapter
    gradients in one bucket (complete only at the end of backward: one all-reduce there)."""
    import dataclasses

    rt = engine.runtime
    rt._channel = None
    rt.policy = dataclasses.replace(rt.policy, grad_bucket_bytes=None)
    rt.set_trainable(rt._grad_params)
    return engine


def _tensor_bytes_excluding(engine) -> tuple[int, set]:
    """Live CPU tensor bytes, the pool's arena counted once from its snapshot and the host
    store left out ([Note: what the frontier's memory is] in the module docstring)."""
    from elastic_kernels.api.finetune.measure import live_tensor_bytes_of

    return live_tensor_bytes_of(engine), set()


def _run(job, cfg: Config, counter, steps: int, profile_memory: bool) -> dict:
    from elastic_kernels.api.finetune.loop import train
    from elastic_kernels.api.planning.peaks import live_tensor_bytes, profiled_growth

    saved = job.cfg
    job.cfg = saved.replace("training", steps=steps)
    try:
        gc.collect()
        before = live_tensor_bytes() if profile_memory else 0
        job.memory.set_baseline()
        engine = cfg.build()
        t0 = time.perf_counter()
        if profile_memory:
            live, _ = _tensor_bytes_excluding(engine)
            box = {}
            growth = profiled_growth(lambda: box.update(result=train(job, engine, counter, primary=False)))
            result = box["result"]
            result["tensor_peak_bytes"] = live + growth - before
        else:
            result = train(job, engine, counter, primary=False)
        result["wall_s"] = time.perf_counter() - t0
        engine.close()
        engine = None  # its memory goes before the next configuration is built
    finally:
        job.cfg = saved
    gc.collect()
    dist.barrier()
    return result


def _slowest(x: float) -> float:
    from elastic_kernels.api.distributed.agree import exchange

    return max(exchange(x, what="bench_frontier step times"))


class Runner:
    """One configuration's engine, optimizer and RNG stream, stepped one step at a time (the
    interleaved rounds of [Note: what the frontier's memory is])."""

    def __init__(self, job, cfg: Config, counter):
        from elastic_kernels.api.finetune.loop import _seed_rng, adamw

        self.job, self.cfg, self.counter = job, cfg, counter
        self.engine = cfg.build()
        named = self.engine.params()
        self.opt = self.engine.optimizer or adamw([p for _, p in named], job.cfg.training)
        _seed_rng(job.args.seed, job.rank, job.device)
        self.rng = torch.get_rng_state()
        self.engine.train_mode()

    def step(self, k: int) -> dict:
        from elastic_kernels.api.finetune.loop import train_step

        torch.set_rng_state(self.rng)  # each configuration its own stream, as when run alone
        r = train_step(self.job, self.engine, self.opt, k, self.counter)
        self.rng = torch.get_rng_state()
        return r

    def close(self) -> None:
        self.engine.close()
        self.engine = self.opt = None


def measure_memory(job, cfg: Config, counter) -> tuple[int | None, int | None]:
    """(tensor peak, RSS growth) of `cfg` built alone: see [Note: what the frontier's memory
    is]. RSS growth is None on GPU (the tensor peak there is max_memory_allocated)."""
    from elastic_kernels.api.finetune.measure import reset_rss_peak, rss_peak_bytes
    from elastic_kernels.api.planning.peaks import live_tensor_bytes, profiled_growth

    gc.collect()
    gpu = job.device.type == "cuda"
    if gpu:
        job.memory.set_baseline()
        job.memory.reset_peak()
    before = 0 if gpu else live_tensor_bytes()
    rss0 = None if gpu else reset_rss_peak()
    run = Runner(job, cfg, counter)
    if not gpu:
        cfg.static = _tensor_bytes_excluding(run.engine)[0] - before
    try:
        run.step(0)
        run.step(1)
        if gpu:
            run.step(2)
            return job.memory.peak_above_baseline(), None
        peak = rss_peak_bytes()
        rss = None if peak is None or rss0 is None else peak - rss0
        live, _ = _tensor_bytes_excluding(run.engine)
        growth = profiled_growth(lambda: run.step(2))
        return live + growth - before, rss
    finally:
        run.close()
        run = None
        gc.collect()
        dist.barrier()


def interleave(job, configs: list[Config], counter, rounds: int, rank: int) -> None:
    """All configurations alive, one step of each per round; round 0 warms up in the listed
    order, then odd rounds in the listed order and even ones reversed. Fills cfg.steps_run
    (per step: loss, this rank's time, traffic) and cfg.times (the slowest rank's)."""
    from elastic_kernels.api.distributed.agree import exchange

    runners = []
    try:
        for cfg in configs:
            runners.append(Runner(job, cfg, counter))
            cfg.steps_run = []
        for k in range(rounds + 1):
            order = list(runners) if (k == 0 or k % 2 == 1) else list(reversed(runners))
            t0 = time.perf_counter()
            for run in order:
                run.cfg.steps_run.append(run.step(k))
            if rank == 0:
                print(f"  round {k}{' (warm-up)' if k == 0 else ''}: "
                      + ", ".join(f"{r.cfg.label} {r.cfg.steps_run[-1]['time_s']:.2f} s" for r in order)
                      + f"  ({time.perf_counter() - t0:.1f} s)", flush=True)
    finally:
        for run in runners:
            run.close()
        runners = None
        gc.collect()
    every = exchange([[s["time_s"] for s in cfg.steps_run] for cfg in configs], what="bench_frontier step times")
    for i, cfg in enumerate(configs):
        cfg.times = [max(e[i][k] for e in every) for k in range(len(cfg.steps_run))]


def _pair_ratios(a: Config, b: Config) -> dict:
    """Per timed round: b's step time over a's (a's tokens/s over b's)."""
    ratios = [tb / ta for ta, tb in zip(a.times[1:], b.times[1:])]
    return {"median_of_ratios": statistics.median(ratios), "min": min(ratios), "max": max(ratios),
            "ratio_of_medians": statistics.median(b.times[1:]) / statistics.median(a.times[1:]),
            "rounds": len(ratios), "ratios": ratios}


def _pair_configs(spec: str, configs: list[Config]) -> tuple[Config | None, Config | None]:
    mine, _, peer = spec.partition("=")
    system, _, label = peer.partition(":")
    a = next((c for c in configs if c.system.startswith("elastic") and c.label == mine.strip()), None)
    b = next((c for c in configs if c.system == system.strip() and c.label.split(" (")[0] == label.strip()), None)
    return a, b


def pairs(opts, configs: list[Config], job_rank0: bool = False) -> list[dict]:
    out = []
    for spec in (x for x in opts.pairs.split(",") if x.strip()):
        a, b = _pair_configs(spec, configs)
        if a is None or b is None:
            if job_rank0:
                mine, _, peer = spec.partition("=")
                print(f"bench_frontier: --pairs {spec.strip()!r}: {'no elastic configuration ' + repr(mine.strip()) if a is None else 'no configuration ' + repr(peer.strip())} in this run; left out", flush=True)
            continue
        common = sorted(set(a.times_in) & set(b.times_in))
        if not common:  # groups_of keeps a pair together: only if the group size cannot
            if job_rank0:
                print(f"bench_frontier: --pairs {spec.strip()!r}: the two ran in different groups; left out", flush=True)
            continue
        ta, tb = Config(a.system, a.label, None), Config(b.system, b.label, None)
        ta.times, tb.times = a.times_in[common[0]], b.times_in[common[0]]
        out.append({"elastic": a.label, "peer": f"{b.system}: {b.label}", **_pair_ratios(ta, tb),
                    "elastic_peak": a.tensor_peak, "peer_peak": b.tensor_peak,
                    "elastic_rss": a.rss_growth, "peer_rss": b.rss_growth})
    return out


def groups_of(configs: list[Config], size: int, anchor: Config, pair_specs: list[str]) -> list[list[Config]]:
    """The configurations in groups of at most `size`, each with the anchor first, the rest in
    listed order, the two of each --pairs pair kept in one group ([Note: frontier groups])."""
    if size == 0 or size >= len(configs):
        return [[anchor] + [c for c in configs if c is not anchor]]
    partner = {}
    for spec in pair_specs:
        a, b = _pair_configs(spec, configs)
        if a is not None and b is not None and anchor not in (a, b) and size >= 3:
            partner[id(a)], partner[id(b)] = b, a
    units, placed = [], set()
    for c in configs:
        if c is anchor or id(c) in placed:
            continue
        unit = [c] + ([partner[id(c)]] if id(c) in partner and id(partner[id(c)]) not in placed else [])
        placed.update(id(x) for x in unit)
        units.append(unit)
    groups: list[list[Config]] = [[]]
    for unit in units:
        if groups[-1] and len(groups[-1]) + len(unit) > size - 1:
            groups.append([])
        groups[-1].extend(unit)
    return [[anchor] + g for g in groups]


def relate_to_anchor(groups: list[list[Config]]) -> None:
    """Each configuration's tokens/s over the anchor's, per timed round of its group (the
    anchor's step time over its own), and the anchor's times and losses kept from its first
    group; `times_in` already holds every group's times."""
    anchor = groups[0][0]
    for g, group in enumerate(groups):
        for c in group:
            r = [ta / tc for ta, tc in zip(anchor.times_in[g][1:], c.times_in[g][1:])]
            c.vs_anchor = {"median": statistics.median(r), "min": min(r), "max": max(r), "ratios": r, "group": g}
    anchor.vs_anchor = {"median": 1.0, "min": 1.0, "max": 1.0, "ratios": [], "group": 0}
    anchor.times = anchor.times_in[0]


def pairs_table(rows: list[dict], gpu: bool) -> str:
    mem = "max_memory_allocated MiB" if gpu else "tensor peak MiB"
    head = (f"| elastic | peer | tokens/s ratio, median of per-round ratios [min, max] | ratio of medians | rounds "
            f"| {mem}: elastic vs peer |" + ("" if gpu else " RSS growth MiB: elastic vs peer |") + "\n"
            "|---|---|---:|---:|---:|---:|" + ("" if gpu else "---:|") + "\n")
    lines = []
    for r in rows:
        line = (f"| {r['elastic']} | {r['peer']} | {r['median_of_ratios']:.3f}x [{r['min']:.3f}, {r['max']:.3f}] | "
                f"{r['ratio_of_medians']:.3f}x | {r['rounds']} | {_mib(r['elastic_peak'])} vs {_mib(r['peer_peak'])} |")
        if not gpu:
            line += f" {_mib(r['elastic_rss'])} vs {_mib(r['peer_rss'])} |"
        lines.append(line)
    return head + "\n".join(lines) + "\n"


def _mib(b) -> str:
    return "n/a" if b is None else f"{b / 2**20:.1f}"


def summarize(job, configs: list[Config], refs: dict[str, list[float]]) -> list[dict]:
    """One row per configuration; `refs`: per weight format, the losses its runs are set against."""
    from elastic_kernels.api.finetune.peers.frontier import best_peer_at_or_below, pareto

    rows = []
    gpu = job.device.type == "cuda"
    tokens_per_step = job.world_size * job.args.micro_batch * job.args.grad_accum * job.args.seq_len
    grouped = len(configs[0].times_in) > 1  # the anchor ran in more than one group
    if grouped:  # [Note: frontier groups]: the anchor's step time over all its timed rounds
        anchor_s = statistics.median(t for times in configs[0].times_in.values() for t in times[1:])
    for cfg in configs:
        step_s = anchor_s / cfg.vs_anchor["median"] if grouped else statistics.median(cfg.times[1:])
        steps = cfg.steps_run
        losses = [s["loss"] for s in steps]
        ref_losses = refs.get(cfg.weight_format)
        diff = None if ref_losses is None else max(abs(a - b) for a, b in zip(losses, ref_losses))
        va = cfg.vs_anchor
        rows.append({
            "system": cfg.system, "config": cfg.label,
            "tokens_per_s": tokens_per_step / step_s, "step_time_s": step_s,
            "peak_memory_mib": None if cfg.tensor_peak is None else cfg.tensor_peak / 2**20,
            "memory_measure": "max_memory_allocated" if gpu else "tensor peak (CPU)",
            "peak_tensor_mib": None if gpu or cfg.tensor_peak is None else cfg.tensor_peak / 2**20,
            "static_tensor_mib": None if cfg.static is None else cfg.static / 2**20,
            "peak_rss_mib": None if gpu or cfg.rss_growth is None else cfg.rss_growth / 2**20,
            "allgather_mib_per_step": statistics.median(s["counted"] for s in steps[1:]) / 2**20,
            "allgather_calls_per_step": statistics.median(s["calls"] for s in steps[1:]),
            "allgather_mib_first_step": steps[0]["counted"] / 2**20,
            "max_abs_loss_diff": diff, "final_loss": losses[-1],
            "group": None if va is None else va["group"],
            "vs_anchor": None if va is None else va["median"], "vs_anchor_min": None if va is None else va["min"],
            "vs_anchor_max": None if va is None else va["max"],
        })
    formats = {r["system"]: c.weight_format for r, c in zip(rows, configs)}
    peer_pts = [{"memory": r["peak_memory_mib"], "tokens_per_s": r["tokens_per_s"], "row": r}
                for r in rows if not r["system"].startswith("elastic")]
    for system in {r["system"] for r in rows}:
        mine = [r for r in rows if r["system"] == system]
        front = set(pareto([(r["peak_memory_mib"], r["tokens_per_s"]) for r in mine]))
        for i, r in enumerate(mine):
            r["on_frontier"] = i in front
    for fmt in set(formats.values()):  # every system together, within one weight format
        mine = [r for r in rows if formats[r["system"]] == fmt]
        front = set(pareto([(r["peak_memory_mib"], r["tokens_per_s"]) for r in mine]))
        for i, r in enumerate(mine):
            r["on_joint_frontier"] = i in front
    for r in rows:
        mine = [p for p in peer_pts if formats[p["row"]["system"]] == formats[r["system"]]]  # its own weights
        best = best_peer_at_or_below(r["peak_memory_mib"], mine) if r["system"].startswith("elastic") else None
        r["best_peer_at_or_below"] = "" if best is None else f"{best['row']['system']}: {best['row']['config']}"
        r["vs_best_peer"] = None if best is None else r["tokens_per_s"] / best["tokens_per_s"]
    return rows


def _fmt(v, spec=".1f"):
    return "n/a" if v is None else format(v, spec)


def table(rows: list[dict]) -> str:
    measure = rows[0]["memory_measure"] if rows else "tensor peak (CPU)"
    grouped = any(r.get("group") for r in rows)
    head = (f"| system | configuration | tokens/s | {measure} MiB | RSS growth MiB (mmap threshold fixed) "
            "| all-gather MiB/step | all-gathers/step | on its system's frontier | on the joint frontier "
            "| fastest peer at <= memory | vs it |"
            + (" group | tokens/s vs the anchor, median of per-round ratios [min, max] |" if grouped else "")
            + "\n|---|---|---:|---:|---:|---:|---:|---|---|---|---:|" + ("---:|---:|" if grouped else "") + "\n")
    lines = []
    for r in rows:
        va = (f" {r['group']} | {r['vs_anchor']:.3f}x [{r['vs_anchor_min']:.3f}, {r['vs_anchor_max']:.3f}] |"
              if grouped else "")
        lines.append(f"| {r['system']} | {r['config']} | {r['tokens_per_s']:.1f} | {_fmt(r['peak_memory_mib'])} | "
                     f"{_fmt(r['peak_rss_mib'])} | {r['allgather_mib_per_step']:.2f} | {r['allgather_calls_per_step']:.0f} | "
                     f"{'yes' if r['on_frontier'] else ''} | {'yes' if r['on_joint_frontier'] else ''} | "
                     f"{r['best_peer_at_or_below'] or ('-' if not r['system'].startswith('elastic') else 'none fits')} | "
                     f"{'' if r['vs_best_peer'] is None else format(r['vs_best_peer'], '.2f') + 'x'} |" + va)
    return head + "\n".join(lines) + "\n"


def picture(rows: list[dict], path: str, caption: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from elastic_kernels.api.finetune.peers.frontier import plot_frontier

    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)  # a new --results folder (the CSV's too)
    fig, ax = plt.subplots(figsize=(10, 6))
    plot_frontier(ax, [{"system": r["system"], "label": r["config"].split(" (")[0],
                        "memory": None if r["peak_memory_mib"] is None else r["peak_memory_mib"] * 2**20,
                        "tokens_per_s": r["tokens_per_s"]} for r in rows],
                  memory_label="peak memory MiB per rank (tensor peak on CPU, max_memory_allocated on GPU)")
    ax.set_title("\n".join(textwrap.wrap(caption, 130)), fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120, format="png")
    plt.close(fig)


def start_job(opts, rest: list[str], steps: int, tmp: str):
    """The CLI's job for this bench's model options (--preset, else --model with REAL_OPTIONS)
    and the finetune options in `rest`, `steps` steps, saving under `tmp`; its process group
    started. Returns (job, parsed CLI args). One thread per rank."""
    from elastic_kernels.api.finetune.job import prepare
    from elastic_kernels.api.finetune.options import parse_args

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.set_num_threads(1)
    if opts.preset is not None:
        model_opts = PRESETS[opts.preset]
    else:
        from elastic_kernels.api.loading.pretrained import pretrained_dir

        model_dir = opts.model if os.path.isdir(opts.model) else str(pretrained_dir(opts.model))
        model_opts = ["--model", model_dir] + REAL_OPTIONS
    args = parse_args(model_opts + rest + ["--steps", str(steps), "--no-progress", "--overwrite",
                                           "--save-dir", os.path.join(tmp, f"rank{rank}")])
    job = prepare(args, rank, world, int(os.environ.get("LOCAL_RANK", "0")))
    os.makedirs(job.save_dir, exist_ok=True)  # the planned runs write plan.json there (rank 0)
    start_group(job, args.timeout_s)
    return job, args


def seed_adapters(job) -> None:
    """Every configuration starts from the same adapters: those of one elastic build."""
    from elastic_kernels.api.finetune.engines import ElasticEngine
    from elastic_kernels.api.nn import adapter_state_dict

    seed = ElasticEngine(job, None)
    job.initial_adapters = {k: v.clone() for k, v in adapter_state_dict(seed.model).items()}


def main(argv=None) -> int:
    import warnings

    warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.* is deprecated")
    from elastic_kernels.api.distributed.agree import exchange
    from elastic_kernels.api.finetune.measure import AllGatherCounter, fix_mmap_threshold
    from elastic_kernels.api.finetune.report import nf4_gap_bound

    opts, rest = _parse(sys.argv[1:] if argv is None else argv)
    mmap_fixed = fix_mmap_threshold()  # before anything is allocated: [Note: what the frontier's memory is]
    rank, W = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    tmp = tempfile.mkdtemp(prefix="bench_frontier_")
    rounds = opts.passes * (opts.steps - 1)
    job, args = start_job(opts, rest, rounds + 1, tmp)
    device = job.device
    load = os.getloadavg()
    with AllGatherCounter() as counter:
        seed_adapters(job)
        configs = configurations(opts, job, counter)
        if rank == 0:
            print(f"bench_frontier: {len(configs)} configurations, memory each alone (3 steps), then 1 + {rounds} "
                  f"interleaved rounds; {W} ranks ({dist.get_backend()}), {job.spec.description()}; "
                  f"mmap threshold {'fixed' if mmap_fixed else 'NOT fixed (RSS not comparable)'}; "
                  f"load average {load[0]:.1f}", flush=True)
        t_start = time.perf_counter()
        for cfg in configs:
            cfg.tensor_peak, cfg.rss_growth = measure_memory(job, cfg, counter)
            # every rank's figures (a rank's share of a weight's ragged last chunk differs)
            per_rank = exchange((cfg.static, cfg.tensor_peak), what="bench_frontier memory")
            if rank == 0:
                print(f"  memory: {cfg.system:9s} {cfg.label:50s} {_mib(cfg.tensor_peak)} MiB "
                      f"{'max_memory_allocated' if device.type == 'cuda' else 'tensor peak'}"
                      + ("" if cfg.static is None else f", static {_mib(cfg.static)} MiB (built, before a step)")
                      + ("" if cfg.rss_growth is None else f", RSS growth {_mib(cfg.rss_growth)} MiB")
                      + (f"; per rank: static {', '.join(f'{st / 2**20:.3f}' for st, _ in per_rank)} MiB, "
                         f"tensor peak {', '.join(f'{pk / 2**20:.3f}' for _, pk in per_rank)} MiB"
                         if cfg.static is not None and cfg.tensor_peak is not None else ""),
                      flush=True)
        anchor = configs[0] if opts.anchor is None else next((c for c in configs if c.label == opts.anchor), None)
        if anchor is None:
            raise SystemExit(f"bench_frontier: --anchor {opts.anchor!r}: no such configuration; "
                             f"there are {[c.label for c in configs]}")
        groups = groups_of(configs, opts.groups, anchor, [x for x in opts.pairs.split(",") if x.strip()])
        anchor_losses = []
        for g, group in enumerate(groups):
            if rank == 0 and len(groups) > 1:
                print(f"group {g + 1} of {len(groups)}: " + ", ".join(c.label for c in group), flush=True)
            interleave(job, group, counter, rounds, rank)
            for c in group:
                c.times_in[g] = list(c.times)
            anchor_losses.append([st["loss"] for st in anchor.steps_run])
            if g == 0:
                anchor_steps = anchor.steps_run
        anchor.steps_run = anchor_steps  # the losses, traffic and times of its first group
        relate_to_anchor(groups)
        configs = [anchor] + [c for c in configs if c is not anchor]  # the reference of the losses
        refs = {}  # the first configuration of each weight format: the others of it are set against it
        for c in configs:
            refs.setdefault(c.weight_format, (c, [st["loss"] for st in c.steps_run]))
        rows = summarize(job, configs, {f: losses for f, (_, losses) in refs.items()})
        pair_rows = pairs(opts, configs, rank == 0)
        elapsed = time.perf_counter() - t_start
    load_end = os.getloadavg()
    if rank == 0:
        ctx = context(device)
        tokens_per_step = W * args.micro_batch * args.grad_accum * args.seq_len
        name = opts.preset or os.path.basename(os.path.normpath(opts.model))
        csv_rows = [{**ctx, "preset": name, "model": job.spec.description(), "world_size": W,
                     "backend": dist.get_backend(), "tokens_per_step": tokens_per_step, "steps": opts.steps,
                     "passes": opts.passes, "rounds": rounds, "mmap_threshold_fixed": mmap_fixed,
                     "load_avg_start": round(load[0], 2), "load_avg_end": round(load_end[0], 2),
                     **{k: (round(v, 6) if isinstance(v, float) else v) for k, v in r.items()}} for r in rows]
        out_dir = results_dir(opts.results)
        png = opts.png or os.path.join(out_dir, "frontier.png" if name == "demo" else f"frontier_{name}.png")
        caption = (f"{ctx['date']} · {ctx['device']} · {W} ranks ({dist.get_backend()}) · {job.spec.description()} · "
                   f"{tokens_per_step} tokens/step · load {load[0]:.1f}-{load_end[0]:.1f}")
        picture(rows, png, caption)
        print()
        print(table(rows), end="")
        print()
        if pair_rows:
            print(pairs_table(pair_rows, device.type == "cuda"), end="")
            for r in pair_rows:
                print(f"per-round ratios, {r['elastic']} vs {r['peer']}: " + ", ".join(f"{x:.3f}" for x in r["ratios"]))
            print()
        for fmt, (ref_cfg, ref_losses) in refs.items():
            worst = max((r for r, c in zip(rows, configs) if c.weight_format == fmt), key=lambda r: r["max_abs_loss_diff"])
            # nf4: [Note: the NF4 peer's loss tolerance]; int8 has no peer: its runs differ by rounding
            bound = nf4_gap_bound("float32", ref_losses) if fmt == "nf4" else 1e-5
            beyond = "beyond the NF4 tolerance" if fmt == "nf4" else "more than fp32 rounding"
            of = "any run" if len(refs) == 1 else f"any {fmt} run"
            print(f"largest |loss - {ref_cfg.system} loss| of {of}, any step: {worst['max_abs_loss_diff']:.3g} "
                  f"({worst['system']}: {worst['config']})" + (f"  <-- {beyond}" if worst["max_abs_loss_diff"] > bound else ""))
        if len(anchor_losses) > 1:
            same = max(abs(a - b) for other in anchor_losses[1:] for a, b in zip(anchor_losses[0], other))
            print(f"the anchor ({anchor.label}) in {len(anchor_losses)} groups: largest loss difference between "
                  f"them {same:.3g}")
            for r, c in zip(rows, configs):
                if c is not anchor:
                    print(f"per-round ratios, {c.label} ({c.system}) vs the anchor, group {r['group']}: "
                          + ", ".join(f"{x:.3f}" for x in c.vs_anchor["ratios"]))
        print(f"load average {load[0]:.1f} at the start, {load_end[0]:.1f} at the end; {elapsed:.0f} s", flush=True)
        # The rows last: a file of another schema refuses them (append_rows), after the report printed.
        path = append_rows("frontier", csv_rows, out_dir)
        print(f"rows: {path}\npicture: {png}", flush=True)
    dist.barrier()
    dist.destroy_process_group()
    shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # [Note: exiting without teardown] in python_api/finetune/cli.py
