"""``paella experiment turbo``: TurboTransformers' variable-length serving (Fang et al.,
PPoPP'21, Figures 15 and 16, Tables 4 and 5) on the kernel scheduler.

A BERT-base encoder (12 layers, hidden 768, 12 heads, FFN 3072, seeded weights) is
compiled into one bundle with a variant per length bucket and batch size, and profiled
on the simulated RTX 2060 (the paper's GPU) to fill the DP batcher's cost table
(``VariantSpec.cost_s``: each variant's isolated time, what ``paella profile`` reports).
Requests have lengths uniform in 2-100 or 5-500 and Poisson arrivals, swept in rate;
three batchers serve them under the ``paella`` policy:

* ``nobatch``: the identity batcher (each request alone on the smallest bucket that
  takes it; the paper's Turbo-NoBatch);
* ``naive``: the dynamic batcher with no window and one batch in flight, so every
  request queued when the GPU frees up goes in one batch padded to the longest (the
  paper's Turbo-Naive-Batch, "packs the requests currently inside the message queue
  into a single batch");
* ``dp``: the ``turbo-dp`` batcher (Algorithm 2, hungry, at most 20 per batch, as the
  paper runs it).

The summary gives each system's throughput at saturation (the most responses per
second any load point reached), ``summary.dp_over_nobatch`` and
``summary.dp_over_naive`` per length range, and the latency (mean, min, max, p99) at
each load. ``summary.peak_bytes`` compares the allocators for the intermediates of the
DP run at 5-500: the per-variant buffer sets the daemon uses by default, measured
serving; TurboTransformers' chunked allocator (Algorithm 1, dispatcher/chunked_buffers.py),
measured serving; and a caching allocator (PyTorch's idea), replayed over the same
sequence of jobs one at a time (a lower bound for it: concurrent jobs would hold more).

The simulator computes no outputs here (timing only), so the weights are not uploaded
to the simulated device; the answers of the same batchers are checked on real bytes by
tests/batching/. Every simulated second is virtual: the run is deterministic.
"""
from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np

from paella.dispatcher.adaptor import PlanAdaptor, plan_from_bundle
from paella.dispatcher.batchers import ModelVariants, VariantSpec, make_batcher
from paella.dispatcher.batchers.stage import BatchingStage, ServedModel, ServedVariant, layout_of
from paella.dispatcher.chunked_buffers import ChunkedMemory
from paella.dispatcher.core import STATUS_OK, Dispatcher, Request
from paella.dispatcher.devices.sim import SimDevice
from paella.dispatcher.devices.sim.bundle_profile import plan_time
from paella.dispatcher.seqlen_allocator import CachingAllocator, ChunkAllocator
from paella.experiments.cli import add_common, save_figure
from paella.experiments.harness import _drive, write_outputs
from paella.shapes import layout as request_layout

GPU = "rtx2060"
BERT_BASE = {"layers": 12, "hidden": 768, "heads": 12, "ffn": 3072}
RANGES = {"2-100": (2, 100), "5-500": (5, 500)}
MAX_BATCH = 20                       # the paper's maximum batch size (§6.3)
SYSTEMS = {"nobatch": ("identity", {}),
           "naive": ("dynamic", {"max_batch_size": MAX_BATCH, "max_inflight_batches": 1}),
           "dp": ("turbo-dp", {"max_batch_size": MAX_BATCH, "trigger": "hungry"})}


def _options(options: dict, variants: ModelVariants) -> dict:
    """The system's options, its batch cap no larger than the largest compiled variant."""
    if "max_batch_size" in options:
        return {**options, "max_batch_size": min(options["max_batch_size"], variants.max_rows)}
    return dict(options)


@dataclasses.dataclass(frozen=True)
class Setting:
    """The compiled variants and the sweep."""
    buckets: tuple[int, ...]
    sizes: tuple[int, ...]
    rates: dict[str, tuple[float, ...]]
    n_requests: int
    encoder: dict = dataclasses.field(default_factory=lambda: dict(BERT_BASE))


FULL = Setting(buckets=(25, 50, 75, 100, 200, 300, 400, 500), sizes=(1, 2, 4, 8, 12, 16, 20),
               rates={"2-100": (100, 200, 300, 450, 700), "5-500": (30, 60, 90, 130, 200)},
               n_requests=400)
