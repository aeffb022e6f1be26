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
from typing import Callable

import numpy as np

from paella import protocol
from paella.dispatcher.devices.base import NotifQOverrun
from paella.gpus import GpuSpec
from paella.occupancy import Footprint, SMResources, limits_per_resource

from .clock import EventLoop
from .cost import CostModel

KERNEL, H2D, D2H, MARKER = 0, 1, 2, 3
#: Placements of more blocks than this take the vector path (every SM at once).
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
    __slots__ = ("name", "fp", "total", "unplaced", "started", "ended", "block_time",
                 "launch_id", "instrumented", "group", "issued", "blocked", "t_first")

    def __init__(self, stream, on_complete, name, fp, total, block_time, launch_id, instrumented, group):
        super().__init__(KERNEL, stream, on_complete)
        self.name = name
        self.fp = fp
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
        self.res = SMResources(spec)
        self.n_sm = spec.sm_count
        self.nq = spec.hw_queues
        self.queues: list[deque[Op]] = [deque() for _ in range(self.nq)]
        self.streams: list[deque[Op]] = [deque() for _ in range(n_streams)]
        self.active: list[KernelOp] = []          # dispatchable queue heads, launch order
        self.engines = {H2D: deque(), D2H: deque()}
        self.ring = notifq
        self.mask = notifq.size - 1
        self.tail = 0
        self.rng = random.Random(seed)
        self.np_rng = np.random.default_rng(seed)
        self.jitter = jitter
        self._seq = 0
        self._rr = 0
        # Every rotation of the SM order, so a full scan allocates nothing.
        order = list(range(self.n_sm))
        self._rotations = [order[i:] + order[:i] for i in range(self.n_sm)]
        self._rotations_np = [np.array(r, dtype=np.int64) for r in self._rotations]
        self._dirty: list[int] = []               # SMs that gained room since the last pass
        self._is_dirty = [False] * self.n_sm
        self._is_dirty_np = np.zeros(self.n_sm, dtype=bool)    # the same, for vector scans
        self._waves_cache: dict[Footprint, int] = {}
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
        per_wave = self._blocks_per_sm(fp) * self.n_sm
        waves = -(-blocks // per_wave)
        block_time = self.cost.kernel_time(self.spec, flops, nbytes, duration) / waves
        op = KernelOp(stream, on_complete, name, fp, blocks, block_time, launch_id, instrumented, group)
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

    def _blocks_per_sm(self, fp: Footprint) -> int:
        n = self._waves_cache.get(fp)
        if n is None:
            n = self._waves_cache[fp] = min(limits_per_resource(self.spec, fp).values())
        return n

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
        progressed = True
        while progressed and active:
            # A kernel whose last block is placed leaves its queue; the op behind it may
            # then become dispatchable, so passes repeat until one changes nothing.
            progressed = False
            for k in tuple(active):
                self._place(k)
                if not k.unplaced:
                    active.remove(k)
                    qi = k.stream % self.nq
                    self.queues[qi].popleft()
                    self._advance(qi)
                    progressed = True
        for s in self._dirty:
            self._is_dirty[s] = False
        self._is_dirty_np[:] = False
        self._dirty.clear()

    def _place(self, k: KernelOp) -> None:
        # A kernel that found every SM full last time can only fit where room appeared.
        if k.blocked:
            if not self._dirty:
                return
            wave = k.unplaced > FEW_BLOCKS and len(self._dirty) > FEW_BLOCKS
        else:
            wave = k.unplaced > FEW_BLOCKS
        if wave:
            self._place_wave(k)
            return
        cands = self._dirty if k.blocked else self._rotations[self._rr]
        fp = k.fp
        fit = self.res.fit
        need = k.unplaced
        caps = []
        got = 0
        for s in cands:
            c = fit(s, fp)
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
        self._start_blocks(k, caps)
        self._placed(k, caps[-1][0])

    def _place_wave(self, k: KernelOp) -> None:
        """:meth:`_place` for many blocks: every SM in a few vector operations."""
        caps = self.res.fit_all(k.fp)
        order = self._rotations_np[self._rr]
        if k.blocked:
            order = order[self._is_dirty_np[order]]
        c = caps[order]
        sel = c > 0
        if not sel.any():
            k.blocked = True
            return
        sms, ns = order[sel], _water_fill_np(c[sel], k.unplaced)
        if not ns.all():
            keep = ns > 0
            sms, ns = sms[keep], ns[keep]
        self._start_wave(k, sms, ns)
        self._placed(k, int(sms[-1]))

    def _placed(self, k: KernelOp, last_sm: int) -> None:
        self._rr = (last_sm + 1) % self.n_sm
        if k.blocked:
            self._prune_dirty()
        k.blocked = k.unplaced > 0

    def _prune_dirty(self) -> None:
        """Drop SMs that can hold no block at all any more, so the kernels waiting
        after this one do not scan them."""
        blocks, warps, is_dirty = self.res.blocks, self.res.warps, self._is_dirty
        keep = []
        for s in self._dirty:
            if blocks[s] and warps[s]:
                keep.append(s)
            else:
                is_dirty[s] = False
                self._is_dirty_np[s] = False
        self._dirty[:] = keep

    def _start_blocks(self, k: KernelOp, caps: list[tuple[int, int]]) -> None:
        """Place ``n`` blocks of ``k`` on each SM ``s`` of ``caps``, at once.

        Blocks placed together last equally long, so one event ends them all (per SM
        when ``jitter`` gives each group its own duration)."""
        now = self.loop.now
        fp = k.fp
        take = self.res.take
        instrumented = k.instrumented
        groups = []
        placed = 0
        for s, n in caps:
            c0 = k.started
            k.started = c0 + n
            placed += n
            if instrumented:
                self._post(_PLACE, s, c0, n, k)
            groups.append((s, n, take(s, fp, n)))
        self._started(k, now, placed)
        d = k.block_time
        if self.jitter:
            for g in groups:
                self.loop.at(now + d * self.rng.lognormvariate(0.0, self.jitter), self._blocks_done, (k, (g,)))
        else:
            self.loop.at(now + d, self._blocks_done, (k, groups))

    def _start_wave(self, k: KernelOp, sms: np.ndarray, ns: np.ndarray) -> None:
        """:meth:`_start_blocks` for many SMs, as arrays."""
        now = self.loop.now
        split = self.res.take_many(sms, k.fp, ns)
        placed = int(ns.sum())
        if k.instrumented:
            self._post_wave(_PLACE, sms, ns, k.started, k)
        k.started += placed
        self._started(k, now, placed)
        d = k.block_time
        if self.jitter:
            for i, f in enumerate(self.np_rng.lognormal(0.0, self.jitter, len(sms))):
                self.loop.at(now + d * f, self._wave_done, (k, sms[i:i + 1], ns[i:i + 1], split[i:i + 1]))
        else:
            self.loop.at(now + d, self._wave_done, (k, sms, ns, split))

    def _started(self, k: KernelOp, now: float, placed: int) -> None:
        if k.t_first < 0:
            k.t_first = now
        k.unplaced -= placed
        self.placements += placed
        self._account(now, placed)

    def _blocks_done(self, event: tuple) -> None:
        k, groups = event
        give = self.res.give
        fp = k.fp
        ended = 0
        for s, n, split in groups:
            give(s, fp, n, split)
            self._mark_dirty(s)
            c0 = k.ended
            k.ended = c0 + n
            ended += n
            if k.instrumented:
                self._post(_DONE, s, c0, n, k)
        self._ended(k, ended)

    def _wave_done(self, event: tuple) -> None:
        k, sms, ns, split = event
        self.res.give_many(sms, k.fp, ns, split)
        for s in sms.tolist():
            self._mark_dirty(s)
        if k.instrumented:
            self._post_wave(_DONE, sms, ns, k.ended, k)
        ended = int(ns.sum())
        k.ended += ended
        self._ended(k, ended)

    def _mark_dirty(self, s: int) -> None:
        if not self._is_dirty[s]:
            self._is_dirty[s] = True
            self._is_dirty_np[s] = True
            self._dirty.append(s)

    def _ended(self, k: KernelOp, ended: int) -> None:
        self.events += 1
        self._account(self.loop.now, -ended)
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
    def _post(self, kind_bits: int, sm: int, c0: int, n: int, k: KernelOp) -> None:
        """Write the entries the device header would write for blocks c0+1..c0+n."""
        g = k.group
        total = k.total
        end = c0 + n
        base = kind_bits | (sm << protocol.SM_SHIFT) | k.launch_id
        nxt = (c0 // g + 1) * g
        while nxt <= end:
            self._write(base | (g << protocol.COUNT_SHIFT))
            nxt += g
        if end == total and total % g:
            self._write(base | ((total % g) << protocol.COUNT_SHIFT))

    def _post_wave(self, kind_bits: int, sms: np.ndarray, ns: np.ndarray, c0: int, k: KernelOp) -> None:
        """:meth:`_post` for blocks c0+1.. spread over SMs ``sms`` (``ns`` each), in order:
        the block whose counter value is a multiple of the group, or the last, posts."""
        g = k.group
        ends = c0 + np.cumsum(ns)
        end = int(ends[-1])
        values = np.arange((c0 // g + 1) * g, end + 1, g)
        who = sms[np.searchsorted(ends, values)]
        words = (kind_bits | k.launch_id | (g << protocol.COUNT_SHIFT)) | (who << protocol.SM_SHIFT)
        if end == k.total and k.total % g:
            last = kind_bits | k.launch_id | ((k.total % g) << protocol.COUNT_SHIFT) | (int(sms[-1]) << protocol.SM_SHIFT)
            words = np.append(words, last)
        if len(words):
            self._write_many(words)

    def _write_many(self, words: np.ndarray) -> None:
        slots = (self.tail + np.arange(len(words))) & self.mask
        if self.ring[slots].any():
            raise self._overrun(int(slots[np.nonzero(self.ring[slots])[0][0]]))
        self.ring[slots] = words.astype(np.uint64)
        self.tail += len(words)

    def _overrun(self, slot: int) -> NotifQOverrun:
        return NotifQOverrun(
            f"notifQ overrun at slot {slot} (entry {self.tail}): the reader has not consumed "
            f"it; the dispatcher must bound outstanding blocks to fewer than "
            f"{self.mask + 1} ring slots' worth of notifications")

    def _write(self, word: int) -> None:
        slot = self.tail & self.mask
        if self.ring[slot]:
            raise self._overrun(slot)
        self.ring[slot] = word
        self.tail += 1

    # -- statistics -----------------------------------------------------------------
    def _account(self, now: float, delta: int) -> None:
        self._resident_area += self.resident * (now - self._last_t)
        self._last_t = now
        self.resident += delta

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


def _water_fill_np(caps: np.ndarray, need: int) -> np.ndarray:
    """:func:`_water_fill` on an array of capacities; returns blocks per SM."""
    if caps.sum() <= need:
        return caps
    out = np.zeros_like(caps)
    if len(caps) >= need:
        out[:need] = 1
        return out
    level = 0
    while np.minimum(caps, level + 1).sum() <= need:
        level += 1
    out = np.minimum(caps, level)
    extra = need - int(out.sum())
    out[np.nonzero(caps > level)[0][:extra]] += 1
    return out


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

