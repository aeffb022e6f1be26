"""Benchmark (not a test): one request at a time through the dispatcher on the real-time
simulated GPU, in this process, against the time the simulated GPU itself takes.

    .venv/bin/python -m paella.benchmarks.bench_realtime [--models resnet18,squeezenet1_1,googlenet]
        [--requests 200] [--lookahead 3] [--policy paella] [--profile FILE] [--fifo]
        [--pause [--spin]] [--gap 0.02] [--daemon | --daemon-only] [--daemon-args "--idle spin"]
        [--engine] [--virtual]

No daemon, no client, no rings: the in-process core of ``paella demo``'s critical path.
Each model (a zoo bundle, compiled and cached like the demo's) is served through the
daemon's own adaptor (``bundle_adaptor``: the plan, the CPU build's answer as the last
kernel's functional effect, through the functional cache) by a ``Dispatcher`` on a
``SimDevice(realtime=True)``, stepped back to back (a spin: no sleep can overshoot).
Per request:

* **latency**: wall time from ``submit`` to the request's completion callback;
* **isolated**: the same request on the *virtual-time* simulated GPU (its H2D, kernels
  and D2H alone on the device): what the GPU would take, the floor;
* **extra**: latency minus isolated, the host's cost on the critical path.

Reported: medians over ``--requests`` requests after warm-up, the ratio latency /
isolated, the extra per kernel, the median gap between two of a request's device
operations (the engine's self-log: the host's reaction at a kernel boundary), and the CPU
per request (``--profile FILE`` writes
cProfile's stats of the timed requests). ``--fifo`` runs under SCHED_FIFO when allowed
(the daemon does by default, see docs/service.md).

``--pause`` sleeps (``--spin``: busy-waits) ``--gap`` seconds before each request
instead of serving them back to back: ``paella demo``'s spacing (20 requests/s per
client), after which this machine's caches no longer hold the loop's code and data. ``--daemon`` (``--daemon-only``) then
(only) sends the same kind of requests through the real daemon from one client process
pinned away from the daemon's core, one at a time, ``--gap`` apart on average: the demo's
critical path without its queueing.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from typing import Any, Callable

import numpy as np

from paella.dispatcher.core import Dispatcher, Request
from paella.dispatcher.daemon.bundles import FunctionalCache, bundle_adaptor
from paella.dispatcher.daemon.system import freeze_new_objects as freeze_heap
from paella.dispatcher.devices.sim import SimDevice

DEFAULT_MODELS = ["resnet18", "squeezenet1_1", "googlenet"]


def serve_one(disp: Dispatcher, model_id: int, io: np.ndarray, req_id: int,
              spin: float = 0.0) -> float:
    """Submit one request and step the dispatcher until it completes: its wall latency.
    ``spin`` (seconds): each step may spin in the kernel core that long, as the
    daemon's loop lets it (``Dispatcher.spin_until``)."""
    done = []
    req = Request(req_id, 0, model_id, io, on_complete=lambda r, st, err: done.append(st))
    perf = time.perf_counter
    t0 = perf()
    disp.submit(req)
    step = disp.step
    while not done:
        if spin:
            disp.spin_until = perf() + spin
        step()
    t = perf() - t0
    if done[0] != 0:
        raise RuntimeError(f"request {req_id} failed: {req.error}")
    return t


def serve_virtual(bundle, name: str, io: np.ndarray, policy: str, lookahead: int,
                  n: int) -> list[float]:
    """``n`` requests, one at a time, on the virtual-time simulated T4: each one's time
    from submit to completion (the GPU's alone; the host costs nothing here)."""
    dev = SimDevice("t4")
    disp = Dispatcher(dev, policy, lookahead=lookahead)
    mid = disp.register_model(name, bundle_adaptor(bundle, name, dev, FunctionalCache()))
    times = []
    for i in range(n):
        req = Request(i, 0, mid, io)
        disp.submit(req)
        disp.run_until_idle()
        times.append(req.t_done - req.t_submit)
    return times


