"""Activation offload: the activations the elastic LoRA layers save for backward go to a
bounded, recycled host buffer pool after forward and come back one layer ahead of backward.

    policy = ElasticPolicy(offload_activations=True, host_budget_bytes=2 << 30)
    model = convert_to_elastic(model, lora, policy)     # nothing else changes
    ...
    runtime_of(model).activation_offload.stats()         # d2h_bytes, h2d_bytes, host_pinned_bytes

The offloader is created lazily, by the first forward of an elastic LoRA layer whose runtime's
policy asks for it (`activation_offload_of`), and lives on the runtime as
`runtime.activation_offload`.

[Note: activation offload]
What moves. `ElasticLoRAFunction` saves lora_x (the input, or the dropped-out input), xa =
lora_x·Aᵀ and the dropout mask (the *activations*), and the adapters A and B (parameters:
never moved). After the layer's forward each activation is copied into a host buffer from
`HostBufferPool` and the layer drops its reference to the device tensor, which is then freed
unless something else holds it. An input shared by several layers (the normed hidden state
of q/k/v) is copied by each of them (no deduplication across layers): its device memory is
released once the last of them has offloaded its copy. Backward gets a fresh device tensor
with the original shape, dtype and strides (strides only when the tensor is non-overlapping
and dense, else contiguous; the values and hence the gradients are bit-identical).

When nothing moves (everything is saved as without offload):
- no autograd graph is built (no_grad, or no input requires grad: `ctx.next_functions` is
  empty): nothing is saved at all, so nothing is copied;
- a recompute: a forward inside backward ([Note: recompute inside backward] in
  python_api/runtime/_order.py)
  uses its saved tensors at once;
- saved-tensor hooks are active around the layer: non-reentrant checkpointing drops the
  tensors and recomputes them (offloading them would copy what is about to be discarded),
  `torch.autograd.graph.save_on_cpu` already moves them;
- torch.compile is tracing the function;
- the tensor is empty, or no buffer of its size class is free and a new one would take the
  pool past `host_budget_bytes` (the tensor then stays on the device: `kept_tensors`).

One layer ahead. Every layer that offloads something gets a handle (`_Offloaded`) holding a
weak reference to the handle of the layer that offloaded just before it, in forward order.
When the backward of the k-th asks for its tensors, its own copy-back is issued (unless the
(k+1)-th already did), then the copy-back of the (k-1)-th is started, so it runs while the
k-th layer's backward computes; the (k-1)-th then only waits for it. On CUDA every copy, D2H
and H2D, runs on the offloader's copy stream: a D2H waits for the compute stream by event
(`wait_stream`), an H2D result is handed to the compute stream by event (`wait_event`) and
`record_stream`; never a device or host synchronisation. On CPU the copies are synchronous
(the "prefetch" is simply done one layer early). The order is a heuristic for speed only:
a layer whose backward comes out of order finds its copy-back not started and issues it, and
with two graphs alive at once (two forwards before their backwards) the first layer of the
second links to the last of the first, whose copy-back then merely starts early.

Buffer lifetime. A handle returns its buffers to the pool as soon as its copy-back has been
issued (before the backward of its layer ends). Reusing a buffer is safe without a sync
because every write (D2H) and read (H2D) of a host buffer is on the one copy stream, so
stream order serialises them. A graph freed without backward (a forward run twice, a
backward that raised, a loss dropped) frees its nodes, hence their handles, whose `__del__`
returns the buffers. A second backward through the same graph (retain_graph=True) finds the
buffers gone and raises; offload_activations does not support retain_graph.

Pool. Buffers are flat uint8 tensors (pinned when the runtime's device is CUDA, so copies are
asynchronous DMA; plain CPU memory otherwise) in power-of-two size classes of at least
`MIN_HOST_BUFFER_BYTES`: a request takes a free buffer of its class, else allocates one if the
pool's held bytes (free + in use) stay within `host_budget_bytes`, else is refused. The pool
never evicts or borrows a buffer of another class: with a repeating sequence of requests
(every training step of a fixed shape) the first step allocates everything and every later
step is served from recycled buffers, and the tensors that stay on the device are the same
every step: in forward order, each one that found no free buffer of its class when the pool
was full. Power-of-two classes waste at most half of each buffer but recycle across
sequence lengths that round to the same class; `trim()` frees the free buffers when shapes
changed for good. `host_budget_bytes`: None is no cap, 0 offloads nothing, and a budget
between 0 and one smallest buffer (`MIN_HOST_BUFFER_BYTES`, one PagePool page alignment) can
hold nothing and is refused with a ValueError when the offloader is created (the first
forward, before that layer's first gather; `ElasticPolicy` refuses it already when offload is
on: `elastic_kernels.api.config.check_host_budget`).
Pinned allocations happen in the first step only (the caching host allocator may sync there).

Not measured yet: the overlap of the CUDA copies with the LoRA backward (CPU-only sessions so
far); the CPU tests check traffic, order, budget, lifetime and bit-parity.

[Note: returning buffers without a lock]
A handle's `__del__` returns its buffers, and `__del__` runs wherever its graph dies: also
inside a cyclic garbage collection, which CPython starts at *any* allocation of a container
object on the thread that allocates (a dead graph caught in a reference cycle is normal after
an exception in a step: OOM retries, automatic batch sizing). Had `release` taken the pool's
lock, a collection started by an allocation made while that lock is held would run `__del__`
on the same thread, which would wait for the lock forever (a `threading.Lock` is not
reentrant; an `RLock` would instead let `__del__` change the free lists in the middle of the
critical section). So:
- `release` takes no lock: it appends to a `collections.deque` (atomic under the GIL, and it
  allocates no object a collection counts);
- the buffers given back are filed into the free lists by the next `acquire`, `trim` or read of
  `held_bytes` / `in_use_bytes`, one buffer at a time under the lock;
- nothing inside the lock allocates a Python object: a new buffer is reserved under the lock
  (budget checked, bytes counted) and allocated after it is released (the reservation is
  undone if the allocation fails); a new size class's list and trim's new dict are made
  before the lock is taken. Only ints (which a collection never counts) are made inside.
Tested by forcing a collection at the pool's own allocation, and by running with a collection
at almost every container allocation (tests/host/test_activation_offload.py, in a child
process with a time bound).

[Note: the in-place check of offloaded tensors]
Autograd refuses a backward when a saved tensor was changed in place after it was saved ("one
of the variables needed for gradient computation has been modified by an inplace operation"):
it compares the version the tensor had when saved with its version counter now. An offloaded
tensor is saved as None, so that check would be lost: an in-place activation or
`Dropout(inplace=True)` applied to a layer's input after the layer ran would silently use the
old values on CPU, and on CUDA its kernel would race with the device-to-host copy. So each slot
records `t._version` at offload and keeps a *marker*: `t.detach()` (which shares t's version
counter) whose data is then replaced by an empty tensor (`.data =` keeps the version counter
and does not bump it), so the marker follows every in-place change of t and of its views
without keeping t's memory alive. `restore` compares before any copy-back and raises
autograd's error, in autograd's words, naming the layer.

[Note: trimming returns memory]
Freeing a host buffer does not give its memory back to the operating system: a pinned buffer
goes back to torch's caching host allocator (freed by `torch._C._host_emptyCache()`), a plain
one to the C library's heap (returned by glibc's `malloc_trim(0)`; large blocks are `mmap`ed
and unmapped at once only until glibc's adaptive threshold has grown past their size, which the
first freed buffer of that size does). `trim()` does both after dropping its free buffers.
Switching offload off (`ElasticRuntime.set_offload_activations(False)`, e.g. by a re-plan)
trims the pool and turns recycling off, so that buffers still held by live graphs are freed
when they come back instead of being kept.
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import functools
import threading
import weakref

import torch

from ..config import MIN_HOST_BUFFER_BYTES, check_host_budget

_ATTR = "activation_offload"  # the runtime attribute that holds the offloader
_CTX_ATTR = "_elastic_offloaded"  # the autograd ctx attribute that holds a layer's handle


def size_class(nbytes: int) -> int:
    """The capacity of the buffer serving `nbytes`: the next power of two, at least the minimum."""
    return max(MIN_HOST_BUFFER_BYTES, 1 << max(0, nbytes - 1).bit_length())


class HostBufferPool:
    """Bounded, recycled host buffers in power-of-two size classes ([Note: activation offload]).

    `held_bytes` (free + in use) never exceeds `budget_bytes` (None: no cap). Thread-safe: the
    autograd engine returns buffers from its device threads, `__del__` from wherever a graph
    dies ([Note: returning buffers without a lock])."""

    def __init__(self, budget_bytes: int | None, pin: bool):
        check_host_budget(budget_bytes)
        self.budget_bytes = budget_bytes
        self.pin = pin
        self._free: dict[int, list[torch.Tensor]] = {}
        self._lock = threading.Lock()  # the accounting below; no allocation while it is held
        self._returned: collections.deque[torch.Tensor] = collections.deque()  # given back, not yet filed
        self._held = 0  # capacity of every buffer the pool owns
        self._in_use = 0  # capacity of the buffers handed out and not yet filed back
        self._free_bytes = 0  # capacity of the buffers in the free lists
        self.allocations = 0  # buffers ever allocated (steady state: constant)
        self.recycle = True  # False: a returned buffer is freed, not kept (offload switched off)

    @property
    def held_bytes(self) -> int:
        self._file_returned()
        return self._held

    @property
    def in_use_bytes(self) -> int:
        self._file_returned()
        return self._in_use

    def idle_buffers(self) -> list[torch.Tensor]:
        """The buffers not in use now, those given back but not yet filed included: for a
        measurement that must tell the pool's host memory from device tensors on a CPU-only
        machine (python_api/planning/measure.py). Between steps only: no lock is taken."""
        self._file_returned()
        return [b for bufs in list(self._free.values()) for b in bufs]

    def acquire(self, nbytes: int) -> torch.Tensor | None:
        """A buffer of at least `nbytes` bytes, or None when the budget refuses a new one."""
        cap = size_class(nbytes)
        self._file_returned()
        with self._lock:  # [Note: returning buffers without a lock]: nothing allocated in here
            free = self._free.get(cap)
            if free:
                self._free_bytes -= cap
                self._in_use += cap
                return free.pop()
            if self.budget_bytes is not None and self._held + cap > self.budget_bytes:
                return None
            self._held += cap  # reserved: the allocation itself runs outside the lock
            self._in_use += cap
            self.allocations += 1
        try:
            return torch.empty(cap, dtype=torch.uint8, pin_memory=self.pin)
        except BaseException:
            with self._lock:
                self._held -= cap
                self._in_use -= cap
                self.allocations -= 1
            raise

    def release(self, buf: torch.Tensor) -> None:
        """Give `buf` back. Takes no lock and allocates no Python object, so it is safe from a
        `__del__` that a garbage collection runs anywhere, also inside this pool's own critical
        sections ([Note: returning buffers without a lock])."""
        self._returned.append(buf)

    def _file_returned(self) -> None:
        """Move the buffers given back into the free lists (or free them: `recycle` off)."""
        returned = self._returned
        while returned:
            try:
                buf = returned.popleft()
            except IndexError:  # another thread took the last one
                return
            cap = buf.numel()
            if not self.recycle:
                with self._lock:
                    self._in_use -= cap
                    self._held -= cap
                del buf  # freed here, outside the lock
                continue
            free = self._free.get(cap)
            if free is None:
                free = self._free.setdefault(cap, [])  # the new list is made before the lock is taken
            with self._lock:
                free.append(buf)  # may grow the list's array: not an object allocation, no collection
                self._free_bytes += cap
                self._in_use -= cap

    def trim(self) -> int:
        """Free every buffer not in use and give the memory back to the operating system
        ([Note: trimming returns memory]); returns the bytes freed."""
        self._file_returned()
        empty: dict[int, list[torch.Tensor]] = {}
        with self._lock:
            dropped, self._free = self._free, empty
            freed, self._free_bytes = self._free_bytes, 0
            self._held -= freed
        del dropped  # the buffers are freed here, outside the lock
        if freed:
            release_host_memory(self.pin)
        return freed


def release_host_memory(pinned: bool) -> None:
    """Give freed host buffers back to the operating system ([Note: trimming returns memory]):
    pinned ones sit in torch's caching host allocator until its cache is emptied, plain ones in
    the C library's heap until it is trimmed."""
    if pinned:
        empty_cache = getattr(torch._C, "_host_emptyCache", None)
        if empty_cache is not None:
            empty_cache()
        return
    libc = _libc()
    if libc is not None:
        libc.malloc_trim(0)


