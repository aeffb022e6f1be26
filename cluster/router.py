"""Routers: which replica (one daemon, one GPU) serves a request. Pure decision logic:
no Ray, no I/O, no clock. The Ray Serve deployment and ``paella experiment cluster``
feed them the same :class:`Replica` records.

Every router has one contract, in two steps so that a caller reads only what a router
looks at (Ray's power-of-two router probes two replicas, not all of them):

* ``sample(model, replicas, rng) -> list[Replica]``: the replicas the router will
  compare, drawn from the healthy replicas that serve ``model``;
* ``pick(model, sampled) -> Replica``: the choice among them, from their fields.

``choose(model, replicas, rng)`` is the two together. A caller whose records may be
stale refreshes the sampled ones between the two steps (the experiment brings each
sampled GPU to the decision's instant and reads its daemon's estimate there).

The rules (``ROUTERS``):

* ``random``: uniform over the candidates.
* ``round-robin``: the candidates in turn, one counter per model, so that each model's
  requests spread evenly whatever the others do.
* ``p2c-queue``: power of two choices by requests in flight (the router's own count of
  requests sent and not answered): Ray Serve's default rule.
* ``p2c-work``: power of two choices by the daemon's estimated queued work
  (``queued_work_us`` of its STATUS reply: the sum over its live jobs of the SRPT
  remaining-time estimates, in that GPU's own time) plus the request's own estimated
  time on that replica (``Replica.estimates_us``, 0 where unknown): the replica that
  should finish the request first. Ties go to fewer requests in flight.

Model-aware: a replica is a candidate only if it is healthy and serves the model; when
none is, every router raises :class:`NoReplica`, naming the model and what the replicas
serve. ``rng`` is a ``numpy.random.Generator`` or a ``random.Random`` (anything with
``integers`` or ``randrange``); routers hold no randomness of their own, so a seeded
caller is reproducible.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Hashable, Mapping, Sequence


@dataclass
class Replica:
    """What a router knows of one replica: its id, the models it serves, its daemon's
    reported queued work (``queued_work_us``, STATUS), the requests in flight on it (the
    router's own count), whether its health check passes, and optionally the estimated
    time of one request of each model on it (microseconds; the daemon's SRPT profile
    total for the model, or a measured isolated time)."""
    id: Hashable
    models: frozenset[str]
    queued_work_us: float = 0.0
    in_flight: int = 0
    healthy: bool = True
    estimates_us: Mapping[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not isinstance(self.models, frozenset):
            self.models = frozenset(self.models)

    def serves(self, model: str) -> bool:
        return model in self.models

    @classmethod
    def from_status(cls, id: Hashable, status: Mapping[str, Any], in_flight: int = 0,
                    healthy: bool = True,
                    estimates_us: Mapping[str, float] | None = None) -> "Replica":
        """A record from a daemon's STATUS reply (``Client.status()``): its models'
        names and its ``queued_work_us`` (0 from a daemon that predates it)."""
        return cls(id, frozenset(m["name"] for m in status.get("models", ())),
                   float(status.get("queued_work_us", 0) or 0), in_flight, healthy,
                   dict(estimates_us or {}))


class NoReplica(LookupError):
    """No healthy replica serves the request's model."""


def candidates(model: str, replicas: Sequence[Replica]) -> list[Replica]:
    """The healthy replicas that serve ``model``; :class:`NoReplica` if there is none."""
    out = [r for r in replicas if r.healthy and model in r.models]
    if not out:
        serving = [r.id for r in replicas if model in r.models]
        if serving:
            why = f"the replica(s) serving it ({_ids(serving)}) are unhealthy"
        elif replicas:
            known = sorted(set().union(*(r.models for r in replicas)))
            why = f"no replica serves it (served: {', '.join(known) or 'nothing'})"
        else:
            why = "there are no replicas"
        raise NoReplica(f"no replica for model {model!r}: {why}")
    return out


def _ids(ids: list) -> str:
    shown = ", ".join(map(str, ids[:8]))
    return shown + (f" and {len(ids) - 8} more" if len(ids) > 8 else "")


def _below(rng: Any, n: int) -> int:
    """A uniform integer in [0, n) from a numpy Generator or a random.Random."""
    integers = getattr(rng, "integers", None)
    return int(integers(n)) if integers is not None else rng.randrange(n)


class Router:
    """The contract (see the module docstring)."""
    name = "?"

    def sample(self, model: str, replicas: Sequence[Replica], rng: Any) -> list[Replica]:
        raise NotImplementedError

    def pick(self, model: str, sampled: Sequence[Replica]) -> Replica:
        return sampled[0]

    def choose(self, model: str, replicas: Sequence[Replica], rng: Any) -> Replica:
        return self.pick(model, self.sample(model, replicas, rng))


class RandomRouter(Router):
    name = "random"

    def sample(self, model: str, replicas: Sequence[Replica], rng: Any) -> list[Replica]:
        c = candidates(model, replicas)
        return [c[_below(rng, len(c))]]


class RoundRobinRouter(Router):
    """The candidates in turn, one counter per model (a candidate list that changes,
    a replica lost or added, keeps the counter: the turn moves on from where it was)."""
    name = "round-robin"

    def __init__(self) -> None:
        self._next: dict[str, int] = {}

    def sample(self, model: str, replicas: Sequence[Replica], rng: Any) -> list[Replica]:
        c = candidates(model, replicas)
        k = self._next.get(model, 0)
        self._next[model] = k + 1
        return [c[k % len(c)]]


class PowerOfTwo(Router):
    """Two distinct candidates drawn uniformly (one when only one serves the model);
    ``pick`` takes the one with the lower :meth:`score`, the first drawn on a tie."""

    def sample(self, model: str, replicas: Sequence[Replica], rng: Any) -> list[Replica]:
        c = candidates(model, replicas)
        n = len(c)
        if n == 1:
            return c
        i = _below(rng, n)
        j = _below(rng, n - 1)
        return [c[i], c[j + (j >= i)]]

    def score(self, model: str, r: Replica) -> tuple:
        raise NotImplementedError

    def pick(self, model: str, sampled: Sequence[Replica]) -> Replica:
        return min(sampled, key=lambda r: self.score(model, r))


class P2CQueueRouter(PowerOfTwo):
    """By requests in flight: Ray Serve's default."""
    name = "p2c-queue"

    def score(self, model: str, r: Replica) -> tuple:
        return (r.in_flight,)


class P2CWorkRouter(PowerOfTwo):
    """By the daemon's estimated queued work plus the request's own estimated time on
    the replica: when the request would finish there, as far as the daemon knows."""
    name = "p2c-work"

    def score(self, model: str, r: Replica) -> tuple:
        return (r.queued_work_us + r.estimates_us.get(model, 0.0), r.in_flight)


#: Routers by name.
ROUTERS: dict[str, Callable[[], Router]] = {
    "random": RandomRouter,
    "round-robin": RoundRobinRouter,
    "p2c-queue": P2CQueueRouter,
    "p2c-work": P2CWorkRouter,
}


def make_router(name: str) -> Router:
    """A fresh router (its own round-robin counters) by name."""
    try:
        return ROUTERS[name]()
    except KeyError:
        raise ValueError(f"unknown router {name!r}; choose from {', '.join(ROUTERS)}") from None
