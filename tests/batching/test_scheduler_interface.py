"""The scheduler interface (batchers that drive their own jobs, docs/batching.md
"Schedulers"): a toy scheduler on the row model, in virtual time, on real bytes.

``TwoPass`` runs each request twice through the 1-row variant on the request's own io
(y = 3x + 1, then x := y and again: 9x + 4), reports progress after the first pass and
completes after the second; its options make it misbehave on purpose."""
from __future__ import annotations

import numpy as np
import pytest

from paella import rings
from paella.dispatcher.batchers import ModelVariants
from paella.dispatcher.batchers.base import RequestRefused, SchedulerBatcher
from paella.dispatcher.batchers.stage import ServedModel

from row_model import COLS, Client, serve, variant_adaptor


class TwoPass(SchedulerBatcher):
    name = "two-pass"

    def __init__(self, model, *, raise_in: str = "", refuse_first: float = -1.0,
                 answer_twice: bool = False):
        super().__init__(model)
        self.raise_in, self.refuse_first, self.answer_twice = raise_in, refuse_first, answer_twice
        self.removed: list[int] = []
        self.closed = False

    def start(self, ctx):
        super().start(ctx)
        self.v = ctx.variants[0]                 # the 1-row variant
        self.ptr = ctx.alloc(4096)               # device memory the stage frees at the end

    def add(self, req, now):
        if self.raise_in == "add":
            raise RuntimeError("boom in add")
        if self.raise_in == "hold":          # keeps it, with nothing that would wake it
            return
        x = req.io[:COLS * 4].view(np.float32)
        if x[0] == self.refuse_first:
            raise RequestRefused(f"first value {self.refuse_first} is not served")
        self._pass(req, 1)

    def _pass(self, req, k):
        self.ctx.submit(self.v.model_id, req.io, [req.client_id],
                        lambda st, err: self._done(req, k, st, err))

    def _done(self, req, k, status, err):
        if self.raise_in == "on_done":
            raise RuntimeError("boom in on_done")
        if status != rings.OK:
            self.ctx.complete(req, status, err)
            return
        y = self.v.layout.outputs[0]
        if k == 1:
            self.ctx.progress(req, 1)
            req.io[:COLS * 4] = req.io[y.offset:y.offset + COLS * 4]
            self._pass(req, 2)
        else:
            self.ctx.complete(req)
            if self.answer_twice:
                assert self.ctx.complete(req) is False

    def remove_client(self, client_id):
        self.removed.append(client_id)
        return []

    def close(self):
        self.closed = True


def served(**options):
    disp, stage = serve(sizes=(1, 2))
    m = stage.models[100]
    sched = TwoPass(m.variants, **options)
    stage.add_model(100, ServedModel("rows", m.variants, m.served, sched))
    return disp, stage, sched


def progress_log(reqs):
    log = []
    for r in reqs:
        r.on_progress = lambda q, n: log.append((q.req_id, n))
    return log


def test_requests_complete_once_with_progress_first_and_memory_freed():
    disp, stage, sched = served(answer_twice=True)
    c = Client()
    reqs = [c.request(i, 1, client=i % 2) for i in range(4)]
    x0 = {i: c.expect[i].copy() for i in range(4)}
    log = progress_log(reqs)
    for r in reqs:
        stage.submit(r)
    stage.run_until_idle()
    assert sorted(c.done) == [0, 1, 2, 3]
    assert all(st == rings.OK for st, _ in c.done.values())
    for i in range(4):      # 3 (3x+1) + 1 = 9x + 4, with x = (expect - 1) / 3
        x = (x0[i] - 1) / 3
        np.testing.assert_allclose(c.outputs[i], 9 * x + 4)
    assert sorted(log) == [(i, 1) for i in range(4)]
    assert stage.queued == 0 and stage.stats.scheduler_jobs == 8
    ctx = stage.models[100].ctx
    assert ctx.jobs == 0 and ctx.held() == []
    stage.abandon("stop")                        # closes it; its memory goes back
    assert sched.closed and not ctx._ptrs


