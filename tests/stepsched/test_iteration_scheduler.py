"""Orca's Algorithm 2 (iteration-level FCFS, KV-slot reservation) and what goes beyond it."""
import pytest

from paella.stepsched.iteration_scheduler import (INCREMENT, PREEMPTED, GenRequest, IterationScheduler)
from paella.stepsched.timeline import simulate


def req(name, prompt=4, max_tokens=8, out=None, arrival=0.0, user=0, priority=0):
    return GenRequest(name, prompt, max_tokens, out, arrival, user, priority)


def names(it):
    return [r.req_id for r in it.requests]


def test_fcfs_up_to_max_bs_and_requests_join_and_leave_each_iteration():
    s = IterationScheduler(max_bs=2, n_slots=100)
    a, b, c = req("a", out=1), req("b", out=3), req("c", out=2)
    for r in (a, b, c):
        s.add(r)
    it = s.select()
    assert names(it) == ["a", "b"] and it.n_tokens == [4, 4] and it.phases == ["prefill"] * 2
    assert s.select() is None                 # n_workers=1: one batch in flight (line 9)
    assert s.returned(it) == [a]              # a leaves after its one token, at once
    it = s.select()
    assert names(it) == ["b", "c"]            # c joins the running b
    assert it.n_tokens == [1, 4] and it.phases == ["decode", "prefill"]
    s.returned(it)
    it = s.select()
    assert names(it) == ["b", "c"]
    assert s.returned(it) == [b, c]
    assert s.n_rsrv == 0 and not s.pending


def test_iteration_level_fcfs_property_holds_on_a_timeline():
    # Every pair: an earlier request has run at least as many iterations as a later one.
    reqs = [req(f"r{i}", prompt=2 + i % 3, max_tokens=10, out=1 + (7 * i) % 6, arrival=i * 0.5)
            for i in range(8)]
    count = {r.req_id: 0 for r in reqs}
    seen = []

    class Watch(IterationScheduler):
        def select(self, worker=0, now=0.0):
            it = super().select(worker, now)
            if it is not None:
                for r in it.requests:
                    count[r.req_id] += 1
                live = sorted(self.pool, key=lambda r: r.arrival)
                for x, y in zip(live, live[1:]):
                    seen.append(count[x.req_id] >= count[y.req_id])
            return it
    w = Watch(max_bs=3, n_slots=40)
    tl = simulate(w, [(r.arrival, r) for r in reqs], lambda it: 1.0)
    assert len(tl.finished) == 8 and seen and all(seen)
    assert {r.req_id: r.generated for r in reqs} == {r.req_id: r.out_len for r in reqs}


def test_reserves_max_tokens_and_stops_admitting_at_n_slots():
    s = IterationScheduler(max_bs=8, n_slots=20)
    a, b, c = req("a", max_tokens=8, out=2), req("b", max_tokens=10, out=2), req("c", max_tokens=5, out=2)
    for r in (a, b, c):
        s.add(r)
    it = s.select()
    # a (8) fits, b (8+10=18) fits, c (18+5 > 20): stop. c is small but never jumps b or a.
    assert names(it) == ["a", "b"] and s.n_rsrv == 18
    s.returned(it)
    it = s.select()
    assert names(it) == ["a", "b"]            # running requests need no new reservation
    s.returned(it)                            # both finish: 18 slots back
    assert s.n_rsrv == 0
    it = s.select()
    assert names(it) == ["c"] and s.n_rsrv == 5


def test_stop_means_break_not_continue():
    # The line is d (too big for the free slots), then e (small). FCFS: e waits behind d.
    s = IterationScheduler(max_bs=8, n_slots=16)
    a, d, e = req("a", max_tokens=10, out=3), req("d", max_tokens=10, out=1), req("e", max_tokens=5, out=1)
    for r in (a, d, e):
        s.add(r)
    it = s.select()
    assert names(it) == ["a"]                 # d does not fit beside a; e is not considered
    s.returned(it)
    assert names(s.select()) == ["a"]


def test_admission_never_deadlocks_under_pressure():
    # Many requests competing for a small cache: every one finishes, slots never exceed
    # n_slots, and the reservation returns to zero.
    reqs = [req(f"r{i}", prompt=3, max_tokens=10 + i % 5, out=None, arrival=i * 0.1) for i in range(30)]
    peak = []

    class Watch(IterationScheduler):
        def select(self, worker=0, now=0.0):
            it = super().select(worker, now)
            peak.append(self.n_rsrv)
            return it
    w = Watch(max_bs=4, n_slots=30)
    tl = simulate(w, [(r.arrival, r) for r in reqs], lambda it: 1.0)
    assert len(tl.finished) == 30 and max(peak) <= 30 and w.n_rsrv == 0
    assert all(r.generated == r.max_tokens - r.prompt_len for r in reqs)


