"""The ``cellular`` scheduler plug-in on the batching stage, in virtual time (the daemon's
path without the daemon: tests/service/test_cellular_service.py has that): requests laid
out as clients lay them out, outputs checked against each request computed alone, cell
by cell, from the same seeded weights; requests joining and leaving running batches; the
decoder's priority; bad input refused alone; a client leaving."""
import numpy as np
import pytest

from paella import rings
from paella.dispatcher.batchers import ModelVariants, VariantSpec, get_batcher, make_batcher
from paella.dispatcher.batchers.stage import BatchingStage, ServedModel
from paella.dispatcher.core import Dispatcher, Request
from paella.dispatcher.devices.sim import SimDevice
from paella.models import rnn
from paella.stepsched.cell_engine import run_alone
from paella.stepsched.graph import random_binary_tree
from paella.stepsched.cellular_plugin import CellularPlugin, cell_request, compile_cells
from paella.stepsched.graph import TreeError, tree_order

CFG = rnn.RNNConfig.tiny()
H = CFG.hidden


def lstm_alone(xs):
    return run_alone("lstm", CFG, xs=xs)["steps"]


def seq2seq_alone(src, tgt_len):
    r = run_alone("seq2seq", CFG, src=src, tgt_len=tgt_len)
    return r["tokens"], r["steps"]


def tree_alone(xs, parents):
    return run_alone("treelstm", CFG, xs=xs, parents=parents)["steps"]


class Req:
    """One client request: its io region as ``cell_request`` fills it."""

    def __init__(self, sched, rid, client=0, **inputs):
        io_info = sched.io
        self.info = io_info
        self.io = np.zeros(io_info.io_bytes, np.uint8)
        for t in io_info.inputs:
            n = int(np.prod(t.shape)) * np.dtype(t.dtype).itemsize
            self.io[t.offset:t.offset + n] = np.ascontiguousarray(
                cell_request(io_info, **inputs)[t.name]).view(np.uint8).ravel()
        self.progress, self.done = [], []
        self.req = Request(rid, client, 5, self.io, on_complete=self._done,
                           on_progress=lambda q, k: self.progress.append(k))

    def _done(self, req, status, err):
        self.done.append((status, err))

    def out(self, name):
        t = next(t for t in self.info.outputs if t.name == name)
        n = int(np.prod(t.shape)) * np.dtype(t.dtype).itemsize
        return self.io[t.offset:t.offset + n].view(t.dtype).reshape(t.shape)


def stage_and(tmp_path, **options):
    disp = Dispatcher(SimDevice("t4", n_streams=64, seed=0), "paella", profile_runs=0)
    stage = BatchingStage(disp)
    model = ModelVariants("cells", (VariantSpec(0, 1, 0, "cells"),))
    sched = make_batcher("cellular", model, {"bundle_dir": str(tmp_path / "cells"), **options})
    stage.add_model(5, ServedModel("cells", model, {}, sched))
    return disp, stage, sched


@pytest.fixture(scope="module")
def cells_dir(tmp_path_factory):
    """The cells compiled (the plug-in only takes them from the compile cache)."""
    root = tmp_path_factory.mktemp("cellbundles")
    for kind in ("lstm", "seq2seq", "treelstm"):
        compile_cells(kind, CFG, (1, 2, 4, 8), bundle_dir=root / "cells")
    return root


def test_cells_not_compiled_yet_refuse_the_model_with_the_command_that_builds_them(cells_dir):
    from paella.dispatcher.batchers import BatcherError
    model = ModelVariants("cells", (VariantSpec(0, 1, 0, "cells"),))
    with pytest.raises(BatcherError, match=r"the lstm cells are not compiled yet .*build them with: "
                                           r"python -m paella.stepsched.cellular_plugin MODEL_FOLDER"):
        make_batcher("cellular", model, {"bundle_dir": str(cells_dir / "cells"), "seed": 987654321})


