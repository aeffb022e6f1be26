"""The dynamic batcher against Triton's documented dynamic-batching rules, one test per
rule, in virtual time (the device clock is whatever ``now`` the test passes; the stage
tests run the real dispatcher on the simulated GPU).

Each docstring quotes the rule it checks: Triton's user guide ("Batchers", docs/
user_guide/batcher.md of triton-inference-server/server) or the model configuration's
protobuf documentation (ModelDynamicBatching and ModelQueuePolicy in model_config.proto
of triton-inference-server/common)."""
from __future__ import annotations

import logging
from types import SimpleNamespace

import numpy as np
import pytest

from paella import rings
from paella.dispatcher.batchers import (BatcherError, ModelVariants, VariantSpec,
                                        make_batcher)
from paella.dispatcher.batchers.stage import BatchingStage, ServedModel, ServedVariant
from paella.dispatcher.core import Dispatcher
from paella.dispatcher.devices.sim import SimDevice
from row_model import Client, variant_adaptor

MODEL = ModelVariants("m", tuple(VariantSpec(i, b) for i, b in enumerate((1, 2, 4, 8))))
US = 1e-6


def req(i, rows=1, client=0, priority=0, timeout_us=None):
    r = SimpleNamespace(req_id=i, rows=rows, seq_len=0, client_id=client, priority=priority)
    if timeout_us is not None:
        r.timeout_us = timeout_us
    return r


def ids(batch):
    return [r.req_id for r in batch.requests]


def refusing(options):
    """The batcher with a refusal hook as a stage sets it; refusals are recorded."""
    b = make_batcher("dynamic", MODEL, options)
    refused = []
    b.refuse = lambda r, reason: refused.append((r.req_id, reason))
    return b, refused


def in_flight(b, now=0.0):
    """One batch in flight first (``max_inflight_batches`` 1 holds the next ones back,
    as Triton holds them while its model instance is busy)."""
    first = b.add(req(100, rows=b.max_batch_size), now)
    assert len(first) == 1 and ids(first[0]) == [100]
    return first[0]


# -- preferred batch sizes and the queue delay ------------------------------------------------
def test_the_largest_preferred_size_that_can_be_formed_leaves_at_once():
    """Triton: "If the dynamic batcher can form a batch of a preferred size(s) it will
    create a batch of the largest possible preferred size and send it for inferencing."

    Issue 40's case: max_batch_size 8, preferred [4], five one-row requests queued while
    a batch is in flight: when it ends the next batch is 4 rows, at once (it used to wait
    the whole delay and send all five, padded to 8)."""
    b = make_batcher("dynamic", MODEL, {"max_batch_size": 8, "preferred_batch_size": [4],
                                        "max_queue_delay_microseconds": 1000,
                                        "max_inflight_batches": 1})
    first = in_flight(b)
    for i in range(5):
        assert b.add(req(i), i * US) == []          # held: a batch is in flight
    b.batch_done(first, 20 * US)
    (batch,) = b.poll(20 * US)                      # long before the delay (1000 us)
    assert ids(batch) == [0, 1, 2, 3] and batch.variant.rows == 4 and batch.padding == 0
    assert b.pending == 1
    # With two preferred sizes the larger one that can be formed goes.
    b = make_batcher("dynamic", MODEL, {"preferred_batch_size": [2, 4],
                                        "max_queue_delay_microseconds": 1000,
                                        "max_inflight_batches": 1})
    first = in_flight(b)
    for i in range(7):
        b.add(req(i), 0.0)
    b.batch_done(first, 1 * US)
    (batch,) = b.poll(1 * US)
    assert ids(batch) == [0, 1, 2, 3]


