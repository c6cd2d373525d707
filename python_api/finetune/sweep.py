"""A sweep job (`--sweep`, issue 29): K LoRA adapters, one per combination of the swept values,
trained in one elastic job on one cached base (SweepEngine), and `--compare-sequential`, the
same adapters trained one after another, each alone, interleaved with the sweep's steps
(compare_sequential).

[Note: a sweep job]
Every adapter trains on the batches a solo run of the job would train on: each micro-batch's
rows are repeated once per adapter (row r of adapter i at i x micro-batch + r) and the forward
names each row's adapter (`adapter_names`, [Note: many adapters on one base] in
python_api/nn/lora.py), so the frozen weights are gathered once per use for all K adapters.
The loss of adapter i is its own token mean over its rows, as the model's own loss is over
the micro-batch in a solo run (transformers' ForCausalLMLoss: logits in fp32, labels shifted,
mean over the tokens not -100); the loss backpropagated is the sum of the K means, so adapter
i's gradient is its solo run's (the other terms do not depend on its parameters). Each adapter
has its own AdamW over `adapter_parameters(model, name)`, with its own learning rate and the
job's schedule (--lr-schedule, --warmup-steps, --steps) at that peak. The adapters' initial
values are each LoRAConfig's (its seed: --seed, or the sweep's `seed`), as a solo run's; so
adapter i's losses are its solo run's within fp32 summation order (the base GEMM runs over K
times the rows, the LoRA terms per adapter segment). With --lora-dropout > 0 the sweep draws
other masks than K solo runs would (one draw per layer for all rows), as any two runs do.

What a sweep job does not do, refused as options (option_checks._check_sweep): a pipeline
(--pp, --compare-pp), a planned run (the planner profiles one adapter's model), checkpoints and
--resume (a sweep writes its adapters and report at the end; rerun it), the comparison runs of
one adapter (--compare-budgets, --compare-format, --compare-host), --baseline without
--compare-sequential.

[Note: the sweep's sequential comparison]
`--compare-sequential` builds, after the sweep job, a fresh sweep model, one 1-adapter elastic
model per distinct (r, alpha, dropout) of the adapters at the same pool budget, and each peer
of --baseline per distinct shape (PEFT LoRA with that shape), all alive at once. Round k runs
one unit of each configuration, in the listed order for even k and reversed for odd k: a sweep
step; K steps of the 1-adapter models, adapter i's step with adapter i's values copied in (and
out after) and its own AdamW and learning rate, so it is trained as it would be alone (its
losses are set against the sweep's); K steps of each peer (timing only: a step's time does not
depend on the adapter's values, and a peer's sharded adapters are not swapped). Round 0 warms
up (the first step learns the layer order and gathers everything); a unit's time in a round is
the slowest rank's. The ratio of a round is time(K sequential steps) / time(one sweep step):
the aggregate tokens/s of the sweep over the sequential adapters'; reported as the median of
the rounds' ratios with their minimum, maximum and every round's ratio (bench_adapters.py's
[Note: the adapters bench's rounds], whose units these are).
"""

from __future__ import annotations

import dataclasses
import itertools
import statistics
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ..distributed.agree import exchange
from ..nn import PEFT_PREFIX, LoRAConfig, adapter_parameters, adapter_state_dict
from .engine import model_inputs
from .engines import ElasticEngine
from .files import save_adapter_agreed
from .loop import _seed_rng, adamw
from .models import lora_config
from .option_values import SWEEP_KEYS, sweep_label
from .policy import lr_at

ADAPTERS_DIR = "adapters"  # save_dir/adapters/<name>/: one PEFT adapter each
# The largest |sweep adapter loss - its sequential loss| --compare-sequential calls fp32
# rounding: tests/finetune/test_finetune.py's [Note: the elastic-vs-FSDP2 tolerance] (20 ulps of
# a loss near 5.5, 40x the largest difference measured between two summation orders).
LOSS_TOL = 1e-5


@dataclass(frozen=True)
class SweepAdapter:
    """One adapter of a sweep: its name, its swept values, the job's training options at its
    learning rate, and its LoRAConfig (r, alpha, dropout, the job's targets, its seed)."""
    name: str
    values: tuple  # ((key, value), ...): the swept ones, in --sweep's order
    training: object  # configuration.TrainingConfig
    lora: LoRAConfig

    def settings(self) -> dict:
        """Its full settings, by the solo run's option names."""
        return {"lr": self.training.lr, "lora-r": self.lora.r, "lora-alpha": self.lora.alpha,
                "lora-dropout": self.lora.dropout, "seed": self.lora.seed}


