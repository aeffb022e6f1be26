"""Round-trip overhead of the service path: predict -> read_result, per wait mode.

Starts a real daemon (``paella serve``, its loop pinned to the last core with
SCHED_FIFO when permitted), pins this client to another core, and times closed-loop
round trips for each wait mode (hybrid, polling, socket) on two built-in models:

* ``echo``: computed on the daemon's CPU, so it measures the service path alone
  (rings, validation, wake-up, completion);
* ``noop``: one trivial 5 us kernel through the Dispatcher and the real-time
  simulated GPU, i.e. the whole device path.

Run: ``python -m paella.benchmarks.bench_roundtrip [--n 5000] [--json FILE]``.
Target (issue 5): hybrid p50 <= 50 us on the echo path.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import asdict

from paella.child_daemon import start_daemon, stop_daemon
from paella.client.perf import time_round_trips


def client_core() -> int | None:
    """Pin the client away from the daemon's core (the last one)."""
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        return None
    os.sched_setaffinity(0, {cores[0]})
    return cores[0]


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
                r = time_round_trips(sock, model, mode, args.n)
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
