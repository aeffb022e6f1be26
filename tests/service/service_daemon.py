"""Helpers of the service tests: a real daemon process, readiness via sd_notify.

The daemon is started as ``python -m paella.cli serve`` with a real datagram socket as
$NOTIFY_SOCKET; a test proceeds only once READY=1 arrived on it, which is exactly
what systemd's Type=notify waits for.
"""
from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field

from paella.parent_death import end_with_parent

#: ``paella serve`` without the other sub-commands (so another component's broken
#: import cannot fail these tests). Not ``-m``: that would make a second copy of the
#: module whose CLIError the real one's handler would not catch.
PAELLA = (sys.executable, "-X", "faulthandler", "-c",
          "import sys; from paella.dispatcher.daemon import main; sys.exit(main())")

#: Polite defaults for a shared 2-core machine; tests of pinning pass their own.
POLITE = ("--cpu", "none", "--rt-priority", "0")


@dataclass
class DaemonProc:
    proc: subprocess.Popen
    socket: str
    dir: str
    log_path: str
    notify: socket.socket
    messages: list[str] = field(default_factory=list)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def log(self) -> str:
        with open(self.log_path) as f:
            return f.read()

    def segments(self) -> list[str]:
        """This daemon's segments: client memfds still mapped or open in its process (they
        have no name anywhere else), and every name in /dev/shm it owns (its own segments,
        such as the simulator process's notifQ, or client segments of the old scheme)."""
        named = {n for n in os.listdir("/dev/shm") if n.startswith(f"paella.{self.pid}.")}
        return sorted(named | held_segments(self.pid))

    def fds(self) -> list[str]:
        """What the daemon's open descriptors point at (``readlink /proc/PID/fd/*``)."""
        return sorted(_fd_targets(self.pid).values())

    def recv_notify(self, timeout: float) -> list[str]:
        self.notify.settimeout(timeout)
        try:
            while True:
                self.messages.append(self.notify.recv(4096).decode())
                self.notify.settimeout(0.01)
        except (socket.timeout, BlockingIOError):
            pass  # nothing more queued
        return self.messages

    def stop(self, timeout: float = 15.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout)


#: A client segment as /proc names it: a memfd (``/memfd:paella.PID.CID (deleted)``)
#: or a POSIX segment (``/dev/shm/paella.PID.CID.RANDOM``).
SEGMENT = re.compile(r"(?:/memfd:|/dev/shm/)(paella\.\d+\.\d+)")


def _fd_targets(pid: int) -> dict[int, str]:
    out = {}
    try:
        names = os.listdir(f"/proc/{pid}/fd")
    except FileNotFoundError:
        return out            # the process is gone (or a zombie)
    for n in names:
        try:
            out[int(n)] = os.readlink(f"/proc/{pid}/fd/{n}")
        except FileNotFoundError:
            pass              # closed while we looked
    return out


def held_segments(pid: int) -> set[str]:
    """Names of the client segments process ``pid`` maps or holds a descriptor of."""
    try:
        with open(f"/proc/{pid}/maps") as f:
            lines = f.read().splitlines()
    except (FileNotFoundError, ProcessLookupError):
        lines = []
    lines += _fd_targets(pid).values()
    return {m.group(1) for m in map(SEGMENT.search, lines) if m}


def start_daemon(*args: str, ready: bool = True, polite: bool = True,
                 sock_dir: str | None = None, env: dict[str, str] | None = None) -> DaemonProc:
    d = sock_dir or tempfile.mkdtemp(prefix="pls", dir="/tmp")
    sock = os.path.join(d, "p.sock")
    notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    npath = os.path.join(d, f"notify.{time.monotonic_ns()}")
    notify.bind(npath)
    log_path = os.path.join(d, f"daemon.{time.monotonic_ns()}.log")
    env = dict(os.environ, NOTIFY_SOCKET=npath, **(env or {}))
    cmd = [*PAELLA, "--socket", sock,
           *(POLITE if polite else ()), *args]
    with open(log_path, "w") as logf:
        proc = subprocess.Popen(cmd, stdout=logf, stderr=subprocess.STDOUT, env=env,
                                preexec_fn=end_with_parent())
    dp = DaemonProc(proc, sock, d, log_path, notify)
    if ready:
        deadline = time.monotonic() + 30
        while not any("READY=1" in m for m in dp.messages):
            if proc.poll() is not None:
                raise RuntimeError(f"daemon exited with {proc.returncode}:\n{dp.log()}")
            if time.monotonic() > deadline:
                proc.kill()
                raise RuntimeError(f"daemon not ready after 30 s:\n{dp.log()}")
            dp.recv_notify(0.2)
    return dp


def cleanup(dp: DaemonProc) -> None:
    if dp.proc.poll() is None:
        dp.proc.kill()
        dp.proc.wait(10)
    for name in os.listdir("/dev/shm"):     # a failed test must not leak into the next
        if name.startswith(f"paella.{dp.pid}."):
            os.unlink(os.path.join("/dev/shm", name))
    dp.notify.close()
    shutil.rmtree(dp.dir, ignore_errors=True)



def run_client(code: str, sock: str, timeout: float = 60) -> subprocess.CompletedProcess:
    """Run ``code`` in a fresh interpreter with SOCK bound to the daemon's socket."""
    prog = f"SOCK = {sock!r}\n" + code
    return subprocess.run([sys.executable, "-c", prog], capture_output=True, text=True,
                          timeout=timeout)


def free_port() -> int:
    """A TCP port free now (bound and released: another process may take it meanwhile,
    which only fails the test)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_kserve(sock: str, *args: str) -> tuple[subprocess.Popen, int, int, "Path"]:
    """``paella kserve`` for the daemon at ``sock`` (and ``args``): (process, HTTP port,
    gRPC port, log)."""
    from pathlib import Path
    hp, gp = free_port(), free_port()
    log = Path(sock).with_name(f"kserve.{hp}.log")
    paella = str(Path(sys.executable).with_name("paella"))
    with open(log, "w") as f:
        proc = subprocess.Popen([paella, "kserve", "--socket", sock, "--http-port", str(hp),
                                 "--grpc-port", str(gp), "--timeout", "10", *args],
                                stdout=f, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 30
    while "HTTP on" not in log.read_text():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError(f"paella kserve did not start:\n{log.read_text()}")
        time.sleep(0.1)
    return proc, hp, gp, log
