"""BatchMaker's Algorithm 1 and Figure 5, as timelines in unit time."""
import pytest

from paella.stepsched.cell_scheduler import CellType, CellularScheduler
from paella.stepsched.graph import DONE, unfold_chain, unfold_seq2seq, unfold_tree
from paella.stepsched.padding import PaddingBatcher
from paella.stepsched.timeline import simulate

# Figure 5. The text fixes: req1-4 arrive at t=0; req1 has length 2, req4 length 5;
# req2 and req3 leave at t=3 (length 3); req5 arrives before t=2; req6 and req7 join the
# fourth task; the second graph batch runs from t=5 to t=12 (the longest of req5-8 is 7).
# The picture is not in our copy of the paper: the other lengths and arrivals are chosen
# within those constraints (docs/step-scheduler.md).
FIG5 = [("req1", 2, 0), ("req2", 3, 0), ("req3", 3, 0), ("req4", 5, 0),
        ("req5", 7, 1), ("req6", 4, 2.5), ("req7", 3, 2.5), ("req8", 2, 4)]


def cellular(reqs, bsizes=(4,), max_tasks=5):
    sch = CellularScheduler([CellType("lstm", bsizes)], max_tasks)
    return simulate(sch, [(a, unfold_chain(n, L, arrival=a)) for n, L, a in reqs], lambda t: 1)


def test_figure5_cellular_timeline_exactly():
    tl = cellular(FIG5)
    assert tl.rows() == [
        (0, 1, ["req1", "req2", "req3", "req4"]),     # two full tasks of req1-4 ...
        (1, 2, ["req1", "req2", "req3", "req4"]),
        (2, 3, ["req2", "req3", "req4", "req5"]),     # req1 left at 2, req5 joins
        (3, 4, ["req4", "req5", "req6", "req7"]),     # req2, req3 left; req6, req7 join
        (4, 5, ["req4", "req5", "req6", "req7"]),
        (5, 6, ["req5", "req6", "req7", "req8"]),
        (6, 7, ["req5", "req6", "req8"]),
        (7, 8, ["req5"]),
        (8, 9, ["req5"]),
    ]
    assert tl.finished == {"req1": 2, "req2": 3, "req3": 3, "req4": 5, "req7": 6,
                           "req6": 7, "req8": 7, "req5": 9}


def test_figure5_graph_batching_timeline_exactly():
    tl = simulate(PaddingBatcher(4, width=None), [(a, (n, L)) for n, L, a in FIG5], lambda t: t.steps)
    assert tl.rows() == [(0, 5, ["req1", "req2", "req3", "req4"]),
                         (5, 12, ["req5", "req6", "req7", "req8"])]
    assert set(tl.finished.values()) == {5, 12}
    cell = cellular(FIG5)
    # cellular batching: every request leaves no later, and the whole set ends sooner
    assert all(cell.finished[r] <= tl.finished[r] for r in tl.finished)
    assert max(cell.finished.values()) < max(tl.finished.values())


def test_max_tasks_to_submit_bounds_one_round():
    # one request of 12 cells: with MaxTasksToSubmit=5 the worker gets 5 cells at a time
    sch = CellularScheduler([CellType("lstm", (1, 4))], max_tasks_to_submit=5)
    sch.add(unfold_chain("a", 12))
    tasks = sch.schedule(0)
    assert len(tasks) == 5
    assert [t.nodes[0][1].depth for t in tasks] == [0, 1, 2, 3, 4]   # successive cells
    assert sch.schedule(0) and sch.running["lstm"] == 10    # the idle-worker call adds 5 more


def test_small_task_after_the_first_ends_the_round():
    sch = CellularScheduler([CellType("lstm", (4,))], max_tasks_to_submit=5)
    for n, L in [("a", 3), ("b", 3), ("c", 3), ("d", 1)]:
        sch.add(unfold_chain(n, L))
    tasks = sch.schedule(0)
    # 4 ready, then 3 (d is done after one cell): 3 < min(Bsizes)=4 is not sent
    assert [len(t.nodes) for t in tasks] == [4]
    assert tasks[0].batch_size == 4


def test_padded_batch_size_is_the_smallest_compiled_one():
    ct = CellType("lstm", (8, 1, 2, 4))
    assert ct.bsizes == (1, 2, 4, 8)
    assert [ct.padded(n) for n in (1, 2, 3, 5, 8)] == [1, 2, 4, 8, 8]


def three_tier_scheduler():
    return CellularScheduler([CellType("encoder", (1, 2), priority=0),
                              CellType("decoder", (1, 2), priority=1)], max_tasks_to_submit=1)


