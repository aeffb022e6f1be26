"""``paella experiment hol``: head-of-line blocking in the GPU's FIFO queues (Figure 2).

Setting (the paper's): a GTX 1660 SUPER (22 SMs, 1024 threads/SM, 32 hardware queues);
each job is 8 dependent kernels of one 128-thread block, 9 registers, no shared memory,
300 us each; lognormal arrivals; a sweep of offered load. Two ways to submit:

* ``naive``: every job's 8 kernels are submitted at once to the job's own stream. With
  more jobs than hardware queues, a queue's head waits on its own stream's previous
  kernel while everything behind it idles: at most 32 blocks run, of 176 possible.
* ``aware``: a minimal occupancy-aware driver releases a job's next kernel only once the
  previous one has completed *and* the GPU's state says its block will be placed at
  once (here read from the simulator's ground truth; the real dispatcher learns it from
  notifications). Oldest job first.

Goodput is the highest throughput whose p99 latency meets the SLO (``--slo-ms``,
default 10x a job's isolated time). The sweep's grid is coarse where the knee may fall
(20k, then 30k jobs/s), so after it each system's knee is refined by bisection
(:func:`refine_knee`, ``KNEE_STEPS`` halvings of the gap between its last load point
within the SLO and the first one past it): every system gets the same resolution, and
a goodput is no longer rounded down to a grid point. The refined points are in
``results`` with ``"refined": true``.

``--driver dispatcher`` reruns the same setting with the real dispatcher in place of
the minimal drivers (:func:`run_dispatcher`): the virtual-time harness
(:mod:`paella.experiments.harness`) drives ``paella`` and ``ms-jbj`` (CUDA-MS: one
stream per job, all kernels at once) with the Figure 2 job as a plan adaptor, and
charges the dispatcher's own CPU time, times ``--cpu-scale``, to the simulated clock.
``goodput_ratio`` is then paella's goodput over ms-jbj's. Filling the GPU takes
176 resident blocks / 300 us = ~590k kernel releases per second (~73k jobs/s), far
beyond what the Python dispatcher sustains when its cost is charged in full.
"""
from __future__ import annotations

import argparse
import heapq
import time
from functools import partial

import numpy as np

from paella.dispatcher.devices.base import KernelInfo, ModuleImage
from paella.dispatcher.devices.sim import SimDevice
from paella.experiments.cli import finish, save_figure
from paella.experiments.workload import (arrival_rate, goodput, latency_summary,
                                          lognormal_arrivals)
from paella.models.synthetic import SyntheticJob, figure2_job

GPU = "gtx1660s"
NAIVE_STREAMS = 1024        # one stream per job (reused after 1024 jobs)
FULL_RATES = [2e3, 4e3, 6e3, 8e3, 10e3, 12e3, 14e3, 16e3, 20e3, 30e3, 40e3, 50e3, 55e3, 60e3, 65e3, 70e3]
QUICK_RATES = [4e3, 8e3, 12e3, 16e3, 30e3, 50e3, 60e3, 70e3]
#: Bisections of each system's knee after the sweep (:func:`refine_knee`): 3 halve a
#: 10k jobs/s gap to 1.25k.
KNEE_STEPS = 3


def refine_knee(points: list[dict], slo_ms: float, measure, steps: int = KNEE_STEPS) -> None:
    """Bisect the offered load between the last point within the SLO and the next
    point past it, ``steps`` times, appending each new point (``measure(rate, k)``, k
    its index, for a seed of its own) to ``points`` (kept sorted by offered load). The
    goodput (the highest throughput within the SLO) then has the same resolution for
    every system, whatever the grid."""
    for k in range(steps):
        points.sort(key=lambda p: p["offered"])
        ok = [i for i, p in enumerate(points) if p["p99_ms"] <= slo_ms]
        if not ok or ok[-1] + 1 >= len(points):
            return                       # nothing within the SLO, or no point past it
        lo, hi = points[ok[-1]]["offered"], points[ok[-1] + 1]["offered"]
        pt = measure((lo + hi) / 2, k)
        pt["refined"] = True
        points.append(pt)
    points.sort(key=lambda p: p["offered"])


