"""Round-trip overhead of the service path: predict -> read_result, per wait mode.

Starts a real daemon (``paella serve``, its loop pinned to the last core with
SCHED_FIFO when permitted), pins this client to another core, and times closed-loop
round trips for each wait mode (hybrid, polling, socket) on two built-in models:

* ``echo``: computed on the daemon's CPU, so it measures the service path alone
  (rings, validation, wake-up, completion);
* ``noop``: one trivial 5 us kernel through the Dispatcher and the real-time
  simulated GPU, i.e. the whole device path.

Run: ``python -m paella.experiments.bench_roundtrip [--n 5000] [--json FILE]``.
Target (issue 5): hybrid p50 <= 50 us on the echo path.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import signal
import socket
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass

import numpy as np

from paella.parent_death import end_with_parent

DAEMON = (sys.executable, "-c",
          "import sys; from paella.dispatcher.daemon import main; sys.exit(main())")


@dataclass
class RoundTrip:
    model: str
    mode: str
    n: int
    p50_us: float
    p99_us: float
    mean_us: float
    client_cpu: float      # client CPU seconds / wall seconds over the run


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
    deadline = time.monotonic() + timeout
    while True:
        try:
            if b"READY=1" in notify.recv(4096):
                break
        except socket.timeout:
            pass
        code = proc.poll()
        if code is not None or time.monotonic() > deadline:
            proc.kill()
            proc.wait()
            notify.close()
            shutil.rmtree(d, ignore_errors=True)
            raise RuntimeError(f"the daemon exited with status {code} before it was ready "
                               f"(its error is above)" if code is not None else
                               f"the daemon did not become ready within {timeout:g} s")
    _notify_sockets[proc.pid] = notify      # kept open: the daemon reports STOPPING=1 too
    return proc, sock, d


_notify_sockets: dict[int, socket.socket] = {}


def stop_daemon(proc: subprocess.Popen) -> int:
    proc.send_signal(signal.SIGTERM)
    try:
        return proc.wait(30)
    finally:
        sock = _notify_sockets.pop(proc.pid, None)
        if sock is not None:
            sock.close()


def client_core() -> int | None:
    """Pin the client away from the daemon's core (the last one)."""
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        return None
    os.sched_setaffinity(0, {cores[0]})
    return cores[0]


def measure(sock: str, model: str, mode: str, n: int, warmup: int = 300) -> RoundTrip:
    from paella.client import connect
    with connect(sock, mode=mode) as c:
        v = c.models[model].variants[0]
        off = c.alloc(v.io_bytes)
        predict, read = c.predict, c.read_result
        times = np.empty(n)
        perf = time.perf_counter
        for _ in range(warmup):
            predict(model, v.io_bytes, off)
            read()
        r0 = resource.getrusage(resource.RUSAGE_SELF)
        w0 = perf()
        for i in range(n):
            t = perf()
            predict(model, v.io_bytes, off)
            read()
            times[i] = perf() - t
        wall = perf() - w0
        r1 = resource.getrusage(resource.RUSAGE_SELF)
    cpu = (r1.ru_utime - r0.ru_utime + r1.ru_stime - r0.ru_stime) / wall
    us = times * 1e6
    return RoundTrip(model, mode, n, float(np.percentile(us, 50)), float(np.percentile(us, 99)),
                     float(us.mean()), cpu)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=5000, help="round trips per mode and model")
    ap.add_argument("--models", default="echo,noop")
    ap.add_argument("--modes", default="hybrid,polling,socket")
    ap.add_argument("--daemon-arg", action="append", default=[],
                    help="extra `paella serve` option (repeatable), e.g. --daemon-arg=--idle=spin")
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args(argv)
    proc, sock, _ = start_daemon(*args.daemon_arg)
    core = client_core()
    results = []
    try:
        for model in args.models.split(","):
            for mode in args.modes.split(","):
                r = measure(sock, model, mode, args.n)
                results.append(r)
                print(f"{model:5s} {mode:8s} p50 {r.p50_us:7.1f} us  p99 {r.p99_us:8.1f} us  "
                      f"mean {r.mean_us:7.1f} us  client CPU {r.client_cpu:4.0%}", flush=True)
    finally:
        rc = stop_daemon(proc)
    meta = {"client_core": core, "cores": os.cpu_count(), "daemon_args": args.daemon_arg,
            "daemon_exit": rc}
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "results": [asdict(r) for r in results]}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
