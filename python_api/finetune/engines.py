"""The engines a job trains: the elastic runtime (ElasticEngine) and the FSDP2 baseline
(FSDP2Engine), each on a base model built on every rank with its failures agreed.

[Note: what is compared with FSDP2, and the tolerance]
`--baseline fsdp2` trains the same base model (same weights), PEFT LoRA with the same r, alpha
and target modules and *the same initial adapter values* (copied from the elastic model), with
`fully_shard` per decoder layer (reshard_after_forward=True) and on the root, AdamW with the
same hyper-parameters, on the same batches. In exact arithmetic the two runs are the same
computation; in fp32 they differ only in summation order (the elastic GEMMs run chunk by
chunk, gradients are averaged by all-reduce instead of reduce-scatter, PEFT adds the LoRA term
after the base GEMM). Those differences start at fp32 rounding (~1e-7 relative) and grow only
as far as training amplifies them; the test bounds the loss curves' difference by 1e-5
absolute over its short run (measured: 1.2e-7; see tests/finetune/test_finetune.py for the
number). With `--lora-dropout` > 0 the runs draw different masks and are not comparable step
by step.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math

import torch
import torch.nn as nn

from ..distributed.zero import ShardedOptimizer
from ..loading import LoadError, SafetensorsSource, empty_model
from ..nn import PEFT_PREFIX, adapter_state_dict, convert_to_elastic, runtime_of
from ..planner import PlanningError, least_memory
from ..planning import plan
from .agreement import agree_error
from .checkpoints import nonfinite
from .engine import Engine
from .errors import FinetuneError
from .job import Job
from .loop import adamw
from .models import ModelSpec, lora_config, target_list
from .option_values import budget_label, fmt_bytes
from .planning import JobPlanner
from .policy import elastic_policy


class ElasticEngine(Engine):
    """The model under convert_to_elastic; gradient accumulation through the runtime's no_sync."""

    kind = "elastic"

    def __init__(self, job: Job, budget, weights_on: str | None = None, planned: bool = False,
                 weight_format: str | None = None, lora=None):
        """`lora`: what convert_to_elastic takes (a sweep's {name: LoRAConfig}); None: the job's LoRAConfig."""
        model, source = _collective_build_on_meta(job)
        policy = with_format(elastic_policy(job.cfg, budget, weights_on, job.world_size), job.cfg.weights, weight_format)
        try:
            self.model = convert_to_elastic(model, lora_config(job.cfg.lora, job.cfg.training.seed) if lora is None
                                            else lora, policy,
                                            source=source)
        except LoadError as exc:  # raised on every rank (the ranks agree in source.check); names the files
            raise FinetuneError(str(exc)) from exc
        self.runtime = runtime_of(self.model)
        if source is not None:
            agree_error(_nonfinite_loaded(self.model, self.runtime, job.spec), job.world_size)
        frozen = sum(et.nbytes for et in self.runtime.tensors)  # as stored: quantized with --weight-format
        self.frozen_bytes = frozen
        if isinstance(budget, tuple):
            self.budget_bytes = int(budget[1] * frozen)
        else:
            self.budget_bytes = budget
        self.runtime.set_pool_budget(self.budget_bytes)
        policy = self.runtime.policy
        where = ""
        if policy.weights_on == "host":
            where = ", weights on host"
        elif policy.source_fraction > 0:
            where = f", {policy.source_fraction:g} from host"
        fmt = f" {policy.weight_format}" if policy.weight_format else ""
        self.weight_format = policy.weight_format or "none"
        self.name = f"elastic{fmt}, budget {budget_label(budget)}{where}"
        # The micro-batch split of each step: the job's, or the plan's (python_api/finetune/planning.py).
        self.micro_batch, self.grad_accum = job.cfg.training.micro_batch, job.cfg.training.grad_accum
        self.planner = None
        if (job.world_size > 1 and self.kind == "elastic" and not planned
                and self.budget_bytes is not None and self.budget_bytes < frozen):
            # Below a full cache each rank holds the AdamW moments of its share of the adapters
            # ([Note: sharded optimizer state] in python_api/distributed/zero.py). A full cache
            # keeps DDP's replicated optimizer (no all-gather a step); a planned run too (the
            # planner's memory model counts the moments on every rank); a sweep has its own.
            training = job.cfg.training
            self.optimizer = ShardedOptimizer([p for _, p in self.params()], lambda ps: adamw(ps, training),
                                              self.runtime.group)
            self._optimizer_gathered = 0  # its all-gathers' bytes up to the last step (step_figures)
        if planned:
            self.kind = "planned"
            self.planner = JobPlanner(job, self)
            self.name = f"planned{fmt}, cap {self.planner.cap_label()}{where}"
            _check_cap_schedule(job, self.planner, self.model)

    def before_step(self, step: int) -> None:
        """At the start of optimizer step `step` (0-based): a planned run re-plans if its memory
        changed (a collective decision, the same on every rank)."""
        if self.planner is not None:
            self.planner.before_step(step)

    def accumulate(self, is_last: bool):
        return contextlib.nullcontext() if is_last else self.runtime.no_sync()

    def gathered_bytes(self) -> int:
        """The frozen weights' all-gathers, and the updated adapters' of a sharded optimizer."""
        shared = self.optimizer.allgather_bytes if isinstance(self.optimizer, ShardedOptimizer) else 0
        return self.runtime.stats()["allgather_bytes"] + shared

    def h2d_bytes(self) -> int:
        return self.runtime.stats()["h2d_bytes"]

    def step_figures(self) -> dict:
        """A sharded optimizer's all-gather of the updated adapters in the step just run (part
        of the step's gathered bytes)."""
        if not isinstance(self.optimizer, ShardedOptimizer):
            return {}
        step = self.optimizer.allgather_bytes - self._optimizer_gathered
        self._optimizer_gathered = self.optimizer.allgather_bytes
        return {"optimizer_gathered": step}

    def run_figures(self, per_step: dict[str, list], tensor_peak: int | None, memory) -> dict:
        out = super().run_figures(per_step, tensor_peak, memory)
        out.update(budget_bytes=self.budget_bytes, frozen_bytes=self.frozen_bytes, runtime_stats=self.runtime.stats())
        if isinstance(self.optimizer, ShardedOptimizer):  # [Note: sharded optimizer state]
            out.update(optimizer_allgather_bytes_per_step=per_step.get("optimizer_gathered", []),
                       optimizer_state_bytes=self.optimizer.state_bytes())
        if self.planner is not None:
            out.update(self.planner.report())
        return out

    def adapters(self) -> dict:
        """The adapters under PEFT's names, a copy (adapter_state_dict's CPU tensors share
        storage with the parameters)."""
        return {k: v.clone() for k, v in adapter_state_dict(self.model).items() if k.startswith(PEFT_PREFIX)}

    def close(self) -> None:
        """The runtime's pool, shards and host memory go now ([Note: closing a runtime])."""
        self.runtime.close()


