"""A replica's daemon: its GPU's ``paella serve`` as a child process.

Unlike :func:`paella.child_daemon.start_daemon` (a launcher whose daemon writes to the
launcher's terminal), a replica must be able to say *why* its daemon did not start:
Ray shows an exception from a replica's constructor in its logs and in the deployment's
status, and the daemon's own words (no GPU, a bad bundle) are the useful part. So the
daemon's stderr goes through a pipe: a thread copies every line to the replica's
stderr (Ray's log of that replica) and keeps the last ones for the error.

The daemon is spawned without a ``preexec_fn``, so that ``subprocess`` takes its vfork
path: a replica has grpcio's threads running (Ray Serve loads it), and a plain fork
runs grpcio's fork handlers in the child, which could abort it before its exec (seen
once in the cluster test: the daemon dead at start). The child asks for its parent's
death signal itself, first thing after the exec (:data:`DAEMON_CMD`).
"""
from __future__ import annotations

import collections
import os
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field

from paella.child_daemon import await_ready, terminate

#: Lines of the daemon's stderr kept for an error message.
TAIL_LINES = 20


#: ``paella serve`` (as :data:`paella.child_daemon.DAEMON` runs it), ended by SIGTERM
#: when its parent (the replica, ``PAELLA_PARENT_PID``) exits, as
#: :func:`paella.parent_death.end_with_parent` does from a ``preexec_fn``.
DAEMON_CMD = (sys.executable, "-c",
              "import ctypes, os, signal, sys\n"
              "try:\n"
              "    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM, 0, 0, 0)\n"
              "except (OSError, AttributeError):\n"
              "    pass\n"
              "if os.getppid() != int(os.environ.pop('PAELLA_PARENT_PID', os.getppid())):\n"
              "    sys.exit(0)                     # (the replica is gone already)\n"
              "from paella.dispatcher.daemon import main\n"
              "sys.exit(main())\n")


class DaemonStartError(RuntimeError):
    """The daemon exited, or was not ready in time; the message ends with its stderr."""


@dataclass
class DaemonProcess:
    """A running daemon: the process, its control socket, and its stderr's last lines."""
    proc: subprocess.Popen
    socket: str
    tail: collections.deque = field(default_factory=lambda: collections.deque(maxlen=TAIL_LINES))
    #: Kept open while the daemon runs: it reports STOPPING=1 there when it stops.
    notify: socket.socket | None = None

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None

    def why_dead(self) -> str:
        """The exit status and the daemon's last words, for a health check's error."""
        code = self.proc.poll()
        how = (f"killed by signal {-code}" if code is not None and code < 0
               else f"exited with status {code}")
        return f"the paella daemon (pid {self.proc.pid}) {how}{self.last_words()}"

    def last_words(self) -> str:
        lines = [ln for ln in self.tail if "sd_notify" not in ln]
        return (":\n" + "\n".join(lines)) if lines else " (it wrote nothing to stderr)"

    def stop(self, timeout: float = 10.0) -> None:
        """SIGTERM (the daemon drains and removes its segments), SIGKILL if it hangs."""
        terminate(self.proc, timeout)
        if self.notify is not None:
            self.notify.close()
            self.notify = None
        for path in (self.socket, self.socket + ".notify"):
            try:
                os.unlink(path)
            except OSError:
                pass


def start(socket_path: str, args: list[str], env: dict[str, str] | None = None,
          timeout: float = 60.0) -> DaemonProcess:
    """``paella serve --socket socket_path *args``, returned once it reports READY=1
    (sd_notify); :class:`DaemonStartError` with its stderr if it exits or hangs first."""
    notify_path = socket_path + ".notify"
    _unlink(notify_path)
    notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    notify.bind(notify_path)
    notify.settimeout(0.2)
    proc = subprocess.Popen([*DAEMON_CMD, "--socket", socket_path, *args],
                            env=dict(env or os.environ, NOTIFY_SOCKET=notify_path,
                                     PAELLA_PARENT_PID=str(os.getpid())),
                            stdin=subprocess.DEVNULL, stderr=subprocess.PIPE)
    d = DaemonProcess(proc, socket_path, notify=notify)
    threading.Thread(target=_copy_stderr, args=(proc, d.tail), daemon=True,
                     name=f"paella-daemon-{proc.pid}-stderr").start()
    try:
        _await_ready(d, notify, timeout)
    except BaseException:
        d.stop(timeout=2.0)
        raise
    return d


def _await_ready(d: DaemonProcess, notify: socket.socket, timeout: float) -> None:
    if await_ready(notify, lambda: d.alive, timeout):
        return
    if not d.alive:
        d.proc.wait()
        time.sleep(0.1)                      # (the stderr thread reads the last lines)
        raise DaemonStartError(f"could not start the paella daemon: {d.why_dead()}")
    raise DaemonStartError(f"the paella daemon was not ready within {timeout:g} s"
                           f"{d.last_words()}")


def _copy_stderr(proc: subprocess.Popen, tail: collections.deque) -> None:
    """Each line to our stderr (Ray's replica log) and to the tail, until EOF."""
    assert proc.stderr is not None
    for raw in proc.stderr:
        line = raw.decode("utf-8", "replace").rstrip("\n")
        tail.append(line)
        print(line, file=sys.stderr, flush=True)


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
