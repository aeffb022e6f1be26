"""TurboTransformers' sequence-length-aware allocator for a request's intermediates
(Fang et al., PPoPP'21, §4.3 and Algorithm 1), and the two allocators it is compared with.

Why: a variable-length request's intermediates change size with its length, so a
per-request buffer set sized for the longest length wastes most of its bytes on short
requests, and a caching allocator keeps every size it has ever seen. The launch plan
knows each intermediate's lifetime (the first and last step that touches it), so once a
request's length is known its intermediates can be packed into a few large *chunks*:
tensors whose lifetimes do not overlap share bytes.

:class:`ChunkAllocator` is Algorithm 1:

* usage records ``(first_op, last_op, size)`` are placed in decreasing order of size;
* each goes into the first chunk with a gap that fits it, the *smallest* such gap
  (``find_gap``: greedy by size for offset calculation, Pisarchyk and Lee 2020, as the
  paper adapts it);
* when no chunk has a gap, a new chunk of ``max(chunk_size, size * k_scale)`` bytes is
  appended (2 MB and 1.2 in the paper);
* chunks that no tensor of this inference uses are released (after ``max_idle``
  inferences; 0, the paper's default, releases them at once).

Chunks survive across requests, so a steady stream of similar lengths costs no device
allocation at all. The two baselines: :class:`PerRequestAllocator` (what the daemon did
before: every intermediate has its own buffer, sized for the longest length, one set per
request) and :class:`CachingAllocator` (PyTorch's idea: free blocks are cached by size and
reused best-fit, never returned).

Offsets are exact integers and lifetimes are inclusive step indices, so
``tests/dispatcher/test_seqlen_allocator.py`` can check by property that no two tensors
live at the same time ever share a byte.
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from typing import Callable, Iterable, Sequence

#: The job of :meth:`ChunkAllocator.plan` (one inference at a time).
_SERIAL = object()

#: The paper's chunk size (2 MB) and its new-chunk scale factor (§4.3).
DEFAULT_CHUNK_SIZE = 2 << 20
K_SCALE = 1.2


@dataclass(frozen=True, slots=True)
class TensorUsage:
    """One intermediate of one inference: live from step ``first_op`` to ``last_op``
    inclusive (indices in the launch plan's order), ``size`` bytes."""
    name: str
    first_op: int
    last_op: int
    size: int

    def __post_init__(self) -> None:
        if self.size < 0 or self.first_op < 0 or self.last_op < self.first_op:
            raise ValueError(f"tensor {self.name!r}: bad usage record "
                             f"(first_op={self.first_op}, last_op={self.last_op}, size={self.size})")

    def overlaps(self, other: "TensorUsage") -> bool:
        """Whether the two lifetimes share a step (Algorithm 1, lines 5-7)."""
        return max(self.first_op, other.first_op) <= min(self.last_op, other.last_op)


@dataclass(frozen=True, slots=True)
class Placement:
    """Where one tensor lives: chunk ``chunk`` (an index into the allocator's chunks),
    ``offset`` bytes into it."""
    chunk: int
    offset: int


@dataclass
class Chunk:
    """One device allocation and the live tensors placed in it, each with the job (the
    inference) it belongs to, kept sorted by offset (``find_gap`` walks them in address
    order)."""
    size: int
    ptr: int
    records: list[tuple[int, TensorUsage, object]] = field(default_factory=list)  # (offset, usage, job)
    idle: int = 0

    def place(self, offset: int, t: TensorUsage, job: object = None) -> None:
        bisect.insort(self.records, (offset, t, job), key=lambda r: r[0])


@dataclass
class AllocatorStats:
    """What the comparison reports: bytes held now and at peak, device allocation and
    free calls, and the inferences served."""
    held_bytes: int = 0
    peak_bytes: int = 0
    alloc_calls: int = 0
    free_calls: int = 0
    inferences: int = 0

    def allocated(self, nbytes: int) -> None:
        self.alloc_calls += 1
        self.held_bytes += nbytes
        self.peak_bytes = max(self.peak_bytes, self.held_bytes)

    def freed(self, nbytes: int) -> None:
        self.free_calls += 1
        self.held_bytes -= nbytes


def find_gap(t: TensorUsage, chunk: Chunk, job: object = None) -> int | None:
    """Algorithm 1's FindGapFromChunk: the offset of the smallest gap in ``chunk`` that
    holds ``t`` among the tensors whose lifetimes overlap ``t``'s, else the free space
    after the last of them, else None. O(n) per call, O(n^2) per inference. A tensor of
    another job (an inference running at the same time) always overlaps."""
    smallest_gap, best, prev_end = None, None, 0
    for offset, x, owner in chunk.records:
        if owner is job and not t.overlaps(x):
            continue
        gap = offset - prev_end
        if gap >= t.size and (smallest_gap is None or gap < smallest_gap):
            smallest_gap, best = gap, prev_end
        prev_end = max(prev_end, offset + x.size)
    if best is None and chunk.size - prev_end >= t.size:
        best = prev_end
    return best


def _sorted_by_size(usages: Iterable[TensorUsage]) -> list[TensorUsage]:
    """Decreasing size; ties in plan order, so a placement is a function of its input."""
    return sorted(usages, key=lambda u: (-u.size, u.first_op, u.name))


class _Device:
    """The device memory the allocators draw from (``alloc``/``free`` of the dispatcher,
    or counters alone when the comparison runs without a device)."""

    def __init__(self, alloc: Callable[[int], int] | None, free: Callable[[int], None] | None,
                 stats: AllocatorStats | None = None):
        self._alloc, self._free = alloc, free
        self._next = 0x1000
        self.stats = stats if stats is not None else AllocatorStats()

    def alloc(self, nbytes: int) -> int:
        if self._alloc is not None:
            ptr = self._alloc(nbytes)        # (first: one that fails counts nothing)
        else:
            ptr, self._next = self._next, self._next + nbytes + 256
        self.stats.allocated(nbytes)
        return ptr

    def free(self, ptr: int, nbytes: int) -> None:
        self.stats.freed(nbytes)
        if self._free is not None:
            self._free(ptr)


class ChunkAllocator:
    """Algorithm 1 over chunks that outlive inferences (see the module docstring)."""

    def __init__(self, chunk_size: int = DEFAULT_CHUNK_SIZE, k_scale: float = K_SCALE,
                 max_idle: int = 0, alloc: Callable[[int], int] | None = None,
                 free: Callable[[int], None] | None = None, stats: AllocatorStats | None = None):
        """``stats``: counters to add to (several allocators drawing on one device
        share one, so that its peak is theirs together)."""
        if chunk_size <= 0 or k_scale < 1.0 or max_idle < 0:
            raise ValueError(f"chunk allocator: chunk_size must be > 0, k_scale >= 1 and "
                             f"max_idle >= 0 (got {chunk_size}, {k_scale}, {max_idle})")
        self.chunk_size, self.k_scale, self.max_idle = chunk_size, k_scale, max_idle
        self.chunks: list[Chunk] = []
        self._device = _Device(alloc, free, stats)

    @property
    def stats(self) -> AllocatorStats:
        return self._device.stats

    def plan(self, usages: Sequence[TensorUsage]) -> dict[str, Placement]:
        """Algorithm 1 as the paper runs it, one inference at a time (MemAllocate): the
        previous inference's tensors are gone, this one's are placed; returns name ->
        placement. Chunks persist across inferences; unused ones are released."""
        self.release_job(_SERIAL)
        placed = self._place_job(_SERIAL, usages)
        index = {id(c): i for i, c in enumerate(self.chunks)}
        return {n: Placement(index[id(c)], off) for n, (c, off) in placed.items()}

    def addresses(self, usages: Sequence[TensorUsage]) -> dict[str, int]:
        """:meth:`plan`, as device addresses."""
        return {n: self.chunks[p.chunk].ptr + p.offset for n, p in self.plan(usages).items()}

    def place_job(self, job: object, usages: Sequence[TensorUsage]) -> dict[str, int]:
        """Algorithm 1 for inferences that run *at the same time* (a job on the device
        beside others): ``job``'s tensors are placed around every live tensor of the
        other jobs (always overlapping) and, within the job, by their lifetimes, until
        :meth:`release_job`. One job at a time, this is :meth:`plan` exactly. Returns
        name -> device address."""
        return {n: c.ptr + off for n, (c, off) in self._place_job(job, usages).items()}

    def release_job(self, job: object) -> None:
        """``job`` has finished: its tensors' bytes are free (the chunks stay; a chunk no
        inference uses is released at the next placement, after ``max_idle`` of them)."""
        for c in self.chunks:
            if any(r[2] is job for r in c.records):
                c.records = [r for r in c.records if r[2] is not job]

    def _place_job(self, job: object, usages: Sequence[TensorUsage]) -> dict[str, tuple[Chunk, int]]:
        names = [t.name for t in usages]
        if len(set(names)) != len(names):
            raise ValueError("chunk allocator: two usage records share a tensor name")
        placed = {t.name: self._place(t, job) for t in _sorted_by_size(usages)}
        self._release_unused()
        self.stats.inferences += 1
        return placed

    def _place(self, t: TensorUsage, job: object) -> tuple[Chunk, int]:
        for c in self.chunks:
            off = find_gap(t, c, job)
            if off is not None:
                c.place(off, t, job)
                return c, off
        size = max(self.chunk_size, int(t.size * self.k_scale))
        c = Chunk(size, self._device.alloc(size))
        c.place(0, t, job)
        self.chunks.append(c)
        return c, 0

    def _release_unused(self) -> None:
        kept = []
        for c in self.chunks:
            c.idle = 0 if c.records else c.idle + 1
            if c.idle > self.max_idle:
                self._device.free(c.ptr, c.size)
            else:
                kept.append(c)
        self.chunks = kept

    def trim(self) -> int:
        """Free every chunk no live tensor uses, at once (not after ``max_idle``
        placements); returns the bytes freed."""
        freed = 0
        kept = []
        for c in self.chunks:
            if c.records:
                kept.append(c)
            else:
                self._device.free(c.ptr, c.size)
                freed += c.size
        self.chunks = kept
        return freed

    def close(self) -> None:
        for c in self.chunks:
            self._device.free(c.ptr, c.size)
        self.chunks = []


class PerRequestAllocator:
    """The daemon's buffer sets before this allocator: every intermediate gets its own
    buffer, sized for the longest length the model takes (``max_sizes``), one set per
    request in flight, kept for reuse."""

    def __init__(self, max_sizes: dict[str, int], alloc: Callable[[int], int] | None = None,
                 free: Callable[[int], None] | None = None):
        self.max_sizes = dict(max_sizes)
        self._device = _Device(alloc, free)
        self._free_sets: list[dict[str, int]] = []

    @property
    def stats(self) -> AllocatorStats:
        return self._device.stats

    def acquire(self, usages: Sequence[TensorUsage]) -> dict[str, int]:
        for u in usages:
            if u.size > self.max_sizes.get(u.name, -1):
                raise ValueError(f"tensor {u.name!r} needs {u.size} bytes, more than the "
                                 f"largest length's {self.max_sizes.get(u.name)}")
        self.stats.inferences += 1
        if self._free_sets:
            return self._free_sets.pop()
        return {n: self._device.alloc(s) for n, s in self.max_sizes.items()}

    def release(self, buffers: dict[str, int]) -> None:
        self._free_sets.append(buffers)


class CachingAllocator:
    """A caching allocator in the manner of PyTorch's: each tensor is allocated at its
    first step and freed at its last; freed blocks are cached by size (rounded up to
    ``round_to`` bytes, 512 as in PyTorch) and reused best-fit, never returned to the
    device, so the cache grows to the largest mix of sizes ever live at once."""

    def __init__(self, round_to: int = 512, alloc: Callable[[int], int] | None = None,
                 free: Callable[[int], None] | None = None):
        self.round_to = round_to
        self._device = _Device(alloc, free)
        self._cache: list[tuple[int, int]] = []       # (size, ptr), sorted

    @property
    def stats(self) -> AllocatorStats:
        return self._device.stats

    def _get(self, size: int) -> tuple[int, int]:
        size = -(-max(size, 1) // self.round_to) * self.round_to
        i = bisect.bisect_left(self._cache, (size, -1))
        if i < len(self._cache):
            return self._cache.pop(i)
        return size, self._device.alloc(size)

    def run(self, usages: Sequence[TensorUsage]) -> dict[str, int]:
        """Serve one inference step by step; returns the address each tensor got."""
        self.stats.inferences += 1
        if not usages:
            return {}
        last = max(u.last_op for u in usages)
        starts: dict[int, list[TensorUsage]] = {}
        ends: dict[int, list[TensorUsage]] = {}
        for u in usages:
            starts.setdefault(u.first_op, []).append(u)
            ends.setdefault(u.last_op, []).append(u)
        held: dict[str, tuple[int, int]] = {}
        where: dict[str, int] = {}
        for step in range(last + 1):
            for u in starts.get(step, ()):
                held[u.name] = self._get(u.size)
                where[u.name] = held[u.name][1]
            for u in ends.get(step, ()):
                bisect.insort(self._cache, held.pop(u.name))
        return where