def test_the_queue_delay_applies_only_when_no_preferred_size_can_be_formed():
    """Triton: "When a batch of a maximum or preferred size cannot be created from the
    available requests, the dynamic batcher will delay sending the batch as long as no
    request is delayed longer than the configured max_queue_delay_microseconds value.
    If a new request arrives during this delay and allows the dynamic batcher to form a
    batch of a maximum or preferred batch size, then that batch is sent immediately for
    inferencing. If the delay expires the dynamic batcher sends the batch as is, even
    though it is not a maximum or preferred size." """
    b = make_batcher("dynamic", MODEL, {"preferred_batch_size": [4],
                                        "max_queue_delay_microseconds": 1000})
    assert b.add(req(0), 0.0) == [] and b.add(req(1, rows=2), 100 * US) == []
    assert b.deadline() == pytest.approx(1000 * US)     # the oldest request's delay
    assert b.poll(999 * US) == []
    (batch,) = b.add(req(2), 500 * US)                  # 4 rows: preferred, sent now
    assert ids(batch) == [0, 1, 2] and b.deadline() is None
    # No preferred size forms: the batch waits out the delay, then goes as it is.
    assert b.add(req(3, rows=2), 2000 * US) == [] and b.add(req(4), 2100 * US) == []
    assert b.poll(2999 * US) == []
    (batch,) = b.poll(3000 * US)
    assert ids(batch) == [3, 4] and batch.rows == 3 and batch.variant.rows == 4
    # A maximum-size batch leaves at once too, though no preferred size forms (6 + 2).
    assert b.add(req(5, rows=6), 4000 * US) == []
    (batch,) = b.add(req(6, rows=2), 4001 * US)
    assert ids(batch) == [5, 6] and batch.rows == 8


def test_without_preferred_sizes_the_largest_batch_forms_and_waits_for_the_delay():
    """Triton: "If the dynamic batcher cannot form a batch of a preferred size (or if the
    dynamic batcher is not configured with any preferred batch sizes), it will send a
    batch of the largest size possible that is less than the maximum batch size allowed
    by the model (but see the following section for the delay option that changes this
    behavior)"; with the delay, the batch waits for more unless a maximum-size batch
    can be formed, which is sent immediately. And: "By default the dynamic batcher will
    create batches as large as possible up to the maximum batch size and will not delay
    when forming batches." """
    b = make_batcher("dynamic", MODEL, {"max_queue_delay_microseconds": 500})
    for i in range(7):
        assert b.add(req(i), i * US) == []
    (batch,) = b.add(req(7), 10 * US)                   # 8 rows: max_batch_size, now
    assert ids(batch) == list(range(8))
    b = make_batcher("dynamic", MODEL, {"max_batch_size": 4, "max_inflight_batches": 1})
    first = in_flight(b)
    for i in range(6):
        b.add(req(i), 0.0)
    b.batch_done(first, 1 * US)
    (batch,) = b.poll(1 * US)                            # no delay: the largest, at once
    assert ids(batch) == [0, 1, 2, 3]
    b.batch_done(batch, 2 * US)
    (batch,) = b.poll(2 * US)
    assert ids(batch) == [4, 5]


# -- the queue policy ------------------------------------------------------------------------
def test_default_timeout_zero_is_no_timeout():
    """ModelQueuePolicy.default_timeout_microseconds: "The default timeout for every
    request, in microseconds. The default value is 0 which indicates that no timeout is
    set." """
    b, refused = refusing({"max_inflight_batches": 1,
                           "default_queue_policy": {"timeout_action": "REJECT"}})
    in_flight(b)
    b.add(req(0), 0.0)
    assert b.deadline() is None and b.poll(3600.0) == [] and not refused
    assert b.pending == 1