class AwareDriver:
    """Release a job's next kernel only when it will be placed at once."""

    def __init__(self, dev: SimDevice, func, job: SyntheticJob, on_job_done):
        self.dev, self.func, self.job, self.on_job_done = dev, func, job, on_job_done
        k = job.kernels[0]
        self.fp = dev.block_footprint(func, (k.block, 1, 1), 0)
        self.ready: list[tuple[int, int]] = []     # (job id, kernel index): oldest job first
        self.free_streams = list(range(len(dev.streams) - 1, -1, -1))
        self.launch_id = 0

    def arrive(self, job_id: int) -> None:
        heapq.heappush(self.ready, (job_id, 0))
        self.release()

    def _fits_somewhere(self) -> bool:
        fit, fp = self.dev.resources.fit, self.fp
        return any(fit(s, fp) for s in range(self.dev.props.sm_count))

    def release(self) -> None:
        while self.ready and self.free_streams and self._fits_somewhere():
            job_id, ki = heapq.heappop(self.ready)
            k = self.job.kernels[ki]
            stream = self.free_streams.pop()
            self.launch_id += 1
            self.dev.launch(self.func, k.grid, k.block, stream, self.launch_id, instrumented=False,
                            on_complete=partial(self._done, job_id, ki, stream))

    def _done(self, job_id: int, ki: int, stream: int) -> None:
        self.free_streams.append(stream)
        if ki + 1 < len(self.job.kernels):
            heapq.heappush(self.ready, (job_id, ki + 1))
        else:
            self.on_job_done(job_id)
        self.release()


def _ratio(a: float, b: float) -> float:
    """Goodput ``a`` over ``b``: infinite when only ``b`` is 0, undefined (NaN: null in the
    JSON) when both are (an SLO nothing meets)."""
    if b:
        return a / b
    return float("inf") if a else float("nan")


def run_point(mode: str, rate: float, n_jobs: int, sigma: float, seed: int) -> dict:
    """Simulate ``n_jobs`` arrivals at ``rate`` jobs/s; the first 10% are warm-up."""
    job = figure2_job()
    k0 = job.kernels[0]
    n_streams = NAIVE_STREAMS if mode == "naive" else 256
    dev = SimDevice(GPU, n_streams=n_streams, seed=seed)
    func = dev.load_module(ModuleImage("figure2", [KernelInfo(k0.name, k0.regs_per_thread,
                                                              duration=k0.duration)]))[k0.name]
    arrivals = lognormal_arrivals(rate, sigma, n_jobs, seed)
    done = np.full(n_jobs, np.nan)

    def job_done(job_id: int) -> None:
        done[job_id] = dev.now()

    warm = n_jobs // 10
    snap = None
    if mode == "naive":
        for i, t in enumerate(arrivals):
            dev.run_until(t)
            if i == warm:
                snap = dev.gpu.area_snapshot()
            stream = i % n_streams
            for ki, k in enumerate(job.kernels):
                last = ki == len(job.kernels) - 1
                dev.launch(func, k.grid, k.block, stream, i * 8 + ki, instrumented=False,
                           on_complete=partial(job_done, i) if last else None)
    elif mode == "aware":
        driver = AwareDriver(dev, func, job, job_done)
        for i, t in enumerate(arrivals):
            dev.run_until(t)
            if i == warm:
                snap = dev.gpu.area_snapshot()
            driver.arrive(i)
    else:
        raise ValueError(f"unknown mode {mode!r}; use naive or aware")
    dev.run_until(arrivals[-1])
    resident = dev.gpu.mean_resident(*snap)
    dev.run()
    lat = done[warm:] - arrivals[warm:]
    span = np.nanmax(done[warm:]) - arrivals[warm]
    return {"mode": mode, "offered": rate, "arrival_rate": arrival_rate(arrivals[warm:], rate),
            "throughput": float(len(lat) / span),
            "resident_blocks": float(resident), **latency_summary(lat)}


def run(rates: list[float], n_jobs: int, sigma: float, seed: int, slo_ms: float,
        progress=None) -> dict:
    results: dict[str, list[dict]] = {"naive": [], "aware": []}
    for i, rate in enumerate(rates):
        for mode in results:
            results[mode].append(run_point(mode, rate, n_jobs, sigma, seed + i))
        if progress:
            progress(i + 1, len(rates), rate, results)
    for mode, points in results.items():
        refine_knee(points, slo_ms, lambda r, k, mode=mode: run_point(
            mode, r, n_jobs, sigma, seed + len(rates) + k))
    spec = SimDevice(GPU).props
    possible = 8 * spec.sm_count   # 8 resident 128-thread blocks per SM (warp limit)
    good = {m: goodput(points, slo_ms) for m, points in results.items()}
    peak_naive = max(p["resident_blocks"] for p in results["naive"])
    return {
        "setting": {"gpu": GPU, "kernels_per_job": 8, "kernel_us": 300, "block": 128, "regs": 9,
                    "sigma": sigma, "jobs_per_point": n_jobs, "slo_ms": slo_ms, "seed": seed},
        "results": results,
        "goodput": good,
        "goodput_ratio": _ratio(good["aware"], good["naive"]),
        "naive_peak_resident_blocks": peak_naive,
        "aware_peak_resident_blocks": max(p["resident_blocks"] for p in results["aware"]),
        "possible_resident_blocks": possible,
    }


