"""Gradient reduction of the replicated trainable parameters (the adapters): averaged across
the group once per step, at the end of backward (ElasticRuntime's gradients, a mixin of
runtime.py).

[Note: gradient accumulation]
With `policy.all_reduce_grads` the adapter gradients are averaged across the group at the end
of every backward. Over k micro-batches that is k all-reduces of every adapter gradient where
one suffices: averaging is linear, so mean_r(sum_i g_ri) = sum_i mean_r(g_ri) up to rounding.
`no_sync()` skips the reduction for the backward passes run inside it (their gradients
accumulate locally in .grad); the backward of the last micro-batch, run outside, averages the
accumulated sums once. Every rank must use the same micro-batch count, or the ranks issue
different numbers of all-reduces (a collective mismatch, as with DDP's no_sync).
"""

from __future__ import annotations

import weakref
from contextlib import contextmanager

import torch
import torch.distributed as dist
from torch.profiler import record_function

from .tensor import Phase


class _GradReduction:
    """set_trainable, no_sync, the end-of-backward callback, set_grad_reduction."""

    def set_trainable(self, params: list[torch.nn.Parameter]) -> None:
        """Replicated trainable parameters whose gradients are averaged at the end of backward."""
        for h in self._grad_hooks:
            h.remove()
        self._grad_hooks = []
        self._grad_params = list(params)
        # A weak reference: the hook lives in the parameter's autograd metadata, out of the
        # garbage collector's sight ([Note: closing a runtime] in runtime.py).
        ref = weakref.ref(self)

        def ready(p, ref=ref):
            rt = ref()
            if rt is not None:
                rt._queue_end_of_backward()

        for p in self._grad_params:
            self._grad_hooks.append(p.register_post_accumulate_grad_hook(ready))

    def _drop_grad_state(self) -> None:
        """close(): nothing to drop yet beyond the hooks."""

    @contextmanager
    def no_sync(self):
        """Backward passes run inside this context leave the gradients of the trainable
        parameters unreduced (local sums); the first backward after it averages the
        accumulated sums. See [Note: gradient accumulation]. Enter it on every rank alike."""
        previous = self._sync_grads
        self._sync_grads = False
        try:
            yield
        finally:
            self._sync_grads = previous

    def _all_reduce_grads(self) -> None:
        grads = [p.grad for p in self._grad_params if p.grad is not None]
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for g in grads:
            by_dtype.setdefault(g.dtype, []).append(g)
        with record_function("elastic::all_reduce_grads"):
            for gs in by_dtype.values():
                flat = torch.cat([g.reshape(-1) for g in gs])
                dist.all_reduce(flat, group=self.group)
                flat.div_(self.world_size)
                offset = 0
                for g in gs:
                    g.copy_(flat[offset : offset + g.numel()].view_as(g))
                    offset += g.numel()

    def _queue_end_of_backward(self) -> None:
        if self._end_of_backward_queued:
            return
        self._end_of_backward_queued = True
        torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)

    def _end_of_backward(self) -> None:
        self._end_of_backward_queued = False
        if self.phase is Phase.BACKWARD:
            self._finish_phase()
        if self._reduce_grads and self._sync_grads and self.world_size > 1:
            with self._device_guard():
                self._all_reduce_grads()

    def set_grad_reduction(self, enabled: bool | None) -> None:
        """Turn the end-of-backward gradient averaging on or off (None: the policy's
        `all_reduce_grads`), e.g. off while DDP averages the same gradients. On every rank."""
        self._reduce_grads = self.policy.all_reduce_grads if enabled is None else bool(enabled)

    @property
    def reduces_grads(self) -> bool:
        return self._reduce_grads
