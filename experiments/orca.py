"""``paella experiment orca``: iteration-level scheduling against request-level batching
(the Orca chapter's Figure 4.8), on the step runtime.

Setting. A GPT-2-small-shaped decoder (d 768, 12 layers, 12 heads, vocabulary 50257)
on the simulated GPU (``--gpu``, default V100), every iteration one job of the kernel
scheduler with the selectively batched kernels of :func:`paella.stepsched.step_kernels.
transformer_iteration` (dense kernels over the batch's flattened tokens, one ragged
attention launch). The trace is the chapter's: prompts uniform in 32-512 tokens, output
lengths uniform in 1-128, Poisson arrivals swept. Timing only: no weights, the outputs'
lengths are the trace's (the functional path is tested in tests/stepsched).

* ``orca``: Algorithm 2 with ``--max-bs`` (default 32) and the KV cache's slots
  (``--slots``, default 32768: 2.4 GB of fp32 keys and values);
* ``request``: request-level batching, FasterTransformer behind a server that takes at
  most ``--max-bs`` requests from its queue when idle and runs them to completion
  (prompts padded to the longest, as many iterations as the longest output).

Metrics, per the chapter: median end-to-end latency normalized by each request's number
of generated tokens, against throughput. ``summary.throughput_ratio_at_equal_latency``:
the chapter matches a median normalized latency of twice Orca's normalized execution
time (190 ms for its 175B model); here the level is twice Orca's median normalized
latency at the lowest load swept, and each system's throughput at that level is
interpolated along its sweep. ``summary.ttft_ms`` and ``summary.inter_token_ms`` give
time to first token and the gaps between tokens at p50 and p99 at a moderate load (half
of request-level batching's peak). Request-level batching streams nothing: its first
token arrives with the last.

How it runs: every step is a launch plan that the dispatcher replays on its kernel core
(the step runtime's replayed steps; ``run_point(replay=False)`` launches each step kernel
by kernel through the step adaptor instead: the same figures, bit for bit, slower), and the
load points run in ``--workers`` processes, each point alone on a simulated GPU of its
own: the figures are the same for any number of workers.
"""
from __future__ import annotations

import argparse
from functools import partial
from typing import Any, Callable

import numpy as np

#: The chapter's headline: 36.9x throughput at a median normalized latency of 190 ms
#: (GPT-3 175B on 16 A100s, against FasterTransformer).
PAPER = {"throughput_ratio_at_equal_latency": 36.9, "latency_level_ms": 190,
         "model": "GPT-3 175B, 16 A100 GPUs"}
FULL_RATES = [5, 10, 20, 30, 40, 60, 80, 100, 130, 160, 200]
QUICK_RATES = [5, 15, 30, 60, 100, 160]
#: On the compiled kernels (an iteration takes about ten times longer, see the report):
#: request-level batching saturates below 2 req/s and Orca near 5.
COMPILED_RATES = [0.25, 0.5, 1, 1.5, 2, 3, 4, 5, 6, 8]
COMPILED_QUICK_RATES = [0.25, 0.5, 1, 2, 4, 6]


