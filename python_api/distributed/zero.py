"""An optimizer whose state is sharded across the ranks (ZeRO stage 1) for replicated trainable
parameters: the adapters, whose gradients the runtime already averages on every rank.

    opt = ShardedOptimizer(params, lambda owned: torch.optim.AdamW(owned, lr=1e-4), group)
    loss.backward()          # gradients averaged across the group (the runtime's buckets)
    opt.step()               # each rank updates the parameters it owns, then every rank gets them all
    opt.zero_grad()

[Note: sharded optimizer state]
The adapters are replicated and their gradients all-reduced, so every rank used to run the
same AdamW update on every adapter and hold both of its moments: on SmolLM2-135M with LoRA r
8 on every projection, 18.6 MiB of moments per rank, where FSDP2 shards them (4.7 MiB at 4
ranks; bench/results/2026-12-04_buffers.md, "Where the 4-rank peak goes"). Here each rank owns
a contiguous run of the parameters (in the order given, cut where the running element count
crosses k/W of the total: `partition`, the same on every rank) and builds the inner optimizer
over those only, so it holds 1/W of the state. `step()` runs the inner step on the owned
parameters, then one all-gather per dtype of the owned parameters' new values, flattened and
padded to the largest rank's count, copied into every rank's parameters: (W - 1)/W of the
adapter bytes received per step, half what the all-reduce of their gradients receives. The
gradients stay all-reduced (stage 1, not 2): every rank holds them all. The result is the
replicated optimizer's bit for bit: the gradients are the same on every rank, AdamW's update
of a parameter reads only that parameter, its gradient and its own state (elementwise, the
same kernels whatever tensors share a foreach call), and the all-gather copies bits.
- `param_groups` are the inner optimizer's (one group; a rank that owns nothing keeps a
  group of its own), so a learning rate set on them is the step's.
- `state_dict()` is the replicated optimizer's, over every parameter in the order given: a
  collective (every rank's part, moved to the host, exchanged); `load_state_dict` takes that
  form and keeps the owned entries, so a checkpoint does not depend on the world size.
- Where it runs: the CLI's elastic engine below a full cache (python_api/finetune/engines.py),
  the end of the frontier that FSDP2 holds, whose optimizer state is sharded too. A full
  cache keeps DDP's replicated optimizer: the point of that end is DDP's speed, and the
  all-gather would add to the step what DDP does not do. Planned runs keep it replicated as
  well: the planner's memory model counts the moments on every rank.
- Not for parameters that differ across ranks (a pipeline's stages) nor for gradients that are
  not averaged before `step()`: the owner's update would be everyone's.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist

from .agree import exchange
from .collectives import all_gather_into


def partition(numels: list[int], world_size: int) -> list[tuple[int, int]]:
    """Per rank, the parameters [begin, end) it owns: contiguous runs in the given order, the
    cut after the parameter whose running element count first reaches k/W of the total."""
    total = sum(numels)
    bounds, begin, running = [], 0, 0
    for r in range(world_size):
        end = begin
        target = total * (r + 1) / world_size
        while end < len(numels) and (r == world_size - 1 or running + numels[end] / 2 <= target):
            running += numels[end]
            end += 1
        bounds.append((begin, end))
        begin = end
    return bounds


def _local_error(params: list) -> str | None:
    if not params:
        return "no parameters"
    if len({id(p) for p in params}) != len(params):
        return "a parameter is given twice"
    devices = {p.device for p in params}
    if len(devices) != 1:
        return f"the parameters are on several devices {sorted(map(str, devices))}"
    return None


def _check_params(params: list, world_size: int, group) -> None:
    """Every rank must pass the same parameter list (shapes and dtypes, in order): the
    partition and the all-gathers are computed from it. Checked on every rank at once, so a
    rank's bad input fails every rank with the same message instead of a hang in a peer's
    next collective."""
    err = _local_error(params)
    if world_size == 1:
        if err:
            raise ValueError(f"ShardedOptimizer: {err}")
        return
    signature = [(tuple(p.shape), str(p.dtype)) for p in params]
    every = exchange((err, signature), group, what="ShardedOptimizer: checking the parameters")
    errors = [(r, e) for r, (e, _) in enumerate(every) if e]
    if errors:
        raise ValueError("ShardedOptimizer: " + "; ".join(f"{e} (on rank {r})" for r, e in errors))
    first = every[0][1]
    for r, (_, sig) in enumerate(every[1:], start=1):
        if sig != first:
            if len(sig) != len(first):
                where = f"{len(sig)} parameters on rank {r}, {len(first)} on rank 0"
            else:
                i = next(i for i, (a, b) in enumerate(zip(sig, first)) if a != b)
                where = f"parameter {i} is {sig[i][0]} {sig[i][1]} on rank {r}, {first[i][0]} {first[i][1]} on rank 0"
            raise ValueError(f"ShardedOptimizer: the ranks pass different parameters ({where}); every rank must "
                             f"pass the same replicated parameters in the same order")


class ShardedOptimizer(torch.optim.Optimizer):
    """ZeRO stage 1 over `params` (replicated, their gradients averaged before each step):
    `make(owned)` builds the inner optimizer on this rank's share ([Note: sharded optimizer
    state]). A torch Optimizer, so torch's learning-rate schedulers take it; its
    `param_groups`, `state` and `defaults` are the inner optimizer's (Optimizer.__init__ is not
    called: it would build groups of its own)."""

    def __init__(self, params, make: Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer], group=None):
        self.params = list(params)
        self.group = group
        one = not dist.is_initialized()  # a single process without a process group owns everything
        self.world_size = 1 if one else dist.get_world_size(group)
        self.rank = 0 if one else dist.get_rank(group)
        _check_params(self.params, self.world_size, group)
        self.bounds = partition([p.numel() for p in self.params], self.world_size)
        begin, end = self.bounds[self.rank]
        self.owned = self.params[begin:end]
        probe = make(self.owned if self.owned else [torch.nn.Parameter(self.params[0].new_zeros(0))])
        if len(probe.param_groups) != 1:
            raise ValueError("ShardedOptimizer: the inner optimizer must have one parameter group")
        self.inner = probe if self.owned else None
        self.defaults = probe.defaults
        self.state = probe.state if self.owned else {}
        # A rank that owns nothing still carries the hyperparameters (a learning rate set on
        # them, state_dict's group).
        self.param_groups = probe.param_groups if self.owned else [
            {k: v for k, v in probe.param_groups[0].items() if k != "params"} | {"params": []}]
        self.allgather_bytes = 0  # received from the peers by step()'s all-gathers, cumulative
        # Per dtype, what step() shares: each rank's owned parameters of that dtype, their
        # element counts, and the padded width of one rank's part of the all-gather.
        self._shares = []
        for dtype in dict.fromkeys(p.dtype for p in self.params):
            per_rank = [[p for p in self.params[b:e] if p.dtype == dtype] for b, e in self.bounds]
            counts = [sum(p.numel() for p in ps) for ps in per_rank]
            if max(counts) > 0:
                self._shares.append((dtype, per_rank, counts, max(counts)))

    def add_param_group(self, param_group: dict) -> None:
        raise ValueError("ShardedOptimizer: parameters are partitioned at construction; build a new one "
                         "over every parameter instead of adding a group")

    def state_bytes(self) -> int:
        """Bytes of optimizer state this rank holds (tensors only)."""
        if self.inner is None:
            return 0
        return sum(v.numel() * v.element_size() for s in self.inner.state.values() for v in s.values()
                   if torch.is_tensor(v))

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.params:
            if set_to_none:
                p.grad = None
            elif p.grad is not None:
                p.grad.detach_().zero_()

    @torch.no_grad()
    def step(self, closure=None):
        if closure is not None:
            raise ValueError("ShardedOptimizer.step: a closure is not supported")
        if self.inner is not None:
            self.inner.step()
        if self.world_size > 1:
            self._share_updated()

    def _share_updated(self) -> None:
        """Every rank's owned parameters into every rank's copies: one all-gather per dtype."""
        for dtype, per_rank, counts, width in self._shares:
            send = self.params[0].new_zeros(width, dtype=dtype)
            mine = per_rank[self.rank]
            if mine:
                torch.cat([p.detach().reshape(-1) for p in mine], out=send[: counts[self.rank]])
            out = send.new_empty(self.world_size * width)
            all_gather_into(out, send, self.group, async_op=False)
            self.allgather_bytes += (self.world_size - 1) * send.numel() * send.element_size()
            for r, ps in enumerate(per_rank):
                if r == self.rank or not ps:
                    continue
                flat = out[r * width : r * width + counts[r]]
                for p, value in zip(ps, flat.split([p.numel() for p in ps])):
                    p.detach().copy_(value.view_as(p))

    def state_dict(self) -> dict:
        """The replicated optimizer's state dict over every parameter (a collective)."""
        begin, _ = self.bounds[self.rank]
        mine = {}
        if self.inner is not None:
            for j, entry in self.inner.state_dict()["state"].items():
                mine[begin + j] = {k: v.detach().cpu() if torch.is_tensor(v) else v for k, v in entry.items()}
        state = {}
        parts = exchange(mine, self.group, what="ShardedOptimizer.state_dict") if self.world_size > 1 else [mine]
        for part in parts:
            state.update(part)
        group = {k: v for k, v in self.param_groups[0].items() if k != "params"}
        group["params"] = list(range(len(self.params)))
        return {"state": {i: state[i] for i in sorted(state)}, "param_groups": [group]}

    def load_state_dict(self, state_dict: dict) -> None:
        """Take a state dict of the replicated form (every parameter, in order); keep this
        rank's entries."""
        groups = state_dict.get("param_groups")
        if not isinstance(groups, list) or len(groups) != 1 or len(groups[0].get("params", ())) != len(self.params):
            raise ValueError(f"ShardedOptimizer.load_state_dict: expected one parameter group of "
                             f"{len(self.params)} parameters")
        begin, end = self.bounds[self.rank]
        hyper = {k: v for k, v in groups[0].items() if k != "params"}
        if self.inner is None:
            self.param_groups[0].update(hyper)
            return
        state = state_dict.get("state", {})
        local = {"state": {i - begin: state[i] for i in range(begin, end) if i in state},
                 "param_groups": [hyper | {"params": list(range(end - begin))}]}
        self.inner.load_state_dict(local)
