"""Gradient reduction of the replicated trainable parameters (the adapters): averaged across
the group once per step, in buckets reduced while backward runs (ElasticRuntime's gradients,
a mixin of runtime.py).

[Note: gradient accumulation]
With `policy.all_reduce_grads` the adapter gradients are averaged across the group in every
backward. Over k micro-batches that is k all-reduces of every adapter gradient where one
suffices: averaging is linear, so mean_r(sum_i g_ri) = sum_i mean_r(g_ri) up to rounding.
`no_sync()` skips the reduction for the backward passes run inside it (their gradients
accumulate locally in .grad); the backward of the last micro-batch, run outside, averages the
accumulated sums once. Every rank must use the same micro-batch count, or the ranks issue
different numbers of all-reduces (a collective mismatch, as with DDP's no_sync).

[Note: gradient buckets]
The idea of DDP's reducer, for the adapters. `set_trainable` cuts the trainable parameters,
in reverse registration order (the order a layered model's backward produces their
gradients), into buckets of at most `policy.grad_bucket_bytes` of one dtype and device
(None: one bucket per dtype). A post-accumulate-grad hook marks a parameter ready once its
gradient for this backward is accumulated; when every parameter of a bucket is ready and
every bucket before it has been launched, its gradients are concatenated and all-reduced
asynchronously (gloo's worker thread, or NCCL's stream) while backward goes on. Buckets are
launched strictly in index order, so every rank issues the same all-reduces in the same
order whatever the order its hooks fire in. At the end of backward the buckets not launched
yet (a parameter without a gradient this step) are launched with the gradients that exist,
all are waited for in index order (bounded by `collective_timeout_s`), divided by the world
size and copied back into `.grad`: one all-reduce per bucket per step.
- Identical to the former single all-reduce per dtype: each element is the sum of the same
  per-rank values divided by the world size. On 2 ranks the sum of two values does not depend
  on the buffer it is in, so the gradients are bit-identical (tests/runtime/test_grad_buckets.py
  compares bit for bit with a concatenated all-reduce); on more ranks gloo's ring may add the
  ranks' values in an order that depends on the element's offset in its buffer, so they agree
  to fp32 rounding.
- A parameter whose gradient is accumulated again after its bucket was launched (a weight
  used by two reentrant checkpointed segments) makes that bucket stale: its result is
  discarded and it is reduced again at the end of backward from the final gradients.
- A backward that raised leaves launched buckets in flight: the next forward waits for them
  and discards them (`_reset_grad_round`), as every rank launched the same ones.
- Gradient accumulation: inside `no_sync()` no hook launches anything; the last
  micro-batch's backward reduces the accumulated sums as above.

[Note: gradients absent on some ranks]
Above, a bucket reduces the gradients that exist on the launching rank. That is
collective-consistent only when every rank has the same parameters with a gradient. With
several named adapters on one model ([Note: many adapters on one base] in
python_api/nn/lora.py) an adapter may have rows in one rank's batch and none in another's:
its parameters have a gradient on the first rank only, the buffers would differ in size and
the all-reduce would fail or mix elements. So a model converted with named adapters sets
`set_trainable(..., absent_grads=True)`, and then every bucket reduces all of its parameters
in its fixed order, a parameter without a gradient contributing zeros, followed by one
presence flag per parameter (1 where this rank has a gradient, else 0) in the same buffer:
one all-reduce per bucket, as before, with the same size on every rank. After it, a
parameter whose flags sum to more than 0 gets the average (created when this rank had no
gradient: its zeros plus the others' values, divided by the world size, as an absent
adapter contributes nothing to the average); one no rank had a gradient for keeps `.grad`
None, so its optimizer does not step it (AdamW skips a parameter whose grad is None: no
decay, no moment update). The flags are sums of 0/1 of at most the world size: any float
dtype tells > 0 exactly.
The buckets are then all launched at the end of backward, none from a hook: the gradient
hooks fire at points that depend on which adapters have rows on the rank, and a bucket
all-reduce launched from one on a single rank would sit, on the runtime's group, between
two weight gathers that the other ranks issue back to back (the gathers' headers share the
group: [Note: headers off the prefetch path] in python_api/distributed/collectives.py), a
collective mismatch that hangs (it did, in tests/nn/test_multi_adapter.py, before this
rule). The end of backward is the same point of the program on every rank. The cost: the
adapter gradients' all-reduce no longer overlaps backward (adapters are small next to the
frozen weights). Without named adapters
(`absent_grads=False`) nothing changes.
"""

