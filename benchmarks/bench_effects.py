"""No client can stall the others (issue 37): an echo client's round trips beside a
client that sends never-seen SqueezeNet inputs back to back.

Starts a real daemon (``paella serve --backend sim``) serving ``squeezenet1_1`` (the zoo
bundle, compiled once and cached, as ``paella demo`` does) and ``echo``. One client
process sends an echo request every 10 ms and times each round trip; another sends
SqueezeNet requests with fresh random inputs, each after the previous answer, so
every one of them is a first-seen input whose answer the CPU build must compute. Two
phases, the same daemon: the echo client alone, then beside the SqueezeNet client.

Before issue 37 the CPU build ran on the dispatcher's loop (echo p50 0.54 ms / p99 0.88
ms alone, p50 125 ms / p99 171 ms beside it); it now runs in the effect workers.

Run: ``python -m paella.benchmarks.bench_effects [--seconds 10] [--json FILE]``.
Target: the echo p99 beside the fresh inputs within 3x of its p99 alone, or under 5 ms.
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

MODEL = "squeezenet1_1"
ECHO_PERIOD = 0.010


def _echo_client(sock: str, seconds: float, out) -> None:
    from paella.client import connect
    x = np.arange(256, dtype=np.float32)
    lat = []
    with connect(sock) as c:
        end = time.monotonic() + seconds
        nxt = time.monotonic()
        while time.monotonic() < end:
            t = time.perf_counter()
            c.infer("echo", {"x": x}, timeout=30)
            lat.append(time.perf_counter() - t)
            nxt += ECHO_PERIOD
            time.sleep(max(0.0, nxt - time.monotonic()))
    out.put(lat)


def _fresh_client(sock: str, seconds: float, shapes: dict, out) -> None:
    from paella.client import connect
    rng = np.random.default_rng(7)
    lat = []
    with connect(sock) as c:
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            x = {k: rng.standard_normal(s).astype(np.float32) for k, s in shapes.items()}
            t = time.perf_counter()
            c.infer(MODEL, x, timeout=120)
            lat.append(time.perf_counter() - t)
    out.put(lat)


def _pct(xs: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(xs) * 1e3, q)) if xs else float("nan")


def _phase(sock: str, seconds: float, shapes: dict | None) -> dict:
    ctx = mp.get_context("spawn")
    q_echo, q_fresh = ctx.Queue(), ctx.Queue()
    procs = [ctx.Process(target=_echo_client, args=(sock, seconds, q_echo))]
    if shapes is not None:
        procs.append(ctx.Process(target=_fresh_client, args=(sock, seconds + 1.0, shapes, q_fresh)))
        procs[-1].start()
        time.sleep(1.0)                      # (its first answers under way)
    procs[0].start()
    echo = q_echo.get(timeout=seconds + 120)
    fresh = q_fresh.get(timeout=seconds + 300) if shapes is not None else []
    for p in procs:
        p.join(30)
    return {"echo_n": len(echo), "echo_p50_ms": _pct(echo, 50), "echo_p99_ms": _pct(echo, 99),
            "fresh_n": len(fresh), "fresh_p50_ms": _pct(fresh, 50)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=10.0, help="length of each phase")
    ap.add_argument("--json", help="write the figures here")
    ap.add_argument("--daemon-args", default="", help="extra `paella serve` arguments")
    args = ap.parse_args(argv)
    from paella.child_daemon import start_daemon, stop_daemon
    from paella.experiments.zoo import DEFAULT_ZOO_DIR, ensure_bundles

    bundle = ensure_bundles([MODEL], DEFAULT_ZOO_DIR)[MODEL]
    shapes = {t.name: tuple(t.shape) for t in bundle.variants[0].inputs}
    repo = Path(tempfile.mkdtemp(prefix="paella-bench-effects-"))
    os.symlink(bundle.path.resolve(), repo / MODEL)
    proc, sock, tmp = start_daemon("--models", str(repo), "--backend", "sim", "--no-noop",
                                   *args.daemon_args.split(), timeout=300)
    try:
        alone = _phase(sock, args.seconds, None)
        beside = _phase(sock, args.seconds, shapes)
    finally:
        stop_daemon(proc)
        shutil.rmtree(repo, ignore_errors=True)
        shutil.rmtree(tmp, ignore_errors=True)
    ratio = beside["echo_p99_ms"] / alone["echo_p99_ms"]
    met = ratio <= 3.0 or beside["echo_p99_ms"] < 5.0
    result = {"alone": alone, "beside_fresh_inputs": beside, "p99_ratio": ratio, "target_met": met}
    print(f"echo alone:                 p50 {alone['echo_p50_ms']:.2f} ms  p99 "
          f"{alone['echo_p99_ms']:.2f} ms  ({alone['echo_n']} round trips)")
    print(f"echo beside fresh {MODEL}: p50 {beside['echo_p50_ms']:.2f} ms  p99 "
          f"{beside['echo_p99_ms']:.2f} ms  ({beside['echo_n']} round trips; "
          f"{beside['fresh_n']} fresh inputs answered, p50 {beside['fresh_p50_ms']:.0f} ms)")
    print(f"p99 beside / alone: {ratio:.2f}x  (target: <= 3x or under 5 ms: "
          f"{'met' if met else 'MISSED'})")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
