"""``paella experiment timelines``: the schedules behind Figures 1 and 2, drawn.

Each scenario runs through the real dispatcher in virtual time with a
:class:`~paella.dispatcher.trace.TraceRecorder` installed, writes its trace (the Trace
Event JSON that Perfetto opens: ``--trace-dir``) and draws the GPU's streams as a
timeline, so a reader of docs/EXPERIMENTS.md sees the schedule without opening a tool:

* **Figure 1** (the paper's toy): four tasks of three kernels, each kernel filling one
  of two SMs for 1 ms, all submitted at 0. Under ``paella`` (SRPT with the +B rule)
  tasks finish at 3, 3, 6, 6 ms... rather than all near the end; under ``ms-jbj`` (naive
  multi-stream: every task's kernels at once on its own stream, the hardware
  interleaving them) every task finishes late.
* **Figure 2** (head-of-line blocking): the Figure 2 job (8 dependent one-block kernels
  of 300 us) on the GTX 1660 SUPER at 30k jobs/s; a 3 ms stretch under ``paella`` and
  under ``ms-jbj``, whose 32 hardware queues hold each job's whole chain.

* **Priorities** (``paella experiment priority``, issue 38): ResNet-18 (urgent, red)
  beside ResNet-50 at batch 8 (best effort, blue), a 12 ms stretch, under ``paella``
  with classes and kernel slicing and under ``paella`` without classes.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

import numpy as np

from paella.dispatcher.adaptor import PlanAdaptor, synthetic_plan
from paella.dispatcher.core import Dispatcher, Request
from paella.dispatcher.devices.sim import SimDevice
from paella.dispatcher.trace import TraceRecorder, write_trace
from paella.dispatcher.virtual_time import VirtualDriver
from paella.experiments.cli import add_common, add_zoo_dir
from paella.experiments.workload import lognormal_arrivals
from paella.gpus import preset

MS = 1e-3
#: Two SMs of a GTX 1660 SUPER: a 1024-thread block fills one.
TWO_SMS = preset("gtx1660s").with_(name="two-sm", sm_count=2)
POLICIES = ("paella", "ms-jbj")
PRIORITY_MECHANISMS = ("paella-classes", "paella")


def _traced(d: Dispatcher, arrivals: list[float], models: list[int],
            io_bytes: int) -> tuple[TraceRecorder, dict[int, float]]:
    """Run ``d`` over ``arrivals`` (request i of model ``models[i % len]``), traced; each
    request's latency (seconds)."""
    rec = TraceRecorder(d).start()
    done: dict[int, float] = {}
    t0 = d.device.now()

    def submit(due: range) -> None:
        for i in due:
            d.submit(Request(i, i % 4, models[i % len(models)], np.zeros(io_bytes, np.uint8),
                             on_complete=lambda r, s, e: done.setdefault(
                                 r.req_id, r.t_done - r.t_submit)))
    VirtualDriver(d, name="timelines").run([t0 + a for a in arrivals], submit)
    rec.stop()
    return rec, done


def figure1(policy: str) -> tuple[TraceRecorder, dict[int, float]]:
    """The paper's Figure 1 toy under ``policy``."""
    dev = SimDevice(TWO_SMS, n_streams=8, seed=0)
    d = Dispatcher(dev, policy, profile_runs=1)
    models = []
    for t in range(4):
        plan = synthetic_plan(f"task{t}", [(f"t{t}_k{i}", 1, 1024, 32, MS) for i in range(3)],
                              in_bytes=0, out_bytes=0)
        models.append(d.register_model(f"task{t}", PlanAdaptor(plan)))
    return _traced(d, [0.0] * 4, models, 1)


def priority_stretch(mechanism: str, bundles: dict, n_hp: int,
                     seed: int = 1) -> tuple[TraceRecorder, dict]:
    """The priority experiment's ``mechanism`` (its own run, ``n_hp`` urgent requests),
    traced: the recorder sits in the dispatcher the run makes."""
    from paella.dispatcher.instruments import instrument_every_dispatcher
    from paella.experiments import priority as P
    recs: list[TraceRecorder] = []

    def make(d: Dispatcher) -> TraceRecorder | None:
        if recs:
            return None
        recs.append(TraceRecorder(d))
        return recs[0]
    with instrument_every_dispatcher(make):
        pt = P.run_mechanism(mechanism, bundles, hp_rate=1 / 3 / P.isolated_seconds(bundles["hp"]),
                             n_hp=n_hp, sigma=1.0, be_depth=2, seed=seed, slice_us=100.0,
                             cpu_scale=0.0)
    recs[0].stop()
    return recs[0], pt


