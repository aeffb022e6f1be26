"""Model control against a real daemon (``paella model``: REPOSITORY_INDEX, LOAD, UNLOAD):
the index lists served and unserved models; an unloaded model is refused as unknown while
the others serve, and a request in flight during the unload is answered once; a LOAD
brings it back, and an unload holds across a reload until then; who may; hostile names;
concurrent LOADs of one model."""
from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from bundles_for_tests import make_slow_loading, make_slow_running, set_dtype, tiny_mlp
from paella import rings, wire
from paella.client import DaemonError, NothingInFlight, RequestFailed, UnknownModel, connect
from paella.client import repository
from paella.client.control import ask
from paella.client.status import daemon_status
from service_daemon import cleanup, start_daemon

PAELLA = str(Path(sys.executable).with_name("paella"))
X = np.ones((2, 16), np.float32)                 # the tiny MLP's input


@pytest.fixture(scope="module")
def mlp(tmp_path_factory) -> Path:
    """The tiny MLP, compiled once; tests copy it."""
    return tiny_mlp(tmp_path_factory.mktemp("mlp") / "tiny_mlp")


@pytest.fixture(scope="module")
def repo(tmp_path_factory, mlp) -> Path:
    """tiny_mlp and other (good), broken (an unknown dtype), notes (a folder that is not
    a model) and README (a file)."""
    repo = tmp_path_factory.mktemp("repo")
    for name in ("tiny_mlp", "other", "broken"):
        shutil.copytree(mlp, repo / name)
    set_dtype(repo / "broken", "bogus")
    (repo / "notes").mkdir()
    (repo / "README").write_text("not a model\n")
    return repo


@pytest.fixture(scope="module")
def daemon(repo):
    """The repository served; control_users names only another uid (the owner, root
    here, may still), and uid 65534 (nobody) may connect."""
    dp = start_daemon("--models", str(repo), "--control-user", "12345", "--allow-user", "nobody")
    os.chmod(dp.dir, 0o755)                              # (nobody reaches the socket)
    yield dp
    cleanup(dp)


def states(sock: str) -> dict[str, tuple[str, str]]:
    return {m["name"]: (m["state"], m["reason"]) for m in repository.index(sock)}


