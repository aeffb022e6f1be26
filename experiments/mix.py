"""``paella experiment mix`` (Figure 11): a uniform mix of the eight Table 2 models.

Setting (the paper's Figure 11): every request is one of the eight compiled zoo models
(:data:`paella.experiments.zoo.TABLE2_MS`), chosen uniformly at random, on the ``t4``
preset; lognormal arrivals with sigma 1.5 and 2; the offered load is swept up to
saturation. Each point reports average throughput and p99 latency, overall and per
model. Systems (Table 3 as far as this project can express it):

* through the dispatcher, in virtual time (:func:`paella.experiments.harness.run_point`):
  ``fifo`` (Paella-SS), ``ms-jbj``, ``ms-kbk``, ``paella``, ``sjf``, ``rr``. Each model is
  a :meth:`PlanAdaptor.from_bundle` of its compiled bundle. ``--cpu-scale`` (default 0,
  a free dispatcher, as in ``short-long``) multiplies the dispatcher CPU time charged to
  the simulated clock; 1 charges this dispatcher in full.
* directly on the simulated device, with no dispatcher (:func:`direct_point`), the same
  bundles' plans, uninstrumented launches: ``cuda-ss`` submits every job's plan to ONE
  stream in arrival order; ``cuda-ms`` submits each job's plan to its own stream
  (1024 streams, reused after 1024 jobs), so that streams beyond the 32 hardware queues
  share queues (stream ``s`` feeds queue ``s % 32``), as with CUDA. The jobs share one
  scratch buffer per model: the simulator times copies by size, and nobody reads the
  results.

Both kinds of point draw the same request sequence (models and arrival times) for a
given seed and load, and drop the first 10% of requests as warm-up. Every load of a
sweep uses the same seed, so the loads differ only by the scale of the same arrival
pattern (a point-to-point difference is the load's, not a new draw's), and each point
has ``--requests`` requests (default 2,000: p99 from ~1,800 samples, ~225 per model).

SLO, per model: every model's p99 <= ``--slo-x`` (default 10) times that model's
isolated time (its plan alone on one stream,
:func:`paella.experiments.calibrate.simulate`). A mix of models from 2 to 15 ms alone
needs a per-model bound: one overall p99 bound is set by the longest model alone (the
overall p99 is almost always one of its requests) and says nothing about the short
models, which are what an SRPT scheduler protects and what a FIFO queue hurts. 10x is
the multiple ``hol`` uses. A policy *sustains* a load when every model meets its SLO
and it is not saturated (throughput >= 90% of the rate the load's arrivals had,
:func:`paella.experiments.harness.saturated`) at that load and at every lower load of
the grid (a load counts only if the loads below it passed too). ``summary.load_ratio_vs_ms_jbj``
is paella's highest sustained load over ms-jbj's, the smaller over the sigmas run (the
per-sigma values are beside it); the load grid bounds its resolution. Beside it the
summary gives the same for one overall bound (overall p99 <= ``--slo-x`` times the
mix's mean isolated time: the paper's axis) under ``overall_slo``, the mean and p99
latency of ms-jbj over paella's at ms-jbj's sustained load, and the throughput at
saturation (the highest any load reached) under ``saturation``; ``summary.claims``
says which of the paper's claims each reproduces.

Running time (2 cores shared with other work): a point of 2,000 requests takes a few
seconds straight to the device and 10-40 s through the dispatcher (the simulator costs
about 4 ms of CPU per MobileNetV2 request). ``--quick`` (paella, ms-jbj and CUDA-MS; sigma 1.5; three loads)
takes a few minutes.
"""
from __future__ import annotations

import argparse
import math
import sys
import time
from typing import Callable

import numpy as np

from paella.dispatcher.adaptor import Plan, PlanAdaptor, plan_from_bundle
from paella.dispatcher.devices.base import ModuleImage
from paella.dispatcher.devices.sim import CostModel, SimDevice
from paella.experiments.cli import add_common, add_cpu_scale, save_figure
from paella.experiments.harness import (DEFAULT_STREAMS, PointConfig, Workload, run_point,
                                        saturated, write_outputs)
