"""``paella experiment overhead``: where one request's latency goes (Figure 10).

One MobileNetV2 request at a time goes through the real daemon (``paella serve`` on the
real-time simulated T4) from a real client process (this one), and its end-to-end
latency, predict() to wait() returning, is split into:

* **communication**: client to daemon (push on the request ring, the daemon taking
  it) plus daemon to client (the completion's push on the ring and wake-up frame, the
  client's wake-up and poll);
* **scheduling and framework**: the dispatcher's share of the daemon's window while
  the simulated GPU is idle: job start (admission, greenlet, adaptor, first copy
  issued), the gaps between the job's device operations (notifications read, kernels
  released), and completion (last copy noticed, job finished: its completion is about
  to be pushed);
* **device**: the simulated GPU's busy time for the request (union of its copies'
  and kernels' intervals on the device clock, first H2D start to last D2H end minus
  idle gaps), plus the simulator's own CPU time that falls in the GPU's idle gaps: its
  engine's work, and its functional model's answer lookup ahead of each job (the
  dispatcher's ``answer_looked_up`` hook; session 27: before, about 2.5 us of it per
  request counted as the job's start, though a real GPU has no such lookup).

The simulator runs *stepped* inside the daemon's loop (``--sim-mode stepped``, the
default). Its CPU time (advancing the event loop, placing blocks, posting notifQ words,
moving the bytes of copies, and the CPU build that stands in for the kernels'
arithmetic) is not the scheduler's cost: a real GPU does that work in hardware. So the
traced daemon times every call into the simulator, and the part of that time during
which the simulated GPU was idle (and so delayed the dispatcher) is counted as device
time; the part that overlaps the GPU's busy time is already inside it. We did not use
``--sim-mode process``: its device clock lives in the child process, out of reach of
the daemon's timestamps, and on this 2-core machine a third busy process adds noise.

Timestamps: the client, the daemon and the simulated device all read CLOCK_MONOTONIC
(``time.perf_counter``; the real-time simulator's clock is ``perf_counter() - t0``),
so intervals from the three can be compared. The daemon is the real one
(``paella.dispatcher.daemon.main``) started through :func:`traced_daemon`, which hands
it an instrument (:mod:`paella.dispatcher.instruments`: each request's admission by the
dispatcher, its wake-up sent, its job finished just before the completion is pushed) and a traced
simulator (:func:`traced_sim`, the simulated GPU timing its own public methods and
recording each operation's device interval through the ``on_complete`` callbacks of the
device interface); it writes what it saw when it exits. Nothing patches the daemon's or
the dispatcher's code. Admission is when the dispatcher accepts the request, after the
front end took it off the ring and checked it, so that check counts as communication.
The components partition the client's
interval, so they add up to its end-to-end latency; the JSON states the residual
(float rounding). What tracing costs is measured: the same requests to an untraced
daemon give the untraced end-to-end latency.

Two cases: *back to back* (the next request right after the previous one returns, the
daemon still spinning) and *after idle* (a pause longer than the daemon's idle spin,
so the daemon sleeps in epoll and the client's push needs a KICK to wake it).
"""
from __future__ import annotations

import argparse
import contextlib
import math
import os
import shutil
import sys
import tempfile
import time
from array import array
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np

from paella.dispatcher.instruments import Instrument

MODEL = "mobilenetv2"
#: The traced daemon: argv[1] is where it writes its trace; the rest is `paella serve`'s.
TRACED_DAEMON = (sys.executable, "-c",
                 "import sys; from paella.experiments.overhead import traced_daemon; "
                 "sys.exit(traced_daemon())")
#: Pause of the "after idle" case: longer than the daemon's idle spin (200 us default).
IDLE_GAP_S = 0.005
FULL = {"n": 1000, "idle_n": 200, "echo_n": 1000, "spin_n": 300}
QUICK = {"n": 200, "idle_n": 50, "echo_n": 300, "spin_n": 100}
WARMUP = 20
#: Component names, in plot order.
COMPONENTS = ("communication", "scheduling_framework", "device")
#: Fields of a breakdown row that are counts, not durations.
COUNTS = ("kernels", "traced_calls")


