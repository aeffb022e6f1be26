"""Model control through the network front end (Triton's model-repository extension) with
the unmodified ``tritonclient`` over HTTP and gRPC: the index, unload (the model is gone,
the others serve), load (it is back); refused unless ``paella kserve --model-control``;
the daemon's own permission check still applies."""
from __future__ import annotations

import shutil

import numpy as np
import pytest

tritonhttp = pytest.importorskip("tritonclient.http")
tritongrpc = pytest.importorskip("tritonclient.grpc")
from tritonclient.utils import InferenceServerException  # noqa: E402

from bundles_for_tests import tiny_mlp  # noqa: E402
from service_daemon import cleanup, start_daemon, start_kserve  # noqa: E402

X = np.ones((2, 16), np.float32)                 # the tiny MLP's input


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    repo = tmp_path_factory.mktemp("repo")
    mlp = tiny_mlp(tmp_path_factory.mktemp("mlp") / "tiny_mlp")
    for name in ("alpha", "beta"):
        shutil.copytree(mlp, repo / name)
    (repo / "notes").mkdir()
    dp = start_daemon("--models", str(repo))
    yield dp
    cleanup(dp)


def _front(daemon, *args):
    proc, hp, gp, log = start_kserve(daemon.socket, *args)
    return proc, hp, gp, log


@pytest.fixture(scope="module")
def front(daemon):
    proc, hp, gp, log = _front(daemon, "--model-control")
    yield hp, gp
    proc.terminate()
    assert proc.wait(15) == 0, log.read_text()
    assert "Traceback" not in log.read_text()


def _infer_http(c, model: str) -> np.ndarray:
    inp = tritonhttp.InferInput("x", list(X.shape), "FP32")
    inp.set_data_from_numpy(X)
    return c.infer(model, [inp]).as_numpy(c.get_model_metadata(model)["outputs"][0]["name"])


def test_http_index_unload_load(front):
    hp, _ = front
    c = tritonhttp.InferenceServerClient(f"127.0.0.1:{hp}")
    index = {m["name"]: m for m in c.get_model_repository_index()}
    assert {"alpha", "beta"} <= set(index) and "notes" not in index
    assert index["alpha"]["state"] == "READY" and index["alpha"]["version"] == "1"
    want = _infer_http(c, "beta")
    c.unload_model("alpha")
    assert not c.is_model_ready("alpha")
    index = {m["name"]: m for m in c.get_model_repository_index()}
    assert index["alpha"]["state"] == "UNAVAILABLE"
    with pytest.raises(InferenceServerException, match="unknown model"):
        _infer_http(c, "alpha")
    assert np.array_equal(_infer_http(c, "beta"), want)        # the others serve on
    c.load_model("alpha")
    assert c.is_model_ready("alpha")
    assert np.array_equal(_infer_http(c, "alpha"), want)
    with pytest.raises(InferenceServerException, match="unknown_model"):
        c.load_model("nope")
    with pytest.raises(InferenceServerException, match="bad_name"):
        c.load_model("..")


def test_grpc_index_unload_load(front):
    _, gp = front
    c = tritongrpc.InferenceServerClient(f"127.0.0.1:{gp}")
    index = {m.name: m for m in c.get_model_repository_index().models}
    assert index["beta"].state == "READY"
    c.unload_model("beta")
    assert not c.is_model_ready("beta")
    assert {m.name: m.state for m in c.get_model_repository_index().models}["beta"] == \
        "UNAVAILABLE"
    c.load_model("beta")
    assert c.is_model_ready("beta")
    with pytest.raises(InferenceServerException) as e:
        c.load_model("nope")
    assert e.value.status() == "StatusCode.NOT_FOUND"
    with pytest.raises(InferenceServerException, match="parameters are not supported"):
        c.load_model("beta", config='{"backend": "x"}')


def test_refused_without_model_control(daemon):
    """The index is readable; load and unload are 403 / PERMISSION_DENIED naming the flag."""
    proc, hp, gp, log = _front(daemon)
    try:
        c = tritonhttp.InferenceServerClient(f"127.0.0.1:{hp}")
        assert {"alpha", "beta"} <= {m["name"] for m in c.get_model_repository_index()}
        with pytest.raises(InferenceServerException, match="--model-control"):
            c.unload_model("alpha")
        g = tritongrpc.InferenceServerClient(f"127.0.0.1:{gp}")
        with pytest.raises(InferenceServerException) as e:
            g.load_model("alpha")
        assert e.value.status() == "StatusCode.PERMISSION_DENIED"
        assert c.is_model_ready("alpha")
    finally:
        proc.terminate()
        assert proc.wait(15) == 0


@pytest.mark.parametrize("code, status", [("permission", 403), ("unknown_model", 404),
                                          ("busy", 409), ("load_failed", 400)])
def test_daemon_refusals_map_to_statuses(code, status):
    """The daemon's refusal codes (its own permission check: ``[access] control_users``,
    tested against the daemon in test_model_control.py) reach the client as statuses,
    with the daemon's message."""
    import asyncio

    from paella.client import DaemonError
    from paella.kserve.repository_control import RepositoryControl
    from paella.kserve.tensors import InferError

    def refuse(*_a, **_k):
        raise DaemonError(code, "the reason, as the daemon gave it")
    with pytest.raises(InferError) as e:
        asyncio.run(RepositoryControl._call(refuse))
    assert e.value.status == status and "the reason, as the daemon gave it" in str(e.value)