from paella.experiments.workload import latency_summary, lognormal_arrivals

GPU = "t4"
DISPATCHER_POLICIES = ["fifo", "ms-jbj", "ms-kbk", "paella", "sjf", "rr"]
DIRECT = ["cuda-ss", "cuda-ms"]
SYSTEMS = DIRECT + DISPATCHER_POLICIES
#: Policies beyond Table 3 that ``--systems`` may name (any registered policy is accepted;
#: these are the ones measured for issue 38's item 3, docs/policies.md "`slack`").
EXTRA_POLICIES = ["slack"]
LABELS = {"cuda-ss": "CUDA-SS", "cuda-ms": "CUDA-MS", "fifo": "Paella-SS (fifo)",
          "ms-jbj": "Paella-MS-jbj", "ms-kbk": "Paella-MS-kbk", "paella": "Paella",
          "sjf": "Paella-SJF", "rr": "Paella-RR", "slack": "Paella-slack (EDF)"}
FULL_RATES = [300, 400, 500, 600, 700, 800, 1000, 1400, 1800]
QUICK_RATES = [300, 600, 900]
#: --quick runs the headline comparison only (paella, ms-jbj, and CUDA-MS for reference).
QUICK_SYSTEMS = ["cuda-ms", "ms-jbj", "paella"]
REQUESTS = 2000
QUICK_REQUESTS = 2000
FULL_SIGMAS = [1.5, 2.0]
QUICK_SIGMAS = [1.5]
WARMUP = 0.1


def direct_point(mode: str, rate: float, sigma: float, n: int, seed: int,
                 plans: dict[str, Plan], gpu: str = GPU) -> dict:
    """CUDA-SS or CUDA-MS: jobs' plans submitted straight to the simulated device."""
    if mode not in DIRECT:
        raise ValueError(f"unknown direct mode {mode!r}; use one of {DIRECT}")
    n_streams = 1 if mode == "cuda-ss" else DEFAULT_STREAMS
    dev = SimDevice(gpu, n_streams=n_streams, seed=seed)
    names = list(plans)
    loaded = []
    for name in names:
        plan = plans[name]
        funcs = dev.load_module(ModuleImage(plan.name, list(plan.kernels)))
        largest = max((op.nbytes for op in plan.ops), default=0) or 1
        loaded.append((plan.ops, funcs, dev.alloc(largest), np.zeros(largest, np.uint8)))
    kinds = _kinds(len(names), n, seed)
    arrivals = dev.now() + lognormal_arrivals(rate, sigma, n, seed)
    done = np.full(n, np.nan)
    launch_id = 0
    for i, t in enumerate(arrivals):
        dev.run_until(t)
        ops, funcs, scratch, host = loaded[kinds[i]]
        stream = 0 if mode == "cuda-ss" else i % n_streams
        finish = (lambda i=i: done.__setitem__(i, dev.now()))
        for j, op in enumerate(ops):
            cb = finish if j == len(ops) - 1 else None
            if op.kind == "launch":
                launch_id += 1
                dev.launch(funcs[op.kernel], op.grid, op.block, stream, launch_id,
                           dyn_smem=op.dyn_smem, instrumented=False, on_complete=cb)
            elif op.kind == "h2d":
                dev.memcpy_htod(scratch, host[:op.nbytes], stream, on_complete=cb)
            elif op.kind == "d2h":      # (record / wait: one stream per job here)
                dev.memcpy_dtoh(host[:op.nbytes], scratch, stream, on_complete=cb)
    dev.run()
    if np.isnan(done).any():
        raise RuntimeError(f"{mode}: {int(np.isnan(done).sum())} jobs never completed")
    warm = int(n * WARMUP)
    lat = done[warm:] - arrivals[warm:]
    span = done[warm:].max() - arrivals[warm]
    out = {"policy": mode, "offered": rate, "sigma": sigma, "throughput": float((n - warm) / span),
           **latency_summary(lat), "per_model": {}}
    for k, name in enumerate(names):
        mask = kinds[warm:] == k
        out["per_model"][name] = {"count": int(mask.sum()), **latency_summary(lat[mask])}
    return out


