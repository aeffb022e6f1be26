"""Cell models served by the real daemon (BatchMaker as the ``cellular`` scheduler plug-in,
loaded through its entry point), to client processes over the rings.

The daemon serves a model repository of ``config.toml``-only folders (docs/step-scheduler.md,
"Serving cell models from the daemon"): ``lstm``, ``s2s`` and ``tree`` (the tiny
configuration: hidden 16, vocabulary 32), and ``lstm-long`` (sequences up to 4,096 steps,
state rows for one of them and a little more). Outputs are checked against each request
computed alone, cell by cell, in numpy from the same seeded weights."""
from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

from paella import rings
from paella.client import RequestFailed, connect
from paella.models import rnn
from paella.stepsched.cell_engine import run_alone
from paella.stepsched.graph import random_binary_tree
from paella.stepsched.cellular_plugin import cell_request, compile_cells
from service_daemon import cleanup, start_daemon

CFG = rnn.RNNConfig.tiny()
H = CFG.hidden
MODELS = {"lstm": 'model = "lstm"\nmax_len = 64\n',
          "s2s": 'model = "seq2seq"\nmax_len = 32\n',
          "tree": 'model = "treelstm"\nmax_len = 64\n',
          "lstm-long": 'model = "lstm"\nmax_len = 4096\nstate_rows = 4200\n',
          # weights of a seed nobody compiled: refused at load, the others served
          "lstm-unbuilt": 'model = "lstm"\nseed = 987654321\n'}


def alone(model, **request):
    """The request computed by itself, cell by cell (``run_alone``)."""
    return run_alone(model, CFG, **request)


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    root = tmp_path_factory.mktemp("cells")
    bundles = root / "bundles"
    for kind in ("lstm", "seq2seq", "treelstm"):      # compiled here first (the compile
        compile_cells(kind, CFG, (1, 2, 4, 8), bundle_dir=bundles)   # cache serves the daemon)
    models = root / "models"
    for name, body in MODELS.items():
        (models / name).mkdir(parents=True)
        (models / name / "config.toml").write_text(
            f'[batching]\nbatcher = "cellular"\nconfig = "tiny"\nbundle_dir = "{bundles}"\n{body}')
    dp = start_daemon("--backend", "sim", "--models", str(models))
    yield dp
    cleanup(dp)


CLIENT = textwrap.dedent('''
    import json, sys, time
    import numpy as np
    import paella
    from paella.stepsched.cellular_plugin import cell_request
    jobs, start = json.loads(sys.argv[1])
    c = paella.connect(SOCK)
    while time.time() < start:
        time.sleep(0.001)
    out = []
    for model, args in jobs:                 # one after the other, sent without waiting
        v = c.model(model).variants[0]
        out.append(c.infer(model, cell_request(v, **args), timeout=60))
    print(json.dumps([{k: a.tolist() for k, a in o.items()} for o in out]))
''')


