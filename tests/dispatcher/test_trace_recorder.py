"""The trace recorder (paella.dispatcher.trace) in virtual time: the same timeline on the
kernel core as on the dispatcher's own path, bounded size, policy decisions."""
from __future__ import annotations

import io
import json

import numpy as np
import pytest

from paella.dispatcher.adaptor import PlanAdaptor
from paella.dispatcher.core import Dispatcher, Request
from paella.dispatcher.devices.sim import SimDevice
from paella.dispatcher.policies.base import HeapPolicy
from paella.dispatcher.trace import TraceRecorder, write_trace

from test_compiled_replay import random_plan
from test_kernel_core import arrivals, fig2_plan


def traced_run(kernel_core, policy="paella", n=30, max_events=100_000, lookahead=1):
    dev = SimDevice("gtx1660s", n_streams=16, notifq_slots=1 << 12, seed=1)
    d = Dispatcher(dev, policy, profile_runs=1, kernel_core=kernel_core, lookahead=lookahead,
                   implied_copies=False)     # (the own path's schedule, to compare with it)
    mids = [d.register_model(p.name, PlanAdaptor(p)) for p in (fig2_plan(), random_plan(3))]
    rec = TraceRecorder(d, max_events=max_events).start()
    times = arrivals(n, 2, 100e-6)
    t0 = dev.now()
    i = 0
    while i < n or d.in_flight or d.pending_arrivals:
        while i < n and t0 + times[i] <= dev.now():
            m = d.models[mids[i % 2]]
            d.submit(Request(i, i % 3, m.model_id, np.zeros(m.adaptor.io_bytes, np.uint8),
                             priority=1 + i % 2, on_complete=lambda r, s, e: None))
            i += 1
        d.step()
        if d.idle and not d.pending_arrivals:
            dev.run_until(min(dev.next_event_time(), t0 + times[i] if i < n else np.inf))
    rec.stop()
    f = io.StringIO()
    summary = write_trace(f, rec)
    return json.loads(f.getvalue()), summary, d


def slices(doc, cat):
    def reqs(a):
        return tuple(map(tuple, a["requests"])) if "requests" in a else ((a["client"], a["request"]),)
    return sorted((e["name"], e["tid"], e["ts"], e["dur"], e["args"]["job"], reqs(e["args"]))
                  for e in doc["traceEvents"] if e.get("cat") == cat)


@pytest.mark.parametrize("lookahead", (1, 3))
def test_the_kernel_core_draws_the_timeline_of_the_dispatchers_own_path(lookahead):
    own, s_own, _ = traced_run(None, lookahead=lookahead)
    assert s_own.requests == 30 and s_own.kernels > 30 and not s_own.truncated
    for impl in ("c", "python"):
        got, s, d = traced_run(impl, lookahead=lookahead)
        assert d.core is not None
        assert slices(got, "kernel") == slices(own, "kernel"), impl
        assert slices(got, "request") == slices(own, "request"), impl
        # copies: the same ends and streams (their start is their release on the core)
        ends = lambda doc: sorted((e["tid"], e["ts"] + e["dur"]) for e in doc["traceEvents"]
                                  if e.get("cat") == "copy")
        assert ends(got) == ends(own)
    # The request slices carry the class the request asked for.
    assert {e["args"]["class"] for e in own["traceEvents"] if e.get("cat") == "request"} == {1, 2}


def test_a_trace_stops_at_its_size_limit_and_says_so():
    doc, summary, d = traced_run("c", max_events=64)
    assert summary.truncated and doc["otherData"]["truncated"] is True
    notes = [e for e in doc["traceEvents"] if e["name"].startswith("trace stopped")]
    assert len(notes) == 1 and "trace_max_bytes" in notes[0]["name"]
    assert not d.core.ops                # it took itself off: the core stopped reporting ops


class Explodes(HeapPolicy):
    """Works for a while, then raises in pick()."""
    name = "explodes-trace-test"
    calls = 0

    def key(self, job):
        return job.seq

    def pick(self):
        Explodes.calls += 1
        if Explodes.calls > 40:
            raise ZeroDivisionError("plug-in bug")
        return super().pick()


