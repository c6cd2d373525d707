"""Registering the frozen weights of one model: sharding them, checking that every rank wraps
the same weights under the same policy, and building the node's host store (ElasticRuntime's
registration, a mixin of runtime.py)."""

from __future__ import annotations

import torch

from ..distributed.agree import exchange
from ..distributed.collectives import header_channel
from ..host.sources import store_offsets
from ..host.store import build_node_host_store
from .tensor import ElasticTensor


class _Registration:
    """register, the ranks' agreement on what they wrap, the host store."""

    _KEY_BITS = 32  # key = wid << 32 | chunk

    def key(self, wid: int, chunk: int) -> int:
        return (wid << self._KEY_BITS) | chunk

    def register(self, weight: torch.Tensor, name: str, unit: str | None = None, rows=None) -> ElasticTensor:
        """Shard `weight` under the runtime. `unit` groups weights gathered together (see
        [Note: units and coalesced gathers]); None: the weight is its own unit. With `rows`
        (a callable reading rows [begin, end) of the weight), `weight` may be on the meta
        device and only this rank's rows are read."""
        if self.pool is not None:
            raise RuntimeError("ElasticRuntime.register: all weights must be registered before the first use")
        if weight.requires_grad:
            raise ValueError(
                f"{name} requires grad: only frozen weights go under the elastic runtime "
                "(freeze it with requires_grad_(False), or keep it trainable and replicated)"
            )
        if weight.dim() not in (1, 2):
            raise ValueError(f"{name}: expected a 1-D or 2-D frozen weight, got shape {tuple(weight.shape)}")
        if rows is None and weight.is_meta:
            raise ValueError(f"{name} is on the meta device: pass `rows` to read it from its file")
        et = ElasticTensor(self, len(self.tensors), name, weight, unit, rows)
        self.tensors.append(et)
        return et

    def _agreement(self) -> dict:
        # Timeouts may differ between ranks (each bounds its own waits); everything else must agree.
        policy = {k: v for k, v in vars(self.policy).items() if k not in ("collective_timeout_s", "host_setup_timeout_s")}
        return {"policy": policy, "weights": [et.signature() for et in self.tensors]}

    def check_ranks_agree(self) -> None:
        """Fail on every rank, naming the field and the ranks, unless every rank registered
        the same frozen weights (names, shapes, dtypes, chunk layout, residency, units and a
        fingerprint of their contents) under the same policy. One collective, at wrap time."""
        if self.world_size == 1:
            return
        mine = self._agreement()
        every = exchange(mine, self.group, timeout_s=self.policy.collective_timeout_s,
                         what="elastic: the wrap-time check of what every rank wraps")
        problems = []
        ref = every[0]
        for field, value in ref["policy"].items():
            differ = [r for r in range(self.world_size) if every[r]["policy"].get(field) != value]
            if differ:
                problems.append(f"policy field {field!r}: {value!r} on rank 0, "
                                f"{[every[r]['policy'].get(field) for r in differ]} on rank(s) {differ}")
        counts = [len(e["weights"]) for e in every]
        if len(set(counts)) > 1:
            problems.append(f"number of frozen weights: {counts} on ranks {list(range(self.world_size))}")
        else:
            for i, sig in enumerate(ref["weights"]):
                for field, value in sig.items():
                    differ = [r for r in range(self.world_size) if every[r]["weights"][i][field] != value]
                    if differ:
                        problems.append(f"frozen weight #{i} ({sig['name']}) {field}: {value!r} on rank 0, "
                                        f"{[every[r]['weights'][i][field] for r in differ]} on rank(s) {differ}")
                        break
                if len(problems) >= 3:
                    break
        if problems:
            raise ValueError(
                "elastic: the ranks do not agree on what they wrap (every rank must build the same model "
                "with the same weights and the same ElasticPolicy): " + "; ".join(problems[:3])
            )

    def finish_registration(self) -> None:
        """After the last `register`, on every rank: check that the ranks agree, then build the
        host store when the policy uses the host tier ([Note: chunk sources])."""
        self.check_ranks_agree()
        if self.world_size > 1 or self._force_pool:
            if self.comm_stream is None:  # host-waited gathers ([Note: headers off the prefetch path])
                self._channel = header_channel(self.group)
        if self.policy.uses_host_store and self.host_store is None:
            self._build_host_store()

    def _build_host_store(self) -> None:
        offsets, size = store_offsets(self.tensors)
        for et, off in zip(self.tensors, offsets):
            et.store_offset = off

        def fill(store, local_rank: int, local_world: int) -> None:
            # Each local rank writes its share of every weight, as stored ([Note: filling the
            # host store] in python_api/host/sources.py).
            for et in self.tensors:
                et.fill_host_share(store, local_rank, local_world)

        self.host_store, self.host_node = build_node_host_store(
            size, group=self.group, fill=fill, timeout_s=self.policy.collective_timeout_s, device=self.device,
            setup_timeout_s=self.policy.host_setup_timeout_s)
        for et in self.tensors:
            et._reader = None