DISPATCHER_POLICIES = ("paella", "ms-jbj")


def run_dispatcher(rates: list[float], n_jobs: int, sigma: float, seed: int, slo_ms: float,
                   cpu_scale: float, policies: tuple[str, ...] = DISPATCHER_POLICIES,
                   progress=None) -> dict:
    """The Figure 2 setting through the real dispatcher (``--driver dispatcher``)."""
    from paella.experiments.harness import PointConfig, Workload, adaptor_for
    from paella.experiments.harness import run_point as harness_point
    workloads = [Workload("fig2", adaptor_for(figure2_job(), 64, 64))]
    results: dict[str, list[dict]] = {p: [] for p in policies}
    def measure(pol: str, rate: float, seed_: int) -> dict:
        t0 = time.perf_counter()
        pt = harness_point(PointConfig(pol, rate, sigma, n_jobs, seed_, gpu=GPU,
                                       cpu_scale=cpu_scale), workloads)
        pt["wall_seconds"] = time.perf_counter() - t0
        return pt

    for i, rate in enumerate(rates):
        for pol in policies:
            results[pol].append(measure(pol, rate, seed + i))
        if progress:
            progress(i + 1, len(rates), rate, results)
    for pol, points in results.items():
        refine_knee(points, slo_ms, lambda r, k, pol=pol: measure(pol, r, seed + len(rates) + k))
    good = {p: goodput(points, slo_ms) for p, points in results.items()}
    base = good[policies[1]] if len(policies) > 1 else float("nan")
    return {
        "setting": {"driver": "dispatcher", "gpu": GPU, "kernels_per_job": 8, "kernel_us": 300,
                    "block": 128, "regs": 9, "sigma": sigma, "jobs_per_point": n_jobs,
                    "slo_ms": slo_ms, "seed": seed, "cpu_scale": cpu_scale,
                    "kernel_releases_to_fill_gpu_per_s": 8 * 22 / 300e-6},
        "results": results,
        "goodput": good,
        "goodput_ratio": _ratio(good[policies[0]], base),
        "cpu_per_iteration_us": {p: [pt["cpu_per_iteration_us"] for pt in pts]
                                 for p, pts in results.items()},
    }


def plot(data: dict, path: str) -> None:
    if data["setting"].get("driver") == "dispatcher":
        return plot_dispatcher(data, path)
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (a, b) = plt.subplots(1, 2, figsize=(8, 3.2), dpi=90)
    for mode, style in (("naive", "o-"), ("aware", "s-")):
        pts = data["results"][mode]
        a.plot([p["throughput"] / 1e3 for p in pts], [p["p99_ms"] for p in pts], style, label=mode, ms=3)
        b.plot([p["offered"] / 1e3 for p in pts], [p["resident_blocks"] for p in pts], style, label=mode, ms=3)
    a.axhline(data["setting"]["slo_ms"], color="grey", ls=":", lw=1, label="SLO")
    a.set_yscale("log")
    a.set_xlabel("throughput (k jobs/s)")
    a.set_ylabel("p99 latency (ms)")
    a.legend(fontsize=8)
    b.axhline(data["possible_resident_blocks"], color="grey", ls=":", lw=1)
    b.set_xlabel("offered load (k jobs/s)")
    b.set_ylabel("mean resident blocks")
    fig.suptitle(f"Head-of-line blocking on {GPU}: goodput ratio {data['goodput_ratio']:.2f}x", fontsize=9)
    save_figure(fig, path)


def plot_dispatcher(data: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(5, 3.4), dpi=90)
    for (pol, pts), style in zip(data["results"].items(), ("s-", "o-", "^-")):
        ax.plot([p["throughput"] / 1e3 for p in pts], [p["p99_ms"] for p in pts], style,
                label=pol, ms=3)
    ax.axhline(data["setting"]["slo_ms"], color="grey", ls=":", lw=1, label="SLO")
    ax.set_yscale("log")
    ax.set_xlabel("throughput (k jobs/s)")
    ax.set_ylabel("p99 latency (ms)")
    ax.legend(fontsize=8)
    ax.set_title(f"Figure 2 setting, real dispatcher (cpu_scale {data['setting']['cpu_scale']:g}): "
                 f"goodput ratio {data['goodput_ratio']:.2f}x", fontsize=8)
    save_figure(fig, path)


