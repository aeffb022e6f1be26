"""Client timeouts against a hung daemon: ``infer(timeout=)``, ``read_result(timeout=)``.

Two ways a daemon hangs: a socket that accepts and never answers (the handshake's own
timeout), and a real daemon stopped with SIGSTOP after the handshake (the request is on
its ring and nothing comes back)."""
from __future__ import annotations

import os
import signal
import socket
import tempfile
import time

import numpy as np
import pytest

import paella
from paella.client import ResultTimeout


def test_connect_to_a_socket_that_never_answers_times_out():
    d = tempfile.mkdtemp(prefix="plt", dir="/tmp")
    path = os.path.join(d, "mute.sock")
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(path)
    srv.listen(4)
    try:
        t0 = time.monotonic()
        with pytest.raises(paella.DaemonUnavailable, match="did not answer HELLO"):
            paella.connect(path, timeout=0.3)
        assert time.monotonic() - t0 < 3
    finally:
        srv.close()
        os.unlink(path)
        os.rmdir(d)


def test_a_full_accept_backlog_is_waited_for_until_the_timeout():
    """A Unix socket refuses a connect at once (EAGAIN) while its backlog is full: the
    client waits for room (here: the server accepts one after 0.2 s), and gives up with
    DaemonUnavailable only at its timeout."""
    import threading
    from paella.client.client import Client
    d = tempfile.mkdtemp(prefix="plt", dir="/tmp")
    path = os.path.join(d, "busy.sock")
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(path)
    srv.listen(0)
    queued = []
    try:
        while True:                       # fill the backlog
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.setblocking(False)
            try:
                s.connect(path)
            except BlockingIOError:
                s.close()
                break
            queued.append(s)
        t0 = time.monotonic()
        with pytest.raises(paella.DaemonUnavailable, match="Resource temporarily unavailable"):
            Client._dial(path, 0.3)
        assert 0.25 < time.monotonic() - t0 < 3          # waited, then gave up
        timer = threading.Timer(0.2, lambda: srv.accept()[0].close())
        timer.start()
        t0 = time.monotonic()
        Client._dial(path, 5.0).close()                   # room made meanwhile: connected
        assert 0.15 < time.monotonic() - t0 < 3
        timer.join()
    finally:
        for s in queued:
            s.close()
        srv.close()
        os.unlink(path)
        os.rmdir(d)


@pytest.mark.parametrize("mode", ["hybrid", "polling", "socket"])
def test_infer_and_read_result_time_out_on_a_stopped_daemon(fresh_daemon, mode):
    dp = fresh_daemon("--no-noop")
    x = np.arange(256, dtype=np.float32)
    with paella.connect(dp.socket, mode=mode) as c:
        assert np.array_equal(c.infer("echo", {"x": x}, timeout=10)["y"], x)
        os.kill(dp.pid, signal.SIGSTOP)
        try:
            t0 = time.monotonic()
            with pytest.raises(ResultTimeout, match="hung or stopped"):
                c.infer("echo", {"x": x + 1}, timeout=0.3)
            waited = time.monotonic() - t0
            assert 0.3 <= waited < 3, waited
            assert c.in_flight == 1                 # still in flight, region still held
            with pytest.raises(TimeoutError):       # ResultTimeout is a TimeoutError
                c.read_result(timeout=0.1)
            rid = c.predict("echo", c.models["echo"].variants[0].io_bytes,
                            c.alloc(c.models["echo"].variants[0].io_bytes))
        finally:
            os.kill(dp.pid, signal.SIGCONT)
        # The daemon resumes: the orphaned infer's completion is swallowed (its region
        # freed), the predict's comes back, and a new infer works.
        assert c.read_result(timeout=10) == rid
        assert c.in_flight == 0
        assert np.array_equal(c.infer("echo", {"x": x + 2}, timeout=10)["y"], x + 2)


def test_timeout_must_be_a_non_negative_number(daemon):
    with paella.connect(daemon.socket) as c:
        with pytest.raises(ValueError, match="timeout must be >= 0"):
            c.read_result(timeout=-1)
