"""The scheduling-policy interface and its registry.

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
(see :mod:`paella.dispatcher.streams`) and ``eager`` (see :mod:`.waitlist`).

Policies register with ``@register_policy("name")``; other packages add theirs through
the entry-point group ``paella.policies`` (``name = "module:Class"``). Names are
case-insensitive and ``_`` equals ``-``. Unknown or duplicate names raise.
"""
from __future__ import annotations

import logging
from importlib import metadata
from typing import Any, Callable

from ..pqueue import IndexedHeap

log = logging.getLogger(__name__)

ENTRY_POINT_GROUP = "paella.policies"
_REGISTRY: dict[str, type["Policy"]] = {}


class PolicyError(ValueError):
    """An unknown policy name, a duplicate registration or a bad policy option."""


def _norm(name: str) -> str:
    return name.strip().lower().replace("_", "-")


def register_policy(name: str) -> Callable[[type["Policy"]], type["Policy"]]:
    def deco(cls: type[Policy]) -> type[Policy]:
        key = _norm(name)
        if key in _REGISTRY and _REGISTRY[key] is not cls:
            raise PolicyError(f"policy name {key!r} is already registered by "
                              f"{_REGISTRY[key].__module__}.{_REGISTRY[key].__qualname__}; "
                              f"choose another name")
        if "name" not in cls.__dict__:
            cls.name = key
        _REGISTRY[key] = cls
        return cls
    return deco


def _load_entry_points() -> None:
    for ep in metadata.entry_points(group=ENTRY_POINT_GROUP):
        if _norm(ep.name) in _REGISTRY:
            continue
        cls = ep.load()
        register_policy(ep.name)(cls)


def get_policy(name: str) -> type["Policy"]:
    """The policy class registered under ``name`` (built-ins, then plug-ins)."""
    from . import builtin  # noqa: F401  (registers the built-in policies)
    key = _norm(name)
    if key not in _REGISTRY:
        _load_entry_points()
    try:
        return _REGISTRY[key]
    except KeyError:
        raise PolicyError(f"unknown scheduling policy {name!r}; known policies: "
                          f"{', '.join(sorted(_REGISTRY))} (plug-ins register under the "
                          f"entry-point group {ENTRY_POINT_GROUP!r})") from None


def policy_names() -> list[str]:
    from . import builtin  # noqa: F401
    _load_entry_points()
    return sorted(_REGISTRY)


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
