"""The (pp, dp) mesh of a pipelined run: `pipeline_groups(pp)`.

[Note: the mesh and its timeouts]
The world is `init_device_mesh(device, (pp, dp), mesh_dim_names=("pp", "dp"))`: global rank
= pp_rank x dp + dp_rank, so the dp replicas of a stage are consecutive ranks (on one node
when dp divides the GPUs per node, which keeps the frozen weights' all-gathers and the host
store on the node) and activations cross nodes along "pp". Frozen weights shard and gather
over the dp group only; PipelineStage's P2P runs over the pp group.
DeviceMesh sub-groups do not inherit `init_process_group(timeout=...)`: they get the
backend's default (30 minutes on gloo), and `dist.set_timeout` does not change it there
(measured, torch 2.14.1, /work/scratch/pp/FINDINGS.md Q5). A P2P receive whose peer died
would then block for 30 minutes. So each mesh dimension gets the timeout explicitly through
`backend_override` (the backend's Options with `_timeout` set), which bounds every blocked
receive and all-gather by `timeout_s`.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..planner.pipeline import PipelineError, divisors


@dataclass(frozen=True)
class PipelineGroups:
    """This rank's place in the (pp, dp) mesh and the two groups it talks over."""

    pp: int
    dp: int
    rank: int
    pp_rank: int
    dp_rank: int
    pp_group: object  # dist.ProcessGroup: activations (PipelineStage P2P)
    dp_group: object  # dist.ProcessGroup: frozen-weight gathers, adapter-gradient all-reduce
    mesh: object  # torch.distributed.device_mesh.DeviceMesh

    @property
    def world_size(self) -> int:
        return self.pp * self.dp


def _options(backend: str, timeout_s: float):
    timeout = datetime.timedelta(seconds=timeout_s)
    if backend == "gloo":
        opts = dist.ProcessGroupGloo._Options()
    elif backend == "nccl":
        opts = dist.ProcessGroupNCCL.Options()
    else:
        raise PipelineError(f"pipelines run on gloo or nccl, not on the {backend!r} backend")
    opts._timeout = timeout
    return (backend, opts)


def pipeline_groups(pp: int, device: torch.device | str = "cpu", timeout_s: float = 300.0) -> PipelineGroups:
    """The (pp, dp) mesh over the default process group ([Note: the mesh and its timeouts]).
    A collective: every rank calls it with the same `pp`."""
    if not (dist.is_available() and dist.is_initialized()):
        raise PipelineError("a pipeline needs an initialised process group (torch.distributed.init_process_group)")
    world = dist.get_world_size()
    if isinstance(pp, bool) or not isinstance(pp, int) or pp < 1:
        raise PipelineError(f"the pipeline degree must be a positive int, got {pp!r}")
    if world % pp:
        raise PipelineError(f"the pipeline degree {pp} does not divide the world size {world} "
                            f"(world = pp x dp; divisors of {world}: {divisors(world)})")
    if not timeout_s or timeout_s <= 0:
        raise PipelineError(f"timeout_s must be a positive number of seconds, got {timeout_s!r}")
    from torch.distributed.device_mesh import init_device_mesh

    device = torch.device(device)
    backend = dist.get_backend()
    override = {"pp": _options(backend, timeout_s), "dp": _options(backend, timeout_s)}
    mesh = init_device_mesh(device.type, (pp, world // pp), mesh_dim_names=("pp", "dp"), backend_override=override)
    return PipelineGroups(pp=pp, dp=world // pp, rank=dist.get_rank(), pp_rank=mesh["pp"].get_local_rank(),
                          dp_rank=mesh["dp"].get_local_rank(), pp_group=mesh["pp"].get_group(),
                          dp_group=mesh["dp"].get_group(), mesh=mesh)
