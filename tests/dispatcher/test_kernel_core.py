"""The kernel core (paella.dispatcher.kernel_core, dispatcher/_kcore.c): the C core and
its Python reference produce the same events at the same times, and both serve plans
exactly as the legacy dispatcher does (same completion time for every request)."""
from __future__ import annotations

import random

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from paella.dispatcher import kernel_core as kc
from paella.dispatcher.adaptor import PlanAdaptor
from paella.dispatcher.core import STATUS_OK, Dispatcher, Request
from paella.dispatcher.devices.sim import SimDevice

from test_compiled_replay import random_plan
from test_plan_events import event_plan

POLICIES = tuple(kc.POLICIES)


def fig2_plan():
    from paella.experiments.harness import adaptor_for
    from paella.models.synthetic import figure2_job
    return adaptor_for(figure2_job(), 64, 64)().plan


def arrivals(n: int, seed: int, gap: float) -> list[tuple[float, int]]:
    rng = random.Random(seed)
    t, out = 0.0, []
    for _ in range(n):
        t += rng.expovariate(1 / gap)
        out.append(t)
    return out


def setup(plans, policy, lookahead, extra_blocks, backlog=None):
    dev = SimDevice("gtx1660s", n_streams=16, notifq_slots=1 << 12, seed=1)
    d = Dispatcher(dev, policy, lookahead=lookahead, extra_blocks=extra_blocks, profile_runs=1,
                   saturation_backlog=backlog)
    mids = [d.register_model(p.name, PlanAdaptor(p)) for p in plans]
    return dev, d, mids


def run_legacy(plans, policy, lookahead, extra_blocks, times, picks, backlog=None):
    dev, d, mids = setup(plans, policy, lookahead, extra_blocks, backlog)
    t0 = dev.now()
    done = {}
    i = 0
    while i < len(times) or d.in_flight or d.pending_arrivals:
        while i < len(times) and t0 + times[i] <= dev.now():
            m = d.models[mids[picks[i]]]
            d.submit(Request(i, i % 3, m.model_id, np.zeros(m.adaptor.io_bytes, np.uint8),
                             on_complete=lambda r, s, e: done.__setitem__(r.req_id, (dev.now(), s))))
            i += 1
        d.step()
        if d.idle and not d.pending_arrivals:
            nxt = t0 + times[i] if i < len(times) else np.inf
            dev.run_until(min(dev.next_event_time(), nxt))
    return done


def run_core(impl, plans, policy, lookahead, extra_blocks, times, picks, client_unit=False,
             ops=False, classes=False, implied=True, lead=0.0, backlog=None):
    """The same arrivals through a kernel core on the legacy dispatcher's registered
    models (their profiles and buffer sets); every event with its time (``ops``: op
    events too; ``lead``: the wake-up's lead, seconds; ``backlog``: the saturation rule's,
    None: the dispatcher's default)."""
    dev, d, mids = setup(plans, policy, lookahead, extra_blocks, backlog)
    core = kc.make_core(impl, d.tracker, dev, policy, lookahead=lookahead, group=d.group,
                        fairness_unit="client" if client_unit else "job", wake_lead=lead,
                        saturation_backlog=d.saturation_backlog)
    core.ops = ops
    core.implied_copies = implied
    models = []
    for mid in mids:
        m = d.models[mid]
        cm = kc.register_model(core, m.replay, m.profile, dev)
        models.append((m, cm))
    t0 = dev.now()
    events = []
    held = {}
    ios = {}
    i = 0
    while i < len(times) or core.jobs:
        while i < len(times) and t0 + times[i] <= dev.now():
            m, cm = models[picks[i]]
            bindings = m.pool.acquire()
            held[i] = (m.pool, bindings)
            io = np.zeros(m.adaptor.io_bytes, np.uint8)
            if plans[picks[i]].name.startswith("rand"):
                io[:64] = np.random.default_rng(i).integers(0, 256, 64, dtype=np.uint8)
            ios[i] = io
            args, copies = kc.job_operands(cm, m.replay, bindings.bound, io, dev.memory)
            core.admit(i, 10_000 + i, cm.plan, cm.profile, client=i % 3, args=args,
                       copies=copies, level=(1, 128, 200)[i * 7 % 3] if classes else 0)
            i += 1
        ev = core.step(dev.now()) or ()
        for e in ev:
            events.append((dev.now(), *e))
            if e[0] == kc.FINISHED:
                pool, b = held.pop(e[1])
                pool.release(b)
        if not ev and not core.pending_arrivals:
            nxt = t0 + times[i] if i < len(times) else np.inf
            t = min(dev.next_event_time(), nxt)
            assert t < np.inf, "the core stalled with jobs in flight"
            dev.run_until(t)
    profiles = [core.profile(cm.profile) for _, cm in models]
    for k, io in ios.items():                # random plans: x goes in, and comes back
        if plans[picks[k]].name.startswith("rand"):
            assert (io[64:128] == io[:64]).all(), f"request {k}: its bytes did not round-trip"
    return events, profiles


