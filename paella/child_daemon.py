"""A daemon as a child process: ``paella serve`` on a private socket, started and stopped
by a launcher (the demo, the experiments and benchmarks that time a real daemon, tests).

:func:`start_daemon` returns once the daemon says ``READY=1`` over a notify socket of its
own (sd_notify, as under systemd), so the caller never races its start-up; the socket
stays open, because the daemon reports reloads (``READY=1`` again) and ``STOPPING=1`` on
it too (:func:`notify_socket`). The child ends with its launcher (:mod:`.parent_death`).
"""
from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from typing import Callable

from paella.parent_death import end_with_parent

#: The daemon's command line without options: the daemon alone, in this interpreter.
DAEMON = (sys.executable, "-c",
          "import sys; from paella.dispatcher.daemon import main; sys.exit(main())")

_notify_sockets: dict[int, socket.socket] = {}


def start_daemon(*extra: str, timeout: float = 60.0,
                 command: tuple[str, ...] = DAEMON) -> tuple[subprocess.Popen, str, str]:
    """A daemon on a fresh socket; returns (process, socket path, temp dir) once READY.
    ``command`` starts it (default: the daemon alone; the overhead experiment passes
    its traced entry point)."""
    d = tempfile.mkdtemp(prefix="plbench")
    sock, notify_path = os.path.join(d, "p.sock"), os.path.join(d, "notify")
    notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    notify.bind(notify_path)
    notify.settimeout(0.2)                  # (to see a daemon that exits meanwhile)
    proc = subprocess.Popen([*command, "--socket", sock, "--log-level", "warning", *extra],
                            env=dict(os.environ, NOTIFY_SOCKET=notify_path),
                            preexec_fn=end_with_parent())
    if not await_ready(notify, lambda: proc.poll() is None, timeout):
        code = proc.poll()
        terminate(proc, 0)
        notify.close()
        shutil.rmtree(d, ignore_errors=True)
        raise RuntimeError(f"the daemon exited with status {code} before it was ready "
                           f"(its error is above)" if code is not None else
                           f"the daemon did not become ready within {timeout:g} s")
    _notify_sockets[proc.pid] = notify      # kept open: the daemon reports STOPPING=1 too
    return proc, sock, d


def await_ready(notify: socket.socket, alive: Callable[[], bool], timeout: float) -> bool:
    """Wait for ``READY=1`` (sd_notify) on ``notify`` while ``alive()``: True once it came,
    False if the daemon exited or ``timeout`` seconds passed first. ``notify`` has a
    short timeout of its own (0.2 s), so that an exit is seen soon. Every launcher of a
    daemon (this module, a cluster replica, the fuzzer) waits this way."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            if b"READY=1" in notify.recv(4096):
                return True
        except socket.timeout:
            pass
        if not alive() or time.monotonic() > deadline:
            return False


def terminate(proc: subprocess.Popen, timeout: float) -> int | None:
    """SIGTERM (the daemon drains and removes its segments), then SIGKILL if it has not
    exited within ``timeout`` seconds (0: at once); its exit status, or None if it had
    to be killed."""
    if proc.poll() is None:
        if timeout > 0:
            proc.send_signal(signal.SIGTERM)
            try:
                return proc.wait(timeout)
            except subprocess.TimeoutExpired:
                pass
        proc.kill()
        proc.wait()
        return None
    return proc.returncode


def notify_socket(proc: subprocess.Popen) -> socket.socket:
    """The notify socket of a daemon :func:`start_daemon` started, to see it report a
    reload (``READY=1`` after SIGHUP) or its stop."""
    return _notify_sockets[proc.pid]


def stop_daemon(proc: subprocess.Popen) -> int | None:
    """SIGTERM (the daemon drains and removes its segments); its exit status, or None if
    it did not stop within 30 s and was killed."""
    try:
        return terminate(proc, 30.0)
    finally:
        sock = _notify_sockets.pop(proc.pid, None)
        if sock is not None:
            sock.close()
