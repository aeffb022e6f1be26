"""``paella experiment cluster``: N simulated GPUs behind one router, in virtual time.

Issue 41, part 4: scale past one machine by simulation. Each GPU is the real
:class:`~paella.dispatcher.core.Dispatcher` (policy ``paella``, the kernel core the
daemon runs by default) on its own simulated device (:class:`SimDevice`); in front of
them, the routers of :mod:`paella.cluster.router`, the same code the Ray Serve
deployment runs, on :class:`~paella.cluster.router.Replica` records filled the way the
deployment fills them: ``queued_work_us`` is what the GPU's daemon would put in its
STATUS reply (:func:`paella.dispatcher.daemon.server.queued_work_us`, on that GPU's
dispatcher at the decision's instant) and ``in_flight`` is the router's own count of
requests sent and not answered.

**One loop, N clocks.** The GPUs share nothing but the router, so each keeps its own
virtual clock and is brought forward only when the router needs it: before a decision
the sampled replicas' GPUs are driven (:class:`~paella.dispatcher.virtual_time.VirtualDriver`)
up to the arrival's instant, their state read there, and the request submitted to the
chosen one; a GPU no decision looks at does not move until one does, or until the end,
when every GPU drains. This is exact, not an approximation: a GPU's history up to ``t``
depends only on the requests it got before ``t``, which are all submitted by then, and
what a router reads at ``t`` is that GPU's state at ``t``. The cost is the GPUs' own
work plus at most two drives per request (a ``p2c`` router reads two GPUs; ``random``
and ``round-robin`` one), whatever N is: one event queue over N devices would pay a
heap operation for every device event to learn the same thing.

**Setting.** The model mix is the paper's Table 2 (the eight models of
:data:`paella.experiments.zoo.TABLE2_MS`, uniformly at random, as ``mix`` draws them),
each as a synthetic model of ``KERNELS`` dependent kernels whose FLOPs make its
isolated time on a T4 the Table 2 time: compiled bundles cost ~10 ms of simulation per
request, too much for 64 GPUs. Kernels are timed by the cost model from their FLOPs (a
grid that fills a T4), so a faster preset runs them faster, as it would the real models
(a V100: 1.9x). Arrivals: Poisson by default (``--sigma`` > 0: lognormal gaps of that
sigma), at ``load`` times the cluster's capacity (the sum over its GPUs of one over the
mix's mean isolated time on that GPU), so the rate scales with N and with the presets.
Every model is placed on every GPU unless ``--placement`` says otherwise
(:mod:`paella.cluster.placement`). Each point runs ``--requests-per-gpu`` requests per
GPU (at least ``--min-requests``) and drops the first 10% as warm-up; every router sees
the same requests (models and times) at a given N and load.

**Cases.** ``homogeneous``: N T4s. ``heterogeneous``: alternately a T4 and a faster
preset (``--fast-gpu``, default V100), N >= 2.

**Measures** (``summary``, the contract of issue 41):

* ``p99_at_load[case][router][N][load]``: the p99 latency (ms) of the whole mix.
* ``throughput_at_bound[case][router][N]``: the throughput (req/s) at which the p99 meets
  the bound (``--slo-x`` times the mix's mean isolated time on a T4, 10x by default),
  interpolated between the two loads around the crossing (log p99 against throughput);
  the lowest load's throughput is a floor when every load meets it (``censored``).
* ``scaling_efficiency[N]``: throughput at the bound at N GPUs over N times that of one
  GPU, homogeneous, for ``p2c-work`` (``scaling_efficiency_by_router``: every router).
* ``router_gain[load]``: p99 of ``p2c-queue`` over p99 of ``p2c-work`` at the same load,
  heterogeneous, at the largest N; ``router_gain_at``: the same at the highest load where
  ``p2c-work`` meets the bound.

The dispatchers are free (``cpu_scale`` 0: the policy and mechanism alone, as ``mix``
by default), so the results do not depend on the machine or its load. Running time: see
docs/cluster.md (``--quick``: N = 1, 4, 16, three loads, about a minute; the full run:
N = 1 .. 64).
"""
from __future__ import annotations

