"""``paella`` (the default, §6): SRPT on the estimated remaining time, bounded by
deficit counters.

* **SRPT.** Ready jobs sit in a heap keyed by their remaining-time estimate
  (:mod:`paella.dispatcher.profile`), ties to the earlier arrival.
* **Deficits** (the paper's update rule). Each fairness *unit* has a deficit; when a
  kernel of unit u is released, u's deficit drops by 1 - 1/n and every other unit's
  rises by 1/n, n being the units with unfinished jobs.
* **Past the threshold.** If the highest deficit among units with a ready kernel
  reaches ``fairness_threshold`` (``>=``, so that at 0 a lone job's deficit of 0,
  which stays 0 while it runs alone, already counts and a newcomer cannot overtake it):

  - ``fairness_unit="job"`` (the default; every job is a unit, as in the paper's
    implementation, which shifts by 1/#jobs): the **oldest ready job** goes next,
    whichever unit is over. Threshold 0 is therefore arrival order (Paella-SS's order,
    kernel by kernel), a large threshold is SRPT, and in between a job is overtaken
    by about n x threshold kernels at most before arrival order takes over.
  - ``fairness_unit="client"`` (the paper's "user"): the oldest ready job *of the
    client with the highest deficit*. This enforces equal kernel shares between
    clients whatever their request rates: threshold 0 is a kernel-level round robin
    between clients, which is FIFO only if the clients send similar mixes.
* **O(log n) per decision.** As in the paper, deficits are stored as ``s_u`` with
  ``deficit_u = s_u + G``: a release adds 1/n to the global offset ``G`` and subtracts
  1 from ``s_u`` (O(1)). The SRPT order, the ready units by ``s_u`` (highest first)
  and the hold rule's live jobs are indexed heaps (:mod:`paella.dispatcher.pqueue`),
  re-keyed or removed in place; the arrival order of ready jobs (one per client in
  client mode) is a heap with one entry per job. ``G`` is folded back into every
  ``s_u`` when it passes 1e9 (the paper's O(n) reset: the deficit heap's keys shift by
  the same amount), so floats never lose precision.

* **The order rule** (Figure 1's ideal schedule). B's slack (the +B rule) lets a kernel
  that cannot start now wait in a hardware queue, whose FIFO then places it ahead of
  whatever is picked next. So when a live job that comes before the SRPT pick is
  between two of its kernels and not one block of the pick's kernel can be placed now
  (``Tracker.starts_now``), ``pick()`` returns None: the kernel goes once it can start,
  or once its job is the most urgent live one. The fairness path is never held.
* **The hold rule** (``hold_factor``, beyond the paper). Blocks cannot be preempted, so
  SRPT alone cannot protect a short job between two of its kernels: the GPU is
  backfilled meanwhile, and a long job's big kernel released then makes the short job's
  next kernel wait for it. When the SRPT pick's next kernel (a) is expected to last
  longer than ``hold_factor`` x the whole estimated time of the in-flight job with the
  least remaining work (ready or not, if that is less than the pick's), and (b) would
  not fit in the resources free now, ``pick()`` returns None until that job is done.
  The fairness path is never held, so deficits still bound starvation. Cost: every
  live job sits in one more heap, re-keyed at each of its releases.
* **The saturation rule** (the dispatcher's, ``saturation_backlog``): while more jobs
  wait for a release than that backlog, neither rule above holds anything back
  (``Dispatcher.saturated``), as the +B rule does not: see docs/dispatcher.md.

Decisions on the paper's open points (docs/policies.md): deficits are charged per
kernel, not per block (a batched job serving several clients charges each client its
requests' fraction of every kernel, in client mode); a unit enters with deficit 0 and leaves (forgetting its
deficit) when its last job finishes, so idle units accrue nothing; "oldest job" is
the earliest-arrived job with a ready kernel.
"""
from __future__ import annotations

import itertools
from heapq import heapify, heappop, heappush
from typing import Any

from ..pqueue import IndexedHeap
from .base import Policy, PolicyError, class_key
from .registry import register_policy

