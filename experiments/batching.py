"""``paella experiment batching``: dynamic batching under the kernel scheduler.

Setting: one model served alone on the simulated ``t4`` (virtual time, the harness of
:mod:`paella.experiments.harness`), ResNet-18 (224x224) and the BERT-like encoder
(:func:`paella.models.transformer.bert_encoder`, length 64), each compiled with
``--batch-sizes 1,2,4,8,16`` (one bundle, one variant per size, cached in
``$PAELLA_ZOO_DIR/batching``). Lognormal arrivals (sigma 1.5) of one-row requests
from 8 clients, swept from half of the batch-1 capacity to past saturation. Systems:

* ``unbatched``: the identity batcher (each request a job of variant b1: today's path);
* ``dynamic``: the dynamic batcher, Triton's semantics, ``max_batch_size`` 16,
  ``max_queue_delay_us`` 100 and ``max_inflight_batches`` 2 (Triton's two model
  instances): under load requests gather while two batches run and leave together,
  padded up to the next compiled size;

each with the ``paella`` and the ``fifo`` kernel policy underneath. A point reports
throughput, p50/p99 latency (arrival to completion), mean batch size and padding
waste. ``summary.max_throughput_ratio`` is the batched over the unbatched maximum
throughput (at saturation: the highest any load reached) under ``paella``, the
smaller of the two models (per model and policy in ``summary.per_model``);
``summary.per_model[m].p99_at_equal_load`` compares the p99 of both at the highest
load the unbatched system sustains (throughput >= 90% of offered).

``--cpu-scale`` (default 0: a free dispatcher, as in ``mix`` and ``short-long``)
charges the dispatcher's CPU time to the simulated clock. ``--quick``: fewer loads
and requests (a few minutes once the bundles are compiled; compiling them takes
about 2-3 minutes the first time).
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

SIZES = (1, 2, 4, 8, 16)
SEQ_LEN = 64
MODELS = ("resnet18", "bert_encoder")
POLICIES = ("paella", "fifo")
SYSTEMS = ("unbatched", "dynamic")
DYNAMIC = {"max_batch_size": 16, "max_queue_delay_us": 100, "max_inflight_batches": 2}
CLIENTS = 8
FACTORS = (0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, 8.0, 12.0, 16.0, 24.0)
QUICK_FACTORS = (0.5, 1.0, 2.0, 4.0, 8.0, 16.0)


def register(sub: argparse._SubParsersAction) -> None:
    from .cli import add_common
    p = sub.add_parser("batching", help="dynamic batching vs one request per job (ResNet-18, "
                                        "BERT-like encoder)", description=__doc__.splitlines()[0])
    add_common(p)
    p.add_argument("--requests", type=int, default=None,
                   help="requests per load point (default 1000, --quick 300)")
    p.add_argument("--cpu-scale", type=float, default=0.0,
                   help="dispatcher CPU time charged to the simulated clock (default 0)")
    p.set_defaults(func=main)


def ensure_bundles(root: Path | None = None, progress=print) -> dict:
    """The two models' bundles with one variant per batch size (compiled once)."""
    from paella.bundle import DEFAULT_ZOO_DIR, load_bundle
    from paella.compiler_pass.build import compile_bundle
    from paella.models import zoo
    root = Path(root or DEFAULT_ZOO_DIR / "batching")
    root.mkdir(parents=True, exist_ok=True)
    out = {}
    for name in MODELS:
        seq = SEQ_LEN if name == "bert_encoder" else None
        models = [zoo.get(name, batch=b, seq_len=seq) for b in SIZES]
        progress(f"[batching] {name}: variants {', '.join(map(str, SIZES))} (compiled once, "
                 f"then cached in {root})")
        compile_bundle(models, root / name)
        out[name] = load_bundle(root / name)
    return out


def run_point(bundle, batcher: str, policy: str, rate: float, n: int, seed: int,
              cpu_scale: float, sigma: float = 1.5, warmup: float = 0.1) -> dict:
    """``n`` one-row requests at ``rate`` req/s through the stage and the dispatcher."""
    from paella.dispatcher.adaptor import PlanAdaptor
    from paella.dispatcher.batchers import ModelVariants, VariantSpec, make_batcher
    from paella.dispatcher.batchers.stage import (BatchingStage, ServedModel, ServedVariant,
                                                  layout_of)
    from paella.dispatcher.core import STATUS_OK, Dispatcher, Request
    from paella.dispatcher.devices.sim import SimDevice

    from .harness import DEFAULT_STREAMS, _drive, device_meter
    from .workload import latency_summary, lognormal_arrivals
    dev = SimDevice("t4", n_streams=DEFAULT_STREAMS, seed=seed)
    d = Dispatcher(dev, policy, profile_runs=1, kernel_core="auto")
    stage = BatchingStage(d)
    served = {}
    for k, v in enumerate(bundle.variants):
        mid = d.register_model(f"{bundle.model}/{v.name}", PlanAdaptor.from_bundle(bundle, k))
        served[k] = ServedVariant(VariantSpec(k, v.rows, v.seq_len, v.name), mid,
                                  layout_of(v.inputs, v.outputs, v.io_bytes))
    variants = ModelVariants(bundle.model, tuple(s.spec for s in served.values()))
    options = DYNAMIC if batcher == "dynamic" else {}
    stage.add_model(0, ServedModel(bundle.model, variants, served,
                                   make_batcher(batcher, variants, options)))
    v0 = bundle.variants[0]
    io = np.zeros(v0.io_bytes, np.uint8)
    arrivals = dev.now() + lognormal_arrivals(rate, sigma, n, seed)
    done = np.full(n, np.nan)
    status = np.zeros(n, int)

    def complete(req, st, err):
        done[req.req_id] = dev.now()
        status[req.req_id] = st

    meter = device_meter(d, 2e-6) if cpu_scale > 0 else None
    _drive(d, dev, arrivals, lambda i: stage.submit(Request(
        i, i % CLIENTS, 0, io, on_complete=complete, rows=1, seq_len=v0.seq_len)),
        cpu_scale, meter, stage=stage)
    if np.any(status != STATUS_OK):
        raise RuntimeError(f"{int(np.sum(status != STATUS_OK))} requests failed")
    warm = int(n * warmup)
    lat = done[warm:] - arrivals[warm:]
    span = np.nanmax(done[warm:]) - arrivals[warm]
    st = stage.stats
    return {"policy": policy, "batcher": batcher, "offered": rate,
            "throughput": float((n - warm) / span), **latency_summary(lat),
            "mean_batch": st.requests / max(st.batches, 1),
            "padding_waste": st.padding_waste, "batches": st.batches}