def raw(sock: str, frame: bytes) -> tuple[int, dict]:
    """One frame sent on a connection of its own, and the first frame answered."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(20)
    s.connect(sock)
    try:
        s.sendall(frame)
        r = wire.FrameReader()
        while True:
            data = s.recv(65536)
            assert data, "the daemon closed the connection without an answer"
            frames = r.feed(data)
            if frames:
                return frames[0]
    finally:
        s.close()


def serves_echo(sock: str) -> None:
    with connect(sock) as c:
        x = np.arange(256, dtype=np.float32)
        np.testing.assert_array_equal(c.infer("echo", {"x": x}, timeout=30)["y"], x)


def test_the_index_lists_served_and_unserved_models(daemon, repo):
    got = repository.index(daemon.socket)
    assert [m["name"] for m in got] == ["broken", "other", "tiny_mlp"]   # not notes, README
    assert all(m["version"] == "1" and set(m) == {"name", "version", "state", "reason"}
               for m in got)
    st = states(daemon.socket)
    assert st["tiny_mlp"] == ("READY", "") and st["other"] == ("READY", "")
    assert st["broken"][0] == "UNAVAILABLE" and "'bogus'" in st["broken"][1]
    shutil.copytree(repo / "tiny_mlp", repo / "late")     # added after the daemon started
    try:
        late = states(daemon.socket)["late"]
        assert late[0] == "UNAVAILABLE" and "not loaded" in late[1], late
    finally:
        shutil.rmtree(repo / "late")
    r = subprocess.run([PAELLA, "model", "index", "--socket", daemon.socket],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[0].split() == ["NAME", "VERSION", "STATE", "REASON"]
    assert lines[3].split() == ["tiny_mlp", "1", "READY"]
    r = subprocess.run([PAELLA, "model", "index", "--json", "--socket", daemon.socket],
                       capture_output=True, text=True, timeout=60)
    assert json.loads(r.stdout) == got


def test_unload_refuses_the_model_while_another_serves_and_load_brings_it_back(daemon):
    with connect(daemon.socket) as c:
        np.testing.assert_array_equal(c.infer("tiny_mlp", {"x": X})["output0"].shape, (2, 8))
        assert repository.unload("tiny_mlp", daemon.socket) is None
        with pytest.raises(RequestFailed) as e:          # (this client's list predates it)
            c.infer("tiny_mlp", {"x": X}, timeout=30)
        assert e.value.status == rings.E_MODEL and "no model with id" in e.value.reason
        assert c.infer("other", {"x": X}, timeout=30)["output0"].shape == (2, 8)
        with connect(daemon.socket) as fresh:
            assert "tiny_mlp" not in fresh.models and "other" in fresh.models
            with pytest.raises(UnknownModel):
                fresh.infer("tiny_mlp", {"x": X})
        assert states(daemon.socket)["tiny_mlp"] == ("UNAVAILABLE", "unloaded")
        with pytest.raises(DaemonError) as e:            # not loaded: nothing to unload
            repository.unload("tiny_mlp", daemon.socket)
        assert e.value.code == "unknown_model" and "unloaded" in e.value.message
        assert repository.load("tiny_mlp", daemon.socket) is None
        assert states(daemon.socket)["tiny_mlp"] == ("READY", "")
        # The name keeps its id: the old connection's list is right again.
        assert c.infer("tiny_mlp", {"x": X}, timeout=30)["output0"].shape == (2, 8)
    assert "UNLOAD tiny_mlp: not served any more" in daemon.log()
    assert "LOAD tiny_mlp: served" in daemon.log()


def test_the_command_line_loads_and_unloads(daemon):
    def model(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([PAELLA, "model", *args, "--socket", daemon.socket],
                              capture_output=True, text=True, timeout=120)
    r = model("unload", "other")
    assert r.returncode == 0 and r.stdout.startswith("unloaded other"), r.stderr
    r = model("unload", "other")                          # the daemon refuses: exit 1
    assert r.returncode == 1 and r.stderr.startswith("paella: error: unknown_model: "), r.stderr
    r = model("load", "other")
    assert r.returncode == 0 and r.stdout.strip() == "loaded other", r.stderr
    r = model("load", "broken")
    assert r.returncode == 1 and "load_failed" in r.stderr and "'bogus'" in r.stderr
    assert "Traceback" not in r.stderr
    r = subprocess.run([PAELLA, "model", "load", "x", "--socket", daemon.socket + ".none"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "no paella daemon answers" in r.stderr   # no daemon: exit 2


def _repository_reads(dp) -> int:
    return dp.log().count("SIGHUP: repository read")


def _reload(dp) -> None:
    """SIGHUP, and wait until the reload is swapped in."""
    reads = _repository_reads(dp)
    dp.proc.send_signal(signal.SIGHUP)
    deadline = time.monotonic() + 30
    while _repository_reads(dp) == reads:
        assert time.monotonic() < deadline, dp.log()
        time.sleep(0.05)


def test_an_unload_holds_across_reloads_until_a_load(daemon):
    repository.unload("other", daemon.socket)
    _reload(daemon)
    assert "1 unloaded by UNLOAD and skipped" in daemon.log()
    assert "other" not in {m["name"] for m in daemon_status(daemon.socket)["models"]}
    assert states(daemon.socket)["other"] == ("UNAVAILABLE", "unloaded")
    repository.load("other", daemon.socket)
    _reload(daemon)
    assert states(daemon.socket)["other"] == ("READY", "")
    with connect(daemon.socket) as c:
        assert c.infer("other", {"x": X}, timeout=30)["output0"].shape == (2, 8)


@pytest.mark.parametrize("op, name, code, text", [
    ("load", "nosuch", "unknown_model",
     "has no folder 'nosuch'; its model folders: broken, other, tiny_mlp"),
    ("load", "README", "unknown_model", "has no folder 'README'"),
    ("load", "notes", "unknown_model",
     "notes is not a model folder (no manifest.json in it or in a version subfolder, and no "
     "config.toml); its model folders: broken, other, tiny_mlp"),
    ("load", "broken", "load_failed", "broken is not served: variant 'default': tensor 'x' "
                                      "has dtype 'bogus'"),
    ("unload", "broken", "unknown_model", "the daemon serves no model 'broken' (UNAVAILABLE: "),
    ("unload", "nosuch", "unknown_model", "the daemon serves no model 'nosuch'; nothing to "
                                          "unload (served from its repository: other, tiny_mlp)"),
    ("load", "echo", "builtin", "echo is a built-in model of the daemon"),
    ("unload", "noop", "builtin", "`paella serve --no-noop` serves without it"),
])
def test_what_cannot_be_loaded_or_unloaded_is_a_clear_error(daemon, op, name, code, text):
    with pytest.raises(DaemonError) as e:
        getattr(repository, op)(name, daemon.socket)
    assert e.value.code == code and text in e.value.message, e.value
    assert states(daemon.socket)["tiny_mlp"] == ("READY", "")
    serves_echo(daemon.socket)


LONG = "x" * 60_000


@pytest.mark.parametrize("kind", [wire.LOAD, wire.UNLOAD], ids=["LOAD", "UNLOAD"])
@pytest.mark.parametrize("payload, code, text", [
    ({}, "bad_field", "needs the field 'name'"),
    ({"name": 3}, "bad_field", "field 'name' must be a string"),
    ({"name": None}, "bad_field", "field 'name' must be a string"),
    ({"name": ["tiny_mlp"]}, "bad_field", "field 'name' must be a string"),
    ({"name": "tiny_mlp", "path": "/etc"}, "bad_field", "has no field 'path'"),
    ({"name": ""}, "bad_name", "it is empty"),
    ({"name": "."}, "bad_name", "it is a path"),
    ({"name": ".."}, "bad_name", "it is a path"),
    ({"name": "../tiny_mlp"}, "bad_name", "it is a path"),
    ({"name": "tiny_mlp/../other"}, "bad_name", "it is a path"),
    ({"name": "/etc"}, "bad_name", "it is a path"),
    ({"name": ".hidden"}, "bad_name", "starts with '.'"),
    ({"name": "a\x00b"}, "bad_name", "control characters"),
    ({"name": "tiny_mlp\n"}, "bad_name", "control characters or surrounding spaces"),
    ({"name": " tiny_mlp"}, "bad_name", "surrounding spaces"),
    ({"name": "\ud800"}, "bad_name", "not a valid file name"),
    ({"name": "x" * 256}, "bad_name", "256 bytes long; a model folder's name has at most 255"),
    ({"name": "\u00e9" * 128}, "bad_name", "256 bytes long"),
    ({"name": LONG}, "bad_name", "60000 bytes long"),
], ids=lambda v: None)
def test_hostile_names_are_refused_and_the_daemon_serves_on(daemon, kind, payload, code, text):
    body = json.dumps(payload).encode()                  # (json escapes the lone surrogate)
    kind_got, msg = raw(daemon.socket, wire.HEADER.pack(kind, 0, len(body)) + body)
    assert kind_got == wire.ERROR and msg["error"] == code and text in msg["message"], msg
    assert len(msg["message"]) < 400                     # a huge name is not echoed whole
    assert states(daemon.socket)["tiny_mlp"] == ("READY", "")
    serves_echo(daemon.socket)


def test_a_name_past_the_frame_limit_drops_only_that_connection(daemon):
    body = json.dumps({"name": "x" * wire.MAX_CLIENT_PAYLOAD}).encode()
    kind, msg = raw(daemon.socket, wire.HEADER.pack(wire.LOAD, 0, len(body)) + body)
    assert kind == wire.ERROR and msg["error"] == "too_large", msg
    serves_echo(daemon.socket)


_AS_NOBODY = """
import json, os, socket, sys
from paella import wire
os.setresuid(-1, 65534, -1)                  # SO_PEERCRED: the uid at connect
s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
s.connect(sys.argv[1])
os.setresuid(-1, 0, -1)
s.sendall(wire.encode(int(sys.argv[2]), json.loads(sys.argv[3])))
s.settimeout(20)
r = wire.FrameReader()
while True:
    for kind, msg in r.feed(s.recv(65536)):
        print(json.dumps([wire.NAMES[kind], msg]))
        sys.exit(0)
