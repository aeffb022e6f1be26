"""Benchmark (not a test): what the daemon's Prometheus metrics cost the dispatcher loop.

    .venv/bin/python -m paella.benchmarks.bench_metrics [--jobs 3000] [--repeat 5]

The dispatcher alone (``bench_dispatcher.measure_alone``: Figure-2 jobs, 8 kernels and
2 copies each, on a device that completes everything at once, so only the dispatcher's
CPU is timed) without and with :class:`~paella.dispatcher.daemon.metrics.JobMetrics`,
alternated run by run so that the host's drift hits both alike. Reported: the median
per-kernel cost of each and their ratio, and what one scrape costs (the collector
building every family for a daemon with that instrument's counts), which is paid in
the metrics thread only when Prometheus asks.
"""
from __future__ import annotations

import argparse
import json
import time

import numpy as np

from paella.dispatcher.daemon.metrics import DaemonCollector, MetricsCounts
from paella.benchmarks.bench_dispatcher import measure_alone


def scrape_cost(n: int = 200) -> float:
    """Seconds to collect every family once (eight models' counts, a 40-SM GPU)."""
    counts = MetricsCounts()
    models = [{"id": i, "name": f"m{i}", "variants": 1} for i in range(8)]
    for m in models:
        counts.model(m["id"]).success = 1000
    st = {"models": models, "in_flight": 3, "clients": [{}] * 4,
          "dispatcher": {"sm_occupancy": [0.5] * 40, "notifq_depth": 0, "resident_blocks": 9,
                         "notifications": 10, "policy_fallbacks": 0, "policy": "paella"}}
    col = DaemonCollector(counts, lambda: dict(st, dispatcher=dict(st["dispatcher"])))
    t0 = time.perf_counter()
    for _ in range(n):
        for fam in col.collect():
            list(fam.samples)
    return (time.perf_counter() - t0) / n


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--jobs", type=int, default=3000)
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--json", help="write the figures here")
    a = p.parse_args(argv)
    off, on = [], []
    for _ in range(a.repeat):
        off.append(measure_alone(a.jobs)["per_kernel_us"]["median"])
        on.append(measure_alone(a.jobs, instrument=MetricsCounts().instruments()[0])["per_kernel_us"]["median"])
    res = {"per_kernel_us_without": float(np.median(off)), "per_kernel_us_with": float(np.median(on)),
           "runs_without": off, "runs_with": on, "scrape_ms": scrape_cost() * 1e3}
    res["ratio"] = res["per_kernel_us_with"] / res["per_kernel_us_without"]
    print(f"dispatcher per kernel, median of {a.repeat}: without metrics "
          f"{res['per_kernel_us_without']:.2f} us, with {res['per_kernel_us_with']:.2f} us "
          f"({res['ratio']:.3f}x); one scrape {res['scrape_ms']:.2f} ms in the metrics thread")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
