"""``paella experiment sched-delay``: how much a slower scheduling decision costs (Figure 9).

The paper adds synthetic delay to every scheduling decision of its default policy and
shows latency and throughput degrade: Paella releases kernels late, by design, so its
decisions sit on the critical path. Here the virtual-time harness adds ``delay``
seconds to the simulated clock for every kernel the dispatcher releases (on top of
nothing else: the dispatcher's own CPU is not charged, ``cpu_scale`` 0), for the
short-long workload (synthetic ResNet-18 and InceptionV3 on a T4, requests inversely
proportional to size) under the ``paella`` policy, over a sweep of offered load.

The summary states the *headroom*: the largest delay per decision whose p99 (of the
whole mix and of ResNet-18 alone) stays within 10% of the undelayed run's at every
load, with no load saturating, beside what a released kernel costs the dispatcher as the
experiments and the daemon run it, on the C kernel core (about 4.5 us as ``--cpu-scale
1`` charges it: ~2 us of measured CPU and 2 us per driver call, docs/benchmarks.md round
18), and on its own Python path (about 8.5 us of CPU, docs/dispatcher.md).
"""
from __future__ import annotations

import argparse
import time

from paella.experiments.cli import add_common, finish, save_figure
from paella.experiments.harness import PointConfig, run_point, saturated
from paella.experiments.short_long import workloads

FULL_DELAYS_US = [0, 1, 2, 5, 10, 20, 50, 100]
QUICK_DELAYS_US = [0, 2, 10, 50]
FULL_RATES = [150, 300, 450]
QUICK_RATES = [200, 400]
TOLERANCE = 1.10
PYTHON_DECISION_US = 8.5       # measured: docs/dispatcher.md, "Cost" (bench_dispatcher, whole)
CORE_DECISION_US = 4.5         # measured: docs/benchmarks.md, round 18 (the harness's charge)


def run(delays_us: list[float], rates: list[float], sigma: float, n: int, seed: int,
        progress=None) -> dict:
    wl = workloads()
    points: dict[str, list[dict]] = {}
    for d in delays_us:
        pts = points[f"{d:g}"] = []
        for i, rate in enumerate(rates):
            pt = run_point(PointConfig("paella", rate, sigma, n, seed + i, gpu="t4", cpu_scale=0.0,
                                       decision_delay=d * 1e-6), wl)
            pt["delay_us"] = d
            pts.append(pt)
            if progress:
                progress(d, rate, pt)
    base = points[f"{delays_us[0]:g}"]

    def worse(p: dict, b: dict) -> float:
        """p99 growth of the whole mix or of its short jobs, whichever is larger."""
        short = p["per_model"]["resnet18"]["p99_ms"] / b["per_model"]["resnet18"]["p99_ms"]
        return max(p["p99_ms"] / b["p99_ms"], short)

    ratio = {k: [worse(p, b) for p, b in zip(pts, base)] for k, pts in points.items()}
    within = [d for d in delays_us if max(ratio[f"{d:g}"]) <= TOLERANCE
              and not any(saturated(p) for p in points[f"{d:g}"])]
    headroom = max(within) if within else 0.0
    return {"setting": {"gpu": "t4", "policy": "paella", "workload": "short-long", "sigma": sigma,
                        "rates": rates, "requests_per_point": n, "seed": seed, "cpu_scale": 0.0},
            "points": points,
            "summary": {"delays_us": delays_us, "p99_ratio_to_no_delay": ratio,
                        "throughput": {k: [p["throughput"] for p in pts] for k, pts in points.items()},
                        "headroom_us": headroom, "tolerance": TOLERANCE,
                        "python_decision_us": PYTHON_DECISION_US,
                        "core_decision_us": CORE_DECISION_US}}


def plot(data: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(5.5, 3.2))
    for key, pts in data["points"].items():
        ax.plot([p["throughput"] for p in pts], [p["p99_ms"] for p in pts], "o-", ms=3,
                label=f"+{key} us")
    ax.set_yscale("log")
    ax.set_xlabel("throughput (req/s)")
    ax.set_ylabel("p99 latency (ms)")
    ax.set_title(f"Figure 9: synthetic delay per scheduling decision (headroom "
                 f"{data['summary']['headroom_us']:g} us)", fontsize=9)
    ax.legend(fontsize=7, ncol=2)
    save_figure(fig, path)


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("sched-delay", help="Figure 9: synthetic delay per scheduling decision")
    add_common(p)
    p.add_argument("--requests", type=int, default=None, help="requests per point")
    p.add_argument("--sigma", type=float, default=1.5)
    p.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    delays = QUICK_DELAYS_US if args.quick else FULL_DELAYS_US
    rates = QUICK_RATES if args.quick else FULL_RATES
    n = args.requests or (800 if args.quick else 2000)
    t0 = time.perf_counter()

    def progress(d, rate, pt):
        print(f"delay {d:5g} us  offered {rate:4g}/s  throughput {pt['throughput']:6.1f}/s  "
              f"p99 {pt['p99_ms']:8.2f} ms  resnet18 p99 {pt['per_model']['resnet18']['p99_ms']:7.2f} ms",
              flush=True)

    data = run(delays, rates, args.sigma, n, args.seed, progress)
    s = data["summary"]
    print(f"headroom: up to {s['headroom_us']:g} us per decision keeps p99 within "
          f"{(TOLERANCE - 1):.0%} of the undelayed run; a released kernel costs the dispatcher "
          f"about {CORE_DECISION_US:g} us on the C kernel core (charged at --cpu-scale 1), "
          f"{PYTHON_DECISION_US:g} us on its own Python path")
    return finish(data, args, plot, t0)
