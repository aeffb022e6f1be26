"""``paella trace`` against a real daemon: two models, two clients, a two-second trace in
the Trace Event format; who may take one; bad TRACE messages."""
from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections import defaultdict
from pathlib import Path

import numpy as np
import pytest

import paella
from paella import wire
from service_daemon import cleanup, start_daemon

PAELLA = str(Path(sys.executable).with_name("paella"))


@pytest.fixture(scope="module")
def traced():
    """A daemon serving noop and the tiny MLP, letting uid 65534 (nobody) connect."""
    from paella.compiler_pass.build import compile_bundle
    from paella.models.tiny import tiny_mlp
    repo = tempfile.mkdtemp(prefix="plrepo")
    compile_bundle(tiny_mlp(), os.path.join(repo, "tiny_mlp"))
    dp = start_daemon("--models", repo, "--allow-user", "nobody")
    os.chmod(dp.dir, 0o755)                              # (nobody reaches the socket)
    yield dp
    cleanup(dp)
    shutil.rmtree(repo, ignore_errors=True)


def _client(sock: str, model: str, stop: threading.Event, answered: list) -> None:
    with paella.connect(sock) as c:
        info = c.models[model].variants[0]
        x = {t.name: np.zeros(t.shape, t.dtype) for t in info.inputs}
        while not stop.is_set():
            c.infer(model, x, timeout=30)
            answered.append(time.monotonic())
            time.sleep(0.003)


def test_a_trace_of_two_models_and_two_clients_is_a_valid_timeline(traced, tmp_path):
    stop = threading.Event()
    answered: dict[str, list] = {"noop": [], "tiny_mlp": []}
    clients = [threading.Thread(target=_client, args=(traced.socket, m, stop, answered[m]))
               for m in answered]
    for t in clients:
        t.start()
    try:
        time.sleep(0.3)                                  # both clients under way
        out = tmp_path / "trace.json"
        r = subprocess.run([PAELLA, "trace", "--socket", traced.socket, "--seconds", "2",
                            "-o", str(out)], capture_output=True, text=True, timeout=120)
    finally:
        stop.set()
        for t in clients:
            t.join(60)
    assert r.returncode == 0, r.stderr
    assert "request(s)" in r.stdout and "perfetto" in r.stdout
    doc = json.loads(out.read_text())
    events = doc["traceEvents"]
    assert doc["otherData"]["truncated"] is False
    for e in events:                                     # the Trace Event format
        assert e["ph"] in ("X", "B", "E", "i", "C", "s", "f", "M"), e
        assert type(e["pid"]) is int and type(e["tid"]) is int, e
        if e["ph"] != "M":
            assert isinstance(e["ts"], (int, float)), e
        if e["ph"] == "X":
            assert e["dur"] >= 0, e
    requests = {(e["args"]["client"], e["args"]["request"]): e
                for e in events if e.get("cat") == "request"}
    kernels = [e for e in events if e.get("cat") == "kernel"]
    # (the dispatcher's names: a bundle's carry its generation and variant, tiny_mlp#1/default)
    models = {e["args"]["model"].split("#")[0] for e in requests.values()}
    assert models == {"noop", "tiny_mlp"}, models
    # Every answered request has one slice (its key is unique), and about as many were
    # answered in the window as the clients saw (they run on: no exact count).
    assert len(requests) == sum(1 for e in events if e.get("cat") == "request")
    assert len(requests) >= 20
    # Every kernel lies inside the slice of each of its job's requests (when that request
    # was answered within the trace).
    inside = 0
    for k in kernels:
        for key in map(tuple, k["args"]["requests"]):
            q = requests.get(key)
            if q is not None:
                assert q["ts"] <= k["ts"] and k["ts"] + k["dur"] <= q["ts"] + q["dur"] + 1e-3, \
                    (q, k)
                inside += 1
    assert inside >= len(requests) // 2
    # No two kernels overlap on one stream.
    by_stream = defaultdict(list)
    for k in kernels:
        by_stream[k["tid"]].append((k["ts"], k["ts"] + k["dur"]))
    for spans in by_stream.values():
        spans.sort()
        for (a0, a1), (b0, b1) in zip(spans, spans[1:]):
            assert b0 >= a1 - 1e-3, (a0, a1, b0, b1)
    # Flow arrows pair up, from a request lane to a stream.
    starts = {e["id"]: e for e in events if e["ph"] == "s"}
    ends = {e["id"]: e for e in events if e["ph"] == "f"}
    assert starts and starts.keys() == ends.keys()
    assert any(e["name"] == "pick" for e in events if e["ph"] == "i")


_AS_NOBODY = """
import os, socket, sys
from paella import wire
os.setresuid(-1, 65534, -1)                  # SO_PEERCRED: the uid at connect
s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
s.connect(sys.argv[1])
os.setresuid(-1, 0, -1)
s.sendall(wire.encode(wire.TRACE, {"milliseconds": 500}))
s.settimeout(20)
r = wire.FrameReader()
while True:
    for kind, msg in r.feed(s.recv(65536)):
        print(wire.NAMES[kind], msg.get("error"), msg.get("message"))
        sys.exit(0)
"""


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to connect as another uid")
def test_a_user_other_than_the_owner_is_refused_with_the_reason(traced):
    r = subprocess.run([sys.executable, "-c", _AS_NOBODY, traced.socket], capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("ERROR forbidden"), r.stdout
    assert "trace_users" in r.stdout and "uid 65534" in r.stdout
    assert traced.proc.poll() is None


def _ask(sock: str, frame: bytes) -> tuple[int, dict]:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(20)
    s.connect(sock)
    try:
        s.sendall(frame)
        r = wire.FrameReader()
        while True:
            frames = r.feed(s.recv(65536))
            if frames:
                return frames[0]
    finally:
        s.close()


@pytest.mark.parametrize("payload", [{"milliseconds": 0}, {"milliseconds": 600_001},
                                     {"milliseconds": 1.5}, {"milliseconds": True}, {},
                                     {"milliseconds": 10, "path": "/etc/passwd"}])
def test_bad_trace_requests_get_a_clear_error(traced, payload):
    kind, msg = _ask(traced.socket, wire.encode(wire.TRACE, payload))
    assert kind == wire.ERROR and msg["error"] == "bad_field", msg
    with paella.connect(traced.socket) as c:             # and everyone is still served
        assert c.infer("noop", {"x": np.zeros(64, np.uint8)}, timeout=30) is not None


def test_more_traces_at_once_than_allowed_are_refused_busy(traced, tmp_path):
    from paella.client.errors import DaemonError
    from paella.client.trace import take_trace
    from paella.dispatcher.daemon.traces import MAX_SESSIONS
    results: list = []

    def one(i: int) -> None:
        try:
            results.append(take_trace(str(tmp_path / f"t{i}.json"), 1.5, traced.socket))
        except DaemonError as e:
            results.append(e)
    threads = [threading.Thread(target=one, args=(i,)) for i in range(MAX_SESSIONS + 1)]
    for t in threads:
        t.start()
        time.sleep(0.1)
    for t in threads:
        t.join(60)
    busy = [r for r in results if isinstance(r, DaemonError)]
    assert len(busy) == 1 and busy[0].code == "busy", results
    assert sum(1 for r in results if isinstance(r, dict)) == MAX_SESSIONS