def sweep_adapters(cfg) -> list[SweepAdapter]:
    """The adapters of `cfg`'s sweep (a resolved FinetuneConfig: its learning rate is set), one
    per combination, the last key varying fastest ([Note: the sweep's keys and adapter names]
    in option_values.py)."""
    base = lora_config(cfg.lora, cfg.training.seed)
    keys = [k for k, _ in cfg.training.sweep]
    out = []
    for combo in itertools.product(*(values for _, values in cfg.training.sweep)):
        v = dict(zip(keys, combo))
        lora = dataclasses.replace(base, r=v.get("lora-r", base.r), alpha=v.get("lora-alpha", base.alpha),
                                   dropout=v.get("lora-dropout", base.dropout), seed=v.get("seed", base.seed))
        training = dataclasses.replace(cfg.training, lr=v.get("lr", cfg.training.lr))
        name = "_".join(f"{SWEEP_KEYS[k][1]}{sweep_label(x)}" for k, x in zip(keys, combo))
        out.append(SweepAdapter(name, tuple(zip(keys, combo)), training, lora))
    return out


class PerAdapterAdamW:
    """One AdamW per adapter, stepped together (each with its own state and learning rate)."""

    def __init__(self, opts: list[torch.optim.Optimizer]):
        self.opts = opts

    @property
    def param_groups(self):
        return [g for o in self.opts for g in o.param_groups]

    def step(self):
        for o in self.opts:
            o.step()

    def zero_grad(self, set_to_none: bool = True):
        for o in self.opts:
            o.zero_grad(set_to_none=set_to_none)


def repeat_rows(inputs: dict, k: int) -> dict:
    """Each tensor input's rows repeated k times (row r of copy i at i x rows + r)."""
    return {key: (torch.cat([v] * k) if torch.is_tensor(v) and v.dim() else v) for key, v in inputs.items()}


def adapter_losses(logits: torch.Tensor, labels: torch.Tensor, k: int) -> torch.Tensor:
    """The k adapters' mean losses ([k]) of logits [k x rows, T, V] for labels [rows, T]:
    adapter i's own token mean over its rows, as transformers' ForCausalLMLoss computes a solo
    run's (fp32 logits, labels shifted by one, tokens labelled -100 left out)."""
    shifted = F.pad(labels, (0, 1), value=-100)[..., 1:]
    ce = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), shifted.repeat(k, 1).reshape(-1),
                         ignore_index=-100, reduction="none").view(k, -1)
    return ce.sum(dim=1) / (shifted != -100).sum()


