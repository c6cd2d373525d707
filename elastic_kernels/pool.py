"""Python face of the page pool (``csrc/pool/``): the persistent frozen-weight cache.

A :class:`PagePool` hands out fixed-size pages (1-D ``uint8`` tensors of ``page_bytes``)
carved out of a few large torch allocations on one device, keyed by an ``int`` the runtime
chooses (weight id and chunk index). Pages are evicted by (priority, least recently used) when
the budget is full; the budget can shrink and grow at any time; on CUDA a freed page is reused
only after the streams that used it are done with it. The design notes are ``[Note: ...]``
blocks in ``csrc/pool/page_pool.cpp``:

- ``[Note: page pool layout]``: segments, slots, the segment size policy, placement;
- ``[Note: eviction order]``: what counts as a use, over-budget behaviour;
- ``[Note: no relocation]``: why a shrink never moves live pages, and ``evict_to_release``;
- ``[Note: stream-ordered reuse]``: events, cross-stream hand-out, releasing segments;
- ``[Note: locking and the GIL]`` and ``[Note: errors leave the pool unchanged]``.

Errors: a missing (or already present) key raises ``KeyError``; other bad input
``ValueError`` (``IndexError`` for a bad slot); no page with everything pinned
:class:`PoolExhausted`. After an error the pool is as it was before the call.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

import torch

from elastic_kernels import _ext

__all__ = ["PagePool", "PoolExhausted", "view"]


class PoolExhausted(RuntimeError):
    """No page can be found: the budget is full and every page in it is pinned."""


def view(page: torch.Tensor, dtype: torch.dtype, shape: int | Sequence[int]) -> torch.Tensor:
    """Reinterpret the first ``prod(shape) * dtype.itemsize`` bytes of ``page`` as a tensor.

    ``page`` is a 1-D contiguous ``uint8`` tensor (a pool page); the result shares its memory.
    Raises ``TypeError``/``ValueError`` when the arguments are not of that kind, the chunk does
    not fit in the page, or the page's address is not a multiple of the dtype's size.
    """
    if not isinstance(page, torch.Tensor):
        raise TypeError(f"view: page must be a torch.Tensor, got {type(page).__name__}")
    if page.dtype != torch.uint8 or page.dim() != 1 or not page.is_contiguous():
        raise ValueError(
            f"view: page must be a 1-D contiguous uint8 tensor, got dtype {page.dtype}, "
            f"shape {tuple(page.shape)}, stride {page.stride()}"
        )
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"view: dtype must be a torch.dtype, got {dtype!r}")
    dims = (shape,) if isinstance(shape, int) else tuple(shape)
    for d in dims:
        if not isinstance(d, int) or isinstance(d, bool) or d < 0:
            raise ValueError(f"view: shape must be non-negative ints, got {shape!r}")
    itemsize = dtype.itemsize
    nbytes = math.prod(dims) * itemsize
    if nbytes > page.numel():
        raise ValueError(
            f"view: a {dims} tensor of {dtype} needs {nbytes} bytes, the page has {page.numel()}"
        )
    if page.data_ptr() % itemsize:
        raise ValueError(
            f"view: the page starts at address {page.data_ptr():#x}, not aligned to the "
            f"{itemsize}-byte elements of {dtype}"
        )
    return page[:nbytes].view(dtype).view(dims)


def _check_size(name: str, value) -> int:
    if not isinstance(value, int) or isinstance(value, bool):
        raise TypeError(f"PagePool: {name} must be an int, got {type(value).__name__}")
    return value


class PagePool:
    """Paged caching allocator on one device (``"cpu"`` or ``"cuda[:i]"``).

    ``page_bytes`` is a positive multiple of 512; ``budget_bytes`` at least one page. Pages
    are taken from segments (one ``torch.empty`` each) of up to
    ``max(1, segment_bytes // page_bytes)`` pages (``segment_bytes`` defaults to 64 MiB),
    added lazily and never past the budget; ``close()`` (or leaving a ``with`` block) gives
    every segment back. Thread-safe.
    """

    __slots__ = ("_impl", "_device", "__weakref__")

    view = staticmethod(view)

    def __init__(
        self,
        page_bytes: int,
        budget_bytes: int,
        device: torch.device | str = "cpu",
        *,
        segment_bytes: int | None = None,
    ):
        _check_size("page_bytes", page_bytes)
        _check_size("budget_bytes", budget_bytes)
        if segment_bytes is not None:
            _check_size("segment_bytes", segment_bytes)
        dev = torch.device(device)
        if dev.type == "cuda" and dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
        elif dev.type not in ("cpu", "cuda"):
            raise ValueError(f"PagePool: device must be cpu or cuda, got {dev}")
        _C = _ext.require()
        if segment_bytes is None:  # the C++ default (64 MiB), kept in one place
            self._impl = _C.PagePool(page_bytes, budget_bytes, str(dev))
        else:
            self._impl = _C.PagePool(page_bytes, budget_bytes, str(dev), segment_bytes)
        self._device = dev

    # ---- properties ----

    @property
    def page_bytes(self) -> int:
        return self._impl.page_bytes

    @property
    def budget_bytes(self) -> int:
        return self._impl.budget_bytes

    @property
    def device(self) -> torch.device:
        return self._device

    @property
    def pages_per_segment(self) -> int:
        return self._impl.pages_per_segment

    @property
    def closed(self) -> bool:
        return self._impl.closed

    # ---- single pages ----

    def allocate(self, key: int) -> torch.Tensor:
        """A new unpinned page for ``key`` (evicting if the budget is full)."""
        return self._impl.allocate(key, False)

    def allocate_pinned(self, key: int) -> torch.Tensor:
        """``allocate(key)`` and ``pin(key)`` in one call."""
        return self._impl.allocate(key, True)

    def get(self, key: int) -> torch.Tensor | None:
        """The page of ``key`` or None; counts a hit or a miss and marks the page used."""
        return self._impl.get(key)

    def slot(self, key: int) -> int:
        """The slot of ``key``'s page, or -1; no hit/miss counting, not a use."""
        return self._impl.slot(key)

    def contains(self, key: int) -> bool:
        """Whether ``key`` has a page; no hit/miss counting, not a use."""
        return self._impl.contains(key)

    __contains__ = contains

    def free(self, key: int) -> None:
        """Give ``key``'s page back (it must not be pinned)."""
        self._impl.free(key)

    def pin(self, key: int) -> None:
        """Keep ``key``'s page from eviction; pins are counted."""
        self._impl.pin(key)

    def unpin(self, key: int) -> None:
        """Undo one ``pin``; the last one makes the page evictable (and evicts, if the pool is
        over its budget: [Note: eviction order])."""
        self._impl.unpin(key)

    def pin_count(self, key: int) -> int:
        return self._impl.pin_count(key)

    def priority(self, key: int) -> int:
        return self._impl.priority(key)

    def set_priority(self, key: int, priority: int) -> None:
        """Higher priority pages are kept longer (default 0); not a use of the page."""
        self._impl.set_priority(key, priority)

    def record_stream(self, key: int, stream) -> None:
        """On a CUDA pool: ``stream`` (a ``torch.cuda.Stream``) uses ``key``'s page, so a later
        free or eviction hands the page out again only after the work queued on ``stream``
        by then completes. On a CPU pool only the key is checked."""
        if self._device.type != "cuda":
            self._impl.record_stream(key, 0)
            return
        handle = getattr(stream, "cuda_stream", None)
        if handle is None:
            raise TypeError(f"PagePool.record_stream: expected a torch.cuda.Stream, got {type(stream).__name__}")
        if torch.device(stream.device) != self._device:
            raise ValueError(f"PagePool.record_stream: stream is on {stream.device}, the pool on {self._device}")
        self._impl.record_stream(key, handle)

    # ---- batched hot calls ----

    def lookup_pin(self, keys: Sequence[int]) -> list[int]:
        """For each key: its slot, pinned (a hit), or -1 (a miss)."""
        return self._impl.lookup_pin(keys)

    def unpin_many(self, keys: Sequence[int]) -> None:
        """``unpin`` each key (a key listed twice is unpinned twice); all or nothing."""
        self._impl.unpin_many(keys)

    def allocate_many(self, keys: Sequence[int], pin: bool = False) -> list[int]:
        """Pages for several new keys at once; returns their slots (see ``page``). The pages
        of one call never evict each other; all or nothing (PoolExhausted up front)."""
        return self._impl.allocate_many(keys, pin)

    def free_many(self, keys: Sequence[int]) -> None:
        """``free`` each key; all or nothing."""
        self._impl.free_many(keys)

    def page(self, slot: int) -> torch.Tensor:
        """The page view of a slot holding a live page (cached: O(1), no new tensor)."""
        return self._impl.page(slot)

    # ---- budget and bookkeeping ----

    def drain_evicted(self) -> list[int]:
        """Keys evicted since the last call, in eviction order."""
        return self._impl.drain_evicted()

    def set_budget(self, budget_bytes: int, *, evict_to_release: bool = False) -> None:
        """Move the budget. Shrinking evicts unpinned pages (lowest priority, least recently
        used first) until in-use bytes fit and gives empty segments back to torch until the
        reserved bytes fit. With ``evict_to_release=True`` it evicts whole segments instead, so
        that the *reserved* bytes fit too ([Note: no relocation])."""
        _check_size("budget_bytes", budget_bytes)
        self._impl.set_budget(budget_bytes, evict_to_release)

    def trim(self) -> int:
        """Give every segment without live pages back to torch; returns the bytes released."""
        return self._impl.trim()

    def stats(self) -> dict[str, int]:
        return self._impl.stats()

    def reset_peak(self) -> None:
        self._impl.reset_peak()

    def reset_counters(self) -> None:
        """Zero hits, misses, evictions and the other event counters."""
        self._impl.reset_counters()

    def snapshot(self) -> list[dict[str, int]]:
        """One dict per segment: index, pages, live, pinned, pending, bytes, data_ptr."""
        return self._impl.snapshot()

    def keys(self) -> list[int]:
        """The keys with a page, sorted."""
        return self._impl.keys()

    def __len__(self) -> int:
        return len(self._impl)

    def __iter__(self) -> Iterable[int]:
        return iter(self.keys())

    # ---- lifetime ----

    def close(self) -> None:
        """Give every segment back to torch; the pool is unusable afterwards (stats still
        work). Views handed out earlier keep their segment's memory alive until dropped."""
        self._impl.close()

    def __enter__(self) -> PagePool:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        s = self._impl.stats()
        return (
            f"PagePool(page_bytes={s['page_bytes']}, budget_bytes={s['budget_bytes']}, device='{self._device}', "
            f"pages={s['pages']}, reserved_bytes={s['reserved_bytes']})"
        )
