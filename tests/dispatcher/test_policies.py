"""Policies: SRPT order, deficit-bounded starvation, the registry, plug-in fallback."""
from __future__ import annotations

import logging
import random
import sys
import types
from importlib import metadata

import pytest

from paella.dispatcher.core import STATUS_OK
from paella.dispatcher.policies import registry
from paella.dispatcher.policies import HeapPolicy, PolicyError, get_policy, register_policy
from paella.dispatcher.policies.paella import Paella

from dispatch_helpers import Recorder, chain


class _Op:
    def __init__(self, key):
        self.key = key


class _Stat:
    def __init__(self, seconds):
        self.time = seconds


class FakeJob:
    """What a policy sees of a job (its next kernel has no timing estimate: never held)."""
    _n = 0

    def __init__(self, remaining: float, client: int = 0):
        FakeJob._n += 1
        self.seq = FakeJob._n
        self.remaining = self.estimate = remaining
        self.client_id = client
        self.policy_state = None
        self.ready = [_Op("k")]
        self.model = types.SimpleNamespace(profile=types.SimpleNamespace(kernels={}))

    @property
    def level(self):
        """Its class, as Job.level: its most urgent request's (none named: 128)."""
        reqs = getattr(self, "requests", ())
        return min((getattr(r, "priority", 0) or 128) for r in reqs) if reqs else 128

    def __repr__(self):
        return f"J{self.seq}(rem={self.remaining})"


def arrive(policy, *jobs):
    for j in jobs:
        policy.job_arrived(j)
        policy.kernel_ready(j)


def test_priority_serves_the_most_urgent_level_first_then_srpt():
    """1 is the most urgent level; a job without a priority counts as the middle one
    (128); within a level the least remaining work goes first, ties to arrival."""
    p = get_policy("priority")()

    def job(remaining, *levels):
        j = FakeJob(remaining)
        j.requests = [types.SimpleNamespace(priority=lv) for lv in levels]
        return j
    batch_work = job(1.0, 200)            # short but unimportant
    plain = job(9.0, 0)                   # no priority: level 128
    urgent_long, urgent_short = job(50.0, 1), job(5.0, 1)
    mixed = job(20.0, 250, 2)             # a batch with one level-2 request: level 2
    arrive(p, batch_work, plain, urgent_long, urgent_short, mixed)
    order = []
    while (j := p.pick()) is not None:
        order.append(j)
        p.released(j, None)
        p.kernel_completed(j, None)
    assert order == [urgent_short, urgent_long, mixed, plain, batch_work]
    # The hold: while an urgent kernel is on the device, a less urgent job waits even
    # with nothing urgent ready; once it completes (or its job ends), it goes.
    urgent, low = job(3.0, 1), job(1.0, 9)
    arrive(p, urgent, low)
    assert p.pick() is urgent
    p.released(urgent, None)
    assert p.pick() is None
    p.kernel_completed(urgent, None)
    assert p.pick() is low
    p.released(low, None)
    p.kernel_ready(urgent)
    assert p.pick() is urgent               # urgent is never held behind a lower level
    p.released(urgent, None)
    p.job_finished(urgent)                  # (a cancelled job's kernels may not report)
    assert p.level_on_device == {9: 1} and urgent not in p.on_device


def test_srpt_picks_the_least_remaining_work():
    p = Paella(fairness_threshold=1e9)
    a, b, c = FakeJob(5.0), FakeJob(1.0), FakeJob(3.0)
    arrive(p, a, b, c)
    order = []
    for _ in range(3):
        j = p.pick()
        assert p.pick() is j                  # pick() does not change state
        order.append(j)
        p.released(j, None)
    assert order == [b, c, a]
    assert p.pick() is None


def test_srpt_requeues_with_the_reduced_estimate():
    p = Paella(fairness_threshold=1e9)
    long_, short = FakeJob(10.0), FakeJob(4.0)
    arrive(p, long_, short)
    j = p.pick()
    assert j is short
    p.released(short, None)
    long_.remaining = 10.0
    short.remaining = 3.0
    p.kernel_ready(short)
    assert p.pick() is short
    # A partially completed long job overtakes a fresh short one.
    p.released(short, None)
    p.pick()
    long_.remaining = 2.0
    p.released(long_, None)
    p.kernel_ready(long_)
    p.kernel_ready(short)
    assert p.pick() is long_


