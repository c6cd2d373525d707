"""Many adapters on one cached base (issue 29): K LoRA adapters trained in one elastic job
against the same K adapters trained one after another, by the elastic runtime and by FSDP2 +
PEFT, in one process group.

    torchrun --standalone --nproc-per-node 2 bench/bench_adapters.py [--model smollm2-135m-instruct |
        --preset tiny|demo|large] [--adapters 1,2,4,8] [--budgets 0,all] [--rounds 3]
        [--k-budgets '8=0'] [--fsdp2-adapters 1,2,4,8] [--memory-budgets 0,all] [--memory-adapters 1,2,4,8]
        [--profile-adapters 4,8]
        [--results DIR] [finetune options ...]

The model, the job and the launcher are bench/bench_frontier.py's (the real model by default:
seq 128, micro-batch 1 per adapter, no accumulation; `--preset` for an embedded one). K
adapters make a hyperparameter sweep: adapter i is the job's LoRAConfig with seed
`--seed + i` (its initial A), and every adapter trains on the job's batch of the step.

The configurations, at each K of --adapters and each pool budget of --budgets:
- multi: one elastic model converted with K named adapters ({"a0": LoRAConfig, ...}); the
  micro-batch is the step's sequence repeated K times with adapter_names = the K names, the
  loss the sum of the per-adapter mean losses (each adapter's own token mean: the loss it
  would have alone), one AdamW per adapter (adapter_parameters); one step.
- sequential: the same K adapters trained one after another by the elastic runtime at the
  same budget: K steps of a 1-adapter elastic model (the CLI's ElasticEngine, one
  LoRAConfig). One model serves all K adapters: a step's time does not depend on the
  adapter's values, so before adapter i's step its values are copied in (and out after),
  and adapter i has its own AdamW (its own state) over that model's parameters. The copies
  are outside the timed step. So each sequential adapter is trained exactly as it would be
  alone, across rounds, from the initial values it gets alone (the layer's own
  initialisation at seed --seed + i: [Note: initialisation and replication] in
  python_api/nn/lora.py), and its losses can be set against the multi job's.
- fsdp2 (at each K of --fsdp2-adapters): K steps of FSDP2 + PEFT as the CLI's `--baseline
  fsdp2` builds it (python_api/finetune/engines.py: FSDP2Engine, reshard after forward),
  from adapter a0's initial values. One model serves every K (its time does not depend on
  the adapter's values either); only its first step's loss is compared (with sequential
  a0's first).

[Note: the adapters bench's rounds]
Timing follows bench_frontier's [Note: what the frontier's memory is]: all configurations of
a block alive, one warm-up round, then --rounds timed rounds, round k running one unit of
each configuration (a multi step, K sequential steps, K FSDP2 steps) in the listed order for
odd k and reversed for even k; a unit's time is the slowest rank's (its K steps summed on
each rank first). Aggregate tokens/s = K x ranks x seq tokens over the unit's time; the
ratios are time(K sequential steps) / time(one multi step) and time(K FSDP2 steps) /
time(one multi step) per round: their median with [min, max], beside the ratio of medians.
The configurations are interleaved in one block per K, in the order of --adapters, at the
budgets of --budgets or of --k-budgets for that K (the K-adapter models of every budget,
built for the block and closed after it; the 1-adapter models and FSDP2 live across
blocks), not all K at once: on the real model at budget all every elastic model keeps the
whole base in its pool (about 0.9 GiB per rank), and eight such models did not fit the
shared VM. Every ratio is taken within one round of one block.

Memory (the multi job's tensor peak, each configuration built alone after the blocks, when
everything else is closed; bench_frontier.measure_memory: 3 steps, the third profiled): at
each budget of --memory-budgets, the multi job at each K of --memory-adapters (default 1, 2
and every K of --adapters), and the 1-adapter elastic job. The per-adapter growth is MEASURED as peak(K=2) - peak(K=1) (activations of one
more row, its adapter, gradients and AdamW state); the bound set against peak(K) is peak(1)
+ (K-1) x that difference. The analytic adapter + gradient + AdamW bytes (4 x the adapter's
fp32 bytes) are printed beside it.

Exactness, asserted: at every round each multi adapter's loss equals its sequential
counterpart's within 1e-5 (fp32 rounding, as bench_frontier bounds its peers), and FSDP2's
first loss sequential a0's first; a mismatch ends the script with exit code 1 after the
tables, so that a wrong measurement cannot pass as a fast one. All-gathered bytes per step
of the multi job are printed beside the 1-adapter job's (issue 29: equal at the same budget).

Profile (--profile-adapters, at budget 0 when in --budgets): after its block's timed rounds,
one more multi step with rank 0 under torch.profiler (CPU): the time split between waiting
for gathers, the gradient all-reduce, GEMMs and the rest.

Rows go to <results>/adapters.csv (one per budget and K).
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import os
import shutil
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from bench.bench_frontier import PRESETS, REAL_MODEL, REAL_OPTIONS, Config, Runner, _mib, _pair_ratios, measure_memory  # noqa: E402
from bench.harness import append_rows, context, results_dir, start_group  # noqa: E402
from elastic_kernels.api.finetune.engine import Engine, model_inputs  # noqa: E402
from elastic_kernels.api.finetune.sweep import PerAdapterAdamW, adapter_losses, repeat_rows  # noqa: E402  (the CLI's --sweep's)

LOSS_TOL = 1e-5  # fp32 rounding over a few steps: bench_frontier's bound for its peers


def _ints(text: str, flag: str, p) -> list[int]:
    try:
        out = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        p.error(f"{flag}: a comma-separated list of positive ints is expected, got {text!r}")
    if any(k < 1 for k in out) or len(set(out)) != len(out):
        p.error(f"{flag}: positive, distinct numbers of adapters are expected, got {text!r}")
    return out


def _parse(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    p.add_argument("--model", default=REAL_MODEL, help="the real model (a pretrained_dir name or an HF directory)")
    p.add_argument("--preset", choices=sorted(PRESETS), default=None, help="an embedded model instead of --model")
    p.add_argument("--adapters", default="1,2,4,8", help="numbers of adapters K, one block each")
    p.add_argument("--budgets", default="0,all", help="elastic pool budgets")
    p.add_argument("--rounds", type=int, default=3, help="timed rounds per block, after one warm-up round")
    p.add_argument("--k-budgets", default="",
                   help="budgets of some blocks, e.g. '8=0' (K=8 at budget 0 only; others at --budgets)")
    p.add_argument("--memory-adapters", default=None, help="K whose tensor peak is measured (default 1, 2 and --adapters)")
    p.add_argument("--fsdp2-adapters", default=None, help="the K at which FSDP2 + PEFT runs (default: every K; '' none)")
    p.add_argument("--memory-budgets", default=None, help="budgets whose tensor peaks are measured (default: --budgets)")
    p.add_argument("--profile-adapters", default="4,8", help="K whose multi step at budget 0 is profiled ('' none)")
    p.add_argument("--results", default=None, help="folder for adapters.csv (default bench/results)")
    opts, rest = p.parse_known_args(argv)
    if opts.rounds < 1:
        p.error("--rounds must be >= 1")
    opts.ks = _ints(opts.adapters, "--adapters", p)
    if not opts.ks:
        p.error("--adapters: at least one K")
    opts.fsdp2_ks = opts.ks if opts.fsdp2_adapters is None else _ints(opts.fsdp2_adapters, "--fsdp2-adapters", p)
    opts.profile_ks = _ints(opts.profile_adapters, "--profile-adapters", p)
    opts.memory_ks = sorted({1, 2, *opts.ks}) if opts.memory_adapters is None else \
        _ints(opts.memory_adapters, "--memory-adapters", p)
    opts.block_budgets = {}
    for item in (x for x in opts.k_budgets.split(";") if x.strip()):
        k, eq, bs = item.partition("=")
        if not eq or not k.strip().isdigit() or int(k) not in opts.ks or not bs.strip():
            p.error(f"--k-budgets: {item!r} is not 'K=budget[,budget]' for a K of --adapters")
        opts.block_budgets[int(k)] = bs
    if opts.memory_budgets is None:
        opts.memory_budgets = opts.budgets
    from elastic_kernels.api.finetune.option_values import _budget

    for flag, text in [("budgets", opts.budgets), ("memory_budgets", opts.memory_budgets)] + \
            [("k_budgets", t) for t in opts.block_budgets.values()]:
        for b in (x for x in text.split(",") if x.strip()):
            try:
                _budget(b)
            except argparse.ArgumentTypeError as exc:
                p.error(f"--{flag.replace('_', '-')}: {exc}")
    if not [b for b in opts.budgets.split(",") if b.strip()]:
        p.error("--budgets: at least one budget")
    return opts, rest


def _budgets(text: str) -> list[tuple[str, object]]:
    from elastic_kernels.api.finetune.option_values import _budget, budget_label

    return [(budget_label(_budget(b)), _budget(b)) for b in text.split(",") if b.strip()]


def adapter_names(k: int) -> list[str]:
    return [f"a{i}" for i in range(k)]


# ------------------------------------------------------------------ the multi job


class MultiEngine(Engine):
    """K named adapters on one elastic model: the step's sequence once per adapter, one
    forward and backward for all, the loss the sum of the per-adapter mean losses."""

    kind = "multi"

    def __init__(self, job, budget, k: int):
        from elastic_kernels.api.finetune.engines import _collective_build_on_meta
        from elastic_kernels.api.finetune.loop import adamw
        from elastic_kernels.api.finetune.models import lora_config
        from elastic_kernels.api.finetune.option_values import budget_label
        from elastic_kernels.api.finetune.policy import elastic_policy
        from elastic_kernels.api.nn import adapter_parameters, convert_to_elastic, runtime_of

        if job.cfg.training.grad_accum != 1:
            raise SystemExit("bench_adapters: --grad-accum 1 only (one micro-batch of K rows per step)")
        model, source = _collective_build_on_meta(job)
        base = lora_config(job.cfg.lora, job.cfg.training.seed)
        self.names = adapter_names(k)
        self.configs = {n: dataclasses.replace(base, seed=base.seed + i) for i, n in enumerate(self.names)}
        self.model = convert_to_elastic(model, self.configs, elastic_policy(job.cfg, budget, None, job.world_size),
                                        source=source)
        self.runtime = runtime_of(self.model)
        frozen = sum(et.nbytes for et in self.runtime.tensors)
        self.runtime.set_pool_budget(int(budget[1] * frozen) if isinstance(budget, tuple) else budget)
        self.name = f"multi K={k}, budget {budget_label(budget)}"
        self.micro_batch, self.grad_accum = job.args.micro_batch, 1
        self.adapter_params = {n: adapter_parameters(self.model, n) for n in self.names}
        self.optimizer = PerAdapterAdamW([adamw(self.adapter_params[n], job.args) for n in self.names])
        self.last_losses: list[float] = []

    def params(self):
        return [(f"{n}.{i}", p) for n in self.names for i, p in enumerate(self.adapter_params[n])]

    def run_step(self, job, batch: dict, opt) -> float:
        k = len(self.names)
        inputs = model_inputs(batch, 0)
        labels = inputs.pop("labels")
        # the micro-batch once per adapter (row r of adapter i at i * micro_batch + r), each
        # adapter's own token mean over its rows: the loss it has alone (finetune/sweep.py)
        names = [n for n in self.names for _ in range(labels.shape[0])]
        out = self.model(**repeat_rows(inputs, k), adapter_names=names)
        per = adapter_losses(out.logits, labels, k)
        per.sum().backward()
        self.optimizer_step(opt)
        losses = per.detach().double()
        dist.all_reduce(losses)
        self.last_losses = (losses / job.world_size).tolist()
        return float(sum(self.last_losses))

    def step_figures(self) -> dict:
        return {"adapter_losses": list(self.last_losses)}

    def accumulate(self, is_last: bool):
        raise AssertionError("MultiEngine.run_step has no accumulation")

    def gathered_bytes(self) -> int:
        return self.runtime.stats()["allgather_bytes"]

    def close(self) -> None:
        self.runtime.close()


def _config(label: str, build) -> Config:
    return Config("elastic", label, build)


# ------------------------------------------------------------------ the units of a round


def solo_initial(engine, seed: int) -> list[torch.Tensor]:
    """The initial values of the 1-adapter model's parameters (engine.params() order) had its
    LoRAConfig the seed `seed`: each layer's own initialisation, built anew."""
    from elastic_kernels.api.nn import ElasticLoRALinear

    layers = {n: m for n, m in engine.model.named_modules() if isinstance(m, ElasticLoRALinear)}
    out = []
    for name, _ in engine.params():
        layer_name, _, which = name.rpartition(".lora_")
        m = layers[layer_name]
        fresh = ElasticLoRALinear(m.et, None, dataclasses.replace(m.lora, seed=seed), layer_name,
                                  fan_in_fan_out=m.fan_in_fan_out)
        out.append((fresh.lora_A if which.startswith("A.") else fresh.lora_B).weight.detach().clone())
    return out


