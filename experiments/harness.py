"""Virtual-time harness: lognormal clients against the dispatcher on the simulated GPU.

One process, one clock. Each loop iteration submits the requests that have arrived,
runs one :meth:`Dispatcher.step`, measures the CPU time that step took
(``time.thread_time``, less the clock's own share of the window) and advances the
simulated GPU by that much (times
``cpu_scale``): the dispatcher's own overhead costs simulated latency, as it would on a
real machine, while the GPU keeps running underneath. Time spent *inside* the
simulator's methods (placing blocks, scheduling its events) is not the dispatcher's: it
is measured apart and replaced by ``device_call_cost`` per call (a CUDA driver call's
CPU cost, about 2 us for a launch). An iteration that changed nothing
is a poll; the clock then jumps to the next device event or arrival (Trio's rule: never
spin when nothing can happen). The loop is the project's one virtual-time driver
(:class:`~paella.dispatcher.virtual_time.VirtualDriver`); :class:`CpuCharge` is its
charge hook here.

``run_point`` is what the experiments call, e.g. ``hol --driver dispatcher``:
``run_point(PointConfig(policy, rate, sigma, n, seed, gpu="gtx1660s", cpu_scale=...),
[Workload("fig2", adaptor_for(figure2_job(), 64, 64))])``, :func:`adaptor_for` turning a
:class:`paella.models.synthetic.SyntheticJob` into an adaptor factory. ``cpu_scale=0`` is
a free dispatcher (the policy and mechanism alone); 1 charges this Python dispatcher in
full.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from paella.cpu_clock import clock_overhead
from paella.dispatcher.adaptor import JobAdaptor, PlanAdaptor, synthetic_plan
from paella.dispatcher.core import DEFAULT_SETS_AHEAD, STATUS_OK, Dispatcher, Request
from paella.dispatcher.devices.sim import SimDevice
from paella.dispatcher.virtual_time import VirtualDriver
from paella.experiments.workload import arrival_rate, latency_summary, lognormal_arrivals

#: Real streams in the device pool. Many more than hardware queues, as Paella creates:
#: the ``pool`` mapping never makes a kernel wait behind another in its stream, and
#: ``ms-jbj`` gets one stream per job (reused after this many jobs).
DEFAULT_STREAMS = 1024


@dataclass
class Workload:
    """One kind of request: a model, its share of the arrivals, and its client."""
    name: str
    make_adaptor: Callable[[], JobAdaptor]
    weight: float = 1.0
    client_id: int | None = None       # None: its index among the workloads


@dataclass
class PointConfig:
    policy: str
    rate: float                         # requests/s, all workloads together
    sigma: float = 1.5
    n_requests: int = 1000
    seed: int = 1
    gpu: str = "t4"
    n_streams: int = DEFAULT_STREAMS
    group: int = 16
    extra_blocks: int | None = None
    fairness_threshold: float | None = None
    #: The dispatcher's saturation rule (None: its default; 0: off; docs/dispatcher.md).
    saturation_backlog: int | None = None
    policy_options: dict[str, Any] = field(default_factory=dict)
    cpu_scale: float = 1.0              # 0: a free dispatcher; 1: charge what it costs here
    kernel_core: str | None = "auto"    # what runs the per-kernel path (Dispatcher(kernel_core=))
    device_call_cost: float = 2e-6      # seconds charged per device call instead of the sim's
    decision_delay: float = 0.0         # seconds added per kernel release (Figure 9's synthetic delay)
    profile_runs: int = 2
    warmup: float = 0.1                 # fraction of requests excluded from statistics
    buffer_sets_ahead: int = DEFAULT_SETS_AHEAD   # (Dispatcher(buffer_sets_ahead=), the daemon's)


def adaptor_for(job: Any, in_bytes: int = 4096, out_bytes: int = 4096) -> Callable[[], JobAdaptor]:
    """A factory of plan adaptors for a ``SyntheticJob`` (kernels run in order)."""
    rows = [(k.name, k.grid, k.block, k.regs_per_thread, k.duration) for k in job.kernels]
    smem = max((k.smem for k in job.kernels), default=0)
    return lambda: PlanAdaptor(synthetic_plan(job.name, rows, in_bytes, out_bytes, smem=smem))


def run_point(cfg: PointConfig, workloads: list[Workload]) -> dict:
    """Simulate ``cfg.n_requests`` lognormal arrivals; per-workload latency statistics."""
    dev = SimDevice(cfg.gpu, n_streams=cfg.n_streams, seed=cfg.seed)
    d = Dispatcher(dev, cfg.policy, extra_blocks=cfg.extra_blocks, group=cfg.group,
                   fairness_threshold=cfg.fairness_threshold,
                   saturation_backlog=cfg.saturation_backlog,
                   policy_options=dict(cfg.policy_options), profile_runs=cfg.profile_runs,
                   kernel_core=cfg.kernel_core, buffer_sets_ahead=cfg.buffer_sets_ahead)
    mids = [d.register_model(w.name, w.make_adaptor()) for w in workloads]
    ios = [np.zeros(max(d.models[m].adaptor.io_bytes, 1), np.uint8) for m in mids]
    n = cfg.n_requests
    rng = np.random.default_rng(cfg.seed)
    weights = np.array([w.weight for w in workloads], float)
    kinds = rng.choice(len(workloads), n, p=weights / weights.sum())
    t0 = dev.now()
    arrivals = t0 + lognormal_arrivals(cfg.rate, cfg.sigma, n, cfg.seed)
    done = np.full(n, np.nan)
    status = np.zeros(n, int)

    def complete(req: Request, st: int, err: str | None) -> None:
        done[req.req_id] = dev.now()
        status[req.req_id] = st

    # A free dispatcher (cpu_scale 0) without synthetic delay needs no CPU meter, and
    # measuring is not free: time.thread_time is a system call (~0.5 us; 10 us measured
    # here while the machine was loaded).
    measure = cfg.cpu_scale > 0 or cfg.decision_delay > 0
    meter = device_meter(d, cfg.device_call_cost) if measure else None
    cpu = _drive(d, dev, arrivals, lambda i: d.submit(Request(
        i, _client(workloads, kinds[i]), mids[kinds[i]], ios[kinds[i]], on_complete=complete)),
        cfg.cpu_scale, meter, cfg.decision_delay)
    if np.any(status != STATUS_OK):
        raise RuntimeError(f"{int(np.sum(status != STATUS_OK))} requests failed in the harness")
    warm = int(n * cfg.warmup)
    keep = slice(warm, n)
    lat = done[keep] - arrivals[keep]
    span = np.nanmax(done[keep]) - arrivals[warm]
    # "offered": the nominal rate; "arrival_rate": the rate the kept arrivals had.
    out = {"policy": cfg.policy, "offered": cfg.rate,
           "arrival_rate": arrival_rate(arrivals[warm:], cfg.rate),
           "sigma": cfg.sigma, "throughput": float((n - warm) / span), **latency_summary(lat),
           "per_model": {}, "iterations": d.iterations,
           "cpu_per_iteration_us": 1e6 * cpu / max(d.iterations, 1) if measure else None,
           "policy_failure": getattr(d, "policy_failure", None)}
    for k, w in enumerate(workloads):
        mask = kinds[keep] == k
        out["per_model"][w.name] = {"count": int(mask.sum()), **latency_summary(lat[mask])}
    return out


def _client(workloads: list[Workload], k: int) -> int:
    c = workloads[k].client_id
    return k if c is None else c


def device_meter(d: Dispatcher, call_cost: float) -> "DeviceMeter | CoreMeter":
    """The meter that charges ``d``'s device calls at ``call_cost`` each, in place of
    the simulator's own time: a :class:`CoreMeter` where a kernel core launches into the
    engine directly, else a :class:`DeviceMeter` (which wraps the device's methods)."""
    if d.core is not None and d.core.direct:
        return CoreMeter(d.core, call_cost)
    return DeviceMeter(d.device, call_cost)


class CoreMeter:
    """:class:`DeviceMeter`'s contract for a kernel core that launches and copies into
    the simulated engine itself (no Python method to wrap): every driver call its
    launches and copies stand for (``core.device_calls``) is charged ``call_cost``, as
    DeviceMeter charges each wrapped call. The engine's own work for a direct launch
    (~500 instructions, counted by ``benchmarks/bench_kernel_core``) stays inside the
    step's measured CPU: charged twice, a small pessimism, never an advantage."""

    def __init__(self, core: Any, call_cost: float):
        self.core = core
        self.call_cost = call_cost
        self._calls = core.device_calls
        self._released = core.released

    def take(self) -> float:
        """Seconds to take out of the step's CPU (negative: the calls are charged)."""
        n = self.core.device_calls
        calls, self._calls = n - self._calls, n
        return -calls * self.call_cost

    def take_launches(self) -> int:
        n = self.core.released
        k, self._released = n - self._released, n
        return k


class DeviceMeter:
    """Times the simulator's methods that the dispatcher calls, so that the harness
    charges the dispatcher's CPU time only. Instance attributes shadow the methods.

    The spans are read with ``time.perf_counter`` (~0.1 us, no system call), not
    ``time.thread_time`` (a system call: ~0.5 us, far more on a loaded VM), because
    whatever the two reads cost outside the span is charged to the dispatcher, 1-2
    times per kernel; the spans are microseconds, too short for preemption to matter."""

    METHODS = ("launch", "launch_checked", "memcpy_htod", "memcpy_dtoh", "record_event",
               "event_query")

    def __init__(self, dev: SimDevice, call_cost: float):
        self.seconds = 0.0          # simulator time minus the charged call cost
        self.launches = 0           # kernel releases since the last take_launches()
        for name in self.METHODS:
            setattr(dev, name, self._timed(name, getattr(dev, name), call_cost))

    def _timed(self, name: str, fn: Callable, call_cost: float) -> Callable:
        clock = time.perf_counter
        is_launch = name in ("launch", "launch_checked")

        def timed(*args: Any, **kw: Any) -> Any:
            c0 = clock()
            try:
                return fn(*args, **kw)
            finally:
                self.seconds += clock() - c0 - call_cost
                if is_launch:
                    self.launches += 1
        return timed

    def take(self) -> float:
        s, self.seconds = self.seconds, 0.0
        return s

    def take_launches(self) -> int:
        n, self.launches = self.launches, 0
        return n


class CpuCharge:
    """The driver's ``charge`` hook when the dispatcher's CPU is charged: a step costs its
    CPU time (``time.thread_time``, the simulator's own time taken out by ``meter``, and
    the clock's own share of the window, :func:`clock_overhead`, measured once here)
    times ``cpu_scale``, plus ``decision_delay`` per kernel it released (Figure 9's
    synthetic delay). ``total``: the CPU seconds measured so far.

    The clock's share is the meter's cost, not the dispatcher's: uncorrected it charged
    0.44 us to every step, about 1 us per Figure 2 job near its knee (session 25;
    ``benchmarks/bench_dispatcher`` corrects its own windows the same way)."""

    def __init__(self, meter: "DeviceMeter | CoreMeter", cpu_scale: float,
                 decision_delay: float = 0.0):
        self.meter = meter
        self.cpu_scale = cpu_scale
        self.decision_delay = decision_delay
        self.total = 0.0
        self.overhead = clock_overhead()

    def __call__(self, step: Callable[[], None]) -> float:
        meter, clock = self.meter, time.thread_time
        meter.take()
        meter.take_launches()
        c0 = clock()
        step()
        spent = max(clock() - c0 - self.overhead - meter.take(), 0.0)
        self.total += spent
        return spent * self.cpu_scale + meter.take_launches() * self.decision_delay


def _drive(d: Dispatcher, dev: SimDevice, arrivals: np.ndarray, submit: Callable[[int], None],
           cpu_scale: float, meter: "DeviceMeter | CoreMeter | None", decision_delay: float = 0.0,
           stage: Any = None) -> float:
    """The harness loop (:class:`~paella.dispatcher.virtual_time.VirtualDriver`); returns
    the dispatcher CPU seconds charged. Without a meter the dispatcher is free: nothing
    is measured and the clock skips to what the dispatcher can observe. With one, each
    iteration's CPU (``time.thread_time``, the simulator's own time taken out) times
    ``cpu_scale``, plus ``decision_delay`` per kernel released, moves the clock, and the
    dispatcher is stepped at every device event, as a busy-polling loop would be: the
    idle polls and the instants they fall on are part of what is measured (skipping them
    moved short-long at --cpu-scale 1 from 4.9x to 1.6x). ``stage``: a
    :class:`~paella.dispatcher.batchers.stage.BatchingStage` in front of the dispatcher
    (``submit`` hands it the requests): stepped after the dispatcher (its CPU is the
    dispatcher's), and its batchers' deadlines are events the clock stops at."""
    cpu = CpuCharge(meter, cpu_scale, decision_delay) if meter is not None else None
    driver = VirtualDriver(d, stage, skip_unobserved=cpu is None, charge=cpu,
                           on_stall=None if stage is None else stage.unstall, name="harness")
    driver.run(arrivals, lambda due: _each(submit, due))
    return cpu.total if cpu is not None else 0.0


def _each(submit: Callable[[int], None], due: range) -> None:
    for i in due:
        submit(i)


def saturated(point: dict, tolerance: float = 0.9) -> bool:
    """A load point is saturated when completions fall behind arrivals: the arrivals it
    had (``arrival_rate``), not the nominal rate they were drawn at (``offered``), which
    they miss by +-6% at 2,000 lognormal gaps of sigma 1.5 and by up to 2.4x in a short
    heavy-tailed run (`sched-delay --quick --requests 200 --sigma 2.5 --seed 9`).
    (Points written before ``arrival_rate`` existed compare with ``offered``.)"""
    return point["throughput"] < tolerance * point.get("arrival_rate", point["offered"])


def run_experiment(run: Callable[[Any], dict], plot: Callable[[dict, str], None], args: Any) -> int:
    """An experiment's ``main``: ``run(args)``, then :func:`write_outputs`; exit status 0."""
    t0 = time.perf_counter()
    write_outputs(run(args), args, plot, t0)
    return 0


def write_outputs(data: dict, args: Any, plot: Callable[[dict, str], None], t0: float) -> None:
    """Print the summary, then end as every experiment does (:func:`cli.finish`: the
    running time since ``t0``, ``time.perf_counter()`` at the start, into
    ``wall_seconds``; ``--json`` and ``--plot`` if asked)."""
    import json

    from paella.experiments.cli import finish
    print(json.dumps(data["summary"], indent=2))
    finish(data, args, plot, t0)
