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


class HeapPolicy(Policy):
    """A policy that orders ready jobs by a key: one indexed heap (``paella.dispatcher.
    pqueue``), so a released or finished job leaves it in place and nothing stale is ever
    skipped. O(log n) per decision. Subclasses define :meth:`key`: a number (ties go to
    the earlier arrival) or a ``(number, int)`` pair, least first. Holds no per-job state
    outside the heap (``policy_state`` stays free)."""

    def __init__(self, dispatcher: Any = None, **options: Any):
        super().__init__(dispatcher, **options)
        self.heap = IndexedHeap()

    def key(self, job: Any) -> Any:
        raise NotImplementedError("need key")

    def kernel_ready(self, job: Any) -> None:
        key = self.key(job)
        if type(key) is tuple:
            self.heap.push(job, key[0], key[1])
        else:
            self.heap.push(job, key, job.seq)

    def pick(self) -> Any:
        return self.heap.top()

    def released(self, job: Any, op: Any) -> None:
        self.heap.remove(job)

    def job_finished(self, job: Any) -> None:
        self.heap.remove(job)
