"""``paella experiment dvabatch``: DVABatch against ZeroBatch and DelayBatch (the
paper's Figures 14-16, section 8), served as the daemon serves them.

Setting: three compiled networks -- U-Net-like (operator diversity: its encoder fills the
GPU only at large batches, its decoder already at small ones), BERT-base (input
diversity: lengths drawn like GLUE RTE's, four length buckets in one served model) and
ResNet-152 (load diversity only) -- compiled for the batch sizes 1, 2, 4, ..., 64
(timing-only bundles, ``paella compile --stages``, profiled on the simulated Titan RTX,
the paper's GPU). Each load point is the daemon's execution path in virtual time: a
:class:`~paella.dispatcher.batchers.stage.BatchingStage` in front of a dispatcher (the
``paella`` policy, a free dispatcher) on the simulated GPU, the model's compiled variants
registered as launch plans (:func:`~paella.dispatcher.adaptor.plan_from_bundle`: kernels
timed by the simulator's warps, bandwidth and launch-latency model, as in every other
experiment), the ``dvabatch`` batcher on the scheduler interface (stage jobs through
:class:`~paella.dispatcher.batchers.stage.StageContext`, boundaries in the pairs' device
memory) and requests with io regions, driven by the one virtual-time driver
(:class:`~paella.dispatcher.virtual_time.VirtualDriver`).

* **DVABatch**: the model cut into stages (4, 2 for BERT, the paper's best counts) evenly
  in time (:mod:`~paella.compiler_pass.stages`), three buffer pairs, a batch bounded by
  the model's preferred batch size (``bs_max = "preferred"``: the smallest compiled size
  within 3% of the best profiled throughput), the three policies; no batching window,
  and the stretch bound
  ``T_comp_wait`` is the first stage's time at batch 1 of the longest length (a batch
  takes late queries while in its first stage), and only when the first stage can start
  the late queries' catch-up at once (``stretch_idle_only``). The paper gives no
  ``T_comp_wait`` and sets policy I's window to the first stage's time at batch 64; both
  made DVABatch slower here, and two pairs or a bound of 64 rows did too
  (docs/dvabatch.md has the measurements).
* **ZeroBatch**: the same batcher on the model compiled in one stage (``--stages 1``),
  one buffer pair, no stretch, no split, no length grouping (``group_lengths = false``:
  a batch pads to its longest query's bucket): a batch of everything queued (up to 64)
  whenever the model is free.
* **DelayBatch**: ZeroBatch with a batching window, tuned as the paper tunes it: the
  window (from a grid) giving the highest peak throughput.

A run of rows between compiled sizes is the pieces :func:`paella.bundle.split_rows`
gives (no padding row), as the daemon runs it, for every system.

Peak throughput: the highest Poisson load whose p99 latency stays within the QoS target
(200 ms) while completions keep up, searched by doubling and bisection (:func:`peak`).
DelayBatch's smallest window is searched from scratch; each larger window is first
probed at the best bracket so far and searched further only if it beats it (ties keep
the smaller window); ZeroBatch and DVABatch start from DelayBatch's bracket. A probe
stops as soon as enough queries are late that its p99 must miss the QoS (the verdict is
the same as running it to the end). The loads are 1/4, 3/5 and 9/10 of DelayBatch's
peak; maximum batch 64. The first run compiles (the whole models about 7 minutes here,
cached; the stage cuts are re-made, in seconds, when the slicing pass changes: the
bundle's cache key hashes its source).

Cost: every query is the daemon's per-kernel scheduling in virtual time (the kernel
core, as the daemon runs it: ``kernel_core="auto"``), a few hundred kernels a batch for
BERT; the plans are timing-only (no weights uploaded, no functional effect), so nothing
is computed and the only bytes moved are each request's one row of io (under 1% of the
run, profiled) -- the time is the scheduling and the simulated kernels.
``--quick`` keeps every model, system, load and the daemon's path, and reduces the
sample: 400 queries a point instead of 1,500, DelayBatch windows 2/8/32 ms instead of
1/2/4/8/16/32 ms, and 3 bisection steps instead of 5 (peaks to 1/8 of the doubling
bracket instead of 1/32). About 3-4 minutes on the shared 2-core machine once compiled;
the full run about 17 minutes (1,037 s measured).
"""
from __future__ import annotations

import argparse
import math
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from paella.compiler_pass.stages import OpProfile, preferred_batch
from paella.dispatcher.adaptor import Plan, PlanAdaptor, plan_from_bundle
from paella.dispatcher.batchers import ModelVariants, VariantSpec, make_batcher
from paella.dispatcher.batchers.stage import BatchingStage, ServedModel, ServedVariant, layout_of
from paella.dispatcher.core import STATUS_OK, Dispatcher, Request
from paella.dispatcher.devices.sim import SimDevice
from paella.dispatcher.virtual_time import VirtualDriver
from paella.experiments.workload import latency_summary
from paella.shapes import layout as request_layout

