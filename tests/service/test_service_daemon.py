"""End-to-end: a real ``paella serve`` process and real client processes."""
from __future__ import annotations

import errno
import os
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from paella import rings
from paella.client import (NONBLOCK, DaemonGone, DaemonUnavailable, NothingInFlight,
                           RequestFailed, UnknownModel, connect)

from service_daemon import PAELLA, run_client


def echo_ref(x: np.ndarray) -> np.ndarray:
    """CPU reference of the built-in echo model."""
    return x.astype(np.float32).copy()


def test_ready_notification_and_model_list(daemon):
    assert any(m.startswith("READY=1") and f"MAINPID={daemon.pid}" in m for m in daemon.messages)
    with connect(daemon.socket) as c:
        assert "echo" in c.models
        v = c.models["echo"].variants[0]
        assert v.io_bytes == 2048 and v.inputs[0].shape == (256,)
        assert "echo" in c.list_models()


def test_noop_takes_the_device_path(daemon):
    """The built-in noop model runs one kernel on the simulated GPU via the dispatcher."""
    with connect(daemon.socket) as c:
        info = c.models["noop"].variants[0]
        assert (info.io_bytes, info.outputs) == (64, ())
        off = c.alloc(64)
        ids = [c.predict("noop", 64, off) for _ in range(20)]
        assert sorted(c.read_result() for _ in ids) == ids
    assert "stepped from the dispatcher loop" in daemon.log()


def test_infer_matches_reference(daemon):
    rng = np.random.default_rng(0)
    with connect(daemon.socket) as c:
        for _ in range(50):
            x = rng.standard_normal(256).astype(np.float32)
            out = c.infer("echo", {"x": x})
            np.testing.assert_array_equal(out["y"], echo_ref(x))


def test_paper_api_zero_copy_and_nonblock(daemon):
    with connect(daemon.socket) as c:
        assert c.read_result(NONBLOCK) == -errno.EAGAIN       # nothing in flight
        with pytest.raises(NothingInFlight):
            c.read_result()                                   # returns at once, no hang
        off = c.alloc(2048)
        ins, outs = c.io_views("echo", off)
        ins["x"][:] = np.arange(256)
        rid = c.predict("echo", 2048, off)
        got = c.read_result(NONBLOCK)
        while got == -errno.EAGAIN:                           # poll the paper's way
            got = c.read_result(NONBLOCK)
        assert got == rid
        np.testing.assert_array_equal(outs["y"], np.arange(256, dtype=np.float32))
        assert c.read_result(NONBLOCK) == -errno.EAGAIN


@pytest.mark.parametrize("mode", ["hybrid", "polling", "socket"])
def test_every_wait_mode_gets_every_result(daemon, mode):
    with connect(daemon.socket, mode=mode) as c:
        offs = [c.alloc(2048) for _ in range(16)]
        for k, off in enumerate(offs):
            c.arena[off:off + 1024].view(np.float32)[:] = k
        ids = {c.predict("echo", 2048, off): k for k, off in enumerate(offs)}
        seen = set()
        for _ in offs:
            rid = c.read_result()
            seen.add(rid)
            off = offs[ids[rid]]
            assert (c.arena[off + 1024:off + 2048].view(np.float32) == ids[rid]).all()
        assert seen == set(ids)
        with pytest.raises(NothingInFlight):
            c.read_result()


def test_bad_requests_fail_with_the_daemons_reason(daemon):
    with connect(daemon.socket, arena_bytes=1 << 16) as c:
        with pytest.raises(UnknownModel, match="serves no model 'nope'"):
            c.predict("nope", 2048, 0)
        cases = [(dict(model=999, length=2048, io_offset=0), rings.E_MODEL, "no model"),
                 (dict(model="echo", length=2048, io_offset=(1 << 16) - 100), rings.E_RANGE,
                  "outside"),
                 (dict(model="echo", length=100, io_offset=0), rings.E_LENGTH, "needs 2048"),
                 (dict(model="echo", length=2048, io_offset=0, options=1 << 20), rings.E_OPTIONS,
                  "unknown option"),
                 (dict(model="echo", length=2048, io_offset=0, options=3), rings.E_OPTIONS,
                  "no variant 3")]
        for kw, status, text in cases:
            rid = c.predict(**kw)
            with pytest.raises(RequestFailed) as e:
                c.read_result()
            assert (e.value.req_id, e.value.status) == (rid, status)
            assert text in e.value.reason
        with pytest.raises(ValueError, match=r"shape \(256,\)"):
            c.infer("echo", {"x": np.zeros(300, np.float32)})        # too large an input
        np.testing.assert_array_equal(c.infer("echo", {"x": np.ones(256)})["y"], 1)