def test_a_policy_fallback_is_an_instant_with_its_reason():
    Explodes.calls = 0
    doc, summary, d = traced_run(None, policy=Explodes)
    assert d.policy.name == "fifo" and summary.requests == 30
    falls = [e for e in doc["traceEvents"] if e["name"] == "fallback"]
    assert len(falls) == 1 and "ZeroDivisionError" in falls[0]["args"]["reason"]
    picks = [e for e in doc["traceEvents"] if e["name"] == "pick"]
    assert len(picks) == summary.kernels + sum(1 for e in doc["traceEvents"]
                                               if e.get("cat") == "copy")


def test_max_events_is_checked():
    d = Dispatcher(SimDevice("t4"), "paella")
    with pytest.raises(ValueError, match="max_events"):
        TraceRecorder(d, max_events=3)


@pytest.mark.parametrize("core", ["c", None])
def test_each_slice_of_a_kernel_is_an_instant_and_a_kernel_slice(core):
    """Issue 43's ``slice`` decisions: a best-effort job's sliced kernel shows as one
    instant per slice (its blocks and the kernel's), whose blocks add up to the kernel."""
    from test_slicing import _dispatcher, _io
    dev = SimDevice("t4", n_streams=64, seed=1)
    d, be, hp = _dispatcher(dev, core)
    d.submit(Request(0, 0, hp, _io(), priority=1))          # a more urgent class exists
    d.run_until_idle()
    rec = TraceRecorder(d).start()
    d.submit(Request(1, 1, be, _io(), priority=200))
    d.run_until_idle()
    rec.stop()
    events = rec.events()
    cut = [e["args"] for e in events if e.get("name") == "slice"]
    assert len(cut) > 1 and {(a["kernel"], a["of"]) for a in cut} == {("big", 4000)}
    assert sum(a["blocks"] for a in cut) == 4000
    kernels = [e for e in events if e.get("cat") == "kernel" and e["name"] == "big"]
    assert len(kernels) == len(cut)
    assert not [e for e in events if e.get("name") == "slice" and e["args"]["kernel"] == "small"]


def test_a_policy_hold_is_an_instant_and_every_path_reports_the_same():
    """Issue 43's ``hold`` decisions: the class rule keeps best-effort kernels back while
    an urgent job is live; each hold (the first pick after a release that releases
    nothing) is an instant with the jobs it kept waiting, the same on every path."""
    from test_slicing import CORES, _dispatcher, _io
    seen = []
    for core in CORES:
        dev = SimDevice("t4", n_streams=64, seed=1)
        d, be, hp = _dispatcher(dev, core, slice_us=0.0, implied=False)   # (the own path's)
        rec = TraceRecorder(d).start()
        for i in range(4):
            d.submit(Request(10 + i, 1, be, _io(), priority=200))
        d.submit(Request(0, 0, hp, _io(), priority=1))
        d.run_until_idle()
        rec.stop()
        holds = [(e["ts"], e["args"]["queued"]) for e in rec.events() if e.get("name") == "hold"]
        seen.append(holds)
    assert seen[0] and all(q >= 1 for _, q in seen[0])
    assert seen[0] == seen[1] == seen[2]


@pytest.mark.parametrize("names", ("dispatcher", "front end"))
def test_a_request_in_flight_when_the_trace_starts_is_named_by_its_model(names):
    """A request whose job's ops were all released before the trace started is named
    from its model id: the dispatcher's model, or (the daemon, whose requests carry the
    front end's ids) the name the given lookup returns, never ``model N``."""
    dev = SimDevice("gtx1660s", n_streams=16, notifq_slots=1 << 12, seed=1)
    d = Dispatcher(dev, "paella", profile_runs=1, implied_copies=False)
    mid = d.register_model("fig2", PlanAdaptor(fig2_plan()))
    m = d.models[mid]
    front_id = mid + 40                   # the front end's numbering differs
    lookup = {front_id: "served-name"}.get
    # (a request answered while the trace records, whose job's ops were released
    # before it started: the recorder sees its end only)
    req = Request(7, 1, front_id if names == "front end" else mid,
                  np.zeros(m.adaptor.io_bytes, np.uint8), t_submit=0.0, t_done=1e-3, status=0)
    rec = TraceRecorder(d, request_model=lookup if names == "front end" else None).start()
    rec.request_finished(req)
    rec.stop()
    got = [e["args"]["model"] for e in rec.events() if e.get("cat") == "request"]
    assert got == (["served-name"] if names == "front end" else [m.name])
