"""Instrumentation hooks and jobs serving several requests, as timelines."""
from __future__ import annotations

import numpy as np
import pytest

from paella.dispatcher.adaptor import JobAdaptor
from paella.dispatcher.core import STATUS_CANCELLED, STATUS_ERROR, STATUS_OK, Dispatcher, Request
from paella.dispatcher.devices.sim import SimDevice
from paella.dispatcher.devices.base import KIND_NAMES
from paella.dispatcher.instruments import HOOKS, Instrument, Instruments

from dispatch_helpers import Recorder, chain


class Log(Instrument):
    """Every hook, as (hook, what, time) rows."""

    def __init__(self, d):
        self.d = d
        self.rows = []

    def _op(self, hook, op, t=None):
        what = op.key if op.key else KIND_NAMES[op.kind]
        self.rows.append((hook, what, self.d.now if t is None else t))

    def request_admitted(self, req):
        self.rows.append(("request_admitted", req.req_id, self.d.now))

    def request_started(self, req):
        self.rows.append(("request_started", req.req_id, self.d.now))

    def request_woken(self, req):
        self.rows.append(("request_woken", req.req_id, self.d.now))

    def request_finished(self, req):
        self.rows.append(("request_finished", req.req_id, req.status))

    def op_issued(self, op):
        self._op("op_issued", op)

    def op_released(self, op, t):
        self._op("op_released", op, t)

    def op_started(self, op, t):
        self._op("op_started", op, t)

    def op_ended(self, op, t):
        self._op("op_ended", op, t)


def test_every_hook_fires_in_the_order_of_a_requests_life(make):
    dev, d = make("paella")
    mid = d.register_model("c", chain("c", 2))
    log = Log(d)
    d.instruments.add(log)
    rec = Recorder()
    d.submit(rec.request(7, mid, 320))
    d.run_until_idle()
    hooks = [(h, w) for h, w, _ in log.rows]
    assert hooks[:2] == [("request_admitted", 7), ("request_started", 7)]
    assert ("request_woken", 7) in hooks
    assert [w for h, w in hooks if h == "op_issued"] == ["h2d", "c_k0", "c_k1", "d2h"]
    for what in ("h2d", "c_k0", "c_k1", "d2h"):      # each op: released, started, ended
        assert [h for h, w in hooks if w == what][1:] == ["op_released", "op_started", "op_ended"]
        times = [t for h, w, t in log.rows if w == what][1:]
        assert times == sorted(times)
    assert log.rows[-1] == ("request_finished", 7, STATUS_OK)
    ended = [t for h, w, t in log.rows if h == "op_ended"]
    assert ended == sorted(ended)                    # one dependent chain: in order


class CountingSim(SimDevice):
    """Counts the events the dispatcher records."""
    events = 0

    def record_event(self, stream):
        self.events += 1
        return super().record_event(stream)


def test_copy_starts_are_watched_only_while_someone_listens():
    """A copy's start costs an extra device event: recorded only while op_started has a
    listener."""
    dev = CountingSim("gtx1660s", n_streams=16)
    d = Dispatcher(dev, "paella", profile_runs=0)
    mid = d.register_model("c", chain("c", 1))
    rec = Recorder()
    d.submit(rec.request(0, mid, 320))
    d.run_until_idle()
    plain = dev.events
    d.instruments.add(Log(d))
    d.submit(rec.request(1, mid, 320))
    d.run_until_idle()
    assert plain == 2 and dev.events - plain == 4    # two copies: one event each, then two


def test_an_instrument_that_raises_is_removed_and_serving_goes_on(make, caplog):
    dev, d = make("paella")
    mid = d.register_model("c", chain("c", 3))

    class Broken(Instrument):
        calls = 0

        def op_released(self, op, t):
            Broken.calls += 1
            raise ZeroDivisionError("probe bug")
    d.instruments.add(Broken())
    rec = Recorder()
    for i in range(3):
        d.submit(rec.request(i, mid, 320))
    d.run_until_idle()
    assert Broken.calls == 1 and "op_released" not in d.instruments
    assert [rec.done[i][0] for i in range(3)] == [STATUS_OK] * 3
    assert "probe bug" in caplog.text