def with_format(policy, weights, weight_format: str | None):
    """`policy` with the weight format `weight_format` ("none", "nf4", "int8"; None: the job's
    own, unchanged), its block and nesting from --quant-block / --quant-nested (`weights`: the
    weight-format group, WeightFormatConfig; --compare-format)."""
    if weight_format is None:
        return policy
    if weight_format == "none":
        return dataclasses.replace(policy, weight_format=None, quant_block_size=None, quant_nested=False)
    return dataclasses.replace(policy, weight_format=weight_format, quant_block_size=weights.quant_block,
                               quant_nested=bool(weights.quant_nested) and weight_format == "nf4")


def _check_cap_schedule(job: Job, planner: JobPlanner, model: nn.Module) -> None:
    """Every cap of --memory-cap-change up to the last step must have a plan, checked before
    step 1 with the planner's own functions on the profile just measured: an impossible cap
    found only at its step (3:1, say) stopped the run there and discarded the steps trained.
    The profile is the same on every rank (its figures are agreed across ranks when measured),
    so is this decision. With `--memory-cap auto` on CUDA the cap in force can be lower still
    (the device's free memory, read at each step): that case is found at its step."""
    for step, size in planner.changes:
        if step > job.cfg.training.steps:
            continue  # after the last step: ignored ([Note: options a run ignores])
        try:
            plan(model, planner.profile, min(size, planner.profile.capacity_bytes), planner.global_batch)
        except PlanningError as exc:
            try:
                fits = least_memory(planner.profile, planner.global_batch, prefetch_depth=None)
                least = f"; the least memory it plans this model in is {fmt_bytes(fits)} per rank"
            except PlanningError:  # nothing fits even at the profile's capacity
                least = ""
            raise FinetuneError(
                f"--memory-cap-change {step}:{fmt_bytes(size)}: the planner finds no plan for {fmt_bytes(size)} per rank "
                f"({exc}){least}; checked before step 1, nothing was trained") from exc


