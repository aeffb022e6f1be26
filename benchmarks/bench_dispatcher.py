"""Benchmark (not a test): the dispatcher's CPU cost per kernel, everything included.

    .venv/bin/python -m paella.benchmarks.bench_dispatcher [--jobs 6000] [--rate 3000] [--repeat 3]

Figure-2 jobs (an H2D copy, 8 dependent one-block 300 us kernels, a D2H copy; the
harness's ``adaptor_for(figure2_job())``) arrive lognormally (sigma 1.5) faster than
the dispatcher can serve them, on the simulated GTX 1660 SUPER in virtual time, driven
the way ``experiments/harness.py`` drives it: each ``step()``'s CPU time
(``time.thread_time``) minus the time spent inside the simulator's methods advances
the clock. Reported:

* **whole**: dispatcher CPU per released kernel with everything a kernel involves
  (accepting the request, starting the job and issuing its ops, the policy, +B,
  streams, launch ids, the waitlist, the notifications and completion, the copies,
  finishing the request),
  over windows of 256 kernels: median and p99 of the windows, and kernels per
  second of dispatcher CPU over the whole run;
* **phases** (a second run, timed through the dispatcher's instruments,
  :mod:`paella.dispatcher.instruments`, with ``perf_counter``): per released kernel, the
  gap between two kernel releases of one pass (pick, +B, launch bookkeeping, waitlist);
  the reaction, from a kernel's completion seen to its job's next kernel released in
  the same step (completion bookkeeping, activation, policy, release); per job, from
  its start to its last op issued (the plan's replay). Medians and p99;
* **alone** (``--alone``): the dispatcher without the simulator, see :func:`measure_alone`,
  with no instrument and with one listening to every hook (what instrumentation costs);
* **per-step perf_counter**: the whole run again, each step timed by ``time.perf_counter``
  instead of ``time.thread_time``. ``thread_time`` is a system call, and what it leaves
  behind (the kernel entry and exit, mitigations flushing the TLB) slows the dispatcher
  code that follows it: side by side the same runs read ~3 us per kernel higher with it.
  ``perf_counter`` reads the clock without entering the kernel but counts preemption as
  the step's time; the median over windows leaves the few preempted windows out.

The simulator's own time is excluded everywhere: on a GPU that work is the hardware's.

The meter must not be what costs: ``time.thread_time`` is a system call (~0.5 us here,
far more on a loaded VM), so the device methods are timed with ``time.perf_counter``
(~0.1 us, no system call; their spans are microseconds, too short for preemption to
matter), what the wrapper itself costs per call is measured at start on a no-op and
subtracted, and so is the part of the two ``thread_time`` calls around each step that
falls inside the step's window (the median of back-to-back calls).
"""
from __future__ import annotations

import argparse
import time
from typing import Any, Callable

import numpy as np

from paella import protocol
from paella.dispatcher.core import Dispatcher, Request
from paella.dispatcher.devices.base import KERNEL
from paella.dispatcher.devices.sim import SimDevice
from paella.dispatcher.instruments import HOOKS, Instrument
from paella.dispatcher.virtual_time import VirtualDriver
from paella.experiments.harness import adaptor_for, clock_overhead
from paella.experiments.workload import lognormal_arrivals
from paella.models.synthetic import figure2_job

_clock = time.thread_time
_inner = time.perf_counter
_DEVICE_METHODS = ("launch", "launch_checked", "memcpy_htod", "memcpy_dtoh", "record_event",
                   "event_query")


