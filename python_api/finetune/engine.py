"""The engine interface: what the training loop (loop.py) asks of an engine. `Engine` holds
the defaults, those of the engines that hold the whole model on every rank and run a step as
micro-batches: elastic and planned (engines.py) and the peers (peers/). The pipelined engine
(pipelined.py) overrides the step, the checkpoint's parameters and the evaluation.

[Note: the engine interface]
train() in loop.py runs every engine the same way: it seeds the RNG or resumes a checkpoint,
then per step sets the step's learning rate, calls `before_step(step)` and `batch(job, step)`
(untimed) and times `run_step(job, batch, opt)`; it writes checkpoints at the cadence, and at
the end evaluates the held-out probe and returns one result. What an engine provides:
  built      its constructor sets `model`, `name`, `kind`, `micro_batch` and `grad_accum`;
             `optimizer` is the AdamW its framework owns (DeepSpeed) or its own (the
             elastic engine's ShardedOptimizer below a full cache), else None and the loop
             builds one (`adamw` in loop.py)
  a step     `set_learning_rate(opt, training, step)`: the step's learning rate on `opt`;
             `batch`: the step's input on the device; `run_step`: forward and backward over
             the step's micro-batches and the optimizer step, returning the loss averaged
             over the world. Here: `accumulate(is_last)` around each micro-step's forward and
             `(loss / accum).backward()`, then `optimizer_step(opt)`; a pipeline runs
             PipelinedModel.train_step
  figures    `gathered_bytes()` and `h2d_bytes()`: running totals, the loop takes their
             difference over each step; `step_figures()`: the engine's own figures of the
             step just run; `run_figures(...)`: the engine's own entries of the run's result
  checkpoint `param_order()`: the parameter names optimizer.pt lists, in order;
             `gather_states(mine)`: every rank's part of the optimizer state (a collective
             for a pipeline, whose stages each hold some); `load_adapter`, `save_adapter`
  evaluation `evaluate(job, logits)`: the held-out loss of the probe batch, and its logits
"""

from __future__ import annotations

import statistics

import torch
import torch.distributed as dist
import torch.nn as nn

from ..nn import load_adapter
from .files import save_adapter_agreed
from .option_values import budget_label
from .policy import lr_at


