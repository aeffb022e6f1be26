"""``paella experiment cellular``: BatchMaker's cellular batching against graph batching
with padding (the paper's Figures 8 and 11, LSTM), on the step runtime.

Setting. An LSTM of hidden size 1024 (Figure 3's), compiled by TVM for every batch size
1, 2, 4, ... 512; one cell per step on the simulated GPU,
each batched step a job of the kernel scheduler (``--gpu``, default the paper's V100). Requests are LSTM chains whose lengths
follow the WMT-15 figures the paper gives (mean about 24, maximum 330): a lognormal with
that mean, clipped at 330 (the dataset itself is not available offline). Poisson
arrivals, swept.

* ``cellular``: Algorithm 1 (one cell type, ``MaxTasksToSubmit`` 5, max batch 512);
* ``graph``: graph batching with padding buckets of width 10, max batch 512 (the paper's
  MXNet/TensorFlow configuration); a batch leaves when its padded graph ends.

The host cost of the step scheduler (forming each task) is measured on this
implementation (``time.thread_time``) and charged to the simulated clock, times
``--cpu-scale`` (default 1): it is what makes padding win on fixed-length inputs, as
BatchMaker's own scheduling and gathering overhead does in §7.3.

Summary keys: ``summary.peak_throughput_ratio`` (cellular's peak throughput over graph
batching's, WMT-like lengths), ``summary.p90_ms`` (both systems' p90 latency at a
moderate load: half of graph batching's peak, the paper's definition), and
``summary.fixed_length`` (the same ratio with every request of length 24: the control
where padding wins).
"""
from __future__ import annotations

import argparse

import numpy as np

from paella.experiments.workload import latency_summary

#: BatchMaker's figures (EuroSys'18, §7.3, V100 GPU): LSTM peak throughput +25% over
#: MXNet/TensorFlow; p90 latency 37.5%-90.5% lower at moderate load; on fixed-length
#: inputs the baselines reach ~27,136 req/s and BatchMaker ~87% of that.
PAPER = {"peak_throughput_ratio": 1.25, "p90_reduction_at_moderate_load": [0.375, 0.905],
         "fixed_length_throughput_ratio": 0.87}
BSIZES = tuple(2 ** i for i in range(10))          # 1 .. 512
MAX_TASKS = 5
WIDTH = 10
MEAN_LEN, MAX_LEN = 24, 330
FULL_RATES = [2e3, 4e3, 6e3, 8e3, 10e3, 12e3, 15e3, 20e3, 25e3, 30e3, 40e3]
QUICK_RATES = [3e3, 8e3, 15e3, 25e3, 40e3]


def wmt_like_lengths(n: int, seed: int, sigma: float = 0.7) -> np.ndarray:
    """Lognormal lengths with mean ``MEAN_LEN``, clipped to [1, ``MAX_LEN``]."""
    rng = np.random.default_rng(seed)
    mu = np.log(MEAN_LEN) - sigma ** 2 / 2
    return np.clip(np.rint(rng.lognormal(mu, sigma, n)), 1, MAX_LEN).astype(int)


def poisson_arrivals(rate: float, n: int, seed: int) -> np.ndarray:
    return np.cumsum(np.random.default_rng(seed + 1).exponential(1.0 / rate, n))


def lstm_kernels(gpu_arch: str = "sm_75") -> dict:
    """The LSTM cell's kernels per batch size (compiled once, then cached)."""
    from paella.bundle import DEFAULT_ZOO_DIR
    from paella.models.rnn import lstm_cell
    from paella.stepsched.step_kernels import compile_steps
    return compile_steps(lstm_cell, BSIZES, DEFAULT_ZOO_DIR / "steps")