class MeteredSim(SimDevice):
    """The simulated GPU with the time spent inside its methods metered (subtracted from
    the dispatcher's), and launches counted: the public methods the dispatcher calls are
    replaced, on this instance, by timed versions of themselves. The wrapper's own cost
    outside its span (the call through it, the reads of the clock) is measured once on a
    method that does nothing and subtracted per call too: it is the meter's, not the
    dispatcher's. ``total`` accumulates every metered second (``take`` resets only
    ``seconds``)."""

    def __init__(self, *a: Any, **k: Any):
        super().__init__(*a, **k)
        self.seconds = self.total = 0.0
        self.launches = 0
        self.per_call = 0.0
        self.per_call = self._calibrate()
        for name in _DEVICE_METHODS:
            setattr(self, name, self._timed(getattr(self, name),
                                            name in ("launch", "launch_checked")))
        self.seconds = self.total = 0.0

    def _timed(self, fn: Callable, count: bool) -> Callable:
        clock = _inner

        def timed(*a: Any, **k: Any) -> Any:
            c0 = clock()
            try:
                return fn(*a, **k)
            finally:
                spent = clock() - c0 + self.per_call
                self.seconds += spent
                self.total += spent
                if count:
                    self.launches += 1
        return timed

    def _calibrate(self, n: int = 2000, batches: int = 15) -> float:
        """What calling through the wrapper adds, over calling the method directly,
        outside the metered span: median over batches of a no-op called both ways."""
        def nop(*a: Any, **k: Any) -> None:
            return None
        wrapped = self._timed(nop, False)
        out = []
        for _ in range(batches):
            self.seconds = 0.0
            c0 = _clock()
            for _ in range(n):
                wrapped(1, 2, 3, 4, 5, dyn_smem=0, args=(), instrumented=True, group=16)
            c1 = _clock()
            for _ in range(n):
                nop(1, 2, 3, 4, 5, dyn_smem=0, args=(), instrumented=True, group=16)
            c2 = _clock()
            out.append(((c1 - c0 - self.seconds) - (c2 - c1)) / n)
        return max(float(np.median(out)), 0.0)

    def take(self) -> float:
        s, self.seconds = self.seconds, 0.0
        return s


class InstantDevice(SimDevice):
    """A device that does everything at once (the alone measurement), once ``instant`` is
    set (after the model's profiling runs, which take the simulator's times): a launch
    posts its PLACEMENT and COMPLETION into the notifQ immediately, copies and events
    complete immediately. Only the dispatcher's own work is left to time."""

    def __init__(self, *a: Any, **k: Any):
        super().__init__(*a, **k)
        self.instant = False
        self._ring = memoryview(self.notifq)
        self._mask = self.notifq.size - 1
        self._tail = 0
        one = 1 << protocol.COUNT_SHIFT
        self._placed = (protocol.PLACEMENT << protocol.KIND_SHIFT) | one
        self._completed = (protocol.COMPLETION << protocol.KIND_SHIFT) | one

    def launch(self, func: Any, grid: Any, block: Any, stream: int, launch_id: int,
               **kw: Any) -> None:
        if not self.instant:
            return super().launch(func, grid, block, stream, launch_id, **kw)
        self._post(launch_id)

    def launch_checked(self, k: Any, stream: int, launch_id: int, *a: Any, **kw: Any) -> None:
        if not self.instant:
            return super().launch_checked(k, stream, launch_id, *a, **kw)
        self._post(launch_id)

    def _post(self, launch_id: int) -> None:
        """The launch's placement and completion, at once."""
        t = self._tail
        self._ring[t & self._mask] = self._placed | launch_id
        self._ring[(t + 1) & self._mask] = self._completed | launch_id
        self._tail = t + 2

    def memcpy_htod(self, *a: Any, **k: Any) -> None:
        if not self.instant:
            super().memcpy_htod(*a, **k)

    def memcpy_dtoh(self, *a: Any, **k: Any) -> None:
        if not self.instant:
            super().memcpy_dtoh(*a, **k)

    def record_event(self, stream: int) -> Any:
        return super().record_event(stream) if not self.instant else None

    def event_query(self, event: Any) -> bool:
        return super().event_query(event) if not self.instant else True


class EveryHook(Instrument):
    """An instrument that listens to every hook and does nothing: instrumentation's cost."""


for _hook in HOOKS:
    setattr(EveryHook, _hook, lambda self, *a: None)


def _setup(policy: str, seed: int, device: type = MeteredSim) -> tuple[Any, Dispatcher, int]:
    dev = device("gtx1660s", n_streams=1024, seed=seed)
    d = Dispatcher(dev, policy)
    mid = d.register_model("fig2", adaptor_for(figure2_job())())
    if isinstance(dev, MeteredSim):
        dev.take()
    return dev, d, mid


