"""Arrivals and latency statistics shared by the experiments."""
from __future__ import annotations

import math

import numpy as np


def lognormal_arrivals(rate: float, sigma: float, n: int, seed: int) -> np.ndarray:
    """Absolute arrival times of ``n`` requests whose inter-arrival times are lognormal
    with mean ``1/rate`` and shape ``sigma`` (the paper uses 1.5 and 2)."""
    if rate <= 0 or n < 1:
        raise ValueError(f"need rate > 0 and n >= 1, got rate={rate}, n={n}")
    mu = math.log(1.0 / rate) - sigma * sigma / 2.0       # so that E[gap] = 1/rate
    gaps = np.random.default_rng(seed).lognormal(mu, sigma, n)
    return np.cumsum(gaps)


def arrival_rate(arrivals: np.ndarray, nominal: float) -> float:
    """The rate ``arrivals`` (sorted times) actually had, per second. Lognormal gaps stray
    from their nominal rate in a short or heavy-tailed run (up to 2.4x in `sched-delay
    --quick --requests 200 --sigma 2.5 --seed 9`),
    and a throughput measured over the same window follows the arrivals, not the nominal
    rate. ``nominal`` when fewer than two distinct times."""
    if len(arrivals) < 2 or arrivals[-1] <= arrivals[0]:
        return float(nominal)
    return float((len(arrivals) - 1) / (arrivals[-1] - arrivals[0]))


def latency_summary(latencies: np.ndarray) -> dict[str, float]:
    """p50, p99 and mean, in milliseconds."""
    lat = np.asarray(latencies, dtype=float) * 1e3
    if lat.size == 0:
        return {"p50_ms": float("nan"), "p99_ms": float("nan"), "mean_ms": float("nan")}
    p50, p99 = np.percentile(lat, [50, 99])
    return {"p50_ms": float(p50), "p99_ms": float(p99), "mean_ms": float(lat.mean())}


def goodput(points: list[dict], slo_ms: float, key: str = "p99_ms") -> float:
    """Highest throughput among load points whose tail latency meets the SLO."""
    ok = [p["throughput"] for p in points if p[key] <= slo_ms]
    return max(ok) if ok else 0.0