def finished(events):
    return {e[2]: e[0] for e in events if e[1] == kc.FINISHED}


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("lookahead,extra_blocks,backlog,gap",
                         [(1, None, None, 150e-6), (3, None, None, 150e-6), (1, 0, None, 150e-6),
                          (1, None, 2, 20e-6), (3, 0, 2, 20e-6)])
def test_both_cores_serve_plans_as_the_legacy_dispatcher(policy, lookahead, extra_blocks,
                                                         backlog, gap):
    """(backlog 2 with arrivals 20 us apart: the saturation rule lifts the gate often.)"""
    plans = [fig2_plan(), event_plan(streams=True)]
    times = arrivals(60, 1, gap)
    picks = [random.Random(k).randrange(2) for k in range(len(times))]
    legacy = run_legacy(plans, policy, lookahead, extra_blocks, times, picks, backlog)
    assert all(s == STATUS_OK for _, s in legacy.values())
    for impl in ("python", "c"):
        events, _ = run_core(impl, plans, policy, lookahead, extra_blocks, times, picks,
                             backlog=backlog)
        got = finished(events)
        assert sorted(got) == sorted(legacy)
        assert all(got[k] == legacy[k][0] for k in got), impl
        # Every job woke its clients exactly once, before (or as) it finished.
        almost = [e[2] for e in events if e[1] == kc.ALMOST]
        assert sorted(almost) == sorted(got)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seeds=st.lists(st.integers(0, 10_000), min_size=1, max_size=3, unique=True),
       policy=st.sampled_from(POLICIES), lookahead=st.sampled_from((1, 3)),
       extra_blocks=st.sampled_from((None, 0)), n=st.integers(1, 30),
       gap=st.sampled_from((20e-6, 100e-6, 400e-6)), client=st.booleans(), ops=st.booleans(),
       classes=st.booleans(), implied=st.booleans(),
       lead=st.sampled_from((0.0, 100e-6)), backlog=st.sampled_from((None, 0, 2)))
def test_the_c_core_matches_the_reference_event_for_event(seeds, policy, lookahead,
                                                          extra_blocks, n, gap, client, ops,
                                                          classes, implied, lead, backlog):
    plans = [random_plan(s) for s in seeds]
    times = arrivals(n, seeds[0], gap)
    picks = [random.Random(k).randrange(len(plans)) for k in range(n)]
    ref = run_core("python", plans, policy, lookahead, extra_blocks, times, picks, client, ops,
                   classes, implied, lead, backlog)
    c = run_core("c", plans, policy, lookahead, extra_blocks, times, picks, client, ops,
                 classes, implied, lead, backlog)
    assert c == ref
    assert len(finished(ref[0])) == n
    op_events = [e for e in ref[0] if e[1] in (kc.OP_RELEASED, kc.OP_ENDED)]
    if not ops:
        assert not op_events
        return
    # Every op released once and ended once, after its release, before its job finished.
    released = {(e[2], e[3]): e for e in op_events if e[1] == kc.OP_RELEASED}
    ended = {(e[2], e[3]): e for e in op_events if e[1] == kc.OP_ENDED}
    assert len(released) == len([e for e in op_events if e[1] == kc.OP_RELEASED])
    assert released.keys() == ended.keys()
    done = finished(ref[0])
    for key, e in ended.items():
        assert released[key][0] <= e[0] <= done[key[0]]
        assert e[4] < 0 or released[key][0] <= e[4] <= e[5]     # a kernel's start