def test_the_answer_lookup_ahead_of_each_job_is_reported_with_its_interval(make):
    """``answer_looked_up``: the simulated GPU's functional lookup ahead of a job (a model
    whose adaptor has ``answer_ahead``), timed on the loop, once per job; the experiment
    that splits a request's latency counts it as device time."""
    import time
    asked = []

    class Ahead(type(chain("c", 2))):
        def answer_ahead(self, io, owner=None):
            asked.append(len(io))
            return None                            # a likely hit: the job runs at once

    class Looked(Instrument):
        def __init__(self):
            self.rows = []

        def answer_looked_up(self, job, t0, t1):
            self.rows.append((job.requests[0].req_id, t0, t1))
    base = chain("c", 2)
    adaptor = Ahead(base.plan)
    dev, d = make("paella")
    mid = d.register_model("c", adaptor)
    looked = Looked()
    d.instruments.add(looked)
    rec = Recorder()
    t = time.perf_counter()
    for k in (1, 2):
        d.submit(rec.request(k, mid, adaptor.io_bytes))
    d.run_until_idle()
    assert [r[0] for r in looked.rows] == [1, 2] and len(asked) >= 2
    assert all(t <= t0 <= t1 <= time.perf_counter() for _, t0, t1 in looked.rows)
    d.instruments.remove(looked)                   # nobody listens: not timed, still asked
    d.submit(rec.request(3, mid, adaptor.io_bytes))
    d.run_until_idle()
    assert len(looked.rows) == 2 and len(asked) >= 3


def test_hooks_nobody_overrides_are_not_listed():
    class OnlyEnds(Instrument):
        def op_ended(self, op, t):
            pass
    ins = Instruments([OnlyEnds()])
    assert list(ins) == ["op_ended"] and set(HOOKS) > set(ins)
    with pytest.raises(TypeError, match="Instrument"):
        ins.add(object())


# -- one job, several requests ----------------------------------------------------------------
def group(rec, mid, clients, io_bytes=320):
    reqs = [rec.request(10 + i, mid, io_bytes, client=c) for i, c in enumerate(clients)]
    return reqs, np.zeros(io_bytes, np.uint8)


def test_a_job_serves_each_of_its_requests(make):
    dev, d = make("paella")
    mid = d.register_model("c", chain("c", 4))
    rec = Recorder()
    reqs, io = group(rec, mid, [0, 1, 2])
    d.submit_group(reqs, io)
    assert d.in_flight == 3 and len(d.jobs) == 1
    d.run_until_idle()
    assert {i: v[0] for i, v in rec.done.items()} == {10: STATUS_OK, 11: STATUS_OK, 12: STATUS_OK}
    assert sorted(rec.almost) == [10, 11, 12] and d.in_flight == 0


def test_cancelling_one_client_of_a_shared_job_cancels_only_its_request(make):
    dev, d = make("paella")
    mid = d.register_model("c", chain("c", 6))
    rec = Recorder()
    reqs, io = group(rec, mid, [0, 1])
    d.submit_group(reqs, io)
    d.step()
    assert d.cancel_client(1) == 1
    d.run_until_idle()
    assert rec.done[10][0] == STATUS_OK and rec.done[11][0] == STATUS_CANCELLED
    assert "client 1" in rec.done[11][1] and rec.almost == [10]    # no wake-up for the gone one
    reqs, io = group(rec, mid, [3, 3])
    reqs = [Request(20 + i, 3, mid, r.io, on_complete=rec._complete) for i, r in enumerate(reqs)]
    d.submit_group(reqs, io)
    d.step()
    assert d.cancel_client(3) == 2                   # every request of the job: it stops
    d.run_until_idle()
    assert rec.done[20][0] == rec.done[21][0] == STATUS_CANCELLED
    assert d.tracker.in_flight() == 0 and not d.jobs


def test_a_failing_job_fails_each_of_its_requests(make):
    dev, d = make("paella")

    class Broken(JobAdaptor):
        def run(self, io):
            raise KeyError("no weights")
    mid = d.register_model("b", Broken(), profile_runs=0)
    rec = Recorder()
    reqs, io = group(rec, mid, [0, 1], io_bytes=8)
    d.submit_group(reqs, io)
    d.run_until_idle()
    assert [rec.done[i][0] for i in (10, 11)] == [STATUS_ERROR] * 2
    assert all("no weights" in rec.done[i][1] for i in (10, 11))


def test_a_group_is_one_model(make):
    dev, d = make("paella")
    a = d.register_model("a", chain("a", 1), profile_runs=0)
    b = d.register_model("b", chain("b", 1), profile_runs=0)
    rec = Recorder()
    with pytest.raises(ValueError, match="one job serves one model"):
        d.submit_group([rec.request(1, a, 320), rec.request(2, b, 320)], np.zeros(320, np.uint8))
    with pytest.raises(ValueError, match="at least one"):
        d.submit_group([], np.zeros(1, np.uint8))