def starve(threshold: float, rounds: int = 400, unit: str = "job") -> int:
    """A long job against an endless supply of one-kernel short jobs (two at a time, from
    another client): the longest run of releases during which the long job waited."""
    p = Paella(fairness_threshold=threshold, fairness_unit=unit)
    long_ = FakeJob(1e6, client=1)
    arrive(p, long_)
    worst = gap = 0
    shorts = [FakeJob(1.0, client=2), FakeJob(1.0, client=2)]
    arrive(p, *shorts)
    for _ in range(rounds):
        j = p.pick()
        p.released(j, None)
        if j is long_:
            worst = max(worst, gap)
            gap = 0
            p.kernel_ready(long_)
        else:
            gap += 1
            p.job_finished(j)
            s = FakeJob(1.0, client=2)         # a fresh short job takes its place
            arrive(p, s)
    return max(worst, gap)


@pytest.mark.parametrize("threshold", [0.0, 2.0, 8.0])
@pytest.mark.parametrize("unit,units", [("job", 3), ("client", 2)])
def test_deficits_bound_how_long_a_long_job_starves(threshold, unit, units):
    # The long job's unit gains 1/n per release it misses (n = 3 jobs or 2 clients),
    # so it is served after about n * (threshold + 1) releases at most.
    worst = starve(threshold, unit=unit)
    assert worst <= units * (threshold + 1) + 1
    assert worst >= 1 or threshold == 0.0


def test_without_deficits_srpt_starves_the_long_job():
    assert starve(float("inf"), rounds=200) == 200


def test_deficits_by_client_follow_the_paper_update():
    p = Paella(fairness_threshold=1e9, fairness_unit="client")
    a, b = FakeJob(1.0, client=1), FakeJob(2.0, client=2)
    arrive(p, a, b)
    p.released(p.pick(), None)               # client 1 releases one kernel
    assert p.deficit(1) == pytest.approx(-0.5)  # -(1 - 1/2)
    assert p.deficit(2) == pytest.approx(0.5)   # +1/2


def test_a_batched_job_charges_each_client_its_requests_part():
    """Client mode: a batch serving 2 requests of client 1 and 1 of client 2 charges a
    kernel 2/3 and 1/3 (deficits per user per request); client 3 only gains."""
    p = Paella(fairness_threshold=1e9, fairness_unit="client")
    batch = FakeJob(1.0, client=1)
    batch.requests = [types.SimpleNamespace(client_id=c) for c in (1, 1, 2)]
    other = FakeJob(5.0, client=3)
    arrive(p, batch, other)
    assert set(p.units) == {1, 2, 3}
    p.released(p.pick(), None)
    assert p.deficit(1) == pytest.approx(1 / 3 - 2 / 3)
    assert p.deficit(2) == pytest.approx(1 / 3 - 1 / 3)
    assert p.deficit(3) == pytest.approx(1 / 3)
    p.job_finished(batch)
    assert set(p.units) == {3}               # the batch's clients leave with it


def test_deficits_by_job_follow_the_paper_update():
    p = Paella(fairness_threshold=1e9)        # fairness_unit="job" is the default
    a, b, c = FakeJob(1.0), FakeJob(2.0), FakeJob(3.0)
    arrive(p, a, b, c)
    p.released(p.pick(), None)               # a releases one kernel
    assert p.deficit(a) == pytest.approx(-2 / 3)
    assert p.deficit(b) == pytest.approx(1 / 3)
    assert p.deficit(c) == pytest.approx(1 / 3)


def test_deficit_threshold_zero_serves_oldest_waiting_first():
    p = Paella(fairness_threshold=0.0, fairness_unit="job")
    old, new = FakeJob(9.0), FakeJob(1.0)
    arrive(p, old, new)
    assert p.pick() is old                    # deficits 0 reach threshold 0: oldest first
    p.released(old, None)
    p.kernel_ready(old)
    assert p.pick() is old                    # new is owed 1/2, old still the oldest


