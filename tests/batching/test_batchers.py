"""The batcher layer in virtual time: the registry, the dynamic batcher's rules, and the
stage (gather, scatter, per-request completion, cancellation, failure isolation) on the
real dispatcher and simulated GPU."""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from paella import rings
from paella.dispatcher.batchers import (BatcherError, ModelVariants, VariantSpec, batcher_names,
                                        make_batcher)

from paella.dispatcher.batchers.base import SchedulerBatcher
from row_model import POISON, Client, serve, served_model

MODEL = ModelVariants("m", tuple(VariantSpec(i, b) for i, b in enumerate((1, 2, 4, 8))))


def req(i, rows=1, client=0, priority=0):
    return SimpleNamespace(req_id=i, rows=rows, seq_len=0, client_id=client, priority=priority)


def test_registry_names_errors_and_options():
    assert {"identity", "dynamic"} <= set(batcher_names())
    with pytest.raises(BatcherError, match="unknown batcher 'triton'.*dynamic.*identity"):
        make_batcher("triton", MODEL)
    with pytest.raises(BatcherError, match="no option 'max_delay'.*max_queue_delay_us"):
        make_batcher("dynamic", MODEL, {"max_delay": 5})
    with pytest.raises(BatcherError, match="max_batch_size must be 1..8"):
        make_batcher("dynamic", MODEL, {"max_batch_size": 16})
    with pytest.raises(BatcherError, match="must be an int"):
        make_batcher("dynamic", MODEL, {"max_batch_size": "8"})
    with pytest.raises(BatcherError, match="identity.*no option .max_batch_size.; valid options: none"):
        make_batcher("identity", MODEL, {"max_batch_size": 4})
    from paella.dispatcher.batchers import Batcher, register_batcher
    if "exits-in-init" not in batcher_names():
        @register_batcher("exits-in-init")
        class ExitsInInit(Batcher):          # sys.exit() in a plug-in: an error, not an exit
            def __init__(self, model):
                raise SystemExit(5)
    with pytest.raises(BatcherError, match="'exits-in-init' refused its options .* SystemExit: 5"):
        make_batcher("exits-in-init", MODEL)
    # Bounded: 1e8 levels once took the daemon's memory (a queue each); an infinite delay
    # never answered a lone request.
    with pytest.raises(BatcherError, match=r"priority_levels must be 0..64 \(one queue each"):
        make_batcher("dynamic", MODEL, {"priority_levels": 100_000_000})
    for bad in (float("inf"), float("nan"), -1.0):
        with pytest.raises(BatcherError, match=r"max_queue_delay_us must be 0..86400000000 \(a day\)"):
            make_batcher("dynamic", MODEL, {"max_queue_delay_us": bad})


def test_dynamic_forms_max_and_preferred_batches_at_once():
    b = make_batcher("dynamic", MODEL, {"max_queue_delay_us": 1000, "preferred_batch_sizes": [4]})
    assert b.add(req(0), 0.0) == [] and b.add(req(1), 0.0) == [] and b.add(req(2), 0.0) == []
    assert b.deadline() == pytest.approx(1e-3)
    (batch,) = b.add(req(3), 0.0)                      # 4 rows: a preferred size
    assert [r.req_id for r in batch.requests] == [0, 1, 2, 3] and batch.variant.rows == 4
    assert b.pending == 0 and b.deadline() is None
    out = b.add(req(4, rows=6), 0.0) + b.add(req(5, rows=2), 0.0)   # 8 rows: max_batch_size
    assert len(out) == 1 and out[0].rows == 8 and out[0].padding == 0


def test_dynamic_waits_for_the_delay_then_pads_to_the_next_variant():
    b = make_batcher("dynamic", MODEL, {"max_queue_delay_us": 500})
    assert b.add(req(0), 0.0) == [] and b.add(req(1, rows=2), 1e-4) == []
    assert b.poll(4.9e-4) == []
    (batch,) = b.poll(5e-4)
    assert batch.rows == 3 and batch.variant.rows == 4 and batch.padding == 1


def test_dynamic_keeps_order_and_never_splits_a_request():
    b = make_batcher("dynamic", MODEL, {"max_queue_delay_us": 100, "max_batch_size": 4})
    b.add(req(0, rows=3), 0.0)
    out = b.add(req(1, rows=2), 0.0)                  # 5 > 4: the first goes alone
    assert [[r.req_id for r in x.requests] for x in out] == [[0]]
    assert b.pending == 1


