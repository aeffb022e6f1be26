"""``paella experiment windtunnel``: classical pipelines translated, fine-tuned, served
(the WindTunnel chapter, Tables 5.3-5.5).

For each dataset and pipeline (all local: :mod:`paella.windtunnel.data`):

1. the pipeline is fitted on the training split (60%); its test AUC is ``auc_original``;
2. it is translated at the paper's tau = 1 with the training rows as reference: the
   network fine-tuning starts from (``auc_translated``; the smoothing costs some AUC),
   and at tau = 0.001, where it takes the pipeline's decisions (``auc_translated_exact``);
3. the tau = 1 network is fine-tuned end to end, warm (``auc_finetuned``), with only the
   model's blocks trained (``auc_model_scope``: the paper's GBDT2NN of Table 5.4), and
   from a random initialisation of the same architecture (``auc_cold``, Table 5.5; and
   ``auc_cold_model``: only the model's blocks random, the featurizers translated);
   the tau = 0.001 network too (``auc_finetuned_exact``: does a steep start train?).
   Adam, weight decay 1e-6, dropout 0.1, early stopping on the validation split (20%),
   the best epoch restored;
4. AUC on the test split (20%). Synthetic data also give the *oracle* AUC of the true
   log-odds, the ceiling.

``summary`` holds the headline setting (synthetic data, the GBDT pipeline: the paper's
Pipe2): ``auc_original``, ``auc_translated``, ``auc_finetuned``, ``auc_cold``, and the
relative gains beside the paper's.

Serving: the headline network, fine-tuned, is exported to ONNX, compiled by ``paella
compile`` at batch 1 and at a larger batch, and timed on the simulated T4 in virtual
time: one request alone (latency: its launch plan on one stream, as
``experiment calibrate`` times the zoo), and a saturating stream of requests through
the dispatcher (throughput; the dispatcher's CPU not charged, ``--cpu-scale 0`` as in
the other experiments). Beside it, the pipeline's own ``predict_proba`` on this
machine's CPU, one row and one batch at a time (medians of repeated calls).
"""
from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from paella.experiments.cli import add_common, save_figure

#: The paper's AUCs (ML = original pipeline, W.T. = WindTunnel). Table 5.3: dataset ->
#: preprocessing -> (ML Pipe1, ML Pipe2, W.T. Pipe1, W.T. Pipe2).
PAPER_T53 = {
    "Flight": {"Pre1": (0.6783, 0.7358, 0.6913, 0.7790), "Pre2": (0.6847, 0.7427, 0.6910, 0.7897),
               "Pre3": (0.7126, 0.7507, 0.7244, 0.7960)},
    "Avazu": {"Pre1": (0.6896, 0.7521, 0.7588, 0.7753), "Pre2": (0.7264, 0.7550, 0.7589, 0.7742),
              "Pre3": (0.7553, 0.7718, 0.7637, 0.7763)},
    "Criteo": {"Pre1": (0.7167, 0.7739, 0.7750, 0.8006), "Pre2": (0.7442, 0.7781, 0.7804, 0.8053),
               "Pre3": (0.7769, 0.7925, 0.7903, 0.8041)},
}
#: Table 5.4 (Criteo, Pipe2): (ML, GBDT2NN, W.T.) per preprocessing.
PAPER_T54 = {"Pre2": (0.7781, 0.7962, 0.8053), "Pre3": (0.7925, 0.7998, 0.8041)}
#: Table 5.5 (Criteo): (cold, warm) per pipeline and preprocessing.
PAPER_T55 = {"Pipe2": {"Pre2": (0.7983, 0.8053), "Pre3": (0.7990, 0.8041)},
             "Pipe3": {"Pre2": (0.7966, 0.8058), "Pre3": (0.7975, 0.8048)}}