GPU = "titanrtx"           # the paper's GPU (72 SMs, 1,024 threads each)
GPU_NAMES = {"titanrtx": "Titan RTX", "t4": "T4"}
BS_MAX = 64
#: DVABatch's buffer pairs (the paper's Figure 19 found two best at peak load; three
#: measured better here on the U-Net-like network, the others within 3%: docs/dvabatch.md).
DVA_PAIRS = 3
QOS_MS = 200.0
LOADS = {"low": 1 / 4, "medium": 3 / 5, "high": 9 / 10}
BATCH_SIZES = (1, 2, 4, 8, 16, 32, 64)
SYSTEMS = ("zerobatch", "delaybatch", "dvabatch")
#: The paper's averages over its six models (section 8.2, Figures 14 and 16), percent.
PAPER = {"avg_latency_reduction_vs_zerobatch": {"low": 16.1, "medium": 39.0, "high": 57.7},
         "avg_latency_reduction_vs_delaybatch": {"low": 35.4, "medium": 47.3, "high": 48.5},
         "p99_latency_reduction_vs_zerobatch": {"low": 16.9, "medium": 27.4, "high": 53.7},
         "peak_throughput_ratio": {"bert": 1.47, "unet": 1.0, "resnet152": 1.0}}
#: The compiled networks (zoo name, stages, length buckets).
COMPILED = {"unet": ("unet", 4, ()), "bert": ("bert_base", 2, (32, 64, 128, 256)),
            "resnet152": ("resnet152", 4, ())}
MODELS = tuple(COMPILED)
#: The served model's id (the clients'); its variants get the dispatcher's own ids.
MODEL_ID = 1_000_000


def _runs(xs: list[int]) -> list[int]:
    """``xs`` with each run of equal values once."""
    out: list[int] = []
    for x in xs:
        if not out or out[-1] != x:
            out.append(x)
    return out


@dataclass
class StagedModel:
    """One network's two bundles: ``staged`` cut into DVABatch's stages, ``whole`` in one
    stage (the baselines); both with every length bucket in one bundle. Their variants'
    launch plans are made once (:meth:`plans`) and shared by every load point."""
    name: str
    staged: Any                        # paella.bundle.Bundle
    whole: Any
    _plans: dict = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        self.buckets = tuple(sorted({v.seq_len for v in self.staged.variants if v.seq_len}))
        self.max_len = max(self.buckets, default=0)
        self.n_stages = self.staged.n_stages
        self.sizes = sorted({v.rows for v in self.staged.variants})
        self._secs = {(b is self.whole, v.stage, v.rows, v.seq_len): v.stage_seconds
                      for b in (self.staged, self.whole) for v in b.variants}

    def bundle(self, system: str) -> Any:
        return self.staged if system == "dvabatch" else self.whole

    def plans(self, system: str) -> list[Plan]:
        """The bundle's variants as timing-only launch plans (weights' buffers allocated,
        never uploaded: the simulator times kernels and computes nothing here)."""
        b = self.bundle(system)
        if id(b) not in self._plans:
            self._plans[id(b)] = [plan_from_bundle(b, i, name=f"{self.name}@{v.name}", weights=False)
                                  for i, v in enumerate(b.variants)]
        return self._plans[id(b)]

    def time(self, stage: int, rows: int, seq_len: int) -> float:
        """The compiler's profiled isolated time of ``rows`` rows through ``stage`` (-1:
        the whole model), its pieces' times added."""
        from paella.bundle import split_rows
        b = next((x for x in self.buckets if x >= seq_len), self.max_len) if self.buckets else 0
        return sum(self._secs[(stage < 0, max(stage, 0), size, b)]
                   for _, size in split_rows(0, rows, self.sizes))

    def record(self) -> dict:
        """The cuts and the operators' preferred batch sizes (at the longest length)."""
        from paella.compiler_pass.stage_variants import call_times
        b = self.max_len
        whole = {v.rows: i for i, v in enumerate(self.whole.variants) if v.seq_len == b}
        calls = {size: call_times(self.whole, whole[size], GPU) for size in self.sizes}
        prefs = [preferred_batch(OpProfile(str(i), tuple((size, calls[size][i]) for size in self.sizes)))
                 for i in range(len(calls[self.sizes[0]]))]
        first = next(v for v in self.staged.variants if v.seq_len == b)
        bounds = [0, *first.cuts, len(prefs)]
        return {"source": "compiled", "stages": [[a, e] for a, e in zip(bounds, bounds[1:])],
                "preferred_batch": _runs(prefs), "batch_sizes": self.sizes,
                "fused_operators": len(prefs),
                "launches": len(self.whole.variants[whole[1]].launches()),
                "stage_ms_at_bs64": [1e3 * self.time(s, BS_MAX, b) for s in range(self.n_stages)],
                "compile_seconds": self.staged.manifest.compile_seconds}


