"""``paella perf``: a load generator for a running daemon, like Triton's perf_analyzer.

Two kinds of sweep, over the local rings (the client library) or KServe v2 over HTTP
(``--kserve HOST:PORT``, binary tensors, one keep-alive connection per worker):

* ``--concurrency 1,2,4``: closed loop, N workers each sending its next request as
  soon as the last one answered;
* ``--rate 100,200``: open loop, requests sent at scheduled arrival times, Poisson
  (exponential gaps) or lognormal gaps of the same mean (``--arrivals``, ``--sigma``);
  latency counts from the scheduled time, so a generator that falls behind shows as
  latency rather than hiding it.

Per point: p50, p90 and p99 latency, mean, throughput, errors; to ``--csv`` (the
columns perf_analyzer writes, in microseconds), ``--json`` and ``--plot`` (latency
percentiles against throughput, needs matplotlib: the ``plots`` extra). Progress goes
to stderr once a second. Inputs are random, of the model's shapes and dtypes.
"""
from __future__ import annotations

import argparse
import csv
import http.client
import json
import math
import os
import queue
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from typing import Callable

import numpy as np

from paella import wire
from paella.client.client import connect, default_socket
from paella.client.errors import PaellaError

KSERVE_DTYPES = {"BOOL": "bool", "UINT8": "uint8", "UINT16": "uint16", "UINT32": "uint32",
                 "UINT64": "uint64", "INT8": "int8", "INT16": "int16", "INT32": "int32",
                 "INT64": "int64", "FP16": "float16", "FP32": "float32", "FP64": "float64"}


class PerfError(Exception):
    """A setting or a target that cannot be measured: the message says why."""


@dataclass
class Point:
    """One measured load point."""
    concurrency: int | None
    rate: float | None
    seconds: float
    requests: int
    errors: int
    throughput_rps: float
    p50_ms: float
    p90_ms: float
    p99_ms: float
    mean_ms: float
    first_error: str = ""


@dataclass
class Sender:
    """Makes one worker's ``send()``: runs one request, raises on failure. ``close()``
    closes the connections made so far (after each point)."""
    make: Callable[[], Callable[[], None]]
    closers: list[Callable[[], None]] = field(default_factory=list)

    def workers(self, n: int) -> list[Callable[[], None]]:
        try:
            return [self.make() for _ in range(n)]
        except (PaellaError, OSError) as e:
            self.close()
            raise PerfError(f"cannot open {n} connections: {e}") from None

    def close(self) -> None:
        while self.closers:
            self.closers.pop()()


# --- targets --------------------------------------------------------------------------
def local_target(socket: str, model: str, timeout: float, mode: str = "socket",
                 priority: int = 0) -> Sender:
    """Requests over the rings, one connection per worker, in wait ``mode``. The default
    is ``socket``: the workers are threads of one process, and a hybrid or polling waiter
    spins on its ring holding the GIL, so the other workers wait for the interpreter's
    switch interval (5 ms) and the generator, not the daemon, sets the latency."""
    try:
        probe = connect(socket)
    except PaellaError as e:
        raise PerfError(str(e)) from None
    with probe:
        m = probe.models.get(model)
        if m is None:
            raise PerfError(f"the daemon serves no model {model!r}; it serves "
                            f"{', '.join(sorted(probe.models)) or 'none'}")
    rng = np.random.default_rng(0)
    inputs = {t.name: _random(rng, t.dtype, t.shape) for t in m.variants[0].inputs}
    sender = Sender(lambda: None)

    def make() -> Callable[[], None]:
        c = connect(socket, mode=mode)
        sender.closers.append(c.close)
        return lambda: c.infer(model, inputs, timeout=timeout, priority=priority) and None
    sender.make = make
    return sender