def test_deficit_threshold_is_reached_not_exceeded():
    p = Paella(fairness_threshold=0.5, fairness_unit="job")
    old, new = FakeJob(9.0), FakeJob(1.0)
    arrive(p, old, new)
    assert p.pick() is new                    # deficits 0 < 0.5: SRPT
    p.released(new, None)
    p.kernel_ready(new)
    assert p.deficit(old) == pytest.approx(0.5)
    assert p.pick() is old                    # 0.5 reaches 0.5


def release_order(threshold: float, unit: str, kernels: int = 4) -> list[int]:
    """Six jobs of ``kernels`` kernels each, arriving together, shortest last, from two
    clients; each released kernel is ready again at once. Returns the job (arrival
    index) of every release."""
    p = Paella(fairness_threshold=threshold, fairness_unit=unit)
    jobs = [FakeJob(float(10 - i), client=i % 2) for i in range(6)]
    left = {j: kernels for j in jobs}
    arrive(p, *jobs)
    order = []
    while (j := p.pick()) is not None:
        p.released(j, None)
        order.append(jobs.index(j))
        left[j] -= 1
        j.remaining -= 1.0
        if left[j]:
            p.kernel_ready(j)
        else:
            p.job_finished(j)
    return order


def test_threshold_zero_is_arrival_order_and_infinity_is_srpt():
    # Per-job deficits: once one reaches the threshold the oldest ready job goes
    # first; every deficit starts at 0, so threshold 0 is arrival order throughout.
    fifo = release_order(0.0, "job")
    assert fifo == sorted(fifo)
    srpt = release_order(float("inf"), "job")
    assert srpt == sorted(srpt, reverse=True)     # shortest (last-arrived) job first
    # Per-client deficits at 0 give the two clients equal shares of the releases
    # (kernel-level round robin between users), not arrival order.
    by_client = release_order(0.0, "client")
    assert by_client[:4] == [0, 1, 0, 1]
    for k in range(1, len(by_client) + 1):
        ones = sum(i % 2 for i in by_client[:k])
        assert abs(ones - (k - ones)) <= 2


def test_larger_thresholds_move_monotonically_from_fifo_to_srpt():
    def inversions(order):
        return sum(1 for i in range(len(order)) for k in range(i) if order[k] > order[i])
    inv = [inversions(release_order(t, "job")) for t in (0.0, 1.0, 4.0, 1e9)]
    assert inv == sorted(inv) and inv[0] < inv[-1]


@pytest.mark.parametrize("name", ["fifo", "ms-jbj", "ms_jbj", "MS-KBK", "sjf", "rr", "paella",
                                  "priority"])
def test_registry_finds_builtin_policies(name):
    assert get_policy(name).name == name.lower().replace("_", "-")


def test_unknown_policy_names_the_known_ones():
    with pytest.raises(PolicyError, match="unknown scheduling policy 'nope'.*fifo.*paella"):
        get_policy("nope")


def test_duplicate_registration_raises():
    with pytest.raises(PolicyError, match="already registered"):
        @register_policy("fifo")
        class Other(HeapPolicy):
            def key(self, job):
                return 0


def test_bad_policy_options_raise():
    with pytest.raises(PolicyError, match="fairness_threshold"):
        Paella(fairness_threshold=-1)
    with pytest.raises(PolicyError, match="no option"):
        get_policy("rr")(None, bogus=1)


@pytest.mark.parametrize("attr,value", [("gated", "no"), ("eager", 1), ("gated", None)])
def test_a_policy_declaring_a_non_bool_release_mode_is_refused(attr, value):
    """``gated = "no"`` would be taken as true: refused when the dispatcher builds it."""
    from paella.dispatcher.core import Dispatcher
    from paella.dispatcher.devices.sim import SimDevice

    class Declares(HeapPolicy):
        name = "declares"

        def key(self, job):
            return job.seq
    setattr(Declares, attr, value)
    with pytest.raises(PolicyError, match=f"policy 'declares' declares {attr} = "
                                          f"{value!r}; it must be True or False"):
        Dispatcher(SimDevice("t4"), Declares)