import argparse
import math
import sys
import time
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from paella.cluster.placement import place_text
from paella.cluster.router import ROUTERS, Replica, make_router
from paella.dispatcher.adaptor import Plan, PlanAdaptor, PlanOp
from paella.dispatcher.core import STATUS_OK, Dispatcher, Request
from paella.dispatcher.daemon.server import queued_work_us
from paella.dispatcher.devices.base import KernelInfo
from paella.dispatcher.devices.sim import SimDevice
from paella.dispatcher.virtual_time import VirtualDriver
from paella.experiments.cli import add_common, save_figure
from paella.experiments.harness import write_outputs
from paella.experiments.workload import arrival_rate, latency_summary, lognormal_arrivals
from paella.experiments.zoo import TABLE2_MS
from paella.gpus import preset

BASE_GPU = "t4"
FAST_GPU = "v100"
CASES = ["homogeneous", "heterogeneous"]
ROUTER_NAMES = list(ROUTERS)
HEADLINE = "p2c-work"
#: Dependent kernels per synthetic model; their grid fills a T4 (40 SMs x 4 blocks of 256).
KERNELS = 6
GRID, BLOCK, REGS = 160, 256, 32
IO_BYTES = 4096
FULL_GPUS = [1, 2, 4, 8, 16, 32, 64]
QUICK_GPUS = [1, 4, 16]
FULL_LOADS = [0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95]
QUICK_LOADS = [0.3, 0.45, 0.6, 0.75, 0.9]
REQUESTS_PER_GPU = 600
QUICK_REQUESTS_PER_GPU = 300
MIN_REQUESTS = 3000
QUICK_MIN_REQUESTS = 2000
WARMUP = 0.1


def synthetic_plan(name: str, ms: float, gpu: str = BASE_GPU) -> Plan:
    """``name`` as ``KERNELS`` dependent compute kernels whose FLOPs make ``ms`` on
    ``gpu`` (at its peak: the grid fills it), between a 4 KiB input and output copy."""
    per = ms * 1e-3 / KERNELS
    flops = per * preset(gpu).peak_flops
    ks = [KernelInfo(f"{name}_k{i}", REGS, flops=flops, bytes=0.0) for i in range(KERNELS)]
    ops = ([PlanOp("h2d", buffer="in", nbytes=IO_BYTES)]
           + [PlanOp("launch", kernel=k.name, grid=(GRID,), block=(BLOCK,)) for k in ks]
           + [PlanOp("d2h", buffer="out", io_offset=IO_BYTES, nbytes=IO_BYTES)])
    return Plan(name, ks, ops, {"in": IO_BYTES, "out": IO_BYTES}, 2 * IO_BYTES)


class SimGpu:
    """One simulated GPU with its dispatcher, driven forward on demand (:meth:`advance`)."""

    def __init__(self, index: int, gpu: str, plans: dict[str, Plan], seed: int):
        self.index = index
        self.gpu = gpu
        self.dev = SimDevice(gpu, seed=seed)
        self.disp = Dispatcher(self.dev, "paella", kernel_core="auto")
        self.mids = {name: self.disp.register_model(name, PlanAdaptor(p))
                     for name, p in plans.items()}
        self.io = np.zeros(2 * IO_BYTES, np.uint8)
        #: Each model's estimated time alone here (the dispatcher's SRPT profile), us.
        self.estimates_us = {name: self.disp.models[m].profile.total * 1e6
                             for name, m in self.mids.items()}
        self.driver = VirtualDriver(self.disp, name=f"cluster gpu {index}")

    def advance(self, t: float) -> None:
        """Drive this GPU until its clock reads ``t`` (nothing submitted meanwhile)."""
        dev = self.dev
        if dev.now() < t:
            self.driver.run((t,), _nothing, until=lambda: dev.now() >= t)

    def drain(self) -> None:
        self.driver.run()

    def queued_work_us(self) -> int:
        return queued_work_us(self.disp)


def _nothing(due: range) -> None:
    pass


def presets_for(case: str, n: int, fast: str = FAST_GPU) -> list[str]:
    if case == "homogeneous":
        return [BASE_GPU] * n
    if case == "heterogeneous":
        return [BASE_GPU if i % 2 == 0 else fast for i in range(n)]
    raise ValueError(f"unknown case {case!r}; choose from {CASES}")


@dataclass
class Cluster:
    """What a point needs that does not depend on the load or the router."""
    presets: list[str]
    plans: dict[str, Plan]
    placement: str = "all"

    def capacity(self, isolated_ms: dict[str, dict[str, float]]) -> float:
        """Requests/s the GPUs serve back to back: the sum of 1 / mean isolated time."""
        return sum(1e3 / float(np.mean(list(isolated_ms[g].values()))) for g in self.presets)


