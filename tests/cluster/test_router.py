"""The routers' rules on constructed replicas (paella.cluster.router), and the placement
rules (paella.cluster.placement). No Ray, no daemon: records in, a choice out."""
from __future__ import annotations

import random
from collections import Counter

import numpy as np
import pytest

from paella.cluster.placement import parse_rule, place, place_text
from paella.cluster.router import (ROUTERS, NoReplica, P2CQueueRouter, P2CWorkRouter, Replica,
                                   make_router)

AB = frozenset({"a", "b"})


def fleet(n: int = 4, models=AB, **fields) -> list[Replica]:
    return [Replica(i, models, **fields) for i in range(n)]


@pytest.mark.parametrize("name", list(ROUTERS))
def test_every_router_is_model_aware(name):
    reps = [Replica(0, {"a"}), Replica(1, {"b"}), Replica(2, {"a", "b"}), Replica(3, {"c"})]
    router, rng = make_router(name), np.random.default_rng(0)
    for _ in range(200):
        assert router.choose("b", reps, rng).id in (1, 2)
        assert router.choose("c", reps, rng).id == 3


@pytest.mark.parametrize("name", list(ROUTERS))
def test_no_replica_for_a_model_is_a_clear_error(name):
    router, rng = make_router(name), np.random.default_rng(0)
    reps = [Replica(0, {"a"}), Replica(1, {"b"})]
    with pytest.raises(NoReplica, match=r"model 'z': no replica serves it \(served: a, b\)"):
        router.choose("z", reps, rng)
    reps[0].healthy = False
    with pytest.raises(NoReplica, match=r"model 'a'.*replica\(s\) serving it \(0\) are unhealthy"):
        router.choose("a", reps, rng)
    with pytest.raises(NoReplica, match="there are no replicas"):
        router.choose("a", [], rng)


@pytest.mark.parametrize("name", list(ROUTERS))
def test_unhealthy_replicas_are_never_chosen(name):
    reps = fleet(4)
    reps[1].healthy = reps[3].healthy = False
    router, rng = make_router(name), random.Random(1)       # a random.Random works too
    assert {router.choose("a", reps, rng).id for _ in range(100)} == {0, 2}


def test_random_spreads_uniformly():
    router, rng = make_router("random"), np.random.default_rng(3)
    counts = Counter(router.choose("a", fleet(4), rng).id for _ in range(4000))
    assert set(counts) == {0, 1, 2, 3} and all(900 < c < 1100 for c in counts.values())


def test_round_robin_cycles_per_model():
    router, rng = make_router("round-robin"), np.random.default_rng(0)
    reps = fleet(3)
    seq = [(router.choose("a", reps, rng).id, router.choose("b", reps, rng).id) for _ in range(6)]
    # each model has its own turn: a's and b's requests both cycle 0, 1, 2
    assert [a for a, _ in seq] == [0, 1, 2, 0, 1, 2] and [b for _, b in seq] == [0, 1, 2, 0, 1, 2]
    # a model on a subset cycles over that subset only
    mixed = [Replica(0, {"a"}), Replica(1, {"x"}), Replica(2, {"a"})]
    assert [router.choose("x", mixed, rng).id for _ in range(3)] == [1, 1, 1]
    r2 = make_router("round-robin")
    assert [r2.choose("a", mixed, rng).id for _ in range(4)] == [0, 2, 0, 2]


def test_power_of_two_samples_two_distinct_candidates():
    rng = np.random.default_rng(5)
    reps = fleet(5)
    seen = set()
    for _ in range(500):
        s = P2CQueueRouter().sample("a", reps, rng)
        assert len(s) == 2 and s[0].id != s[1].id
        seen.add(frozenset(r.id for r in s))
    assert len(seen) == 10                       # every pair of the five turns up
    one = [Replica(0, {"a"}), Replica(1, {"b"})]
    assert [r.id for r in P2CQueueRouter().sample("a", one, rng)] == [0]


def test_p2c_queue_takes_fewer_requests_in_flight():
    router = P2CQueueRouter()
    busy, idle = Replica(0, AB, in_flight=5, queued_work_us=0), Replica(1, AB, in_flight=1,
                                                                         queued_work_us=9e6)
    assert router.pick("a", [busy, idle]) is idle
    assert router.pick("a", [idle, busy]) is idle
    # over a whole fleet: the busiest replica is never chosen (it loses every pair)
    reps = [Replica(i, AB, in_flight=n) for i, n in enumerate([9, 0, 1, 2])]
    rng = np.random.default_rng(2)
    chosen = Counter(router.choose("a", reps, rng).id for _ in range(600))
    assert 0 not in chosen and chosen[1] > chosen[2] > chosen[3]