def _drive(dev: MeteredSim, d: Dispatcher, mid: int, n_jobs: int, rate: float,
           seed: int, on_step: Callable[[float, int, bool], None],
           fixed: float | None = None, clock: Callable[[], float] = _clock) -> None:
    """The harness's loop (cpu_scale 1), on the one virtual-time driver:
    ``on_step(cpu_seconds, kernels_launched, idle)``. The CPU of a step includes
    ``submit`` (the job's creation), not the client's ``Request`` nor the arrival
    bookkeeping. With ``fixed`` (seconds per kernel launched, plus 5 us per step) the
    clock advances by that instead of the measured CPU: every version of the dispatcher
    then does exactly the same work, in the same batches, which is what a before/after
    comparison on a noisy machine needs."""
    arrivals = (dev.now() + lognormal_arrivals(rate, 1.5, n_jobs, seed)).tolist()
    steps = _TimedSteps(dev, d, mid, on_step, fixed, clock)
    VirtualDriver(d, skip_unobserved=False, charge=steps, name="bench_dispatcher").run(
        arrivals, steps.arrive)


class _TimedSteps:
    """The driver's ``charge`` hook here: the requests that arrived are submitted inside
    the timed span, with the step; the simulator's own time is taken out."""

    def __init__(self, dev: MeteredSim, d: Dispatcher, mid: int,
                 on_step: Callable[[float, int, bool], None], fixed: float | None,
                 clock: Callable[[], float]):
        self.dev, self.d, self.mid = dev, d, mid
        self.io = np.zeros(max(d.models[mid].adaptor.io_bytes, 1), np.uint8)
        self.on_step, self.fixed, self.clock = on_step, fixed, clock
        self.overhead = clock_overhead(clock)
        self.arrived: list[Request] = []

    def arrive(self, due: range) -> None:
        self.arrived.extend(Request(i, i % 4, self.mid, self.io) for i in due)

    def __call__(self, step: Callable[[], None]) -> float:
        dev, clock, submit = self.dev, self.clock, self.d.submit
        reqs, self.arrived = self.arrived, []
        dev.take()
        k0 = dev.launches
        c0 = clock()
        for req in reqs:
            submit(req)
        step()
        spent = max(clock() - c0 - self.overhead - dev.take(), 0.0)
        k = dev.launches - k0
        self.on_step(spent, k, self.d.idle)
        return spent if self.fixed is None else self.fixed * k + 5e-6


def measure_whole(n_jobs: int, policy: str = "paella", rate: float = 3000.0, seed: int = 1,
                  window: int = 256, fixed: float | None = None,
                  clock: Callable[[], float] = _clock) -> dict:
    dev, d, mid = _setup(policy, seed)
    windows: list[float] = []
    busy_windows: list[float] = []
    # window cpu, window kernels, total cpu, total kernels; the same over busy steps
    acc = [0.0, 0, 0.0, 0]
    busy = [0.0, 0, 0.0, 0]
    idle_steps = [0]

    def add(a: list, out: list, cpu: float, k: int) -> None:
        a[0] += cpu
        a[1] += k
        a[2] += cpu
        a[3] += k
        if a[1] >= window:
            out.append(a[0] / a[1])
            a[0], a[1] = 0.0, 0

    def on_step(cpu: float, k: int, idle: bool) -> None:
        add(acc, windows, cpu, k)
        if idle:
            idle_steps[0] += 1
        else:
            add(busy, busy_windows, cpu, k)
    _drive(dev, d, mid, n_jobs, rate, seed, on_step, fixed, clock)
    w = np.array(windows) * 1e6
    return {"kernels": acc[3], "cpu_s": acc[2], "kernels_per_cpu_s": acc[3] / acc[2],
            "whole_per_kernel_us": _stats(w), "iterations": d.iterations,
            "idle_iterations": idle_steps[0],
            "busy_per_kernel_us": _stats(np.array(busy_windows) * 1e6),
            "kernels_per_busy_cpu_s": busy[3] / busy[2]}