def isolated_times(plans: dict[str, Plan], gpus: Sequence[str]) -> dict[str, dict[str, float]]:
    """Each model's estimated time alone (ms) on each preset: the dispatcher's profile."""
    return {g: {m: us / 1e3 for m, us in SimGpu(0, g, plans, 0).estimates_us.items()}
            for g in sorted(set(gpus))}


def arrivals_for(rate: float, n: int, sigma: float, seed: int) -> np.ndarray:
    if sigma > 0:
        return lognormal_arrivals(rate, sigma, n, seed)
    return np.cumsum(np.random.default_rng(seed + 1).exponential(1.0 / rate, n))


def run_point(cluster: Cluster, router_name: str, rate: float, n: int, sigma: float,
              seed: int) -> dict:
    """``n`` requests at ``rate``/s through ``router_name`` over the cluster's GPUs."""
    names = list(cluster.plans)
    gpus = [SimGpu(i, g, cluster.plans, seed + i) for i, g in enumerate(cluster.presets)]
    served = place_text(names, len(gpus), _capped(cluster.placement, len(gpus)))
    replicas = [Replica(i, served[i], estimates_us=g.estimates_us) for i, g in enumerate(gpus)]
    router = make_router(router_name)
    kinds = np.random.default_rng(seed).choice(len(names), n)
    arrivals = arrivals_for(rate, n, sigma, seed)
    decide = np.random.default_rng(seed + 7)
    done = np.full(n, np.nan)
    where = np.zeros(n, int)
    failed: list[str] = []

    def completion(g: SimGpu, r: Replica):
        dev = g.dev

        def complete(req: Request, st: int, err: str | None) -> None:
            done[req.req_id] = dev.now()
            r.in_flight -= 1
            if st != STATUS_OK:
                failed.append(f"request {req.req_id} on gpu {g.index}: {err}")
        return complete

    on_complete = [completion(g, r) for g, r in zip(gpus, replicas)]
    for i in range(n):
        t = float(arrivals[i])
        model = names[kinds[i]]
        sampled = router.sample(model, replicas, decide)
        for r in sampled:                     # what a router reads: each at instant t
            g = gpus[r.id]
            g.advance(t)
            r.queued_work_us = g.queued_work_us()
        r = router.pick(model, sampled)
        g = gpus[r.id]
        g.disp.submit(Request(i, int(kinds[i]), g.mids[model], g.io, on_complete=on_complete[r.id]))
        r.in_flight += 1
        where[i] = r.id
    for g in gpus:
        g.drain()
    if failed or np.isnan(done).any():
        raise RuntimeError(f"{len(failed)} request(s) failed, {int(np.isnan(done).sum())} never "
                           f"completed: {failed[:3]}")
    warm = int(n * WARMUP)
    lat = done[warm:] - arrivals[warm:]
    span = float(np.max(done[warm:]) - arrivals[warm])
    share = np.bincount(where[warm:], minlength=len(gpus)) / (n - warm)
    out = {"router": router_name, "offered": rate, "arrival_rate": arrival_rate(arrivals[warm:], rate),
           "throughput": (n - warm) / span, **latency_summary(lat),
           "count": n - warm, "share_max": float(share.max()), "share_min": float(share.min())}
    # (no per-model statistics: 448 points of the full run would triple the JSON)
    if len(set(cluster.presets)) > 1:       # the heterogeneous case: where requests went
        fast = np.array([p != BASE_GPU for p in cluster.presets])
        out["share_fast"] = float(share[fast].sum())
    return out


def _capped(rule: str, n: int) -> str:
    """A placement count above the replicas there are means all of them."""
    if rule.strip().isdigit():
        return str(min(int(rule), n))
    parts = []
    for part in rule.split(","):
        name, eq, count = part.partition("=")
        parts.append(f"{name}={min(int(count), n)}" if eq and count.strip().isdigit() else part)
    return ",".join(parts)