#: Default fairness threshold, in kernels' worth of deficit. A unit starved while the
#: others release K kernels reaches a deficit near K/n (n units with unfinished jobs),
#: so a job is overtaken by about n x 256 kernels at most before arrival order takes
#: over. Lower values turn the policy into arrival order at load: with ~20 jobs in flight
#: (Figure 11's mix at 300 req/s) a threshold of 64 is reached after ~1,300 releases
#: (~50 ms), forced releases then happen all the time, and MobileNetV2's p99 is 66 ms
#: against 9.5 ms at 256 (docs/policies.md, "Default threshold").
DEFAULT_FAIRNESS_THRESHOLD = 256.0
#: Default fairness unit: every job is its own unit (the paper's implementation, which
#: shifts by 1/#jobs). See the module docstring for what ``"client"`` changes.
DEFAULT_FAIRNESS_UNIT = "job"
#: Default hold factor (the hold rule, module docstring): a kernel that would fill the
#: GPU and is expected to last longer than half of a shorter in-flight job's whole
#: estimated time waits while that job runs. Measured choice: docs/policies.md.
DEFAULT_HOLD_FACTOR = 0.5
_REBASE = 1e9


class _JobState:
    """The policy's own record of a live job (``job.policy_state``): its fairness unit,
    whether it is queued (has a ready kernel announced), whether it has a fifo entry;
    ``shares`` (client mode, a batched job serving several clients): each client's unit
    and the fraction of every release it is charged (its requests over the job's)."""
    __slots__ = ("unit", "queued", "infifo", "shares")

    def __init__(self, unit: "_Unit"):
        self.unit = unit
        self.queued = False
        self.infifo = False
        self.shares: "list[tuple[_Unit, float]] | None" = None


class _Unit:
    __slots__ = ("key", "s", "nready", "ready", "jobs", "seq")

    def __init__(self, key: Any, s: float, seq: int):
        self.key = key
        self.s = s
        self.nready = 0
        self.ready: list = []       # client mode's fifo: (arrival seq, job), see kernel_ready
        self.jobs = 0
        self.seq = seq