class MultiUnit:
    def __init__(self, job, label, budget, k, counter):
        self.label, self.k = label, k
        self.runner = Runner(job, _config(label, lambda: MultiEngine(job, budget, k)), counter)
        self.steps: list[dict] = []
        self.times: list[float] = []

    def unit(self, step: int) -> dict:
        r = self.runner.step(step)
        return {"time_s": r["time_s"], "losses": r["adapter_losses"], "gathered": r["gathered"]}

    def close(self):
        self.runner.close()


class RepeatUnit:
    """K steps of one engine (`runner`, shared), each with its own adapter values and AdamW
    when `seeds` is given (the sequential elastic job), else the engine's own (FSDP2)."""

    def __init__(self, job, label, runner, k, seeds=None):
        from elastic_kernels.api.finetune.loop import adamw

        self.label, self.k, self.runner = label, k, runner
        self.params = [p for _, p in runner.engine.params()]
        self.values = None if seeds is None else [solo_initial(runner.engine, s) for s in seeds]
        self.opts = None if seeds is None else [adamw(self.params, job.args) for _ in seeds]
        self.rngs = None if seeds is None else [runner.rng.clone() for _ in seeds]
        self.steps: list[dict] = []
        self.times: list[float] = []

    def unit(self, step: int) -> dict:
        total, losses, gathered = 0.0, [], []
        for i in range(self.k):
            if self.values is not None:
                with torch.no_grad():
                    for p, v in zip(self.params, self.values[i]):
                        p.copy_(v)
                self.runner.opt, self.runner.rng = self.opts[i], self.rngs[i]
            r = self.runner.step(step)
            if self.values is not None:
                with torch.no_grad():
                    for p, v in zip(self.params, self.values[i]):
                        v.copy_(p)
                self.rngs[i] = self.runner.rng
            total += r["time_s"]
            losses.append(r["loss"])
            gathered.append(r["gathered"])
        return {"time_s": total, "losses": losses, "gathered": gathered[0]}

    def close(self):
        pass