def test_a_refused_launch_fails_its_job_and_the_others_go_on():
    from paella.dispatcher.devices.base import DeviceError
    plans = [fig2_plan()]
    for impl in ("python", "c"):
        dev, d, mids = setup(plans, "paella", 1, None)
        calls = {"n": 0}
        real = dev.memcpy_htod

        def flaky(dst, src, stream=0):
            calls["n"] += 1
            if calls["n"] == 2:
                raise DeviceError("bad pointer (injected)")
            return real(dst, src, stream)
        dev.memcpy_htod = flaky
        core = kc.make_core(impl, d.tracker, dev, "paella", group=d.group)
        m = d.models[mids[0]]
        cm = kc.register_model(core, m.replay, m.profile, dev)
        for i in range(3):
            io = np.zeros(m.adaptor.io_bytes, np.uint8)
            args, copies = kc.job_operands(cm, m.replay, m.pool.acquire().bound, io)
            core.admit(i, i, cm.plan, cm.profile, args=args, copies=copies)
        events = []
        while core.jobs:
            events += core.step(dev.now()) or ()
            if core.jobs:
                dev.run_until(dev.next_event_time())
        kinds = [(e[0], e[1]) for e in events]
        assert (kc.REFUSED, 1) in kinds, impl
        assert [k for k, j in kinds if k == kc.FINISHED] == [kc.FINISHED] * 3
        ran = {e[1]: e[2] for e in events if e[0] == kc.FINISHED}
        assert ran[0] == ran[2] == 8 and ran[1] == 0     # the failed job never ran a kernel
        assert (kc.ALMOST, 1) not in kinds        # a failed job wakes nobody