def test_p2c_work_prefers_less_queued_work():
    router = P2CWorkRouter()
    # more requests in flight but less work (short jobs) beats one long job
    short_jobs = Replica(0, AB, in_flight=4, queued_work_us=4 * 1_600)
    long_job = Replica(1, AB, in_flight=1, queued_work_us=31_200)
    assert router.pick("a", [long_job, short_jobs]) is short_jobs
    assert P2CQueueRouter().pick("a", [long_job, short_jobs]) is long_job
    # ties on work go to fewer in flight
    t1, t2 = Replica(0, AB, in_flight=3, queued_work_us=100), Replica(1, AB, in_flight=2,
                                                                      queued_work_us=100)
    assert router.pick("a", [t1, t2]) is t2


def test_p2c_work_adds_the_requests_own_estimate():
    """On mixed GPUs the same work queue finishes a request sooner on the faster one: the
    request's own estimated time there is part of the score."""
    router = P2CWorkRouter()
    slow = Replica(0, AB, queued_work_us=10_000, estimates_us={"a": 31_000, "b": 1_000})
    fast = Replica(1, AB, queued_work_us=20_000, estimates_us={"a": 16_000, "b": 500})
    assert router.pick("a", [slow, fast]) is fast        # 41 ms against 36 ms
    assert router.pick("b", [slow, fast]) is slow        # 11 ms against 20.5 ms
    unknown = Replica(2, AB, queued_work_us=15_000)        # no estimate: 0
    assert router.pick("b", [slow, unknown]) is slow and router.pick("a", [slow, unknown]) is unknown


def test_a_seeded_rng_makes_choices_reproducible():
    reps = fleet(8)
    for name in ROUTERS:
        a = [make_router(name).choose("a", reps, np.random.default_rng(7)).id for _ in range(3)]
        b = [make_router(name).choose("a", reps, np.random.default_rng(7)).id for _ in range(3)]
        assert a == b


def test_replica_from_a_status_reply():
    st = {"models": [{"id": 1, "name": "echo"}, {"id": 2, "name": "noop"}], "queued_work_us": 1234,
          "in_flight": 3}
    r = Replica.from_status("gpu0", st, in_flight=2)
    assert r.models == {"echo", "noop"} and r.queued_work_us == 1234 and r.in_flight == 2
    assert Replica.from_status("old", {"models": []}).queued_work_us == 0   # an older daemon


def test_unknown_router_names_the_known_ones():
    with pytest.raises(ValueError, match="random, round-robin, p2c-queue, p2c-work"):
        make_router("least-loaded")


# -- placement -----------------------------------------------------------------------------
MODELS = ["m0", "m1", "m2", "m3", "m4"]


def test_all_places_every_model_everywhere():
    assert place(MODELS, 3) == [frozenset(MODELS)] * 3
    assert place_text(MODELS, 2, "all") == [frozenset(MODELS)] * 2


@pytest.mark.parametrize("n,count", [(4, 1), (4, 2), (5, 3), (7, 2), (3, 3)])
def test_a_count_per_model_is_exact_and_balanced(n, count):
    served = place(MODELS, n, count)
    for m in MODELS:
        assert sum(m in s for s in served) == count
    sizes = [len(s) for s in served]
    assert max(sizes) - min(sizes) <= 1
    assert served == place(MODELS, n, count)          # deterministic


def test_counts_by_model_and_a_default():
    served = place_text(MODELS, 4, "m0=4,m1=1,*=2")
    counts = {m: sum(m in s for s in served) for m in MODELS}
    assert counts == {"m0": 4, "m1": 1, "m2": 2, "m3": 2, "m4": 2}
    sizes = [len(s) for s in served]
    assert max(sizes) - min(sizes) <= 1
    assert place(MODELS, 2, {"m0": 1}) == place_text(MODELS, 2, "m0=1,*=all")


def test_bad_placements_are_refused():
    with pytest.raises(ValueError, match="from 1 to the 3 replica"):
        place(MODELS, 3, 4)
    with pytest.raises(ValueError, match="from 1 to the 3 replica"):
        place(MODELS, 3, 0)
    with pytest.raises(ValueError, match="unknown model"):
        place(MODELS, 3, {"nope": 1})
    with pytest.raises(ValueError, match="at least one replica"):
        place(MODELS, 0)
    with pytest.raises(ValueError, match="named twice"):
        place(["a", "a"], 2)
    for text in ("m0", "m0=x", "=2", "m0=1,m0=2"):
        with pytest.raises(ValueError):
            parse_rule(text)


def test_routing_over_a_placement():
    """Placement and routing together: each model's requests reach only its replicas,
    and reach all of them."""
    served = place(MODELS, 6, 2)
    reps = [Replica(i, s) for i, s in enumerate(served)]
    router, rng = make_router("p2c-work"), np.random.default_rng(4)
    for m in MODELS:
        hosts = {i for i, s in enumerate(served) if m in s}
        assert {router.choose(m, reps, rng).id for _ in range(100)} == hosts