def test_registered_as_a_standalone_scheduler():
    assert get_batcher("cellular") is CellularPlugin
    assert CellularPlugin.drives_jobs and CellularPlugin.standalone


def test_lstm_chains_of_different_lengths_join_and_leave_running_batches(cells_dir):
    disp, stage, sched = stage_and(cells_dir, model="lstm", max_len=32)
    rng = np.random.default_rng(1)
    lens = [12, 3, 7, 1, 20]
    xss = [rng.standard_normal((n, H)).astype(np.float32) for n in lens]
    reqs = [Req(sched, i, client=i, xs=xs, per_step=(i % 2 == 0)) for i, xs in enumerate(xss)]
    stage.submit(reqs[0].req)
    stage.submit(reqs[1].req)
    for _ in range(6):                   # a few cells in, then the others join
        disp.step()
        stage.step()
        if disp.idle:
            disp.device.run_until(max(disp.device.next_event_time(), disp.device.now()))
    for r in reqs[2:]:
        stage.submit(r.req)
    stage.run_until_idle()
    eng = sched.engine
    for i, (r, n) in enumerate(zip(reqs, lens)):
        assert r.done == [(rings.OK, None)]
        want = lstm_alone(xss[i])
        np.testing.assert_allclose(r.out("h"), want[-1], rtol=1e-5, atol=1e-6)
        if i % 2 == 0:
            np.testing.assert_allclose(r.out("steps")[:n], want, rtol=1e-5, atol=1e-6)
            assert r.out("n_steps")[0] == n and r.progress == list(range(1, n + 1))
        else:
            assert r.out("n_steps")[0] == 0 and not r.progress
    assert eng.runtime.stats.tasks < sum(lens)          # cells of several requests batched
    assert eng.runtime.stats.rows == sum(lens)
    assert not eng.live and len(eng.free_rows) == eng.rows and not sched.pending