@functools.cache
def _libc():
    """glibc (for malloc_trim), or None where the C library has no malloc_trim (musl, macOS)."""
    try:
        libc = ctypes.CDLL(None)
        libc.malloc_trim.argtypes = [ctypes.c_size_t]
        libc.malloc_trim.restype = ctypes.c_int
    except (OSError, AttributeError):
        return None
    return libc


def _dense_strides(t: torch.Tensor) -> tuple[int, ...] | None:
    """t's strides when t is non-overlapping and dense (a permutation of a contiguous layout),
    else None (it is restored contiguous)."""
    dims = sorted((st, sz) for st, sz in zip(t.stride(), t.shape) if sz != 1)
    expected = 1
    for st, sz in dims:
        if st != expected:
            return None
        expected *= sz
    return tuple(t.stride())


class _Slot:
    """One offloaded tensor: where it was in the saved tuple, its host copy, its metadata, and
    its version at offload ([Note: the in-place check of offloaded tensors])."""

    __slots__ = ("index", "buf", "nbytes", "shape", "stride", "dtype", "device", "restored", "version", "marker")

    def __init__(self, index: int, buf: torch.Tensor, t: torch.Tensor):
        self.index, self.buf, self.nbytes = index, buf, t.nbytes
        self.shape, self.stride, self.dtype, self.device = t.shape, _dense_strides(t), t.dtype, t.device
        self.restored: torch.Tensor | None = None
        self.version = t._version
        self.marker = _version_marker(t)

    def host_view(self) -> torch.Tensor:
        return self.buf[: self.nbytes].view(self.dtype).view(self.shape)

    def check_version(self, what: str) -> None:
        """Raise autograd's error when the tensor was changed in place after it was offloaded."""
        now = self.marker._version
        if now != self.version:
            kind = torch.empty(0, dtype=self.dtype, device=self.device).type()
            raise RuntimeError(
                "one of the variables needed for gradient computation has been modified by an inplace "
                f"operation: [{kind} {list(self.shape)}] is at version {now}; expected version {self.version} "
                f"instead. Hint: it was saved for the backward of {what} and offloaded to host memory after "
                "that layer's forward (ElasticPolicy.offload_activations); an in-place operation (an in-place "
                "activation, Dropout(inplace=True), x.mul_(...)) changed it afterwards: make that operation out of "
                "place, as autograd would ask without offload."
            )