def test_implied_copies_follow_the_rule_and_save_two_driver_calls_each():
    """An input copy followed on its stream by a kernel (or another input copy) and
    nothing else is implied; an output copy, or one another stream waits on, is not. Both
    cores charge an implied copy one driver call instead of three, release its kernel
    behind it at once, and answer the same, event for event."""
    from paella.dispatcher.devices.base import D2H, H2D
    plan = fig2_plan()
    times = arrivals(40, 3, 150e-6)
    picks = [0] * 40
    # The rule, on the reference's PlanSpec: fig2's input copy; multi-stream plans' input
    # copies that another stream waits on are not.
    dev, d, mids = setup([plan, event_plan(streams=True)], "paella", 1, None)
    core = kc.make_core("python", d.tracker, dev, "paella", group=d.group)
    fig2, evs = (core.plans[kc.register_model(core, d.models[m].replay, d.models[m].profile,
                                              dev).plan] for m in mids)
    assert [i for i, x in enumerate(fig2.implied) if x] == \
        [i for i, k in enumerate(fig2.kinds) if k == H2D]
    # Size: only a copy the link moves within its fixed latency (96 KB on the presets'
    # PCIe 3: pcie_bw * pcie_latency); a larger one would hold its kernel's share of the
    # GPU for its whole transfer.
    from paella.dispatcher.adaptor import synthetic_plan
    assert kc.implied_copy_bytes(dev.props) == dev.props.pcie_bw * dev.props.pcie_latency
    for nbytes, want in ((96_000, 1), (200_000, 0)):
        big = synthetic_plan(f"in{nbytes}", [("k", 1, 128, 9, 1e-4)], nbytes, 64)
        mid = d.register_model(big.name, PlanAdaptor(big))
        spec = core.plans[kc.register_model(core, d.models[mid].replay, d.models[mid].profile,
                                            dev).plan]
        assert [spec.implied[i] for i, k in enumerate(spec.kinds) if k == H2D] == [want]
    for spec in (fig2, evs):
        for i, x in enumerate(spec.implied):
            if x:
                assert spec.kinds[i] == H2D and spec.dstart[i] == spec.dstart[i + 1]
            elif spec.kinds[i] == D2H:
                assert not x
    got = {}
    for impl in ("python", "c"):
        for implied in (False, True):
            events, _ = run_core(impl, [plan], "paella", 1, None, times, picks,
                                 implied=implied)
            assert len(finished(events)) == 40
            got[impl, implied] = events
    assert got["python", True] == got["c", True] and got["python", False] == got["c", False]
    # the C core and the reference count the same driver calls: 8 kernels + 1 + 3
    for implied, per_job in ((True, 12), (False, 14)):
        calls = []
        for impl in ("python", "c"):
            dev, d, mids = setup([plan], "paella", 1, None)
            core = kc.make_core(impl, d.tracker, dev, "paella", group=d.group)
            core.implied_copies = implied
            m = d.models[mids[0]]
            cm = kc.register_model(core, m.replay, m.profile, dev)
            io = np.zeros(m.adaptor.io_bytes, np.uint8)
            args, copies = kc.job_operands(cm, m.replay, m.pool.acquire().bound, io, dev.memory)
            core.admit(0, 0, cm.plan, cm.profile, args=args, copies=copies)
            while core.jobs:
                core.step(dev.now())
                if core.jobs:
                    dev.run_until(dev.next_event_time())
            calls.append(core.device_calls)
        assert calls == [per_job, per_job], implied


@pytest.mark.parametrize("impl", ("python", "c"))
@pytest.mark.parametrize("direct_copies", (False, True))
def test_a_job_stopped_behind_its_implied_copy_still_drains(impl, direct_copies):
    """The job's input copy is out (implied: no event) and its kernel waits for room on
    a full GPU when its client goes away: the kernel is dropped, so an event recorded
    then tells the copy's completion, and the job finishes; the GPU's other job too."""
    from paella.dispatcher.adaptor import synthetic_plan
    big = synthetic_plan("big", [("fill", 22 * 40, 1024, 32, 2e-3)])
    plans = [big, fig2_plan()]
    dev, d, mids = setup(plans, "paella", 1, 0)
    core = kc.make_core(impl, d.tracker, dev, "paella", group=d.group)
    assert core.implied_copies
    cms = [kc.register_model(core, d.models[m].replay, d.models[m].profile, dev) for m in mids]
    handles = {}
    for k, (mid, cm) in enumerate(zip(mids, cms)):
        m = d.models[mid]
        io = np.zeros(max(m.adaptor.io_bytes, 1), np.uint8)
        args, copies = kc.job_operands(cm, m.replay, m.pool.acquire().bound, io,
                                       dev.memory if direct_copies else None)
        handles[k] = core.admit(k, k, cm.plan, cm.profile, args=args, copies=copies)
        events = list(core.step(dev.now()) or ())
    before = core.device_calls
    assert core.queued == 1                  # job 1's kernel waits; its copy went out
    events += core.abort(handles[1], 1)
    t_end = dev.now() + 1.0
    while core.jobs and dev.now() < t_end:
        events += core.step(dev.now()) or ()
        if core.jobs:
            dev.run_until(dev.next_event_time())
    assert core.jobs == 0, "a job stalled behind its implied copy"
    assert sorted(e[1] for e in events if e[0] == kc.FINISHED) == [0, 1]
    assert core.device_calls == before + 2   # the event recorded behind the copy, its query


