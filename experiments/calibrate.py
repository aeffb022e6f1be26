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

Two checks say how far that fit can be trusted and how far any fit could go:

* leave-one-out: each model's ratio when the two parameters are fitted on the other
  seven (``loo_ratio``); and the same two parameters fitted to the goal's own metric,
  the worst relative error, instead of squared logs (``summary.worst_error_fit``);
* a bound on every cost model that sums, over a model's kernels, non-negative
  multiples of per-kernel quantities the bundles really have (:data:`FEATURES`:
  launches, FLOPs, bytes, the busiest SM's FLOPs with and without an occupancy
  penalty, waves, per-thread serial work, blocks). If model A has at most ``rho``
  times model B's amount of every such quantity, any such cost model gives
  ``sim(A) <= copies + rho * sim(B)``, so when the paper says A is much slower than B
  no choice of weights brings both within the goal; ``summary.feature_bound`` is the
  largest such lower bound on the worst error, and the pair that sets it.
"""
from __future__ import annotations

import argparse
import math
import time

import numpy as np

from paella.dispatcher.devices.sim import CostModel, SimDevice
from paella.experiments.cli import finish, save_figure
from paella.experiments.zoo import DEFAULT_ZOO_DIR, TABLE2_MS, ensure_bundles, module_image
from paella.gpus import GpuSpec, preset
from paella.occupancy import footprint, limits_per_resource

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


def fit(parts: dict[str, tuple[float, float, float]], objective: str = "log-squares") -> tuple[float, float]:
    """Efficiency and launch overhead minimising, over the models in ``parts``, either the
    sum of squared log ratios to Table 2 (``log-squares``) or the worst relative error
    (``worst``). One stream makes a model's time linear in the two parameters, so the
    search needs no simulation."""
    names = list(parts)
    c = np.array([parts[n][0] for n in names])[:, None, None]
    k = np.array([parts[n][1] for n in names])[:, None, None]
    r = np.array([parts[n][2] for n in names])[:, None, None]
    paper = np.array([TABLE2_MS[n] * 1e-3 for n in names])[:, None, None]
    eff = np.geomspace(0.01, 1.0, 400)[None, :, None]
    over = np.linspace(0.0, 100e-6, 401)[None, None, :]
    ratio = (c + k * over + r / eff) / paper
    if objective == "log-squares":
        err = (np.log(ratio) ** 2).sum(axis=0)
    elif objective == "worst":
        err = np.abs(ratio - 1).max(axis=0)
    else:
        raise ValueError(f"unknown fit objective {objective!r}; use 'log-squares' or 'worst'")
    i, j = np.unravel_index(np.argmin(err), err.shape)
    return float(eff[0, i, 0]), float(over[0, 0, j])


def predict(part: tuple[float, float, float], eff: float, over: float) -> float:
    """A model's seconds from its (copies, kernels, roofline) at the given parameters."""
    copies, kernels, roof = part
    return copies + kernels * over + roof / eff


def leave_one_out(parts: dict[str, tuple[float, float, float]],
                  objective: str = "log-squares") -> dict[str, float]:
    """Each model's simulated/paper ratio when the parameters are fitted without it."""
    out = {}
    for n in parts:
        eff, over = fit({m: p for m, p in parts.items() if m != n}, objective)
        out[n] = predict(parts[n], eff, over) / (TABLE2_MS[n] * 1e-3)
    return out


def _launch_features(spec: GpuSpec, blocks: int, threads: int, regs: int, smem: int,
                     flops: float, nbytes: float) -> dict[str, float]:
    fp = footprint(spec, threads, regs, smem)
    per_sm = min(limits_per_resource(spec, fp).values())
    on_busiest = math.ceil(blocks / spec.sm_count)          # blocks the busiest SM runs
    resident = min(on_busiest, per_sm)
    waves = math.ceil(on_busiest / per_sm)
    sm_time = on_busiest * flops / blocks / (spec.peak_flops / spec.sm_count)
    occupancy = resident * fp.warps / spec.max_warps_per_sm
    return {"launches": 1.0,
            "flops": flops / spec.peak_flops,                 # whole-GPU compute throughput
            "bytes": nbytes / spec.mem_bw,                    # DRAM bandwidth
            "busiest_sm": sm_time,                            # grid smaller than the GPU, tails
            "busiest_sm_occupancy": sm_time / min(1.0, occupancy),  # too few warps to hide latency
            "waves": float(waves),                            # per-wave fixed latency
            "serial": waves * flops / (blocks * threads),     # one thread's serial work
            "blocks": float(blocks)}                          # per-block fixed cost


#: The per-kernel quantities the feature bound considers; every physically motivated
#: cost model we tried is a non-negative combination of them.
FEATURES = tuple(_launch_features(preset(GPU), 1, 32, 16, 0, 1.0, 1.0))


def features(bundle, gpu: str = GPU) -> dict[str, float]:
    """Sums over a model's launches of the per-kernel quantities in :data:`FEATURES`,
    from the bundle's grids, blocks, registers, shared memory, FLOPs and bytes."""
    spec = preset(gpu)
    v = bundle.variants[0]
    total = dict.fromkeys(FEATURES, 0.0)
    for op in v.launches():
        k = v.kernel(op.kernel)
        f = _launch_features(spec, math.prod(op.grid), math.prod(op.block), k.registers,
                             k.static_smem + op.dyn_smem, float(k.flops), float(k.bytes))
        for name, x in f.items():
            total[name] += x
    return total