def figure2(policy: str, rate: float = 30e3, jobs: int = 400,
            seed: int = 1) -> tuple[TraceRecorder, dict[int, float]]:
    """The Figure 2 job at ``rate`` jobs/s under ``policy``."""
    from paella.experiments.harness import adaptor_for
    from paella.models.synthetic import figure2_job
    from paella.experiments.harness import DEFAULT_STREAMS
    dev = SimDevice("gtx1660s", n_streams=DEFAULT_STREAMS, seed=seed)
    d = Dispatcher(dev, policy, profile_runs=1)
    mid = d.register_model("fig2", adaptor_for(figure2_job(), 64, 64)())
    arrivals = list(lognormal_arrivals(rate, 1.5, jobs, seed))
    return _traced(d, arrivals, [mid], d.models[mid].adaptor.io_bytes)


# -- drawing ------------------------------------------------------------------------------
def draw(ax: Any, events: list[dict], title: str, t0_us: float = 0.0,
         t1_us: float | None = None, rows: str = "stream", max_rows: int = 40,
         colors: dict[str, str] | None = None, running: bool = False) -> None:
    """The GPU's kernels between ``t0_us`` and ``t1_us`` (microseconds from the first
    kernel), coloured by job, or by model (``colors``: model name -> colour; a sliced
    twin, "NAME (sliced)", is its model's): one row per stream that ran any
    (``rows="stream"``), or one row per job (``"job"``: the first ``max_rows`` jobs
    admitted in the window, each over a grey bar from its request's admission to its
    answer: grey alone is waiting; ``running``: also the jobs admitted before and still
    unanswered at ``t0_us``)."""
    kernels = [e for e in events if e.get("cat") == "kernel"]
    if not kernels:
        ax.set_title(title + " (no kernels)", fontsize=8)
        return
    base = min(e["ts"] for e in kernels)
    t1_us = max(e["ts"] + e["dur"] for e in kernels) - base if t1_us is None else t1_us
    key = (lambda e: e["tid"]) if rows == "stream" else (lambda e: e["args"]["job"])
    if rows == "stream":
        keys = sorted({key(e) for e in kernels})
    else:                             # the jobs admitted first in the window
        admitted = {e["args"]["job"]: e for e in events
                    if e.get("cat") == "request" and e["args"]["job"] is not None}
        shown = {k for k, r in admitted.items()
                 if t0_us <= r["ts"] - base <= t1_us
                 or running and r["ts"] - base < t0_us <= r["ts"] + r["dur"] - base}
        keys = sorted(shown, key=lambda k: admitted[k]["ts"])[:max_rows]
    row = {k: i for i, k in enumerate(keys)}
    cmap = _colormap()
    if rows == "job":                 # each job's request, admission to answer, in grey
        for k in keys:
            r = admitted[k]
            ax.broken_barh([((r["ts"] - base) / 1e3, r["dur"] / 1e3)], (row[k] - 0.15, 0.3),
                           facecolors="0.8", edgecolors="none")
    for e in kernels:
        a = e["ts"] - base
        if key(e) not in row or a + e["dur"] < t0_us or a > t1_us:
            continue
        face = (cmap(e["args"]["job"] % 20) if colors is None else
                colors.get(e["args"]["model"].split(" (")[0], "0.5"))
        ax.broken_barh([(a / 1e3, max(e["dur"], 1.0) / 1e3)], (row[key(e)] - 0.4, 0.8),
                       facecolors=face, edgecolors="black", linewidth=0.3)
    ax.set_xlim(t0_us / 1e3, t1_us / 1e3)
    ax.set_ylim(-0.6, len(keys) - 0.4)
    if rows == "stream":
        ax.set_yticks(range(len(keys)))
        ax.set_yticklabels([f"stream {k}" for k in keys], fontsize=7)
    else:
        ax.set_yticks([])
        ax.set_ylabel(f"{len(keys)} jobs", fontsize=7)
    ax.set_xlabel("ms", fontsize=7)
    ax.tick_params(axis="x", labelsize=7)
    ax.set_title(title, fontsize=8)


def _colormap():
    import matplotlib
    return matplotlib.colormaps["tab20"]


def _served_window(events: list[dict], after_us: float = 5000.0,
                   span_us: float = 12000.0) -> tuple[float, float]:
    """A window ``after_us`` into the served requests (the profiling runs come first),
    as :func:`draw` takes it: microseconds from the first kernel."""
    base = min(e["ts"] for e in events if e.get("cat") == "kernel")
    start = min(e["ts"] for e in events if e.get("cat") == "request" and e["args"]["request"] >= 0)
    t0 = start - base + after_us
    return t0, t0 + span_us


