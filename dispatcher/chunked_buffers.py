"""A model's per-request buffers from TurboTransformers' chunked allocator, shared by all
its variants (length buckets, batch sizes).

Why: each compiled variant of a model is a dispatcher model of its own with its own pool
of buffer sets (:class:`~paella.dispatcher.adaptor.BufferPool`), each set sized for that
variant. A variable-length workload touches every length bucket, so the pools together
hold a set for every bucket ever used, most of it idle. Here all the variants of one
model draw from one :class:`ChunkedMemory`: ``limit`` *slots* (one per job on the device),
each a :class:`~paella.dispatcher.seqlen_allocator.ChunkAllocator` whose chunks persist
across jobs; a job's buffers are placed in its slot's chunks by Algorithm 1 from the
lifetimes in its variant's launch plan (:func:`plan_usages`), so buffers whose lifetimes
do not overlap share bytes and a steady mix of lengths allocates nothing.

The dispatcher sees each variant's :class:`ChunkedView` as that variant's buffer pool
(``acquire``, ``release``, ``waiting``, ``rebind``). The views share one ``waiting``
queue, so a job waiting for a slot gets the next slot freed by *any* variant; the slot
is re-planned for its variant (``rebind``) on the way.
"""
from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING, Any, Callable

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
    """A buffer set placed in one slot's chunks."""
    __slots__ = ("slot",)

    def __init__(self, ptrs: dict[str, int], bound: list, slot: ChunkAllocator):
        super().__init__(ptrs, [], bound)
        self.slot = slot


class ChunkedMemory:
    """The slots of one model, shared by its variants' views (see the module doc)."""

    def __init__(self, name: str, limit: int, chunk_size: int = DEFAULT_CHUNK_SIZE,
                 k_scale: float = K_SCALE, max_idle: int = 0):
        if limit < 1:
            raise ValueError(f"model {name!r}: the chunked memory needs at least 1 slot, got {limit}")
        self.name, self.limit = name, limit
        self.chunk_size, self.k_scale, self.max_idle = chunk_size, k_scale, max_idle
        self.free: list[ChunkAllocator] = []
        self.slots: list[ChunkAllocator] = []
        self.in_use = 0
        self.waiting: deque = deque()       # jobs of every variant, owned by the dispatcher
        self.views = 0
        self.closed = False
        self._alloc: Callable[[int], int] | None = None
        self._free: Callable[[int], None] | None = None
        #: Device bytes held and at peak, allocation calls, jobs placed: all slots together.
        self.stats = AllocatorStats()
        #: If a list, each placement appends its variant's usage records (experiments
        #: replay the same sequence through other allocators).
        self.trace: list | None = None

    def view(self, adaptor: "PlanAdaptor") -> "ChunkedView":
        """The buffer pool of one variant (called from its adaptor's ``init``)."""
        dev = adaptor.device
        if self._alloc is None:
            self._alloc, self._free = dev.alloc, dev.free
        self.views += 1
        return ChunkedView(self, adaptor)

    def take(self) -> ChunkAllocator | None:
        if self.free:
            slot = self.free.pop()
        elif len(self.slots) < self.limit:
            slot = ChunkAllocator(self.chunk_size, self.k_scale, self.max_idle,
                                  alloc=self._alloc, free=self._free, stats=self.stats)
            self.slots.append(slot)
        else:
            return None
        self.in_use += 1
        return slot

    def give_back(self, slot: ChunkAllocator) -> None:
        self.in_use -= 1
        if self.closed:
            slot.close()
        else:
            self.free.append(slot)

    def view_closed(self) -> None:
        self.views -= 1
        if self.views == 0:
            self.closed = True
            while self.free:
                self.free.pop().close()


class ChunkedView:
    """One variant's buffer pool over its model's :class:`ChunkedMemory`."""

    shared = None                           # (BufferPool's attribute: no shared set)

    def __init__(self, memory: ChunkedMemory, adaptor: "PlanAdaptor"):
        self.memory = memory
        self.adaptor = adaptor
        self.usages = plan_usages(adaptor.plan)
        self.limit = memory.limit

    @property
    def waiting(self) -> deque:
        return self.memory.waiting

    def _bind(self, slot: ChunkAllocator) -> ChunkBufferSet:
        if self.memory.trace is not None:
            self.memory.trace.append(self.usages)
        ptrs = dict(self.adaptor.buffers)
        ptrs.update(slot.addresses(self.usages))
        return ChunkBufferSet(ptrs, self.adaptor.bind(ptrs), slot)

    def acquire(self) -> ChunkBufferSet | None:
        slot = self.memory.take()
        return None if slot is None else self._bind(slot)

    def rebind(self, b: Any) -> ChunkBufferSet:
        """A set freed by another job (perhaps of another variant), placed for this one."""
        return self._bind(b.slot)

    def release(self, b: ChunkBufferSet) -> None:
        self.memory.give_back(b.slot)

    def close(self) -> None:
        self.memory.view_closed()