def test_a_request_past_its_timeout_is_rejected_with_reject():
    """ModelQueuePolicy.TimeoutAction REJECT: "Reject the request and return error message
    accordingly." (the default action). The timeout is "The default timeout for every
    request, in microseconds" in the queue; Triton answers "Request timeout expired"."""
    b, refused = refusing({"max_inflight_batches": 1, "max_queue_delay_microseconds": 5000,
                           "default_queue_policy": {"default_timeout_microseconds": 300}})
    first = in_flight(b)
    b.add(req(0), 0.0)
    b.add(req(1), 200 * US)
    assert b.deadline() == pytest.approx(300 * US)      # held, yet its timeout is watched
    assert b.poll(299 * US) == [] and not refused
    assert b.poll(300 * US) == []
    assert [r for r, _ in refused] == [0] and b.pending == 1
    assert "request timeout expired" in refused[0][1] and "REJECT" in refused[0][1]
    assert b.deadline() == pytest.approx(500 * US)
    b.batch_done(first, 400 * US)                       # the other one is still in time
    assert b.poll(400 * US) == [] and b.deadline() == pytest.approx(500 * US)
    b.poll(500 * US)
    assert [r for r, _ in refused] == [0, 1] and b.pending == 0


def test_a_request_past_its_timeout_waits_behind_the_others_with_delay():
    """ModelQueuePolicy.TimeoutAction DELAY: "Delay the request until all other requests
    at the same (or higher) priority levels that have not reached their timeouts are
    processed. A delayed request will eventually be processed, but may be delayed
    indefinitely due to newly arriving requests." """
    b, refused = refusing({"max_batch_size": 1, "max_inflight_batches": 1,
                           "default_queue_policy": {"default_timeout_microseconds": 100,
                                                    "timeout_action": "DELAY"}})
    first = in_flight(b)
    b.add(req(0), 0.0)                                  # expires at 100 us
    b.poll(150 * US)
    b.add(req(1), 200 * US)                             # in time until 300 us
    b.batch_done(first, 250 * US)
    (batch,) = b.poll(250 * US)
    assert ids(batch) == [1] and not refused            # the delayed one waits
    b.add(req(2), 260 * US)
    b.batch_done(batch, 270 * US)
    (batch,) = b.poll(270 * US)
    assert ids(batch) == [2]                            # ... behind newer ones too
    b.batch_done(batch, 280 * US)
    (batch,) = b.poll(280 * US)
    assert ids(batch) == [0] and b.pending == 0         # and is served eventually
    # "(or higher) priority levels": delayed at level 1, it still goes before level 2.
    b, _ = refusing({"max_batch_size": 1, "max_inflight_batches": 1, "priority_levels": 2,
                     "default_queue_policy": {"default_timeout_microseconds": 100,
                                              "timeout_action": "DELAY"}})
    first = in_flight(b)
    b.add(req(0, priority=1), 0.0)
    b.add(req(1, priority=2), 150 * US)
    b.add(req(2, priority=1), 160 * US)
    b.batch_done(first, 170 * US)
    order = []
    for t in (170, 171, 172):
        (batch,) = b.poll(t * US)
        order += ids(batch)
        b.batch_done(batch, t * US)
    assert order == [2, 0, 1]


def test_a_client_that_leaves_takes_its_queued_and_delayed_requests():
    """(Not a Triton rule: the daemon's client cancellation.) Its requests leave both
    queues of a level, the queue size counts only what is left, and the rest keep
    their order."""
    b, refused = refusing({"max_batch_size": 1, "max_inflight_batches": 1,
                           "default_queue_policy": {"default_timeout_microseconds": 100,
                                                    "timeout_action": "DELAY",
                                                    "max_queue_size": 3}})
    first = in_flight(b)
    b.add(req(0, client=1), 0.0)
    b.add(req(1, client=2), 0.0)
    b.poll(150 * US)                                    # both delayed
    b.add(req(2, client=1), 160 * US)
    assert sorted(r.req_id for r in b.remove_client(1)) == [0, 2] and b.pending == 1
    b.add(req(3, client=2), 170 * US)
    b.add(req(4, client=2), 170 * US)
    assert not refused                                  # 3 of 3: room for both
    b.batch_done(first, 200 * US)
    order = []
    for t in (200, 201, 202):
        (batch,) = b.poll(t * US)
        order += ids(batch)
        b.batch_done(batch, t * US)
    assert order == [3, 4, 1] and b.pending == 0


