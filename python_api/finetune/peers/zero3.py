"""DeepSpeed ZeRO-3 + PEFT LoRA: the peer of `--baseline deepspeed`.

The base model is built under `deepspeed.zero.Init` (sharded at construction, as ZeRO-3's
users do), the job's base weights are written into the partitions from rank 0, PEFT LoRA gets
the elastic run's initial adapters, and `deepspeed.initialize` takes a torch AdamW with the
job's hyper-parameters. DeepSpeed is an optional dependency (`pip install
elastic-kernels[baselines]`); nothing outside this module imports it, and only when this peer
runs.

[Note: DeepSpeed ZeRO-3 as a peer]
What each line below relies on was measured with DeepSpeed 0.19.8 on 2 gloo ranks (the issue
18 spike; the tests in tests/finetune/test_peers.py hold the results):
- Accelerator: `DS_ACCELERATOR=cpu` must be set before `deepspeed` is first imported on a
  machine without a GPU (its CPU accelerator then uses gloo; no oneCCL, no DeepSpeed
  launcher). `init_distributed` wraps the process group torchrun made. Its first call on a
  machine JIT-builds one small op (`deepspeed_shm_comm`, ~85 s on the loaded 2-core VM, then
  cached in ~/.cache/torch_extensions, 0.5 s); only DeepSpeed's inference all-reduce uses it.
- dtype: only `zero.Init(config_dict_or_path=cfg, dtype=None)` keeps float32 on CPU.
  `Init._set_dtype` reads `self.dtype = dtype or torch.float16 if fp16_ok else
  torch.bfloat16 if is_bf16_supported else torch.float`, which parses as
  `(dtype or fp16) if fp16_ok else (bf16 if <a bound method: truthy> else fp32)`: on CPU
  (no fp16) any explicit dtype, float32 included, silently becomes bfloat16. With the config
  and dtype=None it follows the config's bf16/fp16 flags. The engine checks the dtype of
  every partition after `initialize`.
- Values: built under zero.Init the weights are not the job's (HF's init runs on empty
  partitions), so each module's parameters are gathered with `GatheredParameters(...,
  modifier_rank=0)`, rank 0 copies the job's values in, and the exit re-partitions them.
- Adapters: PEFT's LoRA layers are created after zero.Init, as plain tensors, and get the
  initial values then; `initialize` partitions them too. (Written after `initialize`, a
  gathered copy would change the compute copy only: the optimizer's fp32 master partition
  keeps the old values and the first step brings them back.)
- Clipping: 0.19.8 clips the global gradient norm at 1.0 unless told otherwise
  (runtime/constants.py GRADIENT_CLIPPING_DEFAULT = 1.0): `gradient_clipping: 0.0`.
- Optimizer: a client torch AdamW. ZeRO-3 steps its flat fp32 partitions of the adapters
  through it (AdamW is element-wise, so that is the same arithmetic), and the loop's learning
  rate schedule writes its param_groups. A config-built AdamW is DeepSpeed's FusedAdam (a
  second JIT build, other numerics).
- Accumulation: ZeRO-3 has no `no_sync`. `gradient_accumulation_steps` is 1 and the
  micro-steps of an optimizer step run inside one `engine.coalesce_grad_reduction()` block:
  gradients accumulate locally and are reduced once when the block closes, one reduction per
  step as for the other runs; the loop's `(loss / accum).backward()` is then exact
  (DeepSpeed's per-tensor hook divides by gradient_accumulation_steps, 1). With
  gradient_accumulation_steps = accum the same backward would divide twice.
- Buckets: `reduce_bucket_size` is the adapters' element count (one bucket holds every
  gradient); DeepSpeed's default, 5e8 elements, is a 2 GB fp32 buffer per rank.
- Counting: DeepSpeed's TorchBackend keeps the `torch.distributed.all_gather_into_tensor` it
  found when it was built; the engine points it at the current one, so the job's
  AllGatherCounter ([Note: what the all-gather counter wraps]) sees every gather whenever the
  backend was made. `stage3_use_all_reduce_for_fetch_params` stays off (it would fetch with
  all-reduce).
- ZeRO++ quantized weights need CUDA: on CPU `zero.Init` fails in `CUDAQuantizer()` with
  "This op had not been implemented on CPU backend"; refused up front.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import warnings
from dataclasses import dataclass, fields

import torch
import torch.distributed as dist
import torch.nn as nn

from ..agreement import agree_error
from ..engine import Engine
from ..engines import _check_finite_weights, peft_with_initial_adapters
from ..errors import FinetuneError
from ..job import Job
from ..loop import adamw

INSTALL_HINT = ("pip install 'elastic-kernels[baselines]' (or: DS_BUILD_OPS=0 pip install --no-build-isolation "
                "-r requirements-baselines.txt, with DS_ACCELERATOR=cpu on a machine without a GPU)")

# DeepSpeed 0.19.8's values of the four knobs (runtime/zero/config.py), for labels.
DEEPSPEED_DEFAULTS = {"persistence_threshold": 10**5, "max_live_parameters": 10**9,
                      "max_reuse_distance": 10**9, "prefetch_bucket_size": 5 * 10**7}
_CONFIG_KEYS = {"persistence_threshold": "stage3_param_persistence_threshold",
                "max_live_parameters": "stage3_max_live_parameters",
                "max_reuse_distance": "stage3_max_reuse_distance",
                "prefetch_bucket_size": "stage3_prefetch_bucket_size",
                "quantized_weights": "zero_quantized_weights",
                "quantized_nontrainable_weights": "zero_quantized_nontrainable_weights"}
_SHORT = {"persistence_threshold": "persistence", "max_live_parameters": "max live",
          "max_reuse_distance": "reuse", "prefetch_bucket_size": "prefetch",
          "quantized_weights": "quantized weights", "quantized_nontrainable_weights": "quantized frozen weights"}


def count_text(n: int) -> str:
    """100000 -> '1e5', 50000000 -> '5e7', 362752 -> '362752' (DeepSpeed's own notation)."""
    if n >= 1000:
        mantissa, exp = n, 0
        while mantissa % 10 == 0:
            mantissa //= 10
            exp += 1
        if exp >= 3 and mantissa < 10:
            return f"{mantissa}e{exp}"
    return str(n)


@dataclass(frozen=True)
class ZeRO3Setting:
    """The ZeRO-3 knobs a user tunes; None leaves DeepSpeed's default (DEEPSPEED_DEFAULTS).
    Element counts, as DeepSpeed counts them."""

    persistence_threshold: int | None = None
    max_live_parameters: int | None = None
    max_reuse_distance: int | None = None
    prefetch_bucket_size: int | None = None
    quantized_weights: bool = False
    quantized_nontrainable_weights: bool = False

    @classmethod
    def from_args(cls, args) -> ZeRO3Setting:
        """The --ds-* options (`args`: the peers' options, PeersConfig, or parse_args' namespace)."""
        return cls(**{f.name: getattr(args, "ds_" + f.name) for f in fields(cls)})

    def zero_optimization(self) -> dict:
        """The given knobs as DeepSpeed's zero_optimization keys."""
        return {_CONFIG_KEYS[f.name]: getattr(self, f.name) for f in fields(self)
                if getattr(self, f.name) is not None and getattr(self, f.name) is not False}

    @property
    def label(self) -> str:
        """'DeepSpeed defaults' or e.g. 'persistence 0, reuse 0, prefetch 0'."""
        parts = []
        for f in fields(self):
            v = getattr(self, f.name)
            if v is True:
                parts.append(_SHORT[f.name])
            elif v is not None and v is not False:
                parts.append(f"{_SHORT[f.name]} {count_text(v)}")
        return ", ".join(parts) or "DeepSpeed defaults"

    def options(self) -> list[str]:
        """The command-line options that select this setting (`--ds-...`)."""
        out = []
        for f in fields(self):
            v = getattr(self, f.name)
            opt = "--ds-" + f.name.replace("_", "-")
            if v is True:
                out.append(opt)
            elif v is not None and v is not False:
                out += [opt, count_text(v)]
        return out


def setting_error(setting: ZeRO3Setting, device: torch.device, dtype: torch.dtype) -> str | None:
    """Why this setting cannot run on `device` in `dtype`, or None."""
    if device.type != "cuda" and (setting.quantized_weights or setting.quantized_nontrainable_weights):
        which = "--ds-quantized-weights" if setting.quantized_weights else "--ds-quantized-nontrainable-weights"
        return (f"{which}: ZeRO++ quantized weights need a CUDA device; DeepSpeed's quantizer has no CPU "
                "implementation (zero.Init fails with 'This op had not been implemented on CPU backend')")
    if device.type != "cuda" and dtype == torch.float16:
        return ("--baseline deepspeed with --dtype float16 on CPU: DeepSpeed's CPU accelerator does not support "
                "float16; use --dtype float32 or bfloat16")
    return None


def import_deepspeed(device: torch.device):
    """`deepspeed`, imported for `device` (DS_ACCELERATOR=cpu first where there is no GPU);
    ImportError with the reason and the install line when it cannot be."""
    if device.type != "cuda":
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    try:
        import deepspeed
        from deepspeed.accelerator import get_accelerator
    except Exception as exc:  # noqa: BLE001 - any failure to import is "not available", with its cause
        raise ImportError(f"DeepSpeed cannot be imported ({type(exc).__name__}: {exc}); {INSTALL_HINT}") from exc
    accel = get_accelerator().device_name()
    if (device.type == "cuda") != (accel == "cuda"):
        raise ImportError(f"DeepSpeed was set up for its '{accel}' accelerator (DS_ACCELERATOR="
                          f"{os.environ.get('DS_ACCELERATOR', 'unset')}), the job runs on {device.type}")
    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
    return deepspeed


def ds_config(job: Job, setting: ZeRO3Setting, adapter_numel: int) -> dict:
    """The DeepSpeed configuration of the peer ([Note: DeepSpeed ZeRO-3 as a peer])."""
    t = job.cfg.training
    dtype = job.spec.dtype
    return {
        "train_micro_batch_size_per_gpu": t.micro_batch,
        "gradient_accumulation_steps": 1,  # the micro-steps of a step share one coalesce_grad_reduction block
        "train_batch_size": t.micro_batch * job.world_size,
        "gradient_clipping": 0.0,
        "prescale_gradients": False,
        "gradient_predivide_factor": 1.0,
        "bf16": {"enabled": dtype == torch.bfloat16},
        "fp16": {"enabled": dtype == torch.float16},
        "zero_allow_untested_optimizer": True,
        "zero_optimization": {
            "stage": 3,
            "overlap_comm": True,
            "contiguous_gradients": True,
            "reduce_bucket_size": max(1, adapter_numel),
            **setting.zero_optimization(),
        },
        "steps_per_print": 2**31 - 1,
        "wall_clock_breakdown": False,
    }


def _point_backend_at_current_collectives() -> None:
    """DeepSpeed's TorchBackend stores torch.distributed's all-gather and reduce-scatter when it
    is built; refresh them so a counter installed later sees DeepSpeed's calls."""
    cdb = sys.modules["deepspeed.comm.comm"].cdb
    cdb.all_gather_function = cdb.get_all_gather_function()
    cdb.reduce_scatter_function = cdb.get_reduce_scatter_function()


class ZeRO3Engine(Engine):
    """DeepSpeed ZeRO-3 + PEFT LoRA (see the module docstring)."""

    kind = "deepspeed"

    def __init__(self, job: Job, counter, setting: ZeRO3Setting = ZeRO3Setting()):
        from transformers import AutoModelForCausalLM

        agree_error(setting_error(setting, job.device, job.spec.dtype), job.world_size)
        error, ds = None, None
        try:
            ds = import_deepspeed(job.device)
        except ImportError as exc:
            error = f"--baseline deepspeed: {exc}"
        agree_error(error, job.world_size)
        warnings.filterwarnings("ignore", message=".*all_gather_into_tensor.* is deprecated")
        warnings.filterwarnings("ignore", message=".*reduce_scatter_tensor.* is deprecated")
        # DeepSpeed reads these from the environment (zero.Init: LOCAL_RANK); torchrun sets them,
        # a process group made another way (file://, tests) may not.
        for key, value in (("RANK", job.rank), ("WORLD_SIZE", job.world_size), ("LOCAL_RANK", job.local_rank)):
            os.environ.setdefault(key, str(value))
        ds.init_distributed(dist_backend=dist.get_backend(), auto_mpi_discovery=False, verbose=False)
        _point_backend_at_current_collectives()
        self.setting = setting
        self.name = f"DeepSpeed ZeRO-3 + PEFT ({setting.label})"
        self.counter = counter
        self.micro_batch, self.grad_accum = job.cfg.training.micro_batch, job.cfg.training.grad_accum
        adapter_numel = sum(v.numel() for v in job.initial_adapters.values())
        self.config = ds_config(job, setting, adapter_numel)
        # No initialization: every parameter is written from rank 0 below. Initializing would also
        # fail on a model with a padding token (the real model's pad_token_id 2): transformers
        # zeroes weight[padding_idx] of an embedding zero.Init has already partitioned to size 0.
        with ds.zero.Init(config_dict_or_path=self.config, dtype=None), _no_init_weights():  # dtype=None: [Note: DeepSpeed ZeRO-3 as a peer]
            base = AutoModelForCausalLM.from_config(job.spec.config)
        base.train()
        _write_weights_from_rank0(ds, job, base)
        peft_model = peft_with_initial_adapters(job, base)
        self.optimizer = adamw([p for p in peft_model.parameters() if p.requires_grad], job.cfg.training)
        self.model, ds_optimizer, _, _ = ds.initialize(model=peft_model, optimizer=self.optimizer, config=self.config)
        if getattr(ds_optimizer, "optimizer", None) is not self.optimizer:
            raise FinetuneError(f"--baseline deepspeed: DeepSpeed wrapped the AdamW in {type(ds_optimizer).__name__} "
                                "without stepping it; the learning-rate schedule would not reach the optimizer")
        self.partition_dtypes = sorted({str(p.ds_tensor.dtype).replace("torch.", "")
                                        for p in self.model.module.parameters()})
        agree_error(self._dtype_error(job), job.world_size)
        self._coalescing = None

    def _dtype_error(self, job: Job) -> str | None:
        want = job.spec.dtype
        wrong = [(n, p.ds_tensor.dtype) for n, p in self.model.module.named_parameters()
                 if not p.requires_grad and p.ds_tensor.dtype != want]
        if wrong:
            return (f"--baseline deepspeed: DeepSpeed holds {wrong[0][0]} in {wrong[0][1]} ({len(wrong)} frozen "
                    f"weights), the job asked for {want}")
        return None

    def params(self):
        return [(n, p) for n, p in self.model.module.named_parameters() if p.requires_grad]

    @contextlib.contextmanager
    def accumulate(self, is_last: bool):
        """The micro-steps of one optimizer step run inside one coalesce_grad_reduction block,
        opened at the first and closed (the one reduction) after the last."""
        if self._coalescing is None:
            self._coalescing = self.model.coalesce_grad_reduction()
            self._coalescing.__enter__()
        try:
            yield
        except BaseException:
            block, self._coalescing = self._coalescing, None
            block.__exit__(*sys.exc_info())
            raise
        if is_last:
            block, self._coalescing = self._coalescing, None
            block.__exit__(None, None, None)

    def optimizer_step(self, opt) -> None:
        """DeepSpeed's step: AdamW (`opt`, this engine's `optimizer`) on this rank's partitions,
        gradients cleared."""
        self.model.step()

    def gathered_bytes(self) -> int:
        return self.counter.bytes

    def close(self) -> None:
        self.model.destroy()


def _no_init_weights():
    """transformers' context that skips weight initialization (moved between versions)."""
    try:
        from transformers.initialization import no_init_weights
    except ImportError:
        from transformers.modeling_utils import no_init_weights
    return no_init_weights()


def _write_weights_from_rank0(ds, job: Job, base: nn.Module) -> None:
    """The job's base weights (built on rank 0 only) into the partitions of `base`, one
    module's parameters per gather; the buffers broadcast from rank 0."""
    plain, error = None, None
    if job.rank == 0:
        try:
            plain = job.spec.build()
            _check_finite_weights(plain, job.spec)
        except FinetuneError as exc:
            error = str(exc)
    agree_error(error, job.world_size)
    src = dict(plain.named_parameters(remove_duplicate=False)) if plain is not None else {}
    for module_name, module in base.named_modules():
        own = list(module.named_parameters(recurse=False))
        if not own:
            continue
        with ds.zero.GatheredParameters([p for _, p in own], modifier_rank=0), torch.no_grad():
            if job.rank == 0:
                for name, p in own:
                    p.copy_(src[f"{module_name}.{name}" if module_name else name])
    buffers = dict(plain.named_buffers()) if plain is not None else {}
    with torch.no_grad():
        for name, b in base.named_buffers():
            t = (buffers[name] if job.rank == 0 else b).to(job.device, b.dtype)
            dist.broadcast(t, 0)
            b.copy_(t)