def interleave(units: list, rounds: int, rank: int, block: str) -> None:
    """bench_frontier.interleave's rounds over units ([Note: the adapters bench's rounds])."""
    from elastic_kernels.api.distributed.agree import exchange

    for u in units:
        u.steps = []
    for k in range(rounds + 1):
        order = list(units) if (k == 0 or k % 2 == 1) else list(reversed(units))
        t0 = time.perf_counter()
        for u in order:
            u.steps.append(u.unit(k))
        if rank == 0:
            print(f"  {block} round {k}{' (warm-up)' if k == 0 else ''}: "
                  + ", ".join(f"{u.label} {u.steps[-1]['time_s']:.2f} s" for u in order)
                  + f"  ({time.perf_counter() - t0:.1f} s)", flush=True)
    every = exchange([[s["time_s"] for s in u.steps] for u in units], what="bench_adapters unit times")
    for i, u in enumerate(units):
        u.times = [max(e[i][k] for e in every) for k in range(len(u.steps))]


def profile_step(unit: MultiUnit, step: int, rank: int) -> dict | None:
    """One more multi step, rank 0 under torch.profiler (CPU): where its time goes."""
    from torch.profiler import ProfilerActivity, profile

    from elastic_kernels.api.planning.peaks import _kineto_quiet

    if rank != 0:
        unit.unit(step)
        return None
    with _kineto_quiet():
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            t0 = time.perf_counter()
            unit.unit(step)
            wall = time.perf_counter() - t0
        events = prof.key_averages()
    us = {e.key: (e.cpu_time_total, e.self_cpu_time_total, e.count) for e in events}

    def total(*keys):
        return sum(us[k][0] for k in keys if k in us) / 1e6

    def self_of(pred):
        return sum(v[1] for k, v in us.items() if pred(k)) / 1e6

    gemm = ("aten::mm", "aten::addmm", "aten::bmm", "aten::matmul_out", "aten::baddbmm", "aten::addmm_")
    split = {
        "wall_s": wall,
        "gather_wait_s": total("elastic::gather_wait"),
        "gather_issue_s": total("elastic::gather", "elastic::gather_full"),
        "grad_allreduce_s": total("elastic::all_reduce_grads", "elastic::all_reduce_grads_wait",
                                  "elastic::all_reduce_grads_apply"),
        "gemm_self_s": self_of(lambda k: k in gemm),
        "attention_self_s": self_of(lambda k: "scaled_dot_product" in k or "flash_attention" in k),
        "loss_self_s": self_of(lambda k: "log_softmax" in k or "nll_loss" in k or "cross_entropy" in k),
        "optimizer_self_s": self_of(lambda k: k.startswith("aten::_foreach") or "adamw" in k.lower()),
        # the elastic layers' forward and backward, everything inside them (their GEMMs, waits) included
        "elastic_layers_fwd_s": total("ElasticMultiLoRAFunction"),
        "elastic_layers_bwd_s": total("ElasticMultiLoRAFunctionBackward"),
    }
    top = sorted(events, key=lambda e: -e.self_cpu_time_total)[:12]
    split["top"] = [(e.key, e.self_cpu_time_total / 1e6, e.count) for e in top]
    return split


