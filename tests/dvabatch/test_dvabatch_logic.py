"""DVABatch's pure logic: the paper's Figure 3 toy cases and Figure 8 queue sequences
reproduced exactly, the buffer pairs' state machine, hazards between stages, and one
buffer pair serializing the stages where two pipeline them."""
from __future__ import annotations

import random

import pytest

from paella.stepsched.dvabatch import (Access, BatchTable, BufferPool, BufferState,
                                                 DvaConfig, HazardError, QueueItem,
                                                 check_hazards, group_by_length, split_sizes)
from paella.stepsched.dvabatch.buffer_pairs import LEGAL, Buffer

from toy_gpu import Query, mean_latency, simulate


def baseline(total: float, window: float = 0.0) -> DvaConfig:
    """Single-entry single-exit batching: the whole model as one stage, one batch at a
    time, no stretch, no split."""
    return DvaConfig(1, lambda s, b, l: total, pairs=1, window=window, stretch=False, split=False)


# -- Figure 3 ----------------------------------------------------------------------------
def test_figure3_case1_input_diversity_4T_to_2_5T():
    # 4 operators of 1T; queries 1-3 are short (need 2 operators), query 4 long (4).
    cost = lambda s, rows, l: (1.0, min(rows / 4, 1.0))  # noqa: E731
    qs = lambda: [Query(i, 0.0, stages=2) for i in range(3)] + [Query(3, 0.0, stages=4)]  # noqa: E731
    single, _ = simulate(baseline(4.0), lambda s, r, l: (4.0, 1.0), qs())
    assert mean_latency(single) == pytest.approx(4.0)
    cfg = DvaConfig(4, lambda s, b, l: 1.0, stages_of=lambda q: q.stages)
    multi, pipe = simulate(cfg, cost, qs())
    assert [q.done for q in multi] == pytest.approx([2.0, 2.0, 2.0, 4.0])
    assert mean_latency(multi) == pytest.approx(2.5)
    assert pipe.stats.split == 1 and pipe.stats.new == 1


def case2_time(stage: int, rows: int) -> float:
    """Operator A prefers batch 4 (1T up to 4 rows), B, C, D batch 1 (T/4 per row)."""
    return max(rows, 4) / 4 if stage == 0 else max(rows, 1) / 4


@pytest.mark.parametrize("pairs", [1, 2])
def test_figure3_case2_operator_diversity_4T_to_2_875T(pairs):
    cost = lambda s, rows, l: (case2_time(s, rows), 1.0 if s else rows / 4)  # noqa: E731
    qs = lambda: [Query(i, 0.0) for i in range(4)]  # noqa: E731
    single, _ = simulate(baseline(sum(case2_time(s, 4) for s in range(4))),
                         lambda s, r, l: (4.0, 1.0), qs())
    assert mean_latency(single) == pytest.approx(4.0)
    cfg = DvaConfig(4, lambda s, b, l: case2_time(s, b), pairs=pairs)
    multi, pipe = simulate(cfg, cost, qs())
    # A with batch 4, then split into four batches of 1 run one after the other.
    assert [q.done for q in multi] == pytest.approx([1.75, 2.5, 3.25, 4.0])
    assert mean_latency(multi) == pytest.approx(2.875)
    assert pipe.stats.stage_rows == [4] + [1] * 12


