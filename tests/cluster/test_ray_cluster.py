"""The Ray Serve deployment, for real: a local Ray cluster with two simulated GPUs,
the application of ``paella cluster`` on it, load through the KServe ingress with
tritonclient, over REST and over gRPC (unary and ``ModelStreamInfer``) (issue 41's "Done
means").

One Ray instance serves the module (starting Ray costs seconds on a 2-core machine); it
is stopped by the fixture's finalizer whatever happens. Every answer is checked against
its own request (each request's input is unique), so a lost, swapped or duplicated
answer shows.
"""
from __future__ import annotations

import json
import os
import signal
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

ray = pytest.importorskip("ray")
httpclient = pytest.importorskip("tritonclient.http")
from tritonclient.utils import InferenceServerException  # noqa: E402

from paella.client import Client  # noqa: E402
from paella.cluster import ray_app  # noqa: E402
from paella.cluster.ray_config import SIM_GPU_RESOURCE, parse_config  # noqa: E402
from paella.dispatcher.frontend import Frontend  # noqa: E402

pytestmark = [pytest.mark.ray, pytest.mark.timeout(300)]

N_GPUS = 2


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """A local Ray with two simulated GPUs and the cluster application on it:
    (config, KServe HTTP client URL)."""
    from ray import serve
    run_dir = str(tmp_path_factory.mktemp("paella-cluster"))
    port, grpc_port = _free_port(), _free_port()
    cfg = parse_config({"models": ["echo"], "gpus": {"count": N_GPUS},
                        "http": {"port": port}, "grpc": {"port": grpc_port},
                        "run_dir": run_dir,
                        "daemon": {"timeout_s": 10, "health_check_period_s": 1,
                                   "stats_period_s": 0.5}})
    # (two more simulated GPUs: the failing replicas' test, both cases at once)
    ray.init(num_cpus=2, resources={SIM_GPU_RESOURCE: N_GPUS + 2}, include_dashboard=False,
             log_to_driver=False, configure_logging=False)
    try:
        ray_app.run(cfg, seed=1)
        yield cfg, f"127.0.0.1:{port}"
    finally:
        serve.shutdown()
        ray.shutdown()


def _records(cfg) -> dict[int, dict]:
    """Each rank's daemon, as its replica wrote it down (a replacement may hold a rank
    past N until Ray renumbers it)."""
    out = {}
    for name in os.listdir(cfg.run_dir):
        if name.startswith(f"{cfg.app_name}-") and name.endswith(".json"):
            try:
                with open(os.path.join(cfg.run_dir, name)) as f:
                    rec = json.load(f)
            except (OSError, ValueError):            # (being replaced)
                continue
            out[rec["rank"]] = rec
    return out


def _served(record: dict) -> int:
    """Requests this daemon took (its STATUS), -1 if it does not answer. The daemon
    reuses a STATUS reply for ``STATUS_REUSE`` seconds (the router polls it too), so
    this waits that long first: a count read right after the last answer could
    otherwise predate the last few requests."""
    time.sleep(2 * Frontend.STATUS_REUSE)
    try:
        c = Client(record["socket"])
    except Exception:  # noqa: BLE001
        return -1
    try:
        return int(c.status()["stats"]["requests"])
    finally:
        c.close()


def _unique(i: int) -> np.ndarray:
    """Request ``i``'s input, unlike any other request's."""
    v = np.full(256, i, np.float32)
    v[0] = -i
    return v


def _infer(url: str, i: int) -> str:
    """One request with a unique input; "ok", or the error's text (checked by callers)."""
    c = httpclient.InferenceServerClient(url, network_timeout=30)
    try:
        x = httpclient.InferInput("x", [256], "FP32")
        v = _unique(i)
        x.set_data_from_numpy(v)
        try:
            y = c.infer("echo", [x]).as_numpy("y")
        except InferenceServerException as e:
            return f"error: {e}"
        assert y is not None and np.array_equal(y, v), f"request {i} got another answer"
        return "ok"
    finally:
        c.close()


def _load(url: str, first: int, n: int, workers: int = 8) -> list[str]:
    with ThreadPoolExecutor(workers) as pool:
        return list(pool.map(lambda i: _infer(url, i), range(first, first + n)))


def test_load_through_the_ingress_is_answered_by_both_daemons(cluster):
    cfg, url = cluster
    c = httpclient.InferenceServerClient(url)
    assert c.is_server_ready()
    assert c.get_model_metadata("echo")["outputs"][0]["name"] == "y"
    assert [(m["name"], m["state"]) for m in c.get_model_repository_index()] == \
        [("echo", "READY")]                            # (the config's models)
    records = _records(cfg)
    assert sorted(records) == list(range(N_GPUS))
    before = {r: _served(rec) for r, rec in records.items()}
    results = _load(url, 1, 200)
    assert results == ["ok"] * 200
    after = {r: _served(rec) for r, rec in records.items()}
    took = {r: after[r] - before[r] for r in records}
    assert all(n > 0 for n in took.values()), f"a daemon served nothing: {took}"
    assert sum(took.values()) == 200, took           # each request once, on one daemon
    # an unknown model is the front end's own 404, through the cluster
    with pytest.raises(InferenceServerException, match="unknown model"):
        c.infer("nope", [httpclient.InferInput("x", [1], "FP32")])


