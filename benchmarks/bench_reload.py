"""Benchmark (not a test): does a SIGHUP reload stall the dispatcher loop?

    .venv/bin/python -m paella.benchmarks.bench_reload [--load-seconds 2] [--runs 3] [--json F]

Starts a real daemon serving the tiny MLP, then, per run, makes the bundle slow to load
(its CPU build becomes a shared object whose constructor sleeps ``--load-seconds``;
loading it is what a big model's CPU build costs the daemon) and sends SIGHUP, while a
client calls ``infer`` back to back on the version being served. Reported per run: how
long the reload took (SIGHUP to READY=1), the answers during it, the worst and median
gap between two answers during it and in the second after the swap (when the daemon
also freezes the new objects out of the collector's way), and, before the first
reload, the same client's worst and median round trip over 300 calls. A reload done in
the loop shows one gap as long as the load.

Needs a C compiler (``cc``) for the slow-loading library.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

import numpy as np

SLOW_SOURCE = r"""
#include <unistd.h>
__attribute__((constructor)) static void paella_slow_load(void) { usleep(%d); }
"""


def make_slow_loading(bdir: Path, seconds: float) -> None:
    """Point the bundle's CPU build at a wrapper library whose constructor sleeps
    ``seconds`` and which needs the real one (TVM finds the module's symbols through the
    dependency). The manifest changes, so the daemon sees a changed bundle."""
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        raise RuntimeError("a C compiler (cc) is needed to build the slow-loading library")
    src = bdir / "slow_load.c"
    src.write_text(SLOW_SOURCE % int(seconds * 1e6))
    # A new name each time: the dynamic loader returns a library already loaded under
    # the same name without running its constructor again.
    lib = f"cpu_slow_{os.urandom(4).hex()}.so"
    subprocess.run([cc, "-shared", "-fPIC", "-o", str(bdir / lib), str(src),
                    "-Wl,--no-as-needed", f"-L{bdir}", "-l:cpu.so", "-Wl,-rpath,$ORIGIN"],
                   check=True, capture_output=True)
    path = bdir / "manifest.json"
    m = json.loads(path.read_text())
    m["files"]["cpu_lib"] = lib
    path.write_text(json.dumps(m, indent=1))
    st = os.stat(path)                   # a new mtime even within the clock's resolution
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))


def one_reload(proc, notify: socket.socket, bdir: Path, client, x: dict,
               load_seconds: float) -> dict:
    make_slow_loading(bdir, load_seconds)
    t_hup = time.monotonic()
    proc.send_signal(signal.SIGHUP)
    notify.setblocking(False)
    times = []
    while True:
        client.infer("tiny_mlp", x)
        times.append(time.monotonic())
        try:
            if b"READY=1" in notify.recv(4096):
                break
        except BlockingIOError:
            pass                         # not yet
    t_ready = times[-1]
    after = [t_ready]
    while after[-1] < t_ready + 1.0:
        client.infer("tiny_mlp", x)
        after.append(time.monotonic())
    during = np.diff([t_hup, *times])
    return {"reload_s": t_ready - t_hup, "answers": len(times),
            "worst_gap_ms": float(during.max() * 1e3),
            "median_gap_ms": float(np.median(during) * 1e3),
            "worst_gap_after_ms": float(np.diff(after).max() * 1e3)}


def run(load_seconds: float, runs: int) -> dict:
    from paella.client import connect
    from paella.compiler_pass.build import compile_bundle
    from paella.child_daemon import notify_socket, start_daemon, stop_daemon
    from paella.models.tiny import tiny_mlp
    tmp = Path(tempfile.mkdtemp(prefix="paella-bench-reload-"))
    repo = tmp / "models"
    repo.mkdir()
    compile_bundle(tiny_mlp(), str(repo / "tiny_mlp"))
    proc, sock, d = start_daemon("--models", str(repo), "--cpu", "none", "--rt-priority", "0")
    notify = notify_socket(proc)
    x = {"x": np.ones((2, 16), np.float32)}
    try:
        with connect(sock) as c:
            rt = []
            for _ in range(300):
                t = time.monotonic()
                c.infer("tiny_mlp", x)
                rt.append(time.monotonic() - t)
            results = [one_reload(proc, notify, repo / "tiny_mlp", c, x, load_seconds)
                       for _ in range(runs)]
    finally:
        code = stop_daemon(proc)
        shutil.rmtree(d, ignore_errors=True)
        shutil.rmtree(tmp, ignore_errors=True)
    return {"load_seconds": load_seconds, "daemon_exit": code,
            "round_trip_median_ms": float(np.median(rt) * 1e3),
            "round_trip_worst_ms": float(max(rt) * 1e3), "runs": results}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--load-seconds", type=float, default=2.0)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--json", metavar="FILE")
    args = ap.parse_args()
    data = run(args.load_seconds, args.runs)
    print(f"outside a reload: round trip median {data['round_trip_median_ms']:.2f} ms, "
          f"worst {data['round_trip_worst_ms']:.1f} ms (300 calls)")
    for i, r in enumerate(data["runs"], 1):
        print(f"reload {i}: {r['reload_s']:.2f} s, {r['answers']} answers during it, worst gap "
              f"{r['worst_gap_ms']:.1f} ms (median {r['median_gap_ms']:.2f} ms); worst gap in the "
              f"second after the swap {r['worst_gap_after_ms']:.1f} ms")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(data, f, indent=1)


if __name__ == "__main__":
    main()