def test_a_plan_spec_that_lies_is_refused_with_a_reason():
    dev, d, mids = setup([fig2_plan()], "paella", 1, None)
    core = kc.make_core("c", d.tracker, dev, "paella", group=d.group)
    m = d.models[mids[0]]
    cm = kc.register_model(core, m.replay, m.profile, dev)
    with pytest.raises(ValueError, match="out of range"):
        kc.PlanSpec(**{**{f: getattr(cm.spec, f) for f in cm.spec.__slots__},
                       "succ": (99,) * len(cm.spec.kinds)})
    fake = type("Spec", (), {f: getattr(cm.spec, f) for f in cm.spec.__slots__})()
    fake.succ = (99,) * len(cm.spec.kinds)
    with pytest.raises(ValueError, match="succ"):
        core.add_plan(fake)
    with pytest.raises(ValueError, match="unknown plan"):
        core.admit(0, 0, 7, cm.profile)
    with pytest.raises(ValueError, match="copies"):
        core.admit(0, 0, cm.plan, cm.profile, copies=())
    args, copies = kc.set_operands(cm, m.replay, m.pool.acquire().bound, dev.memory)
    with pytest.raises(ValueError, match="takes its host bytes from io"):   # io too short
        core.admit(0, 0, cm.plan, cm.profile, 0, 0, -1, args, copies, np.zeros(3, np.uint8))
    with pytest.raises(ValueError, match="takes its host bytes from io"):   # no io at all
        core.admit(0, 0, cm.plan, cm.profile, 0, 0, -1, args, copies)
    with pytest.raises(ValueError, match="cuda_kernels"):
        core.cuda_kernels(cm.plan, [])                 # one entry per kernel, or None
    assert core.jobs == 0
    with pytest.raises(ValueError, match="no built-in policy"):
        kc.make_core("c", d.tracker, dev, "nope")


# -- the dispatcher on the kernel core ------------------------------------------------------
def serve(kernel_core, policy, lookahead, plans, n=60, cancel_at=None, log=None,
          add_late=False, classes=False, implied=False):
    """Requests of three clients through a Dispatcher; client 1 goes away at request
    ``cancel_at``. Every answer with its time, status and error. ``log``: an OpLog
    installed from the start (``add_late``: after the profiling runs). ``implied``: the
    cores' implied copies (off: the schedule of the dispatcher's own path)."""
    dev = SimDevice("gtx1660s", n_streams=16, notifq_slots=1 << 12, seed=1)
    d = Dispatcher(dev, policy, lookahead=lookahead, profile_runs=1, kernel_core=kernel_core,
                   instruments=[log.instrument] if log is not None and not add_late else (),
                   implied_copies=implied)
    mids = [d.register_model(p.name, PlanAdaptor(p)) for p in plans]
    if log is not None and add_late:         # (after the profiling runs' kernels)
        log.released_before = d.core.released
        d.instruments.add(log.instrument)
    times = arrivals(n, 2, 100e-6)
    done = {}
    t0 = dev.now()
    i = 0
    while i < n or d.in_flight or d.pending_arrivals:
        while i < n and t0 + times[i] <= dev.now():
            m = d.models[mids[i % len(mids)]]
            d.submit(Request(i, i % 3, m.model_id, np.zeros(m.adaptor.io_bytes, np.uint8),
                             on_complete=lambda r, s, e: done.__setitem__(
                                 r.req_id, (dev.now(), s, e)),
                             priority=(1, 0, 200)[i * 7 % 3] if classes else 0))
            i += 1
            if i == cancel_at:
                d.cancel_client(1)
        d.step()
        if d.idle and not d.pending_arrivals:
            dev.run_until(min(dev.next_event_time(), t0 + times[i] if i < n else np.inf))
    return done, d


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("lookahead, classes", [(1, False), (3, False), (1, True)])
def test_the_dispatcher_on_either_core_answers_as_on_its_own_path(policy, lookahead, classes):
    plans = [fig2_plan(), event_plan(streams=True), random_plan(3)]
    own, _ = serve(None, policy, lookahead, plans, classes=classes)
    assert len(own) == 60 and all(s == STATUS_OK for _, s, _ in own.values())
    if classes and policy not in ("fifo", "ms-jbj"):
        # The classes change the schedule: not ignored. (fifo and ms-jbj release every
        # op as soon as it is issued: at this load nothing waits in the dispatcher for
        # an order to matter.)
        assert own != serve(None, policy, lookahead, plans)[0]
    for impl in ("c", "python"):
        got, d = serve(impl, policy, lookahead, plans, classes=classes)
        assert got == own, impl
        assert d.core.jobs == 0 and d.in_flight == 0