def _version_marker(t: torch.Tensor) -> torch.Tensor:
    """A tensor that shares `t`'s version counter but not its memory ([Note: the in-place check
    of offloaded tensors])."""
    marker = t.detach()  # shares t's version counter (and, for now, its storage)
    marker.data = torch.empty(0, dtype=t.dtype, device=t.device)  # drops the storage, keeps the counter
    return marker


class _Offloaded:
    """The activations one layer's forward offloaded; restored once by that layer's backward."""

    __slots__ = ("_owner", "_slots", "_prev", "_state", "_event", "__weakref__")

    OFFLOADED, COPYING_BACK, CONSUMED = range(3)

    def __init__(self, owner: ActivationOffload, slots: list[_Slot], prev):
        self._owner = owner
        self._slots = slots
        self._prev = prev  # weakref to the handle offloaded just before this one, or None
        self._state = self.OFFLOADED
        self._event = None

    def _copy_back(self) -> None:
        """Issue the H2D copies of every slot and give the buffers back to the pool (safe at
        once: the next write of a buffer is a D2H on the same copy stream)."""
        owner = self._owner
        stream = owner.copy_stream
        ctx = torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()
        with ctx:
            for s in self._slots:
                dev = (torch.empty_strided(s.shape, s.stride, dtype=s.dtype, device=s.device) if s.stride is not None
                       else torch.empty(s.shape, dtype=s.dtype, device=s.device))
                dev.copy_(s.host_view(), non_blocking=stream is not None)
                s.restored = dev
                owner._count("h2d_bytes", s.nbytes)
            if stream is not None:
                self._event = torch.cuda.Event()
                self._event.record(stream)
        for s in self._slots:
            owner.pool.release(s.buf)
            s.buf = None
        self._state = self.COPYING_BACK

    def restore(self, saved: tuple, what: str = "an elastic LoRA layer") -> tuple:
        """`saved` (ctx.saved_tensors, offloaded positions None) with the activations back on
        the device; starts the copy-back of the previous layer's handle ([Note: activation
        offload]). Raises autograd's error when an offloaded tensor was changed in place since
        ([Note: the in-place check of offloaded tensors]); `what` names the layer in it."""
        if self._state == self.CONSUMED:
            raise RuntimeError(
                "elastic activation offload: this layer's offloaded activations were already used by a "
                "backward and their host buffers recycled; a second backward through the same graph "
                "(retain_graph=True) is not supported with ElasticPolicy.offload_activations"
            )
        for s in self._slots:
            s.check_version(what)
        if self._state == self.OFFLOADED:
            self._copy_back()
        prev = self._prev() if self._prev is not None else None
        if prev is not None and prev._state == self.OFFLOADED:
            with torch.profiler.record_function("elastic::activation_prefetch"):
                prev._copy_back()
        out = list(saved)
        stream = self._owner.copy_stream
        if stream is not None:
            compute = torch.cuda.current_stream(self._slots[0].device)
            compute.wait_event(self._event)
        for s in self._slots:
            if stream is not None:
                s.restored.record_stream(compute)
            out[s.index] = s.restored
            s.restored = None
        self._state = self.CONSUMED
        self._slots = []
        return tuple(out)

    def release(self) -> None:
        """Give back whatever this handle still holds (its graph died without its backward)."""
        pool = self._owner.pool
        for s in self._slots:
            if s.buf is not None:
                pool.release(s.buf)
                s.buf = None
            s.restored = None
        self._slots = []
        self._state = self.CONSUMED

    def __del__(self):
        try:
            self.release()
        except Exception:  # noqa: BLE001 - interpreter shutdown: the pool may be gone already
            pass