def isolated_seconds(bundle, name: str, io: np.ndarray, policy: str, lookahead: int) -> float:
    """The request alone on the virtual-time simulated T4, submit to completion."""
    return statistics.median(serve_virtual(bundle, name, io, policy, lookahead, 3))


def request_io(bundle) -> np.ndarray:
    """An io buffer for the bundle's first variant, its inputs filled (seeded)."""
    v = bundle.variants[0]
    io = np.zeros(v.io_bytes, np.uint8)
    rng = np.random.default_rng(0)
    for t in v.inputs:
        io[t.offset:t.offset + t.nbytes] = rng.standard_normal(t.shape).astype(t.dtype) \
            .view(np.uint8).reshape(-1)
    return io


def spin_wait(seconds: float) -> None:
    """Busy-wait (``--spin``): the core stays ours, as the daemon's ``--idle spin``
    keeps it, so what a pause still costs is not the sleep's wake-up."""
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def bench_model(bundle, name: str, n: int, policy: str, lookahead: int,
                profiler: Any = None, gap: float = 0.0,
                wait: Callable[[float], None] = time.sleep, early_lookup: bool = True,
                kernel_core: str | None = "auto", spin: float = 100e-6) -> dict:
    dev = SimDevice("t4", realtime=True)
    disp = Dispatcher(dev, policy, lookahead=lookahead, kernel_core=kernel_core)
    adaptor = bundle_adaptor(bundle, name, dev, FunctionalCache(), early_lookup=early_lookup)
    adaptor.warm()
    mid = disp.register_model(name, adaptor)
    io = request_io(bundle)
    iso = isolated_seconds(bundle, name, io, policy, lookahead)
    for i in range(10):                       # warm-up: the CPU build runs once here
        serve_one(disp, mid, io, i)
    freeze_heap()                             # as the daemon does once its models are loaded
    lat = []
    cpu0 = time.process_time()
    if profiler is not None:
        profiler.enable()
    dev.gpu.logging = True                    # the gaps between each request's ops
    dev.gpu.log_take()
    gaps: list[float] = []
    for i in range(n):
        if gap:
            wait(gap)
        lat.append(serve_one(disp, mid, io, 100 + i, spin))
        gaps += request_gaps(dev)
    dev.gpu.logging = False
    if profiler is not None:
        profiler.disable()
    cpu = (time.process_time() - cpu0) / n     # (the sleeps take none)
    p50 = statistics.median(lat)
    kernels = sum(1 for op in adaptor.plan.ops if op.kind == "launch")
    return {"model": name, "kernels": kernels, "isolated_ms": iso * 1e3, "p50_ms": p50 * 1e3,
            "p90_ms": float(np.percentile(lat, 90)) * 1e3, "ratio": p50 / iso,
            "extra_us": (p50 - iso) * 1e6, "extra_per_kernel_us": (p50 - iso) * 1e6 / kernels,
            "cpu_ms_per_request": cpu * 1e3,
            "gap_p50_us": float(np.median(gaps)) * 1e6 if gaps else float("nan")}


def request_gaps(dev: SimDevice) -> list[float]:
    """The idle gaps between the device operations of the request just served, from the
    engine's self-log (``Gpu.logging``; taken and cleared): what the GPU waited between
    two of the request's ops, the host's reaction at each kernel boundary."""
    ops_b, _ = dev.gpu.log_take()
    ops = np.frombuffer(ops_b).reshape(-1, 3)
    ops = ops[np.argsort(ops[:, 0])]
    ends = np.maximum.accumulate(ops[:, 1])
    g = ops[1:, 0] - ends[:-1]
    return [float(x) for x in g if x > 0]