QUICK = Setting(buckets=(50, 100, 250, 500), sizes=(1, 4, 10, 20),
                rates={"2-100": (100, 600), "5-500": (40, 200)}, n_requests=150)

#: The paper's figures (resp/s at saturation; Table 4 and 5 latencies at the critical points).
PAPER = {"2-100": {"pytorch_nobatch": 99, "nobatch": 237, "naive": 323, "dp": 402,
                   "dp_over_pytorch_nobatch": 4.06, "dp_over_nobatch": 402 / 237,
                   "dp_over_naive": 402 / 323},
         "5-500": {"pytorch_nobatch": 60, "nobatch": 120, "naive": 98, "dp": 144,
                   "dp_over_pytorch_nobatch": 2.4, "dp_over_nobatch": 144 / 120,
                   "dp_over_naive": 144 / 98}}


# -- the model -----------------------------------------------------------------------------
def build_bundle(setting: Setting, progress: Callable[[str], None] = lambda m: None,
                 out_dir: Path | None = None) -> Path:
    """Compile (or fetch from the compile cache) the encoder's variants into ``out_dir``
    (default: the zoo's directory)."""
    from paella.bundle import DEFAULT_ZOO_DIR
    from paella.compiler_pass.build import compile_bundle
    from paella.models.transformer import bert_encoder
    models = []
    for seq in setting.buckets:
        for b in setting.sizes:
            md = bert_encoder(batch=b, seq_len=seq, **setting.encoder)
            md.batch, md.seq_len = b, seq
            models.append(md)
    tag = "x".join(str(setting.encoder[k]) for k in ("layers", "hidden", "heads", "ffn"))
    out = (out_dir or DEFAULT_ZOO_DIR) / f"turbo_bert_{tag}_{len(setting.buckets)}l{len(setting.sizes)}b"
    return compile_bundle(models, out, progress=progress)


def variant_costs(bundle: Any, gpu: str = GPU) -> list[float]:
    """Each variant's isolated time on ``gpu`` (the DP batcher's cost table)."""
    return [plan_time(bundle, gpu, vi) for vi in range(len(bundle.variants))]


def _timing_plan(bundle: Any, vi: int) -> Any:
    """The variant's plan with its weights' contents dropped (their buffers stay shared
    and allocated): the simulator times kernels and computes nothing here."""
    return plan_from_bundle(bundle, vi, name=f"{bundle.model}@{bundle.variants[vi].name}",
                            weights=False)


class Server:
    """A dispatcher on the simulated GPU, a batching stage, and the encoder's variants."""

    MODEL_ID = 1

    def __init__(self, bundle: Any, costs: list[float], batcher: str, options: dict,
                 policy: str = "paella", gpu: str = GPU, memory: ChunkedMemory | None = None,
                 seed: int = 1):
        self.dev = SimDevice(gpu, n_streams=256, seed=seed)
        self.disp = Dispatcher(self.dev, policy, profile_runs=1)
        self.stage = BatchingStage(self.disp)
        self.adaptors: list[PlanAdaptor] = []
        served = {}
        for vi, v in enumerate(bundle.variants):
            ad = PlanAdaptor(_timing_plan(bundle, vi), memory=memory)
            mid = self.disp.register_model(ad.name, ad)
            spec = VariantSpec(vi, v.rows, v.seq_len, ad.name, cost_s=costs[vi])
            served[vi] = ServedVariant(spec, mid, layout_of(v.inputs, v.outputs, v.io_bytes))
            self.adaptors.append(ad)
        variants = ModelVariants(bundle.model, tuple(s.spec for s in served.values()))
        self.variants = variants
        self.tensors = [(t.name, tuple(t.shape), t.dtype)
                        for t in [*bundle.variants[0].inputs, *bundle.variants[0].outputs]]
        self.v0 = bundle.variants[0]
        self.stage.add_model(self.MODEL_ID, ServedModel(bundle.model, variants, served,
                                                        make_batcher(batcher, variants,
                                                                     _options(options, variants))))

    def request(self, i: int, seq_len: int, on_complete: Callable) -> Request:
        slots, nbytes = request_layout(self.tensors, self.v0.rows, self.v0.seq_len, 1, seq_len)
        return Request(i, i % 8, self.MODEL_ID, np.zeros(nbytes, np.uint8), rows=1,
                       seq_len=seq_len, layout=tuple(slots), on_complete=on_complete)

    def serve(self, arrivals: np.ndarray, lengths: np.ndarray) -> np.ndarray:
        """Submit request i at ``arrivals[i]``; returns each one's completion time."""
        disp, dev, stage = self.disp, self.dev, self.stage
        n = len(arrivals)
        done = np.full(n, np.nan)
        status = np.zeros(n, int)

        def complete(req: Request, st: int, err: str | None) -> None:
            done[req.req_id], status[req.req_id] = dev.now(), st

        t0 = dev.now()
        arrivals = t0 + arrivals
        _drive(disp, dev, arrivals,
               lambda i: stage.submit(self.request(i, int(lengths[i]), complete)),
               cpu_scale=0.0, meter=None, stage=stage)        # a free dispatcher
        if np.any(status != STATUS_OK):
            raise RuntimeError(f"{int(np.sum(status != STATUS_OK))} requests failed")
        return done - t0