class SweepEngine(ElasticEngine):
    """The K adapters of a sweep on one elastic model ([Note: a sweep job])."""

    kind = "sweep"

    def __init__(self, job, budget):
        self.sweep = sweep_adapters(job.cfg)
        super().__init__(job, budget, lora={a.name: a.lora for a in self.sweep})
        self.names = [a.name for a in self.sweep]
        self.sequence_copies = len(self.names)
        self.name = self.name.replace("elastic", f"elastic sweep of {len(self.names)} adapters", 1)
        self.adapter_params = {n: adapter_parameters(self.model, n) for n in self.names}
        self.optimizer = PerAdapterAdamW([adamw(self.adapter_params[a.name], a.training) for a in self.sweep])
        self.last_losses: list[float] = []
        self.heldout: dict[str, float] = {}

    def params(self):
        return [(f"{n}.{i}", p) for n in self.names for i, p in enumerate(self.adapter_params[n])]

    def set_learning_rate(self, opt, training, step: int) -> None:
        """Each adapter's own learning rate at `step` (its peak, the job's schedule)."""
        for a, o in zip(self.sweep, opt.opts):
            for group in o.param_groups:
                group["lr"] = lr_at(a.training, step)

    def _forward(self, inputs: dict) -> torch.Tensor:
        """The K adapters' mean losses over one micro-batch (its rows once per adapter)."""
        k = len(self.names)
        inputs = dict(inputs)
        labels = inputs.pop("labels")
        out = self.model(**repeat_rows(inputs, k), adapter_names=[n for n in self.names for _ in range(labels.shape[0])])
        return adapter_losses(out.logits, labels, k)

    def run_step(self, job, batch: dict, opt) -> float:
        """Forward and backward of every micro-batch for all adapters (the loss the sum of their
        means over the micro-steps), then every adapter's AdamW step; returns the mean of the
        adapters' losses, each averaged over the micro-batches and ranks (`last_losses`)."""
        accum = self.grad_accum
        totals = torch.zeros(len(self.names), dtype=torch.float64, device=job.device)
        for a in range(accum):
            with self.accumulate(is_last=a == accum - 1):
                per = self._forward(model_inputs(batch, a))
                (per.sum() / accum).backward()
            totals += per.detach().double()
        self.optimizer_step(opt)
        dist.all_reduce(totals)
        self.last_losses = (totals / (accum * job.world_size)).tolist()
        return sum(self.last_losses) / len(self.last_losses)

    def step_figures(self) -> dict:
        return {"adapter_losses": list(self.last_losses)}

    def evaluate(self, job, logits: bool):
        """Every adapter's held-out loss on the probe batch (`heldout`); returns their mean."""
        self.model.eval()
        with torch.no_grad():
            per = self._forward(model_inputs({k: v.to(job.device) for k, v in job.windows.probe_inputs().items()}))
        self.model.train()
        self.heldout = dict(zip(self.names, per.tolist()))
        return sum(self.heldout.values()) / len(self.heldout), None

    def run_figures(self, per_step: dict[str, list], tensor_peak: int | None, memory) -> dict:
        out = super().run_figures(per_step, tensor_peak, memory)
        steps = per_step.get("adapter_losses", [])
        out["adapters"] = [{"name": a.name, "swept": {k: v for k, v in a.values}, "settings": a.settings(),
                            "losses": [s[i] for s in steps], "final_loss": steps[-1][i] if steps else None,
                            "heldout_loss": self.heldout.get(a.name)} for i, a in enumerate(self.sweep)]
        return out

    def adapters(self) -> dict:
        """Every adapter's values under PEFT's names ({name: {key: tensor}}), copies."""
        return {n: {k: v.clone() for k, v in adapter_state_dict(self.model, n).items()} for n in self.names}

    def save_adapter(self, job, folder: str, what: str) -> None:
        """Every adapter in PEFT's format under `folder/<name>/`."""
        save_adapter_agreed(job, self.model, folder, what)


# ------------------------------------------------------------------ --compare-sequential


class _Unit:
    """One configuration of the comparison's rounds: `steps(step)` runs its unit (one sweep
    step, or K 1-adapter steps) and returns its time and the adapters' losses."""

    def __init__(self, label: str):
        self.label, self.times, self.losses, self.gathered = label, [], [], []


def _timed_step(job, engine, opt, training, step: int) -> tuple[float, float, int]:
    """One optimizer step of `engine` at `training`'s learning rate: (its time, its loss, the bytes it gathered)."""
    engine.set_learning_rate(opt, training, step)
    engine.before_step(step)
    batch = engine.batch(job, step)
    g0 = engine.gathered_bytes()
    if job.device.type == "cuda":
        torch.cuda.synchronize(job.device)
    t0 = time.perf_counter()
    loss = engine.run_step(job, batch, opt)
    if job.device.type == "cuda":
        torch.cuda.synchronize(job.device)
    return time.perf_counter() - t0, loss, engine.gathered_bytes() - g0


def _job_for(job, adapter: SweepAdapter, initial: dict):
    """The job as a solo run of `adapter` would have it: its r, alpha, dropout and learning
    rate, the peers' initial adapters its values (the seed of the batches stays the job's)."""
    cfg = job.cfg.replace("lora", lora_r=adapter.lora.r, lora_alpha=adapter.lora.alpha,
                          lora_dropout=adapter.lora.dropout).replace("training", lr=adapter.training.lr)
    return dataclasses.replace(job, cfg=cfg, initial_adapters=dict(initial))


def _ratios(num: list[float], den: list[float]) -> dict:
    """Per timed round (after round 0) num / den: their median, minimum, maximum and each."""
    r = [a / b for a, b in zip(num[1:], den[1:])]
    return {"median": statistics.median(r), "min": min(r), "max": max(r), "rounds": r}