# ======================================================================================
# Daemon side: the trace and the wrappers that fill it (they run in the daemon process).
# ======================================================================================
class _Trace(Instrument):
    """What the traced daemon saw, in ``perf_counter`` seconds, through the dispatcher's
    instruments (requests) and the traced device's public methods (device operations and
    simulator calls). Device operations and simulator calls are recorded only while a
    request is in flight (the daemon's start-up profiling and idle polling are left out)."""

    def __init__(self) -> None:
        self.open: dict[tuple[int, int], list[float]] = {}   # (client, req) -> [admit, wake]
        self.requests: list[tuple[int, int, float, float, float]] = []
        # Flat arrays of doubles, not lists of tuples: nothing for the garbage collector
        # to scan as they grow over thousands of requests.
        self.ops = array("d")            # start, end, kind of each GPU operation
        self.sim = array("d")            # start, end of each simulator call
        self.functional = array("d")     # start, end of each answer lookup ahead of a job
        self.device: Any = None          # the traced simulator (traced_sim)

    # -- the instruments: a request's admission, wake-up and delivered completion --------
    def request_admitted(self, req: Any) -> None:
        self.open[(req.client_id, req.req_id)] = [time.perf_counter(), math.nan, math.nan]

    def job_finished(self, job: Any) -> None:
        """Just before the job's completions are pushed: the end of the daemon's share.
        (A stamp after the push, in request_finished, can come later than a client
        spinning on its ring reads the entry.)"""
        t = time.perf_counter()
        for req in job.requests:
            rec = self.open.get((req.client_id, req.req_id))
            if rec is not None:
                rec[2] = t

    def answer_looked_up(self, job: Any, t0: float, t1: float) -> None:
        """The simulated GPU's answer lookup ahead of a job (its functional model, on the
        loop before the job starts): device work that a real GPU does not have."""
        self.functional.extend((t0, t1))

    def request_woken(self, req: Any) -> None:
        rec = self.open.get((req.client_id, req.req_id))
        if rec is not None and math.isnan(rec[1]):
            rec[1] = time.perf_counter()

    def request_finished(self, req: Any) -> None:
        rec = self.open.pop((req.client_id, req.req_id), None)
        if rec is not None:
            push = rec[2] if not math.isnan(rec[2]) else time.perf_counter()
            self.requests.append((req.client_id, req.req_id, rec[0], rec[1], push))

    def take_device_log(self) -> None:
        """The simulated GPU's self-log (``Gpu.logging``) into ``ops`` and ``sim``, in
        ``perf_counter`` seconds."""
        dev = self.device
        if dev is None:
            return
        ops_b, sim_b = dev.gpu.log_take()
        ops = np.frombuffer(ops_b, dtype=float).reshape(-1, 3).copy()
        ops[:, :2] += dev.offset
        self.ops.extend(ops.ravel())
        self.sim.extend(np.frombuffer(sim_b, dtype=float))

    def save(self, path: str) -> None:
        self.take_device_log()
        np.savez(path, requests=np.array(self.requests, dtype=float).reshape(-1, 5),
                 ops=np.frombuffer(self.ops, dtype=float).reshape(-1, 3),
                 sim=np.frombuffer(self.sim, dtype=float).reshape(-1, 2),
                 functional=np.frombuffer(self.functional, dtype=float).reshape(-1, 2))


def traced_sim(trace: _Trace, gpu: str) -> Any:
    """The real-time simulated GPU stepped in the daemon's loop, with its self-log on
    (``Gpu.logging``): the engine itself records, in C, each kernel's and copy's device
    interval (a kernel from its issue, so its launch latency is device time; a copy from
    its start) and each stretch of its own work (firing due events, taking a launch or a
    copy: the simulator's CPU, which includes the CPU build when it runs as the plan's
    last kernel's effect), and the device's own Python work for its functional model as
    an effect kernel is launched (its answer lookup: ``Gpu.log_work``; session 27: before,
    it went uncounted, and as it can outlast the kernel, the GPU's idle gap after that
    kernel was put down to the scheduler). ``functional`` holds the answer lookups ahead
    of jobs, which run outside the device (``_Trace.answer_looked_up``).
    Nothing on the device is replaced in Python, so the daemon runs as it does untraced:
    its kernel core launches into the engine directly and spins in C (``Core.spin``).
    Before session 22 the device's methods were wrapped in Python, which took the core
    off its direct path: the figure then measured a slower dispatcher than the one
    users run."""
    from paella.dispatcher.devices.sim import SimDevice

    dev = SimDevice(gpu, realtime=True)
    # Device time + offset = perf_counter time (the real-time clock at speed 1).
    dev.offset = time.perf_counter() - dev.now()
    dev.gpu.logging = True
    trace.device = dev
    return dev