class _Phases(Instrument):
    """Timestamps of releases, completions and job starts, through the instruments: see
    the module docstring's "phases". Time inside the simulator's methods is left out
    (``perf_counter`` minus the device's metered ``total``)."""

    def __init__(self, dev: MeteredSim) -> None:
        self.dev = dev
        self.release: list[float] = []       # gaps between two kernel releases of a pass
        self.react: list[float] = []         # kernel completion seen -> job's next release
        self.start: list[float] = []         # job start -> its last op issued
        self.step = 0
        self._last_release = (-1, 0.0)
        self._ended: dict[Any, tuple[int, float]] = {}
        self._started: dict[Any, float] = {}
        self._issued: dict[Any, float] = {}

    def _now(self) -> float:
        return _inner() - self.dev.total

    def op_released(self, op: Any, t: float) -> None:
        now = self._now()
        if op.kind != KERNEL:
            return
        step, last = self._last_release
        if step == self.step:
            self.release.append(now - last)
        self._last_release = (self.step, now)
        seen = self._ended.pop(op.job, None)
        if seen is not None and seen[0] == self.step:
            self.react.append(now - seen[1])

    def op_ended(self, op: Any, t: float) -> None:
        if op.kind == KERNEL:
            self._ended[op.job] = (self.step, self._now())

    def request_started(self, req: Any) -> None:
        self._started[req] = self._now()

    def op_issued(self, op: Any) -> None:
        self._issued[op.job] = self._now()

    def request_finished(self, req: Any) -> None:
        t0 = self._started.pop(req, None)
        job_issued = [t for job, t in self._issued.items() if req in job.requests]
        if t0 is not None and job_issued:
            self.start.append(job_issued[0] - t0)
        for job in [j for j in self._issued if req in j.requests]:
            del self._issued[job]
            self._ended.pop(job, None)


def measure_phases(n_jobs: int, policy: str = "paella", rate: float = 3000.0, seed: int = 1) -> dict:
    dev, d, mid = _setup(policy, seed)
    ph = _Phases(dev)
    d.instruments.add(ph)

    def on_step(cpu: float, k: int, idle: bool) -> None:
        ph.step += 1
    _drive(dev, d, mid, n_jobs, rate, seed, on_step)
    us = lambda x: _stats(np.array(x) * 1e6)      # noqa: E731
    return {"release_per_kernel_us": us(ph.release), "reaction_per_kernel_us": us(ph.react),
            "start_per_job_us": us(ph.start), "release_gaps": len(ph.release),
            "reactions": len(ph.react)}


def measure_alone(n_jobs: int, policy: str = "paella", batch: int = 4, seed: int = 1,
                  window: int = 1000, instrumented: bool = False,
                  instrument: Instrument | None = None) -> dict:
    """The dispatcher alone, cache-warm, on an :class:`InstantDevice` (launches post their
    PLACEMENT and COMPLETION at once, copies and events complete at once): ``batch``
    requests are submitted per step, and the thread CPU of submit + step is all the
    dispatcher's. Median over windows of ``window`` jobs, per kernel. What the simulated
    runs add on top is mostly the simulator's work evicting the dispatcher's data and
    code between steps. ``instrumented``: with an instrument listening to every hook;
    ``instrument``: with this one (the daemon's metrics, ``bench_metrics``)."""
    dev, d, mid = _setup(policy, seed, InstantDevice)
    if instrumented:
        d.instruments.add(EveryHook())
    if instrument is not None:
        d.instruments.add(instrument)
    kernels_per_job = sum(1 for step in d.models[mid].replay.steps if step.kind == KERNEL)
    dev._tail = d.tracker.head
    dev.instant = True
    out = []
    c0 = [_clock()]

    def window_done(jobs: int) -> None:
        c1 = _clock()
        out.append((c1 - c0[0]) / (jobs * kernels_per_job))
        c0[0] = c1
    drive_alone(d, mid, n_jobs, batch, window_done, window)
    return {"per_kernel_us": _stats(np.array(out) * 1e6), "kernels_per_cpu_s": float(1 / np.median(out))}


def drive_alone(d: Dispatcher, mid: int, n_jobs: int, batch: int = 4,
                on_window: Callable[[int], None] | None = None, window: int = 1000) -> None:
    """Submit ``n_jobs`` requests of model ``mid``, ``batch`` per step, and step until
    all are done; ``on_window(jobs)`` after every ``window`` jobs submitted."""
    io = np.zeros(max(d.models[mid].adaptor.io_bytes, 1), np.uint8)
    i = i0 = 0
    while i < n_jobs or d.in_flight:
        for _ in range(batch):
            if i < n_jobs:
                d.submit(Request(i, i % 4, mid, io))
                i += 1
        d.step()
        if on_window is not None and i - i0 >= window:
            on_window(i - i0)
            i0 = i


