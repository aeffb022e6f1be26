"""The occupancy tracker: what is resident on the GPU, learned from the notifQ (§5.2).

Every loop iteration :meth:`Tracker.drain` reads the notifQ from the dispatcher's head
until an INVALID slot, stores INVALID back, and applies each entry:

* PLACEMENT (sm, n, launch): n more blocks of that launch are resident on ``sm``;
* COMPLETION (sm, n, launch): n blocks left ``sm``; the launch is finished when all of
  its blocks have completed.

Usage is kept per SM and in total for the four resources of Table 1, in the same
granules as :class:`paella.occupancy.SMResources` (whole warps, registers per warp
rounded to 256, shared memory rounded to the allocation unit): a block of footprint
``fp`` counts 1 block, ``fp.warps`` warps, ``fp.regs`` registers, ``fp.smem`` bytes.

**Aggregation.** With groups of g blocks (the compiler's default 16), an entry names
only the posting block's SM, so the whole group is attributed to that SM: per-SM
figures are approximate (an SM may even show more than it can hold), while totals lag
the truth by fewer than g blocks per in-flight kernel (placements and completions not
yet reported). With g = 1 both are exact.

**The +B rule** (§6 (3)). The tracker also keeps the blocks released but not yet
placed (``unplaced``) and their resource demand. :meth:`admits` allows a release while
the unplaced blocks exceed what the free resources can hold by fewer than B blocks::

    excess = unplaced * max over resources r of (demand_r - free_r) / demand_r
    admit  iff  unplaced == 0  or  excess < B

The check is on GPU-wide totals (O(1) per decision, no per-SM scan); it ignores
fragmentation across SMs, which B covers. A kernel larger than the whole GPU is
released when nothing else is unplaced and then runs in waves, holding further
releases back until its own unplaced blocks fall below B.

**Flow control.** A launch of n blocks posts at most ``2*ceil(n/g)`` entries. The
tracker admits a launch only while the entries not yet consumed, plus the new ones,
fit in the ring, so the device can never overrun an unread slot. Launch ids carry a
counter-pair slot in their low bits (``paella.protocol``'s region layout), taken from a
free list, so no two launches in flight share a counter pair.
"""
from __future__ import annotations

from collections import deque
from typing import Callable

import numpy as np

from paella import protocol
from paella.gpus import GpuSpec
from paella.occupancy import sub_partitions

from .waitlist import Op

_KIND_SHIFT = protocol.KIND_SHIFT
_SM_SHIFT = protocol.SM_SHIFT
_COUNT_SHIFT = protocol.COUNT_SHIFT
_LAUNCH_MASK = protocol.LAUNCH_MASK
_PLACEMENT = protocol.PLACEMENT