def wrapper_cost_us(n: int = 20000) -> float:
    """What one self-log entry adds, bounded from above: two clock reads, timed here from
    Python (the engine makes them in C, with a memcpy, and no call per entry)."""
    perf = time.perf_counter
    best = math.inf
    for _ in range(3):
        t = perf()
        for _ in range(n):
            perf()
            perf()
        mid = perf()
        for _ in range(n):
            pass
        best = min(best, ((mid - t) - (perf() - mid)) / n)
    return best * 1e6


def traced_daemon(argv: list[str] | None = None) -> int:
    """``paella serve`` with timestamps: argv[0] is the trace file (.npz), the rest the
    daemon's options. The trace is written when the daemon exits. The daemon is the real
    one, given the trace as an instrument and the traced simulator as its device."""
    args = sys.argv[1:] if argv is None else argv
    trace = _Trace()
    from paella.dispatcher.daemon import main

    def open_device(cfg: Any) -> Any:
        if cfg.backend != "sim" or cfg.sim_mode != "stepped":
            raise SystemExit("overhead: the traced daemon needs the simulator stepped in its "
                             "loop (--backend sim --sim-mode stepped)")
        return traced_sim(trace, cfg.gpu)
    try:
        return main(args[1:], instruments=[trace], open_device=open_device)
    finally:
        trace.save(args[0])


# ======================================================================================
# Client side.
# ======================================================================================
@dataclass
class Sample:
    """One request as the client saw it (perf_counter seconds)."""
    client_id: int
    req_id: int
    t_predict: float
    t_done: float


def run_requests(sock: str, model: str, n: int, gap: float, seed: int,
                 warmup: int = WARMUP) -> tuple[list[Sample], float]:
    """``n`` requests one at a time (``gap`` seconds apart, 0: back to back), after
    ``warmup`` untimed ones. One fixed input, so the daemon's CPU build runs once.
    Returns the samples and the median time to write the inputs into the arena (part
    of the client's own work, before predict; not in the end-to-end)."""
    from paella.client import connect
    perf = time.perf_counter
    with connect(sock) as c:
        m = c.model(model)
        v = m.variants[0]
        off = c.alloc(v.io_bytes)
        ins, _ = c.io_views(m.model_id, off)
        rng = np.random.default_rng(seed)
        x = {k: rng.standard_normal(a.shape).astype(a.dtype) for k, a in ins.items()}
        writes = []
        for _ in range(20):
            t = perf()
            for k, a in ins.items():
                a[...] = x[k]
            writes.append(perf() - t)
        for _ in range(warmup):
            c.wait(c.predict(m.model_id, v.io_bytes, off))
        out = []
        for _ in range(n):
            if gap:
                time.sleep(gap)
            t = perf()
            rid = c.predict(m.model_id, v.io_bytes, off)
            c.wait(rid)
            out.append(Sample(c.client_id, rid, t, perf()))
    return out, float(np.median(writes))


# ======================================================================================
# Analysis.
# ======================================================================================
def _union(iv: np.ndarray) -> list[tuple[float, float]]:
    out: list[list[float]] = []
    for s, e in sorted(map(tuple, iv)):
        if out and s <= out[-1][1]:
            out[-1][1] = max(out[-1][1], e)
        else:
            out.append([s, e])
    return [(s, e) for s, e in out]


def _overlap(iv: np.ndarray, lo: float, hi: float, busy: list[tuple[float, float]]) -> float:
    """Time of the (disjoint) intervals ``iv`` inside [lo, hi] and outside ``busy``."""
    total = 0.0
    for s, e in iv:
        s, e = max(s, lo), min(e, hi)
        if e <= s:
            continue
        total += e - s
        for bs, be in busy:
            total -= max(0.0, min(e, be) - max(s, bs))
    return total


def _window(arr: np.ndarray, lo: float, hi: float) -> np.ndarray:
    """Rows of ``arr`` (sorted by column 0) that may overlap [lo, hi]."""
    i = np.searchsorted(arr[:, 0], lo, "left")
    j = np.searchsorted(arr[:, 0], hi, "right")
    return arr[max(i - 1, 0):j]