def test_figure3_case3_load_diversity_8T_to_5_25T():
    # Every operator prefers batch 4 (1T whatever the batch); window 4T; query 1 at 0,
    # queries 2-4 at 5T while query 1 runs.
    cost = lambda s, rows, l: (1.0, rows / 4)  # noqa: E731
    qs = lambda: [Query(0, 0.0)] + [Query(i, 5.0) for i in (1, 2, 3)]  # noqa: E731
    single, _ = simulate(baseline(4.0, window=4.0), lambda s, r, l: (4.0, r / 4), qs())
    assert [q.done - q.arrival for q in single] == pytest.approx([8.0] * 4)
    for idle_only in (False, True):     # the first stage is idle at 5T: both stretch
        cfg = DvaConfig(4, lambda s, b, l: 1.0, window=4.0, t_comp_wait=2.0,
                        stretch_idle_only=idle_only)
        multi, pipe = simulate(cfg, cost, qs())
        assert [q.done - q.arrival for q in multi] == pytest.approx([9.0, 4.0, 4.0, 4.0])
        assert mean_latency(multi) == pytest.approx(5.25)
        assert pipe.stats.stretch == 3 and pipe.stats.new == 1
    # Arriving at 4.5T, while the first stage still runs query 1: only without the rule.
    early = lambda: [Query(0, 0.0)] + [Query(i, 4.5) for i in (1, 2, 3)]  # noqa: E731
    for idle_only, stretches in ((False, 3), (True, 0)):
        _, pipe = simulate(DvaConfig(4, lambda s, b, l: 1.0, window=4.0, t_comp_wait=2.0,
                                     stretch_idle_only=idle_only), cost, early())
        assert pipe.stats.stretch == stretches
    # Past the wait bound no stretch: query 1's batch has run 1T at 5T.
    late, pipe = simulate(DvaConfig(4, lambda s, b, l: 1.0, window=4.0, t_comp_wait=0.5),
                          cost, qs())
    assert pipe.stats.stretch == 0 and mean_latency(late) > 5.25


# -- Figure 8 ----------------------------------------------------------------------------
def test_figure8_new_stretch_split_queue_sequences():
    t = BatchTable(4)                       # the paper's stages 1..4 are 0..3 here
    # (a) new: batch 0 with 2 queries.
    t.new(["q0", "q1"], now=0.0)
    assert t.snapshot() == [(0, 2, (0, 0, 0, 0))]
    assert t.queue_items(0) == [(0, 0, 2)]
    assert t.complete(0, QueueItem(0, 0, 2)) == "ready"
    assert t.forward(0, 1) == QueueItem(0, 0, 2)
    assert t.snapshot() == [(0, 2, (2, 0, 0, 0))]
    assert t.queue_items(1) == [(0, 0, 2)]
    # (b) stretch by 2 while executor 2 runs the batch: only the new queries go to
    # queue 1; executor 2 pushes nothing until they catch up, then one merged item.
    assert t.stretch(0, ["q2", "q3"]) == QueueItem(0, 2, 2)
    assert t.snapshot() == [(0, 4, (2, 0, 0, 0))]
    assert t.queue_items(0) == [(0, 2, 2)]
    assert t.complete(1, QueueItem(0, 0, 2)) == "hold"
    assert t.queue_items(2) == [] and t.snapshot() == [(0, 4, (2, 2, 0, 0))]
    assert t.complete(0, QueueItem(0, 2, 2)) == "ready"
    t.forward(0, 1)
    assert t.queue_items(1) == [(0, 2, 2)]
    assert t.complete(1, QueueItem(0, 2, 2)) == "ready"
    t.forward(0, 2)
    assert t.queue_items(2) == [(0, 0, 4)]
    assert t.snapshot() == [(0, 4, (4, 4, 0, 0))]
    # (c) executor 3 runs the batch of 4, then split into two batches of 2, both pushed
    # to queue 4 one by one.
    assert t.complete(2, QueueItem(0, 0, 4)) == "ready"
    kids = t.split(0, 3, [2, 2])
    for k in kids:
        t.forward(k.id, 3)
    assert t.snapshot() == [(0, 2, (2, 2, 2, 0)), (1, 2, (2, 2, 2, 0))]
    assert t.queue_items(3) == [(0, 0, 2), (1, 0, 2)]
    assert [k.row0 for k in kids] == [0, 2] and kids[1].queries == ["q2", "q3"]
    assert t.stretchable() is None          # a split batch takes no stretch


def test_batch_table_refuses_bad_operations():
    t = BatchTable(2, bs_max=4)
    t.new([1, 2, 3], 0.0)
    with pytest.raises(ValueError):
        t.stretch(0, [4, 5])                # beyond bs_max
    with pytest.raises(ValueError):
        t.complete(1, QueueItem(0, 0, 3))   # not stage 1's head
    with pytest.raises(ValueError):
        t.split(0, 1, [2, 1])               # stage 0 not done yet
    with pytest.raises(ValueError):
        t.new([], 0.0)