def run(gpu_counts: list[int], loads: list[float], routers: list[str], cases: list[str],
        per_gpu: int, min_requests: int, sigma: float, slo_x: float, seed: int,
        fast_gpu: str = FAST_GPU, placement: str = "all", progress=None) -> dict:
    unknown = sorted(set(routers) - set(ROUTERS))
    if unknown:
        raise ValueError(f"unknown routers {unknown}; choose from {ROUTER_NAMES}")
    plans = {name: synthetic_plan(name, ms) for name, ms in TABLE2_MS.items()}
    iso = isolated_times(plans, [BASE_GPU, fast_gpu] if "heterogeneous" in cases else [BASE_GPU])
    mean_iso = float(np.mean(list(iso[BASE_GPU].values())))
    bound_ms = slo_x * mean_iso
    results: dict[str, dict[str, dict[str, list[dict]]]] = {}
    for case in cases:
        ns = [n for n in gpu_counts if case == "homogeneous" or n >= 2]
        per = results[case] = {r: {} for r in routers}
        for n_gpus in ns:
            cluster = Cluster(presets_for(case, n_gpus, fast_gpu), plans, placement)
            cap = cluster.capacity(iso)
            n_req = max(min_requests, per_gpu * n_gpus)
            for load in loads:
                for router in routers:
                    t0 = time.perf_counter()
                    pt = run_point(cluster, router, load * cap, n_req, sigma, seed)
                    pt.update(load=load, n_gpus=n_gpus, requests=n_req,
                              wall_seconds=time.perf_counter() - t0)
                    per[router].setdefault(str(n_gpus), []).append(pt)
                    if progress:
                        progress(case, n_gpus, load, router, pt, bound_ms)
    setting = {"base_gpu": BASE_GPU, "fast_gpu": fast_gpu, "models": list(plans),
               "table2_ms": dict(TABLE2_MS), "kernels_per_model": KERNELS,
               "isolated_ms": iso, "mean_isolated_ms": mean_iso, "slo_x": slo_x,
               "p99_bound_ms": bound_ms, "gpu_counts": gpu_counts, "loads": loads,
               "routers": routers, "cases": cases, "requests_per_gpu": per_gpu,
               "min_requests": min_requests, "arrivals": "lognormal" if sigma > 0 else "poisson",
               "sigma": sigma, "warmup": WARMUP, "seed": seed, "placement": placement,
               "policy": "paella", "cpu_scale": 0.0}
    return {"setting": setting, "results": results, "summary": summarize(results, bound_ms)}


def throughput_at_bound(points: list[dict], bound_ms: float) -> tuple[float, bool]:
    """The throughput where the p99 crosses ``bound_ms`` (interpolated in log p99
    between the loads around the first crossing), and whether it is censored (every
    load met the bound: the highest load's throughput, a floor). 0.0 when the lowest
    load already misses it."""
    pts = sorted(points, key=lambda p: p["load"])
    prev = None
    for p in pts:
        if not p["p99_ms"] <= bound_ms:
            if prev is None:
                return 0.0, False
            lo, hi = math.log(prev["p99_ms"]), math.log(p["p99_ms"])
            f = (math.log(bound_ms) - lo) / (hi - lo) if hi > lo else 1.0
            return prev["throughput"] + f * (p["throughput"] - prev["throughput"]), False
        prev = p
    return (pts[-1]["throughput"], True) if pts else (0.0, False)


def summarize(results: dict, bound_ms: float) -> dict:
    p99_at_load: dict = {}
    at_bound: dict = {}
    censored: dict = {}
    for case, per in results.items():
        p99_at_load[case], at_bound[case], censored[case] = {}, {}, {}
        for router, by_n in per.items():
            p99_at_load[case][router] = {n: {f"{p['load']:g}": p["p99_ms"] for p in pts}
                                         for n, pts in by_n.items()}
            at_bound[case][router], censored[case][router] = {}, {}
            for n, pts in by_n.items():
                thr, cens = throughput_at_bound(pts, bound_ms)
                at_bound[case][router][n] = thr
                censored[case][router][n] = cens
    eff_by_router: dict = {}
    for router, by_n in at_bound.get("homogeneous", {}).items():
        one = by_n.get("1", 0.0)
        eff_by_router[router] = {n: (thr / (int(n) * one) if one > 0 else math.nan)
                                 for n, thr in by_n.items()}
    out = {"p99_bound_ms": bound_ms, "p99_at_load": p99_at_load,
           "throughput_at_bound": at_bound, "throughput_at_bound_censored": censored,
           "scaling_efficiency": eff_by_router.get(HEADLINE, {}),
           "scaling_efficiency_router": HEADLINE,
           "scaling_efficiency_by_router": eff_by_router}
    worst = {r: min((v for v in e.values() if not math.isnan(v)), default=math.nan)
             for r, e in eff_by_router.items()}
    out["scaling_efficiency_min_by_router"] = worst
    out.update(_router_gain(results.get("heterogeneous", {}), bound_ms))
    return out


