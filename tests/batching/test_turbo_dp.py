"""TurboTransformers' DP batch scheduler (dispatcher/batchers/turbo_dp.py): optimal
against brute force over contiguous partitions, the paper's backtracking bug fixed, the
cap, the hungry and lazy triggers and the half-SLO rule."""
from __future__ import annotations

import itertools
from types import SimpleNamespace

import pytest
from hypothesis import given, settings, strategies as st

from paella.dispatcher.batchers import BatcherError, ModelVariants, VariantSpec, make_batcher
from paella.dispatcher.batchers.turbo_dp import partition

BUCKETS = (16, 32, 64, 128)
SIZES = (1, 2, 4, 8)


def cost_model(seq: int, rows: int) -> float:
    """A batch's time: a fixed part, plus work in padded tokens with a batching discount."""
    return 1e-4 + 2e-6 * seq * rows ** 0.7


MODEL = ModelVariants("bert", tuple(
    VariantSpec(i, b, s, cost_s=cost_model(s, b))
    for i, (s, b) in enumerate(itertools.product(BUCKETS, SIZES))))


def req(i, seq, client=0):
    return SimpleNamespace(req_id=i, rows=1, seq_len=seq, client_id=client, priority=0)


def brute_force(lengths, cost, cap):
    """Every split of the sorted list into contiguous batches of at most ``cap``."""
    n, best = len(lengths), (float("inf"), None)
    for cuts in itertools.product((0, 1), repeat=max(n - 1, 0)):
        bounds = [0] + [i + 1 for i, c in enumerate(cuts) if c] + [n]
        parts = list(zip(bounds, bounds[1:]))
        if any(b - a > cap for a, b in parts):
            continue
        total = sum(cost(lengths[b - 1], b - a) for a, b in parts)
        if total < best[0] - 1e-15:
            best = (total, parts)
    return best


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(1, 128), min_size=1, max_size=9), st.integers(1, 8))
def test_dp_is_optimal_against_brute_force(lengths, cap):
    lengths = sorted(lengths)
    b = make_batcher("turbo-dp", MODEL, {"max_batch_size": cap})
    total, parts = partition(lengths, b.batch_cost, cap)
    best, _ = brute_force(lengths, b.batch_cost, cap)
    assert total == pytest.approx(best, rel=1e-12)
    # The batches cover every request exactly once, in order, none above the cap.
    assert [i for a, c in parts for i in range(a, c)] == list(range(len(lengths)))
    assert all(1 <= c - a <= cap for a, c in parts)
    assert sum(b.batch_cost(lengths[c - 1], c - a) for a, c in parts) == pytest.approx(total)


def test_backtracking_keeps_every_request():
    """The paper's listing continues at start_idx - 1 and would drop request 1 here."""
    cost = lambda seq, rows: 1.0 if rows <= 2 else 10.0         # noqa: E731  pairs are free
    total, parts = partition([1, 2, 3, 4], cost, 4)
    assert parts == [(0, 2), (2, 4)] and total == 2.0


def test_papers_figure8_shape_three_batches_beat_one_and_none():
    """Figure 8: lengths 17, 18, 52, 63, 77; one batch of five is worse than none, the
    optimum has several batches grouping neighbours."""
    b = make_batcher("turbo-dp", MODEL)
    lengths = [17, 18, 52, 63, 77]
    total, parts = partition(lengths, b.batch_cost, 8)
    one = b.batch_cost(77, 5)
    none = sum(b.batch_cost(x, 1) for x in lengths)
    assert total < min(one, none) and 1 < len(parts) < 5


def test_hungry_runs_when_idle_and_batches_by_length():
    b = make_batcher("turbo-dp", MODEL, {"max_batch_size": 8})
    (first,) = b.add(req(0, 20), 0.0)                 # idle: the scheduler runs at once
    assert first.requests[0].req_id == 0 and first.variant.seq_len == 32
    out = [b.add(req(i, seq), 1e-5) for i, seq in enumerate((100, 10, 12, 110, 11), 1)]
    assert out == [[]] * 5 and b.pending == 5          # the GPU is busy: they wait
    b.batch_done(first, 2e-4)
    batches = b.poll(2e-4)
    assert sorted(r.req_id for x in batches for r in x.requests) == [1, 2, 3, 4, 5]
    for x in batches:                                 # neighbours in length go together
        lens = [r.seq_len for r in x.requests]
        assert lens == sorted(lens) and x.variant.takes(len(lens), max(lens))
    assert {tuple(sorted(r.seq_len for r in x.requests)) for x in batches} >= {(10, 11, 12)}


def test_lazy_waits_for_the_cap_or_the_timeout():
    b = make_batcher("turbo-dp", MODEL, {"trigger": "lazy", "timeout_us": 1000,
                                          "max_batch_size": 4})
    assert b.add(req(0, 20), 0.0) == [] and b.deadline() == pytest.approx(1e-3)
    assert b.poll(9e-4) == []
    assert len(b.poll(1e-3)) >= 1 and b.pending == 0
    for i in range(3):
        assert b.add(req(i, 20), 2e-3) == []
    assert b.add(req(3, 20), 2e-3)                     # four queued: the cap
    assert b.pending == 0


def test_half_slo_rule_runs_the_scheduler_early():
    b = make_batcher("turbo-dp", MODEL, {"trigger": "lazy", "timeout_us": 1e6, "slo_ms": 2})
    assert b.add(req(0, 128), 0.0) == []
    due = b.deadline()
    assert due == pytest.approx(1e-3 - MODEL.fit(1, 128).cost_s)
    assert b.poll(due - 1e-6) == [] and len(b.poll(due)) == 1


def test_options_and_missing_costs_are_clear_errors():
    with pytest.raises(BatcherError, match="trigger must be one of hungry, lazy"):
        make_batcher("turbo-dp", MODEL, {"trigger": "eager"})
    bare = ModelVariants("m", (VariantSpec(0, 1, 32), VariantSpec(1, 4, 32)))
    with pytest.raises(BatcherError, match="profiled time"):
        make_batcher("turbo-dp", bare)


def test_remove_client_and_flush():
    b = make_batcher("turbo-dp", MODEL, {"trigger": "lazy", "timeout_us": 1e6})
    b.add(req(0, 20, client=1), 0.0)
    b.add(req(1, 30, client=2), 0.0)
    assert [r.req_id for r in b.remove_client(1)] == [0]
    (batch,) = b.flush(0.0)
    assert [r.req_id for r in batch.requests] == [1] and b.pending == 0


def test_classes_are_batched_apart_the_most_urgent_first():
    """Issue 38: an urgent request (class 1) is not padded to, nor batched with, less
    urgent ones of nearly its length; its batch comes first. Within a class, Algorithm 2
    as before (neighbours in length together)."""
    b = make_batcher("turbo-dp", MODEL, {"max_batch_size": 8})
    (first,) = b.add(req(0, 20), 0.0)
    queued = [req(1, 12), req(2, 11), req(3, 13), req(4, 100)]
    queued[2].priority = 1                              # request 3: urgent
    queued[3].priority = 200                            # request 4: the least urgent
    for r in queued:
        assert b.add(r, 1e-5) == []
    b.batch_done(first, 2e-4)
    batches = b.poll(2e-4)
    ids = [[r.req_id for r in x.requests] for x in batches]
    assert ids[0] == [3] and ids[-1] == [4], ids        # alone, first; the 200 last
    assert sorted(ids[1]) == [1, 2]                     # the default class (128) together
    assert len(batches) == 3