def engine_seconds(bundle, n: int = 300, repeat: int = 3) -> float:
    """The simulated GPU's own CPU per request: the plan's kernels launched on one stream
    of a virtual-time SimDevice and run to the end (placements, re-timing, notifQ words;
    no dispatcher), the best of ``repeat`` runs of ``n`` requests (thread CPU time)."""
    from paella.dispatcher.adaptor import plan_from_bundle
    from paella.experiments.zoo import module_image
    dev = SimDevice("t4")
    funcs = dev.load_module(module_image(bundle))
    kernels = [(funcs[op.kernel], op.grid, op.block) for op in plan_from_bundle(bundle, 0).ops
               if op.kind == "launch"]
    best = float("inf")
    for _ in range(repeat):
        spent = 0.0
        for _ in range(n):
            for i, (f, grid, block) in enumerate(kernels):
                dev.launch(f, grid, block, 0, i + 1, instrumented=True)
            t = time.thread_time()
            dev.run()
            spent += time.thread_time() - t
            dev.notifq[:] = 0                # (nobody reads it here)
        best = min(best, spent / n)
    return best


def bench_daemon(bundles: dict, n: int, policy: str, lookahead: int, gap: float,
                 extra: tuple[str, ...] = ()) -> list[dict]:
    """The same requests through ``paella serve`` (the real daemon, on the real-time
    simulated T4) from one client process, one at a time, ``gap`` seconds apart on
    average (uniform in [0.5, 1.5] x gap: the demo's load without its queueing)."""
    import shutil
    import tempfile
    from pathlib import Path

    from paella.client import connect
    from paella.child_daemon import start_daemon, stop_daemon
    repo = Path(tempfile.mkdtemp(prefix="paella-bench-rt-"))
    for name, b in bundles.items():
        os.symlink(b.path.resolve(), repo / name)
    proc, sock, tmp = start_daemon("--models", str(repo), "--backend", "sim", "--gpu", "t4",
                                   "--policy", policy, "--lookahead", str(lookahead), *extra,
                                   timeout=300)
    from paella.benchmarks.bench_roundtrip import client_core
    client_core()                             # this client away from the daemon's core
    rng = np.random.default_rng(0)
    lat: dict[str, list[float]] = {name: [] for name in bundles}
    try:
        with connect(sock) as c:
            inputs = {}
            for name, b in bundles.items():
                inputs[name] = {t.name: rng.standard_normal(t.shape).astype(t.dtype) for t in b.inputs}
                for _ in range(5):
                    c.infer(name, inputs[name])
            names = list(bundles)
            perf = time.perf_counter
            for i in range(n * len(names)):
                name = names[i % len(names)]
                time.sleep(gap * rng.uniform(0.5, 1.5))
                t0 = perf()
                c.infer(name, inputs[name])
                lat[name].append(perf() - t0)
    finally:
        code = stop_daemon(proc)
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.rmtree(repo, ignore_errors=True)
    if code != 0:
        raise RuntimeError(f"the daemon exited {code}")
    return [{"model": name, "p50_ms": statistics.median(v) * 1e3,
             "p90_ms": float(np.percentile(v, 90)) * 1e3} for name, v in lat.items()]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="bench_realtime", description=__doc__.split("\n")[0])
    ap.add_argument("--models", default=",".join(DEFAULT_MODELS))
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--lookahead", type=int, default=3)
    ap.add_argument("--policy", default="paella")
    ap.add_argument("--profile", help="write cProfile stats of the timed requests here")
    ap.add_argument("--fifo", action="store_true", help="run under SCHED_FIFO if allowed")
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--daemon", action="store_true",
                    help="also through the daemon, from one client process, one at a time")
    ap.add_argument("--gap", type=float, default=0.02,
                    help="seconds between requests: --daemon's mean; in process with --pause")
    ap.add_argument("--pause", action="store_true",
                    help="in process: sleep --gap between requests (the demo's spacing) instead "
                         "of serving them back to back")
    ap.add_argument("--spin", action="store_true",
                    help="with --pause: busy-wait the gap instead of sleeping")
    ap.add_argument("--late-lookup", action="store_true",
                    help="in process: the functional cache's lookup all at the last kernel, "
                         "on the loop (before session 14), instead of begun on the comparison "
                         "thread at the first kernel")
    ap.add_argument("--daemon-only", action="store_true", help="only the --daemon part")
    ap.add_argument("--daemon-args", default="", help="--daemon: more options for paella serve")
    ap.add_argument("--engine", action="store_true",
                    help="also the simulated GPU's own CPU per request (no dispatcher)")
    ap.add_argument("--kernel-core", default="auto", choices=("auto", "c", "python", "off"),
                    help="the dispatcher's kernel core, as the daemon's kernel_core setting "
                         "(default auto, the daemon's: the C core)")
    ap.add_argument("--no-spin", action="store_true",
                    help="one core pass per step, without spinning in C between the loop's "
                         "passes (the daemon's loop before session 22)")
    ap.add_argument("--virtual", action="store_true",
                    help="only serve --requests requests on the virtual-time T4, one at a time "
                         "(the same code without wall-clock waits: for instruction counts "
                         "under callgrind)")
    args = ap.parse_args(argv)
    from paella.experiments.zoo import DEFAULT_ZOO_DIR, ensure_bundles
    if args.fifo:
        try:
            os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(1))
        except OSError as e:
            print(f"(SCHED_FIFO refused: {e})")
    names = args.models.split(",")
    bundles = ensure_bundles(names, DEFAULT_ZOO_DIR)
    if args.virtual:
        for n in names:
            t = serve_virtual(bundles[n], n, request_io(bundles[n]), args.policy, args.lookahead,
                              args.requests)
            print(f"{n}: {len(t)} requests on the virtual-time T4, p50 {statistics.median(t) * 1e3:.3f} ms")
        return 0
    profiler = None
    if args.profile:
        import cProfile
        profiler = cProfile.Profile()
    rows = [] if args.daemon_only else [
        bench_model(bundles[n], n, args.requests, args.policy, args.lookahead, profiler,
                    args.gap if args.pause else 0.0, spin_wait if args.spin else time.sleep,
                    not args.late_lookup,
                    None if args.kernel_core == "off" else args.kernel_core,
                    0.0 if args.no_spin else 100e-6)
        for n in names]
    print(f"{'model':<15}{'kernels':>8}{'isolated':>10}{'p50':>9}{'p90':>9}{'ratio':>7}"
          f"{'extra':>9}{'/kernel':>9}{'cpu/req':>9}{'gap p50':>9}")
    for r in rows:
        print(f"{r['model']:<15}{r['kernels']:>8}{r['isolated_ms']:>8.3f}ms{r['p50_ms']:>7.3f}ms"
              f"{r['p90_ms']:>7.3f}ms{r['ratio']:>6.2f}x{r['extra_us']:>7.0f}us"
              f"{r['extra_per_kernel_us']:>7.1f}us{r['cpu_ms_per_request']:>7.3f}ms"
              f"{r['gap_p50_us']:>7.2f}us")
    if args.engine:
        freeze_heap()
        print("the simulated GPU's own CPU per request (virtual time, no dispatcher):")
        for n in names:
            cpu = engine_seconds(bundles[n])
            print(f"{n:<15}{cpu * 1e6:8.0f} us CPU")
            rows.append({"model": n, "path": "engine", "engine_cpu_us": cpu * 1e6})
    if args.daemon or args.daemon_only:
        drows = bench_daemon(bundles, args.requests, args.policy, args.lookahead, args.gap,
                             tuple(args.daemon_args.split()))
        print(f"through the daemon, one client, one request at a time (mean gap {args.gap * 1e3:g} ms):")
        for r in drows:
            print(f"{r['model']:<15}p50 {r['p50_ms']:.3f} ms  p90 {r['p90_ms']:.3f} ms")
        rows += [dict(r, path="daemon") for r in drows]
    if profiler is not None:
        profiler.dump_stats(args.profile)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