def _kinds(n_models: int, n: int, seed: int) -> np.ndarray:
    """The model of each request: the draw :func:`run_point` makes for equal weights."""
    w = np.ones(n_models)
    return np.random.default_rng(seed).choice(n_models, n, p=w / w.sum())


def isolated_ms(bundles: dict) -> dict[str, float]:
    """Each model alone, its plan on one stream, under the timing model (ms)."""
    from paella.experiments.calibrate import simulate
    return {name: simulate(b, CostModel(), GPU) * 1e3 for name, b in bundles.items()}


def run(bundles: dict, rates: list[float], sigmas: list[float], n: int, seed: int,
        systems: list[str], cpu_scale: float, slo_x: float, progress=None,
        extra_blocks: int | None = None) -> dict:
    """``extra_blocks``: the dispatcher's B (the +B rule) for every dispatcher system
    (None: its default, the GPU's SM count)."""
    from paella.dispatcher.policies import policy_names
    known = set(SYSTEMS) | set(policy_names())
    unknown = sorted(set(systems) - known)
    if unknown:
        raise ValueError(f"unknown systems {unknown}; choose from {SYSTEMS + EXTRA_POLICIES} "
                         f"(or any registered policy)")
    plans = {name: plan_from_bundle(b) for name, b in bundles.items()}
    workloads = [Workload(name, (lambda b=b: PlanAdaptor.from_bundle(b))) for name, b in bundles.items()]
    iso = isolated_ms(bundles)
    mean_iso = float(np.mean(list(iso.values())))
    slo_ms = {name: slo_x * t for name, t in iso.items()}
    results: dict[str, dict[str, list[dict]]] = {}
    for sigma in sigmas:
        per = results[f"sigma={sigma}"] = {s: [] for s in systems}
        for rate in sorted(rates):
            for system in systems:
                t0 = time.perf_counter()
                # One seed for every load: the same arrival pattern, scaled.
                if system in DIRECT:
                    pt = direct_point(system, rate, sigma, n, seed, plans)
                else:
                    pt = run_point(PointConfig(system, rate, sigma, n, seed, gpu=GPU,
                                               cpu_scale=cpu_scale, extra_blocks=extra_blocks),
                                   workloads)
                pt["wall_seconds"] = time.perf_counter() - t0
                per[system].append(pt)
                if progress:
                    progress(sigma, rate, system, pt, slo_ms)
    setting = {"gpu": GPU, "models": list(bundles), "isolated_ms": iso, "mean_isolated_ms": mean_iso,
               "slo_x": slo_x, "slo_ms": slo_ms, "overall_slo_ms": slo_x * mean_iso, "rates": rates, "sigmas": sigmas,
               "requests_per_point": n, "warmup": WARMUP, "seed": seed, "cpu_scale": cpu_scale,
               "cuda_ms_streams": DEFAULT_STREAMS, "extra_blocks": extra_blocks}
    return {"setting": setting, "results": results,
            "summary": summarize(results, slo_ms, slo_x * mean_iso)}


def meets_slo(point: dict, slo_ms: dict[str, float]) -> bool:
    """Every model's p99 within its SLO, and the system keeps up with the load."""
    return (not saturated(point)
            and all(point["per_model"][m]["p99_ms"] <= slo for m, slo in slo_ms.items()))


def sustained_load(points: list[dict], ok: Callable[[dict], bool]) -> float:
    """Highest offered load whose point is ``ok`` and every lower load's point too (0 if
    the lowest fails): a load that passes above a failing one is luck, not capacity."""
    best = 0.0
    for p in sorted(points, key=lambda p: p["offered"]):
        if not ok(p):
            break
        best = p["offered"]
    return best


def _ratio(a: float, b: float) -> float:
    if b > 0:
        return a / b
    return math.inf if a > 0 else math.nan


