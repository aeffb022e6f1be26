"""A model's per-request buffers from TurboTransformers' chunked allocator, shared by all
its variants (length buckets, batch sizes).

Why: each compiled variant of a model is a dispatcher model of its own with its own pool
of buffer sets (:class:`~paella.dispatcher.adaptor.BufferPool`), each set sized for that
variant. A variable-length workload touches every length bucket, so the pools together
hold a set for every bucket ever used, most of it idle. Here all the variants of one
model draw from one :class:`ChunkedMemory`: one
:class:`~paella.dispatcher.seqlen_allocator.ChunkAllocator` whose chunks persist across
jobs. A job's buffers are placed by Algorithm 1 from the lifetimes in its variant's
launch plan (:func:`plan_usages`) around the live buffers of the jobs already on the
device (``place_job``: another job's buffers always overlap in time), and let go when it
finishes; a chunk no job uses is released. So buffers whose lifetimes do not overlap
share bytes, the memory held follows the jobs in flight rather than every shape ever
served, and a steady mix of lengths allocates nothing. At most ``limit`` jobs hold
buffers at once.

The dispatcher sees each variant's :class:`ChunkedView` as that variant's buffer pool
(``acquire``, ``release``, ``waiting``, ``rebind``). The views share one ``waiting``
queue, so a job waiting for buffers goes next when a job of *any* variant finishes; its
buffers are placed for its own variant on the way (``rebind``).
"""
from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING, Any

from .adaptor import BufferSet
from .seqlen_allocator import (DEFAULT_CHUNK_SIZE, K_SCALE, AllocatorStats, ChunkAllocator,
                               TensorUsage)

if TYPE_CHECKING:
    from .adaptor import Plan, PlanAdaptor


def plan_usages(plan: "Plan") -> list[TensorUsage]:
    """Each per-request buffer of ``plan`` as a usage record: live from the first step
    that touches it to the last (plan order). On a multi-stream plan, plan order is not
    execution order, so every buffer is taken to live through the whole plan (no
    sharing: safe, and the allocator still reuses chunks across jobs)."""
    request = plan.request_buffers
    span: dict[str, list[int]] = {}
    for i, op in enumerate(plan.ops):
        names = ([a.buffer for a in op.args if getattr(a, "buffer", None)]
                 if op.kind == "launch" else [op.buffer] if op.buffer else [])
        for n in names:
            if n in request:
                s = span.setdefault(n, [i, i])
                s[1] = i
    last = max(len(plan.ops) - 1, 0)
    multi = any(op.stream for op in plan.ops)
    return [TensorUsage(n, 0 if multi else span.get(n, [0, 0])[0],
                        last if multi else span.get(n, [0, 0])[1], size)
            for n, size in request.items()]


class ChunkBufferSet(BufferSet):
    """A job's buffers, placed in its model's chunks under ``token``."""
    __slots__ = ("token",)

    def __init__(self, ptrs: dict[str, int], bound: list, token: object):
        super().__init__(ptrs, [], bound)
        self.token = token