class Engine:
    """The defaults of [Note: the engine interface]: one whole model per rank, its step as
    --grad-accum micro-batches of --micro-batch sequences (or a planned split)."""

    kind = "engine"
    name = "engine"
    weight_format = "none"  # the numerics its losses are compared within
    optimizer = None  # the engine's own optimizer, else the loop's AdamW ([Note: engines that own their optimizer step])
    measures_tensor_peak = True  # the tensor peak of [Note: what "peak memory" means here] in measure.py
    sequence_copies = 1  # adapters trained on each sequence (a sweep's K): the tokens a step trains, per sequence

    # ------------------------------------------------------------ a step

    def params(self) -> list[tuple[str, nn.Parameter]]:
        """The trained parameters (the adapters), named."""
        return [(n, p) for n, p in self.model.named_parameters() if p.requires_grad]

    def train_mode(self) -> None:
        """Before the first step."""
        self.model.train()

    def set_learning_rate(self, opt, training, step: int) -> None:
        """Optimizer step `step`'s learning rate (`training`: the job's TrainingConfig) on every
        parameter group of `opt`; a sweep sets each adapter's own (sweep.py)."""
        for group in opt.param_groups:
            group["lr"] = lr_at(training, step)  # [Note: learning-rate defaults] in policy.py

    def before_step(self, step: int) -> None:
        """At the start of optimizer step `step` (0-based), before its batch is built."""

    def batch(self, job, step: int) -> dict:
        """This rank's share of step `step`, on the device: `micro_batch` x `grad_accum` sequences."""
        inputs = job.windows.inputs(job.cfg.training.seed, step, job.world_size, job.rank, self.micro_batch, self.grad_accum)
        return {k: v.to(job.device) for k, v in inputs.items()}

    def accumulate(self, is_last: bool):
        """The context of one micro-step's forward and backward: gradients are reduced across
        the ranks on the last micro-step of a step only."""
        raise NotImplementedError(f"{type(self).__name__} must say how it accumulates gradients")

    def run_step(self, job, batch: dict, opt) -> float:
        """Forward and backward over the step's micro-batches, then the optimizer step; the
        loss averaged over the micro-batches and the ranks."""
        accum = self.grad_accum
        total = torch.zeros((), dtype=torch.float64, device=job.device)
        for a in range(accum):
            with self.accumulate(is_last=a == accum - 1):
                out = self.model(**model_inputs(batch, a))
                (out.loss / accum).backward()
            total += out.loss.detach().double()
        self.optimizer_step(opt)
        dist.all_reduce(total)
        return total.item() / (accum * job.world_size)

    def optimizer_step(self, opt) -> None:
        opt.step()
        opt.zero_grad(set_to_none=True)

    def split(self) -> tuple[int, int]:
        """The step's split: (sequences per micro-batch, micro-batches)."""
        return self.micro_batch, self.grad_accum

    # ------------------------------------------------------------ figures

    def gathered_bytes(self) -> int:
        """All-gathered bytes so far (a running total)."""
        return 0

    def h2d_bytes(self) -> int:
        """Host-to-device bytes so far (a running total)."""
        return 0

    def step_figures(self) -> dict:
        """The engine's own figures of the step just run: none here."""
        return {}

    def run_figures(self, per_step: dict[str, list], tensor_peak: int | None, memory) -> dict:
        """The engine's own entries of the run's result. `per_step`: the loop's per-step lists
        ("calls": all-gather calls) and those of `step_figures`."""
        calls = per_step["calls"]
        return {
            "tensor_peak_bytes": tensor_peak,
            "memory_measure": memory.describe() if hasattr(memory, "describe") else None,
            "allgather_calls_per_step": calls,
            "allgather_calls_steady": statistics.median(calls[1:]) if len(calls) > 1 else (calls[0] if calls else 0),
        }

    # ------------------------------------------------------------ checkpoints

    def param_order(self) -> list[str]:
        """The names of the optimizer state a checkpoint lists, in its order."""
        return [n for n, _ in self.params()]

    def budget_label(self, elastic) -> str:
        """The pool budget a checkpoint's segment of this run names ([Note: segments of a run] in
        loop.py); `elastic`: the elastic policy's options (ElasticConfig)."""
        return budget_label(elastic.pool_budget)

    def gather_states(self, mine: dict) -> list[dict]:
        """Every rank's part of the optimizer state ({name: state}, on the host): this rank holds all."""
        return [mine]

    def load_adapter(self, path: str) -> None:
        load_adapter(self.model, path)

    def save_adapter(self, job, folder: str, what: str) -> None:
        """The adapter in PEFT's format into `folder`; a failure on any rank is `what` on every rank."""
        save_adapter_agreed(job, self.model, folder, what)

    # ------------------------------------------------------------ the end

    def evaluate(self, job, logits: bool) -> tuple[float, torch.Tensor | None]:
        """The held-out loss of the probe batch and, if `logits`, its logits (float, on the host)."""
        self.model.eval()
        with torch.no_grad():
            out = self.model(**model_inputs({k: v.to(job.device) for k, v in job.windows.probe_inputs().items()}))
        self.model.train()
        return float(out.loss), out.logits.detach().float().cpu() if logits else None

    def close(self) -> None:
        """Release what the engine holds beyond its model (nothing here)."""


def steady(per_step: list) -> float:
    """The mean of a per-step figure over the steps after the first (the first alone if only it ran)."""
    if len(per_step) > 1:
        return sum(per_step[1:]) / (len(per_step) - 1)
    return float(per_step[0] if per_step else 0)


def model_inputs(batch: dict, a: int | None = None) -> dict:
    """The forward's keyword arguments: micro-step `a` of a batch (or the whole batch). Packed
    records carry position ids, which confine attention to each record only without a KV cache
    (transformers' masking_utils detects packed sequences when no cache is passed), hence
    use_cache=False ([Note: records are packed, attention stays in each record] in sft.py)."""
    out = {k: (v if a is None else v[a]) for k, v in batch.items()}
    if "position_ids" in out:
        out["use_cache"] = False
    return out

