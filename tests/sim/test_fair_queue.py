"""The answer workers' queue shared by its owners (``FairQueue``): bounded, an owner is
refused only while it holds the largest share, one owner's flood cannot refuse another's
task nor make it wait behind the flood, and every owner's tasks keep their order."""
from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from paella.dispatcher.devices.sim.fair_queue import FairQueue

OWNERS = st.sampled_from("abcd")
STEPS = st.lists(st.one_of(st.tuples(st.just("push"), OWNERS), st.just(("pop",)),
                           st.just(("end",))), max_size=120)


def bounded_push(q: FairQueue, owner, item) -> str | None:
    """What EffectWorkers.submit does: refuse, or evict a victim's newest, then push."""
    evicted = None
    if q.full():
        victim = q.victim(owner)
        if victim is None:
            return "refused"
        evicted = q.evict_newest(victim)
    q.push(owner, item)
    return evicted


@settings(max_examples=300, deadline=None)
@given(bound=st.integers(1, 6), steps=STEPS)
def test_invariants(bound, steps):
    q: FairQueue = FairQueue(bound)
    order: dict = {}                       # owner -> its items still waiting, in order
    running: list = []
    n = 0
    for step in steps:
        if step[0] == "push":
            owner = step[1]
            before = {o: q.waiting(o) for o in "abcd"}
            refused = q.refuses(owner)
            got = bounded_push(q, owner, (owner, n))
            if got == "refused":
                assert refused
                # refused only while it holds the largest share (or one less: no swap)
                assert all(before[o] <= before[owner] + 1 for o in "abcd" if o != owner)
                assert before[owner] > 0 or all(before[o] == 0 for o in "abcd" if o != owner)
            else:
                assert not refused
                order.setdefault(owner, []).append((owner, n))
                if got is not None:          # the newest of an owner holding the most
                    assert before[got[0]] == max(before.values()) and got[0] != owner
                    assert order[got[0]][-1] == got
                    order[got[0]].pop()
            n += 1
        elif step[0] == "pop":
            least = min((q.running(o) for o in "abcd" if q.waiting(o)), default=None)
            got = q.pop()
            if got is None:
                assert len(q) == 0
                continue
            owner, item = got
            assert q.running(owner) - 1 == least          # the fewest running went first
            assert order[owner].pop(0) == item            # an owner's own order kept
            running.append(owner)
        elif running:
            q.ended(running.pop(0))
        assert len(q) <= bound and len(q) == sum(q.waiting(o) for o in "abcd")
        assert sorted(q) == sorted(x for xs in order.values() for x in xs)


def test_a_flood_neither_refuses_nor_delays_another_owners_task():
    q: FairQueue = FairQueue(8)
    for i in range(8):
        assert bounded_push(q, "flood", i) is None
    assert bounded_push(q, "flood", 8) == "refused"          # its own share is the largest
    assert q.refuses("flood") and not q.refuses("tenant")
    assert bounded_push(q, "tenant", "mine") == 7             # the flood's newest made room
    # one of the flood's tasks is running: the tenant's goes next, not after 7 more
    q2: FairQueue = FairQueue(8)
    for i in range(4):
        q2.push("flood", i)
    assert q2.pop() == ("flood", 0)
    q2.push("tenant", "mine")
    assert q2.pop() == ("tenant", "mine")
    assert q2.pop() == ("flood", 1)
    # equal running counts: the owner served longest ago (or never) goes first, even
    # when the flood's owner came back to the queue earlier
    q3: FairQueue = FairQueue(8)
    q3.push("flood", 0)
    assert q3.pop() == ("flood", 0)
    q3.push("flood", 1)
    q3.push("tenant", "mine")
    q3.ended("flood")
    assert q3.pop() == ("tenant", "mine")
    q3.ended("tenant")
    assert q3.pop() == ("flood", 1)
    q3.ended("flood")
    # nothing is remembered of owners with nothing waiting or running
    assert (q3._waiting, q3._running, q3._served, q3.busy) == ({}, {}, {}, 0)


def test_owners_take_turns_and_clear_forgets_everything():
    q: FairQueue = FairQueue(10)
    for owner, item in [("a", 1), ("a", 2), ("a", 3), ("b", 1), ("c", 1), ("b", 2)]:
        q.push(owner, item)
    got = []
    while (x := q.pop()) is not None:
        got.append(x)
        q.ended(x[0])
    assert got == [("a", 1), ("b", 1), ("c", 1), ("a", 2), ("b", 2), ("a", 3)]
    q.push("a", 1)
    q.pop()
    q.push("b", 1)
    assert q.clear() == [1] and len(q) == 0 and q.running("a") == 0
    assert q.remove_if(lambda x: True) == []


def test_remove_if_takes_out_matching_items_only():
    q: FairQueue = FairQueue(10)
    for i in range(4):
        q.push("a" if i % 2 else "b", i)
    assert sorted(q.remove_if(lambda x: x < 2)) == [0, 1]
    assert sorted(q) == [2, 3] and q.waiting("a") == 1 and q.waiting("b") == 1


def test_a_bad_bound_is_refused():
    import pytest
    with pytest.raises(ValueError, match="bound must be an int >= 1"):
        FairQueue(0)