# ------------------------------------------------------------------ reporting


def _losses_diff(multi, seq) -> float:
    """The largest |multi adapter i's loss - sequential adapter i's| over the rounds (inf if
    any is not finite, or if the two did not run the same rounds and adapters)."""
    pairs = [(a, b) for m, s in zip(multi.steps, seq.steps) for a, b in zip(m["losses"], s["losses"])]
    if len(multi.steps) != len(seq.steps) or any(len(m["losses"]) != len(s["losses"])
                                                 for m, s in zip(multi.steps, seq.steps)) or not pairs:
        return float("inf")
    diffs = [abs(a - b) for a, b in pairs]
    return max(diffs) if all(d == d and d != float("inf") for d in diffs) else float("inf")


def rows_of(job, budget_label: str, k: int, multi: MultiUnit, seq: RepeatUnit, fsdp: RepeatUnit | None) -> dict:
    W, T = job.world_size, job.args.seq_len
    tokens = k * W * job.args.micro_batch * T
    vs_seq = _pair_ratios(multi, seq)
    vs_fsdp = _pair_ratios(multi, fsdp) if fsdp is not None else None
    med = statistics.median(multi.times[1:])
    return {
        "budget": budget_label, "adapters": k, "tokens_per_unit": tokens, "rounds": len(multi.times) - 1,
        "multi_step_s": med, "multi_tokens_per_s": tokens / med,
        "sequential_tokens_per_s": tokens / statistics.median(seq.times[1:]),
        "fsdp2_tokens_per_s": None if fsdp is None else tokens / statistics.median(fsdp.times[1:]),
        "vs_sequential_median": vs_seq["median_of_ratios"], "vs_sequential_min": vs_seq["min"],
        "vs_sequential_max": vs_seq["max"], "vs_sequential_ratio_of_medians": vs_seq["ratio_of_medians"],
        "vs_fsdp2_median": None if vs_fsdp is None else vs_fsdp["median_of_ratios"],
        "vs_fsdp2_min": None if vs_fsdp is None else vs_fsdp["min"],
        "vs_fsdp2_max": None if vs_fsdp is None else vs_fsdp["max"],
        "vs_fsdp2_ratio_of_medians": None if vs_fsdp is None else vs_fsdp["ratio_of_medians"],
        "multi_allgather_mib_per_step": statistics.median(s["gathered"] for s in multi.steps[1:]) / 2**20,
        "single_allgather_mib_per_step": statistics.median(s["gathered"] for s in seq.steps[1:]) / 2**20,
        "tensor_peak_mib": None, "bound_mib": None, "single_adapter_job_peak_mib": None,  # add_memory
        "max_abs_loss_diff_vs_sequential": _losses_diff(multi, seq),
        "vs_sequential_ratios": " ".join(f"{r:.3f}" for r in vs_seq["ratios"]),
        "vs_fsdp2_ratios": "" if vs_fsdp is None else " ".join(f"{r:.3f}" for r in vs_fsdp["ratios"]),
    }


