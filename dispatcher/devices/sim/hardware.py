"""The simulated GPU's hardware: SMs, hardware queues, the block scheduler, copy engines,
and the device side of the notifQ.

The rules that produce head-of-line blocking, stated once:

* stream ``s`` feeds hardware queue ``s mod N``; every queue is strictly FIFO;
* an operation may start only when every earlier operation of its stream has completed;
* only the head of a queue is considered; a kernel stays the head until all its blocks
  have been placed, and only then can the operation behind it start;
* the block scheduler visits the dispatchable heads in launch order and places blocks
  of each while some SM has room for a whole block (the Occupancy Calculator's
  granularity, :class:`paella.occupancy.SMResources`), spreading them breadth-first
  over the SMs, round-robin from where it last stopped;
* blocks of one kernel placed together on one SM form one *group*; the groups placed
  in one pass end together, in one event (each block lasts the kernel's time over its
  waves; with ``jitter`` each group gets its own duration and its own event).

Copies go to one H2D and one D2H engine, each FIFO. Instrumented kernels post into the
notifQ exactly what the device header posts (``paella.protocol.group_posts``'s rule).
"""
from __future__ import annotations

import bisect
import random
from collections import deque
from heapq import heappush
from typing import Callable

import numpy as np

from paella import protocol
from paella.dispatcher.devices.base import D2H, H2D, KERNEL, MARKER, NotifQOverrun
from paella.gpus import GpuSpec
from paella.occupancy import Footprint

from .clock import EventLoop
from .cost import CostModel
from .smstate import GIVE_SHIFT, TAKE_SHIFT, SMStates

#: Placements of more blocks than this scan the candidate SMs as a wave (see ``_place``;
#: it decides the candidate order when blocked and which generator draws the jitter).
FEW_BLOCKS = 8
_PLACE = protocol.PLACEMENT << protocol.KIND_SHIFT
_DONE = protocol.COMPLETION << protocol.KIND_SHIFT


class Op:
    """Something submitted to a stream: a kernel, a copy, or an event marker."""
    __slots__ = ("kind", "stream", "seq", "on_complete", "done", "t_submit", "t_done")

    def __init__(self, kind: int, stream: int, on_complete: Callable[[], None] | None):
        self.kind = kind
        self.stream = stream
        self.on_complete = on_complete
        self.done = False
        self.seq = 0
        self.t_submit = self.t_done = 0.0

    def __lt__(self, other: "Op") -> bool:   # launch order, for the active list
        return self.seq < other.seq


class KernelOp(Op):
    __slots__ = ("name", "fp", "shape", "total", "unplaced", "started", "ended", "block_time",
                 "launch_id", "instrumented", "group", "issued", "blocked", "t_first")

    def __init__(self, stream, on_complete, name, shape, total, block_time, launch_id, instrumented, group):
        super().__init__(KERNEL, stream, on_complete)
        self.name = name
        self.fp = shape.fp
        self.shape = shape        # the footprint's memo tables (smstate.Shape)
        self.total = self.unplaced = total
        self.started = self.ended = 0
        self.block_time = block_time
        self.launch_id = launch_id
        self.instrumented = instrumented
        self.group = group
        self.issued = False       # reached the head of its queue, stream-ready
        self.blocked = False      # True once a scan found no SM with room for it
        self.t_first = -1.0


class CopyOp(Op):
    __slots__ = ("nbytes", "action")

    def __init__(self, kind, stream, on_complete, nbytes, action):
        super().__init__(kind, stream, on_complete)
        self.nbytes = nbytes
        self.action = action      # moves the bytes when the copy completes