def trace(n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return rng.integers(32, 513, n), rng.integers(1, 129, n)


def run_point(system: str, rate: float, prompts: np.ndarray, outs: np.ndarray, *, max_bs: int,
              n_slots: int, seed: int = 1, gpu: str = "v100", warmup: float = 0.1,
              kernels: Any = None, replay: bool = True) -> dict:
    """One load point; ``kernels``: the compiled iteration's kernels
    (:class:`~paella.stepsched.compiled_iteration.IterationKernels`), None: the kernels
    derived from the shapes (:func:`~paella.stepsched.step_kernels.transformer_iteration`).
    ``replay``: every step a launch plan the dispatcher replays on its kernel core (the
    step runtime's replayed steps); False: the step runtime's own adaptor, launching kernel
    by kernel through the dispatcher's Python path: the same launches at the same times
    (the same figures), up to 1.4 times the CPU time (on Orca's points; request-level
    batching's whole generations cost about as much either way, their plans being built
    once per task)."""
    from paella.dispatcher.batchers.stage import scheduler_context
    from paella.dispatcher.core import Dispatcher
    from paella.dispatcher.devices.sim import SimDevice
    from paella.experiments.cellular import poisson_arrivals
    from paella.models.gpt import GPTConfig
    from paella.stepsched.generation import GenerationEngine
    from paella.stepsched.iteration_scheduler import GenRequest
    from paella.stepsched.step_kernels import request_level_generation
    from paella.stepsched.padding import RequestBatcher
    from paella.stepsched.runtime import StepRuntime

    cfg = GPTConfig.gpt2_small()
    # A compiled prefill of 32 long prompts launches kernels of up to 1.5 M blocks, each
    # 16 posting two notifQ entries: more than the default ring holds.
    dev = SimDevice(gpu, n_streams=64, seed=seed, notifq_slots=1 << 19)
    ctx = scheduler_context(Dispatcher(dev, "paella", profile_runs=0,
                                       kernel_core="auto" if replay else None), system)
    n = len(prompts)
    arrivals = poisson_arrivals(rate, n, seed)
    first = np.full(n, np.nan)
    done = np.full(n, np.nan)
    gaps: list[float] = []
    if system == "orca":
        eng = GenerationEngine(ctx, cfg, max_bs=max_bs, n_slots=n_slots, iteration_kernels=kernels,
                               plans=replay)
        streams = {}

        def arrive(i: int) -> None:
            streams[i] = eng.submit([0] * int(prompts[i]), int(outs[i]), out_len=int(outs[i]), kick=False)

        _refuse_failures(eng.runtime)
        eng.runtime.drive([(float(a), i) for i, a in enumerate(arrivals)], on_arrival=arrive)
        for i, s in streams.items():
            first[i], done[i] = s.times[0], s.times[-1]
            gaps.extend(np.diff(s.times))
        stats = eng.runtime.stats.to_dict()
    elif system == "request":
        reqs = [GenRequest(i, int(p), int(p) + int(o), int(o), float(a))
                for i, (p, o, a) in enumerate(zip(prompts, outs, arrivals))]
        if kernels is not None:
            from paella.stepsched.compiled_iteration import request_level_compiled
            level = partial(request_level_compiled, kernels)
        else:
            level = partial(request_level_generation, cfg)
        rt = StepRuntime(ctx, RequestBatcher(max_bs),
                         lambda t: level([r.prompt_len for r in t.requests],
                                         [r.limit for r in t.requests]), name="ft", plans=replay)
        _refuse_failures(rt)
        rt.drive([(r.arrival, r) for r in reqs])
        for r in reqs:
            first[r.req_id] = done[r.req_id] = rt.finished[r]
        stats = rt.stats.to_dict()
    else:
        raise ValueError(f"unknown system {system!r}; use orca or request")
    keep = slice(int(n * warmup), n)
    lat = done[keep] - arrivals[keep]
    norm = lat / outs[keep]
    span = np.nanmax(done[keep]) - arrivals[keep][0]
    ttft = (first[keep] - arrivals[keep]) * 1e3
    out = {"system": system, "offered": rate, "throughput": float((n - keep.start) / span),
           "median_norm_latency_ms": float(np.median(norm) * 1e3),
           "p50_ms": float(np.median(lat) * 1e3), "p99_ms": float(np.percentile(lat, 99) * 1e3),
           "ttft_p50_ms": float(np.percentile(ttft, 50)), "ttft_p99_ms": float(np.percentile(ttft, 99)),
           **stats}
    if gaps:
        g = np.array(gaps) * 1e3
        out.update(inter_token_p50_ms=float(np.percentile(g, 50)), inter_token_p99_ms=float(np.percentile(g, 99)))
    return out


def _refuse_failures(rt: Any) -> None:
    """A step whose job failed ends the experiment: its requests would otherwise count
    as served at once."""
    inner = rt.on_task_done

    def hook(task: Any, done: list) -> None:
        if task.status:
            raise RuntimeError(f"a {rt.adaptor.name} step of {len(task.requests)} requests failed "
                               f"(status {task.status}): the run is not valid")
        if inner is not None:
            inner(task, done)
    rt.on_task_done = hook


def throughput_at(points: list[dict], level_ms: float) -> float:
    """The throughput a system sustains with its median normalized latency at
    ``level_ms``: interpolated between the last point under it and the next (by load)."""
    pts = sorted(points, key=lambda p: p["offered"])
    best = 0.0
    for a, b in zip([None] + pts, pts):
        if b["median_norm_latency_ms"] <= level_ms:
            best = max(best, b["throughput"])
        elif a is not None and a["median_norm_latency_ms"] <= level_ms:
            f = (level_ms - a["median_norm_latency_ms"]) / (b["median_norm_latency_ms"] - a["median_norm_latency_ms"])
            best = max(best, a["throughput"] + f * (b["throughput"] - a["throughput"]))
            break
        else:
            break
    return best


def _line(p: dict) -> str:
    return (f"  {p['system']:8s} {p['offered']:6.4g} req/s offered: {p['throughput']:6.1f} served, median "
            f"normalized latency {p['median_norm_latency_ms']:7.2f} ms, mean batch {p['mean_batch']:.1f}")


def sweep(system: str, rates: list[float], prompts, outs, **kw) -> list[dict]:
    pts = []
    for r in rates:
        p = run_point(system, r, prompts, outs, **kw)
        print(_line(p), flush=True)
        pts.append(p)
    return pts


def default_workers() -> int:
    """Worker processes for the load points: the CPUs this process may use, at most 4
    (each holds a GPT-2's weights while it loads a compiled variant: up to 1.8 GB)."""
    import os
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return max(1, min(4, cpus or 1))


def run_points(sweeps: dict[str, list[float]], then: Callable[[dict], dict[str, float]],
               prompts, outs, *, workers: int = 1, **kw) -> tuple[dict, dict]:
    """Every load point of ``sweeps`` (system -> rates), then one point per system at the
    rate ``then(the sweeps' points)`` gives it (the moderate load). Returns the sweeps'
    points (system -> points, in the order of its rates) and those last points (system
    -> point).

    ``workers`` > 1: the points run in that many worker processes (spawned), that many
    at a time, the last ones as soon as the sweeps are in. Each point runs alone on a
    simulated GPU and a dispatcher of its own, from its own seed, so its figures are the
    same in whichever process it runs, and the same as with ``workers`` = 1 (one point
    after the other, here)."""
    if workers <= 1 or sum(map(len, sweeps.values())) <= 1:
        out = {s: sweep(s, rates, prompts, outs, **kw) for s, rates in sweeps.items()}
        return out, {s: run_point(s, r, prompts, outs, **kw) for s, r in then(out).items()}
    import multiprocessing
    from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
    k = kw.pop("kernels", None)
    spec = None if k is None else (k.cfg, str(k.out), k.cache_dir)
    # The longest points first, so that the workers end together: request-level
    # batching's (each about as long as Orca's longest), then Orca's from the lowest load
    # up (they shorten as its batches grow).
    todo = [(s, r, False) for s in sorted(sweeps, key=lambda s: s != "request")
            for r in sorted(sweeps[s])]
    n_sweep = len(todo)
    results: dict[tuple[str, float], dict] = {}
    last: dict[str, dict] = {}
    running: dict = {}
    pool = ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn"),
                               initializer=_init_worker, initargs=(spec,))
    try:
        while todo or running:
            while todo and len(running) < workers:
                s, r, final = todo.pop(0)
                running[pool.submit(_worker_point, s, r, prompts, outs, kw)] = (s, r, final)
            done, _ = wait(running, return_when=FIRST_COMPLETED)
            for f in done:
                s, r, final = running.pop(f)
                p = f.result()
                print(_line(p), flush=True)
                if final:
                    last[s] = p
                    continue
                results[(s, r)] = p
                if len(results) == n_sweep:
                    out = {s: [results[(s, r)] for r in rates] for s, rates in sweeps.items()}
                    todo[:0] = [(s, r, True) for s, r in then(out).items()]
    finally:
        pool.shutdown(wait=not running, cancel_futures=True)
    return out, {s: last[s] for s in sweeps}


