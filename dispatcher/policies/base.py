"""The scheduling-policy interface (the registry is :mod:`.registry`).

A policy orders *jobs that have a ready kernel*; the dispatcher does everything else
(waitlists, occupancy, the +B rule, streams). Its hooks, all called by the dispatcher
loop only:

* ``job_arrived(job)``  a request's job was created;
* ``kernel_ready(job)`` the job has at least one ready kernel and is not queued;
* ``pick() -> job``     the job whose next ready kernel should be released, or None.
                        Must not change state: the release may be refused (+B);
* ``released(job, op)`` that kernel was released; the job leaves the queue (it comes
                        back through ``kernel_ready`` if it has more ready kernels);
* ``kernel_completed(job, op)`` a released kernel finished;
* ``job_finished(job)`` the job is gone (completed, failed or cancelled), queued or not.

Three class attributes tell the dispatcher how to release: ``gated`` (apply the +B
rule; False means release whatever is ready, letting the GPU schedule), ``stream_mode``
(see :mod:`paella.dispatcher.streams`) and ``eager`` (see :mod:`.waitlist`). A policy
keeps its per-job state in ``job.policy_state``, a slot that is its alone.
"""
from __future__ import annotations

from bisect import insort
from typing import Any

from ..pqueue import IndexedHeap


class PolicyError(ValueError):
    """An unknown policy name, a duplicate registration or a bad policy option."""


def check_declared(policy: "Policy") -> None:
    """What a built policy declares to the dispatcher is of the right type: a plug-in's
    ``gated = "no"`` would otherwise be taken as true. (Its ``stream_mode`` is checked
    by :class:`~paella.dispatcher.streams.StreamMap`.)"""
    for attr in ("gated", "eager"):
        value = getattr(policy, attr)
        if type(value) is not bool:
            raise PolicyError(f"policy {policy.name!r} declares {attr} = {value!r:.60}; it "
                              f"must be True or False")


class Policy:
    name = "base"
    gated = True
    stream_mode = "pool"
    eager = False

    def __init__(self, dispatcher: Any = None, **options: Any):
        if options:
            raise PolicyError(f"policy {self.name!r} takes no option(s) "
                              f"{', '.join(sorted(options))}")
        self.dispatcher = dispatcher

    def job_arrived(self, job: Any) -> None:
        pass

    def kernel_ready(self, job: Any) -> None:
        raise NotImplementedError("need kernel_ready")

    def pick(self) -> Any:
        raise NotImplementedError("need pick")

    def released(self, job: Any, op: Any) -> None:
        raise NotImplementedError("need released")

    def kernel_completed(self, job: Any, op: Any) -> None:
        pass

    def job_finished(self, job: Any) -> None:
        pass


#: Classes first (issue 38): every built-in policy orders by a job's priority class (1 the
#: most urgent .. 255; ``Job.level``), then by its own rule within the class. A heap key
#: is ``class * CLASS_SPAN + own key`` where the own key is a whole number (nanoseconds, a
#: sequence number, a turn) capped below CLASS_SPAN: 2**45 leaves 8 bits for the class
#: below 2**53, so the sum is exact in a double and orders (class, key) exactly.
CLASS_SPAN = 2 ** 45


def class_key(level: int, key: int | float) -> float:
    """``key`` (a whole number) ordered after the class ``level`` (see CLASS_SPAN)."""
    return float(level * CLASS_SPAN + min(key, CLASS_SPAN - 1))


class HeapPolicy(Policy):
    """A policy that orders ready jobs by their priority class first (``job.level``, 1 the
    most urgent), then by a key: an indexed heap per class (``paella.dispatcher.
    pqueue``), so a released or finished job leaves it in place and nothing stale is ever
    skipped. O(log n) per decision. Subclasses define :meth:`key`: a number (ties go to
    the earlier arrival) or a ``(number, int)`` pair, least first. Holds no per-job state
    outside the heaps (``policy_state`` stays free)."""

    def __init__(self, dispatcher: Any = None, **options: Any):
        super().__init__(dispatcher, **options)
        self.heaps: dict[int, IndexedHeap] = {}      # class -> its ready jobs
        self.levels: list[int] = []                  # the classes with a heap, ascending

    def key(self, job: Any) -> Any:
        raise NotImplementedError("need key")

    def kernel_ready(self, job: Any) -> None:
        key = self.key(job)
        heap = self.heaps.get(job.level)
        if heap is None:
            heap = self.heaps[job.level] = IndexedHeap()
            insort(self.levels, job.level)
        if type(key) is tuple:
            heap.push(job, key[0], key[1])
        else:
            heap.push(job, key, job.seq)

    def top(self) -> Any:
        """The ready job of the most urgent class that comes first by key (None: none)."""
        for level in self.levels:
            job = self.heaps[level].top()
            if job is not None:
                return job
        return None

    def pick(self) -> Any:
        return self.top()

    def released(self, job: Any, op: Any) -> None:
        self.heaps[job.level].remove(job)

    def job_finished(self, job: Any) -> None:
        heap = self.heaps.get(job.level)
        if heap is not None:
            heap.remove(job)