# -- buffer pairs ------------------------------------------------------------------------
def test_buffer_row_state_machine_allows_only_the_cycle():
    assert LEGAL == {(BufferState.INVALID, BufferState.IN_WRITING),
                     (BufferState.IN_WRITING, BufferState.AVAILABLE),
                     (BufferState.AVAILABLE, BufferState.IN_READING),
                     (BufferState.IN_READING, BufferState.INVALID)}
    b = Buffer(0, 1, 4)
    with pytest.raises(HazardError, match="in-reading"):
        b.move(0, 2, BufferState.IN_READING)          # RAW: nothing written
    b.move(0, 2, BufferState.IN_WRITING)
    assert b.state is BufferState.IN_WRITING
    with pytest.raises(HazardError):
        b.move(1, 2, BufferState.IN_WRITING)          # row 1 is being written
    b.move(0, 2, BufferState.AVAILABLE)
    with pytest.raises(HazardError):
        b.move(0, 1, BufferState.IN_WRITING)          # WAR: unread data
    b.move(2, 2, BufferState.IN_WRITING)              # other rows: the catch-up of a stretch
    b.move(0, 2, BufferState.IN_READING)
    b.move(0, 2, BufferState.INVALID)
    b.move(2, 2, BufferState.AVAILABLE)
    assert b.state is BufferState.AVAILABLE and not b.clean
    with pytest.raises(HazardError):
        b.move(3, 2, BufferState.IN_READING)          # out of range


def test_pool_legitimacy_and_release():
    pool = BufferPool(n_stages=2, pairs=1, rows=4)
    assert pool.free_pair() == 0
    pool.claim(0, 7)
    assert pool.free_pair() is None
    assert not pool.legitimate(0, 0, 0, 2)            # inputs not loaded
    pool.load_inputs(0, 0, 2)
    assert pool.legitimate(0, 0, 0, 2)
    pool.begin_stage(0, 0, 0, 2)
    assert not pool.legitimate(0, 1, 0, 2)            # stage 0 still writes them
    with pytest.raises(HazardError):
        pool.begin_stage(0, 1, 0, 2)
    pool.end_stage(0, 0, 0, 2)
    pool.begin_stage(0, 1, 0, 2)
    pool.end_stage(0, 1, 0, 2)
    with pytest.raises(HazardError, match="unread"):
        pool.release(0, 7)                           # outputs not taken
    pool.take_outputs(0, 0, 2)
    pool.release(0, 7)
    assert pool.free_pair() == 0


# -- the policies ------------------------------------------------------------------------
def test_policies():
    assert split_sizes(64, lambda b: 10.0 * b) == [1] * 64            # linear: split down
    assert split_sizes(64, lambda b: 5.0) == [64]                      # flat: keep
    assert split_sizes(64, lambda b: max(b, 16.0)) == [16] * 4         # saturates at 16
    assert split_sizes(6, float) == [3, 3] and split_sizes(5, float) == [5]   # 5 < 2 x 3
    qs = [Query(i, 0, seq_len=s) for i, s in enumerate((30, 70, 10, 120, 64))]
    assert [(b, [q.id for q in g]) for b, g in group_by_length(qs, (32, 64, 128))] == \
        [(32, [0, 2]), (64, [4]), (128, [1, 3])]


# -- hazards and the two manners ---------------------------------------------------------
def test_no_raw_or_war_hazard_between_stages_under_random_load():
    rng = random.Random(5)
    cost = lambda s, rows, l: (case2_time(s, rows) * (1 + l / 64), min(rows / 4, 1.0))  # noqa: E731
    used = set()
    for pairs, buckets in ((1, (16, 64)), (2, (16, 64)), (3, (16, 64)), (2, ())):
        qs, t = [], 0.0
        for i in range(150):
            t += rng.expovariate(3.0)
            qs.append(Query(i, t, seq_len=rng.choice((8, 16, 32, 64))))
        cfg = DvaConfig(4, lambda s, b, l: case2_time(s, b) * (1 + l / 64), pairs=pairs,
                        bs_max=8, window=0.2, t_comp_wait=1.5, length_buckets=buckets)
        done, pipe = simulate(cfg, cost, qs)
        assert all(q.done >= q.arrival for q in done)
        used.update(k for k in ("new", "stretch", "split") if getattr(pipe.stats, k))
        assert check_hazards(pipe.accesses) == []
        assert all(b.clean for pair in pipe.pool.buffers for b in pair)
        assert not pipe.table.rows
    assert used == {"new", "stretch", "split"}


