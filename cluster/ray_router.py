"""The routers of :mod:`paella.cluster.router` on Ray Serve's request-router interface.

Ray Serve (2.46 and later) lets a deployment name its own request router
(``RequestRouterConfig(request_router_class=...)``): a subclass of
``ray.serve.request_router.RequestRouter`` whose ``choose_replicas`` ranks the running
replicas for each request. :class:`PaellaRequestRouter` builds one
:class:`~paella.cluster.router.Replica` record per running replica and lets the
configured router (``p2c-work`` by default) sample and pick, so the deployment and
``paella experiment cluster`` run the same decision code.

The records are filled from:

* ``routing_stats``: what each replica's ``record_routing_stats`` returned when Ray last
  polled it (``stats_period_s``): its daemon's ``queued_work_us`` (STATUS), the models
  it serves, whether its daemon lives;
* ``replica_metadata``: what the replica's ``record_replica_metadata`` returned once,
  when it was initialized (its models), which Ray delivers with the replica itself. A
  replica not polled yet is thus routable at once, as idle and alive (Ray routes only
  to replicas it has seen initialized; a dead daemon fails Ray's health check). Its
  stats, once polled, win: a replica given another rank may serve other models. A
  request with no replica serving its model waits, with Ray's backoff, until one does
  (a replica restarting), or until the ingress's timeout;
* ``in_flight``: this router's own count of the requests it sent there and that have
  not completed (fresh, unlike the stats).

The request's keyword arguments carry what the decision needs: ``model`` (model-aware
routing: only replicas serving it are candidates) and ``avoid`` (the replica whose
daemon died under the request's first try; its retry goes elsewhere if it can).
"""
from __future__ import annotations

import random
from typing import Any, Optional

from ray.serve.request_router import (PendingRequest, ReplicaID, RequestRouter,
                                      RunningReplica)

from .router import NoReplica, Replica, Router, make_router


class PaellaRequestRouter(RequestRouter):
    """Ray's request router running a :mod:`paella.cluster.router` rule (see the
    module docstring). ``request_router_kwargs``: ``policy`` (a router name) and
    ``seed`` (None: a random one)."""

    def initialize_state(self, policy: str = "p2c-work", seed: int | None = None,
                         **_: Any) -> None:
        self._policy: Router = make_router(policy)
        self._rng = random.Random(seed)
        self._in_flight: dict[ReplicaID, int] = {}
        self._sent: dict[str, ReplicaID] = {}

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: Optional[PendingRequest] = None
                              ) -> list[list[RunningReplica]]:
        """The chosen replica first, then the other sampled one (Ray tries them in
        turn if the first's queue is full); [] while no replica can serve the model."""
        kwargs = pending_request.kwargs if pending_request is not None else {}
        model, avoid = kwargs.get("model"), kwargs.get("avoid")
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        records = [self.record(r) for r in candidate_replicas]
        if model is None:                     # (not a request for a model: any replica)
            return [list(candidate_replicas)] if candidate_replicas else []
        others = [r for r in records if r.id != avoid]
        try:
            sampled = self._policy.sample(model, others or records, self._rng)
        except NoReplica:
            return []
        best = self._policy.pick(model, sampled)
        ranked = [best] + [r for r in sampled if r is not best]
        return [[by_id[r.id]] for r in ranked]

    def record(self, r: RunningReplica) -> Replica:
        """What the rule reads of one running replica."""
        stats = r.routing_stats or {}
        models = stats.get("models")
        if models is None:                    # (not polled yet: what it said at its start)
            models = (getattr(r, "replica_metadata", None) or {}).get("models", ())
        return Replica(r.replica_id.unique_id, frozenset(models),
                       float(stats.get("queued_work_us", 0.0) or 0.0),
                       self._in_flight.get(r.replica_id, 0),
                       bool(stats.get("alive", True)))

    # -- this router's count of requests in flight -----------------------------------
    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID,
                          result: Any) -> None:
        self._in_flight[replica_id] = self._in_flight.get(replica_id, 0) + 1
        self._sent[pending_request.metadata.internal_request_id] = replica_id

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        if self._sent.pop(internal_request_id, None) is not None:
            self._in_flight[replica_id] = max(0, self._in_flight.get(replica_id, 0) - 1)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self._in_flight.pop(replica_id, None)