def test_tier1_a_full_batch_wins_over_priority():
    sch = three_tier_scheduler()
    sch.add(unfold_seq2seq("a", 1, 1))
    sch.add(unfold_seq2seq("b", 1, 1))      # two encoders ready: a full batch
    (t,) = sch.schedule(0)
    assert t.kind == "encoder" and t.requests == ["a", "b"]


def test_tier2_an_idle_type_before_a_busy_higher_priority_one():
    sch = three_tier_scheduler()
    a = unfold_seq2seq("a", 1, 3)
    sch.add(a)
    (enc,) = sch.schedule(0)
    sch.task_done(enc)                      # a's decoders are ready (one at a time)
    (dec,) = sch.schedule(0)
    assert dec.kind == "decoder"
    sch.add(unfold_seq2seq("b", 2, 1))      # an encoder is ready; the decoder type is running
    sch.task_done(dec)
    # a's next decoder is ready too, and decoders have priority, but neither type has a
    # full batch and no task is running: tier 2 holds both, tier 1 neither -> priority
    (t,) = sch.schedule(0)
    assert t.kind == "decoder"
    # with the decoder task still running, a second worker takes the idle encoder type
    (t2,) = sch.schedule(1)
    assert t2.kind == "encoder" and t2.requests == ["b"]


def test_tier3_later_cell_type_first():
    sch = three_tier_scheduler()
    a, b = unfold_seq2seq("a", 1, 2), unfold_seq2seq("b", 2, 1)
    sch.add(a)
    sch.add(b)
    (t,) = sch.schedule(0)                  # encoders of a and b: full batch (tier 1)
    sch.task_done(t)
    # now: a's decoder ready, b's second encoder ready; each 1 < 2, none running:
    # tier 2 holds both, priority picks the decoder (later cell type)
    (t,) = sch.schedule(0)
    assert t.kind == "decoder"
    (t3,) = sch.schedule(0)                 # decoder running: tier 2 = encoder
    assert t3.kind == "encoder"
    (t4,) = sch.schedule(0)                 # both running, both ready: tier 3 -> priority
    assert t4.kind == "decoder"


def test_pinned_subgraph_stays_on_its_worker():
    sch = CellularScheduler([CellType("lstm", (1,))], max_tasks_to_submit=1)
    sch.add(unfold_chain("a", 3))
    (t,) = sch.schedule(0)
    assert sch.schedule(1) == []            # a's next cell is ready but pinned to worker 0
    (t2,) = sch.schedule(0)
    sch.task_done(t)
    sch.task_done(t2)
    (t3,) = sch.schedule(1)                 # no task running: unpinned, any worker
    assert t3.worker == 1 and sch.task_done(t3) == ["a"]


def test_tree_unfolding_and_batching():
    g = unfold_tree("x", 4)
    assert [s.kind for s in g.steps] == ["leaf"] * 4 + ["internal"] * 3
    assert g.steps[6].deps == (4, 5)
    sch = CellularScheduler([CellType("leaf", (8,)), CellType("internal", (8,), priority=1)], 5)
    tl = simulate(sch, [(0, g), (0, unfold_tree("y", 2))], lambda t: 1)
    assert tl.rows() == [(0, 1, ["x"] * 4 + ["y"] * 2),
                         (1, 2, ["x", "x", "y"]),    # level 1 of x with y's root
                         (2, 3, ["x"])]
    assert tl.finished == {"y": 2, "x": 3}
    assert all(s.state == DONE for s in g.steps)


def test_bad_inputs_are_refused_with_the_cause():
    with pytest.raises(ValueError, match="at least one step"):
        unfold_chain("a", 0)
    with pytest.raises(ValueError, match="power of two"):
        unfold_tree("a", 3)
    with pytest.raises(ValueError, match="positive ints"):
        CellType("lstm", ())
    sch = CellularScheduler([CellType("lstm", (4,))])
    with pytest.raises(ValueError, match="unknown cell types"):
        sch.add(unfold_seq2seq("a", 1, 1))


def test_padding_buckets_of_width_10():
    pb = PaddingBatcher(max_bs=4, width=10)
    assert [pb.bucket(n) for n in (1, 10, 11, 21, 330)] == [10, 10, 20, 30, 330]
    for r, n in [("a", 21), ("b", 5), ("c", 29), ("d", 3)]:
        pb.add((r, n))
    (t,) = pb.schedule(0)                   # the oldest request's bucket (30), all of it
    assert t.requests == ["a", "c"] and t.steps == 30 and t.padded_cells == 9 + 1
    (t,) = pb.schedule(0)
    assert t.requests == ["b", "d"] and t.steps == 10
    assert pb.schedule(0) == []