def test_a_request_may_shorten_its_timeout_only_where_overriding_is_allowed():
    """ModelQueuePolicy.allow_timeout_override: "Whether individual request can override
    the default timeout value. When true, individual requests can set a timeout that is
    less than the default timeout value but may not increase the timeout."

    (A request here carries its own timeout as ``timeout_us``, where the request object
    has one: the wire format has no field for it.)"""
    policy = {"default_timeout_microseconds": 1000, "allow_timeout_override": True}
    b, refused = refusing({"max_inflight_batches": 1, "default_queue_policy": policy})
    in_flight(b)
    b.add(req(0, timeout_us=100), 0.0)                  # shorter: taken
    b.add(req(1, timeout_us=5000), 0.0)                 # longer: the default holds
    b.add(req(2), 0.0)
    b.poll(100 * US)
    assert [r for r, _ in refused] == [0]
    b.poll(1000 * US)
    assert sorted(r for r, _ in refused) == [0, 1, 2]
    # Not allowed: the request's own timeout is ignored.
    b, refused = refusing({"max_inflight_batches": 1,
                           "default_queue_policy": {"default_timeout_microseconds": 1000}})
    in_flight(b)
    b.add(req(0, timeout_us=100), 0.0)
    assert b.poll(500 * US) == [] and not refused and b.deadline() == pytest.approx(1000 * US)


def test_a_full_queue_refuses_a_request_at_once():
    """ModelQueuePolicy.max_queue_size: "The maximum queue size for holding requests. A
    request will be rejected immediately if it can't be enqueued because the queue is
    full. The default value is 0 which indicates that no maximum queue size is
    enforced." (Triton: "Exceeds maximum queue size".)"""
    b, refused = refusing({"max_inflight_batches": 1,
                           "default_queue_policy": {"max_queue_size": 2}})
    first = in_flight(b)
    b.add(req(0), 0.0)
    b.add(req(1), 0.0)
    assert not refused
    assert b.add(req(2), 1 * US) == []
    assert [r for r, _ in refused] == [2] and b.pending == 2
    assert refused[0][1].startswith("queue full: m holds max_queue_size=2 request(s)")
    b.batch_done(first, 2 * US)
    (batch,) = b.poll(2 * US)                           # room again
    assert ids(batch) == [0, 1]
    b.add(req(3), 3 * US)
    assert [r for r, _ in refused] == [2]
    # 0: unbounded.
    b, refused = refusing({"max_inflight_batches": 1})
    in_flight(b)
    for i in range(1000):
        b.add(req(i), 0.0)
    assert b.pending == 1000 and not refused


def test_each_priority_level_has_its_own_queue_policy():
    """Triton: "When priority_levels is defined, each priority level can have a
    different ModelQueuePolicy as specified by default_queue_policy and
    priority_queue_policy"; priority_queue_policy: "Specify the queue policy for the
    priority level. The default queue policy will be used if a priority level doesn't
    specify a queue policy." """
    b, refused = refusing({
        "max_inflight_batches": 1, "priority_levels": 3,
        "default_queue_policy": {"max_queue_size": 1},
        "priority_queue_policy": {"1": {"default_timeout_microseconds": 100},
                                  "3": {"max_queue_size": 0}}})
    in_flight(b)
    b.add(req(0, priority=1), 0.0)
    b.add(req(1, priority=1), 0.0)                      # level 1: unbounded, timeout 100
    b.add(req(2, priority=2), 0.0)
    b.add(req(3, priority=2), 0.0)                      # level 2: the default, bound 1
    b.add(req(4, priority=3), 0.0)
    b.add(req(5, priority=3), 0.0)                      # level 3: unbounded, no timeout
    assert [r for r, _ in refused] == [3]
    assert "at priority level 2" in refused[0][1]
    b.poll(100 * US)
    assert sorted(r for r, _ in refused) == [0, 1, 3] and b.pending == 3


