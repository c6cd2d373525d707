"""`PipelinedModel`: a Hugging Face causal LM with LoRA adapters on elastic frozen weights,
run as a pipeline of packs on torch.distributed.pipelining.

    groups = pipeline_groups(pp=2, device="cpu", timeout_s=300)              # the (pp, dp) mesh
    layout = PipelineLayout.build(world_size, 2, n_layers, "looped-bfs", micro_batches=8, pack_size=2)
    model = PipelinedModel(lm, LoRAConfig(r=8, alpha=16), ElasticPolicy(), layout, groups,
                           micro_batch_size=2, seq_len=128)
    loss = model.train_step(input_ids)          # every rank: this dp group's m x 2 sequences
    opt.step()                                  # opt over model.parameters(): this rank's adapters
    model.save_adapter("out/adapter")           # one PEFT adapter from every stage

[Note: one step of a pipelined model]
Every rank of a dp group passes the same batch of m x micro_batch_size sequences (the dp
group's share of the global batch); the schedule cuts it into m micro-batches, the first
pack embeds them, the last computes the model's own loss (`loss_function`, the per-micro-batch
token mean HF computes) and the schedule keeps the m losses. position_ids go to every rank's
`step()` as a keyword, so every pack recomputes its rotary embeddings and mask from them.
`scale_grads` (the schedule's default) divides the adapters' gradients by m at the end of the
step; the pipeline then averages them over the dp group, once: the gradient of the mean of
the dp x m micro-batch losses, which is the pp = 1 run's (mean over W x accumulation
micro-batches of equal size) when the global batch is the same. The reported loss is that
mean, agreed over the world (one all-gather that also carries each rank's step and compute
times: the bubble is measured as idle time per rank, the slowest rank's time in the
schedule's step minus this rank's time inside its stages' forwards and backwards).
Gradients are set to None at the start of each step (the schedule's division would hit
gradients left from before); accumulation across steps is not supported, by design.

[Note: what a rank holds]
Pack k lives on pp rank k mod pp (round-robin) and its frozen weights are sharded over that
rank's dp group only: a rank holds 1/dp of its packs' frozen weights (in the host store with
weights_on="host": the node's store holds each pack once for its dp group) plus what its packs
keep replicated (the embeddings on the first pack, the final norm and head on the last). The
HF model passed in is consumed: the parameters of the layers of other ranks are moved to the
meta device (freed) once the packs are built, so nothing else of the model stays on the rank.
"""

from __future__ import annotations

import bisect
import dataclasses
import inspect
import json
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.profiler import record_function

from ..config import ElasticPolicy
from ..distributed.agree import agree, exchange, rank0_then_agree
from ..nn import LoRAConfig, adapter_state_dict, convert_to_elastic, runtime_of, target_names
from ..nn.adapters import ADAPTER_CONFIG, ADAPTER_WEIGHTS, PEFT_PREFIX, adapter_metadata, atomic_write, peft_config
from ..nn.lora import is_conv1d
from ..planner.pipeline import PipelineError, PipelineLayout
from .failure import FailureWatch
from .hf_packs import architecture_of, check_checkpointing
from .mesh import PipelineGroups
from .residency import PackResidency
from .stage import PackStage, StepCounters

_SCHEDULE_CLASSES = {
    "gpipe": "ScheduleGPipe",
    "1f1b": "Schedule1F1B",
    "looped-bfs": "ScheduleLoopedBFS",
    "interleaved-1f1b": "ScheduleInterleaved1F1B",
}


def _schedule_class(name: str):
    import torch.distributed.pipelining as pipelining

    cls = getattr(pipelining, _SCHEDULE_CLASSES[name], None)
    if cls is None:
        raise PipelineError(f"schedule {name}: torch {torch.__version__} has no "
                            f"torch.distributed.pipelining.{_SCHEDULE_CLASSES[name]}")
    return cls