def compiled_model(name: str, zoo_dir: str, log: Callable[[str], None] = print) -> StagedModel:
    """``name``'s bundles in ``zoo_dir``, compiled there on first use: timing only
    (kernels and plans, no weights or CPU build), every length bucket in one bundle, cut
    in its stages and in one. ``compile_bundle`` keeps them current: a bundle whose cache
    key (the models, and a hash of the slicing passes' source) differs is made again --
    so a stage bundle cut before the boundaries had buffers of their own is re-cut, from
    the bundle cache, not served with host copies."""
    from pathlib import Path

    from paella.bundle import load_bundle
    from paella.compiler_pass.build import compile_bundle
    from paella.models import zoo
    zname, n, buckets = COMPILED[name]
    models = [zoo.get(zname, batch=b, seq_len=s or None) for s in buckets or (0,) for b in BATCH_SIZES]
    out = {}
    for tag, stages in (("", n), ("_whole", 1)):
        path = Path(zoo_dir) / f"dvabatch_{zname}{tag}"
        t0 = time.perf_counter()
        compile_bundle(models, path, stages=stages, stage_gpu=GPU, timing_only=True)
        out[tag] = load_bundle(path)
        took = time.perf_counter() - t0
        if took > 5:
            log(f"{name}: compiled {path.name} ({len(BATCH_SIZES)} batch sizes"
                f"{f' x {len(buckets)} lengths' if buckets else ''}, {stages} stage(s)) in "
                f"{took:.0f} s (first time only; cached in {zoo_dir} and the bundle cache)")
    return StagedModel(name, out[""], out["_whole"])


def rte_lengths(n: int, rng: np.random.Generator) -> np.ndarray:
    """Token counts shaped like GLUE RTE's (median about 60, a tail past 200)."""
    return np.clip(np.round(rng.lognormal(math.log(60), 0.55, n)), 8, 256).astype(int)


def batcher_options(m: StagedModel, system: str, window: float = 0.0) -> dict:
    """The ``[batching]`` options of ``system`` (``config.toml``'s, for the dvabatch
    batcher)."""
    if system == "dvabatch":
        # No window (stretch lets late queries join); a batch takes stretches while it
        # is in its first stage (Figure 3 Case-III's rule), bounded by the first
        # stage's time at batch 1 of the longest length.
        return {"pairs": DVA_PAIRS, "bs_max": "preferred", "window_us": 0.0,
                "t_comp_wait_us": 1e6 * m.time(0, 1, m.max_len), "stretch_idle_only": True}
    return {"pairs": 1, "bs_max": BS_MAX, "window_us": 1e6 * window, "stretch": False,
            "split": False, "group_lengths": False}


class Server:
    """One load point's daemon path: the simulated GPU, a dispatcher, a batching stage
    serving ``m``'s bundle for ``system`` with the dvabatch batcher."""

    def __init__(self, m: StagedModel, system: str, window: float, seed: int):
        self.dev = SimDevice(GPU, n_streams=1024, seed=seed)
        self.disp = Dispatcher(self.dev, "paella", profile_runs=0, kernel_core="auto")
        self.stage = BatchingStage(self.disp)
        bundle = m.bundle(system)
        served = {}
        for vi, (v, plan) in enumerate(zip(bundle.variants, m.plans(system))):
            mid = self.disp.register_model(plan.name, PlanAdaptor(plan))
            spec = VariantSpec(vi, v.rows, v.seq_len, v.name, cost_s=v.stage_seconds, stage=v.stage)
            served[vi] = ServedVariant(spec, mid, layout_of(v.inputs, v.outputs, v.io_bytes))
        variants = ModelVariants(m.name, tuple(sv.spec for sv in served.values()))
        self.batcher = make_batcher("dvabatch", variants, batcher_options(m, system, window))
        self.stage.add_model(MODEL_ID, ServedModel(m.name, variants, served, self.batcher))
        first = next(v for v in bundle.variants if v.stage == 0)
        last = next(v for v in bundle.variants if v.stage == bundle.n_stages - 1)
        self.tensors = [(t.name, tuple(t.shape), t.dtype) for t in (*first.inputs, *last.outputs)]
        self.first = first
        self._layouts: dict[int, tuple] = {}
        self._io = np.zeros(0, np.uint8)

    def request(self, i: int, seq_len: int, on_complete: Callable) -> Request:
        """Request ``i``: one row of length ``seq_len``, shaped as the whole model. The
        requests share one io region (timing only: their bytes are not checked here;
        the tests check the answers on real bytes)."""
        lay = self._layouts.get(seq_len)
        if lay is None:
            slots, nbytes = request_layout(self.tensors, self.first.rows, self.first.seq_len,
                                           1, seq_len)
            lay = self._layouts[seq_len] = (tuple(slots), nbytes)
            if nbytes > self._io.size:
                self._io = np.zeros(nbytes, np.uint8)
        return Request(i, i % 8, MODEL_ID, self._io, rows=1, seq_len=seq_len, layout=lay[0],
                       on_complete=on_complete)

    def serve(self, arrivals: np.ndarray, lengths: np.ndarray,
              stop_late: tuple[int, int, float] | None = None) -> np.ndarray | None:
        """Request ``i`` submitted at ``arrivals[i]`` (device seconds); each one's
        completion time. ``stop_late = (first, count, limit)``: stop, returning None, as
        soon as ``count`` requests from index ``first`` on are known to take longer than
        ``limit`` seconds (done late, or still waiting past it), checked at each arrival
        instant -- a peak probe's verdict, decided before the run's end."""
        dev, stage = self.dev, self.stage
        done = np.full(len(arrivals), np.nan)
        failed: list[str] = []

        def complete(req: Request, status: int, err: str | None) -> None:
            done[req.req_id] = dev.now()
            if status != STATUS_OK:
                failed.append(f"request {req.req_id}: status {status}: {err}")

        def arrive(due: range) -> None:
            if stop_late is not None and _late(done, arrivals, due.start, dev.now(), stop_late):
                raise _Late
            for i in due:
                stage.submit(self.request(i, int(lengths[i]), complete))
        try:
            VirtualDriver(self.disp, stage, on_stall=stage.unstall, name="dvabatch experiment").run(
                list(arrivals), arrive)
        except _Late:
            return None
        if failed:
            raise RuntimeError(f"{len(failed)} request(s) failed: {failed[0]}")
        return done