def test_priority_levels_and_the_default_level():
    """ModelDynamicBatching.priority_levels: "Requests are handled in priority order with
    all priority 1 requests processed before priority 2, all priority 2 requests
    processed before priority 3, etc. Requests with the same priority level will be
    handled in the order that they are received." Triton's guide: "Inference requests
    that do not set a priority are scheduled using the default_priority_level property."
    (Triton's InferenceRequest::SetPriority also gives a priority past the levels the
    default level.)"""
    b = make_batcher("dynamic", MODEL, {"max_batch_size": 1, "max_inflight_batches": 1,
                                        "priority_levels": 3, "default_priority_level": 2})
    first = in_flight(b)
    for i, prio in enumerate((3, 0, 9, 1, 2)):          # 0: none; 9: past the levels
        b.add(req(i, priority=prio), 0.0)
    order = []
    b.batch_done(first, 1 * US)
    for t in range(5):
        (batch,) = b.poll((2 + t) * US)
        order += ids(batch)
        b.batch_done(batch, (2 + t) * US)
    assert order == [3, 1, 2, 4, 0]


# -- preserve_ordering, end to end on the stage ------------------------------------------------
def serve_timed(durations: dict[int, float], options: dict, policy: str = "paella"):
    """The row model behind the dynamic batcher, with each variant's kernels lasting
    ``durations[rows]`` seconds, under the paella policy (so a later, shorter batch
    can end first; fifo would run the jobs one after the other)."""
    dev = SimDevice("t4", n_streams=64, seed=1)
    disp = Dispatcher(dev, policy, profile_runs=1)
    stage = BatchingStage(disp)
    served = {}
    for i, (rows, seconds) in enumerate(sorted(durations.items())):
        ad, layout = variant_adaptor(rows, seconds)
        mid = disp.register_model(f"rows@{rows}", ad)
        served[i] = ServedVariant(VariantSpec(i, rows, 0, f"rows@{rows}"), mid, layout)
    variants = ModelVariants("rows", tuple(s.spec for s in served.values()))
    stage.add_model(100, ServedModel("rows", variants, served,
                                     make_batcher("dynamic", variants, options)))
    return disp, stage


@pytest.mark.parametrize("preserve", [False, True])
def test_preserve_ordering_answers_in_arrival_order(preserve):
    """ModelDynamicBatching.preserve_ordering: "Should the dynamic batcher preserve the
    ordering of responses to match the order of requests received by the scheduler.
    Default is false. If true, the responses will be returned in the same order as the
    order of requests sent to the scheduler. If false, the responses may be returned in
    arbitrary order."

    Four one-row requests fill the slow batch-4 variant (5 ms a kernel); a fifth runs
    alone on the fast batch-1 variant and ends first. Without the option its answer
    comes first; with it, after the four, and every answer is still right."""
    disp, stage = serve_timed({1: 20e-6, 4: 5e-3},
                              {"max_batch_size": 4, "max_queue_delay_microseconds": 100,
                               "preserve_ordering": preserve})
    c = Client()
    for i in range(5):
        stage.submit(c.request(i, 1, client=i))
    stage.run_until_idle()
    assert stage.stats.batches == 2
    order = list(c.done)                                # in the order answered
    assert order == ([0, 1, 2, 3, 4] if preserve else [4, 0, 1, 2, 3])
    for i in range(5):
        assert c.done[i] == (rings.OK, None)
        np.testing.assert_array_equal(c.outputs[i], c.expect[i])


@pytest.mark.parametrize("preserve", [False, True])
def test_preserve_ordering_keeps_order_through_a_cancelled_and_a_failed_request(preserve):
    """The same rule when a request of the earlier batch is cancelled (its client left)
    and one fails, so that its batch is re-run request by request: the later batch's
    answer still waits for all of theirs (without the option it comes first)."""
    from row_model import POISON
    disp, stage = serve_timed({1: 20e-6, 4: 5e-3},
                              {"max_batch_size": 4, "max_queue_delay_microseconds": 100,
                               "preserve_ordering": preserve})
    c = Client()
    for i in range(4):
        stage.submit(c.request(i, 1, client=i, first=POISON if i == 1 else None))
    disp.step()
    stage.cancel_client(2)
    stage.submit(c.request(4, 1, client=4))
    stage.run_until_idle()
    assert c.done[1][0] == rings.E_FAILED and "poisoned row" in c.done[1][1]
    assert c.done[2][0] == rings.E_CANCELLED and stage.stats.retried == 3
    assert all(c.done[i] == (rings.OK, None) for i in (0, 3, 4))
    assert (list(c.done) == [0, 1, 2, 3, 4]) == preserve
    assert list(c.done)[0] == (0 if preserve else 4)


