"""PaellaRequestRouter's decision on Ray's replica records, without a Ray cluster: what
it reads of each running replica (its routing stats, else the metadata it gave at its
start) and whom it ranks first."""
from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import pytest

pytest.importorskip("ray")
from paella.cluster.ray_router import PaellaRequestRouter  # noqa: E402


@dataclass(frozen=True)
class FakeID:
    unique_id: str


@dataclass
class FakeReplica:
    """The parts of Ray's RunningReplica the router reads."""
    name: str
    routing_stats: dict[str, Any] = field(default_factory=dict)
    replica_metadata: dict[str, Any] = field(default_factory=dict)

    @property
    def replica_id(self) -> Any:
        return FakeID(self.name)


def _router(policy: str = "p2c-work") -> PaellaRequestRouter:
    r = PaellaRequestRouter.__new__(PaellaRequestRouter)   # (Ray builds it in a handle)
    r.initialize_state(policy=policy, seed=1)
    return r


def _choose(router: PaellaRequestRouter, replicas: list[FakeReplica], **kwargs: Any):
    pending = SimpleNamespace(kwargs=kwargs)
    ranked = asyncio.run(router.choose_replicas(replicas, pending))
    return [[r.name for r in group] for group in ranked]


def test_a_replica_not_polled_yet_is_routed_by_its_start_metadata():
    """Before Ray's first routing-stats poll the replica's models come from its
    metadata: a fresh cluster routes at once instead of waiting on the poll."""
    fresh = [FakeReplica("a", replica_metadata={"models": ["echo"]}),
             FakeReplica("b", replica_metadata={"models": ["resnet"]})]
    assert _choose(_router(), fresh, model="echo")[0] == ["a"]
    assert _choose(_router(), fresh, model="resnet")[0] == ["b"]
    assert _choose(_router(), fresh, model="nope") == []      # (waits: no one serves it)


def test_polled_stats_win_over_the_start_metadata():
    """A replica given another rank serves that rank's models: its stats say so."""
    moved = FakeReplica("a", routing_stats={"models": ["resnet"], "alive": True},
                        replica_metadata={"models": ["echo"]})
    assert _choose(_router(), [moved], model="echo") == []
    assert _choose(_router(), [moved], model="resnet")[0] == ["a"]


def test_a_dead_daemon_is_no_candidate_and_the_less_loaded_is_first():
    dead = FakeReplica("dead", routing_stats={"models": ["echo"], "alive": False})
    busy = FakeReplica("busy", routing_stats={"models": ["echo"], "alive": True,
                                              "queued_work_us": 5000.0})
    idle = FakeReplica("idle", routing_stats={"models": ["echo"], "alive": True,
                                              "queued_work_us": 10.0})
    for _ in range(20):               # (p2c samples both live ones: the idle one first)
        assert _choose(_router(), [dead, busy, idle], model="echo") == [["idle"], ["busy"]]