from __future__ import annotations

import datetime
import weakref
from contextlib import contextmanager

import torch
import torch.distributed as dist
from torch.profiler import record_function

from .tensor import Phase


class _Bucket:
    """Parameters reduced together; `flat` and `work` while its all-reduce is in flight."""

    __slots__ = ("params", "index", "ready", "flat", "work", "members", "stale")

    def __init__(self, index: int, params: list[torch.nn.Parameter]):
        self.index = index
        self.params = params
        self.ready = 0
        self.flat = None
        self.work = None
        self.members: list[torch.nn.Parameter] = []  # the parameters in flat, in order
        self.stale = False

    @property
    def launched(self) -> bool:
        return self.flat is not None


def make_buckets(params: list[torch.nn.Parameter], cap: int | None) -> list[list[torch.nn.Parameter]]:
    """Parameters in reverse order, cut into runs of one dtype and device of at most `cap`
    bytes (at least one parameter each); None: one bucket per dtype and device."""
    out: list[list[torch.nn.Parameter]] = []
    if cap is None:
        by_kind: dict = {}
        for p in reversed(params):
            by_kind.setdefault((p.dtype, p.device), []).append(p)
        return list(by_kind.values())
    size = 0
    for p in reversed(params):
        b = p.numel() * p.element_size()
        if out and (out[-1][0].dtype, out[-1][0].device) == (p.dtype, p.device) and size + b <= cap:
            out[-1].append(p)
            size += b
        else:
            out.append([p])
            size = b
    return out


