"""The ``slack`` policy: deadlines from the SRPT estimate capped at the mix's mean, EDF
order within a class, one bounded demotion of late jobs, and no starvation past the cap."""
from __future__ import annotations

import random
import types

import pytest

from paella.dispatcher.core import STATUS_OK
from paella.dispatcher.policies import PolicyError, get_policy
from paella.dispatcher.policies.slack import Slack

from dispatch_helpers import Recorder, chain


class FakeJob:
    """What a policy sees of a job: arrival order, estimates, class."""
    _n = 0

    def __init__(self, estimate: float, level: int = 128):
        FakeJob._n += 1
        self.seq = FakeJob._n
        self.estimate = self.remaining = estimate
        self.level = level
        self.client_id = 0
        self.policy_state = None
        self.ready = [types.SimpleNamespace(key="k")]

    def __repr__(self):
        return f"J{self.seq}(est={self.estimate})"


def arrive(p: Slack, *jobs, at: float | None = None):
    if at is not None:
        p.clock = at
    for j in jobs:
        p.job_arrived(j)
        p.kernel_ready(j)


def drain(p: Slack) -> list:
    out = []
    while (j := p.pick()) is not None:
        out.append(j)
        p.released(j, None)
        p.job_finished(j)
    return out


def test_registered_and_options_checked():
    assert get_policy("slack") is Slack
    for bad in ({"slack_x": 0}, {"slack_x": -1.0}, {"late_x": -1}, {"mean_window": 0},
                {"order": "fifo"}, {"nope": 1}):
        with pytest.raises(PolicyError):
            Slack(**bad)


def test_deadline_is_arrival_plus_slack_x_times_the_estimate():
    p = Slack(slack_x=10.0, late_x=0.0, mean_window=1)   # the mean is the last estimate
    a = FakeJob(1e-3)
    arrive(p, a, at=0.0)
    assert a.policy_state.deadline == pytest.approx(10e-3)
    b = FakeJob(0.5e-3)                   # mean -> 0.5 ms: its own estimate, not capped
    arrive(p, b, at=2e-3)
    assert b.policy_state.deadline == pytest.approx(2e-3 + 5e-3)


def test_earliest_deadline_first_not_shortest_job_first():
    """A short job that arrived long after a long one does not overtake it once the long
    one's deadline comes first; one that arrives soon after it does."""
    p = Slack(slack_x=10.0, late_x=0.0, mean_window=1 << 20)
    long_ = FakeJob(4e-3)
    arrive(p, long_, at=0.0)             # the mean is 4 ms: deadline 40 ms
    soon = FakeJob(1e-3)
    arrive(p, soon, at=1e-3)             # deadline 11 ms: goes first
    late = FakeJob(1e-3)
    arrive(p, late, at=35e-3)            # deadline 45 ms: after the long job's 40 ms
    assert drain(p) == [soon, long_, late]


def test_a_long_job_is_due_no_later_than_a_job_of_the_mix_mean_size():
    """The cap: a model much longer than the mix's mean gets the mean's budget."""
    p = Slack(slack_x=10.0, late_x=0.0, mean_window=4)
    for _ in range(40):                  # a mix of 1 ms jobs
        arrive(p, FakeJob(1e-3), at=0.0)
    drain(p)
    big = FakeJob(30e-3)
    arrive(p, big, at=1.0)
    assert p.mean < 10e-3                 # (the big job moved the mean, a quarter of the way)
    assert big.policy_state.deadline == pytest.approx(1.0 + 10.0 * p.mean)
    assert big.policy_state.deadline < 1.0 + 10.0 * big.estimate


def test_a_job_that_cannot_make_its_deadline_yields_once():
    p = Slack(slack_x=10.0, late_x=3.0, mean_window=1 << 20)
    hopeless, fine = FakeJob(2e-3), FakeJob(2e-3)
    arrive(p, hopeless, at=0.0)          # deadline 20 ms
    arrive(p, fine, at=5e-3)             # deadline 25 ms
    p.clock = 19e-3                      # 19 + 2 ms of work > 20: late whatever is done
    assert p.pick() is fine              # the job that can still make it goes first
    assert p.pick() is fine              # (pick() is repeatable)
    assert hopeless.policy_state.demoted
    assert hopeless.policy_state.deadline == pytest.approx(20e-3 + 3 * 10 * 2e-3)
    # Demoted once only: past its new deadline too, it is not moved again.
    p.released(fine, None)
    p.job_finished(fine)
    newer = FakeJob(2e-3)
    arrive(p, newer, at=70e-3)           # deadline 90 ms; the demoted job's is 80 ms
    p.clock = 100e-3
    assert p.pick() is hopeless