def feature_bound(feats: dict[str, dict[str, float]], paper: dict[str, float],
                  copies: dict[str, float]) -> dict:
    """The largest lower bound, over ordered pairs of models, on the worst relative error
    of any cost model that sums non-negative multiples of the features over kernels.

    For A and B with ``rho = max_f feats[A][f] / feats[B][f]``, such a model has
    ``sim(A) - copies(A) <= rho * (sim(B) - copies(B))``; being within ``e`` of the
    paper on both needs ``(1 - e) P_A - C_A <= rho ((1 + e) P_B - C_B)``, that is
    ``e >= (P_A - C_A - rho (P_B - C_B)) / (P_A + rho P_B)``. Times in seconds.
    """
    best = {"bound": 0.0}
    for a in feats:
        for b in feats:
            if a == b:
                continue
            ratios = {f: (feats[a][f] / feats[b][f] if feats[b][f] > 0 else
                          (math.inf if feats[a][f] > 0 else 0.0)) for f in feats[a]}
            feature = max(ratios, key=ratios.get)
            rho = ratios[feature]
            if not math.isfinite(rho):
                continue
            e = (paper[a] - copies[a] - rho * (paper[b] - copies[b])) / (paper[a] + rho * paper[b])
            if e > best["bound"]:
                best = {"bound": e, "slower": a, "faster": b, "paper_ratio": paper[a] / paper[b],
                        "max_feature_ratio": rho, "feature": feature}
    return best


def run(names: list[str], zoo_dir, progress: bool = True) -> dict:
    bundles = ensure_bundles(names, zoo_dir, progress=progress)
    parts = {n: decompose(b) for n, b in bundles.items()}
    eff, over = fit(parts)
    cost = CostModel(efficiency=eff, launch_overhead=over)
    loo = leave_one_out(parts)
    feats = {n: features(b) for n, b in bundles.items()}
    models = {}
    for n, b in bundles.items():
        sim_ms = simulate(b, cost) * 1e3
        copies, kernels, roof = parts[n]
        models[n] = {"simulated_ms": sim_ms, "paper_ms": TABLE2_MS[n], "ratio": sim_ms / TABLE2_MS[n],
                     "loo_ratio": loo[n],
                     "kernels": kernels, "launches": kernels, "roofline_ms": roof * 1e3,
                     "copies_ms": copies * 1e3,
                     "gflops": sum(b.variants[0].kernel(op.kernel).flops
                                   for op in b.variants[0].launches()) / 1e9,
                     "features": feats[n]}
    paper_order = sorted(models, key=lambda n: models[n]["paper_ms"])
    sim_order = sorted(models, key=lambda n: models[n]["simulated_ms"])
    worst = max(abs(m["ratio"] - 1) for m in models.values())
    w_eff, w_over = fit(parts, "worst")
    w_ratios = {n: predict(parts[n], w_eff, w_over) / (TABLE2_MS[n] * 1e-3) for n in parts}
    w_loo = leave_one_out(parts, "worst")
    bound = feature_bound(feats, {n: TABLE2_MS[n] * 1e-3 for n in feats},
                          {n: parts[n][0] for n in feats})
    return {"setting": {"gpu": GPU, "fit": "grid search, least squares of log(simulated/paper)"},
            "cost_model": {"efficiency": eff, "launch_overhead_us": over * 1e6},
            "models": models,
            "summary": {"worst_relative_error": worst, "within_goal": worst <= GOAL,
                        "goal": GOAL, "same_ordering": paper_order == sim_order,
                        "paper_order": paper_order, "simulated_order": sim_order,
                        "loo_worst_relative_error": max(abs(r - 1) for r in loo.values()),
                        "worst_error_fit": {
                            "efficiency": w_eff, "launch_overhead_us": w_over * 1e6,
                            "ratios": w_ratios,
                            "worst_relative_error": max(abs(r - 1) for r in w_ratios.values()),
                            "loo_worst_relative_error": max(abs(r - 1) for r in w_loo.values())},
                        "feature_bound": bound}}


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
    print("leave-one-out ratios: " + ", ".join(f"{n} {m['loo_ratio']:.2f}" for n, m in data["models"].items())
          + f"; worst {s['loo_worst_relative_error']:.0%}")
    w = s["worst_error_fit"]
    print(f"fitted to the worst error instead: efficiency {w['efficiency']:.4f}, overhead "
          f"{w['launch_overhead_us']:.2f} us, worst {w['worst_relative_error']:.0%} "
          f"(leave-one-out {w['loo_worst_relative_error']:.0%})")
    b = s["feature_bound"]
    if b["bound"] > 0:
        print(f"no sum of non-negative per-kernel features ({', '.join(FEATURES)}) can do better than "
              f"{b['bound']:.0%}: the paper has {b['slower']} {b['paper_ratio']:.2f}x {b['faster']}, "
              f"but {b['slower']} has at most {b['max_feature_ratio']:.2f}x of any of them ({b['feature']})")
    return finish(data, args, plot, t0)