def sweep(bundle, batcher: str, policy: str, rates: list[float], n: int, seed: int,
          cpu_scale: float, progress) -> list[dict]:
    from .harness import saturated
    points, over = [], 0
    for rate in rates:
        t0 = time.perf_counter()
        p = run_point(bundle, batcher, policy, rate, n, seed, cpu_scale)
        points.append(p)
        progress(f"  {bundle.model} {batcher:9s} {policy:6s} {rate:8.0f}/s -> {p['throughput']:8.0f}/s "
                 f"p99 {p['p99_ms']:7.2f} ms, batch {p['mean_batch']:.2f} "
                 f"({time.perf_counter() - t0:.1f} s)")
        over = over + 1 if saturated(p) else 0
        if over >= 2:                        # well past saturation: the rest adds nothing
            break
    return points


def summarize(results: dict) -> dict:
    from .harness import saturated
    per_model = {}
    for model, r in results.items():
        entry = {"isolated_ms": r["isolated_ms"], "max_throughput": {}, "max_throughput_ratio": {},
                 "p99_at_equal_load": {}}
        for policy in POLICIES:
            tput = {s: max(p["throughput"] for p in r["points"][policy][s]) for s in SYSTEMS}
            entry["max_throughput"][policy] = tput
            entry["max_throughput_ratio"][policy] = tput["dynamic"] / tput["unbatched"]
            ok = [p for p in r["points"][policy]["unbatched"] if not saturated(p)]
            if ok:
                load = max(p["offered"] for p in ok)
                un = next(p for p in ok if p["offered"] == load)
                ba = next((p for p in r["points"][policy]["dynamic"] if p["offered"] == load), None)
                entry["p99_at_equal_load"][policy] = {
                    "load": load, "unbatched_p99_ms": un["p99_ms"],
                    "dynamic_p99_ms": ba["p99_ms"] if ba else None}
        per_model[model] = entry
    ratio = min(e["max_throughput_ratio"]["paella"] for e in per_model.values())
    return {"max_throughput_ratio": ratio, "per_model": per_model}


def main(args: argparse.Namespace) -> int:
    from .calibrate import simulate
    from .harness import write_outputs
    t0 = time.perf_counter()
    progress = (lambda m: print(m, file=sys.stderr, flush=True))
    bundles = ensure_bundles(progress=progress)
    n = args.requests or (300 if args.quick else 1000)
    factors = QUICK_FACTORS if args.quick else FACTORS
    results = {}
    for model, b in bundles.items():
        iso = simulate(b)                    # variant 0: batch 1 alone
        rates = [f / iso for f in factors]
        results[model] = {"isolated_ms": iso * 1e3, "rates": rates,
                          "points": {pol: {} for pol in POLICIES}}
        for policy in POLICIES:
            for system in SYSTEMS:
                results[model]["points"][policy][system] = sweep(
                    b, "identity" if system == "unbatched" else "dynamic", policy, rates, n,
                    args.seed, args.cpu_scale, progress)
    data = {"experiment": "batching", "gpu": "t4", "sizes": list(SIZES), "seq_len": SEQ_LEN,
            "dynamic": DYNAMIC, "requests_per_point": n, "cpu_scale": args.cpu_scale,
            "quick": bool(args.quick), "seed": args.seed, "results": results}
    data["summary"] = summarize(results)
    write_outputs(data, args, plot, t0)
    return 0


def plot(data: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from .cli import save_figure
    models = list(data["results"])
    fig, axes = plt.subplots(1, len(models), figsize=(5.5 * len(models), 4))
    for ax, model in zip(np.atleast_1d(axes), models):
        r = data["results"][model]
        for policy, ls in zip(POLICIES, ("-", "--")):
            for system, color in zip(SYSTEMS, ("tab:gray", "tab:blue")):
                pts = r["points"][policy][system]
                ax.plot([p["throughput"] for p in pts], [p["p99_ms"] for p in pts], ls,
                        color=color, marker="o", ms=3, label=f"{system} / {policy}")
        ratio = data["summary"]["per_model"][model]["max_throughput_ratio"]["paella"]
        ax.set_title(f"{model} (t4): batched/unbatched max throughput {ratio:.2f}x")
        ax.set_xlabel("throughput (req/s)")
        ax.set_ylabel("p99 latency (ms)")
        ax.set_yscale("log")
        ax.legend(fontsize=8)
    save_figure(fig, path)