class FSDP2Engine(Engine):
    """The same base model with PEFT LoRA (same initial adapters), fully_shard per decoder layer
    (reshard_after_forward=True by default, or False, or an int: `--fsdp2-reshard`) and on the
    root. A model directory is built on the meta device and each rank reads only its shard from
    the files ([Note: FSDP2 from the files])."""

    kind = "fsdp2"

    def __init__(self, job: Job, counter, reshard_after_forward: bool | int = True):
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        if job.spec.embedded:
            base, source = _collective_build(job), None
        else:
            base, source = _collective_meta_base(job)
        # On the meta device the adapters are read with the shards (_load_fsdp2_shards).
        self.model = peft_with_initial_adapters(job, base, set_adapters=source is None)
        layer_types = set(getattr(base, "_no_split_modules", None) or [])
        layers = [m for m in self.model.modules() if type(m).__name__ in layer_types]
        if not layers:
            raise FinetuneError(f"--baseline fsdp2: cannot find the decoder layers of {type(base).__name__} (_no_split_modules)")
        reshard = reshard_after_forward
        error = fsdp2_reshard_error(reshard, job.world_size)
        if error:
            raise FinetuneError(error)
        self.name = ("FSDP2 + PEFT (reshard after forward)" if reshard is True else
                     "FSDP2 + PEFT (no reshard after forward)" if reshard is False else
                     f"FSDP2 + PEFT (reshard after forward to {reshard} ranks)")
        self.reshard_after_forward = reshard
        mesh = init_device_mesh(job.device.type, (job.world_size,))
        for layer in layers:
            fully_shard(layer, mesh=mesh, reshard_after_forward=reshard)
        fully_shard(self.model, mesh=mesh)
        if source is not None:
            _load_fsdp2_shards(self.model, base, source, job)
        self.counter = counter
        self.micro_batch, self.grad_accum = job.cfg.training.micro_batch, job.cfg.training.grad_accum

    def accumulate(self, is_last: bool):
        self.model.set_requires_gradient_sync(is_last)
        return contextlib.nullcontext()

    def gathered_bytes(self) -> int:
        return self.counter.bytes


def fsdp2_reshard_error(reshard: bool | int, world_size: int) -> str | None:
    """Why FSDP2 cannot reshard to `reshard` ranks after forward on this mesh, or None: an int
    must be a divisor of the world size strictly between 1 and it (torch's own rule, where 1
    means False and the world size True)."""
    if isinstance(reshard, bool) or (1 < reshard < world_size and world_size % reshard == 0):
        return None
    return (f"--fsdp2-reshard {reshard}: on {world_size} ranks FSDP2 can keep the weights sharded after forward "
            f"over a group size that divides {world_size}, strictly between 1 and {world_size} "
            f"({', '.join(str(n) for n in range(2, world_size) if world_size % n == 0) or 'none here'}); "
            "use true or false")


def peft_with_initial_adapters(job: Job, base: nn.Module, set_adapters: bool = True):
    """`base` under PEFT LoRA with the job's r, alpha, dropout and targets (no rsLoRA), its
    adapters set to the elastic run's initial values (`job.initial_adapters`): what every
    peer trains ([Note: what is compared with FSDP2, and the tolerance])."""
    from peft import LoraConfig, get_peft_model

    lora = job.cfg.lora
    model = get_peft_model(base, LoraConfig(
        r=lora.lora_r, lora_alpha=lora.lora_alpha, lora_dropout=lora.lora_dropout,
        target_modules=target_list(lora), use_rslora=False,
    ))
    if set_adapters:
        _adapters_into_peft(model, job.initial_adapters)
    return model


def _adapters_into_peft(peft_model, state: dict) -> None:
    """Copy adapters saved under PEFT's file names (base_model.model.<module>.lora_A.weight)
    into a PEFT model's modules; every LoRA module must get one, and every tensor must land."""
    from peft.tuners.lora import LoraLayer

    inner = peft_model.base_model.model
    names = {n for n, m in inner.named_modules() if isinstance(m, LoraLayer)}
    wanted = {k[len("base_model.model."):].rsplit(".lora_", 1)[0] for k in state}
    if names != wanted:
        raise FinetuneError(
            f"--baseline: PEFT put LoRA on {len(names)} modules, the elastic model on {len(wanted)}; "
            f"differing: {sorted(names ^ wanted)[:4]}"
        )
    with torch.no_grad():
        for key, value in state.items():
            module_name, _, rest = key[len("base_model.model."):].rpartition(".lora_")
            which = "lora_A" if rest.startswith("A.") else "lora_B"
            getattr(inner.get_submodule(module_name), which)["default"].weight.copy_(value)