def breakdown(samples: list[Sample], trace: dict[str, np.ndarray]) -> list[dict[str, float]]:
    """Per request, every component in microseconds (see the module docstring)."""
    reqs = {(int(r[0]), int(r[1])): r[2:] for r in trace["requests"]}
    ops = trace["ops"][np.argsort(trace["ops"][:, 1], kind="stable")]
    ends = ops[:, 1]
    cpu = {k: trace[k][np.argsort(trace[k][:, 0])] for k in ("sim", "functional")}
    rows = []
    for smp in samples:
        admit, wake, push = reqs[(smp.client_id, smp.req_id)]
        mine = ops[np.searchsorted(ends, admit, "right"):np.searchsorted(ends, push, "right")]
        if not len(mine):
            raise RuntimeError(f"request {smp.req_id} has no device operation in the trace; "
                               f"was the model served by the dispatcher path?")
        busy = _union(np.clip(mine[:, :2], admit, push))
        first, last = busy[0][0], busy[-1][1]
        busy_t = sum(e - s for s, e in busy)

        def idle_cpu(lo: float, hi: float) -> float:
            return sum(_overlap(_window(cpu[k], lo, hi), lo, hi, busy) for k in cpu)
        start_cpu, gaps_cpu, end_cpu = idle_cpu(admit, first), idle_cpu(first, last), idle_cpu(last, push)
        sim_idle = _overlap(_window(cpu["sim"], admit, push), admit, push, busy)
        calls = len(mine) + sum(int(np.sum((cpu[k][:, 0] >= admit) & (cpu[k][:, 0] <= push))) for k in cpu)
        r = {
            "e2e": smp.t_done - smp.t_predict,
            "comm_in": admit - smp.t_predict,
            "comm_out": smp.t_done - push,
            "sched_start": (first - admit) - start_cpu,
            "sched_gaps": (last - first) - busy_t - gaps_cpu,
            "sched_completion": (push - last) - end_cpu,
            "device_busy": busy_t,
            "sim_cpu_idle": sim_idle,
            "functional_cpu_idle": start_cpu + gaps_cpu + end_cpu - sim_idle,
            "device_span": last - first,
            "kernels": float(np.sum(mine[:, 2] == 0)),
            "traced_calls": float(calls + 3),       # + admission, wake-up, completion
            "wake_before_push": push - wake if not math.isnan(wake) else math.nan,
        }
        r["communication"] = r["comm_in"] + r["comm_out"]
        r["scheduling_framework"] = r["sched_start"] + r["sched_gaps"] + r["sched_completion"]
        r["device"] = r["device_busy"] + r["sim_cpu_idle"] + r["functional_cpu_idle"]
        r["residual"] = r["e2e"] - sum(r[k] for k in COMPONENTS)
        rows.append({k: (v if k in COUNTS else v * 1e6) for k, v in r.items()})
    return rows


def summarize(rows: list[dict[str, float]]) -> dict[str, dict[str, float]]:
    """Median, p99, mean, min and max of every field."""
    out = {}
    for k in rows[0]:
        a = np.array([r[k] for r in rows], dtype=float)
        a = a[~np.isnan(a)]
        if len(a):
            out[k] = {"p50": float(np.median(a)), "p99": float(np.percentile(a, 99)),
                      "mean": float(a.mean()), "min": float(a.min()), "max": float(a.max())}
    return out


def _echo_summary(samples: list[Sample], trace: dict[str, np.ndarray]) -> dict[str, float]:
    """The echo model (computed on the daemon's CPU): its round trip is communication
    plus a few microseconds of host work, an independent check of the communication
    component."""
    reqs = {(int(r[0]), int(r[1])): r[2:] for r in trace["requests"]}
    e2e = np.array([s.t_done - s.t_predict for s in samples]) * 1e6
    comm = np.array([(reqs[(s.client_id, s.req_id)][0] - s.t_predict)
                     + (s.t_done - reqs[(s.client_id, s.req_id)][2]) for s in samples]) * 1e6
    return {"n": len(samples), "e2e_p50_us": float(np.median(e2e)),
            "e2e_p99_us": float(np.percentile(e2e, 99)),
            "communication_p50_us": float(np.median(comm))}


# ======================================================================================
# The experiment.
# ======================================================================================
@dataclass
class Setting:
    model: str
    gpu: str
    policy: str
    n: int
    idle_n: int
    echo_n: int
    spin_n: int
    idle_gap_ms: float
    sim_mode: str
    daemon_args: list[str]
    seed: int