def kserve_target(address: str, model: str, timeout: float, priority: int = 0) -> Sender:
    """Requests to a KServe v2 REST endpoint, binary tensors, a connection per worker."""
    host, _, port = address.rpartition(":")
    if not (port.isascii() and port.isdigit() and int(port) < 65536):
        raise PerfError(f"--kserve wants HOST:PORT, got {address!r}")
    conn = http.client.HTTPConnection(host, int(port), timeout=timeout)
    try:
        conn.request("GET", f"/v2/models/{model}")
        r = conn.getresponse()
        body = r.read()
    except OSError as e:
        raise PerfError(f"no KServe endpoint answers on {address}: {e}") from None
    finally:
        conn.close()
    if r.status != 200:
        raise PerfError(f"KServe endpoint {address}: model {model!r}: "
                        f"{json.loads(body or b'{}').get('error', r.status)}")
    md = json.loads(body)
    rng = np.random.default_rng(0)
    header, raw = [], b""
    for t in md["inputs"]:
        a = _random(rng, KSERVE_DTYPES[t["datatype"]], tuple(t["shape"]))
        header.append({"name": t["name"], "datatype": t["datatype"], "shape": t["shape"],
                       "parameters": {"binary_data_size": a.nbytes}})
        raw += a.tobytes()
    params: dict = {"binary_data_output": True}
    if priority:
        params["priority"] = priority        # (Triton's request parameter)
    head = json.dumps({"inputs": header, "parameters": params}).encode()
    payload = head + raw
    headers = {"Inference-Header-Content-Length": str(len(head)),
               "Content-Type": "application/octet-stream"}
    path = f"/v2/models/{model}/infer"
    sender = Sender(lambda: None)

    def make() -> Callable[[], None]:
        c = http.client.HTTPConnection(host, int(port), timeout=timeout)
        sender.closers.append(c.close)

        def send() -> None:
            c.request("POST", path, body=payload, headers=headers)
            r = c.getresponse()
            data = r.read()
            if r.status != 200:
                raise RuntimeError(f"HTTP {r.status}: {data[:200]!r}")
        return send
    sender.make = make
    return sender


def _random(rng: np.random.Generator, dtype: str, shape: tuple[int, ...]) -> np.ndarray:
    dt = np.dtype(dtype)
    if dt.kind == "f":
        return rng.random(shape).astype(dt)
    if dt.kind == "b":
        return rng.random(shape) < 0.5
    return rng.integers(0, 100, size=shape).astype(dt)


# --- load -------------------------------------------------------------------------------
class Recorder:
    """Latencies and errors of one point, shared by its workers."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.latencies: list[float] = []
        self.errors = 0
        self.first_error = ""

    def record(self, send: Callable[[], None], t0: float, measuring: bool) -> None:
        try:
            send()
        except Exception as e:  # noqa: BLE001 - every failure counts, the run goes on
            with self.lock:
                self.errors += measuring
                self.first_error = self.first_error or f"{type(e).__name__}: {e}"
            return
        if measuring:
            lat = time.perf_counter() - t0
            with self.lock:
                self.latencies.append(lat)


def run_concurrency(sender: Sender, n: int, seconds: float, warmup: float,
                    progress: Callable[[Recorder, float], None]) -> tuple[Recorder, float]:
    rec = Recorder()
    sends = sender.workers(n)
    t_start = time.perf_counter() + warmup
    t_end = t_start + seconds

    def worker(send: Callable[[], None]) -> None:
        while True:
            t0 = time.perf_counter()
            if t0 >= t_end:
                return
            rec.record(send, t0, t0 >= t_start)
    return rec, _run_threads([threading.Thread(target=worker, args=(s,)) for s in sends],
                             rec, t_start, t_end, progress)


def arrival_gaps(rate: float, arrivals: str, sigma: float, n: int, seed: int = 1) -> np.ndarray:
    """``n`` gaps (seconds) of mean 1/rate: exponential (Poisson arrivals), lognormal of
    that mean with shape ``sigma``, or constant."""
    rng = np.random.default_rng(seed)
    mean = 1.0 / rate
    if arrivals == "poisson":
        return rng.exponential(mean, n)
    if arrivals == "lognormal":
        return rng.lognormal(math.log(mean) - sigma ** 2 / 2, sigma, n)
    return np.full(n, mean)


def run_rate(sender: Sender, rate: float, arrivals: str, sigma: float, seconds: float,
             warmup: float, workers: int, progress: Callable[[Recorder, float], None]
             ) -> tuple[Recorder, float]:
    rec = Recorder()
    sends = sender.workers(workers)
    todo: queue.Queue[float | None] = queue.Queue()
    t_start = time.perf_counter() + warmup
    t_end = t_start + seconds
    gaps = arrival_gaps(rate, arrivals, sigma, int(rate * (seconds + warmup) * 1.5) + 16)

    def worker(send: Callable[[], None]) -> None:
        while (t0 := todo.get()) is not None:
            rec.record(send, t0, t_start <= t0 < t_end)

    def schedule() -> None:
        t = time.perf_counter()
        for gap in gaps:
            t += gap
            if t >= t_end:
                break
            delay = t - time.perf_counter()
            if delay > 0:
                time.sleep(delay)
            todo.put(t)                       # latency counts from the scheduled time
        for _ in sends:
            todo.put(None)
    threads = [threading.Thread(target=worker, args=(s,)) for s in sends]
    threads.append(threading.Thread(target=schedule))
    return rec, _run_threads(threads, rec, t_start, t_end, progress)


def _run_threads(threads: list[threading.Thread], rec: Recorder, t_start: float, t_end: float,
                 progress: Callable[[Recorder, float], None]) -> float:
    for t in threads:
        t.daemon = True
        t.start()
    while (alive := [t for t in threads if t.is_alive()]):
        alive[0].join(1.0)
        progress(rec, min(time.perf_counter(), t_end) - t_start)
    return t_end - t_start


def summarize(rec: Recorder, seconds: float, concurrency: int | None, rate: float | None) -> Point:
    lat = np.array(rec.latencies) * 1e3
    pct = (lambda q: float(np.percentile(lat, q))) if lat.size else (lambda q: math.nan)
    return Point(concurrency, rate, seconds, int(lat.size), rec.errors, lat.size / seconds,
                 pct(50), pct(90), pct(99), float(lat.mean()) if lat.size else math.nan,
                 rec.first_error)


# --- output -----------------------------------------------------------------------------
@dataclass
class RoundTrip:
    """Closed-loop round trips of one model in one wait mode (:func:`time_round_trips`)."""
    model: str
    mode: str
    n: int
    p50_us: float
    p99_us: float
    mean_us: float
    client_cpu: float      # client CPU seconds / wall seconds over the run


def time_round_trips(sock: str, model: str, mode: str, n: int, warmup: int = 300) -> RoundTrip:
    """``n`` requests back to back from one client, predict to read_result on one
    buffer (no input written, no output copied): the service path's own cost, which the
    demo and ``bench_roundtrip`` both report, so they time it the same way."""
    import resource
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


def write_csv(path: str, points: list[Point]) -> None:
    """perf_analyzer's columns (latencies in microseconds), plus ours."""
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["Concurrency", "Request Rate", "Inferences/Second", "p50 latency",
                    "p90 latency", "p99 latency", "Avg latency", "Requests", "Errors"])
        for p in points:
            w.writerow([p.concurrency or "", p.rate or "", f"{p.throughput_rps:.2f}",
                        round(p.p50_ms * 1e3), round(p.p90_ms * 1e3), round(p.p99_ms * 1e3),
                        round(p.mean_ms * 1e3), p.requests, p.errors])