def compare_sequential(job, counter, skipped: dict[str, str], rank_print) -> dict:
    """[Note: the sweep's sequential comparison]: the rounds, and the figures of each configuration."""
    from . import peers

    t = job.cfg.training
    budget = job.cfg.elastic.pool_budget
    _seed_rng(t.seed, job.rank, job.device)
    engines = []
    try:
        sweep = SweepEngine(job, budget)
        engines.append(sweep)
        adapters = sweep.sweep
        k = len(adapters)
        initial = sweep.adapters()
        shape = {a.name: (a.lora.r, a.lora.alpha, a.lora.dropout) for a in adapters}
        first = {}
        for a in adapters:
            first.setdefault(shape[a.name], a)
        singles = {}
        for s, a in first.items():
            singles[s] = ElasticEngine(_job_for(job, a, initial[a.name]), budget)
            engines.append(singles[s])
        values = {a.name: dict(initial[a.name]) for a in adapters}
        opts = {a.name: adamw([p for _, p in singles[shape[a.name]].params()], a.training) for a in adapters}
        peer_engines = {}
        for kind in job.cfg.peers.baselines:
            if kind in skipped:
                continue
            for s, a in first.items():
                e = peers.build(_job_for(job, a, initial[a.name]), kind, counter)
                engines.append(e)
                opt = e.optimizer or adamw([p for _, p in e.params()], a.training)
                peer_engines[(kind, s)] = (e, opt)
        for e in engines:
            e.train_mode()

        def sweep_unit(step):
            dt, _, g = _timed_step(job, sweep, sweep.optimizer, t, step)
            return dt, list(sweep.last_losses), g

        def sequential_unit(step):
            total, losses, gathered = 0.0, [], 0
            for a in adapters:
                e = singles[shape[a.name]]
                params = {PEFT_PREFIX + n: p for n, p in e.params()}
                with torch.no_grad():
                    for key, v in values[a.name].items():
                        params[key].copy_(v)
                dt, loss, g = _timed_step(job, e, opts[a.name], a.training, step)
                with torch.no_grad():
                    for key, v in values[a.name].items():
                        v.copy_(params[key])
                total, gathered = total + dt, gathered + g
                losses.append(loss)
            return total, losses, gathered

        def peer_unit(kind):
            def unit(step):
                total = 0.0
                for a in adapters:
                    e, opt = peer_engines[(kind, shape[a.name])]
                    total += _timed_step(job, e, opt, a.training, step)[0]
                return total, None, 0
            return unit

        units = [(_Unit("sweep"), sweep_unit), (_Unit("sequential elastic"), sequential_unit)]
        units += [(_Unit(f"sequential {kind}"), peer_unit(kind)) for kind in dict.fromkeys(k for k, _ in peer_engines)]
        for step in range(t.steps):
            order = units if step % 2 == 0 else list(reversed(units))
            for u, run in order:
                dt, losses, g = run(step)
                u.times.append(dt)
                u.losses.append(losses)
                u.gathered.append(g)
            rank_print(f"compare-sequential round {step}{' (warm-up)' if step == 0 else ''}: "
                       + ", ".join(f"{u.label} {u.times[-1]:.3f} s" for u, _ in order))
    finally:
        for e in engines:
            e.close()
    every = exchange([u.times for u, _ in units], what="the sweep comparison's times")
    for i, (u, _) in enumerate(units):
        u.times = [max(e[i][r] for e in every) for r in range(len(u.times))]  # the slowest rank's
    tokens = k * job.world_size * t.micro_batch * t.grad_accum * t.seq_len  # one unit: K adapters' step
    sw, seq = units[0][0], units[1][0]
    diffs = [abs(a - b) for ls, lq in zip(sw.losses, seq.losses) for a, b in zip(ls, lq)]
    out = {
        "adapters": k, "rounds_timed": t.steps - 1, "tokens_per_unit": tokens,
        "sweep_tokens_per_s": tokens / statistics.median(sw.times[1:]),
        "sequential_tokens_per_s": tokens / statistics.median(seq.times[1:]),
        "ratio_vs_sequential": _ratios(seq.times, sw.times),
        "sweep_step_times_s": sw.times, "sequential_unit_times_s": seq.times,
        "sweep_allgather_bytes_per_step": sw.gathered,
        "sequential_allgather_bytes_per_adapter_step": [g // k for g in seq.gathered],
        "max_abs_loss_diff_vs_sequential": max(diffs) if diffs else None,
        "peers": {},
    }
    for u, _ in units[2:]:
        kind = u.label.split(" ", 1)[1]
        out["peers"][kind] = {"tokens_per_s": tokens / statistics.median(u.times[1:]),
                              "ratio": _ratios(u.times, sw.times), "unit_times_s": u.times}
    return out
