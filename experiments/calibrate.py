"""``paella experiment calibrate``: fit the simulator's cost model to the paper's Table 2.

Each Table 2 model, compiled by ``paella compile`` with its real kernels, grids, blocks
and registers, runs alone on the ``t4`` preset: its launch plan (input copy, every
kernel, output copy) on one stream, as TVM's runtime runs it. The simulated time is
compared with the paper's TVM time on a T4.

The cost model has two parameters shared by every kernel of every model (efficiency
and launch overhead; see ``dispatcher/devices/sim/cost.py``). On one stream a model's
time is linear in them,

    T(model) = copies + n_kernels * launch_overhead + sum(roofline) / efficiency,

so three simulations per model (at reference parameters) give ``copies``,
``n_kernels`` and ``sum(roofline)`` exactly, and the fit is a grid search minimising the
sum of squared log ratios over the eight models. Nothing is tuned per model. The fitted
values are then checked by simulating every model once more.
"""
from __future__ import annotations

import argparse
import time

import numpy as np

from paella.dispatcher.devices.sim import CostModel, SimDevice
from paella.experiments.cli import finish, save_figure
from paella.experiments.zoo import DEFAULT_ZOO_DIR, TABLE2_MS, ensure_bundles, module_image

GPU = "t4"
GOAL = 0.25            # every model within 25% of the paper's time


def simulate(bundle, cost: CostModel, gpu: str = GPU) -> float:
    """Seconds for one request of ``bundle`` alone: its plan on one stream."""
    dev = SimDevice(gpu, cost=cost)
    funcs = dev.load_module(module_image(bundle))
    plan = bundle.variants[0].plan
    largest = max((op.nbytes or 0) for op in plan) or 1
    scratch = dev.alloc(largest)
    host = np.zeros(largest, dtype=np.uint8)
    for lid, op in enumerate(plan):
        if op.op == "launch":
            dev.launch(funcs[op.kernel], tuple(op.grid), tuple(op.block), 0, lid,
                       dyn_smem=op.dyn_smem, instrumented=False)
        elif op.op == "h2d":
            dev.memcpy_htod(scratch, host[:op.nbytes], 0)
        else:
            dev.memcpy_dtoh(host[:op.nbytes], scratch, 0)
    dev.run()
    return dev.now()


def decompose(bundle) -> tuple[float, float, float]:
    """(copy seconds, kernels, roofline seconds) of a model, read off the simulator."""
    base = simulate(bundle, CostModel(efficiency=1.0, launch_overhead=0.0))           # C + R
    with_overhead = simulate(bundle, CostModel(efficiency=1.0, launch_overhead=1e-3))  # + n ms
    half = simulate(bundle, CostModel(efficiency=0.5, launch_overhead=0.0))           # C + 2R
    roof = half - base
    return base - roof, round((with_overhead - base) / 1e-3), roof


def fit(parts: dict[str, tuple[float, float, float]]) -> tuple[float, float]:
    """Efficiency and launch overhead minimising the squared log ratios to Table 2."""
    names = list(parts)
    c = np.array([parts[n][0] for n in names])[:, None, None]
    k = np.array([parts[n][1] for n in names])[:, None, None]
    r = np.array([parts[n][2] for n in names])[:, None, None]
    paper = np.array([TABLE2_MS[n] * 1e-3 for n in names])[:, None, None]
    eff = np.geomspace(0.01, 1.0, 400)[None, :, None]
    over = np.linspace(0.0, 100e-6, 401)[None, None, :]
    err = (np.log((c + k * over + r / eff) / paper) ** 2).sum(axis=0)
    i, j = np.unravel_index(np.argmin(err), err.shape)
    return float(eff[0, i, 0]), float(over[0, 0, j])


def run(names: list[str], zoo_dir, progress: bool = True) -> dict:
    bundles = ensure_bundles(names, zoo_dir, progress=progress)
    parts = {n: decompose(b) for n, b in bundles.items()}
    eff, over = fit(parts)
    cost = CostModel(efficiency=eff, launch_overhead=over)
    models = {}
    for n, b in bundles.items():
        sim_ms = simulate(b, cost) * 1e3
        copies, kernels, roof = parts[n]
        models[n] = {"simulated_ms": sim_ms, "paper_ms": TABLE2_MS[n], "ratio": sim_ms / TABLE2_MS[n],
                     "kernels": kernels, "launches": kernels, "roofline_ms": roof * 1e3,
                     "copies_ms": copies * 1e3,
                     "gflops": sum(b.variants[0].kernel(op.kernel).flops
                                   for op in b.variants[0].launches()) / 1e9}
    paper_order = sorted(models, key=lambda n: models[n]["paper_ms"])
    sim_order = sorted(models, key=lambda n: models[n]["simulated_ms"])
    worst = max(abs(m["ratio"] - 1) for m in models.values())
    return {"setting": {"gpu": GPU, "fit": "grid search, least squares of log(simulated/paper)"},
            "cost_model": {"efficiency": eff, "launch_overhead_us": over * 1e6},
            "models": models,
            "summary": {"worst_relative_error": worst, "within_goal": worst <= GOAL,
                        "goal": GOAL, "same_ordering": paper_order == sim_order,
                        "paper_order": paper_order, "simulated_order": sim_order}}


def plot(data: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    ms = data["models"]
    names = sorted(ms, key=lambda n: ms[n]["paper_ms"])
    x = np.arange(len(names))
    fig, ax = plt.subplots(figsize=(7, 3), dpi=90)
    ax.bar(x - 0.2, [ms[n]["paper_ms"] for n in names], 0.4, label="paper (TVM on T4)")
    ax.bar(x + 0.2, [ms[n]["simulated_ms"] for n in names], 0.4, label="simulated t4")
    ax.set_xticks(x, names, rotation=30, fontsize=7)
    ax.set_yscale("log")
    ax.set_ylabel("ms per request")
    c = data["cost_model"]
    ax.set_title(f"calibration: efficiency {c['efficiency']:.3f}, launch overhead "
                 f"{c['launch_overhead_us']:.1f} us", fontsize=9)
    ax.legend(fontsize=8)
    save_figure(fig, path)


def register(sub: argparse._SubParsersAction) -> None:
    from paella.experiments.cli import add_common
    p = sub.add_parser("calibrate", help="fit the simulator's cost model to the paper's Table 2")
    add_common(p)
    p.add_argument("--zoo-dir", default=str(DEFAULT_ZOO_DIR),
                   help=f"where the compiled zoo lives (default {DEFAULT_ZOO_DIR})")
    p.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    from pathlib import Path
    t0 = time.perf_counter()
    data = run(list(TABLE2_MS), Path(args.zoo_dir))
    c = data["cost_model"]
    print(f"fitted cost model: efficiency {c['efficiency']:.4f}, launch overhead {c['launch_overhead_us']:.2f} us")
    print(f"{'model':<15}{'kernels':>8}{'GFLOP':>8}{'simulated ms':>14}{'paper ms':>10}{'ratio':>8}")
    for n, m in data["models"].items():
        print(f"{n:<15}{m['kernels']:>8}{m['gflops']:>8.2f}{m['simulated_ms']:>14.2f}{m['paper_ms']:>10.2f}"
              f"{m['ratio']:>8.2f}")
    s = data["summary"]
    print(f"worst relative error {s['worst_relative_error']:.0%} (goal {s['goal']:.0%}: "
          f"{'met' if s['within_goal'] else 'NOT met'}); same ordering as the paper: {s['same_ordering']}")
    return finish(data, args, plot, t0)