def run_point(system: str, rate: float, lengths: np.ndarray, kernels: dict, *, seed: int = 1,
              gpu: str = "v100", cpu_scale: float = 1.0, warmup: float = 0.1) -> dict:
    from paella.dispatcher.batchers.stage import scheduler_context
    from paella.dispatcher.core import Dispatcher
    from paella.dispatcher.devices.sim import SimDevice
    from paella.stepsched.cell_scheduler import CellType, CellularScheduler
    from paella.stepsched.graph import unfold_chain
    from paella.stepsched.padding import PaddingBatcher
    from paella.stepsched.runtime import StepRuntime

    dev = SimDevice(gpu, n_streams=64, seed=seed)
    ctx = scheduler_context(Dispatcher(dev, "paella", profile_runs=0), system)
    n = len(lengths)
    arrivals = poisson_arrivals(rate, n, seed)
    if system == "cellular":
        policy = CellularScheduler([CellType("lstm", BSIZES)], MAX_TASKS)
        rt = StepRuntime(ctx, policy, lambda t: kernels[t.batch_size], name="lstm", cpu_scale=cpu_scale)
        items = [(float(a), unfold_chain(i, int(L), arrival=float(a))) for i, (a, L) in enumerate(zip(arrivals, lengths))]
    elif system == "graph":
        policy = PaddingBatcher(max(BSIZES), WIDTH, BSIZES)
        rt = StepRuntime(ctx, policy, lambda t: kernels[t.batch_size].repeated(t.steps), name="graph",
                         cpu_scale=cpu_scale)
        items = [(float(a), (i, int(L))) for i, (a, L) in enumerate(zip(arrivals, lengths))]
    else:
        raise ValueError(f"unknown system {system!r}; use cellular or graph")
    rt.drive(items)
    warm = int(n * warmup)
    done = np.array([rt.finished[i] for i in range(n)])
    lat = done[warm:] - arrivals[warm:]
    span = done[warm:].max() - arrivals[warm]
    return {"system": system, "offered": rate, "throughput": float((n - warm) / span),
            **latency_summary(lat), "p90_ms": float(np.percentile(lat, 90) * 1e3), **rt.stats.to_dict()}


def sweep(system: str, rates: list[float], lengths: np.ndarray, kernels: dict, **kw) -> list[dict]:
    pts = []
    for r in rates:
        p = run_point(system, r, lengths, kernels, **kw)
        print(f"  {system:8s} {r:8.0f} req/s offered: {p['throughput']:8.0f} served, "
              f"p90 {p['p90_ms']:7.2f} ms, mean batch {p['mean_batch']:.1f}", flush=True)
        pts.append(p)
    return pts


def run(args: argparse.Namespace) -> dict:
    rates = QUICK_RATES if args.quick else FULL_RATES
    n = args.requests or (800 if args.quick else 2000)
    kernels = lstm_kernels()
    kw = dict(seed=args.seed, gpu=args.gpu, cpu_scale=args.cpu_scale)
    data: dict = {"setting": {"gpu": args.gpu, "hidden": 1024, "bsizes": list(BSIZES),
                              "max_tasks_to_submit": MAX_TASKS, "bucket_width": WIDTH,
                              "requests_per_point": n, "rates": rates, "cpu_scale": args.cpu_scale,
                              "lengths": f"lognormal mean {MEAN_LEN}, clipped to {MAX_LEN}"},
                  "paper": PAPER, "datasets": {}}
    sets = {"wmt": wmt_like_lengths(n, args.seed), "fixed24": np.full(n, MEAN_LEN)}
    for name, lengths in sets.items():
        print(f"{name}: mean length {lengths.mean():.1f}, max {lengths.max()}", flush=True)
        data["datasets"][name] = {s: sweep(s, rates, lengths, kernels, **kw) for s in ("cellular", "graph")}
    peak = {k: {s: max(p["throughput"] for p in pts) for s, pts in v.items()} for k, v in data["datasets"].items()}
    moderate = 0.5 * peak["wmt"]["graph"]
    print(f"moderate load (half of graph batching's peak): {moderate:.0f} req/s", flush=True)
    mod = {s: run_point(s, moderate, sets["wmt"], kernels, **kw) for s in ("cellular", "graph")}
    data["moderate"] = mod
    data["summary"] = {
        "peak_throughput_ratio": round(peak["wmt"]["cellular"] / peak["wmt"]["graph"], 3),
        "peak_throughput": {s: round(v, 1) for s, v in peak["wmt"].items()},
        "p90_ms": {"load": round(moderate, 1), "cellular": round(mod["cellular"]["p90_ms"], 3),
                   "graph": round(mod["graph"]["p90_ms"], 3),
                   "reduction": round(1 - mod["cellular"]["p90_ms"] / mod["graph"]["p90_ms"], 3)},
        "fixed_length": {"peak_throughput_ratio": round(peak["fixed24"]["cellular"] / peak["fixed24"]["graph"], 3),
                         "peak_throughput": {s: round(v, 1) for s, v in peak["fixed24"].items()}},
        "host_us_per_task": round(mod["cellular"]["host_us_per_task"], 1),
    }
    return data