def render(path: str, panels: list[tuple[list[dict], str, float, float | None]],
           rows: str = "stream", colors: dict[str, str] | None = None,
           running: bool = False) -> None:
    """One figure, a row per panel: (events, title, t0_us, t1_us)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    heights = [max(1.2, 0.18 * len({e["tid"] for e in ev if e.get("cat") == "kernel"}) + 0.8)
               if rows == "stream" else 3.0 for ev, *_ in panels]
    fig, axes = plt.subplots(len(panels), 1, figsize=(7.5, sum(heights) + 0.4),
                             gridspec_kw={"height_ratios": heights}, squeeze=False)
    for ax, (events, title, t0, t1) in zip(axes[:, 0], panels):
        draw(ax, events, title, t0, t1, rows, colors=colors, running=running)
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)


# -- the command ----------------------------------------------------------------------------
def run(args: argparse.Namespace) -> dict:
    out: dict = {"figure1": {}, "figure2": {}}
    traces: dict[str, list[dict]] = {}
    for policy in POLICIES:
        rec, done = figure1(policy)
        out["figure1"][policy] = {"completion_ms": [round(done[t] / MS, 3) for t in range(4)],
                                  "mean_ms": round(float(np.mean(list(done.values()))) / MS, 3)}
        traces[f"figure1_{policy}"] = rec.events()
        rec2, done2 = figure2(policy, jobs=150 if args.quick else 400, seed=args.seed)
        lat = np.array(sorted(done2.values())) / MS
        out["figure2"][policy] = {"jobs": len(lat), "p50_ms": round(float(np.median(lat)), 3),
                                  "p99_ms": round(float(np.percentile(lat, 99)), 3)}
        traces[f"figure2_{policy}"] = rec2.events()
        if args.trace_dir:
            for name, r in ((f"figure1_{policy}", rec), (f"figure2_{policy}", rec2)):
                with open(os.path.join(args.trace_dir, f"timeline_{name}.json"), "w") as f:
                    write_trace(f, r, scenario=name)
    from paella.experiments import priority as P
    bundles = P.compile_models(args.zoo_dir, progress=lambda m: print(m, file=sys.stderr))
    out["priority"] = {}
    for mech in PRIORITY_MECHANISMS:
        rec, pt = priority_stretch(mech, bundles, 60 if args.quick else 150, args.seed)
        out["priority"][mech] = {"hp_p50_ms": round(pt["hp"]["p50_ms"], 3),
                                 "hp_p99_ms": round(pt["hp"]["p99_ms"], 3),
                                 "be_throughput": round(pt["be_throughput"], 1)}
        traces[f"priority_{mech}"] = rec.events()
        if args.trace_dir:
            with open(os.path.join(args.trace_dir, f"timeline_priority_{mech}.json"), "w") as f:
                write_trace(f, rec, scenario=f"priority_{mech}")
    out["traces"] = {k: len(v) for k, v in traces.items()}
    if args.plot:
        stem, ext = os.path.splitext(args.plot)
        render(args.plot, [(traces[f"figure1_{p}"], f"Figure 1 toy under {p}: tasks finish "
                            f"at {', '.join(f'{x:g}' for x in out['figure1'][p]['completion_ms'])}"
                            f" ms", 0.0, None) for p in POLICIES])
        render(f"{stem}_hol{ext or '.png'}",
               [(traces[f"figure2_{p}"], f"Figure 2 jobs at 30k jobs/s under {p}: a row "
                 f"per job, admission to answer in grey, its kernels in colour; p99 "
                 f"{out['figure2'][p]['p99_ms']:g} ms", 4000.0, 16000.0) for p in POLICIES],
               rows="job")
        render(f"{stem}_priority{ext or '.png'}",
               [(traces[f"priority_{m}"], f"priority under {m}: ResNet-18 (urgent) in red, "
                 f"ResNet-50 b8 (best effort) in blue; a row per job; ResNet-18 p99 "
                 f"{out['priority'][m]['hp_p99_ms']:g} ms", *_served_window(traces[f"priority_{m}"]))
                for m in PRIORITY_MECHANISMS], rows="job",
               colors={"hp": "tab:red", "be": "tab:blue"}, running=True)
    return out


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("timelines", help="the schedules of Figures 1 and 2, drawn from traces",
                       description=__doc__.split("\n\n")[0])
    add_common(p)
    add_zoo_dir(p)
    p.add_argument("--trace-dir", metavar="DIR",
                   help="also write each scenario's trace (Trace Event JSON) into DIR")
    p.set_defaults(func=_main)


def _main(args: argparse.Namespace) -> int:
    from paella.cli import CLIError
    if args.trace_dir and not os.path.isdir(args.trace_dir):
        raise CLIError(f"--trace-dir {args.trace_dir}: no such directory")
    t0 = time.perf_counter()
    out = run(args)
    out["wall_seconds"] = time.perf_counter() - t0
    text = json.dumps(out, indent=1)
    if args.json:
        with open(args.json, "w") as f:
            f.write(text + "\n")
    print(text)
    return 0
