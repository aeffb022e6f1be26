"""What waking a sleeping client costs the process that wakes it.

The daemon wakes a hybrid client (one asleep in ``recv`` on its Unix socket) with a
WAKE frame: a ``send`` made by the dispatcher's loop, on the critical path of the
request's end (docs/dispatcher.md, "Wake-up lead"). Its cost is mostly the kernel
waking a process that sleeps on another CPU, which on a VM is an inter-processor
interrupt and an exit to the hypervisor. This measures the waker's side of three ways
to do it, one process asleep on the other CPU each time (it answers on an eventfd of
its own, so each wake-up finds it asleep again):

* ``socket``: ``send`` of an 8-byte frame on a Unix stream socket (what the daemon does);
* ``eventfd``: ``write`` on an eventfd the other process reads;
* ``futex``: ``FUTEX_WAKE`` on a shared word the other process waits on.

Run: ``python -m paella.benchmarks.bench_wakeup [--n 3000] [--json FILE]``.
Figures: docs/benchmarks.md, round 17.
"""
from __future__ import annotations

import argparse
import ctypes
import json
import mmap
import os
import socket
import struct
import sys
import time

import numpy as np

SYS_FUTEX = 202                 # x86-64
FUTEX_WAIT, FUTEX_WAKE = 0, 1
#: Between two wake-ups, so that the other process is asleep again when the next comes.
PAUSE_S = 300e-6


def _cpus() -> tuple[set[int], set[int]]:
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        raise SystemExit("bench_wakeup: needs two CPUs (the waker and the sleeper)")
    return {cores[0]}, {cores[-1]}


def _time(n: int, wake, sleeper, back: int) -> list[float]:
    """Fork ``sleeper`` onto the other CPU, time ``wake()`` ``n`` times."""
    mine, other = _cpus()
    cores = os.sched_getaffinity(0)
    pid = os.fork()
    if pid == 0:                                     # the sleeper
        try:
            os.sched_setaffinity(0, other)
            sleeper(n)
        finally:
            os._exit(0)
    os.sched_setaffinity(0, mine)
    out = []
    try:
        for _ in range(n):
            time.sleep(PAUSE_S)
            t = time.perf_counter()
            wake()
            out.append(time.perf_counter() - t)
            os.eventfd_read(back)
    finally:
        os.waitpid(pid, 0)
        os.sched_setaffinity(0, cores)
    return out


def bench_socket(n: int) -> list[float]:
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    back = os.eventfd(0)

    def sleeper(k: int) -> None:
        for _ in range(k):
            b.recv(64)
            os.eventfd_write(back, 1)
    try:
        return _time(n, lambda: a.send(b"12345678"), sleeper, back)
    finally:
        a.close(), b.close(), os.close(back)


def bench_eventfd(n: int) -> list[float]:
    fd, back = os.eventfd(0), os.eventfd(0)

    def sleeper(k: int) -> None:
        for _ in range(k):
            os.eventfd_read(fd)
            os.eventfd_write(back, 1)
    try:
        return _time(n, lambda: os.eventfd_write(fd, 1), sleeper, back)
    finally:
        os.close(fd), os.close(back)


def bench_futex(n: int) -> list[float]:
    libc = ctypes.CDLL(None, use_errno=True)
    word = mmap.mmap(-1, 4096)                      # shared with the forked sleeper
    addr = ctypes.c_void_p(ctypes.addressof(ctypes.c_int.from_buffer(word)))
    back = os.eventfd(0)

    def sleeper(k: int) -> None:
        for _ in range(k):
            while struct.unpack_from("i", word, 0)[0] == 0:
                libc.syscall(SYS_FUTEX, addr, FUTEX_WAIT, 0, None, None, 0)
            struct.pack_into("i", word, 0, 0)
            os.eventfd_write(back, 1)

    def wake() -> None:
        struct.pack_into("i", word, 0, 1)
        libc.syscall(SYS_FUTEX, addr, FUTEX_WAKE, 1, None, None, 0)
    try:
        return _time(n, wake, sleeper, back)
    finally:
        os.close(back)


WAYS = {"socket": bench_socket, "eventfd": bench_eventfd, "futex": bench_futex}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--n", type=int, default=3000, help="wake-ups per way (default 3000)")
    p.add_argument("--json", help="write the figures here")
    args = p.parse_args(argv)
    if args.n < 10:
        p.error("--n must be at least 10")
    if not sys.platform.startswith("linux"):
        raise SystemExit("bench_wakeup: Linux only (eventfd, futex)")
    rows = {}
    for name, fn in WAYS.items():
        us = np.array(fn(args.n)) * 1e6
        rows[name] = {"p50_us": float(np.median(us)), "p90_us": float(np.percentile(us, 90))}
        print(f"{name:8s} waker's cost: p50 {rows[name]['p50_us']:6.2f} us, "
              f"p90 {rows[name]['p90_us']:6.2f} us", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"n": args.n, "ways": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