def plot(path: str, points: list[Point], title: str) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise PerfError("--plot needs matplotlib: pip install 'paella-py[plots]'") from None
    fig, ax = plt.subplots(figsize=(6, 4))
    x = [p.throughput_rps for p in points]
    for key, style in (("p50_ms", "o-"), ("p90_ms", "s--"), ("p99_ms", "^-")):
        ax.plot(x, [getattr(p, key) for p in points], style, label=key[:3])
    for p in points:
        ax.annotate(f"c{p.concurrency}" if p.concurrency else f"{p.rate:g}/s",
                    (p.throughput_rps, p.p99_ms), fontsize=7, textcoords="offset points",
                    xytext=(3, 3))
    ax.set_xlabel("throughput (requests/s)")
    ax.set_ylabel("latency (ms)")
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# --- command ----------------------------------------------------------------------------
def _numbers(text: str, kind: type) -> list:
    try:
        vals = [kind(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}")
    if not vals or any(not 0 < v < 1e9 for v in vals):     # (also refuses nan and inf)
        raise argparse.ArgumentTypeError(f"expected positive numbers (below 1e9), got {text!r}")
    return vals


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("perf", help="load generator for a running daemon (like perf_analyzer)",
                       description=__doc__.splitlines()[0])
    p.add_argument("model", help="model name (e.g. echo, noop, resnet18)")
    where = p.add_mutually_exclusive_group()
    where.add_argument("--socket", help="the daemon's control socket (local rings; default "
                                        "$PAELLA_SOCKET or /run/paella/paella.sock)")
    where.add_argument("--kserve", metavar="HOST:PORT", help="a KServe v2 REST endpoint instead")
    load = p.add_mutually_exclusive_group()
    load.add_argument("--concurrency", type=lambda t: _numbers(t, int),
                      help="closed-loop sweep, e.g. 1,2,4,8 (default 1)")
    load.add_argument("--rate", type=lambda t: _numbers(t, float),
                      help="open-loop sweep in requests/s, e.g. 100,200,400")
    p.add_argument("--arrivals", choices=("poisson", "lognormal", "constant"), default="poisson",
                   help="open-loop arrival process (default poisson)")
    p.add_argument("--sigma", type=float, default=1.5, help="lognormal shape (default 1.5)")
    p.add_argument("--seconds", type=float, default=5.0, help="measured seconds per point")
    p.add_argument("--warmup", type=float, default=1.0, help="unmeasured seconds first")
    p.add_argument("--workers", type=int, default=16,
                   help="open loop: requests in flight at most (default 16)")
    p.add_argument("--timeout", type=float, default=30.0, help="per request, seconds")
    p.add_argument("--priority", type=int, default=0,
                   help=f"every request's priority, 1 (most urgent) .. {wire.MAX_PRIORITY}; "
                        "default none (the batchers' and the priority policy's middle level)")
    p.add_argument("--wait-mode", choices=("socket", "hybrid", "polling"), default="socket",
                   help="local rings: how workers wait (default socket: they are threads of "
                        "one process, and a spinning waiter holds the GIL)")
    p.add_argument("--csv", help="write the points as CSV (perf_analyzer's columns)")
    p.add_argument("--json", help="write the points as JSON")
    p.add_argument("--plot", help="write latency against throughput as an image")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress lines")
    p.set_defaults(func=_perf)


def _perf(args: argparse.Namespace) -> int:
    from paella.cli import CLIError
    if not (0 < args.seconds <= 1e6 and 0 <= args.warmup <= 1e6 and 1 <= args.workers <= 4096
            and 0 < args.sigma <= 100 and 0 < args.timeout <= 1e6):    # (nan and inf too)
        raise CLIError("--seconds, --workers, --sigma and --timeout must be positive, "
                       "--warmup >= 0 (all finite; at most 4096 workers)")
    for opt in ("csv", "json", "plot"):         # (checked now, not after the whole run)
        out = getattr(args, opt)
        if out and (os.path.isdir(out) or not os.path.isdir(os.path.dirname(os.path.abspath(out)))):
            raise CLIError(f"--{opt} {out}: not a file in an existing directory")
    if not 0 <= args.priority <= wire.MAX_PRIORITY:
        raise CLIError(f"--priority must be 1 (most urgent) .. {wire.MAX_PRIORITY}, or 0 for "
                       f"none; got {args.priority}")
    try:
        if args.kserve:
            sender = kserve_target(args.kserve, args.model, args.timeout, args.priority)
            transport = "kserve-http"
        else:
            sock = args.socket or default_socket()
            sender = local_target(sock, args.model, args.timeout, args.wait_mode, args.priority)
            transport = "local-rings"
        points = _sweep(args, sender)
    except PerfError as e:
        raise CLIError(str(e)) from None
    finally:
        if "sender" in locals():
            sender.close()
    print(f"{'concurrency' if args.rate is None else 'rate/s':>11} {'req/s':>9} {'p50 ms':>8} "
          f"{'p90 ms':>8} {'p99 ms':>8} {'errors':>6}")
    for p in points:
        print(f"{p.concurrency or p.rate:>11g} {p.throughput_rps:>9.1f} {p.p50_ms:>8.3f} "
              f"{p.p90_ms:>8.3f} {p.p99_ms:>8.3f} {p.errors:>6}")
    failed = [p for p in points if p.errors]
    if failed:
        print(f"first error: {failed[0].first_error}", file=sys.stderr)
    result = {"model": args.model, "transport": transport,
              "arrivals": None if args.rate is None else args.arrivals,
              "sigma": args.sigma if args.arrivals == "lognormal" and args.rate else None,
              "seconds": args.seconds, "priority": args.priority or None,
              "points": [asdict(p) for p in points]}
    try:
        if args.json:
            with open(args.json, "w") as f:
                json.dump(result, f, indent=1)
        if args.csv:
            write_csv(args.csv, points)
    except OSError as e:
        raise CLIError(f"cannot write {e.filename}: {e.strerror}") from None
    if args.plot:
        try:
            plot(args.plot, points, f"paella perf {args.model} ({transport}"
                 f"{', ' + args.arrivals + ' arrivals' if args.rate else ''})")
        except PerfError as e:
            raise CLIError(str(e)) from None
    return 1 if any(p.requests == 0 for p in points) else 0


def _sweep(args: argparse.Namespace, sender: Sender) -> list[Point]:
    points = []
    loads = args.rate if args.rate is not None else (args.concurrency or [1])
    for load in loads:
        label = f"rate {load:g}/s" if args.rate is not None else f"concurrency {load}"

        def progress(rec: Recorder, t: float, label: str = label) -> None:
            if args.quiet:
                return
            with rec.lock:
                n, errors = len(rec.latencies), rec.errors
            phase = "warm-up" if t < 0 else f"{t:4.1f}/{args.seconds:g} s"
            print(f"[{label}] {phase}: {n} requests, {errors} errors", file=sys.stderr,
                  flush=True)
        if args.rate is not None:
            rec, secs = run_rate(sender, load, args.arrivals, args.sigma, args.seconds,
                                 args.warmup, args.workers, progress)
            points.append(summarize(rec, secs, None, load))
        else:
            rec, secs = run_concurrency(sender, load, args.seconds, args.warmup, progress)
            points.append(summarize(rec, secs, load, None))
        sender.close()
    return points