def test_dynamic_priority_levels_fill_from_the_highest():
    b = make_batcher("dynamic", MODEL, {"max_queue_delay_us": 100, "priority_levels": 2,
                                        "max_batch_size": 2})
    b.add(req(0, priority=2), 0.0)
    out = b.add(req(1, priority=1), 0.0)              # two rows: full
    assert [r.req_id for r in out[0].requests] == [1, 0]


def test_dynamic_holds_batches_while_max_inflight_run():
    b = make_batcher("dynamic", MODEL, {"max_inflight_batches": 1})
    (first,) = b.add(req(0), 0.0)
    assert b.add(req(1), 0.0) == [] and b.add(req(2), 0.0) == []
    b.batch_done(first, 1.0)
    (second,) = b.poll(1.0)
    assert [r.req_id for r in second.requests] == [1, 2] and second.variant.rows == 2


def test_remove_client_drops_only_its_queued_requests():
    b = make_batcher("dynamic", MODEL, {"max_queue_delay_us": 100})
    b.add(req(0, client=1), 0.0)
    b.add(req(1, client=2), 0.0)
    assert [r.req_id for r in b.remove_client(1)] == [0] and b.pending == 1


# -- the stage, end to end on the simulated GPU ------------------------------------------------
@pytest.mark.parametrize("batcher,options", [("identity", {}),
                                              ("dynamic", {"max_queue_delay_us": 200})])
def test_each_request_gets_exactly_its_own_rows(batcher, options):
    disp, stage = serve(batcher=batcher, options=options)
    c = Client()
    rows = [1, 2, 3, 1, 4, 2, 1, 1, 5, 3, 2, 1]       # 3 and 5 pad to 4 and 8
    for i, r in enumerate(rows):
        stage.submit(c.request(i, r, client=i % 3))
    stage.run_until_idle()
    assert set(c.done) == set(range(len(rows)))
    for i in range(len(rows)):
        assert c.done[i] == (rings.OK, None)
        np.testing.assert_array_equal(c.outputs[i], c.expect[i])
    assert c.woken == set(range(len(rows)))
    st = stage.stats
    assert st.requests == len(rows) and st.rows == sum(rows)
    if batcher == "dynamic":
        assert st.batches < len(rows)
    else:
        assert st.batches == len(rows) and st.padded_rows == 1 + 3 + 1   # 3 -> 4 (twice), 5 -> 8
        assert st.zero_copy == len(rows) - 3


def test_a_cancelled_request_of_a_batch_gets_no_outputs_and_the_others_theirs():
    disp, stage = serve(batcher="dynamic", options={"max_queue_delay_us": 100,
                                                    "preferred_batch_sizes": [4]})
    c = Client()
    for i in range(4):
        stage.submit(c.request(i, 1, client=i))       # one batch of 4, formed at once
    disp.step()
    stage.cancel_client(2)                            # in the running batch
    stage.submit(c.request(9, 1, client=7))           # queued
    stage.cancel_client(7)                            # cancelled while queued
    stage.run_until_idle()
    assert c.done[2][0] == rings.E_CANCELLED and c.done[9][0] == rings.E_CANCELLED
    assert not c.outputs[2].any() and not c.outputs[9].any()
    for i in (0, 1, 3):
        assert c.done[i] == (rings.OK, None)
        np.testing.assert_array_equal(c.outputs[i], c.expect[i])
    assert stage.stats.batches == 1


def test_a_failing_request_fails_alone():
    disp, stage = serve(batcher="dynamic", options={"max_queue_delay_us": 100}, greenlet=True)
    c = Client()
    for i in range(4):
        stage.submit(c.request(i, 1, first=POISON if i == 1 else None))
    stage.run_until_idle()
    assert c.done[1][0] == rings.E_FAILED and "poisoned row" in c.done[1][1]
    for i in (0, 2, 3):
        assert c.done[i] == (rings.OK, None)
        np.testing.assert_array_equal(c.outputs[i], c.expect[i])
    assert stage.stats.retried == 4