def test_late_x_zero_is_plain_edf():
    p = Slack(slack_x=10.0, late_x=0.0, mean_window=1 << 20)
    hopeless, fine = FakeJob(2e-3), FakeJob(2e-3)
    arrive(p, hopeless, at=0.0)
    arrive(p, fine, at=5e-3)
    p.clock = 19e-3
    assert p.pick() is hopeless and not hopeless.policy_state.demoted


def test_least_laxity_orders_by_deadline_minus_remaining():
    p = Slack(slack_x=10.0, late_x=0.0, order="llf", mean_window=1 << 20)
    a, b = FakeJob(1e-3), FakeJob(1e-3)
    arrive(p, a, at=0.0)                 # deadline 10 ms
    arrive(p, b, at=1e-3)                # deadline 11 ms
    a.remaining = 0.1e-3                 # a is almost done: its latest start is 9.9 ms
    b.remaining = 1e-3                   # b's is 10 ms
    p.kernel_ready(a)
    assert p.pick() is a
    a.remaining = 1e-3
    b.remaining = 0.1e-3                 # now b's latest start (10.9) is later: still a
    p.kernel_ready(a)
    p.kernel_ready(b)
    assert p.pick() is a
    b.remaining = 0.0
    a.remaining = 2.5e-3                 # a: 7.5 ms, b: 11 ms
    p.kernel_ready(a)
    p.kernel_ready(b)
    assert p.pick() is a


def test_classes_first_then_deadline():
    p = Slack()
    relaxed = FakeJob(0.1e-3, level=200)  # the earliest deadline, least urgent class
    plain_a, plain_b = FakeJob(1e-3), FakeJob(2e-3)
    urgent = FakeJob(5e-3, level=5)       # the latest deadline, most urgent class
    arrive(p, relaxed, plain_a, plain_b, urgent, at=0.0)
    order = drain(p)
    assert order[0] is urgent and order[-1] is relaxed
    assert order[1:3] == [plain_a, plain_b]


@pytest.mark.parametrize("seed", [1, 2, 3])
@pytest.mark.parametrize("late_x", [0.0, 3.0])
def test_no_job_overtakes_a_long_one_past_its_cap(seed, late_x):
    """A long job (30x the short ones) in a stream of short jobs that overloads the
    server (one kernel at a time). SRPT would never serve it. Here its deadline is at
    most its arrival + slack_x x the mix's mean (+ late_x mix budgets if demoted), and
    no job that arrives after that deadline minus the shortest budget overtakes it: it
    waits only for work that arrived before its cap, so it is served."""
    rng = random.Random(seed)
    p = Slack(slack_x=10.0, late_x=late_x, mean_window=64)
    kernel = 0.1e-3                       # every job's kernels last 0.1 ms
    arrived = {}

    def new(est, t):
        j = FakeJob(est)
        arrive(p, j, at=t)
        arrived[j] = t
        return j
    for _ in range(30):                   # warm the mean with short jobs
        new(1e-3, 0.0)
    long_ = new(30e-3, 0.0)
    cap = 10.0 * p.mean * (1 + late_x)
    shortest = 10.0 * 1e-3                # the short jobs' budget (1 ms < the mean)
    t = 0.0
    while True:
        for _ in range(rng.choice([0, 1, 1, 2])):             # 10x more work than served
            new(1e-3, t)
        j = p.pick()
        p.released(j, None)
        if j is long_:
            break
        # Only work that arrived before the long job's (final) deadline, minus the
        # shortest budget, goes before it.
        assert arrived[j] <= long_.policy_state.deadline - shortest + 1e-12
        j.remaining = round(j.remaining - kernel, 9)
        if j.remaining > 0:
            p.kernel_ready(j)
        else:
            p.job_finished(j)
        t += kernel
        p.clock = t
        assert t < 10.0, "the long job starved"
    assert long_.policy_state.deadline <= cap + 1e-12
    assert long_.policy_state.demoted == (late_x > 0)


def test_the_dispatcher_runs_it_on_its_own_path_and_serves_every_job(make):
    """``slack`` is not a built-in of the kernel core: kernel_core="auto" leaves it to
    the dispatcher's Python path, which calls this policy, and every job completes."""
    dev, d = make("slack", kernel_core="auto")
    assert d.core is None and isinstance(d.policy, Slack)
    short = d.register_model("short", chain("short", 4, grid=4))
    long_ = d.register_model("long", chain("long", 12, grid=22 * 4, seconds=200e-6))
    rec = Recorder()
    for i in range(20):
        d.submit(rec.request(i, long_ if i % 4 == 0 else short, 512))
    d.run_until_idle()
    assert len(rec.done) == 20 and all(v[0] == STATUS_OK for v in rec.done.values())
    assert d.policy_failure is None if hasattr(d, "policy_failure") else True
    assert d.policy.mean is not None and d.policy.mean > 0