def _compare(results: dict, ok: Callable[[dict], bool], system: str = "paella") -> dict:
    """Sustained loads per sigma and system under the SLO ``ok``; ``system`` over ms-jbj."""
    sustained, ratios, p99_ratios, mean_ratios = {}, {}, {}, {}
    for key, per in results.items():
        sustained[key] = {s: sustained_load(pts, ok) for s, pts in per.items()}
        if system in per and "ms-jbj" in per:
            ratios[key] = _ratio(sustained[key][system], sustained[key]["ms-jbj"])
            # latency at the highest load ms-jbj sustains (``system`` ran the same loads).
            base = sustained[key]["ms-jbj"]
            at = [(p, q) for p, q in zip(per[system], per["ms-jbj"]) if q["offered"] == base]
            p99_ratios[key] = at[0][1]["p99_ms"] / at[0][0]["p99_ms"] if at else math.nan
            mean_ratios[key] = at[0][1]["mean_ms"] / at[0][0]["mean_ms"] if at else math.nan
    finite = [r for r in ratios.values() if not math.isnan(r)]
    overall = min(finite) if finite else math.nan
    return {"sustained_load": sustained, "load_ratio_vs_ms_jbj": overall,
            "load_ratio_vs_ms_jbj_per_sigma": ratios,
            "p99_ratio_ms_jbj_over_paella_at_ms_jbj_load": p99_ratios,
            "mean_ratio_ms_jbj_over_paella_at_ms_jbj_load": mean_ratios,
            "paella_beats_ms_jbj": bool(finite) and overall > 1.0}


def _saturation(results: dict, system: str = "paella") -> dict:
    """Throughput at saturation: the highest any load reached, per sigma and system."""
    peak = {key: {s: max(p["throughput"] for p in pts) for s, pts in per.items()}
            for key, per in results.items()}
    ratios = {key: _ratio(v[system], v["ms-jbj"]) for key, v in peak.items()
              if system in v and "ms-jbj" in v}
    finite = [r for r in ratios.values() if not math.isnan(r)]
    return {"throughput": peak, "ratio_vs_ms_jbj_per_sigma": ratios,
            "ratio_vs_ms_jbj": min(finite) if finite else math.nan}


def _claims(s: dict) -> list[dict]:
    """The paper's Figure 11 claims ("the scheduling policy alone sustains 1.4x the load at
    1.35x lower latency"), each beside the measure that tests it here."""
    o, sat = s["overall_slo"], s["saturation"]
    worst = lambda d: min((v for v in d.values() if not math.isnan(v)), default=math.nan)  # noqa: E731
    rows = [("1.4x the load (p99 of the whole mix within one bound: the paper's axis)", 1.4,
             o["load_ratio_vs_ms_jbj"]),
            ("1.4x the load (every model's p99 within 10x its isolated time)", 1.4,
             s["load_ratio_vs_ms_jbj"]),
            ("1.35x lower p99 at the load ms-jbj sustains (per-model SLO)", 1.35,
             worst(s["p99_ratio_ms_jbj_over_paella_at_ms_jbj_load"])),
            ("lower mean latency at that load", 1.0, worst(s["mean_ratio_ms_jbj_over_paella_at_ms_jbj_load"])),
            ("throughput at saturation (not a claim: both saturate the same GPU)", None,
             sat["ratio_vs_ms_jbj"])]
    return [{"claim": c, "paper": p, "ours": v,
             "reproduced": (None if p is None or math.isnan(v) else bool(v > 1.0))} for c, p, v in rows]


def summarize(results: dict, slo_ms: dict[str, float], overall_slo_ms: float) -> dict:
    """The per-model SLO comparison (the headline), and one overall-p99 bound beside it."""
    def overall_ok(p: dict) -> bool:
        return not saturated(p) and p["p99_ms"] <= overall_slo_ms
    out = {"slo_ms": slo_ms, **_compare(results, lambda p: meets_slo(p, slo_ms)),
           "overall_slo": {"slo_ms": overall_slo_ms, **_compare(results, overall_ok)},
           "saturation": _saturation(results),
           "paper": {"load_ratio": 1.4, "latency_ratio": 1.35}}
    out["claims"] = _claims(out)
    out["vs_ms_jbj"] = versus_ms_jbj(results, slo_ms, overall_slo_ms)
    return out