def test_seq2seq_decoders_first_and_tokens_equal_each_request_alone(cells_dir):
    disp, stage, sched = stage_and(cells_dir, model="seq2seq", max_len=16)
    rng = np.random.default_rng(2)
    cases = [(rng.integers(0, CFG.vocab, s).tolist(), t) for s, t in [(5, 7), (9, 3), (2, 12)]]
    reqs = [Req(sched, i, client=i, src=s, tgt_len=t, per_step=True) for i, (s, t) in enumerate(cases)]
    for r in reqs:
        stage.submit(r.req)
    stage.run_until_idle()
    for r, (s, t) in zip(reqs, cases):
        assert r.done == [(rings.OK, None)]
        toks, steps = seq2seq_alone(s, t)
        assert r.out("tokens")[:t].tolist() == toks
        np.testing.assert_allclose(r.out("steps")[:t], steps, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(r.out("h"), steps[-1], rtol=1e-5, atol=1e-6)
    ct = {c.name: c for c in sched.engine.sched.cell_types}
    assert ct["decoder"].priority > ct["encoder"].priority


def test_treelstm_equals_the_reference_run_node_by_node(cells_dir):
    disp, stage, sched = stage_and(cells_dir, model="treelstm", max_len=32)
    rng = np.random.default_rng(3)
    trees = [random_binary_tree(rng, n) for n in (1, 5, 17, 31)]
    trees.append([3, 3, 4, 4, -1])        # root last: children after their parents' index
    serve_and_check(stage, sched, "treelstm", rng, [len(p) for p in trees], trees)


def serve_and_check(stage, sched, model, rng, lengths, trees=None):
    """Requests of ``lengths`` (random inputs; ``trees``: their parents) from one client
    each, all at once; each answer (every step's, and the last's) equals the request
    computed alone."""
    reqs = []
    for i, n in enumerate(lengths):
        xs = rng.standard_normal((n, H)).astype(np.float32)
        parents = trees[i] if trees is not None else None
        reqs.append((Req(sched, i, client=i, xs=xs, parents=parents, per_step=True), xs, parents))
    for r, _, _ in reqs:
        stage.submit(r.req)
    stage.run_until_idle()
    for r, xs, parents in reqs:
        assert r.done == [(rings.OK, None)]
        want = run_alone(model, CFG, xs=xs, parents=parents)
        np.testing.assert_allclose(r.out("steps")[:len(xs)], want["steps"], rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(r.out("h"), want["h"], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("parents,reason", [
    ([1, 0], "no root .*a cycle"),
    ([-1, 0, 3, 2], "do not reach the root: a cycle"),
    ([-1, 1], "node 1 is its own parent"),
    ([-1, 7], "parent 7 is out of range"),
    ([-1, -2], "parent -2 is out of range"),
    ([-1, 0, 0, 0], "node 0 has 3 children"),
    ([-1, -1], "got 2"),
])
def test_tree_faults_are_named(parents, reason):
    with pytest.raises(TreeError, match=reason):
        tree_order(parents)


def test_bad_requests_are_refused_alone_and_the_others_served(cells_dir):
    disp, stage, sched = stage_and(cells_dir, model="treelstm", max_len=8)
    xs = np.ones((3, H), np.float32)
    bad = [Req(sched, 1, xs=xs, parents=[1, 2, 0]),            # a cycle, no root
           Req(sched, 2, xs=xs, parents=[-1, 5, 0]),           # out of range
           Req(sched, 3, xs=np.zeros((0, H)))]                  # empty
    over = Req(sched, 4, xs=xs, parents=[-1, 0, 0])
    over.io[sched.io.inputs[-1].offset:][:4] = np.array([9], np.int32).view(np.uint8)   # 9 > max_len 8
    good = Req(sched, 5, xs=xs, parents=[-1, 0, 0])
    for r in [*bad, over, good]:
        stage.submit(r.req)
    stage.run_until_idle()
    assert [r.done[0][0] for r in [*bad, over]] == [rings.E_OPTIONS] * 4
    assert "cycle" in bad[0].done[0][1] and "out of range" in bad[1].done[0][1]
    assert "empty" in bad[2].done[0][1] and "over the configured maximum max_len = 8" in over.done[0][1]
    assert good.done == [(rings.OK, None)]
    np.testing.assert_allclose(good.out("h"), tree_alone(xs, [-1, 0, 0])[0], rtol=1e-5, atol=1e-6)


def test_a_client_leaving_withdraws_its_cells_and_the_others_go_on(cells_dir):
    disp, stage, sched = stage_and(cells_dir, model="lstm", max_len=64, state_rows=128)
    rng = np.random.default_rng(4)
    a = Req(sched, 1, client=7, xs=rng.standard_normal((60, H)), per_step=True)
    xb = rng.standard_normal((40, H))
    b = Req(sched, 2, client=8, xs=xb)
    stage.submit(a.req)
    stage.submit(b.req)
    dev = disp.device
    while len(a.progress) < 5:
        disp.step()
        stage.step()
        if disp.idle:
            dev.run_until(max(dev.next_event_time(), dev.now()))
    stage.cancel_client(7)
    stage.run_until_idle()
    assert a.done[0][0] == rings.E_CANCELLED and len(a.done) == 1
    assert len(a.progress) < 60
    rows = sched.engine.runtime.stats.rows
    assert rows < 60 + 40                 # a's remaining cells never ran
    assert b.done == [(rings.OK, None)]
    np.testing.assert_allclose(b.out("h"), lstm_alone(xb)[-1], rtol=1e-5, atol=1e-6)
    assert len(sched.engine.free_rows) == 128 and not sched.engine.live


def test_a_device_without_host_views_refuses_the_model_with_the_reason(cells_dir, monkeypatch):
    """On a real GPU the context has no host view of device memory: the model is refused
    at load with what to do (the cells are computed as the simulated GPU's effects)."""
    from paella.dispatcher.batchers.stage import StageContext

    def no_view(self, ptr, nbytes):
        raise RuntimeError("the cuda device has no host view of its memory")
    monkeypatch.setattr(StageContext, "view", no_view)
    disp = Dispatcher(SimDevice("t4", n_streams=64, seed=0), "paella", profile_runs=0)
    model = ModelVariants("cells", (VariantSpec(0, 1, 0, "cells"),))
    sched = make_batcher("cellular", model, {"bundle_dir": str(cells_dir / "cells")})
    from paella.dispatcher.batchers.stage import scheduler_context
    ctx = scheduler_context(disp, "cells")
    with pytest.raises(RuntimeError, match="simulated GPU's functional effects; serve it with "
                                           "--backend sim"):
        sched.start(ctx)


@pytest.mark.parametrize("options,reason", [
    ({"model": "gru"}, "model must be one of lstm, seq2seq, treelstm"),
    ({"config": "huge"}, "config must be one of tiny, paper"),
    ({"bsizes": [0, 2]}, "bsizes must be a list of positive ints"),
    ({"max_len": 0}, "max_len must be an int >= 1"),
])
def test_bad_options_are_refused_at_load(cells_dir, options, reason):
    from paella.dispatcher.batchers import BatcherError
    model = ModelVariants("cells", (VariantSpec(0, 1, 0, "cells"),))
    with pytest.raises(BatcherError, match=reason):
        make_batcher("cellular", model, {"bundle_dir": str(cells_dir / "cells"), **options})


def test_graph_batching_baselines_run_seq2seq_and_trees_whole():
    """Seq2Seq's padded graph: encoder then decoder steps of the two-dimensional bucket;
    trees: merged and run level by level, every member leaving at the end."""
    from paella.stepsched.padding import Seq2SeqPadding, TreeGraphBatcher
    p = Seq2SeqPadding(4, 10, (1, 2, 4))
    for i, (s, t) in enumerate([(3, 12), (9, 19), (11, 5), (2, 20)]):
        p.add((i, s, t))
    (task,) = p.schedule(0)
    assert task.requests == [0, 1, 3] and task.parts == [("encoder", 4, 10), ("decoder", 4, 20)]
    assert p.task_done(task) == [0, 1, 3] and p.waiting == [(2, (11, 5))]
    tg = TreeGraphBatcher(2, {"leaf": (1, 2, 4), "internal": (1, 2, 4)})
    for i, parents in enumerate([[-1, 0, 0, 1, 1], [-1, 0, 0], [-1]]):
        tg.add((i, parents))
    assert tg.levels([-1, 0, 0, 1, 1]) == [2, 1, 0, 0, 0]
    (task,) = tg.schedule(0)
    # level 0: 3 + 2 leaves (5: chunks 4 and 1); level 1: 1 + 1 internal; level 2: 1
    assert task.parts == [("leaf", 4, 1), ("leaf", 1, 1), ("internal", 2, 1), ("internal", 1, 1)]
    assert task.requests == [0, 1]


@pytest.mark.parametrize("model", ["lstm", "treelstm"])
def test_two_workers_keep_every_subgraph_in_order(cells_dir, model):
    """BatchMaker's workers (n_workers = 2): two batched cells in flight, a subgraph's
    cells pinned to one worker; the answers are each request's alone."""
    disp, stage, sched = stage_and(cells_dir, model=model, max_len=32, n_workers=2,
                                   max_tasks_to_submit=2)
    rt, workers = sched.engine.runtime, set()
    kernels_for = rt.kernels_for
    rt.kernels_for = lambda t: (workers.add(t.worker), kernels_for(t))[1]
    rng = np.random.default_rng(6)
    lengths = [9, 20, 3, 14, 31, 6]
    trees = [random_binary_tree(rng, n) for n in lengths] if model == "treelstm" else None
    serve_and_check(stage, sched, model, rng, lengths, trees)
    assert workers == {0, 1}
