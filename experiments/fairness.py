"""``paella experiment fairness`` (Figure 13): the deficit threshold trades short-job
latency for long-job latency.

Two job types from two clients share a T4: ``short`` (8 kernels) and ``long`` (40
kernels, 5x as many), each kernel 160 blocks of 256 threads (one full wave) for
100 us; equal numbers of requests, lognormal arrivals (sigma 1.5). The sweep runs
``paella`` at each fairness threshold and reports each type's mean latency; ``fifo``
(Paella-SS) is the reference the paper says the system approaches as the threshold
goes to 0. ``summary`` holds ``thresholds``, ``short_mean_ms`` and ``long_mean_ms``
(equal lengths) and the fifo means.
"""
from __future__ import annotations

import argparse
import math
import sys

from paella.experiments.cli import add_common
from paella.experiments.harness import write_outputs, PointConfig, Workload, adaptor_for, run_point
from paella.models.synthetic import chain_job

FULL_THRESHOLDS = [0.0, 0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 1e9]
QUICK_THRESHOLDS = [0.0, 1.0, 4.0, 16.0, 1e9]


def workloads() -> list[Workload]:
    short = chain_job("short", 8, grid=160, block=256, regs=48, duration=100e-6)
    long_ = chain_job("long", 40, grid=160, block=256, regs=48, duration=100e-6)
    return [Workload("short", adaptor_for(short, 1024, 1024), 1.0, client_id=0),
            Workload("long", adaptor_for(long_, 1024, 1024), 1.0, client_id=1)]


def run(thresholds: list[float], rate: float, sigma: float, n: int, seed: int, cpu_scale: float,
        progress=None) -> dict:
    wl = workloads()
    points = []
    for th in thresholds:
        pt = run_point(PointConfig("paella", rate, sigma, n, seed, fairness_threshold=th,
                                   cpu_scale=cpu_scale), wl)
        pt["threshold"] = th
        points.append(pt)
        if progress:
            progress(f"paella T={th:g}", pt)
    ref = run_point(PointConfig("fifo", rate, sigma, n, seed, cpu_scale=cpu_scale), wl)
    if progress:
        progress("fifo", ref)
    short = [p["per_model"]["short"]["mean_ms"] for p in points]
    long_ = [p["per_model"]["long"]["mean_ms"] for p in points]
    fs, fl = ref["per_model"]["short"]["mean_ms"], ref["per_model"]["long"]["mean_ms"]
    dist = [math.hypot(s - fs, l - fl) for s, l in zip(short, long_)]
    return {"setting": {"gpu": "t4", "rate": rate, "sigma": sigma, "requests": n, "seed": seed,
                        "short_kernels": 8, "long_kernels": 40, "cpu_scale": cpu_scale},
            "points": points, "fifo": ref,
            "summary": {"thresholds": thresholds, "short_mean_ms": short, "long_mean_ms": long_,
                        "fifo_short_mean_ms": fs, "fifo_long_mean_ms": fl,
                        "distance_to_fifo_ms": dist,
                        "approaches_fifo": dist[0] < dist[-1]}}


def plot(data: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    s = data["summary"]
    xs = [t if t < 1e8 else 2 * max(x for x in s["thresholds"] if x < 1e8) for t in s["thresholds"]]
    xs = [max(x, 0.1) for x in xs]
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(xs, s["short_mean_ms"], marker="o", label="short (8 kernels)")
    ax.plot(xs, s["long_mean_ms"], marker="s", label="long (40 kernels)")
    ax.axhline(s["fifo_short_mean_ms"], ls="--", color="C0", alpha=0.6, label="short, fifo")
    ax.axhline(s["fifo_long_mean_ms"], ls="--", color="C1", alpha=0.6, label="long, fifo")
    ax.set_xscale("log")
    ax.set_xlabel("fairness threshold (0 plotted at 0.1; rightmost = off)")
    ax.set_ylabel("mean latency (ms)")
    ax.set_title("Figure 13: deficit threshold")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("fairness", help="Figure 13: mean latency of short and long jobs vs threshold")
    add_common(p)
    p.add_argument("--rate", type=float, default=300.0, help="requests/s (default 300)")
    p.add_argument("--requests", type=int, default=None, help="requests per point")
    p.add_argument("--cpu-scale", type=float, default=1.0,
                   help="multiplier on the dispatcher CPU time charged to the clock (default 1)")
    p.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    th = QUICK_THRESHOLDS if args.quick else FULL_THRESHOLDS
    n = args.requests or (500 if args.quick else 2000)

    def progress(name, pt):
        print(f"{name:14s} short mean={pt['per_model']['short']['mean_ms']:.2f} ms "
              f"long mean={pt['per_model']['long']['mean_ms']:.2f} ms", file=sys.stderr)

    data = run(th, args.rate, 1.5, n, args.seed, args.cpu_scale, progress)
    write_outputs(data, args, plot)
    return 0