def register(sub: argparse._SubParsersAction) -> None:
    from paella.experiments.cli import add_common
    p = sub.add_parser("hol", help="head-of-line blocking: naive vs occupancy-aware release (Figure 2)")
    add_common(p)
    p.add_argument("--jobs", type=int, default=None, help="jobs per load point (default 6000, quick 2000)")
    p.add_argument("--sigma", type=float, default=1.5, help="lognormal sigma of inter-arrival times")
    p.add_argument("--slo-ms", type=float, default=24.0, help="p99 SLO in ms (default 24 = 10x a job)")
    p.add_argument("--driver", choices=("minimal", "dispatcher"), default="minimal",
                   help="minimal: naive vs occupancy-aware minimal drivers (default); "
                        "dispatcher: paella vs ms-jbj through the real dispatcher")
    p.add_argument("--cpu-scale", type=float, default=0.0,
                   help="with --driver dispatcher: multiplier on the dispatcher CPU time charged "
                        "to the simulated clock (default 0, a free dispatcher; 1 charges this "
                        "dispatcher in full)")
    p.set_defaults(func=main)


def main_dispatcher(args: argparse.Namespace) -> int:
    rates = QUICK_RATES if args.quick else FULL_RATES
    n_jobs = args.jobs or (1500 if args.quick else 4000)
    t0 = time.perf_counter()

    def progress(i, n, rate, results):
        def cpu(pt: dict) -> str:
            us = pt["cpu_per_iteration_us"]
            return "" if us is None else f" ({us:.0f} us/iter)"
        cells = " | ".join(f"{pol}: {pts[-1]['throughput'] / 1e3:5.1f}k/s p99 {pts[-1]['p99_ms']:8.2f} ms"
                           f"{cpu(pts[-1])}" for pol, pts in results.items())
        print(f"[{i:2d}/{n}] offered {rate / 1e3:5.1f}k jobs/s | {cells}", flush=True)

    data = run_dispatcher(rates, n_jobs, args.sigma, args.seed, args.slo_ms, args.cpu_scale,
                          progress=progress)
    g = data["goodput"]
    print(f"goodput at p99 <= {args.slo_ms} ms (cpu_scale {args.cpu_scale:g}): "
          + ", ".join(f"{p} {v / 1e3:.1f}k jobs/s" for p, v in g.items())
          + f" -> ratio {data['goodput_ratio']:.2f}x (paper: 2.2x)")
    return finish(data, args, plot, t0)


def main(args: argparse.Namespace) -> int:
    if getattr(args, "driver", "minimal") == "dispatcher":
        return main_dispatcher(args)
    rates = QUICK_RATES if args.quick else FULL_RATES
    n_jobs = args.jobs or (2000 if args.quick else 6000)
    t0 = time.perf_counter()

    def progress(i, n, rate, results):
        nv, aw = results["naive"][-1], results["aware"][-1]
        print(f"[{i:2d}/{n}] offered {rate / 1e3:5.1f}k jobs/s | naive: {nv['throughput'] / 1e3:5.1f}k/s "
              f"p99 {nv['p99_ms']:8.2f} ms, {nv['resident_blocks']:5.1f} blocks | aware: "
              f"{aw['throughput'] / 1e3:5.1f}k/s p99 {aw['p99_ms']:8.2f} ms, {aw['resident_blocks']:5.1f} blocks",
              flush=True)

    data = run(rates, n_jobs, args.sigma, args.seed, args.slo_ms, progress)
    print(f"goodput at p99 <= {args.slo_ms} ms: naive {data['goodput']['naive'] / 1e3:.1f}k jobs/s, "
          f"aware {data['goodput']['aware'] / 1e3:.1f}k jobs/s -> ratio {data['goodput_ratio']:.2f}x "
          f"(paper: 2.2x)")
    print(f"resident blocks: naive peaks at {data['naive_peak_resident_blocks']:.1f}, aware at "
          f"{data['aware_peak_resident_blocks']:.1f}, of {data['possible_resident_blocks']} possible "
          f"(paper: naive capped at 32 of 176)")
    return finish(data, args, plot, t0)
