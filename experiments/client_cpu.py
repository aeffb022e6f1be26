"""Figure 14: client CPU utilization at a high request rate, per wait mode.

A real daemon serves the built-in ``noop`` model (one trivial kernel through the
Dispatcher and the real-time simulated GPU). For each wait mode (socket, polling,
hybrid), one client process pinned to its own core sends requests one at a time at a
target rate (default 6,700/s, the paper's; it goes as fast as the round trip allows
when that is slower), for a fixed time. The parent samples the client's CPU time
every 5 ms from /proc/PID/schedstat (nanoseconds, unlike the 10 ms ticks of
/proc/PID/stat) and reports the mean utilization, the achieved rate and latency.

Run: ``python -m paella.experiments.client_cpu [--seconds 5] [--rate 6700] [--json F]``.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from dataclasses import asdict, dataclass

import numpy as np

from paella.child_daemon import start_daemon, stop_daemon

CLIENT = r"""
import json, os, sys, time
import numpy as np
from paella.client import connect
sock, mode, model, rate, seconds, core = sys.argv[1:7]
rate, seconds = float(rate), float(seconds)
if int(core) >= 0:
    os.sched_setaffinity(0, {int(core)})
c = connect(sock, mode=mode)
v = c.models[model].variants[0]
off = c.alloc(v.io_bytes)
for _ in range(200):
    c.predict(model, v.io_bytes, off); c.read_result()
print("go", flush=True)
sys.stdin.readline()
period = 1.0 / rate
lat = []
t0 = time.perf_counter()
nxt = t0
while True:
    now = time.perf_counter()
    if now - t0 >= seconds:
        break
    if nxt - now > 2e-4:
        time.sleep(nxt - now - 1e-4)
    t = time.perf_counter()
    c.predict(model, v.io_bytes, off)
    c.read_result()
    lat.append(time.perf_counter() - t)
    nxt = max(nxt + period, t)
wall = time.perf_counter() - t0
print(json.dumps({"n": len(lat), "wall": wall, "lat": lat}), flush=True)
"""


@dataclass
class ModeCpu:
    mode: str
    rate: float              # achieved requests per second
    cpu_mean: float          # fraction of one core, mean of the 5 ms samples
    cpu_p50: float
    cpu_p90: float
    lat_mean_us: float
    lat_p50_us: float
    lat_p99_us: float


def cpu_ns(pid: int) -> int:
    with open(f"/proc/{pid}/schedstat") as f:
        return int(f.read().split()[0])


def run_mode(sock: str, mode: str, model: str, rate: float, seconds: float, core: int,
             interval: float = 0.005) -> ModeCpu:
    p = subprocess.Popen([sys.executable, "-c", CLIENT, sock, mode, model, str(rate),
                          str(seconds), str(core)], stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "go"
    p.stdin.write("\n")
    p.stdin.flush()
    samples = []
    last_c, last_t = cpu_ns(p.pid), time.perf_counter()
    end = last_t + seconds
    while time.perf_counter() < end:
        time.sleep(interval)
        try:
            c = cpu_ns(p.pid)
        except (FileNotFoundError, ProcessLookupError):
            break   # the client finished early
        t = time.perf_counter()
        samples.append((c - last_c) / 1e9 / (t - last_t))
        last_c, last_t = c, t
    out = json.loads(p.stdout.readline())
    p.wait(30)
    lat = np.array(out["lat"]) * 1e6
    s = np.array(samples)
    return ModeCpu(mode, out["n"] / out["wall"], float(s.mean()), float(np.percentile(s, 50)),
                   float(np.percentile(s, 90)), float(lat.mean()), float(np.percentile(lat, 50)),
                   float(np.percentile(lat, 99)))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=5.0)
    ap.add_argument("--rate", type=float, default=6700.0)
    ap.add_argument("--model", default="noop")
    ap.add_argument("--modes", default="socket,polling,hybrid")
    ap.add_argument("--daemon-arg", action="append", default=[])
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args(argv)
    proc, sock, _ = start_daemon(*args.daemon_arg)
    cores = sorted(os.sched_getaffinity(0))
    core = cores[0] if len(cores) > 1 else -1
    results = []
    try:
        for mode in args.modes.split(","):
            r = run_mode(sock, mode, args.model, args.rate, args.seconds, core)
            results.append(r)
            print(f"{mode:8s} {r.rate:7.0f} req/s  client CPU mean {r.cpu_mean:4.0%} "
                  f"(p50 {r.cpu_p50:4.0%}, p90 {r.cpu_p90:4.0%})  latency mean "
                  f"{r.lat_mean_us:6.1f} us, p50 {r.lat_p50_us:6.1f}, p99 {r.lat_p99_us:7.1f}",
                  flush=True)
    finally:
        stop_daemon(proc)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "results": [asdict(r) for r in results]}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