def add_memory(rows: list[dict], memory: dict) -> None:
    """The memory columns of each row: its tensor peak, peak(1) + (K-1) x (peak(2) - peak(1))
    and the 1-adapter job's peak, where measured."""
    for r in rows:
        b, k = r["budget"], r["adapters"]
        peak, p1, p2, single = (memory.get((b, x)) for x in (k, 1, 2, "single"))
        bound = None if None in (peak, p1, p2) else p1 + (k - 1) * (p2 - p1)
        r["tensor_peak_mib"] = None if peak is None else peak / 2**20
        r["bound_mib"] = None if bound is None else bound / 2**20
        r["single_adapter_job_peak_mib"] = None if single is None else single / 2**20


def loss_failures(rows: list[dict], fsdp_first: tuple[float, float] | None) -> list[str]:
    """What the exactness check refuses: a multi adapter's loss beyond LOSS_TOL of its
    sequential run's at any round, or FSDP2's first loss beyond it of sequential a0's first."""
    out = [f"budget {r['budget']}, K={r['adapters']}: a multi adapter's loss differs from its sequential run's by "
           f"{r['max_abs_loss_diff_vs_sequential']:.3g} (> {LOSS_TOL:g})"
           for r in rows if not r["max_abs_loss_diff_vs_sequential"] <= LOSS_TOL]  # NaN fails too
    if fsdp_first is not None and not abs(fsdp_first[0] - fsdp_first[1]) <= LOSS_TOL:
        out.append(f"FSDP2's first loss {fsdp_first[0]:.7g} differs from sequential a0's first {fsdp_first[1]:.7g} "
                   f"by more than {LOSS_TOL:g}")
    return out