def test_hazard_check_finds_overlapping_write_and_read():
    a = Access(stage=0, pair=0, row=0, num=2, t0=0.0, t1=1.0)     # writes buffer 1
    b = Access(stage=1, pair=0, row=1, num=2, t0=0.5, t1=1.5)     # reads buffer 1
    found = check_hazards([a, b])
    assert any(h.startswith("RAW on pair 0 buffer 1") for h in found)
    assert check_hazards([a, Access(1, 1, 0, 2, 0.5, 1.5)]) != []  # pair 1 never written
    assert check_hazards([a, Access(1, 0, 0, 2, 1.0, 2.0)]) == []


def overlapping_batches(pairs: int) -> tuple[int, list[float]]:
    """Two single-query batches, 0.5T apart, through 4 stages of 1T at a quarter of the
    GPU each: the most batches running at once and the queries' completion times."""
    cost = lambda s, rows, l: (1.0, 0.25)  # noqa: E731
    cfg = DvaConfig(4, lambda s, b, l: 1.0, pairs=pairs, stretch=False)
    done, pipe = simulate(cfg, cost, [Query(0, 0.0), Query(1, 0.5)])
    most = max(sum(1 for b in pipe.accesses if b.t0 <= a.t0 < b.t1) for a in pipe.accesses)
    return most, [q.done for q in done]


def test_one_buffer_pair_serializes_two_pipeline():
    most, done = overlapping_batches(1)
    assert most == 1 and done == pytest.approx([4.0, 8.0])
    most, done = overlapping_batches(2)
    assert most == 2 and done == pytest.approx([4.0, 5.0])


def test_the_most_urgent_class_is_batched_first_and_never_mixed():
    # Issue 38: six queries wait when the window closes, classes 200 (best effort) and 1
    # (urgent), the best-effort ones first. The first batch is the urgent ones alone,
    # although they came last; a query of another class never joins (stretch) a batch.
    qs = [Query(i, 0.0) for i in range(6)]
    level = {0: 200, 1: 200, 2: 200, 3: 1, 4: 1, 5: 1}
    cfg = DvaConfig(2, lambda s, b, l: 1.0, pairs=1, bs_max=8, window=0.5, split=False,
                    class_of=lambda q: level[q.id])
    done, pipe = simulate(cfg, lambda s, r, l: (1.0, 1.0), qs)
    urgent = sorted(q.done for q in done if level[q.id] == 1)
    best = sorted(q.done for q in done if level[q.id] == 200)
    assert urgent == pytest.approx([2.5] * 3)           # window, then two stages
    assert min(best) > max(urgent)                      # the next batch, after them
    assert pipe.stats.new == 2 and pipe.stats.stretch == 0
    # the same queries with one class: one batch of six
    one, pipe = simulate(DvaConfig(2, lambda s, b, l: 1.0, pairs=1, bs_max=8, window=0.5,
                                   split=False), lambda s, r, l: (1.0, 1.0),
                         [Query(i, 0.0) for i in range(6)])
    assert pipe.stats.new == 1 and {q.done for q in one} == {2.5}
    # a late urgent query does not stretch a running best-effort batch
    late = [Query(0, 0.0), Query(1, 0.6)]
    cls = {0: 200, 1: 1}
    _, pipe = simulate(DvaConfig(2, lambda s, b, l: 1.0, pairs=2, window=0.0, split=False,
                                 class_of=lambda q: cls[q.id]), lambda s, r, l: (1.0, 1.0), late)
    assert pipe.stats.stretch == 0 and pipe.stats.new == 2
    _, pipe = simulate(DvaConfig(2, lambda s, b, l: 1.0, pairs=2, window=0.0, split=False),
                       lambda s, r, l: (1.0, 1.0), [Query(0, 0.0), Query(1, 0.6)])
    assert pipe.stats.stretch == 1                      # (one class: it would)