class _Late(Exception):
    """A peak probe's requests already miss the QoS target (:meth:`Server.serve`)."""


def _late(done: np.ndarray, arrivals: np.ndarray, upto: int, now: float,
          stop_late: tuple[int, int, float]) -> bool:
    """Whether ``count`` of the requests ``first..upto-1`` are known to exceed ``limit``
    at ``now``: answered late, or unanswered and waiting longer."""
    first, count, limit = stop_late
    if upto - first < count:
        return False
    lat = np.where(np.isnan(done[first:upto]), now, done[first:upto]) - arrivals[first:upto]
    return int(np.count_nonzero(lat > limit)) >= count


def run_point(m: StagedModel, system: str, rate: float, n: int, seed: int,
              window: float = 0.0, probe: bool = False) -> dict | None:
    """``n`` Poisson arrivals at ``rate``/s through ``system``; latency statistics and the
    batcher's counters. ``probe``: a peak probe, which stops (None) as soon as enough
    queries miss the QoS target that the p99 must exceed it."""
    srv = Server(m, system, window, seed)
    rng = np.random.default_rng(seed)
    arrivals = srv.dev.now() + np.cumsum(rng.exponential(1.0 / rate, n))
    lens = rte_lengths(n, rng) if m.buckets else np.zeros(n, int)
    warm = n // 10
    done = srv.serve(arrivals, lens, (warm, _late_count(n - warm), QOS_MS / 1e3) if probe else None)
    if done is None:
        return None
    lat = (done - arrivals)[warm:]
    span = float(np.max(done[warm:]) - arrivals[warm])
    st = srv.batcher.pipe.stats
    bst = srv.batcher.stats
    return {"system": system, "offered": rate, "throughput": (n - warm) / span,
            **latency_summary(lat), "new": st.new, "stretch": st.stretch, "split": st.split,
            "mean_stage_batch": float(np.mean(st.stage_rows)) if st.stage_rows else 0.0,
            "padded_token_share": st.padded_tokens / max(1, st.padded_tokens + int(lens.sum()))
            if m.buckets else 0.0,
            "bs_max": srv.batcher.pipe.cfg.bs_max,
            "jobs": bst.jobs, "handoff": bst.handoff, "boundary_host_bytes": bst.boundary_host_bytes}


def _late_count(m: int) -> int:
    """How many of ``m`` latencies above a limit put their p99 above it for certain:
    ``latency_summary``'s p99 (numpy's linear interpolation) is at least the sorted
    value at ``floor(0.99 (m - 1))``, which exceeds the limit once ``m - floor(...)``
    latencies do."""
    return m - math.floor(0.99 * (m - 1))


def peak(m, system: str, n: int, seed: int, window: float = 0.0, steps: int = 5,
         bracket: tuple[float, float] | None = None, below: bool = True
         ) -> tuple[float, float] | None:
    """The highest Poisson load (queries/s) meeting the QoS at p99 while completions
    keep up, as a bracket ``(lo, hi)``: ``lo`` meets it (the peak), ``hi`` does not.
    From scratch: doubling from a quarter of the model's batch-64 throughput, then
    ``steps`` bisections. From another system's ``bracket``: if ``lo`` meets the QoS
    and ``hi`` does not, that bracket, at its resolution (two probes); if ``hi`` meets
    it too, doubling from ``hi`` then bisection; if ``lo`` does not, bisection below
    ``lo`` -- or None with ``below=False`` (the caller only wants a higher peak). Each
    probe stops as soon as its p99 must miss the QoS (:func:`run_point`'s ``probe``)."""
    def ok(rate: float) -> bool:
        pt = run_point(m, system, rate, n, seed, window, probe=True)
        return pt is not None and pt["p99_ms"] <= QOS_MS and pt["throughput"] >= 0.9 * rate
    if bracket is None:
        lo, hi = 0.0, 0.25 * BS_MAX / m.time(-1, BS_MAX, m.max_len)
    elif bracket[0] > 0 and ok(bracket[0]):
        if not ok(bracket[1]):
            return bracket
        lo, hi = bracket[1], 2 * bracket[1]
    elif not below:
        return None
    else:
        lo, hi = 0.0, bracket[0] if bracket[0] > 0 else bracket[1]
    if bracket is None or lo > 0:
        while ok(hi):
            lo, hi = hi, 2 * hi
    for _ in range(steps):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if ok(mid) else (lo, mid)
    return lo, hi


