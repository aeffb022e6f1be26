"""A compiled model's new input is computed before its job takes anything on the device
(``Dispatcher._await_answer``, ``FunctionalCache.ahead``; issue 37): the job waits in the
dispatcher holding no buffer set, stream or kernel slot, so jobs of cached inputs run on
meanwhile, under ``fifo`` (one stream for everything) and with more new inputs waiting
than the device has streams. Answers are driven by hand here (a runner whose futures
the test completes), on the simulated GPU in virtual time."""
from __future__ import annotations

from concurrent.futures import Future

import numpy as np
import pytest

from paella.bundle import load_bundle
from paella.dispatcher.core import STATUS_CANCELLED, STATUS_ERROR, STATUS_OK, Dispatcher, Request
from paella.dispatcher.daemon.bundles import FunctionalCache, functional_adaptor
from paella.dispatcher.devices.sim import SimDevice


class HandDriven:
    """The effect workers' interface (``submit(fn, *args) -> Future``), computing in
    this thread only when told: at once while ``auto``, else at :meth:`finish`."""

    max_queue = None

    def __init__(self) -> None:
        self.auto = True
        self.waiting: list[tuple[Future, object, tuple]] = []

    def submit(self, fn, *args, bound=True, owner=None) -> Future:
        f: Future = Future()
        if self.auto:
            f.set_result(fn(*args))
        else:
            self.waiting.append((f, fn, args))
        return f

    def finish(self, fail: bool = False) -> int:
        n = len(self.waiting)
        for f, fn, args in self.waiting:
            if fail:
                f.set_exception(RuntimeError("worker 1234 died (SIGSEGV)"))
            else:
                f.set_result(fn(*args))
        self.waiting = []
        return n


@pytest.fixture(scope="module")
def bundle(tmp_path_factory):
    from paella.compiler_pass.build import compile_bundle
    from paella.models.tiny import tiny_mlp
    return load_bundle(compile_bundle(tiny_mlp(), tmp_path_factory.mktemp("ahead") / "mlp"))


def served(bundle, policy: str, n_streams: int = 2):
    effects = HandDriven()
    cache = FunctionalCache(effects=effects)
    adaptor = functional_adaptor(bundle, "mlp", cache)
    adaptor.warm()                               # the zeros' answer, cached
    effects.auto = False
    dev = SimDevice("t4", n_streams=n_streams, seed=0)
    d = Dispatcher(dev, policy, profile_runs=0)
    return d, dev, effects, d.register_model("mlp", adaptor)


def submit(bundle, d, mid, rid, x, done, client=0):
    io = bundle.pack_inputs({"x": x})
    d.submit(Request(rid, client, mid, io,
                     on_complete=lambda r, st, err: done.__setitem__(r.req_id, (st, err, io))))


def drive(d, dev, until, limit=20_000):
    for _ in range(limit):
        if until():
            return
        d.step()
        t = dev.next_event_time()
        if t != float("inf"):
            dev.run_until(t)
    raise AssertionError("never came")


def fresh(seed):
    return np.random.default_rng(seed).standard_normal((2, 16)).astype(np.float32)


@pytest.mark.parametrize("policy", ["fifo", "paella"])
def test_cached_inputs_run_while_more_new_ones_than_streams_wait(bundle, policy):
    d, dev, effects, mid = served(bundle, policy)
    done: dict = {}
    for i in range(5):                           # 5 new inputs, 2 streams
        submit(bundle, d, mid, i, fresh(i), done, client=1)
    zeros = np.zeros((2, 16), np.float32)
    for i in range(10, 13):
        submit(bundle, d, mid, i, zeros, done, client=2)
    drive(d, dev, lambda: {10, 11, 12} <= set(done))
    assert not {0, 1, 2, 3, 4} & set(done)       # the new ones wait for their answers
    assert d.answers_awaited == 5 and len(effects.waiting) == 5
    assert dev.gates == 0                        # holding nothing on the device
    want = bundle.run_cpu({"x": zeros})["output0"]
    for i in range(10, 13):
        st, err, io = done[i]
        assert (st, err) == (STATUS_OK, None)
        np.testing.assert_array_equal(bundle.unpack_outputs(io)["output0"], want)
    effects.finish()
    drive(d, dev, lambda: len(done) == 8)
    assert d.answers_awaited == 0 and d.in_flight == 0
    for i in range(5):
        st, err, io = done[i]
        assert (st, err) == (STATUS_OK, None)
        np.testing.assert_array_equal(bundle.unpack_outputs(io)["output0"],
                                      bundle.run_cpu({"x": fresh(i)})["output0"])
    assert effects.waiting == []                 # each answer computed once, then cached