class ChunkedMemory:
    """The chunks of one model, shared by its variants' views (see the module doc)."""

    def __init__(self, name: str, limit: int, chunk_size: int = DEFAULT_CHUNK_SIZE,
                 k_scale: float = K_SCALE, max_idle: int = 0):
        if limit < 1:
            raise ValueError(f"model {name!r}: the chunked memory needs at least 1 job, got {limit}")
        self.name, self.limit = name, limit
        self.chunk_size, self.k_scale, self.max_idle = chunk_size, k_scale, max_idle
        self.allocator: ChunkAllocator | None = None
        self.in_use = 0
        self.waiting: deque = deque()       # jobs of every variant, owned by the dispatcher
        self.views = 0
        self.closed = False
        #: If a list, each placement appends its variant's usage records (experiments
        #: replay the same sequence through other allocators).
        self.trace: list | None = None

    @property
    def stats(self) -> AllocatorStats:
        """Device bytes held and at peak, allocation calls, jobs placed."""
        return self.allocator.stats if self.allocator is not None else AllocatorStats()

    def view(self, adaptor: "PlanAdaptor") -> "ChunkedView":
        """The buffer pool of one variant (called from its adaptor's ``init``)."""
        if self.allocator is None:
            dev = adaptor.device
            self.allocator = ChunkAllocator(self.chunk_size, self.k_scale, self.max_idle,
                                            alloc=dev.alloc, free=dev.free)
        self.views += 1
        return ChunkedView(self, adaptor)

    def place(self, token: object, usages: list[TensorUsage]) -> dict[str, int]:
        if self.trace is not None:
            self.trace.append(usages)
        return self.allocator.place_job(token, usages)

    def take(self) -> object | None:
        """A token for one more job, or None when ``limit`` jobs hold buffers."""
        if self.in_use >= self.limit:
            return None
        self.in_use += 1
        return object()

    def give_back(self, token: object) -> None:
        self.allocator.release_job(token)
        self.in_use -= 1
        self._close_if_done()

    def trim(self) -> int:
        """Free the chunks no job uses (the device's memory is full); returns bytes."""
        return self.allocator.trim() if self.allocator is not None else 0

    def view_closed(self) -> None:
        self.views -= 1
        if self.views == 0:
            self.closed = True
            self._close_if_done()

    def _close_if_done(self) -> None:
        if self.closed and self.in_use == 0 and self.allocator is not None:
            self.allocator.close()


class ChunkedView:
    """One variant's buffer pool over its model's :class:`ChunkedMemory`."""

    shared = None                           # (BufferPool's attribute: no shared set)
    #: Placements whose bound steps are kept per variant.
    BOUND_CACHE = 8

    def __init__(self, memory: ChunkedMemory, adaptor: "PlanAdaptor"):
        self.memory = memory
        self.adaptor = adaptor
        self.usages = plan_usages(adaptor.plan)
        self.limit = memory.limit
        self._bound: dict[tuple, tuple[dict, list]] = {}   # placement -> (ptrs, bound steps)

    @property
    def waiting(self) -> deque:
        return self.memory.waiting

    def _bind(self, token: object) -> ChunkBufferSet:
        placed = self.memory.place(token, self.usages)
        # Speed (a trick, labelled): binding walks every plan step (160-175 us for
        # BERT-base's 244), but a steady load places a variant at the same few addresses
        # again and again, so the bound steps are kept per placement (a few, bounded).
        key = tuple(placed.values())
        hit = self._bound.get(key)
        if hit is None:
            ptrs = {**self.adaptor.buffers, **placed}
            if len(self._bound) >= self.BOUND_CACHE:
                self._bound.pop(next(iter(self._bound)))
            hit = self._bound[key] = (ptrs, self.adaptor.bind(ptrs))
        return ChunkBufferSet(hit[0], hit[1], token)

    def acquire(self) -> ChunkBufferSet | None:
        token = self.memory.take()
        return None if token is None else self._bind_or_give_back(token)

    def rebind(self, b: Any) -> ChunkBufferSet:
        """A set freed by another job (perhaps of another variant), placed for this one."""
        self.memory.allocator.release_job(b.token)
        return self._bind_or_give_back(b.token)

    def _bind_or_give_back(self, token: object) -> ChunkBufferSet:
        try:
            return self._bind(token)
        except Exception:                   # a chunk did not fit (OutOfMemory): what
            self.memory.give_back(token)    # was placed goes, and the job's slot
            raise

    @property
    def owner(self) -> ChunkedMemory:
        """What holds this pool's memory: the model's chunks, shared by its variants."""
        return self.memory

    @property
    def held_bytes(self) -> int:
        """Device bytes of the model's chunks (every variant's: count them once)."""
        return self.memory.stats.held_bytes

    def trim(self) -> int:
        return self.memory.trim()

    def release(self, b: ChunkBufferSet) -> None:
        self.memory.give_back(b.token)

    def close(self) -> None:
        self.memory.view_closed()