TAU = 1.0              # the paper's temperature, for fine-tuning
EXACT_TAU = 1e-3       # a temperature at which the network takes the pipeline's decisions
HEADLINE = ("synthetic", "gbdt")
FULL = {"rows": 20000, "trees": 100, "epochs": 40, "batch": 256,
        "settings": [("synthetic", "logistic"), ("synthetic", "gbdt"), ("synthetic", "lightgbm"),
                     ("synthetic", "xgboost"), ("breast_cancer", "logistic"), ("breast_cancer", "gbdt")]}
QUICK = {"rows": 6000, "trees": 50, "epochs": 15, "batch": 64,
         "settings": [("synthetic", "logistic"), ("synthetic", "gbdt")]}


def paper_gains() -> dict[str, Any]:
    """The paper's relative gains, computed from its tables."""
    t53 = {f"{d} {p}": {"pipe1": w1 / m1 - 1, "pipe2": w2 / m2 - 1}
           for d, rows in PAPER_T53.items() for p, (m1, m2, w1, w2) in rows.items()}
    return {
        "table_5_3": t53,
        "table_5_3_range": {k: [min(v[k] for v in t53.values()), max(v[k] for v in t53.values())]
                            for k in ("pipe1", "pipe2")},
        "table_5_4": {p: {"gbdt2nn_over_ml": g / m - 1, "wt_over_ml": w / m - 1} for p, (m, g, w) in PAPER_T54.items()},
        "table_5_5": {f"{pipe} {p}": w / c - 1 for pipe, rows in PAPER_T55.items() for p, (c, w) in rows.items()},
    }


# ======================================================================================
# Pipelines
# ======================================================================================
def make_pipeline(kind: str, data, trees: int, seed: int):
    """Pipe1 (``logistic``: scaled numerics, their quantile bins, one-hot categories, then a
    logistic regression) or Pipe2 (scaled numerics, one-hot categories, then a GBDT from
    scikit-learn, LightGBM or XGBoost)."""
    from sklearn.compose import ColumnTransformer
    from sklearn.ensemble import GradientBoostingClassifier
    from sklearn.linear_model import LogisticRegression
    from sklearn.pipeline import Pipeline
    from sklearn.preprocessing import KBinsDiscretizer, OneHotEncoder, StandardScaler
    parts = [("num", StandardScaler(), data.numeric)]
    if kind == "logistic":
        parts.append(("bins", KBinsDiscretizer(n_bins=8, encode="onehot", quantile_method="averaged_inverted_cdf"),
                      data.numeric))
    if data.categorical:
        parts.append(("cat", OneHotEncoder(handle_unknown="ignore"), data.categorical))
    if kind == "logistic":
        model = LogisticRegression(max_iter=2000)
    elif kind == "gbdt":
        model = GradientBoostingClassifier(n_estimators=trees, max_depth=3, random_state=seed)
    elif kind == "lightgbm":
        import lightgbm as lgb
        model = lgb.LGBMClassifier(n_estimators=trees, num_leaves=8, learning_rate=0.1, random_state=seed,
                                   n_jobs=1, verbose=-1)
    elif kind == "xgboost":
        import xgboost as xgb
        model = xgb.XGBClassifier(n_estimators=trees, max_depth=3, learning_rate=0.1, random_state=seed, n_jobs=1)
    else:
        raise ValueError(f"unknown pipeline {kind!r}")
    # dense: XGBoost would read the zeros of a sparse matrix as missing values
    return Pipeline([("features", ColumnTransformer(parts, sparse_threshold=0)), ("model", model)])


def _auc(y: np.ndarray, p: np.ndarray) -> float:
    from sklearn.metrics import roc_auc_score
    return float(roc_auc_score(y, p))


