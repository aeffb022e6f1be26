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

**The launch record.** What the tracker knows of a kernel launch is a :class:`Demand`
(``blocks``, per-block ``warps``/``regs``/``smem``, and the notifQ ``entries`` it may post),
made once per launch shape by :meth:`Tracker.demand`. ``release(demand, token)`` returns
the launch id and keeps ``token`` (the dispatcher's op) opaque; ``drain`` hands it back.
The tracker reads and writes no attribute of any Python object.

**Aggregation.** With groups of g blocks (the compiler's default 16), an entry names
only the posting block's SM, so the whole group is attributed to that SM: per-SM
figures are approximate (an SM may even show more than it can hold), while totals lag
the truth by fewer than g blocks per in-flight kernel (placements and completions not
yet reported). With g = 1 both are exact.

**The +B rule** (§6 (3)). The tracker also keeps the blocks released but not yet
placed (``unplaced``) and their resource demand. :meth:`admits` asks whether the
unplaced blocks *plus the candidate's* that the free resources cannot hold now stay
within B::

    demand_r = unplaced demand of r + the candidate's need of r
    waiting  = (unplaced + n) * max(0, max over resources r of (demand_r - free_r) / demand_r)
    admit  iff  waiting <= B  or  (unplaced == 0 and (B > 0 or nothing is resident))

So at B = 0 a kernel goes only when all of it can be placed at once (or the GPU is
idle): no kernel ever waits in a hardware queue behind resident work. The check is on
GPU-wide totals (O(1) per decision, no per-SM scan); it ignores fragmentation across
SMs, which B covers. A kernel larger than the free resources is released when nothing
else is unplaced and then runs in waves, holding further releases back until its own
unplaced blocks fall below B. :meth:`starts_now` (would one block be placed at once?)
lets a policy keep B's slack from reordering its choices (``paella``'s order rule).

:meth:`admits_after` (``demand``, ``pred``, ``pred_launch_id=-1``) is the same rule for a
launch queued behind ``pred`` on its stream (the dispatcher's lookahead): it cannot start
before ``pred`` ends, so ``pred``'s resources count as free and its blocks as no longer
unplaced. If ``pred`` is itself deferred (below), it is judged as if it counted.

**Deferred launches** (the lookahead). ``release(demand, token, behind=lid)`` names the
running kernel that the new launch is queued behind on its stream: it cannot start
before that kernel ends, so its blocks are not work waiting for free resources yet. They
stay out of ``unplaced`` (and of the +B rule, ``fits_now`` and ``starts_now``) until that
kernel's last block completes, or until a block of the new launch is reported placed,
whichever the notifQ shows first. Counted at once, every job's looked-ahead kernel held
the other jobs' releases back: ``paella`` at lookahead 2 served 561 of Figure 11's 800
requests/s (docs/dispatcher.md, "Lookahead").

**Flow control.** A launch of n blocks posts at most ``2*ceil(n/g)`` entries. The
tracker admits a launch only while the entries not yet consumed, plus the new ones,
fit in the ring, so the device can never overrun an unread slot. Launch ids carry a
counter-pair slot in their low bits (``paella.protocol``'s region layout), taken from a
free list, so no two launches in flight share a counter pair.

**Where the work is done.** What runs per notification and per release (``drain``,
``admits``, ``admits_after``, ``flow_ok``, ``fits_now``, ``starts_now``, ``release``, ``unrelease``) is the C type
:class:`paella.dispatcher._tracker.TrackerCore` (``dispatcher/_tracker.c``), which keeps
each launch in flight in arrays indexed by its counter pair: in Python these cost
about 1.5 us per kernel in attribute reads and integer boxing. :class:`Tracker`, its
subclass here, checks the arguments, makes :class:`Demand` records and answers the
inspection queries; the rules above are the contract of both halves.
"""

from __future__ import annotations

from paella import protocol
from paella.gpus import GpuSpec
from paella.occupancy import sub_partitions

from paella.occupancy import Footprint

from .native import load

_native = load("_tracker")
TrackerCore = _native.TrackerCore
#: ``Demand(blocks, warps, regs, smem, entries)``: one launch's demand (C, immutable).
Demand = _native.Demand

#: The notification word's layout, as the C half decodes it.
_LAYOUT = (protocol.KIND_SHIFT, protocol.SM_SHIFT, protocol.COUNT_SHIFT, protocol.LAUNCH_MASK,
           protocol.PLACEMENT, protocol.COMPLETION)


class Tracker(TrackerCore):
    """Resident usage from the notifQ, the +B rule and flow control (module docstring).

    Per kernel, on a :class:`Demand`: ``admits(d)`` / ``flow_ok(d)`` / ``fits_now(d)`` /
    ``starts_now(d)`` -> bool, ``release(d, token, behind=-1)`` -> launch id,
    ``unrelease(launch_id)``,
    and ``drain(now, on_done, on_start=None)`` -> entries consumed, which calls, after the
    whole batch is applied, ``on_start(token)`` for each launch whose first block was
    reported placed (only when ``on_start`` is given: nothing is collected otherwise) and
    ``on_done(token, t_first)`` for each launch whose last block completed, in completion
    order (``t_first``: the drain time of its first placement). An entry naming no launch
    in flight, an unknown kind, a non-existent SM, a block count outside 1..group or more
    blocks than its launch has is consumed and raises RuntimeError, after the launches
    before it are reported. A callback that raises does not stop the others: every
    launch is reported, and the first error is raised at the end (later ones go to
    ``sys.unraisablehook``). ``unrelease`` is only for a launch none of whose blocks have
    been placed (the device refused it). ``progress(launch_id)`` -> ``(placed, ended,
    t_first)``. Every method refuses a tracker whose ``__init__`` failed.
    Read-only figures: ``head``, ``slots``, ``blocks``/``warps``/``regs``/``smem``
    (resident), ``unplaced``/``d_warps``/``d_regs``/``d_smem`` (released, not placed),
    ``deferred`` (blocks released behind a running kernel, module docstring), ``cap``,
    ``pending_entries``; ``extra_blocks`` (B) may be changed."""

    def __init__(self, spec: GpuSpec, notifq, *, extra_blocks: int, group: int,
                 counter_pairs: int = protocol.DEFAULT_COUNTER_PAIRS):
        if extra_blocks < 0:
            raise ValueError(f"extra_blocks (B) must be >= 0, got {extra_blocks}")
        if not 1 <= group <= protocol.MAX_GROUP:
            raise ValueError(f"notification group must be 1..{protocol.MAX_GROUP}, got {group}")
        if counter_pairs < 1 or counter_pairs & (counter_pairs - 1):
            raise ValueError(f"counter pairs must be a power of two, got {counter_pairs}")
        n = spec.sm_count
        if n > protocol.BYTE_MASK + 1:
            raise ValueError(f"a notification names SMs 0..{protocol.BYTE_MASK}; this GPU has {n}")
        parts = sub_partitions(spec)
        # Capacity of the whole GPU, in the four resources (blocks, warps, regs, smem).
        cap = (n * spec.max_blocks_per_sm, n * spec.max_warps_per_sm,
               n * (spec.regs_per_sm // parts) * parts, n * spec.smem_per_sm)
        super().__init__(notifq, cap, n, extra_blocks, group, counter_pairs, _LAYOUT)
        self.spec = spec

    # -- release side ---------------------------------------------------------------------
    def entries_for(self, blocks: int) -> int:
        """notifQ entries a launch of ``blocks`` blocks may post (placements and
        completions, one per group)."""
        return 2 * (-(-blocks // self.group))

    def demand(self, fp: Footprint, blocks: int) -> "Demand":
        """The launch record of ``blocks`` blocks of footprint ``fp`` (``fp.regs`` is a
        computed property: flattened here once, not per decision)."""
        return Demand(blocks, fp.warps, fp.regs, fp.smem, self.entries_for(blocks))

    # -- inspection -----------------------------------------------------------------------
    @property
    def notifications(self) -> int:
        """Entries consumed since the tracker started (the head starts at 0)."""
        return self.head

    @property
    def launches(self) -> dict:
        """The tokens of the launches in flight by launch id (a snapshot, for tests and
        inspection)."""
        return self.tokens_in_flight()

    # Per-SM usage of each resource (lists, snapshots), in the C half's order.
    sm_blocks = property(lambda self: self._sm_usage(0))
    sm_warps = property(lambda self: self._sm_usage(1))
    sm_regs = property(lambda self: self._sm_usage(2))
    sm_smem = property(lambda self: self._sm_usage(3))

    def used(self) -> dict[str, int]:
        """Totals in the keys of :meth:`paella.occupancy.SMResources.used`."""
        return {"blocks": self.blocks, "warps": self.warps, "registers": self.regs,
                "shared_memory": self.smem}