def test_a_request_larger_than_every_variant_is_refused_alone():
    disp, stage = serve(batcher="dynamic", options={"max_queue_delay_us": 100})
    c = Client()
    stage.submit(c.request(0, 9))
    stage.submit(c.request(1, 2))
    stage.run_until_idle()
    assert c.done[0][0] == rings.E_OPTIONS and "largest: 8 rows" in c.done[0][1]
    assert c.done[1] == (rings.OK, None)


def test_the_plug_in_of_docs_batching_md_works():
    """The example batcher of docs/batching.md, taken from the page, batches in pairs."""
    import re
    from pathlib import Path
    text = (Path(__file__).resolve().parents[2] / "docs" / "batching.md").read_text()
    code = re.search(r"```python\n(from paella.dispatcher.batchers import.*?)```", text, re.S).group(1)
    ns: dict = {}
    exec(compile(code, "docs/batching.md", "exec"), ns)
    disp, stage = serve(batcher="pairs", options={"wait_us": 300})
    c = Client()
    for i in range(5):
        stage.submit(c.request(i, 1, client=i))
    stage.run_until_idle()
    assert all(c.done[i] == (rings.OK, None) for i in range(5))
    for i in range(5):
        np.testing.assert_array_equal(c.outputs[i], c.expect[i])
    assert stage.stats.batches == 3 and stage.stats.padded_rows == 0   # 2 + 2 + 1


def _register_broken():
    """Plug-in batchers that get things wrong in the ways a plug-in can (once)."""
    from paella.dispatcher.batchers import Batch, Batcher, batcher_names, register_batcher
    if "repeats" in batcher_names():
        return

    @register_batcher("raises-in-poll")
    class RaisesInPoll(Batcher):
        def __init__(self, model):
            super().__init__(model)
            self.q = []

        def add(self, req, now):
            self.q.append(req)
            return []

        def deadline(self):
            return 0.0

        def poll(self, now):
            raise RuntimeError("plug-in bug")

    def holder(name, result=(), deadline=None, poll=()):
        """Holds every request; ``add`` returns ``result``, ``deadline`` and ``poll``
        their own wrong answers."""
        class Holder(Batcher):
            def add(self, req, now):
                return list(result) if isinstance(result, tuple) else result

            def deadline(self):
                return deadline

            def poll(self, now):
                return list(poll)
        register_batcher(name)(Holder)

    holder("add-returns-text", result="batches")
    holder("add-returns-none", result=None)
    holder("add-returns-ints", result=[1, 2])
    holder("holds-no-deadline")
    holder("deadline-nan", deadline=float("nan"))
    holder("deadline-text", deadline="soon")
    holder("deadline-always-past", deadline=0.0)

    @register_batcher("exits-in-add")
    class ExitsInAdd(Batcher):
        def add(self, req, now):
            raise SystemExit(3)              # sys.exit() must not end a shared daemon

    @register_batcher("repeats")
    class Repeats(Batcher):
        """Returns every request twice, and a batch with no variant."""

        def add(self, req, now):
            return [Batch([req], self.fit([req])), Batch([req], self.fit([req])),
                    Batch([req], None)]


@pytest.mark.parametrize("name", ["raises-in-poll", "exits-in-add", "repeats", "add-returns-text",
                                  "add-returns-none", "add-returns-ints", "holds-no-deadline",
                                  "deadline-nan", "deadline-text", "deadline-always-past"])
def test_a_wrong_batcher_loses_and_repeats_no_request(name):
    _register_broken()
    disp, stage = serve(batcher=name)
    c = Client()
    for i in range(4):
        stage.submit(c.request(i, 1 + i % 2, client=i))
    stage.run_until_idle()
    assert set(c.done) == set(range(4))                  # (Client asserts: once each)
    for i in range(4):
        assert c.done[i] == (rings.OK, None)
        np.testing.assert_array_equal(c.outputs[i], c.expect[i])
    if name != "repeats":                                # fell back to identity
        assert stage.models[100].batcher.name == "identity"