def test_segment_is_nameless_and_goes_with_the_client(daemon):
    """The segment is a memfd: in no file system (no /dev/shm entry anyone could
    open), mapped by the client and the daemon only, and gone from the daemon once
    the client leaves. (Its seals: test_hostile_frontend.py.)"""
    c = connect(daemon.socket)
    assert c.segment_name == f"memfd:paella.{daemon.pid}.{c.client_id}"
    name = c.segment_name.removeprefix("memfd:")
    assert not [n for n in os.listdir("/dev/shm") if n.startswith(f"paella.{daemon.pid}.")]
    with open("/proc/self/maps") as f:
        assert f"/memfd:{name} (deleted)" in f.read()
    assert name in daemon.segments()
    c.close()
    deadline = time.monotonic() + 5
    while name in daemon.segments() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert name not in daemon.segments()


CLIENT_LOOP = """
import numpy as np, sys
from paella.client import connect
c = connect(SOCK, mode=MODE)
rng = np.random.default_rng(SEED)
for i in range(N):
    x = rng.standard_normal(256).astype(np.float32)
    y = c.infer("echo", {"x": x})["y"]
    assert np.array_equal(y, x), i
print("ok", N)
"""


def test_many_concurrent_client_processes(daemon):
    procs = []
    for k in range(8):
        code = CLIENT_LOOP.replace("MODE", repr(("hybrid", "polling", "socket")[k % 3]))
        code = code.replace("SEED", str(k)).replace("N)", "300)").replace("range(N)", "range(300)")
        procs.append(subprocess.Popen([sys.executable, "-c", f"SOCK = {daemon.socket!r}\n" + code],
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    for p in procs:
        out, err = p.communicate(timeout=120)
        assert p.returncode == 0, err
        assert out.strip() == "ok 300"
    assert daemon.proc.poll() is None


def test_threads_may_share_a_client(daemon):
    errors = []
    with connect(daemon.socket) as c:
        def work(seed: int) -> None:
            rng = np.random.default_rng(seed)
            try:
                for _ in range(100):
                    x = rng.standard_normal(256).astype(np.float32)
                    assert np.array_equal(c.infer("echo", {"x": x})["y"], x)
            except Exception as e:  # noqa: BLE001 - reported by the assert below
                errors.append(e)
        ts = [threading.Thread(target=work, args=(s,)) for s in range(4)]
        for t in ts:
            t.start()
        for t in ts:
            t.join(60)
        assert not errors
        assert c.in_flight == 0


KILLABLE = """
import numpy as np, sys
from paella.client import connect
c = connect(SOCK)
off = [c.alloc(2048) for _ in range(64)]
print(c.segment_name, flush=True)
while True:                       # keep requests in flight until SIGKILL
    for o in off:
        c.predict("echo", 2048, o)
    for _ in off:
        c.read_result()
"""


def test_sigkilled_clients_leak_nothing_and_others_keep_working(daemon):
    names = []
    for _ in range(10):
        p = subprocess.Popen([sys.executable, "-c", f"SOCK = {daemon.socket!r}\n" + KILLABLE],
                             stdout=subprocess.PIPE, text=True)
        names.append(p.stdout.readline().strip())
        time.sleep(0.05)
        p.send_signal(signal.SIGKILL)
        p.wait()
        p.stdout.close()
    assert all(n.startswith(f"memfd:paella.{daemon.pid}.") for n in names)
    names = [n.removeprefix("memfd:") for n in names]
    deadline = time.monotonic() + 5
    while set(names) & set(daemon.segments()) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert set(names) & set(daemon.segments()) == set()
    with connect(daemon.socket) as c:
        np.testing.assert_array_equal(c.infer("echo", {"x": np.full(256, 3.0)})["y"], 3.0)
    assert "dropped: disconnected" in daemon.log()


def test_sigterm_drains_and_exits_zero(fresh_daemon):
    dp = fresh_daemon()
    c = connect(dp.socket)
    assert len(dp.segments()) == 1
    off = c.alloc(2048)
    for _ in range(32):
        c.predict("echo", 2048, off)
    dp.proc.send_signal(signal.SIGTERM)
    assert dp.proc.wait(15) == 0
    done = 0
    while True:                        # everything submitted before SIGTERM is answered
        try:
            c.read_result()
            done += 1
        except RequestFailed as e:
            assert "shutting down" in e.reason
            done += 1
        except (NothingInFlight, DaemonGone):
            break
    assert done == 32
    assert dp.segments() == []
    assert not os.path.exists(dp.socket) and not os.path.exists(dp.socket + ".lock")
    assert "STOPPING=1" in "".join(dp.recv_notify(1.0))
    assert "stopped cleanly" in dp.log()
    with pytest.raises(DaemonUnavailable, match="no paella daemon"):
        connect(dp.socket)
    c.close()


def test_second_daemon_is_refused_and_stale_socket_reused(fresh_daemon):
    first = fresh_daemon()
    second = subprocess.run([*PAELLA, "--socket", first.socket,
                             "--cpu", "none", "--rt-priority", "0"],
                            capture_output=True, text=True, timeout=30)
    assert second.returncode == 2
    assert f"another paella daemon (pid {first.pid}) is already serving" in second.stderr
    with connect(first.socket) as c:                      # the first one is unharmed
        assert c.infer("echo", {"x": np.ones(256)})["y"][0] == 1
    first.proc.kill()                                     # leaves a stale socket file
    first.proc.wait()
    assert os.path.exists(first.socket)
    third = fresh_daemon(sock_dir=first.dir)
    with connect(third.socket) as c:
        assert c.infer("echo", {"x": np.ones(256)})["y"][0] == 1


def test_dead_daemon_gives_an_error_not_a_hang(fresh_daemon):
    dp = fresh_daemon()
    c = connect(dp.socket)
    off = c.alloc(2048)
    dp.proc.kill()
    dp.proc.wait()
    with pytest.raises(DaemonGone):
        c.predict("echo", 2048, off)
        c.read_result()
    c.close()


def test_access_control_by_peer_credentials(fresh_daemon):
    """A client of another uid is refused unless allowed; when allowed, it maps the
    0600 root-owned segment through the descriptor passed over the socket."""
    if os.geteuid() != 0:
        pytest.skip("needs root to run a client as another user")
    code = """
import os
import numpy as np
from paella.client import connect, DaemonUnavailable
os.setgid(65534); os.setuid(65534)   # after the imports: the interpreter lives under /root
try:
    c = connect(SOCK)
except DaemonUnavailable as e:
    print("refused:", e); raise SystemExit
print("served", c.infer("echo", {"x": np.full(256, 7.0)})["y"][0])
"""
    closed = fresh_daemon()
    os.chmod(closed.dir, 0o755)
    r = run_client(code, closed.socket)
    assert "refused: the daemon refused the connection: forbidden" in r.stdout, r.stderr
    opened = fresh_daemon("--allow-user", "nobody")
    os.chmod(opened.dir, 0o755)
    r = run_client(code, opened.socket)
    assert "served 7.0" in r.stdout, r.stderr


def test_pinning_and_priority_are_logged(fresh_daemon):
    dp = fresh_daemon("--cpu", "auto", "--rt-priority", "1", polite=False)
    log = dp.log()
    assert "dispatcher loop pinned to core" in log
    assert ("running SCHED_FIFO priority 1" in log) or ("not permitted" in log)
    with connect(dp.socket) as c:
        assert c.infer("echo", {"x": np.ones(256)})["y"][0] == 1


def test_sighup_reloads(fresh_daemon, tmp_path):
    repo = tmp_path / "models"
    repo.mkdir()
    dp = fresh_daemon("--models", str(repo))
    dp.proc.send_signal(signal.SIGHUP)
    deadline = time.monotonic() + 10
    while "RELOADING=1" not in "".join(dp.recv_notify(0.2)) and time.monotonic() < deadline:
        pass
    assert dp.log().count("serving 2 model(s): echo, noop") == 2
    with connect(dp.socket) as c:
        assert c.infer("echo", {"x": np.ones(256)})["y"][0] == 1


def test_spin_mode_serves(fresh_daemon):
    dp = fresh_daemon("--idle", "spin")
    with connect(dp.socket) as c:
        for _ in range(20):
            assert c.infer("echo", {"x": np.ones(256)})["y"][0] == 1
    assert dp.stop() == 0