def test_a_cancelled_client_drains_in_the_core_and_the_others_are_served():
    plans = [fig2_plan(), random_plan(4)]
    own, _ = serve(None, "paella", 1, plans, cancel_at=20)
    for impl in ("c", "python"):
        got, d = serve(impl, "paella", 1, plans, cancel_at=20)
        assert got.keys() == own.keys() and d.in_flight == 0 and d.core.jobs == 0
        cancelled = {k for k, (_, s, _) in got.items() if s != STATUS_OK}
        assert cancelled and all(k % 3 == 1 and k < 20 for k in cancelled), impl
        assert cancelled == {k for k, (_, s, _) in own.items() if s != STATUS_OK}
        # Those still queued at the cancel never ran; the rest is answered as without.
        assert all(got[k] == own[k] for k in got if k >= 20)


def test_the_kernel_core_refuses_what_it_cannot_run_with_the_fix():
    from paella.dispatcher.adaptor import JobAdaptor
    from paella.dispatcher.policies import Policy
    dev = SimDevice("gtx1660s", n_streams=16)

    class Mine(Policy):
        name = "mine-kc-test"

        def kernel_ready(self, job): ...
        def pick(self): return None
        def released(self, job, op): ...
    with pytest.raises(ValueError, match="kernel_core=None"):
        Dispatcher(dev, Mine, kernel_core="c")

    d = Dispatcher(dev, "paella", kernel_core="c")

    class Own(JobAdaptor):
        io_bytes = 8

        def run(self, io): ...
    with pytest.raises(ValueError, match="replays launch plans only"):
        d.register_model("own", Own())


# -- op events ------------------------------------------------------------------------------
class OpLog:
    """Every op hook with what identifies the op on any path (its job's first request,
    kind, kernel, virtual stream, real stream, launch id) and the hook's time."""

    def __init__(self):
        from paella.dispatcher.instruments import Instrument

        log = self

        class _I(Instrument):
            def op_issued(self, op):
                log.issued.append(log.ident(op)[:4])

            def op_released(self, op, t):
                log.rows.setdefault(log.ident(op), {})["released"] = t
                assert op.t_release == t

            def op_started(self, op, t):
                log.rows.setdefault(log.ident(op), {})["started"] = t

            def op_ended(self, op, t):
                log.rows.setdefault(log.ident(op), {})["ended"] = t
        self.instrument = _I()
        self.issued: list[tuple] = []
        self.rows: dict[tuple, dict[str, float]] = {}

    @staticmethod
    def ident(op) -> tuple:
        return (op.job.requests[0].req_id, op.kind, op.key, op.vstream.vid, op.stream,
                op.launch_id)


def serve_logged(kernel_core, policy, lookahead, plans, n=40, add_late=False):
    """serve() with an OpLog."""
    log = OpLog()
    done, d = serve(kernel_core, policy, lookahead, plans, n, log=log, add_late=add_late)
    return log, done, d