def run(models: list[str], n: int, seed: int, windows_ms: list[float], steps: int,
        log: Callable[[str], None] = print, zoo_dir: str = "") -> dict:
    per_model = {}
    for name in models:
        m = compiled_model(name, zoo_dir, log)
        # DelayBatch's window: the first (smallest) searched from scratch; each other
        # one only probed at the best bracket so far, and searched further only if it
        # meets the QoS at the bracket's top (ties keep the smaller window).
        best: tuple[float, tuple[float, float]] | None = None
        for w in sorted(windows_ms):
            br = peak(m, "delaybatch", n, seed, w / 1e3, steps,
                      bracket=best[1] if best else None, below=False)
            log(f"{name}: DelayBatch window {w:g} ms -> "
                + (f"peak {br[0]:.0f}/s" if br else f"below {best[1][0]:.0f}/s"))
            if br is not None and (best is None or br[0] > best[1][0]):
                best = (w, br)
        window_ms, delay_br = best
        delay_peak = delay_br[0]
        dva_peak = peak(m, "dvabatch", n, seed, 0.0, steps, bracket=delay_br)[0]
        zero_peak = peak(m, "zerobatch", n, seed, 0.0, steps, bracket=delay_br)[0]
        log(f"{name}: peaks ZeroBatch {zero_peak:.0f}/s, DelayBatch {delay_peak:.0f}/s "
            f"(window {window_ms:g} ms), DVABatch {dva_peak:.0f}/s")
        loads = {}
        for load, frac in LOADS.items():
            rate = frac * delay_peak
            pts = {s: run_point(m, s, rate, n, seed, window_ms / 1e3 if s == "delaybatch" else 0.0)
                   for s in ("zerobatch", "delaybatch", "dvabatch")}
            loads[load] = {"rate": rate, **pts}
            log(f"{name} {load} ({rate:.0f}/s): " + ", ".join(
                f"{s} mean {p['mean_ms']:.1f} p99 {p['p99_ms']:.1f} ms" for s, p in pts.items()))
        per_model[name] = {**m.record(),
                           "delay_window_ms": window_ms,
                           "peak": {"zerobatch": zero_peak, "delaybatch": delay_peak,
                                    "dvabatch": dva_peak},
                           "loads": loads}
    return {"models": per_model, "summary": summarize(per_model), "paper": PAPER,
            "setting": {"gpu": GPU, "qos_ms": QOS_MS, "bs_max": BS_MAX, "queries": n,
                        "seed": seed, "delay_windows_ms": windows_ms, "bisection_steps": steps,
                        "kernels": "compiled",
                        "path": "daemon batcher (BatchingStage + dvabatch, virtual time)"}}


def _reduction(base: float, new: float) -> float:
    return 100.0 * (base - new) / base if base > 0 else float("nan")


def summarize(per_model: dict) -> dict:
    """The issue's keys: per load, the mean over the models of DVABatch's latency
    reduction (percent, positive = lower) and, per model, DVABatch's peak throughput
    over DelayBatch's."""
    def mean_over(key: str, base: str) -> dict:
        return {load: float(np.mean([_reduction(pm["loads"][load][base][key],
                                                pm["loads"][load]["dvabatch"][key])
                                     for pm in per_model.values()])) for load in LOADS}
    ratios = {n: pm["peak"]["dvabatch"] / pm["peak"]["delaybatch"] for n, pm in per_model.items()}
    return {"avg_latency_reduction_vs_zerobatch": mean_over("mean_ms", "zerobatch"),
            "p99_latency_reduction_vs_zerobatch": mean_over("p99_ms", "zerobatch"),
            "avg_latency_reduction_vs_delaybatch": mean_over("mean_ms", "delaybatch"),
            "p99_latency_reduction_vs_delaybatch": mean_over("p99_ms", "delaybatch"),
            "peak_throughput_ratio": {**ratios, "mean": float(np.mean(list(ratios.values())))}}