class GpuModel:
    """SMs, queues and engines of one simulated GPU, driven by an event loop."""

    def __init__(self, spec: GpuSpec, loop: EventLoop, cost: CostModel, n_streams: int,
                 notifq: np.ndarray, seed: int = 0, jitter: float = 0.0):
        self.spec = spec
        self.loop = loop
        self.cost = cost
        self.res = SMStates(spec)
        self.n_sm = spec.sm_count
        self.nq = spec.hw_queues
        self.queues: list[deque[Op]] = [deque() for _ in range(self.nq)]
        self.streams: list[deque[Op]] = [deque() for _ in range(n_streams)]
        self.active: list[KernelOp] = []          # dispatchable queue heads, launch order
        self.engines = {H2D: deque(), D2H: deque()}
        self.ring = notifq
        # Speed: a memoryview reads and writes a slot as a Python int several times
        # faster than numpy scalar indexing.
        self._ring_mv = memoryview(notifq)
        self.mask = notifq.size - 1
        self.tail = 0
        self.rng = random.Random(seed)
        self.np_rng = np.random.default_rng(seed)
        self.jitter = jitter
        self._heap, self._eseq = loop._heap, loop._seq     # for loop.at(), inlined
        self._seq = 0
        self._rr = 0
        # Every rotation of the SM order, so a full scan allocates nothing.
        order = list(range(self.n_sm))
        self._rotations = [order[i:] + order[:i] for i in range(self.n_sm)]
        self._dirty: list[int] = []               # SMs that gained room since the last pass
        self._is_dirty = [False] * self.n_sm
        # Statistics.
        self.resident = 0
        self.placements = 0
        self.events = 0
        self._resident_area = 0.0
        self._last_t = 0.0

    # -- submission ---------------------------------------------------------------
    def launch(self, name: str, fp: Footprint, blocks: int, flops: float, nbytes: float,
               duration: float | None, stream: int, launch_id: int, instrumented: bool,
               group: int, on_complete) -> KernelOp:
        shape = self.res.shape(fp)
        per_wave = shape.per_sm * self.n_sm
        waves = -(-blocks // per_wave)
        block_time = self.cost.kernel_time(self.spec, flops, nbytes, duration) / waves
        op = KernelOp(stream, on_complete, name, shape, blocks, block_time, launch_id, instrumented, group)
        self._submit(op)
        return op

    def copy(self, kind: int, stream: int, nbytes: int, action, on_complete) -> CopyOp:
        op = CopyOp(kind, stream, on_complete, nbytes, action)
        self._submit(op)
        return op

    def marker(self, stream: int) -> Op:
        op = Op(MARKER, stream, None)
        self._submit(op)
        return op

    def _submit(self, op: Op) -> None:
        self._seq += 1
        op.seq = self._seq
        op.t_submit = self.loop.now
        self.streams[op.stream].append(op)
        q = op.stream % self.nq
        self.queues[q].append(op)
        if len(self.queues[q]) == 1:
            self._advance(q)
            self._dispatch()

    # -- queues -------------------------------------------------------------------
    def _advance(self, qi: int) -> None:
        """Start what the head of queue ``qi`` allows: copies go to their engine, markers
        complete, a kernel becomes dispatchable. Stops at an op whose stream is busy."""
        q = self.queues[qi]
        while q:
            op = q[0]
            if self.streams[op.stream][0] is not op:
                return                      # an earlier op of its stream is still running
            if op.kind == KERNEL:
                if not op.issued:
                    op.issued = True
                    bisect.insort(self.active, op)
                return
            q.popleft()
            if op.kind == MARKER:
                self._complete(op)
            else:
                engine = self.engines[op.kind]
                engine.append(op)
                if len(engine) == 1:
                    self._start_copy(op)

    def _complete(self, op: Op) -> None:
        op.done = True
        op.t_done = self.loop.now
        head = self.streams[op.stream].popleft()
        if head is not op:
            raise AssertionError("stream order violated in the simulator")
        self._advance(op.stream % self.nq)
        if op.on_complete is not None:
            op.on_complete()

    # -- block scheduler ------------------------------------------------------------
    def _dispatch(self) -> None:
        """Place blocks of the dispatchable heads, in launch order, while they fit."""
        active = self.active
        dirty = self._dirty
        progressed = True
        while progressed and active:
            # A kernel whose last block is placed leaves its queue; the op behind it may
            # then become dispatchable, so passes repeat until one changes nothing.
            progressed = False
            for k in tuple(active):
                if k.blocked and not dirty:
                    continue        # it found every SM full, and no SM gained room since
                self._place(k)
                if not k.unplaced:
                    active.remove(k)
                    qi = k.stream % self.nq
                    self.queues[qi].popleft()
                    self._advance(qi)
                    progressed = True
        if dirty:
            is_dirty = self._is_dirty
            for s in dirty:
                is_dirty[s] = False
            dirty.clear()

    def _place(self, k: KernelOp) -> None:
        """Place what fits of ``k``, breadth-first from the round-robin position; a kernel
        that found every SM full last time only looks where room appeared (``_dirty``).

        Two candidate orders, kept as they were when the second was a numpy path: up to
        ``FEW_BLOCKS`` blocks (or few room-gaining SMs) scan the SMs in rotation order,
        or the dirty SMs in the order they gained room, and stop once one block per SM
        covers what is left; more scan the rotation filtered to dirty SMs. The two give
        different placements when blocked, and draw jitter from different generators."""
        need = k.unplaced
        if k.blocked:
            wave = need > FEW_BLOCKS and len(self._dirty) > FEW_BLOCKS
            if wave:
                is_dirty = self._is_dirty
                cands = [s for s in self._rotations[self._rr] if is_dirty[s]]
            else:
                cands = self._dirty
        else:
            wave = need > FEW_BLOCKS
            cands = self._rotations[self._rr]
        fit = k.shape.fit
        sid = self.res.sid
        caps = []
        got = 0
        for s in cands:
            c = fit[sid[s]]
            if c:
                caps.append((s, c))
                got += c
                if len(caps) >= need:
                    break           # one block per SM already covers what is left
        if not caps:
            k.blocked = True
            return
        if len(caps) >= need:
            caps = [(s, 1) for s, _ in caps]       # breadth-first: one block per SM
        elif got > need:
            caps = _water_fill(caps, need)
        # Start them: ``n`` blocks on each SM ``s`` of ``caps``, at once. Blocks placed
        # together last equally long, so one event ends them all (per SM when
        # ``jitter`` gives each group its own duration: drawn from ``np_rng``, all at
        # once, for a ``wave`` placement, else from ``rng`` one by one).
        now = self.loop.now
        take = k.shape.take
        groups = []
        placed = 0
        for s, n in caps:
            sid[s], did = take[(sid[s] << TAKE_SHIFT) | n]
            groups.append((s, n, did))
            placed += n
        c0 = k.started
        k.started = end = c0 + placed
        if k.instrumented and (end - end % k.group > c0 or end == k.total):
            self._post(_PLACE, groups, c0, k)      # some block of these posts
        if k.t_first < 0:
            k.t_first = now
        k.unplaced = need - placed
        self.placements += placed
        # Resident-block area up to now, then the new count (inlined: a hot path).
        self._resident_area += self.resident * (now - self._last_t)
        self._last_t = now
        self.resident += placed
        d = k.block_time
        if not self.jitter:
            if d >= 0:              # loop.at(now + d, ...) inlined; at() refuses the past
                heappush(self._heap, (now + d, next(self._eseq), self._blocks_done, (k, groups)))
            else:
                self.loop.at(now + d, self._blocks_done, (k, groups))
        elif wave:
            at, done = self.loop.at, self._blocks_done
            for g, f in zip(groups, self.np_rng.lognormal(0.0, self.jitter, len(groups)).tolist()):
                at(now + d * f, done, (k, (g,)))
        else:
            at, done = self.loop.at, self._blocks_done
            for g in groups:
                at(now + d * self.rng.lognormvariate(0.0, self.jitter), done, (k, (g,)))
        self._rr = (s + 1) % self.n_sm
        if k.blocked:
            # Drop SMs that can hold no block at all any more, so the kernels waiting
            # after this one do not scan them.
            no_room, is_dirty = self.res.no_room, self._is_dirty
            dirty = self._dirty
            keep = []
            for s in dirty:
                if no_room[sid[s]]:
                    is_dirty[s] = False
                else:
                    keep.append(s)
            dirty[:] = keep
        k.blocked = need > placed

    def _blocks_done(self, event: tuple) -> None:
        k, groups = event
        res = self.res
        give, sid = res.give_memo, res.sid
        is_dirty, dirty = self._is_dirty, self._dirty
        ended = 0
        for s, n, did in groups:
            sid[s] = give[(sid[s] << GIVE_SHIFT) | did]
            if not is_dirty[s]:
                is_dirty[s] = True
                dirty.append(s)
            ended += n
        c0 = k.ended
        k.ended = end = c0 + ended
        if k.instrumented and (end - end % k.group > c0 or end == k.total):
            self._post(_DONE, groups, c0, k)
        self.events += 1
        now = self.loop.now
        self._resident_area += self.resident * (now - self._last_t)
        self._last_t = now
        self.resident -= ended
        if k.ended == k.total:
            self._complete(k)
        self._dispatch()

    # -- copy engines ---------------------------------------------------------------
    def _start_copy(self, op: CopyOp) -> None:
        self.loop.at(self.loop.now + self.cost.copy_time(self.spec, op.nbytes), self._copy_done, op)

    def _copy_done(self, op: CopyOp) -> None:
        self.events += 1
        engine = self.engines[op.kind]
        engine.popleft()
        if op.action is not None:
            op.action()
        if engine:
            self._start_copy(engine[0])
        self._complete(op)
        self._dispatch()

    # -- notifQ ---------------------------------------------------------------------
    def _post(self, kind_bits: int, groups: list, c0: int, k: KernelOp) -> None:
        """Write the entries the device header would write for blocks c0+1.. placed (or
        ended) as ``groups`` (SM, blocks, _), in order: the block whose counter value is
        a multiple of the group posts the group's count, and the kernel's last block
        posts what remains."""
        g = k.group
        total = k.total
        mv, mask, tail = self._ring_mv, self.mask, self.tail
        full = kind_bits | k.launch_id | (g << protocol.COUNT_SHIFT)
        nxt = (c0 // g + 1) * g
        s = 0
        for s, n, _ in groups:
            c0 += n
            if nxt <= c0:
                word = full | (s << protocol.SM_SHIFT)
                while nxt <= c0:
                    slot = tail & mask
                    if mv[slot]:
                        self.tail = tail
                        raise self._overrun(slot)
                    mv[slot] = word
                    tail += 1
                    nxt += g
        if c0 == total and total % g:
            slot = tail & mask
            if mv[slot]:
                self.tail = tail
                raise self._overrun(slot)
            mv[slot] = (kind_bits | k.launch_id | ((total % g) << protocol.COUNT_SHIFT)
                        | (s << protocol.SM_SHIFT))
            tail += 1
        self.tail = tail

    def _overrun(self, slot: int) -> NotifQOverrun:
        return NotifQOverrun(
            f"notifQ overrun at slot {slot} (entry {self.tail}): the reader has not consumed "
            f"it; the dispatcher must bound outstanding blocks to fewer than "
            f"{self.mask + 1} ring slots' worth of notifications")

    # -- statistics -----------------------------------------------------------------
    def mean_resident(self, since_area: float = 0.0, since_t: float = 0.0) -> float:
        """Time-averaged resident blocks since (area, time) snapshot, up to now."""
        now = self.loop.now
        area = self._resident_area + self.resident * (now - self._last_t)
        return (area - since_area) / (now - since_t) if now > since_t else float(self.resident)

    def area_snapshot(self) -> tuple[float, float]:
        now = self.loop.now
        return self._resident_area + self.resident * (now - self._last_t), now

    def busy(self) -> bool:
        return any(self.streams)


def _water_fill(caps: list[tuple[int, int]], need: int) -> list[tuple[int, int]]:
    """Breadth-first share of ``need`` blocks over SMs with capacities ``caps``: every SM
    gets a block before any gets a second, as the hardware spreads a grid."""
    level = 0
    placed = 0
    while True:
        nxt = sum(c if c < level + 1 else level + 1 for _, c in caps)
        if nxt > need:
            break
        level += 1
        placed = nxt
    extra = need - placed
    out = []
    for s, c in caps:
        n = c if c < level else level
        if extra and c > level:
            n += 1
            extra -= 1
        if n:
            out.append((s, n))
    return out