def _placement(pid: int) -> dict[str, Any]:
    """Where the daemon's loop runs: its cores and whether SCHED_FIFO was granted (it
    pins itself before it reports READY)."""
    names = {os.SCHED_FIFO: "SCHED_FIFO", os.SCHED_OTHER: "SCHED_OTHER"}
    return {"cores": sorted(os.sched_getaffinity(pid)),
            "policy": names.get(os.sched_getscheduler(pid), str(os.sched_getscheduler(pid))),
            "machine_cores": os.cpu_count()}


def _pin_away(pid: int) -> None:
    """Keep this process (the client) off the daemon's core when the daemon pinned its
    loop; a daemon started with ``--cpu none`` shares every core and nothing moves."""
    rest = os.sched_getaffinity(0) - os.sched_getaffinity(pid)
    if rest:
        os.sched_setaffinity(0, rest)


def isolated_device_us(bundle_path: Path, gpu: str) -> float:
    """The same request alone on the simulated GPU in virtual time (the calibration's
    measurement): the device time the daemon's GPU-busy component should equal."""
    from paella.bundle import load_bundle
    from paella.dispatcher.devices.sim import CostModel
    from paella.experiments.calibrate import simulate
    return simulate(load_bundle(bundle_path), CostModel(), gpu) * 1e6


@contextlib.contextmanager
def _daemon(args: tuple[str, ...], trace_path: str | None) -> Iterator[tuple[str, dict]]:
    """A daemon (traced when ``trace_path`` is given) with this process, the client, kept
    off its core. Yields (socket, placement); checks the daemon exits cleanly."""
    from paella.child_daemon import DAEMON, start_daemon, stop_daemon
    cores = os.sched_getaffinity(0)      # the daemon inherits them: restored at the end
    command = (*TRACED_DAEMON, trace_path) if trace_path else DAEMON
    proc, sock, tmp = start_daemon(*args, timeout=300, command=command)
    try:
        placement = _placement(proc.pid)
        _pin_away(proc.pid)
        yield sock, placement
    finally:
        os.sched_setaffinity(0, cores)
        code = stop_daemon(proc)
        shutil.rmtree(tmp, ignore_errors=True)
    if code != 0:
        raise RuntimeError(f"the daemon exited with status {code}; see its log above")


def _load_trace(path: str) -> dict[str, np.ndarray]:
    with np.load(path) as z:
        return {k: z[k] for k in z.files}


def run(bundle_path: Path, setting: Setting, progress: Callable[[str], None] = print,
        untraced: bool = True) -> dict:
    """Serve ``bundle_path`` from traced daemons, time the requests, split them up.

    Daemon 1 (as configured): back to back, after idle, echo. Daemon 2 (``--idle spin``):
    back to back, for the cost of the adaptive idle mode. Daemon 3 (untraced, unless
    ``untraced`` is False): back to back, for the cost of tracing."""
    repo = Path(tempfile.mkdtemp(prefix="paella-overhead-"))
    os.symlink(Path(bundle_path).resolve(), repo / setting.model)
    args = ("--models", str(repo), "--backend", "sim", "--gpu", setting.gpu,
            "--sim-mode", setting.sim_mode, "--policy", setting.policy, *setting.daemon_args)
    m, seed = setting.model, setting.seed
    samples: dict[str, list[Sample]] = {}
    traces: dict[str, dict[str, np.ndarray]] = {}
    try:
        path = str(repo / "trace.npz")
        progress(f"traced daemon ({m} on the simulated {setting.gpu}): {setting.n} requests back "
                 f"to back, {setting.idle_n} {setting.idle_gap_ms:g} ms apart, {setting.echo_n} echo")
        with _daemon(args, path) as (sock, placement):
            samples["back_to_back"], write_s = run_requests(sock, m, setting.n, 0.0, seed)
            samples["after_idle"], _ = run_requests(sock, m, setting.idle_n,
                                                    setting.idle_gap_ms / 1e3, seed)
            echo, _ = run_requests(sock, "echo", setting.echo_n, 0.0, seed)
        traces["back_to_back"] = traces["after_idle"] = _load_trace(path)
        if setting.spin_n:
            path = str(repo / "trace-spin.npz")
            progress(f"traced daemon with --idle spin: {setting.spin_n} requests back to back")
            with _daemon((*args, "--idle", "spin"), path) as (sock, _):
                samples["spin_back_to_back"], _ = run_requests(sock, m, setting.spin_n, 0.0, seed)
            traces["spin_back_to_back"] = _load_trace(path)
        plain = None
        if untraced:
            progress(f"untraced daemon (what tracing costs): {setting.n} requests back to back")
            with _daemon(args, None) as (sock, _):
                plain, _ = run_requests(sock, m, setting.n, 0.0, seed)
    finally:
        shutil.rmtree(repo, ignore_errors=True)
    cases = {}
    for name, smp in samples.items():
        rows = breakdown(smp, traces[name])
        cases[name] = {"n": len(rows), "stats_us": summarize(rows)}
    data: dict[str, Any] = {"setting": asdict(setting), "daemon": placement, "cases": cases,
                            "echo": _echo_summary(echo, traces["back_to_back"]),
                            "input_write_us": write_s * 1e6, "wrapper_cost_us": wrapper_cost_us(),
                            "isolated_device_us": isolated_device_us(bundle_path, setting.gpu),
                            "load_average": os.getloadavg()[1]}     # 5 minutes, at the end
    if plain is not None:
        e2e = np.array([s.t_done - s.t_predict for s in plain]) * 1e6
        data["untraced_e2e_us"] = {"p50": float(np.median(e2e)), "p99": float(np.percentile(e2e, 99))}
    data["summary"] = _summary(data)
    return data