#: A worker process's compiled iteration kernels (:func:`_init_worker`), loaded as its
#: points meet them and kept for its next points.
_KERNELS: Any = None


def _init_worker(spec: tuple | None) -> None:
    global _KERNELS
    if spec is not None:
        from paella.stepsched.compiled_iteration import IterationKernels
        cfg, out, cache_dir = spec
        _KERNELS = IterationKernels(cfg, out, cache_dir=cache_dir,
                                    progress=lambda m: print(f"  {m}", flush=True))


def _worker_point(system: str, rate: float, prompts, outs, kw: dict) -> dict:
    return run_point(system, rate, prompts, outs, kernels=_KERNELS, **kw)


def run(args: argparse.Namespace) -> dict:
    compiled = args.kernels == "compiled"
    if compiled:
        rates = COMPILED_QUICK_RATES if args.quick else COMPILED_RATES
        n = args.requests or (60 if args.quick else 200)
    else:
        rates = QUICK_RATES if args.quick else FULL_RATES
        n = args.requests or (150 if args.quick else 400)
    prompts, outs = trace(n, args.seed)
    kw: dict = dict(max_bs=args.max_bs, n_slots=args.slots, seed=args.seed, gpu=args.gpu)
    if compiled:
        from pathlib import Path

        from paella.models.gpt import GPTConfig
        from paella.stepsched.compiled_iteration import IterationKernels
        out = Path(args.bundles or "bundles/orca-iteration")
        kw["kernels"] = IterationKernels(GPTConfig.gpt2_small(), out,
                                         progress=lambda m: print(f"  {m}", flush=True))
    data: dict = {"setting": {"gpu": args.gpu, "model": "GPT-2 small shapes (d 768, 12 layers)",
                              "kernels": ("compiled (TVM's kernels of models/gpt.py:gpt_iteration, one "
                                          "variant per (tokens, slots) bucket)" if compiled else
                                          "from the shapes (step_kernels.transformer_iteration)"),
                              "max_bs": args.max_bs, "n_slots": args.slots, "requests_per_point": n,
                              "rates": rates, "prompts": "U(32, 512)", "outputs": "U(1, 128)"},
                  "paper": PAPER}

    def moderate_load(sweeps: dict) -> dict[str, float]:
        moderate = 0.5 * max(p["throughput"] for p in sweeps["request"])
        print(f"moderate load (half of request-level batching's peak): {moderate:.1f} req/s", flush=True)
        return {s: moderate for s in sweeps}
    workers = args.workers or default_workers()
    data["sweeps"], mod = run_points({s: rates for s in ("orca", "request")}, moderate_load,
                                     prompts, outs, workers=workers, **kw)
    data["moderate"] = mod
    level = 2 * min(data["sweeps"]["orca"], key=lambda p: p["offered"])["median_norm_latency_ms"]
    at = {s: throughput_at(pts, level) for s, pts in data["sweeps"].items()}
    moderate = mod["orca"]["offered"]
    ratio = at["orca"] / at["request"] if at["request"] > 0 else None
    data["summary"] = {
        "throughput_ratio_at_equal_latency": round(ratio, 3) if ratio is not None else None,
        "latency_level_ms": round(level, 3),
        "throughput_at_level": {s: round(v, 2) for s, v in at.items()},
        "peak_throughput": {s: round(max(p["throughput"] for p in pts), 2) for s, pts in data["sweeps"].items()},
        "moderate_load": round(moderate, 2),
        "ttft_ms": {s: {"p50": round(m["ttft_p50_ms"], 2), "p99": round(m["ttft_p99_ms"], 2)} for s, m in mod.items()},
        "inter_token_ms": {"orca": {"p50": round(mod["orca"]["inter_token_p50_ms"], 3),
                                    "p99": round(mod["orca"]["inter_token_p99_ms"], 3)},
                           "request": None},
    }
    return data


