"""The Ray Serve deployment, for real: a local Ray cluster with two simulated GPUs,
the application of ``paella cluster`` on it, load through the KServe REST ingress with
tritonclient (issue 41's "Done means").

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
    port = _free_port()
    cfg = parse_config({"models": ["echo"], "gpus": {"count": N_GPUS},
                        "http": {"port": port}, "run_dir": run_dir,
                        "daemon": {"timeout_s": 10, "health_check_period_s": 1,
                                   "stats_period_s": 0.5}})
    # (one more simulated GPU: the failing replicas' test)
    ray.init(num_cpus=2, resources={SIM_GPU_RESOURCE: N_GPUS + 1}, include_dashboard=False,
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
    """Requests this daemon took (its STATUS), -1 if it does not answer."""
    try:
        c = Client(record["socket"])
    except Exception:  # noqa: BLE001
        return -1
    try:
        return int(c.status()["stats"]["requests"])
    finally:
        c.close()


def _infer(url: str, i: int) -> str:
    """One request with a unique input; "ok", or the error's text (checked by callers)."""
    c = httpclient.InferenceServerClient(url, network_timeout=30)
    try:
        x = httpclient.InferInput("x", [256], "FP32")
        v = np.full(256, i, np.float32)
        v[0] = -i
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
    records = _records(cfg)
    assert sorted(records) == list(range(N_GPUS))
    before = {r: _served(rec) for r, rec in records.items()}
    results = _load(url, 1, 300)
    assert results == ["ok"] * 300
    after = {r: _served(rec) for r, rec in records.items()}
    took = {r: after[r] - before[r] for r in records}
    assert all(n > 0 for n in took.values()), f"a daemon served nothing: {took}"
    assert sum(took.values()) == 300, took           # each request once, on one daemon
    # an unknown model is the front end's own 404, through the cluster
    with pytest.raises(InferenceServerException, match="unknown model"):
        c.infer("nope", [httpclient.InferInput("x", [1], "FP32")])


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


@pytest.mark.parametrize("case", ["bad option", "bad bundle"])
def test_a_replica_that_cannot_start_its_daemon_says_why(cluster, tmp_path, case):
    """The replica's constructor raises with the daemon's own words; Ray shows them in
    the deployment's status, where ``paella cluster`` reads them for its error."""
    from ray import serve
    cfg0, _ = cluster
    raw = {"models": ["echo"], "gpus": {"count": 1}, "run_dir": cfg0.run_dir,
           "app_name": "broken"}
    if case == "bad option":
        raw["daemon"] = {"args": ["--policy", "no-such-policy"]}
        want = "no-such-policy"
    else:
        (tmp_path / "broken").mkdir()               # a model folder without a bundle
        raw.update(models=["broken"], model_repository=str(tmp_path))
        want = "without the model(s) broken"
    cfg = parse_config(raw)
    try:
        with pytest.raises(RuntimeError):
            serve.run(ray_app.gpu_replicas(cfg, 1), name="broken", route_prefix=None)
        status = serve.status().applications["broken"]
        assert want in status.deployments[ray_app.REPLICA_DEPLOYMENT].message
        assert want in ray_app.failure_of("broken")
    finally:
        serve.delete("broken")