#: What the paper says about Figure 10 (its bars' values are not in the text).
PAPER = {
    "figure_values_in_text": False,
    "mobilenetv2_ms": 1.67,
    "claims": [
        "Paella's scheduling and framework overhead is comparable to Triton's (FIFO) and lower "
        "than Clockwork's; even against Paella's own FIFO ablations it is minimal.",
        "Paella's communication (serialization and syscalls) is lower than Clockwork's and much "
        "lower than Triton's (gRPC).",
        "All network latency and CUDA execution time are excluded from the figure.",
        "Assuming MobileNet and Figure 10's per-job dispatch overhead, job dispatch rates could "
        "grow ~30x before hurting Paella's throughput (Section 7.3).",
    ],
}


def _summary(data: dict) -> dict:
    s = data["cases"]["back_to_back"]["stats_us"]
    med = {k: s[k]["p50"] for k in COMPONENTS}
    mean = {k: s[k]["mean"] for k in COMPONENTS}
    out = {"median_us": med, "p99_us": {k: s[k]["p99"] for k in COMPONENTS},
           "e2e_p50_us": s["e2e"]["p50"], "e2e_p99_us": s["e2e"]["p99"],
           "sum_of_means_us": sum(mean.values()), "e2e_mean_us": s["e2e"]["mean"],
           "max_abs_residual_us": max(abs(s["residual"]["p50"]), abs(s["residual"]["p99"]),
                                      abs(s["residual"]["mean"])),
           "gpu_busy_us": s["device_busy"]["p50"], "isolated_device_us": data["isolated_device_us"],
           "simulator_cpu_us": s["sim_cpu_idle"]["p50"] + s["functional_cpu_idle"]["p50"],
           "release_gap_us": s["sched_gaps"]["p50"] / max(s["kernels"]["p50"] - 1, 1),
           "gpu_over_overhead": s["device_busy"]["p50"] / (med["communication"]
                                                          + med["scheduling_framework"]),
           "paper": PAPER}
    out["tracing_estimate_us"] = s["traced_calls"]["p50"] * data["wrapper_cost_us"]
    if "untraced_e2e_us" in data:
        out["tracing_cost_us"] = s["e2e"]["p50"] - data["untraced_e2e_us"]["p50"]
    return out


LABELS = {"communication": "communication", "sched_start": "sched.: job start",
          "sched_gaps": "sched.: releases", "sched_completion": "sched.: completion",
          "device_busy": "device: GPU busy", "sim_cpu_idle": "device: simulator CPU",
          "functional_cpu_idle": "device: answer lookup"}
COLORS = {"communication": "#4c72b0", "sched_start": "#dd8452", "sched_gaps": "#e8a877",
          "sched_completion": "#c44e52", "device_busy": "#55a868", "sim_cpu_idle": "#8fd19e",
          "functional_cpu_idle": "#b8e0c0"}


