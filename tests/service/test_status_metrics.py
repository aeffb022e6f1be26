"""``paella status`` and the Prometheus endpoint against a real daemon; STATUS from
hostile clients."""
from __future__ import annotations

import json
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

import paella
from paella import wire
from paella.client.status import daemon_status

PAELLA = str(Path(sys.executable).with_name("paella"))


@pytest.fixture(scope="module")
def metrics_daemon():
    from service_daemon import cleanup, free_port, start_daemon
    port = free_port()
    dp = start_daemon("--metrics-port", str(port))
    dp.metrics_port = port
    yield dp
    cleanup(dp)


def scrape(port: int) -> dict[tuple[str, tuple], float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        text = r.read().decode()
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def test_status_lists_models_clients_and_occupancy(metrics_daemon):
    dp = metrics_daemon
    with paella.connect(dp.socket) as c:
        c.infer("echo", {"x": np.ones(256, np.float32)}, timeout=10)
        st = c.status()
        r = subprocess.run([PAELLA, "status", "--socket", dp.socket, "--json"],
                           capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, r.stderr
        cli = json.loads(r.stdout)
        text = subprocess.run([PAELLA, "status", "--socket", dp.socket], capture_output=True,
                              text=True, timeout=60).stdout
    for s in (st, cli):
        assert [m["name"] for m in s["models"]] == ["echo", "noop"]
        assert s["pid"] == dp.pid and s["backend"] == "sim"
        assert s["dispatcher"]["gpu"] == "t4" and len(s["dispatcher"]["sm_occupancy"]) == 40
        assert all(0 <= x <= 1 for x in s["dispatcher"]["sm_occupancy"])
    assert c.client_id in [x["id"] for x in st["clients"]]
    assert st["stats"]["requests"] >= 1
    assert "echo" in text and "per-SM occupancy" in text and "policy paella" in text
    # noop is the one dispatcher model; its 64-byte input buffer set at least
    assert st["dispatcher"]["models"] == 1 and st["dispatcher"]["device_memory_bytes"] >= 64
    assert st["dispatcher"]["device_memory_total_bytes"] == 16 << 30   # the T4's 16 GB
    assert st["dispatcher"]["memory_waits"] == st["dispatcher"]["memory_failures"] == 0
    assert "1 dispatcher model(s)" in text and "device memory" in text and "of 16.0 GiB" in text
    # per model: noop holds all of it (its buffer sets, made at load: buffer_sets_ahead),
    # echo (a host model) nothing
    mem = {m["name"]: m["device_memory_bytes"] for m in st["models"]}
    assert mem == {"echo": 0, "noop": st["dispatcher"]["device_memory_bytes"]}
    assert mem["noop"] == 512 * 64                   # 512 sets of its 64-byte input
    assert " KiB on the GPU" in text.split("noop", 1)[1].splitlines()[0]


def test_a_clients_status_counts_the_requests_it_had_answered(metrics_daemon):
    """The daemon reuses a STATUS reply for a few milliseconds (a STATUS flood costs it
    little), but never one older than the asking client's own answers."""
    with paella.connect(metrics_daemon.socket) as c:
        for i in range(20):
            before = c.status()["stats"]["requests"]        # (built now: reused below)
            c.infer("echo", {"x": np.full(256, i, np.float32)}, timeout=10)
            after = c.status()["stats"]["requests"]
            assert after >= before + 1, (i, before, after)
        flood = [c.status()["stats"]["requests"] for _ in range(50)]
        assert flood == sorted(flood) and flood[-1] >= after


def test_status_of_no_daemon_is_a_clear_error(tmp_path):
    r = subprocess.run([PAELLA, "status", "--socket", str(tmp_path / "none.sock")],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "paella: error: no paella daemon answers" in r.stderr
    assert "Traceback" not in r.stderr


def test_hostile_status_frames_get_errors_and_the_daemon_serves_on(metrics_daemon):
    dp = metrics_daemon
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(10)
    s.connect(dp.socket)
    try:
        s.sendall(wire.encode(wire.STATUS, {"x": 1}))            # a field STATUS lacks
        reader = wire.FrameReader()
        frames = []
        while not frames:
            frames = reader.feed(s.recv(65536))
        assert frames[0][0] == wire.ERROR and frames[0][1]["error"] == "bad_field"
        # A client may not send a reply. A flood of STATUS is answered from a cache
        # (one build per 50 ms); the replies pile up faster than this reader takes them,
        # so the daemon may drop it as a client that does not read (1 MiB queued).
        s.sendall(wire.encode(wire.STATUS_REPLY, {"status": {}}))
        s.sendall(wire.encode(wire.STATUS) * 2000)
        got, eof, t_end = [], False, time.monotonic() + 10
        while len(got) < 2001 and not eof and time.monotonic() < t_end:
            data = s.recv(1 << 20)
            eof = not data
            got += reader.feed(data)
        assert got[0][0] == wire.ERROR and got[0][1]["error"] == "unexpected"
        replies = sum(k == wire.STATUS_REPLY for k, _ in got)
        assert replies == 2000 or (eof and replies > 0), (replies, eof)
    finally:
        s.close()
    assert daemon_status(dp.socket)["pid"] == dp.pid
    with paella.connect(dp.socket) as c:
        x = np.arange(256, dtype=np.float32)
        assert np.array_equal(c.infer("echo", {"x": x}, timeout=10)["y"], x)


def test_metrics_count_requests_kernels_and_occupancy(metrics_daemon):
    dp = metrics_daemon
    before = scrape(dp.metrics_port)
    m = lambda d, name, model: d.get((name, (("model", model), ("version", "1"))), 0.0)  # noqa: E731
    with paella.connect(dp.socket) as c:
        for i in range(5):
            c.infer("echo", {"x": np.full(256, i, np.float32)}, timeout=10)
        for _ in range(3):
            c.infer("noop", {"x": np.zeros(64, np.uint8)}, timeout=10)
        bad = c.predict("echo", 7, c.alloc(8))                 # wrong length: fails
        with pytest.raises(paella.RequestFailed):
            c.wait(bad, timeout=10)
    after = scrape(dp.metrics_port)
    assert m(after, "nv_inference_request_success", "echo") - \
        m(before, "nv_inference_request_success", "echo") == 5
    assert m(after, "nv_inference_request_success", "noop") - \
        m(before, "nv_inference_request_success", "noop") == 3
    # noop: one kernel per request (the profiling runs at start-up count too)
    assert m(after, "paella_kernel_releases_total", "noop") - \
        m(before, "paella_kernel_releases_total", "noop") == 3
    assert m(after, "nv_inference_exec_count", "noop") >= 3
    assert m(after, "nv_inference_request_duration_us", "noop") > \
        m(after, "nv_inference_compute_infer_duration_us", "noop") > 0
    assert m(after, "nv_inference_queue_duration_us", "noop") >= 0
    occupancy = [k for k in after if k[0] == "paella_sm_occupancy"]
    assert len(occupancy) == 40
    assert ("paella_notifq_depth", ()) in after and ("paella_policy_fallbacks_total", ()) in after
    assert after[("paella_policy", (("policy", "paella"),))] == 1
    assert after[("paella_dispatcher_models", ())] == 1
    assert after[("paella_device_memory_bytes", ())] >= 64
    assert m(after, "paella_model_device_memory_bytes", "noop") == \
        after[("paella_device_memory_bytes", ())]
    assert m(after, "paella_model_device_memory_bytes", "echo") == 0
    assert after[("paella_device_memory_total_bytes", ())] == 16 << 30
    assert after[("paella_memory_waits_total", ())] == after[("paella_memory_failures_total", ())] == 0


@pytest.mark.skipif(shutil.which("curl") is None, reason="curl is not installed")
def test_curl_shows_the_metrics(metrics_daemon):
    r = subprocess.run(["curl", "-sf", f"http://127.0.0.1:{metrics_daemon.metrics_port}/metrics"],
                       capture_output=True, text=True, timeout=30)
    assert r.returncode == 0
    assert "\nnv_inference_request_success{model=\"echo\",version=\"1\"} " in r.stdout
    assert "paella_sm_occupancy{sm=\"0\"}" in r.stdout


def test_metrics_name_compiled_models_and_skip_profiling_runs(tmp_path):
    """A compiled model runs as dispatcher models of its own (one per variant, internal
    ids): its requests are still counted under the name its clients use. The profiling
    runs at start-up are nobody's requests: a fresh daemon reports none."""
    from bundles_for_tests import tiny_mlp
    from service_daemon import cleanup, free_port, start_daemon
    repo = tmp_path / "models"
    tiny_mlp(repo / "tiny_mlp")
    port = free_port()
    dp = start_daemon("--models", str(repo), "--metrics-port", str(port))
    try:
        m = lambda d, name, model: d.get((name, (("model", model), ("version", "1"))), 0.0)  # noqa: E731
        fresh = scrape(port)
        assert m(fresh, "nv_inference_request_success", "noop") == 0
        assert m(fresh, "nv_inference_exec_count", "tiny_mlp") == 0
        with paella.connect(dp.socket) as c:
            spec = c.models["tiny_mlp"].variants[0].inputs
            x = {t.name: np.ones(t.shape, t.dtype) for t in spec}
            for _ in range(3):
                c.infer("tiny_mlp", x, timeout=30)
        after = scrape(port)
        assert m(after, "nv_inference_request_success", "tiny_mlp") == 3
        assert m(after, "nv_inference_count", "tiny_mlp") == 3
        assert 1 <= m(after, "nv_inference_exec_count", "tiny_mlp") <= 3
        assert m(after, "paella_kernel_releases_total", "tiny_mlp") == 3 * 4   # 4 kernels each
        assert m(after, "nv_inference_request_duration_us", "tiny_mlp") > 0
        # The answer workers (issue 37): the warm-up's zeros and these ones, computed there.
        assert after[("paella_effect_workers", ())] >= 1
        assert after[("paella_effect_queue", ())] == 0
        assert after[("paella_effect_completed_total", ())] >= 2
        assert after[("paella_effect_failed_total", ())] == 0
    finally:
        cleanup(dp)


def test_status_into_a_pipe_its_reader_closed_is_no_traceback(metrics_daemon):
    """`paella status | head -1`: the reader is gone before the report is written."""
    import os
    r, w = os.pipe()
    os.close(r)
    try:
        p = subprocess.run([PAELLA, "status", "--socket", metrics_daemon.socket], stdout=w,
                           stderr=subprocess.PIPE, text=True, timeout=60)
    finally:
        os.close(w)
    assert p.returncode == 141 and "Traceback" not in p.stderr, p.stderr


def test_the_grafana_dashboard_queries_only_what_the_daemon_exports(metrics_daemon):
    """dist/grafana-paella.json parses, and every metric its queries name is one the
    daemon's live /metrics exports (after a request of a dispatcher model, so that
    every family has samples)."""
    import re
    dist = Path(__file__).resolve().parents[2] / "dist"
    dash = json.loads((dist / "grafana-paella.json").read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p.get("targets", ())]
    assert len(exprs) >= 10
    named = {m for e in exprs for m in re.findall(r"\b((?:nv|paella)_[a-z_]+)\b", e)}
    assert {"nv_inference_request_success", "paella_kernel_releases_total",
            "paella_sm_occupancy", "paella_notifq_depth", "paella_policy_fallbacks_total"} <= named
    with paella.connect(metrics_daemon.socket) as c:
        c.infer("noop", {"x": np.zeros(64, np.uint8)}, timeout=30)
    exported = {name for name, _ in scrape(metrics_daemon.metrics_port)}
    assert named <= exported, sorted(named - exported)
    scrape_cfg = (dist / "prometheus-paella.yml").read_text()
    assert "job_name: paella" in scrape_cfg and ":9464" in scrape_cfg