"""


def _as_nobody(sock: str, kind: int, payload: dict) -> tuple[str, dict]:
    r = subprocess.run([sys.executable, "-c", _AS_NOBODY, sock, str(kind), json.dumps(payload)],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    name, msg = json.loads(r.stdout)
    return name, msg


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to connect as another uid")
@pytest.mark.parametrize("kind", [wire.LOAD, wire.UNLOAD], ids=["LOAD", "UNLOAD"])
def test_a_user_not_in_control_users_is_refused_with_the_setting_to_change(daemon, kind):
    name, msg = _as_nobody(daemon.socket, kind, {"name": "tiny_mlp"})
    assert name == "ERROR" and msg["error"] == "permission", msg
    assert "[access] control_users" in msg["message"] and "uid 65534" in msg["message"]
    assert states(daemon.socket)["tiny_mlp"] == ("READY", "")
    # The index only reads: every admitted client may ask for it.
    name, msg = _as_nobody(daemon.socket, wire.REPOSITORY_INDEX, {})
    assert name == "REPOSITORY_INDEX_REPLY" and len(msg["models"]) == 3


def test_the_permission_check_takes_users_uids_and_groups(tmp_path):
    from paella.dispatcher.frontend import ClientConn, Frontend, FrontendConfig, FrontendError
    from paella.dispatcher.frontend import ModelTable

    def front(*who) -> Frontend:
        return Frontend(FrontendConfig(str(tmp_path / "p.sock"), control_users=who),
                        ModelTable())

    def peer(uid: int, gid: int) -> ClientConn:
        return ClientConn(1, None, 2 ** 22 + 7, uid, gid)   # (no such pid: its gid alone)
    default = front()
    assert default.may_control(peer(os.geteuid(), 4242)) and default.may_control(peer(0, 0))
    assert not default.may_control(peer(65534, 65534))
    assert front("nobody").may_control(peer(65534, 4242))
    assert front(65534).may_control(peer(65534, 4242))
    assert front("12345").may_control(peer(12345, 4242))
    group = front("@nogroup")
    assert group.may_control(peer(4242, 65534)) and not group.may_control(peer(4242, 4243))
    with pytest.raises(FrontendError, match=r"\[access\] control_users: there is no user"):
        front("no_such_user_x")


def test_control_users_in_the_config_file(tmp_path):
    from paella.dispatcher.daemon.config import ConfigError, load_config
    p = tmp_path / "paella.toml"
    p.write_text('[access]\ncontrol_users = ["ops", "@admins", 1000]\n')
    cfg = load_config(str(p))
    cfg.check()
    assert cfg.control_users == ["ops", "@admins", 1000]
    for bad in ('["a b"]', "[-1]", '["@"]', '["x/y"]'):
        p.write_text(f"[access]\ncontrol_users = {bad}\n")
        with pytest.raises(ConfigError, match="control_users must list user names, uids or"):
            load_config(str(p)).check()


def test_a_request_in_flight_during_unload_is_answered_once(tmp_path, mlp):
    """Four requests of about a second each on the simulated GPU when UNLOAD comes: the
    unload answers at once (UNLOADING: they still run), each request completes exactly
    once and OK, a new one is refused as for an unknown model, echo serves throughout,
    and the model is UNAVAILABLE once they are done."""
    repo = tmp_path / "models"
    repo.mkdir()
    shutil.copytree(mlp, repo / "slow_mlp")
    make_slow_running(repo / "slow_mlp", kernel_seconds=0.2)
    dp = start_daemon("--models", str(repo), "--no-noop")
    try:
        c = connect(dp.socket)
        n = c.models["slow_mlp"].variants[0].io_bytes
        ids = [c.predict("slow_mlp", n, c.alloc(n)) for _ in range(4)]
        end = time.monotonic() + 20
        while sum(m["in_flight"] for m in daemon_status(dp.socket)["models"]
                  if m["name"] == "slow_mlp") < len(ids):
            assert time.monotonic() < end, dp.log()
            time.sleep(0.02)
        t0 = time.monotonic()
        msg, _ = ask(wire.encode(wire.UNLOAD, {"name": "slow_mlp"}), wire.UNLOAD_REPLY, dp.socket)
        assert time.monotonic() - t0 < 1.0
        assert msg["model"]["state"] == "UNLOADING", msg
        serves_echo(dp.socket)
        late = c.predict(c.models["slow_mlp"].model_id, n, c.alloc(n))
        got: dict[int, list] = {}
        while True:                          # every completion until none is in flight
            try:
                got.setdefault(c.read_result(timeout=30), []).append((rings.OK, ""))
            except RequestFailed as e:
                got.setdefault(e.req_id, []).append((e.status, e.reason))
            except NothingInFlight:
                break
        assert sorted(got) == sorted(ids + [late])
        assert all(len(v) == 1 for v in got.values()), got          # each answered once
        assert all(got[i][0][0] == rings.OK for i in ids), got
        assert got[late][0][0] == rings.E_MODEL and "no model with id" in got[late][0][1]
        deadline = time.monotonic() + 20
        while states(dp.socket)["slow_mlp"][0] != "UNAVAILABLE":
            assert time.monotonic() < deadline, dp.log()
            time.sleep(0.05)
        assert states(dp.socket)["slow_mlp"] == ("UNAVAILABLE", "unloaded")
        assert daemon_status(dp.socket)["dispatcher"]["models"] == 0  # its variants freed
        c.close()
    finally:
        cleanup(dp)


def test_loads_of_one_model_run_one_at_a_time(tmp_path, mlp):
    """Three LOADs of a model that takes 1.5 s to read: the first runs; the second,
    asked during it, waits and then reads the folder again; the third, asked while the
    second waits, shares the second's load and answer. Meanwhile the index says
    LOADING and the daemon serves."""
    repo = tmp_path / "models"
    repo.mkdir()
    shutil.copytree(mlp, repo / "slow")
    dp = start_daemon("--models", str(repo), "--no-noop")
    try:
        repository.unload("slow", dp.socket)
        make_slow_loading(repo / "slow", seconds=1.5)
        done: dict[int, float] = {}
        errors: list = []

        def one(k: int) -> None:
            try:
                repository.load("slow", dp.socket, timeout=60)
                done[k] = time.monotonic()
            except Exception as e:  # noqa: BLE001 - reported below
                errors.append(e)
        threads = [threading.Thread(target=one, args=(k,)) for k in range(3)]
        for t in threads:
            t.start()
            time.sleep(0.3)
        assert states(dp.socket)["slow"][0] == "LOADING"
        serves_echo(dp.socket)
        for t in threads:
            t.join(60)
        assert not errors and len(done) == 3, errors
        assert done[1] >= done[0] and abs(done[2] - done[1]) < 0.5, done
        log = dp.log()
        assert log.count("LOAD slow: reading") == 2, log
        assert log.index("LOAD slow: served") < log.rindex("LOAD slow: reading")
        assert states(dp.socket)["slow"] == ("READY", "")
        with connect(dp.socket) as c:
            assert c.infer("slow", {"x": X}, timeout=30)["output0"].shape == (2, 8)
    finally:
        cleanup(dp)


def test_an_index_larger_than_the_socket_buffer_arrives_whole(tmp_path, mlp):
    """1,200 model folders with long names (a config.toml and no bundle: each not served,
    with its reason): the index (~350 KB) does not fit the socket at once; the rest goes
    out as the client reads, then the connection is closed. Nothing is left open."""
    repo = tmp_path / "models"
    repo.mkdir()
    shutil.copytree(mlp, repo / "tiny_mlp")
    for k in range(1200):
        folder = repo / f"m{k:04d}{'_' * 110}"
        folder.mkdir()
        (folder / "config.toml").write_text("")
    dp = start_daemon("--models", str(repo), "--no-noop", "--log-level", "warning")
    try:
        sockets = sum("socket:" in t for t in dp.fds())
        got = repository.index(dp.socket)
        assert len(json.dumps(got)) > 300_000          # (a Unix socket takes ~210 KB at once)
        assert len(got) == 1201 and got[-1] == {"name": "tiny_mlp", "version": "1",
                                                 "state": "READY", "reason": ""}
        assert all(m["state"] == "UNAVAILABLE" and "config.toml but no bundle" in m["reason"]
                   for m in got[:-1])
        assert repository.index(dp.socket) == got
        serves_echo(dp.socket)
        deadline = time.monotonic() + 10                 # the answered connections are gone
        while sum("socket:" in t for t in dp.fds()) > sockets:
            assert time.monotonic() < deadline, dp.fds()
            time.sleep(0.05)
    finally:
        cleanup(dp)


def test_a_daemon_without_a_repository_lists_nothing_and_loads_nothing():
    dp = start_daemon("--no-noop")
    try:
        assert repository.index(dp.socket) == []
        with pytest.raises(DaemonError) as e:
            repository.load("tiny_mlp", dp.socket)
        assert e.value.code == "no_repository" and "--models DIR" in e.value.message
    finally:
        cleanup(dp)