def _router_gain(per: dict, bound_ms: float) -> dict:
    """p99 of p2c-queue over p99 of p2c-work, load by load, at the largest N run."""
    if "p2c-queue" not in per or "p2c-work" not in per or not per["p2c-work"]:
        return {"router_gain": {}, "router_gain_at": None}
    n = max(per["p2c-work"], key=int)
    queue = {p["load"]: p for p in per["p2c-queue"].get(n, [])}
    work = {p["load"]: p for p in per["p2c-work"][n]}
    gain = {f"{load:g}": queue[load]["p99_ms"] / work[load]["p99_ms"]
            for load in sorted(work) if load in queue}
    ok = [load for load in sorted(work) if work[load]["p99_ms"] <= bound_ms and load in queue]
    at = None
    if ok:
        load = ok[-1]
        at = {"n_gpus": int(n), "load": load, "gain": gain[f"{load:g}"],
              "p99_ms": {"p2c-queue": queue[load]["p99_ms"], "p2c-work": work[load]["p99_ms"]}}
    return {"router_gain": gain, "router_gain_n_gpus": int(n), "router_gain_at": at}


# -- the figure ------------------------------------------------------------------------------
STYLE = {"random": dict(marker="x", ls=":"), "round-robin": dict(marker="s", ls="-."),
         "p2c-queue": dict(marker="o", ls="--"), "p2c-work": dict(marker="D", ls="-")}


def plot(data: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    st, s, res = data["setting"], data["summary"], data["results"]
    fig, axes = plt.subplots(2, 2, figsize=(10.5, 7.6))
    bound = st["p99_bound_ms"]

    def p99_panel(ax, case: str) -> None:
        per = res.get(case, {})
        ns = sorted({n for by_n in per.values() for n in by_n}, key=int)
        if not ns:
            ax.set_visible(False)
            return
        n = ns[-1]
        for router, by_n in per.items():
            pts = sorted(by_n.get(n, []), key=lambda p: p["load"])
            ax.plot([p["load"] for p in pts], [p["p99_ms"] for p in pts], label=router,
                    **STYLE.get(router, {}))
        ax.axhline(bound, color="grey", lw=1, ls=":", label=f"p99 bound {bound:.0f} ms")
        what = (f"{n} x {st['base_gpu']}" if case == "homogeneous"
                else f"{n} GPUs, {st['base_gpu']} and {st['fast_gpu']} alternately")
        ax.set_title(f"{case}: {what}", fontsize=9)
        ax.set_xlabel("load (fraction of the cluster's capacity)")
        ax.set_ylabel("p99 latency of the mix (ms)")
        ax.set_yscale("log")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)

    p99_panel(axes[0][0], "homogeneous")
    p99_panel(axes[0][1], "heterogeneous")
    ax = axes[1][0]
    for router, by_n in s["throughput_at_bound"].get("homogeneous", {}).items():
        ns = sorted(by_n, key=int)
        ax.plot([int(n) for n in ns], [by_n[n] for n in ns], label=router, **STYLE.get(router, {}))
    one = s["throughput_at_bound"].get("homogeneous", {}).get(HEADLINE, {}).get("1")
    if one:
        ns = sorted(st["gpu_counts"])
        ax.plot(ns, [one * n for n in ns], color="grey", lw=1, ls=":", label="N x one GPU")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("GPUs (N)")
    ax.set_ylabel("throughput at the p99 bound (req/s)")
    ax.set_title("homogeneous: throughput at the p99 bound", fontsize=9)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7)
    ax = axes[1][1]
    for router, eff in s["scaling_efficiency_by_router"].items():
        ns = sorted(eff, key=int)
        ax.plot([int(n) for n in ns], [eff[n] for n in ns], label=router, **STYLE.get(router, {}))
    ax.axhline(0.9, color="grey", lw=1, ls=":", label="90%")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("GPUs (N)")
    ax.set_ylabel("scaling efficiency")
    ax.set_title("throughput at the bound over N x one GPU's", fontsize=9)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7)
    at = s.get("router_gain_at")
    gain = f"\np2c-work's p99 gain over p2c-queue (heterogeneous, N={at['n_gpus']}, load " \
           f"{at['load']:g}): {at['gain']:.2f}x" if at else ""
    eff = s["scaling_efficiency"]
    top = max(eff, key=int) if eff else None
    scale = f"; scaling efficiency at N={top} ({HEADLINE}): {eff[top]:.2f}" if top else ""
    fig.suptitle(f"Cluster of simulated GPUs, Table 2 mix ({st['arrivals']} arrivals), p99 bound "
                 f"{st['slo_x']:g}x the mean isolated time ({bound:.0f} ms){scale}{gain}", fontsize=9)
    save_figure(fig, path)