def _saved_tensor_hooks_active() -> bool:
    """Saved-tensor hooks (non-reentrant checkpointing, save_on_cpu, a user's) are in effect."""
    top = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
    return top is not None and top(False) is not None


class ActivationOffload:
    """Offloads the activations elastic LoRA layers save for backward ([Note: activation
    offload]). One per runtime: `activation_offload_of(runtime)`."""

    def __init__(self, runtime):
        policy = runtime.policy
        check_host_budget(policy.host_budget_bytes)
        self.device = torch.device(runtime.device)
        cuda = self.device.type == "cuda"
        self.pool = HostBufferPool(policy.host_budget_bytes, pin=cuda)
        # The activation copy stream: every D2H (after a layer's forward) and H2D (one layer
        # ahead of its backward) of activations runs here, overlapped with compute, and host
        # buffer reuse is ordered by this stream alone. Not the runtime's `copy_stream` (host
        # store -> pool pages): the weights' H2D and the activations' D2H then queue on
        # separate streams and can use the two copy directions at once.
        self.copy_stream = torch.cuda.Stream(self.device) if cuda else None
        self._last = None  # weakref to the handle of the last layer that offloaded
        self._stats = {"d2h_bytes": 0, "h2d_bytes": 0, "offloaded_tensors": 0, "kept_tensors": 0}
        self._stats_lock = threading.Lock()

    # ------------------------------------------------------------------ stats

    def _count(self, key: str, n: int) -> None:
        with self._stats_lock:
            self._stats[key] += n

    def stats(self, detail: bool = False) -> dict:
        """d2h_bytes / h2d_bytes: activation bytes copied device->host / host->device (cumulative);
        host_pinned_bytes: bytes of host buffers the pool holds now (pinned on CUDA, plain CPU
        memory otherwise). `detail` adds offloaded_tensors, kept_tensors (refused by the budget),
        host_in_use_bytes and host_allocations."""
        out = {"d2h_bytes": self._stats["d2h_bytes"], "h2d_bytes": self._stats["h2d_bytes"],
               "host_pinned_bytes": self.pool.held_bytes}
        if detail:
            out.update(offloaded_tensors=self._stats["offloaded_tensors"], kept_tensors=self._stats["kept_tensors"],
                       host_in_use_bytes=self.pool.in_use_bytes, host_allocations=self.pool.allocations)
        return out

    def reset_stats(self) -> None:
        with self._stats_lock:
            for k in self._stats:
                self._stats[k] = 0

    # ------------------------------------------------------------------ offload

    @staticmethod
    def wants(ctx, recompute: bool) -> bool:
        """Should the activations this forward saves be offloaded? ([Note: activation offload])
        `recompute`: the forward runs inside backward (the runtime's `in_backward()`)."""
        return (
            bool(ctx.next_functions)  # empty when apply builds no graph (no_grad, nothing requires grad)
            and not recompute
            and not _saved_tensor_hooks_active()
            and not torch.compiler.is_compiling()
        )

    def offload(self, tensors: tuple, activations: tuple[int, ...]) -> tuple[tuple, _Offloaded | None]:
        """Copy each of `tensors[i]`, i in `activations`, into a host buffer; returns the tuple
        to save on the device (None where offloaded) and the handle (None when nothing was
        offloaded)."""
        slots: list[_Slot] = []
        kept = list(tensors)
        stream = self.copy_stream
        with torch.profiler.record_function("elastic::activation_offload"):
            if stream is not None:
                stream.wait_stream(torch.cuda.current_stream(self.device))
            ctx = torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()
            with ctx:
                for i in activations:
                    t = tensors[i]
                    if t is None or t.numel() == 0:
                        continue
                    buf = self.pool.acquire(t.nbytes)
                    if buf is None:
                        self._count("kept_tensors", 1)
                        continue
                    slot = _Slot(i, buf, t)
                    slot.host_view().copy_(t, non_blocking=stream is not None)
                    if stream is not None:
                        t.record_stream(stream)  # the copy reads t: not reused before it is done
                    slots.append(slot)
                    kept[i] = None
                    self._count("d2h_bytes", t.nbytes)
                    self._count("offloaded_tensors", 1)
        if not slots:
            return tuple(kept), None
        handle = _Offloaded(self, slots, self._last)
        self._last = weakref.ref(handle)
        return tuple(kept), handle

    def trim(self) -> int:
        """Free the host buffers not in use and return their memory to the OS; the bytes freed."""
        return self.pool.trim()

    def set_enabled(self, enabled: bool) -> None:
        """Offload switched on or off (`ElasticRuntime.set_offload_activations`): off frees every
        buffer not in use now and every buffer a live graph gives back later ([Note: trimming
        returns memory]); on recycles them again."""
        self.pool.recycle = enabled
        if not enabled:
            self.pool.trim()