def test_two_client_processes_get_their_own_outputs_from_each_cell_model(daemon):
    """Two processes, each sending requests of different lengths to the three models,
    started at once: their cells share batched steps (requests join and leave running
    batches); every answer equals its request computed alone."""
    rng = np.random.default_rng(7)
    plans = []
    for p in range(2):
        jobs = []
        for n in ([37, 5] if p == 0 else [12, 50]):
            jobs.append(("lstm", {"xs": rng.standard_normal((n, H)).tolist(), "per_step": True}))
        for s, t in ([(6, 9)] if p == 0 else [(15, 4)]):
            jobs.append(("s2s", {"src": rng.integers(0, CFG.vocab, s).tolist(), "tgt_len": t,
                                 "per_step": False}))
        for n in ([9] if p == 0 else [40]):
            jobs.append(("tree", {"xs": rng.standard_normal((n, H)).tolist(),
                                  "parents": random_binary_tree(rng, n), "per_step": True}))
        plans.append(jobs)
    start = time.time() + 2.0
    procs = [subprocess.Popen([sys.executable, "-c", f"SOCK = {daemon.socket!r}\n" + CLIENT,
                               json.dumps([jobs, start])], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for jobs in plans]
    for jobs, proc in zip(plans, procs):
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, err
        for (model, args), got in zip(jobs, json.loads(out)):
            if model == "lstm":
                want = alone("lstm", xs=args["xs"])["steps"]
                n = len(want)
                np.testing.assert_allclose(got["h"], want[-1], rtol=1e-5, atol=1e-6)
                np.testing.assert_allclose(np.array(got["steps"])[:n], want, rtol=1e-5, atol=1e-6)
                assert got["n_steps"] == [n]
            elif model == "s2s":
                want = alone("seq2seq", src=args["src"], tgt_len=args["tgt_len"])
                toks, h = want["tokens"], want["h"]
                assert got["tokens"][:args["tgt_len"]] == toks
                np.testing.assert_allclose(got["h"], h, rtol=1e-5, atol=1e-6)
                assert got["n_steps"] == [0]
            else:
                want = alone("treelstm", xs=args["xs"], parents=args["parents"])["steps"]
                n = len(want)
                np.testing.assert_allclose(np.array(got["steps"])[:n], want, rtol=1e-5, atol=1e-6)
                np.testing.assert_allclose(got["h"], want[0], rtol=1e-5, atol=1e-6)


def test_a_treelstm_request_equals_the_reference_run_node_by_node(daemon):
    rng = np.random.default_rng(11)
    parents = [5, 5, 6, 6, 7, 7, 9, 10, -1, 8, 8]      # a valid binary tree, root 8
    xs = rng.standard_normal((len(parents), H)).astype(np.float32)
    with connect(daemon.socket) as c:
        v = c.model("tree").variants[0]
        got = c.infer("tree", cell_request(v, xs=xs, parents=parents, per_step=True), timeout=30)
    want = alone("treelstm", xs=xs, parents=parents)["steps"]
    np.testing.assert_allclose(got["steps"][:len(parents)], want, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(got["h"], want[8], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("model,args,reason", [
    ("tree", {"xs": np.ones((3, H)), "parents": [1, 2, 0]}, "no root (parent -1): its parents form a cycle"),
    ("tree", {"xs": np.ones((4, H)), "parents": [-1, 0, 3, 2]}, "do not reach the root: a cycle"),
    ("tree", {"xs": np.ones((3, H)), "parents": [-1, 0, 64]}, "parent 64 is out of range"),
    ("tree", {"xs": np.ones((3, H)), "parents": [-1, -7, 0]}, "parent -7 is out of range"),
    ("tree", {"xs": np.ones((4, H)), "parents": [-1, 0, 0, 0]}, "node 0 has 3 children"),
    ("lstm", {"xs": np.ones((0, H))}, "must be at least 1 (an empty request)"),
    ("s2s", {"src": [], "tgt_len": 3}, "must be at least 1 (an empty request)"),
    ("s2s", {"src": [1, 2], "tgt_len": 0}, "the target length must be 1..32"),
    ("s2s", {"src": [1, 32], "tgt_len": 2}, "token id 32 is outside the vocabulary [0, 32)"),
    ("lstm", {"xs": np.full((2, H), np.nan)}, "NaN"),
])
def test_bad_input_is_a_clear_error_for_that_request_alone(daemon, model, args, reason):
    with connect(daemon.socket) as c:
        v = c.model(model).variants[0]
        with pytest.raises(RequestFailed) as e:
            c.infer(model, cell_request(v, **args), timeout=20)
        assert e.value.status == rings.E_OPTIONS and reason in str(e.value)
        xs = np.ones((4, H), np.float32)     # the daemon keeps serving
        got = c.infer("lstm", cell_request(c.model("lstm").variants[0], xs=xs), timeout=20)
        np.testing.assert_allclose(got["h"], alone("lstm", xs=xs)["h"], rtol=1e-5, atol=1e-6)


def test_a_sequence_over_the_configured_maximum_is_refused(daemon):
    with connect(daemon.socket) as c:
        v = c.model("lstm").variants[0]
        inputs = cell_request(v, xs=np.ones((3, H)))
        inputs["lengths"][0] = 65                # the io holds 64; the daemon reads 65
        with pytest.raises(RequestFailed) as e:
            c.infer("lstm", inputs, timeout=20)
        assert e.value.status == rings.E_OPTIONS
        assert "is 65, over the configured maximum max_len = 64" in str(e.value)
        with pytest.raises(ValueError, match="at most 64"):    # the helper says so first
            cell_request(v, xs=np.ones((65, H)))


VANISH = textwrap.dedent('''
    import os, time
    import numpy as np
    from paella import connect, rings, wire
    from paella.stepsched.cellular_plugin import cell_request
    c = connect(SOCK, mode="polling")
    v = c.model("lstm-long").variants[0]
    off = c.alloc(v.io_bytes)
    ins, outs = c.io_views("lstm-long", off)
    for k, a in cell_request(v, xs=np.ones((4000, 16)), per_step=True).items():
        ins[k][...] = a
    rid = c.predict("lstm-long", v.io_bytes, off, wire.STREAM)
    seen = []
    while len(seen) < 3:                  # three cells in
        e = c._completions.pop()
        if e is not None:
            seen.append(e)
    print(seen[-1][2], "running" if all(e[1] == rings.PROGRESS for e in seen) else "ended",
          flush=True)
    os._exit(0)                           # gone mid-sequence, socket and all
''')


def test_a_client_vanishing_mid_sequence_gets_its_cells_withdrawn(daemon):
    """lstm-long's 4,200 state rows hold one 4,000-step sequence: a request of 300 steps
    is refused ("state rows") until the vanished client's rows are back. Run alone, the
    4,000 steps take 3.7 s here (0.9 ms a cell); withdrawn, the rows are back as soon as
    the daemon sees the client go, and the 300-step request is served (0.26 s alone)
    well before the 4,000 would have ended."""
    r = subprocess.run([sys.executable, "-c", f"SOCK = {daemon.socket!r}\n" + VANISH],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    steps_seen, state = r.stdout.split()
    assert state == "running" and int(steps_seen) < 100
    t0 = time.monotonic()
    xs = np.random.default_rng(5).standard_normal((300, H)).astype(np.float32)
    with connect(daemon.socket) as c:
        v = c.model("lstm-long").variants[0]
        for attempt in range(100):           # (the daemon may not have seen it go yet)
            try:
                got = c.infer("lstm-long", cell_request(v, xs=xs), timeout=30)
                break
            except RequestFailed as e:
                assert "state rows" in str(e), e
                time.sleep(0.005)
        else:
            pytest.fail("the vanished client's state rows never came back")
    elapsed = time.monotonic() - t0
    np.testing.assert_allclose(got["h"], alone("lstm", xs=xs)["h"], rtol=1e-5, atol=1e-6)
    # Measured on this 2-core machine: 4,000 steps alone 3.7 s, 300 steps 0.26 s.
    assert elapsed < 2.0, elapsed


def test_a_model_whose_cells_are_not_built_is_refused_with_the_command(daemon):
    """The daemon never compiles: the folder is refused with the command that builds its
    cells, and the other models are served."""
    from paella.client import UnknownModel
    with connect(daemon.socket) as c:
        with pytest.raises(UnknownModel):
            c.model("lstm-unbuilt")
        xs = np.ones((3, H), np.float32)
        got = c.infer("lstm", cell_request(c.model("lstm").variants[0], xs=xs), timeout=20)
    np.testing.assert_allclose(got["h"], alone("lstm", xs=xs)["h"], rtol=1e-5, atol=1e-6)
    log = daemon.log()
    assert "lstm-unbuilt" in log and "the lstm cells are not compiled yet" in log
    assert "python -m paella.stepsched.cellular_plugin MODEL_FOLDER" in log