def test_metrics_count_each_request_once_through_retries_and_refusals():
    """A failed batch's requests run again alone: the daemon's metrics count each request
    once, by its final answer (the failed batch's tally is taken back when the stage
    retries), and a request the stage refuses before any job is counted too."""
    from paella.dispatcher.daemon.metrics import MetricsCounts
    disp, stage = serve(batcher="dynamic", options={"max_queue_delay_us": 100}, greenlet=True)
    counts = MetricsCounts()
    job_metrics, _, stage_metrics = counts.instruments()
    disp.instruments.add(job_metrics)
    stage.instruments.add(stage_metrics)
    c = Client()
    for i in range(4):
        stage.submit(c.request(i, 1, first=POISON if i == 1 else None))
    stage.submit(c.request(9, 9))                     # larger than every variant: refused
    stage.run_until_idle()
    assert stage.stats.retried == 4 and c.done[1][0] == rings.E_FAILED
    m = counts.models[c.model_id]
    assert (m.count, m.success, m.failure) == (5, 3, 2)
    assert m.exec_count == 1 + 4                      # the batch, then each alone
    assert counts.kernels >= m.kernels > 0


def test_the_stage_takes_its_instruments_as_a_list_too():
    from paella.dispatcher.batchers.stage import BatchingStage
    from paella.dispatcher.daemon.metrics import MetricsCounts
    from paella.dispatcher.instruments import Instruments
    disp, _ = serve()
    probe = MetricsCounts().instruments()[2]
    for given in ([probe], (probe,), Instruments([probe])):
        st = BatchingStage(disp, given)
        assert "request_finished" in st.instruments and "request_retried" in st.instruments
    assert not BatchingStage(disp).instruments


def test_a_replaced_model_runs_what_its_batcher_held_then_its_variants_are_freed():
    """A reload replaces a model whose batcher holds requests and gives none of them
    back on flush (a plug-in may): they still run, alone, on the old variants, and
    those are freed once their jobs end (Dispatcher.retire_model)."""
    from paella.dispatcher.batchers import Batcher
    from paella.dispatcher.batchers.stage import ServedModel

    class Hoards(Batcher):
        def add(self, req, now):
            return []

        def deadline(self):
            return None

        def flush(self, now):
            return []

    disp, stage = serve(sizes=(1, 2))
    old = stage.models[100]
    stage.add_model(100, ServedModel("rows", old.variants, old.served, Hoards(old.variants)))
    dev = disp.device
    base_models, base_bytes = len(disp.models), dev.allocated_bytes
    c = Client()
    for i in range(3):
        stage.submit(c.request(i, 1 + i % 2, client=i))
    for _ in range(5):
        disp.step()
        stage.step()
    assert c.done == {} and stage.queued == 3     # (they stay with the batcher)
    stage.add_model(100, served_model(disp, (1, 2), "rows2"))   # the new version
    stage.submit(c.request(3, 2, client=3))
    for _ in range(10_000):                  # (bounded: a request lost here would make
        if len(c.done) == 4:                 # stage.run_until_idle spin for ever)
            break
        disp.step()
        stage.step()
        if disp.idle and dev.next_event_time() != float("inf"):
            dev.run_until(dev.next_event_time())
    assert set(c.done) == {0, 1, 2, 3}
    for i in range(4):
        assert c.done[i] == (rings.OK, None)
        np.testing.assert_array_equal(c.outputs[i], c.expect[i])
    assert len(disp.models) == base_models   # the two old variants went, two new came
    assert all(m.name.startswith("rows2@") for m in disp.models.values())
    stage.remove_model(100)
    assert disp.models == {} and dev.allocated_bytes == 0 < base_bytes


def _drive(disp, stage, done, n=20_000):
    """Step in virtual time until ``done()`` (bounded, unlike stage.run_until_idle)."""
    dev = disp.device
    for _ in range(n):
        if done():
            return
        disp.step()
        stage.step()
        if disp.idle:
            d = stage.deadline()
            t = min(dev.next_event_time(), float("inf") if d is None else d)
            if t != float("inf"):
                dev.run_until(max(t, dev.now()))


