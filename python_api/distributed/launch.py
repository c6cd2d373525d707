"""The default process group under a multi-process launch: `ensure_default_group`.

[Note: converting under a launcher creates the process group]
torchrun (and `accelerate launch`) start W processes and set RANK, WORLD_SIZE, LOCAL_RANK,
MASTER_ADDR and MASTER_PORT, but create no process group: the script does, and with the
Hugging Face stack it is `TrainingArguments` (through accelerate's `PartialState`) that calls
`init_process_group`, after the model was loaded and, naturally, converted. A runtime built
before any group exists runs alone (world size 1, [Note: single process] in
python_api/runtime/runtime.py), so each rank would silently hold and train the whole model,
and the first collective (a save) would fail far from the cause. So `convert_to_elastic`,
`elasticize` and `load_elastic` call `ensure_default_group` first: with `WORLD_SIZE > 1` in the
environment and no group, they create the default group the way accelerate and the Trainer do
(env:// rendezvous from the launcher's variables; NCCL for a CUDA device, after
`torch.cuda.set_device(LOCAL_RANK)`; gloo otherwise), and the Trainer or `Accelerator` created
afterwards finds it and uses it (`PartialState` initialises a group only when none exists).
When the variables a rendezvous needs are missing (WORLD_SIZE set by hand, say) it refuses
with the fix rather than guess. `WORLD_SIZE` absent or 1: nothing happens (a plain script).
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

__all__ = ["ensure_default_group", "launch_world_size"]

_RENDEZVOUS = ("RANK", "MASTER_ADDR", "MASTER_PORT")


def launch_world_size() -> int:
    """WORLD_SIZE as a launcher (torchrun, accelerate launch) sets it; 1 when absent. A value
    that is not a positive integer is refused by name."""
    raw = os.environ.get("WORLD_SIZE")
    if raw is None or raw.strip() == "":
        return 1
    try:
        n = int(raw)
    except ValueError:
        n = 0
    if n < 1:
        raise RuntimeError(f"the environment variable WORLD_SIZE is {raw!r}: it must be a positive integer "
                           "(the number of processes torchrun or accelerate launch started)")
    return n


def ensure_default_group(device: torch.device | str | None, what: str) -> None:
    """See [Note: converting under a launcher creates the process group]. `device`: where the
    model's elastic weights will live (picks the backend); `what` names the caller in errors."""
    if not dist.is_available():
        if launch_world_size() > 1:
            raise RuntimeError(f"{what}: WORLD_SIZE={os.environ['WORLD_SIZE']} but this torch build has no "
                               "torch.distributed")
        return
    if dist.is_initialized():
        return
    world = launch_world_size()
    if world == 1:
        return
    missing = [v for v in _RENDEZVOUS if not os.environ.get(v)]
    if missing:
        raise RuntimeError(
            f"{what}: WORLD_SIZE={world} says this is one of {world} processes, but no process group exists and "
            f"{', '.join(missing)} {'is' if len(missing) == 1 else 'are'} not set, so none can be created here: "
            f"launch with torchrun (or accelerate launch), or call torch.distributed.init_process_group(...) before "
            f"{what}; without a group every process would train the whole model alone")
    device = torch.device(device) if device is not None else torch.device("cpu")
    if device.type == "cuda":
        local = os.environ.get("LOCAL_RANK")
        if device.index is None and local is not None and local.isdigit() and int(local) < torch.cuda.device_count():
            torch.cuda.set_device(int(local))  # as accelerate's PartialState does: one GPU per local rank
        backend = "nccl"
    else:
        backend = "gloo"
    dist.init_process_group(backend=backend, init_method="env://")