class Exploding(HeapPolicy):
    """A plug-in that works for a while, then raises in pick()."""
    calls = 0

    def key(self, job):
        return job.seq

    def pick(self):
        Exploding.calls += 1
        if Exploding.calls > 25:
            raise ZeroDivisionError("plug-in bug")
        return super().pick()


@pytest.fixture
def plugin(monkeypatch):
    """Expose ``Exploding`` as an entry point of group paella.policies."""
    mod = types.ModuleType("paella_test_plugin")
    mod.Exploding = Exploding
    monkeypatch.setitem(sys.modules, "paella_test_plugin", mod)
    ep = metadata.EntryPoint("exploding", "paella_test_plugin:Exploding", registry.ENTRY_POINT_GROUP)
    real = metadata.entry_points
    monkeypatch.setattr(metadata, "entry_points",
                        lambda group=None: [ep] if group == registry.ENTRY_POINT_GROUP else real(group=group))
    yield
    registry._REGISTRY.pop("exploding", None)


def serve_through_a_fallback(d, kernels: int, caplog) -> None:
    """12 requests on ``d``, whose policy fails on the way: fifo takes over (logged), and
    every request completes once, OK."""
    mid = d.register_model("c", chain("c", kernels), profile_runs=0)
    rec = Recorder()
    for i in range(12):
        d.submit(rec.request(i, mid, 512))
    with caplog.at_level(logging.ERROR):
        d.run_until_idle()
    assert d.policy.name == "fifo"
    assert any("falling back" in r.getMessage() for r in caplog.records)
    assert sorted(rec.done) == list(range(12))
    assert all(v[0] == STATUS_OK for v in rec.done.values())


def test_plugin_policy_loads_from_an_entry_point_and_falls_back_to_fifo(make, plugin, caplog):
    Exploding.calls = 0
    dev, d = make("exploding")
    assert type(d.policy) is Exploding
    serve_through_a_fallback(d, 6, caplog)
    assert "ZeroDivisionError" in d.policy_failure


class NotAJob(HeapPolicy):
    def key(self, job):
        return job.seq

    def pick(self):
        job = super().pick()
        return object() if job is not None and job.client_id >= 0 else job


class NeverPicks(HeapPolicy):
    def key(self, job):
        return job.seq

    def pick(self):
        return None


@pytest.mark.parametrize("policy, reason", [
    (NotAJob, "pick() returned <object object at"),
    (NeverPicks, "pick() returned None while 12 job(s) had a ready kernel and the device had "
                 "nothing to run"),
])
def test_a_wrong_pick_falls_back_to_fifo(make, policy, reason, caplog):
    """A pick() that answers a non-job, or holds every ready job back while the GPU is
    idle (in virtual time the clock cannot move meanwhile: a stall at once), is a policy
    failure: fifo takes over and every request completes once."""
    dev, d = make(policy)
    serve_through_a_fallback(d, 4, caplog)
    assert reason in d.policy_failure


def test_abandon_all_completes_jobs_with_kernels_on_the_device(make):
    """The drain deadline: every request is completed as cancelled at once, also those
    whose kernels the device is still running, and none twice (Recorder checks)."""
    from paella.dispatcher.core import STATUS_CANCELLED
    dev, d = make("paella")
    mid = d.register_model("c", chain("c", 6, seconds=1e-3), profile_runs=0)
    rec = Recorder()
    for i in range(8):
        d.submit(rec.request(i, mid, 512))
    for _ in range(50):                       # some kernels released, none finished
        d.step()
    assert any(d.streams.busy) and not rec.done
    assert d.abandon_all("the daemon stopped") == 8
    assert d.in_flight == 0 and not d.jobs
    assert {i: v[:2] for i, v in rec.done.items()} == {
        i: (STATUS_CANCELLED, "the daemon stopped") for i in range(8)}


# -- the hold rule ------------------------------------------------------------------------
def held_job(remaining: float, kernel_seconds: float) -> FakeJob:
    """A FakeJob whose next ready kernel is expected to last ``kernel_seconds``."""
    j = FakeJob(remaining)
    j.model.profile.kernels["k"] = _Stat(kernel_seconds)
    return j