def plot(data: dict, path: str) -> None:
    """Left: every component (the simulator's CPU dominates). Right: the paper's view,
    the overheads alone (Figure 10 excludes the GPU's execution time)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (left, right) = plt.subplots(1, 2, figsize=(8.0, 2.8), gridspec_kw={"width_ratios": [1, 1]})
    names = list(data["cases"])
    overheads = ("communication", "sched_start", "sched_gaps", "sched_completion")
    for ax, keys, unit in ((left, list(LABELS), 1e3), (right, overheads, 1.0)):
        for y, name in enumerate(names):
            st = data["cases"][name]["stats_us"]
            x = 0.0
            for k in keys:
                w = st[k]["p50"] / unit
                ax.barh(y, w, left=x, color=COLORS[k], label=LABELS[k] if y == 0 else None)
                x += w
        ax.set_yticks(range(len(names)), [n.replace("_", " ") for n in names], fontsize=7)
        ax.invert_yaxis()
    for y, name in enumerate(names):
        left.plot([data["cases"][name]["stats_us"]["e2e"]["p50"] / 1e3], [y], "k|", ms=14)
    left.set_xlabel("ms (medians; | = median end-to-end)", fontsize=7)
    right.set_xlabel("us (medians): communication + scheduling & framework", fontsize=7)
    right.set_yticks([])
    left.set_title(f"one {data['setting']['model']} request through the daemon", fontsize=8)
    right.set_title("overheads only (the paper's Figure 10 view)", fontsize=8)
    handles, labels = left.get_legend_handles_labels()
    fig.legend(handles, labels, fontsize=6.5, ncol=4, loc="lower center", frameon=False)
    fig.tight_layout(rect=(0, 0.14, 1, 1))    # (save_figure's own layout would drop the legend)
    fig.savefig(path, dpi=90)
    plt.close(fig)


def _print(data: dict) -> None:
    for name, case in data["cases"].items():
        st = case["stats_us"]
        print(f"\n{name.replace('_', ' ')} ({case['n']} requests)   p50 us   p99 us   mean us")
        for k in ("e2e", *COMPONENTS, "comm_in", "comm_out", *list(LABELS)[1:], "device_span",
                  "wake_before_push", "residual"):
            if k in st:
                print(f"  {k:<24}{st[k]['p50']:>9.1f}{st[k]['p99']:>9.1f}{st[k]['mean']:>10.1f}")
    e = data["echo"]
    print(f"\necho round trip (communication only): p50 {e['e2e_p50_us']:.1f} us, "
          f"p99 {e['e2e_p99_us']:.1f} us")
    sm = data["summary"]
    print(f"tracing: {data['cases']['back_to_back']['stats_us']['traced_calls']['p50']:.0f} traced "
          f"calls per request x {data['wrapper_cost_us']:.2f} us = {sm['tracing_estimate_us']:.0f} us")
    if "untraced_e2e_us" in data:
        print(f"untraced daemon, back to back: e2e p50 {data['untraced_e2e_us']['p50']:.1f} us "
              f"(traced minus untraced: {sm['tracing_cost_us']:.1f} us at the median)")
    print(f"client's input write into the arena (not in e2e): {data['input_write_us']:.1f} us")


def register(sub: argparse._SubParsersAction) -> None:
    from paella.experiments.cli import add_common
    p = sub.add_parser("overhead", help="Figure 10: one request's latency through the daemon, by component",
                       description=__doc__.splitlines()[0])
    add_common(p)
    p.add_argument("--model", default=MODEL, help=f"zoo model (default {MODEL})")
    p.add_argument("--gpu", default="t4")
    p.add_argument("--policy", default="paella")
    p.add_argument("--n", type=int, help="back-to-back requests (default 1000, --quick 200)")
    p.add_argument("--daemon-arg", action="append", default=[],
                   help="extra `paella serve` option (repeatable), e.g. --daemon-arg=--rt-priority=0; "
                        "default: the daemon's own (loop pinned to the last core, SCHED_FIFO)")
    p.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    from paella.experiments.cli import finish
    from paella.experiments.zoo import ensure_bundles
    t0 = time.perf_counter()
    sizes = dict(QUICK if args.quick else FULL)
    if args.n:
        sizes["n"] = args.n
    bundle = ensure_bundles([args.model])[args.model]
    setting = Setting(args.model, args.gpu, args.policy, sizes["n"], sizes["idle_n"], sizes["echo_n"],
                      sizes["spin_n"], IDLE_GAP_S * 1e3, "stepped", args.daemon_arg, args.seed)
    data = run(bundle.path, setting, progress=lambda m: print(f"[overhead] {m}", flush=True))
    _print(data)
    return finish(data, args, plot, t0)