def run_setting(dataset: str, kind: str, cfg: dict, seed: int, progress=None) -> tuple[dict, Any]:
    """One (dataset, pipeline): the AUCs and fine-tuning records; also the fine-tuned net."""
    from paella.windtunnel import FitConfig, finetune, translate
    from paella.windtunnel.data import breast_cancer, synthetic
    data = synthetic(cfg["rows"], seed) if dataset == "synthetic" else breast_cancer()
    tr, va, te = data.split(seed)
    pipe = make_pipeline(kind, tr, cfg["trees"], seed)
    t0 = time.perf_counter()
    pipe.fit(tr.X, tr.y)
    fit_s = time.perf_counter() - t0
    out: dict[str, Any] = {"dataset": dataset, "pipeline": kind, "rows": {"train": len(tr.y), "val": len(va.y),
                                                                         "test": len(te.y)},
                           "fit_seconds": fit_s, "auc_original": _auc(te.y, pipe.predict_proba(te.X)[:, 1])}
    if te.logit is not None:
        out["auc_oracle"] = _auc(te.y, te.logit)
    exact = translate(pipe, tau=EXACT_TAU, reference=tr.X)
    out["auc_translated_exact"] = _auc(te.y, exact.output(te.X)[:, 1])
    out["decisions_equal_exact"] = float(np.mean(exact.predict(te.X) == pipe.predict(te.X)))
    fit = FitConfig(epochs=cfg["epochs"], seed=seed)
    runs = {}
    warm = lambda: translate(pipe, tau=TAU, reference=tr.X)  # noqa: E731
    for name, make, scope in (("finetuned", warm, "all"), ("model_scope", warm, "model"),
                              ("cold", lambda: warm().cold_start(seed), "all"),
                              ("cold_model", lambda: warm().cold_start(seed, scope="model"), "all"),
                              ("finetuned_exact", lambda: exact, "all")):
        net = make()
        if name == "finetuned":
            out["auc_translated"] = _auc(te.y, net.output(te.X)[:, 1])
        fit.scope = scope
        res = finetune(net, tr.X, tr.y, va.X, va.y, fit)
        out[f"auc_{name}"] = _auc(te.y, net.output(te.X)[:, 1])
        runs[name] = {"best_epoch": res.best_epoch, "epochs_run": len(res.train_loss) - 1,
                      "seconds": res.seconds, "val_loss_start": res.val_loss[0], "val_loss_best": min(res.val_loss)}
        if name == "finetuned":
            tuned = net
        if progress:
            progress(f"{dataset}/{kind} {name}: AUC {out[f'auc_{name}']:.4f} "
                     f"(best epoch {res.best_epoch}, {res.seconds:.0f} s)")
    out["runs"] = runs
    out["gain_finetuned"] = out["auc_finetuned"] / out["auc_original"] - 1
    out["gain_model_scope"] = out["auc_model_scope"] / out["auc_original"] - 1
    out["gain_warm_over_cold"] = out["auc_finetuned"] / out["auc_cold"] - 1
    out["gain_warm_over_cold_model"] = out["auc_finetuned"] / out["auc_cold_model"] - 1
    out["test"] = {"X": te.X, "pipeline": pipe}
    return out, tuned