@pytest.mark.parametrize("kernel_seconds,held", [(2.0, True), (0.5, False)])
def test_hold_keeps_a_big_kernel_back_while_a_much_shorter_job_runs(kernel_seconds, held):
    p = Paella(fairness_threshold=1e9)
    short, long_ = held_job(1.0, 0.1), held_job(10.0, kernel_seconds)
    arrive(p, short, long_)
    assert p.pick() is short
    p.released(short, None)                   # short's kernel runs; nothing of it is ready
    assert (p.pick() is None) == held
    p.job_finished(short)                     # once short is gone the long kernel goes
    assert p.pick() is long_


def test_hold_can_be_turned_off_and_does_not_override_fairness():
    p = Paella(fairness_threshold=1e9, hold_factor=None)
    short, long_ = held_job(1.0, 0.1), held_job(10.0, 5.0)
    arrive(p, short, long_)
    p.released(p.pick(), None)
    assert p.pick() is long_
    # At threshold 0 the oldest job goes first, held or not (deficits bound starvation).
    p = Paella(fairness_threshold=0.0)
    long_, short = held_job(10.0, 5.0), held_job(1.0, 0.1)
    arrive(p, long_, short)
    assert p.pick() is long_
    with pytest.raises(PolicyError, match="hold_factor"):
        Paella(hold_factor=-1)
    assert Paella(hold_factor=0).hold is None and Paella(hold_factor=False).hold is None


def test_hold_protects_a_short_job_from_a_long_kernel_end_to_end(make):
    """A short job (8 x 50 us) and a long one whose single kernel fills the GPU for
    2 ms arrive together. Holding the long kernel until the short job is done keeps
    the short job near its isolated latency; releasing it (no hold) makes the short
    job's second kernel wait for it. Both finish either way."""
    def run(hold):
        dev, d = make("paella", policy_options={"hold_factor": hold})
        s = d.register_model("short", chain("short", 8, grid=4))
        big = d.register_model("big", chain("big", 1, grid=22 * 64, block=256, seconds=2e-3))
        rec = Recorder()
        d.submit(rec.request(0, s, 512))
        d.submit(rec.request(1, big, 512))
        d.run_until_idle()
        assert {k: v[0] for k, v in rec.done.items()} == {0: STATUS_OK, 1: STATUS_OK}
        return rec.done[0][2], rec.done[1][2]
    short_held, long_held = run(1.0)
    short_free, long_free = run(None)
    assert short_held < 0.6e-3                # 8 kernels of 50 us plus copies
    assert short_free > short_held + 1e-3     # waited for (part of) the 2 ms kernel
    assert long_held > long_free              # the price: the long job waits


# -- the lazily deleted heaps against a scan ------------------------------------------------
def scan_pick(live: list, queued: set, hold: float):
    """What Paella must pick when fairness never applies: the queued job with the least
    (remaining, seq), held back (None) when a live job with less remaining work is
    shorter than twice its next kernel (hold 0.5; without a dispatcher, every kernel
    counts as filling the GPU)."""
    if not queued:
        return None
    job = min(queued, key=lambda j: (j.remaining, j.seq))
    other = min(live, key=lambda j: (j.remaining, j.seq))
    if other is job or not other.remaining < job.remaining:
        return job
    stat = job.model.profile.kernels.get(job.ready[0].key)
    return None if stat is not None and stat.time > hold * other.estimate else job


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("unit", ["job", "client"])
def test_srpt_and_hold_picks_match_a_scan(seed, unit):
    """Random arrivals, releases, ready kernels and cancellations (queued or not): every
    pick equals a scan of the jobs, so stale entries, the in-place re-key of the
    in-flight heap and the one-entry-per-job fairness fifo lose nothing."""
    rnd = random.Random(seed)
    p = Paella(fairness_threshold=float("inf"), fairness_unit=unit)
    live: list = []
    queued: set = set()
    left = {}
    for _ in range(3000):
        r = rnd.random()
        if r < 0.12 or not live:
            j = held_job(rnd.uniform(1.0, 20.0), rnd.choice([0.1, 0.5, 3.0]))
            j.client_id = rnd.randrange(3)
            left[j] = rnd.randint(1, 6)
            p.job_arrived(j)
            live.append(j)
            p.kernel_ready(j)
            queued.add(j)
        elif r < 0.7:
            got = p.pick()
            assert got is scan_pick(live, queued, p.hold)
            if got is not None:
                got.remaining -= rnd.choice([0.0, rnd.uniform(0.0, 3.0)])   # as the dispatcher
                p.released(got, None)
                queued.discard(got)
                left[got] -= 1
        elif r < 0.93:
            idle = [j for j in live if j not in queued]
            if idle:
                j = rnd.choice(idle)
                if left[j]:
                    p.kernel_ready(j)
                    queued.add(j)
                else:
                    p.job_finished(j)
                    live.remove(j)
        else:
            j = rnd.choice(live)
            p.job_finished(j)
            live.remove(j)
            queued.discard(j)
    assert len(p.fifo) <= 2 * len(live) + 64 + 1