def activation_offload_of(runtime) -> ActivationOffload | None:
    """The runtime's offloader, created on first use when its policy offloads activations;
    None otherwise. Creation validates the host budget (a clear ValueError before any work)."""
    if not runtime.policy.offload_activations:  # off (or switched off: set_offload_activations)
        return None
    off = getattr(runtime, _ATTR, None)
    if off is None:
        off = ActivationOffload(runtime)
        setattr(runtime, _ATTR, off)
    return off


def offload_stats(runtime) -> dict:
    """The runtime's activation offload counters (`ActivationOffload.stats`), zeros when no
    offloader exists (offload off, or no forward yet): for merging into the runtime's stats."""
    off = getattr(runtime, _ATTR, None)
    return off.stats() if off is not None else {"d2h_bytes": 0, "h2d_bytes": 0, "host_pinned_bytes": 0}


_observers: list = []  # observe_activations: callables (tensors, activations) -> None


@contextlib.contextmanager
def observe_activations(fn):
    """Inside, every `save_for_backward` below first calls `fn(tensors, activations)`: the
    tensors an elastic LoRA layer saves and the positions of its activations (what offload
    would copy). For measuring a profile (python_api/planning/measure.py); on this thread's
    forwards, one observer at a time."""
    _observers.append(fn)
    try:
        yield
    finally:
        _observers.remove(fn)


def save_for_backward(ctx, offload: ActivationOffload | None, tensors: tuple, activations: tuple[int, ...],
                      recompute: bool = False) -> None:
    """`ctx.save_for_backward(*tensors)`, with the tensors at positions `activations` offloaded
    when `offload` is set and wants them ([Note: activation offload]; an offloaded position is
    saved as None); read back, in the same order, with `saved_for_backward(ctx)`. `recompute`:
    the forward runs inside backward (nothing is offloaded then)."""
    for fn in _observers:
        fn(tensors, activations)
    handle = None
    if offload is not None and offload.wants(ctx, recompute):
        tensors, handle = offload.offload(tensors, activations)
    ctx.save_for_backward(*tensors)
    setattr(ctx, _CTX_ATTR, handle)


def saved_for_backward(ctx) -> tuple:
    """The tensors given to `save_for_backward`, activations back on the device."""
    saved = ctx.saved_tensors
    handle = getattr(ctx, _CTX_ATTR, None)
    if handle is None:
        return saved
    et = getattr(ctx, "et", None)
    return handle.restore(saved, what=et.name if et is not None else "an elastic LoRA layer")
