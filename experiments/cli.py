"""``paella experiment NAME``: each experiment module registers one sub-command."""
from __future__ import annotations

import argparse
import importlib
import math
import os
from typing import Any

#: Experiment modules; each exposes ``register(subparsers)``.
EXPERIMENTS = [
    "paella.experiments.hol",
    "paella.experiments.short_long",
    "paella.experiments.priority",
    "paella.experiments.mix",
    "paella.experiments.fairness",
    "paella.experiments.calibrate",
    "paella.experiments.fidelity",
    "paella.experiments.sched_delay",
    "paella.experiments.overhead",
    "paella.experiments.windtunnel",
    "paella.experiments.nimble",
    "paella.experiments.cellular",
    "paella.experiments.orca",
    "paella.experiments.turbo",
    "paella.experiments.report",
    "paella.experiments.batching",
    "paella.experiments.dvabatch",
    "paella.experiments.timelines",
    "paella.experiments.cluster",
]


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("experiment", help="reproduce a figure of the paper on the simulated GPU")
    esub = p.add_subparsers(dest="experiment", metavar="NAME", required=True)
    for mod in EXPERIMENTS:
        importlib.import_module(mod).register(esub)
    for parser in esub.choices.values():
        func = parser.get_default("func")
        if func is not None:
            parser.add_argument("--trace", metavar="FILE.json",
                                help="also write a kernel-level trace of the run's first "
                                     "dispatchers (Trace Event format: Perfetto, "
                                     "chrome://tracing)")
            parser.add_argument("--trace-runs", type=int, default=2, metavar="N",
                                help="with --trace: how many of the run's dispatchers to "
                                     "trace, in the order it makes them (default 2)")
            parser.set_defaults(func=_checked(parser, _traced(func)))


def _traced(func):
    """``func`` with ``--trace``: the first ``--trace-runs`` dispatchers the run makes (in
    this process) traced, into one file at the end (dispatcher/trace.py)."""
    def run(args: argparse.Namespace):
        if not getattr(args, "trace", None):
            return func(args)
        import sys
        from paella.dispatcher.trace import trace_every_dispatcher
        traced: list = []
        try:
            with trace_every_dispatcher(args.trace, args.trace_runs,
                                        f"paella experiment {args.experiment}") as traced:
                return func(args)
        finally:
            print(f"trace: {args.trace}: {len(traced)} dispatcher run(s)"
                  + ("" if traced else ": this experiment made no dispatcher in this process "
                                       "(a real daemon's: use `paella trace`)"),
                  file=sys.stderr)
    return run


#: Numeric options where 0 means something whatever their default: ``--cpu-scale 0`` is a
#: free dispatcher in every experiment (cellular's default, 1, charges its measured CPU).
ZERO_MEANS_SOMETHING = {"cpu_scale"}


def _checked(parser: argparse.ArgumentParser, func):
    """``func`` behind a check of the numeric options (every experiment's): finite, not
    negative, and positive where the default is (counts, rates, SLOs), so a bad value is
    a ``paella: error:`` naming the option rather than a traceback from deep inside."""
    def run(args: argparse.Namespace):
        from paella.cli import CLIError
        for a in parser._actions:
            v = getattr(args, a.dest, None)
            if a.dest == "seed" or type(v) not in (int, float):
                continue
            d = a.default
            floor_ok = a.dest in ZERO_MEANS_SOMETHING or (
                isinstance(d, (int, float)) and not isinstance(d, bool) and d == 0)
            if not (math.isfinite(v) and (v >= 0 if floor_ok else v > 0)):
                raise CLIError(f"{a.option_strings[0]} must be a finite number "
                               f"{'>= 0' if floor_ok else '> 0'}, got {v}")
        for opt in ("json", "plot", "trace"):   # before the run, not after minutes of it
            out = getattr(args, opt, None)
            if isinstance(out, str) and out:
                folder = os.path.dirname(os.path.abspath(out))
                if not os.path.isdir(folder) or not os.access(folder, os.W_OK):
                    raise CLIError(f"--{opt} {out}: cannot write into {folder} (no such "
                                   f"directory, or not writable)")
                if os.path.exists(out) and not os.path.isfile(out):
                    raise CLIError(f"--{opt} {out}: not a regular file (a directory or a "
                                   f"device such as /dev/full); name a file to write")
        return func(args)
    return run


def add_common(p: argparse.ArgumentParser) -> None:
    """Options every experiment takes."""
    p.add_argument("--json", metavar="FILE", help="write the results as JSON")
    p.add_argument("--plot", metavar="FILE.png", help="write a plot")
    p.add_argument("--quick", action="store_true", help="a reduced sweep that finishes in minutes")
    p.add_argument("--seed", type=int, default=1, help="random seed (default 1)")


def add_cpu_scale(p: argparse.ArgumentParser) -> None:
    """``--cpu-scale``, default 0 (a free dispatcher), for experiments through the dispatcher."""
    p.add_argument("--cpu-scale", type=float, default=0.0,
                   help="multiplier on the dispatcher CPU time charged to the clock (default 0: "
                        "a free dispatcher; 1 charges this dispatcher in full)")


def add_zoo_dir(p: argparse.ArgumentParser) -> None:
    """``--zoo-dir``, for experiments on the compiled zoo (missing bundles are compiled)."""
    from paella.bundle import DEFAULT_ZOO_DIR
    p.add_argument("--zoo-dir", default=str(DEFAULT_ZOO_DIR),
                   help=f"where the compiled zoo lives (default {DEFAULT_ZOO_DIR})")


def finish(data: dict, args: argparse.Namespace, plot, t0: float) -> int:
    """End an experiment: record its running time since ``t0`` (``time.perf_counter``),
    write ``--json``/``--plot``, say how long it took. Returns the exit status."""
    import sys
    import time
    data["wall_seconds"] = time.perf_counter() - t0
    save_outputs(data, args, plot)
    print(f"done in {data['wall_seconds']:.1f} s", file=sys.stderr)
    return 0


def strict_json(value: Any) -> Any:
    """``value`` with every NaN or infinite float replaced by None, so the file is JSON
    that strict parsers read (``json.dump`` writes bare ``NaN`` and ``Infinity``): a
    statistic of a class that got no request after warm-up, a ratio of two zeros."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: strict_json(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [strict_json(v) for v in value]
    return value


def save_outputs(data: dict, args: argparse.Namespace, plot) -> None:
    """Write ``--json`` and ``--plot`` when asked (every experiment ends this way)."""
    import json
    if args.json:
        with open(args.json, "w") as f:
            json.dump(strict_json(data), f, indent=1, allow_nan=False)
    if args.plot:
        plot(data, args.plot)


def save_figure(fig, path: str, dpi: int = 90) -> None:
    """Lay out, write and close a matplotlib figure (plots are committed small)."""
    import matplotlib.pyplot as plt
    fig.tight_layout()
    fig.savefig(path, dpi=dpi)
    plt.close(fig)