# -- one load point -----------------------------------------------------------------------------
def workload(lo: int, hi: int, rate: float, n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Poisson arrivals (s) and lengths uniform in [lo, hi]."""
    rng = np.random.default_rng(seed)
    return np.cumsum(rng.exponential(1.0 / rate, n)), rng.integers(lo, hi + 1, n)


def run_point(bundle: Any, costs: list[float], system: str, length_range: str, rate: float,
              n: int, seed: int, memory: ChunkedMemory | None = None) -> dict:
    batcher, options = SYSTEMS[system]
    srv = Server(bundle, costs, batcher, options, memory=memory, seed=seed)
    arrivals, lengths = workload(*RANGES[length_range], rate, n, seed)
    done = srv.serve(arrivals, lengths)
    warm = n // 10
    lat = (done - arrivals)[warm:] * 1e3
    span = np.max(done[warm:]) - arrivals[warm]
    st = srv.stage.stats
    return {"system": system, "range": length_range, "offered": rate,
            "throughput": float((n - warm) / span),
            "mean_ms": float(lat.mean()), "min_ms": float(lat.min()), "max_ms": float(lat.max()),
            "p50_ms": float(np.percentile(lat, 50)), "p99_ms": float(np.percentile(lat, 99)),
            "batches": st.batches, "mean_batch": st.requests / max(st.batches, 1),
            "padding_waste": st.padding_waste, "server": srv}


# -- allocators ------------------------------------------------------------------------------------
def compare_allocators(bundle: Any, costs: list[float], rate: float, n: int, seed: int) -> dict:
    """Peak device bytes of request intermediates and allocation calls per request: the
    DP batcher at ``rate`` on 5-500, served once with per-variant buffer sets and once
    with the chunked allocator; the caching allocator replays the chunked run's jobs."""
    pools = run_point(bundle, costs, "dp", "5-500", rate, n, seed)
    sets = [ad.buffer_pool for ad in pools["server"].adaptors]
    per_request = {"peak_bytes": sum(p.created * p.set_bytes for p in sets),
                   "alloc_calls": sum(p.created * len(ad.plan.request_buffers)
                                      for p, ad in zip(sets, pools["server"].adaptors))}
    limit = max(p.limit for p in sets)          # as many jobs with buffers as the sets allow
    memory = ChunkedMemory(bundle.model, limit=limit)
    memory.trace = []
    run_point(bundle, costs, "dp", "5-500", rate, n, seed, memory=memory)
    chunked = {"peak_bytes": memory.stats.peak_bytes, "alloc_calls": memory.stats.alloc_calls}
    caching = CachingAllocator()
    for usages in memory.trace:
        caching.run(usages)
    jobs = len(memory.trace)
    out = {"per_request_sets": per_request, "chunked": chunked,
           "caching": {"peak_bytes": caching.stats.peak_bytes,
                       "alloc_calls": caching.stats.alloc_calls},
           "jobs": jobs, "requests": n, "max_jobs_with_buffers": limit}
    # One job at a time (the paper's serial runtime, Figure 6): the chunk allocator
    # alone, and one buffer set per variant used.
    serial = ChunkAllocator()
    for usages in memory.trace:
        serial.plan(usages)
    out["chunked_one_at_a_time"] = {"peak_bytes": serial.stats.peak_bytes,
                                    "alloc_calls": serial.stats.alloc_calls}
    used = {id(usages): usages for usages in memory.trace}    # (one list per variant)
    out["per_request_sets_one_at_a_time"] = {
        "peak_bytes": sum(u.size for usages in used.values() for u in usages),
        "alloc_calls": sum(len(usages) for usages in used.values())}
    for v in out.values():
        if isinstance(v, dict):
            v["alloc_calls_per_request"] = v["alloc_calls"] / n
    return out


# -- the experiment ------------------------------------------------------------------------------
def run(setting: Setting, seed: int = 1, progress: Callable[[str], None] = lambda m: None,
        out_dir: Path | None = None) -> dict:
    from paella.bundle import load_bundle
    bundle = load_bundle(build_bundle(setting, progress, out_dir))
    costs = variant_costs(bundle)
    points = []
    for rng_name in RANGES:
        for system in SYSTEMS:
            for rate in setting.rates[rng_name]:
                pt = run_point(bundle, costs, system, rng_name, rate, setting.n_requests, seed)
                pt.pop("server")
                points.append(pt)
                progress(f"{rng_name} {system:7s} offered {rate:5g}/s -> {pt['throughput']:6.1f}/s "
                         f"mean {pt['mean_ms']:8.2f} ms p99 {pt['p99_ms']:8.2f} ms "
                         f"batch {pt['mean_batch']:.1f}")
    summary: dict[str, Any] = {"dp_over_nobatch": {}, "dp_over_naive": {}, "saturation_rps": {}}
    for rng_name in RANGES:
        sat = {s: max(p["throughput"] for p in points if p["range"] == rng_name and p["system"] == s)
               for s in SYSTEMS}
        summary["saturation_rps"][rng_name] = sat
        summary["dp_over_nobatch"][rng_name] = sat["dp"] / sat["nobatch"]
        summary["dp_over_naive"][rng_name] = sat["dp"] / sat["naive"]
    alloc_rate = setting.rates["5-500"][len(setting.rates["5-500"]) // 2]
    alloc = compare_allocators(bundle, costs, alloc_rate, setting.n_requests, seed)
    summary["peak_bytes"] = {k: v["peak_bytes"] for k, v in alloc.items() if isinstance(v, dict)}
    summary["alloc_calls_per_request"] = {k: v["alloc_calls_per_request"]
                                          for k, v in alloc.items() if isinstance(v, dict)}
    return {"gpu": GPU, "model": dict(setting.encoder), "buckets": list(setting.buckets),
            "batch_sizes": list(setting.sizes), "n_requests": setting.n_requests, "seed": seed,
            "cost_table_ms": {f"{v.seq_len}x{v.rows}": c * 1e3 for v, c in zip(bundle.variants, costs)},
            "points": points, "allocators": {**alloc, "offered": alloc_rate},
            "paper": PAPER, "summary": summary}


def plot(data: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, rng_name in zip(axes, RANGES):
        for system in SYSTEMS:
            pts = [p for p in data["points"] if p["range"] == rng_name and p["system"] == system]
            ax.plot([p["offered"] for p in pts], [p["throughput"] for p in pts], "o-", label=system)
        top = max(p["offered"] for p in data["points"] if p["range"] == rng_name)
        ax.plot([0, top], [0, top], ":", color="grey", lw=0.8)
        ax.set_title(f"BERT-base, lengths {rng_name}, simulated {data['gpu']}")
        ax.set_xlabel("request rate (req/s)")
        ax.set_ylabel("responses/s")
        ax.legend()
    save_figure(fig, path)


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("turbo", help="TurboTransformers' Figures 15/16: DP batching of variable lengths")
    add_common(p)
    p.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    t0 = time.perf_counter()
    data = run(QUICK if args.quick else FULL, args.seed, lambda m: print(m, file=sys.stderr))
    write_outputs(data, args, plot, t0)
    return 0


def _gib(b: float) -> str:
    return f"{b / 2**30:.2f} GiB"


def report_section(d: dict) -> list[str]:
    """The TurboTransformers section of docs/EXPERIMENTS.md, every figure read from ``d``."""
    s = d["summary"]
    rows = ["| lengths | system | ours: responses/s at saturation | paper (RTX 2060) |",
            "|---|---|---:|---:|"]
    names = {"nobatch": "Turbo-NoBatch", "naive": "Turbo-Naive-Batch", "dp": "Turbo-DP-Batch"}
    for rng_name, sat in s["saturation_rps"].items():
        p = d["paper"][rng_name]
        rows.append(f"| {rng_name} | PyTorch-NoBatch | (not run) | {p['pytorch_nobatch']} |")
        for system, v in sat.items():
            rows.append(f"| {rng_name} | {names[system]} | {v:.0f} | {p[system]} |")
    ratios = ["| lengths | DP over no batching: ours | paper (over Turbo-NoBatch; over PyTorch) "
              "| DP over naive: ours | paper |", "|---|---:|---:|---:|---:|"]
    for rng_name in s["dp_over_nobatch"]:
        p = d["paper"][rng_name]
        ratios.append(f"| {rng_name} | **{s['dp_over_nobatch'][rng_name]:.2f}x** | "
                      f"{p['dp_over_nobatch']:.2f}x; {p['dp_over_pytorch_nobatch']:.2f}x | "
                      f"**{s['dp_over_naive'][rng_name]:.2f}x** | {p['dp_over_naive']:.2f}x |")
    lat = ["| lengths | system | offered req/s | served req/s | mean (min, max) ms | p99 ms | mean batch |",
           "|---|---|---:|---:|---:|---:|---:|"]
    for pt in d["points"]:
        lat.append(f"| {pt['range']} | {pt['system']} | {pt['offered']:g} | {pt['throughput']:.0f} | "
                   f"{pt['mean_ms']:.1f} ({pt['min_ms']:.1f}, {pt['max_ms']:.1f}) | {pt['p99_ms']:.1f} | "
                   f"{pt['mean_batch']:.1f} |")
    al = d["allocators"]
    mem = ["| allocator | how measured | peak device bytes (intermediates) | device allocations per request |",
           "|---|---|---:|---:|"]
    how = {"per_request_sets": "serving (one buffer pool per variant)",
           "chunked": "serving (one chunk list per model, jobs side by side)",
           "caching": "replayed, one job at a time",
           "chunked_one_at_a_time": "replayed, one job at a time",
           "per_request_sets_one_at_a_time": "one set per variant used"}
    for k, v in al.items():
        if isinstance(v, dict):
            mem.append(f"| {k} | {how.get(k, '')} | {_gib(v['peak_bytes'])} | "
                       f"{v['alloc_calls_per_request']:.2f} |")
    short, long_ = s["dp_over_nobatch"].get("2-100", 0), s["dp_over_nobatch"].get("5-500", 0)
    p_short, p_long = d["paper"]["2-100"], d["paper"]["5-500"]
    sat = s["saturation_rps"]
    naive_worse = sat["5-500"]["naive"] < sat["5-500"]["nobatch"]
    ct = d["cost_table_ms"]
    b1 = min((v for k, v in ct.items() if k.endswith("x1")), default=float("nan"))
    c1 = al["chunked_one_at_a_time"]["peak_bytes"]
    s1 = al["per_request_sets_one_at_a_time"]["peak_bytes"]
    cc = al["caching"]["peak_bytes"]
    cs, ss = al["chunked"]["peak_bytes"], al["per_request_sets"]["peak_bytes"]

    def more(a: float, b: float) -> str:
        return "more than" if a > b * 1.05 else "less than" if a < b / 1.05 else "about as much as"
    notes = [
        f"- Baselines: the paper's 4.06x and 2.4x are DP batching over *PyTorch* without "
        f"batching; our no-batching baseline is our own runtime unbatched (its Turbo-NoBatch), "
        f"against which the paper gains {p_short['dp_over_nobatch']:.2f}x and "
        f"{p_long['dp_over_nobatch']:.2f}x, and we {short:.2f}x and {long_:.2f}x. PyTorch is "
        f"not part of this system, so that column is not run.",
        f"- DP over no batching at 2-100: ours gains {more(short, p_short['dp_over_nobatch'])} "
        f"the paper's because our batch-1 kernels are further from the GPU's peak than Turbo's "
        f"(TVM's untuned default schedules, DLight, and per-call transposes of the weights, "
        f"43% of the kernel time at batch 1 and length 25, which a deployment folds at load "
        f"time: docs/simulator.md; timed by the simulator, one short request "
        f"alone takes {b1:.1f} ms, Turbo's hand-written kernels about 3.7 ms on the real RTX "
        f"2060, Table 4), so batching recovers more; unbatched we serve "
        f"{sat['2-100']['nobatch'] / p_short['nobatch']:.2f}x the paper's rate, batched with "
        f"the DP {sat['2-100']['dp'] / p_short['dp']:.2f}x. At 5-500, where long requests fill "
        f"the GPU alone, the gains are {more(long_, p_long['dp_over_nobatch'])} the paper's "
        f"({long_:.2f}x against {p_long['dp_over_nobatch']:.2f}x); our absolute rates are "
        f"lower there ({sat['5-500']['dp'] / p_long['dp']:.2f}x the paper's with the DP) "
        f"because the paper turns on tensor cores for that run and we compute in fp32.",
        f"- DP over naive batching: {s['dp_over_naive']['2-100']:.2f}x and "
        f"{s['dp_over_naive']['5-500']:.2f}x against the paper's "
        f"{p_short['dp_over_naive']:.2f}x and {p_long['dp_over_naive']:.2f}x: padding costs us "
        f"{'more' if s['dp_over_naive']['2-100'] > p_short['dp_over_naive'] else 'less'} at "
        f"2-100: a naive batch also pads its rows to the next compiled batch size and its "
        f"tokens to the next length bucket, which the DP's cost table accounts for when it "
        f"forms batches.",
        f"- Naive batching {'loses to' if naive_worse else 'beats'} no batching at 5-500 "
        f"({sat['5-500']['naive']:.0f} against {sat['5-500']['nobatch']:.0f} responses/s), "
        f"{'as in the paper (98 against 120): padding every request to the longest of the queue wastes more than batching gains' if naive_worse else 'unlike the paper (98 against 120)'}.",
        "- Length buckets: a batch runs on the smallest compiled bucket and batch size that take "
        f"it ({', '.join(map(str, d['buckets']))} tokens; batch sizes "
        f"{', '.join(map(str, d['batch_sizes']))}), where the paper's runtime takes any length "
        "and batch size; the DP's cost table is each variant's simulated isolated time, where "
        "the paper measures a warm-up on the GPU.",
        f"- Memory, one job at a time: the chunk list needs {_gib(c1)}, {more(c1, s1)} one "
        f"buffer set per variant used ({_gib(s1)}) and {more(c1, cc)} a caching allocator "
        f"({_gib(cc)}): the variants' own sets are each sized for their bucket and batch and "
        f"all stay allocated, while the chunks are shared by every shape and shrink when the "
        f"shapes served change. Serving, the chunk list peaks at {_gib(cs)}, {more(cs, ss)} the "
        f"per-variant buffer pools ({_gib(ss)}), with {al['chunked']['alloc_calls_per_request']:.2f} "
        f"device allocations per request against {al['per_request_sets']['alloc_calls_per_request']:.2f} "
        f"(chunks are freed once unused and allocated again when the lengths come back; the "
        f"paper's idle-count option, ``max_idle``, trades that for memory). The paper "
        f"compares with PyTorch's per-tensor caching allocator on a runtime that runs one "
        f"inference at a time; our caching allocator is replayed one job at a time only.",
    ]
    return [
        f"BERT-base (12 layers, hidden 768, 12 heads) compiled for length buckets x batch sizes, "
        f"on the simulated {d['gpu']} (the paper's GPU), Poisson arrivals, {d['n_requests']} "
        f"requests per point, the `paella` policy, the dispatcher's CPU not charged. "
        f"`nobatch`: the identity batcher; `naive`: every queued request in one batch padded to "
        f"the longest (dynamic batcher, no window, one batch in flight); `dp`: the `turbo-dp` "
        f"batcher (Algorithm 2, hungry, at most {MAX_BATCH} per batch). "
        f"(docs/turbotransformers.md)", "", *rows, "", *ratios, "", *lat, "",
        f"Allocators for the DP run at 5-500, {al['offered']:g} requests/s "
        f"(`summary.peak_bytes`):", "", *mem, "", *notes]