def _stats(x: np.ndarray) -> dict:
    return {"median": float(np.median(x)), "p99": float(np.percentile(x, 99))}


def _median_run(a: argparse.Namespace, fixed: float | None,
                clock: Callable[[], float]) -> tuple[dict, list[float]]:
    """``a.repeat`` whole runs timed by ``clock``: the run of median figure, and every
    run's median (sorted)."""
    runs = [measure_whole(a.jobs, a.policy, a.rate, a.seed, fixed=fixed, clock=clock)
            for _ in range(max(a.repeat, 1))]
    medians = sorted(r["whole_per_kernel_us"]["median"] for r in runs)
    mid = float(np.median(medians))
    return min(runs, key=lambda r: abs(r["whole_per_kernel_us"]["median"] - mid)), medians


def _runs_note(medians: list[float]) -> str:
    if len(medians) < 2:
        return ""
    return f"  (median run of {len(medians)}: " + " / ".join(f"{m:.2f}" for m in medians) + " us)"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--jobs", type=int, default=6000)
    p.add_argument("--rate", type=float, default=3000.0, help="job arrivals per second")
    p.add_argument("--policy", default="paella")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--fixed-us", type=float, default=None,
                   help="advance the clock by this many us per kernel instead of the measured "
                        "CPU (same work for every version: for before/after comparisons)")
    p.add_argument("--alone", action="store_true",
                   help="also time the dispatcher alone, without the simulator (cache-warm)")
    p.add_argument("--repeat", type=int, default=3,
                   help="runs of the whole measurement (default 3): this machine's speed drifts "
                        "by tens of percent within minutes, so each run's median is printed and "
                        "the median of those is the figure")
    a = p.parse_args()
    fixed = None if a.fixed_us is None else a.fixed_us * 1e-6
    w, medians = _median_run(a, fixed, _clock)
    ww, wall_medians = _median_run(a, fixed, _inner)
    ph = measure_phases(a.jobs, a.policy, a.rate, a.seed)
    print(f"{a.jobs} Figure-2 jobs at {a.rate:g}/s, policy {a.policy}: {w['kernels']} kernels, "
          f"{w['iterations']} iterations ({w['idle_iterations']} idle)")
    print(f"  whole, per kernel (windows)   median {w['whole_per_kernel_us']['median']:7.2f}  "
          f"p99 {w['whole_per_kernel_us']['p99']:7.2f} us   "
          f"-> {w['kernels_per_cpu_s']:,.0f} kernels per CPU second"
          + _runs_note(medians))
    print(f"  whole, per-step perf_counter  median {ww['whole_per_kernel_us']['median']:7.2f}  "
          f"p99 {ww['whole_per_kernel_us']['p99']:7.2f} us   "
          f"-> {ww['kernels_per_cpu_s']:,.0f} kernels per second" + _runs_note(wall_medians))
    print(f"  busy steps only, per kernel   median {w['busy_per_kernel_us']['median']:7.2f}  "
          f"p99 {w['busy_per_kernel_us']['p99']:7.2f} us   "
          f"-> {w['kernels_per_busy_cpu_s']:,.0f} kernels per CPU second")
    for k, label in (("release_per_kernel_us", "release, per kernel"),
                     ("reaction_per_kernel_us", "completion -> next release"),
                     ("start_per_job_us", "start + issue, per job")):
        print(f"  {label:29s} median {ph[k]['median']:7.2f}  p99 {ph[k]['p99']:7.2f} us")
    if a.alone:
        al = measure_alone(max(a.jobs, 12000), a.policy, seed=a.seed)
        print(f"  alone (no simulator), /kernel median {al['per_kernel_us']['median']:7.2f}  "
              f"p99 {al['per_kernel_us']['p99']:7.2f} us   "
              f"-> {al['kernels_per_cpu_s']:,.0f} kernels per CPU second")
        ai = measure_alone(max(a.jobs, 12000), a.policy, seed=a.seed, instrumented=True)
        print(f"  alone, every hook listened to median {ai['per_kernel_us']['median']:7.2f}  "
              f"p99 {ai['per_kernel_us']['p99']:7.2f} us   (instrumentation's cost when used)")


if __name__ == "__main__":
    main()