def plot(data: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from paella.experiments.cli import save_figure
    fig, ax = plt.subplots(figsize=(5.5, 3.8))
    for s, pts in data["sweeps"].items():
        ax.plot([p["throughput"] for p in pts], [p["median_norm_latency_ms"] for p in pts], "o-", label=s)
    ax.axhline(data["summary"]["latency_level_ms"], color="grey", ls=":", label="equal-latency level")
    ax.set_xlabel("throughput (req/s)")
    ax.set_ylabel("median normalized latency (ms/token)")
    ax.set_yscale("log")
    ax.set_title("GPT-2 small shapes, U(32,512) in, U(1,128) out")
    ax.legend()
    save_figure(fig, path)


def register(sub: argparse._SubParsersAction) -> None:
    from paella.experiments.cli import add_common
    p = sub.add_parser("orca", help="Orca: iteration-level scheduling vs request-level batching (GPT)")
    add_common(p)
    p.add_argument("--gpu", default="v100", help="simulated GPU preset (default v100)")
    p.add_argument("--max-bs", type=int, default=32, help="max batch size of both systems (default 32)")
    p.add_argument("--slots", type=int, default=32768, help="Orca's KV slots (default 32768)")
    p.add_argument("--requests", type=int, default=0, help="requests per load point (default 400, "
                   "150 with --quick; on the compiled kernels 200, 60 with --quick)")
    p.add_argument("--kernels", choices=("compiled", "shapes"), default="compiled",
                   help="the iteration's kernels: compiled by TVM from models/gpt.py (default; each "
                        "bucket built once, cached) or derived from the shapes")
    p.add_argument("--bundles", default="", help="where the compiled iterations go (default "
                   "bundles/orca-iteration)")
    p.add_argument("--workers", type=int, default=0, help="processes running the load points "
                   "(default 0: the CPUs available, at most 4; 1: one after the other, here); "
                   "the figures are the same for any number")
    p.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    from paella.experiments.harness import run_experiment
    return run_experiment(run, plot, args)


def report_section(d: dict, figures: str = "docs/figures") -> list[str]:
    """The Orca section of docs/EXPERIMENTS.md, every figure read from ``d`` (and, beside
    it, from ``orca-shapes.json``: the same experiment on the kernels derived from the
    shapes, ``--kernels shapes``)."""
    import json
    from pathlib import Path
    s, st, p = d["summary"], d["setting"], d["paper"]
    r = s["throughput_ratio_at_equal_latency"]
    ratio = f"**{r:.1f}x**" if r is not None else "n/a (request-level batching never reaches the level)"
    t, it = s["ttft_ms"], s["inter_token_ms"]["orca"]
    compiled = st.get("kernels", "").startswith("compiled")
    rows = [
        f"{st['model']} on a simulated {st['gpu']}; kernels: {st.get('kernels', 'from the shapes')}; "
        f"prompts {st['prompts']}, outputs {st['outputs']}; max batch {st['max_bs']} for both systems; "
        f"{st['n_slots']} KV slots; {st['requests_per_point']} requests per point.", "",
        "| | this project | paper (Orca) |", "|---|---:|---:|",
        f"| throughput at equal median normalized latency, Orca over request-level "
        f"(`summary.throughput_ratio_at_equal_latency`) | {ratio} at {s['latency_level_ms']:.2f} ms/token "
        f"({s['throughput_at_level']['orca']:.1f} vs {s['throughput_at_level']['request']:.1f} req/s) | "
        f"{p['throughput_ratio_at_equal_latency']}x at {p['latency_level_ms']} ms/token ({p['model']}) |"]
    other = Path(figures) / "orca-shapes.json"
    if compiled and other.is_file():
        o = json.loads(other.read_text())
        os_, ost = o["summary"], o["setting"]
        rows.append(f"| the same on the kernels derived from the shapes (`--kernels shapes`, "
                    f"{ost['requests_per_point']} requests per point; `orca-shapes.json`) | "
                    f"{os_['throughput_ratio_at_equal_latency']:.1f}x at {os_['latency_level_ms']:.2f} "
                    f"ms/token ({os_['throughput_at_level']['orca']:.1f} vs "
                    f"{os_['throughput_at_level']['request']:.1f} req/s) | - |")
    rows += [
        f"| peak throughput, Orca / request-level | {s['peak_throughput']['orca']:.1f} / "
        f"{s['peak_throughput']['request']:.1f} req/s | - |",
        f"| time to first token p50 / p99 at {s['moderate_load']:.1f} req/s, Orca | "
        f"{t['orca']['p50']:.1f} / {t['orca']['p99']:.1f} ms | - |",
        f"| time to first token p50 / p99, request-level (= its latency: nothing streams) | "
        f"{t['request']['p50']:.1f} / {t['request']['p99']:.1f} ms | - |",
        f"| inter-token latency p50 / p99, Orca | {it['p50']:.2f} / {it['p99']:.2f} ms | - |", ""]
    why = []
    if compiled:
        why += [
            "- The kernels are TVM's, compiled from `models/gpt.py:gpt_iteration` (one variant per "
            "(tokens, slots) bucket, as served), for both systems. That iteration's attention is "
            "dense over the batch's gathered KV slots (every new token scores every slot of every "
            "request in the batch, the others' masked out) and it writes the new keys and values "
            "with a one-hot matmul: both cost tokens x slots per layer, so a decode iteration grows "
            "with the square of its batch. On the simulated V100 a decode of 1, 8 and 32 requests at "
            "a context of 500 takes 7.9, 20.7 and 69.6 ms compiled, against 3.0, 3.1 and 3.7 ms on the "
            "kernels from the shapes (a ragged attention over each request's own context, as Orca's). "
            "Batching decodes is what iteration-level scheduling wins by, and here it pays little: "
            "both systems saturate early and the ratio falls.",
            "- TVM's kernels are untuned (DLight's default schedules), against FasterTransformer's "
            "and cuBLAS' in the chapter.",
            "- Each compiled iteration is simulated launch by launch, about four times as many "
            "launches as the kernels from the shapes make, so `--quick` runs fewer requests per "
            "point on them (60 against 150) and the full run 200; the first run also builds each "
            "(tokens, slots) variant it meets (46 in `--quick`, 4-5 s each on this machine, then "
            "cached). Each step is a launch plan that the dispatcher's kernel core replays, and "
            "the load points run in worker processes (`--workers`, by default the CPUs available, "
            "at most 4): the same figures, bit for bit, as launching each step kernel by kernel "
            "one point after the other, which took 7 minutes here from a warm cache.",
        ]
    why += [
        "- The chapter's 36.9x comes from a 175B model on two pipeline stages, where "
        "FasterTransformer's batches idled a whole stage and its baseline peaked at 0.185 req/s; "
        "here one GPU runs a 124M-parameter model, where request-level batching loses only to "
        "padding (prompts to the longest, outputs to the longest) and to requests waiting for the "
        "running batch to end.",
        "- The latency level is twice Orca's median normalized latency at the lowest load swept; the "
        "chapter took twice Orca's normalized execution time in its microbenchmark, the same idea "
        "measured on the same curve.",
        "- The chapter reports no TTFT or inter-token figures; the rows are ours alone.",
    ]
    return rows + why