# -- the stage answers what the batcher refuses -------------------------------------------------
def test_the_stage_answers_a_timed_out_and_a_refused_request_with_the_reason():
    """REJECT and max_queue_size through the stage: the refused requests are answered at
    once with the reason (E_FAILED), nothing else is lost, and the stage holds no
    request afterwards."""
    disp, stage = serve_timed({1: 5e-3, 2: 5e-3}, {
        "max_batch_size": 1, "max_inflight_batches": 1,
        "default_queue_policy": {"default_timeout_microseconds": 1000, "max_queue_size": 2}})
    c = Client()
    for i in range(4):
        stage.submit(c.request(i, 1, client=i))         # 0 runs; 1, 2 queue; 3: full
    assert c.done[3][0] == rings.E_FAILED and "queue full" in c.done[3][1]
    stage.run_until_idle()
    assert c.done[0] == (rings.OK, None)
    for i in (1, 2):                                    # 1 ms < 5 ms of request 0
        assert c.done[i][0] == rings.E_FAILED and "request timeout expired" in c.done[i][1]
    assert stage.queued == 0 and stage.stats.batches == 1


# -- without a stage that answers refusals -------------------------------------------------------
def test_without_a_refusal_hook_refused_requests_are_kept_and_it_is_logged(caplog):
    """A stage that cannot answer a refused request: REJECT degrades to DELAY and
    max_queue_size to unbounded, logged once, and no request is lost."""
    b = make_batcher("dynamic", MODEL, {"max_inflight_batches": 1, "default_queue_policy": {
        "default_timeout_microseconds": 100, "max_queue_size": 1}})
    first = in_flight(b)
    with caplog.at_level(logging.WARNING):
        b.add(req(0), 0.0)
        b.add(req(1), 0.0)
        b.poll(200 * US)
    assert b.pending == 2
    assert sum("needs a stage that answers refused requests" in r.message
               for r in caplog.records) == 1
    b.batch_done(first, 300 * US)
    (batch,) = b.poll(300 * US)
    assert ids(batch) == [0, 1]


# -- names and bad configs ----------------------------------------------------------------------
def test_the_earlier_option_names_still_work():
    """``preferred_batch_sizes`` and ``max_queue_delay_us`` (this project's names before
    Triton's ``preferred_batch_size`` and ``max_queue_delay_microseconds``) mean the
    same; both names of one option are refused."""
    for prefs, delay in (("preferred_batch_size", "max_queue_delay_microseconds"),
                         ("preferred_batch_sizes", "max_queue_delay_us")):
        b = make_batcher("dynamic", MODEL, {prefs: [2], delay: 300})
        assert b.add(req(0), 0.0) == [] and b.deadline() == pytest.approx(300 * US)
        assert len(b.add(req(1), 0.0)) == 1
    with pytest.raises(BatcherError, match="preferred_batch_size and preferred_batch_sizes "
                                           "are one option"):
        make_batcher("dynamic", MODEL, {"preferred_batch_size": [2], "preferred_batch_sizes": [2]})