# -- the command -----------------------------------------------------------------------------
def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("cluster", help="N simulated GPUs behind one router (random, round-robin, "
                                       "power of two by queue or by estimated work)")
    add_common(p)
    p.add_argument("--gpus", default=None, help="comma-separated GPU counts (default "
                   f"{','.join(map(str, FULL_GPUS))}; quick {','.join(map(str, QUICK_GPUS))})")
    p.add_argument("--loads", default=None, help="comma-separated loads, fractions of the cluster's "
                   f"capacity (default {','.join(map(str, FULL_LOADS))}; quick "
                   f"{','.join(map(str, QUICK_LOADS))})")
    p.add_argument("--routers", default=",".join(ROUTER_NAMES),
                   help=f"subset of {','.join(ROUTER_NAMES)} (default all)")
    p.add_argument("--cases", default=",".join(CASES), help=f"subset of {','.join(CASES)} (default both)")
    p.add_argument("--requests-per-gpu", type=int, default=None,
                   help=f"requests per GPU per point (default {REQUESTS_PER_GPU}, quick "
                        f"{QUICK_REQUESTS_PER_GPU})")
    p.add_argument("--min-requests", type=int, default=None,
                   help=f"at least this many requests per point (default {MIN_REQUESTS}, quick "
                        f"{QUICK_MIN_REQUESTS})")
    p.add_argument("--sigma", type=float, default=0.0,
                   help="lognormal inter-arrival sigma (default 0: Poisson arrivals)")
    p.add_argument("--slo-x", type=float, default=10.0,
                   help="the p99 bound, a multiple of the mix's mean isolated time on a T4 (default 10)")
    p.add_argument("--fast-gpu", default=FAST_GPU,
                   help=f"the heterogeneous case's other preset (default {FAST_GPU})")
    p.add_argument("--placement", default="all",
                   help="models per replica: 'all', a count per model, or model=count,... "
                        "(counts above N mean all; default all)")
    p.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    from paella.cli import CLIError
    try:
        gpus = _ints(args.gpus, QUICK_GPUS if args.quick else FULL_GPUS)
        loads = ([float(x) for x in args.loads.split(",")] if args.loads
                 else (QUICK_LOADS if args.quick else FULL_LOADS))
        preset(args.fast_gpu)
        place_text(list(TABLE2_MS), max(gpus), _capped(args.placement, max(gpus)))
    except (ValueError, KeyError) as e:
        raise CLIError(f"cluster: {e}") from None
    routers = args.routers.split(",")
    cases = args.cases.split(",")
    bad = sorted(set(cases) - set(CASES)) + sorted(set(routers) - set(ROUTERS))
    if bad or any(n < 1 for n in gpus) or any(not 0 < x for x in loads):
        raise CLIError(f"cluster: unknown {', '.join(bad)}; routers are {', '.join(ROUTERS)}, "
                       f"cases {', '.join(CASES)}; GPU counts and loads must be positive")
    per_gpu = args.requests_per_gpu or (QUICK_REQUESTS_PER_GPU if args.quick else REQUESTS_PER_GPU)
    min_req = args.min_requests or (QUICK_MIN_REQUESTS if args.quick else MIN_REQUESTS)
    print(f"cluster: N = {','.join(map(str, gpus))} GPUs x {len(loads)} loads x {len(routers)} "
          f"routers, {', '.join(cases)}; {per_gpu} requests per GPU (at least {min_req}) per point",
          file=sys.stderr)
    t0 = time.perf_counter()

    def progress(case, n, load, router, pt, bound):
        print(f"[{time.perf_counter() - t0:6.0f} s] {case:13s} N={n:<3d} load={load:<5g} "
              f"{router:11s} thr={pt['throughput']:8.1f}/s p99={pt['p99_ms']:8.2f} ms"
              f"{' (over the bound)' if pt['p99_ms'] > bound else ''} [{pt['wall_seconds']:.1f} s]",
              file=sys.stderr, flush=True)

    data = run(gpus, loads, routers, cases, per_gpu, min_req, args.sigma, args.slo_x, args.seed,
               args.fast_gpu, args.placement, progress)
    write_outputs(data, args, plot, t0)
    return 0


def _ints(text: str | None, default: list[int]) -> list[int]:
    return sorted({int(x) for x in text.split(",")}) if text else default