def test_refused_request_fails_alone():
    disp, stage, sched = served(refuse_first=1000.0)     # request 1's first value
    c = Client()
    for i in range(3):
        stage.submit(c.request(i, 1))
    stage.run_until_idle()
    assert c.done[1][0] == rings.E_OPTIONS and "not served" in c.done[1][1]
    assert c.done[0][0] == c.done[2][0] == rings.OK


@pytest.mark.parametrize("where", ["add", "on_done"])
def test_raising_scheduler_answers_everything_once(where):
    disp, stage, sched = served(raise_in=where)
    c = Client()
    for i in range(3):
        stage.submit(c.request(i, 1))
    stage.run_until_idle()
    stage.submit(c.request(9, 1))                # after the failure: answered at once
    assert sorted(c.done) == [0, 1, 2, 9]
    for st, err in c.done.values():
        assert st == rings.E_INTERNAL
        assert err.startswith(f"rows out of service: scheduler 'two-pass' raised in {where}(): "
                              f"RuntimeError: boom in {where}")
        assert err.endswith("reload (SIGHUP)")
    assert stage.queued == 0 and sched.closed
    assert stage.stats.scheduler_failures == 1
    assert not stage.models[100].ctx._ptrs       # no job in flight: memory freed


def test_client_leaving_cancels_its_requests_and_others_finish():
    disp, stage, sched = served()
    c = Client()
    for i in range(4):
        stage.submit(c.request(i, 1, client=7 if i < 2 else 8))
    disp.step()
    stage.cancel_client(7)
    stage.run_until_idle()
    assert sched.removed == [7]
    assert [c.done[i][0] for i in range(4)] == [rings.E_CANCELLED] * 2 + [rings.OK] * 2


def test_abandon_answers_held_requests_cancelled():
    disp, stage, sched = served()
    c = Client()
    for i in range(3):
        stage.submit(c.request(i, 1))
    disp.step()
    stage.abandon("cancelled: the daemon stopped")
    disp.abandon_all("cancelled: the daemon stopped")
    assert sorted(c.done) == [0, 1, 2]
    assert all(st == rings.E_CANCELLED for st, _ in c.done.values())
    assert stage.queued == 0 and sched.closed


def test_reload_retires_the_old_scheduler_after_its_requests():
    disp, stage, old = served()
    c = Client()
    for i in range(2):
        stage.submit(c.request(i, 1))
    m = stage.models[100]
    new = TwoPass(m.variants)
    stage.add_model(100, ServedModel("rows", m.variants, m.served, new))
    stage.submit(c.request(5, 1))
    assert not old.closed
    stage.run_until_idle()
    assert sorted(c.done) == [0, 1, 5] and all(s == rings.OK for s, _ in c.done.values())
    assert old.closed and not new.closed and stage._retired == []


def test_a_scheduler_may_not_run_other_models():
    disp, stage, sched = served()
    other = disp.register_model("other", variant_adaptor(1)[0])
    with pytest.raises(ValueError, match="not one this scheduler registered"):
        sched.ctx.submit(other, np.zeros(64, np.uint8), [0], lambda s, e: None)
    assert isinstance(stage.models[100].variants, ModelVariants)


def test_a_scheduler_holding_requests_with_nothing_to_wake_it_is_a_stall():
    disp, stage, sched = served(raise_in="hold")
    c = Client()
    stage.submit(c.request(0, 1))
    assert stage.deadline() is None                  # the loop's look: a stall, answered
    assert c.done[0][0] == rings.E_INTERNAL
    assert "no job in flight and no deadline" in c.done[0][1]
    assert stage.queued == 0


def test_a_scheduler_failing_to_start_is_not_served_and_frees_its_memory():
    disp, stage, sched = served()
    m = stage.models[100]
    bad = TwoPass(m.variants)
    bad.start = lambda ctx: (SchedulerBatcher.start(bad, ctx), ctx.alloc(64), 1 / 0)
    with pytest.raises(ZeroDivisionError):
        stage.add_model(101, ServedModel("rows2", m.variants, m.served, bad))
    assert 101 not in stage.models and not bad.ctx._ptrs and bad.closed