def test_fairness_fifo_holds_one_entry_per_job_not_per_kernel():
    p = Paella(fairness_threshold=1e9)
    jobs = [FakeJob(float(i + 1)) for i in range(5)]
    arrive(p, *jobs)
    for _ in range(500):
        j = p.pick()
        p.released(j, None)
        j.remaining -= 1e-3
        p.kernel_ready(j)
    assert len(p.fifo) == len(jobs)


# -- the documented plug-in example ------------------------------------------------------------
def test_the_documented_policy_example_runs(make):
    """docs/policies.md's "Writing a policy" block, executed as written: it registers, every
    job completes, and least attained service favours a newcomer over a job that has run."""
    import re
    from pathlib import Path
    doc = (Path(__file__).resolve().parents[2] / "docs" / "policies.md").read_text()
    block = re.search(r"## Writing a policy.*?```python\n(.*?)```", doc, re.S).group(1)
    ns: dict = {}
    try:
        exec(compile(block, "docs/policies.md", "exec"), ns)
        dev, d = make("las")
        assert type(d.policy).__name__ == "LeastAttainedService"
        mid = d.register_model("c", chain("c", 6))
        rec = Recorder()
        for i in range(10):
            d.submit(rec.request(i, mid, 320, client=i % 3))
        d.run_until_idle()
        assert sorted(rec.done) == list(range(10))
        assert all(v[0] == STATUS_OK for v in rec.done.values())
        assert len(d.policy.ready) == 0
        # Unit level: the job that has attained less goes first.
        p = ns["LeastAttainedService"]()
        old, new = FakeJob(5.0), FakeJob(5.0)
        old.seq, new.seq = 1, 2
        for j in (old, new):
            p.job_arrived(j)
        old.policy_state = 3e-3                # it has attained 3 ms already
        p.kernel_ready(old)
        p.kernel_ready(new)
        assert p.pick() is new
    finally:
        registry._REGISTRY.pop("las", None)


@pytest.mark.parametrize("name", ["paella", "fifo", "sjf", "rr", "ms-kbk", "ms-jbj", "priority"])
def test_every_built_in_policy_orders_by_class_first(name):
    """Issue 38: a job of a more urgent class goes before one its own rule would put
    first (less work, earlier arrival, an earlier turn); within a class, the policy's own
    rule. Class 1 is the most urgent; a request naming none counts as 128."""
    p = get_policy(name)()

    def job(remaining, level):
        j = FakeJob(remaining)
        j.requests = [types.SimpleNamespace(priority=level, client_id=0)]
        return j
    first_by_rule = job(1.0, 200)          # less work and earlier: the rule's pick
    plain_short, plain_long = job(2.0, 0), job(30.0, 0)
    urgent = job(40.0, 5)                  # most work, last to arrive, most urgent class
    arrive(p, first_by_rule, plain_short, plain_long, urgent)
    order = []
    while (j := p.pick()) is not None:
        order.append(j)
        p.released(j, None)
        p.kernel_completed(j, None)
        p.job_finished(j)
    assert order[0] is urgent and order[-1] is first_by_rule, (name, order)
    assert set(order[1:3]) == {plain_short, plain_long}
    if name in ("paella", "sjf", "priority"):      # SRPT / SJF within the class
        assert order[1:3] == [plain_short, plain_long]