class _GradReduction:
    """set_trainable, no_sync, the gradient buckets, the end-of-backward callback, set_grad_reduction."""

    def set_trainable(self, params: list[torch.nn.Parameter], absent_grads: bool = False) -> None:
        """Replicated trainable parameters whose gradients are averaged once per backward
        ([Note: gradient buckets]). `absent_grads`: some may have no gradient on some ranks
        ([Note: gradients absent on some ranks])."""
        self._reset_grad_round()
        self._absent_grads = absent_grads
        for h in self._grad_hooks:
            h.remove()
        self._grad_hooks = []
        self._grad_params = list(dict.fromkeys(params))
        self._buckets = [_Bucket(i, ps) for i, ps in enumerate(make_buckets(self._grad_params,
                                                                            self.policy.grad_bucket_bytes))]
        self._bucket_of = {id(p): b for b in self._buckets for p in b.params}
        # A weak reference: the hook lives in the parameter's autograd metadata, out of the
        # garbage collector's sight ([Note: closing a runtime] in runtime.py).
        ref = weakref.ref(self)

        def ready(p, ref=ref):
            rt = ref()
            if rt is not None:
                rt._grad_ready(p)

        for p in self._grad_params:
            self._grad_hooks.append(p.register_post_accumulate_grad_hook(ready))

    def _drop_grad_state(self) -> None:
        """close(): no bucket outlives the runtime's use."""
        self._reset_grad_round()
        self._buckets = []
        self._bucket_of = {}

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

    def _reducing(self) -> bool:
        return self._reduce_grads and self._sync_grads and self.world_size > 1

    def _grad_ready(self, p: torch.nn.Parameter) -> None:
        """The post-accumulate-grad hook of a trainable parameter."""
        self._queue_end_of_backward()
        if not self._reducing() or getattr(self, "_absent_grads", False):
            return  # [Note: gradients absent on some ranks]: every bucket at the end of backward
        bucket = self._bucket_of.get(id(p))
        if bucket is None:
            return
        if id(p) in self._params_ready:
            if bucket.launched:
                bucket.stale = True  # accumulated again after its launch: redone at the end
            return
        self._params_ready.add(id(p))
        bucket.ready += 1
        while self._next_bucket < len(self._buckets):
            b = self._buckets[self._next_bucket]
            if b.ready < len(b.params):
                break
            with self._device_guard():
                self._launch_bucket(b)
            self._buckets_launched_in_backward += 1
            self._next_bucket += 1

    def _launch_bucket(self, bucket: _Bucket) -> None:
        if getattr(self, "_absent_grads", False):  # [Note: gradients absent on some ranks]
            bucket.members = list(bucket.params)
            with record_function("elastic::all_reduce_grads"):
                p0 = bucket.params[0]
                parts = [p.grad.reshape(-1) if p.grad is not None else p.new_zeros(p.numel()) for p in bucket.params]
                flags = torch.tensor([float(p.grad is not None) for p in bucket.params], dtype=p0.dtype)
                bucket.flat = torch.cat(parts + [flags.to(p0.device)])
                bucket.work = dist.all_reduce(bucket.flat, group=self.group, async_op=True)
            return
        bucket.members = [p for p in bucket.params if p.grad is not None]
        if not bucket.members:
            bucket.flat = torch.empty(0)  # launched, nothing to reduce (no gradient on any rank)
            return
        with record_function("elastic::all_reduce_grads"):
            bucket.flat = torch.cat([p.grad.reshape(-1) for p in bucket.members])
            bucket.work = dist.all_reduce(bucket.flat, group=self.group, async_op=True)

    def _wait_bucket(self, bucket: _Bucket) -> None:
        work, bucket.work = bucket.work, None
        if work is None:
            return
        timeout = self.policy.collective_timeout_s
        try:
            with record_function("elastic::all_reduce_grads_wait"):
                if timeout is None or self.comm_stream is not None:
                    work.wait()  # NCCL: the compute stream waits; the process group's timeout bounds it
                else:
                    work.wait(datetime.timedelta(seconds=timeout))
        except Exception as exc:  # noqa: BLE001 - re-raised with context
            del work  # [Note: nothing outlives its step] in python_api/distributed/collectives.py
            bucket.flat = None
            raise RuntimeError(
                f"elastic: the all-reduce of adapter gradients (bucket {bucket.index} of {len(self._buckets)}) "
                f"failed or timed out (timeout {timeout} s); a peer rank probably failed: {exc}") from exc

    def _reset_grad_round(self) -> None:
        """Forget this step's readiness; buckets still in flight (a backward that raised) are
        waited for and discarded ([Note: gradient buckets])."""
        for b in getattr(self, "_buckets", []):
            try:
                self._wait_bucket(b)
            except RuntimeError:
                pass  # the failure was the backward's; nothing of it is applied
            b.ready, b.flat, b.members, b.stale = 0, None, [], False
        self._params_ready = set()
        self._next_bucket = 0

    def _all_reduce_grads(self) -> None:
        """End of backward: launch what is left, wait for every bucket, apply the averages."""
        try:
            for b in self._buckets[self._next_bucket:]:
                self._launch_bucket(b)
            self._next_bucket = len(self._buckets)
            for b in self._buckets:
                self._wait_bucket(b)
                if b.stale:
                    b.flat = None
                    self._launch_bucket(b)
                    self._wait_bucket(b)
                offset = 0
                with record_function("elastic::all_reduce_grads_apply"):
                    b.flat.div_(self.world_size)
                    if getattr(self, "_absent_grads", False):
                        self._apply_with_flags(b)
                        continue
                    for p in b.members:
                        n = p.grad.numel()
                        p.grad.copy_(b.flat[offset: offset + n].view_as(p.grad))
                        offset += n
        finally:
            self._reset_grad_round()

    def _apply_with_flags(self, b: _Bucket) -> None:
        """[Note: gradients absent on some ranks]: the averages of the parameters some rank
        had a gradient for; the others keep .grad None."""
        flags = b.flat[b.flat.numel() - len(b.members):]
        present = (flags > 0).tolist()
        offset = 0
        for p, here in zip(b.members, present):
            n = p.numel()
            if here:
                avg = b.flat[offset: offset + n].view_as(p)
                if p.grad is None:
                    p.grad = avg.clone()
                else:
                    p.grad.copy_(avg)
            offset += n

    def _queue_end_of_backward(self) -> None:
        if self._end_of_backward_queued:
            return
        self._end_of_backward_queued = True
        torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)

    def _end_of_backward(self) -> None:
        self._end_of_backward_queued = False
        if self.phase is Phase.BACKWARD:
            self._finish_phase()
        if self._reducing():
            with self._device_guard():
                self._all_reduce_grads()
        else:
            self._reset_grad_round()

    def set_grad_reduction(self, enabled: bool | None) -> None:
        """Turn the per-backward gradient averaging on or off (None: the policy's
        `all_reduce_grads`), e.g. off while DDP averages the same gradients. On every rank."""
        self._reduce_grads = self.policy.all_reduce_grads if enabled is None else bool(enabled)

    @property
    def reduces_grads(self) -> bool:
        return self._reduce_grads