@register_policy("paella")
class Paella(Policy):
    """The hot path (``kernel_ready``, ``pick``, ``released``: once per kernel) is
    inlined and written for speed; the order it gives is the module docstring's.

    * ``srpt`` (queued jobs by ``(remaining, seq)``), ``inflight`` (live jobs, the
      same key as of their last release) and ``dheap`` (units with a queued job by
      ``(-s_u, unit seq)``) are :class:`~paella.dispatcher.pqueue.IndexedHeap` s: a
      release removes or re-keys in place, so nothing stale is ever skipped or
      compacted.
    * ``fifo`` (client mode: the unit's ``ready``): arrival order is a constant key, so
      a job keeps one ``(seq, job)`` heapq entry (its state's ``infifo``) from its first ready
      kernel until the entry reaches the top while the job is not queued; a queued job
      always has its entry. One push per job, not per kernel.
    * ``_share`` (1/#units, read at every release) is kept up to date where units come
      and go.
    """

    def __init__(self, dispatcher: Any = None, *, fairness_threshold: float | None = None,
                 fairness_unit: str = DEFAULT_FAIRNESS_UNIT,
                 hold_factor: float | None = DEFAULT_HOLD_FACTOR, **options: Any):
        super().__init__(dispatcher, **options)
        if fairness_threshold is None:
            fairness_threshold = DEFAULT_FAIRNESS_THRESHOLD
        if not fairness_threshold >= 0:
            raise PolicyError(f"fairness_threshold must be >= 0, got {fairness_threshold}")
        if fairness_unit not in ("job", "client"):
            raise PolicyError(f"fairness_unit must be 'job' or 'client', got {fairness_unit!r}")
        if hold_factor is not None and not hold_factor >= 0:
            raise PolicyError(f"hold_factor must be >= 0 (0 or None: never hold), got {hold_factor}")
        self.threshold = float(fairness_threshold)
        self.by_client = fairness_unit == "client"
        self.hold = hold_factor or None    # 0, False (TOML) and None turn the rule off
        self.inflight = IndexedHeap()       # every live job, by (remaining, seq)
        self.n_live_jobs = 0
        #: Live jobs per class (level -> count): the class rule of pick().
        self.live_levels: dict[int, int] = {}
        self.srpt = IndexedHeap()           # queued jobs, by (class, remaining ns; seq)
        self.fifo: list = []        # (arrival seq, job): job mode's fairness pick
        self.dheap = IndexedHeap()          # units with a queued job, by (-s, unit seq)
        self.units: dict[Any, _Unit] = {}
        self.G = 0.0
        self._share = 0.0           # 1.0 / len(self.units)
        self._useq = itertools.count()

    # -- hooks ----------------------------------------------------------------------------
    def job_arrived(self, job: Any) -> None:
        key = job.client_id if self.by_client else job
        unit = self._unit(key)
        unit.jobs += 1
        job.policy_state = st = _JobState(unit)
        reqs = getattr(job, "requests", ())
        if self.by_client and len(reqs) > 1:
            counts: dict[Any, int] = {}
            for r in reqs:
                counts[r.client_id] = counts.get(r.client_id, 0) + 1
            if len(counts) > 1:      # a batch of several clients: each is charged its part
                st.shares = []
                for cid, n in counts.items():
                    u = self._unit(cid)
                    if u is not unit:
                        u.jobs += 1
                    st.shares.append((u, n / len(reqs)))
        self.n_live_jobs += 1
        self.inflight.push(job, job.remaining, job.seq)
        lv = self.live_levels
        lv[job.level] = lv.get(job.level, 0) + 1

    def _unit(self, key: Any) -> "_Unit":
        unit = self.units.get(key)
        if unit is None:
            unit = self.units[key] = _Unit(key, -self.G, next(self._useq))
            self._units_changed()
        return unit

    def kernel_ready(self, job: Any) -> None:
        st = job.policy_state
        st.queued = True
        # Classes first (base.class_key): the class, then the estimate in whole ns.
        self.srpt.push(job, class_key(job.level, round(job.remaining * 1e9)), job.seq)
        unit = st.unit
        if not st.infifo:            # its (seq, job) entry in its fairness fifo
            st.infifo = True
            fifo = unit.ready if self.by_client else self.fifo
            heappush(fifo, (job.seq, job))
            if len(fifo) > 2 * self.n_live_jobs + 64:       # (once per job)
                self._compact_fifo(fifo)
        n = unit.nready + 1
        unit.nready = n
        if n == 1:
            self.dheap.push(unit, -unit.s, unit.seq)

    def pick(self) -> Any:
        dheap = self.dheap
        unit = dheap.top()
        if unit is not None and self.G - dheap.top_key() >= self.threshold:
            # Deficits act within the most urgent class waiting: a starved unit whose
            # oldest ready job is of a less urgent class waits for that class to drain.
            first = self._oldest(unit.ready if self.by_client else self.fifo)
            top = self.srpt.top()
            if top is None or first.level <= top.level:
                return first
        job = self.srpt.top()
        if job is None:
            return None
        op = job.ready[0]
        # (0) The class rule: while a job of a more urgent class is live (between two of
        # its kernels: it is not queued, or it would be the pick), no kernel of a less
        # urgent class goes. Blocks are not preempted: one would delay that job's next
        # kernel and share its SMs while it runs. (Measured: letting one go when all of
        # it fits beside what runs gave ResNet-18 1.21x its solo p99 beside ResNet-50,
        # this rule 1.05x, for the same best-effort throughput; docs/policies.md.)
        lv = self.live_levels
        if len(lv) > 1 and min(lv) < job.level:
            return None
        other = self.inflight.top()  # (never None: job is live)
        if other is job:
            return job
        # A live job comes before the pick in SRPT order and is between two of its
        # kernels (it is not queued, or it would be the pick). The pick's kernel must not
        # take the resources that job's next kernel will want:
        # (0) The saturation rule (Dispatcher.saturated): past the backlog, neither rule
        # below holds anything: the hardware queues are kept full.
        if getattr(self.dispatcher, "saturated", False):
            return job
        # (1) The order rule: a kernel that cannot start now would wait in a hardware
        # queue, and the hardware's FIFO would place it ahead of that job's next kernel.
        # Hold it; it goes once it can start, or once it is the most urgent live job.
        if not self._starts_now(op):
            return None
        # (2) The hold rule: blocks cannot be preempted, so a kernel that is long next
        # to that job and does not fit beside everything would make its next kernel
        # wait for it. Hold it back while that job runs.
        if (self.hold is None or not self.inflight.top_key() < job.remaining
                or other.level > job.level):          # (no hold for a less urgent class)
            return job
        stat = job.model.profile.kernels.get(op.key)
        if (stat is not None and stat.time > self.hold * other.estimate
                and self._fills_gpu(op)):
            return None
        return job

    def released(self, job: Any, op: Any) -> None:
        st = job.policy_state
        st.queued = False
        self.srpt.remove(job)
        unit = st.unit
        n = unit.nready - 1
        unit.nready = n
        if n == 0:
            self.dheap.remove(unit)
        self.inflight.push(job, job.remaining, job.seq)     # its estimate dropped: re-key
        # Deficits: everyone +1/n (the offset), the releasing unit -1.
        g = self.G = self.G + self._share
        if st.shares is None:
            unit.s -= 1.0
        else:                        # a batch of several clients: per request
            self._charge(st.shares)
        if n:
            self.dheap.push(unit, -unit.s, unit.seq)
        if g > _REBASE:
            self._rebase()

    def _charge(self, shares: "list[tuple[_Unit, float]]") -> None:
        """Charge one release to the clients of a batched job, each its requests'
        fraction; a unit with ready jobs moves in the deficit heap."""
        for u, part in shares:
            u.s -= part
            if u.nready:
                self.dheap.push(u, -u.s, u.seq)

    def job_finished(self, job: Any) -> None:
        st = job.policy_state
        unit = st.unit
        if st.queued:
            st.queued = False
            self.srpt.remove(job)
            unit.nready -= 1
            if unit.nready == 0:
                self.dheap.remove(unit)
        self.inflight.remove(job)
        lv = self.live_levels
        n = lv[job.level] - 1
        if n:
            lv[job.level] = n
        else:
            del lv[job.level]
        st.unit = None               # (job mode: unit.key is the job; no cycle left for the gc)
        self.n_live_jobs -= 1
        for u in {unit, *(u for u, _ in st.shares or ())}:
            u.jobs -= 1
            if u.jobs == 0:
                del self.units[u.key]
                self._units_changed()
        st.shares = None

    # -- inspection (tests, docs) -----------------------------------------------------------
    def deficit(self, job_or_client: Any) -> float:
        unit = self.units[job_or_client]
        return unit.s + self.G

    # -- helpers ----------------------------------------------------------------------------
    def _units_changed(self) -> None:
        n = len(self.units)
        if n:
            self._share = 1.0 / n

    def _starts_now(self, op: Any) -> bool:
        """Would a block of ``op``'s launch be placed at once? (Without a dispatcher, in
        unit tests of the order alone: assume it would.)"""
        return self.dispatcher is None or self.dispatcher.tracker.starts_now(op.launch.demand)

    def _fills_gpu(self, op: Any) -> bool:
        """Only a kernel that does not fit beside everything else can hold a shorter
        job's next kernel back (without a dispatcher, in unit tests: assume it does)."""
        return self.dispatcher is None or not self.dispatcher.tracker.fits_now(op.launch.demand)

    @staticmethod
    def _compact_fifo(fifo: list) -> None:
        """Drop the entries of jobs not queued (finished ones too), in place."""
        keep = []
        for e in fifo:
            st = e[1].policy_state
            if st is not None and st.queued:
                keep.append(e)
            elif st is not None:
                st.infifo = False
        heapify(keep)
        fifo[:] = keep

    @staticmethod
    def _oldest(fifo: list) -> Any:
        """The earliest-arrived queued job of a (seq, job) fifo; jobs not queued that
        reach the top leave it (they re-enter at their next ready kernel)."""
        while fifo:
            job = fifo[0][1]
            st = job.policy_state
            if st is not None and st.queued:
                return job
            heappop(fifo)
            if st is not None:
                st.infifo = False
        raise AssertionError("a unit counted as ready has no ready job")

    def _rebase(self) -> None:
        """Fold G into every s_u; the deficit heap's keys (-s_u) move by -G with them."""
        g = self.G
        self.G = 0.0
        for unit in self.units.values():
            unit.s += g
        self.dheap.shift(-g)