def test_a_stretch_never_puts_a_longer_query_behind_one_that_exits_earlier():
    """Early exits leave from a batch's tail, so a query needing more stages than the
    tail does not stretch that batch (it would hold the tail's exit back: the short
    query would run stages it did not ask for); a query needing no more stages than the
    tail does stretch it and leaves with it."""
    cost = lambda s, rows, l: (1.0, 0.1)  # noqa: E731
    cfg = DvaConfig(4, lambda s, b, l: 1.0, split=False, stages_of=lambda q: q.stages)
    qs = [Query(0, 0.0, stages=2), Query(1, 0.5, stages=4), Query(2, 0.6, stages=2)]
    done, pipe = simulate(cfg, cost, qs)
    # query 1 (4 stages) did not stretch query 0's batch (2 stages): a batch of its own;
    # query 2 (2 stages) stretched query 1's and left from its tail after stage 1
    batches = {a.batch for a in pipe.accesses}
    assert pipe.stats.new == 2 and pipe.stats.stretch == 1 and batches == {0, 1}, pipe.stats
    assert [(a.batch, a.stage, a.num) for a in pipe.accesses] == [
        (0, 0, 1), (1, 0, 2), (0, 1, 1), (1, 1, 2), (1, 2, 1), (1, 3, 1)]
    assert [q.done for q in done] == pytest.approx([2.0, 5.0, 3.0])


def _staged(costs: dict[int, list[float]]):
    """A StageModel of len(costs[1]) stages with the given per-stage profiled times."""
    from paella.stepsched.dvabatch.stage_io import StageModel, StageVariant
    vs = [StageVariant(i, s, b, 0, (), (), 0, t)
          for i, (b, ts) in enumerate(costs.items()) for s, t in enumerate(ts)]
    return StageModel("m", vs)


def test_preferred_rows_is_the_smallest_size_within_3_percent_of_the_best_throughput():
    # whole-model times 3.7, 4.2, 7.7, 13.6, 27.2, 56.0, 109 ms (the compiled ResNet-152's)
    times = {1: 3.7, 2: 4.2, 4: 7.7, 8: 13.6, 16: 27.2, 32: 56.0, 64: 109.0}
    sm = _staged({b: [t / 2, t / 2] for b, t in times.items()})
    assert sm.preferred_rows() == 8                    # 588/s, within 3% of 16's 588/s
    faster16 = _staged({b: [t / 2, t / 2] for b, t in {**times, 16: 27.0}.items()})
    assert faster16.preferred_rows(within=0.0) == 16   # the very best
    assert faster16.preferred_rows() == 8
    # A model that keeps gaining up to its largest size prefers the largest.
    assert _staged({b: [0.01 * b ** 0.5] for b in times}).preferred_rows() == 64
    # Unprofiled variants: no preference (the batcher then uses the largest size).
    assert _staged({b: [0.0, 0.0] for b in times}).preferred_rows() == 0


def test_bs_max_preferred_bounds_the_batch_and_a_bad_value_is_a_clear_error():
    from paella.dispatcher.batchers.base import BatcherError
    from paella.stepsched.dvabatch.batcher import DvaBatcher
    from paella.dispatcher.batchers.base import ModelVariants, VariantSpec
    specs = tuple(VariantSpec(i, b, 0, f"s{s}b{b}", cost_s=t, stage=s)
                  for i, (b, t, s) in enumerate((b, t, s) for b, t in
                                                ((1, 1.0), (2, 1.0), (4, 2.0), (8, 4.0)) for s in (0, 1)))
    model = ModelVariants("m", specs)
    b = DvaBatcher(model, bs_max="preferred")
    sm = _staged({1: [1.0, 1.0], 2: [1.0, 1.0], 4: [2.0, 2.0], 8: [4.0, 4.0]})
    assert b._bs_max(sm) == 2
    assert DvaBatcher(model, bs_max=4)._bs_max(sm) == 4
    assert DvaBatcher(model)._bs_max(sm) == 8
    with pytest.raises(BatcherError, match='or "preferred"'):
        DvaBatcher(model, bs_max="largest")
