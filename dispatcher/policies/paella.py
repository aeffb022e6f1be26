"""``paella`` (the default, §6): SRPT on the estimated remaining time, bounded by
deficit counters.

* **SRPT.** Ready jobs sit in a heap keyed by their remaining-time estimate
  (:mod:`paella.dispatcher.profile`), ties to the earlier arrival.
* **Deficits.** Each fairness *unit* (a client, the paper's "user", by default;
  ``fairness_unit="job"`` gives every job its own) has a deficit. When a kernel of unit u is released, u's deficit
  drops by 1 - 1/n and every other unit's rises by 1/n, n being the units with
  unfinished jobs. If the highest deficit among units with a ready kernel exceeds
  ``fairness_threshold``, that unit's oldest ready job is picked; otherwise SRPT's.
* **O(log n) per decision.** As in the paper, deficits are stored as ``s_u`` with
  ``deficit_u = s_u + G``: a release adds 1/n to the global offset ``G`` and subtracts
  1 from ``s_u`` (O(1)), and a max-heap of ``s_u`` over ready units (lazy deletion)
  finds the highest. ``G`` is folded back into every ``s_u`` when it grows large (the
  paper's O(n) reset on underflow), so floats never lose precision.

Decisions on the paper's open points (docs/policies.md): deficits are charged per
kernel, not per block; a unit enters with deficit 0 and leaves (forgetting its
deficit) when its last job finishes, so idle units accrue nothing; "oldest job" is
the unit's earliest-arrived job with a ready kernel.
"""
from __future__ import annotations

import heapq
import itertools
from typing import Any

from .base import Policy, PolicyError, register_policy

#: Default fairness threshold, in kernels' worth of deficit. A client starved while
#: the others release K kernels reaches a deficit near K/n (n active clients), so with
#: two clients a long job waits at most about 2 x 32 kernels of the other client (a few
#: ResNet-18 requests) before its client's oldest job is served.
DEFAULT_FAIRNESS_THRESHOLD = 32.0
_REBASE = 1e9


class _Unit:
    __slots__ = ("key", "s", "ver", "nready", "ready", "jobs", "seq")

    def __init__(self, key: Any, s: float, seq: int):
        self.key = key
        self.s = s
        self.ver = 0
        self.nready = 0
        self.ready: list = []       # (arrival seq, pver, job), lazy deletion
        self.jobs = 0
        self.seq = seq


@register_policy("paella")
class Paella(Policy):
    def __init__(self, dispatcher: Any = None, *, fairness_threshold: float | None = None,
                 fairness_unit: str = "client", **options: Any):
        super().__init__(dispatcher, **options)
        if fairness_threshold is None:
            fairness_threshold = DEFAULT_FAIRNESS_THRESHOLD
        if not fairness_threshold >= 0:
            raise PolicyError(f"fairness_threshold must be >= 0, got {fairness_threshold}")
        if fairness_unit not in ("job", "client"):
            raise PolicyError(f"fairness_unit must be 'job' or 'client', got {fairness_unit!r}")
        self.threshold = float(fairness_threshold)
        self.by_client = fairness_unit == "client"
        self.srpt: list = []        # (remaining, arrival seq, pver, job)
        self.dheap: list = []       # (-s, unit seq, unit ver, unit)
        self.units: dict[Any, _Unit] = {}
        self.G = 0.0
        self.live = 0
        self._useq = itertools.count()

    # -- hooks ----------------------------------------------------------------------------
    def job_arrived(self, job: Any) -> None:
        key = job.client_id if self.by_client else job
        unit = self.units.get(key)
        if unit is None:
            unit = self.units[key] = _Unit(key, -self.G, next(self._useq))
        unit.jobs += 1
        job.punit = unit

    def kernel_ready(self, job: Any) -> None:
        job.pver += 1
        job.queued = True
        self.live += 1
        pver = job.pver
        heapq.heappush(self.srpt, (job.remaining, job.seq, pver, job))
        unit = job.punit
        heapq.heappush(unit.ready, (job.seq, pver, job))
        unit.nready += 1
        if unit.nready == 1:
            self._push_unit(unit)
        if len(self.srpt) > 2 * self.live + 64:
            self._compact()

    def pick(self) -> Any:
        dheap = self.dheap
        while dheap:
            neg_s, _, ver, unit = dheap[0]
            if ver == unit.ver and unit.nready:
                if self.G - neg_s > self.threshold:
                    return self._oldest(unit)
                break
            heapq.heappop(dheap)
        srpt = self.srpt
        while srpt:
            top = srpt[0]
            job = top[3]
            if top[2] == job.pver and job.queued:
                return job
            heapq.heappop(srpt)
        return None

    def released(self, job: Any, op: Any) -> None:
        unit = job.punit
        self._unqueue(job)
        # Deficits: everyone +1/n (the offset), the releasing unit -1.
        self.G += 1.0 / len(self.units)
        unit.s -= 1.0
        if unit.nready:
            self._push_unit(unit)
        if self.G > _REBASE or len(self.dheap) > 2 * len(self.units) + 64:
            self._rebase()

    def job_finished(self, job: Any) -> None:
        if job.queued:
            self._unqueue(job)
        unit = job.punit
        unit.jobs -= 1
        if unit.jobs == 0:
            del self.units[unit.key]
            unit.ver += 1

    # -- inspection (tests, docs) -----------------------------------------------------------
    def deficit(self, job_or_client: Any) -> float:
        unit = self.units[job_or_client]
        return unit.s + self.G

    # -- helpers ----------------------------------------------------------------------------
    def _oldest(self, unit: _Unit) -> Any:
        ready = unit.ready
        while ready:
            _, pver, job = ready[0]
            if pver == job.pver and job.queued:
                return job
            heapq.heappop(ready)
        raise AssertionError("unit counted as ready has no ready job")

    def _push_unit(self, unit: _Unit) -> None:
        unit.ver += 1
        heapq.heappush(self.dheap, (-unit.s, unit.seq, unit.ver, unit))

    def _unqueue(self, job: Any) -> None:
        job.queued = False
        job.pver += 1
        self.live -= 1
        unit = job.punit
        unit.nready -= 1
        if unit.nready == 0:
            unit.ver += 1
            unit.ready.clear()

    def _rebase(self) -> None:
        """Fold G into every s_u and rebuild the deficit heap without stale entries."""
        g = self.G
        self.G = 0.0
        for unit in self.units.values():
            unit.s += g
        self.dheap = []
        for unit in self.units.values():
            if unit.nready:
                self._push_unit(unit)

    def _compact(self) -> None:
        self.srpt = [e for e in self.srpt if e[2] == e[3].pver and e[3].queued]
        heapq.heapify(self.srpt)