@pytest.mark.parametrize("policy", ("paella", "ms-kbk", "fifo"))
@pytest.mark.parametrize("lookahead", (1, 3))
def test_the_core_reports_every_op_as_the_dispatchers_own_path(policy, lookahead):
    from paella.dispatcher.devices.base import KERNEL
    plans = [fig2_plan(), event_plan(streams=True), random_plan(3)]
    own, own_done, _ = serve_logged(None, policy, lookahead, plans)
    assert own.rows and len(own_done) == 40
    for impl in ("c", "python"):
        got, done, d = serve_logged(impl, policy, lookahead, plans)
        assert d.core is not None and d.core.ops, impl       # still on the core
        assert done == own_done, impl
        assert sorted(got.issued) == sorted(own.issued), impl
        assert got.rows.keys() == own.rows.keys(), impl
        for key, row in got.rows.items():
            want = own.rows[key]
            assert row["released"] == want["released"] and row["ended"] == want["ended"], key
            if key[1] == KERNEL:                 # a copy's start: its release on the core
                assert row["started"] == want["started"], key
            else:
                assert row["started"] == row["released"], key
        assert not d._core_ops, "an op's view outlived it"


def test_an_instrument_added_later_is_served_on_the_core_and_removing_it_stops_the_events():
    plans = [fig2_plan(), random_plan(5)]
    log, done, d = serve_logged("c", "paella", 1, plans, n=20, add_late=True)
    assert d.core is not None and len(done) == 20
    kernels = sum(1 for k in log.rows if k[2] is not None)
    assert kernels == d.core.released - log.released_before > 0
    d.instruments.remove(log.instrument)
    d.step()
    assert not d.core.ops


@pytest.mark.parametrize("impl", ("python", "c"))
def test_implied_copies_never_hold_every_stream_of_the_pool(impl):
    """Pool streams (``paella``): a job's implied input copy keeps its stream until the
    kernel behind it is seen done, and that kernel waits for the policy. A burst of new
    jobs on a full GPU must not take every stream that way: the jobs between two kernels,
    which the policy ranks first, need a free stream for their next kernel, and with none
    left nothing could ever run again (Figure 2 at 50k jobs/s with the CPU charged).
    At most half the pool waits behind implied copies; everything finishes."""
    from paella.dispatcher.adaptor import synthetic_plan
    two = synthetic_plan("two", [("a", 22, 1024, 32, 100e-6), ("b", 22, 1024, 32, 100e-6)],
                         64, 64)
    dev = SimDevice("gtx1660s", n_streams=8, notifq_slots=1 << 12, seed=1)
    d = Dispatcher(dev, "paella", extra_blocks=0, profile_runs=1)
    mid = d.register_model("two", PlanAdaptor(two))
    core = kc.make_core(impl, d.tracker, dev, "paella", group=d.group)
    m = d.models[mid]
    cm = kc.register_model(core, m.replay, m.profile, dev)
    done, k, events = set(), 0, []
    t_end = dev.now() + 0.5
    while len(done) < 60 and dev.now() < t_end:
        for _ in range(6 if k < 60 else 0):  # bursts of new jobs while others run
            io = np.zeros(m.adaptor.io_bytes, np.uint8)
            args, copies = kc.job_operands(cm, m.replay, m.pool.acquire().bound, io, dev.memory)
            core.admit(k, k, cm.plan, cm.profile, args=args, copies=copies)
            k += 1
        ev = core.step(dev.now()) or ()
        done |= {e[1] for e in ev if e[0] == kc.FINISHED}
        if core.jobs and not ev:
            t = dev.next_event_time()
            assert t < np.inf, f"stalled with {core.jobs} jobs in flight ({len(done)} done)"
            dev.run_until(t)
    assert len(done) == 60