# [Note: FSDP2 from the files]
# `--baseline fsdp2` used to build the whole model in host memory on every rank
# (from_pretrained: 8 x 27 GB for a 7B in fp32) before sharding it. With a model directory it
# now does what FSDP2 users do: the model is built on the meta device (elastic_kernels.api.loading's
# empty_model: parameters on meta, buffers real), its files checked against it (shapes,
# dtypes, tied weights untied as from_pretrained does), PEFT's adapters added (on meta too),
# `fully_shard` applied, then `to_empty` gives each rank the memory of its own shard only, and
# each sharded parameter is filled from the files by rows: FSDP2 shards dim 0 as torch.chunk
# does (ceil(rows / W) per rank), so rank r reads rows [r*c, r*c + its local rows). The
# adapters come from the elastic run's initial values (job.initial_adapters) the same way;
# buffers are put back as the constructor made them (or from the files when they hold them).
# Peak host memory per rank: its shard of everything plus one read at a time. The base
# weights were checked for NaN/Inf by the elastic run, which reads the same files first.


def _collective_meta_base(job: Job):
    """The FSDP2 baseline's base model of a model directory on the meta device, checked against
    its files, and the files ([Note: FSDP2 from the files]). A failure anywhere is an error everywhere."""
    model, source, err = None, None, None
    try:
        source = SafetensorsSource(job.spec.source, device=job.device, allow_cast=True)
        model = empty_model(job.spec.config, job.spec.dtype).train()
    except LoadError as exc:
        err = str(exc)
    agree_error(err, job.world_size)
    try:
        source.check(model)  # a collective: every rank raises alike
    except LoadError as exc:
        raise FinetuneError(str(exc)) from exc
    source.untie_differing(model)
    return model, source