def test_a_failed_batch_of_a_replaced_model_retries_on_its_own_variants():
    """The swap flushes the old batcher: one batch of 4 on the old 4-row variant, which
    fails (a poisoned row), and its requests retry alone on the old 1-row variant. That
    variant had no job at the swap; it must still be there (it was freed at once, and
    the retry's ValueError took the daemon's loop down)."""
    disp, stage = serve(batcher="dynamic", options={"max_queue_delay_us": 10_000_000},
                        greenlet=True)
    c = Client()
    for i in range(4):
        stage.submit(c.request(i, 1, client=i, first=POISON if i == 1 else None))
    for _ in range(3):
        disp.step()
        stage.step()
    assert stage.queued == 4 and c.done == {}
    stage.add_model(100, served_model(disp, (1, 2, 4, 8), "v2", greenlet=True))
    _drive(disp, stage, lambda: len(c.done) == 4)
    assert c.done[1][0] == rings.E_FAILED
    for i in (0, 2, 3):
        assert c.done[i] == (rings.OK, None)
        np.testing.assert_array_equal(c.outputs[i], c.expect[i])
    assert sorted(m.name for m in disp.models.values()) == ["v2@1", "v2@2", "v2@4", "v2@8"]


class Later(SchedulerBatcher):
    """Holds each request for 1 ms of device time, then runs it on the 1-row variant."""
    name = "later"

    def start(self, ctx):
        super().start(ctx)
        self.held, self.at = [], 0.0

    def add(self, req, now):
        self.held.append(req)
        self.at = now + 1e-3

    def deadline(self):
        return self.at if self.held else None

    def remove_client(self, client_id):
        self.held = [r for r in self.held if r.client_id != client_id]

    def poll(self, now):
        for req in self.held:
            self.ctx.submit(self.ctx.variants[0].model_id, req.io, [req.client_id],
                            lambda st, err, req=req: self.ctx.complete(req, st, err))
        self.held = []


def test_a_retired_scheduler_keeps_the_variants_it_still_needs():
    """A scheduler holding requests is replaced by a model on the same variant ids, and
    that one is then removed: the variants stay until the scheduler's requests ran."""
    from paella.dispatcher.batchers.stage import ServedModel

    disp, stage = serve(sizes=(1, 2))
    m = stage.models[100]
    stage.add_model(100, ServedModel("rows", m.variants, m.served, Later(m.variants)))
    c = Client()
    for i in range(2):
        stage.submit(c.request(i, 1, client=i))
    stage.add_model(100, ServedModel("rows", m.variants, m.served,
                                     make_batcher("identity", m.variants)))
    stage.remove_model(100)
    assert len(disp.models) == 2             # the retired scheduler still needs them
    _drive(disp, stage, lambda: len(c.done) == 2)
    assert c.done == {0: (rings.OK, None), 1: (rings.OK, None)}
    _drive(disp, stage, lambda: not disp.models, n=100)
    assert disp.models == {} and disp.device.allocated_bytes == 0


def test_removed_model_ids_are_never_handed_out_again():
    disp, stage = serve(sizes=(1, 2))
    before = set(disp.models)
    stage.remove_model(100)
    assert disp.models == {}
    v = served_model(disp, (1,), "v2")
    assert not {sv.model_id for sv in v.served.values()} & before


def test_a_retired_scheduler_whose_client_left_closes_and_frees_its_variants():
    from paella.dispatcher.batchers.stage import ServedModel
    disp, stage = serve(sizes=(1, 2))
    m = stage.models[100]
    stage.add_model(100, ServedModel("rows", m.variants, m.served, Later(m.variants)))
    sched = stage.models[100]
    c = Client()
    stage.submit(c.request(0, 1, client=9))
    stage.add_model(100, served_model(disp, (1, 2), "v2"))     # held, no job yet
    stage.cancel_client(9)
    assert c.done[0][0] == rings.E_CANCELLED
    assert sched.ctx.closed and stage._retired == []
    assert sorted(x.name for x in disp.models.values()) == ["v2@1", "v2@2"]


def test_an_abandoned_batch_is_answered_with_its_failure_not_retried():
    """The daemon's lost-GPU path: every request of a running batch is completed with
    E_FAILED by abandon_all, and gets that answer (a retry submitted into the
    dispatcher being abandoned was dropped: no answer at all)."""
    disp, stage = serve(batcher="dynamic", options={"max_queue_delay_us": 1000})
    m = stage.models[100]
    c = Client()
    for i in range(3):
        stage.submit(c.request(i, 1, client=i))
    _drive(disp, stage, lambda: m.running > 0)
    stage.flush()
    stage.abandon("lost", rings.E_FAILED)
    assert disp.abandon_all("the GPU failed", rings.E_FAILED) == 3
    assert c.done == {i: (rings.E_FAILED, "the GPU failed") for i in range(3)}
    assert m.running == 0 and disp.in_flight == 0
