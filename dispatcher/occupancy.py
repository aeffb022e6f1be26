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
        # Speed: a memoryview reads a slot as a Python int in ~40 ns, numpy indexing in
        # ~300 ns (and stores INVALID back in ~35 ns against ~90 ns).
        self._slots_mv = memoryview(notifq)
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
        # Flow control: entries reserved by every launch so far; those not yet consumed
        # are ``pending_entries`` (reserved minus the head), so a drain updates neither.
        self._reserved = 0
        self._id_shift = counter_pairs.bit_length() - 1
        self._id_mask = counter_pairs - 1
        # Launches in flight, indexed by counter pair (the launch id's low bits): a list
        # lookup instead of a dict; the generation is checked against ``op.launch_id``.
        self._by_pair: list[Op | None] = [None] * counter_pairs
        self._free_ids: deque[int] = deque(range(counter_pairs))
        self._gen = [0] * counter_pairs
        self._gen_mask = _LAUNCH_MASK >> self._id_shift

    @property
    def pending_entries(self) -> int:
        """notifQ entries the launches in flight may still post (flow control)."""
        return self._reserved - self.head

    @property
    def notifications(self) -> int:
        """Entries consumed since the tracker started (the head starts at 0)."""
        return self.head

    @property
    def launches(self) -> dict[int, Op]:
        """Launches in flight by launch id (a snapshot, for tests and inspection)."""
        return {op.launch_id: op for op in self._by_pair if op is not None}

    # -- release side ---------------------------------------------------------------------
    def entries_for(self, blocks: int) -> int:
        return 2 * (-(-blocks // self.group))

    def prepare(self, op: Op) -> None:
        """Flatten ``op.fp`` (per-block warps, registers, smem) and count the notifQ
        entries its ``op.blocks`` may post: what the hot paths read. Done once per op,
        at issue; ops built by hand get it at their first admission check."""
        fp = op.fp
        op.fw, op.fr, op.fs = fp.warps, fp.regs, fp.smem
        op.entries = self.entries_for(op.blocks)

    def flow_ok(self, op: Op) -> bool:
        """May ``op`` be launched without risking a notifQ overrun?"""
        if not op.entries:
            self.prepare(op)
        return bool(self._free_ids) and self._reserved - self.head + op.entries <= self.slots

    def fits_now(self, op: Op) -> bool:
        """Would all of ``op``'s blocks fit in what is free now, after the blocks already
        released and not yet placed? (GPU-wide totals, like :meth:`admits`.) Policies use
        it to tell a kernel that runs beside everything from one that fills the GPU."""
        if not op.entries:
            self.prepare(op)
        n = op.blocks
        b, w, r, s = self.cap
        return (n <= b - self.blocks - self.unplaced
                and n * op.fw <= w - self.warps - self.d_warps
                and n * op.fr <= r - self.regs - self.d_regs
                and n * op.fs <= s - self.smem - self.d_smem)

    def admits(self, op: Op) -> bool:
        """The +B rule (see the module docstring), then flow control. O(1): every figure
        is a running total kept by :meth:`release` and :meth:`drain`."""
        u = self.unplaced
        if u:
            b, w, r, s = self.cap
            frac = (u - (b - self.blocks)) / u          # demand in blocks is u itself
            excess = frac if frac > 0.0 else 0.0
            dw = self.d_warps
            if dw:
                frac = (dw - (w - self.warps)) / dw
                if frac > excess:
                    excess = frac
            dr = self.d_regs
            if dr:
                frac = (dr - (r - self.regs)) / dr
                if frac > excess:
                    excess = frac
            ds = self.d_smem
            if ds:
                frac = (ds - (s - self.smem)) / ds
                if frac > excess:
                    excess = frac
            if u * excess >= self.extra_blocks:
                return False
        if not op.entries:
            self.prepare(op)
        return bool(self._free_ids) and self._reserved - self.head + op.entries <= self.slots

    def release(self, op: Op) -> int:
        """Account for launching ``op``; returns its launch id."""
        if not op.entries:
            self.prepare(op)
        slot = self._free_ids.popleft()
        gen = self._gen[slot] = (self._gen[slot] + 1) & self._gen_mask
        lid = (gen << self._id_shift) | slot
        op.launch_id = lid                    # (placed and ended start at 0: released once)
        self._by_pair[slot] = op
        n = op.blocks
        self.unplaced += n
        self.d_warps += n * op.fw
        self.d_regs += n * op.fr
        self.d_smem += n * op.fs
        self._reserved += op.entries
        return lid

    def unrelease(self, op: Op) -> None:
        """Undo :meth:`release` for a launch the device refused."""
        n = op.blocks
        self.unplaced -= n
        self.d_warps -= n * op.fw
        self.d_regs -= n * op.fr
        self.d_smem -= n * op.fs
        self._reserved -= op.entries
        self._finish(op)

    # -- notification side ----------------------------------------------------------------
    def drain(self, now: float, on_done: Callable[[Op], None]) -> int:
        """Consume every valid notifQ entry; then ``on_done(op)`` for each launch whose
        last block completed, in completion order. Returns the entries consumed.

        Speed: one pass of integer updates per entry on local variables, written back
        once. (A numpy scan of the batch was measured slower: finding the batch's end
        alone costs ~3 us per drain, while batches are a few entries long.)"""
        mv = self._slots_mv
        mask = self.mask
        head = self.head
        w = mv[head & mask]
        if not w:
            return 0
        start = head
        by_pair = self._by_pair
        id_mask = self._id_mask
        sm_b, sm_w, sm_r, sm_s = self.sm_blocks, self.sm_warps, self.sm_regs, self.sm_smem
        blocks, warps, regs, smem = self.blocks, self.warps, self.regs, self.smem
        unplaced, d_w, d_r, d_s = self.unplaced, self.d_warps, self.d_regs, self.d_smem
        finished = None
        free_id = self._free_ids.append
        bad = 0
        while w:
            mv[head & mask] = 0               # INVALID back: the slot is free again
            head += 1
            lid = w & _LAUNCH_MASK
            op = by_pair[lid & id_mask]
            if op is None or op.launch_id != lid:
                bad = w
                break
            sm = (w >> _SM_SHIFT) & 0xFF
            n = (w >> _COUNT_SHIFT) & 0xFF
            nw = n * op.fw
            nr = n * op.fr
            ns = n * op.fs
            if (w >> _KIND_SHIFT) == _PLACEMENT:
                if not op.placed:
                    op.t_first = now
                op.placed += n
                blocks += n
                warps += nw
                regs += nr
                smem += ns
                sm_b[sm] += n
                sm_w[sm] += nw
                sm_r[sm] += nr
                sm_s[sm] += ns
                unplaced -= n
                d_w -= nw
                d_r -= nr
                d_s -= ns
            else:
                blocks -= n
                warps -= nw
                regs -= nr
                smem -= ns
                sm_b[sm] -= n
                sm_w[sm] -= nw
                sm_r[sm] -= nr
                sm_s[sm] -= ns
                op.ended += n
                if op.ended == op.blocks:
                    by_pair[lid & id_mask] = None
                    free_id(lid & id_mask)
                    if finished is None:
                        finished = [op]
                    else:
                        finished.append(op)
            w = mv[head & mask]
        self.blocks, self.warps, self.regs, self.smem = blocks, warps, regs, smem
        self.unplaced, self.d_warps, self.d_regs, self.d_smem = unplaced, d_w, d_r, d_s
        self.head = head
        if finished is not None:
            for op in finished:
                on_done(op)
        if bad:
            raise RuntimeError(f"notifQ entry {bad:#018x} names launch {bad & _LAUNCH_MASK}, "
                               f"which is not in flight (internal error, please report)")
        return head - start

    def _finish(self, op: Op) -> None:
        slot = op.launch_id & self._id_mask
        self._by_pair[slot] = None
        self._free_ids.append(slot)

    # -- reporting ------------------------------------------------------------------------
    def used(self) -> dict[str, int]:
        """Totals in the keys of :meth:`paella.occupancy.SMResources.used`."""
        return {"blocks": self.blocks, "warps": self.warps, "registers": self.regs,
                "shared_memory": self.smem}

    def in_flight(self) -> int:
        """Launches in flight: the counter pairs taken."""
        return len(self._by_pair) - len(self._free_ids)