class PipelinedModel:
    """See the module docstring. Build it on every rank of the world, with the same arguments
    (checked: the ranks agree before anything is built)."""

    def __init__(self, lm: nn.Module, lora: LoRAConfig, policy: ElasticPolicy, layout: PipelineLayout,
                 groups: PipelineGroups, *, micro_batch_size: int, seq_len: int, source=None,
                 device: torch.device | str | None = None, trace: bool = False, fail_fast: bool = True):
        if not isinstance(lora, LoRAConfig):
            raise TypeError(f"lora must be a LoRAConfig, got {type(lora).__name__}")
        if not isinstance(policy, ElasticPolicy):
            raise TypeError(f"policy must be an ElasticPolicy, got {type(policy).__name__}")
        if not isinstance(layout, PipelineLayout):
            raise TypeError(f"layout must be a PipelineLayout, got {type(layout).__name__}")
        self.layout, self.groups, self.lora, self.policy = layout, groups, lora, policy
        self.micro_batch_size, self.seq_len = micro_batch_size, seq_len
        self.device = torch.device(device) if device is not None else (
            source.device if source is not None else torch.device("cpu"))
        error = None
        try:
            self._check(lm)
        except PipelineError as exc:
            error = str(exc)
        agree(error, None, what="pipeline", error_type=PipelineError)
        self._agree_configuration(lm)
        error = None
        try:
            self._build(lm, source, trace)
        except Exception as exc:  # noqa: BLE001 - agreed below: every rank raises, none waits
            error = f"{type(exc).__name__}: {exc}" if not isinstance(exc, PipelineError) else str(exc)
            failure = exc
        else:
            failure = None
        try:
            agree(error, None, what="building the pipeline", error_type=PipelineError)
        except PipelineError as exc:
            raise exc from failure
        self.watch = FailureWatch(groups.rank, fail_fast=fail_fast)
        self.last_step: dict = {}
        self._totals = {"p2p_send_bytes": 0, "p2p_recv_bytes": 0, "steps": 0}

    # ------------------------------------------------------------ checks

    def _check(self, lm: nn.Module) -> None:
        layout, groups = self.layout, self.groups
        for name, v in (("micro_batch_size", self.micro_batch_size), ("seq_len", self.seq_len)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise PipelineError(f"{name} must be a positive int, got {v!r}")
        if layout.world_size != groups.world_size or layout.pp != groups.pp:
            raise PipelineError(f"the layout is for world {layout.world_size} = pp {layout.pp} x dp {layout.dp}; "
                                f"the mesh is pp {groups.pp} x dp {groups.dp}")
        self.arch = architecture_of(lm)
        n_layers = len(self.arch.layers(lm))
        if layout.n_layers != n_layers:
            raise PipelineError(f"the layout cuts {layout.n_layers} decoder layers, the model has {n_layers}")
        for i, layer in enumerate(self.arch.layers(lm)):
            check_checkpointing(layer, f"decoder layer {i} ({type(layer).__name__})")

    def _agree_configuration(self, lm: nn.Module) -> None:
        """Every rank builds the same pipeline: layout, LoRA, policy (the timeout aside), batch
        shape and model configuration; otherwise every rank fails naming the fields."""
        config = {k: v for k, v in lm.config.to_dict().items() if k not in ("transformers_version", "_name_or_path")}
        mine = {
            "layout": self.layout.to_dict(),
            "lora": repr(self.lora),
            "policy": {k: v for k, v in vars(self.policy).items() if k != "collective_timeout_s"},
            "micro_batch_size": self.micro_batch_size,
            "seq_len": self.seq_len,
            "model": json.dumps(config, sort_keys=True, default=str),
        }
        every = exchange(mine, None, timeout_s=self.policy.collective_timeout_s, what="pipeline configuration",
                         error_type=PipelineError)
        differ = [k for k in mine if any(e[k] != every[0][k] for e in every)]
        if differ:
            raise PipelineError(f"the ranks build different pipelines: {', '.join(differ)} differ between ranks "
                                "(every rank needs the same model, layout, LoRA, policy and batch shape)")

    # ------------------------------------------------------------ building

    def _layer_of(self, name: str) -> int | None:
        prefix = self.arch.layer_prefix
        if name.startswith(prefix):
            return int(name[len(prefix):].split(".", 1)[0])
        return None

    def _pack_of(self, name: str) -> int:
        """The pack holding module `name`: its layer's, else the first (embeddings) or last
        (norm, head)."""
        i = self._layer_of(name)
        layout = self.layout
        if i is not None:
            return bisect.bisect_right(layout.boundaries, i) - 1
        return layout.n_packs - 1 if self.arch.is_head(name) else 0

    def _build(self, lm: nn.Module, source, trace: bool) -> None:
        layout, groups, arch = self.layout, self.groups, self.arch
        n = layout.n_packs
        self.lm = lm
        self.targets = target_names(lm, self.lora)
        self.fan_in_fan_out = any(is_conv1d(lm.get_submodule(t)) for t in self.targets)
        self.adapter_metadata = adapter_metadata(lm)  # [Note: adapters that load everywhere]
        trainable = [False] * n
        for t in self.targets:
            trainable[self._pack_of(t)] = True
        needs_grad_in = [any(trainable[:k]) for k in range(n + 1)]
        embed = arch.embedding(lm)
        act_dtype = embed.weight.dtype
        logit_dtype = lm.lm_head.weight.dtype
        H, V = arch.hidden_size(lm), int(lm.config.vocab_size)
        self.hidden_size, self.vocab_size, self.act_dtype = H, V, act_dtype
        units = arch.layer_class_names(lm)
        self.local = layout.packs_of_rank(groups.pp_rank)
        self.packs: dict[int, nn.Module] = {}
        self.runtimes = {}
        for k in self.local:
            pack = arch.pack(lm, layout.layers_of_pack(k), first=k == 0, last=k == n - 1)
            if source is None and self.device.type != "cpu":
                pack.to(self.device)
            # [Note: one runtime per pack]: resident packs hold every chunk PERSISTENT in a pool
            # sized for the pack (released by the residency); a transient pack's pool holds only
            # the runtime's working set (cache budget 0), its chunks gathered for each use. No
            # runs ([Note: resident runs]): the residency releases and prefetches a pack's
            # chunks itself, into pages, every step.
            full = layout.residency[k] != "transient"
            pol = dataclasses.replace(self.policy, keep_ratio=1.0 if full else 0.0,
                                      persist_ratio=1.0 if full else 0.0, pool_budget_bytes=None if full else 0,
                                      all_reduce_grads=False, resident_runs=False)
            convert_to_elastic(pack, self.lora, pol, group=groups.dp_group, unit_modules=units, source=source)
            self.packs[k] = pack
            self.runtimes[k] = runtime_of(pack)
        self._free_other_layers(lm)
        self.holds_first, self.holds_last = 0 in self.packs, (n - 1) in self.packs
        self.counters = StepCounters()
        self.residency = PackResidency(layout, self.runtimes, trace=trace)
        mbs, S, dev = self.micro_batch_size, self.seq_len, self.device
        self.stages = []
        for k in self.local:
            x = (torch.zeros(mbs, S, dtype=torch.long, device=dev) if k == 0 else
                 torch.zeros(mbs, S, H, dtype=act_dtype, device=dev, requires_grad=needs_grad_in[k]))
            y = (torch.zeros(mbs, S, V, dtype=logit_dtype, device=dev, requires_grad=needs_grad_in[n]) if k == n - 1
                 else torch.zeros(mbs, S, H, dtype=act_dtype, device=dev, requires_grad=needs_grad_in[k + 1]))
            self.stages.append(PackStage(self.packs[k], k, n, dev, input_args=(x,), output_args=(y,),
                                         group=groups.pp_group, residency=self.residency, counters=self.counters))
        loss_function, vocab = lm.loss_function, V

        def loss_fn(logits, labels):
            return loss_function(logits=logits, labels=labels, vocab_size=vocab)

        self.loss_fn = loss_fn
        cls = _schedule_class(layout.schedule)
        try:
            if layout.schedule in ("gpipe", "1f1b"):
                self.schedule = cls(self.stages[0], n_microbatches=layout.micro_batches, loss_fn=loss_fn)
            else:
                self.schedule = cls(self.stages, n_microbatches=layout.micro_batches, loss_fn=loss_fn)
        except ValueError as exc:  # torch's own rules, should ours (planner/pipeline.py) miss one
            raise PipelineError(f"schedule {layout.schedule} refuses this layout: {exc}") from exc
        params = inspect.signature(self.schedule.step).parameters
        self._step_kwargs = {"return_outputs": False} if "return_outputs" in params else {}
        self.trainable = [p for k in self.local for p in self.packs[k].parameters() if p.requires_grad]

    def _free_other_layers(self, lm: nn.Module) -> None:
        """[Note: what a rank holds]: parameters no local pack uses go to the meta device."""
        keep = {id(t) for pack in self.packs.values() for t in list(pack.parameters()) + list(pack.buffers())}
        with torch.no_grad():
            for module in lm.modules():
                for name, p in list(module._parameters.items()):
                    if p is not None and id(p) not in keep and not p.is_meta:
                        module._parameters[name] = nn.Parameter(p.to("meta"), requires_grad=False)

    # ------------------------------------------------------------ parameters

    def named_parameters(self):
        """This rank's trainable parameters (its packs' adapters) under the HF model's names."""
        for k in self.local:
            for name, p in self.packs[k].named_parameters():
                if p.requires_grad:
                    yield name, p

    def parameters(self):
        return [p for _, p in self.named_parameters()]

    def param_order(self) -> list[str]:
        """Every adapter parameter of the whole model, in the order the pp = 1 model lists them
        (module order, lora_A then lora_B): the order of a checkpoint's optimizer state."""
        return [f"{t}.lora_{w}.weight" for t in self.targets for w in ("A", "B")]

    # ------------------------------------------------------------ one step

    def _positions(self, batch: int) -> torch.Tensor:
        return torch.arange(self.seq_len, device=self.device).unsqueeze(0).expand(batch, -1).contiguous()

    def _check_batch(self, input_ids: torch.Tensor, what: str) -> None:
        want = (self.layout.micro_batches * self.micro_batch_size, self.seq_len)
        if not isinstance(input_ids, torch.Tensor) or tuple(input_ids.shape) != want:
            got = tuple(input_ids.shape) if isinstance(input_ids, torch.Tensor) else type(input_ids).__name__
            raise PipelineError(f"{what}: expected input_ids of shape {want} (micro-batches x micro-batch size, "
                                f"sequence length), got {got}")

    def train_step(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None) -> float:
        """One training step of this dp group's batch ([Note: one step of a pipelined model]);
        every rank of the world calls it. Leaves the dp-averaged gradients in the adapters'
        .grad and returns the mean loss over the whole world's batch."""
        labels = input_ids if labels is None else labels
        for p in self.trainable:
            p.grad = None
        for pack in self.packs.values():
            pack.train()
        gathered0, h2d0 = self._runtime_totals()
        self.counters.reset()
        self.residency.begin_step()
        losses = [] if self.holds_last else None
        with self.watch.step():  # a bad batch on one rank fails every rank ([Note: a stage that fails mid-step])
            self._check_batch(input_ids, "train_step")
            self._check_batch(labels, "train_step (labels)")
            B = input_ids.shape[0]
            args = (input_ids.to(self.device),) if self.holds_first else ()
            target = labels.to(self.device) if self.holds_last else None
            dist.barrier(group=self.groups.pp_group)
            t0 = time.perf_counter()
            self.schedule.step(*args, target=target, losses=losses, position_ids=self._positions(B),
                               **self._step_kwargs)
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            pipe_s = time.perf_counter() - t0
            self.residency.end_step()
            self._reduce_grads()
            loss_sum = float(sum(float(v.detach()) for v in losses)) if losses else 0.0
            mine = torch.tensor([loss_sum, pipe_s, self.counters.compute_s], dtype=torch.float64,
                                device=self._collective_device())
            every = [torch.zeros_like(mine) for _ in range(self.groups.world_size)]
            dist.all_gather(every, mine)
            every = [e.cpu() for e in every]
        loss = sum(float(e[0]) for e in every) / (self.layout.dp * self.layout.micro_batches)
        step_s = max(float(e[1]) for e in every)
        gathered1, h2d1 = self._runtime_totals()
        self.last_step = {
            "loss": loss,
            "step_s": step_s,
            "pipe_s": pipe_s,
            "compute_s": self.counters.compute_s,
            "idle_s": step_s - self.counters.compute_s,
            "idle_fraction": (step_s - self.counters.compute_s) / step_s if step_s > 0 else 0.0,
            "idle_s_per_rank": [step_s - float(e[2]) for e in every],
            "allgather_bytes": gathered1 - gathered0,
            "h2d_bytes": h2d1 - h2d0,
            "p2p_send_bytes": self.counters.p2p_send_bytes,
            "p2p_recv_bytes": self.counters.p2p_recv_bytes,
            "forwards": self.counters.forwards,
            "backwards": self.counters.backwards,
        }
        self._totals["p2p_send_bytes"] += self.counters.p2p_send_bytes
        self._totals["p2p_recv_bytes"] += self.counters.p2p_recv_bytes
        self._totals["steps"] += 1
        return loss

    def _collective_device(self) -> torch.device:
        """Where the world group's small collectives live: the device on NCCL, else the CPU."""
        return self.device if dist.get_backend() == "nccl" else torch.device("cpu")

    def _reduce_grads(self) -> None:
        """The adapters' gradients averaged over the dp group, once per step."""
        dp = self.groups.dp
        if dp == 1:
            return
        grads = [p.grad for p in self.trainable if p.grad is not None]
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for g in grads:
            by_dtype.setdefault(g.dtype, []).append(g)
        with record_function("elastic::pipeline_all_reduce_grads"):
            for gs in by_dtype.values():
                flat = torch.cat([g.reshape(-1) for g in gs])
                dist.all_reduce(flat, group=self.groups.dp_group)
                flat.div_(dp)
                offset = 0
                for g in gs:
                    g.copy_(flat[offset: offset + g.numel()].view_as(g))
                    offset += g.numel()

    def _runtime_totals(self) -> tuple[int, int]:
        s = [rt.stats() for rt in self.runtimes.values()]
        return sum(x["allgather_bytes"] for x in s), sum(x["h2d_bytes"] for x in s)

    # ------------------------------------------------------------ forward only

    def evaluate(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None):
        """Forward only (no gradient, nothing learned): (mean loss of these sequences, their
        logits on the ranks holding the last pack, else None). Any number of sequences: they
        are padded to whole micro-batches by repeating them (the repeats are left out of the
        loss and logits). Every rank of the world calls it with the same sequences."""
        if not hasattr(self.schedule, "eval"):
            raise PipelineError(f"torch {torch.__version__}'s pipeline schedules have no eval(): no forward-only pass")
        labels = input_ids if labels is None else labels
        n, S = input_ids.shape
        if S != self.seq_len:
            raise PipelineError(f"evaluate: sequences of {S} tokens, the pipeline runs {self.seq_len}")
        per_pass = self.layout.micro_batches * self.micro_batch_size
        passes = max(1, -(-n // per_pass))
        idx = torch.arange(passes * per_pass) % n
        ids, lab = input_ids[idx], labels[idx]
        for pack in self.packs.values():
            pack.eval()
        for st in self.stages:
            st.track = False
        chunks = []
        try:
            with torch.no_grad(), self.watch.step():
                for p in range(passes):
                    sl = slice(p * per_pass, (p + 1) * per_pass)
                    args = (ids[sl].to(self.device),) if self.holds_first else ()
                    target = lab[sl].to(self.device) if self.holds_last else None
                    out = self.schedule.eval(*args, target=target, position_ids=self._positions(per_pass))
                    if self.holds_last:
                        chunks.append(out.detach())
        finally:
            for st in self.stages:
                st.track = True
            for k, pack in self.packs.items():
                pack.train()
                if self.layout.residency[k] in ("step", "phase"):
                    self.residency.release(k)
        if not self.holds_last:
            logits, local_loss = None, 0.0
        else:
            logits = torch.cat(chunks)[:n]
            local_loss = float(self.loss_fn(logits.float(), lab[:n].to(logits.device)))
        mine = torch.tensor([local_loss], dtype=torch.float64, device=self._collective_device())
        dist.all_reduce(mine)
        loss = float(mine.cpu()) / self.layout.dp  # every dp replica of the last pack computed it
        return loss, logits

    # ------------------------------------------------------------ adapters

    def adapter_state_dict(self) -> dict[str, torch.Tensor]:
        """Every adapter of the model under PEFT's names, on every rank (a collective over the
        pp group: each stage contributes its own; dp replicas hold the same)."""
        mine = {}
        for k in self.local:
            mine.update(adapter_state_dict(self.packs[k]))
        every = exchange(mine, self.groups.pp_group, timeout_s=self.policy.collective_timeout_s,
                         what="gathering the adapters of every stage", error_type=PipelineError)
        full = {}
        for part in every:
            full.update(part)
        order = [f"{PEFT_PREFIX}{name}" for name in self.param_order()]
        missing = [k for k in order if k not in full]
        if missing:
            raise PipelineError(f"adapters of no stage: {missing[:3]}")
        return {k: full[k] for k in order}

    def save_adapter(self, path: str) -> None:
        """One PEFT adapter (adapter_model.safetensors + adapter_config.json) from every stage,
        the same files the pp = 1 model's save_adapter writes; rank 0 writes, every rank
        returns once they exist (or raises rank 0's error). A collective over the world."""
        from safetensors.torch import save_file

        state = self.adapter_state_dict()

        def write():
            os.makedirs(path, exist_ok=True)
            atomic_write(os.path.join(path, ADAPTER_WEIGHTS),
                         lambda p: save_file({k: v.contiguous() for k, v in state.items()}, p,
                                             metadata={"format": "pt"}))
            config = peft_config(self.lora, self.targets, self.fan_in_fan_out, **self.adapter_metadata)
            atomic_write(os.path.join(path, ADAPTER_CONFIG),
                         lambda p: open(p, "w").write(json.dumps(config, indent=2, sort_keys=True) + "\n"))

        rank0_then_agree(write, None, what=f"save_adapter({path!r})", error_type=PipelineError)

    def load_adapter(self, path: str) -> None:
        """Load a PEFT adapter of the whole model (from save_adapter, of this run or of a pp = 1
        run): every rank loads its packs' adapters. The file must hold exactly the model's
        adapters with their shapes, and the LoRA rank and alpha of this model; checked on every
        rank before anything changes, agreed over the world."""
        from safetensors.torch import load_file

        error, state = None, None
        try:
            wfile, cfile = os.path.join(path, ADAPTER_WEIGHTS), os.path.join(path, ADAPTER_CONFIG)
            for f in (wfile, cfile):
                if not os.path.isfile(f):
                    raise PipelineError(f"load_adapter: {f} does not exist")
            with open(cfile) as f:
                config = json.load(f)
            want = peft_config(self.lora, self.targets, self.fan_in_fan_out)
            for key in ("peft_type", "r", "lora_alpha", "use_rslora", "rank_pattern", "alpha_pattern"):
                if config.get(key) != want[key]:
                    raise PipelineError(f"load_adapter: {cfile} has {key}={config.get(key)!r}, this model "
                                        f"{want[key]!r}")
            state = load_file(wfile)
            expected = {f"{PEFT_PREFIX}{n}" for n in self.param_order()}
            extra, lack = sorted(set(state) - expected), sorted(expected - set(state))
            if extra or lack:
                raise PipelineError(f"load_adapter: {wfile} does not fit this model's adapters"
                                    + (f"; unknown: {extra[:3]}" if extra else "")
                                    + (f"; missing: {lack[:3]}" if lack else ""))
            for name, p in self.named_parameters():
                t = state[f"{PEFT_PREFIX}{name}"]
                if tuple(t.shape) != tuple(p.shape):
                    raise PipelineError(f"load_adapter: {name} has shape {tuple(t.shape)} in {wfile}, the model "
                                        f"{tuple(p.shape)}")
                if not t.is_floating_point() or not bool(torch.isfinite(t).all()):
                    raise PipelineError(f"load_adapter: {name} in {wfile} is not finite floating point")
        except (OSError, ValueError) as exc:
            error = str(exc)
        agree(error, None, what="load_adapter", error_type=PipelineError)
        with torch.no_grad():
            for name, p in self.named_parameters():
                p.copy_(state[f"{PEFT_PREFIX}{name}"].to(device=p.device, dtype=p.dtype))

    # ------------------------------------------------------------ figures

    def frozen_bytes_held(self) -> int:
        """Bytes of frozen elastic weights this rank holds: its shards (or its share of the host
        store's chunks with weights_on="host": 0 on the device)."""
        total = 0
        for rt in self.runtimes.values():
            for et in rt.tensors:
                total += et.shard_bytes  # its shard, or its own elements in a run
        return total

    def frozen_bytes_of_packs(self) -> int:
        """Bytes of the whole frozen elastic weights of this rank's packs, as stored (their
        quantized size with a weight_format)."""
        return sum(et.nbytes for rt in self.runtimes.values() for et in rt.tensors)

    def stats(self) -> dict:
        """Cumulative figures of this rank: the runtimes' counters summed over its packs, and
        the P2P bytes of every step."""
        s = [rt.stats() for rt in self.runtimes.values()]
        out = {k: sum(x[k] for x in s) for k in ("allgather_bytes", "allgather_calls", "pool_hits", "pool_misses",
                                                  "h2d_bytes", "pool_peak_bytes", "host_store_bytes")}
        out.update(self._totals)
        return out

    def close(self) -> None:
        self.watch.close()