BAD = [
    ({"max_batch_size": 4, "preferred_batch_size": [2, 8]},
     "preferred_batch_size must be integers in 1..4 (max_batch_size), got 8"),
    ({"preferred_batch_sizes": [0]},
     "preferred_batch_sizes must be integers in 1..8 (max_batch_size), got 0"),
    ({"default_queue_policy": {"default_timeout_microseconds": -5}},
     "default_queue_policy.default_timeout_microseconds must be an integer 0..86400000000 "
     "(microseconds in the queue; 0: no timeout), got -5"),
    ({"default_queue_policy": {"timeout_action": "DROP"}},
     "default_queue_policy.timeout_action must be one of REJECT, DELAY, got 'DROP'"),
    ({"default_queue_policy": {"max_queue_size": -1}},
     "default_queue_policy.max_queue_size must be an integer 0..4294967295"),
    ({"default_queue_policy": {"allow_timeout_override": 1}},
     "default_queue_policy.allow_timeout_override must be true or false, got 1"),
    ({"default_queue_policy": {"timeout": 5}},
     "default_queue_policy has no key 'timeout'; valid keys: allow_timeout_override, "
     "default_timeout_microseconds, max_queue_size, timeout_action"),
    ({"priority_levels": 2, "priority_queue_policy": {"3": {}}},
     "priority_queue_policy keys are priority levels (1..2), got '3'"),
    ({"priority_queue_policy": {"1": {}}},
     "priority_queue_policy keys are priority levels (none: priority_levels is 0), got '1'"),
    ({"priority_levels": 2, "priority_queue_policy": {"1": {"timeout_action": "later"}}},
     "priority_queue_policy.1.timeout_action must be one of REJECT, DELAY, got 'later'"),
    ({"priority_levels": 2, "default_priority_level": 3},
     "default_priority_level must be 1..2 (priority_levels), got 3"),
    ({"preserve_ordering": True, "priority_levels": 2},
     "preserve_ordering needs at most one priority level"),
    ({"preserve_ordering": True, "default_queue_policy": {"default_timeout_microseconds": 5,
                                                          "timeout_action": "DELAY"}},
     "preserve_ordering cannot go with default_queue_policy.timeout_action DELAY"),
    ({"max_queue_delay_microseconds": -1},
     "max_queue_delay_microseconds must be 0..86400000000 (a day), got -1"),
]


@pytest.mark.parametrize("options,expected", BAD, ids=[m.split(" ")[0] for _, m in BAD])
def test_a_bad_option_is_refused_naming_the_key_and_what_is_valid(options, expected):
    """Triton refuses these at model load too ("dynamic batching preferred size must be
    <= max batch size", "default priority level must be in range [1, N]", "priority
    queue policy must have priority level in range [1, N]", "Only one priority level is
    allowed when 'preserve_ordering' is true", "Queue policy can not have DELAY as
    timeout action when 'preserve_ordering' is true"); a negative timeout and an unknown
    timeout_action cannot even be written in its protobuf config."""
    with pytest.raises(BatcherError) as e:
        make_batcher("dynamic", MODEL, options)
    assert expected in str(e.value)


def test_config_toml_reads_the_triton_names(tmp_path):
    """The names of a Triton model config, in config.toml's [batching] (nested tables
    for the queue policies, priority levels as keys), reach the batcher."""
    from paella.dispatcher.daemon.model_config import load_model_config
    (tmp_path / "config.toml").write_text("""
[batching]
batcher = "dynamic"
max_batch_size = 8
preferred_batch_size = [4]
max_queue_delay_microseconds = 1000
preserve_ordering = false
priority_levels = 2
default_priority_level = 2

[batching.default_queue_policy]
timeout_action = "DELAY"
default_timeout_microseconds = 500
allow_timeout_override = true
max_queue_size = 16

[batching.priority_queue_policy.1]
max_queue_size = 4
""")
    cfg = load_model_config(tmp_path)
    b = make_batcher(cfg.batcher, MODEL, cfg.batcher_options)
    assert b.preferred == {4} and b.delay == pytest.approx(1e-3) and b.levels == 2
    lvl1, lvl2 = b._levels
    assert (lvl1.policy.max_queue_size, lvl1.policy.timeout_us, lvl1.policy.reject) == (4, 0, True)
    assert (lvl2.policy.max_queue_size, lvl2.policy.timeout_us, lvl2.policy.reject,
            lvl2.policy.allow_override) == (16, 500, False, True)