@pytest.mark.parametrize("impl", ("python", "c"))
@pytest.mark.parametrize("policy", ("fifo", "ms-jbj"))
def test_a_new_job_goes_to_a_stream_that_holds_no_gate(impl, policy):
    """The simulated device holds a kernel whose answer is still being computed behind a
    gate in its stream (SimDevice._hold). Under fifo every job would go to that stream
    (ms-jbj: the next one round robin), and wait behind it; the cores give a new job the
    next stream with no gate (issue 37). All of a job's ops stay on that one stream."""
    from paella.dispatcher.adaptor import synthetic_plan
    plan = synthetic_plan("two", [("a", 1, 128, 9, 50e-6), ("b", 1, 128, 9, 50e-6)], 64, 64)
    dev = SimDevice("gtx1660s", n_streams=8, notifq_slots=1 << 12, seed=1)
    d = Dispatcher(dev, policy, profile_runs=1, kernel_core=impl)
    mid = d.register_model("two", PlanAdaptor(plan))
    handle = dev.gpu.gate(0)
    gated = {s: dev.gpu.stream_gated(s) for s in range(8)}
    assert gated[0] and not any(v for s, v in gated.items() if s)
    done = {}
    m = d.models[mid]
    d.submit(Request(1, 1, mid, np.zeros(m.adaptor.io_bytes, np.uint8),
                     on_complete=lambda r, s, e: done.__setitem__(r.req_id, s)))
    d.step()
    if policy == "fifo":                                # the stream after the held one
        assert not dev.gpu.stream_idle(1) and dev.gpu.stream_idle(2)
    t_end = dev.now() + 0.1
    while 1 not in done and dev.now() < t_end:          # it finishes with stream 0 held
        d.step()
        dev.run_until(min(dev.next_event_time(), t_end))
    assert done == {1: STATUS_OK} and dev.gpu.stream_gated(0)
    assert dev.gpu.open(handle)


@pytest.mark.parametrize("impl", ("python", "c", None))
@pytest.mark.parametrize("policy", ("fifo", "ms-jbj"))
def test_with_a_gate_in_every_stream_a_new_job_waits_for_a_stream_without_one(impl, policy):
    """Released ahead (an eager policy submits all of a job's work at its start), every
    job with an answer to ask puts a gate in its stream; with more such jobs in flight
    than streams, every stream holds one, and a gate may hold for the whole computation
    of another client's answer. A new job then waits for a stream without a gate instead
    of queueing behind one (issue 37's last gap, session 29): here it is released only
    once one stream's gate opens, and goes there. Both cores and the dispatcher's own
    path (None: Python plug-in policies)."""
    from paella.dispatcher.adaptor import synthetic_plan
    plan = synthetic_plan("two", [("a", 1, 128, 9, 50e-6), ("b", 1, 128, 9, 50e-6)], 64, 64)
    dev = SimDevice("gtx1660s", n_streams=8, notifq_slots=1 << 12, seed=1)
    d = Dispatcher(dev, policy, profile_runs=1, kernel_core=impl)
    if impl is None:                      # (the own path reads gates in real time only)
        d.streams.gated = dev.gpu.stream_gated
    mid = d.register_model("two", PlanAdaptor(plan))
    handles = [dev.gpu.gate(s) for s in range(8)]
    done = {}
    m = d.models[mid]
    d.submit(Request(1, 1, mid, np.zeros(m.adaptor.io_bytes, np.uint8),
                     on_complete=lambda r, s, e: done.__setitem__(r.req_id, s)))
    for _ in range(5):
        d.step()
        dev.run_until(dev.now() + 1e-3)
    assert not done and all(dev.gpu.stream_idle(s) is False for s in range(8))
    assert dev.gpu.busy() and dev.gpu.gates == 8          # nothing of the job went in
    assert dev.gpu.open(handles[5])
    t_end = dev.now() + 0.1
    while 1 not in done and dev.now() < t_end:
        d.step()
        dev.run_until(min(dev.next_event_time(), t_end))
    assert done == {1: STATUS_OK} and dev.gpu.gates == 7
    assert all(dev.gpu.stream_gated(s) for s in range(8) if s != 5)
    for h in handles:
        dev.gpu.open(h)