def test_one_new_input_sent_twice_is_computed_once(bundle):
    d, dev, effects, mid = served(bundle, "paella")
    done: dict = {}
    submit(bundle, d, mid, 1, fresh(7), done)
    submit(bundle, d, mid, 2, fresh(7), done)
    drive(d, dev, lambda: d.answers_awaited == 2)
    assert len(effects.waiting) == 1
    effects.finish()
    drive(d, dev, lambda: len(done) == 2)
    assert [done[i][:2] for i in (1, 2)] == [(STATUS_OK, None)] * 2


def test_a_failed_answer_fails_its_job_alone_and_a_waiting_job_can_be_cancelled(bundle):
    d, dev, effects, mid = served(bundle, "fifo")
    done: dict = {}
    submit(bundle, d, mid, 1, fresh(1), done, client=1)
    submit(bundle, d, mid, 2, fresh(2), done, client=2)
    drive(d, dev, lambda: d.answers_awaited == 2)
    assert d.cancel_client(2) == 1               # it vanished while its answer computed
    drive(d, dev, lambda: 2 in done)
    assert done[2][0] == STATUS_CANCELLED and d.answers_awaited == 1
    effects.finish(fail=True)
    drive(d, dev, lambda: 1 in done)
    st, err, _ = done[1]
    assert st == STATUS_ERROR and err == "answer not computed: worker 1234 died (SIGSEGV)"
    assert d.in_flight == 0 and not d.jobs
    # and the model serves on
    submit(bundle, d, mid, 3, np.zeros((2, 16), np.float32), done)
    drive(d, dev, lambda: 3 in done)
    assert done[3][:2] == (STATUS_OK, None)


def test_the_lookup_ahead_counts_cached_inputs_by_a_coarse_key(bundle):
    """``ahead`` decides a likely hit on a coarse key (runs of AHEAD_SPAN bytes per input),
    counted per cached input as entries come and go; only a new input's job waits."""
    from paella.dispatcher.daemon.bundles import AHEAD_SPAN, coarse_spans
    effects = HandDriven()
    effects.auto = False
    n = 16384                                    # 64 KiB of float32: 256-byte steps
    out = {"y": np.zeros(4, np.float32)}
    cache = FunctionalCache(max_bytes=n * 4 + 16, effects=effects)   # room for one entry
    x = np.zeros(n, np.float32)
    cache._insert(cache._key("m", {"x": x}), {"x": x.copy()}, out)
    assert len(cache._coarse) == 1

    def ask(a):                                  # as the adaptor asks: its coarse key
        return cache.ahead("m", bundle, cache._coarse_key("m", {"x": a}), lambda: {"x": a})
    assert ask(x) is None             # cached: a likely hit
    crafted = x.copy()
    crafted.view(np.uint8)[AHEAD_SPAN + 4] = 1   # between the first two runs
    assert coarse_spans(n * 4)[1][0] > AHEAD_SPAN + 4
    assert ask(crafted) is None       # passes as one (documented)
    new = x.copy()
    new.view(np.uint8)[0] = 1                    # in the first run
    f = ask(new)
    assert isinstance(f, Future) and not f.done() and len(effects.waiting) == 1
    assert ask(new.copy()) is f       # the same new input: shared
    # Another input evicts x (room for one): x is new again, the counts follow.
    y = np.full(n, 2.0, np.float32)
    cache._insert(cache._key("m", {"y": y}), {"y": y.copy()}, out)
    assert len(cache._coarse) == 1
    assert isinstance(ask(x), Future)


@pytest.mark.parametrize("policy, waits", [("fifo", True), ("paella", False)])
def test_a_step_job_whose_effect_computes_waits_only_where_it_would_hold_everyone(policy, waits):
    """``submit_group(ready=future)`` (a step plug-in's effect computing elsewhere): under
    ``fifo``, one stream for every job, the job waits for it holding nothing, so the
    others run; under a policy with a pool of streams it goes in at once (the device
    holds its kernel on its own stream until the answer is in)."""
    from paella.dispatcher.adaptor import PlanAdaptor, synthetic_plan
    dev = SimDevice("t4", n_streams=4, seed=0)
    d = Dispatcher(dev, policy, profile_runs=0)
    step = d.register_model("step", PlanAdaptor(synthetic_plan("step", [("k", 40, 128, 32, 2e-4)])))
    other = d.register_model("other", PlanAdaptor(synthetic_plan("other", [("j", 40, 128, 32, 1e-4)])))
    done: dict = {}

    def req(rid, mid):
        return Request(rid, rid, mid, np.zeros(8, np.uint8),
                       on_complete=lambda r, st, err: done.__setitem__(r.req_id, (st, err)))
    ready: Future = Future()
    d.submit_group([req(1, step)], np.zeros(8, np.uint8), ready=ready)
    assert d.answers_awaited == (1 if waits else 0)
    d.submit(req(2, other))
    drive(d, dev, lambda: 2 in done and (waits or 1 in done))
    assert done[2] == (STATUS_OK, None)
    if waits:
        assert 1 not in done
        ready.set_result(None)
        drive(d, dev, lambda: 1 in done)
    assert done[1] == (STATUS_OK, None) and d.answers_awaited == 0