def plot(data: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from paella.experiments.cli import save_figure
    models = list(data["models"])
    fig, axes = plt.subplots(1, len(models), figsize=(4 * len(models), 3.2), squeeze=False)
    systems = ("zerobatch", "delaybatch", "dvabatch")
    for ax, name in zip(axes[0], models):
        loads = data["models"][name]["loads"]
        x = np.arange(len(loads))
        for k, s in enumerate(systems):
            ax.bar(x + (k - 1) * 0.27, [loads[ld][s]["mean_ms"] for ld in loads], 0.27, label=s)
        ax.set_xticks(x, list(loads))
        ax.set_title(name)
        ax.set_ylabel("average latency (ms)")
        ax.set_yscale("log")
    axes[0][0].legend(fontsize=7)
    save_figure(fig, path)


def register(sub: argparse._SubParsersAction) -> None:
    from paella.experiments.cli import add_common
    p = sub.add_parser("dvabatch", help="DVABatch vs ZeroBatch and DelayBatch (Figures 14-16)")
    from paella.experiments.cli import add_zoo_dir
    add_common(p)
    add_zoo_dir(p)
    p.add_argument("--queries", type=int, default=None,
                   help="queries per load point (default 1500, quick 400)")
    p.add_argument("--models", default=",".join(MODELS),
                   help=f"comma-separated subset of {', '.join(MODELS)}")
    p.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    from paella.experiments.cli import finish
    models = [s.strip() for s in args.models.split(",") if s.strip()]
    bad = [s for s in models if s not in MODELS]
    if bad or not models:
        print(f"paella: error: unknown model(s) {', '.join(bad) or '(none)'}; "
              f"choose from {', '.join(MODELS)}", file=sys.stderr)
        return 2
    n = args.queries or (400 if args.quick else 1500)
    windows = [2.0, 8.0, 32.0] if args.quick else [1.0, 2.0, 4.0, 8.0, 16.0, 32.0]
    t0 = time.perf_counter()
    log = lambda m: print(m, file=sys.stderr, flush=True)  # noqa: E731
    data = run(models, n, args.seed, windows, steps=3 if args.quick else 5, log=log,
               zoo_dir=args.zoo_dir)
    s = data["summary"]
    import json
    print(json.dumps(s, indent=1))
    return finish(data, args, plot, t0)


def report_section(d: dict) -> list[str]:
    """The DVABatch section of docs/EXPERIMENTS.md, every figure read from ``d``."""
    s, p, st, ms = d["summary"], d["paper"], d["setting"], d["models"]
    loads = list(LOADS)

    def row(label: str, vals: dict) -> str:
        return f"| {label} | " + " | ".join(f"{vals[ld]:.1f}" for ld in loads) + " |"
    rows = ["| | low (1/4) | medium (3/5) | high (9/10) |", "|---|---:|---:|---:|"]
    for key in ("avg_latency_reduction_vs_zerobatch", "p99_latency_reduction_vs_zerobatch",
                "avg_latency_reduction_vs_delaybatch"):
        rows += [row(f"`summary.{key}`, ours", s[key]), row("the paper's", p[key])]
    paper_peak = {"unet": "1.0 (Unet, LinkNet)", "bert": "1.47 (BertBase), 2.37 (BertLarge)",
                  "resnet152": "1.0"}
    per = ["| model | mean latency ZeroBatch / DelayBatch / DVABatch (ms), low | medium | high | "
           "`summary.peak_throughput_ratio` (DVABatch / DelayBatch) | the paper's |",
           "|---|---|---|---|---:|---:|"]
    for name, pm in ms.items():
        cells = [" / ".join(f"{pm['loads'][ld][sy]['mean_ms']:.1f}"
                            for sy in ("zerobatch", "delaybatch", "dvabatch")) for ld in loads]
        per.append(f"| {name} | " + " | ".join(cells) +
                   f" | {s['peak_throughput_ratio'][name]:.2f} | {paper_peak.get(name, '-')} |")
    r = {k: s[k] for k in s}
    windows = "/".join(f"{w:g}" for w in st["delay_windows_ms"])
    chosen = sorted({pm["delay_window_ms"] for pm in ms.values()})
    compiled = st.get("kernels", "described") == "compiled"
    quick = st["queries"] <= 400
    steps = st.get("bisection_steps", 3 if quick else 5)
    out = [_models_paragraph(ms, st, compiled) + " "
           f"Poisson arrivals at 1/4, 3/5 and 9/10 of DelayBatch's "
           f"peak, {st['queries']:,} queries a point, QoS {st['qos_ms']:g} ms, maximum batch "
           f"{st['bs_max']}. DelayBatch's window is the one of {windows} ms with the highest peak "
           f"(chosen: {', '.join(f'{w:g}' for w in chosen)} ms; the smallest searched by doubling "
           f"and {steps} bisection steps, each larger one probed at the best bracket so far and "
           f"searched on only if it beats it, ties keeping the smaller; ZeroBatch's and DVABatch's "
           f"peaks searched from DelayBatch's bracket). DVABatch: "
           f"4 stages (2 for BERT) even in time, three buffer pairs, a batch bounded by the "
           f"model's preferred batch size (" + ", ".join(
               f"{n} {pm['loads']['high']['dvabatch'].get('bs_max', BS_MAX)}" for n, pm in ms.items())
           + "), the three policies (docs/dvabatch.md). "
           f"Reductions are in percent of the baseline's latency (positive: DVABatch lower), the mean "
           f"over the models as the paper averages over its six."
           + (" These figures are the `--quick` run (400 queries a point, 3 windows, 3 bisection "
              "steps), not the full run." if quick else ""), "",
        *rows, "", *per, "", "Differences, one sentence each:", ""]
    z, dl, pz, pd = (r["avg_latency_reduction_vs_zerobatch"], r["avg_latency_reduction_vs_delaybatch"],
                     p["avg_latency_reduction_vs_zerobatch"], p["avg_latency_reduction_vs_delaybatch"])
    z99, pz99 = r["p99_latency_reduction_vs_zerobatch"], p["p99_latency_reduction_vs_zerobatch"]

    def means(ld: str, systems=("zerobatch", "dvabatch"), key="mean_ms") -> str:
        return "; ".join(f"{n} " + " / ".join(f"{pm['loads'][ld][sy][key]:.1f}" for sy in systems)
                         for n, pm in ms.items())
    ratio = s["peak_throughput_ratio"]
    out += [
        f"- **Low load, against ZeroBatch ({z['low']:.1f} vs {pz['low']:.1f})**: at low load a "
        f"batch is one or two queries and the gain is the stage pipeline alone (a query's first "
        f"stage beside an earlier one's later stages); "
        + ("our compiled kernels already fill most of the simulated GPU at batch 1-2 (the "
           "preferred batch sizes above), so there is little idle GPU for it" if compiled else
           "ours is lower where a model gains little at low load")
        + f" -- mean ms ZeroBatch / DVABatch: {means('low')}.",
        f"- **Medium and high load, against ZeroBatch ({z['medium']:.1f} / {z['high']:.1f} vs "
        f"{pz['medium']:.1f} / {pz['high']:.1f})**: "
        + ("the issue's bar, at least 50% at high load, is met. " if z["high"] >= 50 else
           "the issue's bar, at least 50% at high load, is **not met**. ")
        + "Per model at high load: " + "; ".join(
            f"{n} {_reduction(pm['loads']['high']['zerobatch']['mean_ms'], pm['loads']['high']['dvabatch']['mean_ms']):.0f}% "
            f"(DVABatch's mean stage batch {pm['loads']['high']['dvabatch']['mean_stage_batch']:.1f}, "
            f"stretches {pm['loads']['high']['dvabatch']['stretch']}, "
            f"splits {pm['loads']['high']['dvabatch']['split']}; ZeroBatch's batch "
            f"{pm['loads']['high']['zerobatch']['mean_stage_batch']:.1f})" for n, pm in ms.items())
        + "; our reading, not isolated: the loads are fractions of DelayBatch's peak, so where "
        "DVABatch's peak is far above it (BERT, padding) the baselines are not near saturation "
        "at 'high' load, and where the compiled kernels fill the GPU at batch 1-2 (BERT's "
        "queries run nearly alone: stage batch above) there is little idle GPU for a pipeline.",
        "- **Against the earlier path** (commit c89b8b9's `--quick` run: `DvaPipeline` driven "
        "directly, fixed-duration stage kernels interfering only through block slots, 55.7% at "
        "high load): the largest change is ResNet-152's DVABatch at high load (14.8 ms then, "
        + (f"{ms['resnet152']['loads']['high']['dvabatch']['mean_ms']:.1f} ms now"
           if "resnet152" in ms else "not run now")
        + "); candidate cause, not isolated: overlapping stage jobs now share the SMs, "
        "bandwidth and issue slots of the timing model and pay a launch per stage job.",
        f"- **Against DelayBatch ({dl['low']:.1f} / {dl['medium']:.1f} / {dl['high']:.1f} vs "
        f"{pd['low']:.1f} / {pd['medium']:.1f} / {pd['high']:.1f})**: the peak search chose windows of "
        f"{', '.join(f'{w:g}' for w in chosen)} ms; "
        + ("so short a window costs little latency at low load here, where the paper's DelayBatch "
           "loses more" if dl["low"] < pd["low"] / 2 else "a window costs latency at low load as "
           "in the paper")
        + f", and at high load our DelayBatch, one whole-model batch at a time, queues like "
        f"ZeroBatch, which is where DVABatch gains most here (mean ms DelayBatch / DVABatch at "
        f"high: {means('high', ('delaybatch', 'dvabatch'))}).",
        f"- **p99 against ZeroBatch ({z99['low']:.1f} / {z99['medium']:.1f} / {z99['high']:.1f} vs "
        f"{pz99['low']:.1f} / {pz99['medium']:.1f} / {pz99['high']:.1f})**: the tails shrink more than "
        f"the means at low and medium load (p99 ms ZeroBatch / DVABatch at low: "
        f"{means('low', key='p99_ms')}): a query arriving while a large batch runs waits for the "
        f"whole model under ZeroBatch, only for the first stage under DVABatch (stretch) -- our "
        f"reading, not isolated.",
        f"- **Peak throughput, BERT ({ratio.get('bert', float('nan')):.2f} vs "
        f"1.47-2.37)**: DVABatch removes padding by grouping lengths (the baselines pad a batch to "
        f"its longest query's bucket)"
        + ((" (peaks ZeroBatch / DelayBatch / DVABatch: " + " / ".join(
            f"{ms['bert']['peak'][sy]:.0f}" for sy in ("zerobatch", "delaybatch", "dvabatch"))
            + f" queries/s; each to 1/{2 ** steps} of its doubling bracket)") if "bert" in ms else "")
        + ".",
        "- **Peak throughput, Unet and ResNet (" + ", ".join(
            f"{ratio[n]:.2f}" for n in ("unet", "resnet152") if n in ms) +
        " vs 1.0)**: " + ("the same as the paper's: the three systems reach the same peak."
                          if all(abs(ratio[n] - 1) < 0.05 for n in ("unet", "resnet152") if n in ms)
                          else "our baselines run one whole-model batch at a time (one model "
                               "instance), so DVABatch's stage pipeline, which keeps up to three batches on "
                               "the GPU, adds throughput where the paper found the hardware the "
                               "limit for both."),
        ("- **Models**: ours are three compiled networks (TVM's fused operators and DLight "
         "schedules, timed by our simulator's model of a Titan RTX) where the paper ran six "
         "models' TensorRT engines on a real one; the batch sizes are the powers of two, not "
         "all of 1..64 (compile time: docs/dvabatch.md), other sizes run in pieces."
         if compiled else
         "- **Models**: ours are three, described by kernel shapes and times rather than compiled "
         "networks, on the simulated Titan RTX (the paper's GPU) with TensorRT's kernels replaced by "
         "our own block counts and wave times."),
        *(["- **Stage cuts** (" + "; ".join(
            f"{n} " + " / ".join(f"{t:.0f}" for t in pm["stage_ms_at_bs64"])
            for n, pm in ms.items() if "stage_ms_at_bs64" in pm) + " ms at batch 64): even in "
            "time, then each cut moved to a change of the operators' preferred batch size where "
            "that keeps the longest stage within 10% (the paper names both rules, not how it "
            "weighs them); cutting at preference changes first left ResNet-152 at 10 / 13 / 78 / "
            "8 ms and DVABatch at 21% on it at high load (docs/dvabatch.md, 'Slicing')."]
          if compiled and any("stage_ms_at_bs64" in pm for pm in ms.values()) else []),
        "- **Policy settings the paper leaves open or sets otherwise**: `T_comp_wait` is the first "
        "stage's time at batch 1 and a stretch also needs the first stage free at once; three "
        "buffer pairs (the paper: two at peak load) and a batch bounded by the model's preferred "
        "batch size (the paper: 64, with policy II splitting toward the preferred sizes; our "
        "split rule rarely fires on a batch of 64, whose halves cost more than it on the "
        "compiled ResNet-152: docs/dvabatch.md); together the best of the "
        "settings tried on the three models (three pairs: U-Net-like 28.6 ms against 34.9 at "
        "high load, the others within 3%; the bound: ResNet-152 23.7 against 29.3), the paper's "
        "policy-I window and time-only stretches worse (docs/dvabatch.md has the measurements).",
        "", "Quick variant: `--quick` (400 queries a point instead of 1,500, DelayBatch windows "
        "2/8/32 ms instead of six, 3 bisection steps instead of 5; every model, system and load, "
        "on the same path): "
        + ("about 3 minutes once compiled (164 s measured on the shared 2-core machine); the "
           "first run compiles the three networks (timing-only, 7 batch sizes, BERT's four length "
           "buckets) in about 7 minutes." if compiled else "4 s on this machine.")]
    return out


def _models_paragraph(ms: dict, st: dict, compiled: bool) -> str:
    gpu = GPU_NAMES.get(st["gpu"], st["gpu"])
    if not compiled:
        def pref(name: str, i: int) -> str:
            return str(ms[name]["preferred_batch"][i]) if name in ms else "?"
        return (f"Three kernel-described models on the simulated {gpu} behind the kernel scheduler "
                f"(`paella` policy, virtual time, a free dispatcher): Unet-like (12 operators "
                f"preferring batch {pref('unet', 0)}, then 12 preferring batch {pref('unet', -1)}), "
                f"BERT-like (12 operators whose time grows with the length; lengths drawn like GLUE "
                f"RTE's, buckets 32/64/128/256) and ResNet-152-like (32 operators preferring batch "
                f"{pref('resnet152', 0)}).")
    desc = {"unet": "U-Net-like (`unet`: width 64, four levels, 256x256)",
            "bert": "BERT-like (`bert_base`: 12 layers, hidden 768; lengths drawn like GLUE RTE's, "
                    "buckets 32/64/128/256 in one served model)",
            "resnet152": "ResNet-152 (`resnet152`, 224x224)"}
    parts = []
    for n, pm in ms.items():
        prefs = sorted(set(pm["preferred_batch"]))
        parts.append(f"{desc.get(n, n)}: {pm['fused_operators']} fused operators, stages of "
                     + " / ".join(f"{t:.0f}" for t in pm["stage_ms_at_bs64"])
                     + f" ms at batch 64, preferred batch sizes {', '.join(map(str, prefs))}")
    return (f"Three compiled networks on the simulated {gpu}, each served as the daemon serves "
            f"it: a batching stage in front of the kernel scheduler (`paella` policy, virtual time, "
            f"a free dispatcher), the `dvabatch` batcher for every system, the compiled variants' "
            f"launch plans timed by the simulator's model (warps, bandwidth, launch latency), "
            f"compiled for batch sizes "
            f"{', '.join(map(str, next(iter(ms.values()))['batch_sizes']))} (timing-only bundles) and "
            f"cut by `paella compile --stages` (the baselines: one stage); rows between compiled "
            f"sizes run as pieces of compiled sizes: " + "; ".join(parts) + ".")