def test_request_too_big_for_the_cache_is_refused():
    s = IterationScheduler(max_bs=4, n_slots=10)
    with pytest.raises(ValueError, match="exceeds the KV cache"):
        s.add(req("big", max_tokens=11))
    with pytest.raises(ValueError, match="must exceed the prompt"):
        req("bad", prompt=8, max_tokens=8)


def test_cancel_frees_slots_now_or_when_its_iteration_returns():
    s = IterationScheduler(max_bs=4, n_slots=20)
    a, b = req("a", max_tokens=10), req("b", max_tokens=10)
    s.add(a)
    s.add(b)
    it = s.select()
    s.cancel(a)                               # running: slots held until the return
    assert s.n_rsrv == 20
    assert s.returned(it) == [] and s.n_rsrv == 10
    s.cancel(b)                               # idle: slots back at once
    assert s.n_rsrv == 0 and not s.pending
    assert s.select() is None


def test_priorities_order_the_line():
    s = IterationScheduler(max_bs=1, n_slots=100, priorities=True)
    lo, hi = req("lo", out=2), req("hi", out=2, arrival=1.0, priority=5)
    s.add(lo)
    s.add(hi)
    assert names(s.select()) == ["hi"]


def test_preemption_keeps_the_place_in_line_and_chooses_swap_or_recompute():
    cost = {"a": "swap", "b": "recompute"}
    s = IterationScheduler(max_bs=4, n_slots=20, priorities=True, preempt=True,
                           preempt_cost=lambda r: cost[r.req_id])
    a, b = req("a", max_tokens=10, out=5, arrival=0), req("b", max_tokens=10, out=5, arrival=1)
    s.add(a)
    s.add(b)
    s.returned(s.select())                    # a and b run once: 20 slots held
    urgent = req("u", max_tokens=10, out=1, arrival=2, priority=1)
    s.add(urgent)
    it = s.select()
    # u needs 10 slots: the last in line behind it (b) gives them up; a keeps running
    assert names(it) == ["u", "a"] and [r.req_id for r in it.preempted] == ["b"]
    assert b.state == PREEMPTED and b.evicted == "recompute" and s.n_rsrv == 20
    s.returned(it)                            # u done: its slots return
    it = s.select()
    assert names(it) == ["a", "b"]            # b back, ahead of anything later
    assert it.phases == ["decode", "recompute"] and it.n_tokens == [1, 4 + 1]
    s.returned(it)
    assert b.state == INCREMENT and b.generated == 2


def test_preemption_only_takes_from_behind():
    # FCFS with preemption on: the blocked request is the youngest; nobody is behind it.
    s = IterationScheduler(max_bs=4, n_slots=10, preempt=True)
    a, b = req("a", max_tokens=10, out=3), req("b", max_tokens=10, out=1, arrival=1)
    s.add(a)
    s.add(b)
    it = s.select()
    assert names(it) == ["a"] and it.preempted == []
    s.returned(it)
    assert names(s.select()) == ["a"]


def test_fairness_deficits_let_a_starved_user_in():
    # user 0 floods; user 1 has one request behind 6 of them. max_bs=1.
    s = IterationScheduler(max_bs=1, n_slots=1000, fairness_threshold=2.0)
    flood = [req(f"f{i}", out=3, arrival=0.0, user=0) for i in range(6)]
    for r in flood:
        s.add(r)
    late = req("late", out=1, arrival=0.1, user=1)
    s.add(late)
    served = []
    while s.pending and len(served) < 30:
        it = s.select()
        served += names(it)
        s.returned(it)
        if served == ["f0"]:
            assert s.deficit == {0: -0.5, 1: 0.5}      # per user in the pool
        if "late" in served:
            assert 1 not in s.deficit                  # its last request left: so did it
    # each iteration of user 0 raises user 1's deficit by 1/2: after 5, it is 2.5 > 2
    assert served.index("late") == 5
    assert s.deficit == {}
    plain = IterationScheduler(max_bs=1, n_slots=1000)
    for r in [req(f"f{i}", out=3, user=0) for i in range(6)] + [req("late", out=1, arrival=0.1, user=1)]:
        plain.add(r)
    order = []
    while plain.pending:
        it = plain.select()
        order += names(it)
        plain.returned(it)
    assert order.index("late") == 18          # without deficits: after every flood token