class Tracker:
    def __init__(self, spec: GpuSpec, notifq: np.ndarray, *, extra_blocks: int, group: int,
                 counter_pairs: int = protocol.DEFAULT_COUNTER_PAIRS):
        if extra_blocks < 0:
            raise ValueError(f"extra_blocks (B) must be >= 0, got {extra_blocks}")
        if not 1 <= group <= protocol.MAX_GROUP:
            raise ValueError(f"notification group must be 1..{protocol.MAX_GROUP}, got {group}")
        if counter_pairs < 1 or counter_pairs & (counter_pairs - 1):
            raise ValueError(f"counter pairs must be a power of two, got {counter_pairs}")
        n = spec.sm_count
        self.spec = spec
        self.ring = notifq
        self.slots = notifq.size
        self.mask = notifq.size - 1
        self.head = 0
        self.extra_blocks = extra_blocks
        self.group = group
        # Capacity of the whole GPU, in the four resources (blocks, warps, regs, smem).
        self.cap = (n * spec.max_blocks_per_sm, n * spec.max_warps_per_sm,
                    n * (spec.regs_per_sm // sub_partitions(spec)) * sub_partitions(spec),
                    n * spec.smem_per_sm)
        # Resident usage: totals and per SM.
        self.blocks = self.warps = self.regs = self.smem = 0
        self.sm_blocks = [0] * n
        self.sm_warps = [0] * n
        self.sm_regs = [0] * n
        self.sm_smem = [0] * n
        # Released, not yet placed: block count and demand.
        self.unplaced = 0
        self.d_warps = self.d_regs = self.d_smem = 0
        # Flow control.
        self.pending_entries = 0
        self.launches: dict[int, Op] = {}
        self._id_shift = counter_pairs.bit_length() - 1
        self._id_mask = counter_pairs - 1
        self._free_ids: deque[int] = deque(range(counter_pairs))
        self._gen = [0] * counter_pairs
        self.notifications = 0

    # -- release side ---------------------------------------------------------------------
    def entries_for(self, blocks: int) -> int:
        g = self.group
        return 2 * (-(-blocks // g))

    def flow_ok(self, op: Op) -> bool:
        """May ``op`` be launched without risking a notifQ overrun?"""
        return bool(self._free_ids) and (
            self.pending_entries + self.entries_for(op.blocks) <= self.slots)

    def admits(self, op: Op) -> bool:
        """The +B rule (see the module docstring), then flow control."""
        u = self.unplaced
        if u:
            fp_excess = 0.0
            # Inlined over the four resources: this runs once per release decision.
            b, w, r, s = self.cap
            free = b - self.blocks
            frac = (u - free) / u
            if frac > fp_excess:
                fp_excess = frac
            if self.d_warps:
                frac = (self.d_warps - (w - self.warps)) / self.d_warps
                if frac > fp_excess:
                    fp_excess = frac
            if self.d_regs:
                frac = (self.d_regs - (r - self.regs)) / self.d_regs
                if frac > fp_excess:
                    fp_excess = frac
            if self.d_smem:
                frac = (self.d_smem - (s - self.smem)) / self.d_smem
                if frac > fp_excess:
                    fp_excess = frac
            if u * fp_excess >= self.extra_blocks:
                return False
        return self.flow_ok(op)

    def release(self, op: Op) -> int:
        """Account for launching ``op``; returns its launch id."""
        slot = self._free_ids.popleft()
        gen = self._gen[slot] = (self._gen[slot] + 1) & (_LAUNCH_MASK >> self._id_shift)
        lid = (gen << self._id_shift) | slot
        op.launch_id = lid
        op.placed = op.ended = 0
        self.launches[lid] = op
        n = op.blocks
        fp = op.fp
        self.unplaced += n
        self.d_warps += n * fp.warps
        self.d_regs += n * fp.regs
        self.d_smem += n * fp.smem
        self.pending_entries += self.entries_for(n)
        return lid

    def unrelease(self, op: Op) -> None:
        """Undo :meth:`release` for a launch the device refused."""
        n = op.blocks
        fp = op.fp
        self.unplaced -= n
        self.d_warps -= n * fp.warps
        self.d_regs -= n * fp.regs
        self.d_smem -= n * fp.smem
        self.pending_entries -= self.entries_for(n)
        self._finish(op)

    # -- notification side ----------------------------------------------------------------
    def drain(self, now: float, on_done: Callable[[Op], None]) -> int:
        """Consume every valid notifQ entry; ``on_done(op)`` for each finished launch.
        Returns the number of entries consumed."""
        ring = self.ring
        mask = self.mask
        head = self.head
        start = head
        launches = self.launches
        while True:
            i = head & mask
            w = int(ring[i])
            if not w:
                break
            ring[i] = 0                       # INVALID back: the slot is free again
            head += 1
            sm = (w >> _SM_SHIFT) & 0xFF
            n = (w >> _COUNT_SHIFT) & 0xFF
            op = launches.get(w & _LAUNCH_MASK)
            if op is None:
                raise RuntimeError(f"notifQ entry {w:#018x} names launch {w & _LAUNCH_MASK}, "
                                   f"which is not in flight (internal error, please report)")
            fp = op.fp
            if (w >> _KIND_SHIFT) == _PLACEMENT:
                if not op.placed:
                    op.t_first = now
                op.placed += n
                self._add(sm, n, fp.warps * n, fp.regs * n, fp.smem * n)
                self.unplaced -= n
                self.d_warps -= n * fp.warps
                self.d_regs -= n * fp.regs
                self.d_smem -= n * fp.smem
            else:
                op.ended += n
                self._add(sm, -n, -fp.warps * n, -fp.regs * n, -fp.smem * n)
                if op.ended == op.blocks:
                    self._finish(op)
                    on_done(op)
        self.head = head
        consumed = head - start
        self.pending_entries -= consumed
        self.notifications += consumed
        return consumed

    def _add(self, sm: int, b: int, w: int, r: int, s: int) -> None:
        self.blocks += b
        self.warps += w
        self.regs += r
        self.smem += s
        self.sm_blocks[sm] += b
        self.sm_warps[sm] += w
        self.sm_regs[sm] += r
        self.sm_smem[sm] += s

    def _finish(self, op: Op) -> None:
        lid = op.launch_id
        del self.launches[lid]
        self._free_ids.append(lid & self._id_mask)

    # -- reporting ------------------------------------------------------------------------
    def used(self) -> dict[str, int]:
        """Totals in the keys of :meth:`paella.occupancy.SMResources.used`."""
        return {"blocks": self.blocks, "warps": self.warps, "registers": self.regs,
                "shared_memory": self.smem}

    def in_flight(self) -> int:
        return len(self.launches)
