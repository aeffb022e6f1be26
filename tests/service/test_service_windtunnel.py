"""A fine-tuned WindTunnel network, exported to ONNX and compiled by ``paella compile``,
served by the real daemon: the client's answers equal the torch network's."""
from __future__ import annotations

import os

import numpy as np
import pytest

torch = pytest.importorskip("torch")  # a safety net: `make install` installs the windtunnel extra

from paella.client import connect
from service_daemon import cleanup, start_daemon

BATCH = 8


@pytest.fixture(scope="module")
def served_net(tmp_path_factory):
    """(daemon, network, test rows): the bundle is compiled once and cached by content in
    ~/.cache/paella (fine-tuning is seeded and single-threaded, so the weights repeat)."""
    from sklearn.compose import ColumnTransformer
    from sklearn.ensemble import GradientBoostingClassifier
    from sklearn.pipeline import Pipeline
    from sklearn.preprocessing import KBinsDiscretizer, OneHotEncoder, StandardScaler

    from paella.windtunnel import FitConfig, compile_network, finetune, translate
    from paella.windtunnel.data import synthetic
    torch.set_num_threads(1)
    tr, _, te = synthetic(1200, seed=5).split(seed=5)
    ct = ColumnTransformer([("num", StandardScaler(), tr.numeric),
                            ("bins", KBinsDiscretizer(n_bins=4, encode="onehot"), [2]),
                            ("cat", OneHotEncoder(handle_unknown="ignore"), tr.categorical)])
    pipe = Pipeline([("ct", ct), ("gb", GradientBoostingClassifier(n_estimators=12, max_depth=3, random_state=0))])
    net = translate(pipe.fit(tr.X, tr.y), tau=1.0, reference=tr.X)
    finetune(net, tr.X, tr.y, config=FitConfig(epochs=2, lr=3e-3))
    repo = tmp_path_factory.mktemp("wtrepo")
    compile_network(net, repo / "windtunnel", batch=BATCH)
    assert os.listdir(repo) == ["windtunnel"]    # the repository holds the bundle only
    dp = start_daemon("--models", str(repo))
    yield dp, net, te.X
    cleanup(dp)


def test_daemon_answers_equal_the_framework(served_net):
    dp, net, rows = served_net
    with connect(dp.socket) as c:
        spec = c.models["windtunnel"].variants[0]
        assert [t.name for t in spec.inputs] == ["x"] and tuple(spec.inputs[0].shape) == (BATCH, net.in_dim)
        for k in range(6):
            x = np.ascontiguousarray(rows[k * BATCH:(k + 1) * BATCH])
            got = c.infer("windtunnel", {"x": x})["y"]        # the ONNX model's output name
            np.testing.assert_allclose(got, net.output(x), rtol=1e-5, atol=1e-6)
            np.testing.assert_allclose(got.sum(axis=1), 1.0, atol=1e-6)   # probabilities
    assert "backend auto: sim" in dp.log()