def _load_fsdp2_shards(model: nn.Module, base: nn.Module, source, job: Job) -> None:
    """Give the sharded (meta) PEFT model under fully_shard its memory (`to_empty`) and fill each
    rank's shard of every parameter from the files, the adapters from the elastic run's initial
    values ([Note: FSDP2 from the files])."""
    from torch.distributed.tensor import DTensor

    prefix = getattr(base, "base_model_prefix", None) or None
    buffers = {n: b.detach().clone() for n, b in model.named_buffers()}  # as built (real: params_on_meta)
    model.to_empty(device=job.device)
    peft_prefix = "base_model.model."

    def file_rows(name: str):
        inner = name[len(peft_prefix):] if name.startswith(peft_prefix) else name
        key = source.resolve(inner.replace(".base_layer.", "."), prefix)
        if key is None:
            raise FinetuneError(f"--baseline fsdp2: {name} is in none of the files of {source.path}")
        return source.rows(key), source.entries[key].shape

    def adapter_rows(name: str):
        key = name.replace(".default.weight", ".weight")
        if key not in job.initial_adapters:
            raise FinetuneError(f"--baseline fsdp2: no initial value for the adapter {name}")
        value = job.initial_adapters[key]
        return (lambda b, e: value[b:e]), tuple(value.shape)

    with torch.no_grad():
        for name, param in model.named_parameters():
            rows, shape = adapter_rows(name) if ".lora_" in name else file_rows(name)
            local = param.to_local() if isinstance(param, DTensor) else param
            if tuple(param.shape) != tuple(shape):
                raise FinetuneError(f"--baseline fsdp2: {name} has shape {tuple(param.shape)}, its source {tuple(shape)}")
            if isinstance(param, DTensor) and local.dim() > 0:
                chunk = -(-shape[0] // job.world_size)
                begin = min(job.rank * chunk, shape[0])
                if local.shape[0] != min(chunk, shape[0] - begin) or tuple(local.shape[1:]) != tuple(shape[1:]):
                    raise FinetuneError(f"--baseline fsdp2: {name}: this rank's shard has shape {tuple(local.shape)}, "
                                        f"not rows [{begin}, {begin + chunk}) of {tuple(shape)} (FSDP2's dim-0 chunks)")
            else:
                begin = 0
            if local.dim() == 0:
                raise FinetuneError(f"--baseline fsdp2: {name} is a 0-dimensional parameter (not supported here)")
            if local.numel():
                local.copy_(rows(begin, begin + local.shape[0]).reshape(local.shape))
        for mname, module in model.named_modules():
            for local_name, buf in module.named_buffers(recurse=False):
                name = f"{mname}.{local_name}" if mname else local_name
                inner = name[len(peft_prefix):] if name.startswith(peft_prefix) else name
                key = None if local_name in module._non_persistent_buffers_set else source.resolve(inner, prefix)
                buf.copy_(source.tensor(key, dtype=buf.dtype) if key is not None else buffers[name])


def _collective_build(job: Job) -> nn.Module:
    """Build the base model on every rank and check its weights are finite; a failure
    anywhere is an error everywhere."""
    model, err = None, None
    try:
        model = job.spec.build()
        _check_finite_weights(model, job.spec)
        model = model.to(job.device)
    except FinetuneError as exc:
        err = str(exc)
    agree_error(err, job.world_size)
    return model


def _collective_build_on_meta(job: Job):
    """The elastic engine's base model and where its weights come from: for a model directory,
    the model with its parameters on the meta device and a `SafetensorsSource` from which
    convert_to_elastic reads each rank's share ([Note: loading from files] in
    python_api/loading/), so no rank holds the whole model; the embedded model is built in
    memory (`_collective_build`, source None). A failure anywhere is an error everywhere."""
    if job.spec.embedded:
        return _collective_build(job), None
    model, source, err = None, None, None
    try:  # --dtype casts floating weights on load, as from_pretrained(dtype=...) does
        source = SafetensorsSource(job.spec.source, device=job.device, allow_cast=True)
        if job.spec.packed is not None:  # [Note: the CLI reads bitsandbytes 4-bit checkpoints]
            source.read_packed(job.spec.packed)
        model = empty_model(job.spec.config, job.spec.dtype).train()
    except LoadError as exc:
        err = str(exc)
    agree_error(err, job.world_size)
    return model, source


def _nonfinite_loaded(model: nn.Module, runtime, spec: ModelSpec) -> str | None:
    """`_check_finite_weights` of a model loaded by rows, as an error message or None: each rank
    checks what it holds (its shard of every elastic weight, and the replicated tensors), so
    together the ranks check every weight once without any of them reading it whole. With
    weights_on="host" there is no shard: every node has its own copy of every weight (its host
    store), so each rank checks its node's store, local rank i of L the chunks i, i + L, ...:
    every chunk of every node's store exactly once per node."""
    try:
        _check_finite_weights(model, spec)
        node = runtime.host_node.layout if runtime.host_node is not None else None
        local_rank, local_world = (node.local_rank, node.local_world) if node is not None else (0, 1)
        for et in runtime.tensors:
            parts = et.own_parts() if et.on_device else \
                [et.host_chunk(c) for c in range(local_rank, et.num_chunks, local_world)]
            if et.qlayout is not None:  # its shard is the quantized image: the rows it was made of
                bad = et.nonfinite_read
            else:
                bad = sum(int((~torch.isfinite(p)).sum()) for p in parts if p.is_floating_point())
            if bad:
                raise FinetuneError(_nonfinite_message(f"{et.name}.weight", bad, math.prod(et.shape), spec))
    except FinetuneError as exc:
        return str(exc)
    return None


def _nonfinite_message(name: str, bad: int, numel: int, spec: ModelSpec) -> str:
    what = "the embedded model" if spec.embedded else f"the model in {spec.source}"
    cast = (f" (or values beyond the range of {str(spec.dtype).replace('torch.', '')} became Inf when "
            f"loaded in it: try --dtype float32 or bfloat16)") if spec.dtype == torch.float16 else ""
    return (f"the base weights of {what} hold NaN or Inf values ({name}, {bad} of "
            f"{numel}): the weights are damaged{cast}; every loss would be NaN, whatever --lr")


def _check_finite_weights(model: nn.Module, spec: ModelSpec) -> None:
    """NaN or Inf in the base weights makes every loss NaN from step 1, whatever the learning
    rate: say so before training (one pass over the weights, on the CPU copy)."""
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        if nonfinite(t):
            raise FinetuneError(_nonfinite_message(name, int((~torch.isfinite(t)).sum()), t.numel(), spec))