def plot(data: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from paella.experiments.cli import save_figure
    sets = data["datasets"]
    fig, axes = plt.subplots(1, len(sets), figsize=(5 * len(sets), 3.6))
    for ax, (name, systems) in zip(np.atleast_1d(axes), sets.items()):
        for s, pts in systems.items():
            ax.plot([p["throughput"] for p in pts], [p["p90_ms"] for p in pts], "o-", label=s)
        ax.set_xlabel("throughput (req/s)")
        ax.set_ylabel("p90 latency (ms)")
        ax.set_yscale("log")
        ax.set_title(f"LSTM h1024, {name} lengths")
        ax.legend()
    save_figure(fig, path)


def register(sub: argparse._SubParsersAction) -> None:
    from paella.experiments.cli import add_common
    p = sub.add_parser("cellular", help="BatchMaker: cellular batching vs graph batching with padding (LSTM)")
    add_common(p)
    p.add_argument("--gpu", default="v100", help="simulated GPU preset (default v100, the paper's)")
    p.add_argument("--requests", type=int, default=0, help="requests per load point (default 2000; 800 with --quick)")
    p.add_argument("--cpu-scale", type=float, default=1.0,
                   help="charge the step scheduler's measured CPU time per task, times this (default 1)")
    p.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    from paella.experiments.harness import run_experiment
    return run_experiment(run, plot, args)


def report_section(d: dict) -> list[str]:
    """The cellular-batching section of docs/EXPERIMENTS.md, every figure read from ``d``."""
    s, st, p = d["summary"], d["setting"], d["paper"]
    lo, hi = p["p90_reduction_at_moderate_load"]
    red = s["p90_ms"]["reduction"]
    fixed = s["fixed_length"]["peak_throughput_ratio"]
    return [
        f"LSTM hidden {st['hidden']} compiled by TVM for batch sizes {st['bsizes'][0]}-{st['bsizes'][-1]}, "
        f"on a simulated {st['gpu']}; {st['requests_per_point']} requests per point, lengths {st['lengths']}; "
        f"MaxTasksToSubmit {st['max_tasks_to_submit']}; graph batching with buckets of width {st['bucket_width']}; "
        f"the step scheduler's own CPU time charged (x{st['cpu_scale']}): "
        f"{s['host_us_per_task']} us per task at the moderate load.", "",
        "| | this project | paper (BatchMaker, V100) |", "|---|---:|---:|",
        f"| peak throughput, cellular over graph batching (`summary.peak_throughput_ratio`) | "
        f"**{s['peak_throughput_ratio']:.2f}x** ({s['peak_throughput']['cellular']:.0f} vs "
        f"{s['peak_throughput']['graph']:.0f} req/s) | {p['peak_throughput_ratio']:.2f}x |",
        f"| p90 at moderate load ({s['p90_ms']['load']:.0f} req/s), cellular / graph (`summary.p90_ms`) | "
        f"{s['p90_ms']['cellular']:.2f} / {s['p90_ms']['graph']:.2f} ms ({red:.0%} lower) | "
        f"{lo:.1%}-{hi:.1%} lower |",
        f"| fixed length 24: peak throughput, cellular over graph (`summary.fixed_length`) | "
        f"{fixed:.2f}x | {p['fixed_length_throughput_ratio']:.2f}x |", "",
        f"- Peak throughput: {s['peak_throughput_ratio']:.2f}x against the paper's 1.25x, "
        + ("the same direction" if s["peak_throughput_ratio"] > 1 else "the opposite direction")
        + "; graph batching spreads these lengths over many width-10 buckets, each batch small, and "
          "TVM's untuned LSTM kernels take about as long at batch 2-32 as at 64 (docs/step-scheduler.md), "
          "while cellular batching's own peak is lowered by the host time this Python scheduler spends "
          "per cell, charged to the GPU's clock.",
        f"- p90 at moderate load: {red:.0%} lower, "
        + ("inside" if lo <= red <= hi else "outside")
        + " the paper's 37.5%-90.5% range; as in the paper, the gain is queueing: a request joins the "
          "running cells at the next step instead of waiting for a bucket's padded graph to end.",
        f"- Fixed length: {fixed:.2f}x against the paper's 0.87x: "
        + ("padding wins here too, by more" if fixed < 0.95 else
           "a tie where padding wins in the paper" if fixed <= 1.05 else
           "cellular batching wins where padding does in the paper")
        + "; what decides it is the host's cost per cell (BatchMaker's C++: about 250 us per step of "
          "512; this Python scheduler: several microseconds per cell), and the measured CPU time "
          "charged here moves with the machine's load from run to run (docs/step-scheduler.md gives "
          "runs side by side); the gathers BatchMaker makes when a batch's members change are not "
          "modelled (a few hundred KiB per step at batch 512).",
    ]