def versus_ms_jbj(results: dict, slo_ms: dict[str, float], overall_slo_ms: float) -> dict:
    """Issue 38's three ratios for every dispatcher system that ran beside ms-jbj, per
    sigma: sustained load under the per-model SLO and under one overall bound, and the
    throughput at saturation, each over ms-jbj's; ``dominates`` says whether all three
    reach their targets (2x, 1.4x, 1x) at every sigma."""
    systems = sorted({s for per in results.values() for s in per
                      if s not in DIRECT and s != "ms-jbj"})
    if not any("ms-jbj" in per for per in results.values()):
        return {}
    targets = {"per_model_load": 2.0, "overall_load": 1.4, "saturation": 1.0}

    def overall_ok(p: dict) -> bool:
        return not saturated(p) and p["p99_ms"] <= overall_slo_ms
    out = {}
    for system in systems:
        row = {"per_model_load": _compare(results, lambda p: meets_slo(p, slo_ms), system)[
                   "load_ratio_vs_ms_jbj_per_sigma"],
               "overall_load": _compare(results, overall_ok, system)["load_ratio_vs_ms_jbj_per_sigma"],
               "saturation": _saturation(results, system)["ratio_vs_ms_jbj_per_sigma"]}
        row["dominates"] = all(bool(row[k]) and all(not math.isnan(v) and v >= t
                                                    for v in row[k].values())
                               for k, t in targets.items())
        out[system] = row
    return {"targets": targets, "systems": out}


def worst_slo_ratio(point: dict, slo_ms: dict[str, float]) -> float:
    """The largest p99 / SLO over the models: <= 1 when every model meets its SLO."""
    return max(point["per_model"][m]["p99_ms"] / slo for m, slo in slo_ms.items())