# ======================================================================================
# Serving
# ======================================================================================
def _median_seconds(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def serving(net, pipe, X: np.ndarray, batch: int, seed: int, progress=None) -> dict:
    """Latency and throughput of the compiled network on the simulated T4 (virtual time)
    against the pipeline's ``predict_proba`` on this CPU."""
    from paella.bundle import load_bundle
    from paella.dispatcher.adaptor import PlanAdaptor
    from paella.dispatcher.devices.sim import CostModel
    from paella.experiments.calibrate import simulate
    from paella.experiments.harness import PointConfig, Workload, run_point
    from paella.windtunnel import compile_network
    out: dict[str, Any] = {"batch": batch, "gpu": "t4"}
    with tempfile.TemporaryDirectory(prefix="wtserve") as tmp:
        for b in (1, batch):
            t0 = time.perf_counter()
            bundle = load_bundle(compile_network(net, Path(tmp) / f"windtunnel_b{b}", batch=b))
            lat = simulate(bundle, CostModel(), "t4")
            # a stream at twice what one request at a time sustains saturates the GPU
            pt = run_point(PointConfig("paella", rate=2.0 / lat, sigma=1.5, n_requests=400, seed=seed,
                                       cpu_scale=0.0),
                           [Workload("windtunnel", lambda bundle=bundle: PlanAdaptor.from_bundle(bundle))])
            v = bundle.variants[0]
            ref = net.output(X[:b])
            cpu_build = bundle.run_cpu({"x": np.ascontiguousarray(X[:b])})["y"]   # the ONNX output name
            out[f"gpu_batch{b}"] = {
                "latency_ms": lat * 1e3, "rows_per_s": pt["throughput"] * b, "requests_per_s": pt["throughput"],
                "p50_ms_saturated": pt["p50_ms"], "kernels": len(v.kernels),
                "launches": sum(1 for o in v.plan if o.op == "launch"),
                "compile_seconds": time.perf_counter() - t0,
                "bundle_cpu_build_max_abs_error": float(np.abs(cpu_build - ref).max())}
            if progress:
                progress(f"serving batch {b}: {lat * 1e3:.3f} ms alone, {pt['throughput'] * b:,.0f} rows/s")
    rows1, rowsb = X[:1], X[:batch]
    one = _median_seconds(lambda: pipe.predict_proba(rows1), 200)
    many = _median_seconds(lambda: pipe.predict_proba(rowsb), 50)
    out["cpu_batch1"] = {"latency_ms": one * 1e3, "rows_per_s": 1 / one}
    out[f"cpu_batch{batch}"] = {"latency_ms": many * 1e3, "rows_per_s": batch / many}
    out["latency_ratio_cpu_over_gpu_batch1"] = out["cpu_batch1"]["latency_ms"] / out["gpu_batch1"]["latency_ms"]
    out["throughput_ratio_gpu_over_cpu"] = out[f"gpu_batch{batch}"]["rows_per_s"] / out[f"cpu_batch{batch}"]["rows_per_s"]
    return out


# ======================================================================================
# The experiment
# ======================================================================================
def run(cfg: dict, seed: int, progress=None) -> dict:
    import torch

    from paella.windtunnel import FitConfig
    torch.set_num_threads(1)
    results, headline = [], None
    for dataset, kind in cfg["settings"]:
        r, tuned = run_setting(dataset, kind, cfg, seed, progress)
        test = r.pop("test")
        results.append(r)
        if (dataset, kind) == HEADLINE:
            headline = (tuned, test)
    h = next(r for r in results if (r["dataset"], r["pipeline"]) == HEADLINE)
    serve = serving(headline[0], headline[1]["pipeline"], headline[1]["X"], cfg["batch"], seed, progress)
    summary = {k: h[k] for k in ("auc_original", "auc_translated", "auc_translated_exact", "auc_finetuned",
                                 "auc_model_scope", "auc_cold", "auc_cold_model", "auc_finetuned_exact", "auc_oracle",
                                 "gain_finetuned", "gain_model_scope", "gain_warm_over_cold",
                                 "gain_warm_over_cold_model")}
    summary.update({"headline": f"{HEADLINE[0]}/{HEADLINE[1]}",
                    "serving_latency_ms_gpu": serve["gpu_batch1"]["latency_ms"],
                    "serving_latency_ms_cpu": serve["cpu_batch1"]["latency_ms"],
                    "serving_rows_per_s_gpu": serve[f"gpu_batch{cfg['batch']}"]["rows_per_s"],
                    "serving_rows_per_s_cpu": serve[f"cpu_batch{cfg['batch']}"]["rows_per_s"]})
    fit = FitConfig(epochs=cfg["epochs"], seed=seed)
    return {"setting": {"tau": TAU, "exact_tau": EXACT_TAU, "rows_synthetic": cfg["rows"], "trees": cfg["trees"],
                        "max_epochs": fit.epochs, "optimizer": f"Adam lr {fit.lr:g}, weight decay "
                        f"{fit.weight_decay:g}, batch {fit.batch_size}", "dropout": fit.dropout,
                        "patience": fit.patience, "level": 4, "seed": seed, "torch_threads": 1,
                        "split": "60/20/20 train/validation/test", "serving_batch": cfg["batch"]},
            "results": results, "serving": serve, "paper": paper_gains(), "summary": summary}


def plot(data: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    res, st = data["results"], data["setting"]
    keys = [("auc_translated", f"translated, tau {st['tau']:g}"), ("auc_finetuned", "fine-tuned (warm)"),
            ("auc_model_scope", "model only (GBDT2NN)"), ("auc_cold", "cold start"),
            ("auc_cold_model", "cold model, warm featurizers"),
            ("auc_finetuned_exact", f"fine-tuned from tau {st['exact_tau']:g}")]
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(12, 4.4), gridspec_kw={"width_ratios": [2.4, 1]})
    lo_clip, hi_clip = -12.0, 9.0
    lo, hi = data["paper"]["table_5_3_range"]["pipe2"]
    ax.axhspan(100 * lo, 100 * hi, color="0.85", label="paper, fine-tuned Pipe2 (Table 5.3)")
    x = np.arange(len(res))
    w = 0.8 / len(keys)
    for i, (k, label) in enumerate(keys):
        gains = np.array([100 * (r[k] / r["auc_original"] - 1) for r in res])
        xs = x + (i - len(keys) / 2 + 0.5) * w
        ax.bar(xs, np.clip(gains, lo_clip, hi_clip), w, label=label, color=f"C{i + 1}")
        for xi, g in zip(xs, gains):
            if g < lo_clip:
                ax.annotate(f"{g:.0f}% (clipped)", (xi + w / 2, 0.6 * lo_clip), fontsize=6.5, ha="left")
    for j, r in enumerate(res):
        if "auc_oracle" in r:
            ax.hlines(100 * (r["auc_oracle"] / r["auc_original"] - 1), j - 0.4, j + 0.4, colors="k",
                      linestyles=":", label="oracle (true log-odds)" if j == 0 else None)
    ax.axhline(0, color="k", lw=0.8)
    ax.set_ylim(lo_clip, hi_clip)
    ax.set_xticks(x, [f"{r['dataset']}\n{r['pipeline']}\n(pipeline {r['auc_original']:.3f})" for r in res],
                  fontsize=7)
    ax.set_ylabel("test AUC change over the pipeline (%)")
    ax.set_title("WindTunnel: the networks against the pipeline they come from", fontsize=9)
    ax.legend(fontsize=6.5, loc="lower left", ncol=3)
    s = data["serving"]
    b = s["batch"]
    labels = ["latency, 1 row (ms)", f"rows/s, batch {b} (x1000)"]
    gpu = [s["gpu_batch1"]["latency_ms"], s[f"gpu_batch{b}"]["rows_per_s"] / 1e3]
    cpu = [s["cpu_batch1"]["latency_ms"], s[f"cpu_batch{b}"]["rows_per_s"] / 1e3]
    xx = np.arange(2)
    ax2.bar(xx - 0.2, gpu, 0.4, label="network, simulated T4")
    ax2.bar(xx + 0.2, cpu, 0.4, label="pipeline, this CPU")
    ax2.set_yscale("log")
    ax2.set_xticks(xx, labels, fontsize=8)
    ax2.set_title(f"serving {data['summary']['headline']}", fontsize=9)
    ax2.legend(fontsize=7)
    save_figure(fig, path, dpi=100)


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("windtunnel", help="WindTunnel (Tables 5.3-5.5): pipelines translated, fine-tuned, served")
    add_common(p)
    p.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    from paella.experiments.harness import write_outputs
    from paella.windtunnel.errors import EXTRA_HINT
    import importlib
    for module in ("torch", "sklearn", "lightgbm", "xgboost"):
        try:
            importlib.import_module(module)
        except ImportError:
            from paella.cli import CLIError
            raise CLIError(f"the windtunnel experiment needs {module}: {EXTRA_HINT}") from None
    t0 = time.perf_counter()
    data = run(QUICK if args.quick else FULL, args.seed, lambda m: print(m, file=sys.stderr, flush=True))
    data["setting"]["quick"] = bool(args.quick)
    write_outputs(data, args, plot, t0)
    return 0


# ======================================================================================
# docs/EXPERIMENTS.md section (``paella experiment report``)
# ======================================================================================
def _pct(x: float) -> str:
    return f"{100 * x:+.1f}%"


def _span(xs: list[float]) -> str:
    return _pct(xs[0]) if len(xs) == 1 else f"{_pct(min(xs))} to {_pct(max(xs))}"


def _versus(ours: list[float], theirs: list[float]) -> str:
    if min(ours) > max(theirs):
        return "above"
    if max(ours) < min(theirs):
        return "below"
    return "within or overlapping"


def report_section(d: dict) -> list[str]:
    """The WindTunnel section of docs/EXPERIMENTS.md, every figure read from ``d``."""
    from paella.windtunnel.data import CARDINALITIES
    st, s, res, paper, sv = d["setting"], d["summary"], d["results"], d["paper"], d["serving"]
    ex = f"{st['exact_tau']:g}"
    rows = [f"| dataset / pipeline | pipeline | translated, tau {ex} (decisions equal) | translated, tau "
            f"{st['tau']:g} | fine-tuned (warm) | model only (GBDT2NN) | cold start | cold model, warm "
            f"featurizers | fine-tuned from tau {ex} | oracle |", "|---|" + "---:|" * 9]
    for r in res:
        rows.append(f"| {r['dataset']} / {r['pipeline']} | {r['auc_original']:.4f} | {r['auc_translated_exact']:.4f} "
                    f"({r['decisions_equal_exact']:.1%}) | {r['auc_translated']:.4f} | **{r['auc_finetuned']:.4f}** | "
                    f"{r['auc_model_scope']:.4f} | {r['auc_cold']:.4f} | {r['auc_cold_model']:.4f} | "
                    f"{r['auc_finetuned_exact']:.4f} | "
                    + (f"{r['auc_oracle']:.4f} |" if "auc_oracle" in r else "n/a |"))
    syn = [r for r in res if r["dataset"] == "synthetic"]
    trees = [r for r in syn if r["pipeline"] != "logistic"]
    logi = [r for r in syn if r["pipeline"] == "logistic"]
    p53, p54, p55 = paper["table_5_3_range"], paper["table_5_4"], list(paper["table_5_5"].values())
    p54g = [v["gbdt2nn_over_ml"] for v in p54.values()]
    g_trees = [r["gain_finetuned"] for r in trees]
    g_scope = [r["gain_model_scope"] for r in trees]
    g_cold = [r["gain_warm_over_cold"] for r in trees]
    g_cold_m = [r["gain_warm_over_cold_model"] for r in trees]
    cmp = ["| relative AUC gain (synthetic data) | this project | paper |", "|---|---:|---:|",
           f"| fine-tuned over the pipeline, GBDT pipelines (Pipe2) | {_span(g_trees)} | "
           f"{_span(p53['pipe2'])} (Table 5.3) |"]
    if logi:
        cmp.append(f"| fine-tuned over the pipeline, logistic pipeline (Pipe1) | "
                   f"{_span([r['gain_finetuned'] for r in logi])} | {_span(p53['pipe1'])} (Table 5.3) |")
    cmp += [f"| model blocks only (GBDT2NN) over the pipeline | {_span(g_scope)} | {_span(p54g)} (Table 5.4) |",
            f"| warm start over cold start | {_span(g_cold)} | {_span(p55)} (Table 5.5) |",
            f"| warm start over a cold model behind translated featurizers | {_span(g_cold_m)} | |"]
    train_rows = syn[0]["rows"]["train"] if syn else res[0]["rows"]["train"]
    notes = [
        f"Fine-tuning the GBDT pipelines changes test AUC by {_span(g_trees)}, {_versus(g_trees, p53['pipe2'])} "
        f"the paper's {_span(p53['pipe2'])} for Pipe2. The data differ in kind and size: ours are "
        f"{train_rows:,} synthetic training rows whose label has smooth effects and interactions that "
        f"depth-3 trees approximate in steps (the oracle AUC, {s['auc_oracle']:.4f}, is the ceiling), the "
        "paper's 14-41M real rows of Flight, Avazu and Criteo; how much fine-tuning gains depends on how much "
        "the pipeline leaves below that ceiling.",
    ]
    if logi:
        lg = logi[0]
        notes.append(
            f"The logistic pipeline changes by {_pct(lg['gain_finetuned'])}, "
            f"{_versus([lg['gain_finetuned']], p53['pipe1'])} the paper's Pipe1 ({_span(p53['pipe1'])}): behind "
            "one-hot codes, the translated embedding followed by the linear layer is still a linear function of "
            "the one-hot vector, so joint training adds no capacity there; only the soft bin edges add some. What "
            f"tau = {st['tau']:g} changes is the starting point: each bin edge spreads over about a bin, which "
            f"moves its AUC from {lg['auc_original']:.4f} to {lg['auc_translated']:.4f} before fine-tuning, and "
            f"fine-tuning ends at {lg['auc_finetuned']:.4f}; started from exact bins (tau = {ex}) it ends at "
            f"{lg['auc_finetuned_exact']:.4f}. The paper's Pipe1 used binary and two-hot encoders, whose "
            "collisions the embedding tables undo, on millions of categories.")
    h = next(r for r in res if f"{r['dataset']}/{r['pipeline']}" == s["headline"])
    notes.append(
        f"Before fine-tuning, the network translated at the paper's tau = {st['tau']:g} scores "
        f"{h['auc_translated']:.4f} against the pipeline's {h['auc_original']:.4f}: the smoothing blends "
        "neighbouring leaves (a leaf whose path misses by one split still weighs (1 + tanh(-1)) / 2 = 0.12). "
        f"At tau = {ex} the network is the pipeline ({h['auc_translated_exact']:.4f}, "
        f"{h['decisions_equal_exact']:.1%} of test decisions equal), but fine-tuned from there it reaches only "
        f"{h['auc_finetuned_exact']:.4f} (against {h['auc_finetuned']:.4f} from tau = {st['tau']:g}): steep "
        "splits pass almost no gradient, so little but the leaf values can move. The paper does not report the "
        "translated network's AUC before fine-tuning; its tau = 1 is what makes fine-tuning work here too.")
    order = all(r["auc_original"] <= r["auc_model_scope"] <= r["auc_finetuned"] for r in trees)
    n_cat = sum(CARDINALITIES)
    notes.append(
        f"Training only the model's blocks changes AUC by {_span(g_scope)} where joint training gives "
        f"{_span(g_trees)} (the paper's GBDT2NN: {_span(p54g)}): "
        + ("the paper's ordering, pipeline < GBDT2NN < WindTunnel, holds. " if order else
           "the paper's ordering, pipeline < GBDT2NN < WindTunnel, does **not** hold in every case. ")
        + "Our featurizers are a scaler, which the trees' trainable first layer can absorb anyway, and one-hot "
        f"codes of {n_cat} categories; the paper's gap between the two comes from encoders of high-cardinality "
        "columns (Criteo: 30.8M categories), where learning the embeddings matters most.")
    cold_below = all(r["auc_cold"] < r["auc_original"] for r in trees)
    notes.append(
        f"Warm start beats cold start by {_span(g_cold)} ({_versus(g_cold, p55)} the paper's {_span(p55)})"
        + (", and our cold network stays below the pipeline while the paper's cold start beat it" if cold_below
           else "")
        + ": the cold network starts from unscaled columns (the scaler's statistics are parameters, redrawn as a "
        f"normalisation layer's identity) and learns from {train_rows:,} rows within {st['max_epochs']} epochs, "
        "where the paper's had 41M rows and ran to convergence; the smaller the data, the more the translated "
        f"prior is worth. With the translated featurizers kept and only the model random, warm start still wins "
        f"by {_span(g_cold_m)}."
        + (" Cold networks of the same shape coincide (same seed, nothing of the fitted trees left): "
           + ", ".join(f"{r['pipeline']}" for r in trees if [q["auc_cold"] for q in trees].count(r["auc_cold"]) > 1)
           + " share their cold AUC." if len({r["auc_cold"] for r in trees}) < len(trees) else ""))
    if any(r["dataset"] == "breast_cancer" for r in res):
        bc = [r for r in res if r["dataset"] == "breast_cancer"]
        failed = [r for r in bc if r["auc_cold"] < 0.5]
        notes.append(
            f"On breast_cancer ({bc[0]['rows']['test']} test rows, AUC near 1), every difference is within "
            "what another split of the data would change"
            + ("; except that the cold start of the " + ", ".join(r["pipeline"] for r in failed)
               + " pipeline fails outright (AUC " + ", ".join(f"{r['auc_cold']:.2f}" for r in failed)
               + f"): raw columns in the thousands into a random layer, {bc[0]['rows']['train']} training rows, "
               f"{st['max_epochs']} epochs at most." if failed else "."))
    b = sv["batch"]
    g1, gb, c1, cb = sv["gpu_batch1"], sv[f"gpu_batch{b}"], sv["cpu_batch1"], sv[f"cpu_batch{b}"]
    serve = ["| serving the headline network | network, simulated T4 | pipeline `predict_proba`, this CPU | ratio |",
             "|---|---:|---:|---:|",
             f"| one row, latency | {g1['latency_ms']:.3f} ms | {c1['latency_ms']:.2f} ms | "
             f"{sv['latency_ratio_cpu_over_gpu_batch1']:.1f}x |",
             f"| batches of {b}, rows/s | {gb['rows_per_s']:,.0f} | {cb['rows_per_s']:,.0f} | "
             f"{sv['throughput_ratio_gpu_over_cpu']:.1f}x |"]
    err = max(g1["bundle_cpu_build_max_abs_error"], gb["bundle_cpu_build_max_abs_error"])
    serve_note = (
        f"The network compiles to {gb['kernels']} kernels ({gb['launches']} launches per request at batch {b}); "
        f"the bundles' CPU builds match torch within {err:.1e}. The GPU figures are the simulator's cost model "
        "in virtual time (one request alone; a saturating lognormal stream through the dispatcher, its CPU not "
        "charged), not a measurement, and the simulator's cost model misses its calibration goal against "
        "the Paella paper's Table 2 (Calibration, above); the CPU figures are medians measured on this shared 2-core machine, where scikit-learn's "
        "per-call input checks and the ColumnTransformer dominate a one-row call. The WindTunnel chapter "
        "reports no serving figures to compare with; `tests/service/test_service_windtunnel.py` checks that "
        "the real daemon's answers equal the framework's.")
    out = [
        f"Pipelines fitted on 60% of each dataset, translated (tau = {st['tau']:g}, the paper's; GBDT level "
        f"L{st['level']}), fine-tuned with {st['optimizer']}, dropout {st['dropout']:g}, early stopping on "
        f"the validation 20% (patience {st['patience']}, at most {st['max_epochs']} epochs); test AUC on the last "
        f"20%. Synthetic data: {st['rows_synthetic']:,} rows with a known structure (`paella.windtunnel.data`); "
        f"GBDTs of {st['trees']} trees of depth 3 (LightGBM: 8 leaves)."
        + (" A `--quick` run." if st.get("quick") else ""),
        "", *rows, "", *cmp, ""]
    for n in notes:
        out += [n, ""]
    return out + [*serve, "", serve_note]