def test_grpc_through_the_ingress_unary_and_streamed_is_answered_by_both_daemons(cluster):
    """The ingress's own gRPC server (the front end's servicer over the cluster's
    service): unmodified tritonclient.grpc, ``ModelInfer`` from threads and
    ``ModelStreamInfer`` on one stream, every answer its own request's input."""
    grpcclient = pytest.importorskip("tritonclient.grpc")
    cfg, _ = cluster
    addr = f"{cfg.grpc_host}:{cfg.grpc_port}"
    c = grpcclient.InferenceServerClient(addr)
    try:
        assert c.is_server_live() and c.is_server_ready()
        assert c.get_model_metadata("echo").outputs[0].name == "y"
        records = _records(cfg)
        before = {r: _served(rec) for r, rec in records.items()}

        def x_of(i: int):
            x = grpcclient.InferInput("x", [256], "FP32")
            x.set_data_from_numpy(_unique(i))
            return x

        def unary(i: int) -> None:
            y = c.infer("echo", [x_of(i)], request_id=str(i), client_timeout=30).as_numpy("y")
            assert y is not None and np.array_equal(y, _unique(i)), f"request {i}"

        with ThreadPoolExecutor(8) as pool:
            list(pool.map(unary, range(30_000, 30_100)))

        # one stream, 100 requests in flight together and an unknown model among them:
        # each answer matched to its request by id, the unknown one an error on the
        # stream (which goes on)
        answers: dict[int, np.ndarray] = {}
        errors: list[str] = []

        def on_response(result, error) -> None:
            if error is not None:
                errors.append(str(error))
            else:
                rid = int(result.get_response().id)
                assert rid not in answers, f"request {rid} answered twice"
                answers[rid] = result.as_numpy("y")

        c.start_stream(callback=on_response, stream_timeout=60)
        for i in range(40_000, 40_100):
            c.async_stream_infer("echo", [x_of(i)], request_id=str(i))
            if i == 40_050:
                c.async_stream_infer("nope", [x_of(0)], request_id="unknown")
        c.stop_stream()                        # (waits for the stream's end)
        assert sorted(answers) == list(range(40_000, 40_100))
        for i, y in answers.items():
            assert np.array_equal(y, _unique(i)), f"streamed request {i} got another answer"
        assert len(errors) == 1 and "unknown model" in errors[0], errors

        after = {r: _served(rec) for r, rec in records.items()}
        took = {r: after[r] - before[r] for r in records}
        assert all(n > 0 for n in took.values()), f"a daemon served nothing: {took}"
        assert sum(took.values()) == 200, took       # each request once, on one daemon

        # an unknown model is the front end's NOT_FOUND, through the cluster
        with pytest.raises(InferenceServerException, match="unknown model") as e:
            c.infer("nope", [x_of(0)])
        assert e.value.status() == "StatusCode.NOT_FOUND"
    finally:
        c.close()


def test_a_killed_daemon_loses_no_request_and_its_replica_comes_back(cluster):
    cfg, url = cluster
    victim = _records(cfg)[0]
    old = {r["daemon_pid"] for r in _records(cfg).values()}
    results: list[str] = []
    done = threading.Event()

    def killer() -> None:
        time.sleep(1.0)                               # (during the load)
        os.kill(victim["daemon_pid"], signal.SIGKILL)
        done.set()

    t = threading.Thread(target=killer)
    t.start()
    results = _load(url, 10_000, 600)
    t.join()
    assert done.is_set()
    errors = [r for r in results if r != "ok"]
    print(f"\n{len(results) - len(errors)} answered, {len(errors)} failed: {sorted(set(errors))[:3]}")
    # every request has one outcome: its own correct answer (checked in _infer), or a
    # clear error naming what happened
    assert len(results) == 600
    for e in errors:
        assert ("lost its daemon" in e or "did not answer" in e
                or "died" in e), e
    assert len(errors) < 600, "nothing was answered"
    # Ray replaces the replica (its health check fails), which starts a new daemon
    deadline = time.monotonic() + 90
    new = None
    while time.monotonic() < deadline and new is None:
        time.sleep(0.5)
        new = next((r for r in _records(cfg).values()
                    if r["daemon_pid"] not in old and _served(r) >= 0), None)
    if new is None:
        pytest.fail("the replica did not come back with a new daemon within 90 s")
    # ... and serves again: load until the new daemon has taken some
    start = _served(new)
    for k in range(20):
        assert _load(url, 20_000 + 100 * k, 100) == ["ok"] * 100
        if _served(new) > start:
            break
    else:
        pytest.fail("the new daemon of rank 0 was never routed a request")


def test_replicas_that_cannot_start_their_daemons_say_why(cluster, tmp_path):
    """The replica's constructor raises with the daemon's own words; Ray shows them in
    the deployment's status, where ``paella cluster`` reads them for its error (after
    serve.run raised, as it does in ``paella cluster``). The cases deploy one after the
    other: each is three tries of a replica."""
    from ray import serve
    cfg0, _ = cluster
    (tmp_path / "broken").mkdir()                   # a model folder without a bundle
    cases = {
        "broken-option": ({"daemon": {"args": ["--policy", "no-such-policy"]}},
                          "no-such-policy"),
        "broken-bundle": ({"models": ["broken"], "model_repository": str(tmp_path)},
                          "without the model(s) broken"),
    }

    def deploy(name: str) -> None:
        cfg = parse_config({"models": ["echo"], "gpus": {"count": 1}, "run_dir": cfg0.run_dir,
                            "app_name": name, **cases[name][0]})
        with pytest.raises(RuntimeError):
            serve.run(ray_app.gpu_replicas(cfg, 1), name=name, route_prefix=None)

    try:
        # One after the other: deploying from two threads at once raced inside Ray
        # (DeploymentConfig's pickle-by-value registration of the request router's
        # module: "is not registered for pickle by value", in a fresh-clone suite run).
        for name in cases:
            deploy(name)
        for name, (_, want) in cases.items():
            status = serve.status().applications[name]
            assert want in status.deployments[ray_app.REPLICA_DEPLOYMENT].message, name
            assert want in ray_app.failure_of(name)
    finally:
        for name in cases:
            serve.delete(name)