def plot(data: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    keys = list(data["results"])
    fig, axes = plt.subplots(2, len(keys), figsize=(max(6.0, 4.6 * len(keys)), 6.6), squeeze=False)
    markers = dict(zip(SYSTEMS, "vxosD^*P"))
    st = data["setting"]
    for col, key in enumerate(keys):
        top, bottom = axes[0][col], axes[1][col]
        for system, pts in data["results"][key].items():
            style = dict(ls="--" if system in DIRECT else "-", marker=markers.get(system, "o"), ms=4,
                         label=LABELS.get(system, system))
            thr = [p["throughput"] for p in pts]
            top.plot(thr, [p["p99_ms"] for p in pts], **style)
            bottom.plot(thr, [worst_slo_ratio(p, st["slo_ms"]) for p in pts], **style)
        top.axhline(st["overall_slo_ms"], color="grey", ls=":", lw=1,
                    label=f"overall bound {st['overall_slo_ms']:.0f} ms")
        bottom.axhline(1.0, color="grey", ls=":", lw=1, label="per-model SLO")
        top.set_title(f"{key}: p99 of the whole mix (the paper's axes)", fontsize=9)
        bottom.set_title(f"{key}: worst model's p99 / its SLO ({st['slo_x']:g}x alone)", fontsize=9)
        for ax in (top, bottom):
            ax.set_yscale("log")
            ax.set_xlabel("throughput (req/s)")
            ax.grid(True, alpha=0.3)
        top.set_ylabel("p99 latency (ms)")
        bottom.set_ylabel("p99 / SLO")
    axes[0][0].legend(fontsize=6)
    s = data["summary"]
    fig.suptitle(f"Figure 11: eight-model mix on t4 (cpu_scale {st['cpu_scale']:g})\nsustained load, "
                 f"paella over ms-jbj: {s['load_ratio_vs_ms_jbj']:.2f}x (per-model SLO), "
                 f"{s['overall_slo']['load_ratio_vs_ms_jbj']:.2f}x (overall bound)", fontsize=9)
    save_figure(fig, path)


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("mix", help="Figure 11: a uniform mix of the eight Table 2 models")
    add_common(p)
    p.add_argument("--requests", type=int, default=None,
                   help=f"requests per load point (default {REQUESTS}, quick {QUICK_REQUESTS})")
    p.add_argument("--rates", default=None, help="comma-separated offered loads in req/s "
                   f"(default {','.join(map(str, FULL_RATES))}; quick {','.join(map(str, QUICK_RATES))})")
    p.add_argument("--sigmas", default=None, help="comma-separated lognormal sigmas (default 1.5,2; quick 1.5)")
    p.add_argument("--systems", default=None, help=f"subset of {','.join(SYSTEMS)}, or any registered policy (e.g. "
                   f"{','.join(EXTRA_POLICIES)}) (default all of the first; "
                   f"quick {','.join(QUICK_SYSTEMS)})")
    add_cpu_scale(p)
    p.add_argument("--extra-blocks", type=int, default=None,
                   help="the dispatcher's B (+B rule) for every dispatcher system (default: the "
                        "GPU's SM count)")
    p.add_argument("--slo-x", type=float, default=10.0,
                   help="per-model p99 SLO as a multiple of each model's isolated time (default 10); "
                        "the overall bound uses the same multiple of the mix's mean isolated time")
    p.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    from paella.experiments.zoo import TABLE2_MS, ensure_bundles
    rates = [float(r) for r in args.rates.split(",")] if args.rates else (QUICK_RATES if args.quick else FULL_RATES)
    sigmas = ([float(s) for s in args.sigmas.split(",")] if args.sigmas
              else (QUICK_SIGMAS if args.quick else FULL_SIGMAS))
    n = args.requests or (QUICK_REQUESTS if args.quick else REQUESTS)
    systems = args.systems.split(",") if args.systems else (QUICK_SYSTEMS if args.quick else SYSTEMS)
    print(f"mix: {len(systems)} systems x {len(rates)} loads x {len(sigmas)} sigma(s), {n} requests "
          f"per point; dispatcher CPU charged at cpu_scale {args.cpu_scale:g} "
          f"({'a free dispatcher' if args.cpu_scale == 0 else 'this dispatcher, scaled'})",
          file=sys.stderr)
    t0 = time.perf_counter()

    def progress(sigma, rate, system, pt, slo_ms):
        worst = max(pt["per_model"], key=lambda m: pt["per_model"][m]["p99_ms"] / slo_ms[m])
        print(f"[{time.perf_counter() - t0:6.0f} s] sigma={sigma} offered={rate:g}/s {system:7s} "
              f"thr={pt['throughput']:6.1f}/s p99={pt['p99_ms']:8.2f} ms; worst against its SLO: "
              f"{worst} {pt['per_model'][worst]['p99_ms']:.1f} ms = "
              f"{worst_slo_ratio(pt, slo_ms):.2f}x its SLO [{pt['wall_seconds']:.0f} s]",
              file=sys.stderr, flush=True)

    bundles = ensure_bundles(list(TABLE2_MS))
    data = run(bundles, rates, sigmas, n, args.seed, systems, args.cpu_scale, args.slo_x, progress,
               extra_blocks=args.extra_blocks)
    s = data["summary"]
    print(f"SLO: every model's p99 <= {args.slo_x:g}x its isolated time; sustained load per system:",
          file=sys.stderr)
    for key, per in s["sustained_load"].items():
        print(f"  {key}: " + ", ".join(f"{k} {v:g}" for k, v in per.items()), file=sys.stderr)
    print(f"(one overall bound, p99 <= {s['overall_slo']['slo_ms']:.1f} ms: "
          + "; ".join(f"{key}: " + ", ".join(f"{k} {v:g}" for k, v in per.items())
                      for key, per in s["overall_slo"]["sustained_load"].items()) + ")", file=sys.stderr)
    write_outputs(data, args, plot, t0)
    return 0