def _x(v) -> str:
    return "n/a" if v is None else f"{v:.3f}x"


def table(rows: list[dict]) -> str:
    head = ("| budget | K | multi tokens/s | sequential tokens/s | FSDP2 tokens/s | vs sequential: median [min, max] "
            "| ratio of medians | vs FSDP2: median [min, max] | ratio of medians | rounds | all-gather MiB/step: "
            "multi vs 1-adapter | max abs loss diff |\n"
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n")
    lines = []
    for r in rows:
        f = r["fsdp2_tokens_per_s"]
        lines.append(
            f"| {r['budget']} | {r['adapters']} | {r['multi_tokens_per_s']:.1f} | {r['sequential_tokens_per_s']:.1f} | "
            f"{'n/a' if f is None else format(f, '.1f')} | {_x(r['vs_sequential_median'])} "
            f"[{r['vs_sequential_min']:.3f}, {r['vs_sequential_max']:.3f}] | {_x(r['vs_sequential_ratio_of_medians'])} | "
            + ("n/a | n/a" if f is None else f"{_x(r['vs_fsdp2_median'])} [{r['vs_fsdp2_min']:.3f}, "
               f"{r['vs_fsdp2_max']:.3f}] | {_x(r['vs_fsdp2_ratio_of_medians'])}")
            + f" | {r['rounds']} | {r['multi_allgather_mib_per_step']:.2f} vs {r['single_allgather_mib_per_step']:.2f} "
            f"| {r['max_abs_loss_diff_vs_sequential']:.3g} |")
    return head + "\n".join(lines) + "\n"


def memory_table(memory: dict, budgets: list[str], ks: list[int], adapter_bytes: int) -> str:
    head = ("| budget | K | multi tensor peak MiB | peak(1) + (K-1) x (peak(2) - peak(1)) MiB | peak / bound "
            "| 1-adapter job (single LoRAConfig) MiB | analytic adapter + grad + AdamW MiB per adapter |\n"
            "|---|---:|---:|---:|---:|---:|---:|\n")
    lines = []
    for b in budgets:
        if (b, 1) not in memory:
            continue
        p1, p2 = memory[(b, 1)], memory.get((b, 2))
        for k in sorted({1, 2, *ks}):
            peak = memory.get((b, k))
            if peak is None:
                continue
            bound = None if p2 is None else p1 + (k - 1) * (p2 - p1)
            lines.append(f"| {b} | {k} | {_mib(peak)} | {_mib(bound)} | "
                         f"{'n/a' if bound is None else format(peak / bound, '.3f')} | {_mib(memory.get((b, 'single')))} "
                         f"| {4 * adapter_bytes / 2**20:.2f} |")
    return head + "\n".join(lines) + "\n"


# ------------------------------------------------------------------ main


def main(argv=None) -> int:
    import warnings

    warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.* is deprecated")
    from elastic_kernels.api.finetune.engines import ElasticEngine, FSDP2Engine
    from elastic_kernels.api.finetune.job import prepare
    from elastic_kernels.api.finetune.measure import AllGatherCounter, fix_mmap_threshold
    from elastic_kernels.api.finetune.options import parse_args
    from elastic_kernels.api.nn import adapter_state_dict

    opts, rest = _parse(sys.argv[1:] if argv is None else argv)
    mmap_fixed = fix_mmap_threshold()
    rank, W = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local = int(os.environ.get("LOCAL_RANK", "0"))
    torch.set_num_threads(1)
    tmp = tempfile.mkdtemp(prefix="bench_adapters_")
    if opts.preset is not None:
        model_opts = PRESETS[opts.preset] + ["--micro-batch", "1", "--grad-accum", "1"]  # per adapter, as REAL_OPTIONS
    else:
        from elastic_kernels.api.loading.pretrained import pretrained_dir

        model_dir = opts.model if os.path.isdir(opts.model) else str(pretrained_dir(opts.model))
        model_opts = ["--model", model_dir] + REAL_OPTIONS
    # steps: enough for the longest sequence of step indices (memory runs 3, blocks 1 + rounds + 1)
    args = parse_args(model_opts + rest + ["--steps", str(max(3, opts.rounds + 2)), "--no-progress", "--overwrite",
                                           "--save-dir", os.path.join(tmp, f"rank{rank}")])
    job = prepare(args, rank, W, local)
    device = job.device
    start_group(job, args.timeout_s)
    load = os.getloadavg()
    budgets = _budgets(opts.budgets)
    mem_budgets = _budgets(opts.memory_budgets)
    seeds = [args.seed + i for i in range(max(opts.ks))]
    rows, profiles = [], {}
    with AllGatherCounter() as counter:
        if rank == 0:
            print(f"bench_adapters: K {opts.ks}, budgets {[b for b, _ in budgets]}, FSDP2 at K {opts.fsdp2_ks}; "
                  f"{W} ranks ({dist.get_backend()}), {job.spec.description()}; 1 + {opts.rounds} rounds per block; "
                  f"load average {load[0]:.1f}", flush=True)
        t_start = time.perf_counter()
        # ---- the engines that live across blocks
        singles = {}
        block_budgets = {k: _budgets(opts.block_budgets[k]) if k in opts.block_budgets else budgets for k in opts.ks}
        every_budget = {label: budget for bs in block_budgets.values() for label, budget in bs}
        for label, budget in every_budget.items():
            singles[label] = Runner(job, _config(f"1-adapter, budget {label}",
                                                 lambda budget=budget: ElasticEngine(job, budget)), counter)
        first = next(iter(singles.values()))
        job.initial_adapters = {k: v.clone() for k, v in adapter_state_dict(first.engine.model).items()}  # a0's
        adapter_bytes = sum(p.numel() * p.element_size() for _, p in first.engine.params())
        fsdp = Runner(job, Config("fsdp2", "reshard", lambda: FSDP2Engine(job, counter, True)), counter) \
            if opts.fsdp2_ks else None
        fsdp_first_loss = None
        try:
            for k in opts.ks:
                units, multis, seqs, fsdp_unit = [], {}, {}, None
                try:
                    for label, budget in block_budgets[k]:
                        multis[label] = MultiUnit(job, f"multi b={label}", budget, k, counter)
                        seqs[label] = RepeatUnit(job, f"{k}x 1-adapter b={label}", singles[label], k, seeds[:k])
                        units += [multis[label], seqs[label]]
                    if k in opts.fsdp2_ks:
                        fsdp_unit = RepeatUnit(job, f"{k}x FSDP2", fsdp, k)
                        units.append(fsdp_unit)
                    interleave(units, opts.rounds, rank, f"K={k}")
                    if fsdp_first_loss is None and fsdp_unit is not None:  # the same initial values and batch
                        fsdp_first_loss = (fsdp_unit.steps[0]["losses"][0], seqs[block_budgets[k][0][0]].steps[0]["losses"][0])
                    for label, _ in block_budgets[k]:
                        rows.append(rows_of(job, label, k, multis[label], seqs[label], fsdp_unit))
                        if rank == 0:
                            r = rows[-1]
                            print(f"  K={k} budget {label}: vs sequential {r['vs_sequential_median']:.3f}x "
                                  f"[{r['vs_sequential_min']:.3f}, {r['vs_sequential_max']:.3f}]"
                                  + ("" if r["vs_fsdp2_median"] is None else
                                     f", vs FSDP2 {r['vs_fsdp2_median']:.3f}x [{r['vs_fsdp2_min']:.3f}, {r['vs_fsdp2_max']:.3f}]")
                                  + f", loss diff {r['max_abs_loss_diff_vs_sequential']:.3g}", flush=True)
                    if k in opts.profile_ks and "0" in multis:
                        profiles[k] = profile_step(multis["0"], opts.rounds + 1, rank)
                        if rank == 0:
                            print(f"  profile K={k}: " + ", ".join(f"{key} {v:.2f}" for key, v in profiles[k].items()
                                                                if key != "top"), flush=True)
                finally:
                    for u in multis.values():
                        u.close()
                    multis = units = None
                    gc.collect()
        finally:
            for r in singles.values():
                r.close()
            if fsdp is not None:
                fsdp.close()
            gc.collect()
        # ---- memory, each configuration alone (after the blocks: all else is closed)
        memory: dict = {}
        for label, budget in mem_budgets:
            for k in opts.memory_ks:
                cfg = _config(f"multi K={k}, budget {label}", lambda budget=budget, k=k: MultiEngine(job, budget, k))
                memory[(label, k)], _ = measure_memory(job, cfg, counter)
                if rank == 0:
                    print(f"  memory: {cfg.label:28s} {_mib(memory[(label, k)])} MiB tensor peak", flush=True)
            cfg = _config(f"1-adapter, budget {label}", lambda budget=budget: ElasticEngine(job, budget))
            memory[(label, "single")], _ = measure_memory(job, cfg, counter)
            if rank == 0:
                print(f"  memory: {cfg.label:28s} {_mib(memory[(label, 'single')])} MiB tensor peak", flush=True)
        add_memory(rows, memory)
        elapsed = time.perf_counter() - t_start
    load_end = os.getloadavg()
    failures = loss_failures(rows, fsdp_first_loss)  # the same on every rank: the losses are all-reduced
    if rank == 0:
        ctx = context(device)
        name = opts.preset or os.path.basename(os.path.normpath(opts.model))
        csv_rows = [{**ctx, "preset": name, "model": job.spec.description(), "world_size": W,
                     "backend": dist.get_backend(), "seq_len": args.seq_len, "micro_batch_per_adapter": args.micro_batch,
                     "load_avg_start": round(load[0], 2), "load_avg_end": round(load_end[0], 2),
                     "mmap_threshold_fixed": mmap_fixed,
                     **{k: (round(v, 6) if isinstance(v, float) else v) for k, v in r.items()}} for r in rows]
        path = append_rows("adapters", csv_rows, results_dir(opts.results))
        print()
        rows.sort(key=lambda r: (r["budget"] != "0", r["budget"], r["adapters"]))
        print(table(rows), end="")
        print()
        for r in rows:
            print(f"per-round ratios, budget {r['budget']} K={r['adapters']}: vs sequential {r['vs_sequential_ratios']}"
                  + (f"; vs FSDP2 {r['vs_fsdp2_ratios']}" if r["vs_fsdp2_ratios"] else ""))
        print()
        if memory:
            print("memory (tensor peak, each configuration alone; per-adapter growth MEASURED as peak(2) - peak(1)):")
            print(memory_table(memory, [b for b, _ in mem_budgets], opts.memory_ks, adapter_bytes), end="")
            print()
        for k, split in sorted(profiles.items()):
            print(f"profile, multi K={k}, budget 0, rank 0 (one step, torch.profiler CPU): wall {split['wall_s']:.2f} s; "
                  f"gather wait {split['gather_wait_s']:.2f} s, gather issue {split['gather_issue_s']:.2f} s, "
                  f"gradient all-reduce {split['grad_allreduce_s']:.2f} s, GEMM self {split['gemm_self_s']:.2f} s, "
                  f"attention self {split['attention_self_s']:.2f} s, loss self {split['loss_self_s']:.2f} s, "
                  f"optimizer self {split['optimizer_self_s']:.2f} s; elastic layers (total) forward "
                  f"{split['elastic_layers_fwd_s']:.2f} s, backward {split['elastic_layers_bwd_s']:.2f} s")
            print("  top self CPU: " + "; ".join(f"{key} {s:.2f} s ({n})" for key, s, n in split["top"]))
    if rank == 0:
        worst = max((r["max_abs_loss_diff_vs_sequential"] for r in rows), default=0.0)
        print(f"largest |multi adapter loss - its sequential loss|, any budget, K, adapter and round: {worst:.3g}"
              + ("  <-- more than fp32 rounding" if worst > LOSS_TOL else ""))
        if fsdp_first_loss is not None:
            print(f"FSDP2's first loss {fsdp_first_loss[0]:.7f}, sequential a0's first {fsdp_first_loss[1]:.7f}: "
                  f"|diff| {abs(fsdp_first_loss[0] - fsdp_first_loss[1]):.3g}")
        print(f"load average {load[0]:.1f} at the start, {load_end[0]:.1f} at the end; {elapsed:.0f} s")
        print(f"rows: {path}", flush=True)
        for f in failures:
            print(f"bench_adapters: LOSS MISMATCH: {f}", flush=True)
    dist.barrier()
    dist.destroy_process_group()
    shutil.rmtree(tmp, ignore_errors=True)
    return 1 if failures else 0


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # [Note: exiting without teardown] in python_api/finetune/cli.py
